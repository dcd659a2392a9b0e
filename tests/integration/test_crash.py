"""An actor that crashes takes the whole daemon down: logged reason, exit 1, socket removed.

The fault is injected (an actor cannot be made to crash for real without a bug): the
daemon runs in a subprocess whose gateway sweeper raises one second after start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

CRASHING_DAEMON = textwrap.dedent(
    """
    import sys
    import anyio
    from kvd.actors import gateway
    from kvd.config import parse_config
    from kvd.daemon import serve
    from kvd.logs import configure

    async def crash(self):
        await anyio.sleep(1.0)
        raise RuntimeError("injected actor crash")

    gateway.Gateway._sweep = crash
    configure("info", "json")
    cfg = parse_config({"daemon": {"socket": sys.argv[1], "name": "kvd-crash"},
                        "side_channel": {"port": 0}}, "<test>")
    sys.exit(serve(cfg))
    """
)


def test_actor_crash_ends_the_daemon_with_a_reason(workdir: Path) -> None:
    sock = str(workdir / "crash.sock")
    t0 = time.monotonic()
    res = subprocess.run(
        [sys.executable, "-c", CRASHING_DAEMON, sock], capture_output=True, text=True, timeout=60
    )
    assert res.returncode == 1
    assert time.monotonic() - t0 < 30
    assert '"event": "daemon_crashed"' in res.stderr and "injected actor crash" in res.stderr
    assert '"event": "daemon_ready"' in res.stderr  # it was fully up, then went down whole
    assert not os.path.exists(sock)


def test_a_network_device_that_is_not_there_is_a_clear_start_failure(workdir: Path) -> None:
    """A real start failure (no injection): UCX told to use a network device this host
    lacks (as when the NIC named in UCX_NET_DEVICES is missing, or down: a two-host chaos
    run met it restarting a daemon while its link was cut). The daemon exits 1 with one
    error line that names the device and says what to check, not a crash traceback, and
    leaves no socket."""
    sock = workdir / "nodev.sock"
    cfg = workdir / "nodev.toml"
    cfg.write_text(
        f'[daemon]\nname = "kvd-nodev"\nsocket = "{sock}"\n'
        '[side_channel]\nport = 0\n[nixl]\nucx_tls = "tcp"\n[log]\nformat = "json"\n'
    )
    env = dict(os.environ, UCX_NET_DEVICES="kvdnodev0")
    res = subprocess.run(
        [sys.executable, "-m", "kvd", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    out = res.stdout + res.stderr
    assert res.returncode == 1, out
    failed = [json.loads(t) for t in out.splitlines() if '"event": "nixl_start_failed"' in t]
    assert len(failed) == 1, out
    assert failed[0]["ucx_net_devices"] == "kvdnodev0" and failed[0]["ucx_tls"] == "tcp"
    assert "UCX_NET_DEVICES" in failed[0]["hint"]
    assert "daemon_crashed" not in out and "Traceback" not in out
    assert '"event": "daemon_ready"' not in out
    assert not sock.exists()
