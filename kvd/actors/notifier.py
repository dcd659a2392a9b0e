"""Notifier: the single consumer of NIXL notifications.

The NIXL thread hands each batch to `sink` on the event loop; the notifier decodes every
message (a peer's bytes are untrusted: anything malformed is dropped, counted and logged
at a bounded rate through `RejectLog`) and routes the rest to the actor that owns them
(which drops messages from agents that never handshaked): what P's daemon hears from D
(registrations, heartbeats, pull completions, cancels, re-sync acks) to the sender,
what D's daemon hears from P (push completions, pull acks, re-sync requests) to the
receiver, probes to the registrar. It never blocks. Heartbeats and probes are outside
input (`HeartbeatReceived`, `ProbeReceived`): dropped and counted when their mailbox is
full, the next one comes. Everything else is never dropped (`Mailbox.post`'s rule).
With a shared secret (a `Keyring`), every notification must be a `wire.Sealed` envelope
under the session key of the agent NIXL names as its sender, with a MAC that verifies and
a counter inside the replay window (`kvd.core.peersession`); the message inside is then
routed as above. Anything else (bare, forged, replayed, too old, under another peer's or
an old incarnation's key) is dropped before it is decoded further, counted in
`notifs_auth_rejected` and `auth_rejected_<reason>`, and logged at a bounded rate.
A peer may send at most `limits.notifs_per_peer_per_s` notifications a second (bursts of
one second's worth, `kvd.core.ratelimit.RateLimiter`): beyond it they are dropped before
decoding and counted (`limit_notifs_dropped`), so a flooding peer costs a counter each.
What the sender keeps while P's engine has not finished (D's registrations and pulls) is
charged from here, not only once the sender keeps it: each is reserved its estimated
bytes from the sender's `limits.pending_bytes` budget (`kvd.core.limits.Reservation`)
before it is posted, and one that does not fit is answered BUSY at once (a PushDone or
PullAck, counted in `limit_pending_bytes_refused`) and never queued. The reservation goes
with the message; the sender adopts it or releases it. So a flood waiting in the
sender's mailbox (its notices are never refused) is bounded by the same bytes as what
the sender keeps. The rest of what waits is bounded in bytes too, each by its own budget
of `limits.notif_bytes` (`kvd.core.limits.message_cost`, reserved here and released by the
actor once it has handled the message): heartbeats waiting for the sender (each may name
65,536 ids, so their mailbox's count bound alone is not one on memory), and P's answers
waiting for the receiver (push completions, layer notices, pull acks, re-sync requests:
notices it never refuses, so an authenticated but hostile or broken P could otherwise
queue them without bound). One peer may hold at most half of each (`SharedBudget`), so
one flooding peer does not crowd the others out. One that does not fit is dropped and
counted (`limit_heartbeat_bytes_dropped`, `limit_notice_bytes_dropped`): a heartbeat's
next one comes, and a D request whose answer was dropped still ends exactly once, failed
by its watchdog (`transfer.transfer_timeout` / `transfer.push_registration_timeout`).
With the stage trace on, it records for each message that names a request when the NIXL
thread polled it (`nixl.notif_polled`) and when it was routed (`notifier.routed`).
"""

from __future__ import annotations

import time
from typing import Any, Final

from kvd_client import wire
from kvd_client.errors import Busy, ErrorCode, KvdError, RemoteProtocolError

from kvd.actors.base import SYSTEM_CLOCK, Clock, Mailbox
from kvd.actors.messages import HeartbeatReceived, NotifReceived, ProbeReceived
from kvd.actors.transfers import Transport
from kvd.core.limits import PendingBudget, Reservation, SharedBudget, message_cost, record_cost
from kvd.core.peersession import AuthRefusal, Keyring
from kvd.core.ratelimit import RateLimiter
from kvd.core.silence import LastSigns
from kvd.core.trace import NO_TRACE, StageTrace, trace_key
from kvd.logs import RejectLog

