"""Encoder-cache transfer between a producer daemon and a consumer daemon (real NIXL, real shm)."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import zmq
from kvd_client import wire
from kvd_client.errors import ErrorCode, InvalidRequest

from kvd.actors.ecrouter import EC_XFER_CONTEXT, ec_segment_creator
from kvd.core.peerauth import message_mac
from kvd.ecdemo import ECSide, output_bytes, run_ec

from .conftest import StartDaemon, auth_overrides, shared_secret_bytes, shm_segments
from .ports import restart_port

MiB = 1 << 20


def ec_cfg(role: str, region: int, block: int = MiB) -> str:
    return (
        f'[ec]\nrole = "{role}"\nregion_bytes = {region}\nblock_bytes = {block}\n'
        "xfer_timeout = 5.0\n"
    )


def test_500_outputs_with_repeats_every_byte(daemons: StartDaemon) -> None:
    e = daemons("kvd-enc", ec_cfg("producer", 48 * MiB))  # small: eviction under pressure
    c = daemons("kvd-con", ec_cfg("consumer", 96 * MiB))
    prod, cons = ECSide(e.socket, "encoder"), ECSide(c.socket, "consumer")
    try:
        res = run_ec(
            prod, cons, 500, random.Random(3), min_bytes=64 << 10, max_bytes=8 * MiB, window=8
        )
        assert res.failures == []
        assert (res.verified, res.mismatched, res.failed) == (500, 0, 0)
        pc = prod.client.status()["counters"]
        cc = cons.client.status()["counters"]
        st = cons.client.status("ec")
    finally:
        prod.close()
        cons.close()
    # repeats were served from the consumer's cache, without a producer round trip
    assert res.local_hits > 0 and cc["ec_hits"] == res.local_hits == st["hits"]
    assert cc["ec_xfer_requests"] == cc["ec_misses"] == st["misses"]
    # the producer was under pressure (it evicted), yet no pinned block was ever reused:
    # every byte of every fetched output matched
    assert pc["ec_evicted"] > 0 and res.reencoded > 0
    assert pc["ec_served"] == cc["ec_fetched"]
    assert st["consumer"]["pinned"] == 0
    assert any(ec_segment_creator(n) == e.proc.pid for n in shm_segments("kvd-ec-"))
    for d in (e, c):
        assert d.stop() == 0
    # the daemons removed their EC regions (named after their pids)
    assert not {
        n for n in shm_segments("kvd-ec-") for d in (e, c) if ec_segment_creator(n) == d.proc.pid
    }


def test_both_roles_in_one_daemon(daemons: StartDaemon) -> None:
    a = daemons("kvd-ecboth-a", ec_cfg("both", 32 * MiB))
    b = daemons("kvd-ecboth-b", ec_cfg("both", 32 * MiB))
    sa, sb = ECSide(a.socket, "a"), ECSide(b.socket, "b")
    try:
        res1 = run_ec(sa, sb, 40, random.Random(1), max_bytes=2 * MiB, unique=20)
        res2 = run_ec(sb, sa, 40, random.Random(2), max_bytes=2 * MiB, unique=20)
        assert (res1.verified, res2.verified) == (40, 40)
        assert res1.local_hits > 0 and res2.local_hits > 0
        info = sa.client.status("ec")
        assert info["producer"]["blocks"] == info["consumer"]["blocks"] == 16
        assert info["consumer_offset"] == 16
    finally:
        sa.close()
        sb.close()


def test_an_idle_socket_to_a_producer_is_closed_and_the_next_fetch_opens_another(
    daemons: StartDaemon,
) -> None:
    """A consumer closes its socket to a producer that no fetch needs once it has sent
    nothing on it for `ec.producer_socket_idle` (a producer restarted at another address
    is never named again, and ZMQ would redial the old one for good); the next fetch from
    that producer opens another and gets every byte."""
    e = daemons("kvd-enc", ec_cfg("producer", 16 * MiB))
    c = daemons("kvd-con", ec_cfg("consumer", 16 * MiB) + "producer_socket_idle = 0.5\n")
    prod, cons = ECSide(e.socket, "encoder"), ECSide(c.socket, "consumer")
    try:
        res = run_ec(prod, cons, 4, random.Random(5), max_bytes=MiB)
        assert (res.verified, res.failed) == (4, 0)
        deadline = time.monotonic() + 10.0
        while cons.client.status("ec")["producer_sockets"] != 0:
            assert time.monotonic() < deadline, "the idle socket was never closed"
            time.sleep(0.1)
        assert cons.client.status()["counters"]["ec_dealers_closed"] == 1
        res = run_ec(prod, cons, 4, random.Random(6), max_bytes=MiB, unique=4, name="again")
        assert (res.verified, res.failed) == (4, 0) and res.local_hits < 4  # (fetched)
        assert cons.client.status("ec")["producer_sockets"] == 1
    finally:
        prod.close()
        cons.close()


def _raw_xfer(port: int, frame: bytes, timeout_ms: int = 5000) -> wire.ECXferAck | None:
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(f"tcp://127.0.0.1:{port}")
    try:
        s.send(frame)
        if not s.poll(timeout_ms):
            return None
        _, msg = wire.decode(s.recv())
        assert isinstance(msg, wire.ECXferAck)
        return msg
    finally:
        s.close(0)


def test_bad_xfer_requests_are_refused_and_the_producer_keeps_serving(daemons: StartDaemon) -> None:
    e = daemons("kvd-enc", ec_cfg("producer", 16 * MiB))
    c = daemons("kvd-con", ec_cfg("consumer", 16 * MiB))
    prod, cons = ECSide(e.socket, "encoder"), ECSide(c.socket, "consumer")
    try:
        port = int(prod.client.status("ec")["port"])
        blocks = prod.client.ec_allocate("good", 3 * MiB)
        prod.write(blocks.block_ids, output_bytes(7, 3 * MiB))
        params = prod.client.ec_commit("good", 3 * MiB, compat="ec-ok")
        region = next(r for r in cons.client.status()["regions"] if r["engine_id"] == "kvd-ec")
        agent = cons.client.status()["agent_name"]
        side_port = int(cons.client.status()["side_channel"].rsplit(":", 1)[1])
        incarnation = int(cons.client.status()["incarnation"], 16)
        secret = shared_secret_bytes(Path(c.config).parent)

        def req(**kw: object) -> bytes:
            base = dict(
                mm_hash="good",
                compat="ec-ok",
                agent_name=agent,
                side_host="127.0.0.1",
                side_port=side_port,
                dst_region=region["region_id"],
                dst_generation=region["generation"],
                dst_block_ids=(0, 1, 2),
            )
            base.update(kw)
            msg = wire.ECXferReq(**base)  # type: ignore[arg-type]
            if secret is not None:  # KVD_TEST_AUTH=1: signed as a daemon signs it
                msg = replace(msg, timestamp=time.time(), nonce=os.urandom(16))
                msg = replace(msg, mac=message_mac(secret, msg, EC_XFER_CONTEXT))
            return wire.encode(msg)

        # malformed frames are dropped (no ack) and counted
        assert _raw_xfer(port, b"\xc1garbage", 500) is None
        assert _raw_xfer(port, wire.encode(wire.Probe(1, False)), 500) is None
        cases = {
            "unknown hash": (req(mm_hash="nope"), ErrorCode.NOT_FOUND),
            "wrong compat": (req(compat="other-model"), ErrorCode.INCOMPATIBLE),
            "out of region": (req(dst_block_ids=(14, 15, 16)), ErrorCode.INVALID),
            "negative block": (req(dst_block_ids=(-1, 0, 1)), ErrorCode.INVALID),
            "count mismatch": (req(dst_block_ids=(0,)), ErrorCode.INVALID),
            "stale generation": (req(dst_generation=region["generation"] + 1), ErrorCode.NOT_FOUND),
            "forged agent": (req(agent_name="someone-else"), ErrorCode.PROTOCOL),
            # names the consumer's agent, address, region and generation, and another
            # process of it: the producer handshakes afresh, and refuses
            "another incarnation": (req(incarnation=incarnation ^ 1), ErrorCode.NOT_FOUND),
        }
        for name, (frame, code) in cases.items():
            ack = _raw_xfer(port, frame)
            assert ack is not None and not ack.ok, name
            assert ack.code == code, (name, ack)
        counters = prod.client.status()["counters"]
        assert counters["ec_xfer_rejected"] == 2
        assert counters["ec_xfer_failed"] == len(cases)
        assert prod.client.status("ec")["producer"]["pinned"] == 0
        # a well-behaved consumer is served throughout
        cons.client.ec_ensure(params)
        (ev,) = cons.client.wait_events(10)
        assert isinstance(ev, wire.ECReady)
        assert cons.matches(ev.block_ids, output_bytes(7, 3 * MiB))
        cons.client.ec_release("good")
        # an unknown hash through the real consumer path ends unavailable, not hung
        cons.client.ec_ensure(
            wire.ECParams("missing", "127.0.0.1", port, MiB, (), "uint8", "image", "ec-ok")
        )
        (ev,) = cons.client.wait_events(10)
        assert isinstance(ev, wire.ECUnavailable) and ev.code == ErrorCode.NOT_FOUND
        # a producer that does not answer: unavailable after ec.xfer_timeout
        dead = wire.ECParams("x", "127.0.0.1", 9, MiB, (), "uint8", "image", "ec-ok")
        t0 = time.monotonic()
        cons.client.ec_ensure(dead)
        evs = cons.client.wait_events(15)
        assert [type(x).__name__ for x in evs] == ["ECUnavailable"]
        assert evs[0].code == ErrorCode.TIMEOUT and 4.0 < time.monotonic() - t0 < 12
    finally:
        prod.close()
        cons.close()


def test_consumer_daemon_restart_mid_stream(daemons: StartDaemon) -> None:
    from kvd.demo import start_daemon

    e = daemons("kvd-enc", ec_cfg("producer", 32 * MiB))
    c = daemons("kvd-con", ec_cfg("consumer", 32 * MiB))
    prod, cons = ECSide(e.socket, "encoder"), ECSide(c.socket, "consumer")
    restarted = None
    try:
        outs = []
        for i in range(6):
            blocks = prod.client.ec_allocate(f"r{i}", 4 * MiB)
            prod.write(blocks.block_ids, output_bytes(i, 4 * MiB))
            outs.append(prod.client.ec_commit(f"r{i}", 4 * MiB, compat="ec-ok"))
        for p in outs:
            cons.client.ec_ensure(p)
        c.kill()  # mid-stream: some fetches may have completed, the rest are in flight
        restarted = start_daemon(
            c.config.parent,
            "kvd-con",
            ec_cfg("consumer", 32 * MiB),
            overrides=auth_overrides(c.config.parent),
        )
        ended: dict[str, str] = {}
        deadline = time.monotonic() + 15
        while len(ended) < 6 and time.monotonic() < deadline:
            for ev in cons.client.wait_events(0.5):
                ended[ev.mm_hash] = type(ev).__name__
        assert len(ended) == 6, ended  # every outstanding request ended, none hangs
        # the client opens its new session without blocking: it is up a few drains later
        while cons.client.reconnects == 0 and time.monotonic() < deadline:
            cons.client.wait_events(0.1)
        assert cons.client.reconnects == 1
        assert "ECUnavailable" in ended.values()
        # new requests work against the restarted daemon
        fresh = ECSide(restarted.socket, "consumer2")
        try:
            fresh.client.ec_ensure(outs[0])
            (ev,) = fresh.client.wait_events(10)
            assert isinstance(ev, wire.ECReady) and not ev.local_hit
            assert fresh.matches(ev.block_ids, output_bytes(0, 4 * MiB))
        finally:
            fresh.close()
    finally:
        prod.close()
        cons.close()
        if restarted is not None:
            assert restarted.stop() == 0


def test_a_consumer_restarted_under_its_name_and_address_is_handshaken_afresh(
    daemons: StartDaemon,
) -> None:
    """The producer serves a consumer's requests through the view of it it holds, without
    a registrar call, while a request names that view's incarnation (counted). A consumer
    killed and started again under the same name at the same address (its EC region the
    same id; the same generation too when it starts within the same second, since
    generations start from the clock): its request is not served through the view of the
    process that is gone, the producer handshakes afresh, and every byte arrives.
    (`test_bad_xfer_requests_...`: a request naming everything of the consumer but its
    incarnation is refused.)"""
    port = restart_port()  # both consumer incarnations listen here, under one agent name
    side = {"side_channel": {"port": port}}
    e = daemons("kvd-encv", ec_cfg("producer", 16 * MiB))
    c1 = daemons("kvd-conv", ec_cfg("consumer", 16 * MiB), overrides=side)
    prod, cons = ECSide(e.socket, "encoder"), ECSide(c1.socket, "consumer")
    open_sides = [prod, cons]
    old_pid = c1.proc.pid
    try:
        outs = []
        for i in range(3):
            blocks = prod.client.ec_allocate(f"v{i}", 2 * MiB)
            prod.write(blocks.block_ids, output_bytes(20 + i, 2 * MiB))
            outs.append(prod.client.ec_commit(f"v{i}", 2 * MiB, compat="ec-v"))

        def fetch(side: ECSide, i: int) -> None:
            side.client.ec_ensure(outs[i])
            (ev,) = side.client.wait_events(10)
            assert isinstance(ev, wire.ECReady) and not ev.local_hit, ev
            assert side.matches(ev.block_ids, output_bytes(20 + i, 2 * MiB))

        def held() -> int:
            return int(prod.client.status()["counters"].get("ec_consumer_views_held", 0))

        def region(side: ECSide) -> tuple[int, int]:
            r = next(r for r in side.client.status()["regions"] if r["engine_id"] == "kvd-ec")
            return r["region_id"], r["generation"]

        fetch(cons, 0)  # the producer handshakes with the consumer (a registrar call)
        before = held()
        fetch(cons, 1)
        assert held() == before + 1  # served through the view it holds
        first = cons.client.status()
        first_region = region(cons)
        open_sides.remove(cons)
        cons.close()
        c1.kill()
        c2 = daemons("kvd-conv", ec_cfg("consumer", 16 * MiB), overrides=side)
        cons2 = ECSide(c2.socket, "consumer")
        open_sides.append(cons2)
        again = cons2.client.status()
        # the premise: nothing but the incarnation tells the two consumers apart
        assert again["agent_name"] == first["agent_name"]
        assert again["side_channel"] == first["side_channel"]
        assert region(cons2)[0] == first_region[0]
        assert again["incarnation"] != first["incarnation"]
        views = {p["agent"]: p for p in prod.client.status("peers")["peers"]}
        print("producer's view of the consumer:", views.get(first["agent_name"]))
        before = held()
        fetch(cons2, 2)
        assert held() == before  # not through the view of the process that is gone
        views = {p["agent"]: p for p in prod.client.status("peers")["peers"]}
        assert views[again["agent_name"]]["incarnation"] == again["incarnation"]
        fetch(cons2, 0)  # and the new view serves the next request
        assert held() == before + 1
    finally:
        for side_open in open_sides:
            side_open.close()
        for n in shm_segments("kvd-ec-"):  # the killed daemon's region (reaping is off)
            if ec_segment_creator(n) == old_pid:
                os.unlink(f"/dev/shm/{n}")


def test_compat_is_required_and_a_mismatch_names_both_values(daemons: StartDaemon) -> None:
    """No empty compat anywhere: the daemons' own EC regions derive theirs, a commit or an
    ensure without one is refused at the door (counted); a consumer asking under another
    compat than the producer committed gets nothing, and is told both values."""
    e = daemons("kvd-enc", ec_cfg("producer", 16 * MiB))
    c = daemons("kvd-con", ec_cfg("consumer", 16 * MiB))
    prod, cons = ECSide(e.socket, "encoder"), ECSide(c.socket, "consumer")
    try:
        for s in (prod, cons):
            regions = [r for r in s.client.status()["regions"] if r["engine_id"] == "kvd-ec"]
            assert [r["compat"] for r in regions] == [f"kvd-ec:block_bytes={MiB}"]

        blocks = prod.client.ec_allocate("img", 2 * MiB)
        prod.write(blocks.block_ids, output_bytes(5, 2 * MiB))
        before = prod.client.status()["counters"]
        with pytest.raises(InvalidRequest, match="compat must identify the model"):
            prod.client.ec_commit("img", 2 * MiB, compat="")
        after = prod.client.status()["counters"]
        assert after["ec_requests_rejected"] - before.get("ec_requests_rejected", 0) == 1
        assert after.get("ec_committed", 0) == before.get("ec_committed", 0)
        assert prod.client.status("ec")["produced"] == []
        params = prod.client.ec_commit("img", 2 * MiB, compat="model-a")

        # refused by the consumer's own daemon: nothing is asked of the producer
        before = cons.client.status()["counters"]
        cons.client.ec_ensure(replace(params, compat=""))
        (ev,) = cons.client.wait_events(10)
        assert isinstance(ev, wire.ECUnavailable) and ev.code == ErrorCode.INVALID, ev
        assert "compat must identify the model" in ev.reason
        after = cons.client.status()["counters"]
        assert after["ec_requests_rejected"] - before.get("ec_requests_rejected", 0) == 1
        assert after.get("ec_xfer_requests", 0) == before.get("ec_xfer_requests", 0)

        # another compat: the producer refuses, naming both; not a byte arrives
        cons.client.ec_ensure(replace(params, compat="model-b"))
        (ev,) = cons.client.wait_events(10)
        assert isinstance(ev, wire.ECUnavailable) and ev.code == ErrorCode.INCOMPATIBLE, ev
        assert "producer 'model-a' vs consumer 'model-b'" in ev.reason, ev.reason
        assert not cons.buf.any()
        assert prod.client.status()["counters"].get("ec_served", 0) == 0

        # the same compat is served, every byte
        cons.client.ec_ensure(params)
        (ev,) = cons.client.wait_events(10)
        assert isinstance(ev, wire.ECReady), ev
        assert cons.matches(ev.block_ids, output_bytes(5, 2 * MiB))
        cons.client.ec_release("img")
    finally:
        prod.close()
        cons.close()


def test_consumer_cache_serves_an_output_only_under_its_compat(daemons: StartDaemon) -> None:
    """The consumer's cache (and a fetch in flight) holds an output under the compat it was
    fetched with: asking for the same hash under another compat is refused naming both,
    never answered with the other model's bytes."""
    e = daemons("kvd-enc", ec_cfg("producer", 16 * MiB))
    c = daemons("kvd-con", ec_cfg("consumer", 16 * MiB))
    prod, cons = ECSide(e.socket, "encoder"), ECSide(c.socket, "consumer")
    try:
        blocks = prod.client.ec_allocate("img", 2 * MiB)
        prod.write(blocks.block_ids, output_bytes(9, 2 * MiB))
        params = prod.client.ec_commit("img", 2 * MiB, compat="model-a")

        # in flight: both asks go out together, the second joins nothing
        cons.client.ec_ensure(params)
        cons.client.ec_ensure(replace(params, compat="model-b"))
        evs = cons.client.wait_events(10)
        deadline = time.monotonic() + 10
        while len(evs) < 2 and time.monotonic() < deadline:
            evs += cons.client.wait_events(0.5)
        ready = [x for x in evs if isinstance(x, wire.ECReady)]
        refused = [x for x in evs if isinstance(x, wire.ECUnavailable)]
        assert len(ready) == 1 and len(refused) == 1, evs
        assert refused[0].code == ErrorCode.INCOMPATIBLE, refused[0]
        assert "'model-a'" in refused[0].reason and "'model-b'" in refused[0].reason
        assert cons.matches(ready[0].block_ids, output_bytes(9, 2 * MiB))
        cons.client.ec_release("img")

        # cached: a hit only under the same compat
        before = cons.client.status()["counters"]
        cons.client.ec_ensure(replace(params, compat="model-b"))
        (ev,) = cons.client.wait_events(10)
        assert isinstance(ev, wire.ECUnavailable) and ev.code == ErrorCode.INCOMPATIBLE, ev
        assert "cached under 'model-a'" in ev.reason and "'model-b'" in ev.reason, ev.reason
        cons.client.ec_ensure(params)
        (ev,) = cons.client.wait_events(10)
        assert isinstance(ev, wire.ECReady) and ev.local_hit, ev
        cons.client.ec_release("img")
        after = cons.client.status()["counters"]
        assert after["ec_hits"] - before.get("ec_hits", 0) == 1
        assert after["ec_compat_refused"] - before.get("ec_compat_refused", 0) == 1
        assert cons.client.status("ec")["consumer"]["pinned"] == 0
    finally:
        prod.close()
        cons.close()


