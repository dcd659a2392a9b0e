"""Per-peer session keys: every peer message after the handshake is sealed and admitted once.

With a shared secret (`auth.secret_file`), each authenticated handshake derives a session
key for the two daemons (`derive_session`): an HMAC-SHA256 key derivation (HKDF-style
extract and expand) from the secret and the handshake's transcript: both agent names,
both daemon incarnations and both sides' fresh random nonces. A restarted daemon has a
new incarnation and new nonces, so no key of its old incarnation is ever derived again,
and a message made under one fails. Each direction has its own key (a message cannot be
reflected back to its sender), and each key has a 16-byte id both sides compute alike.

Every later peer message travels in a `wire.Sealed` envelope: the key id, the sender's
counter for that key (1, 2, 3, ... per direction) and the message's own encoding, under
an HMAC-SHA256 of all three with the direction's key. One envelope for every kind of
message (NIXL notifications of any type, side-channel notices), so a new notification
kind needs nothing here. The receiver (`Keyring.open`) refuses, in this order:
- `UNKNOWN_KEY`: no key with that id (no handshake, an old incarnation, a retired key);
- `WRONG_PEER`: the key belongs to another peer than the one the transport names;
- `BAD_MAC`: the MAC does not verify (forged or altered); nothing moves the window;
- `REPLAYED` / `TOO_OLD`: the counter was admitted before, or is `REPLAY_WINDOW` or more
  behind the highest one admitted (`ReplayWindow`, the anti-replay window of IPsec and
  DTLS). Notifications ride both direct sends and transfer completions, so they can
  arrive out of order: the window admits any order within it.

Key roll-over: a re-handshake (either side may dial) derives a new key. The dialer has it
once the reply is verified and sends with it at once; the acceptor installs it when it
replies but keeps sending with its previous key until a message under the new one
arrives (proof that the dialer holds it), so a notification never overtakes the
handshake reply it depends on. A key is replaced once the peer sends under a newer one
(it has switched for good); it still opens messages for `KEY_GRACE_S` then (those in
flight), at most `MAX_KEYS_PER_PEER` are kept per peer, and all go when the peer is
forgotten (it died or restarted).

Pure: time is an argument (it only retires replaced keys); nothing here does IO.
"""

from __future__ import annotations

import enum
import hmac
from dataclasses import dataclass, field
from typing import Any, Final

from kvd_client import wire

SESSION_CONTEXT: Final = b"kvd-session-v1"
KEY_ID_BYTES: Final = 16
REPLAY_WINDOW: Final = 1 << 16
"""Counters a message may lag behind the highest admitted one. Generous on purpose: a
transfer's completion is sealed when the transfer is posted and arrives when it ends,
after every notification sealed meanwhile (one byte of state per slot)."""
MAX_KEYS_PER_PEER: Final = 4
KEY_GRACE_S: Final = 60.0
"""How long a replaced key still opens messages (those sent before the peer switched)."""


@dataclass(frozen=True)
class Party:
    """One side of a handshake, as its (authenticated) handshake message says."""

    agent: str
    incarnation: int
    nonce: bytes


@dataclass(frozen=True)
class SessionKey:
    """What one handshake derives; `from_dialer`/`from_acceptor` key each direction."""

    key_id: bytes
    dialer: str
    acceptor: str
    from_dialer: bytes = field(repr=False)
    from_acceptor: bytes = field(repr=False)


def _field(b: bytes) -> bytes:
    return len(b).to_bytes(4, "big") + b


def derive_session(secret: bytes, *, dialer: Party, acceptor: Party) -> SessionKey:
    """The session key of one handshake (both sides derive the same one)."""
    transcript = b"".join(
        _field(p.agent.encode()) + p.incarnation.to_bytes(8, "big") + _field(p.nonce)
        for p in (dialer, acceptor)
    )
    prk = hmac.digest(secret, SESSION_CONTEXT + transcript, "sha256")
    return SessionKey(
        key_id=hmac.digest(prk, b"key-id", "sha256")[:KEY_ID_BYTES],
        dialer=dialer.agent,
        acceptor=acceptor.agent,
        from_dialer=hmac.digest(prk, b"from-dialer", "sha256"),
        from_acceptor=hmac.digest(prk, b"from-acceptor", "sha256"),
    )


