from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kvd_client.errors import Incompatible, InvalidRequest

from kvd.core.planner import (
    INT64_MAX,
    Geometry,
    Plan,
    _plan_small,
    _plan_vectorised,
    check_blocks,
    expand_logical,
    plan_per_chunk,
    plan_transfer,
)

L, K, C = 4, 2, 8  # layers, K/V parts, chunk bytes used by most tests


def bm(num_blocks: int = 32, base: int = 0, layers: int = L, parts: int = K) -> Geometry:
    return Geometry.block_major(base, num_blocks, layers, parts, C)


def lm(num_blocks: int = 32, base: int = 0, layers: int = L, parts: int = K) -> Geometry:
    return Geometry.layer_major(base, num_blocks, layers, parts, C)


# --- geometry -------------------------------------------------------------------------


def test_constructors() -> None:
    g = Geometry.block_major(4096, 10, 3, 2, 16, physical_per_logical=2)
    assert (g.kv_stride, g.layer_stride, g.block_stride, g.nbytes) == (16, 32, 96, 960)
    assert g.block_bytes == 96 and g.physical_per_logical == 2
    h = Geometry.layer_major(0, 10, 3, 2, 16)
    assert (h.block_stride, h.kv_stride, h.layer_stride, h.nbytes) == (16, 160, 320, 960)
    assert h.block_bytes == 96


def _geometry(**changes: Any) -> Geometry:
    fields: dict[str, Any] = dict(
        base_addr=0,
        nbytes=10 * 4 * 2 * 8,
        num_blocks=10,
        num_layers=4,
        kv_parts=2,
        chunk_bytes=8,
        block_stride=64,
        layer_stride=16,
        kv_stride=8,
    )
    fields.update(changes)
    return Geometry(**fields)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"num_blocks": 0}, "num_blocks"),
        ({"num_layers": -1}, "num_layers"),
        ({"kv_parts": 3}, "kv_parts"),
        ({"kv_parts": 0}, "kv_parts"),
        ({"chunk_bytes": 0}, "chunk_bytes"),
        ({"nbytes": 0}, "nbytes"),
        ({"physical_per_logical": 0}, "physical_per_logical"),
        ({"block_stride": -64}, "block_stride"),
        ({"base_addr": -1}, "base_addr"),
        ({"nbytes": 639}, "nbytes"),  # last chunk sticks out by one byte
        ({"block_stride": 65}, "nbytes"),
        ({"block_stride": 63, "nbytes": 10_000}, "block_stride"),  # blocks overlap
        ({"kv_stride": 4}, "kv_stride"),  # K and V overlap
        ({"layer_stride": 8, "kv_stride": 8}, "layer_stride"),  # layer 1 K == layer 0 V
        ({"block_stride": 0, "nbytes": 10_000}, "block_stride"),
        ({"base_addr": INT64_MAX - 100}, "overflows"),
        ({"nbytes": 2**64}, "overflows"),
        ({"num_blocks": True}, "num_blocks"),
        ({"chunk_bytes": 8.0}, "chunk_bytes"),
        ({"block_stride": np.int64(64)}, "block_stride"),
    ],
)
def test_validate_rejects(changes: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest, match=field):
        _geometry(**changes).validate()


def test_validate_accepts_valid_layouts() -> None:
    _geometry().validate()
    _geometry(kv_parts=1, kv_stride=0).validate()  # one part: its stride is irrelevant
    _geometry(num_blocks=1, block_stride=0, nbytes=64).validate()
    # layer-major with gaps between layers is fine
    _geometry(block_stride=8, kv_stride=80, layer_stride=200, nbytes=3 * 200 + 160).validate()
    # V interleaved with K per block: [block][part] inside a layer
    _geometry(block_stride=16, kv_stride=8, layer_stride=160, nbytes=640).validate()


def test_constructors_validate() -> None:
    with pytest.raises(InvalidRequest):
        Geometry.block_major(0, 0, 4, 2, 8)
    with pytest.raises(InvalidRequest):
        Geometry.layer_major(INT64_MAX, 4, 4, 2, 8)


# --- block ids ------------------------------------------------------------------------


