"""Live fuzzing: random and mutated frames at every door of a running daemon.

A daemon X (with a shared secret, a KV decode engine and an EC producer) and a peer
P take frames made from the golden wire fixtures (`tests/fixtures/wire`: bits flipped,
bytes replaced, inserted, cut, fixtures spliced, msgpack fields swapped for values of
other types, headers changed) and from nothing (random bytes, random msgpack trees),
seeded. Each surface gets its own stream:

- `ipc`: X's IPC socket, on connections that never said Hello;
- `side`: X's TCP side channel;
- `ec`: X's EC router;
- `notif`: NIXL notifications from a rogue agent: a real NIXL agent that learned X's
  metadata (an accomplice that knows the secret handshook for it) but never handshook
  itself.

Before a frame is sent it is classified offline with the daemon's own decoder
(`kvd_client.wire.decode`, X's frame limit) and the surface's admission rule (below):
the frames X must reject are sent, and the counters of rejection X keeps must grow by
exactly what the classifier predicts; the few mutations that are valid messages a
well-behaved party may send (a Hello with a known role, a KeepAlive, an empty
notification) are counted as such and withheld. The rules:

- ipc: undecodable, a message before Hello, a Hello with an unknown role: `ipc_rejected`;
- side: undecodable or not a side-channel request: `side_rejected`; a Handshake or a
  TraceQuery fails authentication (`auth_rejected`); a RegionDropped, a peer's tier
  request or a Sealed envelope is not an authentic envelope of a peer that handshook
  (`side_auth_rejected`);
- ec: undecodable or neither an ECXferReq nor an ECXferCancel: `ec_xfer_rejected`; either
  of those fails authentication (`ec_auth_rejected`);
- notif: undecodable: `notifs_malformed`; any message from an agent that never
  handshook: `notifs_rejected` (or `notifs_dropped_busy` when its actor's mailbox is
  full; any counter named `notifs_*auth*` also counts, for peers whose every message
  is authenticated).

Then `sessions`: well-formed messages made the same way, sent by clients that said Hello
(a scheduler, a worker, a tiers and a second scheduler session, with engine ids of their
own, opened afresh every `SESSION_ROTATE` messages so that none times out; half the
messages that name an engine name the session's own), so that they reach the actors
behind the gateway (X keeps KV tiers and an EC producer for it). What
they ask may be valid or not; nothing is predicted per message. What must hold: X never
exits, a new client's Hello and status call are answered within `HELLO_BOUND_S` at every
check, the good client is served meanwhile, and once the fuzzing clients are gone and the
good client stopped, nothing of theirs is left in X: no session, region, lease, tracked
or pending request, tier operation, lent or quarantined slot, EC allocation, orphan, pin
or fetch. (Their first run found three bugs: pulls naming P hosts by names whose DNS
lookups were slow held every other client's Hello for seconds, since libzmq resolved
them in its I/O thread; EC allocations never committed stayed pinned for good after their
session ended; a failed handshake was a log line each. And the resolver's first version,
on asyncio's default executor, made a stopping daemon wait for every lookup under way.)

`frames` is the total, shared evenly by the four surfaces (`kvd chaos --fuzz`: 100,000);
the sessions send `frames // 4` more.
Meanwhile a good client is served: real push and pull transfers P -> X with every byte
verified, interleaved with the frames. The report: frames per surface, rejections
counted against predicted, crashes (X or P exiting), transfers verified.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import shutil
import struct
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgpack
import zmq
from kvd_client import wire
from kvd_client.client import KvdClient
from kvd_client.errors import KvdError, RemoteProtocolError

from kvd.actors.gateway import ROLES
from kvd.actors.registrar import handshake_mac
from kvd.demo import DaemonProc, Engine, make_engine, run_mode, start_daemon
from kvd.tiertraffic import tier_holdings

FIXTURES: Final = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "wire"
SURFACES: Final = ("ipc", "side", "ec", "notif")
WITHHELD: Final = "valid"
"""The class of a frame a well-behaved party may send: not sent."""
BATCH: Final = 64
SESSION_ROTATE: Final = 200
"""Messages the fuzzing sessions send before they are opened afresh (and X is checked)."""
HELLO_BOUND_S: Final = 2.0
"""A new client's Hello and status call must be answered within this, during the fuzzing."""
SESSION_ROLES: Final = (
    ("scheduler", "fuzz-s"),
    ("worker", "fuzz-s"),
    ("tiers", ""),
    ("scheduler", "fuzz-e"),
)
MAX_FRAME: Final = 1 << 20
"""X's daemon.max_frame_bytes."""


