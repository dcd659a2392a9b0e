"""One rule, by message type: notices between actors beyond the bound wait in order and are
never refused; outside input (`Outside`) is refused meanwhile."""

from __future__ import annotations

import anyio
import pytest
from kvd_client.errors import Busy

from kvd.actors.base import Mailbox, Outside


class Knock(Outside):
    """Outside input (a client request, a heartbeat)."""


async def test_internal_posts_overflow_in_order_and_outside_posts_stay_refused() -> None:
    box: Mailbox[object] = Mailbox("t", 2)
    for i in range(10):
        box.post(i)  # a notice: never raises, however far beyond the bound
    assert box.depth() == 10
    with pytest.raises(Busy):
        box.post(Knock())  # outside load is still refused while notices wait
    got = [box.receive_nowait() for _ in range(3)] + [await box.receive() for _ in range(7)]
    assert got == list(range(10))
    assert box.depth() == 0
    knock = Knock()
    box.post(knock)  # room again
    assert box.receive_nowait() is knock


async def test_internal_overflow_drains_through_async_iteration() -> None:
    box: Mailbox[int] = Mailbox("t", 3)
    for i in range(1000):
        box.post(i)
    seen: list[int] = []

    async def consume() -> None:
        async for msg in box:
            seen.append(msg)
            if len(seen) == 1000:
                return

    with anyio.fail_after(5):
        await consume()
    assert seen == list(range(1000))
