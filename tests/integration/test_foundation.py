"""Two real daemons, a third process registering shared memory, `kvd ping` and `kvd status`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

from kvd_client.client import KvdClient

from kvd.demo import DaemonProc

from .conftest import StartDaemon, shm_segments


def kvd(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvd", *args], capture_output=True, text=True, timeout=60
    )


REGISTER_AND_WAIT = textwrap.dedent(
    """
    import sys, time
    from kvd_client.client import KvdClient
    from kvd_client.layout import block_major, region_bytes
    from kvd_client.shm import SharedRegion
    sock, name = sys.argv[1], sys.argv[2]
    lay = block_major(num_blocks=32, num_layers=4, chunk_bytes=4096)
    region = SharedRegion(name, region_bytes(lay))
    region.buf[:4] = b"kvd!"
    c = KvdClient(sock, role="worker", engine_id="engine-a", tp_rank=0)
    c.connect()
    rid = c.register_region(region, layout=lay, compat="test")
    print(rid, flush=True)
    sys.stdin.readline()          # hold the session until told to finish
    c.deregister_region(rid)
    c.close()
    region.close()
    print("closed", flush=True)
    """
)


def test_two_daemons_ping_status_and_clean_exit(daemons: StartDaemon, workdir: Path) -> None:
    a = daemons("kvd-a", "[transfer]\nkv_lease_duration = 20.0\n")
    b = daemons("kvd-b", "[transfer]\nkv_lease_duration = 40.0\n")
    seg = f"kvdt-{os.getpid()}-fnd"
    worker = subprocess.Popen(
        [sys.executable, "-c", REGISTER_AND_WAIT, a.socket, seg],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert worker.stdout is not None and worker.stdin is not None
        region_id = int(worker.stdout.readline())

        ping = kvd("ping", f"127.0.0.1:{b.side_port}", "--socket", a.socket, "--json")
        assert ping.returncode == 0, ping.stdout + ping.stderr
        result = json.loads(ping.stdout)
        assert result["ok"] is True
        assert result["canary_match"] is True
        assert result["canary_by"] == "read"  # one machine: UCX READs natively (cma)
        assert result["agent"] == "kvd-b"
        assert result["read_bytes"] > 0 and result["notif_rtt_ms"] > 0

        st_a = json.loads(kvd("status", "--json", "--socket", a.socket).stdout)
        st_b = json.loads(kvd("status", "--json", "--socket", b.socket).stdout)
        assert [r["region_id"] for r in st_a["regions"]] == [region_id]
        assert st_a["regions"][0]["engine_id"] == "engine-a" and st_a["regions"][0]["blocks"] == 32
        assert st_b["regions"] == []
        assert [p["agent"] for p in st_a["peers"]] == ["kvd-b"]
        assert [p["agent"] for p in st_b["peers"]] == [
            "kvd-a"
        ]  # the handshake taught B about A too
        assert st_a["peers"][0]["lease_duration"] == 40.0
        assert st_a["agent_name"] == "kvd-a" and st_a["uptime_s"] > 0
        assert set(st_a["mailboxes"]) >= {"registrar", "sender", "receiver", "events"}
        peers_b = json.loads(kvd("peers", "--json", "--socket", b.socket).stdout)
        assert peers_b["peers"][0]["regions"][0]["engine_id"] == "engine-a"
        assert peers_b["peers"][0]["incarnation"] == st_a["incarnation"]  # 16 hex digits

        worker.stdin.write("done\n")
        worker.stdin.flush()
        assert worker.stdout.readline().strip() == "closed"
        assert worker.wait(10) == 0
        assert json.loads(kvd("status", "--json", "--socket", a.socket).stdout)["regions"] == []
    finally:
        if worker.poll() is None:
            worker.kill()
    for d in (a, b):
        assert d.stop() == 0, d.report(2000)
        assert not os.path.exists(d.socket)
    # the worker unlinked its segment, and the daemons (no EC region here) created none
    assert seg not in shm_segments()
    pids = {str(a.proc.pid), str(b.proc.pid)}
    assert not {n for n in shm_segments() if any(f"-{pid}-" in n for pid in pids)}


def test_ping_by_write_where_a_read_would_be_emulated(daemons: StartDaemon) -> None:
    """Where our UCX would emulate the canary READ (TCP: a reader dying with a READ queued
    at a stopped peer aborts the peer), the peer WRITEs its canary, the echo after it."""
    a = daemons("kvd-a", '[transfer]\npull_by = "write"\n')
    b = daemons("kvd-b")
    for _ in range(2):  # the scratch is wiped before each
        ping = kvd("ping", f"127.0.0.1:{b.side_port}", "--socket", a.socket, "--json")
        assert ping.returncode == 0, ping.stdout + ping.stderr
        result = json.loads(ping.stdout)
        assert result["ok"] is True and result["canary_match"] is True, result
        assert result["canary_by"] == "write" and result["read_bytes"] == 64 * 1024
    st = json.loads(kvd("status", "--json", "--socket", b.socket).stdout)
    assert st["counters"].get("probe_echo_failed", 0) == 0


def test_a_ping_to_a_frozen_peer_times_out_and_leaves_nothing_waiting(
    daemons: StartDaemon,
) -> None:
    """A ping whose echo never comes (the peer SIGSTOPped after the handshake) fails at
    its timeout and forgets its probe: before, it stayed, and the NIXL thread polled at
    its short cap for good (the daemon never idled deeply again)."""
    a = daemons("kvd-a", '[transfer]\npull_by = "write"\n')
    b = daemons("kvd-b")
    assert kvd("ping", f"127.0.0.1:{b.side_port}", "--socket", a.socket).returncode == 0
    os.kill(b.proc.pid, signal.SIGSTOP)
    try:
        res = kvd("ping", f"127.0.0.1:{b.side_port}", "--socket", a.socket, "--json",
                  "--timeout", "1.5")  # fmt: skip
        assert res.returncode == 1 and "timed out" in json.loads(res.stdout)["error"], res
        reg = json.loads(kvd("status", "--json", "--socket", a.socket).stdout)["registrar"]
        assert reg["pings_waiting"] == 0
    finally:
        os.kill(b.proc.pid, signal.SIGCONT)
    # b, woken, answers the late probe with a late echo (dropped) and then pings again
    ping = json.loads(
        kvd("ping", f"127.0.0.1:{b.side_port}", "--socket", a.socket, "--json").stdout
    )
    assert ping["ok"] is True and ping["canary_by"] == "write", ping
    reg = json.loads(kvd("status", "--json", "--socket", b.socket).stdout)["registrar"]
    assert reg["canary_writes"] == 0


def _peers(d: DaemonProc) -> list[str]:
    with KvdClient(d.socket, role="cli") as c:
        return sorted(p["agent"] for p in c.status("peers")["peers"])


def _wait(cond: Callable[[], bool], what: str, timeout: float = 20.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.1)


def test_a_peer_gone_for_good_is_forgotten_and_the_others_kept(daemons: StartDaemon) -> None:
    """A peer whose side channel stays silent (and that sends nothing) for
    `side_channel.forget_silent_peers` is forgotten: before, a daemon gone for good
    stayed known for the life of the process (NIXL entry, every actor's view, sockets
    redialed). A peer that answers, and one frozen for less than the window, stay."""
    side = {"side_channel": {"forget_silent_peers": 3.0, "handshake_timeout": 1.0}}
    a = daemons("kvd-a", overrides=side)
    b, c = daemons("kvd-b"), daemons("kvd-c")
    for peer in (b, c):
        assert kvd("ping", f"127.0.0.1:{peer.side_port}", "--socket", a.socket).returncode == 0
    assert _peers(a) == ["kvd-b", "kvd-c"]
    os.kill(c.proc.pid, signal.SIGSTOP)  # silent for less than the window: kept
    time.sleep(1.0)
    os.kill(c.proc.pid, signal.SIGCONT)
    t0 = time.monotonic()
    b.kill()
    _wait(lambda: _peers(a) == ["kvd-c"], "kvd-b forgotten")
    took = time.monotonic() - t0
    # not before its silence lasted the window (counted from its last answer, at most a
    # check interval, 0.3 s, before the kill)
    assert took >= 2.6, took
    with KvdClient(a.socket, role="cli") as cl:
        counters = cl.status()["counters"]
    assert counters["peers_forgotten_silent"] == 1
    time.sleep(3.5)  # c answers every check: kept past the window
    assert _peers(a) == ["kvd-c"]
    ping = json.loads(
        kvd("ping", f"127.0.0.1:{c.side_port}", "--socket", a.socket, "--json").stdout
    )
    assert ping["ok"] is True


def test_ping_unreachable_peer_fails_cleanly(daemons: StartDaemon) -> None:
    a = daemons("kvd-a")
    res = kvd("ping", "127.0.0.1:1", "--socket", a.socket, "--json", "--timeout", "1.5")
    assert res.returncode == 1
    assert json.loads(res.stdout)["ok"] is False
    res = kvd("ping", "not a host:5600", "--socket", a.socket, "--json")  # never dialled
    assert res.returncode == 2, res
    # with --json the error is JSON too, on stdout
    assert "PingPeer.host 'not a host'" in json.loads(res.stdout)["error"]
    with KvdClient(a.socket, role="cli") as c:  # still serving
        assert c.status()["agent_name"] == "kvd-a"


def test_check_config_and_unknown_key(workdir: Path) -> None:
    good = workdir / "good.toml"
    good.write_text("[transfer]\nkv_lease_duration = 12.5\n")
    assert kvd("check-config", str(good)).returncode == 0
    bad = workdir / "bad.toml"
    bad.write_text("[transfer]\nkv_lease_duratoin = 12.5\n")
    res = kvd("check-config", str(bad))
    assert res.returncode == 2
    assert "transfer.kv_lease_duratoin" in res.stderr and "bad.toml" in res.stderr
    res = kvd("serve", "--config", str(bad))
    assert res.returncode == 2


def test_cli_reports_missing_daemon(workdir: Path) -> None:
    res = kvd("status", "--socket", str(workdir / "nobody.sock"))
    assert res.returncode == 3
    assert f"no kvd daemon at {workdir / 'nobody.sock'}: is it running?" in res.stderr
