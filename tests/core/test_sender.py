"""The P side of the transfer protocol (`kvd.core.sender`), driven directly: no sockets, no
loop, no sleeps; the time is an argument. The direct tests walk each path of the machine (and
carry over every scenario of the old push matcher it replaced); the model-based test at the
end drives it with random event sequences next to a small reference model and checks the
protocol's rules after every step.
"""

from __future__ import annotations

import itertools
import random
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
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

from kvd.core import sender as sender_module
from kvd.core.effects import Emit, Log, Notify, SessionEnded
from kvd.core.ids import base_request_id
from kvd.core.sender import (
    _ON,
    TERMINAL,
    TRANSITIONS,
    AbortSend,
    CancelArrived,
    Effect,
    EndSession,
    Event,
    Finish,
    FinishRefused,
    HeartbeatArrived,
    LayersSaved,
    LayersWritten,
    PeerIncarnation,
    PostLayers,
    PostWrite,
    PullDoneArrived,
    RegionsChanged,
    RegistrationArrived,
    ResolveView,
    ResyncAcked,
    Sender,
    SendRequest,
    SendState,
    Stalled,
    ViewResolved,
    WriteDone,
    WriteSettled,
)

S = SendState

LEASE: Final = 6.0
EXTENSION: Final = LEASE * 2.0 / 3.0
"""How far past a heartbeat the lease runs at least."""
WAIT: Final = 3.0
"""lease_wait_timeout: how long an early pull waits for P's finish."""
REG: Final = 20.0
"""registration_timeout: how long a registration waits for P's finish."""
RESYNC: Final = 5.0

ENGINE: Final = "p-engine"
D1: Final = "agent-d1"
D2: Final = "agent-d2"
VIEW: Final = "view-of-d"
BLOCKS: Final = (10, 11, 12)

INVALID: Final = int(ErrorCode.INVALID)
NOT_FOUND: Final = int(ErrorCode.NOT_FOUND)
TRANSFER: Final = int(ErrorCode.TRANSFER)
TIMEOUT: Final = int(ErrorCode.TIMEOUT)
LEASE_EXPIRED: Final = int(ErrorCode.LEASE_EXPIRED)
INCOMPATIBLE: Final = int(ErrorCode.INCOMPATIBLE)


class RecordingSender(Sender):
    """The real machine, recording every move it makes."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.moves: list[tuple[SendRequest, SendState, SendState]] = []

    def _goto(self, req: SendRequest, state: SendState) -> None:
        self.moves.append((req, req.state, state))
        super()._goto(req, state)


def make(**kw: Any) -> RecordingSender:
    """A sender whose re-sync nonces are 1, 2, 3, ..."""
    nonces = itertools.count(1)
    args: dict[str, Any] = {
        "lease_duration": LEASE,
        "lease_wait_timeout": WAIT,
        "registration_timeout": REG,
        "resync_timeout": RESYNC,
        "nonce": lambda bits: next(nonces),
    }
    args.update(kw)
    return RecordingSender(**args)


def finish(rid: str, blocks: tuple[int, ...] = BLOCKS, session: str = "s1") -> Finish:
    return Finish(rid, ENGINE, blocks, session)


def reg(
    d_rid: str,
    p_rid: str = "",
    *,
    blocks: tuple[int, ...] = (7, 8),
    p_session: str = "",
    p_blocks: tuple[int, ...] = (),
) -> wire.PushRegistration:
    """D's registration of its request `d_rid`, naming P's id `p_rid` ("" = D does not know
    it); `p_blocks`: a pull by WRITE naming P's blocks."""
    return wire.PushRegistration(
        request_id=d_rid,
        remote_request_id=p_rid,
        engine_id="d-engine",
        remote_engine_id=ENGINE,
        tp_size=1,
        block_ids=blocks,
        side_host="d-host",
        side_port=4000,
        incarnation=9,
        generations=(1,),
        p_session=p_session,
        p_block_ids=p_blocks,
    )


def registered(
    d_rid: str,
    p_rid: str = "",
    *,
    agent: str = D1,
    blocks: tuple[int, ...] = (7, 8),
    p_session: str = "",
) -> RegistrationArrived:
    return RegistrationArrived(agent, reg(d_rid, p_rid, blocks=blocks, p_session=p_session))


def pulled(
    p_rid: str,
    d_rid: str = "d1",
    generations: tuple[int, ...] = (),
    *,
    agent: str = D1,
    p_session: str = "",
) -> PullDoneArrived:
    return PullDoneArrived(agent, wire.PullDone(p_rid, d_rid, generations, p_session))


Norm = tuple[Any, ...] | Effect


def norm(eff: Effect) -> Norm:
    """Effects with their wording left out (a failure's code, not its reason)."""
    if isinstance(eff, Emit):
        assert eff.engine_id == ENGINE
        rec = eff.record
        if isinstance(rec, wire.SendFinished):
            return ("finished", eff.session, rec.request_id, 0)
        if isinstance(rec, wire.SendExpired):
            return ("expired", eff.session, rec.request_id, 0)
        assert isinstance(rec, wire.SendFailed), rec
        return ("failed", eff.session, rec.request_id, rec.code)
    if isinstance(eff, Notify):
        rec = eff.record
        if isinstance(rec, wire.PushDone):
            assert rec.tp_rank == 0 and not rec.ok  # the machine only ever says no to a push
            return ("push_done", eff.agent, rec.request_id, rec.code)
        if isinstance(rec, wire.PullAck):
            return ("pull_ack", eff.agent, rec.d_request_id, rec.ok, rec.code)
        assert isinstance(rec, wire.Resync), rec
        return ("resync", eff.agent)
    return eff


def calm(effects: Iterable[Effect]) -> list[Norm]:
    """The effects without log lines, normalised (each line checked by `logs`)."""
    logs(effects := list(effects))
    return [norm(e) for e in effects if not isinstance(e, Log)]


def logs(effects: Iterable[Effect]) -> list[str]:
    """The events of the log lines; a line about a request names its peer too (so the
    logs of one request can be followed across both daemons)."""
    lines = [e for e in effects if isinstance(e, Log)]
    for e in lines:
        assert "request_id" not in e.fields or "peer" in e.fields, e
    return [e.event for e in lines]


def reason(effects: Sequence[Effect]) -> str:
    """The reason of the single SendFailed in `effects`."""
    (rec,) = [e.record for e in effects if isinstance(e, Emit)]
    assert isinstance(rec, wire.SendFailed)
    return rec.reason


def answer(effects: Sequence[Effect]) -> str:
    """The reason of the single failed PushDone in `effects`."""
    (rec,) = [
        e.record for e in effects if isinstance(e, Notify) and isinstance(e.record, wire.PushDone)
    ]
    assert not rec.ok
    return rec.reason


def state(tx: Sender, key: str) -> SendState:
    return tx.reqs[key].state


def check_index(tx: Sender) -> None:
    """The base-id index holds exactly the live requests, in the order they were added."""
    want: dict[str, list[str]] = {}
    for key in tx.reqs:
        want.setdefault(base_request_id(key), []).append(key)
    assert {b: list(keys) for b, keys in tx._by_base.items()} == want


def matched(tx: Sender, rid: str, d_rid: str, now: float, *, agent: str = D1) -> None:
    """Bring P's request `rid` to MATCHED (its lease from `now`)."""
    assert tx.handle(finish(rid), now) == []
    ev = registered(d_rid, rid, agent=agent)
    assert tx.handle(ev, now) == [ResolveView(rid, agent, ev.msg)]
    assert state(tx, rid) is S.MATCHED


def writing(tx: Sender, rid: str, d_rid: str, now: float, *, agent: str = D1) -> PostWrite:
    matched(tx, rid, d_rid, now, agent=agent)
    (post,) = tx.handle(ViewResolved(rid, VIEW), now)
    assert isinstance(post, PostWrite)
    assert state(tx, rid) is S.WRITING
    return post


def assert_empty(tx: Sender) -> None:
    """Nothing live: no request, lease, timer or re-sync, so no reason to wake."""
    assert tx.reqs == {}
    assert tx._by_base == {}
    assert len(tx.leases) == 0
    assert tx.resyncing == {}
    assert tx.next_deadline() is None


def saved(
    rid: str, layers: int, *, rank: int = 0, ranks: int = 1, of: int = 4, blocks=BLOCKS
) -> LayersSaved:
    """P's worker of `rank`: layers [0, layers) of `rid` (of `of`) are in host memory."""
    return LayersSaved(rid, ENGINE, rank, ranks, layers, of, blocks)


def posts(effects: Iterable[Effect]) -> list[tuple[str, int, int]]:
    return [(e.key, e.first, e.end) for e in effects if isinstance(e, PostLayers)]


def streaming(tx: Sender, rid: str, d_rid: str, now: float, *, ranks: int = 1) -> None:
    """D registered for P's `rid`; its worker of rank 0 saved layer 0; D's view is resolved
    (so layer 0 is written if P has one rank)."""
    ev = registered(d_rid, rid)
    ev = RegistrationArrived(ev.agent, replace(ev.msg, tp_size=ranks))
    assert tx.handle(ev, now) == []
    assert tx.handle(saved(rid, 1, ranks=ranks), now) == [ResolveView(rid, D1, ev.msg)]
    assert state(tx, rid) is S.STREAMING
    want = [(rid, 0, 1)] if ranks == 1 else []
    assert posts(tx.handle(ViewResolved(rid, VIEW), now)) == want


# ------------------------------------------------------------------ the table


def test_transition_table_is_closed() -> None:
    assert {S.DELIVERED, S.EXPIRED, S.ABORTED, S.FAILED} == TERMINAL
    # every live state has a way on, terminal states have none
    assert set(TRANSITIONS) == set(S) - TERMINAL
    assert all(TRANSITIONS[s] for s in TRANSITIONS)
    assert not any(s in TRANSITIONS for s in TERMINAL)
    assert all(s not in TERMINAL for (s, _) in _ON)
    # a request is born AWAITING (D came first) or HELD (P's engine finished it): every state
    # is reachable from those, and every live state can reach an end
    seen, todo = {S.AWAITING, S.HELD}, [S.AWAITING, S.HELD]
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
    # a claimed lease cannot expire or be aborted under the WRITE: only its outcome ends it
    assert TRANSITIONS[S.WRITING] == {S.DELIVERED, S.FAILED}
    # nothing goes back: a request is never held again once it moved on
    assert all(
        S.HELD not in TRANSITIONS[s] and S.AWAITING not in TRANSITIONS[s] for s in TRANSITIONS
    )


def test_a_move_outside_the_table_is_our_bug() -> None:
    tx = make()
    req = SendRequest("r1", S.DELIVERED, 0.0)
    with pytest.raises(LocalProtocolError, match="no transition"):
        tx._goto(req, S.WRITING)
    assert req.state is S.DELIVERED
    req = SendRequest("r2", S.WRITING, 0.0)
    with pytest.raises(LocalProtocolError, match="no transition"):
        tx._goto(req, S.EXPIRED)
    assert req.state is S.WRITING


# ------------------------------------------------------------------ push: the happy paths


def test_push_finished_first() -> None:
    tx = make()
    assert tx.next_deadline() is None
    assert tx.handle(finish("r1"), 0.0) == []
    assert state(tx, "r1") is S.HELD
    lease = tx.leases.get("r1")
    assert lease is not None and lease.deadline == LEASE and lease.owner == "s1"
    assert tx.next_deadline() == LEASE
    assert tx.counters["leases_granted"] == 1

    ev = registered("d1", "r1")
    assert tx.handle(ev, 1.0) == [ResolveView("r1", D1, ev.msg)]
    assert state(tx, "r1") is S.MATCHED and tx.reqs["r1"].agent == D1
    assert tx.next_deadline() == LEASE  # the lease runs on while D's regions are resolved

    # D registered 2 blocks (D had the first one cached): the WRITE gets all of P's, the
    # planner pairs D's with their tail (block sizes may differ)
    out = tx.handle(ViewResolved("r1", VIEW), 1.5)
    assert out == [PostWrite("r1", D1, ENGINE, (10, 11, 12), ev.msg, VIEW)]
    assert state(tx, "r1") is S.WRITING
    assert "r1" not in tx.leases  # claimed: it cannot expire under the WRITE
    assert tx.next_deadline() is None
    assert tx.handle_timer(1000.0) == []
    assert state(tx, "r1") is S.WRITING

    assert tx.handle(WriteDone("r1"), 1000.5) == [Emit("s1", ENGINE, wire.SendFinished("r1"))]
    assert tx.counters["sends_ok"] == 1
    assert_empty(tx)
    assert [(f, t) for _, f, t in tx.moves] == [
        (S.HELD, S.MATCHED),
        (S.MATCHED, S.WRITING),
        (S.WRITING, S.DELIVERED),
    ]


def test_push_registration_first() -> None:
    tx = make()
    ev = registered("d1", "r1")
    assert tx.handle(ev, 0.0) == []
    assert state(tx, "r1") is S.AWAITING
    assert tx.by_state()["awaiting"] == 1
    assert list(tx.held()) == []
    # it waits for P's finish (bounded by REG) while D heartbeats it: looked at a lease on
    assert tx.next_deadline() == LEASE
    assert len(tx.leases) == 0

    assert tx.handle(finish("r1"), 2.0) == [ResolveView("r1", D1, ev.msg)]
    req = tx.reqs["r1"]
    assert (req.state, req.session, req.engine_id, req.blocks) == (S.MATCHED, "s1", ENGINE, BLOCKS)
    assert tx.next_deadline() == 2.0 + LEASE  # the registration's wait is over; the lease runs
    assert "r1" not in tx._timers

    tx = make()
    tx.handle(ev, 0.0)
    tx.handle(finish("r1"), 2.0)
    assert tx.handle(ViewResolved("r1", VIEW), 2.5) == [
        PostWrite("r1", D1, ENGINE, (10, 11, 12), ev.msg, VIEW)
    ]
    assert tx.handle(WriteDone("r1"), 3.0) == [Emit("s1", ENGINE, wire.SendFinished("r1"))]
    assert_empty(tx)
    assert [(f, t) for _, f, t in tx.moves] == [
        (S.AWAITING, S.MATCHED),
        (S.MATCHED, S.WRITING),
        (S.WRITING, S.DELIVERED),
    ]


def test_a_finish_the_daemon_refused_fails_ds_registration_and_pull_at_once() -> None:
    """The daemon refused P's finish before the machine saw it (its engine had no region
    registered yet: a client that reconnected sends finishes before its regions are
    back); the engine has its error. Before: D's registration for the request, waiting
    or to come, waited for a finish that never came, up to the registration timeout
    (480 s by default). Now it is answered failed at once, with the refusal's reason."""
    why = "P's daemon refused the request's finish: engine 'p-engine' has no region"
    tx = make()
    # D registered first: answered now
    assert tx.handle(registered("d1-bbbb", "r1-aaaa"), 0.0) == []
    out = tx.handle(FinishRefused("r1-aaaa", NOT_FOUND, why), 1.0)
    assert out == [Notify(D1, wire.PushDone("d1-bbbb", 0, False, NOT_FOUND, why))]
    assert tx.counters["finishes_refused"] == 1
    # or D registers (or pulls) later
    tx.handle(FinishRefused("r2-aaaa", NOT_FOUND, why), 2.0)
    assert calm(tx.handle(registered("d2-bbbb", "r2-aaaa"), 3.0)) == [
        ("push_done", D1, "d2-bbbb", NOT_FOUND)
    ]
    assert calm(tx.handle(pulled("r2-aaaa", "d3-bbbb"), 3.0)) == [
        ("pull_ack", D1, "d3-bbbb", False, NOT_FOUND)
    ]
    assert_empty(tx)
    # the engine finishes it again once its regions are back: leased and served
    tx.handle(finish("r2-aaaa"), 4.0)
    assert state(tx, "r2-aaaa") is S.HELD


def test_a_refused_second_finish_leaves_the_leased_request_alone() -> None:
    """A second finish of a leased request is refused (by the machine, or by the daemon's
    checks when its blocks are wrong): the first one's lease and D's registration for it
    are untouched."""
    tx = make()
    tx.handle(finish("r1"), 0.0)
    assert tx.handle(FinishRefused("r1", INVALID, "block 99 is outside the region"), 1.0) == []
    assert state(tx, "r1") is S.HELD and "finishes_refused" not in tx.counters
    ev = registered("d1", "r1")
    assert tx.handle(ev, 2.0) == [ResolveView("r1", D1, ev.msg)]