def test_check_blocks_accepts() -> None:
    g = bm(8)
    assert check_blocks(g, [3, 1, 7]).tolist() == [3, 1, 7]
    assert check_blocks(g, (0,)).dtype == np.int64
    assert check_blocks(g, range(8)).tolist() == list(range(8))
    assert check_blocks(g, np.array([5, 6], dtype=np.uint8)).tolist() == [5, 6]
    numpy_scalars: list[Any] = [np.int32(2), 3]
    assert check_blocks(g, numpy_scalars).tolist() == [2, 3]
    assert check_blocks(g, []).shape == (0,)
    src = np.array([1, 2], dtype=np.int64)
    out = check_blocks(g, src)
    out[0] = 5
    assert src[0] == 1  # a copy, never the caller's array


@pytest.mark.parametrize(
    ("blocks", "needle"),
    [
        ([0, 8], "block id 8"),
        ([-1], "block id -1"),
        ([1, True], "bool"),
        ([np.bool_(True)], "bool"),
        ([1.0], "float"),
        ([2**63], "overflows"),
        ([1, 2**70], r"\[1\]"),
        ([-(2**63) - 1], "overflows"),
        ([np.uint64(2**64 - 1)], "overflows"),
        ([[1]], "list"),
        ("12", "str"),
        (b"\x01", "bytes"),
        ({1, 2}, "set"),
        (5, "int"),
        (np.array([[1]]), "one-dimensional"),
        (np.array([1.0]), "dtype"),
        (np.array([True]), "dtype"),
        (np.array([2**64 - 1], dtype=np.uint64), "overflows"),
        ([1, 2, 3, 2], "block id 2 appears more than once"),
        (np.array([4, 4]), "block id 4"),
    ],
)
def test_check_blocks_rejects(blocks: Any, needle: str) -> None:
    with pytest.raises(InvalidRequest, match=needle):
        check_blocks(bm(8), blocks)


def test_expand_logical() -> None:
    assert expand_logical([0, 3], 1).tolist() == [0, 3]
    assert expand_logical([2, 0], 3).tolist() == [6, 7, 8, 0, 1, 2]
    assert expand_logical(np.array([1], dtype=np.int32), 2).dtype == np.int64
    assert expand_logical([], 4).shape == (0,)
    with pytest.raises(InvalidRequest):
        expand_logical([-1], 2)
    with pytest.raises(InvalidRequest):
        expand_logical([2**62], 2)  # would overflow
    with pytest.raises(InvalidRequest):
        expand_logical([1], 0)
    with pytest.raises(InvalidRequest):
        expand_logical([True], 2)


# --- plans: descriptor counts -----------------------------------------------------------


def test_block_major_contiguous_is_one_descriptor() -> None:
    g = bm()
    plan = plan_transfer(g, [3, 4, 5, 6], g, [10, 11, 12, 13])
    assert plan.descriptors == 1
    assert plan.local_addrs.tolist() == [3 * g.block_stride]
    assert plan.remote_addrs.tolist() == [10 * g.block_stride]
    assert plan.total_bytes == 4 * g.block_bytes


def test_block_major_fragmented_runs() -> None:
    g = bm()
    # local runs [0,1] [5,6]; remote contiguous -> split where local breaks
    assert plan_transfer(g, [0, 1, 5, 6], g, [10, 11, 12, 13]).descriptors == 2
    # local contiguous, remote breaks once
    assert plan_transfer(g, [0, 1, 2, 3], g, [10, 11, 20, 21]).descriptors == 2
    # given out of order but pairs are contiguous once sorted by local address
    assert plan_transfer(g, [2, 0, 1], g, [12, 10, 11]).descriptors == 1


def test_block_major_reversed() -> None:
    g = bm()
    plan = plan_transfer(g, [5, 4, 3], g, [10, 11, 12])
    assert plan.descriptors == 3  # one per block: each block is contiguous on both sides
    assert plan.local_addrs.tolist() == sorted(plan.local_addrs.tolist())


def test_layer_major_counts() -> None:
    g = lm()
    assert plan_transfer(g, [3, 4, 5], g, [7, 8, 9]).descriptors == L * K
    assert plan_transfer(g, [0, 1, 5, 6], g, [10, 11, 12, 13]).descriptors == 2 * L * K
    assert plan_transfer(g, [5, 4, 3], g, [10, 11, 12]).descriptors == 3 * L * K


