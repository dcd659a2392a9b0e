"""The D side of the KV transfer protocol: a sans-IO state machine per request.

A `Receiver` owns every request D's daemon receives (or only tracks so far), each a
`RecvRequest`, the heartbeat schedule that keeps P's leases on them alive, the probes of
the peers they wait on, and the tombstones of those that ended. Events go in through
`handle(event, now)`, effects come out (`kvd.core.effects` and those below);
`next_deadline()` says when `handle_timer(now)` must run next. No IO, no clock.

States (`RecvState`; `TRANSITIONS` lists every allowed move, `_ON` the handlers):

    TRACKED      the request arrived at D's engine: heartbeats to P start now
    HANDSHAKING  the engine registered (push) or asked to pull: P's regions are being
                 resolved (`Resolve`; the P daemon incarnation, compat and ranks checked)
    REGISTERING  push: the registration is being sent (a view found dead when sending is
                 handshaked afresh, once)
    REGISTERED   push: the registration went out; waiting for a PushDone per transfer, or
                 (a layer-wise push) a LayersPushed for every layer of each transfer.
                 Until P's first answer the registration is sent again (`Resend`), at
                 the heartbeat period, doubling up to half P's lease: P may have
                 refused the first unheard (a notification from an agent it did not
                 know at that moment, or beyond its byte bound), and P ignores a repeat
                 of the registration it holds
                 (A pull by P's WRITE, `PeerResolved.by_write`, goes REGISTERING and
                 REGISTERED as a push does: its registration names P's blocks.)
    READING      pull: our READ of P's blocks is in flight
    ACKING       pull: PullDone sent; P acknowledges only if its lease still held
    CANCELLING   aborted while registered: P was told; waiting for its last word
    HOLDING      given up (P lost, the registration watchdog, no answer to the cancel, an
                 Unsettled READ) while something may still write into D's blocks: the
                 terminal event is held (the engine keeps the blocks untouched) until P's
                 word (a push answer: P sends it only once its WRITE ended or was never
                 posted), P proven gone (`PeerGone`), the READ settled (`ReadSettled`), or
                 its bound passed (P's `write_bound`, else `hold_bound`)
    FINISHED     every byte arrived (RecvFinished)
    FAILED       RecvFailed, with the blocks to recompute
    DROPPED      only tracked, then abandoned (no terminal event: none was announced)

Rules it keeps:
- Each registered or pulled request ends in exactly one terminal event to its session.
- Done only when every rank is: a rank is done by its PushDone(ok), or when the
  LayersPushed that ride P's layer-wise WRITEs (each after its WRITE's bytes) have named
  every one of its layers. A repeated or out-of-range layer is rejected, never counted.
- A request never ends while something may still write into its blocks: a READ in
  flight finishes first, a registration at P is cancelled and P's answer awaited
  (bounded), and an abort while handshaking cancels at P once P is known.
- P is told (a cancel) whenever a request ends before P heard its fate, so P frees the
  blocks at once instead of after a whole lease without heartbeats.
- No byte after the terminal event (docs/late-writes.md §4 C): giving up on a push whose
  WRITE may be in flight (P lost, the registration watchdog, P silent after a cancel)
  re-sends the cancel, asks whether P is provably gone (`CheckGone`, again every
  `probe_interval` while anything is held at P: P answering as itself is told the
  cancel again, so a link that comes back lets it through), stops heartbeating
  (P's lease lapses), and HOLDs the terminal event until P's word, P proven gone, or
  P's `write_bound` (from its handshake: its lease + its post fence + its transfer bound
  + its settle bound: past it no WRITE P could have posted can still land; at most an
  hour; our own `hold_bound` where P did not say). A READ the adapter reports Unsettled
  holds the same way until it settles (`ReadSettled`), at most `hold_bound` more; past
  either bound the request fails anyway (counted `holds_expired`, logged as an error).
- A peer that refuses our handshake, or has not answered for a whole lease, is no
  longer heartbeated or probed (nothing is retried forever).
- A closing session is answered (`SessionEnded`) once none of its requests is left.
- Drain (`StartDrain`, the daemon going out of service): requests only tracked are
  dropped (P told), new tracks are ignored, and a registration or pull fails at once
  (RecvFailed with its blocks, P told); what is already receiving runs to its end.
  `Drained` says when nothing is left.
- An operator's abort (`ForceAbort`, `kvd abort`) ends a request whatever its session,
  by the same rules as the engine's own abort (the terminal event waits for a READ in
  flight or P's answer to the cancel).
- Bounded (`kvd.core.limits`): every live request is charged its estimated bytes against
  `pending_bytes`. A track beyond it is refused (Busy); a push registration or pull
  beyond it ends failed at once (RecvFailed naming the limit, and P told to free).
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from kvd_client import wire
from kvd_client.errors import (
    Busy,
    ErrorCode,
    InvalidRequest,
    KvdError,
    LocalProtocolError,
    NotFound,
    ShuttingDown,
    Timeout,
    TransferError,
    error_from_code,
)

from kvd.core.effects import Drained, Emit, Log, Notify, Refused, SessionEnded
from kvd.core.heartbeats import HeartbeatSchedule
from kvd.core.limits import PendingBudget, record_cost
from kvd.core.timers import TimerHeap

MAX_HB_IDS: Final = 8192
"""Ids per heartbeat message (a larger batch is split)."""
ENDED: Final = 65536
"""Ended request ids remembered (a late answer for one is counted, not warned about)."""
MAX_WRITE_BOUND: Final = 3600.0
"""The longest a P's handshake may make us hold a push it gave up on (seconds)."""


class RecvState(enum.Enum):
    TRACKED = "tracked"
    HANDSHAKING = "handshaking"
    REGISTERING = "registering"
    REGISTERED = "registered"
    READING = "reading"
    ACKING = "acking"
    CANCELLING = "cancelling"
    HOLDING = "holding"
    FINISHED = "finished"
    FAILED = "failed"
    DROPPED = "dropped"


