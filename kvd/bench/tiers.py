"""Scenario 7, KV tiers: a daemon of its own with `[tiers]` on, and `TierClient`.

- Lookup: a batch of 1,000 keys (all host-tier hits), the client's round trip (daemon
  answer included), with 1,000 and with 100,000 blocks held (1 KiB blocks); the same
  1,000-key batch's cost per key, as the engine pays it. Beside it, the sans-IO host
  index alone (reserve + commit + pin + unpin per key) at 1k and 100k entries.
- Host tier: store and load of one 64 MiB request (32 blocks of 2 MiB) through the pool
  against a memcpy of the same bytes.
- Disk tier: the request's blocks written by the demoter, the daemon restarted (its disk
  index rebuilt: nothing in the host tier), then loads from disk (`promote_on_hit` off,
  so every load reads the files; the client reads each file straight into the
  destination and checks it, `tiers.disk_client_reads`; beside it the same load through
  the pool, the client's file reads off: the daemon's NIXL read into a slot, its check,
  the client's copy out) against, in the same run and page-cache state, plain
  buffered reads of the same files (`readinto`, one file after another) into the
  request's destination (the same bytes delivered: the target's baseline) and into one
  reused block-sized buffer (cache-resident: no 64 MiB of distinct memory written),
  and NIXL's POSIX backend alone reading them into a registered buffer (the floor of
  the daemon's read). Each is measured with the page cache warm and cold (the files
  evicted with POSIX_FADV_DONTNEED before each); the fraction of the files' bytes in
  the page cache is checked (RWF_NOWAIT reads) before each and reported.
- Peer tier: the request's blocks held by a second daemon only; the first daemon (with
  `tiers.peers` naming it, `promote_on_hit` off so that every load asks the peer) is
  asked by its client: a lookup (a miss locally, a batch to the peer), then a load (a
  pin on the peer, a NIXL READ into the local pool, the checksums checked, an unpin,
  and the client's copy out), against a memcpy of the same bytes. Both daemons on one
  host: the READ is UCX's same-host copy, not a network.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvd_client.shm import SharedRegion, staging_name
from kvd_client.tiers import TierClient

from kvd.bench.common import Env, Progress, median
from kvd.core.tiers import HostIndex
from kvd.demo import DaemonProc, start_daemon

NS = b"kvd-bench-tiers"


@dataclass(frozen=True)
class TiersBenchConfig:
    lookup_keys: int = 1000
    lookup_reps: int = 200
    big_blocks: int = 100_000
    request_bytes: int = 64 << 20
    block_bytes: int = 2 << 20
    reps: int = 7

    @classmethod
    def quick(cls) -> TiersBenchConfig:
        return cls(
            lookup_reps=50, big_blocks=20_000, request_bytes=16 << 20, block_bytes=1 << 20, reps=3
        )


def steps(cfg: TiersBenchConfig) -> int:
    return 5


def _key(i: int) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little")).digest() + b"\0\0\0\0"


def _daemon(env: Env, name: str, tiers: dict[str, Any]) -> DaemonProc:
    return start_daemon(
        env.workdir,
        f"{name}-{os.getpid()}",
        overrides={"tiers": {"enabled": True, **tiers}, "daemon": {"client_timeout": 30.0}},
    )


def run(env: Env, cfg: TiersBenchConfig, seed: int, progress: Progress) -> dict[str, Any]:
    del seed
    out: dict[str, Any] = {"config": cfg.__dict__}
    out["lookup"] = _lookup(env, cfg)
    progress("tiers: lookup at 1k and 100k blocks")
    out["index"] = _index(cfg)
    progress("tiers: sans-IO host index")
    out["host"] = _host(env, cfg)
    progress("tiers: host tier store and load")
    out["disk"] = _disk(env, cfg)
    progress("tiers: disk tier load")
    out["peer"] = _peer(env, cfg)
    progress("tiers: peer tier load")
    return out


def _lookup(env: Env, cfg: TiersBenchConfig) -> dict[str, Any]:
    bb = 1024
    d = _daemon(env, "kvdb-tl", {"host_bytes": (cfg.big_blocks + 4096) * bb, "low_water": 0.0})
    res: dict[str, Any] = {"block_bytes": bb}
    try:
        with TierClient(d.socket, NS, bb, timeout=10.0) as c:
            blob = memoryview(bytes(bb))
            held = 0
            for size in (cfg.lookup_keys, cfg.big_blocks):
                while held < size:
                    n = min(4096, size - held)
                    keys = [_key(i) for i in range(held, held + n)]
                    c.store(keys, [blob] * n)
                    held += n
                probe = [_key(i) for i in range(0, size, max(1, size // cfg.lookup_keys))]
                probe = probe[: cfg.lookup_keys]
                c.batch_lookup(probe)  # warm
                took = []
                for _ in range(cfg.lookup_reps):
                    t0 = time.perf_counter()
                    found = c.batch_lookup(probe)
                    took.append(time.perf_counter() - t0)
                    if not all(found):
                        raise RuntimeError("a held key was not found")
                res[f"p50_ms_{size}"] = round(median(took) * 1e3, 4)
                res[f"per_key_us_{size}"] = round(median(took) * 1e6 / len(probe), 3)
            res["blocks_small"] = cfg.lookup_keys
            res["blocks_big"] = cfg.big_blocks
            res["growth"] = round(
                res[f"p50_ms_{cfg.big_blocks}"] / res[f"p50_ms_{cfg.lookup_keys}"], 3
            )
    finally:
        d.stop()
    return res


def _index(cfg: TiersBenchConfig) -> dict[str, Any]:
    """ns per key of reserve + commit + pin + unpin + evict, in an index of n entries."""
    res: dict[str, Any] = {}
    for n in (1000, 100_000):
        h = HostIndex(n + cfg.lookup_keys)
        for i in range(n):
            k = (NS, _key(i))
            h.reserve(k)
            h.commit(k)
        keys = [(NS, _key(n + i)) for i in range(cfg.lookup_keys)]
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for k in keys:
                h.reserve(k)
                h.commit(k)
                h.pin(k)
                h.unpin(k)
            for k in keys:
                h.evict(k)
            best = min(best, time.perf_counter() - t0)
        res[f"ns_per_key_{n}"] = round(best * 1e9 / len(keys), 1)
    res["growth"] = round(res["ns_per_key_100000"] / res["ns_per_key_1000"], 3)
    return res


def _blocks(cfg: TiersBenchConfig) -> tuple[list[bytes], list[memoryview]]:
    n = cfg.request_bytes // cfg.block_bytes
    src = bytearray(os.urandom(cfg.request_bytes))
    view = memoryview(src)
    blocks = [view[i * cfg.block_bytes : (i + 1) * cfg.block_bytes] for i in range(n)]
    return [_key(10_000_000 + i) for i in range(n)], blocks


def _host(env: Env, cfg: TiersBenchConfig) -> dict[str, Any]:
    keys, blocks = _blocks(cfg)
    n, bb = len(keys), cfg.block_bytes
    d = _daemon(env, "kvdb-th", {"host_bytes": (cfg.reps + 2) * cfg.request_bytes})
    dst = bytearray(cfg.request_bytes)
    dview = memoryview(dst)
    dests = [dview[i * bb : (i + 1) * bb] for i in range(n)]
    src_all = blocks[0].obj  # the one buffer the blocks are views of
    store_t: list[float] = []
    load_t: list[float] = []
    pinned_t: list[float] = []
    copy_t: list[float] = []
    into_t: list[float] = []
    out_t: list[float] = []
    direct_blocks = 0
    # the floor: the same block copies into and out of shared memory, with no daemon
    shm = SharedRegion(staging_name("bench-tier-floor"), cfg.request_bytes, populate=True)
    try:
        pool = shm.buf
        with TierClient(d.socket, NS, bb, timeout=10.0) as c:
            for r in range(cfg.reps):
                fresh = [hashlib.sha256(k + bytes([r])).digest() + b"\0\0\0\0" for k in keys]
                t0 = time.perf_counter()
                ok = c.store(fresh, blocks)
                store_t.append(time.perf_counter() - t0)
                if not all(ok):
                    raise RuntimeError("a store was refused")
                keys = fresh
                t0 = time.perf_counter()
                dview[:] = memoryview(src_all)
                copy_t.append(time.perf_counter() - t0)
                # the load as engines make it (through the directory where it names the
                # blocks) and the same load pinned (one round trip), in turns
                for direct in (True, False) if r % 2 == 0 else (False, True):
                    dview[:] = bytes(len(dview))
                    c.direct_loads = direct
                    hits = c.direct_hits
                    t0 = time.perf_counter()
                    got = c.load(keys, dests)
                    (load_t if direct else pinned_t).append(time.perf_counter() - t0)
                    direct_blocks += c.direct_hits - hits
                    if not all(got) or dst != src_all:
                        raise RuntimeError("a load returned wrong bytes")
                c.direct_loads = True
                # the same block copies into and out of a shared-memory segment (written
                # before), with no daemon: what any path through the pool costs here
                t0 = time.perf_counter()
                for i, b in enumerate(blocks):
                    pool[i * bb : (i + 1) * bb] = b
                into_t.append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                for i, dest in enumerate(dests):
                    dest[:] = pool[i * bb : (i + 1) * bb]
                out_t.append(time.perf_counter() - t0)
    finally:
        d.stop()
        shm.close()
    mc, st, ld = median(copy_t), median(store_t), median(load_t)
    gb = cfg.request_bytes / 1e9
    return {
        "request_bytes": cfg.request_bytes,
        "block_bytes": bb,
        "memcpy_gbps": round(gb / mc, 2),
        "store_gbps": round(gb / st, 2),
        "load_gbps": round(gb / ld, 2),
        "store_vs_memcpy": round(mc / st, 3),
        "load_vs_memcpy": round(mc / ld, 3),
        "load_direct_blocks": f"{direct_blocks} of {n * cfg.reps}",
        "load_pinned_gbps": round(gb / median(pinned_t), 2),
        "load_pinned_vs_memcpy": round(mc / median(pinned_t), 3),
        "copies_into_pool_vs_memcpy": round(mc / median(into_t), 3),
        "copies_out_of_pool_vs_memcpy": round(mc / median(out_t), 3),
    }


def _cached_fraction(files: list[Path], nbytes: int) -> float:
    """Fraction of the files' first `nbytes` in the page cache: a read with RWF_NOWAIT
    returns only cached bytes (it starts no IO, so checking changes nothing)."""
    got = 0
    buf = memoryview(bytearray(1 << 20))
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            off = 0
            while off < nbytes:
                try:
                    n = os.preadv(fd, [buf[: min(len(buf), nbytes - off)]], off, os.RWF_NOWAIT)
                except BlockingIOError:
                    n = 0
                got += n
                off += len(buf)
        finally:
            os.close(fd)
    return got / (nbytes * len(files))


def _evict(files: list[Path]) -> None:
    """Drop the files from the page cache (written back first: only clean pages go)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