def test_registration_by_ds_own_id_matches_by_base_id_in_both_orders() -> None:
    """D that does not know P's id registers under its own, which shares P's base id."""
    p_id, d_id = "cmpl-x-0-aaaaaaaa", "cmpl-x-0-dddddddd"
    tx = make()
    ev = registered(d_id)  # no remote id: the key is D's id
    assert tx.handle(ev, 0.0) == []
    assert set(tx.reqs) == {d_id}
    assert tx.handle(finish(p_id), 1.0) == [ResolveView(p_id, D1, ev.msg)]
    assert set(tx.reqs) == {p_id}  # the request took P's id
    check_index(tx)

    tx = make()
    tx.handle(finish(p_id), 0.0)
    assert tx.handle(ev, 1.0) == [ResolveView(p_id, D1, ev.msg)]
    assert set(tx.reqs) == {p_id}


def test_block_counts_are_the_planners_to_check() -> None:
    # D's blocks may outnumber P's (D's blocks are smaller): the machine matches them and
    # the WRITE's planner decides; its refusal fails the send and tells D
    tx = make()
    tx.handle(finish("r1", blocks=(1, 2)), 0.0)
    ev = registered("d1", "r1", blocks=(5, 6, 7))
    assert tx.handle(ev, 0.1) == [ResolveView("r1", D1, ev.msg)]
    assert tx.handle(ViewResolved("r1", VIEW), 0.2) == [
        PostWrite("r1", D1, ENGINE, (1, 2), ev.msg, VIEW)
    ]
    out = tx.handle(WriteDone("r1", InvalidRequest("D has 3 blocks to fill but P has only 2")), 0.3)
    assert calm(out) == [("failed", "s1", "r1", INVALID), ("push_done", D1, "d1", INVALID)]
    assert "P has only 2" in reason(out)
    assert_empty(tx)


def test_a_registration_of_no_blocks_writes_nothing_of_ps() -> None:
    tx = make()
    tx.handle(finish("r1"), 0.0)
    ev = registered("d1", "r1", blocks=())
    tx.handle(ev, 0.0)
    assert tx.handle(ViewResolved("r1", VIEW), 0.1) == [
        PostWrite("r1", D1, ENGINE, (), ev.msg, VIEW)
    ]


def test_ds_view_not_resolved_fails_the_send() -> None:
    tx = make()
    matched(tx, "r1", "d1", 0.0)
    out = tx.handle(ViewResolved("r1", error=Incompatible("D re-registered")), 0.5)
    assert calm(out) == [
        ("failed", "s1", "r1", INCOMPATIBLE),
        ("push_done", D1, "d1", INCOMPATIBLE),
    ]
    assert reason(out) == "D re-registered"
    assert logs(out) == ["push_failed"]
    assert_empty(tx)
    # the request's fate is its own: not found by another id sharing its base
    assert tx.tombstones["r1"].by_base is False


def test_write_failed_fails_the_send_and_tells_d() -> None:
    tx = make()
    writing(tx, "r1", "d1", 0.0)
    out = tx.handle(WriteDone("r1", TransferError("WRITE failed")), 0.5)
    assert calm(out) == [("failed", "s1", "r1", TRANSFER), ("push_done", D1, "d1", TRANSFER)]
    assert tx.counters["sends_failed"] == 1
    assert_empty(tx)


def test_unsettled_write_keeps_the_request_and_tells_d_nothing_until_it_settles() -> None:
    """UCX did not end the WRITE within its bound: P's blocks may still be read and D's
    still written, so P's engine keeps its blocks and D gets no word (D holds its own)
    until the WRITE ends; its failure then is P's word to D."""
    tx = make(unsettled_hold=50.0)
    writing(tx, "r1", "d1", 0.0)
    out = tx.handle(WriteDone("r1", Timeout("still in flight"), unsettled=True), 40.0)
    assert calm(out) == []
    assert logs(out) == ["write_unsettled"]
    assert state(tx, "r1") is S.WRITING
    assert tx.next_deadline() == 90.0
    assert tx.handle(CancelArrived(D1, "r1"), 41.0) == []  # the WRITE's end answers it
    out = tx.handle(WriteSettled("r1", TransferError("endpoint failed")), 45.0)
    assert calm(out) == [("failed", "s1", "r1", TRANSFER), ("push_done", D1, "d1", TRANSFER)]
    assert tx.counters["writes_settled"] == 1
    assert_empty(tx)


def test_unsettled_write_that_lands_after_all_is_delivered() -> None:
    tx = make()
    writing(tx, "r1", "d1", 0.0)
    tx.handle(WriteDone("r1", Timeout("still in flight"), unsettled=True), 40.0)
    out = tx.handle(WriteSettled("r1"), 41.0)  # D got its PushDone(ok) with the bytes
    assert calm(out) == [("finished", "s1", "r1", 0)]
    assert_empty(tx)


def test_unsettled_write_past_its_hold_frees_ps_blocks_but_tells_d_nothing() -> None:
    tx = make(unsettled_hold=50.0)
    writing(tx, "r1", "d1", 0.0)
    tx.handle(WriteDone("r1", Timeout("still in flight"), unsettled=True), 40.0)
    assert tx.handle_timer(89.9) == []
    out = tx.handle_timer(90.0)
    assert calm(out) == [("failed", "s1", "r1", TIMEOUT)]  # no PushDone: D holds its blocks
    assert logs(out) == ["write_unsettled_released"]
    assert tx.counters["writes_unsettled_released"] == 1
    assert_empty(tx)
    assert tx.handle(WriteSettled("r1"), 95.0) == []  # ended already
    assert tx.counters["writes_landed_after_release"] == 1
    # D, holding its blocks, cancels again: P cannot say its WRITE ended, so it is silent
    assert calm(tx.handle(CancelArrived(D1, "r1"), 96.0)) == []


def test_a_registration_repeated_after_its_request_ended_is_answered_by_ds_id() -> None:
    """D repeats a registration whose answer it never heard (lost with the link). D names
    the request by its own id (push without P's id: matched by base id when it came); P's
    request ended under P's id. The repeat finds it by D's id and is answered (here:
    delivered already, an error D fails the request on: a recompute), never taken for a
    new registration that would wait for a finish that came long ago."""
    p_id, d_id = "cmpl-aa-1-0-11111111", "cmpl-aa-1-0-22222222"
    tx = make()
    tx.handle(finish(p_id), 0.0)
    assert tx.handle(registered(d_id), 0.1) != []
    assert isinstance(tx.handle(ViewResolved(p_id, VIEW), 0.2)[0], PostWrite)
    assert calm(tx.handle(WriteDone(p_id), 0.5)) == [("finished", "s1", p_id, 0)]
    out = tx.handle(registered(d_id), 1.0)
    assert calm(out) == [("push_done", D1, d_id, INVALID)]
    assert tx.counters["late_registrations"] == 1 and tx.counters["push_registrations"] == 1
    assert_empty(tx)
    # the WRITE said how many PushDone(ok) it carried: D, which never heard them, is told
    # again (its bytes are there, in blocks it still holds), by the same agent only
    tx = make()
    tx.handle(finish(p_id), 0.0)
    tx.handle(registered(d_id), 0.1)
    tx.handle(ViewResolved(p_id, VIEW), 0.2)
    assert calm(tx.handle(WriteDone(p_id, transfers=2), 0.5)) == [("finished", "s1", p_id, 0)]
    out = tx.handle(registered(d_id, agent=D2), 0.9)
    assert calm(out) == [("push_done", D2, d_id, INVALID)]  # not the D it was written to
    out = tx.handle(registered(d_id), 1.0)
    assert out == [
        Notify(D1, wire.PushDone(d_id, 0, True, 0, "")),
        Notify(D1, wire.PushDone(d_id, 1, True, 0, "")),
    ]
    assert tx.counters["registrations_answered_done"] == 1
    assert_empty(tx)
    # one whose WRITE was released unsettled (it may still land): no word, nothing waits
    tx = make(unsettled_hold=50.0)
    tx.handle(finish(p_id), 0.0)
    tx.handle(registered(d_id), 0.1)
    tx.handle(ViewResolved(p_id, VIEW), 0.2)
    tx.handle(WriteDone(p_id, Timeout("still in flight"), unsettled=True), 10.0)
    assert calm(tx.handle_timer(60.0)) == [("failed", "s1", p_id, TIMEOUT)]
    assert calm(tx.handle(registered(d_id), 61.0)) == []
    assert tx.counters["late_registrations_unsettled"] == 1
    assert_empty(tx)


def test_a_cancel_after_the_write_ended_is_answered_from_the_tombstone() -> None:
    """D gave up and holds its blocks until P's word; P's request ended already (its WRITE
    failed, and that answer was lost with the link): the cancel D sends again is answered,
    since nothing of the request can be in flight, but only to the agent it was bound to."""
    tx = make()
    writing(tx, "r1", "d1", 0.0)
    tx.handle(WriteDone("r1", TransferError("endpoint failed")), 0.5)
    assert calm(tx.handle(CancelArrived(D2, "r1"), 1.0)) == []
    out = tx.handle(CancelArrived(D1, "r1"), 1.0)
    assert calm(out) == [("push_done", D1, "d1", TRANSFER)]
    assert tx.counters["cancels_answered_after_end"] == 1


def test_a_second_view_answer_changes_nothing() -> None:
    tx = make()
    writing(tx, "r1", "d1", 0.0)
    assert tx.handle(ViewResolved("r1", VIEW), 0.1) == []
    assert tx.handle(ViewResolved("r1", error=Incompatible("late")), 0.1) == []
    assert state(tx, "r1") is S.WRITING


def test_write_done_for_a_request_not_writing_is_our_bug() -> None:
    tx = make()
    with pytest.raises(LocalProtocolError, match="not writing"):
        tx.handle(WriteDone("ghost"), 0.0)
    tx.handle(finish("r1"), 0.0)
    with pytest.raises(LocalProtocolError, match="not writing"):
        tx.handle(WriteDone("r1"), 0.1)
    assert state(tx, "r1") is S.HELD


def test_nothing_ends_a_write_but_its_outcome() -> None:
    tx = make()
    writing(tx, "r1", "d1", 0.0)
    assert tx.handle(AbortSend("r1", "s1"), 0.1) == []
    assert tx.handle(CancelArrived(D1, "r1"), 0.2) == []  # its PushDone answers D
    assert tx.handle(HeartbeatArrived(D1, ("r1",)), 0.3) == []
    assert tx.counters["heartbeat_unknown_ids"] == 1  # no lease to extend: it is claimed
    assert calm(tx.handle(Stalled(), 0.35)) == []  # a stall does not reach a WRITE in flight
    assert tx.handle_timer(1000.0) == []
    assert state(tx, "r1") is S.WRITING
    # the WRITE had run already: delivered, even though the engine gave up meanwhile
    assert tx.handle(WriteDone("r1"), 1000.0) == [Emit("s1", ENGINE, wire.SendFinished("r1"))]
    assert_empty(tx)


# ------------------------------------------------------------------ leases and time


def test_lease_expires_at_its_deadline() -> None:
    tx = make()
    tx.handle(finish("r1"), 1.0)
    assert tx.handle_timer(1.0 + LEASE - 0.01) == []
    out = tx.handle_timer(1.0 + LEASE)
    assert calm(out) == [("expired", "s1", "r1", 0)]
    assert logs(out) == ["lease_expired"]
    assert tx.counters["leases_expired"] == 1
    assert_empty(tx)
    assert tx.handle_timer(1000.0) == []  # once


def test_lease_expiring_while_matched_tells_d() -> None:
    tx = make()
    matched(tx, "r1", "d1", 0.0)
    out = tx.handle_timer(LEASE)
    assert calm(out) == [("expired", "s1", "r1", 0), ("push_done", D1, "d1", LEASE_EXPIRED)]
    assert_empty(tx)
    # the view comes back too late: no WRITE
    assert tx.handle(ViewResolved("r1", VIEW), LEASE + 0.1) == []


def test_heartbeats_extend_the_lease_never_shorten_it() -> None:
    p_id = "cmpl-h-0-aaaaaaaa"
    tx = make()
    tx.handle(finish(p_id), 0.0)
    tx.handle(HeartbeatArrived(D1, (p_id, "ghost")), 1.0)  # would end at 5: no earlier
    assert tx.next_deadline() == LEASE
    tx.handle(HeartbeatArrived(D1, (p_id,)), 5.0)
    assert tx.next_deadline() == 5.0 + EXTENSION
    # D's own id for it finds the lease by its base id
    tx.handle(HeartbeatArrived(D1, ("cmpl-h-0-dddddddd",)), 8.0)
    assert tx.next_deadline() == 8.0 + EXTENSION
    assert tx.counters["heartbeats_received"] == 3
    assert tx.counters["heartbeat_unknown_ids"] == 1
    assert tx.handle_timer(8.0 + EXTENSION - 0.01) == []
    assert calm(tx.handle_timer(8.0 + EXTENSION)) == [("expired", "s1", p_id, 0)]


AUTH: Final = int(ErrorCode.AUTH)


def test_a_lease_is_bound_to_the_first_peer_that_speaks_for_it() -> None:
    """Another peer can neither heartbeat, register for, complete a pull of nor cancel a
    request bound to D1: each is refused to it alone and counted, and D1's request goes on."""
    tx = make()
    tx.handle(finish("pull-r"), 0.0)
    tx.handle(HeartbeatArrived(D1, ("pull-r",)), 5.0)  # D1 holds it from now on
    assert tx.reqs["pull-r"].agent == D1
    assert tx.next_deadline() == 5.0 + EXTENSION
    tx.handle(HeartbeatArrived(D2, ("pull-r",)), 7.0)  # would push the lease to 11
    assert tx.next_deadline() == 5.0 + EXTENSION
    assert tx.counters["heartbeats_foreign"] == 1
    out = tx.handle(pulled("pull-r", "d2-r", agent=D2), 7.5)
    assert calm(out) == [("pull_ack", D2, "d2-r", False, AUTH)]
    out = tx.handle(CancelArrived(D2, "pull-r"), 7.6)
    assert calm(out) == []
    assert state(tx, "pull-r") is S.HELD
    assert tx.counters["foreign_requests_refused"] == 2
    # D1's own pull completion is acknowledged
    out = tx.handle(pulled("pull-r", "d1-r"), 8.0)
    assert calm(out) == [("finished", "s1", "pull-r", 0), ("pull_ack", D1, "d1-r", True, 0)]
    # push: D1 registered; D2's registration for the same request is refused to D2
    matched(tx, "push-r", "d1-p", 10.0)
    out = tx.handle(registered("d2-p", "push-r", agent=D2), 10.5)
    assert calm(out) == [("push_done", D2, "d2-p", AUTH)]
    assert state(tx, "push-r") is S.MATCHED and tx.reqs["push-r"].agent == D1
    assert tx.counters["foreign_requests_refused"] == 3


def test_next_deadline_is_the_earliest_of_leases_waits_and_resyncs() -> None:
    tx = make()
    assert tx.next_deadline() is None
    tx.handle(finish("held"), 0.0)  # lease until 6
    # waits until 21 at most; looked at a lease after D last heartbeated it (7)
    tx.handle(registered("d-reg", "reg"), 1.0)
    assert tx.next_deadline() == LEASE
    tx.handle(pulled("early"), 2.0)  # waits until 5
    assert tx.next_deadline() == 2.0 + WAIT
    tx.handle(Stalled(), 2.5)
    matched(tx, "m", "d-m", 2.5)
    tx.handle(ViewResolved("m", VIEW), 2.9)  # re-sync until 7.9, lease until 8.5
    assert tx.next_deadline() == 2.0 + WAIT
    tx.handle_timer(2.0 + WAIT)
    assert tx.next_deadline() == LEASE
    tx.handle_timer(LEASE)
    assert tx.next_deadline() == 1.0 + LEASE
    tx.handle(HeartbeatArrived(D1, ("reg",)), 6.5)
    assert tx.handle_timer(1.0 + LEASE) == []  # heard at 6.5: looked at again at 12.5
    assert tx.next_deadline() == 2.9 + RESYNC
    tx.handle_timer(2.9 + RESYNC)  # fails "m", whose lease goes with it
    assert tx.next_deadline() == 6.5 + LEASE
    tx.handle_timer(6.5 + LEASE)  # D silent for a lease: the registration ends
    assert_empty(tx)


def test_a_deadline_of_zero_counts() -> None:
    tx = make(lease_wait_timeout=0.0)
    tx.handle(pulled("r1"), 0.0)
    assert tx.next_deadline() == 0.0
    assert calm(tx.handle_timer(0.0)) == [("pull_ack", D1, "d1", False, NOT_FOUND)]
    assert tx.next_deadline() is None

    tx = make()
    tx.handle(finish("r1"), -LEASE)  # time is only a number: the lease ends at 0.0
    assert tx.next_deadline() == 0.0
    assert calm(tx.handle_timer(0.0)) == [("expired", "s1", "r1", 0)]


# ------------------------------------------------------------------ pull


