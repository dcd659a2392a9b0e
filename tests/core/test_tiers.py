"""The KV tiers' indexes (kvd.core.tiers): unit cases, and hypothesis models of the host
and disk indexes against plain reference models (lists scanned in full, obviously right)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kvd_client import wire as w
from kvd_client.shm import unique_name
from kvd_client.tierdir import TierDirReader, TierDirWriter, key_digest

from kvd.core.tiers import (
    DiskIndex,
    HostIndex,
    OpBook,
    OpKind,
    PeerHints,
    Reserve,
    TierKey,
    found_problem,
    pick_peers,
    pinned_problem,
)


def k(i: int, ns: bytes = b"m") -> TierKey:
    return (ns, i.to_bytes(4, "big"))


# --------------------------------------------------------------------------- host, by hand


def test_reserve_commit_pin_unpin() -> None:
    h = HostIndex(2)
    got = h.reserve(k(1))
    assert got == (0, None)
    assert not h.ready(k(1)) and k(1) in h
    assert h.reserve(k(1)) is Reserve.HELD
    h.commit(k(1))
    assert h.ready(k(1)) and h.pins(k(1)) == 0
    assert h.pin(k(1)) == 0 and h.pins(k(1)) == 1
    assert h.unpin(k(1)) is False
    assert h.pin(k(2)) is None


def test_pinned_and_reserved_are_never_evicted() -> None:
    h = HostIndex(2)
    h.reserve(k(1))  # reserved (pinned once)
    h.reserve(k(2))
    h.commit(k(2))
    h.pin(k(2))
    assert h.reserve(k(3)) is Reserve.FULL
    assert h.evict(k(2)) is None and h.evict(k(1)) is None
    h.unpin(k(2))
    slot, victim = h.reserve(k(3))  # type: ignore[misc]
    assert victim is not None and victim.key == k(2) and not victim.on_disk and slot == 1


def test_clean_entries_go_first_and_dirty_only_when_allowed() -> None:
    h = HostIndex(3)
    for i in (1, 2, 3):
        h.reserve(k(i))
        h.commit(k(i))
    h.mark_on_disk(k(3))  # the newest, but clean
    assert h.clean == 1
    _, victim = h.reserve(k(4), evict_dirty=False)  # type: ignore[misc]
    assert victim is not None and victim.key == k(3) and victim.on_disk
    h.commit(k(4))
    assert h.reserve(k(5), evict_dirty=False) is Reserve.FULL
    got = h.reserve(k(5))
    assert not isinstance(got, Reserve) and got[1] is not None and got[1].key == k(1)
    assert h.victims(10) == [k(2), k(4)]


def test_transient_entry_freed_by_its_last_unpin() -> None:
    h = HostIndex(1)
    h.reserve(k(1), transient=True, on_disk=True)
    h.commit(k(1), keep_pin=True)
    assert h.pins(k(1)) == 1
    assert h.unpin(k(1)) is True
    assert k(1) not in h and h.free_slots == 1


def test_abort_and_bad_transitions() -> None:
    h = HostIndex(1)
    h.reserve(k(1))
    assert h.abort(k(1)) == 0 and h.free_slots == 1
    with pytest.raises(KeyError):
        h.unpin(k(1))
    h.reserve(k(1))
    h.commit(k(1))
    with pytest.raises(ValueError, match="not reserved"):
        h.commit(k(1))
    with pytest.raises(ValueError, match="not pinned"):
        h.unpin(k(1))
    with pytest.raises(ValueError):
        HostIndex(0)
    with pytest.raises(ValueError, match="not reserved"):
        h.detach(k(1))
    with pytest.raises(ValueError, match="not lent"):
        h.give_back(0)
    with pytest.raises(ValueError, match="generation counters"):
        HostIndex(4, [0, 0])


def test_a_detached_slot_stays_out_of_use_until_given_back() -> None:
    gens = [0, 0]
    h = HostIndex(2, gens)
    got = h.reserve(k(1))
    assert not isinstance(got, Reserve) and got[0] == 0 and gens == [1, 0]
    assert h.detach(k(1)) == 0
    assert k(1) not in h and h.lent == 1 and h.free_slots == 1
    assert h.reserve(k(1)) == (1, None)  # the key may be stored again, elsewhere
    assert h.reserve(k(2)) is Reserve.FULL  # the lent slot is never handed out
    h.give_back(0)
    assert h.reserve(k(2)) == (0, None) and gens == [2, 1]


def test_namespaces_never_share() -> None:
    h = HostIndex(4)
    h.reserve(k(1, b"a"))
    h.commit(k(1, b"a"))
    assert not h.ready(k(1, b"b"))
    assert h.reserve(k(1, b"b")) != Reserve.HELD


# --------------------------------------------------------------------------- disk, by hand


def test_disk_capacity_evicts_lru_and_refuses_what_cannot_fit() -> None:
    d = DiskIndex(100)
    for i in range(4):
        assert d.begin_write(k(i), 25) == []
        d.finish_write(k(i), True)
    assert d.used == 100
    assert d.pin(k(0))  # a reader: k(0) now the most recent and not evictable
    assert d.begin_write(k(9), 30) == [k(1), k(2)]
    assert d.used == 80
    assert d.begin_write(k(10), 101) is Reserve.FULL
    assert d.begin_write(k(3), 1) is Reserve.HELD
    d.finish_write(k(9), False)  # a failed write frees its bytes
    assert d.used == 50 and k(9) not in d
    assert d.remove(k(3)) and d.used == 25  # found bad without a reader: gone at once


def test_a_bad_disk_file_with_readers_is_condemned_until_its_last_reader_goes() -> None:
    d = DiskIndex(100)
    for i in range(2):
        assert d.begin_write(k(i), 25) == []
        d.finish_write(k(i), True)
    assert d.pin(k(0)) and d.pin(k(0))  # two readers (a client reading the file, say)
    assert not d.remove(k(0))  # found bad meanwhile: condemned, not forgotten yet
    assert not d.ready(k(0)) and not d.pin(k(0))  # a miss, never read again
    assert d.begin_write(k(0), 25) is Reserve.HELD  # not written again while condemned
    assert d.begin_write(k(5), 75) == [k(1)]  # its bytes are not evictable meanwhile
    d.finish_write(k(5), True)
    assert not d.unpin(k(0))
    assert d.unpin(k(0))  # the last reader: forgotten now, the file to be deleted
    assert k(0) not in d and d.used == 75


def test_disk_full_of_readers_and_writers_refuses_without_evicting() -> None:
    d = DiskIndex(50)
    d.begin_write(k(1), 25)  # being written
    d.begin_write(k(2), 25)
    d.finish_write(k(2), True)
    d.pin(k(2))
    assert d.begin_write(k(3), 25) is Reserve.FULL
    assert len(d) == 2 and d.used == 50


# --------------------------------------------------------------------------- ops


def test_opbook_sessions_and_deadlines() -> None:
    b = OpBook()
    a = b.open("s1", OpKind.LOAD, deadline=10.0)
    c = b.open("s1", OpKind.STORE, deadline=5.0)
    e = b.open("s2", OpKind.LOAD, deadline=20.0)
    assert b.of_session("s1") == [a.op, c.op]
    assert b.next_deadline() == 5.0
    assert b.expired(9.0) == [c.op]
    assert b.close(c.op) is c and b.close(c.op) is None
    assert b.of_session("s1") == [a.op]
    assert b.close(a.op) is a
    assert b.of_session("s1") == []
    assert b.expired(100.0) == [e.op]


# --------------------------------------------------------------------------- host model


@dataclass
class _Ref:
    slot: int
    reserved: bool
    pins: int
    on_disk: bool
    transient: bool
    used: int  # recency stamp when it last became unpinned and ready


class _Directory:
    """HostIndex's directory as the daemon's (`kvd.actors.tiers._Published`): a real
    shared-memory directory, read back through a client's reader."""

    def __init__(self, pool_slots: int) -> None:
        self.writer = TierDirWriter(unique_name("kvd-test-dir"), pool_slots)
        self.reader = TierDirReader(self.writer.name, pool_slots)

    def publish(self, key: TierKey, slot: int, gen: int) -> None:
        assert self.writer.publish(key_digest(*key), slot, gen)

    def retract(self, key: TierKey) -> None:
        self.writer.retract(key_digest(*key))

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


