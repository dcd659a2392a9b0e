"""Bad input on every door of a real daemon: the IPC socket, the TCP side channel, the EC
port and NIXL notifications.

Each bad input gets a typed error or is dropped and counted, and the daemon keeps serving
well-behaved clients and peers throughout. Two daemons serve most of the module (starting
them costs seconds): P, and D with a small frame limit; both require a shared secret. A
NIXL agent created in this process (the "fake peer") handshakes with them over the side
channel as a daemon would and then forges notifications; a second one (the "ghost")
never handshakes. Every descriptor a daemon builds must come from a validated
(region, block id) pair: the forged registrations below check that none is built, and a
control case checks that the same path does WRITE when the ids are valid.

Floods (10,000 bad frames, 1,000 forged handshakes) each go to a fresh daemon of their
own, so that its counters and its log hold nothing else: every rejection is counted
exactly, the log stays within the rate limit's bound, and a good client and a good peer
are served while the flood lasts. Requests naming a peer address that cannot be one are
refused at once and never dialled; frames beyond the transport cap are counted as the
lost connections libzmq makes of them.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, TypeVar

import msgpack
import numpy as np
import pytest
import zmq
from kvd_client import layout as kvlayout
from kvd_client import wire
from kvd_client.client import Event, KvdClient
from kvd_client.errors import (
    ErrorCode,
    InvalidRequest,
    KvdError,
    NotFound,
    ProtocolError,
)
from kvd_client.shm import SharedRegion, unique_name
from zmq.utils.monitor import recv_monitor_message

from kvd.actors.ecrouter import EC_XFER_CONTEXT
from kvd.actors.registrar import canary_pattern, handshake_mac
from kvd.adapters.nixl_import import nixl_api
from kvd.core.peerauth import message_mac
from kvd.core.peersession import AuthRefusal, Keyring, Party, derive_session
from kvd.demo import (
    DEMO_COMPAT,
    DaemonProc,
    Engine,
    make_engine,
    pattern,
    run_mode,
    start_daemon,
)

from .conftest import StartDaemon

SECRET = b"kvd bad-input test secret"
FRAME_LIMIT = 4096
"""D's daemon.max_frame_bytes (the smallest the config allows)."""
NUM_BLOCKS = 64
NUM_LAYERS = 2
CHUNK = 4096
COMPAT = DEMO_COMPAT  # make_engine's default
FAKE_ENGINE = "kvdt-fake-engine"
FAKE_BLOCKS = 8

T = TypeVar("T")


# ------------------------------------------------------------------ helpers


def eventually(
    fn: Callable[[], T | None],
    what: str,
    timeout: float = 10.0,
    pump: Callable[[], None] | None = None,
) -> T:
    """Poll fn until it returns something truthy (pumping the fake peer's NIXL agent meanwhile)."""
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        if pump is not None:
            pump()
        time.sleep(0.002)


def status(d: DaemonProc, section: str = "status") -> dict[str, Any]:
    """A status call from a fresh, well-behaved CLI client (also proves the daemon serves)."""
    with KvdClient(d.socket, role="cli", timeout=5.0, keepalive_interval=0) as c:
        return c.status(section)


def counters(d: DaemonProc) -> dict[str, int]:
    got: dict[str, int] = status(d)["counters"]
    return got


def delta(before: dict[str, int], after: dict[str, int], key: str) -> int:
    return after.get(key, 0) - before.get(key, 0)


class RawIpc:
    """A raw DEALER on a daemon's IPC socket: sends whatever bytes it is given."""

    def __init__(self, socket_path: str) -> None:
        self.sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(f"ipc://{socket_path}")

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(list(frames))

    def recv(self, timeout: float = 5.0) -> tuple[int, wire.Record]:
        assert self.sock.poll(int(timeout * 1000)), "no reply from the daemon"
        return wire.decode(self.sock.recv())

    def request(self, msg: wire.Record, corr: int) -> wire.Record:
        self.send(wire.encode(msg, corr))
        rcorr, reply = self.recv()
        assert rcorr == corr, f"reply {reply} carries corr {rcorr}, not {corr}"
        return reply

    def hello(self, corr: int = 1000) -> None:
        """Open a session on this connection (and prove the connection is still served)."""
        hello = wire.Hello(f"raw-{secrets.token_hex(4)}", "cli", "", -1, os.getpid(), "test")
        assert isinstance(self.request(hello, corr), wire.Welcome)

    def close(self) -> None:
        self.sock.close(0)


def side_exchange(
    port: int, *frames: bytes, timeout: float = 5.0
) -> tuple[int, wire.Record] | None:
    """Send frames to a side channel on a fresh DEALER; the reply, or None if none came."""
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{port}")
        sock.send_multipart(list(frames))
        if not sock.poll(int(timeout * 1000)):
            return None
        return wire.decode(sock.recv())
    finally:
        sock.close(0)


def wait_disconnected(
    sock: zmq.Socket[bytes], send: Callable[[], None], timeout: float = 5.0
) -> None:
    """Run `send` and wait until the daemon's end closes this socket's connection."""
    mon = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        send()
        assert mon.poll(int(timeout * 1000)), (
            "the daemon kept the connection of an oversized frame open"
        )
        assert recv_monitor_message(mon)["event"] == zmq.EVENT_DISCONNECTED
    finally:
        sock.disable_monitor()
        mon.close(0)


def ping(src: DaemonProc, dst: DaemonProc) -> dict[str, Any]:
    with KvdClient(src.socket, role="cli", timeout=5.0, keepalive_interval=0) as c:
        return c.ping_peer("127.0.0.1", dst.side_port, timeout=5.0)


def assert_peer_serves(src: DaemonProc, dst: DaemonProc) -> None:
    """A well-behaved peer with the same secret still handshakes and READs dst's canary."""
    res = ping(src, dst)
    assert res["ok"] is True and res["canary_match"] is True, res


class _SideResponder:
    """The fake peer's side channel: answers every request (RegionDropped notices) with Ok."""

    def __init__(self) -> None:
        self.port = 0
        self.received: list[wire.Record] = []
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="fake-side", daemon=True)
        self._thread.start()
        assert self._ready.wait(5)

    def _run(self) -> None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        self.port = sock.bind_to_random_port("tcp://127.0.0.1")
        self._ready.set()
        try:
            while not self._stop.is_set():
                if not sock.poll(50):
                    continue
                ident, frame = sock.recv_multipart()
                corr, msg = wire.decode(frame)
                self.received.append(msg)
                sock.send_multipart([ident, wire.encode(wire.Ok(), corr)])
        finally:
            sock.close(0)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)


def new_agent(name: str) -> Any:
    api = nixl_api()
    agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "peer"})
    return agent


class FakePeer:
    """A real NIXL agent that handshakes with daemons like a peer daemon and forges notifications.

    It exposes one real, registered region (engine FAKE_ENGINE) laid out like the test
    engines, so a daemon that accepted a registration from it could WRITE into it. It
    knows the secret, so like a daemon it derives the session key of each handshake and
    seals what it sends (`send`; `send_bare` does not) and opens what it receives.
    """

    def __init__(self, name: str, secret: bytes) -> None:
        self.name = name
        self.secret = secret
        self.agent = new_agent(name)
        self.incarnation = random.getrandbits(63)
        self.layout = kvlayout.block_major(FAKE_BLOCKS, NUM_LAYERS, CHUNK)
        self.buf = np.zeros(kvlayout.region_bytes(self.layout), dtype=np.uint8)
        desc = [(self.buf.ctypes.data, self.buf.nbytes, 0, "")]
        self.reg = self.agent.register_memory(desc, "DRAM")
        self.region_md = bytes(
            self.agent.get_partial_agent_metadata(self.agent.get_reg_descs(desc, "DRAM"), False, [])
        )
        self.side = _SideResponder()
        self.remote_md: dict[str, bytes] = {}
        self.inbox: list[tuple[str, wire.Record]] = []
        self.keys = Keyring(name)

    def region(self, **changes: Any) -> wire.RegionInfo:
        info = wire.RegionInfo(
            region_id=1,
            generation=1,
            engine_id=FAKE_ENGINE,
            tp_rank=0,
            tp_size=1,
            base_addr=self.buf.ctypes.data,
            nbytes=self.buf.nbytes,
            mem_type="DRAM",
            device=0,
            layout=self.layout,
            compat=COMPAT,
            nixl_md=self.region_md,
        )
        return replace(info, **changes)

    def handshake_msg(
        self, *, sign_with: bytes | None = None, context: bytes = b"req", **changes: Any
    ) -> wire.Handshake:
        hs = wire.Handshake(
            agent_name=self.name,
            incarnation=self.incarnation,
            nixl_md=bytes(self.agent.get_agent_metadata()),
            side_host="127.0.0.1",
            side_port=self.side.port,
            kv_lease_duration=30.0,
            write_bound=100.0,
            regions=(self.region(),),
            canary_addr=0,
            canary_bytes=0,
            nonce=os.urandom(16),
            timestamp=time.time(),
            mac=b"",
        )
        hs = replace(hs, **changes)
        key = self.secret if sign_with is None else sign_with
        return replace(hs, mac=handshake_mac(key, hs, context)) if key else hs

    def connect(self, d: DaemonProc, **changes: Any) -> wire.Handshake:
        """A legitimate handshake (checks the daemon's signature), then load its metadata."""
        hs = self.handshake_msg(**changes)
        got = side_exchange(d.side_port, wire.encode(hs, 77))
        assert got is not None
        corr, reply = got
        assert corr == 77 and isinstance(reply, wire.Handshake), reply
        assert reply.mac == handshake_mac(self.secret, reply, b"rep" + hs.nonce)
        key = derive_session(
            self.secret,
            dialer=Party(hs.agent_name, hs.incarnation, hs.nonce),
            acceptor=Party(reply.agent_name, reply.incarnation, reply.nonce),
        )
        self.keys.install(reply.agent_name, key, time.monotonic())
        if reply.agent_name not in self.remote_md:
            assert self.agent.add_remote_agent(reply.nixl_md) == reply.agent_name.encode()
            self.remote_md[reply.agent_name] = reply.nixl_md
        return reply

    def sealed(self, d: DaemonProc, raw: bytes) -> bytes:
        """`raw` sealed under our session key with `d` (as a daemon would send it)."""
        env = self.keys.seal(d.name, raw, time.monotonic())
        assert env is not None, f"no handshake with {d.name} yet"
        return wire.encode(env)

    def send(self, d: DaemonProc, raw: bytes) -> None:
        self.send_bare(d, self.sealed(d, raw))

    def send_bare(self, d: DaemonProc, raw: bytes) -> None:
        self.agent.send_notif(d.name, raw)
        self.pump()

    def pump(self) -> None:
        for peer, msgs in self.agent.get_new_notifs().items():
            name = peer if isinstance(peer, str) else peer.decode()
            for raw in msgs:
                msg = wire.decode(raw)[1]
                if isinstance(msg, wire.Sealed):
                    opened = self.keys.open(msg, time.monotonic(), name)
                    assert not isinstance(opened, AuthRefusal), (name, opened)
                    msg = wire.decode(opened[1])[1]
                self.inbox.append((name, msg))
                if isinstance(msg, wire.Resync):
                    # as a daemon does: a daemon that stalled (a busy test machine) asks
                    # its peers to re-sync before it WRITEs to them again
                    ack = wire.encode(wire.ResyncAck(msg.nonce))
                    env = self.keys.seal(name, ack, time.monotonic())
                    self.agent.send_notif(name, ack if env is None else wire.encode(env))

    def wait_for(
        self, match: Callable[[wire.Record], bool], what: str, timeout: float = 10.0
    ) -> wire.Record:
        def find() -> wire.Record | None:
            self.pump()
            return next((m for _, m in self.inbox if match(m)), None)

        return eventually(find, what, timeout)

    def close(self) -> None:
        self.side.close()
        with contextlib.suppress(Exception):
            self.agent.deregister_memory(self.reg)
        del self.agent