def test_pull_acknowledged_while_held() -> None:
    tx = make()
    assert tx.handle(RegionsChanged({ENGINE: (3, 4)}), 0.0) == []
    tx.handle(finish("r1"), 0.0)
    out = tx.handle(pulled("r1", "d1", (3, 4)), 1.0)
    assert out == [
        Emit("s1", ENGINE, wire.SendFinished("r1")),
        Notify(D1, wire.PullAck("d1", True, 0, "")),
    ]
    assert tx.counters["pulls_acked"] == 1
    assert_empty(tx)
    assert [(f, t) for _, f, t in tx.moves] == [(S.HELD, S.DELIVERED)]


def test_pull_through_a_stale_view_of_ps_regions_fails_closed() -> None:
    tx = make()
    tx.handle(RegionsChanged({ENGINE: (3,)}), 0.0)
    tx.handle(finish("r1"), 0.0)
    out = tx.handle(pulled("r1", "d1", (2,)), 1.0)
    assert calm(out) == [("failed", "s1", "r1", TRANSFER), ("pull_ack", D1, "d1", False, TRANSFER)]
    assert tx.counters["pulls_stale_view"] == 1
    assert_empty(tx)
    # and with no regions known at all, any generation D names is stale
    tx = make()
    tx.handle(finish("r1"), 0.0)
    assert calm(tx.handle(pulled("r1", "d1", (1,)), 1.0))[0] == ("failed", "s1", "r1", TRANSFER)


def test_a_pull_that_read_nothing_is_acknowledged() -> None:
    tx = make()
    tx.handle(finish("r1", blocks=()), 0.0)
    assert calm(tx.handle(pulled("r1", "d1", ()), 0.5)) == [
        ("finished", "s1", "r1", 0),
        ("pull_ack", D1, "d1", True, 0),
    ]


def test_early_pull_waits_for_the_finish() -> None:
    tx = make()
    tx.handle(RegionsChanged({ENGINE: (3,)}), 0.0)
    assert tx.handle(pulled("r1", "d1", (3,)), 0.0) == []
    assert state(tx, "r1") is S.AWAITING
    assert tx.next_deadline() == WAIT
    assert tx.counters["early_pulls"] == 1
    out = tx.handle(finish("r1"), 1.0)
    assert out == [
        Emit("s1", ENGINE, wire.SendFinished("r1")),
        Notify(D1, wire.PullAck("d1", True, 0, "")),
    ]
    assert tx.counters["early_pulls_served"] == 1
    assert_empty(tx)
    assert [(f, t) for _, f, t in tx.moves] == [(S.AWAITING, S.DELIVERED)]


def test_early_pull_that_waits_in_vain() -> None:
    tx = make()
    tx.handle(pulled("r1", "d1"), 0.0)
    assert tx.handle_timer(WAIT - 0.01) == []
    assert calm(tx.handle_timer(WAIT)) == [("pull_ack", D1, "d1", False, NOT_FOUND)]
    assert_empty(tx)
    # D gave up: a finish that comes later ends at once, and leases nothing
    out = tx.handle(finish("r1"), WAIT + 1.0)
    assert calm(out) == [("failed", "s1", "r1", NOT_FOUND)]
    assert_empty(tx)


def test_a_pull_is_refused_when_the_request_is_not_pullable() -> None:
    tx = make()
    matched(tx, "m", "d-m", 0.0)
    tx.handle(registered("d-a", "a"), 0.0)
    tx.handle(pulled("e", "d-e"), 0.0)
    for rid, d in (("m", "d-m"), ("a", "d-a"), ("e", "d-e2")):
        out = tx.handle(pulled(rid, d), 0.1)
        assert calm(out) == [("pull_ack", D1, d, False, INVALID)]
        assert logs(out) == ["pull_refused"]
    assert {k: r.state for k, r in tx.reqs.items()} == {
        "m": S.MATCHED,
        "a": S.AWAITING,
        "e": S.AWAITING,
    }
    assert tx.reqs["e"].early_pull == wire.PullDone("e", "d-e", (), "")  # the first one waits on


# ------------------------------------------------------------------ P's engine gives up


def test_abort_held() -> None:
    tx = make()
    tx.handle(finish("r1"), 0.0)
    out = tx.handle(AbortSend("r1", "s1"), 1.0)
    assert out == [Emit("s1", ENGINE, wire.SendFailed("r1", TRANSFER, "aborted"))]
    assert_empty(tx)
    # D registering or pulling later is told at once
    out = tx.handle(registered("d1", "r1"), 2.0)
    assert calm(out) == [("push_done", D1, "d1", NOT_FOUND)]
    assert tx.counters["late_registrations"] == 1
    assert calm(tx.handle(pulled("r1", "d1"), 2.0)) == [("pull_ack", D1, "d1", False, NOT_FOUND)]
    assert tx.handle(AbortSend("r1", "s1"), 3.0) == []  # once
    assert_empty(tx)


def test_abort_matched_tells_d_and_never_writes() -> None:
    tx = make()
    matched(tx, "r1", "d1", 0.0)
    out = tx.handle(AbortSend("r1", "s1"), 1.0)
    assert calm(out) == [("failed", "s1", "r1", TRANSFER), ("push_done", D1, "d1", NOT_FOUND)]
    assert_empty(tx)
    assert tx.handle(ViewResolved("r1", VIEW), 1.1) == []


def test_abort_before_finish_fails_a_waiting_registration_and_later_ones() -> None:
    p_id = "cmpl-a-0-aaaaaaaa"
    tx = make()
    tx.handle(registered("cmpl-a-0-dddddddd"), 0.0)  # D's id: found by base id
    out = tx.handle(AbortSend(p_id, "s1"), 1.0)
    assert calm(out) == [("push_done", D1, "cmpl-a-0-dddddddd", NOT_FOUND)]
    assert tx.counters["registrations_failed_p_abort"] == 1
    assert_empty(tx)  # never finished here: no event to the engine
    out = tx.handle(registered("cmpl-a-0-dddddddd", p_id), 2.0)
    assert calm(out) == [("push_done", D1, "cmpl-a-0-dddddddd", NOT_FOUND)]

    tx = make()
    tx.handle(pulled(p_id, "d1"), 0.0)  # an early pull under P's id
    assert calm(tx.handle(AbortSend(p_id, "s1"), 1.0)) == [("pull_ack", D1, "d1", False, NOT_FOUND)]
    assert_empty(tx)


def test_abort_by_another_session_or_for_nothing() -> None:
    tx = make()
    tx.handle(finish("r1"), 0.0)
    assert tx.handle(AbortSend("r1", "s2"), 0.1) == []  # not that session's request
    assert state(tx, "r1") is S.HELD
    assert tx.handle(AbortSend("nobody", "s1"), 0.1) == []
    assert state(tx, "r1") is S.HELD
    # what was never finished here is tombstoned: D is told at once when it comes
    assert calm(tx.handle(pulled("nobody", "d9"), 0.2)) == [
        ("pull_ack", D1, "d9", False, NOT_FOUND)
    ]


# ------------------------------------------------------------------ D cancels


def test_cancel_held_frees_the_lease_now() -> None:
    tx = make()
    tx.handle(finish("r1"), 0.0)
    out = tx.handle(CancelArrived(D2, "r1"), 1.0)  # no D has claimed it: any may cancel
    assert calm(out) == [("failed", "s1", "r1", TRANSFER)]
    assert reason(out) == "cancelled by D"
    assert logs(out) == ["lease_cancelled_by_d"]
    assert tx.counters["leases_cancelled"] == 1
    assert_empty(tx)


def test_cancel_matched_answers_the_registration() -> None:
    tx = make()
    matched(tx, "r1", "d1", 0.0)
    out = tx.handle(CancelArrived(D1, "r1"), 1.0)
    assert calm(out) == [("failed", "s1", "r1", TRANSFER), ("push_done", D1, "d1", TRANSFER)]
    assert tx.handle(ViewResolved("r1", VIEW), 1.1) == []
    assert_empty(tx)


def test_cancel_by_ds_own_id_finds_ps_request_by_base_id() -> None:
    tx = make()
    tx.handle(finish("cmpl-c-0-aaaaaaaa"), 0.0)
    out = tx.handle(CancelArrived(D1, "cmpl-c-0-dddddddd"), 1.0)
    assert calm(out) == [("failed", "s1", "cmpl-c-0-aaaaaaaa", TRANSFER)]
    assert_empty(tx)


def test_cancel_a_waiting_registration() -> None:
    tx = make()
    tx.handle(registered("d1", "r1"), 0.0)
    assert calm(tx.handle(CancelArrived(D1, "r1"), 1.0)) == [("push_done", D1, "d1", TRANSFER)]
    assert_empty(tx)
    # the finish that comes later ends at once: nothing will ever read the blocks
    out = tx.handle(finish("r1"), 2.0)
    assert calm(out) == [("failed", "s1", "r1", TRANSFER)]
    assert tx.counters["finishes_after_cancel"] == 1
    assert_empty(tx)


def test_a_registration_d_stopped_heartbeating_ends_a_lease_after_it_was_last_heard() -> None:
    """D heartbeats what it waits for: a registration waiting for P's finish that D no
    longer heartbeats (D ended the request and its cancel was lost, or went to a P it
    took for this one) ends a lease after D was last heard, answered failed, and P's
    finish of it later ends at once; not at the registration timeout."""
    tx = make()
    tx.handle(registered("cmpl-w-0-dddddddd", "cmpl-w-0-aaaaaaaa"), 0.0)
    assert tx.handle(HeartbeatArrived(D1, ("cmpl-w-0-aaaaaaaa",)), 3.0) == []
    assert tx.handle_timer(LEASE) == []  # heard at 3: looked at again at 9
    assert tx.next_deadline() == 3.0 + LEASE
    assert tx.handle(HeartbeatArrived(D1, ("cmpl-w-0-dddddddd",)), 8.0) == []  # by D's id
    assert tx.handle_timer(3.0 + LEASE) == []
    # another peer's heartbeat says nothing of it (counted as an unknown id)
    assert tx.handle(HeartbeatArrived(D2, ("cmpl-w-0-aaaaaaaa",)), 12.0) == []
    assert tx.counters["heartbeat_unknown_ids"] == 1
    assert tx.counters["heartbeats_on_waiting"] == 2
    assert tx.handle_timer(8.0 + LEASE - 0.01) == []
    assert state(tx, "cmpl-w-0-aaaaaaaa") is S.AWAITING
    out = tx.handle_timer(8.0 + LEASE)
    assert calm(out) == [("push_done", D1, "cmpl-w-0-dddddddd", TIMEOUT)]
    assert logs(out) == ["registration_abandoned"]
    assert "did not heartbeat" in answer(out)
    assert tx.counters["registrations_abandoned"] == 1
    assert_empty(tx)
    out = tx.handle(finish("cmpl-w-0-aaaaaaaa"), 15.0)  # nobody would take the blocks
    assert calm(out) == [("failed", "s1", "cmpl-w-0-aaaaaaaa", TIMEOUT)]
    assert_empty(tx)


def test_a_registration_d_keeps_heartbeating_waits_until_the_registration_timeout() -> None:
    tx = make()
    tx.handle(registered("d1", "r1"), 0.0)
    t = 0.0
    while t + LEASE / 6 < REG:
        t += LEASE / 6
        tx.handle(HeartbeatArrived(D1, ("r1",)), t)
        assert tx.handle_timer(t) == []
    tx.handle(registered("d1", "r1"), REG - 0.5)  # D's repeat of it counts as a sign too
    assert state(tx, "r1") is S.AWAITING
    out = tx.handle_timer(REG)
    assert calm(out) == [("push_done", D1, "d1", TIMEOUT)]
    assert "did not finish the request" in answer(out)
    assert tx.counters.get("registrations_abandoned", 0) == 0


def test_our_stall_gives_a_waiting_registration_a_lease_from_its_end() -> None:
    """Frozen, we heard nobody: a registration is judged silent only a lease after our
    stall (the actor feeds the stall before the timers that came due during it)."""
    tx = make()
    tx.handle(registered("d1", "r1"), 0.0)
    tx.handle(Stalled(), 10.0)
    assert tx.handle_timer(10.0) == []
    assert state(tx, "r1") is S.AWAITING
    tx.handle(HeartbeatArrived(D1, ("r1",)), 12.0)
    assert tx.handle_timer(16.0) == []
    assert calm(tx.handle_timer(18.0)) == [("push_done", D1, "d1", TIMEOUT)]


def test_a_registration_repeated_to_a_restarted_p_is_refused_at_once() -> None:
    """D names the P incarnation it planned against; a repeat of it that reaches the P
    daemon that came up since (same agent name) is refused at once, never kept."""
    tx = make(incarnation=0x2222)
    msg = replace(reg("d1", "r1"), p_incarnation=0x1111)
    out = tx.handle(RegistrationArrived(D1, msg), 0.0)
    assert calm(out) == [("push_done", D1, "d1", TRANSFER)]
    assert "restarted" in answer(out)
    assert tx.counters["requests_of_another_incarnation"] == 1
    assert_empty(tx)


def test_a_restarted_ds_waiting_registrations_end_and_its_late_ones_are_ignored() -> None:
    """D's daemon restarted (a handshake shows a new incarnation): the registrations its
    earlier incarnation left waiting end at once, with no word (nobody would hear it),
    instead of at our registration timeout; a late one from it is ignored; the new
    incarnation's registrations and another D's are untouched."""
    tx = make()
    assert tx.handle(PeerIncarnation(D1, 9), 0.0) == []  # the incarnation `reg` names
    tx.handle(registered("d1", "r1"), 0.0)
    tx.handle(registered("d2", "r2", agent=D2), 0.0)
    assert tx.awaiting() == (2, 0)
    assert tx.handle(PeerIncarnation(D1, 9), 1.0) == []  # the same one again: nothing
    assert tx.awaiting() == (2, 0)
    assert calm(tx.handle(PeerIncarnation(D1, 10), 2.0)) == []  # restarted: no word
    assert tx.awaiting() == (1, 0)
    assert tx.counters["waits_failed_peer_restarted"] == 1
    assert tx.handle(registered("d3", "r3"), 3.0) == []  # late, from the old incarnation
    assert tx.counters["registrations_from_gone_incarnation"] == 1
    assert tx.awaiting() == (1, 0)
    new = RegistrationArrived(D1, replace(reg("d4", "r4"), incarnation=10))
    tx.handle(new, 4.0)
    assert tx.awaiting() == (2, 0)
    # the old incarnation's request is refused when P's engine finishes it after all
    assert calm(tx.handle(finish("r1"), 5.0)) == [("failed", "s1", "r1", TRANSFER)]


def test_cancel_before_anything_refuses_the_finish() -> None:
    tx = make()
    assert tx.handle(CancelArrived(D1, "cmpl-z-0-dddddddd"), 0.0) == []  # D's own id
    out = tx.handle(finish("cmpl-z-0-aaaaaaaa"), 1.0)
    assert calm(out) == [("failed", "s1", "cmpl-z-0-aaaaaaaa", TRANSFER)]
    assert "cancelled" in reason(out)
    assert_empty(tx)


def test_cancel_from_another_peer_is_rejected() -> None:
    tx = make()
    matched(tx, "r1", "d1", 0.0, agent=D1)
    out = tx.handle(CancelArrived(D2, "r1"), 1.0)
    assert calm(out) == [] and logs(out) == ["notif_rejected"]
    assert tx.counters["notifs_rejected"] == 1
    assert state(tx, "r1") is S.MATCHED
    tx.handle(registered("d2", "r2", agent=D1), 1.0)
    assert calm(tx.handle(CancelArrived(D2, "r2"), 1.1)) == []
    assert state(tx, "r2") is S.AWAITING


# ------------------------------------------------------------------ our own stalls


def test_after_a_stall_no_write_until_d_resyncs() -> None:
    tx = make()
    out = tx.handle(Stalled(), 0.0)
    assert calm(out) == [] and logs(out) == ["resync_after_stall"]
    matched(tx, "r1", "d1", 0.0)
    matched(tx, "r2", "d2", 0.0)
    out = tx.handle(ViewResolved("r1", VIEW), 0.5)
    assert out == [Notify(D1, wire.Resync(1))]
    assert state(tx, "r1") is S.MATCHED and "r1" in tx.leases  # not claimed yet
    assert tx.next_deadline() == 0.5 + RESYNC
    assert tx.handle(ViewResolved("r2", VIEW), 0.6) == []  # one Resync per peer
    # an unknown nonce, or the right one from another peer, covers nothing
    for ev in (ResyncAcked(D1, 2), ResyncAcked(D2, 1)):
        out = tx.handle(ev, 0.7)
        assert calm(out) == [] and logs(out) == ["notif_rejected"]
    assert {state(tx, "r1"), state(tx, "r2")} == {S.MATCHED}
    out = tx.handle(ResyncAcked(D1, 1), 0.8)
    assert [(type(e), e.key) for e in out if isinstance(e, PostWrite)] == [
        (PostWrite, "r1"),
        (PostWrite, "r2"),
    ]
    assert calm(out) == out
    assert tx.next_deadline() is None
    # D1 is in sync now: a new request to it writes at once; D2 must re-sync first
    matched(tx, "r3", "d3", 1.0)
    assert [type(e) for e in tx.handle(ViewResolved("r3", VIEW), 1.0)] == [PostWrite]
    matched(tx, "r4", "d4", 1.0, agent=D2)
    assert tx.handle(ViewResolved("r4", VIEW), 1.0) == [Notify(D2, wire.Resync(2))]
    assert logs(tx.handle(ResyncAcked(D1, 1), 1.1)) == ["notif_rejected"]  # the old ack again
    assert state(tx, "r4") is S.MATCHED


