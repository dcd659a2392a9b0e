"""The transport port, and the book of transfers one actor has in flight.

`Transport` is all the sender and receiver actors need of NIXL: send a notification,
post a transfer and wait for it. `kvd.adapters.nixl.NixlEngine` implements it; a test
can implement it with a fake that injects faults.

`TransferBook` posts the descriptors of every rank pair (`kvd.core.topology.map_ranks`)
of a request as one NIXL transfer per pair of memory types (usually one) and keeps, for
the region drains, how many transfers touch each local region and each remote (agent,
region): a region is freed (locally) or forgotten (a peer's) only once nothing in flight
touches it, and no new transfer starts from a local region being released. It also keeps
the recent transfers for `kvd transfers`. Each actor owns its own book (no state shared
between actors).

`TransferActor` is the shell both actors share: the loop that sleeps until the machine's
next deadline or the next message, feeds the machine, and carries out the effects common
to both sides (events to clients, notifications, session ends, logs); each side adds the
messages and effects of its own.

With the daemon's stage trace on (`kvd.core.trace`), the shell records a request's
stages as `<actor>.<stage>` (and the book `transfer.handed`/`transfer.returned`); the
transport is passed the request id to record its own under (`nixl.*`).
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Final, Protocol

import anyio
import numpy as np
import structlog
from anyio.abc import TaskStatus
from kvd_client import wire
from kvd_client.errors import (
    ErrorCode,
    InvalidRequest,
    KvdError,
    NotFound,
    TransferError,
)

from kvd.actors.base import Mailbox
from kvd.actors.messages import (
    AbortByOperator,
    ClientRequest,
    DrainLocalRegion,
    DrainRemoteRegion,
    EventOut,
    LocalRegion,
    PeerInfo,
    RemoteRegion,
    SessionClosed,
    Snapshot,
    StartDrain,
)
from kvd.core.effects import Drained, Emit, Log, Notify, Refused, SessionEnded
from kvd.core.planner import Plan
from kvd.core.stats import TransferStats, XferTiming
from kvd.core.trace import NO_TRACE, StageTrace, trace_key
from kvd.logs import RejectLog

if TYPE_CHECKING:
    from kvd.adapters.staging import StagingArea

RECENT_TRANSFERS: Final = 256
DRAIN_LISTED: Final = 100
"""Live requests each side lists in the `drain` status section (the count is exact)."""


BURST_DEPTH: Final = 32
"""Outside messages waiting in an actor's mailbox from which a turn takes `burst_batch`."""


class Transport(Protocol):
    """What the transfer actors need of the data plane (NixlEngine implements it)."""

    async def send_notif(self, peer: str, msg: bytes, trace_id: str = "") -> None:
        """Send one notification to a peer agent; raises TransferError (PeerDisconnected
        when NIXL knows the peer is gone, PeerUnknown when it holds no agent of that name:
        the view the caller resolved was dropped or replaced meanwhile). `trace_id`: the
        request the stage trace records the sending under ("" = none)."""

    def post_notif(
        self,
        peer: str,
        msg: bytes,
        done: Callable[[KvdError | None], None],
        trace_id: str = "",
        *,
        report_ok: bool = True,
    ) -> None:
        """Send one notification without waiting: `done` is called later on the event loop
        with the error `send_notif` would raise, or None once sent (only if `report_ok`)."""

    async def transfer(
        self,
        op: str,
        local: np.ndarray,
        remote: np.ndarray,
        peer: str,
        notif: bytes,
        timeout: float,  # noqa: ASYNC109 - enforced by the transport, which owns the handle
        nbytes: int,
        local_mem: str = "DRAM",
        remote_mem: str = "DRAM",
        trace_id: str = "",
        settled: Callable[[], None] | None = None,
        *,
        post_by: float = 0.0,
    ) -> XferTiming:
        """Post a WRITE or READ of Nx3 (addr, len, dev) descriptor arrays and wait for it;
        `notif` is delivered to the peer when it completes. Returns its post and transfer
        times (fed to the actor's histograms). Raises as `send_notif` does
        (PeerUnknown also when the peer's metadata lacks the remote memory named).
        `trace_id` as above. `settled`: called once on the loop when nothing more of the
        transfer can land (it ended, or was never posted): before the answer, or after
        it for a transfer answered Unsettled (still in flight in UCX). `post_by` (raw
        `time.monotonic()`, 0 = none): the freshness fence: not posted at all
        (TransferError, nothing moved) once it has passed, e.g. after a stall between the
        decision to write and the post."""

    def submit(
        self,
        op: str,
        local: np.ndarray,
        remote: np.ndarray,
        peer: str,
        notif: bytes,
        timeout: float,
        nbytes: int,
        local_mem: str = "DRAM",
        remote_mem: str = "DRAM",
        trace_id: str = "",
        settled: Callable[[], None] | None = None,
        *,
        post_by: float = 0.0,
    ) -> asyncio.Future[XferTiming]:
        """`transfer` without the wait: handed to the data plane before this returns; the
        future is what `transfer` would return or raise (it may also raise here, having
        called `settled`: nothing was posted)."""


