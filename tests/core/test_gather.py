"""P-side staging of a push (`kvd.core.gather`): a gathered push lands in D exactly the
bytes its direct plan would (every byte of every D region compared), and the rule stages
only where it saves many descriptors."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from integration.kvref import Side, spec_of

import kvd.core.gather as gather_mod
from kvd.core.gather import (
    MAX_MEAN_PIECE,
    MIN_FACTOR,
    Folded,
    Gathered,
    fold,
    gather,
    instantiate,
    plan_gather,
    plan_template,
    prepare,
    split,
)
from kvd.core.planner import plan_request

from .test_topology import SIDES, apply, regions, request_case


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    heads=st.sampled_from([1, 2, 4, 8]),
    head_size=st.sampled_from([4, 32, 64]),
    ps=SIDES,
    ds=SIDES,
    ntok=st.integers(1, 80),
    seed=st.integers(0, 2**16),
)
def test_a_gathered_push_lands_what_the_direct_plan_lands(
    heads: int, head_size: int, ps: Side, ds: Side, ntok: int, seed: int
) -> None:
    if heads >= 2 and any(heads % s.tp and s.tp % heads for s in (ps, ds)):
        return
    check(heads, head_size, ps, ds, ntok, seed)


def check(heads: int, head_size: int, ps: Side, ds: Side, ntok: int, seed: int) -> bool:
    """Push `ntok` tokens P -> D by the direct plan and gathered; both must land the same
    bytes in every D region. Whether it was gathered (False: the rule declined)."""
    spec = spec_of(heads, head_size=head_size)
    rng = np.random.default_rng(seed)
    m = -(-ntok // ps.tokens)
    n = -(-ntok // ds.tokens)
    if m > ps.num_blocks or n > ds.num_blocks:
        return False
    p_views, p_bufs, d_views, d_bufs, _, pb, db = request_case(spec, ps, ds, m, n, rng)
    direct = [b.copy() for b in d_bufs]
    staged_d = [b.copy() for b in d_bufs]
    rp = plan_request(p_views, pb, d_views, db, local_is_p=True)
    for plan, pair in zip(rp.plans, rp.pairs, strict=True):
        pv, dv = p_views[pair.p], d_views[pair.d]
        apply(
            plan, p_bufs[pair.p], pv.geometry.base_addr, direct[pair.d], dv.geometry.base_addr, True
        )
    templated = check_template(p_views, p_bufs, pb, d_views, d_bufs, db, direct)
    g = plan_gather(
        rp.plans,
        [x.p for x in rp.pairs],
        [x.d for x in rp.pairs],
        [v.geometry.base_addr for v in p_views],
    )
    if g is None:
        return templated
    assert g.descriptors * MIN_FACTOR <= sum(p.descriptors for p in rp.plans)
    slot = np.zeros(g.nbytes + 7, dtype=np.uint8)  # (any slack after the pieces is unused)
    gather(slot, p_bufs, g)
    check_split(g, slot, p_bufs)
    for w in g.writes:
        dv = d_views[w.remote]
        apply(w.plan, slot, 0, staged_d[w.remote], dv.geometry.base_addr, True)
    for r in range(ds.tp):
        assert np.array_equal(staged_d[r], direct[r]), f"D rank {r} differs"
    return True


def check_template(
    p_views: list,
    p_bufs: list,
    pb: list[int],
    d_views: list,
    d_bufs: list,
    db: list[int],
    want: list,
) -> bool:
    """The same request gathered from its shape's template (where one applies) lands
    the same bytes as its direct plans (`want`). Whether a template applied."""
    t = plan_template(p_views, d_views)
    if t is None:
        return False
    g = instantiate(t, p_views, pb, d_views, db)
    if g is None:
        return False
    slot = np.zeros(g.nbytes, dtype=np.uint8)
    gather(slot, p_bufs, g)
    check_split(g, slot, p_bufs)
    got = [b.copy() for b in d_bufs]
    for w in g.writes:
        dv = d_views[w.remote]
        apply(w.plan, slot, 0, got[w.remote], dv.geometry.base_addr, True)
    for r, (a, b) in enumerate(zip(got, want, strict=True)):
        assert np.array_equal(a, b), f"D rank {r} differs (template)"
    # in parts of D blocks (a pipelined push): the same slot, the same bytes at D
    prep = prepare(t, p_views, pb, d_views, db)
    assert prep is not None and prep.nbytes == g.nbytes
    for k in (2, 3, prep.blocks):
        bounds = [i * prep.blocks // k for i in range(k + 1)]
        slot_k = np.zeros(g.nbytes, dtype=np.uint8)
        got_k = [b.copy() for b in d_bufs]
        for a, b in itertools.pairwise(bounds):
            part = prep.part(a, b)
            gather(slot_k, p_bufs, part)
            for w in part.writes:  # WRITten before the next part is gathered
                dv = d_views[w.remote]
                apply(w.plan, slot_k, 0, got_k[w.remote], dv.geometry.base_addr, True)
        assert np.array_equal(slot_k, slot)
        for r, (a_, b_) in enumerate(zip(got_k, want, strict=True)):
            assert np.array_equal(a_, b_), f"D rank {r} differs (template, {k} parts)"
    whole = prep.part(0, prep.blocks)
    assert [w.plan.descriptors for w in whole.writes] == [w.plan.descriptors for w in g.writes]
    return True


def check_split(g: Gathered, want: np.ndarray, p_bufs: list) -> None:
    """Gathered part by part (`split`, as a pipelined push does), the slot holds the same
    bytes, and the parts' WRITEs are the whole gather's, in order, each part's region
    filled only by its own copies."""
    for parts in (2, 3, len(g.writes)):
        cut = split(g, parts, 1)
        assert len(cut) == min(parts, len(g.writes)) or len(cut) < parts
        assert [w for c in cut for w in c.writes] == list(g.writes)
        assert sum(len(c.copies) for c in cut) == len(g.copies)
        slot = np.zeros_like(want)
        for c in cut:
            gather(slot, p_bufs, c)
            for w in c.writes:  # this part's WRITE reads only bytes gathered by now
                for la, ln in zip(w.plan.local_addrs, w.plan.lengths, strict=True):
                    assert np.array_equal(slot[la : la + ln], want[la : la + ln])
        assert np.array_equal(slot, want)


def test_split_cuts_whole_regions_and_merges_a_small_tail() -> None:
    from kvd.core.gather import RowCopy, Staged
    from kvd.core.planner import Plan

    def staged(r: int, nbytes: int) -> Staged:
        one = np.array([nbytes], dtype=np.int64)
        return Staged(r, 0, Plan(one * 0, one * 0, one))

    rows = np.zeros(1, dtype=np.int64)
    copies = tuple(RowCopy(0, rows, rows) for _ in range(8))
    g = Gathered(0, 16, copies, tuple(staged(r, 4 << 20) for r in range(4)), (0, 2, 4, 6))
    cut = split(g, 4, 1 << 20)
    assert [len(c.writes) for c in cut] == [1, 1, 1, 1]
    assert [c.firsts for c in cut] == [(0,)] * 4 and all(len(c.copies) == 2 for c in cut)
    assert [len(c.writes) for c in split(g, 2, 1 << 20)] == [2, 2]
    assert split(g, 4, 16 << 20) == (g,)  # parts of at least the whole: none
    assert [len(c.writes) for c in split(g, 4, 6 << 20)] == [2, 2]
    # a tail under min_bytes goes with the part before it
    g3 = Gathered(0, 16, copies[:6], (*g.writes[:2], staged(2, 1 << 10)), (0, 2, 4))
    assert [len(c.writes) for c in split(g3, 3, 1 << 20)] == [1, 2]
    assert split(g, 1, 1) == (g,)
    unknown = Gathered(0, 16, copies, g.writes, ())  # (no firsts: not cut)
    assert split(unknown, 4, 1) == (unknown,)


@pytest.mark.parametrize(("piece", "loop"), [(1 << 20, 32 << 10), (256, 1), (1 << 20, 1 << 30)])
def test_head_slices_both_ways_and_token_runs_are_gathered_exactly(
    piece: int, loop: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Also copied in small pieces (`GATHER_PIECE_BYTES`: a few rows per numpy call), and
    strided block copies block by block or many blocks per call (`BLOCK_LOOP_BYTES`)."""
    monkeypatch.setattr(gather_mod, "GATHER_PIECE_BYTES", piece)
    monkeypatch.setattr(gather_mod, "BLOCK_LOOP_BYTES", loop)
    for p_tp, d_tp, lay in ((4, 8, "HND"), (8, 4, "HND"), (4, 8, "NHD"), (2, 8, "NHD")):
        ps = Side(tp=p_tp, tokens=16, kv_layout=lay, major="block", num_blocks=24)
        ds = Side(tp=d_tp, tokens=16, kv_layout=lay, major="block", num_blocks=24)
        assert check(8, 64, ps, ds, 200, p_tp * 10 + d_tp), (p_tp, d_tp, lay)
        # and from the shape's template, D naming fewer blocks than P (a prefix hit)
        spec = spec_of(8, head_size=64)
        rng = np.random.default_rng(p_tp)
        p_views, p_bufs, d_views, d_bufs, _, pb, db = request_case(spec, ps, ds, 13, 11, rng)
        want = [b.copy() for b in d_bufs]
        rp = plan_request(p_views, pb, d_views, db, local_is_p=True)
        for plan, pair in zip(rp.plans, rp.pairs, strict=True):
            pv, dv = p_views[pair.p], d_views[pair.d]
            apply(
                plan,
                p_bufs[pair.p],
                pv.geometry.base_addr,
                want[pair.d],
                dv.geometry.base_addr,
                True,
            )
        assert check_template(p_views, p_bufs, pb, d_views, d_bufs, db, want), (p_tp, d_tp, lay)


