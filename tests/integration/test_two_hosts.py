"""Two hosts on one machine: P and D daemons in two network namespaces joined by a veth
pair, NIXL over UCX's TCP transport (`nixl.ucx_tls = "tcp"`, UCX_NET_DEVICES = the
veth), side channels and the EC router bound to the namespaces' addresses.

Every daemon-to-daemon byte (handshakes, notifications, WRITEs and READs, EC requests)
crosses the veth: with the default UCX_TLS, UCX would still use `cma` between the
namespaces (same kernel), so the TCP setting is what makes them two hosts; the veth's
byte counters prove the data went over it. The engines are real thin clients in this
process: they reach their daemon over its IPC socket (a path) and shared memory, which
network namespaces do not separate, exactly as an engine on the daemon's host would.

Push, pull and EC move verified bytes between the hosts; then the link is cut
(`ip link set ... down`) while large transfers of all three kinds are in flight, for
longer than a transfer may take, and restored: every request ends on both sides (done
with the right bytes, or failed within its bound), and transfers after the restore
succeed, within a bound after the restore (lease + transfer timeout + 5 s). None is
reported done with wrong bytes.

Needs root and `ip netns` (CI containers usually have both); skips with the reason
elsewhere. Namespaces and veths are named uniquely per run and always removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import signal
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from kvd_client import wire
from kvd_client.client import KvdClient
from kvd_client.errors import ErrorCode

from kvd import netns
from kvd.demo import (
    DaemonProc,
    Engine,
    ModeResult,
    make_engine,
    pattern,
    run_mode,
    start_daemon,
)
from kvd.ecdemo import ECResult, ECSide, run_ec

from .traffic import judged_gone

pytestmark = pytest.mark.serial  # network namespaces, and links cut under timed bounds

NET = "10.77.0"
P_ADDR = f"{NET}.1"
D_ADDR = f"{NET}.2"
LEASE = 6.0
XFER_TIMEOUT = 2.5
BLOCKS = 160
LAYERS = 2
CHUNK = 128 << 10
"""Bytes per block per layer: a block is 256 KiB, a request up to 2 MiB."""
CUT_S = 4.0
"""How long the link stays down: longer than a transfer may take (XFER_TIMEOUT)."""
END_BOUND = LEASE + XFER_TIMEOUT + 5.0
"""Longest a request in flight at the cut may take to end after the link is back."""


@dataclass
class Host(netns.Host):
    daemon: DaemonProc | None = None


@dataclass
class Hosts:
    p: Host
    d: Host
    workdir: Path
    engines: list[Any] = field(default_factory=list)
    """The current test's engines and EC sides (closed when it ends: an EC producer
    session keeps its outputs pinned while it lives)."""


def _daemon(
    workdir: Path, host: Host, name: str, ec_role: str, transfer: dict[str, Any] | None = None
) -> DaemonProc:
    return start_daemon(
        workdir,
        name,
        env=host.ucx_env,
        overrides={
            "daemon": {"reap_leftover_segments": False},
            "side_channel": {"host": host.addr, "port": 0, "handshake_timeout": 3.0},
            "nixl": {"ucx_tls": "tcp"},
            "transfer": {
                "kv_lease_duration": LEASE,
                "transfer_timeout": XFER_TIMEOUT,
                "peer_probe_interval": 0.5,
            }
            | (transfer or {}),
            "ec": {
                "role": ec_role,
                "region_bytes": 128 << 20,
                "block_bytes": 1 << 20,
                "xfer_timeout": XFER_TIMEOUT,
            },
        },
        prefix=host.prefix,
    )


@pytest.fixture(scope="module")
def hosts() -> Iterator[Hosts]:
    why = netns.unavailable()
    if why is not None:
        pytest.skip(f"two hosts on one machine: {why}")
    p, d = (Host(h.ns, h.veth, h.addr) for h in netns.pair("kvdt", NET))
    assert (p.addr, d.addr) == (P_ADDR, D_ADDR)
    netns.create(p, d)
    workdir = Path(tempfile.mkdtemp(prefix="kvdt-2h-", dir="/tmp"))
    env = Hosts(p, d, workdir)
    tag = p.ns.split("-")[1]
    try:
        p.daemon = _daemon(workdir, p, f"kvdt-2h-p-{tag}", "producer")
        d.daemon = _daemon(workdir, d, f"kvdt-2h-d-{tag}", "consumer")
        yield env
    finally:
        _close_engines(env)
        problems = []
        for h in (d, p):
            if h.daemon is not None:
                rc = h.daemon.stop()
                if rc != 0:
                    log = h.daemon.report(3000)
                    problems.append(f"{h.daemon.name} exited {rc}:\n{log}")
        left = netns.remove(p, d)
        if os.environ.get("KVD_TEST_KEEP_LOGS"):
            print(f"daemon logs kept in {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)
        assert not left, f"namespaces left behind: {left}"
        assert not problems, "\n".join(problems)


def _close_engines(env: Hosts) -> None:
    while env.engines:
        env.engines.pop().close()


@pytest.fixture
def two(hosts: Hosts) -> Iterator[Hosts]:
    """The hosts, with the engines a test opens closed when it ends."""
    try:
        yield hosts
    finally:
        _close_engines(hosts)
    for h in (hosts.p, hosts.d):  # a daemon that died fails the test that killed it
        if h.daemon is not None and (rc := h.daemon.proc.poll()) is not None:
            pytest.fail(f"{h.daemon.name} died ({rc}):\n{h.daemon.report(6000)}")


def _engines(env: Hosts, tag: str) -> tuple[Engine, Engine]:
    assert env.p.daemon is not None and env.d.daemon is not None
    kw: dict[str, Any] = {"num_blocks": BLOCKS, "num_layers": LAYERS, "chunk_bytes": CHUNK}
    pe = make_engine(env.p.daemon.socket, f"prefill-{tag}", **kw)
    env.engines.append(pe)
    de = make_engine(env.d.daemon.socket, f"decode-{tag}", **kw)
    env.engines.append(de)
    return pe, de


def _ec(env: Hosts, tag: str) -> tuple[ECSide, ECSide]:
    assert env.p.daemon is not None and env.d.daemon is not None
    prod = ECSide(env.p.daemon.socket, f"encoder-{tag}")
    env.engines.append(prod)
    cons = ECSide(env.d.daemon.socket, f"consumer-{tag}")
    env.engines.append(cons)
    return prod, cons


def _kv(env: Hosts, mode: str, pe: Engine, de: Engine, n: int, seed: int, **kw: Any) -> ModeResult:
    assert env.p.daemon is not None
    return run_mode(
        mode,
        pe,
        de,
        env.p.daemon.side_port,
        n,
        random.Random(seed),
        p_host=P_ADDR,
        **kw,
    )


def _all_verified(res: ModeResult | ECResult) -> None:
    assert res.verified == res.requests and not res.mismatched, res.summary()
    assert not res.failures, res.summary()


def test_push_pull_and_ec_cross_the_veth_over_tcp(two: Hosts) -> None:
    hosts = two
    pe, de = _engines(hosts, "a")
    prod, cons = _ec(hosts, "a")
    rx0, _ = hosts.d.veth_bytes()
    before = _counters(hosts.d).get("pulls_by_write", 0)
    push = _kv(hosts, "push", pe, de, 16, 1, max_blocks=8)
    pull = _kv(hosts, "pull", pe, de, 16, 2, max_blocks=8)
    # over TCP UCX would emulate a READ (`kvd.core.readpath`): every pull that moved
    # blocks went by P's WRITE
    assert _counters(hosts.d).get("pulls_by_write", 0) - before >= 16
    ec = run_ec(prod, cons, 12, random.Random(3), max_bytes=4 << 20, timeout=60, name="a")
    for res in (push, pull, ec):
        _all_verified(res)
    assert ec.local_hits < ec.requests  # some outputs crossed (the rest were D's own hits)
    moved = push.bytes + pull.bytes
    rx1, _ = hosts.d.veth_bytes()
    # every KV byte D received came in over the veth (cma would leave its counters idle)
    assert rx1 - rx0 >= moved, (rx1 - rx0, moved)
    peers = pe.client.status("peers")["peers"]
    assert {p["addr"].rsplit(":", 1)[0] for p in peers} == {D_ADDR}, peers


SLOW_LINK = ("rate", "40mbit", "burst", "32kb", "latency", "400ms")
"""tbf on each host's egress: 5 MB/s (the veth alone moves GB/s), and a queue that holds
up to 400 ms of it, so a notification or heartbeat waits behind the bulk bytes queued
before it, as on a congested link."""


def test_a_slow_peer_is_waited_for_not_judged_gone(two: Hosts) -> None:
    """A peer that is slow but not dead: the link between the hosts is slow and congested
    (5 MB/s each way, up to 400 ms queued) from the first handshake of new engines on,
    while push, pull and EC requests run at once. Every request ends done with the right
    bytes; neither daemon forgets the other, gives up on it, fails a handshake or lets a
    lease expire. Once the link is fast again, requests run as before."""
    hosts = two
    pe, de = _engines(hosts, "s")
    pe2, de2 = _engines(hosts, "t")  # each driver drains its own engines' events
    prod, cons = _ec(hosts, "s")
    before = {h.ns: _counters(h) for h in (hosts.p, hosts.d)}
    rx0, _ = hosts.d.veth_bytes()
    for h in (hosts.p, hosts.d):
        h.tc("add", "root", "tbf", *SLOW_LINK)
    try:
        drivers = [
            _Run(lambda: _kv(hosts, "push", pe, de, 12, 40, max_blocks=2, window=2, timeout=90)),
            _Run(lambda: _kv(hosts, "pull", pe2, de2, 12, 41, max_blocks=2, window=2, timeout=90)),
            _Run(
                lambda: run_ec(
                    prod,
                    cons,
                    6,
                    random.Random(42),
                    max_bytes=512 << 10,
                    window=2,
                    timeout=90,
                    name="s",
                )
            ),
        ]
        started = time.monotonic()
        for t in drivers:
            t.start()
        for t in drivers:
            t.join(120)
            assert not t.is_alive(), "a driver never ended"
            assert t.error is None, repr(t.error)
        took = time.monotonic() - started
        if os.environ.get("KVD_XX_DEBUG"):
            print(
                "STATE UNDER TBF",
                json.dumps(_transfer_states(hosts), indent=1, default=str)[:20000],
            )
    finally:
        for h in (hosts.p, hosts.d):
            h.tc("del", "root")
    slow = [t.result for t in drivers]
    for res in slow:
        _all_verified(res)
    after = {h.ns: _counters(h) for h in (hosts.p, hosts.d)}
    judged = {ns: judged_gone(before[ns], after[ns]) for ns in after}
    assert not any(judged.values()), judged
    # the link was the bottleneck: what crossed it took at least its rate's time
    rx1, _ = hosts.d.veth_bytes()
    assert took >= (rx1 - rx0) / 5e6 * 0.9, (took, rx1 - rx0)
    again = [
        _kv(hosts, "push", pe, de, 4, 43, max_blocks=4),
        _kv(hosts, "pull", pe2, de2, 4, 44, max_blocks=4),
    ]
    for res in again:
        _all_verified(res)
    print(f"slow link: {rx1 - rx0:,} bytes in {took:.1f} s: {[r.summary() for r in slow]}")


def _counters(h: Host) -> dict[str, int]:
    assert h.daemon is not None
    with KvdClient(h.daemon.socket, role="cli", keepalive_interval=0) as c:
        got: dict[str, int] = c.status()["counters"]
    return got


class _Run(threading.Thread):
    """Runs one traffic driver to its end (each driver owns its engines' clients)."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        super().__init__(daemon=True)
        self.fn = fn
        self.result: Any = None
        self.error: BaseException | None = None
        self.ended_at = 0.0

    def run(self) -> None:
        try:
            self.result = self.fn()
        except BaseException as exc:
            self.error = exc
        self.ended_at = time.monotonic()


def test_link_cut_mid_transfer_then_restored(two: Hosts) -> None:
    hosts = two
    pe, de = _engines(hosts, "b")
    pe2, de2 = _engines(hosts, "c")
    prod, cons = _ec(hosts, "b")
    # warm the connections up, so that the cut finds transfers in flight, not handshakes
    _all_verified(_kv(hosts, "push", pe, de, 4, 10, max_blocks=8))
    _all_verified(_kv(hosts, "pull", pe2, de2, 4, 11, max_blocks=8))
    drivers = [
        _Run(lambda: _kv(hosts, "push", pe, de, 120, 12, max_blocks=8, window=16, timeout=45)),
        _Run(lambda: _kv(hosts, "pull", pe2, de2, 80, 13, max_blocks=8, window=16, timeout=45)),
        _Run(
            lambda: run_ec(
                prod, cons, 40, random.Random(14), max_bytes=4 << 20, timeout=45, name="b"
            )
        ),
    ]
    for t in drivers:
        t.start()
    in_flight = _wait_in_flight(hosts)
    hosts.p.link("down")
    time.sleep(CUT_S)
    hosts.p.link("up")
    restored_at = time.monotonic()
    for t in drivers:
        t.join(60)
        assert not t.is_alive(), "a driver never ended"
        assert t.error is None, repr(t.error)
    during = [t.result for t in drivers]
    late = [round(t.ended_at - restored_at, 1) for t in drivers]
    # after the restore, everything works again
    after = [
        _kv(hosts, "push", pe, de, 8, 20, max_blocks=8),
        _kv(hosts, "pull", pe2, de2, 8, 21, max_blocks=8),
        run_ec(prod, cons, 8, random.Random(22), max_bytes=4 << 20, timeout=30, name="c"),
    ]
    print(
        f"cut {CUT_S}s with {in_flight} transfers in flight: "
        f"{[r.summary() for r in during]}; after: {[r.summary() for r in after]}"
    )
    for res in during:
        # every request ended on both sides (run_mode counts one when both sides ended),
        # within its bound (checked above)
        stuck = [f for f in res.failures if "timed out" in f or "unknown" in f]
        if stuck:
            print(stuck, json.dumps(_transfer_states(hosts), indent=1, default=str))
        assert not stuck, (res.summary(), stuck)
        assert res.verified + res.mismatched + res.failed == res.requests, res.summary()
    for res in after:
        assert res.verified + res.mismatched == res.requests, res.summary()
    # No byte of a transfer given up on lands in blocks released since: NIXL cannot
    # cancel a posted transfer, so kvd never releases one UCX still works on, bounds how
    # long UCX may keep it (TCP_USER_TIMEOUT), mends the failed endpoints afterwards, and
    # the EC consumer quarantines what it gave up on until the producer answers.
    wrong = [r.summary() for r in during + after if r.mismatched]
    assert not wrong, wrong
    # every driver ended within its bound after the restore: P never forgets a D that
    # dialed it over a failed endpoint (the engine mends it), so P answers D's cancels
    # and D's held pushes end on P's word, not at their hold bound
    assert max(late) < END_BOUND, late


def _transfer_states(hosts: Hosts) -> dict[str, Any]:
    """What P and D still hold (for a failure's message); a daemon that died fails the
    test with its crash report."""
    out: dict[str, Any] = {}
    for h in (hosts.p, hosts.d):
        if h.daemon is not None:
            rc = h.daemon.proc.poll()
            assert rc is None, f"{h.daemon.name} died ({rc}):\n{h.daemon.report(6000)}"
            with KvdClient(h.daemon.socket, role="cli", keepalive_interval=0) as c:
                out[h.daemon.name] = {
                    "transfers": c.status("transfers"),
                    "live": c.status("drain"),
                    "counters": c.status()["counters"],
                }
    return out


def _wait_in_flight(hosts: Hosts, timeout: float = 5.0) -> int:
    """Transfers in flight at P and D, once there are some (the drivers own the engines'
    clients: ask through a CLI session of our own)."""
    deadline = time.monotonic() + timeout
    with contextlib.ExitStack() as stack:
        clis = [
            stack.enter_context(KvdClient(h.daemon.socket, role="cli", keepalive_interval=0))
            for h in (hosts.p, hosts.d)
            if h.daemon is not None
        ]
        while True:
            n = sum(len(c.status("transfers")["in_flight"]) for c in clis)
            if n or time.monotonic() > deadline:
                return n
            time.sleep(0.02)


def test_an_ec_request_held_behind_a_cut_link_is_refused_past_its_deadline(two: Hosts) -> None:
    """The consumer asks while the link is down: its request waits in TCP (ZMQ queues it,
    the kernel retransmits), the consumer gives up at `ec.xfer_timeout` and quarantines
    the blocks. Once the link is back the request reaches the producer seconds after its
    deadline (`serve_by_ns`): the producer, which judges it with the consumer's clock
    offset (no synchronized clocks assumed), refuses it, counted, WRITEs nothing, and its
    refusal frees the consumer's quarantine. Outputs are fetched and verified after."""
    hosts = two
    prod, cons = _ec(hosts, "d")
    # warm: the connections, the handshakes and the clock offset
    _all_verified(run_ec(prod, cons, 2, random.Random(30), max_bytes=2 << 20, name="d"))

    def counters(side: ECSide) -> dict[str, int]:
        got: dict[str, int] = side.client.status()["counters"]
        return got

    nbytes = 2 << 20
    blocks = prod.client.ec_allocate("cut-held", nbytes)
    prod.write(blocks.block_ids, np.full(nbytes, 0x5A, dtype=np.uint8))
    params = prod.client.ec_commit("cut-held", nbytes, shape=(nbytes,), dtype="uint8", compat="c")
    p0, c0 = counters(prod), counters(cons)
    hosts.p.link("down")
    try:
        cons.client.ec_ensure(params)
        events: list[Any] = []
        deadline = time.monotonic() + XFER_TIMEOUT + 5.0
        while not events and time.monotonic() < deadline:
            events = [e for e in cons.client.wait_events(0.5) if e.mm_hash == "cut-held"]
        assert len(events) == 1 and not isinstance(events[0], wire.ECReady), events
        assert events[0].code == int(ErrorCode.TIMEOUT), events[0]
        time.sleep(1.0)  # the request is now well past its deadline
    finally:
        hosts.p.link("up")
    t0 = time.monotonic()
    while True:
        p1, c1 = counters(prod), counters(cons)
        if p1.get("ec_xfer_too_old", 0) > p0.get("ec_xfer_too_old", 0) and c1.get(
            "ec_quarantine_released_answered", 0
        ) > c0.get("ec_quarantine_released_answered", 0):
            break
        assert time.monotonic() - t0 < 30, (p1, c1)
        time.sleep(0.1)
    assert p1.get("ec_xfer_too_old", 0) == p0.get("ec_xfer_too_old", 0) + 1
    assert p1.get("ec_served", 0) == p0.get("ec_served", 0)  # nothing WRITten
    assert p1.get("ec_xfer_age_unknown", 0) == p0.get("ec_xfer_age_unknown", 0)
    assert c1.get("ec_quarantined", 0) == c0.get("ec_quarantined", 0) + 1
    assert not cons.client.wait_events(0.2)  # the request ended once, at its timeout
    # UCX failed the endpoints during the cut: the first WRITEs after it may fail once,
    # while the producer makes a fresh one (as after any cut); then outputs cross again
    for attempt in range(10):
        first = run_ec(prod, cons, 1, random.Random(31), max_bytes=2 << 20, name=f"e{attempt}")
        if first.verified == 1:
            break
        time.sleep(0.5)
    _all_verified(run_ec(prod, cons, 4, random.Random(32), max_bytes=2 << 20, name="f"))


# ------------------------------------------------------------ a push WRITE outliving D's wait

SLOW = "4mbit"
"""P's egress while the WRITE is in flight: its 2 MiB take about 4 s to cross."""
MARK = 0x5A


def _events(cli: KvdClient, into: dict[str, tuple[float, Any]]) -> None:
    now = time.monotonic()
    for ev in cli.drain_events():
        rid = getattr(ev, "request_id", "")
        assert rid not in into, f"a second terminal event for {rid}: {ev}"
        into[rid] = (now, ev)


@dataclass
class _Pair:
    """A P and a D daemon of a test's own, one engine on each, and the terminal events
    each engine saw (request id -> (when, event))."""

    pd: DaemonProc
    dd: DaemonProc
    pe: Engine
    de: Engine
    p_seen: dict[str, tuple[float, Any]] = field(default_factory=dict)
    d_seen: dict[str, tuple[float, Any]] = field(default_factory=dict)

    def push(self, name: str, p_blocks: list[int], d_blocks: list[int]) -> tuple[str, str, str]:
        pe, de = self.pe, self.de
        key = f"cmpl-{secrets.token_hex(6)}-{name}-0"
        p_id, d_id = f"{key}-p", f"{key}-d"
        for j, b in enumerate(p_blocks):
            pe.block(0, b)[:] = pattern(f"{key}/0", j, pe.block_bytes)
        pe.client.finished(p_id, p_blocks)
        de.client.track(d_id, P_ADDR, self.pd.side_port, remote_request_id=p_id)
        de.client.register_push(d_id, d_blocks, P_ADDR, self.pd.side_port, remote_request_id=p_id)
        return key, p_id, d_id

    def wait(self, rid: str, side: str, t: float) -> Any:
        cli, seen = (self.pe.client, self.p_seen) if side == "p" else (self.de.client, self.d_seen)
        deadline = time.monotonic() + t
        while rid not in seen:
            assert time.monotonic() < deadline, f"no terminal event for {rid} within {t}s"
            _events(cli, seen)
            time.sleep(0.01)
        return seen[rid]

    def arrived(self, key: str, d_blocks: list[int]) -> bool:
        de = self.de
        return all(
            bytes(de.block(0, b)) == bytes(pattern(f"{key}/0", j, de.block_bytes))
            for j, b in enumerate(d_blocks)
        )

    def p_writing(self, timeout: float = 5.0) -> None:
        """Returns once P's daemon has a transfer in flight."""
        with KvdClient(self.pd.socket, role="cli", keepalive_interval=0) as cli:
            wait_for = time.monotonic() + timeout
            while not cli.status("transfers")["in_flight"]:
                assert time.monotonic() < wait_for, "P never posted its WRITE"
                time.sleep(0.01)


@contextlib.contextmanager
def _pair(
    hosts: Hosts,
    d_transfer: dict[str, Any] | None = None,
    p_transfer: dict[str, Any] | None = None,
) -> Iterator[_Pair]:
    """Daemons of the test's own on the two hosts (16 blocks per engine), with a push
    already verified (D holds P's view); P's egress slowed to `SLOW` once inside. Both
    daemons must exit cleanly at the end (a crash fails the test)."""
    tag = secrets.token_hex(2)
    pd = _daemon(hosts.workdir, hosts.p, f"kvdt-2h-pw-{tag}", "none", p_transfer)
    dd = _daemon(hosts.workdir, hosts.d, f"kvdt-2h-dw-{tag}", "none", d_transfer)
    shaped = False
    try:
        kw: dict[str, Any] = {"num_blocks": 16, "num_layers": LAYERS, "chunk_bytes": CHUNK}
        pe = make_engine(pd.socket, f"prefill-w{tag}", **kw)
        hosts.engines.append(pe)
        de = make_engine(dd.socket, f"decode-w{tag}", **kw)
        hosts.engines.append(de)
        pair = _Pair(pd, dd, pe, de)
        # a push that fits D's wait: verified, and D holds P's view from now on
        key, _, d_id = pair.push("warm", [0], [0])
        _, ev = pair.wait(d_id, "d", 10.0)
        assert type(ev).__name__ == "RecvFinished" and pair.arrived(key, [0]), ev
        hosts.p.tc("add", "root", "tbf", "rate", SLOW, "burst", "32kb", "latency", "1s")
        shaped = True
        yield pair
    finally:
        if shaped:
            hosts.p.tc("del", "root")
        _close_engines(hosts)
        for dmn in (dd, pd):
            with contextlib.suppress(ProcessLookupError):
                dmn.proc.send_signal(signal.SIGCONT)
            assert dmn.stop() == 0, dmn.report(3000)


def test_push_write_in_flight_past_ds_watchdog_lands_nothing_after_the_terminal_event(
    two: Hosts,
) -> None:
    """P's WRITE into D's blocks is still crossing a slow link, and P's daemon is frozen
    (SIGSTOP) in the middle of it, when D's registration watchdog gives up. NIXL cannot
    cancel the WRITE, so D must hold the request's terminal event (its engine keeps the
    blocks) until P says the WRITE ended: D's engine hears of the end only after P's
    daemon came back and its WRITE ended, and once it did, no byte lands in the blocks
    (a marker written into them right after the event stays intact)."""
    with _pair(two, {"push_registration_timeout": 1.0}) as pair:
        pd, dd, de = pair.pd, pair.dd, pair.de
        blocks = [1, 2, 3, 4, 5, 6, 7, 8]  # 2 MiB
        key, p_id, d_id = pair.push("slow", blocks, blocks)
        # P's WRITE is in flight (the link lets it through slowly): freeze P in its midst
        pair.p_writing()
        pd.proc.send_signal(signal.SIGSTOP)
        try:
            time.sleep(2.5)  # D's watchdog (1 s) gives up meanwhile
            _events(de.client, pair.d_seen)
            assert d_id not in pair.d_seen, (
                f"D ended the request under P's WRITE: {pair.d_seen[d_id]}"
            )
            with KvdClient(dd.socket, role="cli", keepalive_interval=0) as cli:
                assert cli.status()["receiver"]["holding"] == 1
        finally:
            pd.proc.send_signal(signal.SIGCONT)
        resumed = time.monotonic()
        d_at, ev = pair.wait(d_id, "d", 20.0)
        _, p_ev = pair.wait(p_id, "p", 20.0)
        assert d_at >= resumed
        landed = type(ev).__name__ == "RecvFinished"
        if landed:  # the WRITE ended well: every byte is there
            assert pair.arrived(key, blocks)
            # P's engine: done, or failed when the WRITE outlived the settle bound first
            # (answered Unsettled, then held until UCX ended it: which way is not told)
            assert type(p_ev).__name__ == "SendFinished" or "in flight" in p_ev.reason, p_ev
        else:
            assert list(ev.block_ids) == blocks, ev
        # the blocks are the engine's again: nothing of the WRITE may land in them now
        for b in blocks:
            de.block(0, b)[:] = MARK
        time.sleep(2.0)
        intact = [b for b in blocks if bool((de.block(0, b) == MARK).all())]
        assert intact == blocks, (
            f"bytes landed after the terminal event in {set(blocks) - set(intact)}"
        )
        with KvdClient(dd.socket, role="cli", keepalive_interval=0) as cli:
            st = cli.status()
            assert st["receiver"]["holding"] == 0
            assert st["counters"].get("holds_released_by_p", 0) == 1, st["counters"]
        print(f"D's event {ev} {d_at - resumed:.3f}s after P resumed; P's: {p_ev}")


def test_an_engine_gone_under_a_write_in_flight_leaves_its_region_to_the_late_bytes(
    two: Hosts,
) -> None:
    """D's engine goes away (its session closes, its region is dropped) while P's WRITE
    into its blocks is still crossing a slow link. NIXL cannot cancel the WRITE, so the
    rest of its bytes arrive at D after the drop: D must not have unmapped the region's
    memory under them (over TCP the late bytes would be copied into unmapped memory: D's
    daemon would crash), nor let another mapping take its addresses. D retires the
    region instead (its addresses stay reserved, the engine's memory is let go) and
    frees the addresses only after the longest time a late byte may take; meanwhile D
    serves on."""
    # P's transfer bound longer than the WRITE takes to cross (TCP_USER_TIMEOUT follows
    # it): the WRITE runs to its end instead of being cut off
    with _pair(two, p_transfer={"transfer_timeout": 12.0}) as pair:
        dd, de = pair.dd, pair.de
        blocks = [1, 2, 3, 4, 5, 6, 7, 8]  # 2 MiB: about 4 s over the slowed link
        _, p_id, _ = pair.push("slow", blocks, blocks)
        pair.p_writing()
        with KvdClient(dd.socket, role="cli", keepalive_interval=0) as cli:
            dropped = cli.status()["counters"].get("regions_dropped", 0)
            two.engines.remove(de)
            de.close()  # the engine goes; its session's region is dropped
            deadline = time.monotonic() + 15.0
            while cli.status()["counters"].get("regions_dropped", 0) == dropped:
                assert time.monotonic() < deadline, "D never dropped the engine's region"
                time.sleep(0.05)
            retired = cli.status()["registrar"]["retired"]
            assert len(retired) == 1 and retired[0]["decoy"], retired
            # P's WRITE is still crossing: the rest of it lands in the retired region
            assert cli.status()["counters"].get("regions_retired_freed", 0) == 0
        _, p_ev = pair.wait(p_id, "p", 30.0)
        time.sleep(1.0)  # whatever was still queued lands meanwhile
        assert dd.proc.poll() is None, f"D died under the late bytes:\n{dd.report(6000)}"
        # the WRITE ran to its end, into the decoy: D's UCX met no unmapped memory (which
        # fails the endpoint, or crashes D where it copies the bytes itself)
        assert type(p_ev).__name__ == "SendFinished", p_ev
        # D serves on: a new engine registers and receives a verified push
        two.p.tc("del", "root")
        two.p.tc("add", "root", "pfifo")
        tag = secrets.token_hex(2)
        kw: dict[str, Any] = {"num_blocks": 16, "num_layers": LAYERS, "chunk_bytes": CHUNK}
        pair.de = make_engine(dd.socket, f"decode-x{tag}", **kw)
        two.engines.append(pair.de)
        key, _, d_id = pair.push("after", [9], [3])
        _, ev = pair.wait(d_id, "d", 20.0)
        assert type(ev).__name__ == "RecvFinished" and pair.arrived(key, [3]), ev
        print(f"P's event for the WRITE under the gone engine: {p_ev}")
