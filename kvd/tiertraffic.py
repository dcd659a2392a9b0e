"""Tier traffic for `kvd chaos`: KV blocks stored, looked up and loaded through the
daemons' tiers (host pool, disk, peers) by real `TierClient`s, every loaded byte checked.

A `TierWorker` is one engine's offloading: in a thread of its own (a tier call blocks up
to its timeout, as vLLM's offloading worker does), it stores batches of blocks and looks
up and loads others, drawn from a key space larger than the daemon's host tier (so blocks
are evicted, demoted to disk and promoted back) and shared with a worker on another
daemon (so lookups find blocks on that peer and loads READ them over NIXL). A block's
bytes are a function of its key (`content`): a load that reports a block loaded with
other bytes (another block's, a slot reused under a frozen client, a torn file, a peer's
stale pin) is a wrong byte. Each call must end, loaded or failed, within `call_bound`.

The victims of `kvd chaos` run one too, with keys of their own: SIGKILLed, SIGSTOPped past
their session (their pins dropped, their lent slots quarantined) or starved mid-call,
they must never make the main workers load wrong bytes, and what they held must be freed.
"""

from __future__ import annotations

import hashlib
import random
import threading
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from kvd_client.errors import KvdError
from kvd_client.tiers import TierClient

NAMESPACE: Final = b"kvd-chaos-model"
BLOCK_BYTES: Final = 32 * 1024
HOST_SLOTS: Final = 96
"""Blocks of the daemons' host tier (`tiers.host_bytes`): fewer than the key space."""
DISK_BLOCKS: Final = 128
"""Blocks of the daemons' disk tier: host and disk together hold fewer than the key space,
so a daemon keeps losing blocks it had and finds them again on its peer."""
KEYS: Final = 320
"""The main workers' key space (10 MiB of blocks): each stores half of it and loads from
all of it (the other half is found on the peer, or missed)."""
MAX_BATCH: Final = 12
LOOKUP_TIMEOUT: Final = 2.0
IO_TIMEOUT: Final = 4.0
RATE: Final = 15.0
"""Calls a worker starts per second at most (the machine has other work to do)."""


def call_bound(lookup_timeout: float = LOOKUP_TIMEOUT, io_timeout: float = IO_TIMEOUT) -> float:
    """Seconds within which a call must return or raise: a session the daemon no longer
    knows is reopened once (`TierClient`), so a message may wait twice for its answer, and
    a load's lookup comes before it; 2 s for the copies on a loaded machine."""
    return 2 * (lookup_timeout + io_timeout) + 2.0


def tiers_overrides(disk_path: str, peers: str) -> dict[str, Any]:
    """The daemons' `[tiers]` for the run: a small host tier, a disk tier behind it,
    demotion and promotion on, `peers` asked for misses."""
    return {
        "enabled": True,
        "host_bytes": HOST_SLOTS * BLOCK_BYTES,
        "disk_path": disk_path,
        "disk_bytes": DISK_BLOCKS * BLOCK_BYTES,
        "peers": peers,
        "pin_timeout": 10.0,
    }


def tier_holdings(tiers: dict[str, Any]) -> dict[str, int]:
    """What a daemon's KV tiers hold for their clients and peers now (`kvd tiers --json`):
    once every client is gone, each must be 0. Pins and reservations (operations open),
    slots lent ahead of stores or quarantined for a client that may still write, pins
    taken for peers, reads from peers or the disk under way."""
    host, peer = tiers.get("host", {}), tiers.get("peer", {})
    return {
        "operations open (pins, reservations)": int(tiers.get("ops_open", 0)),
        "slots lent": int(host.get("lent", 0)),
        "slots quarantined": int(host.get("quarantined", 0)),
        "pins held for peers": int(peer.get("pins_held", 0)),
        "peer reads": int(peer.get("reading", 0)),
        "disk reads": int(tiers.get("disk", {}).get("reading", 0)),
    }


def key_space(tag: str, n: int) -> list[bytes]:
    """`n` OffloadKeys (a block hash and the KV group, 4 bytes) of `tag`."""
    return [hashlib.sha256(f"{tag}/{i}".encode()).digest() + bytes(4) for i in range(n)]


