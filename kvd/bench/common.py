"""What every scenario shares: statistics, the daemons, simulated engines, waiting for events."""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import platform
import secrets
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from kvd_client import wire
from kvd_client.client import Event, KvdClient
from kvd_client.errors import Busy
from kvd_client.shm import SharedRegion, staging_name

from kvd.core.planner import Geometry

Progress = Callable[[str], None]
"""Called with a short description after each step of a scenario."""


class BenchError(RuntimeError):
    """A contender failed (wrong bytes, a failure event, a timeout): the run is invalid."""


# ------------------------------------------------------------------ statistics


def pct(xs: Sequence[float], q: float) -> float:
    """The q-quantile (nearest rank) of xs; 0.0 for no samples."""
    if not xs:
        return 0.0
    s = sorted(xs)
    return float(s[min(len(s) - 1, max(0, math.ceil(q * len(s)) - 1))])


def median(xs: Sequence[float]) -> float:
    if not xs:
        return 0.0
    return float(np.median(np.asarray(xs, dtype=np.float64)))


CDF_POINTS = 200
"""Most points of a latency sample's distribution kept in the JSON (for `--plot`)."""


def summary_ms(seconds: Sequence[float], *, cdf: bool = False) -> dict[str, Any]:
    """p50/p99/p99.9/max of a latency sample, in milliseconds; with `cdf`, also the
    sorted sample thinned to at most CDF_POINTS evenly spaced ranks (first and last kept),
    from which `kvd bench --plot` draws its distribution."""
    ms = [s * 1e3 for s in seconds]
    out: dict[str, Any] = {
        "n": len(ms),
        "p50_ms": round(pct(ms, 0.50), 4),
        "p99_ms": round(pct(ms, 0.99), 4),
        "p999_ms": round(pct(ms, 0.999), 4),
        "max_ms": round(max(ms), 4) if ms else 0.0,
        "mean_ms": round(sum(ms) / len(ms), 4) if ms else 0.0,
    }
    if cdf:
        out["cdf_ms"] = cdf_points(ms)
    return out


def cdf_points(xs: Sequence[float], points: int = CDF_POINTS) -> list[float]:
    """xs sorted, thinned to at most `points` evenly spaced ranks (min and max kept)."""
    s = sorted(xs)
    if len(s) <= points:
        return [round(x, 4) for x in s]
    step = (len(s) - 1) / (points - 1)
    return [round(s[round(i * step)], 4) for i in range(points)]


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    mem = 0
    with contextlib.suppress(ValueError, OSError):
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = 0.0
    return {
        "cpus": os.cpu_count() or 0,
        "cpu_model": cpu,
        "mem_gib": round(mem / 2**30, 1),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "gpu": False,
        "transport": "UCX, same host: RMA over cma, notifications over tcp/lo",
        "load_avg_1m_at_start": round(load, 2),
    }


# ------------------------------------------------------------------ simulated engines

_ids = itertools.count(1)


def new_id(prefix: str) -> str:
    """A request id unique in this run (with a random part, like vLLM's)."""
    return f"{prefix}-{next(_ids)}-{secrets.token_hex(4)}"


def geometry(base: int, nbytes: int, lay: wire.RegionLayout) -> Geometry:
    return Geometry.from_layout(base, nbytes, lay)


@dataclass
class Side:
    """One engine on one daemon: a shared-memory KV region and a scheduler client."""

    engine_id: str
    client: KvdClient
    region: SharedRegion
    layout: wire.RegionLayout
    arr: np.ndarray
    chunks: np.ndarray
    """The region as (block, layer, part, byte): `chunks[blocks]` gathers their bytes."""
    stash: list[Event] = field(default_factory=list)

    @property
    def addr(self) -> int:
        return int(self.arr.ctypes.data)

    @property
    def block_bytes(self) -> int:
        lay = self.layout
        return lay.num_layers * lay.kv_parts * lay.chunk_bytes

    def geometry(self, base: int | None = None) -> Geometry:
        return geometry(self.addr if base is None else base, self.region.nbytes, self.layout)

    def close(self) -> None:
        self.client.close()
        del self.chunks
        del self.arr
        self.region.close()


def make_side(socket: str, engine_id: str, lay: wire.RegionLayout, nbytes: int) -> Side:
    client = KvdClient(socket, role="scheduler", engine_id=engine_id)
    client.connect()
    try:
        region = SharedRegion(staging_name(f"bench-{engine_id}"), nbytes)
    except BaseException:
        client.close()
        raise
    arr = np.frombuffer(region.buf, dtype=np.uint8)
    chunks = np.lib.stride_tricks.as_strided(
        arr,
        shape=(lay.num_blocks, lay.num_layers, lay.kv_parts, lay.chunk_bytes),
        strides=(lay.block_stride, lay.layer_stride, lay.kv_stride, 1),
        writeable=True,
    )
    side = Side(engine_id, client, region, lay, arr, chunks)
    try:
        arr[:] = 0  # fault every page in now, not during a timed transfer
        client.register_region(region, layout=lay, tp_rank=0, tp_size=1, compat="kvd-bench")
    except BaseException:
        side.close()
        raise
    return side