def test_single_part_and_single_layer() -> None:
    g = bm(parts=1)
    assert plan_transfer(g, [0, 1], g, [4, 5]).descriptors == 1
    h = lm(layers=1, parts=1)
    assert plan_transfer(h, [0, 1, 2], h, [4, 5, 6]).descriptors == 1


def test_mixed_layouts() -> None:
    plan = plan_transfer(bm(), [0, 1], lm(), [0, 1])
    # block-major local chunk order is (block, layer, part); remote layer-major never
    # continues chunk to chunk inside a block, so nothing merges
    assert plan.descriptors == 2 * L * K


def test_per_chunk_plan() -> None:
    g = bm()
    plan = plan_per_chunk(g, [3, 4], g, [10, 11])
    assert plan.descriptors == 2 * L * K
    assert (plan.lengths == C).all()
    assert plan.local_addrs[:2].tolist() == [3 * g.block_stride, 3 * g.block_stride + C]


def test_empty_plan() -> None:
    plan = plan_transfer(bm(), [], lm(), [])
    assert plan.descriptors == 0 and plan.total_bytes == 0
    assert plan_per_chunk(bm(), [], lm(), []).descriptors == 0
    assert plan.as_tuples_local().shape == (0, 3)


def test_tuples_and_readonly() -> None:
    g = bm(base=1 << 20)
    plan = plan_transfer(g, [1, 2], g, [5, 9])
    local = plan.as_tuples_local(dev=3)
    remote = plan.as_tuples_remote()
    assert local.dtype == np.int64 and local.shape == (2, 3)
    assert local[:, 2].tolist() == [3, 3] and remote[:, 2].tolist() == [0, 0]
    assert local[:, 1].tolist() == plan.lengths.tolist()
    with pytest.raises(ValueError):
        plan.local_addrs[0] = 0


def test_plan_errors() -> None:
    with pytest.raises(Incompatible, match="num_layers"):
        plan_transfer(bm(layers=4), [0], bm(layers=5), [0])
    with pytest.raises(Incompatible, match="chunk_bytes"):
        plan_transfer(bm(), [0], Geometry.block_major(0, 8, L, K, 16), [0])
    with pytest.raises(InvalidRequest, match="counts must match"):
        plan_transfer(bm(), [0, 1], bm(), [0])
    with pytest.raises(InvalidRequest, match="block id 32"):
        plan_transfer(bm(), [0], bm(), [32])
    with pytest.raises(InvalidRequest, match="nbytes"):
        plan_transfer(bm(), [0], _geometry(nbytes=10), [0])


# --- plans: bytes -----------------------------------------------------------------------


def apply_plan(
    plan: Plan, src: Geometry, src_mem: np.ndarray, dst: Geometry, dst_mem: np.ndarray
) -> None:
    for la, ra, n in zip(
        plan.local_addrs.tolist(), plan.remote_addrs.tolist(), plan.lengths.tolist(), strict=True
    ):
        lo, ro = la - src.base_addr, ra - dst.base_addr
        dst_mem[ro : ro + n] = src_mem[lo : lo + n]


def reference_copy(
    src: Geometry, src_blocks: list[int], src_mem: np.ndarray,
    dst: Geometry, dst_blocks: list[int], dst_mem: np.ndarray,
) -> None:  # fmt: skip
    for sb, db in zip(src_blocks, dst_blocks, strict=True):
        for layer in range(src.num_layers):
            for part in range(src.kv_parts):
                so = sb * src.block_stride + layer * src.layer_stride + part * src.kv_stride
                do = db * dst.block_stride + layer * dst.layer_stride + part * dst.kv_stride
                dst_mem[do : do + src.chunk_bytes] = src_mem[so : so + src.chunk_bytes]


LAYOUTS = [
    (bm(24), bm(40)),
    (lm(24), lm(40)),
    (bm(24), lm(40)),
    (lm(24, base=4096), bm(40, base=1 << 30)),
    (bm(24, parts=1), lm(40, parts=1)),
]


