"""The local plane's floor: a ZMQ IPC round trip between a client and an event loop.

A kvd request crosses ZMQ IPC twice on its path: the engine's call to its daemon and
the terminal event back. `round_trips` measures that pair with nothing else in it:

- the helper (`python -m kvd.bench.zmqfloor <endpoint>`) is a process with the daemon's
  loop (anyio on uvloop) and the gateway's socket (a `zmq.asyncio` ROUTER), and sends
  every frame it reads straight back to its sender;
- the benchmark is the client, as `kvd_client.KvdClient` is: a synchronous DEALER, a
  non-blocking send, then `poll` until the answer is in.

Each ZMQ message passes through libzmq's I/O thread on both ends, so a round trip is
eight thread hand-offs on two cores: what a daemon reached over ZMQ cannot go below,
whatever it does between the two messages.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Final

import zmq

QUIT: Final = b"kvd-bench-quit"
_BODY: Final = b"\x00" * 96
"""About the size of a `RegisterPush` frame of a two-block request."""


async def _echo(endpoint: str) -> None:
    import zmq.asyncio

    ctx = zmq.asyncio.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.bind(endpoint)
    print("ready", flush=True)
    try:
        while True:
            frames = await sock.recv_multipart(copy=False)
            if frames[-1].bytes == QUIT:
                return
            sock.send_multipart(frames, flags=zmq.NOBLOCK)
    finally:
        sock.close(0)
        ctx.term()


def helper_main() -> int:
    import anyio

    anyio.run(_echo, sys.argv[1], backend="asyncio", backend_options={"use_uvloop": True})
    return 0


def round_trips(workdir: Path, n: int, warmup: int = 50, timeout: float = 5.0) -> list[float]:
    """Seconds of n ZMQ IPC round trips (client DEALER -> asyncio ROUTER in a helper
    process -> back), each started right after the one before, after `warmup`."""
    endpoint = f"ipc://{workdir / f'zmq-floor-{os.getpid()}.sock'}"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvd.bench.zmqfloor", endpoint],
        stdout=subprocess.PIPE,
        text=True,
    )
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != "ready":
            raise RuntimeError("zmq floor helper did not start")
        sock.connect(endpoint)
        out = []
        for i in range(warmup + n):
            t0 = time.perf_counter()
            sock.send(_BODY, flags=zmq.NOBLOCK)
            if not sock.poll(int(timeout * 1000)):
                raise RuntimeError("zmq floor helper did not answer")
            sock.recv()
            if i >= warmup:
                out.append(time.perf_counter() - t0)
        sock.send(QUIT)
        return out
    finally:
        sock.close(0)
        ctx.term()
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        with contextlib.suppress(FileNotFoundError):
            Path(endpoint.removeprefix("ipc://")).unlink()


if __name__ == "__main__":
    sys.exit(helper_main())
