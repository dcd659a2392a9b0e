"""`kvd serve` tells systemd READY=1 (only once its sockets are bound) and STOPPING=1."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

from kvd_client.client import KvdClient


def test_serve_notifies_ready_and_stopping(workdir: Path) -> None:
    notify_path = str(workdir / "notify.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(notify_path)
    listener.settimeout(30)
    sock = str(workdir / "d.sock")
    cfg = workdir / "d.toml"
    cfg.write_text(f'[daemon]\nname = "kvd-notify"\nsocket = "{sock}"\n[side_channel]\nport = 0\n')
    env = dict(os.environ, NOTIFY_SOCKET=notify_path)
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvd", "serve", "--config", str(cfg)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        msg = listener.recv(4096).decode()
        assert "READY=1" in msg.split("\n")
        # READY means the IPC socket is bound and answers, with the configured mode
        assert stat.S_IMODE(os.stat(sock).st_mode) == 0o660
        with KvdClient(sock, role="cli", timeout=5) as c:
            assert c.status()["agent_name"] == "kvd-notify"
        proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 20
        got: list[str] = []
        while time.monotonic() < deadline and "STOPPING=1" not in got:
            got += listener.recv(4096).decode().split("\n")
        assert "STOPPING=1" in got
        assert proc.wait(20) == 0
        assert not os.path.exists(sock)
    finally:
        if proc.poll() is None:
            proc.kill()
        listener.close()
