"""A P or D vLLM engine at TP >= 1 for tests: vLLM 0.33's real Scheduler with one
scheduler-side KvdConnector and one worker-side KvdConnector per TP rank, all in this
process, the test playing the model runner and vLLM's executor.

Every rank has its own KV tensors (vLLM's `allocate_kv_cache` from the engine's
KVCacheConfig, that rank's heads: max(1, KV heads // TP)), its own worker connector built
by vLLM's factory while `get_tensor_model_parallel_rank()` says its rank, and its own
daemon session. A step runs vLLM's order on every rank (handle_preemptions,
bind_connector_metadata, the forward, start_load_kv, save_kv_layer per layer,
wait_for_save, get_transfer_results, clear_connector_metadata); the ranks' outputs go
through vLLM's own `KVOutputAggregator` (an id is finished once every rank reported it)
into `update_from_output`.

The fake forward writes, at every computed position, each global KV head's pattern (a
function of the tokens so far, the layer, the head and the engine's salt) into the rank
that holds that head; Mamba-style state layers get a per-rank pattern of the state after
the step. When P's request finishes, the reference is read back from P's own tensors
(numpy, P's block ids and block size, heads gathered from every P rank). When D's
aggregated output reports the request received, every D rank's tensors are compared with
that reference: every loaded position of every head it holds (a window group's positions
inside the window; a state layer's slot with P's same rank).
"""

from __future__ import annotations

import secrets
import time
import zlib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import vllm.distributed.parallel_state as parallel_state
from kvd_client.vllm import KvdConnector
from transformers import LlamaConfig
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    ParallelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.utils import KVOutputAggregator
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
from vllm.model_executor.layers.mamba.mamba_utils import MambaStateShapeCalculator
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager
from vllm.v1.worker.utils import allocate_kv_cache

EOS = 50256
TOKEN = 7
KV_HEADS = 4
HEAD_SIZE = 16
WINDOW = 40
PLAIN_LAYERS = [f"model.layers.{i}.self_attn.attn" for i in range(2)]
HYBRID_GROUPS = {
    "full": ["model.layers.0.self_attn.attn", "model.layers.3.self_attn.attn"],
    "window": ["model.layers.1.self_attn.attn", "model.layers.4.self_attn.attn"],
    "state": ["model.layers.2.mixer", "model.layers.5.mixer"],
}

init_none_hash(sha256)


def write_model(path: Path, kv_heads: int = KV_HEADS) -> str:
    """A tiny local Llama config with `kv_heads` KV heads of HEAD_SIZE (no weights)."""
    LlamaConfig(
        vocab_size=128,
        hidden_size=8 * HEAD_SIZE,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=kv_heads,
        max_position_embeddings=2048,
        architectures=["LlamaForCausalLM"],
    ).save_pretrained(path)
    return str(path)


def heads_of(total: int, tp: int, rank: int) -> tuple[int, int]:
    """(first global KV head, count) of `rank` (vLLM's split; replicated when total < tp)."""
    if total >= tp:
        return rank * total // tp, total // tp
    return rank * total // tp, 1


def head_pattern(
    salt: str, prompt: Sequence[int], pos: int, layer: str, heads: int, width: int
) -> torch.Tensor:
    """[heads, width] KV of every global head at `pos` (a function of the tokens so far)."""
    key = zlib.crc32(f"{salt}/{layer}/{pos}".encode())
    key = zlib.crc32(bytes(str(list(prompt[: pos + 1])), "ascii"), key)
    g = torch.Generator().manual_seed(key)
    return torch.randn((heads, width), generator=g)


# A Mamba2 mixer as vLLM shapes its state at any TP (`MambaStateShapeCalculator`): heads,
# head size, groups (one: replicated on every rank above TP 1), SSM state size, conv kernel
MAMBA_HEADS, MAMBA_HEAD, MAMBA_GROUPS, MAMBA_DSTATE, MAMBA_KERNEL = 4, 4, 1, 8, 4
_ROWS = MAMBA_KERNEL - 1  # conv history (vLLM's "SD" layout: [history][channels])
_X, _BC = MAMBA_HEAD * 2, MAMBA_DSTATE * 2  # bytes of one head's / group's channels (bf16)
_SSM = MAMBA_HEAD * MAMBA_DSTATE * 2
STATE_BYTES = _ROWS * (MAMBA_HEADS * _X + 2 * MAMBA_GROUPS * _BC) + MAMBA_HEADS * _SSM
"""The whole model's state of one layer (every head and group once)."""