class _RawPosix:
    """NIXL's POSIX backend alone (an agent of the bench's own): the same files read into
    one registered buffer, in one transfer, as the daemon reads them: the floor."""

    def __init__(self, nbytes: int) -> None:
        import ctypes
        import mmap

        from kvd.adapters.nixl_import import nixl_api

        api = nixl_api()
        conf = api.nixl_agent_config(enable_prog_thread=False, backends=[])
        self.agent = api.nixl_agent(f"kvdb-posix-{os.getpid()}", conf)
        self.agent.create_backend("POSIX", {})
        flags = mmap.MAP_SHARED | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
        self.buf = mmap.mmap(-1, nbytes, flags=flags)
        anchor = ctypes.c_char.from_buffer(self.buf)
        self.addr = ctypes.addressof(anchor)
        del anchor
        self.reg = self.agent.register_memory(
            [(self.addr, nbytes, 0, "")], "DRAM", backends=["POSIX"]
        )

    def read(self, files: list[Path], bb: int) -> float:
        fds = [os.open(p, os.O_RDWR) for p in files]
        a = self.agent
        try:
            t0 = time.perf_counter()
            reg = a.register_memory([(0, bb, fd, "") for fd in fds], "FILE", backends=["POSIX"])
            mem = a.get_xfer_descs([(self.addr + i * bb, bb, 0) for i in range(len(fds))], "DRAM")
            fls = a.get_xfer_descs([(0, bb, fd) for fd in fds], "FILE")
            h = a.initialize_xfer("READ", mem, fls, a.name, b"", backends=["POSIX"])
            state = a.transfer(h)
            while state != "DONE":
                state = a.check_xfer_state(h)
            took = time.perf_counter() - t0
            a.release_xfer_handle(h)
            a.deregister_memory(reg)
            return took
        finally:
            for fd in fds:
                os.close(fd)

    def close(self) -> None:
        self.agent.deregister_memory(self.reg)
        self.buf.close()


