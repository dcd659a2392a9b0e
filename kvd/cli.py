"""The `kvd` command line: run the daemon, inspect it, diagnose peers, run the demo.

Every inspection command talks to a running daemon over its IPC socket (`--socket`
chooses one; the default is the daemon's default socket) and prints a rich table, or
JSON with `--json`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from kvd import __version__

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="kvd: KV-cache transfer daemon over NIXL."
)
console = Console()
err = Console(stderr=True)

SocketOpt = Annotated[
    str | None, typer.Option("--socket", "-s", help="The daemon's IPC socket path.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="A kvd TOML config file.")]


def _client(socket: str | None) -> Any:
    from kvd_client.client import KvdClient
    from kvd_client.errors import KvdError

    c = KvdClient(socket, role="cli", timeout=5.0, keepalive_interval=0)
    try:
        c.connect()
    except KvdError as exc:
        err.print(f"[red]cannot reach kvd at {c.socket_path}: {exc}[/red]")
        raise typer.Exit(3) from None
    return c


def _fetch(socket: str | None, section: str) -> dict[str, Any]:
    c = _client(socket)
    try:
        return c.status(section)  # type: ignore[no-any-return]
    finally:
        c.close()


def _table(title: str, rows: list[dict[str, Any]], columns: list[str]) -> Table:
    t = Table(title=title)
    for col in columns:
        t.add_column(col)
    for r in rows:
        t.add_row(*(_cell(r.get(c)) for c in columns))
    return t


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}"
    return str(v)


@app.command()
def serve(config: ConfigOpt = None) -> None:
    """Run the daemon in the foreground (systemd: Type=notify)."""
    from kvd.config import ConfigError, load_config
    from kvd.daemon import serve as run
    from kvd.logs import configure

    try:
        cfg = load_config(config)
    except ConfigError as exc:
        err.print(f"[red]config error:[/red] {exc}")
        raise typer.Exit(2) from None
    configure(cfg.log.level, cfg.log.format)
    raise typer.Exit(run(cfg))


@app.command("check-config")
def check_config(file: Path) -> None:
    """Validate a config file (exit 2 with the key and file named if it is wrong)."""
    from kvd.config import ConfigError, load_config

    try:
        load_config(file)
    except ConfigError as exc:
        err.print(f"[red]{exc}[/red]")
        raise typer.Exit(2) from None
    console.print(f"{file}: ok")


@app.command()
def status(socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """Version, uptime, agent, regions, peers, mailbox depths and counters."""
    data = _fetch(socket, "status")
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return
    console.print(
        f"kvd {data['version']}  agent [bold]{data['agent_name']}[/bold]  "
        f"uptime {data['uptime_s']:.0f}s  side channel {data['side_channel']}"
    )
    console.print(
        _table(
            "regions",
            data["regions"],
            [
                "region_id",
                "generation",
                "engine_id",
                "tp_rank",
                "tp_size",
                "blocks",
                "nbytes",
                "name",
                "compat",
            ],
        )
    )
    console.print(_table("peers", data["peers"], ["agent", "addr", "lease_duration", "age_s"]))
    boxes = [{"mailbox": k, **v} for k, v in data["mailboxes"].items()]
    console.print(_table("mailboxes", boxes, ["mailbox", "depth", "size", "rejected"]))
    counters = [{"counter": k, "value": v} for k, v in data["counters"].items()]
    console.print(_table("counters", counters, ["counter", "value"]))


@app.command()
def peers(socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """Peer daemons this daemon has handshaked with, and their regions."""
    data = _fetch(socket, "peers")
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return
    rows = [{**p, "regions": len(p["regions"])} for p in data["peers"]]
    cols = ["agent", "addr", "lease_duration", "regions", "age_s"]
    cols += ["clock_offset_us", "clock_error_us"]  # the peer's trace clock minus ours, ±
    console.print(_table("peers", rows, cols))


@app.command()
def leases(socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """P side: leased requests and their expiry. D side: requests being heartbeated."""
    data = _fetch(socket, "leases")
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return
    console.print(
        _table("leases", data["leases"], ["request_id", "state", "expires_in_s", "age_s"])
    )
    console.print(_table("heartbeated", data["tracked"], ["request_id", "peer", "hb_id"]))


@app.command()
def transfers(socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """Transfers in flight and recent ones: state, bytes, descriptors, duration."""
    data = _fetch(socket, "transfers")
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return
    cols = ["request_id", "op", "peer", "state", "bytes", "descriptors", "ranks", "duration_ms"]
    console.print(_table("in flight", data["in_flight"], cols))
    console.print(_table("recent", data["recent"][-20:], cols))
    console.print(
        _table(
            "receiving",
            data["receiving"],
            ["request_id", "mode", "peer", "state", "ranks_done", "ranks", "blocks", "age_s"],
        )
    )


@app.command()
def ec(socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """Encoder cache: region use, cached and produced hashes, pinned blocks, hits and misses."""
    data = _fetch(socket, "ec")
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return
    console.print(
        f"role [bold]{data['role']}[/bold]  region {data['region'] or '-'}  "
        f"{data['region_bytes'] / 2**20:.0f} MiB in {data['block_bytes'] / 2**20:g} MiB blocks"
    )
    pools = [{"pool": name, **data[name]} for name in ("producer", "consumer") if data.get(name)]
    console.print(
        _table(
            "blocks",
            pools,
            ["pool", "blocks", "used", "free", "pinned", "evictable", "entries", "evicted"],
        )
    )
    total = data["hits"] + data["misses"]
    rate = f"{data['hits'] / total:.1%}" if total else "-"
    console.print(f"hits {data['hits']}  misses {data['misses']}  hit rate {rate}")
    for key in ("produced", "cached", "fetching"):
        if data[key]:
            console.print(
                f"{key}: {', '.join(data[key][:20])}{' ...' if len(data[key]) > 20 else ''}"
            )


@app.command()
def ping(
    peer: Annotated[str, typer.Argument(help="HOST:PORT of the peer daemon's side channel.")],
    socket: SocketOpt = None,
    as_json: JsonOpt = False,
    timeout: Annotated[float, typer.Option(help="Seconds for the whole check.")] = 5.0,
) -> None:
    """Handshake with a peer, round-trip a notification, READ its canary and check the bytes."""
    host, _, port = peer.rpartition(":")
    if not host or not port.isdigit():
        err.print("[red]expected HOST:PORT[/red]")
        raise typer.Exit(2)
    from kvd_client.errors import InvalidRequest

    c = _client(socket)
    try:
        data = c.ping_peer(host, int(port), timeout)
    except InvalidRequest as exc:  # an address no daemon would dial
        err.print(f"[red]{exc.message}[/red]")
        raise typer.Exit(2) from None
    finally:
        c.close()
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        t = Table(title=f"ping {peer}")
        t.add_column("check")
        t.add_column("result")
        for k, v in data.items():
            t.add_row(k, _cell(v))
        console.print(t)
    if not data.get("ok"):
        raise typer.Exit(1)


@app.command()
def trace(
    request_id: Annotated[str, typer.Argument(help="The request's id (P's or D's).")],
    peer: Annotated[
        bool, typer.Option("--peer", help="Also the peer daemon's stages (side channel).")
    ] = False,
    socket: SocketOpt = None,
    as_json: JsonOpt = False,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the peer.")] = 5.0,
) -> None:
    """One request's stages on this daemon (and with --peer on its peer), on one clock."""
    from kvd_client.errors import KvdError

    from kvd.tracecmd import run

    c = _client(socket)
    try:
        code = run(c, request_id, peer, as_json, timeout)
    except KvdError as exc:
        err.print(f"[red]{exc.message}[/red]")
        raise typer.Exit(2) from None
    finally:
        c.close()
    raise typer.Exit(code)


