"""EC router: encoder outputs (e.g. vision embeddings) between an encoder node and its consumers.

The daemon owns one shared-memory EC region, registered with NIXL and cut into fixed
blocks; engine workers map it by name to copy outputs in (producer) and out (consumer).

Producer (role producer/both):
- `ECAllocate` pins fresh blocks (FIFO eviction of unpinned outputs; if everything that
  could be evicted is pinned, allocation fails clearly and evicts nothing); `ECCommit`
  unpins them and returns the `ec_transfer_params` entry for the hash. An allocation its
  session ends without committing is freed, or, where its client may still write into
  it (the session timed out), kept out of use until that process is gone.
- A ZMQ ROUTER on `ec.port` serves `ECXferReq` from consumer daemons. With a shared
  secret (`auth.secret_file`) a request must first prove it, where it is read and before
  anything else is done for it: a valid MAC (HMAC-SHA256 over b"ecxfer" and every other
  field), a timestamp within `AUTH_WINDOW_S` of our wall clock and not older than our
  start, and a nonce not served before (`kvd.core.peerauth.ReplayGuard`). One that fails
  is acked AUTH and counted as `ec_auth_rejected`, without a task, a handshake or a pin.
  Then the hash must exist and be committed, the compatibility hash must equal the
  committed one (a refusal names both), the consumer's address must be one we could
  dial, and the consumer must be who the request says, with or without a secret: our
  handshake with the daemon at its side channel must name the same agent, and that
  agent's EC region must be the region and generation named (on a mismatch we handshake
  once more, in case our view is stale, then refuse). The destination blocks must lie in
  that EC region (the planner refuses anything else). The output is pinned, WRITten into
  the consumer's blocks, acked (`ECXferAck`), then unpinned. Nothing is WRITten for a
  refused request. A request is also refused (TIMEOUT, counted in `ec_xfer_too_old`) once
  the consumer's clock may have passed its `serve_by_ns` (its send time plus the
  consumer's `ec.xfer_timeout`): the consumer quarantines its blocks only for the life of
  a WRITE started before that, and a request may have waited in ZMQ behind a cut link
  for longer. The producer judges it without synchronized clocks, right before it posts
  the WRITE (nothing awaited in between): with the consumer's clock offset it measured
  at the handshake (again when older than `CLOCK_MAX_AGE_S`), widened by the offset's
  error bound and the drift the clocks may have had since
  (`kvd.core.timeline.peer_now_latest_ns`). A request without a deadline, or from a
  consumer whose offset cannot be measured, is refused too (`ec_xfer_age_unknown`): one
  is served only when it is known to be in time.
  At most `daemon.mailbox_size` requests are served at once (each
  waits on a handshake and a WRITE); one beyond is acked BUSY at once, counted in
  `ec_xfer_failed`, so a flood holds no task, pin or registrar call per request. With a
  secret, each ack carries a MAC over b"ecack", the request's nonce and the ack: a
  consumer takes an ok ack only with a valid one (else it is counted in
  `ec_auth_rejected` and the fetch waits on); a refusal is taken either way (it only
  costs a local encode). Malformed and refused requests are counted and logged at a
  bounded rate (`RejectLog`); frames above twice `max_frame_bytes` are cut off by libzmq with
  their connection (`ec_disconnects`, `kvd.adapters.zmq_monitor`).

Consumer (role consumer/both):
- `ECEnsure` answers from the local cache when it can (a hit, counted), joins an
  in-flight fetch (both only under the compat the output was fetched with: another is
  refused), or allocates blocks (LRU eviction, never a pinned output) and sends
  `ECXferReq` (with a fresh nonce and timestamp, the deadline for the producer's WRITE to
  start on its monotonic clock, and a MAC when a secret is set) through
  a lazily created DEALER per producer. The answer is an event:
  `ECReady` (the output is pinned for the caller until `ECRelease`) or `ECUnavailable`
  (unknown, refused, or no answer within `ec.xfer_timeout`). A client that goes away has
  its pins dropped. Every ack names its request's nonce: one for another request (given
  up on earlier) is never taken for the fetch in flight.
- A fetch given up on keeps its blocks quarantined: the producer may still WRITE them.
  They are freed by the producer's answer to that request, or to a cancel
  (`ECXferCancel`, sent once our clock passed the request's `serve_by_ns`, then every
  `CANCEL_EVERY_S`): a producer that is not serving it (it never got it, or it is a new
  incarnation of a producer that died with it) answers that it never will, which it can
  say because it would refuse the request as too old; one serving it answers when its
  WRITE ended, one that gave up on a WRITE UCX had not ended never does. Without an
  answer the blocks are freed at the WRITE's bound (`quarantine_s`).
- The cache is also published in an index segment (`kvd_client.ecindex`, a seqlock per
  slot) so that clients serve warm hits without a round trip (`KvdClient.ec_read`): an
  output is published once its fetch is acked, and retracted (its slot's sequence made
  odd) in the same synchronous step that evicts it, before its blocks go into the next
  fetch's `ECXferReq`. Clients report those hits in batches (`ECHits`): counted as hits,
  and each output made most recently used.
- A cold fetch's `ECXferReq` is sent from the handler that allocated its blocks, and
  its ack is handled on the task that reads it: each hop cut was measured
  (`kvd bench --only ec` prints the stages of a cold fetch).

Compat: `ECCommit` and `ECEnsure` must carry a non-empty `compat` (the string producer
and consumer agree on, e.g. a hash of the model): one without is refused at the door.
An output is handed only to an ask under the compat it was committed with, by the
producer and from the consumer's cache alike. The EC region itself declares
`ec_region_compat(block_bytes)`, as every region declares one.
"""

from __future__ import annotations

import math
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Final, cast

import anyio
import anyio.lowlevel
import structlog
import zmq
import zmq.asyncio
from anyio.abc import TaskStatus
from kvd_client import wire
from kvd_client.ecindex import ECIndexWriter, index_slots
from kvd_client.errors import (
    AuthError,
    Busy,
    ErrorCode,
    Incompatible,
    InvalidRequest,
    KvdError,
    NotFound,
    RemoteProtocolError,
    ShuttingDown,
    Timeout,
    error_from_code,
)
from kvd_client.layout import block_major
from kvd_client.shm import SHM_DIR, SharedRegion, staging_name

from kvd.actors.base import Mailbox
from kvd.actors.gateway import bind_tcp, transport_cap
from kvd.actors.messages import (
    ClientRequest,
    ClockReading,
    EnsurePeer,
    EventOut,
    LocalRegion,
    LocalRegionsChanged,
    PeerClock,
    PeerInfo,
    PeerLost,
    PeerUpdated,
    RegisterDaemonRegion,
    SessionClosed,
    Snapshot,
    StartDrain,
)
from kvd.adapters.nixl import NixlEngine, PeerDisconnected, Unsettled
from kvd.adapters.resolve import Resolver, connect
from kvd.adapters.shm import pid_alive, reap_dead_creators, staging_creator_here
from kvd.adapters.zmq_monitor import watch_disconnects
from kvd.core.addresses import address_problem
from kvd.core.blockpool import BlockPool
from kvd.core.peerauth import (
    AUTH_WINDOW_S,
    NONCE_BYTES,
    Refusal,
    ReplayGuard,
    mac_valid,
    message_mac,
)
from kvd.core.planner import plan_transfer
from kvd.core.timeline import peer_now_latest_ns
from kvd.core.timers import TimerHeap
from kvd.logs import RejectLog

if TYPE_CHECKING:
    import asyncio

log = structlog.get_logger("kvd.ecrouter", actor="ecrouter")

EC_ENGINE: Final = "kvd-ec"
"""The engine id under which a daemon's EC region appears to its peers."""


EC_SEGMENT_PREFIX: Final = "kvd-ec-"
EC_INDEX_SUFFIX: Final = ".idx"

