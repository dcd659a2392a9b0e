"""EC transfer requests under a shared secret, against real daemons (real NIXL, real shm).

An attacker who reaches a producer's `ec.port` (a raw DEALER in this process) must not be
able to make it WRITE an output into a consumer's EC region: a request without a MAC,
with a MAC made under another secret, a captured request sent again, a stale one, and
a captured one retargeted are refused AUTH, counted as `ec_auth_rejected` and logged;
one that proves the secret but names another agent, region or generation than the
producer's handshake with the consumer says is refused too. Before each attack the
consumer's EC region is filled with a known pattern, and after it the pattern must be
intact: nothing is WRITten on a refusal. Daemons that share the secret still move
outputs, every byte checked; a consumer without it gets nothing.
"""

from __future__ import annotations

import json
import os
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from kvd_client import wire
from kvd_client.errors import ErrorCode

from kvd.actors.ecrouter import EC_XFER_CONTEXT
from kvd.core.peerauth import message_mac
from kvd.demo import DaemonProc
from kvd.ecdemo import ECSide, output_bytes, run_ec

from .conftest import StartDaemon
from .ports import restart_port
from .test_ec import MiB, ec_cfg

SECRET = b"kvd ec auth test secret"
OUTPUT = 3 * MiB
BLOCKS = (0, 1, 2)
"""The consumer's blocks every forged request names (its LRU pool's first blocks)."""


def secret_file(workdir: Path, name: str, secret: bytes) -> str:
    path = workdir / name
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, secret + b"\n")
    os.close(fd)
    return f'[auth]\nsecret_file = "{path}"\n'


def counters(side: ECSide) -> dict[str, int]:
    got: dict[str, int] = side.client.status()["counters"]
    return got


def log_events(d: DaemonProc) -> list[dict[str, Any]]:
    out = []
    for line in d.log.read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if isinstance(rec, dict):
            out.append(rec)
    return out


class Attacker:
    """A raw DEALER on the producer's EC port: sends whatever bytes it is given."""

    def __init__(self, port: int) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"tcp://127.0.0.1:{port}")

    def send(self, frame: bytes, timeout_ms: int = 10_000) -> wire.ECXferAck:
        self.sock.send(frame)
        assert self.sock.poll(timeout_ms), "the producer did not answer"
        _, msg = wire.decode(self.sock.recv())
        assert isinstance(msg, wire.ECXferAck), msg
        return msg

    def close(self) -> None:
        self.sock.close(0)


@dataclass
class Pair:
    """A producer with one committed output and a consumer, both knowing SECRET."""

    prod: ECSide
    cons: ECSide
    prod_daemon: DaemonProc
    prod_config: str
    """The producer's config (TOML added to start_daemon's), to start it again."""
    params: wire.ECParams
    template: wire.ECXferReq
    """A request the real consumer could make for the output (fields only: no nonce,
    no timestamp, no MAC)."""
    attacker: Attacker
    pattern: np.ndarray

    def request(self, *, sign_with: bytes | None = SECRET, **changes: Any) -> bytes:
        """A fresh request (new nonce, current time, a deadline 10 s away on the consumer's
        monotonic clock: this host's), signed with `sign_with` if given."""
        req = replace(
            self.template,
            timestamp=time.time(),
            nonce=os.urandom(16),
            serve_by_ns=time.monotonic_ns() + 10 * 10**9,
        )
        req = replace(req, **changes)
        if sign_with is not None:
            req = replace(req, mac=message_mac(sign_with, req, EC_XFER_CONTEXT))
        return wire.encode(req)

    def fill(self) -> None:
        """The consumer's whole EC region holds the known pattern."""
        self.cons.buf[:] = self.pattern

    def intact(self) -> bool:
        return bool(np.array_equal(self.cons.buf, self.pattern))

    def output_at_blocks(self) -> bool:
        return self.cons.matches(BLOCKS, output_bytes(7, OUTPUT))


@pytest.fixture
def pair(daemons: StartDaemon, workdir: Path) -> Iterator[Pair]:
    auth = secret_file(workdir, "secret", SECRET)
    prod_config = auth + ec_cfg("producer", 16 * MiB)
    e = daemons("kvdt-ea-enc", prod_config)
    c = daemons("kvdt-ea-con", auth + ec_cfg("consumer", 16 * MiB))
    prod, cons = ECSide(e.socket, "encoder"), ECSide(c.socket, "consumer")
    p: Pair | None = None
    try:
        params = commit_output(prod)
        st = cons.client.status()
        region = next(r for r in st["regions"] if r["engine_id"] == "kvd-ec")
        template = wire.ECXferReq(
            mm_hash="img",
            compat="ec-ok",
            agent_name=st["agent_name"],
            side_host="127.0.0.1",
            side_port=int(st["side_channel"].rsplit(":", 1)[1]),
            dst_region=region["region_id"],
            dst_generation=region["generation"],
            dst_block_ids=BLOCKS,
        )
        rng = np.random.default_rng(99)
        pattern = rng.integers(0, 256, size=len(cons.buf), dtype=np.uint8)
        attacker = Attacker(params.peer_port)
        p = Pair(prod, cons, e, prod_config, params, template, attacker, pattern)
        yield p
    finally:
        if p is not None:
            p.attacker.close()
            prod = p.prod  # a test may have restarted the producer
        prod.close()
        cons.close()