def test_the_rule_stages_head_slices_not_whole_chunks() -> None:
    """TP 4 -> 8 in HND (each D rank a head slice of every P chunk) is staged into a run
    per D block; equal TP (whole chunks, already few descriptors) is not."""
    spec = spec_of(8, head_size=64)
    ps = Side(tp=4, tokens=16, kv_layout="HND", major="block", num_blocks=24)
    ds = Side(tp=8, tokens=16, kv_layout="HND", major="block", num_blocks=24)
    p_views, _ = regions(spec, ps, 1 << 20)
    d_views, _ = regions(spec, ds, 1 << 30)
    pb, db = list(range(0, 24, 2)), list(range(1, 24, 2))  # 12 blocks each, not adjacent
    rp = plan_request(p_views, pb, d_views, db, local_is_p=True)
    g = plan_gather(
        rp.plans,
        [x.p for x in rp.pairs],
        [x.d for x in rp.pairs],
        [v.geometry.base_addr for v in p_views],
    )
    assert g is not None
    assert g.descriptors == 8 * 12  # a run per D block per D rank
    assert sum(p.descriptors for p in rp.plans) >= 8 * 12 * spec.num_layers
    ds4 = Side(tp=4, tokens=16, kv_layout="HND", major="block", num_blocks=24)
    d4, _ = regions(spec, ds4, 1 << 30)
    rp4 = plan_request(p_views, pb, d4, db, local_is_p=True)
    assert (
        plan_gather(
            rp4.plans,
            [x.p for x in rp4.pairs],
            [x.d for x in rp4.pairs],
            [v.geometry.base_addr for v in p_views],
        )
        is None
    )