# ------------------------------------------------------------------ frames


def golden_frames(fixtures: Path = FIXTURES) -> list[bytes]:
    frames = [p.read_bytes() for p in sorted(fixtures.glob("*.bin"))]
    if not frames:
        raise FileNotFoundError(f"no golden wire fixtures in {fixtures}")
    return frames


def _random_value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12 if depth < 3 else 9)
    if kind == 0:
        return rng.choice([0, -1, 1, 2**31 - 1, -(2**31), 2**32, 2**63 - 1, -(2**63), 2**64 - 1])
    if kind == 1:
        return rng.randrange(-1000, 1000)
    if kind == 2:
        return rng.choice(["", "x" * rng.randrange(300), "\x00", "漢字😀", "../../etc", "a b"])
    if kind == 3:
        return bytes(rng.getrandbits(8) for _ in range(rng.randrange(40)))
    if kind == 4:
        return rng.choice([None, True, False])
    if kind == 5:
        return rng.choice([0.0, -1.0, 1e308, float("inf"), float("-inf"), float("nan")])
    if kind == 6:
        return struct.pack("<i", rng.randrange(-(2**31), 2**31)) * rng.randrange(5)
    if kind in (7, 8):
        return rng.randrange(1 << 16)
    if kind == 9:
        return [_random_value(rng, depth + 1) for _ in range(rng.randrange(6))]
    if kind == 10:
        return {str(i): _random_value(rng, depth + 1) for i in range(rng.randrange(4))}
    return [[_random_value(rng, depth + 2)] for _ in range(rng.randrange(3))]


def _pack(obj: Any) -> bytes:
    out = msgpack.packb(obj, use_bin_type=True)
    assert isinstance(out, bytes)
    return out


def mutate(rng: random.Random, seeds: list[bytes]) -> bytes:
    """One frame made from `seeds` (or from nothing), deterministic given rng's state."""
    op = rng.randrange(12)
    base = bytearray(rng.choice(seeds))
    n = len(base)
    if op == 0 and n:  # flip bits
        for _ in range(rng.randint(1, 8)):
            i = rng.randrange(n)
            base[i] ^= 1 << rng.randrange(8)
    elif op == 1 and n:  # replace bytes
        for _ in range(rng.randint(1, 6)):
            base[rng.randrange(n)] = rng.getrandbits(8)
    elif op == 2:  # insert bytes
        i = rng.randrange(n + 1)
        base[i:i] = bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 16)))
    elif op == 3 and n:  # cut a slice or the tail
        i = rng.randrange(n)
        j = rng.randrange(i, n + 1) if rng.random() < 0.5 else n
        del base[i:j]
    elif op == 4:  # splice two fixtures
        other = rng.choice(seeds)
        base = base[: rng.randrange(n + 1)] + other[rng.randrange(len(other) + 1) :]
    elif op in (5, 6):  # a field of another type
        with contextlib.suppress(Exception):
            raw = msgpack.unpackb(bytes(base), raw=False, strict_map_key=False)
            if isinstance(raw, list) and raw:
                i = (
                    rng.randrange(3, len(raw))
                    if len(raw) > 3 and op == 5
                    else rng.randrange(len(raw))
                )
                raw[i] = _random_value(rng)
                return _pack(raw)
    elif op == 7:  # fields added or dropped
        with contextlib.suppress(Exception):
            raw = msgpack.unpackb(bytes(base), raw=False, strict_map_key=False)
            if isinstance(raw, list):
                if raw and rng.random() < 0.5:
                    del raw[rng.randrange(len(raw)) :]
                else:
                    raw += [_random_value(rng) for _ in range(rng.randint(1, 3))]
                return _pack(raw)
    elif op in (10, 11):  # a well-formed message, sent where it does not belong
        with contextlib.suppress(Exception):
            raw = msgpack.unpackb(bytes(base), raw=False, strict_map_key=False)
            raw[2] = rng.randrange(1 << 32)
            return _pack(raw)
    elif op == 8:  # random bytes
        return bytes(rng.getrandbits(8) for _ in range(rng.randrange(200)))
    else:  # a random message-shaped tree
        head = [
            rng.choice([wire.PROTOCOL_VERSION, wire.PROTOCOL_VERSION, 0, 99]),
            rng.choice([*wire.registry(), rng.randrange(1000)]),
            rng.choice([0, 1, 2**64 - 1, -1]),
        ]
        return _pack(head + [_random_value(rng) for _ in range(rng.randrange(12))])
    return bytes(base)


