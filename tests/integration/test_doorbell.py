"""Doorbells between real daemons (`nixl.doorbell`): idle daemons whose NIXL threads
poll rarely ring each other after their notifications, every byte still arrives, junk
datagrams at a doorbell change nothing, and a daemon without one is never rung."""

from __future__ import annotations

import os
import socket
import time
from typing import Any

from kvd.demo import Engine, make_engine

from .conftest import StartDaemon

RARE_POLLS: dict[str, Any] = {"poll_max_idle_us": 100_000, "poll_deep_idle_us": 1_000_000}
"""An idle NIXL thread backs off to polls 100 ms apart (1 s with nothing at all going on):
without a doorbell, each notification to an idle daemon would wait for that poll."""


def _one(p: Engine, d: Engine, side_port: int, mode: str, i: int) -> None:
    pb, db = [2 * i, 2 * i + 1], [100 + 2 * i, 101 + 2 * i]
    for n, b in enumerate(pb):
        p.block(0, b)[:] = (i * 7 + n) % 251
    pid, did = f"bell-{mode}-{i}-pppppppp", f"bell-{mode}-{i}-dddddddd"
    if mode == "push":
        d.client.register_push(did, db, "127.0.0.1", side_port, remote_request_id=pid)
        time.sleep(0.3)  # D's thread backs off before P's WRITE (and its notification)
        p.client.finished(pid, pb)
    else:
        p.client.finished(pid, pb)
        deadline = time.monotonic() + 10
        while not p.client.status("leases")["leases"]:
            assert time.monotonic() < deadline, "P never granted the lease"
            time.sleep(0.01)
        d.client.pull(did, db, "127.0.0.1", side_port, remote_request_id=pid, remote_block_ids=pb)
    evs = d.client.wait_events(10)
    assert [type(e).__name__ for e in evs] == ["RecvFinished"], evs
    for n, b in enumerate(db):
        assert (d.block(0, b) == (i * 7 + n) % 251).all()
    assert [type(e).__name__ for e in p.client.wait_events(10)] == ["SendFinished"]


def test_idle_daemons_ring_each_other_and_every_byte_arrives(daemons: StartDaemon) -> None:
    p_d = daemons("kvd-bell-p", overrides={"nixl": RARE_POLLS})
    d_d = daemons("kvd-bell-d", overrides={"nixl": RARE_POLLS})
    p = make_engine(p_d.socket, "prefill", num_blocks=64, num_layers=2, chunk_bytes=4096)
    d = make_engine(d_d.socket, "decode", num_blocks=256, num_layers=2, chunk_bytes=4096)
    junk = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        for i in range(200):  # junk at both doorbells first: dropped unread
            for port in (p_d.side_port, d_d.side_port):
                junk.sendto(os.urandom(i * 7 % 1400), ("127.0.0.1", port))
        for i in range(6):
            time.sleep(0.3)  # both threads back off (their waits grow to 100 ms)
            _one(p, d, p_d.side_port, "push" if i % 2 == 0 else "pull", i)
        ps, ds = p.client.status(), d.client.status()
    finally:
        junk.close()
        p.close()
        d.close()
    pn, dn = ps["nixl"], ds["nixl"]
    assert pn["doorbell_port"] == p_d.side_port and dn["doorbell_port"] == d_d.side_port
    assert pn["doorbell_peers"] == 1 and dn["doorbell_peers"] == 1
    # D rang P after its registrations and PullDones, P rang D after its WRITEs (their
    # notifications, 0.3 s after D registered): each woke the other's backed-off thread.
    # P's PullAcks follow D's PullDones at once: D polls hot then, and is not rung.
    assert dn["doorbell_rung"] >= 4 and pn["doorbell_wakes"] >= 4
    assert pn["doorbell_rung"] >= 2 and dn["doorbell_wakes"] >= 2
    assert pn["doorbell_skipped"] >= 2
    # (the kernel drops what overflows a socket buffer: most of the junk is drained here)
    assert pn["doorbell_drained"] >= 50 and dn["doorbell_drained"] >= 50
    assert ps["counters"].get("notifs_rejected", 0) == 0
    assert ds["counters"].get("notifs_rejected", 0) == 0


def test_a_daemon_without_a_doorbell_is_never_rung(daemons: StartDaemon) -> None:
    p_d = daemons("kvd-nobell-p", overrides={"nixl": {**RARE_POLLS, "doorbell": False}})
    d_d = daemons("kvd-nobell-d", overrides={"nixl": RARE_POLLS})
    p = make_engine(p_d.socket, "prefill", num_blocks=64, num_layers=2, chunk_bytes=4096)
    d = make_engine(d_d.socket, "decode", num_blocks=256, num_layers=2, chunk_bytes=4096)
    try:
        for i in range(4):
            time.sleep(0.2)
            _one(p, d, p_d.side_port, "push" if i % 2 == 0 else "pull", i)
        ps, ds = p.client.status(), d.client.status()
    finally:
        p.close()
        d.close()
    assert ps["nixl"]["doorbell_port"] == 0  # none bound: it rings nobody either
    assert ps["nixl"].get("doorbell_rung", 0) == 0
    assert ds["nixl"]["doorbell_peers"] == 0  # P said it has none
    assert ds["nixl"]["doorbell_rung"] == 0
