"""One request's timeline across two daemons: clock offsets, the trace exchange, merging.

Clock offset (NTP-style). We send at `t0` (our clock), the peer stamps `t1` when the
query arrives and `t2` when its answer leaves (its clock), we receive at `t3`. If the
peer's clock reads ours plus θ, causality gives t1 - θ >= t0 and t2 - θ <= t3, so

    θ in [t2 - t3, t1 - t0],   estimate ((t1 - t0) + (t2 - t3)) / 2,
    error bound half the round trip ((t3 - t0) - (t2 - t1)) / 2.

The bound holds whatever the path's asymmetry; of several exchanges the one with the
smallest bound is kept (`best`). It does not count drift since the exchange: the
daemon measures again before a trace (`kvd trace --peer`), and at every handshake.
The clocks are the daemons' stage-trace clocks (CLOCK_MONOTONIC): on one host θ is 0
and the estimate says so within its bound.

The exchange itself (`TraceQuery` / `TraceAnswer` on the side channel) is built and
checked here: with a shared secret both carry an HMAC (the answer's bound to the
query's nonce), like every other authenticated peer message. Pure: clocks and the
secret are arguments.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any, Final

from kvd_client import wire
from kvd_client.errors import AuthError, RemoteProtocolError

from kvd.core.peerauth import AUTH_WINDOW_S, message_mac
from kvd.core.trace import Found

QUERY_CONTEXT: Final = b"trace"
ANSWER_CONTEXT: Final = b"trace-answer"


@dataclass(frozen=True)
class ClockOffset:
    """The peer's clock minus ours, within ± `error_ns` (see the module docstring)."""

    offset_ns: int
    error_ns: int
    rtt_ns: int

    def as_dict(self) -> dict[str, Any]:
        return {"offset_ns": self.offset_ns, "error_ns": self.error_ns, "rtt_ns": self.rtt_ns}


