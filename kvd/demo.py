"""`kvd demo`: a full local P/D pipeline with real daemons, real NIXL and real shared memory.

Two `kvd serve` processes (P and D) start with built-in configs in a temporary
directory. Two simulated engines use the real thin client: each owns a shared-memory
KV region; P fills each request's blocks with a deterministic per-request pattern. N
requests run in push mode and/or pull mode with random block counts, fragmented block
allocations and a random order of P-finish vs D-register; every byte is checked at D.
The same harness (`Cluster`, `Engine`, `run_mode`) drives the integration tests.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import numpy as np
from kvd_client import layout as kvlayout
from kvd_client import wire
from kvd_client.client import KvdClient
from kvd_client.errors import KvdError
from kvd_client.shm import SharedRegion, staging_name

# ------------------------------------------------------------------ daemons


@dataclass
class DaemonProc:
    name: str
    socket: str
    config: Path
    proc: subprocess.Popen[bytes]
    log: Path
    side_port: int = 0

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 10.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def report(self, limit: int = 3000) -> str:
        """What its log says about how it ended: `log_report`."""
        return log_report(self.log, limit)


def log_report(path: Path, limit: int = 3000) -> str:
    """The last `limit` characters of a daemon's log, with its crash report first when it
    crashed: UCX's native backtrace, if it printed one, and the crashing thread's Python
    stack (Python's fault handler dumps every thread, the crashing one, "Current
    thread", anywhere among them), which a plain tail would often cut off."""
    try:
        text = path.read_text(errors="replace")
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"
    tail = text[-limit:]
    parts: list[str] = []
    native = text.find("Caught signal")
    if native >= 0:
        end = text.find("=================================", native)
        # the frames without their libraries' directories (long, and the same)
        frames = re.sub(r"/[^\s(]*/", "", text[native : end if end > 0 else native + limit])
        parts.append(frames[:limit])
    at = text.find("Fatal Python error")
    if at >= 0:
        blocks = text[at:].split("\n\n")
        parts.append(blocks[0])
        parts += [b[:limit] for b in blocks if b.lstrip().startswith("Current thread")]
    if not parts:
        return tail
    return "\n\n".join([*parts, "[...]", tail])


def start_daemon(
    workdir: Path,
    name: str,
    extra: str = "",
    env: dict[str, str] | None = None,
    *,
    overrides: dict[str, dict[str, Any]] | None = None,
    prefix: Sequence[str] = (),
    ready_timeout: float = 30.0,
) -> DaemonProc:
    """Start `kvd serve` with a small config; returns once its socket answers (killed
    and RuntimeError after `ready_timeout` seconds).

    `overrides` replaces or adds keys of the sections written here ([daemon],
    [side_channel], [log]) or of new ones; `extra` is TOML appended as is. `prefix` is a
    command that execs the rest (e.g. `ip netns exec NS`, to run it in a network
    namespace): the process started is still the daemon.
    """
    sock = str(workdir / f"{name}.sock")
    cfg = workdir / f"{name}.toml"
    sections: dict[str, dict[str, Any]] = {
        "daemon": {"name": name, "socket": sock, "client_timeout": 5.0},
        "side_channel": {"port": 0},
        "log": {"format": "json", "level": "info"},
    }
    for section, values in (overrides or {}).items():
        sections.setdefault(section, {}).update(values)
    text = "".join(
        f"[{section}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in values.items())
        for section, values in sections.items()
    )
    cfg.write_text(text + extra)
    log = workdir / f"{name}.log"
    penv = dict(os.environ)
    penv.update(env or {})
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "kvd", "serve", "--config", str(cfg)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=penv,
        )
    d = DaemonProc(name, sock, cfg, proc, log)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"daemon {name} exited with {proc.returncode}:\n{log_report(log)}")
        if os.path.exists(sock):
            c = KvdClient(sock, role="cli", timeout=1.0, keepalive_interval=0)
            try:
                w = c.connect()
                d.side_port = w.side_port
                return d
            except KvdError:
                pass
            finally:
                c.close()
        time.sleep(0.05)
    d.kill()
    raise RuntimeError(f"daemon {name} did not become ready:\n{log_report(log)}")


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    return json.dumps(str(v))  # a JSON string is a valid TOML basic string


# ------------------------------------------------------------------ engines

