"""Scenario 1, the data plane: one request's KV moved between two regions in two processes.

Contenders, on the same bytes of the same shared-memory regions, run alternately:

- `memcpy`: one contiguous copy of the same number of bytes (the physical limit);
- `raw per-block WRITE/READ`: raw NIXL, one descriptor per (block, layer, K/V part), as
  vLLM's NixlConnector posts them;
- `raw coalesced WRITE/READ`: raw NIXL, one descriptor per run contiguous on both sides;
- `kvd push` / `kvd pull`: through the P and D daemons, end to end: P has finished the
  request (its lease is granted, as when prefill ends first; D learns P's blocks only
  then), and the clock runs from D's `register_push` / `pull` call to the `RecvFinished`
  event at D's client (push: D's registration reaches P, P WRITEs; pull: D READs, P
  acknowledges that the lease was still held). The daemon's own record of the transfer
  (descriptors posted to completion) is reported beside it.

Cases: two layouts (block-major, kvd's recommended host staging layout; layer-major,
vLLM's per-layer KV tensors) times two block allocations (contiguous: blocks 0..n-1 on
both sides; fragmented: n blocks drawn at random, in random order, from a pool twice as
large, independently on each side, so hardly any two neighbours coalesce).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from kvd_client import layout as kvlayout

from kvd.bench.common import (
    BenchError,
    Env,
    Progress,
    Side,
    expect_ok,
    fill_pattern,
    leases,
    make_side,
    median,
    new_id,
    wait_for,
    wait_leases,
)
from kvd.core.planner import Plan, plan_per_chunk, plan_transfer

LAYOUTS = ("block-major", "layer-major")
ALLOCATIONS = ("contiguous", "fragmented")
CONTENDERS = (
    "memcpy",
    "raw per-block WRITE",
    "raw coalesced WRITE",
    "kvd push",
    "raw per-block READ",
    "raw coalesced READ",
    "kvd pull",
)


@dataclass(frozen=True)
class DataPlaneConfig:
    num_layers: int = 32
    kv_parts: int = 2
    chunk_bytes: int = 16 * 8 * 128 * 2
    """16 tokens x 8 KV heads x 128 dims x 2 bytes (bf16): 32 KiB per block, layer and part."""
    blocks: int = 128
    pool_factor: int = 2
    reps: int = 9

    @property
    def request_bytes(self) -> int:
        return self.blocks * self.num_layers * self.kv_parts * self.chunk_bytes


@dataclass
class Pair:
    layout: str
    p: Side
    d: Side


def setup(env: Env, cfg: DataPlaneConfig, pairs: list[Pair]) -> None:
    """P and D engines for both layouts, filled; appended to `pairs` as they are made (so
    that whatever was made is torn down if a later step fails)."""
    pool = cfg.blocks * cfg.pool_factor
    for i, name in enumerate(LAYOUTS):
        make = kvlayout.block_major if name == "block-major" else kvlayout.layer_major
        lay = make(pool, cfg.num_layers, cfg.chunk_bytes, kv_parts=cfg.kv_parts)
        nbytes = kvlayout.region_bytes(lay)
        tag = "bm" if name == "block-major" else "lm"
        p = make_side(env.p_socket, f"dp-{tag}-p", lay, nbytes)
        try:
            d = make_side(env.d_socket, f"dp-{tag}-d", lay, nbytes)
        except BaseException:
            p.close()
            raise
        pairs.append(Pair(name, p, d))
        fill_pattern(p, 100 + i)


def raw_bases(env: Env, pairs: list[Pair]) -> dict[str, int]:
    """Map every region into the raw helper and register it with the raw initiator."""
    bases: dict[str, int] = {}
    for pair in pairs:
        for side in (pair.p, pair.d):
            bases[side.engine_id] = env.peer.map(side.region.name, side.region.nbytes)
            env.raw.register(side.addr, side.region.nbytes)
    return bases


def run(
    env: Env,
    cfg: DataPlaneConfig,
    pairs: list[Pair],
    bases: dict[str, int],
    seed: int,
    progress: Progress,
) -> dict[str, Any]:
    rng = random.Random(seed)
    cases = []
    for pair in pairs:
        for alloc in ALLOCATIONS:
            cases.append(_case(env, cfg, pair, bases, alloc, rng, progress))
    return {
        "config": {
            "num_layers": cfg.num_layers,
            "kv_parts": cfg.kv_parts,
            "chunk_bytes": cfg.chunk_bytes,
            "blocks": cfg.blocks,
            "block_bytes": cfg.num_layers * cfg.kv_parts * cfg.chunk_bytes,
            "request_bytes": cfg.request_bytes,
            "pool_blocks": cfg.blocks * cfg.pool_factor,
            "reps": cfg.reps,
        },
        "cases": cases,
    }


def _blocks(cfg: DataPlaneConfig, alloc: str, rng: random.Random) -> tuple[list[int], list[int]]:
    if alloc == "contiguous":
        return list(range(cfg.blocks)), list(range(cfg.blocks))
    pool = cfg.blocks * cfg.pool_factor
    return rng.sample(range(pool), cfg.blocks), rng.sample(range(pool), cfg.blocks)


def _case(
    env: Env,
    cfg: DataPlaneConfig,
    pair: Pair,
    bases: dict[str, int],
    alloc: str,
    rng: random.Random,
    progress: Progress,
) -> dict[str, Any]:
    p, d = pair.p, pair.d
    lb, rb = _blocks(cfg, alloc, rng)
    total = cfg.request_bytes
    # Raw plans are made before any clock starts: the raw contenders pay nothing for planning.
    p_local, d_local = p.geometry(), d.geometry()
    p_remote, d_remote = p.geometry(bases[p.engine_id]), d.geometry(bases[d.engine_id])
    plans: dict[str, Plan] = {
        "raw per-block WRITE": plan_per_chunk(p_local, lb, d_remote, rb),
        "raw coalesced WRITE": plan_transfer(p_local, lb, d_remote, rb),
        "raw per-block READ": plan_per_chunk(d_local, rb, p_remote, lb),
        "raw coalesced READ": plan_transfer(d_local, rb, p_remote, lb),
    }
    descs: dict[str, int] = {name: plan.descriptors for name, plan in plans.items()}
    descs["memcpy"] = 1
    kvd_ids: dict[str, str] = {}
    # the daemon's own record of each transfer: posting the descriptors to completion
    daemon_ms: dict[str, list[float]] = {"kvd push": [], "kvd pull": []}

    def raw(name: str) -> Callable[[], float]:
        plan = plans[name]
        op = "WRITE" if name.endswith("WRITE") else "READ"
        loc, rem = plan.as_tuples_local(), plan.as_tuples_remote()
        return lambda: env.raw.transfer(op, loc, rem)

    def memcpy() -> float:
        t0 = time.perf_counter()
        np.copyto(d.arr[:total], p.arr[:total])
        return time.perf_counter() - t0

    def push() -> float:
        pid, did = new_id("dp-push-p"), new_id("dp-push-d")
        base = leases(env)
        p.client.finished(pid, lb)
        wait_leases(env, base + 1)
        t0 = time.perf_counter()
        d.client.register_push(
            did, rb, "127.0.0.1", env.p_port, remote_engine_id=p.engine_id, remote_request_id=pid
        )
        ev = wait_for(d.client, did, d.stash)
        t1 = time.perf_counter()
        expect_ok(ev, "kvd push at D")
        expect_ok(wait_for(p.client, pid, p.stash), "kvd push at P")
        kvd_ids["kvd push"] = pid
        daemon_ms["kvd push"].append(float(env.transfers("p", pid).get("duration_ms", 0.0)))
        return t1 - t0

    def pull() -> float:
        pid, did = new_id("dp-pull-p"), new_id("dp-pull-d")
        base = leases(env)
        p.client.finished(pid, lb)
        wait_leases(env, base + 1)
        t0 = time.perf_counter()
        d.client.pull(
            did,
            rb,
            "127.0.0.1",
            env.p_port,
            remote_request_id=pid,
            remote_block_ids=lb,
            remote_engine_id=p.engine_id,
        )
        ev = wait_for(d.client, did, d.stash)
        t1 = time.perf_counter()
        expect_ok(ev, "kvd pull at D")
        expect_ok(wait_for(p.client, pid, p.stash), "kvd pull at P")
        kvd_ids["kvd pull"] = did
        daemon_ms["kvd pull"].append(float(env.transfers("d", did).get("duration_ms", 0.0)))
        return t1 - t0

    runs: dict[str, Callable[[], float]] = {
        "memcpy": memcpy,
        "raw per-block WRITE": raw("raw per-block WRITE"),
        "raw coalesced WRITE": raw("raw coalesced WRITE"),
        "kvd push": push,
        "raw per-block READ": raw("raw per-block READ"),
        "raw coalesced READ": raw("raw coalesced READ"),
        "kvd pull": pull,
    }
    label = f"data plane {pair.layout} {alloc}"
    # One checked run each (also the warm-up): D's blocks are cleared first, then compared.
    for name, fn in runs.items():
        if name == "memcpy":
            fn()
            continue
        d.chunks[rb] = 0
        fn()
        if not np.array_equal(d.chunks[rb], p.chunks[lb]):
            raise BenchError(f"{label}: {name} delivered wrong bytes")
    descs["kvd push"] = int(env.transfers("p", kvd_ids["kvd push"]).get("descriptors", 0))
    descs["kvd pull"] = int(env.transfers("d", kvd_ids["kvd pull"]).get("descriptors", 0))
    progress(f"{label}: checked")
    for samples in daemon_ms.values():
        samples.clear()  # keep the timed repetitions only
    order = list(CONTENDERS)
    times: dict[str, list[float]] = {name: [] for name in order}
    for rep in range(cfg.reps):
        k = rep % len(order)
        for name in order[k:] + order[:k]:  # rotate, so no contender always runs first
            times[name].append(runs[name]())
        progress(f"{label}: rep {rep + 1}/{cfg.reps}")
    contenders: dict[str, dict[str, Any]] = {}
    for name in CONTENDERS:
        med = median(times[name])
        contenders[name] = {
            "descriptors": descs[name],
            "median_ms": round(med * 1e3, 3),
            "min_ms": round(min(times[name]) * 1e3, 3),
            "max_ms": round(max(times[name]) * 1e3, 3),
            "gbps": round(total / med / 1e9, 3) if med > 0 else 0.0,
            "samples_ms": [round(t * 1e3, 3) for t in times[name]],
        }
        if name in daemon_ms:
            # end to end minus the daemon's transfer: the control path's share
            contenders[name]["daemon_transfer_ms"] = round(median(daemon_ms[name]), 3)

    def ratio(a: str, b: str) -> float:
        num, den = float(contenders[a]["gbps"]), float(contenders[b]["gbps"])
        return round(num / den, 3) if den else 0.0

    ratios = {
        "push/raw-coalesced": ratio("kvd push", "raw coalesced WRITE"),
        "push/raw-per-block": ratio("kvd push", "raw per-block WRITE"),
        "push/memcpy": ratio("kvd push", "memcpy"),
        "pull/raw-coalesced": ratio("kvd pull", "raw coalesced READ"),
        "pull/raw-per-block": ratio("kvd pull", "raw per-block READ"),
        "pull/memcpy": ratio("kvd pull", "memcpy"),
    }
    return {
        "layout": pair.layout,
        "allocation": alloc,
        "bytes": total,
        "contenders": contenders,
        "ratios": ratios,
        "coalescing_gain_kept": {
            "push": gain_kept(contenders, "kvd push", "WRITE"),
            "pull": gain_kept(contenders, "kvd pull", "READ"),
        },
    }


def gain_kept(contenders: dict[str, dict[str, Any]], kvd: str, op: str) -> float | None:
    """How much of what coalescing gains raw NIXL over per-block descriptors kvd keeps:
    (kvd - per-block) / (coalesced - per-block), in GB/s; 1.0 keeps all of it, 0 none
    (kvd no faster than per-block). None when there is nothing to coalesce (the same
    descriptors either way) or the gain is under 5 % (the ratio would be noise)."""
    coal, blk = contenders[f"raw coalesced {op}"], contenders[f"raw per-block {op}"]
    c, b, k = float(coal["gbps"]), float(blk["gbps"]), float(contenders[kvd]["gbps"])
    if coal["descriptors"] >= blk["descriptors"] or c - b < 0.05 * c:
        return None
    return round((k - b) / (c - b), 3)


def teardown(pairs: list[Pair]) -> None:
    for pair in pairs:
        pair.p.close()
        pair.d.close()
