"""`kvd chaos`: real daemons under sustained faults and load, and the figures that held.

Four `kvd serve` processes (P and D for KV-cache blocks, an encoder E and a consumer C
for encoder outputs) with fixed sockets and ports, as systemd would run them. The
simulated engines of `kvd.demo` (real thin clients, shared-memory KV regions, two ranks)
drive mixed push, layer-wise push and pull requests P -> D (`kvd.traffic.Traffic`: P
fills blocks with a per-request pattern, layer by layer for a layer-wise push, and
poisons them the moment its send ends; D checks every byte it is told is done), and an
encoder stream E -> C (`kvd.ecdemo.output_bytes`, every byte checked at C), and KV tier
calls on P's and D's daemons, each the other's tier peer (`kvd.tiertraffic`: blocks
stored, looked up and loaded from the host pool, the disk tier or the peer, every loaded
byte checked). Victim engines (engine pairs in child processes) run their own traffic,
tier calls included.

Meanwhile a driver seeded by `--seed` picks random moments and injects faults: a daemon
SIGKILLed and restarted ~2 s later on the same socket and ports, a daemon SIGSTOPped
and SIGCONTed, a daemon starved of CPU for seconds (held to 2-10 % of a core,
`kvd.cpulimit`: slow, not dead; where the machine has a writable cpu cgroup), a victim
engine SIGKILLed and started again, SIGSTOPped and SIGCONTed, or starved of CPU.
With `two_hosts` (`kvd chaos --two-hosts`) P and E run on one host and D and C on
another (`kvd.netns`: network namespaces joined by a veth, UCX over TCP on it, so every
daemon-to-daemon byte crosses the link), and the link is cut (0.5-10 s) or slowed (8-64
Mbit/s, 400 ms queued, 1-5 s) as faults too. A transfer in flight over a cut or slowed
link is waited for (the peer is not dead; NIXL cannot cancel it), so the time the link
was cut or slowed does not count for a request's bound, as the time its daemons were
stopped does not: every request must end within its bound of the link's return.
Then everything settles and the invariants are checked:

- every announced request ended exactly once on each side, within its bound: the KV
  lease + 1 s (or `DEAD_P_BOUND` where its P daemon died) for KV requests, the EC
  transfer timeout + 1 s for encoder outputs, counted from the request's start or from
  the end of the last fault that held up its daemons, whichever is later;
- no wrong bytes were ever reported done;
- nothing leaked: no lease, registration, pin, session or tracked request of a party
  that is gone is left in a surviving daemon (`kvd status`; for the tiers: no pin,
  reservation, lent or quarantined slot, pin for a peer), and no shared-memory segment
  of ours is left in /dev/shm once everything stopped;
- every tier call returned or raised within `kvd.tiertraffic.call_bound`;
- daemon memory is flat: see `rss_flat`.

`run_fuzz` (`kvd chaos --fuzz`) sends random and mutated frames at a live daemon's IPC
socket, side channel, EC router, and as NIXL notifications from a rogue agent, while a
good client is served; see `kvd.fuzz`.

Run with `python -m kvd.chaos victim ...` the module is a victim engine pair.
"""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any, Final, NamedTuple

import numpy as np
from kvd_client import wire
from kvd_client.client import KvdClient
from kvd_client.errors import ErrorCode, KvdError

from kvd import cpulimit, netns
from kvd.actors.ecrouter import ec_segment_creator
from kvd.actors.tiers import pool_creator
from kvd.cpulimit import CpuLimit
from kvd.demo import DaemonProc, Engine, make_engine, start_daemon
from kvd.ecdemo import output_bytes
from kvd.tiertraffic import KEYS as TIER_KEYS
from kvd.tiertraffic import TierWorker, call_bound, key_space, tier_holdings, tiers_overrides
from kvd.traffic import NOT_OFFERED, Traffic

HOST: Final = "127.0.0.1"
LEASE_WAIT_TIMEOUT: Final = 5.0
"""transfer.lease_wait_timeout (the default): how long P keeps a pull that came before
its engine's finish. With the lease, it makes the KV bound: max(lease, this) + 1 s."""
DEAD_P_BOUND: Final = 5.0
"""Seconds within which D must end a request whose P daemon died (the issue's bound)."""
RESTART_AFTER: Final = 2.0
"""Seconds between a daemon's SIGKILL and its restart, and between a start that failed
and the next (systemd's RestartSec)."""
START_TRIES_S: Final = 60.0
"""How long a daemon's failed starts are tried again before the run gives up."""
RSS_WARMUP_S: Final = 5.0
"""Seconds after a daemon's start before its memory samples count (imports, NIXL and
UCX set-up, first peers)."""
RSS_TOLERANCE_KIB: Final = 24 * 1024
"""Growth allowed between the first and the last quarter of an incarnation's samples:
`rss_flat` holds when the anonymous memory's max(last quarter) <= max(first quarter) +
max(this, 10%)."""
DRIVER_STALL: Final = 0.3
"""A gap between two turns of the driver's loop longer than this (seconds) is a stall of
the driver: what it drains right after waited for it, not for the daemons."""
STOP_TIMEOUT: Final = 30.0
"""Seconds a daemon may take to exit after SIGTERM (its shutdown_timeout is 5 s; a busy
machine adds to it)."""
READY_TIMEOUT: Final = 120.0
"""Seconds a daemon may take to start (a busy 2-core machine can take tens)."""
EC_COMPAT: Final = "kvd-chaos-encoder"
KV_NAMES: Final = ("p", "d")
KV_TP: Final = 2
"""Ranks of the main engines (a region each; the victims' engines have one)."""
KV_MODES: Final = ("push", "pull", "layers")
"""Whole pushes, pulls and layer-wise pushes (`kvd.traffic`), in turn."""
EC_NAMES: Final = ("e", "c")
LINK_NET: Final = "10.78.0"
"""The two hosts' addresses (`kvd chaos --two-hosts`): .1 (P, E) and .2 (D, C)."""
VICTIM_TIER_KEYS: Final = 48
"""A victim's own tier blocks (stored and loaded on P's daemon beside the main ones)."""
LINK_QUEUE_MS: Final = 400
"""A slowed link queues up to this much (tbf latency): what waits behind bulk bytes,
notifications and heartbeats included, is that late."""


# ------------------------------------------------------------------ configuration


@dataclass(frozen=True)
class ChaosConfig:
    duration: float = 40.0
    """Seconds of faults under load (the settle and the checks come after)."""
    seed: int = 0
    lease: float = 4.0
    """transfer.kv_lease_duration of P and D (short, so that expiries happen)."""
    client_timeout: float = 3.0
    """daemon.client_timeout: a session silent this long is ended."""
    ec_xfer_timeout: float = 4.0
    fault_gap: tuple[float, float] = (1.0, 3.0)
    """Seconds between two faults, drawn uniformly."""
    faults: bool = True
    """False: a soak, the same load and checks with no fault during the load (each daemon
    one incarnation, its memory judged over the whole run); the settle still SIGKILLs the
    victim engines, as in every run, for the leak checks."""
    freeze: tuple[float, float] = (0.3, 2.5)
    """Seconds a SIGSTOPped daemon stays stopped, drawn uniformly."""
    starve: tuple[float, float] = (1.0, 5.0)
    """Seconds a daemon is held to a share of a core, drawn uniformly."""
    starve_share: tuple[float, float] = (0.02, 0.1)
    """The share of one core a starved daemon gets, drawn uniformly."""
    victims: int = 1
    """Victim engine pairs (child processes) running at any time."""
    reap: bool = True
    """daemon.reap_leftover_segments (the default). Tests running beside others turn it
    off: reaping at start is machine-wide."""
    fuzz_frames: int = 0
    """Frames per surface for `kvd.fuzz.run_fuzz` after the chaos (0: none)."""
    two_hosts: bool = False
    """P and E on one host, D and C on another (`kvd.netns`: two network namespaces, a
    veth between them, UCX over TCP on it), with the link cut and slowed as faults too."""
    link_cut: tuple[float, float] = (0.5, 10.0)
    """Seconds the link between the hosts stays down, drawn uniformly: up to well past the
    lease (a partition: each side's timers run, leases expire, peers are judged gone,
    and what the other side sent before or during it must not count after it)."""
    link_slow: tuple[float, float] = (1.0, 5.0)
    """Seconds the link is slowed (both ways), drawn uniformly."""
    link_mbit: tuple[float, float] = (8.0, 64.0)
    """Its rate while slowed, Mbit/s, drawn uniformly; up to `LINK_QUEUE_MS` queued."""
    forget_silent: float = 0.0
    """side_channel.forget_silent_peers of the daemons (0: their default, 600 s, which a
    run never reaches). A few seconds makes link cuts and freezes forget peers mid-run."""
    workdir: Path | None = None


# ------------------------------------------------------------------ daemons


class RssSample(NamedTuple):
    """One sample of a daemon's memory (`rss_kib`)."""

    incarnation: int
    at: float
    """monotonic time"""
    total_kib: int
    """VmRSS"""
    anon_kib: int
    """RssAnon: the heap, stacks and private mappings (what a leak of objects grows)"""
    shmem_kib: int
    """RssShmem: pages of shared memory the daemon mapped and touched (engines' regions,
    its staging and tier pools): grows as a new incarnation first touches them, bounded
    by what it maps"""


