"""Push-mode matcher on the prefill (P) side.

In push mode P writes KV blocks into D's memory. Two things must meet first: D's
*registration* (where to write) and P's *finished* notice (which blocks hold the
prompt). They arrive in either order and may name the request under ids that differ
only in vLLM's per-engine random suffix. Each arrival looks in the other table, exact
id first, then by base id (`kvd.core.ids.base_request_id`); a hit removes both entries
and yields a `Match`, a miss stores the arrival. Every lookup is O(1): both tables keep
a base id -> ids index. Sans-IO: `now` only stamps arrivals for watchdogs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

from kvd_client.errors import InvalidRequest

from kvd.core.ids import base_request_id

R = TypeVar("R")
F = TypeVar("F")
V = TypeVar("V")


@dataclass(frozen=True, slots=True)
class Match(Generic[R, F]):
    """A registration and a finished notice that belong to the same request."""

    registration_id: str
    finished_id: str
    registration: R
    finished: F


class _Table(Generic[V]):
    """Entries keyed by id, stamped with their arrival time, indexed by base id."""

    __slots__ = ("by_base", "entries", "max_added", "ordered")

    def __init__(self) -> None:
        self.entries: dict[str, tuple[V, float]] = {}
        # base id -> ids with that base, oldest first (insertion-ordered set)
        self.by_base: dict[str, dict[str, None]] = {}
        self.max_added = float("-inf")
        # True while arrival times were non-decreasing, so `entries` is in time order.
        self.ordered = True

    def add(self, request_id: str, value: V, now: float, what: str) -> None:
        if request_id in self.entries:
            raise InvalidRequest(f"duplicate {what} for request {request_id!r}")
        self.entries[request_id] = (value, now)
        self.by_base.setdefault(base_request_id(request_id), {})[request_id] = None
        if now < self.max_added:
            self.ordered = False
        else:
            self.max_added = now

    def lookup(self, request_id: str) -> str | None:
        if request_id in self.entries:
            return request_id
        ids = self.by_base.get(base_request_id(request_id))
        return next(iter(ids)) if ids else None

    def pop(self, request_id: str) -> V | None:
        entry = self.entries.pop(request_id, None)
        if entry is None:
            return None
        base = base_request_id(request_id)
        ids = self.by_base[base]
        del ids[request_id]
        if not ids:
            del self.by_base[base]
        if not self.entries:
            self.ordered = True
            self.max_added = float("-inf")
        return entry[0]

    def older_than(self, cutoff: float) -> list[str]:
        if self.ordered:
            out: list[str] = []
            for request_id, (_, added) in self.entries.items():
                if added >= cutoff:
                    break
                out.append(request_id)
            return out
        old = [(added, rid) for rid, (_, added) in self.entries.items() if added < cutoff]
        old.sort(key=lambda item: item[0])
        return [rid for _, rid in old]


class PushMatcher(Generic[R, F]):
    """Pairs registrations (from D) with finished notices (from P's scheduler)."""

    __slots__ = ("_fins", "_regs")

    def __init__(self) -> None:
        self._regs: _Table[R] = _Table()
        self._fins: _Table[F] = _Table()

    def add_registration(self, request_id: str, reg: R, now: float) -> Match[R, F] | None:
        """Match `reg` with a waiting finished notice, or store it until one arrives.

        Raises InvalidRequest if a registration with this exact id is already waiting.
        """
        if request_id in self._regs.entries:
            raise InvalidRequest(f"duplicate registration for request {request_id!r}")
        other = self._fins.lookup(request_id)
        if other is None:
            self._regs.add(request_id, reg, now, "registration")
            return None
        fin = self._fins.entries[other][0]
        self._fins.pop(other)
        return Match(request_id, other, reg, fin)

    def add_finished(self, request_id: str, fin: F, now: float) -> Match[R, F] | None:
        """Match `fin` with a waiting registration, or store it until one arrives.

        Raises InvalidRequest if a finished notice with this exact id is already waiting.
        """
        if request_id in self._fins.entries:
            raise InvalidRequest(f"duplicate finished notice for request {request_id!r}")
        other = self._regs.lookup(request_id)
        if other is None:
            self._fins.add(request_id, fin, now, "finished notice")
            return None
        reg = self._regs.entries[other][0]
        self._regs.pop(other)
        return Match(other, request_id, reg, fin)

    def remove_registration(self, request_id: str) -> R | None:
        """Drop a waiting registration (exact id); None if there is none."""
        return self._regs.pop(request_id)

    def find_registration(self, request_id: str) -> str | None:
        """The key of a waiting registration for this id: exact first, then by base id."""
        return self._regs.lookup(request_id)

    def remove_finished(self, request_id: str) -> F | None:
        """Drop a waiting finished notice (exact id); None if there is none."""
        return self._fins.pop(request_id)

    def pending_registrations(self) -> int:
        return len(self._regs.entries)

    def pending_finished(self) -> int:
        return len(self._fins.entries)

    def has_unmatched_finished(self) -> bool:
        return bool(self._fins.entries)

    def registrations_older_than(self, cutoff: float) -> list[str]:
        """Ids of registrations that arrived before `cutoff`, oldest first.

        While arrival times are non-decreasing this stops at the first young entry
        instead of scanning the table.
        """
        return self._regs.older_than(cutoff)
