"""The P side of the KV transfer protocol: a sans-IO state machine per request.

A `Sender` owns every request P's daemon is sending, each a `SendRequest` in one of the
states below, and the tombstones of those that ended. Events go in through
`handle(event, now)`, which returns the effects to carry out (`kvd.core.effects` and
the two below); `next_deadline()` says when `handle_timer(now)` must run next. Nothing
here does IO or reads a clock.

States (`SendState`) and what moves them (`TRANSITIONS` lists every allowed move; the
per-state handlers are in `_ON`):

    AWAITING  D's registration, or its pull completion, arrived before P's engine
              finished the request. Bounded: registration_timeout / lease_wait_timeout;
              a registration also ends (no word) once its D is seen restarted
              (`PeerIncarnation`), and (answered failed) once D has not heartbeated it for
              a lease (`lease_duration`: D heartbeats what it waits for every lease/6):
              D ended it and its cancel was lost, so nothing waits for it there.
    HELD      P's engine finished it: a lease is granted; D's heartbeats extend it. Or
              (bidirectional KV) D's engine *kept* a finished request's blocks for the
              next conversational turn: a fixed lease (`Finish.keep_for`) that no
              heartbeat extends; the next turn's P pulls them (the daemon is then the
              source side of that request, exactly as P's is for a pull).
    MATCHED   held and D's registration is here: D's regions are being resolved (the
              `ResolveView` effect), and after a stall of ours D must re-sync first.
    WRITING   the lease is claimed (it cannot expire under the WRITE): `PostWrite`.
    STREAMING layer-wise push: D registered before P finished, and P's workers announce
              layers as they are saved (`LayersSaved`): each is written at once
              (`PostLayers`, whose WRITE carries a `LayersPushed` for D). P's finish
              writes whatever was not announced; D reports done once it has every layer
              of every rank. Nothing is leased: P's engine holds the blocks until its
              finish, and after it the request is claimed as in WRITING.
    DELIVERED the WRITE landed, or D's READ was acknowledged with the lease held.
    EXPIRED   the lease ran out (D stopped heartbeating).
    ABORTED   P's engine aborted the request, or its session ended.
    FAILED    D cancelled it, the WRITE failed, or D's view was stale.

Rules it keeps:
- Each request P's engine finished ends in exactly one terminal event to its session
  (SendFinished, SendFailed, SendExpired); a D that registered or pulled gets exactly
  one answer (PushDone or PullAck).
- Fail closed: a pull is acknowledged only while the lease is held and only for the
  region generations that are current; a WRITE happens only under a claimed lease,
  through the exact view of D's regions D named, and never into a D that has not
  re-synced since our last stall.
- Bound to one peer: a request belongs to the first D agent that heartbeats, registers
  for or pulls it. Another agent's heartbeat does not extend its lease, and its
  registration, pull completion or cancel is refused (answered as a failure to that
  agent only, counted as `foreign_requests_refused`/`heartbeats_foreign`); the request
  carries on for the peer it is bound to. (Agents are who NIXL says sent a message:
  with a shared secret, who holds the session key it was sealed under.)
- Tombstones: an ended request is remembered (bounded, by base id) so that a late
  registration, pull or finish is answered at once instead of waiting. So is a finish
  the daemon refused before the machine saw it (`FinishRefused`: its blocks are not in
  the engine's regions, or the regions are not registered yet after a reconnect): the
  engine has its error, and D's registration or pull for it fails at once (one that
  waited too) instead of waiting for a finish that will not come.
- A closing session is answered (`SessionEnded`) once none of its requests is WRITING.
- Kept blocks (bidirectional KV) are only pulled: a push registration for them is
  refused (PushDone failed), and their lease ends at its fixed deadline whatever the
  heartbeats (counted as `heartbeats_on_kept`). A pull by WRITE is a pull.
- A pull by WRITE (a registration naming P's blocks, `p_block_ids`: D's UCX would emulate
  its READ, `kvd.core.readpath`) is served as a push of exactly those blocks, only if each
  is one P leased for the request (else the request fails on both sides, INVALID); it
  never streams by layer (it waits for P's finish).
- Drain (`StartDrain`, the daemon going out of service): no new lease is granted. A
  `finished` during the drain fails at once (SendFailed to P's engine; a tombstone that
  refuses D's registration or pull at once, so D recomputes), registrations and pulls
  that wait for a lease are answered failed, new ones are refused as they come; what is
  leased is served until it ends. `Drained` says when nothing is left.
- An operator's abort (`ForceAbort`, `kvd abort`) ends a request whatever its session,
  like the engine's own abort; a WRITE in flight is not cut (its end answers).
- Bounded (`kvd.core.limits`): at most `max_pending_per_peer` registrations and pulls
  from one D wait in AWAITING, and every live request is charged its estimated bytes
  against `pending_bytes`. A registration or pull beyond either is answered failed at
  once (D fails the request and its engine recomputes). One that arrives with a
  `Reservation` (its bytes charged at intake, before it queued) is not charged again:
  the request it starts or joins adopts the reservation, and if it is not kept,
  `handle` releases it, whatever the answer was. A finish beyond the bytes ends
  failed at once (SendFailed to P's engine, and D answered if it registered), with a
  tombstone so that D's later registration or pull is answered at once too.
- D hears P's word on a push (PushDone) only once no WRITE for it is or will be in flight:
  a WRITE the adapter reports Unsettled (UCX did not end it within its bound) keeps the
  request WRITING (P's blocks are still read, D's still written) until it settles
  (`WriteSettled`: landed = delivered, else failed and D told); past `unsettled_hold`
  P's engine gets SendFailed (its blocks back, counted `writes_unsettled_released`) but
  D is never told the WRITE ended: D holds its blocks until its own bound.
- A streaming request ends only once none of its layer WRITEs is in flight: D hears of a
  failure (PushDone ok=False) only when nothing more can land in its blocks, and never
  after it received every layer (it reported done by then).
"""

from __future__ import annotations

import enum
import random
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Final

from kvd_client import wire
from kvd_client.errors import ErrorCode, InvalidRequest, KvdError, LocalProtocolError, NotFound

from kvd.core.effects import Drained, Emit, Log, Notify, Refused, SessionEnded
from kvd.core.ids import base_request_id
from kvd.core.leases import LeaseTable
from kvd.core.limits import PendingBudget, Reservation, record_cost
from kvd.core.timers import TimerHeap


class SendState(enum.Enum):
    AWAITING = "awaiting"
    HELD = "held"
    MATCHED = "matched"
    WRITING = "writing"
    STREAMING = "streaming"
    DELIVERED = "delivered"
    EXPIRED = "expired"
    ABORTED = "aborted"
    FAILED = "failed"


S = SendState
TERMINAL: Final = frozenset({S.DELIVERED, S.EXPIRED, S.ABORTED, S.FAILED})
TRANSITIONS: Final[Mapping[SendState, frozenset[SendState]]] = {
    S.AWAITING: frozenset({S.MATCHED, S.STREAMING, S.DELIVERED, S.FAILED, S.ABORTED}),
    S.HELD: frozenset({S.MATCHED, S.DELIVERED, S.EXPIRED, S.ABORTED, S.FAILED}),
    S.MATCHED: frozenset({S.WRITING, S.EXPIRED, S.ABORTED, S.FAILED}),
    S.WRITING: frozenset({S.DELIVERED, S.FAILED}),
    S.STREAMING: frozenset({S.WRITING, S.DELIVERED, S.FAILED, S.ABORTED}),
}

ENDED_SESSIONS: Final = 65536
"""Ended client sessions remembered (a registration naming one fails at once)."""


# ------------------------------------------------------------------ events


@dataclass(frozen=True, slots=True)
class Finish:
    """P's engine finished the request: lease these (validated) blocks. With `keep_for` > 0,
    D's engine keeps a finished request's blocks for the next turn's P to pull (bidirectional
    KV): a fixed lease of that many seconds, never extended by heartbeats."""

    request_id: str
    engine_id: str
    block_ids: tuple[int, ...]
    session: str
    keep_for: float = 0.0
    num_tokens: int = 0


@dataclass(frozen=True, slots=True)
class FinishRefused:
    """P's daemon refused the engine's finish before the machine saw it (its blocks are
    not in the engine's regions, or the engine has none registered yet: a client that
    reconnected sends its finish before its regions are back). The engine was answered
    with the error (its client reports SendFailed); D's registration or pull for the
    request, waiting or still to come, is answered failed at once: no finish for it is
    coming, and it must not wait for one to the registration timeout."""

    request_id: str
    code: int
    reason: str


@dataclass(frozen=True, slots=True)
class AbortSend:
    """P's engine gave up on the request."""

    request_id: str
    session: str


@dataclass(frozen=True, slots=True)
class EndSession:
    """The client session went away: end what it owns (answered by `SessionEnded`)."""

    session: str


@dataclass(frozen=True, slots=True)
class StartDrain:
    """The daemon goes out of service: grant no new lease, serve what is leased
    (answered by `Drained` once nothing is left; again at every later StartDrain)."""


@dataclass(frozen=True, slots=True)
class ForceAbort:
    """The operator ends the request by hand (`kvd abort`), whichever session owns it.
    Raises NotFound when no live request has this id, InvalidRequest while its WRITE runs."""

    request_id: str


@dataclass(frozen=True, slots=True)
class RegistrationArrived:
    agent: str
    msg: wire.PushRegistration
    reservation: Reservation | None = None
    """Its bytes, reserved from `Sender.budget` at intake (None: charged here)."""