def test_an_ack_for_an_older_stall_does_not_cover_a_newer_one() -> None:
    tx = make()
    tx.handle(Stalled(), 0.0)
    matched(tx, "r1", "d1", 0.0)
    assert tx.handle(ViewResolved("r1", VIEW), 0.1) == [Notify(D1, wire.Resync(1))]
    tx.handle(Stalled(), 0.2)  # D's cancels during this stall are not behind ack 1
    assert tx.handle(ResyncAcked(D1, 1), 0.3) == [Notify(D1, wire.Resync(2))]
    assert state(tx, "r1") is S.MATCHED
    assert tx.next_deadline() == 0.3 + RESYNC
    out = tx.handle(ResyncAcked(D1, 2), 0.4)
    assert [type(e) for e in out] == [PostWrite]


def test_resync_that_never_comes_fails_what_waits_for_it() -> None:
    tx = make()
    tx.handle(Stalled(), 0.0)
    matched(tx, "r1", "d1", 0.0)
    matched(tx, "r2", "d2", 0.0, agent=D2)
    tx.handle(ViewResolved("r1", VIEW), 0.5)
    tx.handle(ViewResolved("r2", VIEW), 0.5)
    assert tx.handle_timer(0.5 + RESYNC - 0.01) == []
    out = tx.handle_timer(0.5 + RESYNC)
    assert Counter(calm(out)) == Counter(
        [
            ("failed", "s1", "r1", TRANSFER),
            ("push_done", D1, "d1", TRANSFER),
            ("failed", "s1", "r2", TRANSFER),
            ("push_done", D2, "d2", TRANSFER),
        ]
    )
    assert tx.counters["resyncs_failed"] == 2
    assert_empty(tx)
    assert logs(tx.handle(ResyncAcked(D1, 1), 6.0)) == ["notif_rejected"]  # too late


def test_a_cancel_ahead_of_the_ack_is_honoured() -> None:
    """The point of re-syncing: D's cancel sent while we could not hear it arrives before
    the ack, and the registration it withdrew is never written."""
    tx = make()
    tx.handle(Stalled(), 0.0)
    matched(tx, "r1", "d1", 0.0)
    tx.handle(ViewResolved("r1", VIEW), 0.1)
    tx.handle(CancelArrived(D1, "r1"), 0.2)
    assert tx.handle(ResyncAcked(D1, 1), 0.3) == []
    assert_empty(tx)


def test_no_resync_without_a_stall() -> None:
    tx = make()
    writing(tx, "r1", "d1", 0.0)
    assert tx.resyncing == {} and tx.counters.get("stall_resyncs", 0) == 0


# ------------------------------------------------------------------ tombstones


def test_late_messages_for_a_delivered_request_never_revive_it() -> None:
    tx = make()
    writing(tx, "r1", "d1", 0.0)
    tx.handle(WriteDone("r1"), 0.5)
    late: list[tuple[Event, list[Norm]]] = [
        (registered("d1", "r1"), [("push_done", D1, "d1", INVALID)]),
        (pulled("r1", "d1"), [("pull_ack", D1, "d1", False, INVALID)]),
        (HeartbeatArrived(D1, ("r1",)), []),
        (ViewResolved("r1", VIEW), []),
        (AbortSend("r1", "s1"), []),
        # D, holding its blocks, would be released: nothing of it is in flight
        (CancelArrived(D1, "r1"), [("push_done", D1, "d1", NOT_FOUND)]),
        (CancelArrived(D1, "r1"), [("push_done", D1, "d1", TRANSFER)]),
    ]
    for ev, want in late:
        assert calm(tx.handle(ev, 1.0)) == want, ev
        assert_empty(tx)
    assert tx.handle_timer(1000.0) == []


def test_late_messages_for_an_expired_request() -> None:
    tx = make()
    tx.handle(finish("cmpl-e-0-aaaaaaaa"), 0.0)
    tx.handle_timer(LEASE)
    # an expiry is found by D's own id too (the same request under the other engine's id)
    out = tx.handle(registered("cmpl-e-0-dddddddd"), LEASE + 1)
    assert calm(out) == [("push_done", D1, "cmpl-e-0-dddddddd", LEASE_EXPIRED)]
    out = tx.handle(pulled("cmpl-e-0-aaaaaaaa", "d1"), LEASE + 1)
    assert calm(out) == [("pull_ack", D1, "d1", False, LEASE_EXPIRED)]
    assert_empty(tx)


def test_a_delivered_requests_fate_is_found_by_its_exact_id_only() -> None:
    tx = make()
    tx.handle(finish("cmpl-d-0-aaaaaaaa"), 0.0)
    tx.handle(pulled("cmpl-d-0-aaaaaaaa", "d1"), 0.5)
    out = tx.handle(registered("d2", "cmpl-d-0-aaaaaaaa"), 1.0)  # its exact id: answered
    assert out == [
        Notify(D1, wire.PushDone("d2", 0, False, INVALID, "the request was already delivered"))
    ]
    # a new request whose id shares the base is not answered with the old one's fate
    assert tx.handle(registered("cmpl-d-0-bbbbbbbb"), 1.0) == []
    assert state(tx, "cmpl-d-0-bbbbbbbb") is S.AWAITING


def test_tombstones_are_bounded_oldest_forgotten_first() -> None:
    tx = make(max_tombstones=2)
    for rid in ("cmpl-a-0-aaaaaaaa", "cmpl-b-0-aaaaaaaa", "cmpl-c-0-aaaaaaaa"):
        tx.handle(finish(rid), 0.0)
        tx.handle(AbortSend(rid, "s1"), 0.0)
    assert list(tx.tombstones) == ["cmpl-b-0-aaaaaaaa", "cmpl-c-0-aaaaaaaa"]
    assert set(tx._tomb_base) == {"cmpl-b-0", "cmpl-c-0"}
    # the forgotten one is not answered any more: a late registration waits as if new
    assert tx.handle(registered("cmpl-a-0-dddddddd"), 1.0) == []
    assert state(tx, "cmpl-a-0-dddddddd") is S.AWAITING
    out = tx.handle(registered("cmpl-b-0-dddddddd"), 1.0)
    assert calm(out) == [("push_done", D1, "cmpl-b-0-dddddddd", NOT_FOUND)]

    tx = make(max_tombstones=0)
    tx.handle(finish("r1"), 0.0)
    tx.handle(AbortSend("r1", "s1"), 0.0)
    assert len(tx.tombstones) == 0
    assert tx.handle(registered("d1", "r1"), 1.0) == []  # remembers nothing


def test_a_cancel_is_never_forgotten_by_a_later_tombstone() -> None:
    tx = make()
    tx.handle(CancelArrived(D1, "r1"), 0.0)
    tx.handle(AbortSend("r1", "s1"), 0.1)  # buried again, as aborted
    assert tx.tombstones["r1"].refuses_finish
    out = tx.handle(finish("r1"), 0.2)
    assert calm(out) == [("failed", "s1", "r1", NOT_FOUND)]
    assert_empty(tx)


# ------------------------------------------------------------------ sessions


def test_end_session_ends_what_it_owns_once_and_waits_for_writes() -> None:
    tx = make()
    tx.handle(finish("held"), 0.0)
    matched(tx, "matched", "d-m", 0.0)
    writing(tx, "writing", "d-w", 0.0)
    tx.handle(registered("d-wait", "waiting", p_session="s1"), 0.0)
    tx.handle(pulled("waiting2", "d-wait2", p_session="s1"), 0.0)
    tx.handle(registered("d-other", "other", p_session="s2"), 0.0)
    tx.handle(registered("d-anon", "anon"), 0.0)
    tx.handle(finish("theirs", session="s2"), 0.0)
    tx.moves.clear()

    out = tx.handle(EndSession("s1"), 1.0)
    # the engine is gone: nobody to tell; D's registration is answered, and so is what
    # waits for this session to finish it (it never will: a finish still queued in the
    # frozen engine's socket is refused with the session)
    assert calm(out) == [
        ("push_done", D1, "d-wait", TRANSFER),
        ("pull_ack", D1, "d-wait2", False, TRANSFER),
        ("push_done", D1, "d-m", TRANSFER),
    ]
    assert {k: r.state for k, r in tx.reqs.items()} == {
        "writing": S.WRITING,
        "other": S.AWAITING,  # another session's, or nobody's in particular: they wait
        "anon": S.AWAITING,
        "theirs": S.HELD,
    }
    assert tx.closing == {"s1"}
    assert [(r.key, f, t) for r, f, t in tx.moves] == [
        ("waiting", S.AWAITING, S.FAILED),
        ("waiting2", S.AWAITING, S.FAILED),
        ("held", S.HELD, S.ABORTED),
        ("matched", S.MATCHED, S.ABORTED),
    ]
    assert tx.handle(ViewResolved("matched", VIEW), 1.1) == []  # no WRITE after its end
    # D's late word about what the session owned is answered at once
    out = tx.handle(registered("d-h", "held"), 1.1)
    assert calm(out) == [("push_done", D1, "d-h", TRANSFER)]
    assert tx.handle(AbortSend("held", "s1"), 1.1) == []  # ended once

    out = tx.handle(WriteDone("writing"), 1.2)
    assert out == [Emit("s1", ENGINE, wire.SendFinished("writing")), SessionEnded("s1")]
    assert tx.closing == set()
    # and so is anything naming the ended session as the one to finish it
    out = tx.handle(registered("d-x", "never", p_session="s1"), 2.0)
    assert calm(out) == [("push_done", D1, "d-x", TRANSFER)]
    out = tx.handle(pulled("never2", "d-y", p_session="s1"), 2.0)
    assert calm(out) == [("pull_ack", D1, "d-y", False, TRANSFER)]
    assert set(tx.reqs) == {"other", "anon", "theirs"}


def test_end_session_without_requests_answers_at_once() -> None:
    tx = make()
    tx.handle(finish("theirs", session="s2"), 0.0)
    assert tx.handle(EndSession("s1"), 0.0) == [SessionEnded("s1")]
    assert tx.handle(EndSession("s1"), 0.1) == [SessionEnded("s1")]  # each close is answered
    assert state(tx, "theirs") is S.HELD and tx.closing == set()


def test_ended_sessions_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sender_module, "ENDED_SESSIONS", 2)
    tx = make()
    for s in ("s1", "s2", "s3"):
        tx.handle(EndSession(s), 0.0)
    assert list(tx.ended_sessions) == ["s2", "s3"]
    assert tx.handle(registered("d1", "r1", p_session="s1"), 1.0) == []  # forgotten: waits
    out = tx.handle(registered("d2", "r2", p_session="s3"), 1.0)
    assert calm(out) == [("push_done", D1, "d2", TRANSFER)]


# ------------------------------------------------------------------ bad input


def test_a_second_finish_is_refused_and_changes_nothing() -> None:
    tx = make()
    tx.handle(finish("held"), 0.0)
    matched(tx, "matched", "d-m", 0.0)
    writing(tx, "writing", "d-w", 0.0)
    tx.handle(HeartbeatArrived(D1, ("held",)), 3.0)
    before = {k: (r.state, r.session, r.blocks, r.agent) for k, r in tx.reqs.items()}
    leases = {lease.request_id: lease.deadline for lease in tx.leases.leases()}
    for rid in before:
        with pytest.raises(InvalidRequest, match="already holds a lease"):
            tx.handle(finish(rid, blocks=(1,), session="s2"), 4.0)
    assert {k: (r.state, r.session, r.blocks, r.agent) for k, r in tx.reqs.items()} == before
    assert {lease.request_id: lease.deadline for lease in tx.leases.leases()} == leases


def test_a_second_registration_is_answered_and_the_first_goes_on() -> None:
    tx = make()
    tx.handle(registered("d1", "a", agent=D1), 0.0)
    matched(tx, "m", "d-m", 0.0)
    writing(tx, "w", "d-w", 0.0)
    for rid in ("a", "m", "w"):
        # from another peer: the request is bound to D1 (AUTH); from D1 itself: INVALID
        out = tx.handle(registered("d-dup", rid, agent=D2), 0.5)
        assert calm(out) == [("push_done", D2, "d-dup", AUTH)]
        assert logs(out) == ["notif_rejected"]
        out = tx.handle(registered("d-dup", rid, agent=D1), 0.6)
        assert calm(out) == [("push_done", D1, "d-dup", INVALID)]
        assert logs(out) == ["notif_rejected"]
    assert {k: (r.state, r.agent) for k, r in tx.reqs.items()} == {
        "a": (S.AWAITING, D1),
        "m": (S.MATCHED, D1),
        "w": (S.WRITING, D1),
    }


def test_answers_naming_nothing_live_change_nothing() -> None:
    tx = make()
    assert tx.handle(ViewResolved("ghost", VIEW), 0.0) == []
    assert tx.handle(HeartbeatArrived(D1, ("ghost", "ghost2")), 0.0) == []
    assert tx.counters["heartbeat_unknown_ids"] == 2
    assert logs(tx.handle(ResyncAcked(D1, 7), 0.0)) == ["notif_rejected"]
    assert tx.handle(RegionsChanged({}), 0.0) == []
    assert_empty(tx)


# ------------------------------------------------------------------ the old push matcher's
# scenarios (kvd/core/matching.py, which the Sender replaced), on the Sender itself


def test_matching_registration_then_finished() -> None:
    tx = make()
    assert tx.handle(registered("d1", "r1"), 0.0) == []
    assert tx.by_state()["awaiting"] == 1
    assert [type(e) for e in tx.handle(finish("r1"), 1.0)] == [ResolveView]
    assert tx.by_state() == {"awaiting": 0, "held": 0, "matched": 1, "writing": 0, "streaming": 0}


def test_matching_finished_then_registration() -> None:
    tx = make()
    tx.handle(finish("r1"), 0.0)
    assert [r.key for r in tx.held()] == ["r1"]  # an unmatched finish
    assert [type(e) for e in tx.handle(registered("d1", "r1"), 1.0)] == [ResolveView]
    assert tx.by_state() == {"awaiting": 0, "held": 0, "matched": 1, "writing": 0, "streaming": 0}


def test_matching_base_id_fallback_both_orders() -> None:
    tx = make()
    ev = registered("cmpl-x-0-1a2b3c4d")
    assert tx.handle(ev, 0.0) == []
    assert tx.handle(finish("cmpl-x-0-deadbeef"), 0.0) == [
        ResolveView("cmpl-x-0-deadbeef", D1, ev.msg)
    ]
    assert tx.handle(finish("cmpl-y-0"), 0.0) == []  # an id with no suffix is its own base
    ev = registered("cmpl-y-0-00000000")
    assert tx.handle(ev, 0.0) == [ResolveView("cmpl-y-0", D1, ev.msg)]
    assert tx.by_state() == {"awaiting": 0, "held": 0, "matched": 2, "writing": 0, "streaming": 0}
    check_index(tx)


def test_matching_exact_id_preferred_over_base() -> None:
    tx = make()
    tx.handle(finish("q-0-11111111"), 0.0)
    tx.handle(finish("q-0-22222222"), 0.0)
    (view,) = tx.handle(registered("d2", "q-0-22222222"), 0.0)
    assert isinstance(view, ResolveView) and view.key == "q-0-22222222"
    (view,) = tx.handle(registered("q-0-33333333"), 0.0)
    assert isinstance(view, ResolveView) and view.key == "q-0-11111111"


def test_matching_base_fallback_takes_the_oldest_live_request_whatever_its_state() -> None:
    """Differs from the old matcher on purpose: that one searched only the finished notices
    not yet matched, so a registration naming neither of two siblings exactly went to the
    unmatched one. The Sender looks up one live request per id (exact, else the oldest
    sharing its base id) and lets that request's state decide: a registration for it while
    it is matched is a duplicate, refused, even though a younger sibling is still held."""
    tx = make()
    tx.handle(finish("q-0-11111111"), 0.0)
    tx.handle(finish("q-0-22222222"), 0.0)
    tx.handle(registered("d1", "q-0-11111111"), 0.0)
    out = tx.handle(registered("q-0-33333333"), 0.0)
    assert calm(out) == [("push_done", D1, "q-0-33333333", INVALID)]
    assert state(tx, "q-0-22222222") is S.HELD


