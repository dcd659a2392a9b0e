"""A hybrid P or D vLLM instance for tests: vLLM 0.33's real Scheduler with a hybrid
KVCacheConfig (full attention + sliding window + Mamba-style state, vLLM's own planner
and allocator), KvdConnector loaded by module path, the test playing the model runner.

The fake model writes, at every computed position, a known KV pattern into the full and
sliding-window layers' slots, and after every step a known state (a function of the
tokens so far) into the request's state slot of each Mamba layer. At finished_recving D's
tensors are checked: full layers hold P's KV for every loaded position, window layers for
every position inside the window, Mamba layers P's state after the loaded tokens.
"""

from __future__ import annotations

import secrets
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from kvd_client.vllm import KvdConnector
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
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.request import Request
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache
from vllm_harness import BLOCK_SIZE, Instance, kv_pattern

WINDOW = 40
"""Sliding window in tokens (the last 39 tokens of a request matter)."""
GROUPS = {
    "full": ["model.layers.0.self_attn.attn", "model.layers.3.self_attn.attn"],
    "window": ["model.layers.1.self_attn.attn", "model.layers.4.self_attn.attn"],
    "state": ["model.layers.2.mixer", "model.layers.5.mixer"],
}


def state_pattern(salt: str, prompt: Sequence[int], upto: int, layer: str, n: int) -> torch.Tensor:
    """A Mamba layer's state after the first `upto` tokens: `n` bytes (int8)."""
    key = zlib.crc32(f"{salt}/{layer}/{upto}".encode())
    key = zlib.crc32(bytes(str(list(prompt[:upto])), "ascii"), key)
    g = torch.Generator().manual_seed(key)
    return torch.randint(-128, 128, (n,), generator=g, dtype=torch.int8)


@dataclass
class HybridInstance(Instance):
    group_of: dict[str, int] | None = None
    """Layer name -> its KV cache group."""

    def _groups(self, rid: str) -> tuple[list[int], ...]:
        return self.scheduler.kv_cache_manager.get_block_ids(rid)

    def _state_slot(self, ids: list[int]) -> int:
        null = self.scheduler.kv_cache_manager.block_pool.null_block.block_id
        real = [b for b in ids if b != null]
        assert real, "a request without a state slot"
        return real[-1]

    def _forward(self, req: Request, start: int, n: int) -> None:
        blocks = self._groups(req.request_id)
        prompt = req.prompt_token_ids
        assert prompt is not None and self.group_of is not None
        for name, t in self.kv.items():
            g = self.group_of[name]
            if name.endswith("mixer"):
                slot = self._state_slot(blocks[g])
                t[slot].view(-1)[:] = state_pattern(
                    self.salt, prompt, start + n, name, t[slot].numel()
                )
                continue
            for pos in range(start, start + n):
                b, s = blocks[g][pos // BLOCK_SIZE], pos % BLOCK_SIZE
                t[b, :, s, :] = kv_pattern(
                    self.salt, prompt, pos, zlib.crc32(name.encode()) % 97, (t.shape[1], t.shape[3])
                )

    def _check_received(self, rid: str) -> None:
        req = self.scheduler.requests[rid]
        blocks = self._groups(rid)
        self.received[rid] = [b for part in blocks for b in part]
        if rid not in self.verify:
            return
        salt, first = self.verify[rid]
        prompt = req.prompt_token_ids
        assert prompt is not None and self.group_of is not None
        loaded = req.num_computed_tokens  # P's tokens: the prompt less the one D computes
        if loaded != len(prompt) - 1:
            self.errors.append(f"{self.name}: {rid} loaded {loaded} of {len(prompt)} tokens")
            return
        for name, t in self.kv.items():
            g = self.group_of[name]
            if name.endswith("mixer"):
                slot = self._state_slot(blocks[g])
                want = state_pattern(salt, prompt, loaded, name, t[slot].numel())
                if not torch.equal(t[slot].reshape(-1), want):
                    self.errors.append(f"{self.name}: {rid} state of {name} differs")
                continue
            lo = first if g == 0 else max(first, loaded - WINDOW + 1)  # window: its tokens
            for pos in range(lo, loaded):
                b, s = blocks[g][pos // BLOCK_SIZE], pos % BLOCK_SIZE
                want = kv_pattern(
                    salt, prompt, pos, zlib.crc32(name.encode()) % 97, (t.shape[1], t.shape[3])
                )
                if not torch.equal(t[b, :, s, :].view(torch.int16), want.view(torch.int16)):
                    self.errors.append(f"{self.name}: {rid} position {pos} of {name} differs")
                    return


def make_hybrid_instance(
    name: str, socket: str, model: str, *, mode: str = "pull", num_blocks: int = 128
) -> HybridInstance:
    mc = ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024)
    sc = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=1024,
        is_encoder_decoder=False,
    )
    cc = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False)
    cc.kv_cache_layout = "LBNHC"
    kt = KVTransferConfig(
        kv_connector="KvdConnector",
        kv_connector_module_path="kvd_client.vllm",
        kv_role="kv_both",
        engine_id=f"engine-{name}-{secrets.token_hex(3)}",
        kv_connector_extra_config={"kvd_socket": socket, "transfer_mode": mode},
    )
    vc = VllmConfig(
        model_config=mc,
        scheduler_config=sc,
        cache_config=cc,
        kv_transfer_config=kt,
        device_config=DeviceConfig("cpu"),
    )
    heads, size = mc.get_num_kv_heads(vc.parallel_config), mc.get_head_size()
    full = FullAttentionSpec(
        block_size=BLOCK_SIZE, num_kv_heads=heads, head_size=size, dtype=torch.bfloat16
    )
    swa = SlidingWindowSpec(
        block_size=BLOCK_SIZE,
        num_kv_heads=heads,
        head_size=size,
        dtype=torch.bfloat16,
        sliding_window=WINDOW,
    )
    mamba = MambaSpec(
        block_size=BLOCK_SIZE,
        shapes=((4, 32), (2, 16, 8)),
        dtypes=(torch.bfloat16, torch.bfloat16),
        page_size_padded=full.page_size_bytes,
    )
    specs = {"full": full, "window": swa, "state": mamba}
    groups = [KVCacheGroupSpec(GROUPS[k], specs[k]) for k in ("full", "window", "state")]
    kcc = get_kv_cache_config_from_groups(vc, groups, num_blocks * full.page_size_bytes * 2)
    vc.cache_config.num_gpu_blocks = kcc.num_blocks
    kv = allocate_kv_cache(kcc, torch.device("cpu"), cc.get_resolved_kv_cache_layout())
    worker = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kcc)
    assert isinstance(worker, KvdConnector)
    worker.register_kv_caches(kv)
    sched = Scheduler(
        vllm_config=vc,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BLOCK_SIZE,
    )
    group_of = {layer: i for i, g in enumerate(groups) for layer in g.layer_names}
    inst = HybridInstance(
        name, kt.engine_id or "", f"salt-{name}", vc, sched, worker, kv, group_of=group_of
    )
    return inst


def kv_groups(inst: Any) -> Any:
    return inst.scheduler.kv_cache_config.kv_cache_groups