_TO_SENDER = (wire.PushRegistration, wire.PullDone, wire.CancelRegistration, wire.ResyncAck)
_RESERVED = (wire.PushRegistration, wire.PullDone)
"""What the sender may keep while P's engine has not finished: charged at intake."""
_TO_RECEIVER = (wire.PushDone, wire.LayersPushed, wire.PullAck, wire.Resync)
RATE_KEYS: Final = 4096
"""Peers whose notification rate is tracked apart; further peers share one bucket."""
_OTHER_PEERS: Final = "\0other-peers"


class Notifier:
    def __init__(
        self,
        *,
        sender: Mailbox[Any],
        receiver: Mailbox[Any],
        registrar: Mailbox[Any],
        max_frame: int,
        counters: dict[str, int],
        rejects: RejectLog,
        notifs_per_peer_per_s: float = 100_000.0,
        clock: Clock = SYSTEM_CLOCK,
        trace: StageTrace = NO_TRACE,
        keyring: Keyring | None = None,
        budget: PendingBudget | None = None,
        transport: Transport | None = None,
        notif_bytes: int = 64 << 20,
        signs: LastSigns | None = None,
    ) -> None:
        """`budget`: the sender machine's pending budget, charged here for registrations
        and pulls (None: the sender charges what it keeps, nothing bounds its mailbox);
        `transport` answers those refused (required with a budget); `notif_bytes`: the
        bound of each of the heartbeat and receiver-notice budgets."""
        if (budget is None) != (transport is None):
            raise ValueError("a pending budget needs a transport to answer refusals")
        self.sender = sender
        self.receiver = receiver
        self.registrar = registrar
        self.max_frame = max_frame
        self.counters = counters
        self.rejects = rejects
        self.trace = trace
        self.keyring = keyring
        self.clock = clock
        self.budget = budget
        self.transport = transport
        self.signs = signs
        """Where every notification that decoded (and, with a secret, proved authentic) is
        noted as its agent's sign of life: the registrar does not forget a peer that
        still talks to us while its side channel is silent (`kvd.core.silence`)."""
        self.heartbeat_bytes = SharedBudget(notif_bytes, name="limits.notif_bytes")
        """Heartbeats decoded and waiting for the sender."""
        self.notice_bytes = SharedBudget(notif_bytes, name="limits.notif_bytes")
        """P's answers decoded and waiting for the receiver."""
        self.rate: RateLimiter[str] = RateLimiter(
            notifs_per_peer_per_s, notifs_per_peer_per_s, RATE_KEYS, _OTHER_PEERS
        )

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    def sink(self, agent: str, msgs: list[bytes], polled_ns: int = 0) -> None:
        """A batch of notifications from `agent`, polled at `polled_ns` (0: not traced)."""
        now = self.clock.now()
        for raw in msgs:
            self._one(agent, raw, polled_ns, now)

    def _one(self, agent: str, raw: bytes, polled_ns: int, now: float) -> None:
        self._count("notifs_received")
        if not raw:
            return  # NIXL transfers posted without a notification message
        if not self.rate.allow(agent, now):
            self.rejects.reject(
                "notifier",
                "limit_notifs_dropped",
                "notif_dropped",
                "notifs_per_peer_per_s",
                peer=agent,
                limit=self.rate.rate,
            )
            return
        try:
            _, msg = wire.decode(raw, self.max_frame)
            if self.keyring is not None:
                opened = self._open(agent, msg)
                if isinstance(opened, AuthRefusal):
                    self._auth_refused(agent, opened)
                    return
                _, msg = wire.decode(opened, self.max_frame)  # authentic: now decode it
                if isinstance(msg, (wire.Sealed, wire.Handshake)):
                    self._auth_refused(agent, AuthRefusal.NESTED)
                    return
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
        if self.signs is not None:
            self.signs.note(agent, now)
        try:
            if isinstance(msg, wire.Probe):
                self.registrar.post(ProbeReceived(agent, msg))
            elif isinstance(msg, wire.Heartbeat):
                held = self._hold(agent, msg, self.heartbeat_bytes, "heartbeat")
                if held is None:
                    return
                try:
                    self.sender.post(HeartbeatReceived(agent, msg, held))
                except Busy:
                    held.release()
                    raise
            elif isinstance(msg, _RESERVED) and self.budget is not None:
                reservation = self._reserve(agent, msg, self.budget)
                if reservation is None:
                    return  # refused and answered: never queued
                self.sender.post(NotifReceived(agent, msg, reservation))
            elif isinstance(msg, _TO_SENDER):
                self.sender.post(NotifReceived(agent, msg))
            elif isinstance(msg, _TO_RECEIVER):
                held = self._hold(agent, msg, self.notice_bytes, "notice")
                if held is None:
                    return
                self.receiver.post(NotifReceived(agent, msg, held))
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
            return
        if self.trace.on and polled_ns and (rid := trace_key(msg)):
            self.trace.mark_at(rid, "nixl.notif_polled", polled_ns)
            self.trace.mark(rid, "notifier.routed")

    def _hold(
        self, agent: str, msg: wire.Record, budget: SharedBudget, what: str
    ) -> Reservation | None:
        """The bytes `msg` holds until its actor has handled it; None (dropped, counted,
        logged at a bounded rate) when they do not fit under `limits.notif_bytes`, or in
        the half of it one peer may hold."""
        cost = message_cost(msg)
        held = budget.reserve_for(agent, cost)
        if held is None:
            self.rejects.reject(
                "notifier",
                f"limit_{what}_bytes_dropped",
                "notif_dropped",
                "notif_bytes",
                peer=agent,
                type=type(msg).__name__,
                error=budget.why(cost, f"a {type(msg).__name__}"),
            )
        return held

    def _reserve(
        self, agent: str, msg: wire.PushRegistration | wire.PullDone, budget: PendingBudget
    ) -> Reservation | None:
        """The bytes reserved for `msg` until the sender keeps or drops it; None once it
        was refused for want of them (answered BUSY, counted)."""
        cost = record_cost(msg)
        reservation = budget.reserve(cost)
        if reservation is not None:
            return reservation
        busy = int(ErrorCode.BUSY)
        answer: wire.Record
        if isinstance(msg, wire.PushRegistration):
            why = budget.why(cost, "a push registration")
            answer = wire.PushDone(msg.request_id, 0, False, busy, why)
        else:
            why = budget.why(cost, "a pull")
            answer = wire.PullAck(msg.d_request_id, False, busy, why)
        self.rejects.reject(
            "notifier",
            "limit_pending_bytes_refused",
            "peer_request_refused",
            "pending_bytes",
            peer=agent,
        )
        assert self.transport is not None

        def done(exc: KvdError | None) -> None:
            if exc is not None:
                self._count("notifs_failed")

        self.transport.post_notif(agent, wire.encode(answer), done, report_ok=False)
        return None

    def _open(self, agent: str, msg: wire.Record) -> bytes | AuthRefusal:
        """The body of an authentic, fresh envelope from `agent`, or why not."""
        assert self.keyring is not None
        if not isinstance(msg, wire.Sealed):
            return AuthRefusal.UNSEALED
        got = self.keyring.open(msg, time.monotonic(), agent)
        return got if isinstance(got, AuthRefusal) else got[1]

    def _auth_refused(self, agent: str, why: AuthRefusal) -> None:
        self._count(f"auth_rejected_{why.value}")
        self.rejects.reject(
            "notifier", "notifs_auth_rejected", "notif_auth_rejected", why.value, peer=agent
        )

    def limits(self) -> dict[str, Any]:
        """The notification rate limit, the busiest peer's rate, and the drops, for status."""
        return {
            "limit": self.rate.rate,
            "used": self.rate.busiest(self.clock.now()),
            "refused": self.counters.get("limit_notifs_dropped", 0),
        }

    def byte_limits(self) -> dict[str, dict[str, int]]:
        """`limits.notif_bytes` of each budget: bound, use, peak and drops, for status."""
        return {
            f"notif_bytes_{name}": {
                "limit": b.limit,
                "used": b.used,
                "peak": b.peak,
                "refused": b.refused,
            }
            for name, b in (("heartbeats", self.heartbeat_bytes), ("notices", self.notice_bytes))
        }
