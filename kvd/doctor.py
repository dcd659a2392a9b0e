"""`kvd doctor`: check a node before it serves, each finding with a concrete fix.

Every check is a small pure function from what was read off the system to a `Check`
(ok, warn, fail or skip, what was found, and how to fix it), so the rules are tested
without the system (tests/core/test_doctor.py); `gather` reads the system, `run` ties
them together. What is checked:

- memlock: RLIMIT_MEMLOCK. RDMA transports pin registered memory; a limit below the KV
  regions makes their registration fail (host-local cma/shm and tcp do not pin).
- /dev/shm: host-staging regions live there; its size and free space.
- UCX transports: `ucx_info -d` when installed, else the transport modules bundled with
  NIXL; whether `nixl.ucx_tls` names only what is there; whether any RDMA transport is.
- NIXL: the plugins the installed NIXL offers, and that the configured backend is one.
- The IPC socket's directory: exists, writable by us, not writable by others; whether a
  daemon answers on the socket.
- Clock sync: timedatectl or chrony, when present (with [auth] peers' clocks must agree
  within 2 minutes; `kvd trace` measures offsets itself).
- Peers (`--peer HOST:PORT`, and those a running daemon knows): a TCP connect to the side
  channel with a short timeout, and, through the running daemon, `kvd ping` (handshake,
  notification round trip, the peer's canary moved and checked).
"""

from __future__ import annotations

import glob
import logging
import os
import resource
import shutil
import socket
import stat
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final, Literal

from kvd_client.errors import KvdError

from kvd.config import Config, resolve_socket_path

Status = Literal["ok", "warn", "fail", "skip"]

KiB: Final = 1024
MiB: Final = 1024 * KiB
GiB: Final = 1024 * MiB
SHM_FAIL_BELOW: Final = 64 * MiB
"""Less free than this in /dev/shm (Docker's default size): no KV region fits."""
SHM_WARN_BELOW: Final = 1 * GiB
RDMA_TRANSPORTS: Final = frozenset({"rc", "rc_verbs", "rc_mlx5", "dc", "dc_mlx5", "ud", "ud_verbs"})
RDMA_TRANSPORTS_ALL: Final = RDMA_TRANSPORTS | {"ib", "ib_mlx5", "ib_efa", "srd", "gga"}
UCX_TLS_ALIASES: Final = frozenset(
    {"all", "shm", "ib", "mm", "rc_x", "dc_x", "ud_x", "cuda", "rocm", "sm", "self"}
)
"""Names UCX_TLS accepts that stand for groups of transports (not checked one by one)."""
BUILTIN_TRANSPORTS: Final = ("self", "tcp", "posix", "sysv")
"""Transports built into libuct itself (no module of their own)."""


