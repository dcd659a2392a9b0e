"""Block leases on the prefill (P) side.

While a decode peer has not yet pulled a request's KV blocks, P keeps them pinned under
a lease. The peer's heartbeats extend the lease; a lease that reaches its deadline is
expired and its blocks go back to the engine. A *fixed* lease (D keeping a finished
request's blocks for the next conversational turn, bidirectional KV) has its own
duration and is never extended: the next turn's timing is the client's, not a peer's.
The table is sans-IO: `now` is always an argument, `next_deadline()` says when the
sender must next wake, and `expire(now)` returns what expired. Deadlines live in a
`TimerHeap` (lazy deletion), so extending or expiring is O(log n) per lease, never a
scan of the table.

Leases are also indexed by base request id (see `kvd.core.ids`) so an id carrying
another engine's random suffix still finds its lease.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kvd_client.errors import InvalidRequest

from kvd.core.ids import base_request_id
from kvd.core.timers import TimerHeap


@dataclass(frozen=True, slots=True)
class Lease:
    """Blocks of one request held for a peer until `deadline`."""

    request_id: str
    deadline: float
    granted_at: float
    owner: str
    """Opaque key of whoever holds the lease (e.g. a client session)."""
    fixed: bool = False
    """Never extended by heartbeats (its deadline is final)."""


class LeaseTable:
    """Leases keyed by request id, with a deadline heap and a base-id index."""

    __slots__ = ("_by_base", "_duration", "_extension", "_leases", "_timers")

    def __init__(self, duration: float) -> None:
        if not duration > 0:
            raise ValueError(f"lease duration must be > 0, got {duration!r}")
        self._duration = float(duration)
        self._extension = self._duration * 2.0 / 3.0
        self._leases: dict[str, Lease] = {}
        self._timers: TimerHeap[str] = TimerHeap()
        # base id -> table keys with that base (insertion-ordered set)
        self._by_base: dict[str, dict[str, None]] = {}

    @property
    def duration(self) -> float:
        """Lifetime of a fresh lease."""
        return self._duration

    @property
    def extension(self) -> float:
        """How far past `now` an extension pushes a deadline (2/3 of the duration)."""
        return self._extension

    def __len__(self) -> int:
        return len(self._leases)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._leases

    def get(self, request_id: str) -> Lease | None:
        return self._leases.get(request_id)

    def leases(self) -> Iterator[Lease]:
        """Every live lease, in grant order."""
        return iter(list(self._leases.values()))

    def grant(
        self, request_id: str, now: float, owner: str = "", *, fixed_for: float = 0.0
    ) -> Lease:
        """Lease `request_id`'s blocks until `now + duration`, or with `fixed_for` > 0 until
        `now + fixed_for`, a deadline no heartbeat moves.

        Raises InvalidRequest if the id already holds a lease.
        """
        if request_id in self._leases:
            raise InvalidRequest(f"request {request_id!r} already holds a lease")
        if fixed_for < 0:
            raise ValueError(f"fixed lease duration must be >= 0, got {fixed_for!r}")
        fixed = fixed_for > 0
        lease = Lease(
            request_id=request_id,
            deadline=now + (fixed_for if fixed else self._duration),
            granted_at=now,
            owner=owner,
            fixed=fixed,
        )
        self._leases[request_id] = lease
        self._timers.set(request_id, lease.deadline)
        self._by_base.setdefault(base_request_id(request_id), {})[request_id] = None
        return lease

    def extend(self, request_ids: Iterable[str], now: float) -> list[str]:
        """Push each known lease's deadline to at least `now + extension`.

        Deadlines never move earlier, and a fixed lease's never moves at all. Unknown ids
        are ignored; the ids that were known (fixed ones included) are returned (in the
        order given) so the caller can count the rest.
        """
        target = now + self._extension
        leases = self._leases
        timers = self._timers
        known: list[str] = []
        for request_id in request_ids:
            lease = leases.get(request_id)
            if lease is None:
                continue
            known.append(request_id)
            if target > lease.deadline and not lease.fixed:
                leases[request_id] = Lease(lease.request_id, target, lease.granted_at, lease.owner)
                timers.set(request_id, target)
        return known

    def release(self, request_id: str) -> Lease | None:
        """Remove and return the lease of `request_id` (None if it holds none)."""
        lease = self._leases.pop(request_id, None)
        if lease is not None:
            self._timers.discard(request_id)
            self._unindex(request_id)
        return lease

    def find(self, request_id: str) -> str | None:
        """The table key for `request_id`: itself if leased, else a lease sharing its base id."""
        if request_id in self._leases:
            return request_id
        keys = self._by_base.get(base_request_id(request_id))
        if not keys:
            return None
        return next(iter(keys))

    def next_deadline(self) -> float | None:
        """The earliest live deadline (when the sender must next wake), or None."""
        return self._timers.next_time()

    def expire(self, now: float) -> list[Lease]:
        """Remove and return every lease whose deadline is <= `now`, earliest first."""
        expired: list[Lease] = []
        for request_id, _ in self._timers.pop_due(now):
            expired.append(self._leases.pop(request_id))
            self._unindex(request_id)
        return expired

    def _unindex(self, request_id: str) -> None:
        base = base_request_id(request_id)
        keys = self._by_base.get(base)
        if keys is not None:
            keys.pop(request_id, None)
            if not keys:
                del self._by_base[base]
