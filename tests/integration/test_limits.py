"""Limits (`[limits]`) on real daemons: each limit, once hit, refuses with an error naming
it, counts the refusal and shows it in `kvd status`; after the burst, normal service
resumes (verified transfers). The flooding peer is a real NIXL agent in this process that
handshakes like a peer daemon (no secret: these daemons run without `[auth]`) and sends
real notifications; the EC flood comes from a raw DEALER on the producer's EC port.
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import zmq
from kvd_client import wire
from kvd_client.client import KvdClient
from kvd_client.errors import Busy, ErrorCode

from kvd.actors.ecrouter import EC_XFER_CONTEXT
from kvd.core.peerauth import message_mac
from kvd.demo import DaemonProc, Engine, make_engine, run_mode
from kvd.ecdemo import ECSide, run_ec

from .conftest import StartDaemon, shared_secret_bytes
from .test_bad_input import FAKE_ENGINE, FakePeer, eventually, side_exchange
from .test_ec import MiB, ec_cfg
from .test_ec_auth import commit_output

BLOCKS = 64
LAYERS = 2
CHUNK = 4096


def status(d: DaemonProc) -> dict[str, Any]:
    with KvdClient(d.socket, role="cli", timeout=5.0, keepalive_interval=0) as c:
        got: dict[str, Any] = c.status("status")
        return got


class Peer(FakePeer):
    """The bad-input tests' fake peer, handshaking without a secret."""

    def __init__(self) -> None:
        super().__init__(f"kvdt-flood-{os.getpid()}-{secrets.token_hex(3)}", b"")

    def connect(self, d: DaemonProc, **changes: Any) -> wire.Handshake:
        hs = self.handshake_msg(**changes)
        got = side_exchange(d.side_port, wire.encode(hs, 78))
        assert got is not None and isinstance(got[1], wire.Handshake), got
        reply = got[1]
        if reply.agent_name not in self.remote_md:
            assert self.agent.add_remote_agent(reply.nixl_md) == reply.agent_name.encode()
            self.remote_md[reply.agent_name] = reply.nixl_md
        return reply

    def registration(self, rid: str, blocks: int) -> bytes:
        reg = wire.PushRegistration(
            rid,
            "",
            FAKE_ENGINE,
            "prefill",
            1,
            tuple(range(blocks)),
            "",
            0,
            self.incarnation,
            (1,),
            "",
        )
        return wire.encode(reg)

    def answers(self, kind: type[wire.Record]) -> list[Any]:
        self.pump()
        return [m for _, m in self.inbox if isinstance(m, kind)]


@pytest.fixture
def peer() -> Iterator[Peer]:
    """Ask for it before `daemons`: the daemons stop first (they tell their peers' side
    channels that their regions go)."""
    p = Peer()
    yield p
    p.close()


def engines(p: DaemonProc, d: DaemonProc) -> tuple[Engine, Engine]:
    pe = make_engine(p.socket, "prefill", num_blocks=BLOCKS, num_layers=LAYERS, chunk_bytes=CHUNK)
    de = make_engine(d.socket, "decode", num_blocks=BLOCKS, num_layers=LAYERS, chunk_bytes=CHUNK)
    return pe, de


def served(
    p: DaemonProc, pe: Engine, de: Engine, mode: str = "push", n: int = 12, window: int = 16
) -> None:
    """Normal service: n requests P -> D (at most `window` at once), every byte verified,
    each ending once per side."""
    res = run_mode(
        mode, pe, de, p.side_port, n, random.Random(5), max_blocks=4, timeout=60, window=window
    )
    assert res.verified == n and not res.failures, res.summary()


