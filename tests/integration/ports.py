"""TCP ports for daemons the tests start on a fixed port.

A port found by binding port 0 comes from the kernel's ephemeral range and is free only at
that moment: while nothing listens on it (before the daemon binds it, or between two
incarnations of a daemon restarted on it), any bind to port 0 or outgoing connection on
this host may be given it, and the daemon then fails to bind ("Address already in use").
With the suite's workers starting daemons and connections all the while, that happens.
No one is given a port below the ephemeral range unless they ask for it by number.
"""

from __future__ import annotations

from kvd.chaos import free_port


def restart_port() -> int:
    """A free port below the kernel's ephemeral range (as `kvd chaos` takes for the
    daemons it restarts): for a daemon that binds it, or is restarted on it."""
    return free_port(set())
