"""The sender and receiver actors on a real event loop, over a fake transport port.

Real: the actors (`kvd.actors.sender`, `kvd.actors.receiver`), their shell and mailboxes,
anyio task groups, the daemon's wiring of views (`Daemon._publish`) and, for the session
close, the gateway on a real ipc:// socket. Fake: the transport port (`FakePort` records
the notifications sent and the transfers posted; the test completes or fails each
transfer, and can make a notification fail), the registrar (`StubActor` answers
`EnsurePeer` from a table) and the daemon's clock (`FakeClock` moves only when a test
advances it, so every lease, watchdog and heartbeat fires exactly when the test says:
nothing here waits for a timer in real time). The test plays the peer daemon: it reads
what the port sent and posts the peer's answers as the notifier would.

The last three tests are regressions for bugs of the first design, where whether a
notice between actors could be refused was decided at each call site.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final, Generic, TypeVar

import anyio
import anyio.lowlevel
import numpy as np
import pytest
import zmq
import zmq.asyncio
from anyio.abc import TaskStatus
from kvd_client import wire
from kvd_client.errors import Busy, ErrorCode, InvalidRequest, KvdError, NotFound, TransferError

from kvd.actors.base import Clock, Mailbox
from kvd.actors.gateway import NOT_TAKEN_DEPTH, Gateway
from kvd.actors.messages import (
    ClientRequest,
    EnsurePeer,
    EventOut,
    FinishNotTaken,
    HeartbeatReceived,
    LayersAnnounced,
    LoadNotTaken,
    LocalRegion,
    LocalRegionsChanged,
    NotifReceived,
    PeerInfo,
    PeerLost,
    PeerUpdated,
    ProbeReceived,
    RemoteRegion,
    SessionClosed,
    Snapshot,
)
from kvd.actors.notifier import Notifier
from kvd.actors.receiver import Receiver
from kvd.actors.sender import Sender
from kvd.actors.transfers import Running, TransferBook
from kvd.adapters.nixl import PeerDisconnected, Unsettled, translate
from kvd.config import Config, DaemonConfig
from kvd.core.limits import PendingBudget, record_cost
from kvd.core.planner import Geometry, Plan
from kvd.core.stats import XferTiming
from kvd.daemon import Daemon
from kvd.logs import RejectLog

T = TypeVar("T")
R = TypeVar("R", bound=wire.Record)

WAIT: Final = 5.0
"""Bound on waiting for something that follows at once (real seconds; generous)."""
SIZE: Final = 4
"""Every mailbox's bound on outside input."""
LEASE: Final = 12.0
HB: Final = LEASE / 6.0
"""D's heartbeat period once the handshake taught it P's lease."""
REG_TIMEOUT: Final = 20.0

P_AGENT: Final = "kvd-p"
D_AGENT: Final = "kvd-d"
P_ENGINE: Final = "engine-p"
D_ENGINE: Final = "engine-d"
P_SESSION: Final = "session-p"
D_SESSION: Final = "session-d"
P_HOST, P_PORT = "10.0.0.1", 5600
D_HOST, D_PORT = "10.0.0.2", 5700
P_INCARNATION: Final = 0xA1
D_INCARNATION: Final = 0xD1
P_GEN: Final = 3
D_GEN: Final = 4
COMPAT: Final = "model-x"

P_BASE: Final = 0x10000
D_BASE: Final = 0x90000
P_GEO: Final = Geometry.block_major(P_BASE, 16, 2, 2, 64)
D_GEO: Final = Geometry.block_major(D_BASE, 16, 2, 2, 64)
BLOCK: Final = P_GEO.block_bytes
LAYOUT: Final = wire.RegionLayout(
    num_blocks=16,
    num_layers=2,
    kv_parts=2,
    chunk_bytes=64,
    block_stride=BLOCK,
    layer_stride=128,
    kv_stride=64,
    tokens_per_block=16,
    physical_per_logical=1,
    kv_layout="NHD",
    dtype="bfloat16",
)


def _local(engine: str, geo: Geometry, gen: int, session: str) -> LocalRegion:
    return LocalRegion(1, gen, engine, 0, 1, geo, LAYOUT, COMPAT, session, f"{engine}-kv")


def _peer(agent: str, host: str, port: int, incarnation: int, remote: RemoteRegion) -> PeerInfo:
    return PeerInfo(
        agent=agent,
        incarnation=incarnation,
        host=host,
        port=port,
        lease_duration=LEASE,
        regions={(remote.engine_id, 0): remote},
        canary_addr=0,
        canary_bytes=0,
        handshaked_at=1.0,
        native_reads=True,  # one machine: a pull READs (`world(native_reads=False)`: by WRITE)
    )


P_REGION: Final = _local(P_ENGINE, P_GEO, P_GEN, P_SESSION)
D_REGION: Final = _local(D_ENGINE, D_GEO, D_GEN, D_SESSION)
P_INFO: Final = _peer(
    P_AGENT, P_HOST, P_PORT, P_INCARNATION, RemoteRegion(1, P_GEN, P_ENGINE, 0, 1, P_GEO, COMPAT)
)
"""P's daemon as D's registrar knows it."""
D_INFO: Final = _peer(
    D_AGENT, D_HOST, D_PORT, D_INCARNATION, RemoteRegion(9, D_GEN, D_ENGINE, 0, 1, D_GEO, COMPAT)
)
"""D's daemon as P's registrar knows it."""


# ------------------------------------------------------------------ fakes


class Recorder(Generic[T]):
    """What happened, in order; a test waits until what it expects is there."""

    def __init__(self) -> None:
        self.items: list[T] = []
        self._changed = anyio.Event()

    def add(self, item: T) -> None:
        self.items.append(item)
        self._changed.set()
        self._changed = anyio.Event()

    async def until(self, done: Callable[[list[T]], bool]) -> None:
        with anyio.fail_after(WAIT):
            while not done(self.items):
                await self._changed.wait()


class FakeClock(Clock):
    """Daemon time that moves only when the test advances it."""

    def __init__(self, start: float = 100.0) -> None:
        super().__init__()
        self.t = start

    def now(self) -> float:
        return self.t


@dataclass
class Transfer:
    """One transfer posted on the port: it is in flight until the test ends it."""

    op: str
    peer: str
    local: np.ndarray
    remote: np.ndarray
    notif: wire.Record | None
    nbytes: int
    _ended: anyio.Event = field(default_factory=anyio.Event)
    _error: KvdError | None = None

    def complete(self) -> None:
        self._ended.set()

    def fail(self, exc: KvdError) -> None:
        self._error = exc
        self._ended.set()

    async def wait(self) -> None:
        await self._ended.wait()
        if self._error is not None:
            raise self._error


