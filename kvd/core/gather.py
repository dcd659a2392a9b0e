"""P-side staging of a push: gather the pieces D's layout wants into one slot, then WRITE.

A push whose rank pairs slice heads (P TP != D TP) or convert the token layout (NHD/HND)
has a direct plan of many small descriptors: a head slice per chunk, or a run per token.
Each costs the transport a few microseconds. P's daemon holds every P rank's memory, so
it can lay the request's bytes out in a slot exactly as D's regions want them (all the
pieces bound for one D region, in D's address order, whatever P rank they come from),
and WRITE the slot as a few contiguous runs: one local pass over the bytes instead of
thousands of descriptors. D receives the bytes in its own layout, as from the direct
plan: nothing changes on the wire or at D.

Sans-IO: `plan_gather` turns the direct plans into `Gathered` (slot layout, row
mappings, the staged plans); `gather` copies. Pieces move as rows of `row` bytes (the
greatest common divisor of every offset and length involved), so the copy is a numpy
row gather, not a Python loop.

Pushes between the same region shapes use a `GatherTemplate` made once (`plan_template`):
a request is checked against it (`prepare`) and gathered in parts of D blocks
(`Prepared.part`), so that P can WRITE one part while it gathers the next. A template
source whose pieces of a block form an n-D grid (`fold`: heads of a chunk, a head of
every token) is copied by strided numpy assignments (`BlockCopy`), without row indices.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt
from kvd_client.errors import InvalidRequest

from kvd.core.planner import (
    Int64Array,
    Plan,
    RankView,
    align_tokens,
    check_logical,
    plan_request,
    rank_kv,
)
from kvd.core.topology import Pair, map_ranks

MIN_ROW: Final = 16
"""A gather whose pieces share no larger unit than this is not made (rows too many: a
head of 8 bf16 elements is 16 bytes, of 128 elements 256)."""
GATHER_PIECE_BYTES: Final = 1 << 20
"""The gather copies at most this many bytes per numpy call (its temporary stays small)."""
BLOCK_LOOP_BYTES: Final = 32 << 10
"""A `BlockCopy` whose pieces of a block hold at least this many bytes is copied block by
block (one strided assignment each, no temporary); smaller ones, many blocks at a time
through an index on the block axis (a numpy call per block would cost more than its copy)."""
MIN_SAVED: Final = 64
"""Stage only when it saves at least this many descriptors..."""
MIN_FACTOR: Final = 4
"""...and the staged plan has at most 1/MIN_FACTOR of the direct plan's descriptors..."""
MAX_MEAN_PIECE: Final = 16 << 10
"""...and the direct plan's pieces average fewer bytes than this. A gather is one more
pass over the bytes, at 3-4.5 GB/s for rows of pieces here (16 KiB: 3.6-5.3 us), where
a descriptor it saves costs 1.6-4.4 us over cma: from this size on, the descriptors are
the cheaper way. `worth_gathering` decides it from two sums, so a push of large pieces
(whole blocks, layers) is written directly without planning a gather at all."""


def worth_gathering(descriptors: int, nbytes: int) -> bool:
    """Whether a push of `descriptors` direct pieces holding `nbytes` in all may be worth
    gathering (`MIN_SAVED`, `MAX_MEAN_PIECE`); the gather's own plan decides the rest."""
    return descriptors >= MIN_SAVED and nbytes < descriptors * MAX_MEAN_PIECE


@dataclass(frozen=True)
class RowCopy:
    """Rows of `src` (a P region, by index in the caller's list) copied into the slot."""

    src: int
    src_rows: Int64Array
    """Row indices in the source region (rows of `Gathered.row` bytes from its base)."""
    dst_rows: Int64Array
    """Row indices in the slot."""


@dataclass(frozen=True, eq=False)
class Folded:
    """A source's pieces of one block as an n-D strided pattern (`fold`): `shape` items of
    `item_rows` rows, at `src_strides` / `dst_strides` rows apart, from row `src0` of the
    source block / `dst0` of the block's segment. Copied as one strided numpy assignment
    per block: no index arrays, items of whole runs (a head of a token, a chunk)."""

    item_rows: int
    shape: tuple[int, ...]
    src_strides: tuple[int, ...]
    dst_strides: tuple[int, ...]
    src0: int
    dst0: int


