"""The NIXL agent, owned by one dedicated thread (the only module that imports nixl).

Why a thread of our own:
- NIXL's default progress thread busy-spins a whole core (pthrDelay=0), which ruins
  latency on small machines. We create the agent without it and drive progress here: the
  loop polls `get_new_notifs` and in-flight transfer states, continuously (yielding the
  GIL and the CPU between polls) while transfers are in flight, every 100 us for 5 ms
  after any activity, and backing off (up to `poll_max_idle_us`) when idle. It
  never busy-spins on the GIL. The passive side of a transfer thus keeps making progress.
- `transfer()` may do the whole copy inside the call (same-host cma) and releases the
  GIL: it must never run on the event loop.
- Every call into the agent happens on this one thread, so the agent needs no locks.

The event loop talks to the thread with `await engine.call(fn)`; notifications and
transfer completions come back through `loop.call_soon_threadsafe`. NIXL's exceptions are
translated here into kvd's error types. With the daemon's stage trace on, the thread
records when it picks up, posts and completes a transfer and picks up a notification to
send (under the request id the caller passes), and when it polled each batch of
notifications (the sink records it under the ids it decodes).
The thread is named `kvd-nixl` (`top -H`, `/proc/<pid>/task/*/comm`).
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final, TypeVar

import numpy as np
import structlog
from kvd_client import wire
from kvd_client.errors import KvdError, NotFound, Timeout, TransferError

from kvd.core.peersession import Keyring
from kvd.core.stats import XferTiming
from kvd.core.trace import NO_TRACE, StageTrace

log = structlog.get_logger("kvd.nixl")

T = TypeVar("T")
NotifSink = Callable[[str, list[bytes], int], None]
"""Called on the event loop with (peer agent name, messages, the monotonic ns at which the
thread polled them, or 0 while the stage trace is off) for each batch."""

_HOT_S: Final = 0.005
"""After activity (a command, a notification, a completion), poll every `_HOT_POLL_S`
this long before backing off: a request's next notification usually follows within a
few ms. Not longer: on a small machine the polls of a daemon waiting out a large
transfer take CPU from the thread doing the copy (kvd bench, 2 cores)."""

_HOT_POLL_S: Final = 100e-6
"""Pause between polls while hot. The pause is a timed wait on the command queue: it
releases the GIL and the CPU (a command still wakes the thread at once). Never a busy
spin: `get_new_notifs` holds the GIL, so spinning on it starves the event loop thread
(up to the 5 ms switch interval per wake-up) and burns a core on small machines. Each
poll costs about 25 us of CPU here (mostly the timed wait), so 100 us is ~25 % of a
core while hot, and notifications wait 50 us on average."""

_PR_SET_TIMERSLACK: Final = 29
_PR_SET_NAME: Final = 15
THREAD_NAME: Final = "kvd-nixl"


class PeerDisconnected(TransferError):
    """NIXL reports the remote agent gone (dead process, EFAULT on its memory)."""

    at_post: bool = False
    """Raised by posting the transfer or notification: NIXL already knew the peer was gone
    (e.g. it died, maybe restarted, while we were idle), rather than losing it under a
    posted transfer."""


class PeerUnknown(TransferError):
    """Posting a transfer or notification found no NIXL metadata for the peer agent, or
    none for the remote memory named (NIXL_ERR_NOT_FOUND): the view of the peer it was
    posted through was dropped or replaced meanwhile (the registrar forgot a dead peer, or
    loaded a restarted one in its place). Nothing was sent or moved."""


def translate(exc: BaseException, *, posting: bool = False) -> KvdError:
    """Map a NIXL exception to a kvd error (keeps the NIXL name in the message).

    `posting`: raised by posting a transfer or a notification, so NIXL judged the view of
    the peer the caller posted through before anything went out.
    """
    if isinstance(exc, KvdError):
        return exc
    name = type(exc).__name__
    text = f"{name}: {exc}"
    if "RemoteDisconnect" in name:
        gone = PeerDisconnected(text)
        gone.at_post = posting
        return gone
    if "NotFound" in name:
        return PeerUnknown(text) if posting else NotFound(text)
    return TransferError(text)


@dataclass
class _Xfer:
    handle: Any
    future: asyncio.Future[XferTiming]
    deadline: float
    started: float
    trace_id: str = ""
    post_s: float = 0.0
    """Seconds spent preparing and posting it (descriptor lists, initialize, transfer)."""


@dataclass
class NixlStats:
    transfers_posted: int = 0
    transfers_done: int = 0
    transfers_failed: int = 0
    bytes_moved: int = 0
    notifs_sent: int = 0
    notifs_received: int = 0
    polls: int = 0
    inflight: int = 0
    errors: dict[str, int] = field(default_factory=dict)


class NixlEngine:
    """One NIXL agent and the thread that owns it."""

    def __init__(
        self,
        name: str,
        *,
        backend: str = "UCX",
        error_handling_mode: str = "peer",
        num_threads: int = 0,
        poll_max_idle_us: int = 1000,
        ucx_tls: str = "",
        trace: StageTrace = NO_TRACE,
    ) -> None:
        self.name: Final = name
        self._backend = backend
        self._err_mode = error_handling_mode
        self._num_threads = num_threads
        self._max_idle = poll_max_idle_us / 1e6
        self._ucx_tls = ucx_tls
        self._cmds: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._inflight: list[_Xfer] = []
        self._thread: threading.Thread | None = None
        self._agent: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sink: NotifSink | None = None
        self._stop = threading.Event()
        self.stats = NixlStats()
        self.trace = trace
        self.keyring: Keyring | None = None
        """Set (with a shared secret) before the first peer: every notification we send
        is then sealed (`_seal`)."""

    # ---------------------------------------------------------------- lifecycle

    async def start(self, sink: NotifSink) -> None:
        """Create the agent on its thread; returns once it is ready (or raises)."""
        self._loop = asyncio.get_running_loop()
        self._sink = sink
        ready: asyncio.Future[None] = self._loop.create_future()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name=THREAD_NAME, daemon=True
        )
        self._thread.start()
        await ready

    async def close(self) -> None:
        """Stop the thread; in-flight transfers fail, the agent is destroyed."""
        if self._thread is None:
            return
        self._cmds.put(None)
        thread = self._thread
        await asyncio.get_running_loop().run_in_executor(None, thread.join, 5.0)
        self._thread = None

    def _create_agent(self) -> Any:
        if self._ucx_tls:
            os.environ["UCX_TLS"] = self._ucx_tls
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        from nixl._api import nixl_agent, nixl_agent_config

        conf = nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            num_threads=self._num_threads,
            backends=[],
        )
        agent = nixl_agent(self.name, conf)
        agent.create_backend(self._backend, {"ucx_error_handling_mode": self._err_mode})
        return agent

    # ---------------------------------------------------------------- the thread

    def _run(self, ready: asyncio.Future[None]) -> None:
        loop = self._loop
        assert loop is not None
        try:
            self._agent = self._create_agent()
        except BaseException as exc:  # report any failure to the awaiting start()
            err = translate(exc)
            loop.call_soon_threadsafe(_set_exc, ready, err)
            return
        loop.call_soon_threadsafe(_set_result, ready, None)
        _tune_thread()
        idle = _HOT_POLL_S
        last_activity = time.monotonic()
        try:
            while True:
                if self._inflight:
                    wait = 0.0  # a transfer in flight: poll it continuously, yielding
                elif time.monotonic() - last_activity < _HOT_S:
                    wait = min(_HOT_POLL_S, self._max_idle)
                else:
                    wait = idle
                cmds: list[Callable[[], None] | None] = []
                try:
                    if wait > 0:
                        cmds.append(self._cmds.get(timeout=wait))
                    else:
                        os.sched_yield()  # releases the GIL and the CPU
                        cmds.append(self._cmds.get_nowait())
                    while True:
                        cmds.append(self._cmds.get_nowait())
                except queue.Empty:
                    pass
                active = bool(cmds)
                for cmd in cmds:
                    if cmd is not None:
                        cmd()
                if None in cmds:
                    return
                if self._poll_notifs():
                    active = True
                if self._inflight and self._poll_xfers():
                    active = True
                self.stats.polls += 1
                if active:
                    last_activity = time.monotonic()
                    idle = min(_HOT_POLL_S, self._max_idle)
                elif wait > 0 and time.monotonic() - last_activity >= _HOT_S:
                    idle = min(self._max_idle, idle * 2)
        finally:
            self._shutdown_agent()

    def _poll_notifs(self) -> bool:
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as exc:  # progress errors must not kill the thread
            self._count_error(exc)
            return False
        if not notifs:
            return False
        loop, sink = self._loop, self._sink
        assert loop is not None and sink is not None
        polled = self.trace.now()
        for peer, msgs in notifs.items():
            self.stats.notifs_received += len(msgs)
            loop.call_soon_threadsafe(
                sink, peer if isinstance(peer, str) else peer.decode(), list(msgs), polled
            )
        return True

    def _poll_xfers(self) -> bool:
        now = time.monotonic()
        keep: list[_Xfer] = []
        changed = False
        for x in self._inflight:
            try:
                state = self._agent.check_xfer_state(x.handle)
            except Exception as exc:
                self._finish(x, exc)
                changed = True
                continue
            if state == "DONE":
                self._finish(x, None)
                changed = True
            elif state == "PROC" and now < x.deadline:
                keep.append(x)
            elif state == "PROC":
                self._finish(x, Timeout(f"transfer still in flight after {now - x.started:.3f}s"))
                changed = True
            else:
                self._finish(x, TransferError(f"transfer state {state!r}"))
                changed = True
        self._inflight = keep
        self.stats.inflight = len(keep)
        return changed

    def _finish(self, x: _Xfer, exc: BaseException | None, *, at_post: bool = False) -> None:
        try:
            self._agent.release_xfer_handle(x.handle)
        except Exception as rel_exc:
            self._count_error(rel_exc)
        loop = self._loop
        assert loop is not None
        if exc is None:
            self.stats.transfers_done += 1
            if self.trace.on and x.trace_id:
                self.trace.mark(x.trace_id, "nixl.done")
            done = XferTiming(x.post_s, time.monotonic() - x.started)
            loop.call_soon_threadsafe(_set_result, x.future, done)
        else:
            self.stats.transfers_failed += 1
            self._count_error(exc)
            loop.call_soon_threadsafe(_set_exc, x.future, translate(exc, posting=at_post))

    def _count_error(self, exc: BaseException) -> None:
        name = type(exc).__name__
        self.stats.errors[name] = self.stats.errors.get(name, 0) + 1

    def _shutdown_agent(self) -> None:
        for x in self._inflight:
            self._finish(x, TransferError("NIXL engine shut down"))
        self._inflight = []
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                break
            if cmd is not None:
                cmd()  # commands fail fast: the agent is still there
        self._agent = None

    # ---------------------------------------------------------------- calls from the loop

    async def call(self, fn: Callable[[Any], T], *, posting: bool = False) -> T:
        """Run fn(agent) on the NIXL thread and return its result (errors translated;
        `posting` as in `translate`)."""
        loop = self._loop
        if loop is None or self._thread is None:
            raise TransferError("NIXL engine is not running")
        fut: asyncio.Future[T] = loop.create_future()

        def run() -> None:
            try:
                value = fn(self._agent)
            except BaseException as exc:
                loop.call_soon_threadsafe(_set_exc, fut, translate(exc, posting=posting))
            else:
                loop.call_soon_threadsafe(_set_result, fut, value)

        self._cmds.put(run)
        return await fut

    async def transfer(
        self,
        op: str,
        local: np.ndarray,
        remote: np.ndarray,
        peer: str,
        notif: bytes,
        timeout: float,  # noqa: ASYNC109 - enforced by the NIXL thread, which owns the handle
        nbytes: int,
        local_mem: str = "DRAM",
        remote_mem: str = "DRAM",
        trace_id: str = "",
    ) -> XferTiming:
        """Post a WRITE or READ of Nx3 (addr, len, dev) descriptor arrays and wait for it.

        Returns the seconds spent posting it, and from the start of posting to completion
        (so including the post: a same-host copy may finish inside it). The notification
        is delivered to the peer by NIXL when the transfer completes. Raises TransferError
        (PeerDisconnected when the peer is gone, PeerUnknown when NIXL holds no metadata
        for it or for the remote memory named, Timeout past `timeout`). `trace_id`: the
        request the stage trace records this transfer under.
        """
        notif = self._seal(peer, notif) if notif else notif
        loop = self._loop
        if loop is None or self._thread is None:
            raise TransferError("NIXL engine is not running")
        fut: asyncio.Future[XferTiming] = loop.create_future()

        trace = self.trace

        def run() -> None:
            agent = self._agent
            started = time.monotonic()
            if trace.on and trace_id:
                trace.mark(trace_id, "nixl.picked")
            try:
                ldesc = agent.get_xfer_descs(local, local_mem)
                rdesc = agent.get_xfer_descs(remote, remote_mem)
                handle = agent.initialize_xfer(op, ldesc, rdesc, peer, notif)
            except BaseException as exc:
                self.stats.transfers_failed += 1
                self._count_error(exc)
                loop.call_soon_threadsafe(_set_exc, fut, translate(exc, posting=True))
                return
            self.stats.transfers_posted += 1
            self.stats.bytes_moved += nbytes
            x = _Xfer(handle, fut, started + timeout, started, trace_id)
            if trace.on and trace_id:
                trace.mark(trace_id, "nixl.posted")
            try:
                state = agent.transfer(handle)
            except BaseException as exc:
                self._finish(x, exc, at_post=True)
                return
            x.post_s = time.monotonic() - started
            if state == "DONE":
                self._finish(x, None)
            else:
                self._inflight.append(x)

        self._cmds.put(run)
        return await fut

    async def send_notif(self, peer: str, msg: bytes, trace_id: str = "") -> None:
        """Send one notification; NIXL sends it within the call, so every failure is one of
        posting (see `translate`)."""
        trace = self.trace
        msg = self._seal(peer, msg)

        def send(agent: Any) -> None:
            if trace.on and trace_id:
                trace.mark(trace_id, "nixl.notif_picked")
            agent.send_notif(peer, msg)
            self.stats.notifs_sent += 1

        await self.call(send, posting=True)

    def post_notif(
        self,
        peer: str,
        msg: bytes,
        done: Callable[[KvdError | None], None],
        trace_id: str = "",
        *,
        report_ok: bool = True,
    ) -> None:
        """Send one notification without waiting for it: `done` is called later on the
        event loop with the error `send_notif` would raise, or with None once it was sent
        (only if `report_ok`). No task and no future: the caller's loop goes on at once."""
        loop = self._loop
        if loop is None or self._thread is None:
            err = TransferError("NIXL engine is not running")
            asyncio.get_running_loop().call_soon(done, err)
            return
        trace = self.trace
        try:
            msg = self._seal(peer, msg)
        except KvdError as err:
            asyncio.get_running_loop().call_soon(done, err)
            return

        def send() -> None:
            if trace.on and trace_id:
                trace.mark(trace_id, "nixl.notif_picked")
            try:
                self._agent.send_notif(peer, msg)
            except BaseException as exc:
                loop.call_soon_threadsafe(done, translate(exc, posting=True))
                return
            self.stats.notifs_sent += 1
            if report_ok:
                loop.call_soon_threadsafe(done, None)

        self._cmds.put(send)

    def _seal(self, peer: str, msg: bytes) -> bytes:
        """With a keyring (a shared secret), `msg` in an envelope under our session key with
        `peer` (`kvd.core.peersession`), sealed here on the loop in the order the thread
        posts. Without a key for the peer nothing is sent (PeerUnknown: handshake again)."""
        if self.keyring is None:
            return msg
        env = self.keyring.seal(peer, msg, time.monotonic())
        if env is None:
            raise PeerUnknown(f"no session key with {peer!r}: handshake first")
        return wire.encode(env)

    async def register(self, addr: int, nbytes: int, mem: str = "DRAM", dev: int = 0) -> Any:
        """Register memory: "DRAM" (host, incl. shared memory) or "VRAM" (a GPU's, dev = GPU id)."""
        return await self.call(lambda a: a.register_memory([(addr, nbytes, dev, "")], mem))

    async def deregister(self, reg: Any) -> None:
        await self.call(lambda a: a.deregister_memory(reg))

    async def metadata(self) -> bytes:
        md = await self.call(lambda a: a.get_agent_metadata())
        return bytes(md)

    async def partial_metadata(
        self, addr: int, nbytes: int, mem: str = "DRAM", dev: int = 0
    ) -> bytes:
        def get(a: Any) -> bytes:
            descs = a.get_reg_descs([(addr, nbytes, dev, "")], mem)
            return bytes(a.get_partial_agent_metadata(descs, False, []))

        return await self.call(get)

    async def add_remote(self, md: bytes) -> str:
        name = await self.call(lambda a: a.add_remote_agent(md))
        return name.decode() if isinstance(name, bytes) else str(name)

    async def remove_remote(self, name: str) -> None:
        await self.call(lambda a: a.remove_remote_agent(name))


def _tune_thread() -> None:
    """Name the calling thread for the OS, and let its short timed waits end on time
    (Linux rounds them up by the thread's timer slack, 50 us by default: as long as the
    hot poll pause itself)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_NAME, THREAD_NAME.encode(), 0, 0, 0)
        libc.prctl(_PR_SET_TIMERSLACK, 1000, 0, 0, 0)  # 1 us, for the calling thread only
    except (OSError, AttributeError):
        pass


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exc(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