def _disk(env: Env, cfg: TiersBenchConfig) -> dict[str, Any]:
    keys, blocks = _blocks(cfg)
    n, bb = len(keys), cfg.block_bytes
    root = Path(env.workdir) / "tiers-disk"
    shutil.rmtree(root, ignore_errors=True)
    tiers = {
        "host_bytes": 2 * n * bb,  # a load of the whole request is one pin of n blocks
        "disk_path": str(root),
        "disk_bytes": 4 * cfg.request_bytes,
        "low_water": 0.5,
        "promote_on_hit": False,
    }
    d = _daemon(env, "kvdb-td", tiers)
    try:
        with TierClient(d.socket, NS, bb, timeout=10.0, io_timeout=120.0) as c:
            for i in range(0, n, 4):
                if not all(c.store(keys[i : i + 4], blocks[i : i + 4])):
                    raise RuntimeError("a store was refused")
            deadline = time.monotonic() + 120
            # everything must reach the disk: store more until the request is evicted
            filler = [_key(20_000_000 + i) for i in range(2 * n)]
            for i in range(0, 2 * n, 4):
                c.store(filler[i : i + 4], blocks[:4])
            while c.stats()["host"]["demoting"] and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        d.stop()
    d = _daemon(env, "kvdb-td2", tiers)  # warm restart: every block is on disk only
    dst = bytearray(cfg.request_bytes)
    dview = memoryview(dst)
    dests = [dview[i * bb : (i + 1) * bb] for i in range(n)]
    src_all = blocks[0].obj
    raw = _RawPosix(cfg.request_bytes)
    t: dict[str, list[float]] = {}
    cached: dict[str, list[float]] = {}

    def timed(name: str, state: str, files: list[Path], fn: Any) -> None:
        if state == "cold":
            _evict(files)
        cached.setdefault(f"{name}_{state}", []).append(_cached_fraction(files, bb))
        t0 = time.perf_counter()
        took = fn()
        t.setdefault(f"{name}_{state}", []).append(
            took if isinstance(took, float) else time.perf_counter() - t0
        )

    try:
        with TierClient(d.socket, NS, bb, timeout=10.0, io_timeout=120.0) as c:
            on_disk = c.stats()["disk"]["blocks"]
            found = c.batch_lookup(keys)
            if not all(found):
                raise RuntimeError(f"only {sum(found)} of {n} blocks reached the disk")
            # the request's own files, in its order (the daemon reads exactly these)
            from kvd_client.tierfiles import block_path, read_block

            files = [Path(block_path(str(root), (NS, k))) for k in keys]
            small = memoryview(bytearray(bb))

            def load() -> None:
                if not all(c.load(keys, dests)):
                    raise RuntimeError("a disk load missed")

            def load_pool() -> None:  # the same load with the client's file reads off
                c.read_files = False
                try:
                    load()
                finally:
                    c.read_files = True

            def load_pinned() -> None:  # the same load, its files pinned (a round trip)
                c.direct_loads = False
                try:
                    load()
                finally:
                    c.direct_loads = True

            def read_check() -> None:  # the client's own reads and checks, no daemon
                for k, dest in zip(keys, dests, strict=True):
                    if read_block(str(root), (NS, k), dest, verify=True):
                        raise RuntimeError("a block file failed its check")

            def into_one() -> None:
                for path in files:
                    with open(path, "rb") as f:
                        f.readinto(small)

            def into_dest() -> None:
                for path, dest in zip(files, dests, strict=True):
                    with open(path, "rb") as f:
                        f.readinto(dest)

            before = c.stats()["counters"]
            for state in ("warm", "cold"):
                for _ in range(cfg.reps):
                    dview[:] = bytes(len(dview))
                    files_read = c.files_read
                    timed("load", state, files, load)
                    if dst != src_all:  # (checked after the timing, as the reads' below)
                        raise RuntimeError("a disk load returned wrong bytes")
                    if c.files_read - files_read != n:
                        raise RuntimeError("a disk load did not read the files itself")
                    dview[:] = bytes(len(dview))
                    timed("load_pool", state, files, load_pool)
                    if dst != src_all:
                        raise RuntimeError("a disk load through the pool returned wrong bytes")
                    if state == "warm":
                        after = c.stats()["counters"]
                    dview[:] = bytes(len(dview))
                    timed("load_pinned", state, files, load_pinned)
                    if dst != src_all:
                        raise RuntimeError("a pinned disk load returned wrong bytes")
                    dview[:] = bytes(len(dview))
                    timed("read_check", state, files, read_check)
                    if dst != src_all:
                        raise RuntimeError("a checked read returned wrong bytes")
                    dview[:] = bytes(len(dview))
                    timed("read_dest", state, files, into_dest)
                    if dst != src_all:
                        raise RuntimeError("a buffered read returned wrong bytes")
                    timed("read_one", state, files, into_one)
                    timed("nixl_posix", state, files, lambda: raw.read(files, bb))
                if state == "warm":
                    warm_counters = (before, after)
    finally:
        raw.close()
        d.stop()
    gb = cfg.request_bytes / 1e9
    med = {k: median(v) for k, v in t.items()}
    before, after = warm_counters
    warm_loads = cfg.reps
    read_ms = (after.get("disk_read_us", 0) - before.get("disk_read_us", 0)) / warm_loads / 1e3
    check_ms = (after.get("disk_check_us", 0) - before.get("disk_check_us", 0)) / warm_loads / 1e3
    out: dict[str, Any] = {
        "request_bytes": cfg.request_bytes,
        "block_bytes": bb,
        "files": n,
        "blocks_on_disk_at_start": on_disk,
        "checksum": "sum64 (the default)",
        "page_cache": {k: round(median(v), 3) for k, v in cached.items()},
        "ms": {k: round(v * 1e3, 2) for k, v in med.items()},
        "warm_load_parts_ms": {
            "nixl_read_sum": round(read_ms, 2),
            "checksum_sum": round(check_ms, 2),
        },
    }
    for state in ("warm", "cold"):
        ld = med[f"load_{state}"]
        out[f"load_gbps_{state}"] = round(gb / ld, 2)
        out[f"read_dest_gbps_{state}"] = round(gb / med[f"read_dest_{state}"], 2)
        out[f"read_one_gbps_{state}"] = round(gb / med[f"read_one_{state}"], 2)
        out[f"nixl_posix_gbps_{state}"] = round(gb / med[f"nixl_posix_{state}"], 2)
        out[f"load_vs_read_dest_{state}"] = round(med[f"read_dest_{state}"] / ld, 3)
        out[f"load_pool_gbps_{state}"] = round(gb / med[f"load_pool_{state}"], 2)
        out[f"load_pool_vs_read_dest_{state}"] = round(
            med[f"read_dest_{state}"] / med[f"load_pool_{state}"], 3
        )
        out[f"load_vs_read_one_{state}"] = round(med[f"read_one_{state}"] / ld, 3)
        out[f"load_pinned_vs_read_dest_{state}"] = round(
            med[f"read_dest_{state}"] / med[f"load_pinned_{state}"], 3
        )
        out[f"read_check_vs_read_dest_{state}"] = round(
            med[f"read_dest_{state}"] / med[f"read_check_{state}"], 3
        )
        out[f"nixl_posix_vs_read_dest_{state}"] = round(
            med[f"read_dest_{state}"] / med[f"nixl_posix_{state}"], 3
        )
    out["load_vs_buffered"] = out["load_vs_read_dest_warm"]
    return out


