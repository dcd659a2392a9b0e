"""The encoder-cache pipeline used by `kvd demo --mode ec` and its integration tests.

An encoder engine (producer) and a consumer engine each map their daemon's EC region
by name. A stream of images with repeats: the encoder "encodes" an image the first time
it is asked for (deterministic bytes per image), copies the output into the blocks its
daemon allocated and commits it; the consumer ensures each image, copies it out when
`ECReady` arrives (checking every byte), and releases it. An output the producer has
since evicted is encoded again, as a real deployment would.
"""

from __future__ import annotations

import mmap
import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from kvd_client import wire
from kvd_client.client import KvdClient
from kvd_client.errors import ErrorCode

_BASE = np.random.default_rng(12345).integers(0, 256, size=16 << 20, dtype=np.uint8)


def output_bytes(image: int, nbytes: int) -> np.ndarray:
    """The encoder output of image `image`: distinct per image, cheap to make and check."""
    start = (image * 7919) % (len(_BASE) - nbytes) if nbytes < len(_BASE) else 0
    return _BASE[start : start + nbytes] ^ np.uint8(image % 251 + 1)


class ECSide:
    """An engine's view of its daemon's EC region."""

    def __init__(self, socket: str, name: str) -> None:
        self.client = KvdClient(socket, role="scheduler", engine_id=name)
        self.client.connect()
        info = self.client.status("ec")
        self.block_bytes = int(info["block_bytes"])
        fd = os.open(os.path.join("/dev/shm", info["region"]), os.O_RDWR)
        try:
            self._mm = mmap.mmap(fd, int(info["region_bytes"]))
        finally:
            os.close(fd)
        self.buf = np.frombuffer(self._mm, dtype=np.uint8)

    def write(self, blocks: tuple[int, ...], data: np.ndarray) -> None:
        bb = self.block_bytes
        for i, b in enumerate(blocks):
            chunk = data[i * bb : (i + 1) * bb]
            self.buf[b * bb : b * bb + len(chunk)] = chunk

    def matches(self, blocks: tuple[int, ...], data: np.ndarray) -> bool:
        bb = self.block_bytes
        for i, b in enumerate(blocks):
            chunk = data[i * bb : (i + 1) * bb]
            if not np.array_equal(self.buf[b * bb : b * bb + len(chunk)], chunk):
                return False
        return True

    def close(self) -> None:
        self.client.close()
        del self.buf
        self._mm.close()


@dataclass
class ECResult:
    requests: int = 0
    verified: int = 0
    mismatched: int = 0
    failed: int = 0
    local_hits: int = 0
    encoded: int = 0
    reencoded: int = 0
    bytes: int = 0
    seconds: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies_ms)

        def pct(q: float) -> float:
            return lat[min(len(lat) - 1, int(q * len(lat)))] if lat else 0.0

        return {
            "mode": "ec",
            "requests": self.requests,
            "verified": self.verified,
            "mismatched": self.mismatched,
            "failed": self.failed,
            "local_hits": self.local_hits,
            "hit_rate": round(self.local_hits / self.requests, 3) if self.requests else 0.0,
            "encoded": self.encoded,
            "reencoded": self.reencoded,
            "bytes": self.bytes,
            "seconds": round(self.seconds, 4),
            "gbps": round(self.bytes / self.seconds / 1e9, 3) if self.seconds else 0.0,
            "p50_ms": round(pct(0.5), 3),
            "p99_ms": round(pct(0.99), 3),
            "failures": self.failures[:10],
        }


def run_ec(
    producer: ECSide,
    consumer: ECSide,
    n: int,
    rng: random.Random,
    *,
    min_bytes: int = 64 << 10,
    max_bytes: int = 8 << 20,
    unique: int | None = None,
    window: int = 8,
    timeout: float = 120.0,
    progress: Any = None,
    name: str = "img",
) -> ECResult:
    """Stream n images through the producer to the consumer; every byte checked. `name`
    prefixes the images' hashes (runs against the same daemons use distinct ones)."""
    res = ECResult(requests=n)
    unique = unique or max(1, n * 3 // 5)
    sizes = {i: rng.randint(min_bytes, max_bytes) for i in range(unique)}
    # a stream with repeats: recent images come back often (as in a chat with images)
    stream = [
        min(unique - 1, int(rng.paretovariate(1.2)) - 1)
        if rng.random() < 0.4
        else rng.randrange(unique)
        for _ in range(n)
    ]
    params: dict[int, wire.ECParams] = {}
    inflight: dict[str, list[tuple[int, float, wire.ECParams]]] = {}
    t0 = time.perf_counter()
    deadline = time.monotonic() + timeout
    pos = done = 0

    def encode(image: int) -> wire.ECParams:
        nbytes = sizes[image]
        mm_hash = f"{name}-{image:05d}"
        blocks = producer.client.ec_allocate(mm_hash, nbytes)
        producer.write(blocks.block_ids, output_bytes(image, nbytes))
        p = producer.client.ec_commit(
            mm_hash, nbytes, shape=(nbytes,), dtype="uint8", compat="ec-demo"
        )
        res.encoded += 1
        return p

    def ensure(image: int) -> None:
        if image not in params:
            params[image] = encode(image)
        p = params[image]
        inflight.setdefault(p.mm_hash, []).append((image, time.perf_counter(), p))
        consumer.client.ec_ensure(p)

    while done < n:
        if time.monotonic() > deadline:
            res.failures.append(f"timed out with {n - done} outputs outstanding")
            break
        while pos < n and sum(len(v) for v in inflight.values()) < window:
            ensure(stream[pos])
            pos += 1
        for ev in consumer.client.wait_events(1.0):
            if not isinstance(ev, (wire.ECReady, wire.ECUnavailable)):
                continue
            waiting = inflight.get(ev.mm_hash)
            if not waiting:
                res.failures.append(f"event for unannounced {ev.mm_hash}")
                continue
            image, started, used = waiting.pop(0)
            if not waiting:
                del inflight[ev.mm_hash]
            if isinstance(ev, wire.ECUnavailable):
                if ev.code == ErrorCode.NOT_FOUND:
                    # the producer evicted it: encode again, as an engine would
                    if params.get(image) is used:
                        res.reencoded += 1
                        del params[image]
                    ensure(image)
                    continue
                res.failed += 1
                res.failures.append(f"{ev.mm_hash}: {ev.reason}")
                done += 1
                continue
            data = output_bytes(image, sizes[image])
            if ev.nbytes == len(data) and consumer.matches(ev.block_ids, data):
                res.verified += 1
                res.bytes += len(data)
                res.latencies_ms.append((time.perf_counter() - started) * 1e3)
            else:
                res.mismatched += 1
                res.failures.append(f"bytes differ for {ev.mm_hash}")
            if ev.local_hit:
                res.local_hits += 1
            consumer.client.ec_release(ev.mm_hash)
            done += 1
            if progress is not None:
                progress()
    res.seconds = time.perf_counter() - t0
    return res
