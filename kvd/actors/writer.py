"""Writer: every KV transfer, push (P WRITEs) and pull (D READs), and D's request states.

Rules:
- Push: D's registration (`PushRegistration`, a NIXL notification) and P's finished
  blocks (`Stage`, from the reaper once the lease is granted) match in either order,
  exact id first, then the id without its per-engine random suffix.
- Before P reads its own blocks for a WRITE it claims the lease from the reaper: a lease
  that expired fails the request closed (D is told, never left waiting), and a claimed
  lease cannot expire under a WRITE.
- Pull: D READs P's blocks, then tells P (`PullDone`) and reports done only when P
  acknowledges that the lease was still held (fail closed).
- Every descriptor comes from the planner, from a validated (region, block id) pair.
- Each D request ends in exactly one event: RecvFinished or RecvFailed (with its blocks).
- A request whose kv_transfer_params name a P daemon incarnation other than the one the
  handshake finds fails at once (P restarted: its blocks are gone).
- D aborting a request (or its session closing) before its registration reached P still
  tells P (a cancel), so P frees the blocks now; a closing session is answered once all
  its requests ended.
- After P's daemon stalled (frozen, starved), P re-syncs with each D before WRITing a
  matched request into it: it sends `Resync` and waits for D's `ResyncAck`; notifications
  arrive in order, so every cancel D decided while P was stalled is processed first, and
  P never WRITEs into blocks D gave up on while P could not hear it.
- The writer sleeps on its mailbox; the only timers are registration watchdogs and
  re-sync deadlines.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import anyio
import structlog
from anyio.abc import TaskStatus
from kvd_client import wire
from kvd_client.errors import (
    Busy,
    ErrorCode,
    Incompatible,
    InvalidRequest,
    KvdError,
    LeaseExpired,
    NotFound,
    Timeout,
    TransferError,
)

from kvd.actors.base import Mailbox
from kvd.actors.messages import (
    CancelLease,
    Claim,
    ClientRequest,
    Delivered,
    DrainLocalRegion,
    DrainRemoteRegion,
    EnsurePeer,
    EventOut,
    LocalRegion,
    LocalRegionsChanged,
    NotifReceived,
    PeerInfo,
    PeerLost,
    PeerUpdated,
    RemoteRegion,
    SessionClosed,
    Snapshot,
    Stage,
    TrackRequest,
    Unstage,
    Untrack,
)
from kvd.adapters.nixl import NixlEngine, PeerDisconnected
from kvd.core.ids import base_request_id
from kvd.core.matching import Match, PushMatcher
from kvd.core.planner import Plan, expand_logical, plan_transfer
from kvd.core.timers import TimerHeap

log = structlog.get_logger("kvd.writer", actor="writer")

RECENT_TRANSFERS: Final = 256
_REARM: Final = object()
"""Posted to our own mailbox to wake the loop when a task sets a watchdog."""
_RESYNC: Final = "\0resync:"
"""Watchdog key prefix of a peer's re-sync deadline (request ids never start with NUL)."""


@dataclass(frozen=True)
class _PushReg:
    agent: str
    msg: wire.PushRegistration


@dataclass
class _Recv:
    """A D-side request waiting for KV."""

    request_id: str
    engine_id: str
    session: str
    mode: str
    block_ids: tuple[int, ...]
    host: str
    port: int
    remote_request_id: str
    started: float
    agent: str = ""
    expected_ranks: int = 0
    done_ranks: set[int] = field(default_factory=set)
    state: str = "handshake"
    aborted: bool = False
    ack: asyncio.Future[wire.PullAck] | None = None
    since: float = 0.0
    """`handshaked_at` of the peer view this request is bound to (see PeerLost)."""
    bytes: int = 0
    descriptors: int = 0


