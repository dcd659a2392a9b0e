"""Limits (`[limits]`) in the sans-IO core: the per-peer token buckets
(`kvd.core.ratelimit.RateLimiter`), the pending-bytes budget (`kvd.core.limits`) and how
the sender and receiver machines refuse what does not fit. Time is an argument; no sleeps.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvd_client import wire
from kvd_client.errors import Busy, ErrorCode, TransferError

from kvd.core.effects import Emit, Notify, Refused
from kvd.core.limits import (
    BLOCK_ID_BYTES,
    ENTRY_BYTES,
    PendingBudget,
    Reservation,
    entry_cost,
    record_cost,
)
from kvd.core.ratelimit import RateLimiter
from kvd.core.receiver import AbortRecv, CancelAt, PeerUnresolved, RecvState
from kvd.core.sender import (
    AbortSend,
    CancelArrived,
    PostWrite,
    PullDoneArrived,
    RegistrationArrived,
    ResolveView,
    SendState,
    StartDrain,
    ViewResolved,
    WriteDone,
)

from .test_receiver import load, track
from .test_receiver import make as make_receiver
from .test_sender import D1, D2, REG, WAIT, finish, make, pulled, registered

BUSY = int(ErrorCode.BUSY)


# ------------------------------------------------------------------ the token buckets


def test_a_peer_gets_its_burst_then_its_rate() -> None:
    lim: RateLimiter[str] = RateLimiter(8.0, 8.0, 8, "other")
    assert [lim.allow("a", 100.0) for _ in range(10)] == [True] * 8 + [False] * 2
    assert lim.allow("b", 100.0)  # another peer has its own bucket
    assert not lim.allow("a", 100.0625)  # half a token refilled
    assert lim.allow("a", 100.125) and not lim.allow("a", 100.125)  # one token per 1/rate
    assert lim.busiest(100.125) == 13  # taken and refused alike
    assert lim.busiest(102.0) == 0


def test_refilled_buckets_are_forgotten_and_keys_beyond_the_bound_share_one() -> None:
    lim: RateLimiter[str] = RateLimiter(100.0, 2.0, 4, "other")
    for i in range(4):
        assert lim.allow(f"p{i}", 0.0)
    assert len(lim) == 4
    assert lim.allow("p4", 0.0) and lim.allow("p5", 0.0)  # the shared bucket: 2 tokens
    assert not lim.allow("p6", 0.0)
    assert len(lim) == 5  # 4 keys and the overflow key
    assert lim.allow("p7", 1.0)  # every bucket refilled by now: forgotten, room again
    assert len(lim) == 1


def test_a_flood_of_keys_keeps_memory_bounded() -> None:
    lim: RateLimiter[int] = RateLimiter(1.0, 1.0, 16, -1)
    taken = sum(lim.allow(i, 5.0 + i * 1e-6) for i in range(10_000))
    assert taken == 16 + 1  # 16 keys, then one token of the shared bucket
    assert len(lim) <= 17 and len(lim._seconds) <= 17


@pytest.mark.parametrize(("rate", "burst"), [(0.0, 1.0), (1.0, 0.5)])
def test_rate_limiter_refuses_impossible_settings(rate: float, burst: float) -> None:
    with pytest.raises(ValueError):
        RateLimiter(rate, burst, 4, "o")


# ------------------------------------------------------------------ the budget


def test_budget_charges_what_fits_and_counts_refusals() -> None:
    b = PendingBudget(10_000)
    assert b.take(6_000) and not b.take(5_000)
    assert (b.used, b.refused) == (6_000, 1)
    assert b.take(9_000, freed=6_000)  # an entry that grows: charged the difference
    assert not b.take(12_000, freed=9_000)
    assert b.take(100, freed=9_000)  # shrinking always fits
    b.give(100)
    assert (b.used, b.peak, b.refused) == (0, 9_000, 2)
    with pytest.raises(ValueError):
        b.give(1)
    assert "limits.pending_bytes" in b.why(5, "a pull")


def test_a_reservation_is_adopted_or_released_once() -> None:
    b = PendingBudget(1000)
    r = b.reserve(600)
    assert r is not None and r.held and b.used == 600
    assert b.reserve(500) is None and b.refused == 1  # it does not fit beside the first
    assert r.release() and not r.held and b.used == 0
    assert not r.release() and b.used == 0  # a second release gives nothing back
    with pytest.raises(ValueError):
        r.adopt()  # nor may a released reservation be kept
    kept = b.reserve(700)
    assert kept is not None and kept.adopt() == 700 and b.used == 700
    assert not kept.release() and b.used == 700  # adopted: the entry gives it back
    with pytest.raises(ValueError):
        kept.adopt()
    b.give(700)
    assert b.used == 0 and b.peak == 700


_OPS = st.lists(
    st.tuples(
        st.sampled_from(("reserve", "adopt", "release", "give", "again")),
        st.integers(0, 9),
        st.integers(1, 400),
    ),
    max_size=200,
)


@settings(max_examples=300, deadline=None)
@given(_OPS)
def test_reserve_and_release_never_leak_nor_free_twice(ops: list[tuple[str, int, int]]) -> None:
    """Whatever order reservations are made, adopted, released (again and again) and the
    adopted entries given back, the budget holds exactly what is held or kept, never more
    than its limit, and nothing is freed twice."""
    b = PendingBudget(1000)
    held: list[Reservation] = []
    done: list[Reservation] = []  # adopted or released: nothing more to free through them
    kept: list[int] = []
    refused = 0
    for op, i, cost in ops:
        if op == "reserve":
            r = b.reserve(cost)
            if r is None:
                refused += 1
                assert b.used + cost > b.limit
            else:
                held.append(r)
        elif op == "adopt" and held:
            r = held.pop(i % len(held))
            kept.append(r.adopt())
            done.append(r)
        elif op == "release" and held:
            r = held.pop(i % len(held))
            assert r.release()
            done.append(r)
        elif op == "give" and kept:
            b.give(kept.pop(i % len(kept)))
        elif op == "again" and done:
            r = done[i % len(done)]
            before = b.used
            assert not r.release() and b.used == before
            with pytest.raises(ValueError):
                r.adopt()
            assert b.used == before
        assert all(r.held for r in held) and not any(r.held for r in done)
        assert b.used == sum(r.cost for r in held) + sum(kept) <= b.limit
        assert b.refused == refused and b.peak <= b.limit
    for r in held:
        r.release()
    for cost in kept:
        b.give(cost)
    assert b.used == 0


def test_record_cost_counts_block_ids_and_text() -> None:
    reg = registered("d1", blocks=tuple(range(1000))).msg
    assert record_cost(reg) >= ENTRY_BYTES + 1000 * BLOCK_ID_BYTES + len("d1")
    assert record_cost(reg, None) == record_cost(reg)
    assert entry_cost(0) == ENTRY_BYTES


# ------------------------------------------------------------------ P: the sender


def _answers(effects: list[object]) -> list[tuple[str, str, int]]:
    out = []
    for e in effects:
        if isinstance(e, Notify) and isinstance(e.record, wire.PushDone):
            out.append(("push_done", e.record.request_id, e.record.code))
        elif isinstance(e, Notify) and isinstance(e.record, wire.PullAck):
            out.append(("pull_ack", e.record.d_request_id, e.record.code))
    return out


def _refused(effects: list[object]) -> list[str]:
    return [e.counter for e in effects if isinstance(e, Refused)]


def test_registrations_beyond_the_per_peer_limit_are_answered_failed_at_once() -> None:
    m = make(max_pending_per_peer=3)
    for i in range(3):
        assert m.handle(registered(f"d{i}"), 0.0) == []
    out = m.handle(registered("d3"), 0.0)
    assert _answers(out) == [("push_done", "d3", BUSY)]
    reason = next(e.record.reason for e in out if isinstance(e, Notify))
    assert "limits.pending_registrations_per_peer" in reason and D1 in reason
    assert _refused(out) == ["limit_pending_registrations_refused"]
    # an early pull counts too; another peer has its own allowance
    assert _answers(m.handle(pulled("p9", "d9"), 0.0)) == [("pull_ack", "d9", BUSY)]
    assert m.handle(registered("e0", agent=D2), 0.0) == []
    assert m.limits()["pending_registrations_per_peer"]["used"] == 3
    # once one of D1's ends (P's engine finished it), D1 may register again
    m.handle(finish("d0"), 1.0)
    assert m.handle(registered("d4"), 1.0) == []


def test_registrations_beyond_the_pending_bytes_are_answered_failed() -> None:
    one = record_cost(registered("d0", blocks=(7, 8)).msg)
    m = make(pending_bytes=3 * one)
    for i in range(3):
        assert m.handle(registered(f"d{i}"), 0.0) == []
    out = m.handle(registered("d3"), 0.0)
    assert _answers(out) == [("push_done", "d3", BUSY)]
    assert _refused(out) == ["limit_pending_bytes_refused"]
    assert m.budget.used == 3 * one and m.budget.refused == 1
    # a huge registration never fits, however few are waiting
    m.handle(CancelArrived(D1, "d0"), 0.0)
    huge = registered("big", blocks=tuple(range(100_000)))
    assert _answers(m.handle(huge, 0.0)) == [("push_done", "big", BUSY)]


def test_a_finish_beyond_the_pending_bytes_ends_failed_on_both_sides() -> None:
    m = make(pending_bytes=4096)
    out = m.handle(finish("p1", blocks=tuple(range(200))), 0.0)
    fails = [e.record for e in out if isinstance(e, Emit)]
    assert [(type(r), r.request_id, r.code) for r in fails] == [(wire.SendFailed, "p1", BUSY)]
    assert "limits.pending_bytes" in fails[0].reason
    assert "p1" not in m.reqs and m.budget.used == 0
    # D's later registration for it is answered at once (not after registration_timeout)
    assert _answers(m.handle(registered("d1", "p1"), 0.5)) == [("push_done", "d1", BUSY)]
    # a registration that came first is answered when the finish is refused
    assert m.handle(registered("d2", "p2"), 1.0) == []
    out = m.handle(finish("p2", blocks=tuple(range(200))), 1.0)
    assert _answers(out) == [("push_done", "d2", BUSY)]
    assert [type(e.record) for e in out if isinstance(e, Emit)] == [wire.SendFailed]
    assert m.reqs == {} and m.budget.used == 0
    # a small one still fits
    assert m.handle(finish("p3", blocks=(1,)), 2.0) == []
    assert m.reqs["p3"].state is SendState.HELD


def test_the_sender_budget_is_returned_whatever_way_requests_end() -> None:
    rng = random.Random(7)
    m = make(pending_bytes=24 * 1024, max_pending_per_peer=4)
    now = 0.0
    for step in range(3000):
        now += rng.random() * 0.5
        rid = f"r{rng.randrange(40)}"
        kind = rng.randrange(6)
        agent = rng.choice((D1, D2))
        blocks = tuple(range(rng.randrange(1, 300)))
        try:
            if kind == 0:
                m.handle(finish(rid, blocks=blocks), now)
            elif kind == 1:
                m.handle(registered(f"d-{rid}", rid, agent=agent, blocks=blocks[:20]), now)
            elif kind == 2:
                m.handle(pulled(rid, f"d-{rid}", agent=agent), now)
            elif kind == 3:
                m.handle(AbortSend(rid, "s1"), now)
            elif kind == 4:
                m.handle(CancelArrived(agent, rid), now)
            else:
                m.handle_timer(now)
        except Exception as exc:  # a refusal of a client's request leaves it unchanged
            assert type(exc).__name__ == "InvalidRequest", (step, exc)
        live = sum(r.cost for r in m.reqs.values())
        assert m.budget.used == live <= m.budget.limit, step
    m.handle_timer(now + REG + WAIT + 1e6)  # every lease and wait runs out
    assert m.reqs == {} and m.budget.used == 0
    assert m.budget.refused > 0  # the bounds were hit on the way


# ------------------------------------------------------------------ P: charged at intake


def _reserved(m: Any, ev: RegistrationArrived | PullDoneArrived) -> Any:
    """`ev` as the notifier posts it: with its bytes reserved from the sender's budget."""
    r = m.budget.reserve(record_cost(ev.msg))
    assert r is not None
    return type(ev)(ev.agent, ev.msg, r)