def test_clients_beyond_max_clients_are_refused_until_one_leaves(daemons: StartDaemon) -> None:
    d = daemons("kvdt-lim-clients", overrides={"limits": {"max_clients": 2}})
    first = KvdClient(d.socket, role="scheduler", engine_id="e1", keepalive_interval=0)
    second = KvdClient(d.socket, role="worker", engine_id="e1", tp_rank=0, keepalive_interval=0)
    first.connect()
    second.connect()
    third = KvdClient(d.socket, role="scheduler", engine_id="e2", timeout=5.0, keepalive_interval=0)
    try:
        with pytest.raises(Busy, match=r"limits\.max_clients reached: 2 client sessions open"):
            third.connect()
        st = status(d)  # the CLI may still look: it has a reserve (its session counts)
        assert st["limits"]["max_clients"] == {"limit": 2, "used": 3, "refused": 1}
        assert st["counters"]["limit_clients_refused"] == 1
        table = subprocess.run(
            [sys.executable, "-m", "kvd", "status", "--socket", d.socket],
            capture_output=True,
            text=True,
            timeout=30,
            env={**os.environ, "COLUMNS": "200"},
        )
        assert table.returncode == 0, table.stderr
        row = next(line for line in table.stdout.splitlines() if "max_clients" in line)
        cells = [c.strip() for c in row.split("│")[2:6]]
        assert cells == ["2", "3", "-", "1"], row  # limit, used (this call's too), peak, refused
        second.close()
        third.close()
        third = KvdClient(d.socket, role="scheduler", engine_id="e2", keepalive_interval=0)
        third.connect()  # a slot is free again
        assert status(d)["limits"]["max_clients"]["used"] == 3
    finally:
        for c in (first, second, third):
            c.close()


def burst_into_a_frozen_d(
    daemons: StartDaemon, n: int, tag: str, window: int = 16, **d_overrides: Any
) -> tuple[dict[str, list[Any]], dict[str, Any]]:
    """`n` registrations sent while D's daemon is frozen (SIGSTOP), none failed by the
    client; then, as it runs again, `n` aborts. Waits until every request ended (at most
    60 s); returns their events and D's counters. Service goes on after (`window`
    requests at once: within what D's mailboxes hold, or some are rightly refused BUSY)."""
    p = daemons(f"kvdt-lim-{tag}p")
    d = daemons(f"kvdt-lim-{tag}d", overrides=d_overrides)
    pe, de = engines(p, d)
    ids = [f"cmpl-{tag}-{i}-{secrets.token_hex(3)}" for i in range(n)]
    ended: dict[str, list[Any]] = {}
    try:
        d.proc.send_signal(signal.SIGSTOP)
        try:
            for i, rid in enumerate(ids):
                de.client.register_push(rid, [i % BLOCKS], "127.0.0.1", p.side_port)
            local = de.client.drain_events()  # the daemon is stopped: only the client speaks
            assert local == [], local[:3]
        finally:
            d.proc.send_signal(signal.SIGCONT)
        for rid in ids:
            de.client.abort(rid)
        t0 = time.monotonic()
        while len(ended) < len(ids):
            for ev in de.client.wait_events(1.0):
                ended.setdefault(ev.request_id, []).append(ev)
            assert time.monotonic() - t0 < 60, f"{len(ended)} of {len(ids)} ended"
        assert set(ended) == set(ids)
        assert all(len(evs) == 1 for evs in ended.values())
        assert all(isinstance(evs[0], wire.RecvFailed) for evs in ended.values())  # none pushed
        counters: dict[str, Any] = status(d)["counters"]
        served(p, pe, de, window=window)
        return ended, counters
    finally:
        pe.close()
        de.close()


def test_a_burst_to_a_frozen_daemon_is_queued_and_taken(daemons: StartDaemon) -> None:
    """5,000 registrations sent while D's daemon is frozen wait in the client's send
    queue: none fails locally (libzmq's default queue of 1,000 refused the tail of such a
    burst, "send queue full"). Once the daemon runs again they and 5,000 aborts arrive at
    once, and its receiver keeps up (a turn takes `burst_batch` messages while requests
    pile up: taking one, it refused ~940 of them BUSY): every request ends exactly once,
    aborted, within seconds."""
    ended, counters = burst_into_a_frozen_d(daemons, 5000, "burst")
    reasons = {evs[0].reason for evs in ended.values()}
    assert reasons == {"aborted by the client"}, reasons
    assert counters.get("ipc_busy", 0) == 0


def test_aborts_refused_busy_are_taken_or_sent_again(daemons: StartDaemon) -> None:
    """The same burst (300) into a D whose mailboxes hold 8 requests: registrations and
    aborts are refused BUSY; an abort refused so is taken as a notice by the daemon or
    sent again by the client (once dropped, its registration waited for P for 480 s):
    every request ends exactly once, within seconds, aborted or refused BUSY."""
    # (then a window of 2: a track and a registration each, within the 8)
    ended, counters = burst_into_a_frozen_d(
        daemons, 300, "abusy", window=2, daemon={"mailbox_size": 8}
    )
    reasons = {evs[0].reason for evs in ended.values()}
    assert reasons <= {"aborted by the client", "the receiver mailbox is full (8)"}, reasons
    assert counters.get("ipc_busy", 0) > 0  # refusals happened: the path was taken


