"""Idle cost: the CPU a daemon uses while it has nothing to do, per thread.

Read from /proc: `/proc/<pid>/stat` (utime + stime, every thread of the process) before
and after a window, and `/proc/<pid>/task/<tid>/stat` for each thread (named by its
`comm`: the NIXL thread is `kvd-nixl`, ZMQ's are `ZMQbg/...`, the event loop is the
process's own name). Times are in clock ticks (`SC_CLK_TCK`, usually 100 Hz), so a
window of w seconds resolves 1 / (w x ticks) of a core. `cpu_ns` is for short spans
(a batch of requests): the nanoseconds on CPU from each thread's `schedstat`.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any


def _stat(path: Path) -> tuple[str, int]:
    """(comm, utime + stime in ticks) of a /proc stat file."""
    text = path.read_text()
    comm = text[text.index("(") + 1 : text.rindex(")")]
    fields = text[text.rindex(")") + 2 :].split()
    return comm, int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)


def sample(pid: int) -> tuple[float, int, dict[int, tuple[str, int]]]:
    """(monotonic s, the process's ticks, {tid: (comm, ticks)})."""
    now = time.monotonic()
    _, total = _stat(Path(f"/proc/{pid}/stat"))
    threads: dict[int, tuple[str, int]] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            threads[int(task.name)] = _stat(task / "stat")
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
    return now, total, threads


def measure(pid: int, window_s: float) -> dict[str, Any]:
    """CPU of process `pid` over the next `window_s` seconds, in % of one core."""
    hz = os.sysconf("SC_CLK_TCK")
    t0, total0, threads0 = sample(pid)
    time.sleep(window_s)
    t1, total1, threads1 = sample(pid)
    wall = t1 - t0

    def pct(ticks: int) -> float:
        return round(ticks / hz / wall * 100, 3)

    used = [
        (pct(ticks - threads0.get(tid, (comm, 0))[1]), tid, comm)
        for tid, (comm, ticks) in threads1.items()
    ]
    used.sort(key=lambda u: (-u[0], u[1]))
    threads = [{"tid": tid, "name": comm, "cpu_pct": cpu} for cpu, tid, comm in used]
    return {
        "window_s": round(wall, 3),
        "cpu_pct": pct(total1 - total0),
        "resolution_pct": round(100 / hz / wall, 3),
        "threads": threads,
    }


def cpu_ns(pid: int) -> int:
    """Nanoseconds process `pid` has run on a CPU, all threads (`task/*/schedstat`; a
    thread that ended is no longer counted). Falls back to `stat` ticks without it."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except FileNotFoundError:
            return _stat(Path(f"/proc/{pid}/stat"))[1] * (10**9 // os.sysconf("SC_CLK_TCK"))
        except (OSError, ValueError, IndexError):
            continue  # the thread ended meanwhile
    return total
