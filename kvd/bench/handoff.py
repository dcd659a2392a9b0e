"""A thread hand-off with nothing else in it: an event loop to a thread and back.

A kvd daemon hands each transfer and notification between its event loop (anyio on
uvloop) and its NIXL thread: a command into the `queue.SimpleQueue` the thread waits on,
the result back through `loop.call_soon_threadsafe`. `round_trips` times that pair alone,
in this process, one at a time, each leg on its own, each waking a thread asleep in its
wait (the thread in `get`, the loop in its poll). Set beside the stage trace's
hand-offs (the daemons' `nixl.picked` and `transfer.returned` stages), it shows how much
of a hand-off on the request's path is the primitive and how much is waiting for a core.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from typing import Final

LOOP_ASLEEP_S: Final = 200e-6
"""The thread's pause before it answers: the loop, waiting on the answer, has gone to
sleep in its poll by then, as when a transfer or notification comes back to a daemon's
loop (an answer sent at once would find it awake and cost less than that wake-up)."""


def round_trips(n: int, warmup: int = 50) -> tuple[list[float], list[float]]:
    """Seconds of n loop -> thread and n thread -> loop hand-offs (after `warmup` round
    trips), measured on a fresh uvloop event loop in a thread of its own."""
    to_thread: list[float] = []
    to_loop: list[float] = []
    failed: list[BaseException] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        cmds: queue.SimpleQueue[float | None] = queue.SimpleQueue()
        back: list[asyncio.Future[None]] = []

        def arrived(sent: float) -> None:
            to_loop.append(time.perf_counter() - sent)
            back[0].set_result(None)

        def worker() -> None:
            while (sent := cmds.get()) is not None:
                to_thread.append(time.perf_counter() - sent)
                time.sleep(LOOP_ASLEEP_S)  # the loop waits in its poll by now, as for a result
                loop.call_soon_threadsafe(arrived, time.perf_counter())

        thread = threading.Thread(target=worker, name="kvd-bench-handoff", daemon=True)
        thread.start()
        try:
            for _ in range(warmup + n):
                back[:] = [loop.create_future()]
                cmds.put(time.perf_counter())
                await asyncio.wait_for(back[0], 5.0)
        finally:
            cmds.put(None)
            thread.join(5.0)

    def run() -> None:
        import uvloop

        try:
            uvloop.run(main())
        except BaseException as exc:  # reported in the caller's thread
            failed.append(exc)

    runner = threading.Thread(target=run, name="kvd-bench-handoff-loop")
    runner.start()
    runner.join()
    if failed:
        raise failed[0]
    return to_thread[warmup:], to_loop[warmup:]