def commit_output(prod: ECSide) -> wire.ECParams:
    """The output every test asks for, committed at the producer."""
    blocks = prod.client.ec_allocate("img", OUTPUT)
    prod.write(blocks.block_ids, output_bytes(7, OUTPUT))
    return prod.client.ec_commit("img", OUTPUT, compat="ec-ok")


HANDSHAKES = ("handshakes_ok", "handshakes_failed")


def refused(p: Pair, frame: bytes, code: ErrorCode, counter: str, why: str) -> None:
    """`frame` is refused with `code`, counted once under `counter`, nothing WRITten.
    A request refused AUTH is refused where it is read: the producer dials no one for it."""
    p.fill()
    before = counters(p.prod)
    ack = p.attacker.send(frame)
    assert not ack.ok and ack.code == code, (why, ack)
    after = counters(p.prod)
    assert after.get(counter, 0) - before.get(counter, 0) == 1, (why, counter)
    for key in {"ec_auth_rejected", "ec_xfer_failed"} - {counter}:
        assert after.get(key, 0) == before.get(key, 0), (why, key)
    assert after.get("ec_served", 0) == before.get("ec_served", 0), why
    if code == ErrorCode.AUTH:
        for key in HANDSHAKES:
            assert after.get(key, 0) == before.get(key, 0), (why, key)
    assert p.intact(), f"{why}: the consumer's EC region was written"


def test_requests_without_the_secret_are_refused_and_nothing_is_written(pair: Pair) -> None:
    p = pair
    refused(p, p.request(sign_with=None), ErrorCode.AUTH, "ec_auth_rejected", "no MAC")
    wrong = p.request(sign_with=b"not the secret")
    refused(p, wrong, ErrorCode.AUTH, "ec_auth_rejected", "wrong secret")
    # a MAC of the right length but made by no one
    forged = replace(wire.decode(p.request(sign_with=None))[1], mac=os.urandom(32))
    refused(p, wire.encode(forged), ErrorCode.AUTH, "ec_auth_rejected", "random MAC")
    # a request a secret holder made without a nonce (as an old consumer would)
    no_nonce = p.request(nonce=b"")
    refused(p, no_nonce, ErrorCode.AUTH, "ec_auth_rejected", "no nonce")
    assert counters(p.prod)["ec_auth_rejected"] == 4
    # refused where they are read: no handshake with the consumer was asked for
    assert counters(p.prod).get("handshakes_ok", 0) == 0
    assert p.prod.client.status("ec")["producer"]["pinned"] == 0
    kinds = {
        r.get("kind")
        for r in log_events(p.prod_daemon)
        if r.get("event") == "ec_xfer_auth_rejected"
    }
    assert {"no_mac", "bad_mac", "short_nonce"} <= kinds, kinds


def test_a_request_delivered_after_its_deadline_is_refused_and_nothing_is_written(
    pair: Pair,
) -> None:
    """A genuine request that reaches the producer only after the consumer's deadline for
    its WRITE (`serve_by_ns`: as one queued in ZMQ behind a cut link would, while the
    consumer gave up, quarantined its blocks, and may have freed them) is refused TIMEOUT,
    counted, nothing WRITten. The producer judges the deadline through the consumer's
    clock offset it measured over the side channel, not by trusting that clocks agree; a
    request whose deadline it cannot judge (none given) is refused as well. One in time is
    served."""
    p = pair
    before = counters(p.prod)
    sent = p.request(serve_by_ns=time.monotonic_ns() + 1_500_000_000)  # 1.5 s to start
    time.sleep(2.0)  # held back, as a cut link would
    refused(p, sent, ErrorCode.TIMEOUT, "ec_xfer_failed", "delivered past its deadline")
    after = counters(p.prod)
    assert after.get("ec_xfer_too_old", 0) - before.get("ec_xfer_too_old", 0) == 1
    refused(p, p.request(serve_by_ns=0), ErrorCode.TIMEOUT, "ec_xfer_failed", "no deadline")
    now = counters(p.prod)
    assert now.get("ec_xfer_age_unknown", 0) - after.get("ec_xfer_age_unknown", 0) == 1
    assert now.get("ec_xfer_too_old", 0) == after.get("ec_xfer_too_old", 0)
    # the producer measured the consumer's clock (one host: an offset within its bound)
    (consumer,) = p.prod.client.status("peers")["peers"]
    assert consumer["clock_offset_us"] is not None, consumer
    assert abs(consumer["clock_offset_us"]) <= consumer["clock_error_us"] + 1, consumer
    p.fill()
    ack = p.attacker.send(p.request())  # 10 s to start: in time
    assert ack.ok, ack
    assert p.output_at_blocks()
    assert counters(p.prod)["ec_served"] == before.get("ec_served", 0) + 1