def test_a_kept_registration_adopts_its_reservation_and_is_not_charged_twice() -> None:
    m = make()
    ev = _reserved(m, registered("d1"))
    cost = ev.reservation.cost
    assert m.handle(ev, 0.0) == []
    assert not ev.reservation.held and m.reqs["d1"].cost == cost and m.budget.used == cost
    # P's finish re-charges the entry in place; the end gives everything back
    m.handle(finish("d1"), 1.0)
    assert m.budget.used == m.reqs["d1"].cost
    m.handle(CancelArrived(D1, "d1"), 2.0)
    assert m.reqs == {} and m.budget.used == 0


def test_a_registration_for_a_held_request_adds_its_bytes_to_the_request() -> None:
    m = make()
    m.handle(finish("p1"), 0.0)
    lease = m.reqs["p1"].cost
    ev = _reserved(m, registered("d1", "p1"))
    m.handle(ev, 0.5)
    assert m.reqs["p1"].state is SendState.MATCHED and not ev.reservation.held
    assert m.reqs["p1"].cost == m.budget.used == lease + ev.reservation.cost
    m.handle(AbortSend("p1", "s1"), 1.0)
    assert m.budget.used == 0


def test_a_registration_refused_by_the_sender_releases_its_reservation() -> None:
    m = make(max_pending_per_peer=1)

    def refused(ev: RegistrationArrived | PullDoneArrived, now: float) -> None:
        before = m.budget.used
        ev = _reserved(m, ev)
        assert _answers(m.handle(ev, now)), ev  # D is answered failed at once
        assert not ev.reservation.held and m.budget.used == before

    assert m.handle(_reserved(m, registered("d0")), 0.0) == []
    refused(registered("d1"), 0.0)  # beyond the per-peer count
    refused(pulled("p1", "d1"), 0.0)
    m.handle(finish("p2"), 0.0)
    m.handle(registered("d2", "p2"), 0.0)
    refused(registered("d2b", "p2"), 0.5)  # a second registration for it
    refused(registered("d2c", "p2", agent=D2), 0.5)  # another peer's
    m.handle(CancelArrived(D1, "p2"), 1.0)
    refused(registered("d2d", "p2"), 1.0)  # late: it ended
    m.handle(StartDrain(), 1.0)  # d0, waiting, is answered failed
    refused(registered("d3"), 1.5)
    refused(pulled("p4", "d4"), 1.5)
    assert m.reqs == {} and m.budget.used == 0


