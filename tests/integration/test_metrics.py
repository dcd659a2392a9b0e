"""The Prometheus exporter serves the daemon's real counters when metrics.port is set."""

from __future__ import annotations

import socket
import urllib.request

from kvd.demo import make_engine

from .conftest import StartDaemon


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def test_metrics_exporter_reports_counters_and_mailboxes(daemons: StartDaemon) -> None:
    port = _free_port()
    p_d = daemons("kvd-mp", f"[metrics]\nport = {port}\n")
    d_d = daemons("kvd-md")
    p = make_engine(p_d.socket, "prefill", num_blocks=8, num_layers=2, chunk_bytes=4096)
    d = make_engine(d_d.socket, "decode", num_blocks=8, num_layers=2, chunk_bytes=4096)
    try:
        p.block(0, 1)[:] = 9
        d.client.register_push("m-1-aaaaaaaa", [2], "127.0.0.1", p_d.side_port)
        p.client.finished("m-1-bbbbbbbb", [1])
        assert [type(e).__name__ for e in d.client.wait_events(10)] == ["RecvFinished"]
        assert [type(e).__name__ for e in p.client.wait_events(10)] == ["SendFinished"]
        text = _scrape(port)
    finally:
        p.close()
        d.close()
    assert 'kvd_events_total{agent="kvd-mp",name="leases_granted"} 1.0' in text
    assert 'kvd_events_total{agent="kvd-mp",name="sends_ok"} 1.0' in text
    assert 'kvd_mailbox_depth{agent="kvd-mp",mailbox="sender"}' in text
    assert 'kvd_nixl_transfers_done_total{agent="kvd-mp"} 1.0' in text
