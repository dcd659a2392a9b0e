"""The daemon's side of host staging: map a worker's POSIX shared-memory segment.

Checks before mapping: the name is a plain segment name, the file is a regular file
at least as large as the region claims, and it maps read-write (a READ into a
read-only mapping poisons a NIXL connection or crashes the process).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import stat
from typing import Final

from kvd_client.errors import InvalidRequest, NotFound
from kvd_client.shm import SHM_DIR, check_name


class MappedRegion:
    """A read-write mapping of someone else's shared-memory segment."""

    def __init__(self, name: str, nbytes: int) -> None:
        try:
            check_name(name)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise NotFound(f"shared-memory segment {name!r} does not exist") from None
        except OSError as exc:
            raise InvalidRequest(
                f"cannot open segment {name!r} read-write: {exc.strerror}"
            ) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InvalidRequest(f"segment {name!r} is not a regular file")
            if st.st_size < nbytes:
                raise InvalidRequest(
                    f"segment {name!r} has {st.st_size} bytes, the region claims {nbytes}"
                )
            self._mm: mmap.mmap | None = mmap.mmap(
                fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        finally:
            os.close(fd)
        anchor = ctypes.c_char.from_buffer(self._mm)
        self.addr: Final = ctypes.addressof(anchor)
        del anchor  # release the buffer export so close() can unmap
        self.name: Final = name
        self.nbytes: Final = nbytes

    def view(self) -> memoryview:
        assert self._mm is not None
        return memoryview(self._mm)

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None


class AnonRegion:
    """Daemon-private memory (the canary and scratch buffers)."""

    def __init__(self, nbytes: int) -> None:
        self._mm: mmap.mmap | None = mmap.mmap(-1, nbytes)
        anchor = ctypes.c_char.from_buffer(self._mm)
        self.addr: Final = ctypes.addressof(anchor)
        del anchor
        self.nbytes: Final = nbytes

    def view(self) -> memoryview:
        assert self._mm is not None
        return memoryview(self._mm)

    def close(self) -> None:
        if self._mm is not None:
            self._mm.close()
            self._mm = None
