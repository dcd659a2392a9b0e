"""Doorbells: a peer's NIXL thread woken by a datagram instead of its next timed poll.

NIXL hands out notifications only when polled (`get_new_notifs`), and its agent gives
no file descriptor to wait on. So an idle daemon's NIXL thread finds a notification at
its next timed poll: after up to `nixl.poll_max_idle_us` (1 ms) once it backed off, twice
on a push's path (D's registration at P, P's PushDone at D) and again wherever a request
waits on its peer. A doorbell removes that wait without polling more often: a daemon
binds a UDP socket on its side channel's address and port (`nixl.doorbell`, and says so
in its handshake, `Handshake.doorbell`); after a notification went out to a peer that
has one, and after a WRITE whose notification the peer will poll, the sending thread
sends it one empty datagram. The woken thread polls at once and stays hot.

A datagram carries nothing: it is never read, only drained, and proves nothing. A
forged or flooded one costs the woken thread a poll: the bell is watched only while the
thread has backed off (a hot thread polls every 100 us anyway), so a flood costs at most
what a hot thread does. A lost one (UDP, a firewall) costs the timed poll, as without a
doorbell. A peer is not rung where it cannot be idle: rung or heard from within `HOT_S`
(a ring wakes its thread, a notification from it means its thread was active: either
way it polls hot for 5 ms after); under load, when threads stay hot, no datagram is sent
at all.
"""

from __future__ import annotations

import contextlib
import os
import queue
import select
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

import structlog

log = structlog.get_logger("kvd.doorbell")

HOT_S: Final = 0.004
"""A peer rung or heard from this recently is polling hot: a ring wakes its thread, and a
notification from it was sent by its thread; either counts as activity there, after which
it polls every 100 us for 5 ms (whether or not our notification had arrived). No ring."""
DRAIN_MAX: Final = 64
"""Datagrams drained per wake-up (the rest wait for the next)."""
_PAYLOAD: Final = b""
_SELECT_FDS: Final = 1024
"""`select` takes descriptors below FD_SETSIZE only; past it, `poll` (ms resolution)."""

Command = Callable[[], None] | None


@dataclass
class BellStats:
    rung: int = 0
    """Datagrams sent to peers."""
    skipped: int = 0
    """Rings not sent: the peer was rung or heard from too recently to be idle."""
    ring_errors: int = 0
    """Datagrams the kernel refused to send (counted, never retried)."""
    wakes: int = 0
    """Waits of the NIXL thread that the bell ended."""
    drained: int = 0
    """Datagrams received (and dropped unread)."""


