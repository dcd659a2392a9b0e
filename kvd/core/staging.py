"""D-side staging: whole chunks into a staging buffer, then one scatter into D's blocks.

A rank pair that slices heads (P TP != D TP) or converts the token layout (NHD <-> HND)
costs one descriptor per (block, layer, K/V part), or per token, when its bytes land in
D's layout directly; over same-host `cma` each descriptor costs microseconds, so such a
request moves at a fraction of the rate of an equal-TP one. Staged instead, D's daemon
READs each P rank's blocks whole (one descriptor per run of P's blocks) into a slot of its
staging buffer, once for every D rank that takes heads of that P rank, and then copies
each D rank's heads out of the slot into D's blocks in D's layout: one strided numpy pass
per pair (head slice and layout conversion at once), before D reports the request done.

`plan_staged` decides per P rank, from a cost model whose constants were measured here
(`kvd bench --quick --only topology`), whether staging beats the request's direct plan,
and keeps the cheaper. Only pairs of equal block size into D's host memory (`DRAM`) stage;
the rest keep their direct plans. `StagingPool` is the bounded allocator of slots: a slot
is handed out per transfer, freed exactly once, and a slot whose READ may still land
(the transport has not reported the transfer ended) is quarantined instead of freed,
until it has. When no slot fits, the caller keeps the direct plan: staging is never a
reason to fail.

Sans IO: plain functions of region views and block ids, and a plain allocator.
"""

from __future__ import annotations

from bisect import insort
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
from kvd_client.errors import KvdError

from kvd.core.planner import (
    Geometry,
    Int64Array,
    Permute,
    Plan,
    RankView,
    RequestPlan,
    _plan_checked,
    align_tokens,
    check_logical,
    permutes_on_receive,
    rank_kv,
)
from kvd.core.topology import Pair, RankKv

ALIGN: Final = 4096
"""Slots start on a page."""

DESC_S: Final = 2.5e-6
"""Seconds one more descriptor costs a same-host transfer (cma): `kvd bench --only
topology`, TP 8->4 HND, 2,048 descriptors 4.8 ms slower than 64 for the same 4 MiB."""
MOVE_BPS: Final = 3.0e9
"""Bytes per second a transfer of whole chunks moves (the same bench, NHD->NHD 32 MiB)."""
SCATTER_BPS: Final = 6.0e9
"""Bytes per second of the scatter (a numpy strided copy; a head transposing copy is the
slowest, ~1.7 memcpys of 11 GB/s here)."""
PERMUTE_BPS: Final = 10.0e9
"""Bytes per second of the in-place permute (copy out, write back transposed, 1 MiB at a
time: `kvd.core.planner.PERMUTE_RUN_BYTES`): `kvd bench --only topology`, 2026-11-26,
the 256 MiB NHD->HND push adds 25.4 ms to the same transfer into an NHD D (10.6 GB/s),
where the staged pull's scatter adds 42.8 ms (6.3 GB/s): a pull that only converts the
token layout now READs whole chunks into D's blocks and permutes them, as a push does."""
RUN_BYTES: Final = 256 << 10
"""The scatter copies at most this many bytes of D's blocks per numpy call: the source
and destination of a transposing copy then stay in cache (measured ~1.4x faster than one
call over a large request)."""


@dataclass(frozen=True, slots=True, eq=False)
class Scatter:
    """Copy `heads` heads (P's local head `p_head` on, into D's local head `d_head` on) of
    every token of the staged blocks of one P rank into D rank `d`'s blocks: the i-th staged
    block into D's physical block `blocks[i]`. The slot holds the P rank's blocks whole,
    block-major, in P's token layout, from `src_off`."""

    d: int
    pair: int
    blocks: Int64Array
    src_off: int
    src_strides: tuple[int, int, int, int, int]
    """Bytes between staged blocks, layers, K/V parts, tokens and heads."""
    dst_strides: tuple[int, int, int, int, int]
    """The same in D's region (its geometry's strides and D's token layout)."""
    p_head: int
    d_head: int
    heads: int
    tokens: int
    layers: int
    parts: int
    head_bytes: int
    converts: bool = False
    """P's and D's token layouts differ (the scatter is also the receive permute)."""

    @property
    def nbytes(self) -> int:
        n = int(self.blocks.shape[0])
        return n * self.layers * self.parts * self.tokens * self.heads * self.head_bytes


