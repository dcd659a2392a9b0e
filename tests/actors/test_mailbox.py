"""Mailboxes on a real event loop: bounded, BUSY when full, calls answered through futures."""

from __future__ import annotations

from dataclasses import dataclass

import anyio
import pytest
from kvd_client.errors import Busy

from kvd.actors.base import Call, Mailbox, Outside


@dataclass
class Double(Outside, Call[int]):
    value: int


@dataclass(frozen=True)
class In(Outside):
    """Input from outside the daemon: refused when the mailbox is full."""

    n: int


async def test_full_mailbox_is_busy_and_loses_nothing() -> None:
    box: Mailbox[In] = Mailbox("t", 2)
    box.post(In(1))
    box.post(In(2))
    with pytest.raises(Busy, match="t mailbox is full"):
        box.post(In(3))
    assert box.depth() == 2 and box.stats()["rejected"] == 1
    assert [box.receive_nowait(), box.receive_nowait()] == [In(1), In(2)]
    box.post(In(3))
    assert box.receive_nowait() == In(3)


async def test_call_round_trip_and_failure() -> None:
    box: Mailbox[Double] = Mailbox("doubler", 4)

    async def actor() -> None:
        async for msg in box:
            if msg.value < 0:
                msg.fail(ValueError("negative"))
            else:
                msg.resolve(msg.value * 2)

    async with anyio.create_task_group() as tg:
        tg.start_soon(actor)
        assert await box.call(Double(21)) == 42
        with pytest.raises(ValueError, match="negative"):
            await box.call(Double(-1))
        tg.cancel_scope.cancel()


async def test_receive_before_returns_a_message_or_none_at_the_deadline() -> None:
    box: Mailbox[int] = Mailbox("timer", 4)
    now = box.clock.now  # deadlines are in daemon time
    assert await box.receive_before(now() + 0.02) is None
    assert await box.receive_before(now() - 1) is None  # already past: no wait
    box.post(7)
    assert await box.receive_before(now() + 5) == 7
    box.post(8)
    assert await box.receive_before(None) == 8