@pytest.mark.parametrize(("src", "dst"), LAYOUTS)
@pytest.mark.parametrize("seed", range(4))
def test_bytes_match_reference(src: Geometry, dst: Geometry, seed: int) -> None:
    rng = np.random.default_rng(seed)
    n = int(rng.integers(1, 20))
    src_blocks = rng.permutation(src.num_blocks)[:n].tolist()
    if seed % 2:  # contiguous destination runs merge on both sides
        start = int(rng.integers(0, dst.num_blocks - n + 1))
        dst_blocks = list(range(start, start + n))
        src_blocks.sort()
    else:
        dst_blocks = rng.permutation(dst.num_blocks)[:n].tolist()
    src_mem = rng.integers(0, 256, src.nbytes, dtype=np.uint8)
    for planner in (plan_transfer, plan_per_chunk):
        got = np.zeros(dst.nbytes, dtype=np.uint8)
        want = np.zeros(dst.nbytes, dtype=np.uint8)
        plan = planner(src, src_blocks, dst, dst_blocks)
        apply_plan(plan, src, src_mem, dst, got)
        reference_copy(src, src_blocks, src_mem, dst, dst_blocks, want)
        assert np.array_equal(got, want)
        assert plan.total_bytes == n * src.block_bytes


def test_large_plan_is_fast_and_coalesced() -> None:
    g = Geometry.layer_major(0, 100_000, 80, 2, 4096)
    blocks = np.arange(10_000, 20_000)
    plan = plan_transfer(g, blocks, g, blocks + 50_000)
    assert plan.descriptors == 80 * 2
    assert plan.total_bytes == 10_000 * g.block_bytes


# --- property test: nothing outside its region, ever -------------------------------------


Shape = tuple[int, int, int]  # num_layers, kv_parts, chunk_bytes

shapes = st.tuples(st.integers(1, 4), st.integers(1, 2), st.sampled_from([1, 3, 4, 8, 16]))
odd_values = st.one_of(
    st.integers(-2, 400), st.sampled_from([0, -1, 2**63, 2**64, -(2**63) - 1, True, 1.5])
)


@st.composite
def geometries(draw: st.DrawFn, shape: Shape) -> Geometry:
    """Random layouts: the three dimensions nested in any order with random gaps (block-
    and layer-major among them), sometimes overlapping or too small, sometimes with one
    field replaced by an arbitrary value."""
    num_layers, kv_parts, chunk = shape
    num_blocks = draw(st.integers(1, 12))
    base = draw(st.sampled_from([0, 0, 4096, 1 << 40, INT64_MAX - 4096]))
    counts = {"block": num_blocks, "layer": num_layers, "part": kv_parts}
    strides: dict[str, int] = {}
    extent = chunk
    for name in draw(st.permutations(["block", "layer", "part"])):  # inner to outer
        strides[name] = extent + draw(st.sampled_from([0, 0, 0, 0, 0, 0, 1, 5, -1]))
        extent += strides[name] * (counts[name] - 1)
    nbytes = extent + draw(st.sampled_from([0, 0, 0, 0, 3, 16, -1]))
    fields: dict[str, Any] = dict(
        base_addr=base,
        nbytes=nbytes,
        num_blocks=num_blocks,
        num_layers=num_layers,
        kv_parts=kv_parts,
        chunk_bytes=chunk,
        block_stride=strides["block"],
        layer_stride=strides["layer"],
        kv_stride=strides["part"],
    )
    if draw(st.integers(0, 5)) == 5:
        fields[draw(st.sampled_from(sorted(fields)))] = draw(odd_values)
    return Geometry(**fields)


@st.composite
def geometry_pairs(draw: st.DrawFn) -> tuple[Geometry, Geometry]:
    shape = draw(shapes)
    other = draw(shapes) if draw(st.integers(0, 7)) == 7 else shape
    return draw(geometries(shape)), draw(geometries(other))


bad_block_id = st.sampled_from([-1, 2**63, 2**64 + 3, -(2**63) - 1, True, 1.0, "1"])


