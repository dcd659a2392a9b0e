from __future__ import annotations

import random

from kvd.core.timers import TimerHeap


def test_set_replaces_and_discard() -> None:
    heap: TimerHeap[str] = TimerHeap()
    heap.set("a", 5.0)
    heap.set("b", 3.0)
    heap.set("a", 1.0)
    assert heap.peek() == ("a", 1.0)
    assert heap.get("a") == 1.0 and "a" in heap and len(heap) == 2
    heap.discard("a")
    heap.discard("zzz")
    assert heap.next_time() == 3.0
    assert heap.pop_due(2.9) == []
    assert heap.pop_due(3.0) == [("b", 3.0)]
    assert heap.peek() is None and len(heap) == 0


def test_ties_pop_in_set_order() -> None:
    heap: TimerHeap[int] = TimerHeap()
    for k in range(10):
        heap.set(k, 1.0)
    assert [k for k, _ in heap.pop_due(1.0)] == list(range(10))


def test_random_against_model_and_compaction() -> None:
    rng = random.Random(7)
    heap: TimerHeap[int] = TimerHeap()
    model: dict[int, float] = {}
    now = 0.0
    for _ in range(30_000):
        k = rng.randrange(50)
        r = rng.random()
        if r < 0.6:
            t = now + rng.random() * 10
            heap.set(k, t)
            model[k] = t
        elif r < 0.8:
            heap.discard(k)
            model.pop(k, None)
        else:
            now += rng.random()
            got = heap.pop_due(now)
            want = sorted((t, kk) for kk, t in model.items() if t <= now)
            assert [t for _, t in got] == [t for t, _ in want]
            assert {kk for kk, _ in got} == {kk for _, kk in want}
            for kk, _ in got:
                del model[kk]
        assert heap.heap_size <= 3 * len(heap) + 64 + 1
        assert heap.next_time() == (min(model.values()) if model else None)