@dataclass
class Node:
    """One daemon, started again on the same socket and ports after each kill."""

    key: str
    workdir: Path
    extra: str
    overrides: dict[str, dict[str, Any]]
    host: netns.Host | None = None
    """Its host with `--two-hosts` (it runs in that network namespace), else None."""
    proc: DaemonProc | None = None
    incarnation: int = 0
    pids: list[int] = field(default_factory=list)
    frozen: bool = False
    out_since: float = 0.0
    """monotonic time the current fault began (0: up and running)."""
    outages: list[tuple[float, float, str]] = field(default_factory=list)
    """(began, ended, kind) of every fault that held this daemon up: "kill", "stop", "stall"
    (the machine did not run it), "link cut" or "link slow" (two hosts: its peers are
    across the link). A CPU starvation is not one: a starved daemon runs, slowly, and its
    bounds still hold."""
    limit: CpuLimit | None = None
    """The CPU limit it is held to now (a "starve" fault), if any."""
    rss: list[RssSample] = field(default_factory=list)
    started_at: float = 0.0
    failed_starts: int = 0
    """Starts that exited before the daemon was ready (tried again, as systemd does)."""

    @property
    def name(self) -> str:
        return f"kvdc-{self.key}"

    @property
    def up(self) -> bool:
        return self.proc is not None and self.proc.proc.poll() is None and not self.frozen

    @property
    def addr(self) -> str:
        """Where its peers reach it."""
        return self.host.addr if self.host else HOST

    def harvest_stalls(self) -> None:
        """Take the stalls the current incarnation logged (`daemon_stalled`: the machine
        did not run it) as outages: the daemon's timers do not count them, so a bound in
        wall time cannot either. Read before a restart truncates the log, and at the end."""
        if self.proc is None:
            return
        offset = time.time() - time.monotonic()
        with contextlib.suppress(OSError):
            for line in self.proc.log.read_text().splitlines():
                if '"daemon_stalled"' not in line:
                    continue
                with contextlib.suppress(ValueError, KeyError, TypeError):
                    rec = json.loads(line)
                    ended = _wall(rec["timestamp"]) - offset
                    span = (ended - float(rec["seconds"]), ended, "stall")
                    if span not in self.outages:
                        self.outages.append(span)

    def start(self) -> None:
        """Start it (again), as systemd does: a start that fails (a port still held a
        moment after a SIGKILL; with two hosts, UCX refuses a veth that is down while the
        link is cut) is tried again every `RESTART_AFTER` seconds, for up to
        `START_TRIES_S`; each failed start is counted."""
        self.harvest_stalls()
        log = self.workdir / f"{self.name}.log"
        if log.exists():  # kept: the start below writes a new one (a crash's reason is here)
            log.rename(self.workdir / f"{self.name}.{self.incarnation}.log")
        last: Exception | None = None
        give_up = time.monotonic() + START_TRIES_S
        while True:
            try:
                self.proc = start_daemon(
                    self.workdir,
                    self.name,
                    self.extra,
                    self.host.ucx_env if self.host else None,
                    overrides=self.overrides,
                    prefix=self.host.prefix if self.host else (),
                    ready_timeout=READY_TIMEOUT,
                )
                break
            except RuntimeError as exc:
                if "did not become ready" in str(exc):
                    raise  # it was killed at its deadline: a retry would only wait again
                last = exc  # it exited
                self.failed_starts += 1
                if time.monotonic() >= give_up:
                    raise RuntimeError(f"{self.name} did not start again: {last}") from exc
                time.sleep(RESTART_AFTER)
        self.incarnation += 1
        self.pids.append(self.proc.proc.pid)
        self.started_at = time.monotonic()
        if self.out_since:
            self.outages.append((self.out_since, self.started_at, "kill"))
            self.out_since = 0.0

    def kill(self) -> None:
        assert self.proc is not None
        if self.frozen:
            self.thaw()
        self.proc.kill()
        self.out_since = time.monotonic()
        self.feed()  # the process is gone: its cgroup goes too

    def starve(self, share: float) -> None:
        assert self.proc is not None and self.limit is None
        self.limit = CpuLimit(self.proc.proc.pid, share, tag="kvdc")

    def feed(self) -> int:
        """The end of a starvation: the periods the kernel held it back (0 if none)."""
        if self.limit is None:
            return 0
        throttled = self.limit.throttled()
        self.limit.release()
        self.limit = None
        return throttled

    def freeze(self) -> None:
        assert self.proc is not None
        self.proc.proc.send_signal(signal.SIGSTOP)
        self.frozen = True
        self.out_since = time.monotonic()

    def thaw(self) -> None:
        assert self.proc is not None
        self.proc.proc.send_signal(signal.SIGCONT)
        self.frozen = False
        now = time.monotonic()
        self.outages.append((self.out_since, now, "stop"))
        self.out_since = 0.0

    def sample_rss(self) -> None:
        if self.proc is None or self.proc.proc.poll() is not None:
            return
        kib = rss_kib(self.proc.proc.pid)
        if kib is not None:
            total, anon, shmem = kib
            self.rss.append(RssSample(self.incarnation, time.monotonic(), total, anon, shmem))

    def status(self, section: str = "status") -> dict[str, Any]:
        assert self.proc is not None
        with KvdClient(self.proc.socket, role="cli", timeout=5.0, keepalive_interval=0) as c:
            got: dict[str, Any] = c.status(section)
            return got


def _wall(timestamp: str) -> float:
    """Unix seconds of a log line's ISO 8601 UTC timestamp."""
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()


def start_all(nodes: list[Node]) -> None:
    """Start daemons side by side (each start is mostly waiting for imports and NIXL)."""
    errors: list[BaseException] = []

    def start(n: Node) -> None:
        try:
            n.start()
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=start, args=(n,), daemon=True) for n in nodes]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    if errors:
        for n in nodes:
            if n.proc is not None:
                n.proc.stop()
        raise errors[0]


def rss_kib(pid: int) -> tuple[int, int, int] | None:
    """A process's resident memory (VmRSS), its anonymous part (RssAnon: heap, stacks,
    private mappings) and its shared-memory part (RssShmem) in KiB; None if it is gone."""
    got: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key = line.split(":", 1)[0]
                if key in ("VmRSS", "RssAnon", "RssShmem"):
                    got[key] = int(line.split()[1])
    except (OSError, ValueError):
        return None
    if "VmRSS" not in got:
        return None
    return got["VmRSS"], got.get("RssAnon", got["VmRSS"]), got.get("RssShmem", 0)


def deleted_shm_mappings(pid: int) -> list[str]:
    """The shared-memory files a process still maps although they were removed (`(deleted)`
    in /proc/<pid>/maps): memory held for a segment nobody can open any more."""
    names: set[str] = set()
    try:
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                if "/dev/shm/" in line and line.rstrip().endswith("(deleted)"):
                    names.add(line.split("/dev/shm/", 1)[1].rsplit(" (deleted)", 1)[0])
    except OSError:
        return []
    return sorted(names)


def free_port(avoid: set[int]) -> int:
    """A free TCP port below the ephemeral range (a restarted daemon binds it again, and
    no outgoing connection can have taken it meanwhile)."""
    lo, _ = _ephemeral_range()
    pick = random.SystemRandom()
    for _ in range(200):
        port = pick.randrange(20000, min(lo, 32768))
        if port in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind((HOST, port))
            except OSError:
                continue
        avoid.add(port)
        return port
    raise RuntimeError("no free port below the ephemeral range")


def _ephemeral_range() -> tuple[int, int]:
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 32768, 60999


def make_nodes(
    workdir: Path, cfg: ChaosConfig, hosts: tuple[netns.Host, netns.Host] | None = None
) -> dict[str, Node]:
    """The four daemons; with `hosts`, P and E on the first, D and C on the second (UCX
    over TCP on their veth, side channels and EC routers on the hosts' addresses)."""
    ports: set[int] = set()
    common: dict[str, dict[str, Any]] = {
        "daemon": {
            "client_timeout": cfg.client_timeout,
            "reap_leftover_segments": cfg.reap,
        },
        "transfer": {
            "kv_lease_duration": cfg.lease,
            "lease_wait_timeout": LEASE_WAIT_TIMEOUT,
            "peer_probe_interval": 0.5,
        },
        "side_channel": {"handshake_timeout": 2.0},
    }
    if cfg.forget_silent > 0:
        common["side_channel"]["forget_silent_peers"] = cfg.forget_silent

    def node(key: str, ec_role: str = "") -> Node:
        over = {k: dict(v) for k, v in common.items()}
        over["side_channel"]["port"] = free_port(ports)
        host = None if hosts is None else hosts[0 if key in ("p", "e") else 1]
        if host is not None:
            over["side_channel"]["host"] = host.addr
            over["nixl"] = {"ucx_tls": "tcp"}
        if ec_role:
            over["ec"] = {
                "role": ec_role,
                "port": free_port(ports),
                "region_bytes": 32 << 20,
                "block_bytes": 256 << 10,
                "xfer_timeout": cfg.ec_xfer_timeout,
            }
        return Node(key, workdir, "", over, host)

    nodes = {
        "p": node("p"),
        "d": node("d"),
        "e": node("e", "producer"),
        "c": node("c", "consumer"),
    }
    for key, other in (("p", "d"), ("d", "p")):  # KV tiers, each the other's peer
        peer = nodes[other]
        nodes[key].overrides["tiers"] = tiers_overrides(
            str(workdir / f"tiers-{key}"), f"{peer.addr}:{peer.overrides['side_channel']['port']}"
        )
    return nodes