# ------------------------------------------------------------------ classification


def _decoded(frame: bytes) -> wire.Record | None:
    """The message X's decoder makes of `frame`, None if it refuses it. Any exception
    other than RemoteProtocolError escapes: that is a decoder bug, a finding."""
    try:
        return wire.decode(frame, MAX_FRAME)[1]
    except RemoteProtocolError:
        return None


def classify(surface: str, frame: bytes) -> tuple[str, ...]:
    """The counters X increments for `frame` on `surface` (module docstring), or
    (WITHHELD,) for a frame a well-behaved party may send."""
    if surface == "notif" and not frame:
        return (WITHHELD,)  # NIXL's own transfer notifications carry no message
    msg = _decoded(frame)
    if surface == "ipc":
        if isinstance(msg, wire.KeepAlive) or (isinstance(msg, wire.Hello) and msg.role in ROLES):
            return (WITHHELD,)
        return ("ipc_rejected",)
    if surface == "side":
        if isinstance(msg, (wire.Handshake, wire.TraceQuery)):
            return ("auth_rejected",)
        if isinstance(
            msg,
            (
                wire.RegionDropped,
                wire.Sealed,
                wire.PeerTierLookup,
                wire.PeerTierPin,
                wire.PeerTierUnpin,
            ),
        ):
            return ("side_auth_rejected",)  # not an authentic envelope of a known peer
        return ("side_rejected",)
    if surface == "ec":
        if isinstance(msg, (wire.ECXferReq, wire.ECXferCancel)):
            return ("ec_auth_rejected",)
        return ("ec_xfer_rejected",)
    assert surface == "notif"
    if msg is None:
        return ("notifs_malformed",)
    return ("notifs_rejected",)  # a Probe too: only a peer that handshook is answered


# ------------------------------------------------------------------ the run


@dataclass
class SurfaceResult:
    surface: str
    frames: int = 0
    withheld: int = 0
    predicted: Counter[str] = field(default_factory=Counter)
    counted: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return all(self.counted.get(k, 0) == v for k, v in self.predicted.items())


class GoodClient:
    """Real transfers P -> X (push and pull, every byte verified) in a thread, round
    after round, until stopped."""

    def __init__(self, p: Engine, d: Engine, port: int, seed: int) -> None:
        self.p, self.d, self.port = p, d, port
        self.rng = random.Random(seed)
        self.rounds = self.verified = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="good-client", daemon=True)

    def __enter__(self) -> GoodClient:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            mode = ("push", "pull")[self.rounds % 2]
            try:
                res = run_mode(
                    mode, self.p, self.d, self.port, 4, self.rng, max_blocks=4, timeout=30
                )
            except Exception as exc:  # a broken client is a finding, not a crash of the run
                self.errors.append(repr(exc))
                return
            if res.verified != 4 or res.failed or res.mismatched:
                self.errors.append(f"{mode}: {res.summary()['failures']}")
            self.verified += res.verified
            self.rounds += 1

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


