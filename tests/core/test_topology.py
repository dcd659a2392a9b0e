"""The planner's mapping of any P onto any D, against the numpy reference of
tests/integration/kvref.py (in the model's terms: tokens and global heads, not offsets).

Regions live in plain numpy buffers; a plan is applied by copying each descriptor's
bytes, as NIXL would."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from integration.kvref import Side, compat, expected, fill, rank_layout, request_kv, spec_of
from kvd_client import layout as kvlayout
from kvd_client import wire
from kvd_client.errors import Incompatible, InvalidRequest
from kvd_client.layout import KvSpec

from kvd.core.planner import (
    Geometry,
    Plan,
    align_tokens,
    permute_chunks,
    plan_request,
    receive_permutes,
    shift_plan,
)
from kvd.core.topology import map_ranks


@dataclass(frozen=True)
class View:
    tp_rank: int
    tp_size: int
    compat: str
    geometry: Geometry
    layout: wire.RegionLayout | None
    mem_type: str = "DRAM"


def regions(spec: KvSpec, side: Side, base: int) -> tuple[list[View], list[np.ndarray]]:
    views, bufs = [], []
    for rank in range(side.tp):
        lay = rank_layout(spec, side, rank)
        n = kvlayout.region_bytes(lay)
        views.append(View(rank, side.tp, compat(spec), Geometry.from_layout(base, n, lay), lay))
        bufs.append(np.zeros(n, dtype=np.uint8))
        base += n + 4096
    return views, bufs


def request_case(
    spec: KvSpec, ps: Side, ds: Side, m: int, n: int, rng: np.random.Generator
) -> tuple[list[View], list[np.ndarray], list[View], list[np.ndarray], Any, list[int], list[int]]:
    """P's and D's regions for one request of `m` P blocks onto `n` D blocks, drawn at
    random: P's filled from the request's KV (returned), D's with noise."""
    p_views, p_bufs = regions(spec, ps, 1 << 20)
    d_views, d_bufs = regions(spec, ds, 1 << 30)
    kv = request_kv(spec, m * ps.tokens, rng)
    pb = [int(b) for b in rng.permutation(ps.num_blocks)[:m]]
    db = [int(b) for b in rng.permutation(ds.num_blocks)[:n]]
    for r in range(ps.tp):
        fill(p_bufs[r], p_views[r].layout, spec, ps.tp, r, pb, kv)  # type: ignore[arg-type]
    for buf in d_bufs:
        buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
    return p_views, p_bufs, d_views, d_bufs, kv, pb, db


def apply(
    plan: Plan, src: np.ndarray, src_base: int, dst: np.ndarray, dst_base: int, local_is_src: bool
) -> None:
    la, ra = plan.local_addrs, plan.remote_addrs
    s_addr, d_addr = (la, ra) if local_is_src else (ra, la)
    for s, d, n in zip(s_addr.tolist(), d_addr.tolist(), plan.lengths.tolist(), strict=True):
        dst[d - dst_base : d - dst_base + n] = src[s - src_base : s - src_base + n]


SIDES = st.builds(
    Side,
    tp=st.sampled_from([1, 2, 4, 8]),
    tokens=st.sampled_from([4, 8, 16]),
    kv_layout=st.sampled_from(["NHD", "HND"]),
    major=st.sampled_from(["block", "layer"]),
    num_blocks=st.just(24),
)


