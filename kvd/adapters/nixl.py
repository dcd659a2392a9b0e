"""The NIXL agent, owned by one dedicated thread (the only module of the daemon that uses
nixl; `kvd.adapters.nixl_import` imports it).

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

The event loop talks to the thread with `await engine.call(fn)`; transfer completions
come back through `loop.call_soon_threadsafe`, notifications through one bounded queue
(`_RX_MAX_NOTIFS`, `_RX_MAX_BYTES`) that one scheduled drain on the loop feeds to the
sink, in the order polled. Past the bound they are dropped and counted
(`notifs_dropped`): a lost notification only leaves its request to its watchdog, never
makes it report done. NIXL's exceptions are
translated here into kvd's error types. With the daemon's stage trace on, the thread
records when it picks up, posts and completes a transfer and picks up a notification to
send (under the request id the caller passes), and when it polled each batch of
notifications (the sink records it under the ids it decodes).
The thread is named `kvd-nixl` (`top -H`, `/proc/<pid>/task/*/comm`).
"""

from __future__ import annotations

import _thread
import asyncio
import collections
import contextlib
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

from kvd.adapters.doorbell import Commands, Doorbell
from kvd.adapters.nixl_import import nixl_api
from kvd.core.peersession import Keyring
from kvd.core.stats import XferTiming
from kvd.core.trace import NO_TRACE, StageTrace

log = structlog.get_logger("kvd.nixl")

T = TypeVar("T")
NotifSink = Callable[[str, list[bytes], int], None]
"""Called on the event loop with (peer agent name, messages, the monotonic ns at which the
thread polled them, or 0 while the stage trace is off) for each batch."""

_HAND_S: Final = 200e-6
"""How long a hand-off to the idle NIXL thread waits for the thread to take it (`_hand`)."""
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

_RELOAD_EVERY_S: Final = 0.5
"""A peer whose fresh endpoint fails again is reloaded at most this often (a dead peer's
failures must not turn into a reconnect storm; the registrar forgets dead peers)."""

_HOLD_MAX_S: Final = 3.0
"""The longest a notification waits for a broken peer's fresh endpoint. A peer that died
looks the same from here as one behind a cut link (its endpoint failed; re-adding its old
metadata yields another endpoint that fails): after this its notifications fail, so the
callers see it gone (D forgets it and fails what waits on it within seconds)."""
FILE_BACKEND: Final = "POSIX"
"""NIXL's backend for files (`file_transfer`) to and from host memory."""
GDS_BACKEND: Final = "GDS"
"""NIXL's GPUDirect Storage backend: files to and from VRAM without a host copy (created
beside POSIX where a GPU is visible, the plugin loads and cuFile registers a probe file;
not tested end to end: on the one GPU machine tried, cuFile refused every file)."""

_RX_MAX_NOTIFS: Final = 65_536
_RX_MAX_BYTES: Final = 64 << 20
"""Bounds on the notifications polled and not yet fed to the sink (count, bytes)."""

_PR_SET_TIMERSLACK: Final = 29
_PR_SET_NAME: Final = 15
THREAD_NAME: Final = "kvd-nixl"


class PeerDisconnected(TransferError):
    """NIXL reports the remote agent gone (dead process, EFAULT on its memory)."""

    at_post: bool = False
    """Raised by posting the transfer or notification: NIXL already knew the peer was gone
    (e.g. it died, maybe restarted, while we were idle), rather than losing it under a
    posted transfer."""


class Unsettled(Timeout):
    """A transfer still in flight in UCX past its timeout and past the settle bound:
    NIXL cannot cancel it (`release_xfer_handle` does not stop a posted WRITE/READ: its
    bytes may still land). The handle is kept and polled until UCX ends it; until then
    the memory it touches (ours and the peer's) must not be reused."""


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
    peer: str = ""
    cleanup: Callable[[], None] | None = None
    """Run on the NIXL thread once the transfer ended (e.g. deregister its files)."""
    post_s: float = 0.0
    """Seconds spent preparing and posting it (descriptor lists, initialize, transfer)."""
    late: bool = False
    """Past its deadline and still in flight in UCX: kept (never released while in
    flight), its end awaited."""
    reported: bool = False
    """Its future was already answered (Unsettled); the handle is still polled."""
    settled: Callable[[], None] | None = None
    """Called on the event loop once UCX ended the transfer (nothing more of it can land)."""
    notifies: bool = False
    """It carries a notification for the peer (whose doorbell is rung once it is done)."""


@dataclass(slots=True)
class _Notif:
    peer: str
    msg: bytes
    done: Callable[[KvdError | None], None]
    report_ok: bool
    since: float


