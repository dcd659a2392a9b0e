"""Doorbells (`kvd.adapters.doorbell`), on real UDP sockets and a real NIXL engine: a
datagram ends the NIXL thread's backed-off wait, a command still ends it, rings to a
peer that cannot be idle are not sent, floods are drained in bounded batches, and an
address that cannot be bound leaves the daemon without a doorbell (never a failure)."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from typing import Any

import pytest

from kvd.adapters import doorbell
from kvd.adapters.doorbell import (
    DRAIN_MAX,
    HOT_S,
    Commands,
    Doorbell,
    peer_address,
)
from kvd.adapters.nixl import NixlEngine


def _bell() -> Doorbell:
    bell = Doorbell.bind("127.0.0.1", 0)
    assert bell is not None
    return bell


def _ringer(target: Doorbell, peer: str = "p") -> Doorbell:
    ringer = _bell()
    ringer.set_peer(peer, peer_address("127.0.0.1", target.port))
    return ringer


def test_a_datagram_ends_the_wait_and_is_drained() -> None:
    bell, cmds = _bell(), Commands()
    ringer = _ringer(bell)
    try:
        ringer.ring("p")
        assert ringer.stats.rung == 1
        assert cmds.wait(5.0, bell) is True
        assert (bell.stats.wakes, bell.stats.drained) == (1, 1)
        assert cmds.wait(0.01, bell) is False  # drained: nothing left to wake it
    finally:
        bell.close()
        ringer.close()
        cmds.close()


def test_a_command_ends_the_wait_and_stays_queued() -> None:
    bell, cmds = _bell(), Commands()
    try:
        cmds.put(None)  # queued before the wait: it does not block at all
        assert cmds.wait(5.0, bell) is False
        assert cmds.get_nowait() is None
        marker = lambda: None  # noqa: E731
        timer = threading.Timer(0.05, cmds.put, (marker,))
        timer.start()
        t0 = time.monotonic()
        assert cmds.wait(5.0, bell) is False
        assert time.monotonic() - t0 < 4.0, "the put did not end the wait"
        assert cmds.get_nowait() is marker
        timer.join()
        assert bell.stats.wakes == 0
    finally:
        bell.close()
        cmds.close()


def test_a_wait_with_nothing_times_out() -> None:
    bell, cmds = _bell(), Commands()
    try:
        assert cmds.wait(0.02, bell) is False
    finally:
        bell.close()
        cmds.close()


def test_a_peer_rung_or_heard_from_lately_is_not_rung() -> None:
    bell = _bell()
    ringer = _ringer(bell)
    try:
        ringer.ring("p")
        ringer.ring("p")  # within HOT_S: the peer is polling hot
        assert (ringer.stats.rung, ringer.stats.skipped) == (1, 1)
        time.sleep(HOT_S * 2)
        ringer.heard("p", time.monotonic())  # it just sent us something: hot too
        ringer.ring("p")
        assert (ringer.stats.rung, ringer.stats.skipped) == (1, 2)
        time.sleep(HOT_S * 1.5)
        ringer.ring("p")
        assert ringer.stats.rung == 2
        ringer.ring("unknown")  # no doorbell known for it
        ringer.set_peer("p", None)
        time.sleep(HOT_S * 2)
        ringer.ring("p")  # forgotten
        assert ringer.stats.rung == 2
        bell.drain()
        assert bell.stats.drained == 2
    finally:
        bell.close()
        ringer.close()


def test_a_flood_is_drained_in_bounded_batches() -> None:
    bell, cmds = _bell(), Commands()
    out = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        n = DRAIN_MAX * 3 + 5
        for i in range(n):  # junk of any size: never read, only dropped
            out.sendto(os.urandom(i % 1400), ("127.0.0.1", bell.port))
        wakes = 0
        while cmds.wait(0.2, bell):
            wakes += 1
            assert bell.stats.drained <= wakes * DRAIN_MAX
        assert bell.stats.drained == n
        assert wakes == 4
    finally:
        out.close()
        bell.close()
        cmds.close()


def test_an_address_that_cannot_be_bound_leaves_no_doorbell() -> None:
    taken = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    taken.bind(("127.0.0.1", 0))
    try:
        assert Doorbell.bind("127.0.0.1", taken.getsockname()[1]) is None  # in use
        assert Doorbell.bind("eth-nonexistent", 0) is None  # not numeric (an interface)
    finally:
        taken.close()
    wild = Doorbell.bind("*", 0)  # ZMQ's "every address"
    assert wild is not None
    wild.close()
    assert peer_address("not-numeric", 1) is None
    assert peer_address("::1", 5)[0] == socket.AF_INET6  # type: ignore[index]


BACK_OFF_S = 3.5
"""An idle thread's waits double from 100 us after its last activity (1.64 s from 1.64 s
on, 3.28 s from 3.28 s on): after this, the wait under way ends three seconds or more
later, where the tests below want the thread awake within one second."""
AWAKE_S = 1.0


async def _backed_off_engine(tag: str) -> NixlEngine:
    """A real engine with a doorbell whose thread, idle, backs off to waits of seconds."""
    eng = NixlEngine(
        f"kvdt-bell-{tag}-{os.getpid()}", poll_max_idle_us=1000, poll_deep_idle_us=10_000_000
    )
    eng.awake = lambda: False

    def sink(peer: str, msgs: list[bytes], polled: int) -> None:
        return None

    await eng.start(sink)
    assert eng.open_doorbell("127.0.0.1", 0)
    await asyncio.sleep(BACK_OFF_S)

    assert eng._deep, "the NIXL thread did not back off"
    return eng


@pytest.mark.asyncio
async def test_a_backed_off_thread_is_woken_by_the_bell_and_by_a_command() -> None:
    eng = await _backed_off_engine("wake")
    assert eng.bell is not None
    ringer = _ringer(eng.bell)
    try:
        polls = eng.stats.polls
        ringer.ring("p")
        deadline = time.monotonic() + AWAKE_S  # the timed wait would end 3 s later
        while eng.bell.stats.wakes == 0:
            assert time.monotonic() < deadline, "the doorbell did not wake the thread"
            await asyncio.sleep(0.005)
        assert eng.stats.polls > polls
        stats: dict[str, Any] = eng.stats_dict()
        assert stats["doorbell_port"] == eng.bell.port and stats["doorbell_wakes"] == 1
        await asyncio.sleep(BACK_OFF_S)  # backed off again
        assert eng._deep
        # a command handed to a thread in a doorbell wait is taken at once (the eventfd)
        got = await asyncio.wait_for(eng.call(lambda agent: 42), AWAKE_S)
        assert got == 42
    finally:
        ringer.close()
        await eng.close()


def test_descriptors_past_select_s_limit_are_polled(monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon with more than FD_SETSIZE descriptors open waits with `poll` instead."""
    monkeypatch.setattr(doorbell, "_SELECT_FDS", 0)
    bell, cmds = _bell(), Commands()
    ringer = _ringer(bell)
    try:
        ringer.ring("p")
        assert cmds.wait(5.0, bell) is True and bell.stats.drained == 1
        timer = threading.Timer(0.05, cmds.put, (None,))
        timer.start()
        t0 = time.monotonic()
        assert cmds.wait(5.0, bell) is False
        assert time.monotonic() - t0 < 4.0, "the put did not end the wait"
        timer.join()
        assert cmds.get_nowait() is None
        assert cmds.wait(0.02, bell) is False
    finally:
        bell.close()
        ringer.close()
        cmds.close()