class FakePort:
    """The transport port (`kvd.actors.transfers.Transport`) in memory."""

    def __init__(self) -> None:
        self.notifs: Recorder[tuple[str, wire.Record]] = Recorder()
        self.transfers: Recorder[Transfer] = Recorder()
        self._faults: dict[type[wire.Record], tuple[KvdError, Callable[[], None]]] = {}

    def fail_next(
        self, kind: type[wire.Record], exc: KvdError, before: Callable[[], None] = lambda: None
    ) -> None:
        """The next notification of `kind` raises `exc`, right after `before()` ran (with
        no await in between: what `before` sets up is what the failure path finds)."""
        self._faults[kind] = (exc, before)

    async def send_notif(self, peer: str, msg: bytes, trace_id: str = "") -> None:
        await anyio.lowlevel.checkpoint()  # the real port awaits its thread
        _, record = wire.decode(msg)
        fault = self._faults.pop(type(record), None)
        if fault is not None:
            exc, before = fault
            before()
            raise exc
        self.notifs.add((peer, record))

    def post_notif(
        self,
        peer: str,
        msg: bytes,
        done: Callable[[KvdError | None], None],
        trace_id: str = "",
        *,
        report_ok: bool = True,
    ) -> None:
        def later() -> None:  # the real port answers from its thread, later
            _, record = wire.decode(msg)
            fault = self._faults.pop(type(record), None)
            if fault is not None:
                exc, before = fault
                before()
                done(exc)
                return
            self.notifs.add((peer, record))
            if report_ok:
                done(None)

        asyncio.get_running_loop().call_soon(later)

    async def transfer(self, *args: Any, **kwargs: Any) -> XferTiming:
        return await self.submit(*args, **kwargs)

    def submit(
        self,
        op: str,
        local: np.ndarray,
        remote: np.ndarray,
        peer: str,
        notif: bytes,
        timeout: float,
        nbytes: int,
        local_mem: str = "DRAM",
        remote_mem: str = "DRAM",
        trace_id: str = "",
        settled: Callable[[], None] | None = None,
        *,
        post_by: float = 0.0,
    ) -> asyncio.Future[XferTiming]:
        """Handed over at once (as the real port: recorded before this returns); answered
        when the test ends it."""
        record = wire.decode(notif)[1] if notif else None
        xfer = Transfer(op, peer, local.copy(), remote.copy(), record, nbytes)
        self.transfers.add(xfer)

        async def answer() -> XferTiming:
            try:
                await xfer.wait()
            finally:
                if settled is not None:  # the fake's transfer ends with its answer
                    settled()
            return XferTiming(0.0, 0.001)

        return asyncio.ensure_future(answer())

    def sent(self, kind: type[R]) -> list[tuple[str, R]]:
        return [(peer, r) for peer, r in self.notifs.items if isinstance(r, kind)]

    async def wait_sent(self, kind: type[R], count: int = 1) -> list[tuple[str, R]]:
        await self.notifs.until(lambda _: len(self.sent(kind)) >= count)
        return self.sent(kind)

    async def wait_transfer(self, count: int = 1) -> Transfer:
        await self.transfers.until(lambda items: len(items) >= count)
        return self.transfers.items[count - 1]


class WatchedMailbox(Mailbox[Any]):
    """A mailbox that tells when a `SessionClosed` went in."""

    def __init__(self, name: str, size: int, clock: Clock) -> None:
        super().__init__(name, size, clock)
        self.close_posted = anyio.Event()
        self.not_taken: list[FinishNotTaken] = []

    def post(self, msg: Any) -> None:
        super().post(msg)
        if isinstance(msg, SessionClosed):
            self.close_posted.set()
        if isinstance(msg, FinishNotTaken):
            self.not_taken.append(msg)


class StubActor:
    """A stand-in for the registrar (or the EC router): answers `EnsurePeer` from a table
    of peers and `SessionClosed` at once, and keeps every message it got."""

    def __init__(self, name: str, clock: Clock, peers: tuple[PeerInfo, ...] = ()) -> None:
        self.box: Mailbox[Any] = Mailbox(name, SIZE, clock)
        self.peers = {p.addr: p for p in peers}
        self.got: Recorder[Any] = Recorder()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        async for msg in self.box:
            if isinstance(msg, EnsurePeer):
                info = self.peers.get(f"{msg.host}:{msg.port}")
                if info is None:
                    msg.fail(NotFound(f"no daemon at {msg.host}:{msg.port}"))
                else:
                    msg.resolve(info)
            elif isinstance(msg, SessionClosed):
                msg.resolve(None)
            self.got.add(msg)


def make_sender(
    clock: Clock,
    port: FakePort,
    registrar: StubActor,
    emit: Callable[[EventOut], None],
    mailbox: Mailbox[Any] | None = None,
) -> Sender:
    return Sender(
        transport=port,
        mailbox=mailbox or Mailbox("sender", SIZE, clock),
        registrar=registrar.box,
        emit=emit,
        lease_duration=LEASE,
        lease_wait_timeout=5.0,
        registration_timeout=REG_TIMEOUT,
        transfer_timeout=30.0,
        tombstones=1000,
        counters={},
    )


def make_receiver(
    clock: Clock, port: FakePort, registrar: StubActor, emit: Callable[[EventOut], None]
) -> Receiver:
    rx = Receiver(
        transport=port,
        mailbox=Mailbox("receiver", SIZE, clock),
        registrar=registrar.box,
        emit=emit,
        lease_duration=LEASE,
        probe_interval=1000.0,  # no probes: heartbeats alone tell whether P is there
        push_registration_timeout=REG_TIMEOUT,
        transfer_timeout=30.0,
        counters={},
        incarnation=D_INCARNATION,
        side_host=D_HOST,
        side_port_ref=lambda: D_PORT,
    )

    async def listening(host: str, port: int, timeout: float) -> bool | None:  # noqa: ASYNC109
        return True  # P's side channel accepts (a test that needs P gone swaps this)

    rx.side_listening = listening
    return rx


@dataclass
class World:
    """P's sender and D's receiver (of two different daemons, each with its own port),
    with what they know before a request arrives: their local regions and the peer."""

    clock: FakeClock
    registrar: StubActor
    events: Recorder[EventOut]
    p_port: FakePort
    d_port: FakePort
    sender: Sender
    receiver: Receiver

    async def advance(self, seconds: float) -> None:
        """Move daemon time on; both actors run their timers at the new time."""
        self.clock.t += seconds
        await snapshot(self.sender.mailbox)
        await snapshot(self.receiver.mailbox)

    def events_of(self, request_id: str) -> list[wire.Record]:
        return [
            e.record for e in self.events.items if getattr(e.record, "request_id", "") == request_id
        ]


@asynccontextmanager
async def world(native_reads: bool = True) -> AsyncIterator[World]:
    """`native_reads=False`: D's UCX would emulate a READ from P (TCP), so D pulls by
    P's WRITE (`transfer.pull_by = "auto"`)."""
    clock = FakeClock()
    p_info = replace(P_INFO, native_reads=native_reads)
    registrar = StubActor("registrar", clock, (p_info, D_INFO))
    events: Recorder[EventOut] = Recorder()
    p_port, d_port = FakePort(), FakePort()
    sender = make_sender(clock, p_port, registrar, events.add)
    receiver = make_receiver(clock, d_port, registrar, events.add)
    sender.mailbox.post(LocalRegionsChanged({(P_ENGINE, 0): P_REGION}))
    sender.mailbox.post(PeerUpdated(D_AGENT, D_INFO))
    receiver.mailbox.post(LocalRegionsChanged({(D_ENGINE, 0): D_REGION}))
    receiver.mailbox.post(PeerUpdated(P_AGENT, p_info))
    async with anyio.create_task_group() as tg:
        await tg.start(registrar.run)
        await tg.start(sender.run)
        await tg.start(receiver.run)
        yield World(clock, registrar, events, p_port, d_port, sender, receiver)
        tg.cancel_scope.cancel()


# ------------------------------------------------------------------ helpers


async def client(box: Mailbox[Any], session: str, msg: wire.Record) -> wire.Record:
    """A client request as the gateway routes it; the actor's answer."""
    with anyio.fail_after(WAIT):
        return await box.call(ClientRequest(session, msg))


async def snapshot(box: Mailbox[Any], section: str = "status") -> dict[str, Any]:
    """The actor's status; also wakes its loop (timers run at the clock's current time)."""
    with anyio.fail_after(WAIT):
        return await box.call(Snapshot(section))


async def settle() -> None:
    """Until every task waits: whatever the last step set off has run."""
    with anyio.fail_after(WAIT):
        await anyio.wait_all_tasks_blocked()


def fill(box: Mailbox[Any], make: Callable[[], Any]) -> list[Any]:
    """Post outside input into `box` until it is refused (the box is full); what went in."""
    posted: list[Any] = []
    for _ in range(2 * box.size):
        msg = make()
        try:
            box.post(msg)
        except Busy:
            return posted
        posted.append(msg)
    raise AssertionError(f"the {box.name} mailbox never refused outside input")


def registration(d_rid: str = "d-req", p_rid: str = "p-req") -> wire.PushRegistration:
    """D's registration for P's request `p_rid`, as D's daemon sends it."""
    return wire.PushRegistration(
        request_id=d_rid,
        remote_request_id=p_rid,
        engine_id=D_ENGINE,
        remote_engine_id=P_ENGINE,
        tp_size=1,
        block_ids=(5, 6),
        side_host=D_HOST,
        side_port=D_PORT,
        incarnation=D_INCARNATION,
        generations=(D_GEN,),
        p_session=P_SESSION,
        p_incarnation=P_INCARNATION,
    )


