"""Scenario 3, scale: many requests and many leases.

Live daemons:
- `concurrent`: N push requests (1 MiB each) announced at once on both sides, no window;
  every request must end exactly once on each side, successfully, with D's bytes equal
  to P's (zero loss). Also the cost of `drain_events()` calls that return events.
- `live_leases`: a P client holds N leases at once; how fast they are granted, the push
  latency with them live (against the control-plane baseline), the `kvd leases` snapshot,
  a D daemon heartbeating 1,000 of them (P must know every id), and releasing them all
  when the client closes.

Sans-IO core, measured directly (no sockets, no event loop), as the brief allows:
- `heartbeat`: P's handling of one heartbeat naming 1,000 ids against 10,000 leases
  (decode + `LeaseTable.extend`, as the sender does), and D's side (the batch falling
  due in `HeartbeatSchedule` + encoding it).
- `leases`: `LeaseTable` grant, extend, and expiry cost per operation at 1k, 10k and
  100k live leases.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
from kvd_client import wire
from kvd_client.client import KvdClient

from kvd.bench.common import (
    BenchError,
    Env,
    Progress,
    event_id,
    median,
    new_id,
    pct,
    status,
    summary_ms,
)
from kvd.bench.control import CtlPair, measure
from kvd.core.heartbeats import HeartbeatSchedule
from kvd.core.leases import LeaseTable

LEASE_BATCH = 500


@dataclass(frozen=True)
class ScaleConfig:
    concurrent: int = 1000
    live_leases: int = 10_000
    heartbeat_ids: int = 1000
    latency_requests: int = 300
    lease_sizes: tuple[int, ...] = (1000, 10_000, 100_000)
    heartbeat_reps: int = 200
    heartbeat_wait_s: float = 15.0
    """How long to wait for D's heartbeats to cover every tracked id (two periods)."""
    timeout: float = 120.0

    @classmethod
    def quick(cls) -> ScaleConfig:
        return cls(
            concurrent=200,
            live_leases=2000,
            heartbeat_ids=1000,
            latency_requests=50,
            heartbeat_reps=30,
            heartbeat_wait_s=1.0,
        )


def steps(cfg: ScaleConfig) -> int:
    return 4 + len(cfg.lease_sizes)


def run(
    env: Env,
    cfg: ScaleConfig,
    pair: CtlPair,
    seed: int,
    progress: Progress,
    base_p50_ms: float | None,
) -> dict[str, Any]:
    rng = random.Random(seed + 3)
    out: dict[str, Any] = {}
    out["concurrent"] = concurrent(env, pair, cfg.concurrent, rng, cfg.timeout)
    progress(f"scale: {cfg.concurrent} concurrent pushes")
    out["live_leases"] = live_leases(env, pair, cfg, rng, base_p50_ms)
    progress(f"scale: {cfg.live_leases} live leases")
    out["heartbeat"] = heartbeat_core(
        cfg.live_leases if cfg.live_leases >= 10_000 else 10_000,
        cfg.heartbeat_ids,
        cfg.heartbeat_reps,
    )
    progress("scale: heartbeat (sans-IO)")
    out["leases"] = {"sizes": []}
    for n in cfg.lease_sizes:
        out["leases"]["sizes"].append(lease_ops(n))
        progress(f"scale: lease table at {n} leases (sans-IO)")
    sizes = out["leases"]["sizes"]
    first, last = sizes[0], sizes[-1]
    out["leases"]["expire_growth"] = (
        round(last["expire_us"] / first["expire_us"], 3) if first["expire_us"] else 0.0
    )
    out["leases"]["log_growth"] = round(math.log(last["n"]) / math.log(first["n"]), 3)
    out["leases"]["linear_growth"] = round(last["n"] / first["n"], 1)
    progress("scale: done")
    return out


# ------------------------------------------------------------------ live daemons