def test_a_machine_that_raises_still_releases_the_reservation() -> None:
    m = make()
    ev = _reserved(m, registered("d1"))
    m._awaiting_by_agent = None  # type: ignore[assignment]  # any bug on the way in
    with pytest.raises(TypeError):
        m.handle(ev, 0.0)
    assert not ev.reservation.held and m.budget.used == 0


_STEP = st.tuples(
    st.sampled_from(
        (
            *("reg", "reg", "pull", "deliver", "deliver", "drop"),
            *("finish", "cancel", "abort", "view", "time", "drain"),
        )
    ),
    st.integers(0, 11),
    st.sampled_from((D1, D2)),
    st.integers(0, 600),
)


@settings(max_examples=150, deadline=None)
@given(st.lists(_STEP, max_size=120))
def test_reservations_from_intake_to_every_end_never_leak(
    steps: list[tuple[str, int, str, int]],
) -> None:
    """The notifier's side and the sender's together, as in the daemon: registrations and
    pulls are reserved at intake (refused there if they do not fit), wait in a queue (the
    mailbox), and are fed to the machine, dropped unseen, kept and then finished,
    written, cancelled, aborted, expired or refused during a drain. At every step the
    budget holds exactly what is queued plus what is kept, within its limit; once
    everything has ended it holds nothing, and no reservation is left held."""
    m = make(pending_bytes=16 * 1024, max_pending_per_peer=3)
    queue: deque[RegistrationArrived | PullDoneArrived] = deque()
    fed: list[Reservation] = []
    work: deque[Any] = deque()  # ResolveView / PostWrite waiting for their outcome
    now = 0.0
    intake_refused = 0

    def feed(ev: Any) -> None:
        try:
            out = m.handle(ev, now)
        except Exception as exc:  # a client's request the machine refuses, unchanged
            assert type(exc).__name__ == "InvalidRequest", exc
            return
        work.extend(e for e in out if isinstance(e, ResolveView | PostWrite))

    for kind, i, agent, blocks in steps:
        rid = f"r{i}"
        if kind in ("reg", "pull"):
            ev: RegistrationArrived | PullDoneArrived
            if kind == "reg":
                ev = registered(f"d{i}.{now}", rid, agent=agent, blocks=tuple(range(blocks)))
            else:
                ev = pulled(rid, f"d{i}.{now}", agent=agent)
            r = m.budget.reserve(record_cost(ev.msg))
            if r is None:
                intake_refused += 1  # answered BUSY by the notifier, never queued
            else:
                queue.append(type(ev)(ev.agent, ev.msg, r))
        elif kind == "deliver" and queue:
            ev = queue.popleft()
            feed(ev)
            assert ev.reservation is not None
            fed.append(ev.reservation)
        elif kind == "drop" and queue:
            ev = queue.popleft()  # the actor drops it (an agent that never handshaked)
            assert ev.reservation is not None and ev.reservation.release()
        elif kind == "finish":
            feed(finish(rid, blocks=tuple(range(1 + blocks % 50))))
        elif kind == "cancel":
            feed(CancelArrived(agent, rid))
        elif kind == "abort":
            feed(AbortSend(rid, "s1"))
        elif kind == "view" and work:
            eff = work.popleft()
            feed(
                ViewResolved(eff.key, view="v")
                if isinstance(eff, ResolveView)
                else WriteDone(eff.key)
            )
        elif kind == "time":
            now += blocks / 20
            work.extend(e for e in m.handle_timer(now) if isinstance(e, ResolveView | PostWrite))
        elif kind == "drain":
            feed(StartDrain())
        queued = sum(e.reservation.cost for e in queue if e.reservation is not None)
        live = sum(r.cost for r in m.reqs.values())
        assert m.budget.used == queued + live <= m.budget.limit
        assert not any(r.held for r in fed)
        assert m.budget.refused >= intake_refused
    while queue:
        ev = queue.popleft()
        feed(ev)
        assert ev.reservation is not None and not ev.reservation.held
    while work:
        eff = work.popleft()
        feed(
            ViewResolved(eff.key, view="v") if isinstance(eff, ResolveView) else WriteDone(eff.key)
        )
    m.handle_timer(now + REG + WAIT + 1e6)  # every lease and wait runs out
    assert m.reqs == {} and m.budget.used == 0


