"""Fixed-size block allocator for the encoder cache.

One registered region is cut into `num_blocks` equal blocks. Each cache entry (keyed
by e.g. an mm_hash) owns a list of blocks. Entries in use are pinned (counted); an
unpinned entry stays cached and is evicted only when an allocation needs its blocks:
oldest first on the producer side (``"fifo"``), least recently used on the consumer
side (``"lru"``, where `get` counts as a use). Pinned entries are never evicted, and an
allocation that cannot be satisfied fails with `Busy` without evicting anything.

Unpinned entries sit in a `TimerHeap` keyed by their policy rank (allocation order,
or last use), so picking a victim is O(log n), never a scan. Freed blocks go back on a
stack in an order that hands them out again as ascending runs, which keeps transfer
descriptors coalescible; an entry's blocks are always listed in ascending order.
Sans-IO: no clock is needed; order is a counter.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from kvd_client.errors import Busy, InvalidRequest, NotFound

from kvd.core.timers import TimerHeap

EvictionPolicy = Literal["fifo", "lru"]


@dataclass(frozen=True, slots=True)
class Allocation:
    """The blocks granted to a new entry, and the keys evicted to make room."""

    blocks: list[int]
    evicted: list[str]


class _Entry:
    __slots__ = ("blocks", "pins", "rank")

    def __init__(self, blocks: list[int], rank: int) -> None:
        self.blocks = blocks
        self.pins = 0
        self.rank = rank


class BlockPool:
    """Entries of fixed-size blocks with pin counts and FIFO or LRU eviction."""

    __slots__ = (
        "_clock",
        "_entries",
        "_evictable",
        "_evictable_blocks",
        "_evicted",
        "_free",
        "_lru",
        "_num_blocks",
    )

    def __init__(self, num_blocks: int, policy: EvictionPolicy = "fifo") -> None:
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks <= 0:
            raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")
        if policy not in ("fifo", "lru"):
            raise ValueError(f"policy must be 'fifo' or 'lru', got {policy!r}")
        self._num_blocks = num_blocks
        self._lru = policy == "lru"
        # A stack: the end is handed out first, so keep it descending towards the end.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._entries: dict[str, _Entry] = {}
        self._evictable: TimerHeap[str] = TimerHeap()  # unpinned entries by rank
        self._evictable_blocks = 0
        self._evicted = 0
        self._clock = 0

    # --- queries -------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def policy(self) -> EvictionPolicy:
        return "lru" if self._lru else "fifo"

    @property
    def free_blocks(self) -> int:
        """Blocks owned by no entry."""
        return len(self._free)

    @property
    def used_blocks(self) -> int:
        """Blocks owned by an entry, pinned or not."""
        return self._num_blocks - len(self._free)

    @property
    def evictable_blocks(self) -> int:
        """Blocks owned by unpinned entries."""
        return self._evictable_blocks

    @property
    def evicted(self) -> int:
        """Entries evicted so far."""
        return self._evicted

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        """Keys of every entry, in allocation order."""
        return list(self._entries)

    def is_pinned(self, key: str) -> bool:
        """Whether `key` is pinned (False for an unknown key)."""
        entry = self._entries.get(key)
        return entry is not None and entry.pins > 0

    def get(self, key: str) -> list[int] | None:
        """The blocks of `key`, or None. Under LRU this marks it most recently used."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self._lru:
            entry.rank = self._tick()
            if entry.pins == 0:
                self._evictable.set(key, entry.rank)
        return list(entry.blocks)

    # --- changes ---------------------------------------------------------------------------

    def allocate(self, key: str, nblocks: int, *, pin: bool = False) -> Allocation:
        """Give `key` `nblocks` blocks, evicting unpinned entries in policy order if needed.

        With `pin`, the new entry starts pinned once. Raises InvalidRequest if the key
        exists or `nblocks` is not in [1, num_blocks]; raises Busy, having changed
        nothing, if even evicting every unpinned entry would not free enough blocks.
        """
        if isinstance(nblocks, bool) or not isinstance(nblocks, int):
            raise InvalidRequest(f"nblocks must be an int, got {type(nblocks).__name__}")
        if not 0 < nblocks <= self._num_blocks:
            raise InvalidRequest(
                f"cannot allocate {nblocks} blocks for {key!r}: must be in [1, {self._num_blocks}]"
            )
        if key in self._entries:
            raise InvalidRequest(f"encoder cache entry {key!r} already exists")
        free = self._free
        if len(free) + self._evictable_blocks < nblocks:
            raise Busy(
                f"cannot allocate {nblocks} blocks for {key!r}: {len(free)} free, "
                f"{self._evictable_blocks} evictable, "
                f"{self._num_blocks - len(free) - self._evictable_blocks} pinned"
            )
        evicted: list[str] = []
        while len(free) < nblocks:
            top = self._evictable.peek()
            assert top is not None, "evictable block count out of sync"
            victim = top[0]
            self._remove(victim)
            evicted.append(victim)
        self._evicted += len(evicted)
        blocks = free[-nblocks:]
        del free[-nblocks:]
        blocks.sort()  # ascending ids coalesce into fewer transfer descriptors
        entry = _Entry(blocks, self._tick())
        self._entries[key] = entry
        if pin:
            entry.pins = 1
        else:
            self._evictable.set(key, entry.rank)
            self._evictable_blocks += nblocks
        return Allocation(list(blocks), evicted)

    def pin(self, key: str) -> None:
        """Protect `key` from eviction until a matching `unpin` (pins are counted)."""
        entry = self._lookup(key)
        entry.pins += 1
        if entry.pins == 1:
            self._evictable.discard(key)
            self._evictable_blocks -= len(entry.blocks)

    def unpin(self, key: str) -> None:
        """Drop one pin of `key`; raises InvalidRequest if it holds none."""
        entry = self._lookup(key)
        if entry.pins == 0:
            raise InvalidRequest(f"encoder cache entry {key!r} is not pinned")
        entry.pins -= 1
        if entry.pins == 0:
            self._evictable.set(key, entry.rank)
            self._evictable_blocks += len(entry.blocks)

    def free(self, key: str) -> None:
        """Drop `key` and return its blocks; raises InvalidRequest if it is pinned."""
        entry = self._lookup(key)
        if entry.pins:
            raise InvalidRequest(
                f"encoder cache entry {key!r} is pinned ({entry.pins}); unpin it first"
            )
        self._remove(key)

    # --- internals -------------------------------------------------------------------------

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _lookup(self, key: str) -> _Entry:
        entry = self._entries.get(key)
        if entry is None:
            raise NotFound(f"no encoder cache entry {key!r}")
        return entry

    def _remove(self, key: str) -> None:
        """Drop an unpinned entry and put its blocks back (reversed: see the free stack)."""
        entry = self._entries.pop(key)
        self._evictable.discard(key)
        self._evictable_blocks -= len(entry.blocks)
        self._free.extend(reversed(entry.blocks))
