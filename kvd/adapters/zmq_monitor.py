"""Connections a ZMQ socket lost, from libzmq's socket monitor.

Sockets that take untrusted input cap frames with ZMQ_MAXMSGSIZE, so a peer cannot make
the daemon buffer a huge frame: libzmq reads the frame's header, sees the size and
drops the connection. What libzmq 4.3.5 (pyzmq 27.3, no draft API) reports for that,
measured on a ROUTER over tcp:// and ipc://: EVENT_DISCONNECTED, whose value is the
connection's file descriptor; nothing else (no HANDSHAKE_FAILED_* event: the handshake
had succeeded, and the frame never reaches the socket). A peer that simply closes its
connection produces exactly the same event with the same kind of value. The
distinguishing options (ZMQ_ROUTER_NOTIFY, ZMQ_DISCONNECT_MSG) are draft API, absent
from this build. So the daemon cannot count oversized frames as such: it counts every
lost connection, and the oversized frames are among them.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import NoReturn, cast

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message


class DisconnectWatch:
    """The connections a socket loses, each reported with its file descriptor (the value
    libzmq gives EVENT_DISCONNECTED), to `on_disconnect`: as they come (`run`), and on
    demand (`drain`, synchronous). libzmq reuses a closed connection's descriptor at
    once for the next one, so a caller that maps messages to connections by descriptor
    (ZMQ_SRCFD) drains before it trusts a descriptor it has not seen for a client: every
    loss reported so far is then handled first (libzmq reports a loss before it closes
    the descriptor, so before a new connection can be accepted on the same number)."""

    def __init__(self, sock: zmq.asyncio.Socket, on_disconnect: Callable[[int], None]) -> None:
        self._sock = sock
        self._mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._on = on_disconnect

    def drain(self) -> None:
        """Report every loss queued so far, without waiting."""
        while True:
            # a future that is done at once (NOBLOCK): the frames, or zmq.Again
            fut = cast("asyncio.Future[list[bytes]]", self._mon.recv_multipart(zmq.NOBLOCK))
            if not fut.done():
                fut.cancel()
                return
            if fut.exception() is not None:  # zmq.Again: nothing more
                return
            event = parse_monitor_message(fut.result())
            if event["event"] == zmq.EVENT_DISCONNECTED:
                self._on(int(event["value"]))

    async def run(self) -> NoReturn:
        """Report losses as they come, until cancelled; then stop monitoring."""
        try:
            while True:
                await self._mon.poll()
                self.drain()
        finally:
            with contextlib.suppress(zmq.ZMQError):  # the socket may be closed already
                self._sock.disable_monitor()
            self._mon.close(0)


async def watch_disconnects(
    sock: zmq.asyncio.Socket, on_disconnect: Callable[[], None]
) -> NoReturn:
    """Call `on_disconnect` for every connection `sock` loses, until cancelled."""
    await DisconnectWatch(sock, lambda fd: on_disconnect()).run()