# ------------------------------------------------------------------ encoder outputs


class _Mapped:
    """A daemon's EC region mapped by name (the mapping outlives the segment's name)."""

    def __init__(self, name: str, nbytes: int, block_bytes: int) -> None:
        self.name = name
        self.block_bytes = block_bytes
        fd = os.open(os.path.join("/dev/shm", name), os.O_RDWR)
        try:
            self.mm = mmap.mmap(fd, nbytes)
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self.mm, dtype=np.uint8)

    def close(self) -> None:
        del self.buf
        with contextlib.suppress(BufferError):
            self.mm.close()


@dataclass
class _Ensure:
    image: int
    params: wire.ECParams
    started: float
    c_incarnation: int
    end: str = ""
    end_at: float = 0.0


@dataclass
class ECTraffic:
    """A stream of images with repeats, encoded at E and ensured at C; call `step()` often.

    Like `kvd.ecdemo.run_ec`, but it never stops at a failure: an output E no longer has
    is encoded again; each ensure has at most one in flight per hash, so that every
    ensure's single terminal event (ECReady or ECUnavailable) can be checked.
    """

    e: Node
    c: Node
    rng: random.Random
    window: int = 4
    images: int = 40
    max_bytes: int = 1 << 20
    prod: KvdClient | None = None
    cons: KvdClient | None = None
    regions: dict[str, _Mapped] = field(default_factory=dict)
    c_region: dict[int, _Mapped] = field(default_factory=dict)
    """C's region per C incarnation: an ECReady names blocks of the region of the
    incarnation the ensure went to."""
    params: dict[int, wire.ECParams] = field(default_factory=dict)
    inflight: dict[str, _Ensure] = field(default_factory=dict)
    ensures: list[_Ensure] = field(default_factory=list)
    sizes: dict[int, int] = field(default_factory=dict)
    verified: int = 0
    bytes: int = 0
    wrong: list[str] = field(default_factory=list)
    stray: list[str] = field(default_factory=list)
    outcomes: Counter[str] = field(default_factory=Counter)
    paused: bool = False
    c_ready: bool = True
    """False from C's kill until its new region is mapped: no ensure is sent meanwhile, so
    that each ensure's incarnation (whose region its ECReady names) is known for sure."""
    encode_errors: list[str] = field(default_factory=list)
    last_start: float = 0.0
    rate: float = 25.0
    """Ensures started per second at most (the machine has other work to do)."""

    def open(self) -> None:
        assert self.e.proc is not None and self.c.proc is not None
        self.prod = KvdClient(
            self.e.proc.socket, role="scheduler", engine_id="encoder", timeout=1.0
        )
        self.prod.connect()
        self.cons = KvdClient(self.c.proc.socket, role="scheduler", engine_id="consumer")
        self.cons.connect()
        self.c_restarted()
        self.sizes = {i: self.rng.randint(16 << 10, self.max_bytes) for i in range(self.images)}

    def c_restarted(self) -> None:
        """Map C's region of its current incarnation."""
        info = self.c.status("ec")
        self.c_region[self.c.incarnation] = _Mapped(
            info["region"], int(info["region_bytes"]), int(info["block_bytes"])
        )
        self.c_ready = True

    def e_restarted(self) -> None:
        self.params.clear()  # a new E has none of them: encode again

    def close(self) -> None:
        for cl in (self.prod, self.cons):
            if cl is not None:
                cl.close()
        for m in [*self.regions.values(), *self.c_region.values()]:
            m.close()

    @property
    def live(self) -> int:
        return len(self.inflight)

    def step(self) -> None:
        if not self.paused:
            while len(self.inflight) < self.window and self._start():
                pass
        self._drain()

    def _start(self) -> bool:
        assert self.cons is not None
        now = time.monotonic()
        if not self.c_ready or now - self.last_start < 1.0 / self.rate:
            return False
        self.last_start = now
        image = self._pick()
        if image is None:
            return False
        p = self.params.get(image)
        if p is None:
            if not self.e.up:
                return False
            p = self._encode(image)
            if p is None:
                return False
        key = p.mm_hash
        ens = _Ensure(image, p, time.monotonic(), self.c.incarnation)
        self.inflight[key] = ens
        self.ensures.append(ens)
        self.cons.ec_ensure(p)
        return True

    def _pick(self) -> int | None:
        for _ in range(8):
            image = self.rng.randrange(self.images)
            if self.params.get(image) is None or self.params[image].mm_hash not in self.inflight:
                return image
        return None

    def _encode(self, image: int) -> wire.ECParams | None:
        assert self.prod is not None
        nbytes = self.sizes[image]
        mm_hash = f"chaos-img-{image:04d}-{self.e.incarnation}"
        try:
            blocks = self.prod.ec_allocate(mm_hash, nbytes)
            region = self.regions.get(blocks.region)
            if region is None:
                for old in self.regions.values():
                    old.close()
                self.regions.clear()
                info = self.e.status("ec")
                region = self.regions[blocks.region] = _Mapped(
                    blocks.region, int(info["region_bytes"]), blocks.block_bytes
                )
            data = output_bytes(image, nbytes)
            bb = blocks.block_bytes
            for i, b in enumerate(blocks.block_ids):
                chunk = data[i * bb : (i + 1) * bb]
                region.buf[b * bb : b * bb + len(chunk)] = chunk
            p = self.prod.ec_commit(mm_hash, nbytes, shape=(nbytes,), compat=EC_COMPAT)
        except (KvdError, OSError) as exc:
            self.outcomes[f"encode failed: {type(exc).__name__}"] += 1
            self.encode_errors.append(str(exc)[:200])
            return None
        self.params[image] = p
        return p

    def _drain(self) -> None:
        assert self.cons is not None
        for ev in self.cons.drain_events():
            if not isinstance(ev, (wire.ECReady, wire.ECUnavailable)):
                continue
            ens = self.inflight.pop(ev.mm_hash, None)
            if ens is None:
                self.stray.append(f"{type(ev).__name__} for {ev.mm_hash}")
                continue
            ens.end, ens.end_at = type(ev).__name__, time.monotonic()
            if isinstance(ev, wire.ECUnavailable):
                self.outcomes[f"unavailable {ErrorCode(ev.code).name}"] += 1
                if ev.code == ErrorCode.NOT_FOUND and self.params.get(ens.image) is ens.params:
                    del self.params[ens.image]  # E lost or evicted it: encode again
                continue
            self.outcomes["ready"] += 1
            data = output_bytes(ens.image, self.sizes[ens.image])
            region = self.c_region.get(ens.c_incarnation)
            if region is None or ev.nbytes != len(data) or not _matches(region, ev, data):
                self.wrong.append(f"{ev.mm_hash} (C incarnation {ens.c_incarnation})")
            else:
                self.verified += 1
                self.bytes += len(data)
            if ens.c_incarnation == self.c.incarnation:
                self.cons.ec_release(ev.mm_hash)  # an older C's pins died with it

    def unfinished(self) -> list[str]:
        return [f"ec {k}" for k in self.inflight]


def _matches(region: _Mapped, ev: wire.ECReady, data: np.ndarray) -> bool:
    bb = region.block_bytes
    for i, b in enumerate(ev.block_ids):
        chunk = data[i * bb : (i + 1) * bb]
        if not np.array_equal(region.buf[b * bb : b * bb + len(chunk)], chunk):
            return False
    return True


# ------------------------------------------------------------------ victim engines


def kv_engine(
    socket: str, name: str, num_blocks: int, *, tp: int = 1, workers: bool = False
) -> Engine:
    """A simulated engine's KV regions, one per rank: 4 layers of 2 KiB chunks (16 KiB
    blocks); P's has a worker session per rank (the layer-wise pushes' notices come from
    them, and a request is done at D only once every rank's bytes landed)."""
    return make_engine(
        socket,
        name,
        num_blocks=num_blocks,
        num_layers=4,
        chunk_bytes=2048,
        tp=tp,
        workers=workers,
    )


def victim_main(argv: list[str]) -> int:
    """A victim engine pair (P engine on P's daemon, D engine on D's) running traffic
    until it is killed."""
    p_sock, d_sock, port, seed, tag = argv[0], argv[1], int(argv[2]), int(argv[3]), argv[4]
    p_host = argv[5] if len(argv) > 5 else HOST
    tier_report = Path(argv[6]) if len(argv) > 6 else None
    rng = random.Random(seed)
    try:
        p = kv_engine(p_sock, f"{tag}-p", 64, workers=True)
        d = kv_engine(d_sock, f"{tag}-d", 64)
    except (KvdError, OSError) as exc:
        print(f"victim {tag} could not start: {exc}", file=sys.stderr)
        return 3
    if tier_report is not None:  # its tier calls, on P's daemon, with keys of its own
        TierWorker(
            p_sock, tag, key_space(tag, VICTIM_TIER_KEYS), rng.getrandbits(32), report=tier_report
        ).start()
    print("ready", flush=True)
    t = Traffic(p, d, port, rng, window=6, modes=KV_MODES, p_host=p_host)
    while True:
        t.step()
        time.sleep(0.003)