def concurrent(
    env: Env, pair: CtlPair, n: int, rng: random.Random, timeout: float
) -> dict[str, Any]:
    p, d, k = pair.p, pair.d, pair.cfg.blocks_per_request
    if 2 * n * k > 2 * pair.cfg.pool_blocks or n * k > pair.cfg.pool_blocks:
        raise BenchError(f"{n} concurrent requests need {n * k} blocks per side")
    p_blocks = rng.sample(range(pair.cfg.pool_blocks), n * k)
    d_blocks = rng.sample(range(pair.cfg.pool_blocks), n * k)
    d.arr[:] = 0
    reqs = []
    for i in range(n):
        reqs.append(
            (
                new_id("scale-p"),
                new_id("scale-d"),
                p_blocks[i * k : (i + 1) * k],
                d_blocks[i * k : (i + 1) * k],
            )
        )
    p_by = {r[0]: r for r in reqs}
    d_by = {r[1]: r for r in reqs}
    t0 = time.perf_counter()
    for pid, did, lb, rb in reqs:
        if rng.random() < 0.5:
            p.client.finished(pid, lb)
            d.client.register_push(
                did,
                rb,
                "127.0.0.1",
                env.p_port,
                remote_engine_id=p.engine_id,
                remote_request_id=pid,
            )
        else:
            d.client.register_push(
                did,
                rb,
                "127.0.0.1",
                env.p_port,
                remote_engine_id=p.engine_id,
                remote_request_id=pid,
            )
            p.client.finished(pid, lb)
    t_sent = time.perf_counter() - t0
    p_ev: dict[str, str] = {}
    d_ev: dict[str, str] = {}
    dup = unknown = 0
    drains: list[tuple[float, int]] = []
    deadline = time.monotonic() + timeout
    while (len(p_ev) < n or len(d_ev) < n) and time.monotonic() < deadline:
        got = 0
        for side, by, seen in ((d, d_by, d_ev), (p, p_by, p_ev)):
            t = time.perf_counter()
            evs = side.client.drain_events()
            dt = time.perf_counter() - t
            if side is d and evs:
                drains.append((dt, len(evs)))
            got += len(evs)
            for ev in evs:
                rid = getattr(ev, "request_id", "")
                if rid not in by:
                    unknown += 1
                elif rid in seen:
                    dup += 1
                else:
                    seen[rid] = type(ev).__name__
        if not got:
            time.sleep(0.0005)
    wall = time.perf_counter() - t0
    ok_d = sum(1 for v in d_ev.values() if v == "RecvFinished")
    ok_p = sum(1 for v in p_ev.values() if v == "SendFinished")
    verified = 0
    for _, did, lb, rb in reqs:
        if d_ev.get(did) == "RecvFinished" and np.array_equal(d.chunks[rb], p.chunks[lb]):
            verified += 1
    counters_p = status(env.p_cli)["counters"]
    counters_d = status(env.d_cli)["counters"]
    busy = {
        key: counters_p.get(key, 0) + counters_d.get(key, 0)
        for key in ("ipc_busy", "notifs_dropped_busy", "ipc_send_dropped")
    }
    per_call = [dt * 1e6 for dt, _ in drains]
    per_event = [dt * 1e6 / m for dt, m in drains]
    return {
        "requests": n,
        "request_bytes": pair.cfg.request_bytes,
        "recv_finished": ok_d,
        "send_finished": ok_p,
        "verified": verified,
        "lost": (n - len(d_ev)) + (n - len(p_ev)),
        "failed": (len(d_ev) - ok_d) + (len(p_ev) - ok_p),
        "duplicates": dup,
        "unknown": unknown,
        "d_outcomes": _count(d_ev.values()),
        "p_outcomes": _count(p_ev.values()),
        "submit_s": round(t_sent, 4),
        "wall_s": round(wall, 4),
        "requests_per_s": round(n / wall, 1) if wall else 0.0,
        "gbps": round(n * pair.cfg.request_bytes / wall / 1e9, 3) if wall else 0.0,
        "daemon_overload_counters": busy,
        "drain_busy": {
            "calls": len(drains),
            "p50_us": round(pct(per_call, 0.5), 2),
            "p99_us": round(pct(per_call, 0.99), 2),
            "us_per_event": round(median(per_event), 2),
            "max_events_per_call": max((m for _, m in drains), default=0),
        },
    }


