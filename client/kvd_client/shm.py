"""POSIX shared-memory regions a worker creates and the daemon maps (host staging).

The worker owns the segment: it creates it (mode 0660, O_EXCL), maps it read-write,
and unlinks it when done. The daemon maps the same file read-write by name. Plain
`os.open` + `mmap` is used on purpose: `multiprocessing.shared_memory` registers
segments with the resource tracker, which unlinks them when *any* attaching process
exits.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import secrets
from typing import Final

SHM_DIR: Final = "/dev/shm"
_NAME_RE: Final = re.compile(r"^[A-Za-z0-9._-]{1,200}$")


def check_name(name: str) -> str:
    """A segment name: letters, digits, '.', '_', '-' only (no paths)."""
    if not _NAME_RE.match(name) or name in (".", ".."):
        raise ValueError(f"invalid shared-memory name {name!r}")
    return name


def unique_name(prefix: str = "kvd") -> str:
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"


class SharedRegion:
    """A shared-memory segment created and owned by this process."""

    def __init__(self, name: str, nbytes: int) -> None:
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        self.name: Final = check_name(name)
        self.nbytes: Final = nbytes
        self.path: Final = os.path.join(SHM_DIR, name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
        try:
            os.ftruncate(fd, nbytes)
            self._mm: mmap.mmap | None = mmap.mmap(
                fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self.buf: memoryview = memoryview(self._mm)

    def close(self, unlink: bool = True) -> None:
        """Unmap (and by default unlink). Idempotent."""
        if self._mm is None:
            return
        self.buf.release()
        self._mm.close()
        self._mm = None
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)

    def __enter__(self) -> SharedRegion:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