@dataclass(frozen=True, eq=False)
class BlockCopy:
    """A source's pieces of some blocks, by its `Folded` pattern: block `src_blocks[i]`
    of P region `src` (blocks `src_block_rows` rows apart) into the slot segment starting
    at row `dst_rows0[i]`."""

    src: int
    fold: Folded
    src_block_rows: int
    src_blocks: Int64Array
    dst_rows0: Int64Array

    @property
    def rows(self) -> int:
        return self.fold.item_rows * math.prod(self.fold.shape) * int(self.src_blocks.shape[0])


def fold(src_rows: npt.NDArray[np.int64], dst_rows: npt.NDArray[np.int64]) -> Folded | None:
    """`src_rows[i] -> dst_rows[i]` (one block's rows, in the order the copy lists them)
    as a strided pattern: runs of rows consecutive on both sides, all of one length, whose
    starts enumerate an n-D grid in row-major order with non-negative steps. None where
    they do not (the copy then takes index arrays)."""
    if src_rows.size == 0 or src_rows.shape != dst_rows.shape:
        return None
    brk = np.flatnonzero((np.diff(src_rows) != 1) | (np.diff(dst_rows) != 1)) + 1
    starts = np.concatenate(([0], brk)).astype(np.int64)
    lens = np.diff(np.concatenate((starts, [src_rows.size])))
    if not bool((lens == lens[0]).all()):
        return None
    s, d = src_rows[starts], dst_rows[starts]
    dims: list[tuple[int, int, int]] = []
    while s.size > 1:
        ss, ds = int(s[1] - s[0]), int(d[1] - d[0])
        if ss < 0 or ds < 0:
            return None
        off = np.flatnonzero((np.diff(s) != ss) | (np.diff(d) != ds))
        n = s.size if off.size == 0 else int(off[0]) + 1
        if s.size % n:
            return None
        sm, dm = s.reshape(-1, n), d.reshape(-1, n)
        if not (
            bool(((sm - sm[:, :1]) == (sm[0] - sm[0, 0])).all())
            and bool(((dm - dm[:, :1]) == (dm[0] - dm[0, 0])).all())
        ):
            return None
        dims.insert(0, (n, ss, ds))
        s, d = sm[:, 0], dm[:, 0]
        if len(dims) > 16:
            return None
    return Folded(
        int(lens[0]),
        tuple(n for n, _, _ in dims),
        tuple(x for _, x, _ in dims),
        tuple(x for _, _, x in dims),
        int(s[0]),
        int(d[0]),
    )


@dataclass(frozen=True)
class Staged:
    """The WRITE of one D region's pieces from the slot."""

    remote: int
    """Index of the D region (in the caller's list of remote regions)."""
    local: int
    """A P region whose memory type the transfer is grouped by (all are DRAM)."""
    plan: Plan
    """Slot-relative local addresses (shift them by the slot's address), D's addresses."""


@dataclass(frozen=True)
class Gathered:
    nbytes: int
    row: int
    copies: tuple[RowCopy | BlockCopy, ...]
    writes: tuple[Staged, ...]
    firsts: tuple[int, ...] = ()
    """Index in `copies` of each write's first copy (its copies follow it, up to the next
    write's): what `split` cuts by. Empty: not known (the gather is not split)."""

    @property
    def descriptors(self) -> int:
        return sum(w.plan.descriptors for w in self.writes)

    @property
    def write_bytes(self) -> int:
        return sum(w.plan.total_bytes for w in self.writes)