@dataclass
class Victim:
    tag: str
    proc: subprocess.Popen[bytes]
    started: float
    frozen: bool = False
    limit: CpuLimit | None = None
    """The CPU limit it is held to now (a "victim-starve" fault), if any."""
    ended: bool = False
    """Its exit was seen (killed by the driver, or exited by itself)."""

    def feed(self) -> None:
        if self.limit is not None:
            self.limit.release()
            self.limit = None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.ended = True
        self.feed()


# ------------------------------------------------------------------ the run


@dataclass
class ChaosReport:
    seed: int
    duration_s: float
    two_hosts: bool = False
    link_bytes: int = 0
    """With two hosts: bytes that crossed the veth between them, both ways (its counters)."""
    faults: Counter[str] = field(default_factory=Counter)
    not_injected: dict[str, str] = field(default_factory=dict)
    """Fault kinds this machine cannot inject, with why."""
    kv_requests: int = 0
    kv_outcomes: dict[str, int] = field(default_factory=dict)
    ec_requests: int = 0
    ec_outcomes: dict[str, int] = field(default_factory=dict)
    bytes_verified: int = 0
    kv_bytes_verified: int = 0
    """Of `bytes_verified`, KV requests' (each moved P -> D once; an encoder output C
    already holds is verified again without a transfer)."""
    requests_verified: int = 0
    layer_streams_verified: int = 0
    """Layer-wise pushes D's engine verified (part of `requests_verified`)."""
    wrong_bytes: int = 0
    tiers: dict[str, Any] = field(default_factory=dict)
    """Per tier worker of the main engines: its calls and what it loaded
    (`kvd.tiertraffic.TierLoad`)."""
    tier_blocks_verified: int = 0
    """Blocks the main engines loaded from the tiers (host, disk, peer) with every byte right."""
    tier_bytes_verified: int = 0
    tier_wrong: list[str] = field(default_factory=list)
    """Blocks loaded with wrong bytes (the victims' too); counted in `wrong_bytes`."""
    longest_tier_call_s: float = 0.0
    tier_daemons: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per KV daemon, its last incarnation's tier counters: where loads were served from."""
    tier_stuck: list[str] = field(default_factory=list)
    """Tier workers whose call had not ended when they were stopped."""
    unfinished: list[str] = field(default_factory=list)
    stray: list[str] = field(default_factory=list)
    over_bound: list[str] = field(default_factory=list)
    longest_to_terminal_s: float = 0.0
    bound_s: dict[str, float] = field(default_factory=dict)
    leaks: list[str] = field(default_factory=list)
    victim_segments_left: int = 0
    rss: dict[str, dict[str, Any]] = field(default_factory=dict)
    rss_flat: bool = True
    daemon_exits: list[str] = field(default_factory=list)
    fuzz: dict[str, Any] = field(default_factory=dict)
    wall_s: float = 0.0
    stalls: dict[str, float] = field(default_factory=dict)
    """Seconds each daemon (and the driver) was not run by the machine, in all."""
    failed_starts: dict[str, int] = field(default_factory=dict)
    """Starts of each daemon that exited before it was ready, tried again (with two hosts:
    restarted while the link was cut, UCX refuses the veth that is down)."""
    peers_forgotten_silent: int = 0
    """Peers the daemons forgot as silent, every incarnation (their logs' lines)."""
    workdir: str = ""
    phases_s: dict[str, float] = field(default_factory=dict)
    """Wall seconds of each phase of the run."""

    @property
    def ok(self) -> bool:
        return (
            self.wrong_bytes == 0
            and not self.unfinished
            and not self.stray
            and not self.over_bound
            and not self.leaks
            and self.rss_flat
            and not self.daemon_exits
            and self.requests_verified > 0
            and self.tier_blocks_verified > 0
            and not self.tier_stuck
            and bool(self.fuzz.get("ok", True))
        )

    def problems(self) -> list[str]:
        out = []
        if self.wrong_bytes:
            out.append(
                f"{self.wrong_bytes} requests reported done with wrong bytes "
                f"({len(self.tier_wrong)} of them blocks loaded from the tiers)"
            )
        out += [f"tier block loaded wrong: {w}" for w in self.tier_wrong[:10]]
        out += [f"tier call stuck: {s}" for s in self.tier_stuck]
        if self.tier_blocks_verified == 0:
            out.append("no tier block was loaded (the tier load never ran)")
        out += [f"unfinished: {u}" for u in self.unfinished[:10]]
        out += [f"stray event: {s}" for s in self.stray[:10]]
        out += [f"over its bound: {o}" for o in self.over_bound[:10]]
        out += [f"leak: {x}" for x in self.leaks[:20]]
        out += [f"daemon exit: {x}" for x in self.daemon_exits]
        if not self.rss_flat:
            out.append(f"daemon memory grew: {self.rss}")
        if self.requests_verified == 0:
            out.append("no request was verified (the load never ran)")
        out += [f"fuzz: {p}" for p in self.fuzz.get("problems", [])]
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "ok": self.ok,
            "seed": self.seed,
            "duration_s": self.duration_s,
            "two_hosts": self.two_hosts,
            "link_bytes": self.link_bytes,
            "wall_s": round(self.wall_s, 1),
            "faults": dict(self.faults),
            "faults_total": sum(self.faults.values()),
            "not_injected": self.not_injected,
            "kv_requests": self.kv_requests,
            "kv_outcomes": self.kv_outcomes,
            "ec_requests": self.ec_requests,
            "ec_outcomes": self.ec_outcomes,
            "requests_verified": self.requests_verified,
            "layer_streams_verified": self.layer_streams_verified,
            "bytes_verified": self.bytes_verified,
            "kv_bytes_verified": self.kv_bytes_verified,
            "wrong_bytes": self.wrong_bytes,
            "tiers": self.tiers,
            "tier_blocks_verified": self.tier_blocks_verified,
            "tier_bytes_verified": self.tier_bytes_verified,
            "tier_wrong": self.tier_wrong[:20],
            "longest_tier_call_s": round(self.longest_tier_call_s, 3),
            "tier_daemons": self.tier_daemons,
            "tier_stuck": self.tier_stuck,
            "unfinished": len(self.unfinished),
            "stray_events": len(self.stray),
            "over_bound": len(self.over_bound),
            "longest_to_terminal_s": round(self.longest_to_terminal_s, 3),
            "bound_s": self.bound_s,
            "leaks": len(self.leaks),
            "victim_segments_left": self.victim_segments_left,
            "rss_flat": self.rss_flat,
            "rss": self.rss,
            "stalls_s": self.stalls,
            "failed_starts": self.failed_starts,
            "peers_forgotten_silent": self.peers_forgotten_silent,
            "phases_s": self.phases_s,
            "workdir": self.workdir,
            "fuzz": self.fuzz,
            "problems": self.problems(),
        }


