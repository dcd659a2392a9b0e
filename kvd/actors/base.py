"""Mailboxes and calls: the only way actors talk to each other.

A mailbox is an anyio memory stream with one rule for what may be refused, by the
message's type, never by the call site:
- input from outside the daemon (`Outside`: a client request, a peer's heartbeat or
  probe, a side-channel request) is bounded: once `size` of them wait, `post` raises
  `Busy`, which the edge answers BUSY (or drops a heartbeat: the next one comes);
- every other message is a notice between actors (a session closed, a region changed,
  a peer lost, the outcome of the actor's own work): it is never refused or dropped, and
  it does not count against the bound. Their number follows work already accepted, not
  outside load; refusing one would leave two actors disagreeing, and counting them
  would let an actor's own bookkeeping (an outcome per transfer) turn outside requests
  away under a burst it had accepted.
All messages are received in the order they were posted.
`call` posts a message carrying an asyncio future and awaits the answer (a one-shot
reply channel).

Time: every actor reads the daemon's one `Clock` (daemon time, which does not count the
daemon's own stalls: `kvd.core.clock`), never `time.monotonic()` itself, and sleeps until
its next deadline in that time with `receive_before`.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

import anyio
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from kvd_client.errors import Busy

from kvd.core.clock import StallClock

M = TypeVar("M")
R = TypeVar("R")


class Outside:
    """Marker base of messages that carry input from outside the daemon: a full mailbox
    refuses them (`Mailbox.post` raises Busy). Everything else is never refused."""

    __slots__ = ()


@dataclass
class Call(Generic[R]):
    """Base for messages that want an answer: the receiver resolves `reply`."""

    reply: asyncio.Future[R] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future(), kw_only=True
    )

    def resolve(self, value: R) -> None:
        if not self.reply.done():
            self.reply.set_result(value)

    def fail(self, exc: BaseException) -> None:
        if not self.reply.done():
            self.reply.set_exception(exc)


class Clock:
    """The daemon's clock: daemon time from the raw monotonic clock (see `StallClock`).

    `run` observes it every `tick` so that a stall is measured even while every actor
    sleeps; any read (`now`) observes it too, so the first code to run after a stall
    already sees daemon time, not the jump.
    """

    def __init__(self, *, tick: float = 0.1, max_gap: float = 1.0) -> None:
        self.core = StallClock(time.monotonic(), tick=tick, max_gap=max_gap)

    def now(self) -> float:
        return self.core.observe(time.monotonic())

    @property
    def stall_count(self) -> int:
        return self.core.stall_count

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        seen = 0
        while True:
            self.now()
            if self.core.stall_count != seen:
                seen = self.core.stall_count
                stall = self.core.last_stall
                if stall is not None:
                    _log_stall(stall.seconds, self.core.stalled)
            await anyio.sleep(self.core.tick)


def _log_stall(seconds: float, total: float) -> None:
    import structlog

    structlog.get_logger("kvd.clock").warning(
        "daemon_stalled", seconds=round(seconds, 3), total_stalled_s=round(total, 3)
    )


SYSTEM_CLOCK: Final = Clock(max_gap=float("inf"))
"""For mailboxes built without a daemon (tests): plain monotonic time. Nothing ticks it,
so it must not take the gaps between its reads for stalls."""


class Mailbox(Generic[M]):
    """A mailbox owned by one actor; `size` bounds the outside input waiting in it."""

    def __init__(self, name: str, size: int, clock: Clock | None = None) -> None:
        self.name = name
        self.size = size
        self.clock = clock or SYSTEM_CLOCK
        send, recv = anyio.create_memory_object_stream[M](max_buffer_size=math.inf)
        self._send: MemoryObjectSendStream[M] = send
        self._recv: MemoryObjectReceiveStream[M] = recv
        self._outside = 0
        self.rejected = 0

    def post(self, msg: M) -> None:
        """Enqueue without blocking. Outside input is refused with Busy once `size` of it
        waits; a notice between actors never is (see the module docstring)."""
        if isinstance(msg, Outside):
            if self._outside >= self.size:
                self.rejected += 1
                raise Busy(f"the {self.name} mailbox is full ({self.size})")
            self._outside += 1
        self._send.send_nowait(msg)

    def _took(self, msg: M) -> M:
        if isinstance(msg, Outside):
            self._outside -= 1
        return msg

    async def call(self, msg: Call[R]) -> R:
        self.post(msg)  # type: ignore[arg-type]
        return await msg.reply

    def depth(self) -> int:
        return self._send.statistics().current_buffer_used

    @property
    def outside(self) -> int:
        """Outside input waiting (what `size` bounds)."""
        return self._outside

    async def __aiter__(self) -> AsyncIterator[M]:
        async for msg in self._recv:
            yield self._took(msg)

    async def receive_before(self, deadline: float | None) -> M | None:
        """The next message, or None once `deadline` (daemon time) passes first.

        This is how an actor sleeps until either its next timer or its next message. A
        stall during the sleep does not count: the deadline is re-checked in daemon time.
        """
        if deadline is None:
            return await self.receive()
        while True:
            left = deadline - self.clock.now()
            if left <= 0:
                return None
            with anyio.move_on_after(left):
                return await self.receive()

    async def receive(self) -> M:
        return self._took(await self._recv.receive())

    def receive_nowait(self) -> M:
        return self._took(self._recv.receive_nowait())

    def stats(self) -> dict[str, Any]:
        return {
            "depth": self.depth(),
            "outside": self._outside,
            "size": self.size,
            "rejected": self.rejected,
        }


class StartFailed(Exception):
    """The daemon cannot start for a reason outside its code (the host, its devices, the
    configuration): logged as one error line, `event` with `fields`, with no traceback;
    the process exits 1."""

    def __init__(self, event: str, **fields: Any) -> None:
        super().__init__(event)
        self.event = event
        self.fields = fields
