"""Scenario 2, the control plane: small (1 MiB) requests, one at a time, and `drain_events`.

- Push latency: P's `finished` for a batch of requests goes first (so P's blocks are
  staged, as when prefill ends before decode has room); then, one request at a time,
  the clock runs from D's `register_push` call to the `RecvFinished` event at D's client.
- Pull latency: the same, from D's `pull` call to `RecvFinished` (the READ, P's
  acknowledgement that the lease was still held, and the event).
- `drain_events()`: one call with nothing to return (idle); and one call that returns a
  backlog (busy: the replies and events of a burst of requests that already finished).
- Stage trace: more push and pull requests in batches that alternate the daemons' stage
  trace on and off (`kvd.bench.stages`): where the time of one request goes, and what
  the tracing itself costs.
- Floors: a raw NIXL notification round trip (`kvd.bench.raw`) and a ZMQ IPC round trip
  (`kvd.bench.zmqfloor`), and what a daemon on this host cannot go below: the two round
  trips plus the copy itself (the WRITE or READ as the stage trace timed it).
- Bare thread hand-offs (`kvd.bench.handoff`): an event loop to a thread and back, as a
  daemon's loop and its NIXL thread hand over each transfer and notification, measured
  alone beside the stage trace's (on a loaded host the difference is waiting for a core).
- Idle cost: the runner measures the D daemon's CPU once every scenario is done
  (`kvd.bench.idle`).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvd_client import layout as kvlayout
from kvd_client.client import KvdClient

from kvd.bench import handoff, idle, stages, zmqfloor
from kvd.bench.common import (
    Env,
    Progress,
    Side,
    Timed,
    expect_ok,
    fill_pattern,
    leases,
    make_side,
    median,
    new_id,
    pct,
    status,
    summary_ms,
    wait_for,
    wait_leases,
)

BATCH = 100


@dataclass(frozen=True)
class ControlConfig:
    requests: int = 2000
    pull_requests: int = 1000
    num_layers: int = 32
    chunk_bytes: int = 8 << 10
    blocks_per_request: int = 2
    """2 blocks x 32 layers x K and V x 8 KiB = 1 MiB per request."""
    pool_blocks: int = 2048
    drain_calls: int = 20000
    busy_bursts: int = 5
    busy_requests: int = 64
    traced_requests: int = 600
    traced_pull_requests: int = 300
    """Requests of the stage-trace run (after a batch to warm up); half of them traced,
    by batches (ABBA order)."""
    trace_batch: int = 10
    raw_round_trips: int = 1000
    """Raw NIXL notification round trips and ZMQ IPC round trips (the floors), each,
    printed beside push and pull."""
    idle_window_s: float = 10.0
    """How long the idle daemon's CPU is measured."""
    apart_requests: int = 100
    apart_gap_s: float = 0.02
    """Push and pull requests also measured one at a time `apart_gap_s` apart: each finds
    the daemons idle (their NIXL threads backed off), as at a low request rate, where the
    back-to-back figures find them warm."""

    @classmethod
    def quick(cls) -> ControlConfig:
        return cls(
            requests=200,
            pull_requests=100,
            pool_blocks=512,
            drain_calls=2000,
            busy_bursts=2,
            busy_requests=32,
            traced_requests=60,
            traced_pull_requests=40,
            raw_round_trips=100,
            idle_window_s=2.0,
            apart_requests=20,
        )

    @property
    def request_bytes(self) -> int:
        return self.blocks_per_request * self.num_layers * 2 * self.chunk_bytes


def steps(cfg: ControlConfig) -> int:
    """Progress steps of `run`, and the runner's idle measurement."""
    return _batches(cfg.requests) + 2 * _batches(cfg.pull_requests) + 2 + 2 + 3 + 1 + 2


def _batches(n: int) -> int:
    return (n + BATCH - 1) // BATCH


@dataclass
class CtlPair:
    p: Side
    d: Side
    cfg: ControlConfig

    def close(self) -> None:
        self.p.close()
        self.d.close()


def setup(env: Env, cfg: ControlConfig) -> CtlPair:
    lay = kvlayout.block_major(cfg.pool_blocks, cfg.num_layers, cfg.chunk_bytes)
    nbytes = kvlayout.region_bytes(lay)
    p = make_side(env.p_socket, "ctl-p", lay, nbytes)
    try:
        d = make_side(env.d_socket, "ctl-d", lay, nbytes)
    except BaseException:
        p.close()
        raise
    fill_pattern(p, 7)
    return CtlPair(p, d, cfg)