def content(key: bytes) -> bytes:
    """A block's bytes: a pattern of its key's hash, different from any other key's at
    every 32 bytes."""
    seed = hashlib.sha256(b"chaos-kv" + key).digest()
    return seed * (BLOCK_BYTES // len(seed))


@dataclass
class TierLoad:
    """What one worker saw."""

    calls: Counter[str] = field(default_factory=Counter)
    """Per call kind and end: "store ok", "load failed TIMEOUT", ..."""
    stored: int = 0
    loaded: int = 0
    """Blocks loaded with every byte right."""
    bytes: int = 0
    not_loaded: int = 0
    """Blocks a lookup found that the load then did not (evicted meanwhile, a stale read,
    a peer gone): misses, which vLLM computes."""
    wrong: list[str] = field(default_factory=list)
    longest_s: float = 0.0
    over_bound: list[str] = field(default_factory=list)
    stats: dict[str, Any] = field(default_factory=dict)
    """The client's own counters at its end (`TierClient.reopened`, `.stale_reads`, ...)."""

    def as_dict(self) -> dict[str, Any]:
        return {
            "calls": dict(sorted(self.calls.items())),
            "stored": self.stored,
            "loaded": self.loaded,
            "bytes": self.bytes,
            "not_loaded": self.not_loaded,
            "wrong": self.wrong[:20],
            "longest_s": round(self.longest_s, 3),
            "over_bound": self.over_bound[:20],
            "client": self.stats,
        }


class TierWorker:
    """One engine's tier calls on the daemon at `socket`, in a thread (`start`, `stop`)."""

    def __init__(
        self,
        socket: str,
        name: str,
        keys: Sequence[bytes],
        seed: int,
        *,
        store_keys: Sequence[bytes] | None = None,
        rate: float = RATE,
        lookup_timeout: float = LOOKUP_TIMEOUT,
        io_timeout: float = IO_TIMEOUT,
        report: Path | None = None,
    ) -> None:
        """Loads draw from `keys`, stores from `store_keys` (default: the same). `report`: a
        file each wrong block is also written to at once (a victim's: the process may be
        killed at any moment)."""
        self.socket = socket
        self.report = report
        self.name = name
        self.keys = list(keys)
        self.store_keys = list(keys if store_keys is None else store_keys)
        self.rng = random.Random(seed)
        self.rate = rate
        self.lookup_timeout = lookup_timeout
        self.io_timeout = io_timeout
        self.bound = call_bound(lookup_timeout, io_timeout)
        self.load = TierLoad()
        self.paused = threading.Event()
        """Set: no call is started (the run settles); `idle` is set once none is under way."""
        self.idle = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._client: TierClient | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name=f"tiers-{self.name}", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    @property
    def thread_alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                if self.paused.is_set():
                    self.idle.set()
                    self._stop.wait(0.05)
                    continue
                self.idle.clear()
                self._one()
                self._stop.wait(1.0 / self.rate)
        finally:
            self.idle.set()
            if self._client is not None:
                c = self._client
                self.load.stats = {
                    "reopened": c.reopened,
                    "stale_reads": c.stale_reads,
                    "commits_refused": c.commits_refused,
                    "files_read": c.files_read,
                    "files_failed": c.files_failed,
                    "direct_hits": c.direct_hits,
                    "direct_stale": c.direct_stale,
                }
                c.close()

    def _one(self) -> None:
        if self._client is None:
            t0 = time.monotonic()
            try:
                self._client = TierClient(
                    self.socket,
                    NAMESPACE,
                    BLOCK_BYTES,
                    timeout=self.lookup_timeout,
                    io_timeout=self.io_timeout,
                )
            except KvdError as exc:  # its daemon down or stopped: tried again
                self._ended("open", t0, exc)
                self._stop.wait(0.5)
                return
            self._ended("open", t0)
        n = self.rng.randint(1, MAX_BATCH)
        if self.rng.random() < 0.4:
            self._store(self._client, self.rng.sample(self.store_keys, n))
        else:
            self._lookup_and_load(self._client, self.rng.sample(self.keys, n))

    def _store(self, client: TierClient, keys: list[bytes]) -> None:
        t0 = time.monotonic()
        try:
            done = client.store(keys, [memoryview(content(k)) for k in keys])
        except KvdError as exc:
            self._ended("store", t0, exc)
            return
        self._ended("store", t0)
        self.load.stored += sum(done)

    def _lookup_and_load(self, client: TierClient, keys: list[bytes]) -> None:
        t0 = time.monotonic()
        try:
            found = client.batch_lookup(keys)
            held = [k for k, f in zip(keys, found, strict=True) if f]
            dests = [bytearray(BLOCK_BYTES) for _ in held]
            got = client.load(held, [memoryview(d) for d in dests]) if held else []
        except KvdError as exc:
            self._ended("load", t0, exc)
            return
        self._ended("load", t0)
        for k, ok, d in zip(held, got, dests, strict=True):
            if not ok:
                self.load.not_loaded += 1
            elif d != content(k):
                at = next(i for i, (a, b) in enumerate(zip(d, content(k), strict=True)) if a != b)
                line = f"{self.name}: block {k[:6].hex()} wrong from byte {at}"
                self.load.wrong.append(line)
                if self.report is not None:
                    with self.report.open("a") as f:
                        f.write(line + "\n")
            else:
                self.load.loaded += 1
                self.load.bytes += BLOCK_BYTES

    def _ended(self, kind: str, t0: float, exc: KvdError | None = None) -> None:
        took = time.monotonic() - t0
        end = "ok" if exc is None else f"failed {exc.code.name}"
        self.load.calls[f"{kind} {end}"] += 1
        self.load.longest_s = max(self.load.longest_s, took)
        if took > self.bound:
            self.load.over_bound.append(
                f"{self.name}: {kind} {end} after {took:.2f}s > {self.bound:g}s"
            )
