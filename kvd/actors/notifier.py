"""Notifier: the single consumer of NIXL notifications.

The NIXL thread hands each batch to `sink` on the event loop; the notifier decodes every
message (a peer's bytes are untrusted: anything malformed is dropped, counted and logged
at a bounded rate through `RejectLog`) and routes the rest to the actor that owns them
(which drops messages from agents that never handshaked). It never blocks. Heartbeats
and probes are dropped (and counted) when their mailbox is full: the next one comes.
Completions, acks and registrations are never dropped: they take the overflow path of
`post_internal`.
"""

from __future__ import annotations

from typing import Any

from kvd_client import wire
from kvd_client.errors import Busy, RemoteProtocolError

from kvd.actors.base import Mailbox
from kvd.actors.messages import NotifReceived, ProbeReceived
from kvd.logs import RejectLog

_TO_WRITER = (
    wire.PushRegistration,
    wire.PushDone,
    wire.PullAck,
    wire.CancelRegistration,
    wire.Resync,
    wire.ResyncAck,
)
_TO_REAPER = (wire.Heartbeat, wire.PullDone)


class Notifier:
    def __init__(
        self,
        *,
        writer: Mailbox[Any],
        reaper: Mailbox[Any],
        registrar: Mailbox[Any],
        max_frame: int,
        counters: dict[str, int],
        rejects: RejectLog,
    ) -> None:
        self.writer = writer
        self.reaper = reaper
        self.registrar = registrar
        self.max_frame = max_frame
        self.counters = counters
        self.rejects = rejects

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    def sink(self, agent: str, msgs: list[bytes]) -> None:
        for raw in msgs:
            self._one(agent, raw)

    def _one(self, agent: str, raw: bytes) -> None:
        self._count("notifs_received")
        if not raw:
            return  # NIXL transfers posted without a notification message
        try:
            _, msg = wire.decode(raw, self.max_frame)
        except RemoteProtocolError as exc:
            self.rejects.reject(
                "notifier",
                "notifs_malformed",
                "notif_malformed",
                type(exc).__name__,
                peer=agent,
                error=exc.message,
            )
            return
        try:
            if isinstance(msg, wire.Probe):
                self.registrar.post(ProbeReceived(agent, msg))
            elif isinstance(msg, wire.Heartbeat):
                self.reaper.post(NotifReceived(agent, msg))  # droppable: the next beat comes
            elif isinstance(msg, _TO_WRITER):
                # answers to our own transfers, or a registration that D would otherwise
                # only see fail at its watchdog: never dropped (see Mailbox.post_internal)
                self.writer.post_internal(NotifReceived(agent, msg))
            elif isinstance(msg, _TO_REAPER):
                self.reaper.post_internal(NotifReceived(agent, msg))
            else:
                self.rejects.reject(
                    "notifier",
                    "notifs_rejected",
                    "notif_unexpected_type",
                    "not_a_notification",
                    peer=agent,
                    type=type(msg).__name__,
                )
        except Busy:
            self._count("notifs_dropped_busy")