DEMO_COMPAT: Final = "kvd-demo-simulated-model"
"""The compat every simulated engine declares by default: one simulated model, one KV
format (two regions exchange blocks only when their compat strings are equal)."""


_PATTERN_BASE = np.random.default_rng(2026).integers(0, 256, size=32 << 20, dtype=np.uint8)


def pattern(request_key: str, block_index: int, nbytes: int) -> np.ndarray:
    """The deterministic bytes P writes into the request's block `block_index`.

    A window of a fixed random buffer at an offset derived from (request, block), XORed
    with a per-block byte: distinct per request and block, and as cheap as a memcpy.
    """
    digest = hashlib.blake2b(f"{request_key}/{block_index}".encode(), digest_size=8).digest()
    h = int.from_bytes(digest, "little")
    if nbytes > len(_PATTERN_BASE):
        reps = -(-nbytes // len(_PATTERN_BASE))
        return np.tile(_PATTERN_BASE, reps)[:nbytes] ^ np.uint8(h % 255 + 1)
    start = h % (len(_PATTERN_BASE) - nbytes + 1)
    return _PATTERN_BASE[start : start + nbytes] ^ np.uint8((h >> 32) % 255 + 1)


@dataclass
class Engine:
    """A simulated engine: a KV region per TP rank in shared memory, a scheduler client,
    and (when `workers`) one worker client per rank that registers the rank's region."""

    name: str
    client: KvdClient
    regions: list[SharedRegion]
    layout: wire.RegionLayout
    free: list[int]
    workers: list[KvdClient] = field(default_factory=list)

    @property
    def block_bytes(self) -> int:
        return self.layout.block_stride

    def block(self, rank: int, b: int) -> np.ndarray:
        buf = np.frombuffer(self.regions[rank].buf, dtype=np.uint8)
        return buf[b * self.block_bytes : (b + 1) * self.block_bytes]

    def chunk(self, rank: int, b: int, layer: int, part: int) -> np.ndarray:
        """Block `b`'s bytes of one layer and K/V part (any layout)."""
        lay = self.layout
        at = b * lay.block_stride + layer * lay.layer_stride + part * lay.kv_stride
        buf = np.frombuffer(self.regions[rank].buf, dtype=np.uint8)
        return buf[at : at + lay.chunk_bytes]

    def alloc(self, rng: random.Random, n: int) -> list[int]:
        if n > len(self.free):
            raise RuntimeError(f"{self.name}: out of KV blocks")
        # fragmented on purpose: pick a random run start, take a run, then scatter
        rng.shuffle(self.free) if rng.random() < 0.5 else self.free.sort()
        got, self.free = self.free[:n], self.free[n:]
        return got

    def release(self, blocks: list[int]) -> None:
        self.free.extend(blocks)

    def close(self) -> None:
        for w in self.workers:
            w.close()
        self.client.close()
        for r in self.regions:
            r.close()


def make_engine(
    socket: str,
    name: str,
    *,
    num_blocks: int,
    num_layers: int,
    chunk_bytes: int,
    tp: int = 1,
    workers: bool = False,
    compat: str = DEMO_COMPAT,
    layer_major: bool = False,
) -> Engine:
    shape = kvlayout.layer_major if layer_major else kvlayout.block_major
    lay = shape(num_blocks, num_layers, chunk_bytes)
    nbytes = kvlayout.region_bytes(lay)
    client = KvdClient(socket, role="scheduler", engine_id=name)
    client.connect()
    regions = [SharedRegion(staging_name(f"demo-{name}-r{r}"), nbytes) for r in range(tp)]
    eng = Engine(name, client, regions, lay, list(range(num_blocks)))
    for rank, reg in enumerate(regions):
        owner = client
        if workers:
            owner = KvdClient(socket, role="worker", engine_id=name, tp_rank=rank)
            owner.connect()
            eng.workers.append(owner)
        owner.register_region(reg, layout=lay, tp_rank=rank, tp_size=tp, compat=compat)
    return eng


# ------------------------------------------------------------------ one mode


@dataclass
class ModeResult:
    mode: str
    requests: int = 0
    verified: int = 0
    mismatched: int = 0
    failed: int = 0
    expired: int = 0
    bytes: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    p_events: dict[str, int] = field(default_factory=dict)
    d_events: dict[str, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_ms)
        return {
            "mode": self.mode,
            "requests": self.requests,
            "verified": self.verified,
            "mismatched": self.mismatched,
            "failed": self.failed,
            "expired": self.expired,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 4),
            "gbps": round(self.bytes / self.seconds / 1e9, 3) if self.seconds else 0.0,
            "p50_ms": round(_pct(lat, 0.50), 3),
            "p99_ms": round(_pct(lat, 0.99), 3),
            "p_events": self.p_events,
            "d_events": self.d_events,
            "failures": self.failures[:10],
        }