def _counters(d: DaemonProc) -> dict[str, int]:
    with KvdClient(d.socket, role="cli", timeout=10.0, keepalive_interval=0) as c:
        got: dict[str, int] = c.status()["counters"]
        return got


def _rogue_agent(name: str) -> Any:
    from kvd.adapters.nixl_import import nixl_api

    api = nixl_api()
    nixl_agent, nixl_agent_config = api.nixl_agent, api.nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=[]))
    agent.create_backend("UCX", {"ucx_error_handling_mode": "peer"})
    return agent


def _learn_metadata(x: DaemonProc, secret: bytes, informant: Any) -> bytes:
    """X's NIXL metadata, from a handshake the informant (who knows the secret) makes."""
    hs = wire.Handshake(
        agent_name=informant.name,
        incarnation=random.getrandbits(63),
        nixl_md=bytes(informant.get_agent_metadata()),
        side_host="127.0.0.1",
        side_port=9,
        kv_lease_duration=30.0,
        write_bound=100.0,
        regions=(),
        canary_addr=0,
        canary_bytes=0,
        nonce=os.urandom(16),
        timestamp=time.time(),
        mac=b"",
    )
    hs = dataclasses.replace(hs, mac=handshake_mac(secret, hs, b"req"))
    sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://127.0.0.1:{x.side_port}")
        sock.send(wire.encode(hs, 1))
        if not sock.poll(20_000):
            raise RuntimeError("X did not answer the informant's handshake")
        _, reply = wire.decode(sock.recv())
    finally:
        sock.close(0)
    if not isinstance(reply, wire.Handshake):
        raise RuntimeError(f"X refused the informant's handshake: {reply}")
    return reply.nixl_md


class _Sender:
    """Sends one surface's frames in batches, draining whatever X answers."""

    def __init__(self, surface: str, x: DaemonProc, ec_port: int, rogue: Any) -> None:
        self.surface = surface
        self.x = x
        self.rogue = rogue
        self.socks: list[zmq.Socket[bytes]] = []
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
        endpoint = {
            "ipc": f"ipc://{x.socket}",
            "side": f"tcp://127.0.0.1:{x.side_port}",
            "ec": f"tcp://127.0.0.1:{ec_port}",
        }.get(surface)
        if endpoint is not None:
            for _ in range(8):
                s: zmq.Socket[bytes] = ctx.socket(zmq.DEALER)
                s.setsockopt(zmq.LINGER, 0)
                s.connect(endpoint)
                self.socks.append(s)
        self.answers = 0

    def send(self, batch: list[bytes]) -> None:
        if self.surface == "notif":
            for f in batch:
                self.rogue.send_notif(self.x.name, f)
            self.rogue.get_new_notifs()
            return
        for i, f in enumerate(batch):
            self.socks[i % len(self.socks)].send(f)
        self.drain(0.0)

    def drain(self, wait: float) -> None:
        end = time.monotonic() + wait
        while True:
            got = False
            for s in self.socks:
                while s.poll(0):
                    s.recv()
                    self.answers += 1
                    got = True
            if not got and time.monotonic() >= end:
                return
            if not got:
                time.sleep(0.002)

    def close(self) -> None:
        for s in self.socks:
            s.close(0)


def _rejections(surface: str, c: dict[str, int]) -> dict[str, int]:
    keys = {
        "ipc": ("ipc_rejected",),
        "side": ("side_rejected", "auth_rejected", "side_auth_rejected"),
        "ec": ("ec_xfer_rejected", "ec_auth_rejected"),
        "notif": ("notifs_malformed", "notifs_rejected", "notifs_dropped_busy"),
    }[surface]
    extra = [k for k in c if surface == "notif" and k.startswith("notifs_") and "auth" in k]
    return {k: c.get(k, 0) for k in (*keys, *extra)}


