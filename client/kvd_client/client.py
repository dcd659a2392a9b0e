"""The thin client: what an engine's scheduler and worker processes use to talk to kvd.

- One DEALER socket on the daemon's ipc:// ROUTER, used only from the caller's thread.
- Scheduler calls (`track`, `register_push`, `pull`, `finished`, `abort`) never wait for
  the daemon: they send and return. Their replies are read by `drain_events`, which
  never blocks either; a refused request becomes a failure event for that request, so
  every announced request still ends in exactly one terminal event.
- `drain_events` returns only events about ids this client announced.
- A keep-alive thread with its own socket pings the daemon; if the daemon restarted (it
  no longer knows the session) or died (its socket refuses connections), the next
  `drain_events` fails every request that was in flight, and reconnects and
  re-registers the regions once a daemon listens again (never waiting for one).
- Setup calls (`connect`, `register_region`, `status`, `ping_peer`) wait for their reply.
"""

from __future__ import annotations

import errno
import itertools
import os
import secrets
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

import zmq

from kvd_client import __version__, wire
from kvd_client.errors import ErrorCode, KvdError, ProtocolError, Timeout, error_from_code
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


@dataclass
class _Pending:
    kind: str  # "recv", "send", "other"
    request_id: str
    block_ids: tuple[int, ...] = ()


