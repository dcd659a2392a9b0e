"""systemd's notification protocol (sd_notify), without libsystemd or extra dependencies.

The daemon tells systemd it is ready once its sockets are bound and memory is registered,
pings the watchdog, and says when it is stopping. Every call is a single non-blocking
datagram to `$NOTIFY_SOCKET`; outside systemd (variable unset) it does nothing and
returns False. A failed send also returns False rather than raising: losing a status
line must never take the daemon down, and a missed watchdog ping is retried next period.
"""

from __future__ import annotations

import os
import socket
from typing import Final

_NOTIFY_SOCKET: Final = "NOTIFY_SOCKET"


def _address(value: str) -> str | None:
    """The socket address in `$NOTIFY_SOCKET`: a path, or `@name` for the abstract namespace."""
    if value.startswith("@"):
        return "\0" + value[1:]
    if value.startswith("/"):
        return value
    return None  # e.g. vsock:..., which only VMs' service managers use


def notify(state: str) -> bool:
    """Send `state` (newline-separated `KEY=value` lines) to systemd.

    Returns True when the datagram was sent; False when `$NOTIFY_SOCKET` is unset or
    unusable, or the send failed (it never blocks).
    """
    address = _address(os.environ.get(_NOTIFY_SOCKET, ""))
    if address is None:
        return False
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.setblocking(False)
            sock.sendto(state.encode(), address)
    except OSError:
        return False
    return True


def _one_line(text: str) -> str:
    # A newline would start a new assignment: STATUS text must not be able to say READY=1.
    return " ".join(text.splitlines())


def ready(status: str = "") -> bool:
    """Tell systemd that start-up finished (Type=notify units leave `activating`)."""
    return notify(f"READY=1\nSTATUS={_one_line(status)}" if status else "READY=1")


def stopping() -> bool:
    """Tell systemd that the daemon is shutting down."""
    return notify("STOPPING=1")


def watchdog_ping() -> bool:
    """Reset the watchdog timer (WatchdogSec=)."""
    return notify("WATCHDOG=1")


def status(text: str) -> bool:
    """Set the one-line status shown by `systemctl status`."""
    return notify(f"STATUS={_one_line(text)}")


def watchdog_interval() -> float | None:
    """Seconds between watchdog pings (half the watchdog period), or None if disabled.

    systemd sets WATCHDOG_USEC when the unit has WatchdogSec=; WATCHDOG_PID, when set,
    names the process meant to ping: any other process (a child that inherited the
    environment) gets None.
    """
    try:
        usec = int(os.environ.get("WATCHDOG_USEC", ""))
    except ValueError:
        return None
    if usec <= 0:
        return None
    pid = os.environ.get("WATCHDOG_PID")
    if pid is not None:
        try:
            if int(pid) != os.getpid():
                return None
        except ValueError:
            return None
    return usec / 2_000_000