R = RecvState
TERMINAL: Final = frozenset({R.FINISHED, R.FAILED, R.DROPPED})
TRANSITIONS: Final[Mapping[RecvState, frozenset[RecvState]]] = {
    R.TRACKED: frozenset({R.HANDSHAKING, R.DROPPED}),
    R.HANDSHAKING: frozenset({R.REGISTERING, R.READING, R.ACKING, R.FAILED}),
    # P's answer may overtake our own word that the registration went out
    R.REGISTERING: frozenset({R.REGISTERED, R.HANDSHAKING, R.FINISHED, R.FAILED}),
    R.REGISTERED: frozenset({R.CANCELLING, R.HOLDING, R.FINISHED, R.FAILED}),
    R.READING: frozenset({R.HANDSHAKING, R.ACKING, R.HOLDING, R.FAILED}),
    R.ACKING: frozenset({R.FINISHED, R.FAILED}),
    R.CANCELLING: frozenset({R.HOLDING, R.FINISHED, R.FAILED}),
    # P's word may be that its WRITE did land (every rank done): the bytes are there
    R.HOLDING: frozenset({R.FINISHED, R.FAILED}),
}


def push_hold_bound(lease: float, transfer_timeout: float, settle: float) -> float:
    """How long D holds a given-up push's terminal event when P never answers: P claims
    no lease after it lapsed (`lease` after our last heartbeat: held requests are not
    heartbeated), posts a claimed WRITE within its post fence (`transfer_timeout`, else
    it fails unposted), and its adapter ends or reports it within `transfer_timeout + 2 x
    settle + 1 s` (the Unsettled bound); 1 s margin. P computes it from its own settings
    and says it in its handshake (`Handshake.write_bound`); D's own is used where P did not
    say (and for D's own READs)."""
    return lease + 2 * transfer_timeout + 2 * settle + 2.0


# ------------------------------------------------------------------ events


@dataclass(frozen=True, slots=True)
class Track:
    """D's engine got a request whose KV is at P: heartbeat P for it from now on."""

    request_id: str
    session: str
    engine_id: str
    host: str
    port: int
    hb_id: str
    """The id P knows it by (P's id when given, else ours)."""


@dataclass(frozen=True, slots=True)
class Load:
    """D's engine registered blocks for a push, or asks to pull (validated blocks)."""

    request_id: str
    session: str
    engine_id: str
    mode: str
    """"push" or "pull"."""
    block_ids: tuple[int, ...]
    host: str
    port: int
    remote_engine_id: str
    remote_request_id: str
    remote_block_ids: tuple[int, ...]
    remote_incarnation: int
    remote_session: str
    num_tokens: int = 0
    """The request's token count (`wire.RegisterPush.num_tokens`; 0 = not said)."""

    @property
    def hb_id(self) -> str:
        return self.remote_request_id or self.request_id

    @property
    def peer(self) -> str:
        return f"{self.host}:{self.port}"


@dataclass(frozen=True, slots=True)
class AbortRecv:
    request_id: str
    session: str


@dataclass(frozen=True, slots=True)
class EndSession:
    session: str


@dataclass(frozen=True, slots=True)
class StartDrain:
    """The daemon goes out of service: take no new transfer, finish what runs (answered
    by `Drained` once nothing is left; again at every later StartDrain)."""


@dataclass(frozen=True, slots=True)
class ForceAbort:
    """The operator ends the request by hand (`kvd abort`), whichever session owns it.
    Raises NotFound when no live request has this id."""

    request_id: str


@dataclass(frozen=True, slots=True)
class PeerResolved:
    """The answer to `Resolve`: P's daemon and its regions for the request.

    `first` is the message that starts the transfer (the PushRegistration, or for a pull
    the PullDone to send after the READ); `view` what `PostRead` needs."""

    request_id: str
    agent: str
    since: float
    """When the view was handshaked (a PeerLost about an older view spares it)."""
    ranks: int
    """PushDones that complete a push: one per NIXL transfer P posts (all rank pairs of
    the request in one per pair of memory types; `kvd.actors.transfers.transfer_groups`)."""
    first: wire.Record
    view: object = None
    layers: int = 0
    """Layers of our regions (what a layer-wise push must cover per rank)."""
    incarnation: int = 0
    """P daemon's incarnation (a `CheckGone` that meets another one proves it gone)."""
    write_bound: float = 0.0
    """P's handshake: how long after its lease lapsed a WRITE of P's may still land (a
    held push waits at most this long for P's word; 0: P did not say, our own bound)."""
    by_write: bool = False
    """A pull that P serves by WRITE (`kvd.core.readpath`: UCX would emulate our READ):
    `first` is a PushRegistration naming P's blocks, and the request goes as a push."""


@dataclass(frozen=True, slots=True)
class PeerUnresolved:
    """`Resolve` failed. `agent` is set when P was reached but refused (compat, a restarted
    daemon): it may hold a lease, so it is told."""

    request_id: str
    error: KvdError
    agent: str = ""


@dataclass(frozen=True, slots=True)
class Sent:
    """A `SendFor` notification went out."""

    request_id: str


@dataclass(frozen=True, slots=True)
class SendFailed:
    """A `SendFor` notification could not be sent. `stale`: our view of the peer was dead,
    or already dropped, when posting (it died, maybe restarted, while we were idle): one
    fresh handshake may mend it."""

    request_id: str
    error: KvdError
    stale: bool = False


@dataclass(frozen=True, slots=True)
class ReadDone:
    """The answer to `PostRead` (`stale` as in SendFailed)."""

    request_id: str
    error: KvdError | None = None
    stale: bool = False
    unsettled: bool = False
    """The READ is still in flight in UCX past its bound (`Unsettled`): it may still write
    into D's blocks, so the request is held until `ReadSettled`."""


@dataclass(frozen=True, slots=True)
class ReadSettled:
    """A READ answered Unsettled (`ReadDone.unsettled`) has ended in UCX at last: nothing
    more of it can land in D's blocks."""

    request_id: str


@dataclass(frozen=True, slots=True)
class PeerGone:
    """The P daemon `agent` named is provably gone (its side channel refused the
    connection, or another incarnation answers there): nothing of it can write any more."""

    agent: str
    reason: str


@dataclass(frozen=True, slots=True)
class PushDoneArrived:
    agent: str
    msg: wire.PushDone


@dataclass(frozen=True, slots=True)
class LayersPushedArrived:
    agent: str
    msg: wire.LayersPushed


@dataclass(frozen=True, slots=True)
class PullAckArrived:
    agent: str
    msg: wire.PullAck


