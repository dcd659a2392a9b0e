"""Tiers: node-wide KV tiers that engines keep blocks in (vLLM's secondary offloading tiers).

The daemon owns a host pool (one shared-memory segment, registered with NIXL, cut into
slots of the block size of the first client that opens it) and, with `tiers.disk_path`,
a disk tier of files moved with NIXL's POSIX backend (a second backend of the daemon's
one agent). `kvd.core.tiers` keeps the indexes; this actor feeds them requests and does
the IO. Clients (`kvd_client.tiers.TierClient`) map the pool and copy bytes themselves:
- `TierLookup`: one answer for a whole batch (host, disk or miss per key).
- Store: `TierReserve` reserves and pins a slot per key not held yet (evicting the least
  recently used unpinned block when no slot is free), the client copies, `TierCommit`
  makes the blocks visible; a block is never visible before its bytes are in place.
  Clients send the commit one-way; it is answered all the same (a refusal is counted
  there), and a session's messages are handled in order.
- Store ahead: `TierGrant` lends a session free slots (or those of clean blocks, never
  of a block the disk tier lacks; at most an eighth of the pool per session), the client
  copies blocks into them and names the keys in `TierPut` (one-way): a store without a
  round trip. A slot named by a put goes back to the pool whatever happens to its key
  (stored, or held already); lent slots not put go back when the session ends.
- Load: `TierPin` pins the keys' slots; a disk-tier hit is first read into a reserved
  slot (promoted: kept in the host tier afterwards, unless `promote_on_hit` is off) and
  its length and checksum checked (a bad or truncated file is a miss: removed and counted,
  never a crash); the client copies out and sends `TierUnpin`. With `TierPin.files`
  (`tiers.disk_client_reads`) a disk hit is answered SLOT_FILE instead: its file is
  pinned (never deleted meanwhile) and the client reads it into its own memory and checks
  it (`kvd_client.tierfiles`); after the unpin the daemon promotes it in the background
  (`promote_on_hit`). A file found bad while pinned so is condemned: a miss at once,
  deleted by its last reader's unpin.
- Load without a round trip: every READY host block is published in the directory
  (`kvd_client.tierdir`, a shared-memory table beside the pool: key digest, slot, the
  slot's generation; `HostIndex` publishes and retracts), and a client copies what it
  finds there (checked by the generations afterwards) and reads disk-tier files it may
  read without a pin; it names those blocks afterwards in a one-way `TierTouch`
  (`TiersTouched` from the gateway): they become the most recently used, disk ones are
  promoted (`promote_on_hit`), all are counted (`tiers_direct_loads`).
A reservation or pin belongs to an operation of the client's session: it is dropped when
the client ends it, when the session ends (goodbye; a killed client's lost connection;
no keep-alive for `daemon.client_timeout`: a frozen client), or after
`tiers.pin_timeout`. A client dropped so may only have been slow or frozen, and may
still copy. Readers: every slot has a generation, bumped (in a shared-memory array the
clients map read-only) before the slot takes new bytes; a load's answer names them and
the client checks them after copying (a reused slot: a miss). Writers cannot be checked
after the fact, so a store's slots dropped that way are not reused (quarantined, lent in
`HostIndex`) until the client is known to be done with them: its commit or unpin of that
operation, its next session (`TierOpen.prev`), its session's safe end (goodbye, lost
connection), or its process's end (checked every `QUARANTINE_CHECK` seconds).

Across nodes (`tiers.peers`, `tiers.ask_known_peers`). A lookup whose keys all hit locally
is answered at once. Otherwise the keys that missed go, one `PeerTierLookup` per peer, to
every peer asked (configured peers are handshaked through the registrar at start, and
again while they do not answer); the answers that came within `tiers.peer_lookup_timeout`
are validated (a wrong one is dropped and counted) and merged: a local hit wins, and among
peers a host hit before a disk hit, then the least agent name (`pick_peers`). A peer that
does not answer in time (dead, frozen, unreachable) is a miss for that batch, counted. A
peer hit answers TIER_PEER and is remembered (`PeerHints`). A load (`TierPin`) of such a
key reserves a local host slot, asks that peer to pin the block (`PeerTierPin`, one per
peer per load), READs it over NIXL straight into the slot, checks its checksum against
the one the peer computed over the block it pinned (a mismatch is a miss, counted), and
unpins it on the peer (`PeerTierUnpin`). Where that READ would be UCX's emulation over
TCP (`kvd.core.readpath`: it aborts the peer if we die with READs queued at it), the load
asks for the blocks inline instead (`PeerTierPin.inline`): the peer copies the pinned
blocks into its answer (what fits in a frame; the rest of a batch are misses) and unpins
them at once; we copy them into our slots and check them the same way. The block is then
promoted: kept in the local host tier like a stored one (`promote_on_hit`; off: freed
after that load). Serving
peers: a peer's lookup is answered from the local tiers only (never forwarded); a peer's
pins are an operation of the session `\0peer:<agent>`, dropped by its unpin, after
`tiers.peer_pin_timeout`, and at once when the registrar forgets that peer or sees it
restarted (a new incarnation): nothing stays pinned for a reader that is gone.

Disk tier. A block is a file `<disk_path>/<hh>/<digest>.blk`: the block's bytes, then the
namespace and the key, then a trailer (magic, length, checksum kind, and the checksum
of all before it: `tiers.disk_checksum`; `kvd_client.tierfiles`, shared with clients).
It is written as a temp file (NIXL WRITE from its pinned host slot, then the trailer)
and renamed into place only when complete, so a crash or a full disk never leaves a
file that is served; temp files found at start are removed. At start the index is
rebuilt from the files' trailers (a warm restart). Demotion: the host tier keeps
`tiers.low_water` of its slots free by writing its least recently used blocks to disk
(`demote_on_evict`) and then evicting them; blocks already on disk are evicted at once.
A reservation that finds no free slot evicts at once, and a block not yet on disk is
then dropped (counted as `tiers_host_dropped`). A failed disk write (a full disk) drops
the block and removes the temp file (counted as `tiers_disk_write_failed`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import math
import os
import secrets
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Final

import anyio
import anyio.abc
import anyio.to_thread
import numpy as np
import structlog
from anyio.abc import TaskStatus
from kvd_client import wire
from kvd_client.errors import (
    Incompatible,
    InvalidRequest,
    KvdError,
    NotFound,
    Timeout,
    TransferError,
)
from kvd_client.shm import SHM_DIR, SharedRegion, staging_name
from kvd_client.tierdir import TierDirWriter, key_digest
from kvd_client.tierfiles import (
    CHECKSUMS,
    SUFFIX,
    TMP_SUFFIX,
    TRAILER,
    block_checksum,
    block_path,
    read_trailer,
    trailer_of,
)

from kvd.actors.base import Mailbox, StartFailed
from kvd.actors.gateway import transport_cap
from kvd.actors.messages import (
    ClientRequest,
    EnsurePeer,
    PeerInfo,
    PeerLost,
    PeerTierRequest,
    PeerUpdated,
    SessionClosed,
    Snapshot,
    TiersTouched,
)
from kvd.adapters.nixl import NixlEngine, PeerDisconnected, Unsettled
from kvd.adapters.peerlink import PeerLink
from kvd.adapters.resolve import Resolver
from kvd.adapters.shm import pid_alive, reap_dead_creators, staging_creator_here
from kvd.config import TiersConfig
from kvd.core import readpath
from kvd.core.peersession import Keyring
from kvd.core.stats import XferTiming
from kvd.core.tiers import (
    DiskIndex,
    Evicted,
    HostIndex,
    Op,
    OpBook,
    OpKind,
    PeerHints,
    Reserve,
    TierKey,
    found_problem,
    pick_peers,
    pinned_problem,
)
from kvd.logs import RejectLog

log = structlog.get_logger("kvd.tiers", actor="tiers")

MAX_INLINE: Final = 8 << 20
"""The most block bytes one inline answer carries (`wire.PeerTierPinned.data`'s bound)."""
INLINE_OVERHEAD: Final = 1 << 20
"""Frame room kept for the rest of an inline answer (slots, checksums, sealing)."""

POOL_PREFIX: Final = "kvd-tiers-"
GENS_SUFFIX: Final = "-gens"
"""The slots' generations: a segment named as the pool, with this suffix."""
DIR_SUFFIX: Final = "-dir"
"""The host tier's directory (`kvd_client.tierdir`): named as the pool, with this suffix."""
LOCK_NAME: Final = ".lock"
"""The disk tier's lock file, at its root (`lock_disk`; block files live in subfolders)."""
DEMOTE_BATCH: Final = 64
"""Blocks written to disk in one NIXL transfer by the background demoter."""
DISK_IO_TIMEOUT: Final = 60.0
UNSETTLED: Final = "unsettled"
"""Why a disk transfer failed when NIXL still had it in flight (`Unsettled`)."""
PEER_SESSION: Final = "\0peer:"
"""Prefix of the session a peer's pins belong to (no client's session starts so)."""
PROMOTE_SESSION: Final = "\0promote"
"""The session of the daemon's own promotions of blocks that clients read from files."""
LENT: Final = 0
"""The key under which a session's lent slots sit in its `_Quarantine.by_op` (op ids start
at 1)."""
QUARANTINE_CHECK: Final = 1.0
"""Seconds between checks whether a timed-out session's process is gone."""
PEER_HINTS: Final = 1 << 16
"""Keys remembered with the peer a lookup found them on."""
PEER_DIAL_INTERVAL: Final = 1.0
"""Seconds between handshake attempts with configured peers that are not known yet."""
PEER_CHECKSUMS: Final = {CHECKSUMS["sum64"], CHECKSUMS["crc32"]}
"""Checksum kinds a peer's pin answer may carry (the reader always checks one)."""


@dataclass
class _DiskDone:
    """Notice from a disk task to the actor: per block, whether it worked."""

    op: Op | None
    read: bool
    results: list[tuple[TierKey, int, bool, str]]


@dataclass
class _PeersAnswered:
    """Notice from a lookup's peer task: the (validated) answers that came in time."""

    req: ClientRequest
    keys: list[TierKey]
    found: bytes
    miss: list[int]
    answers: dict[str, bytes]


@dataclass
class _PeerLoaded:
    """Notice from a peer READ task: per key (index in the op, key, local slot, ok, why)."""

    op: Op
    agent: str
    results: list[tuple[int, TierKey, int, bool, str]]


@dataclass
class _Unpin:
    """Notice from a task serving a peer's inline pin: its blocks were copied, free them."""

    op: int


@dataclass
class _PeerDialed:
    """Notice from the dialer: a configured peer's address answered as this agent."""

    addr: str
    info: PeerInfo


class _Published:
    """`HostIndex`'s directory: its entries, by key digest, in the shared segment."""

    __slots__ = ("writer",)

    def __init__(self, writer: TierDirWriter) -> None:
        self.writer = writer

    def publish(self, key: TierKey, slot: int, gen: int) -> None:
        self.writer.publish(key_digest(*key), slot, gen)

    def retract(self, key: TierKey) -> None:
        self.writer.retract(key_digest(*key))


@dataclass
class _Opened:
    namespaces: set[bytes] = field(default_factory=set)
    lent: set[int] = field(default_factory=set)
    """Host slots lent to the session ahead of its stores (`TierGrant`), not put yet."""


@dataclass
class _Quarantine:
    """Slots a session's client may still write into, kept out of use (lent): its store
    operation was dropped (pin timeout, or its session timed out) before the client said
    it was done with them. Given back by that operation's own commit or unpin (the
    client sends it after its copies), the session's safe end (goodbye, lost connection),
    the client's next session (`TierOpen.prev`), or its process's end."""

    by_op: dict[int, list[int]] = field(default_factory=dict)
    pid: int = 0
    timed_out: bool = False


def pool_name() -> str:
    """`kvd-tiers-n<pid namespace>-p<pid>-<hex>` (a `kvd_client.shm.staging_name`): the name
    records the daemon that made the pool and its pid namespace, so that a pool is removed
    only once that daemon is gone (`reap_stale_pools`), never a live daemon's in another
    pid namespace that shares /dev/shm (a container started with the host's IPC)."""
    return staging_name("tiers")


def pool_creator(name: str) -> int | None:
    """The pid of the daemon that made a host pool (or its generations, or its directory),
    when it lived in our pid namespace; None for any other name."""
    if not name.startswith(POOL_PREFIX):
        return None
    for suffix in (GENS_SUFFIX, DIR_SUFFIX):
        if name.endswith(suffix):
            return staging_creator_here(name.removesuffix(suffix))
    return staging_creator_here(name)


def reap_stale_pools(shm_dir: str = SHM_DIR) -> list[str]:
    """Unlink host pools (and their generations and directories) left by daemons that died
    without cleanup (`kvd.adapters.shm.reap_dead_creators`). Blocking IO: run it in a
    worker thread."""
    removed = reap_dead_creators(pool_creator, shm_dir)
    for name, pid in removed.items():
        log.info("tiers_stale_pool_removed", pool=name, creator_pid=pid)
    return list(removed)


def lock_disk(root: str) -> int:
    """Take the disk tier at `root` for this daemon: an exclusive `flock` of `root/.lock`,
    held (the descriptor returned) until the daemon closes it or its process ends, even by
    SIGKILL (the kernel drops the lock: a restart under systemd takes it at once). A
    daemon that finds it taken fails to start with one line naming the holder's pid: two
    daemons on one disk tier would each remove the other's unfinished writes at start and
    evict files the other indexes. The file holds the holder's pid, for people."""
    os.makedirs(root, exist_ok=True)
    fd = os.open(os.path.join(root, LOCK_NAME), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip()
        os.close(fd)
        raise StartFailed(
            "tiers_disk_in_use",
            path=root,
            holder_pid=holder,
            hint="another kvd daemon runs with this tiers.disk_path: give each daemon a disk "
            "tier of its own (or stop the other one)",
        ) from None
    except OSError:
        os.close(fd)
        raise
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def scan_disk(
    root: str, check: Callable[[str], None] | None = None
) -> tuple[list[tuple[float, TierKey, int]], list[str], list[str]]:
    """Files of a disk tier: (mtime, key, data bytes) of the good ones, oldest first; the
    bad ones (removed); the temp files of writes that never finished (removed)."""
    good: list[tuple[float, TierKey, int]] = []
    bad: list[str] = []
    leftovers: list[str] = []
    if not os.path.isdir(root):
        return good, bad, leftovers
    for sub in sorted(os.listdir(root)):
        d = os.path.join(root, sub)
        if len(sub) != 2 or not os.path.isdir(d):
            continue
        for name in os.listdir(d):
            path = os.path.join(d, name)
            if name.endswith(TMP_SUFFIX):
                _unlink(path)
                leftovers.append(path)
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                fd = os.open(path, os.O_RDONLY)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                got = read_trailer(fd, st.st_size)
            except OSError:
                got = "unreadable"
            finally:
                os.close(fd)
            if isinstance(got, str) or block_path(root, got[0]) != path:
                _unlink(path)
                bad.append(path)
                continue
            good.append((st.st_mtime, got[0], got[1]))
    good.sort(key=lambda g: g[0])
    return good, bad, leftovers


def _fit(slots: tuple[int, ...], most: int) -> tuple[int, ...]:
    """The slots with hits past the first `most` turned into misses (an inline answer
    carries at most `most` blocks)."""
    out, n = [], 0
    for s in slots:
        if s >= 0:
            n += 1
            if n > most:
                s = wire.SLOT_HELD
        out.append(s)
    return tuple(out)


def _inline_problem(ans: wire.PeerTierPinned, inline: bool, slot_bytes: int) -> str | None:
    """What is wrong with an answer's inline part (None: nothing)."""
    hits = sum(s >= 0 for s in ans.slots)
    if inline and ans.op:
        return f"an inline answer holds operation {ans.op} open"
    want = hits * slot_bytes if inline else 0
    if len(ans.data) != want:
        return f"{len(ans.data)} bytes of blocks inline, not {want}"
    return None


def _unlink(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class Tiers:
    def __init__(
        self,
        *,
        engine: NixlEngine,
        mailbox: Mailbox[Any],
        cfg: TiersConfig,
        counters: dict[str, int],
        rejects: RejectLog,
        registrar: Mailbox[Any] | None = None,
        keyring: Keyring | None = None,
        max_frame: int = 16 << 20,
        agent_name: str = "",
        incarnation: int = 0,
        resolver: Resolver | None = None,
        pull_by: str = "auto",
    ) -> None:
        self.engine = engine
        self.registrar = registrar
        self.pull_by = pull_by
        """`transfer.pull_by`: where a READ from a peer would be emulated (TCP), a load asks
        for the blocks inline (`PeerTierPin.inline`) instead (`kvd.core.readpath`)."""
        self.inline_budget = max(0, min(MAX_INLINE, max_frame - INLINE_OVERHEAD))
        """Bytes of blocks one inline answer may carry (both sides cap it)."""
        self._warned_large = False
        self.agent_name = agent_name or engine.name
        self.incarnation = incarnation
        self.link = PeerLink(
            keyring=keyring,
            max_frame=max_frame,
            frame_cap=transport_cap(max_frame),
            on_late=self._late_answer,
            counters=counters,
            rejects=rejects,
            resolver=resolver,
        )
        self.peer_view: dict[str, PeerInfo] = {}
        """Peers the registrar knows (its `PeerUpdated` notices), by agent."""
        self.configured: dict[str, str] = {}
        """`tiers.peers` "host:port" -> the agent that answered there."""
        self.peer_sessions: dict[str, int] = {}
        """Peers whose pins we hold -> the incarnation that took them."""
        self.hints = PeerHints(PEER_HINTS)
        self.peer_reading = 0
        self._side_ready: anyio.Event | None = None
        """Set once the daemon's side channel listens (`side_channel_listening`)."""
        self.mailbox = mailbox
        self.clock = mailbox.clock
        self.cfg = cfg
        self.counters = counters
        self.rejects = rejects
        self.disk_root = os.path.abspath(cfg.disk_path) if cfg.disk_path else ""
        self.pool: SharedRegion | None = None
        self.gens_region: SharedRegion | None = None
        self.gens: memoryview | None = None
        """The slots' generations (`HostIndex`), published read-only to clients."""
        self.directory: TierDirWriter | None = None
        """The READY host blocks by slot, published read-only to clients (their loads
        without a round trip; `kvd_client.tierdir`)."""
        self.quarantine: dict[str, _Quarantine] = {}
        """Slots kept out of use for sessions whose client may still write into them."""
        self._quarantine_check = 0.0
        self.pool_addr = 0
        self._pool_reg: Any = None
        self._disk_lock: int | None = None
        """The descriptor holding the disk tier's lock (`lock_disk`) while this daemon runs."""
        self.host: HostIndex | None = None
        self.slot_bytes = 0
        self.disk: DiskIndex | None = DiskIndex(cfg.disk_bytes) if self.disk_root else None
        self.ops = OpBook()
        self.sessions: dict[str, _Opened] = {}
        self.demoting = 0
        self.reading = 0
        self.op_reqs: dict[int, ClientRequest] = {}
        """Operations not answered yet (disk reads pending, or waiting for slots)."""
        self.waiters: dict[int, Op] = {}
        """Operations whose keys wait for host slots, oldest first."""
        self._tg: anyio.abc.TaskGroup | None = None

    @property
    def enabled(self) -> bool:
        return self.cfg.enabled

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    # ---------------------------------------------------------------- lifecycle

    def side_channel_listening(self) -> None:
        """The daemon's side channel listens: configured peers are dialed from now on
        (our handshake names its port)."""
        if self._side_ready is not None:
            self._side_ready.set()

    def busy(self) -> bool:
        """Whether a tier operation is open (a load, a store, a peer's pins it READs
        through our agent); read from the NIXL thread too."""
        return len(self.ops) > 0

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        self._side_ready = anyio.Event()
        if self.enabled:
            await self._start()
        async with anyio.create_task_group() as tg:
            self._tg = tg
            await tg.start(self.link.run)
            if self.enabled and self.cfg.peer_addrs and self.registrar is not None:
                tg.start_soon(self._dial_peers)
            task_status.started()
            while True:
                msg: Any = await self.mailbox.receive_before(self._next_deadline())
                if msg is not None:
                    self._dispatch(msg)
                now = self.clock.now()
                for op in self.ops.expired(now):
                    got = self.ops.get(op)
                    if got is not None and got.session.startswith(PEER_SESSION):
                        self._count("tiers_peer_pins_expired")
                    self._count("tiers_pins_expired")
                    # its client may still be copying into a store's slots: kept out of
                    # use until it is known to be done
                    self._release(op, quarantine=True)
                if self.quarantine and now >= self._quarantine_check:
                    self._quarantine_check = now + QUARANTINE_CHECK
                    self._check_quarantine()

    def _next_deadline(self) -> float | None:
        ops = self.ops.next_deadline()
        if not any(q.timed_out for q in self.quarantine.values()):
            return ops
        return self._quarantine_check if ops is None else min(ops, self._quarantine_check)

    async def _start(self) -> None:
        if self.disk is not None:  # first: another daemon's disk tier is never touched
            self._disk_lock = lock_disk(self.disk_root)
        try:
            await anyio.to_thread.run_sync(reap_stale_pools)
        except OSError as exc:
            log.warning("tiers_stale_pool_reap_failed", error=str(exc))
        name = pool_name()
        # the pool's pages are allocated now, not at each first copy into a slot
        self.pool = SharedRegion(name, self.cfg.host_bytes, populate=True)
        import ctypes

        anchor = ctypes.c_char.from_buffer(self.pool.buf)
        self.pool_addr = ctypes.addressof(anchor)
        del anchor
        self._pool_reg = await self.engine.register(self.pool_addr, self.cfg.host_bytes)
        if self.disk is not None:
            os.makedirs(self.disk_root, exist_ok=True)
            good, bad, leftovers = await anyio.to_thread.run_sync(scan_disk, self.disk_root)
            for _, key, nbytes in good:
                got = self.disk.add_existing(key, nbytes)
                if isinstance(got, list):
                    for old in got:
                        _unlink(block_path(self.disk_root, old))
                        self._count("tiers_disk_evictions", 1)
                else:
                    _unlink(block_path(self.disk_root, key))
            self._count("tiers_disk_corrupt", len(bad))
            self._count("tiers_disk_leftovers_removed", len(leftovers))
            log.info(
                "tiers_disk_loaded",
                path=self.disk_root,
                blocks=len(self.disk),
                bytes=self.disk.used,
                bad=len(bad),
                leftovers=len(leftovers),
            )
        log.info("tiers_ready", pool=name, host_bytes=self.cfg.host_bytes, disk=self.disk_root)

    async def cleanup(self) -> None:
        """Deregister and unlink the pool (shutdown; shielded by the daemon)."""
        if self._pool_reg is not None:
            try:
                await self.engine.deregister(self._pool_reg)
            except KvdError as exc:
                log.warning("tiers_deregister_failed", error=exc.message)
            self._pool_reg = None

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
            self.pool = None
        self._close_gens()
        if self._disk_lock is not None:
            os.close(self._disk_lock)  # the lock goes with it (and with the process)
            self._disk_lock = None

    def _close_gens(self) -> None:
        if self.directory is not None:
            self.directory.close()
            self.directory = None
        if self.gens is not None:
            self.gens.release()
            self.gens = None
        if self.gens_region is not None:
            self.gens_region.close()
            self.gens_region = None

    # ---------------------------------------------------------------- dispatch

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, ClientRequest):
            try:
                self._client(msg)
            except KvdError as exc:
                self.rejects.reject(
                    "tiers",
                    "tiers_requests_rejected",
                    "tiers_request_rejected",
                    type(exc).__name__,
                    session=msg.session,
                    error=exc.message,
                )
                msg.fail(exc)
        elif isinstance(msg, PeerTierRequest):
            try:
                self._peer_request(msg)
            except KvdError as exc:
                self.rejects.reject(
                    "tiers",
                    "tiers_peer_requests_rejected",
                    "tiers_peer_request_rejected",
                    type(exc).__name__,
                    peer=msg.agent,
                    error=exc.message,
                )
                msg.fail(exc)
        elif isinstance(msg, TiersTouched):
            self._touched(msg)
        elif isinstance(msg, _PeersAnswered):
            self._peers_answered(msg)
        elif isinstance(msg, _PeerLoaded):
            self._peer_loaded(msg)
        elif isinstance(msg, _Unpin):
            if self.ops.get(msg.op) is not None:  # (released meanwhile: the peer is gone)
                self._release(msg.op)
        elif isinstance(msg, PeerUpdated):
            self._peer_updated(msg)
        elif isinstance(msg, _PeerDialed):
            self.configured[msg.addr] = msg.info.agent
            info = self.peer_view.setdefault(msg.info.agent, msg.info)
            self.link.prepare(info.agent, info.host, info.port)
        elif isinstance(msg, _DiskDone):
            if msg.read:
                self._read_done(msg)
            else:
                self._write_done(msg)
        elif isinstance(msg, SessionClosed):
            opened = self.sessions.pop(msg.session, None)
            if opened is not None and opened.lent:
                self._return_lent(msg.session, opened.lent, quarantine=msg.timed_out)
            for op in self.ops.of_session(msg.session):
                self._release(op, quarantine=msg.timed_out)
            q = self.quarantine.get(msg.session)
            if q is not None:
                if msg.timed_out:  # (it may thaw and write: until its process is gone)
                    q.timed_out, q.pid = True, msg.pid
                    self._quarantine_check = self.clock.now() + QUARANTINE_CHECK
                else:  # goodbye (after its calls), or its connection lost (it is gone)
                    self._end_quarantine(msg.session)
            msg.resolve(None)
        elif isinstance(msg, Snapshot):
            msg.resolve(self.snapshot())
        else:
            raise TypeError(f"tiers got {type(msg).__name__}")

    def _client(self, req: ClientRequest) -> None:
        m = req.msg
        if not self.enabled or self.pool is None:
            raise InvalidRequest("this daemon keeps no KV tiers (tiers.enabled = false)")
        if isinstance(m, wire.TierOpen):
            if m.prev and m.prev != req.session:  # its previous session is over for good
                self._end_quarantine(m.prev)
            req.resolve(self._open(req.session, m))
            return
        if isinstance(m, (wire.TierUnpin, wire.TierCommit)):
            req.resolve(self._finish(req.session, m))
            return
        if isinstance(m, wire.TierGrant):
            req.resolve(self._grant(req.session, m.n))
            return
        assert isinstance(m, (wire.TierLookup, wire.TierReserve, wire.TierPin, wire.TierPut))
        opened = self.sessions.get(req.session)
        if opened is None or m.namespace not in opened.namespaces:
            raise InvalidRequest("TierOpen this namespace first")
        if len(m.keys) % m.key_bytes:
            raise InvalidRequest(f"keys are not a multiple of key_bytes ({m.key_bytes})")
        n = len(m.keys) // m.key_bytes
        if n > wire.MAX_TIER_KEYS:
            raise InvalidRequest(f"{n} keys in one batch (at most {wire.MAX_TIER_KEYS})")
        kb, blob, ns = m.key_bytes, m.keys, m.namespace
        keys = [(ns, blob[i : i + kb]) for i in range(0, n * kb, kb)]
        if isinstance(m, wire.TierLookup):
            self._lookup_with_peers(req, m, keys, self._lookup(keys))
        elif isinstance(m, wire.TierReserve):
            self._reserve(req, keys)
        elif isinstance(m, wire.TierPut):
            req.resolve(self._put(opened, keys, m.slots))
        else:
            self._pin(req, keys, files=m.files)

    def _touched(self, msg: TiersTouched) -> None:
        """Blocks a client loaded without a pin (`wire.TierTouch`, one-way): through the
        directory, or (`disk`) from their files. Counted as loads and made the most
        recently used; disk blocks promoted (`promote_on_hit`). Bad input is counted and
        logged, never answered."""
        m = msg.msg
        opened = self.sessions.get(msg.session)
        why = ""
        if self.host is None or opened is None or m.namespace not in opened.namespaces:
            why = "TierTouch before TierOpen of its namespace"
        elif len(m.keys) % m.key_bytes or len(m.keys) // m.key_bytes > wire.MAX_TIER_KEYS:
            why = f"keys are not a batch of at most {wire.MAX_TIER_KEYS} of {m.key_bytes} bytes"
        if why:
            self.rejects.reject(
                "tiers",
                "tiers_requests_rejected",
                "tiers_request_rejected",
                "InvalidRequest",
                session=msg.session,
                error=why,
            )
            return
        assert self.host is not None
        kb, blob, ns = m.key_bytes, m.keys, m.namespace
        n = len(blob) // kb
        keys = [(ns, blob[i : i + kb]) for i in range(0, n * kb, kb)]
        self._count("tiers_direct_loads", n)
        self._count("tiers_blocks_loaded", n)
        if not m.disk:
            self.host.touch(keys)
            self._count("tiers_host_bytes_out", n * self.slot_bytes)
            return
        if self.disk is None:
            return  # (the client read files of a disk tier this daemon no longer has)
        self.disk.touch(keys)
        self._count("tiers_disk_client_reads", n)
        self._count("tiers_disk_bytes_out", n * self.slot_bytes)
        if self.cfg.promote_on_hit:
            self._promote(keys)
            self._keep_free()
            self._retry_waiters()

    # ---------------------------------------------------------------- requests

    def _open(self, session: str, m: wire.TierOpen) -> wire.TierOpened:
        assert self.pool is not None
        if m.block_bytes > self.cfg.host_bytes:
            raise InvalidRequest(
                f"a block of {m.block_bytes} bytes exceeds tiers.host_bytes ({self.cfg.host_bytes})"
            )
        if self.host is None or (
            self.slot_bytes != m.block_bytes
            and len(self.host) == 0
            and len(self.ops) == 0
            and self.host.lent == 0
            and not (self.sessions.keys() - {session})  # (they map the old slots)
        ):
            self._new_host_index(m.block_bytes)
        elif self.slot_bytes != m.block_bytes:
            raise Incompatible(
                f"the host tier holds blocks of {self.slot_bytes} bytes; this client's "
                f"are {m.block_bytes} (one block size per daemon while blocks are held)"
            )
        self.sessions.setdefault(session, _Opened()).namespaces.add(m.namespace)
        assert self.host is not None
        return wire.TierOpened(
            self.pool.name,
            self.cfg.host_bytes,
            self.slot_bytes,
            self.host.num_slots,
            self.cfg.pin_timeout,
            self.cfg.lookup_timeout,
            self.disk is not None,
            self._client_files,
            self.cfg.disk_checksum != "none",
            self.gens_region.name if self.gens_region is not None else "",
            self.directory.name if self.directory is not None else "",
        )

    def _new_host_index(self, block_bytes: int) -> None:
        """The host index for slots of `block_bytes`, with its generations in a new
        shared-memory segment beside the pool."""
        assert self.pool is not None
        num_slots = self.cfg.host_bytes // block_bytes
        self._close_gens()
        self.gens_region = SharedRegion(f"{self.pool.name}{GENS_SUFFIX}", num_slots * 8)
        self.gens = self.gens_region.buf.cast("Q")
        self.directory = TierDirWriter(f"{self.pool.name}{DIR_SUFFIX}", num_slots)
        self.slot_bytes = block_bytes
        self.host = HostIndex(num_slots, self.gens, _Published(self.directory))

    @property
    def _client_files(self) -> str:
        """The disk tier's directory where clients may read its files, or ""."""
        if self.disk is None or not self.cfg.disk_client_reads:
            return ""
        return self.disk_root

    def _lookup(self, keys: list[TierKey]) -> bytes:
        host, disk = self.host, self.disk
        assert host is not None
        in_host = host.ready_many(keys)
        out = bytearray(in_host)  # (bools as bytes: TIER_HOST is 1, TIER_MISS 0)
        hits, dhits = sum(in_host), 0
        if disk is not None and hits < len(keys):
            rest = [i for i, h in enumerate(in_host) if not h]
            for i, d in zip(rest, disk.ready_many([keys[i] for i in rest]), strict=True):
                if d:
                    out[i] = wire.TIER_DISK
                    dhits += 1
        self._count("tiers_host_hits", hits)
        self._count("tiers_host_misses", len(keys) - hits)
        if disk is not None:
            self._count("tiers_disk_hits", dhits)
            self._count("tiers_disk_misses", len(keys) - hits - dhits)
        self._count("tiers_lookups")
        self._count("tiers_lookup_keys", len(keys))
        return bytes(out)

    def _reserve(self, req: ClientRequest, keys: list[TierKey]) -> None:
        host, disk = self.host, self.disk
        assert host is not None
        op = self.ops.open(req.session, OpKind.STORE, self.clock.now() + self.cfg.pin_timeout)
        op.keys = keys
        op.slots = [wire.SLOT_HELD] * len(keys)
        seen: set[TierKey] = set()
        for i, k in enumerate(keys):
            if k in host or (disk is not None and disk.ready(k)) or k in seen:
                continue
            seen.add(k)
            op.waiting.append(i)
        self.op_reqs[op.op] = req
        self._place(op)

    def _grant(self, session: str, n: int) -> wire.TierGranted:
        """Lend the session free host slots for its next store (`HostIndex.lend`: never a
        block the disk tier lacks; never waiting), at most `_max_lent` at a time."""
        host = self.host
        opened = self.sessions.get(session)
        if opened is None or host is None:
            raise InvalidRequest("TierOpen first")
        n = min(n, self._max_lent - len(opened.lent))
        if n <= 0:
            return wire.TierGranted(())
        slots, evicted = host.lend(n)
        for victim in evicted:
            self._evicted(victim)
        opened.lent.update(slots)
        self._count("tiers_slots_lent", len(slots))
        self._keep_free()
        return wire.TierGranted(tuple(slots))

    @property
    def _max_lent(self) -> int:
        """Slots one session may hold lent: an eighth of the pool, at most a batch."""
        assert self.host is not None
        return min(wire.MAX_TIER_KEYS, self.host.num_slots // 8)

    def _put(self, opened: _Opened, keys: list[TierKey], slots: tuple[int, ...]) -> wire.TierFlags:
        """A store into lent slots (`TierPut`): each key's block is in its slot. A slot
        not lent to this session is refused (counted); a key held already gives its
        slot back."""
        host, disk = self.host, self.disk
        assert host is not None
        if len(slots) != len(keys):
            raise InvalidRequest(f"{len(keys)} keys but {len(slots)} slots")
        flags = bytearray(len(keys))
        stored = back = refused = 0
        for j, (k, slot) in enumerate(zip(keys, slots, strict=True)):
            if slot not in opened.lent:
                refused += 1
                continue
            opened.lent.discard(slot)
            flags[j] = 1
            if (disk is not None and disk.ready(k)) or not host.fill(k, slot):
                host.give_back(slot)  # held already (or earlier in this batch)
                back += 1
            else:
                stored += 1
        if refused:  # (counted per slot; logged per put, rate-limited: client input)
            self._count("tiers_put_refused", refused)
            self.rejects.reject(
                "tiers", "tiers_puts_rejected", "tiers_put_refused", "not_lent", slots=refused
            )
        self._count("tiers_host_bytes_in", stored * self.slot_bytes)
        self._count("tiers_blocks_stored", stored)
        self._keep_free()
        if back:
            self._retry_waiters()
        return wire.TierFlags(bytes(flags))

    def _finish(self, session: str, m: wire.TierUnpin | wire.TierCommit) -> wire.Record:
        op = self.ops.get(m.op)
        if op is None or op.session != session:
            q = self.quarantine.get(session)
            if q is not None and m.op != LENT and m.op in q.by_op:  # it is done with them
                self._give_back(session, q.by_op.pop(m.op))
            raise NotFound(f"no tier operation {m.op} (expired, or its pins were dropped)")
        if isinstance(m, wire.TierUnpin):
            self._release(m.op)
            return wire.Ok()
        if op.kind is not OpKind.STORE:
            raise InvalidRequest(f"operation {m.op} is a load: unpin it, not commit it")
        if not op.answered:
            raise InvalidRequest(f"operation {m.op} has no slots yet: commit after its answer")
        host = self.host
        assert host is not None
        self.ops.close(m.op)
        flags = bytearray(len(op.slots))
        committed = 0
        for j, (k, slot) in enumerate(zip(op.keys, op.slots, strict=True)):
            if slot == wire.SLOT_HELD:
                flags[j] = 1
            elif slot >= 0:
                if j < len(m.ok) and m.ok[j]:
                    host.commit(k)
                    flags[j] = 1
                    committed += 1
                else:
                    host.abort(k)
        self._count("tiers_host_bytes_in", committed * self.slot_bytes)
        self._count("tiers_blocks_stored", committed)
        self._keep_free()
        return wire.TierFlags(bytes(flags))

    def _pin(
        self, req: ClientRequest, keys: list[TierKey], *, peer: str = "", files: bool = False
    ) -> None:
        """A load's pins (module docstring); `peer`: for that peer daemon's READ (never
        passed on to our own peers); `files`: the client reads disk hits from their files
        (answered SLOT_FILE, the file pinned: never deleted meanwhile)."""
        host, disk = self.host, self.disk
        assert host is not None
        hold = self.cfg.peer_pin_timeout if peer else self.cfg.pin_timeout
        op = self.ops.open(req.session, OpKind.LOAD, self.clock.now() + hold)
        op.keys = keys
        op.slots = [wire.SLOT_HELD] * len(keys)
        n_host = n_files = 0
        files = files and not peer and bool(self._client_files)
        from_peers: dict[str, list[int]] = {}
        for i, k in enumerate(keys):
            slot = host.pin(k)
            if slot is not None:
                op.slots[i] = slot
                n_host += 1
            elif disk is not None and disk.ready(k):
                if files and disk.nbytes(k) == self.slot_bytes and disk.pin(k):
                    op.slots[i] = wire.SLOT_FILE
                    n_files += 1
                else:
                    op.waiting.append(i)
            elif not peer and (agent := self.hints.get(k)) is not None:
                from_peers.setdefault(agent, []).append(i)
        if not peer:  # (a peer's: counted when answered, disk hits included)
            self._count("tiers_host_bytes_out", n_host * self.slot_bytes)
            self._count("tiers_blocks_loaded", n_host + n_files)
        if n_files:
            self._count("tiers_disk_client_reads", n_files)
            self._count("tiers_disk_bytes_out", n_files * self.slot_bytes)
        self.op_reqs[op.op] = req
        for agent, idxs in sorted(from_peers.items()):
            self._start_peer_load(op, agent, idxs)
        self._place(op)

    def _place(self, op: Op) -> None:
        """Find host slots for the op's waiting keys: a store's new blocks, or a load's
        disk hits (which then start reading). Those that find none wait for the demoter
        to free slots, or are refused (store) or misses (load) when nothing can free one.
        Answers the op once nothing is pending or waiting."""
        host, disk = self.host, self.disk
        assert host is not None
        reads: list[tuple[TierKey, int]] = []
        still: list[int] = []
        todo, op.waiting = op.waiting, []
        if op.kind is OpKind.STORE:
            for i in todo:
                got = host.reserve(op.keys[i], evict_dirty=not self._demoting_on)
                if got is Reserve.FULL:
                    still.append(i)
                elif not isinstance(got, Reserve):
                    op.slots[i] = got[0]
                    self._evicted(got[1])
                # HELD: stored by another client meanwhile
            todo = []
        for i in todo:
            k = op.keys[i]
            if disk is None or not disk.ready(k) or disk.nbytes(k) != self.slot_bytes:
                continue  # gone meanwhile, or another block size: a miss
            got = host.reserve(
                k,
                transient=not self.cfg.promote_on_hit,
                on_disk=True,
                evict_dirty=not self._demoting_on,
            )
            if got is Reserve.HELD:  # promoted (or being read) for another load meanwhile
                slot = host.pin(k)
                if slot is None:
                    still.append(i)
                else:
                    op.slots[i] = slot
                continue
            if got is Reserve.FULL:
                still.append(i)
                continue
            assert not isinstance(got, Reserve)
            slot, victim = got
            self._evicted(victim)
            disk.pin(k)
            reads.append((k, slot))
            op.slots[i] = slot
            op.pending.add((k, slot))
        op.waiting = still
        if reads:
            self.reading += len(reads)
            assert self._tg is not None
            self._tg.start_soon(self._read_disk, op, reads)
        if op.waiting:
            self.waiters[op.op] = op  # (kept in place if it was waiting already)
            self._keep_free()
            # nothing will free a slot for it: no demotion, and no read under way (a
            # read of the same block for another load, or a promotion, ends in the host
            # tier or in a miss; either way this op is placed again then)
            if self.demoting == 0 and self.reading == 0 and not op.pending:
                if op.kind is OpKind.STORE:
                    self._count("tiers_store_refused", len(op.waiting))
                    for i in op.waiting:
                        op.slots[i] = wire.SLOT_REFUSED
                else:
                    self._count("tiers_promote_no_room", len(op.waiting))
                op.waiting = []
        if not op.waiting:
            self.waiters.pop(op.op, None)
        self._answer(op)

    def _answer(self, op: Op) -> None:
        if op.answered or op.waiting or op.pending:
            return
        op.answered = True
        req = self.op_reqs.pop(op.op, None)
        if req is None:
            return
        if op.released:
            req.fail(NotFound("the operation's pins were dropped (pin timeout, session end)"))
        elif op.kind is OpKind.LOAD and self.host is not None:
            gen = self.host.gen
            gens = struct.pack(f"<{len(op.slots)}Q", *(gen(s) if s >= 0 else 0 for s in op.slots))
            req.resolve(wire.TierSlots(op.op, tuple(op.slots), gens))
        else:
            req.resolve(wire.TierSlots(op.op, tuple(op.slots)))

    def _retry_waiters(self) -> None:
        for op in list(self.waiters.values()):
            self._place(op)

    @property
    def _demoting_on(self) -> bool:
        return self.disk is not None and self.cfg.demote_on_evict

    def _evicted(self, victim: Evicted | None) -> None:
        if victim is not None:
            self._count("tiers_host_evictions")
            if not victim.on_disk:
                self._count("tiers_host_dropped")

    def _release(self, op_id: int, *, quarantine: bool = False) -> None:
        """Drop what an operation holds: a store's uncommitted reservations, a load's pins
        (blocks still being read from disk are released when the read ends).
        `quarantine`: its client may still write into the store's slots (the operation
        expired, or its session timed out): they are kept out of use (`_Quarantine`).
        A load's pins go in any case: a reader that copies out later sees the slots'
        generations changed (`kvd_client.tiers`)."""
        op = self.ops.close(op_id)
        host = self.host
        if op is None or host is None:
            return
        op.released = True
        waiting = set(op.waiting)
        op.waiting = []
        self.waiters.pop(op.op, None)
        read_by_client: list[TierKey] = []
        lent: list[int] = []
        for i, (k, slot) in enumerate(zip(op.keys, op.slots, strict=True)):
            if slot == wire.SLOT_FILE:
                if self.disk is not None and self.disk.unpin(k):
                    # found bad while this client had it pinned: its last reader is gone
                    _unlink(block_path(self.disk_root, k))
                read_by_client.append(k)
                continue
            if slot < 0 or i in waiting or (k, slot) in op.pending:
                continue
            if op.kind is OpKind.STORE:
                if quarantine and op.answered:
                    lent.append(host.detach(k))
                else:
                    host.abort(k)
            else:
                host.unpin(k)
        if lent:
            self.quarantine.setdefault(op.session, _Quarantine()).by_op[op.op] = lent
            self._count("tiers_quarantined", len(lent))
            log.warning("tiers_slots_quarantined", session=op.session, op=op.op, slots=len(lent))
        self._answer(op)
        if read_by_client and self.cfg.promote_on_hit:
            self._promote(read_by_client)
        self._keep_free()
        self._retry_waiters()

    def _return_lent(self, session: str, lent: set[int], *, quarantine: bool) -> None:
        """The slots lent to a session that ended: free, or (it may still be copying into
        them: timed out) quarantined."""
        if quarantine:
            self.quarantine.setdefault(session, _Quarantine()).by_op[LENT] = sorted(lent)
            self._count("tiers_quarantined", len(lent))
            log.warning("tiers_slots_quarantined", session=session, lent=len(lent))
            return
        host = self.host
        assert host is not None
        for slot in lent:
            host.give_back(slot)
        self._retry_waiters()

    def _give_back(self, session: str, slots: list[int]) -> None:
        host = self.host
        assert host is not None
        for slot in slots:
            host.give_back(slot)
        self._count("tiers_quarantine_released", len(slots))
        q = self.quarantine.get(session)
        if q is not None and not q.by_op:
            del self.quarantine[session]
        self._retry_waiters()

    def _end_quarantine(self, session: str) -> None:
        """The session's client is done with every slot it was given (or gone)."""
        q = self.quarantine.pop(session, None)
        if q is not None:
            self._give_back(session, [s for slots in q.by_op.values() for s in slots])

    def _check_quarantine(self) -> None:
        """Give back the slots of timed-out sessions whose process is gone."""
        for session, q in list(self.quarantine.items()):
            if q.timed_out and q.pid > 0 and not pid_alive(q.pid):
                log.info("tiers_quarantine_process_gone", session=session, pid=q.pid)
                self._end_quarantine(session)

    def _promote(self, keys: list[TierKey]) -> None:
        """Bring disk blocks that a client read from their files into the host tier
        (`promote_on_hit`), in the background, once that load is over: read into free
        slots (or slots of blocks already on disk), never waiting for the demoter."""
        host, disk = self.host, self.disk
        assert host is not None and disk is not None
        todo = [k for k in dict.fromkeys(keys) if k not in host and disk.ready(k)]
        if not todo:
            return
        op = self.ops.open(PROMOTE_SESSION, OpKind.LOAD, self.clock.now() + self.cfg.pin_timeout)
        op.keys = todo
        op.slots = [wire.SLOT_HELD] * len(todo)
        op.waiting = list(range(len(todo)))
        self._place(op)
        # released at once: reads under way end in the host tier (their pins dropped as
        # they end), blocks that found no slot are not promoted
        self._count("tiers_promote_no_room", len(op.waiting))
        self._release(op.op)

    # ---------------------------------------------------------------- peers: asking

    def _asked_peers(self) -> list[PeerInfo]:
        """The peers a local miss is looked up in, by agent name."""
        agents = set(self.configured.values())
        if self.cfg.ask_known_peers:
            agents |= set(self.peer_view)
        return [self.peer_view[a] for a in sorted(agents) if a in self.peer_view]

    def _loadable(self, info: PeerInfo) -> bool:
        """Whether we can load this peer's blocks without a READ UCX would emulate: a
        block larger than an inline answer holds, from a peer we cannot READ natively,
        is never asked for (its keys stay misses: the engine recomputes them)."""
        if self.slot_bytes <= self.inline_budget or not readpath.by_write(
            self.pull_by, info.native_reads
        ):
            return True
        self._count("tiers_peer_skipped_emulated")
        if not self._warned_large:
            self._warned_large = True
            log.warning(
                "tiers_peer_block_too_large_inline",
                peer=info.agent,
                block_bytes=self.slot_bytes,
                inline_budget=self.inline_budget,
                hint="a READ from this peer would be emulated (TCP); raise "
                "daemon.max_frame_bytes above the block size plus 1 MiB to load inline",
            )
        return False

    def _lookup_with_peers(
        self, req: ClientRequest, m: wire.TierLookup, keys: list[TierKey], found: bytes
    ) -> None:
        """Answer now when every key hit locally or no peer is asked; else ask the peers
        for the misses (one batch each) in a task, and answer from its notice."""
        miss = [i for i, f in enumerate(found) if f == wire.TIER_MISS]
        peers = [info for info in self._asked_peers() if self._loadable(info)] if miss else []
        if not peers:
            req.resolve(wire.TierFound(found))
            return
        q = wire.PeerTierLookup(
            self.agent_name,
            m.namespace,
            self.slot_bytes,
            m.key_bytes,
            b"".join(keys[i][1] for i in miss),
        )
        assert self._tg is not None
        self._tg.start_soon(self._ask_peers, req, keys, found, miss, peers, q)

    async def _ask_peers(
        self,
        req: ClientRequest,
        keys: list[TierKey],
        found: bytes,
        miss: list[int],
        peers: list[PeerInfo],
        q: wire.PeerTierLookup,
    ) -> None:
        answers: dict[str, bytes] = {}

        async def one(info: PeerInfo) -> None:
            self._count("tiers_peer_lookups")
            try:
                reply = await self.link.ask(
                    info.agent, info.host, info.port, q, self.cfg.peer_lookup_timeout
                )
            except KvdError as exc:
                kind = "timeouts" if isinstance(exc, Timeout) else "unreachable"
                self._count(f"tiers_peer_{kind}")
                log.debug("tiers_peer_lookup_failed", peer=info.agent, error=exc.message)
                return
            why = (
                found_problem(reply.found, len(miss))
                if isinstance(reply, wire.TierFound)
                else f"a {type(reply).__name__}, not TierFound"
            )
            if why is not None:
                self._bad_answer(info.agent, why)
                return
            assert isinstance(reply, wire.TierFound)
            answers[info.agent] = reply.found

        try:
            async with anyio.create_task_group() as tg:
                for info in peers:
                    tg.start_soon(one, info)
        finally:
            self.mailbox.post(_PeersAnswered(req, keys, found, miss, answers))

    def _bad_answer(self, agent: str, why: str) -> None:
        self.rejects.reject(
            "tiers",
            "tiers_peer_bad_answers",
            "tiers_peer_answer_rejected",
            "invalid",
            level="warning",
            peer=agent,
            error=why,
        )

    def _peers_answered(self, msg: _PeersAnswered) -> None:
        picks = pick_peers(len(msg.miss), msg.answers)
        out = bytearray(msg.found)
        hits = 0
        for i, agent in zip(msg.miss, picks, strict=True):
            if agent is not None:
                out[i] = wire.TIER_PEER
                self.hints.note(msg.keys[i], agent)
                hits += 1
        self._count("tiers_peer_hits", hits)
        self._count("tiers_peer_misses", len(msg.miss) - hits)
        msg.req.resolve(wire.TierFound(bytes(out)))

    def _start_peer_load(self, op: Op, agent: str, idxs: list[int]) -> None:
        """Reserve local slots for keys a peer holds and READ them in a task (pending)."""
        host = self.host
        info = self.peer_view.get(agent)
        assert host is not None
        if info is None or not self._loadable(info):  # (its view changed since it was asked)
            self._count("tiers_peer_load_failed", len(idxs))
            return
        inline = readpath.by_write(self.pull_by, info.native_reads)
        reads: list[tuple[int, TierKey, int]] = []
        for i in idxs:
            k = op.keys[i]
            got = host.reserve(
                k, transient=not self.cfg.promote_on_hit, evict_dirty=not self._demoting_on
            )
            if got is Reserve.HELD:  # stored or being loaded meanwhile
                slot = host.pin(k)
                if slot is not None:
                    op.slots[i] = slot
                continue
            if got is Reserve.FULL:
                self._count("tiers_peer_no_room")
                continue
            assert not isinstance(got, Reserve)
            slot, victim = got
            self._evicted(victim)
            op.slots[i] = slot
            op.pending.add((k, slot))
            reads.append((i, k, slot))
        if reads:
            self.peer_reading += len(reads)
            assert self._tg is not None
            if not inline:
                self._tg.start_soon(self._peer_load, op, info, reads, False)
                return
            # Our READ from this peer would be UCX's emulation (`kvd.core.readpath`), which
            # aborts the peer if we die with READs queued at it: the blocks come inline,
            # each answer carrying at most `per` of them.
            per = self.inline_budget // self.slot_bytes
            for at in range(0, len(reads), per):
                self._tg.start_soon(self._peer_load, op, info, reads[at : at + per], True)

    async def _peer_load(
        self, op: Op, info: PeerInfo, reads: list[tuple[int, TierKey, int]], inline: bool
    ) -> None:
        """Pin on the peer, READ into our slots (or copy the blocks its answer carries:
        `inline`), check, unpin (always posts its notice)."""
        results: list[tuple[int, TierKey, int, bool, str]] = []
        pinned: wire.PeerTierPinned | None = None
        try:
            ns, kb = reads[0][1][0], len(reads[0][1][1])
            q = wire.PeerTierPin(
                self.agent_name,
                self.incarnation,
                ns,
                self.slot_bytes,
                kb,
                b"".join(k[1] for _, k, _ in reads),
                inline=inline,
            )
            try:
                ans = await self.link.ask(
                    info.agent, info.host, info.port, q, self.cfg.peer_read_timeout
                )
            except KvdError as exc:
                self._count(
                    "tiers_peer_timeouts" if isinstance(exc, Timeout) else "tiers_peer_unreachable"
                )
                results = [(i, k, s, False, f"pin: {exc.message}") for i, k, s in reads]
                return
            why = (
                pinned_problem(ans, len(reads), self.slot_bytes, PEER_CHECKSUMS)
                if isinstance(ans, wire.PeerTierPinned)
                else f"a {type(ans).__name__}, not PeerTierPinned"
            )
            if isinstance(ans, wire.PeerTierPinned):
                pinned = ans
                if why is None:
                    why = _inline_problem(ans, inline, self.slot_bytes)
            if why is not None:
                self._bad_answer(info.agent, why)
                results = [(i, k, s, False, why) for i, k, s in reads]
                return
            assert pinned is not None
            if inline:
                results = await anyio.to_thread.run_sync(self._copy_inline, reads, pinned)
                self._count("tiers_peer_inline_blocks", sum(s >= 0 for s in pinned.slots))
            else:
                results = await self._peer_read(info, reads, pinned)
        finally:
            if pinned is not None and pinned.op:  # (op 0: nothing was opened there)
                self.link.tell(
                    info.agent, info.host, info.port, wire.PeerTierUnpin(self.agent_name, pinned.op)
                )
            self.mailbox.post(_PeerLoaded(op, info.agent, results))

    async def _peer_read(
        self, info: PeerInfo, reads: list[tuple[int, TierKey, int]], ans: wire.PeerTierPinned
    ) -> list[tuple[int, TierKey, int, bool, str]]:
        sb = self.slot_bytes
        hits = [(j, r) for j, r in enumerate(reads) if ans.slots[j] >= 0]
        out = [
            (i, k, s, False, "a miss on the peer")
            for j, (i, k, s) in enumerate(reads)
            if ans.slots[j] < 0
        ]
        if not hits:
            return out
        local = np.array(
            [[self.pool_addr + s * sb, sb, 0] for _, (_, _, s) in hits], dtype=np.int64
        )
        remote = np.array(
            [[ans.pool_addr + ans.slots[j] * sb, sb, 0] for j, _ in hits], dtype=np.int64
        )
        try:
            await self.engine.transfer(
                "READ", local, remote, info.agent, b"", self.cfg.peer_read_timeout, len(hits) * sb
            )
        except Unsettled:
            return out + [(i, k, s, False, UNSETTLED) for _, (i, k, s) in hits]
        except KvdError as exc:
            if isinstance(exc, PeerDisconnected) and self.registrar is not None:
                self.registrar.post(
                    PeerLost(info.agent, exc.message, info.handshaked_at, endpoint=True)
                )
            return out + [(i, k, s, False, f"read: {exc.message}") for _, (i, k, s) in hits]
        checked = await anyio.to_thread.run_sync(self._check_peer_sums, hits, ans)
        return out + checked

    def _copy_inline(
        self, reads: list[tuple[int, TierKey, int]], ans: wire.PeerTierPinned
    ) -> list[tuple[int, TierKey, int, bool, str]]:
        """An inline answer's blocks into our slots (ours alone: nothing else writes them,
        and an answer that came too late was dropped), each checked against its checksum."""
        assert self.pool is not None
        sb = self.slot_bytes
        hits = [(j, r) for j, r in enumerate(reads) if ans.slots[j] >= 0]
        data = memoryview(ans.data)
        for n, (_, (_, _, s)) in enumerate(hits):
            self.pool.buf[s * sb : (s + 1) * sb] = data[n * sb : (n + 1) * sb]
        out = [
            (i, k, s, False, "a miss on the peer")
            for j, (i, k, s) in enumerate(reads)
            if ans.slots[j] < 0
        ]
        return out + self._check_peer_sums(hits, ans)

    def _check_peer_sums(
        self, hits: list[tuple[int, tuple[int, TierKey, int]]], ans: wire.PeerTierPinned
    ) -> list[tuple[int, TierKey, int, bool, str]]:
        assert self.pool is not None
        sb = self.slot_bytes
        out = []
        for j, (i, k, s) in hits:
            want = int.from_bytes(ans.checksums[8 * j : 8 * j + 8], "little")
            got = block_checksum(ans.checksum_kind, self.pool.buf[s * sb : (s + 1) * sb], k)
            out.append((i, k, s, got == want, "" if got == want else "checksum mismatch"))
        return out

    def _peer_loaded(self, msg: _PeerLoaded) -> None:
        host = self.host
        op = msg.op
        assert host is not None
        self.peer_reading -= len(msg.results)
        good = 0
        for i, k, slot, ok, why in msg.results:
            op.pending.discard((k, slot))
            if why == UNSETTLED:  # the slot stays reserved for good: NIXL may write it
                self._count("tiers_slots_unsettled")
                op.slots[i] = wire.SLOT_HELD
                continue
            if ok:
                host.commit(k, keep_pin=True)
                good += 1
                if op.released:
                    host.unpin(k)
                continue
            host.abort(k)
            op.slots[i] = wire.SLOT_HELD
            if why == "checksum mismatch":
                self._count("tiers_peer_checksum_mismatch")
                self._bad_answer(
                    msg.agent, f"block {k[1].hex()[:16]}: the bytes READ fail its checksum"
                )
            self._count("tiers_peer_load_failed")
        self._count("tiers_peer_bytes_in", good * self.slot_bytes)
        self._count("tiers_peer_blocks_loaded", good)
        self._count("tiers_blocks_loaded", good)
        if self.cfg.promote_on_hit:
            self._count("tiers_peer_blocks_promoted", good)
        self._answer(op)
        self._keep_free()
        self._retry_waiters()

    async def _dial_peers(self) -> None:
        """Handshake (through the registrar) with configured peers not known yet."""
        assert self.registrar is not None
        assert self._side_ready is not None
        await self._side_ready.wait()
        while True:
            for host, port in self.cfg.peer_addrs:
                addr = f"{host}:{port}"
                if self.configured.get(addr) in self.peer_view:
                    continue
                try:
                    info = await self.registrar.call(EnsurePeer(host, port))
                except KvdError as exc:
                    self._count("tiers_peer_dial_failed")
                    log.debug("tiers_peer_dial_failed", addr=addr, error=exc.message)
                    continue
                self.mailbox.post(_PeerDialed(addr, info))
            await anyio.sleep(PEER_DIAL_INTERVAL)

    def _late_answer(self, agent: str, reply: wire.Record) -> None:
        """A pin answer after its load gave up: release what it pinned for us."""
        if isinstance(reply, wire.PeerTierPinned) and reply.op:
            info = self.peer_view.get(agent)
            if info is not None:
                self.link.tell(
                    agent, info.host, info.port, wire.PeerTierUnpin(self.agent_name, reply.op)
                )

    def _peer_updated(self, msg: PeerUpdated) -> None:
        """A peer's view changed: forgotten (gone) or a new incarnation drops its pins."""
        held = self.peer_sessions.get(msg.agent)
        if msg.info is None:
            self.peer_view.pop(msg.agent, None)
            self.hints.forget_peer(msg.agent)
            for addr in [a for a, g in self.configured.items() if g == msg.agent]:
                del self.configured[addr]
            self.link.forget(msg.agent)  # (ZMQ would redial its address for good)
        else:
            self.peer_view[msg.agent] = msg.info
            self.link.forget(msg.agent, keep=(msg.info.host, msg.info.port))  # moved?
            if self.cfg.ask_known_peers or msg.agent in self.configured.values():
                self.link.prepare(msg.agent, msg.info.host, msg.info.port)
        if held is not None and (msg.info is None or msg.info.incarnation != held):
            self._release_peer(msg.agent)

    def _release_peer(self, agent: str) -> None:
        self.peer_sessions.pop(agent, None)
        ops = self.ops.of_session(PEER_SESSION + agent)
        if ops:
            self._count("tiers_peer_pins_released_gone", len(ops))
            log.info("tiers_peer_pins_released", peer=agent, ops=len(ops))
        for op in ops:
            self._release(op)

    # ---------------------------------------------------------------- peers: serving

    def _peer_request(self, req: PeerTierRequest) -> None:
        m = req.msg
        if isinstance(m, wire.PeerTierUnpin):
            op = self.ops.get(m.op)
            if op is None or op.session != PEER_SESSION + req.agent:
                raise NotFound(f"no tier operation {m.op} of {req.agent}")
            self._release(m.op)
            req.resolve(wire.Ok())
            return
        if len(m.keys) % m.key_bytes:
            raise InvalidRequest(f"keys are not a multiple of key_bytes ({m.key_bytes})")
        n = len(m.keys) // m.key_bytes
        if n > wire.MAX_TIER_KEYS:
            raise InvalidRequest(f"{n} keys in one batch (at most {wire.MAX_TIER_KEYS})")
        kb, blob, ns = m.key_bytes, m.keys, m.namespace
        keys = [(ns, blob[i : i + kb]) for i in range(0, n * kb, kb)]
        host, disk = self.host, self.disk
        serving = (
            self.enabled
            and self.pool is not None
            and host is not None
            and m.block_bytes == self.slot_bytes
        )
        if isinstance(m, wire.PeerTierLookup):
            out = bytearray(n)
            if serving:
                assert host is not None
                for i, k in enumerate(keys):
                    if host.ready(k):
                        out[i] = wire.TIER_HOST
                    elif disk is not None and disk.ready(k) and disk.nbytes(k) == self.slot_bytes:
                        out[i] = wire.TIER_DISK
            self._count("tiers_peer_served_lookups")
            self._count("tiers_peer_served_keys", n)
            self._count("tiers_peer_served_hits", n - out.count(0))
            req.resolve(wire.TierFound(bytes(out)))
            return
        self._count("tiers_peer_served_pins")
        if not serving:
            req.resolve(self._pinned(0, (wire.SLOT_HELD,) * n, b"\0" * (8 * n)))
            return
        held = self.peer_sessions.get(req.agent)
        if held is not None and held != m.incarnation:  # it restarted: its old pins go
            self._release_peer(req.agent)
        self.peer_sessions[req.agent] = m.incarnation
        pinned = sum(
            len(op.keys)
            for o in self.ops.of_session(PEER_SESSION + req.agent)
            if (op := self.ops.get(o)) is not None
        )
        share = max(1, int(self.cfg.peer_pin_share * (self.cfg.host_bytes // self.slot_bytes)))
        if pinned + n > share:  # bounded in number as well as in time
            self._count("tiers_peer_pins_refused", n)
            req.resolve(self._pinned(0, (wire.SLOT_HELD,) * n, b"\0" * (8 * n)))
            return
        inner = ClientRequest(PEER_SESSION + req.agent, wire.TierPin(ns, kb, blob))
        self._pin(inner, keys, peer=req.agent)
        assert self._tg is not None
        self._tg.start_soon(self._answer_peer_pin, req, inner, keys)

    def _pinned(self, op: int, slots: tuple[int, ...], sums: bytes) -> wire.PeerTierPinned:
        kind = CHECKSUMS["crc32" if self.cfg.disk_checksum == "crc32" else "sum64"]
        return wire.PeerTierPinned(
            op, self.pool_addr, self.cfg.host_bytes, self.slot_bytes, slots, kind, sums
        )

    async def _answer_peer_pin(
        self, req: PeerTierRequest, inner: ClientRequest, keys: list[TierKey]
    ) -> None:
        """The pins' answer, with each pinned block's checksum (computed off the loop:
        the blocks cannot change while pinned)."""
        try:
            got = await inner.reply
        except KvdError as exc:
            req.fail(exc)
            return
        assert isinstance(got, wire.TierSlots)
        probe = self._pinned(0, (), b"")
        if isinstance(req.msg, wire.PeerTierPin) and req.msg.inline:
            # the blocks go in the answer (copied while pinned), and nothing stays pinned
            slots = _fit(got.slots, self.inline_budget // self.slot_bytes)
            try:
                sums, data = await anyio.to_thread.run_sync(
                    self._peer_copy, probe.checksum_kind, slots, keys
                )
            finally:
                self.mailbox.post(_Unpin(got.op))
            self._count("tiers_peer_bytes_out", len(data))
            self._count("tiers_peer_inline_served", sum(s >= 0 for s in slots))
            req.resolve(replace(self._pinned(0, slots, sums), data=data))
            return
        sums = await anyio.to_thread.run_sync(self._peer_sums, probe.checksum_kind, got.slots, keys)
        self._count("tiers_peer_bytes_out", sum(s >= 0 for s in got.slots) * self.slot_bytes)
        req.resolve(self._pinned(got.op, got.slots, sums))

    def _peer_copy(
        self, kind: int, slots: tuple[int, ...], keys: list[TierKey]
    ) -> tuple[bytes, bytes]:
        """The checksums of the pinned blocks, and their bytes (hits, in key order)."""
        assert self.pool is not None
        sb = self.slot_bytes
        data = b"".join(bytes(self.pool.buf[s * sb : (s + 1) * sb]) for s in slots if s >= 0)
        return self._peer_sums(kind, slots, keys), data

    def _peer_sums(self, kind: int, slots: tuple[int, ...], keys: list[TierKey]) -> bytes:
        assert self.pool is not None
        sb = self.slot_bytes
        out = bytearray()
        for s, k in zip(slots, keys, strict=True):
            c = block_checksum(kind, self.pool.buf[s * sb : (s + 1) * sb], k) if s >= 0 else 0
            out += c.to_bytes(8, "little")
        return bytes(out)

    # ---------------------------------------------------------------- disk: loads

    async def _read_disk(self, op: Op, reads: list[tuple[TierKey, int]]) -> None:
        results: list[tuple[TierKey, int, bool, str]] = []
        fds: list[tuple[TierKey, int, int]] = []  # key, slot, fd
        try:
            # off the event loop: opening files and reading their trailers may wait for
            # the disk (a cold page cache); a trailer is read after the data, so that
            # the data's read comes first and the trailer then is usually read ahead
            fds, bad = await anyio.to_thread.run_sync(self._open_blocks, reads)
            results.extend(bad)
            if fds:
                pieces = [
                    (self.pool_addr + s * self.slot_bytes, self.slot_bytes, fd) for _, s, fd in fds
                ]
                try:
                    timing = await self._file_io("READ", pieces)
                    checks, check_s = await anyio.to_thread.run_sync(self._check_blocks, fds)
                    # where a disk load's time goes (`kvd bench`): NIXL's read (from its
                    # start on the NIXL thread: no queueing), the checks
                    self._count("tiers_disk_read_us", round(timing.xfer_s * 1e6))
                    self._count("tiers_disk_check_us", round(check_s * 1e6))
                    results.extend(checks)
                except Unsettled:
                    # NIXL may still write into these slots and read these fds: both are
                    # kept (the slots never reused, the fds never closed: counted)
                    results.extend((k, s, False, UNSETTLED) for k, s, _ in fds)
                    fds = []
                except KvdError as exc:
                    results.extend((k, s, False, f"io: {exc.message}") for k, s, _ in fds)
        finally:
            for _, _, fd in fds:
                os.close(fd)
            self.mailbox.post(_DiskDone(op, True, results))

    async def _file_io(self, op: str, pieces: list[tuple[int, int, int]]) -> XferTiming:
        """A NIXL file transfer into or out of the pool, shielded from cancellation: at
        shutdown the pool is deregistered and unmapped only after the NIXL thread is done
        with it (bounded: the thread fails a transfer after DISK_IO_TIMEOUT)."""
        with anyio.CancelScope(shield=True):
            timing = await self.engine.file_transfer(op, pieces, DISK_IO_TIMEOUT)
        return timing

    def _open_blocks(
        self, reads: list[tuple[TierKey, int]]
    ) -> tuple[list[tuple[TierKey, int, int]], list[tuple[TierKey, int, bool, str]]]:
        """(key, slot, fd) of the block files of the right size; (key, slot, False, why)
        of the others (missing, or the wrong length: never read)."""
        good: list[tuple[TierKey, int, int]] = []
        bad: list[tuple[TierKey, int, bool, str]] = []
        for k, slot in reads:
            path = block_path(self.disk_root, k)
            try:
                fd = os.open(path, os.O_RDWR)
            except OSError as exc:
                bad.append((k, slot, False, f"open: {exc.strerror}"))
                continue
            try:
                size = os.fstat(fd).st_size
            except OSError as exc:
                os.close(fd)
                bad.append((k, slot, False, f"stat: {exc.strerror}"))
                continue
            if size != self.slot_bytes + len(k[0]) + len(k[1]) + TRAILER.size:
                os.close(fd)
                bad.append((k, slot, False, "wrong length"))
                continue
            good.append((k, slot, fd))
        return good, bad

    def _check_blocks(
        self, fds: list[tuple[TierKey, int, int]]
    ) -> tuple[list[tuple[TierKey, int, bool, str]], float]:
        """Each block read into its slot checked against its file's trailer: the key, the
        length, and the checksum it recorded (`tiers.disk_checksum = "none"`: not the
        checksum); and the seconds that took."""
        assert self.pool is not None
        started = time.perf_counter()
        out: list[tuple[TierKey, int, bool, str]] = []
        for k, slot, fd in fds:
            size = self.slot_bytes + len(k[0]) + len(k[1]) + TRAILER.size
            try:
                got = read_trailer(fd, size)
            except OSError as exc:
                got = f"read: {exc.strerror}"
            if isinstance(got, str) or got[0] != k or got[1] != self.slot_bytes:
                out.append((k, slot, False, got if isinstance(got, str) else "names another block"))
                continue
            kind, want = got[2]
            if kind == CHECKSUMS["none"] or self.cfg.disk_checksum == "none":
                out.append((k, slot, True, ""))
                continue
            off = slot * self.slot_bytes
            sum_ = block_checksum(kind, self.pool.buf[off : off + self.slot_bytes], k)
            out.append((k, slot, sum_ == want, "" if sum_ == want else "checksum mismatch"))
        return out, time.perf_counter() - started

    def _read_done(self, msg: _DiskDone) -> None:
        host, disk = self.host, self.disk
        op = msg.op
        assert host is not None and disk is not None and op is not None
        self.reading -= len(msg.results)
        good = 0
        index = {k: i for i, k in enumerate(op.keys)}
        for k, slot, ok, why in msg.results:
            op.pending.discard((k, slot))
            if disk.unpin(k):  # condemned by another read meanwhile: this was its last reader
                _unlink(block_path(self.disk_root, k))
            if why == UNSETTLED:  # the slot stays reserved for good: NIXL may write it
                self._count("tiers_slots_unsettled")
                op.slots[index[k]] = wire.SLOT_HELD
                continue
            if ok:
                host.commit(k, keep_pin=True)
                good += 1
                if op.released:
                    host.unpin(k)
                continue
            host.abort(k)
            if disk.remove(k):  # (else condemned: deleted when its last reader unpins it)
                _unlink(block_path(self.disk_root, k))
            self._count("tiers_disk_corrupt")
            self.rejects.reject(
                "tiers",
                "tiers_disk_bad_files",
                "tiers_disk_block_bad",
                "bad_file",
                level="warning",
                error=why,
            )
            op.slots[index[k]] = wire.SLOT_HELD
        self._count("tiers_blocks_promoted", good)
        if op.session != PROMOTE_SESSION:  # (a client's read of those files was counted)
            self._count("tiers_disk_bytes_out", good * self.slot_bytes)
            self._count("tiers_blocks_loaded", good)
        self._answer(op)
        self._keep_free()
        self._retry_waiters()

    # ---------------------------------------------------------------- disk: demotion

    def _keep_free(self) -> None:
        """Keep `low_water` of the host slots free (and as many as waiting loads need):
        evict blocks already on disk, write the others to disk first (one batch at a
        time), or drop them (no disk tier, or demotion off)."""
        host, disk = self.host, self.disk
        if host is None:
            return
        target = math.ceil(self.cfg.low_water * host.num_slots)
        target = max(target, sum(len(op.waiting) for op in self.waiters.values()))
        need = target - host.free_slots - self.demoting
        if need <= 0:
            return
        for ev in host.evict_clean(need):
            self._evicted(ev)
            need -= 1
        if need <= 0:
            return
        if not self._demoting_on:
            for k in host.victims(need):
                self._evicted(host.evict(k))
            return
        if self.demoting:
            return  # one batch at a time; its end calls us again
        assert disk is not None
        writes: list[tuple[TierKey, int]] = []
        for k in host.victims(min(need, DEMOTE_BATCH)):
            got = disk.begin_write(k, self.slot_bytes)
            if got is Reserve.HELD:  # (a file of an earlier life of this block)
                host.mark_on_disk(k)
                self._evicted(host.evict(k))
                continue
            if got is Reserve.FULL:
                self._count("tiers_disk_full")
                self._evicted(host.evict(k))
                continue
            assert isinstance(got, list)
            for old in got:
                _unlink(block_path(self.disk_root, old))
                self._count("tiers_disk_evictions")
            slot = host.pin(k)
            assert slot is not None
            writes.append((k, slot))
        if writes:
            self.demoting += len(writes)
            assert self._tg is not None
            self._tg.start_soon(self._write_disk, writes)

    async def _write_disk(self, writes: list[tuple[TierKey, int]]) -> None:
        leaked = False
        results: list[tuple[TierKey, int, bool, str]] = []
        opened: list[tuple[TierKey, int, int, str]] = []  # key, slot, fd, temp path
        try:
            for k, slot in writes:
                final = block_path(self.disk_root, k)
                tmp = f"{final}.{secrets.token_hex(4)}{TMP_SUFFIX}"
                try:
                    os.makedirs(os.path.dirname(final), exist_ok=True)
                    fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                except OSError as exc:
                    results.append((k, slot, False, f"open: {exc.strerror}"))
                    continue
                opened.append((k, slot, fd, tmp))
            if opened:
                pieces = [
                    (self.pool_addr + s * self.slot_bytes, self.slot_bytes, fd)
                    for _, s, fd, _ in opened
                ]
                try:
                    await self._file_io("WRITE", pieces)
                    results.extend(await anyio.to_thread.run_sync(self._seal_files, opened))
                except Unsettled:
                    # NIXL may still write to these fds: never closed (a closed number
                    # could name another file by then); the temp files are unlinked
                    results.extend((k, s, False, UNSETTLED) for k, s, _, _ in opened)
                    leaked = True
                except KvdError as exc:
                    results.extend((k, s, False, f"io: {exc.message}") for k, s, _, _ in opened)
        finally:
            for _, _, fd, _ in opened:
                if not leaked:
                    os.close(fd)
            ok_keys = {k for k, _, ok, _ in results if ok}
            for k, _, _, tmp in opened:
                if k not in ok_keys:
                    _unlink(tmp)
            self.mailbox.post(_DiskDone(None, False, results))

    def _seal_files(
        self, opened: list[tuple[TierKey, int, int, str]]
    ) -> list[tuple[TierKey, int, bool, str]]:
        """Trailer written, then renamed into place: only a whole block is ever served."""
        assert self.pool is not None
        out = []
        for k, slot, fd, tmp in opened:
            off = slot * self.slot_bytes
            kind = CHECKSUMS[self.cfg.disk_checksum]
            data = self.pool.buf[off : off + self.slot_bytes]
            tail = trailer_of(k, self.slot_bytes, kind, block_checksum(kind, data, k))
            try:
                if os.pwrite(fd, tail, self.slot_bytes) != len(tail):
                    raise OSError(errno.ENOSPC, "short write")
                os.rename(tmp, block_path(self.disk_root, k))
            except OSError as exc:
                out.append((k, slot, False, f"write: {exc.strerror}"))
                continue
            out.append((k, slot, True, ""))
        return out

    def _write_done(self, msg: _DiskDone) -> None:
        host, disk = self.host, self.disk
        assert host is not None and disk is not None
        self.demoting -= len(msg.results)
        for k, _, ok, why in msg.results:
            disk.finish_write(k, ok)
            host.unpin(k)
            if ok:
                host.mark_on_disk(k)
                self._count("tiers_disk_bytes_in", self.slot_bytes)
                self._count("tiers_blocks_demoted")
            else:
                self._count("tiers_disk_write_failed")
                self.rejects.reject(
                    "tiers",
                    "tiers_disk_write_errors",
                    "tiers_disk_write_failed",
                    "write_failed",
                    level="warning",
                    error=why,
                )
            self._evicted(host.evict(k))
        self._keep_free()
        self._retry_waiters()

    # ---------------------------------------------------------------- status

    def snapshot(self) -> dict[str, Any]:
        host, disk = self.host, self.disk
        out: dict[str, Any] = {"enabled": self.enabled}
        if not self.enabled:
            return out
        c = self.counters
        slots = host.num_slots if host is not None else 0
        quarantined = sum(len(s) for q in self.quarantine.values() for s in q.by_op.values())
        used = (len(host) if host is not None else 0) * self.slot_bytes
        out["pool"] = self.pool.name if self.pool is not None else ""
        out["block_bytes"] = self.slot_bytes
        out["pending_lookups"] = self.mailbox.depth()
        out["counters"] = {
            name[len("tiers_") :]: v for name, v in sorted(c.items()) if name.startswith("tiers_")
        }
        out["ops_open"] = len(self.ops)
        out["host"] = {
            "capacity": self.cfg.host_bytes,
            "slots": slots,
            "used": used,
            "blocks": len(host) if host is not None else 0,
            "free_slots": host.free_slots if host is not None else 0,
            "quarantined": quarantined,
            "lent": (host.lent if host is not None else 0) - quarantined,
            "hits": c.get("tiers_host_hits", 0),
            "misses": c.get("tiers_host_misses", 0),
            "evictions": c.get("tiers_host_evictions", 0),
            "bytes_in": c.get("tiers_host_bytes_in", 0),
            "bytes_out": c.get("tiers_host_bytes_out", 0),
            "demoting": self.demoting,
            # blocks clients load without a round trip; `unpublished`: blocks that found no
            # free directory entry (their loads are pinned)
            "directory": {
                "blocks": len(self.directory) if self.directory is not None else 0,
                "unpublished": self.directory.unpublished if self.directory is not None else 0,
                "direct_loads": c.get("tiers_direct_loads", 0),
            },
        }
        if disk is not None:
            out["disk"] = {
                "path": self.disk_root,
                "capacity": disk.capacity,
                "used": disk.used,
                "blocks": len(disk),
                "hits": c.get("tiers_disk_hits", 0),
                "misses": c.get("tiers_disk_misses", 0),
                "evictions": c.get("tiers_disk_evictions", 0),
                "bytes_in": c.get("tiers_disk_bytes_in", 0),
                "bytes_out": c.get("tiers_disk_bytes_out", 0),
                "reading": self.reading,
            }
        peer_ops = sum(
            len(self.ops.of_session(PEER_SESSION + a)) for a in sorted(self.peer_sessions)
        )
        out["peer"] = {
            "configured": [f"{h}:{p}" for h, p in self.cfg.peer_addrs],
            "ask_known_peers": self.cfg.ask_known_peers,
            "asked": [p.agent for p in self._asked_peers()],
            "sockets": self.link.sockets(),
            "lookups": c.get("tiers_peer_lookups", 0),
            "hits": c.get("tiers_peer_hits", 0),
            "misses": c.get("tiers_peer_misses", 0),
            "timeouts": c.get("tiers_peer_timeouts", 0),
            "bad_answers": c.get("tiers_peer_bad_answers", 0),
            "blocks_loaded": c.get("tiers_peer_blocks_loaded", 0),
            "bytes_in": c.get("tiers_peer_bytes_in", 0),
            "bytes_out": c.get("tiers_peer_bytes_out", 0),
            "reading": self.peer_reading,
            "pins_held": peer_ops,
            "hints": len(self.hints),
        }
        return out

    def gauges(self) -> dict[str, float]:
        """Plain numbers for the metrics exporter (read from its thread)."""
        snap_host = self.host
        out = {
            "host_capacity_bytes": float(self.cfg.host_bytes if self.enabled else 0),
            "host_used_bytes": float(len(snap_host) * self.slot_bytes if snap_host else 0),
            "host_blocks": float(len(snap_host) if snap_host else 0),
        }
        if self.disk is not None:
            out["disk_capacity_bytes"] = float(self.disk.capacity)
            out["disk_used_bytes"] = float(self.disk.used)
            out["disk_blocks"] = float(len(self.disk))
        if self.enabled:
            out["peer_asked"] = float(len(self._asked_peers()))
        return out


__all__ = ["Tiers", "TransferError", "block_path", "scan_disk"]
