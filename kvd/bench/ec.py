"""Scenario 4, the encoder cache: one 4,505,600-byte encoder output (a 720p image on
Qwen3.5-4B, llm-d #2535), from the producer daemon (P) to the consumer daemon (D).

- Cold fetch: the producer allocated, wrote and committed the output (not timed); the
  clock runs from the consumer's `ec_ensure` to `ECReady` at its client (consumer daemon
  -> producer's EC router -> WRITE into the consumer's blocks -> ack -> event). Against
  raw NIXL: one WRITE of the same blocks to the same destination blocks. The daemons'
  stage trace is on for these fetches: the table of `COLD_PATH` stages says where a
  cold fetch's time goes (medians of the time since the stage before it).
- Warm hit: the output is already in the consumer's cache; the clock runs from the
  consumer's call to the bytes copied out of the EC region into the engine's own buffer.
  The fast path is `ec_read` (the client looks the output up in the daemon's EC index,
  copies, and checks the index did not change: no round trip); beside it, the IPC path
  (`ec_ensure` -> `ECReady` -> copy -> `ec_release`). Against memcpy: the same copy alone.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from kvd_client import wire
from kvd_client.client import Event

from kvd.bench.common import (
    BenchError,
    Env,
    Progress,
    expect_ok,
    median,
    new_id,
    summary_ms,
    wait_for,
)
from kvd.bench.control import fetch_trace, switch_trace
from kvd.core.planner import Geometry, plan_transfer
from kvd.ecdemo import ECSide, output_bytes

COLD_PATH: tuple[tuple[str, str, str], ...] = (
    ("D", "gateway.request", "client ec_ensure -> consumer daemon"),
    ("D", "ec.request_sent", "consumer: blocks allocated, ECXferReq handed to ZMQ"),
    ("P", "ec.request_received", "producer: ECXferReq received"),
    ("P", "ec.peer_checked", "producer: checks, pin, consumer's handshake looked up"),
    ("P", "nixl.picked", "producer: NIXL thread picks the WRITE"),
    ("P", "nixl.posted", "producer: WRITE posted"),
    ("P", "nixl.done", "producer: WRITE complete"),
    ("P", "ec.ack_sent", "producer: back on the loop, ECXferAck sent"),
    ("D", "ec.ack_received", "consumer: ECXferAck received"),
    ("D", "ec.ready", "consumer: ack handled, output cached and indexed"),
    ("D", "gateway.event", "consumer: ECReady sent"),
)
"""A cold fetch's stages in order: (daemon, stage as recorded, what happened)."""


def cold_stages(
    records: dict[str, list[list[Any]]], fetches: dict[str, tuple[int, int]]
) -> list[dict[str, Any]]:
    """Median microseconds of each `COLD_PATH` stage since the one before it (from the
    client's call; the last row: ECReady sent -> the client has it), over `fetches`
    (mm_hash -> client call and event times, CLOCK_MONOTONIC ns)."""
    at: dict[str, dict[tuple[str, str], int]] = {mm: {} for mm in fetches}
    for side, recs in records.items():
        for t, rid, stage in recs:
            if rid in at:
                at[rid].setdefault((side, stage), int(t))
    took: dict[str, list[float]] = {label: [] for _, _, label in COLD_PATH}
    took["client: ECReady received"] = []
    for mm, (t0, t1) in fetches.items():
        prev = t0
        for side, stage, label in COLD_PATH:
            t = at[mm].get((side, stage))
            if t is not None:
                took[label].append((t - prev) / 1e3)
                prev = t
        took["client: ECReady received"].append((t1 - prev) / 1e3)
    return [
        {"stage": k, "n": len(v), "us": round(median(v), 1) if v else 0.0} for k, v in took.items()
    ]


@dataclass(frozen=True)
class ECConfig:
    nbytes: int = 4_505_600
    cold_reps: int = 40
    warm_reps: int = 300

    @classmethod
    def quick(cls) -> ECConfig:
        return cls(cold_reps=6, warm_reps=30)


