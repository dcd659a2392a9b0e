"""An E (encoder) or PD (consumer) vLLM instance for encoder-cache tests: vLLM 0.33's real
Scheduler with `KvdECConnector` loaded by vLLM's EC factory (module path), the worker-side
connector the factory builds, and real multimodal requests made by vLLM's own
`InputProcessor` from an image (a tiny BLIP-2 config: real processor, real placeholders,
real mm hashes; no weights).

The test plays the model runner, in the V2 runner's order (`ActiveECConnector`): drop the
outputs the scheduler freed -> bind_connector_metadata -> start_save_caches (producer) ->
start_load_caches (consumer) -> the forward, whose "encoder" computes each scheduled
encoder input as a pattern derived from (instance salt, mm hash) -> save_caches for each
new output (producer) -> get_finished -> build_connector_worker_meta ->
clear_connector_metadata -> update_from_output. Every step checks that each mm item the
forward consumes is in the encoder cache and, for an item a consumer was told to fetch,
that its bytes are exactly the producer's and that the consumer never encoded it itself.
"""

from __future__ import annotations

import secrets
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from kvd_client.vllm import KvdECConnector
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    Blip2Config,
    Blip2Processor,
    Blip2QFormerConfig,
    Blip2VisionConfig,
    OPTConfig,
    PreTrainedTokenizerFast,
)
from vllm import SamplingParams
from vllm.config import (
    CacheConfig,
    DeviceConfig,
    ECTransferConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
from vllm.distributed.ec_transfer.ec_connector.encoder_output_width import (
    measure_encoder_output_widths,
)
from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.input_processor import InputProcessor
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
from vllm.v1.outputs import ECConnectorOutput, ModelRunnerOutput
from vllm.v1.request import Request, RequestStatus
from vllm.v1.structured_output import StructuredOutputManager

try:  # transformers without torchvision
    from transformers import BlipImageProcessorPil as BlipImageProcessor
except ImportError:  # pragma: no cover
    from transformers import BlipImageProcessor  # type: ignore[assignment]

BLOCK_SIZE = 16
NUM_LAYERS = 2
HIDDEN = 64
IMAGE_TOKEN = 255
QUERY_TOKENS = 32
"""Encoder output rows per image: 32 x 64 bfloat16 = 4 KiB."""
TOKEN = 7

init_none_hash(sha256)


def write_mm_model(path: Path) -> str:
    """A tiny BLIP-2 (vision tower + Q-Former + OPT) with a word-level tokenizer and its
    processor files: everything vLLM's multimodal processor and Scheduler need, no weights."""
    Blip2Config(
        vision_config=Blip2VisionConfig(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        ).to_dict(),
        qformer_config=Blip2QFormerConfig(
            hidden_size=32,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=64,
            encoder_hidden_size=32,
        ).to_dict(),
        text_config=OPTConfig(
            vocab_size=256,
            hidden_size=HIDDEN,
            ffn_dim=128,
            num_hidden_layers=NUM_LAYERS,
            num_attention_heads=4,
            word_embed_proj_dim=HIDDEN,
            max_position_embeddings=2048,
        ).to_dict(),
        num_query_tokens=QUERY_TOKENS,
        image_token_index=IMAGE_TOKEN,
        architectures=["Blip2ForConditionalGeneration"],
    ).save_pretrained(path)
    vocab = {f"t{i}": i for i in range(250)}
    vocab |= {"<pad>": 250, "<eos>": 251, "<bos>": 252, "<unk>": 253, "<image>": IMAGE_TOKEN}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token="<bos>",
        eos_token="<eos>",
        pad_token="<pad>",
        unk_token="<unk>",
    )
    ip = BlipImageProcessor(size={"height": 28, "width": 28})
    proc = Blip2Processor(  # type: ignore[no-untyped-call]
        image_processor=ip, tokenizer=fast, num_query_tokens=QUERY_TOKENS
    )
    proc.save_pretrained(path)
    return str(path)


def image(seed: int) -> Image.Image:
    """A distinct picture per seed (so a distinct mm hash)."""
    px = np.random.default_rng(seed).integers(0, 256, (28, 28, 3), dtype=np.uint8)
    return Image.fromarray(px)


def encoder_output(salt: str, mm_hash: str, shape: Sequence[int]) -> torch.Tensor:
    """What an instance's encoder computes for an item: a function of (salt, hash)."""
    g = torch.Generator().manual_seed(zlib.crc32(f"{salt}/{mm_hash}".encode()))
    return torch.randn(tuple(shape), generator=g).to(torch.bfloat16)


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.shape == b.shape
        and a.dtype == b.dtype
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


