"""Which log lines about repeated events to write: bounded lines and memory whatever arrives.

Anyone who can reach a socket can make the daemon reject input as fast as it can send
it; one log line per rejection would turn that into a log flood. So:

- An event is counted under a key, e.g. (where it was rejected, the kind of rejection).
  Keys come from a small fixed vocabulary (event names, error classes), never from text
  the input chose.
- The first occurrence of a key is logged at once. Further occurrences within
  `interval` of the key's last line are only counted; when the interval ends, one
  summary line carries that count. A key that stays quiet for a whole interval is
  forgotten, so its next occurrence is again logged at once. A steady flood of one key
  costs at most one line per interval after the first.
- At most `max_keys` keys are remembered; occurrences of any further key count under
  the `overflow` key. Memory is O(max_keys) whatever the input.
- Time is an argument; `next_deadline()` says when `due(now)` next has work.

This module only decides; it never logs or reads a clock (see `kvd.logs.RejectLog`).
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

from kvd.core.timers import TimerHeap

K = TypeVar("K", bound=Hashable)


class LogLimiter(Generic[K]):
    """Per-key windows: `hit` says whether to log now, `due` yields the summaries."""

    __slots__ = ("_ends", "_suppressed", "interval", "max_keys", "overflow")

    def __init__(self, interval: float, max_keys: int, overflow: K) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0 (got {interval!r})")
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1 (got {max_keys!r})")
        self.interval = interval
        self.max_keys = max_keys
        self.overflow = overflow
        self._suppressed: dict[K, int] = {}
        """Occurrences of each remembered key since its last line."""
        self._ends: TimerHeap[K] = TimerHeap()
        """When each remembered key's current window ends."""

    def __len__(self) -> int:
        """Keys remembered now (at most max_keys, plus the overflow key)."""
        return len(self._suppressed)

    def hit(self, key: K, now: float) -> int | None:
        """One occurrence of `key` at `now`.

        Returns None when it must not be logged (it is counted for the next summary),
        else the number of occurrences suppressed since the key's previous line (0 for
        the first), which the line should mention.
        """
        end = self._ends.get(key)
        if end is None:
            if len(self._suppressed) >= self.max_keys and key != self.overflow:
                return self.hit(self.overflow, now)
            self._suppressed[key] = 0
            self._ends.set(key, now + self.interval)
            return 0
        if now < end:
            self._suppressed[key] += 1
            return None
        # The window ended and `due` has not run yet: this line carries the summary.
        n = self._suppressed[key]
        self._suppressed[key] = 0
        self._ends.set(key, now + self.interval)
        return n

    def next_deadline(self) -> float | None:
        """When the earliest window ends (a summary may be due then), or None."""
        return self._ends.next_time()

    def due(self, now: float) -> list[tuple[K, int]]:
        """(key, occurrences suppressed) for each window that ended with some, earliest first.

        Each summary is a line, so a new window starts for its key at `now`; keys whose
        window ended quietly are forgotten.
        """
        out: list[tuple[K, int]] = []
        for key, _ in self._ends.pop_due(now):
            n = self._suppressed[key]
            if n:
                out.append((key, n))
                self._suppressed[key] = 0
                self._ends.set(key, now + self.interval)
            else:
                del self._suppressed[key]
        return out

    def drain(self) -> list[tuple[K, int]]:
        """(key, occurrences suppressed) for every open window that has some; forgets all
        keys (at shutdown: the last summaries, however early)."""
        out = [(key, n) for key, n in self._suppressed.items() if n]
        self._suppressed.clear()
        self._ends = TimerHeap()
        return out
