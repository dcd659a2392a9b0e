"""Registrar: owns every memory registration and every peer handshake.

- Regions: maps a worker's shared-memory segment read-write, validates its layout
  (no descriptor can ever leave it), registers it with NIXL as DRAM and gives it an id
  and a generation. Every region declares a non-empty `compat` (what must agree between
  the two ends of a transfer); one without is refused, so no region is exempt from the
  transfer actors' compat check. Before a region is unmapped, peers are told to drop it (side
  channel, with a reply) and transfers touching it drain; only then is it deregistered.
  A region dropped because its session ended or its client asked is dropped in the
  background (`dropping`): it leaves our actors' view and the handshakes at once, and the
  registrar goes on serving meanwhile. Waiting there for a slow peer's reply would hold
  up every registration and handshake of the daemon for up to `handshake_timeout` per
  region, and two daemons dropping regions at the same moment (an engine pair exiting
  together) would each wait for the other's reply until it timed out: the peer's side
  channel answers a drop notice only once its registrar has taken it in. A region of the
  same shared-memory segment registered again waits for the drop of the old one.
- Peers: one handshake per peer daemon (not per rank), cached; concurrent requests for
  the same peer wait on one handshake and all get its result; a failure is reported to
  every waiter and not cached. Optional HMAC authentication with a shared secret.
  A handshake is refused if it fails authentication, names an address we could never
  dial, or describes impossible regions; refusals are counted and logged at a bounded
  rate (`RejectLog`), as are refused region requests of local clients.
- Clocks and traces: after every handshake (dialed or accepted) the registrar measures
  the peer's clock offset over the side channel (`kvd.core.timeline`: a few NTP-style
  TraceQuery exchanges, the one with the smallest error bound kept; shown by `kvd
  peers`). `kvd trace ID --peer` asks the peer the request was transferred with for its
  stage records of the request in the same exchange, measuring the offset afresh.
- The canary: a small buffer with a pattern derived from the agent name, which
  `kvd ping` READs to prove the data path end to end.
- Leftovers (unless `daemon.reap_leftover_segments` is off): at start, after the
  regions of a session whose client went away without Goodbye are unmapped, and when the
  creator of a segment kept then (a live client at start, a frozen client whose session
  timed out) is gone (its pid is checked every `WATCH_INTERVAL` seconds, `WATCH_MAX`
  segments at most), staging segments are removed by the leftover rule
  (`kvd.adapters.shm.reap_segments`: a kvd staging name from our pid namespace, our uid,
  its creator gone, nobody mapping or holding it). The /proc scan runs in a worker
  thread while the registrar waits for it (tens to hundreds of ms, only when a candidate
  passed the cheaper checks); the start-up pass ends before the registrar reports
  started.
"""

from __future__ import annotations

import asyncio
import collections
import hmac
import os
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import anyio
import structlog
import zmq
import zmq.asyncio
from anyio.abc import TaskStatus
from kvd_client import wire
from kvd_client.errors import (
    AuthError,
    InvalidRequest,
    KvdError,
    NotFound,
    RemoteProtocolError,
    Timeout,
    TransferError,
)
from kvd_client.shm import SHM_DIR

from kvd.actors.base import Mailbox
from kvd.actors.gateway import transport_cap
from kvd.actors.messages import (
    AcceptHandshake,
    ClientRequest,
    ClockReading,
    EnsurePeer,
    LocalRegion,
    LocalRegionsChanged,
    PeerClock,
    PeerInfo,
    PeerLost,
    PeerRegionDropped,
    PeerUpdated,
    PingPeerCmd,
    ProbeReceived,
    RegisterDaemonRegion,
    RemoteRegion,
    SessionClosed,
    Snapshot,
    TraceCmd,
)
from kvd.adapters.cuda_ipc import CudaIpcRegion
from kvd.adapters.doorbell import peer_address
from kvd.adapters.nixl import NixlEngine
from kvd.adapters.resolve import Resolver, connect
from kvd.adapters.shm import (
    AnonRegion,
    MappedRegion,
    Reaped,
    pid_alive,
    reap_segments,
    staging_creator_here,
)
from kvd.core import readpath
from kvd.core.addresses import address_problem
from kvd.core.hybrid import region_groups
from kvd.core.peerauth import AUTH_WINDOW_S, message_mac
from kvd.core.peersession import Keyring, Party, derive_session
from kvd.core.planner import Geometry
from kvd.core.readpath import Reach, native_reads
from kvd.core.receiver import MAX_WRITE_BOUND
from kvd.core.silence import LastSigns
from kvd.core.timeline import ClockOffset, best, check_answer, estimate, make_query
from kvd.core.topology import check_region
from kvd.core.trace import NO_TRACE, Found, StageTrace
from kvd.logs import RejectLog

log = structlog.get_logger("kvd.registrar", actor="registrar")

CANARY_BYTES: Final = 64 * 1024
MAX_CANARY_WRITES: Final = 4
"""Canary WRITEs for peers' pings under way at once; a probe beyond is refused, counted."""
CANARY_WRITE_TIMEOUT: Final = 10.0
CLOCK_SAMPLES: Final = 5
"""Clock exchanges per measurement (the first also opens the TCP connection)."""
MAX_LATE_S: Final = MAX_WRITE_BOUND
"""The longest a retired region's addresses are kept (a peer's handshake may say more)."""
WATCH_INTERVAL: Final = 1.0
"""Seconds between checks of the creators of segments kept while they were alive."""
WATCH_MAX: Final = 1024
"""Segments watched so at most (the oldest dropped: the next start reaps them)."""


@dataclass(frozen=True)
class _PeerSilent:
    """The registrar to itself: the peer handshaked at `handshaked_at` has not answered
    on its side channel for `forget_silent` seconds (`answered`: someone else answers
    there, under `answered`)."""

    agent: str
    handshaked_at: float
    answered: str = ""


@dataclass(frozen=True)
class _CreatorsGone:
    """The registrar to itself: these watched segments' creators are gone."""

    names: tuple[str, ...]


@dataclass(frozen=True)
class _SessionDropped:
    """The registrar to itself: every region of the closed session is gone."""

    closed: SessionClosed
    segments: tuple[str, ...]
    """Its shared-memory segments (to judge as leftovers if its client went away)."""


@dataclass(frozen=True)
class _AfterDrop:
    """The registrar to itself: a registration that waited for the drop of a region
    over the same memory (taken now, whatever became of that drop)."""

    req: ClientRequest


async def _answer_when_set(req: ClientRequest, done: anyio.Event) -> None:
    """A client's deregistration is answered once its region is gone."""
    await done.wait()
    req.resolve(wire.Ok())


def canary_pattern(agent_name: str, nbytes: int = CANARY_BYTES) -> bytes:
    """The bytes a daemon's canary holds: derived from its agent name, so a reader can check."""
    return random.Random(f"kvd-canary:{agent_name}").randbytes(nbytes)


def geometry_of(base_addr: int, nbytes: int, layout: wire.RegionLayout) -> Geometry:
    """A validated Geometry for a layout at an address (raises InvalidRequest)."""
    return Geometry.from_layout(base_addr, nbytes, layout)


def handshake_mac(secret: bytes, hs: wire.Handshake | wire.RegionDropped, context: bytes) -> bytes:
    """HMAC-SHA256 over a peer message with an empty mac field, bound to `context`."""
    return message_mac(secret, hs, context)


@dataclass
class _Region:
    view: LocalRegion
    mapping: MappedRegion | CudaIpcRegion
    reg: Any
    nixl_md: bytes
    base_addr: int
    nbytes: int


@dataclass
class _Dropping:
    """A region being dropped: out of `regions`, not yet deregistered."""

    region: _Region
    done: anyio.Event = field(default_factory=anyio.Event)
    started: bool = False
    """A drop of it is under way (the background one, or shutdown's after it was cut)."""


@dataclass
class _Retired:
    """A dropped region whose addresses are kept (`MappedRegion.retire`) until no late
    byte of a transfer to or from it can arrive any more."""

    region_id: int
    name: str
    nbytes: int
    mapping: MappedRegion
    until: float
    """When its addresses are freed (daemon time)."""


