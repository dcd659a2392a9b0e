"""`KvdTier` and `KvdAsyncLookup`: the vLLM 0.33 classes of kvd's secondary tier.

See `kvd_client.vllm.tiers` (this module's vLLM-free half) for how the tier works and how
to configure it. This module imports vLLM; `kvd_client.vllm.tiers` resolves its names
lazily, so vLLM's `SecondaryTierFactory` finds `KvdTier` there by module path.

Threads: vLLM calls every method here under its manager lock, from the scheduler thread
(or its tier-poll thread); `KvdAsyncLookup` owns one background thread for lookups and
`TransferRunner` one for transfers, each with its own daemon session (a lookup never
waits behind a large load).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from functools import partial
from typing import Any, ClassVar

from typing_extensions import override
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvd_client.vllm.tiers import (
    RunnerJob,
    TierConfig,
    TransferRunner,
    TransportFactory,
    TransportSlot,
    compat_namespace,
    lookup_batch,
    tier_client_factory,
)

log = logging.getLogger("kvd_client.vllm.tiers")


class KvdAsyncLookup(AsyncLookupManager):  # type: ignore[misc]
    """vLLM's `AsyncLookupManager` asking the kvd daemon, one round trip per step.

    Everything on the scheduler side (`lookup`, `flush`, `drain_results`, `cleanup`,
    `mark_miss`, `shutdown`) is vLLM's own. Only the worker loop differs: vLLM's calls
    `batch_lookup` once per request of the step; this one sends the whole step's batch
    (keys are already unique: a key is queued only when no state exists for it) in one
    `batch_lookup`, which is one message to the daemon and one answer. A failure or a
    timeout is a miss for every key of the batch.
    """

    def __init__(self, slot: TransportSlot, tier_type: str) -> None:
        self._slot = slot
        self.batches_sent = 0
        super().__init__(tier_type=tier_type)  # starts the worker thread: set state first

    @override
    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        self.batches_sent += 1
        return lookup_batch(self._slot, keys)

    @override
    def _worker(self) -> None:
        while True:
            pending = self._lookup_queue.get()
            if pending is None:
                return
            if not pending:
                continue
            keys = [key for key, _ctx, _gen in pending]
            try:
                hits = list(self.batch_lookup(keys, pending[0][1]))
            except Exception:  # lookup_batch does not raise; a subclass might
                log.warning("kvd tier: batch_lookup raised", exc_info=True)
                hits = [False] * len(keys)
            if len(hits) != len(keys):
                hits = [False] * len(keys)
            self._pending_results.put(
                [(key, gen, hit) for (key, _ctx, gen), hit in zip(pending, hits, strict=True)]
            )

    @override
    def shutdown(self) -> None:
        super().shutdown()
        self._slot.close()  # the worker thread has exited: this thread owns the transport


def namespace_fields(spec: Any, block_bytes: int, salt: str) -> dict[str, Any]:
    """What decides the meaning of a stored chunk, from vLLM's `OffloadingConfig`."""
    cfg = spec.config
    p = cfg.parallel
    return {
        "model": cfg.model.name,
        "dtype": str(cfg.model.dtype),
        "tokens_per_hash": cfg.cache.tokens_per_hash,
        "blocks_per_chunk": cfg.cache.blocks_per_chunk,
        "groups": [[g.tokens_per_block, list(g.layer_names)] for g in cfg.groups],
        "worker_kv_bytes_per_block": cfg.worker_kv_bytes_per_block,
        "chunk_bytes": block_bytes,
        "parallel": [p.tp_size, p.pp_size, p.pcp_size, p.dcp_size, p.world_size],
        "layout": cfg.kv_cache_layout,
        "canonical_layout": bool(cfg.canonical_layout),
        "replicated_layout": bool(cfg.replicated_layout),
        "salt": salt,
    }


