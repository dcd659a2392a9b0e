"""Daemon time: raw monotonic readings in, stalls taken out (no sleeps, no real clock)."""

from __future__ import annotations

import pytest

from kvd.core.clock import Stall, StallClock


def test_time_runs_with_the_raw_clock_while_the_daemon_ticks() -> None:
    c = StallClock(100.0, tick=0.1, max_gap=1.0)
    for i in range(1, 50):
        assert c.observe(100.0 + i * 0.1) == pytest.approx(100.0 + i * 0.1)
    assert c.stalled == 0.0 and c.stall_count == 0 and c.last_stall is None


def test_a_gap_longer_than_max_gap_is_a_stall_and_does_not_count() -> None:
    c = StallClock(0.0, tick=0.1, max_gap=1.0)
    assert c.observe(0.5) == 0.5
    # frozen for 10 s: daemon time advances by one tick only
    assert c.observe(10.5) == pytest.approx(0.6)
    assert c.stall_count == 1
    assert c.last_stall == Stall(began=0.5, seconds=pytest.approx(9.9))
    # and runs on from there
    assert c.observe(11.0) == pytest.approx(1.1)
    # a second stall adds up
    assert c.observe(31.0) == pytest.approx(1.2)
    assert c.stall_count == 2 and c.stalled == pytest.approx(29.8)


def test_a_deadline_in_daemon_time_outlives_a_stall() -> None:
    """A lease due 5 s after its grant is still 4 s away after a 10 s freeze 1 s in."""
    c = StallClock(0.0, tick=0.1, max_gap=1.0)
    deadline = c.observe(0.0) + 5.0
    c.observe(1.0)
    assert deadline - c.observe(11.0) == pytest.approx(3.9)


def test_gaps_up_to_max_gap_are_time_not_stalls() -> None:
    c = StallClock(0.0, tick=0.1, max_gap=1.0)
    assert c.observe(1.0) == 1.0  # exactly max_gap: a slow tick, not a stall
    assert c.stall_count == 0


def test_readings_from_the_past_are_not_observations() -> None:
    """Several callers read the clock; an older reading neither moves it back nor
    makes the next gap look longer."""
    c = StallClock(0.0, tick=0.1, max_gap=1.0)
    c.observe(5.0)  # a stall of 4.9
    assert c.observe(4.5) == pytest.approx(4.5 - 4.9)
    assert c.observe(5.5) == pytest.approx(0.6)
    assert c.stall_count == 1


def test_an_infinite_max_gap_never_sees_a_stall() -> None:
    c = StallClock(0.0, tick=0.1, max_gap=float("inf"))
    assert c.observe(3600.0) == 3600.0 and c.stall_count == 0


@pytest.mark.parametrize(("tick", "max_gap"), [(0.0, 1.0), (1.0, 1.0), (2.0, 1.0), (-1.0, 1.0)])
def test_tick_must_be_below_max_gap(tick: float, max_gap: float) -> None:
    with pytest.raises(ValueError):
        StallClock(0.0, tick=tick, max_gap=max_gap)
