"""The stage trace: when a request passed each stage of a daemon.

One `StageTrace` per daemon, fed by the actors and the NIXL thread, kept two ways:

- Per request (always on unless `daemon.trace_requests` = 0): the stages of the most
  recent `requests` requests, looked up by request id (`lookup`), for `kvd trace`. A
  request also remembers its peer agent and the id the peer knows it by (`link`), so a
  lookup finds the records both daemons keep under either id. The oldest request falls
  out when a new one arrives and the table is full; a request keeps at most
  `STAGES_PER_REQUEST` stages (a long-lived one's heartbeats cannot grow it).
- A flat ring (only when `daemon.trace_records` > 0, for `kvd bench`): (time, request
  id, stage) records in order; `drain` hands them out oldest first and forgets them.

Recording can be switched off and on at run time (the bench compares the two); off, it
costs one branch: every place that records tests `trace.on` before it builds the
record's arguments, and `mark` tests it again, so a trace that is off records nothing
and never reads its clock.

Threads: the NIXL thread records too, without a lock. A deque's append and popleft, and
a dict's get, setdefault and pop, are each atomic under the GIL; a request's entry is
created by `setdefault`, and only the thread whose entry won queues it for eviction, so
no record is torn. Two threads evicting at once may evict one request too many, and a
request may keep one stage past its bound: both harmless.

Time is injected: the daemon passes `time.monotonic_ns`, CLOCK_MONOTONIC, which every
process of a host shares. Across hosts the peer's times are moved onto ours by the
clock offset estimated at handshake (`kvd.core.timeline`). Stage names are stable
dotted strings (`<actor or thread>.<what happened>`); `kvd/bench/stages.py` lists those
of a push and a pull in the order a request passes them.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

TraceRecord = tuple[int, str, str]
"""(time in ns, request id, stage)."""

STAGES_PER_REQUEST: Final = 64
"""Most stages kept per request; later ones are counted (`dropped`), not kept."""


class _Request:
    """One request's stages, and what links it to the peer's records."""

    __slots__ = ("dropped", "linked", "peer", "stages")

    def __init__(self) -> None:
        self.stages: list[tuple[int, str]] = []
        self.peer = ""
        """The peer daemon's agent name ("" = not known yet)."""
        self.linked = ""
        """The id the peer (and some of our own records) know the request by."""
        self.dropped = 0


@dataclass(frozen=True)
class Found:
    """What a daemon holds about one request (`StageTrace.lookup`)."""

    ids: tuple[str, ...]
    """The ids whose records are included: the asked ones that are known, and those
    they are linked to."""
    peer: str
    """The peer agent the request was linked to ("" = none known)."""
    records: tuple[TraceRecord, ...]
    """Oldest first."""
    dropped: int
    """Stages recorded beyond `STAGES_PER_REQUEST` and not kept."""