def pull_by_write(
    env: Env, pair: CtlPair, cfg: ControlConfig, rng: random.Random, progress: Progress
) -> list[float]:
    """The same pulls from P, by a D daemon that has P WRITE them (`transfer.pull_by =
    "write"`, as between hosts where UCX would emulate the READ): what that costs beside
    a READ, measured side by side (empty when the bench has no such daemon)."""
    if not env.dw_socket:
        return []
    lay = kvlayout.block_major(cfg.pool_blocks, cfg.num_layers, cfg.chunk_bytes)
    dw = make_side(env.dw_socket, "ctl-dw", lay, kvlayout.region_bytes(lay))
    try:
        other = CtlPair(pair.p, dw, cfg)
        measure(env, other, "pull", 50, rng)  # warm up (handshake, first transfers)
        return measure(env, other, "pull", cfg.pull_requests, rng, progress)
    finally:
        dw.close()


def measure(
    env: Env,
    pair: CtlPair,
    mode: str,
    n: int,
    rng: random.Random,
    progress: Progress | None = None,
    *,
    gap_s: float = 0.0,
) -> list[float]:
    """Latency of n requests, one at a time (`gap_s` apart), from D's call to D's
    RecvFinished (seconds)."""
    return [t.seconds for t in timed(env, pair, mode, n, rng, progress, gap_s=gap_s)]


