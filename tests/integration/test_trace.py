"""`kvd trace`: one real push and one real pull between two real daemons, traced on both.

The daemons keep every request's stages (always on); `kvd trace ID --peer` on D asks P
over the side channel and places P's stages on D's clock with the offset measured in
that exchange. Both daemons run on one host, so the true offset is 0: the estimate must
say so within its own bound, and every stage one daemon caused on the other must come
after its cause within that bound.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import zmq
from kvd_client import wire
from kvd_client.errors import ErrorCode

from kvd.core.timeline import make_query
from kvd.demo import DaemonProc, make_engine

from .conftest import StartDaemon


def _kvd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvd", *args], capture_output=True, text=True, timeout=60
    )


def _trace(d: DaemonProc, rid: str, *more: str) -> tuple[int, dict[str, Any]]:
    res = _kvd("trace", rid, "--socket", d.socket, "--json", *more)
    assert res.returncode in (0, 1), res.stderr[-2000:]
    return res.returncode, json.loads(res.stdout)


def _at(view: dict[str, Any], daemon: str, stage: str, rid: str, last: bool = False) -> int:
    """The time (D's clock) at which `daemon` recorded `stage` for `rid`."""
    ts = [
        r["t_ns"]
        for r in view["timeline"]
        if (r["daemon"], r["stage"], r["request_id"]) == (daemon, stage, rid)
    ]
    seen = [(r["daemon"], r["stage"]) for r in view["timeline"]]
    assert ts, f"{daemon} {stage} {rid} not in {seen}"
    return ts[-1] if last else ts[0]


def _events(client: Any, want: int) -> list[str]:
    got: list[str] = []
    deadline = time.monotonic() + 15
    while len(got) < want and time.monotonic() < deadline:
        got += [type(e).__name__ for e in client.wait_events(0.5)]
    return got


def test_trace_shows_both_daemons_stages_of_a_push_and_a_pull(daemons: StartDaemon) -> None:
    p_d = daemons("kvd-p")
    d_d = daemons("kvd-d")
    p = make_engine(p_d.socket, "prefill", num_blocks=64, num_layers=2, chunk_bytes=4096)
    d = make_engine(d_d.socket, "decode", num_blocks=64, num_layers=2, chunk_bytes=4096)
    push_d, push_p = "tr-push-1-aaaaaaaa", "tr-push-1-bbbbbbbb"
    pull_d, pull_p = "tr-pull-2-cccccccc", "tr-pull-2-dddddddd"
    try:
        for b in range(4):
            p.block(0, b)[:] = 7 + b
        d.client.register_push(push_d, [10, 11], "127.0.0.1", p_d.side_port)
        p.client.finished(push_p, [0, 1])
        assert _events(d.client, 1) == ["RecvFinished"]
        assert _events(p.client, 1) == ["SendFinished"]
        p.client.finished(pull_p, [2, 3])
        d.client.pull(
            pull_d,
            [20, 21],
            "127.0.0.1",
            p_d.side_port,
            remote_request_id=pull_p,
            remote_block_ids=[2, 3],
        )
        assert _events(d.client, 1) == ["RecvFinished"]
        assert _events(p.client, 1) == ["SendFinished"]
        assert (d.block(0, 11) == 8).all() and (d.block(0, 21) == 10).all()
    finally:
        p.close()
        d.close()

    # push: D's registration reached P, P's WRITE was posted before D saw it done
    code, push = _trace(d_d, push_d, "--peer")
    assert code == 0, push
    assert push["found"] and push["peer"]["found"] and not push["peer"]["error"]
    assert push["peer"]["agent"] == "kvd-p" and push_p in push["peer"]["ids"]
    clock = push["clock"]
    err = clock["error_ns"]
    assert 0 <= err < 1_000_000_000
    assert abs(clock["offset_ns"]) <= err  # one host: the true offset is 0
    sides = {(r["daemon"], r["side"]) for r in push["timeline"]}
    assert sides == {("kvd-d", "local"), ("kvd-p", "peer")}
    assert [r["t_ns"] for r in push["timeline"]] == sorted(r["t_ns"] for r in push["timeline"])
    assert push["timeline"][0]["delta_us"] == 0.0
    assert _at(push, "kvd-d", "receiver.notif_handed", push_d) - err <= _at(
        push, "kvd-p", "nixl.notif_polled", push_d
    )
    assert _at(push, "kvd-p", "nixl.posted", push_p) - err <= _at(
        push, "kvd-d", "receiver.notif_fed", push_d
    )
    assert _at(push, "kvd-p", "nixl.posted", push_p) - err <= _at(
        push, "kvd-d", "gateway.event", push_d, last=True
    )
    # the same request asked by P's id on P: P's stages only, without --peer
    code, on_p = _trace(p_d, push_p)
    assert code == 0 and on_p["peer"] is None and on_p["clock"] is None
    assert {r["daemon"] for r in on_p["timeline"]} == {"kvd-p"}
    assert "sender.claimed" in {r["stage"] for r in on_p["timeline"]}

    # pull: D's READ returned before P heard PullDone; P's ack went out before D's done
    code, pull = _trace(d_d, pull_d, "--peer")
    assert code == 0, pull
    err = pull["clock"]["error_ns"]
    assert abs(pull["clock"]["offset_ns"]) <= err
    assert _at(pull, "kvd-d", "transfer.returned", pull_d) - err <= _at(
        pull, "kvd-p", "nixl.notif_polled", pull_p
    )
    assert _at(pull, "kvd-p", "sender.notif_handed", pull_d) - err <= _at(
        pull, "kvd-d", "receiver.notif_fed", pull_d
    )
    assert _at(pull, "kvd-d", "nixl.posted", pull_d) < _at(pull, "kvd-d", "nixl.done", pull_d)

    # the table: both daemons, each stage, the offset's uncertainty
    res = _kvd("trace", push_d, "--peer", "--socket", d_d.socket)
    assert res.returncode == 0, res.stderr
    text = " ".join(res.stdout.split())
    for word in ("kvd-d (local)", "kvd-p (peer)", "nixl.posted", "gateway.event", "±"):
        assert word in text, res.stdout

    # an unknown id says so, in both forms, and fails
    code, none = _trace(d_d, "no-such-request", "--peer")
    assert code == 1 and not none["found"] and none["timeline"] == []
    assert "not in this daemon's trace" in none["peer"]["error"]
    res = _kvd("trace", "no-such-request", "--socket", d_d.socket)
    assert res.returncode == 1
    assert "'no-such-request' is not in the trace of kvd-d" in " ".join(res.stdout.split())

    # the clock offset measured at handshake shows in `kvd peers`
    res = _kvd("peers", "--socket", d_d.socket, "--json")
    assert res.returncode == 0, res.stderr
    (peer,) = json.loads(res.stdout)["peers"]
    assert peer["agent"] == "kvd-p" and peer["clock_error_us"] is not None
    assert abs(peer["clock_offset_us"]) <= peer["clock_error_us"]


def _secret(workdir: Path, name: str, secret: bytes) -> str:
    path = workdir / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, secret)
    os.close(fd)
    return f'[auth]\nsecret_file = "{path}"\n'