# ------------------------------------------------------------------ D: the receiver


def test_a_track_beyond_the_pending_bytes_is_refused_and_changes_nothing() -> None:
    r = make_receiver()
    r.budget = PendingBudget(record_cost(track("a")))
    r.handle(track("a"), 0.0)
    assert "a" in r.reqs
    with pytest.raises(Busy, match=r"limits\.pending_bytes"):
        r.handle(track("b"), 0.0)
    assert set(r.reqs) == {"a"} and r.budget.refused == 1


def test_a_load_beyond_the_pending_bytes_ends_failed_and_frees_p() -> None:
    r = make_receiver()
    r.budget = PendingBudget(record_cost(load("a")) + 100)
    r.handle(load("a"), 0.0)
    assert r.reqs["a"].state is RecvState.HANDSHAKING
    out = r.handle(load("b", blocks=(4, 5)), 0.0)
    assert "b" not in r.reqs
    fails = [e.record for e in out if isinstance(e, Emit)]
    assert [(type(f), f.request_id, f.code, f.block_ids) for f in fails] == [
        (wire.RecvFailed, "b", BUSY, (4, 5))
    ]
    assert [e for e in out if isinstance(e, CancelAt)] == [CancelAt("p1:5001", "b")]
    assert _refused(out) == ["limit_pending_bytes_refused"]
    # a tracked request whose load does not fit: dropped (P told), failed once
    r.budget = PendingBudget(r.budget.used + record_cost(track("c")) + 10)
    r.budget.used = r.budget.limit - record_cost(track("c")) - 10
    r.handle(track("c"), 1.0)
    out = r.handle(load("c", blocks=tuple(range(500))), 1.0)
    assert "c" not in r.reqs
    assert [type(e.record) for e in out if isinstance(e, Emit)] == [wire.RecvFailed]
    assert [e for e in out if isinstance(e, CancelAt)] == [CancelAt("p1:5001", "c")]


