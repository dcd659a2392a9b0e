"""Receiver: the D side of every KV transfer, a thin shell around `kvd.core.receiver.Receiver`.

The protocol (tracking and heartbeats, registrations and pulls, answers from P, aborts,
watchdogs, giving up on a peer) lives in the sans-IO machine; this actor feeds it what
arrives (D's engine's track, register_push, pull and abort; P's PushDone, PullAck and
Resync; peer views from the registrar; the outcome of its own work) with the daemon's
time, and carries out the effects: events to clients, handshakes and checks of P's
regions (the P daemon incarnation and compat named by the request), the registration or
pull completion, the READs themselves, heartbeats and probes, through the transport
port. Outcomes come back through the actor's own mailbox: only the loop touches the
machine.
"""

from __future__ import annotations

import ctypes
import itertools
import socket
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Final

import anyio
import numpy as np
import structlog
from kvd_client import wire
from kvd_client.errors import (
    AuthError,
    Incompatible,
    InvalidRequest,
    KvdError,
    RemoteProtocolError,
    TransferError,
)

from kvd.actors.base import Mailbox
from kvd.actors.messages import (
    AbortNotTaken,
    ClientRequest,
    EnsurePeer,
    EventOut,
    LoadNotTaken,
    LocalRegion,
    LocalRegionsChanged,
    NotifReceived,
    PeerInfo,
    PeerLost,
    PeerUpdated,
    RemoteRegion,
)
from kvd.actors.transfers import (
    DRAIN_LISTED,
    Running,
    SettleWatch,
    TransferActor,
    Transport,
    local_ranks,
    transfer_groups,
)
from kvd.adapters.nixl import PeerDisconnected, PeerUnknown, Unsettled
from kvd.adapters.staging import StagingArea
from kvd.core import readpath
from kvd.core import receiver as proto
from kvd.core.hybrid import is_hybrid, permutes_any, plan_any
from kvd.core.planner import Permute, RequestPlan, check_logical, permute_chunks
from kvd.core.staging import Scatter, Staged, plan_staged, scatter, shifted
from kvd.core.trace import NO_TRACE, StageTrace, trace_key
from kvd.logs import RejectLog

log = structlog.get_logger("kvd.receiver", actor="receiver")

_REFUSED: Final = (AuthError, Incompatible, InvalidRequest, RemoteProtocolError)
"""Handshake failures that retrying cannot mend (VersionMismatch is a RemoteProtocolError)."""


@dataclass(frozen=True)
class _View:
    """What a resolved request's transfer needs (opaque to the machine): one entry per
    transfer (rank pair) in each list."""

    local: list[LocalRegion]
    remote: list[RemoteRegion]
    plans: list[Any]
    notifs: list[bytes]
    """One (empty) per NIXL transfer (`transfer_groups`)."""
    permutes: dict[int, list[tuple[LocalRegion, Permute]]] = field(default_factory=dict)
    """Receive permutes (`kvd.core.planner.permutes_on_receive`) by transfer (group)
    index: done before that transfer is reported to the machine; each taken once."""
    staged: Staged | None = None
    """A pull's staged alternative (`kvd.core.staging`), taken when a slot is free."""
    replan: Callable[[], RequestPlan] | None = None
    """A pull's direct plan, when `plans` was left empty (staged whole): built only if
    staging has no slot for it."""


