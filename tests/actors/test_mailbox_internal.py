"""One rule, by message type: notices between actors are never refused and do not count
against the bound; outside input (`Outside`) is refused once `size` of it waits. Everything
is received in the order it was posted."""

from __future__ import annotations

import anyio
import pytest
from kvd_client.errors import Busy

from kvd.actors.base import Mailbox, Outside


class Knock(Outside):
    """Outside input (a client request, a heartbeat)."""


async def test_notices_are_never_refused_and_do_not_crowd_out_outside_input() -> None:
    box: Mailbox[object] = Mailbox("t", 2)
    for i in range(10):
        box.post(i)  # a notice: never raises, however far beyond the bound
    assert box.depth() == 10
    a, b = Knock(), Knock()
    box.post(a)  # the actor's own notices do not turn outside input away...
    box.post(b)
    with pytest.raises(Busy):
        box.post(Knock())  # ...but `size` waiting outside messages do
    assert box.stats()["rejected"] == 1 and box.stats()["outside"] == 2
    box.post(10)  # notices still go in while outside input is refused
    got = [box.receive_nowait() for _ in range(3)] + [await box.receive() for _ in range(10)]
    assert got == [*range(10), a, b, 10]  # in the order posted
    assert box.depth() == 0 and box.stats()["outside"] == 0
    knock = Knock()
    box.post(knock)  # room again
    assert box.receive_nowait() is knock


async def test_outside_room_comes_back_as_outside_messages_are_taken() -> None:
    box: Mailbox[object] = Mailbox("t", 1)
    first = Knock()
    box.post(first)
    box.post("notice")
    with pytest.raises(Busy):
        box.post(Knock())
    assert box.receive_nowait() is first  # the outside message is taken...
    later = Knock()
    box.post(later)  # ...so one more fits, though a notice still waits
    assert [box.receive_nowait(), box.receive_nowait()] == ["notice", later]


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