@dataclass
class Env:
    workdir: Path
    p: DaemonProc
    d: DaemonProc
    p_eng: Engine
    d_eng: Engine
    fake: FakePeer
    auth: str

    def counters_until(
        self, d: DaemonProc, key: str, target: int, timeout: float = 10.0
    ) -> dict[str, int]:
        """Counters once counter `key` reached `target` (pumping the fake peer while waiting)."""

        def reached() -> dict[str, int] | None:
            c = counters(d)
            return c if c.get(key, 0) >= target else None

        return eventually(
            reached,
            f"{d.name} {key} >= {target}",
            timeout,
            pump=self.fake.pump,
        )


@pytest.fixture(scope="module")
def env() -> Iterator[Env]:
    workdir = Path(tempfile.mkdtemp(prefix="kvdt-", dir="/tmp"))
    secret_file = workdir / "secret"
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, SECRET + b"\n")
    os.close(fd)
    auth = f'[auth]\nsecret_file = "{secret_file}"\n'
    started: list[DaemonProc] = []
    engines: list[Engine] = []
    fake: FakePeer | None = None
    try:
        p = start_daemon(workdir, "kvdt-bad-p", auth)
        started.append(p)
        d = start_daemon(
            workdir, "kvdt-bad-d", auth, overrides={"daemon": {"max_frame_bytes": FRAME_LIMIT}}
        )
        started.append(d)
        engines.append(
            make_engine(
                p.socket, "prefill", num_blocks=NUM_BLOCKS, num_layers=NUM_LAYERS, chunk_bytes=CHUNK
            )
        )
        engines.append(
            make_engine(
                d.socket, "decode", num_blocks=NUM_BLOCKS, num_layers=NUM_LAYERS, chunk_bytes=CHUNK
            )
        )
        fake = FakePeer(f"kvdt-fake-{os.getpid()}", SECRET)
        yield Env(workdir, p, d, engines[0], engines[1], fake, auth)
    finally:
        for eng in engines:
            eng.close()
        problems = []
        for dp in reversed(started):
            rc = dp.stop()
            if rc != 0:
                problems.append(f"{dp.name} exited {rc}:\n{dp.report(2000)}")
            if os.path.exists(dp.socket):
                problems.append(f"{dp.name} left its socket {dp.socket}")
        for dp in started:
            errors = [
                line for line in dp.log.read_text().splitlines() if '"level": "error"' in line
            ]
            if errors:
                problems.append(f"{dp.name} logged errors:\n" + "\n".join(errors[:10]))
        if fake is not None:
            fake.close()
        shutil.rmtree(workdir, ignore_errors=True)
        assert not problems, "\n".join(problems)