def test_registrations_beyond_the_per_peer_limit_fail_on_d_at_once(daemons: StartDaemon) -> None:
    """A real D registers 8 pushes before P's engine finishes any; P keeps 5 and answers
    the other 3 failed at once (D's engine gets RecvFailed naming the limit, long before
    any watchdog); the 5 kept are delivered when P finishes them; service goes on."""
    p = daemons("kvdt-lim-regp", overrides={"limits": {"pending_registrations_per_peer": 5}})
    d = daemons("kvdt-lim-regd")
    pe, de = engines(p, d)
    try:
        ids = [f"cmpl-lim-{i}-{secrets.token_hex(4)}" for i in range(8)]
        blocks = {rid: [i] for i, rid in enumerate(ids)}
        for rid in ids:
            de.client.register_push(rid, blocks[rid], "127.0.0.1", p.side_port)
        t0 = time.monotonic()
        failed: dict[str, wire.RecvFailed] = {}
        while len(failed) < 3:
            for ev in de.client.wait_events(1.0):
                assert isinstance(ev, wire.RecvFailed), ev
                failed[ev.request_id] = ev
            assert time.monotonic() - t0 < 10, f"only {len(failed)} failed"
        for ev in failed.values():
            assert ev.code == int(ErrorCode.BUSY)
            assert "limits.pending_registrations_per_peer reached: 5" in ev.reason
            assert ev.block_ids == tuple(blocks[ev.request_id])  # what to recompute
        st = status(p)
        lim = st["limits"]["pending_registrations_per_peer"]
        assert lim == {"limit": 5, "used": 5, "refused": 3}
        assert st["counters"]["limit_pending_registrations_refused"] == 3
        kept = [rid for rid in ids if rid not in failed]
        for rid in kept:
            pe.client.finished(rid, blocks[rid])
        done: set[str] = set()
        sent: set[str] = set()
        while len(done) < len(kept) or len(sent) < len(kept):
            for ev in de.client.wait_events(0.2):
                assert isinstance(ev, wire.RecvFinished), ev
                done.add(ev.request_id)
            for ev in pe.client.drain_events():
                assert isinstance(ev, wire.SendFinished), ev
                sent.add(ev.request_id)
            assert time.monotonic() - t0 < 20
        assert done == sent == set(kept)
        assert status(p)["limits"]["pending_registrations_per_peer"]["used"] == 0
        # within the limit (D may register all of a window before P finishes any: a window
        # above 5 would be refused in part, rightly, whenever D is that fast)
        served(p, pe, de, window=5)
    finally:
        pe.close()
        de.close()


def test_a_peer_beyond_its_notification_rate_is_dropped_and_counted(
    peer: Peer, daemons: StartDaemon
) -> None:
    rate = 100
    p = daemons("kvdt-lim-ratep", overrides={"limits": {"notifs_per_peer_per_s": float(rate)}})
    d = daemons("kvdt-lim-rated")
    pe, de = engines(p, d)
    try:
        peer.connect(p)
        hb = wire.encode(wire.Heartbeat(("cmpl-nobody",)))
        sent = 1000
        t0 = time.monotonic()
        for i in range(sent):
            peer.agent.send_notif(p.name, hb)
            if i % 50 == 0:
                peer.pump()
        peer.pump()
        took = time.monotonic() - t0
        # at most the burst plus what refilled while the flood lasted was taken
        most = rate + rate * (took + 1.0)

        def all_counted() -> dict[str, Any] | None:
            peer.pump()
            st = status(p)
            c = st["counters"]
            seen = c.get("limit_notifs_dropped", 0) + c.get("heartbeats_received", 0)
            return st if seen >= sent else None

        st = eventually(all_counted, "P to count every heartbeat of the flood", 20)
        dropped = st["counters"]["limit_notifs_dropped"]
        assert sent - most <= dropped < sent, (dropped, took)
        lim = st["limits"]["notifs_per_peer_per_s"]
        assert lim["limit"] == rate and lim["refused"] == dropped
        time.sleep(1.1)  # the bucket refills
        served(p, pe, de)  # the real D's notifications are its own: served throughout
        served(p, pe, de, "pull")
        assert status(p)["counters"]["limit_notifs_dropped"] == dropped
    finally:
        pe.close()
        de.close()


