"""Gateway: the ZMQ ROUTER on ipc:// that local clients (engines, workers, the CLI) talk to.

Rules:
- Every frame is decoded and validated before anything acts on it. A malformed frame gets
  an ErrorReply (PROTOCOL) and is counted; the gateway keeps serving everyone else.
  Rejections are logged through `RejectLog` (rate-limited: a flood is a few lines).
- A request naming a peer address that could never be dialled (`kvd.core.addresses`) is
  refused (INVALID, naming the field) before it is routed: nothing is tracked, retried
  or handshaked for it.
- Frames above twice `max_frame_bytes` are cut off by libzmq with their connection;
  that is only visible as a lost connection (`ipc_disconnects`, `kvd.adapters.zmq_monitor`).
- A session starts with Hello; requests from an unknown identity are refused. At most
  `max_clients` sessions are open at once; `kvd` CLI sessions may use CLI_RESERVE more,
  so the daemon can still be inspected at the limit (roles are declared by the client:
  the reserve is a convenience, not a protection). A Hello beyond it is answered BUSY,
  naming the limit, and counted (`limit_clients_refused`).
- Operator requests (`Drain`, `AbortRequest`: `kvd drain`, `kvd abort`) are taken from
  CLI sessions only and handed to the daemon (`kvd.drain`); CLI sessions, opened by every
  `kvd status`, are logged at debug level.
- Requests are posted to the owning actor's mailbox without blocking: a full mailbox is
  a BUSY reply (a finish, registration or pull refused so is reported to its actor all
  the same, as a notice: D's registration or pull must not wait for a finish refused, a
  track must not heartbeat on for a load refused). Replies are sent
  when the actor resolves the request's future. A worker's `LayersSaved` is one-way:
  never answered, dropped and counted when busy.
- Events go to the session that announced the request and to the engine's workers.
- A session lives on the connection its requests arrive on (ZMQ_SRCFD): when libzmq
  reports that connection lost (the client was killed, or closed its socket without
  Goodbye), the session is closed at once. A session that neither sends nor pings for
  `client_timeout` (daemon time: a stall of the daemon itself does not count; a frozen
  client) is closed too. Either way its regions, leases, pins and requests are
  released by their owners. A session that ends without Goodbye (lost, timed out,
  replaced) tells the registrar its client may be gone, so the staging segments its regions left
  may be removed (by the leftover rule, `kvd.adapters.shm`); after Goodbye, never.
- Closing a session has two phases: it stops taking requests at once, then every owner
  ends what the session announced (a transfer in flight from or into its blocks finishes
  first). Only then is the session *closed*: a keep-alive naming it is answered
  NOT_FOUND, which is what lets its client report its requests failed and its engine
  reuse the blocks. While closing, keep-alives get no answer (the client waits).
- A Hello from an engine rank whose previous process is gone (a restarted engine, its
  old session not yet timed out) closes the old session first, so the new process can
  register its regions at once.
- With the stage trace on, a request is recorded when its frame is decoded
  (`gateway.request`) and its terminal event when it is handed to ZMQ (`gateway.event`).
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import os
import socket
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final

import anyio
import anyio.lowlevel
import msgpack
import structlog
import zmq
import zmq.asyncio
from anyio.abc import TaskStatus
from kvd_client import wire
from kvd_client.errors import (
    Busy,
    ErrorCode,
    InvalidRequest,
    KvdError,
    NotFound,
    RemoteProtocolError,
)

from kvd.actors.base import Clock, Mailbox, StartFailed
from kvd.actors.messages import (
    AbortNotTaken,
    ClientRequest,
    EventOut,
    FinishNotTaken,
    LayersAnnounced,
    LoadNotTaken,
    PingPeerCmd,
    SessionClosed,
    TiersTouched,
    TraceCmd,
)
from kvd.adapters.zmq_monitor import DisconnectWatch
from kvd.core.addresses import peer_address_problem
from kvd.core.trace import NO_TRACE, StageTrace, trace_key
from kvd.logs import RejectLog

log = structlog.get_logger("kvd.gateway", actor="gateway")

ROLES = ("scheduler", "worker", "cli", "tiers")
CLI_RESERVE: Final = 8
"""Sessions of role `cli` allowed beyond `max_clients` (see the module docstring)."""
CLOSED_SESSIONS: Final = 65536
"""Closed session ids remembered (answered NOT_FOUND either way; kept for `kvd status`)."""
NOT_TAKEN_DEPTH: Final = 4
"""A finish, registration or pull refused BUSY is reported to its actor (`FinishNotTaken`,
`LoadNotTaken`), and an abort taken as a notice (`AbortNotTaken`), while fewer than this
many times its mailbox's size wait in it (the notices themselves stay bounded)."""


