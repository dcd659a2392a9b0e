"""Staging segments that dead workers left in /dev/shm, and the rule that removes them.

The rule (`kvd.adapters.shm.reap_segments`) is tested first on its own, on real files in
/dev/shm made and held by real processes: a segment goes only when its name is a kvd
staging name from our pid namespace, it is ours, its creator is gone and no process maps
or holds it. Then with real daemons and real clients in child processes: a SIGKILLed
worker's segment goes once the daemon ended its session (and not while the daemon itself
still maps it for another session); a restarted daemon removes what a killed worker and a
worker that said goodbye and died left, and keeps a live client's segment.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from kvd_client.client import KvdClient
from kvd_client.shm import SHM_DIR, pid_namespace, staging_creator, staging_name, unique_name

from kvd.actors.ecrouter import ec_segment_creator, ec_segment_name, reap_stale_segments
from kvd.actors.tiers import pool_creator, pool_name, reap_stale_pools
from kvd.adapters.shm import MappedRegion, reap_segments, staging_creator_here
from kvd.demo import DaemonProc

from .conftest import StartDaemon

pytestmark = pytest.mark.serial  # its daemons reap leftover segments machine-wide

# ------------------------------------------------------------------ helpers


def wait_until(pred: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {got!r})")
        time.sleep(0.05)


def exists(name: str) -> bool:
    return os.path.exists(os.path.join(SHM_DIR, name))


@pytest.fixture
def segments() -> Iterator[list[str]]:
    """Names to unlink at teardown, whatever the test left."""
    names: list[str] = []
    yield names
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, name))


def dead_pid() -> int:
    """The pid of a process that has exited (and been waited for)."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


def python(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )


def line(proc: subprocess.Popen[str]) -> str:
    assert proc.stdout is not None
    got = proc.stdout.readline().strip()
    assert got, f"child {proc.pid} said nothing (exit {proc.poll()})"
    return got


