from __future__ import annotations

from typing import Any, Literal

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from kvd_client.errors import Busy, InvalidRequest, NotFound

from kvd.core.blockpool import Allocation, BlockPool


def test_allocate_and_free() -> None:
    pool = BlockPool(8)
    a = pool.allocate("a", 3)
    assert a == Allocation([0, 1, 2], [])
    assert pool.allocate("b", 2).blocks == [3, 4]
    assert (pool.used_blocks, pool.free_blocks, len(pool)) == (5, 3, 2)
    assert "a" in pool and pool.keys() == ["a", "b"]
    pool.free("a")
    assert "a" not in pool and pool.free_blocks == 6
    assert pool.allocate("c", 3).blocks == [0, 1, 2]  # freed runs come back ascending
    assert pool.get("zzz") is None


def test_invalid_allocations() -> None:
    pool = BlockPool(4)
    pool.allocate("a", 1)
    for n in (0, -1, 5):
        with pytest.raises(InvalidRequest):
            pool.allocate("x", n)
    bad: Any = True
    with pytest.raises(InvalidRequest):
        pool.allocate("x", bad)
    with pytest.raises(InvalidRequest, match="'a'"):
        pool.allocate("a", 1)
    with pytest.raises(ValueError):
        BlockPool(0)
    policy: Any = "mru"
    with pytest.raises(ValueError):
        BlockPool(4, policy)


def test_fifo_evicts_oldest_even_if_used() -> None:
    pool = BlockPool(4, "fifo")
    pool.allocate("a", 2)
    pool.allocate("b", 2)
    pool.get("a")  # irrelevant to FIFO
    alloc = pool.allocate("c", 2)
    assert alloc.evicted == ["a"] and alloc.blocks == [0, 1]
    assert pool.evicted == 1 and pool.keys() == ["b", "c"]


def test_lru_evicts_least_recently_used() -> None:
    pool = BlockPool(4, "lru")
    pool.allocate("a", 2)
    pool.allocate("b", 2)
    pool.get("a")
    assert pool.allocate("c", 2).evicted == ["b"]
    assert pool.policy == "lru"


def test_eviction_takes_as_many_as_needed_in_order() -> None:
    pool = BlockPool(6, "fifo")
    for key in "abc":
        pool.allocate(key, 2)
    alloc = pool.allocate("d", 5)
    assert alloc.evicted == ["a", "b", "c"]
    assert alloc.blocks == [0, 2, 3, 4, 5]  # ascending, from the freed entries' blocks
    assert pool.evicted == 3


def test_pinned_never_evicted() -> None:
    pool = BlockPool(4, "fifo")
    pool.allocate("a", 2)
    pool.allocate("b", 2)
    pool.pin("a")
    assert pool.allocate("c", 2).evicted == ["b"]
    assert pool.is_pinned("a") and not pool.is_pinned("c") and not pool.is_pinned("nope")


def test_unpin_restores_original_fifo_rank() -> None:
    pool = BlockPool(6, "fifo")
    for key in "abc":
        pool.allocate(key, 2)
    pool.pin("a")
    pool.unpin("a")
    assert pool.allocate("d", 2).evicted == ["a"]


def test_all_pinned_allocation_fails_without_side_effects() -> None:
    pool = BlockPool(6, "lru")
    pool.allocate("a", 2, pin=True)
    pool.allocate("b", 2)
    pool.allocate("c", 2, pin=True)
    before = (pool.keys(), pool.free_blocks, pool.evicted, pool.get("b"))
    with pytest.raises(Busy, match=r"3 blocks.*0 free, 2 evictable, 4 pinned"):
        pool.allocate("d", 3)
    assert (pool.keys(), pool.free_blocks, pool.evicted, pool.get("b")) == before
    assert "d" not in pool


def test_pin_counts() -> None:
    pool = BlockPool(2)
    pool.allocate("a", 2)
    pool.pin("a")
    pool.pin("a")
    pool.unpin("a")
    with pytest.raises(InvalidRequest, match="pinned"):
        pool.free("a")
    pool.unpin("a")
    with pytest.raises(InvalidRequest, match="not pinned"):
        pool.unpin("a")
    pool.free("a")
    for op in (pool.pin, pool.unpin, pool.free):
        with pytest.raises(NotFound):
            op("a")


