"""Scenario 2, the control plane: small (1 MiB) requests, one at a time, and `drain_events`.

- Push latency: P's `finished` for a batch of requests goes first (so P's blocks are
  staged, as when prefill ends before decode has room); then, one request at a time,
  the clock runs from D's `register_push` call to the `RecvFinished` event at D's client.
- Pull latency: the same, from D's `pull` call to `RecvFinished` (the READ, P's
  acknowledgement that the lease was still held, and the event).
- `drain_events()`: one call with nothing to return (idle); and one call that returns a
  backlog (busy: the replies and events of a burst of requests that already finished).
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass
from typing import Any

from kvd_client import layout as kvlayout

from kvd.bench.common import (
    Env,
    Progress,
    Side,
    expect_ok,
    fill_pattern,
    leases,
    make_side,
    median,
    new_id,
    pct,
    summary_ms,
    wait_for,
    wait_leases,
)

BATCH = 100


@dataclass(frozen=True)
class ControlConfig:
    requests: int = 2000
    pull_requests: int = 1000
    num_layers: int = 32
    chunk_bytes: int = 8 << 10
    blocks_per_request: int = 2
    """2 blocks x 32 layers x K and V x 8 KiB = 1 MiB per request."""
    pool_blocks: int = 2048
    drain_calls: int = 20000
    busy_bursts: int = 5
    busy_requests: int = 64

    @classmethod
    def quick(cls) -> ControlConfig:
        return cls(
            requests=200,
            pull_requests=100,
            pool_blocks=512,
            drain_calls=2000,
            busy_bursts=2,
            busy_requests=32,
        )

    @property
    def request_bytes(self) -> int:
        return self.blocks_per_request * self.num_layers * 2 * self.chunk_bytes


def steps(cfg: ControlConfig) -> int:
    return _batches(cfg.requests) + _batches(cfg.pull_requests) + 2


def _batches(n: int) -> int:
    return (n + BATCH - 1) // BATCH


@dataclass
class CtlPair:
    p: Side
    d: Side
    cfg: ControlConfig

    def close(self) -> None:
        self.p.close()
        self.d.close()


def setup(env: Env, cfg: ControlConfig) -> CtlPair:
    lay = kvlayout.block_major(cfg.pool_blocks, cfg.num_layers, cfg.chunk_bytes)
    nbytes = kvlayout.region_bytes(lay)
    p = make_side(env.p_socket, "ctl-p", lay, nbytes)
    try:
        d = make_side(env.d_socket, "ctl-d", lay, nbytes)
    except BaseException:
        p.close()
        raise
    fill_pattern(p, 7)
    return CtlPair(p, d, cfg)


def measure(
    env: Env, pair: CtlPair, mode: str, n: int, rng: random.Random, progress: Progress | None = None
) -> list[float]:
    """Latency of n requests, one at a time, from D's call to D's RecvFinished (seconds)."""
    p, d, k = pair.p, pair.d, pair.cfg.blocks_per_request
    pool = range(pair.cfg.pool_blocks)
    out: list[float] = []
    for start in range(0, n, BATCH):
        batch = []
        base = leases(env)
        for _ in range(min(BATCH, n - start)):
            pid, did = new_id(f"ctl-{mode}-p"), new_id(f"ctl-{mode}-d")
            lb, rb = rng.sample(pool, k), rng.sample(pool, k)
            p.client.finished(pid, lb)
            batch.append((pid, did, lb, rb))
        wait_leases(env, base + len(batch))  # P has staged the whole batch
        p.stash.extend(p.client.drain_events())
        for pid, did, lb, rb in batch:
            t0 = time.perf_counter()
            if mode == "push":
                d.client.register_push(
                    did,
                    rb,
                    "127.0.0.1",
                    env.p_port,
                    remote_engine_id=p.engine_id,
                    remote_request_id=pid,
                )
            else:
                d.client.pull(
                    did,
                    rb,
                    "127.0.0.1",
                    env.p_port,
                    remote_request_id=pid,
                    remote_block_ids=lb,
                    remote_engine_id=p.engine_id,
                )
            ev = wait_for(d.client, did, d.stash)
            out.append(time.perf_counter() - t0)
            expect_ok(ev, f"{mode} at D")
        for pid, *_ in batch:
            expect_ok(wait_for(p.client, pid, p.stash), f"{mode} at P")
        if progress is not None:
            progress(f"control plane {mode}: {start + len(batch)}/{n}")
    return out


def drain_idle(pair: CtlPair, calls: int) -> list[float]:
    """Seconds per `drain_events()` call with nothing to return."""
    cli = pair.d.client
    pair.d.stash.extend(cli.drain_events())
    out = []
    for _ in range(calls):
        t0 = time.perf_counter()
        evs = cli.drain_events()
        out.append(time.perf_counter() - t0)
        if evs:
            pair.d.stash.extend(evs)
    return out


def drain_busy(
    env: Env, pair: CtlPair, bursts: int, n: int, rng: random.Random
) -> list[dict[str, float]]:
    """One `drain_events()` call collecting the backlog of n finished push requests."""
    p, d, k = pair.p, pair.d, pair.cfg.blocks_per_request
    out = []
    for _ in range(bursts):
        ids = []
        p_blocks = rng.sample(range(pair.cfg.pool_blocks), n * k)
        d_blocks = rng.sample(range(pair.cfg.pool_blocks), n * k)
        for i in range(n):
            pid, did = new_id("ctl-busy-p"), new_id("ctl-busy-d")
            p.client.finished(pid, p_blocks[i * k : (i + 1) * k])
            d.client.register_push(
                did,
                d_blocks[i * k : (i + 1) * k],
                "127.0.0.1",
                env.p_port,
                remote_engine_id=p.engine_id,
                remote_request_id=pid,
            )
            ids.append((pid, did))
        # wait on P's side only, so D's replies and events pile up unread
        for pid, _ in ids:
            expect_ok(wait_for(p.client, pid, p.stash), "busy burst at P")
        time.sleep(0.05)
        t0 = time.perf_counter()
        evs = d.client.drain_events()
        dt = time.perf_counter() - t0
        d.stash.extend(evs)
        for _, did in ids:
            expect_ok(wait_for(d.client, did, d.stash), "busy burst at D")
        out.append({"us": dt * 1e6, "events": float(len(evs)), "frames": float(2 * n)})
    return out


def run(
    env: Env, cfg: ControlConfig, pair: CtlPair, seed: int, progress: Progress
) -> dict[str, Any]:
    rng = random.Random(seed + 2)
    measure(env, pair, "push", 50, rng)  # warm up (handshake, first transfers)
    measure(env, pair, "pull", 50, rng)
    push = measure(env, pair, "push", cfg.requests, rng, progress)
    pull = measure(env, pair, "pull", cfg.pull_requests, rng, progress)
    idle = drain_idle(pair, cfg.drain_calls)
    progress("control plane: idle drain_events")
    busy = drain_busy(env, pair, cfg.busy_bursts, cfg.busy_requests, rng)
    progress("control plane: busy drain_events")
    idle_us = [t * 1e6 for t in idle]
    busy_us = [b["us"] for b in busy]
    busy_events = [b["events"] for b in busy]
    return {
        "request_bytes": cfg.request_bytes,
        "push": summary_ms(push),
        "pull": summary_ms(pull),
        "drain_idle": {
            "n": len(idle_us),
            "p50_us": round(pct(idle_us, 0.5), 2),
            "p99_us": round(pct(idle_us, 0.99), 2),
            "mean_us": round(sum(idle_us) / len(idle_us), 2),
        },
        "drain_busy": {
            "bursts": len(busy),
            "requests_per_burst": cfg.busy_requests,
            "median_events": median(busy_events),
            "median_us": round(median(busy_us), 1),
            "us_per_frame": round(median([b["us"] / b["frames"] for b in busy]), 2),
        },
    }
