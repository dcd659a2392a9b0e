"""Bidirectional KV (multi-turn): D keeps a finished request's blocks for the next turn,
whose P pulls them from D's daemon instead of recomputing. Real daemons, real NIXL, real
shared memory; every byte checked.

D's `keep` is a fixed lease on D's daemon (`transfer.decoder_kv_blocks_ttl`, heartbeats do
not extend it); P's pull is the ordinary pull run the other way (P's daemon READs D's
blocks, then asks D's daemon whether it still held them: fail closed). Each kept request
ends exactly once on D: SendFinished (pulled), SendExpired, or SendFailed (session gone).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from kvd_client import wire
from kvd_client.client import Event, KvdClient
from kvd_client.errors import ErrorCode

from kvd.demo import DaemonProc, Engine, make_engine

from .conftest import StartDaemon

HOST = "127.0.0.1"


def engine(d: DaemonProc, name: str, *, workers: bool = False) -> Engine:
    return make_engine(
        d.socket, name, num_blocks=32, num_layers=2, chunk_bytes=4096, workers=workers
    )


def wait_until(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def events(client: KvdClient, n: int, timeout: float = 10.0) -> list[Event]:
    """At least `n` events (fails after `timeout`), then whatever else came within 0.3 s:
    so a second terminal event for the same request would show."""
    got: list[Event] = []
    deadline = time.monotonic() + timeout
    while len(got) < n:
        left = deadline - time.monotonic()
        assert left > 0, f"expected {n} events, got {got}"
        got += client.wait_events(left)
    got += client.wait_events(0.3)
    return got


def fill(eng: Engine, blocks: list[int], rng: np.random.Generator) -> None:
    for b in blocks:
        eng.block(0, b)[:] = rng.integers(0, 256, eng.block_bytes, dtype=np.uint8)


def same(a: Engine, a_blocks: list[int], b: Engine, b_blocks: list[int]) -> bool:
    pairs = zip(a_blocks, b_blocks, strict=True)
    return all(np.array_equal(a.block(0, x), b.block(0, y)) for x, y in pairs)


def counters(eng: Engine) -> dict[str, int]:
    return dict(eng.client.status()["counters"])


def kept_leases(eng: Engine) -> list[dict[str, Any]]:
    return list(eng.client.status("leases")["leases"])


@pytest.mark.parametrize("pull_by", ["read", "write"])
@pytest.mark.parametrize("turn1", ["pull", "push"])
def test_next_turn_p_pulls_the_blocks_d_kept(
    daemons: StartDaemon, turn1: str, pull_by: str
) -> None:
    """Turn 1 moves P's prefill to D (push or pull); D decodes into its blocks and keeps
    them; turn 2's P pulls D's blocks (not its own old ones: P reused those) and gets
    every byte D had. D's kept request ends once, SendFinished, and nothing stays leased.
    Pulls READ, or go by the source daemon's WRITE (`transfer.pull_by`, as between hosts
    where UCX would emulate the READ): kept blocks are pulled either way."""
    over = {"transfer": {"pull_by": pull_by}}
    p_d, d_d = daemons("kvd-p", overrides=over), daemons("kvd-d", overrides=over)
    p, d = engine(p_d, "prefill"), engine(d_d, "decode")
    rng = np.random.default_rng(1)
    try:
        assert d.client.welcome is not None and d.client.welcome.decoder_kv_blocks_ttl == 480.0
        # ---- turn 1: P's prefill of 3 blocks goes to D
        p1, d1 = "turn1-aaaaaaaa", "turn1-bbbbbbbb"
        p_blocks, d_blocks = [3, 4, 5], [10, 11, 12]
        fill(p, p_blocks, rng)
        if turn1 == "pull":
            p.client.finished(p1, p_blocks)
            d.client.pull(
                d1,
                d_blocks,
                HOST,
                p_d.side_port,
                remote_request_id=p1,
                remote_block_ids=p_blocks,
            )
        else:
            d.client.register_push(d1, d_blocks, HOST, p_d.side_port, remote_request_id=p1)
            p.client.finished(p1, p_blocks)
        assert [type(e) for e in events(d.client, 1)] == [wire.RecvFinished]
        assert [type(e) for e in events(p.client, 1)] == [wire.SendFinished]
        assert same(p, p_blocks, d, d_blocks)
        # ---- D decodes: its last block changes and a fourth one fills; then it keeps them
        d_kept = [*d_blocks, 13]
        fill(d, d_kept[2:], rng)
        t0 = time.time()
        expiry = d.client.keep(d1, d_kept)
        assert t0 + 480.0 <= expiry <= time.time() + 480.0
        (lease,) = wait_until(lambda: kept_leases(d), 5.0, "the kept lease")
        assert lease["request_id"] == d1 and lease["kept"] is True
        assert 470.0 < lease["expires_in_s"] <= 480.0
        # ---- P reused its blocks meanwhile; turn 2 pulls D's kept ones into others
        fill(p, p_blocks, rng)
        p2, p2_blocks = "turn2-cccccccc", [20, 21, 22, 23]
        d_welcome = d.client.welcome
        p.client.pull(
            p2,
            p2_blocks,
            HOST,
            d_d.side_port,
            remote_engine_id="decode",
            remote_request_id=d1,
            remote_block_ids=d_kept,
            remote_incarnation=d_welcome.incarnation,
            remote_session=d.client.session,
        )
        assert [type(e) for e in events(p.client, 1)] == [wire.RecvFinished]
        assert same(d, d_kept, p, p2_blocks)
        assert not same(d, d_kept[:3], p, p_blocks)  # P's own old blocks were not the source
        got = events(d.client, 1)
        assert [(type(e), e.request_id) for e in got] == [(wire.SendFinished, d1)]
        assert kept_leases(d) == []
        c = counters(d)
        acked, written = (1, 0) if pull_by == "read" else (0, 1)
        assert (c["kv_kept"], c["kept_pulled"]) == (1, 1), c
        assert (c.get("pulls_acked", 0), c.get("pulls_written", 0)) == (acked, written), c
        assert c.get("kept_expired", 0) == 0
    finally:
        p.close()
        d.close()


def test_kept_blocks_expire_at_their_ttl_despite_heartbeats(daemons: StartDaemon) -> None:
    """The TTL is fixed: P's heartbeats (it tracks the request) do not extend it. At expiry
    D's engine gets SendExpired once; P's pull after that fails closed (LEASE_EXPIRED,
    its blocks to recompute), and D hears nothing more."""
    over = {"transfer": {"decoder_kv_blocks_ttl": 1.5, "kv_lease_duration": 0.6}}
    p_d, d_d = daemons("kvd-p", overrides=over), daemons("kvd-d", overrides=over)
    p, d = engine(p_d, "prefill"), engine(d_d, "decode")
    rng = np.random.default_rng(2)
    try:
        assert d.client.welcome is not None and d.client.welcome.decoder_kv_blocks_ttl == 1.5
        kept_id, blocks = "ttl-dddddddd", [1, 2]
        fill(d, blocks, rng)
        t0 = time.monotonic()
        expiry = d.client.keep(kept_id, blocks)  # the daemon's TTL
        assert expiry - time.time() <= 1.5
        # P's next turn is queued: its daemon heartbeats D for the kept request
        p_id = "ttl-eeeeeeee"
        p.client.track(p_id, HOST, d_d.side_port, remote_request_id=kept_id)
        # heartbeats extend a 0.6 s lease by 0.4 s each: had they counted, it would live on
        # as long as P tracks it (here: past this wait)
        got = events(d.client, 1, timeout=8.0)
        took = time.monotonic() - t0
        assert [(type(e), e.request_id) for e in got] == [(wire.SendExpired, kept_id)]
        assert 1.5 <= took < 8.0, took
        c = counters(d)
        assert c["heartbeats_on_kept"] > 0 and c["kept_expired"] == 1, c
        assert kept_leases(d) == []
        p.client.pull(
            p_id,
            [5, 6],
            HOST,
            d_d.side_port,
            remote_engine_id="decode",
            remote_request_id=kept_id,
            remote_block_ids=blocks,
        )
        (failed,) = events(p.client, 1)
        assert isinstance(failed, wire.RecvFailed), failed
        assert (failed.code, failed.block_ids) == (int(ErrorCode.LEASE_EXPIRED), (5, 6)), failed
        assert d.client.wait_events(0.5) == []  # D's request ended once, at its expiry
        assert counters(d).get("kept_pulled", 0) == 0
    finally:
        p.close()
        d.close()


def test_kept_blocks_freed_when_d_engine_session_ends(daemons: StartDaemon) -> None:
    """D's scheduler session closes (its workers' regions stay): the kept lease ends at
    once, and the next turn's pull fails closed instead of reading blocks nobody holds."""
    p_d, d_d = daemons("kvd-p"), daemons("kvd-d")
    p = engine(p_d, "prefill")
    d = engine(d_d, "decode", workers=True)
    rng = np.random.default_rng(3)
    closed = False
    try:
        kept_id, blocks = "gone-ffffffff", [7, 8, 9]
        fill(d, blocks, rng)
        assert d.client.keep(kept_id, blocks, ttl=300.0) > time.time() + 290
        wait_until(lambda: kept_leases(d), 5.0, "the kept lease")
        session = d.client.session
        d.client.close()
        closed = True
        cli = KvdClient(d_d.socket, role="cli")
        cli.connect()
        try:
            wait_until(lambda: cli.status("leases")["leases"] == [], 5.0, "lease freed")
            assert cli.status()["counters"].get("kept_pulled", 0) == 0
        finally:
            cli.close()
        p.client.pull(
            "gone-gggggggg",
            [1, 2, 3],
            HOST,
            d_d.side_port,
            remote_engine_id="decode",
            remote_request_id=kept_id,
            remote_block_ids=blocks,
            remote_session=session,
        )
        (failed,) = events(p.client, 1)
        assert isinstance(failed, wire.RecvFailed), failed
        assert failed.block_ids == (1, 2, 3)
    finally:
        p.close()
        if closed:
            for w in d.workers:
                w.close()
            for r in d.regions:
                r.close()
        else:
            d.close()


