"""Operating kvd end to end: `kvd drain`, `kvd abort` and the CLI's first contact, against
real daemons (real processes, IPC sockets, NIXL and shared memory; bytes checked).

"Exactly once" is counted on the engines' worker clients: a worker receives every event
of its engine unfiltered (the scheduler client drops repeats by design).
"""

from __future__ import annotations

import json
import os
import random
import secrets
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from kvd_client import wire
from kvd_client.client import KvdClient
from kvd_client.errors import DaemonUnavailable
from typer.testing import CliRunner

from kvd.cli import app
from kvd.demo import DaemonProc, Engine, make_engine, pattern

from .conftest import StartDaemon, shm_segments
from .traffic import D_TERMINAL, P_TERMINAL, Req, Traffic

HOST = "127.0.0.1"


def kvd(*args: str, timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvd", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def kvd_json(*args: str) -> dict[str, object]:
    res = kvd(*args, "--json")
    assert res.returncode == 0, res.stdout + res.stderr
    out: dict[str, object] = json.loads(res.stdout)
    return out


def ids(tag: str) -> tuple[str, str]:
    """(P's request id, D's request id): vLLM-style ids sharing a base id."""
    key = f"cmpl-{secrets.token_hex(8)}-{tag}-0"
    return f"{key}-{secrets.token_hex(4)}", f"{key}-{secrets.token_hex(4)}"


def engine(d: DaemonProc, name: str, blocks: int = 256) -> Engine:
    return make_engine(
        d.socket, name, num_blocks=blocks, num_layers=2, chunk_bytes=4096, workers=True
    )


class Ends:
    """Terminal events per request id as each engine's worker saw them."""

    def __init__(self, p: Engine, d: Engine) -> None:
        self.p, self.d = p, d
        self.sent: Counter[str] = Counter()
        self.recv: Counter[str] = Counter()

    def poll(self) -> None:
        for ev in self.p.workers[0].drain_events():
            if isinstance(ev, P_TERMINAL):
                self.sent[ev.request_id] += 1
        for ev in self.d.workers[0].drain_events():
            if isinstance(ev, D_TERMINAL):
                self.recv[ev.request_id] += 1


def run(t: Traffic, ends: Ends, seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        t.step()
        ends.poll()
        time.sleep(0.003)


def held(t: Traffic, mode: str, tag: str) -> Req:
    """A request of `t`'s (its events, ends and bytes checked by `t`) whose blocks are
    filled but nothing is announced yet: the test moves it by hand."""
    key = f"cmpl-{secrets.token_hex(8)}-{tag}-0"
    r = Req(
        key,
        f"{key}-{secrets.token_hex(4)}",
        f"{key}-{secrets.token_hex(4)}",
        mode,
        t.p.alloc(t.rng, 2),
        t.d.alloc(t.rng, 2),
        time.monotonic(),
    )
    for rank in range(len(t.p.regions)):
        for j, b in enumerate(r.p_blocks):
            t.p.block(rank, b)[:] = pattern(f"{key}/{rank}", j, t.p.block_bytes)
    t.reqs[key], t.by_p[r.p_id], t.by_d[r.d_id] = r, r, r
    return r


def ours(pids: list[int]) -> set[str]:
    """Staging segments of this test process and of the daemons it started."""
    return {n for n in shm_segments() if any(f"-p{pid}-" in n for pid in pids)}


# ------------------------------------------------------------------ drain


@pytest.mark.parametrize("side", ["P", "D"])
def test_drain_under_load_ends_every_request_once_and_exits_clean(
    daemons: StartDaemon, side: str
) -> None:
    """Push and pull requests flow; the drain refuses new ones at once on both sides (D
    recomputes), lets the leased and in-flight ones end, and the daemon exits 0 holding
    nothing. Every request ends exactly once on each side; every byte delivered is right.

    Besides the random traffic, a few requests are held at the drain's start for certain:
    P side, leases D has not fetched yet (D registers or pulls them during the drain: they
    are served); D side, push registrations whose P has not finished yet (P finishes them
    during the drain: they are written)."""
    p_d, d_d = daemons("kvd-p"), daemons("kvd-d")
    target = p_d if side == "P" else d_d
    p, d = engine(p_d, "prefill"), engine(d_d, "decode")
    ends = Ends(p, d)
    port = p_d.side_port
    t = Traffic(p, d, port, random.Random(11), window=16, max_blocks=4)
    try:
        run(t, ends, 1.5)
        assert t.ok() > 0, t.unfinished()[:5]
        assert {r.mode for r in t.reqs.values()} == {"push", "pull"}
        # requests certainly in flight when the drain starts
        if side == "P":  # leased at P, not yet fetched by D
            kept = [held(t, mode, f"held{i}") for i, mode in enumerate(("push", "pull", "push"))]
            for r in kept:
                d.client.track(r.d_id, HOST, port, remote_request_id=r.p_id)
                p.client.finished(r.p_id, r.p_blocks)
            want = {r.p_id for r in kept}
            deadline = time.monotonic() + 30
            while not want <= {x["request_id"] for x in p.client.status("leases")["leases"]}:
                assert time.monotonic() < deadline
                run(t, ends, 0.02)
        else:  # registered at D for a push, P not finished yet
            kept = [held(t, "push", f"held{i}") for i in range(3)]
            for r in kept:
                d.client.track(r.d_id, HOST, port, remote_request_id=r.p_id)
                d.client.register_push(r.d_id, r.d_blocks, HOST, port, remote_request_id=r.p_id)
            deadline = time.monotonic() + 30
            while p.client.status()["sender"]["pending_registrations"] < len(kept):
                assert time.monotonic() < deadline
                run(t, ends, 0.02)

        # start the drain, traffic still coming: new work is refused at once, both sides
        started = kvd_json("drain", "--no-wait", "-s", target.socket)
        assert started["state"] == "draining"  # the held requests are in flight
        in_flight = started["sending" if side == "P" else "receiving"]
        assert isinstance(in_flight, dict) and in_flight["count"] >= len(kept)
        # the held requests go on now, during the drain
        for r in kept:
            if side == "P":
                t._d_start(r)
            else:
                p.client.finished(r.p_id, r.p_blocks)
        before = t.started
        run(t, ends, 1.5)
        assert t.started > before  # new requests came during the drain
        refused = [r for r in t.reqs.values() if "draining" in r.d_reason]
        assert refused, t.unfinished()[:5]
        status = kvd_json("status", "-s", target.socket)
        drain = status["drain"]
        assert isinstance(drain, dict) and drain["state"] in ("draining", "drained")
        assert drain["since"] is not None and "sending" in drain and "receiving" in drain

        # no new requests; drain with --exit while the engines keep polling
        t.paused = True
        cmd = ["drain", "--exit", "--timeout", "60", "--json", "-s", target.socket]
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvd", *cmd],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        deadline = time.monotonic() + 120
        while proc.poll() is None:
            assert time.monotonic() < deadline, "kvd drain --exit did not return"
            t.step()
            ends.poll()
            time.sleep(0.005)
        out, errs = proc.communicate()
        assert proc.returncode == 0, out + errs
        report = json.loads(out)
        assert report["state"] in ("drained", "exited"), report
        assert target.proc.wait(30) == 0, target.report(3000)
        assert not os.path.exists(target.socket)
        log = target.log.read_text()
        assert '"drain_done"' in log and '"exiting_after_drain"' in log

        # every request ended exactly once on each side
        t.settle(30)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and (
            set(ends.sent) != set(t.by_p) or set(ends.recv) != set(t.by_d)
        ):
            ends.poll()
            time.sleep(0.02)
        assert t.unfinished() == []
        assert t.stray == [] and t.wrong == []
        assert set(ends.sent) == set(t.by_p) and set(ends.recv) == set(t.by_d)
        assert max(ends.sent.values()) == 1 and max(ends.recv.values()) == 1
        # what was leased or in flight when the drain started was served, bytes checked
        for r in kept:
            assert (r.p_end, r.d_end) == ("SendFinished", "RecvFinished"), r
        # the refusals were failures on both sides, with the blocks D recomputes
        for r in refused:
            assert r.d_end == "RecvFailed" and r.p_end in ("SendFailed", "SendExpired")
        # the other daemon holds nothing for any of them
        other_eng = d if side == "P" else p
        leases = other_eng.client.status("leases")
        assert leases["leases"] == [] and leases["tracked"] == []
        st = other_eng.client.status()
        assert st["sender"]["leases"] == 0 and st["receiver"]["tracked"] == 0
    finally:
        p.close()
        d.close()
    # nothing leaked: no staging segment of ours or of the exited daemon
    assert ours([os.getpid(), target.proc.pid]) == set()


def test_drain_timeout_reports_what_is_left_and_exit_still_exits(daemons: StartDaemon) -> None:
    """A lease nobody fetches keeps the drain from ending: at the timeout `kvd drain` says
    what is left (exit 1), and with --exit the daemon exits anyway, cleanly."""
    p_d = daemons("kvd-p")
    p = engine(p_d, "prefill", blocks=16)
    try:
        p_id, _ = ids("stuck")
        p.client.finished(p_id, [1, 2])
        res = kvd("drain", "--timeout", "1", "--json", "-s", p_d.socket)
        assert res.returncode == 1, res.stdout + res.stderr
        report = json.loads(res.stdout)
        assert report["state"] == "timed_out"
        sending = report["sending"]
        assert sending["count"] == 1
        assert sending["requests"][0]["request_id"] == p_id
        assert sending["requests"][0]["state"] == "held"
        # the lease still runs: the drain never cuts what is leased
        assert p.client.status("leases")["leases"][0]["request_id"] == p_id
        # the operator ends it by hand, then the daemon exits at once
        assert kvd_json("abort", p_id, "-s", p_d.socket)["send"] == {"was": "held", "now": "ended"}
        (ev,) = p.client.wait_events(10)
        assert isinstance(ev, wire.SendFailed) and "operator" in ev.reason
        res = kvd("drain", "--exit", "-s", p_d.socket)
        assert res.returncode == 0, res.stdout + res.stderr
        assert "the daemon exited" in res.stdout
        assert p_d.proc.wait(30) == 0
    finally:
        p.close()


# ------------------------------------------------------------------ abort


def test_operator_abort_on_both_sides_ends_each_request_once(daemons: StartDaemon) -> None:
    p_d, d_d = daemons("kvd-p"), daemons("kvd-d")
    port = p_d.side_port
    p, d = engine(p_d, "prefill", 16), engine(d_d, "decode", 16)
    ends = Ends(p, d)
    try:
        # P: a leased request D never fetches
        p1, d1 = ids("abort-p")
        p.client.finished(p1, [1, 2])
        out = kvd_json("abort", p1, "-s", p_d.socket)
        assert out["send"] == {"was": "held", "now": "ended"} and out["recv"] is None
        (ev,) = p.client.wait_events(10)
        assert isinstance(ev, wire.SendFailed) and "operator" in ev.reason
        # D registers for it later: refused at once (the lease is gone), D recomputes
        d.client.register_push(d1, [3, 4], HOST, port, remote_request_id=p1)
        (ev,) = d.client.wait_events(10)
        assert isinstance(ev, wire.RecvFailed) and ev.block_ids == (3, 4)

        # D: a registration waiting for a P engine that never finishes
        p2, d2 = ids("abort-d")
        d.client.register_push(d2, [5], HOST, port, remote_request_id=p2)
        deadline = time.monotonic() + 20
        while p.client.status()["sender"]["pending_registrations"] != 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        out = kvd_json("abort", d2, "-s", d_d.socket)
        recv = out["recv"]
        assert out["send"] is None and isinstance(recv, dict) and recv["was"] == "registered"
        (ev,) = d.client.wait_events(10)
        assert isinstance(ev, wire.RecvFailed) and "operator" in ev.reason and ev.block_ids == (5,)
        # P was told: it holds nothing for it, and a late finish is refused at once
        deadline = time.monotonic() + 10
        while p.client.status()["sender"]["pending_registrations"] != 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        p.client.finished(p2, [6])
        (ev,) = p.client.wait_events(10)
        assert isinstance(ev, wire.SendFailed)

        # exactly once on each side (as the workers saw it)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline and (len(ends.sent) < 2 or len(ends.recv) < 2):
            ends.poll()
            time.sleep(0.02)
        ends.poll()
        assert ends.sent == Counter({p1: 1, p2: 1}) and ends.recv == Counter({d1: 1, d2: 1})

        # nothing by that id any more, on either daemon: said so, exit 1
        res = kvd("abort", d2, "--json", "-s", d_d.socket)
        assert res.returncode == 1 and json.loads(res.stdout)["kind"] == "not_found"
        res = kvd("abort", "no-such-request", "-s", p_d.socket)
        assert res.returncode == 1 and "no request 'no-such-request'" in res.stderr
        assert p.client.status("leases")["leases"] == []
        assert d.client.status("leases")["tracked"] == []
    finally:
        p.close()
        d.close()


def test_operator_requests_are_for_cli_sessions_only(daemons: StartDaemon) -> None:
    p_d = daemons("kvd-p")
    c = KvdClient(p_d.socket, role="scheduler", engine_id="e")
    c.connect()
    try:
        with pytest.raises(Exception, match="operator request"):
            c.request(wire.Drain(0.0, True))
        assert c.status()["drain"]["state"] == "serving"
    finally:
        c.close()


# ------------------------------------------------------------------ first contact


def test_missing_socket_answers_at_once_and_in_json(workdir: Path) -> None:
    missing = str(workdir / "nope.sock")
    runner = CliRunner()
    for cmd in (["status"], ["leases"], ["drain"], ["abort", "x"], ["ping", "h:1"]):
        t0 = time.monotonic()
        res = runner.invoke(app, [*cmd, "-s", missing])
        assert time.monotonic() - t0 < 2.0, cmd  # not a 5 s timeout
        assert res.exit_code == 3, (cmd, res.output)
        assert f"no kvd daemon at {missing}: is it running?" in res.output
        assert "--socket" in res.output and "KVD_SOCKET" in res.output
        res = runner.invoke(app, [*cmd, "-s", missing, "--json"])
        assert res.exit_code == 3
        err = json.loads(res.stdout)
        assert err["kind"] == "no_daemon" and missing in err["error"]


def test_stale_socket_and_permission_denied_are_said_so(
    daemons: StartDaemon, workdir: Path
) -> None:
    # a socket file nobody listens on (a daemon killed with SIGKILL leaves one)
    stale = str(workdir / "stale.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(stale)
    s.close()
    res = CliRunner().invoke(app, ["status", "-s", stale])
    assert res.exit_code == 3 and "no kvd daemon listens" in res.output
    # a daemon whose socket this user may not open
    x = daemons("kvd-x")
    if os.geteuid() == 0:  # root may open anything: ask as nobody
        cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    else:
        os.chmod(x.socket, 0)
        cmd = []
    env = dict(os.environ)
    t0 = time.monotonic()
    res = subprocess.run(
        [*cmd, sys.executable, "-m", "kvd", "status", "--json", "-s", x.socket],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert res.returncode == 3, res.stdout + res.stderr
    err = json.loads(res.stdout)
    assert err["kind"] == "permission_denied" and "permission denied" in err["error"]
    assert time.monotonic() - t0 < 60  # (interpreter start under load; no 5 s wait inside)


def test_client_status_on_a_dead_daemon_does_not_block(daemons: StartDaemon) -> None:
    x = daemons("kvd-x")
    c = KvdClient(x.socket, role="cli", timeout=10.0, keepalive_interval=0)
    c.connect()
    try:
        assert c.status()["agent_name"] == "kvd-x"
        x.kill()  # SIGKILL: the socket file stays behind
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="no kvd daemon listens"):
            c.status()
        assert time.monotonic() - t0 < 3.0  # not the 10 s timeout
    finally:
        c.close()
    # and a new client is told at once
    t0 = time.monotonic()
    with pytest.raises(DaemonUnavailable):
        KvdClient(x.socket, role="cli").connect(wait_for_daemon=0)
    assert time.monotonic() - t0 < 1.0


def test_status_shows_pid_settings_and_unauthenticated_peers(
    daemons: StartDaemon, workdir: Path
) -> None:
    x = daemons("kvd-x")
    data = kvd_json("status", "-s", x.socket)
    assert data["pid"] == x.proc.pid
    settings = data["settings"]
    assert isinstance(settings, dict)
    assert settings["socket"] == x.socket and settings["socket_mode"] == "0o660"
    assert settings["auth"] == "off"
    for key in ("kv_lease_duration", "transfer_timeout", "client_timeout", "handshake_timeout"):
        assert isinstance(settings[key], float)
    assert data["drain"] == {"state": "serving"}
    text = kvd("status", "-s", x.socket).stdout
    assert f"pid {x.proc.pid}" in text and "auth off" in text and "lease 30s" in text
    assert "WARNING: peers are NOT authenticated" in text

    secret = workdir / "secret"
    secret.write_bytes(secrets.token_bytes(32))
    secret.chmod(0o600)
    a = daemons("kvd-a", overrides={"auth": {"secret_file": str(secret)}})
    text = kvd("status", "-s", a.socket).stdout
    assert "auth on" in text and "NOT authenticated" not in text


def test_tables_are_not_cut_and_cli_sessions_log_at_debug(daemons: StartDaemon) -> None:
    x = daemons("kvd-x")
    e = engine(x, "prefill", 16)
    try:
        long_id = "cmpl-" + "0123456789abcdef" * 6 + "-0-deadbeef"
        e.client.finished(long_id, [1, 2, 3])
        # stdout is a pipe, not a terminal: the table is as wide as its content
        env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
        res = subprocess.run(
            [sys.executable, "-m", "kvd", "leases", "-s", x.socket],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert long_id in res.stdout, res.stdout
        # a width set on purpose (`watch` sets COLUMNS) wraps a long id, never cuts it
        env["COLUMNS"] = "60"
        res = subprocess.run(
            [sys.executable, "-m", "kvd", "leases", "-s", x.socket],
            capture_output=True,
            text=True,
            timeout=120,
            env=env,
        )
        assert "…" not in res.stdout and max(map(len, res.stdout.splitlines())) <= 60
        cells = [ln.split("│")[1].strip() for ln in res.stdout.splitlines() if ln.startswith("│")]
        assert long_id in "".join(cells), res.stdout
        for _ in range(3):
            kvd("status", "-s", x.socket)
        assert kvd_json("abort", long_id, "-s", x.socket)["send"] == {"was": "held", "now": "ended"}
    finally:
        e.close()
    sessions = [
        json.loads(line)
        for line in x.log.read_text().splitlines()
        if '"session_opened"' in line or '"session_closed"' in line
    ]
    # the engine's sessions are logged at info; the CLI's many sessions are not (debug)
    assert {s["role"] for s in sessions if s["event"] == "session_opened"} == {
        "scheduler",
        "worker",
    }
    assert all(s["level"] == "info" for s in sessions)
