"""Side channel: the ZMQ ROUTER on TCP where peer daemons handshake and announce drops.

Each request is decoded and validated (bounded frame size); a malformed one gets an
ErrorReply when it carries a usable identity, and is counted (`side_rejected`, or
`side_malformed` when it is not one frame) and logged at a bounded rate (`RejectLog`).
Frames above twice `max_frame_bytes` never reach the socket: libzmq drops their
connection, which is only visible as a lost connection (`side_disconnects`, see
`kvd.adapters.zmq_monitor`). Handshakes go to the registrar, region drops to the
registrar and then to the sender and receiver (which drain transfers into the region
before the peer frees it). Trace queries (`kvd trace --peer`, and the clock exchange
after a handshake) are answered here at once from the daemon's stage trace, stamped
with its clock when they arrived and when the answer leaves (`kvd.core.timeline`);
with a shared secret, a query without a valid MAC is refused like a bad handshake
(counted in `auth_rejected`). Replies are sent as they complete, so a slow handshake never
blocks the socket. What is being served at once is bounded in bytes: each frame is
charged twice its size (the frame and what it decodes to) from `limits.handshake_bytes`
before it is decoded, until it is answered (a handshake waits for the registrar, a
region drop for the transfers into the region to drain); one that does not fit is
answered BUSY at once and counted (`limit_handshake_bytes_refused`). One is always
taken while none is held, so a handshake as large as `daemon.max_frame_bytes` passes.

Peers' tier requests (`PeerTierLookup`, `PeerTierPin`, `PeerTierUnpin`: a daemon asking
this one's KV tiers) go to the tiers actor (BUSY when its mailbox is full); their
answers travel back sealed under our session key with the asker when a secret is set.

With a shared secret (a `Keyring`), only the handshake and the trace query (request and
reply, each with its own MAC and nonce) travel bare: a region drop or a tier request must
come sealed under the session key its handshake derived (`kvd.core.peersession`), fresh,
and naming the peer that key belongs to; anything else is refused AUTH and counted
(`side_auth_rejected`, and `auth_rejected_<reason>`).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Final

import anyio
import anyio.abc
import anyio.lowlevel
import structlog
import zmq
import zmq.asyncio
from anyio.abc import TaskStatus
from kvd_client import wire
from kvd_client.errors import AuthError, Busy, ErrorCode, KvdError, RemoteProtocolError

from kvd.actors.base import Mailbox
from kvd.actors.gateway import bind_tcp, salvage_corr, transport_cap
from kvd.actors.messages import AcceptHandshake, PeerRegionDropped, PeerTierRequest
from kvd.adapters.zmq_monitor import watch_disconnects
from kvd.core.limits import PendingBudget, Reservation
from kvd.core.peersession import AuthRefusal, Keyring
from kvd.core.timeline import check_query, make_answer
from kvd.core.trace import NO_TRACE, StageTrace
from kvd.logs import RejectLog

log = structlog.get_logger("kvd.sidechannel", actor="sidechannel")

PEER_TIER: Final = (wire.PeerTierLookup, wire.PeerTierPin, wire.PeerTierUnpin)
"""A peer daemon's requests to this daemon's KV tiers."""


class SideChannel:
    def __init__(
        self,
        *,
        host: str,
        port: int,
        registrar: Mailbox[Any],
        drain_remote: Callable[[str, int], Awaitable[None]],
        max_frame: int,
        counters: dict[str, int],
        rejects: RejectLog,
        agent_name: str = "",
        secret: bytes | None = None,
        trace: StageTrace = NO_TRACE,
        keyring: Keyring | None = None,
        handshake_bytes: int = 64 << 20,
        tiers: Mailbox[Any] | None = None,
    ) -> None:
        self.on_input: Callable[[], None] = _nothing
        """Called on every frame received (the daemon sets it to `NixlEngine.poke`: an
        idle NIXL thread polls quickly again as soon as anything comes in)."""
        self.host = host
        self.budget = PendingBudget(handshake_bytes, name="limits.handshake_bytes")
        """Bytes of the requests being served (see the module docstring)."""
        self.port = port
        self.registrar = registrar
        self.drain_remote = drain_remote
        self.max_frame = max_frame
        self.counters = counters
        self.rejects = rejects
        self.agent_name = agent_name
        self.secret = secret
        self.trace = trace
        self.keyring = keyring
        self.tiers = tiers
        self._sock: zmq.asyncio.Socket | None = None

    def _disconnected(self) -> None:
        # Peers' handshake connections closing, and connections libzmq dropped for a
        # frame above the transport cap: libzmq reports both alike (zmq_monitor).
        self.rejects.reject(
            "sidechannel",
            "side_disconnects",
            "side_connection_lost",
            "disconnected",
            level="info",
        )

    def bind(self) -> int:
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, transport_cap(self.max_frame))
        sock.setsockopt(zmq.ROUTER_MANDATORY, 0)
        self.port = bind_tcp(sock, self.host, self.port, "side_channel.port")
        self._sock = sock
        return self.port

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        assert self._sock is not None
        sock = self._sock
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch_disconnects, sock, self._disconnected)
                task_status.started()
                while True:
                    frames = await sock.recv_multipart()
                    self.on_input()
                    if len(frames) != 2:
                        self.rejects.reject(
                            "sidechannel",
                            "side_malformed",
                            "side_frame_rejected",
                            "multipart",
                            error=f"{len(frames) - 1} frames, expected 1",
                        )
                    else:
                        await self._receive(tg, frames[0], frames[1])
                    # A ready frame is received without suspending: without this, a peer
                    # that keeps the socket busy would starve every other task.
                    await anyio.lowlevel.checkpoint()
        finally:
            sock.close(0)

    async def _receive(self, tg: anyio.abc.TaskGroup, ident: bytes, frame: bytes) -> None:
        """Charge the frame's bytes until it is answered (or refuse it BUSY), then handle
        it: a bad frame here (no task per bad frame), a request in its task (which
        releases the charge when it ends)."""
        cost = 2 * len(frame)
        held = self.budget.reserve(cost, alone_fits=True)
        if held is None:
            self.rejects.reject(
                "sidechannel", "limit_handshake_bytes_refused", "side_request_refused", "bytes"
            )
            busy = Busy(self.budget.why(cost, "a side-channel request"))
            reply = wire.ErrorReply.of(busy.code, busy.message)
            await self._send(ident, reply, salvage_corr(frame))
            return
        handed = False
        try:
            handed = await self._receive_held(tg, ident, frame, held)
        finally:
            if not handed:
                held.release()

    async def _receive_held(
        self, tg: anyio.abc.TaskGroup, ident: bytes, frame: bytes, held: Reservation
    ) -> bool:
        """Whether the request was handed to a task (which then owns `held`)."""
        t1 = self.trace.clock()
        try:
            corr, msg = wire.decode(frame, self.max_frame)
        except RemoteProtocolError as exc:
            await self._refuse(ident, salvage_corr(frame), exc)
            return False
        if isinstance(msg, wire.TraceQuery):  # request/reply with its own MAC and nonce
            await self._trace_query(ident, corr, msg, t1)
            return False
        if not isinstance(msg, (wire.Handshake, wire.RegionDropped, wire.Sealed, *PEER_TIER)):
            why = f"{type(msg).__name__} is not a side-channel request"
            await self._refuse(ident, corr, RemoteProtocolError(why))
            return False
        peer = msg.agent_name if isinstance(msg, PEER_TIER) else ""
        if self.keyring is not None and not isinstance(msg, wire.Handshake):
            opened = self._open(msg)
            if isinstance(opened, AuthRefusal):
                await self._auth_refused(ident, corr, msg, opened)
                return False
            try:
                _, msg = wire.decode(opened[1], self.max_frame)  # authentic: now decode it
            except RemoteProtocolError as exc:
                await self._refuse(ident, corr, exc)
                return False
            refusal = None
            if isinstance(msg, (wire.Sealed, wire.Handshake)):
                refusal = AuthRefusal.NESTED
            elif isinstance(msg, (wire.RegionDropped, *PEER_TIER)) and msg.agent_name != opened[0]:
                refusal = AuthRefusal.WRONG_PEER  # a peer speaks for itself only
            if refusal is not None:
                await self._auth_refused(ident, corr, msg, refusal)
                return False
            peer = opened[0]
        if isinstance(msg, PEER_TIER):
            # a small request, answered from the tiers actor's bounded mailbox: its frame's
            # bytes are given back once it is posted
            await self._tier_request(tg, ident, corr, peer, msg)
            return False
        if not isinstance(msg, (wire.Handshake, wire.RegionDropped)):
            why = f"{type(msg).__name__} is not a side-channel request"
            if isinstance(msg, wire.Sealed):
                why = "a sealed message, but this daemon has no shared secret"
            await self._refuse(ident, corr, RemoteProtocolError(why))
            return False
        tg.start_soon(self._handle, ident, corr, msg, held)
        return True

    async def _tier_request(
        self,
        tg: anyio.abc.TaskGroup,
        ident: bytes,
        corr: int,
        peer: str,
        msg: wire.PeerTierLookup | wire.PeerTierPin | wire.PeerTierUnpin,
    ) -> None:
        if self.tiers is None:
            await self._refuse(ident, corr, RemoteProtocolError("this daemon keeps no KV tiers"))
            return
        req = PeerTierRequest(peer, msg)
        try:
            self.tiers.post(req)
        except Busy as exc:
            await self._refuse(ident, corr, exc)
            return
        tg.start_soon(self._tier_answer, ident, corr, req)

    async def _tier_answer(self, ident: bytes, corr: int, req: PeerTierRequest) -> None:
        try:
            reply = await req.reply
        except KvdError as exc:
            await self._refuse(ident, corr, exc)
            return
        if self.keyring is not None:
            env = self.keyring.seal(req.agent, wire.encode(reply), time.monotonic())
            if env is None:  # its key went meanwhile (the peer was forgotten)
                err = AuthError(f"no session key with {req.agent} any more")
                await self._send(ident, wire.ErrorReply.of(err.code, err.message), corr)
                return
            reply = env
        await self._send(ident, reply, corr)

    def _open(self, msg: wire.Record) -> tuple[str, bytes] | AuthRefusal:
        """(peer, body) of an authentic, fresh envelope, or why not."""
        assert self.keyring is not None
        if not isinstance(msg, wire.Sealed):
            return AuthRefusal.UNSEALED
        return self.keyring.open(msg, time.monotonic())

    async def _auth_refused(
        self, ident: bytes, corr: int, msg: wire.Record, why: AuthRefusal
    ) -> None:
        key = f"auth_rejected_{why.value}"
        self.counters[key] = self.counters.get(key, 0) + 1
        self.rejects.reject(
            "sidechannel",
            "side_auth_rejected",
            "side_request_auth_rejected",
            why.value,
            type=type(msg).__name__,
        )
        err = AuthError(f"side-channel message refused: {why.value}")
        await self._send(ident, wire.ErrorReply.of(err.code, err.message), corr)

    async def _handle(
        self, ident: bytes, corr: int, msg: wire.Handshake | wire.RegionDropped, held: Reservation
    ) -> None:
        try:
            await self._handle_held(ident, corr, msg)
        finally:
            held.release()

    async def _handle_held(
        self, ident: bytes, corr: int, msg: wire.Handshake | wire.RegionDropped
    ) -> None:
        try:
            if isinstance(msg, wire.Handshake):
                reply: wire.Record = await self.registrar.call(AcceptHandshake(msg))
            else:
                await self.registrar.call(PeerRegionDropped(msg))
                await self.drain_remote(msg.agent_name, msg.region_id)
                reply = wire.Ok()
        except KvdError as exc:
            await self._refuse(ident, corr, exc)
            return
        await self._send(ident, reply, corr)

    async def _trace_query(self, ident: bytes, corr: int, q: wire.TraceQuery, t1: int) -> None:
        """Answer at once: our records of the asked requests, and our clock."""
        try:
            check_query(q, self.secret, time.time())
        except AuthError as exc:
            self.rejects.reject(
                "sidechannel",
                "auth_rejected",
                "trace_query_rejected",
                "AuthError",
                peer=q.agent_name,
                error=exc.message,
            )
            await self._send(ident, wire.ErrorReply.of(exc.code, exc.message), corr)
            return
        found = self.trace.lookup(q.request_ids) if q.request_ids else None
        clock = self.trace.clock
        answer = make_answer(self.agent_name, q, found, t1, clock(), self.secret)
        await self._send(ident, answer, corr)

    async def _refuse(self, ident: bytes, corr: int, exc: KvdError) -> None:
        self.rejects.reject(
            "sidechannel",
            "side_rejected",
            "side_request_rejected",
            type(exc).__name__,
            error=exc.message,
        )
        code = exc.code if isinstance(exc.code, ErrorCode) else ErrorCode.PROTOCOL
        await self._send(ident, wire.ErrorReply.of(code, exc.message), corr)

    def limits(self) -> dict[str, int]:
        """`limits.handshake_bytes`: bound, use, peak and refusals, for status."""
        b = self.budget
        return {"limit": b.limit, "used": b.used, "peak": b.peak, "refused": b.refused}

    async def _send(self, ident: bytes, reply: wire.Record, corr: int) -> None:
        assert self._sock is not None
        try:
            await self._sock.send_multipart([ident, wire.encode(reply, corr)])
        except zmq.ZMQError as exc:
            log.warning("side_reply_failed", error=str(exc))


def _nothing() -> None:
    pass
