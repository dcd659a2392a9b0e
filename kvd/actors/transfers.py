"""The transport port, and the book of transfers one actor has in flight.

`Transport` is all the sender and receiver actors need of NIXL: send a notification,
post a transfer and wait for it. `kvd.adapters.nixl.NixlEngine` implements it; a test
can implement it with a fake that injects faults.

`TransferBook` posts one transfer per TP rank and keeps, for the region drains, how many
transfers touch each local region and each remote (agent, region): a region is freed
(locally) or forgotten (a peer's) only once nothing in flight touches it, and no new
transfer starts from a local region being released. It also keeps the recent transfers
for `kvd transfers`. Each actor owns its own book (no state shared between actors).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

import anyio
import numpy as np
from kvd_client.errors import Incompatible, InvalidRequest, KvdError, NotFound, TransferError

from kvd.actors.messages import LocalRegion, RemoteRegion
from kvd.core.planner import Plan

RECENT_TRANSFERS: Final = 256


class Transport(Protocol):
    """What the transfer actors need of the data plane (NixlEngine implements it)."""

    async def send_notif(self, peer: str, msg: bytes) -> None:
        """Send one notification to a peer agent; raises TransferError (PeerDisconnected
        when NIXL knows the peer is gone)."""

    async def transfer(
        self,
        op: str,
        local: np.ndarray,
        remote: np.ndarray,
        peer: str,
        notif: bytes,
        timeout: float,  # noqa: ASYNC109 - enforced by the transport, which owns the handle
        nbytes: int,
        local_mem: str = "DRAM",
        remote_mem: str = "DRAM",
    ) -> float:
        """Post a WRITE or READ of Nx3 (addr, len, dev) descriptor arrays and wait for it;
        `notif` is delivered to the peer when it completes."""


class TransferBook:
    """Transfers in flight from one actor, by region (see the module docstring)."""

    def __init__(self, transport: Transport, transfer_timeout: float, counters: dict[str, int]):
        self.transport = transport
        self.transfer_timeout = transfer_timeout
        self.counters = counters
        self.in_flight: dict[str, dict[str, Any]] = {}
        self.recent: deque[dict[str, Any]] = deque(maxlen=RECENT_TRANSFERS)
        self.local: dict[int, int] = {}
        self.remote: dict[tuple[str, int], int] = {}
        self.releasing: set[int] = set()
        self._wakeup: anyio.Event | None = None

    def _count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n

    async def run(
        self,
        op: str,
        rid: str,
        agent: str,
        local: Sequence[LocalRegion],
        remote: Sequence[RemoteRegion],
        plans: Sequence[Plan],
        notifs: Sequence[bytes],
    ) -> None:
        """Post one transfer per rank concurrently and wait for all; raise the first
        failure (a KvdError). With no descriptors, only the notification is sent."""
        for loc in local:
            if loc.region_id in self.releasing:
                raise TransferError(f"local region {loc.region_id} is being released")
        total = sum(p.total_bytes for p in plans)
        descs = sum(p.descriptors for p in plans)
        rec: dict[str, Any] = {
            "request_id": rid,
            "op": op,
            "peer": agent,
            "bytes": total,
            "descriptors": descs,
            "ranks": len(plans),
            "state": "in_flight",
            "started": time.time(),
        }
        key = f"{rid}:{op}"
        self.in_flight[key] = rec
        for loc, rem in zip(local, remote, strict=True):
            self.local[loc.region_id] = self.local.get(loc.region_id, 0) + 1
            self.remote[(agent, rem.region_id)] = self.remote.get((agent, rem.region_id), 0) + 1
        t0 = time.perf_counter()
        errors: list[KvdError] = []
        try:
            if len(plans) == 1:  # one rank: no task group (it costs a task per request)
                await self._one(op, agent, plans[0], notifs[0], local[0], remote[0], errors)
            else:
                async with anyio.create_task_group() as tg:
                    for plan, notif, loc, rem in zip(plans, notifs, local, remote, strict=True):
                        tg.start_soon(self._one, op, agent, plan, notif, loc, rem, errors)
        finally:
            for loc, rem in zip(local, remote, strict=True):
                self.local[loc.region_id] -= 1
                self.remote[(agent, rem.region_id)] -= 1
            self._wake()
            self.in_flight.pop(key, None)
            rec["duration_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
            rec["state"] = "failed" if errors else "done"
            self.recent.append(rec)
        if errors:
            raise errors[0]
        self._count("transfers_ok")
        self._count("bytes_transferred", total)
        self._count("descriptors", descs)

    async def _one(
        self,
        op: str,
        agent: str,
        plan: Plan,
        notif: bytes,
        loc: LocalRegion,
        rem: RemoteRegion,
        errors: list[KvdError],
    ) -> None:
        try:
            if plan.descriptors:
                await self.transport.transfer(
                    op,
                    plan.as_tuples_local(loc.device),
                    plan.as_tuples_remote(rem.device),
                    agent,
                    notif,
                    self.transfer_timeout,
                    plan.total_bytes,
                    local_mem=loc.mem_type,
                    remote_mem=rem.mem_type,
                )
            elif notif:
                await self.transport.send_notif(agent, notif)
        except KvdError as exc:
            errors.append(exc)

    # ---------------------------------------------------------------- drains

    def _wake(self) -> None:
        """A transfer ended: let every drain re-check its region (drains are rare)."""
        if self._wakeup is not None:
            self._wakeup.set()
            self._wakeup = None

    async def _until(self, busy: Callable[[], bool]) -> None:
        while busy():
            if self._wakeup is None:
                self._wakeup = anyio.Event()
            await self._wakeup.wait()

    async def drain_local(self, region_id: int) -> None:
        """No new transfer from this region; returns once none is in flight."""
        self.releasing.add(region_id)
        try:
            await self._until(lambda: self.local.get(region_id, 0) > 0)
        finally:
            self.releasing.discard(region_id)
            self.local.pop(region_id, None)

    async def drain_remote(self, agent: str, region_id: int) -> None:
        key = (agent, region_id)
        await self._until(lambda: self.remote.get(key, 0) > 0)
        self.remote.pop(key, None)

    def snapshot(self) -> dict[str, Any]:
        return {"in_flight": list(self.in_flight.values()), "recent": list(self.recent)}


def local_ranks(local: dict[tuple[str, int], LocalRegion], engine_id: str) -> list[LocalRegion]:
    """An engine's regions by rank; every rank of its TP must be registered."""
    regs = sorted((r for (e, _), r in local.items() if e == engine_id), key=lambda r: r.tp_rank)
    if not regs:
        raise NotFound(f"engine {engine_id!r} has no registered region on this daemon")
    tp = regs[0].tp_size
    if len(regs) != tp or [r.tp_rank for r in regs] != list(range(tp)):
        raise InvalidRequest(f"engine {engine_id!r} registered {len(regs)} of {tp} ranks")
    return regs


def check_compat(
    *, p: Sequence[LocalRegion | RemoteRegion], d: Sequence[LocalRegion | RemoteRegion]
) -> None:
    """Refuse unless each P rank and its D rank declare the same, non-empty compat.

    Our own regions always have one (the registrar refuses an empty compat); a peer's
    empty one (a peer from before that rule) matches nothing. The reason names both
    values in full, so an operator sees which side to fix.
    """
    for pr, dr in zip(p, d, strict=True):
        if pr.compat and pr.compat == dr.compat:
            continue
        raise Incompatible(
            f"KV compatibility differs: P rank {pr.tp_rank} {pr.compat!r} "
            f"vs D rank {dr.tp_rank} {dr.compat!r}"
        )
