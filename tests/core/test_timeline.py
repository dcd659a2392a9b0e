"""Clock offsets, the trace exchange and the merged timeline, without a socket or a clock."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st
from kvd_client import wire
from kvd_client.errors import AuthError, RemoteProtocolError

from kvd.core.timeline import (
    ClockOffset,
    best,
    check_answer,
    check_query,
    estimate,
    make_answer,
    make_query,
    merge,
    rows,
)
from kvd.core.trace import StageTrace

SECRET = b"s3cret"
NONCE = bytes(range(16))


def test_estimate_of_a_symmetric_exchange_is_exact() -> None:
    # peer clock = ours + 1000; 50 ns each way; the peer took 20 ns
    t0 = 10_000
    t1 = t0 + 50 + 1000
    t2 = t1 + 20
    t3 = t2 - 1000 + 50
    got = estimate(t0, t1, t2, t3)
    assert got == ClockOffset(1000, 50, 100)


@given(
    theta=st.integers(-(10**15), 10**15),
    out=st.integers(0, 10**9),
    back=st.integers(0, 10**9),
    work=st.integers(0, 10**9),
    t0=st.integers(0, 10**15),
)
def test_the_true_offset_is_always_within_the_bound(
    theta: int, out: int, back: int, work: int, t0: int
) -> None:
    """Whatever the asymmetry of the path, |true - estimate| <= error."""
    t1 = t0 + out + theta
    t2 = t1 + work
    t3 = t2 - theta + back
    got = estimate(t0, t1, t2, t3)
    assert abs(theta - got.offset_ns) <= got.error_ns
    assert got.rtt_ns == out + back


def test_impossible_exchanges_are_refused() -> None:
    with pytest.raises(ValueError):
        estimate(10, 0, 0, 5)
    with pytest.raises(RemoteProtocolError, match="before the query arrived"):
        estimate(0, 10, 5, 20)


def test_best_keeps_the_smallest_bound() -> None:
    a, b = ClockOffset(5, 100, 200), ClockOffset(-3, 10, 20)
    assert best([a, b, a]) == b


def test_query_and_answer_round_trip_with_and_without_a_secret() -> None:
    tr = StageTrace(0, lambda: 42, requests=4)
    tr.mark("p-1", "sender.claimed")
    tr.link("p-1", "kvd-d", "d-1")
    for secret in (None, SECRET):
        q = make_query("kvd-d", ["d-1"], 7, NONCE, 1000.0, secret)
        q = wire.decode(wire.encode(q, 1))[1]
        assert isinstance(q, wire.TraceQuery)
        check_query(q, secret, 1000.0)
        a = make_answer("kvd-p", q, tr.lookup(q.request_ids), 50, 60, secret)
        a = wire.decode(wire.encode(a, 1))[1]
        assert isinstance(a, wire.TraceAnswer)
        check_answer(a, q, secret)
        assert (a.t0, a.t1, a.t2) == (7, 50, 60)
        assert set(a.ids) == {"d-1", "p-1"}
        assert [(s.t_ns, s.request_id, s.stage) for s in a.stages] == [
            (42, "p-1", "sender.claimed")
        ]


def test_a_query_or_answer_without_the_secret_is_refused() -> None:
    q = make_query("kvd-d", ["d-1"], 7, NONCE, 1000.0, None)
    with pytest.raises(AuthError, match="failed authentication"):
        check_query(q, SECRET, 1000.0)
    signed = make_query("kvd-d", ["d-1"], 7, NONCE, 1000.0, b"other")
    with pytest.raises(AuthError):
        check_query(signed, SECRET, 1000.0)
    stale = make_query("kvd-d", ["d-1"], 7, NONCE, 1000.0, SECRET)
    with pytest.raises(AuthError, match="window"):
        check_query(stale, SECRET, 1000.0 + 600)
    good = make_query("kvd-d", ["d-1"], 7, NONCE, 1000.0, SECRET)
    unsigned = make_answer("kvd-p", good, None, 1, 2, None)
    with pytest.raises(AuthError):
        check_answer(unsigned, good, SECRET)
    other_query = make_query("kvd-d", ["d-1"], 7, bytes(16), 1000.0, SECRET)
    for_other = make_answer("kvd-p", other_query, None, 1, 2, SECRET)
    with pytest.raises(AuthError):  # bound to its query's nonce
        check_answer(for_other, good, SECRET)
    wrong_t0 = make_answer("kvd-p", make_query("x", [], 8, NONCE, 1.0, None), None, 1, 2, None)
    with pytest.raises(RemoteProtocolError, match="t0"):
        check_answer(wrong_t0, good, None)


def test_merge_moves_the_peer_onto_our_clock_and_orders_the_stages() -> None:
    local = [[1_000, "d-1", "gateway.request"], [4_000, "d-1", "gateway.event"]]
    peer = [[13_500, "p-1", "nixl.posted"]]  # peer clock = ours + 10 µs
    steps = merge("kvd-d", local, "kvd-p", peer, ClockOffset(10_000, 5, 10))
    assert [(s.t_ns, s.daemon, s.side, s.stage) for s in steps] == [
        (1_000, "kvd-d", "local", "gateway.request"),
        (3_500, "kvd-p", "peer", "nixl.posted"),
        (4_000, "kvd-d", "local", "gateway.event"),
    ]
    got = rows(steps)
    assert [(r["delta_us"], r["step_us"]) for r in got] == [(0.0, 0.0), (2.5, 2.5), (3.0, 0.5)]
    assert merge("kvd-d", local, "kvd-p", peer, None) == steps[::2]  # no offset: ours only
    assert rows([]) == []


def test_peer_now_latest_is_never_earlier_than_the_peer_clock() -> None:
    """The latest a peer's clock may read: our clock plus the offset, its error and the
    drift since it was measured. Whatever the true offset within the error bound, and
    whatever the drift within DRIFT_PPM, the peer's clock is never later than that."""
    from kvd.core.timeline import DRIFT_PPM, peer_now_latest_ns

    rng = random.Random(3)
    for _ in range(2000):
        true_offset = rng.randint(-(10**15), 10**15)
        error = rng.randint(0, 5 * 10**6)
        measured = rng.randint(0, 10**15)
        estimate_ = true_offset + rng.randint(-error, error)
        off = ClockOffset(estimate_, error, 2 * error)
        elapsed = rng.randint(0, 3600 * 10**9)
        rate = 1 + rng.uniform(-1, 1) * DRIFT_PPM / 1e6  # peer ticks at rate x ours
        now = measured + elapsed
        peer_now = measured + true_offset + int(elapsed * rate)
        assert peer_now_latest_ns(now, off, measured) >= peer_now
    # tight when measured just now: within the error bound and a nanosecond
    off = ClockOffset(1_000, 50, 100)
    assert peer_now_latest_ns(10**9, off, 10**9) == 10**9 + 1_000 + 50 + 1
