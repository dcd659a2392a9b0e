"""Reaper: leases on the P side, heartbeats and peer probes on the D side, on kvd's own clock.

P side: `Finish` grants a lease (kv_lease_duration) and stages the blocks for push;
`HB` notifications extend leases to max(old, now + 2/3·lease); the reaper sleeps until
the earliest deadline and expires leases then (heap, no scans). A WRITE claims its lease
first so it cannot expire under the copy; a pull's `PullDone` is acknowledged ok only if
the lease was still held (fail closed) and releases it.

A pull completion (`PullDone`) that arrives before P's engine finished the request (D's
READ overtook P's `finished` on its way here) waits for the lease up to
`lease_wait_timeout`: it is acknowledged the moment the lease is granted, and refused
only after that. A cancel from D (it aborted the request, or its session ended) releases
the lease at once and tombstones the id: a `finished` that comes later fails at once.

D side: a tracked request is heartbeated every lease/6 from arrival until its transfer
ends, one batched `HB` per P daemon. Peers with tracked requests are probed every
`peer_probe_interval`; a send that fails means the peer is gone and its requests fail.
A track belongs to the client session that made it: when that session closes (or the
client aborts the request) before the writer took the request over, heartbeats stop and
P is told to free the blocks now (a cancel), instead of keeping them for a whole lease.

Sessions: closing a session releases its leases; one whose WRITE is under way (claimed)
ends when the WRITE does, and the session's close is answered only then.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import anyio
import structlog
from anyio.abc import TaskStatus
from kvd_client import wire
from kvd_client.errors import (
    AuthError,
    ErrorCode,
    Incompatible,
    InvalidRequest,
    KvdError,
    NotFound,
    RemoteProtocolError,
)

from kvd.actors.base import Mailbox
from kvd.actors.messages import (
    CancelLease,
    Claim,
    ClientRequest,
    Delivered,
    EnsurePeer,
    EventOut,
    LocalRegion,
    LocalRegionsChanged,
    NotifReceived,
    PeerInfo,
    PeerLost,
    PeerUpdated,
    SessionClosed,
    Snapshot,
    Stage,
    TrackRequest,
    Unstage,
    Untrack,
)
from kvd.adapters.nixl import NixlEngine, PeerDisconnected
from kvd.core.heartbeats import HeartbeatSchedule
from kvd.core.ids import base_request_id
from kvd.core.leases import Lease, LeaseTable
from kvd.core.planner import check_blocks, expand_logical
from kvd.core.timers import TimerHeap

ENDED_SESSIONS: Final = 65536
"""Ended client sessions remembered (bounded; oldest forgotten first)."""

log = structlog.get_logger("kvd.reaper", actor="reaper")

MAX_HB_IDS: Final = 8192
"""Ids per heartbeat message (a larger batch is split)."""
_REFUSED: Final = (AuthError, Incompatible, InvalidRequest, RemoteProtocolError)
"""Handshake failures that retrying cannot mend (VersionMismatch is a RemoteProtocolError)."""
_CANCELLED: Final = -1
"""Tombstone code of an id D cancelled (a later finish or pull fails at once)."""


@dataclass
class _Owner:
    session: str
    engine_id: str


@dataclass
class _Tracked:
    request_id: str
    hb_id: str
    host: str
    port: int
    session: str
    by_writer: bool = False
    """The writer owns the request (it registered or pulls): it untracks and cancels."""


def _rank(r: LocalRegion) -> int:
    return r.tp_rank


@dataclass
class _EarlyPull:
    agent: str
    msg: wire.PullDone


class Reaper:
    def __init__(
        self,
        *,
        engine: NixlEngine,
        mailbox: Mailbox[Any],
        writer: Mailbox[Any],
        registrar: Mailbox[Any],
        emit: Callable[[EventOut], None],
        lease_duration: float,
        probe_interval: float,
        lease_wait_timeout: float,
        tombstones: int,
        counters: dict[str, int],
    ) -> None:
        self.engine = engine
        self.mailbox = mailbox
        self.clock = mailbox.clock
        self.writer = writer
        self.registrar = registrar
        self.emit = emit
        self.leases = LeaseTable(lease_duration)
        self.owners: dict[str, _Owner] = {}
        self.claimed: dict[str, Lease] = {}
        self.expired: OrderedDict[str, int] = OrderedDict()
        """Base ids P will never send, with the error code a late pull or finish gets."""
        self._max_tombstones = tombstones
        self.lease_wait_timeout = lease_wait_timeout
        self.early_pulls: dict[str, _EarlyPull] = {}
        """Pull completions waiting for their lease, by base id."""
        self.early_deadlines: TimerHeap[str] = TimerHeap()
        self.closing: dict[str, SessionClosed] = {}
        self.ended_sessions: OrderedDict[str, None] = OrderedDict()
        """Client sessions that ended (a pull naming one will never get its lease)."""
        self.failing_since: dict[str, float] = {}
        """Peer address -> when its handshake or sends began failing (cleared on success)."""
        self.heartbeats = HeartbeatSchedule()
        self.tracked: dict[str, _Tracked] = {}
        self.peers: dict[str, PeerInfo] = {}
        self.local: dict[tuple[str, int], LocalRegion] = {}
        self.probes: TimerHeap[str] = TimerHeap()
        self.probe_interval = probe_interval
        self.counters = counters
        self._tg: anyio.abc.TaskGroup | None = None
        self.expiry_lag_max = 0.0

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    def next_deadline(self) -> float | None:
        times = [
            t
            for t in (
                self.leases.next_deadline(),
                self.heartbeats.next_deadline(),
                self.probes.next_time(),
                self.early_deadlines.next_time(),
            )
            if t is not None
        ]
        return min(times) if times else None

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        async with anyio.create_task_group() as tg:
            self._tg = tg
            task_status.started()
            while True:
                msg: Any = await self.mailbox.receive_before(self.next_deadline())
                if msg is not None:
                    self._dispatch(msg)
                self._on_time(self.clock.now())

    # ---------------------------------------------------------------- timers

    def _on_time(self, now: float) -> None:
        for base, _ in self.early_deadlines.pop_due(now):
            early = self.early_pulls.pop(base, None)
            if early is not None:
                why = f"no lease for this request within {self.lease_wait_timeout}s"
                self._refuse_pull(early.agent, early.msg, int(ErrorCode.NOT_FOUND), why)
        for lease in self.leases.expire(now):
            self.expiry_lag_max = max(self.expiry_lag_max, now - lease.deadline)
            self._count("leases_expired")
            self._tombstone(lease.request_id, int(ErrorCode.LEASE_EXPIRED))
            owner = self.owners.pop(lease.request_id, None)
            self.writer.post_internal(Unstage(lease.request_id, expired=True))
            if owner is not None:
                self.emit(
                    EventOut(owner.session, owner.engine_id, wire.SendExpired(lease.request_id))
                )
            log.info(
                "lease_expired", request_id=lease.request_id, late_s=round(now - lease.deadline, 4)
            )
        for peer, ids in self.heartbeats.due(now).items():
            assert self._tg is not None
            self._tg.start_soon(self._beat, peer, ids)
        for peer, _ in self.probes.pop_due(now):
            if self.heartbeats.requests_of(peer):
                assert self._tg is not None
                self._tg.start_soon(self._probe, peer)
                self.probes.set(peer, now + self.probe_interval)

    async def _beat(self, peer: str, ids: list[str]) -> None:
        """One batched HB per peer; ids are the P-side ids D knows (or D's own)."""
        hb_ids = [self.tracked[i].hb_id for i in ids if i in self.tracked]
        info: PeerInfo | None = None
        try:
            info = await self._info(peer)
            for i in range(0, len(hb_ids), MAX_HB_IDS):
                beat = wire.Heartbeat(tuple(hb_ids[i : i + MAX_HB_IDS]))
                await self.engine.send_notif(info.agent, wire.encode(beat))
            self._count("heartbeats_sent")
            self._count("heartbeat_ids_sent", len(hb_ids))
            self.failing_since.pop(peer, None)
        except KvdError as exc:
            self._peer_failed(peer, exc, info)

    async def _probe(self, peer: str) -> None:
        info: PeerInfo | None = None
        try:
            info = await self._info(peer)
            await self.engine.send_notif(info.agent, wire.encode(wire.Probe(0, True)))
            self.failing_since.pop(peer, None)
        except KvdError as exc:
            self._peer_failed(peer, exc, info)

    async def _info(self, peer: str) -> PeerInfo:
        host, _, port = peer.rpartition(":")
        info: PeerInfo = await self.registrar.call(EnsurePeer(host, int(port)))
        return info

    def _peer_failed(self, peer: str, exc: KvdError, info: PeerInfo | None) -> None:
        self._count("peer_failures")
        now = self.clock.now()
        first = self.failing_since.setdefault(peer, now)
        if first == now:
            log.warning("peer_unreachable", peer=peer, error=exc.message)
        if info is None and (
            isinstance(exc, _REFUSED) or now - first >= self.leases.duration
        ):
            # The handshake itself cannot succeed (refused: another secret, version or
            # model), or has not for a whole lease (any lease P granted has expired): stop
            # beating it instead of retrying forever. A request that registers or pulls
            # later fails through its own handshake.
            self._give_up_on(peer, exc)
            return
        if info is not None:  # the view the failure was seen through
            agent, since = info.agent, info.handshaked_at
        else:
            agent, since = (
                next((a for a, p in self.peers.items() if p.addr == peer), ""),
                float("inf"),
            )
        if agent and isinstance(exc, PeerDisconnected):
            lost = PeerLost(agent, exc.message, since)
            self.writer.post_internal(lost)
            self.registrar.post_internal(lost)
        elif agent:
            self.writer.post_internal(PeerLost(agent, exc.message, since))
        else:
            # never reached: the requests waiting on it fail through the writer's handshake
            pass

    def _give_up_on(self, peer: str, exc: KvdError) -> None:
        self.failing_since.pop(peer, None)
        dropped = [
            t
            for rid in self.heartbeats.requests_of(peer)
            if (t := self.tracked.get(rid)) is not None and not t.by_writer
        ]
        for t in dropped:
            self.heartbeats.untrack(t.request_id)
            self.tracked.pop(t.request_id, None)
        self.probes.discard(peer)
        self._count("peers_given_up")
        self._count("tracks_dropped", len(dropped))
        log.warning("peer_given_up", peer=peer, tracks_dropped=len(dropped), error=exc.message)

    # ---------------------------------------------------------------- messages

    def _dispatch(self, msg: Any) -> None:
        now = self.clock.now()
        if isinstance(msg, ClientRequest):
            self._client(msg, now)
        elif isinstance(msg, NotifReceived):
            self._notif(msg.agent, msg.msg, now)
        elif isinstance(msg, LocalRegionsChanged):
            self.local = msg.regions
        elif isinstance(msg, Claim):
            key = self.leases.find(msg.request_id)
            lease = self.leases.release(key) if key is not None else None
            if lease is None:
                msg.resolve(False)
            else:
                self.claimed[lease.request_id] = lease
                msg.resolve(True)
        elif isinstance(msg, Delivered):
            self._delivered(msg)
            self._maybe_closed()
        elif isinstance(msg, CancelLease):
            self._cancelled(msg.request_id, msg.agent)
        elif isinstance(msg, TrackRequest):
            self._track(msg.request_id, msg.remote_request_id, msg.host, msg.port, msg.session, now)
            self.tracked[msg.request_id].by_writer = True
        elif isinstance(msg, Untrack):
            self.heartbeats.untrack(msg.request_id)
            self.tracked.pop(msg.request_id, None)
        elif isinstance(msg, PeerUpdated):
            if msg.info is None:
                self.peers.pop(msg.agent, None)
            else:
                self.peers[msg.agent] = msg.info
                # requests tracked before the handshake beat at our own lease/6: use P's
                interval = max(msg.info.lease_duration / 6.0, 0.01)
                self.heartbeats.set_interval(msg.info.addr, interval, now)
        elif isinstance(msg, SessionClosed):
            self.ended_sessions[msg.session] = None
            while len(self.ended_sessions) > ENDED_SESSIONS:
                self.ended_sessions.popitem(last=False)
            for rid, owner in list(self.owners.items()):
                if owner.session == msg.session:
                    self._end_lease(rid, None)
            for t in list(self.tracked.values()):
                if t.session == msg.session and not t.by_writer:
                    self._drop_track(t)
            self.closing[msg.session] = msg
            self._maybe_closed()
        elif isinstance(msg, Snapshot):
            msg.resolve(self.snapshot(msg.section))
        else:
            raise TypeError(f"reaper got {type(msg).__name__}")

    def _client(self, req: ClientRequest, now: float) -> None:
        m = req.msg
        try:
            if isinstance(m, wire.Finish):
                if m.request_id in self.leases or m.request_id in self.claimed:
                    raise InvalidRequest(f"request {m.request_id!r} already holds a lease")
                self._check_blocks(m.engine_id, m.block_ids)
                if self.expired.get(base_request_id(m.request_id)) == _CANCELLED:
                    # nothing will read these blocks: end the request now (an event, so
                    # that the engine's workers see it too), lease nothing
                    self._count("finishes_after_cancel")
                    req.resolve(wire.Ok())
                    why = "D cancelled the request before P finished it"
                    ev = wire.SendFailed(m.request_id, int(ErrorCode.TRANSFER), why)
                    self.emit(EventOut(req.session, m.engine_id, ev))
                    return
                self.leases.grant(m.request_id, now, owner=req.session)
                self.owners[m.request_id] = _Owner(req.session, m.engine_id)
                self._count("leases_granted")
                self.writer.post_internal(
                    Stage(m.request_id, m.engine_id, m.block_ids, req.session)
                )
                req.resolve(wire.Ok())
                early = self._take_early_pull(m.request_id)
                if early is not None:
                    self._count("early_pulls_served")
                    self._pull_done(early.agent, early.msg)
            elif isinstance(m, wire.Track):
                self._track(
                    m.request_id, m.remote_request_id, m.peer_host, m.peer_port, req.session, now
                )
                req.resolve(wire.Ok())
            elif isinstance(m, wire.Abort):
                t = self.tracked.get(m.request_id)
                if t is not None and t.session == req.session and not t.by_writer:
                    self._drop_track(t)  # D gave up before registering or pulling: tell P
                owner = self.owners.get(m.request_id)
                if (
                    owner is not None
                    and owner.session == req.session
                    and m.request_id in self.leases
                ):
                    self._end_lease(
                        m.request_id,
                        wire.SendFailed(m.request_id, int(ErrorCode.TRANSFER), "aborted"),
                    )
                # D side: the writer ends the receive and replies.
                self.writer.post(req)
            else:
                raise TypeError(f"reaper got {type(m).__name__}")
        except KvdError as exc:
            self._count("requests_rejected")
            req.fail(exc)

    def _check_blocks(self, engine_id: str, block_ids: tuple[int, ...]) -> None:
        """Refuse a lease on blocks that are not in every one of the engine's regions (so a
        bad P block id is an error for the caller now, never an input to the planner)."""
        regions = [r for (e, _), r in self.local.items() if e == engine_id]
        if not regions:
            raise NotFound(f"engine {engine_id!r} has no registered region on this daemon")
        for r in regions:
            check_blocks(r.geometry, expand_logical(block_ids, r.layout.physical_per_logical))

    def _track(
        self, rid: str, remote_rid: str, host: str, port: int, session: str, now: float
    ) -> None:
        if rid in self.tracked:
            return
        peer = f"{host}:{port}"
        self.tracked[rid] = _Tracked(rid, remote_rid or rid, host, port, session)
        agent = next((a for a, p in self.peers.items() if p.addr == peer), None)
        lease = self.peers[agent].lease_duration if agent else self.leases.duration
        self.heartbeats.track(rid, peer, now, max(lease / 6.0, 0.01))
        if peer not in self.probes:
            self.probes.set(peer, now + self.probe_interval)

    def _drop_track(self, t: _Tracked) -> None:
        """Stop heartbeating a request its client gave up on, and tell P to free it now."""
        self.heartbeats.untrack(t.request_id)
        self.tracked.pop(t.request_id, None)
        self._count("tracks_cancelled")
        assert self._tg is not None
        self._tg.start_soon(self._send_cancel, f"{t.host}:{t.port}", t.hb_id)

    async def _send_cancel(self, peer: str, rid: str) -> None:
        """Tell P (at `peer`, handshaking first if need be: a handshake may still be under
        way) that nothing will take `rid`'s blocks."""
        try:
            info = await self._info(peer)
            await self.engine.send_notif(info.agent, wire.encode(wire.CancelRegistration(rid)))
        except KvdError as exc:
            log.warning("cancel_not_delivered", request_id=rid, peer=peer, error=exc.message)

    def _cancelled(self, rid: str, agent: str) -> None:
        """P: D cancelled `rid` (by P's id or its own): free the lease now, and fail a
        finish or a pull that comes later."""
        key = self.leases.find(rid)
        if key is not None:
            self._count("leases_cancelled")
            log.info("lease_cancelled_by_d", request_id=key, peer=agent)
            self._end_lease(key, wire.SendFailed(key, int(ErrorCode.TRANSFER), "cancelled by D"))
            self._tombstone(key, _CANCELLED)
        self._tombstone(rid, _CANCELLED)
        early = self._take_early_pull(rid)
        if early is not None:
            self._refuse_pull(early.agent, early.msg, int(ErrorCode.TRANSFER), "cancelled by D")

    def _maybe_closed(self) -> None:
        """Answer closing sessions that own no lease under a WRITE any more."""
        if not self.closing:
            return
        busy = {self.owners[rid].session for rid in self.claimed if rid in self.owners}
        for session in [s for s in self.closing if s not in busy]:
            self.closing.pop(session).resolve(None)

    def _end_lease(self, rid: str, event: wire.Record | None) -> None:
        """Release a lease early (P aborted, its client went away, or D cancelled): it will
        never be sent, and a pull that comes later is refused at once."""
        if rid in self.leases:
            self._tombstone(rid, int(ErrorCode.NOT_FOUND))
        self.leases.release(rid)
        owner = self.owners.pop(rid, None)
        self.writer.post_internal(Unstage(rid, expired=False, aborted=True))
        if owner is not None and event is not None:
            self.emit(EventOut(owner.session, owner.engine_id, event))

    def _delivered(self, msg: Delivered) -> None:
        lease = self.claimed.pop(msg.request_id, None)
        key = msg.request_id if lease is not None else self.leases.find(msg.request_id)
        if key is None:
            return
        if lease is None:
            self.leases.release(key)
        owner = self.owners.pop(key, None)
        if owner is None:
            return
        if msg.ok:
            self._count("sends_ok")
            self.emit(EventOut(owner.session, owner.engine_id, wire.SendFinished(key)))
        else:
            self._count("sends_failed")
            self.emit(
                EventOut(owner.session, owner.engine_id, wire.SendFailed(key, msg.code, msg.reason))
            )

    def _notif(self, agent: str, msg: wire.Record, now: float) -> None:
        if agent not in self.peers:  # no handshake: it may not extend or release leases
            self._count("notifs_rejected")
            why = f"{type(msg).__name__} from an agent that never handshaked"
            log.warning("notif_rejected", peer=agent, reason=why)
            return
        if isinstance(msg, wire.Heartbeat):
            known = self.leases.extend((self.leases.find(i) or i for i in msg.request_ids), now)
            self._count("heartbeats_received")
            unknown = len(msg.request_ids) - len(known)
            if unknown:
                self._count("heartbeat_unknown_ids", unknown)
        elif isinstance(msg, wire.PullDone):
            self._pull_done(agent, msg, now)
        else:
            self._count("notifs_rejected")
            log.warning("notif_rejected", peer=agent, reason=f"unexpected {type(msg).__name__}")

    def _pull_done(self, agent: str, msg: wire.PullDone, now: float | None = None) -> None:
        """D finished READing P's blocks: ack ok only if the lease is held (fail closed)."""
        key = self.leases.find(msg.request_id)
        if key is not None and msg.generations:
            owner = self.owners.get(key)
            have = self._generations(owner.engine_id) if owner is not None else ()
            if have != msg.generations:
                # D read through a view of regions we no longer have (our engine
                # re-registered and D missed the drop notice): its bytes are not ours
                why = f"D read generations {msg.generations}, P's regions are {have}"
                self._count("pulls_stale_view")
                self._end_lease(key, wire.SendFailed(key, int(ErrorCode.TRANSFER), why))
                self._refuse_pull(agent, msg, int(ErrorCode.TRANSFER), why)
                return
        if key is not None:
            owner = self.owners.pop(key, None)
            self.leases.release(key)
            self.writer.post_internal(Unstage(key, expired=False))
            self._count("pulls_acked")
            if owner is not None:
                self.emit(EventOut(owner.session, owner.engine_id, wire.SendFinished(key)))
            self._ack(agent, wire.PullAck(msg.d_request_id, True, 0, ""))
            return
        base = base_request_id(msg.request_id)
        code = self.expired.get(base)
        if code is None and msg.p_session in self.ended_sessions:
            code = int(ErrorCode.TRANSFER)  # its engine session ended: no finish will come
        if code is None and now is not None and base not in self.early_pulls:
            # P's engine may not have finished yet (its `finished` is on its way): wait
            self._count("early_pulls")
            self.early_pulls[base] = _EarlyPull(agent, msg)
            self.early_deadlines.set(base, now + self.lease_wait_timeout)
            return
        if code == int(ErrorCode.LEASE_EXPIRED):
            why = "the lease expired before the pull completed"
        elif code == _CANCELLED:
            code, why = int(ErrorCode.TRANSFER), "D cancelled the request"
        elif code is not None and msg.p_session in self.ended_sessions:
            why = "P's engine session ended before it finished the request"
        elif code is not None:
            why = "P gave up on the request"
        else:
            code, why = int(ErrorCode.NOT_FOUND), "no lease for this request"
        self._refuse_pull(agent, msg, code, why)

    def _generations(self, engine_id: str) -> tuple[int, ...]:
        regs = sorted((r for (e, _), r in self.local.items() if e == engine_id), key=_rank)
        return tuple(r.generation for r in regs)

    def _take_early_pull(self, rid: str) -> _EarlyPull | None:
        base = base_request_id(rid)
        early = self.early_pulls.pop(base, None)
        if early is not None:
            self.early_deadlines.discard(base)
        return early

    def _refuse_pull(self, agent: str, msg: wire.PullDone, code: int, why: str) -> None:
        self._count("pulls_refused")
        log.warning("pull_refused", request_id=msg.request_id, peer=agent, reason=why)
        self._ack(agent, wire.PullAck(msg.d_request_id, False, code, why))

    def _ack(self, agent: str, ack: wire.PullAck) -> None:
        assert self._tg is not None
        self._tg.start_soon(self._send_ack, agent, ack)

    async def _send_ack(self, agent: str, ack: wire.PullAck) -> None:
        try:
            await self.engine.send_notif(agent, wire.encode(ack))
        except KvdError as exc:
            log.warning("pull_ack_failed", peer=agent, error=exc.message)

    def _tombstone(self, rid: str, code: int) -> None:
        if self._max_tombstones <= 0:
            return
        self.expired[base_request_id(rid)] = code
        while len(self.expired) > self._max_tombstones:
            self.expired.popitem(last=False)

    def snapshot(self, section: str) -> dict[str, Any]:
        now = self.clock.now()
        if section == "leases":
            return {
                "leases": [
                    {
                        "request_id": lease.request_id,
                        "expires_in_s": round(lease.deadline - now, 3),
                        "age_s": round(now - lease.granted_at, 3),
                        "state": "held",
                    }
                    for lease in self.leases.leases()
                ]
                + [
                    {
                        "request_id": rid,
                        "expires_in_s": None,
                        "age_s": round(now - lease.granted_at, 3),
                        "state": "sending",
                    }
                    for rid, lease in self.claimed.items()
                ],
                "tracked": [
                    {"request_id": t.request_id, "peer": f"{t.host}:{t.port}", "hb_id": t.hb_id}
                    for t in self.tracked.values()
                ],
            }
        return {
            "leases": len(self.leases),
            "claimed": len(self.claimed),
            "tracked": len(self.tracked),
            "heartbeat_peers": len(self.heartbeats.peers()),
            "expiry_lag_max_ms": round(self.expiry_lag_max * 1e3, 3),
        }
