"""Hybrid regions, sans IO: group validation, id splitting, what each group kind moves
(bytes checked in simulated memory against chunk-by-chunk expectations), the push-side
permutes agreeing with the plan, and refusals that name both sides."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import pytest
from kvd_client import layout as kvlayout
from kvd_client import wire
from kvd_client.errors import Incompatible, InvalidRequest

from kvd.core.hybrid import (
    Group,
    group_permutes,
    permutes_any,
    plan_any,
    plan_groups,
    region_groups,
    split_ids,
)
from kvd.core.planner import Geometry, Plan

MODEL = "org/sim-hybrid"
HEADS, HEAD = 2, 4  # KV heads, head size (bfloat16: 8 bytes a head)
WINDOW = 20


def kv(layers: int) -> str:
    return kvlayout.kv_spec(
        model=MODEL, dtype="bfloat16", num_kv_heads=HEADS, head_size=HEAD, num_layers=layers
    )


def attn(
    tp: int, tokens: int, layers: int, blocks: int = 12, kv_layout: str = "NHD"
) -> wire.RegionLayout:
    spec = kvlayout.parse_kv_spec(kv(layers))
    assert spec is not None
    return kvlayout.kv_region_layout(
        spec, tp_size=tp, tp_rank=0, num_blocks=blocks, tokens_per_block=tokens, kv_layout=kv_layout
    )


def state(tp: int, slots: int = 4) -> tuple[wire.RegionLayout, str]:
    lay = kvlayout.block_major(slots, 2, 64 // tp, kv_parts=2, tokens_per_block=1, dtype="float32")
    return lay, kvlayout.state_spec(
        model=MODEL, dtype="float32", slot_bytes=2 * (64 // tp), num_layers=2
    )


@dataclass(frozen=True)
class Rank:
    tp_rank: int
    tp_size: int
    compat: str
    geometry: Geometry
    layout: wire.RegionLayout | None
    mem_type: str
    groups: tuple[Group, ...]


def side(
    tp: int,
    base: int,
    *,
    tokens: int = 16,
    kinds: tuple[str, ...] = ("full", "window", "state"),
    kv_layout: str = "NHD",
    mem: str = "VRAM",
) -> tuple[list[Rank], int]:
    """A hybrid engine of `tp` ranks, rank r's region at base + r * 2**20; and its bytes."""
    ranks: list[Rank] = []
    size = 0
    for r in range(tp):
        parts: list[tuple[str, wire.RegionLayout, str, int]] = []
        for kind in kinds:
            if kind == "state":
                lay, comp = state(tp)
                parts.append(("state", lay, comp, 0))
            else:
                layers = 2 if kind == "full" else 1
                lay = attn(tp, tokens, layers, kv_layout=kv_layout)
                parts.append((kind, lay, kv(layers), WINDOW if kind == "window" else 0))
        envelope, groups, nbytes = kvlayout.hybrid_region(parts)
        at = base + r * (1 << 20)
        ranks.append(
            Rank(
                r,
                tp,
                kvlayout.hybrid_compat(MODEL),
                Geometry.from_layout(at, nbytes, envelope),
                envelope,
                mem,
                region_groups(at, nbytes, envelope, groups, tp, r),
            )
        )
        size = nbytes
    return ranks, size


P_BASE, D_BASE = 1 << 30, 1 << 34


class Memory:
    """Both sides' regions as bytes; plans are applied by address."""

    def __init__(self, p: list[Rank], d: list[Rank], nbytes: int) -> None:
        rng = np.random.default_rng(1)
        self.p = {r.geometry.base_addr: rng.integers(0, 256, nbytes, np.uint8) for r in p}
        self.d = {r.geometry.base_addr: rng.integers(0, 256, nbytes, np.uint8) for r in d}

    @staticmethod
    def _at(space: dict[int, np.ndarray], addr: int, n: int) -> np.ndarray:
        base = max(b for b in space if b <= addr)
        return space[base][addr - base : addr - base + n]

    def apply(self, plan: Plan, local_is_p: bool) -> None:
        src_addrs = plan.local_addrs if local_is_p else plan.remote_addrs
        dst_addrs = plan.remote_addrs if local_is_p else plan.local_addrs
        for s, t, n in zip(
            src_addrs.tolist(), dst_addrs.tolist(), plan.lengths.tolist(), strict=True
        ):
            self._at(self.d, t, n)[:] = self._at(self.p, s, n)