def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return 0.0
    return xs[min(len(xs) - 1, int(q * len(xs)))]


@dataclass
class _Req:
    key: str
    p_id: str
    d_id: str
    p_blocks: list[int]
    d_blocks: list[int]
    p_finished: bool = False
    d_started: float = 0.0
    d_done: bool = False
    p_done: bool = False


def run_mode(
    mode: str,
    p: Engine,
    d: Engine,
    p_port: int,
    n: int,
    rng: random.Random,
    *,
    max_blocks: int = 24,
    window: int = 16,
    timeout: float = 120.0,
    progress: Any = None,
    p_host: str = "127.0.0.1",
) -> ModeResult:
    """Send n requests P -> D in `mode` and verify every byte at D.

    Every request must end exactly once on each side. `p_host` is the address of P's
    side channel as D's engine names it.
    """
    res = ModeResult(mode, requests=n)
    todo: list[_Req] = []
    for i in range(n):
        key = f"cmpl-{secrets.token_hex(8)}-{i}-0"
        nb = rng.randint(1, max_blocks)
        todo.append(
            _Req(
                key,
                f"{key}-{secrets.token_hex(4)}",
                f"{key}-{secrets.token_hex(4)}",
                [],
                [],
            )
        )
        todo[-1].p_blocks = [nb]  # block count for now; allocated when the request starts
    live: dict[str, _Req] = {}
    by_p: dict[str, _Req] = {}
    by_d: dict[str, _Req] = {}
    pending_d: list[_Req] = []
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    done = 0
    queue = list(todo)
    while done < n:
        if time.monotonic() > deadline:
            left = [
                f"{r.d_id} (P {'ended' if r.p_done else 'open'}, "
                f"D {'ended' if r.d_done else 'open'})"
                for r in list(live.values())[:4]
            ]
            res.failures.append(f"timed out with {n - done} requests unfinished: {left}")
            break
        # start new requests up to the window
        while queue and len(live) < window:
            r = queue.pop(0)
            nb = r.p_blocks[0]
            r.p_blocks = p.alloc(rng, nb)
            r.d_blocks = d.alloc(rng, nb)
            for rank in range(len(p.regions)):
                for j, b in enumerate(r.p_blocks):
                    p.block(rank, b)[:] = pattern(f"{r.key}/{rank}", j, p.block_bytes)
            live[r.key] = r
            by_p[r.p_id] = r
            by_d[r.d_id] = r
            d.client.track(
                r.d_id,
                p_host,
                p_port,
                remote_engine_id=p.name,
                remote_request_id=r.p_id if mode == "pull" else "",
            )
            if mode == "push" and rng.random() < 0.5:
                _d_start(mode, d, r, p_host, p_port, p.name)
                p.client.finished(r.p_id, r.p_blocks)
                r.p_finished = True
            else:
                p.client.finished(r.p_id, r.p_blocks)
                r.p_finished = True
                pending_d.append(r)
        # D side of the others arrives a little later, in random order
        rng.shuffle(pending_d)
        while pending_d:
            _d_start(mode, d, pending_d.pop(), p_host, p_port, p.name)
        for ev in p.client.drain_events():
            if isinstance(ev, (wire.ECReady, wire.ECUnavailable)):
                continue
            r2 = by_p.get(ev.request_id)
            name = type(ev).__name__
            res.p_events[name] = res.p_events.get(name, 0) + 1
            if r2 is None or r2.p_done:
                res.failures.append(f"P event {name} for unknown or finished {ev.request_id}")
                continue
            r2.p_done = True
            if isinstance(ev, wire.SendExpired):
                res.expired += 1
            p.release(r2.p_blocks)
            done += _maybe_done(r2, live)
        for ev in d.client.drain_events():
            if isinstance(ev, (wire.ECReady, wire.ECUnavailable)):
                continue
            r3 = by_d.get(ev.request_id)
            name = type(ev).__name__
            res.d_events[name] = res.d_events.get(name, 0) + 1
            if r3 is None or r3.d_done:
                res.failures.append(f"D event {name} for unknown or finished {ev.request_id}")
                continue
            r3.d_done = True
            if isinstance(ev, wire.RecvFinished):
                res.latencies_ms.append((time.perf_counter() - r3.d_started) * 1e3)
                ok = all(
                    np.array_equal(d.block(rank, b), pattern(f"{r3.key}/{rank}", j, d.block_bytes))
                    for rank in range(len(d.regions))
                    for j, b in enumerate(r3.d_blocks)
                )
                if ok:
                    res.verified += 1
                    res.bytes += len(r3.d_blocks) * d.block_bytes * len(d.regions)
                else:
                    res.mismatched += 1
                    res.failures.append(f"bytes differ for {r3.d_id}")
            else:
                res.failed += 1
                res.failures.append(f"{r3.d_id}: {getattr(ev, 'reason', name)}")
            d.release(r3.d_blocks)
            done += _maybe_done(r3, live)
            if progress is not None:
                progress()
        if live:
            time.sleep(0.0002)
    res.seconds = time.perf_counter() - t0
    return res


