"""The D-side staging buffer: daemon-owned memory registered with NIXL, split into slots.

Anonymous shared memory (`mmap`, no /dev/shm name, so nothing is left behind when the
daemon dies), mapped read-write, registered with the daemon's NIXL agent the first time
a transfer stages (so a daemon that never stages pays nothing). Pages are faulted in by
the first transfers that use them and stay (slots are handed out first-fit from the
start, so a daemon's resident staging is its high-water mark, not the whole buffer).
Slots are handed out by
`kvd.core.staging.StagingPool`; this module only owns the memory and its registration.
"""

from __future__ import annotations

import ctypes
import mmap
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import numpy as np
import numpy.typing as npt

from kvd.core.staging import StagingPool


class StagingArea:
    """`size` bytes of staging, registered through `register(addr, nbytes)` on first use."""

    def __init__(
        self,
        size: int,
        register: Callable[[int, int], Awaitable[Any]],
        deregister: Callable[[Any], Awaitable[None]],
    ) -> None:
        self.pool = StagingPool(size)
        self._register = register
        self._deregister = deregister
        self._map: mmap.mmap | None = None
        self._reg: Any = None
        self._lock = anyio.Lock()
        self.buf: npt.NDArray[np.uint8] = np.empty(0, dtype=np.uint8)
        self.addr = 0

    @property
    def ready(self) -> bool:
        return self._reg is not None

    async def ensure(self) -> None:
        """Map and register the buffer, once (raises what registration raises, leaving
        nothing mapped)."""
        if self._reg is not None or self.pool.size == 0:
            return
        async with self._lock:
            if self._reg is not None:
                return
            m = mmap.mmap(-1, self.pool.size, flags=mmap.MAP_SHARED | mmap.MAP_ANONYMOUS)
            buf = np.frombuffer(m, dtype=np.uint8)
            addr = ctypes.addressof(ctypes.c_uint8.from_buffer(m))
            try:
                reg = await self._register(addr, self.pool.size)
            except BaseException:
                del buf
                m.close()
                raise
            self._map, self.buf, self.addr, self._reg = m, buf, addr, reg

    async def close(self) -> None:
        """Deregister (the memory stays mapped until the process ends: a late transfer
        can never land in memory reused by something else)."""
        reg, self._reg = self._reg, None
        if reg is not None:
            await self._deregister(reg)

    def snapshot(self) -> dict[str, Any]:
        return self.pool.snapshot() | {"registered": self.ready}
