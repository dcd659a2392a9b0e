"""A steady stream of P -> D requests, as vLLM's engines make them, for fault tests.

P's simulated engine fills each request's blocks with a per-request pattern and, like
vLLM, reuses a block the moment its daemon says the send ended (done, failed or
expired): it overwrites the block with a poison pattern and puts it back in its free
list. D's engine checks every byte of every request its daemon reports done. So a
daemon that transfers from blocks its engine was told it got back shows up as a
`RecvFinished` with wrong bytes, never silently.

Requests take turns among `modes`: push and pull (D tracks each one first, P finishes it,
D registers or pulls, in random order relative to P's finish for push), and layer-wise
push ("layers": D registers first, then P's engine computes the request a layer or two at
a time over several steps: it writes each layer's bytes into blocks that hold poison
until then, its workers announce them with `layers_saved`, and it finishes after the
last; a daemon that WRITEs a layer before its notice, or reports D done before every
layer landed, shows up as wrong bytes). Every terminal event is recorded per request id,
on each side, with the time it was seen, so tests (and `kvd chaos`) can check "exactly
once" and "within its bound".
"""

from __future__ import annotations

import random
import secrets
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from kvd_client import wire

from kvd.demo import Engine, pattern

HOST = "127.0.0.1"
P_TERMINAL = (wire.SendFinished, wire.SendFailed, wire.SendExpired)
D_TERMINAL = (wire.RecvFinished, wire.RecvFailed)
NOT_OFFERED = "not offered"
"""D's end of a request P's client refused at once (no live session): D never heard of it."""


@dataclass
class Req:
    key: str
    p_id: str
    d_id: str
    mode: str
    p_blocks: list[int]
    d_blocks: list[int]
    started: float
    p_end: str = ""
    d_end: str = ""
    d_reason: str = ""
    p_end_at: float = 0.0
    """time.monotonic() when P's terminal event was drained (0: none yet)."""
    d_end_at: float = 0.0
    """time.monotonic() when D's terminal event was drained (0: none yet)."""
    remote: dict[str, Any] = field(default_factory=dict)
    """What D's calls carry about P (kv_transfer_params), with `as_vllm`."""
    nbytes: int = 0
    """Bytes D's engine verified for it (0 unless it ended RecvFinished with the right bytes)."""
    layers: int = 0
    """Mode "layers": the layers P's engine has computed and announced so far."""


