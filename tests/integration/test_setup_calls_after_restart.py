"""A waiting call (ec_allocate, status, register_region, ...) made after the daemon
restarted and before the engine drained its events: it must not reach the new daemon
without a Hello (which refused it as a protocol error, counted as bad input, although
the client did nothing wrong). It opens the new session first, or fails at once while no
daemon listens. Found by the chaos run (`kvd chaos`): an encoder's ec_allocate right
after its daemon came back."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from kvd_client.client import DOWN_REASON, KvdClient
from kvd_client.errors import DaemonUnavailable

from kvd.demo import start_daemon

from .conftest import StartDaemon

EC = '[ec]\nrole = "producer"\nregion_bytes = 8388608\nblock_bytes = 1048576\n'


def _lost(c: KvdClient, timeout: float = 10.0) -> None:
    """Until the client's keep-alive thread saw the daemon's end close (white box: no
    drain_events, which would open the new session the usual way)."""
    deadline = time.monotonic() + timeout
    while not c._lost.is_set():
        assert time.monotonic() < deadline, "the client never saw its daemon go"
        time.sleep(0.01)


def test_waiting_call_after_a_restart_fails_at_once_or_opens_the_session_first(
    daemons: StartDaemon, workdir: Path
) -> None:
    d = daemons("kvdt-setup", EC)
    c = KvdClient(d.socket, role="scheduler", engine_id="enc", timeout=5.0, keepalive_interval=0.2)
    c.connect()
    try:
        assert c.ec_allocate("kvdt-h1", 1000).block_ids
        first = c.session
        d.kill()
        _lost(c)
        t0 = time.monotonic()
        with pytest.raises(DaemonUnavailable, match="reconnecting"):
            c.ec_allocate("kvdt-h2", 1000)  # no daemon listens: fails here, sends nothing
        assert time.monotonic() - t0 < 1.0
        assert DOWN_REASON.startswith("kvd daemon unavailable")
        d2 = start_daemon(
            workdir, "kvdt-setup", EC, overrides={"daemon": {"reap_leftover_segments": False}}
        )
        try:
            blocks = c.ec_allocate("kvdt-h3", 1000)  # the new session's Hello goes first
            assert blocks.block_ids and c.session != first
            counters = c.status()["counters"]
            assert counters.get("ipc_rejected", 0) == 0, counters
            assert counters["sessions_opened"] >= 1
        finally:
            c.close()
            assert d2.stop() == 0
    finally:
        c.close()
