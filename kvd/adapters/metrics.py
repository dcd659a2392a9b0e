"""Prometheus exporter: the daemon's counters, histograms, mailbox depths and NIXL figures.

prometheus-client serves /metrics from its own thread; the collector only copies plain
numbers the actors already keep (dict and list copies and integer reads, each one step
under the GIL), so it never touches an actor's state machine, takes no lock an actor
takes, and never blocks the event loop. The transfer histograms are kept by the actors
that complete the transfers (`kvd.core.stats`, fed in `kvd.actors.transfers`) with
vLLM's `vllm:nixl_*` bucket bounds; here they become `kvd_nixl_*` histograms.

Every series carries `agent` (the daemon's NIXL agent name). README "Metrics" lists them;
`configs/grafana/kvd.json` charts them (a test checks the two agree).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from prometheus_client import start_http_server
from prometheus_client.core import (
    CollectorRegistry,
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from kvd.core.stats import Histogram, TransferStats

NIXL_COUNTERS: Final = (
    "transfers_posted",
    "transfers_done",
    "transfers_failed",
    "bytes_moved",
    "notifs_sent",
    "notifs_received",
    "notifs_dropped",
    "doorbell_rung",
    "doorbell_wakes",
)

TIER_COUNTERS: Final = {
    "hits": "KV tiers: keys looked up and found in the tier",
    "misses": "KV tiers: keys looked up and not found in the tier",
    "evictions": "KV tiers: blocks evicted from the tier",
    "bytes_in": "KV tiers: bytes stored into the tier (peer: READ from peers' tiers)",
    "bytes_out": "KV tiers: bytes loaded out of the tier (peer: pinned for peers to READ)",
}
TIER_GAUGES: Final = {
    "capacity_bytes": "KV tiers: the tier's capacity in bytes",
    "used_bytes": "KV tiers: bytes of blocks the tier holds",
    "blocks": "KV tiers: blocks the tier holds",
}

HISTOGRAMS: Final = {
    "xfer_time": ("kvd_nixl_xfer_time_seconds", "Seconds from posting a NIXL transfer to done"),
    "post_time": ("kvd_nixl_post_time_seconds", "Seconds spent preparing and posting a transfer"),
    "bytes": ("kvd_nixl_bytes_transferred", "Bytes per completed NIXL transfer"),
    "descriptors": ("kvd_nixl_num_descriptors", "Descriptors per completed NIXL transfer"),
}

COUNTER_SERIES: Final = {
    # series name (without _total): (daemon counter, help)
    "kvd_leases_expired": ("leases_expired", "P: leases that expired before a transfer"),
    "kvd_notifs_after_expiry": (
        "notifs_after_expiry",
        "P: D registrations or pulls naming a request whose lease had expired",
    ),
    "kvd_nixl_num_failed_notifications": (
        "notifs_failed",
        "Notifications to a peer that NIXL could not send",
    ),
}


@dataclass(frozen=True)
class Sources:
    """Where the collector reads (each a plain structure one actor owns, or a callable
    that only reads such)."""

    counters: Mapping[str, int]
    mailboxes: Callable[[], Mapping[str, Mapping[str, Any]]]
    nixl: Callable[[], Mapping[str, Any]]
    transfer_stats: Sequence[TransferStats] = ()
    failures: Mapping[str, Mapping[str, int]] | None = None
    """Per side ("sender", "receiver"): requests ended failed, by reason."""
    in_flight: Callable[[], Mapping[str, int]] | None = None
    """Per side: requests with a transfer in flight."""
    leases: Callable[[], int] | None = None
    clients: Callable[[], Mapping[str, int]] | None = None
    """Open client sessions per role."""
    tiers: Callable[[], Mapping[str, float]] | None = None
    """KV tiers' gauges: `<tier>_capacity_bytes`, `<tier>_used_bytes`, `<tier>_blocks`."""