def split(g: Gathered, parts: int, min_bytes: int) -> tuple[Gathered, ...]:
    """`g` cut into at most `parts` gathers of whole D regions, in order, each with the
    copies that fill its regions' part of the slot (the same slot: offsets unchanged), so
    that one part's WRITE can run while the next is gathered. A part holds at least
    `min_bytes` where it can; `(g,)` where `g` has a single region (or no `firsts`)."""
    n = len(g.writes)
    if parts < 2 or n < 2 or len(g.firsts) != n:
        return (g,)
    sizes = [w.plan.total_bytes for w in g.writes]
    goal = max(min_bytes, -(-sum(sizes) // parts))
    cuts = [0]
    acc = 0
    for i, size in enumerate(sizes):
        acc += size
        if acc >= goal and i + 1 < n:
            cuts.append(i + 1)
            acc = 0
    if len(cuts) > 1 and acc < min_bytes:
        cuts.pop()  # a last part too small to pay for a WRITE of its own: merged
    if len(cuts) == 1:
        return (g,)
    bounds = [*cuts, n]
    firsts = [*g.firsts, len(g.copies)]
    out = []
    for a, b in itertools.pairwise(bounds):
        c0, c1 = firsts[a], firsts[b]
        out.append(
            Gathered(
                g.nbytes,
                g.row,
                g.copies[c0:c1],
                g.writes[a:b],
                tuple(f - c0 for f in firsts[a:b]),
            )
        )
    return tuple(out)


def plan_gather(
    plans: Sequence[Plan],
    local_of: Sequence[int],
    remote_of: Sequence[int],
    local_bases: Sequence[int],
) -> Gathered | None:
    """The gathered form of a push's direct plans, or None where it would not pay.

    `plans[i]` moves bytes from P region `local_of[i]` (whose memory starts at
    `local_bases[local_of[i]]`) into D region `remote_of[i]`. Every piece bound for one D
    region goes to the slot in D's address order, so the D region's bytes come out of
    the slot as contiguous runs.
    """
    direct = sum(p.descriptors for p in plans)
    if not worth_gathering(direct, sum(p.total_bytes for p in plans)):
        return None
    by_remote: dict[int, list[int]] = {}
    for i, r in enumerate(remote_of):
        if plans[i].descriptors:
            by_remote.setdefault(r, []).append(i)
    # the row: a unit every source offset, piece length and slot offset is made of
    parts: list[Int64Array] = []
    for i, p in enumerate(plans):
        if p.descriptors:
            parts += [p.local_addrs - np.int64(local_bases[local_of[i]]), p.lengths]
    if not parts:
        return None
    row = int(np.gcd.reduce(np.concatenate(parts)))
    if row < MIN_ROW:
        return None
    copies: list[RowCopy] = []
    writes: list[Staged] = []
    slot = 0
    firsts: list[int] = []
    for r, members in sorted(by_remote.items()):
        firsts.append(len(copies))
        packed = _pack(
            [plans[i] for i in members], [local_bases[local_of[i]] for i in members], row
        )
        if packed is None:
            return None  # overlapping destinations: not a plan we stage
        plan = Plan(
            _ro(packed.off[packed.starts] + np.int64(slot)),
            _ro(packed.ra[packed.starts]),
            _ro(packed.run_len),
        )
        writes.append(Staged(r, local_of[members[0]], plan))
        for k, i in enumerate(members):
            src_rows, dst_rows = packed.rows[k]
            if src_rows.size:
                copies.append(RowCopy(local_of[i], src_rows, _ro(dst_rows + slot // row)))
        slot += int(packed.ln.sum())
    staged = sum(w.plan.descriptors for w in writes)
    if direct - staged < MIN_SAVED or staged * MIN_FACTOR > direct:
        return None
    return Gathered(slot, row, tuple(copies), tuple(writes), tuple(firsts))


@dataclass(frozen=True, eq=False)
class _Packed:
    """The pieces bound for one D region, laid out in D's address order from offset 0 of
    their part of the slot: D addresses, lengths, slot offsets, the runs (pieces
    contiguous in D, hence in the slot), and each member plan's rows to copy."""

    ra: Int64Array
    ln: Int64Array
    off: Int64Array
    starts: Int64Array
    """Index of each run's first piece."""
    run_len: Int64Array
    rows: tuple[tuple[Int64Array, Int64Array], ...]
    """Per member: (source rows from its P region's base, rows from the part's start)."""


def _pack(plans: Sequence[Plan], bases: Sequence[int], row: int) -> _Packed | None:
    """`plans` (each from the P region whose memory starts at `bases[k]`) packed for their
    D region; None if two pieces overlap in D."""
    ra = np.concatenate([pl.remote_addrs for pl in plans])
    ln = np.concatenate([pl.lengths for pl in plans])
    la = np.concatenate([pl.local_addrs - np.int64(b) for pl, b in zip(plans, bases, strict=True)])
    who = np.concatenate([np.full(pl.descriptors, k, dtype=np.int64) for k, pl in enumerate(plans)])
    order = np.argsort(ra, kind="stable")
    ra, ln, la, who = ra[order], ln[order], la[order], who[order]
    if ln.size > 1 and bool((ra[1:] < ra[:-1] + ln[:-1]).any()):
        return None
    off = np.concatenate(([0], np.cumsum(ln)[:-1])).astype(np.int64)
    # coalesce: the slot is contiguous in this order; D's runs break where it is not
    cut = np.flatnonzero(ra[1:] != ra[:-1] + ln[:-1]) + 1
    starts = np.concatenate(([0], cut)).astype(np.int64)
    run_len = np.add.reduceat(ln, starts).astype(np.int64)
    n_rows = ln // row
    rows: list[tuple[Int64Array, Int64Array]] = []
    for k in range(len(plans)):
        mine = who == k
        per = n_rows[mine]
        step = np.arange(int(per.sum()), dtype=np.int64) - np.repeat(
            np.concatenate(([0], np.cumsum(per)[:-1])), per
        )
        rows.append(
            (_ro(np.repeat(la[mine] // row, per) + step), np.repeat(off[mine] // row, per) + step)
        )
    return _Packed(_ro(ra), _ro(ln), _ro(off), _ro(starts), _ro(run_len), tuple(rows))


def gather(
    slot: npt.NDArray[np.uint8], sources: Sequence[npt.NDArray[np.uint8]], g: Gathered
) -> None:
    """Copy the pieces into `slot` (`g.nbytes` bytes) from the P regions' bytes
    (`sources[c.src]`, each from its region's base). numpy checks every index."""
    item = np.dtype((np.void, g.row))
    out = slot[: g.nbytes].view(item)
    step = max(1, GATHER_PIECE_BYTES // g.row)  # a small temporary, in cache
    for c in g.copies:
        src = sources[c.src]
        if isinstance(c, BlockCopy):
            _copy_blocks(slot[: g.nbytes], src, g.row, c)
            continue
        rows = src[: (src.shape[0] // g.row) * g.row].view(item)
        for i in range(0, c.src_rows.shape[0], step):
            out[c.dst_rows[i : i + step]] = rows[c.src_rows[i : i + step]]


def _copy_blocks(
    slot: npt.NDArray[np.uint8], src: npt.NDArray[np.uint8], row: int, c: BlockCopy
) -> None:
    """A `BlockCopy`: one strided assignment per block (numpy checks every view against
    its buffer: a pattern reaching outside the region or the slot raises)."""
    f = c.fold
    item = np.dtype((np.void, f.item_rows * row))
    # the blocks whose pattern lies inside the region (a layer-major region's blocks are
    # closer together than a block's pieces reach)
    reach = f.src0 + sum((n - 1) * x for n, x in zip(f.shape, f.src_strides, strict=True))
    nblk = max(0, (src.shape[0] // row - reach - f.item_rows) // c.src_block_rows + 1)
    sv = np.ndarray(
        (nblk, *f.shape),
        item,
        buffer=src,
        offset=f.src0 * row,
        strides=(c.src_block_rows * row, *(x * row for x in f.src_strides)),
    )
    first = int(c.dst_rows0.min()) if c.dst_rows0.size else 0
    span = int(c.dst_rows0.max()) - first + 1 if c.dst_rows0.size else 0
    dv = np.ndarray(
        (span, *f.shape),
        item,
        buffer=slot,
        offset=(first + f.dst0) * row,
        strides=(row, *(x * row for x in f.dst_strides)),
    )
    per_block = f.item_rows * row * math.prod(f.shape)
    if per_block >= BLOCK_LOOP_BYTES:
        for b, d in zip(c.src_blocks.tolist(), c.dst_rows0.tolist(), strict=True):
            dv[d - first] = sv[b]
        return
    step = max(1, GATHER_PIECE_BYTES // per_block)
    for i in range(0, int(c.src_blocks.shape[0]), step):
        dv[c.dst_rows0[i : i + step] - first] = sv[c.src_blocks[i : i + step]]


def _ro(a: npt.NDArray[np.int64]) -> Int64Array:
    out = np.ascontiguousarray(a, dtype=np.int64)
    out.setflags(write=False)
    return out


# ------------------------------------------------------------------ per shape pair


@dataclass(frozen=True, eq=False)
class _Source:
    """The pieces one rank pair contributes to a D region's block, as rows."""

    pair: int
    """Index in `GatherTemplate.pairs` (whose aligned P blocks it takes)."""
    src: int
    """The P region (index)."""
    block_rows: int
    """Rows between consecutive blocks of that P region."""
    src_rows: Int64Array
    """Source rows for P block 0 (from the region's base)."""
    dst_rows: Int64Array
    """Rows inside the block's segment of the slot."""
    folded: Folded | None = None
    """The same as a strided pattern (`fold`), where it is one."""


@dataclass(frozen=True, eq=False)
class _Target:
    """One D region: what a block of it receives, in the order its bytes lie in D."""

    remote: int
    local: int
    block_stride: int
    seg: int
    """Bytes of one block's pieces: a block's segment of the slot."""
    run_ra: Int64Array
    """D addresses of the runs for D block 0 (runs: pieces contiguous in D)."""
    run_off: Int64Array
    """Where each run starts inside the segment."""
    run_len: Int64Array
    direct: int
    """Descriptors of one block in the direct plans."""
    sources: tuple[_Source, ...]


@dataclass(frozen=True, eq=False)
class GatherTemplate:
    """A gathered push of one P block onto one D block between two sets of regions,
    made once per (P regions, D regions) shape (`plan_template`) and turned into each
    request's `Gathered` by array arithmetic on its block ids (`instantiate`), instead of
    planning the request's direct plans and gathering them (`plan_gather`), which costs
    milliseconds per request where heads are sliced or tokens interleave."""

    pairs: tuple[Pair, ...]
    row: int
    targets: tuple[_Target, ...]

    @property
    def per_block(self) -> int:
        """Descriptors the direct plans have per block (an estimate of a request's)."""
        return sum(t.direct for t in self.targets)

    def slot_bytes(self, blocks: int) -> int:
        """The slot a request of `blocks` D blocks gathers into."""
        return blocks * sum(t.seg for t in self.targets)


def plan_template(p: Sequence[RankView], d: Sequence[RankView]) -> GatherTemplate | None:
    """The template of a push from P's regions `p` onto D's `d`, or None where one does
    not apply: opaque regions, block sizes that differ (a P block is not a D block),
    logical blocks of several physical ones, regions of fewer than two blocks, plans that
    are not the same for every block but for the blocks' offsets, or a gather that would
    not pay (`MIN_ROW`, `MIN_FACTOR`). Incompatible regions raise, as for a request."""
    pairs = map_ranks(p, d)
    if not pairs or pairs[0].heads == 0:
        return None
    views = [*p, *d]
    if any(v.geometry.physical_per_logical != 1 or v.geometry.num_blocks < 2 for v in views):
        return None
    p_kv = [rank_kv(v) for v in p]
    d_kv = [rank_kv(v) for v in d]
    if any(p_kv[x.p].tokens_per_block != d_kv[x.d].tokens_per_block for x in pairs):
        return None
    at = {
        ab: plan_request(p, [ab[0]], d, [ab[1]], local_is_p=True) for ab in ((0, 0), (1, 0), (0, 1))
    }
    if any(at[ab].pairs != pairs or at[ab].permutes for ab in at):
        return None  # (a conversion D permutes on receive is not a gather)
    p_bases = [v.geometry.base_addr for v in p]
    by_remote: dict[int, list[int]] = {}
    for j, pair in enumerate(pairs):
        b, x, y = (at[ab].plans[j] for ab in ((0, 0), (1, 0), (0, 1)))
        if not (b.descriptors == x.descriptors == y.descriptors):
            return None
        if not b.descriptors:
            continue
        ps, ds = p[pair.p].geometry.block_stride, d[pair.d].geometry.block_stride
        if not (
            np.array_equal(b.lengths, x.lengths)
            and np.array_equal(b.lengths, y.lengths)
            and np.array_equal(x.local_addrs - b.local_addrs, np.full(b.descriptors, ps))
            and np.array_equal(x.remote_addrs, b.remote_addrs)
            and np.array_equal(y.remote_addrs - b.remote_addrs, np.full(b.descriptors, ds))
            and np.array_equal(y.local_addrs, b.local_addrs)
        ):
            return None  # not affine in the block ids: plan each request
        by_remote.setdefault(pair.d, []).append(j)
    if not by_remote:
        return None
    base = at[(0, 0)].plans
    units: list[Int64Array] = [np.array([v.geometry.block_stride for v in p], dtype=np.int64)]
    for j, pair in enumerate(pairs):
        if base[j].descriptors:
            units += [base[j].local_addrs - np.int64(p_bases[pair.p]), base[j].lengths]
    row = int(np.gcd.reduce(np.concatenate(units)))
    if row < MIN_ROW:
        return None
    targets: list[_Target] = []
    for r, members in sorted(by_remote.items()):
        packed = _pack([base[j] for j in members], [p_bases[pairs[j].p] for j in members], row)
        if packed is None:
            return None  # overlapping destinations: not a plan we stage
        sources: list[_Source] = []
        for k, j in enumerate(members):
            src = pairs[j].p
            src_rows, dst_rows = packed.rows[k]
            sources.append(
                _Source(
                    j,
                    src,
                    p[src].geometry.block_stride // row,
                    src_rows,
                    _ro(dst_rows),
                    fold(src_rows, dst_rows),
                )
            )
        targets.append(
            _Target(
                r,
                pairs[members[0]].p,
                d[r].geometry.block_stride,
                int(packed.ln.sum()),
                _ro(packed.ra[packed.starts]),
                _ro(packed.off[packed.starts]),
                packed.run_len,
                sum(base[j].descriptors for j in members),
                tuple(sources),
            )
        )
    per_block = sum(t.direct for t in targets)
    staged = sum(t.run_len.size for t in targets)
    if staged * MIN_FACTOR > per_block:
        return None
    return GatherTemplate(pairs, row, tuple(targets))


def instantiate(
    t: GatherTemplate,
    p: Sequence[RankView],
    p_logical: Sequence[int],
    d: Sequence[RankView],
    d_logical: Sequence[int],
) -> Gathered | None:
    """A request's `Gathered` from its template (`plan_template` of these regions'
    shape): the bytes land in D as by the request's direct plans. None where it would
    not pay (`MIN_SAVED`) or D names a block twice. Raises InvalidRequest for a block
    outside a region or counts that cannot match, as planning the request does."""
    prep = prepare(t, p, p_logical, d, d_logical)
    return None if prep is None else prep.part(0, prep.blocks)


@dataclass(frozen=True, eq=False)
class _Placed:
    """One D region of a prepared request: its blocks in D's address order."""

    target: _Target
    slot: int
    """Where the region's segments start in the slot."""
    db: Int64Array
    """D's blocks, sorted (a block's segment is at its position here)."""
    pb: tuple[Int64Array, ...]
    """Per source of the target: P's blocks, in the same order as `db`."""


@dataclass(frozen=True, eq=False)
class Prepared:
    """A request checked against its template (`prepare`), whose `Gathered` is made in
    parts of D blocks (`part`): each part's rows and runs cost a share of the whole's, so
    a pipelined push plans and gathers one part while the previous part is WRITten."""

    row: int
    nbytes: int
    """The slot's size (every part's bytes lie in it where the whole gather puts them)."""
    blocks: int
    """D blocks per region: parts are ranges of them (in D's address order)."""
    placed: tuple[_Placed, ...]

    def part(self, a: int, b: int) -> Gathered:
        """The gather of D's blocks at positions [a, b) of every region (in D's address
        order): its copies and each region's WRITE runs (runs cut at the range's ends)."""
        copies: list[RowCopy | BlockCopy] = []
        writes: list[Staged] = []
        firsts: list[int] = []
        for pl in self.placed:
            tg = pl.target
            db = pl.db[a:b]
            n = int(db.shape[0])
            if n == 0:
                continue
            pos = np.arange(a, a + n, dtype=np.int64)
            seg0 = np.int64(pl.slot) + pos * np.int64(tg.seg)
            ra = (db[:, None] * np.int64(tg.block_stride) + tg.run_ra[None, :]).ravel()
            la = (seg0[:, None] + tg.run_off[None, :]).ravel()
            ln = np.broadcast_to(tg.run_len, (n, tg.run_len.size)).ravel()
            cut = np.flatnonzero(ra[1:] != ra[:-1] + ln[:-1]) + 1
            starts = np.concatenate(([0], cut)).astype(np.int64)
            runs = Plan(_ro(la[starts]), _ro(ra[starts]), _ro(np.add.reduceat(ln, starts)))
            writes.append(Staged(tg.remote, tg.local, runs))
            firsts.append(len(copies))
            for s, pb in zip(tg.sources, pl.pb, strict=True):
                if s.folded is not None:
                    copies.append(
                        BlockCopy(s.src, s.folded, s.block_rows, pb[a:b], _ro(seg0 // self.row))
                    )
                    continue
                src_rows = (pb[a:b, None] * np.int64(s.block_rows) + s.src_rows[None, :]).ravel()
                dst_rows = ((seg0 // self.row)[:, None] + s.dst_rows[None, :]).ravel()
                copies.append(RowCopy(s.src, _ro(src_rows), _ro(dst_rows)))
        return Gathered(self.nbytes, self.row, tuple(copies), tuple(writes), tuple(firsts))


def prepare(
    t: GatherTemplate,
    p: Sequence[RankView],
    p_logical: Sequence[int],
    d: Sequence[RankView],
    d_logical: Sequence[int],
) -> Prepared | None:
    """A request checked against its template, ready to be gathered in parts
    (`Prepared.part`); None where a gather would not pay (`MIN_SAVED`), D names a block
    twice or D's regions name different numbers of blocks. Raises InvalidRequest for a
    block outside a region or counts that cannot match, as planning the request does:
    every check is made here, before any part is gathered or WRITten."""
    p_phys = [check_logical(v.geometry, p_logical) for v in p]
    d_phys = [check_logical(v.geometry, d_logical) for v in d]
    aligned: list[Int64Array] = []
    for pair in t.pairs:
        tpb = 1  # equal block sizes (the template's condition): blocks pair one to one
        pb, _, units = align_tokens(p_phys[pair.p], tpb, d_phys[pair.d], tpb)
        aligned.append(pb[:units])
    placed: list[_Placed] = []
    slot = 0
    direct = staged = 0
    blocks = -1
    for tg in t.targets:
        db = d_phys[tg.remote]
        n = int(db.shape[0])
        if n == 0:
            continue
        if blocks not in (-1, n):
            return None  # (D's ranks name the same blocks; parts are ranges of them)
        blocks = n
        order = np.argsort(db, kind="stable")
        sorted_db = db[order]
        if n > 1 and bool((sorted_db[1:] == sorted_db[:-1]).any()):
            return None  # D names a block twice: its pieces would overlap
        geo = d[tg.remote].geometry
        lo = int(sorted_db[0]) * tg.block_stride + int(tg.run_ra.min())
        hi = int(sorted_db[-1]) * tg.block_stride + int((tg.run_ra + tg.run_len).max())
        if lo < geo.base_addr or hi > geo.base_addr + geo.nbytes:
            raise InvalidRequest(f"D region {tg.remote}: a run falls outside the region")
        pbs: list[Int64Array] = []
        for s in tg.sources:
            pb = aligned[s.pair]
            if pb.shape[0] != n:
                raise InvalidRequest(f"P has {pb.shape[0]} blocks for D's {n}")
            pbs.append(_ro(pb[order]))
        placed.append(_Placed(tg, slot, _ro(sorted_db), tuple(pbs)))
        slot += n * tg.seg
        direct += n * tg.direct
        # runs of consecutive D blocks merge: count them as the WRITE will have them
        adjacent = int(np.count_nonzero(sorted_db[1:] == sorted_db[:-1] + 1))
        joins = _joins(tg)
        staged += n * tg.run_len.size - adjacent * joins
    if not placed or direct - staged < MIN_SAVED or staged * MIN_FACTOR > direct:
        return None
    if not worth_gathering(direct, slot):
        return None
    return Prepared(t.row, slot, blocks, tuple(placed))


def _joins(tg: _Target) -> int:
    """1 if a block's last run ends where the next block's first run starts (in D and in
    the slot), so that the runs of two consecutive D blocks merge into one; else 0."""
    last_end = int(tg.run_ra[-1] + tg.run_len[-1])
    last_off_end = int(tg.run_off[-1] + tg.run_len[-1])
    joined = last_end == tg.block_stride + int(tg.run_ra[0])
    return int(joined and last_off_end == tg.seg + int(tg.run_off[0]))