def fuzz_surface(
    surface: str, n: int, seed: int, x: DaemonProc, ec_port: int, rogue: Any, seeds: list[bytes]
) -> SurfaceResult:
    res = SurfaceResult(surface)
    before = _rejections(surface, _counters(x))
    sender = _Sender(surface, x, ec_port, rogue)
    t0 = time.monotonic()
    rng = random.Random(f"{seed}/{surface}")
    try:
        batch: list[bytes] = []
        while res.frames < n:
            frame = mutate(rng, seeds)
            cls = classify(surface, frame)
            if cls == (WITHHELD,):
                res.withheld += 1
                continue
            res.frames += 1
            res.predicted.update(cls)
            batch.append(frame)
            if len(batch) == BATCH or res.frames == n:
                sender.send(batch)
                batch = []
                if res.frames % (BATCH * 16) == 0:
                    _caught_up(x, surface, before, res, sender)  # bounded in flight
        _caught_up(x, surface, before, res, sender)
    finally:
        sender.close()
    res.seconds = time.monotonic() - t0
    after = _rejections(surface, _counters(x))
    res.counted = {k: after[k] - before.get(k, 0) for k in after}
    if surface == "notif":  # a full mailbox drops instead of rejecting: both are counted
        busy = res.counted.get("notifs_dropped_busy", 0)
        auth = sum(v for k, v in res.counted.items() if "auth" in k)
        res.counted["notifs_rejected"] = res.counted.get("notifs_rejected", 0) + busy + auth
    return res


def fuzz_sessions(n: int, seed: int, x: DaemonProc, seeds: list[bytes]) -> dict[str, Any]:
    """`n` well-formed messages from clients with sessions (module docstring); the figures
    and problems. The leftovers are checked by `session_leftovers` once the good client
    stopped."""
    rng = random.Random(f"{seed}/sessions")
    kinds: Counter[str] = Counter()
    out: dict[str, Any] = {"messages": 0, "problems": [], "slowest_hello_s": 0.0}
    clients: list[KvdClient] = []

    def reopen() -> None:
        for c in clients:
            c.close()
        clients.clear()
        for role, engine in SESSION_ROLES:
            c = KvdClient(x.socket, role=role, engine_id=engine, timeout=10.0, keepalive_interval=0)
            c.connect()
            clients.append(c)

    t0 = time.monotonic()
    try:
        reopen()
        while out["messages"] < n:
            msg = _decoded(mutate(rng, seeds))
            if msg is None or isinstance(msg, (wire.Hello, wire.Goodbye)):
                continue  # (undecodable ones: the ipc surface; these would end a session)
            c = rng.choice(clients)
            if c.engine_id and hasattr(msg, "engine_id") and rng.random() < 0.5:
                # as its own engine's: past the first checks, deeper into the actors
                msg = dataclasses.replace(msg, engine_id=c.engine_id)
            sock = c._sock
            assert sock is not None
            sock.send(wire.encode(msg, rng.getrandbits(31) | 1))
            kinds[type(msg).__name__] += 1
            out["messages"] += 1
            for cl in clients:  # answers and events: read, not judged
                s = cl._sock
                while s is not None and s.poll(0):
                    s.recv()
            if out["messages"] % SESSION_ROTATE == 0:
                if x.proc.poll() is not None:
                    out["problems"].append(f"X exited {x.proc.returncode} under session fuzzing")
                    break
                h0 = time.monotonic()
                with KvdClient(x.socket, role="cli", timeout=30.0, keepalive_interval=0) as cli:
                    cli.status()
                took = time.monotonic() - h0
                out["slowest_hello_s"] = max(out["slowest_hello_s"], round(took, 3))
                if took > HELLO_BOUND_S:
                    out["problems"].append(
                        f"a new client's Hello and status took {took:.2f}s "
                        f"after {out['messages']} session messages"
                    )
                reopen()
    finally:
        for c in clients:
            c.close()
    out["seconds"] = round(time.monotonic() - t0, 1)
    out["kinds"] = dict(kinds.most_common())
    return out


