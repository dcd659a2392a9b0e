"""An engine instance for tier tests: vLLM 0.33's real Scheduler with its real
`OffloadingConnector`, `TieringOffloadingSpec` and CPU primary tier (shared-memory
region), and `KvdTier` as the secondary tier, loaded by vLLM's factory by module path.

The only part played by the test is the one that needs a GPU: the copies between the KV
cache and the primary tier. vLLM's `CPUOffloadingWorker` refuses CPU tensors (CUDA
streams), so `CpuTieringSpec` (the real `TieringOffloadingSpec` with `get_worker`
overridden) hands vLLM's real `OffloadingConnectorWorker` a `CpuCopyWorker`, which copies
each KV page into the worker's real view of the shared primary region, exactly where
vLLM's worker would. Everything the scheduler and the tier do is vLLM's and kvd's own.

`step()` runs one engine step in vLLM's order (as `KVConnectorModelRunnerMixin` does) and
fills the KV of every computed position with a pattern of (instance salt, prompt prefix,
position, layer); a request whose KV was loaded is checked at `finished_recving`, before
it runs again, against the salt of the instance that computed it.
"""

from __future__ import annotations

import os
import secrets
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache
from vllm_harness import BLOCK_SIZE, EOS, NUM_LAYERS, TOKEN, kv_pattern

TIER = {"type": "KvdTier", "module_path": "kvd_client.vllm.tiers"}


class CpuCopyWorker(OffloadingWorker):  # type: ignore[misc]
    """vLLM's CPU offloading worker with the GPU copies done by torch on the CPU."""

    def __init__(self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: Any) -> None:
        assert blocks_per_chunk == 1, "the test worker copies one KV block per chunk"
        self.region = region
        self.pairs: list[tuple[torch.Tensor, torch.Tensor]] = []
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            kv = t.tensor.view(torch.int8).view(-1, page)
            self.pairs.append((kv, region.create_next_worker_view(page)))
        self.done: list[TransferResult] = []

    def _copy(self, job_id: int, kv_blocks: Any, chunks: Any, to_cpu: bool) -> bool:
        t0 = time.monotonic()
        n = 0
        for b, c in zip(kv_blocks.tolist(), chunks.tolist(), strict=True):
            for kv, cpu in self.pairs:
                if to_cpu:
                    cpu[c].copy_(kv[b])
                else:
                    kv[b].copy_(cpu[c])
                n += kv.shape[1]
        self.done.append(TransferResult(job_id, True, n, time.monotonic() - t0))
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._copy(job_id, src_spec.block_ids, dst_spec.block_ids, True)

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        return self._copy(job_id, dst_spec.block_ids, src_spec.block_ids, False)

    def get_finished(self) -> list[TransferResult]:
        out, self.done = self.done, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return None

    def shutdown(self) -> None:
        self.pairs.clear()
        self.region.cleanup()


