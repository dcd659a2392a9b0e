"""POSIX shared-memory regions a worker creates and the daemon maps (host staging).

The worker owns the segment: it creates it (mode 0660, O_EXCL), maps it read-write,
and unlinks it when done. The daemon maps the same file read-write by name. Plain
`os.open` + `mmap` is used on purpose: `multiprocessing.shared_memory` registers
segments with the resource tracker, which unlinks them when *any* attaching process
exits.

A worker killed with SIGKILL cannot unlink its segment. Names made by `staging_name`
say who made it (`kvd-<label>-n<pid namespace>-p<pid>-<12 hex digits>`), so the daemon
can remove such a leftover once that process is gone and nothing maps it
(`kvd.adapters.shm.reap_segments`); a segment with any other name is never removed by
the daemon.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import re
import secrets
import typing
from collections.abc import Callable
from typing import Any, Final

SHM_DIR: Final = "/dev/shm"
MAP_POPULATE: Final[int] = getattr(mmap, "MAP_POPULATE", 0)
"""Linux: map every page at mmap time (0 where the platform has no such flag)."""
MADV_POPULATE_WRITE: Final[int] = getattr(mmap, "MADV_POPULATE_WRITE", 23)
"""Linux >= 5.14: fault pages in as if written (writable, dirty page-table entries)."""
POPULATE_CHUNK: Final = 64 << 20
"""Bytes per `madvise` call of `populate_for_write` (the call holds the GIL)."""
_NAME_RE: Final = re.compile(r"^[A-Za-z0-9._-]{1,200}$")
_STAGING_RE: Final = re.compile(
    r"^kvd-(?P<label>[A-Za-z0-9._-]+)-n(?P<ns>[1-9][0-9]{0,19})-p(?P<pid>[1-9][0-9]{0,9})"
    r"-[0-9a-f]{12}$"
)
_PID_MAX: Final = 2**31 - 1


def check_name(name: str) -> str:
    """A segment name: letters, digits, '.', '_', '-' only (no paths)."""
    if not _NAME_RE.match(name) or name in (".", ".."):
        raise ValueError(f"invalid shared-memory name {name!r}")
    return name


def unique_name(prefix: str = "kvd") -> str:
    """`<prefix>-<pid>-<12 hex digits>`: unique, but not a staging name the daemon may
    reap (use `staging_name` for a staging segment)."""
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(6)}"


def pid_namespace() -> int:
    """The inode number of this process's pid namespace; 0 when /proc cannot tell."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def staging_name(label: str) -> str:
    """A unique name for a staging segment that records who made it:
    `kvd-<label>-n<pid namespace>-p<pid>-<12 hex digits>`.

    A pid means something only in its pid namespace; the daemon judges only names made
    in its own (see `staging_creator`). `label` is free text for people
    (letters, digits, '.', '_', '-'), e.g. `vllm-r0`.
    """
    if not label or not _NAME_RE.match(label):
        raise ValueError(f"invalid staging label {label!r}")
    return check_name(f"kvd-{label}-n{pid_namespace()}-p{os.getpid()}-{secrets.token_hex(6)}")


def staging_creator(name: str) -> tuple[int, int] | None:
    """(pid namespace, pid) of the process that made a `staging_name`; None for any other
    name (including one made where the pid namespace was unknown)."""
    m = _STAGING_RE.match(name)
    if m is None or len(name) > 200:
        return None
    pid = int(m["pid"])
    if pid > _PID_MAX:
        return None
    return int(m["ns"]), pid


def map_for_write(fd: int, nbytes: int) -> mmap.mmap:
    """A shared read-write mapping of `fd` with every page faulted in as if written
    (`populate_for_write`; MAP_POPULATE where the kernel cannot)."""
    prot = mmap.PROT_READ | mmap.PROT_WRITE
    mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, prot)
    if populate_for_write(mm):
        return mm
    mm.close()
    return mmap.mmap(fd, nbytes, mmap.MAP_SHARED | MAP_POPULATE, prot)


def populate_for_write(mm: mmap.mmap) -> bool:
    """Fault every page of the (writable) mapping `mm` in as if written, without changing
    a byte (MADV_POPULATE_WRITE, through libc: the GIL is released meanwhile, one call per
    `POPULATE_CHUNK`). False where the kernel cannot (before 5.14). Costs ~0.25 ms per
    MiB on this project's VMs.

    Why: a page's first write through a mapping costs far more than later ones where its
    page-table entry is not yet dirty (measured on this project's VMs: a 64 MiB copy into
    slots never written through the mapping took 6.5-7.1 ms, 5.4-5.6 ms once written;
    MAP_POPULATE maps pages clean, and MADV_POPULATE_WRITE does nothing to entries that
    are already present), so a mapping written to by copies is populated this way."""
    madvise = _libc_madvise()
    if madvise is None or len(mm) == 0:
        return False
    anchor = ctypes.c_char.from_buffer(mm)  # (an export: mm cannot close under us)
    try:
        base = ctypes.addressof(anchor)
        off, end = 0, len(mm)
        while off < end:
            n = min(POPULATE_CHUNK, end - off)
            if madvise(base + off, n, MADV_POPULATE_WRITE) != 0:
                return False  # EINVAL: a kernel without it
            off += n
        return True
    finally:
        del anchor


def _libc_madvise() -> Callable[[int, int, int], int] | None:
    global _MADVISE
    if _MADVISE is None:
        try:
            fn = ctypes.CDLL(None, use_errno=True).madvise
        except (OSError, AttributeError):
            return None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        fn.restype = ctypes.c_int
        _MADVISE = fn
    return typing.cast("Callable[[int, int, int], int]", _MADVISE)


_MADVISE: Any = None


class SharedRegion:
    """A shared-memory segment created and owned by this process."""

    def __init__(self, name: str, nbytes: int, *, populate: bool = False) -> None:
        """`populate`: allocate and map every page now, writable and dirty
        (`populate_for_write`; MAP_POPULATE on kernels before 5.14), so that the first
        copy into the segment pays neither a page fault nor a first write per page."""
        if nbytes <= 0:
            raise ValueError("nbytes must be positive")
        self.name: Final = check_name(name)
        self.nbytes: Final = nbytes
        self.path: Final = os.path.join(SHM_DIR, name)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
        try:
            os.ftruncate(fd, nbytes)
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            self._mm: mmap.mmap | None = (
                map_for_write(fd, nbytes)
                if populate
                else mmap.mmap(fd, nbytes, mmap.MAP_SHARED, prot)
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
