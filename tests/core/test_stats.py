"""The transfer histograms: buckets as Prometheus counts them, sums, summaries."""

from __future__ import annotations

import pytest

from kvd.core.stats import (
    BYTES_BUCKETS,
    DESCRIPTOR_BUCKETS,
    TIME_BUCKETS,
    XFER_TIME_BUCKETS,
    Histogram,
    TransferStats,
    XferTiming,
)


def test_a_value_on_a_bound_falls_in_that_bucket() -> None:
    h = Histogram((1.0, 2.0, 4.0))
    for v in (0.5, 1.0, 1.5, 2.0, 4.0, 4.5, 100.0):
        h.observe(v)
    assert h.counts == [2, 2, 1, 2]  # <=1, <=2, <=4, +Inf
    assert h.count == 7 and h.total == pytest.approx(113.5)
    assert h.snapshot() == ([2, 2, 1, 2], pytest.approx(113.5))


def test_bounds_must_increase() -> None:
    with pytest.raises(ValueError):
        Histogram((1.0, 1.0))
    with pytest.raises(ValueError):
        Histogram((2.0, 1.0))


def test_bounds_are_vllms() -> None:
    assert TIME_BUCKETS[0] == 0.001 and TIME_BUCKETS[-1] == 5.0
    assert XFER_TIME_BUCKETS[0] == 0.005 and len(XFER_TIME_BUCKETS) == len(TIME_BUCKETS) - 1
    assert BYTES_BUCKETS[0] == 2048 and BYTES_BUCKETS[-1] == 2**33 and len(BYTES_BUCKETS) == 12
    assert DESCRIPTOR_BUCKETS[0] == 10 and DESCRIPTOR_BUCKETS[-1] == 50000


def test_quantile_is_the_bucket_bound() -> None:
    h = Histogram((1.0, 2.0, 4.0))
    assert h.quantile(0.5) is None
    for v in (0.5, 0.5, 3.0, 9.0):
        h.observe(v)
    assert h.quantile(0.5) == 1.0
    assert h.quantile(0.75) == 4.0
    assert h.quantile(1.0) == 4.0  # in +Inf: the last finite bound


def test_transfer_stats_by_op() -> None:
    st = TransferStats()
    st.observe("WRITE", XferTiming(0.0005, 0.003), 4096, 2)
    st.observe("WRITE", XferTiming(0.001, 0.2), 1 << 20, 40)
    st.observe("READ", XferTiming(0.002, 0.02), 8192, 1)
    w = st.by_op["WRITE"]
    assert w["xfer_time"].count == 2 and w["bytes"].total == 4096 + (1 << 20)
    assert w["descriptors"].total == 42 and w["post_time"].total == pytest.approx(0.0015)
    s = st.summary()
    assert s["WRITE"]["count"] == 2 and s["READ"]["count"] == 1
    assert s["WRITE"]["bytes_sum"] == 4096 + (1 << 20) and s["READ"]["descriptors_sum"] == 1
    assert s["WRITE"]["xfer_time_p50_s"] == 0.005
