"""Region drops never hold up a daemon's registrar: real daemons, real NIXL.

A region goes (its session ended, or its client deregistered it) only after every peer
was told and replied, and the transfers touching it drained. Those waits are bounded by
`side_channel.handshake_timeout`, and used to be waited on the registrar's own loop: a
frozen peer held up every registration and handshake of the daemon for that long per
region, and two daemons dropping regions at once (an engine pair exiting together) each
waited out the other's reply, since a daemon answers a drop notice only once its
registrar has taken it in.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from typing import Any

from kvd_client import wire
from kvd_client.client import KvdClient

from kvd.demo import DEMO_COMPAT, DaemonProc, Engine, make_engine

from .conftest import StartDaemon, wait_until

HOST = "127.0.0.1"
TIMEOUT = 4.0
"""side_channel.handshake_timeout of both daemons: what a drop waited on a silent peer."""


def engine(d: DaemonProc, name: str, tp: int = 1) -> Engine:
    return make_engine(d.socket, name, num_blocks=16, num_layers=2, chunk_bytes=4096, tp=tp)


def dropped(e: Engine) -> int:
    return int(e.client.status()["counters"].get("regions_dropped", 0))


def pair(
    daemons: StartDaemon, engines: list[Engine], timeout: float = TIMEOUT
) -> tuple[DaemonProc, DaemonProc]:
    """P and D daemons that know each other (one push went from P to D)."""
    cfg: dict[str, Any] = {"side_channel": {"handshake_timeout": timeout}}
    pd, dd = daemons("kvd-p", overrides=cfg), daemons("kvd-d", overrides=cfg)
    p, d = engine(pd, "prefill"), engine(dd, "decode")
    engines += [p, d]
    p.client.finished("cmpl-warm-0-aaaaaaaa", [1])
    d.client.track("cmpl-warm-0-dddddddd", HOST, pd.side_port)
    d.client.register_push(
        "cmpl-warm-0-dddddddd", [2], HOST, pd.side_port, remote_request_id="cmpl-warm-0-aaaaaaaa"
    )

    def finished() -> bool:
        return any(isinstance(ev, wire.RecvFinished) for ev in d.client.drain_events())

    wait_until(finished, 10.0, "the warm-up push")
    for e in (p, d):
        wait_until(lambda e=e: e.client.status()["registrar"]["peers"] >= 1, 5.0, "peers")
    return pd, dd


def test_a_frozen_peer_does_not_hold_up_registrations_while_a_region_drops(
    daemons: StartDaemon, engines: list[Engine]
) -> None:
    """D's daemon is frozen: P's drop of an exiting engine's region waits for D's reply
    (until `handshake_timeout`), but another engine registers on P meanwhile at once, and
    P shows the region as dropping (`kvd status` too); it goes once D answers."""
    pd, dd = pair(daemons, engines, timeout=3 * TIMEOUT)  # (room for the CLI's start)
    p = engines[0]
    doomed = engine(pd, "doomed")
    before = dropped(p)
    dd.proc.send_signal(signal.SIGSTOP)
    try:
        doomed.close()  # its session ends: its region is dropped, D told first
        wait_until(lambda: p.client.status()["registrar"]["dropping"], 2.0, "the drop")
        t0 = time.monotonic()
        newcomer = engine(pd, "newcomer")  # registers its region and waits for the answer
        took = time.monotonic() - t0
        engines.append(newcomer)
        assert took < TIMEOUT / 2, took  # it waited for no peer
        regions = p.client.status()["regions"]
        assert {r["engine_id"] for r in regions} == {"prefill", "newcomer"}
        assert dropped(p) == before  # D has not answered: not deregistered yet
        (rid,) = p.client.status()["registrar"]["dropping"]
        cli = [sys.executable, "-m", "kvd", "status", "-s", pd.socket]
        text = subprocess.run(cli, capture_output=True, text=True, timeout=60).stdout
        assert f"regions being dropped (peers told, transfers draining): {rid}" in text
        assert dropped(p) == before
    finally:
        dd.proc.send_signal(signal.SIGCONT)
    wait_until(lambda: dropped(p) == before + 1, 5.0, "the region dropped")
    assert p.client.status()["registrar"]["dropping"] == []


def test_two_daemons_dropping_regions_at_once_do_not_wait_for_each_other(
    daemons: StartDaemon, engines: list[Engine]
) -> None:
    """An engine pair (TP 4 on each side) exits together: each daemon tells the other of
    its drops while the other is dropping too. Each answers the other's notices at once,
    so all eight drops end in a moment, not after `handshake_timeout` (each, in turn)."""
    pd, dd = pair(daemons, engines)
    p, d = engines
    pv, dv = engine(pd, "victim-p", tp=4), engine(dd, "victim-d", tp=4)  # 4 regions each
    before = (dropped(p), dropped(d))
    go = threading.Barrier(2)

    def close(e: Engine) -> None:
        go.wait()
        e.close()

    threads = [threading.Thread(target=close, args=(e,)) for e in (pv, dv)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wait_until(
        lambda: (dropped(p), dropped(d)) == (before[0] + 4, before[1] + 4),
        TIMEOUT + 5.0,
        "both regions dropped",
    )
    took = time.monotonic() - t0
    assert took < TIMEOUT / 2, took


def test_the_same_segment_registered_again_waits_for_its_old_regions_drop(
    daemons: StartDaemon, engines: list[Engine]
) -> None:
    """A client's session ends while a peer is frozen; the segment it registered is
    registered again at once by a new session (a client that lost its session and came
    back). The same memory is never registered twice at once: the new registration
    waits for the old region's drop, which waits for the frozen peer (or the timeout),
    then succeeds; the region is then live under its new id. Meanwhile the registrar
    serves others: another engine registers at once."""
    pd, dd = pair(daemons, engines)
    p = engines[0]
    src = engine(pd, "reused")  # owns the segment; its regions go with its session
    seg, lay = src.regions[0], src.layout
    before = dropped(p)
    again = KvdClient(pd.socket, role="scheduler", engine_id="reused")
    took: list[float] = []

    def register_again() -> None:
        t0 = time.monotonic()
        again.register_region(seg, layout=lay, tp_rank=0, tp_size=1, compat=DEMO_COMPAT)
        took.append(time.monotonic() - t0)

    taker = threading.Thread(target=register_again)
    dd.proc.send_signal(signal.SIGSTOP)
    try:
        src.client.close()  # the session ends; the segment stays (its owner lives on)
        wait_until(lambda: p.client.status()["registrar"]["dropping"], 2.0, "the drop")
        again.connect()
        taker.start()
        time.sleep(0.3)  # its registration waits behind the drop
        assert took == []
        t0 = time.monotonic()
        engines.append(engine(pd, "bystander"))
        assert time.monotonic() - t0 < TIMEOUT / 2
        assert took == [] and dropped(p) == before
        dd.proc.send_signal(signal.SIGCONT)  # D answers: the drop ends, then the registration
        taker.join(TIMEOUT + 5.0)
        assert len(took) == 1 and took[0] > 0.3, took
        assert dropped(p) == before + 1
        regions = p.client.status()["regions"]
        assert [r["name"] for r in regions if r["engine_id"] == "reused"] == [seg.name]
    finally:
        dd.proc.send_signal(signal.SIGCONT)
        taker.join(TIMEOUT + 5.0)
        again.close()
        seg.close()