@dataclass(frozen=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


# ---------------------------------------------------------------- the checks (pure)


def _size(n: int) -> str:
    for unit, size in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def check_memlock(soft: int, hard: int, infinity: int = resource.RLIM_INFINITY) -> Check:
    """RLIMIT_MEMLOCK (soft, hard) in bytes."""
    if soft == infinity:
        return Check("memlock", "ok", "unlimited")
    shown = f"{_size(soft)} (hard limit {'unlimited' if hard == infinity else _size(hard)})"
    raise_to = "unlimited" if hard == infinity else str(hard // KiB)
    return Check(
        "memlock",
        "warn",
        f"{shown}: RDMA transports pin registered memory, so KV regions larger than this "
        "fail to register over RDMA (host-local cma/shm and tcp do not pin)",
        "systemd: LimitMEMLOCK=infinity (as in systemd/kvd.service); a shell: "
        f"ulimit -l {raise_to}; containers: --ulimit memlock=-1:-1; or "
        "/etc/security/limits.conf: `kvd - memlock unlimited`",
    )


def check_shm(total: int | None, free: int | None) -> Check:
    """/dev/shm's size and free space in bytes (None: not mounted)."""
    fix = (
        "mount -o remount,size=16G /dev/shm; Docker: --shm-size=16g; Kubernetes: an "
        "emptyDir with medium: Memory mounted at /dev/shm"
    )
    if total is None or free is None:
        return Check("shm", "fail", "/dev/shm is not there: host staging cannot work", fix)
    detail = f"{_size(free)} free of {_size(total)}"
    if free < SHM_FAIL_BELOW:
        return Check("shm", "fail", f"{detail}: too small for any KV staging region", fix)
    if free < SHM_WARN_BELOW:
        return Check("shm", "warn", f"{detail}: KV staging regions need the room", fix)
    return Check("shm", "ok", detail)


def parse_ucx_info(text: str) -> list[str]:
    """The transports `ucx_info -d` lists (`# Transport: NAME`), in order, once each."""
    out: list[str] = []
    for line in text.splitlines():
        key, _, value = line.strip().lstrip("#").strip().partition(":")
        if key.strip() == "Transport" and (name := value.strip()) and name not in out:
            out.append(name)
    return out


def transports_of_modules(paths: Iterable[str]) -> list[str]:
    """Transport names of bundled UCX modules (`libuct_cma.so.0` -> `cma`), and the ones
    built into libuct."""
    names = list(BUILTIN_TRANSPORTS)
    for p in paths:
        base = os.path.basename(p)
        if base.startswith("libuct_") and ".so" in base:
            name = base[len("libuct_") : base.index(".so")]
            if name not in names:
                names.append(name)
    return names


def check_ucx(transports: Sequence[str] | None, source: str, ucx_tls: str) -> Check:
    """The UCX transports found (None: no UCX found at all), from `source` ("ucx_info" or
    "modules"), against the configured `nixl.ucx_tls`."""
    if transports is None:
        return Check(
            "ucx",
            "warn",
            "no UCX found (no ucx_info, no UCX modules next to NIXL)",
            "install NIXL with its UCX (pip install nixl[cu12]) or UCX's tools (ucx_info)",
        )
    found = ", ".join(transports)
    wanted = [t.strip() for t in ucx_tls.lstrip("^").split(",") if t.strip()]
    missing = [
        t
        for t in wanted
        if t not in transports and t not in UCX_TLS_ALIASES and not ucx_tls.startswith("^")
    ]
    if missing:
        return Check(
            "ucx",
            "fail",
            f"nixl.ucx_tls names {', '.join(missing)}, not found ({source}: {found})",
            f"set nixl.ucx_tls to transports that are there (e.g. tcp), or empty: {found}",
        )
    verified = (
        ""
        if source == "ucx_info"
        else " (modules bundled with NIXL; ucx_info -d shows which have a device)"
    )
    if not RDMA_TRANSPORTS_ALL & set(transports):
        return Check(
            "ucx",
            "warn",
            f"{found}{verified}: no RDMA transport, transfers between hosts run over TCP",
            "for RDMA: the NIC's driver and rdma-core (libibverbs), and the device "
            "visible to the container (/dev/infiniband)",
        )
    return Check("ucx", "ok", f"{found}{verified}")


def check_nixl(plugins: Sequence[str] | None, error: str, backend: str) -> Check:
    """The NIXL plugins available (None: NIXL could not be loaded, `error` says why)."""
    if plugins is None:
        return Check(
            "nixl",
            "fail",
            f"NIXL cannot be loaded: {error}",
            "pip install nixl[cu12] (or nixl[cu13]) into kvd's environment",
        )
    if backend not in plugins:
        return Check(
            "nixl",
            "fail",
            f"backend {backend} is not among NIXL's plugins ({', '.join(plugins) or 'none'})",
            "reinstall NIXL with its UCX plugin; NIXL_PLUGIN_DIR must not point elsewhere",
        )
    return Check("nixl", "ok", f"backends {', '.join(sorted(plugins))}; using {backend}")


@dataclass(frozen=True)
class SocketDir:
    """What was found at the IPC socket's directory."""

    path: str
    """The socket's path."""
    dir_exists: bool
    dir_is_dir: bool
    writable: bool
    """We may create the socket there (write and search permission)."""
    mode: int
    """The directory's permission bits."""
    socket_exists: bool
    daemon: str
    """The daemon answering on the socket ("agent version"), "" if none."""


def check_socket_dir(s: SocketDir) -> Check:
    d = os.path.dirname(s.path) or "."
    if s.daemon:
        return Check("socket", "ok", f"{s.path}: served by {s.daemon}")
    if not s.dir_exists:
        return Check(
            "socket",
            "fail",
            f"{d} does not exist: the daemon cannot bind {s.path}",
            f"mkdir -p {d} && chown kvd: {d} (systemd/kvd.service creates /run/kvd with "
            "RuntimeDirectory=kvd), or set daemon.socket",
        )
    if not s.dir_is_dir:
        return Check("socket", "fail", f"{d} is not a directory", "set daemon.socket elsewhere")
    if not s.writable:
        return Check(
            "socket",
            "fail",
            f"{d} is not writable by this user (mode {s.mode:#o}): the daemon cannot bind",
            f"run kvd as the owner of {d}, or chown/chmod it, or set daemon.socket",
        )
    if s.mode & stat.S_IWOTH and not s.mode & stat.S_ISVTX:
        return Check(
            "socket",
            "warn",
            f"{d} is writable by every user (mode {s.mode:#o}): anyone could replace the socket",
            f"chmod o-w {d} (or use a directory of kvd's own, e.g. /run/kvd)",
        )
    if s.socket_exists:
        return Check(
            "socket",
            "warn",
            f"{s.path} exists but no daemon answers on it (left by a daemon that died?)",
            f"if no kvd runs: rm {s.path}",
        )
    return Check("socket", "ok", f"{d} is ready for {os.path.basename(s.path)} (no daemon yet)")


def check_clock(timedatectl: str | None, chrony: str | None, auth: bool) -> Check:
    """`timedatectl show -p NTPSynchronized --value` and `chronyc -n tracking` outputs
    (None: the tool is missing or failed)."""
    need = (
        "[auth] is on: peers' clocks must agree within 2 minutes"
        if auth
        else "kvd trace measures peer offsets itself"
    )
    fix = "run an NTP client (chrony, systemd-timesyncd) on every node"
    if timedatectl is not None and timedatectl.strip() in ("yes", "no"):
        if timedatectl.strip() == "yes":
            return Check("clock", "ok", "synchronized (timedatectl)")
        return Check(
            "clock", "warn" if auth else "ok", f"not synchronized (timedatectl); {need}", fix
        )
    if chrony is not None:
        status = ""
        for line in chrony.splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "Leap status":
                status = value.strip()
        if status == "Normal":
            return Check("clock", "ok", "synchronized (chrony)")
        if status:
            return Check("clock", "warn", f"chrony leap status {status!r}; {need}", fix)
    return Check(
        "clock",
        "warn" if auth else "skip",
        f"cannot tell (no timedatectl or chrony answer); {need}",
        fix,
    )


def check_peer(
    addr: str, connect_error: str, connect_ms: float, ping: dict[str, Any] | None
) -> Check:
    """One peer: the TCP connect to its side channel, and the daemon's `kvd ping` of it
    (None: no local daemon to ping through)."""
    name = f"peer {addr}"
    if connect_error:
        return Check(
            name,
            "fail",
            f"side channel unreachable: {connect_error}",
            "is kvd running there? across hosts its side_channel.host must not be "
            "127.0.0.1 (bind 0.0.0.0 with advertise_host); open the port in the firewall "
            "(TCP; UDP too, for the doorbell: nixl.doorbell)",
        )
    if ping is None:
        return Check(
            name, "ok", f"TCP connect in {connect_ms:.1f} ms (no local daemon to ping through)"
        )
    if not ping.get("ok"):
        return Check(
            name,
            "fail",
            f"TCP connects, but kvd ping fails: {ping.get('error') or 'canary mismatch'}",
            "same [auth] secret on both? compatible kvd versions? a UCX transport both "
            "share (nixl.ucx_tls)? see `kvd ping HOST:PORT`",
        )
    return Check(
        name,
        "ok",
        f"{ping.get('agent', '?')}: handshake {ping.get('handshake_ms', 0):.1f} ms, "
        f"notification {ping.get('notif_rtt_ms', 0):.1f} ms, "
        f"canary {str(ping.get('canary_by', 'read')).upper()} ok",
    )


def exit_code(checks: Sequence[Check]) -> int:
    return 1 if any(c.status == "fail" for c in checks) else 0


# ---------------------------------------------------------------- reading the system


def _run(argv: Sequence[str], timeout: float = 5.0) -> str | None:
    if shutil.which(argv[0]) is None:
        return None
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return res.stdout if res.returncode == 0 else None


def gather_shm() -> tuple[int | None, int | None]:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None, None
    return st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize


def gather_ucx() -> tuple[list[str] | None, str]:
    text = _run(["ucx_info", "-d"])
    if text is not None:
        return parse_ucx_info(text), "ucx_info"
    mods: list[str] = []
    for base in _nixl_lib_dirs():
        mods += glob.glob(os.path.join(base, "ucx", "libuct_*.so*"))
    return (transports_of_modules(mods) if mods else None), "modules"


def _nixl_lib_dirs() -> list[str]:
    import importlib.util

    dirs = []
    for pkg in ("nixl_cu12", "nixl_cu13", "nixl"):
        try:
            spec = importlib.util.find_spec(pkg)
        except (ImportError, ValueError):
            continue
        if spec is not None and spec.origin:
            dirs.append(str(Path(spec.origin).parent.parent / f"{pkg}.libs"))
    return dirs


def gather_nixl() -> tuple[list[str] | None, str]:
    try:
        from kvd.adapters.nixl_import import nixl_api

        api = nixl_api()
        nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config

        logging.getLogger("nixl").setLevel(logging.WARNING)  # its INFO lines go to stdout
        agent = nixl_agent(f"kvd-doctor-{os.getpid()}", nixl_agent_config(backends=[]))
        return list(agent.get_plugin_list()), ""
    except Exception as exc:
        return None, f"{type(exc).__name__}: {exc}"


def gather_socket(path: str, daemon: str) -> SocketDir:
    d = os.path.dirname(path) or "."
    try:
        st = os.stat(d)
        exists, is_dir, mode = True, stat.S_ISDIR(st.st_mode), stat.S_IMODE(st.st_mode)
    except OSError:
        exists, is_dir, mode = False, False, 0
    return SocketDir(
        path=path,
        dir_exists=exists,
        dir_is_dir=is_dir,
        writable=exists and os.access(d, os.W_OK | os.X_OK),
        mode=mode,
        socket_exists=os.path.exists(path),
        daemon=daemon,
    )


def connect(host: str, port: int, timeout: float) -> tuple[str, float]:
    """A TCP connect: ("", ms) or (why it failed, 0)."""
    t0 = time.perf_counter()
    try:
        with socket.create_connection((host, port), timeout=timeout):
            pass
    except OSError as exc:
        return (exc.strerror or str(exc) or type(exc).__name__), 0.0
    return "", (time.perf_counter() - t0) * 1e3


def _daemon(path: str) -> tuple[Any, str]:
    """A client of the daemon on `path` and "agent version", or (None, "")."""
    from kvd_client.client import KvdClient
    from kvd_client.errors import KvdError

    if not os.path.exists(path):
        return None, ""
    c = KvdClient(path, role="cli", timeout=2.0, keepalive_interval=0)
    try:
        w = c.connect()
    except KvdError:
        c.close()
        return None, ""
    return c, f"{w.agent_name} (kvd {w.daemon_version})"


def _split(addr: str) -> tuple[str, int] | None:
    host, _, port = addr.rpartition(":")
    return (host.strip("[]"), int(port)) if host and port.isdigit() else None


def run(cfg: Config, peers: Sequence[str], timeout: float = 2.0) -> list[Check]:
    """Every check against this node and `cfg` (see the module docstring)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    checks = [check_memlock(soft, hard), check_shm(*gather_shm())]
    transports, source = gather_ucx()
    checks.append(check_ucx(transports, source, cfg.nixl.ucx_tls))
    plugins, why = gather_nixl()
    checks.append(check_nixl(plugins, why, cfg.nixl.backend))
    path = str(resolve_socket_path(cfg))
    client, daemon = _daemon(path)
    try:
        checks.append(check_socket_dir(gather_socket(path, daemon)))
        checks.append(
            check_clock(
                _run(["timedatectl", "show", "-p", "NTPSynchronized", "--value"]),
                _run(["chronyc", "-n", "tracking"]),
                bool(cfg.auth.secret_file),
            )
        )
        targets = list(dict.fromkeys(peers))
        if client is not None:
            try:
                known = client.status("peers")["peers"]
            except KvdError:
                known = []
            targets += [p["addr"] for p in known if p["addr"] not in targets]
        if not targets:
            checks.append(
                Check("peers", "skip", "no peer named", "kvd doctor --peer HOST:PORT (repeatable)")
            )
        for addr in targets:
            hp = _split(addr)
            if hp is None:
                checks.append(Check(f"peer {addr}", "fail", "not HOST:PORT", "--peer HOST:PORT"))
                continue
            error, ms = connect(*hp, timeout)
            ping = None
            if client is not None and not error:
                try:
                    # a handshake and a READ: more than a connect, on a busy node too
                    ping = client.ping_peer(hp[0], hp[1], max(timeout * 5, 10.0))
                except KvdError as exc:
                    ping = {"ok": False, "error": exc.message}
            checks.append(check_peer(addr, error, ms, ping))
    finally:
        if client is not None:
            client.close()
    return checks


def as_json(checks: Sequence[Check]) -> dict[str, Any]:
    return {
        "ok": exit_code(checks) == 0,
        "checks": [asdict(c) for c in checks],
    }


def render(checks: Sequence[Check], console: Any) -> None:
    from rich.table import Table

    colour = {"ok": "green", "warn": "yellow", "fail": "red", "skip": "dim"}
    t = Table(title="kvd doctor")
    for col in ("check", "status", "found", "fix"):
        t.add_column(col, overflow="fold")
    for c in checks:
        t.add_row(c.name, f"[{colour[c.status]}]{c.status}[/]", c.detail, c.fix)
    console.print(t)
    fails = sum(c.status == "fail" for c in checks)
    warns = sum(c.status == "warn" for c in checks)
    console.print(f"failed: {fails}, warnings: {warns}" if fails or warns else "all checks passed")
