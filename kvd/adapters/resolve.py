"""Host names resolved off libzmq's I/O thread.

libzmq resolves the host name of a `tcp://` endpoint in its I/O thread, synchronously
(getaddrinfo), when the socket connects and again at every reconnect. A context has one
I/O thread, and the daemon's one context carries every socket it has: the IPC socket of
every engine, the side channel, the EC router. So one slow lookup (a name whose DNS
server does not answer, a resolver timing out) stalls all of them: measured, 100 pulls
from one engine naming 100 unknown P hosts held another engine's Hello for 5-20 s while
the I/O thread worked through the lookups, and a reconnect to a dead peer by name would
repeat its lookup every reconnect interval.

So the daemon hands libzmq numeric addresses only: a name is resolved here, in a thread
of a small pool of the resolver's own, bounded by the caller's timeout (a lookup still
queued then is cancelled; one under way is left to end in its thread), and cached for
a while (`ttl`), so that a hot path (a producer's address on an EC fetch) can use a
known address without waiting. A name that cannot be resolved is `Unresolved`, a
transfer error of that peer only. Not asyncio's default executor: the event loop's close
joins it, so a daemon asked to stop would wait for every lookup in it (measured: 300
pulls naming hosts being looked up held a stopping daemon over 30 s).
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final

import anyio
import zmq
from kvd_client.errors import TransferError

TTL_S: Final = 30.0
"""Seconds a resolved name is used before it is resolved again."""
CACHE_MAX: Final = 4096
"""Names kept; beyond it the oldest go (a client may name any host)."""
LOOKUP_THREADS: Final = 4
"""Lookups under way at once (the rest queue, each within its caller's timeout)."""


class Unresolved(TransferError):
    """A peer's host name has no address (or its lookup took too long)."""


def literal(host: str) -> str | None:
    """`host` if it is a numeric IPv4 or IPv6 address, else None."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return None
    return host


def endpoint(address: str, port: int) -> str:
    """The `tcp://` endpoint of a numeric address (IPv6 in brackets)."""
    return f"tcp://[{address}]:{port}" if ":" in address else f"tcp://{address}:{port}"


def connect(sock: zmq.Socket[Any], address: str, port: int) -> None:
    """Connect `sock` to a numeric address (IPv6 only with the socket's ZMQ_IPV6 on)."""
    if ":" in address:
        sock.setsockopt(zmq.IPV6, 1)
    sock.connect(endpoint(address, port))


class Resolver:
    """Numeric addresses for host names (see the module doc)."""

    def __init__(self, ttl: float = TTL_S) -> None:
        self.ttl = ttl
        self._cache: dict[str, tuple[str, float]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self.lookups = 0
        self.failures = 0

    def stats(self) -> dict[str, int]:
        """Lookups made (cache misses), those that failed, names cached (`kvd status`)."""
        return {"lookups": self.lookups, "failures": self.failures, "cached": len(self._cache)}

    def cached(self, host: str, *, stale_ok: bool = False) -> str | None:
        """The address of `host` known now (a literal, or resolved within `ttl`; with
        `stale_ok`, resolved at any time)."""
        if (lit := literal(host)) is not None:
            return lit
        got = self._cache.get(host)
        if got is None or (not stale_ok and time.monotonic() - got[1] > self.ttl):
            return None
        return got[0]

    async def resolve(self, host: str, timeout: float) -> str:  # noqa: ASYNC109
        """The address of `host` (cached, or looked up in a worker thread within
        `timeout`); raises `Unresolved`."""
        known = self.cached(host)
        if known is not None:
            return known
        self.lookups += 1
        try:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(LOOKUP_THREADS, thread_name_prefix="kvd-resolve")
            lookup = functools.partial(socket.getaddrinfo, host, None, type=socket.SOCK_STREAM)
            with anyio.fail_after(timeout):
                infos = await asyncio.get_running_loop().run_in_executor(self._pool, lookup)
        except TimeoutError:
            self.failures += 1
            raise Unresolved(f"no address for {host!r} within {timeout:g}s") from None
        except (OSError, UnicodeError, ValueError) as exc:  # (a name IDNA cannot encode)
            self.failures += 1
            raise Unresolved(f"no address for {host!r}: {exc}") from None
        addrs = [str(info[4][0]) for info in infos if info[0] in (socket.AF_INET, socket.AF_INET6)]
        if not addrs:
            self.failures += 1
            raise Unresolved(f"no IPv4 or IPv6 address for {host!r}")
        address = next((a for a in addrs if ":" not in a), addrs[0])  # IPv4 first
        if len(self._cache) >= CACHE_MAX:
            self._cache.pop(next(iter(self._cache)))
        self._cache[host] = (address, time.monotonic())
        return address