@dataclass(frozen=True, slots=True)
class ResyncArrived:
    agent: str
    nonce: int


@dataclass(frozen=True, slots=True)
class PeerLost:
    """`agent` is gone (as seen through the view handshaked at `since`)."""

    agent: str
    reason: str
    since: float = float("inf")


@dataclass(frozen=True, slots=True)
class PeerKnown:
    """A handshake taught us the lease of the P at `peer` (host:port)."""

    peer: str
    lease_duration: float


@dataclass(frozen=True, slots=True)
class PeerReached:
    """A heartbeat or probe to `peer` went out."""

    peer: str


@dataclass(frozen=True, slots=True)
class PeerUnreachable:
    """A heartbeat or probe to `peer` failed. `refused`: its handshake was refused in a way
    retrying cannot mend (another secret, version or model)."""

    peer: str
    error: KvdError
    refused: bool


Event = (
    Track
    | Load
    | AbortRecv
    | EndSession
    | StartDrain
    | ForceAbort
    | PeerResolved
    | PeerUnresolved
    | Sent
    | SendFailed
    | ReadDone
    | ReadSettled
    | PeerGone
    | PushDoneArrived
    | LayersPushedArrived
    | PullAckArrived
    | ResyncArrived
    | PeerLost
    | PeerKnown
    | PeerReached
    | PeerUnreachable
)


# ------------------------------------------------------------------ effects


@dataclass(frozen=True, slots=True)
class Resolve:
    """Handshake with P if need be and check it can serve `load` (incarnation, ranks,
    compat); answer with PeerResolved or PeerUnresolved."""

    load: Load
    refresh: bool


@dataclass(frozen=True, slots=True)
class SendFor:
    """A notification the request depends on; a failure comes back as `SendFailed`."""

    request_id: str
    agent: str
    record: wire.Record


@dataclass(frozen=True, slots=True)
class PostRead:
    """READ P's blocks into ours through `view`; answer with `ReadDone`."""

    request_id: str
    agent: str
    view: object


@dataclass(frozen=True, slots=True)
class Beat:
    """One heartbeat to the P at `peer` naming these ids (P's ids); answer with
    PeerReached / PeerUnreachable."""

    peer: str
    hb_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class ProbePeer:
    """Check the P at `peer` is alive (a notification round trip's first half)."""

    peer: str


@dataclass(frozen=True, slots=True)
class CancelAt:
    """Tell the P at `peer` (handshaking first if need be) that nothing will take `hb_id`."""

    peer: str
    hb_id: str


@dataclass(frozen=True, slots=True)
class CheckGone:
    """Find out whether the P daemon `agent` (at `peer`) is provably gone (answer with
    `PeerGone`, or nothing) and, if it answers as itself, tell it the cancel again."""

    peer: str
    agent: str
    hb_ids: tuple[str, ...]
    """The held requests' ids at P (told the cancel again if P answers as itself)."""
    incarnation: int = 0
    """The incarnation of P the requests were registered with (0: unknown)."""


Effect = (
    Emit
    | Notify
    | SessionEnded
    | Log
    | Refused
    | Resolve
    | SendFor
    | PostRead
    | Beat
    | ProbePeer
    | CancelAt
    | CheckGone
    | Drained
)


# ------------------------------------------------------------------ state


@dataclass(slots=True)
class RecvRequest:
    request_id: str
    state: RecvState
    session: str
    engine_id: str
    peer: str
    hb_id: str
    started: float
    load: Load | None = None
    agent: str = ""
    since: float = 0.0
    ranks: int = 0
    done_ranks: set[int] = field(default_factory=set)
    layers: int = 0
    layer_bits: dict[int, int] = field(default_factory=dict)
    """Rank -> bit set of the layers a layer-wise push delivered so far."""
    first: wire.Record | None = None
    view: object = None
    refreshed: bool = False
    aborted: bool = False
    abort_reason: str = "aborted by the client"
    cost: int = 0
    """Estimated bytes charged to the pending budget while it is live."""
    held: KvdError | None = None
    """HOLDING: the failure its terminal event will carry."""
    resend_gap: float = 0.0
    """REGISTERED: the wait before the next repeat of the registration."""
    write_bound: float = 0.0
    """P's, from its handshake (0: not said): see `PeerResolved.write_bound`."""
    incarnation: int = 0
    by_write: bool = False
    """A pull that P serves by WRITE (`PeerResolved.by_write`)."""

    @property
    def mode(self) -> str:
        return self.load.mode if self.load is not None else ""

    @property
    def written(self) -> bool:
        """P WRITEs into our blocks: a push, or a pull served by WRITE (the push's states,
        answers and holds apply); otherwise we READ."""
        return self.mode == "push" or self.by_write

    @property
    def blocks(self) -> tuple[int, ...]:
        return self.load.block_ids if self.load is not None else ()


