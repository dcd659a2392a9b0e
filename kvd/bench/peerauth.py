"""Micro benchmark: what sealing a peer message costs (`kvd.core.peersession`).

    python -m kvd.bench.peerauth [--json]

For a few real notifications (a one-request heartbeat, a 64-block push registration, a
heartbeat batch of 1,000 requests), the time per message of: encoding and decoding it
alone (what daemons without a secret do), sealing it (envelope, counter, HMAC-SHA256, msgpack), and
opening it at the receiver (decode the envelope, verify the MAC, the replay window):
CPU microseconds per message (this thread's CPU time, so other processes on a busy
machine do not count), the best of several rounds. The added cost of
authentication is seal + open; the message is encoded and decoded either way.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, Final

from kvd_client import wire

from kvd.core.peersession import Keyring, Party, derive_session

ROUNDS: Final = 5
N: Final = 20_000

MESSAGES: Final[dict[str, wire.Record]] = {
    "heartbeat_1": wire.Heartbeat(("cmpl-0123456789abcdef-0",)),
    "push_registration_64": wire.PushRegistration(
        "cmpl-0123456789abcdef-0-d",
        "cmpl-0123456789abcdef-0-p",
        "decode",
        "prefill",
        1,
        tuple(range(64)),
        "10.0.0.2",
        5600,
        1 << 60,
        (17,),
        "session-0123456789",
    ),
    "heartbeat_1000": wire.Heartbeat(tuple(f"cmpl-{i:016x}-0" for i in range(1000))),
}


def _best_us(fn: Callable[[], object], n: int) -> float:
    """CPU time per call of `fn` (this thread's: a busy machine's other processes do not
    count), the best of `ROUNDS` rounds of `n` calls after one warm-up round."""
    best = float("inf")
    for r in range(ROUNDS + 1):
        t0 = time.thread_time()
        for _ in range(n):
            fn()
        if r:
            best = min(best, (time.thread_time() - t0) / n)
    return best * 1e6


def measure(n: int = N) -> dict[str, Any]:
    secret = b"bench secret"
    key = derive_session(
        secret, dialer=Party("kvd-d", 2, b"d" * 16), acceptor=Party("kvd-p", 1, b"p" * 16)
    )
    out: dict[str, Any] = {"messages": {}}
    for name, msg in MESSAGES.items():
        sender, receiver = Keyring("kvd-d"), Keyring("kvd-p")
        sender.install("kvd-p", key, 0.0)
        receiver.install("kvd-d", key, 0.0)
        body = wire.encode(msg)
        count = max(200, n // max(1, len(body) // 64))
        encode_us = _best_us(partial(wire.encode, msg), count)
        decode_us = _best_us(partial(wire.decode, body), count)

        def seal(b: bytes = body, sender: Keyring = sender) -> bytes:
            env = sender.seal("kvd-p", b, 0.0)
            assert env is not None
            return wire.encode(env)

        seal_us = _best_us(seal, count)
        frames = [seal() for _ in range(count * (ROUNDS + 1))]
        it = iter(frames)

        def open_one(it: Iterator[bytes] = it, receiver: Keyring = receiver) -> None:
            env = wire.decode(next(it))[1]
            assert isinstance(env, wire.Sealed)
            got = receiver.open(env, 0.0, "kvd-d")
            assert isinstance(got, tuple)

        open_us = _best_us(open_one, count)
        out["messages"][name] = {
            "bytes": len(body),
            "sealed_bytes": len(frames[0]),
            "encode_us": round(encode_us, 2),
            "decode_us": round(decode_us, 2),
            "seal_us": round(seal_us, 2),
            "open_us": round(open_us, 2),
            "added_us": round(seal_us + open_us, 2),
        }
    return out


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    res = measure()
    if "--json" in args:
        print(json.dumps(res, indent=2))
        return
    print(
        f"{'message':<22}{'bytes':>7}{'+bytes':>8}{'encode':>9}{'decode':>9}"
        f"{'seal':>8}{'open':>8}{'added':>8}"
    )
    for name, r in res["messages"].items():
        print(
            f"{name:<22}{r['bytes']:>7}{r['sealed_bytes'] - r['bytes']:>8}{r['encode_us']:>9}"
            f"{r['decode_us']:>9}{r['seal_us']:>8}{r['open_us']:>8}{r['added_us']:>8}"
        )
    print(f"(CPU microseconds per message, best of {ROUNDS} rounds)")


if __name__ == "__main__":
    main()
