"""The `kvd` command line: run the daemon, inspect it, diagnose peers, run the demo and
the chaos run.

Every inspection command talks to a running daemon over its IPC socket (`--socket`
chooses one; the default is the daemon's default socket) and prints a rich table, or
JSON with `--json` (errors too). The operator's commands (drain, abort) and the
first-contact rules live in `kvd.ops`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from kvd import __version__
from kvd.ops import cell as _cell
from kvd.ops import console, err
from kvd.ops import table as _table

app = typer.Typer(
    add_completion=False, no_args_is_help=True, help="kvd: KV-cache transfer daemon over NIXL."
)
SocketOpt = Annotated[
    str | None, typer.Option("--socket", "-s", help="The daemon's IPC socket path.")
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="A kvd TOML config file.")]


def _client(socket: str | None, as_json: bool = False) -> Any:
    from kvd.ops import client

    return client(socket, as_json)


def _fetch(socket: str | None, section: str, as_json: bool = False) -> dict[str, Any]:
    from kvd.ops import fetch

    return fetch(socket, section, as_json)


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
    code = run(cfg)
    # Everything the daemon owns (NIXL agent, registrations, shared memory, sockets) was
    # released by its own shutdown before `run` returned. What is left is the
    # interpreter's teardown of a large heap (a full collection, module by module), which
    # took 3-5 s here and more on a busy node, inside systemd's stop timeout: skip it.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@app.command("check-config")
def check_config(file: Path, as_json: JsonOpt = False) -> None:
    """Validate a config file: every error in it, each with the file and key (exit 2)."""
    from kvd.config import ConfigError, load_config

    try:
        load_config(file)
    except ConfigError as exc:
        errors = exc.all()
        if as_json:
            out = [{"file": e.source, "key": e.key, "error": e.message} for e in errors]
            print(json.dumps({"ok": False, "errors": out}, indent=2))
        else:
            for e in errors:
                err.print(f"[red]{_escape(str(e))}[/red]", soft_wrap=True)
            if len(errors) > 1:
                err.print(f"{len(errors)} errors in {_escape(str(file))}")
        raise typer.Exit(2) from None
    if as_json:
        print(json.dumps({"ok": True, "errors": []}))
    else:
        console.print(f"{file}: ok")


def _escape(text: str) -> str:
    from rich.markup import escape

    return escape(text)


@app.command()
def status(socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """Version, uptime, agent, regions, peers, limits and their use, mailbox depths, counters."""
    from kvd.ops import print_status_header

    data = _fetch(socket, "status", as_json)
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return
    print_status_header(data)
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
    dropping = (data.get("registrar") or {}).get("dropping") or []
    if dropping:  # gone from the table above; not yet deregistered
        ids = ", ".join(str(i) for i in dropping)
        console.print(f"regions being dropped (peers told, transfers draining): {ids}")
    console.print(_table("peers", data["peers"], ["agent", "addr", "lease_duration", "age_s"]))
    limits = [{"name": k, **v} for k, v in data["limits"].items()]
    console.print(_table("limits", limits, ["name", "limit", "used", "peak", "refused"]))
    boxes = [{"mailbox": k, **v} for k, v in data["mailboxes"].items()]
    console.print(_table("mailboxes", boxes, ["mailbox", "depth", "size", "rejected"]))
    counters = [{"counter": k, "value": v} for k, v in data["counters"].items()]
    console.print(_table("counters", counters, ["counter", "value"]))


@app.command()
def peers(socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """Peer daemons this daemon has handshaked with, and their regions."""
    data = _fetch(socket, "peers", as_json)
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return
    rows = [{**p, "regions": len(p["regions"])} for p in data["peers"]]
    cols = ["agent", "incarnation", "addr", "lease_duration", "regions", "age_s"]
    cols += ["clock_offset_us", "clock_error_us"]  # the peer's trace clock minus ours, ±
    console.print(_table("peers", rows, cols))


@app.command()
def leases(socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """P side: leased requests and their expiry. D side: requests being heartbeated."""
    data = _fetch(socket, "leases", as_json)
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return
    console.print(
        _table("leases", data["leases"], ["request_id", "state", "expires_in_s", "age_s", "kept"])
    )
    console.print(_table("heartbeated", data["tracked"], ["request_id", "peer", "hb_id"]))


@app.command()
def transfers(socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """Transfers in flight and recent ones: state, bytes, descriptors, duration."""
    data = _fetch(socket, "transfers", as_json)
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
    data = _fetch(socket, "ec", as_json)
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
    for key in ("produced", "cached", "fetching", "quarantined"):
        if data[key]:
            console.print(
                f"{key}: {', '.join(data[key][:20])}{' ...' if len(data[key]) > 20 else ''}"
            )


@app.command()
def tiers(socket: SocketOpt = None, as_json: JsonOpt = False) -> None:
    """KV tiers: per tier capacity, use, blocks, hits, misses, evictions, bytes in and out
    (and peers' tiers: lookups, hits, misses, timeouts, bytes READ and served)."""
    data = _fetch(socket, "tiers", as_json)
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return
    if not data.get("enabled"):
        console.print("KV tiers are off (tiers.enabled = false)")
        return
    console.print(
        f"pool {data['pool']}  block {data['block_bytes']} bytes  "
        f"pending lookups {data['pending_lookups']}  operations open {data['ops_open']}"
    )
    rows = [{"tier": name, **data[name]} for name in ("host", "disk") if data.get(name)]
    peer = data.get("peer") or {}
    if peer.get("asked") or peer.get("configured") or peer.get("bytes_out"):
        keys = ("hits", "misses", "bytes_in", "bytes_out")
        rows.append({"tier": "peer", **{k: peer[k] for k in keys}})
    for row in rows:
        total = row["hits"] + row["misses"]
        row["hit_rate"] = f"{row['hits'] / total:.1%}" if total else "-"
    cols = ["tier", "capacity", "used", "blocks", "hits", "misses", "hit_rate", "evictions"]
    console.print(_table("tiers", rows, [*cols, "bytes_in", "bytes_out"]))
    host = data.get("host") or {}
    console.print(
        f"host slots: {host.get('free_slots', 0)} free, {host.get('lent', 0)} lent to clients "
        f"ahead of their stores, {host.get('quarantined', 0)} out of use until a frozen or "
        "slow client is done with them"
    )
    directory = host.get("directory") or {}
    if directory:
        console.print(
            f"directory: {directory['blocks']} blocks that engines load without a round trip "
            f"({directory['direct_loads']} loaded so, counting blocks read from disk files; "
            f"{directory['unpublished']} found no free entry and are loaded pinned)"
        )
    if peer:
        console.print(
            f"peers asked {', '.join(peer['asked']) or '-'}  "
            f"(configured {', '.join(peer['configured']) or '-'}; known peers "
            f"{'too' if peer['ask_known_peers'] else 'not'})  lookups {peer['lookups']}  "
            f"timeouts {peer['timeouts']}  bad answers {peer['bad_answers']}  "
            f"blocks loaded {peer['blocks_loaded']}  pins held for peers {peer['pins_held']}"
        )
    counters = [{"counter": k, "value": v} for k, v in data.get("counters", {}).items()]
    console.print(_table("counters", counters, ["counter", "value"]))


@app.command()
def top(
    socket: SocketOpt = None,
    interval: Annotated[float, typer.Option(help="Seconds between frames.")] = 1.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit.")] = False,
) -> None:
    """Live view: throughput, in flight, leases, regions, EC, errors, per peer (q quits)."""
    from kvd.top import run_top

    c = _client(socket)
    c.timeout = max(2.0, 2 * interval)  # a dead daemon shows within a frame or two
    try:
        code = run_top(
            lambda: c.status("status"), interval=interval, once=once, reconnect=c.connect
        )
    finally:
        c.close()
    raise typer.Exit(code)


@app.command()
def ping(
    peer: Annotated[str, typer.Argument(help="HOST:PORT of the peer daemon's side channel.")],
    socket: SocketOpt = None,
    as_json: JsonOpt = False,
    timeout: Annotated[float, typer.Option(help="Seconds for the whole check.")] = 5.0,
) -> None:
    """Handshake with a peer, round-trip a notification, move its canary and check the bytes.

    The canary is READ where that READ is native, and WRITTEN by the peer where UCX would
    emulate the READ (TCP: `canary_by`), as pulls go."""
    from kvd.ops import fail

    host, _, port = peer.rpartition(":")
    if not host or not port.isdigit():
        fail("expected HOST:PORT", 2, as_json, "usage")
    from kvd_client.errors import InvalidRequest, KvdError

    c = _client(socket, as_json)
    try:
        data = c.ping_peer(host, int(port), timeout)
    except InvalidRequest as exc:  # an address no daemon would dial
        fail(exc.message, 2, as_json, "invalid")
    except KvdError as exc:
        fail(f"kvd at {c.socket_path}: {exc.message}", 3, as_json, type(exc).__name__)
    finally:
        c.close()
    if as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        t = Table(title=f"ping {peer}")
        t.add_column("check")
        t.add_column("result", overflow="fold")
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

    from kvd.ops import fail
    from kvd.tracecmd import run

    c = _client(socket, as_json)
    try:
        code = run(c, request_id, peer, as_json, timeout)
    except KvdError as exc:
        fail(exc.message, 2, as_json, type(exc).__name__)
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
    from kvd.ops import fail

    try:
        cfg = load_config(config)
    except ConfigError as exc:
        fail(f"config error: {exc}", 2, as_json, "config")
    checks = run(cfg, peer or [], timeout)
    if as_json:
        print(json.dumps(to_json(checks), indent=2))
    else:
        render(checks, console)
    raise typer.Exit(exit_code(checks))


@app.command()
def drain(
    socket: SocketOpt = None,
    config: Annotated[
        Path | None,
        typer.Option("--config", "-c", help="Take the socket from this kvd config file."),
    ] = None,
    as_json: JsonOpt = False,
    timeout: Annotated[
        float,
        typer.Option(
            help="Seconds to wait for what is in flight to end (0 = until it has; the "
            "protocol's own timeouts bound it). With --exit the daemon exits at the "
            "timeout anyway."
        ),
    ] = 0.0,
    exit_after: Annotated[
        bool, typer.Option("--exit", help="Make the daemon exit once drained.")
    ] = False,
    wait: Annotated[
        bool, typer.Option(help="Follow the drain until it is over (--no-wait: start it).")
    ] = True,
) -> None:
    """Take the daemon out of service: refuse new leases and transfers (each failed at once,
    on both sides, so D recomputes), let what is in flight end, report (exit 1 if the
    timeout left requests in flight)."""
    from kvd.ops import drain as run
    from kvd.ops import fail

    if timeout < 0 or timeout > 86400:
        fail("--timeout must be between 0 and 86400 seconds", 2, as_json, "usage")
    if config is not None and socket is None:
        from kvd.config import ConfigError, load_config, resolve_socket_path

        try:
            socket = str(resolve_socket_path(load_config(config)))
        except ConfigError as exc:
            fail(str(exc), 2, as_json, "config")
    raise typer.Exit(run(socket, timeout, exit_after, wait, as_json))


@app.command()
def abort(
    request_id: Annotated[str, typer.Argument(help="The request id (as kvd leases shows it).")],
    socket: SocketOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """End a stuck request by hand: P ends the lease, D the request it tracks or receives;
    the engine gets its failure event (exit 1 if this daemon holds no such request)."""
    from kvd.ops import abort as run

    raise typer.Exit(run(socket, request_id, as_json))


@app.command()
def demo(
    requests: Annotated[int, typer.Option("--requests", "-n", help="Requests per mode.")] = 100,
    mode: Annotated[
        str, typer.Option(help="push, pull, ec (encoder cache), tiers (KV tiers) or all.")
    ] = "all",
    as_json: JsonOpt = False,
    seed: Annotated[int, typer.Option(help="Random seed (block counts, arrival order).")] = 0,
) -> None:
    """Run a full local P/D pipeline: two daemons, simulated engines, every byte verified."""
    from kvd.demo import run_demo

    if mode not in ("push", "pull", "ec", "tiers", "all"):
        err.print("[red]--mode must be push, pull, ec, tiers or all[/red]")
        raise typer.Exit(2)
    code = run_demo(
        requests=requests,
        modes=["push", "pull", "ec", "tiers"] if mode == "all" else [mode],
        as_json=as_json,
        seed=seed,
    )
    raise typer.Exit(code)


@app.command()
def bench(
    quick: Annotated[bool, typer.Option("--quick", help="A small, fast run (CI smoke).")] = False,
    json_file: Annotated[Path | None, typer.Option("--json", help="Write results as JSON.")] = None,
    only: Annotated[
        str, typer.Option(help="Scenarios: dataplane,control,scale,ec,topology,layerwise,tiers.")
    ] = "",
    seed: Annotated[int, typer.Option(help="Random seed (block allocation, ids).")] = 0,
    plot: Annotated[Path | None, typer.Option("--plot", help="Write PNG charts here.")] = None,
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
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        err.print("[red]--plot needs matplotlib: pip install 'kvd[plot]'[/red]")
        raise typer.Exit(2)
    code = run_bench(
        quick=quick, json_path=json_file, only=chosen, seed=seed, console=err, plot_dir=plot
    )
    raise typer.Exit(code)


@app.command()
def chaos(
    duration: Annotated[float, typer.Option(help="Seconds of faults under load.")] = 300.0,
    seed: Annotated[int, typer.Option(help="Random seed (fault moments, load).")] = 0,
    as_json: JsonOpt = False,
    fuzz: Annotated[
        bool,
        typer.Option(
            "--fuzz",
            help="Then fuzz a fresh daemon's every surface, and from clients with sessions.",
        ),
    ] = False,
    fuzz_frames: Annotated[
        int,
        typer.Option(
            help="Frames in all with --fuzz (shared by the four surfaces; the sessions send "
            "a quarter as many messages more)."
        ),
    ] = 100_000,
    reap: Annotated[
        bool, typer.Option(help="daemon.reap_leftover_segments of the daemons (machine-wide).")
    ] = True,
    two_hosts: Annotated[
        bool,
        typer.Option(
            "--two-hosts",
            help="P and E on one host, D and C on another (network namespaces and a veth, "
            "UCX over TCP; needs root); the link is cut and slowed too.",
        ),
    ] = False,
    forget_silent_peers: Annotated[
        float,
        typer.Option(
            help="side_channel.forget_silent_peers of the daemons, seconds (0: their "
            "default, which a run never reaches; a few seconds makes cuts and freezes "
            "forget peers mid-run).",
            min=0.0,
        ),
    ] = 0.0,
    soak: Annotated[
        bool,
        typer.Option(
            "--soak",
            help="No faults under the load: the same load and checks for --duration seconds, "
            "each daemon one incarnation (its memory judged over the whole run: a leak keeps "
            "growing); the victim engine is still SIGKILLed at the end, as in every run.",
        ),
    ] = False,
) -> None:
    """Four daemons under load (KV transfers, encoder outputs, KV tier stores and loads)
    while daemons and engines are killed, stopped, starved of CPU
    and restarted (and, with --two-hosts, the link between them cut and slowed);
    the invariants that held, as figures (exit 1 if one broke)."""
    from kvd import netns
    from kvd.chaos import ChaosConfig, run_chaos

    if two_hosts and (why := netns.unavailable()) is not None:
        err.print(f"[red]--two-hosts: {why}[/red]")
        raise typer.Exit(2)
    cfg = ChaosConfig(
        duration=duration,
        seed=seed,
        reap=reap,
        fuzz_frames=fuzz_frames if fuzz else 0,
        two_hosts=two_hosts,
        forget_silent=forget_silent_peers,
        faults=not soak,
    )
    raise typer.Exit(run_chaos(cfg, as_json, err if as_json else console))


@app.command()
def version() -> None:
    """Print kvd's version."""
    console.print(__version__)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        sys.exit(130)