@dataclass(frozen=True, slots=True)
class HeartbeatArrived:
    agent: str
    request_ids: tuple[str, ...]


@dataclass(frozen=True, slots=True)
class PullDoneArrived:
    agent: str
    msg: wire.PullDone
    reservation: Reservation | None = None
    """Its bytes, reserved from `Sender.budget` at intake (None: charged here)."""


@dataclass(frozen=True, slots=True)
class CancelArrived:
    """D will not take the request (by P's id or D's own): free it now."""

    agent: str
    request_id: str


@dataclass(frozen=True, slots=True)
class ViewResolved:
    """The answer to `ResolveView`: D's regions as the registration named them, or why not."""

    key: str
    view: object = None
    error: KvdError | None = None


@dataclass(frozen=True, slots=True)
class WriteDone:
    """The answer to `PostWrite`."""

    key: str
    error: KvdError | None = None
    unsettled: bool = False
    """The WRITE is still in flight in UCX past its bound (`Unsettled`): it may still
    read our blocks and land in D's; `WriteSettled` follows when it ends."""
    transfers: int = 0
    """PushDone(ok) notifications the WRITE carried to D, one per transfer (0: unknown)."""


@dataclass(frozen=True, slots=True)
class WriteSettled:
    """A WRITE answered Unsettled has ended in UCX at last (`error` None: it landed)."""

    key: str
    error: KvdError | None = None
    transfers: int = 0
    """As `WriteDone.transfers`."""


@dataclass(frozen=True, slots=True)
class LayersSaved:
    """P's worker of rank `tp_rank` has layers [0, layers) of the request (these validated
    logical blocks) in host memory; the engine has `tp_size` ranks of `num_layers` layers."""

    request_id: str
    engine_id: str
    tp_rank: int
    tp_size: int
    layers: int
    num_layers: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class LayersWritten:
    """The answer to `PostLayers`. `unsupported`: nothing was written because this
    request's transfer cannot be cut by layer (its ranks map with a permute on receive,
    or its layers differ): it goes whole at P's finish instead."""

    key: str
    first: int
    end: int
    error: KvdError | None = None
    unsupported: bool = False
    unsettled: bool = False
    """With `error`: the WRITE was answered Unsettled and UCX had not ended it within
    `unsettled_hold`: it may still land, so D gets no word (it holds its blocks until
    its own bound), as for a whole WRITE released unsettled."""


@dataclass(frozen=True, slots=True)
class ResyncAcked:
    agent: str
    nonce: int


@dataclass(frozen=True, slots=True)
class Stalled:
    """Our daemon was stalled: every D must re-sync before we WRITE into it again."""


@dataclass(frozen=True, slots=True)
class PeerIncarnation:
    """A D daemon's incarnation as its latest handshake showed it. Registrations of an
    earlier incarnation of it (a D that restarted) wait for a party that is gone: they
    end (no word: nobody would hear it), and one arriving late is ignored."""

    agent: str
    incarnation: int


@dataclass(frozen=True, slots=True)
class RegionsChanged:
    """The current generations of our regions, per engine, in rank order."""

    generations: Mapping[str, tuple[int, ...]]


Event = (
    Finish
    | FinishRefused
    | AbortSend
    | EndSession
    | StartDrain
    | ForceAbort
    | RegistrationArrived
    | HeartbeatArrived
    | PullDoneArrived
    | CancelArrived
    | ViewResolved
    | WriteDone
    | WriteSettled
    | LayersSaved
    | LayersWritten
    | ResyncAcked
    | Stalled
    | RegionsChanged
    | PeerIncarnation
)


# ------------------------------------------------------------------ effects


@dataclass(frozen=True, slots=True)
class ResolveView:
    """Find D's regions exactly as `registration` names them (a handshake with D if our
    view is stale), then feed `ViewResolved(key, ...)`."""

    key: str
    agent: str
    registration: wire.PushRegistration


@dataclass(frozen=True, slots=True)
class PostWrite:
    """WRITE P's `p_blocks` of `engine_id` (all the request's: D's registered blocks take
    their tail, `kvd.core.planner.align_tokens`) into D's blocks through `view`, with one
    PushDone(ok) notification per transfer (rank pair); then feed `WriteDone(key, ...)`."""

    key: str
    agent: str
    engine_id: str
    p_blocks: tuple[int, ...]
    registration: wire.PushRegistration
    view: object
    p_tokens: int = 0
    """P's token count of the request (its finish's `num_tokens`; 0 = not said)."""


@dataclass(frozen=True, slots=True)
class PostLayers:
    """WRITE layers [first, end) of P's `p_blocks` (every rank) into D's registered blocks
    through `view`, each NIXL transfer carrying a `LayersPushed` for D; then feed
    `LayersWritten(key, first, end, ...)`. The shell may coalesce the PostLayers of one
    turn that go to the same D regions into one WRITE."""

    key: str
    agent: str
    engine_id: str
    first: int
    end: int
    p_blocks: tuple[int, ...]
    registration: wire.PushRegistration
    view: object


Effect = (
    Emit | Notify | SessionEnded | Log | Refused | ResolveView | PostWrite | PostLayers | Drained
)


# ------------------------------------------------------------------ state


@dataclass(frozen=True, slots=True)
class Tombstone:
    """How a request ended, for the late messages that name it."""

    code: int
    reason: str
    refuses_finish: bool = False
    """D gave up on it: a `finished` that comes later ends at once (nothing leased)."""
    by_base: bool = True
    """Found by an id sharing its base id too (the other engine's id for the same
    request). An outcome that only matters to the exact request (it was delivered, its
    WRITE failed) is found by its exact id only, so a new request whose id happens to
    share the base is never answered with an old one's fate."""
    d_request_id: str = ""
    agent: str = ""
    """The D registration it ended with (its id at D, and D's agent): a cancel D sends
    again later (D holds its blocks until P's word) is answered with a PushDone, since no
    WRITE for it is or will be in flight any more. Empty when that is not known (its
    WRITE was released unsettled) or there was no registration."""
    settled: bool = True
    """No WRITE of it can still be in flight (False: released while Unsettled)."""
    pushed: int = 0
    """Delivered by one WRITE that carried this many PushDone(ok): the same D repeating
    its registration (it never heard them) is told so again, not made to recompute."""


@dataclass(frozen=True, slots=True)
class _Ending:
    """How a streaming request ends once none of its layer WRITEs is in flight."""

    state: SendState
    tomb: Tombstone
    event: wire.Record | None
    """For P's session (only once P's engine finished the request)."""
    settled: bool = True
    """False: a layer WRITE of it may still be in flight in UCX (released unsettled):
    D is not told it failed, and its tombstone answers no cancel."""


@dataclass(slots=True)
class Stream:
    """A layer-wise push's progress, per rank of P's engine."""

    engine_id: str
    blocks: tuple[int, ...]
    num_layers: int
    saved: list[int]
    """Layers [0, saved[r]) of P's rank r are in host memory: [0, min(saved)) of every
    rank can go."""
    posted: int = 0
    """Layers [0, posted) were handed to a WRITE."""
    written: int = 0
    """Layers whose WRITE landed."""
    in_flight: int = 0
    finished: bool = False
    """P's engine finished the request (its finish arrived)."""
    whole: bool = False
    """It cannot go by layer (`LayersWritten.unsupported`): it goes whole at the finish."""
    ending: _Ending | None = None

    def complete(self) -> bool:
        """Every layer landed at D (D reports done by itself)."""
        return self.written == self.num_layers


@dataclass(slots=True)
class SendRequest:
    key: str
    """P's request id once P's engine finished it; the id D named while AWAITING."""
    state: SendState
    since: float
    engine_id: str = ""
    blocks: tuple[int, ...] = ()
    session: str = ""
    tokens: int = 0
    """The token count P's engine finished it with (0 = not said)."""
    agent: str = ""
    """D's agent: whoever registered for it or pulled it."""
    registration: wire.PushRegistration | None = None
    early_pull: wire.PullDone | None = None
    view: object = None
    view_ready: bool = False
    cost: int = 0
    """Estimated bytes charged to the pending budget while it is live."""
    stream: Stream | None = None
    unsettled: KvdError | None = None
    """WRITING: its WRITE was answered Unsettled with this error (it may still run)."""
    kept: bool = False
    """Blocks D kept for the next turn (a fixed lease; pulled only)."""
    heard: float = 0.0
    """AWAITING a registration: when D last showed it still waits for it (the
    registration, a repeat of it, a heartbeat naming it; our own stall counts too)."""


_RESYNC: Final = "\0resync:"
"""Timer key prefix of a peer's re-sync deadline (request ids never start with NUL)."""


