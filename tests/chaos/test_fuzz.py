"""Live fuzzing (`kvd.fuzz`): random and mutated frames at a running daemon's IPC
socket, side channel and EC router, and as notifications from a rogue NIXL agent,
while a good client's transfers go on with every byte verified; then well-formed messages
from clients with sessions, after which nothing of theirs may be left.

20,000 frames here (5,000 per surface, and 5,000 session messages);
`KVD_FUZZ_FRAMES=100000` (or `kvd chaos --fuzz`) for the full run. The offline
classifier is checked against the decoder first: the counts the live run asserts rest
on it.
"""

from __future__ import annotations

import contextlib
import os
import random

import pytest
from kvd_client import wire
from kvd_client.errors import RemoteProtocolError

from kvd.fuzz import SURFACES, WITHHELD, classify, golden_frames, mutate, run_fuzz

pytestmark = pytest.mark.serial  # a flood of frames at live daemons

FRAMES = int(os.environ.get("KVD_FUZZ_FRAMES", "20000"))
"""Frames in all, shared evenly by the surfaces."""


def test_mutations_are_deterministic_by_seed_and_varied() -> None:
    seeds = golden_frames()
    rng1, rng2 = random.Random(7), random.Random(7)
    a = [mutate(rng1, seeds) for _ in range(500)]
    b = [mutate(rng2, seeds) for _ in range(500)]
    assert a == b
    assert len(set(a)) > 400
    decodable = 0
    for f in a:
        try:
            wire.decode(f)
            decodable += 1
        except RemoteProtocolError:
            pass
    assert 25 < decodable < 475, decodable  # both kinds, in numbers


def test_classifier_follows_each_surfaces_rule() -> None:
    hello = wire.encode(wire.Hello("s", "scheduler", "e", -1, 1, "v"), 3)
    root = wire.encode(wire.Hello("s", "root", "e", -1, 1, "v"), 3)
    status = wire.encode(wire.GetStatus("status"), 4)
    probe = wire.encode(wire.Probe(1, False))
    garbage = b"\xc1 not msgpack"
    assert classify("ipc", hello) == (WITHHELD,)
    assert classify("ipc", root) == ("ipc_rejected",)
    assert classify("ipc", status) == ("ipc_rejected",)
    assert classify("ipc", garbage) == ("ipc_rejected",)
    assert classify("side", status) == ("side_rejected",)
    drop = wire.encode(wire.RegionDropped("a", 1, 1, 0.0, b""))
    assert classify("side", drop) == ("side_auth_rejected",)
    query = wire.encode(wire.TraceQuery("a", (), 0, bytes(16), 0.0, b""))
    assert classify("side", query) == ("auth_rejected",)
    assert classify("ec", status) == ("ec_xfer_rejected",)
    req = wire.encode(wire.ECXferReq("h", "", "a", "127.0.0.1", 1, 1, 1, (0,)))
    assert classify("ec", req) == ("ec_auth_rejected",)
    assert classify("notif", probe) == ("notifs_rejected",)
    assert classify("notif", b"") == (WITHHELD,)
    assert classify("notif", garbage) == ("notifs_malformed",)
    assert classify("notif", wire.encode(wire.Heartbeat(("x",)))) == ("notifs_rejected",)


def test_the_decoder_raises_one_error_type_on_every_mutation() -> None:
    """The daemon's loops catch RemoteProtocolError only: anything else would end them."""
    seeds = golden_frames()
    rng = random.Random(11)
    for _ in range(20_000):
        f = mutate(rng, seeds)
        with contextlib.suppress(RemoteProtocolError):
            wire.decode(f)


@pytest.mark.timeout(600)
def test_live_fuzzing_is_rejected_and_counted_exactly_while_a_good_client_is_served() -> None:
    out = run_fuzz(FRAMES, seed=int(os.environ.get("KVD_CHAOS_SEED", "0")))
    print(out)
    assert out["ok"], out["problems"]
    assert out["crashes"] == 0
    assert out["frames"] == FRAMES
    for s in SURFACES:
        got = out["surfaces"][s]
        assert got["frames"] >= FRAMES // len(SURFACES) and got["ok"], (s, got)
        assert sum(got["predicted"].values()) >= got["frames"], (s, got)
    assert out["good_rounds"] >= 2 and out["good_verified"] >= 8
    # clients with sessions sent well-formed messages to the actors behind the gateway:
    # X kept answering new clients, and nothing of theirs was left once they were gone
    s = out["sessions"]
    assert s["messages"] >= FRAMES // 4 and not s["problems"], s
    assert s["slowest_hello_s"] < 2.0 and s["left"] == [], s
    assert {"Pull", "RegisterPush", "Finish", "TierPin", "ECAllocate"} <= set(s["kinds"]), s
