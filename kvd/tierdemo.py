"""`kvd demo --mode tiers`: a first engine stores requests' KV blocks in the daemon's tiers,
a second engine finds and loads them; every loaded byte is checked.

Requests share prefixes (the first blocks of a request come from a few shared "system
prompts"), as prefix caching sees them. The host tier is kept smaller than what is
stored, so blocks are demoted to the disk tier; the second engine reads those straight
from their files (`tiers.disk_client_reads`) and the daemon promotes them back. Keys are
vLLM's OffloadKeys (a block hash and the group, 4 bytes).
"""

from __future__ import annotations

import hashlib
import random
import time
from collections.abc import Callable
from typing import Any

from kvd_client.errors import KvdError
from kvd_client.tiers import TierClient

NS = b"kvd-demo-simulated-model"
BLOCK_BYTES = 64 * 1024
BLOCKS_PER_REQUEST = 8
SHARED_PREFIXES = 8
PREFIX_BLOCKS = 4


def tiers_config(disk_path: str) -> str:
    """The daemon's `[tiers]`: a host tier of 256 blocks and a disk tier behind it."""
    return (
        f'[tiers]\nenabled = true\nhost_bytes = {256 * BLOCK_BYTES}\ndisk_path = "{disk_path}"\n'
        f"disk_bytes = {1 << 30}\nlow_water = 0.125\n"
    )


def _hash(parent: bytes, what: str) -> bytes:
    return hashlib.sha256(parent + what.encode()).digest()


def request_keys(req: int, rng: random.Random) -> list[bytes]:
    """Block keys of one request: a chain of hashes, as prefix caching makes them."""
    prefix = rng.randrange(SHARED_PREFIXES)
    keys, h = [], b""
    for b in range(BLOCKS_PER_REQUEST):
        h = _hash(h, f"p{prefix}-{b}" if b < PREFIX_BLOCKS else f"r{req}-{b}")
        keys.append(h + (0).to_bytes(4, "big"))
    return keys


def block_bytes_of(key: bytes) -> bytes:
    """Deterministic content of a block (what the engine's KV would be)."""
    seed = hashlib.sha256(b"kv" + key).digest()
    return (seed * (BLOCK_BYTES // len(seed) + 1))[:BLOCK_BYTES]


def run_tiers(
    socket: str, requests: int, rng: random.Random, progress: Callable[[], None]
) -> dict[str, Any]:
    """Engine A stores every request's missing blocks; engine B then loads every block
    of every request it finds and checks the bytes. Returns the demo's summary row."""
    plan = [request_keys(i, rng) for i in range(requests)]
    failures: list[str] = []
    with TierClient(socket, NS, BLOCK_BYTES, timeout=10.0, io_timeout=60.0) as a:
        for keys in plan:
            try:
                found = a.batch_lookup(keys)
                new = [k for k, f in zip(keys, found, strict=True) if not f]
                if new:
                    a.store(new, [memoryview(block_bytes_of(k)) for k in new])
            except KvdError as exc:
                failures.append(f"store: {exc.message}")
    looked = hits = verified = mismatched = failed = 0
    took: list[float] = []
    moved = 0
    order = list(range(requests))
    rng.shuffle(order)
    with TierClient(socket, NS, BLOCK_BYTES, timeout=10.0, io_timeout=60.0) as b:
        for i in order:
            keys = plan[i]
            try:
                found = b.batch_lookup(keys)
                looked += len(keys)
                held = [k for k, f in zip(keys, found, strict=True) if f]
                hits += len(held)
                dests = [bytearray(BLOCK_BYTES) for _ in held]
                t0 = time.perf_counter()
                got = b.load(held, [memoryview(d) for d in dests])
                took.append(time.perf_counter() - t0)
            except KvdError as exc:
                failed += 1
                failures.append(f"load: {exc.message}")
                progress()
                continue
            ok = True
            for k, g, d in zip(held, got, dests, strict=True):
                if not g:
                    ok = False
                    failures.append(f"request {i}: a found block did not load")
                elif bytes(d) != block_bytes_of(k):
                    ok = False
                    mismatched += 1
                    failures.append(f"request {i}: wrong bytes")
                else:
                    moved += BLOCK_BYTES
            if ok and len(held) == len(keys):
                verified += 1
            elif ok:
                failed += 1
                failures.append(f"request {i}: {len(keys) - len(held)} blocks not found")
            progress()
        stats = b.stats()
    took.sort()
    total = sum(took)
    return {
        "mode": "tiers",
        "requests": requests,
        "verified": verified,
        "mismatched": mismatched,
        "failed": failed,
        "hit_rate": hits / looked if looked else 0.0,
        "bytes": moved,
        "gbps": moved / total / 1e9 if total else 0.0,
        "p50_ms": took[len(took) // 2] * 1e3 if took else 0.0,
        "p99_ms": took[min(len(took) - 1, int(len(took) * 0.99))] * 1e3 if took else 0.0,
        "failures": failures,
        "tiers": stats,
    }