@st.composite
def block_lists(draw: st.DrawFn, geometry: Geometry, size: int | None = None) -> Any:
    """Mostly valid distinct ids of `geometry` (of `size` if given), sometimes not."""
    n = geometry.num_blocks if type(geometry.num_blocks) is int else 1
    n = min(max(n, 1), 400)
    roll = draw(st.integers(0, 9))  # hypothesis favours 0: keep the valid cases low
    if size is None:
        size = 0 if roll == 9 else draw(st.integers(1, n))
    if roll == 8:  # anything, likely invalid
        return draw(st.lists(st.one_of(st.integers(-2, n + 1), bad_block_id), max_size=8))
    ids = draw(st.lists(st.integers(0, n - 1), unique=True, min_size=min(size, n), max_size=n))
    ids = ids[:size]
    if roll == 7 and ids:  # one bad id
        bad: Any = draw(st.one_of(bad_block_id, st.just(n)))
        ids[draw(st.integers(0, len(ids) - 1))] = bad
    if roll == 6 and ids:  # a duplicate
        ids.append(ids[0])
    if roll == 5:
        return np.array(ids, dtype=np.int64)
    return ids


def _inside(addrs: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64], g: Geometry) -> bool:
    for a, n in zip(addrs.tolist(), lengths.tolist(), strict=True):
        if not (n > 0 and g.base_addr <= a and a + n <= g.base_addr + g.nbytes):
            return False
    return True


def _disjoint(addrs: npt.NDArray[np.int64], lengths: npt.NDArray[np.int64]) -> bool:
    spans = sorted(zip(addrs.tolist(), lengths.tolist(), strict=True))
    return all(a + n <= b for (a, n), (b, _) in itertools.pairwise(spans))


def naive_coalesce(per_chunk: Plan) -> tuple[list[int], list[int], list[int]]:
    """Reference: sort chunk pairs by local address, merge where both sides continue."""
    pairs = sorted(
        zip(
            per_chunk.local_addrs.tolist(),
            per_chunk.remote_addrs.tolist(),
            per_chunk.lengths.tolist(),
            strict=True,
        )
    )
    out: list[list[int]] = []
    for la, ra, n in pairs:
        if out and out[-1][0] + out[-1][2] == la and out[-1][1] + out[-1][2] == ra:
            out[-1][2] += n
        else:
            out.append([la, ra, n])
    return [d[0] for d in out], [d[1] for d in out], [d[2] for d in out]


def assert_same_as_naive(plan: Plan, per_chunk: Plan) -> None:
    la, ra, n = naive_coalesce(per_chunk)
    assert plan.local_addrs.tolist() == la
    assert plan.remote_addrs.tolist() == ra
    assert plan.lengths.tolist() == n


@pytest.mark.parametrize(("src", "dst"), [*LAYOUTS, (lm(24, parts=1), lm(40, parts=1))])
def test_coalescing_matches_naive_reference(src: Geometry, dst: Geometry) -> None:
    rng = np.random.default_rng(5)
    for _ in range(60):
        n = int(rng.integers(0, 24))
        src_blocks = rng.permutation(src.num_blocks)[:n]
        if rng.random() < 0.5:  # runs: sorted local ids, mostly consecutive remote ids
            src_blocks.sort()
            dst_blocks = np.cumsum(rng.choice([1, 1, 1, 2], n)) - 1
            if n and dst_blocks[-1] >= dst.num_blocks:
                continue
        else:
            dst_blocks = rng.permutation(dst.num_blocks)[:n]
        plan = plan_transfer(src, src_blocks, dst, dst_blocks)
        assert_same_as_naive(plan, plan_per_chunk(src, src_blocks, dst, dst_blocks))


@pytest.mark.parametrize(("src", "dst"), [*LAYOUTS, (lm(24, parts=1), lm(40, parts=1))])
def test_plain_python_and_numpy_plan_alike(src: Geometry, dst: Geometry) -> None:
    """A few blocks are planned in plain Python (`_plan_small`), more with numpy: the same
    descriptors in the same order either way, for every layout pair."""
    rng = np.random.default_rng(11)
    made = 0
    for _ in range(80):
        n = int(rng.integers(1, 10))
        lb = rng.permutation(src.num_blocks)[:n].astype(np.int64)
        rb = rng.permutation(dst.num_blocks)[:n].astype(np.int64)
        if rng.random() < 0.5:  # runs on both sides
            lb.sort()
            rb = np.arange(n, dtype=np.int64) + int(rng.integers(0, dst.num_blocks - n + 1))
        small = _plan_small(src, lb, dst, rb)
        numpy_plan = _plan_vectorised(src, lb, dst, rb)
        if small is None:
            continue
        made += 1
        for a, b in ((small.local_addrs, numpy_plan.local_addrs),
                     (small.remote_addrs, numpy_plan.remote_addrs),
                     (small.lengths, numpy_plan.lengths)):  # fmt: skip
            assert a.dtype == b.dtype == np.int64
            assert a.tolist() == b.tolist()
            assert not a.flags.writeable
    assert made > 0  # (larger layer-major requests go to numpy alone)


