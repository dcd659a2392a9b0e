"""`kvd bench`: start the process tree, run every scenario, print tables, write JSON."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

from kvd.bench import (
    SCENARIOS,
    control,
    dataplane,
    ec,
    gpu,
    idle,
    layerwise,
    report,
    scale,
    tiers,
    topology,
)
from kvd.bench.common import Env, machine, status, status_client
from kvd.bench.raw import RawInitiator, RawPeerProcess
from kvd.demo import DaemonProc, start_daemon

EC_REGION_BYTES = 64 << 20
EC_BLOCK_BYTES = 1 << 20
TRACE_RECORDS = 65536
"""The daemons' stage-trace ring (`daemon.trace_records`); off but for the trace run."""
IDLE_SETTLE_S = 0.3
"""Before the idle window: the scenarios' sessions close, the NIXL thread backs off."""


@contextmanager
def process_tree(quick: bool) -> Iterator[Env]:
    """P and D daemons (subprocesses of this one) and the raw-NIXL helper process."""
    workdir = Path(tempfile.mkdtemp(prefix="kvdb-", dir="/tmp"))
    started: list[DaemonProc] = []
    peer: RawPeerProcess | None = None
    raw: RawInitiator | None = None
    clis = []
    try:
        tag = f"{os.getpid()}"
        sizes = f"region_bytes = {EC_REGION_BYTES}\nblock_bytes = {EC_BLOCK_BYTES}\n"
        ec_p = f'[ec]\nrole = "producer"\n{sizes}'
        ec_d = f'[ec]\nrole = "consumer"\n{sizes}'
        traced = {"daemon": {"trace_records": TRACE_RECORDS}}
        p = start_daemon(workdir, f"kvdb-p-{tag}", ec_p, overrides=traced)
        started.append(p)
        d = start_daemon(workdir, f"kvdb-d-{tag}", ec_d, overrides=traced)
        started.append(d)
        by_write: dict[str, dict[str, Any]] = {**traced, "transfer": {"pull_by": "write"}}
        dw = start_daemon(workdir, f"kvdb-dw-{tag}", "", overrides=by_write)
        started.append(dw)
        peer = RawPeerProcess(f"kvdb-rawpeer-{tag}")
        raw = RawInitiator(f"kvdb-rawinit-{tag}", peer)
        p_cli, d_cli = status_client(p.socket), status_client(d.socket)
        clis = [p_cli, d_cli]
        env = Env(
            workdir,
            p.socket,
            d.socket,
            p.side_port,
            quick,
            raw,
            peer,
            p_cli,
            d_cli,
            p.proc.pid,
            d.proc.pid,
            dw.socket,
        )
        control.switch_trace(env, False)
        yield env
    finally:
        for c in clis:
            c.close()
        if raw is not None:
            raw.close()
        if peer is not None:
            peer.close()
        for dp in reversed(started):
            dp.stop()
        shutil.rmtree(workdir, ignore_errors=True)


def idle_daemon(env: Env, window_s: float) -> dict[str, Any]:
    """D's CPU once every scenario is done: no requests, no regions of the bench's
    engines, one client left (the bench's status client, which pings every second)."""
    time.sleep(IDLE_SETTLE_S)
    before = status(env.d_cli)
    res = idle.measure(env.d_pid, window_s)
    after = status(env.d_cli)
    res["daemon"] = "D"
    res["sessions"] = len(after["sessions"])
    res["nixl_polls_per_s"] = round(
        (after["nixl"]["polls"] - before["nixl"]["polls"]) / res["window_s"], 1
    )
    return res


