"""The D side of the transfer protocol (`kvd.core.receiver`), driven directly: no sockets, no
loop, no sleeps; the time is an argument. The direct tests walk each path of the machine; the
model-based test at the end drives it with random event sequences next to a small reference
model and checks the protocol's rules after every step.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvd_client import wire
from kvd_client.errors import (
    ErrorCode,
    Incompatible,
    InvalidRequest,
    LocalProtocolError,
    Timeout,
    TransferError,
)

from kvd.core.clock import StallClock
from kvd.core.effects import Emit, Log, Notify, SessionEnded
from kvd.core.receiver import (
    _ON,
    MAX_HB_IDS,
    MAX_WRITE_BOUND,
    TERMINAL,
    TRANSITIONS,
    AbortRecv,
    Beat,
    CancelAt,
    CheckGone,
    Effect,
    EndSession,
    Event,
    LayersPushedArrived,
    Load,
    PeerGone,
    PeerKnown,
    PeerLost,
    PeerReached,
    PeerResolved,
    PeerUnreachable,
    PeerUnresolved,
    PostRead,
    ProbePeer,
    PullAckArrived,
    PushDoneArrived,
    ReadDone,
    ReadSettled,
    Receiver,
    RecvRequest,
    RecvState,
    Resolve,
    ResyncArrived,
    SendFailed,
    SendFor,
    Sent,
    Track,
    push_hold_bound,
)

S = RecvState

LEASE: Final = 6.0
HB: Final = LEASE / 6.0
"""Heartbeat period until a handshake teaches P's lease."""
PROBE: Final = 2.0
REG_TIMEOUT: Final = 20.0
XFER_TIMEOUT: Final = 15.0
CANCEL_BOUND: Final = min(XFER_TIMEOUT, 10.0)
"""How long a cancelled registration waits for P's last word."""

P1: Final = "p1:5001"
P2: Final = "p2:5002"
AGENTS: Final = {P1: "agent-p1", P2: "agent-p2"}
ENGINE: Final = "d-engine"
VIEW: Final = "view-of-p"

TRANSFER: Final = int(ErrorCode.TRANSFER)
TIMEOUT: Final = int(ErrorCode.TIMEOUT)
LEASE_EXPIRED: Final = int(ErrorCode.LEASE_EXPIRED)
INCOMPATIBLE: Final = int(ErrorCode.INCOMPATIBLE)


def make() -> Receiver:
    return Receiver(
        lease_duration=LEASE,
        probe_interval=PROBE,
        push_registration_timeout=REG_TIMEOUT,
        transfer_timeout=XFER_TIMEOUT,
    )


def track(rid: str, *, session: str = "s1", peer: str = P1, hb_id: str = "") -> Track:
    host, port = peer.split(":")
    return Track(rid, session, ENGINE, host, int(port), hb_id or rid)


def load(
    rid: str,
    mode: str = "push",
    *,
    session: str = "s1",
    blocks: tuple[int, ...] = (1, 2, 3),
    peer: str = P1,
    p_id: str = "",
) -> Load:
    host, port = peer.split(":")
    return Load(
        request_id=rid,
        session=session,
        engine_id=ENGINE,
        mode=mode,
        block_ids=blocks,
        host=host,
        port=int(port),
        remote_engine_id="p-engine",
        remote_request_id=p_id,
        remote_block_ids=tuple(b + 100 for b in blocks),
        remote_incarnation=7,
        remote_session="p-session",
    )


def first_of(ld: Load, *, by_write: bool = False) -> wire.Record:
    """What the actor would resolve as the message that starts the transfer (`by_write`:
    a pull P serves by WRITE, its registration naming P's blocks)."""
    if by_write:
        assert ld.mode == "pull" and ld.block_ids
        reg = first_of(replace(ld, mode="push"))
        assert isinstance(reg, wire.PushRegistration)
        return replace(reg, p_block_ids=ld.remote_block_ids)
    if ld.mode == "push":
        return wire.PushRegistration(
            request_id=ld.request_id,
            remote_request_id=ld.remote_request_id,
            engine_id=ld.engine_id,
            remote_engine_id=ld.remote_engine_id,
            tp_size=1,
            block_ids=ld.block_ids,
            side_host="d-host",
            side_port=4000,
            incarnation=9,
            generations=(1,),
            p_session=ld.remote_session,
        )
    return wire.PullDone(ld.hb_id, ld.request_id, (3,) if ld.block_ids else (), ld.remote_session)


def resolved(ld: Load, *, ranks: int = 1, since: float = 0.0, agent: str = "") -> PeerResolved:
    return PeerResolved(ld.request_id, agent or AGENTS[ld.peer], since, ranks, first_of(ld), VIEW)


def push_done(
    rid: str, rank: int = 0, *, ok: bool = True, code: int = 0, agent: str = AGENTS[P1]
) -> PushDoneArrived:
    return PushDoneArrived(agent, wire.PushDone(rid, rank, ok, code, "" if ok else "P says no"))


def pull_ack(
    rid: str, *, ok: bool = True, code: int = 0, agent: str = AGENTS[P1]
) -> PullAckArrived:
    return PullAckArrived(agent, wire.PullAck(rid, ok, code, "" if ok else "lease gone"))


def cancel(hb_id: str) -> wire.CancelRegistration:
    return wire.CancelRegistration(hb_id)


def quiet(effects: Iterable[Effect]) -> list[Effect]:
    """The effects without log lines (each checked: a line about a request names its
    peer too, so the logs of one request can be followed across both daemons)."""
    out = []
    for e in effects:
        if isinstance(e, Log):
            assert "request_id" not in e.fields or "peer" in e.fields, e
        else:
            out.append(e)
    return out


def records(effects: Iterable[Effect]) -> list[wire.Record]:
    """What was emitted to clients."""
    return [e.record for e in effects if isinstance(e, Emit)]


def one_failure(effects: Sequence[Effect], rid: str) -> wire.RecvFailed:
    """The single terminal event in `effects`, which must be a RecvFailed for `rid`."""
    (rec,) = records(effects)
    assert isinstance(rec, wire.RecvFailed)
    assert rec.request_id == rid
    return rec


def finished(rid: str, session: str = "s1") -> Emit:
    return Emit(session, ENGINE, wire.RecvFinished(rid))


def registered(rx: Receiver, ld: Load, now: float, ranks: int = 1) -> None:
    """Bring a push to REGISTERED (its watchdog at now + REG_TIMEOUT)."""
    assert quiet(rx.handle(ld, now)) == [Resolve(ld, refresh=False)]
    assert quiet(rx.handle(resolved(ld, ranks=ranks, since=now), now)) == [
        SendFor(ld.request_id, AGENTS[ld.peer], first_of(ld))
    ]
    assert rx.handle(Sent(ld.request_id), now) == []
    assert rx.reqs[ld.request_id].state is S.REGISTERED


def reading(rx: Receiver, ld: Load, now: float) -> None:
    assert quiet(rx.handle(ld, now)) == [Resolve(ld, refresh=False)]
    assert quiet(rx.handle(resolved(ld, since=now), now)) == [
        PostRead(ld.request_id, AGENTS[ld.peer], VIEW)
    ]
    assert rx.reqs[ld.request_id].state is S.READING


def acking(rx: Receiver, ld: Load, now: float) -> None:
    """Bring a pull to ACKING (its watchdog at now + XFER_TIMEOUT)."""
    reading(rx, ld, now)
    assert quiet(rx.handle(ReadDone(ld.request_id), now)) == [
        SendFor(ld.request_id, AGENTS[ld.peer], first_of(ld))
    ]
    assert rx.reqs[ld.request_id].state is S.ACKING


def assert_empty(rx: Receiver) -> None:
    """Nothing left: no request, heartbeat, probe or watchdog, so no reason to wake."""
    assert rx.reqs == {}
    assert len(rx.heartbeats) == 0
    assert len(rx.watchdogs) == 0
    assert len(rx.probes) == 0
    assert rx._held_by_hb == {}
    assert rx.next_deadline() is None


# ------------------------------------------------------------------ the table


