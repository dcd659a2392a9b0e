"""Write configs/grafana/kvd.json, the Grafana dashboard of kvd's Prometheus series.

Run from the repository root: `python scripts/make_grafana_dashboard.py`. Every series a
panel queries must be one `kvd.adapters.metrics` exports (tests/integration/test_metrics.py
checks it against a running daemon); README "Operations > Metrics" lists them.
"""

import json
from pathlib import Path

A = 'agent=~"$agent"'


def sel(extra=""):
    return "{" + A + (", " + extra if extra else "") + "}"


R = "[$__rate_interval]"


def q(name, extra=""):
    return name + sel(extra)


panels_spec = [
    (
        "Throughput (bytes/s) by op",
        "sum by (agent, op) (rate(" + q("kvd_nixl_bytes_transferred_sum") + R + "))",
        "Bps",
        "{{agent}} {{op}}",
    ),
    (
        "Transfers completed /s by op",
        "sum by (agent, op) (rate(" + q("kvd_nixl_xfer_time_seconds_count") + R + "))",
        "ops",
        "{{agent}} {{op}}",
    ),
    (
        "Transfer time p50 / p99",
        [
            f"histogram_quantile({x}, sum by (le, agent, op) (rate("
            + q("kvd_nixl_xfer_time_seconds_bucket")
            + R
            + ")))"
            for x in ("0.5", "0.99")
        ],
        "s",
        ["p50 {{agent}} {{op}}", "p99 {{agent}} {{op}}"],
    ),
    (
        "Post time p50 / p99",
        [
            f"histogram_quantile({x}, sum by (le, agent, op) (rate("
            + q("kvd_nixl_post_time_seconds_bucket")
            + R
            + ")))"
            for x in ("0.5", "0.99")
        ],
        "s",
        ["p50 {{agent}} {{op}}", "p99 {{agent}} {{op}}"],
    ),
    (
        "Mean bytes per transfer",
        "sum by (agent, op) (rate("
        + q("kvd_nixl_bytes_transferred_sum")
        + R
        + ")) / sum by (agent, op) (rate("
        + q("kvd_nixl_bytes_transferred_count")
        + R
        + "))",
        "bytes",
        "{{agent}} {{op}}",
    ),
    (
        "Mean descriptors per transfer",
        "sum by (agent, op) (rate("
        + q("kvd_nixl_num_descriptors_sum")
        + R
        + ")) / sum by (agent, op) (rate("
        + q("kvd_nixl_num_descriptors_count")
        + R
        + "))",
        "short",
        "{{agent}} {{op}}",
    ),
    (
        "Transfers in flight",
        ["sum by (agent, side) (" + q("kvd_transfers_in_flight") + ")", q("kvd_nixl_inflight")],
        "short",
        ["requests {{agent}} {{side}}", "NIXL {{agent}}"],
    ),
    ("Leases held", q("kvd_leases"), "short", "{{agent}}"),
    (
        "Request failures /s by reason",
        "sum by (agent, side, reason) (rate(" + q("kvd_request_failures_total") + R + "))",
        "ops",
        "{{agent}} {{side}} {{reason}}",
    ),
    (
        "Expired leases and late notifications /s",
        [
            "rate(" + q("kvd_leases_expired_total") + R + ")",
            "rate(" + q("kvd_notifs_after_expiry_total") + R + ")",
        ],
        "ops",
        ["expired {{agent}}", "after expiry {{agent}}"],
    ),
    (
        "NIXL failures /s",
        [
            "rate(" + q("kvd_nixl_transfers_failed_total") + R + ")",
            "rate(" + q("kvd_nixl_num_failed_notifications_total") + R + ")",
            "sum by (agent, error) (rate(" + q("kvd_nixl_errors_total") + R + "))",
        ],
        "ops",
        ["transfers {{agent}}", "notifications {{agent}}", "{{error}} {{agent}}"],
    ),
    ("Mailbox depth", q("kvd_mailbox_depth"), "short", "{{agent}} {{mailbox}}"),
    (
        "Mailbox BUSY refusals /s",
        "rate(" + q("kvd_mailbox_rejected_total") + R + ")",
        "ops",
        "{{agent}} {{mailbox}}",
    ),
    ("Client sessions by role", q("kvd_clients"), "short", "{{agent}} {{role}}"),
    (
        "Rejected input /s (daemon counters)",
        "sum by (agent, name) (rate(" + q("kvd_events_total", 'name=~".*rejected.*"') + R + "))",
        "ops",
        "{{agent}} {{name}}",
    ),
    (
        "NIXL notifications /s",
        [
            "rate(" + q("kvd_nixl_notifs_sent_total") + R + ")",
            "rate(" + q("kvd_nixl_notifs_received_total") + R + ")",
        ],
        "ops",
        ["sent {{agent}}", "received {{agent}}"],
    ),
]
ds = {"type": "prometheus", "uid": "${datasource}"}
panels = []
for i, (title, exprs, unit, legends) in enumerate(panels_spec):
    if isinstance(exprs, str):
        exprs = [exprs]
        legends = [legends]
    panels.append(
        {
            "id": i + 1,
            "type": "timeseries",
            "title": title,
            "datasource": ds,
            "gridPos": {"h": 8, "w": 12, "x": (i % 2) * 12, "y": (i // 2) * 8},
            "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
            "options": {
                "legend": {"displayMode": "list", "placement": "bottom"},
                "tooltip": {"mode": "multi"},
            },
            "targets": [
                {"refId": chr(65 + j), "expr": e, "legendFormat": leg, "datasource": ds}
                for j, (e, leg) in enumerate(zip(exprs, legends, strict=True))
            ],
        }
    )
dash = {
    "title": "kvd",
    "uid": "kvd-overview",
    "description": (
        "kvd daemons: transfers (vLLM-style NIXL histograms), leases, failures, mailboxes, "
        "clients. Series: README, Operations > Metrics."
    ),
    "tags": ["kvd", "nixl", "kv-cache"],
    "timezone": "browser",
    "schemaVersion": 39,
    "version": 1,
    "refresh": "10s",
    "time": {"from": "now-1h", "to": "now"},
    "templating": {
        "list": [
            {
                "name": "datasource",
                "type": "datasource",
                "query": "prometheus",
                "label": "Data source",
            },
            {
                "name": "agent",
                "type": "query",
                "label": "Agent",
                "datasource": ds,
                "query": {"query": "label_values(kvd_nixl_inflight, agent)", "refId": "agent"},
                "definition": "label_values(kvd_nixl_inflight, agent)",
                "includeAll": True,
                "multi": True,
                "allValue": ".*",
                "refresh": 2,
                "current": {"text": "All", "value": "$__all"},
            },
        ]
    },
    "panels": panels,
}
Path("configs/grafana/kvd.json").write_text(json.dumps(dash, indent=2) + "\n")
