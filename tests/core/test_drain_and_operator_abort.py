"""Drain (`kvd drain`) and the operator's abort (`kvd abort`) in the transfer machines,
driven directly: no sockets, no loop, no sleeps.

P draining grants no new lease: a `finished` fails at once (P's engine is told, and D's
registration or pull for it is refused when it comes, so D recomputes); what waits for a
lease is answered failed; what is leased is served to its end; `Drained` comes when
nothing is left. D draining drops what is only tracked (P told), ignores new tracks,
fails a registration or pull at once with its blocks (P told), and lets what is
receiving end. The operator's abort ends a request whatever its session.
"""

from __future__ import annotations

import pytest
from kvd_client import wire
from kvd_client.errors import ErrorCode, InvalidRequest, NotFound

from kvd.core import receiver as rxm
from kvd.core import sender as txm
from kvd.core.effects import Drained, Emit, Notify

from . import test_receiver as rt
from . import test_sender as st

SHUTTING_DOWN = int(ErrorCode.SHUTTING_DOWN)


# ------------------------------------------------------------------ P: drain


def test_p_drain_when_idle_is_drained_at_once_and_again_when_asked() -> None:
    tx = st.make()
    out = tx.handle(txm.StartDrain(), 1.0)
    assert st.calm(out) == [Drained()] and st.logs(out) == ["drain_started"]
    assert st.calm(tx.handle(txm.StartDrain(), 2.0)) == [Drained()]
    assert tx.draining_since == 1.0  # the first start counts
    st.assert_empty(tx)


def test_p_drain_refuses_a_finish_on_both_sides() -> None:
    tx = st.make()
    out = tx.handle(txm.StartDrain(), 0.0)
    assert Drained() in out
    # P's engine finishes during the drain: no lease, its engine is told now
    out = tx.handle(st.finish("r1-aaaa"), 1.0)
    assert st.calm(out) == [("failed", "s1", "r1-aaaa", SHUTTING_DOWN)]
    assert "draining" in st.reason(out)
    assert len(tx.leases) == 0 and tx.reqs == {}
    assert tx.counters["finishes_refused_draining"] == 1
    # D registers for it later (by P's id): refused at once, D recomputes
    assert st.calm(tx.handle(st.registered("d1-bbbb", "r1-aaaa"), 2.0)) == [
        ("push_done", st.D1, "d1-bbbb", SHUTTING_DOWN)
    ]
    # or pulls it by P's id
    assert st.calm(tx.handle(st.pulled("r1-aaaa", "d1-bbbb"), 2.0)) == [
        ("pull_ack", st.D1, "d1-bbbb", False, SHUTTING_DOWN)
    ]
    st.assert_empty(tx)


def test_p_drain_answers_what_waits_for_a_lease_and_refuses_new_waits() -> None:
    tx = st.make()
    # D came first: a registration and an early pull wait for P's finish
    assert tx.handle(st.registered("d1", "p1"), 0.0) == []
    assert tx.handle(st.pulled("p2", "d2"), 0.0) == []
    assert tx.awaiting() == (1, 1)
    out = tx.handle(txm.StartDrain(), 1.0)
    assert st.calm(out) == [
        ("push_done", st.D1, "d1", SHUTTING_DOWN),
        ("pull_ack", st.D1, "d2", False, SHUTTING_DOWN),
        Drained(),
    ]
    assert tx.awaiting() == (0, 0)
    st.assert_empty(tx)
    # a new registration or early pull for a request P never finished: refused now (it
    # would wait for a lease that will not come)
    assert st.calm(tx.handle(st.registered("d3", "p3"), 2.0)) == [
        ("push_done", st.D1, "d3", SHUTTING_DOWN)
    ]
    assert st.calm(tx.handle(st.pulled("p4", "d4"), 2.0)) == [
        ("pull_ack", st.D1, "d4", False, SHUTTING_DOWN)
    ]
    st.assert_empty(tx)
    # P's engine finishes one of them afterwards: refused too, nothing leased
    assert st.calm(tx.handle(st.finish("p1"), 3.0)) == [("failed", "s1", "p1", SHUTTING_DOWN)]
    st.assert_empty(tx)