def test_transition_table_is_closed() -> None:
    assert {S.FINISHED, S.FAILED, S.DROPPED} == TERMINAL
    # every live state has a way on, terminal states have none
    assert set(TRANSITIONS) == set(S) - TERMINAL
    assert all(TRANSITIONS[s] for s in TRANSITIONS)
    assert not any(s in TRANSITIONS for s in TERMINAL)
    assert all(s not in TERMINAL for (s, _) in _ON)
    # every state is reachable from TRACKED, and every live state can reach an end
    seen, todo = {S.TRACKED}, [S.TRACKED]
    while todo:
        for nxt in TRANSITIONS.get(todo.pop(), frozenset()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert seen == set(S)
    for start in TRANSITIONS:
        reach, todo = {start}, [start]
        while todo:
            for nxt in TRANSITIONS.get(todo.pop(), frozenset()):
                if nxt not in reach:
                    reach.add(nxt)
                    todo.append(nxt)
        assert reach & TERMINAL, start


def test_a_move_outside_the_table_is_our_bug() -> None:
    rx = make()
    req = RecvRequest("r1", S.FINISHED, "s1", ENGINE, P1, "r1", 0.0)
    with pytest.raises(LocalProtocolError, match="no transition"):
        rx._goto(req, S.HANDSHAKING)
    assert req.state is S.FINISHED


# ------------------------------------------------------------------ happy paths


def test_push_happy_path_and_its_deadlines() -> None:
    rx = make()
    assert rx.next_deadline() is None
    assert rx.handle(track("r1"), 0.0) == []
    assert rx.reqs["r1"].state is S.TRACKED
    assert rx.next_deadline() == 0.0  # P's lease clock runs already: beat at once
    assert rx.handle_timer(0.0) == [Beat(P1, ("r1",))]
    assert rx.next_deadline() == HB

    ld = load("r1")
    assert quiet(rx.handle(ld, 0.5)) == [Resolve(ld, refresh=False)]
    assert rx.reqs["r1"].state is S.HANDSHAKING
    assert rx.next_deadline() == HB  # joining the peer's beat does not pull it forward

    assert quiet(rx.handle(resolved(ld, ranks=2), 0.6)) == [SendFor("r1", AGENTS[P1], first_of(ld))]
    assert rx.reqs["r1"].state is S.REGISTERING
    assert len(rx.watchdogs) == 0  # waiting on our own send, which always answers

    assert rx.handle(Sent("r1"), 0.7) == []
    assert rx.reqs["r1"].state is S.REGISTERED
    assert rx.watchdogs.get("r1") == 0.7 + REG_TIMEOUT
    assert rx.next_deadline() == HB

    assert rx.handle_timer(1.0) == [Beat(P1, ("r1",))]
    # no answer from P a heartbeat period after the registration went out: P may have
    # refused it unheard (it did not know us at that moment): sent again, P ignores a
    # repeat; the gap doubles
    assert rx.next_deadline() == 0.7 + HB
    assert rx.handle_timer(0.7 + HB) == [SendFor("r1", AGENTS[P1], first_of(ld))]
    assert rx.counters["registrations_resent"] == 1
    assert rx.handle(Sent("r1"), 1.8) == []  # (a repeat's outcome changes nothing)
    assert rx.resends.get("r1") == 0.7 + 3 * HB
    assert rx.next_deadline() == 2.0  # the next beat and the first probe
    assert rx.handle_timer(2.0) == [Beat(P1, ("r1",)), ProbePeer(P1)]
    assert rx.next_deadline() == 3.0

    assert rx.handle(push_done("r1", 0), 2.5) == []
    assert len(rx.resends) == 0  # P answered: it has the registration
    assert rx.handle(push_done("r1", 0), 2.5) == []  # a duplicate rank counts once
    assert rx.reqs["r1"].state is S.REGISTERED
    out = rx.handle(push_done("r1", 1), 2.6)
    assert quiet(out) == [finished("r1")]
    assert rx.counters["recv_ok"] == 1
    assert_empty(rx)
    assert rx.handle_timer(1000.0) == []


def test_push_without_track_heartbeats_ps_id() -> None:
    rx = make()
    ld = load("d-1", p_id="p-1")
    registered(rx, ld, 10.0)
    assert rx.handle_timer(10.0) == [Beat(P1, ("p-1",))]
    assert rx.next_deadline() == 10.0 + HB
    assert quiet(rx.handle(push_done("d-1"), 11.0)) == [finished("d-1")]
    assert_empty(rx)


def test_pull_happy_path() -> None:
    rx = make()
    ld = load("r1", "pull", p_id="p-1")
    assert quiet(rx.handle(ld, 0.0)) == [Resolve(ld, refresh=False)]
    assert rx.next_deadline() == 0.0
    assert rx.handle_timer(0.0) == [Beat(P1, ("p-1",))]
    assert quiet(rx.handle(resolved(ld), 0.1)) == [PostRead("r1", AGENTS[P1], VIEW)]
    assert rx.reqs["r1"].state is S.READING
    assert len(rx.watchdogs) == 0  # a READ in flight always returns
    assert quiet(rx.handle(ReadDone("r1"), 0.4)) == [SendFor("r1", AGENTS[P1], first_of(ld))]
    assert rx.reqs["r1"].state is S.ACKING
    assert rx.watchdogs.get("r1") == 0.4 + XFER_TIMEOUT
    assert rx.handle(Sent("r1"), 0.5) == []  # the PullDone went out: P's answer decides
    assert rx.reqs["r1"].state is S.ACKING
    assert quiet(rx.handle(pull_ack("r1"), 0.6)) == [finished("r1")]
    assert_empty(rx)


def test_pull_with_nothing_to_read_acks_at_once() -> None:
    rx = make()
    ld = load("r1", "pull", blocks=())
    rx.handle(ld, 0.0)
    out = quiet(rx.handle(resolved(ld), 0.1))
    assert out == [SendFor("r1", AGENTS[P1], first_of(ld))]
    assert not any(isinstance(e, PostRead) for e in out)
    assert rx.reqs["r1"].state is S.ACKING
    assert quiet(rx.handle(pull_ack("r1"), 0.2)) == [finished("r1")]


# ------------------------------------------------------------------ failures


def test_peer_unresolved_fails_with_the_blocks_to_recompute() -> None:
    rx = make()
    ld = load("r1", blocks=(4, 5))
    rx.handle(ld, 0.0)
    out = quiet(rx.handle(PeerUnresolved("r1", TransferError("no such peer")), 0.1))
    assert out == [Emit("s1", ENGINE, wire.RecvFailed("r1", TRANSFER, "no such peer", (4, 5)))]
    assert rx.counters["recv_failed"] == 1
    assert_empty(rx)
    # the resolution's answer never comes twice, but if it did it would change nothing
    assert quiet(rx.handle(PeerUnresolved("r1", TransferError("again")), 0.2)) == []


def test_peer_that_refused_after_being_reached_is_told() -> None:
    rx = make()
    ld = load("r1", "pull", p_id="p-1")
    rx.handle(ld, 0.0)
    out = quiet(rx.handle(PeerUnresolved("r1", Incompatible("other model"), "agent-p1"), 0.1))
    # it may hold a lease on the blocks: cancel first, then the terminal event
    assert out[0] == Notify("agent-p1", cancel("p-1"))
    rec = one_failure(out, "r1")
    assert (rec.code, rec.reason, rec.block_ids) == (INCOMPATIBLE, "other model", (1, 2, 3))
    assert len(out) == 2


def test_registration_not_sent_fails() -> None:
    rx = make()
    ld = load("r1")
    rx.handle(ld, 0.0)
    rx.handle(resolved(ld), 0.0)
    out = quiet(rx.handle(SendFailed("r1", TransferError("send failed")), 0.1))
    rec = one_failure(out, "r1")
    assert (rec.code, rec.reason, rec.block_ids) == (TRANSFER, "send failed", (1, 2, 3))
    assert_empty(rx)
    assert rx.handle(Sent("r1"), 0.2) == []  # never revived


def test_stale_view_when_sending_rehandshakes_once() -> None:
    rx = make()
    ld = load("r1")
    rx.handle(ld, 0.0)
    rx.handle(resolved(ld, since=0.0), 0.0)
    out = quiet(rx.handle(SendFailed("r1", TransferError("peer gone"), stale=True), 1.0))
    assert out == [Resolve(ld, refresh=True)]
    assert rx.reqs["r1"].state is S.HANDSHAKING
    assert quiet(rx.handle(resolved(ld, since=1.0), 1.1)) == [
        SendFor("r1", AGENTS[P1], first_of(ld))
    ]
    out = quiet(rx.handle(SendFailed("r1", TransferError("peer gone again"), stale=True), 1.2))
    assert one_failure(out, "r1").reason == "peer gone again"
    assert_empty(rx)


def test_read_failed_cancels_at_p_and_fails() -> None:
    rx = make()
    ld = load("r1", "pull", p_id="p-1")
    reading(rx, ld, 0.0)
    out = quiet(rx.handle(ReadDone("r1", TransferError("READ failed")), 0.5))
    assert out[0] == Notify(AGENTS[P1], cancel("p-1"))
    rec = one_failure(out, "r1")
    assert (rec.code, rec.reason, rec.block_ids) == (TRANSFER, "READ failed", (1, 2, 3))
    assert_empty(rx)


def test_stale_read_rehandshakes_once() -> None:
    rx = make()
    ld = load("r1", "pull")
    reading(rx, ld, 0.0)
    out = quiet(rx.handle(ReadDone("r1", TransferError("gone at post"), stale=True), 0.5))
    assert out == [Resolve(ld, refresh=True)]
    assert quiet(rx.handle(resolved(ld, since=0.6), 0.6)) == [PostRead("r1", AGENTS[P1], VIEW)]
    out = quiet(rx.handle(ReadDone("r1", TransferError("gone again"), stale=True), 0.7))
    assert one_failure(out, "r1").reason == "gone again"
    assert rx.counters["peer_rehandshakes"] == 1


def test_read_done_for_a_request_not_reading_is_our_bug() -> None:
    rx = make()
    with pytest.raises(LocalProtocolError):
        rx.handle(ReadDone("nobody"), 0.0)
    registered(rx, load("r1"), 0.0)
    with pytest.raises(LocalProtocolError):
        rx.handle(ReadDone("r1"), 0.1)
    assert rx.reqs["r1"].state is S.REGISTERED


def test_p_reports_the_push_failed() -> None:
    rx = make()
    registered(rx, load("r1"), 0.0, ranks=2)
    assert rx.handle(push_done("r1", 0), 0.1) == []
    out = quiet(rx.handle(push_done("r1", 1, ok=False, code=LEASE_EXPIRED), 0.2))
    rec = one_failure(out, "r1")
    assert (rec.code, rec.reason) == (LEASE_EXPIRED, "P says no")
    assert_empty(rx)


def test_p_refuses_the_pull() -> None:
    rx = make()
    acking(rx, load("r1", "pull"), 0.0)
    out = quiet(rx.handle(pull_ack("r1", ok=False, code=LEASE_EXPIRED), 0.1))
    rec = one_failure(out, "r1")
    assert (rec.code, rec.reason, rec.block_ids) == (LEASE_EXPIRED, "lease gone", (1, 2, 3))
    assert_empty(rx)


def test_pull_done_not_delivered_fails() -> None:
    rx = make()
    acking(rx, load("r1", "pull"), 0.0)
    out = quiet(rx.handle(SendFailed("r1", TransferError("notif failed")), 0.1))
    assert one_failure(out, "r1").code == TRANSFER
    assert_empty(rx)


def test_peer_lost_fails_what_waits_on_it_and_spares_reads_in_flight() -> None:
    rx = make()
    registered(rx, load("reg", p_id="p-reg"), 0.0)
    acking(rx, load("ack", "pull"), 0.0)
    reading(rx, load("read", "pull"), 0.0)
    rx.handle(load("registering"), 0.0)
    rx.handle(resolved(load("registering")), 0.0)
    registered(rx, load("other", peer=P2), 0.0)
    out = quiet(rx.handle(PeerLost(AGENTS[P1], "disconnected"), 1.0))
    failed = {r.request_id: r for r in records(out)}
    assert set(failed) == {"ack"}
    assert all(isinstance(r, wire.RecvFailed) for r in failed.values())
    # the push is held, not failed: losing P is no proof that its WRITE cannot land;
    # the cancel goes again, and whether P is provably gone is asked
    assert [e for e in out if isinstance(e, (Notify, SendFor, CancelAt, CheckGone))] == [
        Notify(AGENTS[P1], cancel("p-reg")),
        CheckGone(P1, AGENTS[P1], ("p-reg",)),
    ]
    states = {rid: r.state for rid, r in rx.reqs.items()}
    assert states == {
        "reg": S.HOLDING,
        "read": S.READING,
        "registering": S.REGISTERING,
        "other": S.REGISTERED,
    }
    # P's word (its answer to the cancel, sent once its WRITE ended) ends it
    out = quiet(rx.handle(push_done("reg", ok=False, code=TRANSFER), 2.0))
    assert "lost" in one_failure(out, "reg").reason
    assert rx.counters["holds_released_by_p"] == 1


def test_peer_lost_about_an_older_view_spares_requests_on_the_newer() -> None:
    rx = make()
    registered(rx, load("old"), 1.0)
    rx.reqs["old"].since = 1.0
    ld = load("new")
    rx.handle(ld, 5.0)
    rx.handle(resolved(ld, since=5.0), 5.0)
    rx.handle(Sent("new"), 5.0)
    out = rx.handle(PeerLost(AGENTS[P1], "restarted", since=1.0), 6.0)
    assert records(out) == []
    assert rx.reqs["old"].state is S.HOLDING
    assert rx.reqs["new"].state is S.REGISTERED


def test_registration_watchdog_withdraws_the_registration() -> None:
    rx = make()
    registered(rx, load("r1", p_id="p-1"), 3.0)
    due = 3.0 + REG_TIMEOUT
    assert rx.watchdogs.get("r1") == due
    assert not records(rx.handle_timer(due - 0.01))
    out = quiet(rx.handle_timer(due))
    # P must not WRITE later, and its WRITE may be in flight: the event is held
    assert out == [Notify(AGENTS[P1], cancel("p-1")), CheckGone(P1, AGENTS[P1], ("p-1",))]
    assert rx.reqs["r1"].state is S.HOLDING
    assert rx.watchdogs.get("r1") == due + rx.hold_bound
    assert len(rx.heartbeats) == 0  # P's lease lapses
    # P's WRITE did land after all (its PushDone rides it): the bytes are there
    assert rx.handle_timer(due + 1.0) == []
    assert quiet(rx.handle(push_done("r1"), due + 1.0)) == [finished("r1")]
    assert rx.counters["holds_released_by_p"] == 1
    assert_empty(rx)
    # another answer after the end: counted, never reported
    assert rx.handle(push_done("r1"), due + 2) == []
    assert rx.counters["late_answers"] == 1


def test_a_held_push_asks_again_until_p_answers_by_its_own_id() -> None:
    """A cut link: the first check proves nothing. P is asked again every probe interval
    (the cancel goes once more when it answers as itself); P, which no longer knows the
    request's registration, answers by the id the cancel named: that releases it."""
    rx = make()
    registered(rx, load("r1", p_id="p-1"), 0.0)
    registered(rx, load("r2", p_id="p-2"), 0.0)
    rx.handle(PeerLost(AGENTS[P1], "link down"), 1.0)
    assert rx.next_deadline() == 1.0 + PROBE
    out = quiet(rx.handle_timer(1.0 + PROBE))
    assert out == [CheckGone(P1, AGENTS[P1], ("p-1", "p-2"))]
    out = rx.handle(push_done("p-1", ok=False, code=LEASE_EXPIRED), 3.5)
    assert one_failure(out, "r1").code == TRANSFER  # the hold's reason, not P's
    assert quiet(rx.handle_timer(1.0 + 2 * PROBE)) == [CheckGone(P1, AGENTS[P1], ("p-2",))]
    rx.handle(push_done("r2", ok=False), 5.5)
    assert rx.handle_timer(1.0 + 3 * PROBE) == []  # nothing held: no more checks
    assert_empty(rx)
    # P's id of an ended request is remembered too: a late answer, not a forged one
    assert rx.handle(push_done("p-1", ok=False), 9.0) == []
    assert rx.counters["late_answers"] == 1


def test_hold_bound_ends_a_held_push_that_p_never_answers() -> None:
    rx = make()
    registered(rx, load("r1"), 0.0)
    rx.handle_timer(REG_TIMEOUT)
    end = REG_TIMEOUT + rx.hold_bound
    assert records(rx.handle_timer(end - 0.01)) == []
    assert rx.reqs["r1"].state is S.HOLDING
    assert rx.by_state()["holding"] == 1
    out = rx.handle_timer(end)
    rec = one_failure(out, "r1")
    assert rec.code == TIMEOUT and rec.block_ids == (1, 2, 3)
    assert any(isinstance(e, Log) and e.event == "recv_hold_expired" for e in out)
    assert rx.counters["holds_expired"] == 1
    assert_empty(rx)


def test_a_held_push_waits_for_the_write_bound_ps_handshake_said() -> None:
    """P's settings are P's: its handshake says how long a WRITE of its may still land
    (`write_bound`), and a push held on it waits that long, not our own bound (capped at
    an hour); a P that said nothing gets our own."""
    for said, want in ((20.0, 20.0), (1e9, MAX_WRITE_BOUND), (0.0, None)):
        rx = make()
        ld = load("r1")
        rx.handle(ld, 0.0)
        ev = resolved(ld)
        rx.handle(PeerResolved(**{**_fields(ev), "write_bound": said}), 0.0)
        rx.handle(Sent("r1"), 0.0)
        rx.handle_timer(REG_TIMEOUT)
        bound = want if want is not None else rx.hold_bound
        assert rx.watchdogs.get("r1") == REG_TIMEOUT + bound
        assert records(rx.handle_timer(REG_TIMEOUT + bound - 0.01)) == []
        rec = one_failure(rx.handle_timer(REG_TIMEOUT + bound), "r1")
        assert rec.code == TIMEOUT


def _fields(ev: PeerResolved) -> dict[str, object]:
    return {f: getattr(ev, f) for f in PeerResolved.__dataclass_fields__}


def test_hold_bound_covers_ps_lease_post_fence_and_settle_bound() -> None:
    assert push_hold_bound(6.0, 15.0, 15.0) == 6.0 + 2 * 15.0 + 2 * 15.0 + 2.0
    assert make().hold_bound == push_hold_bound(LEASE, XFER_TIMEOUT, XFER_TIMEOUT)
    rx = Receiver(
        lease_duration=LEASE,
        probe_interval=PROBE,
        push_registration_timeout=REG_TIMEOUT,
        transfer_timeout=XFER_TIMEOUT,
        hold_bound=3.0,
    )
    assert rx.hold_bound == 3.0


def test_p_proven_gone_ends_what_waits_on_it_at_once() -> None:
    rx = make()
    registered(rx, load("held", p_id="p-h"), 0.0)
    rx.handle(PeerLost(AGENTS[P1], "disconnected"), 1.0)
    # another loss of the same P is no news: still held
    assert records(rx.handle(PeerLost(AGENTS[P1], "again"), 1.5)) == []
    assert rx.reqs["held"].state is S.HOLDING
    registered(rx, load("reg"), 1.5)
    registered(rx, load("other", peer=P2), 1.5)
    out = quiet(rx.handle(PeerGone(AGENTS[P1], "side channel refused"), 2.0))
    assert {r.request_id for r in records(out)} == {"held", "reg"}
    assert rx.counters["holds_released_gone"] == 1
    assert set(rx.reqs) == {"other"}
    assert rx.handle(PeerGone(AGENTS[P1], "again"), 3.0) == []


def test_unsettled_read_holds_until_it_settles() -> None:
    rx = make()
    reading(rx, load("r1", "pull", p_id="p-1"), 0.0)
    out = quiet(rx.handle(ReadDone("r1", Timeout("unsettled"), unsettled=True), 5.0))
    assert records(out) == []
    assert out == [Notify(AGENTS[P1], cancel("p-1"))]  # P frees; no probe for a READ
    assert rx.reqs["r1"].state is S.HOLDING
    assert rx.handle(PeerGone(AGENTS[P1], "gone"), 6.0) == []  # our own READ: settles
    assert rx.handle(ReadSettled("other"), 6.0) == []
    out = rx.handle(ReadSettled("r1"), 7.0)
    assert one_failure(out, "r1").code == TIMEOUT
    assert rx.counters["holds_released_settled"] == 1
    assert_empty(rx)


def test_unsettled_read_that_never_settles_ends_at_the_bound() -> None:
    rx = make()
    reading(rx, load("r1", "pull"), 0.0)
    rx.handle(AbortRecv("r1", "s1"), 1.0)
    rx.handle(ReadDone("r1", Timeout("unsettled"), unsettled=True), 5.0)
    assert rx.reqs["r1"].state is S.HOLDING
    out = rx.handle_timer(5.0 + rx.hold_bound)
    assert one_failure(out, "r1").reason.startswith("aborted")
    assert rx.counters["holds_expired"] == 1
    assert_empty(rx)


def test_ack_watchdog() -> None:
    rx = make()
    acking(rx, load("r1", "pull"), 2.0)
    assert not records(rx.handle_timer(2.0 + XFER_TIMEOUT - 0.5))
    out = quiet(rx.handle_timer(2.0 + XFER_TIMEOUT))
    assert one_failure(out, "r1").code == TIMEOUT
    assert len(out) == 1
    assert_empty(rx)


# ------------------------------------------------------------------ giving up on a peer


def test_give_up_after_a_whole_lease_without_an_answer() -> None:
    rx = make()
    rx.handle(track("r1"), 0.0)
    rx.handle(track("r2", peer=P2), 0.0)
    err = TransferError("connection refused")
    out = rx.handle(PeerUnreachable(P1, err, refused=False), 1.0)
    assert [e.event for e in out if isinstance(e, Log)] == ["peer_unreachable"]
    assert rx.handle(PeerUnreachable(P1, err, refused=False), 1.0 + LEASE - 0.01) == []
    assert "r1" in rx.reqs
    out = rx.handle(PeerUnreachable(P1, err, refused=False), 1.0 + LEASE)
    # only tracked: dropped without an event (none was announced), and without a cancel
    assert quiet(out) == []
    assert set(rx.reqs) == {"r2"}
    assert rx.counters["peers_given_up"] == 1
    # nothing beats or probes P1 any more; P2 goes on
    later = rx.handle_timer(100.0)
    assert later == [Beat(P2, ("r2",)), ProbePeer(P2)]


def test_refused_handshake_gives_up_at_once() -> None:
    rx = make()
    rx.handle(track("r1"), 0.0)
    rx.handle(PeerUnreachable(P1, Incompatible("other secret"), refused=True), 0.5)
    assert_empty(rx)


def test_an_answer_ends_the_failure_streak() -> None:
    rx = make()
    rx.handle(track("r1"), 0.0)
    err = TransferError("timeout")
    rx.handle(PeerUnreachable(P1, err, refused=False), 1.0)
    rx.handle(PeerReached(P1), 2.0)
    rx.handle(PeerUnreachable(P1, err, refused=False), 3.0)
    rx.handle(PeerUnreachable(P1, err, refused=False), 1.0 + LEASE)
    assert "r1" in rx.reqs  # failing since 3.0 only
    rx.handle(PeerUnreachable(P1, err, refused=False), 3.0 + LEASE)
    assert "r1" not in rx.reqs


def test_give_up_spares_requests_past_tracking() -> None:
    rx = make()
    rx.handle(track("t"), 0.0)
    registered(rx, load("reg"), 0.0)
    rx.handle(PeerUnreachable(P1, Incompatible("refused"), refused=True), 0.5)
    assert set(rx.reqs) == {"reg"}  # its watchdog or P's answer ends it
    beats = [e for e in rx.handle_timer(HB) if not isinstance(e, SendFor)]  # (a repeat)
    assert beats == [Beat(P1, ("reg",))]


def test_idle_peer_forgets_its_failure_streak() -> None:
    """A failed beat long ago, then nothing outstanding at that peer for a while: a new
    request's first failed beat must not count as a whole lease of failures."""
    rx = make()
    rx.handle(track("old"), 0.0)
    err = TransferError("connection refused")
    rx.handle(PeerUnreachable(P1, err, refused=False), 0.1)
    rx.handle(AbortRecv("old", "s1"), 0.2)
    rx.handle(track("new"), 1000.0)
    assert rx.handle_timer(1000.0) == [Beat(P1, ("new",))]
    out = rx.handle(PeerUnreachable(P1, err, refused=False), 1000.1)
    assert "new" in rx.reqs
    assert [e.event for e in out if isinstance(e, Log)] == ["peer_unreachable"]
    rx.handle(PeerUnreachable(P1, err, refused=False), 1000.1 + LEASE)
    assert "new" not in rx.reqs


def test_late_failure_for_ended_requests_is_not_held_against_the_peer() -> None:
    rx = make()
    rx.handle(track("old"), 0.0)
    rx.handle_timer(0.0)  # the beat goes out...
    rx.handle(AbortRecv("old", "s1"), 0.1)  # ...the request ends before it answers...
    err = TransferError("connection refused")
    assert quiet(rx.handle(PeerUnreachable(P1, err, refused=False), 0.2)) == []  # ...failed
    assert rx.failing_since == {}
    rx.handle(track("new"), 500.0)
    rx.handle(PeerUnreachable(P1, err, refused=False), 500.1)
    assert "new" in rx.reqs


def test_a_request_after_giving_up_fails_through_its_handshake() -> None:
    rx = make()
    rx.handle(track("r1"), 0.0)
    rx.handle(PeerUnreachable(P1, Incompatible("refused"), refused=True), 0.5)
    assert "r1" not in rx.reqs
    ld = load("r1", blocks=(7, 8))
    assert quiet(rx.handle(ld, 1.0)) == [Resolve(ld, refresh=False)]
    out = rx.handle(PeerUnresolved("r1", Incompatible("refused")), 1.1)
    rec = one_failure(out, "r1")
    assert (rec.code, rec.block_ids) == (INCOMPATIBLE, (7, 8))


# ------------------------------------------------------------------ aborts


def test_abort_tracked_cancels_at_p_without_an_event() -> None:
    rx = make()
    rx.handle(track("r1", hb_id="p-1"), 0.0)
    assert quiet(rx.handle(AbortRecv("r1", "s1"), 0.1)) == [CancelAt(P1, "p-1")]
    assert_empty(rx)
    assert rx.handle(AbortRecv("r1", "s1"), 0.2) == []


def test_abort_registered_cancels_and_waits_for_ps_last_word() -> None:
    rx = make()
    registered(rx, load("r1", p_id="p-1"), 0.0, ranks=2)
    out = quiet(rx.handle(AbortRecv("r1", "s1"), 1.0))
    assert out == [SendFor("r1", AGENTS[P1], cancel("p-1"))]
    assert rx.reqs["r1"].state is S.CANCELLING
    assert rx.watchdogs.get("r1") == 1.0 + CANCEL_BOUND
    assert rx.handle(Sent("r1"), 1.1) == []
    assert rx.reqs["r1"].state is S.CANCELLING
    out = quiet(rx.handle(push_done("r1", 0, ok=False, code=TRANSFER), 1.2))
    rec = one_failure(out, "r1")
    assert rec.reason.startswith("aborted")
    assert_empty(rx)


def test_abort_after_ps_write_ran_still_ends_failed() -> None:
    rx = make()
    registered(rx, load("r1"), 0.0)
    rx.handle(AbortRecv("r1", "s1"), 1.0)
    out = rx.handle(push_done("r1"), 1.1)  # P's WRITE had already run
    rec = one_failure(out, "r1")
    assert rec.reason.startswith("aborted")
    assert rx.counters.get("recv_ok", 0) == 0


def test_cancel_bound_never_extends_the_registration_watchdog() -> None:
    rx = make()
    registered(rx, load("r1"), 0.0)
    rx.handle(AbortRecv("r1", "s1"), REG_TIMEOUT - 1.0)
    assert rx.watchdogs.get("r1") == REG_TIMEOUT
    assert records(rx.handle_timer(REG_TIMEOUT)) == []  # held: P's WRITE may be in flight
    out = rx.handle_timer(REG_TIMEOUT + rx.hold_bound)
    assert "did not answer the cancel" in one_failure(out, "r1").reason


def test_cancel_not_delivered_ends_the_request() -> None:
    rx = make()
    registered(rx, load("r1"), 0.0)
    rx.handle(AbortRecv("r1", "s1"), 1.0)
    out = rx.handle(SendFailed("r1", TransferError("peer gone"), stale=True), 1.1)
    assert records(out) == []  # P may be alive behind a cut link: held
    assert rx.reqs["r1"].state is S.HOLDING
    out = rx.handle(PeerGone(AGENTS[P1], "another incarnation answers"), 1.2)
    assert "cancel not delivered" in one_failure(out, "r1").reason
    assert_empty(rx)


def test_abort_while_handshaking_push_cancels_once_p_is_known() -> None:
    rx = make()
    ld = load("r1", p_id="p-1")
    rx.handle(ld, 0.0)
    assert quiet(rx.handle(AbortRecv("r1", "s1"), 0.1)) == []  # nothing to cancel yet
    out = quiet(rx.handle(resolved(ld), 0.2))
    assert out[0] == Notify(AGENTS[P1], cancel("p-1"))
    assert one_failure(out, "r1").reason.startswith("aborted")
    assert not any(isinstance(e, SendFor) for e in out)  # never registered
    assert_empty(rx)


def test_abort_while_handshaking_then_unresolved_reports_the_abort() -> None:
    rx = make()
    rx.handle(load("r1"), 0.0)
    rx.handle(AbortRecv("r1", "s1"), 0.1)
    out = rx.handle(PeerUnresolved("r1", Incompatible("other model")), 0.2)
    assert one_failure(out, "r1").reason.startswith("aborted")


def test_abort_while_handshaking_pull_tells_p_without_reading() -> None:
    rx = make()
    ld = load("r1", "pull")
    rx.handle(ld, 0.0)
    rx.handle(AbortRecv("r1", "s1"), 0.1)
    out = quiet(rx.handle(resolved(ld), 0.2))
    assert out == [SendFor("r1", AGENTS[P1], first_of(ld))]  # P frees the blocks now
    assert rx.reqs["r1"].state is S.ACKING
    out = rx.handle(pull_ack("r1"), 0.3)
    assert one_failure(out, "r1").reason.startswith("aborted")


def test_abort_while_registering_cancels_once_sent() -> None:
    rx = make()
    ld = load("r1", p_id="p-1")
    rx.handle(ld, 0.0)
    rx.handle(resolved(ld), 0.0)
    assert quiet(rx.handle(AbortRecv("r1", "s1"), 0.1)) == []
    out = quiet(rx.handle(Sent("r1"), 0.2))
    assert out == [SendFor("r1", AGENTS[P1], cancel("p-1"))]
    assert rx.reqs["r1"].state is S.CANCELLING
    assert rx.watchdogs.get("r1") == 0.2 + CANCEL_BOUND


def test_abort_while_registering_with_a_stale_view_does_not_rehandshake() -> None:
    rx = make()
    ld = load("r1")
    rx.handle(ld, 0.0)
    rx.handle(resolved(ld), 0.0)
    rx.handle(AbortRecv("r1", "s1"), 0.1)
    out = quiet(rx.handle(SendFailed("r1", TransferError("gone"), stale=True), 0.2))
    assert not any(isinstance(e, Resolve) for e in out)
    assert one_failure(out, "r1").reason.startswith("aborted")


def test_abort_while_reading_waits_for_the_read() -> None:
    rx = make()
    ld = load("r1", "pull")
    reading(rx, ld, 0.0)
    assert quiet(rx.handle(AbortRecv("r1", "s1"), 0.1)) == []
    assert rx.reqs["r1"].state is S.READING  # the READ still writes into our blocks
    assert quiet(rx.handle(ReadDone("r1"), 0.2)) == [SendFor("r1", AGENTS[P1], first_of(ld))]
    out = rx.handle(pull_ack("r1"), 0.3)
    assert one_failure(out, "r1").reason.startswith("aborted")


def test_abort_while_reading_then_read_failed() -> None:
    rx = make()
    reading(rx, load("r1", "pull"), 0.0)
    rx.handle(AbortRecv("r1", "s1"), 0.1)
    out = rx.handle(ReadDone("r1", TransferError("x"), stale=True), 0.2)
    assert one_failure(out, "r1").reason.startswith("aborted")  # no rehandshake


def test_abort_by_another_session_or_for_nothing_is_ignored() -> None:
    rx = make()
    registered(rx, load("r1"), 0.0)
    assert rx.handle(AbortRecv("r1", "s2"), 0.1) == []
    assert rx.handle(AbortRecv("nobody", "s1"), 0.1) == []
    assert rx.reqs["r1"].state is S.REGISTERED and not rx.reqs["r1"].aborted
    rx.handle(AbortRecv("r1", "s1"), 0.2)
    assert rx.handle(AbortRecv("r1", "s1"), 0.3) == []  # once
    assert rx.counters["aborted"] == 1


# ------------------------------------------------------------------ sessions


def test_end_session_ends_everything_it_owns_then_answers() -> None:
    rx = make()
    rx.handle(track("t", hb_id="p-t"), 0.0)
    registered(rx, load("reg", p_id="p-reg"), 0.0)
    reading(rx, load("read", "pull"), 0.0)
    registered(rx, load("theirs", session="s2"), 0.0)

    out = quiet(rx.handle(EndSession("s1"), 1.0))
    assert Counter(out) == Counter(
        [CancelAt(P1, "p-t"), SendFor("reg", AGENTS[P1], cancel("p-reg"))]
    )
    assert not records(out)
    assert set(rx.reqs) == {"reg", "read", "theirs"}

    out = quiet(rx.handle(push_done("reg", ok=False, code=TRANSFER), 1.1))
    assert one_failure(out, "reg") and not any(isinstance(e, SessionEnded) for e in out)
    rx.handle(ReadDone("read"), 1.2)  # PullDone goes to P: it frees its blocks
    out = quiet(rx.handle(pull_ack("read"), 1.3))
    assert one_failure(out, "read").reason.startswith("aborted")
    assert out[-1] == SessionEnded("s1")
    assert [e for e in out if isinstance(e, SessionEnded)] == [SessionEnded("s1")]
    assert set(rx.reqs) == {"theirs"} and rx.reqs["theirs"].state is S.REGISTERED
    assert rx.closing == set()


def test_end_session_without_requests_answers_at_once() -> None:
    rx = make()
    registered(rx, load("theirs", session="s2"), 0.0)
    assert rx.handle(EndSession("s1"), 0.0) == [SessionEnded("s1")]
    out = quiet(rx.handle(EndSession("s3"), 0.0))
    assert out == [SessionEnded("s3")]


def test_end_session_with_only_tracked_requests_answers_at_once() -> None:
    rx = make()
    rx.handle(track("a"), 0.0)
    rx.handle(track("b", peer=P2), 0.0)
    out = quiet(rx.handle(EndSession("s1"), 0.1))
    assert out == [CancelAt(P1, "a"), CancelAt(P2, "b"), SessionEnded("s1")]
    assert_empty(rx)


# ------------------------------------------------------------------ races and stale answers


def test_push_done_overtakes_the_registration_sent() -> None:
    rx = make()
    ld = load("r1")
    rx.handle(ld, 0.0)
    rx.handle(resolved(ld, ranks=2), 0.0)
    assert rx.reqs["r1"].state is S.REGISTERING
    assert rx.handle(push_done("r1", 0), 0.1) == []
    assert rx.reqs["r1"].state is S.REGISTERING
    assert quiet(rx.handle(push_done("r1", 1), 0.2)) == [finished("r1")]
    assert rx.handle(Sent("r1"), 0.3) == []  # our own word, late: no watchdog, no revival
    assert_empty(rx)


def test_partial_push_done_then_sent_keeps_the_ranks() -> None:
    rx = make()
    ld = load("r1")
    rx.handle(ld, 0.0)
    rx.handle(resolved(ld, ranks=2), 0.0)
    rx.handle(push_done("r1", 1), 0.1)
    rx.handle(Sent("r1"), 0.2)
    assert rx.reqs["r1"].state is S.REGISTERED
    assert quiet(rx.handle(push_done("r1", 0), 0.3)) == [finished("r1")]


def test_push_done_overtaking_after_an_abort_still_fails() -> None:
    rx = make()
    ld = load("r1")
    rx.handle(ld, 0.0)
    rx.handle(resolved(ld), 0.0)
    rx.handle(AbortRecv("r1", "s1"), 0.05)
    out = rx.handle(push_done("r1"), 0.1)
    assert one_failure(out, "r1").reason.startswith("aborted")


def test_answers_for_ended_requests_are_counted_never_reported() -> None:
    rx = make()
    registered(rx, load("push"), 0.0)
    rx.handle(push_done("push"), 0.1)
    acking(rx, load("pull", "pull"), 0.0)
    rx.handle(pull_ack("pull"), 0.1)
    for ev in (push_done("push"), push_done("push", ok=False), pull_ack("pull")):
        assert rx.handle(ev, 0.2) == []  # not even a warning: they simply came late
    assert rx.counters["late_answers"] == 3
    assert rx.counters.get("notifs_rejected", 0) == 0


def test_answers_for_unknown_requests_are_rejected() -> None:
    rx = make()
    for ev in (push_done("ghost"), pull_ack("ghost")):
        out = rx.handle(ev, 0.0)
        assert not records(out)
        assert [e.event for e in out if isinstance(e, Log)] == ["notif_rejected"]
    assert rx.counters["notifs_rejected"] == 2


def test_answers_from_another_agent_or_in_the_wrong_state_are_rejected() -> None:
    rx = make()
    registered(rx, load("push"), 0.0)
    reading(rx, load("pull", "pull"), 0.0)
    rx.handle(load("hs"), 0.0)
    rx.handle(track("tracked"), 0.0)
    events: list[Event] = [
        push_done("push", agent="agent-p2"),  # not the P it registered at
        push_done("push", rank=1),  # P has one rank only
        pull_ack("pull"),  # not acking yet
        push_done("pull"),  # a pull
        pull_ack("push"),  # a push
        push_done("hs"),  # nothing registered yet
        push_done("tracked"),
    ]
    for ev in events:
        out = rx.handle(ev, 0.1)
        assert not records(out)
    assert rx.counters["notifs_rejected"] == len(events)
    states = {rid: r.state for rid, r in rx.reqs.items()}
    assert states == {
        "push": S.REGISTERED,
        "pull": S.READING,
        "hs": S.HANDSHAKING,
        "tracked": S.TRACKED,
    }
    assert rx.reqs["push"].done_ranks == set()


def test_push_done_while_handshaking_afresh_is_rejected() -> None:
    rx = make()
    ld = load("r1")
    rx.handle(ld, 0.0)
    rx.handle(resolved(ld), 0.0)
    rx.handle(SendFailed("r1", TransferError("stale"), stale=True), 0.1)
    out = rx.handle(push_done("r1"), 0.2)
    assert not records(out)
    assert rx.reqs["r1"].state is S.HANDSHAKING


def test_resync_is_answered() -> None:
    rx = make()
    assert rx.handle(ResyncArrived("agent-p1", 42), 0.0) == [Notify("agent-p1", wire.ResyncAck(42))]


# ------------------------------------------------------------------ the engine's requests


def test_load_refused_when_receiving_or_another_session_tracks_it() -> None:
    rx = make()
    rx.handle(track("t"), 0.0)
    with pytest.raises(InvalidRequest, match="another session"):
        rx.handle(load("t", session="s2"), 0.1)
    assert rx.reqs["t"].state is S.TRACKED and rx.reqs["t"].session == "s1"
    registered(rx, load("r"), 0.0)
    with pytest.raises(InvalidRequest, match="already receiving"):
        rx.handle(load("r", "pull"), 0.2)
    assert rx.reqs["r"].state is S.REGISTERED and rx.reqs["r"].mode == "push"


def test_track_twice_changes_nothing() -> None:
    rx = make()
    rx.handle(track("r1"), 0.0)
    assert rx.handle(track("r1", peer=P2, session="s2"), 5.0) == []
    req = rx.reqs["r1"]
    assert (req.peer, req.session, req.started) == (P1, "s1", 0.0)


def test_load_moves_a_track_to_the_peer_it_names() -> None:
    rx = make()
    rx.handle(track("r1"), 0.0)
    assert rx.handle_timer(0.0) == [Beat(P1, ("r1",))]
    ld = load("r1", peer=P2, p_id="p-1")
    rx.handle(ld, 0.5)
    assert rx.heartbeats.peers() == [P2]
    assert P1 not in rx.probes
    assert rx.handle_timer(0.5) == [Beat(P2, ("p-1",))]


# ------------------------------------------------------------------ heartbeats and time


def test_heartbeats_are_batched_per_peer_and_stop_with_the_last_request() -> None:
    rx = make()
    rx.handle(track("a"), 0.0)
    rx.handle(track("b", hb_id="p-b"), 0.0)
    rx.handle(track("c", peer=P2), 0.0)
    assert rx.handle_timer(0.0) == [Beat(P1, ("a", "p-b")), Beat(P2, ("c",))]
    rx.handle(AbortRecv("a", "s1"), 0.5)
    assert rx.handle_timer(HB) == [Beat(P1, ("p-b",)), Beat(P2, ("c",))]
    rx.handle(AbortRecv("b", "s1"), 1.5)
    assert rx.handle_timer(2 * HB) == [Beat(P2, ("c",)), ProbePeer(P2)]
    assert rx.heartbeats.peers() == [P2]
    rx.handle(AbortRecv("c", "s1"), 2.5)
    assert_empty(rx)
    assert rx.handle_timer(10.0) == []


def test_peers_lease_sets_its_heartbeat_period() -> None:
    rx = make()
    rx.handle(track("a"), 0.0)
    rx.handle(track("b", peer=P2), 0.0)
    rx.handle_timer(0.0)
    rx.handle(PeerKnown(P1, 1.2), 0.1)  # beats every 0.2 s from now on
    assert rx.next_deadline() == pytest.approx(0.3)
    assert rx.handle_timer(0.3) == [Beat(P1, ("a",))]
    assert rx.next_deadline() == pytest.approx(0.5)
    # a new request at that peer takes its period too
    rx.handle(AbortRecv("a", "s1"), 0.4)
    rx.handle(track("a2"), 0.4)
    rx.handle_timer(0.4)
    assert rx.next_deadline() == pytest.approx(0.6)


def test_a_large_heartbeat_batch_is_split() -> None:
    rx = make()
    n = MAX_HB_IDS + 5
    for i in range(n):
        rx.handle(track(f"r{i}"), 0.0)
    beats = rx.handle_timer(0.0)
    assert [len(b.hb_ids) for b in beats if isinstance(b, Beat)] == [MAX_HB_IDS, 5]
    assert {i for b in beats if isinstance(b, Beat) for i in b.hb_ids} == {
        f"r{i}" for i in range(n)
    }


def test_a_jump_in_time_sends_one_beat_per_peer_not_a_backlog() -> None:
    rx = make()
    rx.handle(track("a"), 0.0)
    rx.handle(track("b", peer=P2), 0.0)
    rx.handle_timer(0.0)
    out = rx.handle_timer(1000.0)
    assert out == [Beat(P1, ("a",)), Beat(P2, ("b",)), ProbePeer(P1), ProbePeer(P2)]
    assert rx.next_deadline() == 1000.0 + HB
    assert rx.handle_timer(1000.0) == []


def test_the_machine_takes_now_as_given_so_the_shell_passes_daemon_time() -> None:
    """The machine has no notion of a stall: a jump in `now` fires what is due (exactly
    once). A frozen daemon does not blame P because the shell feeds it daemon time
    (`StallClock`), which does not count the freeze."""
    rx = make()
    registered(rx, load("jumped"), 0.0)
    assert records(rx.handle_timer(1000.0)) == []  # held: P's WRITE may be in flight
    assert rx.handle_timer(1000.0) == []
    out = rx.handle_timer(1000.0 + rx.hold_bound)
    assert one_failure(out, "jumped").code == TIMEOUT
    assert rx.handle_timer(1000.0 + rx.hold_bound) == []

    rx = make()
    clock = StallClock(100.0, tick=0.1, max_gap=1.0)
    now = clock.observe(100.0)
    registered(rx, load("frozen"), now)
    rx.handle_timer(now)
    err = TransferError("timeout")
    rx.handle(PeerUnreachable(P1, err, refused=False), clock.observe(100.5))
    now = clock.observe(100.5 + 3600.0)  # SIGSTOPped for an hour
    assert clock.stall_count == 1
    assert now < 100.0 + REG_TIMEOUT
    out = rx.handle_timer(now)
    assert not records(out)
    assert rx.reqs["frozen"].state is S.REGISTERED
    # the next failed beat is not a whole lease of failures in daemon time
    rx.handle(PeerUnreachable(P1, err, refused=False), now)
    assert now - rx.failing_since[P1] == pytest.approx(0.1)
    assert quiet(rx.handle(push_done("frozen"), clock.observe(100.5 + 3600.1))) == [
        finished("frozen")
    ]


# ------------------------------------------------------------------ model-based

RIDS: Final = ("r0", "r1", "r2", "r3", "r4", "r5")
SESSIONS: Final = ("s0", "s1", "s2")
PEER_LIST: Final = (P1, P2)
AGENT_LIST: Final = (AGENTS[P1], AGENTS[P2])
_GOOD: Final = frozenset({S.REGISTERING, S.REGISTERED, S.CANCELLING, S.HOLDING})
HOLD: Final = push_hold_bound(LEASE, XFER_TIMEOUT, XFER_TIMEOUT)


class RecordingReceiver(Receiver):
    """The real machine, recording every move it makes."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.moves: list[tuple[str, RecvState, RecvState]] = []

    def _goto(self, req: RecvRequest, state: RecvState) -> None:
        self.moves.append((req.request_id, req.state, state))
        super()._goto(req, state)


@dataclass
class MReq:
    """The reference model's view of one request."""

    rid: str
    session: str
    peer: str
    hb_id: str
    phase: RecvState = S.TRACKED
    load: Load | None = None
    agent: str = ""
    since: float = 0.0
    ranks: int = 0
    done: set[int] = field(default_factory=set)
    aborted: bool = False
    refreshed: bool = False
    deadline: float | None = None
    layer_bits: dict[int, int] = field(default_factory=dict)
    held: int = 0
    """HOLDING: the code its failure will carry."""


ML: Final = 2
"""Layers of D's regions in the model (a layer-wise push must deliver each per rank)."""


@dataclass
class Op:
    """Work the machine asked for whose outcome is still to come."""

    kind: str  # "resolve", "send", "read" or "settle" (an Unsettled READ ending)
    rid: str
    load: Load | None = None
    record: wire.Record | None = None
    delivered: bool = False
    """P has acted on it already (its answer arrived): the send did go out."""


Norm = tuple[Any, ...] | Effect


def norm(eff: Effect) -> Norm:
    """Effects as the model predicts them (a failure's code, not its wording)."""
    if isinstance(eff, Emit):
        rec = eff.record
        if isinstance(rec, wire.RecvFinished):
            return ("finished", eff.session, eff.engine_id, rec.request_id)
        assert isinstance(rec, wire.RecvFailed), rec
        return ("failed", eff.session, eff.engine_id, rec.request_id, rec.code, rec.block_ids)
    return eff


class ReceiverModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.rx = RecordingReceiver(
            lease_duration=LEASE,
            probe_interval=PROBE,
            push_registration_timeout=REG_TIMEOUT,
            transfer_timeout=XFER_TIMEOUT,
        )
        self.now = 0.0
        self.live: dict[str, MReq] = {}
        self.seen: set[str] = set()
        self.closed: set[str] = set()  # sessions whose end was asked
        self.closing: set[str] = set()
        self.answered: Counter[str] = Counter()
        self.failing: dict[str, float] = {}
        self.ops: list[Op] = []
        self.expect: list[Norm] = []
        # independent of the reference's phases: what P and the engine really did
        self.loaded: set[str] = set()
        self.aborted: set[str] = set()
        self.mode: dict[str, str] = {}
        self.pull_blocks: dict[str, tuple[int, ...]] = {}
        self.by_write: dict[str, bool] = {}
        """Pulls P serves by WRITE (chosen at their first resolution, kept after: the
        model's peers do not move between machines)."""
        self.ranks: dict[str, int] = {}
        self.pushed_ok: dict[str, set[int]] = {}
        self.read_ok: set[str] = set()
        self.acked_ok: set[str] = set()
        self.emitted: Counter[str] = Counter()
        self.last_state: dict[str, RecvState] = {}
        self.last_expected_end: dict[str, RecvState] = {}
        self.ok = True

    # ------------------------------------------------------------ the reference

    def _written(self, rid: str) -> bool:
        """P WRITEs it: a push, or a pull P serves by WRITE (the push's rules, but for
        layers: P never streams a pull)."""
        return self.mode[rid] == "push" or self.by_write.get(rid, False)

    def _live_at(self, peer: str) -> list[MReq]:
        """Live requests heartbeated at `peer` (a held one is not: P's lease lapses)."""
        return [m for m in self.live.values() if m.peer == peer and m.phase is not S.HOLDING]

    def _end(self, m: MReq, state: RecvState) -> None:
        del self.live[m.rid]
        self.last_expected_end[m.rid] = state
        if not self._live_at(m.peer):
            self.failing.pop(m.peer, None)
        s = m.session
        if s in self.closing and not any(x.session == s for x in self.live.values()):
            self.closing.discard(s)
            self.expect.append(SessionEnded(s))

    def _fail(self, m: MReq, code: int) -> None:
        if m.agent and m.phase in (S.HANDSHAKING, S.READING):
            self.expect.append(Notify(m.agent, wire.CancelRegistration(m.hb_id)))
        self.expect.append(("failed", m.session, ENGINE, m.rid, code, self._blocks(m)))
        self._end(m, S.FAILED)

    def _hold(self, m: MReq, code: int) -> None:
        m.phase, m.held = S.HOLDING, code
        m.deadline = self.now + HOLD
        self.expect.append(Notify(m.agent, wire.CancelRegistration(m.hb_id)))
        # (a push's CheckGone, now and every probe interval: `_check_rechecks`)
        if not self._live_at(m.peer):
            self.failing.pop(m.peer, None)

    def _finish(self, m: MReq) -> None:
        if m.aborted:
            self._fail(m, TRANSFER)
        else:
            self.expect.append(("finished", m.session, ENGINE, m.rid))
            self._end(m, S.FINISHED)

    @staticmethod
    def _blocks(m: MReq) -> tuple[int, ...]:
        return m.load.block_ids if m.load is not None else ()

    def _abort(self, m: MReq) -> None:
        if m.aborted:
            return
        m.aborted = True
        if m.phase is S.TRACKED:
            self.expect.append(CancelAt(m.peer, m.hb_id))
            self._end(m, S.DROPPED)
        else:
            self.aborted.add(m.rid)
            if m.phase is S.REGISTERED:
                self._cancel(m)
            elif m.phase is S.HOLDING:
                m.held = TRANSFER

    def _cancel(self, m: MReq) -> None:
        m.phase = S.CANCELLING
        self.expect.append(SendFor(m.rid, m.agent, wire.CancelRegistration(m.hb_id)))
        m.deadline = min(m.deadline or math.inf, self.now + CANCEL_BOUND)

    def _ack(self, m: MReq) -> None:
        assert m.load is not None
        m.phase = S.ACKING
        self.expect.append(SendFor(m.rid, m.agent, first_of(m.load)))
        m.deadline = self.now + XFER_TIMEOUT

    def _rehandshake(self, m: MReq) -> None:
        assert m.load is not None
        m.refreshed = True
        m.deadline = None
        m.phase = S.HANDSHAKING
        self.expect.append(Resolve(m.load, refresh=True))

    def _timers(self) -> None:
        for m in sorted(self.live.values(), key=lambda x: x.deadline or math.inf):
            if m.deadline is None or m.deadline > self.now:
                continue
            if m.phase is S.REGISTERED:
                self._hold(m, TIMEOUT)
            elif m.phase is S.ACKING:
                self._fail(m, TIMEOUT)
            elif m.phase is S.HOLDING:
                self._fail(m, m.held)
            else:
                assert m.phase is S.CANCELLING
                self._hold(m, TRANSFER)

    # ------------------------------------------------------------ driving the machine

    def _run(self, event: Event | None) -> None:
        """Feed `event` (if any) then the timers at the current time, as the actor's loop
        does, and check the machine against the model."""
        self.ok = False
        self.rx.moves.clear()
        out: list[Effect] = []
        if event is not None:
            out += self.rx.handle(event, self.now)
        timer = self.rx.handle_timer(self.now)
        self._timers()
        expected, self.expect = self.expect, []

        repeats = [e for e in timer if isinstance(e, SendFor)]  # only a repeat is timed
        got = [
            norm(e)
            for e in out + timer
            if not isinstance(e, (Log, Beat, ProbePeer, CheckGone)) and e not in repeats
        ]
        self._check_repeats(repeats)
        self._check_rechecks(out + timer)
        holding = {r for r, q in self.rx.reqs.items() if q.state is S.HOLDING}
        assert {m.rid for m in self.live.values() if m.phase is S.HOLDING} == holding
        assert Counter(got) == Counter(expected), (event, got, expected)
        self._check_moves()
        self._check_emits(out + timer)
        self._check_beats(timer)
        for eff in out + timer:
            if isinstance(eff, SessionEnded):
                self.answered[eff.session] += 1
            elif isinstance(eff, Resolve):
                self.ops.append(Op("resolve", eff.load.request_id, load=eff.load))
            elif isinstance(eff, SendFor):
                self.ops.append(Op("send", eff.request_id, record=eff.record))
            elif isinstance(eff, PostRead):
                # a READ is only ever posted for a live request that is reading
                assert self.rx.reqs[eff.request_id].state is S.READING
                self.ops.append(Op("read", eff.request_id))
        self.ok = True

    def _check_moves(self) -> None:
        for rid, frm, to in self.rx.moves:
            assert to in TRANSITIONS.get(frm, frozenset()), (rid, frm, to)
            assert self.last_state.get(rid, S.TRACKED) is frm, (rid, frm, to)
            self.last_state[rid] = to
        for rid, m in self.live.items():
            req = self.rx.reqs[rid]
            # every change of state went through the table
            assert req.state is self.last_state.get(rid, S.TRACKED)
            assert req.state is m.phase, (rid, req.state, m.phase)
        assert set(self.rx.reqs) == set(self.live)
        for rid, state in self.last_expected_end.items():
            assert self.last_state.get(rid, S.TRACKED) is state, (rid, state)

    def _check_emits(self, effects: list[Effect]) -> None:
        for eff in effects:
            if not isinstance(eff, Emit):
                continue
            rec = eff.record
            assert isinstance(rec, (wire.RecvFinished, wire.RecvFailed))
            rid = rec.request_id
            self.emitted[rid] += 1
            assert self.emitted[rid] == 1, f"{rid} ended twice"
            assert rid in self.loaded, f"{rid} was only tracked, yet an event was emitted"
            if isinstance(rec, wire.RecvFinished):
                assert rid not in self.aborted, f"{rid} finished after an abort"
                if self._written(rid):
                    assert set(range(self.ranks[rid])) <= self.pushed_ok.get(rid, set())
                else:  # a pull of no blocks has nothing to READ: P's ack is all it needs
                    assert rid in self.acked_ok
                    assert rid in self.read_ok or not self.pull_blocks[rid]

    def _check_repeats(self, repeats: list[Effect]) -> None:
        """A registration is repeated only while P has said nothing of it: registered,
        no rank done and no layer delivered yet, to the P it went to."""
        for eff in repeats:
            assert isinstance(eff, SendFor)
            m = self.live.get(eff.request_id)
            assert m is not None and m.phase is S.REGISTERED, (eff, m)
            assert not m.done and not m.layer_bits and eff.agent == m.agent, (eff, m)
            assert isinstance(eff.record, wire.PushRegistration)
            assert eff.record.request_id == m.rid

    def _check_rechecks(self, effects: list[Effect]) -> None:
        """Whether P is gone is asked only about held pushes, naming exactly those at P."""
        for eff in effects:
            if isinstance(eff, CheckGone):
                held = {
                    m.hb_id
                    for m in self.live.values()
                    if m.phase is S.HOLDING
                    and self._written(m.rid)
                    and (m.peer, m.agent) == (eff.peer, eff.agent)
                }
                assert set(eff.hb_ids) <= held and eff.hb_ids, (eff, held)

    def _check_beats(self, timer: list[Effect]) -> None:
        beaten = [e.peer for e in timer if isinstance(e, Beat)]
        assert len(beaten) == len(set(beaten)), "one batch per peer"
        for eff in timer:
            if isinstance(eff, Beat):
                live = self._live_at(eff.peer)
                assert live, f"beat to {eff.peer} with nothing outstanding"
                assert sorted(eff.hb_ids) == sorted(m.hb_id for m in live)
            elif isinstance(eff, ProbePeer):
                assert self._live_at(eff.peer), f"probe of {eff.peer} with nothing outstanding"

    @invariant()
    def structure(self) -> None:
        rx = self.rx
        recount = Counter(r.state.value for r in rx.reqs.values())
        assert rx.by_state() == {s.value: recount[s.value] for s in S if s not in TERMINAL}
        beaten = {m.peer for m in self.live.values() if m.phase is not S.HOLDING}
        assert set(rx.heartbeats.peers()) == beaten
        assert set(rx.watchdogs) == {r for r, m in self.live.items() if m.deadline is not None}
        for rid, m in self.live.items():
            assert rx.watchdogs.get(rid) == m.deadline
        deadline = rx.next_deadline()
        if self.live:
            assert deadline is not None and deadline > self.now
        else:
            assert deadline is None
        assert set(rx.failing_since) <= {m.peer for m in self.live.values()}
        assert rx.closing == self.closing
        assert all(n == 1 for n in self.answered.values())

    # ------------------------------------------------------------ the engine

    def _usable(self, rid: str, session: str) -> bool:
        return session not in self.closed and (rid in self.live or rid not in self.seen)

    @rule(
        rid=st.sampled_from(RIDS),
        session=st.sampled_from(SESSIONS),
        peer=st.sampled_from(PEER_LIST),
        p_id=st.booleans(),
    )
    def track(self, rid: str, session: str, peer: str, p_id: bool) -> None:
        if not self._usable(rid, session):
            return
        if rid not in self.live:
            self.seen.add(rid)
            m = MReq(rid, session, peer, f"P-{rid}" if p_id else rid)
            self.live[rid] = m
        self._run(track(rid, session=session, peer=peer, hb_id=f"P-{rid}" if p_id else rid))

    @rule(
        rid=st.sampled_from(RIDS),
        session=st.sampled_from(SESSIONS),
        mode=st.sampled_from(("push", "pull")),
        peer=st.sampled_from(PEER_LIST),
        blocks=st.sampled_from(((), (1,), (2, 3))),
        p_id=st.booleans(),
    )
    def load(
        self, rid: str, session: str, mode: str, peer: str, blocks: tuple[int, ...], p_id: bool
    ) -> None:
        if not self._usable(rid, session):
            return
        if mode == "push" and not blocks:
            blocks = (9,)
        ld = load(
            rid, mode, session=session, blocks=blocks, peer=peer, p_id=f"P-{rid}" if p_id else ""
        )
        m = self.live.get(rid)
        if m is not None and (m.phase is not S.TRACKED or m.session != session):
            before = {r: (q.state, q.session, q.peer, q.hb_id) for r, q in self.rx.reqs.items()}
            with pytest.raises(InvalidRequest):
                self.rx.handle(ld, self.now)
            after = {r: (q.state, q.session, q.peer, q.hb_id) for r, q in self.rx.reqs.items()}
            assert after == before
            return
        if m is None:
            self.seen.add(rid)
            m = MReq(rid, session, peer, ld.hb_id)
            self.live[rid] = m
        elif m.peer != peer:
            old, m.peer = m.peer, peer
            if not self._live_at(old):
                self.failing.pop(old, None)
        m.hb_id, m.load, m.phase = ld.hb_id, ld, S.HANDSHAKING
        self.loaded.add(rid)
        self.mode[rid] = mode
        self.pull_blocks[rid] = ld.block_ids
        self.expect.append(Resolve(ld, refresh=False))
        self._run(ld)

    @rule(rid=st.sampled_from(RIDS), session=st.sampled_from(SESSIONS))
    def abort(self, rid: str, session: str) -> None:
        m = self.live.get(rid)
        if m is not None and m.session == session:
            self._abort(m)
        self._run(AbortRecv(rid, session))

    @rule(session=st.sampled_from(SESSIONS))
    def end_session(self, session: str) -> None:
        if session in self.closed:
            return
        self.closed.add(session)
        self.closing.add(session)
        for m in [m for m in self.live.values() if m.session == session]:
            self._abort(m)
        if session in self.closing and not any(m.session == session for m in self.live.values()):
            self.closing.discard(session)
            self.expect.append(SessionEnded(session))
        self._run(EndSession(session))

    # ------------------------------------------------------------ outcomes of our own work

    def _take(self, kind: str, i: int) -> Op | None:
        ops = [op for op in self.ops if op.kind == kind]
        if not ops:
            return None
        op = ops[i % len(ops)]
        self.ops.remove(op)
        return op

    @precondition(lambda self: any(op.kind == "resolve" for op in self.ops))
    @rule(
        i=st.integers(0, 7),
        ok=st.booleans(),
        ranks=st.integers(1, 2),
        reached=st.booleans(),
        by_write=st.booleans(),
    )
    def resolve_done(
        self, i: int, ok: bool, ranks: int, reached: bool, by_write: bool = False
    ) -> None:
        op = self._take("resolve", i)
        assert op is not None and op.load is not None
        ld, m = op.load, self.live.get(op.rid)
        agent = AGENTS[ld.peer]
        bw = ld.mode == "pull" and bool(ld.block_ids)
        bw = bw and self.by_write.setdefault(ld.request_id, by_write)
        first = first_of(ld, by_write=bw)
        event: Event
        if ok:
            event = PeerResolved(
                ld.request_id, agent, self.now, ranks, first, VIEW, layers=ML, by_write=bw
            )
            self.ranks[ld.request_id] = ranks
        else:
            event = PeerUnresolved(ld.request_id, Incompatible("refused"), agent if reached else "")
        if m is not None and m.phase is S.HANDSHAKING:
            if not ok:
                m.agent = agent if reached else ""
                self._fail(m, TRANSFER if m.aborted else INCOMPATIBLE)
            else:
                m.agent, m.since, m.ranks = agent, self.now, ranks
                if ld.mode == "push" or bw:
                    if m.aborted:
                        self._fail(m, TRANSFER)
                    else:
                        m.phase = S.REGISTERING
                        self.expect.append(SendFor(m.rid, agent, first))
                elif ld.block_ids and not m.aborted:
                    m.phase = S.READING
                    self.expect.append(PostRead(m.rid, agent, VIEW))
                else:
                    self._ack(m)
        self._run(event)

    @precondition(lambda self: any(op.kind == "send" for op in self.ops))
    @rule(i=st.integers(0, 7), ok=st.booleans(), stale=st.booleans())
    def send_done(self, i: int, ok: bool, stale: bool) -> None:
        op = self._take("send", i)
        assert op is not None
        ok = ok or op.delivered
        m = self.live.get(op.rid)
        event: Event = Sent(op.rid) if ok else SendFailed(op.rid, TransferError("x"), stale)
        if m is not None:
            if ok and m.phase is S.REGISTERING:
                m.phase = S.REGISTERED
                m.deadline = self.now + REG_TIMEOUT
                if m.aborted:
                    self._cancel(m)
            elif not ok and m.phase is S.REGISTERING:
                if stale and not m.refreshed and not m.aborted:
                    self._rehandshake(m)
                else:
                    self._fail(m, TRANSFER)
            elif not ok and m.phase is S.CANCELLING:
                self._hold(m, TRANSFER)  # P may be alive behind a cut link
            elif not ok and m.phase is S.ACKING:
                self._fail(m, TRANSFER)
        self._run(event)

    @precondition(lambda self: any(op.kind == "read" for op in self.ops))
    @rule(i=st.integers(0, 7), ok=st.booleans(), stale=st.booleans(), unsettled=st.booleans())
    def read_done(self, i: int, ok: bool, stale: bool, unsettled: bool = False) -> None:
        op = self._take("read", i)
        assert op is not None
        m = self.live[op.rid]  # a READ in flight keeps its request alive
        assert m.phase is S.READING
        event = ReadDone(op.rid, TransferError("x"), stale)
        if ok:
            self.read_ok.add(op.rid)
            self._ack(m)
            event = ReadDone(op.rid)
        elif unsettled:  # still in flight in UCX: it may write into our blocks
            self._hold(m, TRANSFER if m.aborted else TIMEOUT)
            self.ops.append(Op("settle", op.rid))
            event = ReadDone(op.rid, Timeout("unsettled"), stale, unsettled=True)
        elif stale and not m.refreshed and not m.aborted:
            self._rehandshake(m)
        else:
            self._fail(m, TRANSFER)
        self._run(event)

    @precondition(lambda self: any(op.kind == "settle" for op in self.ops))
    @rule(i=st.integers(0, 7))
    def read_settled(self, i: int) -> None:
        op = self._take("settle", i)
        assert op is not None
        m = self.live.get(op.rid)
        if m is not None and m.phase is S.HOLDING:
            self._fail(m, m.held)
        self._run(ReadSettled(op.rid))

    # ------------------------------------------------------------ P

    def _p_answers(self, rid: str) -> None:
        """P answering means our notification to it did go out."""
        for op in self.ops:
            if op.kind == "send" and op.rid == rid:
                op.delivered = True

    @rule(
        rid=st.sampled_from(RIDS),
        agent=st.sampled_from(AGENT_LIST),
        rank=st.integers(0, 2),
        ok=st.booleans(),
    )
    def push_done(self, rid: str, agent: str, rank: int, ok: bool) -> None:
        m = self.live.get(rid)
        if m is not None and m.agent == agent and m.phase in _GOOD and self._written(rid):
            self._p_answers(rid)
            if not ok and m.phase is S.HOLDING:
                self._fail(m, m.held)  # P's word: its WRITE ended, or none was posted
            elif not ok:
                self._fail(m, TRANSFER if m.aborted else LEASE_EXPIRED)
            elif rank < m.ranks:
                m.done.add(rank)
                self.pushed_ok.setdefault(rid, set()).add(rank)
                if len(m.done) == m.ranks:
                    self._finish(m)
        code = 0 if ok else LEASE_EXPIRED
        self._run(push_done(rid, rank, ok=ok, code=code, agent=agent))

    def _held_pushes(self) -> list[MReq]:
        return [m for m in self.live.values() if m.phase is S.HOLDING and self._written(m.rid)]

    @precondition(lambda self: bool(self._held_pushes()))
    @rule(i=st.integers(0, 3), ok=st.booleans())
    def p_answers_a_held_push(self, i: int, ok: bool) -> None:
        """P's word on a push D holds (its answer to the cancel, or its WRITE's PushDone)."""
        ms = self._held_pushes()
        m = ms[i % len(ms)]
        self.push_done(m.rid, m.agent, 0, ok)

    def _pulled_by_write(self) -> list[MReq]:
        return [
            m
            for m in self.live.values()
            if m.phase in _GOOD and m.agent and self.by_write.get(m.rid, False)
        ]

    @precondition(lambda self: bool(self._pulled_by_write()))
    @rule(i=st.integers(0, 3), ok=st.sampled_from((True, True, True, False)))
    def p_writes_a_pull(self, i: int, ok: bool) -> None:
        """P's WRITE of a pull it serves by WRITE lands: its PushDone, one per rank."""
        ms = self._pulled_by_write()
        m = ms[i % len(ms)]
        rank = next((r for r in range(m.ranks) if r not in m.done), 0)
        self.push_done(m.rid, m.agent, rank, ok)

    @rule(
        rid=st.sampled_from(RIDS),
        agent=st.sampled_from(AGENT_LIST),
        rank=st.integers(0, 2),
        first=st.integers(0, ML),
        span=st.integers(1, 2),
    )
    def layers_pushed(self, rid: str, agent: str, rank: int, first: int, span: int) -> None:
        """A LayersPushed riding one of P's layer-wise WRITEs (possibly a repeat, or out of
        range: rejected, never counted)."""
        end = first + span
        m = self.live.get(rid)
        if m is not None and m.agent == agent and m.phase in _GOOD and self.mode[rid] == "push":
            self._p_answers(rid)
            bits = (1 << end) - (1 << first)
            have = m.layer_bits.get(rank, 0)
            if rank < m.ranks and end <= ML and not have & bits:
                have |= bits
                m.layer_bits[rank] = have
                if have == (1 << ML) - 1:
                    m.done.add(rank)
                    self.pushed_ok.setdefault(rid, set()).add(rank)
                    if len(m.done) == m.ranks:
                        self._finish(m)
        msg = wire.LayersPushed(rank, (wire.LayerRange(rid, first, end),))
        self._run(LayersPushedArrived(agent, msg))

    def _pushing(self) -> list[MReq]:
        return [
            m
            for m in self.live.values()
            if m.phase in _GOOD and self.mode.get(m.rid) == "push" and m.agent
        ]

    @precondition(lambda self: bool(self._pushing()))
    @rule(
        i=st.integers(0, 3), rank=st.integers(0, 1), first=st.integers(0, 1), span=st.integers(1, 2)
    )
    def p_pushes_layers(self, i: int, rank: int, first: int, span: int) -> None:
        """P's layer-wise WRITE of a request registered with it lands (the usual case)."""
        ms = self._pushing()
        m = ms[i % len(ms)]
        if first == 0 and m.ranks:  # mostly: the next layers of one of its ranks
            rank %= m.ranks
            have = m.layer_bits.get(rank, 0)
            first = next((n for n in range(ML) if not have >> n & 1), 0)
            span = min(span, ML - first)
        self.layers_pushed(m.rid, m.agent, rank, first, span)

    @rule(rid=st.sampled_from(RIDS), agent=st.sampled_from(AGENT_LIST), ok=st.booleans())
    def pull_ack(self, rid: str, agent: str, ok: bool) -> None:
        m = self.live.get(rid)
        if m is not None and m.agent == agent and m.phase is S.ACKING:
            self._p_answers(rid)
            if ok:
                self.acked_ok.add(rid)
                self._finish(m)
            else:
                self._fail(m, TRANSFER if m.aborted else LEASE_EXPIRED)
        self._run(pull_ack(rid, ok=ok, code=0 if ok else LEASE_EXPIRED, agent=agent))

    @rule(agent=st.sampled_from(AGENT_LIST), nonce=st.integers(0, 3))
    def resync(self, agent: str, nonce: int) -> None:
        self.expect.append(Notify(agent, wire.ResyncAck(nonce)))
        self._run(ResyncArrived(agent, nonce))

    @rule(agent=st.sampled_from(AGENT_LIST), older=st.booleans())
    def peer_lost(self, agent: str, older: bool) -> None:
        since = self.now - 5.0 if older else math.inf
        for m in list(self.live.values()):
            if m.agent != agent or m.since > since:
                continue
            if m.phase in (S.REGISTERED, S.CANCELLING):
                self._hold(m, TRANSFER)  # no proof P's WRITE cannot land
            elif m.phase is S.ACKING:
                self._fail(m, TRANSFER)
        self._run(PeerLost(agent, "gone", since))

    @rule(agent=st.sampled_from(AGENT_LIST))
    def peer_gone(self, agent: str) -> None:
        for m in list(self.live.values()):
            if m.agent != agent:
                continue
            if m.phase is S.HOLDING and self._written(m.rid):
                self._fail(m, m.held)
            elif m.phase in (S.REGISTERED, S.CANCELLING, S.ACKING):
                self._fail(m, TRANSFER)
        self._run(PeerGone(agent, "refused"))

    @rule(peer=st.sampled_from(PEER_LIST), lease=st.sampled_from((1.2, 12.0)))
    def peer_known(self, peer: str, lease: float) -> None:
        self._run(PeerKnown(peer, lease))

    @rule(peer=st.sampled_from(PEER_LIST))
    def peer_reached(self, peer: str) -> None:
        self.failing.pop(peer, None)
        self._run(PeerReached(peer))

    @rule(peer=st.sampled_from(PEER_LIST), refused=st.booleans())
    def peer_unreachable(self, peer: str, refused: bool) -> None:
        live = self._live_at(peer)
        if live:
            first = self.failing.setdefault(peer, self.now)
            if refused or self.now - first >= LEASE:
                self.failing.pop(peer, None)
                for m in live:
                    if m.phase is S.TRACKED:
                        self._end(m, S.DROPPED)
        self._run(PeerUnreachable(peer, TransferError("unreachable"), refused))

    # ------------------------------------------------------------ time

    @rule(dt=st.sampled_from((0.05, 0.2, 1.0, 2.5, 6.0, 11.0, 21.0, 1000.0)))
    def advance(self, dt: float) -> None:
        self.now += dt
        self._run(None)

    # ------------------------------------------------------------ the end

    def teardown(self) -> None:
        if not self.ok:
            return  # a step failed already: that is the report
        for s in SESSIONS:
            if s not in self.closed:
                self.end_session(s)
        for _ in range(200):
            if not self.live:
                break
            if self.ops:
                kind = self.ops[0].kind
                if kind == "resolve":
                    self.resolve_done(0, True, 1, True)
                elif kind == "send":
                    self.send_done(0, True, False)
                elif kind == "settle":
                    self.read_settled(0)
                else:
                    self.read_done(0, True, False)
            elif self._held_pushes() and self.now % 2 < 1:  # P's word (or, else, the bound)
                self.p_answers_a_held_push(0, self.now % 4 < 2)
                self.now += 1.0
            else:
                self.advance(21.0)
        assert not self.live
        assert_empty(self.rx)
        assert not self.rx.closing
        assert set(self.answered) == set(SESSIONS)
        assert self.expect == []
        # every announced request ended exactly once towards its engine; a track, never
        for rid in self.seen:
            assert self.emitted[rid] == (1 if rid in self.loaded else 0), rid
        assert self.rx.counters.get("recv_ok", 0) + self.rx.counters.get("recv_failed", 0) == len(
            self.loaded
        )


ReceiverModel.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None)
TestReceiverModel = ReceiverModel.TestCase


