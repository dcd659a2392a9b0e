"""Reaper: leases on the P side, heartbeats and peer probes on the D side, on kvd's own clock.

P side: `Finish` grants a lease (kv_lease_duration) and stages the blocks for push;
`HB` notifications extend leases to max(old, now + 2/3·lease); the reaper sleeps until
the earliest deadline and expires leases then (heap, no scans). A WRITE claims its lease
first so it cannot expire under the copy; a pull's `PullDone` is acknowledged ok only if
the lease was still held (fail closed) and releases it.

D side: a tracked request is heartbeated every lease/6 from arrival until its transfer
ends, one batched `HB` per P daemon. Peers with tracked requests are probed every
`peer_probe_interval`; a send that fails means the peer is gone and its requests fail.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import anyio
import structlog
from anyio.abc import TaskStatus
from kvd_client import wire
from kvd_client.errors import ErrorCode, InvalidRequest, KvdError, NotFound

from kvd.actors.base import Mailbox
from kvd.actors.messages import (
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

log = structlog.get_logger("kvd.reaper", actor="reaper")

MAX_HB_IDS: Final = 8192
"""Ids per heartbeat message (a larger batch is split)."""


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
    agent: str = ""


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
        tombstones: int,
        counters: dict[str, int],
    ) -> None:
        self.engine = engine
        self.mailbox = mailbox
        self.writer = writer
        self.registrar = registrar
        self.emit = emit
        self.leases = LeaseTable(lease_duration)
        self.owners: dict[str, _Owner] = {}
        self.claimed: dict[str, Lease] = {}
        self.expired: OrderedDict[str, None] = OrderedDict()
        self._max_tombstones = tombstones
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
                self._on_time(time.monotonic())

    # ---------------------------------------------------------------- timers

    def _on_time(self, now: float) -> None:
        for lease in self.leases.expire(now):
            self.expiry_lag_max = max(self.expiry_lag_max, now - lease.deadline)
            self._count("leases_expired")
            self._tombstone(lease.request_id)
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
        except KvdError as exc:
            self._peer_failed(peer, exc, info)

    async def _probe(self, peer: str) -> None:
        info: PeerInfo | None = None
        try:
            info = await self._info(peer)
            await self.engine.send_notif(info.agent, wire.encode(wire.Probe(0, True)))
        except KvdError as exc:
            self._peer_failed(peer, exc, info)

    async def _info(self, peer: str) -> PeerInfo:
        host, _, port = peer.rpartition(":")
        info: PeerInfo = await self.registrar.call(EnsurePeer(host, int(port)))
        return info

    def _peer_failed(self, peer: str, exc: KvdError, info: PeerInfo | None) -> None:
        log.warning("peer_unreachable", peer=peer, error=exc.message)
        self._count("peer_failures")
        if info is not None:  # the view the failure was seen through
            agent, since = info.agent, info.handshaked_at
        else:
            agent, since = (
                next((a for a, p in self.peers.items() if p.addr == peer), ""),
                float("inf"),
            )
        if agent and isinstance(exc, PeerDisconnected):
            lost = PeerLost(agent, exc.message, since)
            self.writer.post(lost)
            self.registrar.post(lost)
        elif agent:
            self.writer.post(PeerLost(agent, exc.message, since))
        else:
            # never reached: the requests waiting on it fail through the writer's handshake
            pass

    # ---------------------------------------------------------------- messages

    def _dispatch(self, msg: Any) -> None:
        now = time.monotonic()
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
        elif isinstance(msg, TrackRequest):
            self._track(msg.request_id, msg.remote_request_id, msg.host, msg.port, now)
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
            for rid, owner in list(self.owners.items()):
                if owner.session == msg.session:
                    self._end_lease(rid, None)
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
                self.leases.grant(m.request_id, now, owner=req.session)
                self.owners[m.request_id] = _Owner(req.session, m.engine_id)
                self._count("leases_granted")
                self.writer.post_internal(
                    Stage(m.request_id, m.engine_id, m.block_ids, req.session)
                )
                req.resolve(wire.Ok())
            elif isinstance(m, wire.Track):
                self._track(m.request_id, m.remote_request_id, m.peer_host, m.peer_port, now)
                req.resolve(wire.Ok())
            elif isinstance(m, wire.Abort):
                self.heartbeats.untrack(m.request_id)
                self.tracked.pop(m.request_id, None)
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

    def _track(self, rid: str, remote_rid: str, host: str, port: int, now: float) -> None:
        if rid in self.tracked:
            return
        peer = f"{host}:{port}"
        self.tracked[rid] = _Tracked(rid, remote_rid or rid, host, port)
        agent = next((a for a, p in self.peers.items() if p.addr == peer), None)
        lease = self.peers[agent].lease_duration if agent else self.leases.duration
        self.heartbeats.track(rid, peer, now, max(lease / 6.0, 0.01))
        if peer not in self.probes:
            self.probes.set(peer, now + self.probe_interval)

    def _end_lease(self, rid: str, event: wire.Record | None) -> None:
        """Release a lease early (P aborted, or its client went away): it will never be sent."""
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
            key = self.leases.find(msg.request_id)
            if key is not None:
                owner = self.owners.pop(key, None)
                self.leases.release(key)
                self.writer.post_internal(Unstage(key, expired=False))
                ack = wire.PullAck(msg.d_request_id, True, 0, "")
                self._count("pulls_acked")
                if owner is not None:
                    self.emit(EventOut(owner.session, owner.engine_id, wire.SendFinished(key)))
            else:
                expired = base_request_id(msg.request_id) in self.expired
                code = ErrorCode.LEASE_EXPIRED if expired else ErrorCode.NOT_FOUND
                why = (
                    "the lease expired before the pull completed"
                    if expired
                    else "no lease for this request"
                )
                ack = wire.PullAck(msg.d_request_id, False, int(code), why)
                self._count("pulls_refused")
                log.warning("pull_refused", request_id=msg.request_id, peer=agent, reason=why)
            assert self._tg is not None
            self._tg.start_soon(self._send_ack, agent, ack)
        else:
            self._count("notifs_rejected")
            log.warning("notif_rejected", peer=agent, reason=f"unexpected {type(msg).__name__}")

    async def _send_ack(self, agent: str, ack: wire.PullAck) -> None:
        try:
            await self.engine.send_notif(agent, wire.encode(ack))
        except KvdError as exc:
            log.warning("pull_ack_failed", peer=agent, error=exc.message)

    def _tombstone(self, rid: str) -> None:
        if self._max_tombstones <= 0:
            return
        self.expired[base_request_id(rid)] = None
        while len(self.expired) > self._max_tombstones:
            self.expired.popitem(last=False)

    def snapshot(self, section: str) -> dict[str, Any]:
        now = time.monotonic()
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