def test_a_fetch_given_up_on_keeps_its_blocks_until_the_producer_answers(
    daemons: StartDaemon,
) -> None:
    """The producer is frozen (SIGSTOP) while a consumer asks for an output: the consumer
    gives up at ec.xfer_timeout (the engine is told at once), but the blocks it had given
    that fetch stay quarantined, not freed: the producer, resumed, still serves the
    request (NIXL cannot take back a request or a WRITE). Only its answer frees them; the
    output is then fetched again and every byte checked, and nothing stays pinned."""
    import signal

    xfer = 2.0
    cfg = ec_cfg("producer", 16 * MiB).replace("xfer_timeout = 5.0", f"xfer_timeout = {xfer}")
    e = daemons("kvd-encq", cfg)
    c = daemons("kvd-conq", ec_cfg("consumer", 16 * MiB).replace("5.0", str(xfer)))
    prod, cons = ECSide(e.socket, "encoder"), ECSide(c.socket, "consumer")
    try:
        data = output_bytes(3, 2 * MiB)
        blocks = prod.client.ec_allocate("frozen", len(data))
        prod.write(blocks.block_ids, data)
        params = prod.client.ec_commit(
            "frozen", len(data), shape=(len(data),), dtype="uint8", compat="ec-q"
        )
        e.proc.send_signal(signal.SIGSTOP)
        try:
            cons.client.ec_ensure(params)
            (ev,) = cons.client.wait_events(xfer + 10)
            assert isinstance(ev, wire.ECUnavailable) and ev.code == ErrorCode.TIMEOUT, ev
            st = cons.client.status("ec")
            assert st["consumer"]["pinned"] == 2  # quarantined, not freed
            assert cons.client.status()["counters"]["ec_quarantined"] == 1
            # asked again meanwhile: refused at once (busy), never handed those blocks
            cons.client.ec_ensure(params)
            (ev,) = cons.client.wait_events(5)
            assert isinstance(ev, wire.ECUnavailable) and ev.code == ErrorCode.BUSY, ev
        finally:
            e.proc.send_signal(signal.SIGCONT)
        deadline = time.monotonic() + 15
        while cons.client.status("ec")["consumer"]["pinned"]:
            assert time.monotonic() < deadline, "quarantine never released"
            time.sleep(0.1)
        counters = cons.client.status()["counters"]
        assert counters["ec_quarantine_released_answered"] == 1
        assert "ec_quarantine_released_bound" not in counters
        cons.client.ec_ensure(params)
        (ev,) = cons.client.wait_events(10)
        assert isinstance(ev, wire.ECReady), ev
        assert cons.matches(ev.block_ids, data)
        cons.client.ec_release("frozen")
        assert cons.client.status("ec")["consumer"]["pinned"] == 0
    finally:
        if e.proc.poll() is None:
            e.proc.send_signal(signal.SIGCONT)
        prod.close()
        cons.close()