# ------------------------------------------------------------------ layer-wise push


def layered(rx: Receiver, ld: Load, now: float, *, ranks: int, layers: int) -> None:
    """A push REGISTERED with P, our regions having `layers` layers."""
    rx.handle(ld, now)
    ev = replace(resolved(ld, ranks=ranks, since=now), layers=layers)
    rx.handle(ev, now)
    rx.handle(Sent(ld.request_id), now)
    assert rx.reqs[ld.request_id].state is S.REGISTERED


def pushed(
    rank: int, *ranges: tuple[str, int, int], agent: str = AGENTS[P1]
) -> LayersPushedArrived:
    return LayersPushedArrived(
        agent, wire.LayersPushed(rank, tuple(wire.LayerRange(r, a, b) for r, a, b in ranges))
    )


def test_layerwise_done_once_every_layer_of_every_rank_arrived() -> None:
    rx = make()
    layered(rx, load("r1"), 0.0, ranks=2, layers=4)
    layered(rx, load("r2"), 0.0, ranks=2, layers=4)
    # layers in any order, several requests in one notification
    assert quiet(rx.handle(pushed(0, ("r1", 0, 1), ("r2", 0, 2)), 0.1)) == []
    assert quiet(rx.handle(pushed(1, ("r1", 2, 4)), 0.2)) == []
    assert quiet(rx.handle(pushed(0, ("r1", 1, 4), ("r2", 2, 4)), 0.3)) == []
    assert rx.reqs["r1"].done_ranks == {0} and rx.reqs["r2"].done_ranks == {0}
    assert quiet(rx.handle(pushed(1, ("r1", 0, 2)), 0.4)) == [finished("r1")]
    assert quiet(rx.handle(pushed(1, ("r2", 0, 4)), 0.5)) == [finished("r2")]
    assert rx.counters["recv_ok"] == 2
    assert_empty(rx)
    # a late one is a late answer, not a second end
    out = rx.handle(pushed(1, ("r2", 0, 4)), 0.6)
    assert quiet(out) == [] and rx.counters["late_answers"] == 1