@dataclass
class ECInstance:
    name: str
    salt: str
    vllm_config: VllmConfig
    scheduler: Scheduler
    worker: KvdECConnector
    inputs: InputProcessor
    encoder_only: bool
    encoder_cache: dict[str, torch.Tensor] = field(default_factory=dict)
    remote_salt: dict[str, str] = field(default_factory=dict)
    """mm hash -> salt of the producer whose bytes this consumer must end up with."""
    outputs: dict[str, list[Any]] = field(default_factory=dict)
    finished: dict[str, Any] = field(default_factory=dict)
    encoded: list[str] = field(default_factory=list)
    """mm hashes this instance's encoder computed."""
    verified: dict[str, list[str]] = field(default_factory=dict)
    """request id -> remote mm hashes whose bytes a forward consumed and found exact."""
    scheduled: set[str] = field(default_factory=set)
    queue: deque[tuple[Any, ModelRunnerOutput]] = field(default_factory=deque)
    async_depth: int = 1
    errors: list[str] = field(default_factory=list)
    daemon: Any = None
    """The instance's kvd daemon (a DaemonProc), for tests to inspect."""
    before_worker: Callable[[Any], None] | None = None
    """Called with each SchedulerOutput before the model runner sees it."""

    @property
    def connector(self) -> KvdECConnector:
        c = self.scheduler.ec_connector
        assert isinstance(c, KvdECConnector)
        return c

    def add(
        self,
        rid: str,
        img: Image.Image,
        *,
        max_tokens: int = 4,
        ec_params: dict[str, Any] | None = None,
        text: str = "t1 t2 t3",
    ) -> Request:
        sp = SamplingParams(
            max_tokens=max_tokens,
            extra_args={"ec_transfer_params": ec_params} if ec_params is not None else None,
        )
        ecr = self.inputs.process_inputs(
            rid, {"prompt": text, "multi_modal_data": {"image": img}}, sp, ("generate",)
        )
        req = Request.from_engine_core_request(ecr, get_request_block_hasher(BLOCK_SIZE, sha256))
        self.scheduler.add_request(req)
        return req

    def mm_hash(self, img: Image.Image, text: str = "t1 t2 t3") -> str:
        """The mm hash vLLM gives this image (what a producer would have published it under)."""
        ecr = self.inputs.process_inputs(
            "probe",
            {"prompt": text, "multi_modal_data": {"image": img}},
            SamplingParams(),
            ("generate",),
        )
        assert ecr.mm_features is not None
        return str(ecr.mm_features[0].identifier)

    def status(self, rid: str) -> RequestStatus | None:
        req = self.scheduler.requests.get(rid)
        return None if req is None else req.status

    def busy(self) -> bool:
        """Work left: requests, or connector work that keeps vLLM's engine loop stepping."""
        return (
            self.scheduler.has_requests()
            or bool(self.queue)
            or self.connector.has_pending_push_work()
        )

    def step(self) -> None:
        """One engine step; with the async scheduler the next batch is scheduled before the
        previous one's output is processed (two in flight, as vLLM's default does)."""
        if self.scheduler.has_requests() or not self.queue:
            so = self.scheduler.schedule()
            self.scheduled |= set(so.num_scheduled_tokens)
            if self.before_worker is not None:
                self.before_worker(so)
            self.queue.append((so, self._run_worker(so)))
            if len(self.queue) < self.async_depth and self.scheduler.has_requests():
                return
        done, mro = self.queue.popleft()
        for outs in self.scheduler.update_from_output(done, mro).values():
            for o in outs.outputs:
                self.outputs.setdefault(o.request_id, []).append(o)
                if o.finish_reason is not None:
                    self.finished[o.request_id] = o

    def _run_worker(self, so: Any) -> ModelRunnerOutput:
        w = self.worker
        cache = self.encoder_cache
        for h in so.free_encoder_mm_hashes:
            cache.pop(h, None)
        w.bind_connector_metadata(so.ec_connector_metadata)
        if w.is_producer:
            w.start_save_caches(encoder_cache=cache)
        if w.is_consumer:
            w.start_load_caches(cache)
        before = set(cache)
        starts = {r.req_id: r.num_computed_tokens for r in so.scheduled_new_reqs}
        cached = so.scheduled_cached_reqs
        starts.update(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        sampled: dict[str, list[int]] = {}
        for rid, n in so.num_scheduled_tokens.items():
            req = self.scheduler.requests[rid]
            for idx in so.scheduled_encoder_inputs.get(rid, ()):  # the encoder
                f = req.mm_features[idx]
                if f.identifier in self.remote_salt:
                    self.errors.append(f"{self.name}: encoded {f.identifier[:12]} itself")
                shape = (f.mm_position.get_num_embeds(), HIDDEN)
                cache[f.identifier] = encoder_output(self.salt, f.identifier, shape)
                self.encoded.append(f.identifier)
            self._consume(req, starts[rid], n)
            done = starts[rid] + n >= req.num_prompt_tokens
            sampled[rid] = [TOKEN] if done and not self.encoder_only else []
        if w.is_producer:
            for h in set(cache) - before:
                w.save_caches(encoder_cache=cache, mm_hash=h)
        fs, fr = w.get_finished(so.finished_req_ids)
        wm = w.build_connector_worker_meta()
        w.clear_connector_metadata()
        ids = list(so.num_scheduled_tokens)
        return ModelRunnerOutput(
            req_ids=ids,
            req_id_to_index={r: i for i, r in enumerate(ids)},
            sampled_token_ids=[sampled[r] for r in ids],
            ec_connector_output=ECConnectorOutput(
                finished_sending=fs, finished_recving=fr, ec_connector_worker_meta=wm
            ),
        )

    def _consume(self, req: Request, start: int, n: int) -> None:
        """The forward gathers the embeddings of the mm items in [start, start + n)."""
        for f in req.mm_features:
            pos = f.mm_position
            if pos.offset >= start + n or pos.offset + pos.length <= start:
                continue
            got = self.encoder_cache.get(f.identifier)
            if got is None:
                self.errors.append(
                    f"{self.name}: {req.request_id} needs {f.identifier[:12]}, absent"
                )
                continue
            salt = self.remote_salt.get(f.identifier)
            if salt is None:
                continue
            want = encoder_output(salt, f.identifier, (pos.get_num_embeds(), HIDDEN))
            if not same_bytes(got, want):
                self.errors.append(
                    f"{self.name}: {req.request_id}: {f.identifier[:12]} is not the producer's"
                )
            else:
                self.verified.setdefault(req.request_id, []).append(f.identifier)

    def close(self) -> None:
        self.connector.shutdown()
        self.worker.shutdown()


def make_ec_instance(
    name: str,
    socket: str,
    model: str,
    role: str,
    *,
    with_kv_connector: bool = False,
    async_scheduling: bool = False,
    output_width: int = HIDDEN,
    num_blocks: int = 64,
) -> ECInstance:
    """An instance with `ec_role` `role`; `ec_producer` is an encode-only E instance.
    `output_width` is the encoder output width a producer measured at startup (its
    encoder really computes HIDDEN)."""
    mc = ModelConfig(
        model=model, dtype="bfloat16", max_model_len=1024, mm_hasher_algorithm="sha256"
    )
    sc = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=256,
        max_model_len=1024,
        is_encoder_decoder=False,
        async_scheduling=async_scheduling,
    )
    cc = CacheConfig(block_size=BLOCK_SIZE, enable_prefix_caching=False)
    cc.kv_cache_layout = "LBNHC"
    engine_id = f"engine-{name}-{secrets.token_hex(3)}"
    ec = ECTransferConfig(
        ec_connector="KvdECConnector",
        ec_connector_module_path="kvd_client.vllm",
        ec_role=role,
        engine_id=f"ec-{engine_id}",
        ec_connector_extra_config={"kvd_socket": socket},
    )
    kt = None
    if with_kv_connector:
        kt = KVTransferConfig(
            kv_connector="KvdConnector",
            kv_connector_module_path="kvd_client.vllm",
            kv_role="kv_both",
            engine_id=engine_id,
            kv_connector_extra_config={"kvd_socket": socket},
        )
    vc = VllmConfig(
        model_config=mc,
        scheduler_config=sc,
        cache_config=cc,
        ec_transfer_config=ec,
        kv_transfer_config=kt,
        device_config=DeviceConfig("cpu"),
    )
    encoder_only = vc.is_mm_encoder_only
    if ec.is_ec_producer:  # what the engine measures at startup by encoding a dummy item
        measure_encoder_output_widths(vc, lambda fn: [{"image": output_width}])
    if encoder_only:
        kcc = get_kv_cache_config_from_groups(vc, [], 0)  # an E instance holds no KV cache
    else:
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE,
            num_kv_heads=mc.get_num_kv_heads(vc.parallel_config),
            head_size=mc.get_head_size(),
            dtype=torch.bfloat16,
        )
        layers = [
            f"language_model.model.decoder.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)
        ]
        kcc = get_kv_cache_config_from_groups(
            vc, [KVCacheGroupSpec(layers, spec)], num_blocks * spec.page_size_bytes * NUM_LAYERS
        )
    vc.cache_config.num_gpu_blocks = kcc.num_blocks
    # the worker comes first, as in vLLM (ensure_ec_transfer_initialized in init_device)
    worker = ECConnectorFactory.create_connector(vc, ECConnectorRole.WORKER)
    assert isinstance(worker, KvdECConnector)
    cls = AsyncScheduler if async_scheduling else Scheduler
    sched = cls(
        vllm_config=vc,
        kv_cache_config=kcc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BLOCK_SIZE,
    )
    return ECInstance(
        name,
        f"salt-{name}",
        vc,
        sched,
        worker,
        InputProcessor(vc),
        encoder_only=encoder_only,
        async_depth=2 if async_scheduling else 1,
    )