@dataclass
class _Peer:
    info: PeerInfo
    incarnation: int
    loaded_regions: set[tuple[int, int]] = field(default_factory=set)
    clock: ClockOffset | None = None
    """The peer's trace clock minus ours (None: not measured yet)."""
    clock_at: float = 0.0
    """When `clock` was measured (daemon time)."""
    clock_at_ns: int = 0
    """When `clock` was measured (our trace clock, the one it relates to the peer's)."""
    dialed_us: bool = False
    """It handshook with us (as well as, maybe, we with it): the engine mends a failed
    endpoint to it, and it handshakes again itself when it restarts."""


class Registrar:
    """The registrar actor. Other actors reach it only through `mailbox`."""

    def __init__(
        self,
        *,
        engine: NixlEngine,
        mailbox: Mailbox[Any],
        side_host: str,
        side_port_ref: Callable[[], int],
        lease_duration: float,
        handshake_timeout: float,
        write_bound: float,
        secret: bytes | None,
        publish: Callable[[Any], None],
        drain_local: Callable[[int], Awaitable[None]],
        counters: dict[str, int],
        rejects: RejectLog,
        reap_leftovers: bool = True,
        trace: StageTrace = NO_TRACE,
        keyring: Keyring | None = None,
        max_frame: int = 16 * 1024 * 1024,
        reach: Callable[[], Reach] = Reach,
        ucx_tls: str = "",
        pull_by: str = "auto",
        forget_silent: float = 0.0,
        signs: LastSigns | None = None,
    ) -> None:
        self.engine = engine
        self.forget_silent = forget_silent
        """`side_channel.forget_silent_peers` (0: never; `_check_peers`)."""
        self.signs = signs if signs is not None else LastSigns()
        """Peers' signs of life (shared with the notifier, which notes their
        notifications; we note their side channels' answers: `kvd.core.silence`)."""
        self.pull_by = pull_by
        """`transfer.pull_by`: `kvd ping` asks for the peer's canary by its WRITE where our
        READ would be emulated (`kvd.core.readpath`), as pulls do."""
        self._canary_writes = 0
        self._scratch_lock = anyio.Lock()
        """One ping at a time uses the scratch its canary lands in."""
        """Canary WRITEs we are making for peers' pings (at most `MAX_CANARY_WRITES`)."""
        self._reach_of = reach
        self._reach: Reach | None = None
        self.ucx_tls = ucx_tls
        """UCX_TLS as the agent was made with (which READs are native, `kvd.core.readpath`)."""
        self.mailbox = mailbox
        self.clock = mailbox.clock
        self.side_host = side_host
        self._side_port_ref = side_port_ref
        self.lease_duration = lease_duration
        self.write_bound = write_bound
        """What our handshake tells peers: how long our WRITEs may land after a lease."""
        self.handshake_timeout = handshake_timeout
        self.max_frame = max_frame
        self.secret = secret
        self.keyring = keyring if secret is not None else None
        self._publish = publish
        self._drain_local = drain_local
        self.counters = counters
        self.rejects = rejects
        self.reap_leftovers = reap_leftovers
        self.trace = trace
        self.regions: dict[int, _Region] = {}
        self.dropping: dict[int, _Dropping] = {}
        """Regions being dropped in the background (`_begin_drop`)."""
        self.retired: dict[int, _Retired] = {}
        """Dropped regions whose addresses are kept for late bytes (`_retire`)."""
        self._retired_wake = anyio.Event()
        self._late_bound = write_bound
        """The longest a transfer to or from our memory may still land after we stopped
        it (our own bound, and the longest any peer's handshake has told us)."""
        self._next_region_id = 1
        self._generation = int(time.time()) & 0xFFFF  # survives restarts as a different range
        self.peers: dict[str, _Peer] = {}  # by agent name
        self.peer_by_addr: dict[str, str] = {}  # "host:port" -> agent
        self._pending: dict[str, asyncio.Future[PeerInfo]] = {}
        self._pending_since: dict[str, float] = {}
        """When the handshake in `_pending` started (daemon time)."""
        self._answered_since: dict[str, float] = {}
        """When the handshake that answered last (its view is the one cached) started."""
        self._next: dict[str, asyncio.Future[PeerInfo]] = {}
        """Refreshes waiting for the handshake in `_pending` to end, to share the next."""
        self._clock_syncs: dict[str, asyncio.Future[ClockReading]] = {}
        """Clock measurements in flight, by agent (one at a time per peer)."""
        self._probes: dict[int, asyncio.Future[float]] = {}
        self._watched: collections.OrderedDict[str, int] = collections.OrderedDict()
        """Segments kept because their creator (this pid) was alive (`_watch_creators`)."""
        self._watch_wake = anyio.Event()
        self.canary: AnonRegion | None = None
        self._canary_reg: Any = None
        self.scratch: AnonRegion | None = None
        self._scratch_reg: Any = None
        self._zctx = zmq.asyncio.Context.instance()
        self.resolver = Resolver()
        """Peers' host names, resolved off libzmq's I/O thread (`kvd.adapters.resolve`)."""
        self._tg: anyio.abc.TaskGroup | None = None
        self.incarnation: Final = int.from_bytes(os.urandom(8), "little")

    # ---------------------------------------------------------------- lifecycle

    def busy(self) -> bool:
        """Whether a ping waits for its probe's echo (read from the NIXL thread too)."""
        return bool(self._probes)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        if self.reap_leftovers:
            await self._reap(None, when="start")
        self.canary = AnonRegion(CANARY_BYTES)
        self.canary.view()[:] = canary_pattern(self.engine.name)
        self._canary_reg = await self.engine.register(self.canary.addr, CANARY_BYTES)
        self.scratch = AnonRegion(CANARY_BYTES)
        self._scratch_reg = await self.engine.register(self.scratch.addr, CANARY_BYTES)
        async with anyio.create_task_group() as tg:
            self._tg = tg
            if self.reap_leftovers:
                tg.start_soon(self._watch_creators)
            tg.start_soon(self._free_retired)
            if self.forget_silent > 0:
                tg.start_soon(self._check_peers)
            task_status.started()
            async for msg in self.mailbox:
                await self._dispatch(msg)

    async def _watch_creators(self) -> None:
        """Reap the segments kept at a session's end because their creator was alive (a
        frozen client), once that creator is gone: nothing else would (it has no session
        left to end). Judged on the registrar's own loop (`_CreatorsGone`), between its
        registrations."""
        while True:
            if not self._watched:
                self._watch_wake = anyio.Event()
                await self._watch_wake.wait()
            await anyio.sleep(WATCH_INTERVAL)
            gone = [n for n, pid in self._watched.items() if not pid_alive(pid)]
            if gone:
                self.mailbox.post(_CreatorsGone(tuple(gone)))

    async def _check_peers(self) -> None:
        """Ask each known peer's side channel a clock query every tenth of
        `forget_silent` (at most every 60 s), and have the ones silent for
        `forget_silent` forgotten (`_PeerSilent`): a daemon gone for good (a pod replaced
        under a new name, a host retired) would otherwise stay in NIXL, in every actor's
        view and behind sockets ZMQ redials for good. One that answers under another name
        (its address reused) is forgotten at once. A peer handshaked again meanwhile is
        judged afresh (the notice names the view it was about)."""
        every = min(60.0, self.forget_silent / 10)
        while True:
            await anyio.sleep(every)
            self.signs.retain(self.peers)
            async with anyio.create_task_group() as tg:  # (a silent one takes a timeout)
                for agent, p in list(self.peers.items()):
                    tg.start_soon(self._check_peer, agent, p.info)

    async def _check_peer(self, agent: str, info: PeerInfo) -> None:
        try:
            answer, _ = await self._exchange(info.host, info.port, (), samples=1)
        except Exception:  # (any failure is silence; it is logged when forgotten)
            answer = None
        now = self.clock.now()
        if answer is not None and answer.agent_name == agent:
            self.signs.note(agent, now)
        elif answer is not None or now - self.signs.last(agent, info.handshaked_at) >= (
            self.forget_silent
        ):
            other = answer.agent_name if answer is not None else ""
            self.mailbox.post(_PeerSilent(agent, info.handshaked_at, other))

    async def _peer_silent(self, msg: _PeerSilent) -> None:
        p = self.peers.get(msg.agent)
        if p is None or p.info.handshaked_at != msg.handshaked_at:
            return  # forgotten already, or handshaked again since the check
        self._count("peers_forgotten_silent")
        log.info(
            "peer_silent_forgotten",
            peer=msg.agent,
            addr=p.info.addr,
            silent_s=self.forget_silent,
            answered_by=msg.answered or None,
        )
        await self._forget(msg.agent)

    async def _free_retired(self) -> None:
        """Unmap retired regions once their bound passed."""
        while True:
            if not self.retired:
                self._retired_wake = anyio.Event()
                await self._retired_wake.wait()
                continue
            now = self.clock.now()
            for rid, r in list(self.retired.items()):
                if r.until <= now:
                    del self.retired[rid]
                    try:
                        r.mapping.close()
                    except OSError as exc:  # never expected: the range is ours
                        log.error("retired_region_unmap_failed", region_id=rid, error=str(exc))
                    self._count("regions_retired_freed")
                    log.info("retired_region_freed", region_id=rid, name=r.name)
            if self.retired:
                await anyio.sleep(max(0.05, min(r.until for r in self.retired.values()) - now))

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    def _retire(self, rid: int, r: _Region) -> None:
        """The region's memory after it was dropped and deregistered. A transfer NIXL
        could not cancel may still land in it (a peer's WRITE behind a slow or cut link,
        the reply to our own READ past its drain): shared memory is retired (a decoy at
        its addresses, `MappedRegion.retire`) and unmapped only after `_late_bound`.
        Kept mapped as it is if the decoy cannot be made (its owner's memory is then
        held as long). GPU memory opened through CUDA IPC is closed at once: a decoy is
        a host-memory notion (not covered: docs/late-writes.md)."""
        m = r.mapping
        if not isinstance(m, MappedRegion):
            m.close()
            return
        try:
            m.retire()
        except OSError as exc:
            self._count("regions_retire_failed")
            log.error("region_retire_failed", region_id=rid, error=str(exc))
        self.retired[rid] = _Retired(
            rid, r.view.name, r.nbytes, m, self.clock.now() + min(self._late_bound, MAX_LATE_S)
        )
        self._count("regions_retired")
        self._retired_wake.set()

    async def cleanup(self) -> None:
        """Shielded shutdown: tell peers, deregister everything, retire the regions (the
        process's end unmaps them)."""
        for d in self.dropping.values():
            d.started = False  # its background drop was cut short with the rest
        for rid in [*self.dropping, *self.regions]:
            try:
                await self._drop_region(rid, notify_peers=True, drain=False, notify_timeout=1.0)
            except Exception as exc:
                log.warning("region_cleanup_failed", region_id=rid, error=str(exc))
        for reg, mem in ((self._canary_reg, self.canary), (self._scratch_reg, self.scratch)):
            if reg is not None:
                try:
                    await self.engine.deregister(reg)
                except Exception as exc:
                    log.warning("canary_deregister_failed", error=str(exc))
            if mem is not None:
                mem.close()
        self._canary_reg = self._scratch_reg = None

    # ---------------------------------------------------------------- dispatch

    async def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, ClientRequest):
            await self._client(msg)
        elif isinstance(msg, _AfterDrop):
            await self._client(msg.req, waited=True)
        elif isinstance(msg, _PeerSilent):
            await self._peer_silent(msg)
        elif isinstance(msg, _CreatorsGone):
            names = [n for n in msg.names if self._watched.pop(n, None) is not None]
            if names:
                await self._reap(names, "creator_gone")
        elif isinstance(msg, EnsurePeer):
            self._ensure_peer(msg)
        elif isinstance(msg, PeerClock):
            self._peer_clock(msg)
        elif isinstance(msg, RegisterDaemonRegion):
            try:
                got = await self._register("daemon", msg.request)
                msg.resolve(self.regions[got.region_id].view)
            except KvdError as exc:
                msg.fail(exc)
        elif isinstance(msg, AcceptHandshake):
            await self._accept(msg)
        elif isinstance(msg, PeerRegionDropped):
            self._peer_region_dropped(msg)
        elif isinstance(msg, ProbeReceived):
            await self._probe(msg)
        elif isinstance(msg, PingPeerCmd):
            assert self._tg is not None
            self._tg.start_soon(self._ping, msg)
        elif isinstance(msg, TraceCmd):
            assert self._tg is not None
            self._tg.start_soon(self._trace_request, msg)
        elif isinstance(msg, SessionClosed):
            drops: list[anyio.Event] = []
            segments = []
            for rid, r in list(self.regions.items()):
                if r.view.session == msg.session:
                    log.info("region_released_with_session", region_id=rid, session=msg.session)
                    done = self._begin_drop(rid)
                    if done is not None:
                        drops.append(done)
                    if r.view.mem_type == "DRAM":
                        segments.append(r.view.name)
            assert self._tg is not None
            self._tg.start_soon(self._session_dropped, msg, drops, tuple(segments))
        elif isinstance(msg, _SessionDropped):
            c = msg.closed
            c.resolve(None)
            if msg.segments and c.client_gone and self.reap_leftovers:
                # Retired now (a decoy took their place): our mapping no longer keeps
                # them. Awaited: no registration of ours can map one of them while they
                # are judged.
                await self._reap(list(msg.segments), "session_end", c.session)
        elif isinstance(msg, PeerLost):
            p = self.peers.get(msg.agent)
            if p is not None and p.dialed_us and msg.endpoint:
                # The engine mends a failed endpoint to it (`add_remote(mend=True)`), and
                # a new incarnation handshakes again itself. Forgetting it would leave us
                # refusing its notifications (its registrations, cancels, heartbeats)
                # until it happens to handshake again.
                self.counters["peer_lost_kept"] = self.counters.get("peer_lost_kept", 0) + 1
                log.info("peer_lost_kept", peer=msg.agent, reason=msg.reason[:200])
            elif p is None or p.info.handshaked_at <= msg.since:  # not a newer incarnation's view
                await self._forget(msg.agent)
        elif isinstance(msg, Snapshot):
            msg.resolve(self.snapshot(msg.section))
        else:
            raise TypeError(f"registrar got {type(msg).__name__}")

    async def _client(self, req: ClientRequest, *, waited: bool = False) -> None:
        m = req.msg
        try:
            if isinstance(m, wire.RegisterRegion):
                old = None if waited else self._dropping_same(m)
                if old is not None:  # the same memory: taken again once the old one went
                    assert self._tg is not None
                    self._tg.start_soon(self._after_drop, req, old.done)
                    return
                req.resolve(await self._register(req.session, m))
            elif isinstance(m, wire.DeregisterRegion):
                r = self.regions.get(m.region_id)
                if r is None or r.view.session != req.session:
                    raise NotFound(f"no region {m.region_id} owned by this session")
                done = self._begin_drop(m.region_id)
                assert done is not None and self._tg is not None
                self._tg.start_soon(_answer_when_set, req, done)
            else:
                raise TypeError(f"registrar got {type(m).__name__}")
        except KvdError as exc:
            self.rejects.reject(
                "registrar",
                "region_rejected",
                "region_request_rejected",
                type(exc).__name__,
                session=req.session,
                error=exc.message,
            )
            req.fail(exc)

    # ---------------------------------------------------------------- regions

    async def _register(self, session: str, m: wire.RegisterRegion) -> wire.RegionRegistered:
        if not m.compat:
            raise InvalidRequest(
                "compat must identify the model and KV format: use "
                "kvd_client.layout.compat_hash(...) (the same on both ends of a transfer)"
            )
        if m.kind not in ("shm", "cuda-ipc"):
            raise InvalidRequest(f"unknown region kind {m.kind!r} (shm or cuda-ipc)")
        if m.tp_rank >= m.tp_size:
            raise InvalidRequest(f"tp_rank {m.tp_rank} must be < tp_size {m.tp_size}")
        for r in self.regions.values():
            if r.view.engine_id == m.engine_id and r.view.tp_rank == m.tp_rank:
                raise InvalidRequest(
                    f"engine {m.engine_id!r} rank {m.tp_rank} already has region {r.view.region_id}"
                )
        geometry_of(0, m.nbytes, m.layout)  # validate before touching memory
        check_region(m.compat, m.layout, m.tp_size, m.tp_rank)  # a KV spec must fit the layout
        region_groups(0, m.nbytes, m.layout, m.groups, m.tp_size, m.tp_rank)  # hybrid: groups
        mapping: MappedRegion | CudaIpcRegion
        if m.kind == "shm":
            mapping, mem, dev = MappedRegion(m.name, m.nbytes), "DRAM", 0
        else:
            mapping, mem, dev = (
                CudaIpcRegion(m.ipc_handle, m.nbytes, m.device),
                "VRAM",
                max(m.device, 0),
            )
        try:
            geo = geometry_of(mapping.addr, m.nbytes, m.layout)
            groups = region_groups(mapping.addr, m.nbytes, m.layout, m.groups, m.tp_size, m.tp_rank)
            reg = await self.engine.register(mapping.addr, m.nbytes, mem, dev)
            try:
                md = await self.engine.partial_metadata(mapping.addr, m.nbytes, mem, dev)
            except BaseException:
                await self.engine.deregister(reg)
                raise
        except BaseException:
            mapping.close()
            raise
        rid = self._next_region_id
        self._next_region_id += 1
        self._generation += 1
        view = LocalRegion(
            region_id=rid,
            generation=self._generation & 0xFFFFFFFF,
            engine_id=m.engine_id,
            tp_rank=m.tp_rank,
            tp_size=m.tp_size,
            geometry=geo,
            layout=m.layout,
            compat=m.compat,
            session=session,
            name=m.name,
            mem_type=mem,
            device=dev,
            groups=groups,
        )
        self.regions[rid] = _Region(view, mapping, reg, md, mapping.addr, m.nbytes)
        self.counters["regions_registered"] = self.counters.get("regions_registered", 0) + 1
        log.info(
            "region_registered",
            region_id=rid,
            engine_id=m.engine_id,
            tp_rank=m.tp_rank,
            nbytes=m.nbytes,
            blocks=m.layout.num_blocks,
            session=session,
        )
        self._publish_regions()
        return wire.RegionRegistered(rid, view.generation)

    def _begin_drop(self, rid: int) -> anyio.Event | None:
        """Drop region `rid` in the background (peers told, transfers drained, then
        deregistered: `_drop_region`); it leaves our actors' view and what handshakes
        show at once. The event is set once it is gone; None if there is no such region."""
        d = self.dropping.get(rid)
        if d is not None:
            return d.done
        d = self._take(rid)
        if d is None:
            return None
        assert self._tg is not None
        self._tg.start_soon(self._drop_region, rid, True, True)
        return d.done

    def _take(self, rid: int) -> _Dropping | None:
        """Region `rid` out of `regions` and our actors' view, into `dropping`."""
        r = self.regions.pop(rid, None)
        if r is None:
            return None
        d = self.dropping[rid] = _Dropping(r)
        self._publish_regions()
        return d

    def _dropping_same(self, m: wire.RegisterRegion) -> _Dropping | None:
        """A region being dropped over the memory `m` would register (the same shm
        segment; for CUDA IPC, the rank's region, as a handle is opened once per process):
        peers may still write into it until they replied."""
        for d in self.dropping.values():
            v = d.region.view
            if m.kind == "shm":
                if v.mem_type == "DRAM" and v.name == m.name:
                    return d
            elif v.mem_type == "VRAM" and (v.engine_id, v.tp_rank) == (m.engine_id, m.tp_rank):
                return d
        return None

    async def _after_drop(self, req: ClientRequest, done: anyio.Event) -> None:
        """`req` again, on the registrar's loop, once the drop it waits for ended (its
        bound: the drop's own, peers' replies and the drain)."""
        with anyio.move_on_after(2 * self.handshake_timeout + 1.0):
            await done.wait()
        self.mailbox.post(_AfterDrop(req))

    async def _session_dropped(
        self, msg: SessionClosed, drops: list[anyio.Event], segments: tuple[str, ...]
    ) -> None:
        """The session's regions are gone: its close is answered (and its segments judged)
        on the registrar's own loop."""
        for done in drops:
            await done.wait()
        self.mailbox.post(_SessionDropped(msg, segments))

    async def _drop_region(
        self, rid: int, notify_peers: bool, drain: bool, notify_timeout: float | None = None
    ) -> None:
        d = self.dropping.get(rid) or self._take(rid)
        if d is None:
            return
        if d.started:  # under way (in the background): its end is this one's
            await d.done.wait()
            return
        d.started = True
        r = d.region
        # 1. peers first: they must never address this generation again.
        if notify_peers and self.peers:
            notice = wire.RegionDropped(self.engine.name, rid, r.view.generation, time.time(), b"")
            if self.secret is not None:
                notice = replace(notice, mac=handshake_mac(self.secret, notice, b"drop"))
            with anyio.move_on_after(notify_timeout or self.handshake_timeout):
                async with anyio.create_task_group() as tg:
                    for p in list(self.peers.values()):
                        tg.start_soon(self._notify_drop, p.info, self._sealed(p.info, notice))
        # 2. local transfers touching it finish or fail.
        if drain:
            with anyio.move_on_after(self.handshake_timeout):
                await self._drain_local(rid)
        # 3. only now deregister, and retire its memory (late bytes may still come).
        try:
            await self.engine.deregister(r.reg)
        except KvdError as exc:
            # Retired all the same: peers were told and our transfers drained, and what
            # NIXL may still hold registered then points at the decoy. One region's
            # failure must not take the daemon down (this runs in the registrar's tasks).
            self._count("regions_deregister_failed")
            log.error("region_deregister_failed", region_id=rid, error=exc.message)
        finally:
            del self.dropping[rid]
            d.done.set()
            self._retire(rid, r)
        self.counters["regions_dropped"] = self.counters.get("regions_dropped", 0) + 1
        log.info("region_dropped", region_id=rid, generation=r.view.generation)

    async def _reap(self, names: Sequence[str] | None, when: str, session: str = "") -> None:
        """Remove leftover staging segments: `names`, or every segment in /dev/shm."""

        def judge() -> Reaped:
            return reap_segments(
                os.listdir(SHM_DIR) if names is None else names, staging_creator_here
            )

        try:
            got = await anyio.to_thread.run_sync(judge)
        except OSError as exc:
            log.warning("staging_reap_failed", when=when, error=str(exc))
            return
        where = {"when": when} | ({"session": session} if session else {})
        for name, pid in got.removed.items():
            self.counters["staging_segments_reaped"] = (
                self.counters.get("staging_segments_reaped", 0) + 1
            )
            log.info("staging_segment_reaped", segment=name, creator_pid=pid, **where)
        # Judged again once its creator is gone. At start too: an engine alive as this
        # daemon starts may die before it registers its segment here (frozen, or killed
        # as the daemon came back), and then no session of its ends here to reap it.
        for name, pid in got.alive.items():
            self._watched[name] = pid
            self._watched.move_to_end(name)
            if len(self._watched) > WATCH_MAX:
                self._watched.popitem(last=False)
            self._watch_wake.set()
        if names is None:
            return  # at start, every live client's segment is kept: not worth a line each
        for name in names:
            why = got.kept.get(name)
            if why is None and staging_creator_here(name) is None:
                why = "not a kvd staging name from our pid namespace"
            if why is not None:  # else removed, or gone already
                log.info("staging_segment_kept", segment=name, reason=why, **where)

    def _sealed(self, peer: PeerInfo, msg: wire.Record) -> wire.Record:
        """With a shared secret, `msg` in an envelope under our session key with `peer`
        (the side channel refuses anything else after the handshake); else `msg`."""
        if self.keyring is None:
            return msg
        env = self.keyring.seal(peer.agent, wire.encode(msg), time.monotonic())
        return msg if env is None else env  # no key: the peer refuses it, as it should

    async def _notify_drop(self, peer: PeerInfo, notice: wire.Record) -> None:
        try:
            reply = await self._side_request(peer.host, peer.port, notice)
            if not isinstance(reply, wire.Ok):
                log.warning("region_drop_not_acked", peer=peer.agent, reply=type(reply).__name__)
        except Exception as exc:
            log.warning("region_drop_notice_failed", peer=peer.agent, error=str(exc))

    def _publish_regions(self) -> None:
        snap = {(r.view.engine_id, r.view.tp_rank): r.view for r in self.regions.values()}
        self._publish(LocalRegionsChanged(snap))

    def _region_infos(self) -> tuple[wire.RegionInfo, ...]:
        return tuple(
            wire.RegionInfo(
                region_id=r.view.region_id,
                generation=r.view.generation,
                engine_id=r.view.engine_id,
                tp_rank=r.view.tp_rank,
                tp_size=r.view.tp_size,
                base_addr=r.base_addr,
                nbytes=r.nbytes,
                mem_type=r.view.mem_type,
                device=r.view.device,
                layout=r.view.layout,
                compat=r.view.compat,
                nixl_md=r.nixl_md,
                groups=tuple(g.to_wire() for g in r.view.groups),
            )
            for r in self.regions.values()
        )

    # ---------------------------------------------------------------- handshakes

    @property
    def reach(self) -> Reach:
        """What our UCX can do (`kvd.core.readpath`); known once the agent is made."""
        if self._reach is None:
            self._reach = self._reach_of()
        return self._reach

    async def _our_handshake(self, context: bytes, nonce: bytes | None = None) -> wire.Handshake:
        assert self.canary is not None
        hs = wire.Handshake(
            agent_name=self.engine.name,
            incarnation=self.incarnation,
            nixl_md=await self.engine.metadata(),
            side_host=self.side_host,
            side_port=self._side_port_ref(),
            kv_lease_duration=self.lease_duration,
            write_bound=self.write_bound,
            regions=self._region_infos(),
            canary_addr=self.canary.addr,
            canary_bytes=CANARY_BYTES,
            nonce=nonce or os.urandom(16),
            timestamp=time.time(),
            mac=b"",
            machine=self.reach.machine,
            rdma=self.reach.rdma,
            cma=self.reach.cma,
            doorbell=self.engine.bell is not None,
        )
        if self.secret is not None:
            hs = replace(hs, mac=handshake_mac(self.secret, hs, context))
        return hs

    def _install_key(
        self, *, dialer: wire.Handshake | Party, acceptor: wire.Handshake | Party
    ) -> None:
        """With a secret, the session key of an authenticated handshake (`derive_session`),
        installed before anything can be sent to or arrive from the peer under it."""
        if self.keyring is None or self.secret is None:
            return
        d, a = (
            p if isinstance(p, Party) else Party(p.agent_name, p.incarnation, p.nonce)
            for p in (dialer, acceptor)
        )
        peer = a.agent if d.agent == self.engine.name else d.agent
        self.keyring.install(
            peer, derive_session(self.secret, dialer=d, acceptor=a), time.monotonic()
        )
        self.counters["session_keys_derived"] = self.counters.get("session_keys_derived", 0) + 1

    def _check_mac(self, hs: wire.Handshake, context: bytes) -> None:
        if self.secret is None:
            return
        good = handshake_mac(self.secret, hs, context)
        if not hs.mac or not hmac.compare_digest(good, hs.mac):
            raise AuthError(f"peer {hs.agent_name!r} failed authentication")
        if abs(time.time() - hs.timestamp) > AUTH_WINDOW_S:
            raise AuthError(f"peer {hs.agent_name!r} handshake timestamp outside the window")

    async def _learn(self, hs: wire.Handshake, host: str, port: int, *, dialed: bool) -> PeerInfo:
        """Load a peer's NIXL metadata (full first, then per-region) and cache its view.

        Only a handshake we `dialed` maps host:port to the agent: an inbound one merely
        claims that address, and must not redirect our requests for whoever owns it.
        Everything is validated before any existing state is touched.
        """
        if hs.agent_name == self.engine.name:
            raise InvalidRequest(f"peer uses our own agent name {hs.agent_name!r}")
        regions: dict[tuple[str, int], RemoteRegion] = {}
        for ri in hs.regions:
            try:
                geo = geometry_of(ri.base_addr, ri.nbytes, ri.layout)
                groups = region_groups(
                    ri.base_addr, ri.nbytes, ri.layout, ri.groups, ri.tp_size, ri.tp_rank
                )
            except InvalidRequest as exc:
                raise RemoteProtocolError(f"peer region {ri.region_id}: {exc.message}") from None
            regions[(ri.engine_id, ri.tp_rank)] = RemoteRegion(
                ri.region_id,
                ri.generation,
                ri.engine_id,
                ri.tp_rank,
                ri.tp_size,
                geo,
                ri.compat,
                ri.mem_type,
                ri.device,
                ri.layout,
                groups,
            )
            try:
                check_region(ri.compat, ri.layout, ri.tp_size, ri.tp_rank)
            except InvalidRequest as exc:
                raise RemoteProtocolError(f"peer region {ri.region_id}: {exc.message}") from None
            if ri.mem_type not in ("DRAM", "VRAM"):
                raise RemoteProtocolError(
                    f"peer region {ri.region_id}: unknown memory type {ri.mem_type!r}"
                )
        known = self.peers.get(hs.agent_name)
        if known is not None and known.incarnation != hs.incarnation:
            log.info("peer_restarted", peer=hs.agent_name)
            await self._forget(hs.agent_name)
            known = None
        if known is None:
            name = await self.engine.add_remote(hs.nixl_md, mend=not dialed)
            if name != hs.agent_name:
                if name not in self.peers and name != self.engine.name:  # never unload a real peer
                    await self.engine.remove_remote(name)
                raise RemoteProtocolError(
                    f"metadata names agent {name!r}, handshake says {hs.agent_name!r}"
                )
            loaded = {(ri.region_id, ri.generation) for ri in hs.regions}
            known = _Peer(info=None, incarnation=hs.incarnation, loaded_regions=loaded)  # type: ignore[arg-type]
        else:
            if not dialed and not known.dialed_us:
                # we dialed it first (not mended then): from now on the engine mends it
                await self.engine.mend_from(hs.agent_name, hs.nixl_md)
            current = {(ri.region_id, ri.generation) for ri in hs.regions}
            if known.loaded_regions - current and await self.engine.refresh_remote(
                hs.agent_name, hs.nixl_md
            ):
                # regions it dropped were loaded: their sections could shadow regions it
                # registered since at the same addresses (NIXL refuses transfers there)
                log.info("peer_metadata_refreshed", peer=hs.agent_name)
                known.loaded_regions = current
            for ri in hs.regions:
                key = (ri.region_id, ri.generation)
                if key not in known.loaded_regions:
                    await self.engine.add_remote(ri.nixl_md)
                    known.loaded_regions.add(key)
        info = PeerInfo(
            agent=hs.agent_name,
            incarnation=hs.incarnation,
            host=host,
            port=port,
            lease_duration=hs.kv_lease_duration,
            write_bound=hs.write_bound,
            regions=regions,
            canary_addr=hs.canary_addr,
            canary_bytes=hs.canary_bytes,
            handshaked_at=self.clock.now(),
            native_reads=native_reads(self.reach, Reach(hs.machine, hs.rdma, hs.cma)),
        )
        known.info = info
        self._ring_at(hs, host if dialed else hs.side_host)
        self._late_bound = max(self._late_bound, hs.write_bound)
        known.dialed_us = known.dialed_us or not dialed
        self.peers[hs.agent_name] = known
        if dialed:
            self.peer_by_addr[info.addr] = hs.agent_name
        self._publish(PeerUpdated(hs.agent_name, info))
        return info

    def _ensure_peer(self, msg: EnsurePeer) -> None:
        addr = f"{msg.host}:{msg.port}"
        agent = self.peer_by_addr.get(addr)
        stale_at = msg.not_before if msg.refresh else None
        if agent is not None and (
            not msg.refresh
            or (stale_at is not None and self._answered_since.get(addr, -1.0) > stale_at)
        ):
            # (a refresh: a handshake that started after the caller found its view stale
            # has answered already: its view is the fresh one the caller wants)
            if msg.refresh:
                self._count("handshake_refreshes_joined")
            msg.resolve(self.peers[agent].info)
            return
        fut = self._pending.get(addr)
        if fut is None or (msg.refresh and stale_at is None):
            fut = self._start_handshake(msg.host, msg.port)
        elif stale_at is not None and self._pending_since[addr] <= stale_at:
            # A refresh never joins a handshake that started before the caller found its
            # view stale: that one may answer with the same stale view (a region the
            # peer registered meanwhile). It joins the one handshake queued behind it,
            # which starts when it ends: a burst of requests finding the same view stale
            # costs at most two handshakes, not one each.
            nxt = self._next.get(addr)
            if nxt is None:
                nxt = asyncio.get_running_loop().create_future()
                self._next[addr] = nxt
            else:
                self._count("handshake_refreshes_joined")
            fut = nxt
        elif msg.refresh:
            self._count("handshake_refreshes_joined")
        fut.add_done_callback(lambda f: _settle(msg, f))

    def _start_handshake(
        self, host: str, port: int, fut: asyncio.Future[PeerInfo] | None = None
    ) -> asyncio.Future[PeerInfo]:
        addr = f"{host}:{port}"
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
        self._pending[addr] = fut
        self._pending_since[addr] = started = self.clock.now()
        assert self._tg is not None
        self._tg.start_soon(self._handshake, host, port, fut, started)
        return fut

    async def _handshake(
        self, host: str, port: int, fut: asyncio.Future[PeerInfo], started: float
    ) -> None:
        addr = f"{host}:{port}"
        try:
            ours = await self._our_handshake(b"req")
            reply = await self._side_request(host, port, ours)
            if isinstance(reply, wire.ErrorReply):
                raise wire_error(reply)
            if not isinstance(reply, wire.Handshake):
                raise RemoteProtocolError(f"handshake reply is a {type(reply).__name__}")
            self._check_mac(reply, b"rep" + ours.nonce)
            info = await self._learn(reply, host, port, dialed=True)
            self._install_key(dialer=ours, acceptor=reply)
            self.counters["handshakes_ok"] = self.counters.get("handshakes_ok", 0) + 1
            self._answered_since[addr] = started  # the view cached now is this one's
            log.info("peer_handshake_ok", peer=info.agent, addr=addr, regions=len(info.regions))
            fut.set_result(info)
            self._spawn_clock_sync(info.agent, host, port)
        except Exception as exc:
            err = (
                exc
                if isinstance(exc, KvdError)
                else TransferError(f"handshake with {addr} failed: {exc}")
            )
            # counted, and logged rate-limited per kind of failure: an engine may name any
            # number of peers that do not answer, and each would be a line
            self.rejects.reject(
                "registrar",
                "handshakes_failed",
                "peer_handshake_failed",
                type(err).__name__,
                addr=addr,
                error=str(err),
            )
            fut.set_exception(err)
            fut.exception()  # mark retrieved: waiters got it through callbacks
        finally:
            if self._pending.get(addr) is fut:
                del self._pending[addr]
                self._pending_since.pop(addr, None)
                nxt = self._next.pop(addr, None)
                if nxt is not None:  # at once: a refresh coming meanwhile joins it
                    self._start_handshake(host, port, nxt)

    async def _side_request(self, host: str, port: int, msg: wire.Record) -> wire.Record:
        """One request/reply on a peer's side channel (fresh DEALER, bounded by the timeout)."""
        sock = self._zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, transport_cap(self.max_frame))
        try:
            with anyio.fail_after(self.handshake_timeout):
                address = await self.resolver.resolve(host, self.handshake_timeout)
                connect(sock, address, port)
                corr = int.from_bytes(os.urandom(6), "little")
                await sock.send(wire.encode(msg, corr))
                while True:
                    frame = await sock.recv()
                    rcorr, reply = wire.decode(frame)
                    if rcorr == corr:
                        return reply
        except TimeoutError:
            raise Timeout(
                f"no answer from {host}:{port} within {self.handshake_timeout}s"
            ) from None
        finally:
            sock.close(0)

    async def _accept(self, msg: AcceptHandshake) -> None:
        hs = msg.request
        assert isinstance(hs, wire.Handshake)
        try:
            self._check_mac(hs, b"req")
            where = address_problem(
                hs.side_host, hs.side_port, "Handshake.side_host", "Handshake.side_port"
            )
            if where is not None:  # we dial it to tell the peer about dropped regions
                raise InvalidRequest(where)
            await self._learn(hs, hs.side_host, hs.side_port, dialed=False)
            nonce = os.urandom(16)
            self._install_key(
                dialer=hs,
                acceptor=Party(self.engine.name, self.incarnation, nonce),
            )
            reply = await self._our_handshake(b"rep" + hs.nonce, nonce)
            self.counters["handshakes_accepted"] = self.counters.get("handshakes_accepted", 0) + 1
            log.info("peer_handshake_accepted", peer=hs.agent_name)
            msg.resolve(reply)
            self._spawn_clock_sync(hs.agent_name, hs.side_host, hs.side_port)
        except KvdError as exc:
            key = "auth_rejected" if isinstance(exc, AuthError) else "handshakes_rejected"
            self.rejects.reject(
                "registrar",
                key,
                "peer_handshake_rejected",
                type(exc).__name__,
                peer=hs.agent_name,
                error=exc.message,
            )
            msg.resolve(wire.ErrorReply.of(exc.code, exc.message))

    def _peer_region_dropped(self, msg: PeerRegionDropped) -> None:
        n = msg.notice
        if self.secret is not None:
            good = handshake_mac(self.secret, n, b"drop")
            if (
                not n.mac
                or not hmac.compare_digest(good, n.mac)
                or abs(time.time() - n.timestamp) > AUTH_WINDOW_S
            ):
                self.rejects.reject(
                    "registrar",
                    "auth_rejected",
                    "region_drop_rejected",
                    "AuthError",
                    peer=n.agent_name,
                    reason="authentication failed",
                )
                msg.fail(AuthError(f"region drop from {n.agent_name!r} failed authentication"))
                return
        p = self.peers.get(n.agent_name)
        if p is None:
            msg.resolve(None)
            return
        regions = {k: r for k, r in p.info.regions.items() if r.region_id != n.region_id}
        p.info = replace(p.info, regions=regions)
        self._publish(PeerUpdated(n.agent_name, p.info))
        log.info(
            "peer_region_dropped", peer=n.agent_name, region_id=n.region_id, generation=n.generation
        )
        msg.resolve(None)

    def _ring_at(self, hs: wire.Handshake, host: str) -> None:
        """Ring the peer's doorbell after our notifications to it, if it has one (at the
        address we dialed, or the one its handshake gave), else no more. A host name not
        resolved yet is looked up in the background: the handshake never waits for it."""
        ip = self.resolver.cached(host, stale_ok=True) if hs.doorbell else None
        self.engine.set_peer_doorbell(
            hs.agent_name, peer_address(ip, hs.side_port) if ip is not None else None
        )
        if hs.doorbell and ip is None and self._tg is not None:
            self._tg.start_soon(
                self._ring_when_resolved, hs.agent_name, hs.incarnation, host, hs.side_port
            )

    async def _ring_when_resolved(self, agent: str, incarnation: int, host: str, port: int) -> None:
        try:
            ip = await self.resolver.resolve(host, self.handshake_timeout)
        except KvdError:
            return  # (its notifications wait for its timed polls)
        known = self.peers.get(agent)
        if known is not None and known.incarnation == incarnation:
            self.engine.set_peer_doorbell(agent, peer_address(ip, port))

    async def _forget(self, agent: str) -> None:
        """Drop a peer: its NIXL entry goes, the next use handshakes afresh."""
        self.engine.set_peer_doorbell(agent, None)
        p = self.peers.pop(agent, None)
        if self.keyring is not None:
            self.keyring.forget(agent)  # its messages in flight fail from now on
        if p is None:
            return
        if self.peer_by_addr.get(p.info.addr) == agent:
            del self.peer_by_addr[p.info.addr]
        try:
            await self.engine.remove_remote(agent)
        except KvdError as exc:
            log.warning("remove_remote_failed", peer=agent, error=exc.message)
        self._publish(PeerUpdated(agent, None))
        self._count("peers_forgotten")
        log.info("peer_forgotten", peer=agent)

    # ---------------------------------------------------------------- clocks and traces

    def _spawn_clock_sync(self, agent: str, host: str, port: int) -> asyncio.Future[ClockReading]:
        """Measure the peer's clock offset (joining a measurement in flight)."""
        fut = self._clock_syncs.get(agent)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            fut.add_done_callback(_retrieve)
            self._clock_syncs[agent] = fut
            if self._tg is not None:
                self._tg.start_soon(self._clock_sync, agent, host, port, fut)
            else:
                fut.set_exception(Timeout("the registrar is not running"))
        return fut

    def _peer_clock(self, msg: PeerClock) -> None:
        """The stored offset if fresh enough; else a measurement's, when it ends."""
        p = self.peers.get(msg.agent)
        if p is None:
            msg.fail(NotFound(f"{msg.agent!r} is not a known peer"))
            return
        now_ns = self.trace.clock()
        if p.clock is not None and now_ns - p.clock_at_ns <= msg.max_age_s * 1e9:
            msg.resolve(ClockReading(p.clock, p.clock_at_ns))
            return
        fut = self._spawn_clock_sync(msg.agent, p.info.host, p.info.port)

        def answer(f: asyncio.Future[ClockReading]) -> None:
            if f.cancelled():
                msg.fail(Timeout("the clock measurement was cancelled"))
            elif (exc := f.exception()) is not None:
                msg.fail(exc)
            else:
                msg.resolve(f.result())

        fut.add_done_callback(answer)

    async def _clock_sync(
        self, agent: str, host: str, port: int, fut: asyncio.Future[ClockReading]
    ) -> None:
        """Measure a peer's clock offset after a handshake, or when asked (best effort: a
        failure only leaves it unmeasured, and is logged)."""
        try:
            try:
                _, offset = await self._exchange(host, port, ())
            except Exception as exc:
                log.info("peer_clock_unmeasured", peer=agent, addr=f"{host}:{port}", error=str(exc))
                err = exc if isinstance(exc, KvdError) else Timeout(str(exc))
                if not fut.done():
                    fut.set_exception(err)
                return
            at_ns = self._store_clock(agent, offset)
            if not fut.done():
                fut.set_result(ClockReading(offset, at_ns))
        finally:
            if self._clock_syncs.get(agent) is fut:
                del self._clock_syncs[agent]
            if not fut.done():
                fut.set_exception(Timeout("the clock measurement was cancelled"))
        log.debug(
            "peer_clock_measured",
            peer=agent,
            offset_us=round(offset.offset_ns / 1e3, 1),
            error_us=round(offset.error_ns / 1e3, 1),
        )

    def _store_clock(self, agent: str, offset: ClockOffset) -> int:
        """Keep the peer's offset; when (our trace clock) it was measured."""
        at_ns = self.trace.clock()
        p = self.peers.get(agent)
        if p is not None:
            p.clock, p.clock_at, p.clock_at_ns = offset, self.clock.now(), at_ns
        return at_ns

    async def _exchange(
        self, host: str, port: int, request_ids: Sequence[str], samples: int = CLOCK_SAMPLES
    ) -> tuple[wire.TraceAnswer, ClockOffset]:
        """`samples` TraceQuery exchanges on one connection (the first asks for
        `request_ids`' records): its answer, and the offset with the smallest bound."""
        clock = self.trace.clock
        sock = self._zctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, transport_cap(self.max_frame))
        first: wire.TraceAnswer | None = None
        offsets: list[ClockOffset] = []
        try:
            with anyio.fail_after(self.handshake_timeout):
                address = await self.resolver.resolve(host, self.handshake_timeout)
                connect(sock, address, port)
                for i in range(samples):
                    ids = tuple(request_ids) if i == 0 else ()
                    q = make_query(
                        self.engine.name, ids, clock(), os.urandom(16), time.time(), self.secret
                    )
                    corr = int.from_bytes(os.urandom(6), "little")
                    await sock.send(wire.encode(q, corr))
                    while True:
                        frame = await sock.recv()
                        t3 = clock()
                        rcorr, reply = wire.decode(frame)
                        if rcorr == corr:
                            break
                    if isinstance(reply, wire.ErrorReply):
                        raise wire_error(reply)
                    if not isinstance(reply, wire.TraceAnswer):
                        raise RemoteProtocolError(f"trace reply is a {type(reply).__name__}")
                    check_answer(reply, q, self.secret)
                    offsets.append(estimate(q.t0, reply.t1, reply.t2, t3))
                    first = first or reply
        except TimeoutError:
            raise Timeout(
                f"no trace answer from {host}:{port} within {self.handshake_timeout}s"
            ) from None
        finally:
            sock.close(0)
        assert first is not None
        return first, best(offsets)

    async def _trace_request(self, cmd: TraceCmd) -> None:
        """`kvd trace`: our records of the request and, with `peer`, the peer's."""
        found = self.trace.lookup([cmd.request_id])
        out: dict[str, Any] = {
            "request_id": cmd.request_id,
            "agent": self.engine.name,
            "found": found is not None,
            "requests_held": self.trace.requests_held,
            "requests_capacity": self.trace.requests,
            "recording": self.trace.on,
            "local": {
                "ids": list(found.ids) if found else [],
                "records": [list(r) for r in found.records] if found else [],
                "dropped": found.dropped if found else 0,
            },
            "peer": None,
            "clock": None,
        }
        if cmd.peer:
            try:
                with anyio.fail_after(cmd.timeout):
                    out["peer"] = await self._peer_trace(found, out)
            except TimeoutError:
                agent = found.peer if found else ""
                out["peer"] = {"agent": agent, "error": f"no answer within {cmd.timeout}s"}
        cmd.resolve(out)

    async def _peer_trace(self, found: Found | None, out: dict[str, Any]) -> dict[str, Any]:
        if found is None:
            return {"error": "the request is not in this daemon's trace: no peer to ask"}
        if not found.peer:
            return {"error": "no peer daemon is known for this request on this daemon"}
        p = self.peers.get(found.peer)
        if p is None:
            return {"agent": found.peer, "error": f"peer {found.peer} is not connected now"}
        res: dict[str, Any] = {"agent": found.peer, "addr": p.info.addr}
        try:
            answer, offset = await self._exchange(p.info.host, p.info.port, found.ids[:8])
        except KvdError as exc:
            res["error"] = exc.message
            return res
        self._store_clock(found.peer, offset)
        out["clock"] = offset.as_dict() | {"measured": "now"}
        if answer.agent_name != found.peer:
            res["error"] = f"{p.info.addr} answered as {answer.agent_name}, not {found.peer}"
            return res
        res |= {
            "found": bool(answer.ids),
            "ids": list(answer.ids),
            "records": [[s.t_ns, s.request_id, s.stage] for s in answer.stages],
            "dropped": answer.dropped,
        }
        return res

    # ---------------------------------------------------------------- ping

    async def _probe(self, msg: ProbeReceived) -> None:
        if msg.agent not in self.peers:  # only a peer we handshook with is answered
            self.rejects.reject(
                "registrar", "notifs_rejected", "probe_rejected", "unknown_peer", peer=msg.agent
            )
            return
        if msg.probe.reply:
            fut = self._probes.pop(msg.probe.nonce, None)
            if fut is not None and not fut.done():
                fut.set_result(time.perf_counter())
            return
        if msg.probe.canary_bytes:
            if self._canary_writes >= MAX_CANARY_WRITES:
                self.rejects.reject(
                    "registrar", "notifs_rejected", "probe_rejected", "busy", peer=msg.agent
                )
                return
            self._canary_writes += 1
            assert self._tg is not None
            self._tg.start_soon(self._write_canary, msg.agent, msg.probe)
            return
        try:
            await self.engine.send_notif(msg.agent, wire.encode(wire.Probe(msg.probe.nonce, True)))
        except KvdError as exc:
            log.warning("probe_echo_failed", peer=msg.agent, error=exc.message)

    async def _write_canary(self, agent: str, probe: wire.Probe) -> None:
        """WRITE our canary to a pinger's scratch, the echo riding the WRITE's notification
        (NIXL refuses an address the pinger did not register)."""
        try:
            n = min(probe.canary_bytes, CANARY_BYTES)
            assert self.canary is not None
            echo = wire.encode(wire.Probe(probe.nonce, True, 0, n))
            local, remote = _descs(self.canary.addr, n), _descs(probe.canary_addr, n)
            await self.engine.transfer("WRITE", local, remote, agent, echo, CANARY_WRITE_TIMEOUT, n)
        except KvdError as exc:
            self.rejects.reject(
                "registrar",
                "probe_echo_failed",
                "probe_echo_failed",
                type(exc).__name__,
                peer=agent,
                error=exc.message,
            )
        finally:
            self._canary_writes -= 1

    async def _ping(self, cmd: PingPeerCmd) -> None:
        result: dict[str, Any] = {"peer": f"{cmd.host}:{cmd.port}", "ok": False}
        asked: list[int] = []  # our probes' nonces, forgotten however the ping ends
        locked = False
        try:
            with anyio.fail_after(cmd.timeout):
                t0 = time.perf_counter()
                info = await self._ensure_peer_now(cmd.host, cmd.port)
                result["agent"] = info.agent
                result["handshake_ms"] = (time.perf_counter() - t0) * 1e3
                nonce = int.from_bytes(os.urandom(8), "little")
                fut: asyncio.Future[float] = asyncio.get_running_loop().create_future()
                self._probes[nonce] = fut
                asked.append(nonce)
                t1 = time.perf_counter()
                await self.engine.send_notif(info.agent, wire.encode(wire.Probe(nonce, False)))
                t2 = await fut
                result["notif_rtt_ms"] = (t2 - t1) * 1e3
                n = min(info.canary_bytes, CANARY_BYTES)
                assert self.scratch is not None
                await self._scratch_lock.acquire()
                locked = True
                self.scratch.view()[:n] = b"\0" * n
                t3 = time.perf_counter()
                if readpath.by_write(self.pull_by, info.native_reads):
                    # Our READ would be UCX's emulation, which aborts the peer if we die
                    # with it queued there: the peer WRITEs its canary, its echo after it.
                    result["canary_by"] = "write"
                    nonce = int.from_bytes(os.urandom(8), "little")
                    fut = asyncio.get_running_loop().create_future()
                    self._probes[nonce] = fut
                    asked.append(nonce)
                    ask = wire.Probe(nonce, False, self.scratch.addr, n)
                    await self.engine.send_notif(info.agent, wire.encode(ask))
                    await fut
                else:
                    result["canary_by"] = "read"
                    local = _descs(self.scratch.addr, n)
                    remote = _descs(info.canary_addr, n)
                    await self.engine.transfer(
                        "READ", local, remote, info.agent, b"", cmd.timeout, n
                    )
                result["read_ms"] = (time.perf_counter() - t3) * 1e3
                result["read_bytes"] = n
                got = bytes(self.scratch.view()[:n])
                result["canary_match"] = got == canary_pattern(info.agent, n)
                result["ok"] = bool(result["canary_match"])
        except TimeoutError:
            result["error"] = f"timed out after {cmd.timeout}s"
        except KvdError as exc:
            result["error"] = exc.message
        finally:
            for nonce in asked:
                self._probes.pop(nonce, None)
            if locked:
                self._scratch_lock.release()
        cmd.resolve(result)

    async def _ensure_peer_now(self, host: str, port: int) -> PeerInfo:
        call = EnsurePeer(host, port, refresh=True)
        self._ensure_peer(call)
        return await call.reply

    # ---------------------------------------------------------------- status

    def snapshot(self, section: str) -> dict[str, Any]:
        if section == "peers":
            return {
                "peers": [
                    {
                        "agent": p.info.agent,
                        "incarnation": f"{p.info.incarnation:016x}",
                        "addr": p.info.addr,
                        "lease_duration": p.info.lease_duration,
                        "write_bound": p.info.write_bound,
                        "native_reads": p.info.native_reads,
                        "dialed_us": p.dialed_us,
                        "regions": [
                            {
                                "engine_id": r.engine_id,
                                "tp_rank": r.tp_rank,
                                "region_id": r.region_id,
                                "generation": r.generation,
                                "blocks": r.geometry.num_blocks,
                                "compat": r.compat,
                                "groups": [g.describe() for g in r.groups],
                            }
                            for r in p.info.regions.values()
                        ],
                        "age_s": round(self.clock.now() - p.info.handshaked_at, 3),
                        **_clock_fields(p, self.clock.now()),
                    }
                    for p in self.peers.values()
                ]
            }
        return {
            "regions": [
                {
                    "region_id": r.view.region_id,
                    "generation": r.view.generation,
                    "engine_id": r.view.engine_id,
                    "tp_rank": r.view.tp_rank,
                    "tp_size": r.view.tp_size,
                    "name": r.view.name,
                    "nbytes": r.nbytes,
                    "blocks": r.view.layout.num_blocks,
                    "compat": r.view.compat,
                    "groups": [g.describe() for g in r.view.groups],
                    "session": r.view.session,
                }
                for r in self.regions.values()
            ],
            "dropping": sorted(self.dropping),
            "peers": len(self.peers),
            "retired": [
                {
                    "region_id": r.region_id,
                    "name": r.name,
                    "nbytes": r.nbytes,
                    "decoy": r.mapping.retired,
                    "freed_in_s": round(max(0.0, r.until - self.clock.now()), 3),
                }
                for r in self.retired.values()
            ],
            "resolver": self.resolver.stats(),
            "pings_waiting": len(self._probes),
            "canary_writes": self._canary_writes,
            "reach": {  # what our handshake says (`kvd.core.readpath`)
                "machine": f"{self.reach.machine:016x}",
                "rdma": self.reach.rdma,
                "cma": self.reach.cma,
                "ucx_tls": self.ucx_tls,
            },
        }


def _clock_fields(p: _Peer, now: float) -> dict[str, Any]:
    """A peer's clock offset for `kvd peers` (None: not measured)."""
    c = p.clock
    return {
        "clock_offset_us": None if c is None else round(c.offset_ns / 1e3, 1),
        "clock_error_us": None if c is None else round(c.error_ns / 1e3, 1),
        "clock_age_s": None if c is None else round(now - p.clock_at, 3),
    }


def _retrieve(fut: asyncio.Future[Any]) -> None:
    """Mark a future's exception retrieved (a clock measurement nobody waited for)."""
    if not fut.cancelled():
        fut.exception()


def _settle(call: EnsurePeer, fut: asyncio.Future[PeerInfo]) -> None:
    """Hand a shared handshake's outcome to one waiting caller."""
    exc = fut.exception()
    if exc is not None:
        call.fail(exc)
    else:
        call.resolve(fut.result())


def _descs(addr: int, n: int) -> Any:
    import numpy as np

    return np.array([[addr, n, 0]], dtype=np.int64)


def wire_error(reply: wire.ErrorReply) -> KvdError:
    from kvd_client.errors import error_from_code

    return error_from_code(reply.code, reply.message)