def test_matching_no_match_for_a_different_base() -> None:
    tx = make()
    tx.handle(registered("a-0-11111111"), 0.0)
    assert tx.handle(finish("a-1-11111111"), 0.0) == []
    assert {k: r.state for k, r in tx.reqs.items()} == {
        "a-0-11111111": S.AWAITING,
        "a-1-11111111": S.HELD,
    }


def test_matching_duplicates() -> None:
    """The matcher raised on a duplicate registration or finish. The Sender raises on a
    second finish (the caller's fault: the actor answers the engine with the error), but a
    duplicate registration comes from a peer: a different one is answered (PushDone
    failed) and counted, and the first goes on; the same one again from the same D (which
    repeats a registration it has no answer to: the first may have been lost) is only
    counted."""
    tx = make()
    tx.handle(registered("d1", "r"), 0.0)
    assert tx.handle(registered("d1", "r"), 0.0) == []
    assert tx.counters["registrations_repeated"] == 1
    out = tx.handle(registered("d1", "r", blocks=(7, 9)), 0.0)
    assert calm(out) == [("push_done", D1, "d1", INVALID)]
    out = tx.handle(registered("d1", "r", agent=D2), 0.0)
    assert calm(out) == [("push_done", D2, "d1", AUTH)]
    tx.handle(finish("s"), 0.0)
    with pytest.raises(InvalidRequest, match="'s'"):
        tx.handle(finish("s"), 0.0)
    assert {k: r.state for k, r in tx.reqs.items()} == {"r": S.AWAITING, "s": S.HELD}


def test_matching_removal_keeps_the_index_consistent() -> None:
    """The matcher's removals are a cancel (D withdraws its registration) and an abort (P's
    engine gives up) here. One difference: two registrations sharing a base id cannot both
    wait (the second finds the first by base id: a duplicate)."""
    tx = make()
    tx.handle(registered("z-0-11111111"), 0.0)
    out = tx.handle(registered("z-0-22222222"), 0.0)
    assert calm(out) == [("push_done", D1, "z-0-22222222", INVALID)]
    assert calm(tx.handle(CancelArrived(D1, "z-0-11111111"), 0.0)) == [
        ("push_done", D1, "z-0-11111111", TRANSFER)
    ]
    # gone already: a cancel again (D holding its blocks until P's word) is answered from
    # the tombstone, since nothing of it can be in flight
    assert calm(tx.handle(CancelArrived(D1, "z-0-11111111"), 0.0)) == [
        ("push_done", D1, "z-0-11111111", TRANSFER)
    ]
    check_index(tx)
    assert tx.reqs == {}
    # the cancel is remembered (by base id): a finish of the same request ends at once
    assert calm(tx.handle(finish("z-0"), 0.0)) == [("failed", "s1", "z-0", TRANSFER)]

    tx = make()
    ev = registered("z-0-22222222")
    tx.handle(ev, 0.0)
    assert tx.handle(finish("z-0"), 0.0) == [ResolveView("z-0", D1, ev.msg)]
    assert tx.handle(finish("z-0-33333333"), 0.0) == []  # nothing left to match: held
    check_index(tx)
    assert calm(tx.handle(AbortSend("z-0-33333333", "s1"), 0.0)) == [
        ("failed", "s1", "z-0-33333333", TRANSFER)
    ]
    assert tx.handle(AbortSend("z-0-33333333", "s1"), 0.0) == []
    check_index(tx)
    assert list(tx.reqs) == ["z-0"]


def test_matching_unmatched_registrations_expire_in_arrival_order() -> None:
    """The matcher's `registrations_older_than` fed a watchdog; the Sender times each
    registration out itself, `registration_timeout` after it arrived, earliest first, also
    when arrivals were stamped out of order."""
    tx = make(lease_duration=2 * REG)  # D's silence is judged only after the waits
    for i in range(5):
        tx.handle(registered(f"d{i}", f"r{i}"), float(i))
    tx.handle(CancelArrived(D1, "r1"), 4.0)
    assert tx.handle_timer(REG - 0.5) == []
    out = tx.handle_timer(REG + 2.0)
    assert calm(out) == [("push_done", D1, "d0", TIMEOUT), ("push_done", D1, "d2", TIMEOUT)]
    tx.handle(registered("d-late", "late-stamped"), 0.5)  # time went backwards: still correct
    out = tx.handle_timer(REG + 3.0)
    assert calm(out) == [
        ("push_done", D1, "d-late", TIMEOUT),
        ("push_done", D1, "d3", TIMEOUT),
    ]
    assert set(tx.reqs) == {"r4"}


def test_matching_find_exact_then_base() -> None:
    tx = make()
    tx.handle(registered("cmpl-1-0-aaaaaaaa"), 0.0)
    found = tx._find("cmpl-1-0-aaaaaaaa")
    assert found is not None and found.key == "cmpl-1-0-aaaaaaaa"
    found = tx._find("cmpl-1-0-bbbbbbbb")
    assert found is not None and found.key == "cmpl-1-0-aaaaaaaa"
    assert tx._find("cmpl-2-0-bbbbbbbb") is None


def test_matching_random_against_a_model() -> None:
    """The matcher's random test, on the Sender: registrations naming P's id, finishes,
    cancels and aborts over ids that share base ids. The model: one live request per id
    found exactly, else the oldest live one sharing its base id (tombstones off, so only
    matching is at stake; nothing ever resolves or expires)."""
    rng = random.Random(11)
    tx = make(max_tombstones=0)
    live: dict[str, SendState] = {}
    ids = [f"b{i}" for i in range(4)] + [f"b{i}-{j:08x}" for i in range(4) for j in range(3)]

    def find(rid: str) -> str | None:
        if rid in live:
            return rid
        return next((k for k in live if base_request_id(k) == base_request_id(rid)), None)

    for step in range(4000):
        rid = rng.choice(ids)
        op = rng.random()
        want: list[Norm] = []
        ev: Event
        if op < 0.35:
            ev = arrival = registered(f"d{step}", rid)
            found = find(rid)
            if found is None:
                live[rid] = S.AWAITING
            elif live[found] is S.HELD:
                live[found] = S.MATCHED
                want = [ResolveView(found, D1, arrival.msg)]
            else:
                want = [("push_done", D1, f"d{step}", INVALID)]
        elif op < 0.7:
            ev = finish(rid)
            if rid in live and live[rid] is not S.AWAITING:
                with pytest.raises(InvalidRequest):
                    tx.handle(ev, 0.0)
                continue
            found = find(rid)
            if found is not None and live[found] is S.AWAITING:
                del live[found]  # it comes back under P's id
                live[rid] = S.MATCHED
                want = [("resolve", rid)]
            else:
                live[rid] = S.HELD
        elif op < 0.85:
            ev = CancelArrived(D1, rid)
            found = find(rid)
            if found is not None:
                was = live.pop(found)
                if was is not S.AWAITING:
                    want.append(("failed", "s1", found, TRANSFER))
                if was is not S.HELD:
                    want.append(("push_done", D1, "?", TRANSFER))
        else:
            ev = AbortSend(rid, "s1")
            found = rid if rid in live else find(rid)
            if found is not None and (found == rid or live[found] is S.AWAITING):
                was = live.pop(found)
                if was is not S.AWAITING:
                    want.append(("failed", "s1", found, TRANSFER))
                if was is not S.HELD:
                    want.append(("push_done", D1, "?", NOT_FOUND))
        got: list[Norm] = []
        for eff in calm(tx.handle(ev, 0.0)):
            if isinstance(eff, ResolveView) and want and want[0] == ("resolve", eff.key):
                got.append(("resolve", eff.key))  # its registration is the one that waited
            elif isinstance(eff, tuple) and eff[0] == "push_done" and op >= 0.7:
                got.append((*eff[:2], "?", eff[3]))  # answered under D's id, whichever waited
            else:
                got.append(eff)
        assert Counter(got) == Counter(want), (step, ev, got, want)
        assert {k: r.state for k, r in tx.reqs.items()} == live
        assert list(tx.reqs) == list(live)
        check_index(tx)


# ------------------------------------------------------------------ model-based

LETTERS: Final = ("a", "b")
"""Requests are named by a letter and a round: `a0`, then `a1` once the engine is done with
`a0`, and so on. An id of an earlier round is a late message for an ended request."""
SLOTS: Final = ("s0", "s1")
"""Client sessions: a slot's session that ended is replaced by a new one (`s0.0`, `s0.1`)."""
P_SESSIONS: Final = ("", "s0.0", "s1.0", "s0.1")
"""What D names as P's session in its messages ("" = unknown)."""
AGENT_LIST: Final = (D1, D2)
BOGUS_NONCE: Final = 10**9


def p_of(base: str) -> str:
    """P's id for the request with this base id."""
    return f"{base}-0-aaaaaaaa"


def d_of(base: str) -> str:
    """D's id for the same request (another engine's random suffix)."""
    return f"{base}-0-dddddddd"


def base_of(rid: str) -> str:
    """The request (`a0`, `b3`, ...) an id of `p_of` or `d_of` belongs to."""
    return rid.split("-", 1)[0]


@dataclass(frozen=True)
class MTomb:
    """The reference's tombstone: the code late messages get, whether it refuses a finish,
    and whether an id sharing the base id finds it."""

    code: int
    refuses: bool = False
    by_base: bool = True
    d_rid: str = ""
    agent: str = ""
    """The D registration it ended with (a later cancel names D's id in its answer)."""
    settled: bool = True
    """Nothing of it can be in flight: a later cancel is answered."""


M_EXPIRED: Final = MTomb(LEASE_EXPIRED)
M_CANCELLED: Final = MTomb(TRANSFER, refuses=True)
M_ABORTED: Final = MTomb(NOT_FOUND)
M_GONE: Final = MTomb(TRANSFER)
M_DONE: Final = MTomb(INVALID, by_base=False)


@dataclass
class MReq:
    """The reference model's view of one P request (at most one live per base id here)."""

    base: str
    key: str
    state: SendState
    agent: str = ""
    session: str = ""
    blocks: tuple[int, ...] = ()
    reg: wire.PushRegistration | None = None
    pull: wire.PullDone | None = None
    view: str = ""
    view_ready: bool = False
    lease: float | None = None
    wait: float | None = None
    stream: MStream | None = None
    wait_seq: int = 0
    unsettled: float | None = None
    """WRITING: its WRITE was answered Unsettled; P's engine is answered at this time."""
    heard: float = 0.0
    """AWAITING a registration: when D last showed it still waits for it."""
    look: float | None = None
    """AWAITING a registration: when the machine looks at it next (its wait's end, or a
    lease after D was last heard when it was last looked at: a heartbeat moves no timer)."""


NL: Final = 3
"""Layers of the engine in the model (one rank)."""
STREAM_BLOCKS: Final = (10, 11, 12)
"""What P's worker names; P's engine finishes with 10, 11, ... (as many as it has)."""


@dataclass
class MStream:
    """The reference's layer-wise push (one rank)."""

    blocks: tuple[int, ...]
    saved: int = 0
    posted: int = 0
    written: int = 0
    in_flight: int = 0
    finished: bool = False
    ending: tuple[SendState, MTomb, tuple[str, int] | None] | None = None
    """(end state, tombstone, the event for P's session: (kind, code), if any)."""


@dataclass
class MResync:
    nonce: int | None
    epoch: int
    due: float
    seq: int = 0
    """Timers due at the same time fire in the order they were set (the machine's rule)."""


def _streams(r: wire.PushRegistration | None) -> bool:
    """A registration P streams layers for: a push's (a pull by WRITE waits for the finish)."""
    return r is not None and not r.p_block_ids


class SenderModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.tx = make()
        self.now = 0.0
        self.settling: list[str] = []
        """Keys whose WRITE was answered Unsettled and has not settled yet."""
        # the reference
        self.live: dict[str, MReq] = {}
        self.tombs: dict[str, MTomb] = {}
        self.tomb_base: dict[str, str] = {}
        self.ended_sessions: set[str] = set()
        self.closing: set[str] = set()
        self.gens: tuple[int, ...] = ()
        self.epoch = 0
        self.synced: dict[str, int] = {}
        self.resyncing: dict[str, MResync] = {}
        self.expect: list[Norm] = []
        # what the engine and D really did, independent of the reference's states
        self.round = dict.fromkeys(LETTERS, 0)
        self.incarnation = dict.fromkeys(SLOTS, 0)
        self.closed: set[str] = set()
        self.finished: dict[str, str] = {}
        """P's id -> the session that finished it."""
        self.gave_up: set[str] = set()
        """Aborted by the engine before it finished them (it never will)."""
        self.ops: list[ResolveView | PostWrite] = []
        self.views: dict[str, str] = {}
        self.view_seq = 0
        self.registrations: set[tuple[str, wire.PushRegistration]] = set()
        self.d_asked: set[str] = set()
        """The requests D registered for or pulled (it does so once, mostly)."""
        self.write_ok: set[str] = set()
        self.emitted: Counter[str] = Counter()
        self.closed_ends: set[str] = set()
        """Ended by their session's close (no event: the engine is gone)."""
        self.written: set[str] = set()
        self.layers_posted: set[tuple[str, int]] = set()
        self.seq = 0
        self.stalls = 0
        self.region_changes = 0
        self.resync_stalls: dict[int, int] = {}
        """Nonce -> how many stalls there had been when that Resync went out."""
        self.acked_stalls: dict[str, int] = {}
        self.answered: Counter[str] = Counter()
        self.last: dict[int, tuple[SendRequest, SendState]] = {}
        self.ends: Counter[int] = Counter()
        self.ok = True

    def _base(self, letter: str, late: bool) -> str:
        """The current request of `letter`, or (late) the one before it."""
        n = self.round[letter]
        return f"{letter}{max(n - 1, 0) if late else n}"

    def _session(self, slot: str) -> str:
        return f"{slot}.{self.incarnation[slot]}"

    # ------------------------------------------------------------ the reference

    def _find_tomb(self, rid: str) -> MTomb | None:
        tomb = self.tombs.get(rid)
        if tomb is not None:
            return tomb
        exact = self.tomb_base.get(base_request_id(rid))
        return self.tombs.get(exact) if exact is not None else None

    def _bury(self, rid: str, tomb: MTomb) -> None:
        old = self.tombs.pop(rid, None)
        if old is not None and old.refuses:
            tomb = replace(tomb, refuses=True)  # a cancel is never forgotten
        if old is not None and not old.settled:
            tomb = replace(tomb, settled=False)
        if old is not None and old.d_rid and not tomb.d_rid:
            tomb = replace(tomb, d_rid=old.d_rid, agent=old.agent)
        self.tombs[rid] = tomb
        if tomb.by_base:
            self.tomb_base[base_request_id(rid)] = rid

    def _emit(self, m: MReq, kind: str, code: int = 0) -> None:
        if m.session:
            self.expect.append((kind, m.session, m.key, code))

    def _push_failed(self, m: MReq, code: int) -> None:
        if m.reg is not None:
            self.expect.append(("push_done", m.agent, m.reg.request_id, code))

    def _refuse_pull(self, agent: str, msg: wire.PullDone, code: int) -> None:
        self.expect.append(("pull_ack", agent, msg.d_request_id, False, code))

    def _end(self, m: MReq, end: SendState, tomb: MTomb, settled: bool = True) -> None:
        del self.live[m.base]
        m.state = end
        if not settled:
            tomb = replace(tomb, settled=False)
        if m.reg is not None and m.agent:
            tomb = replace(tomb, d_rid=m.reg.request_id, agent=m.agent)
        self._bury(m.key, tomb)
        if m.reg is not None and m.agent and m.reg.request_id != m.key:
            self._bury(m.reg.request_id, tomb)  # a repeated registration names D's id
        s = m.session
        if s in self.closing and not any(x.session == s for x in self.live.values()):
            self.closing.discard(s)
            self.expect.append(SessionEnded(s))

    def _fail_send(self, m: MReq, code: int) -> None:
        self._emit(m, "failed", code)
        self._push_failed(m, code)
        self._end(m, S.FAILED, MTomb(code, by_base=False))

    def _fail_waiting(self, m: MReq, tomb: MTomb, end: SendState) -> None:
        if m.reg is not None:
            self._push_failed(m, tomb.code)
        if m.pull is not None:
            self._refuse_pull(m.agent, m.pull, tomb.code)
        self._end(m, end, tomb)

    def _match(self, m: MReq) -> None:
        assert m.reg is not None
        m.state = S.MATCHED
        if m.reg.p_block_ids and not set(m.reg.p_block_ids) <= set(m.blocks):
            self._fail_send(m, INVALID)  # a pull by WRITE may name only leased blocks
            return
        self.expect.append(ResolveView(m.key, m.agent, m.reg))

    def _deliver_pull(self, m: MReq, agent: str, msg: wire.PullDone) -> None:
        if msg.generations and msg.generations != self.gens:
            self._emit(m, "failed", TRANSFER)
            self._refuse_pull(agent, msg, TRANSFER)
            self._end(m, S.FAILED, MTomb(TRANSFER, by_base=False))
        else:
            self._emit(m, "finished")
            self.expect.append(("pull_ack", agent, msg.d_request_id, True, 0))
            self._end(m, S.DELIVERED, M_DONE)

    def _write_when_synced(self, m: MReq) -> None:
        if self.synced.get(m.agent, 0) < self.epoch:
            if m.agent not in self.resyncing:
                self.seq += 1
                self.resyncing[m.agent] = MResync(None, self.epoch, self.now + RESYNC, self.seq)
                self.expect.append(("resync", m.agent))
            return
        assert m.reg is not None
        m.state, m.lease = S.WRITING, None
        p_blocks = m.reg.p_block_ids or (m.blocks if m.reg.block_ids else ())
        self.expect.append(PostWrite(m.key, m.agent, ENGINE, p_blocks, m.reg, m.view))

    def _matched_ready(self, agent: str) -> list[MReq]:
        return [
            m
            for m in self.live.values()
            if m.state in (S.MATCHED, S.STREAMING) and m.view_ready and m.agent == agent
        ]

    def _synced(self, m: MReq) -> bool:
        if self.synced.get(m.agent, 0) >= self.epoch:
            return True
        if m.agent not in self.resyncing:
            self.seq += 1
            self.resyncing[m.agent] = MResync(None, self.epoch, self.now + RESYNC, self.seq)
            self.expect.append(("resync", m.agent))
        return False

    def _m_stream(self, m: MReq) -> None:
        st_ = m.stream
        assert st_ is not None and m.reg is not None
        if st_.ending is not None or not m.view_ready or st_.saved <= st_.posted:
            return
        if not self._synced(m):
            return
        p_blocks = st_.blocks if m.reg.block_ids else ()
        self.expect.append(
            PostLayers(m.key, m.agent, ENGINE, st_.posted, st_.saved, p_blocks, m.reg, m.view)
        )
        st_.posted = st_.saved
        st_.in_flight += 1

    def _m_settle(self, m: MReq) -> None:
        st_ = m.stream
        assert st_ is not None
        if st_.in_flight:
            return
        if st_.ending is not None:
            end, tomb, event = st_.ending
            if event is not None:
                self._emit(m, event[0], event[1])
            if st_.written < NL:
                self._push_failed(m, tomb.code)
            self._end(m, end, tomb)
        elif st_.finished and st_.written == NL:
            self.write_ok.add(m.key)
            self._emit(m, "finished")
            self._end(m, S.DELIVERED, M_DONE)

    def _m_ending(
        self, m: MReq, end: SendState, tomb: MTomb, event: tuple[str, int] | None
    ) -> None:
        st_ = m.stream
        assert st_ is not None
        if st_.ending is None:
            st_.ending = (end, tomb, event)
        self._m_settle(m)

    def _m_stream_failed(self, m: MReq, code: int) -> None:
        st_ = m.stream
        assert st_ is not None
        event = ("failed", code) if st_.finished else None
        self._m_ending(m, S.FAILED, MTomb(code, by_base=False), event)

    def _timers(self) -> None:
        now = self.now
        for m in list(self.live.values()):
            if m.lease is not None and m.lease <= now:
                self._emit(m, "expired")
                self._push_failed(m, LEASE_EXPIRED)
                self._end(m, S.EXPIRED, M_EXPIRED)
        for m in list(self.live.values()):
            if m.state is S.WRITING and m.unsettled is not None and m.unsettled <= now:
                # P's engine gets its blocks back; D is told nothing (it holds its own)
                self._emit(m, "failed", TIMEOUT)
                self._end(m, S.FAILED, MTomb(TIMEOUT, by_base=False), settled=False)
        for m in list(self.live.values()):
            if m.state is S.AWAITING and m.reg is not None and m.look is not None:
                if m.look > now:
                    continue
                assert m.wait is not None
                if now >= m.wait or now >= m.heard + LEASE:  # timed out, or D silent
                    self._fail_waiting(m, MTomb(TIMEOUT, refuses=True), S.FAILED)
                else:
                    m.look = min(m.wait, m.heard + LEASE)
            elif m.state is S.AWAITING and m.wait is not None and m.wait <= now:
                self._fail_waiting(m, MTomb(NOT_FOUND, refuses=True), S.FAILED)
        # a stream's wait and a re-sync's deadline both touch a stream: in the machine's order
        due: list[tuple[float, int, str, Any]] = [
            (m.wait, m.wait_seq, "wait", m)
            for m in self.live.values()
            if m.state is S.STREAMING and m.wait is not None and m.wait <= now
        ]
        due += [(r.due, r.seq, "resync", a) for a, r in self.resyncing.items() if r.due <= now]
        for _, _, kind, what in sorted(due, key=lambda d: (d[0], d[1])):
            if kind == "wait":
                m = what
                if self.live.get(m.base) is m and m.wait is not None:
                    m.wait = None
                    self._m_ending(m, S.FAILED, MTomb(TIMEOUT, refuses=True), None)
                continue
            agent = what
            del self.resyncing[agent]
            for m in self._matched_ready(agent):
                if m.state is S.STREAMING:
                    self._m_stream_failed(m, TRANSFER)
                else:
                    self._fail_send(m, TRANSFER)

    # ------------------------------------------------------------ driving the machine

    def _run(self, event: Event | None) -> None:
        """Feed `event` (if any) then the timers at the current time, as the actor's loop
        does, and check the machine against the reference."""
        self.ok = False
        self.tx.moves.clear()
        out: list[Effect] = []
        if event is not None:
            out += self.tx.handle(event, self.now)
        out += self.tx.handle_timer(self.now)
        self._timers()
        expected, self.expect = self.expect, []
        got = calm(out)
        assert Counter(got) == Counter(expected), (event, got, expected)
        self._check_moves()
        self._check_effects(out)
        self.ok = True

    def _check_moves(self) -> None:
        for req, frm, to in self.tx.moves:
            prev = self.last.get(id(req))
            if prev is None:
                assert frm in (S.AWAITING, S.HELD), (req.key, frm, to)  # born there
            else:
                assert prev[1] is frm, (req.key, prev[1], frm, to)
            assert to in TRANSITIONS.get(frm, frozenset()), (req.key, frm, to)
            self.last[id(req)] = (req, to)  # holding `req` keeps its id unique
            if to in TERMINAL:
                self.ends[id(req)] += 1
        assert set(self.tx.reqs) == {m.key for m in self.live.values()}
        for m in self.live.values():
            req = self.tx.reqs[m.key]
            assert req.state is m.state, (m.key, req.state, m.state)
            seen = self.last.get(id(req))
            assert seen is None or seen[1] is req.state  # every change went through the table

    def _check_effects(self, effects: list[Effect]) -> None:
        for eff in effects:
            if isinstance(eff, Emit):
                rid = eff.record.request_id  # type: ignore[attr-defined]
                self.emitted[rid] += 1
                assert self.emitted[rid] == 1, f"{rid} ended twice"
                assert rid not in self.closed_ends, f"{rid} ended by its session, then again"
                assert self.finished.get(rid) == eff.session, "an event for what was not finished"
                if isinstance(eff.record, wire.SendFinished):
                    acked = any(
                        isinstance(e, Notify)
                        and isinstance(e.record, wire.PullAck)
                        and e.record.ok
                        and e.record.d_request_id == d_of(base_of(rid))
                        for e in effects
                    )
                    assert rid in self.write_ok or acked, f"{rid} delivered without a transfer"
            elif isinstance(eff, PostWrite):
                key = eff.key
                # never after the request ended towards the engine, never before the match
                assert self.emitted[key] == 0 and key not in self.closed_ends
                assert key in self.finished and key not in self.written
                assert self.tx.reqs[key].state is S.WRITING
                assert (eff.agent, eff.registration) in self.registrations
                assert self.views.get(key) == eff.view
                # never into a D that has not re-synced since our last stall
                assert self.acked_stalls.get(eff.agent, 0) >= self.stalls
                self.written.add(key)
                self.ops.append(eff)
            elif isinstance(eff, ResolveView):
                state = self.tx.reqs[eff.key].state
                assert (state is S.MATCHED and eff.key in self.finished) or state is S.STREAMING
                self.ops.append(eff)
            elif isinstance(eff, PostLayers):
                key = eff.key
                assert self.emitted[key] == 0 and key not in self.closed_ends
                assert self.tx.reqs[key].state is S.STREAMING
                assert (eff.agent, eff.registration) in self.registrations
                assert self.views.get(key) == eff.view
                assert self.acked_stalls.get(eff.agent, 0) >= self.stalls
                assert (key, eff.first) not in self.layers_posted  # each layer once
                self.layers_posted.update((key, n) for n in range(eff.first, eff.end))
                assert 0 <= eff.first < eff.end <= NL
                self.ops.append(eff)
            elif isinstance(eff, SessionEnded):
                self.answered[eff.session] += 1
                assert not any(r.session == eff.session for r in self.tx.reqs.values())
            elif isinstance(eff, Notify) and isinstance(eff.record, wire.Resync):
                pending = self.resyncing[eff.agent]
                assert pending.nonce is None
                pending.nonce = eff.record.nonce
                self.resync_stalls[eff.record.nonce] = self.stalls

    @invariant()
    def structure(self) -> None:
        tx = self.tx
        recount = Counter(r.state.value for r in tx.reqs.values())
        assert tx.by_state() == {s.value: recount[s.value] for s in S if s not in TERMINAL}
        awaiting = [r for r in tx.reqs.values() if r.state is S.AWAITING]
        assert tx.awaiting() == (
            sum(1 for r in awaiting if r.registration is not None),
            sum(1 for r in awaiting if r.early_pull is not None),
        )
        leases = {lease.request_id: lease.deadline for lease in tx.leases.leases()}
        assert leases == {m.key: m.lease for m in self.live.values() if m.lease is not None}
        dues = [m.lease for m in self.live.values() if m.lease is not None]
        dues += [
            m.look if m.state is S.AWAITING and m.reg is not None else m.wait
            for m in self.live.values()
            if m.state in (S.AWAITING, S.STREAMING) and m.wait is not None
        ]
        dues += [r.due for r in self.resyncing.values()]
        dues += [m.unsettled for m in self.live.values() if m.unsettled is not None]
        deadline = tx.next_deadline()
        assert deadline == (min(dues) if dues else None)
        assert deadline is None or deadline > self.now
        assert set(tx.resyncing) == set(self.resyncing)
        assert tx.closing == self.closing
        assert all(n == 1 for n in self.ends.values())
        check_index(tx)

    # ------------------------------------------------------------ P's engine

    @rule(
        letter=st.sampled_from(LETTERS),
        slot=st.sampled_from(SLOTS),
        nblocks=st.sampled_from((3, 3, 1, 0)),
        again=st.sampled_from((False, False, False, True)),
    )
    def p_finishes(self, letter: str, slot: str, nblocks: int, again: bool) -> None:
        if again:
            self._finish_again(letter, slot)
            return
        p = p_of(self._base(letter, False))
        if p in self.finished or p in self.gave_up:
            # an engine finishes a request once, and never one it gave up: the next one
            self.round[letter] += 1
        base, session = self._base(letter, False), self._session(slot)
        p = p_of(base)
        ev = finish(p, tuple(range(10, 10 + nblocks)), session)
        self.finished[p] = session
        m = self.live.get(base)
        tomb = self._find_tomb(p)
        have = m if m is not None and m.key == p else None
        if tomb is not None and tomb.refuses and have is None:
            self.expect.append(("failed", session, p, tomb.code))  # D gave up: ends at once
        elif m is None:
            lease = self.now + LEASE
            self.live[base] = MReq(
                base, p, S.HELD, session=session, blocks=ev.block_ids, lease=lease
            )
        elif m.state is S.STREAMING:
            assert m.stream is not None and m.reg is not None and not m.stream.finished
            m.stream.finished, m.session, m.wait = True, session, None
            if m.stream.ending is not None:
                end, tomb, event = m.stream.ending
                if event is None:
                    m.stream.ending = (end, tomb, ("failed", tomb.code))
                self._m_settle(m)
            elif not ev.block_ids:
                self._m_stream_failed(m, TRANSFER)
            elif ev.block_ids != m.stream.blocks:
                self._m_stream_failed(m, INVALID)
            else:
                m.stream.saved = NL
                self._m_stream(m)
                self._m_settle(m)
        else:
            assert m.state is S.AWAITING  # one P request per base id, finished once
            m.key, m.session, m.blocks = p, session, ev.block_ids
            m.lease, m.wait = self.now + LEASE, None
            if m.pull is not None:
                self._deliver_pull(m, m.agent, m.pull)
            else:
                self._match(m)
        self._run(ev)

    def _finish_again(self, letter: str, slot: str) -> None:
        """Not what an engine does; refused while the request holds its lease."""
        m = self.live.get(self._base(letter, False))
        if m is None or m.state is S.AWAITING or (m.stream is not None and not m.stream.finished):
            return
        before = {k: (r.state, r.session, r.blocks) for k, r in self.tx.reqs.items()}
        with pytest.raises(InvalidRequest):
            self.tx.handle(finish(m.key, (1,), self._session(slot)), self.now)
        assert {k: (r.state, r.session, r.blocks) for k, r in self.tx.reqs.items()} == before

    @rule(
        letter=st.sampled_from(LETTERS),
        slot=st.sampled_from(SLOTS),
        late=st.booleans(),
        early=st.sampled_from((False, False, True)),
    )
    def p_aborts(self, letter: str, slot: str, late: bool, early: bool) -> None:
        base, session = self._base(letter, late), self._session(slot)
        p = p_of(base)
        if p not in self.finished and not early:
            return  # mostly, an engine gives up on what it finished
        m = self.live.get(base)
        if m is not None and m.key == p:
            if m.session and m.session != session:
                pass  # not that session's request
            elif m.state is S.AWAITING:
                self._fail_waiting(m, M_ABORTED, S.ABORTED)
            elif m.state in (S.HELD, S.MATCHED):
                self._emit(m, "failed", TRANSFER)
                self._push_failed(m, NOT_FOUND)
                self._end(m, S.ABORTED, M_ABORTED)
            elif m.state is S.STREAMING:
                assert m.stream is not None
                event = ("failed", TRANSFER) if m.stream.finished else None
                self._m_ending(m, S.ABORTED, M_ABORTED, event)
            # WRITING: the WRITE's outcome answers
        else:
            self._bury(p, M_ABORTED)
            if m is not None and m.state is S.AWAITING:
                self._fail_waiting(m, M_ABORTED, S.ABORTED)
        if p not in self.finished:
            self.gave_up.add(p)
        self._run(AbortSend(p, session))

    @precondition(lambda self: len(self.finished) >= 3 * (len(self.closed) + 1))
    @rule(slot=st.sampled_from(SLOTS))
    def session_ends(self, slot: str) -> None:
        session = self._session(slot)
        self.incarnation[slot] += 1  # the client opens a new one
        self.closed.add(session)
        self.ended_sessions.add(session)
        self.closing.add(session)
        for m in [m for m in self.live.values() if m.state is S.AWAITING]:
            named = m.reg or m.pull  # D named the session that was to finish it
            if named is not None and named.p_session == session:
                self._fail_waiting(m, M_GONE, S.FAILED)
        for m in [m for m in self.live.values() if m.session == session]:
            if m.state in (S.HELD, S.MATCHED):
                self._push_failed(m, TRANSFER)
                self.closed_ends.add(m.key)
                self._end(m, S.ABORTED, M_GONE)
            elif m.state is S.STREAMING:
                assert m.stream is not None
                if m.stream.ending is None:
                    self.closed_ends.add(m.key)
                self._m_ending(m, S.ABORTED, M_GONE, None)
        if session in self.closing and not any(m.session == session for m in self.live.values()):
            self.closing.discard(session)
            self.expect.append(SessionEnded(session))
        self._run(EndSession(session))

    # ------------------------------------------------------------ D

    @rule(
        letter=st.sampled_from(LETTERS),
        late=st.booleans(),
        agent=st.sampled_from(AGENT_LIST),
        named=st.booleans(),
        nblocks=st.sampled_from((0, 1, 2)),
        p_session=st.sampled_from(P_SESSIONS),
        again=st.sampled_from((False, False, False, True)),
        by_write=st.sampled_from(((), (), (), (10, 11), (10,), (12, 99))),
    )
    def d_registers(
        self,
        letter: str,
        late: bool,
        agent: str,
        named: bool,
        nblocks: int,
        p_session: str,
        again: bool,
        by_write: tuple[int, ...],
    ) -> None:
        """D registers for a push, or (`by_write`: the P blocks it was told) pulls by P's
        WRITE where its READ would be emulated: P's blocks it names must be leased."""
        base = self._base(letter, late)
        if base in self.d_asked and not again:
            return
        self.d_asked.add(base)
        p, d = p_of(base), d_of(base)
        blocks = tuple(range(50, 50 + (len(by_write) if by_write else nblocks)))
        msg = reg(d, p if named else "", blocks=blocks, p_session=p_session, p_blocks=by_write)
        self.registrations.add((agent, msg))
        key = p if named else d
        m = self.live.get(base)
        if m is None:
            tomb = self._find_tomb(key) or self._find_tomb(d)
            if tomb is None and p_session in self.ended_sessions:
                tomb = M_GONE
            if tomb is not None and tomb.settled:
                self.expect.append(("push_done", agent, d, tomb.code))
            elif tomb is None:
                wait = self.now + REG
                self.live[base] = MReq(
                    base,
                    key,
                    S.AWAITING,
                    agent=agent,
                    reg=msg,
                    wait=wait,
                    heard=self.now,
                    look=min(wait, self.now + LEASE),
                )
        elif m.agent and m.agent != agent:
            self.expect.append(("push_done", agent, d, AUTH))  # bound to another peer
        elif m.state is S.HELD:
            m.agent, m.reg = agent, msg
            self._match(m)
        elif m.reg != msg:
            self.expect.append(("push_done", agent, d, INVALID))  # a duplicate
        elif m.state is S.AWAITING:
            m.heard = self.now  # a repeat from its D: it still waits
        # (the same registration again from its D in another state: a repeat, ignored)
        self._run(RegistrationArrived(agent, msg))

    @rule(
        letter=st.sampled_from(LETTERS),
        late=st.booleans(),
        agent=st.sampled_from(AGENT_LIST),
        generations=st.sampled_from(((), (1,), (2,))),
        p_session=st.sampled_from(P_SESSIONS),
        again=st.sampled_from((False, False, False, True)),
    )
    def d_pulls(
        self,
        letter: str,
        late: bool,
        agent: str,
        generations: tuple[int, ...],
        p_session: str,
        again: bool,
    ) -> None:
        base = self._base(letter, late)
        if base in self.d_asked and not again:
            return
        self.d_asked.add(base)
        p, d = p_of(base), d_of(base)
        msg = wire.PullDone(p, d, generations, p_session)
        m = self.live.get(base)
        if m is None:
            tomb = self._find_tomb(p)
            if tomb is None and p_session in self.ended_sessions:
                tomb = M_GONE
            if tomb is not None:
                self._refuse_pull(agent, msg, tomb.code)
            else:
                wait = self.now + WAIT
                self.live[base] = MReq(base, p, S.AWAITING, agent=agent, pull=msg, wait=wait)
        elif m.agent and m.agent != agent:
            self._refuse_pull(agent, msg, AUTH)  # bound to another peer
        elif m.state is S.HELD:
            self._deliver_pull(m, agent, msg)
        else:
            self._refuse_pull(agent, msg, INVALID)
        self._run(PullDoneArrived(agent, msg))

    @rule(
        letter=st.sampled_from(LETTERS),
        late=st.booleans(),
        agent=st.sampled_from(AGENT_LIST),
        by_d=st.booleans(),
        early=st.sampled_from((False, False, True)),
    )
    def d_cancels(self, letter: str, late: bool, agent: str, by_d: bool, early: bool) -> None:
        base = self._base(letter, late)
        rid = d_of(base) if by_d else p_of(base)
        m = self.live.get(base)
        if not early and (m is None or m.agent != agent):
            return  # mostly, D cancels what it registered for or pulled
        if m is None:
            tomb = self._find_tomb(rid)
            if tomb is not None and tomb.agent and tomb.agent != agent:
                pass  # another peer's request: rejected
            elif tomb is not None and tomb.settled:
                # nothing of it in flight: D (holding its blocks) gets P's word again
                self.expect.append(("push_done", agent, tomb.d_rid or rid, tomb.code))
                self._bury(rid, M_CANCELLED)
            else:
                self._bury(rid, M_CANCELLED)
        elif m.agent and m.agent != agent:
            pass  # another peer's request: rejected
        elif m.state is S.AWAITING:
            self._fail_waiting(m, M_CANCELLED, S.FAILED)
        elif m.state in (S.HELD, S.MATCHED):
            self._emit(m, "failed", TRANSFER)
            self._push_failed(m, TRANSFER)
            self._end(m, S.FAILED, M_CANCELLED)
        elif m.state is S.STREAMING:
            assert m.stream is not None
            event = ("failed", TRANSFER) if m.stream.finished else None
            self._m_ending(m, S.FAILED, M_CANCELLED, event)
        # WRITING: its PushDone answers D
        self._run(CancelArrived(agent, rid))

    @rule(
        agent=st.sampled_from(AGENT_LIST),
        letters=st.lists(st.sampled_from(LETTERS), max_size=2),
        by_d=st.booleans(),
    )
    def d_heartbeats(self, agent: str, letters: list[str], by_d: bool) -> None:
        bases = [self._base(x, False) for x in letters]
        for b in bases:
            m = self.live.get(b)
            if m is not None and m.state is S.AWAITING and m.reg is not None:
                if m.agent == agent:
                    m.heard = self.now  # D still waits for its registration
            elif m is not None and m.lease is not None:
                if not m.agent:
                    m.agent = agent  # the first peer to speak for a lease holds it
                if m.agent == agent:
                    m.lease = max(m.lease, self.now + EXTENSION)
        ids = tuple(d_of(b) if by_d else p_of(b) for b in bases)
        self._run(HeartbeatArrived(agent, ids))

    @precondition(lambda self: any(r.nonce is not None for r in self.resyncing.values()))
    @rule(i=st.integers(0, 1))
    def d_acks_resync_now(self, i: int) -> None:
        """D answers a Resync promptly (its ack is behind whatever D sent before)."""
        waiting = [a for a, r in self.resyncing.items() if r.nonce is not None]
        self.d_acks_resync(waiting[i % len(waiting)], "pending")

    @rule(agent=st.sampled_from(AGENT_LIST), which=st.sampled_from(("pending", "old", "bogus")))
    def d_acks_resync(self, agent: str, which: str) -> None:
        pending = self.resyncing.get(agent)
        if which == "pending":
            if pending is None or pending.nonce is None:
                return
            nonce = pending.nonce
        elif which == "old":
            old = [n for n in self.resync_stalls if pending is None or n != pending.nonce]
            if not old:
                return
            nonce = old[-1]
        else:
            nonce = BOGUS_NONCE
        if pending is not None and pending.nonce == nonce:
            del self.resyncing[agent]
            self.synced[agent] = pending.epoch
            self.acked_stalls[agent] = self.resync_stalls[nonce]
            for m in self._matched_ready(agent):
                if m.state is S.STREAMING:
                    self._m_stream(m)
                else:
                    self._write_when_synced(m)
        self._run(ResyncAcked(agent, nonce))

    # ------------------------------------------------------------ our own work and state

    def _take(self, kind: type[ResolveView] | type[PostWrite] | type[PostLayers], i: int) -> Any:
        ops = [op for op in self.ops if isinstance(op, kind)]
        op = ops[i % len(ops)]
        self.ops.remove(op)
        return op

    # each outcome has two rules, so that it comes about as soon as the peer's messages do
    @precondition(lambda self: any(isinstance(op, ResolveView) for op in self.ops))
    @rule(i=st.integers(0, 3), ok=st.sampled_from((True, True, False)))
    def view_resolved(self, i: int, ok: bool) -> None:
        self._view_resolved(i, ok)

    @precondition(lambda self: any(isinstance(op, ResolveView) for op in self.ops))
    @rule(i=st.integers(0, 3))
    def view_resolved_ok(self, i: int) -> None:
        self._view_resolved(i, True)

    @precondition(lambda self: any(isinstance(op, PostWrite) for op in self.ops))
    @rule(i=st.integers(0, 3), ok=st.sampled_from((True, True, False)))
    def write_done(self, i: int, ok: bool) -> None:
        self._write_done(i, ok)

    @precondition(lambda self: any(isinstance(op, PostWrite) for op in self.ops))
    @rule(i=st.integers(0, 3))
    def write_done_ok(self, i: int) -> None:
        self._write_done(i, True)

    @precondition(lambda self: any(isinstance(op, PostWrite) for op in self.ops))
    @rule(i=st.integers(0, 3))
    def write_unsettled(self, i: int) -> None:
        """UCX did not end the WRITE within its bound: nothing to anyone until it does."""
        op: PostWrite = self._take(PostWrite, i)
        m = self.live[base_of(op.key)]
        assert m.key == op.key and m.state is S.WRITING
        m.unsettled = self.now + self.tx.unsettled_hold
        self.settling.append(op.key)
        self._run(WriteDone(op.key, Timeout("still in flight"), unsettled=True))

    @precondition(lambda self: bool(self.settling))
    @rule(i=st.integers(0, 3), ok=st.booleans())
    def write_settled(self, i: int, ok: bool) -> None:
        key = self.settling.pop(i % len(self.settling))
        m = self.live.get(base_of(key))
        if m is not None and m.key == key and m.unsettled is not None:
            if ok:  # it landed after all
                self.write_ok.add(m.key)
                self._emit(m, "finished")
                self._end(m, S.DELIVERED, M_DONE)
            else:
                self._fail_send(m, TRANSFER)
        self._run(WriteSettled(key, None if ok else TransferError("endpoint failed")))

    def _view_resolved(self, i: int, ok: bool) -> None:
        op: ResolveView = self._take(ResolveView, i)
        self.view_seq += 1
        view = f"view-{self.view_seq}"
        m = self.live.get(base_of(op.key))
        if m is not None and m.key == op.key and m.state is S.STREAMING and not m.view_ready:
            if ok:
                m.view, m.view_ready = view, True
                self.views[m.key] = view
                self._m_stream(m)
            else:
                self._m_stream_failed(m, INCOMPATIBLE)
        elif m is not None and m.key == op.key and m.state is S.MATCHED and not m.view_ready:
            if ok:
                m.view, m.view_ready = view, True
                self.views[m.key] = view
                self._write_when_synced(m)
            else:
                self._fail_send(m, INCOMPATIBLE)
        err = None if ok else Incompatible("D re-registered")
        self._run(ViewResolved(op.key, view if ok else None, err))

    def _write_done(self, i: int, ok: bool) -> None:
        op: PostWrite = self._take(PostWrite, i)
        m = self.live[base_of(op.key)]  # a WRITE in flight keeps its request alive
        assert m.key == op.key and m.state is S.WRITING
        if ok:
            self.write_ok.add(m.key)
            self._emit(m, "finished")
            self._end(m, S.DELIVERED, M_DONE)
        else:
            self._fail_send(m, TRANSFER)
        self._run(WriteDone(op.key, None if ok else TransferError("WRITE failed")))

    # ------------------------------------------------------------ P's workers (layer-wise)

    @rule(
        letter=st.sampled_from(LETTERS),
        layers=st.integers(1, NL),
        blocks=st.sampled_from((STREAM_BLOCKS, STREAM_BLOCKS, (10, 11, 13))),
        late=st.sampled_from((False, False, True)),
    )
    def p_worker_saves(self, letter: str, layers: int, blocks: tuple[int, ...], late: bool) -> None:
        self._worker_saves(self._base(letter, late), layers, blocks)

    def _worker_saves(self, base: str, layers: int, blocks: tuple[int, ...]) -> None:
        p = p_of(base)
        m = self.live.get(base)
        if m is not None and m.key != p and p in self.tombs:
            pass  # a late notice for P's request that ended: never revives it
        elif m is not None and m.state is S.AWAITING and _streams(m.reg):
            m.key, m.state, m.blocks = p, S.STREAMING, blocks
            m.stream = MStream(blocks, saved=layers)
            self.seq += 1
            m.wait_seq = self.seq
            self.expect.append(ResolveView(p, m.agent, m.reg))
        elif m is not None and m.state is S.STREAMING:
            assert m.stream is not None
            if blocks == m.stream.blocks and layers > m.stream.saved:
                m.stream.saved = layers
                self._m_stream(m)
        self._run(LayersSaved(p, ENGINE, 0, 1, layers, NL, blocks))

    def _streamable(self) -> list[MReq]:
        return [
            m
            for m in self.live.values()
            if (m.state is S.AWAITING and _streams(m.reg)) or m.state is S.STREAMING
        ]

    @precondition(lambda self: bool(self._streamable()))
    @rule(i=st.integers(0, 3), more=st.integers(1, NL))
    def p_worker_saves_next(self, i: int, more: int) -> None:
        """The worker of a request D registered for saves its next layers (the usual case)."""
        ms = self._streamable()
        m = ms[i % len(ms)]
        have = m.stream.saved if m.stream is not None else 0
        blocks = m.stream.blocks if m.stream is not None else STREAM_BLOCKS
        self._worker_saves(m.base, min(NL, have + more), blocks)

    @precondition(lambda self: any(isinstance(op, PostLayers) for op in self.ops))
    @rule(i=st.integers(0, 3), ok=st.sampled_from((True, True, True, False)))
    def layers_written(self, i: int, ok: bool) -> None:
        op: PostLayers = self._take(PostLayers, i)
        m = self.live[base_of(op.key)]  # a WRITE in flight keeps its request alive
        assert m.key == op.key and m.state is S.STREAMING and m.stream is not None
        m.stream.in_flight -= 1
        if ok:
            m.stream.written += op.end - op.first
            self._m_settle(m)
        else:
            self._m_stream_failed(m, TRANSFER)
        err = None if ok else TransferError("WRITE failed")
        self._run(LayersWritten(op.key, op.first, op.end, err))

    @precondition(lambda self: self.stalls + self.region_changes < 5)
    @rule(generation=st.sampled_from((0, 1, 2)))
    def daemon_changes(self, generation: int) -> None:
        """Our daemon stalled (0), or our regions changed generation."""
        if generation == 0:
            self.epoch += 1
            self.stalls += 1
            for m in self.live.values():  # nobody was heard while we were stalled
                if m.state is S.AWAITING and m.reg is not None:
                    m.heard = self.now
            self._run(Stalled())
            return
        self.region_changes += 1
        self.gens = (generation,)
        self._run(RegionsChanged({ENGINE: (generation,)}))

    @rule(dt=st.sampled_from((0.5, 0.5, 1.0, 2.5, 4.5, 21.0)))
    def advance(self, dt: float) -> None:
        self.now += dt
        self._run(None)

    # ------------------------------------------------------------ the end

    def teardown(self) -> None:
        if not self.ok:
            return  # a step failed already: that is the report
        for s in SLOTS:
            self.session_ends(s)
        for _ in range(100):
            if any(isinstance(op, PostWrite) for op in self.ops):
                self.write_done(0, True)
            elif self.settling:
                self.write_settled(0, True)
            elif any(isinstance(op, PostLayers) for op in self.ops):
                self.layers_written(0, True)
            elif self.ops:
                self.view_resolved(0, True)
            elif any(r.nonce is not None for r in self.resyncing.values()):
                self.d_acks_resync_now(0)
            elif self.live or self.resyncing:
                self.advance(21.0)
            else:
                break
        assert not self.live and not self.resyncing
        assert_empty(self.tx)
        assert self.tx.closing == set()
        assert self.answered == Counter(dict.fromkeys(self.closed, 1))
        # every request P's engine finished ended exactly once: an event, or its session's end
        for p in self.finished:
            assert self.emitted[p] + (p in self.closed_ends) == 1, p
        assert set(self.emitted) <= set(self.finished)
        assert all(n == 1 for n in self.ends.values())
        for req, last in self.last.values():
            assert last in TERMINAL, (req.key, last)


