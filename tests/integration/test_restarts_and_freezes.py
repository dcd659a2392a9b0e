"""Restarts and freezes under load: real daemons as processes, real NIXL, bytes checked.

The fault model: a daemon SIGSTOPped and SIGCONTed (it comes back with stale state and a
jumped clock), a daemon SIGKILLed and restarted 2 s later as systemd does, an engine
restarted while its daemon lives, a client that gives up on a session the daemon still
holds, a stale message from an old session or incarnation. The promise under all of
them: no request is ever reported done with bytes its P engine was told it got back
(`tests/integration/traffic.py` poisons a P block the moment its send ends), and every
request ends exactly once on each side, within a bound.
"""

from __future__ import annotations

import random
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from kvd.demo import DaemonProc, Engine, make_engine

from .conftest import StartDaemon
from .traffic import Traffic


def engine(d: DaemonProc, name: str, num_blocks: int = 256) -> Engine:
    return make_engine(d.socket, name, num_blocks=num_blocks, num_layers=2, chunk_bytes=4096)


def counter(eng: Engine, key: str) -> int:
    return int(eng.client.status()["counters"].get(key, 0))


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    made: list[Engine] = []
    yield made
    for e in made:
        e.client.timeout = 2.0
        e.close()


# ------------------------------------------------------------------ item 1: P daemon frozen


def test_p_daemon_frozen_under_load_never_reports_wrong_bytes(
    daemons: StartDaemon, engines: list[Engine]
) -> None:
    """P's daemon is frozen for longer than its client timeout while both engines keep
    sending. Nothing may be reported done with bytes P's engine got back, P's client must
    not churn through sessions (it keeps the one the daemon still holds), and the daemon
    must not blame its client for its own stall (the session survives the freeze)."""
    p_cfg: dict[str, Any] = {"daemon": {"client_timeout": 2.0}}
    pd = daemons("kvd-p", overrides=p_cfg)
    dd = daemons("kvd-d")
    p, d = engine(pd, "prefill"), engine(dd, "decode")
    engines += [p, d]
    t = Traffic(p, d, pd.side_port, random.Random(9))
    t.run_for(1.5)
    assert t.ok() > 0 and not t.wrong, (t.ok(), t.wrong)
    opened = counter(p, "sessions_opened")

    pd.proc.send_signal(signal.SIGSTOP)
    try:
        t.run_for(4.0)  # twice P's client_timeout
    finally:
        pd.proc.send_signal(signal.SIGCONT)
    t.run_for(3.0)
    t.settle(20.0)

    assert t.wrong == [], f"{len(t.wrong)} requests reported done with wrong bytes: {t.wrong[:5]}"
    assert t.unfinished() == [], t.unfinished()[:5]
    assert t.stray == [], t.stray[:5]
    # the client kept its session: the daemon never dropped it, nothing reconnected
    assert counter(p, "sessions_opened") == opened
    assert p.client.reconnects == 0
    # the stream recovered: requests after the freeze completed
    assert t.ok() > 20, (t.ok(), t.p_events, t.d_events)