def track(rid: str = "d-req", p_rid: str = "p-req") -> wire.Track:
    return wire.Track(rid, D_ENGINE, P_HOST, P_PORT, P_ENGINE, p_rid, P_INCARNATION)


def register_push(rid: str = "d-req", p_rid: str = "p-req") -> wire.RegisterPush:
    return wire.RegisterPush(
        rid, D_ENGINE, (5, 6), P_HOST, P_PORT, P_ENGINE, p_rid, P_INCARNATION, P_SESSION
    )


def pull(rid: str = "d-req", p_rid: str = "p-req") -> wire.Pull:
    # D's blocks 5-6 take the last two of P's three blocks (P's first is a local hit on D)
    return wire.Pull(
        rid, D_ENGINE, (5, 6), P_HOST, P_PORT, P_ENGINE, p_rid, (0, 1, 2), P_INCARNATION, P_SESSION
    )


async def registered(w: World) -> None:
    """D: a push request tracked, registered, and its registration at P."""
    box = w.receiver.mailbox
    assert await client(box, D_SESSION, track()) == wire.Ok()
    assert await client(box, D_SESSION, register_push()) == wire.Ok()
    await w.d_port.wait_sent(wire.PushRegistration)
    transfers = await snapshot(box, "transfers")
    assert [r["state"] for r in transfers["receiving"]] == ["registered"]


def _span(descs: np.ndarray) -> tuple[int, int]:
    """(first address, bytes) of an Nx3 (addr, len, dev) descriptor array."""
    return int(descs[:, 0].min()), int(descs[:, 1].sum())


# ------------------------------------------------------------------ P: the sender


async def test_p_push_lease_then_registration_then_write_then_finished() -> None:
    async with world() as w:
        box = w.sender.mailbox
        assert await client(box, P_SESSION, wire.Finish("p-req", P_ENGINE, (0, 1))) == wire.Ok()
        status = await snapshot(box)
        assert (status["leases"], status["held"]) == (1, 1)

        box.post(NotifReceived(D_AGENT, registration()))
        xfer = await w.p_port.wait_transfer()
        assert (xfer.op, xfer.peer) == ("WRITE", D_AGENT)
        assert xfer.notif == wire.PushDone("d-req", 0, True, 0, "")  # D learns when bytes land
        assert xfer.nbytes == 2 * BLOCK
        assert _span(xfer.local) == (P_BASE, 2 * BLOCK)  # P's blocks 0-1...
        assert _span(xfer.remote) == (D_BASE + 5 * BLOCK, 2 * BLOCK)  # ...into D's 5-6
        status = await snapshot(box)
        # the lease is claimed: it cannot expire under the WRITE
        assert (status["leases"], status["writing"]) == (0, 1)
        assert w.events.items == []

        xfer.complete()
        await w.events.until(lambda evs: len(evs) == 1)
        assert w.events.items == [EventOut(P_SESSION, P_ENGINE, wire.SendFinished("p-req"))]
        status = await snapshot(box)
        assert status["leases"] == 0 and not any(status["states"].values())

        # ended: the same registration again (D never heard the PushDone its WRITE
        # carried) is answered at once with it, never written again; another
        # registration naming the request is refused
        box.post(NotifReceived(D_AGENT, registration()))
        [(peer, answer)] = await w.p_port.wait_sent(wire.PushDone)
        assert (peer, answer) == (D_AGENT, wire.PushDone("d-req", 0, True, 0, ""))
        box.post(NotifReceived(D_AGENT, registration(d_rid="d-other")))
        [_, (peer, answer)] = await w.p_port.wait_sent(wire.PushDone, 2)
        assert peer == D_AGENT and answer.request_id == "d-other" and not answer.ok
        await settle()
        assert len(w.p_port.transfers.items) == 1 and len(w.events.items) == 1


def watch_turns(w: World) -> list[int]:
    """The transfers P's port holds each time P's sender ends a turn of its loop (the
    actor's next wait for its mailbox), from now on."""
    box = w.sender.mailbox
    seen: list[int] = []
    wait = box.receive_before

    async def watched(deadline: float | None) -> Any:
        seen.append(len(w.p_port.transfers.items))
        return await wait(deadline)

    box.receive_before = watched  # type: ignore[method-assign]
    return seen


async def test_p_write_is_handed_to_the_port_in_the_turn_that_claimed_it() -> None:
    """Not by a task that would run only after whatever else the loop has to do."""
    async with world() as w:
        box = w.sender.mailbox
        assert await client(box, P_SESSION, wire.Finish("p-req", P_ENGINE, (0, 1))) == wire.Ok()
        seen = watch_turns(w)
        box.post(NotifReceived(D_AGENT, registration()))
        xfer = await w.p_port.wait_transfer()
        await settle()
        assert seen[0] == 1  # the turn that matched the registration posted the WRITE
        xfer.complete()
        await w.events.until(lambda evs: len(evs) == 1)
        assert w.events.items == [EventOut(P_SESSION, P_ENGINE, wire.SendFinished("p-req"))]


async def test_p_layer_write_is_handed_to_the_port_in_the_turn_of_its_notice() -> None:
    """Layer-wise push: the WRITE of a layer a worker announced is posted at the end of the
    turn that took the notice (the last layer's WRITE is on the request's path)."""
    async with world() as w:
        box = w.sender.mailbox
        box.post(NotifReceived(D_AGENT, registration()))  # D registered before P finished
        await settle()
        seen = watch_turns(w)
        saved = wire.LayersSaved(P_ENGINE, 0, 1, (wire.SavedRequest("p-req", (0, 1)),))
        box.post(LayersAnnounced(P_SESSION, saved))
        xfer = await w.p_port.wait_transfer()
        await settle()
        assert seen[0] == 1
        assert xfer.op == "WRITE" and xfer.notif == wire.LayersPushed(
            0, (wire.LayerRange("d-req", 0, 1),)
        )
        xfer.complete()
        await settle()
        assert len(w.p_port.transfers.items) == 1 and w.events.items == []


async def test_p_failed_write_fails_the_request_once_and_tells_d() -> None:
    async with world() as w:
        box = w.sender.mailbox
        await client(box, P_SESSION, wire.Finish("p-req", P_ENGINE, (0, 1)))
        box.post(NotifReceived(D_AGENT, registration()))
        xfer = await w.p_port.wait_transfer()
        xfer.fail(TransferError("remote access error"))

        [(peer, answer)] = await w.p_port.wait_sent(wire.PushDone)
        assert peer == D_AGENT
        assert answer == wire.PushDone("d-req", 0, False, ErrorCode.TRANSFER, "remote access error")
        failed = wire.SendFailed("p-req", ErrorCode.TRANSFER, "remote access error")
        assert w.events.items == [EventOut(P_SESSION, P_ENGINE, failed)]

        # D registers again (a retry): refused from the tombstone, never written again
        box.post(NotifReceived(D_AGENT, registration()))
        await w.p_port.wait_sent(wire.PushDone, 2)
        await w.advance(2 * LEASE)
        await settle()
        assert w.events_of("p-req") == [failed]
        assert len(w.p_port.transfers.items) == 1
        status = await snapshot(box)
        assert status["leases"] == 0 and not any(status["states"].values())