def test_a_captured_request_is_served_once(pair: Pair) -> None:
    p = pair
    captured = p.request()
    p.fill()
    ack = p.attacker.send(captured)
    assert ack.ok, ack  # the genuine request: WRITten into the named blocks
    assert p.output_at_blocks()
    assert counters(p.prod)["ec_served"] == 1
    # the same bytes again, on this connection and on a new one
    refused(p, captured, ErrorCode.AUTH, "ec_auth_rejected", "replay")
    other = Attacker(p.params.peer_port)
    try:
        p.fill()
        ack = other.send(captured)
        assert not ack.ok and ack.code == ErrorCode.AUTH, ack
        assert "already served" in ack.reason, ack.reason
        assert p.intact()
    finally:
        other.close()
    # captured, then retargeted: other blocks, agent, region or generation under its MAC
    _, req = wire.decode(captured)
    assert isinstance(req, wire.ECXferReq)
    changes: dict[str, dict[str, Any]] = {
        "other blocks": {"dst_block_ids": (3, 4, 5)},
        "other agent": {"agent_name": "kvdt-elsewhere"},
        "other region": {"dst_region": req.dst_region + 1},
        "other generation": {"dst_generation": req.dst_generation + 1},
        "new nonce": {"nonce": os.urandom(16)},
        "new timestamp": {"timestamp": time.time()},
    }
    for why, change in changes.items():
        frame = wire.encode(replace(req, **change))
        refused(p, frame, ErrorCode.AUTH, "ec_auth_rejected", f"retargeted: {why}")
    # stale: made too long ago, or for a time too far ahead
    for why, skew in (("old", -300.0), ("future", 300.0)):
        frame = p.request(timestamp=time.time() + skew)
        refused(p, frame, ErrorCode.AUTH, "ec_auth_rejected", f"stale: {why}")
    assert counters(p.prod)["ec_served"] == 1
    kinds = {
        r.get("kind")
        for r in log_events(p.prod_daemon)
        if r.get("event") == "ec_xfer_auth_rejected"
    }
    assert {"replayed", "bad_mac", "stale"} <= kinds, kinds


def test_requests_naming_another_agent_region_or_generation_are_refused(pair: Pair) -> None:
    """A request whose agent, region or generation is not what the producer's handshake
    with the daemon at its side channel says is refused and nothing is WRITten. From an
    attacker (no MAC) it is refused AUTH where it is read, before the producer dials the
    address it names. With a valid MAC (a secret holder's mistake, or a stale view) the
    producer handshakes once more, then refuses: not an authentication failure, so it is
    counted as `ec_xfer_failed`, with the codes a consumer without a secret gets."""
    p = pair
    tpl = p.template
    cases: dict[str, tuple[dict[str, Any], ErrorCode]] = {
        "wrong agent": ({"agent_name": "kvdt-someone-else"}, ErrorCode.PROTOCOL),
        "wrong region": ({"dst_region": tpl.dst_region + 7}, ErrorCode.NOT_FOUND),
        "wrong generation": ({"dst_generation": tpl.dst_generation + 1}, ErrorCode.NOT_FOUND),
        "old generation": ({"dst_generation": tpl.dst_generation - 1}, ErrorCode.NOT_FOUND),
    }
    for why, (change, _) in cases.items():
        frame = p.request(sign_with=None, **change)
        refused(p, frame, ErrorCode.AUTH, "ec_auth_rejected", f"attacker: {why}")
    assert all(counters(p.prod).get(key, 0) == 0 for key in HANDSHAKES)
    for why, (change, code) in cases.items():
        refused(p, p.request(**change), code, "ec_xfer_failed", f"signed: {why}")
    assert p.prod.client.status("ec")["producer"]["pinned"] == 0
    # the producer's view of the consumer is what the consumer says
    (peer,) = p.prod.client.status("peers")["peers"]
    assert peer["agent"] == tpl.agent_name
    # and the same request naming the right ones is served
    p.fill()
    assert p.attacker.send(p.request()).ok
    assert p.output_at_blocks()


