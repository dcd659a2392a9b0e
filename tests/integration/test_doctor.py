"""`kvd doctor --config` against a real daemon's config: the socket is served, a peer
daemon is reached (TCP, then `kvd ping` through the daemon), a closed port fails."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from typing import Any

from .conftest import StartDaemon


def _doctor(*args: str) -> tuple[int, dict[str, Any]]:
    res = subprocess.run(
        [sys.executable, "-m", "kvd", "doctor", "--json", *args],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode in (0, 1), res.stderr[-2000:]
    return res.returncode, json.loads(res.stdout)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])  # closed again when we return


def test_doctor_checks_a_serving_node_and_its_peers(daemons: StartDaemon) -> None:
    p = daemons("kvd-p")
    d = daemons("kvd-d")
    dead = _closed_port()
    code, out = _doctor(
        "--config",
        str(d.config),
        "--peer",
        f"127.0.0.1:{p.side_port}",
        "--peer",
        f"127.0.0.1:{dead}",
    )
    checks = {c["name"]: c for c in out["checks"]}
    assert {"memlock", "shm", "ucx", "nixl", "socket", "clock"} <= set(checks)
    for c in out["checks"]:
        assert c["status"] in ("ok", "warn", "fail", "skip")
        assert c["status"] in ("ok", "skip") or c["fix"], c  # every finding has a fix
    assert checks["socket"]["status"] == "ok" and "kvd-d" in checks["socket"]["detail"]
    assert checks["nixl"]["status"] == "ok" and "UCX" in checks["nixl"]["detail"]
    reached = checks[f"peer 127.0.0.1:{p.side_port}"]
    assert reached["status"] == "ok", reached
    assert "kvd-p" in reached["detail"] and "canary READ ok" in reached["detail"]
    refused = checks[f"peer 127.0.0.1:{dead}"]
    assert refused["status"] == "fail" and "unreachable" in refused["detail"]
    assert code == 1 and out["ok"] is False  # the closed port
    # the peer D has handshaked with is checked without naming it; all fine: exit 0
    code, out = _doctor("--config", str(d.config))
    checks = {c["name"]: c for c in out["checks"]}
    assert checks[f"peer 127.0.0.1:{p.side_port}"]["status"] == "ok"
    assert code == (1 if any(c["status"] == "fail" for c in out["checks"]) else 0)
    assert out["ok"] == (code == 0)
