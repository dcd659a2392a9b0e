"""`kvd doctor`'s rules, from what a node could look like, without reading this one."""

from __future__ import annotations

import stat

import pytest

from kvd.doctor import (
    Check,
    GiB,
    MiB,
    SocketDir,
    as_json,
    check_clock,
    check_memlock,
    check_nixl,
    check_peer,
    check_shm,
    check_socket_dir,
    check_ucx,
    exit_code,
    parse_ucx_info,
    transports_of_modules,
)

INF = -1


def test_memlock_unlimited_is_ok_and_a_limit_warns_with_the_fix() -> None:
    assert check_memlock(INF, INF, INF).status == "ok"
    c = check_memlock(8 * MiB, 8 * MiB, INF)
    assert c.status == "warn" and "8.0 MiB" in c.detail
    assert "LimitMEMLOCK=infinity" in c.fix and "ulimit -l 8192" in c.fix
    assert "ulimit -l unlimited" in check_memlock(64 * MiB, INF, INF).fix


@pytest.mark.parametrize(
    ("free", "status"),
    [(None, "fail"), (32 * MiB, "fail"), (512 * MiB, "warn"), (8 * GiB, "ok")],
)
def test_shm_by_free_space(free: int | None, status: str) -> None:
    c = check_shm(None if free is None else 16 * GiB, free)
    assert c.status == status
    assert ("--shm-size" in c.fix) == (status != "ok")


UCX_INFO = """
#      Transport: posix
#         Device: memory
#      Transport: tcp
#         Device: eth0
#      Transport: tcp
#         Device: lo
#      Transport: rc_mlx5
#         Device: mlx5_0:1
"""


def test_ucx_info_and_bundled_modules_are_read() -> None:
    assert parse_ucx_info(UCX_INFO) == ["posix", "tcp", "rc_mlx5"]
    mods = ["/x/ucx/libuct_cma.so.0.0.0", "/x/ucx/libuct_ib.so.0", "/x/ucx/libuct_ib.la"]
    assert transports_of_modules(mods) == ["self", "tcp", "posix", "sysv", "cma", "ib"]


def test_ucx_checks_the_configured_transports_and_rdma() -> None:
    assert check_ucx(None, "modules", "").status == "warn"
    assert check_ucx(["posix", "tcp", "rc_mlx5"], "ucx_info", "").status == "ok"
    tcp_only = check_ucx(["posix", "tcp"], "ucx_info", "")
    assert tcp_only.status == "warn" and "no RDMA" in tcp_only.detail
    missing = check_ucx(["posix", "tcp"], "ucx_info", "tcp,rc_mlx5")
    assert missing.status == "fail" and "rc_mlx5" in missing.detail
    assert check_ucx(["tcp", "rc"], "ucx_info", "tcp,shm").status == "ok"  # an alias
    assert check_ucx(["tcp", "rc"], "ucx_info", "^cma").status == "ok"  # an exclusion
    assert "ucx_info -d" in check_ucx(["tcp", "ib"], "modules", "").detail


def test_nixl_needs_the_configured_backend() -> None:
    assert check_nixl(["UCX", "POSIX"], "", "UCX").status == "ok"
    c = check_nixl(["POSIX"], "", "UCX")
    assert c.status == "fail" and "POSIX" in c.detail
    c = check_nixl(None, "ImportError: no nixl", "UCX")
    assert c.status == "fail" and "no nixl" in c.detail and "pip install" in c.fix


def _dir(**kw: object) -> SocketDir:
    base: dict[str, object] = {
        "path": "/run/kvd/kvd.sock",
        "dir_exists": True,
        "dir_is_dir": True,
        "writable": True,
        "mode": 0o750,
        "socket_exists": False,
        "daemon": "",
    }
    return SocketDir(**(base | kw))  # type: ignore[arg-type]


def test_socket_directory() -> None:
    assert check_socket_dir(_dir()).status == "ok"
    served = check_socket_dir(_dir(socket_exists=True, daemon="kvd-a (kvd 0.1.0)"))
    assert served.status == "ok" and "kvd-a" in served.detail
    gone = check_socket_dir(_dir(dir_exists=False, dir_is_dir=False))
    assert gone.status == "fail" and "RuntimeDirectory=kvd" in gone.fix
    assert check_socket_dir(_dir(dir_is_dir=False)).status == "fail"
    assert check_socket_dir(_dir(writable=False)).status == "fail"
    assert check_socket_dir(_dir(mode=0o777)).status == "warn"
    assert check_socket_dir(_dir(mode=0o777 | stat.S_ISVTX)).status == "ok"  # like /tmp
    stale = check_socket_dir(_dir(socket_exists=True))
    assert stale.status == "warn" and "rm /run/kvd/kvd.sock" in stale.fix


def test_clock() -> None:
    assert check_clock("yes\n", None, auth=True).status == "ok"
    assert check_clock("no\n", None, auth=True).status == "warn"
    assert check_clock("no\n", None, auth=False).status == "ok"
    chrony = "Reference ID    : 1\nLeap status     : Normal\n"
    assert check_clock(None, chrony, auth=True).status == "ok"
    bad = check_clock(None, "Leap status     : Not synchronised\n", auth=True)
    assert bad.status == "warn" and "Not synchronised" in bad.detail
    assert check_clock(None, None, auth=True).status == "warn"
    assert check_clock(None, None, auth=False).status == "skip"


def test_peers() -> None:
    down = check_peer("10.0.0.2:5600", "Connection refused", 0.0, None)
    assert down.status == "fail" and "refused" in down.detail and "firewall" in down.fix
    assert check_peer("10.0.0.2:5600", "", 0.4, None).status == "ok"
    ping = {"ok": True, "agent": "kvd-p", "handshake_ms": 3.0, "notif_rtt_ms": 0.2}
    up = check_peer("10.0.0.2:5600", "", 0.4, ping)
    assert up.status == "ok" and "kvd-p" in up.detail
    bad = check_peer("10.0.0.2:5600", "", 0.4, {"ok": False, "error": "auth failed"})
    assert bad.status == "fail" and "auth failed" in bad.detail


def test_exit_code_and_json() -> None:
    checks = [Check("a", "ok", ""), Check("b", "warn", ""), Check("c", "skip", "")]
    assert exit_code(checks) == 0 and as_json(checks)["ok"] is True
    checks.append(Check("d", "fail", "x", "y"))
    assert exit_code(checks) == 1
    out = as_json(checks)
    assert out["ok"] is False
    assert out["checks"][-1] == {"name": "d", "status": "fail", "detail": "x", "fix": "y"}