def test_daemons_sharing_the_secret_move_outputs_and_a_stranger_gets_none(
    pair: Pair, daemons: StartDaemon, workdir: Path
) -> None:
    p = pair
    # a consumer daemon under another secret asks for the committed output: refused AUTH
    # where its request is read (before, the producer's handshake with it failed instead)
    other = secret_file(workdir, "other-secret", b"another secret")
    s = daemons("kvdt-ea-stranger", other + ec_cfg("consumer", 16 * MiB))
    stranger = ECSide(s.socket, "stranger")
    try:
        stranger.client.ec_ensure(p.params)
        (ev,) = stranger.client.wait_events(10)
        assert isinstance(ev, wire.ECUnavailable) and ev.code == ErrorCode.AUTH, ev
        assert not stranger.buf.any()
        assert counters(p.prod)["ec_auth_rejected"] == 1
        assert all(counters(p.prod).get(key, 0) == 0 for key in HANDSHAKES)
        assert counters(p.prod).get("ec_served", 0) == 0
    finally:
        stranger.close()
    # the consumer that shares the secret is served, every byte checked
    p.cons.client.ec_ensure(p.params)
    (ev,) = p.cons.client.wait_events(10)
    assert isinstance(ev, wire.ECReady), ev
    assert p.cons.matches(ev.block_ids, output_bytes(7, OUTPUT))
    p.cons.client.ec_release("img")
    res = run_ec(p.prod, p.cons, 30, random.Random(5), max_bytes=2 * MiB, unique=12)
    assert res.failures == []
    assert (res.verified, res.mismatched, res.failed) == (30, 0, 0)
    pc, cc = counters(p.prod), counters(p.cons)
    assert pc["ec_served"] == cc["ec_fetched"] == cc["ec_xfer_requests"] > 1
    assert pc["ec_auth_rejected"] == 1


def test_a_request_captured_before_the_producer_restarted_is_refused(
    pair: Pair, daemons: StartDaemon
) -> None:
    """A producer remembers the nonces it served in memory only, so a restarted one
    refuses every request made before it started: a request served by its predecessor
    cannot be replayed to it, even once the same output is committed again."""
    p = pair
    captured = p.request()
    p.fill()
    assert p.attacker.send(captured).ok
    assert p.output_at_blocks()
    p.attacker.close()
    p.prod.close()
    assert p.prod_daemon.stop() == 0
    e2 = daemons("kvdt-ea-enc", p.prod_config)
    p.prod = ECSide(e2.socket, "encoder")
    params = commit_output(p.prod)
    p.attacker = Attacker(params.peer_port)
    p.prod_daemon = e2
    refused(p, captured, ErrorCode.AUTH, "ec_auth_rejected", "captured before the restart")
    kinds = {r.get("kind") for r in log_events(e2) if r.get("event") == "ec_xfer_auth_rejected"}
    assert kinds == {"stale"}, kinds
    # the same request made anew is served by the new producer
    p.fill()
    assert p.attacker.send(p.request()).ok
    assert p.output_at_blocks()


def test_a_consumer_restarted_under_another_name_is_served(
    daemons: StartDaemon, workdir: Path
) -> None:
    """The producer's view maps the consumer's side channel to the agent it handshaked
    with. A consumer restarted at the same address under another name names its new
    agent: the producer handshakes again before refusing, finds it, and serves it."""
    auth = secret_file(workdir, "secret", SECRET)
    e = daemons("kvdt-ea-enc", auth + ec_cfg("producer", 16 * MiB))
    side = {"side_channel": {"port": restart_port()}}  # both incarnations
    c1 = daemons("kvdt-ea-con1", auth + ec_cfg("consumer", 16 * MiB), overrides=side)
    prod = ECSide(e.socket, "encoder")
    try:
        outs = []
        for i in range(2):
            blocks = prod.client.ec_allocate(f"r{i}", MiB)
            prod.write(blocks.block_ids, output_bytes(i, MiB))
            outs.append(prod.client.ec_commit(f"r{i}", MiB, compat="ec-ok"))
        cons = ECSide(c1.socket, "consumer")
        try:
            cons.client.ec_ensure(outs[0])
            (ev,) = cons.client.wait_events(10)
            assert isinstance(ev, wire.ECReady), ev
        finally:
            cons.close()
        assert c1.stop() == 0
        c2 = daemons("kvdt-ea-con2", auth + ec_cfg("consumer", 16 * MiB), overrides=side)
        cons = ECSide(c2.socket, "consumer")
        try:
            cons.client.ec_ensure(outs[1])
            (ev,) = cons.client.wait_events(10)
            assert isinstance(ev, wire.ECReady), ev
            assert cons.matches(ev.block_ids, output_bytes(1, MiB))
        finally:
            cons.close()
        agents = [peer["agent"] for peer in prod.client.status("peers")["peers"]]
        assert "kvdt-ea-con2" in agents, agents
    finally:
        prod.close()
