"""The daemon's side of host staging: map a worker's POSIX shared-memory segment, and
remove the segments that dead workers left.

Checks before mapping: the name is a plain segment name, the file is a regular file
at least as large as the region claims, and it maps read-write (a READ into a
read-only mapping poisons a NIXL connection or crashes the process).

The leftover rule (`reap_segments`): a segment is unlinked only when all of these hold
- its name says which process made it, in our pid namespace (`creator`; for staging
  segments, `kvd_client.shm.staging_name` and `staging_creator_here`);
- it is a regular file owned by our effective uid;
- that process is gone (`kill(pid, 0)` fails with ESRCH; a pid taken by another
  process since only delays the removal);
- no process we can inspect maps it (`/proc/<pid>/maps`, by device and inode) or holds
  it open (`/proc/<pid>/fd`). The daemon itself counts: it unmaps first.
Processes whose /proc entries we may not read (other users, non-dumpable) are not seen;
a process of another pid namespace is seen only if ours contains it, which is why a
name made in another pid namespace is never judged by its pid. The judgement is a
snapshot: a process that opens a dead creator's segment by name while it is judged may
see the name go (its mapping stays valid); kvd's own registrar waits for the judgement.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import stat
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Final

from kvd_client.errors import InvalidRequest, NotFound
from kvd_client.shm import SHM_DIR, check_name, pid_namespace, staging_creator

PROC_DIR: Final = "/proc"


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [
    ctypes.c_void_p,
    ctypes.c_size_t,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_int,
    ctypes.c_long,
]
_libc.munmap.restype = ctypes.c_int
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_MAP_FAILED: Final = ctypes.c_void_p(-1).value
_MAP_FIXED: Final = 0x10
_MAP_NORESERVE: Final = getattr(mmap, "MAP_NORESERVE", 0x4000)


def _os_error(what: str) -> OSError:
    err = ctypes.get_errno()
    return OSError(err, f"{what}: {os.strerror(err)}")


class MappedRegion:
    """A read-write mapping of someone else's shared-memory segment.

    Mapped with mmap(2) directly (no file descriptor is kept: the segment is held only
    by the mapping), so that it can be `retire`d in place."""

    def __init__(self, name: str, nbytes: int) -> None:
        try:
            check_name(name)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from None
        if nbytes <= 0:
            raise InvalidRequest(f"a region of {nbytes} bytes cannot be mapped")
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
            prot = mmap.PROT_READ | mmap.PROT_WRITE
            addr = _libc.mmap(None, nbytes, prot, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == _MAP_FAILED:
                err = _os_error(f"mmap of segment {name!r}")
                raise InvalidRequest(str(err))
        finally:
            os.close(fd)
        self.addr: Final[int] = int(addr)
        self.name: Final = name
        self.nbytes: Final = nbytes
        self._mapped = True
        self.retired = False
        """Its addresses hold a private decoy now, not the segment (`retire`)."""

    def view(self) -> memoryview:
        """The mapping's bytes (valid until `close`: do not keep it past that)."""
        assert self._mapped
        return memoryview((ctypes.c_char * self.nbytes).from_address(self.addr)).cast("B")

    def retire(self) -> None:
        """Let the segment go but keep its addresses: a private, zero-filled decoy
        mapping takes its place, atomically (MAP_FIXED), until `close`. A peer's
        transfer NIXL could not cancel (a WRITE, or the reply to a READ, still on the
        way when the region was dropped) then lands in the decoy: never in memory of
        the segment's owner, never in a region mapped later at the same addresses, and
        never in unmapped memory, where it crashes the daemon (UCX's TCP transport
        copies it in the daemon's own process). The segment is no longer held by us
        (its owner's memory is freed once nobody else maps it)."""
        if not self._mapped or self.retired:
            return
        flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_FIXED | _MAP_NORESERVE
        got = _libc.mmap(self.addr, self.nbytes, mmap.PROT_READ | mmap.PROT_WRITE, flags, -1, 0)
        if got is None or got == _MAP_FAILED or int(got) != self.addr:
            raise _os_error(f"cannot retire the mapping of {self.name!r}")
        self.retired = True

    def close(self) -> None:
        """Unmap (the segment, or the decoy of a retired region)."""
        if self._mapped:
            self._mapped = False
            if _libc.munmap(self.addr, self.nbytes) != 0:
                raise _os_error(f"munmap of {self.name!r}")


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


# ------------------------------------------------------------------ leftovers


def staging_creator_here(name: str) -> int | None:
    """The pid of the process that made a staging segment `name`, when that process
    lived in our pid namespace (only then does the pid mean anything here); else None."""
    made = staging_creator(name)
    if made is None:
        return None
    ns, pid = made
    here = pid_namespace()
    return pid if here and ns == here else None


@dataclass
class Reaped:
    """What `reap_segments` did: the names it unlinked (with their creator's pid) and,
    for each name the rule looked at and kept, why."""

    removed: dict[str, int] = field(default_factory=dict)
    kept: dict[str, str] = field(default_factory=dict)
    alive: dict[str, int] = field(default_factory=dict)
    """Of `kept`, those kept only because their creator (this pid) is alive."""


