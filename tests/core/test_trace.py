"""The stage trace's ring: bounded, drained oldest first, and nothing at all while off."""

from __future__ import annotations

import itertools
import threading

import pytest
from kvd_client import wire

from kvd.bench import stages
from kvd.bench.common import Timed
from kvd.core.trace import NO_TRACE, STAGES_PER_REQUEST, StageTrace, trace_key


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


# ---------------------------------------------------------------- per request


def test_per_request_table_looks_up_a_request_s_stages_in_order() -> None:
    ticks = _clock()
    tr = StageTrace(0, lambda: next(ticks), requests=4)
    assert tr.on and len(tr) == 0  # no flat ring, but recording
    tr.mark("d-1", "gateway.request")
    tr.mark("other", "gateway.request")
    tr.mark_at("d-1", "nixl.notif_polled", 5)
    found = tr.lookup(["d-1"])
    assert found is not None
    assert found.ids == ("d-1",) and found.peer == ""
    assert found.records == ((5, "d-1", "nixl.notif_polled"), (1000, "d-1", "gateway.request"))
    assert tr.lookup(["nope"]) is None and tr.lookup([""]) is None
    assert tr.drain(10) == []  # nothing went to a ring


def test_link_joins_both_ids_and_names_the_peer() -> None:
    ticks = _clock()
    tr = StageTrace(0, lambda: next(ticks), requests=8)
    tr.mark("p-1", "sender.claimed")
    tr.mark("d-1", "notifier.routed")  # P records D's message under D's id
    tr.link("p-1", "kvd-d", "d-1")
    for asked in (["p-1"], ["d-1"], ["d-1", "p-1"]):
        found = tr.lookup(asked)
        assert found is not None and found.peer == "kvd-d"
        assert set(found.ids) == {"p-1", "d-1"}
        assert [s for _, _, s in found.records] == ["sender.claimed", "notifier.routed"]
    tr.link("same", "kvd-x", "same")  # one id on both sides: no self link
    found = tr.lookup(["same"])
    assert found is not None and found.ids == ("same",) and found.peer == "kvd-x"


def test_the_table_keeps_the_most_recent_requests_and_bounds_each() -> None:
    tr = StageTrace(0, lambda: 1, requests=3)
    for i in range(10):
        tr.mark(f"r{i}", "s")
    assert tr.requests_held == 3
    assert [tr.lookup([f"r{i}"]) is not None for i in range(10)] == [False] * 7 + [True] * 3
    for _ in range(STAGES_PER_REQUEST + 5):
        tr.mark("r9", "beat")
    found = tr.lookup(["r9"])
    assert found is not None
    assert len(found.records) == STAGES_PER_REQUEST and found.dropped == 6


def test_off_keeps_nothing_per_request_and_zero_requests_is_no_table() -> None:
    tr = StageTrace(0, lambda: 1, requests=4)
    tr.switch(False)
    tr.mark("r", "s")
    tr.link("r", "kvd-p", "q")
    assert tr.lookup(["r"]) is None and tr.requests_held == 0
    none = StageTrace(0, lambda: 1, requests=0)
    assert not none.on and none.switch(True) is False
    with pytest.raises(ValueError, match="requests"):
        StageTrace(0, lambda: 0, requests=-1)


def test_both_kept_at_once_ring_and_table() -> None:
    tr = StageTrace(8, lambda: 3, requests=8)
    tr.mark("r", "s")
    assert tr.drain(10) == [(3, "r", "s")]
    found = tr.lookup(["r"])
    assert found is not None and found.records == ((3, "r", "s"),)


def test_another_thread_records_into_the_table_while_requests_are_evicted() -> None:
    """The NIXL thread marks while the loop does: no torn entry, the bound holds."""
    tr = StageTrace(0, lambda: 1, requests=100)

    def mark(name: str) -> None:
        for i in range(20_000):
            tr.mark(f"{name}{i}", name)

    threads = [threading.Thread(target=mark, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert 98 <= tr.requests_held <= 100
    held = 0
    for rid in (f"{n}{i}" for n in "ab" for i in range(20_000)):
        found = tr.lookup([rid])
        if found is not None:
            held += 1
            assert found.records == ((1, rid, rid[0]),)
    assert held == tr.requests_held


def test_the_layerwise_join_takes_the_last_layers_write_and_the_first_records_after_it() -> None:
    """`kvd.bench.stages.last_layer`: the WRITE that ends at the last layer is the request's;
    the WRITEs of the layers before and other requests' records are not; then `join`
    counts each stage from its first record at or after the last notice."""
    records = {
        "P": [
            [100, "p-1", "gateway.request"],  # layer 31's notice, before the last
            [150, "p-1/l30-31", "nixl.done"],
            [1000, "p-1", "gateway.request"],  # the last notice
            [1100, "p-1/l31-32", "transfer.handed"],
            [1200, "p-1/l30-32", "nixl.done"],  # coalesced: ends at the last layer
            [1300, "p-1", "gateway.request"],  # the engine's finish, later
            [1250, "p-2/l31-32", "nixl.done"],  # another request
        ],
        "D": [[900, "d-1", "receiver.notif_fed"], [1400, "d-1", "receiver.notif_fed"]],
    }
    kept = stages.last_layer(records, 32)
    assert kept["P"] == [
        [100, "p-1", "gateway.request"],
        [1000, "p-1", "gateway.request"],
        [1100, "p-1", "transfer.handed"],
        [1200, "p-1", "nixl.done"],
        [1300, "p-1", "gateway.request"],
        [1250, "p-2", "nixl.done"],
    ]
    [times] = stages.join([Timed("p-1", "d-1", 1000, 1010, 1500)], kept)
    assert times == {
        "client call": 0,
        "client sent": 10,
        "client event": 500,
        "P gateway.request": 0,
        "P transfer.handed": 100,
        "P nixl.done": 200,
        "D receiver.notif_fed": 400,
    }


def test_a_layer_notice_is_keyed_under_its_first_request() -> None:
    """A worker's `LayersSaved` and P's `LayersPushed` name their requests in a list: the
    trace keys them under the first (P's id and D's id), so the layer-wise path is traced."""
    saved = wire.LayersSaved(
        "engine-p", 0, 4, (wire.SavedRequest("p-1", (0, 1)), wire.SavedRequest("p-2", (2,)))
    )
    pushed = wire.LayersPushed(0, (wire.LayerRange("d-1", 0, 4), wire.LayerRange("d-2", 0, 4)))
    assert trace_key(saved) == "p-1" and trace_key(pushed) == "d-1"
    assert trace_key(wire.Heartbeat(("a", "b"))) == ""  # many ids, none first