class Receiver(TransferActor):
    name = "receiver"

    def __init__(
        self,
        *,
        transport: Transport,
        mailbox: Mailbox[Any],
        registrar: Mailbox[Any],
        emit: Callable[[EventOut], None],
        lease_duration: float,
        probe_interval: float,
        push_registration_timeout: float,
        transfer_timeout: float,
        counters: dict[str, int],
        incarnation: int,
        side_host: str,
        side_port_ref: Callable[[], int],
        rejects: RejectLog | None = None,
        pending_bytes: int = 256 << 20,
        trace: StageTrace = NO_TRACE,
        staging: StagingArea | None = None,
        pull_by: str = "auto",
    ) -> None:
        super().__init__(
            transport=transport,
            mailbox=mailbox,
            registrar=registrar,
            emit=emit,
            transfer_timeout=transfer_timeout,
            counters=counters,
            rejects=rejects,
            trace=trace,
        )
        self.incarnation = incarnation
        self.pull_by = pull_by
        """`transfer.pull_by`: whether a pull READs or asks P to WRITE (`kvd.core.readpath`)."""
        self.staging = staging
        """Where pulls that slice heads or convert layouts READ whole chunks (None: off)."""
        self.side_listening: Callable[[str, int, float], Awaitable[bool | None]] = side_listening
        """How `CheckGone` asks whether P's side channel still listens (a test swaps it)."""
        self._permuting: dict[str, tuple[int, list[EventOut]]] = {}
        """Requests whose received bytes a permute is rewriting in place (how many permutes,
        and the events held back meanwhile): the engine hears the request ended, and may
        reuse its blocks, only once no permute can write into them any more."""
        self.side_host = side_host
        self._side_port_ref = side_port_ref
        self.proto: proto.Receiver = proto.Receiver(
            lease_duration=lease_duration,
            probe_interval=probe_interval,
            push_registration_timeout=push_registration_timeout,
            transfer_timeout=transfer_timeout,
            pending_bytes=pending_bytes,
            counters=counters,
        )

    # ---------------------------------------------------------------- input

    def _own(self, msg: Any, now: float) -> bool:
        if isinstance(msg, LoadNotTaken):
            self._drop_refused_track(msg.session, msg.request_id)
        elif isinstance(msg, AbortNotTaken):
            self._feed(proto.AbortRecv(msg.request_id, msg.session), now)
        elif isinstance(msg, NotifReceived):
            try:
                self._notif(msg.agent, msg.msg, now)
            finally:  # handled: its bytes (limits.notif_bytes) no longer wait
                if msg.reservation is not None:
                    msg.reservation.release()
        elif isinstance(msg, LocalRegionsChanged):
            self.local = msg.regions
        elif isinstance(msg, PeerUpdated):
            if msg.info is None:
                old = self.peers.pop(msg.agent, None)
                if old is not None:
                    # forgotten (dead, or restarted as a new incarnation): what waits on the
                    # view it had will never come
                    lost = proto.PeerLost(msg.agent, "disconnected or restarted", old.handshaked_at)
                    self._feed(lost, now)
            else:
                self.peers[msg.agent] = msg.info
                self._feed(proto.PeerKnown(msg.info.addr, msg.info.lease_duration), now)
        elif isinstance(msg, PeerLost):
            self._feed(proto.PeerLost(msg.agent, msg.reason, msg.since), now)
        else:
            return False
        return True

    def _end_session(self, session: str) -> proto.Event:
        return proto.EndSession(session)

    def _start_drain(self) -> proto.Event:
        return proto.StartDrain()

    def _force_abort(self, request_id: str) -> proto.Event:
        return proto.ForceAbort(request_id)

    def _state_of(self, request_id: str) -> str:
        req = self.proto.reqs.get(request_id)
        return req.state.value if req is not None else ""

    def _client_event(self, req: ClientRequest) -> proto.Event:
        m = req.msg
        if isinstance(m, wire.Track):
            hb_id = m.remote_request_id or m.request_id
            return proto.Track(
                m.request_id, req.session, m.engine_id, m.peer_host, m.peer_port, hb_id
            )
        if isinstance(m, (wire.RegisterPush, wire.Pull)):
            try:
                return self._load(req.session, m)
            except KvdError:
                self._drop_refused_track(req.session, m.request_id)
                raise
        if isinstance(m, wire.Abort):
            return proto.AbortRecv(m.request_id, req.session)
        raise TypeError(f"receiver got {type(m).__name__}")

    def _drop_refused_track(self, session: str, request_id: str) -> None:
        """A registration or pull refused at our door (or by the gateway, BUSY): the engine
        has its error (its client reports RecvFailed, and nothing will abort the request
        here), so a track of it must not go on heartbeating P's lease: dropped as an abort
        drops it (P is told it may free the blocks; no event: the engine had its answer)."""
        tracked = self.proto.reqs.get(request_id)
        if (
            tracked is not None
            and tracked.state is proto.RecvState.TRACKED
            and tracked.session == session
        ):
            self._count("tracks_dropped_refused")
            self._feed(proto.AbortRecv(request_id, session), self.clock.now())

    def _load(self, session: str, m: wire.RegisterPush | wire.Pull) -> proto.Load:
        for reg in local_ranks(self.local, m.engine_id):
            check_logical(reg.geometry, m.block_ids)  # bounds, before anything else
        remote_blocks: tuple[int, ...] = ()
        if isinstance(m, wire.Pull):
            remote_blocks = m.remote_block_ids  # how they pair with ours: the planner's
        return proto.Load(
            request_id=m.request_id,
            session=session,
            engine_id=m.engine_id,
            mode="push" if isinstance(m, wire.RegisterPush) else "pull",
            block_ids=m.block_ids,
            host=m.peer_host,
            port=m.peer_port,
            remote_engine_id=m.remote_engine_id,
            remote_request_id=m.remote_request_id,
            remote_block_ids=remote_blocks,
            remote_incarnation=m.remote_incarnation,
            remote_session=m.remote_session,
            num_tokens=m.num_tokens,
        )

    def _notif(self, agent: str, msg: wire.Record, now: float) -> None:
        if not self._known(agent, msg):
            return
        if isinstance(msg, wire.PushDone):
            req = self.proto.reqs.get(msg.request_id)
            view = req.view if req is not None else None
            jobs = view.permutes.pop(msg.tp_rank, None) if isinstance(view, _View) else None
            if jobs and msg.ok:  # the machine hears of it once D's bytes are in D's layout
                self._spawn(self._permuted_push, agent, msg, jobs)
                return
            self._feed(proto.PushDoneArrived(agent, msg), now)
        elif isinstance(msg, wire.LayersPushed):
            self._feed(proto.LayersPushedArrived(agent, msg), now)
        elif isinstance(msg, wire.PullAck):
            self._feed(proto.PullAckArrived(agent, msg), now)
        elif isinstance(msg, wire.Resync):
            self._feed(proto.ResyncArrived(agent, msg.nonce), now)
        else:
            self._reject_notif(agent, type(msg).__name__, f"unexpected {type(msg).__name__}")
            return
        if self.trace.on:
            self._mark(trace_key(msg), "notif_fed")

    # ---------------------------------------------------------------- effects

    def _carry_out_own(self, eff: Any) -> None:
        if isinstance(eff, proto.Resolve):
            known = None if eff.refresh else self._known_peer(eff.load)
            if known is None:
                self._spawn(self._resolve, eff)
            else:  # P's view is at hand: no IO needed
                self._ready.append(self._resolved(eff.load, *known))
        elif isinstance(eff, proto.SendFor):
            self._send_for(eff)
        elif isinstance(eff, proto.PostRead):
            self._read(eff)
        elif isinstance(eff, proto.Beat):
            self._spawn(self._reach, eff.peer, wire.Heartbeat(eff.hb_ids), len(eff.hb_ids))
        elif isinstance(eff, proto.ProbePeer):
            self._spawn(self._reach, eff.peer, wire.Probe(0, True), 0)
        elif isinstance(eff, proto.CancelAt):
            self._spawn(self._cancel_at, eff)
        elif isinstance(eff, proto.CheckGone):
            self._spawn(self._check_gone, eff)
        else:
            raise TypeError(f"receiver cannot carry out {type(eff).__name__}")

    async def _peer(
        self, host: str, port: int, refresh: bool = False, since: float | None = None
    ) -> PeerInfo:
        """P's view (`refresh`: a fresh one, from a handshake started after `since`, by
        default now: see `EnsurePeer.not_before`)."""
        if refresh and since is None:
            since = self.clock.now()
        info: PeerInfo = await self.registrar.call(
            EnsurePeer(host, port, refresh=refresh, not_before=since if refresh else None)
        )
        return info

    def _known_peer(
        self, load: proto.Load
    ) -> tuple[list[LocalRegion], PeerInfo, list[RemoteRegion]] | None:
        """The request's local ranks and P's view, if the view this actor holds (the
        registrar's, as last published) has every rank the request needs; None otherwise
        (then `_resolve` asks the registrar, which handshakes where needed)."""
        info = next(
            (i for i in self.peers.values() if i.host == load.host and i.port == load.port), None
        )
        if info is None or (
            load.remote_incarnation and info.incarnation != load.remote_incarnation
        ):
            return None
        try:
            local = local_ranks(self.local, load.engine_id)
        except KvdError:
            return None
        remote = _ranks_for(info, load.remote_engine_id)
        return (local, info, remote) if remote is not None else None

    async def _resolve(self, eff: proto.Resolve) -> None:
        """P's daemon and its regions for the request, checked, and what starts the transfer."""
        load = eff.load
        try:
            local = local_ranks(self.local, load.engine_id)
            info, remote = await self._peer_ranks(load, eff.refresh)
        except KvdError as exc:
            self._outcome(proto.PeerUnresolved(load.request_id, exc))
            return
        self._outcome(self._resolved(load, local, info, remote))

    def _resolved(
        self,
        load: proto.Load,
        local: list[LocalRegion],
        info: PeerInfo,
        remote: list[RemoteRegion],
    ) -> proto.Event:
        """The request checked against P's regions, and what starts its transfer."""
        try:
            first: wire.Record
            plans: tuple[Any, ...] = ()
            permutes: tuple[Permute, ...] = ()
            staged: Staged | None = None
            replan: Callable[[], RequestPlan] | None = None
            # refuses a pair that cannot map, naming both sides' values
            pairs, permutes = permutes_any(remote, local, load.block_ids, load.num_tokens)
            # a pull where UCX would emulate the READ goes by P's WRITE, as a push naming
            # the P blocks to pull (`kvd.core.readpath`); P plans it (as for a push: how
            # D's blocks take P's is checked there, and a refusal answers the registration)
            by_write = (
                load.mode == "pull"
                and bool(load.block_ids)
                and readpath.by_write(self.pull_by, info.native_reads)
            )
            if load.mode == "push" or by_write:
                first = wire.PushRegistration(
                    request_id=load.request_id,
                    remote_request_id=load.remote_request_id,
                    engine_id=load.engine_id,
                    remote_engine_id=remote[0].engine_id,
                    tp_size=len(local),
                    block_ids=load.block_ids,
                    side_host=self.side_host,
                    side_port=self._side_port_ref(),
                    incarnation=self.incarnation,
                    generations=tuple(r.generation for r in local),
                    p_session=load.remote_session,
                    num_tokens=load.num_tokens,
                    # the P this was planned against (kv_transfer_params may not say):
                    # a repeat that reaches a P restarted since is refused there at once
                    p_incarnation=load.remote_incarnation or info.incarnation,
                    p_block_ids=load.remote_block_ids if by_write else (),
                )
            else:
                n = len(load.block_ids)
                if n:
                    replan = partial(
                        plan_any,
                        remote,
                        load.remote_block_ids,
                        local,
                        load.block_ids,
                        local_is_p=False,
                        num_tokens=load.num_tokens,
                    )
                    if self.staging is not None and not is_hybrid(remote, local):
                        # staged whole: the direct plan is built only if no slot is free
                        staged = plan_staged(
                            remote, load.remote_block_ids, local, load.block_ids, pairs
                        )
                    if staged is None or staged.direct:
                        rp = replan()
                        pairs, plans, permutes = rp.pairs, rp.plans, rp.permutes
                        if staged is not None:
                            staged = plan_staged(
                                remote, load.remote_block_ids, local, load.block_ids, pairs, rp
                            )
                first = wire.PullDone(
                    load.remote_request_id,
                    load.request_id,
                    tuple(r.generation for r in remote) if n else (),
                    load.remote_session,
                    load.remote_incarnation or info.incarnation,
                )
        except KvdError as exc:
            # P was reached and may hold a lease: the machine tells it
            return proto.PeerUnresolved(load.request_id, exc, info.agent)
        if self.trace.on:
            self._mark(load.request_id, "resolved")
            self.trace.link(load.request_id, info.agent, load.remote_request_id)
        locs = [local[x.d] for x in pairs]
        rems = [remote[x.p] for x in pairs]
        groups = transfer_groups(locs, rems)  # push: one PushDone each
        group_of = {i: g for g, members in enumerate(groups) for i in members}
        by_group: dict[int, list[tuple[LocalRegion, Permute]]] = {}
        for job in permutes:
            by_group.setdefault(group_of[job.pair], []).append((locs[job.pair], job))
        transfers = len(groups)
        if by_write:
            self._count("pulls_by_write")
        if load.mode == "pull" and not load.block_ids:
            view = _View([], [], [], [])
        else:
            view = _View(locs, rems, list(plans), [b""] * transfers, by_group, staged, replan)
        return proto.PeerResolved(
            load.request_id,
            info.agent,
            info.handshaked_at,
            transfers,
            first,
            view,
            layers=local[0].geometry.num_layers,
            incarnation=info.incarnation,
            write_bound=info.write_bound,
            by_write=by_write,
        )

    async def _peer_ranks(
        self, load: proto.Load, refresh: bool
    ) -> tuple[PeerInfo, list[RemoteRegion]]:
        """The peer's regions for the request's engine, re-handshaking once if they are not
        (yet) known. The peer must be the daemon the request's incarnation names (if
        given): a cached view of an older one is refreshed once, a newer one fails."""
        # the request arrived before now: a handshake started from now on shows what it
        # needs of P (a region P registered, a restart), one started before may not
        since = self.clock.now()
        info = await self._peer(load.host, load.port, refresh=refresh, since=since)
        wanted = load.remote_incarnation
        if wanted and info.incarnation != wanted and not refresh:
            info = await self._peer(load.host, load.port, refresh=True, since=since)
            refresh = True
        if wanted and info.incarnation != wanted:
            raise TransferError(
                f"P's daemon {info.agent} restarted since it leased the blocks "
                f"(incarnation {info.incarnation:016x}, kv_transfer_params name "
                f"{wanted:016x}): its KV is gone"
            )
        engine_id = load.remote_engine_id
        for attempt in range(2):
            ranks = _ranks_for(info, engine_id)
            if ranks is not None:
                return info, ranks
            if attempt == 0 and not refresh:
                info = await self._peer(load.host, load.port, refresh=True, since=since)
        ranks = _ranks_of(info, engine_id)
        tp = ranks[0].tp_size if ranks else 0
        raise Incompatible(
            f"peer {info.agent} has {len(ranks)} regions for engine {engine_id!r}, "
            f"not all {tp} ranks of its TP"
        )

    def _disconnected(self, agent: str, exc: KvdError) -> bool:
        """A transfer or notification found the peer gone: the registrar forgets the view
        (the next use handshakes afresh). True if it was posting (NIXL already knew)."""
        if not isinstance(exc, PeerDisconnected):
            return False
        info = self.peers.get(agent)
        since = info.handshaked_at if info is not None else float("inf")
        self.registrar.post(PeerLost(agent, exc.message, since))
        return exc.at_post

    def _stale(self, agent: str, exc: KvdError) -> bool:
        """Whether posting a request's notification or READ failed because the view of P it
        resolved is stale, so that one fresh handshake may mend the request: NIXL knew the
        peer gone (the registrar is told to forget it), or NIXL no longer holds the agent
        (or the memory) the view names, because the registrar dropped or replaced that view
        since the request resolved it (a heartbeat or another request found P gone, or a
        handshake met P's new incarnation). Nothing is forgotten then: the registrar's
        current view, if any, is a newer one."""
        return self._disconnected(agent, exc) or isinstance(exc, PeerUnknown)

    def _send_for(self, eff: proto.SendFor) -> None:
        """Send a request's notification (no task: its outcome comes back as a message)."""
        rid = ""
        if self.trace.on:
            rid = eff.request_id
            self._mark(rid, "notif_handed")

        def done(exc: KvdError | None) -> None:
            if exc is None:
                self._outcome(proto.Sent(eff.request_id))
                return
            self._count("notifs_failed")
            # a notification is sent within the call: a peer found gone was gone at post
            stale = self._stale(eff.agent, exc) or isinstance(exc, PeerDisconnected)
            self._outcome(proto.SendFailed(eff.request_id, exc, stale))

        self.transport.post_notif(eff.agent, wire.encode(eff.record), done, rid)

    def _read(self, eff: proto.PostRead) -> None:
        """READ a request's blocks from P. Straight into D's blocks: handed to the NIXL
        thread in this turn of the loop (as P's WRITE: `Sender._write`), a task waiting
        for its end; a READ that may go through a staging slot (`_staged_read`, which may
        wait for the staging area) is carried out by a task from the start."""
        view = eff.view
        assert isinstance(view, _View)
        if view.staged is not None:
            self._spawn(self._read_staged, eff)
            return
        watch = SettleWatch()
        run = self._start_direct(eff, view, watch)
        if run is not None:
            self._spawn(self._read_landed, eff, view, run, watch)

    def _start_direct(self, eff: proto.PostRead, view: _View, watch: SettleWatch) -> Running | None:
        """The READ straight into D's blocks handed over now; None (the machine told) when
        nothing could be posted."""
        try:
            if not view.plans and view.replan is not None:  # staged whole, but no slot
                view.plans.extend(view.replan().plans)  # (its permutes are in the view)
            return self.book.start(
                "READ",
                eff.request_id,
                eff.agent,
                view.local,
                view.remote,
                view.plans,
                view.notifs,
                watch,
            )
        except KvdError as exc:
            self._outcome(proto.ReadDone(eff.request_id, exc, self._stale(eff.agent, exc)))
            return None

    async def _read_staged(self, eff: proto.PostRead) -> None:
        """`_read` through a staging slot, or straight into D's blocks where it has none."""
        view = eff.view
        assert isinstance(view, _View)
        if await self._staged_read_or_fail(eff, view):
            return
        watch = SettleWatch()
        run = self._start_direct(eff, view, watch)
        if run is not None:
            await self._read_landed(eff, view, run, watch)

    async def _staged_read_or_fail(self, eff: proto.PostRead, view: _View) -> bool:
        """True once the staged READ ran (its outcome sent), or failed (outcome sent)."""
        try:
            if await self._staged_read(eff.request_id, eff.agent, view):
                self._outcome(proto.ReadDone(eff.request_id))
                return True
        except KvdError as exc:
            # into a staging slot (quarantined by the staging area when still in flight)
            self._outcome(proto.ReadDone(eff.request_id, exc, self._stale(eff.agent, exc)))
            return True
        return False

    async def _read_landed(
        self, eff: proto.PostRead, view: _View, run: Running, watch: SettleWatch
    ) -> None:
        """Waits for the end of a READ straight into D's blocks; permutes them into D's
        token layout where the pair needs it; answers the machine."""
        try:
            await self.book.finish(run)
        except Unsettled as exc:
            # still in flight in UCX: it may write into our blocks, which stay held
            self._outcome(proto.ReadDone(eff.request_id, exc, unsettled=True))
            await watch.wait()
            self._outcome(proto.ReadSettled(eff.request_id))
            return
        except KvdError as exc:
            # lost under a posted READ: fail; a stale view when posting: handshake again
            self._outcome(proto.ReadDone(eff.request_id, exc, self._stale(eff.agent, exc)))
            return
        try:
            jobs = [job for group in view.permutes.values() for job in group]
            view.permutes.clear()
            if jobs:
                await self._permute(jobs)
        except KvdError as exc:
            self._outcome(proto.ReadDone(eff.request_id, exc, self._stale(eff.agent, exc)))
            return
        self._outcome(proto.ReadDone(eff.request_id))

    async def _permute(self, jobs: list[tuple[LocalRegion, Permute]]) -> None:
        """Permute received blocks into D's token layout (`_in_thread`)."""
        await self._in_thread([loc for loc, _ in jobs], _run_permutes, jobs)
        self._count("receive_permutes", len(jobs))

    async def _in_thread(
        self, regions: list[LocalRegion], fn: Callable[..., None], *args: Any
    ) -> None:
        """A receive step writing D's regions, in a worker thread (numpy copies release
        the GIL), with the regions held like a transfer holds them (a region being
        released is not touched: TransferError)."""
        self._hold_regions(regions)
        try:
            await anyio.to_thread.run_sync(fn, *args)
        finally:
            self._unhold_regions(regions)

    async def _staged_read(self, rid: str, agent: str, view: _View) -> bool:
        """READ the staged P ranks' blocks whole into a staging slot (and the other pairs
        by their own plans, in the same transfer); then scatter them into D's blocks in
        D's layout in a worker thread, while the machine acknowledges the READ with P:
        the request's terminal event is held until the scatter ended (`_emit`), so D's
        engine hears of it only once its bytes are in its layout (and a scatter that
        fails turns a held RecvFinished into RecvFailed). False, having done nothing, when
        staging has no slot (or cannot be registered): the caller moves the request by
        its direct plans.

        The slot ends exactly once: freed when nothing can land in it any more and the
        scatter is over; quarantined instead when the READ may still land (answered
        Unsettled, or cancelled), until the transport reports it ended."""
        staging, staged = self.staging, view.staged
        assert staging is not None and staged is not None
        if not await self._staging_ready(staging, rid):
            return False
        pool = staging.pool
        off = pool.alloc(staged.nbytes)
        if off is None:
            self._count("staging_exhausted")
            return False
        ended = quarantined = False

        def settle() -> None:
            nonlocal ended
            ended = True
            if quarantined:
                pool.release(off)
                self._count("staging_released")

        def done_with_slot() -> None:
            nonlocal quarantined
            if ended:
                pool.free(off)
            else:
                quarantined = True
                pool.quarantine(off)
                self._count("staging_quarantined")

        view.permutes.clear()  # the staged alternative carries the permutes it keeps
        base = staging.addr + off
        idx = [*staged.direct, *(r.pair for r in staged.reads)]
        locs = [view.local[i] for i in idx]
        rems = [view.remote[i] for i in idx]
        plans = [view.plans[i] for i in staged.direct]
        plans += [shifted(r.plan, base) for r in staged.reads]
        notifs = [b""] * len(transfer_groups(locs, rems))
        scatters = [(view.local[j.pair], j) for j in staged.scatters]
        permutes = [(view.local[j.pair], j) for j in staged.permutes]
        regions = [loc for loc, _ in scatters] + [loc for loc, _ in permutes]
        try:
            await self.book.run("READ", rid, agent, locs, rems, plans, notifs, settle)
            self._hold_regions(regions)
        except BaseException:
            done_with_slot()
            raise
        req = self.proto.reqs.get(rid)
        blocks = req.blocks if req is not None else ()
        running, held = self._permuting.get(rid, (0, []))
        self._permuting[rid] = (running + 1, held)
        slot = staging.buf[off : off + staged.nbytes]
        self._spawn(self._scatter, rid, blocks, regions, done_with_slot, slot, scatters, permutes)
        self._count("staged_reads")
        self._count("staged_scatters", len(staged.scatters))
        # a scatter between token layouts is that pair's receive permute, in one pass
        converted = sum(1 for j in staged.scatters if j.converts) + len(staged.permutes)
        if converted:
            self._count("receive_permutes", converted)
        return True

    async def _scatter(
        self,
        rid: str,
        blocks: tuple[int, ...],
        regions: list[LocalRegion],
        done_with_slot: Callable[[], None],
        *args: Any,
    ) -> None:
        """`_staged_read`'s scatter (regions already held), then the held events out."""
        failed: KvdError | None = None
        try:
            t0 = time.perf_counter()
            await anyio.to_thread.run_sync(_run_scatters, *args)
            # the local pass a staged pull costs (`kvd bench --only topology` reports it)
            self._count("staged_scatter_us", int((time.perf_counter() - t0) * 1e6))
        except Exception as exc:  # a planner bug: fail closed, never report done
            failed = TransferError(f"staged scatter failed: {exc!r}")
            log.error("staged_scatter_failed", request_id=rid, error=repr(exc))
        finally:
            self._unhold_regions(regions)
            done_with_slot()
            running, held = self._permuting.pop(rid)
            if running > 1:
                self._permuting[rid] = (running - 1, held)
                held = []
            for ev in held:
                if failed is not None and isinstance(ev.record, wire.RecvFinished):
                    self._count("staged_scatters_failed")
                    record = wire.RecvFailed(rid, int(failed.code), failed.message, blocks)
                    ev = EventOut(ev.session, ev.engine_id, record)
                self.emit(ev)

    async def _permuted_push(
        self, agent: str, msg: wire.PushDone, jobs: list[tuple[LocalRegion, Permute]]
    ) -> None:
        rid = msg.request_id
        running, held = self._permuting.get(rid, (0, []))
        self._permuting[rid] = (running + 1, held)
        try:
            await self._permute(jobs)
        except KvdError as exc:
            msg = wire.PushDone(rid, msg.tp_rank, False, int(exc.code), exc.message)
        finally:
            running, held = self._permuting.pop(rid)
            if running > 1:
                self._permuting[rid] = (running - 1, held)
            else:
                for ev in held:  # the request ended (e.g. D's watchdog) while we permuted
                    self.emit(ev)
        self._outcome(proto.PushDoneArrived(agent, msg))

    def _emit(self, ev: EventOut) -> None:
        rid = getattr(ev.record, "request_id", None)
        if rid is not None and rid in self._permuting:
            self._permuting[rid][1].append(ev)
            self._count("events_held_for_permute")
            return
        self.emit(ev)

    async def _reach(self, peer: str, msg: wire.Record, ids: int) -> None:
        """One heartbeat (or probe) to the P at `peer`; its outcome feeds the give-up rule."""
        host, _, port = peer.rpartition(":")
        info: PeerInfo | None = None
        tid = ""
        if self.trace.on and isinstance(msg, wire.Heartbeat) and msg.request_ids:
            tid = msg.request_ids[0]  # traced under the first id it names (P's id)
        try:
            info = await self._peer(host, int(port))
            if tid:
                self._mark(tid, "beat_handed")
            await self.transport.send_notif(info.agent, wire.encode(msg))
        except KvdError as exc:
            if info is not None:
                self._disconnected(info.agent, exc)
                self._outcome(proto.PeerLost(info.agent, exc.message, info.handshaked_at))
            refused = info is None and isinstance(exc, _REFUSED)
            self._outcome(proto.PeerUnreachable(peer, exc, refused))
            return
        if ids:
            self._count("heartbeats_sent")
            self._count("heartbeat_ids_sent", ids)
        self._outcome(proto.PeerReached(peer))

    async def _cancel_at(self, eff: proto.CancelAt) -> None:
        """Tell P (handshaking first if need be: a handshake may still be under way) that
        nothing will take `hb_id`'s blocks."""
        host, _, port = eff.peer.rpartition(":")
        try:
            info = await self._peer(host, int(port))
            await self.transport.send_notif(
                info.agent, wire.encode(wire.CancelRegistration(eff.hb_id))
            )
        except KvdError as exc:
            log.warning(
                "cancel_not_delivered", request_id=eff.hb_id, peer=eff.peer, error=exc.message
            )

    async def _check_gone(self, eff: proto.CheckGone) -> None:
        """Whether the P daemon a held push waits on is provably gone: nothing listens at
        its side channel any more (the connection is refused: its process is gone, and
        with it its NIXL agent), or another daemon (agent or incarnation) answers there.
        If it answers as itself, it is told the cancel again through the fresh view.
        Unreachable (a cut link, a frozen process): no proof, the request stays held."""
        host, _, port_s = eff.peer.rpartition(":")
        port = int(port_s)
        listening = await self.side_listening(host, port, min(self.book.transfer_timeout, 5.0))
        if listening is False:
            self._outcome(proto.PeerGone(eff.agent, f"{eff.peer} refused the connection"))
            return
        if listening is None:
            log.info("held_peer_unreachable", peer=eff.peer, held=len(eff.hb_ids))
            return
        try:
            info = await self._peer(host, port, refresh=True)
        except KvdError as exc:
            log.info("held_peer_not_handshaked", peer=eff.peer, error=exc.message)
            return
        if info.agent != eff.agent or (eff.incarnation and info.incarnation != eff.incarnation):
            why = f"{eff.peer} answers as {info.agent} incarnation {info.incarnation:016x}"
            self._outcome(proto.PeerGone(eff.agent, why))
            return
        for hb_id in eff.hb_ids:
            try:
                await self.transport.send_notif(
                    info.agent, wire.encode(wire.CancelRegistration(hb_id))
                )
            except KvdError as exc:
                log.info("cancel_not_delivered", request_id=hb_id, peer=eff.peer, error=exc.message)
                return

    # ---------------------------------------------------------------- status

    def snapshot(self, section: str, now: float) -> dict[str, Any]:
        p = self.proto
        if section == "drain":
            live = list(itertools.islice(p.reqs.values(), DRAIN_LISTED))
            return {
                "count": len(p.reqs),
                "requests": [
                    {
                        "request_id": r.request_id,
                        "state": r.state.value,
                        "age_s": round(now - r.started, 3),
                    }
                    for r in live
                ],
            }
        if section == "leases":
            return {
                "tracked": [
                    {"request_id": r.request_id, "peer": r.peer, "hb_id": r.hb_id}
                    for r in p.reqs.values()
                ]
            }
        if section == "transfers":
            return self.book.snapshot() | {
                "receiving": [
                    {
                        "request_id": r.request_id,
                        "mode": r.mode,
                        "peer": r.agent,
                        "state": r.state.value,
                        "ranks_done": len(r.done_ranks),
                        "ranks": r.ranks,
                        "blocks": len(r.blocks),
                        "age_s": round(now - r.started, 3),
                    }
                    for r in p.reqs.values()
                    if r.state is not proto.RecvState.TRACKED
                ]
            }
        states = p.by_state()
        return {
            "tracked": len(p.reqs),
            "receiving": len(p.reqs) - states["tracked"],
            "states": states,
            "holding": states["holding"],
            "sending": len(self.book.in_flight),
            "staging": self.staging.snapshot() if self.staging is not None else None,
            "heartbeat_peers": len(p.heartbeats.peers()),
            "limits": p.limits(),
            "failures": dict(self.failures),
        } | self.book.totals()


