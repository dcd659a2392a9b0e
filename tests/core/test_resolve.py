"""The daemon's resolver (`kvd.adapters.resolve`): numbers pass through, names are looked
up in its own threads, cached for `ttl`, looked up again after it (a name that moved to
another address is followed), and a name with no address, or one whose lookup outlasts
the caller's timeout, is `Unresolved`. The lookups of `localhost` and of a `.invalid`
name are real; a name that moves and a lookup that hangs are made by replacing
`socket.getaddrinfo` (neither can be made for real here)."""

from __future__ import annotations

import socket
import threading
import time
from typing import Any

import anyio
import pytest

from kvd.adapters.resolve import Resolver, Unresolved, endpoint, literal


def run(coro: Any) -> Any:
    async def main() -> Any:
        return await coro

    return anyio.run(main)


def test_numbers_pass_through_and_endpoints_bracket_ipv6() -> None:
    r = Resolver()
    assert literal("10.0.0.5") == "10.0.0.5" and literal("::1") == "::1"
    assert literal("localhost") is None and literal("10.0.0") is None
    assert run(r.resolve("10.0.0.5", 1.0)) == "10.0.0.5"
    assert r.cached("fe80::1") == "fe80::1"
    assert r.lookups == 0  # no lookup for a number
    assert endpoint("10.0.0.5", 5600) == "tcp://10.0.0.5:5600"
    assert endpoint("::1", 5600) == "tcp://[::1]:5600"


def test_a_name_is_looked_up_once_then_cached() -> None:
    r = Resolver()
    assert r.cached("localhost") is None
    first = run(r.resolve("localhost", 5.0))
    assert first in ("127.0.0.1", "::1")
    assert run(r.resolve("localhost", 5.0)) == first and r.cached("localhost") == first
    assert r.stats() == {"lookups": 1, "failures": 0, "cached": 1}


def test_a_name_with_no_address_is_unresolved() -> None:
    r = Resolver()
    with pytest.raises(Unresolved, match=r"no-such-host\.invalid"):
        run(r.resolve("no-such-host.invalid", 10.0))
    with pytest.raises(Unresolved):  # a name IDNA cannot encode: refused, not a crash
        run(r.resolve("a" * 64 + ".example", 10.0))
    assert r.failures == 2 and r.cached("no-such-host.invalid") is None


def test_a_name_that_moved_is_followed_after_the_ttl(monkeypatch: pytest.MonkeyPatch) -> None:
    where = ["10.1.0.1"]

    def fake(host: str, *args: Any, **kw: Any) -> list[Any]:
        assert host == "p.example"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (where[0], 0))]

    monkeypatch.setattr(socket, "getaddrinfo", fake)
    r = Resolver(ttl=0.1)
    assert run(r.resolve("p.example", 1.0)) == "10.1.0.1"
    where[0] = "10.1.0.2"  # the peer restarted elsewhere
    assert run(r.resolve("p.example", 1.0)) == "10.1.0.1"  # within the ttl: cached
    time.sleep(0.15)
    assert r.cached("p.example") is None  # expired
    assert r.cached("p.example", stale_ok=True) == "10.1.0.1"
    assert run(r.resolve("p.example", 1.0)) == "10.1.0.2"


def test_a_lookup_that_hangs_ends_at_the_callers_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    release = threading.Event()

    def hangs(*args: Any, **kw: Any) -> list[Any]:
        release.wait(10)
        raise socket.gaierror("released")

    monkeypatch.setattr(socket, "getaddrinfo", hangs)
    r = Resolver()
    t0 = time.monotonic()
    try:
        with pytest.raises(Unresolved, match=r"within 0\.3s"):
            run(r.resolve("slow.example", 0.3))
        assert time.monotonic() - t0 < 2.0
    finally:
        release.set()
