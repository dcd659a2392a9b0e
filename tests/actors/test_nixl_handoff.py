"""The hand-off to the NIXL thread (`NixlEngine._hand`), on a real engine (its own NIXL
agent and thread): a notification or transfer handed to the idle thread has been taken
by it when the hand-off returns (the loop waited, at most `_HAND_S`); one handed to a
thread that is busy is queued without a wait, and runs all the same."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from typing import Any

import pytest
from kvd_client.errors import KvdError

from kvd.adapters.nixl import NixlEngine


async def idle_engine() -> NixlEngine:
    eng = NixlEngine(f"kvdt-hand-{os.getpid()}")

    async def sink(batch: Any) -> None:
        return None

    await eng.start(sink)
    # the thread goes back to waiting on its queue once its start-up polls are done
    deadline = time.monotonic() + 5.0
    while not eng._idle_wait:
        assert time.monotonic() < deadline, "the NIXL thread never waited on its queue"
        await asyncio.sleep(0.001)
    return eng


@pytest.mark.asyncio
async def test_a_notification_handed_to_the_idle_thread_is_taken_before_the_call_returns() -> None:
    eng = await idle_engine()
    try:
        loop = asyncio.get_running_loop()
        answered: asyncio.Future[KvdError | None] = loop.create_future()
        taken_on: list[str] = []
        original = eng._send_or_hold

        def send_or_hold(n: Any) -> None:
            taken_on.append(threading.current_thread().name)
            original(n)

        eng._send_or_hold = send_or_hold  # type: ignore[method-assign]
        eng.post_notif("nobody-we-know", b"x", answered.set_result)
        # it waited for the thread: taken within the bound on a quiet machine (a late one,
        # on a loaded one, is still queued and runs)
        assert eng.stats.hands_waited + eng.stats.hands_late == 1
        err = await asyncio.wait_for(answered, 5.0)
        assert isinstance(err, KvdError)  # no such peer: refused, and said so
        assert taken_on and taken_on[0] != threading.current_thread().name
    finally:
        await eng.close()


@pytest.mark.asyncio
async def test_a_command_for_a_busy_thread_is_queued_without_a_wait() -> None:
    eng = await idle_engine()
    try:
        loop = asyncio.get_running_loop()
        release = threading.Event()
        running = threading.Event()

        def hold() -> None:
            running.set()
            release.wait(5.0)

        eng._cmds.put(hold)
        assert await loop.run_in_executor(None, running.wait, 5.0)
        answered: asyncio.Future[KvdError | None] = loop.create_future()
        t0 = time.perf_counter()
        eng.post_notif("nobody-we-know", b"x", answered.set_result)
        waited = time.perf_counter() - t0
        assert eng.stats.hands_waited + eng.stats.hands_late == 0  # not idle: no wait
        assert waited < 0.1
        release.set()
        assert isinstance(await asyncio.wait_for(answered, 5.0), KvdError)
    finally:
        release.set()
        await eng.close()
