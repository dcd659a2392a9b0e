"""kvd's KV tiers as a secondary tier of vLLM's `OffloadingConnector`.

vLLM 0.33's `TieringOffloadingSpec` keeps a CPU primary tier and loads secondary tiers by
module path; `KvdTier` is one: the node's kvd daemon keeps the blocks (host memory, then
disk), shared by every engine on the node and surviving engine restarts::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "KvdTier", "module_path": "kvd_client.vllm.tiers",
                             "kvd_socket": "/run/kvd/kvd.sock"}]}}'

What runs where:
- Lookups: vLLM asks `lookup(key)` per chunk on the scheduler thread; it never blocks.
  Keys accumulate during a step, `on_schedule_end` posts them as one batch, a background
  thread asks the daemon in one round trip (`batch_lookup`), and the answers are applied
  before the next step's first lookup (vLLM's `AsyncLookupManager`, `KvdAsyncLookup`).
  A failed or timed-out lookup is a miss.
- Transfers: `submit_store` / `submit_load` queue a job for one worker thread, which hands
  zero-copy slices of vLLM's primary-tier memory straight to the daemon client (the only
  copy is the one between vLLM's memory and the daemon's); `get_finished_jobs` reports
  each job once. A failed load is reported as failed (vLLM recomputes those chunks) and
  its keys are remembered as misses, so vLLM does not promote them again and again.
- The namespace: the daemon keeps each model's blocks under a compatibility hash of the
  model config (`compat_namespace`), so two models never share blocks.
- A daemon that is down, slow or restarting costs misses and failed transfers, never an
  error in the engine and never a hang: every call has a timeout, and after a failure the
  client is dropped and not tried again for `retry_interval` seconds (answers are misses
  meanwhile, at no cost).

This module imports neither vLLM nor the daemon: the parts that subclass vLLM live in
`tier_vllm` and are resolved lazily (`KvdTier`, `KvdAsyncLookup`).
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import math
import queue
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, Protocol

from kvd_client.client import default_socket_path

if TYPE_CHECKING:
    from kvd_client.vllm.tier_vllm import KvdAsyncLookup, KvdTier

log = logging.getLogger("kvd_client.vllm.tiers")

__all__ = [
    "KvdAsyncLookup",
    "KvdTier",
    "RunnerJob",
    "TierConfig",
    "TierTransport",
    "TransferRunner",
    "TransportSlot",
    "compat_namespace",
]

NAMESPACE_VERSION: Final = "kvd-tier-1"
"""Part of every namespace: bump it when the meaning of a stored block changes."""
NAMESPACE_BYTES: Final = 16


class TierTransport(Protocol):
    """The daemon's tier API as the engine sees it (`kvd_client.tiers.TierClient`).

    Blocking; one thread at a time. Every call raises `KvdError` on a failure or timeout.
    """

    def batch_lookup(self, keys: Sequence[bytes]) -> list[bool]: ...

    def store(self, keys: Sequence[bytes], blocks: Sequence[memoryview]) -> list[bool]: ...

    def load(self, keys: Sequence[bytes], dests: Sequence[memoryview]) -> list[bool]: ...

    def stats(self) -> dict[str, Any]: ...

    def close(self) -> None: ...


TransportFactory = Callable[[str, bytes, int, float], TierTransport]
"""(socket path, namespace, block bytes, timeout) -> a connected transport."""


def tier_client_factory(
    socket: str, namespace: bytes, block_bytes: int, timeout: float
) -> TierTransport:
    """The real transport: the thin client's `TierClient`; `timeout` bounds every call
    (lookups and the copies' round trips alike), so shutdown never waits longer."""
    from kvd_client.tiers import TierClient

    return TierClient(socket, namespace, block_bytes, timeout=timeout, io_timeout=timeout)


# ---------------------------------------------------------------------------- config

_KNOWN: Final = frozenset(
    {"kvd_socket", "lookup_timeout", "transfer_timeout", "retry_interval", "namespace_salt"}
)
_VLLM_KEYS: Final = frozenset({"locality", "backpressure"})


@dataclass(frozen=True)
class TierConfig:
    """The tier's own keys in `secondary_tiers[i]` (vLLM passes them to the constructor)."""

    socket: str
    lookup_timeout: float = 1.0
    """Seconds a lookup batch may take; past it the batch is all misses."""
    transfer_timeout: float = 5.0
    """Seconds each round trip of a store or load may take; past it the job fails."""
    retry_interval: float = 5.0
    """Seconds after a failure before the daemon is asked again (misses meanwhile)."""
    namespace_salt: str = ""
    """Mixed into the namespace: engines with different salts never share blocks."""

    @classmethod
    def from_kwargs(cls, kwargs: Mapping[str, Any]) -> TierConfig:
        """Validate the tier config; a bad value raises ValueError naming the key."""
        for key in sorted(kwargs):
            if key not in _KNOWN and key not in _VLLM_KEYS:
                log.warning("kvd: unknown secondary_tiers key %r ignored", key)
        sock = kwargs.get("kvd_socket") or default_socket_path()
        if not isinstance(sock, str):
            raise ValueError(f"secondary_tiers[...]['kvd_socket'] must be a path, got {sock!r}")
        salt = kwargs.get("namespace_salt", "")
        if not isinstance(salt, str):
            raise ValueError(
                f"secondary_tiers[...]['namespace_salt'] must be a string, got {salt!r}"
            )
        return cls(
            socket=sock,
            lookup_timeout=_seconds(kwargs, "lookup_timeout", cls.lookup_timeout),
            transfer_timeout=_seconds(kwargs, "transfer_timeout", cls.transfer_timeout),
            retry_interval=_seconds(kwargs, "retry_interval", cls.retry_interval),
            namespace_salt=salt,
        )


def _seconds(kwargs: Mapping[str, Any], key: str, default: float) -> float:
    v = kwargs.get(key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(
            f"secondary_tiers[...][{key!r}] must be a positive number of seconds, got {v!r}"
        )
    return float(v)


def compat_namespace(fields: Mapping[str, Any]) -> bytes:
    """The daemon namespace of one model configuration: a hash of everything that decides
    what the bytes of a stored block mean (model, dtype, block size, layout, parallelism,
    block bytes). Equal configs give equal namespaces on every engine and every node."""
    canonical = json.dumps(
        {"version": NAMESPACE_VERSION, **fields}, sort_keys=True, separators=(",", ":")
    )
    return hashlib.sha256(canonical.encode()).digest()[:NAMESPACE_BYTES]


# ---------------------------------------------------------------------------- transport slot


class TransportSlot:
    """A transport owned by one thread, connected when first needed and dropped on failure.

    After a failure the slot stays empty for `retry_interval` seconds: `get` returns None
    and the caller answers a miss (or fails the job) without asking the daemon, so a dead
    daemon costs one timeout per interval, not one per step. Time is an argument.
    """

    def __init__(
        self,
        factory: Callable[[], TierTransport],
        retry_interval: float,
        what: str,
    ) -> None:
        self._factory = factory
        self._retry_interval = retry_interval
        self._what = what
        self._transport: TierTransport | None = None
        self._retry_at = -math.inf
        self.failures = 0

    def get(self, now: float) -> TierTransport | None:
        if self._transport is not None:
            return self._transport
        if now < self._retry_at:
            return None
        try:
            self._transport = self._factory()
        except Exception as exc:  # a transport that cannot be built is a failure, not a crash
            self.failed(now, exc)
            return None
        return self._transport

    def failed(self, now: float, exc: BaseException) -> None:
        """Drop the transport after `exc`; ask again after `retry_interval`."""
        self.failures += 1
        if self.failures == 1 or self.failures % 100 == 0:
            log.warning(
                "kvd tier: %s failed (%s: %s); misses for %.1fs",
                self._what,
                type(exc).__name__,
                exc,
                self._retry_interval,
            )
        self.close()
        self._retry_at = now + self._retry_interval

    def close(self) -> None:
        t, self._transport = self._transport, None
        if t is not None:
            try:
                t.close()
            except Exception:
                log.debug("kvd tier: closing the %s transport failed", self._what, exc_info=True)


def lookup_batch(
    slot: TransportSlot, keys: Sequence[bytes], now: Callable[[], float] = time.monotonic
) -> list[bool]:
    """Ask the daemon about `keys` in one round trip; anything but a clean answer is all
    misses (and marks the slot failed)."""
    t = slot.get(now())
    if t is None:
        return [False] * len(keys)
    try:
        hits = list(t.batch_lookup(keys))
        if len(hits) != len(keys):
            raise ValueError(f"{len(hits)} answers for {len(keys)} keys")
        return [h is True for h in hits]
    except Exception as exc:
        slot.failed(now(), exc)
        return [False] * len(keys)


# ---------------------------------------------------------------------------- transfers


@dataclass(frozen=True)
class RunnerJob:
    """One job for the worker thread: chunks at byte offsets of the primary tier."""

    job_id: int
    is_load: bool
    keys: tuple[bytes, ...]
    offsets: tuple[int, ...]


@dataclass(frozen=True)
class TransferOutcome:
    """What became of a job: `done[i]` is whether keys[i] was stored (or loaded)."""

    job_id: int
    is_load: bool
    done: tuple[bool, ...]
    seconds: float
    nbytes: int

    @property
    def success(self) -> bool:
        return all(self.done)


@dataclass
class _Counters:
    submitted: int = 0
    finished: int = 0
    stores_ok: int = 0
    stores_failed: int = 0
    loads_ok: int = 0
    loads_failed: int = 0
    in_flight: set[int] = field(default_factory=set)


class TransferRunner:
    """One worker thread that moves chunks between a flat byte view of vLLM's primary
    tier and the daemon. Loads go first (a request waits for them; a store only fills the
    tier), each kind in submission order.

    `submit` never blocks; `take_finished` returns each job's outcome exactly once;
    `drain` waits until every submitted job has an outcome; `shutdown` lets a running job
    finish (a copy is never abandoned halfway), fails the queued ones and joins the thread.
    """

    def __init__(
        self,
        view: memoryview,
        block_bytes: int,
        slot: TransportSlot,
        *,
        name: str = "kvd_tier_transfers",
        now: Callable[[], float] = time.monotonic,
    ) -> None:
        if view.ndim != 1 or view.itemsize != 1 or not view.contiguous:
            raise ValueError("the primary tier view must be flat, contiguous bytes")
        self._view = view
        self._block_bytes = block_bytes
        self._slot = slot
        self._now = now
        # (priority, sequence, job): loads 0, stores 1, the shutdown sentinel 2 (after
        # everything queued, which it fails).
        self._jobs: queue.PriorityQueue[tuple[int, int, RunnerJob | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._done: queue.SimpleQueue[TransferOutcome] = queue.SimpleQueue()
        self._cond = threading.Condition()
        self._c = _Counters()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ caller side

    def submit(self, job: RunnerJob) -> None:
        if len(job.keys) != len(job.offsets):
            raise ValueError(f"job {job.job_id}: {len(job.keys)} keys, {len(job.offsets)} slots")
        for off in job.offsets:
            if off < 0 or off + self._block_bytes > len(self._view):
                raise ValueError(f"job {job.job_id}: offset {off} is outside the primary tier")
        with self._cond:
            if job.job_id in self._c.in_flight:
                raise ValueError(f"job {job.job_id} submitted twice")
            self._c.in_flight.add(job.job_id)
            self._c.submitted += 1
            stopping = self._stopping
        if stopping:
            self._finish(job, (False,) * len(job.keys), 0.0)
        else:
            self._jobs.put((0 if job.is_load else 1, next(self._seq), job))

    def take_finished(self) -> list[TransferOutcome]:
        out = []
        while True:
            try:
                out.append(self._done.get_nowait())
            except queue.Empty:
                return out

    def pending(self) -> int:
        """Jobs submitted whose outcome has not been produced yet."""
        with self._cond:
            return self._c.submitted - self._c.finished

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has an outcome; False if `timeout` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._c.finished == self._c.submitted, timeout)

    def stats(self) -> dict[str, int]:
        with self._cond:
            c = self._c
            return {
                "jobs_pending": c.submitted - c.finished,
                "stored_blocks": c.stores_ok,
                "store_failures": c.stores_failed,
                "loaded_blocks": c.loads_ok,
                "load_failures": c.loads_failed,
            }

    def shutdown(self) -> None:
        with self._cond:
            self._stopping = True
        self._jobs.put((2, next(self._seq), None))
        self._thread.join()
        self._slot.close()  # the thread is gone: this thread owns the transport now
        self._view.release()  # vLLM unmaps the primary tier only when nothing exports it

    # ------------------------------------------------------------ worker thread

    def _run(self) -> None:
        while True:
            _, _, job = self._jobs.get()
            if job is None:
                return
            with self._cond:
                stopping = self._stopping
            if stopping:
                self._finish(job, (False,) * len(job.keys), 0.0)
                continue
            t0 = self._now()
            done = self._transfer(job)
            self._finish(job, done, self._now() - t0)

    def _transfer(self, job: RunnerJob) -> tuple[bool, ...]:
        miss = (False,) * len(job.keys)
        t = self._slot.get(self._now())
        if t is None:
            return miss
        bb = self._block_bytes
        views = [self._view[off : off + bb] for off in job.offsets]  # zero-copy slices
        try:
            done = t.load(job.keys, views) if job.is_load else t.store(job.keys, views)
            if len(done) != len(job.keys):
                raise ValueError(f"{len(done)} answers for {len(job.keys)} keys")
            return tuple(d is True for d in done)
        except Exception as exc:
            self._slot.failed(self._now(), exc)
            return miss
        finally:
            for v in views:
                v.release()

    def _finish(self, job: RunnerJob, done: tuple[bool, ...], seconds: float) -> None:
        ok = sum(done)
        outcome = TransferOutcome(job.job_id, job.is_load, done, seconds, ok * self._block_bytes)
        with self._cond:
            c = self._c
            if job.is_load:
                c.loads_ok += ok
                c.loads_failed += len(done) - ok
            else:
                c.stores_ok += ok
                c.stores_failed += len(done) - ok
            self._done.put(outcome)  # before `finished` moves: drain() then sees it queued
            c.finished += 1
            c.in_flight.discard(job.job_id)
            self._cond.notify_all()


# ---------------------------------------------------------------------------- lazy vLLM part

_LAZY: Final = frozenset({"KvdTier", "KvdAsyncLookup"})


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from kvd_client.vllm import tier_vllm

        return getattr(tier_vllm, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
