"""Warm encoder-cache hits served by the client from the consumer daemon's EC index
(`KvdClient.ec_read`, `kvd_client.ecindex`): real daemons, real NIXL, real shm.

The rule under test: a copy `ec_read` returns True for holds exactly the producer's bytes,
even when the daemon evicts the output and reuses its blocks while the client copies;
otherwise it returns False and the IPC path (`ec_ensure`) serves the output."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
from kvd_client import wire
from kvd_client.client import KvdClient

from kvd.demo import start_daemon
from kvd.ecdemo import ECSide, output_bytes

from .conftest import StartDaemon, shm_segments
from .test_ec import ec_cfg

MiB = 1 << 20
COMPAT = "ec-fast"
ROOT = Path(__file__).resolve().parents[2]


def commit(prod: ECSide, image: int, nbytes: int) -> wire.ECParams:
    mm = f"img-{image}"
    blocks = prod.client.ec_allocate(mm, nbytes)
    prod.write(blocks.block_ids, output_bytes(image, nbytes))
    return prod.client.ec_commit(mm, nbytes, compat=COMPAT)


def fetch(client: KvdClient, params: wire.ECParams, timeout: float = 15.0) -> wire.ECReady:
    """The IPC path: ensure, wait for ECReady, release."""
    client.ec_ensure(params)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in client.wait_events(0.5):
            if isinstance(ev, wire.ECReady) and ev.mm_hash == params.mm_hash:
                client.ec_release(params.mm_hash)
                return ev
            assert not isinstance(ev, wire.ECUnavailable), ev
    raise AssertionError(f"no ECReady for {params.mm_hash}")


def image_of(params: wire.ECParams) -> int:
    return int(params.mm_hash.split("-")[1])


def served_right(client: KvdClient, params: wire.ECParams) -> bool:
    """ec_read into a buffer that holds no right byte; True only if served and exact."""
    out = np.full(params.nbytes, 0, dtype=np.uint8)
    want = output_bytes(image_of(params), params.nbytes)
    out[:] = ~want
    if not client.ec_read(params, out):
        return False
    assert np.array_equal(out, want), f"{params.mm_hash}: ec_read served wrong bytes"
    return True


def test_fast_hits_are_exact_counted_and_keep_lru_order(daemons: StartDaemon) -> None:
    e = daemons("kvd-enc", ec_cfg("producer", 64 * MiB))
    c = daemons("kvd-con", ec_cfg("consumer", 16 * MiB))
    prod, cons = ECSide(e.socket, "encoder"), ECSide(c.socket, "consumer")
    try:
        a, b, cc, d, x = (commit(prod, i, 4 * MiB - 1000 * i) for i in range(1, 6))
        assert not served_right(cons.client, a)  # not cached yet: not served, no request
        assert cons.client.status()["counters"].get("ec_xfer_requests", 0) == 0
        for p in (a, b, cc, d):
            fetch(cons.client, p)
        st = cons.client.status("ec")
        assert st["index"] == st["region"] + ".idx" and st["indexed"] == 4
        hits0 = st["hits"]

        # A, B, C, D fill the cache (16 blocks); A is the least recently used
        for _ in range(10):
            assert served_right(cons.client, a)
        # under another compat, or with other nbytes: not served (the IPC path decides)
        assert not cons.client.ec_read(wire.ECParams(**{**asdict(a), "compat": "other"}), b"")
        bigger = bytearray(a.nbytes + 1)
        assert not cons.client.ec_read(
            wire.ECParams(**{**asdict(a), "nbytes": a.nbytes + 1}), bigger
        )
        assert cons.client.ec_fast_hits == 10 and cons.client.ec_fast_races == 0
        cons.client.drain_events()  # sends the hit report (without waiting for its reply)
        deadline = time.monotonic() + 5
        while cons.client.status("ec")["hits"] < hits0 + 10 and time.monotonic() < deadline:
            time.sleep(0.05)
        st = cons.client.status("ec")
        assert (st["hits"], st["client_hits"]) == (hits0 + 10, 10)
        assert cons.client.status()["counters"]["ec_hits_client"] == 10

        # the reported hits made A the most recently used: X evicts B, not A
        fetch(cons.client, x)
        assert served_right(cons.client, a)
        assert not served_right(cons.client, b)
        assert served_right(cons.client, x)
        st = cons.client.status("ec")
        assert "img-2" not in st["cached"] and "img-1" in st["cached"]
        assert st["consumer"]["pinned"] == 0
    finally:
        prod.close()
        cons.close()


def test_eviction_while_copying_is_never_served(daemons: StartDaemon) -> None:
    """Forced: the client's hook runs between its lookup and its copy, and makes the
    daemon evict the output and reuse its blocks for others (the producer WRITEs them)."""
    e = daemons("kvd-enc", ec_cfg("producer", 64 * MiB))
    c = daemons("kvd-con", ec_cfg("consumer", 8 * MiB))
    prod, cons = ECSide(e.socket, "encoder"), ECSide(c.socket, "consumer")
    other = KvdClient(c.socket, engine_id="thrasher")
    other.connect()
    try:
        a, b, cc = (commit(prod, i, 4 * MiB) for i in (1, 2, 3))
        first = fetch(cons.client, a)
        assert served_right(cons.client, a)
        reused: list[int] = []

        def evict_now(i: int) -> None:
            if i == 0:
                for p in (b, cc):  # 8 blocks: A's four are reused
                    reused.extend(fetch(other, p).block_ids)

        want = output_bytes(1, a.nbytes)
        out = np.zeros(a.nbytes, dtype=np.uint8)
        assert not cons.client.ec_read(a, out, between=evict_now)
        assert set(first.block_ids) <= set(reused)
        # the race was real: what the client copied is another output's bytes...
        assert not np.array_equal(out, want)
        assert cons.client.ec_fast_races == 1
        # ...and it was not served; the IPC path serves the right bytes, then the index too
        again = fetch(cons.client, a)
        assert cons.matches(again.block_ids, want)
        assert served_right(cons.client, a)
        assert cons.client.status("ec")["consumer"]["pinned"] == 0
    finally:
        other.close()
        prod.close()
        cons.close()


READER = r"""
import json, sys, time
import numpy as np
from kvd_client import wire
from kvd_client.client import KvdClient
from kvd.ecdemo import output_bytes