async def test_p_a_finish_refused_at_the_door_answers_ds_registration_at_once() -> None:
    """A finish refused before the machine saw it: by the sender's checks (a block outside
    the engine's region), or by the gateway with the sender's mailbox full (BUSY: the
    gateway posts `FinishNotTaken`, a notice that goes in however full the mailbox is).
    The engine has its error either way; D's registration for the request, whether it
    waited already or comes later, is answered failed at once with P's reason, not held
    to the registration timeout."""
    async with world() as w:
        box = w.sender.mailbox
        box.post(NotifReceived(D_AGENT, registration("d-1", "p-1")))  # D first: it waits
        await settle()
        bad = wire.Finish("p-1", P_ENGINE, (0, 10_000))
        with pytest.raises(InvalidRequest):
            await client(box, P_SESSION, bad)
        [(peer, answer)] = await w.p_port.wait_sent(wire.PushDone)
        assert (peer, answer.request_id, answer.ok) == (D_AGENT, "d-1", False)
        assert "refused the request's finish" in answer.reason
        # the gateway could not post a finish (the mailbox was full): its notice still goes in
        fillers = fill(box, lambda: ClientRequest("other", wire.Abort("x", P_ENGINE, "send")))
        box.post(FinishNotTaken("p-2", int(ErrorCode.BUSY), "the sender mailbox is full (4)"))
        for req in fillers:
            with anyio.fail_after(WAIT):
                await req.reply
        box.post(NotifReceived(D_AGENT, registration("d-2", "p-2")))  # D after
        sent = await w.p_port.wait_sent(wire.PushDone, 2)
        assert [(a.request_id, a.ok, a.code) for _, a in sent] == [
            ("d-1", False, ErrorCode.INVALID),
            ("d-2", False, ErrorCode.BUSY),
        ]
        assert sent[1][1].reason == (
            "P's daemon refused the request's finish: the sender mailbox is full (4)"
        )
        status = await snapshot(box)
        assert w.sender.counters["finishes_refused"] == 2
        assert status["leases"] == 0 and not any(status["states"].values())
        assert w.p_port.transfers.items == []


async def test_p_lease_is_extended_by_heartbeats_and_expires_without_them() -> None:
    async with world() as w:
        box = w.sender.mailbox
        await client(box, P_SESSION, wire.Finish("p-req", P_ENGINE, (0, 1)))  # t=100: until 112
        await w.advance(8.0)
        box.post(HeartbeatReceived(D_AGENT, wire.Heartbeat(("p-req",))))
        await snapshot(box)  # handled at t=108: until 108 + 2/3 x 12 = 116
        await w.advance(6.0)  # t=114: past the lease as granted, not as extended
        assert w.events.items == []
        assert (await snapshot(box))["leases"] == 1

        await w.advance(3.0)  # t=117
        assert w.events.items == [EventOut(P_SESSION, P_ENGINE, wire.SendExpired("p-req"))]

        # D's registration comes too late: refused, the blocks are never written
        box.post(NotifReceived(D_AGENT, registration()))
        [(_, answer)] = await w.p_port.wait_sent(wire.PushDone)
        assert not answer.ok and answer.code == ErrorCode.LEASE_EXPIRED
        await w.advance(LEASE)
        await settle()
        assert w.p_port.transfers.items == [] and len(w.events.items) == 1


async def test_p_session_close_is_answered_only_once_its_write_ended() -> None:
    async with world() as w:
        box = w.sender.mailbox
        await client(box, P_SESSION, wire.Finish("p-req", P_ENGINE, (0, 1)))
        await client(box, P_SESSION, wire.Finish("p-other", P_ENGINE, (2, 3)))
        box.post(NotifReceived(D_AGENT, registration()))
        xfer = await w.p_port.wait_transfer()

        close = SessionClosed(P_SESSION)
        box.post(close)
        await settle()
        status = await snapshot(box)
        # the held lease ended at once; the WRITE may still read the session's blocks
        assert (status["held"], status["writing"], status["leases"]) == (0, 1, 0)
        assert not close.reply.done()

        xfer.complete()
        with anyio.fail_after(WAIT):
            await close.reply
        assert w.events_of("p-req") == [wire.SendFinished("p-req")]
        assert w.events_of("p-other") == []  # its session is gone: no one to tell

        # D registers for the other request only now: refused, never written
        box.post(NotifReceived(D_AGENT, registration("d-other", "p-other")))
        [(_, answer)] = await w.p_port.wait_sent(wire.PushDone)
        assert answer.request_id == "d-other" and not answer.ok
        await settle()
        assert len(w.p_port.transfers.items) == 1


# ------------------------------------------------------------------ D: the receiver


async def test_d_push_track_then_registration_then_push_done_then_finished() -> None:
    async with world() as w:
        box = w.receiver.mailbox
        assert await client(box, D_SESSION, track()) == wire.Ok()
        # heartbeats start at once, naming P's request id
        [(peer, beat)] = await w.d_port.wait_sent(wire.Heartbeat)
        assert peer == P_AGENT and beat.request_ids == ("p-req",)

        assert await client(box, D_SESSION, register_push()) == wire.Ok()
        [(peer, reg)] = await w.d_port.wait_sent(wire.PushRegistration)
        assert peer == P_AGENT
        assert reg == registration()  # what the P tests feed the sender
        assert w.events.items == []

        box.post(NotifReceived(P_AGENT, wire.PushDone("d-req", 0, True, 0, "")))
        await w.events.until(lambda evs: len(evs) == 1)
        assert w.events.items == [EventOut(D_SESSION, D_ENGINE, wire.RecvFinished("d-req"))]

        # a duplicate answer changes nothing; heartbeats for it stopped
        box.post(NotifReceived(P_AGENT, wire.PushDone("d-req", 0, True, 0, "")))
        await w.advance(LEASE)
        await settle()
        assert len(w.events.items) == 1
        assert len(w.d_port.sent(wire.Heartbeat)) == 1
        assert (await snapshot(box))["tracked"] == 0


async def test_d_a_load_refused_at_the_door_stops_its_tracks_heartbeats() -> None:
    """D's engine tracked a request (heartbeats keep P's lease), then its registration was
    refused at the door (a block outside D's region; or BUSY at the gateway, which posts
    `LoadNotTaken`). The engine has its error and will not abort the request here: before,
    the track heartbeated P's lease on for as long as D's session lived, holding P's
    blocks. Now it is dropped as an abort drops it: P is told it may free the blocks, and
    no event is sent (the engine had its answer)."""
    async with world() as w:
        box = w.receiver.mailbox
        assert await client(box, D_SESSION, track()) == wire.Ok()
        await w.d_port.wait_sent(wire.Heartbeat)
        bad = replace(register_push(), block_ids=(5, 10_000))
        with pytest.raises(InvalidRequest):
            await client(box, D_SESSION, bad)
        [(peer, cancel)] = await w.d_port.wait_sent(wire.CancelRegistration)
        assert (peer, cancel) == (P_AGENT, wire.CancelRegistration("p-req"))
        # the gateway could not post a pull (BUSY): its notice drops the other track
        assert await client(box, D_SESSION, track("d-2", "p-2")) == wire.Ok()
        box.post(LoadNotTaken(D_SESSION, "d-2"))
        sent = await w.d_port.wait_sent(wire.CancelRegistration, 2)
        assert sent[1] == (P_AGENT, wire.CancelRegistration("p-2"))
        beats = len(w.d_port.sent(wire.Heartbeat))
        await w.advance(2 * LEASE)
        await settle()
        assert len(w.d_port.sent(wire.Heartbeat)) == beats  # no more heartbeats
        assert (await snapshot(box))["tracked"] == 0
        assert w.events.items == []
        assert w.receiver.counters["tracks_dropped_refused"] == 2


async def test_d_pull_read_then_pull_done_then_ack_then_finished() -> None:
    async with world() as w:
        box = w.receiver.mailbox
        assert await client(box, D_SESSION, pull()) == wire.Ok()
        xfer = await w.d_port.wait_transfer()
        assert (xfer.op, xfer.peer, xfer.notif) == ("READ", P_AGENT, None)
        assert _span(xfer.local) == (D_BASE + 5 * BLOCK, 2 * BLOCK)  # into D's 5-6...
        assert _span(xfer.remote) == (P_BASE + 1 * BLOCK, 2 * BLOCK)  # ...from P's 1-2
        await settle()
        assert w.d_port.sent(wire.PullDone) == []  # P hears only once the bytes are in

        xfer.complete()
        [(peer, done)] = await w.d_port.wait_sent(wire.PullDone)
        assert peer == P_AGENT and done == wire.PullDone(
            "p-req", "d-req", (P_GEN,), P_SESSION, P_INCARNATION
        )
        assert w.events.items == []  # done only once P says its lease still held

        box.post(NotifReceived(P_AGENT, wire.PullAck("d-req", True, 0, "")))
        await w.events.until(lambda evs: len(evs) == 1)
        assert w.events.items == [EventOut(D_SESSION, D_ENGINE, wire.RecvFinished("d-req"))]


