"""The Prometheus exporter of real daemons: the series exist and move as transfers happen.

Two daemons (P and D), both exporting; real pushes (P's WRITEs) and pulls (D's READs)
of real blocks; each scrape is compared with the one before: histogram counts grow by the
transfers made, their byte sums by exactly the bytes moved (as computed from the blocks
and as counted by NIXL), an expired lease and a registration after it show in their
counters and in the failures by reason, and the client gauge follows the sessions.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

from kvd_client import wire
from kvd_client.errors import ErrorCode
from prometheus_client.parser import text_string_to_metric_families

from kvd.demo import Engine, make_engine

from .conftest import StartDaemon
from .ports import restart_port

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

DASHBOARD = Path(__file__).resolve().parents[2] / "configs" / "grafana" / "kvd.json"


def _free_port() -> int:
    return restart_port()  # not from the ephemeral range: free until the daemon binds it


def _scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return str(r.read().decode())


def _samples(port: int) -> Samples:
    out: Samples = {}
    for fam in text_string_to_metric_families(_scrape(port)):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _get(samples: Samples, series: str, /, **labels: str) -> float:
    return samples.get((series, tuple(sorted(labels.items()))), 0.0)


def _wait(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def _one(eng: Engine, kind: type[wire.Record]) -> wire.Record:
    (ev,) = eng.client.wait_events(10)
    assert isinstance(ev, kind), ev
    return ev


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


def test_histograms_and_failures_move_with_real_transfers(daemons: StartDaemon) -> None:
    p_port, d_port = _free_port(), _free_port()
    p_d = daemons(
        "kvd-hp",
        f"[metrics]\nport = {p_port}\n",
        # short, so that the expiry below comes soon; long enough that no push or pull
        # here outlives it on a loaded machine
        overrides={"transfer": {"kv_lease_duration": 3.0}},
    )
    d_d = daemons("kvd-hd", f"[metrics]\nport = {d_port}\n")
    p = make_engine(p_d.socket, "prefill", num_blocks=32, num_layers=2, chunk_bytes=4096)
    d = make_engine(d_d.socket, "decode", num_blocks=32, num_layers=2, chunk_bytes=4096)
    agent_p, agent_d = "kvd-hp", "kvd-hd"
    try:
        p0 = _samples(p_port)
        assert _get(p0, "kvd_clients", agent=agent_p, role="scheduler") == 1
        assert _get(p0, "kvd_nixl_xfer_time_seconds_count", agent=agent_p, op="WRITE") == 0

        # pushes: P WRITEs; block counts 1..4, so byte sums tell them apart
        pushed = 0
        for i, n in enumerate((1, 2, 3, 4)):
            p_blocks = list(range(i * 4, i * 4 + n))
            d_blocks = list(range(16 + i * 4, 16 + i * 4 + n))
            for b in p_blocks:
                p.block(0, b)[:] = i + 1
            d.client.register_push(f"h-{i}-aaaaaaaa", d_blocks, "127.0.0.1", p_d.side_port)
            p.client.finished(f"h-{i}-bbbbbbbb", p_blocks)
            _one(d, wire.RecvFinished)
            _one(p, wire.SendFinished)
            assert all((d.block(0, b) == i + 1).all() for b in d_blocks)
            pushed += n * p.block_bytes
        p1 = _samples(p_port)

        def delta(series: str, /, **labels: str) -> float:
            return _get(p1, series, **labels) - _get(p0, series, **labels)

        w = {"agent": agent_p, "op": "WRITE"}
        assert delta("kvd_nixl_xfer_time_seconds_count", **w) == 4
        assert delta("kvd_nixl_post_time_seconds_count", **w) == 4
        assert delta("kvd_nixl_bytes_transferred_count", **w) == 4
        assert delta("kvd_nixl_num_descriptors_count", **w) == 4
        assert delta("kvd_nixl_bytes_transferred_sum", **w) == pushed
        assert delta("kvd_nixl_bytes_moved_total", agent=agent_p) == pushed
        assert delta("kvd_nixl_num_descriptors_sum", **w) == delta(
            "kvd_events_total", agent=agent_p, name="descriptors"
        )
        xfer_s = delta("kvd_nixl_xfer_time_seconds_sum", **w)
        assert 0 < delta("kvd_nixl_post_time_seconds_sum", **w) <= xfer_s
        # cumulative buckets: +Inf holds all, le=32768 those of at most 32 KiB
        small = sum(1 for n in (1, 2, 3, 4) if n * p.block_bytes <= 32768)
        assert 0 < small < 4
        assert _get(p1, "kvd_nixl_bytes_transferred_bucket", le="+Inf", **w) == 4
        assert _get(p1, "kvd_nixl_bytes_transferred_bucket", le="32768.0", **w) == small
        # P's side had no READ; D's exporter saw no WRITE of its own
        assert _get(p1, "kvd_nixl_xfer_time_seconds_count", agent=agent_p, op="READ") == 0
        assert _get(_samples(d_port), "kvd_nixl_xfer_time_seconds_count", **w) == 0

        # pulls: D READs
        for b in range(4, 7):
            p.block(0, b)[:] = 77
        p.client.finished("hp-1-bbbbbbbb", [4, 5, 6])
        d.client.pull(
            "hp-1-aaaaaaaa",
            [24, 25, 26],
            "127.0.0.1",
            p_d.side_port,
            remote_request_id="hp-1-bbbbbbbb",
            remote_block_ids=[4, 5, 6],
        )
        _one(d, wire.RecvFinished)
        _one(p, wire.SendFinished)
        assert all((d.block(0, b) == 77).all() for b in (24, 25, 26))
        d1 = _samples(d_port)
        r = {"agent": agent_d, "op": "READ"}
        assert _get(d1, "kvd_nixl_xfer_time_seconds_count", **r) == 1
        assert _get(d1, "kvd_nixl_bytes_transferred_sum", **r) == 3 * p.block_bytes
        assert _get(d1, "kvd_nixl_bytes_moved_total", agent=agent_d) == 3 * p.block_bytes

        # an expired lease (no D ever asks), then D's registration after it
        assert _get(p1, "kvd_leases_expired_total", agent=agent_p) == 0
        p.client.finished("hx-1-bbbbbbbb", [8])
        _one(p, wire.SendExpired)
        d.client.register_push("hx-1-aaaaaaaa", [30], "127.0.0.1", p_d.side_port)
        ev = _one(d, wire.RecvFailed)
        assert isinstance(ev, wire.RecvFailed) and ev.code == int(ErrorCode.LEASE_EXPIRED)
        p2 = _samples(p_port)
        assert _get(p2, "kvd_leases_expired_total", agent=agent_p) == 1
        assert _get(p2, "kvd_notifs_after_expiry_total", agent=agent_p) == 1
        sides = {"agent": agent_p, "side": "sender"}
        assert _get(p2, "kvd_request_failures_total", reason="expired", **sides) == 1
        d2 = _samples(d_port)
        recv = {"agent": agent_d, "side": "receiver", "reason": "lease_expired"}
        assert _get(d2, "kvd_request_failures_total", **recv) == 1
        # nothing else failed, and the WRITE histogram did not move
        assert sum(v for (n, _), v in p2.items() if n == "kvd_request_failures_total") == 1
        assert _get(p2, "kvd_nixl_xfer_time_seconds_count", **w) == 4
        assert _get(p2, "kvd_leases", agent=agent_p) == 0
        assert _get(p2, "kvd_transfers_in_flight", agent=agent_p, side="sender") == 0
    finally:
        p.close()
        d.close()
    # the client gauge follows the sessions (the exporter outlives our clients)
    _wait(lambda: _get(_samples(p_port), "kvd_clients", agent=agent_p, role="scheduler") == 0)


def test_grafana_dashboard_uses_only_exported_series(daemons: StartDaemon) -> None:
    """Every series the dashboard queries is one the exporter serves (a renamed series
    would leave a panel silently empty)."""
    port = _free_port()
    daemons("kvd-gp", f"[metrics]\nport = {port}\n")
    families = {fam.name for fam in text_string_to_metric_families(_scrape(port))}
    exported = set()
    for fam in text_string_to_metric_families(_scrape(port)):
        exported.update(s.name for s in fam.samples)
    dash = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for panel in dash["panels"] for t in panel.get("targets", []) if "expr" in t]
    assert exprs
    used = set()
    for expr in exprs:
        used.update(tok for tok in _identifiers(expr) if tok.startswith("kvd_"))
    assert used, exprs
    missing = sorted(
        u
        for u in used
        if u not in exported and re.sub(r"_(bucket|sum|count|total)$", "", u) not in families
    )
    assert not missing, f"dashboard queries series the daemon does not export: {missing}"


def _identifiers(expr: str) -> list[str]:
    out: list[str] = []
    cur = ""
    for ch in expr + " ":
        if ch.isalnum() or ch in "_:":
            cur += ch
        else:
            if cur:
                out.append(cur)
            cur = ""
    return out