def test_layerwise_a_repeated_or_foreign_layer_is_rejected_never_counted() -> None:
    rx = make()
    layered(rx, load("r1"), 0.0, ranks=1, layers=3)
    rx.handle(pushed(0, ("r1", 0, 2)), 0.1)
    for bad in (
        pushed(0, ("r1", 1, 3)),  # layer 1 again
        pushed(0, ("r1", 2, 4)),  # past our layers
        pushed(1, ("r1", 2, 3)),  # a rank we do not have
        pushed(0, ("r1", 2, 3), agent=AGENTS[P2]),  # another P
        pushed(0, ("nobody", 0, 1)),
    ):
        out = rx.handle(bad, 0.2)
        assert records(out) == [] and [e.event for e in out if isinstance(e, Log)] == [
            "notif_rejected"
        ]
    assert rx.counters["notifs_rejected"] == 5
    assert rx.reqs["r1"].layer_bits == {0: 0b011}
    assert quiet(rx.handle(pushed(0, ("r1", 2, 3)), 0.3)) == [finished("r1")]


def test_layerwise_p_lost_after_some_layers_fails_never_done() -> None:
    rx = make()
    layered(rx, load("r1", blocks=(4, 5)), 0.0, ranks=1, layers=4)
    rx.handle(pushed(0, ("r1", 0, 2)), 0.1)
    assert records(rx.handle(PeerLost(AGENTS[P1], "killed"), 0.2)) == []  # held
    out = rx.handle(PeerGone(AGENTS[P1], "refused"), 0.25)
    assert one_failure(out, "r1").block_ids == (4, 5)
    assert_empty(rx)
    out = rx.handle(pushed(0, ("r1", 2, 4)), 0.3)  # the rest, too late
    assert records(out) == [] and rx.counters.get("recv_ok", 0) == 0