@dataclass
class Sender:
    """Every request P's daemon is sending (see the module docstring)."""

    lease_duration: float
    lease_wait_timeout: float
    registration_timeout: float
    resync_timeout: float = 5.0
    max_tombstones: int = 65536
    max_pending_per_peer: int = 16384
    """Registrations and early pulls one D may have waiting in AWAITING."""
    pending_bytes: int = 256 << 20
    """Bound of the estimated bytes of live requests (`kvd.core.limits`)."""
    counters: dict[str, int] = field(default_factory=dict)
    unsettled_hold: float = 60.0
    """How long a WRITE answered Unsettled keeps its request (and P's blocks) before P's
    engine is answered anyway."""
    nonce: Callable[[int], int] = field(default_factory=lambda: random.SystemRandom().getrandbits)
    """Random bits for re-sync nonces (a test passes a deterministic source)."""
    incarnation: int = 0
    """This daemon's incarnation: a registration or pull completion naming another (D's
    engine was told of a lease by the daemon before a restart) is refused at once, as
    nothing of this incarnation can finish it (0: not checked)."""

    def __post_init__(self) -> None:
        self.leases = LeaseTable(self.lease_duration)
        self.reqs: dict[str, SendRequest] = {}
        self._states: Counter[SendState] = Counter()
        self._awaiting_registrations = 0
        self._awaiting_pulls = 0
        self._awaiting_by_agent: Counter[str] = Counter()
        self.budget = PendingBudget(self.pending_bytes)
        self._by_base: dict[str, dict[str, None]] = {}
        self._timers: TimerHeap[str] = TimerHeap()
        self.tombstones: OrderedDict[str, Tombstone] = OrderedDict()
        """Ended requests by exact id, oldest first (bounded)."""
        self._tomb_base: dict[str, str] = {}
        """Base id -> the newest exact id buried `by_base` under it."""
        self.ended_sessions: OrderedDict[str, None] = OrderedDict()
        self.incarnations: dict[str, int] = {}
        """Each D's incarnation as last seen (`PeerIncarnation`)."""
        self.gone_incarnations: OrderedDict[tuple[str, int], None] = OrderedDict()
        """(agent, incarnation) of D daemons that restarted since (bounded)."""
        self.closing: set[str] = set()
        self.generations: dict[str, tuple[int, ...]] = {}
        self.stall_epoch = 0
        self.synced: dict[str, int] = {}
        self.resyncing: dict[str, tuple[int, int]] = {}
        """Peer -> (nonce, stall epoch) of the Resync we await: its ack covers that epoch
        only (a stall after the Resync went out needs another)."""
        self.draining_since: float | None = None
        """Daemon time the drain started (None: not draining)."""
        self._out: list[Effect] = []

    # ---------------------------------------------------------------- the interface

    def handle(self, event: Event, now: float) -> list[Effect]:
        """Feed one event; returns the effects to carry out, in order.

        Raises InvalidRequest for a client request the protocol refuses (the caller's
        fault: the actor answers it with the error); the machine is unchanged then.
        """
        self._out = []
        try:
            _HANDLERS[type(event)](self, event, now)
        finally:
            # not kept (what is kept was adopted): its bytes go back now
            if isinstance(event, RegistrationArrived | PullDoneArrived) and event.reservation:
                event.reservation.release()
        out, self._out = self._out, []
        return out

    def handle_timer(self, now: float) -> list[Effect]:
        """Expire what is due at `now` (leases, waits, re-syncs)."""
        self._out = []
        for lease in self.leases.expire(now):
            req = self.reqs.get(lease.request_id)
            if req is not None:
                self._expire(req, now)
        for key, _ in self._timers.pop_due(now):
            if key.startswith(_RESYNC):
                self._resync_timed_out(key[len(_RESYNC) :], now)
            elif (req := self.reqs.get(key)) is not None and req.state is S.AWAITING:
                self._wait_due_now(req, now)
            elif req is not None and req.state is S.STREAMING:
                self._stream_timed_out(req, now)
            elif req is not None and req.state is S.WRITING and req.unsettled is not None:
                self._unsettled_timed_out(req, now)
        out, self._out = self._out, []
        return out

    def next_deadline(self) -> float | None:
        due = (self.leases.next_deadline(), self._timers.next_time())
        times = [t for t in due if t is not None]  # a deadline may be 0.0
        return min(times) if times else None

    # ---------------------------------------------------------------- bookkeeping

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def _log(self, level: str, event: str, **fields: Any) -> None:
        self._out.append(Log(level, event, fields))

    def _goto(self, req: SendRequest, state: SendState) -> None:
        if state not in TRANSITIONS.get(req.state, frozenset()):
            raise LocalProtocolError(f"send {req.key!r}: no transition {req.state} -> {state}")
        if self.reqs.get(req.key) is req:
            self._index(req, -1)
            req.state = state
            self._index(req, +1)
        else:
            req.state = state

    def _index(self, req: SendRequest, n: int) -> None:
        """Count `req` in (n=+1) or out of (n=-1) the per-state tallies of live requests."""
        self._states[req.state] += n
        if req.state is S.AWAITING:
            left = self._awaiting_by_agent[req.agent] + n
            if left:
                self._awaiting_by_agent[req.agent] = left
            else:
                del self._awaiting_by_agent[req.agent]
            if req.registration is not None:
                self._awaiting_registrations += n
            if req.early_pull is not None:
                self._awaiting_pulls += n

    def _add(self, req: SendRequest) -> None:
        self.reqs[req.key] = req
        self._index(req, +1)
        self._by_base.setdefault(base_request_id(req.key), {})[req.key] = None

    def _drop(self, req: SendRequest) -> None:
        if self.reqs.get(req.key) is req:
            del self.reqs[req.key]
            self._index(req, -1)
            self.budget.give(req.cost)
            req.cost = 0
            base = base_request_id(req.key)
            keys = self._by_base.get(base)
            if keys is not None:
                keys.pop(req.key, None)
                if not keys:
                    del self._by_base[base]
        self.leases.release(req.key)
        self._timers.discard(req.key)

    def _find(self, request_id: str) -> SendRequest | None:
        """The live request D names: exact id first, then one sharing its base id."""
        req = self.reqs.get(request_id)
        if req is not None:
            return req
        keys = self._by_base.get(base_request_id(request_id))
        return self.reqs[next(iter(keys))] if keys else None

    def _tomb(self, request_id: str) -> Tombstone | None:
        tomb = self.tombstones.get(request_id)
        if tomb is not None:
            return tomb
        exact = self._tomb_base.get(base_request_id(request_id))
        return self.tombstones.get(exact) if exact is not None else None

    def _bury(self, request_id: str, tomb: Tombstone) -> None:
        if self.max_tombstones <= 0:
            return
        old = self.tombstones.pop(request_id, None)
        if old is not None and old.refuses_finish and not tomb.refuses_finish:
            tomb = replace(tomb, refuses_finish=True)  # a cancel is never forgotten
        if old is not None and not old.settled:
            tomb = replace(tomb, settled=False)  # nor a WRITE that may still run
        if old is not None and old.d_request_id and not tomb.d_request_id:
            tomb = replace(tomb, d_request_id=old.d_request_id, agent=old.agent)
        self.tombstones[request_id] = tomb
        if tomb.by_base:
            self._tomb_base[base_request_id(request_id)] = request_id
        while len(self.tombstones) > self.max_tombstones:
            gone, _ = self.tombstones.popitem(last=False)
            base = base_request_id(gone)
            if self._tomb_base.get(base) == gone:
                del self._tomb_base[base]

    def _end(
        self, req: SendRequest, state: SendState, tomb: Tombstone | None, *, settled: bool = True
    ) -> None:
        """Move to a terminal state and forget the request (its tombstone stays; `settled`:
        no WRITE of it can still be in flight, so a later cancel from D is answered)."""
        self._goto(req, state)
        self._drop(req)
        if tomb is not None:
            reg = req.registration
            if not settled:
                tomb = replace(tomb, settled=False)
            if reg is not None and req.agent:
                tomb = replace(tomb, d_request_id=reg.request_id, agent=req.agent)
            self._bury(req.key, tomb)
            if reg is not None and req.agent and reg.request_id != req.key:
                # D names it by its own id when it repeats its registration (it never
                # heard our answer): found exactly, as the request it was
                self._bury(reg.request_id, tomb)
        if req.session in self.closing:
            self._maybe_session_ended(req.session)
        if self.draining_since is not None and not self.reqs:
            self._out.append(Drained())

    def _emit(self, req: SendRequest, record: wire.Record) -> None:
        if req.session:
            self._out.append(Emit(req.session, req.engine_id, record))

    def _push_failed(self, req: SendRequest, code: int, reason: str) -> None:
        """Tell D its registration will not be written (one answer per registration)."""
        reg = req.registration
        if reg is not None:
            self._out.append(
                Notify(req.agent, wire.PushDone(reg.request_id, 0, False, code, reason[:1000]))
            )

    def _pull_refused(self, agent: str, msg: wire.PullDone, code: int, reason: str) -> None:
        self._count("pulls_refused")
        self._log("warning", "pull_refused", request_id=msg.request_id, peer=agent, reason=reason)
        self._out.append(Notify(agent, wire.PullAck(msg.d_request_id, False, code, reason)))

    def _count_after_expiry(self, tomb: Tombstone) -> None:
        """D's registration or pull named a request whose lease had expired: D's
        heartbeats did not reach us in time (or D was too slow): `notifs_after_expiry`."""
        if tomb.code == int(ErrorCode.LEASE_EXPIRED):
            self._count("notifs_after_expiry")

    def _reject(self, agent: str, why: str) -> None:
        self._count("notifs_rejected")
        self._log("warning", "notif_rejected", peer=agent, reason=why)

    # ---------------------------------------------------------------- P's engine

    def _on_finish(self, ev: Finish, now: float) -> None:
        have = self.reqs.get(ev.request_id)
        near = self._find(ev.request_id) if have is None else None
        if near is not None and near.stream is not None and not near.stream.finished:
            have = near
        if have is not None and have.state is S.STREAMING:
            self._finish_stream(have, ev, now)
            return
        if have is not None and have.state is not S.AWAITING:
            raise InvalidRequest(f"request {ev.request_id!r} already holds a lease")
        if self.draining_since is not None:
            self._refuse_finish_draining(ev)
            return
        tomb = self._tomb(ev.request_id)
        if tomb is not None and tomb.refuses_finish and have is None:
            # D gave up before P finished: nothing will ever read the blocks
            self._count("finishes_after_cancel")
            why = "D cancelled the request before P finished it"
            self._out.append(
                Emit(ev.session, ev.engine_id, wire.SendFailed(ev.request_id, tomb.code, why))
            )
            return
        waiting = have if have is not None else self._find(ev.request_id)
        if waiting is not None and waiting.state is not S.AWAITING:
            waiting = None
        if (
            ev.keep_for
            and waiting is not None
            and waiting.registration is not None
            and not waiting.registration.p_block_ids
        ):
            self._fail_waiting(waiting, _KEPT_NOT_PUSHED, S.FAILED)  # kept blocks are pulled
            waiting = None
        freed = waiting.cost if waiting is not None else 0
        cost = record_cost(ev, waiting.registration if waiting is not None else None)
        if not self.budget.take(cost, freed):
            self._refuse_finish(ev, waiting, self.budget.why(cost, "a lease"))
            return
        if waiting is not None:
            waiting.cost = 0  # charged again below, as `cost`
            self._drop(waiting)  # it comes back under P's id, below
        self.leases.grant(ev.request_id, now, owner=ev.session, fixed_for=ev.keep_for)
        self._count("leases_granted")
        if ev.keep_for:
            self._count("kv_kept")
        if waiting is None:
            held = SendRequest(ev.request_id, S.HELD, now, ev.engine_id, ev.block_ids, ev.session)
            held.cost, held.kept, held.tokens = cost, ev.keep_for > 0, ev.num_tokens
            self._add(held)
            return
        # D came first: the request takes P's id, and what waited is served now
        waiting.key, waiting.engine_id, waiting.blocks, waiting.session = (
            ev.request_id,
            ev.engine_id,
            ev.block_ids,
            ev.session,
        )
        waiting.cost, waiting.kept, waiting.tokens = cost, ev.keep_for > 0, ev.num_tokens
        self._add(waiting)
        if waiting.early_pull is not None:
            self._count("early_pulls_served")
            self._deliver_pull(waiting, waiting.agent, waiting.early_pull)
        else:
            self._match(waiting, now)

    def _on_finish_refused(self, ev: FinishRefused, now: float) -> None:
        live = self.reqs.get(ev.request_id)
        if live is not None and live.state is not S.AWAITING:
            return  # a second finish of a leased request was refused: the first stands
        tomb = Tombstone(ev.code, ev.reason)
        waiting = self._find(ev.request_id)
        if waiting is not None and waiting.state is S.AWAITING:
            self._fail_waiting(waiting, tomb, S.FAILED)
        elif waiting is not None:
            return  # another live request shares its base id: D's word goes to that one
        self._count("finishes_refused")
        self._bury(ev.request_id, tomb)

    def _refuse_finish_draining(self, ev: Finish) -> None:
        """No new lease while draining: P's engine is told now, and D's registration or
        pull for it (by P's id or one sharing its base) is refused at once by the tombstone."""
        self._count("finishes_refused_draining")
        self._log("info", "finish_refused_draining", request_id=ev.request_id, peer="")
        self._out.append(
            Emit(
                ev.session,
                ev.engine_id,
                wire.SendFailed(ev.request_id, _DRAINING.code, _DRAINING.reason),
            )
        )
        self._bury(ev.request_id, _DRAINING)

    def _on_start_drain(self, ev: StartDrain, now: float) -> None:
        if self.draining_since is None:
            self.draining_since = now
            self._log("info", "drain_started", live=len(self.reqs))
            # what waits for a lease will not get one: answer D now (it recomputes)
            for req in [r for r in self.reqs.values() if r.state is S.AWAITING]:
                self._count("waits_failed_draining")
                self._fail_waiting(req, _DRAINING, S.FAILED)
        if not self.reqs and Drained() not in self._out:  # (the last one's end said so)
            self._out.append(Drained())

    def _on_force_abort(self, ev: ForceAbort, now: float) -> None:
        req = self.reqs.get(ev.request_id)
        if req is None:
            raise NotFound(f"no request {ev.request_id!r} is being sent (P side)")
        if req.state is S.WRITING:
            raise InvalidRequest(
                f"request {ev.request_id!r} is being written to D: it ends when the WRITE "
                "returns (bounded by transfer.transfer_timeout)"
            )
        self._count("operator_aborts")
        self._log(
            "warning",
            "aborted_by_operator",
            request_id=req.key,
            peer=req.agent,
            state=req.state.value,
        )
        self._step(req, ev, now)

    def _operator_aborted(self, req: SendRequest, ev: ForceAbort, now: float) -> None:
        if req.state is S.AWAITING:
            self._fail_waiting(req, _OPERATOR, S.ABORTED)
            return
        self._emit(req, wire.SendFailed(req.key, _OPERATOR.code, _OPERATOR.reason))
        self._push_failed(req, _OPERATOR.code, _OPERATOR.reason)
        self._end(req, S.ABORTED, _OPERATOR)

    def _refuse_finish(self, ev: Finish, waiting: SendRequest | None, why: str) -> None:
        """No room for the lease: the request ends failed now on both sides (P's engine,
        and D if it registered or pulled), and D's later word is answered at once."""
        self._out.append(
            Refused(
                "limit_pending_bytes_refused",
                "finish_refused",
                "pending_bytes",
                {"request_id": ev.request_id, "reason": why},
            )
        )
        self._out.append(
            Emit(ev.session, ev.engine_id, wire.SendFailed(ev.request_id, int(ErrorCode.BUSY), why))
        )
        tomb = Tombstone(int(ErrorCode.BUSY), why)
        if waiting is not None:
            self._fail_waiting(waiting, tomb, S.FAILED)
        self._bury(ev.request_id, tomb)

    def _over(self, agent: str, cost: int, what: str, reserved: bool) -> str | None:
        """Why D's registration or pull (charged `cost`) may not wait for P's engine, or
        None after charging it (see the module docstring); `reserved`: its bytes were
        charged at intake already (the caller adopts the reservation)."""
        if self._awaiting_by_agent[agent] >= self.max_pending_per_peer:
            why = (
                f"limits.pending_registrations_per_peer reached: {self.max_pending_per_peer} "
                f"registrations and pulls from {agent} wait for P's engine"
            )
            counter, kind = "limit_pending_registrations_refused", "pending_registrations"
        elif not reserved and not self.budget.take(cost):
            why = self.budget.why(cost, what)
            counter, kind = "limit_pending_bytes_refused", "pending_bytes"
        else:
            return None
        self._out.append(Refused(counter, "peer_request_refused", kind, {"peer": agent}))
        return why

    def _on_abort(self, ev: AbortSend, now: float) -> None:
        req = self.reqs.get(ev.request_id)
        if req is not None and req.session and req.session != ev.session:
            return  # another session's request: not ours to abort
        if req is None:
            # never finished here (or already ended): fail what D may register or pull
            self._bury(ev.request_id, _ABORTED)
            waiting = self._find(ev.request_id)
            if waiting is not None and waiting.state is S.AWAITING:
                self._abort_waiting(waiting, ev, now)
            return
        self._step(req, ev, now)

    def _aborted(self, req: SendRequest, ev: AbortSend, now: float) -> None:
        self._emit(req, wire.SendFailed(req.key, int(ErrorCode.TRANSFER), "aborted"))
        self._push_failed(req, _ABORTED.code, _ABORTED.reason)
        self._end(req, S.ABORTED, _ABORTED)

    def _on_end_session(self, ev: EndSession, now: float) -> None:
        self.ended_sessions[ev.session] = None
        while len(self.ended_sessions) > ENDED_SESSIONS:
            self.ended_sessions.popitem(last=False)
        self.closing.add(ev.session)
        for req in [r for r in self.reqs.values() if r.state is S.AWAITING]:
            # D named this session as the one to finish it: it never will now (a finish
            # still queued in the engine's socket when it froze is refused with the
            # session), so D is answered now, not at its registration timeout
            named = req.registration or req.early_pull
            if named is not None and named.p_session == ev.session:
                self._count("waits_failed_session_ended")
                self._fail_waiting(req, _GONE, S.FAILED)
        for req in [r for r in self.reqs.values() if r.session == ev.session]:
            if req.state in (S.HELD, S.MATCHED):
                self._push_failed(req, _GONE.code, _GONE.reason)
                self._end(req, S.ABORTED, _GONE)
            elif req.state is S.STREAMING:
                self._stream_ending(req, _Ending(S.ABORTED, _GONE, None), now)
        self._maybe_session_ended(ev.session)

    def _on_peer_incarnation(self, ev: PeerIncarnation, now: float) -> None:
        prev = self.incarnations.get(ev.agent)
        self.incarnations[ev.agent] = ev.incarnation
        if prev is None or prev == ev.incarnation:
            return
        self.gone_incarnations[(ev.agent, prev)] = None
        while len(self.gone_incarnations) > ENDED_SESSIONS:
            self.gone_incarnations.popitem(last=False)
        for req in [r for r in self.reqs.values() if r.state is S.AWAITING]:
            reg = req.registration
            if req.agent == ev.agent and reg is not None and reg.incarnation == prev:
                # its D restarted: nothing will come for it but our registration timeout
                self._count("waits_failed_peer_restarted")
                self._end(req, S.FAILED, _RESTARTED)

    def _maybe_session_ended(self, session: str) -> None:
        if session not in self.closing or any(r.session == session for r in self.reqs.values()):
            return
        self.closing.discard(session)
        self._out.append(SessionEnded(session))

    # ---------------------------------------------------------------- D's messages

    def _on_registration(self, ev: RegistrationArrived, now: float) -> None:
        msg = ev.msg
        if (ev.agent, msg.incarnation) in self.gone_incarnations:
            self._count("registrations_from_gone_incarnation")
            return  # late, from a D that restarted since: nobody would hear an answer
        key = msg.remote_request_id or msg.request_id
        req = self._find(key)
        if req is None:
            tomb = self._tomb(key) or self._tomb(msg.request_id)
            if tomb is None and self._earlier_incarnation(msg.p_incarnation):
                tomb = _P_RESTARTED
            if tomb is None and msg.p_session in self.ended_sessions:
                tomb = _GONE
            if tomb is None and self.draining_since is not None:
                tomb = _DRAINING  # it would wait for a lease that will not be granted
            if tomb is not None and not tomb.settled:
                # its WRITE may still land in D's blocks: no word (D holds them until P's
                # word or its own bound), as for a cancel
                self._count("late_registrations_unsettled")
                return
            if (
                tomb is not None
                and tomb.pushed
                and tomb.agent == ev.agent
                and tomb.d_request_id == msg.request_id
            ):
                # delivered: its PushDones were lost on the way (D repeats because it
                # never heard them); the bytes are in D's blocks, which D still holds
                self._count("registrations_answered_done")
                for i in range(tomb.pushed):
                    done = wire.PushDone(msg.request_id, i, True, 0, "")
                    self._out.append(Notify(ev.agent, done))
                return
            if tomb is not None:
                self._count("late_registrations")
                self._count_after_expiry(tomb)
                self._out.append(
                    Notify(
                        ev.agent, wire.PushDone(msg.request_id, 0, False, tomb.code, tomb.reason)
                    )
                )
                return
            res = ev.reservation
            cost = res.cost if res is not None else record_cost(msg)
            why = self._over(ev.agent, cost, "a push registration", res is not None)
            if why is not None:
                self._out.append(
                    Notify(
                        ev.agent,
                        wire.PushDone(msg.request_id, 0, False, int(ErrorCode.BUSY), why),
                    )
                )
                return
            self._count("pull_registrations" if msg.p_block_ids else "push_registrations")
            waiting = SendRequest(key, S.AWAITING, now, agent=ev.agent, registration=msg)
            waiting.cost = res.adopt() if res is not None else cost
            waiting.heard = now
            self._add(waiting)
            self._timers.set(key, self._wait_due(waiting))
            return
        if self._foreign(req, ev.agent, "registration"):
            why = "this request is bound to another peer"
            self._out.append(
                Notify(ev.agent, wire.PushDone(msg.request_id, 0, False, int(ErrorCode.AUTH), why))
            )
            return
        self._step(req, ev, now)

    def _held_registered(self, req: SendRequest, ev: RegistrationArrived, now: float) -> None:
        if req.kept and not ev.msg.p_block_ids:  # kept blocks are pulled (READ or by WRITE)
            self._reject(ev.agent, f"a push registration for kept request {req.key!r}")
            tomb = _KEPT_NOT_PUSHED
            self._out.append(
                Notify(ev.agent, wire.PushDone(ev.msg.request_id, 0, False, tomb.code, tomb.reason))
            )
            return
        self._count("pull_registrations" if ev.msg.p_block_ids else "push_registrations")
        req.agent, req.registration = ev.agent, ev.msg
        if ev.reservation is not None:
            req.cost += ev.reservation.adopt()  # it keeps D's registration too
        self._match(req, now)

    def _match(self, req: SendRequest, now: float) -> None:
        reg = req.registration
        assert reg is not None
        self._goto(req, S.MATCHED)
        if reg.p_block_ids and not set(reg.p_block_ids) <= set(req.blocks):
            # a pull by WRITE names P's blocks: only those leased for the request are sent
            why = "the pull names blocks P did not lease for this request"
            self._reject(req.agent, f"{why} ({req.key!r})")
            self._fail_send(req, int(ErrorCode.INVALID), why)
            return
        # how D's blocks take P's (block sizes may differ) is the planner's to check
        self._out.append(ResolveView(req.key, req.agent, reg))

    def _duplicate_registration(
        self, req: SendRequest, ev: RegistrationArrived, now: float
    ) -> None:
        if req.agent == ev.agent and req.registration == ev.msg:
            # D repeats a registration it has no answer to yet (the first may have been
            # lost): we have it, the answer follows when the request is done
            self._count("registrations_repeated")
            req.heard = max(req.heard, now)
            return
        self._reject(ev.agent, f"a second registration for request {req.key!r}")
        why = "another registration already holds this request"
        self._out.append(
            Notify(
                ev.agent, wire.PushDone(ev.msg.request_id, 0, False, int(ErrorCode.INVALID), why)
            )
        )

    def _on_heartbeat(self, ev: HeartbeatArrived, now: float) -> None:
        keys: list[str] = []
        unknown = 0
        for i in ev.request_ids:
            if (k := self.leases.find(i)) is not None:
                keys.append(k)
            elif not self._heard_waiting(i, ev.agent, now):
                unknown += 1
        if unknown:
            self._count("heartbeat_unknown_ids", unknown)
        mine = []
        for k in keys:
            req = self.reqs.get(k)
            if req is not None and not req.agent:
                req.agent = ev.agent  # the first peer to speak for a lease holds it
            if req is None or req.agent == ev.agent:
                mine.append(k)
            if req is not None and req.kept:
                self._count("heartbeats_on_kept")  # its lease is fixed: not extended
        self.leases.extend(mine, now)
        self._count("heartbeats_received")
        if foreign := len(keys) - len(mine):
            self._count("heartbeats_foreign", foreign)
            self._reject(ev.agent, f"heartbeat for {foreign} lease(s) bound to another peer")

    def _heard_waiting(self, request_id: str, agent: str, now: float) -> bool:
        """A heartbeat for a registration still AWAITING P's finish: D still waits for it
        (only its own D's heartbeat says so)."""
        req = self._find(request_id)
        if req is None or req.state is not S.AWAITING or req.registration is None:
            return False
        if req.agent != agent:
            return False  # not known to that peer (counted unknown)
        req.heard = max(req.heard, now)
        self._count("heartbeats_on_waiting")
        return True

    def _wait_due(self, req: SendRequest) -> float:
        """When an AWAITING request must next be looked at: its wait's end, or (for a
        registration) a lease after D last showed it still waits."""
        if req.registration is None:
            return req.since + self.lease_wait_timeout
        return min(req.since + self.registration_timeout, req.heard + self.lease_duration)

    def _foreign(self, req: SendRequest, agent: str, what: str) -> bool:
        """Whether `req` is bound to another peer than `agent` (then refused, counted)."""
        if not req.agent or req.agent == agent:
            return False
        self._count("foreign_requests_refused")
        self._reject(agent, f"{what} for request {req.key!r}, bound to another peer")
        return True

    def _earlier_incarnation(self, named: int) -> bool:
        """Whether a message for a request this daemon has no lease for names another
        incarnation of it: its finish went to the daemon before a restart, and never
        comes here (counted `requests_of_another_incarnation`)."""
        if not (named and self.incarnation and named != self.incarnation):
            return False
        self._count("requests_of_another_incarnation")
        return True

    def _on_pull_done(self, ev: PullDoneArrived, now: float) -> None:
        msg = ev.msg
        req = self._find(msg.request_id)
        if req is not None:
            if self._foreign(req, ev.agent, "pull completion"):
                why = "this request is bound to another peer"
                self._pull_refused(ev.agent, msg, int(ErrorCode.AUTH), why)
                return
            self._step(req, ev, now)
            return
        tomb = self._tomb(msg.request_id)
        if tomb is None and self._earlier_incarnation(msg.p_incarnation):
            tomb = _P_RESTARTED
        if tomb is None and msg.p_session in self.ended_sessions:
            tomb = _GONE
        if tomb is None and self.draining_since is not None:
            tomb = _DRAINING  # it would wait for a lease that will not be granted
        if tomb is not None:
            self._count_after_expiry(tomb)
            self._pull_refused(ev.agent, msg, tomb.code, tomb.reason)
            return
        # P's engine may not have finished yet (its `finished` is on its way): wait for it
        res = ev.reservation
        cost = res.cost if res is not None else record_cost(msg)
        if (refusal := self._over(ev.agent, cost, "a pull", res is not None)) is not None:
            busy = int(ErrorCode.BUSY)
            self._out.append(Notify(ev.agent, wire.PullAck(msg.d_request_id, False, busy, refusal)))
            return
        self._count("early_pulls")
        waiting = SendRequest(msg.request_id, S.AWAITING, now, agent=ev.agent, early_pull=msg)
        waiting.cost = res.adopt() if res is not None else cost
        self._add(waiting)
        self._timers.set(waiting.key, now + self.lease_wait_timeout)

    def _held_pulled(self, req: SendRequest, ev: PullDoneArrived, now: float) -> None:
        self._deliver_pull(req, ev.agent, ev.msg)

    def _deliver_pull(self, req: SendRequest, agent: str, msg: wire.PullDone) -> None:
        """D READ our blocks: ack only if they were the current generations (fail closed)."""
        have = self.generations.get(req.engine_id, ())
        if msg.generations and msg.generations != have:
            why = f"D read generations {msg.generations}, P's regions are {have}"
            self._count("pulls_stale_view")
            self._emit(req, wire.SendFailed(req.key, int(ErrorCode.TRANSFER), why))
            self._pull_refused(agent, msg, int(ErrorCode.TRANSFER), why)
            self._end(req, S.FAILED, Tombstone(int(ErrorCode.TRANSFER), why, by_base=False))
            return
        self._count("pulls_acked")
        if req.kept:
            self._count("kept_pulled")
        self._emit(req, wire.SendFinished(req.key))
        self._out.append(Notify(agent, wire.PullAck(msg.d_request_id, True, 0, "")))
        self._end(req, S.DELIVERED, _DONE)

    def _abort_waiting(self, req: SendRequest, ev: AbortSend, now: float) -> None:
        self._count("registrations_failed_p_abort")
        self._fail_waiting(req, _ABORTED, S.ABORTED)

    def _pull_not_now(self, req: SendRequest, ev: PullDoneArrived, now: float) -> None:
        why = f"request is {req.state.value}: not pullable"
        self._pull_refused(ev.agent, ev.msg, int(ErrorCode.INVALID), why)

    def _on_cancel(self, ev: CancelArrived, now: float) -> None:
        self._count("cancels_received")
        req = self._find(ev.request_id)
        if req is None:
            tomb = self._tomb(ev.request_id)
            if tomb is not None and tomb.agent and tomb.agent != ev.agent:
                self._count("foreign_requests_refused")
                self._reject(
                    ev.agent, f"cancel for request {ev.request_id!r}, bound to another peer"
                )
                return
            if tomb is not None and tomb.settled:
                # D may hold its blocks until P's word: nothing of this request is or will
                # be in flight (it ended settled), so it is answered, by D's id when known,
                # else by the id the cancel named
                self._count("cancels_answered_after_end")
                rid = tomb.d_request_id or ev.request_id
                done = wire.PushDone(rid, 0, False, tomb.code, tomb.reason)
                self._out.append(Notify(ev.agent, done))
            self._bury(ev.request_id, _CANCELLED)
            return
        if self._foreign(req, ev.agent, "cancel"):
            return
        self._step(req, ev, now)

    def _cancelled(self, req: SendRequest, ev: CancelArrived, now: float) -> None:
        if req.state is S.AWAITING:
            self._fail_waiting(req, _CANCELLED, S.FAILED)
            return
        self._count("leases_cancelled")
        self._log("info", "lease_cancelled_by_d", request_id=req.key, peer=ev.agent)
        self._emit(req, wire.SendFailed(req.key, _CANCELLED.code, _CANCELLED.reason))
        self._push_failed(req, _CANCELLED.code, _CANCELLED.reason)
        self._end(req, S.FAILED, _CANCELLED)

    def _cancel_under_write(self, req: SendRequest, ev: CancelArrived, now: float) -> None:
        pass  # the WRITE is in flight: its PushDone (after the bytes) answers D

    def _fail_waiting(self, req: SendRequest, tomb: Tombstone, state: SendState) -> None:
        """End an AWAITING request: whoever waits is answered."""
        if req.registration is not None:
            self._push_failed(req, tomb.code, tomb.reason)
        if req.early_pull is not None:
            self._pull_refused(req.agent, req.early_pull, tomb.code, tomb.reason)
        self._end(req, state, tomb)

    # ---------------------------------------------------------------- our own effects

    def _on_view(self, ev: ViewResolved, now: float) -> None:
        req = self.reqs.get(ev.key)
        if req is not None and req.state is S.STREAMING and not req.view_ready:
            self._stream_view(req, ev, now)
            return
        if req is None or req.state is not S.MATCHED or req.view_ready:
            return  # it ended meanwhile (expired, cancelled, aborted)
        if ev.error is not None:
            self._fail_send(req, int(ev.error.code), ev.error.message)
            return
        req.view, req.view_ready = ev.view, True
        self._write_when_synced(req, now)

    def _synced(self, req: SendRequest, now: float) -> bool:
        """Whether D re-synced since our last stall; if not, ask it (once per stall)."""
        if self.synced.get(req.agent, 0) >= self.stall_epoch:
            return True
        if req.agent not in self.resyncing:
            nonce = self.nonce(64)
            self.resyncing[req.agent] = (nonce, self.stall_epoch)
            self._timers.set(_RESYNC + req.agent, now + self.resync_timeout)
            self._count("stall_resyncs")
            self._out.append(Notify(req.agent, wire.Resync(nonce)))
        return False

    def _write_when_synced(self, req: SendRequest, now: float) -> None:
        if not self._synced(req, now):
            return
        self._goto(req, S.WRITING)
        self.leases.release(req.key)  # claimed: it cannot expire under the WRITE
        reg = req.registration
        assert reg is not None
        self._out.append(
            PostWrite(
                req.key, req.agent, req.engine_id, _p_blocks(req, reg), reg, req.view, req.tokens
            )
        )

    def _on_write_done(self, ev: WriteDone, now: float) -> None:
        req = self.reqs.get(ev.key)
        if req is None or req.state is not S.WRITING:
            raise LocalProtocolError(f"WriteDone for {ev.key!r}, which is not writing")
        if ev.error is None:
            self._written(req, ev.transfers)
        elif ev.unsettled:
            # no word to D yet: its blocks may still be written; ours are still read
            self._count("writes_unsettled")
            self._log("warning", "write_unsettled", request_id=req.key, peer=req.agent)
            req.unsettled = ev.error
            self._timers.set(req.key, now + self.unsettled_hold)
        else:
            self._fail_send(req, int(ev.error.code), ev.error.message)

    def _written(self, req: SendRequest, transfers: int) -> None:
        """The WRITE landed: D got its PushDone(s) with the bytes."""
        self._count("sends_ok")
        if req.registration is not None and req.registration.p_block_ids:
            self._count("pulls_written")
            if req.kept:
                self._count("kept_pulled")
        self._emit(req, wire.SendFinished(req.key))
        self._end(req, S.DELIVERED, replace(_DONE, pushed=transfers))

    def _on_write_settled(self, ev: WriteSettled, now: float) -> None:
        req = self.reqs.get(ev.key)
        if req is None or req.state is not S.WRITING or req.unsettled is None:
            if ev.error is None:
                self._count("writes_landed_after_release")  # D saw its PushDone(ok)
            return  # released at the hold bound already
        self._timers.discard(req.key)
        self._count("writes_settled")
        if ev.error is None:  # it landed after all: D got its PushDone with the bytes
            self._written(req, ev.transfers)
        else:
            self._fail_send(req, int(ev.error.code), ev.error.message)

    def _unsettled_timed_out(self, req: SendRequest, now: float) -> None:
        """Held past `unsettled_hold`: P's engine gets its blocks back (a late read of them
        can only reach D's blocks, which D holds until its own bound), D gets no word."""
        err = req.unsettled
        assert err is not None
        self._count("writes_unsettled_released")
        self._count("sends_failed")
        self._log("error", "write_unsettled_released", request_id=req.key, peer=req.agent)
        self._emit(req, wire.SendFailed(req.key, int(err.code), err.message[:1000]))
        tomb = Tombstone(int(err.code), err.message[:1000], by_base=False)
        self._end(req, S.FAILED, tomb, settled=False)

    def _fail_send(self, req: SendRequest, code: int, reason: str) -> None:
        self._count("push_failed")
        self._count("sends_failed")
        self._log("warning", "push_failed", request_id=req.key, peer=req.agent, error=reason)
        self._emit(req, wire.SendFailed(req.key, code, reason[:1000]))
        self._push_failed(req, code, reason)
        self._end(req, S.FAILED, Tombstone(code, reason[:1000], by_base=False))

    def _on_resync_acked(self, ev: ResyncAcked, now: float) -> None:
        pending = self.resyncing.get(ev.agent)
        if pending is None or pending[0] != ev.nonce:
            self._reject(ev.agent, "resync ack with an unknown nonce")
            return
        del self.resyncing[ev.agent]
        self._timers.discard(_RESYNC + ev.agent)
        self.synced[ev.agent] = pending[1]
        for req in self._matched_ready(ev.agent):
            if req.state is S.STREAMING:
                self._stream(req, now)
            else:
                self._write_when_synced(req, now)

    def _resync_timed_out(self, agent: str, now: float) -> None:
        if self.resyncing.pop(agent, None) is None:
            return
        self._count("resyncs_failed")
        why = f"peer {agent} did not re-sync after our stall"
        for req in self._matched_ready(agent):
            if req.state is S.STREAMING:
                self._stream_failed(req, int(ErrorCode.TRANSFER), why, now)
            else:
                self._fail_send(req, int(ErrorCode.TRANSFER), why)

    def _matched_ready(self, agent: str) -> list[SendRequest]:
        return [
            r
            for r in self.reqs.values()
            if r.state in (S.MATCHED, S.STREAMING) and r.view_ready and r.agent == agent
        ]

    def _on_stalled(self, ev: Stalled, now: float) -> None:
        self.stall_epoch += 1
        self._log("warning", "resync_after_stall", epoch=self.stall_epoch)
        for req in self.reqs.values():  # stalled, we heard nobody: D gets a lease from now
            if req.state is S.AWAITING and req.registration is not None:
                req.heard = max(req.heard, now)

    def _on_regions(self, ev: RegionsChanged, now: float) -> None:
        self.generations = dict(ev.generations)

    # ---------------------------------------------------------------- layer-wise push

    def _on_layers(self, ev: LayersSaved, now: float) -> None:
        req = self.reqs.get(ev.request_id)
        if req is None and ev.request_id in self.tombstones:
            req = None  # a late notice for a request that ended: never revives it
        elif req is None:
            req = self._find(ev.request_id)
        if req is None or not (
            (
                req.state is S.AWAITING
                and req.registration is not None
                and not req.registration.p_block_ids  # a pull by WRITE waits for the finish
            )
            or (req.state is S.STREAMING)
        ):
            # no registration yet (or P finished it first): P's finish writes it whole
            self._count("layers_unmatched")
            return
        if req.state is S.AWAITING:
            self._start_stream(req, ev, now)
            return
        st = req.stream
        assert st is not None
        if (
            ev.engine_id != st.engine_id
            or ev.block_ids != st.blocks
            or ev.tp_size != len(st.saved)
            or ev.num_layers != st.num_layers
        ):
            self._count("layers_refused")
            self._log(
                "warning",
                "layers_refused",
                request_id=req.key,
                peer=req.agent,
                reason="blocks changed",
            )
            return
        if ev.layers > st.saved[ev.tp_rank]:
            st.saved[ev.tp_rank] = ev.layers
            self._stream(req, now)

    def _start_stream(self, req: SendRequest, ev: LayersSaved, now: float) -> None:
        reg = req.registration
        assert reg is not None
        self._count("streams_started")
        # the request takes P's id now (as at a finish), keeping its registration's wait
        self._drop(req)
        req.key, req.engine_id, req.blocks = ev.request_id, ev.engine_id, ev.block_ids
        req.stream = Stream(ev.engine_id, ev.block_ids, ev.num_layers, saved=[0] * ev.tp_size)
        req.stream.saved[ev.tp_rank] = ev.layers
        self._add(req)
        self._goto(req, S.STREAMING)
        self._timers.set(req.key, req.since + self.registration_timeout)
        self._out.append(ResolveView(req.key, req.agent, reg))

    def _stream_view(self, req: SendRequest, ev: ViewResolved, now: float) -> None:
        if ev.error is not None:
            self._stream_failed(req, int(ev.error.code), ev.error.message, now)
            return
        req.view, req.view_ready = ev.view, True
        self._stream(req, now)

    def _stream(self, req: SendRequest, now: float) -> None:
        """WRITE every saved layer not yet handed to a WRITE (once D's view is resolved and
        D re-synced after any stall of ours)."""
        st, reg = req.stream, req.registration
        assert st is not None and reg is not None
        if st.whole:  # goes whole once P finished and nothing of it is in flight
            if req.state is S.STREAMING and st.finished and not st.in_flight and not st.ending:
                self._write_whole(req, now)
            return
        if st.ending is not None or not req.view_ready:
            return
        ready = min(st.saved)
        if ready <= st.posted or not self._synced(req, now):
            return
        p_blocks = st.blocks if reg.block_ids else ()  # how D's take P's: the planner's
        self._out.append(
            PostLayers(req.key, req.agent, st.engine_id, st.posted, ready, p_blocks, reg, req.view)
        )
        st.posted = ready
        st.in_flight += 1
        self._count("layer_writes")

    def _on_layers_written(self, ev: LayersWritten, now: float) -> None:
        req = self.reqs.get(ev.key)
        st = req.stream if req is not None else None
        if req is None or req.state is not S.STREAMING or st is None or st.in_flight <= 0:
            raise LocalProtocolError(f"LayersWritten for {ev.key!r}, which is not streaming")
        st.in_flight -= 1
        if ev.unsupported:
            if not st.whole:  # nothing was written: it goes whole at P's finish
                st.whole = True
                self._count("streams_whole")
            self._settle(req, now)
            return
        if ev.error is not None and ev.unsettled:
            self._stream_unsettled(req, ev.error, now)
            return
        if ev.error is not None:
            self._stream_failed(req, int(ev.error.code), ev.error.message, now)
            return
        st.written += ev.end - ev.first
        self._settle(req, now)

    def _finish_stream(self, req: SendRequest, ev: Finish, now: float) -> None:
        """P's engine finished a streaming request: every layer is in host memory now, so
        what no worker announced is written at once (no wait for late announcements)."""
        st, reg = req.stream, req.registration
        assert st is not None and reg is not None
        if st.finished:
            raise InvalidRequest(f"request {ev.request_id!r} already finished")
        st.finished = True
        req.session = ev.session
        self._timers.discard(req.key)
        self._count("stream_finishes")
        if st.ending is not None:  # it ends once its WRITEs return; P's engine hears how
            if st.ending.event is None:
                failed = wire.SendFailed(req.key, st.ending.tomb.code, st.ending.tomb.reason)
                st.ending = replace(st.ending, event=failed)
            self._settle(req, now)
            return
        if not ev.block_ids:  # P's engine gave the request up (an empty finish says so)
            self._stream_failed(req, int(ErrorCode.TRANSFER), "P finished it with no blocks", now)
            return
        if ev.engine_id != st.engine_id or ev.block_ids != st.blocks:
            why = "P finished the request with other blocks than its workers streamed"
            self._stream_failed(req, int(ErrorCode.INVALID), why, now)
            return
        st.saved = [st.num_layers] * len(st.saved)
        self._stream(req, now)
        self._settle(req, now)

    def _write_whole(self, req: SendRequest, now: float) -> None:
        """A stream that cannot go by layer, P finished and nothing in flight: one WRITE of
        the whole request, as when D registers after P's finish."""
        reg = req.registration
        assert reg is not None
        if not self._synced(req, now):
            return
        self._goto(req, S.WRITING)
        self._out.append(
            PostWrite(
                req.key, req.agent, req.engine_id, _p_blocks(req, reg), reg, req.view, req.tokens
            )
        )

    def _settle(self, req: SendRequest, now: float) -> None:
        """End a streaming request once nothing of it is in flight and its fate is known."""
        st = req.stream
        assert st is not None
        if st.in_flight:
            return
        if st.ending is not None:
            end = st.ending
            if end.event is not None:
                self._emit(req, end.event)
            if not st.complete() and end.settled:
                self._push_failed(req, end.tomb.code, end.tomb.reason)
            self._end(req, end.state, end.tomb, settled=end.settled)
        elif st.finished and st.whole:
            self._stream(req, now)
        elif st.finished and st.complete():
            self._count("sends_ok")
            self._count("sends_layered")
            self._emit(req, wire.SendFinished(req.key))
            self._end(req, S.DELIVERED, _DONE)

    def _stream_ending(self, req: SendRequest, ending: _Ending, now: float) -> None:
        st = req.stream
        assert st is not None
        if st.ending is None:
            st.ending = ending
        self._settle(req, now)

    def _stream_unsettled(self, req: SendRequest, err: KvdError, now: float) -> None:
        """A layer WRITE held past `unsettled_hold` (`_unsettled_timed_out` for a stream):
        P's engine gets its blocks back once nothing else is in flight, D gets no word."""
        st = req.stream
        assert st is not None
        self._count("writes_unsettled_released")
        self._log("error", "write_unsettled_released", request_id=req.key, peer=req.agent)
        if st.ending is not None:  # failed already: its end must not tell D either
            st.ending = replace(st.ending, settled=False)
            self._settle(req, now)
            return
        self._count("sends_failed")
        event = wire.SendFailed(req.key, int(err.code), err.message[:1000]) if st.finished else None
        tomb = Tombstone(int(err.code), err.message[:1000], by_base=False)
        self._stream_ending(req, _Ending(S.FAILED, tomb, event, settled=False), now)

    def _stream_failed(self, req: SendRequest, code: int, reason: str, now: float) -> None:
        st = req.stream
        assert st is not None
        if st.ending is None:
            self._count("push_failed")
            self._count("sends_failed")
            self._log("warning", "push_failed", request_id=req.key, peer=req.agent, error=reason)
        event = wire.SendFailed(req.key, code, reason[:1000]) if st.finished else None
        tomb = Tombstone(code, reason[:1000], by_base=False)
        self._stream_ending(req, _Ending(S.FAILED, tomb, event), now)

    def _stream_aborted(self, req: SendRequest, ev: AbortSend, now: float) -> None:
        st = req.stream
        assert st is not None
        self._count("streams_aborted")
        event = (
            wire.SendFailed(req.key, int(ErrorCode.TRANSFER), "aborted") if st.finished else None
        )
        self._stream_ending(req, _Ending(S.ABORTED, _ABORTED, event), now)

    def _stream_operator_aborted(self, req: SendRequest, ev: ForceAbort, now: float) -> None:
        """`kvd abort` mid-stream: nothing more is written; it ends once its WRITEs return."""
        st = req.stream
        assert st is not None
        event = wire.SendFailed(req.key, _OPERATOR.code, _OPERATOR.reason) if st.finished else None
        self._stream_ending(req, _Ending(S.ABORTED, _OPERATOR, event), now)

    def _stream_cancelled(self, req: SendRequest, ev: CancelArrived, now: float) -> None:
        st = req.stream
        assert st is not None
        self._count("leases_cancelled")
        self._log("info", "stream_cancelled_by_d", request_id=req.key, peer=ev.agent)
        event = (
            wire.SendFailed(req.key, _CANCELLED.code, _CANCELLED.reason) if st.finished else None
        )
        self._stream_ending(req, _Ending(S.FAILED, _CANCELLED, event), now)

    def _stream_timed_out(self, req: SendRequest, now: float) -> None:
        why = f"P's engine did not finish the request within {self.registration_timeout}s"
        st = req.stream
        assert st is not None
        if not st.finished:
            tomb = Tombstone(int(ErrorCode.TIMEOUT), why, refuses_finish=True)
            self._stream_ending(req, _Ending(S.FAILED, tomb, None), now)

    # ---------------------------------------------------------------- time

    def _expire(self, req: SendRequest, now: float) -> None:
        self._count("leases_expired")
        if req.kept:
            self._count("kept_expired")
        self._log(
            "info",
            "lease_expired",
            request_id=req.key,
            peer=req.agent,  # "" when no D ever registered for it
            late_s=round(now - req.since, 4),
        )
        self._emit(req, wire.SendExpired(req.key))
        self._push_failed(req, _EXPIRED.code, _EXPIRED.reason)
        self._end(req, S.EXPIRED, _EXPIRED)

    def _wait_due_now(self, req: SendRequest, now: float) -> None:
        if req.registration is None or now >= req.since + self.registration_timeout:
            self._wait_timed_out(req, now)
        elif now >= req.heard + self.lease_duration:
            self._abandoned(req, now)
        else:  # heard from D since: looked at again a lease after that
            self._timers.set(req.key, self._wait_due(req))

    def _abandoned(self, req: SendRequest, now: float) -> None:
        """D stopped heartbeating a registration that waits for P's finish: it ended the
        request (its cancel lost on the way, or sent to a P it took for this one) or is
        cut off for longer than a lease. Answered failed (a D still there recomputes);
        P's finish of it, if it comes, ends at once: nobody would take the blocks."""
        self._count("registrations_abandoned")
        self._log(
            "info",
            "registration_abandoned",
            request_id=req.key,
            peer=req.agent,
            silent_s=round(now - req.heard, 3),
        )
        self._fail_waiting(req, _ABANDONED, S.FAILED)

    def _wait_timed_out(self, req: SendRequest, now: float) -> None:
        if req.early_pull is not None:
            why = f"no lease for this request within {self.lease_wait_timeout}s"
            tomb = Tombstone(int(ErrorCode.NOT_FOUND), why, refuses_finish=True)
        else:
            why = f"P's engine did not finish the request within {self.registration_timeout}s"
            tomb = Tombstone(int(ErrorCode.TIMEOUT), why, refuses_finish=True)
        self._fail_waiting(req, tomb, S.FAILED)

    # ---------------------------------------------------------------- dispatch

    def _step(self, req: SendRequest, ev: Event, now: float) -> None:
        handler = _ON.get((req.state, type(ev)))
        if handler is None:
            self._reject(getattr(ev, "agent", ""), f"{type(ev).__name__} while {req.state.value}")
            return
        handler(self, req, ev, now)

    # ---------------------------------------------------------------- views

    def held(self) -> Iterable[SendRequest]:
        return (r for r in self.reqs.values() if r.state is not S.AWAITING)

    def by_state(self) -> dict[str, int]:
        """Live requests per state (kept as they move: O(states), not O(requests))."""
        return {s.value: self._states[s] for s in S if s not in TERMINAL}

    def limits(self) -> dict[str, dict[str, int]]:
        """Its limits, their use and refusals (for `kvd status`)."""
        c = self.counters
        busiest = max(self._awaiting_by_agent.values(), default=0)
        return {
            "pending_registrations_per_peer": {
                "limit": self.max_pending_per_peer,
                "used": busiest,
                "refused": c.get("limit_pending_registrations_refused", 0),
            },
            "pending_bytes": {
                "limit": self.budget.limit,
                "used": self.budget.used,
                "peak": self.budget.peak,
                "refused": self.budget.refused,
            },
        }

    def awaiting(self) -> tuple[int, int]:
        """D's push registrations and early pulls waiting for P's finish."""
        return self._awaiting_registrations, self._awaiting_pulls