SenderModel.TestCase.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)
TestSenderModel = SenderModel.TestCase


# ------------------------------------------------------------------ layer-wise push


def test_layerwise_each_layer_written_at_once_and_finish_only_ends_it() -> None:
    tx = make()
    ev = registered("d1", "r1")
    ev = RegistrationArrived(ev.agent, replace(ev.msg, tp_size=2))
    tx.handle(ev, 0.0)
    out = tx.handle(saved("r1", 1, ranks=2), 0.1)
    assert out == [ResolveView("r1", D1, ev.msg)]  # D's view first
    assert tx.handle(saved("r1", 2, rank=1, ranks=2), 0.2) == []  # no view yet: remembered
    out = tx.handle(ViewResolved("r1", VIEW), 0.3)
    # a layer goes once every rank has it: [0, 1) now
    assert out == [PostLayers("r1", D1, ENGINE, 0, 1, BLOCKS, ev.msg, VIEW)]
    assert posts(tx.handle(saved("r1", 3, ranks=2), 0.4)) == [("r1", 1, 2)]
    assert tx.handle(saved("r1", 2, ranks=2), 0.4) == []  # older news: nothing
    for first, end in ((0, 1), (1, 2)):
        assert calm(tx.handle(LayersWritten("r1", first, end), 0.5)) == []
    assert posts(tx.handle(saved("r1", 4, ranks=2), 0.6)) == []  # rank 1 has only 2
    assert posts(tx.handle(saved("r1", 4, rank=1, ranks=2), 0.6)) == [("r1", 2, 4)]
    assert tx.handle(LayersWritten("r1", 2, 4), 0.7) == []  # D has it all; P not finished
    assert len(tx.leases) == 0 and tx.by_state()["streaming"] == 1
    assert tx.handle(finish("r1"), 0.8) == [Emit("s1", ENGINE, wire.SendFinished("r1"))]
    assert_empty(tx)
    assert tx.counters["sends_layered"] == 1 and tx.counters.get("leases_granted", 0) == 0
    assert [(f, t) for _, f, t in tx.moves] == [
        (S.AWAITING, S.STREAMING),
        (S.STREAMING, S.DELIVERED),
    ]


