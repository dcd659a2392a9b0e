"""KV tiers kept by the daemon: real daemons, real NIXL (UCX for the pool, POSIX for the
disk tier), the real shared-memory pool and real files; every loaded byte is checked."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
from kvd_client import wire
from kvd_client.client import KvdClient
from kvd_client.errors import ProtocolError
from kvd_client.tierfiles import SUFFIX, TMP_SUFFIX, block_path, read_block
from kvd_client.tiers import TierClient

from kvd.demo import start_daemon

from .conftest import StartDaemon, shm_segments

NS = b"model-compat-hash-A"
BB = 64 * 1024


def key(i: int, group: int = 0) -> bytes:
    """An OffloadKey as vLLM makes it: a 32-byte block hash and the group, 4 bytes."""
    return hashlib.sha256(f"block-{i}".encode()).digest() + group.to_bytes(4, "big")


def block(i: int, ns: bytes = NS, size: int = BB) -> bytes:
    seed = hashlib.sha256(ns + i.to_bytes(8, "little")).digest()
    return (seed * (size // len(seed) + 1))[:size]


def tiers_cfg(**kw: Any) -> dict[str, dict[str, Any]]:
    tiers: dict[str, Any] = {"enabled": True, "host_bytes": 16 * BB, "low_water": 0.0}
    tiers.update(kw)
    return {"tiers": tiers}


def load_check(
    c: TierClient, ids: list[int], ns: bytes = NS, *, bad_files: frozenset[int] = frozenset()
) -> list[bool]:
    """Load `ids`, check every loaded byte, and that a miss left its dest untouched (but
    for `bad_files`: blocks whose bad file the client read itself before checking it)."""
    dests = [bytearray(c.block_bytes) for _ in ids]
    got = c.load([key(i) for i in ids], [memoryview(d) for d in dests])
    for i, ok, d in zip(ids, got, dests, strict=True):
        if ok:
            assert bytes(d) == block(i, ns), f"block {i}: wrong bytes"
        elif i not in bad_files:
            assert bytes(d) == bytes(len(d)), f"block {i}: a miss wrote into its dest"
    return got


def disk_files(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob(f"*{SUFFIX}"))


def test_store_lookup_load_host_tier(daemons: StartDaemon) -> None:
    d = daemons("t1", overrides=tiers_cfg())
    with TierClient(d.socket, NS, BB) as c:
        ids = list(range(8))
        assert c.batch_lookup([key(i) for i in ids]) == [False] * 8
        assert c.store([key(i) for i in ids], [memoryview(block(i)) for i in ids]) == [True] * 8
        assert c.batch_lookup([key(i) for i in range(10)]) == [True] * 8 + [False] * 2
        # storing again: already held (nothing copied), still True
        assert c.store([key(0)], [memoryview(block(0))]) == [True]
        assert load_check(c, [3, 9, 0, 7]) == [True, False, True, True]
        # another namespace (another model) never sees these blocks
        with TierClient(d.socket, b"model-B", BB) as other:
            assert other.batch_lookup([key(i) for i in ids]) == [False] * 8
        s = c.stats()
        assert s["host"]["blocks"] == 8
        assert s["host"]["bytes_in"] == 8 * BB
        assert s["host"]["bytes_out"] == 3 * BB
        assert s["ops_open"] == 0
        assert c.num_slots == 16 and not c.has_disk and c.lookup_timeout == 2.0
    with pytest.raises(ProtocolError, match="closed"):
        c.batch_lookup([key(0)])


def test_second_client_loads_what_the_first_stored(daemons: StartDaemon) -> None:
    d = daemons("t2", overrides=tiers_cfg())
    with TierClient(d.socket, NS, BB) as a:
        assert all(a.store([key(i) for i in range(4)], [memoryview(block(i)) for i in range(4)]))
    with TierClient(d.socket, NS, BB) as b:
        assert b.batch_lookup([key(i) for i in range(4)]) == [True] * 4
        assert load_check(b, [0, 1, 2, 3]) == [True] * 4


def test_lru_eviction_never_evicts_pinned(daemons: StartDaemon) -> None:
    d = daemons("t3", overrides=tiers_cfg())  # 16 slots, no disk tier
    with TierClient(d.socket, NS, BB) as c:
        assert all(c.store([key(i) for i in range(16)], [memoryview(block(i)) for i in range(16)]))
        assert load_check(c, [0]) == [True]  # 0 is now the most recently used
        assert all(
            c.store([key(i) for i in range(16, 20)], [memoryview(block(i)) for i in range(16, 20)])
        )
        found = c.batch_lookup([key(i) for i in range(20)])
        assert found[0] and all(found[16:20])
        assert found[1:5] == [False] * 4  # the least recently used went
        s = c.stats()
        assert s["host"]["evictions"] == 4
        assert s["host"]["blocks"] == 16


@pytest.mark.parametrize("client_reads", [True, False], ids=["client-reads", "through-pool"])
def test_disk_tier_demote_promote_and_warm_restart(
    daemons: StartDaemon, workdir: Path, client_reads: bool
) -> None:
    root = workdir / "disk"
    cfg = tiers_cfg(disk_path=str(root), disk_bytes=64 * BB, low_water=0.25)
    d = daemons("t4", overrides=cfg)
    ids = list(range(40))
    with TierClient(d.socket, NS, BB) as c:
        c.read_files = client_reads
        for i in ids:  # one at a time: the demoter keeps 4 slots free as they come
            assert c.store([key(i)], [memoryview(block(i))]) == [True]
            time.sleep(0.01)
        _wait(lambda: c.stats()["host"]["demoting"] == 0)
        s = c.stats()
        assert s["disk"]["blocks"] >= 20, s
        assert all(c.batch_lookup([key(i) for i in ids]))
        # more than the host tier holds: disk hits wait for the demoter to free slots
        # (pinned in parts of 8, half the pool, pipelined: every part unpinned after)
        got = load_check(c, ids)
        assert got == [True] * 40
        s2 = c.stats()
        assert s2["disk"]["bytes_out"] > 0  # some came back from disk (promoted)
        assert s2["ops_open"] == 0
        # blocks the client read from files are promoted after the load, which may demote
        # others: the files are counted once the daemon is quiet
        _wait(lambda: _quiet(c) and _quiet(c))
    files = disk_files(root)
    assert files and not list(root.rglob(f"*{TMP_SUFFIX}"))
    d.stop()
    # warm restart: the disk index is rebuilt from the files
    d2 = daemons("t4b", overrides=cfg)
    with TierClient(d2.socket, NS, BB) as c:
        c.read_files = client_reads
        on_disk = c.batch_lookup([key(i) for i in ids])
        assert sum(on_disk) == len(files)
        held = [i for i, ok in zip(ids, on_disk, strict=True) if ok]
        assert load_check(c, held) == [True] * len(held)
        assert c.stats()["disk"]["blocks"] == len(files)
        assert c.files_read == (len(held) if client_reads else 0)
        assert c.files_failed == 0


@pytest.mark.parametrize("client_reads", [True, False], ids=["client-reads", "through-pool"])
@pytest.mark.parametrize("checksum", ["sum64", "crc32"])
def test_corrupt_and_truncated_files_are_misses(
    daemons: StartDaemon, workdir: Path, checksum: str, client_reads: bool
) -> None:
    root = workdir / "disk"
    cfg = tiers_cfg(
        disk_path=str(root), disk_bytes=64 * BB, low_water=1 / 16, disk_checksum=checksum
    )
    d = daemons("t5", overrides=cfg)
    with TierClient(d.socket, NS, BB) as c:
        for i in range(24):
            assert c.store([key(i)], [memoryview(block(i))]) == [True]
        _wait(lambda: c.stats()["host"]["demoting"] == 0)
    d.stop()
    files = {p for p in disk_files(root)}
    flip = Path(block_path(str(root), (NS, key(0))))
    cut = Path(block_path(str(root), (NS, key(1))))
    assert flip in files and cut in files
    raw = bytearray(flip.read_bytes())
    raw[100] ^= 0xFF
    flip.write_bytes(raw)
    with open(cut, "r+b") as f:
        f.truncate(BB // 2)
    d2 = daemons("t5b", overrides=cfg)
    with TierClient(d2.socket, NS, BB) as c:
        c.read_files = client_reads
        # the truncated file fails its length check when the index is rebuilt
        assert not cut.exists()
        assert c.batch_lookup([key(0), key(1)]) == [True, False]
        # the flipped byte fails its checksum when loaded: a miss, removed, counted (the
        # client that read it itself found it bad and loaded it again through the pool,
        # where the daemon found it bad)
        assert load_check(c, [0, 2], bad_files=frozenset({0})) == [False, True]
        assert not flip.exists()
        assert c.batch_lookup([key(0)]) == [False]
        status = c.stats()
        assert status["disk"]["blocks"] == len(files) - 2
        assert status["counters"]["disk_corrupt"] == 2  # (the cut one too)
        assert (c.files_read, c.files_failed) == ((1, 1) if client_reads else (0, 0))
        assert not c._files_unreadable  # a bad file is not a file the client cannot read


def _on_disk_only(daemons: StartDaemon, name: str, cfg: dict[str, Any], n: int) -> Any:
    """A daemon whose disk tier holds blocks 0..n-1 and whose host tier holds nothing:
    stored, demoted, then the daemon restarted (its index rebuilt from the files)."""
    d = daemons(name, overrides=cfg)
    with TierClient(d.socket, NS, BB) as c:
        for i in range(n):
            assert c.store([key(i)], [memoryview(block(i))]) == [True]
        # more stored until every one of 0..n-1 is on disk
        filler = iter(range(1000, 1100))
        root = cfg["tiers"]["disk_path"]
        while not all(Path(block_path(root, (NS, key(i)))).exists() for i in range(n)):
            i = next(filler)
            assert c.store([key(i)], [memoryview(block(i))]) == [True]
            _wait(lambda: c.stats()["host"]["demoting"] == 0)
    d.stop()
    d2 = daemons(name + "b", overrides=cfg)
    with TierClient(d2.socket, NS, BB) as c:
        assert c.batch_lookup([key(i) for i in range(n)]) == [True] * n
        assert c.stats()["host"]["blocks"] == 0
    return d2


@pytest.mark.parametrize("promote", [True, False], ids=["promote", "no-promote"])
def test_disk_hits_read_by_the_client_from_their_files(
    daemons: StartDaemon, workdir: Path, promote: bool
) -> None:
    """A disk hit goes straight from its file into the client's memory (one pass), checked
    there; with `promote_on_hit` the daemon brings it into the host tier afterwards, so
    the next load is a host hit."""
    cfg = tiers_cfg(
        disk_path=str(workdir / "disk"), disk_bytes=64 * BB, low_water=0.25, promote_on_hit=promote
    )
    d = _on_disk_only(daemons, "t7", cfg, 8)
    with TierClient(d.socket, NS, BB) as c:
        ids = list(range(8))
        assert load_check(c, ids) == [True] * 8
        assert (c.files_read, c.files_failed) == (8, 0)
        counters = c.stats()["counters"]
        assert counters["disk_client_reads"] == 8
        assert counters["blocks_loaded"] == 8
        assert c.stats()["ops_open"] == 0 or promote
        if promote:
            _wait(lambda: c.stats()["counters"].get("blocks_promoted", 0) == 8)
            assert c.stats()["host"]["blocks"] == 8
            assert load_check(c, ids) == [True] * 8
            assert c.files_read == 8  # host hits now
        else:
            assert c.stats()["host"]["blocks"] == 0
            assert load_check(c, ids) == [True] * 8
            assert c.files_read == 16
        _wait(lambda: c.stats()["ops_open"] == 0)
        assert c.stats()["counters"]["blocks_loaded"] == 16


def test_a_file_a_client_reads_is_not_evicted_meanwhile(
    daemons: StartDaemon, workdir: Path
) -> None:
    """The daemon pins a file it tells a client to read: the disk tier's eviction passes it
    by until the client unpins it."""
    root = workdir / "disk"
    cfg = tiers_cfg(disk_path=str(root), disk_bytes=8 * BB, low_water=0.25, promote_on_hit=False)
    d = _on_disk_only(daemons, "t8", cfg, 4)
    path = Path(block_path(str(root), (NS, key(0))))
    with TierClient(d.socket, NS, BB) as c:
        pin = wire.TierPin(NS, 36, key(0), files=True)
        got = c._ask(pin, wire.TierSlots, 5.0)
        assert got.slots == (wire.SLOT_FILE,)
        # key 0 is the least recently used file: blocks through a disk tier of 8 until
        # the files after it (1, 2, 3) were evicted
        others = [Path(block_path(str(root), (NS, key(i)))) for i in (1, 2, 3)]
        more = iter(range(100, 200))
        while any(p.exists() for p in others):
            i = next(more)
            assert c.store([key(i)], [memoryview(block(i))]) == [True]
            _wait(lambda: c.stats()["host"]["demoting"] == 0)
        assert path.exists()
        assert c.batch_lookup([key(0)]) == [True]
        dest = bytearray(BB)
        assert read_block(str(root), (NS, key(0)), memoryview(dest)) == ""
        assert bytes(dest) == block(0)
        c._release(got.op, store=False)
        # unpinned: it goes with the next evictions (within a disk tier's worth)
        more = iter(range(200, 216))
        while path.exists():
            i = next(more)
            assert c.store([key(i)], [memoryview(block(i))]) == [True]
            _wait(lambda: c.stats()["host"]["demoting"] == 0)
        assert c.batch_lookup([key(0)]) == [False]


def test_a_killed_readers_file_pins_are_dropped(daemons: StartDaemon, workdir: Path) -> None:
    """A client killed while it holds files to read (SLOT_FILE pins): its session ends
    with its connection, the files are unpinned at once (not after `pin_timeout`), and
    the disk tier's eviction may take them again."""
    root = workdir / "disk"
    cfg = tiers_cfg(
        disk_path=str(root),
        disk_bytes=8 * BB,
        low_water=0.25,
        promote_on_hit=False,
        pin_timeout=60.0,
    )
    d = _on_disk_only(daemons, "t10", cfg, 4)
    code = textwrap.dedent(
        f"""
        import time
        from kvd_client import wire
        from kvd_client.tiers import TierClient
        c = TierClient({d.socket!r}, {NS!r}, {BB})
        keys = [{", ".join(repr(key(i)) for i in range(4))}]
        got = c._ask(wire.TierPin(c.namespace, 36, b"".join(keys), files=True), wire.TierSlots, 5.0)
        assert got.slots == (wire.SLOT_FILE,) * 4, got.slots
        print("pinned", flush=True)
        time.sleep(60)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    paths = [Path(block_path(str(root), (NS, key(i)))) for i in range(4)]
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == b"pinned"
        with TierClient(d.socket, NS, BB) as c:
            assert c.stats()["ops_open"] == 1
            p.send_signal(signal.SIGKILL)
            p.wait()
            t_kill = time.monotonic()
            _wait(lambda: c.stats()["ops_open"] == 0, timeout=10)
            assert time.monotonic() - t_kill < 5.0  # (far under the 60 s bounds)
            assert c.stats()["counters"].get("pins_expired", 0) == 0
            # unpinned: newer blocks push the four files out of the disk tier
            more = iter(range(300, 340))
            while any(path.exists() for path in paths):
                i = next(more)
                assert c.store([key(i)], [memoryview(block(i))]) == [True]
                _wait(lambda: c.stats()["host"]["demoting"] == 0)
            assert c.batch_lookup([key(i) for i in range(4)]) == [False] * 4
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def _freeze_at(name: str, marker: str) -> str:
    """Child-script lines (in a textwrap.dedent'ed f-string, 8 spaces in) that make the
    process stop itself (SIGSTOP) the first time `kvd_client.tiers.<name>` is called,
    after printing `marker`."""
    lines = [
        f"real = T.{name}",
        "stopped = []",
        "def frozen(*a, **k):",
        "    if not stopped:",
        "        stopped.append(1)",
        f"        print({marker!r}, flush=True)",
        "        os.kill(os.getpid(), signal.SIGSTOP)",
        "    return real(*a, **k)",
        f"T.{name} = frozen",
    ]
    return "\n        ".join(lines)


def test_a_reader_frozen_past_its_session_loads_right_bytes_or_misses(
    daemons: StartDaemon, workdir: Path
) -> None:
    """A client frozen (SIGSTOP) between the daemon's answer (files to read) and its reads,
    past `client_timeout`: the daemon ends its session and drops its file pins, and the
    files are then evicted. Thawed, its load ends (no hang, no exception): the files are
    gone, it loads them again through the pool on a new session, and every block is a
    miss; no block is ever reported loaded with wrong bytes."""
    root = workdir / "disk"
    cfg = {
        **tiers_cfg(disk_path=str(root), disk_bytes=8 * BB, low_water=0.25, promote_on_hit=False),
        "daemon": {"client_timeout": 1.0},
    }
    d = _on_disk_only(daemons, "t11", cfg, 4)
    want = [hashlib.sha256(block(i)).hexdigest() for i in range(4)]
    code = textwrap.dedent(
        f"""
        import hashlib, json, os, signal
        from kvd_client import tiers as T
        {_freeze_at("read_block", "reading")}
        c = T.TierClient({d.socket!r}, {NS!r}, {BB}, timeout=5.0, io_timeout=10.0)
        c.direct_loads = False  # (the pinned way: files the daemon named)
        keys = [{", ".join(repr(key(i)) for i in range(4))}]
        dests = [bytearray({BB}) for _ in keys]
        got = c.load(keys, [memoryview(x) for x in dests])
        right = [hashlib.sha256(x).hexdigest() for x in dests]
        print(json.dumps({{"got": got, "sums": right, "reopened": c.reopened}}), flush=True)
        c.close()
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    paths = [Path(block_path(str(root), (NS, key(i)))) for i in range(4)]
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == b"reading"
        _wait(lambda: Path(f"/proc/{p.pid}/stat").read_text().split(")")[1].split()[0] == "T")
        with TierClient(d.socket, NS, BB) as c:
            # its session ends (no keep-alive for client_timeout): its pins go with it
            _wait(lambda: c.stats()["ops_open"] == 0, timeout=10)
            more = iter(range(400, 440))
            while any(path.exists() for path in paths):
                i = next(more)
                assert c.store([key(i)], [memoryview(block(i))]) == [True]
                _wait(lambda: c.stats()["host"]["demoting"] == 0)
        p.send_signal(signal.SIGCONT)
        rest, _ = p.communicate(timeout=30)  # (its load must end: never a hang)
        assert p.returncode == 0
        out = json.loads(rest.splitlines()[-1])
        for i, ok in enumerate(out["got"]):
            if ok:
                assert out["sums"][i] == want[i], f"block {i} loaded with wrong bytes"
        assert out["got"] == [False] * 4
        assert out["reopened"] == 1
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def test_a_file_read_without_a_pin_stays_whole_when_evicted_meanwhile(
    daemons: StartDaemon, workdir: Path
) -> None:
    """A client reading disk-tier files itself, without asking the daemon (a direct
    load), freezes after it opened the first file and read its bytes; meanwhile the
    disk tier evicts (deletes) all four files. Thawed, the file it had open is whole for
    it (an open file outlives its name): that block loads with the right bytes; the
    others are gone, go the pinned way and miss. No block with wrong bytes, no hang."""
    root = workdir / "disk"
    cfg = {
        **tiers_cfg(disk_path=str(root), disk_bytes=8 * BB, low_water=0.25, promote_on_hit=False),
        "daemon": {"client_timeout": 1.0},
    }
    d = _on_disk_only(daemons, "t36", cfg, 4)
    want = [hashlib.sha256(block(i)).hexdigest() for i in range(4)]
    code = textwrap.dedent(
        f"""
        import hashlib, json, os, signal
        from kvd_client import tierfiles, tiers as T
        real = tierfiles.read_trailer
        stopped = []
        def frozen(*a, **k):
            if not stopped:
                stopped.append(1)
                print("read", flush=True)
                os.kill(os.getpid(), signal.SIGSTOP)
            return real(*a, **k)
        tierfiles.read_trailer = frozen
        c = T.TierClient({d.socket!r}, {NS!r}, {BB}, timeout=5.0, io_timeout=10.0)
        keys = [{", ".join(repr(key(i)) for i in range(4))}]
        dests = [bytearray({BB}) for _ in keys]
        got = c.load(keys, [memoryview(x) for x in dests])
        right = [hashlib.sha256(x).hexdigest() for x in dests]
        print(json.dumps({{"got": got, "sums": right, "direct": c.direct_hits}}), flush=True)
        c.close()
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    paths = [Path(block_path(str(root), (NS, key(i)))) for i in range(4)]
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == b"read"
        _wait(lambda: Path(f"/proc/{p.pid}/stat").read_text().split(")")[1].split()[0] == "T")
        with TierClient(d.socket, NS, BB) as c:
            assert c.stats()["ops_open"] == 0  # (it pinned nothing)
            more = iter(range(400, 440))
            while any(path.exists() for path in paths):
                i = next(more)
                assert c.store([key(i)], [memoryview(block(i))]) == [True]
                _wait(lambda: c.stats()["host"]["demoting"] == 0)
        p.send_signal(signal.SIGCONT)
        rest, _ = p.communicate(timeout=30)  # (its load must end: never a hang)
        assert p.returncode == 0
        out = json.loads(rest.splitlines()[-1])
        for i, ok in enumerate(out["got"]):
            if ok:
                assert out["sums"][i] == want[i], f"block {i} loaded with wrong bytes"
        assert out["got"] == [True, False, False, False]
        assert out["direct"] == 1
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def test_a_bad_file_another_client_is_reading_goes_when_that_client_is_done(
    daemons: StartDaemon, workdir: Path
) -> None:
    """A file found bad (its checksum) while another client holds it to read: a miss at
    once for everyone (never served again), deleted when that client unpins it."""
    root = workdir / "disk"
    cfg = tiers_cfg(disk_path=str(root), disk_bytes=64 * BB, low_water=0.25, promote_on_hit=False)
    d = _on_disk_only(daemons, "t12", cfg, 2)
    path = Path(block_path(str(root), (NS, key(0))))
    raw = bytearray(path.read_bytes())
    raw[7] ^= 0x5A
    path.write_bytes(raw)
    with TierClient(d.socket, NS, BB) as a, TierClient(d.socket, NS, BB) as b:
        on_disk = b.stats()["disk"]["blocks"]
        held = a._ask(wire.TierPin(NS, 36, key(0), files=True), wire.TierSlots, 5.0)
        assert held.slots == (wire.SLOT_FILE,)
        # b reads the file, finds it bad, loads it through the pool: the daemon finds it
        # bad too, with a's pin on it
        assert load_check(b, [0, 1], bad_files=frozenset({0})) == [False, True]
        assert b.files_failed == 1
        assert b.batch_lookup([key(0)]) == [False]  # condemned: a miss from now on
        assert path.exists()  # a still has it
        assert b.stats()["counters"]["disk_corrupt"] == 1
        a._release(held.op, store=False)
        _wait(lambda: not path.exists())
        assert b.stats()["disk"]["blocks"] == on_disk - 1
        assert load_check(b, [0]) == [False]


@pytest.mark.parametrize("why", ["daemon-says-no", "client-cannot-open"])
def test_loads_go_through_the_pool_where_files_cannot_be_read(
    daemons: StartDaemon, workdir: Path, why: str
) -> None:
    """A daemon that keeps its files to itself (`disk_client_reads` off), or a client that
    cannot open them (another mount namespace, permissions; the directory it is told is
    replaced by one it cannot see, the fault a real namespace would give): every load
    still succeeds, through the pool; the client stops trying files after the first."""
    cfg = tiers_cfg(
        disk_path=str(workdir / "disk"),
        disk_bytes=64 * BB,
        low_water=0.25,
        promote_on_hit=False,
        disk_client_reads=why != "daemon-says-no",
    )
    d = _on_disk_only(daemons, "t9", cfg, 4)
    with TierClient(d.socket, NS, BB) as c:
        info = c._info()
        if why == "daemon-says-no":
            assert info.disk_files == ""
        else:
            assert info.disk_files == str(workdir / "disk")
            c._opened = dataclasses.replace(info, disk_files=str(workdir / "not-mounted"))
        assert load_check(c, [0, 1]) == [True, True]
        assert load_check(c, [2, 3]) == [True, True]
        assert c.files_read == 0
        assert c.files_failed == (0 if why == "daemon-says-no" else 2)
        assert c._files_unreadable == (why != "daemon-says-no")
        counters = c.stats()["counters"]
        assert counters.get("disk_client_reads", 0) == (0 if why == "daemon-says-no" else 2)
        assert counters.get("disk_corrupt", 0) == 0


def test_killed_client_pins_released(daemons: StartDaemon) -> None:
    """SIGKILL a client holding pins: they are released when its connection is lost,
    well inside a short bound, not after `client_timeout` or `pin_timeout` (both 60 s
    here)."""
    d = daemons("t6", overrides={**tiers_cfg(pin_timeout=60.0), "daemon": {"client_timeout": 60.0}})
    with TierClient(d.socket, NS, BB) as c:
        assert all(c.store([key(i) for i in range(16)], [memoryview(block(i)) for i in range(16)]))
    # a client that pins every block (a load's first step) and is killed before unpinning
    code = textwrap.dedent(
        f"""
        import sys, time
        from kvd_client import wire
        from kvd_client.tiers import TierClient
        c = TierClient({d.socket!r}, {NS!r}, {BB})
        keys = [{", ".join(repr(key(i)) for i in range(16))}]
        got = c._ask(wire.TierPin(c.namespace, 36, b"".join(keys)), wire.TierSlots, 5.0)
        assert all(s >= 0 for s in got.slots)
        print("pinned", flush=True)
        time.sleep(60)
        """
    )
    env = dict(os.environ)
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == b"pinned"
        with TierClient(d.socket, NS, BB) as c:
            assert c.stats()["ops_open"] == 1
            # every slot is pinned: a new block cannot be stored
            assert c.store([key(99)], [memoryview(block(99))]) == [False]
            p.send_signal(signal.SIGKILL)
            p.wait()
            t_kill = time.monotonic()
            _wait(lambda: c.stats()["ops_open"] == 0, timeout=10)
            assert time.monotonic() - t_kill < 5.0  # (far under the 60 s bounds)
            counters = c.stats()["counters"]
            assert counters.get("pins_expired", 0) == 0
            assert c.store([key(99)], [memoryview(block(99))]) == [True]
            assert load_check(c, [99]) == [True]
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_pool_segment_removed_at_stop(daemons: StartDaemon) -> None:
    d = daemons("t7", overrides=tiers_cfg())
    with TierClient(d.socket, NS, BB) as c:
        pool = c.stats()["pool"]
    assert pool.startswith("kvd-tiers-") and pool in shm_segments("kvd-tiers-")
    d.stop()
    assert pool not in shm_segments("kvd-tiers-")


def _in_ns(pid: int, path: str) -> bool:
    """Does `path` exist in the mount namespace of process `pid`?"""
    return (Path(f"/proc/{pid}/root") / path.lstrip("/")).exists()


def _quiet(c: TierClient) -> bool:
    """No demotion and no disk read under way (a promotion's included)."""
    time.sleep(0.05)
    s = c.stats()
    return bool(s["host"]["demoting"] == 0 and s["disk"]["reading"] == 0)


def _wait(cond: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            pytest.fail("condition not met in time")
        time.sleep(0.02)


def test_full_disk_fails_cleanly(workdir: Path) -> None:
    """A real full file system: a 1 MiB tmpfs mounted in the daemon's own user and mount
    namespace (`unshare -rm`, no root needed), under a disk tier told it may use 16 MiB.
    Demotions that hit ENOSPC fail, their temp files are removed, and nothing
    half-written is ever found or served."""
    if shutil.which("unshare") is None:
        pytest.skip("unshare(1) is not installed")
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip(f"unprivileged user namespaces are off: {probe.stderr.decode().strip()}")
    root = workdir / "small"
    root.mkdir()
    mount = f'mount -t tmpfs -o size=1m kvdtest "{root}" && exec "$0" "$@"'
    d = start_daemon(
        workdir,
        "tfull",
        overrides={
            **tiers_cfg(disk_path=str(root), disk_bytes=16 << 20, low_water=0.25),
            "daemon": {"reap_leftover_segments": False},
        },
        prefix=["unshare", "-rm", "sh", "-c", mount],
    )
    seen = Path(f"/proc/{d.proc.pid}/root") / str(root).lstrip("/")
    try:
        with TierClient(d.socket, NS, BB) as c:
            ids = list(range(48))
            for i in ids:
                c.store([key(i)], [memoryview(block(i))])
            _wait(lambda: c.stats()["host"]["demoting"] == 0)
            s = c.stats()
            assert s["counters"].get("disk_write_failed", 0) > 0, s
            # only whole blocks: the index holds exactly the renamed files, no temp file
            files = list(seen.rglob(f"*{SUFFIX}"))
            assert not list(seen.rglob(f"*{TMP_SUFFIX}"))
            assert s["disk"]["blocks"] == len(files) > 0
            assert s["disk"]["used"] == len(files) * BB
            on_disk = [i for i in ids if _in_ns(d.proc.pid, block_path(str(root), (NS, key(i))))]
            assert len(on_disk) == len(files)
            # what is found loads with the right bytes (load_check), every block on disk
            # among it; a block only in the host tier may be dropped meanwhile, when the
            # demoter's write of it fails (a miss, which the engine recomputes)
            found = c.batch_lookup([key(i) for i in ids])
            held = [i for i, f in zip(ids, found, strict=True) if f]
            assert set(on_disk) <= set(held) and len(held) < len(ids)
            loaded = dict(zip(held, load_check(c, held), strict=True))
            assert all(loaded[i] for i in on_disk)
            assert c.stats()["counters"].get("disk_corrupt", 0) == 0
    finally:
        rc = d.stop()
    assert rc == 0, d.report(2000)


def test_cli_status_and_metrics(daemons: StartDaemon, workdir: Path) -> None:
    from .test_metrics import _free_port, _get, _samples

    port = _free_port()
    root = workdir / "disk"
    cfg = {**tiers_cfg(disk_path=str(root), disk_bytes=64 * BB), "metrics": {"port": port}}
    d = daemons("t8", overrides=cfg)
    with TierClient(d.socket, NS, BB) as c:
        assert all(c.store([key(i) for i in range(3)], [memoryview(block(i)) for i in range(3)]))
        assert c.batch_lookup([key(0), key(7)]) == [True, False]
        assert load_check(c, [1, 2]) == [True, True]
    run = [sys.executable, "-m", "kvd"]
    out = subprocess.run(
        [*run, "tiers", "--socket", d.socket, "--json"], capture_output=True, check=True
    )
    data = json.loads(out.stdout)
    assert data["host"]["blocks"] == 3 and data["host"]["hits"] == 1
    assert data["host"]["misses"] == 1 and data["host"]["bytes_out"] == 2 * BB
    assert data["disk"]["capacity"] == 64 * BB and data["disk"]["path"] == str(root)
    # (the lookup's round trip came after the store's one-way commit: both loads direct)
    assert data["host"]["directory"] == {"blocks": 3, "unpublished": 0, "direct_loads": 2}
    table = subprocess.run([*run, "tiers", "--socket", d.socket], capture_output=True, check=True)
    assert b"host" in table.stdout and b"disk" in table.stdout
    assert b"lent to clients" in table.stdout
    assert b"directory: 3 blocks" in table.stdout
    status = subprocess.run(
        [*run, "status", "--socket", d.socket, "--json"], capture_output=True, check=True
    )
    assert json.loads(status.stdout)["tiers"]["host"]["blocks"] == 3
    m = _samples(port)
    agent = "t8"
    assert _get(m, "kvd_tiers_hits_total", agent=agent, tier="host") == 1
    assert _get(m, "kvd_tiers_bytes_in_total", agent=agent, tier="host") == 3 * BB
    assert _get(m, "kvd_tiers_blocks", agent=agent, tier="host") == 3
    assert _get(m, "kvd_tiers_capacity_bytes", agent=agent, tier="disk") == 64 * BB


def test_tiers_off_refuses_clearly(daemons: StartDaemon) -> None:
    from kvd_client.errors import InvalidRequest

    d = daemons("t9")
    with pytest.raises(InvalidRequest, match=r"tiers\.enabled"):
        TierClient(d.socket, NS, BB)


def test_client_survives_a_daemon_restart(daemons: StartDaemon) -> None:
    d = daemons("t10", overrides=tiers_cfg())
    with TierClient(d.socket, NS, BB) as c:
        assert c.store([key(1)], [memoryview(block(1))]) == [True]
        d.stop()
        d2 = daemons("t10", overrides=tiers_cfg())
        assert d2.socket == d.socket
        # a new daemon: a new session and a new (empty) pool, met on the next call
        assert c.batch_lookup([key(1)]) == [False]
        assert c.reopened == 1
        assert c.store([key(2)], [memoryview(block(2))]) == [True]
        assert load_check(c, [2]) == [True]


def test_host_hits_load_through_the_directory_without_a_pin(daemons: StartDaemon) -> None:
    """Host-tier hits are copied straight out of the pool through the daemon's directory:
    right bytes, no operation opened, counted by the daemon from the client's one-way
    TierTouch; a key not in the directory (a miss) still goes the pinned way."""
    d = daemons("t31", overrides=tiers_cfg())
    with TierClient(d.socket, NS, BB) as c:
        assert c.store([key(i) for i in range(4)], [memoryview(block(i)) for i in range(4)])
        # (a store's commit is one-way: its blocks are published once the daemon handled
        # it, which this round trip makes sure of; before, a load takes the pinned way)
        assert c.batch_lookup([key(i) for i in range(4)]) == [True] * 4
        assert load_check(c, [0, 1, 2, 3, 9]) == [True] * 4 + [False]
        assert c.direct_hits == 4 and c.direct_stale == 0
        st = c.stats()  # (a round trip after the touch: the daemon handled it)
        assert st["counters"]["direct_loads"] == 4
        assert st["counters"]["blocks_loaded"] == 4
        assert st["host"]["bytes_out"] == 4 * BB
        assert st["ops_open"] == 0
        c.direct_loads = False  # the pinned way: the same bytes, one round trip
        assert load_check(c, [2, 3]) == [True, True]
        assert c.direct_hits == 4
        st = c.stats()
        assert st["counters"]["direct_loads"] == 4
        assert st["counters"]["blocks_loaded"] == 6


def test_a_load_through_the_directory_keeps_its_block_recent(daemons: StartDaemon) -> None:
    """A block loaded without a pin is still a use: the daemon makes it the most recently
    used (TierTouch), so eviction takes the block nobody loaded."""
    d = daemons("t32", overrides=tiers_cfg(host_bytes=4 * BB))
    with TierClient(d.socket, NS, BB) as c:
        for i in range(4):  # stored oldest first: 0, 1, 2, 3
            assert c.store([key(i)], [memoryview(block(i))]) == [True]
        assert c.batch_lookup([key(0)]) == [True]  # (the one-way commits handled)
        assert load_check(c, [0]) == [True]
        assert c.direct_hits == 1
        assert c.store([key(4)], [memoryview(block(4))]) == [True]  # one eviction
        assert c.batch_lookup([key(i) for i in range(5)]) == [True, False, True, True, True]


def test_a_killed_daemons_directory_is_left_for_the_new_daemon(daemons: StartDaemon) -> None:
    """A daemon killed (SIGKILL: its directory is never marked closed) and started again:
    the client hears from its keep-alives that its session is gone, stops loading through
    the dead daemon's directory, and its next load opens a session with the new daemon
    (whose tiers are empty: a miss, then its own blocks through its own directory)."""
    cfg = {**tiers_cfg(), "daemon": {"client_timeout": 1.0}}
    d = daemons("t33", overrides=cfg)
    with TierClient(d.socket, NS, BB) as c:
        assert c.store([key(1)], [memoryview(block(1))]) == [True]
        assert c.batch_lookup([key(1)]) == [True]  # (the one-way commit handled)
        assert load_check(c, [1]) == [True] and c.direct_hits == 1
        d.kill()
        d2 = daemons("t33", overrides=cfg)
        _wait(lambda: c._session_lost == c._session, timeout=10)
        assert load_check(c, [1]) == [False]
        assert c.reopened == 1 and c.direct_hits == 1
        assert c.store([key(2)], [memoryview(block(2))]) == [True]
        assert c.batch_lookup([key(2)]) == [True]
        assert load_check(c, [2]) == [True] and c.direct_hits == 2
        assert d2.proc.poll() is None


def test_bad_touches_are_counted_never_answered(daemons: StartDaemon) -> None:
    """A TierTouch is one-way: one naming a namespace the session did not open, or keys
    that are not a batch, is counted and logged, never answered; the daemon and the
    session go on. To a daemon without tiers likewise."""
    d = daemons("t34", overrides=tiers_cfg())
    with TierClient(d.socket, NS, BB) as c:
        assert c.store([key(1)], [memoryview(block(1))]) == [True]
        assert c.batch_lookup([key(1)]) == [True]
        sock = c._sock
        assert sock is not None
        for bad in (
            wire.TierTouch(b"another-model", 36, key(1)),
            wire.TierTouch(NS, 36, key(1) + b"x"),
        ):
            sock.send(wire.encode(bad, 999_999))
        st = c.stats()  # (answered: the touches were handled before it, and not answered)
        assert st["counters"]["requests_rejected"] == 2
        assert st["counters"].get("direct_loads", 0) == 0
        assert load_check(c, [1]) == [True] and c.direct_hits == 1
        assert 999_999 not in c._replies
    off = daemons("t35")
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{off.socket}")
    try:
        sock.send(wire.encode(wire.Hello("tiers-raw-1", "tiers", "", -1, os.getpid(), "0"), 1))
        assert sock.poll(5000)
        assert isinstance(wire.decode(sock.recv())[1], wire.Welcome)
        with KvdClient(off.socket, role="cli", timeout=5.0, keepalive_interval=0) as cli:
            sock.send(wire.encode(wire.TierTouch(NS, 36, key(1)), 2))
            _wait(lambda: cli.status()["counters"].get("tiers_requests_rejected", 0) == 1)
        assert not sock.poll(100)  # never answered
    finally:
        sock.close(0)


def test_pins_expire_after_pin_timeout(daemons: StartDaemon) -> None:
    from kvd_client import wire

    d = daemons("t11", overrides=tiers_cfg(pin_timeout=0.5))
    with TierClient(d.socket, NS, BB) as c:
        assert all(c.store([key(i) for i in range(2)], [memoryview(block(i)) for i in range(2)]))
        # a load's first step, never followed by its unpin
        got = c._ask(wire.TierPin(NS, 36, key(0) + key(1)), wire.TierSlots, 5.0)
        assert all(s >= 0 for s in got.slots)
        assert c.stats()["ops_open"] == 1
        _wait(lambda: c.stats()["ops_open"] == 0, timeout=5)
        assert c.stats()["counters"]["pins_expired"] == 1
        assert load_check(c, [0, 1]) == [True, True]


def test_keys_of_mixed_lengths_in_one_batch(daemons: StartDaemon) -> None:
    d = daemons("t12", overrides=tiers_cfg())
    short = [b"k-%d" % i for i in range(3)]
    with TierClient(d.socket, NS, BB) as c:
        keys = [key(0), short[0], key(1), short[1]]
        assert c.store(keys, [memoryview(block(i)) for i in range(4)]) == [True] * 4
        assert c.batch_lookup([short[1], key(1), short[2], key(0)]) == [True, True, False, True]
        dests = [bytearray(BB) for _ in range(4)]
        assert c.load(keys, [memoryview(x) for x in dests]) == [True] * 4
        assert [bytes(x) for x in dests] == [block(i) for i in range(4)]


def test_one_way_commit_visible_in_order_and_refusal_counted(daemons: StartDaemon) -> None:
    """A store's commit is sent without waiting: the storing session's next request
    already sees the blocks (the daemon handles a session's messages in order), a block
    is never visible before its commit, and a commit the daemon refuses (its reservation
    expired meanwhile) stores nothing and is counted by the client."""
    from kvd_client import wire

    d = daemons("t13", overrides=tiers_cfg(pin_timeout=2.0))
    with TierClient(d.socket, NS, BB) as c, TierClient(d.socket, NS, BB) as other:
        assert c.store([key(0)], [memoryview(block(0))]) == [True]
        assert c.batch_lookup([key(0)]) == [True]  # the next request, right behind the commit
        assert load_check(other, [0]) == [True]
        # reserved and copied, not committed: invisible to everyone
        got = c._ask(wire.TierReserve(NS, 36, key(1)), wire.TierSlots, 5.0)
        (slot,) = got.slots
        assert slot >= 0
        pool = c._need_pool()
        pool[slot * BB : (slot + 1) * BB] = block(1)
        assert other.batch_lookup([key(1)]) == [False]
        assert load_check(other, [1]) == [False]
        # the reservation expires before the commit arrives: refused, nothing stored
        _wait(lambda: other.stats()["counters"].get("pins_expired", 0) == 1, timeout=15)
        # (its slot stays out of use: the client may still be copying into it)
        assert other.stats()["host"]["quarantined"] == 1
        c._commit(got.op, b"\x01")
        assert c.batch_lookup([key(1)]) == [False]
        assert other.stats()["host"]["quarantined"] == 0  # its commit: it is done
        assert c.commits_refused == 1
        assert load_check(other, [1]) == [False]
        assert c.commits_refused == 1 and c.store([key(2)], [memoryview(block(2))]) == [True]
        # (the commit is one-way: another session sees it once the daemon handled it, which
        # the storing session's next round trip makes sure of)
        assert c.batch_lookup([key(2)]) == [True]
        assert load_check(other, [0, 2]) == [True, True]


def _frozen_client(
    d: Any, call: str, *, direct: bool = False, at: str = "_check_slots"
) -> subprocess.Popen[bytes]:
    """A client process that stops itself (SIGSTOP) at the first call of `at`: by default
    once the daemon answered its store's or load's slots, before it copies a byte; thawed,
    it finishes `call`, prints what it got, then makes one more call (a lookup) and exits.
    `direct`: its loads go through the directory first (`TierClient.direct_loads`)."""
    code = textwrap.dedent(
        f"""
        import hashlib, json, os, signal
        from kvd_client import tiers as T
        {_freeze_at(at, "answered")}
        def key(i):
            return hashlib.sha256(f"block-{{i}}".encode()).digest() + bytes(4)
        def block(i):
            seed = hashlib.sha256({NS!r} + i.to_bytes(8, "little")).digest()
            return (seed * ({BB} // len(seed) + 1))[:{BB}]
        c = T.TierClient({d.socket!r}, {NS!r}, {BB}, timeout=5.0, io_timeout=10.0)
        c.direct_loads = {direct!r}
        keys = [key(0), key(1)]
        if {call!r} == "store":
            got = c.store(keys, [memoryview(block(i)) for i in range(2)])
            sums = []
        else:
            dests = [bytearray({BB}) for _ in keys]
            got = c.load(keys, [memoryview(x) for x in dests])
            sums = [hashlib.sha256(x).hexdigest() for x in dests]
        print(json.dumps({{"got": got, "sums": sums, "stale": c.stale_reads,
                           "direct_stale": c.direct_stale}}), flush=True)
        c.batch_lookup(keys)
        print(json.dumps({{"reopened": c.reopened}}), flush=True)
        c.close()
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert p.stdout is not None
    assert p.stdout.readline().strip() == b"answered"
    _wait(lambda: Path(f"/proc/{p.pid}/stat").read_text().split(")")[1].split()[0] == "T")
    return p


@pytest.mark.parametrize("direct", [False, True], ids=["pinned", "directory"])
def test_a_reader_frozen_before_its_check_never_loads_reused_slots(
    daemons: StartDaemon, direct: bool
) -> None:
    """A reader frozen before it checks its copies, while the blocks are evicted and their
    slots take other blocks. Pinned: frozen between the daemon's answer (its pool slots)
    and its copies, past `client_timeout`, so its session ends and its pins go. Through
    the directory: frozen after its copies (it pinned nothing). Thawed, its check sees the
    slots' generations moved on: misses, never another block's bytes reported loaded."""
    cfg = {**tiers_cfg(host_bytes=4 * BB), "daemon": {"client_timeout": 1.0}}
    d = daemons("t30" if direct else "t20", overrides=cfg)
    with TierClient(d.socket, NS, BB) as c:
        assert all(c.store([key(i) for i in range(2)], [memoryview(block(i)) for i in range(2)]))
    at = "_unchanged" if direct else "_check_slots"
    p = _frozen_client(d, "load", direct=direct, at=at)
    try:
        with TierClient(d.socket, NS, BB) as c:
            _wait(lambda: c.stats()["ops_open"] == 0, timeout=10)  # its pins went (or none)
            ids = list(range(100, 104))  # fill every slot: 0 and 1 are evicted
            assert all(c.store([key(i) for i in ids], [memoryview(block(i)) for i in ids]))
            assert c.batch_lookup([key(0), key(1)]) == [False, False]
            p.send_signal(signal.SIGCONT)
            rest, _ = p.communicate(timeout=30)
            assert p.returncode == 0
            out = json.loads(rest.splitlines()[0])
            want = [hashlib.sha256(block(i)).hexdigest() for i in range(2)]
            for i, ok in enumerate(out["got"]):
                if ok:
                    assert out["sums"][i] == want[i], f"block {i} loaded with wrong bytes"
            assert out["got"] == [False, False]
            # its copies saw the slots' generations move on
            assert out["direct_stale" if direct else "stale"] == 2
            assert load_check(c, ids) == [True] * 4
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def test_a_writer_frozen_past_its_session_never_overwrites_other_blocks(
    daemons: StartDaemon,
) -> None:
    """A writer frozen between the daemon's answer (its reserved slots) and its copies,
    past `client_timeout`: its session ends, but the slots it was given are not reused
    while it may still write into them (quarantined); other stores go elsewhere and are
    never overwritten when it thaws and copies. Its own store is refused (nothing
    visible); the slots come back once it is known to be done (it reopened a session)."""
    cfg = {**tiers_cfg(host_bytes=4 * BB), "daemon": {"client_timeout": 1.0}}
    d = daemons("t21", overrides=cfg)
    p = _frozen_client(d, "store")
    try:
        with TierClient(d.socket, NS, BB) as c:
            _wait(lambda: c.stats()["ops_open"] == 0, timeout=10)
            assert c.stats()["host"]["quarantined"] == 2
            ids = [100, 101, 102]
            for i in ids:
                assert c.store([key(i)], [memoryview(block(i))]) == [True]
            # two slots are out of use: the third store evicted the first block instead
            assert c.batch_lookup([key(i) for i in ids]) == [False, True, True]
            p.send_signal(signal.SIGCONT)
            rest, _ = p.communicate(timeout=30)
            assert p.returncode == 0
            lines = rest.splitlines()
            assert json.loads(lines[1])["reopened"] == 1
            assert load_check(c, [101, 102]) == [True, True]  # never overwritten
            assert c.batch_lookup([key(0), key(1)]) == [False, False]
            assert c.stats()["host"]["quarantined"] == 0  # given back by its next session
            more = [103, 104]
            assert all(c.store([key(i) for i in more], [memoryview(block(i)) for i in more]))
            assert load_check(c, [101, 102, 103, 104]) == [True] * 4
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()


def test_a_frozen_writer_killed_gives_its_slots_back(daemons: StartDaemon) -> None:
    """The slots kept out of use for a frozen writer come back once its process is gone."""
    cfg = {**tiers_cfg(host_bytes=4 * BB), "daemon": {"client_timeout": 1.0}}
    d = daemons("t22", overrides=cfg)
    p = _frozen_client(d, "store")
    try:
        with TierClient(d.socket, NS, BB) as c:
            _wait(lambda: c.stats()["host"]["quarantined"] == 2, timeout=10)
            p.kill()
            p.wait()
            _wait(lambda: c.stats()["host"]["quarantined"] == 0, timeout=10)
            ids = list(range(100, 104))  # every slot usable again: nothing evicted
            assert all(c.store([key(i) for i in ids], [memoryview(block(i)) for i in ids]))
            assert load_check(c, ids) == [True] * 4
            assert c.stats()["host"]["evictions"] == 0
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


def test_stores_into_slots_lent_ahead(daemons: StartDaemon) -> None:
    """After its first store, a client holds slots the daemon lent it ahead (`TierGrant`)
    and its next stores copy into them and name their keys one-way (`TierPut`): no round
    trip. Every byte arrives; a key held already gives its slot back; a session's end
    gives back what it still holds."""
    d = daemons("t23", overrides=tiers_cfg(host_bytes=64 * BB))  # 64 slots: 8 lent at most
    with TierClient(d.socket, NS, BB) as c, TierClient(d.socket, NS, BB) as other:
        assert c.store([key(0)], [memoryview(block(0))]) == [True]  # (reserved: none lent)
        assert c.store([key(1)], [memoryview(block(1))]) == [True]  # into a lent slot
        c._take_grant()
        assert len(c._spare) == 1
        ids = list(range(2, 6))  # more than it holds: reserved, and 3 more asked for
        assert c.store([key(i) for i in ids], [memoryview(block(i)) for i in ids]) == [True] * 4
        c._take_grant()
        assert len(c._spare) == 4 and other.stats()["host"]["lent"] == 4
        ids = list(range(6, 10))  # into lent slots
        assert c.store([key(i) for i in ids], [memoryview(block(i)) for i in ids]) == [True] * 4
        assert c._spare == []
        # (a put is one-way: the storing session's next request sees it; another session
        # once the daemon handled it, which that round trip makes sure of)
        assert c.batch_lookup([key(i) for i in range(10)]) == [True] * 10
        assert load_check(other, list(range(10))) == [True] * 10
        # a key held already: its lent slot comes back, its bytes stay the first store's
        c._take_grant()
        spare = len(c._spare)
        assert spare == 4
        assert c.store([key(3)], [memoryview(block(7))]) == [True]
        assert c.batch_lookup([key(3)]) == [True]  # (the put handled: see above)
        assert load_check(other, [3]) == [True]
        s = other.stats()
        assert s["host"]["blocks"] == 10 and s["host"]["lent"] == spare - 1
        assert s["counters"]["slots_lent"] == 1 + 1 + 3 + 4
        assert c.commits_refused == 0
    with TierClient(d.socket, NS, BB) as c:
        s = c.stats()
        assert s["host"]["lent"] == 0 and s["host"]["quarantined"] == 0  # (goodbye)
        assert s["host"]["free_slots"] == 64 - 10


def test_a_put_naming_slots_not_lent_is_refused(daemons: StartDaemon) -> None:
    d = daemons("t24", overrides=tiers_cfg(host_bytes=64 * BB))
    with TierClient(d.socket, NS, BB) as c, TierClient(d.socket, NS, BB) as other:
        got = other._ask(wire.TierGrant(2), wire.TierGranted, 5.0)
        assert len(got.slots) == 2
        # another session's lent slot, and one never lent: refused, nothing stored
        put = wire.TierPut(NS, 36, key(0) + key(1), (got.slots[0], 60))
        assert c._ask(put, wire.TierFlags, 5.0).flags == b"\x00\x00"
        assert c.batch_lookup([key(0), key(1)]) == [False, False]
        assert c.stats()["counters"]["put_refused"] == 2
        with pytest.raises(Exception, match="2 keys but 1 slots"):
            c._ask(wire.TierPut(NS, 36, key(0) + key(1), (1,)), wire.TierFlags, 5.0)
        # the owner's put of the same slot still works
        pool = other._need_pool()
        pool[got.slots[0] * BB : (got.slots[0] + 1) * BB] = block(0)
        put = wire.TierPut(NS, 36, key(0), (got.slots[0],))
        assert other._ask(put, wire.TierFlags, 5.0).flags == b"\x01"
        assert load_check(c, [0]) == [True]


def test_a_writer_frozen_with_lent_slots_never_overwrites_other_blocks(
    daemons: StartDaemon,
) -> None:
    """A client frozen while it holds slots lent ahead (here: as its store takes them,
    before it copies), past `client_timeout`: those slots stay out of use until it is
    known to be done; other stores never get them, and its late put is refused."""
    cfg = {**tiers_cfg(host_bytes=16 * BB), "daemon": {"client_timeout": 1.0}}  # 2 lent
    d = daemons("t25", overrides=cfg)
    code = textwrap.dedent(
        f"""
        import hashlib, json, os, signal
        from kvd_client import tiers as T
        def key(i):
            return hashlib.sha256(f"block-{{i}}".encode()).digest() + bytes(4)
        def block(i):
            seed = hashlib.sha256({NS!r} + i.to_bytes(8, "little")).digest()
            return (seed * ({BB} // len(seed) + 1))[:{BB}]
        c = T.TierClient({d.socket!r}, {NS!r}, {BB}, timeout=5.0, io_timeout=10.0)
        assert c.store([key(0), key(1)], [memoryview(block(i)) for i in range(2)]) == [True] * 2
        real = c._granted
        def frozen(got):
            real(got)
            print(json.dumps({{"lent": list(c._spare)}}), flush=True)
            os.kill(os.getpid(), signal.SIGSTOP)
        c._granted = frozen
        got = c.store([key(2), key(3)], [memoryview(block(i)) for i in (2, 3)])
        print(json.dumps({{"got": got, "refused": c.commits_refused}}), flush=True)
        c.batch_lookup([key(2)])
        print(json.dumps({{"reopened": c.reopened, "refused": c.commits_refused}}), flush=True)
        c.close()
        """
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE)
    try:
        assert p.stdout is not None
        lent = json.loads(p.stdout.readline())["lent"]
        assert len(lent) == 2
        _wait(lambda: Path(f"/proc/{p.pid}/stat").read_text().split(")")[1].split()[0] == "T")
        with TierClient(d.socket, NS, BB) as c:
            c.read_files = False
            _wait(lambda: c.stats()["host"]["quarantined"] == 2, timeout=10)
            ids = list(range(100, 110))  # 2 quarantined, 2 held, 10, 1 lent to c: 15 of 16
            for i in ids:
                assert c.store([key(i)], [memoryview(block(i))]) == [True]
            assert c.batch_lookup([key(0), key(1)]) == [True, True]
            p.send_signal(signal.SIGCONT)
            rest, _ = p.communicate(timeout=30)
            assert p.returncode == 0
            lines = [json.loads(x) for x in rest.splitlines()]
            assert lines[-1]["reopened"] == 1 and lines[-1]["refused"] == 2
            assert c.stats()["host"]["evictions"] == 0
            assert load_check(c, [*ids, 0, 1]) == [True] * 12  # never overwritten
            assert c.batch_lookup([key(2), key(3)]) == [False, False]  # its put: refused
            _wait(lambda: c.stats()["host"]["quarantined"] == 0, timeout=10)
    finally:
        if p.poll() is None:
            p.send_signal(signal.SIGCONT)
            p.kill()
            p.wait()
