from __future__ import annotations

import random

import pytest
from kvd_client.errors import InvalidRequest

from kvd.core.ids import base_request_id
from kvd.core.matching import Match, PushMatcher

M = PushMatcher[str, int]


def test_registration_then_finished() -> None:
    m: M = PushMatcher()
    assert m.add_registration("r1", "reg", now=0.0) is None
    assert m.pending_registrations() == 1
    assert m.add_finished("r1", 7, now=1.0) == Match("r1", "r1", "reg", 7)
    assert m.pending_registrations() == 0 and m.pending_finished() == 0


def test_finished_then_registration() -> None:
    m: M = PushMatcher()
    assert m.add_finished("r1", 7, now=0.0) is None
    assert m.has_unmatched_finished()
    assert m.add_registration("r1", "reg", now=1.0) == Match("r1", "r1", "reg", 7)
    assert not m.has_unmatched_finished()


def test_base_id_fallback_both_orders() -> None:
    m: M = PushMatcher()
    assert m.add_registration("cmpl-x-0-1a2b3c4d", "reg", now=0.0) is None
    assert m.add_finished("cmpl-x-0-deadbeef", 1, now=0.0) == Match(
        "cmpl-x-0-1a2b3c4d", "cmpl-x-0-deadbeef", "reg", 1
    )
    assert m.add_finished("cmpl-y-0", 2, now=0.0) is None
    assert m.add_registration("cmpl-y-0-00000000", "reg2", now=0.0) == Match(
        "cmpl-y-0-00000000", "cmpl-y-0", "reg2", 2
    )
    assert m.pending_registrations() == 0 and m.pending_finished() == 0


def test_exact_preferred_over_base() -> None:
    m: M = PushMatcher()
    m.add_finished("q-0-11111111", 1, now=0.0)
    m.add_finished("q-0-22222222", 2, now=0.0)
    match = m.add_registration("q-0-22222222", "reg", now=0.0)
    assert match is not None and match.finished_id == "q-0-22222222" and match.finished == 2
    match = m.add_registration("q-0-33333333", "reg", now=0.0)
    assert match is not None and match.finished_id == "q-0-11111111"


def test_no_match_for_different_base() -> None:
    m: M = PushMatcher()
    m.add_registration("a-0-11111111", "reg", now=0.0)
    assert m.add_finished("a-1-11111111", 1, now=0.0) is None
    assert m.pending_registrations() == 1 and m.pending_finished() == 1


def test_duplicates_raise() -> None:
    m: M = PushMatcher()
    m.add_registration("r", "reg", now=0.0)
    with pytest.raises(InvalidRequest, match="'r'"):
        m.add_registration("r", "reg", now=0.0)
    m.add_finished("s", 1, now=0.0)
    with pytest.raises(InvalidRequest, match="'s'"):
        m.add_finished("s", 1, now=0.0)
    assert m.pending_registrations() == 1 and m.pending_finished() == 1


def test_removal_keeps_index_consistent() -> None:
    m: M = PushMatcher()
    m.add_registration("z-0-11111111", "a", now=0.0)
    m.add_registration("z-0-22222222", "b", now=0.0)
    assert m.remove_registration("z-0-11111111") == "a"
    assert m.remove_registration("z-0-11111111") is None
    match = m.add_finished("z-0", 1, now=0.0)
    assert match is not None and match.registration == "b"
    assert m.add_finished("z-0-33333333", 2, now=0.0) is None  # nothing left to match
    assert m.remove_finished("z-0-33333333") == 2
    assert m.remove_finished("z-0-33333333") is None
    assert m.add_registration("z-0-44444444", "c", now=0.0) is None


def test_registrations_older_than() -> None:
    m: M = PushMatcher()
    for i in range(5):
        m.add_registration(f"r{i}", "x", now=float(i))
    m.remove_registration("r1")
    assert m.registrations_older_than(3.0) == ["r0", "r2"]
    assert m.registrations_older_than(0.0) == []
    m.add_registration("late-stamped", "x", now=0.5)  # time went backwards: still correct
    assert m.registrations_older_than(3.0) == ["r0", "late-stamped", "r2"]


def test_random_against_model() -> None:
    rng = random.Random(11)
    m: M = PushMatcher()
    regs: dict[str, str] = {}
    fins: dict[str, int] = {}
    ids = [f"b{i}" for i in range(5)] + [f"b{i}-{j:08x}" for i in range(5) for j in range(3)]
    for step in range(20_000):
        rid = rng.choice(ids)
        op = rng.random()
        if op < 0.35:
            if rid in regs:
                with pytest.raises(InvalidRequest):
                    m.add_registration(rid, "r", now=float(step))
                continue
            match = m.add_registration(rid, f"reg-{step}", now=float(step))
            exact = rid in fins
            cands = [f for f in fins if base_request_id(f) == base_request_id(rid)]
            if exact:
                assert match is not None and match.finished_id == rid
            elif cands:
                assert match is not None and match.finished_id in cands
            else:
                assert match is None
                regs[rid] = f"reg-{step}"
            if match is not None:
                assert match.registration_id == rid
                assert match.finished == fins.pop(match.finished_id)
        elif op < 0.7:
            if rid in fins:
                with pytest.raises(InvalidRequest):
                    m.add_finished(rid, 0, now=float(step))
                continue
            match = m.add_finished(rid, step, now=float(step))
            cands = [r for r in regs if base_request_id(r) == base_request_id(rid)]
            if rid in regs:
                assert match is not None and match.registration_id == rid
            elif cands:
                assert match is not None and match.registration_id in cands
            else:
                assert match is None
                fins[rid] = step
            if match is not None:
                assert match.finished_id == rid
                assert match.registration == regs.pop(match.registration_id)
        elif op < 0.85:
            assert m.remove_registration(rid) == regs.pop(rid, None)
        else:
            assert m.remove_finished(rid) == fins.pop(rid, None)
        assert m.pending_registrations() == len(regs)
        assert m.pending_finished() == len(fins)
        assert m.has_unmatched_finished() == bool(fins)


def test_find_registration_exact_then_base() -> None:
    m: PushMatcher[str, str] = PushMatcher()
    m.add_registration("cmpl-1-0-aaaaaaaa", "reg", 0.0)
    assert m.find_registration("cmpl-1-0-aaaaaaaa") == "cmpl-1-0-aaaaaaaa"
    assert m.find_registration("cmpl-1-0-bbbbbbbb") == "cmpl-1-0-aaaaaaaa"
    assert m.find_registration("cmpl-2-0-bbbbbbbb") is None
