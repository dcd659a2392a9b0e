"""`kvd top` against real daemons carrying real transfers.

Under tmux (a real terminal, 80 columns): the frame shows the daemon and the transfer
count, the count moves as transfers happen, and `q` quits with status 0, leaving the
terminal as it was. `--once` prints one frame to stdout.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from kvd_client import wire

from kvd.demo import Engine, make_engine

from .conftest import StartDaemon

ROOT = Path(__file__).resolve().parents[2]


def _push(p: Engine, d: Engine, port: int, i: int, n: int = 2) -> None:
    p_blocks = [(i * n + k) % 16 for k in range(n)]
    d_blocks = [16 + (i * n + k) % 16 for k in range(n)]
    for b in p_blocks:
        p.block(0, b)[:] = (i % 250) + 1
    d.client.register_push(f"t-{i}-aaaaaaaa", d_blocks, "127.0.0.1", port)
    p.client.finished(f"t-{i}-bbbbbbbb", p_blocks)
    (ev,) = d.client.wait_events(10)
    assert isinstance(ev, wire.RecvFinished), ev
    (ev,) = p.client.wait_events(10)
    assert isinstance(ev, wire.SendFinished), ev
    assert all((d.block(0, b) == (i % 250) + 1).all() for b in d_blocks)


def _env() -> dict[str, str]:
    # without LINES/COLUMNS (pytest-xdist's workers set 24 x 80): kvd top must size its
    # frame from the terminal it runs in
    env = {k: v for k, v in os.environ.items() if k not in ("LINES", "COLUMNS")}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT), str(ROOT / "client"), env.get("PYTHONPATH", "")]
    )
    return env


def _write_count(screen: str) -> int | None:
    """The WRITE row's transfer count in a frame (`WRITE (P)  <count> ...`)."""
    m = re.search(r"WRITE \(P\)\s+(\d+)", screen)
    return int(m.group(1)) if m else None


def test_top_once_prints_one_frame(daemons: StartDaemon) -> None:
    p_d = daemons("kvd-top1p")
    d_d = daemons("kvd-top1d")
    p = make_engine(p_d.socket, "prefill", num_blocks=32, num_layers=2, chunk_bytes=4096)
    d = make_engine(d_d.socket, "decode", num_blocks=32, num_layers=2, chunk_bytes=4096)
    try:
        for i in range(3):
            _push(p, d, p_d.side_port, i)
        out = subprocess.run(
            [sys.executable, "-m", "kvd", "top", "--once", "--interval", "0.2", "-s", p_d.socket],
            capture_output=True,
            text=True,
            timeout=60,
            env=_env(),
            check=False,
        )
    finally:
        p.close()
        d.close()
    assert out.returncode == 0, out.stderr
    assert "kvd-top1p" in out.stdout
    assert _write_count(out.stdout) == 3, out.stdout
    assert "kvd-top1d" in out.stdout  # the per-peer table names D
    assert max(len(line) for line in out.stdout.splitlines()) <= 80


def test_top_under_tmux_moves_and_quits_on_q(daemons: StartDaemon, tmp_path: Path) -> None:
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux) so no terminal to drive")
    p_d = daemons("kvd-top2p")
    d_d = daemons("kvd-top2d")
    p = make_engine(p_d.socket, "prefill", num_blocks=32, num_layers=2, chunk_bytes=4096)
    d = make_engine(d_d.socket, "decode", num_blocks=32, num_layers=2, chunk_bytes=4096)
    session = f"kvdtop-{uuid.uuid4().hex[:8]}"
    rc_file = tmp_path / "rc"
    cmd = " ".join(
        shlex.quote(x)
        for x in [sys.executable, "-m", "kvd", "top", "--interval", "0.3", "-s", p_d.socket]
    )
    stty_before = tmp_path / "stty-before"
    stty_after = tmp_path / "stty-after"
    script = (
        f"stty -g > {shlex.quote(str(stty_before))}; {cmd}; echo $? > {shlex.quote(str(rc_file))}; "
        f"stty -g > {shlex.quote(str(stty_after))}; sleep 30"
    )
    env = _env()
    tmux = ["tmux", "-L", session]
    subprocess.run(
        [*tmux, "new-session", "-d", "-s", session, "-x", "80", "-y", "50", "sh", "-c", script],
        check=True,
        env=env,
        timeout=20,
    )

    def screen() -> str:
        return subprocess.run(
            [*tmux, "capture-pane", "-p", "-t", session],
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout

    def wait_for(cond: Callable[[str], bool], timeout: float = 30.0) -> str:
        deadline = time.monotonic() + timeout
        while True:
            s = screen()
            if cond(s):
                return s
            assert time.monotonic() < deadline, f"screen never matched:\n{s}"
            time.sleep(0.1)

    try:
        first = wait_for(lambda s: "kvd-top2p" in s and "q quits" in s)
        assert _write_count(first) is None  # no transfer yet: "none yet"
        for i in range(2):
            _push(p, d, p_d.side_port, i)
        wait_for(lambda s: _write_count(s) == 2)
        for i in range(2, 5):
            _push(p, d, p_d.side_port, i)
        # A whole frame: the capture can catch Live mid-redraw (lines erased, the lower
        # ones not yet written), so wait for the footer, the frame's last line, too.
        shown = wait_for(lambda s: _write_count(s) == 5 and "q quits" in s)
        assert "kvd-top2d" in shown, shown  # per peer
        assert all(len(line.rstrip()) <= 80 for line in shown.splitlines())
        subprocess.run([*tmux, "send-keys", "-t", session, "q"], check=True, timeout=10)
        deadline = time.monotonic() + 20
        while not rc_file.exists() or not stty_after.exists():
            assert time.monotonic() < deadline, f"kvd top did not quit on q:\n{screen()}"
            time.sleep(0.1)
        time.sleep(0.2)
        assert rc_file.read_text().strip() == "0"
        assert stty_after.read_text() == stty_before.read_text()  # the terminal restored
    finally:
        subprocess.run([*tmux, "kill-server"], check=False, timeout=10)
        p.close()
        d.close()