def seal_mac(key: bytes, key_id: bytes, counter: int, body: bytes) -> bytes:
    """HMAC-SHA256 of an envelope's key id, counter and body under a direction's key."""
    return hmac.digest(key, key_id + counter.to_bytes(8, "big") + body, "sha256")


class Verdict(enum.Enum):
    """What a `ReplayWindow` says of a counter."""

    FRESH = "fresh"
    REPLAYED = "replayed"
    TOO_OLD = "too_old"


class ReplayWindow:
    """Admits each counter (>= 1) once, unless `size` or more behind the highest admitted.

    A ring of one byte per slot: slot `c % size` is set while counter `c` is admitted and
    inside the window. Admitting in order costs O(1); a jump ahead clears the slots it
    passes (at most `size`).
    """

    __slots__ = ("_slots", "size", "top")

    def __init__(self, size: int = REPLAY_WINDOW) -> None:
        if size < 1:
            raise ValueError(f"size must be >= 1 (got {size!r})")
        self.size = size
        self.top = 0
        self._slots = bytearray(size)

    def check(self, counter: int) -> Verdict:
        """The verdict `handle` would give, without admitting anything."""
        if counter < 1 or counter <= self.top - self.size:
            return Verdict.TOO_OLD
        if counter <= self.top and self._slots[counter % self.size]:
            return Verdict.REPLAYED
        return Verdict.FRESH

    def handle(self, counter: int) -> Verdict:
        """Admit `counter` if it is fresh (the window moves); say why not otherwise."""
        verdict = self.check(counter)
        if verdict is not Verdict.FRESH:
            return verdict
        size = self.size
        if counter > self.top:
            gap = counter - self.top - 1  # slots passed over: now empty
            if gap >= size:
                self._slots[:] = bytes(size)
            elif gap:
                start = (self.top + 1) % size
                end = start + gap
                if end <= size:
                    self._slots[start:end] = bytes(gap)
                else:
                    self._slots[start:] = bytes(size - start)
                    self._slots[: end - size] = bytes(end - size)
            self.top = counter
        self._slots[counter % size] = 1
        return Verdict.FRESH


class AuthRefusal(enum.Enum):
    """Why a peer message was not admitted (a counter `auth_rejected_<value>` each)."""

    UNSEALED = "unsealed"
    UNKNOWN_KEY = "unknown_key"
    WRONG_PEER = "wrong_peer"
    BAD_MAC = "bad_mac"
    REPLAYED = "replayed"
    TOO_OLD = "too_old"
    NESTED = "nested"
    """An envelope inside an envelope, or one around a handshake."""


@dataclass
class _Key:
    session: SessionKey
    peer: str
    send_key: bytes = field(repr=False)
    recv_key: bytes = field(repr=False)
    confirmed: bool
    """We may send with it: we dialed, or the peer sent under it."""
    installed_at: float
    window: ReplayWindow = field(default_factory=ReplayWindow)
    sent: int = 0
    replaced_at: float | None = None