@dataclass
class Traffic:
    """Drives requests between two engines (see the module docstring); call `step()` often."""

    p: Engine
    d: Engine
    port: int
    rng: random.Random
    window: int = 24
    max_blocks: int = 4
    modes: tuple[str, ...] = ("push", "pull")
    incarnation: int = 0
    """P daemon incarnation put in D's calls (0: unknown), as kv_transfer_params carry it."""
    p_host: str = HOST
    """The address of P's daemon's side channel, as D's calls name it."""
    as_vllm: bool = False
    """Announce each request as vLLM's `KvdConnector` does: P finishes first and D hears
    of it only if P's client took it, with P's current incarnation and session; else the
    request ends at P alone (D's end is `NOT_OFFERED`). Off: D tracks first and a push
    may register before P finishes, whatever P's client says."""
    reqs: dict[str, Req] = field(default_factory=dict)
    by_p: dict[str, Req] = field(default_factory=dict)
    by_d: dict[str, Req] = field(default_factory=dict)
    p_events: Counter[str] = field(default_factory=Counter)
    d_events: Counter[str] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)
    stray: list[str] = field(default_factory=list)
    started: int = 0
    not_offered: int = 0
    """Requests P's client refused at once (`as_vllm`)."""
    paused: bool = False
    streaming: dict[str, Req] = field(default_factory=dict)
    """Mode "layers": requests P's engine is still computing, by key."""

    def __post_init__(self) -> None:
        if "layers" in self.modes and len(self.p.workers) != len(self.p.regions):
            raise ValueError('mode "layers" needs P\'s engine made with workers (one per rank)')

    @property
    def live(self) -> int:
        return sum(1 for r in self.reqs.values() if not (r.p_end and r.d_end))

    def step(self) -> None:
        if not self.paused:
            while self.live < self.window and self._start():
                pass
        self._compute_layers()
        self._drain()

    def _start(self) -> bool:
        n = self.rng.randint(1, self.max_blocks)
        if len(self.p.free) < n or len(self.d.free) < n:
            return False
        key = f"cmpl-{secrets.token_hex(8)}-{self.started}-0"
        mode = self.modes[self.started % len(self.modes)]
        self.started += 1
        r = Req(
            key,
            f"{key}-{secrets.token_hex(4)}",
            f"{key}-{secrets.token_hex(4)}",
            mode,
            self.p.alloc(self.rng, n),
            self.d.alloc(self.rng, n),
            time.monotonic(),
        )
        self.reqs[key], self.by_p[r.p_id], self.by_d[r.d_id] = r, r, r
        if mode == "layers":
            return self._start_layers(r)
        for rank in range(len(self.p.regions)):
            for j, b in enumerate(r.p_blocks):
                self.p.block(rank, b)[:] = pattern(f"{key}/{rank}", j, self.p.block_bytes)
        d = self.d.client
        if self.as_vllm:
            return self._start_as_vllm(r)
        d.track(r.d_id, self.p_host, self.port, remote_request_id=r.p_id, **self._inc())
        d_first = mode == "push" and self.rng.random() < 0.5
        if d_first:
            self._d_start(r)
        self.p.client.finished(r.p_id, r.p_blocks)
        if not d_first:
            self._d_start(r)
        return True

    def _start_as_vllm(self, r: Req) -> bool:
        """P finishes first; only if its client took the request (a live session) is D
        told, with P's daemon incarnation and client session, as `KvdConnector` does."""
        p = self.p.client
        if not p.finished(r.p_id, r.p_blocks):
            self.not_offered += 1
            r.d_end, r.d_end_at = NOT_OFFERED, time.monotonic()
            self.d.release(r.d_blocks)
            return True
        inc = p.welcome.incarnation if p.welcome is not None else 0
        r.remote = {"remote_incarnation": inc, "remote_session": p.session}
        self.d.client.track(
            r.d_id, self.p_host, self.port, remote_request_id=r.p_id, remote_incarnation=inc
        )
        self._d_start(r)
        return True

    def _start_layers(self, r: Req) -> bool:
        """D registers before P has computed anything (P's blocks hold poison until each
        layer is written), naming P's daemon incarnation and client session as P's
        client last knew them (a P daemon that restarted since, or a session that ended,
        fails the registration at once)."""
        for rank in range(len(self.p.regions)):
            for b in r.p_blocks:
                self.p.block(rank, b)[:] = 0xEE
        p = self.p.client
        if p.welcome is not None and p.session:
            r.remote = {"remote_incarnation": p.welcome.incarnation, "remote_session": p.session}
        inc = r.remote.get("remote_incarnation", self.incarnation)
        self.d.client.track(
            r.d_id, self.p_host, self.port, remote_request_id=r.p_id, remote_incarnation=inc
        )
        self._d_start(r)
        self.streaming[r.key] = r
        return True

    def _compute_layers(self) -> None:
        """Each step, every request P's engine is computing gets one or two more layers:
        their bytes written, then announced by every rank's worker; after the last layer
        the engine finishes the request (the finish sends whatever no notice named)."""
        lay = self.p.layout
        for key, r in list(self.streaming.items()):
            upto = min(lay.num_layers, r.layers + self.rng.randint(1, 2))
            for rank in range(len(self.p.regions)):
                for j, b in enumerate(r.p_blocks):
                    want = pattern(f"{key}/{rank}", j, self.p.block_bytes)
                    for layer in range(r.layers, upto):
                        for part in range(lay.kv_parts):
                            at = layer * lay.layer_stride + part * lay.kv_stride
                            chunk = want[at : at + lay.chunk_bytes]
                            self.p.chunk(rank, b, layer, part)[:] = chunk
            r.layers = upto
            for w in self.p.workers:
                w.layers_saved(upto, [(r.p_id, r.p_blocks)])  # not sent: the finish covers it
            if upto < lay.num_layers:
                continue
            del self.streaming[key]
            if not self.p.client.finished(r.p_id, r.p_blocks) and not r.d_end:
                # P's prefill failed (no session): the router gives D's request up
                self.d.client.abort(r.d_id, "recv")

    def _inc(self) -> dict[str, Any]:
        return {"remote_incarnation": self.incarnation} if self.incarnation else {}

    def _d_start(self, r: Req) -> None:
        # P's engine named, as kv_transfer_params name it: P's daemon may serve others
        extra = {**(r.remote or self._inc()), "remote_engine_id": self.p.name}
        if r.mode in ("push", "layers"):
            self.d.client.register_push(
                r.d_id, r.d_blocks, self.p_host, self.port, remote_request_id=r.p_id, **extra
            )
        else:
            self.d.client.pull(
                r.d_id,
                r.d_blocks,
                self.p_host,
                self.port,
                remote_request_id=r.p_id,
                remote_block_ids=r.p_blocks,
                **extra,
            )

    def _drain(self) -> None:
        for w in self.p.workers if "layers" in self.modes else ():
            # the workers whose notices the streams need poll as vLLM's worker connector
            # does each step: a worker's session comes back (and registers its regions
            # again) only through its own polls; it sees its engine's events too, which
            # the scheduler's client counts (without streams, the caller's to take)
            w.drain_events()
        for ev in self.p.client.drain_events():
            if not isinstance(ev, P_TERMINAL):
                continue
            r = self.by_p.get(ev.request_id)
            self.p_events[type(ev).__name__] += 1
            if r is None or r.p_end or r.key in self.streaming:
                # (P's engine never finished a request it is still computing)
                self.stray.append(f"P {type(ev).__name__} for {ev.request_id}")
                continue
            r.p_end = type(ev).__name__
            r.p_end_at = time.monotonic()
            # vLLM frees the blocks now and reuses them: poison them at once
            for rank in range(len(self.p.regions)):
                for b in r.p_blocks:
                    self.p.block(rank, b)[:] = 0xEE
            self.p.release(r.p_blocks)
        for ev in self.d.client.drain_events():
            if not isinstance(ev, D_TERMINAL):
                continue
            r = self.by_d.get(ev.request_id)
            self.d_events[type(ev).__name__] += 1
            if r is None or r.d_end:
                self.stray.append(f"D {type(ev).__name__} for {ev.request_id}")
                continue
            r.d_end = type(ev).__name__
            r.d_end_at = time.monotonic()
            if isinstance(ev, wire.RecvFinished):
                if not self._bytes_ok(r):
                    self.wrong.append(f"{r.mode} {r.d_id} (P said {r.p_end or 'nothing yet'})")
                else:
                    r.nbytes = len(r.d_blocks) * self.d.block_bytes * len(self.d.regions)
            else:
                r.d_reason = ev.reason
            self.d.release(r.d_blocks)

    def _bytes_ok(self, r: Req) -> bool:
        return all(
            np.array_equal(self.d.block(rank, b), pattern(f"{r.key}/{rank}", j, self.d.block_bytes))
            for rank in range(len(self.d.regions))
            for j, b in enumerate(r.d_blocks)
        )

    def run_for(self, seconds: float, every: float = 0.002) -> None:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            self.step()
            time.sleep(every)

    def settle(self, timeout: float) -> None:
        """Stop starting requests and wait until every started one ended on both sides."""
        self.paused = True
        end = time.monotonic() + timeout
        while (self.live or self.streaming) and time.monotonic() < end:
            self.step()
            time.sleep(0.005)
        self.paused = False
        self._drain()

    def unfinished(self) -> list[str]:
        return [
            f"{r.mode} {r.d_id}: P={r.p_end or '-'} D={r.d_end or '-'}"
            for r in self.reqs.values()
            if not (r.p_end and r.d_end)
        ]

    def ok(self) -> int:
        return sum(1 for r in self.reqs.values() if r.d_end == "RecvFinished")
