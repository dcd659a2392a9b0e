"""Two hosts on one machine: two network namespaces joined by a veth pair.

A daemon started with `Host.prefix` (`ip netns exec NS ...`) has only its namespace's
loopback and its veth end: with UCX's TCP transport bound to that veth (`Host.ucx_env`,
`nixl.ucx_tls = "tcp"`) every byte between two such daemons crosses the veth, where it can
be cut (`Host.link("down")`) or slowed (`Host.shape`). Without the TCP setting UCX would
still copy between the namespaces with `cma` (same kernel). Engines need no namespace:
they reach their daemon over its IPC socket (a path) and shared memory, which network
namespaces do not separate, as an engine on the daemon's host would.

Used by `kvd chaos --two-hosts` and the two-host tests. Needs root and `ip` (iproute2);
`unavailable()` says why not elsewhere. Namespaces are named per run and always removed
(deleting a namespace deletes the veth end in it).
"""

from __future__ import annotations

import functools
import json
import os
import secrets
import shutil
import subprocess
from dataclasses import dataclass

_IP_TIMEOUT_S = 10.0


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """Run `ip ARGS` (raises CalledProcessError with `check` when it fails)."""
    return subprocess.run(
        ["ip", *args], capture_output=True, text=True, check=check, timeout=_IP_TIMEOUT_S
    )


@functools.cache
def unavailable() -> str | None:
    """Why this machine cannot make network namespaces (tried once for real), or None."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None:
        return "needs the `ip` command (iproute2)"
    name = f"kvd-probe-{secrets.token_hex(3)}"
    probe = ip("netns", "add", name, check=False)
    if probe.returncode != 0:
        return f"`ip netns add` fails here: {probe.stderr.strip()}"
    ip("netns", "del", name, check=False)
    return None


@dataclass
class Host:
    """One namespace and its end of the veth, with address `addr` (/24)."""

    ns: str
    veth: str
    addr: str

    @property
    def prefix(self) -> tuple[str, ...]:
        """Runs the command after it inside this host's namespace."""
        return ("ip", "netns", "exec", self.ns)

    @property
    def ucx_env(self) -> dict[str, str]:
        """UCX over TCP on this host's veth only (set `nixl.ucx_tls = "tcp"` too)."""
        return {"UCX_NET_DEVICES": self.veth, "UCX_TLS": "tcp"}

    def run(self, *args: str) -> subprocess.CompletedProcess[str]:
        return ip("-n", self.ns, *args)

    def link(self, state: str) -> None:
        """Set this host's veth end "up" or "down" (down: the other end loses carrier)."""
        self.run("link", "set", self.veth, state)

    def tc(self, op: str, *args: str) -> None:
        """Change the queueing discipline of this host's veth (its egress)."""
        cmd = [*self.prefix, "tc", "qdisc", op, "dev", self.veth, *args]
        subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=_IP_TIMEOUT_S)

    def shape(self, mbit: float, queue_ms: int) -> None:
        """Hold this host's egress to `mbit` Mbit/s, up to `queue_ms` of it queued (tbf:
        what waits behind bulk bytes, notifications and heartbeats included, is late)."""
        self.tc("replace", "root", "tbf", "rate", f"{mbit:g}mbit", "burst", "32kbit",
                "latency", f"{queue_ms}ms")  # fmt: skip

    def unshape(self) -> None:
        """Back to the veth's own queueing (a no-op when not shaped)."""
        cmd = [*self.prefix, "tc", "qdisc", "del", "dev", self.veth, "root"]
        subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=_IP_TIMEOUT_S)

    def veth_bytes(self) -> tuple[int, int]:
        """(rx, tx) bytes of this host's veth end."""
        info = json.loads(self.run("-s", "-j", "link", "show", self.veth).stdout)[0]
        stats = info["stats64"]
        return int(stats["rx"]["bytes"]), int(stats["tx"]["bytes"])


def pair(prefix: str, net: str) -> tuple[Host, Host]:
    """Two hosts named for this run (nothing made yet: see `create`), `{net}.1` and
    `{net}.2`; interface names fit the kernel's 15 characters."""
    tag = f"{os.getpid() % 100000}{secrets.token_hex(2)}"
    short = prefix[:3]
    return (
        Host(f"{prefix}-{tag}-a", f"{short}a{tag}"[:15], f"{net}.1"),
        Host(f"{prefix}-{tag}-b", f"{short}b{tag}"[:15], f"{net}.2"),
    )


def create(a: Host, b: Host) -> None:
    """Make both namespaces, the veth between them, addresses and links up. On a failure
    what was made is removed before the error goes on."""
    try:
        for h in (a, b):
            ip("netns", "add", h.ns)
        ip("link", "add", a.veth, "netns", a.ns, "type", "veth", "peer", b.veth, "netns", b.ns)
        for h in (a, b):
            h.run("addr", "add", f"{h.addr}/24", "dev", h.veth)
            h.run("link", "set", "lo", "up")
            h.link("up")
    except BaseException:
        remove(a, b)
        raise


def remove(*hosts: Host) -> list[str]:
    """Delete the hosts' namespaces (and so their veth ends); returns those still there."""
    for h in hosts:
        ip("netns", "del", h.ns, check=False)
    listed = ip("netns", "list", check=False).stdout.split()
    return [h.ns for h in hosts if h.ns in listed]