def send(proc: subprocess.Popen[str], cmd: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()


def tell(proc: subprocess.Popen[str], cmd: str) -> str:
    send(proc, cmd)
    return line(proc)


def stop(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()


CREATE_AND_DIE = """
import os, signal
from kvd_client.shm import SharedRegion, staging_name
region = SharedRegion(staging_name("test-killed"), 4096)
print(region.name, flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def killed_worker_leftover(segments: list[str]) -> tuple[str, int]:
    """A real leftover: a child creates a staging segment and is SIGKILLed."""
    proc = python(CREATE_AND_DIE)
    name = line(proc)
    segments.append(name)
    assert proc.wait(30) == -signal.SIGKILL
    assert exists(name)
    return name, proc.pid


def make_file(segments: list[str], name: str) -> str:
    """A segment file made by this process under a crafted name (nothing maps it)."""
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o660)
    segments.append(name)
    try:
        os.ftruncate(fd, 4096)
    finally:
        os.close(fd)
    return name


def crafted(label: str, pid: int, ns: int | None = None) -> str:
    ns = pid_namespace() if ns is None else ns
    return f"kvd-{label}-n{ns}-p{pid}-{os.urandom(6).hex()}"


# ------------------------------------------------------------------ names


def test_staging_names_say_who_made_them() -> None:
    name = staging_name("vllm-r0")
    assert name.startswith("kvd-vllm-r0-")
    assert staging_creator(name) == (pid_namespace(), os.getpid())
    assert staging_creator_here(name) == os.getpid()
    # names the rule must never judge
    assert staging_creator(unique_name("kvd-doomed")) is None
    assert staging_creator(f"kvd-ec-{os.getpid()}-0123abcd") is None  # EC names of old
    assert staging_creator(crafted("x", 42, ns=0)) is None  # pid namespace unknown
    assert staging_creator_here(crafted("x", 42, ns=pid_namespace() + 1)) is None
    with pytest.raises(ValueError):
        staging_name("../etc")


# ------------------------------------------------------------------ the rule on real files


def test_a_killed_workers_segment_is_removed(segments: list[str]) -> None:
    name, pid = killed_worker_leftover(segments)
    got = reap_segments([name], staging_creator_here)
    assert got.removed == {name: pid} and got.kept == {}
    assert not exists(name)


def test_a_live_creators_segment_is_kept(segments: list[str]) -> None:
    worker = python(
        """
        import sys
        from kvd_client.shm import SharedRegion, staging_name
        region = SharedRegion(staging_name("test-live"), 4096)
        print(region.name, flush=True)
        region.close(unlink=False)   # not even mapped: its creator being alive is enough
        sys.stdin.read()
        """
    )
    try:
        name = line(worker)
        segments.append(name)
        got = reap_segments([name], staging_creator_here)
        assert got.removed == {}
        assert got.kept == {name: f"its creator, pid {worker.pid}, is alive"}
        assert exists(name)
    finally:
        stop(worker)
    assert reap_segments([name], staging_creator_here).removed == {name: worker.pid}


MAP_ONLY = """
import ctypes, mmap, os, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                      ctypes.c_int, ctypes.c_long]
fd = os.open(sys.argv[1], os.O_RDWR)
addr = libc.mmap(None, 4096, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED, fd, 0)
assert addr not in (None, ctypes.c_void_p(-1).value)
os.close(fd)                  # mapped, with no descriptor left open
print("mapped", flush=True)
sys.stdin.read()
"""

OPEN_ONLY = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
print("open", flush=True)
sys.stdin.read()
"""


@pytest.mark.parametrize(
    ("holder", "reason"), [(MAP_ONLY, "mapped by"), (OPEN_ONLY, "open in")], ids=["map", "fd"]
)
def test_a_dead_creators_segment_that_another_process_uses_is_kept(
    segments: list[str], holder: str, reason: str
) -> None:
    name, _ = killed_worker_leftover(segments)
    proc = python(holder, os.path.join(SHM_DIR, name))
    try:
        line(proc)
        got = reap_segments([name], staging_creator_here)
        assert got.removed == {}
        assert got.kept == {name: f"{reason} pid {proc.pid}"}
        assert exists(name)
    finally:
        stop(proc)
    assert name in reap_segments([name], staging_creator_here).removed


def test_our_own_mapping_counts_until_we_unmap(segments: list[str]) -> None:
    name, _ = killed_worker_leftover(segments)
    mapping = MappedRegion(name, 4096)  # as the daemon maps a registered region
    try:
        got = reap_segments([name], staging_creator_here)
        assert got.kept == {name: f"mapped by pid {os.getpid()}"} and exists(name)
    finally:
        mapping.close()
    assert name in reap_segments([name], staging_creator_here).removed


def test_a_retired_mapping_keeps_its_addresses_and_lets_the_segment_go(
    segments: list[str],
) -> None:
    """A dropped region is retired, not unmapped, while late bytes may still land in
    it: its addresses stay writable (a private decoy), what is written there no longer
    reaches the segment, and the segment is no longer ours (it can be reaped); `close`
    frees the addresses."""
    name, _ = killed_worker_leftover(segments)
    mapping = MappedRegion(name, 4096)
    owner = MappedRegion(name, 4096)  # another mapping of the segment: its owner's view
    try:
        mapping.view()[:4] = b"mine"
        assert bytes(owner.view()[:4]) == b"mine"
        mapping.retire()
        assert mapping.retired
        late = (ctypes.c_char * 4096).from_address(mapping.addr)
        late[:4] = b"late"  # a late byte: lands in the decoy, not in the segment
        assert late[:4] == b"late" and bytes(owner.view()[:4]) == b"mine"
        assert f"{os.sep}{name}" not in _maps_of_address(mapping.addr)
    finally:
        owner.close()
    assert name in reap_segments([name], staging_creator_here).removed  # nobody holds it
    mapping.close()
    assert _maps_of_address(mapping.addr) == ""  # the addresses are free now


def _maps_of_address(addr: int) -> str:
    """The line of /proc/self/maps that holds `addr` ("" if unmapped)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return line
    return ""


def test_foreign_names_and_other_owners_are_kept(segments: list[str]) -> None:
    pid = dead_pid()
    ours = make_file(segments, crafted("test-ours", pid))
    not_ours = make_file(segments, crafted("test-theirs", pid))
    other_ns = make_file(segments, crafted("test-ns", pid, ns=pid_namespace() + 1))
    unnamed = make_file(segments, f"kvd-doomed-{pid}-{os.urandom(6).hex()}")
    ec = make_file(segments, f"kvd-ec-{pid}-{os.urandom(4).hex()}")
    link = crafted("test-link", pid)
    os.symlink(os.path.join(SHM_DIR, ours), os.path.join(SHM_DIR, link))
    segments.append(link)
    if os.geteuid() == 0:
        os.chown(os.path.join(SHM_DIR, not_ours), 54321, -1)
        expected_kept = {not_ours: f"owned by uid 54321, not {os.geteuid()}"}
    else:  # we cannot give a file away: this one stays ours, and goes
        expected_kept = {}
    got = reap_segments([not_ours, other_ns, unnamed, ec, link, ours], staging_creator_here)
    assert got.kept == expected_kept | {link: "not a regular file"}
    assert set(got.removed) == {ours} | ({not_ours} if not expected_kept else set())
    for name in (other_ns, unnamed, ec, link):
        assert os.path.lexists(os.path.join(SHM_DIR, name))


def test_a_dead_daemons_ec_segments_are_removed_by_name_and_pid_namespace(
    segments: list[str],
) -> None:
    """The daemon's EC region and its index carry its pid namespace and pid: at start a
    daemon removes those whose creator is gone, even one still mapped (a consumer engine
    reading a dead daemon's outputs keeps its mapping: only the name goes); names from
    another pid namespace, of another form, or of a live creator stay."""
    assert ec_segment_creator(ec_segment_name()) == os.getpid()
    pid = dead_pid()
    seg = make_file(segments, crafted("ec", pid))
    idx = make_file(segments, seg + ".idx")
    used = make_file(segments, crafted("ec", pid))
    live = make_file(segments, crafted("ec", os.getpid()))
    other_ns = make_file(segments, crafted("ec", pid, ns=pid_namespace() + 1))
    old_form = make_file(segments, f"kvd-ec-{pid}-{os.urandom(4).hex()}")
    assert ec_segment_creator(idx) == pid and ec_segment_creator(old_form) is None
    mapping = MappedRegion(used, 4096)
    try:
        mapping.view()[:4] = b"kept"
        removed = set(reap_stale_segments())
        assert bytes(mapping.view()[:4]) == b"kept"  # the mapping outlives the name
    finally:
        mapping.close()
    assert {seg, idx, used} <= removed
    assert not ({live, other_ns, old_form} & removed)
    for name in (seg, idx, used):
        assert not exists(name)
    for name in (live, other_ns, old_form):
        assert exists(name)


def test_a_dead_daemons_tier_pool_is_removed_by_name_and_pid_namespace(
    segments: list[str],
) -> None:
    """The host pool of the KV tiers, its generations and its directory carry the daemon's
    pid namespace and pid: at start a daemon removes those whose creator is gone (mapped
    or not), and
    never a pool named in another pid namespace (a live daemon there may have the pid of
    one that is gone here: before, the pool's name held the pid alone, and a daemon
    starting in one container unlinked a live pool of a daemon in another that shared
    /dev/shm), of a live creator, or of another form."""
    assert pool_creator(pool_name()) == os.getpid()
    pid = dead_pid()
    pool = make_file(segments, crafted("tiers", pid))
    gens = make_file(segments, pool + "-gens")
    directory = make_file(segments, pool + "-dir")
    live = make_file(segments, crafted("tiers", os.getpid()))
    live_dir = make_file(segments, live + "-dir")
    other_ns = make_file(segments, crafted("tiers", pid, ns=pid_namespace() + 1))
    other_ns_gens = make_file(segments, other_ns + "-gens")
    other_ns_dir = make_file(segments, other_ns + "-dir")
    old_form = make_file(segments, f"kvd-tiers-{pid}-{os.urandom(4).hex()}")
    assert pool_creator(gens) == pid and pool_creator(old_form) is None
    assert pool_creator(directory) == pid and pool_creator(live_dir) == os.getpid()
    mapping = MappedRegion(pool, 4096)
    try:
        mapping.view()[:4] = b"kept"
        removed = set(reap_stale_pools())
        assert bytes(mapping.view()[:4]) == b"kept"  # the mapping outlives the name
    finally:
        mapping.close()
    assert {pool, gens, directory} <= removed
    kept = {live, live_dir, other_ns, other_ns_gens, other_ns_dir, old_form}
    assert not (kept & removed)
    for name in (pool, gens, directory):
        assert not exists(name)
    for name in kept:
        assert exists(name)


# ------------------------------------------------------------------ with real daemons

WORKER = """
import os, sys
from kvd_client.client import KvdClient
from kvd_client.layout import block_major, region_bytes
from kvd_client.shm import SharedRegion, staging_name
sock, engine, existing = sys.argv[1], sys.argv[2], sys.argv[3]
lay = block_major(num_blocks=8, num_layers=2, chunk_bytes=4096)
nbytes = region_bytes(lay)
if existing == "-":
    region = SharedRegion(staging_name("test-" + engine), nbytes)
    region.buf[:4] = b"kvd!"
    name = region.name
else:
    region, name = None, existing   # register someone else's segment
print(name, flush=True)
client = None
for cmd in sys.stdin:
    cmd = cmd.strip()
    if cmd == "register":
        client = KvdClient(sock, role="worker", engine_id=engine, tp_rank=0,
                           keepalive_interval=0.2)
        client.connect()
        client.register_region(region, layout=lay, compat="kvdt-leftovers",
                               name=name, nbytes=nbytes)
        print("registered", flush=True)
    elif cmd == "goodbye":
        client.close()
        print("closed", flush=True)
    elif cmd == "check":
        print(bytes(region.buf[:4]).decode(), flush=True)
    elif cmd == "exit-leaving-it":
        os._exit(0)
"""


def worker(d: DaemonProc, engine: str, existing: str = "-") -> tuple[subprocess.Popen[str], str]:
    proc = python(WORKER, d.socket, engine, existing)
    return proc, line(proc)


def events(d: DaemonProc, event: str) -> list[dict[str, Any]]:
    out = []
    for text in d.log.read_text().splitlines():
        if text.startswith("{") and f'"{event}"' in text:
            rec = json.loads(text)
            if rec.get("event") == event:
                out.append(rec)
    return out


REAP = {"reap_leftover_segments": True}  # test daemons leave leftovers alone by default


def reaped_count(d: DaemonProc) -> int:
    with KvdClient(d.socket, role="cli") as c:
        return int(c.status()["counters"].get("staging_segments_reaped", 0))


def reaped_since_start(d: DaemonProc) -> list[dict[str, Any]]:
    """The removals logged after the daemon's start-up pass (which is machine-wide: beside
    other runs it also takes what their killed processes left)."""
    return [r for r in events(d, "staging_segment_reaped") if r["when"] != "start"]


def test_killed_worker_segment_goes_when_its_session_ends(
    daemons: StartDaemon, segments: list[str]
) -> None:
    # the sessions must end because their workers died, not because a live worker lost
    # its core for a second under load (a 1 s timeout did that beside a full suite run)
    d = daemons("kvd-reap", overrides={"daemon": {"client_timeout": 4.0, **REAP}})
    at_start = reaped_count(d)
    procs = []
    try:
        w1, seg1 = worker(d, "w1")
        w2, seg2 = worker(d, "w2")
        procs += [w1, w2]
        segments += [seg1, seg2]
        y, _ = worker(d, "y", existing=seg2)  # a live session that also registers seg2
        procs.append(y)
        for p in (w1, w2, y):
            assert tell(p, "register") == "registered"
        for p in (w1, w2):
            p.kill()
            p.wait()
        # w1's segment goes once its session timed out and the daemon unmapped it
        wait_until(lambda: not exists(seg1), 15.0, "the killed worker's segment removed")
        # seg2's creator is dead too, but the daemon still maps it for y's session
        kept = wait_until(lambda: events(d, "staging_segment_kept"), 15.0, "seg2 judged")
        assert [(k["segment"], k["reason"]) for k in kept] == [
            (seg2, f"mapped by pid {d.proc.pid}")
        ]
        # the daemon counts and logs a removal on its loop once its thread unlinked it
        wait_until(lambda: reaped_count(d) == at_start + 1, 5.0, "seg1's removal counted")
        assert exists(seg2)
        y.kill()
        y.wait()
        wait_until(lambda: not exists(seg2), 15.0, "seg2 removed once y's session ended")
        wait_until(lambda: reaped_count(d) == at_start + 2, 5.0, "seg2's removal counted")

        def both_logged() -> list[dict[str, Any]] | None:
            got = reaped_since_start(d)
            return got if len(got) == 2 else None

        reaped = wait_until(both_logged, 5.0, "both removals logged")
        assert sorted(r["segment"] for r in reaped) == sorted([seg1, seg2])
        assert {r["when"] for r in reaped} == {"session_end"}
        assert {r["creator_pid"] for r in reaped} == {w1.pid, w2.pid}
    finally:
        for p in procs:
            stop(p)


def test_a_frozen_workers_segment_goes_once_it_is_killed_later(
    daemons: StartDaemon, segments: list[str]
) -> None:
    """A worker frozen past the client timeout: its session ends, its segment is kept (its
    creator lives). Killed later, it has no session left to end; the daemon, watching the
    creators of the segments it kept, removes the segment within a second or two."""
    d = daemons("kvd-reap-frozen", overrides={"daemon": {"client_timeout": 1.0, **REAP}})
    at_start = reaped_count(d)
    w, seg = worker(d, "wf")
    segments.append(seg)
    try:
        assert tell(w, "register") == "registered"
        w.send_signal(signal.SIGSTOP)
        kept = wait_until(
            lambda: [k for k in events(d, "staging_segment_kept") if k["segment"] == seg],
            15.0,
            "the segment judged at the session's end",
        )
        assert kept[0]["reason"] == f"its creator, pid {w.pid}, is alive"
        kept_then_removed_once_killed(d, w, seg, at_start)
    finally:
        stop(w)


def test_a_segment_kept_at_start_goes_once_its_creator_is_killed(
    daemons: StartDaemon, segments: list[str]
) -> None:
    """A daemon (re)started while an engine lives keeps the engine's segment at its
    start-up pass. If the engine then dies without ever registering the segment with this
    daemon (it was frozen, or killed as the daemon came back), no session of its ends
    here: the daemon watches the creators of what it kept at start too, and removes the
    segment once its creator is gone. (Found by `kvd chaos --two-hosts`: a killed victim
    engine's segment left by a P daemon restarted moments before.)"""
    w, seg = worker_alive(segments)
    try:
        d = daemons("kvd-reap-atstart", overrides={"daemon": REAP})
        kept_then_removed_once_killed(d, w, seg, reaped_count(d))
    finally:
        stop(w)


def kept_then_removed_once_killed(
    d: DaemonProc, w: subprocess.Popen[str], seg: str, at_start: int
) -> None:
    """`seg` (made by `w`, alive) is kept while `w` lives; once `w` is SIGKILLed, `d`
    removes it within seconds, and counts and logs it (on its loop, once its thread
    unlinked it) as `creator_gone`."""
    time.sleep(1.5)  # watched: kept while its creator lives
    assert exists(seg) and reaped_count(d) == at_start
    w.kill()
    w.wait()
    wait_until(lambda: not exists(seg), 10.0, "removed once its creator is gone")
    ours = wait_until(
        lambda: [r for r in reaped_since_start(d) if r["segment"] == seg], 5.0, "its removal"
    )
    assert [(r["when"], r["creator_pid"]) for r in ours] == [("creator_gone", w.pid)]
    # every removal since start is counted (beside other runs, what their killed processes
    # left may be taken too: the watch, like the start-up pass, is machine-wide)
    wait_until(lambda: reaped_count(d) == at_start + len(reaped_since_start(d)), 5.0, "counted")


def worker_alive(segments: list[str]) -> tuple[subprocess.Popen[str], str]:
    """A live process that made a staging segment and registered it nowhere."""
    proc = python(WORKER, "unused.sock", "alive", "-")
    name = line(proc)
    segments.append(name)
    assert exists(name)
    return proc, name


def test_restart_removes_leftovers_and_keeps_a_live_clients_segment(
    daemons: StartDaemon, segments: list[str]
) -> None:
    d1 = daemons("kvd-restart", overrides={"daemon": REAP})
    # its start-up pass is machine-wide: what other runs' killed processes left goes now
    at_start = reaped_count(d1)
    procs = []
    try:
        live, live_seg = worker(d1, "live")
        bye, bye_seg = worker(d1, "bye")
        procs += [live, bye]
        segments += [live_seg, bye_seg]
        for p in (live, bye):
            assert tell(p, "register") == "registered"
        # a session closed by goodbye: its client owns the segment, the daemon removes
        # nothing, even once that client is gone without unlinking it
        assert tell(bye, "goodbye") == "closed"
        send(bye, "exit-leaving-it")
        assert bye.wait(30) == 0
        killed, _ = killed_worker_leftover(segments)  # never registered anywhere
        assert reaped_count(d1) == at_start
        assert d1.stop() == 0, d1.report(2000)
        assert exists(bye_seg) and exists(killed) and exists(live_seg)
        assert {r["when"] for r in events(d1, "staging_segment_reaped")} <= {"start"}

        d2 = daemons(
            "kvd-restart", overrides={"daemon": REAP}
        )  # same socket; ready means its start-up pass is done
        assert not exists(bye_seg) and not exists(killed)
        assert exists(live_seg) and tell(live, "check") == "kvd!"
        # the start-up pass is machine-wide: it also takes what other runs' killed
        # processes left (counted and logged alike); this test's own are judged here
        reaped = events(d2, "staging_segment_reaped")
        ours = [r for r in reaped if r["segment"] in (bye_seg, killed, live_seg)]
        assert sorted(r["segment"] for r in ours) == sorted([bye_seg, killed])
        assert {r["when"] for r in reaped} == {"start"}
        assert reaped_count(d2) == len(reaped)
        assert tell(live, "register") == "registered"  # the live client goes on
        assert tell(live, "goodbye") == "closed"
    finally:
        for p in procs:
            stop(p)


def test_a_killed_tiers_daemons_pool_generations_and_directory_go_at_the_next_start(
    daemons: StartDaemon,
) -> None:
    """A daemon with KV tiers killed (SIGKILL: it removes nothing) leaves its host pool,
    the slots' generations and the directory in /dev/shm; the next daemon's start-up
    pass removes all three (the directory was left behind once: its suffix was not
    known to the rule)."""
    from kvd_client.tiers import TierClient

    cfg = {"daemon": REAP, "tiers": {"enabled": True, "host_bytes": 16 * 65536}}
    d1 = daemons("kvd-tier-leftovers", overrides=cfg)
    with TierClient(d1.socket, b"kvdt-leftovers", 65536) as c:  # the pool cut into slots
        assert c.store([b"k" * 36], [memoryview(bytes(65536))]) == [True]
    left = sorted(n for n in os.listdir(SHM_DIR) if pool_creator(n) == d1.proc.pid)
    pool = min(left, key=len)
    assert left == sorted([pool, pool + "-dir", pool + "-gens"])
    d1.kill()
    assert all(exists(n) for n in left)
    d2 = daemons("kvd-tier-leftovers", overrides=cfg)  # ready: its start-up pass is done
    assert not any(exists(n) for n in left)
    assert d2.stop() == 0, d2.report(2000)


def test_reaping_can_be_turned_off(daemons: StartDaemon, segments: list[str]) -> None:
    killed, _ = killed_worker_leftover(segments)
    d = daemons("kvd-noreap", overrides={"daemon": {"reap_leftover_segments": False}})
    assert exists(killed) and reaped_count(d) == 0