def chunk(g: Group, block: int, layer: int, part: int) -> tuple[int, int]:
    geo = g.geometry
    addr = geo.base_addr + block * geo.block_stride + layer * geo.layer_stride
    return addr + part * geo.kv_stride, geo.chunk_bytes


def ids(ranks: list[Rank], kind_ids: dict[int, list[int]]) -> list[int]:
    return [ranks[0].groups[g].first_id + b for g, bs in kind_ids.items() for b in bs]


# ------------------------------------------------------------------ validation


def test_region_groups_lay_out_the_id_space() -> None:
    p, _ = side(1, P_BASE)
    groups = p[0].groups
    assert [g.kind for g in groups] == ["full", "window", "state"]
    assert [g.first_id for g in groups] == [0, 12, 24]
    assert all(g.offset % kvlayout.GROUP_ALIGN == 0 for g in groups)
    assert groups[1].window_tokens == WINDOW
    assert p[0].layout == kvlayout.hybrid_layout(tuple(g.to_wire() for g in groups))


def _wire(
    kinds: tuple[str, ...] = ("full", "window", "state"),
) -> tuple[wire.RegionLayout, tuple[wire.KvGroup, ...], int]:
    p, _ = side(1, P_BASE, kinds=kinds)
    groups = tuple(g.to_wire() for g in p[0].groups)
    return kvlayout.hybrid_layout(groups), groups, p[0].geometry.nbytes


@pytest.mark.parametrize(
    ("change", "says"),
    [
        (lambda gs: (replace(gs[0], kind="sparse"), *gs[1:]), "kind must be one of"),
        (lambda gs: (gs[0], replace(gs[1], window_tokens=0), gs[2]), "a window group needs > 0"),
        (lambda gs: (replace(gs[0], window_tokens=8), *gs[1:]), "other kinds 0"),
        (lambda gs: (gs[0], replace(gs[1], offset=gs[0].offset), gs[2]), "overlap"),
        (lambda gs: (*gs[:2], replace(gs[2], offset=1 << 30)), "ends at byte"),
        (lambda gs: (*gs[:2], replace(gs[2], compat=gs[0].compat)), "is not a state spec"),
        (lambda gs: (replace(gs[0], compat="kvspec1|x"), *gs[1:]), "malformed KV spec"),
        (
            lambda gs: (
                *gs[:2],
                replace(
                    gs[2],
                    compat=kvlayout.state_spec(
                        model=MODEL, dtype="float32", slot_bytes=100, num_layers=2
                    ),
                ),
            ),
            "the state spec says 100",
        ),
        (
            lambda gs: (gs[0], replace(gs[1], layout=replace(gs[1].layout, chunk_bytes=7)), gs[2]),
            "chunk_bytes=7",
        ),
        (
            lambda gs: (
                replace(gs[0], layout=replace(gs[0].layout, physical_per_logical=2)),
                *gs[1:],
            ),
            "physical_per_logical=2",
        ),
    ],
)
def test_region_groups_refuse_bad_groups(
    change: Callable[[tuple[wire.KvGroup, ...]], tuple[wire.KvGroup, ...]], says: str
) -> None:
    _, groups, nbytes = _wire()
    bad = change(groups)
    with pytest.raises(InvalidRequest, match=says):
        region_groups(0, nbytes, kvlayout.hybrid_layout(bad), bad, 1, 0)


def test_region_groups_refuse_a_layout_that_is_not_the_id_space() -> None:
    lay, groups, nbytes = _wire()
    with pytest.raises(InvalidRequest, match="hybrid_layout"):
        region_groups(0, nbytes, replace(lay, num_blocks=lay.num_blocks + 1), groups, 1, 0)
    assert region_groups(0, nbytes, lay, (), 1, 0) == ()


def test_split_ids_keeps_order_and_refuses_outsiders() -> None:
    p, _ = side(1, P_BASE)
    got = split_ids(p[0].groups, [13, 2, 25, 0, 14])
    assert [x.tolist() for x in got] == [[2, 0], [1, 2], [1]]
    with pytest.raises(InvalidRequest, match="outside the region's 28 ids"):
        split_ids(p[0].groups, [3, 28])


