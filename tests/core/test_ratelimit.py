"""LogLimiter: which lines about repeated events are written. Time is an argument; no sleeps."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvd.core.ratelimit import LogLimiter

OVER = "overflow"


def limiter(interval: float = 10.0, max_keys: int = 8) -> LogLimiter[str]:
    return LogLimiter(interval, max_keys, OVER)


def test_first_occurrence_is_logged_then_one_summary_per_interval() -> None:
    lim = limiter()
    assert lim.hit("a", 100.0) == 0  # logged at once, nothing suppressed before it
    assert [lim.hit("a", 100.0 + i * 0.001) for i in range(1, 1000)] == [None] * 999
    assert lim.next_deadline() == 110.0
    assert lim.due(109.999) == []
    assert lim.due(110.0) == [("a", 999)]
    # The summary was a line: the next window runs from it, so the flood goes on quietly.
    assert lim.hit("a", 115.0) is None
    assert lim.next_deadline() == 120.0
    assert lim.due(120.5) == [("a", 1)]


def test_a_key_quiet_for_a_whole_window_is_forgotten_and_logs_at_once_again() -> None:
    lim = limiter()
    assert lim.hit("a", 0.0) == 0
    assert len(lim) == 1
    assert lim.due(10.0) == []  # nothing was suppressed: no summary, and the key goes
    assert len(lim) == 0 and lim.next_deadline() is None
    assert lim.hit("a", 10.5) == 0


def test_a_hit_after_the_window_ended_carries_the_summary_when_due_was_late() -> None:
    lim = limiter()
    lim.hit("a", 0.0)
    lim.hit("a", 1.0)
    lim.hit("a", 2.0)
    assert lim.hit("a", 12.0) == 2  # logged now, mentioning the two not logged
    assert lim.due(13.0) == []
    assert lim.hit("a", 13.0) is None
    assert lim.due(22.0) == [("a", 1)]


def test_keys_are_independent() -> None:
    lim = limiter()
    assert lim.hit("a", 0.0) == 0
    assert lim.hit("b", 5.0) == 0
    assert lim.hit("a", 6.0) is None
    assert lim.hit("b", 6.0) is None
    assert lim.hit("b", 7.0) is None
    assert lim.due(10.0) == [("a", 1)]
    assert lim.due(15.0) == [("b", 2)]


def test_memory_is_bounded_and_extra_keys_count_under_the_overflow_key() -> None:
    lim = limiter(max_keys=3)
    for k in "abc":
        assert lim.hit(k, 0.0) == 0
    assert lim.hit("d", 1.0) == 0  # the first overflow line is written (as the caller's)
    for i in range(10_000):
        assert lim.hit(f"new-{i}", 2.0) is None
    assert len(lim) == 4  # a, b, c and the overflow key: nothing per new key
    assert sorted(lim.due(11.0)) == [(OVER, 10_000)]
    # once the windows end, room comes back for new keys
    lim.due(21.0)
    assert len(lim) == 0
    assert lim.hit("e", 22.0) == 0


def test_drain_gives_every_open_summary_and_forgets_everything() -> None:
    lim = limiter()
    lim.hit("a", 0.0)
    lim.hit("a", 1.0)
    lim.hit("b", 2.0)
    assert lim.drain() == [("a", 1)]
    assert len(lim) == 0 and lim.next_deadline() is None
    assert lim.hit("a", 3.0) == 0


@pytest.mark.parametrize("interval", [0.0, -1.0, math.nan])
def test_interval_must_be_positive(interval: float) -> None:
    with pytest.raises(ValueError, match="interval"):
        LogLimiter(interval, 8, OVER)


def test_max_keys_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_keys"):
        LogLimiter(1.0, 0, OVER)


events = st.lists(
    st.tuples(
        st.sampled_from("abcdef"),
        st.floats(min_value=0.0, max_value=7.0),
        st.booleans(),
    ),
    max_size=400,
)


def run_schedule(
    lim: LogLimiter[str], events: list[tuple[str, float, bool]]
) -> tuple[int, int, list[tuple[str, float]]]:
    """Feed hits (and, where asked, a `due` call first) at increasing times; returns
    (occurrences written as a line, occurrences reported as suppressed, lines as
    (key, time))."""
    now = 0.0
    written = summarised = 0
    lines: list[tuple[str, float]] = []
    for key, dt, call_due in events:
        now += dt
        if call_due:
            for k, n in lim.due(now):
                summarised += n
                lines.append((k, now))
        got = lim.hit(key, now)
        if got is not None:
            written += 1
            summarised += got
            lines.append((key, now))
        assert len(lim) <= lim.max_keys + 1
    summarised += sum(n for _, n in lim.drain())
    return written, summarised, lines


@settings(max_examples=300, deadline=None)
@given(events=events, interval=st.sampled_from([0.5, 1.0, 5.0]), max_keys=st.integers(1, 6))
def test_every_occurrence_is_a_line_or_counted_in_exactly_one(
    events: list[tuple[str, float, bool]], interval: float, max_keys: int
) -> None:
    """Against any schedule of hits and (possibly late) `due` calls, with or without
    overflowing keys, memory stays within max_keys + 1 keys and nothing is lost or
    counted twice."""
    written, summarised, _ = run_schedule(LogLimiter(interval, max_keys, OVER), events)
    assert written + summarised == len(events)


@settings(max_examples=300, deadline=None)
@given(events=events, interval=st.sampled_from([0.5, 1.0, 5.0]))
def test_lines_of_a_key_are_at_least_an_interval_apart(
    events: list[tuple[str, float, bool]], interval: float
) -> None:
    """So a flood lasting T costs at most 1 + T / interval lines per key (room for every
    key here: with fewer slots, lines of overflowing keys are the overflow key's)."""
    _, _, lines = run_schedule(LogLimiter(interval, 6, OVER), events)
    last: dict[str, float] = {}
    for key, at in lines:
        if key in last:
            assert at - last[key] >= interval - 1e-9, (key, last[key], at)
        last[key] = at