def _d_start(mode: str, d: Engine, r: _Req, p_host: str, p_port: int, p_engine: str) -> None:
    r.d_started = time.perf_counter()
    if mode == "push":
        d.client.register_push(r.d_id, r.d_blocks, p_host, p_port, remote_engine_id=p_engine)
    else:
        d.client.pull(
            r.d_id,
            r.d_blocks,
            p_host,
            p_port,
            remote_engine_id=p_engine,
            remote_request_id=r.p_id,
            remote_block_ids=r.p_blocks,
        )


def _maybe_done(r: _Req, live: dict[str, _Req]) -> int:
    if r.p_done and r.d_done and r.key in live:
        del live[r.key]
        return 1
    return 0


# ------------------------------------------------------------------ the demo


@contextlib.contextmanager
def cluster(
    workdir: Path | None = None, p_extra: str = "", d_extra: str = ""
) -> Iterator[tuple[DaemonProc, DaemonProc]]:
    """A P daemon and a D daemon; both stopped (SIGTERM) on exit."""
    tmp = workdir or Path(tempfile.mkdtemp(prefix="kvd-demo-"))
    p = start_daemon(tmp, "kvd-demo-p", p_extra)
    try:
        d = start_daemon(tmp, "kvd-demo-d", d_extra)
    except BaseException:
        p.stop()
        raise
    try:
        yield p, d
    finally:
        d.stop()
        p.stop()
        if workdir is None:
            shutil.rmtree(tmp, ignore_errors=True)


