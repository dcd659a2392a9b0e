#!/usr/bin/env python3
"""A UCX abort, reproduced with NIXL alone (no kvd): for a report to UCX.

Over TCP UCX has no native GET: a READ is emulated with active messages, and the
target's UCX answers each GET request from its progress loop
(`ucp_progress_get_reply`, src/ucp/rma/rma_sw.c). When the reader's connection was reset
meanwhile, `uct_ep_am_bcopy` returns an error (ENDPOINT_TIMEOUT here), which goes back
through `ucp_request_send` -> `ucp_request_try_send` -> `ucs_fatal("unexpected error")`:
the TARGET process aborts, although only its peer died.

The sequence: the target is stopped (SIGSTOP: a frozen or CPU-starved process), a
reader READs from it (its GET requests wait in the target's socket), the reader dies
(SIGKILL), the target resumes: it reads the GET requests, answers, and aborts.

    UCX_TLS=tcp python scripts/ucx_get_abort_repro.py [ROUNDS]

prints, per round, whether the target survived; exits 1 at the first abort (with the
target's last output, where UCX's "Fatal: unexpected error" and backtrace appear).
UCX_TLS defaults to tcp here (on one machine UCX would otherwise READ over cma, natively:
no emulation, no abort). Seen with UCX 1.23.0 (the one in nixl 1.5.1's wheel).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

MiB = 1 << 20
SIZE = 64 * MiB


def _agent(name: str):  # type: ignore[no-untyped-def]
    from nixl._api import nixl_agent, nixl_agent_config

    # no progress thread: the process drives UCX itself (as kvd's NIXL thread does)
    return nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))


def target(workdir: Path) -> None:
    """Register a buffer, publish metadata and address, and progress forever."""
    import numpy as np

    agent = _agent("target")
    buf = np.ones(SIZE, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, SIZE, 0, "")], "DRAM")
    (workdir / "target.md").write_bytes(agent.get_agent_metadata())
    (workdir / "target.addr").write_text(str(buf.ctypes.data))
    while True:  # answers the reader's GET requests from here
        agent.get_new_notifs()
        time.sleep(0.001)


def reader(workdir: Path) -> None:
    """READ the target's buffer, 1 MiB pieces, over and over, without waiting."""
    import numpy as np

    agent = _agent(f"reader-{os.getpid()}")
    name = agent.add_remote_agent((workdir / "target.md").read_bytes())
    addr = int((workdir / "target.addr").read_text())
    buf = np.zeros(SIZE, dtype=np.uint8)
    agent.register_memory([(buf.ctypes.data, SIZE, 0, "")], "DRAM")
    n = SIZE // MiB
    local = np.array([[buf.ctypes.data + i * MiB, MiB, 0] for i in range(n)], dtype=np.uint64)
    remote = np.array([[addr + i * MiB, MiB, 0] for i in range(n)], dtype=np.uint64)
    ls = agent.get_xfer_descs(local, "DRAM")
    rs = agent.get_xfer_descs(remote, "DRAM")
    print("reading", flush=True)
    while True:
        h = agent.initialize_xfer("READ", ls, rs, name, b"")
        agent.transfer(h)
        while agent.check_xfer_state(h) == "PROC":
            agent.get_new_notifs()
        agent.release_xfer_handle(h)


def main() -> int:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    env = {**os.environ, "UCX_TLS": os.environ.get("UCX_TLS", "tcp")}
    with tempfile.TemporaryDirectory(prefix="ucx-get-") as tmp:
        workdir = Path(tmp)
        log = open(workdir / "target.log", "w+b")  # noqa: SIM115 - read back at the end
        t = subprocess.Popen(
            [sys.executable, __file__, "--target", tmp], env=env, stdout=log, stderr=log
        )
        try:
            for _ in range(300):
                if (workdir / "target.addr").exists():
                    break
                time.sleep(0.1)
            for r in range(rounds):
                rd = subprocess.Popen(
                    [sys.executable, __file__, "--reader", tmp], env=env, stdout=subprocess.PIPE
                )
                assert rd.stdout is not None
                rd.stdout.readline()  # "reading"
                time.sleep(0.5)
                t.send_signal(signal.SIGSTOP)  # the target stops answering
                time.sleep(0.5)  # the reader's GET requests wait in the target's socket
                rd.kill()  # the reader dies: its connection is reset
                rd.wait()
                time.sleep(0.2)
                t.send_signal(signal.SIGCONT)  # the target answers them
                time.sleep(3.0)
                alive = t.poll() is None
                print(f"round {r}: target {'alive' if alive else f'DIED ({t.returncode})'}")
                if not alive:
                    log.seek(0)
                    print(log.read().decode(errors="replace")[-4000:])
                    return 1
        finally:
            if t.poll() is None:
                t.send_signal(signal.SIGCONT)
                t.kill()
                t.wait()
    print(f"the target survived {rounds} rounds")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--target":
        target(Path(sys.argv[2]))
    elif len(sys.argv) == 3 and sys.argv[1] == "--reader":
        reader(Path(sys.argv[2]))
    else:
        sys.exit(main())