@dataclass
class NixlStats:
    transfers_posted: int = 0
    transfers_done: int = 0
    transfers_failed: int = 0
    bytes_moved: int = 0
    notifs_sent: int = 0
    hands_waited: int = 0
    """Commands handed to the idle thread that it took before the hand-off returned."""
    hands_late: int = 0
    """Commands handed to the idle thread that it did not take within `_HAND_S`."""
    notifs_received: int = 0
    polls: int = 0
    inflight: int = 0
    late: int = 0
    """Transfers past their deadline that UCX has not ended yet."""
    late_landed: int = 0
    """Transfers that UCX completed after their deadline (their bytes did land)."""
    unsettled: int = 0
    """Transfers reported Unsettled (still held, polled until UCX ends them)."""
    transfers_fenced: int = 0
    """Transfers not posted: their post fence had passed (the daemon stalled)."""
    reconnects: int = 0
    """Peers whose failed endpoint was replaced by a fresh one (their metadata reloaded)."""
    reconnect_failures: int = 0
    """Attempts to make a fresh endpoint that failed (the link still down)."""
    notifs_held: int = 0
    """Notifications held for a peer whose endpoint failed (sent once it is mended)."""
    peers_given_up: int = 0
    """Broken peers whose fresh endpoint failed too (gone, not behind a cut link)."""
    removals_deferred: int = 0
    """Peers forgotten while transfers to them were in flight (removed once they ended)."""
    peers_refreshed: int = 0
    """Peers whose metadata was loaded afresh because regions of theirs we had loaded were
    dropped (`refresh_remote`)."""
    refreshes_deferred: int = 0
    """Refreshes not made yet: a transfer to the peer was in flight."""
    notifs_expired: int = 0
    """Held notifications failed: no fresh endpoint within the hold bound."""
    notifs_dropped: int = 0
    """Notifications polled while the queue to the event loop was full (dropped)."""
    notifs_queued: int = 0
    """Notifications polled and not yet fed to the sink (at the last poll or drain)."""
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
        poll_deep_idle_us: int = 0,
        ucx_tls: str = "",
        settle_timeout: float = 0.0,
        trace: StageTrace = NO_TRACE,
        file_backend: bool = False,
    ) -> None:
        self.name: Final = name
        self.file_backend = file_backend
        """Also create NIXL's POSIX backend (files: the KV tiers' disk tier)."""
        self.gds = False
        """NIXL's GDS backend was created too (with `file_backend`, where a GPU is
        visible) and cuFile registers files here: `file_transfer` moves VRAM straight to
        and from files."""
        self.gds_problem = ""
        """Why GDS is not used although its backend was created (cuFile refused a file)."""
        self._backend = backend
        self._err_mode = error_handling_mode
        self._num_threads = num_threads
        self._max_idle = poll_max_idle_us / 1e6
        self._deep_idle = max(poll_deep_idle_us / 1e6, self._max_idle)
        """The longest pause while the daemon has nothing going on at all (`awake` says
        False): no request, fetch, pin or probe that a notification or a peer's
        transfer could be for. Any input to the daemon ends it at once (`poke`)."""
        self.awake: Callable[[], bool] = lambda: True
        """Whether anything of the daemon's may wait on this agent (read on the thread:
        plain reads of the actors' tables). Set by the daemon; True keeps the old cap."""
        self._deep = False
        """The thread is pausing longer than `_max_idle` (`poke` wakes it)."""
        self._idle_wait = False
        """The thread waits on its command queue (`_hand`)."""
        self._ucx_tls = ucx_tls
        self._settle = settle_timeout
        """Bound on how long UCX may keep an unacknowledged operation (TCP_USER_TIMEOUT);
        0: UCX's default (the kernel's, ~15 minutes with tcp_retries2=15)."""
        self._cmds = Commands()
        self.bell: Doorbell | None = None
        """This daemon's doorbell (`open_doorbell`): while backed off, the thread also
        wakes on a datagram to it, sent by a peer after a notification to us."""
        self._mds: dict[str, list[bytes]] = {}
        """Every metadata blob loaded for each remote agent, in order (the thread's): what
        a fresh endpoint to it is made from when UCX failed the old one."""
        self._reloaded: dict[str, float] = {}
        self._broken: dict[str, float] = {}
        """Peers whose endpoint failed and is not mended yet, since when."""
        self._fresh: dict[str, float] = {}
        """Peers given a fresh endpoint that has not carried anything yet: if it fails
        too, the peer is gone, not behind a cut link."""
        self._remove_later: set[str] = set()
        """Peers forgotten while transfers to them were in flight (see `remove_remote`)."""
        self._unloaded: set[str] = set()
        """Peers removed from NIXL by a reload whose re-adding failed (link down)."""
        self._held: dict[str, collections.deque[_Notif]] = {}
        """Notifications waiting, in order, for a broken peer's fresh endpoint."""
        self._inflight: list[_Xfer] = []
        self._thread: threading.Thread | None = None
        self._agent: Any = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sink: NotifSink | None = None
        self._stop = threading.Event()
        self._rx: collections.deque[tuple[str, list[bytes], int, int]] = collections.deque()
        """Polled notifications for the sink: (peer, messages, polled ns, bytes)."""
        self._rx_in = [0, 0]
        """Notifications and bytes appended to `_rx` (by the thread)."""
        self._rx_out = [0, 0]
        """Notifications and bytes taken from `_rx` (on the loop)."""
        self._rx_scheduled = False
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
        if not thread.is_alive():
            self._cmds.close()
            if self.bell is not None:
                self.bell.close()

    def stats_dict(self) -> dict[str, Any]:
        """The engine's statistics, with the doorbell's (`doorbell_*`; `doorbell_port` 0:
        none)."""
        out = dict(self.stats.__dict__)
        bell = self.bell
        out["doorbell_port"] = bell.port if bell is not None else 0
        out["doorbell_peers"] = bell.peers() if bell is not None else 0
        for key, n in (bell.stats.__dict__ if bell is not None else {}).items():
            out[f"doorbell_{key}"] = n
        return out

    def open_doorbell(self, host: str, port: int) -> bool:
        """Bind this daemon's doorbell on UDP host:port (the side channel's); False where
        it cannot be (logged): peers then find our notifications at our timed polls."""
        if self.bell is None:
            self.bell = Doorbell.bind(host, port)
        return self.bell is not None

    def set_peer_doorbell(self, peer: str, addr: tuple[int, tuple[object, ...]] | None) -> None:
        """Ring `peer`'s doorbell at (family, sockaddr) after each notification to it, or
        no more (None). Without a doorbell of our own, peers are not rung either: one
        socket does both, and a daemon that turned doorbells off sends none."""
        if self.bell is not None:
            self.bell.set_peer(peer, addr)

    def _create_agent(self) -> Any:
        if self._ucx_tls:
            os.environ["UCX_TLS"] = self._ucx_tls
        os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
        # a crash inside UCX prints its native backtrace to the log (then Python's fault
        # handler adds every thread's Python stack): the one clue a crash leaves
        os.environ.setdefault("UCX_HANDLE_ERRORS", "bt")
        if self._settle > 0:
            # a peer that acknowledges nothing for this long is cut off by the kernel and
            # every operation queued to it ends in error: nothing of it lands later
            ms = f"{int(self._settle * 1000)}ms"
            os.environ.setdefault("UCX_TCP_USER_TIMEOUT", ms)
            # and an idle connection (a READ waiting for its data sends nothing) is
            # probed, so that it too is cut off within the bound
            half = f"{max(1, int(self._settle / 2))}s"
            os.environ.setdefault("UCX_TCP_KEEPIDLE", half)
            os.environ.setdefault("UCX_TCP_KEEPINTVL", half)
        _load_cuda_runtime()
        api = nixl_api()
        nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config

        conf = nixl_agent_config(
            enable_prog_thread=False,
            enable_listen_thread=False,
            num_threads=self._num_threads,
            backends=[],
        )
        agent = nixl_agent(self.name, conf)
        agent.create_backend(self._backend, {"ucx_error_handling_mode": self._err_mode})
        if self.file_backend:
            agent.create_backend(FILE_BACKEND, {})
            if _gpu_visible() and GDS_BACKEND in agent.get_plugin_list():
                try:
                    agent.create_backend(GDS_BACKEND, {})
                    self.gds_problem = _probe_gds(agent)
                    self.gds = not self.gds_problem
                    if self.gds_problem:
                        log.info("nixl_gds_unusable", error=self.gds_problem)
                except Exception as exc:  # no cuFile, no driver: host memory only
                    log.info("nixl_gds_unavailable", error=str(translate(exc).message))
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
                    wait = min(idle, self._idle_cap())
                self._deep = wait > self._max_idle
                cmds: list[Callable[[], None] | None] = []
                rung = False
                try:
                    if wait > 0:
                        self._idle_wait = True
                        try:
                            bell = self.bell
                            if bell is not None and wait > _HOT_POLL_S:
                                # backed off: a peer's doorbell ends the wait too
                                rung = self._cmds.wait(wait, bell)
                            else:
                                cmds.append(self._cmds.get(timeout=wait))
                        finally:
                            self._idle_wait = False
                    else:
                        os.sched_yield()  # releases the GIL and the CPU
                        cmds.append(self._cmds.get_nowait())
                    while True:
                        cmds.append(self._cmds.get_nowait())
                except queue.Empty:
                    pass
                active, poked = rung, False
                for cmd in cmds:
                    if cmd is _noop:
                        poked = True  # input arrived: poll at the short cap, not hot
                    elif cmd is not None:
                        active = True
                        cmd()
                if None in cmds:
                    return
                if self._poll_notifs():
                    active = True
                self._tend_broken()
                if self._inflight and self._poll_xfers():
                    active = True
                self.stats.polls += 1
                if active:
                    last_activity = time.monotonic()
                    idle = min(_HOT_POLL_S, self._max_idle)
                elif poked:
                    idle = min(idle, self._max_idle)
                elif wait > 0 and time.monotonic() - last_activity >= _HOT_S:
                    idle = min(self._deep_idle, idle * 2)
        finally:
            self._shutdown_agent()

    def _idle_cap(self) -> float:
        """On the thread: the longest pause now. `_max_idle` while anything may wait on
        this agent (the daemon's `awake`, notifications held for a broken peer, a broken
        peer to mend), else `_deep_idle`: an idle daemon polls rarely."""
        if self._deep_idle <= self._max_idle or self._held or self._broken:
            return self._max_idle
        try:
            if self.awake():
                return self._max_idle
        except Exception:  # a table changed size under the read: take the short cap
            return self._max_idle
        return self._deep_idle

    def poke(self) -> None:
        """From the event loop, on any input to the daemon: end a deep pause at once (a
        request may follow whose notifications or peer's transfers need this agent's
        progress soon): the thread polls at the short cap again (a keepalive does not
        make it hot: the request's own commands do). Costs nothing unless the thread is
        in a deep pause."""
        if self._deep:
            self._deep = False
            self._cmds.put(_noop)

    def _poll_notifs(self) -> bool:
        """On the thread: poll NIXL's notifications into the bounded queue to the loop."""
        try:
            notifs = self._agent.get_new_notifs()
        except Exception as exc:  # progress errors must not kill the thread
            self._count_error(exc)
            return False
        if not notifs:
            return False
        loop = self._loop
        assert loop is not None
        polled = self.trace.now()
        rx_in, rx_out = self._rx_in, self._rx_out
        bell, now = self.bell, time.monotonic()
        for peer, msgs in notifs.items():
            name = peer if isinstance(peer, str) else peer.decode()
            if bell is not None:
                bell.heard(name, now)
            self.stats.notifs_received += len(msgs)
            kept: list[bytes] = []
            size = 0
            for m in msgs:
                count = rx_in[0] - rx_out[0] + len(kept)
                if count >= _RX_MAX_NOTIFS or rx_in[1] - rx_out[1] + size + len(m) > _RX_MAX_BYTES:
                    self._drop(name)
                    continue
                kept.append(m)
                size += len(m)
            if kept:
                self._rx.append((name, kept, polled, size))
                rx_in[0] += len(kept)
                rx_in[1] += size
        self.stats.notifs_queued = rx_in[0] - rx_out[0]
        if not self._rx_scheduled and self._rx:
            self._rx_scheduled = True
            loop.call_soon_threadsafe(self._drain_rx)
        return True

    def _drop(self, peer: str) -> None:
        self.stats.notifs_dropped += 1
        if self.stats.notifs_dropped % 1000 == 1:  # at a bounded rate
            log.warning(
                "nixl.notifs_dropped",
                peer=peer,
                dropped=self.stats.notifs_dropped,
                max_notifs=_RX_MAX_NOTIFS,
                max_bytes=_RX_MAX_BYTES,
            )

    def _drain_rx(self) -> None:
        """On the loop: feed the queued notifications to the sink, in the order polled."""
        self._rx_scheduled = False  # first: a batch appended from now on schedules again
        sink = self._sink
        assert sink is not None
        rx, rx_out = self._rx, self._rx_out
        while rx:
            peer, msgs, polled, size = rx.popleft()
            rx_out[0] += len(msgs)
            rx_out[1] += size
            try:
                sink(peer, msgs, polled)
            except Exception:  # the sink validates and counts; a bug must not stall the rest
                log.exception("nixl.sink_failed", peer=peer)
        self.stats.notifs_queued = self._rx_in[0] - rx_out[0]

    def _poll_xfers(self) -> bool:
        now = time.monotonic()
        keep: list[_Xfer] = []
        changed = False
        for x in self._inflight:
            try:
                state = self._agent.check_xfer_state(x.handle)
            except Exception as exc:
                self._finish(x, exc)
                self._maybe_reload(x.peer, exc)
                changed = True
                continue
            if state == "DONE":
                self._finish(x, None)
                changed = True
            elif state == "PROC" and now < x.deadline:
                keep.append(x)
            elif state == "PROC":
                # Never release a handle UCX still works on: release does not cancel it
                # (the bytes may land later). Wait for UCX to end it, up to the settle
                # bound; past that, answer Unsettled and keep polling the handle.
                if not x.late:
                    x.late = True
                    self.stats.late += 1
                    late_s = round(now - x.started, 3)
                    log.warning("nixl.transfer_late", trace_id=x.trace_id, after_s=late_s)
                if not x.reported and now >= x.deadline + self._settle_bound():
                    x.reported = True
                    self.stats.unsettled += 1
                    err = Unsettled(f"transfer still in flight after {now - x.started:.3f}s")
                    assert self._loop is not None
                    self._loop.call_soon_threadsafe(_set_exc, x.future, err)
                    changed = True
                keep.append(x)
            else:
                self._finish(x, TransferError(f"transfer state {state!r}"))
                changed = True
        self._inflight = keep
        self.stats.inflight = len(keep)
        if self._remove_later:
            self._removals_due()
        return changed

    def _settle_bound(self) -> float:
        return 2 * self._settle + 1.0 if self._settle > 0 else 60.0

    def _finish(self, x: _Xfer, exc: BaseException | None, *, at_post: bool = False) -> None:
        if x.late:
            self.stats.late -= 1
            if exc is None:
                self.stats.late_landed += 1
        try:
            self._agent.release_xfer_handle(x.handle)
        except Exception as rel_exc:
            self._count_error(rel_exc)
        if x.cleanup is not None:
            try:
                x.cleanup()
            except Exception as cl_exc:
                self._count_error(cl_exc)
        loop = self._loop
        assert loop is not None
        if x.settled is not None:  # before the answer: the caller sees it first
            loop.call_soon_threadsafe(x.settled)
        if x.reported:  # answered Unsettled already: UCX has ended it now
            self.stats.unsettled -= 1
            return
        if exc is None:
            self._fresh.pop(x.peer, None)
            self.stats.transfers_done += 1
            if x.notifies and self.bell is not None:
                self.bell.ring(x.peer)  # the peer polls the WRITE's notification now
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
        settled: Callable[[], None] | None = None,
        *,
        post_by: float = 0.0,
    ) -> XferTiming:
        """`submit`, then wait for the transfer's answer."""
        return await self.submit(
            op,
            local,
            remote,
            peer,
            notif,
            timeout,
            nbytes,
            local_mem,
            remote_mem,
            trace_id,
            settled,
            post_by=post_by,
        )

    def submit(
        self,
        op: str,
        local: np.ndarray,
        remote: np.ndarray,
        peer: str,
        notif: bytes,
        timeout: float,
        nbytes: int,
        local_mem: str = "DRAM",
        remote_mem: str = "DRAM",
        trace_id: str = "",
        settled: Callable[[], None] | None = None,
        *,
        post_by: float = 0.0,
    ) -> asyncio.Future[XferTiming]:
        """Hand a WRITE or READ of Nx3 (addr, len, dev) descriptor arrays to the NIXL
        thread now (on the event loop, without waiting for a turn of it); the future is its
        answer. An idle thread is waited for until it took the WRITE or READ (`_hand`);
        a busy one gets the CPU yielded to it: the thread, woken by the hand-off, needs
        the GIL to post, which this thread would otherwise keep until the loop next sleeps
        (measured on the layer-wise path here: the pick-up waited 90-350 us behind the rest of the
        loop's turn).

        The answer: the seconds spent posting it, and from the start of posting to
        completion (so including the post: a same-host copy may finish inside it). The
        notification is delivered to the peer by NIXL when the transfer completes. Raises
        (here, or as the answer) TransferError (PeerDisconnected when the peer is gone,
        PeerUnknown when NIXL holds no metadata for it or for the remote memory named,
        Timeout past `timeout`). `trace_id`: the
        request the stage trace records this transfer under. `settled`: called once on the
        event loop when nothing more of the transfer can land (UCX ended it, or it was
        never posted), before the answer; later than the answer for one answered
        Unsettled. `post_by`: the freshness fence (`Transport.transfer`), checked on the
        NIXL thread right before posting.
        """
        loop = self._loop
        try:
            notif = self._seal(peer, notif) if notif else notif
            if loop is None or self._thread is None:
                raise TransferError("NIXL engine is not running")
        except BaseException:
            if settled is not None:
                settled()
            raise
        fut: asyncio.Future[XferTiming] = loop.create_future()

        trace = self.trace

        def run() -> None:
            agent = self._agent
            started = time.monotonic()
            if trace.on and trace_id:
                trace.mark(trace_id, "nixl.picked")
            if post_by and started > post_by:
                self.stats.transfers_fenced += 1
                late = f"{started - post_by:.3f}s past its post fence (a stall): not posted"
                if settled is not None:  # nothing was posted
                    loop.call_soon_threadsafe(settled)
                loop.call_soon_threadsafe(_set_exc, fut, TransferError(f"{op} {late}"))
                return
            try:
                ldesc = agent.get_xfer_descs(local, local_mem)
                rdesc = agent.get_xfer_descs(remote, remote_mem)
                handle = agent.initialize_xfer(op, ldesc, rdesc, peer, notif)
            except BaseException as exc:
                self.stats.transfers_failed += 1
                self._count_error(exc)
                if settled is not None:  # nothing was posted
                    loop.call_soon_threadsafe(settled)
                loop.call_soon_threadsafe(_set_exc, fut, translate(exc, posting=True))
                self._maybe_reload(peer, exc)
                return
            self.stats.transfers_posted += 1
            self.stats.bytes_moved += nbytes
            x = _Xfer(handle, fut, started + timeout, started, trace_id, peer)
            x.settled = settled
            x.notifies = bool(notif)
            if trace.on and trace_id:
                trace.mark(trace_id, "nixl.posted")
            try:
                state = agent.transfer(handle)
            except BaseException as exc:
                self._finish(x, exc, at_post=True)
                self._maybe_reload(peer, exc)
                return
            x.post_s = time.monotonic() - started
            if state == "DONE":
                self._finish(x, None)
            else:
                self._inflight.append(x)

        if not self._hand(run):
            os.sched_yield()  # releases the GIL and the CPU: see above
        return fut

    async def file_transfer(
        self,
        op: str,
        pieces: list[tuple[int, int, int]],
        timeout: float,  # noqa: ASYNC109 - enforced by the NIXL thread, which owns the handle
        mem: str = "DRAM",
        dev: int = 0,
    ) -> XferTiming:
        """Move bytes between registered memory and files: `op` "WRITE" (memory -> file)
        or "READ" (file -> memory); each piece is (address, length, fd), the file side at
        offset 0 of its fd. `mem` "DRAM" (host memory: the POSIX backend) or "VRAM"
        (GPU `dev`'s memory, registered as VRAM: the GDS backend, straight between the
        GPU and the file; not tested end to end). The files are registered for this transfer
        only. Raises TransferError (a short read or write, e.g. a full disk or a
        truncated file, is one; VRAM without the GDS backend is one)."""
        loop = self._loop
        if loop is None or self._thread is None:
            raise TransferError("NIXL engine is not running")
        if not self.file_backend:
            raise TransferError("NIXL engine has no file backend")
        if mem not in ("DRAM", "VRAM"):
            raise TransferError(f"file transfers move DRAM or VRAM, not {mem!r}")
        if mem == "VRAM" and not self.gds:
            raise TransferError(
                "VRAM <-> file needs NIXL's GDS backend (a visible GPU and the GDS plugin)"
                + (f": {self.gds_problem}" if self.gds_problem else "")
            )
        backend = GDS_BACKEND if mem == "VRAM" else FILE_BACKEND
        fut: asyncio.Future[XferTiming] = loop.create_future()
        nbytes = sum(n for _, n, _ in pieces)

        def run() -> None:
            agent = self._agent
            started = time.monotonic()
            reg: Any = None
            try:
                reg = agent.register_memory(
                    [(0, n, fd, "") for _, n, fd in pieces], "FILE", backends=[backend]
                )
                local = agent.get_xfer_descs([(a, n, dev) for a, n, _ in pieces], mem)
                files = agent.get_xfer_descs([(0, n, fd) for _, n, fd in pieces], "FILE")
                handle = agent.initialize_xfer(op, local, files, self.name, b"", backends=[backend])
            except BaseException as exc:
                if reg is not None:
                    _quietly(agent.deregister_memory, reg)
                self.stats.transfers_failed += 1
                self._count_error(exc)
                loop.call_soon_threadsafe(_set_exc, fut, translate(exc, posting=True))
                return
            self.stats.transfers_posted += 1
            self.stats.bytes_moved += nbytes
            x = _Xfer(
                handle,
                fut,
                started + timeout,
                started,
                cleanup=lambda: agent.deregister_memory(reg),
            )
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
        """Send one notification and wait until it went out (see `post_notif`); every
        failure is one of posting (see `translate`)."""
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[None] = loop.create_future()

        def done(exc: KvdError | None) -> None:
            if exc is None:
                _set_result(fut, None)
            else:
                _set_exc(fut, exc)

        self.post_notif(peer, msg, done, trace_id)
        await fut

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
        (only if `report_ok`). No task and no future: the caller's loop goes on once the
        thread took it, if it was idle (`_hand`), else at once.

        A notification to a peer whose endpoint UCX failed (a link stalled past
        TCP_USER_TIMEOUT) is held, in order with the peer's later ones, while a fresh
        endpoint is made, and sent then; `done` gets the failure only if that takes
        longer than the hold bound (`2 x settle + 1 s`, at most `_HOLD_MAX_S`)."""
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
            self._send_or_hold(_Notif(peer, msg, done, report_ok, time.monotonic()))

        self._hand(send)

    def _hand(self, cmd: Callable[[], None]) -> bool:
        """Queue `cmd` for the NIXL thread. If the thread is idle (waiting on the queue),
        wait until it took the command, at most `_HAND_S`: the woken thread needs the GIL,
        which this thread would otherwise keep until its loop next sleeps, and what the
        loop has left to do in its turn is rarely on the request's path (measured on the
        stage trace of `kvd bench --only control`: D's READ was picked up 190 us after
        its hand-off, D's registration 136, P's PullAck 96; 43-52 us with the wait).
        True if it waited (a thread that is busy polling transfers takes the command on
        its next round: `submit` then yields the CPU instead)."""
        if not self._idle_wait:
            self._cmds.put(cmd)
            return False
        picked = _thread.allocate_lock()
        picked.acquire()

        def run() -> None:
            picked.release()
            cmd()

        self._cmds.put(run)
        if picked.acquire(timeout=_HAND_S):
            self.stats.hands_waited += 1
        else:
            self.stats.hands_late += 1
        return True

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

    async def add_remote(self, md: bytes, *, mend: bool = False) -> str:
        """Load a peer's metadata (full, or one more region's). `mend`: if UCX fails our
        endpoint to it, make a fresh one from the metadata loaded so far (see
        `post_notif`); for peers that dialed us, which we cannot handshake with again.
        A peer we dial is not mended here: a failure reaches the caller, who handshakes
        afresh (and so learns whether it restarted, which a fresh endpoint made from
        the old metadata would hide: sends into it look fine until it fails)."""

        def add(a: Any) -> str:
            return self._add_remote(md, mend=mend)

        return await self.call(add)

    async def refresh_remote(self, name: str, md: bytes) -> bool:
        """Load `name`'s metadata afresh from `md` (its full metadata, as a handshake
        sent it): NIXL only ever adds a peer's regions, so sections of regions the peer
        has since dropped stay loaded, and one that overlaps a region it registered later
        at the same addresses makes NIXL refuse transfers there (NOT_FOUND). Done only
        while no transfer to it is in flight (a removed peer's transfers are not looked
        at); False: not done (the caller tries again at the next handshake)."""

        def refresh(a: Any) -> bool:
            if self._busy(name):
                self.stats.refreshes_deferred += 1
                return False
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:
                self._count_error(exc)
            self._agent.add_remote_agent(md)
            if name in self._mds:
                self._mds[name] = [md]
            self._remove_later.discard(name)
            self.stats.peers_refreshed += 1
            return True

        return await self.call(refresh)

    async def mend_from(self, name: str, md: bytes) -> None:
        """Mend `name` from now on (see `add_remote`), from `md`, its full metadata as it
        sent it in a handshake: for a peer first loaded as one we dialed (not mended)
        that has now dialed us. Its regions loaded later are added to it as they come."""

        def mend(a: Any) -> None:
            self._mend_from(name, md)

        await self.call(mend)

    def _mend_from(self, name: str, md: bytes) -> None:
        """On the thread: `mend_from`."""
        if name not in self._mds:
            self._mds[name] = [md]

    async def remove_remote(self, name: str) -> None:
        """Forget a peer. While a transfer to it is in flight its NIXL entry stays until
        the transfer ends: NIXL answers NOT_FOUND for a transfer whose peer was removed
        without looking at it (and releasing it then forgets it in UCX, where it goes on),
        so removing it earlier would turn a transfer in flight into one that may land
        after it was reported failed."""

        def remove(a: Any) -> None:
            self._remove_remote(name)

        await self.call(remove)

    def _add_remote(self, md: bytes, *, mend: bool) -> str:
        """On the thread: `add_remote`."""
        raw = self._agent.add_remote_agent(md)
        name = raw.decode() if isinstance(raw, bytes) else str(raw)
        self._remove_later.discard(name)  # wanted again: the entry stays
        if mend or name in self._mds:
            self._mds.setdefault(name, []).append(md)
        return name

    def _remove_remote(self, name: str) -> None:
        """On the thread: `remove_remote`."""
        self._mds.pop(name, None)
        self._reloaded.pop(name, None)
        self._broken.pop(name, None)
        self._fresh.pop(name, None)
        if name in self._unloaded:  # already gone from NIXL (a reload that failed)
            self._unloaded.discard(name)
            return
        if self._busy(name):
            self._remove_later.add(name)
            self.stats.removals_deferred += 1
            return
        self._agent.remove_remote_agent(name)

    def _busy(self, peer: str) -> bool:
        return any(x.peer == peer for x in self._inflight)

    def _removals_due(self) -> None:
        """Carry out the removals deferred while transfers to the peer were in flight."""
        for name in [n for n in self._remove_later if not self._busy(n)]:
            self._remove_later.discard(name)
            try:
                self._agent.remove_remote_agent(name)
            except Exception as exc:
                self._count_error(exc)

    # ---------------------------------------------------------------- failed endpoints

    def _send_or_hold(self, n: _Notif) -> None:
        """On the thread: send `n` now, or hold it behind the peer's held ones."""
        held = self._held.get(n.peer)
        if held is not None:
            held.append(n)
            return
        try:
            self._agent.send_notif(n.peer, n.msg)
        except BaseException as exc:
            if not self._failed_endpoint(n.peer, exc):
                self._answer(n, translate(exc, posting=True))
                return
            if self._fresh.pop(n.peer, None) is not None:
                # the endpoint we just made failed too: the peer is gone (a dead process's
                # address refuses us), not behind a cut link; its callers must know now
                self._give_up(n.peer)
                self._answer(n, translate(exc, posting=True))
                return
            self._held[n.peer] = collections.deque([n])
            self.stats.notifs_held += 1
            self._mend(n.peer, time.monotonic())
            return
        self._fresh.pop(n.peer, None)
        self.stats.notifs_sent += 1
        if self.bell is not None:
            self.bell.ring(n.peer)
        self._answer(n, None)

    def _answer(self, n: _Notif, err: KvdError | None) -> None:
        if err is not None or n.report_ok:
            loop = self._loop
            assert loop is not None
            loop.call_soon_threadsafe(n.done, err)

    def _failed_endpoint(self, peer: str, exc: BaseException) -> bool:
        """Whether `exc` says UCX failed our endpoint to a peer we can make a fresh one
        to (its metadata is loaded): RemoteDisconnect, or NotFound after a reload that
        could not connect yet (the peer's entry is then missing)."""
        if peer not in self._mds:
            return False
        name = type(exc).__name__
        return "RemoteDisconnect" in name or ("NotFound" in name and peer in self._unloaded)

    def _maybe_reload(self, peer: str, exc: BaseException) -> None:
        """A transfer found our endpoint to `peer` failed: make a fresh one (held
        notifications go out on it), unless the one we just made failed already."""
        if not self._failed_endpoint(peer, exc):
            return
        if self._fresh.pop(peer, None) is not None:
            self._give_up(peer)
            return
        self._mend(peer, time.monotonic())

    def _give_up(self, peer: str) -> None:
        """Stop mending `peer`: fail what is held for it (its callers see it gone)."""
        self._broken.pop(peer, None)
        self.stats.peers_given_up += 1
        held = self._held.pop(peer, None)
        gone = PeerDisconnected(f"peer {peer!r} is gone: a fresh endpoint to it failed too")
        gone.at_post = True
        while held:
            self._answer(held.popleft(), gone)

    def _mend(self, peer: str, now: float) -> None:
        """UCX failed our endpoint to `peer` (its operations ended, their queue dropped),
        but NIXL keeps the failed endpoint, so every later post to the peer would fail
        too: reload the peer's metadata (the same incarnation: a restarted peer is the
        registrar's business) for a fresh endpoint, at most every `_RELOAD_EVERY_S`
        (connecting fails while the link is still down). Then send what is held."""
        since = self._broken.setdefault(peer, now)
        if now - self._reloaded.get(peer, -1e9) < _RELOAD_EVERY_S or self._busy(peer):
            # (a failed endpoint fails every transfer on it: they end soon; removing the
            # peer before they did would make NIXL answer NOT_FOUND without looking)
            return
        self._reloaded[peer] = now
        try:
            self._agent.remove_remote_agent(peer)
        except Exception as rm_exc:
            self._count_error(rm_exc)
        self._unloaded.add(peer)
        try:
            for md in self._mds[peer]:
                self._agent.add_remote_agent(md)
        except Exception as add_exc:
            self._count_error(add_exc)
            if self.stats.reconnect_failures % 50 == 0:
                log.info("nixl.reconnect_failed", peer=peer, error=str(add_exc))
            self.stats.reconnect_failures += 1
            return
        del self._broken[peer]
        self._unloaded.discard(peer)
        self._fresh[peer] = now
        self.stats.reconnects += 1
        log.info("nixl.reconnected", peer=peer, broken_s=round(now - since, 3))
        held = self._held.pop(peer, None)
        while held:
            self._send_or_hold(held.popleft())
            if peer in self._held:  # failed again: the rest stays behind it, in order
                self._held[peer].extend(held)
                return

    def _tend_broken(self) -> None:
        """On the thread, each turn: retry broken peers (while something is held for
        them, or for the hold bound; later traffic to the peer re-arms it: nothing is
        retried forever); fail held notifications past the hold bound."""
        if not self._broken and not self._held:
            return
        now = time.monotonic()
        bound = self._hold_bound()
        for peer, since in list(self._broken.items()):
            if peer not in self._mds:
                del self._broken[peer]
            elif peer in self._held or now - since <= bound:
                self._mend(peer, now)
            else:
                del self._broken[peer]
        for peer, held in list(self._held.items()):
            if peer not in self._mds:  # forgotten meanwhile: nothing will mend it
                gone: KvdError = PeerUnknown(f"peer {peer!r} was forgotten")
                while held:
                    self._answer(held.popleft(), gone)
                del self._held[peer]
                continue
            while held and now - held[0].since > bound:
                self.stats.notifs_expired += 1
                late = PeerDisconnected(f"no endpoint to {peer!r} for {bound:.1f}s")
                late.at_post = True
                self._answer(held.popleft(), late)
            if not held:
                del self._held[peer]

    def _hold_bound(self) -> float:
        return min(2 * self._settle + 1.0, _HOLD_MAX_S) if self._settle > 0 else _HOLD_MAX_S


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


