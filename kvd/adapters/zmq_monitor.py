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

import contextlib
from collections.abc import Callable
from typing import NoReturn

import zmq
import zmq.asyncio
from zmq.utils.monitor import recv_monitor_message


async def watch_disconnects(
    sock: zmq.asyncio.Socket, on_disconnect: Callable[[], None]
) -> NoReturn:
    """Call `on_disconnect` for every connection `sock` loses, until cancelled."""
    mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        while True:
            event = await recv_monitor_message(mon)
            if event["event"] == zmq.EVENT_DISCONNECTED:
                on_disconnect()
    finally:
        with contextlib.suppress(zmq.ZMQError):  # the socket may be closed already
            sock.disable_monitor()
        mon.close(0)
