"""The memory a protocol machine may keep for requests that are pending, estimated and bounded.

Outside input (a peer's registrations and pulls, a client's requests) makes the daemon
keep per-request state until the request ends. Counting entries alone does not bound
memory (one registration may name a million block ids), so each entry is charged an
estimate of the bytes it holds: a fixed cost for its records (the request object, its
dict and timer entries, the message) plus a cost per block id and per character of the
ids it names. A machine takes an entry only if its charge fits under `limit`; the
charge is returned when the entry goes. The estimate is deliberately generous (CPython
objects, not wire bytes), so the daemon's real use stays below the bound.

A peer's message is charged from the moment it is decoded, not only once a machine keeps
it: the intake (the notifier) `reserve`s its cost, refuses it at once if it does not fit,
and hands the `Reservation` along with the message. The reservation moves with it: the
machine `adopt`s it when it keeps the entry (the charge is then the entry's, given back
when the entry goes), and whoever drops the message otherwise (the machine refusing it,
the actor discarding it) `release`s it. So what waits in a mailbox counts against the
same bound as what is kept, and a flood is refused at intake instead of queued. A
reservation frees its bytes at most once: a second release, or a release after adopt,
gives nothing back.

No IO and no clock: the machines own their budget and decide what a refusal means (the
intake and P's sender machine share the sender's budget, as tasks share a capacity
limiter; both run on the daemon's one event loop).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Final

ENTRY_BYTES: Final = 1024
"""Estimated bytes of one pending request's records, apart from its block ids and text."""
BLOCK_ID_BYTES: Final = 40
"""Estimated bytes of one block id held in a tuple (a pointer and an int object)."""
OBJECT_BYTES: Final = 64
"""Estimated bytes of one str, bytes or record object apart from its characters (CPython's
header, a pointer to it, allocator rounding)."""


def entry_cost(blocks: int, text: int = 0) -> int:
    """Estimated bytes of a pending entry holding `blocks` block ids and `text` characters."""
    return ENTRY_BYTES + BLOCK_ID_BYTES * blocks + text


@dataclass
class PendingBudget:
    """Estimated bytes of pending state held, against a bound (see the module docstring)."""

    limit: int
    used: int = 0
    peak: int = 0
    refused: int = 0
    name: str = "limits.pending_bytes"
    """The configuration key of the bound, named in refusals."""

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError(f"limit must be >= 1 (got {self.limit!r})")

    def take(self, cost: int, freed: int = 0, *, alone_fits: bool = False) -> bool:
        """Charge `cost` in place of `freed` (what an entry that grows was charged) if the
        result fits under the limit; False (counted in `refused`, nothing changed) if not.
        `alone_fits`: an entry is taken whatever its cost while nothing else is held (one
        bigger than the bound must still pass, one at a time)."""
        after = self.used - freed + cost
        if alone_fits and self.used == freed:
            pass
        elif after > self.limit and cost > freed:
            self.refused += 1
            return False
        self.used = after
        self.peak = max(self.peak, after)
        return True

    def reserve(self, cost: int, *, alone_fits: bool = False) -> Reservation | None:
        """Charge `cost` for a message not yet kept (see the module docstring); None
        (counted in `refused`, nothing changed) if it does not fit (`take`)."""
        return Reservation(self, cost) if self.take(cost, alone_fits=alone_fits) else None

    def give(self, cost: int, key: str | None = None) -> None:
        """Return what an entry (of `key`, for a `SharedBudget`) was charged."""
        self.used -= cost
        if self.used < 0:  # a bug in the caller; never let it widen the bound
            raise ValueError(f"pending budget returned more than it was charged ({self.used})")

    def why(self, cost: int, what: str) -> str:
        """The refusal's reason, naming the limit."""
        return (
            f"{self.name} reached: {what} needs ~{cost} bytes, {self.used} of {self.limit} in use"
        )