class CpuTieringSpec(TieringOffloadingSpec):  # type: ignore[misc]
    """vLLM's TieringOffloadingSpec, with a worker that runs without a GPU."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if not self._worker:
            region = SharedOffloadRegion(
                engine_id=self._engine_id,
                num_chunks=self.num_chunks,
                rank=0,
                kv_bytes_per_chunk=self.kv_bytes_per_chunk,
                cpu_page_size=self.cpu_page_size_per_worker,
            )
            self._worker = CpuCopyWorker(kv_caches, self.blocks_per_chunk, region)
        return self._worker


def offload_extra(socket: str, *, cpu_chunks: int = 64, **tier: Any) -> dict[str, Any]:
    """`kv_connector_extra_config` of an OffloadingConnector with KvdTier as its tier."""
    return {
        "spec_name": "CpuTieringSpec",
        "spec_module_path": "vllm_tier_harness",
        "cpu_bytes_to_use": cpu_chunks * 4096,
        # The tier-poll thread would service the tiers between steps; off, every call
        # comes from the scheduler thread and a test's step order is deterministic.
        "tier_poll_interval_s": 0,
        "secondary_tiers": [{**TIER, "kvd_socket": socket, **tier}],
    }


@dataclass
class Engine:
    name: str
    salt: str
    vllm_config: VllmConfig
    scheduler: Scheduler
    worker: Any
    kv: dict[str, torch.Tensor]
    async_depth: int = 1
    outputs: dict[str, list[Any]] = field(default_factory=dict)
    finished: dict[str, Any] = field(default_factory=dict)
    matched: list[tuple[str, int | None, bool]] = field(default_factory=list)
    """Every answer of the connector's get_num_new_matched_tokens: (request, n, async)."""
    computed: dict[str, set[int]] = field(default_factory=dict)
    """Positions the fake model computed, per request."""
    verify: dict[str, str] = field(default_factory=dict)
    """Request -> salt of the instance whose KV it should load."""
    loaded: dict[str, int] = field(default_factory=dict)
    """Request -> positions checked against the loading salt at finished_recving."""
    queue: deque[tuple[Any, Any]] = field(default_factory=deque)
    errors: list[str] = field(default_factory=list)

    @property
    def connector(self) -> Any:
        return self.scheduler.connector

    def add(
        self,
        rid: str,
        prompt: Sequence[int],
        *,
        max_tokens: int = 2,
        params: dict[str, Any] | None = None,
    ) -> Request:
        sp = SamplingParams(
            max_tokens=max_tokens,
            extra_args={"kv_transfer_params": params} if params else None,
        )
        sp.update_from_generation_config({}, EOS)
        req = Request(
            request_id=rid,
            prompt_token_ids=list(prompt),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=get_request_block_hasher(BLOCK_SIZE, sha256),
        )
        self.scheduler.add_request(req)
        return req

    def busy(self) -> bool:
        return self.scheduler.has_requests() or bool(self.queue)

    def step(self) -> None:
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            self.queue.append((so, self._run_worker(so)))
            if len(self.queue) < self.async_depth:
                return
        if self.queue:
            so, mro = self.queue.popleft()
            for outs in self.scheduler.update_from_output(so, mro).values():
                for o in outs.outputs:
                    self.outputs.setdefault(o.request_id, []).append(o)
                    if o.finish_reason is not None:
                        self.finished[o.request_id] = o

    def run(self, until: Callable[[], bool] | None = None, timeout: float = 30.0) -> int:
        """Step until idle (or `until()`), pausing 2 ms between steps as an idle engine
        loop would; returns the number of steps."""
        deadline = time.monotonic() + timeout
        n = 0
        while not (until() if until else not self.busy()):
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: still busy after {timeout}s ({n} steps)")
            self.step()
            n += 1
            time.sleep(0.002)
        return n

    def _run_worker(self, so: Any) -> ModelRunnerOutput:
        w = self.worker
        meta = so.kv_connector_metadata
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        if so.has_sync_kv_loads:
            w.start_load_kv(None)
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled: dict[str, list[int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            self._forward(req, starts[rid], n)
            sampled[rid] = [TOKEN] if starts[rid] + n >= req.num_prompt_tokens else []
        if not so.has_sync_kv_loads:
            w.start_load_kv(None)
        for name, t in self.kv.items():
            w.save_kv_layer(name, t, None)
        w.wait_for_save()
        res = w.get_transfer_results(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        worker_meta = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        for rid in res.finished_recving - res.failed_recving:
            if rid in self.scheduler.requests:
                self._check_loaded(rid)
        ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[sampled[r] for r in ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=res.finished_sending or None,
                finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving,
                invalid_block_ids=invalid,
                kv_connector_worker_meta=worker_meta,
            ),
        )

    def _forward(self, req: Request, start: int, n: int) -> None:
        blocks = self.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0]
        prompt = req.prompt_token_ids
        assert prompt is not None
        done = self.computed.setdefault(req.request_id, set())
        for pos in range(start, start + n):
            b, slot = blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            done.add(pos)
            for layer, t in enumerate(self.kv.values()):
                t[b, :, slot, :] = kv_pattern(
                    self.salt, prompt, pos, layer, (t.shape[1], t.shape[3])
                )

    def _check_loaded(self, rid: str) -> None:
        """At finished_recving: every loaded position holds the storing instance's KV."""
        if rid not in self.verify:
            return
        salt = self.verify[rid]
        req = self.scheduler.requests[rid]
        prompt = req.prompt_token_ids
        assert prompt is not None
        blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
        computed = self.computed.get(rid, set())
        n = 0
        for pos in range(req.num_computed_tokens):
            if pos in computed:
                continue
            b, slot = blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            for layer, t in enumerate(self.kv.values()):
                want = kv_pattern(salt, prompt, pos, layer, (t.shape[1], t.shape[3]))
                got = t[b, :, slot, :]
                if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                    self.errors.append(f"{self.name}: {rid} pos {pos} layer {layer} differs")
                    return
            n += 1
        self.loaded[rid] = self.loaded.get(rid, 0) + n

    def held_blocks(self) -> int:
        pool = self.scheduler.kv_cache_manager.block_pool
        return int(pool.num_gpu_blocks - 1 - pool.free_block_queue.num_free_blocks)

    def assert_idle(self) -> None:
        """No request, no held KV block, no offloading job or tier job left."""
        s = self.scheduler
        assert not s.requests and not s.has_requests(), f"{self.name}: {list(s.requests)}"
        assert self.held_blocks() == 0, f"{self.name}: {self.held_blocks()} blocks held"
        manager = offloading(self).connector_scheduler.manager
        assert not manager.has_pending_work(), f"{self.name}: offloading work left"
        for sub in getattr(s.connector, "sub_connectors", []):
            if type(sub).__name__ != "KvdConnector":
                continue
            side = sub.scheduler_side  # as vllm_harness.Instance.assert_idle checks it
            deadline = time.monotonic() + 5
            while side._d and time.monotonic() < deadline:
                side.has_pending_push_work()
                time.sleep(0.01)
            assert not side._d and not side._p and not side._sending, self.name
        assert not self.errors, self.errors

    def close(self) -> None:
        self.connector.shutdown()
        self.worker.shutdown()


def make_engine(
    name: str,
    model: str,
    extra: dict[str, Any],
    *,
    connector: str = "OffloadingConnector",
    module_path: str | None = None,
    num_blocks: int = 64,
    async_scheduling: bool = False,
    salt: str | None = None,
    kv_role: str = "kv_both",
) -> Engine:
    mc = ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024)
    sc = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=1024,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
    )
    cc = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    cc.kv_cache_layout = "LBHNC"  # what OffloadingConnector asks for
    kt = KVTransferConfig(
        kv_connector=connector,
        kv_connector_module_path=module_path,
        kv_role=kv_role,
        engine_id=f"engine-{name}-{secrets.token_hex(3)}",
        kv_connector_extra_config=extra,
        kv_load_failure_policy="recompute",
    )
    vc = VllmConfig(
        model_config=mc,
        scheduler_config=sc,
        cache_config=cc,
        kv_transfer_config=kt,
        device_config=DeviceConfig("cpu"),
    )
    spec = FullAttentionSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=mc.get_num_kv_heads(vc.parallel_config),
        head_size=mc.get_head_size(),
        dtype=torch.bfloat16,
    )
    layers = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
    kcc = get_kv_cache_config_from_groups(
        vc, [KVCacheGroupSpec(layers, spec)], num_blocks * spec.page_size_bytes * NUM_LAYERS
    )
    vc.cache_config.num_gpu_blocks = kcc.num_blocks
    kv = allocate_kv_cache(kcc, torch.device("cpu"), cc.get_resolved_kv_cache_layout())
    worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kcc)
    worker.register_kv_caches(kv)
    cls = AsyncScheduler if async_scheduling else Scheduler
    sched = cls(
        vllm_config=vc,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BLOCK_SIZE,
    )
    eng = Engine(
        name,
        salt or f"salt-{name}",
        vc,
        sched,
        worker,
        kv,
        async_depth=2 if async_scheduling else 1,
    )
    _spy_matches(eng)
    return eng


