"""Peer addresses named by untrusted input: checked before anything dials them.

A request that names a peer (a P daemon's side channel, an encoder daemon's EC port)
makes the daemon handshake with it, heartbeat it and probe it. An address that can never
be reached would only fail, again and again, later. So the address is checked at the
door and the request refused at once (INVALID, naming the field):

- the host is an IPv4 or IPv6 literal (IPv6 optionally in brackets, no zone index), or
  a DNS host name by RFC 1123: dot-separated labels of 1 to 63 letters, digits and
  hyphens, not starting or ending with a hyphen, at most 253 characters in all (one
  trailing dot allowed), and a last label that is not all digits (`10.0.0.300` is a
  mistyped address, not a name);
- the port is 1 to 65535 (0 is "any port" when binding, never a peer's port).

Pure functions: no resolver is asked (a name that does not resolve fails its handshake,
once, like an unreachable address).
"""

from __future__ import annotations

import ipaddress
import re
from typing import Final

from kvd_client import wire

MAX_HOST_NAME: Final = 253
_LABEL: Final = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def host_problem(host: str) -> str | None:
    """Why `host` is not a peer host we could dial, or None if it is one."""
    if not host:
        return "is empty"
    if not host.isascii() or not host.isprintable() or any(c.isspace() for c in host):
        return f"{_shown(host)} has spaces, control or non-ASCII characters"
    if len(host) > MAX_HOST_NAME + 1:
        return f"has {len(host)} characters (a host name has at most {MAX_HOST_NAME})"
    bracketed = host.startswith("[") and host.endswith("]")
    literal = host[1:-1] if bracketed else host
    if "%" not in literal:  # zone indexes are per-host: never an address for a peer
        try:
            ipaddress.ip_address(literal)
            return None
        except ValueError:
            pass
    if bracketed or ":" in host or "%" in host:
        return f"{_shown(host)} is not a valid IP address"
    name = host[:-1] if host.endswith(".") else host
    if len(name) > MAX_HOST_NAME:
        return f"has {len(name)} characters (a host name has at most {MAX_HOST_NAME})"
    labels = name.split(".")
    if not all(_LABEL.fullmatch(label) for label in labels):
        return (
            f"{_shown(host)} is neither an IP address nor a host name (RFC 1123: "
            "labels of 1-63 letters, digits and inner hyphens, separated by dots)"
        )
    if labels[-1].isdigit():
        return f"{_shown(host)} is not a valid IP address"
    return None


def port_problem(port: int) -> str | None:
    """Why `port` is not a peer's port, or None if it is one."""
    if not 1 <= port <= 0xFFFF:
        return f"{port} is not a port a peer listens on (1-65535)"
    return None


def address_problem(host: str, port: int, host_field: str, port_field: str) -> str | None:
    """The first problem with a (host, port) pair, naming its field, or None."""
    if (why := host_problem(host)) is not None:
        return f"{host_field} {why}"
    if (why := port_problem(port)) is not None:
        return f"{port_field} {why}"
    return None


def parse_peer_list(text: str) -> list[tuple[str, int]] | str:
    """`host:port` entries separated by commas (`[v6]:port` for IPv6; spaces around an
    entry are ignored; empty: none), in order without repeats, or the first problem."""
    out: list[tuple[str, int]] = []
    for raw in text.split(","):
        entry = raw.strip()
        if not entry:
            continue
        host, sep, port_text = entry.rpartition(":")
        if not sep or not port_text.isdigit():
            return f"{_shown(entry)} is not host:port"
        if (why := host_problem(host)) is not None:
            return f"{_shown(entry)}: the host {why}"
        if (why := port_problem(int(port_text))) is not None:
            return f"{_shown(entry)}: {why}"
        item = (host, int(port_text))
        if item not in out:
            out.append(item)
    return out


_PEER_FIELDS: Final[dict[type[wire.Record], tuple[str, str]]] = {
    wire.Track: ("peer_host", "peer_port"),
    wire.RegisterPush: ("peer_host", "peer_port"),
    wire.Pull: ("peer_host", "peer_port"),
    wire.ECEnsure: ("peer_host", "peer_port"),
    wire.PingPeer: ("host", "port"),
}
"""The client requests that name a peer, and their host and port fields."""


def peer_address_problem(msg: wire.Record) -> str | None:
    """What is wrong with the peer address a client request names (None: nothing, or it
    names no peer), e.g. "Track.peer_host 'not a host' is neither an IP address ..."."""
    fields = _PEER_FIELDS.get(type(msg))
    if fields is None:
        return None
    host_field, port_field = fields
    name = type(msg).__name__
    return address_problem(
        getattr(msg, host_field),
        getattr(msg, port_field),
        f"{name}.{host_field}",
        f"{name}.{port_field}",
    )


def _shown(host: str) -> str:
    """The host quoted for an error message, cut short (it is untrusted input)."""
    return repr(host if len(host) <= 64 else host[:61] + "...")