def session_leftovers(x: DaemonProc, wait: float) -> list[str]:
    """What X still holds for the fuzzing sessions (all gone) and for the good client
    (stopped), polled for up to `wait` seconds: empty when nothing is left."""
    end = time.monotonic() + wait
    while True:
        with KvdClient(x.socket, role="cli", timeout=10.0, keepalive_interval=0) as c:
            st, tiers, ec, leases = (
                c.status(),
                c.status("tiers"),
                c.status("ec"),
                c.status("leases"),
            )
        left = [
            f"session of {s['engine_id']!r} ({s['role']})"
            for s in st["sessions"]
            if s["role"] != "cli" and s["engine_id"].startswith("fuzz-")
        ]
        left += [
            f"region of {r['engine_id']!r}"
            for r in st["regions"]
            if r["engine_id"] not in ("decode", "kvd-ec")
        ]
        left += [
            f"sender {k} = {v}"
            for k, v in st["sender"].items()
            if k in ("leases", "pending_registrations", "early_pulls", "sending") and v
        ]
        left += [
            f"receiver {k} = {v}"
            for k, v in st["receiver"].items()
            if k in ("tracked", "receiving", "sending", "heartbeat_peers") and v
        ]
        left += [f"lease {x_['request_id']}" for x_ in leases["leases"]]
        left += [f"tracked {x_['request_id']}" for x_ in leases["tracked"]]
        left += [f"tiers {k} = {v}" for k, v in tier_holdings(tiers).items() if v]
        prod = ec.get("producer") or {}
        left += [
            f"EC {k} = {v}"
            for k, v in (
                ("allocated", ec.get("allocated", 0)),
                ("orphaned", ec.get("orphaned")),
                ("pinned", prod.get("pinned", 0)),
                ("fetching", ec.get("fetching")),
                ("quarantined", ec.get("quarantined")),
            )
            if v
        ]
        if not left or time.monotonic() >= end:
            return left
        time.sleep(0.5)


def _caught_up(
    x: DaemonProc, surface: str, before: dict[str, int], res: SurfaceResult, sender: _Sender
) -> None:
    """Wait until X counted every frame sent so far (or 60 s passed)."""
    want = sum(res.predicted.values())
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        now = _rejections(surface, _counters(x))
        if sum(now[k] - before.get(k, 0) for k in now) >= want:
            return
        if sender.surface == "notif":
            sender.rogue.get_new_notifs()
        sender.drain(0.05)