async def side_listening(host: str, port: int, timeout: float) -> bool | None:  # noqa: ASYNC109
    """Whether a TCP connection to host:port is accepted (True), refused (False: nothing
    listens there) or neither within `timeout` (None: unreachable, e.g. a cut link)."""
    return await anyio.to_thread.run_sync(_connects, host, port, timeout)


def _connects(host: str, port: int, timeout: float) -> bool | None:
    # a plain connect: anyio's happy-eyeballs connect folds a refusal into a generic error
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:  # a timeout, no route, the link down
        return None


def _run_permutes(jobs: list[tuple[LocalRegion, Permute]]) -> None:
    for loc, job in jobs:
        g = job.geometry or loc.geometry
        raw = (ctypes.c_uint8 * g.nbytes).from_address(g.base_addr)
        permute_chunks(np.ctypeslib.as_array(raw), g, job)


def _run_scatters(
    slot: np.ndarray,
    scatters: list[tuple[LocalRegion, Scatter]],
    permutes: list[tuple[LocalRegion, Permute]],
) -> None:
    for loc, job in scatters:
        g = loc.geometry
        raw = (ctypes.c_uint8 * g.nbytes).from_address(g.base_addr)
        scatter(slot, np.ctypeslib.as_array(raw), job)
    _run_permutes(permutes)


def _ranks_of(info: PeerInfo, engine_id: str) -> list[RemoteRegion]:
    """P's regions of `engine_id` (of its only engine when none is named)."""
    if engine_id:
        return info.ranks(engine_id)
    engines = {e for (e, _) in info.regions}
    return info.ranks(next(iter(engines))) if len(engines) == 1 else []


def _ranks_for(info: PeerInfo, engine_id: str) -> list[RemoteRegion] | None:
    """P's regions of the engine, if P has every rank of its TP (ranks 0..tp_size-1)."""
    ranks = _ranks_of(info, engine_id)
    if not ranks or [x.tp_rank for x in ranks] != list(range(ranks[0].tp_size)):
        return None
    return ranks