def test_get_returns_a_copy() -> None:
    pool = BlockPool(2)
    pool.allocate("a", 2)
    got = pool.get("a")
    assert got == [0, 1]
    got.append(9)
    assert pool.get("a") == [0, 1]


KEYS = [f"k{i}" for i in range(8)]


class PoolMachine(RuleBasedStateMachine):
    """Random ops against a model; pinned entries must never be evicted."""

    def __init__(self) -> None:
        super().__init__()
        self.policy: Literal["fifo", "lru"] = "fifo"
        self.pool = BlockPool(10, self.policy)
        self.sizes: dict[str, int] = {}
        self.pins: dict[str, int] = {}
        self.rank: dict[str, int] = {}
        self.clock = 0

    @rule(lru=st.booleans())
    def reset(self, lru: bool) -> None:
        self.policy = "lru" if lru else "fifo"
        self.pool = BlockPool(10, self.policy)
        self.sizes.clear()
        self.pins.clear()
        self.rank.clear()

    @rule(key=st.sampled_from(KEYS), n=st.integers(1, 10), pin=st.booleans())
    def allocate(self, key: str, n: int, pin: bool) -> None:
        if key in self.sizes:
            with pytest.raises(InvalidRequest):
                self.pool.allocate(key, n)
            return
        free = 10 - sum(self.sizes.values())
        evictable = sorted((self.rank[k], k) for k in self.sizes if self.pins[k] == 0)
        if free + sum(self.sizes[k] for _, k in evictable) < n:
            keys_before = self.pool.keys()
            with pytest.raises(Busy):
                self.pool.allocate(key, n, pin=pin)
            assert self.pool.keys() == keys_before
            return
        expected: list[str] = []
        for _, k in evictable:
            if free >= n:
                break
            expected.append(k)
            free += self.sizes[k]
        alloc = self.pool.allocate(key, n, pin=pin)
        assert alloc.evicted == expected
        assert len(alloc.blocks) == n
        for k in expected:
            assert self.pins[k] == 0
            del self.sizes[k], self.pins[k], self.rank[k]
        self.clock += 1
        self.sizes[key], self.pins[key], self.rank[key] = n, int(pin), self.clock

    @rule(key=st.sampled_from(KEYS))
    def get(self, key: str) -> None:
        blocks = self.pool.get(key)
        assert (blocks is None) == (key not in self.sizes)
        if blocks is not None and self.policy == "lru":
            self.clock += 1
            self.rank[key] = self.clock

    @rule(key=st.sampled_from(KEYS))
    def pin(self, key: str) -> None:
        if key not in self.sizes:
            with pytest.raises(NotFound):
                self.pool.pin(key)
            return
        self.pool.pin(key)
        self.pins[key] += 1

    @rule(key=st.sampled_from(KEYS))
    def unpin(self, key: str) -> None:
        if self.pins.get(key, 0) == 0:
            with pytest.raises((NotFound, InvalidRequest)):
                self.pool.unpin(key)
            return
        self.pool.unpin(key)
        self.pins[key] -= 1

    @rule(key=st.sampled_from(KEYS))
    def free(self, key: str) -> None:
        if key not in self.sizes or self.pins[key]:
            with pytest.raises((NotFound, InvalidRequest)):
                self.pool.free(key)
            return
        self.pool.free(key)
        del self.sizes[key], self.pins[key], self.rank[key]

    @invariant()
    def consistent(self) -> None:
        pool = self.pool
        assert sorted(pool.keys()) == sorted(self.sizes)
        owned: list[int] = []
        for key, size in self.sizes.items():
            blocks = pool._entries[key].blocks
            assert len(blocks) == size
            assert blocks == sorted(blocks)
            owned.extend(blocks)
            assert pool.is_pinned(key) == (self.pins[key] > 0)
        assert len(owned) == len(set(owned)) == pool.used_blocks
        assert set(owned).isdisjoint(pool._free)
        assert sorted(owned + pool._free) == list(range(10))
        assert pool.evictable_blocks == sum(s for k, s in self.sizes.items() if self.pins[k] == 0)


PoolMachine.TestCase.settings = settings(max_examples=80, stateful_step_count=50, deadline=None)
TestPoolMachine = PoolMachine.TestCase