@dataclass(frozen=True, slots=True, eq=False)
class StagedRead:
    """One P rank's blocks READ whole into the slot: `plan`'s local addresses are offsets
    in the slot (add its address). `pair`: a pair of the request fed by this P rank (its D
    and P regions stand for the READ in the transfer book)."""

    pair: int
    p: int
    plan: Plan


@dataclass(frozen=True, slots=True, eq=False)
class Staged:
    """A request's staged alternative to its direct plan."""

    nbytes: int
    """Slot size needed."""
    direct: tuple[int, ...]
    """Pairs that keep their direct plan (with their permutes, `permutes`)."""
    reads: tuple[StagedRead, ...]
    scatters: tuple[Scatter, ...]
    permutes: tuple[Permute, ...]
    cost_direct_s: float
    cost_staged_s: float


def _staging_geometry(offset: int, units: int, like: Geometry) -> Geometry:
    return Geometry.block_major(offset, units, like.num_layers, like.kv_parts, like.chunk_bytes)


def plan_staged(
    p: Sequence[RankView],
    p_logical: Sequence[int],
    d: Sequence[RankView],
    d_logical: Sequence[int],
    pairs: tuple[Pair, ...],
    direct: RequestPlan | None = None,
    *,
    always: bool = False,
) -> Staged | None:
    """The staged alternative to the direct plan of a pull (`plan_request(...,
    local_is_p=False)`: D's side) of the rank pairs `pairs` (`map_ranks`), or None when
    no P rank's pairs are cheaper staged. With `direct` (that plan) its descriptors are
    counted; without, estimated (`estimate_descriptors`), so that a request staged whole
    is never planned twice: then `Staged.direct` names the pairs that would need it.

    Per P rank whose pairs all have D's block size and D in host memory and do not already
    move whole chunks in D's layout: the cost of its pairs' direct plans (descriptors,
    bytes, and the in-place permute of a conversion) against that of reading its blocks
    whole (descriptors, all of its bytes) and scattering the heads D takes. `always`:
    stage every P rank that can be, whatever the costs (tests).
    """
    if not pairs or pairs[0].heads == 0:
        return None  # opaque compat: equal TP, whole chunks already
    p_kv = [rank_kv(r) for r in p]
    d_kv = [rank_kv(r) for r in d]
    permuted = (
        {job.pair for job in direct.permutes}
        if direct is not None
        else {
            i
            for i, pair in enumerate(pairs)
            if permutes_on_receive(p_kv[pair.p], d_kv[pair.d], pair, d[pair.d].mem_type)
        }
    )
    by_p: dict[int, list[int]] = {}
    blocked: set[int] = set()
    for i, pair in enumerate(pairs):
        pk, dk = p_kv[pair.p], d_kv[pair.d]
        fits = pk.tokens_per_block == dk.tokens_per_block and d[pair.d].mem_type == "DRAM"
        if not fits:
            blocked.add(pair.p)
        elif not (pair.whole and pk.kv_layout == dk.kv_layout):
            by_p.setdefault(pair.p, []).append(i)
    for rank in blocked:
        by_p.pop(rank, None)  # a P rank is read whole for all its pairs, or not at all
    if not by_p:
        return None
    p_phys = {rank: check_logical(p[rank].geometry, p_logical) for rank in by_p}
    d_phys = [check_logical(r.geometry, d_logical) for r in d]
    staged_pairs: set[int] = set()
    reads: list[StagedRead] = []
    scatters: list[Scatter] = []
    offset = 0
    cost_direct = cost_staged = 0.0
    for rank, members in sorted(by_p.items()):
        pk = p_kv[rank]
        pg = p[rank].geometry
        first = pairs[members[0]]
        pb, _, units = align_tokens(
            p_phys[rank], pk.tokens_per_block, d_phys[first.d], d_kv[first.d].tokens_per_block
        )
        pb = pb[:units]
        if units == 0:
            continue
        stage = _staging_geometry(offset, units, pg)
        read = _plan_checked(stage, np.arange(units, dtype=np.int64), pg, pb)
        used = 0
        descs = 0
        perm = 0
        for i in members:
            pair_bytes = units * pg.num_layers * pg.kv_parts * pk.tokens_per_block
            pair_bytes *= pairs[i].heads * pk.head_bytes
            used += pair_bytes
            if direct is not None:
                descs += direct.plans[i].descriptors
            else:
                descs += estimate_descriptors(pk, d_kv[pairs[i].d], pairs[i], units, pg)
            if i in permuted:
                perm += pair_bytes
        whole = units * stage.block_bytes
        c_direct = descs * DESC_S + used / MOVE_BPS + perm / PERMUTE_BPS
        c_staged = read.descriptors * DESC_S + whole / MOVE_BPS + used / SCATTER_BPS
        if c_staged >= c_direct and not always:
            continue
        cost_direct += c_direct
        cost_staged += c_staged
        reads.append(StagedRead(members[0], rank, read))
        src_tok, src_head = pk.token_step, pk.head_step
        for i in members:
            pair = pairs[i]
            dk = d_kv[pair.d]
            dg = d[pair.d].geometry
            scatters.append(
                Scatter(
                    d=pair.d,
                    pair=i,
                    blocks=d_phys[pair.d][:units],
                    src_off=offset,
                    src_strides=(
                        stage.block_stride,
                        stage.layer_stride,
                        stage.kv_stride,
                        src_tok,
                        src_head,
                    ),
                    dst_strides=(
                        dg.block_stride,
                        dg.layer_stride,
                        dg.kv_stride,
                        dk.token_step,
                        dk.head_step,
                    ),
                    p_head=pair.p_head,
                    d_head=pair.d_head,
                    heads=pair.heads,
                    tokens=pk.tokens_per_block,
                    layers=pg.num_layers,
                    parts=pg.kv_parts,
                    head_bytes=pk.head_bytes,
                    converts=pk.kv_layout != dk.kv_layout,
                )
            )
            staged_pairs.add(i)
        offset += -(-whole // ALIGN) * ALIGN
    if not reads:
        return None
    keep = tuple(i for i in range(len(pairs)) if i not in staged_pairs)
    return Staged(
        nbytes=offset,
        direct=keep,
        reads=tuple(reads),
        scatters=tuple(scatters),
        permutes=tuple(
            job for job in (direct.permutes if direct else ()) if job.pair not in staged_pairs
        ),
        cost_direct_s=cost_direct,
        cost_staged_s=cost_staged,
    )


def estimate_descriptors(pk: RankKv, dk: RankKv, pair: Pair, units: int, pg: Geometry) -> int:
    """Descriptors of a pair's direct plan at equal block sizes (`plan_heads`), without
    building it: whole chunks cost one per block (at most), a head slice one per (block,
    layer, K/V part) in HND on both sides, one per token in NHD, and a slice between
    layouts one per (token, head)."""
    chunks = units * pg.num_layers * pg.kv_parts
    if pair.whole:
        return units
    if pk.kv_layout == dk.kv_layout == "HND":
        return chunks
    if pk.kv_layout == dk.kv_layout:
        return chunks * pk.tokens_per_block
    return chunks * pk.tokens_per_block * pair.heads


def shifted(plan: Plan, base: int) -> Plan:
    """`plan` with its local addresses moved by `base` (a staged READ into its slot)."""
    la = plan.local_addrs + np.int64(base)
    la.setflags(write=False)
    return Plan(la, plan.remote_addrs, plan.lengths)


def _folded(
    inner: tuple[int, ...], src: tuple[int, ...], dst: tuple[int, ...], item: int
) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], int]:
    """The inner dimensions of a copy with those contiguous on both sides folded into
    the item: dimensions ordered by D's stride (largest first; the same permutation on
    both sides leaves the copy unchanged), then folded from the innermost while each
    steps by exactly the item on both sides. A head slice of whole runs then copies as a
    few large items instead of many heads."""
    dims = sorted(zip(inner, src, dst, strict=True), key=lambda d: -d[2])
    while dims and dims[-1][1] == item and dims[-1][2] == item:
        item *= dims.pop()[0]
    return (
        tuple(d[0] for d in dims),
        tuple(d[1] for d in dims),
        tuple(d[2] for d in dims),
        item,
    )


