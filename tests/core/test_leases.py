from __future__ import annotations

import random

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvd_client.errors import InvalidRequest

from kvd.core.ids import base_request_id
from kvd.core.leases import Lease, LeaseTable


def test_grant_sets_deadline_and_owner() -> None:
    table = LeaseTable(30.0)
    lease = table.grant("r1", now=100.0, owner="sess")
    assert lease == Lease("r1", deadline=130.0, granted_at=100.0, owner="sess")
    assert table.get("r1") == lease
    assert "r1" in table and len(table) == 1
    assert table.next_deadline() == 130.0
    assert table.extension == pytest.approx(20.0)


def test_regrant_raises() -> None:
    table = LeaseTable(30.0)
    table.grant("r1", now=0.0)
    with pytest.raises(InvalidRequest, match="r1"):
        table.grant("r1", now=1.0)


def test_bad_duration() -> None:
    with pytest.raises(ValueError):
        LeaseTable(0.0)


def test_extend_never_shortens() -> None:
    table = LeaseTable(30.0)
    table.grant("r1", now=0.0)  # deadline 30
    assert table.extend(["r1"], now=5.0) == ["r1"]  # 5 + 20 = 25 < 30: unchanged
    lease = table.get("r1")
    assert lease is not None and lease.deadline == 30.0
    table.extend(["r1"], now=15.0)  # 35
    lease = table.get("r1")
    assert lease is not None and lease.deadline == 35.0
    assert lease.granted_at == 0.0
    assert table.next_deadline() == 35.0
    assert table.expire(34.9) == []
    assert [x.request_id for x in table.expire(35.0)] == ["r1"]


def test_extend_reports_known_only() -> None:
    table = LeaseTable(30.0)
    table.grant("a", now=0.0)
    table.grant("b", now=0.0)
    assert table.extend(["x", "b", "y", "a"], now=20.0) == ["b", "a"]


def test_expiry_order_and_boundary() -> None:
    table = LeaseTable(10.0)
    table.grant("late", now=5.0)  # 15
    table.grant("early", now=0.0)  # 10
    table.grant("mid", now=2.0)  # 12
    table.extend(["early"], now=8.0)  # 8 + 6.67 = 14.67
    assert table.next_deadline() == 12.0
    expired = table.expire(14.9)
    assert [x.request_id for x in expired] == ["mid", "early"]
    assert [x.deadline for x in expired] == sorted(x.deadline for x in expired)
    assert table.next_deadline() == 15.0
    assert [x.request_id for x in table.expire(15.0)] == ["late"]
    assert table.next_deadline() is None
    assert len(table) == 0


def test_release() -> None:
    table = LeaseTable(10.0)
    lease = table.grant("r", now=0.0)
    assert table.release("r") == lease
    assert table.release("r") is None
    assert table.expire(100.0) == []
    assert table.next_deadline() is None


def test_find_by_base_id() -> None:
    table = LeaseTable(10.0)
    table.grant("cmpl-a-0-1a2b3c4d", now=0.0)
    table.grant("cmpl-b-0", now=0.0)
    assert table.find("cmpl-a-0-1a2b3c4d") == "cmpl-a-0-1a2b3c4d"
    assert table.find("cmpl-a-0-deadbeef") == "cmpl-a-0-1a2b3c4d"
    assert table.find("cmpl-a-0") == "cmpl-a-0-1a2b3c4d"
    assert table.find("cmpl-b-0-00000000") == "cmpl-b-0"
    assert table.find("cmpl-c-0") is None
    table.release("cmpl-a-0-1a2b3c4d")
    assert table.find("cmpl-a-0-deadbeef") is None
    table.expire(10.0)
    assert table.find("cmpl-b-0-00000000") is None


def test_find_prefers_exact() -> None:
    table = LeaseTable(10.0)
    table.grant("x-0-11111111", now=0.0)
    table.grant("x-0-22222222", now=0.0)
    assert table.find("x-0-22222222") == "x-0-22222222"
    assert table.find("x-0-33333333") in {"x-0-11111111", "x-0-22222222"}


def test_leases_iterates_live() -> None:
    table = LeaseTable(10.0)
    for i in range(5):
        table.grant(f"r{i}", now=float(i))
    table.release("r2")
    assert [x.request_id for x in table.leases()] == ["r0", "r1", "r3", "r4"]


def test_heap_stays_bounded_under_many_extensions() -> None:
    table = LeaseTable(30.0)
    ids = [f"r{i}" for i in range(100)]
    for r in ids:
        table.grant(r, now=0.0)
    for step in range(1, 2000):
        table.extend(ids, now=float(step))
    assert table._timers.heap_size <= 3 * len(table) + 64 + 1
    assert table.next_deadline() == pytest.approx(1999.0 + 20.0)