def _count(values: Any) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def live_leases(
    env: Env, pair: CtlPair, cfg: ScaleConfig, rng: random.Random, base_p50_ms: float | None
) -> dict[str, Any]:
    n = cfg.live_leases
    before = int(status(env.p_cli)["sender"]["leases"])
    holder = KvdClient(env.p_socket, role="scheduler", engine_id=pair.p.engine_id)
    holder.connect()
    tracker = KvdClient(env.d_socket, role="scheduler", engine_id=pair.d.engine_id)
    tracker.connect()
    res: dict[str, Any] = {"leases": n}
    try:
        ids = [new_id("lease") for _ in range(n)]
        refused: list[str] = []
        # Paced like an engine finishing requests step by step: a burst larger than the
        # daemon's mailbox (daemon.mailbox_size) is refused with BUSY by design.
        t0 = time.perf_counter()
        held = before
        deadline = time.monotonic() + cfg.timeout
        for start in range(0, n, LEASE_BATCH):
            batch = ids[start : start + LEASE_BATCH]
            for i, rid in enumerate(batch, start):
                holder.finished(rid, [i % pair.cfg.pool_blocks])
            while held < before + start + len(batch) and time.monotonic() < deadline:
                time.sleep(0.002)
                refused += [event_id(ev) for ev in holder.drain_events()]
                held = int(status(env.p_cli)["sender"]["leases"])
                if held + len(refused) >= before + start + len(batch):
                    break
        granted_s = time.perf_counter() - t0
        refused += [event_id(ev) for ev in holder.drain_events()]
        res["granted"] = held - before
        res["refused"] = len(refused)
        res["grant_s"] = round(granted_s, 4)
        res["grant_us_per_lease"] = round(granted_s / n * 1e6, 2)
        # latency of ordinary requests while the leases are live
        lat = measure(env, pair, "push", cfg.latency_requests, rng)
        res["push_with_leases"] = summary_ms(lat, cdf=True)
        res["push_baseline_p50_ms"] = base_p50_ms
        t = time.perf_counter()
        snap = status(env.p_cli, "leases")
        res["leases_snapshot_ms"] = round((time.perf_counter() - t) * 1e3, 2)
        res["leases_in_snapshot"] = len(snap["leases"])
        # D heartbeats 1,000 of them: one batched heartbeat per period, every id known to P
        gone = set(refused)
        hb = [i for i in ids if i not in gone][: cfg.heartbeat_ids]
        c0 = status(env.p_cli)["counters"]
        d0 = status(env.d_cli)["counters"]  # before tracking: the first beat goes at once
        tracked = [new_id("track") for _ in hb]
        for rid, remote in zip(tracked, hb, strict=True):
            tracker.track(
                rid,
                "127.0.0.1",
                env.p_port,
                remote_engine_id=pair.p.engine_id,
                remote_request_id=remote,
            )
        # The first beat to a peer goes at once (with the ids tracked by then); the rest
        # ride the next one, a heartbeat period (lease / 6) later.
        deadline = time.monotonic() + cfg.heartbeat_wait_s
        c1, d1 = c0, d0
        while time.monotonic() < deadline:
            time.sleep(0.05)
            d1 = status(env.d_cli)["counters"]
            if d1.get("heartbeat_ids_sent", 0) - d0.get("heartbeat_ids_sent", 0) >= len(hb):
                break
        time.sleep(0.05)
        c1 = status(env.p_cli)["counters"]
        res["heartbeat_live"] = {
            "ids": len(hb),
            "ids_sent": d1.get("heartbeat_ids_sent", 0) - d0.get("heartbeat_ids_sent", 0),
            "heartbeats": c1.get("heartbeats_received", 0) - c0.get("heartbeats_received", 0),
            "unknown_ids": c1.get("heartbeat_unknown_ids", 0) - c0.get("heartbeat_unknown_ids", 0),
        }
        for rid in tracked:
            tracker.abort(rid)
        # releasing them all: the holder goes away
        t = time.perf_counter()
        holder.close()
        left = held
        deadline = time.monotonic() + cfg.timeout
        while left > before and time.monotonic() < deadline:
            time.sleep(0.01)
            left = int(status(env.p_cli)["sender"]["leases"])
        res["release_s"] = round(time.perf_counter() - t, 4)
        res["left_after_release"] = left - before
    finally:
        holder.close()
        tracker.close()
    return res


