"""Hold a process to a share of one core (CFS bandwidth control in a cpu cgroup of its own):
the "slow, not dead" fault of `kvd chaos` and of the fault tests, as on an overloaded host.

The process runs `share` x 100 ms in each 100 ms period, then waits for the rest. Needs a
writable cpu cgroup: cgroup v1's `cpu` hierarchy (`cpu.cfs_quota_us`) or cgroup v2 with
the `cpu` controller enabled at its root (`cpu.max`); `unavailable()` says why not.
"""

from __future__ import annotations

import contextlib
import functools
import os
import secrets
import subprocess
import time
from typing import Final

PERIOD_US: Final = 100_000
_V1: Final = "/sys/fs/cgroup/cpu"
_V2: Final = "/sys/fs/cgroup"


def _root() -> tuple[str, str] | None:
    """(the hierarchy's root, "v1" or "v2") where a cpu cgroup can be made, or None."""
    if os.path.exists(os.path.join(_V1, "cpu.cfs_quota_us")) and os.access(_V1, os.W_OK):
        return _V1, "v1"
    try:
        with open(os.path.join(_V2, "cgroup.subtree_control")) as f:
            if "cpu" in f.read().split() and os.access(_V2, os.W_OK):
                return _V2, "v2"
    except OSError:
        pass
    return None


@functools.cache
def unavailable() -> str | None:
    """Why no process can be held to a share of a core here, or None. Tried once for real:
    a child process is held and released (a container may let a cgroup be made but not a
    process be moved into it)."""
    if _root() is None:
        return "no writable cpu cgroup (v1 cpu.cfs_quota_us, or v2 with the cpu controller)"
    probe = subprocess.Popen(["sleep", "10"])
    try:
        CpuLimit(probe.pid, 0.5, tag="kvd-probe").release()
    except OSError as exc:
        return f"a process cannot be moved into a cpu cgroup here: {exc}"
    finally:
        probe.kill()
        probe.wait()
    return None


class CpuLimit:
    """One process held to `share` of a core until `release()` (or the process ends)."""

    def __init__(self, pid: int, share: float, tag: str = "kvd") -> None:
        found = _root()
        if found is None:
            raise RuntimeError(f"cannot limit CPU here: {unavailable()}")
        if not 0.0 < share <= 1.0:
            raise ValueError(f"share must be in (0, 1], not {share}")
        self.root, self.version = found
        self.pid = pid
        self.share = share
        self.path = os.path.join(self.root, f"{tag}-starved-{pid}-{secrets.token_hex(3)}")
        os.mkdir(self.path)
        try:
            quota = max(1000, int(share * PERIOD_US))
            if self.version == "v1":
                self._write("cpu.cfs_period_us", str(PERIOD_US))
                self._write("cpu.cfs_quota_us", str(quota))
            else:
                self._write("cpu.max", f"{quota} {PERIOD_US}")
            self._write("cgroup.procs", str(pid))  # every thread of it (v1 and v2 alike)
        except BaseException:
            self.release()
            raise

    def _write(self, name: str, value: str) -> None:
        with open(os.path.join(self.path, name), "w") as f:
            f.write(value)

    def throttled(self) -> int:
        """Periods in which the kernel stopped the process for its quota: proof the limit
        bit (0 once released)."""
        try:
            with open(os.path.join(self.path, "cpu.stat")) as f:
                stat = dict(line.split()[:2] for line in f.read().splitlines() if line.strip())
        except OSError:
            return 0
        return int(stat.get("nr_throttled", 0))

    def release(self) -> None:
        """The process runs freely again (back in the root cgroup); the cgroup goes. A
        process that ended meanwhile needs nothing."""
        with contextlib.suppress(OSError), open(os.path.join(self.root, "cgroup.procs"), "w") as f:
            f.write(str(self.pid))
        for _ in range(50):
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:  # its threads are still leaving it
                time.sleep(0.02)