def test_a_quarantined_fetch_is_released_once_its_restarted_producer_answers_the_cancel(
    daemons: StartDaemon,
) -> None:
    """The producer takes a request and dies before answering it (frozen, then SIGKILLed),
    and systemd starts it again 2 s later on the same port. The consumer gave up on the
    fetch and quarantined its blocks; the new producer never heard of the request, so no
    answer to it will ever come: the consumer's cancels (`ECXferCancel`, one a second)
    reach the new producer, which answers that it serves nothing under that nonce, and
    the blocks are freed within seconds, not at the quarantine's bound (over a minute
    with the default transfer timeout). The output, encoded again at the new producer,
    is fetched and every byte checked; nothing stays pinned."""
    import signal

    port = restart_port()  # both incarnations bind it
    xfer = 2.0
    e_cfg = ec_cfg("producer", 16 * MiB).replace("5.0", str(xfer)) + f"port = {port}\n"
    e = daemons("kvd-encr", e_cfg)
    c = daemons("kvd-conr", ec_cfg("consumer", 16 * MiB).replace("5.0", str(xfer)))
    prod, cons = ECSide(e.socket, "encoder"), ECSide(c.socket, "consumer")
    old_pid = e.proc.pid
    prod2: ECSide | None = None
    try:
        data = output_bytes(5, 2 * MiB)

        def encode(side: ECSide) -> wire.ECParams:
            blocks = side.client.ec_allocate("lost", len(data))
            side.write(blocks.block_ids, data)
            return side.client.ec_commit(
                "lost", len(data), shape=(len(data),), dtype="uint8", compat="ec-r"
            )

        params = encode(prod)
        prod.close()
        e.proc.send_signal(signal.SIGSTOP)  # the request reaches its socket, never it
        cons.client.ec_ensure(params)
        (ev,) = cons.client.wait_events(xfer + 10)
        assert isinstance(ev, wire.ECUnavailable) and ev.code == ErrorCode.TIMEOUT, ev
        assert cons.client.status("ec")["consumer"]["pinned"] == 2  # quarantined
        e.kill()
        time.sleep(2.0)
        t_restart = time.monotonic()
        e2 = daemons("kvd-encr", e_cfg)
        deadline = t_restart + 10.0
        while cons.client.status("ec")["consumer"]["pinned"]:
            assert time.monotonic() < deadline, "quarantine not released after the restart"
            time.sleep(0.1)
        counters = cons.client.status()["counters"]
        assert counters["ec_quarantine_released_answered"] == 1, counters
        assert "ec_quarantine_released_bound" not in counters
        assert counters["ec_cancels_sent"] >= 1
        prod2 = ECSide(e2.socket, "encoder")
        assert prod2.client.status()["counters"]["ec_cancels_answered"] >= 1
        params = encode(prod2)
        cons.client.ec_ensure(params)
        (ev,) = cons.client.wait_events(10)
        assert isinstance(ev, wire.ECReady), ev
        assert cons.matches(ev.block_ids, data)
        cons.client.ec_release("lost")
        assert cons.client.status("ec")["consumer"]["pinned"] == 0
    finally:
        e.kill()
        for side in (prod2, cons):
            if side is not None:
                side.close()
        for n in shm_segments("kvd-ec-"):  # the killed daemon's region (reaping is off)
            if ec_segment_creator(n) == old_pid:
                os.unlink(f"/dev/shm/{n}")


