"""Peer link: request/reply to peer daemons' side channels, for the tiers actor.

One ZMQ DEALER per peer (agent and address), kept open while the peer is known there
(ZMQ reconnects by itself when the peer restarts; `forget` closes the sockets of a peer
forgotten or moved to another address, which ZMQ would otherwise redial for good), with
ZMQ_IMMEDIATE: a message is queued only on a completed connection, so a
request to a peer that is down fails at once (`PeerUnreachable`) instead of waiting in a
queue for its timeout. A reader task per socket matches replies to requests by their
correlation id; a reply nobody waits for any more (its request timed out) goes to
`on_late` (the tiers actor unpins what a late pin answer pinned for it).

With a shared secret (a `Keyring`), every request goes sealed under the session key of
the peer's handshake (no key yet: `PeerUnreachable`, the caller handshakes first), and
a reply is taken only sealed under that peer's key (`Keyring.open` with the peer the
socket belongs to) or as a bare `ErrorReply` (a refusal: it only ends the wait early).
Anything else is dropped and counted (`tiers_peer_auth_rejected`); its request then
times out, as a forged answer must not be taken for a real one. Malformed replies are
dropped and counted too (`tiers_peer_bad_answers`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.abc
import structlog
import zmq
import zmq.asyncio
from anyio.abc import TaskStatus
from kvd_client import wire
from kvd_client.errors import RemoteProtocolError, Timeout, TransferError

from kvd.adapters.resolve import Resolver, connect
from kvd.core.peersession import AuthRefusal, Keyring
from kvd.logs import RejectLog

log = structlog.get_logger("kvd.peerlink", actor="tiers")


PREPARE_RESOLVE_S = 5.0
"""How long a peer's host name may take to resolve when its connection is made ahead."""


class PeerUnreachable(TransferError):
    """No connection to the peer (or no session key with it yet): nothing was sent."""


@dataclass
class _Conn:
    sock: zmq.asyncio.Socket
    reader: anyio.CancelScope
    """Its reader task's scope: cancelled before the socket is closed."""