# ------------------------------------------------------------------ what moves


@pytest.mark.parametrize("local_is_p", [True, False])
def test_every_group_moves_what_it_should(local_is_p: bool) -> None:
    p, nbytes = side(1, P_BASE)
    d, _ = side(1, D_BASE)
    mem = Memory(p, d, nbytes)
    before = {k: v.copy() for k, v in mem.d.items()}
    full_p, full_d = [3, 7, 1, 9], [2, 4, 6, 8]
    # window 20 tokens at 16-token blocks: at most 3 blocks; P holds 4, D names 5
    win_p, win_d = [0, 5, 6, 11], [1, 2, 3, 4, 10]
    slot_p, slot_d = [2], [3]
    rp = plan_groups(
        p,
        ids(p, {0: full_p, 1: win_p, 2: slot_p}),
        d,
        ids(d, {0: full_d, 1: win_d, 2: slot_d}),
        local_is_p=local_is_p,
    )
    assert len(rp.pairs) == 3 and rp.permutes == ()
    for plan in rp.plans:
        mem.apply(plan, local_is_p)
    want = {k: v.copy() for k, v in before.items()}
    dmem, pmem = want[D_BASE], mem.p[P_BASE]
    moves = [(0, list(zip(full_p, full_d, strict=True)), 2, 2)]
    moves.append((1, list(zip(win_p[-3:], win_d[-3:], strict=True)), 1, 2))
    moves.append((2, list(zip(slot_p, slot_d, strict=True)), 2, 2))
    for g, blocks, layers, parts in moves:
        pg, dg = p[0].groups[g], d[0].groups[g]
        for pb, db in blocks:
            for layer in range(layers):
                for part in range(parts):
                    sa, n = chunk(pg, pb, layer, part)
                    da, _ = chunk(dg, db, layer, part)
                    dmem[da - D_BASE : da - D_BASE + n] = pmem[sa - P_BASE : sa - P_BASE + n]
    assert np.array_equal(mem.d[D_BASE], want[D_BASE])
    # the window blocks D named outside the window kept their bytes
    for db in win_d[:2]:
        a, n = chunk(d[0].groups[1], db, 0, 0)
        assert np.array_equal(
            mem.d[D_BASE][a - D_BASE : a - D_BASE + n], before[D_BASE][a - D_BASE : a - D_BASE + n]
        )


def test_heterogeneous_tp_for_attention_groups_and_push_agrees_with_the_plan() -> None:
    kinds = ("full", "window")
    p, _ = side(2, P_BASE, kinds=kinds)
    d, _ = side(1, D_BASE, kinds=kinds, kv_layout="HND", mem="DRAM")
    p_ids, d_ids = ids(p, {0: [1, 2], 1: [3, 4]}), ids(d, {0: [5, 6], 1: [7, 8]})
    rp = plan_groups(p, p_ids, d, d_ids, local_is_p=True)
    pairs, permutes = group_permutes(p, d, d_ids)
    assert pairs == rp.pairs  # P WRITEs what D counts
    assert [(x.p, x.d) for x in pairs] == [(0, 0), (1, 0), (0, 0), (1, 0)]
    assert permutes == ()  # heads differ: descriptors land in D's layout, nothing to permute
    moved = sum(plan.total_bytes for plan in rp.plans)
    head = HEAD * 2
    # full: 2 blocks x 16 tokens x 2 heads x 2 parts x 2 layers; window: 2 blocks, 1 layer
    assert moved == 2 * 16 * HEADS * head * 2 * 2 + 2 * 16 * HEADS * head * 2


