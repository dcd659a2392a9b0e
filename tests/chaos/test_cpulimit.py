"""`kvd.cpulimit`, the "slow, not dead" fault: a process held to a share of a core really
gets no more than that share, every thread of it, until it is released."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from kvd import cpulimit
from kvd.cpulimit import CpuLimit

# measures a process's share of a core: beside a loaded parallel run, a freed one may not
# get much more than a limited one
pytestmark = pytest.mark.serial

SPIN = (
    "import threading\n"
    "def spin():\n"
    "    while True: pass\n"
    "threading.Thread(target=spin, daemon=True).start()\n"
    "spin()\n"
)
"""A process that would burn a core (two threads, so the limit must hold the whole process,
not its first thread)."""


def cpu_seconds(pid: int) -> float:
    """utime + stime of every thread of `pid` (/proc/<pid>/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def share_over(pid: int, seconds: float) -> float:
    c0, t0 = cpu_seconds(pid), time.monotonic()
    time.sleep(seconds)
    return (cpu_seconds(pid) - c0) / (time.monotonic() - t0)


def shares_until(pids: tuple[int, int], cpu: float, most: float) -> tuple[float, float]:
    """Both processes' shares of a core over one window, long enough that the second one
    ran `cpu` seconds (at most `most` seconds of wall time)."""
    c0, t0 = [cpu_seconds(p) for p in pids], time.monotonic()
    while True:
        time.sleep(0.1)
        used = [cpu_seconds(p) - c for p, c in zip(pids, c0, strict=True)]
        wall = time.monotonic() - t0
        if used[1] >= cpu or wall >= most:
            return used[0] / wall, used[1] / wall


@contextlib.contextmanager
def _spinning() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", SPIN])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


@pytest.fixture
def spinner() -> Iterator[subprocess.Popen[bytes]]:
    why = cpulimit.unavailable()
    if why is not None:
        pytest.skip(f"CPU limits: {why}")
    with _spinning() as proc:
        yield proc


@pytest.fixture
def control() -> Iterator[subprocess.Popen[bytes]]:
    """A spinner never limited: what a free one gets over the same window (the VM's vCPUs
    may be taken by its host for a while, for every process alike)."""
    with _spinning() as proc:
        yield proc


def test_a_limited_process_gets_its_share_and_no_more(
    spinner: subprocess.Popen[bytes], control: subprocess.Popen[bytes]
) -> None:
    limit = CpuLimit(spinner.pid, 0.05, tag="kvdt")
    try:
        got = share_over(spinner.pid, 2.0)
        # 5 % of a core (one period's rounding of slack at most)
        assert got <= 0.08, f"held to 5 % of a core, it used {got:.1%}"
        assert limit.throttled() >= 10, limit.throttled()
    finally:
        limit.release()
    assert not os.path.exists(limit.path), "the cgroup outlived its release"
    # free again: it spins as a process never limited does, over the same window (a
    # fixed share would fail while the VM's host takes its vCPUs: seen once, 7 % in 1 s)
    freed, free = shares_until((spinner.pid, control.pid), cpu=0.5, most=10.0)
    assert freed > 0.5 * free, f"released, it used {freed:.1%} of a core, a free one {free:.1%}"
    assert free > 3 * 0.05 or freed > 3 * 0.05  # (the window is long enough to tell)


def test_release_after_the_process_ended_removes_the_cgroup(
    spinner: subprocess.Popen[bytes],
) -> None:
    limit = CpuLimit(spinner.pid, 0.1, tag="kvdt")
    spinner.kill()
    spinner.wait()
    limit.release()
    assert not os.path.exists(limit.path)


def test_a_share_outside_0_1_is_refused() -> None:
    why = cpulimit.unavailable()
    if why is not None:
        pytest.skip(f"CPU limits: {why}")
    for share in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="share"):
            CpuLimit(os.getpid(), share)
