"""`kvd top`'s frame is a pure function of two status snapshots: figures, rates, width."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from kvd.top import ERROR_ROWS, WIDTH, render


def _status(done: int, nbytes: int, failures: dict[str, int], rejected: int) -> dict[str, Any]:
    return {
        "agent_name": "kvd-node-a-with-a-rather-long-agent-name",
        "version": "0.1.0",
        "uptime_s": 12.0,
        "mailboxes": {"sender": {"depth": 3}, "receiver": {"depth": 0}},
        "counters": {"sends_ok": done, "recv_ok": 0, "notifs_rejected": rejected},
        "nixl": {"bytes_moved": nbytes, "inflight": 1, "errors": {}},
        "sender": {
            "sending": 1,
            "leases": 4,
            "pending_registrations": 2,
            "early_pulls": 0,
            "failures": failures,
            "xfer_stats": {
                "WRITE": {
                    "count": done,
                    "bytes_sum": nbytes,
                    "xfer_time_p50_s": 0.005,
                    "xfer_time_p90_s": 0.025,
                }
            },
            "by_peer": {"kvd-d": {"transfers": done, "bytes": nbytes, "failed": 1}},
        },
        "receiver": {"sending": 0, "tracked": 0, "receiving": 0, "failures": {}},
        "regions": [{"nbytes": 1 << 20}],
        "peers": [{"agent": "kvd-d", "addr": "10.0.0.2:5600"}],
        "sessions": [{}, {}],
        "ecrouter": {
            "producer": {"used": 3, "blocks": 64, "pinned": 1, "entries": 3, "evicted": 0},
            "consumer": None,
            "hits": 3,
            "misses": 1,
        },
        "tiers": {"host": {"used": 10, "blocks": 100, "entries": 10, "evicted": 2}},
    }


def _text(frame: Any) -> str:
    buf = io.StringIO()
    Console(file=buf, width=WIDTH, color_system=None).print(frame)
    return buf.getvalue()


def test_frame_shows_rates_errors_ec_tiers_and_peers_in_80_columns() -> None:
    prev = _status(10, 10_000_000, {"expired": 1}, 0)
    cur = _status(30, 50_000_000, {"expired": 1, "transfer": 2}, 5)
    out = _text(render(cur, prev, 2.0))
    assert all(len(line) <= WIDTH for line in out.splitlines()), out
    assert "kvd-node-a" in out
    assert "moved 50.0 MB (20.0 MB/s)" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    # WRITE: 30 transfers, (30 - 10) / 2 s = 10.0/s, 20 MB/s, buckets' bounds as p50/p90
    assert lines["WRITE"].split()[2:7] == ["30", "10.0", "20.0", "MB", "50.0"], lines["WRITE"]
    assert "<=5ms" in lines["WRITE"] and "<=25ms" in lines["WRITE"]
    assert "ec producer" in out and "tier host" in out and "ec hits/misses" in out
    # errors: totals, and what is new since the previous frame
    assert "P transfer" in out and "+2" in out
    assert "notifs_rejected" in out and "+5" in out
    assert "P expired" in out
    assert "kvd-d" in out and "10.0.0.2:5600" in out


def test_first_frame_has_no_rates() -> None:
    out = _text(render(_status(3, 3000, {}, 0), None, 0.0))
    assert "moved 3.0 kB (-/s)" in out
    assert "none" in out  # no errors


def test_errors_table_shows_the_newest_few_and_counts_the_rest() -> None:
    """Many reasons would push the peers off a short terminal: the newest ERROR_ROWS are
    shown (new ones first), the rest counted in one row; the peers stay in the frame."""
    prev = _status(1, 1000, {}, 0)
    cur = _status(1, 1000, {}, 0)
    old = {f"old_{i}_failed": 1 for i in range(10)}
    prev["counters"] = {**prev["counters"], **old}
    cur["counters"] = {**cur["counters"], **old, "fresh_failed": 3}
    out = _text(render(cur, prev, 1.0))
    rows = [line for line in out.splitlines() if "_failed" in line]
    assert len(rows) == ERROR_ROWS and "fresh_failed" in rows[0] and "+3" in rows[0], out
    assert f"{11 - ERROR_ROWS} more" in out
    assert "kvd-d" in out and "10.0.0.2:5600" in out
