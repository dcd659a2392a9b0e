"""Peers named by host name, end to end: the daemon resolves names itself
(`kvd.adapters.resolve`) and hands libzmq numeric addresses, on every path that dials a
peer: KV push and pull (the handshake with P by the engine's `peer_host`), the encoder
cache (the producer's advertised host in `ec_transfer_params`), and the KV tiers'
peers (`tiers.peers`). Every byte is checked."""

from __future__ import annotations

import random
import time

from kvd_client.tiers import TierClient

from kvd.demo import make_engine, run_mode
from kvd.ecdemo import ECSide, run_ec

from .conftest import StartDaemon

HOST = "localhost"
MiB = 1 << 20
NS = b"kvd-test-hostnames"
BB = 64 * 1024


def named(extra: dict[str, dict[str, object]] | None = None) -> dict[str, dict[str, object]]:
    """A daemon bound to 127.0.0.1 that tells its peers to reach it as `localhost`."""
    cfg: dict[str, dict[str, object]] = {
        "side_channel": {"host": "127.0.0.1", "advertise_host": HOST}
    }
    for section, values in (extra or {}).items():
        cfg.setdefault(section, {}).update(values)
    return cfg


def block(i: int) -> bytes:
    return bytes([i % 251]) * BB


def test_push_pull_ec_and_tier_peers_by_host_name(daemons: StartDaemon) -> None:
    p = daemons("kvd-hn-p", overrides=named({"tiers": {"enabled": True, "host_bytes": 16 * BB}}))
    d = daemons(
        "kvd-hn-d",
        overrides=named(
            {"tiers": {"enabled": True, "host_bytes": 16 * BB, "peers": f"{HOST}:{p.side_port}"}}
        ),
    )
    pe = make_engine(p.socket, "prefill", num_blocks=64, num_layers=2, chunk_bytes=4096)
    de = make_engine(d.socket, "decode", num_blocks=64, num_layers=2, chunk_bytes=4096)
    try:
        for mode in ("push", "pull"):
            res = run_mode(mode, pe, de, p.side_port, 6, random.Random(1), p_host=HOST)
            assert (res.verified, res.failed, res.mismatched) == (6, 0, 0), res.summary()
        # D resolved the name itself (libzmq got a number), once: then from its cache
        resolver = de.client.status()["registrar"]["resolver"]
        assert resolver["lookups"] >= 1 and resolver["failures"] == 0, resolver
        # each rings the other's doorbell: D at the name it dialed (resolved), P at the
        # name D's handshake gave (from its resolver's cache, else looked up in the
        # background: the handshake does not wait for it)
        assert de.client.status()["nixl"]["doorbell_peers"] == 1
        deadline = time.monotonic() + 10
        while pe.client.status()["nixl"]["doorbell_peers"] != 1:
            assert time.monotonic() < deadline, "P never rang D's doorbell by its name"
            time.sleep(0.05)
    finally:
        pe.close()
        de.close()

    keys = [i.to_bytes(8, "big") for i in range(4)]
    with TierClient(p.socket, NS, BB) as c:  # stored at P, loaded at D from its peer P
        assert c.store(keys, [memoryview(block(i)) for i in range(4)]) == [True] * 4
    with TierClient(d.socket, NS, BB) as c:
        end = time.monotonic() + 20.0  # D dials its configured peer by name, then asks it
        while not c.stats()["peer"]["asked"]:
            assert time.monotonic() < end, c.stats()["peer"]
            time.sleep(0.1)
        assert c.batch_lookup(keys) == [True] * 4  # found on the peer
        dests = [bytearray(BB) for _ in range(4)]
        got = c.load(keys, [memoryview(x) for x in dests])
        assert got == [True] * 4 and [bytes(x) for x in dests] == [block(i) for i in range(4)]
        assert c.stats()["peer"]["blocks_loaded"] == 4

    ec = '[ec]\nrole = "{}"\nregion_bytes = {}\nblock_bytes = 1048576\nxfer_timeout = 5.0\n'
    e = daemons("kvd-hn-e", ec.format("producer", 16 * MiB), overrides=named())
    co = daemons("kvd-hn-c", ec.format("consumer", 16 * MiB), overrides=named())
    prod, cons = ECSide(e.socket, "encoder"), ECSide(co.socket, "consumer")
    try:
        out = run_ec(prod, cons, 12, random.Random(2), max_bytes=2 * MiB)
        assert (out.verified, out.mismatched, out.failed) == (12, 0, 0), out.failures
        resolver = cons.client.status()["registrar"]["resolver"]
        assert resolver["lookups"] >= 1 and resolver["failures"] == 0, resolver
    finally:
        prod.close()
        cons.close()
