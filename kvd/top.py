"""`kvd top`: a live view of one daemon, built from its `status` section over IPC.

Each frame asks the daemon for `status` (the same data as `kvd status --json`) and shows
what changed since the last one as rates: throughput, transfers per second and per peer,
transfers in flight, leases, registrations, encoder-cache (and tier, where a daemon
reports one) use, and errors by reason. It fits 80 columns, so it works over SSH in a
plain terminal. `q` quits: keys are read without blocking (the terminal in cbreak mode,
restored on the way out, even on Ctrl-C). `--once` prints one frame (rates over one
interval) and exits, for scripts and tests.

The view itself (`render`) is a pure function of two status snapshots and the seconds
between them; `run_top` is the shell around it (the IPC client, the clock, the keys).
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any, Final, TextIO

from rich import box
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

WIDTH: Final = 80
_SIDE: Final = {"sender": "P", "receiver": "D"}
Status = dict[str, Any]


# ------------------------------------------------------------------ the view (pure)


def _rate(cur: float, prev: float | None, dt: float) -> float | None:
    if prev is None or dt <= 0:
        return None
    return max(0.0, (cur - prev) / dt)


def _bytes(n: float | None) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n:.0f} B"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _ms(s: float | None) -> str:
    return "-" if s is None else f"<={s * 1e3:g}ms"


def _get(d: Status | None, *path: str, default: Any = 0) -> Any:
    cur: Any = d
    for key in path:
        if not isinstance(cur, dict) or key not in cur:
            return default
        cur = cur[key]
    return cur


def _table(*columns: str, title: str = "", header: bool = True) -> Table:
    t = Table(
        title=title or None,
        box=box.SIMPLE_HEAD,
        show_edge=False,
        show_header=header,
        pad_edge=False,
        title_justify="left",
        title_style="bold",
    )
    for i, col in enumerate(columns):
        t.add_column(col, justify="left" if i == 0 else "right", no_wrap=True)
    return t


def _peers(cur: Status, prev: Status | None, dt: float) -> Table:
    t = _table("peer", "xfers", "bytes", "rate/s", "failed", "addr", title="per peer")
    addrs = {p.get("agent"): p.get("addr", "") for p in cur.get("peers", [])}
    totals: dict[str, list[int]] = {}
    before: dict[str, int] = {}
    for side in ("sender", "receiver"):
        for agent, v in _get(cur, side, "by_peer", default={}).items():
            acc = totals.setdefault(agent, [0, 0, 0])
            acc[0] += v["transfers"]
            acc[1] += v["bytes"]
            acc[2] += v["failed"]
        for agent, v in _get(prev, side, "by_peer", default={}).items():
            before[agent] = before.get(agent, 0) + v["bytes"]
    for agent in sorted(set(totals) | set(addrs)):
        n, b, f = totals.get(agent, [0, 0, 0])
        rate = _rate(b, before.get(agent, 0), dt) if prev is not None else None
        t.add_row(agent[:22], str(n), _bytes(b), _bytes(rate), str(f), str(addrs.get(agent, "-")))
    return t


ERROR_ROWS: Final = 6
"""Reasons the errors table shows at most (the newest first)."""


def _errors(cur: Status, prev: Status | None) -> Table:
    t = _table("error", "total", "new", title="errors by reason")
    rows: list[tuple[str, int, int]] = []
    for side in ("sender", "receiver"):
        now = _get(cur, side, "failures", default={})
        was = _get(prev, side, "failures", default={})
        for reason, n in now.items():
            rows.append((f"{_SIDE[side]} {reason}", n, n - was.get(reason, 0)))
    nixl_now = _get(cur, "nixl", "errors", default={})
    nixl_was = _get(prev, "nixl", "errors", default={})
    for name, n in nixl_now.items():
        rows.append((f"nixl {name}", n, n - nixl_was.get(name, 0)))
    counters = cur.get("counters", {})
    old = _get(prev, "counters", default={})
    for name, n in counters.items():
        if n and ("rejected" in name or "failed" in name or name.endswith("_expired")):
            rows.append((name, n, n - old.get(name, 0)))
    # at most ERROR_ROWS, the newest first (a long list would push the peers off screen)
    rows.sort(key=lambda r: (-r[2], -r[1], r[0]))
    for name, n, new in rows[:ERROR_ROWS]:
        t.add_row(name[:40], str(n), f"+{new}" if new else "")
    if len(rows) > ERROR_ROWS:
        t.add_row(f"... {len(rows) - ERROR_ROWS} more (kvd status)", "", "")
    if not rows:
        t.add_row("none", "", "")
    return t


def _xfer(cur: Status, prev: Status | None, dt: float) -> Table:
    t = _table("op", "xfers", "xfers/s", "bytes/s", "total", "p50", "p90", title="transfers")
    for side in ("sender", "receiver"):
        for op, st in sorted(_get(cur, side, "xfer_stats", default={}).items()):
            was = _get(prev, side, "xfer_stats", op, default=None)
            t.add_row(
                f"{op} ({_SIDE[side]})",
                str(st["count"]),
                _num(_rate(st["count"], was["count"] if was else None, dt)),
                _bytes(_rate(st["bytes_sum"], was["bytes_sum"] if was else None, dt)),
                _bytes(st["bytes_sum"]),
                _ms(st["xfer_time_p50_s"]),
                _ms(st["xfer_time_p90_s"]),
            )
    if not t.rows:
        t.add_row("none yet", "", "", "", "", "", "")
    return t


def _now(cur: Status, prev: Status | None, dt: float) -> Table:
    s, r = cur.get("sender", {}), cur.get("receiver", {})
    regions = cur.get("regions", [])
    t = _table("", "", "", "", title="now", header=False)
    done = [_get(cur, "counters", k) for k in ("sends_ok", "recv_ok")]
    was = [_get(prev, "counters", k) if prev is not None else None for k in ("sends_ok", "recv_ok")]
    rates = [_num(_rate(n, w, dt)) for n, w in zip(done, was, strict=True)]
    t.add_row("ended ok (P/D)", f"{done[0]}/{done[1]}", "per second", "/".join(rates))
    t.add_row(
        "in flight (P/D)",
        f"{s.get('sending', 0)}/{r.get('sending', 0)}",
        "NIXL in flight",
        str(_get(cur, "nixl", "inflight")),
    )
    t.add_row(
        "leases held",
        str(s.get("leases", 0)),
        "awaiting finish",
        f"{s.get('pending_registrations', 0)} reg, {s.get('early_pulls', 0)} pull",
    )
    t.add_row(
        "D tracked",
        str(r.get("tracked", 0)),
        "D receiving",
        str(r.get("receiving", 0)),
    )
    t.add_row(
        "regions",
        f"{len(regions)} ({_bytes(sum(x.get('nbytes', 0) for x in regions))})",
        "peers / clients",
        f"{len(cur.get('peers', []))} / {len(cur.get('sessions', []))}",
    )
    return t


def _ec(cur: Status) -> Table | None:
    ec = cur.get("ecrouter") or {}
    pools: list[tuple[str, dict[str, Any]]] = [
        (name, ec[name]) for name in ("producer", "consumer") if ec.get(name)
    ]
    tiers = cur.get("tiers")
    if not pools and not tiers:
        return None
    t = _table("pool", "used", "blocks", "pinned", "entries", "evicted", title="EC / tiers")
    for name, p in pools:
        t.add_row(
            f"ec {name}",
            str(p["used"]),
            str(p["blocks"]),
            str(p["pinned"]),
            str(p["entries"]),
            str(p["evicted"]),
        )
    if pools:
        hits, misses = ec.get("hits", 0), ec.get("misses", 0)
        rate = f"{hits / (hits + misses):.0%}" if hits + misses else "-"
        t.add_row("ec hits/misses", f"{hits}/{misses}", rate, "", "", "")
    if isinstance(tiers, dict):
        for name, v in sorted(tiers.items()):
            if isinstance(v, dict):
                t.add_row(
                    f"tier {name}"[:22],
                    str(v.get("used", "-")),
                    str(v.get("blocks", v.get("capacity", "-"))),
                    "",
                    str(v.get("entries", "")),
                    str(v.get("evicted", "")),
                )
    return t


def render(cur: Status, prev: Status | None, dt: float, note: str = "") -> RenderableType:
    """One frame: `cur` and the snapshot `dt` seconds before it (None: no rates yet)."""
    boxes = cur.get("mailboxes", {})
    depth = "  ".join(f"{k} {v.get('depth', 0)}" for k, v in boxes.items())
    moved = _get(cur, "nixl", "bytes_moved")
    moved_rate = _rate(moved, _get(prev, "nixl", "bytes_moved", default=None), dt)
    head = Text.assemble(
        ("kvd top ", "bold"),
        (str(cur.get("agent_name", "?"))[:40], "bold cyan"),
        f"  v{cur.get('version', '?')}  up {cur.get('uptime_s', 0):.0f}s",
    )
    parts: list[RenderableType] = [
        head,
        Text(f"moved {_bytes(moved)} ({_bytes(moved_rate)}/s)"),
        Text(f"mailboxes: {depth}", style="dim"),
    ]
    parts += [_xfer(cur, prev, dt), _now(cur, prev, dt)]
    ec = _ec(cur)
    if ec is not None:
        parts.append(ec)
    parts += [_errors(cur, prev), _peers(cur, prev, dt)]
    parts.append(Text(note or "q quits", style="dim"))
    return Group(*parts)


# ------------------------------------------------------------------ the shell


@contextlib.contextmanager
def _keys(stream: TextIO) -> Iterator[Callable[[float], str]]:
    """Yield `wait(seconds) -> key or ""`: sleeps up to `seconds`, returning early with
    the key pressed. The terminal is in cbreak mode meanwhile (keys arrive unbuffered and
    unechoed) and restored afterwards; without a terminal it only sleeps."""
    fd = stream.fileno() if stream.isatty() else -1
    if fd < 0:

        def sleep(seconds: float) -> str:
            time.sleep(seconds)
            return ""

        yield sleep
        return
    import termios
    import tty

    saved = termios.tcgetattr(fd)
    try:
        tty.setcbreak(fd)

        def wait(seconds: float) -> str:
            ready, _, _ = select.select([fd], [], [], max(0.0, seconds))
            return os.read(fd, 32).decode(errors="replace") if ready else ""

        yield wait
    finally:
        termios.tcsetattr(fd, termios.TCSADRAIN, saved)


def run_top(
    fetch: Callable[[], Status],
    *,
    interval: float = 1.0,
    once: bool = False,
    console: Console | None = None,
    reconnect: Callable[[], object] | None = None,
) -> int:
    """Show frames until `q` (0) or Ctrl-C (130); with `once`, print one frame (rates over
    one `interval`) and return. A failed fetch shows its error and is retried (after
    `reconnect`, if given) at the next tick; with `once` it returns 3."""
    from kvd_client.errors import KvdError

    console = console or Console(width=WIDTH if not sys.stdout.isatty() else None)
    if once:
        try:
            first = fetch()
            t0 = time.monotonic()
            time.sleep(interval)
            cur = fetch()
        except KvdError as exc:
            Console(stderr=True).print(f"[red]cannot reach kvd: {exc}[/red]")
            return 3
        console.print(render(cur, first, time.monotonic() - t0, note=" "))
        return 0
    prev: Status | None = None
    t_prev = 0.0
    frame: RenderableType = Text("connecting ...")
    try:
        with (
            _keys(sys.stdin) as wait,
            Live(frame, console=console, auto_refresh=False, transient=False) as live,
        ):
            while True:
                try:
                    cur = fetch()
                    now = time.monotonic()
                    frame = render(cur, prev, now - t_prev)
                    prev, t_prev = cur, now
                except KvdError as exc:
                    frame = Text(f"cannot reach kvd: {exc} (retrying; q quits)", style="red")
                    prev = None
                    if reconnect is not None:
                        with contextlib.suppress(KvdError):
                            reconnect()
                live.update(frame, refresh=True)
                deadline = time.monotonic() + interval
                while (left := deadline - time.monotonic()) > 0:
                    key = wait(left)
                    if key and key[0] in "qQ":
                        return 0
    except KeyboardInterrupt:
        return 130
