"""structlog setup, and the one way to log rejected input.

Event names are stable snake_case; actors bind `actor`, and request ids and peers are
passed as `request_id=` and `peer=` so logs can be filtered by them.

Input from outside (local clients, peer daemons, NIXL notifications) that is rejected
goes through `RejectLog`: every rejection is counted exactly in the daemon's counters,
but lines are rate-limited per (actor, event, kind) by `kvd.core.ratelimit.LogLimiter`,
so a flood of bad input cannot become a flood of log lines.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable
from typing import Any, Final, NamedTuple, NoReturn

import anyio
import structlog

from kvd.core.ratelimit import LogLimiter


def configure(level: str = "info", fmt: str = "auto") -> None:
    lvl = getattr(logging, level.upper(), logging.INFO)
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer()
        if use_json
        else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(lvl),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


class _Key(NamedTuple):
    actor: str
    event: str
    kind: str
    level: str


_OVERFLOW: Final = _Key("rejects", "rejections_of_other_kinds", "other", "warning")
"""Where occurrences go once `max_keys` kinds are being tracked (a safety net: kinds
come from a fixed vocabulary)."""


class RejectLog:
    """Rejected input: counted exactly, logged at most once per key and interval.

    One per daemon, shared by the actors like the counters dict (all of them run on the
    event loop thread). `run` writes the summary lines when windows end.
    """

    def __init__(
        self,
        counters: dict[str, int],
        interval: float,
        *,
        max_keys: int = 256,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.counters = counters
        self.interval = interval
        self._limiter: LogLimiter[_Key] = LogLimiter(interval, max_keys, _OVERFLOW)
        self._clock = clock
        self._loggers: dict[str, Any] = {}
        self._wake: anyio.Event | None = None

    def reject(
        self,
        actor: str,
        counter: str,
        event: str,
        kind: str,
        *,
        level: str = "warning",
        **fields: Any,
    ) -> None:
        """Count one rejection under `counter`; log it as `event` unless rate-limited.

        `kind` must come from a fixed vocabulary (an error class, a reason name), never
        from the input: it is part of the key. `fields` (peer, error text, ...) appear
        only on lines that are written.
        """
        self.counters[counter] = self.counters.get(counter, 0) + 1
        key = _Key(actor, event, kind, level)
        n = self._limiter.hit(key, self._clock())
        if self._wake is not None:
            self._wake.set()  # a window is open: `run` has a deadline to wait for
        if n is None:
            return
        if n:
            fields["suppressed"] = n
        self._write(key, fields)

    def flush(self) -> None:
        """Write the summary lines of every window that has ended."""
        for key, n in self._limiter.due(self._clock()):
            self._summary(key, n)

    def close(self) -> None:
        """Write the summaries of every open window now (the daemon is stopping)."""
        for key, n in self._limiter.drain():
            self._summary(key, n)

    async def run(self) -> NoReturn:
        """Write summaries as windows end (sleeps while no window is open)."""
        while True:
            deadline = self._limiter.next_deadline()
            if deadline is None:
                self._wake = anyio.Event()
                await self._wake.wait()
                self._wake = None
                continue
            await anyio.sleep(max(0.0, deadline - self._clock()))
            self.flush()

    def _summary(self, key: _Key, suppressed: int) -> None:
        self._write(key, {"summary": True, "suppressed": suppressed, "interval_s": self.interval})

    def _write(self, key: _Key, fields: dict[str, Any]) -> None:
        log = self._loggers.get(key.actor)
        if log is None:
            log = self._loggers[key.actor] = structlog.get_logger(
                f"kvd.{key.actor}", actor=key.actor
            )
        getattr(log, key.level)(key.event, kind=key.kind, **fields)
