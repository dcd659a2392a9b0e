"""A region drop in the registrar's background (`Registrar._begin_drop`): the region
leaves the published view at once, shows under `dropping` until deregistered, and a
deregistration NIXL refuses is logged and counted, the memory retired all the same,
and the registrar goes on. A real `Registrar`; the NIXL engine is a fake (a failing
deregistration cannot be produced with real NIXL), the region's memory a recorder."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import anyio
import anyio.lowlevel
from kvd_client.errors import TransferError

from kvd.actors.base import Mailbox
from kvd.actors.messages import LocalRegionsChanged
from kvd.actors.registrar import Registrar, _Region
from kvd.logs import RejectLog


class _Engine:
    """Deregistrations recorded; the first ones named in `fail` raise as NIXL's would."""

    name = "agent-self"

    def __init__(self, fail: int = 0) -> None:
        self.fail = fail
        self.deregistered: list[Any] = []

    async def deregister(self, reg: Any) -> None:
        await anyio.lowlevel.checkpoint()
        if self.fail:
            self.fail -= 1
            raise TransferError("NIXL_ERR_BACKEND: deregistration refused")
        self.deregistered.append(reg)


class _Memory:
    """A region's mapping (not shared memory: retired by closing it)."""

    def __init__(self) -> None:
        self.closed = False

    def close(self) -> None:
        self.closed = True


def _registrar(engine: _Engine) -> tuple[Registrar, list[Any]]:
    counters: dict[str, int] = {}
    published: list[Any] = []
    reg = Registrar(
        engine=engine,  # type: ignore[arg-type]
        mailbox=Mailbox("registrar", 16),
        side_host="127.0.0.1",
        side_port_ref=lambda: 0,
        lease_duration=5.0,
        handshake_timeout=5.0,
        write_bound=10.0,
        secret=None,
        publish=published.append,
        drain_local=_drained,
        counters=counters,
        rejects=RejectLog(counters, 1.0),
    )
    return reg, published


async def _drained(_: int) -> None:
    await anyio.lowlevel.checkpoint()


def _region(rid: int, memory: _Memory) -> _Region:
    view = SimpleNamespace(
        region_id=rid,
        generation=100 + rid,
        engine_id=f"engine-{rid}",
        tp_rank=0,
        name=f"seg-{rid}",
        mem_type="DRAM",
    )
    return _Region(view, memory, f"reg-{rid}", b"", 0, 4096)  # type: ignore[arg-type]


async def test_a_refused_deregistration_is_counted_and_the_registrar_goes_on() -> None:
    engine = _Engine(fail=1)
    reg, published = _registrar(engine)
    first, second = _Memory(), _Memory()
    reg.regions = {1: _region(1, first), 2: _region(2, second)}
    async with anyio.create_task_group() as tg:
        reg._tg = tg
        done = reg._begin_drop(1)
        assert done is not None
        # gone from what our actors see at once; dropping until deregistered
        assert isinstance(published[-1], LocalRegionsChanged)
        assert set(published[-1].regions) == {("engine-2", 0)}
        assert sorted(reg.dropping) == [1]
        assert reg._begin_drop(1) is done  # a second drop of it is the same one
        with anyio.fail_after(5):
            await done.wait()
        assert reg.dropping == {} and first.closed  # retired although NIXL refused
        assert reg.counters["regions_deregister_failed"] == 1
        assert "regions_dropped" in reg.counters
        later = reg._begin_drop(2)  # the registrar's tasks live on: the next drop runs
        assert later is not None
        with anyio.fail_after(5):
            await later.wait()
        assert engine.deregistered == ["reg-2"] and second.closed
        assert reg.counters["regions_dropped"] == 2
        assert reg._begin_drop(3) is None  # no such region