class Machine(Protocol):
    """What the shell needs of a protocol machine (`kvd.core.sender`/`receiver`)."""

    def handle(self, event: Any, now: float) -> list[Any]: ...

    def handle_timer(self, now: float) -> list[Any]: ...

    def next_deadline(self) -> float | None: ...

    @property
    def reqs(self) -> Mapping[str, Any]: ...


@dataclass(frozen=True)
class Outcome:
    """The outcome of the actor's own work (a transfer, a notification, a lookup), fed to
    the machine in the loop: only the loop touches the machine."""

    event: Any


class TransferActor:
    """The shell of a transfer protocol machine (see the module docstring)."""

    name: ClassVar[str]
    proto: Machine

    def __init__(
        self,
        *,
        transport: Transport,
        mailbox: Mailbox[Any],
        registrar: Mailbox[Any],
        emit: Callable[[EventOut], None],
        transfer_timeout: float,
        counters: dict[str, int],
        rejects: RejectLog | None = None,
        trace: StageTrace = NO_TRACE,
    ) -> None:
        self.transport = transport
        self.mailbox = mailbox
        self.clock = mailbox.clock
        self.registrar = registrar
        self.emit = emit
        self.counters = counters
        self.rejects = rejects or RejectLog(counters, 10.0)
        self.log = structlog.get_logger(f"kvd.{self.name}", actor=self.name)
        self.trace = trace
        self.book = TransferBook(transport, transfer_timeout, counters, trace)
        self.local: dict[tuple[str, int], LocalRegion] = {}
        self.peers: dict[str, PeerInfo] = {}
        self.closing: dict[str, list[SessionClosed]] = {}
        self.drains: list[StartDrain] = []
        """Drain calls waiting for the machine's `Drained`."""
        self._tg: anyio.abc.TaskGroup | None = None
        self._ready: deque[Any] = deque()
        """Events an effect produced at once (no IO needed): fed in the same turn."""
        self._draining = False
        self.failures: dict[str, int] = {}
        """Requests this side ended failed or expired, by reason (the error code's name,
        or `expired`), counted as the terminal event leaves for the client."""

    async def _staging_ready(self, staging: StagingArea, rid: str) -> bool:
        """Map and register the staging area (once); False, counted and logged, when it
        cannot be (the request then moves by direct descriptors)."""
        try:
            await staging.ensure()
        except KvdError as exc:
            self._count("staging_unavailable")
            self.log.warning("staging_unavailable", request_id=rid, error=exc.message)
            return False
        return True

    def busy(self) -> bool:
        """Whether any request of this side is live (read from the NIXL thread too: one
        plain read of the machine's table)."""
        return bool(self.proto.reqs)

    def _hold_regions(self, regions: list[LocalRegion]) -> None:
        """Count a step of our own on local regions (a receive scatter, a push's gather)
        like a transfer (a drain waits for it); TransferError, holding nothing, if one is
        being released."""
        book = self.book
        for loc in regions:
            if loc.region_id in book.releasing:
                raise TransferError(f"local region {loc.region_id} is being released")
        for loc in regions:
            book.local[loc.region_id] = book.local.get(loc.region_id, 0) + 1

    def _unhold_regions(self, regions: list[LocalRegion]) -> None:
        book = self.book
        for loc in regions:
            book.local[loc.region_id] -= 1
        book.wake()

    # ---------------------------------------------------------------- loop

    turn_batch: ClassVar[int] = 1
    """Messages already waiting that one turn of the loop takes together (the sender takes
    several, so that layer WRITEs ready at once coalesce in `_turn_end`)."""

    burst_batch: ClassVar[int] = 16
    """What one turn takes while at least `BURST_DEPTH` outside messages wait. A request's
    own notices (outcomes) share the mailbox with the requests: taking one message a turn
    while the gateway posts one request a turn, the receiver fell behind in a burst of
    registrations and refused 940 of 5,000 BUSY; taking 16 it refused none."""

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            while True:
                msg: Any = await self.mailbox.receive_before(self.proto.next_deadline())
                now = self.clock.now()
                self._woke(now)
                if msg is not None:
                    self._dispatch(msg, now)
                    batch = self.turn_batch
                    if self.mailbox.outside >= BURST_DEPTH:
                        batch = max(batch, self.burst_batch)
                    for _ in range(batch - 1):
                        if not self.mailbox.depth():
                            break
                        self._dispatch(self.mailbox.receive_nowait(), now)
                self._carry_out(self.proto.handle_timer(now))
                self._turn_end()

    def _turn_end(self) -> None:
        """Called last at every turn of the loop (the sender posts its coalesced WRITEs)."""

    def _woke(self, now: float) -> None:
        """Called first at every turn of the loop (the sender checks for a stall)."""

    def _feed(self, event: Any, now: float) -> None:
        self._carry_out(self.proto.handle(event, now))

    def _dispatch(self, msg: Any, now: float) -> None:
        if isinstance(msg, Outcome):
            self._feed(msg.event, now)
        elif isinstance(msg, ClientRequest):
            self._client(msg, now)
        elif isinstance(msg, SessionClosed):
            self.closing.setdefault(msg.session, []).append(msg)
            self._feed(self._end_session(msg.session), now)
        elif isinstance(msg, DrainLocalRegion):
            self._spawn(self._drain_local, msg)
        elif isinstance(msg, DrainRemoteRegion):
            info = self.peers.get(msg.agent)
            if info is not None:  # never plan into it again
                regions = {k: v for k, v in info.regions.items() if v.region_id != msg.region_id}
                self.peers[msg.agent] = PeerInfo(**{**info.__dict__, "regions": regions})
            self._spawn(self._drain_remote, msg)
        elif isinstance(msg, Snapshot):
            msg.resolve(self.snapshot(msg.section, now))
        elif isinstance(msg, StartDrain):
            self.drains.append(msg)
            self._feed(self._start_drain(), now)
        elif isinstance(msg, AbortByOperator):
            self._operator_abort(msg, now)
        elif not self._own(msg, now):
            raise TypeError(f"{self.name} got {type(msg).__name__}")

    def _own(self, msg: Any, now: float) -> bool:
        """Handle a message only this side knows; False if it is not one."""
        raise NotImplementedError

    def _end_session(self, session: str) -> Any:
        raise NotImplementedError

    def _start_drain(self) -> Any:
        """The machine's StartDrain event."""
        raise NotImplementedError

    def _force_abort(self, request_id: str) -> Any:
        """The machine's ForceAbort event."""
        raise NotImplementedError

    def _state_of(self, request_id: str) -> str:
        """The live request's state ("" if none)."""
        raise NotImplementedError

    def _operator_abort(self, msg: AbortByOperator, now: float) -> None:
        was = self._state_of(msg.request_id)
        try:
            self._feed(self._force_abort(msg.request_id), now)
        except KvdError as exc:
            msg.fail(exc)
            return
        now_state = self._state_of(msg.request_id)
        msg.resolve({"was": was, "now": now_state or "ended"})

    def _client_event(self, req: ClientRequest) -> Any:
        """The machine's event for a client request; raises KvdError to refuse it."""
        raise NotImplementedError

    def _client(self, req: ClientRequest, now: float) -> None:
        m = req.msg
        if self.trace.on:
            self._mark(trace_key(m), "dequeued")
        try:
            self._feed(self._client_event(req), now)
        except KvdError as exc:
            self.rejects.reject(
                self.name,
                "requests_rejected",
                "request_rejected",
                type(exc).__name__,
                request_id=getattr(m, "request_id", ""),
                peer=_peer_addr(m),
                error=exc.message,
            )
            req.fail(exc)
            return
        req.resolve(wire.Ok())
        if self.trace.on:
            self._mark(trace_key(m), "admitted")

    def _mark(self, request_id: str, stage: str) -> None:
        """Record `<actor>.<stage>` for the request (call only with the trace on)."""
        if request_id:
            self.trace.mark(request_id, sys.intern(f"{self.name}.{stage}"))

    def _known(self, agent: str, msg: wire.Record) -> bool:
        """Only a peer that handshaked may speak to the machine."""
        if agent in self.peers:
            return True
        self._reject_notif(
            agent, "unknown_agent", f"{type(msg).__name__} from an agent that never handshaked"
        )
        return False

    def _reject_notif(self, agent: str, kind: str, reason: str) -> None:
        self.rejects.reject(
            self.name, "notifs_rejected", "notif_rejected", kind, peer=agent, reason=reason
        )

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    # ---------------------------------------------------------------- effects

    def _carry_out(self, effects: list[Any]) -> None:
        """Carry out the machine's effects in order, then feed it the events that some of
        them produced at once (`_ready`), and so on, in this turn of the loop: no hop
        through the mailbox where nothing had to be awaited."""
        self._carry_out_each(effects)
        if self._draining:
            return  # an outer call feeds what is ready
        self._draining = True
        try:
            while self._ready:
                self._carry_out_each(self.proto.handle(self._ready.popleft(), self.clock.now()))
        finally:
            self._draining = False

    def _carry_out_each(self, effects: list[Any]) -> None:
        for eff in effects:
            if isinstance(eff, Emit):
                reason = failure_reason(eff.record)
                if reason is not None:
                    self.failures[reason] = self.failures.get(reason, 0) + 1
                self._emit(EventOut(eff.session, eff.engine_id, eff.record))
            elif isinstance(eff, Notify):
                self._notify(eff)
            elif isinstance(eff, SessionEnded):
                for call in self.closing.pop(eff.session, []):
                    call.resolve(None)
            elif isinstance(eff, Drained):
                for drain in self.drains:
                    drain.resolve(None)
                self.drains.clear()
            elif isinstance(eff, Log):
                getattr(self.log, eff.level)(eff.event, **eff.fields)
            elif isinstance(eff, Refused):
                self.rejects.reject(self.name, eff.counter, eff.event, eff.kind, **eff.fields)
            else:
                self._carry_out_own(eff)

    def _carry_out_own(self, eff: Any) -> None:
        raise NotImplementedError

    def _emit(self, ev: EventOut) -> None:
        """An event to the engine's clients (the receiver may hold one back)."""
        self.emit(ev)

    def _spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        assert self._tg is not None
        self._tg.start_soon(fn, *args)

    def _outcome(self, event: Any) -> None:
        self.mailbox.post(Outcome(event))

    def _notify(self, eff: Notify) -> None:
        """Send a notification nothing waits on; a failure is logged."""
        rid = ""
        if self.trace.on:
            rid = trace_key(eff.record)
            self._mark(rid, "notif_handed")

        def done(exc: KvdError | None) -> None:
            if exc is not None:
                self._count("notifs_failed")
                self.log.warning(
                    "notification_not_delivered",
                    request_id=trace_key(eff.record),
                    peer=eff.agent,
                    type=type(eff.record).__name__,
                    error=exc.message,
                )

        self.transport.post_notif(eff.agent, wire.encode(eff.record), done, rid, report_ok=False)

    async def _drain_local(self, msg: DrainLocalRegion) -> None:
        await self.book.drain_local(msg.region_id)
        msg.resolve(None)

    async def _drain_remote(self, msg: DrainRemoteRegion) -> None:
        await self.book.drain_remote(msg.agent, msg.region_id)
        msg.resolve(None)

    def snapshot(self, section: str, now: float) -> dict[str, Any]:
        raise NotImplementedError


