"""The NIXL adapter's handling of failed UCX endpoints, driven on its own thread's code
with a fake agent (a failed endpoint needs a cut network link to happen for real: that
is `tests/integration/test_two_hosts.py`, as root). What is checked: notifications to a
peer whose endpoint failed are held in order and sent on a fresh endpoint; a fresh
endpoint that fails too means the peer is gone (held ones fail at once); held ones fail
after the hold bound; a peer we dialed is never mended; a peer is never removed from
NIXL while a transfer to it is in flight."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from kvd_client.errors import TransferError

from kvd.adapters.nixl import NixlEngine, PeerDisconnected, Unsettled, _Xfer


class nixlRemoteDisconnectError(Exception):
    pass


class FakeAgent:
    """The calls the adapter makes, with a switch for the endpoint's state."""

    def __init__(self) -> None:
        self.broken = False
        self.stay_broken = False
        self.connect_fails = False
        self.loaded: dict[str, int] = {}
        self.sent: list[tuple[str, bytes]] = []
        self.calls: list[str] = []

    def add_remote_agent(self, md: bytes) -> bytes:
        if self.connect_fails:
            raise RuntimeError("NIXL_ERR_BACKEND")
        name = md.split(b"|")[0]
        self.loaded[name.decode()] = self.loaded.get(name.decode(), 0) + 1
        self.calls.append(f"add {name.decode()}")
        self.broken = self.stay_broken
        return name

    def remove_remote_agent(self, name: str) -> None:
        self.calls.append(f"remove {name}")
        self.loaded.pop(name, None)

    def send_notif(self, peer: str, msg: bytes) -> None:
        if self.broken:
            raise nixlRemoteDisconnectError("NIXL_ERR_REMOTE_DISCONNECT")
        self.sent.append((peer, msg))


def engine(agent: FakeAgent, loop: asyncio.AbstractEventLoop, settle: float = 0.5) -> NixlEngine:
    eng = NixlEngine("us", settle_timeout=settle)
    eng._agent = agent
    eng._loop = loop
    return eng


async def add(eng: NixlEngine, md: bytes, *, mend: bool) -> None:
    eng._add_remote(md, mend=mend)  # what `add_remote` runs on the NIXL thread


def post(eng: NixlEngine, peer: str, msg: bytes, out: list[Any]) -> None:
    from kvd.adapters.nixl import _Notif

    eng._send_or_hold(_Notif(peer, msg, out.append, True, time.monotonic()))


async def settle_loop() -> None:
    for _ in range(3):
        await asyncio.sleep(0)


@pytest.mark.asyncio
async def test_held_in_order_then_sent_on_a_fresh_endpoint() -> None:
    agent = FakeAgent()
    eng = engine(agent, asyncio.get_running_loop())
    await add(eng, b"p|md", mend=True)
    await add(eng, b"p|region", mend=False)  # a mended peer keeps every blob
    out: list[Any] = []
    agent.broken, agent.connect_fails = True, True  # the link is down
    for i in range(3):
        post(eng, "p", b"m%d" % i, out)
    assert agent.sent == [] and len(eng._held["p"]) == 3
    agent.connect_fails = False  # the link is back
    eng._reloaded["p"] = -1e9  # (the reload pause has passed)
    eng._tend_broken()
    assert agent.sent == [("p", b"m0"), ("p", b"m1"), ("p", b"m2")]
    assert agent.calls[-2:] == ["add p", "add p"]  # both blobs reloaded, in order
    await settle_loop()
    assert out == [None, None, None]
    assert eng.stats.reconnects == 1 and "p" not in eng._held and "p" not in eng._broken


@pytest.mark.asyncio
async def test_a_fresh_endpoint_that_fails_too_means_the_peer_is_gone() -> None:
    agent = FakeAgent()
    eng = engine(agent, asyncio.get_running_loop())
    await add(eng, b"p|md", mend=True)
    out: list[Any] = []
    agent.broken, agent.stay_broken = True, True  # the peer died: its address refuses us
    post(eng, "p", b"a", out)  # held; reloaded; the first send on the fresh one fails
    await settle_loop()
    assert eng.stats.reconnects == 1 and agent.sent == []
    assert len(out) == 1 and isinstance(out[0], PeerDisconnected)
    assert eng.stats.peers_given_up == 1 and "p" not in eng._held and "p" not in eng._broken