class Chaos:
    """The run: see the module docstring. `run()` returns the report; it never raises
    for a broken invariant (the report says which), only for a broken set-up."""

    def __init__(self, cfg: ChaosConfig, log: Callable[[str], None] = lambda _: None) -> None:
        self.cfg = cfg
        self.journal: list[str] = []
        """The driver's log lines (faults, restarts, thaws), written to `driver.log` in
        the work directory, which a failed run keeps."""

        def journal(line: str) -> None:
            self.journal.append(line)
            log(line)

        self.log = journal
        self.rng = random.Random(cfg.seed)
        self.report = ChaosReport(cfg.seed, cfg.duration)
        self.own_workdir = cfg.workdir is None
        self.workdir = cfg.workdir or Path(tempfile.mkdtemp(prefix="kvdc-", dir="/tmp"))
        self.hosts = netns.pair("kvdc", LINK_NET) if cfg.two_hosts else None
        """Made at the start of `run`, removed at its end."""
        self.report.two_hosts = cfg.two_hosts
        self.link_faults: dict[str, float] = {}
        """The link faults in force now ("cut", "slow", each at most once at a time), with
        when each began."""
        self.nodes = make_nodes(self.workdir, cfg, self.hosts)
        self.p_eng: Engine | None = None
        self.d_eng: Engine | None = None
        self.kv: Traffic | None = None
        self.ec: ECTraffic | None = None
        self.tiers: list[TierWorker] = []
        """The main engines' tier calls (one on P's daemon, one on D's: each other's peer)."""
        self.victims: list[Victim] = []
        self.victim_tags: list[str] = []
        self.pending: list[tuple[float, str, str]] = []
        """(when, action, target) to carry out: restarts, thaws, victim respawns."""
        self.seen_exits: set[int] = set()
        self.run_id = secrets.token_hex(3)
        self.starting: dict[str, tuple[threading.Thread, list[BaseException | None]]] = {}
        self.last_step = 0.0
        self.phase_began = 0.0
        self.first_faults: list[tuple[str, list[str]]] = [
            ("kill", ["p", "d"]),
            ("kill", ["e", "c"]),
            ("stop", sorted(self.nodes)),
            ("victim", []),
            ("victim-stop", []),
        ]
        if self.hosts is not None:
            self.first_faults += [("link-cut", []), ("link-slow", [])]
        self.starve_unavailable = cpulimit.unavailable()
        if self.starve_unavailable is None:
            self.first_faults += [("starve", sorted(self.nodes)), ("victim-starve", [])]
        else:
            self.report.not_injected["daemon or engine CPU-starved"] = self.starve_unavailable
        self.rng.shuffle(self.first_faults)
        self.last_kv_refused = 0.0
        self.driver_stalls: list[tuple[float, float, str]] = []

    # ---------------------------------------------------------------- set-up

    def _engines(self) -> None:
        p, d = self.nodes["p"], self.nodes["d"]
        assert p.proc is not None and d.proc is not None
        self.p_eng = kv_engine(p.proc.socket, "prefill", 256, tp=KV_TP, workers=True)
        self.d_eng = kv_engine(d.proc.socket, "decode", 256, tp=KV_TP)
        self.kv = Traffic(
            self.p_eng,
            self.d_eng,
            p.proc.side_port,
            self.rng,
            window=12,
            max_blocks=8,
            modes=KV_MODES,
            as_vllm=True,
            p_host=p.addr,
        )
        self.ec = ECTraffic(self.nodes["e"], self.nodes["c"], self.rng)
        self.ec.open()
        keys = key_space(f"main-{self.run_id}", TIER_KEYS)
        half = TIER_KEYS // 2
        for node, own in ((p, keys[:half]), (d, keys[half:])):  # stores its half, loads all
            assert node.proc is not None
            w = TierWorker(
                node.proc.socket,
                f"tiers-{node.key}",
                keys,
                self.rng.getrandbits(32),
                store_keys=own,
            )
            w.start()
            self.tiers.append(w)

    def _spawn_victim(self) -> None:
        p, d = self.nodes["p"], self.nodes["d"]
        if not (p.up and d.up):
            self.pending.append((time.monotonic() + 1.0, "spawn", ""))
            return
        assert p.proc is not None and d.proc is not None
        tag = f"victim{len(self.victim_tags)}-{self.run_id}"
        self.victim_tags.append(tag)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "kvd.chaos",
                "victim",
                p.proc.socket,
                d.proc.socket,
                str(p.proc.side_port),
                str(self.rng.getrandbits(32)),
                tag,
                p.addr,
                str(self.workdir / f"tiers-wrong-{tag}"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        self.victims.append(Victim(tag, proc, time.monotonic()))

    # ---------------------------------------------------------------- faults

    def _fault(self) -> bool:
        """One fault at a seeded moment; False when a first fault found no target."""
        now = time.monotonic()
        if self.first_faults:  # every kind once, in a seeded order, before the rest
            # the next kind that has a target now; none (victims respawning, daemons
            # down): tried again shortly, so that every kind is injected in every run,
            # a short one included (a kind waiting for its target does not hold up the
            # kinds after it)
            for i in range(len(self.first_faults) - 1, -1, -1):
                kind, among = self.first_faults[i]
                if self._inject(now, kind, among):
                    del self.first_faults[i]
                    return True
            return False
        kinds = ["kill", "stop", "kill", "stop", "victim", "victim-stop"]
        if self.starve_unavailable is None:
            kinds += ["starve", "victim-starve"]
        if self.hosts is not None:
            kinds += ["link-cut", "link-slow"]
        kind = self.rng.choice(kinds)
        self._inject(now, kind, sorted(self.nodes))
        return True

    def _inject(self, now: float, kind: str, among: list[str]) -> bool:
        """One fault of `kind`; False when nothing could take it at this moment."""
        if kind in ("link-cut", "link-slow"):
            return self._link_fault(now, kind)
        if kind == "victim-stop":
            live = [v for v in self.victims if v.proc.poll() is None and not v.frozen]
            if live:
                v = self.rng.choice(live)
                v.proc.send_signal(signal.SIGSTOP)
                v.frozen = True
                self.report.faults["engine SIGSTOP/SIGCONT"] += 1
                self.log(f"{now:.1f} SIGSTOP engine {v.tag}")
                # sometimes past the daemons' client_timeout: its sessions end meanwhile
                until = now + self.rng.uniform(0.5, 2 * self.cfg.client_timeout)
                self.pending.append((until, "victim-thaw", v.tag))
            return bool(live)
        if kind == "victim-starve":
            live = [v for v in self.victims if v.proc.poll() is None and v.limit is None]
            if live:
                v = self.rng.choice(live)
                share = self.rng.uniform(*self.cfg.starve_share)
                v.limit = CpuLimit(v.proc.pid, share, tag="kvdc")
                self.report.faults["engine CPU-starved"] += 1
                self.log(f"{now:.1f} CPU-starve engine {v.tag} to {share:.0%} of a core")
                until = now + self.rng.uniform(*self.cfg.starve)
                self.pending.append((until, "victim-feed", v.tag))
            return bool(live)
        if kind == "victim":
            live = [v for v in self.victims if v.proc.poll() is None]
            if live:
                v = self.rng.choice(live)
                v.kill()
                self.report.faults["engine SIGKILL"] += 1
                self.log(f"{now:.1f} SIGKILL engine {v.tag}")
                self.pending.append((now + self.rng.uniform(0.5, 2.0), "spawn", ""))
            return bool(live)
        ready = [k for k in among if self.nodes[k].up and k not in self.starting]
        if kind == "starve":
            ready = [k for k in ready if self.nodes[k].limit is None]
        if not ready:
            return False  # all down or stopped already: this moment passes
        key = self.rng.choice(ready)
        node = self.nodes[key]
        if kind == "starve":
            share = self.rng.uniform(*self.cfg.starve_share)
            node.starve(share)
            self.report.faults[f"{key.upper()} CPU-starved"] += 1
            self.log(f"{now:.1f} CPU-starve {node.name} to {share:.0%} of a core")
            self.pending.append((now + self.rng.uniform(*self.cfg.starve), "feed", key))
        elif kind == "kill":
            node.kill()
            if key == "c":
                assert self.ec is not None
                self.ec.c_ready = False
            self.report.faults[f"{key.upper()} SIGKILL+restart"] += 1
            self.log(f"{now:.1f} SIGKILL {node.name}")
            self.pending.append((now + RESTART_AFTER, "restart", key))
        else:
            node.freeze()
            self.report.faults[f"{key.upper()} SIGSTOP/SIGCONT"] += 1
            self.log(f"{now:.1f} SIGSTOP {node.name}")
            self.pending.append((now + self.rng.uniform(*self.cfg.freeze), "thaw", key))
        return True

    def _link_fault(self, now: float, kind: str) -> bool:
        """Cut the link between the two hosts (one end down: both lose carrier), or slow
        it both ways; it comes back at a seeded moment. A cut and a slowing may overlap."""
        what = "cut" if kind == "link-cut" else "slow"
        if self.hosts is None or what in self.link_faults:
            return False
        self.link_faults[what] = now
        if what == "cut":
            end = self.rng.choice(self.hosts)
            end.link("down")
            self.report.faults["link cut"] += 1
            self.log(f"{now:.1f} link cut ({end.veth} down)")
            self.pending.append((now + self.rng.uniform(*self.cfg.link_cut), "link-up", ""))
        else:
            mbit = self.rng.uniform(*self.cfg.link_mbit)
            for h in self.hosts:
                h.shape(mbit, LINK_QUEUE_MS)
            self.report.faults["link slowed"] += 1
            self.log(f"{now:.1f} link slowed to {mbit:.0f} Mbit/s, {LINK_QUEUE_MS} ms queued")
            self.pending.append((now + self.rng.uniform(*self.cfg.link_slow), "link-fast", ""))
        return True

    def _link_restore(self, what: str) -> None:
        """The link up again ("cut") or at full speed ("slow"), at its seeded moment or at
        the end."""
        if self.hosts is None or what not in self.link_faults:
            return
        for h in self.hosts:
            if what == "cut":
                h.link("up")
            else:
                h.unshape()
        began, now = self.link_faults.pop(what), time.monotonic()
        for node in self.nodes.values():  # every daemon's peers are across the link
            node.outages.append((began, now, f"link {what}"))
        self.log(f"{now:.1f} link back ({what} ended)")

    def _carry_out(self, action: str, key: str) -> None:
        if action in ("link-up", "link-fast"):
            self._link_restore("cut" if action == "link-up" else "slow")
            return
        if action == "spawn":
            if len([v for v in self.victims if v.proc.poll() is None]) < self.cfg.victims:
                self._spawn_victim()
            return
        if action == "victim-feed":
            for v in self.victims:
                if v.tag == key:
                    v.feed()
            return
        if action == "victim-thaw":
            for v in self.victims:
                if v.tag == key and v.frozen:
                    v.frozen = False
                    if v.proc.poll() is None:
                        v.proc.send_signal(signal.SIGCONT)
            return
        node = self.nodes[key]
        if action == "thaw":
            node.thaw()
            self.log(f"{time.monotonic():.1f} SIGCONT {node.name}")
            return
        if action == "feed":
            if node.limit is not None:
                throttled = node.feed()
                self.log(
                    f"{time.monotonic():.1f} CPU back to {node.name} ({throttled} periods held)"
                )
            return
        assert action == "restart"
        # Started in a thread: the load goes on (and events are drained) meanwhile.
        box: list[BaseException | None] = []

        def start() -> None:
            try:
                node.start()
                box.append(None)
            except BaseException as exc:
                box.append(exc)

        th = threading.Thread(target=start, name=f"start-{key}", daemon=True)
        th.start()
        self.starting[key] = (th, box)

    def _started(self) -> None:
        """Finish the restarts whose daemon is up (their engines' views follow)."""
        assert self.ec is not None
        for key, (th, box) in list(self.starting.items()):
            if th.is_alive():
                continue
            del self.starting[key]
            if box and box[0] is not None:
                raise box[0]
            self.log(f"{time.monotonic():.1f} restarted {self.nodes[key].name}")
            if key == "c":
                self.ec.c_restarted()
            elif key == "e":
                self.ec.e_restarted()

    def _due(self, now: float) -> None:
        due = sorted(x for x in self.pending if x[0] <= now)
        self.pending = [x for x in self.pending if x[0] > now]
        for _, action, key in due:
            self._carry_out(action, key)

    def _unexpected_exits(self) -> None:
        for v in self.victims:
            if not v.ended and (rc := v.proc.poll()) is not None:
                # it could not start (a daemon was down or restarting as it connected):
                # another takes its place, or no engine would be left to fault
                v.ended = True
                v.feed()
                self.log(f"{time.monotonic():.1f} engine {v.tag} exited {rc} by itself")
                self.pending.append((time.monotonic() + 1.0, "spawn", ""))
        for node in self.nodes.values():
            dp = node.proc
            if (
                dp is None
                or node.out_since
                or node.key in self.starting
                or dp.proc.pid in self.seen_exits
            ):
                continue
            rc = dp.proc.poll()
            if rc is not None:
                self.seen_exits.add(dp.proc.pid)
                self.report.daemon_exits.append(
                    f"{node.name} exited {rc} unasked:\n{_crash_report(dp)}"
                )
                node.out_since = time.monotonic()
                if node.key == "c" and self.ec is not None:
                    self.ec.c_ready = False
                self.pending.append((node.out_since + RESTART_AFTER, "restart", node.key))

    # ---------------------------------------------------------------- the loop

    def _step(self) -> None:
        assert self.kv is not None and self.ec is not None
        now = time.monotonic()
        if self.last_step and now - self.last_step > DRIVER_STALL:
            # the driver itself was not run: events it drains now waited meanwhile
            self.driver_stalls.append((self.last_step, now, "stall"))
        self.last_step = now
        self._started()
        if now - self.last_kv_refused > 0.2:
            # while P's client has no session it refuses each request at once: a trickle
            # of them is the fault; a flood would only fill the figures
            refused = self.kv.not_offered
            self.kv.step()
            if self.kv.not_offered != refused:
                self.last_kv_refused = now
        self.ec.step()

    def run(self) -> ChaosReport:
        t0 = time.monotonic()
        made = False
        try:
            if self.hosts is not None:
                netns.create(*self.hosts)
                made = True
            start_all(list(self.nodes.values()))
            self._engines()
            for _ in range(self.cfg.victims):
                self._spawn_victim()
            self._phase("set-up", t0)
            self._load_and_faults()
            self._phase("faults under load")
            self._settle()
            self._phase("settle")
            self._check_leaks()
            self._phase("leak checks")
            if self.cfg.fuzz_frames:
                from kvd.fuzz import run_fuzz

                self.report.fuzz = run_fuzz(
                    self.cfg.fuzz_frames, self.cfg.seed, self.workdir, log=self.log
                )
                self._phase("fuzzing")
        finally:
            self._teardown()
            if made and self.hosts is not None:
                with contextlib.suppress(OSError, subprocess.SubprocessError, ValueError):
                    self.report.link_bytes = sum(self.hosts[0].veth_bytes())
                left = netns.remove(*self.hosts)
                self.report.leaks += [f"network namespace {ns} left" for ns in left]
            self._phase("stop")
            self._figures()
            self.report.wall_s = time.monotonic() - t0
            with contextlib.suppress(OSError):
                (self.workdir / "driver.log").write_text("\n".join(self.journal) + "\n")
            if self.own_workdir and self.report.ok:
                shutil.rmtree(self.workdir, ignore_errors=True)
            else:
                self.report.workdir = str(self.workdir)  # kept: the daemons' logs
        return self.report

    def _phase(self, name: str, since: float = 0.0) -> None:
        now = time.monotonic()
        self.report.phases_s[name] = round(now - (since or self.phase_began), 1)
        self.phase_began = now

    def _load_and_faults(self) -> None:
        start = time.monotonic()
        end = start + self.cfg.duration
        next_fault = start + 2.0 if self.cfg.faults else float("inf")
        next_sample = start
        while True:
            now = time.monotonic()
            if now >= end:
                break
            if now >= next_fault:
                if self._fault():
                    # the first kinds close together: every kind fits a short run
                    gap = self.cfg.fault_gap
                    next_fault = now + (gap[0] if self.first_faults else self.rng.uniform(*gap))
                else:
                    next_fault = now + 0.25
            self._due(now)
            self._unexpected_exits()
            if now >= next_sample:
                for node in self.nodes.values():
                    node.sample_rss()
                next_sample = now + 0.5
            self._step()
            time.sleep(0.002)

    def _settle(self) -> None:
        """Every fault ends (restarts and thaws are due at once), the load runs on a while
        with no faults, then stops; wait until every request ended."""
        assert self.kv is not None and self.ec is not None
        for when, action, key in sorted(self.pending):
            if action != "spawn":
                delay = when - time.monotonic()
                if delay > 0:
                    self._run_for(delay)
                self._carry_out(action, key)
        self.pending = []
        while self.starting:
            self._run_for(0.1)
        for v in self.victims:  # the engines' last fault: gone for good, as SIGKILL leaves them
            if v.proc.poll() is None:
                self.report.faults["engine SIGKILL"] += 1
            v.kill()
        self._run_for(3.0)
        self.kv.paused = self.ec.paused = True
        for w in self.tiers:
            w.paused.set()
        deadline = time.monotonic() + 60.0
        while (
            self.kv.live or self.ec.live or not all(w.idle.is_set() for w in self.tiers)
        ) and time.monotonic() < deadline:
            self._step()
            time.sleep(0.005)
        self._stop_tiers()  # their sessions end: what they were lent goes back
        # paused from here on: the leak checks look at what the load left

    def _stop_tiers(self) -> None:
        for w in self.tiers:
            w.stop()
            if w.thread_alive:
                self.report.tier_stuck.append(f"{w.name}: its call did not end")

    def _run_for(self, seconds: float) -> None:
        end = time.monotonic() + seconds
        next_sample = 0.0
        while time.monotonic() < end:
            if time.monotonic() >= next_sample:
                for node in self.nodes.values():
                    node.sample_rss()
                next_sample = time.monotonic() + 0.5
            self._unexpected_exits()
            self._step()
            time.sleep(0.002)

    # ---------------------------------------------------------------- checks

    def _check_leaks(self) -> None:
        """What is left in the surviving daemons once every party that is gone is gone:
        poll (sessions of killed engines end after client_timeout, then what they held is
        freed) until nothing is left or the deadline passes."""
        deadline = time.monotonic() + self.cfg.client_timeout + self.cfg.lease + 20.0
        leaks: list[str] = []
        while time.monotonic() < deadline:
            leaks = self._leaks_now()
            if not leaks:
                break
            self._run_for(0.5)
        self.report.leaks = leaks

    def _leaks_now(self) -> list[str]:
        out: list[str] = []
        main = {"prefill", "decode", "encoder", "consumer", "kvd-ec"}
        for key, node in self.nodes.items():
            st = node.status()
            for r in st["regions"]:
                if r["engine_id"] not in main:
                    out.append(f"{node.name}: region of {r['engine_id']} ({r['name']})")
            for s in st["sessions"]:
                if s["engine_id"] and s["engine_id"] not in main:
                    out.append(f"{node.name}: session {s['session']} of {s['engine_id']}")
            sender, receiver = st["sender"], st["receiver"]
            for what in ("leases", "pending_registrations", "early_pulls", "sending"):
                if sender.get(what):
                    out.append(f"{node.name}: sender {what} = {sender[what]}")
            for what in ("tracked", "receiving", "sending", "heartbeat_peers"):
                if receiver.get(what):
                    out.append(f"{node.name}: receiver {what} = {receiver[what]}")
            staging = receiver.get("staging") or {}
            for what in ("used", "quarantined"):
                if staging.get(what):
                    out.append(f"{node.name}: staging bytes {what} = {staging[what]}")
            if node.proc is not None and (leases := node.status("leases")):
                out += [f"{node.name}: lease {x['request_id']}" for x in leases["leases"]]
                out += [f"{node.name}: tracked {x['request_id']}" for x in leases["tracked"]]
            if node.proc is not None:  # memory kept for a segment that is gone
                gone = deleted_shm_mappings(node.proc.proc.pid)
                out += [
                    f"{node.name}: maps removed segment {n}" for n in gone if n.startswith("kvd")
                ]
            if key in KV_NAMES:
                out += self._tier_leaks(node)
            if key in EC_NAMES:
                ec = st["ecrouter"]
                for pool in ("producer", "consumer"):
                    if ec.get(pool) and ec[pool]["pinned"]:
                        out.append(f"{node.name}: {ec[pool]['pinned']} pinned {pool} EC blocks")
                if ec.get("fetching"):
                    out.append(f"{node.name}: EC fetches {ec['fetching']}")
                if ec.get("quarantined"):
                    out.append(f"{node.name}: EC fetches quarantined {ec['quarantined']}")
        return out

    def _tier_leaks(self, node: Node) -> list[str]:
        """What the KV tiers still hold for a party that is gone (every tier client of the
        run has closed its session or was killed): pins, lent or quarantined slots, pins
        taken for a peer, reads or demotions under way."""
        st = node.status("tiers")
        host, peer = st.get("host", {}), st.get("peer", {})
        self.report.tier_daemons[node.key] = {  # where the loads were served from
            "host hits": host.get("hits", 0),
            "disk hits": st.get("disk", {}).get("hits", 0),
            "peer blocks loaded": peer.get("blocks_loaded", 0),
            "of them inline": st.get("counters", {}).get("peer_inline_blocks", 0),
            "host evictions": host.get("evictions", 0),
            "disk reads by clients": st.get("counters", {}).get("disk_client_reads", 0),
        }
        held = tier_holdings(st)
        return [f"{node.name}: tiers {what} = {n}" for what, n in held.items() if n]

    def _teardown(self) -> None:
        for what in ("cut", "slow"):  # the daemons' shutdown must not wait on a cut link
            with contextlib.suppress(OSError, subprocess.SubprocessError):
                self._link_restore(what)
        for w in self.tiers:  # stopped already, unless the run broke off
            w.stop(timeout=5.0)
        if self.ec is not None:
            self.ec.close()
        for eng in (self.p_eng, self.d_eng):
            if eng is not None:
                eng.client.timeout = 2.0
                eng.close()
        for v in self.victims:
            v.kill()
        for node in self.nodes.values():
            if node.proc is None:
                continue
            if node.frozen:
                node.thaw()
            node.feed()
            if node.proc.proc.poll() is None:
                t0 = time.monotonic()
                rc = node.proc.stop(timeout=STOP_TIMEOUT)
                if rc != 0:
                    self.report.daemon_exits.append(
                        f"{node.name} stopped with {rc} after {time.monotonic() - t0:.1f}s "
                        f"(SIGTERM, then SIGKILL at {STOP_TIMEOUT:g}s):\n" + node.proc.report(2000)
                    )
                if os.path.exists(node.proc.socket):
                    self.report.leaks.append(f"{node.name} left its socket")
        for node in self.nodes.values():
            node.harvest_stalls()
        self._check_segments()

    def _check_segments(self) -> None:
        """No segment of ours in /dev/shm once everything stopped: the daemons' EC regions
        (every incarnation's), the engines' KV regions, and the victims' (removed by the
        daemons when reaping is on; with it off they stay, as documented, and are counted
        and removed here)."""
        pids = {pid for n in self.nodes.values() for pid in n.pids}
        left_victims = []
        for name in sorted(os.listdir("/dev/shm")):
            if name.startswith("kvd-ec-"):
                if ec_segment_creator(name) in pids:
                    self.report.leaks.append(f"/dev/shm/{name} (EC region of a daemon of ours)")
            elif pool_creator(name) in pids:
                self.report.leaks.append(f"/dev/shm/{name} (KV tier pool of a daemon of ours)")
            elif any(
                f"-{tag}-" in name and name.startswith("kvd-demo-") for tag in self.victim_tags
            ):
                left_victims.append(name)
            elif (
                name.startswith(("kvd-demo-prefill-", "kvd-demo-decode-"))
                and f"-p{os.getpid()}-" in name
            ):
                self.report.leaks.append(f"/dev/shm/{name} (a main engine's region)")
        if self.cfg.reap:
            self.report.leaks += [
                f"/dev/shm/{n} (a killed engine's, not reaped)" for n in left_victims
            ]
        else:
            self.report.victim_segments_left = len(left_victims)
            for n in left_victims:
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join("/dev/shm", n))

    def _took(self, started: float, at: float, nodes: tuple[Node, ...]) -> float:
        """Seconds from a request's start to its terminal event at `at` that count for
        its bound: from its start, or from the last restart of its daemons that was
        complete before `at` if later (a request started while its daemon was down), less
        the time its daemons or the driver were stopped or stalled meanwhile."""
        ref = max(
            [started]
            + [end for n in nodes for _, end, kind in n.outages if kind == "kill" and end <= at]
        )
        return at - ref - self._held(ref, at, nodes)

    def _held(self, t0: float, t1: float, nodes: tuple[Node, ...]) -> float:
        """Seconds of [t0, t1] during which one of `nodes` or the driver was stopped or
        stalled (the union of those spans)."""
        spans = sorted(
            (max(a, t0), min(b, t1))
            for a, b, kind in [*self.driver_stalls, *(o for n in nodes for o in n.outages)]
            if kind != "kill" and b > t0 and a < t1
        )
        total, reach = 0.0, t0
        for a, b in spans:
            if b > reach:
                total += b - max(a, reach)
                reach = b
        return total

    def _figures(self) -> None:
        rep, kv, ec = self.report, self.kv, self.ec
        if kv is None or ec is None:
            return
        p, d, e, c = (self.nodes[k] for k in ("p", "d", "e", "c"))
        kv_bound = max(self.cfg.lease, LEASE_WAIT_TIMEOUT) + 1.0
        ec_bound = self.cfg.ec_xfer_timeout + 1.0
        rep.bound_s = {
            "kv": kv_bound,
            "kv_dead_p": DEAD_P_BOUND,
            "ec": ec_bound,
            "tier_call": call_bound(),
        }
        rep.kv_requests = len(kv.reqs)
        outcomes: Counter[str] = Counter()
        longest = 0.0
        for r in kv.reqs.values():
            outcomes[f"P {r.p_end or 'none'}"] += 1
            outcomes[f"D {r.d_end or 'none'}"] += 1
            for side, at in (("P", r.p_end_at), ("D", r.d_end_at)):
                if not at:
                    continue
                took = self._took(r.started, at, (p, d))
                longest = max(longest, took)
                if took > kv_bound:
                    rep.over_bound.append(
                        f"{r.mode} {side} {r.d_id}: {took:.2f}s > {kv_bound:g}s (started "
                        f"{r.started:.1f}, ended {at:.1f} {r.d_end if side == 'D' else r.p_end}"
                        f" {r.d_reason[:80] if side == 'D' else ''}; driver.log has the faults)"
                    )
                killed = [b for b, _, kind in p.outages if kind == "kill" and r.started <= b <= at]
                if side == "D" and killed:
                    since = at - killed[0] - self._held(killed[0], at, (p, d))
                    if since > DEAD_P_BOUND:
                        rep.over_bound.append(
                            f"{r.mode} D {r.d_id}: {since:.2f}s after P died > {DEAD_P_BOUND:g}s"
                        )
        for ens in ec.ensures:
            outcomes[f"EC {ens.end or 'none'}"] += 0
            if not ens.end_at:
                continue
            took = self._took(ens.started, ens.end_at, (e, c))
            longest = max(longest, took)
            if took > ec_bound:
                rep.over_bound.append(f"ec {ens.params.mm_hash}: {took:.2f}s > {ec_bound:g}s")
        rep.kv_outcomes = {k: v for k, v in sorted(outcomes.items()) if v}
        rep.ec_requests = len(ec.ensures)
        rep.ec_outcomes = dict(sorted(ec.outcomes.items()))
        rep.longest_to_terminal_s = longest
        rep.requests_verified = kv.ok() + ec.verified
        rep.layer_streams_verified = sum(
            1 for r in kv.reqs.values() if r.mode == "layers" and r.nbytes > 0
        )
        rep.kv_bytes_verified = sum(r.nbytes for r in kv.reqs.values())
        rep.bytes_verified = rep.kv_bytes_verified + ec.bytes
        loads = [w.load for w in self.tiers]
        rep.tiers = {w.name: w.load.as_dict() for w in self.tiers}
        rep.tier_blocks_verified = sum(x.loaded for x in loads)
        rep.tier_bytes_verified = sum(x.bytes for x in loads)
        rep.tier_wrong = [w for x in loads for w in x.wrong]
        for f in sorted(self.workdir.glob("tiers-wrong-*")):  # the victims'
            with contextlib.suppress(OSError):
                rep.tier_wrong += f.read_text().splitlines()
        rep.longest_tier_call_s = max((x.longest_s for x in loads), default=0.0)
        rep.wrong_bytes = len(kv.wrong) + len(ec.wrong) + len(rep.tier_wrong)
        rep.unfinished = kv.unfinished() + ec.unfinished()
        rep.stray = kv.stray + ec.stray
        rep.over_bound += [o for x in loads for o in x.over_bound]
        rep.rss, rep.rss_flat = rss_flat(self.nodes)
        rep.stalls = {
            k: round(sum(b - a for a, b, kind in n.outages if kind == "stall"), 2)
            for k, n in self.nodes.items()
        }
        rep.stalls["driver"] = round(sum(b - a for a, b, _ in self.driver_stalls), 2)
        rep.failed_starts = {k: n.failed_starts for k, n in self.nodes.items() if n.failed_starts}
        rep.peers_forgotten_silent = sum(
            path.read_bytes().count(b'"peer_silent_forgotten"')
            for path in self.workdir.glob("*.log")
        )