@dataclass
class _RegionArgs:
    region: SharedRegion | None
    msg: wire.RegisterRegion
    region_id: int = 0


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
        self.session = f"{role}-{os.getpid()}-{secrets.token_hex(6)}"
        self.welcome: wire.Welcome | None = None
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        self._sock: zmq.Socket[bytes] | None = None
        self._corr = itertools.count(1)
        self._pending: dict[int, _Pending] = {}
        self._events: deque[Event] = deque()
        self._announced_recv: dict[str, tuple[int, ...]] = {}
        self._announced_send: set[str] = set()
        self._announced_ec: dict[str, int] = {}
        self._regions: list[_RegionArgs] = []
        self._lost = threading.Event()
        self._stop = threading.Event()
        self._ka_thread: threading.Thread | None = None
        self.reconnects = 0

    # ---------------------------------------------------------------- connection

    def connect(self) -> wire.Welcome:
        """Open the socket and say Hello (waits for Welcome, up to `timeout`)."""
        self._open()
        if self._ka_thread is None and self.keepalive_interval > 0:
            self._ka_thread = threading.Thread(
                target=self._keepalive, name="kvd-keepalive", daemon=True
            )
            self._ka_thread.start()
        welcome = self._hello()
        self._lost.clear()
        return welcome

    def _open(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, self.session.encode())
        sock.connect(f"ipc://{self.socket_path}")
        self._sock = sock

    def _hello(self) -> wire.Welcome:
        hello = wire.Hello(
            self.session, self.role, self.engine_id, self.tp_rank, os.getpid(), __version__
        )
        reply = self.request(hello)
        if not isinstance(reply, wire.Welcome):
            raise ProtocolError(f"expected Welcome, got {type(reply).__name__}")
        self.welcome = reply
        return reply

    def close(self) -> None:
        """Say goodbye (the daemon releases this session's regions) and close."""
        self._stop.set()
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
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"ipc://{self.socket_path}")
        try:
            while not self._stop.wait(self.keepalive_interval):
                if not daemon_listening(self.socket_path):
                    self._lost.set()  # died: nothing in flight will ever complete
                    continue
                try:
                    sock.send(wire.encode(wire.KeepAlive(self.session)), flags=zmq.NOBLOCK)
                except zmq.Again:
                    continue
                while sock.poll(0):
                    try:
                        _, msg = wire.decode(sock.recv())
                    except ProtocolError:
                        continue
                    if isinstance(msg, wire.ErrorReply) and msg.code == ErrorCode.NOT_FOUND:
                        self._lost.set()
        finally:
            sock.close(0)

    # ---------------------------------------------------------------- request/reply

    def request(self, msg: wire.Record, timeout: float | None = None) -> wire.Record:
        """Send and wait for the reply (events that arrive meanwhile are kept)."""
        if self._sock is None:
            raise ProtocolError("not connected")
        corr = next(self._corr)
        self._sock.send(wire.encode(msg, corr))
        deadline = time.monotonic() + (self.timeout if timeout is None else timeout)
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self._sock.poll(int(left * 1000) + 1):
                if time.monotonic() >= deadline:
                    raise Timeout(
                        f"no reply from kvd at {self.socket_path} within {timeout or self.timeout}s"
                    )
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
        corr = next(self._corr)
        self._pending[corr] = pending
        try:
            self._sock.send(wire.encode(msg, corr), flags=zmq.NOBLOCK)
        except zmq.Again:  # the daemon is gone and the queue to it is full: never block
            why = "kvd daemon unreachable (send queue full)"
            self._absorb(corr, wire.ErrorReply.of(ErrorCode.BUSY, why))

    def _absorb(self, corr: int, msg: wire.Record) -> None:
        """Handle a frame that is not the reply being waited for."""
        if corr == 0:
            if isinstance(msg, EVENT_TYPES):
                self._accept_event(msg)
            return
        p = self._pending.pop(corr, None)
        if p is None or not isinstance(msg, wire.ErrorReply):
            return
        # A refused request still ends: turn the refusal into its terminal event.
        if p.kind == "ec" and self._announced_ec.get(p.request_id, 0) > 0:
            self._ec_done(p.request_id)
            self._events.append(wire.ECUnavailable(p.request_id, msg.code, msg.message))
        elif p.kind == "recv" and self._announced_recv.pop(p.request_id, None) is not None:
            self._events.append(wire.RecvFailed(p.request_id, msg.code, msg.message, p.block_ids))
        elif p.kind == "send" and p.request_id in self._announced_send:
            self._announced_send.discard(p.request_id)
            self._events.append(wire.SendFailed(p.request_id, msg.code, msg.message))

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
            self._recover()
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

    def _recover(self) -> None:
        """The daemon restarted or died: fail what was in flight, then reconnect if one listens.

        Never waits for a daemon that is not listening: the failures are returned at once
        and the reconnection is tried again by the next `drain_events`.
        """
        reason = "kvd daemon restarted or died; the transfer was lost"
        for rid, blocks in self._announced_recv.items():
            self._events.append(wire.RecvFailed(rid, int(ErrorCode.TRANSFER), reason, blocks))
        for rid in self._announced_send:
            self._events.append(wire.SendFailed(rid, int(ErrorCode.TRANSFER), reason))
        for mm_hash, n in self._announced_ec.items():
            for _ in range(n):
                self._events.append(wire.ECUnavailable(mm_hash, int(ErrorCode.TRANSFER), reason))
        self._announced_recv.clear()
        self._announced_send.clear()
        self._announced_ec.clear()
        self._pending.clear()
        if not daemon_listening(self.socket_path):
            return  # still lost: new requests fail on the next drain, until a daemon is back
        # A new identity: the ROUTER may still hold the old socket's connection (it
        # reconnected on its own), and it ignores a second peer with the same identity.
        self.session = f"{self.role}-{os.getpid()}-{secrets.token_hex(6)}"
        self._open()
        try:
            self._hello()
            for r in self._regions:
                reply = self.request(r.msg)
                assert isinstance(reply, wire.RegionRegistered)
                r.region_id = reply.region_id
        except KvdError:
            return  # it went away again: try once more on the next drain
        self._lost.clear()
        self.reconnects += 1

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
    ) -> None:
        """D: a request that will load remote KV arrived; heartbeats to P start now."""
        self._send(
            wire.Track(
                request_id,
                self.engine_id,
                peer_host,
                peer_port,
                remote_engine_id,
                remote_request_id,
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
    ) -> None:
        """D (push): P will WRITE into these logical blocks; ends in RecvFinished or RecvFailed."""
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
    ) -> None:
        """D (pull): READ P's blocks into ours; empty lists just tell P to free."""
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
            ),
            _Pending("recv", request_id, blocks),
        )

    def finished(self, request_id: str, block_ids: Sequence[int]) -> None:
        """P: prefill done; the daemon leases these blocks until they are sent.

        Ends in SendFinished, SendFailed or SendExpired.
        """
        self._announced_send.add(request_id)
        self._send(
            wire.Finish(request_id, self.engine_id, tuple(block_ids)), _Pending("send", request_id)
        )

    def abort(self, request_id: str) -> None:
        """Either side: give up on a request; its terminal event still comes."""
        self._send(wire.Abort(request_id, self.engine_id), _Pending("other", request_id))

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
    ) -> int:
        """Register a KV region (a SharedRegion for host staging); returns its region id.

        `compat` names what must agree between the two ends of a transfer (model, dtype,
        KV heads, head size, layers, block size, token layout): build it with
        `kvd_client.layout.compat_hash`. The daemon refuses an empty one, and fails any
        transfer between regions whose compat strings differ.
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
