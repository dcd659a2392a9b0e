"""Raw NIXL, as an in-process connector uses it: the baseline kvd is compared with.

Two agents in two processes, like kvd's two daemons:

- `RawPeer` runs in a helper process (`python -m kvd.bench.raw`) with its own agent. It
  maps POSIX shared-memory segments by name, registers them, and drives its agent's
  progress the way kvd's NIXL thread does: no NIXL progress thread (the wrapper's
  default one busy-spins a core), `get_new_notifs` polled continuously for a while after
  activity and with an idle back-off up to 1 ms otherwise. It takes commands from the
  parent as length-prefixed msgpack frames on stdin and answers on stdout.
- `RawInitiator` is an agent in the benchmark process that posts READs and WRITEs
  against the helper's registrations and times each one: building the descriptor
  lists, `initialize_xfer`, `transfer` (with a notification, as every kvd transfer
  carries one), waiting for DONE, releasing the handle. Descriptor arrays are planned
  before the clock starts, so the raw contender pays nothing for planning.
- The floor of the control plane: `RawInitiator.notif_round_trip` sends the helper a
  notification (`PING`), which answers with one of its own (`PONG`) as soon as it polls
  it; the initiator polls continuously until it is in. Two notifications, no daemon:
  what a push (D's registration to P, P's WRITE with its notification back) cannot go
  below, whatever kvd does.
"""

from __future__ import annotations

import contextlib
import os
import select
import struct
import subprocess
import sys
import time
from typing import IO, Any, Final

import msgpack
import numpy as np

from kvd.adapters.shm import MappedRegion

_IDLE_MAX_S: Final = 0.001
_SPIN_S: Final = 0.002
_HEADER: Final = struct.Struct("<I")
PING: Final = b"kvd-bench-ping"
PONG: Final = b"kvd-bench-pong"


def _make_agent(name: str) -> Any:
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    from kvd.adapters.nixl_import import nixl_api

    api = nixl_api()
    nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config

    conf = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=[])
    agent = nixl_agent(name, conf)
    agent.create_backend("UCX", {"ucx_error_handling_mode": "peer"})
    return agent


def _write_frame(out: IO[bytes], obj: Any) -> None:
    data = msgpack.packb(obj, use_bin_type=True)
    out.write(_HEADER.pack(len(data)) + data)
    out.flush()


