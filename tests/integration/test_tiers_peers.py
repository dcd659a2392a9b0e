"""KV tiers across nodes: a daemon looks its local misses up in its peers' tiers and READs
the hits over NIXL. Real daemons (two or three), real NIXL, the real shared-memory pools;
every loaded byte is checked. With KVD_TEST_AUTH=1 every peer message is sealed."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import zmq
from kvd_client import wire
from kvd_client.errors import ErrorCode
from kvd_client.tiers import TierClient

from kvd.actors.tiers import pool_creator
from kvd.demo import DaemonProc

from .conftest import StartDaemon
from .test_tiers import BB, NS, block, key, load_check, tiers_cfg

AUTH = os.environ.get("KVD_TEST_AUTH") == "1"


def tiers_json(d: DaemonProc, cli: bool = False) -> dict[str, Any]:
    """What `kvd tiers --json` shows (`cli`: from the CLI itself, else the same
    answer through a client session: quicker where a test waits on it)."""
    if not cli:
        with TierClient(d.socket, NS, BB) as c:
            return c.stats()
    out = subprocess.run(
        [sys.executable, "-m", "kvd", "tiers", "--json", "--socket", d.socket],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    data: dict[str, Any] = json.loads(out.stdout)
    return data


def wait_for(cond: Callable[[], bool], timeout: float = 15.0) -> None:
    end = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > end:
            raise AssertionError("condition not met in time")
        time.sleep(0.05)


def kill(d: DaemonProc, sig: int = signal.SIGKILL) -> None:
    """Kill a daemon and remove the pool segment it could not."""
    d.proc.send_signal(sig)
    d.proc.wait(10)
    for name in os.listdir("/dev/shm"):
        if pool_creator(name) == d.proc.pid:
            os.unlink(os.path.join("/dev/shm", name))


def asker_cfg(*peers: DaemonProc, **kw: Any) -> dict[str, dict[str, Any]]:
    addrs = ",".join(f"127.0.0.1:{p.side_port}" for p in peers)
    return tiers_cfg(peers=addrs, **kw)


def wait_asked(d: DaemonProc, n: int) -> None:
    wait_for(lambda: len(tiers_json(d)["peer"]["asked"]) == n)


def store(d: DaemonProc, ids: list[int], ns: bytes = NS) -> None:
    with TierClient(d.socket, ns, BB) as c:
        assert c.store([key(i) for i in ids], [memoryview(block(i, ns)) for i in ids]) == [
            True
        ] * len(ids)


def test_peer_hit_loaded_over_nixl_verified_and_promoted(daemons: StartDaemon) -> None:
    from .test_metrics import _free_port, _get, _samples

    b = daemons("pb", overrides=tiers_cfg())
    store(b, list(range(8)))
    port = _free_port()
    a = daemons("pa", overrides={**asker_cfg(b), "metrics": {"port": port}})
    wait_asked(a, 1)
    with TierClient(a.socket, NS, BB) as c:
        assert c.batch_lookup([key(i) for i in range(10)]) == [True] * 8 + [False] * 2
        assert load_check(c, [3, 9, 0, 7, 1]) == [True, False, True, True, True]
        s = c.stats()
        p = s["peer"]
        assert (p["hits"], p["misses"], p["blocks_loaded"]) == (8, 2, 4)
        assert p["bytes_in"] == 4 * BB and p["bad_answers"] == 0
        assert s["counters"].get("peer_checksum_mismatch", 0) == 0
        # promoted: the loaded blocks are local hits now; a lookup that hits only
        # locally never asks the peers
        assert s["host"]["blocks"] == 4
        asked = p["lookups"]
        assert asked == 1  # one batch to the one peer for the 10 keys, not one per key
        assert s["counters"].get("peer_served_keys", 0) == 0  # (B counts what it serves)
        assert c.batch_lookup([key(i) for i in (0, 1, 3, 7)]) == [True] * 4
        assert c.stats()["peer"]["lookups"] == asked
        assert load_check(c, [0, 1, 3, 7]) == [True] * 4
        assert c.stats()["peer"]["blocks_loaded"] == 4
        # another model never sees the peer's blocks
        with TierClient(a.socket, b"model-B", BB) as other:
            assert other.batch_lookup([key(i) for i in range(8)]) == [False] * 8
    sb = tiers_json(b, cli=True)
    assert sb["peer"]["bytes_out"] == 4 * BB
    # B: one lookup batch of A's 10 keys, and model B's batch of 8
    assert sb["counters"]["peer_served_lookups"] == 2
    assert sb["counters"]["peer_served_keys"] == 18
    wait_for(lambda: tiers_json(b)["peer"]["pins_held"] == 0)  # unpinned after the READ
    assert tiers_json(b)["ops_open"] == 0
    m = _samples(port)
    assert _get(m, "kvd_tiers_hits_total", agent="pa", tier="peer") == 8
    # 2 of the first lookup, and model B's 8 (asked of the peer, under its namespace)
    assert _get(m, "kvd_tiers_misses_total", agent="pa", tier="peer") == 10
    assert _get(m, "kvd_tiers_bytes_in_total", agent="pa", tier="peer") == 4 * BB
    table = subprocess.run(
        [sys.executable, "-m", "kvd", "tiers", "--socket", a.socket],
        capture_output=True,
        text=True,
        check=True,
        timeout=30,
    ).stdout
    assert "peer" in table and "peers asked pb" in table and "blocks loaded 4" in table


def test_peer_hits_come_inline_where_a_read_would_be_emulated(daemons: StartDaemon) -> None:
    """Where our UCX would emulate a READ from the peer (TCP: a reader dying with READs
    queued at a stopped peer aborts the peer inside UCX, `kvd.core.readpath`), a load asks
    for the blocks inline: they come in the pin's answer, nothing stays pinned on the
    peer, and every byte is checked. `transfer.pull_by = "write"` makes one machine act
    so; an answer carries what fits in a frame, the rest in more answers (the asker's
    frames) or as misses (the peer's)."""
    write = {"transfer": {"pull_by": "write"}}
    b = daemons("pb", overrides=tiers_cfg())
    store(b, list(range(8)))
    # A's frames hold 3 blocks of inline data: its 5-key load goes as two answers
    small = {"daemon": {"max_frame_bytes": (1 << 20) + 3 * BB + 1024}}
    a = daemons("pa", overrides={**asker_cfg(b), **write, **small})
    wait_asked(a, 1)
    with TierClient(a.socket, NS, BB) as c:
        assert c.batch_lookup([key(i) for i in range(10)]) == [True] * 8 + [False] * 2
        assert load_check(c, [3, 9, 0, 7, 1, 5]) == [True, False, True, True, True, True]
        s = c.stats()
        assert s["peer"]["blocks_loaded"] == 5 and s["peer"]["bad_answers"] == 0
        assert s["counters"]["peer_inline_blocks"] == 5
        assert s["counters"].get("peer_checksum_mismatch", 0) == 0
        assert load_check(c, [0, 1, 3, 5, 7]) == [True] * 5  # promoted: local hits now
    sb = tiers_json(b)
    assert sb["counters"]["peer_inline_served"] == 5 and sb["peer"]["bytes_out"] == 5 * BB
    assert sb["peer"]["pins_held"] == 0 and sb["ops_open"] == 0  # nothing held for a READ

    # a peer whose frames hold 2 blocks answers 2 of each batch, the rest as misses
    b2 = daemons(
        "pb2", overrides={**tiers_cfg(), "daemon": {"max_frame_bytes": (1 << 20) + 2 * BB}}
    )
    store(b2, list(range(20, 26)))
    a2 = daemons("pa2", overrides={**asker_cfg(b2), **write})
    wait_asked(a2, 1)
    with TierClient(a2.socket, NS, BB) as c:
        assert c.batch_lookup([key(i) for i in range(20, 26)]) == [True] * 6
        got = load_check(c, list(range(20, 24)))
        assert got == [True, True, False, False]
    wait_for(lambda: tiers_json(b2)["ops_open"] == 0)

    # an asker whose frames cannot hold one block never asks such a peer (a READ would be
    # emulated): the peer's keys are misses, recomputed by the engine, and nothing is READ
    served = tiers_json(b)["counters"]["peer_served_lookups"]
    tiny = {"daemon": {"max_frame_bytes": (1 << 20) + BB - 1}}
    a3 = daemons("pa3", overrides={**asker_cfg(b), **write, **tiny})
    wait_asked(a3, 1)
    with TierClient(a3.socket, NS, BB) as c:
        assert c.batch_lookup([key(i) for i in range(4)]) == [False] * 4
        s = c.stats()
        assert s["counters"]["peer_skipped_emulated"] == 1
        assert s["peer"]["blocks_loaded"] == 0
    assert tiers_json(b)["counters"]["peer_served_lookups"] == served  # never asked
    assert "tiers_peer_block_too_large_inline" in a3.log.read_text()


def test_a_peer_restarted_at_another_address_is_asked_there_and_its_old_socket_closed(
    daemons: StartDaemon,
) -> None:
    """A peer restarted under its name at another address (a new port here; a new pod IP
    in a cluster): once its handshake says where it is, the asker talks to it there and
    closes its socket to the old address, which ZMQ would otherwise redial for good."""
    b = daemons("pb", overrides=tiers_cfg())
    store(b, [0, 1])
    a = daemons("pa", overrides=asker_cfg(b, ask_known_peers=True))
    wait_asked(a, 1)
    with TierClient(a.socket, NS, BB) as c:
        assert c.batch_lookup([key(0), key(1)]) == [True, True]
        assert load_check(c, [0, 1]) == [True, True]
        assert c.stats()["peer"]["sockets"] == 1
    old_port = b.side_port
    assert b.stop() == 0
    # the same name at another port, dialing A (its own configured peer) as it starts
    b2 = daemons("pb", overrides=tiers_cfg(peers=f"127.0.0.1:{a.side_port}"))
    assert b2.side_port != old_port
    store(b2, [2, 3])
    wait_for(lambda: tiers_json(a)["counters"].get("peer_sockets_closed", 0) == 1)
    with TierClient(a.socket, NS, BB) as c:
        assert c.batch_lookup([key(2), key(3)]) == [True, True]
        assert load_check(c, [2, 3]) == [True, True]
        assert c.stats()["peer"]["sockets"] == 1  # to the new address only


def test_local_hit_wins_and_peers_picked_deterministically(daemons: StartDaemon) -> None:
    b = daemons("pb", overrides=tiers_cfg())
    c_ = daemons("pc", overrides=tiers_cfg())
    store(b, [0, 1, 2, 3])
    store(c_, [2, 3, 4, 5])
    a = daemons("pa", overrides=asker_cfg(c_, b))
    store(a, [1])
    wait_asked(a, 2)
    with TierClient(a.socket, NS, BB) as c:
        assert c.batch_lookup([key(i) for i in range(7)]) == [True] * 6 + [False]
        assert load_check(c, list(range(7))) == [True] * 6 + [False]
        assert c.stats()["peer"]["blocks_loaded"] == 5
    # "pb" < "pc": the blocks both hold come from pb; 1 was local (never asked for)
    assert tiers_json(b)["peer"]["bytes_out"] == 3 * BB  # 0, 2, 3
    assert tiers_json(c_)["peer"]["bytes_out"] == 2 * BB  # 4, 5


def test_dead_and_frozen_peers_are_misses_within_the_timeout(daemons: StartDaemon) -> None:
    timeout = 0.5
    b = daemons("pb", overrides=tiers_cfg())
    f = daemons("pf", overrides=tiers_cfg())
    store(b, [0, 1])
    store(f, [2, 3])
    a = daemons("pa", overrides=asker_cfg(b, f, peer_lookup_timeout=timeout))
    store(a, [9])
    wait_asked(a, 2)
    with TierClient(a.socket, NS, BB, timeout=10.0) as c:
        assert c.batch_lookup([key(i) for i in range(4)]) == [True] * 4
        os.kill(f.proc.pid, signal.SIGSTOP)
        try:
            # all keys local: answered without waiting for the frozen peer
            t0 = time.monotonic()
            assert c.batch_lookup([key(9)]) == [True]
            assert time.monotonic() - t0 < timeout
            # a miss: the frozen peer's keys are misses once its timeout passed
            t0 = time.monotonic()
            assert c.batch_lookup([key(i) for i in range(4)]) == [True, True, False, False]
            took = time.monotonic() - t0
            assert timeout * 0.9 <= took < timeout + 2.0, took
            assert c.stats()["peer"]["timeouts"] >= 1
            kill(b)
            t0 = time.monotonic()
            assert c.batch_lookup([key(i) for i in range(4)]) == [False] * 4
            assert time.monotonic() - t0 < timeout + 2.0
            # a load of a key the lookup found on the dead peer before: a miss
            assert load_check(c, [0, 9]) == [False, True]
        finally:
            os.kill(f.proc.pid, signal.SIGCONT)
        # the frozen peer answers again once it runs
        wait_for(lambda: c.batch_lookup([key(2)]) == [True])
        assert load_check(c, [2, 3]) == [True, True]
    wait_for(lambda: tiers_json(f)["peer"]["pins_held"] == 0)


class Tamper:
    """A side-channel proxy between the asker and a real peer that alters the peer's
    tier answers as told (`mode`): forged answers, as a man in the middle makes them."""

    def __init__(self, target_port: int) -> None:
        self.mode = ""
        self.tampered = 0
        ctx = zmq.Context.instance()
        self.front = ctx.socket(zmq.ROUTER)
        self.front.setsockopt(zmq.LINGER, 0)
        self.port = self.front.bind_to_random_port("tcp://127.0.0.1")
        self.back = ctx.socket(zmq.DEALER)
        self.back.setsockopt(zmq.LINGER, 0)
        self.back.connect(f"tcp://127.0.0.1:{target_port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        who: dict[int, bytes] = {}
        poller = zmq.Poller()
        poller.register(self.front, zmq.POLLIN)
        poller.register(self.back, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                if sock is self.front:
                    ident, frame = self.front.recv_multipart()
                    who[wire.decode(frame)[0]] = ident
                    self.back.send(frame)
                else:
                    frame = self.back.recv()
                    corr, _ = wire.decode(frame)
                    ident = who.pop(corr, b"")
                    if ident:
                        self.front.send_multipart([ident, self._alter(frame)])

    def _alter(self, frame: bytes) -> bytes:
        corr, msg = wire.decode(frame)
        if isinstance(msg, wire.Sealed) and self.mode:
            # without the session key, any change breaks the seal
            self.tampered += 1
            return wire.encode(wire.Sealed(msg.key_id, msg.counter, msg.body, bytes(32)), corr)
        if isinstance(msg, wire.TierFound) and self.mode == "found":
            self.tampered += 1
            return wire.encode(wire.TierFound(msg.found + b"\x01"), corr)
        if isinstance(msg, wire.PeerTierPinned) and self.mode in ("slot", "checksum"):
            self.tampered += 1
            if self.mode == "slot":
                slots = tuple(s + (1 << 20) if s >= 0 else s for s in msg.slots)
                return wire.encode(_with(msg, slots=slots), corr)
            sums = bytes(b ^ 0x5A for b in msg.checksums)
            return wire.encode(_with(msg, checksums=sums), corr)
        return frame

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.front.close(0)
        self.back.close(0)


def _with(msg: wire.PeerTierPinned, **kw: Any) -> wire.PeerTierPinned:
    import dataclasses

    return dataclasses.replace(msg, **kw)


@pytest.fixture
def tamper() -> Iterator[Callable[[int], Tamper]]:
    made: list[Tamper] = []

    def make(port: int) -> Tamper:
        t = Tamper(port)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def test_forged_answers_rejected_and_counted(
    daemons: StartDaemon, tamper: Callable[[int], Tamper]
) -> None:
    b = daemons("pb", overrides=tiers_cfg())
    store(b, list(range(6)))
    proxy = tamper(b.side_port)
    a = daemons(
        "pa",
        overrides=tiers_cfg(peers=f"127.0.0.1:{proxy.port}", peer_read_timeout=1.0),
    )
    wait_asked(a, 1)
    rejected = "peer_auth_rejected" if AUTH else "peer_bad_answers"
    with TierClient(a.socket, NS, BB, timeout=10.0) as c:
        proxy.mode = "found"  # a wrong-length lookup answer: all misses, counted
        assert c.batch_lookup([key(i) for i in range(3)]) == [False] * 3
        assert c.stats()["counters"][rejected] >= 1
        proxy.mode = ""
        assert c.batch_lookup([key(i) for i in range(6)]) == [True] * 6
        for mode, ids in (("slot", [0, 1]), ("checksum", [2, 3])):
            before = c.stats()["counters"]
            proxy.mode = mode  # a slot outside the pool, or checksums the bytes fail
            assert load_check(c, ids) == [False, False]
            after = c.stats()["counters"]
            if AUTH:
                assert after[rejected] > before[rejected]
            elif mode == "slot":
                assert after["peer_bad_answers"] > before.get("peer_bad_answers", 0)
            else:
                assert (
                    after["peer_checksum_mismatch"] == before.get("peer_checksum_mismatch", 0) + 2
                )
        proxy.mode = ""
        assert load_check(c, [4, 5]) == [True, True]
    assert proxy.tampered >= 3
    # what a forged answer made the asker give up is unpinned on the peer
    wait_for(lambda: tiers_json(b)["peer"]["pins_held"] == 0, timeout=20.0)


def _raw_pin(port: int, agent: str, incarnation: int, ids: list[int]) -> wire.Record:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        keys = b"".join(key(i) for i in ids)
        sock.send(wire.encode(wire.PeerTierPin(agent, incarnation, NS, BB, 36, keys), 7))
        assert sock.poll(10_000), "no answer"
        return wire.decode(sock.recv())[1]
    finally:
        sock.close(0)


def test_peer_pins_dropped_when_the_reader_is_gone(daemons: StartDaemon) -> None:
    """A reader that pinned and went away (no unpin): its pins go after the peer pin
    timeout, or at once when the same reader shows up as a new incarnation."""
    b = daemons("pb", overrides=tiers_cfg(peer_pin_timeout=8.0, peer_read_timeout=0.5))
    store(b, [0, 1, 2])
    got = _raw_pin(b.side_port, "ghost", 1, [0, 1, 5])
    if AUTH:  # an unsealed request from nobody we handshaked with: refused, nothing pinned
        assert isinstance(got, wire.ErrorReply) and got.code == ErrorCode.AUTH
        assert tiers_json(b)["peer"]["pins_held"] == 0
        return
    assert isinstance(got, wire.PeerTierPinned)
    assert got.slots[2] == wire.SLOT_HELD and got.slots[0] >= 0 and got.slots[1] >= 0
    assert tiers_json(b)["peer"]["pins_held"] == 1
    wait_for(lambda: tiers_json(b)["peer"]["pins_held"] == 0, timeout=20.0)
    assert tiers_json(b)["counters"]["peer_pins_expired"] == 1
    # a restarted reader (another incarnation): its old pins go at once
    assert isinstance(_raw_pin(b.side_port, "ghost", 1, [0]), wire.PeerTierPinned)
    assert isinstance(_raw_pin(b.side_port, "ghost", 2, [1]), wire.PeerTierPinned)
    s = tiers_json(b)
    assert s["counters"]["peer_pins_released_gone"] == 1 and s["peer"]["pins_held"] == 1


def test_a_peers_pins_are_bounded_in_number(daemons: StartDaemon) -> None:
    """One peer's loads hold at most `peer_pin_share` of the host tier pinned (here a
    quarter of 16 blocks: 4); a load beyond it finds misses, counted, and pins nothing;
    another peer still pins, and the first pins again once its pins are released."""
    b = daemons(
        "pq",
        overrides=tiers_cfg(peer_pin_timeout=30.0, peer_read_timeout=0.5, peer_pin_share=0.25),
    )
    store(b, list(range(8)))
    got = _raw_pin(b.side_port, "ghost", 1, [0, 1, 2])
    if AUTH:  # unsealed from nobody we handshaked with: refused before any pin
        assert isinstance(got, wire.ErrorReply) and got.code == ErrorCode.AUTH
        return
    assert isinstance(got, wire.PeerTierPinned) and all(s >= 0 for s in got.slots)
    over = _raw_pin(b.side_port, "ghost", 1, [3, 4])
    assert isinstance(over, wire.PeerTierPinned)
    assert over.slots == (wire.SLOT_HELD, wire.SLOT_HELD)
    s = tiers_json(b)
    assert s["counters"]["peer_pins_refused"] == 2 and s["peer"]["pins_held"] == 1
    other = _raw_pin(b.side_port, "ghost2", 1, [3, 4, 5, 6])
    assert isinstance(other, wire.PeerTierPinned) and all(x >= 0 for x in other.slots)
    # the same reader restarted (another incarnation): its old pins go, it pins again
    again = _raw_pin(b.side_port, "ghost", 2, [3, 4])
    assert isinstance(again, wire.PeerTierPinned) and all(x >= 0 for x in again.slots)


def test_pins_of_an_asker_killed_mid_load_are_released(daemons: StartDaemon) -> None:
    """A real asker dies (SIGKILL) holding pins on the peer (its load pinned there, and
    it never unpinned): the peer drops them within its peer pin timeout, and keeps
    serving another asker. To hold the pins for certain, the peer is frozen while the
    asker's pin request waits, the asker is frozen, then the peer answers."""
    b = daemons("pb", overrides=tiers_cfg(peer_pin_timeout=6.0, peer_read_timeout=5.0))
    store(b, [0, 1, 2, 3])
    a = daemons("pa", overrides=asker_cfg(b, peer_read_timeout=5.0, peer_pin_timeout=6.0))
    wait_asked(a, 1)
    outcome: list[object] = []
    with TierClient(a.socket, NS, BB, timeout=10.0, io_timeout=10.0) as c:
        assert c.batch_lookup([key(i) for i in range(4)]) == [True] * 4

        def load() -> None:
            try:
                outcome.append(load_check(c, [0, 1]))
            except Exception as exc:  # the asker dies under it
                outcome.append(exc)

        os.kill(b.proc.pid, signal.SIGSTOP)
        try:
            t = threading.Thread(target=load, daemon=True)
            t.start()
            time.sleep(1.5)  # the asker sent its pin request to the frozen peer
            os.kill(a.proc.pid, signal.SIGSTOP)
        finally:
            os.kill(b.proc.pid, signal.SIGCONT)
        # the peer answers the pin: held for a reader that cannot unpin
        wait_for(lambda: tiers_json(b)["peer"]["pins_held"] == 1)
        kill(a)
        t.join(30)
    assert outcome and isinstance(outcome[0], Exception)
    wait_for(lambda: tiers_json(b)["peer"]["pins_held"] == 0, timeout=20.0)
    s = tiers_json(b)
    assert s["counters"]["peer_pins_expired"] == 1 and s["ops_open"] == 0
    a2 = daemons("pa2", overrides=asker_cfg(b))
    wait_asked(a2, 1)
    with TierClient(a2.socket, NS, BB) as c:
        assert c.batch_lookup([key(i) for i in range(4)]) == [True] * 4
        assert load_check(c, [0, 1, 2, 3]) == [True] * 4
    wait_for(lambda: tiers_json(b)["peer"]["pins_held"] == 0)


def test_known_peers_are_asked_and_disk_hits_served(daemons: StartDaemon, workdir: Path) -> None:
    """`ask_known_peers`: A asks the peer that handshaked with it (B dialed A for its own
    `tiers.peers`); B serves a block from its disk tier (read into its pool, then READ)."""
    a = daemons("pa", overrides=tiers_cfg(ask_known_peers=True))
    root = workdir / "bdisk"
    b = daemons(
        "pb",
        overrides=asker_cfg(a, disk_path=str(root), disk_bytes=64 * BB, low_water=0.25),
    )
    wait_asked(b, 1)
    ids = list(range(20))  # more than B's 16 slots: the oldest go to its disk
    with TierClient(b.socket, NS, BB) as c:
        for i in ids:
            assert c.store([key(i)], [memoryview(block(i))]) == [True]
        wait_for(lambda: c.stats()["host"]["demoting"] == 0)
        assert c.stats()["disk"]["blocks"] >= 4
    store(a, [30])
    wait_asked(a, 1)
    assert tiers_json(a)["peer"]["configured"] == []
    with TierClient(a.socket, NS, BB) as c:
        assert c.batch_lookup([key(i) for i in [*ids, 30, 31]]) == [True] * 21 + [False]
        assert load_check(c, [0, 1, 19, 30, 31]) == [True, True, True, True, False]
        assert c.stats()["peer"]["blocks_loaded"] == 3
    assert tiers_json(b)["disk"]["bytes_out"] >= 2 * BB  # 0 and 1: read from B's disk
    # B asked A too (its configured peer): a miss there for a key only B holds
    with TierClient(b.socket, NS, BB) as c:
        assert c.batch_lookup([key(30), key(32)]) == [True, False]
        assert load_check(c, [30]) == [True]
    wait_for(lambda: tiers_json(b)["peer"]["pins_held"] == 0)