def test_layerwise_abort_mid_stream_waits_for_ps_word_and_ends_failed_once() -> None:
    rx = make()
    layered(rx, load("r1", p_id="p-1"), 0.0, ranks=1, layers=2)
    rx.handle(pushed(0, ("r1", 0, 1)), 0.1)
    out = quiet(rx.handle(AbortRecv("r1", "s1"), 0.2))
    assert out == [SendFor("r1", AGENTS[P1], cancel("p-1"))]
    assert rx.reqs["r1"].state is S.CANCELLING
    # P's last layer was already on its way: every layer arrived, still failed (aborted)
    out = rx.handle(pushed(0, ("r1", 1, 2)), 0.3)
    assert one_failure(out, "r1").reason.startswith("aborted")
    assert_empty(rx)
    assert quiet(rx.handle(push_done("r1", ok=False, code=TRANSFER), 0.4)) == []


def test_layerwise_and_push_done_ranks_add_up() -> None:
    rx = make()
    layered(rx, load("r1"), 0.0, ranks=2, layers=2)
    rx.handle(pushed(0, ("r1", 0, 2)), 0.1)
    assert quiet(rx.handle(push_done("r1", 1), 0.2)) == [finished("r1")]
    rx = make()
    layered(rx, load("r2"), 0.0, ranks=1, layers=2)
    rx.handle(pushed(0, ("r2", 0, 1)), 0.1)
    out = rx.handle(push_done("r2", ok=False, code=TRANSFER), 0.2)
    assert one_failure(out, "r2").code == TRANSFER


def test_no_registration_repeat_once_p_answered_before_the_send_completed() -> None:
    """P's first layers can arrive before the local completion of the registration's
    send: P has it, so it is never sent again (found by the model above)."""
    m = ReceiverModel()
    m.structure()
    m.load(blocks=(), mode="push", p_id=False, peer="p1:5001", rid="r0", session="s0")
    m.resolve_done(i=0, ok=True, ranks=1, reached=False)
    m.p_pushes_layers(first=0, i=0, rank=0, span=1)
    m.send_done(i=0, ok=False, stale=False)
    m.advance(dt=1.0)
    m.advance(dt=30.0)
    m.teardown()
