"""Effects common to the transfer protocol machines (`kvd.core.sender`, `kvd.core.receiver`).

A machine never does IO: `handle(event, now)` returns a list of effects, plain frozen
records, and the actor that owns the machine carries them out in order (send a
notification, post a transfer, emit an event to a client, log). Effects that can fail
report back as events of their machine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvd_client import wire


@dataclass(frozen=True, slots=True)
class Emit:
    """Send `record` (a terminal event) to the client session that announced the request,
    and to its engine's workers."""

    session: str
    engine_id: str
    record: wire.Record


@dataclass(frozen=True, slots=True)
class Notify:
    """Send `record` to the peer agent as a NIXL notification."""

    agent: str
    record: wire.Record


@dataclass(frozen=True, slots=True)
class SessionEnded:
    """Nothing of `session` can transfer any more: answer its SessionClosed."""

    session: str


@dataclass(frozen=True, slots=True)
class Log:
    """A log line (stable snake_case event name; the fields bind request and peer)."""

    level: str
    event: str
    fields: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Drained:
    """The machine is draining and nothing of it is left in flight: answer the drain."""


@dataclass(frozen=True, slots=True)
class Refused:
    """Input refused by a limit (`kvd.core.limits`): count it under `counter` and log it
    as `event`, at a bounded rate per `kind` (the actor's `RejectLog`): a flood of
    refusals must not become a flood of log lines."""

    counter: str
    event: str
    kind: str
    fields: dict[str, Any] = field(default_factory=dict)
