"""Per-transfer statistics an actor keeps as plain numbers: fixed-bucket histograms.

The transfer actors observe every NIXL transfer they complete here (transfer time, post
time, bytes, descriptors, by op), on the event loop, without a lock: the histogram is a
list of integers and a float that only its owner writes. The Prometheus exporter
(`kvd.adapters.metrics`) copies them from its own thread (a list copy under the GIL) and
exposes them as histograms; `kvd status` shows them too. Bucket bounds follow vLLM's
`vllm:nixl_*` histograms, so a dashboard built for one reads the other.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

TIME_BUCKETS: Final = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
"""Seconds: vLLM's `vllm:nixl_post_time_seconds` bounds."""

XFER_TIME_BUCKETS: Final = TIME_BUCKETS[1:]
"""Seconds: vLLM's `vllm:nixl_xfer_time_seconds` bounds (the same, less the first)."""

BYTES_BUCKETS: Final = tuple(float(2 ** (10 + i)) for i in range(1, 25, 2))
"""2 KiB to 8 GiB in steps of 4x: vLLM's `vllm:nixl_bytes_transferred` bounds."""

DESCRIPTOR_BUCKETS: Final = (
    10.0,
    20.0,
    30.0,
    50.0,
    75.0,
    100.0,
    200.0,
    400.0,
    1000.0,
    2000.0,
    4000.0,
    10000.0,
    20000.0,
    50000.0,
)
"""vLLM's `vllm:nixl_num_descriptors` bounds."""


@dataclass(frozen=True, slots=True)
class XferTiming:
    """What the transport measured of one transfer: the seconds it took to prepare and
    post it (descriptor lists, `initialize_xfer`, `transfer`), and from the start of that
    until NIXL reported it done (the post included, as in NIXL's own telemetry: a
    same-host copy may be done inside the post)."""

    post_s: float
    xfer_s: float


class Histogram:
    """Counts per bucket (not cumulative; the last is +Inf) and the sum of observations."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        if list(bounds) != sorted(set(bounds)):
            raise ValueError("bucket bounds must be strictly increasing")
        self.bounds: Final = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        # bisect_left: a value equal to a bound falls in that bucket (Prometheus's `le`)
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    @property
    def count(self) -> int:
        return sum(self.counts)

    def snapshot(self) -> tuple[list[int], float]:
        """(counts, sum), each copied in one step; safe to call from another thread."""
        return list(self.counts), self.total

    def quantile(self, q: float) -> float | None:
        """The upper bound of the bucket holding the q-quantile (None when empty; the last
        finite bound when it lies in +Inf): a coarse figure for `kvd top`."""
        counts, _ = self.snapshot()
        n = sum(counts)
        if n == 0:
            return None
        rank = q * n
        acc = 0
        for i, c in enumerate(counts):
            acc += c
            if acc >= rank and c:
                return self.bounds[min(i, len(self.bounds) - 1)]
        return self.bounds[-1]


class TransferStats:
    """The four histograms of vLLM's NIXL connector, per op ("WRITE"/"READ")."""

    KINDS: Final = ("xfer_time", "post_time", "bytes", "descriptors")

    def __init__(self) -> None:
        self.by_op: dict[str, dict[str, Histogram]] = {}

    def _op(self, op: str) -> dict[str, Histogram]:
        hists = self.by_op.get(op)
        if hists is None:
            hists = {
                "xfer_time": Histogram(XFER_TIME_BUCKETS),
                "post_time": Histogram(TIME_BUCKETS),
                "bytes": Histogram(BYTES_BUCKETS),
                "descriptors": Histogram(DESCRIPTOR_BUCKETS),
            }
            self.by_op[op] = hists  # one assignment: a reader sees all four or none
        return hists

    def observe(self, op: str, timing: XferTiming, nbytes: int, descriptors: int) -> None:
        h = self._op(op)
        h["xfer_time"].observe(timing.xfer_s)
        h["post_time"].observe(timing.post_s)
        h["bytes"].observe(float(nbytes))
        h["descriptors"].observe(float(descriptors))

    def summary(self) -> dict[str, dict[str, float | int | None]]:
        """Per op: count, sums and coarse p50/p90 (for `kvd status` and `kvd top`)."""
        out: dict[str, dict[str, float | int | None]] = {}
        for op, h in list(self.by_op.items()):
            out[op] = {
                "count": h["xfer_time"].count,
                "xfer_time_sum_s": round(h["xfer_time"].total, 6),
                "xfer_time_p50_s": h["xfer_time"].quantile(0.5),
                "xfer_time_p90_s": h["xfer_time"].quantile(0.9),
                "post_time_sum_s": round(h["post_time"].total, 6),
                "bytes_sum": int(h["bytes"].total),
                "descriptors_sum": int(h["descriptors"].total),
            }
        return out
