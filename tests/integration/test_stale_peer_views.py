"""What real NIXL raises when D posts through a stale view of a P that restarted.

A P that restarts keeps its agent name. A request on D may resolve its view of P just
before the registrar drops that view (a heartbeat found P gone, or a handshake met its new
incarnation) and post through it just after: NIXL then holds no agent of that name, or the
restarted P's metadata in its place, which lacks the memory the view names. Either is
NIXL_ERR_NOT_FOUND when posting (nothing was sent or moved), which the adapter raises as
`PeerUnknown`; the receiver takes it for a stale view, like a peer found dead when
posting: one fresh handshake, then the request goes on through the new view
(`tests/actors/test_transfer_actors.py` runs that over a fake port). Two engines in this
process stand in for the daemons' agents.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np
import pytest

from kvd.adapters.nixl import NixlEngine, PeerUnknown
from kvd.adapters.shm import AnonRegion

NBYTES = 64 * 1024
P_NAME, D_NAME = "kvdt-views-p", "kvdt-views-d"


@asynccontextmanager
async def agent(name: str, mem: AnonRegion) -> AsyncIterator[NixlEngine]:
    """An engine with `mem` registered."""
    engine = NixlEngine(name)
    await engine.start(lambda agent, msgs: None)
    reg: Any = None
    try:
        reg = await engine.register(mem.addr, NBYTES)
        yield engine
    finally:
        if reg is not None:
            await engine.deregister(reg)
        await engine.close()


def descs(mem: AnonRegion) -> np.ndarray:
    return np.array([[mem.addr, 4096, 0]], dtype=np.int64)


async def post(d: NixlEngine, mem: AnonRegion, p_mem: AnonRegion, what: str) -> None:
    if what == "notification":
        await d.send_notif(P_NAME, b"kvdt")
    else:
        await d.transfer("READ", descs(mem), descs(p_mem), P_NAME, b"", 5.0, 4096)


@pytest.mark.parametrize("what", ["notification", "READ"])
async def test_posting_through_a_stale_view_of_a_restarted_peer(what: str) -> None:
    # three buffers mapped throughout: the new P's cannot reuse the old P's address
    d_mem, old_mem, new_mem = AnonRegion(NBYTES), AnonRegion(NBYTES), AnonRegion(NBYTES)
    try:
        async with agent(D_NAME, d_mem) as d:
            async with agent(P_NAME, old_mem) as p:
                await d.add_remote(await p.metadata())
                await p.add_remote(await d.metadata())
                await post(d, d_mem, old_mem, what)  # the view works while P lives

            # P died, and D's registrar forgot it (a heartbeat found it gone, which raised
            # PeerDisconnected): NIXL holds no agent of that name
            await d.remove_remote(P_NAME)
            with pytest.raises(PeerUnknown):
                await post(d, d_mem, old_mem, what)

            async with agent(P_NAME, new_mem) as p:
                await d.add_remote(await p.metadata())  # D's handshake with the new P
                await p.add_remote(await d.metadata())
                if what == "READ":  # the old view names memory the new P never registered
                    with pytest.raises(PeerUnknown):
                        await post(d, d_mem, old_mem, what)
                await post(d, d_mem, new_mem, what)  # the fresh view works
    finally:
        for mem in (d_mem, old_mem, new_mem):
            mem.close()