def _ask(d: DaemonProc, q: wire.TraceQuery) -> wire.Record:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{d.side_port}")
        sock.send(wire.encode(q, 7))
        assert sock.poll(10_000), "no answer on the side channel"
        corr, reply = wire.decode(sock.recv())
        assert corr == 7
        return reply
    finally:
        sock.close(0)


def test_trace_queries_are_authenticated_under_a_shared_secret(
    daemons: StartDaemon, workdir: Path
) -> None:
    """With [auth], the daemons' own exchange works (both have the secret), and a query
    without the secret's MAC is refused and counted, revealing nothing."""
    auth = _secret(workdir, "secret", b"trace secret")
    p_d = daemons("kvd-p", auth)
    d_d = daemons("kvd-d", auth)
    p = make_engine(p_d.socket, "prefill", num_blocks=16, num_layers=1, chunk_bytes=4096)
    d = make_engine(d_d.socket, "decode", num_blocks=16, num_layers=1, chunk_bytes=4096)
    rid = "tr-auth-1-aaaaaaaa"
    try:
        d.client.register_push(rid, [3], "127.0.0.1", p_d.side_port)
        p.client.finished("tr-auth-1-bbbbbbbb", [1])
        assert _events(d.client, 1) == ["RecvFinished"]
    finally:
        p.close()
        d.close()
    code, view = _trace(d_d, rid, "--peer")
    assert code == 0, view
    assert {r["daemon"] for r in view["timeline"]} == {"kvd-d", "kvd-p"}

    before = json.loads(_kvd("status", "--socket", p_d.socket, "--json").stdout)["counters"]
    forged = make_query("kvd-intruder", [rid], 1, bytes(16), time.time(), b"another secret")
    for q in (forged, make_query("kvd-intruder", [rid], 1, bytes(16), time.time(), None)):
        reply = _ask(p_d, q)
        assert isinstance(reply, wire.ErrorReply) and reply.code == ErrorCode.AUTH, reply
        assert "failed authentication" in reply.message
    after = json.loads(_kvd("status", "--socket", p_d.socket, "--json").stdout)["counters"]
    assert after.get("auth_rejected", 0) - before.get("auth_rejected", 0) == 2
