"""Daemon time: a monotonic clock that does not count the daemon's own stalls.

A daemon that was frozen (SIGSTOP, a paused VM) or starved for seconds comes back to a
raw clock that jumped. Every timeout it measured against the raw clock would fire at
once and blame others for its own stall: a client's session would time out although the
client pinged all along (the pings sat unread in our socket), a lease would expire
although D heartbeated all along. So every deadline in kvd is measured in *daemon
time*: raw monotonic time minus the stalls observed so far.

The daemon observes its clock at least every `tick` seconds while it runs (a ticker,
plus every actor that reads the time). A gap between two observations longer than
`max_gap` means the daemon was not running: the part of the gap beyond `tick` is a
stall; it is added to `stalled` (so daemon time advances by at most `tick` across it)
and recorded, so that the owners of leases can re-check them with their peers.
Sans-IO: raw time is always an argument; nothing here reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Stall:
    """A gap during which the daemon did not run."""

    began: float
    """Daemon time at which it began (the last observation before it)."""
    seconds: float
    """How long it lasted beyond the normal tick, in seconds."""


class StallClock:
    """Raw monotonic readings in, daemon time out (see the module docstring)."""

    __slots__ = ("_last_raw", "_stalled", "last_stall", "max_gap", "stall_count", "tick")

    def __init__(self, raw: float, *, tick: float = 0.1, max_gap: float = 1.0) -> None:
        if not 0 < tick < max_gap:
            raise ValueError(f"need 0 < tick < max_gap, got tick={tick!r} max_gap={max_gap!r}")
        self.tick = tick
        self.max_gap = max_gap
        self._last_raw = raw
        self._stalled = 0.0
        self.stall_count = 0
        """Stalls observed so far: an actor that remembers the count it last acted on
        knows whether a stall happened since (each acts on it in its own way)."""
        self.last_stall: Stall | None = None

    @property
    def stalled(self) -> float:
        """Seconds of stall observed since the clock was made."""
        return self._stalled

    def observe(self, raw: float) -> float:
        """Daemon time at raw monotonic time `raw` (readings may come from several callers:
        one earlier than the last is simply not a new observation)."""
        gap = raw - self._last_raw
        if gap > self.max_gap:
            lost = gap - self.tick
            began = self._last_raw - self._stalled
            self._stalled += lost
            self.stall_count += 1
            self.last_stall = Stall(began, lost)
        if gap > 0:
            self._last_raw = raw
        return raw - self._stalled