def _msgpack(*items: Any) -> bytes:
    out = msgpack.packb(list(items), use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def _oversized() -> bytes:
    """A well-formed GetStatus whose padding takes it just past D's frame limit."""
    return _msgpack(wire.PROTOCOL_VERSION, wire.GetStatus.TYPE, 7, "x" * (FRAME_LIMIT + 100))


# (frame, error code, text in the message, corr the reply must carry)
BAD_FRAMES = {
    "garbage": (b"\xc1\x00\xffnot msgpack at all", ErrorCode.PROTOCOL, "malformed msgpack", 0),
    "empty": (b"", ErrorCode.PROTOCOL, "malformed msgpack", 0),
    "not-an-array": (
        msgpack.packb({"version": 1, "type": 30}),
        ErrorCode.PROTOCOL,
        "not a [version",
        0,
    ),
    "short-array": (_msgpack(1, 30), ErrorCode.PROTOCOL, "not a [version", 0),
    "wrong-version": (
        _msgpack(99, wire.GetStatus.TYPE, 7, "status"),
        ErrorCode.VERSION,
        "version 99",
        7,
    ),
    "unknown-type": (
        _msgpack(wire.PROTOCOL_VERSION, 999, 7),
        ErrorCode.PROTOCOL,
        "unknown message type",
        7,
    ),
    "wrong-field-types": (
        _msgpack(wire.PROTOCOL_VERSION, wire.Hello.TYPE, 7, "s", "cli", "", "-1", "pid", ""),
        ErrorCode.PROTOCOL,
        "expected int",
        7,
    ),
    "missing-fields": (
        _msgpack(wire.PROTOCOL_VERSION, wire.GetStatus.TYPE, 7),
        ErrorCode.PROTOCOL,
        "has 1 fields",
        7,
    ),
    "oversized": (_oversized(), ErrorCode.PROTOCOL, "exceeds", 7),
}


# ------------------------------------------------------------------ IPC socket


@pytest.mark.parametrize("case", list(BAD_FRAMES))
def test_ipc_bad_frame_gets_typed_error(env: Env, case: str) -> None:
    frame, code, text, corr = BAD_FRAMES[case]
    before = counters(env.d)
    raw = RawIpc(env.d.socket)
    try:
        raw.send(frame)
        rcorr, reply = raw.recv()
        assert isinstance(reply, wire.ErrorReply), reply
        assert (reply.code, rcorr) == (code, corr), reply
        assert text in reply.message
        raw.hello()  # the same connection is still served
    finally:
        raw.close()
    after = counters(env.d)
    assert delta(before, after, "ipc_rejected") == 1


@pytest.mark.parametrize("before_hello", [True, False])
def test_ipc_requests_needing_a_session_or_sent_by_mistake(env: Env, before_hello: bool) -> None:
    """A request before Hello, and after Hello a message that is not a client request."""
    before = counters(env.d)
    raw = RawIpc(env.d.socket)
    try:
        if before_hello:
            reply = raw.request(wire.GetStatus("status"), 5)
            text = "GetStatus before Hello"
        else:
            raw.hello()
            reply = raw.request(wire.RecvFinished("kvdt-req"), 5)
            text = "RecvFinished is not a client request"
        assert isinstance(reply, wire.ErrorReply) and reply.code == ErrorCode.PROTOCOL, reply
        assert text in reply.message
        raw.hello(corr=6)
        assert isinstance(raw.request(wire.GetStatus("status"), 7), wire.StatusReply)
    finally:
        raw.close()
    assert delta(before, counters(env.d), "ipc_rejected") == 1


def test_ipc_unknown_role_is_refused(env: Env) -> None:
    before = counters(env.d)
    raw = RawIpc(env.d.socket)
    try:
        reply = raw.request(wire.Hello("raw-root", "root", "", -1, os.getpid(), ""), 3)
        assert isinstance(reply, wire.ErrorReply) and reply.code == ErrorCode.PROTOCOL
        assert "unknown role 'root'" in reply.message
        reply = raw.request(wire.GetStatus("status"), 4)  # no session was opened
        assert isinstance(reply, wire.ErrorReply) and "before Hello" in reply.message
    finally:
        raw.close()
    after = counters(env.d)
    assert delta(before, after, "ipc_rejected") == 2
    assert delta(before, after, "sessions_opened") == 1  # the status call's own session only


def test_ipc_multi_frame_garbage_is_dropped_and_counted(env: Env) -> None:
    before = counters(env.d)
    raw = RawIpc(env.d.socket)
    try:
        raw.send(b"\x01\x02", b"garbage", b"more garbage")
        env.counters_until(env.d, "ipc_malformed", before.get("ipc_malformed", 0) + 1)
        # Nothing was answered: the next reply on this connection is the Welcome.
        raw.hello(corr=9)
    finally:
        raw.close()
    after = counters(env.d)
    assert delta(before, after, "ipc_malformed") == 1
    assert delta(before, after, "ipc_rejected") == 0


def test_ipc_frame_beyond_the_transport_cap_drops_the_connection(env: Env) -> None:
    """Frames far beyond the limit are cut off by the transport before they are buffered."""
    raw = RawIpc(env.d.socket)
    try:
        raw.hello()
        huge = _msgpack(wire.PROTOCOL_VERSION, wire.GetStatus.TYPE, 8, "x" * (64 * FRAME_LIMIT))
        wait_disconnected(raw.sock, lambda: raw.send(huge))
    finally:
        raw.close()
    assert status(env.d)["agent_name"] == env.d.name


def test_ipc_client_gets_typed_error_for_a_frame_the_decoder_refuses(env: Env) -> None:
    """A zero-block layout never passes the wire decoder: PROTOCOL for the caller, no timeout."""
    lay = replace(kvlayout.block_major(4, NUM_LAYERS, CHUNK), num_blocks=0)
    before = counters(env.d)
    with KvdClient(
        env.d.socket,
        role="worker",
        engine_id="kvdt-zero",
        tp_rank=0,
        timeout=5.0,
        keepalive_interval=0,
    ) as c:
        t0 = time.monotonic()
        with pytest.raises(ProtocolError, match="num_blocks"):
            c.register_region(None, layout=lay, compat=COMPAT, name="kvdt-zero", nbytes=1 << 20)
        assert time.monotonic() - t0 < 2.0
        assert all(r["engine_id"] != "kvdt-zero" for r in c.status()["regions"])
    after = counters(env.d)
    assert delta(before, after, "ipc_rejected") == 1
    assert delta(before, after, "region_rejected") == 0


# ------------------------------------------------------------------ impossible regions


@dataclass
class RegionCase:
    error: type[KvdError]
    text: str
    segment_bytes: int = 0  # create a real segment of this size (0: none)
    name: str | None = None
    nbytes: int | None = None
    layout: wire.RegionLayout | None = None
    tp_rank: int = 0
    tp_size: int = 1
    kind: str = "shm"
    ipc_handle: bytes = b""
    symlink: bool = False


_LAY = kvlayout.block_major(16, NUM_LAYERS, CHUNK)
_SIZE = kvlayout.region_bytes(_LAY)

REGION_CASES = {
    "missing-segment": RegionCase(NotFound, "does not exist"),
    "path-traversal": RegionCase(
        InvalidRequest, "invalid shared-memory name", name="../../etc/passwd"
    ),
    "absolute-path": RegionCase(InvalidRequest, "invalid shared-memory name", name="/etc/passwd"),
    "empty-name": RegionCase(InvalidRequest, "invalid shared-memory name", name=""),
    "symlink": RegionCase(InvalidRequest, "cannot open segment", segment_bytes=_SIZE, symlink=True),
    "segment-smaller-than-claimed": RegionCase(
        InvalidRequest,
        f"has {_SIZE // 2} bytes, the region claims {_SIZE}",
        segment_bytes=_SIZE // 2,
    ),
    "chunks-beyond-nbytes": RegionCase(
        InvalidRequest, "too small", segment_bytes=_SIZE, nbytes=_SIZE - 1
    ),
    "overlapping-strides": RegionCase(
        InvalidRequest, "overlap", segment_bytes=_SIZE, layout=replace(_LAY, block_stride=CHUNK)
    ),
    "tp-rank-beyond-tp-size": RegionCase(
        InvalidRequest, "tp_rank 2 must be < tp_size 2", segment_bytes=_SIZE, tp_rank=2, tp_size=2
    ),
    "unknown-kind": RegionCase(
        InvalidRequest, "unknown region kind", segment_bytes=_SIZE, kind="nvme"
    ),
    "garbage-cuda-ipc-handle": RegionCase(
        InvalidRequest, "cuda-ipc handle", kind="cuda-ipc", name="", ipc_handle=b"\xc1garbage"
    ),
}


@pytest.mark.parametrize("case", list(REGION_CASES))
def test_impossible_region_is_refused(env: Env, case: str) -> None:
    rc = REGION_CASES[case]
    engine = f"kvdt-reg-{case}"
    seg: SharedRegion | None = None
    link = ""
    name = rc.name if rc.name is not None else unique_name("kvdt-missing")
    if rc.segment_bytes:
        seg = SharedRegion(unique_name("kvdt-seg"), rc.segment_bytes)
        name = seg.name
        if rc.symlink:
            link = unique_name("kvdt-link")
            os.symlink(seg.path, os.path.join("/dev/shm", link))
            name = link
    before = counters(env.d)
    try:
        with KvdClient(
            env.d.socket,
            role="worker",
            engine_id=engine,
            tp_rank=rc.tp_rank,
            timeout=5.0,
            keepalive_interval=0,
        ) as c:
            with pytest.raises(rc.error) as err:
                c.register_region(
                    None,
                    layout=rc.layout or _LAY,
                    tp_rank=rc.tp_rank,
                    tp_size=rc.tp_size,
                    compat=COMPAT,
                    kind=rc.kind,
                    name=name,
                    nbytes=rc.nbytes or _SIZE,
                    ipc_handle=rc.ipc_handle,
                )
            assert rc.text in str(err.value)
            assert all(r["engine_id"] != engine for r in c.status()["regions"])
    finally:
        if link:
            os.unlink(os.path.join("/dev/shm", link))
        if seg is not None:
            seg.close()
    after = counters(env.d)
    assert delta(before, after, "region_rejected") == 1
    assert delta(before, after, "regions_registered") == 0


def test_duplicate_engine_rank_is_refused(env: Env) -> None:
    before = counters(env.d)
    with (
        SharedRegion(unique_name("kvdt-dup"), _SIZE) as a,
        SharedRegion(unique_name("kvdt-dup"), _SIZE) as b,
        KvdClient(
            env.d.socket,
            role="worker",
            engine_id="kvdt-dup",
            tp_rank=0,
            timeout=5.0,
            keepalive_interval=0,
        ) as c,
    ):
        first = c.register_region(a, layout=_LAY, compat=COMPAT)
        with pytest.raises(InvalidRequest, match=f"rank 0 already has region {first}"):
            c.register_region(b, layout=_LAY, compat=COMPAT)
        mine = [r for r in c.status()["regions"] if r["engine_id"] == "kvdt-dup"]
        assert [(r["region_id"], r["name"]) for r in mine] == [(first, a.name)]
        c.deregister_region(first)
    after = counters(env.d)
    assert delta(before, after, "region_rejected") == 1
    assert delta(before, after, "regions_registered") == 1


# ------------------------------------------------------------------ block ids


BAD_BLOCKS = {
    "beyond-the-region": ((1, NUM_BLOCKS), "outside [0, 64)"),
    "negative": ((3, -1), "out of range"),
    "duplicate": ((5, 6, 5), "more than once"),
    "int32-max": ((2**31 - 1,), "outside [0, 64)"),
}


def _rid(tag: str) -> str:
    return f"kvdt-{tag}-{secrets.token_hex(4)}"


@pytest.mark.parametrize("case", list(BAD_BLOCKS))
@pytest.mark.parametrize("kind", ["register_push", "pull"])
def test_d_request_with_bad_block_ids_is_refused(env: Env, kind: str, case: str) -> None:
    blocks, text = BAD_BLOCKS[case]
    rid = _rid(kind)
    if kind == "register_push":
        msg: wire.Record = wire.RegisterPush(
            rid, "decode", blocks, "127.0.0.1", env.p.side_port, "", ""
        )
    else:
        msg = wire.Pull(
            rid, "decode", blocks, "127.0.0.1", env.p.side_port, "", _rid("p"), (1, 2, 3, 4)
        )
    before = counters(env.d)
    with KvdClient(
        env.d.socket, role="scheduler", engine_id="decode", timeout=5.0, keepalive_interval=0
    ) as c:
        with pytest.raises(InvalidRequest, match="block id") as err:
            c.request(msg)
        assert text in str(err.value)
        assert c.status()["receiver"]["receiving"] == 0
        assert c.drain_events() == []
    after = counters(env.d)
    assert delta(before, after, "requests_rejected") == 1
    assert delta(before, after, f"{'push' if kind == 'register_push' else 'pull'}_requests") == 0


def test_d_request_for_an_unknown_engine_is_refused(env: Env) -> None:
    with (
        KvdClient(
            env.d.socket,
            role="scheduler",
            engine_id="kvdt-nobody",
            timeout=5.0,
            keepalive_interval=0,
        ) as c,
        pytest.raises(NotFound, match="no registered region"),
    ):
        c.request(
            wire.RegisterPush(
                _rid("push"), "kvdt-nobody", (0,), "127.0.0.1", env.p.side_port, "", ""
            )
        )


def test_pull_of_p_blocks_outside_p_region_fails_without_a_read(env: Env) -> None:
    """D can only check P's ids after the handshake: the request then fails, no READ is posted."""
    rid = _rid("pull")
    before_d, before_p = status(env.d), status(env.p)
    with KvdClient(
        env.d.socket, role="scheduler", engine_id="decode", timeout=5.0, keepalive_interval=0
    ) as c:
        c.pull(
            rid,
            [1, 2],
            "127.0.0.1",
            env.p.side_port,
            remote_request_id=_rid("p"),
            remote_block_ids=[NUM_BLOCKS + 5, 3],
        )
        evs = eventually(lambda: c.drain_events(), "the pull's terminal event")
        assert len(evs) == 1 and isinstance(evs[0], wire.RecvFailed), evs
        assert (
            evs[0].request_id == rid
            and evs[0].code == ErrorCode.INVALID
            and evs[0].block_ids == (1, 2)
        )
        assert "outside [0, 64)" in evs[0].reason
    after_d, after_p = status(env.d), status(env.p)
    assert after_d["nixl"]["transfers_posted"] == before_d["nixl"]["transfers_posted"]
    assert after_p["nixl"]["transfers_posted"] == before_p["nixl"]["transfers_posted"]
    assert delta(before_d["counters"], after_d["counters"], "recv_failed") == 1


@pytest.mark.parametrize("case", list(BAD_BLOCKS))
def test_finish_with_bad_block_ids_is_refused(env: Env, case: str) -> None:
    """P's finished blocks are checked against P's regions when the lease would be granted."""
    blocks, text = BAD_BLOCKS[case]
    rid = _rid("finish")
    before = counters(env.p)
    with KvdClient(
        env.p.socket, role="scheduler", engine_id="prefill", timeout=5.0, keepalive_interval=0
    ) as c:
        with pytest.raises(InvalidRequest, match="block id") as err:
            c.request(wire.Finish(rid, "prefill", blocks))
        assert text in str(err.value)
        leases = c.status("leases")["leases"]
        assert all(lease["request_id"] != rid for lease in leases)
    after = counters(env.p)
    assert delta(before, after, "requests_rejected") == 1
    assert delta(before, after, "leases_granted") == 0


def test_finish_for_an_engine_without_regions_is_refused(env: Env) -> None:
    with (
        KvdClient(
            env.p.socket,
            role="scheduler",
            engine_id="kvdt-nobody",
            timeout=5.0,
            keepalive_interval=0,
        ) as c,
        pytest.raises(NotFound, match="no registered region"),
    ):
        c.request(wire.Finish(_rid("finish"), "kvdt-nobody", (0, 1)))


# ------------------------------------------------------------------ side channel


@pytest.mark.parametrize("case", list(BAD_FRAMES))
def test_side_channel_bad_frame_gets_typed_error(env: Env, case: str) -> None:
    frame, code, text, corr = BAD_FRAMES[case]
    before = counters(env.d)
    got = side_exchange(env.d.side_port, frame)
    assert got is not None, "no reply"
    rcorr, reply = got
    assert isinstance(reply, wire.ErrorReply), reply
    assert (reply.code, rcorr) == (code, corr), reply
    assert text in reply.message
    assert delta(before, counters(env.d), "side_rejected") == 1
    assert_peer_serves(env.p, env.d)


@pytest.mark.parametrize(
    "msg",
    [wire.GetStatus("status"), wire.PushDone("kvdt-x", 0, True, 0, ""), wire.Probe(1, False)],
    ids=lambda m: type(m).__name__,
)
def test_side_channel_non_handshake_message_is_refused(env: Env, msg: wire.Record) -> None:
    before = counters(env.d)
    got = side_exchange(env.d.side_port, wire.encode(msg, 11))
    assert got is not None
    corr, reply = got
    assert corr == 11 and isinstance(reply, wire.ErrorReply) and reply.code == ErrorCode.PROTOCOL
    assert f"{type(msg).__name__} is not a side-channel request" in reply.message
    assert delta(before, counters(env.d), "side_rejected") == 1
    assert_peer_serves(env.p, env.d)


@pytest.mark.parametrize("mac", [b"", bytes(32)], ids=["no-mac", "wrong-mac"])
def test_unauthenticated_region_drop_is_refused(env: Env, mac: bytes) -> None:
    """A forged `RegionDropped` naming a real peer must not make P forget D's regions."""
    d_agent = status(env.d)["agent_name"]
    assert any(p["agent"] == d_agent and p["regions"] for p in status(env.p, "peers")["peers"])
    before = counters(env.p)
    notice = wire.RegionDropped(d_agent, 1, 1, time.time(), mac)
    got = side_exchange(env.p.side_port, wire.encode(notice, 5))
    assert got is not None
    corr, reply = got
    assert corr == 5 and isinstance(reply, wire.ErrorReply) and reply.code == ErrorCode.AUTH
    # with a secret a region drop must come sealed under the peer's session key
    assert delta(before, counters(env.p), "side_auth_rejected") == 1
    assert delta(before, counters(env.p), "auth_rejected_unsealed") == 1
    peer = next(p for p in status(env.p, "peers")["peers"] if p["agent"] == d_agent)
    assert {r["engine_id"] for r in peer["regions"]} >= {"decode"}
    assert_peer_serves(env.d, env.p)


def test_side_channel_multi_frame_garbage_is_dropped_and_counted(env: Env) -> None:
    before = counters(env.d)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{env.d.side_port}")
        sock.send_multipart([b"a", b"b", b"c"])
        after = env.counters_until(env.d, "side_malformed", before.get("side_malformed", 0) + 1)
        # Nothing was answered: the first reply on this connection is the next request's.
        sock.send(wire.encode(wire.GetStatus("status"), 12))
        assert sock.poll(5000)
        corr, reply = wire.decode(sock.recv())
        assert corr == 12 and isinstance(reply, wire.ErrorReply), reply
    finally:
        sock.close(0)
    assert delta(before, after, "side_malformed") == 1
    assert delta(before, after, "side_rejected") == 0
    assert_peer_serves(env.p, env.d)


def test_side_channel_frame_beyond_the_transport_cap_drops_the_connection(env: Env) -> None:
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{env.d.side_port}")
        huge = _msgpack(wire.PROTOCOL_VERSION, wire.Handshake.TYPE, 8, b"x" * (64 * FRAME_LIMIT))
        wait_disconnected(sock, lambda: sock.send(huge))
    finally:
        sock.close(0)
    assert_peer_serves(env.p, env.d)


AUTH_CASES: dict[str, dict[str, Any]] = {
    "no-mac": {"sign_with": b""},
    "wrong-secret": {"sign_with": b"not the secret"},
    "random-mac": {"mac": os.urandom(32)},
    "reply-context": {"context": b"rep"},
    "stale-timestamp": {"timestamp": time.time() - 3600.0},
}


@pytest.mark.parametrize("case", list(AUTH_CASES))
def test_handshake_that_fails_authentication_is_refused(env: Env, case: str) -> None:
    changes = dict(AUTH_CASES[case])
    mac = changes.pop("mac", None)
    hs = env.fake.handshake_msg(agent_name=f"kvdt-intruder-{case}", **changes)
    if mac is not None:
        hs = replace(hs, mac=mac)
    before = counters(env.d)
    got = side_exchange(env.d.side_port, wire.encode(hs, 21))
    assert got is not None
    corr, reply = got
    assert corr == 21 and isinstance(reply, wire.ErrorReply), reply
    assert reply.code == ErrorCode.AUTH and f"kvdt-intruder-{case}" in reply.message
    after = counters(env.d)
    assert delta(before, after, "auth_rejected") == 1
    assert delta(before, after, "handshakes_accepted") == 0
    assert all(p["agent"] != hs.agent_name for p in status(env.d, "peers")["peers"])
    assert_peer_serves(env.p, env.d)


def _bad_regions(fake: FakePeer) -> dict[str, tuple[wire.RegionInfo, str]]:
    lay = fake.layout
    return {
        "chunks-beyond-nbytes": (fake.region(nbytes=fake.buf.nbytes - 1), "too small"),
        "overlapping-strides": (fake.region(layout=replace(lay, layer_stride=CHUNK)), "overlap"),
        "address-overflow": (fake.region(base_addr=2**64 - 4096), "overflows int64"),
        "unknown-memory-type": (fake.region(mem_type="XRAM"), "unknown memory type"),
    }


@pytest.mark.parametrize(
    "case",
    ["chunks-beyond-nbytes", "overlapping-strides", "address-overflow", "unknown-memory-type"],
)
def test_handshake_with_impossible_regions_is_refused(env: Env, case: str) -> None:
    region, text = _bad_regions(env.fake)[case]
    hs = env.fake.handshake_msg(
        agent_name=f"kvdt-badregion-{case}", regions=(env.fake.region(region_id=7), region)
    )
    before = counters(env.d)
    got = side_exchange(env.d.side_port, wire.encode(hs, 22))
    assert got is not None
    corr, reply = got
    assert corr == 22 and isinstance(reply, wire.ErrorReply) and reply.code == ErrorCode.PROTOCOL, (
        reply
    )
    assert text in reply.message
    after = counters(env.d)
    assert delta(before, after, "handshakes_rejected") == 1
    assert delta(before, after, "handshakes_accepted") == 0
    assert all(p["agent"] != hs.agent_name for p in status(env.d, "peers")["peers"])
    assert_peer_serves(env.p, env.d)


@pytest.mark.parametrize(
    "side_host,side_port,field",
    [
        ("not a host", None, "side_host"),
        ("p0\x00.local", None, "side_host"),
        (None, 0, "side_port"),
    ],
    ids=["spaces", "nul", "port-0"],
)
def test_handshake_announcing_an_address_that_cannot_be_one_is_refused(
    env: Env, side_host: str | None, side_port: int | None, field: str
) -> None:
    """A peer's side-channel address is dialled later (region drops): a handshake that is
    otherwise good (the fake peer's own, signed) is refused at once, nothing learned."""
    changes: dict[str, Any] = {}
    if side_host is not None:
        changes["side_host"] = side_host
    if side_port is not None:
        changes["side_port"] = side_port
    hs = env.fake.handshake_msg(**changes)
    before = counters(env.d)
    got = side_exchange(env.d.side_port, wire.encode(hs, 24))
    assert got is not None
    corr, reply = got
    assert corr == 24 and isinstance(reply, wire.ErrorReply), reply
    assert reply.code == ErrorCode.INVALID and reply.message.startswith(f"Handshake.{field} ")
    after = counters(env.d)
    assert delta(before, after, "handshakes_rejected") == 1
    assert delta(before, after, "handshakes_accepted") == 0
    bad = f"{hs.side_host}:{hs.side_port}"
    assert all(p["addr"] != bad for p in status(env.d, "peers")["peers"])


def test_handshake_with_bad_nixl_metadata_is_refused_and_harms_no_peer(env: Env) -> None:
    """Garbage metadata, metadata of a known peer under another name, the daemon's own name."""
    assert_peer_serves(env.d, env.p)  # D knows P now
    p_md = env.fake.connect(env.p).nixl_md
    d_md = env.fake.connect(env.d).nixl_md
    cases = [
        (
            env.fake.handshake_msg(agent_name="kvdt-garbage-md", nixl_md=b"\x00garbage metadata"),
            ErrorCode.TRANSFER,
            "",
        ),
        (
            env.fake.handshake_msg(agent_name="kvdt-p-in-disguise", nixl_md=p_md),
            ErrorCode.PROTOCOL,
            f"metadata names agent '{env.p.name}'",
        ),
        (
            env.fake.handshake_msg(agent_name="kvdt-d-in-disguise", nixl_md=d_md),
            ErrorCode.TRANSFER,
            "",
        ),
        (env.fake.handshake_msg(agent_name=env.d.name), ErrorCode.INVALID, "our own agent name"),
    ]
    for hs, code, text in cases:
        before = counters(env.d)
        got = side_exchange(env.d.side_port, wire.encode(hs, 23))
        assert got is not None
        corr, reply = got
        assert corr == 23 and isinstance(reply, wire.ErrorReply) and reply.code == code, reply
        assert text in reply.message
        assert delta(before, counters(env.d), "handshakes_rejected") == 1
    # D still reaches P through the metadata it had: nothing was unloaded on P's behalf.
    assert_peer_serves(env.d, env.p)
    assert_peer_serves(env.p, env.d)


def test_shared_secret_admits_peers_that_know_it_only(
    env: Env, daemons: StartDaemon, workdir: Path
) -> None:
    other = workdir / "other-secret"
    fd = os.open(other, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, b"a different secret\n")
    os.close(fd)
    x = daemons("kvdt-bad-x", f'[auth]\nsecret_file = "{other}"\n')
    before_p, before_x = counters(env.p), counters(x)
    res = ping(x, env.p)  # X cannot prove the secret to P
    assert res["ok"] is False and "authentication" in res["error"], res
    res = ping(env.p, x)  # nor does P accept X's answer (X refuses P first)
    assert res["ok"] is False and "authentication" in res["error"], res
    after_p, after_x = counters(env.p), counters(x)
    assert delta(before_p, after_p, "auth_rejected") == 1
    assert delta(before_x, after_x, "auth_rejected") == 1
    assert delta(before_x, after_x, "handshakes_failed") == 1
    assert all(p["agent"] != "kvdt-bad-x" for p in status(env.p, "peers")["peers"])
    res = ping(env.d, env.p)  # a daemon with the same secret is admitted, data path included
    assert res["ok"] is True and res["canary_match"] is True and res["agent"] == env.p.name, res


# ------------------------------------------------------------------ NIXL notifications


NOTIF_GARBAGE = {
    "garbage": (b"\xc1 not a message", "notifs_malformed"),
    "wrong-version": (
        _msgpack(wire.PROTOCOL_VERSION + 90, wire.PushDone.TYPE, 0, "kvdt-x", 0, True, 0, ""),
        "notifs_malformed",
    ),
    "unknown-type": (_msgpack(wire.PROTOCOL_VERSION, 999, 0), "notifs_malformed"),
    "wrong-field-types": (
        _msgpack(wire.PROTOCOL_VERSION, wire.Heartbeat.TYPE, 0, "not a list"),
        "notifs_malformed",
    ),
    "not-a-notification": (wire.encode(wire.GetStatus("status")), "notifs_rejected"),
}


@pytest.mark.parametrize("case", list(NOTIF_GARBAGE))
@pytest.mark.parametrize("target", ["p", "d"])
def test_malformed_notification_is_dropped_and_counted(env: Env, target: str, case: str) -> None:
    raw, key = NOTIF_GARBAGE[case]
    d = env.p if target == "p" else env.d
    env.fake.connect(d)
    before = counters(d)
    env.fake.send(d, raw)
    after = env.counters_until(d, key, before.get(key, 0) + 1)
    assert delta(before, after, key) == 1
    assert delta(before, after, "notifs_received") == 1


def test_notification_over_the_frame_limit_is_dropped_and_counted(env: Env) -> None:
    env.fake.connect(env.d)
    before = counters(env.d)
    raw = wire.encode(wire.Heartbeat(tuple(f"kvdt-big-{i}" for i in range(FRAME_LIMIT // 8))))
    assert len(raw) > FRAME_LIMIT
    env.fake.send(env.d, raw)
    after = env.counters_until(env.d, "notifs_malformed", before.get("notifs_malformed", 0) + 1)
    assert delta(before, after, "notifs_malformed") == 1
    assert delta(before, after, "heartbeats_received") == 0


def test_push_done_for_an_unknown_request_is_rejected(env: Env) -> None:
    env.fake.connect(env.d)
    before = counters(env.d)
    env.fake.send(env.d, wire.encode(wire.PushDone(_rid("nobody"), 0, True, 0, "")))
    after = env.counters_until(env.d, "notifs_rejected", before.get("notifs_rejected", 0) + 1)
    assert delta(before, after, "recv_ok") == 0 and delta(before, after, "recv_failed") == 0


def test_forged_push_done_cannot_complete_a_real_request(env: Env) -> None:
    """A completion for D's in-flight request from an agent other than its P is ignored;
    P's real WRITE still completes it, with every byte in place."""
    p, d, fake = env.p_eng, env.d_eng, env.fake
    fake.connect(env.d)
    rng = random.Random(7)
    p_blocks, d_blocks = p.alloc(rng, 3), d.alloc(rng, 3)
    rid, p_rid = _rid("forged"), _rid("forged-p")
    try:
        for j, b in enumerate(p_blocks):
            p.block(0, b)[:] = pattern(f"{rid}/0", j, p.block_bytes)
        for b in d_blocks:
            d.block(0, b)[:] = 0
        d.client.register_push(rid, d_blocks, "127.0.0.1", env.p.side_port, remote_request_id=p_rid)

        def registered() -> bool:
            recv = [r for r in status(env.d, "transfers")["receiving"] if r["request_id"] == rid]
            return bool(recv) and recv[0]["state"] == "registered"

        eventually(registered, "D's registration to reach P")
        before = counters(env.d)
        fake.send(env.d, wire.encode(wire.PushDone(rid, 0, True, 0, "")))
        fake.send(
            env.d,
            wire.encode(wire.PushDone(rid, 0, False, int(ErrorCode.TRANSFER), "forged failure")),
        )
        after = env.counters_until(env.d, "notifs_rejected", before.get("notifs_rejected", 0) + 2)
        assert delta(before, after, "recv_ok") == 0 and delta(before, after, "recv_failed") == 0
        assert registered()
        assert d.client.drain_events() == []
        p.client.finished(p_rid, p_blocks)
        evs = eventually(lambda: d.client.drain_events(), "D's terminal event")
        assert [(type(e), getattr(e, "request_id", None)) for e in evs] == [
            (wire.RecvFinished, rid)
        ], evs
        for j, b in enumerate(d_blocks):
            assert np.array_equal(d.block(0, b), pattern(f"{rid}/0", j, d.block_bytes))
        p_evs = eventually(lambda: p.client.drain_events(), "P's terminal event")
        assert [(type(e), getattr(e, "request_id", None)) for e in p_evs] == [
            (wire.SendFinished, p_rid)
        ]
    finally:
        p.release(p_blocks)
        d.release(d_blocks)


def _push_from_fake(
    env: Env,
    d_blocks: tuple[int, ...],
    n_p_blocks: int,
    generations: tuple[int, ...] = (1,),
    **handshake: Any,
) -> tuple[str, wire.PushDone, list[Event]]:
    """The fake peer (handshaking with `handshake` changes) registers d_blocks of its
    region for a request P then finishes."""
    p, fake = env.p_eng, env.fake
    fake.connect(env.p, **handshake)
    rid = _rid("fakepush")
    p_blocks = p.alloc(random.Random(11), n_p_blocks)
    for j, b in enumerate(p_blocks):
        p.block(0, b)[:] = pattern(f"{rid}/0", j, p.block_bytes)
    try:
        reg = wire.PushRegistration(
            rid, "", FAKE_ENGINE, "prefill", 1, d_blocks, "", 0, fake.incarnation, generations, ""
        )
        fake.send(env.p, wire.encode(reg))
        p.client.finished(rid, p_blocks)
        done = fake.wait_for(
            lambda m: isinstance(m, wire.PushDone) and m.request_id == rid, "P's PushDone"
        )
        assert isinstance(done, wire.PushDone)
        p_evs = eventually(lambda: p.client.drain_events(), "P's terminal event", pump=fake.pump)
    finally:
        p.release(p_blocks)
    return rid, done, p_evs


def test_push_registration_from_a_peer_writes_its_blocks(env: Env) -> None:
    """Control for the next test: with valid ids, P does WRITE into the fake peer's region."""
    env.fake.buf[:] = 0
    before = status(env.p)
    d_blocks = (6, 2)
    rid, done, p_evs = _push_from_fake(env, d_blocks, 3)
    assert done.ok is True, done
    assert [(type(e), getattr(e, "request_id", None)) for e in p_evs] == [(wire.SendFinished, rid)]
    block = env.p_eng.block_bytes
    for j, b in enumerate(d_blocks):  # D's blocks get P's last len(d_blocks) blocks
        got = env.fake.buf[b * block : (b + 1) * block]
        assert np.array_equal(got, pattern(f"{rid}/0", j + 1, block))
    untouched = np.ones(FAKE_BLOCKS, dtype=bool)
    untouched[list(d_blocks)] = False
    assert not env.fake.buf.reshape(FAKE_BLOCKS, block)[untouched].any()
    after = status(env.p)
    assert after["nixl"]["transfers_posted"] == before["nixl"]["transfers_posted"] + 1


@pytest.mark.parametrize("case", list(BAD_BLOCKS))
def test_push_registration_with_blocks_outside_the_peer_region_builds_no_descriptor(
    env: Env, case: str
) -> None:
    blocks, _ = BAD_BLOCKS[case]
    blocks = tuple(
        b if b != NUM_BLOCKS else FAKE_BLOCKS for b in blocks
    )  # the fake region has 8 blocks
    env.fake.buf[:] = 0
    before = status(env.p)
    rid, done, p_evs = _push_from_fake(env, blocks, len(blocks))
    assert (done.ok, done.code) == (False, ErrorCode.INVALID), done
    assert "block id" in done.reason
    assert len(p_evs) == 1 and isinstance(p_evs[0], wire.SendFailed) and p_evs[0].request_id == rid
    assert p_evs[0].code == ErrorCode.INVALID
    after = status(env.p)
    assert delta(before["counters"], after["counters"], "push_failed") == 1
    assert after["nixl"]["transfers_posted"] == before["nixl"]["transfers_posted"]
    assert after["sender"]["sending"] == 0
    assert not env.fake.buf.any()


@pytest.mark.parametrize("compat", ["", "sha256:another-model"])
def test_push_registration_from_a_peer_with_another_compat_writes_nothing(
    env: Env, compat: str
) -> None:
    """P checks compat too (a D that skipped the check, or one that declares none, as a
    peer built before the rule would): the push fails on P naming both values, and not
    one byte is written into the peer's region."""
    env.fake.buf[:] = 0
    before = status(env.p)
    try:
        rid, done, p_evs = _push_from_fake(
            env, (6, 2), 2, regions=(env.fake.region(compat=compat),)
        )
    finally:
        env.fake.connect(env.p)  # P's view of the fake peer back as the other tests expect
    want = f"KV compatibility differs: P rank 0 {COMPAT!r} vs D rank 0 {compat!r}"
    assert (done.ok, done.code) == (False, ErrorCode.INCOMPATIBLE), done
    assert want in done.reason, done.reason
    assert [(type(e), getattr(e, "request_id", None)) for e in p_evs] == [(wire.SendFailed, rid)]
    assert isinstance(p_evs[0], wire.SendFailed) and want in p_evs[0].reason
    after = status(env.p)
    assert delta(before["counters"], after["counters"], "push_failed") == 1
    assert after["nixl"]["transfers_posted"] == before["nixl"]["transfers_posted"]
    assert after["sender"]["leases"] == 0 and after["sender"]["sending"] == 0
    assert not env.fake.buf.any()


def test_heartbeat_with_unknown_ids_extends_nothing(env: Env) -> None:
    env.fake.connect(env.p)
    before = status(env.p)
    ids = tuple(f"kvdt-unknown-{i}" for i in range(10_000))
    env.fake.send(env.p, wire.encode(wire.Heartbeat(ids)))
    after = env.counters_until(
        env.p, "heartbeats_received", before["counters"].get("heartbeats_received", 0) + 1
    )
    assert delta(before["counters"], after, "heartbeat_unknown_ids") == 10_000
    assert status(env.p)["sender"]["leases"] == before["sender"]["leases"]


def test_pull_done_for_an_unknown_request_is_refused(env: Env) -> None:
    env.fake.connect(env.p)
    before = counters(env.p)
    env.fake.send(env.p, wire.encode(wire.PullDone(_rid("nobody"), "kvdt-d-side-id", (), "")))
    ack = env.fake.wait_for(
        lambda m: isinstance(m, wire.PullAck) and m.d_request_id == "kvdt-d-side-id", "P's PullAck"
    )
    assert isinstance(ack, wire.PullAck)
    assert (ack.ok, ack.code) == (False, ErrorCode.NOT_FOUND), ack
    assert delta(before, counters(env.p), "pulls_refused") == 1


def test_notifications_from_an_agent_that_never_handshaked_are_rejected(env: Env) -> None:
    """The ghost learned P's NIXL metadata elsewhere. It can neither register, extend, cancel
    nor complete anything at P: a forged PullDone does not release a real lease."""
    p_md = env.fake.connect(env.p).nixl_md
    ghost = new_agent(f"kvdt-ghost-{os.getpid()}")
    assert ghost.add_remote_agent(p_md) == env.p.name.encode()
    p = env.p_eng
    rid = _rid("ghost")
    blocks = p.alloc(random.Random(3), 2)
    try:
        p.client.finished(rid, blocks)  # a real lease, held for D
        eventually(
            lambda: any(lease["request_id"] == rid for lease in status(env.p, "leases")["leases"]),
            "P's lease",
        )
        msgs = [
            wire.PushRegistration(rid, "", FAKE_ENGINE, "prefill", 1, (1,), "", 0, 0, (1,), ""),
            wire.Heartbeat((rid,)),
            wire.PullDone(rid, rid, (), ""),
            wire.CancelRegistration(rid),
        ]
        before = status(env.p)
        for m in msgs:
            ghost.send_notif(env.p.name, wire.encode(m))
            ghost.get_new_notifs()
        # without the secret it has no session key: each is refused before it is read
        target = before["counters"].get("notifs_auth_rejected", 0) + len(msgs)

        def all_rejected() -> dict[str, int] | None:
            ghost.get_new_notifs()
            c = counters(env.p)
            return c if c.get("notifs_auth_rejected", 0) >= target else None

        after = eventually(all_rejected, "P to reject the ghost's notifications")
        assert delta(before["counters"], after, "auth_rejected_unsealed") == len(msgs)
        for key in ("push_registrations", "heartbeats_received", "pulls_refused", "pulls_acked"):
            assert delta(before["counters"], after, key) == 0, key
        now = status(env.p)
        assert now["sender"]["pending_registrations"] == before["sender"]["pending_registrations"]
        assert any(lease["request_id"] == rid for lease in status(env.p, "leases")["leases"])
        assert p.client.drain_events() == []  # no SendFinished: P's blocks stay leased
    finally:
        p.client.abort(rid)
        evs = eventually(lambda: p.client.drain_events(), "the aborted lease's event")
        p.release(blocks)
    assert [(type(e), getattr(e, "request_id", None)) for e in evs] == [(wire.SendFailed, rid)]


def test_peer_cannot_claim_another_daemons_address(env: Env) -> None:
    """A handshake that advertises P's side-channel address does not redirect D's requests for P."""
    env.fake.connect(env.d, side_port=env.p.side_port)
    try:
        res = run_mode(
            "push",
            env.p_eng,
            env.d_eng,
            env.p.side_port,
            2,
            random.Random(5),
            max_blocks=4,
            timeout=20,
        )
        assert res.verified == 2, res.summary()
        env.fake.pump()
        reg = [m for _, m in env.fake.inbox if isinstance(m, wire.PushRegistration)]
        assert reg == [], "D sent its registration to the impostor"
    finally:
        env.fake.connect(env.d)  # advertise its own side channel again


# ------------------------------------------------------------------ floods

FLOOD = 10_000
REJECTION_INTERVAL = 10.0
"""The daemons' log.rejection_interval (the default)."""
FLOOD_FRAMES = (BAD_FRAMES["garbage"][0], BAD_FRAMES["wrong-version"][0])
"""Two kinds of bad frame (a malformed frame and a foreign protocol version)."""


def log_records(d: DaemonProc) -> list[dict[str, Any]]:
    """The daemon's JSON log lines, parsed."""
    out = []
    for line in d.log.read_text().splitlines():
        with contextlib.suppress(ValueError):
            rec = json.loads(line)
            if isinstance(rec, dict):
                out.append(rec)
    return out


def warnings_logged(d: DaemonProc) -> list[dict[str, Any]]:
    return [r for r in log_records(d) if r.get("level") == "warning"]


def accounted(records: list[dict[str, Any]], event: str) -> int:
    """Occurrences the lines of `event` account for: one per line written for an
    occurrence, plus the number not logged that each line reports (`suppressed`)."""
    return sum(
        (0 if r.get("summary") else 1) + int(r.get("suppressed", 0))
        for r in records
        if r.get("event") == event
    )


def line_bound(kinds: int, elapsed: float) -> float:
    """The most lines a flood of `kinds` kinds lasting `elapsed` seconds may cost: per kind
    the first at once, then one per rejection interval, plus the last summary."""
    return kinds * (2 + elapsed / REJECTION_INTERVAL)


class KeptServing:
    """While bad input floods `d`, a good client (a status call on a fresh IPC session) and
    a good peer (`peer` handshakes afresh, round-trips a notification and READs `d`'s
    canary) are served, round after round, without a single failure."""

    def __init__(self, d: DaemonProc, peer: DaemonProc) -> None:
        self.d, self.peer = d, peer
        self.rounds = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kept-serving", daemon=True)

    def __enter__(self) -> KeptServing:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                assert status(self.d)["agent_name"] == self.d.name
                res = ping(self.peer, self.d)
                assert res["ok"] is True and res["canary_match"] is True, res
                self.rounds += 1
            except Exception as exc:
                self.errors.append(repr(exc))
                return

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(30)
        assert not self._thread.is_alive(), "a status call or ping hung"
        assert self.errors == [], self.errors


def flood_until_served(
    send: Callable[[int], None], served: KeptServing, at_least: int = FLOOD, rounds: int = 2
) -> int:
    """Send at least `at_least` bad frames, and go on until `served` completed `rounds`
    rounds meanwhile (so the good client and peer were served during the flood, not after
    it). `send(i)` sends the i-th frame; returns how many were sent."""
    sent = 0
    deadline = time.monotonic() + 120
    while sent < at_least or served.rounds < rounds:
        assert not served.errors, served.errors
        assert time.monotonic() < deadline, f"{served.rounds} rounds served after {sent} frames"
        for _ in range(250):
            send(sent)
            sent += 1
    return sent


def counted(d: DaemonProc, key: str, target: int) -> dict[str, int]:
    """The daemon's counters once counter `key` reached `target` (generous deadline)."""

    def reached() -> dict[str, int] | None:
        c = counters(d)
        return c if c.get(key, 0) >= target else None

    return eventually(reached, f"{d.name} {key} >= {target}", timeout=120)


def test_side_channel_flood_is_counted_exactly_and_logged_in_a_few_lines(
    env: Env, daemons: StartDaemon
) -> None:
    x = daemons("kvdt-flood-side", env.auth)
    before = counters(x)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{x.side_port}")
    replies: list[wire.Record] = []

    def send(i: int) -> None:
        sock.send(FLOOD_FRAMES[i % 2])
        while sock.poll(0):
            replies.append(wire.decode(sock.recv())[1])

    t0 = time.monotonic()
    try:
        with KeptServing(x, env.p) as served:
            sent = flood_until_served(send, served)
            after = counted(x, "side_rejected", before.get("side_rejected", 0) + sent)
    finally:
        sock.close(0)
    elapsed = time.monotonic() - t0
    assert delta(before, after, "side_rejected") == sent
    assert delta(before, counters(x), "side_rejected") == sent  # exactly: nothing more came
    assert replies and all(isinstance(r, wire.ErrorReply) for r in replies)
    warnings = warnings_logged(x)
    assert len(warnings) <= line_bound(2, elapsed), (len(warnings), elapsed, warnings[:5])
    # Once the windows close, the lines account for every rejection, none twice.
    eventually(
        lambda: accounted(log_records(x), "side_request_rejected") == sent,
        "the summary lines",
        timeout=REJECTION_INTERVAL * 3 + 30,
    )


def test_ipc_flood_from_many_connections_is_counted_exactly_and_logged_in_a_few_lines(
    env: Env, daemons: StartDaemon
) -> None:
    x = daemons("kvdt-flood-ipc", env.auth)
    before = counters(x)
    conns = [RawIpc(x.socket) for _ in range(50)]
    t0 = time.monotonic()
    try:
        with KeptServing(x, env.p) as served:
            sent = flood_until_served(
                lambda i: conns[(i // 2) % len(conns)].send(FLOOD_FRAMES[i % 2]), served
            )
            after = counted(x, "ipc_rejected", before.get("ipc_rejected", 0) + sent)
        for c in conns:  # every connection got its typed errors
            _, reply = c.recv()
            assert isinstance(reply, wire.ErrorReply) and reply.code == ErrorCode.PROTOCOL
    finally:
        for c in conns:
            c.close()
    elapsed = time.monotonic() - t0
    assert delta(before, after, "ipc_rejected") == sent
    assert delta(before, counters(x), "ipc_rejected") == sent
    warnings = warnings_logged(x)
    assert len(warnings) <= line_bound(2, elapsed), (len(warnings), elapsed, warnings[:5])


def test_handshake_flood_failing_authentication_is_counted_exactly_and_logged_in_a_few_lines(
    env: Env, daemons: StartDaemon
) -> None:
    x = daemons("kvdt-flood-auth", env.auth)
    base = env.fake.handshake_msg(sign_with=b"not the secret")
    before = counters(x)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{x.side_port}")
    codes: dict[int, int] = {}

    def take_reply() -> None:
        corr, reply = wire.decode(sock.recv())
        assert isinstance(reply, wire.ErrorReply), reply
        codes[corr] = reply.code

    def send(i: int) -> None:
        hs = replace(base, agent_name=f"kvdt-intruder-{i}", nonce=os.urandom(16))
        sock.send(wire.encode(hs, i + 1))
        # At most 200 unanswered, as a client waiting for its answers would be: beyond
        # the registrar's mailbox the daemon would answer BUSY (and beyond the socket's
        # queue drop the answers to a peer that does not read them).
        while sock.poll(0) or i + 1 - len(codes) > 200:
            assert sock.poll(30_000), f"{len(codes)} of {i + 1} handshakes answered"
            take_reply()

    t0 = time.monotonic()
    try:
        with KeptServing(x, env.p) as served:
            sent = flood_until_served(send, served, at_least=1000)
            while len(codes) < sent:
                assert sock.poll(30_000), f"{len(codes)} of {sent} handshakes answered"
                take_reply()
    finally:
        sock.close(0)
    elapsed = time.monotonic() - t0
    assert set(codes) == set(range(1, sent + 1)) and set(codes.values()) == {ErrorCode.AUTH}
    after = counters(x)
    assert delta(before, after, "auth_rejected") == sent
    assert delta(before, after, "handshakes_accepted") == served.rounds  # the good peer's
    assert all(p["agent"] == env.p.name for p in status(x, "peers")["peers"])
    warnings = warnings_logged(x)
    assert len(warnings) <= line_bound(1, elapsed), (len(warnings), elapsed, warnings[:5])


EC_PRODUCER = '[ec]\nrole = "producer"\nregion_bytes = 4194304\nblock_bytes = 1048576\n'


def test_ec_router_flood_is_counted_exactly_and_logged_in_a_few_lines(
    env: Env, daemons: StartDaemon
) -> None:
    x = daemons("kvdt-flood-ec", env.auth + EC_PRODUCER)
    port = int(status(x, "ec")["port"])
    before = counters(x)
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    frames = (*FLOOD_FRAMES, wire.encode(wire.Probe(1, False)))  # and a message of the wrong type
    t0 = time.monotonic()
    try:
        with KeptServing(x, env.p) as served:
            sent = flood_until_served(lambda i: sock.send(frames[i % 3]), served)
            after = counted(x, "ec_xfer_rejected", before.get("ec_xfer_rejected", 0) + sent)
        # the router still answers a request (authenticated, for an output it does not have)
        req = wire.ECXferReq(
            "kvdt-none", "", "kvdt-a", "127.0.0.1", 1, 1, 1, (0,), time.time(), os.urandom(16)
        )
        sock.send(wire.encode(replace(req, mac=message_mac(SECRET, req, EC_XFER_CONTEXT))))
        assert sock.poll(10_000), "the EC router no longer answers"
        _, ack = wire.decode(sock.recv())
        assert isinstance(ack, wire.ECXferAck) and ack.code == ErrorCode.NOT_FOUND, ack
    finally:
        sock.close(0)
    elapsed = time.monotonic() - t0
    assert delta(before, after, "ec_xfer_rejected") == sent
    assert delta(before, counters(x), "ec_xfer_rejected") == sent
    warnings = warnings_logged(x)
    # three kinds of bad frame, and the one refused request
    assert len(warnings) <= line_bound(3, elapsed) + 1, (len(warnings), elapsed, warnings[:5])


def test_flood_of_messages_that_are_not_notifications_is_logged_in_a_few_lines(env: Env) -> None:
    n = 500
    env.fake.connect(env.d)
    before = counters(env.d)
    lines_before = len(warnings_logged(env.d))
    t0 = time.monotonic()
    for _ in range(n):
        env.fake.agent.send_notif(
            env.d.name, env.fake.sealed(env.d, wire.encode(wire.GetStatus("status")))
        )
    env.fake.pump()
    after = env.counters_until(env.d, "notifs_rejected", before.get("notifs_rejected", 0) + n)
    elapsed = time.monotonic() - t0
    assert delta(before, after, "notifs_rejected") == n
    new_lines = warnings_logged(env.d)[lines_before:]
    # earlier tests may have opened this kind's window: then even the first is summarised
    assert len(new_lines) <= line_bound(1, elapsed), (len(new_lines), new_lines[:5])


# ------------------------------------------------------------------ peer addresses

BAD_PEERS: dict[str, tuple[str, int, str]] = {
    "spaces": ("not a host", 5600, "host"),
    "control": ("p0.kvd\x1b[2J.local", 5600, "host"),
    "nul": ("p0\x00.local", 5600, "host"),
    "bad-ip": ("10.0.0.300", 5600, "host"),
    "too-long": ("a" * 254, 5600, "host"),
    "port-0": ("127.0.0.1", 0, "port"),
}


def naming_peer(kind: str, rid: str, host: str, port: int) -> tuple[wire.Record, str]:
    """A request of `kind` naming the peer (host, port), and the prefix of its fields."""
    if kind == "Track":
        return wire.Track(rid, "decode", host, port, "", ""), "Track.peer_"
    if kind == "RegisterPush":
        return wire.RegisterPush(rid, "decode", (1,), host, port, "", ""), "RegisterPush.peer_"
    if kind == "Pull":
        return wire.Pull(rid, "decode", (1,), host, port, "", rid, (1,)), "Pull.peer_"
    if kind == "ECEnsure":
        return wire.ECEnsure(rid, host, port, 4096, ""), "ECEnsure.peer_"
    assert kind == "PingPeer"
    return wire.PingPeer(host, port, 1.0), "PingPeer."


PEER_REQUESTS = ["Track", "RegisterPush", "Pull", "ECEnsure", "PingPeer"]


@pytest.mark.parametrize("case", list(BAD_PEERS))
@pytest.mark.parametrize("kind", PEER_REQUESTS)
def test_request_naming_an_impossible_peer_is_refused_at_once(
    env: Env, kind: str, case: str
) -> None:
    host, port, field = BAD_PEERS[case]
    rid = _rid(f"badpeer-{kind}")
    msg, prefix = naming_peer(kind, rid, host, port)
    before = counters(env.d)
    raw = RawIpc(env.d.socket)
    try:
        raw.hello()
        reply = raw.request(msg, 31)
    finally:
        raw.close()
    assert isinstance(reply, wire.ErrorReply) and reply.code == ErrorCode.INVALID, reply
    assert reply.message.startswith(f"{prefix}{field} "), reply.message
    after = counters(env.d)
    assert delta(before, after, "requests_invalid_peer") == 1
    assert delta(before, after, "handshakes_failed") == 0
    leases = status(env.d, "leases")
    assert rid not in json.dumps(leases) and rid not in json.dumps(status(env.d, "transfers"))


def test_client_requests_naming_an_impossible_peer_end_in_their_failure_event(env: Env) -> None:
    c = env.d_eng.client
    outstanding = c.outstanding
    rids = {kind: _rid(f"badpeer-client-{kind}") for kind in ("push", "pull", "track")}
    c.register_push(rids["push"], [1, 2], "not a host", 5600)
    c.pull(rids["pull"], [3], "10.0.0.300", 5600, remote_request_id="x", remote_block_ids=[4])
    c.track(rids["track"], "p0\x00.local", 5600)
    c.ec_ensure(wire.ECParams("kvdt-mm-badpeer", "127.0.0.1", 0, 4096, (), "uint8", "image", ""))
    got: list[Event] = []

    def three_events() -> bool:
        got.extend(c.drain_events())
        return len(got) >= 3

    eventually(three_events, "three failure events")
    by_id = {getattr(e, "request_id", None) or getattr(e, "mm_hash", None): e for e in got}
    push, pull, ec = by_id[rids["push"]], by_id[rids["pull"]], by_id["kvdt-mm-badpeer"]
    assert isinstance(push, wire.RecvFailed) and push.code == ErrorCode.INVALID
    assert push.reason.startswith("RegisterPush.peer_host") and push.block_ids == (1, 2)
    assert isinstance(pull, wire.RecvFailed) and pull.reason.startswith("Pull.peer_host")
    assert isinstance(ec, wire.ECUnavailable) and ec.code == ErrorCode.INVALID
    assert ec.reason.startswith("ECEnsure.peer_port 0 ")
    assert rids["track"] not in by_id  # a refused track has no event: it left nothing
    assert rids["track"] not in json.dumps(status(env.d, "leases"))
    assert c.outstanding == outstanding
    with pytest.raises(InvalidRequest, match=r"PingPeer\.host"):
        c.ping_peer("not a host", 5600, timeout=1.0)


def test_refused_peer_addresses_are_never_dialled(env: Env, daemons: StartDaemon) -> None:
    """Nothing is tracked, probed, heartbeated or handshaked for a refused address. A
    control request tracked afterwards against a real (closed) address shows what an
    accepted request costs: handshake attempts in the log, at once."""
    x = daemons(
        "kvdt-badpeer",
        overrides={
            "transfer": {"peer_probe_interval": 0.2},
            "side_channel": {"handshake_timeout": 0.5},
        },
    )
    c = KvdClient(x.socket, role="scheduler", engine_id="decode", timeout=5.0)
    c.connect()
    control = _rid("control")
    try:
        for case, (host, port, _) in BAD_PEERS.items():
            c.track(_rid(f"never-{case}"), host, port)
            c.register_push(_rid(f"never-push-{case}"), [1], host, port)
            c.pull(
                _rid(f"never-pull-{case}"),
                [1],
                host,
                port,
                remote_request_id="x",
                remote_block_ids=[1],
            )
        c.track(control, "127.0.0.1", 1)

        # (the failures are logged rate-limited: the counter has every attempt, and every
        # line written names the control)
        eventually(
            lambda: counters(x).get("handshakes_failed", 0) >= 2,
            "two handshake attempts of the control",
        )
        dialled = {
            str(r.get("addr") or r.get("peer"))
            for r in log_records(x)
            if r.get("event") in ("peer_handshake_failed", "peer_handshake_ok", "peer_unreachable")
        }
        assert dialled == {"127.0.0.1:1"}, dialled
        assert counters(x)["requests_invalid_peer"] == 3 * len(BAD_PEERS)
        tracked = [r["request_id"] for r in status(x, "leases")["tracked"]]
        assert tracked == [control], tracked
    finally:
        c.abort(control)
        c.close()


# ------------------------------------------------------------------ frames beyond the transport cap


def test_frames_beyond_the_transport_cap_are_counted_on_every_socket(daemons: StartDaemon) -> None:
    """libzmq drops the connection of a frame above twice max_frame_bytes before reading
    it; the daemon counts the lost connection (libzmq tells nothing more, see
    kvd.adapters.zmq_monitor) and keeps serving. Only this test's connections reach
    the daemon, so each count is exact."""
    x = daemons(
        "kvdt-oversized", EC_PRODUCER, overrides={"daemon": {"max_frame_bytes": FRAME_LIMIT}}
    )
    cli = KvdClient(x.socket, role="cli", timeout=5.0, keepalive_interval=0)
    welcome = cli.connect()
    huge = _msgpack(wire.PROTOCOL_VERSION, wire.GetStatus.TYPE, 8, "x" * (64 * FRAME_LIMIT))

    def count(key: str) -> int:
        got: int = cli.status()["counters"].get(key, 0)
        return got

    def settled(key: str) -> int:
        """The count once connections closed earlier (the start-up checks' clients) are
        in: two reads a while apart agree."""
        last = count(key)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            time.sleep(0.3)
            now = count(key)
            if now == last:
                return now
            last = now
        raise AssertionError(f"{key} kept moving for 30 s")

    def check(key: str, endpoint: str, event: str) -> None:
        before = settled(key)
        sock = dealer(endpoint)
        try:
            wait_disconnected(sock, lambda: sock.send(huge))
            eventually(lambda: count(key) >= before + 1, f"{key} to count it")
            assert count(key) == before + 1, key
        finally:
            sock.close(0)
        assert any(r.get("event") == event for r in log_records(x)), event

    def dealer(endpoint: str) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(endpoint)
        return sock

    try:
        cases = [
            ("ipc_disconnects", f"ipc://{x.socket}", "ipc_connection_lost"),
            ("side_disconnects", f"tcp://127.0.0.1:{x.side_port}", "side_connection_lost"),
            ("ec_disconnects", f"tcp://127.0.0.1:{welcome.ec_port}", "ec_connection_lost"),
        ]
        for key, endpoint, event in cases:
            check(key, endpoint, event)
        # Everyone else is still served: this client, a new one, and the EC router.
        assert cli.status()["agent_name"] == x.name
        assert status(x)["agent_name"] == x.name
        sock = dealer(f"tcp://127.0.0.1:{welcome.ec_port}")
        try:
            req = wire.ECXferReq("kvdt-none", "", "kvdt-a", "127.0.0.1", 1, 1, 1, (0,))
            sock.send(wire.encode(req))
            assert sock.poll(10_000), "the EC router no longer answers"
            _, ack = wire.decode(sock.recv())
            assert isinstance(ack, wire.ECXferAck) and ack.code == ErrorCode.NOT_FOUND, ack
            # A request for an output it has, from a consumer announcing an address that
            # cannot be one: refused without dialling it.
            cli.ec_allocate("kvdt-held", 1000)
            cli.ec_commit("kvdt-held", 1000, compat="c")
            before = count("ec_xfer_failed")
            req = wire.ECXferReq("kvdt-held", "c", "kvdt-a", "not a host", 5600, 1, 1, (0,))
            sock.send(wire.encode(req))
            assert sock.poll(10_000), "the EC router no longer answers"
            _, ack = wire.decode(sock.recv())
            assert isinstance(ack, wire.ECXferAck) and ack.code == ErrorCode.INVALID, ack
            assert ack.reason.startswith("ECXferReq.side_host "), ack
            assert count("ec_xfer_failed") == before + 1
            assert count("handshakes_failed") == 0
        finally:
            sock.close(0)
    finally:
        cli.close()


def test_an_oversized_reply_from_a_peer_side_channel_is_dropped_unread(
    daemons: StartDaemon,
) -> None:
    """The daemon's own dials (handshakes, trace queries) cap what a peer may answer as
    its listening sockets do: a rogue side channel answering a handshake with 96 MiB
    makes the handshake fail; the daemon never holds the frame (its peak RSS stays far
    below it) and keeps serving."""
    x = daemons("kvdt-bigreply", overrides={"daemon": {"max_frame_bytes": FRAME_LIMIT}})
    junk = b"\xc1" * (96 * 1024 * 1024)
    stop = threading.Event()
    answered: list[int] = []
    ready = threading.Event()
    port: list[int] = []

    def rogue() -> None:
        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        port.append(sock.bind_to_random_port("tcp://127.0.0.1"))
        ready.set()
        try:
            while not stop.is_set():
                if not sock.poll(50):
                    continue
                ident, frame = sock.recv_multipart()
                corr, _ = wire.decode(frame)
                sock.send_multipart([ident, junk])
                answered.append(corr)
        finally:
            sock.close(0)

    thread = threading.Thread(target=rogue, name="rogue-side", daemon=True)
    thread.start()
    assert ready.wait(5)
    try:
        time.sleep(0.5)  # the daemon's start-up settles before the peak is reset
        with open(f"/proc/{x.proc.pid}/clear_refs", "w") as f:
            f.write("5")  # VmHWM starts again from the current RSS
        base = _status_kib(x.proc.pid, "VmRSS")
        with KvdClient(x.socket, role="cli", timeout=5.0, keepalive_interval=0) as c:
            res = c.ping_peer("127.0.0.1", port[0], timeout=3.0)
        assert res["ok"] is False and "agent" not in res, res
        assert answered, "the rogue side channel was never asked"
        eventually(lambda: counters(x).get("handshakes_failed", 0) >= 1, "the failed handshake")
        peak = _status_kib(x.proc.pid, "VmHWM")
        assert peak - base < 32 * 1024, f"peak RSS grew {(peak - base) // 1024} MiB"
        assert status(x)["agent_name"] == x.name
    finally:
        stop.set()
        thread.join(5)


def _status_kib(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(f"{field}:"):
                return int(line.split()[1])
    raise AssertionError(f"no {field}")


def test_a_probe_from_an_agent_that_never_handshook_is_refused_not_echoed(
    workdir: Path,
) -> None:
    """Without a secret too: a NIXL agent that learned a daemon's metadata but never
    handshook gets no answer to a Probe (it is counted as rejected); a peer that
    handshook gets its echo."""
    x = start_daemon(workdir, "kvdt-noauth-probe")
    friend = FakePeer(f"kvdt-friend-{os.getpid()}", b"")
    rogue = new_agent(f"kvdt-probe-rogue-{os.getpid()}")
    try:
        hs = friend.handshake_msg()
        got = side_exchange(x.side_port, wire.encode(hs, 5))
        assert got is not None and isinstance(got[1], wire.Handshake), got
        friend.remote_md[x.name] = got[1].nixl_md
        assert friend.agent.add_remote_agent(got[1].nixl_md) == x.name.encode()
        assert rogue.add_remote_agent(got[1].nixl_md) == x.name.encode()
        before = counters(x).get("notifs_rejected", 0)
        rogue.send_notif(x.name, wire.encode(wire.Probe(41, False)))
        seen: list[wire.Record] = []

        def counted_yet() -> bool:  # the rogue's agent progresses only when it is polled
            for msgs in rogue.get_new_notifs().values():
                seen.extend(wire.decode(raw)[1] for raw in msgs)
            return bool(counters(x).get("notifs_rejected", 0) == before + 1)

        eventually(counted_yet, "the rogue probe counted")
        friend.send_bare(x, wire.encode(wire.Probe(42, False)))
        friend.wait_for(lambda m: isinstance(m, wire.Probe) and m.reply and m.nonce == 42, "echo")
        for msgs in rogue.get_new_notifs().values():
            seen.extend(wire.decode(raw)[1] for raw in msgs)
        assert seen == [], seen  # the friend's echo came after any the rogue could get
        assert any(r.get("event") == "probe_rejected" for r in log_records(x))

        # a probe asking for the canary by WRITE (`kvd ping` where a READ would be
        # emulated): the canary lands in the asker's registered memory, the echo after it
        friend.buf[:64] = 0
        ask = wire.Probe(43, False, friend.buf.ctypes.data, 64)
        friend.send_bare(x, wire.encode(ask))
        echo = friend.wait_for(lambda m: isinstance(m, wire.Probe) and m.nonce == 43, "canary")
        assert echo == wire.Probe(43, True, 0, 64)
        assert bytes(friend.buf[:64]) == canary_pattern(x.name)[:64]
        # one naming memory the asker never registered: refused by NIXL, counted, no echo
        friend.send_bare(x, wire.encode(wire.Probe(44, False, 4096, 64)))
        eventually(lambda: counters(x).get("probe_echo_failed", 0) == 1, "the failed WRITE")
        friend.send_bare(x, wire.encode(wire.Probe(45, False)))
        friend.wait_for(lambda m: isinstance(m, wire.Probe) and m.nonce == 45, "a later echo")
        assert not any(isinstance(m, wire.Probe) and m.nonce == 44 for _, m in friend.inbox)
    finally:
        assert x.stop() == 0
        friend.side.close()


# ------------------------------------------------------------------ and after all that


def test_daemons_still_move_verified_bytes(env: Env) -> None:
    res = run_mode(
        "push", env.p_eng, env.d_eng, env.p.side_port, 5, random.Random(1), max_blocks=8, timeout=30
    )
    assert res.verified == 5 and res.failed == 0 and res.mismatched == 0, res.summary()
    res = run_mode(
        "pull", env.p_eng, env.d_eng, env.p.side_port, 3, random.Random(2), max_blocks=8, timeout=30
    )
    assert res.verified == 3 and res.failed == 0 and res.mismatched == 0, res.summary()
    for dp in (env.p, env.d):
        assert dp.proc.poll() is None
        assert status(dp)["agent_name"] == dp.name


# ------------------------------------------------------------------ stale views of regions


def test_push_registration_naming_a_generation_p_does_not_know_writes_nothing(env: Env) -> None:
    """D registers into a generation of its region that P's view does not hold (D's engine
    re-registered, or the view is stale): P may not WRITE through its old view. P handshakes
    again at the address the peer's handshake gave (not one a registration names), where
    this peer answers no handshake: it fails closed."""
    env.fake.connect(env.p)
    env.fake.buf[:] = 0
    before = status(env.p)
    _, done, p_evs = _push_from_fake(env, (6, 2), 2, generations=(7,))
    assert not done.ok, done
    assert "handshake reply is a Ok" in done.reason, done.reason
    last = env.fake.side.received[-1]  # P dialed the address from the fake's handshake
    assert isinstance(last, wire.Handshake) and last.agent_name == env.p.name, last
    assert [type(e) for e in p_evs] == [wire.SendFailed], p_evs
    after = status(env.p)
    assert after["nixl"]["transfers_posted"] == before["nixl"]["transfers_posted"]
    assert after["sender"]["leases"] == 0 and after["sender"]["sending"] == 0
    assert not env.fake.buf.any()


def test_pull_done_naming_a_stale_generation_is_refused_and_frees_the_lease(env: Env) -> None:
    """D READ P's blocks through a view of a region generation P no longer has (its engine
    re-registered and D missed the drop notice): the bytes D got are not the request's,
    so P refuses the ack (D reports failure, never done) and ends its send."""
    env.fake.connect(env.p)
    p = env.p_eng
    rid = _rid("stalegen")
    blocks = p.alloc(random.Random(5), 2)
    try:
        p.client.finished(rid, blocks)
        eventually(
            lambda: any(x["request_id"] == rid for x in status(env.p, "leases")["leases"]),
            "P's lease",
        )
        have = [r["generation"] for r in status(env.p)["regions"] if r["engine_id"] == "prefill"]
        env.fake.send(env.p, wire.encode(wire.PullDone(rid, "kvdt-d-stale", (have[0] + 1,), "")))
        ack = env.fake.wait_for(
            lambda m: isinstance(m, wire.PullAck) and m.d_request_id == "kvdt-d-stale", "ack"
        )
        assert isinstance(ack, wire.PullAck)
        assert (ack.ok, ack.code) == (False, ErrorCode.TRANSFER), ack
        assert f"P's regions are ({have[0]},)" in ack.reason, ack.reason
        evs = eventually(lambda: p.client.drain_events(), "P's terminal event", pump=env.fake.pump)
        assert [(type(e), e.request_id) for e in evs] == [(wire.SendFailed, rid)], evs
        assert status(env.p)["sender"]["leases"] == 0
        assert counters(env.p)["pulls_stale_view"] >= 1
    finally:
        p.release(blocks)


# ------------------------------------------------------------------ nothing retried forever


def test_d_stops_heartbeating_a_p_that_refuses_its_handshake(env: Env, workdir: Path) -> None:
    """A D without the secret tracks requests against an authenticated P: the handshake
    is refused (AUTH), which retrying cannot mend, so D stops heartbeating those requests
    at once instead of trying every second forever; a request that then registers fails
    with the refusal."""
    d = start_daemon(workdir, "kvdt-noauth-d")
    try:
        eng = make_engine(
            d.socket, "decode", num_blocks=NUM_BLOCKS, num_layers=NUM_LAYERS, chunk_bytes=CHUNK
        )
        try:
            for i in range(3):
                eng.client.track(_rid(f"noauth{i}"), "127.0.0.1", env.p.side_port)
            st = eventually(
                lambda: (s := status(d))["counters"].get("peers_given_up", 0) == 1 and s,
                "D giving up on P",
            )
            assert st["receiver"]["tracked"] == 0 and st["receiver"]["heartbeat_peers"] == 0
            assert st["counters"]["tracks_dropped"] == 3
            tries = st["counters"].get("handshakes_failed", 0)
            time.sleep(3.0)
            assert counters(d).get("handshakes_failed", 0) == tries  # no retry since
            rid = _rid("noauth-push")
            eng.client.track(rid, "127.0.0.1", env.p.side_port)
            eng.client.register_push(rid, [1], "127.0.0.1", env.p.side_port)
            (ev,) = eventually(lambda: eng.client.drain_events(), "D's terminal event")
            assert isinstance(ev, wire.RecvFailed) and ev.code == ErrorCode.AUTH, ev
            log_lines = d.log.read_text().count('"peer_unreachable"')
            assert log_lines <= 2, log_lines
        finally:
            eng.close()
    finally:
        assert d.stop() == 0