def _p_blocks(req: SendRequest, reg: wire.PushRegistration) -> tuple[int, ...]:
    """The P blocks a WRITE sends: those a pull by WRITE names, else every block P finished
    (D's registered blocks take their tail; none if D registered none)."""
    if reg.p_block_ids:
        return reg.p_block_ids
    return req.blocks if reg.block_ids else ()


_EXPIRED: Final = Tombstone(
    int(ErrorCode.LEASE_EXPIRED), "the lease expired before the transfer completed"
)
_CANCELLED: Final = Tombstone(int(ErrorCode.TRANSFER), "cancelled by D", refuses_finish=True)
_ABORTED: Final = Tombstone(int(ErrorCode.NOT_FOUND), "P aborted the request")
_GONE: Final = Tombstone(
    int(ErrorCode.TRANSFER), "P's engine session ended before the request was sent"
)
_P_RESTARTED: Final = Tombstone(
    int(ErrorCode.TRANSFER),
    "P's kvd daemon restarted since it leased the blocks (the request names the daemon "
    "before): the lease and the KV are gone",
    by_base=False,
)
_KEPT_NOT_PUSHED: Final = Tombstone(
    int(ErrorCode.INVALID),
    "these blocks are kept on D for the next turn: they are pulled, not pushed",
    by_base=False,
)
_DONE: Final = Tombstone(int(ErrorCode.INVALID), "the request was already delivered", by_base=False)
_DRAINING: Final = Tombstone(
    int(ErrorCode.SHUTTING_DOWN),
    "P's kvd daemon is draining (going out of service): it grants no new leases",
    refuses_finish=True,
)
_ABANDONED: Final = Tombstone(
    int(ErrorCode.TIMEOUT),
    "D did not heartbeat its registration for a lease while it waited for P's finish",
    refuses_finish=True,
)
_RESTARTED: Final = Tombstone(
    int(ErrorCode.TRANSFER), "D's daemon restarted since it registered", refuses_finish=True
)
_OPERATOR: Final = Tombstone(
    int(ErrorCode.TRANSFER), "aborted by the operator (kvd abort) on P", refuses_finish=True
)

