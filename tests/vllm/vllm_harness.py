"""A P or D vLLM instance for tests: vLLM 0.33's real Scheduler and KvdConnector, with the
test playing the model runner.

Each `Instance` is one engine: a real `Scheduler` (or `AsyncScheduler`) whose connector
vLLM's factory loads by module path, the worker-side connector the factory builds for
rank 0, and CPU KV tensors allocated by vLLM's own `allocate_kv_cache` from a
`KVCacheConfig` its planner made. `step()` runs one engine step in vLLM's order:
schedule -> (worker) handle_preemptions, bind_connector_metadata, the forward (the test
writes a known KV pattern into every slot it computes), start_load_kv, wait_for_save,
get_transfer_results, get_block_ids_with_load_errors, clear_connector_metadata ->
update_from_output. Before a received request is handed back to the scheduler its KV
bytes are checked against the sender's pattern.
"""

from __future__ import annotations

import secrets
import time
import zlib
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from kvd_client.vllm import KvdConnector
from transformers import LlamaConfig
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
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

BLOCK_SIZE = 16
NUM_LAYERS = 2
EOS = 50256
TOKEN = 7  # what the fake model samples

init_none_hash(sha256)


def write_model(path: Path) -> str:
    """A tiny local Llama config (no weights, no tokenizer): all the Scheduler needs."""
    LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(path)
    return str(path)


def kv_pattern(
    salt: str, prompt: Sequence[int], pos: int, layer: int, shape: tuple[int, ...]
) -> torch.Tensor:
    """The KV a model computes at `pos` (a function of the tokens up to it), per instance salt."""
    key = zlib.crc32(f"{salt}/{layer}/{pos}".encode())
    key = zlib.crc32(bytes(str(list(prompt[: pos + 1])), "ascii"), key)
    g = torch.Generator().manual_seed(key)
    return torch.randn(shape, generator=g).to(torch.bfloat16)