def run_bench(
    *,
    quick: bool,
    json_path: Path | None,
    only: list[str],
    seed: int,
    console: Console,
    plot_dir: Path | None = None,
) -> int:
    """Run the scenarios in `only` (all when empty); returns the exit code."""
    chosen = [s for s in SCENARIOS if not only or s in only]
    results: dict[str, Any] = {
        "kvd_bench": 1,
        "quick": quick,
        "seed": seed,
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine(),
        "scenarios": {},
    }
    dp_cfg = (
        dataplane.DataPlaneConfig(num_layers=8, blocks=32, reps=3)
        if quick
        else dataplane.DataPlaneConfig()
    )
    ctl_cfg = control.ControlConfig.quick() if quick else control.ControlConfig()
    sc_cfg = scale.ScaleConfig.quick() if quick else scale.ScaleConfig()
    ec_cfg = ec.ECConfig.quick() if quick else ec.ECConfig()
    topo_cfg = topology.TopoConfig.quick() if quick else topology.TopoConfig()
    lw_cfg = layerwise.LayerwiseConfig.quick() if quick else layerwise.LayerwiseConfig()
    tr_cfg = tiers.TiersBenchConfig.quick() if quick else tiers.TiersBenchConfig()
    gpu_cfg = gpu.GpuConfig.quick() if quick else gpu.GpuConfig()
    steps = {
        "dataplane": len(dataplane.LAYOUTS) * len(dataplane.ALLOCATIONS) * (dp_cfg.reps + 1),
        "control": control.steps(ctl_cfg),
        "scale": scale.steps(sc_cfg),
        "ec": ec.steps(ec_cfg),
        "topology": topology.steps(topo_cfg),
        "layerwise": layerwise.steps(lw_cfg),
        "tiers": tiers.steps(tr_cfg),
        "gpu": gpu.steps(gpu_cfg),
    }
    t_start = time.perf_counter()
    with Progress(
        TextColumn("[bold]{task.description:<44}"),
        BarColumn(),
        TextColumn("{task.completed}/{task.total}"),
        TimeElapsedColumn(),
        console=console,
        transient=False,
    ) as bar:
        task = bar.add_task("starting daemons", total=sum(steps[s] for s in chosen) + 1)

        def progress(what: str) -> None:
            bar.update(task, advance=1, description=what)

        with process_tree(quick) as env:
            progress("daemons up")
            pairs: list[dataplane.Pair] = []
            ctl: control.CtlPair | None = None
            ecs: ec.ECPair | None = None
            topo = topology.TopoSet()
            lws: layerwise.LwPair | None = None
            try:
                if "dataplane" in chosen:
                    dataplane.setup(env, dp_cfg, pairs)
                if "control" in chosen or "scale" in chosen:
                    ctl = control.setup(env, ctl_cfg)
                if "ec" in chosen:
                    ecs = ec.setup(env)
                if "topology" in chosen:
                    topology.setup(env, topo_cfg, topo)
                if "layerwise" in chosen:
                    lws = layerwise.setup(env, lw_cfg)
                bases = dataplane.raw_bases(env, pairs) if pairs else {}
                ec_bases = ec.raw_bases(env, ecs) if ecs is not None else None
                env.raw.connect()
                if "dataplane" in chosen:
                    results["scenarios"]["dataplane"] = dataplane.run(
                        env, dp_cfg, pairs, bases, seed, progress
                    )
                if "control" in chosen:
                    assert ctl is not None
                    results["scenarios"]["control"] = control.run(env, ctl_cfg, ctl, seed, progress)
                if "scale" in chosen:
                    assert ctl is not None
                    base_p50 = results["scenarios"].get("control", {}).get("push", {}).get("p50_ms")
                    results["scenarios"]["scale"] = scale.run(
                        env, sc_cfg, ctl, seed, progress, base_p50
                    )
                if "ec" in chosen:
                    assert ecs is not None and ec_bases is not None
                    results["scenarios"]["ec"] = ec.run(env, ec_cfg, ecs, ec_bases, seed, progress)
                if "topology" in chosen:
                    results["scenarios"]["topology"] = topology.run(
                        env, topo_cfg, topo, seed, progress
                    )
                if "layerwise" in chosen:
                    assert lws is not None
                    results["scenarios"]["layerwise"] = layerwise.run(
                        env, lw_cfg, lws, seed, progress
                    )
                if "tiers" in chosen:
                    results["scenarios"]["tiers"] = tiers.run(env, tr_cfg, seed, progress)
                if "gpu" in chosen:
                    results["scenarios"]["gpu"] = gpu.run(env, gpu_cfg, seed, progress)
                    results["machine"]["gpu"] = results["scenarios"]["gpu"].get("device", False)
            finally:
                topo.close()
                dataplane.teardown(pairs)
                if ctl is not None:
                    ctl.close()
                if ecs is not None:
                    ecs.close()
                if lws is not None:
                    lws.close()
            if "control" in chosen:
                results["scenarios"]["control"]["idle"] = idle_daemon(env, ctl_cfg.idle_window_s)
                progress("control plane: idle daemon")
    results["seconds"] = round(time.perf_counter() - t_start, 1)
    results["targets"] = report.targets(results["scenarios"])
    report.print_all(console, results)
    if json_path is not None:
        json_path.write_text(json.dumps(results, indent=2) + "\n")
        console.print(f"results written to {json_path}")
    if plot_dir is not None:
        from kvd.bench.plots import write_all

        for png in write_all(results, plot_dir):
            console.print(f"chart written to {png}")
    return 0