@dataclass
class _Group:
    """One NIXL transfer of a `Running` request (or, with no descriptors, its notification
    alone)."""

    nbytes: int
    descriptors: int
    notif: bytes
    answer: asyncio.Future[XferTiming] | None = None
    """The transport's answer, once handed over."""
    error: KvdError | None = None
    """The transport refused to post it."""
    unposted: Callable[[], None] | None = None
    """Called once the group is over when nothing of it was posted (the transport calls
    the end of a posted transfer itself)."""

    def settle(self) -> None:
        done, self.unposted = self.unposted, None
        if done is not None:
            done()

    def abandon(self) -> None:
        """The waiting for it ended early (cancelled): nothing waits on its answer now."""
        self.settle()
        ans = self.answer
        if ans is None:
            return
        if not ans.done():
            ans.cancel()
        elif not ans.cancelled():
            ans.exception()  # retrieved: a failure nobody waits for is not logged as lost


@dataclass
class Running:
    """A request's transfers handed over by `TransferBook.start`, for `finish`."""

    op: str
    rid: str
    agent: str
    rec: dict[str, Any]
    total: int
    descs: int
    t0: float
    post_by: float
    trace_id: str = ""
    groups: list[_Group] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.rid}:{self.op}"


class TransferBook:
    """Transfers in flight from one actor, by region (see the module docstring)."""

    def __init__(
        self,
        transport: Transport,
        transfer_timeout: float,
        counters: dict[str, int],
        trace: StageTrace = NO_TRACE,
    ) -> None:
        self.transport = transport
        self.trace = trace
        self.transfer_timeout = transfer_timeout
        self.counters = counters
        self.in_flight: dict[str, dict[str, Any]] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_TRANSFERS)
        self.local: dict[int, int] = {}
        self.remote: dict[tuple[str, int], int] = {}
        self.releasing: set[int] = set()
        self._wakeup: anyio.Event | None = None
        self.stats = TransferStats()
        """Every completed NIXL transfer's times, bytes and descriptors (the exporter and
        `kvd status` read them; only this book writes them)."""
        self.by_peer: dict[str, list[int]] = {}
        """Per peer agent: [requests transferred, bytes, requests failed] (`kvd top`)."""

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    async def run(
        self,
        op: str,
        rid: str,
        agent: str,
        local: Sequence[LocalRegion],
        remote: Sequence[RemoteRegion],
        plans: Sequence[Plan],
        notifs: Sequence[bytes],
        settled: Callable[[], None] | None = None,
        *,
        post_by: float = 0.0,
    ) -> None:
        """Move `plans[i]` between `local[i]` and `remote[i]` for every rank pair i, as one
        NIXL transfer per group of pairs of the same memory types (`transfer_groups`:
        usually one for the whole request), posted concurrently; `notifs[g]` goes with
        group g. Waits for all; raises the first failure (a KvdError). A group with no
        descriptors only sends its notification. `settled`: called once (on the loop) when
        nothing more of any of them can land (see `Transport.transfer`), possibly after
        this returns or raises (a transfer answered Unsettled)."""
        await self.finish(
            self.start(op, rid, agent, local, remote, plans, notifs, settled, post_by=post_by)
        )

    def start(
        self,
        op: str,
        rid: str,
        agent: str,
        local: Sequence[LocalRegion],
        remote: Sequence[RemoteRegion],
        plans: Sequence[Plan],
        notifs: Sequence[bytes],
        settled: Callable[[], None] | None = None,
        *,
        post_by: float = 0.0,
    ) -> Running:
        """`run`'s first half, on the caller's turn of the loop: every group's transfer is
        handed to the transport before this returns (a task spawned to run it would wait
        for a later turn, behind whatever else the loop has to do). `finish` waits for
        them. Raises a KvdError (and has called `settled`) when nothing can be posted."""
        groups = transfer_groups(local, remote)
        try:
            for loc in local:
                if loc.region_id in self.releasing:
                    raise TransferError(f"local region {loc.region_id} is being released")
            if len(notifs) != len(groups):
                raise KvdError(f"{len(notifs)} notifications for {len(groups)} transfers")
        except KvdError:
            if settled is not None:
                settled()
            raise
        # The regions stay counted (a drain waits) until nothing more of any group can
        # land, which for a transfer answered Unsettled is after `finish` returns.
        left = [len(groups)]

        def one_ended() -> None:
            left[0] -= 1
            if left[0] == 0:
                for loc, rem in zip(local, remote, strict=True):
                    self.local[loc.region_id] -= 1
                    self.remote[(agent, rem.region_id)] -= 1
                self.wake()
                if settled is not None:
                    settled()

        total = sum(p.total_bytes for p in plans)
        descs = sum(p.descriptors for p in plans)
        rec: dict[str, Any] = {
            "request_id": rid,
            "op": op,
            "peer": agent,
            "bytes": total,
            "descriptors": descs,
            "ranks": len(plans),
            "transfers": len(groups),
            "state": "in_flight",
            "started": time.time(),
        }
        run = Running(op, rid, agent, rec, total, descs, time.perf_counter(), post_by)
        self.in_flight[run.key] = rec
        for loc, rem in zip(local, remote, strict=True):
            self.local[loc.region_id] = self.local.get(loc.region_id, 0) + 1
            self.remote[(agent, rem.region_id)] = self.remote.get((agent, rem.region_id), 0) + 1
        if self.trace.on:
            run.trace_id = rid
            self.trace.mark(rid, "transfer.handed")
        for group, notif in zip(groups, notifs, strict=True):
            lo, re_, nbytes, lmem, rmem = _merged(plans, local, remote, group)
            run.groups.append(self._submit(run, lo, re_, nbytes, lmem, rmem, notif, one_ended))
        return run

    def _submit(
        self,
        run: Running,
        local: np.ndarray,
        remote: np.ndarray,
        nbytes: int,
        local_mem: str,
        remote_mem: str,
        notif: bytes,
        settled: Callable[[], None],
    ) -> _Group:
        """One group's transfer handed to the transport now (or, with no descriptors, its
        notification left for `finish` to send); a refusal to post is kept as its answer."""
        group = _Group(nbytes, int(local.shape[0]), notif)
        if group.descriptors == 0:
            group.unposted = settled  # nothing is posted: called once the notification went
            return group
        try:
            group.answer = self.transport.submit(
                run.op,
                local,
                remote,
                run.agent,
                notif,
                self.transfer_timeout,
                nbytes,
                local_mem=local_mem,
                remote_mem=remote_mem,
                trace_id=run.trace_id,
                settled=settled,  # the transport reports a posted transfer's end itself
                post_by=run.post_by,
            )
        except KvdError as exc:
            group.error = exc  # (the transport called `settled`: nothing was posted)
        return group

    async def finish(self, run: Running) -> None:
        """`run`'s second half: waits for every group `start` handed over; raises the
        first failure (a KvdError)."""
        errors: list[KvdError] = []
        try:
            for g in run.groups:
                try:
                    if g.error is not None:
                        raise g.error
                    if g.answer is not None:
                        timing = await g.answer
                        self.stats.observe(run.op, timing, g.nbytes, g.descriptors)
                    elif g.notif:
                        await self.transport.send_notif(run.agent, g.notif, run.trace_id)
                except KvdError as exc:
                    errors.append(exc)
                finally:
                    g.settle()
        finally:
            for g in run.groups:  # cancelled: what was posted still settles on its own
                g.abandon()
            if run.trace_id:
                self.trace.mark(run.trace_id, "transfer.returned")
            self.in_flight.pop(run.key, None)
            run.rec["duration_ms"] = round((time.perf_counter() - run.t0) * 1e3, 3)
            run.rec["state"] = "failed" if errors else "done"
            self.recent.append(run.rec)
        peer = self.by_peer.get(run.agent)
        if peer is None:
            peer = self.by_peer[run.agent] = [0, 0, 0]
        if errors:
            peer[2] += 1
            raise errors[0]
        peer[0] += 1
        peer[1] += run.total
        self._count("transfers_ok")
        self._count("bytes_transferred", run.total)
        self._count("descriptors", run.descs)

    # ---------------------------------------------------------------- drains

    def wake(self) -> None:
        """A transfer (or a receive step holding a region) ended: let every drain re-check
        its region (drains are rare)."""
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    async def _until(self, busy: Callable[[], bool]) -> None:
        while busy():
            if self._wakeup is None:
                self._wakeup = anyio.Event()
            await self._wakeup.wait()

    async def drain_local(self, region_id: int) -> None:
        """No new transfer from this region; returns once none is in flight."""
        self.releasing.add(region_id)
        try:
            await self._until(lambda: self.local.get(region_id, 0) > 0)
        finally:
            self.releasing.discard(region_id)
            self.local.pop(region_id, None)

    async def drain_remote(self, agent: str, region_id: int) -> None:
        key = (agent, region_id)
        await self._until(lambda: self.remote.get(key, 0) > 0)
        self.remote.pop(key, None)

    def snapshot(self) -> dict[str, Any]:
        return {"in_flight": list(self.in_flight.values()), "recent": list(self.recent)}

    def totals(self) -> dict[str, Any]:
        """For the `status` section: per-op histogram summaries and per-peer totals."""
        return {
            "xfer_stats": self.stats.summary(),
            "by_peer": {
                agent: {"transfers": n, "bytes": b, "failed": f}
                for agent, (n, b, f) in self.by_peer.items()
            },
        }