@pytest.mark.asyncio
async def test_a_fresh_endpoint_that_carried_something_is_mended_again_later() -> None:
    """A fresh endpoint that sent once is a live peer's: a later failure (the link cut
    again) holds and mends again, it does not give the peer up."""
    agent = FakeAgent()
    eng = engine(agent, asyncio.get_running_loop())
    await add(eng, b"p|md", mend=True)
    out: list[Any] = []
    agent.broken = True
    post(eng, "p", b"a", out)  # held, mended, sent
    agent.broken, agent.connect_fails = True, True
    post(eng, "p", b"b", out)  # held again (the reload pause has not passed)
    await settle_loop()
    assert out == [None] and eng.stats.peers_given_up == 0 and len(eng._held["p"]) == 1
    agent.connect_fails = False
    eng._reloaded["p"] = -1e9
    eng._tend_broken()
    await settle_loop()
    assert out == [None, None] and agent.sent == [("p", b"a"), ("p", b"b")]


@pytest.mark.asyncio
async def test_held_notifications_fail_after_the_hold_bound() -> None:
    agent = FakeAgent()
    eng = engine(agent, asyncio.get_running_loop(), settle=0.05)  # bound: 2 x 0.05 + 1 s
    await add(eng, b"p|md", mend=True)
    out: list[Any] = []
    agent.broken, agent.connect_fails = True, True
    post(eng, "p", b"a", out)
    eng._held["p"][0].since -= 2.0  # held longer than the bound
    eng._tend_broken()
    await settle_loop()
    assert len(out) == 1 and isinstance(out[0], PeerDisconnected)
    assert eng.stats.notifs_expired == 1 and "p" not in eng._held


@pytest.mark.asyncio
async def test_a_peer_we_dialed_is_not_mended() -> None:
    agent = FakeAgent()
    eng = engine(agent, asyncio.get_running_loop())
    await add(eng, b"p|md", mend=False)
    out: list[Any] = []
    agent.broken = True
    post(eng, "p", b"a", out)
    await settle_loop()
    assert isinstance(out[0], PeerDisconnected)
    assert eng.stats.reconnects == 0 and agent.calls == ["add p"]


@pytest.mark.asyncio
async def test_a_peer_we_dialed_first_is_mended_once_it_dialed_us() -> None:
    """We dialed it (not mended), then it handshook with us: the registrar keeps it when
    a transfer to it fails (it cannot re-dial us on our behalf), so the engine mends it
    from the metadata it sent, and regions loaded later join that metadata."""
    agent = FakeAgent()
    eng = engine(agent, asyncio.get_running_loop())
    await add(eng, b"p|md", mend=False)
    eng._mend_from("p", b"p|md2")  # what `mend_from` runs on the NIXL thread
    eng._mend_from("p", b"p|md3")  # already mended: the first blob stays
    await add(eng, b"p|region", mend=False)
    out: list[Any] = []
    agent.broken = True
    post(eng, "p", b"a", out)
    await settle_loop()
    assert out == [None] and agent.sent == [("p", b"a")] and eng.stats.reconnects == 1
    assert eng._mds["p"] == [b"p|md2", b"p|region"]


@pytest.mark.asyncio
async def test_no_removal_while_a_transfer_to_the_peer_is_in_flight() -> None:
    agent = FakeAgent()
    loop = asyncio.get_running_loop()
    eng = engine(agent, loop)
    await add(eng, b"p|md", mend=True)
    x = _Xfer(object(), loop.create_future(), time.monotonic() + 9, time.monotonic(), "", "p")
    eng._inflight.append(x)
    eng._remove_remote("p")  # what `remove_remote` runs on the NIXL thread
    assert "remove p" not in agent.calls
    # a failed endpoint is not mended while the transfer is in flight either
    eng._mds["p"] = [b"p|md"]
    eng._mend("p", time.monotonic())
    assert "remove p" not in agent.calls
    eng._inflight.clear()  # the transfer ended
    eng._removals_due()
    assert agent.calls.count("remove p") == 1


