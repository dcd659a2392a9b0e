"""Scenario 5, any P onto any D: heterogeneous TP and token-layout conversion, side by side.

Every engine declares a KV spec (`kvd_client.layout.kv_spec`, small heads: 8 KV heads of
64 bf16 elements) and registers one region per TP rank on its daemon. Contenders, run
alternately on the same number of bytes:

- `TP 4->4`: the equal-TP transfer (the reference: whole chunks, rank i to rank i);
- `TP 8->4`: each D rank receives from two P ranks (two transfers, half the heads each);
- `TP 4->8 HND` / `TP 4->8 NHD`: each D rank takes half of one P rank's heads: a head
  slice, contiguous per chunk in HND, one run per token in NHD;

each in push and pull, timed from D's `register_push`/`pull` to `RecvFinished` (as the
data-plane scenario). Then a layout conversion of one large request (256 MiB; 32 in
`--quick`): P NHD -> D HND through kvd (whole chunks, then D's daemon permutes the
received blocks in place before reporting them done) and the same transfer into an NHD D,
against a memcpy of the same bytes: the conversion's cost is the difference, in memcpys.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from kvd_client import layout as kvlayout
from kvd_client.client import Event, KvdClient
from kvd_client.layout import KvSpec
from kvd_client.shm import SharedRegion, staging_name

from kvd.bench.common import (
    BenchError,
    Env,
    Progress,
    expect_ok,
    leases,
    median,
    new_id,
    status,
    wait_for,
    wait_leases,
)

TP_CONTENDERS = ("TP 4->4", "TP 8->4", "TP 4->8 HND", "TP 4->8 NHD")
"""(P TP, D TP, layout) of each; the first is the equal-TP reference."""
_SHAPES: dict[str, tuple[int, int, str]] = {
    "TP 4->4": (4, 4, "HND"),
    "TP 8->4": (8, 4, "HND"),
    "TP 4->8 HND": (4, 8, "HND"),
    "TP 4->8 NHD": (4, 8, "NHD"),
}
CONVERT = (
    "memcpy",
    "kvd NHD->NHD push",
    "kvd NHD->HND push",
    "kvd NHD->NHD pull",
    "kvd NHD->HND pull",
)


@dataclass(frozen=True)
class TopoConfig:
    heads: int = 8
    head_size: int = 64
    layers: int = 8
    tokens: int = 16
    blocks: int = 64
    """Blocks per request of the TP contenders (16 MiB with the defaults)."""
    reps: int = 5
    convert_mib: int = 256

    @classmethod
    def quick(cls) -> TopoConfig:
        return cls(blocks=16, reps=2, convert_mib=32)

    def spec(self) -> KvSpec:
        return KvSpec("kvd-bench/small-heads", "bfloat16", self.heads, self.head_size, self.layers)

    @property
    def block_bytes(self) -> int:
        """One block of the whole model (every head, layer and K/V part)."""
        return self.tokens * self.heads * self.head_size * 2 * self.layers * 2


def steps(cfg: TopoConfig) -> int:
    return len(TP_CONTENDERS) + cfg.reps + 1 + cfg.reps + 1


@dataclass
class Engine:
    """One engine on one daemon: a region per rank, registered by the scheduler client."""

    engine_id: str
    client: KvdClient
    regions: list[SharedRegion] = field(default_factory=list)
    stash: list[Event] = field(default_factory=list)

    def arr(self, rank: int) -> np.ndarray:
        return np.frombuffer(self.regions[rank].buf, dtype=np.uint8)

    def close(self) -> None:
        self.client.close()
        for r in self.regions:
            r.close()


def make_engine(
    socket: str, name: str, spec: KvSpec, tp: int, blocks: int, tokens: int, layout: str
) -> Engine:
    client = KvdClient(socket, role="scheduler", engine_id=name)
    client.connect()
    eng = Engine(name, client)
    try:
        compat = kvlayout.kv_spec(
            model=spec.model,
            dtype=spec.dtype,
            num_kv_heads=spec.num_kv_heads,
            head_size=spec.head_size,
            num_layers=spec.num_layers,
        )
        for rank in range(tp):
            lay = kvlayout.kv_region_layout(
                spec,
                tp_size=tp,
                tp_rank=rank,
                num_blocks=blocks,
                tokens_per_block=tokens,
                kv_layout=layout,
            )
            region = SharedRegion(staging_name(f"bench-{name}-r{rank}"), kvlayout.region_bytes(lay))
            eng.regions.append(region)
            eng.arr(rank)[:] = rank + 1  # fault every page in now, not during a timed transfer
            client.register_region(region, layout=lay, tp_rank=rank, tp_size=tp, compat=compat)
    except BaseException:
        eng.close()
        raise
    return eng


@dataclass
class TopoSet:
    engines: dict[str, tuple[Engine, Engine]] = field(default_factory=dict)

    def close(self) -> None:
        for p, d in self.engines.values():
            p.close()
            d.close()


def setup(env: Env, cfg: TopoConfig, out: TopoSet) -> None:
    spec = cfg.spec()
    for i, (name, (ptp, dtp, layout)) in enumerate(_SHAPES.items()):
        p = make_engine(env.p_socket, f"topo{i}-p", spec, ptp, cfg.blocks, cfg.tokens, layout)
        try:
            d = make_engine(env.d_socket, f"topo{i}-d", spec, dtp, cfg.blocks, cfg.tokens, layout)
        except BaseException:
            p.close()
            raise
        out.engines[name] = (p, d)
    conv_blocks = max(1, (cfg.convert_mib << 20) // cfg.block_bytes)
    p = make_engine(env.p_socket, "topoc-p", spec, 1, conv_blocks, cfg.tokens, "NHD")
    try:
        d = make_engine(env.d_socket, "topoc-d", spec, 1, conv_blocks, cfg.tokens, "HND")
        same = make_engine(env.d_socket, "topoc-s", spec, 1, conv_blocks, cfg.tokens, "NHD")
    except BaseException:
        p.close()
        raise
    out.engines["convert"] = (p, d)
    out.engines["convert-same"] = (p, same)


def _transfer(env: Env, p: Engine, d: Engine, blocks: list[int], mode: str) -> float:
    """One request P -> D in `mode`; seconds from D's call to its RecvFinished."""
    pid, did = new_id("topo-p"), new_id("topo-d")
    base = leases(env)
    p.client.finished(pid, blocks)
    wait_leases(env, base + 1)  # P's lease is granted before the clock starts
    t0 = time.perf_counter()
    if mode == "push":
        d.client.register_push(
            did,
            blocks,
            "127.0.0.1",
            env.p_port,
            remote_engine_id=p.engine_id,
            remote_request_id=pid,
        )
    else:
        d.client.pull(
            did,
            blocks,
            "127.0.0.1",
            env.p_port,
            remote_request_id=pid,
            remote_block_ids=blocks,
            remote_engine_id=p.engine_id,
        )
    ev = wait_for(d.client, did, d.stash)
    t1 = time.perf_counter()
    expect_ok(ev, f"{mode} at D")
    expect_ok(wait_for(p.client, pid, p.stash), f"{mode} at P")
    return t1 - t0


