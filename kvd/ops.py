"""The operator's commands of the `kvd` CLI: first contact, `kvd drain`, `kvd abort`.

Rules for every command that talks to a daemon:
- A daemon that cannot be reached is said so at once, with what to do (the socket
  missing, not permitted, stale), never after a timeout.
- With `--json`, errors are JSON too (on stdout, `{"error": ..., "kind": ...}`), so a
  script reading stdout always gets JSON; the exit code says it failed.
- Tables are never cut: in a terminal long cells wrap; into a pipe or a file the width
  is the content's (unless $COLUMNS says otherwise).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, NoReturn

import typer
from rich.console import Console
from rich.table import Table


def make_console(stderr: bool = False) -> Console:
    """A console that does not cut tables when it does not write to a terminal."""
    stream = sys.stderr if stderr else sys.stdout
    wide = not stream.isatty() and "COLUMNS" not in os.environ
    return Console(stderr=stderr, width=100_000 if wide else None)


console = make_console()
err = make_console(stderr=True)


def fail(message: str, code: int, as_json: bool, kind: str = "error") -> NoReturn:
    """Say what went wrong (JSON on stdout with --json, else red on stderr) and exit."""
    if as_json:
        print(json.dumps({"error": message, "kind": kind}, sort_keys=True))
    else:
        err.print(f"[red]{_escape(message)}[/red]")
    raise typer.Exit(code)


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


def client(socket: str | None, as_json: bool = False) -> Any:
    """A connected CLI session, or exit 3 at once saying why there is none."""
    from kvd_client.client import KvdClient
    from kvd_client.errors import DaemonUnavailable, KvdError

    c = KvdClient(socket, role="cli", timeout=5.0, keepalive_interval=0)
    try:
        c.connect(wait_for_daemon=0)
    except DaemonUnavailable as exc:
        kind = "permission_denied" if "permission denied" in exc.message else "no_daemon"
        fail(exc.message, 3, as_json, kind)
    except KvdError as exc:
        fail(f"cannot reach kvd at {c.socket_path}: {exc.message}", 3, as_json, "unreachable")
    return c


def fetch(socket: str | None, section: str, as_json: bool = False) -> dict[str, Any]:
    from kvd_client.errors import KvdError

    c = client(socket, as_json)
    try:
        return c.status(section)  # type: ignore[no-any-return]
    except KvdError as exc:
        fail(f"kvd at {c.socket_path}: {exc.message}", 3, as_json, type(exc).__name__)
    finally:
        c.close()


def table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> Table:
    t = Table(title=title)
    for col in columns:
        t.add_column(col, overflow="fold")  # wrap a long id, never cut it to "req…"
    for r in rows:
        t.add_row(*(cell(r.get(c)) for c in columns))
    return t


def cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


# ------------------------------------------------------------------ kvd status


def print_status_header(data: dict[str, Any]) -> None:
    """Who the daemon is, the settings that matter, and what is wrong with them."""
    console.print(
        f"kvd {data['version']}  agent [bold]{_escape(data['agent_name'])}[/bold]  "
        f"pid {data.get('pid', '-')}  uptime {data['uptime_s']:.0f}s  "
        f"side channel {data['side_channel']}"
    )
    st = data.get("settings") or {}
    if st:
        console.print(
            f"socket {_escape(st['socket'])} (mode {st['socket_mode']})  "
            f"auth {st['auth']}  lease {st['kv_lease_duration']:g}s  "
            f"transfer timeout {st['transfer_timeout']:g}s  "
            f"push registration timeout {st['push_registration_timeout']:g}s  "
            f"lease wait {st['lease_wait_timeout']:g}s  "
            f"handshake timeout {st['handshake_timeout']:g}s  "
            f"client timeout {st['client_timeout']:g}s"
        )
        if st["auth"] != "on":
            console.print(
                "[bold red]WARNING: peers are NOT authenticated (auth.secret_file is not "
                "set): any host that reaches the side channel can handshake, read and write "
                "registered KV blocks[/bold red]"
            )
    drain = data.get("drain") or {}
    if drain.get("state", "serving") != "serving":
        console.print(drain_line(drain))


def drain_line(d: dict[str, Any]) -> str:
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(d["since"]))
    sending = d.get("sending", {}).get("count", 0)
    receiving = d.get("receiving", {}).get("count", 0)
    ec = d.get("encoder_cache", {}).get("count", 0)
    deadline = d.get("deadline_in_s")
    left = ""
    if deadline is not None and d["state"] == "draining":
        left = f", deadline in {max(deadline, 0.0):.1f}s"
    then = ", then exit" if d.get("exit") else ""
    return (
        f"[bold yellow]drain: {d['state']}[/bold yellow] since {since} ({d['for_s']:.1f}s"
        f"{left}{then}); in flight: {sending} sending, {receiving} receiving"
        + (f", {ec} encoder-cache" if ec else "")
    )


# ------------------------------------------------------------------ kvd drain


_SIDES = ("sending", "receiving", "encoder_cache")


def drain(socket: str | None, timeout: float, exit_after: bool, wait: bool, as_json: bool) -> int:
    """Start (or join) the drain, follow it, report; with exit_after, wait for the exit."""
    from kvd_client import wire
    from kvd_client.client import daemon_listening
    from kvd_client.errors import KvdError

    c = client(socket, as_json)
    path = c.socket_path
    try:
        reply = c.request(wire.Drain(timeout, exit_after))
        assert isinstance(reply, wire.StatusReply)
        data = reply.data
        if not as_json:
            err.print(f"draining kvd at {_escape(path)} (new leases and transfers are refused)")
        shown = -1
        while wait and data["state"] == "draining":
            n = sum(data.get(k, {}).get("count", 0) for k in _SIDES)
            if n != shown and not as_json:
                err.print(drain_line(data))
                shown = n
            time.sleep(0.2)
            try:
                data = c.status("drain")
            except KvdError:
                if exit_after and not daemon_listening(path):
                    data = {**data, "state": "exited"}
                    break
                raise
    except KvdError as exc:
        fail(f"kvd at {path}: {exc.message}", 3, as_json, type(exc).__name__)
    finally:
        c.close()
    if wait and exit_after and data["state"] != "exited":
        # the daemon shuts down (peers told, memory deregistered): wait until it is gone
        bound = time.monotonic() + 60.0
        while daemon_listening(path) and time.monotonic() < bound:
            time.sleep(0.1)
        data = {**data, "exited": not daemon_listening(path)}
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        _print_drain_report(data)
    return 1 if data["state"] == "timed_out" else 0


def _print_drain_report(d: dict[str, Any]) -> None:
    if d["state"] == "draining":
        console.print(drain_line(d))
        return
    console.print(drain_line(d) if "for_s" in d else f"drain: {d['state']}")
    if d["state"] == "timed_out":
        for side in ("sending", "receiving"):
            rows = d.get(side, {}).get("requests", [])
            if rows:
                console.print(table(f"still {side}", rows, ["request_id", "state", "age_s"]))
    if d.get("exited") or d["state"] == "exited":
        console.print("the daemon exited")


# ------------------------------------------------------------------ kvd abort


def abort(socket: str | None, request_id: str, as_json: bool) -> int:
    """End a request by hand on whichever side this daemon holds it."""
    from kvd_client import wire
    from kvd_client.errors import KvdError, NotFound

    c = client(socket, as_json)
    try:
        reply = c.request(wire.AbortRequest(request_id))
    except NotFound as exc:
        fail(exc.message, 1, as_json, "not_found")
    except KvdError as exc:
        fail(f"kvd at {c.socket_path}: {exc.message}", 3, as_json, type(exc).__name__)
    finally:
        c.close()
    assert isinstance(reply, wire.StatusReply)
    data = reply.data
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return 0
    for side, what in (("send", "P (sending)"), ("recv", "D (receiving)")):
        r = data.get(side)
        if r is None:
            continue
        if "error" in r:
            console.print(f"{what}: not aborted: {_escape(r['error'])}")
        elif r["now"] == "ended":
            console.print(f"{what}: {r['was']} -> ended; its engine got the failure")
        else:
            console.print(
                f"{what}: {r['was']} -> {r['now']}: it ends (and its engine gets the failure) "
                "once what is in flight returns"
            )
    return 0