def run_demo(requests: int, modes: list[str], as_json: bool, seed: int) -> int:
    """Run the demo; returns the exit code (non-zero on any mismatch or unexpected failure)."""
    from rich.console import Console
    from rich.progress import Progress
    from rich.table import Table

    from kvd.ops import make_console

    console = Console(stderr=as_json)
    out = make_console(stderr=as_json)  # the summary: never cut when not to a terminal
    rng = random.Random(seed)
    summaries: list[dict[str, Any]] = []
    counters: dict[str, Any] = {}
    kv_modes = [m for m in modes if m in ("push", "pull")]
    with Progress(console=console, transient=as_json) as bar:
        if kv_modes:
            console.print("starting a P daemon and a D daemon (NIXL agents, side channels)")
            with cluster() as (pd, dd):
                p = make_engine(
                    pd.socket, "prefill", num_blocks=1024, num_layers=8, chunk_bytes=16 * 1024
                )
                d = make_engine(
                    dd.socket, "decode", num_blocks=1024, num_layers=8, chunk_bytes=16 * 1024
                )
                try:
                    for mode in kv_modes:
                        task = bar.add_task(f"{mode:>4}", total=requests)
                        res = run_mode(
                            mode,
                            p,
                            d,
                            pd.side_port,
                            requests,
                            rng,
                            progress=lambda t=task: bar.advance(t),
                        )
                        summaries.append(res.summary())
                    counters["prefill"] = p.client.status()["counters"]
                finally:
                    p.close()
                    d.close()
        if "ec" in modes:
            summaries.append(_run_ec_demo(requests, rng, bar, counters))
        if "tiers" in modes:
            summaries.append(_run_tiers_demo(requests, rng, bar, counters))
    ok = all(
        s["verified"] == s["requests"] and not s["mismatched"] and not s["failed"]
        for s in summaries
    )
    if as_json:
        print(
            json.dumps(
                {"ok": ok, "modes": {s["mode"]: s for s in summaries}, "counters": counters},
                indent=2,
            )
        )
        return 0 if ok else 1
    t = Table(title="kvd demo: real daemons, real NIXL, every byte verified")
    for col in (
        "mode",
        "requests",
        "verified",
        "mismatched",
        "failed",
        "expired",
        "hit rate",
        "MiB",
        "GB/s",
        "p50 ms",
        "p99 ms",
    ):
        t.add_column(col, justify="right")
    for s in summaries:
        hit = f"{s['hit_rate']:.0%}" if "hit_rate" in s else "-"
        t.add_row(
            s["mode"],
            str(s["requests"]),
            str(s["verified"]),
            str(s["mismatched"]),
            str(s["failed"]),
            str(s.get("expired", "-")),
            hit,
            f"{s['bytes'] / 2**20:.1f}",
            f"{s['gbps']:.2f}",
            f"{s['p50_ms']:.2f}",
            f"{s['p99_ms']:.2f}",
        )
    out.print(t)
    if "prefill" in counters:
        c = counters["prefill"]
        out.print(
            f"P daemon: leases granted {c.get('leases_granted', 0)}, "
            f"expired {c.get('leases_expired', 0)}, "
            f"descriptors {c.get('descriptors', 0)}"
        )
    if "encoder" in counters:
        c = counters["encoder"]
        out.print(
            f"encoder daemon: outputs served {c.get('ec_served', 0)}, "
            f"evicted {c.get('ec_evicted', 0)}"
        )
    if "tiers" in counters:
        c = counters["tiers"]
        out.print(
            f"tiers daemon: host blocks {c['host']['blocks']}, disk blocks "
            f"{c['disk']['blocks']}, demoted {c['counters'].get('blocks_demoted', 0)}, "
            f"read from disk by the engine {c['counters'].get('disk_client_reads', 0)}, "
            f"promoted {c['counters'].get('blocks_promoted', 0)}"
        )
    for s in summaries:
        for f in s["failures"][:5]:
            out.print(f"[red]{s['mode']}: {f}[/red]")
    out.print("[green]all bytes verified[/green]" if ok else "[red]FAILED[/red]")
    return 0 if ok else 1


def _run_tiers_demo(
    requests: int, rng: random.Random, bar: Any, counters: dict[str, Any]
) -> dict[str, Any]:
    """A daemon with a host and a disk tier; engine A stores, engine B loads."""
    from kvd.tierdemo import run_tiers, tiers_config

    tmp = Path(tempfile.mkdtemp(prefix="kvd-demo-tiers-"))
    daemon = start_daemon(tmp, "kvd-demo-t", tiers_config(str(tmp / "disk")))
    try:
        task = bar.add_task("tiers", total=requests)
        res = run_tiers(daemon.socket, requests, rng, progress=lambda: bar.advance(task))
        counters["tiers"] = res.pop("tiers")
    finally:
        daemon.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return res


def _run_ec_demo(
    requests: int, rng: random.Random, bar: Any, counters: dict[str, Any]
) -> dict[str, Any]:
    """An encoder daemon and a consumer daemon; a stream of images with repeats."""
    from kvd.ecdemo import ECSide, run_ec

    tmp = Path(tempfile.mkdtemp(prefix="kvd-demo-ec-"))
    ec = '[ec]\nrole = "{}"\nregion_bytes = {}\nblock_bytes = 1048576\n'
    enc = start_daemon(tmp, "kvd-demo-e", ec.format("producer", 128 << 20))
    try:
        con = start_daemon(tmp, "kvd-demo-c", ec.format("consumer", 128 << 20))
        try:
            prod, cons = ECSide(enc.socket, "encoder"), ECSide(con.socket, "consumer")
            try:
                task = bar.add_task("  ec", total=requests)
                res = run_ec(prod, cons, requests, rng, progress=lambda: bar.advance(task))
                counters["encoder"] = prod.client.status()["counters"]
                counters["consumer"] = cons.client.status()["counters"]
            finally:
                prod.close()
                cons.close()
        finally:
            con.stop()
    finally:
        enc.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    return res.summary()
