"""Mailboxes and calls: the only way actors talk to each other.

A mailbox is a bounded anyio memory stream with one rule for what may be refused, by
the message's type, never by the call site:
- input from outside the daemon (`Outside`: a client request, a peer's heartbeat or
  probe, a side-channel request) is refused when the mailbox is full: `post` raises
  `Busy`, which the edge answers BUSY (or drops a heartbeat: the next one comes);
- every other message is a notice between actors (a session closed, a region changed,
  a peer lost, an answer to our own transfer): it is never refused or dropped. Their
  number follows work already accepted, not outside load, and refusing one would leave
  two actors disagreeing. Beyond the bound they wait, in order, in an overflow queue
  that refills the mailbox as the receiver takes messages; outside input is refused
  meanwhile.
`call` posts a message carrying an asyncio future and awaits the answer (a one-shot
reply channel).

Time: every actor reads the daemon's one `Clock` (daemon time, which does not count the
daemon's own stalls: `kvd.core.clock`), never `time.monotonic()` itself, and sleeps until
its next deadline in that time with `receive_before`.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
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
    """A bounded mailbox owned by one actor."""

    def __init__(self, name: str, size: int, clock: Clock | None = None) -> None:
        self.name = name
        self.size = size
        self.clock = clock or SYSTEM_CLOCK
        send, recv = anyio.create_memory_object_stream[M](max_buffer_size=size)
        self._send: MemoryObjectSendStream[M] = send
        self._recv: MemoryObjectReceiveStream[M] = recv
        self._overflow: deque[M] = deque()
        self.rejected = 0

    def post(self, msg: M) -> None:
        """Enqueue without blocking. Outside input is refused with Busy when the mailbox is
        full; a notice between actors never is (see the module docstring)."""
        if self._overflow or not self._offer(msg):
            if isinstance(msg, Outside):
                self.rejected += 1
                raise Busy(f"the {self.name} mailbox is full ({self.size})")
            self._overflow.append(msg)

    def _offer(self, msg: M) -> bool:
        try:
            self._send.send_nowait(msg)
        except anyio.WouldBlock:
            return False
        return True

    def _refill(self) -> None:
        overflow = self._overflow
        while overflow:
            try:
                self._send.send_nowait(overflow[0])
            except anyio.WouldBlock:
                return
            overflow.popleft()

    async def call(self, msg: Call[R]) -> R:
        self.post(msg)  # type: ignore[arg-type]
        return await msg.reply

    def depth(self) -> int:
        return self._send.statistics().current_buffer_used + len(self._overflow)

    async def __aiter__(self) -> AsyncIterator[M]:
        async for msg in self._recv:
            if self._overflow:
                self._refill()
            yield msg

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
        msg = await self._recv.receive()
        if self._overflow:
            self._refill()
        return msg

    def receive_nowait(self) -> M:
        msg = self._recv.receive_nowait()
        if self._overflow:
            self._refill()
        return msg

    def stats(self) -> dict[str, Any]:
        return {"depth": self.depth(), "size": self.size, "rejected": self.rejected}
