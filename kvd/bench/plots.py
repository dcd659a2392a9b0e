"""`kvd bench --plot DIR`: PNG charts of a bench run's results (matplotlib, Agg backend).

Drawn from the results dictionary that `--json` writes, so a saved run can be drawn
again later: `python -m kvd.bench.plots results.json DIR`. One chart per scenario that
ran:

- `dataplane.png`: GB/s of each contender per layout and allocation (memcpy, raw NIXL
  per-block and coalesced, kvd push and pull), bars side by side;
- `control_latency_cdf.png`: the distribution of one request's latency (push, pull, and
  push with 10,000 live leases when `scale` ran), log-scaled milliseconds;
- `scale.png`: the lease table's cost per operation at 1k/10k/100k leases, and push
  latency alone vs with 10,000 live leases;
- `ec.png`: an encoder output's cold fetch vs raw NIXL and warm hit vs memcpy.

Nothing here measures anything; it only draws what the run measured.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Final

import matplotlib

matplotlib.use("Agg")  # no display: files only (before pyplot is imported)

import matplotlib.pyplot as plt
from matplotlib.figure import Figure
from matplotlib.ticker import ScalarFormatter

DPI: Final = 110

CONTENDERS: Final = (
    # key in a data-plane case, label, colour
    ("memcpy", "memcpy (one process)", "#9e9e9e"),
    ("raw per-block WRITE", "raw NIXL per-block WRITE", "#ffb74d"),
    ("raw coalesced WRITE", "raw NIXL coalesced WRITE", "#f57c00"),
    ("kvd push", "kvd push (WRITE)", "#1565c0"),
    ("raw per-block READ", "raw NIXL per-block READ", "#aed581"),
    ("raw coalesced READ", "raw NIXL coalesced READ", "#558b2f"),
    ("kvd pull", "kvd pull (READ)", "#6a1b9a"),
)


def _subtitle(res: dict[str, Any]) -> str:
    m = res.get("machine", {})
    quick = " --quick" if res.get("quick") else ""
    return (
        f"kvd bench{quick}, {res.get('started', '')}: {m.get('cpus', '?')} cores, "
        f"{m.get('cpu_model') or 'unknown CPU'}, {m.get('transport', '')}"
    )


def _save(fig: Figure, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    plt.close(fig)
    return path


def dataplane(res: dict[str, Any], path: Path) -> Path:
    dp = res["scenarios"]["dataplane"]
    cfg = dp["config"]
    cases = dp["cases"]
    present = [c for c in CONTENDERS if any(c[0] in case["contenders"] for case in cases)]
    fig, ax = plt.subplots(figsize=(11, 5.2))
    width = 0.8 / max(1, len(present))
    for i, (key, label, colour) in enumerate(present):
        xs = [j + (i - (len(present) - 1) / 2) * width for j in range(len(cases))]
        ys = [case["contenders"].get(key, {}).get("gbps", 0.0) for case in cases]
        bars = ax.bar(xs, ys, width, label=label, color=colour)
        if key.startswith("kvd"):
            ax.bar_label(bars, fmt="%.1f", fontsize=7, padding=1)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels([f"{c['layout']}\n{c['allocation']}" for c in cases])
    ax.set_ylabel("GB/s (median)")
    ax.set_title(
        f"Data plane: {cfg['request_bytes'] / 2**20:.0f} MiB per request "
        f"({cfg['blocks']} blocks x {cfg['num_layers']} layers), median of {cfg['reps']}\n"
        + _subtitle(res),
        fontsize=10,
    )
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, ncol=2, loc="upper right")
    return _save(fig, path)


def _cdf(ax: Any, summary: dict[str, Any], label: str, colour: str) -> None:
    pts = summary.get("cdf_ms")
    if pts:
        n = len(pts)
        ys = [(i + 1) / n for i in range(n)]
        ax.step(pts, ys, where="post", label=f"{label} (n={summary['n']})", color=colour)
    else:  # a run from before the samples were kept: its percentiles only
        xs = [summary["p50_ms"], summary["p99_ms"], summary["p999_ms"], summary["max_ms"]]
        ax.plot(xs, [0.5, 0.99, 0.999, 1.0], "o--", label=f"{label} (percentiles)", color=colour)
    ax.axvline(summary["p50_ms"], color=colour, alpha=0.25, linestyle=":")


def control_cdf(res: dict[str, Any], path: Path) -> Path:
    sc = res["scenarios"]
    ctl = sc["control"]
    fig, ax = plt.subplots(figsize=(8, 5))
    _cdf(ax, ctl["push"], "push", "#1565c0")
    _cdf(ax, ctl["pull"], "pull", "#6a1b9a")
    leased = sc.get("scale", {}).get("live_leases", {}).get("push_with_leases")
    if leased:
        leases = sc["scale"]["live_leases"].get("leases", 0)
        _cdf(ax, leased, f"push with {leases:,} live leases", "#c62828")
    ax.set_xscale("log")
    ax.xaxis.set_major_formatter(ScalarFormatter())
    ax.xaxis.set_minor_formatter(ScalarFormatter())
    ax.tick_params(axis="x", which="minor", labelsize=7)
    ax.set_xlabel("request latency, ms (log)")
    ax.set_ylabel("fraction of requests")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3, which="both")
    ax.set_title(
        f"Control plane: {ctl['request_bytes'] / 2**20:.0f} MiB requests one at a time "
        f"(dotted: p50)\n{_subtitle(res)}",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, path)


def scale(res: dict[str, Any], path: Path) -> Path:
    sc = res["scenarios"]["scale"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.8))
    sizes = sc["leases"]["sizes"]
    ns = [s["n"] for s in sizes]
    for key, label in (
        ("grant_us", "grant"),
        ("extend_us", "extend"),
        ("find_us", "find"),
        ("expire_us", "expire"),
    ):
        left.plot(ns, [s[key] for s in sizes], "o-", label=label)
    left.set_xscale("log")
    left.set_yscale("log")
    left.set_xlabel("leases in the table (log)")
    left.set_ylabel("us per operation (log)")
    left.set_title(
        f"Lease table (sans-IO): expire t(100k)/t(1k) = {sc['leases']['expire_growth']:.2f}",
        fontsize=10,
    )
    left.grid(alpha=0.3, which="both")
    left.legend(fontsize=8)
    labels: list[str] = []
    p50: list[float] = []
    p99: list[float] = []
    base = res["scenarios"].get("control", {}).get("push")
    if base:
        labels.append("push alone")
        p50.append(base["p50_ms"])
        p99.append(base["p99_ms"])
    live = sc.get("live_leases", {})
    if live.get("push_with_leases"):
        labels.append(f"push, {live['leases']:,} live leases")
        p50.append(live["push_with_leases"]["p50_ms"])
        p99.append(live["push_with_leases"]["p99_ms"])
    hb = sc.get("heartbeat")
    if hb:
        labels.append(f"heartbeat of {hb['ids']:,} ids")
        p50.append(hb["p_side"]["p50_ms"] + hb["d_side"]["p50_ms"])
        p99.append(hb["p_side"]["p99_ms"] + hb["d_side"]["p99_ms"])
    xs = range(len(labels))
    right.bar([x - 0.2 for x in xs], p50, 0.4, label="p50", color="#1565c0")
    right.bar([x + 0.2 for x in xs], p99, 0.4, label="p99", color="#90caf9")
    right.set_xticks(list(xs))
    right.set_xticklabels(labels, fontsize=8)
    right.set_ylabel("ms")
    cc = sc.get("concurrent", {})
    right.set_title(
        f"{cc.get('requests', 0):,} concurrent pushes: {cc.get('verified', 0):,} verified, "
        f"{cc.get('lost', 0)} lost, {cc.get('requests_per_s', 0):.0f} req/s",
        fontsize=10,
    )
    right.grid(axis="y", alpha=0.3)
    right.legend(fontsize=8)
    fig.suptitle("Scale\n" + _subtitle(res), fontsize=10, y=1.04)
    return _save(fig, path)


def ec(res: dict[str, Any], path: Path) -> Path:
    e = res["scenarios"]["ec"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    rows = [
        ("cold: kvd fetch", e["cold"], "#1565c0"),
        ("cold: raw NIXL WRITE", e["raw_write"], "#f57c00"),
        ("warm: kvd hit", e["warm"], "#6a1b9a"),
        ("warm: memcpy", e["memcpy"], "#9e9e9e"),
    ]
    for i, (_label, s, colour) in enumerate(rows):
        ax.bar(i, s["p50_ms"], 0.6, color=colour)
        ax.errorbar(i, s["p50_ms"], yerr=[[0], [s["p99_ms"] - s["p50_ms"]]], color="black")
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels([r[0] for r in rows], fontsize=8)
    ax.set_ylabel("ms (bar: p50, whisker: p99)")
    ax.set_title(f"Encoder cache: {e['nbytes'] / 1e6:.1f} MB output\n{_subtitle(res)}", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def write_all(res: dict[str, Any], out_dir: Path) -> list[Path]:
    """Every chart the results allow; returns the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    sc = res.get("scenarios", {})
    written: list[Path] = []
    if "dataplane" in sc:
        written.append(dataplane(res, out_dir / "dataplane.png"))
    if "control" in sc:
        written.append(control_cdf(res, out_dir / "control_latency_cdf.png"))
    if "scale" in sc:
        written.append(scale(res, out_dir / "scale.png"))
    if "ec" in sc:
        written.append(ec(res, out_dir / "ec.png"))
    return written


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m kvd.bench.plots RESULTS.json OUT_DIR", file=sys.stderr)
        return 2
    for p in write_all(json.loads(Path(argv[0]).read_text()), Path(argv[1])):
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