def machine_guid() -> int:
    """UCX's id of this machine (`ucs_machine_guid`: its MAC address and host name), from
    the libucs NIXL's UCX backend loaded into this process: what UCX itself compares to
    tell peers on one machine (cma, shared memory) from those on another. 0 when no libucs
    is loaded (no UCX agent yet) or it lacks the symbol."""
    import ctypes

    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            paths = {
                line.split(maxsplit=5)[-1].strip()
                for line in maps
                if "/libucs" in line and ".so" in line
            }
    except OSError:
        return 0
    for path in sorted(paths):
        if not os.path.basename(path).startswith("libucs"):
            continue
        try:
            fn = ctypes.CDLL(path).ucs_machine_guid
        except (OSError, AttributeError):
            continue
        fn.restype, fn.argtypes = ctypes.c_uint64, []
        return int(fn()) & 0xFFFFFFFFFFFFFFFF
    return 0


def rdma_devices(root: str = "/sys/class/infiniband") -> bool:
    """Whether the host has an RDMA device (InfiniBand, RoCE, EFA: any verbs device)."""
    try:
        with os.scandir(root) as it:
            return any(True for _ in it)
    except OSError:
        return False


def _quietly(fn: Callable[[Any], Any], arg: Any) -> None:
    with contextlib.suppress(Exception):  # after a failure: the first error is reported
        fn(arg)


