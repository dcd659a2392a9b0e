"""Push and pull end to end: real daemons, real NIXL, real shared memory, every byte checked."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time

import pytest
from kvd_client import wire

from kvd.demo import make_engine, run_mode

from .conftest import StartDaemon


@pytest.mark.parametrize("mode", ["push", "pull"])
def test_200_requests_random_order_every_byte(daemons: StartDaemon, mode: str) -> None:
    p_d = daemons("kvd-p")
    d_d = daemons("kvd-d")
    p = make_engine(p_d.socket, "prefill", num_blocks=512, num_layers=4, chunk_bytes=8192)
    d = make_engine(d_d.socket, "decode", num_blocks=512, num_layers=4, chunk_bytes=8192)
    try:
        res = run_mode(mode, p, d, p_d.side_port, 200, random.Random(7), max_blocks=20, window=24)
        assert res.failures == []
        assert (res.verified, res.mismatched, res.failed, res.expired) == (200, 0, 0, 0)
        # exactly one terminal event per request on each side
        assert res.p_events == {"SendFinished": 200}
        assert res.d_events == {"RecvFinished": 200}
        ps, ds = p.client.status(), d.client.status()
        pl, dl = p.client.status("leases"), d.client.status("leases")
        dt = d.client.status("transfers")
    finally:
        p.close()
        d.close()
    # nothing left behind
    assert pl["leases"] == [] and dl["tracked"] == []
    assert ps["sender"]["leases"] == 0 and ps["sender"]["writing"] == 0
    assert ds["receiver"]["receiving"] == 0 and dt["receiving"] == [] and dt["in_flight"] == []
    assert ps["sender"]["held"] == 0 and ps["sender"]["pending_registrations"] == 0
    # the counters agree with what the engines saw
    pc, dc = ps["counters"], ds["counters"]
    assert pc["leases_granted"] == 200
    assert pc.get("leases_expired", 0) == 0
    assert dc["recv_ok"] == 200 and dc.get("recv_failed", 0) == 0
    if mode == "push":
        assert pc["sends_ok"] == 200 and pc["push_registrations"] == 200
        assert pc["transfers_ok"] == 200
        assert pc["descriptors"] >= 200
    else:
        assert pc["pulls_acked"] == 200
        assert dc["transfers_ok"] == 200 and dc["descriptors"] >= 200
    assert pc.get("notifs_rejected", 0) == 0 and dc.get("notifs_rejected", 0) == 0


def test_coalescing_contiguous_blocks_one_descriptor(daemons: StartDaemon) -> None:
    """A contiguous run of block-major blocks moves as one descriptor (not one per chunk)."""
    p_d = daemons("kvd-p")
    d_d = daemons("kvd-d")
    p = make_engine(p_d.socket, "prefill", num_blocks=64, num_layers=4, chunk_bytes=4096)
    d = make_engine(d_d.socket, "decode", num_blocks=64, num_layers=4, chunk_bytes=4096)
    try:
        for b in range(10, 26):
            p.block(0, b)[:] = b
        d.client.register_push("req-1-aaaaaaaa", list(range(30, 46)), "127.0.0.1", p_d.side_port)
        p.client.finished("req-1-bbbbbbbb", list(range(10, 26)))
        evs = d.client.wait_events(10)
        assert [type(e).__name__ for e in evs] == ["RecvFinished"]
        for i, b in enumerate(range(30, 46)):
            assert (d.block(0, b) == 10 + i).all()
        # P books its transfer when its WRITE's outcome reaches its sender, which can be
        # after D's client has the event
        deadline = time.monotonic() + 10
        while not (recent := p.client.status("transfers")["recent"]):
            assert time.monotonic() < deadline, "P never recorded the transfer"
            time.sleep(0.02)
        assert len(recent) == 1
        assert recent[-1]["descriptors"] == 1
        assert recent[-1]["bytes"] == 16 * 4 * 2 * 4096
    finally:
        p.close()
        d.close()


def test_demo_command_json() -> None:
    res = subprocess.run(
        [sys.executable, "-m", "kvd", "demo", "--requests", "30", "--json"],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout)
    assert out["ok"] is True
    for mode in ("push", "pull", "tiers"):
        m = out["modes"][mode]
        assert (m["requests"], m["verified"], m["mismatched"], m["failed"]) == (30, 30, 0, 0)
    assert out["modes"]["tiers"]["hit_rate"] == 1.0


def test_full_local_hit_pull_frees_p_at_once(daemons: StartDaemon) -> None:
    """D needs none of P's blocks: an empty pull still ends both sides, and P frees at once."""
    p_d = daemons("kvd-p")
    d_d = daemons("kvd-d")
    p = make_engine(p_d.socket, "prefill", num_blocks=16, num_layers=2, chunk_bytes=4096)
    d = make_engine(d_d.socket, "decode", num_blocks=16, num_layers=2, chunk_bytes=4096)
    try:
        p.client.finished("hit-1-aaaaaaaa", [1, 2, 3])
        d.client.pull(
            "hit-1-bbbbbbbb",
            [],
            "127.0.0.1",
            p_d.side_port,
            remote_request_id="hit-1-aaaaaaaa",
            remote_block_ids=[1, 2, 3],
        )
        assert [type(e).__name__ for e in d.client.wait_events(10)] == ["RecvFinished"]
        assert [type(e).__name__ for e in p.client.wait_events(10)] == ["SendFinished"]
        assert p.client.status("leases")["leases"] == []
        assert d.client.status()["counters"].get("descriptors", 0) == 0
    finally:
        p.close()
        d.close()


def test_p_abort_fails_d_push_registration_at_once(daemons: StartDaemon) -> None:
    """P gives up: D's registration, waiting or late, fails now (not at its watchdog)."""
    p_d = daemons("kvd-p")
    d_d = daemons("kvd-d")
    p = make_engine(p_d.socket, "prefill", num_blocks=16, num_layers=2, chunk_bytes=4096)
    d = make_engine(d_d.socket, "decode", num_blocks=16, num_layers=2, chunk_bytes=4096)
    try:
        # 1. D registered first; P never finishes and aborts
        d.client.register_push("ab-1-aaaaaaaa", [1, 2], "127.0.0.1", p_d.side_port)
        deadline = time.monotonic() + 10
        while p.client.status()["sender"]["pending_registrations"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        p.client.abort("ab-1-bbbbbbbb", side="send")  # P never finished it: say which side
        (ev,) = d.client.wait_events(5)
        assert (
            isinstance(ev, wire.RecvFailed) and "P aborted" in ev.reason and ev.block_ids == (1, 2)
        )
        # 2. P finished, then aborted (lease released); D registers late
        p.client.finished("ab-2-bbbbbbbb", [3])
        p.client.abort("ab-2-bbbbbbbb")
        (pev,) = p.client.wait_events(5)
        assert isinstance(pev, wire.SendFailed)
        d.client.register_push("ab-2-aaaaaaaa", [4], "127.0.0.1", p_d.side_port)
        (ev,) = d.client.wait_events(5)
        assert isinstance(ev, wire.RecvFailed) and "P aborted" in ev.reason
        st = p.client.status()
        assert st["sender"]["pending_registrations"] == 0 and st["sender"]["leases"] == 0
        assert st["counters"]["registrations_failed_p_abort"] == 1
        assert st["counters"]["late_registrations"] == 1
    finally:
        p.close()
        d.close()
