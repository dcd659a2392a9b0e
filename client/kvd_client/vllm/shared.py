"""One kvd client per process and engine, shared by every connector of that process.

vLLM builds its connectors separately (the scheduler-side and worker-side KV connectors,
and later an encoder-cache connector), yet with TP=1 they all live in one process; they
must share one daemon session, or the daemon would see one engine as several. So this
module keeps a registry of `SharedClient`s, created lazily on first use, keyed by
(daemon socket, engine id, TP rank) and by the creating pid (a forked child never reuses
its parent's ZMQ socket). The scheduler side counts as rank 0: it shares rank 0's session
when both run in one process (TP=1); a process holding several ranks' workers (tests
simulating TP > 1) gets one session per rank, as one process per rank would.

Rules:
- The underlying `KvdClient` is not thread-safe; every call goes through `SharedClient.call`
  or `SharedClient.poll`, which hold one lock.
- `drain_events` is called only by `poll`, which fans the events out to every subscriber:
  each connector sees every event of the session and picks its own.
- Nothing here imports vLLM or torch, so any connector (KV now, EC later) can build on it.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import threading
from collections import deque
from collections.abc import Callable
from typing import Final, ParamSpec, TypeVar

from kvd_client import wire
from kvd_client.client import Event, KvdClient
from kvd_client.errors import KvdError

log = logging.getLogger("kvd_client.vllm")

P = ParamSpec("P")
R = TypeVar("R")

MAX_QUEUED_EVENTS: Final = 1 << 20
"""Events a subscriber that never takes them may hold before the oldest are dropped."""


class Subscription:
    """One connector's view of the shared event stream."""

    def __init__(self, owner: SharedClient) -> None:
        self._owner = owner
        self._queue: deque[Event] = deque(maxlen=MAX_QUEUED_EVENTS)

    def take(self) -> list[Event]:
        """Poll the daemon (never blocks) and return this subscriber's new events."""
        return self._owner.poll(self)

    def close(self) -> None:
        self._owner.unsubscribe(self)


class SharedClient:
    """A `KvdClient` shared by the connectors of one process (see the module docstring)."""

    def __init__(
        self, socket_path: str, engine_id: str, *, role: str, tp_rank: int, timeout: float
    ) -> None:
        self._lock = threading.RLock()
        self.client = KvdClient(
            socket_path, role=role, engine_id=engine_id, tp_rank=tp_rank, timeout=timeout
        )
        self.welcome: wire.Welcome = self.client.connect()
        self.pid = os.getpid()
        self.rank_key = max(tp_rank, 0)
        self._subs: list[Subscription] = []
        self._closed = False

    @property
    def socket_path(self) -> str:
        return self.client.socket_path

    @property
    def engine_id(self) -> str:
        return self.client.engine_id

    def subscribe(self) -> Subscription:
        sub = Subscription(self)
        with self._lock:
            self._subs.append(sub)
        return sub

    def unsubscribe(self, sub: Subscription) -> None:
        with self._lock:
            if sub in self._subs:
                self._subs.remove(sub)
            last = not self._subs
        if last:
            _release(self)

    def call(self, fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """Run one client call under the lock (scheduler calls return at once)."""
        with self._lock:
            return fn(*args, **kwargs)

    def poll(self, taker: Subscription | None = None) -> list[Event]:
        """Drain the daemon's events without blocking and hand them to every subscriber;
        returns (and clears) `taker`'s queue, all under the lock."""
        with self._lock:
            if not self._closed:
                try:
                    events = self.client.drain_events()
                except KvdError as exc:  # e.g. a reconnect that failed half way: retried next poll
                    log.warning("kvd: draining events failed: %s", exc)
                    events = []
                for sub in self._subs:
                    sub._queue.extend(events)
            if taker is None:
                return []
            out = list(taker._queue)
            taker._queue.clear()
            return out

    def close(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.client.close()


_REGISTRY: dict[tuple[int, str, str, int], SharedClient] = {}
_REGISTRY_LOCK = threading.Lock()


def shared_client(
    socket_path: str, engine_id: str, *, role: str, tp_rank: int = -1, timeout: float = 10.0
) -> SharedClient:
    """This process's client for (socket, engine), connected on first use.

    `role` and `tp_rank` only matter to the call that creates it: a worker-role session
    also receives the events of requests its engine's scheduler announced elsewhere.
    """
    key = (os.getpid(), socket_path, engine_id, max(tp_rank, 0))
    with _REGISTRY_LOCK:
        got = _REGISTRY.get(key)
        if got is None:
            got = SharedClient(socket_path, engine_id, role=role, tp_rank=tp_rank, timeout=timeout)
            _REGISTRY[key] = got
        return got


def _release(sc: SharedClient) -> None:
    with _REGISTRY_LOCK:
        key = (sc.pid, sc.socket_path, sc.engine_id, sc.rank_key)
        if _REGISTRY.get(key) is sc:
            del _REGISTRY[key]
    sc.close()


@atexit.register
def _close_all() -> None:
    with _REGISTRY_LOCK:
        mine = [sc for (pid, _, _, _), sc in _REGISTRY.items() if pid == os.getpid()]
        _REGISTRY.clear()
    for sc in mine:
        with contextlib.suppress(Exception):  # interpreter shutdown: best effort
            sc.close()