def _rss_kib(pid: int, field: str = "VmRSS") -> int:
    """The process's resident set (KiB), or with "VmHWM" its peak since `_reset_peak`."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise AssertionError(f"no {field}")


def _reset_peak(pid: int) -> None:
    """Start VmHWM again from the current RSS (proc(5): clear_refs, "5")."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def test_a_flood_of_pending_registrations_stays_under_the_memory_bound(
    peer: Peer, daemons: StartDaemon
) -> None:
    """Floods of registrations of 4096 block ids each (about 165 KB each at the estimate;
    16 KB on the wire) from a real peer whose P engine never finishes them, while a real
    D is served all along. P charges each registration to `limits.pending_bytes` as it
    decodes it, before it queues it for the sender: what fits in 1 MiB is kept, the rest
    is answered BUSY at once (counted) and never queued. Each registration is answered
    exactly once (refused, or cancelled when the peer gives up). P's RSS stays bounded,
    its peak included: a flood adds no more than allocator noise and its raw bytes."""
    bound = 1 << 20
    p = daemons(
        "kvdt-lim-memp",
        overrides={"limits": {"pending_bytes": bound, "pending_registrations_per_peer": 100_000}},
    )
    d = daemons("kvdt-lim-memd")
    pe, de = engines(p, d)
    flood, floods = 2000, 3
    stop = threading.Event()
    rounds: list[str] = []
    errors: list[BaseException] = []

    def serve_d() -> None:
        """The real D, pushed to and pulling from P in turn until the floods are over."""
        try:
            while not stop.is_set():
                mode = ("push", "pull")[len(rounds) % 2]
                served(p, pe, de, mode)
                rounds.append(mode)
        except BaseException as exc:  # reported by the test's thread
            errors.append(exc)

    server = threading.Thread(target=serve_d, name="real-d", daemon=True)
    try:
        peer.connect(p)
        served(p, pe, de)  # warm: P's and D's views of each other, the engines' memory
        _reset_peak(p.proc.pid)
        rss = [_rss_kib(p.proc.pid)]
        server.start()
        refused_in_all = 0
        for round_ in range(floods):
            ids = [f"flood-{round_}-{i}" for i in range(flood)]
            for i, rid in enumerate(ids):
                peer.agent.send_notif(p.name, peer.registration(rid, 4096))
                if i % 100 == 0:
                    peer.pump()
            st = status(p)
            used = st["limits"]["pending_bytes_sender"]
            assert used["used"] <= bound and used["peak"] <= bound
            # the peer gives up on all of them: what P kept is answered "cancelled"
            for rid in ids:
                peer.agent.send_notif(p.name, wire.encode(wire.CancelRegistration(rid)))

            def answered(round_: int = round_) -> list[Any] | None:
                got = [
                    m
                    for m in peer.answers(wire.PushDone)
                    if m.request_id.startswith(f"flood-{round_}-")
                ]
                return got if len(got) >= flood else None

            answers = eventually(answered, "P to answer every registration", 60)
            assert sorted(m.request_id for m in answers) == sorted(ids)  # once each
            assert not any(m.ok for m in answers)
            refusals = [m for m in answers if m.code == int(ErrorCode.BUSY)]
            kept = flood - len(refusals)
            assert 0 < kept <= 6  # ~165 KB each at the estimate: 6 fit in 1 MiB
            for m in answers:
                if m.code == int(ErrorCode.BUSY):
                    assert "limits.pending_bytes reached" in m.reason, m
                else:
                    assert m.reason == "cancelled by D", m
            eventually(
                lambda: status(p)["limits"]["pending_bytes_sender"]["used"] < 64 * 1024,
                "P to free what the flood held (the real D's requests may hold a little)",
                20,
                pump=peer.pump,
            )
            st = status(p)
            used = st["limits"]["pending_bytes_sender"]
            refused_in_all += len(refusals)
            assert used["refused"] == refused_in_all
            assert st["counters"]["limit_pending_bytes_refused"] == refused_in_all
            assert used["peak"] <= bound
            assert not errors, errors
            rss.append(_rss_kib(p.proc.pid))
        stop.set()
        server.join(120)
        assert not server.is_alive(), "the real D's last round never ended"
        assert not errors, errors
        assert rounds  # the real D was served while the floods came, every byte checked
        peak = _rss_kib(p.proc.pid, "VmHWM")
        print(f"P's RSS (KiB) before, after each flood: {rss}, peak {peak}; D's rounds {rounds}")
        assert status(p)["limits"]["pending_bytes_sender"]["used"] == 0
        # KiB. What P keeps and queues is bounded (asserted above), so no flood adds more
        # than allocator noise while it lasts (the peak; queued unbounded, a flood's
        # decoded registrations added 180-300 MB), apart from its raw notifications:
        # NIXL's thread polls them and hands them to the event loop in batches before P
        # decodes any, so a whole flood (32 MB here) can sit there at once, in NIXL's
        # list and as Python bytes allocated in that thread's malloc arena. That arena
        # keeps what it grew to, so the floods before the last take P to its working
        # size (a second flood added up to 30 MB, in 5 of 33 runs over 10 MB, mostly
        # under 3 MB): the last flood, as large, adds less than 32 MiB.
        raw = flood * len(peer.registration("flood-1-1999", 4096)) // 1024
        assert rss[-1] - rss[-2] < 32 * 1024, rss
        assert peak - rss[0] < 32 * 1024 + 2 * raw, (peak, rss, raw)
        served(p, pe, de)
    finally:
        stop.set()
        if server.is_alive():
            server.join(120)
        pe.close()
        de.close()