@dataclass
class Receiver:
    """Every request D's daemon receives (see the module docstring)."""

    lease_duration: float
    """Our own lease setting: the heartbeat period (lease/6) until a handshake teaches us
    P's, and how long an unreachable P is tried."""
    probe_interval: float
    push_registration_timeout: float
    transfer_timeout: float
    pending_bytes: int = 256 << 20
    """Bound of the estimated bytes of live requests (`kvd.core.limits`)."""
    counters: dict[str, int] = field(default_factory=dict)
    hold_bound: float = 0.0
    """HOLDING at most this long (0: `push_hold_bound` of our lease and transfer timeout,
    the settle bound taken equal to the transfer timeout, as the daemon sets it)."""

    def __post_init__(self) -> None:
        if self.hold_bound <= 0:
            t = self.transfer_timeout
            self.hold_bound = push_hold_bound(self.lease_duration, t, t)
        self.budget = PendingBudget(self.pending_bytes)
        self.reqs: dict[str, RecvRequest] = {}
        self._states: Counter[RecvState] = Counter()
        self.heartbeats = HeartbeatSchedule()
        self.intervals: dict[str, float] = {}
        """Peer (host:port) -> heartbeat period learned from its lease."""
        self.probes: TimerHeap[str] = TimerHeap()
        self.watchdogs: TimerHeap[str] = TimerHeap()
        self.resends: TimerHeap[str] = TimerHeap()
        """Registered pushes without any answer from P yet: the registration again then."""
        self.rechecks: TimerHeap[str] = TimerHeap()
        """Peers (host:port) with held pushes: `CheckGone` again every probe interval (a
        cut link that comes back lets the cancel through; P's answer releases them)."""
        self._held_by_hb: dict[tuple[str, str], str] = {}
        """(P's agent, id at P) -> our id, of held pushes: P may answer a cancel for a
        request it no longer knows by the id the cancel named."""
        self.failing_since: dict[str, float] = {}
        self.ended: OrderedDict[str, None] = OrderedDict()
        self.closing: set[str] = set()
        self.draining_since: float | None = None
        """Daemon time the drain started (None: not draining)."""
        self._out: list[Effect] = []

    # ---------------------------------------------------------------- the interface

    def handle(self, event: Event, now: float) -> list[Effect]:
        """Feed one event; returns the effects to carry out, in order.

        Raises InvalidRequest for a client request the protocol refuses (the actor answers
        it with the error); the machine is unchanged then.
        """
        self._out = []
        _HANDLERS[type(event)](self, event, now)
        out, self._out = self._out, []
        return out

    def handle_timer(self, now: float) -> list[Effect]:
        """Heartbeats and probes that are due, and watchdogs that fired."""
        self._out = []
        for rid, _ in self.watchdogs.pop_due(now):
            req = self.reqs.get(rid)
            if req is not None:
                self._watchdog(req, now)
        for peer, rids in self.heartbeats.due(now).items():
            ids = tuple(self.reqs[r].hb_id for r in rids if r in self.reqs)
            for i in range(0, len(ids), MAX_HB_IDS):
                self._out.append(Beat(peer, ids[i : i + MAX_HB_IDS]))
        for peer, _ in self.probes.pop_due(now):
            if self.heartbeats.requests_of(peer):
                self._out.append(ProbePeer(peer))
                self.probes.set(peer, now + self.probe_interval)
        for peer, _ in self.rechecks.pop_due(now):
            self._recheck(peer, now)
        for rid, _ in self.resends.pop_due(now):
            req = self.reqs.get(rid)
            if req is not None and req.state is R.REGISTERED and req.first is not None:
                self._count("registrations_resent")
                self._out.append(SendFor(req.request_id, req.agent, req.first))
                self._resend_later(req, now)
        out, self._out = self._out, []
        return out

    def next_deadline(self) -> float | None:
        times = [
            t
            for t in (
                self.watchdogs.next_time(),
                self.heartbeats.next_deadline(),
                self.probes.next_time(),
                self.rechecks.next_time(),
                self.resends.next_time(),
            )
            if t is not None
        ]
        return min(times) if times else None

    # ---------------------------------------------------------------- bookkeeping

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def _log(self, level: str, event: str, **fields: Any) -> None:
        self._out.append(Log(level, event, fields))

    def _goto(self, req: RecvRequest, state: RecvState) -> None:
        if state not in TRANSITIONS.get(req.state, frozenset()):
            raise LocalProtocolError(
                f"recv {req.request_id!r}: no transition {req.state} -> {state}"
            )
        if self.reqs.get(req.request_id) is req:
            self._states[req.state] -= 1
            self._states[state] += 1
        if req.state is R.REGISTERED:
            self.resends.discard(req.request_id)  # repeated only while registered
        req.state = state

    def _put(self, req: RecvRequest) -> None:
        self.reqs[req.request_id] = req
        self._states[req.state] += 1

    def _beat(self, req: RecvRequest, now: float) -> None:
        interval = self.intervals.get(req.peer, max(self.lease_duration / 6.0, 0.01))
        self.heartbeats.track(req.request_id, req.peer, now, interval)
        if req.peer not in self.probes:
            self.probes.set(req.peer, now + self.probe_interval)

    def _forget_if_idle(self, peer: str) -> None:
        """Nothing outstanding at `peer` any more: no probe, and its failure streak ends (a
        later request's first failed beat must not be blamed for the idle time)."""
        if not self.heartbeats.requests_of(peer):
            self.probes.discard(peer)
            self.failing_since.pop(peer, None)

    def _end(self, req: RecvRequest, state: RecvState) -> None:
        self._goto(req, state)
        del self.reqs[req.request_id]
        self._states[state] -= 1
        self.budget.give(req.cost)
        req.cost = 0
        self.heartbeats.untrack(req.request_id)
        self._forget_if_idle(req.peer)
        self.watchdogs.discard(req.request_id)
        self.resends.discard(req.request_id)
        if self._held_by_hb.get((req.agent, req.hb_id)) == req.request_id:
            del self._held_by_hb[(req.agent, req.hb_id)]
            if not any(
                r.state is R.HOLDING and r.written and r.peer == req.peer
                for r in self.reqs.values()
            ):
                self.rechecks.discard(req.peer)
        # (a dropped track too, and by P's id: P may answer a cancel by the id it named)
        self.ended[req.request_id] = None
        self.ended[req.hb_id] = None
        while len(self.ended) > ENDED:
            self.ended.popitem(last=False)
        if req.session in self.closing:
            self._maybe_session_ended(req.session)
        if self.draining_since is not None and not self.reqs:
            self._out.append(Drained())

    def _finish(self, req: RecvRequest, now: float) -> None:
        if req.aborted:
            self._fail(req, _aborted(req.abort_reason), now)
            return
        self._count("recv_ok")
        self._out.append(Emit(req.session, req.engine_id, wire.RecvFinished(req.request_id)))
        self._log(
            "debug",
            "recv_finished",
            request_id=req.request_id,
            peer=req.agent,
            seconds=round(now - req.started, 6),
        )
        self._end(req, R.FINISHED)

    def _fail(self, req: RecvRequest, exc: KvdError, now: float) -> None:
        """End the request failed (its blocks to recompute). If P never heard its fate, tell
        P to free the blocks now rather than after a whole lease."""
        if req.agent and req.state in (R.HANDSHAKING, R.READING):
            self._out.append(Notify(req.agent, wire.CancelRegistration(req.hb_id)))
        self._count("recv_failed")
        ev = wire.RecvFailed(req.request_id, int(exc.code), exc.message[:1000], req.blocks)
        self._out.append(Emit(req.session, req.engine_id, ev))
        self._log(
            "info", "recv_failed", request_id=req.request_id, peer=req.agent, error=exc.message
        )
        self._end(req, R.FAILED)

    def _maybe_session_ended(self, session: str) -> None:
        if session not in self.closing or any(r.session == session for r in self.reqs.values()):
            return
        self.closing.discard(session)
        self._out.append(SessionEnded(session))

    def _reject(self, agent: str, why: str) -> None:
        self._count("notifs_rejected")
        self._log("warning", "notif_rejected", peer=agent, reason=why)

    # ---------------------------------------------------------------- D's engine

    def _on_track(self, ev: Track, now: float) -> None:
        if ev.request_id in self.reqs:
            return  # tracked already (or loading): nothing to add
        if self.draining_since is not None:
            self._count("tracks_ignored_draining")  # its registration or pull will fail
            return
        cost = record_cost(ev)
        if not self.budget.take(cost):
            self._count("limit_pending_bytes_refused")
            raise Busy(self.budget.why(cost, "tracking a request"))
        req = RecvRequest(
            ev.request_id,
            R.TRACKED,
            ev.session,
            ev.engine_id,
            f"{ev.host}:{ev.port}",
            ev.hb_id,
            now,
        )
        req.cost = cost
        self._put(req)
        self._beat(req, now)

    def _on_load(self, ev: Load, now: float) -> None:
        req = self.reqs.get(ev.request_id)
        if req is not None and req.state is not R.TRACKED:
            raise InvalidRequest(f"request {ev.request_id!r} is already receiving")
        if req is not None and req.session != ev.session:
            raise InvalidRequest(f"request {ev.request_id!r} is tracked by another session")
        if self.draining_since is not None:
            self._refuse_load_draining(req, ev)
            return
        self._count(f"{ev.mode}_requests")
        cost = record_cost(ev)
        if not self.budget.take(cost, req.cost if req is not None else 0):
            self._refuse_load(ev, req, self.budget.why(cost, f"a {ev.mode}"), now)
            return
        old_peer = ""
        if req is None:
            req = RecvRequest(
                ev.request_id, R.TRACKED, ev.session, ev.engine_id, ev.peer, ev.hb_id, now
            )
            self._put(req)
        elif req.peer != ev.peer or req.hb_id != ev.hb_id:
            self.heartbeats.untrack(req.request_id)
            old_peer, req.peer, req.hb_id = req.peer, ev.peer, ev.hb_id
        req.cost = cost
        req.load, req.engine_id, req.started = ev, ev.engine_id, now
        self._beat(req, now)
        if old_peer:
            self._forget_if_idle(old_peer)
        self._goto(req, R.HANDSHAKING)
        self._out.append(Resolve(ev, refresh=False))

    def _refuse_load_draining(self, req: RecvRequest | None, ev: Load) -> None:
        """No new transfer while draining: the engine gets its failure now (the blocks to
        recompute) and P is told, so it frees any lease at once."""
        self._count("loads_refused_draining")
        self._count("recv_failed")
        self._log("info", "load_refused_draining", request_id=ev.request_id, peer=ev.peer)
        if req is not None:
            self._end(req, R.DROPPED)  # only tracked: the failure below is its end
        self._out.append(CancelAt(ev.peer, ev.hb_id))
        exc = ShuttingDown(_DRAINING)
        rec = wire.RecvFailed(ev.request_id, int(exc.code), exc.message, ev.block_ids)
        self._out.append(Emit(ev.session, ev.engine_id, rec))

    def _on_start_drain(self, ev: StartDrain, now: float) -> None:
        if self.draining_since is None:
            self.draining_since = now
            self._log("info", "drain_started", live=len(self.reqs))
            for req in [r for r in self.reqs.values() if r.state is R.TRACKED]:
                self._count("tracks_dropped_draining")
                self._drop_tracked(req, now)
        if not self.reqs and Drained() not in self._out:  # (the last one's end said so)
            self._out.append(Drained())

    def _on_force_abort(self, ev: ForceAbort, now: float) -> None:
        req = self.reqs.get(ev.request_id)
        if req is None:
            raise NotFound(f"no request {ev.request_id!r} is being received (D side)")
        self._count("operator_aborts")
        self._log(
            "warning",
            "aborted_by_operator",
            request_id=req.request_id,
            peer=req.agent,
            state=req.state.value,
        )
        if not req.aborted:
            req.abort_reason = "aborted by the operator (kvd abort) on D"
        self._abort(req, now)

    def _refuse_load(self, ev: Load, tracked: RecvRequest | None, why: str, now: float) -> None:
        """No room for it: the request ends failed at once, and P (which may hold a lease
        on its blocks) is told to free them."""
        self._out.append(
            Refused(
                "limit_pending_bytes_refused",
                "load_refused",
                "pending_bytes",
                {"request_id": ev.request_id, "reason": why},
            )
        )
        if tracked is not None:
            self._drop_tracked(tracked, now)
        else:
            self._out.append(CancelAt(ev.peer, ev.hb_id))
        fail = wire.RecvFailed(ev.request_id, int(ErrorCode.BUSY), why, ev.block_ids)
        self._out.append(Emit(ev.session, ev.engine_id, fail))

    def limits(self) -> dict[str, dict[str, int]]:
        """Its limit, its use and refusals (for `kvd status`)."""
        b = self.budget
        used = {"limit": b.limit, "used": b.used, "peak": b.peak, "refused": b.refused}
        return {"pending_bytes": used}

    def _on_abort(self, ev: AbortRecv, now: float) -> None:
        req = self.reqs.get(ev.request_id)
        if req is None or req.session != ev.session:
            return  # not ours, or ended already
        self._abort(req, now)

    def _abort(self, req: RecvRequest, now: float) -> None:
        """The terminal event waits until nothing can still write into D's blocks."""
        if req.aborted:
            return
        req.aborted = True
        self._count("aborted")
        handler = _ON_ABORT.get(req.state)
        if handler is not None:
            handler(self, req, now)

    def _abort_held(self, req: RecvRequest, now: float) -> None:
        req.held = _aborted(req.abort_reason)  # it still waits for its blocks to be safe

    def _drop_tracked(self, req: RecvRequest, now: float) -> None:
        """Only tracked: stop heartbeating, and tell P it can free the blocks now."""
        self._count("tracks_cancelled")
        self._out.append(CancelAt(req.peer, req.hb_id))
        self._end(req, R.DROPPED)

    def _cancel_registered(self, req: RecvRequest, now: float) -> None:
        self._goto(req, R.CANCELLING)
        self._out.append(SendFor(req.request_id, req.agent, wire.CancelRegistration(req.hb_id)))
        # P answers with PushDone (failed, or ok if its WRITE already ran); bounded
        due = min(
            self.watchdogs.get(req.request_id) or float("inf"),
            now + min(self.transfer_timeout, 10.0),
        )
        self.watchdogs.set(req.request_id, due)

    def _hold(self, req: RecvRequest, exc: KvdError, now: float) -> None:
        """Give up on the request while something may still write into D's blocks: the
        terminal event (with `exc`) waits for P's word, P proven gone, the READ settled, or
        `hold_bound`. P is told (again) and no longer heartbeated, so its lease lapses."""
        self._goto(req, R.HOLDING)
        req.held = exc
        self._count("holds")
        self.heartbeats.untrack(req.request_id)
        self._forget_if_idle(req.peer)
        bound = self._bound_of(req)
        self.watchdogs.set(req.request_id, now + bound)
        self._log(
            "warning",
            "recv_held",
            request_id=req.request_id,
            peer=req.agent,
            mode=req.mode,
            error=exc.message,
            bound_s=round(bound, 3),
        )
        self._out.append(Notify(req.agent, wire.CancelRegistration(req.hb_id)))
        if req.written:
            self._out.append(CheckGone(req.peer, req.agent, (req.hb_id,), req.incarnation))
            self._held_by_hb[(req.agent, req.hb_id)] = req.request_id
            if req.peer not in self.rechecks:  # asked again until P answers or is gone
                self.rechecks.set(req.peer, now + self.probe_interval)

    def _bound_of(self, req: RecvRequest) -> float:
        """How long `req` may be held: a push, by P's own settings when its handshake said
        them (P's WRITEs are what may still land); a READ, by ours."""
        if req.written and req.write_bound > 0:
            return req.write_bound
        return self.hold_bound

    def _recheck(self, peer: str, now: float) -> None:
        groups: dict[tuple[str, int], list[str]] = {}
        for r in self.reqs.values():
            if r.state is R.HOLDING and r.written and r.peer == peer:
                groups.setdefault((r.agent, r.incarnation), []).append(r.hb_id)
        for (agent, inc), ids in groups.items():
            self._out.append(CheckGone(peer, agent, tuple(ids), inc))
        if groups:
            self.rechecks.set(peer, now + self.probe_interval)

    def _release(self, req: RecvRequest, why: str, now: float) -> None:
        """HOLDING ends: nothing can write into D's blocks any more (or the bound passed)."""
        assert req.held is not None
        self._count(why)
        self._fail(req, req.held, now)

    def _on_end_session(self, ev: EndSession, now: float) -> None:
        self.closing.add(ev.session)
        for req in [r for r in self.reqs.values() if r.session == ev.session]:
            self._abort(req, now)
        self._maybe_session_ended(ev.session)

    # ---------------------------------------------------------------- resolution

    def _on_resolved(self, ev: PeerResolved, now: float) -> None:
        req = self.reqs.get(ev.request_id)
        if req is None or req.state is not R.HANDSHAKING:
            return
        req.agent, req.since, req.ranks, req.layers = ev.agent, ev.since, ev.ranks, ev.layers
        req.first, req.view, req.incarnation = ev.first, ev.view, ev.incarnation
        req.write_bound = min(ev.write_bound, MAX_WRITE_BOUND)
        req.by_write = ev.by_write and req.mode == "pull"
        if req.written:
            if req.aborted:
                self._fail(
                    req, _aborted(req.abort_reason), now
                )  # cancels at P: it may hold a lease
                return
            self._goto(req, R.REGISTERING)
            self._out.append(SendFor(req.request_id, req.agent, ev.first))
            return
        assert req.load is not None
        if req.load.block_ids and not req.aborted:
            self._goto(req, R.READING)
            self._out.append(PostRead(req.request_id, req.agent, ev.view))
        else:
            self._ack(req, now)  # nothing to read (a local hit, or aborted): P frees now

    def _on_unresolved(self, ev: PeerUnresolved, now: float) -> None:
        req = self.reqs.get(ev.request_id)
        if req is None or req.state is not R.HANDSHAKING:
            return
        req.agent = ev.agent
        self._fail(req, _aborted(req.abort_reason) if req.aborted else ev.error, now)

    def _ack(self, req: RecvRequest, now: float) -> None:
        assert req.first is not None
        self._goto(req, R.ACKING)
        self._out.append(SendFor(req.request_id, req.agent, req.first))
        self.watchdogs.set(req.request_id, now + self.transfer_timeout)

    def _on_sent(self, ev: Sent, now: float) -> None:
        req = self.reqs.get(ev.request_id)
        if req is None or req.state is not R.REGISTERING:
            return  # a PullDone or a cancel went out: its answer decides
        self._goto(req, R.REGISTERED)
        self.watchdogs.set(req.request_id, now + self.push_registration_timeout)
        req.resend_gap = self.intervals.get(req.peer, max(self.lease_duration / 6.0, 0.01))
        if not req.layer_bits and not req.done_ranks:  # (P may have answered already)
            self._resend_later(req, now)
        if req.aborted:
            self._cancel_registered(req, now)

    def _resend_later(self, req: RecvRequest, now: float) -> None:
        self.resends.set(req.request_id, now + req.resend_gap)
        lease = self.intervals.get(req.peer, self.lease_duration / 6.0) * 6.0
        req.resend_gap = min(2 * req.resend_gap, max(lease / 2, req.resend_gap))

    def _on_send_failed(self, ev: SendFailed, now: float) -> None:
        req = self.reqs.get(ev.request_id)
        if req is None:
            return
        if req.state is R.REGISTERING and ev.stale and not req.refreshed and not req.aborted:
            self._rehandshake(req, ev.error, now)
        elif req.state is R.CANCELLING:  # P may be alive all the same (a cut link)
            self._hold(
                req, _aborted(f"{req.abort_reason}; cancel not delivered: {ev.error.message}"), now
            )
        elif req.state is R.REGISTERING:
            self._fail(req, _aborted(req.abort_reason) if req.aborted else ev.error, now)
        elif req.state is R.ACKING:
            self._fail(req, ev.error, now)

    def _rehandshake(self, req: RecvRequest, exc: KvdError, now: float) -> None:
        """Our cached view of P was dead (it died, maybe restarted, while we were idle):
        handshake afresh, once."""
        assert req.load is not None
        self._count("peer_rehandshakes")
        self._log(
            "info",
            "peer_gone_rehandshake",
            request_id=req.request_id,
            peer=req.agent,
            error=exc.message,
        )
        req.refreshed = True
        self.watchdogs.discard(req.request_id)
        self._goto(req, R.HANDSHAKING)
        self._out.append(Resolve(req.load, refresh=True))

    def _on_read_done(self, ev: ReadDone, now: float) -> None:
        req = self.reqs.get(ev.request_id)
        if req is None or req.state is not R.READING:
            raise LocalProtocolError(f"ReadDone for {ev.request_id!r}, which is not reading")
        if ev.error is None:
            self._ack(req, now)
        elif ev.unsettled:
            self._hold(req, _aborted(req.abort_reason) if req.aborted else ev.error, now)
        elif ev.stale and not req.refreshed and not req.aborted:
            self._rehandshake(req, ev.error, now)
        else:
            self._fail(req, _aborted(req.abort_reason) if req.aborted else ev.error, now)

    def _on_read_settled(self, ev: ReadSettled, now: float) -> None:
        req = self.reqs.get(ev.request_id)
        if req is not None and req.state is R.HOLDING and not req.written:
            self._release(req, "holds_released_settled", now)

    # ---------------------------------------------------------------- P's answers

    def _on_push_done(self, ev: PushDoneArrived, now: float) -> None:
        msg = ev.msg
        req = self.reqs.get(msg.request_id)
        if req is None or req.agent != ev.agent:
            held = self._held_by_hb.get((ev.agent, msg.request_id))
            if held is not None and not msg.ok:  # P's answer to a cancel, by P's id
                req = self.reqs[held]
        if req is None or req.agent != ev.agent or not req.written:
            self._unknown_answer(ev.agent, msg.request_id, "push completion")
            return
        handler = _ON.get((req.state, PushDoneArrived))
        if handler is None:
            self._reject(ev.agent, f"push completion while {req.state.value}")
            return
        handler(self, req, ev, now)

    def _pushed(self, req: RecvRequest, ev: PushDoneArrived, now: float) -> None:
        msg = ev.msg
        if not msg.ok:
            if req.state is R.HOLDING:
                self._release(req, "holds_released_by_p", now)  # P's WRITE ended (or none)
                return
            exc = (
                _aborted(req.abort_reason) if req.aborted else error_from_code(msg.code, msg.reason)
            )
            self._fail(req, exc, now)
        elif msg.tp_rank >= req.ranks:
            self._reject(ev.agent, f"push completion for rank {msg.tp_rank} of {req.ranks}")
        else:
            self._rank_done(req, msg.tp_rank, now)

    def _on_layers_pushed(self, ev: LayersPushedArrived, now: float) -> None:
        rank = ev.msg.tp_rank
        for rng in ev.msg.ranges:
            req = self.reqs.get(rng.request_id)
            if req is None or req.agent != ev.agent or req.mode != "push":
                self._unknown_answer(ev.agent, rng.request_id, "layers pushed")
                continue
            if _ON.get((req.state, PushDoneArrived)) is None:
                self._reject(ev.agent, f"layers pushed while {req.state.value}")
                continue
            if rank >= req.ranks or not 0 <= rng.first < rng.end <= req.layers:
                self._reject(
                    ev.agent,
                    f"layers [{rng.first}, {rng.end}) of rank {rank}: we have {req.ranks} "
                    f"ranks of {req.layers} layers",
                )
                continue
            bits = (1 << rng.end) - (1 << rng.first)
            have = req.layer_bits.get(rank, 0)
            if have & bits:
                self._reject(ev.agent, f"layers [{rng.first}, {rng.end}) of rank {rank} again")
                continue
            have |= bits
            req.layer_bits[rank] = have
            self.resends.discard(req.request_id)  # P has the registration
            if have == (1 << req.layers) - 1:
                self._rank_done(req, rank, now)

    def _rank_done(self, req: RecvRequest, rank: int, now: float) -> None:
        req.done_ranks.add(rank)
        self.resends.discard(req.request_id)  # P has the registration
        if len(req.done_ranks) == req.ranks:
            if req.state is R.HOLDING:
                self._count("holds_released_by_p")  # its WRITEs did land: the bytes are there
            self._finish(req, now)

    def _on_pull_ack(self, ev: PullAckArrived, now: float) -> None:
        msg = ev.msg
        req = self.reqs.get(msg.d_request_id)
        if req is None or req.agent != ev.agent or req.state is not R.ACKING:
            self._unknown_answer(ev.agent, msg.d_request_id, "pull ack")
            return
        if msg.ok:
            self._finish(req, now)
        else:
            self._fail(
                req,
                _aborted(req.abort_reason)
                if req.aborted
                else error_from_code(msg.code, msg.reason),
                now,
            )

    def _unknown_answer(self, agent: str, rid: str, what: str) -> None:
        if rid in self.ended:
            self._count("late_answers")  # the request ended first (watchdog, abort)
            return
        self._reject(agent, f"{what} for unknown request {rid!r}")

    def _on_resync(self, ev: ResyncArrived, now: float) -> None:
        # every cancel we decided so far is already ahead of this in the queue to P
        self._out.append(Notify(ev.agent, wire.ResyncAck(ev.nonce)))

    # ---------------------------------------------------------------- peers

    def _on_peer_lost(self, ev: PeerLost, now: float) -> None:
        """Give up on what waits on `agent` as seen through views up to `since`. A READ in
        flight ends by itself (it writes into D's blocks: it must return first); a push
        registered at P is held (P's WRITE may still be in flight: losing P is not proof
        that it is gone)."""
        exc = TransferError(f"peer {ev.agent} lost: {ev.reason}")
        for req in list(self.reqs.values()):
            if req.agent != ev.agent or req.since > ev.since:
                continue
            if req.state in (R.REGISTERED, R.CANCELLING):
                self._hold(req, _aborted(req.abort_reason) if req.aborted else exc, now)
            elif req.state is R.ACKING:
                self._fail(req, exc, now)

    def _on_peer_gone(self, ev: PeerGone, now: float) -> None:
        """The P daemon is provably gone: nothing of it can WRITE any more. What waits on it
        ends at once (held pushes included)."""
        exc = TransferError(f"peer {ev.agent} gone: {ev.reason}")
        for req in list(self.reqs.values()):
            if req.agent != ev.agent:
                continue
            if req.state is R.HOLDING and req.written:
                self._release(req, "holds_released_gone", now)
            elif req.state in (R.REGISTERED, R.CANCELLING, R.ACKING):
                self._fail(req, _aborted(req.abort_reason) if req.aborted else exc, now)

    def _on_peer_known(self, ev: PeerKnown, now: float) -> None:
        interval = max(ev.lease_duration / 6.0, 0.01)
        self.intervals[ev.peer] = interval
        self.heartbeats.set_interval(ev.peer, interval, now)

    def _on_peer_reached(self, ev: PeerReached, now: float) -> None:
        self.failing_since.pop(ev.peer, None)

    def _on_peer_unreachable(self, ev: PeerUnreachable, now: float) -> None:
        self._count("peer_failures")
        if not self.heartbeats.requests_of(ev.peer):
            return  # a beat for requests that ended since: nothing left to give up on
        first = self.failing_since.setdefault(ev.peer, now)
        if first == now:
            self._log("warning", "peer_unreachable", peer=ev.peer, error=ev.error.message)
        if ev.refused or now - first >= self.lease_duration:
            # The handshake cannot succeed, or has not for a whole lease (any lease P
            # granted is gone): stop beating instead of retrying forever. A request that
            # registers or pulls later fails through its own handshake.
            self.failing_since.pop(ev.peer, None)
            dropped = [
                self.reqs[r]
                for r in self.heartbeats.requests_of(ev.peer)
                if self.reqs[r].state is R.TRACKED
            ]
            for req in dropped:
                self._end(req, R.DROPPED)
            self.probes.discard(ev.peer)
            self._count("peers_given_up")
            self._count("tracks_dropped", len(dropped))
            self._log(
                "warning",
                "peer_given_up",
                peer=ev.peer,
                tracks_dropped=len(dropped),
                error=ev.error.message,
            )

    # ---------------------------------------------------------------- time

    def _watchdog(self, req: RecvRequest, now: float) -> None:
        if req.state is R.REGISTERED:
            self._count("registration_timeouts")
            self._log(
                "warning", "push_registration_timed_out", request_id=req.request_id, peer=req.agent
            )
            # P must not WRITE into these blocks later: withdraw the registration there
            # (by `_hold`), and hold them until P's word: its WRITE may be in flight
            why = f"no push completion within {self.push_registration_timeout}s"
            self._hold(req, _aborted(req.abort_reason) if req.aborted else Timeout(why), now)
        elif req.state is R.ACKING:
            self._fail(req, Timeout("P did not acknowledge the pull in time"), now)
        elif req.state is R.CANCELLING:
            self._hold(req, _aborted(f"{req.abort_reason}; P did not answer the cancel"), now)
        elif req.state is R.HOLDING:
            self._log(
                "error",
                "recv_hold_expired",
                request_id=req.request_id,
                peer=req.agent,
                mode=req.mode,
                bound_s=round(self._bound_of(req), 3),
            )
            self._release(req, "holds_expired", now)

    # ---------------------------------------------------------------- views

    def by_state(self) -> dict[str, int]:
        """Live requests per state (kept as they move: O(states), not O(requests))."""
        return {s.value: self._states[s] for s in R if s not in TERMINAL}


