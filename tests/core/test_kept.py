"""Kept requests (bidirectional KV) in the sender machine (`kvd.core.sender`), driven
directly: D's daemon holds a finished request's blocks under a fixed lease
(`Finish.keep_for`) for the next turn's P to pull. No sockets, no sleeps.
"""

from __future__ import annotations

from typing import Final

from kvd_client import wire
from kvd_client.errors import ErrorCode

from kvd.core.effects import Emit, Notify, SessionEnded
from kvd.core.leases import LeaseTable
from kvd.core.sender import (
    EndSession,
    Finish,
    HeartbeatArrived,
    PullDoneArrived,
    RegionsChanged,
    RegistrationArrived,
    SendState,
)

from .test_sender import assert_empty, calm, make, reg

S = SendState
ENGINE: Final = "p-engine"  # the engine whose blocks the daemon holds (D's, here)
P1: Final = "agent-p1"
P2: Final = "agent-p2"
TTL: Final = 100.0
LEASE_EXPIRED: Final = int(ErrorCode.LEASE_EXPIRED)
INVALID: Final = int(ErrorCode.INVALID)
TRANSFER: Final = int(ErrorCode.TRANSFER)


def keep(rid: str, session: str = "s1") -> Finish:
    return Finish(rid, ENGINE, (4, 5), session, keep_for=TTL)


def pull(rid: str, p_rid: str = "next", agent: str = P1) -> PullDoneArrived:
    return PullDoneArrived(agent, wire.PullDone(rid, p_rid, (), ""))


def test_lease_table_fixed_lease_is_never_extended() -> None:
    t = LeaseTable(6.0)
    t.grant("kept", 0.0, fixed_for=TTL)
    t.grant("normal", 0.0)
    assert t.extend(["kept", "normal"], 99.0) == ["kept", "normal"]
    kept, normal = t.get("kept"), t.get("normal")
    assert kept is not None and kept.fixed and kept.deadline == TTL
    assert normal is not None and not normal.fixed and normal.deadline == 99.0 + 4.0
    assert [lease.request_id for lease in t.expire(TTL)] == ["kept"]


def test_kept_request_pulled_by_the_next_turn() -> None:
    tx = make()
    tx.handle(RegionsChanged({ENGINE: (1,)}), 0.0)
    assert tx.handle(keep("d1"), 0.0) == []
    assert tx.reqs["d1"].state is S.HELD and tx.reqs["d1"].kept
    assert tx.next_deadline() == TTL
    out = tx.handle(pull("d1"), 50.0)
    assert out == [
        Emit("s1", ENGINE, wire.SendFinished("d1")),
        Notify(P1, wire.PullAck("next", True, 0, "")),
    ]
    assert (tx.counters["kv_kept"], tx.counters["kept_pulled"]) == (1, 1)
    assert_empty(tx)


def test_heartbeats_do_not_extend_a_kept_lease() -> None:
    tx = make()
    tx.handle(keep("d1"), 0.0)
    for t in range(1, int(TTL)):
        tx.handle(HeartbeatArrived(P1, ("d1",)), float(t))
    assert tx.next_deadline() == TTL
    assert tx.counters["heartbeats_on_kept"] == int(TTL) - 1
    assert tx.handle_timer(TTL - 0.01) == []
    assert calm(tx.handle_timer(TTL)) == [("expired", "s1", "d1", 0)]
    assert tx.counters["kept_expired"] == 1
    assert_empty(tx)
    # the next turn's P pulls too late: refused (it recomputes); D's engine hears nothing more
    assert calm(tx.handle(pull("d1"), TTL + 1)) == [("pull_ack", P1, "next", False, LEASE_EXPIRED)]


def test_a_heartbeat_binds_a_kept_request_to_that_p() -> None:
    tx = make()
    tx.handle(keep("d1"), 0.0)
    tx.handle(HeartbeatArrived(P1, ("d1",)), 1.0)
    assert calm(tx.handle(pull("d1", agent=P2), 2.0)) == [
        ("pull_ack", P2, "next", False, int(ErrorCode.AUTH))
    ]
    assert tx.reqs["d1"].state is S.HELD
    assert calm(tx.handle(pull("d1", agent=P1), 3.0))[0] == ("finished", "s1", "d1", 0)


def test_kept_blocks_are_not_pushed() -> None:
    tx = make()
    tx.handle(keep("d1"), 0.0)
    out = tx.handle(RegistrationArrived(P1, reg("p-new", "d1")), 1.0)
    assert calm(out) == [("push_done", P1, "p-new", INVALID)]
    req = tx.reqs["d1"]
    assert req.state is S.HELD and req.registration is None and req.agent == ""
    # a registration that came before the keep is refused at the keep, which holds on
    tx = make()
    assert tx.handle(RegistrationArrived(P1, reg("p-new", "d2")), 0.0) == []
    assert calm(tx.handle(keep("d2"), 1.0)) == [("push_done", P1, "p-new", INVALID)]
    assert tx.reqs["d2"].state is S.HELD and tx.reqs["d2"].kept


def test_early_pull_served_by_the_keep() -> None:
    tx = make()
    assert tx.handle(pull("d1"), 0.0) == []
    assert tx.reqs["d1"].state is S.AWAITING
    out = tx.handle(keep("d1"), 0.5)
    assert calm(out) == [("finished", "s1", "d1", 0), ("pull_ack", P1, "next", True, 0)]
    assert tx.counters["kept_pulled"] == 1
    assert_empty(tx)


def test_kept_blocks_freed_with_ds_session() -> None:
    tx = make()
    tx.handle(keep("d1"), 0.0)
    tx.handle(keep("d2", session="s2"), 0.0)
    out = tx.handle(EndSession("s1"), 1.0)
    assert out[-1] == SessionEnded("s1")
    assert "d1" not in tx.reqs and "d1" not in tx.leases
    assert tx.reqs["d2"].state is S.HELD
    # a pull of the freed blocks is refused (P recomputes)
    assert calm(tx.handle(pull("d1"), 2.0)) == [("pull_ack", P1, "next", False, TRANSFER)]
