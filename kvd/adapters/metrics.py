"""Prometheus exporter: the daemon's counters, mailbox depths and NIXL statistics.

prometheus-client serves /metrics from its own thread; the collector only copies plain
numbers the actors already keep (a dict copy and integer reads under the GIL), so it
never touches an actor's state machine or blocks the event loop.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

from prometheus_client import start_http_server
from prometheus_client.core import CollectorRegistry, CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector


class DaemonCollector(Collector):
    def __init__(
        self,
        agent: str,
        counters: Mapping[str, int],
        mailboxes: Callable[[], Mapping[str, Mapping[str, Any]]],
        nixl: Callable[[], Mapping[str, Any]],
    ) -> None:
        self.agent = agent
        self.counters = counters
        self.mailboxes = mailboxes
        self.nixl = nixl

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        events = CounterMetricFamily(
            "kvd_events",
            "Daemon counters (transfers, leases, rejections, ...)",
            labels=["agent", "name"],
        )
        for name, value in sorted(dict(self.counters).items()):
            events.add_metric([self.agent, name], float(value))
        yield events
        depth = GaugeMetricFamily(
            "kvd_mailbox_depth", "Messages waiting per actor", labels=["agent", "mailbox"]
        )
        rejected = CounterMetricFamily(
            "kvd_mailbox_rejected", "Messages refused BUSY per actor", labels=["agent", "mailbox"]
        )
        for name, st in self.mailboxes().items():
            depth.add_metric([self.agent, name], float(st.get("depth", 0)))
            rejected.add_metric([self.agent, name], float(st.get("rejected", 0)))
        yield depth
        yield rejected
        nixl = dict(self.nixl())
        for key in (
            "transfers_posted",
            "transfers_done",
            "transfers_failed",
            "bytes_moved",
            "notifs_sent",
            "notifs_received",
        ):
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


def serve_metrics(host: str, port: int, collector: DaemonCollector) -> Any:
    """Start the exporter on its own thread; returns the server (call `.shutdown()`)."""
    registry = CollectorRegistry()
    registry.register(collector)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server