async def test_d_names_the_p_it_planned_against_when_the_engine_names_none() -> None:
    """kv_transfer_params may carry no P incarnation. D's registration (and every repeat
    of it) and its pull completion then name the incarnation of the P daemon whose
    regions D planned against, so a P daemon that replaced it under the same agent name
    refuses them at once instead of keeping a registration for a finish that never comes
    (`Sender._earlier_incarnation`)."""
    async with world() as w:
        box = w.receiver.mailbox
        push = replace(register_push(), remote_incarnation=0)
        assert await client(box, D_SESSION, replace(track(), remote_incarnation=0)) == wire.Ok()
        assert await client(box, D_SESSION, push) == wire.Ok()
        [(_, reg)] = await w.d_port.wait_sent(wire.PushRegistration)
        assert reg.p_incarnation == P_INCARNATION
        await settle()  # it was sent (D repeats it a heartbeat interval after that)
        await w.advance(LEASE / 6 + 0.01)  # no answer yet: D repeats it
        sent = await w.d_port.wait_sent(wire.PushRegistration, 2)
        assert [r.p_incarnation for _, r in sent] == [P_INCARNATION, P_INCARNATION]

        got = await client(box, D_SESSION, replace(pull("d-pull", "p-pull"), remote_incarnation=0))
        assert got == wire.Ok()
        xfer = await w.d_port.wait_transfer()
        xfer.complete()
        [(_, done)] = await w.d_port.wait_sent(wire.PullDone)
        assert done.p_incarnation == P_INCARNATION


async def test_a_pull_where_ucx_would_emulate_the_read_goes_by_ps_write() -> None:
    """Over TCP UCX emulates a READ, and a reader dying with GET requests queued at P
    aborts P's daemon inside UCX (`kvd.core.readpath`). There D's pull is a registration
    naming P's blocks, and P WRITEs them as for a push: no READ is ever posted."""
    async with world(native_reads=False) as w:
        p_box, d_box = w.sender.mailbox, w.receiver.mailbox
        assert (
            await client(p_box, P_SESSION, wire.Finish("p-req", P_ENGINE, (0, 1, 2))) == wire.Ok()
        )
        assert await client(d_box, D_SESSION, pull()) == wire.Ok()
        [(peer, reg)] = await w.d_port.wait_sent(wire.PushRegistration)
        assert peer == P_AGENT
        assert reg == replace(registration(), p_block_ids=(0, 1, 2))
        assert w.d_port.transfers.items == [] and w.d_port.sent(wire.PullDone) == []
        assert w.receiver.counters["pulls_by_write"] == 1

        p_box.post(NotifReceived(D_AGENT, reg))
        xfer = await w.p_port.wait_transfer()
        assert (xfer.op, xfer.peer) == ("WRITE", D_AGENT)
        assert xfer.notif == wire.PushDone("d-req", 0, True, 0, "")
        assert _span(xfer.local) == (P_BASE + 1 * BLOCK, 2 * BLOCK)  # P's 1-2 (as the READ)...
        assert _span(xfer.remote) == (D_BASE + 5 * BLOCK, 2 * BLOCK)  # ...into D's 5-6
        assert w.sender.counters["pull_registrations"] == 1
        xfer.complete()
        await w.events.until(lambda evs: len(evs) == 1)
        assert w.events.items == [EventOut(P_SESSION, P_ENGINE, wire.SendFinished("p-req"))]

        d_box.post(NotifReceived(P_AGENT, xfer.notif))
        await w.events.until(lambda evs: len(evs) == 2)
        assert w.events.items[1] == EventOut(D_SESSION, D_ENGINE, wire.RecvFinished("d-req"))
        assert w.d_port.transfers.items == []


async def test_p_refuses_a_pull_by_write_naming_blocks_it_did_not_lease() -> None:
    """A READ reaches whatever P blocks D names; a pull by WRITE is checked: only blocks P
    leased for the request are sent, anything else fails the request on both sides."""
    async with world() as w:
        box = w.sender.mailbox
        assert await client(box, P_SESSION, wire.Finish("p-req", P_ENGINE, (0, 1))) == wire.Ok()
        box.post(NotifReceived(D_AGENT, replace(registration(), p_block_ids=(1, 7))))
        [(peer, answer)] = await w.p_port.wait_sent(wire.PushDone)
        assert peer == D_AGENT and not answer.ok and answer.code == ErrorCode.INVALID
        assert "did not lease" in answer.reason
        await w.events.until(lambda evs: len(evs) == 1)
        [ev] = w.events.items
        assert isinstance(ev.record, wire.SendFailed) and ev.record.code == ErrorCode.INVALID
        await settle()
        assert w.p_port.transfers.items == []
        assert w.sender.counters["notifs_rejected"] == 1


async def test_d_failed_read_fails_the_request_once_with_its_blocks() -> None:
    async with world() as w:
        box = w.receiver.mailbox
        await client(box, D_SESSION, pull())
        xfer = await w.d_port.wait_transfer()
        xfer.fail(TransferError("remote access error"))

        await w.events.until(lambda evs: len(evs) == 1)
        failed = wire.RecvFailed("d-req", ErrorCode.TRANSFER, "remote access error", (5, 6))
        assert w.events.items == [EventOut(D_SESSION, D_ENGINE, failed)]
        # P is told to free its blocks now, not after a lease without heartbeats
        [(peer, cancel)] = await w.d_port.wait_sent(wire.CancelRegistration)
        assert peer == P_AGENT and cancel == wire.CancelRegistration("p-req")

        # nothing later revives it: a stray ack, time passing
        box.post(NotifReceived(P_AGENT, wire.PullAck("d-req", True, 0, "")))
        await w.advance(2 * LEASE)
        await settle()
        assert w.events_of("d-req") == [failed]
        assert w.d_port.sent(wire.PullDone) == [] and len(w.d_port.transfers.items) == 1


async def test_d_registration_times_out_once_and_a_late_write_is_ignored() -> None:
    async with world() as w:
        await registered(w)  # at t=100: until 120
        await w.advance(REG_TIMEOUT - 1.0)
        assert w.events.items == []
        await w.advance(2.0)
        # P must not WRITE into the blocks later: the registration is withdrawn, and
        # once more through a fresh view when P answers as itself (not provably gone)
        sent = await w.d_port.wait_sent(wire.CancelRegistration, 2)
        assert sent == [(P_AGENT, wire.CancelRegistration("p-req"))] * 2
        # its WRITE may be in flight: the engine hears nothing yet
        await w.advance(LEASE)
        await settle()
        assert w.events.items == []
        assert w.receiver.snapshot("", 0.0)["holding"] == 1

        # P's answer to the cancel (sent once its WRITE ended) ends the request
        box = w.receiver.mailbox
        box.post(NotifReceived(P_AGENT, wire.PushDone("d-req", 0, False, 4, "cancelled")))
        await settle()
        assert len(w.events.items) == 1
        ev = w.events.items[0].record
        assert isinstance(ev, wire.RecvFailed)
        assert (ev.request_id, ev.code, ev.block_ids) == ("d-req", ErrorCode.TIMEOUT, (5, 6))
        # a later answer is counted, never reported
        box.post(NotifReceived(P_AGENT, wire.PushDone("d-req", 0, True, 0, "")))
        await w.advance(2 * LEASE)
        await settle()
        assert len(w.events.items) == 1
        assert w.receiver.counters["late_answers"] == 1


async def refused(host: str, port: int, timeout: float) -> bool | None:  # noqa: ASYNC109
    """P's side channel refuses connections: its daemon is gone (`side_listening`)."""
    return False


async def test_d_held_push_ends_at_once_when_ps_side_channel_refuses() -> None:
    async with world() as w:
        w.receiver.side_listening = refused
        await registered(w)
        await w.advance(REG_TIMEOUT + 1.0)
        await settle()
        (item,) = w.events.items
        assert isinstance(item.record, wire.RecvFailed)
        assert w.receiver.counters["holds_released_gone"] == 1