def fill_pattern(side: Side, seed: int) -> None:
    """Distinct bytes everywhere, cheaply: a random pattern whose odd period (1 MiB + 4093)
    makes every chunk-aligned piece of the region differ from every other."""
    rng = np.random.default_rng(seed)
    page = rng.integers(0, 256, size=(1 << 20) + 4093, dtype=np.uint8)
    arr = side.arr
    n = arr.shape[0]
    for off in range(0, n, len(page)):
        end = min(n, off + len(page))
        arr[off:end] = page[: end - off]


# ------------------------------------------------------------------ events


@dataclass(frozen=True)
class Timed:
    """One request timed by the client: its two ids and the client's times, in monotonic
    ns (CLOCK_MONOTONIC, shared with the daemons' stage traces)."""

    p_id: str
    d_id: str
    call: int
    """D's `register_push` / `pull` called."""
    sent: int
    """The call returned (the request is on its way to the daemon)."""
    event: int
    """D's client has the terminal event."""

    @property
    def seconds(self) -> float:
        return (self.event - self.call) / 1e9


def wait_for(
    client: KvdClient, request_id: str, stash: list[Event], timeout: float = 60.0
) -> Event:
    """Block until `client` has the terminal event of `request_id`; others go to `stash`."""
    for i, ev in enumerate(stash):
        if event_id(ev) == request_id:
            return stash.pop(i)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise BenchError(f"{client.engine_id}: no event for {request_id} within {timeout}s")
        found: Event | None = None
        for ev in client.wait_events(left):
            if found is None and event_id(ev) == request_id:
                found = ev
            else:
                stash.append(ev)
        if found is not None:
            return found


def event_id(ev: Event) -> str:
    """The request id (or encoder hash) an event is about."""
    if isinstance(ev, (wire.ECReady, wire.ECUnavailable)):
        return ev.mm_hash
    return ev.request_id


def expect_ok(ev: Event, what: str) -> None:
    if not isinstance(ev, (wire.RecvFinished, wire.SendFinished, wire.ECReady)):
        reason = getattr(ev, "reason", "")
        raise BenchError(f"{what}: {type(ev).__name__} {reason}")


def status(cli: KvdClient, section: str = "status", timeout: float = 30.0) -> dict[str, Any]:
    """`cli.status(section)`, retried while an actor's mailbox answers BUSY (by design,
    under a burst such as thousands of leases released at once)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return cli.status(section)
        except Busy:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.01)


def leases(env: Env) -> int:
    """Leases P holds right now."""
    return int(status(env.p_cli)["sender"]["leases"])


def wait_leases(env: Env, at_least: int, timeout: float = 60.0) -> None:
    """Until P holds `at_least` leases: D must not pull before P has finished (in a real
    deployment D learns P's blocks only from P's finished request)."""
    deadline = time.monotonic() + timeout
    while leases(env) < at_least:
        if time.monotonic() > deadline:
            raise BenchError(f"P did not grant {at_least} leases within {timeout}s")
        time.sleep(0.002)


def status_client(socket: str) -> KvdClient:
    c = KvdClient(socket, role="cli", timeout=30.0, keepalive_interval=1.0)
    c.connect()
    return c


# ------------------------------------------------------------------ the process tree


@dataclass
class Env:
    """Two kvd daemons (P with the EC producer, D with the EC consumer) and a raw-NIXL pair."""

    workdir: Path
    p_socket: str
    d_socket: str
    p_port: int
    quick: bool
    raw: Any
    """A RawInitiator (this process) talking to a RawPeerProcess (the helper)."""
    peer: Any
    p_cli: KvdClient
    d_cli: KvdClient
    p_pid: int = 0
    d_pid: int = 0
    dw_socket: str = ""
    """A second D daemon that pulls by P's WRITE (`transfer.pull_by = "write"`: what D does
    where UCX would emulate a READ); "" = none."""

    def transfers(self, side: str, request_id: str) -> dict[str, Any]:
        """The daemon's record of a finished transfer (descriptors, bytes, duration)."""
        cli = self.p_cli if side == "p" else self.d_cli
        for rec in reversed(status(cli, "transfers")["recent"]):
            if rec["request_id"] == request_id:
                return dict(rec)
        return {}