class HostMachine(RuleBasedStateMachine):
    """HostIndex against a reference that finds victims by scanning every entry; its
    directory read back as a client reads it."""

    N = 6

    def __init__(self) -> None:
        super().__init__()
        self.gens = [0] * self.N
        self.dir = _Directory(self.N)
        self.h = HostIndex(self.N, self.gens, self.dir)
        self.ref: dict[TierKey, _Ref] = {}
        self.lent: set[int] = set()
        self.gen = [0] * self.N  # the model's own count of each slot's new uses
        self.clock = 0

    def _tick(self) -> int:
        self.clock += 1
        return self.clock

    def _lru(self, on_disk: bool) -> list[TierKey]:
        cands = [
            (r.used, key)
            for key, r in self.ref.items()
            if not r.reserved and r.pins == 0 and r.on_disk == on_disk
        ]
        return [key for _, key in sorted(cands)]

    @rule(i=st.integers(0, 9), evict_dirty=st.booleans(), transient=st.booleans())
    def reserve(self, i: int, evict_dirty: bool, transient: bool) -> None:
        key = k(i)
        got = self.h.reserve(key, evict_dirty=evict_dirty, transient=transient)
        if key in self.ref:
            assert got is Reserve.HELD
            return
        clean, dirty = self._lru(True), self._lru(False)
        if len(self.ref) + len(self.lent) < self.N:
            assert not isinstance(got, Reserve) and got[1] is None
        elif clean or (evict_dirty and dirty):
            expect = clean[0] if clean else dirty[0]
            assert not isinstance(got, Reserve)
            assert got[1] is not None and got[1].key == expect
            assert got[1].slot == self.ref[expect].slot == got[0]
            assert got[1].on_disk == self.ref[expect].on_disk
            del self.ref[expect]
        else:
            assert got is Reserve.FULL
            return
        assert not isinstance(got, Reserve)
        assert got[0] not in self.lent
        self.gen[got[0]] += 1
        self.ref[key] = _Ref(got[0], True, 1, False, transient, 0)

    @precondition(lambda self: any(r.reserved for r in self.ref.values()))
    @rule(data=st.data())
    def detach(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(kk for kk, r in self.ref.items() if r.reserved)))
        slot = self.h.detach(key)
        assert slot == self.ref.pop(key).slot
        self.lent.add(slot)

    @rule(n=st.integers(0, 3))
    def lend(self, n: int) -> None:
        free = self.N - len(self.ref) - len(self.lent)
        clean = self._lru(True)
        expect_evicted = clean[: max(0, min(n - free, len(clean)))]
        slots, evicted = self.h.lend(n)
        assert [e.key for e in evicted] == expect_evicted
        assert len(slots) == min(n, free + len(clean))
        for e in evicted:
            assert e.on_disk and e.slot == self.ref.pop(e.key).slot
        for slot in slots:
            assert slot not in self.lent and all(r.slot != slot for r in self.ref.values())
            self.gen[slot] += 1
            self.lent.add(slot)

    @precondition(lambda self: bool(self.lent))
    @rule(data=st.data(), i=st.integers(0, 9))
    def fill(self, data: st.DataObject, i: int) -> None:
        slot = data.draw(st.sampled_from(sorted(self.lent)))
        key = k(i)
        got = self.h.fill(key, slot)
        assert got == (key not in self.ref)
        if got:
            self.lent.discard(slot)
            self.ref[key] = _Ref(slot, False, 0, False, False, self._tick())

    @precondition(lambda self: bool(self.lent))
    @rule(data=st.data())
    def give_back(self, data: st.DataObject) -> None:
        slot = data.draw(st.sampled_from(sorted(self.lent)))
        self.h.give_back(slot)
        self.lent.discard(slot)

    @precondition(lambda self: any(r.reserved for r in self.ref.values()))
    @rule(data=st.data(), keep=st.booleans())
    def commit(self, data: st.DataObject, keep: bool) -> None:
        key = data.draw(st.sampled_from(sorted(kk for kk, r in self.ref.items() if r.reserved)))
        self.h.commit(key, keep_pin=keep)
        r = self.ref[key]
        r.reserved = False
        if not keep:
            self._unpin(key)

    def _unpin(self, key: TierKey) -> None:
        r = self.ref[key]
        r.pins -= 1
        if r.pins == 0:
            if r.transient:
                del self.ref[key]
            else:
                r.used = self._tick()

    @precondition(lambda self: any(r.reserved for r in self.ref.values()))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(kk for kk, r in self.ref.items() if r.reserved)))
        assert self.h.abort(key) == self.ref.pop(key).slot

    @rule(i=st.integers(0, 9))
    def pin(self, i: int) -> None:
        key = k(i)
        r = self.ref.get(key)
        got = self.h.pin(key)
        if r is None or r.reserved:
            assert got is None
        else:
            assert got == r.slot
            r.pins += 1

    @precondition(lambda self: any(not r.reserved and r.pins for r in self.ref.values()))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        pinned = sorted(kk for kk, r in self.ref.items() if not r.reserved and r.pins)
        key = data.draw(st.sampled_from(pinned))
        freed = self.h.unpin(key)
        transient = self.ref[key].transient and self.ref[key].pins == 1
        self._unpin(key)
        assert freed == transient

    @rule(i=st.integers(0, 9))
    def mark_on_disk(self, i: int) -> None:
        key = k(i)
        self.h.mark_on_disk(key)
        r = self.ref.get(key)
        if r is not None and not r.on_disk:
            r.on_disk = True
            if not r.reserved and r.pins == 0:  # the oldest clean one now
                r.used = min([x.used for x in self.ref.values()] + [0]) - 1

    @rule(n=st.integers(0, 4))
    def evict_clean(self, n: int) -> None:
        expect = self._lru(True)[:n]
        got = self.h.evict_clean(n)
        assert [e.key for e in got] == expect
        for key in expect:
            del self.ref[key]

    @rule(n=st.integers(0, 4))
    def victims(self, n: int) -> None:
        assert self.h.victims(n) == self._lru(False)[:n]

    @rule(i=st.integers(0, 9))
    def evict(self, i: int) -> None:
        key = k(i)
        r = self.ref.get(key)
        got = self.h.evict(key)
        if r is None or r.reserved or r.pins:
            assert got is None
        else:
            assert got is not None and got.slot == r.slot
            del self.ref[key]

    @rule(ids=st.lists(st.integers(0, 11), max_size=4))
    def touch(self, ids: list[int]) -> None:
        """Loads through the directory: the unpinned ready ones become the newest."""
        keys = [k(i) for i in ids]
        held = self.h.touch(keys)
        assert held == sum(1 for x in keys if x in self.ref and not self.ref[x].reserved)
        for x in keys:
            r = self.ref.get(x)
            if r is not None and not r.reserved and r.pins == 0:
                r.used = self._tick()

    def teardown(self) -> None:
        self.dir.close()

    @invariant()
    def agrees(self) -> None:
        assert len(self.h) == len(self.ref)
        assert self.h.free_slots == self.N - len(self.ref) - len(self.lent)
        assert self.h.lent == len(self.lent)
        slots = [r.slot for r in self.ref.values()] + sorted(self.lent)
        assert len(set(slots)) == len(slots) and all(0 <= s < self.N for s in slots)
        # every new use of a slot bumped its published generation
        assert self.gens == self.gen and all(self.h.gen(s) == self.gen[s] for s in range(self.N))
        for key, r in self.ref.items():
            assert self.h.slot_of(key) == r.slot
            assert self.h.pins(key) == r.pins
            assert self.h.ready(key) == (not r.reserved)
        probe = [k(i) for i in range(12)]
        assert self.h.ready_many(probe) == [self.h.ready(x) for x in probe]
        assert self.h.evictable == len(self._lru(True)) + len(self._lru(False))
        # the directory names exactly the ready blocks a load may copy (not a transient
        # one: it goes with its load), each with its slot's current generation
        wants = []
        for x in probe:
            r = self.ref.get(x)
            want = None
            if r is not None and not r.reserved and not r.transient:
                want = (r.slot, self.gen[r.slot])
            assert self.dir.reader.lookup(key_digest(*x)) == want, x
            wants.append(want)
        assert self.dir.reader.lookup_many([key_digest(*x) for x in probe]) == wants


HostMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestHostMachine = HostMachine.TestCase


# --------------------------------------------------------------------------- disk model


class DiskMachine(RuleBasedStateMachine):
    """DiskIndex against a reference of (key -> [bytes, writing, readers, recency,
    condemned])."""

    CAP = 100

    def __init__(self) -> None:
        super().__init__()
        self.d = DiskIndex(self.CAP)
        self.ref: dict[TierKey, list[int]] = {}
        self.clock = 0

    def _lru(self) -> list[TierKey]:
        return [
            key
            for _, key in sorted(
                (v[3], key) for key, v in self.ref.items() if not v[1] and v[2] == 0
            )
        ]

    @rule(i=st.integers(0, 9), n=st.integers(1, 60))
    def begin(self, i: int, n: int) -> None:
        key = k(i)
        got = self.d.begin_write(key, n)
        if key in self.ref:
            assert got is Reserve.HELD
            return
        used = sum(v[0] for v in self.ref.values())
        evictable = self._lru()
        freed, expect = 0, []
        for old in evictable:
            if used - freed + n <= self.CAP:
                break
            freed += self.ref[old][0]
            expect.append(old)
        if used - freed + n > self.CAP:
            assert got is Reserve.FULL
            return
        assert got == expect
        for old in expect:
            del self.ref[old]
        self.ref[key] = [n, 1, 0, 0, 0]

    @precondition(lambda self: any(v[1] for v in self.ref.values()))
    @rule(data=st.data(), ok=st.booleans())
    def finish(self, data: st.DataObject, ok: bool) -> None:
        key = data.draw(st.sampled_from(sorted(kk for kk, v in self.ref.items() if v[1])))
        self.d.finish_write(key, ok)
        if ok:
            self.clock += 1
            self.ref[key][1] = 0
            self.ref[key][3] = self.clock
        else:
            del self.ref[key]

    @rule(i=st.integers(0, 9))
    def pin(self, i: int) -> None:
        key = k(i)
        v = self.ref.get(key)
        ok = v is not None and not v[1] and not v[4]
        assert self.d.pin(key) == ok
        if ok:
            assert v is not None
            v[2] += 1

    @precondition(lambda self: any(v[2] for v in self.ref.values()))
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(kk for kk, v in self.ref.items() if v[2])))
        v = self.ref[key]
        v[2] -= 1
        gone = v[2] == 0 and bool(v[4])
        assert self.d.unpin(key) == gone
        if gone:
            del self.ref[key]
        elif v[2] == 0:
            self.clock += 1
            v[3] = self.clock

    @rule(i=st.integers(0, 9))
    def remove(self, i: int) -> None:
        key = k(i)
        v = self.ref.get(key)
        ready = v is not None and not v[1] and not v[4]
        ok = ready and v is not None and v[2] == 0
        assert self.d.remove(key) == ok
        if ok:
            del self.ref[key]
        elif ready and v is not None:  # readers: condemned
            v[4] = 1

    @rule(ids=st.lists(st.integers(0, 11), max_size=4))
    def touch(self, ids: list[int]) -> None:
        """Files read without a pin: the ready ones with no reader become the newest."""
        keys = [k(i) for i in ids]
        ready = [x for x in keys if x in self.ref and not self.ref[x][1] and not self.ref[x][4]]
        assert self.d.touch(keys) == len(ready)
        for x in ready:
            if self.ref[x][2] == 0:
                self.clock += 1
                self.ref[x][3] = self.clock

    @invariant()
    def agrees(self) -> None:
        assert self.d.used == sum(v[0] for v in self.ref.values()) <= self.CAP
        assert len(self.d) == len(self.ref)
        for key, v in self.ref.items():
            assert self.d.ready(key) == (not v[1] and not v[4])
            assert self.d.nbytes(key) == v[0]
        probe = [k(i) for i in range(12)]
        assert self.d.ready_many(probe) == [self.d.ready(x) for x in probe]


DiskMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
TestDiskMachine = DiskMachine.TestCase


# ------------------------------------------------------------------ across nodes


def test_pick_peers_prefers_host_then_least_name_in_any_order() -> None:
    h, d, m = w.TIER_HOST, w.TIER_DISK, w.TIER_MISS
    answers = {"pc": bytes([h, h, m, d]), "pb": bytes([d, h, m, d]), "pa": bytes([m, m, m, m])}
    want = ["pc", "pb", None, "pb"]
    assert pick_peers(4, answers) == want
    assert pick_peers(4, dict(reversed(list(answers.items())))) == want
    assert pick_peers(2, {}) == [None, None]


def test_found_problem_rejects_wrong_length_and_values() -> None:
    assert found_problem(bytes([0, 1, 2]), 3) is None
    assert found_problem(bytes([0, 1]), 3) == "2 answers for 3 keys"
    assert found_problem(bytes([0, 3, 1]), 3) is not None  # TIER_PEER: never from a peer
    assert found_problem(bytes([9]), 1) is not None


def test_pinned_problem_keeps_every_descriptor_inside_the_peer_pool() -> None:
    def ans(**kw: object) -> w.PeerTierPinned:
        base: dict[str, object] = {
            "op": 1,
            "pool_addr": 1 << 30,
            "pool_bytes": 4 * 4096,
            "slot_bytes": 4096,
            "slots": (0, -1, 3),
            "checksum_kind": 1,
            "checksums": bytes(24),
        }
        base.update(kw)
        return w.PeerTierPinned(**base)  # type: ignore[arg-type]

    kinds = {1, 2}
    assert pinned_problem(ans(), 3, 4096, kinds) is None
    assert (
        pinned_problem(ans(slots=(0, 4, 1)), 3, 4096, kinds) == "slot 4 outside the pool's 4 slots"
    )
    assert pinned_problem(ans(slots=(0, -2, 1)), 3, 4096, kinds) is not None
    assert pinned_problem(ans(slots=(0, 1)), 3, 4096, kinds) == "2 slots for 3 keys"
    assert pinned_problem(ans(checksums=bytes(16)), 3, 4096, kinds) is not None
    assert pinned_problem(ans(checksum_kind=0), 3, 4096, kinds) == "unknown checksum kind 0"
    assert pinned_problem(ans(slot_bytes=8192), 3, 4096, kinds) is not None
    assert pinned_problem(ans(pool_addr=(1 << 63) - 100), 3, 4096, kinds) is not None
    # all misses: nothing is read, the sizes do not matter
    assert pinned_problem(ans(slots=(-1, -1, -1), slot_bytes=1), 3, 4096, kinds) is None


def test_peer_hints_bounded_and_forgotten_with_their_peer() -> None:
    h = PeerHints(3)
    for i in range(5):
        h.note((b"ns", bytes([i])), "pb" if i % 2 else "pc")
    assert len(h) == 3 and h.get((b"ns", bytes([0]))) is None
    assert h.get((b"ns", bytes([4]))) == "pc"
    h.note((b"ns", bytes([2])), "pb")  # most recent again
    h.note((b"ns", bytes([9])), "pc")
    assert h.get((b"ns", bytes([2]))) == "pb" and h.get((b"ns", bytes([3]))) is None
    assert h.forget_peer("pb") == 1
    assert h.get((b"ns", bytes([2]))) is None and len(h) == 2