def estimate(t0: int, t1: int, t2: int, t3: int) -> ClockOffset:
    """The offset from one exchange (t0, t3 ours; t1, t2 the peer's)."""
    if t3 < t0:
        raise ValueError(f"received before sent (t0={t0}, t3={t3})")
    if t2 < t1:
        raise RemoteProtocolError(f"peer answered before the query arrived (t1={t1}, t2={t2})")
    rtt = max((t3 - t0) - (t2 - t1), 0)
    offset = ((t1 - t0) + (t2 - t3)) // 2
    return ClockOffset(offset, (rtt + 1) // 2, rtt)


def best(samples: Iterable[ClockOffset]) -> ClockOffset:
    """The exchange with the smallest error bound."""
    return min(samples, key=lambda s: s.error_ns)


DRIFT_PPM: Final = 1000
"""How fast two hosts' monotonic clocks may drift apart, in parts per million: NTP slews
each by at most 500 ppm, and a free-running crystal is within ~100 ppm."""


def peer_now_latest_ns(now_ns: int, offset: ClockOffset, measured_ns: int) -> int:
    """The latest the peer's clock may read when ours reads `now_ns`, with `offset`
    measured when ours read `measured_ns`: our clock plus the offset, its error bound, and
    the drift the two clocks may have had since the measurement (`DRIFT_PPM` of the time
    between). Never too early, however far apart the clocks are: a deadline on the peer's
    clock is taken as passed as soon as it may have passed."""
    drift = abs(now_ns - measured_ns) * DRIFT_PPM // 1_000_000 + 1
    return now_ns + offset.offset_ns + offset.error_ns + drift


# ---------------------------------------------------------------- the exchange


def make_query(
    agent: str,
    request_ids: Sequence[str],
    t0: int,
    nonce: bytes,
    wall: float,
    secret: bytes | None,
) -> wire.TraceQuery:
    q = wire.TraceQuery(agent, tuple(request_ids), t0, nonce, wall, b"")
    if secret is not None:
        q = replace(q, mac=message_mac(secret, q, QUERY_CONTEXT))
    return q


def check_query(q: wire.TraceQuery, secret: bytes | None, wall: float) -> None:
    """Raise AuthError unless `q` is authentic and fresh (when a secret is configured)."""
    if secret is None:
        return
    good = message_mac(secret, q, QUERY_CONTEXT)
    if not q.mac or not hmac.compare_digest(good, q.mac):
        raise AuthError(f"trace query from {q.agent_name!r} failed authentication")
    if abs(wall - q.timestamp) > AUTH_WINDOW_S:
        raise AuthError(f"trace query from {q.agent_name!r}: timestamp outside the window")


def make_answer(
    agent: str,
    q: wire.TraceQuery,
    found: Found | None,
    t1: int,
    t2: int,
    secret: bytes | None,
) -> wire.TraceAnswer:
    """The answer to `q` with what this daemon holds (`StageTrace.lookup`)."""
    ids: tuple[str, ...] = ()
    stages: tuple[wire.TraceStage, ...] = ()
    dropped = 0
    if found is not None:
        ids = found.ids[:16]
        stages = tuple(
            wire.TraceStage(t, rid[: wire.MAX_ID_LEN], stage[:128])
            for t, rid, stage in found.records
            if rid and stage
        )
        stages, dropped = stages[:2048], found.dropped + max(len(stages) - 2048, 0)
    a = wire.TraceAnswer(agent, q.t0, t1, t2, ids, stages, min(dropped, 0xFFFFFFFF), b"")
    if secret is not None:
        a = replace(a, mac=message_mac(secret, a, ANSWER_CONTEXT + q.nonce))
    return a


def check_answer(a: wire.TraceAnswer, q: wire.TraceQuery, secret: bytes | None) -> None:
    """Raise unless `a` answers `q` (and, with a secret, is authentic)."""
    if a.t0 != q.t0:
        raise RemoteProtocolError("trace answer does not echo the query's t0")
    if secret is None:
        return
    good = message_mac(secret, a, ANSWER_CONTEXT + q.nonce)
    if not a.mac or not hmac.compare_digest(good, a.mac):
        raise AuthError(f"trace answer from {a.agent_name!r} failed authentication")


# ---------------------------------------------------------------- the timeline


@dataclass(frozen=True)
class Step:
    """One stage of the merged timeline, on our clock."""

    t_ns: int
    daemon: str
    """The agent name of the daemon it happened on."""
    side: str
    """"local" (the daemon asked) or "peer"."""
    request_id: str
    stage: str


def merge(
    local_agent: str,
    local: Sequence[Sequence[Any]],
    peer_agent: str,
    peer: Sequence[Sequence[Any]],
    offset: ClockOffset | None,
) -> list[Step]:
    """Both daemons' records ([t_ns, request id, stage], each on its own clock) as one
    list on our clock, oldest first: the peer's times less the offset. Without an
    offset the peer's records are left out (they could not be placed)."""
    steps = [Step(int(t), local_agent, "local", str(r), str(s)) for t, r, s in local]
    if offset is not None:
        steps += [
            Step(int(t) - offset.offset_ns, peer_agent, "peer", str(r), str(s)) for t, r, s in peer
        ]
    steps.sort(key=lambda s: s.t_ns)  # stable: at equal times, ours first
    return steps


def rows(steps: Sequence[Step]) -> list[dict[str, Any]]:
    """The timeline as rows: each stage, where, and µs since the first stage and since
    the stage before it."""
    if not steps:
        return []
    first = prev = steps[0].t_ns
    out = []
    for s in steps:
        out.append(
            {
                "daemon": s.daemon,
                "side": s.side,
                "request_id": s.request_id,
                "stage": s.stage,
                "t_ns": s.t_ns,
                "delta_us": round((s.t_ns - first) / 1e3, 1),
                "step_us": round((s.t_ns - prev) / 1e3, 1),
            }
        )
        prev = s.t_ns
    return out