def timed(
    env: Env,
    pair: CtlPair,
    mode: str,
    n: int,
    rng: random.Random,
    progress: Progress | None = None,
    *,
    batch_size: int = BATCH,
    before_batch: Callable[[int], None] | None = None,
    gap_s: float = 0.0,
) -> list[Timed]:
    """n requests, one at a time, in batches (P finishes a whole batch first);
    `before_batch(i)` runs before the i-th batch's first request; `gap_s`: a pause
    before each request (nothing else runs meanwhile)."""
    p, d, k = pair.p, pair.d, pair.cfg.blocks_per_request
    pool = range(pair.cfg.pool_blocks)
    out: list[Timed] = []
    for start in range(0, n, batch_size):
        batch = []
        base = leases(env)
        for _ in range(min(batch_size, n - start)):
            pid, did = new_id(f"ctl-{mode}-p"), new_id(f"ctl-{mode}-d")
            lb, rb = rng.sample(pool, k), rng.sample(pool, k)
            p.client.finished(pid, lb)
            batch.append((pid, did, lb, rb))
        wait_leases(env, base + len(batch))  # P has staged the whole batch
        p.stash.extend(p.client.drain_events())
        if before_batch is not None:
            before_batch(start // batch_size)
        for pid, did, lb, rb in batch:
            if gap_s:
                time.sleep(gap_s)
            t0 = time.monotonic_ns()
            if mode == "push":
                d.client.register_push(
                    did,
                    rb,
                    "127.0.0.1",
                    env.p_port,
                    remote_engine_id=p.engine_id,
                    remote_request_id=pid,
                )
            else:
                d.client.pull(
                    did,
                    rb,
                    "127.0.0.1",
                    env.p_port,
                    remote_request_id=pid,
                    remote_block_ids=lb,
                    remote_engine_id=p.engine_id,
                )
            t_sent = time.monotonic_ns()
            ev = wait_for(d.client, did, d.stash)
            out.append(Timed(pid, did, t0, t_sent, time.monotonic_ns()))
            expect_ok(ev, f"{mode} at D")
        for pid, *_ in batch:
            expect_ok(wait_for(p.client, pid, p.stash), f"{mode} at P")
        if progress is not None:
            progress(f"control plane {mode}: {start + len(batch)}/{n}")
    return out


def drain_idle(pair: CtlPair, calls: int) -> list[float]:
    """Seconds per `drain_events()` call with nothing to return."""
    cli = pair.d.client
    pair.d.stash.extend(cli.drain_events())
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        evs = cli.drain_events()
        out.append(time.perf_counter() - t0)
        if evs:
            pair.d.stash.extend(evs)
    return out


def drain_busy(
    env: Env, pair: CtlPair, bursts: int, n: int, rng: random.Random
) -> list[dict[str, float]]:
    """One `drain_events()` call collecting the backlog of n finished push requests."""
    p, d, k = pair.p, pair.d, pair.cfg.blocks_per_request
    out = []
    for _ in range(bursts):
        ids = []
        p_blocks = rng.sample(range(pair.cfg.pool_blocks), n * k)
        d_blocks = rng.sample(range(pair.cfg.pool_blocks), n * k)
        for i in range(n):
            pid, did = new_id("ctl-busy-p"), new_id("ctl-busy-d")
            p.client.finished(pid, p_blocks[i * k : (i + 1) * k])
            d.client.register_push(
                did,
                d_blocks[i * k : (i + 1) * k],
                "127.0.0.1",
                env.p_port,
                remote_engine_id=p.engine_id,
                remote_request_id=pid,
            )
            ids.append((pid, did))
        # wait on P's side only, so D's replies and events pile up unread
        for pid, _ in ids:
            expect_ok(wait_for(p.client, pid, p.stash), "busy burst at P")
        time.sleep(0.05)
        t0 = time.perf_counter()
        evs = d.client.drain_events()
        dt = time.perf_counter() - t0
        d.stash.extend(evs)
        for _, did in ids:
            expect_ok(wait_for(d.client, did, d.stash), "busy burst at D")
        out.append({"us": dt * 1e6, "events": float(len(evs)), "frames": float(2 * n)})
    return out


def switch_trace(env: Env, on: bool) -> None:
    """Both daemons' stage trace on or off (`daemon.trace_records` > 0 in the bench)."""
    for cli in (env.p_cli, env.d_cli):
        status(cli, "trace_on" if on else "trace_off")


def fetch_trace(cli: KvdClient) -> list[list[Any]]:
    """Every stage-trace record a daemon holds (they leave its ring)."""
    out: list[list[Any]] = []
    while True:
        got = status(cli, "trace")
        out += got["records"]
        if not got["left"]:
            return out


class _TracedBatches:
    """Switches both daemons' trace before each batch (`_traced`), and sums their CPU
    (all threads) per kind of batch: a batch runs from its `start` to the next (the next
    batch's P `finished` calls and waits included, alike for both kinds). The first
    batch warms up and counts for neither."""

    def __init__(self, env: Env) -> None:
        self.env = env
        self.ns = {True: 0, False: 0}
        self._kind: bool | None = None
        self._since = 0

    def _cpu(self) -> int:
        return idle.cpu_ns(self.env.p_pid) + idle.cpu_ns(self.env.d_pid)

    def _close(self) -> None:
        if self._kind is not None:
            self.ns[self._kind] += self._cpu() - self._since

    def start(self, batch: int) -> None:
        self._close()
        self._kind = _traced(batch)
        switch_trace(self.env, bool(self._kind))
        self._since = self._cpu()

    def end(self) -> None:
        self._close()
        self._kind = None
        switch_trace(self.env, False)


def _traced(batch: int) -> bool | None:
    """Batch 0 warms up (None: counts for neither); then traced, untraced, untraced,
    traced, traced, ... (ABBA: a drift in the machine's speed favours neither)."""
    return None if batch == 0 else (batch - 1) % 4 in (0, 3)


def trace_run(
    env: Env, pair: CtlPair, cfg: ControlConfig, rng: random.Random, progress: Progress
) -> dict[str, Any]:
    """Push and pull requests in batches with the daemons' stage trace alternately on and
    off: the stage table of the traced ones, and on vs off latency (the trace's cost)."""
    cost = stages.mark_cost()
    out: dict[str, Any] = {"batch": cfg.trace_batch, "mark_cost": cost}
    for mode, n in (("push", cfg.traced_requests), ("pull", cfg.traced_pull_requests)):
        cpu = _TracedBatches(env)
        reqs = timed(
            env,
            pair,
            mode,
            n + cfg.trace_batch,
            rng,
            batch_size=cfg.trace_batch,
            before_batch=cpu.start,
        )
        cpu.end()
        records = {"P": fetch_trace(env.p_cli), "D": fetch_trace(env.d_cli)}
        kinds = [_traced(i // cfg.trace_batch) for i in range(len(reqs))]
        on = [r for r, kind in zip(reqs, kinds, strict=True) if kind is True]
        off = [r for r, kind in zip(reqs, kinds, strict=True) if kind is False]
        joined = stages.join(on, records)
        chain = stages.STAGES[mode]
        on_ms, off_ms = (
            pct([r.seconds * 1e3 for r in on], 0.5),
            pct([r.seconds * 1e3 for r in off], 0.5),
        )
        marks = sum(len(recs) for recs in records.values()) / max(1, len(on))
        out[mode] = {
            "traced": len(on),
            "complete": stages.complete(chain, joined),
            "records": {side: len(recs) for side, recs in records.items()},
            "stages": stages.summarize(chain, joined),
            "overhead": {
                "on_n": len(on),
                "off_n": len(off),
                "on_p50_ms": round(on_ms, 4),
                "off_p50_ms": round(off_ms, 4),
                "delta_us": round((on_ms - off_ms) * 1e3, 1),
                "cpu_us_per_request_on": round(cpu.ns[True] / max(1, len(on)) / 1e3, 1),
                "cpu_us_per_request_off": round(cpu.ns[False] / max(1, len(off)) / 1e3, 1),
                "marks_per_request": round(marks, 1),
                "estimated_us": round(marks * cost["mark_ns"] / 1e3, 2),
            },
        }
        progress(f"control plane: stage trace, {mode}")
    return out


def raw_round_trips(env: Env, n: int) -> list[float]:
    """The floor: n raw NIXL notification round trips (`RawInitiator.notif_round_trip`)
    between the benchmark's agent and the raw helper, after 20 to warm up, each started
    right after the one before (the helper polls hot, as a daemon does mid-request)."""
    for _ in range(20):
        env.raw.notif_round_trip()
    return [env.raw.notif_round_trip() for _ in range(n)]


COPY_STAGES: dict[str, str] = {"push": "P nixl.done", "pull": "D nixl.done"}
"""The stage whose `took` is the copy itself: from the transfer posted to NIXL's DONE."""


def design_floor(
    notif: dict[str, Any], zmq_rtt: dict[str, Any], trace: dict[str, Any]
) -> dict[str, Any]:
    """What a push or pull through a daemon cannot go below on this host (p50, ms): the
    engine's call and its event (one ZMQ IPC round trip), the two notifications (D's
    registration and P's PushDone; D's PullDone and P's PullAck: one NIXL round trip) and
    the copy (as the stage trace timed it in this run). Everything above it is the
    daemons' own hops."""
    out: dict[str, Any] = {
        "zmq_rtt_p50_ms": zmq_rtt["p50_ms"],
        "notif_rtt_p50_ms": notif["p50_ms"],
    }
    for mode, key in COPY_STAGES.items():
        rows = {row["stage"]: row for row in trace.get(mode, {}).get("stages", [])}
        if key not in rows:
            continue
        copy_ms = rows[key]["took_us"] / 1e3
        out[mode] = {
            "copy_p50_ms": round(copy_ms, 4),
            "p50_ms": round(zmq_rtt["p50_ms"] + notif["p50_ms"] + copy_ms, 4),
        }
    return out


def run(
    env: Env, cfg: ControlConfig, pair: CtlPair, seed: int, progress: Progress
) -> dict[str, Any]:
    rng = random.Random(seed + 2)
    measure(env, pair, "push", 50, rng)  # warm up (handshake, first transfers)
    measure(env, pair, "pull", 50, rng)
    push = measure(env, pair, "push", cfg.requests, rng, progress)
    pull = measure(env, pair, "pull", cfg.pull_requests, rng, progress)
    by_write = pull_by_write(env, pair, cfg, rng, progress)
    gap = cfg.apart_gap_s
    push_apart = measure(env, pair, "push", cfg.apart_requests, rng, gap_s=gap)
    progress(f"control plane: push, {gap * 1e3:.0f} ms apart")
    pull_apart = measure(env, pair, "pull", cfg.apart_requests, rng, gap_s=gap)
    progress(f"control plane: pull, {gap * 1e3:.0f} ms apart")
    idle_drain = drain_idle(pair, cfg.drain_calls)
    progress("control plane: idle drain_events")
    busy = drain_busy(env, pair, cfg.busy_bursts, cfg.busy_requests, rng)
    progress("control plane: busy drain_events")
    trace = trace_run(env, pair, cfg, rng, progress)
    floor = raw_round_trips(env, cfg.raw_round_trips)
    progress("control plane: raw NIXL notification round trip")
    zmq_rtt = zmqfloor.round_trips(env.workdir, cfg.raw_round_trips)
    progress("control plane: ZMQ IPC round trip")
    to_thread, to_loop = handoff.round_trips(cfg.raw_round_trips)
    progress("control plane: thread hand-offs")
    idle_us = [t * 1e6 for t in idle_drain]
    busy_us = [b["us"] for b in busy]
    busy_events = [b["events"] for b in busy]
    return {
        "request_bytes": cfg.request_bytes,
        "push": summary_ms(push, cdf=True),
        "pull": summary_ms(pull, cdf=True),
        **({"pull_by_write": summary_ms(by_write)} if by_write else {}),
        "push_apart": summary_ms(push_apart),
        "pull_apart": summary_ms(pull_apart),
        "apart_gap_ms": round(gap * 1e3, 3),
        "raw_notif_rtt": summary_ms(floor),
        "zmq_rtt": summary_ms(zmq_rtt),
        "handoff_to_thread": summary_ms(to_thread),
        "handoff_to_loop": summary_ms(to_loop),
        "floor": design_floor(summary_ms(floor), summary_ms(zmq_rtt), trace),
        "drain_idle": {
            "n": len(idle_us),
            "p50_us": round(pct(idle_us, 0.5), 2),
            "p99_us": round(pct(idle_us, 0.99), 2),
            "mean_us": round(sum(idle_us) / len(idle_us), 2),
        },
        "drain_busy": {
            "bursts": len(busy),
            "requests_per_burst": cfg.busy_requests,
            "median_events": median(busy_events),
            "median_us": round(median(busy_us), 1),
            "us_per_frame": round(median([b["us"] / b["frames"] for b in busy]), 2),
        },
        "trace": trace,
    }
