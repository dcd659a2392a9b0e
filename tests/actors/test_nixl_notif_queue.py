"""The NIXL adapter's queue of polled notifications, driven on its thread's code with a
fake agent (the real agent is exercised by every integration test; a queue filled past
its bound cannot be arranged there on purpose). What is checked: polled notifications
reach the sink in the order polled, through one drain on the loop; past the queue's
bound (a count, and bytes) they are dropped and counted, never delivered, and once the
loop drained the queue there is room again."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvd.adapters import nixl
from kvd.adapters.nixl import NixlEngine


class FakeAgent:
    def __init__(self) -> None:
        self.inbox: list[dict[Any, list[bytes]]] = []

    def get_new_notifs(self) -> dict[Any, list[bytes]]:
        return self.inbox.pop(0) if self.inbox else {}


def engine(agent: FakeAgent, sink: Any) -> NixlEngine:
    eng = NixlEngine("us")
    eng._agent = agent
    eng._loop = asyncio.get_running_loop()
    eng._sink = sink
    return eng


async def settle_loop() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_polled_notifications_reach_the_sink_in_order() -> None:
    got: list[tuple[str, list[bytes]]] = []
    agent = FakeAgent()
    eng = engine(agent, lambda peer, msgs, polled: got.append((peer, msgs)))
    agent.inbox = [{"p": [b"1", b"2"]}, {b"q": [b"3"]}, {"p": [b"4"]}]
    for _ in range(3):
        assert eng._poll_notifs()  # what the NIXL thread does each turn
    assert not eng._poll_notifs()  # nothing new
    assert got == [] and eng.stats.notifs_queued == 4  # on the loop, not on the thread
    await settle_loop()
    assert got == [("p", [b"1", b"2"]), ("q", [b"3"]), ("p", [b"4"])]
    assert eng.stats.notifs_received == 4 and eng.stats.notifs_queued == 0


@pytest.mark.asyncio
async def test_past_the_bound_notifications_are_dropped_and_counted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(nixl, "_RX_MAX_NOTIFS", 3)
    monkeypatch.setattr(nixl, "_RX_MAX_BYTES", 10)
    got: list[bytes] = []
    agent = FakeAgent()
    eng = engine(agent, lambda peer, msgs, polled: got.extend(msgs))
    agent.inbox = [{"p": [b"a", b"b"]}, {"p": [b"c", b"d"]}]  # 4 > 3: "d" dropped
    eng._poll_notifs()
    eng._poll_notifs()
    assert eng.stats.notifs_dropped == 1 and eng.stats.notifs_queued == 3
    await settle_loop()
    assert got == [b"a", b"b", b"c"] and eng.stats.notifs_queued == 0
    agent.inbox = [{"p": [b"0123456789", b"e"]}]  # the byte bound: "e" does not fit
    eng._poll_notifs()
    await settle_loop()
    assert got[3:] == [b"0123456789"] and eng.stats.notifs_dropped == 2
    agent.inbox = [{"p": [b"f"]}]  # drained: room again
    eng._poll_notifs()
    await settle_loop()
    assert got[-1] == b"f" and eng.stats.notifs_dropped == 2


@pytest.mark.asyncio
async def test_a_failing_sink_does_not_stall_the_rest() -> None:
    got: list[bytes] = []

    def sink(peer: str, msgs: list[bytes], polled: int) -> None:
        if msgs == [b"bad"]:
            raise RuntimeError("a bug in the sink")
        got.extend(msgs)

    agent = FakeAgent()
    eng = engine(agent, sink)
    agent.inbox = [{"p": [b"bad"]}, {"q": [b"ok"]}]
    eng._poll_notifs()
    eng._poll_notifs()
    await settle_loop()
    assert got == [b"ok"] and eng.stats.notifs_queued == 0
