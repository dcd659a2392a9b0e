"""P's daemon frozen while D's dies, over TCP between two hosts: P must survive.

Two hosts (network namespaces joined by a veth, UCX over TCP only). Over TCP UCX emulates
a READ: D's GET requests are answered by P's UCX from its progress loop, and UCX 1.23
aborts the process when such an answer meets a connection that was reset since
(`ucp_request.inl:356 Fatal: unexpected error: Endpoint timeout`). A D that dies while P
is stopped (or starved of CPU) leaves its GET requests in P's socket: before pulls went
by P's WRITE where READs are emulated (`kvd.core.readpath`), P's daemon aborted in the
first or second round of this test. Now each round freezes P, kills D, thaws P and
restarts D, and P's daemon must live through every round, with every byte D's engine
took as done equal to P's.

Needs root and `ip netns`; skips with the reason elsewhere.
"""

from __future__ import annotations

import random
import shutil
import signal
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from kvd_client.client import KvdClient

from kvd import netns
from kvd.chaos import kv_engine
from kvd.demo import DaemonProc, Engine, start_daemon
from kvd.traffic import Traffic

pytestmark = pytest.mark.serial  # network namespaces, processes frozen under timed bounds

NET = "10.79.0"
ROUNDS = 3


class _Pair:
    def __init__(self, workdir: Path, p: netns.Host, d: netns.Host) -> None:
        self.workdir, self.hosts = workdir, {"p": p, "d": d}
        self.daemons: dict[str, DaemonProc] = {}
        self.engines: list[Engine] = []

    def start(self, key: str) -> DaemonProc:
        host = self.hosts[key]
        over: dict[str, dict[str, Any]] = {
            "daemon": {"client_timeout": 3.0, "reap_leftover_segments": False},
            "transfer": {"kv_lease_duration": 4.0, "peer_probe_interval": 0.5},
            "side_channel": {"handshake_timeout": 2.0, "port": 0, "host": host.addr},
            "nixl": {"ucx_tls": "tcp"},
        }
        self.daemons[key] = start_daemon(
            self.workdir,
            f"kvdf-{key}-{host.ns.split('-')[1]}",
            "",
            host.ucx_env,
            overrides=over,
            prefix=host.prefix,
            ready_timeout=60,
        )
        return self.daemons[key]


@pytest.fixture
def pair() -> Iterator[_Pair]:
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"two hosts on one machine: {why}")
    p, d = netns.pair("kvdf", NET)
    netns.create(p, d)
    workdir = Path(tempfile.mkdtemp(prefix="kvdf-", dir="/tmp"))
    env = _Pair(workdir, p, d)
    try:
        yield env
    finally:
        for e in env.engines:
            e.close()
        for dp in env.daemons.values():
            if dp.proc.poll() is None:
                dp.proc.send_signal(signal.SIGCONT)
            dp.stop(timeout=10)
        left = netns.remove(p, d)
        shutil.rmtree(workdir, ignore_errors=True)
        assert not left, f"namespaces left behind: {left}"


def _counter(dp: DaemonProc, name: str) -> int:
    with KvdClient(dp.socket, role="cli", keepalive_interval=0) as c:
        return int(c.status()["counters"].get(name, 0))


def test_a_p_daemon_frozen_while_d_dies_survives_pulls_over_tcp(pair: _Pair) -> None:
    p, d = pair.start("p"), pair.start("d")
    pe = kv_engine(p.socket, "prefill", 256, tp=2, workers=True)
    pair.engines.append(pe)
    de = kv_engine(d.socket, "decode", 256, tp=2)
    pair.engines.append(de)
    rng = random.Random(1)
    kv = Traffic(
        pe,
        de,
        p.side_port,
        rng,
        window=12,
        max_blocks=8,
        modes=("pull", "push"),
        p_host=pair.hosts["p"].addr,
    )
    pulls_by_write = 0
    for r in range(ROUNDS):
        kv.run_for(rng.uniform(1.5, 3.0), every=0.003)
        pulls_by_write += _counter(pair.daemons["d"], "pulls_by_write")
        p.proc.send_signal(signal.SIGSTOP)
        kv.run_for(rng.uniform(0.1, 0.8), every=0.003)
        pair.daemons["d"].kill()
        kv.run_for(rng.uniform(0.2, 1.2), every=0.003)
        p.proc.send_signal(signal.SIGCONT)
        kv.run_for(2.0, every=0.003)
        assert p.proc.poll() is None, f"round {r}: P's daemon died:\n{p.report(4000)}"
        pair.start("d")
        kv.run_for(1.0, every=0.003)
    kv.settle(30.0)
    assert p.proc.poll() is None, f"P's daemon died:\n{p.report(4000)}"
    assert kv.wrong == [], kv.wrong[:5]
    assert kv.unfinished() == [], kv.unfinished()[:5]
    assert kv.ok() > 0
    # the pulls went by P's WRITE: D's daemon over TCP never READs from P
    assert pulls_by_write > 0
    assert _counter(p, "pull_registrations") > 0
    # so does `kvd ping`'s canary check: P WRITEs its canary, the echo after it
    with KvdClient(pair.daemons["d"].socket, role="cli", keepalive_interval=0) as c:
        ping = c.ping_peer(pair.hosts["p"].addr, p.side_port, 10.0)
    assert ping["ok"] is True and ping["canary_by"] == "write", ping
