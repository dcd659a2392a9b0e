"""The thin client: what an engine's scheduler and worker processes use to talk to kvd.

- One DEALER socket on the daemon's ipc:// ROUTER, used only from the caller's thread.
- Scheduler calls (`track`, `register_push`, `pull`, `finished`, `abort`) never wait for
  the daemon: they send and return. Their replies are read by `drain_events`, which
  never blocks either; a refused request becomes a failure event for that request, so
  every announced request still ends in exactly one terminal event.
- `drain_events` returns only events about ids this client announced.
- What the daemon has not read yet waits in the socket's send queue, up to `SEND_QUEUE`
  messages; a call beyond it fails at once, locally (BUSY, "send queue full"): a burst
  is queued, and a frozen daemon costs the engine that much memory at most.
- Setup calls (`connect`, `register_region`, `status`, `ping_peer`) wait for their reply,
  but not for a daemon that is not there: a reply slower than PROBE_AFTER checks that
  the daemon still listens, and `DaemonUnavailable` says why not (no socket, permission
  denied, a stale socket) instead of a timeout.

Sessions (the rule that keeps engine and daemon agreeing on who owns which blocks): a
request announced in a session belongs to that session until the daemon ends it. The
client reports a request failed without the daemon's word only when the daemon can no
longer transfer it:
- the daemon process is gone: the keep-alive thread's connection to it dropped (a
  process that died or shut down closes its sockets; a frozen one does not), or
- the daemon says it no longer knows the session: it answers NOT_FOUND to a keep-alive
  only once it has ended everything the session announced (or it is a new incarnation
  that never knew it).
Anything else (a daemon that is slow, frozen or busy) is waited out: the client never
gives up on a session the daemon still holds, and never opens a second one meanwhile.
After a loss, the next `drain_events` fails what was in flight and opens one new session
without blocking (Hello, then the regions registered again, each answered later); calls
made before it is up fail at once, locally, and reach no daemon.
"""

from __future__ import annotations

import enum
import errno
import itertools
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvd_client import __version__, wire
from kvd_client.ecindex import ECIndexReader
from kvd_client.errors import (
    DaemonUnavailable,
    ErrorCode,
    KvdError,
    ProtocolError,
    Timeout,
    error_from_code,
)
from kvd_client.shm import SharedRegion

Event = (
    wire.SendFinished
    | wire.RecvFinished
    | wire.RecvFailed
    | wire.SendFailed
    | wire.SendExpired
    | wire.ECReady
    | wire.ECUnavailable
)
EVENT_TYPES: Final = (
    wire.SendFinished,
    wire.RecvFinished,
    wire.RecvFailed,
    wire.SendFailed,
    wire.SendExpired,
    wire.ECReady,
    wire.ECUnavailable,
)

__all__ = ["EVENT_TYPES", "Event", "KvdClient", "default_socket_path"]

LOST_REASON: Final = "kvd daemon restarted or died, or ended this session; the transfer was lost"
DOWN_REASON: Final = "kvd daemon unavailable (reconnecting); the request was not sent"
EC_HITS_BATCH: Final = 64
"""Warm hits served from the EC index that are reported to the daemon in one message
(also sent on every `drain_events`)."""
EC_INDEX_RETRY_S: Final = 5.0
"""After the daemon's EC index could not be mapped, how long `ec_read` answers False
before it asks the daemon again."""
REGION_RETRIES: Final = 10
"""Times a region is registered again after a reconnection before the client gives up on
it (one try per second); the daemon then refuses the engine's requests clearly."""


SEND_QUEUE: Final = 65_536
"""Messages a scheduler's or worker's socket holds for a daemon that has not read them
yet (a burst, a busy or frozen daemon; each a few hundred bytes for a request of a few
blocks). libzmq's default, 1,000, failed the last requests of a 1,000-request burst
while the busy daemon read it (`kvd bench --only scale`, about one run in ten)."""

ABORT_RETRY_S: Final = 0.01
"""An abort the daemon refused BUSY is sent again this long after, by a `drain_events`."""

PROBE_AFTER: Final = 0.5
"""Seconds a reply may take before the client checks that the daemon still listens (and
then every second): a reply from a dead daemon is not waited for."""