def test_p_drain_serves_what_is_leased_then_says_drained() -> None:
    tx = st.make()
    assert tx.handle(st.finish("push-1"), 0.0) == []
    assert tx.handle(st.finish("pull-1"), 0.0) == []
    st.matched(tx, "mat-1", "d-mat", 0.0)
    post = st.writing(tx, "wr-1", "d-wr", 0.0)
    out = tx.handle(txm.StartDrain(), 1.0)
    assert Drained() not in out and st.calm(out) == []  # all leased: nothing refused
    # D registers for a held lease: served (held -> matched -> writing)
    ev = st.registered("d-push", "push-1")
    assert tx.handle(ev, 1.5) == [txm.ResolveView("push-1", st.D1, ev.msg)]
    (post2,) = tx.handle(txm.ViewResolved("push-1", st.VIEW), 1.6)
    assert isinstance(post2, txm.PostWrite)
    # the matched one's view resolves: written too
    (post3,) = tx.handle(txm.ViewResolved("mat-1", st.VIEW), 1.7)
    assert isinstance(post3, txm.PostWrite)
    # the pull is acknowledged
    out = tx.handle(st.pulled("pull-1", "d-pull"), 2.0)
    assert st.calm(out) == [
        ("finished", "s1", "pull-1", 0),
        ("pull_ack", st.D1, "d-pull", True, 0),
    ]
    # the WRITEs end; the last one drains the machine
    assert Drained() not in tx.handle(txm.WriteDone(post.key), 2.1)
    assert Drained() not in tx.handle(txm.WriteDone("push-1"), 2.2)
    out = tx.handle(txm.WriteDone("mat-1", InvalidRequest("D went away")), 2.3)
    assert st.calm(out)[-1] == Drained()
    assert ("failed", "s1", "mat-1", int(ErrorCode.INVALID)) in st.calm(out)
    st.assert_empty(tx)


def test_p_drain_lease_expiry_also_ends_the_drain() -> None:
    tx = st.make()
    assert tx.handle(st.finish("r1"), 0.0) == []
    assert Drained() not in tx.handle(txm.StartDrain(), 0.0)
    out = tx.handle_timer(st.LEASE)
    assert st.calm(out) == [("expired", "s1", "r1", 0), Drained()]
    st.assert_empty(tx)


# ------------------------------------------------------------------ P: the operator's abort


def test_p_operator_abort_ends_any_sessions_request_on_both_sides() -> None:
    tx = st.make()
    st.matched(tx, "r1", "d1", 0.0)
    # the engine's own abort from another session would be ignored; the operator's is not
    assert tx.handle(txm.AbortSend("r1", "other-session"), 0.5) == []
    out = tx.handle(txm.ForceAbort("r1"), 1.0)
    assert st.calm(out) == [
        ("failed", "s1", "r1", int(ErrorCode.TRANSFER)),
        ("push_done", st.D1, "d1", int(ErrorCode.TRANSFER)),
    ]
    assert "operator" in st.reason(out)
    assert tx.counters["operator_aborts"] == 1
    st.assert_empty(tx)
    # exactly once: the view's late answer changes nothing, a second abort finds nothing
    assert tx.handle(txm.ViewResolved("r1", st.VIEW), 1.1) == []
    with pytest.raises(NotFound):
        tx.handle(txm.ForceAbort("r1"), 1.2)
    # a late registration for it is refused at once; a finish under its id too
    assert st.calm(tx.handle(st.registered("d9", "r1"), 1.3))[0][0] == "push_done"


def test_p_operator_abort_of_a_waiting_registration_answers_d() -> None:
    tx = st.make()
    assert tx.handle(st.registered("d1", "p1"), 0.0) == []
    out = tx.handle(txm.ForceAbort("p1"), 1.0)
    assert st.calm(out) == [("push_done", st.D1, "d1", int(ErrorCode.TRANSFER))]
    st.assert_empty(tx)
    # P's engine finishes it later: refused at once, nothing leased
    out = tx.handle(st.finish("p1"), 2.0)
    assert [e.record.request_id for e in out if isinstance(e, Emit)] == ["p1"]
    assert len(tx.leases) == 0


def test_p_operator_abort_does_not_cut_a_write() -> None:
    tx = st.make()
    post = st.writing(tx, "r1", "d1", 0.0)
    with pytest.raises(InvalidRequest, match="WRITE"):
        tx.handle(txm.ForceAbort("r1"), 1.0)
    assert st.state(tx, "r1") is st.S.WRITING  # unchanged
    assert st.calm(tx.handle(txm.WriteDone(post.key), 1.5)) == [("finished", "s1", "r1", 0)]
    st.assert_empty(tx)


def test_p_operator_abort_of_an_unknown_request_is_not_found() -> None:
    tx = st.make()
    with pytest.raises(NotFound, match="P side"):
        tx.handle(txm.ForceAbort("nope"), 0.0)
    st.assert_empty(tx)


# ------------------------------------------------------------------ D: drain


def _cancels(effects: list[rxm.Effect]) -> list[rxm.CancelAt]:
    return [e for e in effects if isinstance(e, rxm.CancelAt)]