@dataclass
class _Session:
    session: str
    ident: bytes
    role: str
    engine_id: str
    tp_rank: int
    pid: int
    last_seen: float
    requests: int = 0
    closing: str = ""
    """Why it is closing ("" while open)."""
    fd: int = -1
    """The file descriptor of the connection its requests arrive on (ZMQ_SRCFD)."""


class Gateway:
    def __init__(
        self,
        *,
        socket_path: str,
        socket_mode: int,
        registrar: Mailbox[Any],
        sender: Mailbox[Any],
        receiver: Mailbox[Any],
        ecrouter: Mailbox[Any],
        events: Mailbox[EventOut],
        tiers: Mailbox[Any] | None = None,
        client_timeout: float,
        max_frame: int,
        counters: dict[str, int],
        rejects: RejectLog,
        status: Callable[[str], Awaitable[dict[str, Any]]],
        welcome: Callable[[], wire.Welcome],
        clock: Clock,
        close_bound: float,
        max_clients: int = 1024,
        trace: StageTrace = NO_TRACE,
        admin: Callable[[wire.Record], Awaitable[dict[str, Any]]] | None = None,
    ) -> None:
        self.on_input: Callable[[], None] = _nothing
        """Called on every frame received (the daemon sets it to `NixlEngine.poke`: an
        idle NIXL thread polls quickly again as soon as anything comes in)."""
        self.socket_path = socket_path
        self.socket_mode = socket_mode
        self.registrar = registrar
        self.sender = sender
        self.receiver = receiver
        self.ecrouter = ecrouter
        self.tiers = tiers
        self.events = events
        self.client_timeout = client_timeout
        self.max_frame = max_frame
        self.counters = counters
        self.rejects = rejects
        self._status = status
        self._admin = admin
        self._welcome = welcome
        self.clock = clock
        self.trace = trace
        self.close_bound = close_bound
        self.max_clients = max_clients
        """Longest an owner may take to end a closing session's requests before the
        session is declared closed anyway (and an error logged)."""
        self.sessions: dict[str, _Session] = {}
        self.closing: dict[str, _Session] = {}
        self.closed: OrderedDict[str, None] = OrderedDict()
        self.by_ident: dict[bytes, str] = {}
        self._sock: zmq.asyncio.Socket | None = None
        self._bound: int | None = None
        """The inode of the socket file this daemon bound (None: it bound none)."""
        self._watch: DisconnectWatch | None = None
        self._routes: dict[type[wire.Record], Mailbox[Any]] = {
            wire.RegisterRegion: registrar,
            wire.DeregisterRegion: registrar,
            wire.RegisterPush: receiver,
            wire.Pull: receiver,
            wire.Track: receiver,
            wire.Finish: sender,
            wire.ECAllocate: ecrouter,
            wire.ECCommit: ecrouter,
            wire.ECEnsure: ecrouter,
            wire.ECRelease: ecrouter,
            wire.ECHits: ecrouter,
        }
        if tiers is not None:
            for tier_msg in (
                wire.TierOpen,
                wire.TierLookup,
                wire.TierReserve,
                wire.TierCommit,
                wire.TierPin,
                wire.TierUnpin,
                wire.TierGrant,
                wire.TierPut,
            ):
                self._routes[tier_msg] = tiers

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    # ---------------------------------------------------------------- lifecycle

    def check_free(self) -> None:
        """Refuse to start where another daemon serves our socket (checked first, before
        anything of the node's is touched, and again at `bind`)."""
        path = self.socket_path
        if os.path.exists(path) and _socket_alive(path):
            raise StartFailed(
                "socket_in_use",
                socket=path,
                hint="another kvd daemon is serving this daemon.socket: stop it first, or "
                "give this one its own socket, side_channel.port and tiers.disk_path",
            )

    def bind(self) -> None:
        path = self.socket_path
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        self.check_free()
        if os.path.exists(path):
            os.unlink(path)  # stale file from a crashed daemon
        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, transport_cap(self.max_frame))
        sock.setsockopt(zmq.SNDHWM, 100_000)
        # a client that reopens its socket (same identity) takes the identity over
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        sock.bind(f"ipc://{path}")
        os.chmod(path, self.socket_mode)
        self._sock = sock
        self._bound = os.stat(path).st_ino

    def close(self) -> None:
        """Close the socket and remove its path, if this daemon bound it: a daemon that did
        not start (another serves the socket; a port in use) leaves the path alone. Until
        2026-11-27 it removed it, so a second `kvd serve` with the node's config took the
        serving daemon's socket from its engines and operators."""
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        bound, self._bound = self._bound, None
        if bound is None:
            return
        with contextlib.suppress(FileNotFoundError):
            if os.stat(self.socket_path).st_ino == bound:
                os.unlink(self.socket_path)

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        assert self._sock is not None
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._send_events)
            tg.start_soon(self._sweep)
            self._watch = DisconnectWatch(self._sock, self._disconnected)
            tg.start_soon(self._watch.run)
            self._tg = tg
            task_status.started()
            sock = self._sock
            while True:
                frames = await sock.recv_multipart(copy=False)
                self.on_input()
                if len(frames) != 2:
                    self._reject(
                        frames[0].bytes,
                        "ipc_malformed",
                        "multipart",
                        f"{len(frames) - 1} frames, not 1",
                    )
                else:
                    body = frames[1]
                    self._handle(frames[0].bytes, body.bytes, body.get(zmq.SRCFD))
                # A ready frame is received without suspending: without this, clients
                # that keep the socket busy would starve every other task (replies,
                # events, status calls).
                await anyio.lowlevel.checkpoint()

    # ---------------------------------------------------------------- requests

    def _send(self, ident: bytes, msg: wire.Record, corr: int) -> None:
        # Through the asyncio socket, never a synchronous shadow of it: libzmq's socket
        # fd is edge-triggered, and a send on a shadow can consume the edge that should
        # wake the pending receive (a request then waits for the next frame to arrive).
        if self._sock is None:
            return
        try:
            self._sock.send_multipart([ident, wire.encode(msg, corr)], flags=zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self._count("ipc_send_dropped")
            log.debug("ipc_send_dropped", error=str(exc))

    def _reject(self, ident: bytes, counter: str, kind: str, why: str) -> None:
        """Count a client's bad input under `counter` and log it (rate-limited)."""
        sid = self.by_ident.get(ident, "")
        self.rejects.reject(
            "gateway", counter, "ipc_request_rejected", kind, session=sid, error=why
        )

    def _refuse(self, ident: bytes, corr: int, counter: str, kind: str, exc: KvdError) -> None:
        """Reject a client's bad input and tell it why."""
        self._reject(ident, counter, kind, exc.message)
        self._error(ident, corr, exc)

    def _disconnected(self, fd: int) -> None:
        # Clients closing, and connections libzmq dropped for a frame above the
        # transport cap: libzmq reports both alike (see kvd.adapters.zmq_monitor).
        self.rejects.reject(
            "gateway", "ipc_disconnects", "ipc_connection_lost", "disconnected", level="info"
        )
        # the sessions whose requests came on that connection: their client is gone
        # (killed, or closed its socket without Goodbye); nothing waits for a timeout
        for s in [s for s in self.sessions.values() if s.fd == fd]:
            log.log(_session_level(s.role), "session_disconnected", session=s.session, pid=s.pid)
            self._count("sessions_disconnected")
            self._close(s, "disconnected", client_gone=True)

    def _drain_losses(self) -> None:
        if self._watch is not None:
            self._watch.drain()

    def _tag(self, s: _Session, fd: int) -> bool:
        """Note the connection `s`'s requests arrive on; False if `s` turned out closed.
        A descriptor new to the session may be one libzmq reused after a connection
        was lost: every loss reported so far is handled first, so that a loss is never
        blamed on the connection that took its number."""
        if s.fd == fd:
            return True
        self._drain_losses()
        if self.sessions.get(s.session) is not s:
            return False
        s.fd = fd
        return True

    def _error(self, ident: bytes, corr: int, exc: KvdError) -> None:
        code = exc.code if isinstance(exc.code, ErrorCode) else ErrorCode.INTERNAL
        self._send(ident, wire.ErrorReply.of(code, exc.message), corr)

    def _handle(self, ident: bytes, frame: bytes, fd: int = -1) -> None:
        self._count("ipc_frames")
        try:
            corr, msg = wire.decode(frame, self.max_frame)
        except RemoteProtocolError as exc:
            self._refuse(ident, salvage_corr(frame), "ipc_rejected", type(exc).__name__, exc)
            return
        if self.trace.on and (rid := trace_key(msg)) and not isinstance(msg, wire.GetTrace):
            self.trace.mark(rid, "gateway.request")  # (asking for a trace is not a stage)
        now = self.clock.now()
        if isinstance(msg, wire.KeepAlive):
            s = self.sessions.get(msg.session)
            if s is not None:
                s.last_seen = now
            elif msg.session not in self.closing:
                # closed (everything it announced has ended), or we restarted: the client
                # may now report its requests failed and open a new session
                self._count("keepalives_unknown_session")
                self._error(ident, corr, NotFound(f"unknown session {msg.session!r}"))
            return
        if isinstance(msg, wire.Hello):
            self._hello(ident, corr, msg, now, fd)
            return
        sid = self.by_ident.get(ident)
        s = self.sessions.get(sid) if sid is not None else None
        if s is not None and not self._tag(s, fd):
            s = None
        if s is None:
            why = (
                f"session {sid!r} is closed"
                if sid is not None
                else f"{type(msg).__name__} before Hello"
            )
            self._refuse(ident, corr, "ipc_rejected", "no_session", RemoteProtocolError(why))
            return
        s.last_seen = now
        s.requests += 1
        if isinstance(msg, wire.Goodbye):
            self._close(s, "goodbye", client_gone=False, reply_to=(ident, corr))
            return
        if (problem := peer_address_problem(msg)) is not None:
            refusal = InvalidRequest(problem)
            self._refuse(ident, corr, "requests_invalid_peer", "invalid_peer", refusal)
            return
        if isinstance(msg, (wire.GetStatus, wire.PingPeer, wire.GetTrace)):
            self._tg.start_soon(self._status_request, ident, corr, msg)
            return
        if isinstance(msg, (wire.Drain, wire.AbortRequest)):
            if s.role != "cli":
                why = f"{type(msg).__name__} is an operator request (role cli), not {s.role}'s"
                self._refuse(ident, corr, "ipc_rejected", "not_operator", InvalidRequest(why))
                return
            self._tg.start_soon(self._admin_request, ident, corr, msg)
            return
        if isinstance(msg, wire.LayersSaved):
            self._layers_saved(s, msg)
            return
        if isinstance(msg, wire.TierTouch):
            self._tiers_touched(s, msg)
            return
        box = self._routes.get(type(msg))
        if isinstance(msg, wire.Abort):
            box = {"send": self.sender, "recv": self.receiver}.get(msg.side)
            if box is None:
                why = f"Abort side must be 'send' or 'recv', not {msg.side!r}"
                self._refuse(ident, corr, "ipc_rejected", "bad_abort_side", InvalidRequest(why))
                return
        if box is None:
            why = f"{type(msg).__name__} is not a client request"
            self._refuse(ident, corr, "ipc_rejected", "not_a_request", RemoteProtocolError(why))
            return
        req = ClientRequest(s.session, msg)
        try:
            box.post(req)
        except KvdError as exc:  # Busy
            if isinstance(msg, wire.Abort) and self._not_taken(
                box, AbortNotTaken(s.session, msg.request_id)
            ):
                self._count("aborts_taken_busy")
                self._send(ident, wire.Ok(), corr)
                return
            self._count("ipc_busy")
            self._error(ident, corr, exc)
            if isinstance(msg, wire.Finish):
                self._not_taken(box, FinishNotTaken(msg.request_id, int(exc.code), exc.message))
            elif isinstance(msg, (wire.RegisterPush, wire.Pull)):
                self._not_taken(box, LoadNotTaken(s.session, msg.request_id))
            return
        req.reply.add_done_callback(lambda f: self._reply_done(ident, corr, f))

    def _not_taken(
        self, box: Mailbox[Any], notice: FinishNotTaken | LoadNotTaken | AbortNotTaken
    ) -> bool:
        """A finish, registration or pull refused BUSY: the engine has its error, and the
        actor is told (a notice): on P, so that D's registration or pull for the request
        fails at once; on D, so that a track of it stops heartbeating P's lease. An abort
        that found the mailbox full is taken as a notice instead (answered Ok). Bounded:
        past `NOT_TAKEN_DEPTH` times the mailbox's size waiting in it, the notice is
        dropped and counted (the request then ends at the other side's own bounds; an
        abort is answered BUSY). True if it was posted."""
        if box.depth() >= NOT_TAKEN_DEPTH * box.size:
            self._count("refusals_unrecorded")
            return False
        box.post(notice)
        return True

    def _layers_saved(self, s: _Session, msg: wire.LayersSaved) -> None:
        """A one-way notice: never answered (the worker does not wait on its forward pass);
        dropped and counted when the sender is busy (P's finish writes what it named)."""
        if s.role != "worker" or s.engine_id != msg.engine_id or s.tp_rank != msg.tp_rank:
            why = f"LayersSaved for {msg.engine_id!r} rank {msg.tp_rank} from a {s.role} session"
            self._reject(s.ident, "ipc_rejected", "layers_not_from_rank", why)
            return
        try:
            self.sender.post(LayersAnnounced(s.session, msg))
        except KvdError:
            self._count("layer_notices_dropped")

    def _tiers_touched(self, s: _Session, msg: wire.TierTouch) -> None:
        """A one-way notice: never answered (the client does not wait after its copies);
        dropped and counted when the tiers actor is busy (only recency is lost)."""
        if self.tiers is None:
            why = "TierTouch to a daemon that keeps no KV tiers"
            self._reject(s.ident, "ipc_rejected", "no_tiers", why)
            return
        try:
            self.tiers.post(TiersTouched(s.session, msg))
        except KvdError:
            self._count("tier_touches_dropped")

    def _reply_done(self, ident: bytes, corr: int, fut: asyncio.Future[wire.Record]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is None:
            self._send(ident, fut.result(), corr)
        elif isinstance(exc, KvdError):
            self._error(ident, corr, exc)
        else:
            log.error("request_crashed", error=repr(exc))
            self._error(ident, corr, KvdError(f"internal error: {type(exc).__name__}"))

    def _hello(self, ident: bytes, corr: int, msg: wire.Hello, now: float, fd: int = -1) -> None:
        if msg.role not in ROLES:
            why = f"unknown role {msg.role!r}"
            self._refuse(ident, corr, "ipc_rejected", "unknown_role", RemoteProtocolError(why))
            return
        self._drain_losses()  # (see `_tag`)
        if msg.session in self.closing or msg.session in self.closed:
            self._count("ipc_rejected")
            self._error(ident, corr, NotFound(f"session {msg.session!r} was closed"))
            return
        old = self.sessions.get(msg.session)
        if old is not None and old.ident != ident:
            self.by_ident.pop(old.ident, None)
        if old is None and msg.role != "cli" and msg.engine_id:
            for other in list(self.sessions.values()):
                if (
                    (other.role, other.engine_id, other.tp_rank)
                    == (msg.role, msg.engine_id, msg.tp_rank)
                    and other.pid != msg.pid
                    and not _pid_alive(other.pid)
                ):
                    log.warning(
                        "session_replaced",
                        session=other.session,
                        by=msg.session,
                        engine_id=msg.engine_id,
                        tp_rank=msg.tp_rank,
                        old_pid=other.pid,
                    )
                    self._count("sessions_replaced")
                    self._close(other, "replaced: its process is gone", client_gone=True)
        if old is None and (full := self._full(msg.role)) is not None:
            self._refuse(ident, corr, "limit_clients_refused", "max_clients", Busy(full))
            return
        s = _Session(msg.session, ident, msg.role, msg.engine_id, msg.tp_rank, msg.pid, now)
        s.fd = fd
        self.sessions[msg.session] = s
        self.by_ident[ident] = msg.session
        if old is None:
            self._count("sessions_opened")
            log.log(
                _session_level(msg.role),
                "session_opened",
                session=msg.session,
                role=msg.role,
                engine_id=msg.engine_id,
                tp_rank=msg.tp_rank,
                pid=msg.pid,
            )
        self._send(ident, self._welcome(), corr)

    async def _admin_request(
        self, ident: bytes, corr: int, msg: wire.Drain | wire.AbortRequest
    ) -> None:
        try:
            if self._admin is None:
                raise InvalidRequest("this daemon takes no operator requests")
            data = await self._admin(msg)
            self._send(ident, wire.StatusReply(wire.plain(data)), corr)
        except KvdError as exc:
            self._error(ident, corr, exc)

    def _full(self, role: str) -> str | None:
        """Why a new session of `role` is refused (the client limit), or None."""
        limit = self.max_clients + (CLI_RESERVE if role == "cli" else 0)
        if len(self.sessions) < limit:
            return None
        return (
            f"limits.max_clients reached: {len(self.sessions)} client sessions open "
            f"(limit {self.max_clients}, and {CLI_RESERVE} more for kvd CLI sessions)"
        )

    def limits(self) -> dict[str, Any]:
        """The client limit, its use (every session, this status call's own included)
        and its refusals, for `kvd status`."""
        return {
            "limit": self.max_clients,
            "used": len(self.sessions),
            "refused": self.counters.get("limit_clients_refused", 0),
        }

    async def _status_request(
        self, ident: bytes, corr: int, msg: wire.GetStatus | wire.PingPeer | wire.GetTrace
    ) -> None:
        try:
            if isinstance(msg, wire.GetStatus):
                data = await self._status(msg.section)
            elif isinstance(msg, wire.GetTrace):
                data = await self.registrar.call(TraceCmd(msg.request_id, msg.peer, msg.timeout))
            else:
                data = await self.registrar.call(PingPeerCmd(msg.host, msg.port, msg.timeout))
            self._send(ident, wire.StatusReply(wire.plain(data)), corr)
        except KvdError as exc:
            self._error(ident, corr, exc)

    # ---------------------------------------------------------------- sessions and events

    def _close(
        self,
        s: _Session,
        why: str,
        *,
        client_gone: bool,
        reply_to: tuple[bytes, int] | None = None,
    ) -> None:
        """Stop taking the session's requests now; it is closed once its owners ended
        everything it announced (see the module docstring). `client_gone`: closed without
        the client's goodbye (see `SessionClosed`)."""
        self.sessions.pop(s.session, None)
        s.closing = why
        self.closing[s.session] = s
        self._count("sessions_closed")
        log.log(_session_level(s.role), "session_closing", session=s.session, reason=why)
        self._tg.start_soon(self._end_session, s, client_gone, reply_to)

    async def _end_session(
        self, s: _Session, client_gone: bool, reply_to: tuple[bytes, int] | None
    ) -> None:
        calls: list[SessionClosed] = []
        if s.role != "cli":
            boxes = [self.registrar, self.sender, self.receiver, self.ecrouter]
            if self.tiers is not None:
                boxes.append(self.tiers)
            for box in boxes:
                call = SessionClosed(
                    s.session, client_gone, timed_out=s.closing == "timeout", pid=s.pid
                )
                box.post(call)  # a notice between actors: never refused
                calls.append(call)
        with anyio.move_on_after(self.close_bound) as scope:
            for call in calls:
                await call.reply
        if scope.cancelled_caught:
            self._count("session_close_overdue")
            log.error("session_close_overdue", session=s.session, bound_s=self.close_bound)
        self.closing.pop(s.session, None)
        if self.by_ident.get(s.ident) == s.session:
            del self.by_ident[s.ident]
        self.closed[s.session] = None
        while len(self.closed) > CLOSED_SESSIONS:
            self.closed.popitem(last=False)
        log.log(_session_level(s.role), "session_closed", session=s.session, reason=s.closing)
        if reply_to is not None:
            self._send(reply_to[0], wire.Ok(), reply_to[1])

    async def _sweep(self) -> None:
        while True:
            await anyio.sleep(min(1.0, self.client_timeout / 4))
            cutoff = self.clock.now() - self.client_timeout
            for s in [s for s in self.sessions.values() if s.last_seen < cutoff]:
                log.warning("session_timed_out", session=s.session, role=s.role, pid=s.pid)
                self._close(s, "timeout", client_gone=True)

    async def _send_events(self) -> None:
        async for ev in self.events:
            sent = False
            if self.trace.on and (rid := trace_key(ev.record)):
                self.trace.mark(rid, "gateway.event")
            owner = self.sessions.get(ev.session)
            if owner is not None:
                self._send(owner.ident, ev.record, 0)
                sent = True
            for s in self.sessions.values():
                if s.role == "worker" and s.engine_id == ev.engine_id and s.session != ev.session:
                    self._send(s.ident, ev.record, 0)
            self._count("events_sent" if sent else "events_orphaned")

    def client_counts(self) -> dict[str, int]:
        """Open sessions per role; safe from another thread (one list copy under the GIL,
        then reads of immutable strings): the metrics exporter calls it."""
        out: dict[str, int] = {}
        for s in list(self.sessions.values()):
            out[s.role] = out.get(s.role, 0) + 1
        return out

    def snapshot(self) -> dict[str, Any]:
        now = self.clock.now()
        return {
            "closing": [
                {"session": s.session, "role": s.role, "reason": s.closing}
                for s in self.closing.values()
            ],
            "sessions": [
                {
                    "session": s.session,
                    "role": s.role,
                    "engine_id": s.engine_id,
                    "tp_rank": s.tp_rank,
                    "pid": s.pid,
                    "idle_s": round(now - s.last_seen, 3),
                    "requests": s.requests,
                }
                for s in self.sessions.values()
            ],
        }


def _session_level(role: str) -> int:
    """CLI sessions come and go with every `kvd status` (`watch kvd status`): debug, not
    info, so they do not flood the log; engines' sessions are worth an info line."""
    return logging.DEBUG if role == "cli" else logging.INFO


def transport_cap(max_frame: int) -> int:
    """ZMQ's own limit (MAXMSGSIZE) for a socket whose frames may be `max_frame` bytes.

    Above it the transport drops the connection before buffering the frame, so nobody
    can make the daemon hold a huge message. It is twice the frame limit so that a frame
    somewhat over the limit still reaches the decoder: it is refused with a PROTOCOL
    reply and counted, instead of vanishing with its connection.
    """
    return 2 * max_frame


def bind_tcp(sock: zmq.Socket[Any], host: str, port: int, setting: str) -> int:
    """Bind `sock` to tcp://host:port (port 0: a free one); returns the port. An address
    this host cannot bind (the port in use, by another daemon or a process that has not
    let it go yet; a host address that is not this host's) is a start failure with one
    clear line naming `setting`, not a crash."""
    try:
        if port == 0:
            return int(sock.bind_to_random_port(f"tcp://{host}"))
        sock.bind(f"tcp://{host}:{port}")
    except zmq.ZMQError as exc:
        raise StartFailed(
            "bind_failed",
            setting=setting,
            address=f"{host}:{port}",
            error=str(exc),
            hint=f"{setting} must be an address of this host that no other process holds "
            "(another kvd daemon with the same config: give each its own socket, ports "
            "and tiers.disk_path). Under systemd the daemon is started again (RestartSec).",
        ) from exc
    return port


def salvage_corr(frame: bytes) -> int:
    """The correlation id of a frame that failed to decode, if its header is intact, else 0.

    Echoing it lets the sender's wait for that reply end with the typed error instead of a
    timeout. Reads at most the first three items, each bounded: cheap on any input.
    """
    try:
        unpacker = msgpack.Unpacker(
            io.BytesIO(frame),
            read_size=64,
            max_buffer_size=1024,
            max_str_len=64,
            max_bin_len=64,
            max_array_len=16,
            max_map_len=16,
            max_ext_len=0,
        )
        if unpacker.read_array_header() < 3:
            return 0
        corr = [unpacker.unpack() for _ in range(3)][2]
    except Exception:  # anything unparseable simply has no corr
        return 0
    if isinstance(corr, int) and not isinstance(corr, bool) and 0 < corr < (1 << 64):
        return corr
    return 0


def _pid_alive(pid: int) -> bool:
    """Is there a process `pid` (in our pid namespace)? Unknown (0) counts as alive."""
    if pid <= 0:
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _socket_alive(path: str) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(path)
        return True
    except OSError:
        return False
    finally:
        s.close()


def _nothing() -> None:
    pass
