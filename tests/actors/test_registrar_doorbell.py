"""Where the registrar rings a peer's doorbell (`Registrar._ring_at`): at the numeric
address its handshake gives at once; a host name its resolver has not cached looked up
in the background (the handshake never waits for it), and dropped if the peer was
replaced by a new incarnation meanwhile. A real `Registrar` and a real resolver
(`localhost` through the system's resolver); the NIXL engine is a recorder."""

from __future__ import annotations

import dataclasses
import socket
from types import SimpleNamespace
from typing import Any

import anyio
import pytest
from wire.make_golden import GOLDEN

from kvd.actors.base import Mailbox
from kvd.actors.registrar import Registrar
from kvd.logs import RejectLog

HS = dataclasses.replace(GOLDEN["Handshake"][1], agent_name="peer-a", side_port=5600)


class _Engine:
    """Records `set_peer_doorbell` calls (the only engine call `_ring_at` makes)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.bell = None
        self.second = anyio.Event()

    def set_peer_doorbell(self, peer: str, addr: Any) -> None:
        self.calls.append((peer, addr))
        if len(self.calls) == 2:
            self.second.set()


async def _noop(_: int) -> None:
    return None


def _registrar(engine: _Engine) -> Registrar:
    counters: dict[str, int] = {}
    return Registrar(
        engine=engine,  # type: ignore[arg-type]
        mailbox=Mailbox("registrar", 16),
        side_host="127.0.0.1",
        side_port_ref=lambda: 0,
        lease_duration=5.0,
        handshake_timeout=5.0,
        write_bound=10.0,
        secret=None,
        publish=lambda _: None,
        drain_local=_noop,
        counters=counters,
        rejects=RejectLog(counters, 1.0),
    )


def _localhost_v4() -> str:
    return "127.0.0.1"


pytestmark = pytest.mark.skipif(
    not any(
        info[4][0] == _localhost_v4()
        for info in socket.getaddrinfo("localhost", 0, type=socket.SOCK_DGRAM)
    ),
    reason="localhost does not resolve to 127.0.0.1 on this machine",
)


async def test_a_numeric_address_is_rung_at_once() -> None:
    engine = _Engine()
    reg = _registrar(engine)
    reg._ring_at(HS, "10.0.0.7")
    assert engine.calls == [("peer-a", (socket.AF_INET, ("10.0.0.7", 5600)))]


async def test_a_name_not_cached_is_looked_up_in_the_background() -> None:
    engine = _Engine()
    reg = _registrar(engine)
    reg.peers["peer-a"] = SimpleNamespace(incarnation=HS.incarnation)  # type: ignore[assignment]
    async with anyio.create_task_group() as tg:
        reg._tg = tg
        reg._ring_at(HS, "localhost")
        # the handshake's turn: no address yet (never waits for the name)
        assert engine.calls == [("peer-a", None)]
        with anyio.fail_after(5):
            await engine.second.wait()
    assert engine.calls[1] == ("peer-a", (socket.AF_INET, ("127.0.0.1", 5600)))
    # the name is cached now: the next handshake rings it at once
    reg._ring_at(HS, "localhost")
    assert engine.calls[2] == engine.calls[1]


async def test_a_lookup_for_a_replaced_incarnation_is_dropped() -> None:
    engine = _Engine()
    reg = _registrar(engine)
    reg.peers["peer-a"] = SimpleNamespace(incarnation=HS.incarnation + 1)  # type: ignore[assignment]
    async with anyio.create_task_group() as tg:
        reg._tg = tg
        reg._ring_at(HS, "localhost")
    assert engine.calls == [("peer-a", None)]  # the lookup ended and set nothing
    assert reg.resolver.cached("localhost") == "127.0.0.1"


async def test_a_peer_without_a_doorbell_is_never_rung() -> None:
    engine = _Engine()
    reg = _registrar(engine)
    async with anyio.create_task_group() as tg:
        reg._tg = tg
        reg._ring_at(dataclasses.replace(HS, doorbell=False), "localhost")
    assert engine.calls == [("peer-a", None)]
    assert reg.resolver.cached("localhost") is None  # nothing looked up
