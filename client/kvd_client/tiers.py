"""The engine's side of kvd's KV tiers: keep blocks in the node's daemon, find and load them.

A `TierClient` is one session with the local daemon (its own ZMQ DEALER on the daemon's
IPC socket). Blocks are kept under a `namespace` (the model's compatibility hash: two
models never share blocks) and found by key (vLLM's `OffloadKey`: the block hash and
the KV group index, 4 bytes big-endian); one key is one block of `block_bytes`.

The daemon owns the host tier: a shared-memory pool cut into slots. The client maps it
read-write and moves the bytes itself, so a block crosses memory once each way:
- `batch_lookup`: one round trip for the whole batch.
- `store`: the client copies each block into a pool slot the daemon lent it ahead
  (`TierGrant`, asked for at the end of the previous store and answered meanwhile) and
  names the blocks' keys (`TierPut`, sent without waiting for its answer): no round trip.
  Where it holds too few lent slots (its first store, a larger one, a pool with none
  free), the daemon reserves (and pins) a slot per key it does not hold yet, the client
  copies, and a commit makes them visible (one round trip; the commit is one-way). The
  daemon handles a session's messages in order, and a block is visible only once put or
  committed, so only whole. A key the daemon holds already is not stored again (on the
  lent path it was copied for nothing, and its slot goes back).
- `load`: what needs no round trip first: a block the daemon's directory names
  (`kvd_client.tierdir`: the host tier's READY blocks by slot, in shared memory) is
  copied out of the pool and kept if its slot's generation did not change meanwhile;
  where the daemon lets its engines read the disk tier's files (`TierOpened.disk_files`)
  and this client can, a block whose file is there is read straight into its destination
  and checked (`kvd_client.tierfiles.read_block`: one pass over the bytes instead of
  three; a file is immutable once in place, and stays whole for a reader that opened it
  even if the daemon deletes it). Those blocks are named to the daemon in one-way
  `TierTouch`es (recency, promotion, counters). Every other key (a miss here, on a peer,
  a stale copy, a file that is not there or fails its check) is pinned: the daemon pins
  the keys' slots (reading a disk-tier block into one first) or, for a disk hit this
  client may read, the file; the client copies or reads each block; an unpin releases
  them (sent without waiting for its answer). With a disk tier, a pinned load goes in
  parts of about `PART_BYTES`, pipelined: the next parts' pins are sent before a part is
  copied out, so the daemon reads and checks disk-tier blocks while the client copies. A
  pinned file that cannot be read or fails its check is loaded once more through the
  pool, where the daemon finds a bad file bad (a miss, the file removed, counted).
A reservation or pin is held for the session only: if the client dies, its session ends
(its connection is lost; a frozen client: no keep-alive for `client_timeout`) and the
daemon drops its pins; one left longer than the daemon's pin timeout is dropped too.
Nothing stays pinned for a party that is gone. A client that was only slow or frozen is
never served wrong bytes and never writes into another block for it:
- a load's answer (or the directory) names each slot's generation; the daemon bumps a
  slot's generation (in a read-only shared-memory array) before the slot takes any new
  bytes, and the client checks it after its copies: a block copied from a slot reused
  meanwhile is a miss (`stale_reads`; its destination then holds those bytes, as after a
  bad file);
- a store's slots whose operation the daemon dropped before this client said it was done
  with them are not reused until it is: its commit or unpin of that operation, its next
  session (`TierOpen.prev`: every copy of the old one is over), or its process's end.

Every call blocks until the daemon answered or `timeout` passed. Failures raise
`KvdError` (a subclass): the caller treats a failed lookup as all-miss and a failed
load as a failed load (recompute). A session the daemon no longer knows (it restarted,
or timed this one out) is reopened once, transparently, by the next call.

Threads: calls are serialized by an internal lock, so one background thread (or a few)
may use one client; they are meant for one thread at a time and gain nothing from more.
This module imports only the thin client's dependencies (msgpack, pyzmq, the stdlib).
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import secrets
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any, Final

import zmq

from kvd_client import __version__, wire
from kvd_client.errors import (
    DaemonUnavailable,
    InvalidRequest,
    KvdError,
    ProtocolError,
    Timeout,
    error_from_code,
)
from kvd_client.shm import SHM_DIR, check_name, map_for_write
from kvd_client.tierdir import TierDirReader, digester
from kvd_client.tierfiles import can_sum64, read_block

__all__ = ["TierClient"]

ROLE: Final = "tiers"
MAX_BATCH: Final = wire.MAX_TIER_KEYS
"""Keys per message; longer batches are split (one round trip per part)."""
PART_BYTES: Final = 16 << 20
"""A load is pinned in parts of about this many bytes, pipelined (see `_load`)."""


def _flat(buf: memoryview, what: str) -> memoryview:
    """A 1-D byte view of a C-contiguous buffer (raises InvalidRequest otherwise)."""
    mv = buf if isinstance(buf, memoryview) else memoryview(buf)
    if mv.format == "B" and mv.ndim == 1:
        return mv
    if not mv.c_contiguous:
        raise InvalidRequest(f"{what} is not C-contiguous")
    return mv.cast("B")


class TierClient:
    """A session with the local daemon's KV tiers (see the module docstring)."""

    def __init__(
        self,
        socket_path: str,
        namespace: bytes,
        block_bytes: int,
        *,
        timeout: float = 2.0,
        io_timeout: float = 30.0,
    ) -> None:
        """Connect to the daemon at `socket_path` and open the tiers for blocks of
        `block_bytes` under `namespace`. `timeout` bounds each lookup and each unpin;
        `io_timeout` bounds a store's reservation and a load's pin (which may wait for
        the daemon to demote blocks to disk, or read the disk tier) and a commit."""
        if not namespace or len(namespace) > 128:
            raise InvalidRequest("namespace must be 1..128 bytes (the model's compat hash)")
        if block_bytes <= 0:
            raise InvalidRequest(f"block_bytes must be positive, got {block_bytes}")
        self.socket_path: Final = socket_path
        self.namespace: Final = bytes(namespace)
        self.block_bytes: Final = block_bytes
        self.timeout = timeout
        self.io_timeout = max(io_timeout, timeout)
        self._lock = threading.Lock()
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None
        self._corr = itertools.count(1)
        self._session = ""
        self._opened: wire.TierOpened | None = None
        self._pool_mm: mmap.mmap | None = None
        self._pool: memoryview | None = None
        self._gens_mm: mmap.mmap | None = None
        self._gens: memoryview | None = None
        """The slots' generations (uint64 each), mapped read-only."""
        self._dir: TierDirReader | None = None
        """The host tier's directory (`kvd_client.tierdir`), mapped read-only."""
        self._digest = digester(self.namespace)
        """A key's name in the directory."""
        self._ka_stop = threading.Event()
        self._ka_thread: threading.Thread | None = None
        self._keepalive_s = 1.0
        self._expected: set[int] = set()
        """Correlation ids of calls whose replies are awaited."""
        self._replies: dict[int, wire.Record] = {}
        """Replies that arrived while another call's reply was awaited."""
        self._spare: list[int] = []
        """Pool slots the daemon lent this session ahead of its stores (`TierGrant`)."""
        self._granting: int | None = None
        """The correlation id of our grant request under way."""
        self._commits: dict[int, int] = {}
        """One-way commits and puts whose answers have not arrived yet: corr -> blocks."""
        self.commits_refused = 0
        """Blocks whose one-way commit or put the daemon refused (they were not stored)."""
        self.reopened = 0
        """Sessions opened again after the daemon forgot ours (restart, timeout)."""
        self.read_files = True
        """Read disk-tier hits from the daemon's files where the daemon allows it (off:
        every load goes through the pool)."""
        self.files_read = 0
        """Disk-tier blocks read straight from their files into the destination."""
        self.direct_loads = True
        """Load without a round trip the host-tier blocks the daemon's directory names
        (`kvd_client.tierdir`) and the disk-tier blocks whose files this client reads
        (off: every load is pinned)."""
        self.direct_hits = 0
        """Blocks loaded without a pin (through the directory, or from their files)."""
        self.direct_stale = 0
        """Of the blocks copied through the directory, those whose slot was reused while
        they were copied (loaded again the pinned way)."""
        self.directory_unusable = 0
        """Sessions whose directory could not be mapped (their loads were all pinned)."""
        self.stale_reads = 0
        """Blocks copied out of a slot that was reused meanwhile (this client was too slow:
        frozen, or past the pin timeout): misses, never reported loaded."""
        self.files_failed = 0
        """Of those, reads that failed (loaded through the pool instead: a bad file is
        then found bad by the daemon, removed and a miss)."""
        self._files_unreadable = False
        """A file this client could not open was good for the daemon: the client cannot
        read the daemon's files (permissions, another mount namespace); it stops trying."""
        self._session_lost = ""
        """A session the keep-alive thread heard the daemon no longer knows."""
        self._closed = False
        try:
            with self._lock:
                self._open_session()
        except BaseException:
            self.close()
            raise

    # ---------------------------------------------------------------- public calls

    def batch_lookup(self, keys: Sequence[bytes]) -> list[bool]:
        """Per key: is it held (host or disk tier)? One round trip per batch."""
        with self._lock:
            out: list[bool] = []
            for part in _parts(keys):
                res = [False] * len(part)
                for key_bytes, idx, blob in _by_length(part):
                    msg = wire.TierLookup(self.namespace, key_bytes, blob)
                    found = self._retrying(msg, wire.TierFound, self.timeout).found
                    if len(found) != len(idx):
                        raise ProtocolError("lookup answer does not match the batch")
                    if len(idx) == len(part):  # one key length: the answer in order
                        res = [f != wire.TIER_MISS for f in found]
                        continue
                    for i, f in zip(idx, found, strict=True):
                        res[i] = f != wire.TIER_MISS
                out.extend(res)
            return out

    def store(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]:
        """Per key: copied into its slot and committed (or already held). A block is
        `block_bytes`. The commit is one-way (see the module docstring): one the daemon
        refuses (the reservation dropped meanwhile) shows in `commits_refused`."""
        if len(keys) != len(blocks):
            raise InvalidRequest(f"{len(keys)} keys but {len(blocks)} blocks")
        views = [_flat(b, f"block {i}") for i, b in enumerate(blocks)]
        for i, v in enumerate(views):
            if v.nbytes != self.block_bytes:
                raise InvalidRequest(f"block {i} has {v.nbytes} bytes, not {self.block_bytes}")
        with self._lock:
            if self._sock is None:
                self._open_session()
            self._take_grant()
            out = [False] * len(keys)
            for base, part in _indexed_parts(keys):
                for key_bytes, idx, blob in _by_length(part):
                    if len(self._spare) >= len(idx):  # copies, then a one-way put
                        self._put(key_bytes, idx, blob, [views[base + i] for i in idx])
                        for i in idx:
                            out[base + i] = True
                        continue
                    reserve = wire.TierReserve(self.namespace, key_bytes, blob)
                    slots = self._retrying(reserve, wire.TierSlots, self.io_timeout)
                    if len(slots.slots) != len(idx):
                        self._release(slots.op, store=True)
                        raise ProtocolError("reserve answer does not match the batch")
                    ok = bytearray(len(idx))
                    try:
                        pool = self._need_pool()
                        sb = self._slot_bytes()
                        _check_slots(slots.slots, self._num_slots())
                        for j, (i, s) in enumerate(zip(idx, slots.slots, strict=True)):
                            if s >= 0:
                                off = s * sb
                                pool[off : off + self.block_bytes] = views[base + i]
                                ok[j] = 1
                    except BaseException:
                        self._release(slots.op, store=True)
                        raise
                    self._commit(slots.op, bytes(ok))
                    for i, s, c in zip(idx, slots.slots, ok, strict=True):
                        out[base + i] = bool(c) or s == wire.SLOT_HELD
            self._ask_grant(min(len(keys), MAX_BATCH))
            return out

    def _put(self, key_bytes: int, idx: list[int], blob: bytes, blocks: list[memoryview]) -> None:
        """Copy `blocks` into slots lent ahead (`TierGrant`) and name their keys, one-way:
        a store without a round trip. The daemon handles our messages in order, so our
        next request sees them; a refusal is counted when its answer arrives."""
        n = len(idx)
        slots, self._spare = self._spare[:n], self._spare[n:]
        try:
            pool = self._need_pool()
            sb = self._slot_bytes()
            for s, b in zip(slots, blocks, strict=True):
                off = s * sb
                pool[off : off + self.block_bytes] = b
        except BaseException:
            self._spare[:0] = slots  # still lent to us: used for the next store
            raise
        if self._sock is None:
            raise ProtocolError("not connected")
        corr = next(self._corr)
        put = wire.TierPut(self.namespace, key_bytes, blob, tuple(slots))
        try:
            self._sock.send(wire.encode(put, corr), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise DaemonUnavailable(f"kvd at {self.socket_path} does not take messages") from None
        self._remember_commit(corr, n)

    def _ask_grant(self, n: int) -> None:
        """Ask the daemon to lend us slots for our next store (`n` blocks' worth), unless
        we hold that many or asked already; the answer is taken by the next store."""
        want = n - len(self._spare)
        if want <= 0 or self._granting is not None or self._sock is None:
            return
        with contextlib.suppress(KvdError, zmq.ZMQError):
            self._granting = self._send(wire.TierGrant(min(want, MAX_BATCH)))

    def _take_grant(self) -> None:
        """The answer to our grant request, if one is under way (it is there already
        unless the daemon is slow: it was asked at the end of the previous store)."""
        corr, self._granting = self._granting, None
        if corr is None:
            return
        try:
            got = self._wait(corr, wire.TierGranted, self.io_timeout)
        except KvdError:
            return  # (a store without lent slots reserves them: nothing is lost)
        self._granted(got)

    def _granted(self, got: wire.TierGranted) -> None:
        _check_slots(got.slots, self._num_slots())
        if any(s < 0 for s in got.slots):
            raise ProtocolError("a lent slot outside the pool")
        self._spare.extend(got.slots)

    def load(self, keys: Sequence[bytes], dests: Sequence[memoryview]) -> list[bool]:
        """Per key: its block was copied into its dest (`block_bytes` long). A miss
        leaves its dest untouched, unless a copy was found stale after it was made (the
        slot was reused meanwhile): the dest then holds bytes that mean nothing."""
        if len(keys) != len(dests):
            raise InvalidRequest(f"{len(keys)} keys but {len(dests)} destinations")
        views = [_flat(d, f"dest {i}") for i, d in enumerate(dests)]
        for i, v in enumerate(views):
            if v.readonly:
                raise InvalidRequest(f"dest {i} is read-only")
            if v.nbytes < self.block_bytes:
                raise InvalidRequest(f"dest {i} has {v.nbytes} bytes, fewer than a block")
        for _ in _by_length(keys):  # (the keys' lengths checked before any copy)
            pass
        with self._lock:
            if self._sock is None:
                self._open_session()
            try:
                return self._load_all(keys, views)
            except ProtocolError as exc:
                if "Hello" not in exc.message and "closed" not in exc.message:
                    raise
            # the daemon forgot our session before any part was pinned: reopen, once
            self.reopened += 1
            self._open_session()
            return self._load_all(keys, views)

    def _files_root(self) -> str:
        """Where this client reads disk-tier files from, or "" (through the pool)."""
        info = self._info()
        if not self.read_files or self._files_unreadable or not info.disk_files:
            return ""
        if info.disk_verify and not can_sum64():
            return ""  # (a file's sum64 needs numpy)
        return info.disk_files

    def _load_all(self, keys: Sequence[bytes], views: list[memoryview]) -> list[bool]:
        """The blocks the directory names, copied without a round trip; the rest pinned
        (`_load_pinned`)."""
        out = [False] * len(keys)
        rest = self._load_direct(keys, views, out)
        if len(rest) == len(keys):
            return self._load_pinned(keys, views)
        if rest:
            got = self._load_pinned([keys[i] for i in rest], [views[i] for i in rest])
            for i, ok in zip(rest, got, strict=True):
                out[i] = ok
        return out

    def _load_direct(
        self, keys: Sequence[bytes], views: list[memoryview], out: list[bool]
    ) -> list[int]:
        """Load what needs no round trip: the blocks the directory names, then (where
        this client reads the disk tier's files) the blocks whose files are there; both
        named to the daemon afterwards in one-way `TierTouch`es. Returns the indices left
        for the pinned way, in order."""
        rest = list(range(len(keys)))
        if not self.direct_loads or self._session_lost == self._session:
            return rest  # (a lost session: the pinned way finds out, and reopens)
        d, pool, gens = self._dir, self._pool, self._gens
        if d is not None and pool is not None and gens is not None:
            rest = self._from_directory(keys, views, out, d, pool, gens)
        root = self._files_root() if rest else ""
        if root:
            rest = self._from_files(keys, views, out, rest, root)
        return rest

    def _from_directory(
        self,
        keys: Sequence[bytes],
        views: list[memoryview],
        out: list[bool],
        d: TierDirReader,
        pool: memoryview,
        gens: memoryview,
    ) -> list[int]:
        """Copy out each block the directory names, then check every copied slot's
        generation (after all the copies: the argument of `kvd_client.tierdir`); a valid
        copy is loaded. Returns the indices left, in order."""
        sb, bb, digest = self._slot_bytes(), self.block_bytes, self._digest
        rest: list[int] = []
        copied: list[tuple[int, int, int]] = []  # (index, slot, generation)
        for j, hit in enumerate(d.lookup_many([digest(k) for k in keys])):
            if hit is None:
                rest.append(j)
                continue
            slot, gen = hit
            views[j][:bb] = pool[slot * sb : slot * sb + bb]
            copied.append((j, slot, gen))
        done: list[bytes] = []
        for (j, _, _), ok in zip(copied, _unchanged(gens, copied), strict=True):
            if ok:
                out[j] = True
                done.append(keys[j])
            else:
                self.direct_stale += 1
                rest.append(j)
        if done:
            self.direct_hits += len(done)
            self._touch(done)
        rest.sort()
        return rest

    def _from_files(
        self,
        keys: Sequence[bytes],
        views: list[memoryview],
        out: list[bool],
        todo: list[int],
        root: str,
    ) -> list[int]:
        """Read each block whose disk-tier file is there straight into its destination,
        checked (`read_block`), without a pin: a block file is immutable once renamed
        into place, and one the daemon deletes (evicted) while it is read stays whole for
        the reader that opened it. A file that is not there (not on disk: its
        destination untouched) or fails (its destination then holds garbage) is left to
        the pinned way, which tells a file gone from one this client cannot read, and a
        bad file from a good one. Returns the indices left, in order."""
        bb, ns, verify = self.block_bytes, self.namespace, self._info().disk_verify
        rest: list[int] = []
        done: list[bytes] = []
        for j in todo:
            if read_block(root, (ns, keys[j]), views[j][:bb], verify=verify):
                rest.append(j)
            else:
                out[j] = True
                done.append(keys[j])
        if done:
            self.direct_hits += len(done)
            self.files_read += len(done)
            self._touch(done, disk=True)
        return rest

    def _touch(self, keys: Sequence[bytes], *, disk: bool = False) -> None:
        """Name blocks loaded without a pin to the daemon (one-way `TierTouch`: its
        recency, promotions and counters), best effort."""
        sock = self._sock
        if sock is None:
            return
        for part in _parts(keys):
            for key_bytes, _, blob in _by_length(part):
                msg = wire.TierTouch(self.namespace, key_bytes, blob, disk)
                with contextlib.suppress(zmq.ZMQError):
                    sock.send(wire.encode(msg, next(self._corr)), flags=zmq.NOBLOCK)

    def _load_pinned(self, keys: Sequence[bytes], views: list[memoryview]) -> list[bool]:
        """`_load`, then the disk hits whose files could not be read here once more
        through the pool (the daemon reads and checks them: a bad file is a miss)."""
        failed: dict[int, str] = {}
        out = self._load(keys, views, self._files_root(), failed)
        if not failed:
            return out
        self.files_failed += len(failed)
        idx = sorted(failed)
        again = self._load([keys[i] for i in idx], [views[i] for i in idx], "", {})
        for i, ok in zip(idx, again, strict=True):
            out[i] = ok
            if ok and failed[i].startswith(("open:", "read:")):
                self._files_unreadable = True
        return out

    def _load(
        self, keys: Sequence[bytes], views: list[memoryview], root: str, failed: dict[int, str]
    ) -> list[bool]:
        """Pipelined: the pins of the next parts are sent before this part is copied out,
        so the daemon reads (and checks) disk-tier blocks while the client copies: at
        most half the pool is pinned at once, so that disk hits find slots to be read
        into. Host-tier hits pay one round trip (the first part's). Without a disk tier
        a load is one part (up to half the pool). With `root`, disk hits are read here
        from their files under it (pinned by the daemon until the part's unpin), checked,
        and those that fail are put in `failed` (index -> why), not loaded."""
        out = [False] * len(keys)
        num_slots = self._num_slots()
        window = max(1, min(MAX_BATCH, num_slots // 2))
        # parts only where the daemon may read the disk: for host-tier hits, and disk hits
        # this client reads from their files, the extra messages cost more than they hide
        # (measured: ~13% slower for 64 MiB of host hits on 2 cores)
        parts = self._info().disk and not root
        per = max(1, min(window, PART_BYTES // self.block_bytes)) if parts else window
        todo: list[tuple[int, list[int], wire.TierPin]] = []  # (base, indices, pin)
        for base, part in _indexed_parts(keys, per):
            for key_bytes, idx, blob in _by_length(part):
                pin = wire.TierPin(self.namespace, key_bytes, blob, files=bool(root))
                todo.append((base, idx, pin))
        sent: list[tuple[int, int, list[int]]] = []  # (corr, base, indices), in order
        pinned = 0
        nxt = 0
        try:
            while nxt < len(todo) or sent:
                while nxt < len(todo) and (not sent or pinned + len(todo[nxt][1]) <= window):
                    base, idx, pin = todo[nxt]
                    sent.append((self._send(pin), base, idx))
                    pinned += len(idx)
                    nxt += 1
                corr, base, idx = sent[0]
                slots = self._wait(corr, wire.TierSlots, self.io_timeout)
                sent.pop(0)
                pinned -= len(idx)
                try:
                    if len(slots.slots) != len(idx):
                        raise ProtocolError("pin answer does not match the batch")
                    pool = self._need_pool()
                    sb = self._slot_bytes()
                    bb = self.block_bytes
                    _check_slots(slots.slots, num_slots, files=bool(root))
                    if len(slots.gens) != 8 * len(idx) or self._gens is None:
                        raise ProtocolError("pin answer without the slots' generations")
                    verify = self._info().disk_verify
                    for i, s in zip(idx, slots.slots, strict=True):
                        j = base + i
                        if s >= 0:
                            off = s * sb
                            views[j][:bb] = pool[off : off + bb]
                            out[j] = True
                        elif s == wire.SLOT_FILE:
                            why = read_block(
                                root, (self.namespace, keys[j]), views[j][:bb], verify=verify
                            )
                            if why:
                                failed[j] = why
                            else:
                                self.files_read += 1
                                out[j] = True
                    # after the copies (loads are not reordered with later loads on x86-64:
                    # the seqlock argument of kvd_client.ecindex): a slot reused meanwhile
                    # shows a newer generation, and what was copied from it is a miss
                    want, now = memoryview(slots.gens).cast("Q"), self._gens
                    for pos, (i, s) in enumerate(zip(idx, slots.slots, strict=True)):
                        if s >= 0 and now[s] != want[pos]:
                            out[base + i] = False
                            self.stale_reads += 1
                finally:
                    self._release(slots.op, store=False, wait=False)
        finally:
            for corr, _, _ in sent:  # parts left after a failure: unpinned as they answer
                self._expected.discard(corr)
                if corr in self._replies:
                    self._late(corr, self._replies.pop(corr))
        return out

    def stats(self) -> dict[str, Any]:
        """The daemon's tier statistics (as `kvd tiers --json` shows them)."""
        with self._lock:
            reply = self._retrying(wire.GetStatus("tiers"), wire.StatusReply, self.timeout)
            return dict(reply.data)

    @property
    def num_slots(self) -> int:
        """Slots of the daemon's host pool (a load pins at most half of them at once)."""
        with self._lock:
            return self._num_slots()

    @property
    def has_disk(self) -> bool:
        """Whether the daemon keeps a disk tier behind its host tier."""
        with self._lock:
            return self._info().disk

    @property
    def lookup_timeout(self) -> float:
        """The lookup timeout the daemon suggests (`tiers.lookup_timeout`); this client's
        own `timeout` is what its calls use."""
        with self._lock:
            return self._info().lookup_timeout

    def close(self) -> None:
        """End the session (the daemon drops anything it still held for it) and unmap.
        Calls after this raise ProtocolError."""
        with self._lock:
            self._closed = True
            self._ka_stop.set()
            if self._sock is not None and self._session:
                with contextlib.suppress(KvdError, zmq.ZMQError):
                    self._ask(wire.Goodbye(self._session), wire.Ok, min(self.timeout, 2.0))
            self._close_socket()
            self._unmap()
        if self._ka_thread is not None:
            self._ka_thread.join(timeout=2.0)
            self._ka_thread = None

    def __enter__(self) -> TierClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---------------------------------------------------------------- session

    def _open_session(self) -> None:
        """A new session: Hello, TierOpen, the pool mapped (caller holds the lock)."""
        if self._closed:
            raise ProtocolError("this TierClient is closed")
        self._close_socket()
        self._unmap()
        # every copy of the old session is over (calls hold the lock): the daemon may
        # reuse the slots it kept out of use in case this client still wrote into them
        prev = self._session
        self._spare, self._granting = [], None  # (lent to the old session: gone with it)
        self._session = f"{ROLE}-{os.getpid()}-{secrets.token_hex(6)}"
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self._session.encode())
        sock.connect(f"ipc://{self.socket_path}")
        self._sock = sock
        hello = wire.Hello(self._session, ROLE, "", -1, os.getpid(), __version__)
        welcome = self._ask(hello, wire.Welcome, self.timeout)
        self._keepalive_s = max(0.05, welcome.client_timeout / 4)
        opened = self._ask(
            wire.TierOpen(self.namespace, self.block_bytes, prev), wire.TierOpened, self.timeout
        )
        if opened.slot_bytes < self.block_bytes:
            raise ProtocolError(f"pool slots of {opened.slot_bytes} bytes hold no block")
        self._map(opened)
        self._opened = opened
        if self._ka_thread is None:
            self._ka_thread = threading.Thread(
                target=self._keepalive, name="kvd-tiers-keepalive", daemon=True
            )
            self._ka_thread.start()

    def _map(self, opened: wire.TierOpened) -> None:
        fd = os.open(os.path.join(SHM_DIR, check_name(opened.pool)), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if size < opened.num_slots * opened.slot_bytes:
                raise ProtocolError(f"the tier pool {opened.pool} is smaller than announced")
            # every page faulted in as written now (~0.25 ms per MiB here), so that copies
            # pay neither a fault nor a first write per page (`populate_for_write`)
            self._pool_mm = map_for_write(fd, size)
        finally:
            os.close(fd)
        self._pool = memoryview(self._pool_mm)
        if not opened.gens:
            raise ProtocolError("the daemon names no slot generations")
        fd = os.open(os.path.join(SHM_DIR, check_name(opened.gens)), os.O_RDONLY)
        try:
            if os.fstat(fd).st_size < opened.num_slots * 8:
                raise ProtocolError(f"the tier generations {opened.gens} are too small")
            self._gens_mm = mmap.mmap(fd, opened.num_slots * 8, mmap.MAP_SHARED, mmap.PROT_READ)
        finally:
            os.close(fd)
        self._gens = memoryview(self._gens_mm).cast("Q")
        if opened.directory and TierDirReader.supported():
            try:
                self._dir = TierDirReader(opened.directory, opened.num_slots)
            except (OSError, ValueError):
                self._dir = None  # (every load pinned: correct, one round trip more)
                self.directory_unusable += 1

    def _unmap(self) -> None:
        if self._dir is not None:
            self._dir.close()
            self._dir = None
        if self._gens is not None:
            self._gens.release()
            self._gens = None
        if self._gens_mm is not None:
            self._gens_mm.close()
            self._gens_mm = None
        if self._pool is not None:
            self._pool.release()
            self._pool = None
        if self._pool_mm is not None:
            self._pool_mm.close()
            self._pool_mm = None
        self._opened = None

    def _close_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def _need_pool(self) -> memoryview:
        if self._pool is None:
            raise ProtocolError("the tier pool is not mapped")
        return self._pool

    def _info(self) -> wire.TierOpened:
        if self._opened is None:
            self._open_session()
        assert self._opened is not None
        return self._opened

    def _num_slots(self) -> int:
        return self._info().num_slots

    def _slot_bytes(self) -> int:
        assert self._opened is not None
        return self._opened.slot_bytes

    def _keepalive(self) -> None:
        """Ping our session so the daemon keeps it (and its pins) while we live."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{self.socket_path}")
        sent = ["", ""]  # the sessions of the last two keep-alives
        try:
            while not self._ka_stop.wait(self._keepalive_s):
                session = self._session
                sent = [sent[1], session]
                if session:
                    with contextlib.suppress(zmq.ZMQError):
                        sock.send(wire.encode(wire.KeepAlive(session)), flags=zmq.NOBLOCK)
                while sock.poll(0):  # NOT_FOUND answers: the next call reopens
                    sock.recv()
                    # the daemon restarted or dropped this session (where both keep-alives
                    # that may be answered were its): loads stop using its directory,
                    # whose blocks are right but whose pool is nobody's now
                    if sent[0] == sent[1] == self._session:
                        self._session_lost = sent[1]
        finally:
            sock.close(0)

    def _retrying(self, msg: wire.Record, want: Any, timeout: float) -> Any:
        """Ask; if the daemon no longer knows our session (it restarted, or timed it
        out), open a new one and ask once more."""
        if self._sock is None:
            self._open_session()
        try:
            return self._ask(msg, want, timeout)
        except ProtocolError as exc:
            if "Hello" not in exc.message and "closed" not in exc.message:
                raise
        self.reopened += 1
        self._open_session()
        return self._ask(msg, want, timeout)

    def _commit(self, op: int, ok: bytes) -> None:
        """Make a store's copied blocks visible, one-way: sent without waiting for the
        answer (the daemon handles our messages in order, so our next request sees them
        committed; until the commit is handled nobody sees them, and then only whole).
        A refused commit (its reservation dropped meanwhile: pin timeout, session end)
        is counted when its late answer arrives (`commits_refused`)."""
        if self._sock is None:
            raise ProtocolError("not connected")
        corr = next(self._corr)
        try:
            self._sock.send(wire.encode(wire.TierCommit(op, ok), corr), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise DaemonUnavailable(f"kvd at {self.socket_path} does not take messages") from None
        self._remember_commit(corr, ok.count(1))

    def _remember_commit(self, corr: int, blocks: int) -> None:
        self._commits[corr] = blocks
        if len(self._commits) > 4096:  # answers lost with a session: keep the newest
            del self._commits[min(self._commits)]

    def _release(self, op: int, *, store: bool, wait: bool = True) -> None:
        """Drop an operation's pins, best effort (the session's end or the pin timeout
        drops them otherwise). `wait=False`: send and return (a load's unpin: its
        answer is dropped when it arrives, like any late one; the daemon handles our
        messages in order, so the next request of this client sees the pins gone)."""
        del store  # an unpin releases either kind
        if not wait:
            if self._sock is not None:
                with contextlib.suppress(zmq.ZMQError):
                    msg = wire.encode(wire.TierUnpin(op), next(self._corr))
                    self._sock.send(msg, flags=zmq.NOBLOCK)
            return
        with contextlib.suppress(KvdError, zmq.ZMQError):
            self._ask(wire.TierUnpin(op), wire.Ok, self.timeout)

    def _ask(self, msg: wire.Record, want: Any, timeout: float) -> Any:
        """Send `msg`, wait for its reply (of type `want`); raise the daemon's error."""
        return self._wait(self._send(msg), want, timeout)

    def _send(self, msg: wire.Record) -> int:
        """Send `msg` (its reply is awaited with `_wait`); its correlation id."""
        sock = self._sock
        if sock is None:
            raise ProtocolError("not connected")
        corr = next(self._corr)
        try:
            sock.send(wire.encode(msg, corr), flags=zmq.NOBLOCK)
        except zmq.Again:
            raise DaemonUnavailable(f"kvd at {self.socket_path} does not take messages") from None
        self._expected.add(corr)
        return corr

    def _wait(self, corr: int, want: Any, timeout: float) -> Any:
        """The reply to `corr` (of type `want`); replies to other calls still awaited are
        kept for their `_wait`, any other is late. Raises the daemon's error."""
        sock = self._sock
        if sock is None:
            raise ProtocolError("not connected")
        deadline = time.monotonic() + timeout
        try:
            while corr not in self._replies:
                left = deadline - time.monotonic()
                if left <= 0 or not sock.poll(max(1, int(left * 1000))):
                    if time.monotonic() >= deadline:
                        raise Timeout(f"no reply from kvd at {self.socket_path} within {timeout}s")
                    continue
                rcorr, got = wire.decode(sock.recv())
                if rcorr in self._expected:
                    self._replies[rcorr] = got
                else:
                    self._late(rcorr, got)
            reply = self._replies.pop(corr)
        finally:
            self._expected.discard(corr)
        if isinstance(reply, wire.ErrorReply):
            raise error_from_code(reply.code, reply.message)
        if not isinstance(reply, want):
            raise ProtocolError(f"expected {want}, got {type(reply).__name__}")
        return reply

    def _late(self, corr: int, reply: wire.Record) -> None:
        """A reply to a call that timed out (release what it pinned for us), or to a
        one-way commit (count a refusal)."""
        blocks = self._commits.pop(corr, None)
        if blocks is not None:
            if isinstance(reply, wire.ErrorReply):
                self.commits_refused += blocks
            elif isinstance(reply, wire.TierFlags):  # (a put: 0 = refused)
                self.commits_refused += reply.flags.count(0)
            return
        if isinstance(reply, wire.TierGranted):  # (lent to this session all the same)
            with contextlib.suppress(ProtocolError):
                self._granted(reply)
            return
        if isinstance(reply, wire.TierSlots) and self._sock is not None:
            with contextlib.suppress(zmq.ZMQError):
                corr = next(self._corr)  # its answer is dropped as another late one
                self._sock.send(wire.encode(wire.TierUnpin(reply.op), corr), flags=zmq.NOBLOCK)


def _unchanged(gens: memoryview, copied: Sequence[tuple[int, int, int]]) -> list[bool]:
    """Per (index, slot, generation) copied: whether the slot's generation is still the
    one the copy was made under (read after every copy)."""
    return [gens[slot] == gen for _, slot, gen in copied]


def _check_slots(slots: Sequence[int], num_slots: int, *, files: bool = False) -> None:
    """The daemon's slots must lie in its pool (never turned into a wild offset), and name
    a file only where the client asked to read files."""
    low = wire.SLOT_FILE if files else wire.SLOT_REFUSED
    if any(s >= num_slots or s < low for s in slots):
        raise ProtocolError(f"a slot outside the pool's {num_slots} slots")


def _parts(keys: Sequence[bytes]) -> Iterator[Sequence[bytes]]:
    for _, part in _indexed_parts(keys):
        yield part


def _indexed_parts(
    keys: Sequence[bytes], per: int = MAX_BATCH
) -> Iterator[tuple[int, Sequence[bytes]]]:
    for start in range(0, len(keys), per):
        yield start, keys[start : start + per]


def _by_length(keys: Sequence[bytes]) -> Iterator[tuple[int, list[int], bytes]]:
    """(key length, indices, the keys concatenated) per key length: one message each
    (vLLM's keys all have one length, so one message per batch)."""
    if not keys:
        return
    n = len(keys[0])
    if len(set(map(len, keys))) == 1:
        if not 1 <= n <= 256:
            raise InvalidRequest(f"keys must be 1..256 bytes, got {n}")
        yield n, list(range(len(keys))), b"".join(keys)
        return
    groups: dict[int, list[int]] = {}
    for i, k in enumerate(keys):
        groups.setdefault(len(k), []).append(i)
    for n, idx in groups.items():
        if not 1 <= n <= 256:
            raise InvalidRequest(f"keys must be 1..256 bytes, got {n}")
        yield n, idx, b"".join(keys[i] for i in idx)