def test_a_drain_refuses_new_encoder_cache_transfers_and_waits_for_those_in_flight(
    daemons: StartDaemon,
) -> None:
    """`kvd drain` covers the encoder cache: a draining consumer starts no new fetch
    (refused at once: the engine encodes locally) but serves local hits and waits for a
    fetch in flight (the producer frozen meanwhile) before it says drained; a draining
    producer refuses a consumer's new request (SHUTTING_DOWN)."""
    import signal

    from kvd_client.client import KvdClient

    e = daemons("kvd-ecdr-e", ec_cfg("producer", 16 * MiB))
    c = daemons("kvd-ecdr-c", ec_cfg("consumer", 16 * MiB))
    c2 = daemons("kvd-ecdr-c2", ec_cfg("consumer", 16 * MiB))
    prod, cons, cons2 = ECSide(e.socket, "encoder"), ECSide(c.socket, "consumer"), None

    def drain(socket: str) -> dict[str, object]:
        with KvdClient(socket, role="cli", timeout=5.0, keepalive_interval=0) as cli:
            reply = cli.request(wire.Drain(30.0, False))
            assert isinstance(reply, wire.StatusReply)
            return reply.data

    def drain_state(side: ECSide) -> object:
        return side.client.status("drain")["state"]

    try:
        outputs = {}
        for i, name in enumerate(("in-flight", "refused", "at-producer")):
            data = output_bytes(10 + i, MiB + 4096 * i)
            blocks = prod.client.ec_allocate(name, len(data))
            prod.write(blocks.block_ids, data)
            params = prod.client.ec_commit(
                name, len(data), shape=(len(data),), dtype="uint8", compat="ec-dr"
            )
            outputs[name] = (data, params)
        e.proc.send_signal(signal.SIGSTOP)
        try:
            cons.client.ec_ensure(outputs["in-flight"][1])
            deadline = time.monotonic() + 5
            while cons.client.status("ec")["consumer"]["pinned"] == 0:  # the fetch is out
                assert time.monotonic() < deadline
                time.sleep(0.02)
            started = drain(c.socket)
            assert started["state"] == "draining", started
            assert started["encoder_cache"] == {"count": 1, "serving": 0, "fetching": 1}
            cons.client.ec_ensure(outputs["refused"][1])
            (ev,) = cons.client.wait_events(5)
            assert isinstance(ev, wire.ECUnavailable) and ev.code == ErrorCode.SHUTTING_DOWN, ev
            assert "draining" in ev.reason
            time.sleep(0.3)
            assert drain_state(cons) == "draining"  # the fetch in flight holds it
        finally:
            e.proc.send_signal(signal.SIGCONT)
        (ev,) = cons.client.wait_events(10)
        assert isinstance(ev, wire.ECReady) and ev.mm_hash == "in-flight", ev
        assert cons.matches(ev.block_ids, outputs["in-flight"][0])
        deadline = time.monotonic() + 5
        while drain_state(cons) != "drained":
            assert time.monotonic() < deadline, cons.client.status("drain")
            time.sleep(0.05)
        # a local hit is no new transfer: still served while drained
        cons.client.ec_release("in-flight")
        cons.client.ec_ensure(outputs["in-flight"][1])
        (ev,) = cons.client.wait_events(5)
        assert isinstance(ev, wire.ECReady) and cons.matches(ev.block_ids, outputs["in-flight"][0])
        cons.client.ec_release("in-flight")
        counters = cons.client.status()["counters"]
        assert counters["ec_fetches_refused_draining"] == 1
        # the producer drains: a consumer's new request is refused there
        assert drain(e.socket)["state"] in ("draining", "drained")
        cons2 = ECSide(c2.socket, "consumer2")
        cons2.client.ec_ensure(outputs["at-producer"][1])
        (ev,) = cons2.client.wait_events(10)
        assert isinstance(ev, wire.ECUnavailable) and ev.code == ErrorCode.SHUTTING_DOWN, ev
        assert "producer is draining" in ev.reason
        assert prod.client.status()["counters"]["ec_xfer_refused_draining"] == 1
        deadline = time.monotonic() + 5
        while drain_state(prod) != "drained":  # nothing was in flight: at its next check
            assert time.monotonic() < deadline, prod.client.status("drain")
            time.sleep(0.05)
    finally:
        if e.proc.poll() is None:
            e.proc.send_signal(signal.SIGCONT)
        prod.close()
        cons.close()
        if cons2 is not None:
            cons2.close()