def test_whole_region_collapses_to_one_descriptor() -> None:
    for g in (bm(8), lm(8)):
        plan = plan_transfer(g, range(8), g, range(8))
        assert (plan.descriptors, plan.total_bytes) == (1, g.nbytes)
    # layer-major: all blocks of a region continue across (layer, part) steps
    src, dst = lm(8), lm(8)
    plan = plan_transfer(src, range(8), dst, range(8))
    assert plan.local_addrs.tolist() == [0]


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), pair=geometry_pairs())
def test_plans_never_leave_their_regions(
    data: st.DataObject, pair: tuple[Geometry, Geometry]
) -> None:
    local, remote = pair
    local_blocks = data.draw(block_lists(local))
    same_size = data.draw(st.integers(0, 5)) != 5
    remote_blocks = data.draw(block_lists(remote, len(local_blocks) if same_size else None))
    for planner in (plan_transfer, plan_per_chunk):
        try:
            plan = planner(local, local_blocks, remote, remote_blocks)
        except (InvalidRequest, Incompatible):
            continue
        assert plan.local_addrs.dtype == plan.remote_addrs.dtype == plan.lengths.dtype == np.int64
        assert _inside(plan.local_addrs, plan.lengths, local)
        assert _inside(plan.remote_addrs, plan.lengths, remote)
        assert _disjoint(plan.local_addrs, plan.lengths)
        assert _disjoint(plan.remote_addrs, plan.lengths)
        assert plan.total_bytes == len(local_blocks) * local.block_bytes
        # a plan was made, so the inputs were valid
        local.validate()
        remote.validate()
        assert len(set(np.asarray(local_blocks).tolist())) == len(local_blocks)
        if planner is plan_per_chunk:
            continue
        per_chunk = plan_per_chunk(local, local_blocks, remote, remote_blocks)
        assert_same_as_naive(plan, per_chunk)
        # both ways of planning, whichever plan_transfer took: the same descriptors
        lb, rb = check_blocks(local, local_blocks), check_blocks(remote, remote_blocks)
        if lb.shape[0]:
            assert_same_as_naive(_plan_vectorised(local, lb, remote, rb), per_chunk)
            small = _plan_small(local, lb, remote, rb)
            if small is not None:
                assert_same_as_naive(small, per_chunk)
        if local.nbytes <= 1 << 14 and remote.nbytes <= 1 << 14:
            rng = np.random.default_rng(len(local_blocks))
            src_mem = rng.integers(0, 256, local.nbytes, dtype=np.uint8)
            got = np.zeros(remote.nbytes, dtype=np.uint8)
            want = np.zeros(remote.nbytes, dtype=np.uint8)
            apply_plan(plan, local, src_mem, remote, got)
            lbl, rbl = np.asarray(local_blocks).tolist(), np.asarray(remote_blocks).tolist()
            reference_copy(local, lbl, src_mem, remote, rbl, want)
            assert np.array_equal(got, want)


def _random_nested(rng: np.random.Generator, shape: Shape) -> Geometry:
    num_layers, kv_parts, chunk = shape
    counts = {"block": int(rng.integers(1, 16)), "layer": num_layers, "part": kv_parts}
    strides: dict[str, int] = {}
    extent = chunk
    for name in rng.permutation(["block", "layer", "part"]).tolist():
        strides[name] = extent + int(rng.choice([0, 0, 0, chunk, 7]))
        extent += strides[name] * (counts[name] - 1)
    return Geometry(
        int(rng.choice([0, 64])), extent + int(rng.choice([0, 9])), counts["block"],
        num_layers, kv_parts, chunk, strides["block"], strides["layer"], strides["part"],
    )  # fmt: skip