EC_XFER_CONTEXT: Final = b"ecxfer"
"""Domain separation of an `ECXferReq`'s MAC from the MACs of other peer messages."""

EC_ACK_CONTEXT: Final = b"ecack"
"""Domain separation of an `ECXferAck`'s MAC (followed by its request's nonce)."""

EC_CANCEL_CONTEXT: Final = b"eccancel"
"""Domain separation of an `ECXferCancel`'s MAC."""

CANCEL_EVERY_S: Final = 1.0
"""A consumer sends an `ECXferCancel` for each quarantined fetch this often, until the
producer answers or the quarantine's bound passes."""

EC_UNSETTLED_MAX: Final = 4096
"""Requests whose WRITE UCX had not ended when given up on, remembered by a producer so
that it never answers a cancel of one (beyond this many it answers no cancel at all)."""

CLOCK_MAX_AGE_S: Final = 300.0
"""A consumer's clock offset older than this is measured again before a request of its is
judged (the drift allowed for it grows with its age: `kvd.core.timeline.DRIFT_PPM`)."""
EC_CLOCKS_MAX: Final = 4096
"""Consumers whose clock offset the EC router keeps at hand."""
QUARANTINE_MARGIN_S: Final = 5.0
"""Room, past a producer's settle bound, for its answer to reach us."""
_QUARANTINE: Final = "\0quarantine:"
"""Deadline keys of quarantined fetches (mm_hashes are the other keys)."""
_CANCEL: Final = "\0cancel:"
"""Timer keys of a quarantined fetch's next `ECXferCancel`."""
_ORPHAN: Final = "\0orphan:"
"""Deadline keys of the next check of an orphaned allocation's client."""
_SWEEP: Final = "\0sweep"
"""Timer key of the next look for sockets to producers idle for `dealer_idle`."""
ORPHAN_CHECK_S: Final = 1.0
"""Seconds between checks whether the client of an orphaned allocation is gone."""
ORPHAN_UNKNOWN_S: Final = 300.0
"""How long the blocks of an orphaned allocation whose client's pid is unknown stay out
of use (a client that never said its pid: no check can tell when it is gone)."""
EC_NONCES_MAX: Final = 1 << 18
"""Nonces of served requests a producer remembers (about 70 MiB at most). Each is kept
until its request is stale (at most twice `AUTH_WINDOW_S`): room for over 1,000
requests a second. Beyond that, requests are refused BUSY until some go stale."""

EC_NEEDS_COMPAT: Final = (
    "compat must identify the model and the encoder output's format: producer and "
    "consumer pass the same non-empty string (the vLLM connector: "
    "kvd_client.vllm.ec.ec_compat)"
)


def ec_region_compat(block_bytes: int) -> str:
    """The compat of a daemon's EC region, derived from what it is: kvd's EC region of
    raw bytes, and its block size (all that two EC regions must share). It never equals
    a KV region's `compat_hash`, so no KV request can pair with an EC region."""
    return f"{EC_ENGINE}:block_bytes={block_bytes}"


def ec_segment_name() -> str:
    """`kvd-ec-n<pid namespace>-p<pid>-<hex>`: a staging name (`kvd_client.shm.staging_name`),
    so the leftover rule can judge it; its index is the same name plus `.idx`."""
    return staging_name("ec")


def ec_segment_creator(name: str) -> int | None:
    """The pid of the daemon that made an EC segment or its index, when it lived in our pid
    namespace; None for any other name (the rule does not judge it)."""
    if not name.startswith(EC_SEGMENT_PREFIX):
        return None
    return staging_creator_here(name.removesuffix(EC_INDEX_SUFFIX))