sock, seconds, mode, plist = sys.argv[1], float(sys.argv[2]), sys.argv[3], json.loads(sys.argv[4])
params = [wire.ECParams(**{**d, "shape": tuple(d["shape"])}) for d in plist]
want = {p.mm_hash: output_bytes(int(p.mm_hash.split("-")[1]), p.nbytes) for p in params}
c = KvdClient(sock, engine_id="reader")
c.connect()
out = np.empty(max(p.nbytes for p in params), dtype=np.uint8)

def pause(i):
    if mode == "hang":
        print("copying", flush=True)
        time.sleep(3600)
    time.sleep(0.001)  # widen the window between lookup and copy

served = wrong = 0
end = time.monotonic() + seconds
while time.monotonic() < end:
    for p in params:
        out[: p.nbytes] = ~want[p.mm_hash]
        if c.ec_read(p, out, between=pause):
            served += 1
            wrong += not np.array_equal(out[: p.nbytes], want[p.mm_hash])
    c.drain_events()
print(json.dumps(dict(served=served, wrong=wrong, races=c.ec_fast_races, misses=c.ec_fast_misses)))
c.close()
"""


def reader(
    socket: str, seconds: float, mode: str, params: list[wire.ECParams]
) -> subprocess.Popen[str]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "client")]))
    plist = json.dumps([asdict(p) for p in params])
    return subprocess.Popen(
        [sys.executable, "-c", READER, socket, str(seconds), mode, plist],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def test_reader_process_against_a_thrashing_cache_never_gets_wrong_bytes(
    daemons: StartDaemon,
) -> None:
    """A reader process copies in a tight loop while this process makes the consumer daemon
    evict and refetch all the time (12 outputs through a cache that holds 4)."""
    e = daemons("kvd-enc", ec_cfg("producer", 64 * MiB))
    c = daemons("kvd-con", ec_cfg("consumer", 8 * MiB))
    prod, cons = ECSide(e.socket, "encoder"), ECSide(c.socket, "consumer")
    try:
        outs = [commit(prod, i, 2 * MiB - 4096 * i) for i in range(1, 13)]
        for p in outs[:4]:
            fetch(cons.client, p)
        proc = reader(c.socket, 6.0, "loop", outs)
        fetched = 0
        try:
            while proc.poll() is None:
                for p in outs:
                    ev = fetch(cons.client, p)
                    assert cons.matches(ev.block_ids, output_bytes(image_of(p), p.nbytes))
                    fetched += 1
            stdout, stderr = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 0, stderr
        stats = json.loads(stdout.strip().splitlines()[-1])
        print("reader:", stats, "fetched:", fetched)
        counters = cons.client.status()["counters"]
        assert stats["wrong"] == 0, stats
        assert stats["served"] > 0 and counters["ec_evicted"] > 20, (stats, counters)
        assert stats["races"] > 0, stats  # evictions did land inside copies, and were caught
        assert cons.client.status("ec")["consumer"]["pinned"] == 0
    finally:
        prod.close()
        cons.close()


def test_a_reader_killed_mid_copy_leaks_nothing(daemons: StartDaemon) -> None:
    e = daemons("kvd-enc", ec_cfg("producer", 64 * MiB))
    c = daemons("kvd-con", ec_cfg("consumer", 8 * MiB))
    prod, cons = ECSide(e.socket, "encoder"), ECSide(c.socket, "consumer")
    try:
        outs = [commit(prod, i, 2 * MiB) for i in range(1, 9)]
        for p in outs[:4]:
            fetch(cons.client, p)
        before = shm_segments()
        proc = reader(c.socket, 60.0, "hang", outs[:1])
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "copying"
            os.kill(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=10)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        # the client made no segment of its own (others on this machine may make theirs:
        # a segment's name carries its maker's pid)
        new = shm_segments() - before
        assert not [n for n in new if f"-p{proc.pid}-" in n or f"-{proc.pid}-" in n], new
        st = cons.client.status("ec")
        assert st["consumer"]["pinned"] == 0
        # every block, including those of the output it was copying, can be reused
        for p in outs[4:]:
            ev = fetch(cons.client, p)
            assert cons.matches(ev.block_ids, output_bytes(image_of(p), p.nbytes))
        st = cons.client.status("ec")
        assert "img-1" not in st["cached"] and st["consumer"]["pinned"] == 0
    finally:
        prod.close()
        cons.close()


def test_consumer_daemon_restart_clients_fall_back_and_remap(daemons: StartDaemon) -> None:
    e = daemons("kvd-enc", ec_cfg("producer", 64 * MiB))
    c = daemons("kvd-con", ec_cfg("consumer", 16 * MiB))
    prod, cons = ECSide(e.socket, "encoder"), ECSide(c.socket, "consumer")
    client = KvdClient(c.socket, engine_id="fast")
    client.connect()
    restarted = None
    try:
        a = commit(prod, 1, 3 * MiB)
        fetch(client, a)
        assert served_right(client, a)
        old_index = client.status("ec")["index"]
        c.kill()  # SIGKILL: the index is neither closed nor removed by its daemon
        # until the client notices, a copy from the dead daemon's mapping is still exact
        # (nothing writes there any more); once it notices, it serves nothing
        deadline = time.monotonic() + 10
        while client.reconnects == 0 and not client._lost.is_set():
            served_right(client, a)
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not served_right(client, a)
        restarted = start_daemon(c.config.parent, "kvd-con", ec_cfg("consumer", 16 * MiB))
        assert old_index not in shm_segments()  # the new daemon removed the stale one
        while client.reconnects == 0:
            client.wait_events(0.1)
            assert not served_right(client, a) or client.reconnects
            assert time.monotonic() < deadline + 10
        # the new daemon's index is empty: not served, the IPC path fetches it again
        assert not served_right(client, a)
        ev = fetch(client, a)
        assert not ev.local_hit
        assert served_right(client, a)
        assert client.status("ec")["index"] != old_index
    finally:
        client.close()
        prod.close()
        cons.close()
        if restarted is not None:
            assert restarted.stop() == 0