async def test_d_request_ending_during_a_receive_permute_is_told_only_after_it() -> None:
    """D's bytes are being permuted in place into D's layout when D's watchdog ends the
    request: the engine must not hear of the end (and reuse the blocks) while the permute
    can still write into them."""
    async with world() as w:
        w.receiver.side_listening = refused  # P proven gone: the request ends at the watchdog
        await registered(w)  # at t=100: the registration times out at 120
        gate, started = anyio.Event(), anyio.Event()

        async def slow_permute(jobs: list[Any]) -> None:
            started.set()
            await gate.wait()

        w.receiver._permute = slow_permute  # type: ignore[method-assign]
        view = w.receiver.proto.reqs["d-req"].view
        view.permutes[0] = [("region", "job")]  # type: ignore[union-attr]
        box = w.receiver.mailbox
        box.post(NotifReceived(P_AGENT, wire.PushDone("d-req", 0, True, 0, "")))
        with anyio.fail_after(WAIT):
            await started.wait()
        await w.advance(REG_TIMEOUT + 1.0)  # the watchdog ends the request meanwhile
        await settle()
        assert w.events.items == []  # held back: the permute still writes into the blocks
        assert w.receiver.counters["events_held_for_permute"] == 1

        gate.set()
        await w.events.until(lambda evs: len(evs) == 1)
        await w.advance(1.0)
        await settle()
        [ev] = w.events_of("d-req")
        assert isinstance(ev, wire.RecvFailed) and ev.code == ErrorCode.TIMEOUT
        assert w.receiver._permuting == {}


class nixlNotFoundError(Exception):
    """What NIXL raises when it holds no metadata for the agent (or memory) named (named
    as NIXL's own: `translate` reads the name)."""


async def test_d_push_through_a_view_forgotten_meanwhile_handshakes_again_once() -> None:
    """P restarted while D was idle. D's next requests resolve its cached P; the first
    heartbeat finds that P gone and the registrar forgets it (NIXL unloads the agent), so a
    registration resolved through the old view just before is posted to an agent NIXL no
    longer knows: NIXL_ERR_NOT_FOUND. That is a stale view like a dead one: the request
    handshakes once more, reaches the new P and finishes (it used to fail with NOT_FOUND).
    Nothing is forgotten for it: the registrar's view, if any, is newer."""
    new_p = replace(P_INFO, incarnation=P_INCARNATION + 1, handshaked_at=P_INFO.handshaked_at + 5)
    async with world() as w:
        box = w.receiver.mailbox

        def forgotten() -> None:  # what the registrar did meanwhile: P's next handshake finds
            w.registrar.peers[P_INFO.addr] = new_p  # the restarted P
            box.post(PeerUpdated(P_AGENT, None))

        unknown = translate(nixlNotFoundError("NIXL_ERR_NOT_FOUND"), posting=True)
        w.d_port.fail_next(wire.PushRegistration, unknown, before=forgotten)
        # kv_transfer_params from before P's restart, without its incarnation (as kvd demo's)
        push = replace(register_push(), remote_incarnation=0, remote_session="")
        assert await client(box, D_SESSION, track()) == wire.Ok()
        assert await client(box, D_SESSION, push) == wire.Ok()

        [(peer, reg)] = await w.d_port.wait_sent(wire.PushRegistration)
        # planned again against the new P, and naming it
        inc = new_p.incarnation
        assert peer == P_AGENT and reg == replace(registration(), p_session="", p_incarnation=inc)
        lookups = [m.refresh for m in w.registrar.got.items if isinstance(m, EnsurePeer)]
        # the first beat's lookup (the request resolved through the view the receiver holds,
        # without asking), then one fresh handshake
        assert lookups == [False, True]
        box.post(PeerUpdated(P_AGENT, new_p))
        box.post(NotifReceived(P_AGENT, wire.PushDone("d-req", 0, True, 0, "")))
        await w.events.until(lambda evs: len(evs) == 1)
        assert w.events.items == [EventOut(D_SESSION, D_ENGINE, wire.RecvFinished("d-req"))]
        assert w.receiver.counters["peer_rehandshakes"] == 1
        assert not any(isinstance(m, PeerLost) for m in w.registrar.got.items)


async def test_d_session_close_withdraws_the_registration_and_waits_for_p() -> None:
    async with world() as w:
        await registered(w)
        box = w.receiver.mailbox
        close = SessionClosed(D_SESSION)
        box.post(close)
        [(peer, cancel)] = await w.d_port.wait_sent(wire.CancelRegistration)
        assert peer == P_AGENT and cancel == wire.CancelRegistration("p-req")
        await w.advance(9.0)
        # P may be writing into the session's blocks right now: not closed yet
        assert not close.reply.done() and w.events.items == []

        await w.advance(2.0)  # P never answered the cancel: held (its WRITE may still run)
        await settle()
        assert not close.reply.done() and w.events.items == []
        await w.advance(w.receiver.proto.hold_bound)  # P never answered at all: the bound
        with anyio.fail_after(WAIT):
            await close.reply
        [ev] = w.events_of("d-req")
        assert isinstance(ev, wire.RecvFailed) and ev.block_ids == (5, 6)
        box.post(NotifReceived(P_AGENT, wire.PushDone("d-req", 0, True, 0, "")))
        await settle()
        assert len(w.events.items) == 1


# ------------------------------------------------------------------ regressions


async def test_peer_lost_in_a_heartbeat_task_reaches_full_mailboxes() -> None:
    """Old design: the reaper's heartbeat task, finding P gone, called `_peer_failed`,
    which posted `PeerLost` into the writer's and the registrar's mailboxes with the
    refusable `post`, inside the task's `except`. With a mailbox full, `post` raised Busy
    out of the task, and the task group took the whole daemon down. Now `PeerLost` and the
    outcome of the actor's own work are notices, never refused. Here the receiver finds P
    gone while heartbeating just as both mailboxes it posts into, the registrar's and its
    own, are full of outside input."""
    async with world() as w:
        w.receiver.side_listening = refused  # the loss is proven: the request ends at once
        await registered(w)
        fillers: list[Any] = []

        def fill_both() -> None:
            fillers.extend(fill(w.registrar.box, lambda: ProbeReceived("x", wire.Probe(1, False))))
            fillers.extend(
                fill(
                    w.receiver.mailbox,
                    lambda: ClientRequest(D_SESSION, wire.Abort("other", D_ENGINE, "recv")),
                )
            )

        gone = PeerDisconnected("RemoteDisconnect: kvd-p is gone")
        w.d_port.fail_next(wire.Heartbeat, gone, before=fill_both)
        await w.advance(HB)  # the next heartbeat is due
        await w.events.until(lambda evs: len(evs) == 1)

        assert len(fillers) == 2 * SIZE
        # the registrar got the loss (and forgets the view), after the outside input
        await w.registrar.got.until(lambda got: any(isinstance(m, PeerLost) for m in got))
        lost = [m for m in w.registrar.got.items if isinstance(m, PeerLost)]
        assert lost == [PeerLost(P_AGENT, gone.message, P_INFO.handshaked_at)]
        # what waited on P failed, once, with its blocks to recompute
        ev = w.events.items[0].record
        assert isinstance(ev, wire.RecvFailed)
        assert (ev.request_id, ev.code, ev.block_ids) == ("d-req", ErrorCode.TRANSFER, (5, 6))
        # and the actor is still serving: the outside input is answered, then a status call
        with anyio.fail_after(WAIT):
            for req in fillers[SIZE:]:
                assert await req.reply == wire.Ok()
        assert (await snapshot(w.receiver.mailbox))["tracked"] == 0
        await settle()
        assert len(w.events.items) == 1