def reap_stale_segments(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink EC segments (and indexes) that daemons which died without cleanup left
    (`kvd.adapters.shm.reap_dead_creators`): a consumer engine that still maps one keeps
    its mapping and learns the new daemon's region when it reconnects. Blocking IO: run
    it in a worker thread."""
    removed = reap_dead_creators(ec_segment_creator, shm_dir)
    for name, pid in removed.items():
        log.info("ec_stale_segment_removed", segment=name, creator_pid=pid)
    return list(removed)


@dataclass
class _Produced:
    nbytes: int
    committed: bool = False
    params: wire.ECParams | None = None
    session: str = ""
    """The session that allocated it (until its commit, the allocation is that session's)."""
    orphan_pid: int = 0
    """Its session ended without committing it while its client may still write into
    the blocks (it stopped pinging: frozen, starved): this pid. The blocks stay out of use
    until that process is gone (`ORPHAN_CHECK_S`)."""


@dataclass
class _Fetch:
    mm_hash: str
    producer: tuple[str, int]
    nbytes: int
    compat: str
    waiters: list[str] = field(default_factory=list)
    nonce: bytes = b""
    """The nonce of our request: its ack names it (and is MACed under it with a secret)."""
    serve_by_ns: int = 0
    """Our request's `serve_by_ns`: the producer starts no WRITE for it after that."""


@dataclass(frozen=True)
class _Quarantined:
    """A fetch given up on whose blocks a WRITE of the producer may still reach."""

    nonce: bytes
    producer: tuple[str, int]
    serve_by_ns: int


class ECRouter:
    def __init__(
        self,
        *,
        engine: NixlEngine,
        mailbox: Mailbox[Any],
        registrar: Mailbox[Any],
        emit: Callable[[EventOut], None],
        role: str,
        host: str,
        advertise_host: str,
        port: int,
        region_bytes: int,
        block_bytes: int,
        xfer_timeout: float,
        dealer_idle: float = 300.0,
        settle_timeout: float,
        side_host: str,
        side_port_ref: Callable[[], int],
        max_frame: int,
        secret: bytes | None,
        counters: dict[str, int],
        rejects: RejectLog,
        incarnation: int = 0,
        wall_clock: Callable[[], float] = time.time,
        mono_ns: Callable[[], int] = time.monotonic_ns,
        resolver: Resolver | None = None,
    ) -> None:
        self.on_input: Callable[[], None] = _nothing
        """Called on every frame received (the daemon sets it to `NixlEngine.poke`: an
        idle NIXL thread polls quickly again as soon as anything comes in)."""
        """`mono_ns`: the clock of a request's `serve_by_ns` (the daemon's trace clock, the
        one its side channel stamps in the clock exchange)."""
        self.engine = engine
        self.mono_ns = mono_ns
        self.resolver = resolver or Resolver()
        """Producers' host names, resolved off libzmq's I/O thread (`kvd.adapters.resolve`)."""
        self._clocks: dict[str, tuple[int, ClockReading]] = {}
        """Consumers' clock offsets as the registrar measured them, by agent: (its
        incarnation, the reading), so a cold fetch costs no registrar call."""
        self.incarnation = incarnation
        """This daemon's incarnation: a consumer names it in its requests."""
        self._views: dict[str, PeerInfo] = {}
        """Peers' handshake views as the registrar publishes them (`PeerUpdated`), by
        agent: a producer serves a request through the one it holds when the request names
        that view's incarnation and address (`_held_view`), without a registrar call."""
        self.mailbox = mailbox
        self.clock = mailbox.clock
        self.registrar = registrar
        self.emit = emit
        self.role = role
        self.host = host
        self.advertise_host = advertise_host
        self.port = port
        self.region_bytes = region_bytes
        self.block_bytes = block_bytes
        self.xfer_timeout = xfer_timeout
        # What bounds a producer's WRITE we gave up on: its own deadline, then UCX's
        # settle bound (kvd.adapters.nixl), with room for its answer. This covers a WRITE
        # started within `xfer_timeout` of the request's send time: the request says so
        # (`serve_by_ns`), and the producer refuses one it cannot prove younger (a
        # request queued in ZMQ behind a cut link).
        self.quarantine_s = xfer_timeout + 2 * settle_timeout + 1.0 + QUARANTINE_MARGIN_S
        self.quarantined: dict[str, _Quarantined] = {}
        """Fetches given up on whose blocks may still be written, by hash."""
        self.serving_nonces: set[bytes] = set()
        """Producer: the nonces of the requests being served (read, not yet answered)."""
        self.unsettled: dict[bytes, float] = {}
        """Producer: nonces of requests given up on while UCX had not ended their WRITE
        (never answered, nor their cancels), with when (mailbox clock); forgotten after
        `quarantine_s`, past which no consumer of ours holds their blocks."""
        self.side_host = side_host
        self._side_port_ref = side_port_ref
        self.max_frame = max_frame
        self.secret = secret
        self.wall_clock = wall_clock
        # A request made before we started may have been served by our predecessor.
        self.replays = ReplayGuard(AUTH_WINDOW_S, EC_NONCES_MAX, not_before=wall_clock())
        self.counters = counters
        self.rejects = rejects
        self.serving = 0
        """Consumers' requests being served now (each a task): at most `mailbox.size`."""
        self.draining = False
        """`kvd drain`: no new transfer either way (local hits and local outputs go on)."""
        self._drains: list[StartDrain] = []
        nblocks = region_bytes // block_bytes
        self.producing = role in ("producer", "both")
        self.consuming = role in ("consumer", "both")
        split = nblocks // 2 if (self.producing and self.consuming) else nblocks
        self.prod_pool = BlockPool(split, "fifo") if self.producing else None
        self.cons_pool = (
            BlockPool(nblocks - split if self.producing else nblocks, "lru")
            if self.consuming
            else None
        )
        self.cons_offset = split if (self.producing and self.consuming) else 0
        self.region: SharedRegion | None = None
        self.index: ECIndexWriter | None = None
        self.local: LocalRegion | None = None
        self.produced: dict[str, _Produced] = {}
        self.fetches: dict[str, _Fetch] = {}
        self.deadlines: TimerHeap[str] = TimerHeap()
        self.cached_nbytes: dict[str, int] = {}
        self.cached_compat: dict[str, str] = {}
        self.pins: dict[str, Counter[str]] = {}
        self.dealers: dict[tuple[str, int], zmq.asyncio.Socket] = {}
        """Sockets to producers, by (numeric address, port)."""
        self.dealer_of: dict[tuple[str, int], tuple[str, int]] = {}
        """A producer as requests name it (host, port) -> its socket's key in `dealers`."""
        self.dealer_idle = dealer_idle
        """`ec.producer_socket_idle`: a socket to a producer that no fetch or quarantine
        needs and that sent nothing for this long is closed (a producer restarted at
        another address is never named again, and ZMQ would redial the old one for good);
        the next fetch from there opens another."""
        self.dealer_used: dict[tuple[str, int], float] = {}
        """When each socket in `dealers` last sent (daemon time)."""
        self._dealer_readers: dict[tuple[str, int], anyio.CancelScope] = {}
        self._router: zmq.asyncio.Socket | None = None
        self._tg: anyio.abc.TaskGroup | None = None
        self.trace = engine.trace
        """Stages of a fetch are recorded under its mm_hash (`kvd bench --only ec`)."""
        self.hits = self.misses = self.client_hits = 0

    @property
    def enabled(self) -> bool:
        return self.role != "none"

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    # ---------------------------------------------------------------- lifecycle

    def bind(self) -> int:
        """Bind the producer ROUTER (before ready); returns the port (0 when not a producer)."""
        if not self.producing:
            return 0
        sock = zmq.asyncio.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, transport_cap(self.max_frame))
        self.port = bind_tcp(sock, self.host, self.port, "ec.port")
        self._router = sock
        return self.port

    def busy(self) -> bool:
        """Whether a fetch waits for a producer's WRITE into our region, or a quarantined
        one still may land (read from the NIXL thread too: plain reads of our tables)."""
        return bool(self.fetches or self.quarantined)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        if self.enabled:
            try:
                await anyio.to_thread.run_sync(reap_stale_segments)
            except OSError as exc:
                log.warning("ec_stale_segment_reap_failed", error=str(exc))
            name = ec_segment_name()
            self.region = SharedRegion(name, self.region_bytes)
            if self.cons_pool is not None:
                self.index = ECIndexWriter(
                    f"{name}{EC_INDEX_SUFFIX}",
                    index_slots(self.cons_pool.num_blocks),
                    name,
                    self.region_bytes,
                    self.block_bytes,
                )
            nblocks = self.region_bytes // self.block_bytes
            layout = block_major(
                nblocks,
                1,
                self.block_bytes,
                kv_parts=1,
                tokens_per_block=1,
                dtype="uint8",
                kv_layout="EC",
            )
            reg = wire.RegisterRegion(
                kind="shm",
                name=name,
                nbytes=self.region_bytes,
                engine_id=EC_ENGINE,
                tp_rank=0,
                tp_size=1,
                layout=layout,
                compat=ec_region_compat(self.block_bytes),
                ipc_handle=b"",
                device=-1,
            )
            self.local = await self.registrar.call(RegisterDaemonRegion(reg))
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                if self._router is not None:
                    tg.start_soon(self._serve_router)
                    tg.start_soon(watch_disconnects, self._router, self._disconnected)
                task_status.started()
                while True:
                    msg: Any = await self.mailbox.receive_before(self.deadlines.next_time())
                    if msg is not None:
                        self._dispatch(msg)
                    for key, _ in self.deadlines.pop_due(self.clock.now()):
                        if key.startswith(_QUARANTINE):
                            self._unquarantine(key[len(_QUARANTINE) :], "bound")
                        elif key.startswith(_CANCEL):
                            self._send_cancel(key[len(_CANCEL) :])
                        elif key.startswith(_ORPHAN):
                            self._check_orphan(key[len(_ORPHAN) :])
                        elif key == _SWEEP:
                            self._sweep_dealers()
                        else:
                            self._fetch_timed_out(key)
        finally:
            if self._router is not None:
                self._router.close(0)
            for d in self.dealers.values():
                d.close(0)

    def close(self) -> None:
        """Unlink the EC region (after the registrar deregistered it) and its index."""
        if self.index is not None:
            self.index.close()
            self.index = None
        if self.region is not None:
            self.region.close()
            self.region = None

    # ---------------------------------------------------------------- dispatch

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, ClientRequest):
            try:
                self._client(msg)
            except KvdError as exc:
                self.rejects.reject(
                    "ecrouter",
                    "ec_requests_rejected",
                    "ec_request_rejected",
                    type(exc).__name__,
                    session=msg.session,
                    error=exc.message,
                )
                msg.fail(exc)
        elif isinstance(msg, LocalRegionsChanged):
            self.local = msg.regions.get((EC_ENGINE, 0), self.local)
        elif isinstance(msg, PeerUpdated):
            if not self.producing:
                pass  # only a producer serves through peers' views
            elif msg.info is None:
                self._views.pop(msg.agent, None)
            else:
                self._views[msg.agent] = msg.info
        elif isinstance(msg, SessionClosed):
            self._drop_allocations(msg)
            for mm_hash, n in self.pins.pop(msg.session, Counter()).items():
                for _ in range(n):
                    self._unpin_consumer(mm_hash)
            for f in self.fetches.values():
                f.waiters = [w for w in f.waiters if w != msg.session]
            msg.resolve(None)
        elif isinstance(msg, Snapshot):
            msg.resolve(self.in_flight() if msg.section == "drain" else self.snapshot())
        elif isinstance(msg, StartDrain):
            if not self.draining:
                self.draining = True
                log.info("ec_drain_started", serving=self.serving, fetching=len(self.fetches))
            self._drains.append(msg)
            self._check_drained()
        else:
            raise TypeError(f"ecrouter got {type(msg).__name__}")

    def _drop_allocations(self, msg: SessionClosed) -> None:
        """The outputs a closed session allocated and never committed: freed (their blocks
        pinned for its writes would otherwise stay pinned for a party that is gone, and
        their hashes could never be allocated again), or, where its client may still write
        into them (it stopped pinging), kept out of use until its process is gone."""
        pool = self.prod_pool
        if pool is None:
            return
        for mm_hash, p in list(self.produced.items()):
            if p.session != msg.session or p.committed or p.orphan_pid:
                continue
            if msg.timed_out:
                p.orphan_pid = msg.pid or -1
                self._count("ec_allocations_orphaned")
                wait = ORPHAN_CHECK_S if msg.pid else ORPHAN_UNKNOWN_S
                self.deadlines.set(_ORPHAN + mm_hash, self.clock.now() + wait)
                log.info("ec_allocation_orphaned", mm_hash=mm_hash, pid=msg.pid)
                continue
            self._free_allocation(mm_hash)
            log.info("ec_allocation_dropped", mm_hash=mm_hash, session=msg.session)

    def _check_orphan(self, mm_hash: str) -> None:
        p = self.produced.get(mm_hash)
        if p is None or not p.orphan_pid:
            return
        if p.orphan_pid > 0 and pid_alive(p.orphan_pid):
            self.deadlines.set(_ORPHAN + mm_hash, self.clock.now() + ORPHAN_CHECK_S)
            return
        self._free_allocation(mm_hash)
        log.info("ec_orphan_freed", mm_hash=mm_hash, pid=p.orphan_pid)

    def _free_allocation(self, mm_hash: str) -> None:
        pool = self.prod_pool
        assert pool is not None
        del self.produced[mm_hash]
        if mm_hash in pool:
            pool.unpin(mm_hash)
            pool.free(mm_hash)
        self._count("ec_allocations_dropped")

    def in_flight(self) -> dict[str, Any]:
        """What a drain waits for: requests this producer serves, fetches this consumer
        waits on (a fetch given up on and quarantined is not waited for: its waiters were
        told, only the daemon's own blocks wait for the producer's answer)."""
        return {
            "count": self.serving + len(self.fetches),
            "serving": self.serving,
            "fetching": len(self.fetches),
        }

    def _check_drained(self) -> None:
        if self._drains and self.serving == 0 and not self.fetches:
            for call in self._drains:
                call.resolve(None)
            self._drains.clear()

    def _client(self, req: ClientRequest) -> None:
        m = req.msg
        if not self.enabled:
            raise InvalidRequest("this daemon has no encoder cache (ec.role = none)")
        if isinstance(m, wire.ECAllocate):
            pool = self._need(self.prod_pool, "producer")
            if m.mm_hash in self.produced:
                raise InvalidRequest(f"{m.mm_hash!r} is already allocated")
            n = math.ceil(m.nbytes / self.block_bytes)
            alloc = pool.allocate(m.mm_hash, n, pin=True)
            for key in alloc.evicted:
                self.produced.pop(key, None)
            self._count("ec_evicted", len(alloc.evicted))
            self.produced[m.mm_hash] = _Produced(m.nbytes, session=req.session)
            assert self.region is not None
            req.resolve(
                wire.ECBlocks(m.mm_hash, tuple(alloc.blocks), self.block_bytes, self.region.name)
            )
        elif isinstance(m, wire.ECCommit):
            pool = self._need(self.prod_pool, "producer")
            if not m.compat:
                raise InvalidRequest(EC_NEEDS_COMPAT)
            p = self.produced.get(m.mm_hash)
            if p is None:
                raise NotFound(f"{m.mm_hash!r} was not allocated (or was evicted)")
            if p.committed:
                raise InvalidRequest(f"{m.mm_hash!r} is already committed")
            if m.nbytes > p.nbytes:
                raise InvalidRequest(f"commit of {m.nbytes} bytes exceeds the {p.nbytes} allocated")
            p.nbytes = m.nbytes
            p.committed = True
            if p.orphan_pid:  # its client came back and wrote it: its bytes are intact
                p.orphan_pid = 0
                self.deadlines.discard(_ORPHAN + m.mm_hash)
            p.params = wire.ECParams(
                m.mm_hash,
                self.advertise_host,
                self.port,
                m.nbytes,
                m.shape,
                m.dtype,
                m.modality,
                m.compat,
            )
            pool.unpin(m.mm_hash)
            self._count("ec_committed")
            req.resolve(p.params)
        elif isinstance(m, wire.ECEnsure):
            self._need(self.cons_pool, "consumer")
            if not m.compat:
                raise InvalidRequest(EC_NEEDS_COMPAT)
            req.resolve(wire.Ok())
            self._ensure(req.session, m)
        elif isinstance(m, wire.ECHits):
            pool = self._need(self.cons_pool, "consumer")
            # hits a client served from the index: counted, and made recent (a hit on an
            # output evicted since still happened; it just has no recency to refresh)
            n = len(m.mm_hashes)
            self.hits += n
            self.client_hits += n
            self._count("ec_hits", n)
            self._count("ec_hits_client", n)
            for mm_hash in m.mm_hashes:
                if mm_hash in self.cached_nbytes:
                    pool.get(mm_hash)
            req.resolve(wire.Ok())
        elif isinstance(m, wire.ECRelease):
            self._need(self.cons_pool, "consumer")
            held = self.pins.get(req.session)
            if not held or held[m.mm_hash] <= 0:
                raise InvalidRequest(f"{m.mm_hash!r} is not held by this session")
            held[m.mm_hash] -= 1
            self._unpin_consumer(m.mm_hash)
            req.resolve(wire.Ok())
        else:
            raise TypeError(f"ecrouter got {type(m).__name__}")

    @staticmethod
    def _need(pool: BlockPool | None, role: str) -> BlockPool:
        if pool is None:
            raise InvalidRequest(f"this daemon is not an encoder-cache {role}")
        return pool

    # ---------------------------------------------------------------- consumer

    def _ensure(self, session: str, m: wire.ECEnsure) -> None:
        pool = self.cons_pool
        assert pool is not None
        if m.mm_hash in self.cached_nbytes:
            if not self._same_compat(session, m, self.cached_compat[m.mm_hash], "cached"):
                return
            self.hits += 1
            self._count("ec_hits")
            self._ready(session, m.mm_hash, local_hit=True)
            return
        f = self.fetches.get(m.mm_hash)
        if f is not None:
            if not self._same_compat(session, m, f.compat, "being fetched"):
                return
            f.waiters.append(session)
            return
        if self.draining:  # joining a fetch in flight (above) is no new transfer
            down = ShuttingDown("this kvd daemon is draining: it starts no new fetch")
            self._count("ec_fetches_refused_draining")
            self._count("ec_unavailable")
            self.emit(
                EventOut(session, "", wire.ECUnavailable(m.mm_hash, int(down.code), down.message))
            )
            return
        if m.mm_hash in self.quarantined:
            busy = Busy(f"{m.mm_hash!r}: an earlier fetch of it is not settled yet")
            self._count("ec_unavailable")
            self.emit(
                EventOut(session, "", wire.ECUnavailable(m.mm_hash, int(busy.code), busy.message))
            )
            return
        self.misses += 1
        self._count("ec_misses")
        n = math.ceil(m.nbytes / self.block_bytes)
        try:
            alloc = pool.allocate(m.mm_hash, n, pin=True)
        except KvdError as exc:
            self.emit(
                EventOut(session, "", wire.ECUnavailable(m.mm_hash, int(exc.code), exc.message))
            )
            self._count("ec_unavailable")
            return
        for key in alloc.evicted:
            self.cached_nbytes.pop(key, None)
            self.cached_compat.pop(key, None)
            if self.index is not None:
                # before the blocks are handed to this fetch (its request is sent later):
                # a client copying the evicted output now fails its check
                self.index.retract(key)
        self._count("ec_evicted", len(alloc.evicted))
        f = _Fetch(m.mm_hash, (m.peer_host, m.peer_port), m.nbytes, m.compat, [session])
        self.fetches[m.mm_hash] = f
        self.deadlines.set(m.mm_hash, self.clock.now() + self.xfer_timeout)
        assert self._tg is not None and self.local is not None
        req = wire.ECXferReq(
            mm_hash=m.mm_hash,
            compat=m.compat,
            agent_name=self.engine.name,
            side_host=self.side_host,
            side_port=self._side_port_ref(),
            dst_region=self.local.region_id,
            dst_generation=self.local.generation,
            dst_block_ids=tuple(b + self.cons_offset for b in alloc.blocks),
            timestamp=self.wall_clock(),
            nonce=os.urandom(NONCE_BYTES),
            serve_by_ns=self.mono_ns() + int(self.xfer_timeout * 1e9),
            incarnation=self.incarnation,
        )
        f.nonce, f.serve_by_ns = req.nonce, req.serve_by_ns
        if self.secret is not None:
            req = replace(req, mac=message_mac(self.secret, req, EC_XFER_CONTEXT))
        self._send_req(f.producer, req)

    def _same_compat(self, session: str, m: wire.ECEnsure, held: str, how: str) -> bool:
        """Whether an output cached or being fetched under `held` may answer `m`.

        The consumer holds one output per hash, under the compat it was fetched with;
        an ask under another compat is refused (naming both), never handed those bytes.
        """
        if held == m.compat:
            return True
        exc = Incompatible(
            f"encoder output compatibility differs: {how} under {held!r} "
            f"vs asked under {m.compat!r}"
        )
        self._count("ec_compat_refused")
        self._count("ec_unavailable")
        log.info("ec_compat_refused", mm_hash=m.mm_hash, held=held, asked=m.compat)
        self.emit(EventOut(session, "", wire.ECUnavailable(m.mm_hash, int(exc.code), exc.message)))
        return False

    def _ready(self, session: str, mm_hash: str, *, local_hit: bool) -> None:
        pool = self.cons_pool
        assert pool is not None
        blocks = pool.get(mm_hash)
        assert blocks is not None
        pool.pin(mm_hash)
        self.pins.setdefault(session, Counter())[mm_hash] += 1
        ids = tuple(b + self.cons_offset for b in blocks)
        self.emit(
            EventOut(
                session, "", wire.ECReady(mm_hash, ids, self.cached_nbytes[mm_hash], local_hit)
            )
        )

    def _unpin_consumer(self, mm_hash: str) -> None:
        pool = self.cons_pool
        if pool is not None and mm_hash in pool and pool.is_pinned(mm_hash):
            pool.unpin(mm_hash)

    def _fetch_done(self, ack: wire.ECXferAck) -> None:
        f = self.fetches.get(ack.mm_hash)
        if f is None or ack.nonce != f.nonce:
            # the producer's answer to a request we gave up on (its WRITE is over), or to
            # our cancel of it (it will never serve it)
            q = self.quarantined.get(ack.mm_hash)
            if (
                q is not None
                and ack.nonce == q.nonce
                and (self.secret is None or mac_valid(self.secret, ack, EC_ACK_CONTEXT + q.nonce))
            ):
                self._unquarantine(ack.mm_hash, "answered")
                return
            # another request's answer (one given up on and released, under this hash
            # or not), or a forged one: never taken for the fetch in flight
            self._count("ec_acks_unexpected")
            return
        if (
            self.secret is not None
            and ack.ok
            and not mac_valid(self.secret, ack, EC_ACK_CONTEXT + f.nonce)
        ):
            # Only the producer may say the bytes are there. A refusal without a valid MAC
            # is taken: a producer that cannot check our request cannot MAC its answer
            # either, and a forged refusal only costs a local encode.
            self.rejects.reject(
                "ecrouter",
                "ec_auth_rejected",
                "ec_ack_auth_rejected",
                "ack_bad_mac",
                mm_hash=ack.mm_hash,
                producer=f"{f.producer[0]}:{f.producer[1]}",
            )
            return
        del self.fetches[ack.mm_hash]
        self.deadlines.discard(ack.mm_hash)
        self._check_drained()
        pool = self.cons_pool
        assert pool is not None
        if not ack.ok:
            self._fetch_failed_entry(f, error_from_code(ack.code, ack.reason))
            return
        self.cached_nbytes[f.mm_hash] = f.nbytes
        self.cached_compat[f.mm_hash] = f.compat
        pool.unpin(f.mm_hash)  # the transfer's pin; each waiter takes its own
        if self.index is not None:
            blocks = pool.get(f.mm_hash)
            assert blocks is not None
            self.index.publish(
                f.mm_hash, f.compat, [b + self.cons_offset for b in blocks], f.nbytes
            )
        self._count("ec_fetched")
        self._count("ec_bytes_fetched", f.nbytes)
        if self.trace.on:
            self.trace.mark(f.mm_hash, "ec.ready")
        for session in f.waiters:
            self._ready(session, f.mm_hash, local_hit=False)

    def _fetch_failed(self, mm_hash: str, exc: KvdError) -> None:
        f = self.fetches.pop(mm_hash, None)
        if f is not None:
            self.deadlines.discard(mm_hash)
            self._fetch_failed_entry(f, exc)
            self._check_drained()

    def _fetch_timed_out(self, mm_hash: str) -> None:
        """No answer in time: the waiters are told at once, but the blocks are
        quarantined, not freed: the producer may still WRITE into them (a request queued
        while the link was down, a WRITE UCX has not ended: NIXL cannot cancel one). They
        are freed when the producer's answer to that request arrives (it answers only once
        its WRITE ended), or after `quarantine_s`."""
        f = self.fetches.pop(mm_hash, None)
        if f is None:
            return
        self._count("ec_quarantined")
        self.quarantined[mm_hash] = _Quarantined(f.nonce, f.producer, f.serve_by_ns)
        now = self.clock.now()
        self.deadlines.set(_QUARANTINE + mm_hash, now + self.quarantine_s)
        self.deadlines.set(_CANCEL + mm_hash, now)
        exc = Timeout(f"no answer from the producer in {self.xfer_timeout}s")
        self._fetch_failed_entry(f, exc, free=False)
        self._check_drained()

    def _unquarantine(self, mm_hash: str, why: str) -> None:
        if self.quarantined.pop(mm_hash, None) is None:
            return
        self.deadlines.discard(_QUARANTINE + mm_hash)
        self.deadlines.discard(_CANCEL + mm_hash)
        self._count(f"ec_quarantine_released_{why}")
        pool = self.cons_pool
        assert pool is not None
        if mm_hash in pool:
            pool.unpin(mm_hash)
            pool.free(mm_hash)

    def _send_cancel(self, mm_hash: str) -> None:
        """Ask the producer of a quarantined fetch to say that nothing of its request will
        be written (`wire.ECXferCancel`), and again in `CANCEL_EVERY_S`. Only once our
        clock has passed the request's `serve_by_ns`: from then on the producer refuses
        it, so one that is not serving it may answer. A producer that is frozen, cut off
        or gone gets them queued (or dropped when its queue is full) and answers when it
        reads one; a restarted one answers at once (it serves nothing of the old one's)."""
        q = self.quarantined.get(mm_hash)
        if q is None:
            return
        early_s = (q.serve_by_ns - self.mono_ns()) / 1e9
        self.deadlines.set(_CANCEL + mm_hash, self.clock.now() + max(early_s, CANCEL_EVERY_S))
        key = self.dealer_of.get(q.producer)
        sock = self.dealers.get(key) if key is not None else None
        if early_s > 0 or sock is None:
            return
        cancel = wire.ECXferCancel(mm_hash, q.nonce)
        if self.secret is not None:
            cancel = replace(cancel, mac=message_mac(self.secret, cancel, EC_CANCEL_CONTEXT))
        sent = cast("asyncio.Future[Any]", sock.send(wire.encode(cancel), flags=zmq.NOBLOCK))
        if not sent.done():  # cannot happen with NOBLOCK; never leave it hanging
            sent.cancel()
        elif sent.exception() is None:
            self._count("ec_cancels_sent")

    def _fetch_failed_entry(self, f: _Fetch, exc: KvdError, *, free: bool = True) -> None:
        pool = self.cons_pool
        assert pool is not None
        if free and f.mm_hash in pool:
            pool.unpin(f.mm_hash)
            pool.free(f.mm_hash)
        self._count("ec_unavailable")
        log.warning(
            "ec_fetch_failed",
            mm_hash=f.mm_hash,
            producer=f"{f.producer[0]}:{f.producer[1]}",
            error=exc.message,
        )
        for session in f.waiters:
            self.emit(
                EventOut(session, "", wire.ECUnavailable(f.mm_hash, int(exc.code), exc.message))
            )

    def _send_req(self, producer: tuple[str, int], req: wire.ECXferReq) -> None:
        """Send at once, from the handler that allocated the blocks: no task and no await
        (measured: a task and an awaited send cost ~0.8 ms of a cold fetch on a busy
        2-core host). A DEALER queues for a producer not yet connected; one whose queue
        is full fails the fetch BUSY instead of waiting.

        The send goes through the asyncio socket with NOBLOCK, not awaited: pyzmq sends
        it within the call and then wakes the task waiting in `_recv_acks` if the send
        consumed the socket's (edge-triggered) readiness. A send on a shadow socket
        would not, and acks would wait for the next wakeup (measured: fetches timed out)."""
        address = self.resolver.cached(producer[0])
        if address is None:  # a name not resolved lately: first resolved, in a task
            assert self._tg is not None
            self._tg.start_soon(self._resolve_then_send, producer, req)
            return
        # one DEALER per address, not per name: a name that resolves elsewhere now (a
        # producer restarted on another address) gets a socket to where it is
        key = (address, producer[1])
        sock = self.dealers.get(key)
        if sock is None:
            sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.MAXMSGSIZE, self.max_frame)
            connect(sock, address, producer[1])
            self.dealers[key] = sock
            scope = self._dealer_readers[key] = anyio.CancelScope()
            assert self._tg is not None
            self._tg.start_soon(self._recv_acks, producer, sock, scope)
            if _SWEEP not in self.deadlines:
                self.deadlines.set(_SWEEP, self.clock.now() + self.dealer_idle)
        self.dealer_of[producer] = key
        self.dealer_used[key] = self.clock.now()
        frame = wire.encode(req)
        if self.trace.on:  # before: on a busy host the thread may lose its core in the send
            self.trace.mark(req.mm_hash, "ec.request_sent")
        sent = cast("asyncio.Future[Any]", sock.send(frame, flags=zmq.NOBLOCK))
        exc = sent.exception() if sent.done() else None
        if not sent.done():  # cannot happen with NOBLOCK; never leave it hanging
            sent.cancel()
            exc = zmq.Again()
        if isinstance(exc, zmq.Again):
            self._fetch_failed(req.mm_hash, Busy("the producer's request queue is full"))
            return
        if exc is not None:
            self._fetch_failed(req.mm_hash, KvdError(f"cannot reach producer: {exc}"))
            return
        self._count("ec_xfer_requests")

    async def _resolve_then_send(self, producer: tuple[str, int], req: wire.ECXferReq) -> None:
        """A producer named by a host name not resolved yet: resolve it (within the fetch's
        timeout), then send; a name with no address fails the fetch."""
        failed: KvdError | None = None
        try:
            await self.resolver.resolve(producer[0], self.xfer_timeout)
        except KvdError as exc:
            failed = exc
        f = self.fetches.get(req.mm_hash)
        if f is None or f.nonce != req.nonce:
            return  # it ended meanwhile (its deadline)
        if failed is not None:
            self._fetch_failed(req.mm_hash, failed)
        else:
            self._send_req(producer, req)

    def _sweep_dealers(self) -> None:
        """Close the sockets to producers that no fetch or quarantine needs and that sent
        nothing for `dealer_idle` (`ec_dealers_closed`)."""
        now = self.clock.now()
        producers = [f.producer for f in self.fetches.values()]
        producers += [q.producer for q in self.quarantined.values()]
        needed = {self.dealer_of.get(p) for p in producers}
        for key in list(self.dealers):
            if key in needed or now - self.dealer_used.get(key, now) < self.dealer_idle:
                continue
            self._dealer_readers.pop(key).cancel()
            self.dealers.pop(key).close(0)
            self.dealer_used.pop(key, None)
            for p in [p for p, k in self.dealer_of.items() if k == key]:
                del self.dealer_of[p]
            self._count("ec_dealers_closed")
        if self.dealers:
            self.deadlines.set(_SWEEP, now + self.dealer_idle / 4)

    async def _recv_acks(
        self, producer: tuple[str, int], sock: zmq.asyncio.Socket, scope: anyio.CancelScope
    ) -> None:
        with scope:  # (cancelled when the socket is swept: `_sweep_dealers`)
            while True:
                await anyio.lowlevel.checkpoint()  # a ready frame is received without suspending
                frame = await sock.recv()
                self.on_input()
                try:
                    _, msg = wire.decode(frame, self.max_frame)
                except RemoteProtocolError as exc:
                    self._ack_malformed(producer, type(exc).__name__, exc.message)
                    continue
                if not isinstance(msg, wire.ECXferAck):
                    self._ack_malformed(
                        producer, "not_an_ack", f"{type(msg).__name__} is not an ack"
                    )
                    continue
                if self.trace.on:
                    self.trace.mark(msg.mm_hash, "ec.ack_received")
                # Handled here, not posted to our mailbox (measured: the hop cost ~0.1 ms of a
                # cold fetch): this task is the actor's own, on its loop, and `_fetch_done`
                # does not await, so it never interleaves with the mailbox's handler.
                self._fetch_done(msg)

    def _ack_malformed(self, producer: tuple[str, int], kind: str, why: str) -> None:
        self.rejects.reject(
            "ecrouter",
            "ec_acks_malformed",
            "ec_ack_malformed",
            kind,
            producer=f"{producer[0]}:{producer[1]}",
            error=why,
        )

    # ---------------------------------------------------------------- producer

    async def _serve_router(self) -> None:
        sock = self._router
        assert sock is not None and self._tg is not None
        while True:
            frames = await sock.recv_multipart()
            self.on_input()
            if len(frames) != 2:
                self._xfer_rejected("multipart", f"{len(frames) - 1} frames, expected 1")
            else:
                # Bad frames are dropped here, without a task each.
                try:
                    _, req = wire.decode(frames[1], self.max_frame)
                except RemoteProtocolError as exc:
                    self._xfer_rejected(type(exc).__name__, exc.message)
                else:
                    if isinstance(req, wire.ECXferCancel):
                        await self._cancel(frames[0], req)
                    elif not isinstance(req, wire.ECXferReq):
                        why = f"{type(req).__name__} is not an ECXferReq"
                        self._xfer_rejected("not_a_request", why)
                    else:
                        if self.trace.on:
                            self.trace.mark(req.mm_hash, "ec.request_received")
                        refused = self._admit(req)
                        if refused is None and self.draining:
                            refused = self._refuse_draining(req)
                        if refused is None and self.serving >= self.mailbox.size:
                            refused = self._busy(req)
                        if refused is None:
                            self.serving += 1
                            self.serving_nonces.add(req.nonce)
                            self._tg.start_soon(self._serve_one, frames[0], req)
                        else:
                            await self._ack(frames[0], refused, req.nonce)
            # A ready frame is received without suspending: without this, a consumer that
            # keeps the socket busy would starve every other task.
            await anyio.lowlevel.checkpoint()

    def _admit(self, req: wire.ECXferReq) -> wire.ECXferAck | None:
        """None if `req` may be served; else its refusal, counted and logged here.

        Without a shared secret every request may. With one, a request must prove the
        secret, be fresh and carry a nonce not seen before (`_auth_problem`). Synchronous:
        a nonce is taken before the next request is read, so two copies of one request
        can never both pass."""
        if self.secret is None:
            return None
        problem = self._auth_problem(self.secret, req)
        if problem is None:
            return None
        kind, exc = problem
        if isinstance(exc, AuthError):
            self.rejects.reject(
                "ecrouter",
                "ec_auth_rejected",
                "ec_xfer_auth_rejected",
                kind,
                mm_hash=req.mm_hash,
                peer=req.agent_name,
                error=exc.message,
            )
        else:
            self._xfer_failed(req.mm_hash, exc)
        return wire.ECXferAck(req.mm_hash, False, int(exc.code), exc.message, 0)

    def _refuse_draining(self, req: wire.ECXferReq) -> wire.ECXferAck:
        """A consumer's request while this producer drains: refused at once (the consumer
        encodes locally)."""
        exc = ShuttingDown("the encoder-cache producer is draining (going out of service)")
        self._count("ec_xfer_refused_draining")
        self._xfer_failed(req.mm_hash, exc)
        return wire.ECXferAck(req.mm_hash, False, int(exc.code), exc.message, 0)

    def _busy(self, req: wire.ECXferReq) -> wire.ECXferAck:
        """The refusal of a request beyond the ones served at once (`daemon.mailbox_size`):
        each waits on a handshake and a WRITE, so a flood would otherwise hold a task, a
        pin and a registrar call per request, without bound."""
        exc = Busy(f"the producer serves {self.serving} requests already (daemon.mailbox_size)")
        self._xfer_failed(req.mm_hash, exc)
        return wire.ECXferAck(req.mm_hash, False, int(exc.code), exc.message, 0)

    def _auth_problem(self, secret: bytes, req: wire.ECXferReq) -> tuple[str, KvdError] | None:
        """(kind, error) for a request that fails authentication, else None (its nonce is
        then taken). Only a request with a valid MAC reaches the replay guard."""
        if not req.mac:
            return "no_mac", AuthError("ECXferReq carries no MAC (a shared secret is set)")
        if not mac_valid(secret, req, EC_XFER_CONTEXT):
            return "bad_mac", AuthError("ECXferReq failed authentication")
        if len(req.nonce) < NONCE_BYTES:
            why = f"ECXferReq nonce has {len(req.nonce)} bytes, fewer than {NONCE_BYTES}"
            return "short_nonce", AuthError(why)
        now = self.wall_clock()
        refusal = self.replays.admit(req.nonce, req.timestamp, now)
        if refusal is None:
            return None
        if refusal is Refusal.STALE:
            return "stale", AuthError(
                f"ECXferReq is stale: its timestamp is {req.timestamp - now:+.1f}s from the "
                f"producer's clock (the limit is {AUTH_WINDOW_S:g}s)"
            )
        if refusal is Refusal.REPLAYED:
            return "replayed", AuthError("ECXferReq was already served (its nonce was seen)")
        return "replay_guard_full", Busy(
            f"{len(self.replays)} recent requests are held against replay; retry later"
        )

    def _held_view(self, req: wire.ECXferReq) -> PeerInfo | None:
        """The view of the consumer that `req` came from, if we hold it: the registrar's
        last word on that agent, of the incarnation the request names (a request that
        names none is not served from it), at the address the request gives, and
        describing the EC region and generation it names. Else None: the registrar is
        asked, as for a consumer never seen (it handshakes if its view is stale)."""
        info = self._views.get(req.agent_name)
        if (
            info is None
            or not req.incarnation
            or info.incarnation != req.incarnation
            or (info.host, info.port) != (req.side_host, req.side_port)
            or _consumer_mismatch(info, req) is not None
        ):
            return None
        return info

    async def _consumer_clock(self, info: PeerInfo, req: wire.ECXferReq) -> ClockReading:
        """The consumer's clock offset, to judge `req`'s deadline by; refuses (counted in
        `ec_xfer_age_unknown`) a request without one, or a consumer whose offset cannot be
        measured (whether it is in time cannot be known: never serve it then)."""
        why = "it carries no deadline"
        if req.serve_by_ns:
            known = self._clocks.get(info.agent)
            max_age_ns = CLOCK_MAX_AGE_S * 1e9
            if (
                known is not None
                and known[0] == info.incarnation
                and self.mono_ns() - known[1].measured_ns <= max_age_ns
            ):
                return known[1]
            try:
                reading = await self.registrar.call(PeerClock(info.agent, CLOCK_MAX_AGE_S))
            except KvdError as exc:
                why = f"the consumer's clock offset cannot be measured: {exc.message}"
            else:
                if len(self._clocks) >= EC_CLOCKS_MAX:
                    self._clocks.clear()  # forgotten ones are asked for again
                self._clocks[info.agent] = (info.incarnation, reading)
                return reading
        self._count("ec_xfer_age_unknown")
        raise Timeout(f"ECXferReq refused: whether it is in time cannot be judged ({why})")

    def _check_age(self, req: wire.ECXferReq, reading: ClockReading) -> None:
        """Refuse (counted in `ec_xfer_too_old`) a request whose consumer's clock may have
        passed its deadline (module docstring)."""
        latest = peer_now_latest_ns(self.mono_ns(), reading.offset, reading.measured_ns)
        if latest >= req.serve_by_ns:
            self._count("ec_xfer_too_old")
            raise Timeout(
                "ECXferReq is too old: the consumer's clock may read up to "
                f"{(latest - req.serve_by_ns) / 1e9:.3f}s past the request's deadline "
                f"(clock offset error {reading.offset.error_ns / 1e6:.3f} ms)"
            )

    def _xfer_failed(self, mm_hash: str, exc: KvdError) -> None:
        self.rejects.reject(
            "ecrouter",
            "ec_xfer_failed",
            "ec_xfer_failed",
            type(exc).__name__,
            mm_hash=mm_hash,
            error=exc.message,
        )

    async def _ack(self, ident: bytes, ack: wire.ECXferAck, nonce: bytes) -> None:
        # A ROUTER never blocks a send: a consumer that does not read loses its acks.
        assert self._router is not None
        ack = replace(ack, nonce=nonce)
        if self.secret is not None:
            ack = replace(ack, mac=message_mac(self.secret, ack, EC_ACK_CONTEXT + nonce))
        try:
            await self._router.send_multipart([ident, wire.encode(ack)])
        except zmq.ZMQError as exc:
            log.warning("ec_ack_send_failed", error=str(exc))

    def _xfer_rejected(self, kind: str, why: str) -> None:
        """A request that is not one: dropped (there is nothing to ack), counted, logged."""
        self.rejects.reject("ecrouter", "ec_xfer_rejected", "ec_xfer_malformed", kind, error=why)

    def _disconnected(self) -> None:
        # Consumers' connections closing, and connections libzmq dropped for a frame
        # above the transport cap: libzmq reports both alike (see zmq_monitor).
        self.rejects.reject(
            "ecrouter", "ec_disconnects", "ec_connection_lost", "disconnected", level="info"
        )

    async def _serve_one(self, ident: bytes, req: wire.ECXferReq) -> None:
        try:
            await self._serve(ident, req)
        finally:
            self.serving -= 1
            self.serving_nonces.discard(req.nonce)
            self._check_drained()

    async def _cancel(self, ident: bytes, cancel: wire.ECXferCancel) -> None:
        """A consumer gave up on its request `cancel.nonce` and holds its blocks until we
        say nothing of it will be written. Serving it: no answer now (its ack comes when
        its WRITE ended). Given up on while UCX had not ended its WRITE: never answered
        (the consumer's quarantine runs to its bound). Else, answered TIMEOUT: the
        consumer sends a cancel only once its clock passed the request's `serve_by_ns`,
        so we would refuse the request if it reached us now or later (`_check_age`).
        With a secret, a cancel must carry a valid MAC (it needs no freshness: its
        answer only tells what is true whenever it is asked)."""
        if self.secret is not None and not mac_valid(self.secret, cancel, EC_CANCEL_CONTEXT):
            self.rejects.reject(
                "ecrouter",
                "ec_auth_rejected",
                "ec_cancel_auth_rejected",
                "bad_mac" if cancel.mac else "no_mac",
                mm_hash=cancel.mm_hash,
            )
            return
        now = self.clock.now()
        for nonce, at in list(self.unsettled.items()):
            if now - at <= 2 * self.quarantine_s:
                break  # in insertion (time) order
            del self.unsettled[nonce]
        if (
            cancel.nonce in self.serving_nonces
            or cancel.nonce in self.unsettled
            or len(self.unsettled) >= EC_UNSETTLED_MAX
        ):
            self._count("ec_cancels_unanswered")
            return
        self._count("ec_cancels_answered")
        why = "not served: its deadline has passed, it never will be (cancelled)"
        ack = wire.ECXferAck(cancel.mm_hash, False, int(ErrorCode.TIMEOUT), why, 0)
        await self._ack(ident, ack, cancel.nonce)

    async def _serve(self, ident: bytes, req: wire.ECXferReq) -> None:
        mm_hash = req.mm_hash
        pinned = False
        info: PeerInfo | None = None
        pool = self.prod_pool
        assert pool is not None and self._router is not None
        try:
            p = self.produced.get(mm_hash)
            if p is None or not p.committed or mm_hash not in pool:
                raise NotFound(f"unknown encoder output {mm_hash!r}")
            assert p.params is not None
            if p.params.compat != req.compat:  # never empty: ECCommit refuses that
                raise Incompatible(
                    f"encoder output compatibility differs: producer {p.params.compat!r} "
                    f"vs consumer {req.compat!r}"
                )
            blocks = pool.get(mm_hash)
            assert blocks is not None
            where = address_problem(
                req.side_host, req.side_port, "ECXferReq.side_host", "ECXferReq.side_port"
            )
            if where is not None:  # never dial an address that cannot be one
                raise InvalidRequest(where)
            if len(req.dst_block_ids) != len(blocks):
                raise InvalidRequest(
                    f"{len(req.dst_block_ids)} destination blocks for {len(blocks)} source blocks"
                )
            pool.pin(mm_hash)
            pinned = True
            held = self._held_view(req)  # it describes the consumer `req` names, if any
            if held is not None:
                info = held
                self._count("ec_consumer_views_held")
            else:
                info = await self.registrar.call(EnsurePeer(req.side_host, req.side_port))
                if _consumer_mismatch(info, req) is not None:
                    # Our view may be stale (the consumer restarted, perhaps under another
                    # name): look once more before refusing.
                    info = await self.registrar.call(
                        EnsurePeer(req.side_host, req.side_port, refresh=True)
                    )
                    mismatch = _consumer_mismatch(info, req)
                    if mismatch is not None:
                        raise mismatch
            if self.trace.on:
                self.trace.mark(mm_hash, "ec.peer_checked")
            dst = info.regions[(EC_ENGINE, 0)]
            assert self.local is not None
            plan = plan_transfer(
                self.local.geometry, list(blocks), dst.geometry, list(req.dst_block_ids)
            )
            reading = await self._consumer_clock(info, req)
            self._check_age(req, reading)  # then post at once: nothing awaited in between
            await self.engine.transfer(
                "WRITE",
                plan.as_tuples_local(),
                plan.as_tuples_remote(),
                info.agent,
                b"",
                self.xfer_timeout,
                plan.total_bytes,
                trace_id=mm_hash,
            )
            self._count("ec_served")
            self._count("ec_bytes_served", plan.total_bytes)
            ack = wire.ECXferAck(mm_hash, True, 0, "", p.nbytes)
        except Unsettled as exc:
            # UCX has not ended the WRITE (kvd.adapters.nixl): an answer would free the
            # consumer's blocks while bytes may still land; without one they stay
            # quarantined there until its bound
            self._xfer_failed(mm_hash, exc)
            self._count("ec_unsettled_unanswered")
            self.unsettled[req.nonce] = self.clock.now()
            return
        except KvdError as exc:
            self._xfer_failed(mm_hash, exc)
            if isinstance(exc, PeerDisconnected) and info is not None:
                # UCX failed our endpoint to the consumer: the registrar forgets a peer
                # we dialed (the next use handshakes afresh); one that dialed us is
                # mended by the engine and handshakes again itself when it restarts
                self.registrar.post(
                    PeerLost(info.agent, exc.message, info.handshaked_at, endpoint=True)
                )
            ack = wire.ECXferAck(mm_hash, False, int(exc.code), exc.message[:1000], 0)
        finally:
            if pinned and mm_hash in pool:
                pool.unpin(mm_hash)
        await self._ack(ident, ack, req.nonce)
        if self.trace.on:
            self.trace.mark(mm_hash, "ec.ack_sent")

    # ---------------------------------------------------------------- status

    def snapshot(self) -> dict[str, Any]:
        def pool_stats(pool: BlockPool | None) -> dict[str, Any] | None:
            if pool is None:
                return None
            return {
                "blocks": pool.num_blocks,
                "used": pool.used_blocks,
                "free": pool.free_blocks,
                "evictable": pool.evictable_blocks,
                "pinned": pool.used_blocks - pool.evictable_blocks,
                "entries": len(pool),
                "evicted": pool.evicted,
            }

        return {
            "role": self.role,
            "serving": self.serving,
            "region": self.region.name if self.region else "",
            "index": self.index.name if self.index is not None else "",
            "indexed": len(self.index) if self.index is not None else 0,
            "index_unpublished": self.index.unpublished if self.index is not None else 0,
            "region_bytes": self.region_bytes,
            "block_bytes": self.block_bytes,
            "consumer_offset": self.cons_offset,
            "port": self.port,
            "producer": pool_stats(self.prod_pool),
            "consumer": pool_stats(self.cons_pool),
            "produced": sorted(k for k, v in self.produced.items() if v.committed)[:100],
            "allocated": sum(1 for v in self.produced.values() if not v.committed),
            "orphaned": sorted(k for k, v in self.produced.items() if v.orphan_pid)[:100],
            "cached": sorted(self.cached_nbytes)[:100],
            "fetching": sorted(self.fetches)[:100],
            "producer_sockets": len(self.dealers),
            "quarantined": sorted(self.quarantined)[:100],
            "hits": self.hits,
            "client_hits": self.client_hits,
            "misses": self.misses,
        }


def _consumer_mismatch(info: PeerInfo, req: wire.ECXferReq) -> KvdError | None:
    """Why `req` does not describe the consumer our handshake `info` describes, or None:
    the same agent, the same incarnation (when the request names one), its EC region
    (engine `EC_ENGINE`, rank 0), that region's generation."""
    if info.agent != req.agent_name:
        return RemoteProtocolError(
            f"request names agent {req.agent_name!r}, the peer at {info.addr} is {info.agent!r}"
        )
    if req.incarnation and req.incarnation != info.incarnation:
        return NotFound(
            f"the consumer {info.agent!r} is incarnation {req.incarnation:016x}, our view of "
            f"it is of {info.incarnation:016x} (it restarted since)"
        )
    dst = info.regions.get((EC_ENGINE, 0))
    if dst is None:
        return NotFound(f"the consumer {info.agent!r} has no EC region")
    if (dst.region_id, dst.generation) != (req.dst_region, req.dst_generation):
        return NotFound(
            f"the consumer's EC region is region {dst.region_id} generation {dst.generation}, "
            f"not region {req.dst_region} generation {req.dst_generation} (unknown or stale)"
        )
    return None


def _nothing() -> None:
    pass
