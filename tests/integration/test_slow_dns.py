"""A peer's host name that is slow to resolve holds up that peer's requests only.

libzmq resolves a `tcp://` endpoint's host name in its one I/O thread, synchronously, and
every socket of the daemon (every engine's IPC connection included) waits meanwhile. The
daemon resolves names itself, in worker threads (`kvd.adapters.resolve`), and gives
libzmq numbers. Here a real daemon runs in a network namespace whose DNS server cannot be
reached (its queries are routed into a veth whose other end drops them: each lookup waits for the
resolver's timeout), and an engine asks for pulls from P daemons named by host names:
another engine's Hello and status calls are answered at once meanwhile, and every pull
ends, failed, within its bound; a daemon stopped while lookups are under way exits at
once. Before, the Hello waited for the lookups (5-20 s for 100 names on this machine,
with a DNS server that answers).
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import pytest
from kvd_client import wire
from kvd_client.client import KvdClient

from kvd import netns
from kvd.demo import Engine, make_engine

from .conftest import StartDaemon

NAMES = 8
RES_OPTIONS = "timeout:1 attempts:1"


@pytest.fixture
def dead_dns() -> Iterator[str]:
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"a network namespace: {why}")
    ns = f"kvdres{os.getpid()}"
    netns.ip("netns", "add", ns)
    try:
        run = ("ip", "netns", "exec", ns)
        for cmd in (
            ("ip", "link", "set", "lo", "up"),
            # a veth pair inside the namespace: what is routed out of it is lost
            ("ip", "link", "add", "kvdres0", "type", "veth", "peer", "name", "kvdres1"),
            ("ip", "addr", "add", "10.79.0.1/24", "dev", "kvdres0"),
            ("ip", "link", "set", "kvdres0", "up"),
            ("ip", "link", "set", "kvdres1", "up"),
            ("ip", "route", "add", "default", "dev", "kvdres0"),
        ):
            subprocess.run([*run, *cmd], check=True, capture_output=True, timeout=10)
        t0 = time.monotonic()
        subprocess.run(
            [*run, "getent", "hosts", "p0.kvd-test.invalid"],
            capture_output=True,
            timeout=30,
            env=dict(os.environ, RES_OPTIONS=RES_OPTIONS),
        )
        took = time.monotonic() - t0
        if took < 0.5:
            pytest.skip(f"a lookup in the namespace took {took:.2f}s: not slow here")
        yield ns
    finally:
        netns.ip("netns", "del", ns, check=False)


def pull_from_names(eng: Engine, tag: str, n: int) -> None:
    """`n` pulls, each from a P daemon named by a host name of its own (none resolves)."""
    for i in range(n):
        eng.client.pull(
            f"{tag}-{i}",
            [0, 1],
            f"{tag}{i}.kvd-test.invalid",
            5600,
            remote_request_id=f"p-{tag}-{i}",
            remote_block_ids=[0, 1],
            remote_engine_id="prefill",
        )


def test_names_slow_to_resolve_hold_up_only_their_requests(
    daemons: StartDaemon, dead_dns: str
) -> None:
    d = daemons(
        "kvd-dns",
        env={"RES_OPTIONS": RES_OPTIONS},
        prefix=("ip", "netns", "exec", dead_dns),
    )
    eng = make_engine(d.socket, "decode", num_blocks=16, num_layers=2, chunk_bytes=4096)
    try:
        t0 = time.monotonic()
        pull_from_names(eng, "req", NAMES)
        time.sleep(0.3)  # the lookups are under way
        for k in range(3):  # another engine is served at once meanwhile
            t = time.monotonic()
            with KvdClient(d.socket, role="scheduler", engine_id=f"other{k}", timeout=30.0) as c:
                c.status()
            took = time.monotonic() - t
            assert took < 1.0, f"Hello and status took {took:.2f}s behind the lookups"
        ended: dict[str, wire.Record] = {}
        bound = 5.0 + 2.0  # side_channel.handshake_timeout (the default) + slack
        while len(ended) < NAMES and time.monotonic() - t0 < bound + 5.0:
            for ev in eng.client.wait_events(0.2):
                if isinstance(ev, (wire.RecvFinished, wire.RecvFailed)):
                    ended[ev.request_id] = ev
        assert len(ended) == NAMES, f"{NAMES - len(ended)} pulls did not end"
        assert all(isinstance(ev, wire.RecvFailed) for ev in ended.values()), ended
        with KvdClient(d.socket, role="cli", timeout=10.0) as c:
            assert c.status()["receiver"]["tracked"] == 0
        # stopped while lookups are under way, it exits at once: nothing joins them (24
        # lookups of 2 s each would hold an executor of six threads 8 s)
        pull_from_names(eng, "late", 3 * NAMES)
        time.sleep(0.3)
    finally:
        eng.close()
    t = time.monotonic()
    assert d.stop(timeout=30.0) == 0
    assert time.monotonic() - t < 6.0, f"the daemon took {time.monotonic() - t:.1f}s to stop"