def scatter(slot: npt.NDArray[np.uint8], dst: npt.NDArray[np.uint8], job: Scatter) -> None:
    """Copy `job`'s heads from the staged blocks in `slot` into D's region, whose bytes
    `dst` holds (from its geometry's base address). numpy checks that every view lies
    inside its buffer."""
    n = int(job.blocks.shape[0])
    if n == 0:
        return
    ss, ds = job.src_strides, job.dst_strides
    inner, s_in, d_in, size = _folded(
        (job.layers, job.parts, job.tokens, job.heads), ss[1:], ds[1:], job.head_bytes
    )
    item = np.dtype((np.void, size))
    src = np.ndarray(
        (n, *inner),
        item,
        buffer=slot,
        offset=job.src_off + job.p_head * ss[4],
        strides=(ss[0], *s_in),
    )
    block_bytes = job.layers * job.parts * job.tokens * job.heads * job.head_bytes
    per_run = max(1, RUN_BYTES // block_bytes)
    head0 = job.d_head * ds[4]
    # D's region as an array of blocks (those whose pattern lies inside it): the staged
    # blocks go out through an index on the block axis, `per_run` at a time, one numpy
    # call each, instead of one call per run of consecutive blocks (scattered blocks:
    # one per block, 1.2 us of Python each: a 16 MiB scatter took ~1.5x as long). numpy
    # refuses an index past the last block; a negative one it would count from the end
    if int(job.blocks.min()) < 0:
        raise IndexError(f"D block {int(job.blocks.min())} in a scatter")
    reach = head0 + sum((k - 1) * x for k, x in zip(inner, d_in, strict=True)) + size
    nblk = (dst.shape[0] - reach) // ds[0] + 1 if dst.shape[0] >= reach else 0
    out = np.ndarray((nblk, *inner), item, buffer=dst, offset=head0, strides=(ds[0], *d_in))
    for lo in range(0, n, per_run):
        out[job.blocks[lo : lo + per_run]] = src[lo : lo + per_run]


class StagingPool:
    """Bounded first-fit allocator of slots (offsets) in a staging buffer of `size` bytes.

    A slot is `alloc`ed for one transfer and ends exactly once: `free` (the transfer ended:
    nothing more can land in it) or `quarantine` (it may still land: a transfer reported
    unsettled), then `release` once the transport reports it ended. Misuse (a slot freed
    twice, or one never handed out) raises KvdError: it would hand a slot to two
    transfers at once."""

    def __init__(self, size: int, align: int = ALIGN) -> None:
        if size < 0:
            raise ValueError("staging size must be >= 0")
        self.size = size - size % align
        self.align = align
        self._free: list[tuple[int, int]] = [(0, self.size)] if self.size else []
        self.used: dict[int, int] = {}
        self.quarantined: dict[int, int] = {}
        self.exhausted = 0
        """Allocations refused for lack of a slot that fits."""
        self.allocated = 0
        """Slots handed out so far."""

    @property
    def used_bytes(self) -> int:
        return sum(self.used.values())

    @property
    def quarantined_bytes(self) -> int:
        return sum(self.quarantined.values())

    def alloc(self, nbytes: int) -> int | None:
        """The offset of a free slot of at least `nbytes`, or None (counted) if none fits."""
        if nbytes <= 0:
            raise ValueError("a slot holds at least one byte")
        want = -(-nbytes // self.align) * self.align
        for i, (off, length) in enumerate(self._free):
            if length >= want:
                if length == want:
                    del self._free[i]
                else:
                    self._free[i] = (off + want, length - want)
                self.used[off] = want
                self.allocated += 1
                return off
        self.exhausted += 1
        return None

    def free(self, off: int) -> None:
        """The transfer into the slot at `off` ended: it may be handed out again."""
        length = self.used.pop(off, None)
        if length is None:
            raise KvdError(f"staging slot {off} freed but not in use")
        self._give_back(off, length)

    def quarantine(self, off: int) -> None:
        """A transfer into the slot may still land: hold it until `release`."""
        length = self.used.pop(off, None)
        if length is None:
            raise KvdError(f"staging slot {off} quarantined but not in use")
        self.quarantined[off] = length

    def release(self, off: int) -> None:
        """The quarantined slot's transfer ended at last."""
        length = self.quarantined.pop(off, None)
        if length is None:
            raise KvdError(f"staging slot {off} released but not quarantined")
        self._give_back(off, length)

    def _give_back(self, off: int, length: int) -> None:
        insort(self._free, (off, length))
        merged: list[tuple[int, int]] = []
        for o, n in self._free:
            if merged and merged[-1][0] + merged[-1][1] == o:
                merged[-1] = (merged[-1][0], merged[-1][1] + n)
            else:
                merged.append((o, n))
        self._free = merged

    def snapshot(self) -> dict[str, int]:
        return {
            "size": self.size,
            "used": self.used_bytes,
            "slots": len(self.used),
            "quarantined": self.quarantined_bytes,
            "exhausted": self.exhausted,
            "allocated": self.allocated,
        }