def steps(cfg: ECConfig) -> int:
    return 2


@dataclass
class ECPair:
    prod: ECSide
    cons: ECSide
    cons_region: str
    region_bytes: int
    block_bytes: int

    def close(self) -> None:
        self.prod.close()
        self.cons.close()


def setup(env: Env) -> ECPair:
    prod = ECSide(env.p_socket, "ec-producer")
    try:
        cons = ECSide(env.d_socket, "ec-consumer")
    except BaseException:
        prod.close()
        raise
    info = cons.client.status("ec")
    return ECPair(
        prod, cons, str(info["region"]), int(info["region_bytes"]), int(info["block_bytes"])
    )


def raw_bases(env: Env, pair: ECPair) -> dict[str, int]:
    """The consumer's EC region in the raw helper; the producer's registered here."""
    env.raw.register(int(pair.prod.buf.ctypes.data), pair.region_bytes)
    return {"cons": env.peer.map(pair.cons_region, pair.region_bytes)}


def _geo(base: int, pair: ECPair) -> Geometry:
    n = pair.region_bytes // pair.block_bytes
    return Geometry.block_major(base, n, 1, 1, pair.block_bytes)


def run(
    env: Env, cfg: ECConfig, pair: ECPair, bases: dict[str, int], seed: int, progress: Progress
) -> dict[str, Any]:
    prod, cons = pair.prod, pair.cons
    stash: list[Event] = []
    src_geo = _geo(int(prod.buf.ctypes.data), pair)
    dst_geo = _geo(bases["cons"], pair)
    cold: list[float] = []
    raw: list[float] = []
    descs = 0
    last: tuple[wire.ECParams, np.ndarray] | None = None
    rng = random.Random(seed + 4)
    # Warm-up: one pass over the consumer's whole EC region (and two more fetches), so
    # that no timed fetch pays the one-time page faults of a daemon's first touch of
    # its region; a long-running daemon has long paid them.
    per_output = -(-cfg.nbytes // pair.block_bytes)
    warmup = pair.region_bytes // pair.block_bytes // per_output + 2
    traced: dict[str, tuple[int, int]] = {}
    switch_trace(env, True)
    fetch_trace(env.p_cli)  # whatever an earlier scenario left in the rings
    fetch_trace(env.d_cli)
    for rep in range(cfg.cold_reps + warmup):
        mm = new_id("ec-cold")
        data = output_bytes(rng.randrange(1 << 16), cfg.nbytes)
        blocks = prod.client.ec_allocate(mm, cfg.nbytes)
        prod.write(blocks.block_ids, data)
        params = prod.client.ec_commit(
            mm, cfg.nbytes, shape=(cfg.nbytes,), dtype="uint8", compat="kvd-bench"
        )
        n0 = time.monotonic_ns()
        t0 = time.perf_counter()
        cons.client.ec_ensure(params)
        ev = wait_for(cons.client, mm, stash)
        dt = time.perf_counter() - t0
        n1 = time.monotonic_ns()
        expect_ok(ev, "EC cold fetch")
        assert isinstance(ev, wire.ECReady)
        if not cons.matches(ev.block_ids, data):
            raise BenchError("EC cold fetch delivered wrong bytes")
        # raw NIXL: the same source blocks into the destination blocks the consumer chose
        plan = plan_transfer(src_geo, list(blocks.block_ids), dst_geo, list(ev.block_ids))
        descs = plan.descriptors
        loc, rem = plan.as_tuples_local(), plan.as_tuples_remote()
        t_raw = env.raw.transfer("WRITE", loc, rem)
        cons.client.ec_release(mm)
        if rep >= warmup:
            cold.append(dt)
            raw.append(t_raw)
            traced[mm] = (n0, n1)
        last = (params, data)
    switch_trace(env, False)
    stages = cold_stages({"P": fetch_trace(env.p_cli), "D": fetch_trace(env.d_cli)}, traced)
    progress("EC: cold fetches")
    assert last is not None
    params, data = last
    out = np.empty(cfg.nbytes, dtype=np.uint8)
    bb = pair.block_bytes
    warm: list[float] = []
    warm_ipc: list[float] = []
    copy: list[float] = []
    block_ids: tuple[int, ...] = ()

    def copy_out(ids: tuple[int, ...]) -> None:
        for i, b in enumerate(ids):
            n = min(bb, cfg.nbytes - i * bb)
            out[i * bb : i * bb + n] = cons.buf[b * bb : b * bb + n]

    races = cons.client.ec_fast_races
    # The IPC path first; then the fast path and the memcpy alternately, each going first
    # every other time, so that neither gains from the caches the other warmed.
    for rep in range(cfg.warm_reps + 5):
        t0 = time.perf_counter()
        cons.client.ec_ensure(params)
        ev = wait_for(cons.client, params.mm_hash, stash)
        if not isinstance(ev, wire.ECReady) or not ev.local_hit:
            raise BenchError(f"EC warm hit expected, got {ev!r}")
        copy_out(ev.block_ids)
        di = time.perf_counter() - t0
        cons.client.ec_release(params.mm_hash)
        block_ids = ev.block_ids
        if rep >= 5:
            warm_ipc.append(di)
    if not np.array_equal(out, data):
        raise BenchError("EC warm hit (IPC path) copied wrong bytes")
    cons.client.drain_events()

    def fast() -> float:
        out[:1] = ~data[:1]  # a stale first byte must be overwritten
        t0 = time.perf_counter()
        served = cons.client.ec_read(params, out)
        dt = time.perf_counter() - t0
        if not served:
            raise BenchError("EC warm hit (fast path) was not served from the index")
        return dt

    def memcpy() -> float:
        t0 = time.perf_counter()
        copy_out(block_ids)
        return time.perf_counter() - t0

    for rep in range(cfg.warm_reps + 5):
        if rep % 2:
            dc, dt = memcpy(), fast()
        else:
            dt, dc = fast(), memcpy()
        if rep >= 5:
            warm.append(dt)
            copy.append(dc)
    out[:] = 0
    if not cons.client.ec_read(params, out) or not np.array_equal(out, data):
        raise BenchError("EC warm hit (fast path) copied wrong bytes")
    if cons.client.ec_fast_races != races:
        raise BenchError("the EC index changed during warm hits that nothing evicted")
    cons.client.drain_events()
    progress("EC: warm hits")
    cold_ms, raw_ms = median(cold) * 1e3, median(raw) * 1e3
    warm_us, copy_us = median(warm) * 1e6, median(copy) * 1e6
    ipc_us = median(warm_ipc) * 1e6
    return {
        "nbytes": cfg.nbytes,
        "block_bytes": bb,
        "descriptors": descs,
        "cold": summary_ms(cold),
        "raw_write": summary_ms(raw),
        "cold_stages": stages,
        "cold_minus_raw_ms": round(cold_ms - raw_ms, 4),
        "cold_gbps": round(cfg.nbytes / (cold_ms / 1e3) / 1e9, 3) if cold_ms else 0.0,
        "raw_gbps": round(cfg.nbytes / (raw_ms / 1e3) / 1e9, 3) if raw_ms else 0.0,
        "warm": summary_ms(warm),
        "memcpy": summary_ms(copy),
        "warm_p50_us": round(warm_us, 1),
        "memcpy_p50_us": round(copy_us, 1),
        "warm_over_memcpy": round(warm_us / copy_us, 3) if copy_us else 0.0,
        "warm_ipc": summary_ms(warm_ipc),
        "warm_ipc_p50_us": round(ipc_us, 1),
        "warm_ipc_over_memcpy": round(ipc_us / copy_us, 3) if copy_us else 0.0,
    }