def _read_exact(fd: int, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError("pipe closed")
        buf += chunk
    return bytes(buf)


def _read_frame(fd: int) -> Any:
    (n,) = _HEADER.unpack(_read_exact(fd, _HEADER.size))
    return msgpack.unpackb(_read_exact(fd, n), raw=False)


# ------------------------------------------------------------------ the helper process


def peer_main() -> int:
    """The helper's loop: commands on stdin, NIXL progress in between."""
    name = sys.argv[1] if len(sys.argv) > 1 else f"kvd-bench-raw-peer-{os.getpid()}"
    agent = _make_agent(name)
    regions: list[MappedRegion] = []
    regs: list[Any] = []
    notifs = 0
    fd = sys.stdin.fileno()
    out = sys.stdout.buffer
    idle = 10e-6
    last = time.monotonic()
    try:
        while True:
            got = agent.get_new_notifs()
            if got:
                notifs += sum(len(v) for v in got.values())
                for sender, msgs in got.items():
                    for _ in range(sum(1 for m in msgs if bytes(m) == PING)):
                        agent.send_notif(_as_str(sender), PONG)
                last = time.monotonic()
                idle = 10e-6
            wait = 0.0 if time.monotonic() - last < _SPIN_S else idle
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                if wait > 0:
                    idle = min(_IDLE_MAX_S, idle * 2)
                continue
            cmd = _read_frame(fd)
            op = cmd["op"]
            if op == "quit":
                _write_frame(out, {"ok": True})
                return 0
            if op == "map":
                region = MappedRegion(cmd["name"], int(cmd["nbytes"]))
                regions.append(region)
                regs.append(agent.register_memory([(region.addr, region.nbytes, 0, "")], "DRAM"))
                _write_frame(out, {"addr": region.addr})
            elif op == "md":
                _write_frame(out, {"md": bytes(agent.get_agent_metadata()), "name": name})
            elif op == "add_remote":
                _write_frame(out, {"name": _as_str(agent.add_remote_agent(cmd["md"]))})
            elif op == "notifs":
                _write_frame(out, {"notifs": notifs})
            else:
                _write_frame(out, {"error": f"unknown op {op!r}"})
            last = time.monotonic()
            idle = 10e-6
    except EOFError:
        return 0
    finally:
        for reg in regs:
            with contextlib.suppress(Exception):
                agent.deregister_memory(reg)
        for region in regions:
            region.close()


def _as_str(name: Any) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


class RawPeerProcess:
    """The parent's handle on a `RawPeer` helper process."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvd.bench.raw", name],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )

    def call(self, **cmd: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        _write_frame(self.proc.stdin, cmd)
        reply: dict[str, Any] = _read_frame(self.proc.stdout.fileno())
        if "error" in reply:
            raise RuntimeError(f"raw peer: {reply['error']}")
        return reply

    def map(self, shm_name: str, nbytes: int) -> int:
        return int(self.call(op="map", name=shm_name, nbytes=nbytes)["addr"])

    def metadata(self) -> bytes:
        return bytes(self.call(op="md")["md"])

    def add_remote(self, md: bytes) -> str:
        return str(self.call(op="add_remote", md=md)["name"])

    def notifs(self) -> int:
        return int(self.call(op="notifs")["notifs"])

    def close(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(EOFError, OSError, BrokenPipeError):
                self.call(op="quit")
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# ------------------------------------------------------------------ the initiator


class RawInitiator:
    """A NIXL agent in this process that transfers to and from a `RawPeerProcess`."""

    def __init__(self, name: str, peer: RawPeerProcess) -> None:
        self.name = name
        self.peer = peer
        self.agent = _make_agent(name)
        self._regs: list[Any] = []
        self.remote = ""

    def register(self, addr: int, nbytes: int) -> None:
        self._regs.append(self.agent.register_memory([(addr, nbytes, 0, "")], "DRAM"))

    def connect(self) -> None:
        """Load the helper's metadata (again after it registered more memory)."""
        if self.remote:
            self.agent.remove_remote_agent(self.remote)
        else:
            self.peer.add_remote(bytes(self.agent.get_agent_metadata()))
        self.remote = _as_str(self.agent.add_remote_agent(self.peer.metadata()))

    def transfer(
        self, op: str, local: np.ndarray, remote: np.ndarray, notif: bytes = b"raw"
    ) -> float:
        """One READ or WRITE of Nx3 (addr, len, dev) arrays; returns its seconds."""
        agent = self.agent
        t0 = time.perf_counter()
        ldesc = agent.get_xfer_descs(local, "DRAM")
        rdesc = agent.get_xfer_descs(remote, "DRAM")
        handle = agent.initialize_xfer(op, ldesc, rdesc, self.remote, notif)
        state = agent.transfer(handle)
        while state != "DONE":
            if state not in ("PROC", "DONE"):
                raise RuntimeError(f"raw transfer state {state!r}")
            state = agent.check_xfer_state(handle)
        agent.release_xfer_handle(handle)
        return time.perf_counter() - t0

    def notif_round_trip(self, timeout: float = 5.0) -> float:
        """Seconds from sending the helper a notification to its answer polled here."""
        agent = self.agent
        t0 = time.perf_counter()
        agent.send_notif(self.remote, PING)
        while True:
            got = agent.get_new_notifs()
            if any(bytes(m) == PONG for msgs in got.values() for m in msgs):
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > timeout:
                raise RuntimeError("raw peer: no answer to a notification")

    def close(self) -> None:
        for reg in self._regs:
            with contextlib.suppress(Exception):
                self.agent.deregister_memory(reg)
        self._regs = []
        if self.remote:
            with contextlib.suppress(Exception):
                self.agent.remove_remote_agent(self.remote)
        self.agent = None


if __name__ == "__main__":
    sys.exit(peer_main())
