"""Sender: the P side of every KV transfer, a thin shell around `kvd.core.sender.Sender`.

The protocol (leases, matching D's registration, claims, tombstones, re-sync after a
stall) lives in the sans-IO machine; this actor feeds it what arrives (P's engine's
`finished` and aborts, D's registrations, heartbeats, pull completions and cancels, the
outcome of its own work) with the daemon's time, and carries out the effects: events to
clients, notifications to peers, resolving D's regions (a handshake when our view is
stale) and the WRITEs themselves, through the transport port. Outcomes of that work come
back through the actor's own mailbox, so only the actor's loop touches the machine.

Layer-wise push: workers' `LayersSaved` notices (one way, validated here) feed the
machine; the `PostLayers` it returns during one turn of the loop (which takes up to
`turn_batch` waiting messages together) are posted at the turn's end, coalesced: those
going to the same D region (agent, rank, region generation) become one WRITE of all
their descriptors, carrying one `LayersPushed` that names each request's layers.
"""

from __future__ import annotations

import collections
import ctypes
import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, Final

import anyio
import numpy as np
import numpy.typing as npt
import structlog
from kvd_client import wire
from kvd_client.errors import Incompatible, InvalidRequest, KvdError, NotFound

from kvd.actors.base import Mailbox
from kvd.actors.messages import (
    AbortNotTaken,
    ClientRequest,
    EnsurePeer,
    EventOut,
    FinishNotTaken,
    HeartbeatReceived,
    LayersAnnounced,
    LocalRegion,
    LocalRegionsChanged,
    NotifReceived,
    PeerInfo,
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
from kvd.adapters.nixl import Unsettled
from kvd.adapters.staging import StagingArea
from kvd.core import sender as proto
from kvd.core.gather import (
    Gathered,
    GatherTemplate,
    Prepared,
    gather,
    plan_gather,
    plan_template,
    prepare,
    split,
    worth_gathering,
)
from kvd.core.hybrid import plan_any
from kvd.core.limits import Reservation
from kvd.core.planner import Plan, RequestPlan, check_logical, plan_request, shift_plan
from kvd.core.staging import shifted
from kvd.core.trace import NO_TRACE, StageTrace, trace_key
from kvd.logs import RejectLog

log = structlog.get_logger("kvd.sender", actor="sender")

MAX_COALESCED: Final = 1024
"""Requests' layer ranges one coalesced WRITE carries at most (its LayersPushed names each)."""
TEMPLATES: Final = 64
"""Region shapes whose gather templates are kept (least recently used dropped)."""
LAYER_PLANS: Final = 256
"""Layer-wise pushes' plans kept (`_layer_plan_of`; least recently used dropped): one per
streaming request and range length, enough for the requests of a few steps."""
PIPELINE_PARTS: Final = 2
"""A push gathered on P is WRITten in at most this many parts (`transfer.
gather_part_bytes` each): a part's WRITE runs while the next part is planned and
gathered (`kvd.core.gather.Prepared.part`). Measured on 2 cores (16 MiB requests, `kvd
bench --only topology`): 2 parts beat 1, 4 and 8 (the gather and UCX's copy compete for
the same cores and memory bandwidth, and each part's WRITE costs a post and a
completion)."""


@dataclass(eq=False)
class _StagedPush:
    """A push being gathered into a slot of P's staging area (`SenderActor._gather`):
    its first part gathered, the others to come (`_write_staged`)."""

    base: int
    """The slot's address."""
    first: Gathered
    """The first part, gathered."""
    rest: list[Callable[[], Gathered]]
    """The other parts, in order: each plans and gathers its part (in a worker thread)."""
    spent: list[float]
    """Seconds each planning and gathering took (`staged_gather_us`)."""
    free: Callable[[], None]
    """Frees the slot (once nothing gathers into it and UCX ended every WRITE from it)."""
    unhold: Callable[[], None]
    """Lets a drain of P's regions go on (once nothing gathers from them any more)."""


class Sender(TransferActor):
    name = "sender"
    turn_batch = 64

    def __init__(
        self,
        *,
        transport: Transport,
        mailbox: Mailbox[Any],
        registrar: Mailbox[Any],
        emit: Callable[[EventOut], None],
        lease_duration: float,
        lease_wait_timeout: float,
        registration_timeout: float,
        transfer_timeout: float,
        tombstones: int,
        counters: dict[str, int],
        max_pending_per_peer: int = 16384,
        pending_bytes: int = 256 << 20,
        rejects: RejectLog | None = None,
        trace: StageTrace = NO_TRACE,
        staging: StagingArea | None = None,
        gather_part_bytes: int = 8 << 20,
        incarnation: int = 0,
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
        self.proto: proto.Sender = proto.Sender(
            lease_duration=lease_duration,
            lease_wait_timeout=lease_wait_timeout,
            registration_timeout=registration_timeout,
            max_tombstones=tombstones,
            max_pending_per_peer=max_pending_per_peer,
            pending_bytes=pending_bytes,
            counters=counters,
            unsettled_hold=2 * transfer_timeout + 1.0,
            incarnation=incarnation,
        )
        self.staging = staging
        """Daemon-owned registered memory (shared with the receiver) where a push with
        many small descriptors is gathered before its WRITE (`_gather`)."""
        self.part_bytes = gather_part_bytes
        """A gathered push is WRITten in parts of about this many bytes (0: whole)."""
        self._templates: collections.OrderedDict[tuple[Any, ...], GatherTemplate | None] = (
            collections.OrderedDict()
        )
        """Gather templates by the shape of the P and D regions (`_template`)."""
        self._layer_plans: collections.OrderedDict[tuple[Any, ...], tuple[int, RequestPlan]] = (
            collections.OrderedDict()
        )
        """A layer-wise push's plan of some layers [first, first + n), by request, n,
        blocks and regions: the plan of its later ranges of n layers, moved (`shift_plan`)."""
        self.post_fence = transfer_timeout
        """Seconds (raw monotonic: a stall counts) within which a WRITE the machine decided
        must be posted, or it is not posted at all (`Transport.transfer`'s `post_by`)."""
        self._stall_seen = self.clock.stall_count
        self._layer_posts: list[proto.PostLayers] = []

    # ---------------------------------------------------------------- input

    def _woke(self, now: float) -> None:
        if self.clock.stall_count != self._stall_seen:
            self._stall_seen = self.clock.stall_count
            self._feed(proto.Stalled(), now)

    def _own(self, msg: Any, now: float) -> bool:
        if isinstance(msg, FinishNotTaken):
            self._finish_refused(msg.request_id, msg.code, msg.error, now)
        elif isinstance(msg, AbortNotTaken):
            self._feed(proto.AbortSend(msg.request_id, msg.session), now)
        elif isinstance(msg, HeartbeatReceived):
            try:
                if self._known(msg.agent, msg.msg):
                    self._feed(proto.HeartbeatArrived(msg.agent, msg.msg.request_ids), now)
            finally:  # handled: its bytes no longer wait
                if msg.reservation is not None:
                    msg.reservation.release()
        elif isinstance(msg, NotifReceived):
            try:
                self._notif(msg.agent, msg.msg, now, msg.reservation)
            finally:  # dropped before the machine kept it (the machine adopts what it keeps)
                if msg.reservation is not None:
                    msg.reservation.release()
        elif isinstance(msg, LayersAnnounced):
            self._layers_announced(msg.msg, now)
        elif isinstance(msg, LocalRegionsChanged):
            self.local = msg.regions
            gens: dict[str, list[tuple[int, int]]] = {}
            for (engine, rank), r in msg.regions.items():
                gens.setdefault(engine, []).append((rank, r.generation))
            by_engine = {e: tuple(g for _, g in sorted(v)) for e, v in gens.items()}
            self._feed(proto.RegionsChanged(by_engine), now)
        elif isinstance(msg, PeerUpdated):
            if msg.info is None:
                self.peers.pop(msg.agent, None)
            else:
                self.peers[msg.agent] = msg.info
                self._feed(proto.PeerIncarnation(msg.agent, msg.info.incarnation), now)
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
        if isinstance(m, wire.Finish):
            try:
                self._check_blocks(m.engine_id, m.block_ids)
            except KvdError as exc:
                self._finish_refused(m.request_id, int(exc.code), exc.message, self.clock.now())
                raise
            return proto.Finish(
                m.request_id, m.engine_id, m.block_ids, req.session, m.keep_for, m.num_tokens
            )
        if isinstance(m, wire.Abort):
            return proto.AbortSend(m.request_id, req.session)
        raise TypeError(f"sender got {type(m).__name__}")

    def _finish_refused(self, request_id: str, code: int, error: str, now: float) -> None:
        """A finish refused before the machine saw it (here, or BUSY at the gateway): the
        error answers the engine; D must not wait for a finish that is not coming."""
        why = f"P's daemon refused the request's finish: {error}"
        self._feed(proto.FinishRefused(request_id, code, why), now)

    def _check_blocks(self, engine_id: str, block_ids: tuple[int, ...]) -> None:
        """Refuse a lease on blocks that are not in every one of the engine's regions (a bad
        P block id is an error for the caller now, never an input to the planner)."""
        regions = [r for (e, _), r in self.local.items() if e == engine_id]
        if not regions:
            raise NotFound(f"engine {engine_id!r} has no registered region on this daemon")
        for r in regions:
            check_logical(r.geometry, block_ids)

    def _layers_announced(self, msg: wire.LayersSaved, now: float) -> None:
        """A worker's notice, checked against our regions (each request on its own: one bad
        entry is counted, the others still stream)."""
        try:
            ranks = self._local_ranks(msg.engine_id)
            layers = ranks[0].geometry.num_layers
            if msg.tp_rank >= len(ranks) or msg.layers > layers:
                raise InvalidRequest(
                    f"layers {msg.layers} of rank {msg.tp_rank}: engine {msg.engine_id!r} has "
                    f"{len(ranks)} ranks of {layers} layers"
                )
        except KvdError as exc:
            self._reject_layers(exc)
            return
        self._count("layer_notices")
        for entry in msg.requests:
            try:
                self._check_blocks(msg.engine_id, entry.block_ids)
            except KvdError as exc:
                self._reject_layers(exc, entry.request_id)
                continue
            self._feed(
                proto.LayersSaved(
                    entry.request_id,
                    msg.engine_id,
                    msg.tp_rank,
                    len(ranks),
                    msg.layers,
                    layers,
                    entry.block_ids,
                ),
                now,
            )
            if self.trace.on:
                self._mark(entry.request_id, "layers_fed")

    def _reject_layers(self, exc: KvdError, request_id: str = "") -> None:
        self.rejects.reject(
            self.name,
            "layer_notices_rejected",
            "layer_notice_rejected",
            type(exc).__name__,
            request_id=request_id,
            error=exc.message,
        )

    def _notif(
        self, agent: str, msg: wire.Record, now: float, reserved: Reservation | None
    ) -> None:
        if not self._known(agent, msg):
            return
        if isinstance(msg, wire.PushRegistration):
            self._feed(proto.RegistrationArrived(agent, msg, reserved), now)
        elif isinstance(msg, wire.PullDone):
            if self.trace.on:
                self.trace.link(msg.request_id, agent, msg.d_request_id)
            self._feed(proto.PullDoneArrived(agent, msg, reserved), now)
        elif isinstance(msg, wire.CancelRegistration):
            self._feed(proto.CancelArrived(agent, msg.request_id), now)
        elif isinstance(msg, wire.ResyncAck):
            self._feed(proto.ResyncAcked(agent, msg.nonce), now)
        else:
            self._reject_notif(agent, type(msg).__name__, f"unexpected {type(msg).__name__}")
            return
        if self.trace.on:
            self._mark(trace_key(msg), "notif_fed")

    # ---------------------------------------------------------------- effects

    def _carry_out_own(self, eff: Any) -> None:
        if isinstance(eff, proto.ResolveView):
            if self.trace.on:
                self.trace.link(eff.key, eff.agent, eff.registration.request_id)
            ranks = self._known_view(eff.agent, eff.registration)
            if ranks is None:
                self._spawn(self._resolve_view, eff)
                return
            if self.trace.on:
                self._mark(eff.key, "view_resolved")
            self._ready.append(proto.ViewResolved(eff.key, view=ranks))  # no IO needed
        elif isinstance(eff, proto.PostWrite):
            if self.trace.on:
                self._mark(eff.key, "claimed")
            self._write(eff, time.monotonic() + self.post_fence)
        elif isinstance(eff, proto.PostLayers):
            self._layer_posts.append(eff)  # posted, coalesced, at the end of the turn
        else:
            raise TypeError(f"sender cannot carry out {type(eff).__name__}")

    async def _resolve_view(self, eff: proto.ResolveView) -> None:
        try:
            view = await self._d_view(eff.agent, eff.registration)
        except KvdError as exc:
            self._outcome(proto.ViewResolved(eff.key, error=exc))
            return
        if self.trace.on:
            self._mark(eff.key, "view_resolved")
        self._outcome(proto.ViewResolved(eff.key, view=view))

    async def _d_view(self, agent: str, msg: wire.PushRegistration) -> list[RemoteRegion]:
        """D's regions exactly as its registration names them (incarnation, and each rank's
        generation). A stale or missing view (D's engine re-registered, D restarted) is
        refreshed once by a handshake with D; never WRITE through a view D did not name."""
        ranks = self._known_view(agent, msg)
        if ranks is not None:
            return ranks
        # D's address as its handshake gave it, not as the registration claims: a peer is
        # not trusted about its own address (the fields only serve a peer we lost).
        known = self.peers.get(agent)
        host, port = (known.host, known.port) if known else (msg.side_host, msg.side_port)
        if not host or not port:
            raise Incompatible(f"D {agent} named regions we do not know, and no address")
        self._count("peer_view_refreshes")
        info = await self.registrar.call(EnsurePeer(host, port, refresh=True))
        if info.agent != agent:
            raise Incompatible(f"{host}:{port} is {info.agent}, not {agent} who registered")
        ranks = _fits(info, msg)
        if ranks is None:
            have = tuple(r.generation for r in info.ranks(msg.engine_id))
            raise Incompatible(
                f"D {agent} registered into generations {msg.generations} of engine "
                f"{msg.engine_id!r}, its daemon announces {have}"
            )
        return ranks

    def _known_view(self, agent: str, msg: wire.PushRegistration) -> list[RemoteRegion] | None:
        """D's regions as its registration names them, if the view we hold fits."""
        return _fits(self.peers.get(agent), msg)

    def _write(self, eff: proto.PostWrite, post_by: float) -> None:
        """WRITE a request's blocks into D's. By the direct plans, planned and handed to
        the NIXL thread in this turn of the loop (as `_write_layers`; the control bench's
        stage trace had the WRITE handed over ~180 us after the turn that claimed it when
        a task did it), a task waiting for its end; a push gathered on P first (`_gather`,
        which may wait for the staging area) is carried out by a task from the start."""
        reg = eff.registration
        watch = SettleWatch()
        try:
            local = self._local_ranks(eff.engine_id)
            remote: list[RemoteRegion] = eff.view  # type: ignore[assignment]
            if reg.tp_size != len(remote):
                raise Incompatible(
                    f"D registered for {reg.tp_size} ranks, its daemon announces {len(remote)}"
                )
            # a shape whose pushes are gathered on P skips the direct plans (`template`)
            tokens = _num_tokens(eff.p_tokens, reg.num_tokens)
            how: GatherTemplate | RequestPlan = self._template(local, remote) or plan_any(
                local, eff.p_blocks, remote, reg.block_ids, local_is_p=True, num_tokens=tokens
            )
            locs = [local[x.p] for x in how.pairs]
            rems = [remote[x.d] for x in how.pairs]
            notifs = [  # one per transfer: D counts them
                wire.encode(wire.PushDone(reg.request_id, i, True, 0, ""))
                for i in range(len(transfer_groups(locs, rems)))
            ]
            if self._may_gather(local, remote, how, reg.block_ids):
                self._spawn(self._write_gathered, eff, local, remote, how, notifs, watch, post_by)
                return
            if not isinstance(how, RequestPlan):  # a template, whose gather does not pay
                how = plan_any(
                    local, eff.p_blocks, remote, reg.block_ids, local_is_p=True, num_tokens=tokens
                )
            run = self.book.start(
                "WRITE",
                eff.key,
                eff.agent,
                locs,
                rems,
                list(how.plans),
                notifs,
                watch,
                post_by=post_by,
            )
        except KvdError as exc:
            self._outcome(proto.WriteDone(eff.key, exc))
            return
        self._spawn(self._write_landed, eff, run, watch, len(notifs))

    async def _write_landed(
        self, eff: proto.PostWrite, run: Running, watch: SettleWatch, transfers: int
    ) -> None:
        """Waits for the end of `_write`'s WRITE and answers the machine."""
        try:
            await self.book.finish(run)
        except Unsettled as exc:
            await self._write_unsettled(eff, exc, watch)
            return
        except KvdError as exc:
            self._outcome(proto.WriteDone(eff.key, exc))
            return
        log.debug("push_done", request_id=eff.key, peer=eff.agent)
        self._outcome(proto.WriteDone(eff.key, transfers=transfers))

    async def _write_unsettled(
        self, eff: proto.PostWrite, exc: Unsettled, watch: SettleWatch
    ) -> None:
        # still in flight in UCX: no word to D until it ends (D holds its blocks). The
        # adapter does not say whether it landed then: it is failed (if it landed, D
        # had its PushDone(ok) with the bytes, and this answer comes late)
        self._outcome(proto.WriteDone(eff.key, exc, unsettled=True))
        await watch.wait()
        self._outcome(proto.WriteSettled(eff.key, exc))

    async def _write_gathered(
        self,
        eff: proto.PostWrite,
        local: list[LocalRegion],
        remote: list[RemoteRegion],
        how: GatherTemplate | RequestPlan,
        notifs: list[bytes],
        watch: SettleWatch,
        post_by: float,
    ) -> None:
        """`_write` of a push that may be gathered on P: by the gather if the staging area
        has a slot, else by the direct plans."""
        reg = eff.registration
        locs = [local[x.p] for x in how.pairs]
        rems = [remote[x.d] for x in how.pairs]
        try:
            staged = await self._gather(
                eff.key, local, remote, how, eff.p_blocks, reg.block_ids, len(notifs)
            )
            if staged is not None:
                await self._write_staged(eff, local, remote, staged, notifs, watch, post_by)
            else:  # WRITTEN by the direct plans
                if not isinstance(how, RequestPlan):  # the template's gather was not made
                    how = plan_any(
                        local,
                        eff.p_blocks,
                        remote,
                        reg.block_ids,
                        local_is_p=True,
                        num_tokens=_num_tokens(eff.p_tokens, reg.num_tokens),
                    )
                await self.book.run(
                    "WRITE",
                    eff.key,
                    eff.agent,
                    locs,
                    rems,
                    list(how.plans),
                    notifs,
                    watch,
                    post_by=post_by,
                )
        except Unsettled as exc:
            await self._write_unsettled(eff, exc, watch)
            return
        except KvdError as exc:
            self._outcome(proto.WriteDone(eff.key, exc))
            return
        log.debug("push_done", request_id=eff.key, peer=eff.agent)
        self._outcome(proto.WriteDone(eff.key, transfers=len(notifs)))

    def _turn_end(self) -> None:
        if not self._layer_posts:
            return
        groups: dict[tuple[Any, ...], list[proto.PostLayers]] = {}
        for eff in self._layer_posts:
            view: list[RemoteRegion] = eff.view  # type: ignore[assignment]
            d = tuple((r.region_id, r.generation) for r in view)
            groups.setdefault((eff.agent, eff.engine_id, d), []).append(eff)
        self._layer_posts = []
        post_by = time.monotonic() + self.post_fence
        for effs in groups.values():
            for i in range(0, len(effs), MAX_COALESCED):
                self._write_layers(effs[i : i + MAX_COALESCED], post_by)

    def _write_layers(self, effs: list[proto.PostLayers], post_by: float) -> None:
        """One WRITE of several requests' layers into the same D regions (agent, and each
        region's generation): every rank pair of every request, as one NIXL transfer per
        group of pairs (`transfer_groups`), each carrying the LayersPushed that names all
        the requests' layers in it. A request whose ranks cannot be cut by layer (a
        permute on receive, other layer counts) is answered `unsupported`, unwritten.

        Planned and handed to the NIXL thread in this turn of the loop (a task spawned to
        do it would run only after what else the loop has to do: the last layer's WRITE
        waited 110-230 us behind P's `finished` in the layer-wise bench); a task waits for
        its end (`_layers_landed`)."""
        head = effs[0]
        try:
            local = self._local_ranks(head.engine_id)
        except KvdError as exc:
            for eff in effs:
                self._outcome(proto.LayersWritten(eff.key, eff.first, eff.end, exc))
            return
        locs: list[LocalRegion] = []
        rems: list[RemoteRegion] = []
        plans: list[Plan] = []
        going: list[proto.PostLayers] = []
        groups = 0
        for eff in effs:
            remote: list[RemoteRegion] = eff.view  # type: ignore[assignment]
            try:
                if eff.registration.tp_size != len(remote):
                    raise Incompatible(
                        f"D registered for {eff.registration.tp_size} ranks, "
                        f"its daemon announces {len(remote)}"
                    )
                rp = self._layer_plan_of(local, eff, remote)
            except _CannotCut:
                self._outcome(proto.LayersWritten(eff.key, eff.first, eff.end, unsupported=True))
                continue
            except KvdError as exc:
                self._outcome(proto.LayersWritten(eff.key, eff.first, eff.end, exc))
                continue
            el = [local[x.p] for x in rp.pairs]
            er = [remote[x.d] for x in rp.pairs]
            groups = len(transfer_groups(el, er))
            locs += el
            rems += er
            plans += rp.plans
            going.append(eff)
        if not going:
            return
        if len(going) > 1:
            self._count("layer_writes_coalesced", len(going) - 1)
        notifs = [
            wire.encode(
                wire.LayersPushed(
                    g,
                    tuple(
                        wire.LayerRange(e.registration.request_id, e.first, e.end) for e in going
                    ),
                )
            )
            for g in range(groups)
        ]
        watch = SettleWatch()
        try:
            rid = f"{head.key}/l{head.first}-{head.end}"
            run = self.book.start(
                "WRITE", rid, head.agent, locs, rems, plans, notifs, watch, post_by=post_by
            )
        except KvdError as exc:
            for eff in going:
                self._outcome(proto.LayersWritten(eff.key, eff.first, eff.end, exc))
            return
        self._spawn(self._layers_landed, going, run, watch)

    async def _layers_landed(
        self, going: list[proto.PostLayers], run: Running, watch: SettleWatch
    ) -> None:
        """Waits for the end of `_write_layers`' WRITE and answers each request of it."""
        error: KvdError | None = None
        try:
            await self.book.finish(run)
        except Unsettled as exc:
            # still in flight in UCX: the stream must not tell D it ended (D would free
            # its blocks) until the WRITE ends; past the machine's unsettled bound it ends
            # without a word to D (D holds its blocks until its own bound)
            error = exc
            with anyio.move_on_after(self.proto.unsettled_hold):
                await watch.wait()
        except KvdError as exc:
            error = exc
        unsettled = error is not None and not watch.done and isinstance(error, Unsettled)
        for eff in going:
            self._outcome(proto.LayersWritten(eff.key, eff.first, eff.end, error, False, unsettled))

    def _layer_plan_of(
        self, local: list[LocalRegion], eff: proto.PostLayers, remote: list[RemoteRegion]
    ) -> RequestPlan:
        """`_layer_plan`, planned once per request and range length: a later range of as
        many layers is the first one's plan moved by the layers between them (`shift_plan`,
        ~10 us where planning 64 blocks takes ~100 us, more under load)."""
        n = eff.end - eff.first
        key = (
            eff.key,
            n,
            eff.p_blocks,
            eff.registration.block_ids,
            tuple((r.region_id, r.generation) for r in local),
            tuple((r.region_id, r.generation) for r in remote),
        )
        hit = self._layer_plans.get(key)
        if hit is None:
            rp = _layer_plan(local, eff, remote)
            self._layer_plans[key] = (eff.first, rp)
            if len(self._layer_plans) > LAYER_PLANS:
                self._layer_plans.popitem(last=False)
            return rp
        self._layer_plans.move_to_end(key)
        first, rp = hit
        if first == eff.first:
            return rp
        moved = eff.first - first
        self._count("layer_plans_moved")
        return shift_plan(
            rp,
            [moved * local[x.p].geometry.layer_stride for x in rp.pairs],
            [moved * remote[x.d].geometry.layer_stride for x in rp.pairs],
        )

    def _template(
        self, local: list[LocalRegion], remote: list[RemoteRegion]
    ) -> GatherTemplate | None:
        """The gather template of pushes between these regions (`kvd.core.gather`), made
        on the first push of their shape and kept (`TEMPLATES` shapes); None where pushes
        between them are not gathered by one (or there is no staging to gather into)."""
        if self.staging is None or not local or not remote:
            return None
        views: list[LocalRegion | RemoteRegion] = [*local, *remote]
        if any(r.mem_type != "DRAM" or r.groups for r in views):
            return None
        key = (len(local), *((r.geometry, r.layout, r.compat, r.tp_rank, r.tp_size) for r in views))
        if key in self._templates:
            self._templates.move_to_end(key)
            return self._templates[key]
        try:
            t = plan_template(local, remote)
        except KvdError:
            t = None  # planning the request says why, as before
        self._templates[key] = t
        if len(self._templates) > TEMPLATES:
            self._templates.popitem(last=False)
        self._count("gather_templates_made" if t is not None else "gather_templates_none")
        return t

    def _may_gather(
        self,
        local: list[LocalRegion],
        remote: list[RemoteRegion],
        how: RequestPlan | GatherTemplate,
        d_blocks: tuple[int, ...],
    ) -> bool:
        """Whether a push may be gathered on P (`_gather`'s checks before it waits for
        anything): host memory on both sides, a staging area, and a gather that pays."""
        if self.staging is None or not how.pairs:
            return False
        if any(r.mem_type != "DRAM" for r in local) or any(r.mem_type != "DRAM" for r in remote):
            return False
        # decided here: no worker thread to plan a gather that cannot pay
        return worth_gathering(_direct_descriptors(how, d_blocks), _slot_bytes(how, d_blocks))

    async def _gather(
        self,
        key: str,
        local: list[LocalRegion],
        remote: list[RemoteRegion],
        how: RequestPlan | GatherTemplate,
        p_blocks: tuple[int, ...],
        d_blocks: tuple[int, ...],
        transfers: int,
    ) -> _StagedPush | None:
        """Stage a push on P (`kvd.core.gather`) where its direct plan has many small
        descriptors (head slices, token runs): the pieces laid out in a slot of the
        staging area exactly as D's regions want them, by a worker thread, so that the
        WRITE moves a few contiguous runs. The gather is cut into parts of whole D regions
        (`split`); this gathers the first, `_write_staged` the others while it WRITEs.
        Returns None (nothing done: the caller WRITEs by the direct plans) where it does
        not pay, memory is not all host memory, there is no staging or no slot free."""
        staging = self.staging
        if staging is None or not self._may_gather(local, remote, how, d_blocks):
            return None
        nbytes = _slot_bytes(how, d_blocks)
        direct = _direct_descriptors(how, d_blocks)
        if not await self._staging_ready(staging, key):
            return None
        pool = staging.pool
        bases = [r.geometry.base_addr for r in local]
        sources = [_bytes_of(r) for r in local]

        spent: list[float] = []
        part = self.part_bytes

        def plan_and_gather(
            slot: npt.NDArray[np.uint8],
        ) -> tuple[Gathered, list[Callable[[], Gathered]]] | None:
            # (in a worker thread: planning a gather of many pieces takes ~1 ms per 4 MiB;
            # from a template, a fraction of that, and only the first part's here)
            t0 = time.perf_counter()
            rest: list[Callable[[], Gathered]] = []
            prep: Prepared | None = None
            if isinstance(how, RequestPlan):
                whole = plan_gather(
                    how.plans, [x.p for x in how.pairs], [x.d for x in how.pairs], bases
                )
                if whole is None:
                    return None
                first = whole
            else:
                prep = prepare(how, local, p_blocks, remote, d_blocks)
                if prep is None:
                    return None
                k = min(PIPELINE_PARTS, prep.blocks, -(-prep.nbytes // (part or prep.nbytes)))
                cuts = [i * prep.blocks // k for i in range(k + 1)]
                first = prep.part(cuts[0], cuts[1])
                for a, b in itertools.pairwise(cuts[1:]):
                    rest.append(functools.partial(_gather_part, slot, sources, prep, a, b, spent))
            if first.nbytes > nbytes:
                raise AssertionError(f"a gather of {first.nbytes} bytes for a slot of {nbytes}")
            writes = [(local[w.local], remote[w.remote]) for w in first.writes]
            groups = len(transfer_groups(*zip(*writes, strict=True)))
            if groups != transfers:
                return None  # D counts one PushDone per transfer: keep them as they are
            if groups != 1:
                # parts only where each is one transfer (the last carries the PushDone)
                if prep is not None and rest:
                    first = prep.part(0, prep.blocks)
                    rest = []
            elif isinstance(how, RequestPlan):
                parts = split(first, PIPELINE_PARTS if part else 1, part)
                first = parts[0]
                rest = [
                    functools.partial(_gather_split, slot, sources, g, spent) for g in parts[1:]
                ]
            gather(slot, sources, first)
            spent.append(time.perf_counter() - t0)
            return first, rest

        off = pool.alloc(nbytes)
        if off is None:
            self._count("staging_exhausted")
            return None
        self._hold_regions(local)  # a drain of P's regions waits for the gathers' reads
        slot = staging.buf[off : off + nbytes]
        try:
            got = await anyio.to_thread.run_sync(plan_and_gather, slot)
        except BaseException:
            self._unhold_regions(local)
            pool.free(off)
            raise
        if got is None:
            self._unhold_regions(local)
            pool.free(off)
            return None
        first, rest = got
        self._count("staged_writes")
        if not isinstance(how, RequestPlan):
            self._count("staged_writes_templated")
        if rest:
            self._count("staged_writes_pipelined")
        parts = len(rest) + 1
        saved = direct - first.descriptors * parts  # (each part has about as many runs)
        self._count("staged_write_descriptors_saved", max(0, saved))
        return _StagedPush(
            staging.addr + off,
            first,
            rest,
            spent,
            lambda: pool.free(off),
            lambda: self._unhold_regions(local),
        )

    async def _write_staged(
        self,
        eff: proto.PostWrite,
        local: list[LocalRegion],
        remote: list[RemoteRegion],
        st: _StagedPush,
        notifs: list[bytes],
        watch: SettleWatch,
        post_by: float,
    ) -> None:
        """WRITE a gathered push part by part, each part's WRITE running while the next
        part is gathered (the gather is a local copy on a worker thread; the WRITE, UCX's
        work): a part is posted once the previous one ended (DONE: its bytes are in D's
        blocks), and only the last one carries the PushDone, so D hears of the request
        once every byte is there, as from a single WRITE. A failure stops the pipeline and
        fails the push. The slot is freed once nothing gathers into it and UCX ended every
        WRITE posted from it (`watch` is called then)."""
        total = len(st.rest) + 1
        left = [total + 1]  # each part's WRITE settled, and this pipeline's end

        def release() -> None:
            left[0] -= 1
            if left[0] == 0:
                st.free()
                watch()

        posted = 0
        gathering = True
        part = st.first
        try:
            for i in range(total):
                locs = [local[w.local] for w in part.writes]
                rems = [remote[w.remote] for w in part.writes]
                plans: list[Plan] = [shifted(w.plan, st.base) for w in part.writes]
                last = i + 1 == total
                if last and gathering:
                    st.unhold()  # every part is gathered: P's regions are not read any more
                    gathering = False
                notes = notifs if last else [b""]  # (a part is one transfer: `_gather`)
                posted += 1
                write = functools.partial(
                    self.book.run,
                    "WRITE",
                    eff.key,
                    eff.agent,
                    locs,
                    rems,
                    plans,
                    notes,
                    release,
                    post_by=post_by,
                )
                if last:
                    await write()
                    break
                box: list[Gathered] = []
                errors: list[BaseException] = []
                async with anyio.create_task_group() as tg:
                    tg.start_soon(_in_thread, st.rest[i], box, errors)
                    try:
                        await write()
                    except KvdError as exc:
                        errors.insert(0, exc)  # (after the gather's thread ended)
                if errors:
                    raise errors[0]
                part = box[0]
        finally:
            if gathering:
                st.unhold()
            left[0] -= total - posted  # parts never posted: nothing to settle
            release()
            # the local pass a gathered push costs (`kvd bench --only topology` reports it)
            self._count("staged_gather_us", int(sum(st.spent) * 1e6))

    def _local_ranks(self, engine_id: str) -> list[LocalRegion]:
        return local_ranks(self.local, engine_id)

    # ---------------------------------------------------------------- status

    def snapshot(self, section: str, now: float) -> dict[str, Any]:
        p = self.proto
        if section == "drain":
            live = list(itertools.islice(p.reqs.values(), DRAIN_LISTED))
            return {
                "count": len(p.reqs),
                "requests": [
                    {"request_id": r.key, "state": r.state.value, "age_s": round(now - r.since, 3)}
                    for r in live
                ],
            }
        if section == "leases":
            leases = [
                {
                    "request_id": lease.request_id,
                    "expires_in_s": round(lease.deadline - now, 3),
                    "age_s": round(now - lease.granted_at, 3),
                    "state": p.reqs[lease.request_id].state.value,
                    "peer": p.reqs[lease.request_id].agent,
                    "kept": lease.fixed,
                }
                for lease in p.leases.leases()
                if lease.request_id in p.reqs
            ]
            writing = [
                {
                    "request_id": r.key,
                    "expires_in_s": None,
                    "age_s": round(now - r.since, 3),
                    "state": r.state.value,
                }
                for r in p.reqs.values()
                if r.state in (proto.SendState.WRITING, proto.SendState.STREAMING)
            ]
            return {"leases": leases + writing}
        if section == "transfers":
            return self.book.snapshot()
        states = p.by_state()
        registrations, early_pulls = p.awaiting()
        return {
            "leases": len(p.leases),
            "states": states,
            "held": states["held"],
            "writing": states["writing"],
            "streaming": states["streaming"],
            "pending_registrations": registrations,
            "early_pulls": early_pulls,
            "sending": len(self.book.in_flight),
            "tombstones": len(p.tombstones),
            "limits": p.limits(),
            "failures": dict(self.failures),
        } | self.book.totals()


class _CannotCut(Exception):
    """This request's transfer cannot be cut by layer (it goes whole at P's finish)."""


def _num_tokens(p_tokens: int, d_tokens: int) -> int:
    """The request's token count as P's finish and D's registration say it (0: neither);
    they must agree where both say it."""
    if p_tokens and d_tokens and p_tokens != d_tokens:
        raise InvalidRequest(
            f"P finished the request with {p_tokens} tokens, D registered for {d_tokens}"
        )
    return p_tokens or d_tokens


def _layer_plan(
    local: list[LocalRegion], eff: proto.PostLayers, remote: list[RemoteRegion]
) -> RequestPlan:
    """The request's plan (`plan_request`) restricted to layers [first, end) of every
    rank's region on both sides. Only a request whose ranks map chunk for chunk (no
    permute on receive) with equal layer counts can be cut so; not a hybrid one (its
    groups' layers are not the region's)."""
    if any(r.groups for r in local) or any(r.groups for r in remote):
        raise _CannotCut("hybrid regions go whole")
    try:
        lv = [replace(r, geometry=r.geometry.layers(eff.first, eff.end)) for r in local]
        rv = [replace(r, geometry=r.geometry.layers(eff.first, eff.end)) for r in remote]
    except InvalidRequest as exc:
        raise _CannotCut(exc.message) from None
    layers = {r.geometry.num_layers for r in local} | {r.geometry.num_layers for r in remote}
    if len(layers) != 1:
        raise _CannotCut("layer counts differ")
    rp = plan_request(lv, eff.p_blocks, rv, eff.registration.block_ids, local_is_p=True)
    if rp.permutes:
        raise _CannotCut("D permutes on receive")
    return rp


def _fits(info: PeerInfo | None, msg: wire.PushRegistration) -> list[RemoteRegion] | None:
    """`info`'s regions for the registration, if they are the ones it names (incarnation,
    each rank's generation); None if not."""
    if info is None or info.incarnation != msg.incarnation:
        return None
    ranks = info.ranks(msg.engine_id)
    return ranks if tuple(r.generation for r in ranks) == msg.generations else None


def _gather_part(
    slot: npt.NDArray[np.uint8],
    sources: list[npt.NDArray[np.uint8]],
    prep: Prepared,
    a: int,
    b: int,
    spent: list[float],
) -> Gathered:
    """Plan and gather D's blocks [a, b) of a prepared push (in a worker thread)."""
    t0 = time.perf_counter()
    part = prep.part(a, b)
    gather(slot, sources, part)
    spent.append(time.perf_counter() - t0)
    return part


def _gather_split(
    slot: npt.NDArray[np.uint8],
    sources: list[npt.NDArray[np.uint8]],
    part: Gathered,
    spent: list[float],
) -> Gathered:
    t0 = time.perf_counter()
    gather(slot, sources, part)
    spent.append(time.perf_counter() - t0)
    return part


async def _in_thread(
    make: Callable[[], Gathered], box: list[Gathered], errors: list[BaseException]
) -> None:
    """Run `make` in a worker thread; its result or its error into `box` / `errors`
    (raised by the pipeline once its WRITE ended too)."""
    try:
        box.append(await anyio.to_thread.run_sync(make))
    except Exception as exc:
        errors.append(exc)


def _bytes_of(region: LocalRegion) -> npt.NDArray[np.uint8]:
    """The bytes of a local region as mapped in this process (from its base address)."""
    g = region.geometry
    raw = (ctypes.c_uint8 * g.nbytes).from_address(g.base_addr)
    return np.ctypeslib.as_array(raw)


def _slot_bytes(how: RequestPlan | GatherTemplate, d_blocks: tuple[int, ...]) -> int:
    """What a gather's slot holds for a push planned as `how`."""
    if isinstance(how, RequestPlan):
        return sum(p.total_bytes for p in how.plans)
    return how.slot_bytes(len(d_blocks))


def _direct_descriptors(how: RequestPlan | GatherTemplate, d_blocks: tuple[int, ...]) -> int:
    """The descriptors of a push planned as `how` written by its direct plans."""
    if isinstance(how, RequestPlan):
        return sum(p.descriptors for p in how.plans)
    return how.per_block * len(d_blocks)
