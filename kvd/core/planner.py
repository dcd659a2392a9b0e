"""Descriptor planning: which byte ranges NIXL copies for a KV transfer.

A registered KV region is described by a `Geometry`: the address of the chunk holding
(block b, layer l, K/V part k) is ``base_addr + b*block_stride + l*layer_stride +
k*kv_stride`` and the chunk is ``chunk_bytes`` long. `plan_transfer` pairs the chunks
of a local and a remote block list and coalesces neighbours that are contiguous on both
sides, so a contiguous run of blocks costs one descriptor (block-major) or one per
(layer, part) (layer-major) instead of one per chunk.

This module is the safety boundary of the data plane: NIXL writes wherever a
descriptor points. Rules:

* Every geometry is validated before use (`Geometry.validate`): counts positive,
  strides non-negative, no two chunks overlapping, every chunk inside
  ``[base_addr, base_addr + nbytes)``, nothing beyond int64. Block ids are validated
  (`check_blocks`): strictly ints, in range, no duplicates; nothing is coerced.
* Given those, every address computed below fits int64 and lies inside its region;
  the finished plan is checked against both regions once more anyway.
* All work is vectorised with numpy: no Python loop per block or per chunk.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Final, Protocol, cast

import numpy as np
import numpy.typing as npt
from kvd_client import wire
from kvd_client.errors import Incompatible, InvalidRequest, KvdError

from kvd.core.topology import Pair, RankKv, check_region, map_ranks

Int64Array = npt.NDArray[np.int64]

_SMALL: Final = 64
"""Block lists up to this long are checked in plain Python when they are valid."""

INT64_MAX: Final = 2**63 - 1
INT64_MIN: Final = -(2**63)

_GEOMETRY_FIELDS: Final = (
    "base_addr",
    "nbytes",
    "num_blocks",
    "num_layers",
    "kv_parts",
    "chunk_bytes",
    "block_stride",
    "layer_stride",
    "kv_stride",
    "physical_per_logical",
)


class LayoutLike(Protocol):
    """What a region layout record carries (kvd_client.wire.RegionLayout satisfies it)."""

    @property
    def num_blocks(self) -> int: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def kv_parts(self) -> int: ...
    @property
    def chunk_bytes(self) -> int: ...
    @property
    def block_stride(self) -> int: ...
    @property
    def layer_stride(self) -> int: ...
    @property
    def kv_stride(self) -> int: ...
    @property
    def physical_per_logical(self) -> int: ...


@dataclass(frozen=True, slots=True)
class Geometry:
    """Where every (block, layer, K/V part) chunk of one registered region lives."""

    base_addr: int
    nbytes: int
    """Size of the registered region; every chunk lies in [base_addr, base_addr + nbytes)."""
    num_blocks: int
    """Physical blocks in the region."""
    num_layers: int
    kv_parts: int
    """2 when K and V are stored apart, 1 when one chunk holds both."""
    chunk_bytes: int
    """Bytes of one block of one layer of one K/V part."""
    block_stride: int
    layer_stride: int
    kv_stride: int
    physical_per_logical: int = 1
    """Physical blocks per logical (scheduler) block; see `expand_logical`."""

    @property
    def block_bytes(self) -> int:
        """Bytes of one block over all layers and K/V parts."""
        return self.num_layers * self.kv_parts * self.chunk_bytes

    @classmethod
    def from_layout(cls, base_addr: int, nbytes: int, layout: LayoutLike) -> Geometry:
        """A validated Geometry for a region layout (a wire `RegionLayout`) at an address."""
        geo = cls(
            base_addr=base_addr,
            nbytes=nbytes,
            num_blocks=layout.num_blocks,
            num_layers=layout.num_layers,
            kv_parts=layout.kv_parts,
            chunk_bytes=layout.chunk_bytes,
            block_stride=layout.block_stride,
            layer_stride=layout.layer_stride,
            kv_stride=layout.kv_stride,
            physical_per_logical=layout.physical_per_logical,
        )
        geo.validate()
        return geo

    @classmethod
    def block_major(
        cls,
        base_addr: int,
        num_blocks: int,
        num_layers: int,
        kv_parts: int,
        chunk_bytes: int,
        physical_per_logical: int = 1,
    ) -> Geometry:
        """A region where each block's layers and K/V parts are contiguous."""
        kv_stride = chunk_bytes
        layer_stride = kv_parts * chunk_bytes
        block_stride = num_layers * layer_stride
        geometry = cls(
            base_addr=base_addr,
            nbytes=num_blocks * block_stride,
            num_blocks=num_blocks,
            num_layers=num_layers,
            kv_parts=kv_parts,
            chunk_bytes=chunk_bytes,
            block_stride=block_stride,
            layer_stride=layer_stride,
            kv_stride=kv_stride,
            physical_per_logical=physical_per_logical,
        )
        geometry.validate()
        return geometry

    @classmethod
    def layer_major(
        cls,
        base_addr: int,
        num_blocks: int,
        num_layers: int,
        kv_parts: int,
        chunk_bytes: int,
        physical_per_logical: int = 1,
    ) -> Geometry:
        """A region laid out [layer][K/V part][block] (vLLM's per-layer KV tensors)."""
        block_stride = chunk_bytes
        kv_stride = num_blocks * chunk_bytes
        layer_stride = kv_parts * kv_stride
        geometry = cls(
            base_addr=base_addr,
            nbytes=num_layers * layer_stride,
            num_blocks=num_blocks,
            num_layers=num_layers,
            kv_parts=kv_parts,
            chunk_bytes=chunk_bytes,
            block_stride=block_stride,
            layer_stride=layer_stride,
            kv_stride=kv_stride,
            physical_per_logical=physical_per_logical,
        )
        geometry.validate()
        return geometry

    def validate(self) -> None:
        """Raise InvalidRequest, naming the field, unless this layout is safe to plan on.

        Safe means: every field a plain int within int64; counts and chunk size
        positive; strides non-negative; every chunk inside the region; no two chunks
        overlapping. Overlap is ruled out by sorting the dimensions that have more
        than one entry by stride and requiring each stride to be at least the extent
        of the dimensions inside it (which also makes address order equal to the
        lexicographic order of (outer, ..., inner) indices).
        """
        for name in _GEOMETRY_FIELDS:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool):
                raise InvalidRequest(f"geometry.{name} must be an int, got {type(value).__name__}")
            if not INT64_MIN <= value <= INT64_MAX:
                raise InvalidRequest(f"geometry.{name}={value} overflows int64")
        if self.base_addr < 0:
            raise InvalidRequest(f"geometry.base_addr={self.base_addr} is negative")
        for name in ("nbytes", "num_blocks", "num_layers", "chunk_bytes", "physical_per_logical"):
            value = getattr(self, name)
            if value <= 0:
                raise InvalidRequest(f"geometry.{name}={value} must be > 0")
        if self.kv_parts not in (1, 2):
            raise InvalidRequest(f"geometry.kv_parts={self.kv_parts} must be 1 or 2")
        for name in ("block_stride", "layer_stride", "kv_stride"):
            value = getattr(self, name)
            if value < 0:
                raise InvalidRequest(f"geometry.{name}={value} is negative")
        if self.base_addr + self.nbytes > INT64_MAX:
            raise InvalidRequest(
                f"geometry.base_addr + geometry.nbytes = {self.base_addr + self.nbytes} "
                "overflows int64"
            )
        end = (
            (self.num_blocks - 1) * self.block_stride
            + (self.num_layers - 1) * self.layer_stride
            + (self.kv_parts - 1) * self.kv_stride
            + self.chunk_bytes
        )
        if end > self.nbytes:
            raise InvalidRequest(
                f"geometry.nbytes={self.nbytes} is too small: the last chunk ends at "
                f"offset {end} (check num_blocks, strides and chunk_bytes)"
            )
        dims = sorted(
            (stride, count, name)
            for stride, count, name in (
                (self.kv_stride, self.kv_parts, "kv_stride"),
                (self.layer_stride, self.num_layers, "layer_stride"),
                (self.block_stride, self.num_blocks, "block_stride"),
            )
            if count > 1
        )
        extent = self.chunk_bytes
        for stride, count, name in dims:
            if stride < extent:
                raise InvalidRequest(
                    f"geometry.{name}={stride} is smaller than the {extent} bytes spanned by "
                    "the dimensions inside it: chunks would overlap"
                )
            extent += stride * (count - 1)

    def layers(self, first: int, end: int) -> Geometry:
        """The same region restricted to layers [first, end): each block's part in those
        layers, wherever the layout puts it (one run per block when block-major, one run
        of blocks per layer and K/V part when layer-major). Validated like any geometry."""
        if not 0 <= first < end <= self.num_layers:
            raise InvalidRequest(f"layers [{first}, {end}) outside [0, {self.num_layers})")
        if (first, end) == (0, self.num_layers):
            return self
        skip = first * self.layer_stride
        return _layer_cache(
            Geometry(
                base_addr=self.base_addr + skip,
                nbytes=self.nbytes - skip,
                num_blocks=self.num_blocks,
                num_layers=end - first,
                kv_parts=self.kv_parts,
                chunk_bytes=self.chunk_bytes,
                block_stride=self.block_stride,
                layer_stride=self.layer_stride,
                kv_stride=self.kv_stride,
                physical_per_logical=self.physical_per_logical,
            )
        )

    def check_compatible(self, other: Geometry) -> None:
        """Raise Incompatible unless chunks of `self` and `other` correspond one to one."""
        for name in ("num_layers", "kv_parts", "chunk_bytes"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                raise Incompatible(f"geometries differ: {name} is {mine} here, {theirs} remotely")


def _as_int64_array(values: object, what: str) -> Int64Array:
    """A fresh 1-D int64 array of `values`, which must be ints; nothing is coerced."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise InvalidRequest(f"{what} must be one-dimensional, got shape {values.shape}")
        kind = values.dtype.kind
        if kind == "u" and values.size and int(values.max()) > INT64_MAX:
            first = int(np.argmax(values > INT64_MAX))
            raise InvalidRequest(f"{what}[{first}]={int(values[first])} overflows int64")
        if kind not in "iu":
            raise InvalidRequest(f"{what} must hold integers, got dtype {values.dtype}")
        return np.array(values, dtype=np.int64)
    if isinstance(values, (str, bytes, bytearray, memoryview)) or not isinstance(values, Sequence):
        raise InvalidRequest(f"{what} must be a sequence of ints, got {type(values).__name__}")
    # One C-level pass over the element types: bools (Python's and numpy's), floats,
    # strings and nested lists are refused rather than silently converted.
    for kind_seen in set(map(type, values)):
        if kind_seen is not int and not issubclass(kind_seen, np.integer):
            first = next(i for i, v in enumerate(values) if type(v) is kind_seen)
            raise InvalidRequest(
                f"{what}[{first}]={values[first]!r} is a {kind_seen.__name__}, not an int"
            )
    try:
        return np.array(values, dtype=np.int64)
    except OverflowError:
        first = next(i for i, v in enumerate(values) if not INT64_MIN <= int(v) <= INT64_MAX)
        raise InvalidRequest(f"{what}[{first}]={values[first]} overflows int64") from None


def expand_logical(block_ids: Sequence[int] | npt.NDArray[np.integer], ratio: int) -> Int64Array:
    """Physical block ids of logical blocks: L becomes L*ratio, ..., L*ratio + ratio - 1.

    Logical ids must be non-negative ints small enough that no physical id overflows.
    """
    if not isinstance(ratio, int) or isinstance(ratio, bool) or ratio <= 0:
        raise InvalidRequest(f"physical_per_logical={ratio!r} must be a positive int")
    logical = _as_int64_array(block_ids, "logical block ids")
    limit = (INT64_MAX - (ratio - 1)) // ratio
    bad = (logical < 0) | (logical > limit)
    if bad.any():
        first = int(np.argmax(bad))
        raise InvalidRequest(
            f"logical block id {int(logical[first])} (position {first}) is out of range"
        )
    if ratio == 1:
        return logical
    offsets = np.arange(ratio, dtype=np.int64)
    expanded: Int64Array = (logical[:, None] * ratio + offsets[None, :]).reshape(-1)
    return expanded


def _small_and_valid(geometry: Geometry, block_ids: object) -> bool:
    """A short list or tuple of distinct Python ints inside [0, num_blocks)."""
    if type(block_ids) not in (list, tuple):
        return False
    ids = cast("Sequence[int]", block_ids)
    n = geometry.num_blocks
    return (
        len(ids) <= _SMALL
        and all(type(b) is int and 0 <= b < n for b in ids)
        and len(set(ids)) == len(ids)
    )


def check_blocks(
    geometry: Geometry, block_ids: Sequence[int] | npt.NDArray[np.integer]
) -> Int64Array:
    """Validated physical block ids as a fresh int64 array.

    Raises InvalidRequest, naming the first offender, for anything that is not a 1-D
    sequence of ints, for ids outside [0, num_blocks), and for duplicates.
    """
    if _small_and_valid(geometry, block_ids):
        # the common small request, valid: plain Python is much cheaper than numpy here
        return np.array(block_ids, dtype=np.int64)
    blocks = _as_int64_array(block_ids, "block ids")
    bad = (blocks < 0) | (blocks >= geometry.num_blocks)
    if bad.any():
        first = int(np.argmax(bad))
        raise InvalidRequest(
            f"block id {int(blocks[first])} (position {first}) is outside "
            f"[0, {geometry.num_blocks})"
        )
    if blocks.size > 1:
        ordered = np.sort(blocks)
        if (ordered[1:] == ordered[:-1]).any():
            _, first_seen, counts = np.unique(blocks, return_index=True, return_counts=True)
            dup_value = int(blocks[int(first_seen[counts > 1].min())])
            second = int(np.flatnonzero(blocks == dup_value)[1])
            raise InvalidRequest(
                f"block id {dup_value} appears more than once (again at position {second})"
            )
    return blocks


def _frozen(array: Int64Array) -> Int64Array:
    array.setflags(write=False)
    return array


@dataclass(frozen=True, slots=True, eq=False)
class Plan:
    """Paired descriptors: copy lengths[i] bytes between local_addrs[i] and remote_addrs[i].

    The arrays are int64, equally long and read-only.
    """

    local_addrs: Int64Array
    remote_addrs: Int64Array
    lengths: Int64Array

    @property
    def descriptors(self) -> int:
        return int(self.lengths.shape[0])

    @property
    def total_bytes(self) -> int:
        return int(self.lengths.sum(dtype=np.int64))

    def as_tuples_local(self, dev: int = 0) -> Int64Array:
        """An Nx3 int64 array of (addr, len, dev), as NIXL's descriptor lists take."""
        return _tuples(self.local_addrs, self.lengths, dev)

    def as_tuples_remote(self, dev: int = 0) -> Int64Array:
        """An Nx3 int64 array of (addr, len, dev) on the remote side."""
        return _tuples(self.remote_addrs, self.lengths, dev)


def _tuples(addrs: Int64Array, lengths: Int64Array, dev: int) -> Int64Array:
    out = np.empty((addrs.shape[0], 3), dtype=np.int64)
    out[:, 0] = addrs
    out[:, 1] = lengths
    out[:, 2] = dev
    return out


_VALIDATED: dict[int, Geometry] = {}
"""Geometries already validated, by identity (a Geometry is immutable). Kept alive here
so that an id is never reused by another object while it is a key."""

_VALIDATED_MAX: Final = 4096


def _validate_once(geometry: Geometry) -> None:
    """`geometry.validate()`, skipped for the very object validated before."""
    if _VALIDATED.get(id(geometry)) is geometry:
        return
    geometry.validate()
    if len(_VALIDATED) >= _VALIDATED_MAX:
        _VALIDATED.clear()
    _VALIDATED[id(geometry)] = geometry


def _prepare(
    local: Geometry,
    local_blocks: Sequence[int] | npt.NDArray[np.integer],
    remote: Geometry,
    remote_blocks: Sequence[int] | npt.NDArray[np.integer],
    check: Callable[[Geometry, Any], Int64Array] | None = None,
) -> tuple[Int64Array, Int64Array]:
    """Validated physical block ids of both sides (`check`: how ids become physical ids,
    `check_blocks` by default, i.e. they already are)."""
    check = check or check_blocks
    _validate_once(local)
    _validate_once(remote)
    local.check_compatible(remote)
    lb = check(local, local_blocks)
    rb = check(remote, remote_blocks)
    if lb.shape[0] != rb.shape[0]:
        raise InvalidRequest(
            f"{lb.shape[0]} local blocks but {rb.shape[0]} remote blocks: counts must match"
        )
    return lb, rb


_Dim = tuple[Int64Array, Int64Array, int | None, int | None]
"""One dimension of the chunk grid: its local and remote address offsets, and the
constant step between consecutive offsets on each side when the dimension is a plain
range (layers, K/V parts), else None (blocks: any ids)."""


def _grid_dims(
    local: Geometry, lb: Int64Array, remote: Geometry, rb: Int64Array, by_local_address: bool
) -> list[_Dim]:
    """The (block, layer, part) dimensions of the chunk grid, outermost first.

    With `by_local_address`, block pairs are sorted by local id and the dimensions by
    local stride, largest first; validation guarantees that the flattened grid is then
    in ascending local address order. Otherwise the order is the request's: block
    position, then layer, then part.
    """
    if by_local_address:
        order = np.argsort(lb, kind="stable")
        lb, rb = lb[order], rb[order]
    layers = np.arange(local.num_layers, dtype=np.int64)
    parts = np.arange(local.kv_parts, dtype=np.int64)
    dims: list[tuple[int, _Dim]] = [
        (local.block_stride, (lb * local.block_stride, rb * remote.block_stride, None, None)),
        (
            local.layer_stride,
            (
                layers * local.layer_stride,
                layers * remote.layer_stride,
                local.layer_stride,
                remote.layer_stride,
            ),
        ),
        (
            local.kv_stride,
            (parts * local.kv_stride, parts * remote.kv_stride, local.kv_stride, remote.kv_stride),
        ),
    ]
    if by_local_address:
        # A dimension with one entry adds a constant: its stride has no say in the order.
        dims.sort(key=lambda dim: -dim[0] if dim[1][0].shape[0] > 1 else 0)
    return [dim for _, dim in dims]


def _outer_sum(base: int, offsets: list[Int64Array]) -> Int64Array:
    """``base + o0[i] + o1[j] + ...`` for every index tuple, flattened in C order."""
    out = np.full(1, base, dtype=np.int64)
    for off in offsets:
        out = (out[:, None] + off[None, :]).reshape(-1)
    return out


def _coalesced(
    base_local: int, base_remote: int, dims: list[_Dim], chunk: int
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """Maximal runs of chunks contiguous on both sides, in local address order.

    Equivalent to laying out every chunk pair and merging neighbours, but works from
    the inside out so the cost follows the number of descriptors, not of chunks:
    an inner dimension whose every step continues the previous unit on both sides
    folds into a larger unit; the first one that does not is cut into runs; the
    remaining outer dimensions are laid out over those runs and merged once more
    where a run happens to continue across an outer step.
    """
    dims = list(dims)
    unit = chunk
    while dims:
        lo, ro, lstep, rstep = dims[-1]
        n = lo.shape[0]
        if n > 1:
            # A range dimension steps by a constant: no need to look at every offset.
            if lstep is not None and rstep is not None:
                if lstep != unit or rstep != unit:
                    break
            elif not (_steps_equal(lo, unit) and _steps_equal(ro, unit)):
                break
        dims.pop()
        base_local += int(lo[0])
        base_remote += int(ro[0])
        unit *= n
    if not dims:
        one = np.ones(1, dtype=np.int64)
        return one * base_local, one * base_remote, one * unit
    lo, ro, lstep, rstep = dims.pop()
    n = lo.shape[0]
    if not dims and n <= _SMALL:
        return _runs_small(base_local, base_remote, lo, ro, unit, lstep is None or rstep is None)
    if lstep is not None and rstep is not None:
        starts = np.arange(n, dtype=np.int64)  # it did not fold: no step continues a run
        run_lengths = np.full(n, unit, dtype=np.int64)
    else:
        joins = ((lo[1:] - lo[:-1]) == unit) & ((ro[1:] - ro[:-1]) == unit)
        starts = np.flatnonzero(np.concatenate(([True], ~joins)))
        run_lengths = np.diff(np.append(starts, n)) * unit
    la = _outer_sum(base_local, [d[0] for d in dims] + [lo[starts]])
    ra = _outer_sum(base_remote, [d[1] for d in dims] + [ro[starts]])
    outer = la.shape[0] // starts.shape[0]
    lengths = np.tile(run_lengths, outer)
    if outer > 1:
        ends_l = la[:-1] + lengths[:-1]
        ends_r = ra[:-1] + lengths[:-1]
        joins = (la[1:] == ends_l) & (ra[1:] == ends_r)
        if joins.any():
            starts = np.flatnonzero(np.concatenate(([True], ~joins)))
            lengths = np.add.reduceat(lengths, starts)
            la, ra = la[starts], ra[starts]
    return la, ra, lengths.astype(np.int64, copy=False)


def _runs_small(
    base_local: int, base_remote: int, lo: Int64Array, ro: Int64Array, unit: int, join: bool
) -> tuple[Int64Array, Int64Array, Int64Array]:
    """`_coalesced`'s last step in plain Python, for a short outermost dimension (the
    common small request: numpy's per-call overhead dominates there). `join`: whether a
    unit may continue the previous run (False for a range that did not fold)."""
    la: list[int] = []
    ra: list[int] = []
    lengths: list[int] = []
    for lo_i, ro_i in zip(lo.tolist(), ro.tolist(), strict=True):
        a, b = base_local + lo_i, base_remote + ro_i
        if join and lengths and la[-1] + lengths[-1] == a and ra[-1] + lengths[-1] == b:
            lengths[-1] += unit
        else:
            la.append(a)
            ra.append(b)
            lengths.append(unit)
    return (
        np.array(la, dtype=np.int64),
        np.array(ra, dtype=np.int64),
        np.array(lengths, dtype=np.int64),
    )


def _steps_equal(offsets: Int64Array, step: int) -> bool:
    """Whether consecutive offsets all differ by exactly `step`."""
    return bool(((offsets[1:] - offsets[:-1]) == step).all())


def _check_inside(addrs: Int64Array, lengths: Int64Array, geometry: Geometry, side: str) -> None:
    if addrs.shape[0] == 0:
        return
    _check_span(int(addrs.min()), int((addrs + lengths).max()), geometry, side)


def _check_span(low: int, high: int, geometry: Geometry, side: str) -> None:
    """Descriptors spanning [low, high) lie inside the region."""
    if low < geometry.base_addr or high > geometry.base_addr + geometry.nbytes:
        # Unreachable for validated inputs; refuse rather than hand NIXL a wild address.
        raise KvdError(
            f"planner bug: {side} descriptors span [{low:#x}, {high:#x}) outside the region "
            f"[{geometry.base_addr:#x}, {geometry.base_addr + geometry.nbytes:#x})"
        )


def _finish(local: Geometry, remote: Geometry, plan: Plan) -> Plan:
    _check_inside(plan.local_addrs, plan.lengths, local, "local")
    _check_inside(plan.remote_addrs, plan.lengths, remote, "remote")
    return plan


def plan_transfer(
    local: Geometry,
    local_blocks: Sequence[int] | npt.NDArray[np.integer],
    remote: Geometry,
    remote_blocks: Sequence[int] | npt.NDArray[np.integer],
) -> Plan:
    """Descriptors copying local block ``local_blocks[i]`` to/from remote ``remote_blocks[i]``.

    Block ids are physical (see `expand_logical`). Chunk pairs are ordered by local
    address and merged while both sides continue exactly where the previous chunk
    ended. Raises Incompatible if the geometries' chunks do not correspond, and
    InvalidRequest for an invalid geometry or block list.
    """
    lb, rb = _prepare(local, local_blocks, remote, remote_blocks)
    return _plan_checked(local, lb, remote, rb)


def _plan_checked(local: Geometry, lb: Int64Array, remote: Geometry, rb: Int64Array) -> Plan:
    """`plan_transfer` of block ids already validated against their geometries."""
    if lb.shape[0] == 0:
        empty = np.empty(0, dtype=np.int64)
        return Plan(_frozen(empty), _frozen(empty.copy()), _frozen(empty.copy()))
    if lb.shape[0] <= _SMALL and (small := _plan_small(local, lb, remote, rb)) is not None:
        return small
    return _plan_vectorised(local, lb, remote, rb)


def _plan_vectorised(local: Geometry, lb: Int64Array, remote: Geometry, rb: Int64Array) -> Plan:
    """`_plan_checked` with numpy, for any number of blocks (at least one)."""
    dims = _grid_dims(local, lb, remote, rb, by_local_address=True)
    la, ra, lengths = _coalesced(local.base_addr, remote.base_addr, dims, local.chunk_bytes)
    return _finish(local, remote, Plan(_frozen(la), _frozen(ra), _frozen(lengths)))


_SMALL_UNITS: Final = 64
"""`_plan_small` plans a request whose units, once the inner dimensions folded, number
at most this many; more go through numpy (on this machine plain Python is faster up to
~100 of them: a 2-block layer-major request, 128 units, took 46 us against numpy's 35)."""


def _plan_small(local: Geometry, lb: Int64Array, remote: Geometry, rb: Int64Array) -> Plan | None:
    """`_plan_checked` in plain Python, for a few blocks: the same descriptors in the same
    order (tests/core/test_planner.py compares the two), without numpy's per-call cost,
    which made up most of the ~75 us that planning a 2-block push took on P's loop
    (`kvd bench --only control`, 2 cores). None where more than `_SMALL_UNITS` units
    are left to lay out (a layer-major region's layers and parts): numpy pays there.

    The grid's dimensions (blocks, layers, K/V parts) are ordered by local stride as in
    `_grid_dims`; inner ones that continue each other on both sides fold into one unit
    as in `_coalesced`; what remains is laid out in local address order and neighbours
    contiguous on both sides are merged (maximal runs, as `_coalesced`'s two merges)."""
    pairs = sorted(zip(lb.tolist(), rb.tolist(), strict=True))
    # (local stride, entries, local offsets, remote offsets); offsets None for a range
    # (layers, parts), whose offsets are i * stride on each side
    blocks = (
        [p * local.block_stride for p, _ in pairs],
        [d * remote.block_stride for _, d in pairs],
    )
    dims: list[tuple[int, int, tuple[list[int], list[int]] | None, int, int]] = [
        (local.block_stride, len(pairs), blocks, local.block_stride, remote.block_stride),
        (local.layer_stride, local.num_layers, None, local.layer_stride, remote.layer_stride),
        (local.kv_stride, local.kv_parts, None, local.kv_stride, remote.kv_stride),
    ]
    dims.sort(key=lambda dim: -dim[0] if dim[1] > 1 else 0)
    unit = local.chunk_bytes
    base_l, base_r = local.base_addr, remote.base_addr
    while dims:
        _, n, offsets, lstep, rstep = dims[-1]
        if n > 1:
            if offsets is None:
                if lstep != unit or rstep != unit:
                    break
            elif not (_steps(offsets[0], unit) and _steps(offsets[1], unit)):
                break
        dims.pop()
        if offsets is not None:  # a range starts at offset 0
            base_l += offsets[0][0]
            base_r += offsets[1][0]
        unit *= n
    units = 1
    for dim in dims:
        units *= dim[1]
    if units > _SMALL_UNITS:
        return None
    lo: list[int] = [base_l]
    ro: list[int] = [base_r]
    for _, n, offsets, lstep, rstep in dims:  # outermost first: C order
        dl, dr = offsets if offsets is not None else _range(n, lstep, rstep)
        lo = [a + b for a in lo for b in dl]
        ro = [a + b for a in ro for b in dr]
    la: list[int] = []
    ra: list[int] = []
    lengths: list[int] = []
    for a, b in zip(lo, ro, strict=True):
        if lengths and la[-1] + lengths[-1] == a and ra[-1] + lengths[-1] == b:
            lengths[-1] += unit
        else:
            la.append(a)
            ra.append(b)
            lengths.append(unit)
    for addrs, geometry, side in ((la, local, "local"), (ra, remote, "remote")):
        high = max(a + n for a, n in zip(addrs, lengths, strict=True))
        _check_span(min(addrs), high, geometry, side)
    return Plan(
        _frozen(np.array(la, dtype=np.int64)),
        _frozen(np.array(ra, dtype=np.int64)),
        _frozen(np.array(lengths, dtype=np.int64)),
    )


def _steps(offsets: list[int], step: int) -> bool:
    """Whether consecutive offsets all differ by exactly `step` (`_steps_equal`)."""
    return all(b - a == step for a, b in itertools.pairwise(offsets))


def _range(n: int, lstep: int, rstep: int) -> tuple[list[int], list[int]]:
    return [i * lstep for i in range(n)], [i * rstep for i in range(n)]


def plan_pieces(
    local: Geometry,
    local_blocks: Int64Array,
    remote: Geometry,
    remote_blocks: Int64Array,
    pieces: Sequence[tuple[int, int, int, int]],
) -> Plan:
    """Descriptors for the same pieces of every (block pair, layer): a piece is (part,
    offset in the local chunk, offset in the remote chunk, length). Blocks are physical
    and validated; every descriptor is checked to lie inside its chunk's region. Order:
    block pair, layer, piece (nothing merged: pieces are what a TP split cuts apart)."""
    if local_blocks.shape != remote_blocks.shape:
        raise InvalidRequest(f"{local_blocks.shape[0]} local blocks for {remote_blocks.shape[0]}")
    empty = np.empty(0, dtype=np.int64)
    if not pieces or local_blocks.shape[0] == 0:
        return Plan(_frozen(empty), _frozen(empty.copy()), _frozen(empty.copy()))
    part, lo, ro, ln = (np.array(col, dtype=np.int64) for col in zip(*pieces, strict=True))
    if bool((lo + ln > local.chunk_bytes).any()) or bool((ro + ln > remote.chunk_bytes).any()):
        raise InvalidRequest("a piece runs past its chunk")
    layers = np.arange(local.num_layers, dtype=np.int64)
    la = (
        local.base_addr
        + (local_blocks * local.block_stride)[:, None, None]
        + (layers * local.layer_stride)[None, :, None]
        + (part * local.kv_stride + lo)[None, None, :]
    ).ravel()
    ra = (
        remote.base_addr
        + (remote_blocks * remote.block_stride)[:, None, None]
        + (layers * remote.layer_stride)[None, :, None]
        + (part * remote.kv_stride + ro)[None, None, :]
    ).ravel()
    lengths = np.broadcast_to(ln, (local_blocks.shape[0], local.num_layers, ln.shape[0])).ravel()
    plan = Plan(_frozen(la), _frozen(ra), _frozen(np.ascontiguousarray(lengths)))
    return _finish(local, remote, plan)


def plan_per_chunk(
    local: Geometry,
    local_blocks: Sequence[int] | npt.NDArray[np.integer],
    remote: Geometry,
    remote_blocks: Sequence[int] | npt.NDArray[np.integer],
) -> Plan:
    """Like `plan_transfer` but one descriptor per (block, layer, part), never merged.

    Order: block position, layer, part. For benchmarks against the coalesced plan.
    """
    lb, rb = _prepare(local, local_blocks, remote, remote_blocks)
    dims = _grid_dims(local, lb, remote, rb, by_local_address=False)
    la = _outer_sum(local.base_addr, [d[0] for d in dims])
    ra = _outer_sum(remote.base_addr, [d[1] for d in dims])
    lengths = np.full(la.shape[0], local.chunk_bytes, dtype=np.int64)
    return _finish(local, remote, Plan(_frozen(la), _frozen(ra), _frozen(lengths)))


def check_logical(geometry: Geometry, logical: Sequence[int]) -> Int64Array:
    """Logical block ids of an engine expanded to this region's physical ids, validated
    (raises InvalidRequest for anything outside the region)."""
    ratio = geometry.physical_per_logical
    if ratio == 1 and _small_and_valid(geometry, logical):
        return np.array(logical, dtype=np.int64)  # the common case, without numpy's overhead
    return check_blocks(geometry, expand_logical(logical, ratio))


_LAYER_GEOMETRIES: dict[Geometry, Geometry] = {}


def _layer_cache(geometry: Geometry) -> Geometry:
    """One object per layer-restricted geometry (equal ones share it), so that each is
    validated once (`_validate_once` goes by identity) however many layers are planned."""
    have = _LAYER_GEOMETRIES.get(geometry)
    if have is not None:
        return have
    if len(_LAYER_GEOMETRIES) >= _VALIDATED_MAX:
        _LAYER_GEOMETRIES.clear()
    _LAYER_GEOMETRIES[geometry] = geometry
    return geometry


# ------------------------------------------------------------------ any P onto any D


class RankView(Protocol):
    """One rank's region as `plan_request` needs it (LocalRegion, RemoteRegion)."""

    @property
    def tp_rank(self) -> int: ...
    @property
    def tp_size(self) -> int: ...
    @property
    def compat(self) -> str: ...
    @property
    def geometry(self) -> Geometry: ...
    @property
    def layout(self) -> wire.RegionLayout | None: ...
    @property
    def mem_type(self) -> str: ...


@dataclass(frozen=True, slots=True, eq=False)
class Permute:
    """A receive step: D rank `d`'s `blocks` (physical) arrived in P's token layout
    `src_layout` (whole chunks) and are permuted in place into D's own before D reports
    them done. `pair`: the index of its rank pair in the request's pairs."""

    pair: int
    blocks: Int64Array
    src_layout: str
    tokens: int
    heads: int
    head_bytes: int
    geometry: Geometry | None = None
    """The chunks' geometry when not the region's own (a KV cache group of a hybrid
    region, `kvd.core.hybrid`)."""


def permutes_on_receive(p_kv: RankKv, d_kv: RankKv, pair: Pair, d_mem: str) -> bool:
    """Whether a pair moves whole chunks in P's layout and D permutes them on receive,
    rather than descriptors landing every (token, head) in D's layout: when only the
    token layout differs (same heads, same block size) and D's region is host memory
    (the daemon permutes it with numpy; GPU memory keeps the descriptors). One
    descriptor per (token, head) costs hundreds of memcpys; the permute a few
    (`kvd bench --only topology`). P and D decide alike from the same views."""
    return (
        pair.whole
        and p_kv.tokens_per_block == d_kv.tokens_per_block
        and p_kv.kv_layout != d_kv.kv_layout
        and d_mem == "DRAM"
    )


def receive_permutes(
    p: Sequence[RankView], d: Sequence[RankView], d_logical: Sequence[int]
) -> tuple[tuple[Pair, ...], tuple[Permute, ...]]:
    """D's side of `plan_request` without P's blocks (push: P plans the WRITE): the pairs,
    and the receive permutes D owes (all of a permuted rank's blocks are filled)."""
    pairs = map_ranks(p, d)
    if not pairs or pairs[0].heads == 0:
        return pairs, ()
    out: list[Permute] = []
    for i, pair in enumerate(pairs):
        pk, dk = rank_kv(p[pair.p]), rank_kv(d[pair.d])
        if permutes_on_receive(pk, dk, pair, d[pair.d].mem_type):
            blocks = check_logical(d[pair.d].geometry, d_logical)
            out.append(
                Permute(i, blocks, pk.kv_layout, dk.tokens_per_block, dk.heads, dk.head_bytes)
            )
    return pairs, tuple(out)


PERMUTE_RUN_BYTES: Final = 1 << 20
"""An in-place permute copies at most this many bytes of blocks per numpy call."""


def permute_chunks(buf: npt.NDArray[np.uint8], geometry: Geometry, job: Permute) -> None:
    """Permute `job.blocks`' chunks of the region whose bytes `buf` holds (from
    `geometry.base_addr`) from `job.src_layout` into the other token layout, in place.

    Two passes over the bytes: each run of consecutive blocks is copied out, then written
    back transposed through a strided view of the destination layout (numpy checks that
    both views lie inside `buf`). A run is taken at most `PERMUTE_RUN_BYTES` at a time:
    the copy stays in cache, and its temporary is small (a 32 MiB one came fresh from the
    kernel on some calls and not others: 8-10 ms or 50-60 ms for a 32 MiB request).
    """
    g = geometry
    n = int(job.blocks.shape[0])
    if n == 0:
        return
    t, h, hb = job.tokens, job.heads, job.head_bytes
    blocks = np.sort(job.blocks)
    cuts = np.flatnonzero(np.diff(blocks) != 1) + 1
    starts = np.concatenate(([0], cuts))
    ends = np.concatenate((cuts, [n]))
    # (token, head) strides of the source and destination layouts inside a chunk
    nhd, hnd = (h * hb, hb), (hb, t * hb)
    src_steps, dst_steps = (nhd, hnd) if job.src_layout == "NHD" else (hnd, nhd)
    outer = (g.block_stride, g.layer_stride, g.kv_stride)
    head = np.dtype((np.void, hb))  # a head's bytes move as one item (numpy memcpys it)
    per = max(1, PERMUTE_RUN_BYTES // (g.num_layers * g.kv_parts * t * h * hb))
    for lo, hi in zip(starts.tolist(), ends.tolist(), strict=True):
        for a in range(lo, hi, per):
            first, count = int(blocks[a]), min(per, hi - a)
            at = buf[first * g.block_stride :]
            shape = (count, g.num_layers, g.kv_parts, t, h)
            src = np.ndarray(shape, head, buffer=at, strides=(*outer, *src_steps))
            dst = np.ndarray(shape, head, buffer=at, strides=(*outer, *dst_steps))
            dst[...] = src.copy()


def align_tokens(
    p_blocks: Int64Array, p_tokens: int, d_blocks: Int64Array, d_tokens: int
) -> tuple[Int64Array, int, int]:
    """P's physical blocks D's blocks take, the token unit and the number of units.

    D's blocks are the tail of the request's blocks on D (D may hold a prefix itself):
    they start on a boundary of the larger of the two block sizes, and the last block on
    either side may be partly filled. With equal block sizes this is "D's n blocks take
    P's last n". Returns (P's blocks from the first one D takes, unit tokens G, units),
    where G is the smaller block size and the units are what both sides hold.
    """
    m, n = int(p_blocks.shape[0]), int(d_blocks.shape[0])
    small, large = min(p_tokens, d_tokens), max(p_tokens, d_tokens)
    if large % small:
        raise Incompatible(
            f"block sizes differ by a non-integer factor: P {p_tokens}, D {d_tokens} tokens"
        )
    k = large // small
    if p_tokens == d_tokens:
        if n > m:
            raise InvalidRequest(f"D has {n} blocks to fill but P has only {m}")
        return p_blocks[m - n :], small, n
    if d_tokens > p_tokens:  # each D block takes k of P's
        spans = -(-m // k)
        if n > spans:
            raise InvalidRequest(
                f"D has {n} blocks of {d_tokens} tokens to fill but P's {m} blocks of "
                f"{p_tokens} tokens span only {spans}"
            )
        taken = p_blocks[(spans - n) * k :]
        return taken, small, int(taken.shape[0])
    spans = -(-n // k)  # P blocks D's blocks reach into
    if spans > m:
        raise InvalidRequest(
            f"D has {n} blocks of {d_tokens} tokens to fill but P has only {m} blocks of "
            f"{p_tokens} tokens"
        )
    return p_blocks[m - spans :], small, n


def _unit_offsets(
    blocks: Int64Array,
    geo: Geometry,
    tokens: int,
    unit: int,
    units: int,
    token_step: int,
    first: int = 0,
) -> Int64Array:
    tok = first + np.arange(units, dtype=np.int64) * unit
    out: Int64Array = blocks[tok // tokens] * geo.block_stride + (tok % tokens) * token_step
    return out


def plan_heads(
    local: Geometry,
    local_kv: RankKv,
    local_blocks: Int64Array,
    remote: Geometry,
    remote_kv: RankKv,
    remote_blocks: Int64Array,
    *,
    unit: int,
    units: int,
    local_head: int,
    remote_head: int,
    heads: int,
    local_first: int = 0,
    remote_first: int = 0,
) -> Plan:
    """Descriptors moving `heads` heads (from local head `local_head` and remote head
    `remote_head`) of `units` token units of `unit` tokens, each side in its own block
    size and token layout (NHD/HND): bytes land in the destination's layout.

    Block ids are physical and validated; the i-th unit lies in block
    ``blocks[(first + i*unit) // tokens_per_block]`` on each side (`local_first`,
    `remote_first`: the first unit's token offset from the start of `blocks[0]`).
    Neighbours contiguous on both sides merge, so matching layouts and whole heads cost
    what whole chunks cost; a head slice costs one descriptor per token run in NHD and per
    head run in HND; a layout conversion costs one per (token, head).
    """
    _validate_once(local)
    _validate_once(remote)
    if units == 0:
        empty = np.empty(0, dtype=np.int64)
        return Plan(_frozen(empty), _frozen(empty.copy()), _frozen(empty.copy()))
    hb = local_kv.head_bytes
    lu = _unit_offsets(
        local_blocks,
        local,
        local_kv.tokens_per_block,
        unit,
        units,
        local_kv.token_step,
        local_first,
    )
    ru = _unit_offsets(
        remote_blocks,
        remote,
        remote_kv.tokens_per_block,
        unit,
        units,
        remote_kv.token_step,
        remote_first,
    )
    layers = np.arange(local.num_layers, dtype=np.int64)
    parts = np.arange(local.kv_parts, dtype=np.int64)
    toks = np.arange(unit, dtype=np.int64)
    hs = np.arange(heads, dtype=np.int64)
    outer: list[tuple[int, _Dim]] = [
        (local.block_stride, (lu, ru, None, None)),
        (
            local.layer_stride,
            (
                layers * local.layer_stride,
                layers * remote.layer_stride,
                local.layer_stride,
                remote.layer_stride,
            ),
        ),
        (
            local.kv_stride,
            (parts * local.kv_stride, parts * remote.kv_stride, local.kv_stride, remote.kv_stride),
        ),
    ]
    outer.sort(key=lambda dim: -dim[0] if dim[1][0].shape[0] > 1 else 0)
    tok_dim: _Dim = (
        toks * local_kv.token_step,
        toks * remote_kv.token_step,
        local_kv.token_step,
        remote_kv.token_step,
    )
    head_dim: _Dim = (
        (local_head + hs) * local_kv.head_step,
        (remote_head + hs) * remote_kv.head_step,
        local_kv.head_step,
        remote_kv.head_step,
    )
    inner = [tok_dim, head_dim] if local_kv.kv_layout == "NHD" else [head_dim, tok_dim]
    dims = [d for _, d in outer] + inner
    la, ra, lengths = _coalesced(local.base_addr, remote.base_addr, dims, hb)
    return _finish(local, remote, Plan(_frozen(la), _frozen(ra), _frozen(lengths)))


@dataclass(frozen=True, slots=True, eq=False)
class RequestPlan:
    """The transfers of one request: `pairs[i]` moves `plans[i]` (local/remote as the
    caller's side) between P rank `pairs[i].p` and D rank `pairs[i].d`."""

    pairs: tuple[Pair, ...]
    plans: tuple[Plan, ...]
    permutes: tuple[Permute, ...] = ()
    """What D permutes on receive (`permutes_on_receive`), by pair index."""


def shift_plan(
    plan: RequestPlan, local_deltas: Sequence[int], remote_deltas: Sequence[int]
) -> RequestPlan:
    """`plan` with pair i's local addresses moved by `local_deltas[i]` bytes and its remote
    ones by `remote_deltas[i]`: the plan of the same blocks between regions moved so.
    Planning depends on a region's base address only by adding it (descriptors merge
    where both sides continue each other, which moving a side as a whole keeps), so the
    plan of a request's layers [f + n, e + n) is that of [f, e) moved by n layer strides
    on each side (`Geometry.layers`); a layer-wise push plans each range once."""
    plans = tuple(
        Plan(_frozen(p.local_addrs + dl), _frozen(p.remote_addrs + dr), p.lengths)
        for p, dl, dr in zip(plan.plans, local_deltas, remote_deltas, strict=True)
    )
    return RequestPlan(plan.pairs, plans, plan.permutes)


def plan_request(
    p: Sequence[RankView],
    p_logical: Sequence[int],
    d: Sequence[RankView],
    d_logical: Sequence[int],
    *,
    local_is_p: bool,
) -> RequestPlan:
    """Plan every transfer of a request from P's ranks to D's (each in rank order), from
    logical block ids on each side: D's blocks take the tail of P's (`align_tokens`).

    Raises Incompatible (naming both sides' values) unless the two sides can map
    (`kvd.core.topology.map_ranks`), InvalidRequest for a block outside a region or
    counts that cannot match.
    """
    pairs = map_ranks(p, d)
    p_phys = [check_logical(r.geometry, p_logical) for r in p]
    d_phys = [check_logical(r.geometry, d_logical) for r in d]
    plans: list[Plan] = []
    if pairs and pairs[0].heads == 0:  # opaque compat: equal TP, whole chunks, equal sizes
        for pair in pairs:
            pg, dg = p[pair.p].geometry, d[pair.d].geometry
            pb, _, units = align_tokens(p_phys[pair.p], 1, d_phys[pair.d], 1)
            db = d_phys[pair.d][:units]
            plans.append(_whole_chunks(pg, pb, dg, db, local_is_p))
        return RequestPlan(pairs, tuple(plans))
    p_kv = [rank_kv(r) for r in p]
    d_kv = [rank_kv(r) for r in d]
    permutes: list[Permute] = []
    for pair in pairs:
        pk, dk = p_kv[pair.p], d_kv[pair.d]
        pg, dg = p[pair.p].geometry, d[pair.d].geometry
        pb, unit, units = align_tokens(
            p_phys[pair.p], pk.tokens_per_block, d_phys[pair.d], dk.tokens_per_block
        )
        db = d_phys[pair.d]
        permute = permutes_on_receive(pk, dk, pair, d[pair.d].mem_type)
        if permute or (
            pair.whole
            and pk.tokens_per_block == dk.tokens_per_block
            and pk.kv_layout == dk.kv_layout
        ):
            db = db[:units]
            pb = pb[:units]
            plans.append(_whole_chunks(pg, pb, dg, db, local_is_p))
            if permute:
                permutes.append(
                    Permute(
                        len(plans) - 1,
                        db,
                        pk.kv_layout,
                        dk.tokens_per_block,
                        dk.heads,
                        dk.head_bytes,
                    )
                )
            continue
        if local_is_p:
            plan = plan_heads(
                pg,
                pk,
                pb,
                dg,
                dk,
                db,
                unit=unit,
                units=units,
                local_head=pair.p_head,
                remote_head=pair.d_head,
                heads=pair.heads,
            )
        else:
            plan = plan_heads(
                dg,
                dk,
                db,
                pg,
                pk,
                pb,
                unit=unit,
                units=units,
                local_head=pair.d_head,
                remote_head=pair.p_head,
                heads=pair.heads,
            )
        plans.append(plan)
    return RequestPlan(pairs, tuple(plans), tuple(permutes))


def _whole_chunks(
    pg: Geometry, pb: Int64Array, dg: Geometry, db: Int64Array, local_is_p: bool
) -> Plan:
    """`plan_transfer` of physical ids already validated (`check_logical`), as the
    caller's side sees it."""
    for geo in (pg, dg):
        _validate_once(geo)
    pg.check_compatible(dg)
    return _plan_checked(pg, pb, dg, db) if local_is_p else _plan_checked(dg, db, pg, pb)


def rank_kv(region: RankView) -> RankKv:
    """A rank's KV format from its region's compat and layout (Incompatible if none)."""
    layout = region.layout
    if layout is None:
        raise Incompatible(f"rank {region.tp_rank}'s region has no layout record")
    kv = check_region(region.compat, layout, region.tp_size, region.tp_rank)
    assert kv is not None  # map_ranks found a spec
    return kv
