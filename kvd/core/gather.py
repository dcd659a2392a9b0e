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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

import numpy as np
import numpy.typing as npt

from kvd.core.planner import Int64Array, Plan

MIN_ROW: Final = 16
"""A gather whose pieces share no larger unit than this is not made (rows too many: a
head of 8 bf16 elements is 16 bytes, of 128 elements 256)."""
GATHER_PIECE_BYTES: Final = 1 << 20
"""The gather copies at most this many bytes per numpy call (its temporary stays small)."""
MIN_SAVED: Final = 64
"""Stage only when it saves at least this many descriptors..."""
MIN_FACTOR: Final = 4
"""...and the staged plan has at most 1/MIN_FACTOR of the direct plan's descriptors."""


@dataclass(frozen=True)
class RowCopy:
    """Rows of `src` (a P region, by index in the caller's list) copied into the slot."""

    src: int
    src_rows: Int64Array
    """Row indices in the source region (rows of `Gathered.row` bytes from its base)."""
    dst_rows: Int64Array
    """Row indices in the slot."""


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
    copies: tuple[RowCopy, ...]
    writes: tuple[Staged, ...]

    @property
    def descriptors(self) -> int:
        return sum(w.plan.descriptors for w in self.writes)


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
    if direct < MIN_SAVED:
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
    for r, members in sorted(by_remote.items()):
        ra = np.concatenate([plans[i].remote_addrs for i in members])
        ln = np.concatenate([plans[i].lengths for i in members])
        la = np.concatenate(
            [plans[i].local_addrs - np.int64(local_bases[local_of[i]]) for i in members]
        )
        who = np.concatenate(
            [np.full(plans[i].descriptors, k, dtype=np.int64) for k, i in enumerate(members)]
        )
        order = np.argsort(ra, kind="stable")
        ra, ln, la, who = ra[order], ln[order], la[order], who[order]
        if ln.size > 1 and bool((ra[1:] < ra[:-1] + ln[:-1]).any()):
            return None  # overlapping destinations: not a plan we stage
        off = np.int64(slot) + np.concatenate(([0], np.cumsum(ln)[:-1])).astype(np.int64)
        # coalesce: the slot is contiguous in this order; D's runs break where it is not
        cut = np.flatnonzero(ra[1:] != ra[:-1] + ln[:-1]) + 1
        starts = np.concatenate(([0], cut)).astype(np.int64)
        run_len = np.add.reduceat(ln, starts).astype(np.int64)
        plan = Plan(_ro(off[starts]), _ro(ra[starts]), _ro(run_len))
        writes.append(Staged(r, local_of[members[0]], plan))
        n_rows = ln // row
        for k, i in enumerate(members):
            mine = who == k
            if not mine.any():
                continue
            rows = n_rows[mine]
            total = int(rows.sum())
            step = np.arange(total, dtype=np.int64) - np.repeat(
                np.concatenate(([0], np.cumsum(rows)[:-1])), rows
            )
            src_rows = np.repeat(la[mine] // row, rows) + step
            dst_rows = np.repeat(off[mine] // row, rows) + step
            copies.append(RowCopy(local_of[i], _ro(src_rows), _ro(dst_rows)))
        slot += int(ln.sum())
    staged = sum(w.plan.descriptors for w in writes)
    if direct - staged < MIN_SAVED or staged * MIN_FACTOR > direct:
        return None
    return Gathered(slot, row, tuple(copies), tuple(writes))


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
        rows = src[: (src.shape[0] // g.row) * g.row].view(item)
        for i in range(0, c.src_rows.shape[0], step):
            out[c.dst_rows[i : i + step]] = rows[c.src_rows[i : i + step]]


def _ro(a: npt.NDArray[np.int64]) -> Int64Array:
    out = np.ascontiguousarray(a, dtype=np.int64)
    out.setflags(write=False)
    return out