async def test_view_updates_reach_full_mailboxes() -> None:
    """Old daemon.py: `_publish` posted each registrar view with the refusable `post` and,
    when a mailbox was full, logged `view_update_dropped` and dropped it. The actor kept a
    stale view until the next change, if one ever came: a sender refusing leases on a
    region just registered, or planning through a peer view that had changed. Now a view
    update is a notice: it goes in however full the mailbox is."""
    daemon = Daemon(Config(daemon=DaemonConfig(mailbox_size=SIZE)))
    boxes = (daemon.sender_box, daemon.receiver_box, daemon.ec_box)
    fillers = {
        box.name: fill(box, lambda: ClientRequest("s", wire.Abort("other", P_ENGINE, "send")))
        for box in boxes
    }
    regions = LocalRegionsChanged({(P_ENGINE, 0): P_REGION})
    peer = PeerUpdated(D_AGENT, D_INFO)
    daemon._publish(regions)
    daemon._publish(peer)
    assert "view_updates_dropped" not in daemon.counters

    ec = [daemon.ec_box.receive_nowait() for _ in range(daemon.ec_box.depth())]
    # the EC router takes local regions, and peer views (a producer serves through them)
    assert ec == [*fillers["ecrouter"], regions, peer]
    # the sender and the receiver drain theirs and act on both views
    async with anyio.create_task_group() as tg:
        await tg.start(daemon.sender.run)
        await tg.start(daemon.receiver.run)
        with anyio.fail_after(WAIT):
            for req in fillers["sender"] + fillers["receiver"]:
                assert await req.reply == wire.Ok()
        for box in (daemon.sender_box, daemon.receiver_box):
            await snapshot(box)  # queued behind the views: they have been handled
            assert box.depth() == 0
        tg.cancel_scope.cancel()
    for actor in (daemon.sender, daemon.receiver):
        assert actor.local == regions.regions
        assert actor.peers == {D_AGENT: D_INFO}


@dataclass
class GatewayLink:
    """P's actors (the sender on a mailbox of `SIZE`, whose loop a test starts when it
    wants) behind a real gateway on a real ipc:// socket, and one DEALER client of it."""

    gateway: Gateway
    sock: zmq.asyncio.Socket
    counters: dict[str, int]
    box: WatchedMailbox
    sender: Sender
    actors: tuple[Any, ...]

    async def open(self, tg: anyio.abc.TaskGroup) -> None:
        """Start every actor but the sender, publish P's region, and say Hello."""
        for actor in self.actors:
            await tg.start(actor.run)
        self.box.post(LocalRegionsChanged({(P_ENGINE, 0): P_REGION}))
        await self.ask(wire.Hello(P_SESSION, "scheduler", P_ENGINE, 0, os.getpid(), "test"), 1)
        corr, welcomed = await self.answer()
        assert corr == 1 and isinstance(welcomed, wire.Welcome)

    async def ask(self, msg: wire.Record, corr: int) -> None:
        await self.sock.send(wire.encode(msg, corr))

    async def answer(self) -> tuple[int, wire.Record]:
        with anyio.fail_after(WAIT):
            return wire.decode(await self.sock.recv())


@asynccontextmanager
async def gateway_link(tmp_path: Path) -> AsyncIterator[GatewayLink]:
    clock = FakeClock()
    counters: dict[str, int] = {}
    registrar = StubActor("registrar", clock)
    ecrouter = StubActor("ecrouter", clock)
    events: Mailbox[EventOut] = Mailbox("events", 1024, clock)
    box = WatchedMailbox("sender", SIZE, clock)
    sender = make_sender(clock, FakePort(), registrar, events.post, box)
    receiver = make_receiver(clock, FakePort(), registrar, events.post)
    path = str(tmp_path / "kvd.sock")

    async def no_status(section: str) -> dict[str, Any]:
        return {}

    def welcome() -> wire.Welcome:
        return wire.Welcome("test", P_AGENT, P_HOST, P_PORT, LEASE, "", 0, P_INCARNATION, 60.0, 1.0)

    gateway = Gateway(
        socket_path=path,
        socket_mode=0o600,
        registrar=registrar.box,
        sender=box,
        receiver=receiver.mailbox,
        ecrouter=ecrouter.box,
        events=events,
        client_timeout=60.0,
        max_frame=1 << 20,
        counters=counters,
        rejects=RejectLog(counters, 60.0),
        status=no_status,
        welcome=welcome,
        clock=clock,
        close_bound=WAIT,
    )
    gateway.bind()
    sock = zmq.asyncio.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"ipc://{path}")
    try:
        yield GatewayLink(
            gateway, sock, counters, box, sender, (registrar, ecrouter, receiver, gateway)
        )
    finally:
        sock.close(0)
        gateway.close()


async def test_session_close_reaches_a_full_sender_mailbox(tmp_path: Path) -> None:
    """Old gateway (first design): closing a session posted `SessionClosed` with the
    refusable `post`; on Busy it retried by hand from a task, 100 times 50 ms apart, then
    logged `session_close_lost` and gave up. A sender busy for 5 s kept the session's
    leases until they expired, and nothing ever answered the close. Now `SessionClosed`
    is a notice: it goes into the full mailbox at once, and the client's Goodbye is
    answered once every owner ended what the session announced.

    The real gateway on a real ipc:// socket; the sender's loop starts only once its
    mailbox is full and the close is in it."""
    async with gateway_link(tmp_path) as link, anyio.create_task_group() as tg:
        box, sender = link.box, link.sender
        await link.open(tg)
        for i in range(SIZE + 1):
            await link.ask(wire.Finish(f"p-req-{i}", P_ENGINE, (i,)), 10 + i)
        # the finishes wait in the sender's mailbox, but one too many
        busy_corr, busy = await link.answer()
        assert isinstance(busy, wire.ErrorReply) and busy.code == ErrorCode.BUSY

        await link.ask(wire.Goodbye(P_SESSION), 30)
        # the close goes into the full mailbox at once
        with anyio.fail_after(WAIT):
            await box.close_posted.wait()
        # the view, the finishes, the refused finish's notice, the close
        assert box.depth() == SIZE + 3
        assert box.stats()["outside"] == SIZE
        assert busy_corr == 10 + SIZE  # the view took no room from the finishes
        # the sender hears of the finish refused BUSY (D must not wait for it)
        [not_taken] = box.not_taken
        assert (not_taken.request_id, not_taken.code) == (f"p-req-{SIZE}", ErrorCode.BUSY)

        await tg.start(sender.run)
        replies = dict([await link.answer() for _ in range(SIZE + 1)])
        assert replies == {corr: wire.Ok() for corr in (*range(10, 10 + SIZE), 30)}
        # the leases were granted, then ended with the session
        assert sender.counters["leases_granted"] == SIZE
        assert sender.counters["finishes_refused"] == 1
        status = await snapshot(box)
        assert status["leases"] == 0 and not any(status["states"].values())
        assert "session_close_overdue" not in link.counters
        # closed: a keep-alive naming it is answered NOT_FOUND
        await link.ask(wire.KeepAlive(P_SESSION), 40)
        corr, gone = await link.answer()
        assert corr == 40 and isinstance(gone, wire.ErrorReply)
        assert gone.code == ErrorCode.NOT_FOUND
        assert link.counters["keepalives_unknown_session"] == 1
        tg.cancel_scope.cancel()


async def test_refused_finishes_notices_are_bounded(tmp_path: Path) -> None:
    """A flood of finishes refused BUSY: each is reported to the sender (a notice that
    goes into the full mailbox) only while the mailbox holds fewer than
    `NOT_TAKEN_DEPTH` times its size; past that the notice is dropped and counted
    (`refusals_unrecorded`), so a client cannot grow the sender's mailbox without bound.
    Every finish is answered; the sender, once it runs, records each notice it got."""
    flood = 5 * SIZE
    async with gateway_link(tmp_path) as link, anyio.create_task_group() as tg:
        box, sender = link.box, link.sender
        await link.open(tg)
        for i in range(SIZE + flood):
            await link.ask(wire.Finish(f"p-req-{i}", P_ENGINE, (i,)), 10 + i)
        refused = dict([await link.answer() for _ in range(flood)])
        assert sorted(refused) == list(range(10 + SIZE, 10 + SIZE + flood))
        assert all(
            isinstance(r, wire.ErrorReply) and r.code == ErrorCode.BUSY for r in refused.values()
        )
        # the view and SIZE finishes were in; notices fill it to the bound, no further
        bound = NOT_TAKEN_DEPTH * SIZE
        assert box.depth() == bound
        noticed = bound - (SIZE + 1)
        assert [n.request_id for n in box.not_taken] == [
            f"p-req-{i}" for i in range(SIZE, SIZE + noticed)
        ]
        assert link.counters["refusals_unrecorded"] == flood - noticed

        await tg.start(sender.run)
        accepted = dict([await link.answer() for _ in range(SIZE)])
        assert accepted == {corr: wire.Ok() for corr in range(10, 10 + SIZE)}
        await snapshot(box)  # behind every notice in the mailbox
        assert sender.counters["finishes_refused"] == noticed
        assert sender.counters["leases_granted"] == SIZE
        tg.cancel_scope.cancel()