def test_the_receiver_budget_is_returned_when_requests_end() -> None:
    r = make_receiver()
    r.handle(track("a"), 0.0)
    r.handle(load("b"), 0.0)
    assert r.budget.used == sum(q.cost for q in r.reqs.values()) > 0
    r.handle(AbortRecv("a", "s1"), 1.0)  # only tracked: dropped at once
    assert r.budget.used == r.reqs["b"].cost
    r.handle(PeerUnresolved("b", TransferError("P is gone")), 2.0)
    assert r.reqs == {} and r.budget.used == 0


# ---------------------------------------------------------------- notifications and handshakes


def test_message_cost_charges_every_request_id_a_heartbeat_names_by_its_text() -> None:
    from kvd.core.limits import OBJECT_BYTES, message_cost

    few = message_cost(wire.Heartbeat(()))
    ids = tuple(f"cmpl-{i:016x}-0" for i in range(1000))
    many = message_cost(wire.Heartbeat(ids))
    per_id = (many - few) / 1000
    # a pointer in the tuple, a str object and its characters (CPython: ~49 + len bytes)
    assert per_id >= 8 + 49 + len(ids[0])
    assert per_id == 8 + OBJECT_BYTES + len(ids[0])
    assert few > ENTRY_BYTES
    # nested records (a LayersPushed's ranges) are charged too
    ranges = tuple(wire.LayerRange(f"r{i}", 0, 2) for i in range(100))
    assert message_cost(wire.LayersPushed(0, ranges)) > 100 * (OBJECT_BYTES + 2 * BLOCK_ID_BYTES)


