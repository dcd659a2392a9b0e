"""MACs over peer messages and the replay guard (no sockets, no clocks)."""

from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import pytest
from kvd_client import wire

from kvd.core.peerauth import (
    Refusal,
    ReplayGuard,
    mac_valid,
    message_mac,
)

SECRET = b"a shared secret"
REQ = wire.ECXferReq(
    mm_hash="mm-1",
    compat="model-a",
    agent_name="kvd-consumer",
    side_host="10.0.0.8",
    side_port=5600,
    dst_region=3,
    dst_generation=11,
    dst_block_ids=(4, 5, 6),
    timestamp=1_795_000_000.0,
    nonce=bytes(range(16)),
)


def signed(req: wire.ECXferReq, secret: bytes = SECRET) -> wire.ECXferReq:
    return replace(req, mac=message_mac(secret, req, b"ecxfer"))


def test_a_mac_covers_every_field_and_its_context() -> None:
    good = signed(REQ)
    assert len(good.mac) == 32 and mac_valid(SECRET, good, b"ecxfer")
    assert message_mac(SECRET, good, b"ecxfer") == good.mac  # the mac field itself is not covered
    assert not mac_valid(SECRET, REQ, b"ecxfer")  # no MAC
    assert not mac_valid(b"another secret", good, b"ecxfer")
    assert not mac_valid(SECRET, good, b"req")  # made for EC requests only
    changes: dict[str, Any] = {
        "mm_hash": "mm-2",
        "compat": "model-b",
        "agent_name": "kvd-other",
        "side_host": "10.0.0.9",
        "side_port": 5601,
        "dst_region": 4,
        "dst_generation": 12,
        "dst_block_ids": (4, 5, 7),
        "timestamp": REQ.timestamp + 1,
        "nonce": bytes(16),
        "serve_by_ns": REQ.serve_by_ns + 1,  # a deadline moved under its MAC is refused
        "incarnation": REQ.incarnation + 1,  # nor a view of another consumer process
    }
    assert set(changes) | {"mac"} == {f for f in REQ.__dataclass_fields__}
    for name, value in changes.items():
        assert not mac_valid(SECRET, replace(good, **{name: value}), b"ecxfer"), name


def test_a_nonce_is_admitted_once_while_fresh() -> None:
    g = ReplayGuard(window=10.0, capacity=100)
    assert g.admit(b"a" * 16, 1000.0, 1000.0) is None
    assert g.admit(b"a" * 16, 1000.0, 1001.0) is Refusal.REPLAYED
    assert g.admit(b"b" * 16, 1000.0, 1001.0) is None
    # stale on both sides of our clock, at the window's edge exactly
    assert g.admit(b"c" * 16, 990.0, 1000.0) is Refusal.STALE
    assert g.admit(b"c" * 16, 1010.0, 1000.0) is Refusal.STALE
    assert g.admit(b"c" * 16, 1009.9, 1000.0) is None
    # once its message is stale a nonce is forgotten: a replay is then refused as stale
    assert g.admit(b"a" * 16, 1000.0, 1010.0) is Refusal.STALE
    assert len(g) == 1  # only "c" (timestamp 1009.9) is still held


def test_a_clock_stepped_back_does_not_revive_a_forgotten_nonce() -> None:
    g = ReplayGuard(window=10.0, capacity=100)
    assert g.admit(b"a" * 16, 1000.0, 1000.0) is None
    assert g.admit(b"b" * 16, 1020.0, 1020.0) is None  # "a" is forgotten now
    assert len(g) == 1
    # our clock steps back to 1005: "a"'s timestamp is within 10 s of it, yet refused
    assert g.admit(b"a" * 16, 1000.0, 1005.0) is Refusal.STALE


def test_a_message_made_before_the_guard_existed_is_stale() -> None:
    g = ReplayGuard(window=10.0, capacity=100, not_before=1000.0)
    assert g.admit(b"a" * 16, 999.9, 1000.5) is Refusal.STALE  # fresh, but made before us
    assert g.admit(b"a" * 16, 1000.0, 1000.5) is None


def test_a_full_guard_refuses_instead_of_forgetting() -> None:
    g = ReplayGuard(window=10.0, capacity=3)
    for i in range(3):
        assert g.admit(bytes([i]) * 16, 1000.0 + i, 1000.0) is None
    assert g.admit(b"x" * 16, 1000.0, 1000.0) is Refusal.FULL
    assert g.admit(bytes([0]) * 16, 1000.0, 1000.0) is Refusal.REPLAYED  # still held
    assert len(g) == 3
    assert g.admit(b"x" * 16, 1005.0, 1010.0) is None  # the first went stale: room again
    assert len(g) == 3


def test_bad_parameters() -> None:
    with pytest.raises(ValueError):
        ReplayGuard(window=0.0, capacity=1)
    with pytest.raises(ValueError):
        ReplayGuard(window=1.0, capacity=0)


def test_random_traffic_against_a_model() -> None:
    """A captured message (the same nonce and timestamp) is never admitted twice; a fresh,
    new one is admitted while there is room; memory never exceeds the capacity."""
    rng = random.Random(7)
    window, capacity = 5.0, 40
    g = ReplayGuard(window, capacity)
    admitted: list[tuple[bytes, float]] = []
    ever: set[tuple[bytes, float]] = set()
    now = high = 0.0
    for _ in range(20_000):
        now += rng.choice((0.0, 0.01, 0.1, 1.0, -0.5))  # a clock that sometimes steps back
        high = max(high, now)
        if admitted and rng.random() < 0.4:
            nonce, ts = rng.choice(admitted[-100:])  # a replay of a captured message
        else:
            nonce, ts = rng.randbytes(16), now + rng.uniform(-1.5 * window, 1.5 * window)
        got = g.admit(nonce, ts, now)
        if abs(now - ts) >= window or ts <= high - window:
            assert got is Refusal.STALE
        elif (nonce, ts) in ever:
            assert got is Refusal.REPLAYED
        elif got is None:
            admitted.append((nonce, ts))
            ever.add((nonce, ts))
        else:
            assert got is Refusal.FULL
            assert sum(1 for _, t in admitted if t + window > high) >= capacity
        assert len(g) <= capacity
    assert len(ever) > 1000  # the guard was exercised, not merely full
