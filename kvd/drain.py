"""The daemon-wide drain (`kvd drain`): take the node out of service without losing requests.

The drain is a state of the whole daemon that the sender, receiver and EC router actors
know: once started it never ends (a drained daemon is restarted to serve again). Starting
it posts `StartDrain` to the three, which refuse new work from then on (P grants no
lease, D takes no registration or pull; each refusal is a failure on both sides at once,
so D recomputes; the encoder-cache producer serves no new consumer request and the
consumer starts no new fetch, so engines encode locally) and say when nothing of theirs
is left. This module only waits for the answers, bounded by the operator's timeout,
keeps the state that
`kvd status` shows, and asks the supervisor to exit when the drain was started with
`exit` (at once when drained, or at the timeout with what was left logged).

A later drain request joins the running one: `exit` is added, and a timeout shortens the
deadline (never lengthens it). After a drain timed out, a new request waits again (with
its own timeout only); a drained daemon stays drained.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Final

import anyio
import structlog

from kvd.actors.base import Clock, Mailbox
from kvd.actors.messages import Snapshot, StartDrain

log = structlog.get_logger("kvd.drain")

POLL: Final = 0.05
"""Seconds between checks of the deadline while the actors drain."""


class Drain:
    def __init__(
        self,
        *,
        sender: Mailbox[Any],
        receiver: Mailbox[Any],
        ecrouter: Mailbox[Any],
        clock: Clock,
        spawn: Callable[[Callable[[], Any]], None],
        exit_daemon: Callable[[], None],
    ) -> None:
        self.sender = sender
        self.receiver = receiver
        self.ecrouter = ecrouter
        self.clock = clock
        self._spawn = spawn
        self._exit_daemon = exit_daemon
        self.state = "serving"
        """serving, draining, drained, or timed_out."""
        self.since_wall: float | None = None
        self.started: float = 0.0
        self.deadline: float | None = None
        self.exit = False
        self.ended: float | None = None

    def start(self, timeout: float, exit_after: bool) -> bool:
        """Start the drain, or join the running one (see the module docstring). True when
        the daemon is to exit now (drained already, `exit` just asked): the caller
        answers the operator first, then exits (`exit_daemon`)."""
        now = self.clock.now()
        deadline = now + timeout if timeout > 0 else None
        if deadline is not None and (self.deadline is None or deadline < self.deadline):
            self.deadline = deadline
        if self.state == "serving":
            self.since_wall = time.time()
            self.started = now
        if self.state in ("serving", "timed_out"):
            # (after a timeout, a new request waits again, with its own deadline only)
            if self.state == "timed_out":
                self.deadline = deadline
            self.state = "draining"
            self.ended = None
            self.exit = self.exit or exit_after
            log.info("drain_requested", timeout_s=timeout or None, exit=self.exit)
            self._spawn(self._run)
            return False
        if exit_after and not self.exit:
            self.exit = True
            return self.state == "drained"  # over already: exit now
        return False

    async def _run(self) -> None:
        calls = [StartDrain(), StartDrain(), StartDrain()]
        self.sender.post(calls[0])  # notices between actors: never refused
        self.receiver.post(calls[1])
        self.ecrouter.post(calls[2])
        while not all(c.reply.done() for c in calls):
            if self.deadline is not None and self.clock.now() >= self.deadline:
                break
            await anyio.sleep(POLL)  # (awaiting the futures under a timeout would cancel them)
        self.ended = self.clock.now()
        if all(c.reply.done() for c in calls):
            self.state = "drained"
            log.info("drain_done", seconds=round(self.ended - self.started, 3), exit=self.exit)
        else:
            self.state = "timed_out"
            left = await self.in_flight()
            log.warning(
                "drain_timed_out",
                seconds=round(self.ended - self.started, 3),
                sending=left["sending"]["count"],
                receiving=left["receiving"]["count"],
                encoder_cache=left["encoder_cache"]["count"],
                exit=self.exit,
            )
        if self.exit:
            self._exit_daemon()

    async def in_flight(self) -> dict[str, Any]:
        """What each side still holds (counts, and the first requests with their state)."""
        return {
            "sending": await self.sender.call(Snapshot("drain")),
            "receiving": await self.receiver.call(Snapshot("drain")),
            "encoder_cache": await self.ecrouter.call(Snapshot("drain")),
        }

    async def status(self) -> dict[str, Any]:
        """The drain as `kvd status` and `kvd drain` show it."""
        now = self.clock.now()
        out: dict[str, Any] = {"state": self.state}
        if self.state == "serving":
            return out
        out |= {
            "since": self.since_wall,
            "for_s": round((self.ended if self.ended is not None else now) - self.started, 3),
            "deadline_in_s": round(self.deadline - now, 3) if self.deadline is not None else None,
            "exit": self.exit,
        }
        return out | await self.in_flight()