def test_d_drain_drops_tracked_ignores_new_tracks_and_refuses_loads() -> None:
    rx = rt.make()
    assert rx.handle(rt.track("t1", hb_id="p-t1"), 0.0) == []
    out = rx.handle(rxm.StartDrain(), 1.0)
    assert _cancels(out) == [rxm.CancelAt(rt.P1, "p-t1")]  # P frees the blocks now
    assert rt.records(out) == []  # only tracked: no event was announced
    assert Drained() in out
    rt.assert_empty(rx)
    # a new track is ignored (no heartbeats keep a lease alive for it)
    assert rx.handle(rt.track("t2"), 1.5) == []
    rt.assert_empty(rx)
    # a registration fails at once with its blocks, and P is told
    for mode in ("push", "pull"):
        ld = rt.load(f"{mode}-1", mode, blocks=(4, 5), p_id=f"p-{mode}")
        out = rx.handle(ld, 2.0)
        rec = rt.one_failure(out, f"{mode}-1")
        assert rec.code == SHUTTING_DOWN and rec.block_ids == (4, 5)
        assert "draining" in rec.reason
        assert _cancels(out) == [rxm.CancelAt(rt.P1, f"p-{mode}")]
        rt.assert_empty(rx)
    assert rx.counters["loads_refused_draining"] == 2


def test_d_drain_lets_what_is_receiving_end_then_says_drained() -> None:
    rx = rt.make()
    push = rt.load("push-1", "push")
    rt.registered(rx, push, 0.0)
    pull = rt.load("pull-1", "pull", p_id="p-pull")
    rt.reading(rx, pull, 0.0)
    out = rx.handle(rxm.StartDrain(), 1.0)
    assert rt.quiet(out) == []
    # the READ returns and is acknowledged: finished, as without a drain
    assert rt.quiet(rx.handle(rxm.ReadDone("pull-1"), 1.1)) == [
        rxm.SendFor("pull-1", rt.AGENTS[rt.P1], rt.first_of(pull))
    ]
    assert rt.quiet(rx.handle(rt.pull_ack("pull-1"), 1.2)) == [rt.finished("pull-1")]
    # P's WRITE lands: finished, and nothing is left
    out = rt.quiet(rx.handle(rt.push_done("push-1"), 1.3))
    assert out == [rt.finished("push-1"), Drained()]
    rt.assert_empty(rx)


# ------------------------------------------------------------------ D: the operator's abort


def test_d_operator_abort_ends_any_sessions_request_once() -> None:
    rx = rt.make()
    ld = rt.load("r1", "push", session="engine-session")
    rt.registered(rx, ld, 0.0)
    assert rx.handle(rxm.AbortRecv("r1", "another-session"), 0.5) == []  # not its own
    out = rt.quiet(rx.handle(rxm.ForceAbort("r1"), 1.0))
    # registered at P: P is told, and its answer (or the bound) ends the request
    assert out == [rxm.SendFor("r1", rt.AGENTS[rt.P1], rt.cancel("r1"))]
    assert rx.reqs["r1"].state is rt.S.CANCELLING
    out = rx.handle(rt.push_done("r1", ok=False, code=int(ErrorCode.TRANSFER)), 1.5)
    rec = rt.one_failure(out, "r1")
    assert "operator" in rec.reason and rec.block_ids == (1, 2, 3)
    rt.assert_empty(rx)
    with pytest.raises(NotFound, match="D side"):
        rx.handle(rxm.ForceAbort("r1"), 2.0)


def test_d_operator_abort_waits_for_a_read_in_flight() -> None:
    rx = rt.make()
    ld = rt.load("r1", "pull", p_id="p-1")
    rt.reading(rx, ld, 0.0)
    assert rt.records(rx.handle(rxm.ForceAbort("r1"), 1.0)) == []
    assert rx.reqs["r1"].state is rt.S.READING  # the READ writes into our blocks: wait
    out = rx.handle(rxm.ReadDone("r1"), 1.5)
    # nothing more to read: P is told (the PullDone frees its lease) and its answer ends it
    assert rx.reqs["r1"].state is rt.S.ACKING
    out = rx.handle(rt.pull_ack("r1"), 1.6)
    rec = rt.one_failure(out, "r1")
    assert "operator" in rec.reason
    rt.assert_empty(rx)


def test_d_operator_abort_of_a_tracked_request_drops_it_and_tells_p() -> None:
    rx = rt.make()
    assert rx.handle(rt.track("r1", hb_id="p-1"), 0.0) == []
    out = rx.handle(rxm.ForceAbort("r1"), 1.0)
    assert _cancels(out) == [rxm.CancelAt(rt.P1, "p-1")]
    assert rt.records(out) == []  # nothing was announced beyond the track
    rt.assert_empty(rx)


def test_notify_effects_are_plain_records() -> None:
    """The refusals travel as the protocol's ordinary answers (nothing new on the wire)."""
    tx = st.make()
    tx.handle(txm.StartDrain(), 0.0)
    (eff,) = [e for e in tx.handle(st.registered("d1", "p1"), 0.0) if isinstance(e, Notify)]
    assert isinstance(eff.record, wire.PushDone) and not eff.record.ok
