"""`kvd trace REQUEST_ID [--peer] [--json]`: one request's timeline across both daemons.

The local daemon answers a `GetTrace` with its stage records of the request (kept for
the last `daemon.trace_requests` requests, `kvd.core.trace`), and with `--peer` those
of the peer daemon it was transferred with, which it asks over the side channel while
measuring that daemon's clock offset afresh. This module merges them onto the local
clock (`kvd.core.timeline`) and prints each stage with the daemon it happened on, the
time since the first stage and since the stage before, and how uncertain the offset
makes the order of stages on different daemons. Exit 0 when everything asked for was
found, 1 otherwise (an unknown id, an unreachable peer), 3 without a daemon.
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console
from rich.table import Table

from kvd.core.timeline import ClockOffset, merge, rows


def build(reply: dict[str, Any]) -> dict[str, Any]:
    """The JSON form: the daemon's reply reduced to the merged timeline and what explains
    it (pure: for tests and for the table)."""
    peer = reply.get("peer")
    clock = reply.get("clock")
    offset = ClockOffset(clock["offset_ns"], clock["error_ns"], clock["rtt_ns"]) if clock else None
    peer_records = peer.get("records", []) if peer else []
    steps = merge(
        reply["agent"],
        reply["local"]["records"],
        peer.get("agent", "") if peer else "",
        peer_records,
        offset,
    )
    out: dict[str, Any] = {
        "request_id": reply["request_id"],
        "found": reply["found"],
        "daemon": reply["agent"],
        "ids": reply["local"]["ids"],
        "dropped": reply["local"]["dropped"],
        "recording": reply.get("recording", True),
        "requests_capacity": reply.get("requests_capacity"),
        "timeline": rows(steps),
        "clock": clock,
        "peer": None,
    }
    if peer is not None:
        out["peer"] = {
            "agent": peer.get("agent", ""),
            "addr": peer.get("addr", ""),
            "found": bool(peer.get("found", False)),
            "ids": peer.get("ids", []),
            "dropped": peer.get("dropped", 0),
            "error": peer.get("error", ""),
        }
    return out


def ok(view: dict[str, Any]) -> bool:
    """Everything asked for was found (the exit status)."""
    peer = view["peer"]
    return bool(view["found"]) and (peer is None or (peer["found"] and not peer["error"]))


def render(view: dict[str, Any], console: Console) -> None:
    rid, daemon = view["request_id"], view["daemon"]
    if not view["found"]:
        why = (
            "its trace is off (daemon.trace_requests = 0)"
            if not view["recording"]
            else f"it keeps the last {view['requests_capacity']} requests; check the id "
            "(P and D may know a request by different ids)"
        )
        console.print(f"[red]request {rid!r} is not in the trace of {daemon}[/red]: {why}")
    peer = view["peer"]
    clock = view["clock"]
    title = f"request {rid} on {daemon} (local)"
    if peer and peer["agent"]:
        title += f" and {peer['agent']} (peer)"
    if clock:
        console.print(
            f"clock of {peer['agent']}: offset {clock['offset_ns'] / 1e3:+.1f} µs "
            f"± {clock['error_ns'] / 1e3:.1f} µs (round trip {clock['rtt_ns'] / 1e3:.1f} µs, "
            "measured now); stages on different daemons closer than that may be in either "
            "order"
        )
    if peer and peer["error"]:
        console.print(f"[yellow]peer: {peer['error']}[/yellow]")
    elif peer and not peer["found"]:
        console.print(f"[yellow]request {rid!r} is not in the trace of {peer['agent']}[/yellow]")
    if not view["timeline"]:
        return
    t = Table(title=title)
    for col, justify in (
        ("+µs", "right"),
        ("step µs", "right"),
        ("daemon", "left"),
        ("stage", "left"),
        ("request id", "left"),
    ):
        t.add_column(col, justify=justify)  # type: ignore[arg-type]
    for r in view["timeline"]:
        t.add_row(
            f"{r['delta_us']:.1f}",
            f"{r['step_us']:.1f}",
            f"{r['daemon']} ({r['side']})",
            r["stage"],
            r["request_id"],
        )
    console.print(t)
    dropped = view["dropped"] + (peer["dropped"] if peer else 0)
    if dropped:
        console.print(f"{dropped} later stages were not kept (64 per request)")


def run(client: Any, request_id: str, peer: bool, as_json: bool, timeout: float) -> int:
    """Ask the daemon behind `client`, print, and return the exit status."""
    from kvd_client import wire

    reply = client.request(wire.GetTrace(request_id, peer, timeout), timeout=timeout + 5.0)
    if not isinstance(reply, wire.StatusReply):
        raise TypeError(f"trace reply is a {type(reply).__name__}")
    view = build(reply.data)
    if as_json:
        print(json.dumps(view, indent=2, sort_keys=True))
    else:
        render(view, Console())
    return 0 if ok(view) else 1