@pytest.mark.parametrize("head_size", [256, 512])
def test_pieces_as_large_as_the_bound_are_written_directly_not_gathered(head_size: int) -> None:
    """The same head-sliced shape (TP 4 -> 8, HND: one head of 16 tokens per piece) is
    gathered while its pieces are smaller than `MAX_MEAN_PIECE` (8 KiB) and written
    directly from that size on (16 KiB: a pass over the bytes costs more than the
    descriptors it saves), by the direct plan's gather and by the template alike."""
    spec = spec_of(8, head_size=head_size)
    ps = Side(tp=4, tokens=16, kv_layout="HND", major="block", num_blocks=24)
    ds = Side(tp=8, tokens=16, kv_layout="HND", major="block", num_blocks=24)
    p_views, _ = regions(spec, ps, 1 << 20)
    d_views, _ = regions(spec, ds, 1 << 32)
    pb, db = list(range(0, 24, 2)), list(range(1, 24, 2))
    rp = plan_request(p_views, pb, d_views, db, local_is_p=True)
    pieces = sum(p.descriptors for p in rp.plans)
    mean = sum(p.total_bytes for p in rp.plans) // pieces
    assert mean == 16 * head_size * 2  # bfloat16
    small = mean < MAX_MEAN_PIECE
    g = plan_gather(
        rp.plans,
        [x.p for x in rp.pairs],
        [x.d for x in rp.pairs],
        [v.geometry.base_addr for v in p_views],
    )
    assert (g is not None) == small
    t = plan_template(p_views, d_views)
    assert t is not None
    assert (prepare(t, p_views, pb, d_views, db) is not None) == small