class Writer:
    def __init__(
        self,
        *,
        engine: NixlEngine,
        mailbox: Mailbox[Any],
        registrar: Mailbox[Any],
        reaper: Mailbox[Any],
        emit: Callable[[EventOut], None],
        push_registration_timeout: float,
        transfer_timeout: float,
        tombstones: int,
        counters: dict[str, int],
        incarnation: int,
        side_host: str,
        side_port_ref: Callable[[], int],
    ) -> None:
        self.engine = engine
        self.incarnation = incarnation
        self.side_host = side_host
        self._side_port_ref = side_port_ref
        self.mailbox = mailbox
        self.clock = mailbox.clock
        self.registrar = registrar
        self.reaper = reaper
        self.emit = emit
        self.push_registration_timeout = push_registration_timeout
        self.transfer_timeout = transfer_timeout
        self.counters = counters
        self.local: dict[tuple[str, int], LocalRegion] = {}
        self.peers: dict[str, PeerInfo] = {}
        self.matcher: PushMatcher[_PushReg, Stage] = PushMatcher()
        self.expired: OrderedDict[str, KvdError] = OrderedDict()
        """Base ids P will never send (lease expired, or P aborted) -> the error for D."""
        self._max_tombstones = tombstones
        self.recvs: dict[str, _Recv] = {}
        self.watchdogs: TimerHeap[str] = TimerHeap()
        self.sending: dict[str, dict[str, Any]] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_TRANSFERS)
        self.inflight_local: dict[int, int] = {}
        self.inflight_remote: dict[tuple[str, int], int] = {}
        self.draining_local: set[int] = set()
        self._drain_wakeup: anyio.Event | None = None
        self.pushing: dict[tuple[str, str], int] = {}
        """(D agent, registration key) of each push under way on P (see CancelRegistration)."""
        self.closing: dict[str, SessionClosed] = {}
        self.ended_sessions: OrderedDict[str, None] = OrderedDict()
        """P: client sessions that ended (a registration naming one is never finished)."""
        self._stall_seen = self.clock.stall_count
        self.suspect: set[str] = set()
        """P: peers not re-synced since our last stall (their matches wait in `parked`)."""
        self.parked: dict[str, list[Match[_PushReg, Stage]]] = {}
        self.resyncing: dict[str, int] = {}
        """Peer agent -> nonce of the Resync sent to it."""
        self.resync_timeout = 5.0
        self._tg: anyio.abc.TaskGroup | None = None

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    # ---------------------------------------------------------------- loop

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            while True:
                msg: Any = await self.mailbox.receive_before(self.watchdogs.next_time())
                if msg is not None and msg is not _REARM:
                    await self._dispatch(msg)
                for rid, _ in self.watchdogs.pop_due(self.clock.now()):
                    if rid.startswith(_RESYNC):
                        self._resync_failed(rid[len(_RESYNC) :])
                        continue
                    r = self.recvs.get(rid)
                    if r is not None and r.aborted:
                        self._end_recv(r, _aborted("aborted; P did not answer the cancel"))
                    elif r is not None:
                        log.warning("push_registration_timed_out", request_id=rid, peer=r.agent)
                        self._count("registration_timeouts")
                        self._end_recv(
                            r,
                            Timeout(f"no push completion within {self.push_registration_timeout}s"),
                        )
                        # P must not WRITE into these blocks later: drop the registration there
                        tg.start_soon(self._send_cancel, r)

    async def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, ClientRequest):
            self._client(msg)
        elif isinstance(msg, NotifReceived):
            self._notif(msg.agent, msg.msg)
        elif isinstance(msg, Stage):
            m = self.matcher.add_finished(msg.request_id, msg, self.clock.now())
            if m is not None:
                self._start_push(m)
        elif isinstance(msg, Unstage):
            self.matcher.remove_finished(msg.request_id)
            if msg.expired:
                self._tombstone(
                    msg.request_id, LeaseExpired("the lease expired before D registered")
                )
            elif msg.aborted:
                self._p_gave_up(msg.request_id)
        elif isinstance(msg, LocalRegionsChanged):
            self.local = msg.regions
        elif isinstance(msg, PeerUpdated):
            if msg.info is None:
                # forgotten (dead, or restarted as a new incarnation): what waits on the
                # view it had will never come
                old = self.peers.pop(msg.agent, None)
                if old is not None:
                    self._fail_peer(msg.agent, "disconnected or restarted", old.handshaked_at)
            else:
                self.peers[msg.agent] = msg.info
        elif isinstance(msg, PeerLost):
            self._fail_peer(msg.agent, msg.reason, msg.since)
        elif isinstance(msg, (DrainLocalRegion, DrainRemoteRegion)):
            assert self._tg is not None
            self._tg.start_soon(self._drain, msg)
        elif isinstance(msg, SessionClosed):
            _remember(self.ended_sessions, msg.session)
            self.closing[msg.session] = msg
            for r in [r for r in self.recvs.values() if r.session == msg.session]:
                self._abort_recv(r)
            self._maybe_closed()
        elif isinstance(msg, Snapshot):
            msg.resolve(self.snapshot(msg.section))
        else:
            raise TypeError(f"writer got {type(msg).__name__}")

    def _fail_peer(self, agent: str, reason: str, since: float) -> None:
        """End the requests waiting on `agent` as seen up to handshake `since`. Those in the
        middle of a handshake or a READ end in their own task: a READ in flight writes
        into D's blocks, so its request must not end before the READ returns."""
        for r in list(self.recvs.values()):
            if r.agent == agent and r.state in ("registered", "acking") and r.since <= since:
                self._end_recv(r, TransferError(f"peer {agent} lost: {reason}"))

    # ---------------------------------------------------------------- client requests (D side)

    def _client(self, req: ClientRequest) -> None:
        m = req.msg
        try:
            if isinstance(m, wire.RegisterPush):
                self._check_local(m.engine_id, m.block_ids)
                r = self._new_recv(
                    req.session,
                    m.request_id,
                    m.engine_id,
                    "push",
                    m.block_ids,
                    m.peer_host,
                    m.peer_port,
                    m.remote_request_id,
                )
                req.resolve(wire.Ok())
                assert self._tg is not None
                self._tg.start_soon(self._register_push, r, m)
            elif isinstance(m, wire.Pull):
                self._check_local(m.engine_id, m.block_ids)
                if len(m.block_ids) > len(m.remote_block_ids):
                    raise InvalidRequest(
                        f"{len(m.block_ids)} local blocks but P offers only "
                        f"{len(m.remote_block_ids)}"
                    )
                r = self._new_recv(
                    req.session,
                    m.request_id,
                    m.engine_id,
                    "pull",
                    m.block_ids,
                    m.peer_host,
                    m.peer_port,
                    m.remote_request_id,
                )
                req.resolve(wire.Ok())
                assert self._tg is not None
                self._tg.start_soon(self._pull, r, m)
            elif isinstance(m, wire.Abort):
                known = self.recvs.get(m.request_id)
                if known is not None and known.session == req.session:
                    self._abort_recv(known)
                elif known is None:
                    # P side: whatever D registered for it will never be written
                    self._p_gave_up(m.request_id)
                req.resolve(wire.Ok())
            else:
                raise TypeError(f"writer got {type(m).__name__}")
        except KvdError as exc:
            self._count("requests_rejected")
            log.warning(
                "request_rejected", request_id=getattr(m, "request_id", ""), error=exc.message
            )
            req.fail(exc)

    def _check_local(self, engine_id: str, block_ids: tuple[int, ...]) -> None:
        ranks = self._local_ranks(engine_id)
        for reg in ranks:
            _physical(reg.geometry, block_ids, reg.layout.physical_per_logical)  # bounds check

    def _local_ranks(self, engine_id: str) -> list[LocalRegion]:
        regs = sorted(
            (r for (e, _), r in self.local.items() if e == engine_id), key=lambda r: r.tp_rank
        )
        if not regs:
            raise NotFound(f"engine {engine_id!r} has no registered region on this daemon")
        tp = regs[0].tp_size
        if len(regs) != tp or [r.tp_rank for r in regs] != list(range(tp)):
            raise InvalidRequest(f"engine {engine_id!r} registered {len(regs)} of {tp} ranks")
        return regs

    def _new_recv(
        self,
        session: str,
        rid: str,
        engine_id: str,
        mode: str,
        blocks: tuple[int, ...],
        host: str,
        port: int,
        remote_rid: str,
    ) -> _Recv:
        if rid in self.recvs:
            raise InvalidRequest(f"request {rid!r} is already receiving")
        r = _Recv(rid, engine_id, session, mode, blocks, host, port, remote_rid, self.clock.now())
        self.recvs[rid] = r
        self._count(f"{mode}_requests")
        self.reaper.post_internal(TrackRequest(rid, remote_rid, host, port, session, engine_id))
        return r

    async def _peer(self, host: str, port: int, refresh: bool = False) -> PeerInfo:
        return await self.registrar.call(EnsurePeer(host, port, refresh=refresh))

    async def _peer_ranks(
        self, r: _Recv, engine_id: str, tp: int, incarnation: int, refresh: bool = False
    ) -> tuple[PeerInfo, list[RemoteRegion]]:
        """The peer's regions for `engine_id`, re-handshaking once if they are not (yet)
        known. The peer must be the daemon `incarnation` names (if given): a cached view
        of an older one is refreshed once, a newer one fails the request at once."""
        info = await self._peer(r.host, r.port, refresh=refresh)
        if incarnation and info.incarnation != incarnation and not refresh:
            info = await self._peer(r.host, r.port, refresh=True)
            refresh = True
        self._check_incarnation(info, incarnation)
        for attempt in range(2):
            if engine_id:
                ranks = info.ranks(engine_id)
            else:
                engines = {e for (e, _) in info.regions}
                ranks = info.ranks(next(iter(engines))) if len(engines) == 1 else []
            if len(ranks) == tp and [x.tp_rank for x in ranks] == list(range(tp)):
                return info, ranks
            if attempt == 0 and not refresh:
                info = await self._peer(r.host, r.port, refresh=True)
        raise Incompatible(
            f"peer {info.agent} has {len(ranks)} regions for engine {engine_id!r}, "
            f"need {tp} (equal TP)"
        )

    @staticmethod
    def _check_incarnation(info: PeerInfo, wanted: int) -> None:
        if wanted and info.incarnation != wanted:
            raise TransferError(
                f"P's daemon {info.agent} restarted since it leased the blocks "
                f"(incarnation {info.incarnation:016x}, kv_transfer_params name "
                f"{wanted:016x}): its KV is gone"
            )

    def _bind(self, r: _Recv, info: PeerInfo, ranks: int) -> None:
        r.agent, r.since, r.expected_ranks = info.agent, info.handshaked_at, ranks

    def _stale_peer(self, r: _Recv, info: PeerInfo, exc: PeerDisconnected) -> None:
        """Our cached view of the peer is dead (it died, maybe restarted, while we were idle):
        drop it; the caller handshakes afresh once."""
        log.info(
            "peer_gone_rehandshake", request_id=r.request_id, peer=info.agent, error=exc.message
        )
        self._count("peer_rehandshakes")
        self.registrar.post(PeerLost(info.agent, exc.message, info.handshaked_at))
        r.state = "handshake"

    async def _register_push(self, r: _Recv, m: wire.RegisterPush) -> None:
        try:
            local = self._local_ranks(m.engine_id)
            for attempt in range(2):
                info, remote = await self._peer_ranks(
                    r, m.remote_engine_id, len(local), m.remote_incarnation, refresh=attempt > 0
                )
                self._bind(r, info, len(remote))
                _check_compat(p=remote, d=local)
                if r.aborted:
                    self._end_recv(r, _aborted())
                    return
                reg = wire.PushRegistration(
                    request_id=m.request_id,
                    remote_request_id=m.remote_request_id,
                    engine_id=m.engine_id,
                    remote_engine_id=remote[0].engine_id,
                    tp_size=len(local),
                    block_ids=m.block_ids,
                    side_host=self.side_host,
                    side_port=self._side_port_ref(),
                    incarnation=self.incarnation,
                    generations=tuple(loc.generation for loc in local),
                    p_session=m.remote_session,
                )
                try:
                    await self.engine.send_notif(info.agent, wire.encode(reg))
                    break
                except PeerDisconnected as exc:
                    if attempt:
                        raise
                    self._stale_peer(r, info, exc)
            r.state = "registered"
            self._arm(r.request_id, self.clock.now() + self.push_registration_timeout)
        except KvdError as exc:
            self._end_recv(r, exc)

    async def _pull(self, r: _Recv, m: wire.Pull) -> None:
        try:
            local = self._local_ranks(m.engine_id)
            n = len(m.block_ids)
            p_blocks = m.remote_block_ids[len(m.remote_block_ids) - n :] if n else ()
            for attempt in range(2):
                info, remote = await self._peer_ranks(
                    r, m.remote_engine_id, len(local), m.remote_incarnation, refresh=attempt > 0
                )
                self._bind(r, info, len(remote))
                _check_compat(p=remote, d=local)
                r.state = "reading"
                if not n or r.aborted:
                    break
                plans = [
                    plan_transfer(
                        loc.geometry,
                        _physical(loc.geometry, m.block_ids, loc.layout.physical_per_logical),
                        rem.geometry,
                        _physical(rem.geometry, p_blocks, rem.geometry.physical_per_logical),
                    )
                    for loc, rem in zip(local, remote, strict=True)
                ]
                try:
                    await self._run_plans(
                        "READ",
                        r.request_id,
                        info.agent,
                        local,
                        remote,
                        plans,
                        [b""] * len(plans),
                        r,
                    )
                    break
                except PeerDisconnected as exc:
                    # lost under a posted READ: fail; already gone when posting: handshake again
                    if attempt or not exc.at_post:
                        raise
                    self._stale_peer(r, info, exc)
            r.state = "acking"
            loop = asyncio.get_running_loop()
            r.ack = loop.create_future()
            await self.engine.send_notif(
                info.agent,
                wire.encode(
                    wire.PullDone(
                        m.remote_request_id,
                        m.request_id,
                        tuple(rem.generation for rem in remote) if n else (),
                        m.remote_session,
                    )
                ),
            )
            with anyio.fail_after(self.transfer_timeout):
                ack = await r.ack
            if r.aborted:
                self._end_recv(r, _aborted())
            elif ack.ok:
                self._end_recv(r, None)
            else:
                self._end_recv(r, _error(ack.code, ack.reason))
        except TimeoutError:
            self._end_recv(r, Timeout("P did not acknowledge the pull in time"))
        except KvdError as exc:
            self._end_recv(r, exc)

    async def _run_plans(
        self,
        op: str,
        rid: str,
        agent: str,
        local: list[LocalRegion],
        remote: list[RemoteRegion],
        plans: list[Plan],
        notifs: list[bytes],
        r: _Recv | None,
    ) -> None:
        """Post one transfer per rank concurrently; raise the first failure."""
        for loc in local:
            if loc.region_id in self.draining_local:
                raise TransferError(f"local region {loc.region_id} is being released")
        total = sum(p.total_bytes for p in plans)
        descs = sum(p.descriptors for p in plans)
        rec = {
            "request_id": rid,
            "op": op,
            "peer": agent,
            "bytes": total,
            "descriptors": descs,
            "ranks": len(plans),
            "state": "in_flight",
            "started": time.time(),
        }
        self.sending[rid + ":" + op] = rec
        for loc, rem in zip(local, remote, strict=True):
            self.inflight_local[loc.region_id] = self.inflight_local.get(loc.region_id, 0) + 1
            key = (agent, rem.region_id)
            self.inflight_remote[key] = self.inflight_remote.get(key, 0) + 1
        t0 = time.perf_counter()
        errors: list[BaseException] = []
        try:
            if len(plans) == 1:  # one rank: no task group needed (it costs a task per request)
                await self._one(op, agent, plans[0], notifs[0], local[0], remote[0], errors)
            else:
                async with anyio.create_task_group() as tg:
                    for plan, notif, loc, rem in zip(plans, notifs, local, remote, strict=True):
                        tg.start_soon(self._one, op, agent, plan, notif, loc, rem, errors)
        finally:
            for loc, rem in zip(local, remote, strict=True):
                self.inflight_local[loc.region_id] -= 1
                self.inflight_remote[(agent, rem.region_id)] -= 1
                self._wake_drains()
            self.sending.pop(rid + ":" + op, None)
            rec["duration_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
            rec["state"] = "failed" if errors else "done"
            self.recent.append(rec)
        if errors:
            err = errors[0]
            if isinstance(err, PeerDisconnected):
                since = r.since if r is not None else float("inf")
                self.registrar.post(PeerLost(agent, str(err), since))
            raise err if isinstance(err, KvdError) else TransferError(str(err))
        self._count("transfers_ok")
        self._count("bytes_transferred", total)
        self._count("descriptors", descs)
        if r is not None:
            r.bytes, r.descriptors = total, descs

    async def _one(
        self,
        op: str,
        agent: str,
        plan: Plan,
        notif: bytes,
        loc: LocalRegion,
        rem: RemoteRegion,
        errors: list[BaseException],
    ) -> None:
        try:
            if plan.descriptors:
                await self.engine.transfer(
                    op,
                    plan.as_tuples_local(loc.device),
                    plan.as_tuples_remote(rem.device),
                    agent,
                    notif,
                    self.transfer_timeout,
                    plan.total_bytes,
                    local_mem=loc.mem_type,
                    remote_mem=rem.mem_type,
                )
            elif notif:
                await self.engine.send_notif(agent, notif)
        except KvdError as exc:
            errors.append(exc)

    # ---------------------------------------------------------------- P side push

    def _start_push(self, m: Match[_PushReg, Stage]) -> None:
        if self.clock.stall_count != self._stall_seen:
            # we were stalled: D may have given up on registrations meanwhile, and its
            # cancels may still sit unread behind our own backlog. Re-sync with each D
            # before WRITing into it (see the module docstring).
            self._stall_seen = self.clock.stall_count
            self.suspect = set(self.peers)
            self._count("stall_resyncs")
            log.warning("resync_after_stall", peers=len(self.suspect))
        agent = m.registration.agent
        if agent in self.suspect:
            self.parked.setdefault(agent, []).append(m)
            if agent not in self.resyncing:
                nonce = int.from_bytes(os.urandom(8), "little")
                self.resyncing[agent] = nonce
                self._arm(_RESYNC + agent, self.clock.now() + self.resync_timeout)
                assert self._tg is not None
                self._tg.start_soon(self._send_resync, agent, nonce)
            return
        assert self._tg is not None
        self._tg.start_soon(self._push, m)

    async def _send_resync(self, agent: str, nonce: int) -> None:
        try:
            await self.engine.send_notif(agent, wire.encode(wire.Resync(nonce)))
        except KvdError as exc:
            log.warning("resync_not_delivered", peer=agent, error=exc.message)
            self._resync_failed(agent)

    def _resynced(self, agent: str, nonce: int) -> None:
        if self.resyncing.get(agent) != nonce:
            self._reject(agent, "resync ack with an unknown nonce")
            return
        del self.resyncing[agent]
        self.watchdogs.discard(_RESYNC + agent)
        self.suspect.discard(agent)
        for m in self.parked.pop(agent, []):
            assert self._tg is not None
            self._tg.start_soon(self._push, m)

    def _resync_failed(self, agent: str) -> None:
        """D did not answer: it may have given up on any of these; fail them closed."""
        if self.resyncing.pop(agent, None) is None:
            return
        self.watchdogs.discard(_RESYNC + agent)
        self._count("resyncs_failed")
        exc = TransferError(f"peer {agent} did not re-sync after our stall")
        for m in self.parked.pop(agent, []):
            self.reaper.post_internal(Delivered(m.finished_id, False, int(exc.code), exc.message))
            assert self._tg is not None
            self._tg.start_soon(self._tell_push_failed, agent, m.registration.msg.request_id, exc)

    def _unpark(self, agent: str, key: str) -> Match[_PushReg, Stage] | None:
        """Take a parked match by its registration key (a cancel arrived for it)."""
        parked = self.parked.get(agent, [])
        for i, m in enumerate(parked):
            if m.registration_id == key:
                return parked.pop(i)
        return None

    async def _push(self, m: Match[_PushReg, Stage]) -> None:
        reg, fin = m.registration, m.finished
        d_rid = reg.msg.request_id
        claimed = False
        pushing = (reg.agent, reg.msg.remote_request_id or d_rid)
        self.pushing[pushing] = self.pushing.get(pushing, 0) + 1
        try:
            remote = await self._d_view(reg)
            claimed = await self.reaper.call(Claim(m.finished_id))
            if not claimed:
                raise LeaseExpired(f"the lease of {m.finished_id!r} expired before the WRITE")
            local = self._local_ranks(fin.engine_id)
            if len(remote) != len(local) or reg.msg.tp_size != len(local):
                raise Incompatible(f"TP mismatch: P has {len(local)} ranks, D has {len(remote)}")
            _check_compat(p=local, d=remote)
            d_blocks = reg.msg.block_ids
            if len(d_blocks) > len(fin.block_ids):
                raise InvalidRequest(
                    f"D registered {len(d_blocks)} blocks, P has {len(fin.block_ids)}"
                )
            p_blocks = fin.block_ids[len(fin.block_ids) - len(d_blocks) :] if d_blocks else ()
            plans = [
                plan_transfer(
                    loc.geometry,
                    _physical(loc.geometry, p_blocks, loc.layout.physical_per_logical),
                    rem.geometry,
                    _physical(rem.geometry, d_blocks, rem.geometry.physical_per_logical),
                )
                for loc, rem in zip(local, remote, strict=True)
            ]
            notifs = [
                wire.encode(wire.PushDone(d_rid, rank, True, 0, "")) for rank in range(len(local))
            ]
            await self._run_plans(
                "WRITE", m.finished_id, reg.agent, local, remote, plans, notifs, None
            )
            self.reaper.post_internal(Delivered(m.finished_id, True))
            log.debug("push_done", request_id=m.finished_id, peer=reg.agent)
        except KvdError as exc:
            self._count("push_failed")
            log.warning("push_failed", request_id=m.finished_id, peer=reg.agent, error=exc.message)
            await self._tell_push_failed(reg.agent, d_rid, exc)
            if claimed or not isinstance(exc, LeaseExpired):
                self.reaper.post_internal(
                    Delivered(m.finished_id, False, int(exc.code), exc.message)
                )
        finally:
            left = self.pushing.pop(pushing) - 1
            if left:
                self.pushing[pushing] = left

    async def _d_view(self, reg: _PushReg) -> list[RemoteRegion]:
        """D's regions exactly as its registration names them (incarnation, and each rank's
        generation). A stale or missing view (D's engine re-registered, D restarted) is
        refreshed once by a handshake with D; never WRITE through a view D did not name."""
        msg = reg.msg

        def fits(info: PeerInfo | None) -> list[RemoteRegion] | None:
            if info is None or info.incarnation != msg.incarnation:
                return None
            ranks = info.ranks(msg.engine_id)
            return ranks if tuple(r.generation for r in ranks) == msg.generations else None

        info = self.peers.get(reg.agent)
        ranks = fits(info)
        if ranks is not None:
            return ranks
        if not msg.side_host or not msg.side_port:
            raise Incompatible(f"D {reg.agent} named regions we do not know, and no address")
        self._count("peer_view_refreshes")
        info = await self.registrar.call(EnsurePeer(msg.side_host, msg.side_port, refresh=True))
        if info.agent != reg.agent:
            raise Incompatible(
                f"{msg.side_host}:{msg.side_port} is {info.agent}, not {reg.agent} who registered"
            )
        ranks = fits(info)
        if ranks is None:
            have = tuple(r.generation for r in info.ranks(msg.engine_id))
            raise Incompatible(
                f"D {reg.agent} registered into generations {msg.generations} of engine "
                f"{msg.engine_id!r}, its daemon announces {have}"
            )
        return ranks

    async def _tell_push_failed(self, agent: str, d_rid: str, exc: KvdError) -> None:
        try:
            await self.engine.send_notif(
                agent, wire.encode(wire.PushDone(d_rid, 0, False, int(exc.code), exc.message))
            )
        except KvdError as send_exc:
            log.warning(
                "push_failure_notice_failed", request_id=d_rid, peer=agent, error=send_exc.message
            )

    def _tombstone(self, rid: str, exc: KvdError) -> None:
        if self._max_tombstones <= 0:
            return
        self.expired[base_request_id(rid)] = exc
        while len(self.expired) > self._max_tombstones:
            self.expired.popitem(last=False)

    def _p_gave_up(self, rid: str) -> None:
        """P aborted `rid`: fail a registration already waiting for it, and any that comes later."""
        exc = TransferError("P aborted the request")
        self._tombstone(rid, exc)
        key = self.matcher.find_registration(rid)
        reg = self.matcher.remove_registration(key) if key is not None else None
        if reg is not None:
            assert self._tg is not None
            self._count("registrations_failed_p_abort")
            self._tg.start_soon(self._tell_push_failed, reg.agent, reg.msg.request_id, exc)

    # ---------------------------------------------------------------- notifications

    def _notif(self, agent: str, msg: wire.Record) -> None:
        if agent not in self.peers:
            self._reject(agent, f"{type(msg).__name__} from an agent that never handshaked")
            return
        if isinstance(msg, wire.PushRegistration):
            gone = self.expired.get(base_request_id(msg.remote_request_id or msg.request_id))
            if gone is None:
                gone = self.expired.get(base_request_id(msg.request_id))
            if gone is None and msg.p_session in self.ended_sessions:
                # the P engine session that was to finish it is gone: it never will
                gone = TransferError("P's engine session ended before it finished the request")
            if gone is not None:
                assert self._tg is not None
                self._tg.start_soon(self._tell_push_failed, agent, msg.request_id, gone)
                self._count("late_registrations")
                return
            key = msg.remote_request_id or msg.request_id
            try:
                match = self.matcher.add_registration(key, _PushReg(agent, msg), self.clock.now())
            except KvdError as exc:
                self._reject(agent, exc.message)
                return
            self._count("push_registrations")
            if match is not None:
                self._start_push(match)
        elif isinstance(msg, wire.PushDone):
            r = self.recvs.get(msg.request_id)
            if r is None or r.agent != agent or r.mode != "push":
                self._reject(agent, f"push completion for unknown request {msg.request_id!r}")
                return
            if not msg.ok:
                self._end_recv(r, _aborted() if r.aborted else _error(msg.code, msg.reason))
            elif msg.tp_rank >= r.expected_ranks:
                self._reject(agent, f"push completion for rank {msg.tp_rank} of {r.expected_ranks}")
            else:
                r.done_ranks.add(msg.tp_rank)
                if len(r.done_ranks) == r.expected_ranks:
                    self._end_recv(r, _aborted() if r.aborted else None)
        elif isinstance(msg, wire.PullAck):
            r = self.recvs.get(msg.d_request_id)
            if r is None or r.agent != agent or r.ack is None or r.ack.done():
                self._reject(agent, f"pull ack for unknown request {msg.d_request_id!r}")
                return
            r.ack.set_result(msg)
        elif isinstance(msg, wire.CancelRegistration):
            got = self.matcher.remove_registration(msg.request_id)
            if got is not None and got.agent != agent:
                self.matcher.add_registration(msg.request_id, got, self.clock.now())
                self._reject(agent, "cancel for another peer's registration")
                return
            self._count("cancels_received")
            # the lease (if P finished) is freed now, and a later finish or pull fails
            self.reaper.post_internal(CancelLease(msg.request_id, agent))
            self._tombstone(msg.request_id, TransferError("cancelled by D"))
            parked = self._unpark(agent, msg.request_id)
            if parked is not None:
                got = parked.registration
                self.reaper.post_internal(
                    Delivered(parked.finished_id, False, int(ErrorCode.TRANSFER), "cancelled by D")
                )
            if got is None:
                # nothing waits here: a WRITE under way answers D itself (its PushDone
                # lands after the bytes), an ended one already did, and a cancel for a
                # request never registered needs no answer
                return
            assert self._tg is not None
            # answer under D's own id
            self._tg.start_soon(
                self._tell_push_failed, agent, got.msg.request_id, TransferError("cancelled by D")
            )
        elif isinstance(msg, wire.Resync):
            assert self._tg is not None
            self._tg.start_soon(self._send_resync_ack, agent, msg.nonce)
        elif isinstance(msg, wire.ResyncAck):
            self._resynced(agent, msg.nonce)
        else:
            self._reject(agent, f"unexpected {type(msg).__name__}")

    async def _send_resync_ack(self, agent: str, nonce: int) -> None:
        try:
            await self.engine.send_notif(agent, wire.encode(wire.ResyncAck(nonce)))
        except KvdError as exc:
            log.warning("resync_ack_not_delivered", peer=agent, error=exc.message)

    def _reject(self, agent: str, why: str) -> None:
        self._count("notifs_rejected")
        log.warning("notif_rejected", peer=agent, reason=why)

    # ---------------------------------------------------------------- D request ends

    def _abort_recv(self, r: _Recv) -> None:
        """Abort: the terminal event waits until nothing can still write into D's blocks."""
        if r.aborted:
            return
        r.aborted = True
        self._count("aborted")
        if r.mode == "push" and r.state == "registered":
            assert self._tg is not None
            self._tg.start_soon(self._cancel_push, r)
        elif r.state == "handshake" and r.mode == "push":
            pass  # _register_push sees the flag and ends it
        # pull: the READ in flight (ours) finishes first; _pull then ends it as aborted.

    def _start_cancel(self, r: _Recv) -> None:
        assert self._tg is not None
        self._tg.start_soon(self._send_cancel, r)

    async def _send_cancel(self, r: _Recv) -> None:
        cancel = wire.CancelRegistration(r.remote_request_id or r.request_id)
        try:
            await self.engine.send_notif(r.agent, wire.encode(cancel))
        except KvdError as exc:
            log.warning(
                "cancel_not_delivered", request_id=r.request_id, peer=r.agent, error=exc.message
            )

    async def _cancel_push(self, r: _Recv) -> None:
        try:
            await self.engine.send_notif(
                r.agent, wire.encode(wire.CancelRegistration(r.remote_request_id or r.request_id))
            )
        except KvdError as exc:
            self._end_recv(r, _aborted(f"aborted; cancel not delivered: {exc.message}"))
            return
        # P answers with PushDone (failed, or ok if its WRITE already ran); bound the wait.
        self._arm(
            r.request_id,
            min(
                self.watchdogs.get(r.request_id) or float("inf"),
                self.clock.now() + min(self.transfer_timeout, 10.0),
            ),
        )

    def _arm(self, rid: str, when: float) -> None:
        """Set a watchdog from a task: the loop may be asleep on its mailbox without a
        deadline, so wake it to recompute (a full mailbox wakes it anyway)."""
        self.watchdogs.set(rid, when)
        with contextlib.suppress(Busy):
            self.mailbox.post(_REARM)

    def _end_recv(self, r: _Recv, exc: KvdError | None) -> None:
        if self.recvs.pop(r.request_id, None) is None:
            return
        if exc is not None and r.agent and r.state in ("handshake", "reading"):
            # P has not heard the request's fate (no registration, no PullDone): a cancel
            # frees its lease now instead of after a whole lease without heartbeats
            self._start_cancel(r)
        self.watchdogs.discard(r.request_id)
        if r.ack is not None and not r.ack.done():
            # not cancel(): a child task ending in CancelledError cancels the whole task group
            r.ack.set_exception(TransferError("the request already ended"))
            r.ack.exception()  # retrieved here; _pull still sees it if it awaits
        self.reaper.post_internal(Untrack(r.request_id))
        if r.session in self.closing:
            self._maybe_closed()
        dur = self.clock.now() - r.started
        if exc is None:
            self._count("recv_ok")
            self.emit(EventOut(r.session, r.engine_id, wire.RecvFinished(r.request_id)))
            log.debug("recv_finished", request_id=r.request_id, peer=r.agent, seconds=round(dur, 6))
        else:
            self._count("recv_failed")
            self.emit(
                EventOut(
                    r.session,
                    r.engine_id,
                    wire.RecvFailed(r.request_id, int(exc.code), exc.message[:1000], r.block_ids),
                )
            )
            log.info("recv_failed", request_id=r.request_id, peer=r.agent, error=exc.message)

    def _maybe_closed(self) -> None:
        """Answer closing sessions none of whose requests is still receiving."""
        busy = {r.session for r in self.recvs.values()}
        for session in [s for s in self.closing if s not in busy]:
            self.closing.pop(session).resolve(None)

    # ---------------------------------------------------------------- drains and status

    def _wake_drains(self) -> None:
        """A transfer ended: let every drain re-check its region (drains are rare)."""
        if self._drain_wakeup is not None:
            self._drain_wakeup.set()
            self._drain_wakeup = None

    async def _until_drained(self, busy: Callable[[], bool]) -> None:
        while busy():
            if self._drain_wakeup is None:
                self._drain_wakeup = anyio.Event()
            await self._drain_wakeup.wait()

    async def _drain(self, msg: DrainLocalRegion | DrainRemoteRegion) -> None:
        if isinstance(msg, DrainLocalRegion):
            rid = msg.region_id
            self.draining_local.add(rid)
            try:
                await self._until_drained(lambda: self.inflight_local.get(rid, 0) > 0)
            finally:
                self.draining_local.discard(rid)
                self.inflight_local.pop(rid, None)
        else:
            info = self.peers.get(msg.agent)
            if info is not None:
                regions = {k: v for k, v in info.regions.items() if v.region_id != msg.region_id}
                self.peers[msg.agent] = PeerInfo(**{**info.__dict__, "regions": regions})
            key = (msg.agent, msg.region_id)
            await self._until_drained(lambda: self.inflight_remote.get(key, 0) > 0)
            self.inflight_remote.pop(key, None)
        msg.resolve(None)

    def snapshot(self, section: str) -> dict[str, Any]:
        if section == "transfers":
            return {
                "in_flight": list(self.sending.values()),
                "recent": list(self.recent),
                "receiving": [
                    {
                        "request_id": r.request_id,
                        "mode": r.mode,
                        "peer": r.agent,
                        "state": r.state,
                        "ranks_done": len(r.done_ranks),
                        "ranks": r.expected_ranks,
                        "blocks": len(r.block_ids),
                        "age_s": round(self.clock.now() - r.started, 3),
                    }
                    for r in self.recvs.values()
                ],
            }
        return {
            "receiving": len(self.recvs),
            "sending": len(self.sending),
            "pending_registrations": self.matcher.pending_registrations(),
            "staged_blocks": self.matcher.pending_finished(),
            "tombstones": len(self.expired),
        }


ENDED_SESSIONS: Final = 65536
"""Ended client sessions each actor remembers (bounded; oldest forgotten first)."""


def _remember(ended: OrderedDict[str, None], session: str) -> None:
    ended[session] = None
    while len(ended) > ENDED_SESSIONS:
        ended.popitem(last=False)


def _physical(geo: Any, logical: tuple[int, ...], ratio: int) -> Any:
    from kvd.core.planner import check_blocks

    return check_blocks(geo, expand_logical(logical, ratio))


def _check_compat(
    *, p: Sequence[LocalRegion | RemoteRegion], d: Sequence[LocalRegion | RemoteRegion]
) -> None:
    """Refuse unless each P rank and its D rank declare the same, non-empty compat.

    Our own regions always have one (the registrar refuses an empty compat); a peer's
    empty one (a peer from before that rule) matches nothing. The reason names both
    values in full, so an operator sees which side to fix.
    """
    for pr, dr in zip(p, d, strict=True):
        if pr.compat and pr.compat == dr.compat:
            continue
        raise Incompatible(
            f"KV compatibility differs: P rank {pr.tp_rank} {pr.compat!r} "
            f"vs D rank {dr.tp_rank} {dr.compat!r}"
        )


def _aborted(reason: str = "aborted by the client") -> KvdError:
    return TransferError(reason)


def _error(code: int, reason: str) -> KvdError:
    from kvd_client.errors import error_from_code

    return error_from_code(code, reason)
