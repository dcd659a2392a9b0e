"""Rate limits with bounded memory whatever arrives: which log lines to write
(`LogLimiter`), and which of a peer's messages to take (`RateLimiter`).

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

`RateLimiter` is a token bucket per key (a peer): `rate` events per second, bursts of up
to `burst`. A bucket that has refilled is forgotten (a new one is the same), and at most
`max_keys` buckets are kept; further keys share the `overflow` key's bucket. It also
counts each key's events in the current whole second, for `kvd status`.

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


class RateLimiter(Generic[K]):
    """Token buckets per key (see the module docstring): `allow` says whether to take an
    event; memory is O(max_keys) whatever the keys."""

    __slots__ = (
        "_buckets",
        "_full",
        "_pruned",
        "_seconds",
        "burst",
        "max_keys",
        "overflow",
        "rate",
    )

    def __init__(self, rate: float, burst: float, max_keys: int, overflow: K) -> None:
        if not rate > 0:
            raise ValueError(f"rate must be > 0 (got {rate!r})")
        if not burst >= 1:
            raise ValueError(f"burst must be >= 1 (got {burst!r})")
        if max_keys < 1:
            raise ValueError(f"max_keys must be >= 1 (got {max_keys!r})")
        self.rate = rate
        self.burst = burst
        self.max_keys = max_keys
        self.overflow = overflow
        self._buckets: dict[K, tuple[float, float]] = {}
        """Key -> (tokens, when they were counted)."""
        self._full: TimerHeap[K] = TimerHeap()
        """When each bucket is full again (then it is forgotten)."""
        self._seconds: dict[K, tuple[int, int]] = {}
        """Key -> (whole second, events in it), for `busiest`."""
        self._pruned = -1

    def __len__(self) -> int:
        """Buckets kept now (at most max_keys, plus the overflow key's)."""
        return len(self._buckets)

    def allow(self, key: K, now: float) -> bool:
        """One event of `key` at `now`: True to take it (a token is spent), False to refuse."""
        for gone, _ in self._full.pop_due(now):
            del self._buckets[gone]
        have = self._buckets.get(key)
        if have is None:
            if len(self._buckets) >= self.max_keys and key != self.overflow:
                return self.allow(self.overflow, now)
            tokens = self.burst
        else:
            tokens = min(self.burst, have[0] + (now - have[1]) * self.rate)
        self._tally(key, int(now))
        ok = tokens >= 1.0
        if ok:
            tokens -= 1.0
        self._buckets[key] = (tokens, now)
        self._full.set(key, now + (self.burst - tokens) / self.rate)
        return ok

    def _tally(self, key: K, second: int) -> None:
        seconds = self._seconds
        if key not in seconds and len(seconds) >= self.max_keys:
            if self._pruned != second:  # O(max_keys), at most once a second
                self._pruned = second
                for old in [k for k, (s, _) in seconds.items() if s < second - 1]:
                    del seconds[old]
            if len(seconds) >= self.max_keys:
                key = self.overflow
        seen = seconds.get(key)
        seconds[key] = (second, seen[1] + 1 if seen is not None and seen[0] == second else 1)

    def busiest(self, now: float) -> int:
        """The most events one key brought in the last whole second or the current one
        (taken or refused)."""
        second = int(now)
        return max((n for s, n in self._seconds.values() if s >= second - 1), default=0)
