"""Heartbeat schedule on the decode (D) side.

While D waits to pull a request's blocks, it must keep P's lease on them alive by
heartbeating. Heartbeats are batched per peer: one beat names every request tracked
against that peer. A newly seen peer is due at once (the lease clock on P is already
running); a request added to an already scheduled peer rides its next beat. `due(now)`
returns the batches that are due and reschedules each peer one interval later; a peer
with nothing left to track is dropped and never beats. Sans-IO: `now` is a parameter,
`next_deadline()` says when the shell must next wake.
"""

from __future__ import annotations

from kvd.core.timers import TimerHeap


class HeartbeatSchedule:
    """Requests tracked per peer, with one heartbeat timer per peer."""

    __slots__ = ("_interval", "_peer_of", "_requests", "_timers")

    def __init__(self) -> None:
        self._peer_of: dict[str, str] = {}
        # peer -> its tracked request ids, in tracking order (insertion-ordered set)
        self._requests: dict[str, dict[str, None]] = {}
        self._interval: dict[str, float] = {}
        self._timers: TimerHeap[str] = TimerHeap()

    def __len__(self) -> int:
        return len(self._peer_of)

    def track(self, request_id: str, peer: str, now: float, interval: float) -> None:
        """Heartbeat `request_id` to `peer` every `interval` seconds until untracked.

        `interval` is the peer's period; the latest value given for a peer wins from
        its next reschedule on. Tracking an id already tracked against another peer
        moves it.
        """
        if not interval > 0:
            raise ValueError(f"heartbeat interval must be > 0, got {interval!r}")
        current = self._peer_of.get(request_id)
        if current is not None and current != peer:
            self.untrack(request_id)
        self._peer_of[request_id] = peer
        self._requests.setdefault(peer, {})[request_id] = None
        self._interval[peer] = interval
        if peer not in self._timers:
            self._timers.set(peer, now)

    def set_interval(self, peer: str, interval: float, now: float) -> None:
        """Change `peer`'s period (e.g. once its lease is learned); a beat scheduled later
        than `now + interval` moves up to then. No-op for a peer with nothing tracked."""
        if not interval > 0:
            raise ValueError(f"heartbeat interval must be > 0, got {interval!r}")
        if peer not in self._requests:
            return
        self._interval[peer] = interval
        due = self._timers.get(peer)
        if due is None or due > now + interval:
            self._timers.set(peer, now + interval)

    def untrack(self, request_id: str) -> None:
        """Stop heartbeating `request_id` (no-op if it is not tracked)."""
        peer = self._peer_of.pop(request_id, None)
        if peer is None:
            return
        requests = self._requests[peer]
        del requests[request_id]
        if not requests:
            del self._requests[peer]
            del self._interval[peer]
            self._timers.discard(peer)

    def due(self, now: float) -> dict[str, list[str]]:
        """Every peer due at `now` with its tracked ids; each is rescheduled at now + interval."""
        batches: dict[str, list[str]] = {}
        fired = self._timers.pop_due(now)
        for peer, _ in fired:
            batches[peer] = list(self._requests[peer])
        for peer, _ in fired:
            self._timers.set(peer, now + self._interval[peer])
        return batches

    def next_deadline(self) -> float | None:
        """When the next peer is due, or None if nothing is tracked."""
        return self._timers.next_time()

    def peer_of(self, request_id: str) -> str | None:
        return self._peer_of.get(request_id)

    def requests_of(self, peer: str) -> list[str]:
        """The ids tracked against `peer`, in tracking order (empty if none)."""
        requests = self._requests.get(peer)
        return [] if requests is None else list(requests)

    def peers(self) -> list[str]:
        """Peers with at least one tracked request."""
        return list(self._requests)