def test_100k_expire_in_one_call() -> None:
    table = LeaseTable(10.0)
    n = 100_000
    for i in range(n):
        table.grant(f"req-{i}-{i:08x}", now=i * 1e-5)
    # extend half so they survive
    table.extend((f"req-{i}-{i:08x}" for i in range(0, n, 2)), now=9.0)
    expired = table.expire(15.0)  # (its cost per lease is a bench figure, not a test)
    assert len(expired) == n // 2
    deadlines = [x.deadline for x in expired]
    assert deadlines == sorted(deadlines)
    assert all(int(x.request_id.split("-")[1]) % 2 == 1 for x in expired)
    assert len(table) == n // 2
    assert table.find("req-1-ffffffff") is None
    assert table.find("req-2-ffffffff") == "req-2-00000002"


def test_random_ops_against_model() -> None:
    rng = random.Random(1234)
    duration = 10.0
    table = LeaseTable(duration)
    model: dict[str, float] = {}
    now = 0.0
    for _ in range(20_000):
        now += rng.random() * 0.5
        op = rng.random()
        rid = f"r{rng.randrange(200)}"
        if op < 0.3:
            if rid in model:
                with pytest.raises(InvalidRequest):
                    table.grant(rid, now)
            else:
                table.grant(rid, now)
                model[rid] = now + duration
        elif op < 0.6:
            batch = [f"r{rng.randrange(200)}" for _ in range(rng.randrange(1, 8))]
            known = table.extend(batch, now)
            assert known == [r for r in batch if r in model]
            for r in known:
                model[r] = max(model[r], now + table.extension)
        elif op < 0.75:
            lease = table.release(rid)
            assert (lease is None) == (rid not in model)
            model.pop(rid, None)
        else:
            expired = table.expire(now)
            want = sorted((d, r) for r, d in model.items() if d <= now)
            assert [x.deadline for x in expired] == [d for d, _ in want]
            assert {x.request_id for x in expired} == {r for _, r in want}
            for x in expired:
                del model[x.request_id]
        assert len(table) == len(model)
        assert table.next_deadline() == (min(model.values()) if model else None)
    for r, d in model.items():
        lease = table.get(r)
        assert lease is not None and lease.deadline == d


IDS = [f"q{i}" for i in range(4)] + [
    f"q{i}-{s}" for i in range(3) for s in ("0a0a0a0a", "1b1b1b1b")
]


class LeaseMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.table = LeaseTable(5.0)
        self.model: dict[str, float] = {}
        self.now = 0.0

    @rule(dt=st.floats(0.0, 3.0))
    def tick(self, dt: float) -> None:
        self.now += dt

    @rule(rid=st.sampled_from(IDS))
    def grant(self, rid: str) -> None:
        if rid in self.model:
            with pytest.raises(InvalidRequest):
                self.table.grant(rid, self.now)
        else:
            self.table.grant(rid, self.now)
            self.model[rid] = self.now + 5.0

    @rule(rids=st.lists(st.sampled_from(IDS), max_size=5))
    def extend(self, rids: list[str]) -> None:
        known = self.table.extend(rids, self.now)
        assert known == [r for r in rids if r in self.model]
        for r in known:
            self.model[r] = max(self.model[r], self.now + self.table.extension)

    @rule(rid=st.sampled_from(IDS))
    def release(self, rid: str) -> None:
        assert (self.table.release(rid) is None) == (rid not in self.model)
        self.model.pop(rid, None)

    @precondition(lambda self: bool(self.model))
    @rule()
    def expire(self) -> None:
        expired = self.table.expire(self.now)
        assert {x.request_id for x in expired} == {
            r for r, d in self.model.items() if d <= self.now
        }
        assert [x.deadline for x in expired] == sorted(x.deadline for x in expired)
        for x in expired:
            del self.model[x.request_id]

    @rule(rid=st.sampled_from([*IDS, "q1-2c2c2c2c", "q9"]))
    def find(self, rid: str) -> None:
        got = self.table.find(rid)
        if rid in self.model:
            assert got == rid
        else:
            base = base_request_id(rid)
            candidates = {r for r in self.model if base_request_id(r) == base}
            assert (got in candidates) if candidates else got is None

    @invariant()
    def consistent(self) -> None:
        assert len(self.table) == len(self.model)
        assert self.table.next_deadline() == (min(self.model.values()) if self.model else None)


LeaseMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None)
TestLeaseMachine = LeaseMachine.TestCase