def reap_segments(
    names: Iterable[str],
    creator: Callable[[str], int | None],
    *,
    shm_dir: str = SHM_DIR,
    proc_dir: str = PROC_DIR,
) -> Reaped:
    """Unlink those of `names` (in `shm_dir`) that the leftover rule allows (module doc).

    `creator` returns the pid of the process that made a name, or None for a name the
    rule must not judge (not ours, or made in another pid namespace). Blocking IO: the
    /proc scan runs only when some segment passed the cheaper checks; call it from a
    worker thread.
    """
    out = Reaped()
    uid = os.geteuid()
    candidates: dict[str, tuple[int, int, int]] = {}  # name -> (pid, st_dev, st_ino)
    for name in names:
        pid = creator(name)
        if pid is None:
            continue
        path = os.path.join(shm_dir, name)
        try:
            check_name(name)
            st = os.lstat(path)
        except (ValueError, OSError):
            continue  # gone already, or never a segment name
        if not stat.S_ISREG(st.st_mode):
            out.kept[name] = "not a regular file"
        elif st.st_uid != uid:
            out.kept[name] = f"owned by uid {st.st_uid}, not {uid}"
        elif pid_alive(pid):
            out.kept[name] = f"its creator, pid {pid}, is alive"
            out.alive[name] = pid
        else:
            candidates[name] = (pid, st.st_dev, st.st_ino)
    if not candidates:
        return out
    users = segment_users(
        {(dev, ino) for _, dev, ino in candidates.values()},
        {os.path.join(shm_dir, n) for n in candidates},
        proc_dir=proc_dir,
    )
    for name, (pid, dev, ino) in candidates.items():
        path = os.path.join(shm_dir, name)
        user = users.get((dev, ino)) or users.get(path)
        if user is not None:
            out.kept[name] = user
            continue
        try:
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) != (dev, ino) or pid_alive(pid):
                out.kept[name] = "it changed while it was judged"
                continue
            os.unlink(path)
        except FileNotFoundError:
            continue  # someone else removed it meanwhile
        except OSError as exc:
            out.kept[name] = f"unlink failed: {exc.strerror}"
            continue
        out.removed[name] = pid
    return out


def reap_dead_creators(
    creator: Callable[[str], int | None], shm_dir: str = SHM_DIR
) -> dict[str, int]:
    """Unlink the segments a daemon that died without cleanup (SIGKILL, power loss) left:
    those of `shm_dir` for which `creator` gives a pid (a name of ours, made in our pid
    namespace) of a process that is gone, regular files of our uid; returns them with that
    pid. Unlike a client's staging segment (a live client may register it again by name),
    a dead daemon's segment has no use under its name: a process that still maps it keeps
    its mapping (only the name goes). Blocking IO: call it from a worker thread."""
    removed: dict[str, int] = {}
    uid = os.geteuid()
    for name in os.listdir(shm_dir):
        pid = creator(name)
        if pid is None or pid_alive(pid):
            continue
        path = os.path.join(shm_dir, name)
        try:
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
                continue
            os.unlink(path)
        except OSError:
            continue  # gone already (another daemon starting), or not ours to remove
        removed[name] = pid
    return removed


def segment_users(
    ids: set[tuple[int, int]], paths: set[str], *, proc_dir: str = PROC_DIR
) -> dict[tuple[int, int] | str, str]:
    """Which of the files (by (st_dev, st_ino), for mappings) or `paths` (for open file
    descriptors, as readlink shows them) a visible process maps or holds open.

    Returns, per file found in use, a few words naming one such process. Processes that
    end or that we may not inspect while we look are skipped.
    """
    found: dict[tuple[int, int] | str, str] = {}
    inodes = {str(ino).encode() for _, ino in ids}
    try:
        pids = [e for e in os.listdir(proc_dir) if e.isdigit()]
    except OSError:
        return found
    for pid in pids:
        try:  # ended, or not ours to read: skipped
            with open(os.path.join(proc_dir, pid, "maps"), "rb") as f:
                maps = f.read()
        except OSError:
            maps = b""
        if any(ino in maps for ino in inodes):  # cheap test first: most processes map none
            for line in maps.splitlines():
                # start-end perms offset dev inode [path]
                parts = line.split(maxsplit=5)
                if len(parts) < 5 or parts[4] not in inodes:
                    continue
                major, _, minor = parts[3].partition(b":")
                try:
                    key = (os.makedev(int(major, 16), int(minor, 16)), int(parts[4]))
                except ValueError:  # a line we cannot read may be the mapping: keep all
                    for key in ids:
                        found.setdefault(key, f"maybe mapped by pid {pid}")
                    continue
                if key in ids:
                    found.setdefault(key, f"mapped by pid {pid}")
        fd_dir = os.path.join(proc_dir, pid, "fd")
        with contextlib.suppress(OSError):
            for fd in os.listdir(fd_dir):
                with contextlib.suppress(OSError):
                    target = os.readlink(os.path.join(fd_dir, fd))
                    if target in paths:
                        found.setdefault(target, f"open in pid {pid}")
    return found


def pid_alive(pid: int) -> bool:
    """Is there a process `pid` here? Only ESRCH says no."""
    if pid <= 0:
        return True  # kill(0 or -n, 0) would ask about process groups
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists, as another user
        return True
    return True