_DRAINING: Final = "D's kvd daemon is draining (going out of service): it takes no new transfers"


def _aborted(reason: str) -> KvdError:
    return TransferError(reason)


_HANDLERS: Final[dict[type, Callable[[Receiver, Any, float], None]]] = {
    Track: Receiver._on_track,
    Load: Receiver._on_load,
    AbortRecv: Receiver._on_abort,
    EndSession: Receiver._on_end_session,
    StartDrain: Receiver._on_start_drain,
    ForceAbort: Receiver._on_force_abort,
    PeerResolved: Receiver._on_resolved,
    PeerUnresolved: Receiver._on_unresolved,
    Sent: Receiver._on_sent,
    SendFailed: Receiver._on_send_failed,
    ReadDone: Receiver._on_read_done,
    ReadSettled: Receiver._on_read_settled,
    PeerGone: Receiver._on_peer_gone,
    PushDoneArrived: Receiver._on_push_done,
    LayersPushedArrived: Receiver._on_layers_pushed,
    PullAckArrived: Receiver._on_pull_ack,
    ResyncArrived: Receiver._on_resync,
    PeerLost: Receiver._on_peer_lost,
    PeerKnown: Receiver._on_peer_known,
    PeerReached: Receiver._on_peer_reached,
    PeerUnreachable: Receiver._on_peer_unreachable,
}

_ON: Final[dict[tuple[RecvState, type], Callable[[Receiver, RecvRequest, Any, float], None]]] = {
    (R.REGISTERING, PushDoneArrived): Receiver._pushed,
    (R.REGISTERED, PushDoneArrived): Receiver._pushed,
    (R.CANCELLING, PushDoneArrived): Receiver._pushed,
    (R.HOLDING, PushDoneArrived): Receiver._pushed,
}

_ON_ABORT: Final[dict[RecvState, Callable[[Receiver, RecvRequest, float], None]]] = {
    R.TRACKED: Receiver._drop_tracked,
    R.REGISTERED: Receiver._cancel_registered,
    R.HOLDING: Receiver._abort_held,
    # HANDSHAKING: ended (with a cancel at P) once P is resolved; REGISTERING: cancelled
    # once P has the registration (or ended if it never gets it); READING: once the READ
    # returns (it writes into our blocks); ACKING: once P answers; CANCELLING: already;
    # HOLDING: ends failed once nothing can write into its blocks.
}