async def test_a_registration_flood_is_refused_at_intake_and_never_queued() -> None:
    """The notifier charges each registration to the sender's pending budget before it
    posts it: what does not fit is answered BUSY at once through the port and never
    enters the sender's mailbox, so the mailbox holds no more than the budget, even when
    a whole flood arrives in one NIXL batch (the sender cannot run in between). The
    sender adopts what it keeps and releases what it drops (an agent that never
    handshaked); a registration for a lease it holds is served as before."""
    async with world() as w:
        budget = w.sender.proto.budget = PendingBudget(1 << 20)
        counters = w.sender.counters
        notifier = Notifier(
            sender=w.sender.mailbox,
            receiver=w.receiver.mailbox,
            registrar=w.registrar.box,
            max_frame=1 << 22,
            counters=counters,
            rejects=RejectLog(counters, 10.0),
            clock=w.clock,
            budget=budget,
            transport=w.p_port,
        )
        big = [
            replace(registration(f"f{i}", f"fp{i}"), block_ids=tuple(range(4096)))
            for i in range(300)
        ]
        cost = record_cost(big[0])
        fits = (1 << 20) // cost
        notifier.sink(D_AGENT, [wire.encode(r) for r in big])
        # 6 of 300 were posted (one may already be handed to the sender's waiting loop)
        assert fits == 6 and w.sender.mailbox.depth() in (fits - 1, fits)
        assert budget.used == fits * cost and budget.refused == 300 - fits
        assert counters["limit_pending_bytes_refused"] == 300 - fits
        refusals = await w.p_port.wait_sent(wire.PushDone, 300 - fits)
        assert {r.request_id for _, r in refusals} == {f"f{i}" for i in range(fits, 300)}
        assert all(
            peer == D_AGENT and not r.ok and r.code == ErrorCode.BUSY for peer, r in refusals
        )
        assert all("limits.pending_bytes reached" in r.reason for _, r in refusals)
        status = await snapshot(w.sender.mailbox)
        assert status["pending_registrations"] == fits  # kept: their reservations adopted
        assert budget.used == fits * cost
        # an agent that never handshaked: reserved at intake, released by the sender
        notifier.sink("kvd-stranger", [wire.encode(registration("s1", "sp1"))])
        assert budget.used > fits * cost
        await snapshot(w.sender.mailbox)
        assert budget.used == fits * cost and counters["notifs_rejected"] == 1
        # a real push still goes through beside the flood: P's lease, D's registration
        assert (
            await client(w.sender.mailbox, P_SESSION, wire.Finish("p-req", P_ENGINE, (1, 2, 3)))
            == wire.Ok()
        )
        notifier.sink(D_AGENT, [wire.encode(registration())])
        xfer = await w.p_port.wait_transfer()
        xfer.complete()
        done = [e.record for e in await _events(w, "p-req")]
        assert done == [wire.SendFinished("p-req")]
        # D gives up on the flood: everything goes back
        notifier.sink(D_AGENT, [wire.encode(wire.CancelRegistration(f"fp{i}")) for i in range(300)])
        await snapshot(w.sender.mailbox)
        assert budget.used == 0 and w.sender.proto.reqs == {}


async def _events(w: World, rid: str) -> list[EventOut]:
    await w.events.until(
        lambda items: any(getattr(e.record, "request_id", "") == rid for e in items)
    )
    return [e for e in w.events.items if getattr(e.record, "request_id", "") == rid]


# ------------------------------------------------------------------ the transfer book


class UnsettledPort(FakePort):
    """A transfer answered Unsettled (UCX still works on it): its end comes later, when the
    test calls `end()`."""

    def __init__(self) -> None:
        super().__init__()
        self.ends: list[Callable[[], None]] = []

    def submit(  # type: ignore[override]
        self, *args: Any, settled: Callable[[], None] | None = None, **kwargs: Any
    ) -> asyncio.Future[XferTiming]:
        assert settled is not None  # the book always asks to hear the end
        self.ends.append(settled)
        answer: asyncio.Future[XferTiming] = asyncio.get_running_loop().create_future()
        answer.set_exception(Unsettled("still in flight"))
        return answer


def _one_block(empty: bool = False) -> Plan:
    n = 0 if empty else 1
    return Plan(
        np.array([P_BASE] * n, dtype=np.int64),
        np.array([D_BASE] * n, dtype=np.int64),
        np.array([BLOCK] * n, dtype=np.int64),
    )


def _start_one(book: TransferBook, rid: str, empty: bool, ended: list[bool]) -> Running:
    """P's blocks to D's in one transfer carrying a PushDone (none posted when `empty`);
    `ended` gets True each time the book says nothing more of it can land."""
    remote = RemoteRegion(9, D_GEN, D_ENGINE, 0, 1, D_GEO, COMPAT)
    note = wire.encode(wire.PushDone("d-req", 0, True, 0, ""))
    return book.start(
        "WRITE",
        rid,
        D_AGENT,
        [P_REGION],
        [remote],
        [_one_block(empty)],
        [note],
        lambda: ended.append(True),
    )


async def test_the_book_hands_a_transfer_over_before_start_returns() -> None:
    """`start` posts on the caller's turn (nothing awaited); `finish` waits for the answer,
    and the regions stay counted until the transfer ended."""
    port = FakePort()
    book = TransferBook(port, 1.0, {})
    ended: list[bool] = []
    run = _start_one(book, "r", False, ended)
    [xfer] = port.transfers.items  # handed over: no turn of the loop in between
    assert xfer.notif == wire.PushDone("d-req", 0, True, 0, "")
    assert book.local == {P_REGION.region_id: 1} and list(book.in_flight) == ["r:WRITE"]
    finished = anyio.Event()

    async def finish() -> None:
        await book.finish(run)
        finished.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(finish)
        await settle()
        assert not finished.is_set() and ended == []
        xfer.complete()
        with anyio.fail_after(WAIT):
            await finished.wait()
    assert ended == [True] and not any(book.local.values()) and book.in_flight == {}
    assert book.recent[-1]["state"] == "done"


async def test_the_book_settles_a_notification_alone_once_even_when_cancelled() -> None:
    """A group with no descriptors posts nothing: its notification goes in `finish`, and
    `settled` is called once, also when the wait is cancelled before it went."""
    port = FakePort()
    book = TransferBook(port, 1.0, {})
    ended: list[bool] = []
    run = _start_one(book, "r", True, ended)
    assert port.transfers.items == [] and ended == []
    with anyio.CancelScope() as scope:
        scope.cancel()
        await book.finish(run)
    assert ended == [True] and not any(book.local.values()) and port.sent(wire.PushDone) == []
    run = _start_one(book, "r2", True, ended)
    await book.finish(run)
    assert ended == [True, True] and port.sent(wire.PushDone) == [
        (D_AGENT, wire.PushDone("d-req", 0, True, 0, ""))
    ]


async def test_a_region_drain_waits_for_a_transfer_answered_unsettled() -> None:
    """A region is released (its memory deregistered and given back) only once nothing of
    a transfer touching it can land, not when the transfer was answered: UCX may still
    write into it after an Unsettled answer."""
    port = UnsettledPort()
    book = TransferBook(port, 1.0, {})
    remote = RemoteRegion(9, D_GEN, D_ENGINE, 0, 1, D_GEO, COMPAT)
    plan = Plan(
        np.array([P_BASE], dtype=np.int64),
        np.array([D_BASE], dtype=np.int64),
        np.array([BLOCK], dtype=np.int64),
    )
    ended: list[bool] = []
    with pytest.raises(Unsettled):
        await book.run(
            "WRITE", "r", D_AGENT, [P_REGION], [remote], [plan], [b""], lambda: ended.append(True)
        )
    assert book.local == {P_REGION.region_id: 1} and ended == []
    drained = anyio.Event()

    async def drain() -> None:
        await book.drain_local(P_REGION.region_id)
        drained.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(drain)
        await settle()
        assert not drained.is_set()  # the transfer may still land
        (end,) = port.ends
        end()  # UCX ended it
        with anyio.fail_after(WAIT):
            await drained.wait()
    assert ended == [True] and book.local == {}