def test_random_valid_layouts_copy_the_right_bytes() -> None:
    rng = np.random.default_rng(99)
    for _ in range(300):
        shape = (int(rng.integers(1, 4)), int(rng.integers(1, 3)), int(rng.choice([1, 4, 8])))
        src, dst = _random_nested(rng, shape), _random_nested(rng, shape)
        n = int(rng.integers(0, min(src.num_blocks, dst.num_blocks) + 1))
        src_blocks = rng.permutation(src.num_blocks)[:n]
        if rng.random() < 0.5:
            src_blocks.sort()
            start = int(rng.integers(0, dst.num_blocks - n + 1))
            dst_blocks = np.arange(start, start + n)
        else:
            dst_blocks = rng.permutation(dst.num_blocks)[:n]
        plan = plan_transfer(src, src_blocks, dst, dst_blocks)
        assert_same_as_naive(plan, plan_per_chunk(src, src_blocks, dst, dst_blocks))
        src_mem = rng.integers(0, 256, src.nbytes, dtype=np.uint8)
        got = np.zeros(dst.nbytes, dtype=np.uint8)
        want = np.zeros(dst.nbytes, dtype=np.uint8)
        apply_plan(plan, src, src_mem, dst, got)
        reference_copy(src, src_blocks.tolist(), src_mem, dst, dst_blocks.tolist(), want)
        assert np.array_equal(got, want)


# ------------------------------------------------------------------ one layer range


def _apply(plan: Plan, src: np.ndarray, dst: np.ndarray) -> None:
    for la, ra, n in zip(plan.local_addrs, plan.remote_addrs, plan.lengths, strict=True):
        dst[ra : ra + n] = src[la : la + n]


@pytest.mark.parametrize(
    ("p_shape", "d_shape"), [("block", "block"), ("layer", "block"), ("layer", "layer")]
)
@pytest.mark.parametrize(("first", "end"), [(0, 1), (2, 3), (1, 4), (0, 4)])
def test_a_layer_range_copies_exactly_those_layers(
    p_shape: str, d_shape: str, first: int, end: int
) -> None:
    """A layer range's plan moves those layers' chunks of the blocks, in any layout, and
    nothing else (checked by applying it to real buffers)."""

    def geo(shape: str) -> Geometry:
        make = Geometry.block_major if shape == "block" else Geometry.layer_major
        return make(0, num_blocks=12, num_layers=4, kv_parts=2, chunk_bytes=16)

    loc, rem = geo(p_shape), geo(d_shape)
    lb, rb = [3, 4, 5, 9], [0, 7, 8, 1]
    rng = np.random.default_rng(first * 10 + end)
    src = rng.integers(1, 255, size=loc.nbytes, dtype=np.uint8)
    got = np.zeros(rem.nbytes, dtype=np.uint8)
    plan = plan_transfer(loc.layers(first, end), lb, rem.layers(first, end), rb)
    _apply(plan, src, got)
    want = np.zeros(rem.nbytes, dtype=np.uint8)
    full = plan_per_chunk(loc, lb, rem, rb)
    layer_of = (
        full.local_addrs % loc.block_stride if p_shape == "block" else full.local_addrs
    ) // loc.layer_stride
    keep = (layer_of >= first) & (layer_of < end)
    _apply(Plan(full.local_addrs[keep], full.remote_addrs[keep], full.lengths[keep]), src, want)
    assert np.array_equal(got, want)
    assert plan.total_bytes == (end - first) * len(lb) * 2 * 16
    if p_shape == d_shape == "layer" or p_shape == d_shape == "block":
        assert plan.descriptors < int(keep.sum())  # coalesced, not one per chunk


def test_a_layer_range_outside_the_region_is_refused() -> None:
    g = Geometry.block_major(0, num_blocks=4, num_layers=4, kv_parts=2, chunk_bytes=16)
    for first, end in ((4, 5), (-1, 1), (2, 2), (3, 1)):
        with pytest.raises(InvalidRequest):
            g.layers(first, end)
    assert g.layers(0, 4) is g
    assert g.layers(1, 3) is g.layers(1, 3)  # one object per range: validated once
