"""Peer messages under the shared secret: MACs, and nonces that admit a message once.

With `auth.secret_file` set, a peer daemon proves it knows the secret by an HMAC-SHA256
over a domain-separation context and the message's wire encoding with its `mac` field
empty (`message_mac`): every other field, in the canonical msgpack of `kvd_client.wire`.
The context keeps a MAC made for one kind of message from verifying as another (a
handshake request, its reply, a region drop, an EC transfer request).

A MAC proves that someone with the secret made the message, not that the message is new:
a captured one would verify again. A message that makes a daemon act on another's
memory (the EC transfer request, which WRITEs into a consumer's blocks) therefore
carries, under its MAC, a random nonce and its sender's wall-clock time, and the
receiver admits it through a `ReplayGuard`:

- Stale: a timestamp `window` seconds or more away from our wall clock (peers' clocks
  must agree within the window), or `window` seconds or more older than the latest
  wall-clock reading the guard was given (so a clock stepped back cannot revive a
  message whose nonce was already forgotten), or older than `not_before` (the guard's
  owner started then: a message made earlier may have been admitted by the process
  before it, whose memory of nonces is gone).
- Replayed: a nonce admitted before. A nonce is remembered until its message is stale
  (its timestamp plus `window` has passed); from then on the staleness rule refuses it.
- Full: `capacity` nonces are remembered and none is stale yet. The message is refused
  (the caller answers BUSY: retry later) rather than forgetting a nonce that could then
  be replayed. Memory is O(capacity) whatever arrives; and since only messages with a
  valid MAC reach the guard, nobody without the secret can fill it.

Pure: time is an argument; nothing here reads a clock or does IO.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
from dataclasses import replace
from typing import Final

from kvd_client import wire

from kvd.core.timers import TimerHeap

AUTH_WINDOW_S: Final = 120.0
"""How far a peer's wall clock may be from ours for its authenticated messages to count
as fresh (handshakes, region drops, EC transfer requests)."""

NONCE_BYTES: Final = 16
"""Length of the random nonce a sender puts in each message it authenticates (at least
this many are required)."""

Signed = (
    wire.Handshake
    | wire.RegionDropped
    | wire.ECXferReq
    | wire.ECXferAck
    | wire.ECXferCancel
    | wire.TraceQuery
    | wire.TraceAnswer
)
"""The peer messages that carry a `mac` field."""


def message_mac(secret: bytes, msg: Signed, context: bytes) -> bytes:
    """HMAC-SHA256 with `secret` over `context` and `msg` encoded with an empty mac."""
    body = wire.encode(replace(msg, mac=b""))
    return hmac.new(secret, context + body, hashlib.sha256).digest()


def mac_valid(secret: bytes, msg: Signed, context: bytes) -> bool:
    """Whether `msg` carries the MAC `message_mac` makes (compared in constant time)."""
    return bool(msg.mac) and hmac.compare_digest(message_mac(secret, msg, context), msg.mac)


class Refusal(enum.Enum):
    """Why a `ReplayGuard` did not admit a message."""

    STALE = "stale"
    REPLAYED = "replayed"
    FULL = "full"


class ReplayGuard:
    """Admits each (nonce, timestamp) once, while fresh; see the module docstring."""

    __slots__ = ("_high", "_nonces", "capacity", "not_before", "window")

    def __init__(self, window: float, capacity: int, *, not_before: float = float("-inf")) -> None:
        if not window > 0:
            raise ValueError(f"window must be > 0 (got {window!r})")
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1 (got {capacity!r})")
        self.window = window
        self.capacity = capacity
        self.not_before = not_before
        self._nonces: TimerHeap[bytes] = TimerHeap()  # nonce -> when its message goes stale
        self._high = float("-inf")

    def __len__(self) -> int:
        return len(self._nonces)

    def admit(self, nonce: bytes, timestamp: float, now: float) -> Refusal | None:
        """Admit the message (None) or say why not; `now` is our wall clock."""
        self._high = max(self._high, now)
        self._nonces.pop_due(self._high)
        if (
            abs(now - timestamp) >= self.window
            or timestamp <= self._high - self.window
            or timestamp < self.not_before
        ):
            return Refusal.STALE
        if nonce in self._nonces:
            return Refusal.REPLAYED
        if len(self._nonces) >= self.capacity:
            return Refusal.FULL
        self._nonces.set(nonce, timestamp + self.window)
        return None
