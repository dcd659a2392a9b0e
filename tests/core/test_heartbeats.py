from __future__ import annotations

import random

import pytest

from kvd.core.heartbeats import HeartbeatSchedule


def test_first_beat_is_immediate_and_batched() -> None:
    hb = HeartbeatSchedule()
    hb.track("a", "p1", now=10.0, interval=1.0)
    hb.track("b", "p1", now=10.0, interval=1.0)
    hb.track("c", "p2", now=10.2, interval=2.0)
    assert hb.next_deadline() == 10.0
    assert hb.due(10.0) == {"p1": ["a", "b"]}
    assert hb.due(10.5) == {"p2": ["c"]}
    assert hb.next_deadline() == 11.0
    assert len(hb) == 3
    assert sorted(hb.peers()) == ["p1", "p2"]
    assert hb.peer_of("c") == "p2" and hb.peer_of("zz") is None
    assert hb.requests_of("p1") == ["a", "b"] and hb.requests_of("zz") == []


def test_new_request_joins_next_beat() -> None:
    hb = HeartbeatSchedule()
    hb.track("a", "p", now=0.0, interval=1.0)
    assert hb.due(0.0) == {"p": ["a"]}
    hb.track("b", "p", now=0.3, interval=1.0)
    assert hb.next_deadline() == 1.0  # not pulled forward
    assert hb.due(0.9) == {}
    assert hb.due(1.0) == {"p": ["a", "b"]}


def test_interval_respected() -> None:
    hb = HeartbeatSchedule()
    hb.track("a", "p", now=0.0, interval=2.0)
    beats = []
    t = 0.0
    while t < 10.0:
        if hb.due(t):
            beats.append(t)
        t = round(t + 0.5, 6)
    assert beats == [0.0, 2.0, 4.0, 6.0, 8.0]


def test_late_due_reschedules_from_now() -> None:
    hb = HeartbeatSchedule()
    hb.track("a", "p", now=0.0, interval=1.0)
    hb.due(0.0)
    assert hb.due(5.5) == {"p": ["a"]}  # one beat, not five
    assert hb.next_deadline() == 6.5


def test_untrack_and_no_beats_for_empty_peer() -> None:
    hb = HeartbeatSchedule()
    hb.track("a", "p", now=0.0, interval=1.0)
    hb.track("b", "p", now=0.0, interval=1.0)
    hb.due(0.0)
    hb.untrack("a")
    hb.untrack("nope")
    assert hb.due(1.0) == {"p": ["b"]}
    hb.untrack("b")
    assert hb.next_deadline() is None
    assert hb.due(100.0) == {}
    assert hb.peers() == [] and len(hb) == 0
    # a peer that comes back beats at once again
    hb.track("c", "p", now=200.0, interval=1.0)
    assert hb.due(200.0) == {"p": ["c"]}


def test_retrack_moves_peer() -> None:
    hb = HeartbeatSchedule()
    hb.track("a", "p1", now=0.0, interval=1.0)
    hb.track("a", "p2", now=0.0, interval=1.0)
    assert hb.peers() == ["p2"]
    assert hb.due(0.0) == {"p2": ["a"]}
    hb.track("a", "p2", now=0.5, interval=1.0)  # idempotent
    assert hb.requests_of("p2") == ["a"]


def test_bad_interval() -> None:
    with pytest.raises(ValueError):
        HeartbeatSchedule().track("a", "p", now=0.0, interval=0.0)


def test_random_against_model() -> None:
    rng = random.Random(3)
    hb = HeartbeatSchedule()
    peer_of: dict[str, str] = {}
    next_at: dict[str, float] = {}
    interval = {"p0": 1.0, "p1": 0.7, "p2": 2.5}
    now = 0.0
    for _ in range(5000):
        now += rng.random() * 0.3
        r = rng.random()
        rid = f"r{rng.randrange(40)}"
        if r < 0.4:
            peer = rng.choice(list(interval))
            hb.track(rid, peer, now, interval[peer])
            peer_of[rid] = peer
            next_at.setdefault(peer, now)
        elif r < 0.6:
            hb.untrack(rid)
            peer_of.pop(rid, None)
        else:
            got = hb.due(now)
            want = {p for p, t in next_at.items() if t <= now}
            assert set(got) == want
            for p in want:
                assert set(got[p]) == {x for x, q in peer_of.items() if q == p}
                next_at[p] = now + interval[p]
        live = set(peer_of.values())
        for p in list(next_at):
            if p not in live:
                del next_at[p]  # an emptied peer is dropped; it beats at once if it returns
        assert set(hb.peers()) == live
        assert hb.next_deadline() == (min(next_at.values()) if next_at else None)
        assert len(hb) == len(peer_of)