REQUESTS: dict[str, Any] = {
    "heads": st.sampled_from([1, 2, 4, 8]),
    "mla": st.booleans(),
    "ps": SIDES,
    "ds": SIDES,
    "ntok": st.integers(1, 40),
}
"""A request between any two sides: KV heads (or MLA), P's and D's sides, its tokens."""


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    **REQUESTS,
    hit=st.integers(0, 2),
    local_is_p=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_any_p_onto_any_d_matches_the_reference(
    heads: int, mla: bool, ps: Side, ds: Side, ntok: int, hit: int, local_is_p: bool, seed: int
) -> None:
    spec = spec_of(1, mla=True, head_size=4) if mla else spec_of(heads, head_size=4)
    if not mla and heads >= 2 and any(heads % s.tp and s.tp % heads for s in (ps, ds)):
        return  # not a valid split (the registrar refuses such a region)
    rng = np.random.default_rng(seed)
    big = max(ps.tokens, ds.tokens)
    m = -(-ntok // ps.tokens)
    # D's own prefix ends on a boundary of the larger block
    hit_d = hit * (big // ds.tokens)
    n = -(-ntok // ds.tokens) - hit_d
    if n <= 0 or m > ps.num_blocks or n > ds.num_blocks:
        return
    p_views, p_bufs, d_views, d_bufs, kv, pb, db = request_case(spec, ps, ds, m, n, rng)
    before = [b.copy() for b in d_bufs]
    rp = plan_request(p_views, pb, d_views, db, local_is_p=local_is_p)
    for pair, plan in zip(rp.pairs, rp.plans, strict=True):
        pv, dv = p_views[pair.p], d_views[pair.d]
        if local_is_p:
            apply(
                plan,
                p_bufs[pair.p],
                pv.geometry.base_addr,
                d_bufs[pair.d],
                dv.geometry.base_addr,
                True,
            )
        else:
            apply(
                plan,
                p_bufs[pair.p],
                pv.geometry.base_addr,
                d_bufs[pair.d],
                dv.geometry.base_addr,
                False,
            )
    # D's receive step: blocks that arrived in P's token layout are permuted into D's
    _, permutes = receive_permutes(p_views, d_views, db)
    assert [(j.pair, j.blocks.tolist()) for j in permutes] == [
        (j.pair, j.blocks.tolist()) for j in rp.permutes
    ]
    for job in rp.permutes:
        d = rp.pairs[job.pair].d
        permute_chunks(d_bufs[d], d_views[d].geometry, job)
    for r in range(ds.tp):
        lay = d_views[r].layout
        assert lay is not None
        want = expected(before[r], lay, spec, ds.tp, r, db, hit_d * ds.tokens, kv)
        assert np.array_equal(d_bufs[r], want), f"D rank {r} differs"
    # each D head comes from one P replica only: bytes moved = what D's ranks hold
    head_bytes = spec.head_bytes * (1 if mla else 2) * spec.num_layers
    moved = sum(p.total_bytes for p in rp.plans)
    d_heads = sum(
        v.layout.chunk_bytes // (v.layout.tokens_per_block * spec.head_bytes)
        for v in d_views
        if v.layout is not None
    )
    units_tokens = min(m * ps.tokens - 0, (hit_d + n) * ds.tokens) - hit_d * ds.tokens
    assert moved == d_heads * head_bytes * units_tokens


def test_transfers_per_pair_of_ranks() -> None:
    """P TP > D TP: several P ranks per D rank; P TP < D TP: a slice of one P rank;
    replicated heads: one replica per head, spread over the replicas."""

    def pairs(spec: KvSpec, p: int, d: int) -> list[tuple[int, int, int, int, int]]:
        pv, _ = regions(spec, Side(p, num_blocks=2), 0)
        dv, _ = regions(spec, Side(d, num_blocks=2), 1 << 30)
        return [(x.p, x.d, x.p_head, x.d_head, x.heads) for x in map_ranks(pv, dv)]

    h8 = spec_of(8)
    assert pairs(h8, 2, 2) == [(0, 0, 0, 0, 4), (1, 1, 0, 0, 4)]
    assert pairs(h8, 4, 2) == [(0, 0, 0, 0, 2), (1, 0, 0, 2, 2), (2, 1, 0, 0, 2), (3, 1, 0, 2, 2)]
    assert pairs(h8, 2, 4) == [(0, 0, 0, 0, 2), (0, 1, 2, 0, 2), (1, 2, 0, 0, 2), (1, 3, 2, 0, 2)]
    h2 = spec_of(2)  # replicated at TP 4: ranks 0,1 hold head 0; 2,3 head 1
    assert pairs(h2, 4, 1) == [(0, 0, 0, 0, 1), (2, 0, 0, 1, 1)]
    assert pairs(h2, 4, 4) == [(0, 0, 0, 0, 1), (1, 1, 0, 0, 1), (2, 2, 0, 0, 1), (3, 3, 0, 0, 1)]
    assert pairs(h2, 1, 4) == [(0, 0, 0, 0, 1), (0, 1, 0, 0, 1), (0, 2, 1, 0, 1), (0, 3, 1, 0, 1)]
    mla = spec_of(1, mla=True)
    assert pairs(mla, 4, 2) == [(0, 0, 0, 0, 1), (1, 1, 0, 0, 1)]
    assert pairs(mla, 1, 3) == [(0, 0, 0, 0, 1), (0, 1, 0, 0, 1), (0, 2, 0, 0, 1)]


def test_align_tokens_both_ways() -> None:
    a = np.arange(10, 16, dtype=np.int64)  # P's 6 blocks
    pb, unit, units = align_tokens(a, 16, np.arange(4, dtype=np.int64), 16)
    assert (pb.tolist(), unit, units) == ([12, 13, 14, 15], 16, 4)  # equal: P's last 4
    pb, unit, units = align_tokens(a[:5], 16, np.arange(2, dtype=np.int64), 32)
    assert (pb.tolist(), unit, units) == ([12, 13, 14], 16, 3)  # D spans 3: 1 prefix block
    pb, unit, units = align_tokens(a[:2], 32, np.arange(3, dtype=np.int64), 16)
    assert (pb.tolist(), unit, units) == ([10, 11], 16, 3)  # a partial last D block
    with pytest.raises(
        InvalidRequest, match="D has 5 blocks of 16 tokens to fill but P has only 2 blocks of 32"
    ):
        align_tokens(a[:2], 32, np.arange(5, dtype=np.int64), 16)
    with pytest.raises(Incompatible, match="non-integer factor: P 16, D 24"):
        align_tokens(a, 16, a, 24)


def test_a_layout_conversion_moves_whole_chunks_into_host_memory_and_descriptors_into_gpu() -> None:
    spec = spec_of(4)
    pv, _ = regions(spec, Side(1, 16, "NHD"), 0)
    dv, _ = regions(spec, Side(1, 16, "HND"), 1 << 30)
    blocks = list(range(6))
    rp = plan_request(pv, blocks, dv, blocks, local_is_p=True)
    assert rp.plans[0].descriptors == 1 and len(rp.permutes) == 1  # one run, then permuted
    gpu = [View(v.tp_rank, v.tp_size, v.compat, v.geometry, v.layout, "VRAM") for v in dv]
    rp = plan_request(pv, blocks, gpu, blocks, local_is_p=True)
    # about one descriptor per (block, layer, part, token, head): a few runs happen to merge
    assert rp.permutes == () and rp.plans[0].descriptors > 6 * 2 * 2 * 16 * 3


def test_whole_heads_and_equal_layouts_cost_what_whole_chunks_cost() -> None:
    spec = spec_of(4)
    pv, _ = regions(spec, Side(2, 16, "HND", "layer"), 0)
    dv, _ = regions(spec, Side(4, 16, "HND", "layer"), 1 << 30)
    blocks = list(range(4))
    rp = plan_request(pv, blocks, dv, blocks, local_is_p=True)
    # a head slice in HND: one contiguous run per (layer, part, block)
    assert [p.descriptors for p in rp.plans] == [2 * 2 * 4] * 4
    # whole heads, equal layouts: a run of blocks per (layer, part), as whole chunks
    rp = plan_request(pv, blocks, pv, blocks, local_is_p=True)
    assert [p.descriptors for p in rp.plans] == [2 * 2] * 2
    pv, _ = regions(spec, Side(2, 16, "NHD", "layer"), 0)
    dv, _ = regions(spec, Side(4, 16, "NHD", "layer"), 1 << 30)
    rp = plan_request(pv, blocks, dv, blocks, local_is_p=True)
    # the same slice in NHD: one descriptor per token of each (layer, part, block)
    assert [p.descriptors for p in rp.plans] == [2 * 2 * 4 * 16] * 4


def test_an_in_place_permute_taken_in_pieces_equals_one_taken_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`permute_chunks` copies a long run of consecutive blocks at most PERMUTE_RUN_BYTES
    at a time: pieces of one block, of three, and the whole run give the same bytes."""
    import kvd.core.planner as planner

    spec = spec_of(4, head_size=8)
    side = Side(1, 8, "NHD", num_blocks=24)
    (view,), (buf,) = regions(spec, side, 1 << 20)
    rng = np.random.default_rng(7)
    buf[:] = rng.integers(0, 256, buf.size, dtype=np.uint8)
    blocks = np.array([3, 4, 5, 6, 7, 8, 9, 15, 16, 2], dtype=np.int64)
    head_bytes = spec.head_size * 2
    job = planner.Permute(0, blocks, "NHD", side.tokens, spec.num_kv_heads, head_bytes)
    block_bytes = spec.num_layers * 2 * side.tokens * spec.num_kv_heads * head_bytes
    outs = []
    for run in (block_bytes, 3 * block_bytes, 1 << 30):
        monkeypatch.setattr(planner, "PERMUTE_RUN_BYTES", run)
        got = buf.copy()
        planner.permute_chunks(got, view.geometry, job)
        outs.append(got)
    assert not np.array_equal(outs[2], buf)
    assert np.array_equal(outs[0], outs[2]) and np.array_equal(outs[1], outs[2])


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**REQUESTS, layers=st.integers(2, 5), data=st.data())
def test_a_later_range_of_layers_is_the_first_ones_plan_moved(
    heads: int, mla: bool, ps: Side, ds: Side, ntok: int, layers: int, data: Any
) -> None:
    """What a layer-wise push relies on to plan each range once (`shift_plan`): the plan
    of layers [f, f + n) of a request equals that of [g, g + n) moved by f - g layer
    strides on each side, descriptor for descriptor, for any topology and layout."""
    if mla:
        spec = spec_of(1, mla=True, head_size=4, layers=layers)
    else:
        spec = spec_of(heads, head_size=4, layers=layers)
    if not mla and heads >= 2 and any(heads % s.tp and s.tp % heads for s in (ps, ds)):
        return
    m, n = -(-ntok // ps.tokens), -(-ntok // ds.tokens)
    if m > ps.num_blocks or n > ds.num_blocks:
        return
    rng = np.random.default_rng(data.draw(st.integers(0, 2**16)))
    p_views, _, d_views, _, _, pb, db = request_case(spec, ps, ds, m, n, rng)
    width = data.draw(st.integers(1, layers - 1))
    g = data.draw(st.integers(0, layers - width))
    f = data.draw(st.integers(0, layers - width))

    def sliced(views: list[View], first: int) -> list[View]:
        return [replace(v, geometry=v.geometry.layers(first, first + width)) for v in views]

    try:
        base = plan_request(sliced(p_views, g), pb, sliced(d_views, g), db, local_is_p=True)
    except Incompatible:
        return  # a pair that cannot map (the handshake refuses it)
    want = plan_request(sliced(p_views, f), pb, sliced(d_views, f), db, local_is_p=True)
    moved = shift_plan(
        base,
        [(f - g) * p_views[x.p].geometry.layer_stride for x in base.pairs],
        [(f - g) * d_views[x.d].geometry.layer_stride for x in base.pairs],
    )
    assert moved.pairs == want.pairs
    for a, b in zip(moved.plans, want.plans, strict=True):
        assert np.array_equal(a.local_addrs, b.local_addrs)
        assert np.array_equal(a.remote_addrs, b.remote_addrs)
        assert np.array_equal(a.lengths, b.lengths)
    assert [(j.pair, j.blocks.tolist()) for j in moved.permutes] == [
        (j.pair, j.blocks.tolist()) for j in want.permutes
    ]