PRODUCER = """
import sys, time
from kvd_client.client import KvdClient
c = KvdClient(sys.argv[1], role="scheduler", engine_id="encoder", keepalive_interval=0.2)
c.connect()
c.ec_allocate(sys.argv[2], 3 << 20)
print("allocated", flush=True)
if sys.argv[3] == "commit-on-input":  # frozen past its session, then commits (anew)
    sys.stdin.readline()
    c = KvdClient(sys.argv[1], role="scheduler", engine_id="encoder")
    c.connect()
    c.ec_commit(sys.argv[2], 3 << 20, shape=(3 << 20,), compat="kvd-test")
    print("committed", flush=True)
time.sleep(600)
"""


def test_an_allocation_whose_producer_is_gone_is_freed_and_one_it_may_still_write_is_kept(
    daemons: StartDaemon,
) -> None:
    """An output allocated (its blocks pinned for the producer engine's writes) and never
    committed: freed when the producer's session ends with its process (killed), so its
    blocks and its hash can be used again; kept out of use while the producer may still
    write into it (frozen past its session: it is alive), and freed once it is killed; a
    producer that comes back and commits it has it committed. Before, every such
    allocation stayed pinned for good, and its hash could never be allocated again."""
    import signal
    import subprocess
    import sys

    e = daemons(
        "kvd-ec-alloc",
        ec_cfg("producer", 16 * MiB),
        overrides={"daemon": {"client_timeout": 1.0}},
    )

    def producer(mm_hash: str, mode: str = "") -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            [sys.executable, "-c", PRODUCER, e.socket, mm_hash, mode],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None and proc.stdout.readline().strip() == "allocated"
        return proc

    side = ECSide(e.socket, "encoder-2")

    def ec() -> dict[str, object]:
        return side.client.status("ec")

    def wait(cond: Callable[[], bool], seconds: float = 10.0) -> None:
        end = time.monotonic() + seconds
        while not cond():
            assert time.monotonic() < end, ec()
            time.sleep(0.05)

    try:
        killed = producer("img-killed")
        assert ec()["producer"]["pinned"] == 3 and ec()["allocated"] == 1
        killed.kill()
        killed.wait()
        wait(lambda: ec()["producer"]["pinned"] == 0 and ec()["allocated"] == 0)
        side.client.ec_allocate("img-killed", 1 << 20)  # its hash can be allocated again

        frozen = producer("img-frozen")
        frozen.send_signal(signal.SIGSTOP)
        wait(lambda: ec()["orphaned"] == ["img-frozen"])  # its session timed out
        time.sleep(1.5)
        assert ec()["producer"]["pinned"] >= 3  # still out of use: it may write yet
        with pytest.raises(InvalidRequest, match="already allocated"):
            side.client.ec_allocate("img-frozen", 1 << 20)
        frozen.kill()
        frozen.wait()
        wait(lambda: ec()["orphaned"] == [] and "img-frozen" not in str(ec()["produced"]))

        back = producer("img-back", "commit-on-input")
        back.send_signal(signal.SIGSTOP)
        wait(lambda: ec()["orphaned"] == ["img-back"])
        back.send_signal(signal.SIGCONT)
        assert back.stdin is not None and back.stdout is not None
        back.stdin.write("go\n")
        back.stdin.flush()
        assert back.stdout.readline().strip() == "committed"
        assert ec()["orphaned"] == [] and "img-back" in ec()["produced"]
        back.kill()
        back.wait()
    finally:
        side.close()