def _expand(f: Folded) -> tuple[np.ndarray, np.ndarray]:
    """The rows a `Folded` pattern copies, in order (the inverse of `fold`)."""
    idx = np.indices(f.shape).reshape(len(f.shape), -1) if f.shape else np.zeros((0, 1), int)
    s = f.src0 + sum(i * x for i, x in zip(idx, f.src_strides, strict=True))
    d = f.dst0 + sum(i * x for i, x in zip(idx, f.dst_strides, strict=True))
    s = np.atleast_1d(s)[:, None] + np.arange(f.item_rows)
    d = np.atleast_1d(d)[:, None] + np.arange(f.item_rows)
    return s.ravel(), d.ravel()


@settings(max_examples=200, deadline=None)
@given(
    dims=st.lists(st.tuples(st.integers(1, 5), st.integers(0, 40), st.integers(0, 40)), max_size=3),
    item=st.integers(1, 4),
    s0=st.integers(0, 9),
    d0=st.integers(0, 9),
)
def test_fold_finds_the_strided_pattern_of_any_grid(
    dims: list[tuple[int, int, int]], item: int, s0: int, d0: int
) -> None:
    """Rows laid out as an n-D grid of runs fold back into a pattern that copies exactly
    those rows, in the same order (perhaps with fewer dimensions: merged where regular)."""
    grid = Folded(
        item,
        tuple(n for n, _, _ in dims),
        tuple(a * item for _, a, _ in dims),
        tuple(b * item for _, _, b in dims),
        s0,
        d0,
    )
    src, dst = _expand(grid)
    f = fold(src, dst)
    if f is None:  # (overlapping or touching runs of a degenerate grid may not fold)
        return
    got_s, got_d = _expand(f)
    assert np.array_equal(got_s, src) and np.array_equal(got_d, dst)


def test_fold_refuses_what_is_not_a_grid() -> None:
    rows = np.array([0, 1, 2, 5, 6, 7, 9, 10, 11], dtype=np.int64)  # steps 5 then 4
    assert fold(rows, np.arange(9, dtype=np.int64)) is None
    uneven = np.array([0, 1, 4, 5, 6], dtype=np.int64)  # runs of 2 and 3
    assert fold(uneven, np.arange(5, dtype=np.int64)) is None
    backwards = np.array([8, 9, 0, 1], dtype=np.int64)
    assert fold(backwards, np.arange(4, dtype=np.int64)) is None
    f = fold(np.array([0, 1, 4, 5, 8, 9], dtype=np.int64), np.arange(6, dtype=np.int64))
    assert f is not None and (f.item_rows, f.shape, f.src_strides, f.dst_strides) == (
        2,
        (3,),
        (4,),
        (2,),
    )