def test_layerwise_finish_writes_what_no_worker_announced() -> None:
    tx = make()
    streaming(tx, "r1", "d1", 0.0, ranks=2)  # rank 1 saved nothing yet: nothing written
    out = tx.handle(finish("r1"), 1.0)
    assert posts(out) == [("r1", 0, 4)]
    assert tx.next_deadline() is None  # claimed: no lease, no wait
    assert tx.handle(saved("r1", 4, rank=1, ranks=2), 1.1) == []  # a late notice: nothing
    assert calm(tx.handle(LayersWritten("r1", 0, 4), 1.2)) == [("finished", "s1", "r1", 0)]
    assert_empty(tx)


def test_layerwise_a_request_that_cannot_be_cut_goes_whole_at_the_finish() -> None:
    tx = make()
    streaming(tx, "r1", "d1", 0.0)
    out = tx.handle(LayersWritten("r1", 0, 1, unsupported=True), 0.1)
    assert calm(out) == [] and tx.counters["streams_whole"] == 1
    assert tx.handle(saved("r1", 3), 0.2) == []  # no more layer WRITEs
    ev = tx.reqs["r1"].registration
    assert tx.handle(finish("r1"), 0.3) == [PostWrite("r1", D1, ENGINE, BLOCKS, ev, VIEW)]
    assert state(tx, "r1") is S.WRITING
    assert calm(tx.handle(WriteDone("r1"), 0.4)) == [("finished", "s1", "r1", 0)]
    assert_empty(tx)


def test_layerwise_nothing_without_a_registration_and_never_after_a_finish() -> None:
    tx = make()
    assert tx.handle(saved("r1", 1), 0.0) == []  # nobody registered: dropped
    assert tx.counters["layers_unmatched"] == 1 and tx.reqs == {}
    tx.handle(finish("r1"), 0.1)
    assert tx.handle(saved("r1", 2), 0.1) == []  # held: the whole request goes at match
    assert state(tx, "r1") is S.HELD and tx.counters["layers_unmatched"] == 2


def test_layerwise_notice_with_other_blocks_is_refused() -> None:
    tx = make()
    streaming(tx, "r1", "d1", 0.0)
    out = tx.handle(saved("r1", 2, blocks=(10, 11, 13)), 0.1)
    assert calm(out) == [] and logs(out) == ["layers_refused"]


def test_layerwise_finish_with_other_blocks_fails_once_writes_return() -> None:
    tx = make()
    streaming(tx, "r1", "d1", 0.0)
    assert calm(tx.handle(finish("r1", (10, 11, 99)), 0.5)) == []  # a WRITE is in flight
    assert state(tx, "r1") is S.STREAMING
    out = tx.handle(LayersWritten("r1", 0, 1), 0.6)
    assert calm(out) == [("failed", "s1", "r1", INVALID), ("push_done", D1, "d1", INVALID)]
    assert_empty(tx)


@pytest.mark.parametrize("blocks", [(), (10, 11, 12)])
def test_layerwise_empty_finish_fails_it(blocks: tuple[int, ...]) -> None:
    tx = make()
    streaming(tx, "r1", "d1", 0.0)
    tx.handle(LayersWritten("r1", 0, 1), 0.1)
    out = tx.handle(finish("r1", blocks), 0.2)
    if blocks:
        assert posts(out) == [("r1", 1, 4)]
    else:
        assert calm(out) == [("failed", "s1", "r1", TRANSFER), ("push_done", D1, "d1", TRANSFER)]
        assert_empty(tx)


def test_layerwise_abort_mid_stream_waits_for_writes_then_tells_d() -> None:
    tx = make()
    streaming(tx, "r1", "d1", 0.0)
    assert calm(tx.handle(AbortSend("r1", "s1"), 0.1)) == []  # the WRITE still runs
    assert tx.handle(saved("r1", 3), 0.1) == []  # nothing more is written
    out = tx.handle(LayersWritten("r1", 0, 1), 0.2)
    assert calm(out) == [("push_done", D1, "d1", NOT_FOUND)]  # P never finished: no event
    assert_empty(tx)
    # the late finish of an engine that aborted: a lease as for any aborted request
    assert calm(tx.handle(registered("d1", "r1"), 0.3)) == [("push_done", D1, "d1", NOT_FOUND)]


def test_layerwise_abort_after_d_has_everything_tells_d_nothing() -> None:
    tx = make()
    tx.handle(registered("d1", "r1"), 0.0)
    tx.handle(saved("r1", 4), 0.0)
    tx.handle(ViewResolved("r1", VIEW), 0.0)
    tx.handle(LayersWritten("r1", 0, 4), 0.1)
    assert calm(tx.handle(AbortSend("r1", "s1"), 0.2)) == []  # D is done: no contradiction
    assert_empty(tx)


def test_layerwise_cancel_by_d_and_write_failure() -> None:
    tx = make()
    streaming(tx, "r1", "d1", 0.0)
    tx.handle(finish("r1"), 0.1)  # the rest goes now
    out = tx.handle(CancelArrived(D1, "r1"), 0.2)
    assert calm(out) == []  # waits for the WRITEs
    tx.handle(LayersWritten("r1", 0, 1), 0.3)
    out = tx.handle(LayersWritten("r1", 1, 4), 0.3)
    # D's every layer landed before P heard the cancel: D ends by itself, P fails its send
    assert calm(out) == [("failed", "s1", "r1", TRANSFER)]
    assert_empty(tx)
    tx = make()
    streaming(tx, "r2", "d2", 0.0)
    out = tx.handle(LayersWritten("r2", 0, 1, TransferError("gone")), 0.1)
    assert calm(out) == [("push_done", D1, "d2", TRANSFER)]
    assert logs(out) == ["push_failed"]
    assert_empty(tx)


def test_layerwise_write_unsettled_past_its_hold_ends_without_a_word_to_d() -> None:
    """A layer WRITE UCX had not ended within `unsettled_hold` (the actor waited that
    long): it may still land in D's blocks, so D is not told the push failed (it would
    free them), P's engine gets SendFailed once nothing else is in flight, and D's later
    cancel is not answered (D holds its blocks until its own bound)."""
    tx = make()
    streaming(tx, "r1", "d1", 0.0)
    assert posts(tx.handle(finish("r1"), 0.1)) == [("r1", 1, 4)]
    out = tx.handle(LayersWritten("r1", 0, 1, Timeout("still in flight"), unsettled=True), 60.0)
    assert calm(out) == [] and logs(out) == ["write_unsettled_released"]  # [1, 4) in flight
    out = tx.handle(LayersWritten("r1", 1, 4), 60.1)
    assert calm(out) == [("failed", "s1", "r1", TIMEOUT)]  # no PushDone to D
    assert tx.counters["writes_unsettled_released"] == 1
    assert_empty(tx)
    assert calm(tx.handle(CancelArrived(D1, "r1"), 61.0)) == []
    # a stream that had failed already does not tell D either once a WRITE is unsettled
    tx = make()
    streaming(tx, "r2", "d2", 0.0)
    tx.handle(saved("r2", 4), 0.1)
    out = tx.handle(LayersWritten("r2", 1, 4, TransferError("gone")), 0.2)
    assert calm(out) == []  # [0, 1) still in flight: the end waits for it
    out = tx.handle(LayersWritten("r2", 0, 1, Timeout("still in flight"), unsettled=True), 60.0)
    assert calm(out) == []  # P never finished it: no event; and no word to D
    assert_empty(tx)
    assert calm(tx.handle(CancelArrived(D1, "r2"), 61.0)) == []


def test_layerwise_p_engine_that_never_finishes_times_out() -> None:
    tx = make()
    streaming(tx, "r1", "d1", 0.0)
    tx.handle(LayersWritten("r1", 0, 1), 0.1)
    assert tx.next_deadline() == REG
    out = tx.handle_timer(REG)
    assert calm(out) == [("push_done", D1, "d1", TIMEOUT)]
    assert_empty(tx)
    # the finish that comes after all is refused at once
    assert calm(tx.handle(finish("r1"), REG + 1)) == [("failed", "s1", "r1", TIMEOUT)]


def test_layerwise_session_end_ends_a_finished_stream_once_writes_return() -> None:
    tx = make()
    streaming(tx, "r1", "d1", 0.0)
    tx.handle(finish("r1"), 0.1)
    assert calm(tx.handle(EndSession("s1"), 0.2)) == []  # WRITEs in flight
    tx.handle(LayersWritten("r1", 0, 1), 0.3)
    out = tx.handle(LayersWritten("r1", 1, 4), 0.3)
    assert calm(out) == [SessionEnded("s1")]  # every layer landed: D is done, nothing to say
    assert_empty(tx)


def test_layerwise_after_a_stall_no_layer_until_d_resyncs() -> None:
    tx = make()
    tx.handle(Stalled(), 0.0)
    ev = registered("d1", "r1")
    tx.handle(ev, 0.0)
    tx.handle(saved("r1", 2), 0.0)
    assert tx.handle(ViewResolved("r1", VIEW), 0.1) == [Notify(D1, wire.Resync(1))]
    assert tx.handle(saved("r1", 3), 0.2) == []
    assert posts(tx.handle(ResyncAcked(D1, 1), 0.3)) == [("r1", 0, 3)]
    tx = make()
    tx.handle(Stalled(), 0.0)
    tx.handle(registered("d1", "r1"), 0.0)
    tx.handle(saved("r1", 2), 0.0)
    tx.handle(ViewResolved("r1", VIEW), 0.1)
    out = tx.handle_timer(0.1 + RESYNC)
    assert calm(out) == [("push_done", D1, "d1", TRANSFER)]
    assert_empty(tx)


def test_layerwise_view_failure_and_bad_outcomes() -> None:
    tx = make()
    tx.handle(registered("d1", "r1"), 0.0)
    tx.handle(saved("r1", 1), 0.0)
    out = tx.handle(ViewResolved("r1", error=Incompatible("no")), 0.1)
    assert calm(out) == [("push_done", D1, "d1", INCOMPATIBLE)]
    assert_empty(tx)
    with pytest.raises(LocalProtocolError):
        tx.handle(LayersWritten("r1", 0, 1), 0.2)
    # a second registration while streaming is answered, the stream goes on
    streaming(tx, "r2", "d2", 0.0)
    out = tx.handle(registered("d3", "r2"), 0.1)
    assert calm(out) == [("push_done", D1, "d3", INVALID)]
    assert state(tx, "r2") is S.STREAMING
    with pytest.raises(InvalidRequest):  # finished twice
        tx.handle(finish("r2"), 0.2)
        tx.handle(finish("r2"), 0.3)


def test_a_request_naming_another_incarnation_of_this_daemon_is_refused_at_once() -> None:
    """D's engine was told of a lease by P's daemon before a restart (its finish went to
    that daemon, or was lost with it): a registration or pull completion naming that
    incarnation can never be finished here, so it is refused at once instead of waiting
    for a finish (a push registration would wait `registration_timeout`, 480 s by
    default). Naming this incarnation, or none, waits as before; so does a daemon that
    does not know its own incarnation."""
    tx = make(incarnation=0xAAAA)
    old = replace(reg("d-old", "gone"), p_incarnation=0xBBBB)
    out = tx.handle(RegistrationArrived(D1, old), 0.0)
    assert calm(out) == [("push_done", D1, "d-old", TRANSFER)]
    done = out[0]
    assert isinstance(done, Notify) and isinstance(done.record, wire.PushDone)
    assert "restarted" in done.record.reason
    pull = wire.PullDone("gone2", "d-old2", (), "", 0xBBBB)
    out = tx.handle(PullDoneArrived(D1, pull), 0.0)
    assert calm(out) == [("pull_ack", D1, "d-old2", False, TRANSFER)]
    assert tx.counters["requests_of_another_incarnation"] == 2
    assert tx.reqs == {}
    # this incarnation, or none named: the finish may still come
    now = replace(reg("d-now", "coming"), p_incarnation=0xAAAA)
    assert tx.handle(RegistrationArrived(D1, now), 0.0) == []
    assert tx.handle(registered("d-any", "coming2"), 0.0) == []
    assert tx.handle(PullDoneArrived(D1, wire.PullDone("coming3", "d3", (), "", 0xAAAA)), 0.0) == []
    assert state(tx, "coming") is S.AWAITING and state(tx, "coming3") is S.AWAITING
    out = tx.handle(finish("coming"), 0.1)  # and is served as before
    assert state(tx, "coming") is not S.AWAITING
    # a daemon that does not know its own incarnation judges nothing by it
    tx0 = make()
    assert tx0.handle(RegistrationArrived(D1, old), 0.0) == []


# ------------------------------------------------------------------ pulls by WRITE


def by_write(d_rid: str, p_rid: str, p_blocks: tuple[int, ...]) -> RegistrationArrived:
    """D's pull of P's `p_blocks` where UCX would emulate the READ (`kvd.core.readpath`):
    a registration naming them, which P serves by WRITE."""
    ev = registered(d_rid, p_rid)
    return RegistrationArrived(ev.agent, replace(ev.msg, p_block_ids=p_blocks))


@pytest.mark.parametrize("order", ["finished-first", "pull-first"])
def test_a_pull_by_write_sends_the_p_blocks_it_names(order: str) -> None:
    tx = make()
    ev = by_write("d1", "r1", (11, 12))
    if order == "finished-first":
        assert tx.handle(finish("r1"), 0.0) == []
        assert tx.handle(ev, 1.0) == [ResolveView("r1", D1, ev.msg)]
    else:
        assert tx.handle(ev, 0.0) == []
        # P's workers announcing layers do not start a stream: a pull waits for the finish
        assert tx.handle(saved("r1", 1), 0.5) == []
        assert state(tx, "r1") is S.AWAITING and tx.counters["layers_unmatched"] == 1
        assert tx.handle(finish("r1"), 1.0) == [ResolveView("r1", D1, ev.msg)]
    # the named blocks, not every block P finished
    assert tx.handle(ViewResolved("r1", VIEW), 1.5) == [
        PostWrite("r1", D1, ENGINE, (11, 12), ev.msg, VIEW)
    ]
    assert tx.handle(WriteDone("r1", transfers=1), 2.0) == [
        Emit("s1", ENGINE, wire.SendFinished("r1"))
    ]
    assert (tx.counters["pull_registrations"], tx.counters["pulls_written"]) == (1, 1)
    assert tx.counters.get("push_registrations", 0) == 0
    assert_empty(tx)


@pytest.mark.parametrize("order", ["finished-first", "pull-first"])
def test_a_pull_by_write_naming_a_block_p_did_not_lease_fails_closed(order: str) -> None:
    tx = make()
    ev = by_write("d1", "r1", (12, 13))  # 13 is not the request's
    if order == "finished-first":
        tx.handle(finish("r1"), 0.0)
        out = tx.handle(ev, 1.0)
    else:
        tx.handle(ev, 0.0)
        out = tx.handle(finish("r1"), 1.0)
    assert sorted(calm(out), key=str) == [
        ("failed", "s1", "r1", INVALID),
        ("push_done", D1, "d1", INVALID),
    ]
    assert not any(isinstance(e, (ResolveView, PostWrite)) for e in out)
    assert_empty(tx)


def test_kept_blocks_are_pulled_by_write_but_never_pushed() -> None:
    tx = make()
    kept = Finish("r1", ENGINE, BLOCKS, "s1", keep_for=60.0)
    assert tx.handle(kept, 0.0) == []
    out = tx.handle(registered("d1", "r1"), 1.0)  # a push: refused, the lease stays
    assert calm(out) == [("push_done", D1, "d1", INVALID)]
    assert state(tx, "r1") is S.HELD
    ev = by_write("d2", "r1", BLOCKS)
    assert tx.handle(ev, 2.0) == [ResolveView("r1", D1, ev.msg)]
    (post,) = tx.handle(ViewResolved("r1", VIEW), 2.5)
    assert isinstance(post, PostWrite) and post.p_blocks == BLOCKS
    assert tx.handle(WriteDone("r1", transfers=1), 3.0) == [
        Emit("s1", ENGINE, wire.SendFinished("r1"))
    ]
    assert tx.counters["kept_pulled"] == 1
    assert_empty(tx)