def test_an_ec_request_flood_is_served_a_few_at_a_time_the_rest_refused_busy(
    daemons: StartDaemon,
) -> None:
    """A producer serves at most `daemon.mailbox_size` consumers' EC requests at once
    (each waits on a handshake with its consumer, then a WRITE): a flood of requests
    naming a consumer whose side channel never answers holds that many, and every other
    is acked BUSY at once (counted), holding no task, pin or handshake. Once those end
    (the handshake times out), nothing is left, and a real consumer is served."""
    silent = socket.socket()  # accepts connections (the kernel does) but never speaks
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    at_once, flood = 4, 50
    e = daemons(
        "kvdt-lim-ecp",
        ec_cfg("producer", 16 * MiB),
        overrides={"daemon": {"mailbox_size": at_once}, "side_channel": {"handshake_timeout": 5.0}},
    )
    c = daemons("kvdt-lim-ecc", ec_cfg("consumer", 16 * MiB))
    prod, cons = ECSide(e.socket, "encoder"), ECSide(c.socket, "consumer")
    dealer: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        params = commit_output(prod)
        dealer.connect(f"tcp://127.0.0.1:{params.peer_port}")
        req = wire.ECXferReq(
            mm_hash="img",
            compat="ec-ok",
            agent_name="kvdt-ec-flooder",
            side_host="127.0.0.1",
            side_port=silent.getsockname()[1],
            dst_region=1,
            dst_generation=1,
            dst_block_ids=(0, 1, 2),
        )
        secret = shared_secret_bytes(Path(e.config).parent)
        for _ in range(flood):
            if secret is not None:  # KVD_TEST_AUTH=1: signed as a daemon signs it
                req = replace(req, timestamp=time.time(), nonce=os.urandom(16), mac=b"")
                req = replace(req, mac=message_mac(secret, req, EC_XFER_CONTEXT))
            dealer.send(wire.encode(req))
        acks: list[wire.ECXferAck] = []
        while len(acks) < flood:
            assert dealer.poll(30_000), f"the producer answered {len(acks)} of {flood}"
            _, ack = wire.decode(dealer.recv())
            assert isinstance(ack, wire.ECXferAck), ack
            acks.append(ack)
            if len(acks) == flood - at_once:  # the refusals come first, at once
                assert prod.client.status("ec")["serving"] == at_once
                assert prod.client.status("ec")["producer"]["pinned"] == 3
        busy = [a for a in acks if a.code == int(ErrorCode.BUSY)]
        assert acks[: flood - at_once] == busy, acks
        assert all(not a.ok and "daemon.mailbox_size" in a.reason for a in busy)
        assert not any(a.ok or a.code == int(ErrorCode.BUSY) for a in acks[-at_once:])
        st = prod.client.status("ec")
        assert st["serving"] == 0 and st["producer"]["pinned"] == 0
        assert prod.client.status()["counters"]["ec_xfer_failed"] == flood
        # a real consumer is served, every byte checked
        res = run_ec(prod, cons, 6, random.Random(4), max_bytes=2 * MiB, name="real")
        assert res.failures == [] and res.verified == 6
    finally:
        dealer.close(0)
        silent.close()
        prod.close()
        cons.close()