def _groups_of(tp: int, rank: int) -> slice:
    if MAMBA_GROUPS % tp == 0:
        n = MAMBA_GROUPS // tp
        return slice(rank * n, (rank + 1) * n)
    return slice(0, 1)  # one group, replicated (vLLM supports no other)


def shard_state(whole: np.ndarray, tp: int, rank: int) -> np.ndarray:
    """A rank's state bytes of one layer from the whole model's (`STATE_BYTES`), as vLLM
    shards Mamba2: per conv row [its heads' x, its groups' B, its groups' C], then its
    heads' SSM state."""
    conv = whole[: _ROWS * (MAMBA_HEADS * _X + 2 * MAMBA_GROUPS * _BC)].reshape(_ROWS, -1)
    ssm = whole[conv.size :].reshape(MAMBA_HEADS, _SSM)
    nh = MAMBA_HEADS // tp
    heads, g = slice(rank * nh, (rank + 1) * nh), _groups_of(tp, rank)
    out = []
    for row in conv:
        x = row[: MAMBA_HEADS * _X].reshape(MAMBA_HEADS, _X)
        b = row[MAMBA_HEADS * _X : MAMBA_HEADS * _X + MAMBA_GROUPS * _BC].reshape(-1, _BC)
        c = row[MAMBA_HEADS * _X + MAMBA_GROUPS * _BC :].reshape(-1, _BC)
        out += [x[heads].ravel(), b[g].ravel(), c[g].ravel()]
    out.append(ssm[heads].ravel())
    return np.concatenate(out)


def unshard_state(ranks: Sequence[np.ndarray], tp: int) -> np.ndarray:
    """The whole model's state of one layer from every rank's (`shard_state` inverted)."""
    conv = np.zeros((_ROWS, MAMBA_HEADS * _X + 2 * MAMBA_GROUPS * _BC), dtype=np.uint8)
    ssm = np.zeros((MAMBA_HEADS, _SSM), dtype=np.uint8)
    nh = MAMBA_HEADS // tp
    for rank, got in enumerate(ranks):
        heads, g = slice(rank * nh, (rank + 1) * nh), _groups_of(tp, rank)
        ng = g.stop - g.start
        at = 0
        for row in range(_ROWS):
            x = conv[row, : MAMBA_HEADS * _X].reshape(MAMBA_HEADS, _X)
            b = conv[row, MAMBA_HEADS * _X : MAMBA_HEADS * _X + MAMBA_GROUPS * _BC]
            c = conv[row, MAMBA_HEADS * _X + MAMBA_GROUPS * _BC :]
            x[heads] = got[at : at + nh * _X].reshape(nh, _X)
            at += nh * _X
            b.reshape(-1, _BC)[g] = got[at : at + ng * _BC].reshape(ng, _BC)
            at += ng * _BC
            c.reshape(-1, _BC)[g] = got[at : at + ng * _BC].reshape(ng, _BC)
            at += ng * _BC
        ssm[heads] = got[at:].reshape(nh, _SSM)
    return np.concatenate([conv.ravel(), ssm.ravel()])


def state_pattern(salt: str, prompt: Sequence[int], upto: int, layer: str, n: int) -> torch.Tensor:
    key = zlib.crc32(f"{salt}/{layer}/{upto}".encode())
    key = zlib.crc32(bytes(str(list(prompt[:upto])), "ascii"), key)
    g = torch.Generator().manual_seed(key)
    return torch.randint(-128, 128, (n,), generator=g, dtype=torch.int8)


@contextmanager
def as_rank(rank: int) -> Iterator[None]:
    """vLLM's TP rank query answers `rank` (one process simulating several workers)."""
    saved = parallel_state.get_tensor_model_parallel_rank
    parallel_state.get_tensor_model_parallel_rank = lambda: rank  # type: ignore[assignment]
    try:
        yield
    finally:
        parallel_state.get_tensor_model_parallel_rank = saved  # type: ignore[assignment]


@dataclass
class Rank:
    rank: int
    connector: KvdConnector
    kv: dict[str, torch.Tensor]
    head0: int
    heads: int


@dataclass
class Reference:
    """P's bytes of one request, read back from P's tensors when it finished."""

    tokens: int
    kv: dict[str, np.ndarray]
    """Attention layer -> [tokens, global heads, 2 x head size] (raw 16-bit words)."""
    state: dict[tuple[int, str], np.ndarray]
    """(P rank, state layer) -> the slot's bytes."""


