"""TCP ports for daemons the tests start on a fixed port.

A port found by binding port 0 comes from the kernel's ephemeral range and is free only at
that moment: while nothing listens on it (before the daemon binds it, or between two
incarnations of a daemon restarted on it), any bind to port 0 or outgoing connection on
this host may be given it, and the daemon then fails to bind ("Address already in use").
With the suite's workers starting daemons and connections all the while, that happens.
No one is given a port below the ephemeral range unless they ask for it by number.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

HOST = "127.0.0.1"


def restart_port() -> int:
    """A free port below the kernel's ephemeral range (for a daemon that binds it, or is
    restarted on it)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    rng = random.SystemRandom()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 12_000), low) if low > 1024 else 0
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError("no free port below the ephemeral range")