_DOOMED = """
import sys, time
import numpy as np
from kvd.demo import make_engine
d = make_engine(sys.argv[1], "decode", num_blocks=8, num_layers=2, chunk_bytes=4096)
d.block(0, 1)[:] = 7
d.client.keep("doomed-hhhhhhhh", [1, 2], ttl=300.0)
d.client.status()  # the keep reached the daemon before this answer
print(d.regions[0].name, flush=True)
time.sleep(120)
"""


def test_kept_blocks_freed_when_d_engine_is_killed(daemons: StartDaemon) -> None:
    """D's engine process dies (SIGKILL, no goodbye): its session times out and the kept
    lease ends with it; nothing stays held for a party that is gone."""
    d_d = daemons("kvd-d", overrides={"daemon": {"client_timeout": 1.0}})
    cli = KvdClient(d_d.socket, role="cli", keepalive_interval=0.2)
    cli.connect()
    proc = subprocess.Popen(
        [sys.executable, "-c", _DOOMED, d_d.socket], stdout=subprocess.PIPE, text=True
    )
    name = ""
    try:
        assert proc.stdout is not None
        name = proc.stdout.readline().strip()
        assert name, "the engine did not start"
        (lease,) = cli.status("leases")["leases"]
        assert lease["request_id"] == "doomed-hhhhhhhh" and lease["kept"] is True
        proc.kill()
        proc.wait()
        t_kill = time.monotonic()
        wait_until(lambda: cli.status("leases")["leases"] == [], 5.0, "kept lease freed")
        assert time.monotonic() - t_kill < 5.0
        c = cli.status()["counters"]
        assert c["kv_kept"] == 1 and c.get("kept_pulled", 0) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        cli.close()
        if name:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"/dev/shm/{name}")