class KvdTier(SecondaryTierManager):  # type: ignore[misc]
    """A vLLM secondary tier kept by the node's kvd daemon (see `kvd_client.vllm.tiers`)."""

    medium: ClassVar[Medium] = Medium.CPU

    def __init__(
        self,
        offloading_spec: Any,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: Any = None,
        *,
        transport_factory: TransportFactory | None = None,
        **config: Any,
    ) -> None:
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.config = TierConfig.from_kwargs(config)
        locality = config.get("locality")
        self.locality = Locality(locality) if locality is not None else Locality.LOCAL
        self.namespace = compat_namespace(
            namespace_fields(offloading_spec, self.block_size_bytes, self.config.namespace_salt)
        )
        factory = transport_factory or tier_client_factory
        c = self.config

        def slot(timeout: float, what: str) -> TransportSlot:
            connect = partial(factory, c.socket, self.namespace, self.block_size_bytes, timeout)
            return TransportSlot(connect, c.retry_interval, what)

        # vLLM addresses chunk `b` as primary_kv_view[b] (rows of block_size_bytes); the
        # runner slices a flat byte view of the same memory, without copying.
        flat = primary_kv_view.cast("B")
        self._runner = TransferRunner(
            flat,
            self.block_size_bytes,
            slot(c.transfer_timeout, "transfer"),
            name=f"kvd_tier_transfers_{tier_type}",
        )
        self._lookups = KvdAsyncLookup(slot(c.lookup_timeout, "lookup"), tier_type)
        self._load_keys: dict[int, tuple[OffloadKey, ...]] = {}
        self._store_keys: dict[int, tuple[OffloadKey, ...]] = {}
        self._closed = False
        log.info(
            "kvd tier %s: socket %s, namespace %s, %d-byte chunks",
            tier_type,
            c.socket,
            self.namespace.hex(),
            self.block_size_bytes,
        )

    # ------------------------------------------------------------ lookups

    @override
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        found = self._lookups.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    @override
    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    @override
    def on_request_finished(self, req_context: ReqContext) -> None:
        self._lookups.cleanup(req_context.req_id)

    @override
    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._lookups.flush()

    # ------------------------------------------------------------ transfers

    def _offsets(self, job: TransferJob) -> tuple[int, ...]:
        bb = self.block_size_bytes
        return tuple(int(c) * bb for c in job.chunk_ids)

    @override
    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = tuple(job_metadata.keys)
        self._store_keys[job_metadata.job_id] = keys
        self._runner.submit(
            RunnerJob(job_metadata.job_id, False, keys, self._offsets(job_metadata))
        )

    @override
    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = tuple(job_metadata.keys)
        self._load_keys[job_metadata.job_id] = keys
        self._runner.submit(RunnerJob(job_metadata.job_id, True, keys, self._offsets(job_metadata)))

    @override
    def get_finished_jobs(self) -> Iterable[JobResult]:
        results = []
        for o in self._runner.take_finished():
            keys = (self._load_keys if o.is_load else self._store_keys).pop(o.job_id)
            successful = None
            if o.is_load and not o.success:
                failed = [k for k, d in zip(keys, o.done, strict=True) if not d]
                # vLLM caches the lookup's True: without this it would promote the same
                # missing chunk again on every step (vLLM #49176).
                self._lookups.mark_miss(failed)
                ok = tuple(k for k, d in zip(keys, o.done, strict=True) if d)
                successful = ok or None
            results.append(
                JobResult(
                    job_id=o.job_id,
                    success=o.success,
                    successful_keys=successful,
                    transfer_time=o.seconds,
                    transfer_bytes=o.nbytes or None,
                )
            )
        return results

    @override
    def has_pending_work(self) -> bool:
        return bool(self._load_keys or self._store_keys)

    @override
    def drain_jobs(self) -> None:
        self._runner.drain()

    # ------------------------------------------------------------ lifecycle

    def stats(self) -> dict[str, Any]:
        """Counters of this tier (lookup batches, transfers)."""
        return {
            "lookup_batches": self._lookups.batches_sent,
            "jobs_unreported": len(self._load_keys) + len(self._store_keys),
            **self._runner.stats(),
        }

    @override
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        t0 = time.monotonic()
        self._lookups.shutdown()
        self._runner.shutdown()
        log.info("kvd tier %s: stopped in %.3fs", self.tier_type, time.monotonic() - t0)
