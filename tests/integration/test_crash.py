"""An actor that crashes takes the whole daemon down: logged reason, exit 1, socket removed.

The fault is injected (an actor cannot be made to crash for real without a bug): the
daemon runs in a subprocess whose gateway sweeper raises one second after start.
"""

from __future__ import annotations

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
