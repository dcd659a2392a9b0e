"""The stage trace: when a request passed each stage of a daemon, for `kvd bench`.

One `StageTrace` per daemon: a bounded ring of (time, request id, stage) records that the
actors and the NIXL thread append to (a deque's append is atomic, so the thread needs no
lock). The oldest records fall out when it is full; `drain` hands them out oldest first
and forgets them. It records only when `daemon.trace_records` > 0, and can be switched
off and on at run time (the bench compares the two).

Off costs one branch: every place that records tests `trace.on` before it builds the
record's arguments, and `mark` tests it again, so a trace that is off records nothing
and never reads its clock. Time is injected: the daemon passes `time.monotonic_ns`,
CLOCK_MONOTONIC, which every process of a host shares, so a client's timestamps and
both daemons' join into one timeline. Stage names are stable dotted strings
(`<actor or thread>.<what happened>`); `kvd/bench/stages.py` lists those of a push and a
pull in the order a request passes them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Final

TraceRecord = tuple[int, str, str]
"""(time in ns, request id, stage)."""


class StageTrace:
    """A bounded ring of stage records (see the module docstring)."""

    __slots__ = ("_clock", "_ring", "capacity", "on")

    def __init__(self, capacity: int, clock: Callable[[], int]) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity!r}")
        self.capacity: Final = capacity
        self.on = capacity > 0
        """Recording now. Never true without a ring (capacity 0)."""
        self._clock = clock
        self._ring: deque[TraceRecord] = deque(maxlen=capacity)

    def switch(self, on: bool) -> bool:
        """Start or stop recording; returns whether it records now."""
        self.on = on and self.capacity > 0
        return self.on

    def mark(self, request_id: str, stage: str) -> None:
        """`request_id` reached `stage` now."""
        if self.on:
            self._ring.append((self._clock(), request_id, stage))

    def mark_at(self, request_id: str, stage: str, t_ns: int) -> None:
        """`request_id` reached `stage` at `t_ns` (a time taken elsewhere, e.g. on another
        thread before the request's id was known)."""
        if self.on:
            self._ring.append((t_ns, request_id, stage))

    def now(self) -> int:
        """The trace's clock, for a time to pass to `mark_at` later (0 while off)."""
        return self._clock() if self.on else 0

    def drain(self, limit: int) -> list[TraceRecord]:
        """Up to `limit` records, oldest first; they leave the ring."""
        ring = self._ring
        out: list[TraceRecord] = []
        while ring and len(out) < limit:
            out.append(ring.popleft())
        return out

    def __len__(self) -> int:
        return len(self._ring)

    @property
    def full(self) -> bool:
        """The ring holds `capacity` records: older ones may have fallen out."""
        return self.capacity > 0 and len(self._ring) == self.capacity


NO_TRACE: Final = StageTrace(0, lambda: 0)
"""The trace of a daemon (or a test's actor) that has none: always off."""


def trace_key(record: object) -> str:
    """The request id a wire record is keyed under in the trace ("" for none: a heartbeat
    names many). A message between the daemons carries the id of its sender's side; the
    bench joins a request's records by both of its ids."""
    rid = getattr(record, "request_id", "") or getattr(record, "d_request_id", "")
    return rid if isinstance(rid, str) else ""