def _set_result(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exc(fut: asyncio.Future[Any], exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _gpu_visible() -> bool:
    """An NVIDIA GPU device node exists (cheap: NIXL's GDS plugin is not even tried
    without one, so CPU-only hosts log nothing about it)."""
    import glob

    return bool(glob.glob("/dev/nvidia[0-9]*"))


def _probe_gds(agent: Any) -> str:
    """'' when the GDS backend registers a file (in the temporary directory); otherwise
    why not: cuFile refuses every file where it has neither its kernel driver
    (nvidia-fs) nor its compatibility mode (seen on an H100 VM: cuFileHandleRegister
    failed, err 5027)."""
    import tempfile

    fd, path = tempfile.mkstemp(prefix="kvd-gds-probe-")
    try:
        os.ftruncate(fd, 4096)
        reg = agent.register_memory([(0, 4096, fd, "")], "FILE", backends=[GDS_BACKEND])
        agent.deregister_memory(reg)
        return ""
    except Exception as exc:
        return f"cuFile cannot register a file in {os.path.dirname(path)}: {translate(exc).message}"
    finally:
        os.close(fd)
        os.unlink(path)


def _load_cuda_runtime() -> None:
    """With a GPU, prepare UCX for VRAM before the agent's backend starts it: UCX opens
    its CUDA modules then, and one of them (`libucm_cuda`) needs libcudart, which a
    pip-installed CUDA keeps outside the loader's path: importing torch loads it (and
    creates no CUDA context). And UCX's memory-type cache is turned off (below). On the
    H100 VM tried, VRAM registrations failed (NIXL_ERR_BACKEND, "VRAM memory is detected
    as host by UCX") until the cache was off; the image had libcudart on the loader's
    path, so the import's part was not isolated there."""
    if not _gpu_visible():
        return
    # UCX's memory-type cache took a worker's KV tensor opened here through CUDA IPC for
    # host memory (on the H100: memory this process allocated itself registered as VRAM,
    # IPC-opened memory did not, until the cache was off). Without the cache UCX asks the
    # driver at each registration.
    os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")
    try:
        import torch
    except ImportError:
        log.info("cuda_runtime_not_preloaded", reason="torch is not installed")
        return
    log.info("cuda_runtime_loaded", cuda=str(getattr(torch.version, "cuda", None)))


def _noop() -> None:
    """A command that only wakes the thread (`NixlEngine.poke`)."""
