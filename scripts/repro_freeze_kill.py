"""Reproduce a native abort of a P daemon inside UCX (found by `kvd chaos --two-hosts
--seed 47 --fuzz` on 2026-11-27; avoided since by pulling by WRITE, `kvd.core.readpath`).

Two hosts (network namespaces, UCX over TCP on a veth: needs root), P and D daemons with
KV traffic, then per round: P SIGSTOPped, D SIGKILLed while P is stopped, P SIGCONTed,
D started again. With pulls that READ (`PULL_BY=read`) P aborts in the first round or
two, in its NIXL thread's `get_new_notifs` -> `ucp_worker_progress` ->
`uct_tcp_iface_progress`:

    ucp_request.inl:356  Fatal: unexpected error: Endpoint timeout

Over TCP UCX emulates a READ (GET requests answered by the server's UCX). The address
of the abort is inside `ucp_get_req_handler`: `ucp_progress_get_reply` returns the send
error of a connection that was reset (D died with its GET requests queued in P's socket)
and `ucp_request_send` treats it as fatal. `MODES=push,layers` (no READ): no abort.
With `transfer.pull_by = "auto"` (the default) pulls between these hosts go by P's
WRITE and P survives every round.

    .venv/bin/python scripts/repro_freeze_kill.py 10             # rounds (as root)
    PULL_BY=read .venv/bin/python scripts/repro_freeze_kill.py 3  # the abort
    EXTRA_ENV='{"UCX_X": "y"}' MODES=pull .venv/bin/python ...     # UCX settings, modes
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvd import netns
from kvd.chaos import KV_MODES, KV_TP, kv_engine
from kvd.demo import DaemonProc, start_daemon
from kvd.traffic import Traffic

PORTS = {"p": 47721, "d": 47722}


def main(rounds: int) -> int:
    extra_env = json.loads(os.environ.get("EXTRA_ENV", "{}"))
    modes = tuple(os.environ.get("MODES", ",".join(KV_MODES)).split(","))
    wd = Path(tempfile.mkdtemp(prefix="kvdr-", dir="/tmp"))
    a, b = netns.pair("kvdr", "10.81.0")
    netns.create(a, b)
    daemons: dict[str, DaemonProc] = {}

    def start(key: str) -> DaemonProc:
        host = a if key == "p" else b
        over: dict[str, dict[str, Any]] = {
            "daemon": {"client_timeout": 3.0, "reap_leftover_segments": False},
            "transfer": {
                "kv_lease_duration": 4.0,
                "peer_probe_interval": 0.5,
                "pull_by": os.environ.get("PULL_BY", "auto"),
            },
            "side_channel": {"handshake_timeout": 2.0, "port": PORTS[key], "host": host.addr},
            "nixl": {"ucx_tls": "tcp"},
        }
        daemons[key] = start_daemon(
            wd,
            f"kvdr-{key}",
            "",
            {**host.ucx_env, **extra_env},
            overrides=over,
            prefix=host.prefix,
            ready_timeout=120,
        )
        return daemons[key]

    try:
        p, d = start("p"), start("d")
        pe = kv_engine(p.socket, "prefill", 256, tp=KV_TP, workers=True)
        de = kv_engine(d.socket, "decode", 256, tp=KV_TP)
        rng = random.Random(1)
        kv = Traffic(pe, de, p.side_port, rng, window=12, max_blocks=8, modes=modes, p_host=a.addr)

        def run_for(seconds: float) -> None:
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                kv.step()
                time.sleep(0.003)

        for r in range(rounds):
            run_for(rng.uniform(1.5, 3.0))
            p.proc.send_signal(signal.SIGSTOP)
            run_for(rng.uniform(0.1, 0.8))
            daemons["d"].kill()
            run_for(rng.uniform(0.2, 1.2))
            p.proc.send_signal(signal.SIGCONT)
            run_for(2.0)
            if p.proc.poll() is not None:
                text = p.log.read_text(errors="replace")
                at = text.find("Fatal Python error")
                print(f"round {r}: P died ({p.proc.returncode})\n{text[max(0, at - 3000) : at]}")
                return 1
            print(f"round {r}: P alive", flush=True)
            start("d")
            run_for(1.0)
        return 0
    finally:
        for dp in daemons.values():
            dp.stop(timeout=10)
        netns.remove(a, b)
        print(f"logs: {wd}")


if __name__ == "__main__":
    sys.exit(main(int(sys.argv[1]) if len(sys.argv) > 1 else 10))