def _crash_report(dp: DaemonProc) -> str:
    """What a daemon that died printed about it: the lines before a native backtrace (UCX
    prints its reason there) or before Python's fatal-error dump, then the dump's first
    thread; else the log's tail. The whole log is kept as `<name>.<incarnation>.log`."""
    try:
        text = dp.log.read_text(errors="replace")
    except OSError:
        return dp.report(1500)
    at = text.find("Fatal Python error")
    if at < 0:
        return dp.report(1500)
    native = text.rfind("==== backtrace", 0, at)  # UCX's: its reason is the line above
    if native >= 0:
        return text[max(0, native - 1500) : native] + text[at : at + 600]
    return text[max(0, at - 2000) : at + 600]


def rss_flat(nodes: dict[str, Node]) -> tuple[dict[str, dict[str, Any]], bool]:
    """Per daemon: its longest-lived incarnation's memory, and whether it stayed flat.

    Samples taken in the first `RSS_WARMUP_S` seconds of an incarnation are left out; of
    the rest, flat means the last quarter's peak of anonymous memory (RssAnon: the heap,
    where a leak of objects or buffers shows) exceeds the first quarter's by no more than
    max(RSS_TOLERANCE_KIB, 10%). Shared memory (RssShmem) is reported beside it and not
    judged here: a new incarnation's mappings of engines' regions and its own pools become
    resident as traffic first touches their pages, up to what it maps (a mapping kept of a
    segment that is gone is a leak: `deleted_shm_mappings`). An incarnation with fewer
    than 8 such samples is too short to judge."""
    out: dict[str, dict[str, Any]] = {}
    ok = True
    for key, node in nodes.items():
        by_inc: dict[int, list[RssSample]] = {}
        starts: dict[int, float] = {}
        for x in node.rss:
            starts.setdefault(x.incarnation, x.at)
            if x.at - starts[x.incarnation] >= RSS_WARMUP_S:
                by_inc.setdefault(x.incarnation, []).append(x)
        judged = [s for s in by_inc.values() if len(s) >= 8]
        if not judged:
            out[key] = {"judged": False, "incarnations": node.incarnation}
            continue
        samples = max(judged, key=len)
        q = max(1, len(samples) // 4)
        head, tail = samples[:q], samples[-q:]
        first = max(x.anon_kib for x in head)
        last = max(x.anon_kib for x in tail)
        allowed = max(RSS_TOLERANCE_KIB, first // 10)
        flat = last - first <= allowed
        ok = ok and flat
        out[key] = {
            "judged": True,
            "incarnations": node.incarnation,
            "seconds": round(samples[-1].at - samples[0].at, 1),
            "first_mib": round(max(x.total_kib for x in head) / 1024, 1),
            "last_mib": round(max(x.total_kib for x in tail) / 1024, 1),
            "anon_first_mib": round(first / 1024, 1),
            "anon_last_mib": round(last / 1024, 1),
            "shmem_first_mib": round(max(x.shmem_kib for x in head) / 1024, 1),
            "shmem_last_mib": round(max(x.shmem_kib for x in tail) / 1024, 1),
            "flat": flat,
        }
    return out, ok


# ------------------------------------------------------------------ output


def print_report(rep: ChaosReport, console: Any) -> None:
    from rich.table import Table

    d = rep.as_dict()
    where = ", two hosts (UCX over TCP on a veth)" if rep.two_hosts else ""
    t = Table(title=f"kvd chaos: seed {rep.seed}, {rep.duration_s:g} s of faults under load{where}")
    t.add_column("what")
    t.add_column("figure", justify="right")
    faults = ", ".join(f"{k} {v}" for k, v in sorted(rep.faults.items()))
    rows = [
        ("faults injected", f"{d['faults_total']} ({faults})"),
        *((f"  not injected: {k}", why) for k, why in rep.not_injected.items()),
        (
            "KV requests (push, layer-wise push, pull) offered to D",
            str(rep.kv_requests - rep.kv_outcomes.get(f"D {NOT_OFFERED}", 0)),
        ),
        (
            "KV requests P's client refused at once (no session: its daemon down)",
            str(rep.kv_outcomes.get(f"D {NOT_OFFERED}", 0)),
        ),
        ("encoder outputs ensured", str(rep.ec_requests)),
        ("requests done with bytes verified", str(rep.requests_verified)),
        ("  of them layer-wise pushes", str(rep.layer_streams_verified)),
        ("bytes verified", f"{rep.bytes_verified:,}"),
        *(
            (
                (
                    "bytes across the link (both ways; KV bytes verified)",
                    f"{rep.link_bytes:,} ({rep.kv_bytes_verified:,})",
                ),
            )
            if rep.two_hosts
            else ()
        ),
        (
            "KV tier blocks loaded with bytes verified (host, disk, peer)",
            f"{rep.tier_blocks_verified:,} ({rep.tier_bytes_verified:,} bytes)",
        ),
        (
            "  of them without a pin (directory, files); copies found stale",
            "{:,}; {:,}".format(
                *(
                    sum(w.get("client", {}).get(k, 0) for w in rep.tiers.values())
                    for k in ("direct_hits", "direct_stale")
                )
            ),
        ),
        (
            "KV tier calls (store, lookup and load)",
            ", ".join(
                f"{k} {v}"
                for k, v in sorted(
                    sum((Counter(w["calls"]) for w in rep.tiers.values()), Counter()).items()
                )
            ),
        ),
        *(
            (
                f"  {k.upper()}'s tiers, last incarnation",
                ", ".join(f"{n} {v}" for n, v in c.items()),
            )
            for k, c in rep.tier_daemons.items()
        ),
        ("wrong bytes reported done", str(rep.wrong_bytes)),
        ("requests not ended / ended twice", f"{len(rep.unfinished)} / {len(rep.stray)}"),
        (
            "longest time to a terminal event (KV tier call)",
            f"{rep.longest_to_terminal_s:.2f} s ({rep.longest_tier_call_s:.2f} s)",
        ),
        (
            "bound (KV / dead P / EC / tier call)",
            f"{rep.bound_s.get('kv', 0):g} / {rep.bound_s.get('kv_dead_p', 0):g} / "
            f"{rep.bound_s.get('ec', 0):g} / {rep.bound_s.get('tier_call', 0):g} s; "
            f"over it: {len(rep.over_bound)}",
        ),
        ("leaks (leases, registrations, pins, sessions, shm)", str(len(rep.leaks))),
        ("daemon memory flat", "yes" if rep.rss_flat else "NO"),
        (
            "seconds the machine did not run them",
            ", ".join(f"{k.upper() if k != 'driver' else k} {v:g}" for k, v in rep.stalls.items()),
        ),
    ]
    if rep.failed_starts:
        starts = ", ".join(f"{k.upper()} {v}" for k, v in rep.failed_starts.items())
        rows.append(("daemon starts that failed, tried again (as systemd does)", starts))
    if rep.peers_forgotten_silent:
        forgot = str(rep.peers_forgotten_silent)
        rows.append(("peers forgotten as silent (every incarnation)", forgot))
    if rep.fuzz:
        rows.append(("frames fuzzed", f"{rep.fuzz.get('frames', 0):,}"))
        rows.append(("daemon crashes under fuzzing", str(rep.fuzz.get("crashes", 0))))
    for k, v in rows:
        t.add_row(k, v)
    console.print(t)
    mem = Table(
        title="daemon memory (longest incarnation, after warm-up; first / last quarter's peak)"
    )
    cols = ("daemon", "incarnations", "seconds", "RSS MiB", "anonymous MiB", "shared MiB")
    for col in (*cols, "flat (anonymous)"):
        mem.add_column(col)

    def span(m: dict[str, Any], what: str) -> str:
        a, b = m.get(f"{what}first_mib"), m.get(f"{what}last_mib")
        return "-" if a is None else f"{a} / {b}"

    for k, m in rep.rss.items():
        mem.add_row(
            k.upper(),
            str(m["incarnations"]),
            str(m.get("seconds", "-")),
            span(m, ""),
            span(m, "anon_"),
            span(m, "shmem_"),
            str(m.get("flat", "not judged")),
        )
    console.print(mem)
    for p in rep.problems():
        console.print(f"[red]{p}[/red]")
    console.print("wall seconds: " + ", ".join(f"{k} {v:g}" for k, v in rep.phases_s.items()))
    if rep.workdir:
        console.print(f"daemon logs kept in {rep.workdir}")
    console.print("[green]every invariant held[/green]" if rep.ok else "[red]FAILED[/red]")


def run_chaos(cfg: ChaosConfig, as_json: bool, console: Any) -> int:
    rep = Chaos(cfg, log=lambda s: None).run()
    if as_json:
        print(json.dumps(rep.as_dict(), indent=2, default=str))
    else:
        print_report(rep, console)
    return 0 if rep.ok else 1


if __name__ == "__main__":
    if len(sys.argv) >= 2 and sys.argv[1] == "victim":
        sys.exit(victim_main(sys.argv[2:]))
    sys.exit(2)