class PeerLink:
    def __init__(
        self,
        *,
        keyring: Keyring | None,
        max_frame: int,
        frame_cap: int,
        on_late: Callable[[str, wire.Record], None],
        counters: dict[str, int],
        rejects: RejectLog,
        resolver: Resolver | None = None,
    ) -> None:
        self.keyring = keyring
        self.resolver = resolver or Resolver()
        """Peers' host names, resolved off libzmq's I/O thread (`kvd.adapters.resolve`)."""
        self.max_frame = max_frame
        self.frame_cap = frame_cap
        """ZMQ_MAXMSGSIZE: libzmq drops a connection that sends a bigger frame."""
        self.on_late = on_late
        self.counters = counters
        self.rejects = rejects
        self._socks: dict[tuple[str, str], _Conn] = {}
        """By (agent, "address:port"): a reply is taken as the agent's that the socket is
        for (and, with a secret, only sealed under its key)."""
        self._waiting: dict[int, tuple[str, asyncio.Future[wire.Record]]] = {}
        self._tg: anyio.abc.TaskGroup | None = None

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                task_status.started()
                await anyio.sleep_forever()
        finally:
            self.close()

    def close(self) -> None:
        for conn in self._socks.values():
            conn.reader.cancel()
            conn.sock.close(0)
        self._socks.clear()
        for _, fut in self._waiting.values():
            if not fut.done():
                fut.cancel()
        self._waiting.clear()

    def prepare(self, agent: str, host: str, port: int) -> None:
        """Connect ahead of the first request (ZMQ_IMMEDIATE refuses sends until the
        connection is up); a host name not resolved yet is resolved first, in a task."""
        if self.resolver.cached(host, stale_ok=True) is None:
            assert self._tg is not None
            self._tg.start_soon(self._prepare_resolved, agent, host, port)
            return
        self._sock(agent, host, port)

    async def _prepare_resolved(self, agent: str, host: str, port: int) -> None:
        with contextlib.suppress(TransferError):  # (its next request fails unreachable)
            await self.resolver.resolve(host, PREPARE_RESOLVE_S)
            self._sock(agent, host, port)

    def sockets(self) -> int:
        """Sockets open to peers (`kvd tiers`)."""
        return len(self._socks)

    def forget(self, agent: str, keep: tuple[str, int] | None = None) -> int:
        """Close `agent`'s sockets but the one to `keep` (its host and port now; None: all,
        the peer is gone). Requests waiting on them end at their timeouts. Returns how
        many were closed (counted as `tiers_peer_sockets_closed`)."""
        kept = None
        if keep is not None:
            address = self.resolver.cached(keep[0], stale_ok=True)
            kept = f"{address}:{keep[1]}" if address is not None else None
        gone = [k for k in self._socks if k[0] == agent and k[1] != kept]
        for k in gone:
            conn = self._socks.pop(k)
            conn.reader.cancel()
            conn.sock.close(0)
            self._count("tiers_peer_sockets_closed")
        return len(gone)

    def _sock(self, agent: str, host: str, port: int) -> zmq.asyncio.Socket:
        # (`ask` resolved it just now; a `tell` follows an `ask`: an unpin after its pin)
        address = self.resolver.cached(host, stale_ok=True)
        if address is None:
            raise PeerUnreachable(f"{agent} at {host}:{port}: its host name is not resolved")
        # one socket per address, not per name: a name that resolves elsewhere now (a
        # peer restarted on another address) gets a socket to where it is
        addr = f"{address}:{port}"
        conn = self._socks.get((agent, addr))
        if conn is None:
            sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IMMEDIATE, 1)
            sock.setsockopt(zmq.MAXMSGSIZE, self.frame_cap)
            sock.setsockopt(zmq.SNDHWM, 1024)
            connect(sock, address, port)
            conn = self._socks[(agent, addr)] = _Conn(sock, anyio.CancelScope())
            assert self._tg is not None
            self._tg.start_soon(self._read, agent, conn)
        return conn.sock

    def _frame(self, agent: str, msg: wire.Record, corr: int) -> bytes:
        if self.keyring is None:
            return wire.encode(msg, corr)
        env = self.keyring.seal(agent, wire.encode(msg), time.monotonic())
        if env is None:
            raise PeerUnreachable(f"no session key with {agent} (no handshake yet)")
        return wire.encode(env, corr)

    def _send(self, agent: str, host: str, port: int, msg: wire.Record, corr: int) -> None:
        frame = self._frame(agent, msg, corr)
        sock = self._sock(agent, host, port)
        try:
            # NOBLOCK on an asyncio socket: queued now or zmq.Again (no connection)
            sent: Any = sock.send(frame, flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            raise PeerUnreachable(f"{agent} at {host}:{port}: {exc}") from None
        failed = sent.exception() if sent.done() else None
        if failed is not None:
            raise PeerUnreachable(f"{agent} at {host}:{port}: {failed}")

    async def ask(
        self,
        agent: str,
        host: str,
        port: int,
        msg: wire.Record,
        timeout: float,  # noqa: ASYNC109 - the wait for the reply, not a cancel scope
    ) -> wire.Record:
        """Send `msg` to `agent`'s side channel and wait up to `timeout` for its reply.
        Raises PeerUnreachable, Timeout, or the peer's error (an `ErrorReply`)."""
        corr = int.from_bytes(os.urandom(6), "little") | 1
        fut: asyncio.Future[wire.Record] = asyncio.get_running_loop().create_future()
        self._waiting[corr] = (agent, fut)
        try:
            with anyio.fail_after(timeout):
                try:
                    await self.resolver.resolve(host, timeout)
                except TransferError as exc:
                    raise PeerUnreachable(f"{agent} at {host}:{port}: {exc.message}") from None
                self._send(agent, host, port, msg, corr)
                reply = await fut
        except TimeoutError:
            raise Timeout(f"no answer from {agent} within {timeout}s") from None
        finally:
            self._waiting.pop(corr, None)
        if isinstance(reply, wire.ErrorReply):
            raise TransferError(f"{agent} refused: {reply.message}")
        return reply

    def tell(self, agent: str, host: str, port: int, msg: wire.Record) -> bool:
        """Send without waiting (its reply is dropped as a late one); False if unsent."""
        try:
            self._send(agent, host, port, msg, int.from_bytes(os.urandom(6), "little") | 1)
        except TransferError:
            return False
        return True

    async def _read(self, agent: str, conn: _Conn) -> None:
        with conn.reader, contextlib.suppress(zmq.ZMQError):
            while True:
                frame = await conn.sock.recv()
                got = self._decode(agent, frame)
                if got is None:
                    continue
                corr, reply = got
                waiting = self._waiting.get(corr)
                if waiting is not None and waiting[0] == agent:
                    if not waiting[1].done():
                        waiting[1].set_result(reply)
                    continue
                self._count("tiers_peer_late_answers")
                self.on_late(agent, reply)

    def _decode(self, agent: str, frame: bytes) -> tuple[int, wire.Record] | None:
        try:
            corr, msg = wire.decode(frame, self.max_frame)
            if self.keyring is not None and not isinstance(msg, wire.ErrorReply):
                opened: tuple[str, bytes] | AuthRefusal = (
                    self.keyring.open(msg, time.monotonic(), agent)
                    if isinstance(msg, wire.Sealed)
                    else AuthRefusal.UNSEALED
                )
                if isinstance(opened, AuthRefusal):
                    self.rejects.reject(
                        "tiers",
                        "tiers_peer_auth_rejected",
                        "tiers_peer_answer_auth_rejected",
                        opened.value,
                        peer=agent,
                    )
                    return None
                _, msg = wire.decode(opened[1], self.max_frame)
                if isinstance(msg, wire.Sealed):
                    raise RemoteProtocolError("a sealed message inside a sealed one")
        except RemoteProtocolError as exc:
            self.rejects.reject(
                "tiers",
                "tiers_peer_bad_answers",
                "tiers_peer_answer_rejected",
                "malformed",
                peer=agent,
                error=exc.message,
            )
            return None
        return corr, msg
