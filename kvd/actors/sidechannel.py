"""Side channel: the ZMQ ROUTER on TCP where peer daemons handshake and announce drops.

Each request is decoded and validated (bounded frame size); a malformed one gets an
ErrorReply when it carries a usable identity, and is counted. Handshakes go to the
registrar, region drops to the registrar and the writer (which drains transfers into
the region before the peer frees it). Replies are sent as they complete, so a slow
handshake never blocks the socket.
"""

from __future__ import annotations

from typing import Any

import anyio
import structlog
import zmq
import zmq.asyncio
from anyio.abc import TaskStatus
from kvd_client import wire
from kvd_client.errors import ErrorCode, KvdError, RemoteProtocolError

from kvd.actors.base import Mailbox
from kvd.actors.gateway import salvage_corr, transport_cap
from kvd.actors.messages import AcceptHandshake, DrainRemoteRegion, PeerRegionDropped

log = structlog.get_logger("kvd.sidechannel", actor="sidechannel")


class SideChannel:
    def __init__(
        self,
        *,
        host: str,
        port: int,
        registrar: Mailbox[Any],
        writer: Mailbox[Any],
        max_frame: int,
        counters: dict[str, int],
    ) -> None:
        self.host = host
        self.port = port
        self.registrar = registrar
        self.writer = writer
        self.max_frame = max_frame
        self.counters = counters
        self._sock: zmq.asyncio.Socket | None = None

    def _count(self, key: str) -> None:
        self.counters[key] = self.counters.get(key, 0) + 1

    def bind(self) -> int:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, transport_cap(self.max_frame))
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        if self.port == 0:
            self.port = sock.bind_to_random_port(f"tcp://{self.host}")
        else:
            sock.bind(f"tcp://{self.host}:{self.port}")
        self._sock = sock
        return self.port

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        assert self._sock is not None
        sock = self._sock
        try:
            async with anyio.create_task_group() as tg:
                task_status.started()
                while True:
                    frames = await sock.recv_multipart()
                    if len(frames) != 2:
                        self._count("side_malformed")
                        continue
                    tg.start_soon(self._handle, frames[0], frames[1])
        finally:
            sock.close(0)

    async def _handle(self, ident: bytes, frame: bytes) -> None:
        assert self._sock is not None
        corr = 0
        try:
            corr, msg = wire.decode(frame, self.max_frame)
            if isinstance(msg, wire.Handshake):
                reply: wire.Record = await self.registrar.call(AcceptHandshake(msg))
            elif isinstance(msg, wire.RegionDropped):
                await self.registrar.call(PeerRegionDropped(msg))
                await self.writer.call(DrainRemoteRegion(msg.agent_name, msg.region_id))
                reply = wire.Ok()
            else:
                raise RemoteProtocolError(f"{type(msg).__name__} is not a side-channel request")
        except KvdError as exc:
            corr = corr or salvage_corr(frame)
            self._count("side_rejected")
            log.warning("side_request_rejected", error=exc.message)
            reply = wire.ErrorReply.of(
                exc.code if isinstance(exc.code, ErrorCode) else ErrorCode.PROTOCOL, exc.message
            )
        try:
            await self._sock.send_multipart([ident, wire.encode(reply, corr)])
        except zmq.ZMQError as exc:
            log.warning("side_reply_failed", error=str(exc))
