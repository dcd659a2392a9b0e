"""The host tier's directory: which pool slot holds which block, readable without a round trip.

The daemon publishes, in a shared-memory segment beside its host pool, one entry per
READY block of the host tier: the block's key digest (blake2b of the namespace and the
key), its pool slot and the slot's generation when the block became visible. A
`TierClient` on the same node maps it read-only and serves a host-tier load itself
(`TierClient.load`): it looks each key up, copies the slot out, and then checks the slot's
generation in the generations array (`TierOpened.gens`): unchanged, the copy holds the
block's bytes; changed, the slot was reused meanwhile and the key is loaded again the
pinned way (`TierPin`), which is always correct. Nothing is pinned; the daemon never waits
for a reader; a reader that dies leaves nothing behind.

Why the copy is right when the generation is unchanged (x86-64, TSO; the argument of
`kvd_client.ecindex`). The daemon bumps a slot's generation before the slot takes any new
bytes: before it lends or reserves the slot to a storing client (who writes only after the
answer that names the slot), and before its own disk read into it. So any byte of a new
use is causally after the bump; a reader that copied such a byte loads the generation
after it (program order: loads are not reordered with earlier loads) and sees the bump.

An entry is read under its own sequence number (odd while the daemon rewrites it), so its
three fields come from one write. The daemon publishes an entry only once the block is
READY (after its store's commit or put, or its disk read), and retracts it when the block
leaves the host tier (before its slot is reused; the generation check would catch a
forgotten retraction, but the reader would then pay a wasted copy).

The table has four entries per pool slot, a power of two; an entry goes into the first
free one of `PROBES` from its digest, and a block that finds none is not published (its
loads take the pinned path). Weakly ordered CPUs: `supported()` is False, as for the EC
index, and every load is pinned.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import struct
from collections.abc import Callable, Sequence
from typing import Final

from kvd_client.ecindex import ECIndexReader, index_slots
from kvd_client.shm import SHM_DIR, SharedRegion, check_name

__all__ = ["TierDirReader", "TierDirWriter", "digester", "key_digest"]

MAGIC: Final = b"KVDTDIR1"
HEADER: Final = 64
ENTRY: Final = 40
"""seq (u64), digest (16 bytes), pool slot (u64), generation (u64)."""
PROBES: Final = 4
OPEN: Final = 1
CLOSED: Final = 2
_HEAD: Final = struct.Struct("<8sQQQ")  # magic, state, entries, pool slots
_BODY: Final = struct.Struct("<16sQQ")  # after the seq


def key_digest(namespace: bytes, key: bytes) -> bytes:
    """The 16-byte name of (namespace, key) in the directory."""
    return hashlib.blake2b(
        len(namespace).to_bytes(2, "big") + namespace + key, digest_size=16
    ).digest()


def digester(namespace: bytes) -> Callable[[bytes], bytes]:
    """`key_digest` under one namespace, for many keys (the namespace hashed once)."""
    base = hashlib.blake2b(len(namespace).to_bytes(2, "big") + namespace, digest_size=16)

    def digest(key: bytes) -> bytes:
        h = base.copy()
        h.update(key)
        return h.digest()

    return digest


def _first(digest: bytes, nslots: int) -> int:
    return int.from_bytes(digest[:8], "little") & (nslots - 1)


class TierDirWriter:
    """The daemon's side: creates, updates and removes the segment (one thread only)."""

    def __init__(self, name: str, pool_slots: int) -> None:
        if pool_slots <= 0:
            raise ValueError(f"pool_slots must be positive, got {pool_slots}")
        self.pool_slots: Final = pool_slots
        self.nslots: Final = index_slots(pool_slots)  # (four entries per slot, as the EC index)
        self._region: SharedRegion | None = SharedRegion(name, HEADER + self.nslots * ENTRY)
        self.name: Final = self._region.name
        self.path: Final = self._region.path
        self._buf = self._region.buf
        self._q = self._buf.cast("Q")
        _HEAD.pack_into(self._buf, 0, MAGIC, OPEN, self.nslots, pool_slots)
        self._at: dict[bytes, int] = {}
        """digest -> its entry."""
        self._used = bytearray(self.nslots)
        self.published = 0
        self.unpublished = 0
        """Blocks that found no free entry among their probes (their loads are pinned)."""

    def __len__(self) -> int:
        return len(self._at)

    def __contains__(self, digest: object) -> bool:
        return digest in self._at

    def publish(self, digest: bytes, slot: int, gen: int) -> bool:
        """Make a READY block visible: `digest` is in pool `slot` since generation `gen`.
        False where no entry among its probes is free (its loads are then pinned)."""
        if not 0 <= slot < self.pool_slots:
            raise ValueError(f"slot {slot} outside a pool of {self.pool_slots}")
        if digest in self._at:
            self.retract(digest)  # (a block stored again in another slot)
        first = _first(digest, self.nslots)
        for i in range(PROBES):
            e = (first + i) & (self.nslots - 1)
            if not self._used[e]:
                break
        else:
            self.unpublished += 1
            return False
        si = (HEADER + e * ENTRY) // 8
        self._q[si] += 1  # odd: a reader of this entry retries the pinned way
        _BODY.pack_into(self._buf, HEADER + e * ENTRY + 8, digest, slot, gen)
        self._q[si] += 1  # even: visible
        self._used[e] = 1
        self._at[digest] = e
        self.published += 1
        return True

    def retract(self, digest: bytes) -> None:
        """The block leaves the host tier (a no-op where it was never published)."""
        e = self._at.pop(digest, None)
        if e is None:
            return
        si = (HEADER + e * ENTRY) // 8
        self._q[si] += 1
        off = HEADER + e * ENTRY + 8
        self._buf[off : off + ENTRY - 8] = bytes(ENTRY - 8)
        self._q[si] += 1
        self._used[e] = 0

    def close(self) -> None:
        """Mark the directory closed (readers stop using it), unmap and unlink it."""
        if self._region is None:
            return
        self._q[1] = CLOSED
        self._q.release()
        self._region.close()
        self._region = None