@dataclass
class Instance:
    name: str
    engine_id: str
    salt: str
    vllm_config: VllmConfig
    scheduler: Scheduler
    worker: KvdConnector
    kv: dict[str, torch.Tensor]
    outputs: dict[str, list[Any]] = field(default_factory=dict)
    finished: dict[str, Any] = field(default_factory=dict)
    waited_remote: set[str] = field(default_factory=set)
    received: dict[str, list[int]] = field(default_factory=dict)
    failed_recv: set[str] = field(default_factory=set)
    sent: set[str] = field(default_factory=set)
    verify: dict[str, tuple[str, int]] = field(default_factory=dict)
    """D request id -> (salt of P's KV, first loaded position) to check at finished_recving."""
    queue: deque[tuple[Any, Any]] = field(default_factory=deque)
    async_depth: int = 1
    errors: list[str] = field(default_factory=list)

    @property
    def connector(self) -> KvdConnector:
        c = self.scheduler.connector
        assert isinstance(c, KvdConnector)
        return c

    # ------------------------------------------------------------------ requests

    def add(
        self,
        rid: str,
        prompt: Sequence[int],
        *,
        max_tokens: int,
        params: dict[str, Any] | None,
        skip_prefix_cache: bool = False,
    ) -> Request:
        sp = SamplingParams(
            max_tokens=max_tokens,
            extra_args={"kv_transfer_params": params} if params else None,
            skip_reading_prefix_cache=skip_prefix_cache or None,
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

    def abort(self, rid: str) -> None:
        self.scheduler.finish_requests(rid, RequestStatus.FINISHED_ABORTED)

    # ------------------------------------------------------------------ one engine step

    def busy(self) -> bool:
        return self.scheduler.has_requests() or bool(self.queue)

    def step(self) -> None:
        if self.scheduler.has_requests():
            so = self.scheduler.schedule()
            for rid in so.num_scheduled_tokens:
                assert self.scheduler.requests[rid].status != RequestStatus.WAITING_FOR_REMOTE_KVS
            for req in self.scheduler.requests.values():
                if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                    self.waited_remote.add(req.request_id)
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

    def _run_worker(self, so: Any) -> ModelRunnerOutput:
        w = self.worker
        meta = so.kv_connector_metadata
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        if so.has_sync_kv_loads:
            w.start_load_kv(None)
        sampled: dict[str, list[int]] = {}
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            self._forward(req, starts[rid], n)
            done = starts[rid] + n >= req.num_prompt_tokens
            sampled[rid] = [TOKEN] if done else []
        if not so.has_sync_kv_loads:
            w.start_load_kv(None)
        for name, t in self.kv.items():  # leaving each attention layer, in model order
            w.save_kv_layer(name, t, None)
        w.wait_for_save()
        res = w.get_transfer_results(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        for rid in res.finished_recving - res.failed_recving:
            self._check_received(rid)
        self.failed_recv |= res.failed_recving
        self.sent |= res.finished_sending
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
            ),
        )

    def _forward(self, req: Request, start: int, n: int) -> None:
        """The fake model: KV for positions [start, start+n) into the request's slots."""
        blocks = self.scheduler.kv_cache_manager.get_block_ids(req.request_id)[0]
        prompt = req.prompt_token_ids
        assert prompt is not None
        for pos in range(start, start + n):
            b, slot = blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            for layer, t in enumerate(self.kv.values()):
                t[b, :, slot, :] = kv_pattern(
                    self.salt, prompt, pos, layer, (t.shape[1], t.shape[3])
                )

    def _check_received(self, rid: str) -> None:
        """At finished_recving, before the request runs again: D's KV holds exactly P's bytes."""
        req = self.scheduler.requests[rid]
        blocks = self.scheduler.kv_cache_manager.get_block_ids(rid)[0]
        self.received[rid] = list(blocks)
        if rid not in self.verify:
            return
        salt, first = self.verify[rid]
        prompt = req.prompt_token_ids
        assert prompt is not None
        for pos in range(len(prompt)):
            b, slot = blocks[pos // BLOCK_SIZE], pos % BLOCK_SIZE
            for layer, t in enumerate(self.kv.values()):
                want_salt = salt if pos >= first else self.salt
                want = kv_pattern(want_salt, prompt, pos, layer, (t.shape[1], t.shape[3]))
                got = t[b, :, slot, :]
                if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                    self.errors.append(
                        f"{self.name}: {rid} position {pos} layer {layer} differs from {want_salt}"
                    )
                    return

    def held_blocks(self) -> int:
        pool = self.scheduler.kv_cache_manager.block_pool
        return pool.num_gpu_blocks - 1 - pool.free_block_queue.num_free_blocks

    def assert_idle(self) -> None:
        """No request, no held block, no connector state left (vLLM's own leak checks)."""
        s = self.scheduler
        assert not s.requests, f"{self.name}: requests left {list(s.requests)}"
        assert len(s.waiting) == 0 and not s.running, self.name
        assert not s.finished_recving_kv_req_ids and not s.failed_recving_kv_req_ids, self.name
        assert self.held_blocks() == 0, f"{self.name}: {self.held_blocks()} blocks still held"
        side = self.connector.scheduler_side
        deadline = time.monotonic() + 5  # an orphaned empty transfer ends when its event arrives
        while side._d and time.monotonic() < deadline:
            side.has_pending_push_work()
            time.sleep(0.01)
        assert not side._d and not side._p and not side._sending, (side._d, side._p, side._sending)
        assert not self.errors, self.errors

    def close(self) -> None:
        self.connector.shutdown()
        self.worker.shutdown()


def make_instance(
    name: str,
    socket: str,
    model: str,
    *,
    mode: str = "pull",
    num_blocks: int = 96,
    layout: str = "LBNHC",
    async_scheduling: bool = False,
    failure_policy: str = "fail",
    extra: dict[str, Any] | None = None,
) -> Instance:
    mc = ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024)
    sc = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=1024,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
    )
    cc = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=True)
    cc.kv_cache_layout = layout
    kt = KVTransferConfig(
        kv_connector="KvdConnector",
        kv_connector_module_path="kvd_client.vllm",
        kv_role="kv_both",
        engine_id=f"engine-{name}-{secrets.token_hex(3)}",
        kv_connector_extra_config={"kvd_socket": socket, "transfer_mode": mode, **(extra or {})},
        kv_load_failure_policy=failure_policy,
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
    assert kcc.num_blocks == num_blocks
    vc.cache_config.num_gpu_blocks = kcc.num_blocks
    kv = allocate_kv_cache(kcc, torch.device("cpu"), cc.get_resolved_kv_cache_layout())
    # Workers come first, as in vLLM (the scheduler is built after KV allocation).
    worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kcc)
    assert isinstance(worker, KvdConnector)
    worker.register_kv_caches(kv)
    cls = AsyncScheduler if async_scheduling else Scheduler
    sched = cls(
        vllm_config=vc,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BLOCK_SIZE,
    )
    return Instance(
        name,
        kt.engine_id or "",
        f"salt-{name}",
        vc,
        sched,
        worker,
        kv,
        async_depth=2 if async_scheduling else 1,
    )