def run(env: Env, cfg: TopoConfig, ts: TopoSet, seed: int, progress: Progress) -> dict[str, Any]:
    rng = random.Random(seed)
    blocks = rng.sample(range(cfg.blocks), cfg.blocks)
    total = cfg.blocks * cfg.block_bytes
    runs: dict[str, Callable[[], float]] = {}
    local: dict[str, list[float]] = {}

    def contender(p: Engine, d: Engine, mode: str, name: str) -> Callable[[], float]:
        # the local pass over the bytes a staged push (P's gather) or pull (D's scatter)
        # makes, as the daemon timed it: what a host without a spare core pays on top
        cli = env.p_cli if mode == "push" else env.d_cli
        key = "staged_gather_us" if mode == "push" else "staged_scatter_us"

        def one() -> float:
            before = status(cli)["counters"].get(key, 0)
            took = _transfer(env, p, d, blocks, mode)
            local.setdefault(name, []).append((status(cli)["counters"].get(key, 0) - before) / 1e6)
            return took

        return one

    for name in TP_CONTENDERS:
        p, d = ts.engines[name]
        for mode in ("push", "pull"):
            runs[f"{name} {mode}"] = contender(p, d, mode, f"{name} {mode}")
    for name, fn in runs.items():  # a warm-up each (handshakes, first registrations)
        fn()
        if name.endswith("pull"):
            progress(f"topology: {name.rsplit(' ', 1)[0]} warm")
    order = list(runs)
    times: dict[str, list[float]] = {name: [] for name in order}
    local.clear()  # (the warm-ups')
    for rep in range(cfg.reps):
        k = rep % len(order)
        for name in order[k:] + order[:k]:
            times[name].append(runs[name]())
        progress(f"topology: TP rep {rep + 1}/{cfg.reps}")
    tp: dict[str, dict[str, Any]] = {}
    for name in order:
        med = median(times[name])
        tp[name] = {
            "median_ms": round(med * 1e3, 3),
            "gbps": round(total / med / 1e9, 3) if med > 0 else 0.0,
            "samples_ms": [round(t * 1e3, 3) for t in times[name]],
        }
    for name in order:
        equal = tp[f"TP 4->4 {name.rsplit(' ', 1)[1]}"]
        ref = equal["gbps"]
        tp[name]["vs_equal_tp"] = round(tp[name]["gbps"] / ref, 3) if ref else 0.0
        # the ratio if that local pass is added to the equal-TP transfer, not overlapped
        loc = median(local.get(name, [0.0])) * 1e3
        tp[name]["local_pass_ms"] = round(loc, 3)
        eq_ms = equal["median_ms"]
        tp[name]["serial_bound"] = round(eq_ms / (eq_ms + loc), 3) if eq_ms else 0.0
    conv = _convert(env, cfg, ts, progress)
    mem = copies_at_once(total, cfg.reps)
    progress("topology: memory measured")
    return {
        "config": {
            "heads": cfg.heads,
            "head_size": cfg.head_size,
            "layers": cfg.layers,
            "tokens_per_block": cfg.tokens,
            "blocks": cfg.blocks,
            "request_bytes": total,
            "reps": cfg.reps,
        },
        "tp": tp,
        "convert": conv,
        "memory": mem,
    }


