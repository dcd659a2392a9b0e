"""Session keys, sealed envelopes and the anti-replay window (no sockets, no clocks)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from kvd_client import wire

from kvd.core.peersession import (
    KEY_GRACE_S,
    MAX_KEYS_PER_PEER,
    AuthRefusal,
    Keyring,
    Party,
    ReplayWindow,
    Verdict,
    derive_session,
)

SECRET = b"a shared secret"
P = Party("kvd-p", 0x1111, b"p" * 16)
D = Party("kvd-d", 0x2222, b"d" * 16)
BODY = wire.encode(wire.Heartbeat(("req-1", "req-2")))


def pair(secret: bytes = SECRET) -> tuple[Keyring, Keyring]:
    """D dialed P: both installed the key of that handshake."""
    p, d = Keyring("kvd-p"), Keyring("kvd-d")
    key = derive_session(secret, dialer=D, acceptor=P)
    d.install("kvd-p", key, 0.0)
    p.install("kvd-d", key, 0.0)
    return p, d


def test_both_sides_derive_one_key_and_every_input_changes_it() -> None:
    key = derive_session(SECRET, dialer=D, acceptor=P)
    assert key == derive_session(SECRET, dialer=D, acceptor=P)
    assert len(key.key_id) == 16 and key.from_dialer != key.from_acceptor
    others = [
        derive_session(b"another secret", dialer=D, acceptor=P),
        derive_session(SECRET, dialer=P, acceptor=D),  # the other side dialed
        derive_session(SECRET, dialer=replace(D, incarnation=0x2223), acceptor=P),  # restart
        derive_session(SECRET, dialer=replace(D, nonce=b"e" * 16), acceptor=P),
        derive_session(SECRET, dialer=D, acceptor=replace(P, nonce=b"q" * 16)),
        derive_session(SECRET, dialer=replace(D, agent="kvd-x"), acceptor=P),
    ]
    for other in others:
        assert other.key_id != key.key_id
        assert {other.from_dialer, other.from_acceptor}.isdisjoint(
            {key.from_dialer, key.from_acceptor}
        )
    # names and nonces are length-prefixed: moving a byte between them is another transcript
    a = derive_session(SECRET, dialer=Party("ab", 1, b"c" * 16), acceptor=P)
    b = derive_session(SECRET, dialer=Party("a", 1, b"bc" + b"c" * 14), acceptor=P)
    assert a.key_id != b.key_id


def test_a_sealed_message_opens_once_and_only_at_its_peer() -> None:
    p, d = pair()
    env = d.seal("kvd-p", BODY, 1.0)
    assert env is not None and env.counter == 1
    assert wire.decode(wire.encode(env))[1] == env  # a wire record like any other
    assert p.open(env, 1.0, "kvd-d") == ("kvd-d", BODY)
    assert p.open(env, 1.0, "kvd-d") is AuthRefusal.REPLAYED
    # it cannot be reflected back to its sender (each direction has its own key)
    assert d.open(env, 1.0, "kvd-p") is AuthRefusal.BAD_MAC
    # another agent cannot pass it off as its own
    env2 = d.seal("kvd-p", BODY, 1.0)
    assert env2 is not None and env2.counter == 2
    assert p.open(env2, 1.0, "kvd-x") is AuthRefusal.WRONG_PEER
    assert p.open(env2, 1.0, "kvd-d") == ("kvd-d", BODY)  # the refusal did not spend it


@pytest.mark.parametrize("field", ["key_id", "counter", "body", "mac"])
def test_any_change_to_an_envelope_is_refused_and_moves_nothing(field: str) -> None:
    p, d = pair()
    env = d.seal("kvd-p", BODY, 1.0)
    assert env is not None
    changed = {
        "key_id": bytes(16),
        "counter": env.counter + 1,
        "body": BODY + b"\0",
        "mac": bytes(32),
    }[field]
    want = AuthRefusal.UNKNOWN_KEY if field == "key_id" else AuthRefusal.BAD_MAC
    assert p.open(replace(env, **{field: changed}), 1.0, "kvd-d") is want
    assert p.open(env, 1.0, "kvd-d") == ("kvd-d", BODY)


def test_without_the_secret_nothing_opens() -> None:
    p, _ = pair()
    _, thief = pair(b"a guessed secret")
    env = thief.seal("kvd-p", BODY, 1.0)
    assert env is not None
    assert p.open(env, 1.0, "kvd-d") is AuthRefusal.UNKNOWN_KEY  # other key, other id
    # even with the right key id (it travels in clear), the MAC fails
    p2, d2 = pair()
    real = d2.seal("kvd-p", BODY, 1.0)
    assert real is not None
    forged = replace(env, key_id=real.key_id)
    assert p2.open(forged, 1.0, "kvd-d") is AuthRefusal.BAD_MAC


def test_a_restarted_peer_gets_a_new_key_and_old_messages_fail() -> None:
    p, d = pair()
    old = d.seal("kvd-p", BODY, 1.0)
    assert old is not None
    # D restarts: P forgets it, and the new incarnation's handshake gives a new key
    p.forget("kvd-d")
    assert p.open(old, 2.0, "kvd-d") is AuthRefusal.UNKNOWN_KEY
    d2 = Keyring("kvd-d")
    key2 = derive_session(
        SECRET, dialer=replace(D, incarnation=0x3333, nonce=b"n" * 16), acceptor=P
    )
    d2.install("kvd-p", key2, 2.0)
    p.install("kvd-d", key2, 2.0)
    new = d2.seal("kvd-p", BODY, 2.0)
    assert new is not None and new.counter == 1
    assert p.open(old, 2.0, "kvd-d") is AuthRefusal.UNKNOWN_KEY
    assert p.open(new, 2.0, "kvd-d") == ("kvd-d", BODY)


def test_the_acceptor_switches_keys_only_once_the_dialer_used_the_new_one() -> None:
    p, d = pair()
    first = derive_session(SECRET, dialer=D, acceptor=P).key_id
    # P dials D again (a stale view): P uses the new key at once, D keeps the old one
    # until a message under the new one arrives
    key2 = derive_session(SECRET, dialer=replace(P, nonce=b"r" * 16), acceptor=D)
    d.install("kvd-p", key2, 5.0)
    env = d.seal("kvd-p", BODY, 5.0)
    assert env is not None and env.key_id == first
    p.install("kvd-d", key2, 5.0)
    from_p = p.seal("kvd-d", BODY, 5.0)
    assert from_p is not None and from_p.key_id == key2.key_id
    assert p.open(env, 5.0, "kvd-d") == ("kvd-d", BODY)  # the old key still opens
    assert d.open(from_p, 5.0, "kvd-p") == ("kvd-p", BODY)
    env = d.seal("kvd-p", BODY, 6.0)
    assert env is not None and env.key_id == key2.key_id
    # P keeps the old key until D sends under the new one (D may never have switched)
    late = Keyring("kvd-d")
    late.install("kvd-p", derive_session(SECRET, dialer=D, acceptor=P), 0.0)
    sealed = [late.seal("kvd-p", BODY, 0.0) for _ in range(5)]  # D's old key, counters 1..5
    in_flight, stale = sealed[3], sealed[4]
    assert in_flight is not None and stale is not None and stale.counter == 5
    assert p.next_deadline() is None
    assert p.open(env, 7.0, "kvd-d") == ("kvd-d", BODY)  # now it has switched for good
    # a message under the replaced key still opens for KEY_GRACE_S, then never
    assert p.next_deadline() == 7.0 + KEY_GRACE_S
    assert p.open(in_flight, 7.0 + KEY_GRACE_S - 0.1, "kvd-d") == ("kvd-d", BODY)
    assert p.open(stale, 7.0 + KEY_GRACE_S, "kvd-d") is AuthRefusal.UNKNOWN_KEY
    from_p = p.seal("kvd-d", BODY, 8.0)
    assert from_p is not None and from_p.key_id == key2.key_id


def test_keys_per_peer_are_bounded_and_a_key_is_ours_or_refused() -> None:
    p = Keyring("kvd-p")
    for i in range(MAX_KEYS_PER_PEER + 3):
        key = derive_session(SECRET, dialer=replace(P, nonce=bytes([i]) * 16), acceptor=D)
        p.install("kvd-d", key, float(i))
    assert p.snapshot()["kvd-d"]["keys"] == MAX_KEYS_PER_PEER
    with pytest.raises(ValueError, match="not ours"):
        p.install("kvd-x", derive_session(SECRET, dialer=D, acceptor=P), 0.0)
    assert Keyring("kvd-p").seal("kvd-d", BODY, 0.0) is None  # no key: nothing is sent


def test_the_window_admits_any_order_within_it() -> None:
    w = ReplayWindow(8)
    assert [w.handle(c) for c in (3, 1, 2, 3)] == [
        Verdict.FRESH,
        Verdict.FRESH,
        Verdict.FRESH,
        Verdict.REPLAYED,
    ]
    assert w.handle(0) is Verdict.TOO_OLD  # counters start at 1
    assert w.handle(20) is Verdict.FRESH
    assert w.handle(12) is Verdict.TOO_OLD  # 8 behind the top
    assert w.handle(13) is Verdict.FRESH
    assert w.check(13) is Verdict.REPLAYED and w.check(14) is Verdict.FRESH
    assert w.handle(1000) is Verdict.FRESH  # a jump past the whole window clears it
    assert [w.check(c) for c in (992, 993, 999, 1000)] == [
        Verdict.TOO_OLD,
        Verdict.FRESH,
        Verdict.FRESH,
        Verdict.REPLAYED,
    ]


@settings(max_examples=300, deadline=None)
@given(
    size=st.integers(1, 40),
    counters=st.lists(
        st.one_of(st.integers(0, 120), st.integers(0, 1 << 20), st.just(1)), max_size=200
    ),
)
def test_the_window_agrees_with_a_reference_set(size: int, counters: list[int]) -> None:
    """A counter is fresh iff >= 1, above top - size, and never admitted: the window keeps
    exactly that with O(size) memory, whatever the order."""
    w = ReplayWindow(size)
    admitted: set[int] = set()
    for c in counters:
        top = max(admitted, default=0)
        if c < 1 or c <= top - size:
            want = Verdict.TOO_OLD
        elif c in admitted:
            want = Verdict.REPLAYED
        else:
            want = Verdict.FRESH
        assert w.check(c) is want
        assert w.handle(c) is want, (c, sorted(admitted), size)
        if want is Verdict.FRESH:
            admitted.add(c)
        assert w.top == max(admitted, default=0)