def run_fuzz(
    frames: int,
    seed: int,
    workdir: Path | None = None,
    log: Callable[[str], None] = lambda _: None,
) -> dict[str, Any]:
    """Fuzz a fresh daemon with `frames` frames in all, shared evenly by the surfaces;
    the figures."""
    share = [frames // len(SURFACES) + (i < frames % len(SURFACES)) for i in range(len(SURFACES))]
    seeds = golden_frames()
    own = workdir is None
    base = workdir or Path(tempfile.mkdtemp(prefix="kvdf-", dir="/tmp"))
    wd = Path(tempfile.mkdtemp(prefix="fuzz-", dir=base))
    secret = b"kvd fuzz secret " + os.urandom(8).hex().encode()
    secret_file = wd / "secret"
    fd = os.open(secret_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    os.write(fd, secret + b"\n")
    os.close(fd)
    auth = f'[auth]\nsecret_file = "{secret_file}"\n'
    common = {"daemon": {"max_frame_bytes": MAX_FRAME, "reap_leftover_segments": False}}
    x_extra = (
        auth
        + '[ec]\nrole = "producer"\nregion_bytes = 8388608\nblock_bytes = 1048576\n'
        + f'[tiers]\nenabled = true\nhost_bytes = 4194304\ndisk_path = "{wd / "tiers"}"\n'
    )
    out: dict[str, Any] = {"frames": 0, "crashes": 0, "surfaces": {}, "problems": []}
    p = start_daemon(wd, "kvdf-p", auth, overrides=common, ready_timeout=120)
    x: DaemonProc | None = None
    engines: list[Engine] = []
    rogue = informant = None
    try:
        x = start_daemon(wd, "kvdf-x", x_extra, overrides=common, ready_timeout=120)
        with KvdClient(x.socket, role="cli", timeout=5.0, keepalive_interval=0) as c:
            ec_port = int(c.status("ec")["port"])
        engines.append(
            make_engine(p.socket, "prefill", num_blocks=64, num_layers=2, chunk_bytes=4096)
        )
        engines.append(
            make_engine(x.socket, "decode", num_blocks=64, num_layers=2, chunk_bytes=4096)
        )
        informant = _rogue_agent(f"kvdf-informant-{os.getpid()}")
        rogue = _rogue_agent(f"kvdf-rogue-{os.getpid()}")
        md = _learn_metadata(x, secret, informant)
        if rogue.add_remote_agent(md) != x.name.encode():
            raise RuntimeError("the rogue could not load X's metadata")
        with GoodClient(engines[0], engines[1], p.side_port, seed) as good:
            for surface, n in zip(SURFACES, share, strict=True):
                try:
                    r = fuzz_surface(surface, n, seed, x, ec_port, rogue, seeds)
                except KvdError as exc:  # X stopped answering: crashed, or hung
                    out["crashes"] += 1
                    out["problems"].append(f"{surface}: X stopped answering: {exc}")
                    break
                log(f"{surface}: {r.frames} frames in {r.seconds:.1f}s, {r.counted}")
                out["surfaces"][surface] = {
                    "frames": r.frames,
                    "withheld_valid": r.withheld,
                    "predicted": dict(r.predicted),
                    "counted": r.counted,
                    "seconds": round(r.seconds, 1),
                    "ok": r.ok,
                }
                out["frames"] += r.frames
                if not r.ok:
                    out["problems"].append(
                        f"{surface}: counted {r.counted}, predicted {dict(r.predicted)}"
                    )
                for d in (x, p):
                    if d.proc.poll() is not None:
                        out["crashes"] += 1
                        out["problems"].append(f"{d.name} exited {d.proc.returncode}")
                if out["crashes"]:
                    break
            if not out["crashes"]:
                s = fuzz_sessions(max(SESSION_ROTATE, frames // 4), seed, x, seeds)
                log(f"sessions: {s['messages']} messages in {s['seconds']}s")
                out["sessions"] = s
                out["problems"] += s["problems"]
                if x.proc.poll() is not None:
                    out["crashes"] += 1
            while good.rounds < 2 and not good.errors and not out["crashes"]:
                time.sleep(0.1)  # served during the fuzzing, not only before it
        out["good_rounds"] = good.rounds
        out["good_verified"] = good.verified
        if "sessions" in out and x.proc.poll() is None:
            left = session_leftovers(x, wait=45.0)
            out["sessions"]["left"] = left
            out["problems"] += [f"left after the fuzzing sessions: {w}" for w in left]
        if good.errors or good.rounds < 2:
            out["problems"].append(f"good client: {good.rounds} rounds, {good.errors[:3]}")
    finally:
        for e in engines:
            e.client.timeout = 2.0
            e.close()
        daemons = [dp for dp in (x, p) if dp is not None]
        for dp in daemons:
            if dp.proc.poll() is None and (rc := dp.stop()) != 0:
                out["problems"].append(f"{dp.name} stopped with {rc}")
        for dp in daemons:
            errors = [ln for ln in dp.log.read_text().splitlines() if '"level": "error"' in ln]
            if errors:
                out["problems"].append(f"{dp.name} logged errors: {errors[:3]}")
        del rogue, informant
        shutil.rmtree(wd if not own else base, ignore_errors=True)
    out["ok"] = not out["problems"] and out["crashes"] == 0
    return out
