"""Mailboxes and calls: the only way actors talk to each other.

A mailbox is a bounded anyio memory stream. `post` never blocks: a full mailbox raises
`Busy`, which the gateway turns into a BUSY reply. `call` posts a message carrying an
asyncio future and awaits the answer (a one-shot reply channel).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import anyio
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from kvd_client.errors import Busy

M = TypeVar("M")
R = TypeVar("R")


@dataclass
class Call(Generic[R]):
    """Base for messages that want an answer: the receiver resolves `reply`."""

    reply: asyncio.Future[R] = field(default_factory=lambda: asyncio.get_running_loop().create_future(), kw_only=True)

    def resolve(self, value: R) -> None:
        if not self.reply.done():
            self.reply.set_result(value)

    def fail(self, exc: BaseException) -> None:
        if not self.reply.done():
            self.reply.set_exception(exc)


class Mailbox(Generic[M]):
    """A bounded mailbox owned by one actor."""

    def __init__(self, name: str, size: int) -> None:
        self.name = name
        self.size = size
        send, recv = anyio.create_memory_object_stream[M](max_buffer_size=size)
        self._send: MemoryObjectSendStream[M] = send
        self._recv: MemoryObjectReceiveStream[M] = recv
        self.rejected = 0

    def post(self, msg: M) -> None:
        """Enqueue without blocking; raise Busy when full."""
        try:
            self._send.send_nowait(msg)
        except anyio.WouldBlock:
            self.rejected += 1
            raise Busy(f"the {self.name} mailbox is full ({self.size})") from None

    async def call(self, msg: Call[R]) -> R:
        self.post(msg)  # type: ignore[arg-type]
        return await msg.reply

    def depth(self) -> int:
        return self._send.statistics().current_buffer_used

    async def __aiter__(self) -> AsyncIterator[M]:
        async for msg in self._recv:
            yield msg

    async def receive(self) -> M:
        return await self._recv.receive()

    def receive_nowait(self) -> M:
        return self._recv.receive_nowait()

    def stats(self) -> dict[str, Any]:
        return {"depth": self.depth(), "size": self.size, "rejected": self.rejected}