def failure_reason(record: wire.Record) -> str | None:
    """The reason label of a terminal failure event (None for any other event)."""
    if isinstance(record, wire.SendExpired):
        return "expired"
    if isinstance(record, wire.SendFailed | wire.RecvFailed):
        try:
            return ErrorCode(record.code).name.lower()
        except ValueError:
            return f"code_{record.code}"
    return None


def _peer_addr(m: wire.Record) -> str:
    """The peer daemon a client request names ("" for none: P's `finished`)."""
    host, port = getattr(m, "peer_host", ""), getattr(m, "peer_port", 0)
    return f"{host}:{port}" if host else ""


def transfer_groups(
    local: Sequence[LocalRegion | RemoteRegion], remote: Sequence[LocalRegion | RemoteRegion]
) -> list[list[int]]:
    """The rank pairs (indices into `local`/`remote`) that one NIXL transfer carries: pairs
    of the same (local, remote) memory types, in order of first appearance. A NIXL
    descriptor list has one memory type, and every region of a side lives in one agent, so
    this is usually a single transfer for the whole request. Both ends compute it (D
    counts one completion per group)."""
    groups: dict[tuple[str, str], list[int]] = {}
    for i, (loc, rem) in enumerate(zip(local, remote, strict=True)):
        groups.setdefault((loc.mem_type, rem.mem_type), []).append(i)
    return list(groups.values())