def daemon_problem(path: str) -> str | None:
    """Why no daemon can be reached at the IPC socket `path`, or None if one listens
    (never blocks). Says what to do: the socket missing, not permitted, or stale."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect(path)
        return None
    except BlockingIOError:
        return None  # listening, its backlog is full
    except OSError as exc:
        if exc.errno in (errno.ENOENT, errno.ENOTDIR):
            return (
                f"no kvd daemon at {path}: is it running? set --socket / $KVD_SOCKET "
                "(vLLM: kvd_socket) to its socket"
            )
        if exc.errno in (errno.EACCES, errno.EPERM):
            return (
                f"permission denied on {path}: run as the daemon's user or group "
                "(daemon.socket_mode), or with sudo"
            )
        if exc.errno == errno.ECONNREFUSED:
            return f"no kvd daemon listens at {path} (the socket file is stale: it died?)"
        return f"cannot reach kvd at {path}: {exc.strerror}"
    finally:
        s.close()


def daemon_listening(path: str) -> bool:
    """Does a process accept connections on the daemon's IPC socket? (never blocks)"""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.setblocking(False)
    try:
        s.connect(path)
        return True
    except BlockingIOError:
        return True  # listening, its backlog is full
    except OSError as exc:
        return exc.errno not in (errno.ECONNREFUSED, errno.ENOENT, errno.ENOTDIR)
    finally:
        s.close()


def default_socket_path() -> str:
    """The daemon's default socket.

    $KVD_SOCKET, else $XDG_RUNTIME_DIR/kvd/kvd.sock, else /run/kvd/kvd.sock.
    """
    if env := os.environ.get("KVD_SOCKET"):
        return env
    if xdg := os.environ.get("XDG_RUNTIME_DIR"):
        return str(Path(xdg) / "kvd" / "kvd.sock")
    return "/run/kvd/kvd.sock"


class _Phase(enum.Enum):
    UP = "up"
    """The session is established: calls go to the daemon."""
    DOWN = "down"
    """The session was lost and no daemon listens yet: calls fail locally."""
    HELLO = "hello"
    """A new session's Hello is on its way: calls fail locally until it is up."""
    REGISTERING = "registering"
    """Welcomed; the regions are being registered again."""


@dataclass
class _Pending:
    kind: str  # "recv", "send", "ec", "abort", "other", "hello", "region"
    request_id: str
    block_ids: tuple[int, ...] = ()
    region: int = -1
    side: str = ""  # an abort's


@dataclass
class _RegionArgs:
    region: SharedRegion | None
    msg: wire.RegisterRegion
    region_id: int = 0
    retries: int = 0
    retry_at: float = 0.0
    ok: bool = True