def multi_extra(socket: str, **tier: Any) -> dict[str, Any]:
    """vLLM's MultiConnector: KvdConnector (P/D) first, then OffloadingConnector with
    KvdTier, both on the node's one daemon."""
    return {
        "connectors": [
            {
                "kv_connector": "KvdConnector",
                "kv_connector_module_path": "kvd_client.vllm",
                "kv_role": "kv_both",
                "kv_connector_extra_config": {"kvd_socket": socket, "transfer_mode": "pull"},
            },
            {
                "kv_connector": "OffloadingConnector",
                "kv_role": "kv_both",
                "kv_connector_extra_config": offload_extra(socket, **tier),
            },
        ]
    }


def offloading(eng: Engine) -> Any:
    """The scheduler-side OffloadingConnector of `eng` (alone or inside a MultiConnector)."""
    c = eng.scheduler.connector
    for sub in getattr(c, "sub_connectors", [c]):
        if type(sub).__name__ == "OffloadingConnector":
            return sub
    raise AssertionError("no OffloadingConnector")


def _spy_matches(eng: Engine) -> None:
    """Record every answer of the scheduler-side connector's get_num_new_matched_tokens."""
    c = eng.scheduler.connector
    real = c.get_num_new_matched_tokens

    def spy(request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        n, is_async = real(request, num_computed_tokens)
        eng.matched.append((request.request_id, n, is_async))
        return n, is_async

    c.get_num_new_matched_tokens = spy


def offload_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("vllm_offload_")}


def waiting(eng: Engine, rid: str) -> bool:
    req = eng.scheduler.requests.get(rid)
    return req is not None and req.status in (
        RequestStatus.WAITING,
        RequestStatus.WAITING_FOR_REMOTE_KVS,
    )