def _peer(env: Env, cfg: TiersBenchConfig) -> dict[str, Any]:
    keys, blocks = _blocks(cfg)
    n, bb = len(keys), cfg.block_bytes
    src_all = blocks[0].obj
    b = _daemon(env, "kvdb-tpb", {"host_bytes": 2 * cfg.request_bytes})
    a: DaemonProc | None = None
    dst = bytearray(cfg.request_bytes)
    dview = memoryview(dst)
    dests = [dview[i * bb : (i + 1) * bb] for i in range(n)]
    lookup_t, load_t, copy_t = [], [], []
    try:
        with TierClient(b.socket, NS, bb, timeout=10.0) as c:
            if not all(c.store(keys, blocks)):
                raise RuntimeError("a store was refused")
        a = _daemon(
            env,
            "kvdb-tpa",
            {
                "host_bytes": 2 * cfg.request_bytes,
                "peers": f"127.0.0.1:{b.side_port}",
                "promote_on_hit": False,
                "peer_lookup_timeout": 5.0,
            },
        )
        with TierClient(a.socket, NS, bb, timeout=10.0, io_timeout=60.0) as c:
            deadline = time.monotonic() + 30
            while not c.stats()["peer"]["asked"]:  # the handshake with the peer
                if time.monotonic() > deadline:
                    raise RuntimeError("the peer daemon was never handshaked")
                time.sleep(0.05)
            for _ in range(cfg.reps):
                t0 = time.perf_counter()
                found = c.batch_lookup(keys)
                lookup_t.append(time.perf_counter() - t0)
                if not all(found):
                    raise RuntimeError("a block the peer holds was not found")
                dview[:] = bytes(len(dview))
                t0 = time.perf_counter()
                got = c.load(keys, dests)
                load_t.append(time.perf_counter() - t0)
                if not all(got):
                    raise RuntimeError(f"a peer load missed {got.count(False)} of {n} blocks")
                if dst != src_all:
                    raise RuntimeError("a peer load returned wrong bytes")
                t0 = time.perf_counter()
                dview[:] = memoryview(src_all)
                copy_t.append(time.perf_counter() - t0)
            if c.stats()["peer"]["blocks_loaded"] != cfg.reps * n:
                raise RuntimeError("a load was served without asking the peer")
    finally:
        if a is not None:
            a.stop()
        b.stop()
    mc, ld = median(copy_t), median(load_t)
    gb = cfg.request_bytes / 1e9
    return {
        "request_bytes": cfg.request_bytes,
        "block_bytes": bb,
        "lookup_ms": round(median(lookup_t) * 1e3, 3),
        "memcpy_gbps": round(gb / mc, 2),
        "load_gbps": round(gb / ld, 2),
        "load_vs_memcpy": round(mc / ld, 3),
    }