class KvdClient:
    """A session with the local kvd daemon."""

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        role: str = "scheduler",
        engine_id: str = "",
        tp_rank: int = -1,
        timeout: float = 10.0,
        keepalive_interval: float = 1.0,
    ) -> None:
        self.socket_path = socket_path or default_socket_path()
        self.role = role
        self.engine_id = engine_id
        self.tp_rank = tp_rank
        self.timeout = timeout
        self.keepalive_interval = keepalive_interval
        self.session = self._new_session_id()
        self.welcome: wire.Welcome | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None
        self._corr = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._events: deque[Event] = deque()
        self._announced_recv: dict[str, tuple[int, ...]] = {}
        self._announced_send: set[str] = set()
        self._announced_ec: dict[str, int] = {}
        self._aborts_refused: dict[str, str] = {}
        """Aborts the daemon refused BUSY, by request id (its side): sent again by the
        next `drain_events` at least `ABORT_RETRY_S` later, while the request is open."""
        self._aborts_retry_at = 0.0
        self._regions: list[_RegionArgs] = []
        self._phase = _Phase.DOWN
        self._live_session: str | None = None
        """The session the keep-alive thread pings: set only once the daemon welcomed it."""
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._ka_thread: threading.Thread | None = None
        self.reconnects = 0
        self.sessions_opened = 0
        self._ec_index: ECIndexReader | None = None
        self._ec_index_for = -1
        """The daemon incarnation whose index `_ec_index` maps."""
        self._ec_index_retry = 0.0
        self._ec_hits: list[str] = []
        self.ec_fast_hits = 0
        """Warm hits served by `ec_read` from the daemon's EC index."""
        self.ec_fast_misses = 0
        """`ec_read` calls that found nothing to serve (not cached, other compat, no index)."""
        self.ec_fast_races = 0
        """`ec_read` copies that the daemon changed while they ran (not served)."""

    def _new_session_id(self) -> str:
        return f"{self.role}-{os.getpid()}-{secrets.token_hex(6)}"

    # ---------------------------------------------------------------- connection

    def connect(self, wait_for_daemon: float | None = None) -> wire.Welcome:
        """Open the socket and say Hello (waits for Welcome, up to `timeout`).

        A daemon that is not (yet) listening is waited for up to `wait_for_daemon` seconds
        (default `timeout`; 0 = fail at once): then DaemonUnavailable says why (the
        socket missing, not permitted, stale)."""
        wait = self.timeout if wait_for_daemon is None else wait_for_daemon
        deadline = time.monotonic() + wait
        while (problem := daemon_problem(self.socket_path)) is not None:
            if time.monotonic() >= deadline:
                raise DaemonUnavailable(problem)
            time.sleep(0.05)
        self._open()
        if self._ka_thread is None and self.keepalive_interval > 0:
            self._ka_thread = threading.Thread(
                target=self._keepalive, name="kvd-keepalive", daemon=True
            )
            self._ka_thread.start()
        welcome = self._hello()
        self._welcomed(welcome)
        self._phase = _Phase.UP
        return welcome

    def _open(self) -> None:
        """A fresh DEALER whose routing identity is the session id (the daemon's ROUTER
        hands an identity over to its newest connection, so reopening is safe)."""
        if self._sock is not None:
            self._sock.close(0)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self.session.encode())
        sock.setsockopt(zmq.SNDHWM, SEND_QUEUE)
        sock.connect(f"ipc://{self.socket_path}")
        self._sock = sock
        self.sessions_opened += 1

    def _hello_msg(self) -> wire.Hello:
        return wire.Hello(
            self.session, self.role, self.engine_id, self.tp_rank, os.getpid(), __version__
        )

    def _hello(self) -> wire.Welcome:
        reply = self.request(self._hello_msg())
        if not isinstance(reply, wire.Welcome):
            raise ProtocolError(f"expected Welcome, got {type(reply).__name__}")
        return reply

    def _welcomed(self, welcome: wire.Welcome) -> None:
        self.welcome = welcome
        self._live_session = self.session

    def close(self) -> None:
        """Say goodbye (the daemon releases this session's regions) and close."""
        self._flush_ec_hits()
        self._stop.set()
        self._live_session = None
        self._drop_ec_index()
        if self._sock is not None:
            try:
                if daemon_listening(self.socket_path):  # never wait on a dead daemon
                    self.request(wire.Goodbye(self.session), timeout=min(self.timeout, 2.0))
            except KvdError:
                pass
            self._sock.close(0)
            self._sock = None
        if self._ka_thread is not None:
            self._ka_thread.join(timeout=2.0)
            self._ka_thread = None

    def __enter__(self) -> KvdClient:
        self.connect()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _keepalive(self) -> None:
        """Ping the live session; watch the connection to the daemon (see the module
        docstring). Runs on its own socket and thread; touches only `_lost`."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        sock.connect(f"ipc://{self.socket_path}")
        connected = False
        sent: dict[int, str] = {}  # keep-alive corr -> the session it pinged
        seq = itertools.count(1)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        next_ping = time.monotonic()
        try:
            while not self._stop.is_set():
                wait = max(0.0, next_ping - time.monotonic())
                ready = dict(poller.poll(int(min(wait, 0.2) * 1000)))
                if monitor in ready:
                    ev = recv_monitor_message(monitor)
                    if ev["event"] == zmq.EVENT_CONNECTED:
                        connected = True
                    elif ev["event"] == zmq.EVENT_DISCONNECTED and connected:
                        # the daemon closed its end: it died or shut down, and its NIXL
                        # agent with it. Nothing in flight can complete any more.
                        connected = False
                        if self._live_session is not None:
                            self._lost.set()
                if sock in ready:
                    while sock.poll(0):
                        try:
                            corr, msg = wire.decode(sock.recv())
                        except ProtocolError:
                            continue
                        pinged = sent.pop(corr, None)
                        if (
                            isinstance(msg, wire.ErrorReply)
                            and msg.code == ErrorCode.NOT_FOUND
                            and pinged is not None
                            and pinged == self._live_session
                        ):
                            self._lost.set()  # the daemon ended this session (or never knew it)
                if time.monotonic() < next_ping:
                    continue
                next_ping = time.monotonic() + self.keepalive_interval
                live = self._live_session
                if live is None or not connected:
                    continue
                corr = next(seq)
                sent[corr] = live
                if len(sent) > 64:  # unanswered pings of a frozen daemon: keep the newest
                    del sent[min(sent)]
                try:
                    sock.send(wire.encode(wire.KeepAlive(live), corr), flags=zmq.NOBLOCK)
                except zmq.Again:
                    sent.pop(corr, None)
        finally:
            sock.disable_monitor()
            monitor.close(0)
            sock.close(0)

    # ---------------------------------------------------------------- request/reply

    def request(self, msg: wire.Record, timeout: float | None = None) -> wire.Record:
        """Send and wait for the reply (events that arrive meanwhile are kept).

        After the session was lost, a call waits for no daemon that never heard our Hello:
        it fails at once (DaemonUnavailable, the request was not sent) until a new session
        is on its way, as the scheduler calls do (module docstring)."""
        if self._sock is None:
            raise ProtocolError("not connected")
        if not isinstance(msg, (wire.Hello, wire.Goodbye)):
            if self._lost.is_set():
                self._session_lost()
            if self._phase is _Phase.DOWN:
                self._reopen()  # its Hello goes first on the socket, then this call
                if self._phase is _Phase.DOWN:
                    raise DaemonUnavailable(DOWN_REASON)
        corr = next(self._corr)
        self._sock.send(wire.encode(msg, corr))
        start = time.monotonic()
        deadline = start + (self.timeout if timeout is None else timeout)
        probe_at = start + PROBE_AFTER
        while True:
            now = time.monotonic()
            left = min(deadline, probe_at) - now
            if left <= 0 or not self._sock.poll(int(left * 1000) + 1):
                now = time.monotonic()
                if now >= deadline:
                    raise Timeout(
                        f"no reply from kvd at {self.socket_path} within {timeout or self.timeout}s"
                    )
                if now >= probe_at:  # a slow reply: is anyone still there to send it?
                    probe_at = now + 1.0
                    if (problem := daemon_problem(self.socket_path)) is not None:
                        raise DaemonUnavailable(problem)
                continue
            rcorr, reply = wire.decode(self._sock.recv())
            if rcorr == corr:
                if isinstance(reply, wire.ErrorReply):
                    raise error_from_code(reply.code, reply.message)
                return reply
            self._absorb(rcorr, reply)

    def _send(self, msg: wire.Record, pending: _Pending) -> None:
        if self._sock is None:
            raise ProtocolError("not connected")
        if self._lost.is_set() or self._phase is not _Phase.UP:
            # no live session: nothing is sent, so no daemon will ever act on it
            self._fail(pending, int(ErrorCode.TRANSFER), DOWN_REASON)
            return
        corr = next(self._corr)
        self._pending[corr] = pending
        try:
            self._sock.send(wire.encode(msg, corr), flags=zmq.NOBLOCK)
        except zmq.Again:  # the queue to a frozen daemon is full: never block, never sent
            self._pending.pop(corr, None)
            self._fail(pending, int(ErrorCode.BUSY), "kvd daemon unreachable (send queue full)")

    def _absorb(self, corr: int, msg: wire.Record) -> None:
        """Handle a frame that is not the reply being waited for."""
        if corr == 0:
            if isinstance(msg, EVENT_TYPES):
                self._accept_event(msg)
            return
        p = self._pending.pop(corr, None)
        if p is None:
            return  # a reply to a call made in an earlier session: its request already ended
        if p.kind == "hello":
            self._hello_answered(msg)
        elif p.kind == "region":
            self._region_answered(p.region, msg)
        elif isinstance(msg, wire.ErrorReply):
            # A refused request still ends: turn the refusal into its terminal event.
            self._fail(p, msg.code, msg.message)

    def _announced(self, request_id: str, side: str) -> bool:
        if side == "send":
            return request_id in self._announced_send
        return request_id in self._announced_recv

    def _abort_again(self) -> None:
        """Send the aborts the daemon refused BUSY once more (`_aborts_refused`)."""
        if time.monotonic() < self._aborts_retry_at or self._phase is not _Phase.UP:
            return
        refused, self._aborts_refused = self._aborts_refused, {}
        for rid, side in refused.items():
            if self._announced(rid, side):
                self.abort(rid, side)

    def _fail(self, p: _Pending, code: int, reason: str) -> None:
        """End an announced request that the daemon refused or that was never sent. An
        abort refused BUSY (by the daemon, or by a full send queue) is sent again later,
        while its request is open: the engine waits for the terminal event it hastens."""
        if p.kind == "abort":
            if code == int(ErrorCode.BUSY) and self._announced(p.request_id, p.side):
                if not self._aborts_refused:
                    self._aborts_retry_at = time.monotonic() + ABORT_RETRY_S
                self._aborts_refused[p.request_id] = p.side
        elif p.kind == "ec" and self._announced_ec.get(p.request_id, 0) > 0:
            self._ec_done(p.request_id)
            self._events.append(wire.ECUnavailable(p.request_id, code, reason))
        elif p.kind == "recv" and self._announced_recv.pop(p.request_id, None) is not None:
            self._events.append(wire.RecvFailed(p.request_id, code, reason, p.block_ids))
        elif p.kind == "send" and p.request_id in self._announced_send:
            self._announced_send.discard(p.request_id)
            self._events.append(wire.SendFailed(p.request_id, code, reason))

    def _ec_done(self, mm_hash: str) -> None:
        left = self._announced_ec.get(mm_hash, 0) - 1
        if left > 0:
            self._announced_ec[mm_hash] = left
        else:
            self._announced_ec.pop(mm_hash, None)

    def _accept_event(self, ev: Event) -> None:
        if isinstance(ev, (wire.ECReady, wire.ECUnavailable)):
            if self._announced_ec.get(ev.mm_hash, 0) > 0:
                self._ec_done(ev.mm_hash)
                self._events.append(ev)
            return
        rid = ev.request_id
        if isinstance(ev, (wire.RecvFinished, wire.RecvFailed)):
            announced = self._announced_recv.pop(rid, None) is not None
        else:
            announced = rid in self._announced_send
            self._announced_send.discard(rid)
        # A worker also receives the events of requests its engine's scheduler announced.
        if announced or self.role == "worker":
            self._events.append(ev)

    # ---------------------------------------------------------------- events

    def drain_events(self) -> list[Event]:
        """Every event received so far, without blocking."""
        if self._lost.is_set():
            self._session_lost()
        if self._phase is _Phase.DOWN:
            self._reopen()
        self._flush_ec_hits()
        sock = self._sock
        if sock is not None:
            while True:
                try:
                    frame = sock.recv(flags=zmq.NOBLOCK)
                except zmq.Again:
                    break
                try:
                    corr, msg = wire.decode(frame)
                except ProtocolError:
                    continue
                self._absorb(corr, msg)
        if self._phase is _Phase.REGISTERING:
            self._retry_regions()
        if self._aborts_refused:
            self._abort_again()
        out = list(self._events)
        self._events.clear()
        return out

    def wait_events(self, timeout: float) -> list[Event]:
        """Block up to `timeout` for at least one event.

        For tools and tests: engines use the non-blocking `drain_events`.
        """
        deadline = time.monotonic() + timeout
        while True:
            evs = self.drain_events()
            left = deadline - time.monotonic()
            if evs or left <= 0:
                return evs
            if self._sock is not None:
                self._sock.poll(int(min(left, 0.1) * 1000) + 1)

    def _session_lost(self) -> None:
        """The daemon died or ended our session: nothing in flight can complete any more
        (see the module docstring), so fail it, then open a new session."""
        self._lost.clear()
        self._live_session = None
        self._drop_ec_index()  # the new daemon has a new index; this one is stale
        self._ec_hits.clear()
        for rid, blocks in self._announced_recv.items():
            self._events.append(wire.RecvFailed(rid, int(ErrorCode.TRANSFER), LOST_REASON, blocks))
        for rid in self._announced_send:
            self._events.append(wire.SendFailed(rid, int(ErrorCode.TRANSFER), LOST_REASON))
        for mm_hash, n in self._announced_ec.items():
            for _ in range(n):
                self._events.append(
                    wire.ECUnavailable(mm_hash, int(ErrorCode.TRANSFER), LOST_REASON)
                )
        self._announced_recv.clear()
        self._announced_send.clear()
        self._announced_ec.clear()
        self._aborts_refused.clear()
        self._pending.clear()
        self._phase = _Phase.DOWN

    def _reopen(self) -> None:
        """Start a new session if a daemon listens (never waits: the Welcome and the region
        replies are read by later drains)."""
        if not daemon_listening(self.socket_path):
            return  # still gone: new requests fail locally until a daemon is back
        self.session = self._new_session_id()
        self._open()
        self._phase = _Phase.HELLO
        self._send_setup(self._hello_msg(), _Pending("hello", self.session))

    def _send_setup(self, msg: wire.Record, pending: _Pending) -> None:
        """Send one step of opening a session without waiting (its answer is absorbed)."""
        assert self._sock is not None
        corr = next(self._corr)
        self._pending[corr] = pending
        try:
            self._sock.send(wire.encode(msg, corr), flags=zmq.NOBLOCK)
        except zmq.Again:
            self._pending.pop(corr, None)
            self._phase = _Phase.DOWN  # the new daemon does not take it: start over later

    def _hello_answered(self, msg: wire.Record) -> None:
        if not isinstance(msg, wire.Welcome):
            self._phase = _Phase.DOWN  # refused (e.g. shutting down): try again later
            return
        self._welcomed(msg)
        now = time.monotonic()
        for r in self._regions:
            r.retries, r.retry_at, r.ok = 0, now, False
        self._phase = _Phase.REGISTERING
        self._retry_regions()

    def _retry_regions(self) -> None:
        now = time.monotonic()
        for i, r in enumerate(self._regions):
            if r.ok or r.retry_at > now or r.retries > REGION_RETRIES:
                continue
            r.retries += 1
            r.retry_at = float("inf")  # until answered
            self._send_setup(r.msg, _Pending("region", "", region=i))
        if all(r.ok or r.retries > REGION_RETRIES for r in self._regions):
            self._phase = _Phase.UP
            self.reconnects += 1

    def _region_answered(self, index: int, msg: wire.Record) -> None:
        if index >= len(self._regions):
            return
        r = self._regions[index]
        if isinstance(msg, wire.RegionRegistered):
            r.region_id, r.ok = msg.region_id, True
        else:
            r.retry_at = time.monotonic() + 1.0
        if self._phase is _Phase.REGISTERING:
            self._retry_regions()

    @property
    def outstanding(self) -> int:
        """Requests announced and not yet ended by an event."""
        return (
            len(self._announced_recv) + len(self._announced_send) + sum(self._announced_ec.values())
        )

    # ---------------------------------------------------------------- scheduler API

    def track(
        self,
        request_id: str,
        peer_host: str,
        peer_port: int,
        *,
        remote_engine_id: str = "",
        remote_request_id: str = "",
        remote_incarnation: int = 0,
    ) -> None:
        """D: a request that will load remote KV arrived; heartbeats to P start now.

        It belongs to this session: closing the session (or an `abort`) stops them and
        tells P, which frees the blocks at once."""
        self._send(
            wire.Track(
                request_id,
                self.engine_id,
                peer_host,
                peer_port,
                remote_engine_id,
                remote_request_id,
                remote_incarnation,
            ),
            _Pending("other", request_id),
        )

    def register_push(
        self,
        request_id: str,
        block_ids: Sequence[int],
        peer_host: str,
        peer_port: int,
        *,
        remote_engine_id: str = "",
        remote_request_id: str = "",
        remote_incarnation: int = 0,
        remote_session: str = "",
        num_tokens: int = 0,
    ) -> None:
        """D (push): P will WRITE into these logical blocks; ends in RecvFinished or RecvFailed.

        `remote_incarnation` and `remote_session` (from kv_transfer_params) let the daemons
        fail the request at once if P's daemon restarted, or P's client session ended,
        since the blocks were leased. `num_tokens`: the tokens the blocks receive (what P
        computes); needed where a sliding-window group's block sizes differ."""
        blocks = tuple(block_ids)
        self._announced_recv[request_id] = blocks
        self._send(
            wire.RegisterPush(
                request_id,
                self.engine_id,
                blocks,
                peer_host,
                peer_port,
                remote_engine_id,
                remote_request_id,
                remote_incarnation,
                remote_session,
                num_tokens,
            ),
            _Pending("recv", request_id, blocks),
        )

    def pull(
        self,
        request_id: str,
        block_ids: Sequence[int],
        peer_host: str,
        peer_port: int,
        *,
        remote_request_id: str,
        remote_block_ids: Sequence[int],
        remote_engine_id: str = "",
        remote_incarnation: int = 0,
        remote_session: str = "",
        num_tokens: int = 0,
    ) -> None:
        """D (pull): READ P's blocks into ours; empty lists just tell P to free.
        `num_tokens`: as for `register_push`."""
        blocks = tuple(block_ids)
        self._announced_recv[request_id] = blocks
        self._send(
            wire.Pull(
                request_id,
                self.engine_id,
                blocks,
                peer_host,
                peer_port,
                remote_engine_id,
                remote_request_id,
                tuple(remote_block_ids),
                remote_incarnation,
                remote_session,
                num_tokens,
            ),
            _Pending("recv", request_id, blocks),
        )

    def finished(self, request_id: str, block_ids: Sequence[int], num_tokens: int = 0) -> bool:
        """P: prefill done; the daemon leases these blocks until they are sent. `num_tokens`:
        the tokens they hold (needed where a sliding-window group's block sizes differ).

        Ends in SendFinished, SendFailed or SendExpired. Returns False when it was not sent
        (no live session: it has already ended, SendFailed is queued): then no D should be
        told to fetch it.
        """
        self._announced_send.add(request_id)
        self._send(
            wire.Finish(request_id, self.engine_id, tuple(block_ids), 0.0, num_tokens),
            _Pending("send", request_id),
        )
        return request_id in self._announced_send

    def keep(self, request_id: str, block_ids: Sequence[int], ttl: float | None = None) -> float:
        """D (bidirectional KV): the request finished; keep these logical blocks for the
        next conversational turn, whose P pulls them (this daemon serves the READ and
        acknowledges it only while it still holds them) instead of recomputing.

        A fixed lease of `ttl` seconds (default: the daemon's `decoder_kv_blocks_ttl`)
        that heartbeats do not extend. Ends, exactly once, in SendFinished (pulled: free
        the blocks), SendExpired (nobody pulled them in time: free them) or SendFailed
        (refused, aborted, or this session ended: free them). Returns the wall-clock time
        (`time.time()`) at which they expire, for kv_transfer_params; the daemon's lease
        starts when the request reaches it, so it never ends before that time. Returns 0.0
        when it was not sent (no live session: SendFailed is queued): then no P should be
        told to pull it.
        """
        if ttl is None:
            ttl = self.welcome.decoder_kv_blocks_ttl if self.welcome is not None else 0.0
        if not 0 < ttl <= 86400:
            raise ValueError(
                f"keep: ttl must be in (0, 86400] seconds, got {ttl!r} (a daemon announcing "
                "decoder_kv_blocks_ttl 0 does not keep blocks)"
            )
        expiry = time.time() + ttl
        self._announced_send.add(request_id)
        self._send(
            wire.Finish(request_id, self.engine_id, tuple(block_ids), ttl),
            _Pending("send", request_id),
        )
        return expiry if request_id in self._announced_send else 0.0

    def layers_saved(self, layers: int, requests: Sequence[tuple[str, Sequence[int]]]) -> bool:
        """P's worker (this session's engine and rank): the first `layers` layers of these
        requests (P's id, logical blocks) are in host memory now.

        One way and never blocking: no reply, nothing to wait for in the forward pass. The
        daemon WRITEs those layers at once to a D that registered for the request; it is
        only a head start (P's `finished` writes whatever no notice named), so a notice that
        cannot be sent is simply not sent (returns False). It never reopens a lost session:
        a worker polls `drain_events` every step (vLLM's worker connector does, in
        `get_finished`), which brings the session back and registers its regions again."""
        if not requests:
            return True
        if self._sock is None or self._lost.is_set() or self._phase is not _Phase.UP:
            return False
        msg = wire.LayersSaved(
            self.engine_id,
            self.tp_rank,
            layers,
            tuple(wire.SavedRequest(rid, tuple(blocks)) for rid, blocks in requests),
        )
        try:
            self._sock.send(wire.encode(msg), flags=zmq.NOBLOCK)
        except zmq.Again:
            return False
        return True

    def abort(self, request_id: str, side: str | None = None) -> None:
        """Give up on a request; its terminal event still comes. An abort the daemon is too
        busy to take (BUSY) is sent again by a later `drain_events`, while the request is
        open.

        `side` is "send" (P: a request this client finished) or "recv" (D: one it tracked,
        registered or pulls); by default "send" if this client finished `request_id`,
        else "recv"."""
        if side is None:
            side = "send" if request_id in self._announced_send else "recv"
        if side not in ("send", "recv"):
            raise ValueError(f"side must be 'send' or 'recv', not {side!r}")
        self._send(
            wire.Abort(request_id, self.engine_id, side), _Pending("abort", request_id, side=side)
        )

    # ---------------------------------------------------------------- encoder cache

    def ec_allocate(self, mm_hash: str, nbytes: int) -> wire.ECBlocks:
        """Producer: blocks of the daemon's EC region to copy an encoder output into."""
        reply = self.request(wire.ECAllocate(mm_hash, nbytes))
        if not isinstance(reply, wire.ECBlocks):
            raise ProtocolError(f"expected ECBlocks, got {type(reply).__name__}")
        return reply

    def ec_commit(
        self,
        mm_hash: str,
        nbytes: int,
        *,
        shape: Sequence[int] = (),
        dtype: str = "uint8",
        modality: str = "image",
        compat: str,
    ) -> wire.ECParams:
        """Producer: the bytes are in place; returns the `ec_transfer_params` entry for the hash.

        `compat` (non-empty; the daemon refuses an empty one) is what a consumer must present
        to be served this output: the same string on both sides, e.g. a hash of the model.
        """
        reply = self.request(wire.ECCommit(mm_hash, nbytes, tuple(shape), dtype, modality, compat))
        if not isinstance(reply, wire.ECParams):
            raise ProtocolError(f"expected ECParams, got {type(reply).__name__}")
        return reply

    def ec_ensure(self, params: wire.ECParams) -> None:
        """Consumer: fetch (or find cached) an encoder output; ends in ECReady or ECUnavailable."""
        self._announced_ec[params.mm_hash] = self._announced_ec.get(params.mm_hash, 0) + 1
        self._send(
            wire.ECEnsure(
                params.mm_hash, params.peer_host, params.peer_port, params.nbytes, params.compat
            ),
            _Pending("ec", params.mm_hash),
        )

    def ec_read(
        self,
        params: wire.ECParams,
        out: Any,
        *,
        between: Callable[[int], None] | None = None,
    ) -> bool:
        """Consumer: serve a warm hit here, without a round trip to the daemon.

        If the local daemon's encoder cache holds `params.mm_hash` under `params.compat`,
        copy its `params.nbytes` bytes into `out` (a writable buffer: bytearray, numpy
        array, ...) and return True; the hit is reported to the daemon later, without
        waiting (counted there, and the output made recently used). False: not served
        here (not cached, cached under another compat, changed while it was copied, no
        index, or no live session; `out` may then hold anything): use `ec_ensure`. Nothing
        is pinned and there is nothing to release. The copy is checked against the
        daemon's index (`kvd_client.ecindex`), so a True copy is never stale bytes.
        `between` is a test hook, called before each run of blocks is copied."""
        view = self._ec_view()
        if view is None:
            self.ec_fast_misses += 1
            return False
        mv = memoryview(out).cast("B")
        c = view.lookup(params.mm_hash, params.compat)
        if c is None or c.nbytes != params.nbytes or len(mv) < c.nbytes:
            self.ec_fast_misses += 1
            return False
        view.copy(c, mv, between)
        if not view.valid(c) or self._lost.is_set():
            self.ec_fast_races += 1
            return False
        self.ec_fast_hits += 1
        self._ec_hits.append(params.mm_hash)
        if len(self._ec_hits) >= EC_HITS_BATCH:
            self._flush_ec_hits()
        return True

    def ec_cached(self, params: wire.ECParams) -> bool:
        """Consumer: whether the local daemon's cache holds this output under
        `params.compat` right now, read from its EC index (no round trip; False when no
        index is mapped). A hint: it may be evicted the next moment, and only `ec_ensure`
        pins it."""
        view = self._ec_view()
        if view is None:
            return False
        c = view.lookup(params.mm_hash, params.compat)
        return c is not None and c.nbytes == params.nbytes

    def _ec_view(self) -> ECIndexReader | None:
        """The live daemon's EC index, mapped on first use in each daemon incarnation."""
        if self._lost.is_set() or self._phase is not _Phase.UP or self.welcome is None:
            return None
        incarnation = self.welcome.incarnation
        if self._ec_index is not None:
            if self._ec_index_for == incarnation:
                return self._ec_index
            self._drop_ec_index()
        if not ECIndexReader.supported() or time.monotonic() < self._ec_index_retry:
            return None
        try:
            name = str(self.status("ec").get("index") or "")
            if not name:
                raise ValueError("the daemon publishes no EC index (not an EC consumer)")
            self._ec_index = ECIndexReader(name)
        except (KvdError, OSError, ValueError):
            self._ec_index_retry = time.monotonic() + EC_INDEX_RETRY_S
            return None
        self._ec_index_for = incarnation
        return self._ec_index

    def _drop_ec_index(self) -> None:
        if self._ec_index is not None:
            self._ec_index.close()
            self._ec_index = None
            self._ec_index_for = -1

    def _flush_ec_hits(self) -> None:
        """Report the warm hits served here, without waiting (the reply is absorbed later)."""
        if not self._ec_hits:
            return
        hits, self._ec_hits = tuple(self._ec_hits), []
        if self._sock is not None and self._phase is _Phase.UP and not self._lost.is_set():
            self._send(wire.ECHits(hits), _Pending("other", hits[0]))

    def ec_release(self, mm_hash: str) -> None:
        """Consumer: done copying an output that an ECReady handed out (drops its pin)."""
        self._send(wire.ECRelease(mm_hash), _Pending("other", mm_hash))

    # ---------------------------------------------------------------- worker API and tools

    def register_region(
        self,
        region: SharedRegion | None,
        *,
        layout: wire.RegionLayout,
        compat: str,
        tp_rank: int = 0,
        tp_size: int = 1,
        kind: str = "shm",
        name: str = "",
        nbytes: int = 0,
        ipc_handle: bytes = b"",
        device: int = -1,
        groups: tuple[wire.KvGroup, ...] = (),
    ) -> int:
        """Register a KV region (a SharedRegion for host staging); returns its region id.

        `compat` names what must agree between the two ends of a transfer (model, dtype,
        KV heads, head size, layers, block size, token layout): build it with
        `kvd_client.layout.compat_hash`. The daemon refuses an empty one, and fails any
        transfer between regions whose compat strings differ.

        A hybrid model's region holds several KV cache groups (`groups`; build the region
        with `kvd_client.layout.hybrid_region`): its `layout` is then the groups' block id
        space and its `compat` `kvd_client.layout.hybrid_compat(model)`.
        """
        msg = wire.RegisterRegion(
            kind=kind,
            name=region.name if region is not None else name,
            nbytes=region.nbytes if region is not None else nbytes,
            engine_id=self.engine_id,
            tp_rank=tp_rank,
            tp_size=tp_size,
            layout=layout,
            compat=compat,
            ipc_handle=ipc_handle,
            device=device,
            groups=groups,
        )
        reply = self.request(msg)
        if not isinstance(reply, wire.RegionRegistered):
            raise ProtocolError(f"expected RegionRegistered, got {type(reply).__name__}")
        self._regions.append(_RegionArgs(region, msg, reply.region_id))
        return reply.region_id

    def deregister_region(self, region_id: int) -> None:
        self.request(wire.DeregisterRegion(region_id))
        self._regions = [r for r in self._regions if r.region_id != region_id]

    def status(self, section: str = "status") -> dict[str, Any]:
        reply = self.request(wire.GetStatus(section))
        assert isinstance(reply, wire.StatusReply)
        return reply.data

    def ping_peer(self, host: str, port: int, timeout: float = 5.0) -> dict[str, Any]:
        reply = self.request(wire.PingPeer(host, port, timeout), timeout=timeout + self.timeout)
        assert isinstance(reply, wire.StatusReply)
        return reply.data