# ------------------------------------------------------------------ sans-IO core


def _ids(n: int, tag: str) -> list[str]:
    return [f"cmpl-{tag}{i:08d}-0-{i * 2654435761 % (1 << 32):08x}" for i in range(n)]


def heartbeat_core(live: int, n_ids: int, reps: int) -> dict[str, Any]:
    table = LeaseTable(30.0)
    ids = _ids(live, "hb")
    for i, rid in enumerate(ids):
        table.grant(rid, 0.0 + i * 1e-6)
    hb = random.Random(5).sample(ids, n_ids)
    frame = wire.encode(wire.Heartbeat(tuple(hb)))
    p_side = []
    for r in range(reps):
        now = 1.0 + r * 1e-3
        t0 = time.perf_counter()
        _, msg = wire.decode(frame)
        assert isinstance(msg, wire.Heartbeat)
        known = table.extend((table.find(i) or i for i in msg.request_ids), now)
        p_side.append(time.perf_counter() - t0)
        if len(known) != n_ids:
            raise BenchError("heartbeat: ids not found")
    sched = HeartbeatSchedule()
    tracked = _ids(n_ids, "d")
    for rid in tracked:
        sched.track(rid, "10.0.0.1:5600", 0.0, 5.0)
    hb_of = dict(zip(tracked, hb, strict=True))
    d_side = []
    now = 0.0
    for _ in range(reps):
        t0 = time.perf_counter()
        for _peer, due in sched.due(now).items():
            wire.encode(wire.Heartbeat(tuple(hb_of[i] for i in due)))
        d_side.append(time.perf_counter() - t0)
        now += 5.0
    return {
        "live_leases": live,
        "ids": n_ids,
        "frame_bytes": len(frame),
        "p_side": summary_ms(p_side),
        "d_side": summary_ms(d_side),
        "total_p50_ms": round((median(p_side) + median(d_side)) * 1e3, 4),
    }


def lease_ops(n: int) -> dict[str, Any]:
    """Per-operation cost of the lease table with n live leases."""
    ids = _ids(n, "r")
    table = LeaseTable(30.0)
    rng = random.Random(n)
    t0 = time.perf_counter()
    for i, rid in enumerate(ids):
        table.grant(rid, i * (10.0 / n))  # deadlines spread over 10 s
    grant = (time.perf_counter() - t0) / n
    # heartbeats: batches of 1,000 random ids, each extending its lease
    batch = min(1000, n)
    rounds = 20
    batches = [rng.sample(ids, batch) for _ in range(rounds)]
    t0 = time.perf_counter()
    for r, b in enumerate(batches):
        table.extend(b, 1.0 + r * 1e-3)
    extend = (time.perf_counter() - t0) / (rounds * batch)
    # find by base id (an id with another engine's suffix)
    probes = [rng.choice(ids).rsplit("-", 1)[0] + "-deadbeef" for _ in range(batch)]
    t0 = time.perf_counter()
    for q in probes:
        table.find(q)
    find = (time.perf_counter() - t0) / batch
    # expiry: the clock advances in 100 steps, each expiring about 1% of the table
    t0 = time.perf_counter()
    expired = 0
    end = 40.0
    for step in range(1, 101):
        expired += len(table.expire(step * end / 100))
    expire = (time.perf_counter() - t0) / max(expired, 1)
    if expired != n or len(table):
        raise BenchError(f"lease table: {expired} of {n} expired, {len(table)} left")
    return {
        "n": n,
        "grant_us": round(grant * 1e6, 3),
        "extend_us": round(extend * 1e6, 3),
        "find_us": round(find * 1e6, 3),
        "expire_us": round(expire * 1e6, 3),
    }