class XferAgent(FakeAgent):
    """A fake agent whose transfers stay in flight until `state` says otherwise."""

    def __init__(self) -> None:
        super().__init__()
        self.state = "PROC"
        self.released: list[object] = []

    def check_xfer_state(self, handle: object) -> str:
        return self.state

    def release_xfer_handle(self, handle: object) -> None:
        self.released.append(handle)

    def get_xfer_descs(self, descs: object, mem: str) -> object:
        self.calls.append("descs")  # the post has begun: stop it here
        raise RuntimeError("no descriptors in this fake")


@pytest.mark.asyncio
@pytest.mark.parametrize("end", ["DONE", "ERR"])
async def test_an_unsettled_transfer_reports_its_end_when_ucx_ends_it(end: str) -> None:
    """Past its deadline and the settle bound the caller hears Unsettled (its memory must
    stay untouched); `settled` is called once UCX ends the transfer, and not before."""
    agent = XferAgent()
    loop = asyncio.get_running_loop()
    eng = engine(agent, loop, settle=0.5)  # bound: deadline + 2 x 0.5 + 1 s
    now = time.monotonic()
    handle = object()
    ended: list[bool] = []
    x = _Xfer(handle, loop.create_future(), now - 2.5, now - 3.0, "", "p")
    x.settled = lambda: ended.append(True)
    eng._inflight.append(x)
    eng._poll_xfers()
    await settle_loop()
    with pytest.raises(Unsettled):
        x.future.result()
    assert ended == [] and agent.released == []  # never released while UCX works on it
    eng._poll_xfers()  # still in flight: nothing new
    await settle_loop()
    assert ended == [] and eng.stats.unsettled == 1
    agent.state = end
    eng._poll_xfers()
    await settle_loop()
    assert ended == [True]
    assert agent.released == [handle] and eng.stats.unsettled == 0


@pytest.mark.asyncio
async def test_a_transfer_past_its_post_fence_is_never_posted() -> None:
    """The daemon stalled between deciding a WRITE and posting it: nothing is posted."""
    import numpy as np

    agent = XferAgent()
    loop = asyncio.get_running_loop()
    eng = engine(agent, loop)
    eng._thread = object()  # type: ignore[assignment]  # the NIXL thread: run by hand here
    empty = np.zeros((0, 3), dtype=np.uint64)
    for post_by, posted in ((time.monotonic() - 0.01, False), (time.monotonic() + 60, True)):
        agent.calls.clear()
        post = eng.transfer("WRITE", empty, empty, "p", b"", 1.0, 0, post_by=post_by)
        task = asyncio.ensure_future(post)
        await settle_loop()
        run = eng._cmds.get_nowait()
        assert run is not None
        run()
        with pytest.raises(TransferError) as info:
            await task
        assert ("descs" in agent.calls) is posted
        assert ("post fence" in info.value.message) is not posted
    assert eng.stats.transfers_fenced == 1


def test_an_idle_thread_pauses_long_only_when_nothing_waits_and_a_poke_wakes_it() -> None:
    """The poll loop's cap: the short one while the daemon says something may wait on
    the agent (or notifications are held, or a peer is broken), the deep one otherwise; a
    poke during a deep pause queues a no-op command (which wakes the thread's timed wait
    at once), and nothing otherwise."""
    eng = NixlEngine("us", poll_max_idle_us=1000, poll_deep_idle_us=20_000)
    waiting = [False]
    eng.awake = lambda: waiting[0]
    assert eng._idle_cap() == 0.02
    waiting[0] = True
    assert eng._idle_cap() == 0.001
    waiting[0] = False
    eng._broken["p"] = 0.0
    assert eng._idle_cap() == 0.001
    del eng._broken["p"]

    def broken() -> bool:
        raise RuntimeError("dictionary changed size during iteration")

    eng.awake = broken
    assert eng._idle_cap() == 0.001  # a read that failed: the short cap
    eng.poke()
    assert eng._cmds.empty()  # not in a deep pause: nothing to wake
    eng._deep = True
    eng.poke()
    cmd = eng._cmds.get_nowait()
    assert cmd is not None and cmd() is None and not eng._deep
    # no deep pause configured: always the short cap
    assert NixlEngine("us", poll_max_idle_us=1000)._idle_cap() == 0.001
