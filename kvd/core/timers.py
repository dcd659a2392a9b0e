"""A keyed timer heap with lazy deletion.

Each key has at most one live time. Setting or discarding a key is O(log n) / O(1):
the old heap entry is left in place and recognised as stale (its sequence number is no
longer the key's current one) when it reaches the top. The heap is rebuilt from the
live entries when stale ones outnumber live ones about two to one, so memory stays
O(live). Time is only ever a parameter; this module never reads a clock.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Iterator
from typing import Final, Generic, TypeVar

K = TypeVar("K", bound=Hashable)

_COMPACT_SLACK: Final = 64
"""Stale entries tolerated on top of 2x live before the heap is rebuilt."""


class TimerHeap(Generic[K]):
    """Keys with one scheduled time each; pops them in time order (ties: set order).

    Results are always (key, time) pairs.
    """

    __slots__ = ("_heap", "_live", "_seq")

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, K]] = []
        self._live: dict[K, tuple[float, int]] = {}
        self._seq = 0

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, key: object) -> bool:
        return key in self._live

    def __iter__(self) -> Iterator[K]:
        return iter(self._live)

    def get(self, key: K) -> float | None:
        """The time `key` is scheduled at, or None."""
        entry = self._live.get(key)
        return None if entry is None else entry[0]

    def set(self, key: K, when: float) -> None:
        """Schedule `key` at `when`, replacing any earlier schedule of it."""
        self._seq += 1
        seq = self._seq
        self._live[key] = (when, seq)
        heapq.heappush(self._heap, (when, seq, key))
        self._maybe_compact()

    def discard(self, key: K) -> None:
        """Unschedule `key` (no-op if it is not scheduled)."""
        if self._live.pop(key, None) is not None:
            self._maybe_compact()

    def peek(self) -> tuple[K, float] | None:
        """The earliest live (key, time), or None; drops stale entries it passes."""
        heap = self._heap
        live = self._live
        while heap:
            when, seq, key = heap[0]
            entry = live.get(key)
            if entry is not None and entry[1] == seq:
                return key, when
            heapq.heappop(heap)
        return None

    def next_time(self) -> float | None:
        """The earliest live time, or None."""
        top = self.peek()
        return None if top is None else top[1]

    def pop_due(self, now: float) -> list[tuple[K, float]]:
        """Unschedule and return (key, time) for every key due at `now`, earliest first."""
        heap = self._heap
        live = self._live
        out: list[tuple[K, float]] = []
        while heap and heap[0][0] <= now:
            when, seq, key = heapq.heappop(heap)
            entry = live.get(key)
            if entry is not None and entry[1] == seq:
                del live[key]
                out.append((key, when))
        return out

    def _maybe_compact(self) -> None:
        if len(self._heap) > 3 * len(self._live) + _COMPACT_SLACK:
            self._heap = [(when, seq, key) for key, (when, seq) in self._live.items()]
            heapq.heapify(self._heap)

    @property
    def heap_size(self) -> int:
        """Entries in the heap, stale ones included (for tests and metrics)."""
        return len(self._heap)