@app.command()
def doctor(
    config: ConfigOpt = None,
    peer: Annotated[
        list[str] | None, typer.Option("--peer", help="A peer's side channel HOST:PORT.")
    ] = None,
    as_json: JsonOpt = False,
    timeout: Annotated[float, typer.Option(help="Seconds per TCP connect.")] = 2.0,
) -> None:
    """Check this node before it serves: limits, /dev/shm, UCX, NIXL, socket, clock, peers."""
    from kvd.config import ConfigError, load_config
    from kvd.doctor import as_json as to_json
    from kvd.doctor import exit_code, render, run

    try:
        cfg = load_config(config)
    except ConfigError as exc:
        err.print(f"[red]config error:[/red] {exc}")
        raise typer.Exit(2) from None
    checks = run(cfg, peer or [], timeout)
    if as_json:
        print(json.dumps(to_json(checks), indent=2))
    else:
        render(checks, console)
    raise typer.Exit(exit_code(checks))


@app.command()
def demo(
    requests: Annotated[int, typer.Option("--requests", "-n", help="Requests per mode.")] = 100,
    mode: Annotated[str, typer.Option(help="push, pull, ec (encoder cache) or all.")] = "all",
    as_json: JsonOpt = False,
    seed: Annotated[int, typer.Option(help="Random seed (block counts, arrival order).")] = 0,
) -> None:
    """Run a full local P/D pipeline: two daemons, simulated engines, every byte verified."""
    from kvd.demo import run_demo

    if mode not in ("push", "pull", "ec", "all"):
        err.print("[red]--mode must be push, pull, ec or all[/red]")
        raise typer.Exit(2)
    code = run_demo(
        requests=requests,
        modes=["push", "pull", "ec"] if mode == "all" else [mode],
        as_json=as_json,
        seed=seed,
    )
    raise typer.Exit(code)


@app.command()
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="A small, fast run (CI smoke).")] = False,
    json_file: Annotated[Path | None, typer.Option("--json", help="Write results as JSON.")] = None,
    only: Annotated[str, typer.Option(help="Scenarios: dataplane,control,scale,ec,topology.")] = "",
    seed: Annotated[int, typer.Option(help="Random seed (block allocation, ids).")] = 0,
) -> None:
    """Benchmark kvd against raw NIXL and memcpy on the same bytes: medians, ratios, targets."""
    from kvd.bench import SCENARIOS
    from kvd.bench.runner import run_bench

    chosen = [s.strip() for s in only.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in SCENARIOS]
    if unknown:
        err.print(
            f"[red]unknown scenario(s) {', '.join(unknown)}; choose from "
            f"{', '.join(SCENARIOS)}[/red]"
        )
        raise typer.Exit(2)
    code = run_bench(quick=quick, json_path=json_file, only=chosen, seed=seed, console=err)
    raise typer.Exit(code)


@app.command()
def version() -> None:
    """Print kvd's version."""
    console.print(__version__)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
