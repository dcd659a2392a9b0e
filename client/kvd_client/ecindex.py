"""The consumer's EC index: what the daemon's encoder cache holds, readable without a round trip.

A consumer daemon publishes, in a small shared-memory segment beside its EC region, one
slot per cached encoder output: (blake2b of the mm_hash, blake2b of the compat it was
fetched under, nbytes, the runs of region blocks that hold it) and a per-slot sequence
number. A client on the same node maps both segments read-only and serves a warm hit
itself (`ECIndexReader.read`): look the slot up, copy the bytes out, and check that the
slot did not change meanwhile. Nothing is pinned; the daemon never waits for a reader.

Why a seqlock and not client-side pins. A pin set in shared memory that the daemon must
see before it evicts is Dekker's problem: the client's "store pin, load state" and the
daemon's "store evicting, load pins" need a store->load fence on both sides, which
x86-64 does not give by program order and CPython cannot emit. A seqlock needs only
load->load order in the reader and store->store order in the writer, which x86-64 TSO
gives to plain moves, and it leaves nothing behind when a client dies.

The protocol (one writer, the daemon's EC router, on one thread; any number of readers):
- Writer, to publish an entry: seq := odd; write the slot's fields; seq := even. It
  publishes only after the fetch's ack, so the bytes are in the blocks before the key is.
- Writer, before the entry's blocks can be reused (an eviction, in the same synchronous
  step that hands them to the next fetch and before that fetch's request is sent): seq :=
  odd; clear the key; seq := even. Every later write into those blocks (a producer's
  NIXL WRITE) is caused by a message sent after that store.
- Reader: s1 := seq; if odd, miss. Read the slot; if its key is not ours, look at the next
  probe. Copy the runs out of the EC region; s2 := seq. The copy is valid only if
  s1 == s2 (and the index is still open); otherwise the reader returns "not served" and the
  caller takes the IPC path (`ec_ensure`), which is always correct.

Why a valid copy holds the right bytes (x86-64, TSO). Stores become visible to all cores
in one order (multi-copy atomic, causal), and a core's loads are not reordered with its
earlier loads. If any byte the reader copied had already been overwritten by a reuse, that
overwrite is causally after the writer's "seq := odd" store (the daemon issued the store,
then sent the request that made a producer WRITE), so by causality that store is visible
to the reader before the overwritten byte is, and the reader's load of s2, which comes
after the copy in program order, sees it (or a later value): s2 != s1. Conversely the
slot fields read between s1 and s2 are consistent, since the writer changes them only
while seq is odd. A seq is one aligned 8-byte word, read and written with single moves
(`memoryview.cast("Q")`), so it is never torn. CPython adds no reordering: each load is a
separate call through the interpreter.

aarch64 (and other weakly ordered CPUs) would need a load-acquire of s1, a `dmb ishld`
between the copy and the load of s2, and a `dmb ishst` after the writer's odd store
(or release stores); CPython cannot emit them, so there `ECIndexReader.supported()` is
False and clients always take the IPC path.

A daemon that stops marks the index closed; one that dies does not, but no process
writes into its region any more, and the client drops its mapping once it notices the
daemon is gone (its session is lost) and maps the new daemon's index after reconnecting.
A table slot is chosen among `PROBES` consecutive slots from the key's hash; an entry
that finds none free (rare: the table has four slots per cache block) is simply not
published, and its hits take the IPC path.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import platform
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Final

from kvd_client.shm import SHM_DIR, check_name

MAGIC: Final = b"KVDECIX1"
HEADER: Final = 128
SLOT: Final = 128
PROBES: Final = 4
MAX_RUNS: Final = 9
"""Runs of consecutive blocks a slot can name; an entry in more runs is not published."""
OPEN: Final = 1
CLOSED: Final = 2
_NAME_MAX: Final = HEADER - 48
# header: magic, state, nslots, block_bytes, region_bytes, name length, region name
_HEAD: Final = struct.Struct("<8sQQQQQ")
# slot after its seq: key, compat digest, nbytes, nruns, pad, runs (start, count) x MAX_RUNS
_BODY: Final = struct.Struct(f"<16s16sQII{2 * MAX_RUNS}I")


def digest(text: str) -> bytes:
    """The 16-byte key of an mm_hash or a compat string in the index."""
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def index_slots(num_blocks: int) -> int:
    """Slots for a cache of `num_blocks` blocks: a power of two, at least four per block."""
    n = 64
    while n < 4 * num_blocks:
        n *= 2
    return n


def runs_of(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """(first block, count) per run of consecutive ids."""
    out: list[tuple[int, int]] = []
    for b in block_ids:
        if out and out[-1][0] + out[-1][1] == b:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((b, 1))
    return out


class ECIndexWriter:
    """The daemon's side: creates, updates and removes the segment (one thread only)."""

    def __init__(self, name: str, nslots: int, region: str, region_bytes: int, block_bytes: int):
        if nslots <= 0 or nslots & (nslots - 1):
            raise ValueError(f"nslots must be a power of two, got {nslots}")
        encoded = region.encode()
        if len(encoded) > _NAME_MAX:
            raise ValueError(f"region name {region!r} is too long for the index header")
        self.name: Final = check_name(name)
        self.nslots: Final = nslots
        self.block_bytes: Final = block_bytes
        self.region_blocks: Final = region_bytes // block_bytes
        self.path: Final = os.path.join(SHM_DIR, name)
        size = HEADER + nslots * SLOT
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
        try:
            os.ftruncate(fd, size)
            self._mm: mmap.mmap | None = mmap.mmap(fd, size, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self._buf = memoryview(self._mm)
        self._q = self._buf.cast("Q")
        _HEAD.pack_into(self._buf, 0, MAGIC, OPEN, nslots, block_bytes, region_bytes, len(encoded))
        self._buf[48 : 48 + len(encoded)] = encoded
        self._slot_of: dict[str, int] = {}
        self._owner: list[str | None] = [None] * nslots
        self.published = 0
        self.unpublished = 0

    def __contains__(self, mm_hash: object) -> bool:
        return mm_hash in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def _seq_index(self, slot: int) -> int:
        return (HEADER + slot * SLOT) // 8

    def _bump(self, slot: int) -> None:
        i = self._seq_index(slot)
        self._q[i] = self._q[i] + 1

    def publish(self, mm_hash: str, compat: str, block_ids: Sequence[int], nbytes: int) -> bool:
        """Make an entry whose bytes are in place visible to readers; False if it cannot be
        (no free slot among its probes, or too many runs): its hits then take the IPC path."""
        if mm_hash in self._slot_of:
            raise ValueError(f"{mm_hash!r} is already published")
        runs = runs_of(block_ids)
        if not runs or len(runs) > MAX_RUNS:
            self.unpublished += 1
            return False
        key = digest(mm_hash)
        free = self._free_slot(key)
        if free is None:
            self.unpublished += 1
            return False
        flat = [x for run in runs for x in run] + [0] * (2 * (MAX_RUNS - len(runs)))
        self._bump(free)  # odd: readers of this slot fail from here on
        _BODY.pack_into(
            self._buf, HEADER + free * SLOT + 8, key, digest(compat), nbytes, len(runs), 0, *flat
        )
        self._bump(free)  # even: the entry is visible
        self._slot_of[mm_hash] = free
        self._owner[free] = mm_hash
        self.published += 1
        return True

    def retract(self, mm_hash: str) -> None:
        """Before `mm_hash`'s blocks may be reused: no reader can validate a copy of it after
        this returns (a no-op for an entry that was never published)."""
        slot = self._slot_of.pop(mm_hash, None)
        if slot is None:
            return
        self._owner[slot] = None
        self._bump(slot)  # odd: a copy in progress now fails its check
        off = HEADER + slot * SLOT + 8
        self._buf[off : off + SLOT - 8] = bytes(SLOT - 8)
        self._bump(slot)

    def _free_slot(self, key: bytes) -> int | None:
        h = int.from_bytes(key[:8], "little")
        for i in range(PROBES):
            slot = (h + i) & (self.nslots - 1)
            if self._owner[slot] is None:
                return slot
        return None

    def close(self) -> None:
        """Mark the index closed (readers fail from now on), unmap and unlink it."""
        if self._mm is None:
            return
        self._q[1] = CLOSED
        self._q.release()
        self._buf.release()
        self._mm.close()
        self._mm = None
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


@dataclass(frozen=True, slots=True)
class Cached:
    """A consistent snapshot of one slot: where an output lies, and the seq that says so."""

    slot: int
    seq: int
    nbytes: int
    runs: tuple[tuple[int, int], ...]

    @property
    def block_ids(self) -> tuple[int, ...]:
        return tuple(b for first, n in self.runs for b in range(first, first + n))


class ECIndexReader:
    """A client's read-only view of a daemon's index and of its EC region."""

    @staticmethod
    def supported() -> bool:
        """Whether this CPU orders memory as the protocol needs (see the module docstring)."""
        return platform.machine().lower() in ("x86_64", "amd64")

    def __init__(self, name: str) -> None:
        self.name: Final = check_name(name)
        self._maps: list[mmap.mmap] = []
        self._mm = self._map(name)
        self._buf = memoryview(self._mm)
        self._q = self._buf.cast("Q")
        magic, _state, nslots, block_bytes, region_bytes, name_len = _HEAD.unpack_from(self._buf)
        if magic != MAGIC or nslots <= 0 or nslots & (nslots - 1) or block_bytes <= 0:
            self.close()
            raise ValueError(f"{name} is not a kvd EC index")
        if len(self._mm) < HEADER + nslots * SLOT or name_len > _NAME_MAX:
            self.close()
            raise ValueError(f"{name} is truncated")
        self.nslots: Final[int] = nslots
        self.block_bytes: Final[int] = block_bytes
        self.region_bytes: Final[int] = region_bytes
        self.region: Final = bytes(self._buf[48 : 48 + name_len]).decode()
        self._rm = self._map(check_name(self.region))
        if len(self._rm) < region_bytes:
            self.close()
            raise ValueError(f"the EC region {self.region} is smaller than its index says")
        self._region = memoryview(self._rm)
        self.region_blocks: Final = region_bytes // block_bytes

    def _map(self, name: str) -> mmap.mmap:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
        try:
            mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._maps.append(mm)
        return mm

    @property
    def open(self) -> bool:
        return bool(self._q[1] == OPEN)

    def lookup(self, mm_hash: str, compat: str) -> Cached | None:
        """The slot holding `mm_hash` under `compat`, read consistently, or None (not there,
        under another compat, or changing right now: all answered by the IPC path)."""
        key = digest(mm_hash)
        h = int.from_bytes(key[:8], "little")
        q = self._q
        for i in range(PROBES):
            slot = (h + i) & (self.nslots - 1)
            si = (HEADER + slot * SLOT) // 8
            s1 = q[si]
            if s1 & 1:
                continue
            fields = _BODY.unpack_from(self._buf, HEADER + slot * SLOT + 8)
            if fields[0] != key:
                continue
            if q[si] != s1 or q[1] != OPEN:
                return None
            if fields[1] != digest(compat):
                return None
            nbytes, nruns = fields[2], fields[3]
            flat = fields[5 : 5 + 2 * nruns]
            runs = tuple((flat[2 * j], flat[2 * j + 1]) for j in range(nruns))
            if not self._sane(nbytes, runs):
                return None
            return Cached(slot, s1, nbytes, runs)
        return None

    def _sane(self, nbytes: int, runs: tuple[tuple[int, int], ...]) -> bool:
        total = 0
        for first, n in runs:
            if n <= 0 or first + n > self.region_blocks:
                return False
            total += n
        return 0 < nbytes <= total * self.block_bytes

    def valid(self, c: Cached) -> bool:
        """Whether `c`'s slot is unchanged (so a copy made since its lookup is right)."""
        return bool(self._q[(HEADER + c.slot * SLOT) // 8] == c.seq and self._q[1] == OPEN)

    def copy(
        self, c: Cached, out: memoryview, between: Callable[[int], None] | None = None
    ) -> None:
        """Copy `c`'s bytes into `out` (at least `c.nbytes` long), run by run. `between(i)`
        is called before run i is copied (a test hook for forcing races)."""
        bb, left, pos = self.block_bytes, c.nbytes, 0
        for i, (first, n) in enumerate(c.runs):
            if between is not None:
                between(i)
            take = min(left, n * bb)
            out[pos : pos + take] = self._region[first * bb : first * bb + take]
            pos += take
            left -= take

    def read(
        self,
        mm_hash: str,
        compat: str,
        out: memoryview,
        between: Callable[[int], None] | None = None,
    ) -> int:
        """Copy `mm_hash` (cached under `compat`) into `out`: its nbytes when the copy is
        valid, else 0 (not cached, or changed while it was copied: `out` then holds
        nothing meaningful, and the caller takes the IPC path)."""
        c = self.lookup(mm_hash, compat)
        if c is None or len(out) < c.nbytes:
            return 0
        self.copy(c, out, between)
        return c.nbytes if self.valid(c) else 0

    def close(self) -> None:
        for attr in ("_q", "_buf", "_region"):
            view = getattr(self, attr, None)
            if isinstance(view, memoryview):
                view.release()
        for mm in self._maps:
            mm.close()
        self._maps = []
