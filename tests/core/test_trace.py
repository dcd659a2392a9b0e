"""The stage trace's ring: bounded, drained oldest first, and nothing at all while off."""

from __future__ import annotations

import itertools
import threading

import pytest
from kvd_client import wire

from kvd.core.trace import NO_TRACE, StageTrace, trace_key


def _clock() -> itertools.count[int]:
    return itertools.count(1000, 10)


def test_records_in_order_with_the_clock_and_drains_oldest_first() -> None:
    ticks = _clock()
    tr = StageTrace(8, lambda: next(ticks))
    assert tr.on and len(tr) == 0
    tr.mark("r1", "gateway.request")
    tr.mark_at("r1", "nixl.notif_polled", 5)
    tr.mark("r2", "receiver.admitted")
    assert tr.drain(2) == [(1000, "r1", "gateway.request"), (5, "r1", "nixl.notif_polled")]
    assert len(tr) == 1
    assert tr.drain(100) == [(1010, "r2", "receiver.admitted")]
    assert tr.drain(100) == [] and len(tr) == 0


def test_the_ring_is_bounded_and_drops_the_oldest() -> None:
    ticks = _clock()
    tr = StageTrace(3, lambda: next(ticks))
    for i in range(10):
        tr.mark(f"r{i}", "s")
        assert len(tr) == min(i + 1, 3)
    assert tr.full
    assert [rid for _, rid, _ in tr.drain(10)] == ["r7", "r8", "r9"]
    assert not tr.full


def test_off_records_nothing_and_never_reads_the_clock() -> None:
    def clock() -> int:
        raise AssertionError("a trace that is off read its clock")

    tr = StageTrace(4, clock)
    assert tr.switch(False) is False and not tr.on
    tr.mark("r", "s")
    tr.mark_at("r", "s", 1)
    assert tr.now() == 0
    assert len(tr) == 0 and tr.drain(10) == []


def test_no_ring_cannot_be_switched_on() -> None:
    tr = StageTrace(0, lambda: 1)
    assert not tr.on and not tr.full
    assert tr.switch(True) is False
    tr.mark("r", "s")
    assert len(tr) == 0
    assert not NO_TRACE.on and NO_TRACE.switch(True) is False


def test_switched_back_on_it_records_again() -> None:
    tr = StageTrace(4, lambda: 7)
    tr.switch(False)
    tr.mark("r", "a")
    assert tr.switch(True)
    tr.mark("r", "b")
    assert tr.drain(10) == [(7, "r", "b")]


def test_negative_capacity_is_refused() -> None:
    with pytest.raises(ValueError, match="capacity"):
        StageTrace(-1, lambda: 0)


def test_another_thread_records_into_the_same_ring() -> None:
    """The NIXL thread marks while the event loop does: no record is lost or torn."""
    tr = StageTrace(100_000, lambda: 1)

    def mark(name: str) -> None:
        for i in range(20_000):
            tr.mark(f"{name}{i}", name)

    threads = [threading.Thread(target=mark, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    records = tr.drain(100_000)
    assert len(records) == 40_000
    assert all(rid.startswith(stage) for _, rid, stage in records)


def test_trace_key_names_the_request_a_record_is_about() -> None:
    assert trace_key(wire.PushDone("d-1", 0, True, 0, "")) == "d-1"
    assert trace_key(wire.PullAck("d-2", True, 0, "")) == "d-2"
    assert trace_key(wire.PullDone("p-3", "d-3", (), "")) == "p-3"
    assert trace_key(wire.Heartbeat(("a", "b"))) == ""  # names many: not traced by key
    assert trace_key(wire.KeepAlive("s")) == ""