def _merged(
    plans: Sequence[Plan],
    local: Sequence[LocalRegion],
    remote: Sequence[RemoteRegion],
    group: list[int],
) -> tuple[np.ndarray, np.ndarray, int, str, str]:
    """One descriptor list per side for a group of pairs (each row with its region's device)."""
    if len(group) == 1:
        i = group[0]
        plan = plans[i]
        loc_t, rem_t = (
            plan.as_tuples_local(local[i].device),
            plan.as_tuples_remote(remote[i].device),
        )
    else:
        loc_t = np.concatenate([plans[i].as_tuples_local(local[i].device) for i in group])
        rem_t = np.concatenate([plans[i].as_tuples_remote(remote[i].device) for i in group])
    nbytes = sum(plans[i].total_bytes for i in group)
    return loc_t, rem_t, nbytes, local[group[0]].mem_type, remote[group[0]].mem_type


def local_ranks(local: dict[tuple[str, int], LocalRegion], engine_id: str) -> list[LocalRegion]:
    """An engine's regions by rank; every rank of its TP must be registered."""
    regs = sorted((r for (e, _), r in local.items() if e == engine_id), key=lambda r: r.tp_rank)
    if not regs:
        raise NotFound(f"engine {engine_id!r} has no registered region on this daemon")
    tp = regs[0].tp_size
    if len(regs) != tp or [r.tp_rank for r in regs] != list(range(tp)):
        raise InvalidRequest(f"engine {engine_id!r} registered {len(regs)} of {tp} ranks")
    return regs


class SettleWatch:
    """A transfer's `settled` callback that can be awaited (`Transport.transfer`): for a
    transfer answered Unsettled, its caller waits here until UCX ended it."""

    __slots__ = ("_event", "done")

    def __init__(self) -> None:
        self.done = False
        self._event: anyio.Event | None = None

    def __call__(self) -> None:
        self.done = True
        if self._event is not None:
            self._event.set()

    async def wait(self) -> None:
        if not self.done:
            self._event = self._event or anyio.Event()
            await self._event.wait()