class Commands:
    """The NIXL thread's command queue. A wait on it may also watch a doorbell: puts
    then signal an eventfd (only while such a wait is on)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._efd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        self._watching = False

    def put(self, cmd: Command) -> None:
        self._q.put(cmd)
        if self._watching:  # (set before the waiter looks at the queue: no lost wake-up)
            with contextlib.suppress(OSError):
                os.eventfd_write(self._efd, 1)

    def get(self, timeout: float) -> Command:
        """The next command within `timeout` seconds (raises queue.Empty)."""
        return self._q.get(timeout=timeout)

    def get_nowait(self) -> Command:
        return self._q.get_nowait()

    def empty(self) -> bool:
        return self._q.empty()

    def wait(self, timeout: float, bell: Doorbell) -> bool:
        """Wait up to `timeout` seconds for a command or the bell; True if the bell rang
        (its datagrams are drained). Commands are left in the queue."""
        fds = [self._efd, bell.fileno()]
        self._watching = True
        try:
            if not self.empty():
                return False
            if max(fds) < _SELECT_FDS:  # (microseconds: the back-off's short waits stay short)
                ready, _, _ = select.select(fds, [], [], timeout)
            else:
                poller = select.poll()
                for fd in fds:
                    poller.register(fd, select.POLLIN)
                ready = [fd for fd, _ in poller.poll(timeout * 1e3)]
        finally:
            self._watching = False
        if self._efd in ready:
            with contextlib.suppress(BlockingIOError):
                os.eventfd_read(self._efd)
        if bell.fileno() in ready:
            bell.drain()
            bell.stats.wakes += 1
            return True
        return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            os.close(self._efd)


class Doorbell:
    """This daemon's doorbell socket, and the peers' to ring (used on the NIXL thread;
    `set_peer` from the event loop: plain dict writes)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._out: dict[int, socket.socket] = {sock.family: sock}
        self._peers: dict[str, tuple[int, tuple[object, ...]]] = {}
        self._active: dict[str, float] = {}
        """When each peer was last rung or heard from."""
        self.stats = BellStats()

    @classmethod
    def bind(cls, host: str, port: int) -> Doorbell | None:
        """A doorbell on UDP host:port (the side channel's: "*" or "" is every IPv4
        address), or None (logged) where that cannot be bound: the daemon then runs
        without one (its peers' notifications wait for its timed polls)."""
        where = "0.0.0.0" if host in ("*", "") else host
        try:
            infos = socket.getaddrinfo(
                where, port, type=socket.SOCK_DGRAM, flags=socket.AI_NUMERICHOST
            )
            family, kind, proto, _, addr = infos[0]
            sock = socket.socket(family, kind, proto)
            try:
                sock.setblocking(False)
                sock.bind(addr)
            except OSError:
                sock.close()
                raise
        except OSError as exc:
            log.warning(
                "doorbell_not_bound",
                address=f"{host}:{port}",
                error=str(exc),
                hint="peers' notifications then wait for this daemon's timed polls "
                "(nixl.poll_max_idle_us); a numeric side_channel.host binds one",
            )
            return None
        return cls(sock)

    def fileno(self) -> int:
        return self._sock.fileno()

    @property
    def port(self) -> int:
        return int(self._sock.getsockname()[1])

    def set_peer(self, peer: str, addr: tuple[int, tuple[object, ...]] | None) -> None:
        """Ring `peer` at (family, sockaddr) from now on, or no more (None)."""
        if addr is None:
            self._peers.pop(peer, None)
            self._active.pop(peer, None)
        else:
            self._peers[peer] = addr

    def peers(self) -> int:
        return len(self._peers)

    def heard(self, peer: str, now: float) -> None:
        """On the NIXL thread: a notification from `peer` was polled at `now`."""
        if peer in self._peers:
            self._active[peer] = now

    def ring(self, peer: str) -> None:
        """On the NIXL thread: one datagram to `peer`'s doorbell, if it has one and may be
        idle (neither rung nor heard from within `HOT_S`)."""
        target = self._peers.get(peer)
        if target is None:
            return
        now = time.monotonic()
        if now - self._active.get(peer, -1.0) < HOT_S:
            self.stats.skipped += 1
            return
        self._active[peer] = now
        family, addr = target
        try:
            out = self._out.get(family)
            if out is None:
                out = socket.socket(family, socket.SOCK_DGRAM)
                out.setblocking(False)
                self._out[family] = out
            out.sendto(_PAYLOAD, addr)
            self.stats.rung += 1
        except OSError:
            self.stats.ring_errors += 1

    def drain(self) -> None:
        for _ in range(DRAIN_MAX):
            try:
                self._sock.recv(1)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # (an ICMP error of an earlier ring, reported here)
                continue
            self.stats.drained += 1

    def close(self) -> None:
        for s in {id(s): s for s in (self._sock, *self._out.values())}.values():
            with contextlib.suppress(OSError):
                s.close()


def peer_address(host: str, port: int) -> tuple[int, tuple[object, ...]] | None:
    """(family, sockaddr) of a numeric host and a port, or None."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM, flags=socket.AI_NUMERICHOST)
    except (OSError, UnicodeError):
        return None
    family, _, _, _, addr = infos[0]
    return int(family), tuple(addr)