class Keyring:
    """Our session keys, by peer agent and by key id (see the module docstring)."""

    def __init__(self, me: str, *, window: int = REPLAY_WINDOW) -> None:
        self.me = me
        self.window = window
        self._by_id: dict[bytes, _Key] = {}
        self._by_peer: dict[str, list[_Key]] = {}
        self._deadline: float | None = None
        """When the earliest replaced key retires (kept, not searched per message)."""

    def install(self, peer: str, session: SessionKey, now: float) -> None:
        """Add the key a handshake with `peer` derived (we are its dialer or acceptor)."""
        self.expire(now)
        if session.key_id in self._by_id:
            return
        dialer = session.dialer == self.me
        if (session.dialer, session.acceptor) not in ((self.me, peer), (peer, self.me)):
            raise ValueError(f"key {session.dialer}->{session.acceptor} is not ours with {peer}")
        k = _Key(
            session=session,
            peer=peer,
            send_key=session.from_dialer if dialer else session.from_acceptor,
            recv_key=session.from_acceptor if dialer else session.from_dialer,
            confirmed=dialer,
            installed_at=now,
            window=ReplayWindow(self.window),
        )
        keys = self._by_peer.setdefault(peer, [])
        keys.append(k)
        self._by_id[session.key_id] = k
        while len(keys) > MAX_KEYS_PER_PEER:
            del self._by_id[keys.pop(0).session.key_id]
        self._deadline = self._earliest()

    def forget(self, peer: str) -> None:
        """Drop every key of `peer` (it restarted or is gone)."""
        for k in self._by_peer.pop(peer, []):
            del self._by_id[k.session.key_id]
        self._deadline = self._earliest()

    def has(self, peer: str) -> bool:
        return bool(self._by_peer.get(peer))

    def _send_key(self, peer: str) -> _Key | None:
        keys = self._by_peer.get(peer)
        if not keys:
            return None
        for k in reversed(keys):
            if k.confirmed:
                return k
        return keys[-1]  # only keys the peer has yet to use: it dialed, so it holds them

    def seal(self, peer: str, body: bytes, now: float) -> wire.Sealed | None:
        """`body` (a message's encoding) in an envelope for `peer`; None without a key."""
        self.expire(now)
        k = self._send_key(peer)
        if k is None:
            return None
        k.sent += 1
        sid = k.session.key_id
        return wire.Sealed(sid, k.sent, body, seal_mac(k.send_key, sid, k.sent, body))

    def open(
        self, env: wire.Sealed, now: float, peer: str | None = None
    ) -> tuple[str, bytes] | AuthRefusal:
        """(sending peer, body) of an authentic, fresh envelope, or why it is refused.
        `peer`: who the transport says sent it (None: the key says who)."""
        self.expire(now)
        k = self._by_id.get(env.key_id)
        if k is None:
            return AuthRefusal.UNKNOWN_KEY
        if peer is not None and k.peer != peer:
            return AuthRefusal.WRONG_PEER
        good = seal_mac(k.recv_key, env.key_id, env.counter, env.body)
        if not hmac.compare_digest(good, env.mac):
            return AuthRefusal.BAD_MAC
        verdict = k.window.handle(env.counter)
        if verdict is Verdict.REPLAYED:
            return AuthRefusal.REPLAYED
        if verdict is Verdict.TOO_OLD:
            return AuthRefusal.TOO_OLD
        k.confirmed = True  # the peer holds it: we may send with it
        self._replace_older(k, now)
        return k.peer, env.body

    def _replace_older(self, newest: _Key, now: float) -> None:
        """The peer sent under `newest`: the keys installed before it are replaced."""
        for k in self._by_peer.get(newest.peer, ()):
            if k is newest:
                return  # only keys installed before it
            if k.replaced_at is None:
                k.replaced_at = now
                retire = now + KEY_GRACE_S
                if self._deadline is None or retire < self._deadline:
                    self._deadline = retire

    def _earliest(self) -> float | None:
        times = [k.replaced_at for k in self._by_id.values() if k.replaced_at is not None]
        return min(times) + KEY_GRACE_S if times else None

    def next_deadline(self) -> float | None:
        """When `expire` next has a key to retire (None: no replaced key)."""
        return self._deadline

    def expire(self, now: float) -> None:
        """Retire keys replaced `KEY_GRACE_S` or more ago."""
        deadline = self._deadline
        if deadline is None or now < deadline:
            return
        for peer, keys in list(self._by_peer.items()):
            kept = [k for k in keys if k.replaced_at is None or now < k.replaced_at + KEY_GRACE_S]
            for k in keys:
                if k not in kept:
                    del self._by_id[k.session.key_id]
            self._by_peer[peer] = kept
        self._deadline = self._earliest()

    def snapshot(self) -> dict[str, Any]:
        return {
            peer: {
                "keys": len(keys),
                "sending_key": (k := self._send_key(peer)) and k.session.key_id.hex()[:8],
                "sent": k.sent if k else 0,
                "highest_received": max((x.window.top for x in keys), default=0),
            }
            for peer, keys in self._by_peer.items()
        }