def test_shared_budget_keeps_a_flooding_peer_to_its_share() -> None:
    from kvd.core.limits import SharedBudget

    b = SharedBudget(1000, name="limits.notif_bytes")
    flood = [r for _ in range(10) if (r := b.reserve_for("bad", 200)) is not None]
    assert len(flood) == 2 and b.by_key == {"bad": 400}  # half of 1000 at most (2 x 200)
    assert b.refused == 8
    good = b.reserve_for("good", 500)
    assert good is not None and b.used == 900  # the other half stayed free
    assert b.reserve_for("good", 200) is None  # beyond the whole budget
    assert b.refused == 9
    good.release()
    for r in flood:
        r.release()
        assert not r.release()  # once only
    assert b.used == 0 and b.by_key == {}
    alone = b.reserve_for("big", 900)  # a peer holding nothing may take what fits at all
    assert alone is not None and b.reserve_for("big", 1) is None
    alone.release()
    assert "limits.notif_bytes reached" in b.why(10, "a heartbeat")


def test_alone_fits_takes_one_entry_larger_than_the_bound_while_nothing_is_held() -> None:
    b = PendingBudget(100, name="limits.handshake_bytes")
    big = b.reserve(250, alone_fits=True)
    assert big is not None and b.used == 250
    assert b.reserve(1, alone_fits=True) is None and b.refused == 1  # one at a time
    big.release()
    assert b.reserve(250) is None  # without alone_fits, never
    small = b.reserve(60, alone_fits=True)
    assert small is not None and b.reserve(60, alone_fits=True) is None
