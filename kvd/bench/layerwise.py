"""Layer-wise push against whole-request push, on a simulated prefill.

P's engine computes `layers` layers, `compute_ms` each (a sleep: the GPU's time, which the
CPU spends waiting), and copies each layer's KV into its host staging region as it is
computed (a real memcpy). With layer-wise push its worker announces each layer at once
(`layers_saved`, one way) and P's daemon WRITEs it into D while the next layer computes;
whole-request push starts only at P's `finished`, after the last layer. Both run
alternately on the same regions and bytes, D registered before P starts.

Measured per request: D's client has RecvFinished this long after the end of the last
layer's compute. Target: layer-wise ≤ one layer's transfer + 1 ms, where one layer's
transfer is the median time P's daemon took to WRITE one layer (its own record of each
layer WRITE, post to completion) in the same run. D's client waits in a thread of its
own, blocked in ZMQ (no GIL held), so it sees the event when it arrives.

The floor printed beside it, measured in the same run: what the path after the last
layer cannot go below through daemons here, whatever they do between their messages:
the layer's notice to P's daemon and D's event to its client (one ZMQ IPC round trip,
`kvd.bench.zmqfloor`), the WRITE itself (as above) and its notification to D (half a
raw NIXL notification round trip).

Then more layer-wise requests with both daemons' stage trace on (`LayerwiseConfig.traced`,
not counted in the figures): where the time after the last layer goes, stage by stage
(`kvd.bench.stages.LAYERWISE`).
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from kvd_client import layout as kvlayout
from kvd_client import wire
from kvd_client.client import Event, KvdClient

from kvd.bench import control, stages, zmqfloor
from kvd.bench.common import (
    BenchError,
    Env,
    Side,
    Timed,
    make_side,
    median,
    new_id,
    pct,
    status,
)

FLOOR_ROUND_TRIPS = 200
"""ZMQ IPC and raw NIXL notification round trips measured for the floor."""

_LAYER_RID = re.compile(r"/l(\d+)-(\d+)$")
"""How the sender names a layer WRITE in `kvd transfers` (`<request>/l<first>-<end>`)."""


@dataclass(frozen=True)
class LayerwiseConfig:
    layers: int = 32
    compute_ms: float = 2.0
    """Simulated compute per layer."""
    blocks: int = 64
    chunk_bytes: int = 8192
    """Per block, layer and K/V part: 64 blocks x 2 parts x 8 KiB = 1 MiB per layer."""
    reps: int = 12
    traced: int = 12
    """Layer-wise requests more, with the daemons' stage trace on (`_trace_run`)."""

    @classmethod
    def quick(cls) -> LayerwiseConfig:
        return cls(reps=3, traced=3)

    @property
    def layer_bytes(self) -> int:
        return self.blocks * 2 * self.chunk_bytes


def steps(cfg: LayerwiseConfig) -> int:
    return 2 * (cfg.reps + 1) + cfg.traced


@dataclass
class LwPair:
    p: Side
    d: Side
    worker: KvdClient
    """P's rank-0 worker session: where layer notices come from."""

    def close(self) -> None:
        self.worker.close()
        self.p.close()
        self.d.close()


def setup(env: Env, cfg: LayerwiseConfig) -> LwPair:
    lay = kvlayout.layer_major(cfg.blocks * 2, cfg.layers, cfg.chunk_bytes)
    nbytes = kvlayout.region_bytes(lay)
    p = make_side(env.p_socket, "bench-lw-p", lay, nbytes)
    try:
        d = make_side(env.d_socket, "bench-lw-d", lay, nbytes)
    except BaseException:
        p.close()
        raise
    worker = KvdClient(env.p_socket, role="worker", engine_id="bench-lw-p", tp_rank=0)
    try:
        worker.connect()
    except BaseException:
        p.close()
        d.close()
        raise
    return LwPair(p, d, worker)