@dataclass
class SharedBudget(PendingBudget):
    """A `PendingBudget` shared by peers, none of which may hold more than `share` of it:
    a peer flooding it fills its share and is refused there, and the rest stays for the
    others (a peer holding nothing may always take what fits in the whole budget)."""

    share: float = 0.5
    by_key: dict[str, int] = dataclasses.field(default_factory=dict)

    def reserve_for(self, key: str, cost: int) -> Reservation | None:
        """Charge `cost` to `key` (see `reserve`); None (counted in `refused`) when it does
        not fit in the budget, or in `key`'s share while `key` holds something already."""
        held = self.by_key.get(key, 0)
        if held and held + cost > self.limit * self.share:
            self.refused += 1
            return None
        if not self.take(cost):
            return None
        self.by_key[key] = held + cost
        return Reservation(self, cost, key)

    def give(self, cost: int, key: str | None = None) -> None:
        super().give(cost)
        if key is not None:
            left = self.by_key.get(key, 0) - cost
            if left < 0:
                raise ValueError(f"{key!r} returned more than it was charged ({left})")
            if left:
                self.by_key[key] = left
            else:
                del self.by_key[key]


class Reservation:
    """Bytes of a `PendingBudget` charged for one message from its intake until it ends.

    Exactly one of `adopt` (the charge becomes a kept entry's, returned by the machine
    with `PendingBudget.give` when the entry goes) and `release` (the message was dropped:
    the bytes go back now) takes effect; anything after that is a no-op for `release`
    and an error for `adopt` (the caller would charge an entry twice).
    """

    __slots__ = ("_held", "budget", "cost", "key")

    def __init__(self, budget: PendingBudget, cost: int, key: str | None = None) -> None:
        self.budget = budget
        self.cost = cost
        self.key = key
        self._held = True

    @property
    def held(self) -> bool:
        """Whether the bytes are still this reservation's (neither adopted nor released)."""
        return self._held

    def adopt(self) -> int:
        """The machine keeps the message: its charge is now the entry's. Returns it."""
        if not self._held:
            raise ValueError("reservation already adopted or released")
        self._held = False
        return self.cost

    def release(self) -> bool:
        """Give the bytes back if still held; False (nothing given) if already done."""
        if not self._held:
            return False
        self._held = False
        self.budget.give(self.cost, self.key)
        return True

    def __repr__(self) -> str:
        return f"Reservation(cost={self.cost}, held={self._held})"


def record_cost(*records: object) -> int:
    """`entry_cost` of the messages (frozen dataclasses) a pending entry keeps: each tuple
    item counts as a block id, each character of a text or bytes field as a byte."""
    items = text = 0
    for record in records:
        if record is None:
            continue
        for f in dataclasses.fields(record):  # type: ignore[arg-type]
            value = getattr(record, f.name)
            if isinstance(value, str | bytes):
                text += len(value)
            elif isinstance(value, tuple):
                items += len(value)
    return entry_cost(items, text)


def message_cost(record: object) -> int:
    """Estimated bytes a decoded message holds while it waits (a notification queued for
    its actor, a handshake being served): `ENTRY_BYTES` for the message and its envelope,
    and every text, tuple item and nested record it carries at its CPython size. Unlike
    `record_cost` (block ids), this charges id lists by their characters too: a heartbeat
    naming 65,536 request ids holds ~100 bytes per id, not 40."""
    return ENTRY_BYTES + _value_cost(record)


def _value_cost(value: object) -> int:
    if isinstance(value, str | bytes):
        return OBJECT_BYTES + len(value)
    if isinstance(value, tuple | list):
        return OBJECT_BYTES + sum(8 + _value_cost(v) for v in value)
    if isinstance(value, dict):
        return OBJECT_BYTES + sum(16 + _value_cost(k) + _value_cost(v) for k, v in value.items())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return OBJECT_BYTES + sum(
            8 + _value_cost(getattr(value, f.name)) for f in dataclasses.fields(value)
        )
    return BLOCK_ID_BYTES - 8  # an int, a float, a bool, None: a small object
