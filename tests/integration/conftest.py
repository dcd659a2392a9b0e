"""Fixtures for integration tests: real `kvd serve` processes, real IPC sockets, real NIXL.

`daemons` starts daemons on demand in a short temporary directory (ipc paths must stay
under 107 bytes) and, at teardown, stops each with SIGTERM and checks that it exited 0
and removed its socket.

Their daemons leave other processes' leftover staging segments alone
(`daemon.reap_leftover_segments = false`) unless a test turns reaping on: reaping is
machine-wide, and a test daemon must not remove what a test running beside it (another
suite, a demo) is watching. tests/integration/test_leftovers.py turns it on.

With `KVD_TEST_AUTH=1` in the environment, every daemon a test starts without an `[auth]`
section of its own shares one secret (`[auth] secret_file`): the same tests then run
with every peer message authenticated (see README, Security).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvd.demo import DaemonProc, Engine, start_daemon

StartDaemon = Callable[..., DaemonProc]


def wait_until(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    """`pred()`'s first true value within `timeout` seconds (polled every 20 ms)."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {got!r})")
        time.sleep(0.02)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    """Simulated engines a test made (append them): closed at teardown, before the
    daemons stop."""
    made: list[Engine] = []
    yield made
    for e in made:
        e.client.timeout = 2.0
        e.close()


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvdt-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def daemons(workdir: Path) -> Iterator[StartDaemon]:
    started: list[DaemonProc] = []

    def start(
        name: str,
        extra: str = "",
        env: dict[str, str] | None = None,
        overrides: dict[str, dict[str, Any]] | None = None,
        prefix: tuple[str, ...] = (),
    ) -> DaemonProc:
        merged = {section: dict(values) for section, values in (overrides or {}).items()}
        merged.setdefault("daemon", {}).setdefault("reap_leftover_segments", False)
        if "[auth]" not in extra:
            for section, values in auth_overrides(workdir).items():
                merged.setdefault(section, {}).update(values)
        d = start_daemon(workdir, name, extra, env, overrides=merged, prefix=prefix)
        started.append(d)
        return d

    yield start
    problems = []
    for d in reversed(started):
        if d.proc.poll() is not None:
            continue  # the test killed it on purpose
        rc = d.stop()
        if rc != 0:
            problems.append(f"{d.name} exited {rc}:\n{d.report(2000)}")
        if os.path.exists(d.socket):
            problems.append(f"{d.name} left its socket {d.socket}")
    assert not problems, "\n".join(problems)


def auth_overrides(workdir: Path) -> dict[str, dict[str, Any]]:
    """The config overrides that put a daemon under the shared secret of `workdir` with
    KVD_TEST_AUTH=1 (nothing otherwise): for daemons a test starts itself."""
    if os.environ.get("KVD_TEST_AUTH") != "1":
        return {}
    return {"auth": {"secret_file": shared_secret(workdir)}}


def shared_secret_bytes(workdir: Path) -> bytes | None:
    """The secret daemons share with KVD_TEST_AUTH=1 (None otherwise)."""
    if os.environ.get("KVD_TEST_AUTH") != "1":
        return None
    return Path(shared_secret(workdir)).read_bytes().rstrip(b"\n")


def shared_secret(workdir: Path) -> str:
    """The path of a secret file the daemons of one test share (made once, mode 0600)."""
    path = workdir / "shared-secret"
    if not path.exists():
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, os.urandom(32).hex().encode() + b"\n")
        os.close(fd)
    return str(path)


def shm_segments(prefix: str = "kvd") -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith(prefix)}


@dataclass
class Pair:
    """A P daemon and a D daemon shared by a module's tests (`n` numbers their requests)."""

    p: DaemonProc
    d: DaemonProc
    n: int = 0


def daemon_pair(tag: str, d_transfer: dict[str, Any] | None = None) -> Iterator[Pair]:
    """Start a P and a D daemon named after `tag` for a module-scoped fixture (`yield
    from`); at the end both must stop cleanly (exit 0), or the fixture fails with their
    logs. `d_transfer`: settings of D's `[transfer]` section."""
    work = Path(tempfile.mkdtemp(prefix=f"kvd{tag}-", dir="/tmp"))
    started: list[DaemonProc] = []
    try:
        over: dict[str, dict[str, Any]] = {"daemon": {"reap_leftover_segments": False}}
        started.append(start_daemon(work, f"{tag}-p", overrides=over))
        d_over = over | ({"transfer": d_transfer} if d_transfer else {})
        started.append(start_daemon(work, f"{tag}-d", overrides=d_over))
        yield Pair(started[0], started[1])
    finally:
        problems = []
        for d in reversed(started):
            rc = d.stop()
            if rc != 0:
                problems.append(f"{d.name} exited {rc}:\n{d.report(2000)}")
        shutil.rmtree(work, ignore_errors=True)
        assert not problems, "\n".join(problems)