class _Waiter(threading.Thread):
    """D's client, waiting for one request's terminal event (monotonic ns when it came)."""

    def __init__(self, client: KvdClient, request_id: str, timeout: float) -> None:
        super().__init__(daemon=True)
        self.client, self.request_id, self.timeout = client, request_id, timeout
        self.event: Event | None = None
        self.at = 0

    def run(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.event is None and time.monotonic() < deadline:
            for ev in self.client.wait_events(0.5):
                if getattr(ev, "request_id", "") == self.request_id:
                    self.at = time.monotonic_ns()
                    self.event = ev


def _one(env: Env, cfg: LayerwiseConfig, pair: LwPair, layerwise: bool, rng: Any) -> float:
    """One simulated prefill; returns D's ready time after the last layer's compute (s)."""
    return _timed(env, cfg, pair, layerwise, rng).seconds


def _timed(env: Env, cfg: LayerwiseConfig, pair: LwPair, layerwise: bool, rng: Any) -> Timed:
    """One simulated prefill, timed from the end of the last layer's compute (`call`; `sent`
    once its notice is on its way) to D's RecvFinished (`event`)."""
    p_id, d_id = new_id("lw"), new_id("lw")
    p_blocks = [int(b) for b in rng.permutation(cfg.blocks * 2)[: cfg.blocks]]
    d_blocks = list(range(cfg.blocks))
    src = rng.integers(0, 256, size=(cfg.layers, 2, cfg.blocks, cfg.chunk_bytes), dtype=np.uint8)
    pending = status(env.p_cli)["sender"]["pending_registrations"]
    pair.d.client.register_push(
        d_id,
        d_blocks,
        "127.0.0.1",
        env.p_port,
        remote_engine_id=pair.p.engine_id,
        remote_request_id=p_id,
    )
    deadline = time.monotonic() + 30
    while status(env.p_cli)["sender"]["pending_registrations"] <= pending:
        if time.monotonic() > deadline:
            raise BenchError(f"P did not get D's registration: {pair.d.client.drain_events()}")
        time.sleep(0.001)
    waiter = _Waiter(pair.d.client, d_id, 60.0)
    waiter.start()
    chunks = pair.p.chunks  # (block, layer, part, byte)
    idx = np.array(p_blocks)
    end = sent = 0
    for layer in range(cfg.layers):
        time.sleep(cfg.compute_ms / 1e3)
        chunks[idx, layer] = src[layer].transpose(1, 0, 2)
        end = sent = time.monotonic_ns()
        if layerwise:
            pair.worker.layers_saved(layer + 1, [(p_id, p_blocks)])
            sent = time.monotonic_ns()
    pair.p.client.finished(p_id, p_blocks)
    waiter.join(61.0)
    if not isinstance(waiter.event, wire.RecvFinished):
        raise BenchError(f"D's request ended {waiter.event!r}")
    got = pair.d.chunks[np.array(d_blocks)]
    if not np.array_equal(got.transpose(1, 2, 0, 3), src):
        raise BenchError("layer-wise bench: D's bytes differ from P's")
    p_ev = pair.p.client.wait_events(10.0)
    if not any(isinstance(e, wire.SendFinished) for e in p_ev):
        raise BenchError(f"P's request did not end SendFinished: {p_ev!r}")
    return Timed(p_id, d_id, end, sent, waiter.at)


def _layer_write_ms(env: Env) -> list[float]:
    """P's record of its recent single-layer WRITEs (post to completion), in ms."""
    out: list[float] = []
    for r in status(env.p_cli, "transfers")["recent"]:
        m = _LAYER_RID.search(r["request_id"])
        if r["op"] == "WRITE" and r["state"] == "done" and m and int(m[2]) - int(m[1]) == 1:
            out.append(float(r["duration_ms"]))
    return out


def run(
    env: Env, cfg: LayerwiseConfig, pair: LwPair, seed: int, progress: Callable[[str], None]
) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    # a warm-up of each: handshakes, views, a re-sync after the daemons' start-up stall
    for mode in (True, False):
        _one(env, cfg, pair, mode, rng)
        progress(f"layer-wise: warm-up ({'layers' if mode else 'whole'})")
    lw: list[float] = []
    whole: list[float] = []
    layer_ms: list[float] = []
    for i in range(cfg.reps):
        lw.append(_one(env, cfg, pair, True, rng))
        layer_ms += _layer_write_ms(env)[-cfg.layers :]
        progress(f"layer-wise: {i + 1}/{cfg.reps} layers")
        whole.append(_one(env, cfg, pair, False, rng))
        progress(f"layer-wise: {i + 1}/{cfg.reps} whole")
    trace = _trace_run(env, cfg, pair, rng, progress)
    one_layer = median(layer_ms) if layer_ms else float("nan")
    zmq_rtt = median(zmqfloor.round_trips(env.workdir, FLOOR_ROUND_TRIPS)) * 1e3
    notif = median(control.raw_round_trips(env, FLOOR_ROUND_TRIPS)) * 1e3
    return {
        "layers": cfg.layers,
        "compute_ms_per_layer": cfg.compute_ms,
        "bytes_per_layer": cfg.layer_bytes,
        "reps": cfg.reps,
        "one_layer_write_ms": round(one_layer, 3),
        "layerwise": _summary(lw),
        "whole": _summary(whole),
        "goal_ms": round(one_layer + 1.0, 3),
        "trace": trace,
        "floor": {
            "zmq_rtt_p50_ms": round(zmq_rtt, 4),
            "notif_rtt_p50_ms": round(notif, 4),
            "p50_ms": round(zmq_rtt + notif / 2 + one_layer, 3),
        },
    }


def _trace_run(
    env: Env, cfg: LayerwiseConfig, pair: LwPair, rng: Any, progress: Callable[[str], None]
) -> dict[str, Any]:
    """Where the time after the last layer goes: more layer-wise requests with both
    daemons' stage trace on (`kvd.bench.stages.LAYERWISE`); not counted in the figures
    above (the trace costs a little on every record)."""
    joined: list[dict[str, int]] = []
    for c in (env.p_cli, env.d_cli):
        control.fetch_trace(c)  # whatever an earlier scenario left in the ring
    for i in range(cfg.traced):
        control.switch_trace(env, True)
        try:
            timed = _timed(env, cfg, pair, True, rng)
        finally:
            control.switch_trace(env, False)
        records = {"P": control.fetch_trace(env.p_cli), "D": control.fetch_trace(env.d_cli)}
        joined += stages.join([timed], stages.last_layer(records, cfg.layers))
        progress(f"layer-wise: traced {i + 1}/{cfg.traced}")
    return {
        "traced": len(joined),
        "complete": stages.complete(stages.LAYERWISE, joined),
        "stages": stages.summarize(stages.LAYERWISE, joined),
    }


def _summary(seconds: list[float]) -> dict[str, float]:
    ms = [s * 1e3 for s in seconds]
    return {
        "p50_ms": round(median(ms), 3),
        "p90_ms": round(pct(ms, 0.9), 3),
        "max_ms": round(max(ms), 3),
    }