def copies_at_once(nbytes: int, reps: int) -> dict[str, Any]:
    """Whether this host's memory lets two copies overlap: two cold copies of `nbytes`
    (numpy, which lets go of the GIL) on two threads at once, against the same two in a
    row. A ratio near 1 means one copy already takes all the memory bandwidth: a staged
    transfer's local pass cannot hide behind a same-host transfer (itself a copy by the
    CPU, cma), whatever the cores; only where the transfer is a NIC's or a GPU's work."""
    span = max(8 * nbytes, 256 << 20)  # far larger than the caches: each copy cold
    bufs = [np.full(span, i, dtype=np.uint8) for i in range(4)]
    rng = random.Random(5)

    def copy(src: np.ndarray, dst: np.ndarray) -> None:
        o = rng.randrange(span // nbytes) * nbytes
        np.copyto(dst[o : o + nbytes], src[o : o + nbytes])

    def in_a_row() -> float:
        t0 = time.perf_counter()
        copy(bufs[0], bufs[1])
        copy(bufs[2], bufs[3])
        return time.perf_counter() - t0

    def at_once() -> float:
        th = threading.Thread(target=copy, args=(bufs[2], bufs[3]))
        t0 = time.perf_counter()
        th.start()
        copy(bufs[0], bufs[1])
        th.join()
        return time.perf_counter() - t0

    row: list[float] = []
    once: list[float] = []
    for _ in range(max(5, 2 * reps)):
        row.append(in_a_row())
        once.append(at_once())
    a, b = median(row), median(once)
    return {
        "bytes": nbytes,
        "in_a_row_ms": round(a * 1e3, 3),
        "at_once_ms": round(b * 1e3, 3),
        "at_once_vs_in_a_row": round(b / a, 3) if a else 0.0,
    }


def _convert(env: Env, cfg: TopoConfig, ts: TopoSet, progress: Progress) -> dict[str, Any]:
    p, d = ts.engines["convert"]
    _, same = ts.engines["convert-same"]
    n = len(p.regions[0].buf) // cfg.block_bytes
    blocks = list(range(n))
    nbytes = n * cfg.block_bytes
    src, dst = p.arr(0)[:nbytes], same.arr(0)[:nbytes]
    rng = np.random.default_rng(7)
    src[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    hb = cfg.head_size * 2
    shape = (n, cfg.layers, 2, cfg.tokens, cfg.heads, hb)

    def memcpy() -> float:
        t0 = time.perf_counter()
        np.copyto(dst, src)
        return time.perf_counter() - t0

    runs: dict[str, Callable[[], float]] = {
        "memcpy": memcpy,
        "kvd NHD->NHD push": lambda: _transfer(env, p, same, blocks, "push"),
        "kvd NHD->HND push": lambda: _transfer(env, p, d, blocks, "push"),
        "kvd NHD->NHD pull": lambda: _transfer(env, p, same, blocks, "pull"),
        "kvd NHD->HND pull": lambda: _transfer(env, p, d, blocks, "pull"),
    }
    # checked once: D's HND bytes are P's NHD bytes transposed
    d.arr(0)[:nbytes] = 0
    runs["kvd NHD->HND pull"]()
    want = src.reshape(shape).transpose(0, 1, 2, 4, 3, 5)
    if not np.array_equal(
        d.arr(0)[:nbytes].reshape(n, cfg.layers, 2, cfg.heads, cfg.tokens, hb), want
    ):
        raise BenchError("layout conversion delivered wrong bytes")
    progress("topology: conversion checked")
    times: dict[str, list[float]] = {name: [] for name in CONVERT}
    for rep in range(cfg.reps):
        k = rep % len(CONVERT)
        for name in CONVERT[k:] + CONVERT[:k]:
            times[name].append(runs[name]())
        progress(f"topology: conversion rep {rep + 1}/{cfg.reps}")
    base = median(times["memcpy"])
    out: dict[str, Any] = {"bytes": nbytes}
    for name in CONVERT:
        med = median(times[name])
        out[name] = {
            "median_ms": round(med * 1e3, 3),
            "vs_memcpy": round(med / base, 3) if base else 0.0,
            "samples_ms": [round(t * 1e3, 3) for t in times[name]],
        }
    for mode in ("push", "pull"):
        # what converting adds to the same transfer, in memcpys of the request
        extra = median(times[f"kvd NHD->HND {mode}"]) - median(times[f"kvd NHD->NHD {mode}"])
        out[f"conversion {mode}"] = {
            "median_ms": round(extra * 1e3, 3),
            "vs_memcpy": round(extra / base, 3) if base else 0.0,
        }
    return out