class StageTrace:
    """Stage records per request and (optionally) as a flat ring (see the module doc)."""

    __slots__ = ("_by_id", "_clock", "_order", "_ring", "capacity", "on", "requests")

    def __init__(self, capacity: int, clock: Callable[[], int], *, requests: int = 0) -> None:
        if capacity < 0:
            raise ValueError(f"capacity must be >= 0, got {capacity!r}")
        if requests < 0:
            raise ValueError(f"requests must be >= 0, got {requests!r}")
        self.capacity: Final = capacity
        """Records of the flat ring (0 = no ring)."""
        self.requests: Final = requests
        """Requests kept for lookup (0 = none)."""
        self.on = capacity > 0 or requests > 0
        """Recording now. Never true with neither a ring nor a request table."""
        self._clock = clock
        self._ring: deque[TraceRecord] = deque(maxlen=capacity)
        self._by_id: dict[str, _Request] = {}
        self._order: deque[str] = deque()

    def switch(self, on: bool) -> bool:
        """Start or stop recording; returns whether it records now."""
        self.on = on and (self.capacity > 0 or self.requests > 0)
        return self.on

    def mark(self, request_id: str, stage: str) -> None:
        """`request_id` reached `stage` now."""
        if self.on:
            self._record(self._clock(), request_id, stage)

    def mark_at(self, request_id: str, stage: str, t_ns: int) -> None:
        """`request_id` reached `stage` at `t_ns` (a time taken elsewhere, e.g. on another
        thread before the request's id was known)."""
        if self.on:
            self._record(t_ns, request_id, stage)

    def now(self) -> int:
        """The trace's clock, for a time to pass to `mark_at` later (0 while off)."""
        return self._clock() if self.on else 0

    @property
    def clock(self) -> Callable[[], int]:
        """The clock records are stamped with (also when off): the clock exchange with a
        peer (`kvd.core.timeline`) must read the same one."""
        return self._clock

    def _record(self, t_ns: int, request_id: str, stage: str) -> None:
        if self.capacity:
            self._ring.append((t_ns, request_id, stage))
        if self.requests:
            req = self._entry(request_id)
            if len(req.stages) < STAGES_PER_REQUEST:
                req.stages.append((t_ns, stage))
            else:
                req.dropped += 1

    def _entry(self, request_id: str) -> _Request:
        req = self._by_id.get(request_id)
        if req is None:
            new = _Request()
            req = self._by_id.setdefault(request_id, new)
            if req is new:  # this thread created it: it alone queues it for eviction
                order = self._order
                order.append(request_id)
                while len(order) > self.requests:
                    try:
                        old = order.popleft()
                    except IndexError:  # another thread evicted meanwhile
                        break
                    self._by_id.pop(old, None)
        return req

    # ---------------------------------------------------------------- per request

    def link(self, request_id: str, peer: str, peer_request_id: str = "") -> None:
        """`request_id` is being transferred with the daemon `peer`, which knows it as
        `peer_request_id` ("" = the same id or not known). Both ids learn each other."""
        if not (self.on and self.requests and request_id):
            return
        req = self._entry(request_id)
        req.peer = peer
        if peer_request_id and peer_request_id != request_id:
            req.linked = peer_request_id
            other = self._entry(peer_request_id)
            other.peer, other.linked = peer, request_id

    def lookup(self, request_ids: Iterable[str]) -> Found | None:
        """The records kept under these ids and the ids they are linked to; None if no
        id is known here."""
        want = [r for r in dict.fromkeys(request_ids) if r]
        ids: list[str] = []
        peer = ""
        for rid in want:
            req = self._by_id.get(rid)
            if req is None or rid in ids:
                continue
            ids.append(rid)
            peer = peer or req.peer
            if req.linked and req.linked not in ids and req.linked in self._by_id:
                ids.append(req.linked)
        if not ids:
            return None
        records: list[TraceRecord] = []
        dropped = 0
        for rid in ids:
            req = self._by_id.get(rid)
            if req is None:  # evicted since
                continue
            records += [(t, rid, stage) for t, stage in list(req.stages)]
            dropped += req.dropped
            peer = peer or req.peer
        records.sort(key=lambda r: r[0])
        return Found(tuple(ids), peer, tuple(records), dropped)

    @property
    def requests_held(self) -> int:
        """Requests in the per-request table now."""
        return len(self._by_id)

    # ---------------------------------------------------------------- the flat ring

    def drain(self, limit: int) -> list[TraceRecord]:
        """Up to `limit` records of the flat ring, oldest first; they leave the ring."""
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
    bench joins a request's records by both of its ids, `link` makes a lookup do so."""
    rid = (
        getattr(record, "request_id", "")
        or getattr(record, "d_request_id", "")
        or getattr(record, "mm_hash", "")  # an encoder output is its own request
    )
    if not rid:  # a layer notice names its requests: keyed under the first
        many = getattr(record, "requests", None) or getattr(record, "ranges", None)
        if isinstance(many, tuple) and many:
            rid = getattr(many[0], "request_id", "")
    return rid if isinstance(rid, str) else ""