def test_a_layout_conversion_permutes_each_attention_group_in_its_own_geometry() -> None:
    p, _ = side(2, P_BASE)
    d, _ = side(2, D_BASE, kv_layout="HND", mem="DRAM")
    p_ids = ids(p, {0: [1, 2], 1: [3, 4, 5, 6], 2: [0]})
    d_ids = ids(d, {0: [5, 6], 1: [7, 8, 9, 10], 2: [1]})
    rp = plan_groups(p, p_ids, d, d_ids, local_is_p=False)
    pairs, permutes = group_permutes(p, d, d_ids)
    assert pairs == rp.pairs
    assert [(j.pair, j.blocks.tolist()) for j in permutes] == [
        (j.pair, j.blocks.tolist()) for j in rp.permutes
    ]
    # full: ranks 0, 1 (pairs 0, 1); window: the 3 blocks inside it (pairs 2, 3); state none
    assert [j.pair for j in permutes] == [0, 1, 2, 3]
    assert [j.blocks.tolist() for j in permutes] == [[5, 6], [5, 6], [8, 9, 10], [8, 9, 10]]
    assert [j.geometry for j in permutes] == [
        d[0].groups[0].geometry,
        d[1].groups[0].geometry,
        d[0].groups[1].geometry,
        d[1].groups[1].geometry,
    ]


def test_plain_regions_still_plan_as_before() -> None:
    spec = kvlayout.parse_kv_spec(kv(2))
    assert spec is not None
    lay = kvlayout.kv_region_layout(spec, tp_size=1, tp_rank=0, num_blocks=8, tokens_per_block=16)
    geo = Geometry.from_layout(P_BASE, kvlayout.region_bytes(lay), lay)
    dgeo = Geometry.from_layout(D_BASE, kvlayout.region_bytes(lay), lay)
    p = [Rank(0, 1, kv(2), geo, lay, "DRAM", ())]
    d = [Rank(0, 1, kv(2), dgeo, lay, "DRAM", ())]
    rp = plan_any(p, [1, 2], d, [3, 4], local_is_p=True)
    assert rp.plans[0].descriptors == 1  # blocks 1, 2 -> 3, 4: one run
    assert permutes_any(p, d, [3, 4]) == (rp.pairs, ())


# ------------------------------------------------------------------ refusals


def test_refusals_name_both_sides() -> None:
    p, _ = side(1, P_BASE, tokens=16, kinds=("full", "window"))
    d, _ = side(1, D_BASE, tokens=32, kinds=("full", "window"))
    with pytest.raises(
        Incompatible, match="sliding-window group 1: block sizes differ, P 16 tokens, D 32"
    ):
        plan_groups(p, [], d, [], local_is_p=True)
    with pytest.raises(Incompatible, match="P 16 tokens, D 32"):
        group_permutes(p, d, [])
    p2, _ = side(2, P_BASE)
    d1, _ = side(1, D_BASE)
    with pytest.raises(Incompatible, match="state group 2: TP differs, P 2 ranks, D 1"):
        plan_groups(p2, [], d1, [], local_is_p=True)
    pk, _ = side(1, P_BASE, kinds=("full", "state"))
    with pytest.raises(Incompatible, match=r"P has 2 groups \(full, state\), D has 3 groups"):
        plan_any(pk, [], d1, [], local_is_p=True)
    plain = [replace(d1[0], groups=())]
    with pytest.raises(Incompatible, match="D has one group"):
        permutes_any(d1, plain, [])
    other = [replace(d1[0], compat=kvlayout.hybrid_compat("org/other"))]
    with pytest.raises(Incompatible, match="org/other"):
        plan_any(d1, [], other, [], local_is_p=True)


def test_state_slots_must_match_and_specs_agree() -> None:
    p, _ = side(1, P_BASE, kinds=("full", "state"))
    d, _ = side(1, D_BASE, kinds=("full", "state"))
    with pytest.raises(InvalidRequest, match="P names 1 state slots, D 2"):
        plan_groups(p, ids(p, {1: [0]}), d, ids(d, {1: [0, 1]}), local_is_p=True)
    lay, _ = state(1)
    bigger = kvlayout.block_major(
        lay.num_blocks, 2, lay.chunk_bytes * 2, kv_parts=2, tokens_per_block=1, dtype="float32"
    )
    comp = kvlayout.state_spec(model=MODEL, dtype="float32", slot_bytes=256, num_layers=2)
    g = d[0].groups[1]
    other = replace(
        g,
        layout=bigger,
        compat=comp,
        geometry=Geometry.from_layout(g.geometry.base_addr, kvlayout.region_bytes(bigger), bigger),
    )
    d2 = [replace(d[0], groups=(d[0].groups[0], other))]
    with pytest.raises(Incompatible, match="slot_bytes P=128 D=256"):
        plan_groups(p, ids(p, {1: [0]}), d2, ids(d, {1: [0]}), local_is_p=True)
