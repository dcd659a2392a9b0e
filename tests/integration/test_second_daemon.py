"""A second daemon started on what a running one holds (its socket, a port, its disk tier:
an operator's `kvd serve` by hand beside systemd's, two configs sharing a path) fails to
start with one clear line, exit 1, and changes nothing of the running daemon's.

Before: it crashed with a traceback, and on its way out removed the running daemon's IPC
socket (engines and operators could no longer reach it), after its tiers had already
scanned the shared disk tier (removing the running daemon's unfinished writes).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from kvd_client.client import KvdClient

from kvd.demo import DaemonProc

from .conftest import StartDaemon


def serve(workdir: Path, name: str, config: str) -> tuple[int, list[dict[str, Any]], str]:
    """Run `kvd serve` with `config` (TOML) to its end: exit code, JSON log lines, output."""
    cfg = workdir / f"{name}.toml"
    cfg.write_text(config)
    res = subprocess.run(
        [sys.executable, "-m", "kvd", "serve", "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    out = res.stdout + res.stderr
    lines = []
    for text in out.splitlines():
        try:
            lines.append(json.loads(text))
        except ValueError:
            continue
    return res.returncode, lines, out


def own_config(name: str, sock: Path, side_port: int, extra: str = "") -> str:
    """A daemon's config with a socket of its own (and `extra` TOML)."""
    return (
        f'[daemon]\nname = "{name}"\nsocket = "{sock}"\n[side_channel]\nport = {side_port}\n'
        f'[log]\nformat = "json"\n{extra}'
    )


def unfinished_write(disk: Path) -> Path:
    """A temp file as the running daemon's disk tier leaves while it writes a block (a
    daemon that starts on this disk tier removes such files: they are leftovers of a
    crash, unless another daemon is writing them)."""
    sub = disk / "ab"
    sub.mkdir(parents=True, exist_ok=True)
    tmp = sub / "0123456789abcdef.blk.0a1b2c3d.tmp"
    tmp.write_bytes(b"half a block")
    return tmp


def serving(d: DaemonProc) -> bool:
    with KvdClient(d.socket, role="cli", timeout=5.0, keepalive_interval=0) as c:
        return bool(c.status()["agent_name"] == d.name)


def failed_once(lines: list[dict[str, Any]], out: str, event: str) -> dict[str, Any]:
    """The one error line of a start failure: no crash, no traceback, never ready."""
    found = [ln for ln in lines if ln.get("event") == event]
    assert len(found) == 1, out
    assert "daemon_crashed" not in out and "Traceback" not in out, out
    assert not any(ln.get("event") == "daemon_ready" for ln in lines), out
    return found[0]


def test_a_second_daemon_with_the_same_config_changes_nothing(
    daemons: StartDaemon, workdir: Path
) -> None:
    disk = workdir / "disk-a"
    a = daemons("kvd-sd-a", overrides={"tiers": {"enabled": True, "disk_path": str(disk)}})
    tmp = unfinished_write(disk)
    config = (workdir / "kvd-sd-a.toml").read_text()
    rc, lines, out = serve(workdir, "kvd-sd-again", config)
    assert rc == 1, out
    line = failed_once(lines, out, "socket_in_use")
    assert line["socket"] == a.socket and "another kvd daemon" in line["hint"]
    assert os.path.exists(a.socket) and serving(a)  # its socket is still there, and it
    assert tmp.exists()  # the second daemon never touched the disk tier


def test_a_second_daemon_on_the_same_disk_tier_fails_clearly_until_the_first_is_gone(
    daemons: StartDaemon, workdir: Path
) -> None:
    """The disk tier is held by a lock file while its daemon runs: another daemon with
    the same `tiers.disk_path` (its own socket and port) refuses to start, naming the
    holder; once the holder is SIGKILLed (the kernel drops the lock) the next start takes
    the disk tier, as a restart under systemd does."""
    disk = workdir / "disk-b"
    a = daemons("kvd-sd-b", overrides={"tiers": {"enabled": True, "disk_path": str(disk)}})
    tmp = unfinished_write(disk)
    sock = workdir / "kvd-sd-other.sock"
    config = own_config("kvd-sd-other", sock, 0, f'[tiers]\nenabled = true\ndisk_path = "{disk}"\n')
    rc, lines, out = serve(workdir, "kvd-sd-other", config)
    assert rc == 1, out
    line = failed_once(lines, out, "tiers_disk_in_use")
    assert line["path"] == str(disk) and line["holder_pid"] == str(a.proc.pid), line
    assert tmp.exists() and serving(a)
    assert not sock.exists()

    a.proc.send_signal(signal.SIGKILL)
    a.proc.wait(10)
    b = daemons("kvd-sd-b2", overrides={"tiers": {"enabled": True, "disk_path": str(disk)}})
    assert serving(b)
    assert not tmp.exists()  # a dead daemon's unfinished write: removed at start


def test_a_port_in_use_is_a_clear_start_failure(daemons: StartDaemon, workdir: Path) -> None:
    a = daemons("kvd-sd-c")
    sock = workdir / "kvd-sd-port.sock"
    config = own_config("kvd-sd-port", sock, a.side_port)
    rc, lines, out = serve(workdir, "kvd-sd-port", config)
    assert rc == 1, out
    line = failed_once(lines, out, "bind_failed")
    assert line["setting"] == "side_channel.port", line
    assert line["address"].endswith(f":{a.side_port}"), line
    assert serving(a) and not sock.exists()