class TierDirReader:
    """A client's read-only view of a daemon's directory."""

    @staticmethod
    def supported() -> bool:
        """Whether this CPU orders memory as the protocol needs (the EC index's rule)."""
        return ECIndexReader.supported()

    def __init__(self, name: str, pool_slots: int) -> None:
        """Map directory `name` of a pool of `pool_slots` slots (ValueError where the
        segment is not one, or is for another pool)."""
        self.name: Final = check_name(name)
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY)
        try:
            self._mm = mmap.mmap(fd, 0, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._buf = memoryview(self._mm)
        self._q = self._buf.cast("Q") if len(self._mm) >= HEADER else None
        ok = False
        if self._q is not None:
            magic, _state, nslots, pslots = _HEAD.unpack_from(self._buf)
            ok = (
                magic == MAGIC
                and nslots > 0
                and not nslots & (nslots - 1)
                and pslots == pool_slots
                and len(self._mm) >= HEADER + nslots * ENTRY
            )
        if not ok:
            self.close()
            raise ValueError(f"{name} is not the tier directory of a pool of {pool_slots} slots")
        self.nslots: Final[int] = nslots
        self.pool_slots: Final = pool_slots

    @property
    def open(self) -> bool:
        return self._q is not None and bool(self._q[1] == OPEN)

    def lookup(self, digest: bytes) -> tuple[int, int] | None:
        """(pool slot, generation) of the block named `digest`, read consistently, or None
        (not published, being rewritten, or the directory closed: the pinned way)."""
        q = self._q
        if q is None or q[1] != OPEN:
            return None
        first = _first(digest, self.nslots)
        for i in range(PROBES):
            e = (first + i) & (self.nslots - 1)
            si = (HEADER + e * ENTRY) // 8
            s1 = q[si]
            if s1 & 1:
                continue
            d, slot, gen = _BODY.unpack_from(self._buf, HEADER + e * ENTRY + 8)
            if d != digest:
                continue
            if q[si] != s1 or not 0 <= slot < self.pool_slots:
                return None
            return slot, gen
        return None

    def lookup_many(self, digests: Sequence[bytes]) -> list[tuple[int, int] | None]:
        """`lookup` of each digest (one call for a batch: a load's)."""
        q = self._q
        if q is None or q[1] != OPEN:
            return [None] * len(digests)
        mask, buf, unpack, slots = self.nslots - 1, self._buf, _BODY.unpack_from, self.pool_slots
        out: list[tuple[int, int] | None] = []
        for digest in digests:
            first = int.from_bytes(digest[:8], "little")
            hit: tuple[int, int] | None = None
            for i in range(PROBES):
                e = (first + i) & mask
                si = (HEADER + e * ENTRY) >> 3
                s1 = q[si]
                if s1 & 1:
                    continue
                d, slot, gen = unpack(buf, HEADER + e * ENTRY + 8)
                if d != digest:
                    continue
                if q[si] == s1 and 0 <= slot < slots:
                    hit = (slot, gen)
                break
            out.append(hit)
        return out

    def close(self) -> None:
        if self._q is not None:
            self._q.release()
            self._q = None
        self._buf.release()
        self._mm.close()