class DaemonCollector(Collector):
    def __init__(self, agent: str, sources: Sources) -> None:
        self.agent = agent
        self.src = sources

    def collect(self) -> Iterator[Metric]:
        a = self.agent
        counters = dict(self.src.counters)
        events = CounterMetricFamily(
            "kvd_events",
            "Daemon counters (transfers, leases, rejections, ...)",
            labels=["agent", "name"],
        )
        for name, value in sorted(counters.items()):
            events.add_metric([a, name], float(value))
        yield events
        for series, (key, doc) in COUNTER_SERIES.items():
            c = CounterMetricFamily(series, doc, labels=["agent"])
            c.add_metric([a], float(counters.get(key, 0)))
            yield c
        yield from self._mailboxes()
        yield from self._nixl()
        yield from self._histograms()
        yield from self._requests()
        yield from self._tiers(counters)

    def _mailboxes(self) -> Iterator[Metric]:
        depth = GaugeMetricFamily(
            "kvd_mailbox_depth", "Messages waiting per actor", labels=["agent", "mailbox"]
        )
        rejected = CounterMetricFamily(
            "kvd_mailbox_rejected", "Messages refused BUSY per actor", labels=["agent", "mailbox"]
        )
        for name, st in self.src.mailboxes().items():
            depth.add_metric([self.agent, name], float(st.get("depth", 0)))
            rejected.add_metric([self.agent, name], float(st.get("rejected", 0)))
        yield depth
        yield rejected

    def _nixl(self) -> Iterator[Metric]:
        nixl = dict(self.src.nixl())
        for key in NIXL_COUNTERS:
            c = CounterMetricFamily(
                f"kvd_nixl_{key}", f"NIXL engine: {key.replace('_', ' ')}", labels=["agent"]
            )
            c.add_metric([self.agent], float(nixl.get(key, 0)))
            yield c
        inflight = GaugeMetricFamily(
            "kvd_nixl_inflight", "NIXL transfers in flight", labels=["agent"]
        )
        inflight.add_metric([self.agent], float(nixl.get("inflight", 0)))
        yield inflight
        errors = CounterMetricFamily(
            "kvd_nixl_errors",
            "NIXL exceptions by type (posting, completion, handle release)",
            labels=["agent", "error"],
        )
        for name, n in sorted(dict(nixl.get("errors", {})).items()):
            errors.add_metric([self.agent, name], float(n))
        yield errors

    def _histograms(self) -> Iterator[Metric]:
        merged: dict[str, dict[str, list[Histogram]]] = {}
        for stats in self.src.transfer_stats:
            for op, hists in list(stats.by_op.items()):
                for kind, h in hists.items():
                    merged.setdefault(kind, {}).setdefault(op, []).append(h)
        for kind, (series, doc) in HISTOGRAMS.items():
            fam = HistogramMetricFamily(series, doc, labels=["agent", "op"])
            for op, same in sorted(merged.get(kind, {}).items()):
                buckets, total = _merge(same)
                fam.add_metric([self.agent, op], buckets, total)
            yield fam

    def _requests(self) -> Iterator[Metric]:
        failures = CounterMetricFamily(
            "kvd_request_failures",
            "Requests ended failed or expired, by side and reason (error code or expired)",
            labels=["agent", "side", "reason"],
        )
        for side, by_reason in (self.src.failures or {}).items():
            for reason, n in sorted(dict(by_reason).items()):
                failures.add_metric([self.agent, side, reason], float(n))
        yield failures
        in_flight = GaugeMetricFamily(
            "kvd_transfers_in_flight",
            "Requests with a transfer in flight",
            labels=["agent", "side"],
        )
        if self.src.in_flight is not None:
            for side, n in self.src.in_flight().items():
                in_flight.add_metric([self.agent, side], float(n))
        yield in_flight
        leases = GaugeMetricFamily("kvd_leases", "P: leases held now", labels=["agent"])
        leases.add_metric([self.agent], float(self.src.leases() if self.src.leases else 0))
        yield leases
        clients = GaugeMetricFamily(
            "kvd_clients", "Open client sessions per role", labels=["agent", "role"]
        )
        for role, n in sorted((self.src.clients() if self.src.clients else {}).items()):
            clients.add_metric([self.agent, role], float(n))
        yield clients

    def _tiers(self, counters: Mapping[str, int]) -> Iterator[Metric]:
        if self.src.tiers is None:
            return
        gauges = dict(self.src.tiers())
        tiers = [t for t in ("host", "disk") if f"{t}_capacity_bytes" in gauges]
        counted = tiers + (["peer"] if "peer_asked" in gauges else [])  # peers' tiers
        for key, doc in TIER_COUNTERS.items():
            c = CounterMetricFamily(f"kvd_tiers_{key}", doc, labels=["agent", "tier"])
            for t in counted:
                c.add_metric([self.agent, t], float(counters.get(f"tiers_{t}_{key}", 0)))
            yield c
        for key, doc in TIER_GAUGES.items():
            g = GaugeMetricFamily(f"kvd_tiers_{key}", doc, labels=["agent", "tier"])
            for t in tiers:
                g.add_metric([self.agent, t], float(gauges.get(f"{t}_{key}", 0.0)))
            yield g


def _merge(hists: Sequence[Histogram]) -> tuple[list[tuple[str, float]], float]:
    """Cumulative Prometheus buckets and the sum of histograms with the same bounds."""
    counts = [0] * (len(hists[0].bounds) + 1)
    total = 0.0
    for h in hists:
        c, s = h.snapshot()
        counts = [x + y for x, y in zip(counts, c, strict=True)]
        total += s
    out: list[tuple[str, float]] = []
    acc = 0
    for bound, n in zip((*(repr(float(b)) for b in hists[0].bounds), "+Inf"), counts, strict=True):
        acc += n
        out.append((bound, float(acc)))
    return out, total


def serve_metrics(host: str, port: int, collector: DaemonCollector) -> Any:
    """Start the exporter on its own thread; returns the server (call `.shutdown()`)."""
    registry = CollectorRegistry()
    registry.register(collector)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