_HANDLERS: Final[dict[type, Callable[[Sender, Any, float], None]]] = {
    Finish: Sender._on_finish,
    FinishRefused: Sender._on_finish_refused,
    AbortSend: Sender._on_abort,
    EndSession: Sender._on_end_session,
    StartDrain: Sender._on_start_drain,
    ForceAbort: Sender._on_force_abort,
    RegistrationArrived: Sender._on_registration,
    HeartbeatArrived: Sender._on_heartbeat,
    PullDoneArrived: Sender._on_pull_done,
    CancelArrived: Sender._on_cancel,
    ViewResolved: Sender._on_view,
    WriteDone: Sender._on_write_done,
    WriteSettled: Sender._on_write_settled,
    LayersSaved: Sender._on_layers,
    LayersWritten: Sender._on_layers_written,
    ResyncAcked: Sender._on_resync_acked,
    Stalled: Sender._on_stalled,
    RegionsChanged: Sender._on_regions,
    PeerIncarnation: Sender._on_peer_incarnation,
}

_ON: Final[dict[tuple[SendState, type], Callable[[Sender, SendRequest, Any, float], None]]] = {
    # P's engine aborts
    (S.AWAITING, AbortSend): Sender._abort_waiting,
    (S.HELD, AbortSend): Sender._aborted,
    (S.MATCHED, AbortSend): Sender._aborted,
    (S.WRITING, AbortSend): lambda self, req, ev, now: None,  # the WRITE's end answers
    # the operator aborts (WRITING is refused before: the WRITE's end answers)
    (S.AWAITING, ForceAbort): Sender._operator_aborted,
    (S.HELD, ForceAbort): Sender._operator_aborted,
    (S.MATCHED, ForceAbort): Sender._operator_aborted,
    (S.STREAMING, AbortSend): Sender._stream_aborted,
    (S.STREAMING, ForceAbort): Sender._stream_operator_aborted,
    # D registers
    (S.HELD, RegistrationArrived): Sender._held_registered,
    (S.AWAITING, RegistrationArrived): Sender._duplicate_registration,
    (S.MATCHED, RegistrationArrived): Sender._duplicate_registration,
    (S.WRITING, RegistrationArrived): Sender._duplicate_registration,
    (S.STREAMING, RegistrationArrived): Sender._duplicate_registration,
    # D's READ completed
    (S.HELD, PullDoneArrived): Sender._held_pulled,
    (S.AWAITING, PullDoneArrived): Sender._pull_not_now,
    (S.MATCHED, PullDoneArrived): Sender._pull_not_now,
    (S.WRITING, PullDoneArrived): Sender._pull_not_now,
    (S.STREAMING, PullDoneArrived): Sender._pull_not_now,
    # D cancels
    (S.AWAITING, CancelArrived): Sender._cancelled,
    (S.HELD, CancelArrived): Sender._cancelled,
    (S.MATCHED, CancelArrived): Sender._cancelled,
    (S.WRITING, CancelArrived): Sender._cancel_under_write,
    (S.STREAMING, CancelArrived): Sender._stream_cancelled,
}
