"""D-side staging (`kvd.core.staging`): the staged alternative of a pull lands every byte
where the reference says (direct pairs by their plans, staged P ranks read whole into a
slot and scattered), the cost rule picks staging where descriptors are many, and the
slot allocator hands out, frees and quarantines each slot exactly once."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from integration.kvref import Side, expected, spec_of
from kvd_client.errors import KvdError

from kvd.core.planner import permute_chunks, plan_request
from kvd.core.staging import ALIGN, StagingPool, plan_staged, scatter

from .test_topology import apply, regions, request_case

SIDES = st.builds(
    Side,
    tp=st.sampled_from([1, 2, 4, 8]),
    tokens=st.sampled_from([4, 8]),
    kv_layout=st.sampled_from(["NHD", "HND"]),
    major=st.sampled_from(["block", "layer"]),
    num_blocks=st.just(24),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    heads=st.sampled_from([1, 2, 4, 8]),
    mla=st.booleans(),
    ps=SIDES,
    ds=SIDES,
    ntok=st.integers(1, 40),
    hit=st.integers(0, 2),
    seed=st.integers(0, 2**16),
    always=st.booleans(),
)
def test_staged_pull_matches_the_reference(
    heads: int,
    mla: bool,
    ps: Side,
    ds: Side,
    ntok: int,
    hit: int,
    seed: int,
    always: bool,
) -> None:
    spec = spec_of(1, mla=True, head_size=4) if mla else spec_of(heads, head_size=4)
    if not mla and heads >= 2 and any(heads % s.tp and s.tp % heads for s in (ps, ds)):
        return
    rng = np.random.default_rng(seed)
    big = max(ps.tokens, ds.tokens)
    m = -(-ntok // ps.tokens)
    hit_d = hit * (big // ds.tokens)
    n = -(-ntok // ds.tokens) - hit_d
    if n <= 0 or m > ps.num_blocks or n > ds.num_blocks:
        return
    p_views, p_bufs, d_views, d_bufs, kv, pb, db = request_case(spec, ps, ds, m, n, rng)
    before = [b.copy() for b in d_bufs]
    rp = plan_request(p_views, pb, d_views, db, local_is_p=False)
    staged = plan_staged(p_views, pb, d_views, db, rp.pairs, rp, always=always)
    if staged is None:
        # nothing to stage: every pair already moves whole chunks in D's layout, or the
        # block sizes differ (then every P rank keeps its direct plan)
        assert (
            not always
            or ps.tokens != ds.tokens
            or all(pr.whole and ps.kv_layout == ds.kv_layout for pr in rp.pairs)
        )
        return
    slot = np.zeros(staged.nbytes, dtype=np.uint8)
    for i in staged.direct:
        pair = rp.pairs[i]
        pv, dv = p_views[pair.p], d_views[pair.d]
        apply(
            rp.plans[i],
            p_bufs[pair.p],
            pv.geometry.base_addr,
            d_bufs[pair.d],
            dv.geometry.base_addr,
            False,
        )
    for read in staged.reads:
        pv = p_views[read.p]
        apply(read.plan, p_bufs[read.p], pv.geometry.base_addr, slot, 0, False)
    # nothing of D's was written by the staged READs themselves
    touched = {rp.pairs[i].d for i in staged.direct}
    for r in range(ds.tp):
        if r not in touched:
            assert np.array_equal(d_bufs[r], before[r])
    for job in staged.scatters:
        scatter(slot, d_bufs[job.d], job)
    for pjob in staged.permutes:
        d = rp.pairs[pjob.pair].d
        permute_chunks(d_bufs[d], d_views[d].geometry, pjob)
    for r in range(ds.tp):
        lay = d_views[r].layout
        assert lay is not None
        want = expected(before[r], lay, spec, ds.tp, r, db, hit_d * ds.tokens, kv)
        assert np.array_equal(d_bufs[r], want), f"D rank {r} differs"
    # each staged P rank is read once, whatever the number of D ranks it feeds
    assert len({r.p for r in staged.reads}) == len(staged.reads)


def test_the_rule_stages_head_slices_and_conversions_of_many_descriptors() -> None:
    spec = spec_of(8, head_size=64)
    for ps, ds in (
        (Side(8, 16, "HND", num_blocks=64), Side(4, 16, "HND", num_blocks=64)),
        (Side(4, 16, "HND", num_blocks=64), Side(8, 16, "HND", num_blocks=64)),
        (Side(4, 16, "NHD", num_blocks=64), Side(8, 16, "NHD", num_blocks=64)),
        (Side(4, 16, "NHD", num_blocks=64), Side(8, 16, "HND", num_blocks=64)),
    ):
        p_views, _ = regions(spec, ps, 1 << 20)
        d_views, _ = regions(spec, ds, 1 << 32)
        blocks = list(np.random.default_rng(1).permutation(64)[:16].tolist())
        rp = plan_request(p_views, blocks, d_views, blocks, local_is_p=False)
        staged = plan_staged(p_views, blocks, d_views, blocks, rp.pairs, rp)
        assert staged is not None, (ps, ds)
        # the estimate of the direct plan's descriptors (no direct plan built) agrees
        guess = plan_staged(p_views, blocks, d_views, blocks, rp.pairs)
        assert guess is not None and guess.direct == () and guess.nbytes == staged.nbytes
        assert staged.direct == ()
        assert len(staged.reads) == ps.tp
        # whole P blocks: one descriptor per block and P rank
        assert sum(r.plan.descriptors for r in staged.reads) == 16 * ps.tp
        assert staged.cost_staged_s < staged.cost_direct_s
    # only the token layout differs: whole chunks READ into D's blocks, then permuted in
    # place (PERMUTE_BPS, faster than a staged scatter), unless told to stage anyway
    p_views, _ = regions(spec, Side(1, 16, "NHD", num_blocks=64), 1 << 20)
    d_views, _ = regions(spec, Side(1, 16, "HND", num_blocks=64), 1 << 32)
    blocks = list(np.random.default_rng(1).permutation(64)[:16].tolist())
    rp = plan_request(p_views, blocks, d_views, blocks, local_is_p=False)
    assert rp.permutes and plan_staged(p_views, blocks, d_views, blocks, rp.pairs, rp) is None
    forced = plan_staged(p_views, blocks, d_views, blocks, rp.pairs, rp, always=True)
    assert forced is not None and forced.cost_staged_s > forced.cost_direct_s
    # equal TP and layouts: whole chunks already, nothing to stage
    p_views, _ = regions(spec, Side(4, 16, "HND"), 1 << 20)
    d_views, _ = regions(spec, Side(4, 16, "HND"), 1 << 32)
    rp = plan_request(p_views, [1, 2], d_views, [3, 4], local_is_p=False)
    assert plan_staged(p_views, [1, 2], d_views, [3, 4], rp.pairs, rp) is None
    # D in GPU memory keeps the direct plans
    p_views, _ = regions(spec, Side(8, 16, "HND"), 1 << 20)
    d_views, _ = regions(spec, Side(4, 16, "HND"), 1 << 32)
    gpu = [type(v)(**{**v.__dict__, "mem_type": "VRAM"}) for v in d_views]
    rp = plan_request(p_views, [1, 2], gpu, [3, 4], local_is_p=False)
    assert plan_staged(p_views, [1, 2], gpu, [3, 4], rp.pairs, rp, always=True) is None


def test_pool_hands_out_frees_and_quarantines_each_slot_once() -> None:
    pool = StagingPool(10 * ALIGN)
    a = pool.alloc(1)
    b = pool.alloc(4 * ALIGN)
    c = pool.alloc(5 * ALIGN)
    assert (a, b, c) == (0, ALIGN, 5 * ALIGN)
    assert pool.alloc(1) is None and pool.exhausted == 1  # full: the caller goes direct
    pool.free(b)
    with pytest.raises(KvdError):
        pool.free(b)  # twice
    pool.quarantine(c)
    with pytest.raises(KvdError):
        pool.free(c)  # quarantined: only release ends it
    assert pool.alloc(5 * ALIGN) is None  # the quarantined slot is not handed out again
    assert pool.alloc(4 * ALIGN) == ALIGN
    pool.release(c)
    with pytest.raises(KvdError):
        pool.release(c)
    pool.free(a)
    pool.free(ALIGN)
    assert pool.snapshot() == {
        "size": 10 * ALIGN,
        "used": 0,
        "slots": 0,
        "quarantined": 0,
        "exhausted": 2,
        "allocated": 4,
    }
    assert pool.alloc(10 * ALIGN) == 0  # the free ranges merged again


def test_a_scatter_refuses_a_block_outside_d_region() -> None:
    """A scatter naming a D block before the first or past the last of D's region raises
    (an index on the block axis would take a negative one from the end) and writes
    nothing of D's."""
    spec = spec_of(8, head_size=4)
    ps, ds = Side(tp=4, kv_layout="HND"), Side(tp=2, kv_layout="HND")
    rng = np.random.default_rng(3)
    p_views, _, d_views, d_bufs, _, pb, db = request_case(spec, ps, ds, 2, 2, rng)
    rp = plan_request(p_views, pb, d_views, db, local_is_p=False)
    staged = plan_staged(p_views, pb, d_views, db, rp.pairs, rp, always=True)
    assert staged is not None and staged.scatters
    job = staged.scatters[0]
    slot = np.ones(staged.nbytes, dtype=np.uint8)
    before = d_bufs[job.d].copy()
    for bad in (-1, ds.num_blocks):
        blocks = job.blocks.copy()
        blocks[-1] = bad
        with pytest.raises(IndexError):
            scatter(slot, d_bufs[job.d], dataclasses.replace(job, blocks=blocks))
        if bad < 0:
            assert np.array_equal(d_bufs[job.d], before)
    scatter(slot, d_bufs[job.d], job)  # the job as planned goes through