@dataclass
class TPInstance:
    name: str
    engine_id: str
    salt: str
    tp: int
    block_size: int
    total_heads: int
    vllm_config: VllmConfig
    scheduler: Scheduler
    ranks: list[Rank]
    group_of: dict[str, int]
    kinds: list[str]
    aggregator: KVOutputAggregator
    outputs: dict[str, list[Any]] = field(default_factory=dict)
    finished: dict[str, Any] = field(default_factory=dict)
    waited_remote: set[str] = field(default_factory=set)
    received: set[str] = field(default_factory=set)
    failed_recv: set[str] = field(default_factory=set)
    sent: set[str] = field(default_factory=set)
    refs: dict[str, Reference] = field(default_factory=dict)
    """P: request id -> its reference (taken when it finished)."""
    verify: dict[str, tuple[TPInstance, str]] = field(default_factory=dict)
    """D: request id -> (P, P's request id) whose reference D's bytes must equal."""
    local_hit: dict[str, int] = field(default_factory=dict)
    """D: request id -> tokens of a local prefix hit (those hold D's own bytes)."""
    checked: dict[str, int] = field(default_factory=dict)
    """D: request id -> (rank, layer, position, head) cells compared."""
    errors: list[str] = field(default_factory=list)

    @property
    def connector(self) -> KvdConnector:
        c = self.scheduler.connector
        assert isinstance(c, KvdConnector)
        return c

    def add(self, rid: str, prompt: Sequence[int], *, max_tokens: int, params: Any) -> None:
        sp = SamplingParams(
            max_tokens=max_tokens, extra_args={"kv_transfer_params": params} if params else None
        )
        sp.update_from_generation_config({}, EOS)
        req = Request(
            request_id=rid,
            prompt_token_ids=list(prompt),
            sampling_params=sp,
            pooling_params=None,
            block_hasher=get_request_block_hasher(self.block_size, sha256),
        )
        self.scheduler.add_request(req)

    def busy(self) -> bool:
        return bool(self.scheduler.has_requests())

    def step(self) -> None:
        so = self.scheduler.schedule()
        for req in self.scheduler.requests.values():
            if req.status == RequestStatus.WAITING_FOR_REMOTE_KVS:
                self.waited_remote.add(req.request_id)
        outs = [self._run_rank(r, so) for r in self.ranks]
        mro = self.aggregator.aggregate(outs)
        assert mro is not None
        kvo = mro.kv_connector_output
        if kvo is not None:
            for rid in (kvo.finished_recving or set()) - (kvo.failed_recving or set()):
                self.received.add(rid)
                self._check(rid)
            self.failed_recv |= kvo.failed_recving or set()
            self.sent |= kvo.finished_sending or set()
        for eco in self.scheduler.update_from_output(so, mro).values():
            for o in eco.outputs:
                self.outputs.setdefault(o.request_id, []).append(o)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o
                    if o.kv_transfer_params:
                        self._take_reference(o.request_id)

    def _run_rank(self, r: Rank, so: Any) -> ModelRunnerOutput:
        w = r.connector
        meta = so.kv_connector_metadata
        w.handle_preemptions(meta)
        w.bind_connector_metadata(meta)
        starts = {q.req_id: q.num_computed_tokens for q in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled: dict[str, list[int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            self._forward(r, req, starts[rid], n)
            sampled[rid] = [TOKEN] if starts[rid] + n >= req.num_prompt_tokens else []
        w.start_load_kv(None)
        for name, t in r.kv.items():
            w.save_kv_layer(name, t, None)
        w.wait_for_save()
        res = w.get_transfer_results(so.finished_req_ids)
        invalid = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={q: i for i, q in enumerate(ids)},
            sampled_token_ids=[sampled[q] for q in ids],
            kv_connector_output=KVConnectorOutput(
                finished_sending=res.finished_sending or None,
                finished_recving=res.finished_recving or None,
                failed_recving=res.failed_recving,
                invalid_block_ids=invalid,
            ),
        )

    # ------------------------------------------------------------------ the fake model

    def _blocks(self, rid: str) -> tuple[list[int], ...]:
        return tuple(list(g) for g in self.scheduler.kv_cache_manager.get_block_ids(rid))

    def _slot(self, ids: list[int]) -> int:
        null = self.scheduler.kv_cache_manager.block_pool.null_block.block_id
        real = [b for b in ids if b != null]
        assert real, "a request without a state slot"
        return real[-1]

    def _forward(self, r: Rank, req: Request, start: int, n: int) -> None:
        blocks = self._blocks(req.request_id)
        prompt = req.prompt_token_ids
        assert prompt is not None
        bs = self.block_size
        for name, t in r.kv.items():
            g = self.group_of[name]
            if self.kinds[g] == "state":
                slot = self._slot(blocks[g])
                whole = state_pattern(self.salt, prompt, start + n, name, STATE_BYTES)
                mine = shard_state(whole.view(torch.uint8).numpy(), self.tp, r.rank)
                t[slot].view(-1)[:] = torch.from_numpy(mine).view(torch.int8)
                continue
            width = t.shape[3]
            for pos in range(start, start + n):
                kv = head_pattern(self.salt, prompt, pos, name, self.total_heads, width)
                b, s = blocks[g][pos // bs], pos % bs
                t[b, :, s, :] = kv[r.head0 : r.head0 + r.heads].to(t.dtype)

    # ------------------------------------------------------------------ reference and check

    def _take_reference(self, rid: str) -> None:
        """P: the request's bytes as P's ranks hold them (its blocks are still held)."""
        req = self.scheduler.requests.get(rid)
        if req is None:
            return
        tokens = req.num_prompt_tokens
        blocks = self._blocks(rid)
        kv: dict[str, np.ndarray] = {}
        state: dict[tuple[int, str], np.ndarray] = {}
        bs = self.block_size
        for r in self.ranks:
            for name, t in r.kv.items():
                g = self.group_of[name]
                if self.kinds[g] == "state":
                    slot = self._slot(blocks[g])
                    state[(r.rank, name)] = t[slot].reshape(-1).view(torch.uint8).numpy().copy()
                    continue
                words = t.view(torch.int16).numpy()
                out = kv.setdefault(
                    name, np.full((tokens, self.total_heads, t.shape[3]), -1, dtype=np.int16)
                )
                null = self.scheduler.kv_cache_manager.block_pool.null_block.block_id
                for pos in range(tokens):
                    b = blocks[g][pos // bs]
                    if b == null:  # a window group's block vLLM already freed
                        continue
                    out[pos, r.head0 : r.head0 + r.heads] = words[b, :, pos % bs, :]
        self.refs[rid] = Reference(tokens, kv, state)

    def _check(self, rid: str) -> None:
        """D: at the aggregated finished_recving, every rank's bytes equal P's reference."""
        if rid not in self.verify:
            return
        p, pid = self.verify[rid]
        ref = p.refs.get(pid)
        if ref is None:
            self.errors.append(f"{self.name}: {rid} arrived before P's reference was taken")
            return
        loaded = ref.tokens  # every token P computed (D recomputes the prompt's last itself)
        req_prompt = self.scheduler.requests[rid].prompt_token_ids
        assert req_prompt is not None
        blocks = self._blocks(rid)
        bs = self.block_size
        cells = 0
        for r in self.ranks:
            for name, t in r.kv.items():
                g = self.group_of[name]
                if self.kinds[g] == "state":
                    got = t[self._slot(blocks[g])].reshape(-1).view(torch.uint8).numpy()
                    want = ref.state.get((r.rank, name))
                    if p.tp != self.tp:  # this rank's share of P's whole state
                        whole = unshard_state([ref.state[(q, name)] for q in range(p.tp)], p.tp)
                        want = shard_state(whole, self.tp, r.rank)
                    if want is None or not np.array_equal(got, want):
                        self.errors.append(f"{self.name}: rank {r.rank} state of {name} differs")
                    cells += 1
                    continue
                lo = 0 if self.kinds[g] == "full" else max(0, loaded - WINDOW + 1)
                words = t.view(torch.int16).numpy()
                hit = self.local_hit.get(rid, 0)
                for pos in range(lo, loaded):
                    got = words[blocks[g][pos // bs], :, pos % bs, :]
                    if pos < hit:  # D computed this prefix itself
                        mine = head_pattern(
                            self.salt, req_prompt, pos, name, self.total_heads, t.shape[3]
                        )
                        want = mine[r.head0 : r.head0 + r.heads].to(t.dtype).view(torch.int16)
                        want = want.numpy()
                    else:
                        want = ref.kv[name][pos, r.head0 : r.head0 + r.heads]
                    if not np.array_equal(got, want):
                        self.errors.append(
                            f"{self.name}: {rid} rank {r.rank} {name} position {pos} heads "
                            f"{r.head0}..{r.head0 + r.heads - 1} differ from P's"
                        )
                        return
                    cells += r.heads
        self.checked[rid] = cells

    def held_blocks(self) -> int:
        pool = self.scheduler.kv_cache_manager.block_pool
        return int(pool.num_gpu_blocks - 1 - pool.free_block_queue.num_free_blocks)

    def assert_idle(self) -> None:
        s = self.scheduler
        assert not s.requests, f"{self.name}: requests left {list(s.requests)}"
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
        for r in self.ranks:
            r.connector.shutdown()


def make_tp_instance(
    name: str,
    socket: str,
    model: str,
    *,
    tp: int,
    mode: str = "pull",
    block_size: int = 16,
    layout: str = "LBNHC",
    dtype: str = "bfloat16",
    hybrid: bool = False,
    state: bool = True,
    num_blocks: int = 96,
    describe_state: bool = True,
) -> TPInstance:
    """One engine of `tp` ranks; `hybrid`: full + sliding window (+ Mamba state if `state`)."""
    mc = ModelConfig(model=model, skip_tokenizer_init=True, dtype=dtype, max_model_len=1024)
    sc = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=1024,
        is_encoder_decoder=False,
    )
    cc = CacheConfig(block_size=block_size, enable_prefix_caching=not hybrid)
    cc.kv_cache_layout = layout
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
        parallel_config=ParallelConfig(tensor_parallel_size=tp),
        kv_transfer_config=kt,
        device_config=DeviceConfig("cpu"),
    )
    heads, size = mc.get_num_kv_heads(vc.parallel_config), mc.get_head_size()
    torch_dtype = getattr(torch, dtype)
    full = FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=size, dtype=torch_dtype
    )
    if hybrid:
        swa = SlidingWindowSpec(
            block_size=block_size,
            num_kv_heads=heads,
            head_size=size,
            dtype=torch_dtype,
            sliding_window=WINDOW,
        )
        mamba = MambaSpec(
            block_size=block_size,
            shapes=MambaStateShapeCalculator.mamba2_state_shape(
                tp,
                MAMBA_HEADS * MAMBA_HEAD,
                MAMBA_GROUPS,
                MAMBA_HEADS,
                MAMBA_HEAD,
                MAMBA_DSTATE,
                MAMBA_KERNEL,
            ),
            dtypes=(torch_dtype, torch_dtype),
            page_size_padded=full.page_size_bytes,
        )
        if describe_state:  # as a Mamba2 model's HF config names its groups
            mc.hf_config.n_groups = MAMBA_GROUPS
        elif hasattr(mc.hf_config, "n_groups"):
            del mc.hf_config.n_groups
        specs = {"full": full, "window": swa, "state": mamba}
        kinds = ["full", "window", "state"] if state else ["full", "window"]
        groups = [KVCacheGroupSpec(HYBRID_GROUPS[k], specs[k]) for k in kinds]
        budget = num_blocks * full.page_size_bytes * 2
    else:
        kinds = ["full"]
        groups = [KVCacheGroupSpec(PLAIN_LAYERS, full)]
        budget = num_blocks * full.page_size_bytes * len(PLAIN_LAYERS)
    kcc = get_kv_cache_config_from_groups(vc, groups, budget)
    vc.cache_config.num_gpu_blocks = kcc.num_blocks
    total = mc.get_total_num_kv_heads()
    ranks: list[Rank] = []
    for rank in range(tp):  # workers first, as in vLLM
        kv = allocate_kv_cache(kcc, torch.device("cpu"), cc.get_resolved_kv_cache_layout())
        with as_rank(rank):
            w = KVConnectorFactory.create_connector(vc, KVConnectorRole.WORKER, kcc)
        assert isinstance(w, KvdConnector)
        w.register_kv_caches(kv)
        head0, count = heads_of(total, tp, rank)
        assert count == heads
        ranks.append(Rank(rank, w, kv, head0, count))
    sched = Scheduler(
        vllm_config=vc,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=block_size,
    )
    conn = sched.connector
    assert isinstance(conn, KvdConnector)
    group_of = {layer: i for i, g in enumerate(groups) for layer in g.layer_names}
    return TPInstance(
        name=name,
        engine_id=kt.engine_id or "",
        salt=f"salt-{name}",
        tp=tp,
        block_size=block_size,
        total_heads=total,
        vllm_config=vc,
        scheduler=sched,
        ranks=ranks,
        group_of=group_of,
        kinds=kinds,
        aggregator=KVOutputAggregator.from_connector(conn, tp),
    )
