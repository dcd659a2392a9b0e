"""Host staging of a worker rank's KV cache: block copies between vLLM's KV tensors and a
shared-memory region the kvd daemon registers with NIXL.

vLLM hands `register_kv_caches` one tensor per attention layer. Nothing here assumes
their shape: each tensor's block axis is found from its shape and the engine's block
count (the axis of size `num_blocks`, preferring the outermost; or an outermost axis
holding a whole number of kernel blocks per block), and a block's bytes are those of the
tensor's block slice in its *logical* order (shape, dtype), whatever the strides (an
opaque region: two engines exchange blocks when their per-block shapes agree), or, for
vLLM's attention blocks ([heads, tokens, K|V]), per layer K then V as [token][head][elem]
(NHD) or [head][token][elem] (HND), following the tensors' physical order (`kv_format`):
a KV spec region the daemon maps across TP, block sizes and token layouts
(`staged_format`).

The staging region is block-major: block b holds every layer's bytes for b back to back,
so a run of consecutive block ids is one contiguous range (one NIXL descriptor). With a
uniform per-layer size it is described to the daemon as `num_layers` chunks per block,
otherwise as one chunk per block.

Copies are synchronous. With KV tensors on a GPU they are device<->host copies through
the same code (`.cpu()` / `.to(device)` and `index_copy_`); that path is written to work
but is untested here (the machines that run these tests have no GPU).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from math import prod

import torch

from kvd_client import layout as kvlayout
from kvd_client import wire


@dataclass(frozen=True)
class LayerBlocks:
    """One layer's KV as a tensor whose dim 0 is the (manager) block."""

    name: str
    blocks: torch.Tensor
    block_shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int
    """Bytes of one block of this layer."""
    offset: int = 0
    """Where this layer's bytes start inside a staged block."""


def torch_dtype_name(dtype: torch.dtype) -> str:
    """`torch.bfloat16` -> "bfloat16" (a KV spec's and a region layout's dtype)."""
    return str(dtype).removeprefix("torch.")[:32]


def blocks_view(t: torch.Tensor, num_blocks: int) -> torch.Tensor:
    """`t` viewed with its block axis first (a view: writes reach `t`'s storage)."""
    if t.ndim == 0:
        raise ValueError("a KV cache tensor has no dimensions")
    if t.shape[0] == num_blocks:
        return t
    for dim in range(1, t.ndim):
        if t.shape[dim] == num_blocks:
            return t.movedim(dim, 0)
    if t.shape[0] % num_blocks == 0:
        # kernel blocks subdividing each manager block: [B*r, ...] -> [B, r, ...]
        return t.view(num_blocks, t.shape[0] // num_blocks, *t.shape[1:])
    raise ValueError(f"no axis of the KV tensor {tuple(t.shape)} holds {num_blocks} blocks")


def describe(kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> list[LayerBlocks]:
    """Per-layer block views, in vLLM's layer order, skipping layers that alias another's KV."""
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...], torch.dtype]] = set()
    out: list[LayerBlocks] = []
    offset = 0
    for name, t in kv_caches.items():
        key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if key in seen:
            continue
        seen.add(key)
        b = blocks_view(t, num_blocks)
        shape = tuple(int(x) for x in b.shape[1:])
        nbytes = prod(shape) * t.element_size()
        out.append(LayerBlocks(name, b, shape, t.dtype, nbytes, offset))
        offset += nbytes
    if not out:
        raise ValueError("register_kv_caches got no KV tensors")
    return out


def kv_format(layers: list[LayerBlocks], *, heads: int, tokens: int, head_size: int) -> str | None:
    """The token layout ("NHD" or "HND") to stage these attention layers in as a KV spec
    region (K and V apart, every layer alike), or None when they are not vLLM 0.33's
    attention blocks of `heads` heads x `tokens` tokens x (K|V of `head_size`) each.

    The staged layout follows the tensors' physical order (HND when a block's heads are
    further apart in memory than its tokens, as with LBHNC or BLHNC; NHD for LBNHC), so a
    copy reads each block's bytes in order; the daemon converts NHD <-> HND between P and D.
    """
    want = (heads, tokens, 2 * head_size)
    first = layers[0]
    if any(lay.block_shape != want or lay.dtype != first.dtype for lay in layers):
        return None
    b = first.blocks
    return "HND" if b.stride(1) > b.stride(2) else "NHD"


class HostStaging:
    """Copies blocks between a rank's KV tensors and its block-major staging buffer.

    With `kv_layout` (from `kv_format`) a staged block holds, per layer, K then V, each
    [token][head][elem] (NHD) or [head][token][elem] (HND): the chunks of a KV spec region
    (`kvd_client.layout.kv_region_layout`); otherwise each layer's block bytes in the
    tensor's logical order (an opaque region)."""

    def __init__(
        self,
        layers: list[LayerBlocks],
        num_blocks: int,
        buf: memoryview,
        kv_layout: str | None = None,
    ) -> None:
        self.layers = layers
        self.num_blocks = num_blocks
        self.kv_layout = kv_layout
        self.block_bytes = sum(lay.nbytes for lay in layers)
        need = num_blocks * self.block_bytes
        if len(buf) < need:
            raise ValueError(f"staging buffer of {len(buf)} bytes is smaller than {need}")
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=need)
        self._stage: torch.Tensor | None = flat.view(num_blocks, self.block_bytes)

    @staticmethod
    def region_layout(
        layers: list[LayerBlocks],
        num_blocks: int,
        tokens_per_block: int,
        kv_layout: str | None = None,
        dtype: str | None = None,
    ) -> wire.RegionLayout:
        sizes = {lay.nbytes for lay in layers}
        dtype = dtype or torch_dtype_name(layers[0].dtype)
        if kv_layout is not None:  # K and V as separate chunks of one layer each
            return kvlayout.block_major(
                num_blocks,
                len(layers),
                layers[0].nbytes // 2,
                kv_parts=2,
                tokens_per_block=tokens_per_block,
                dtype=dtype,
                kv_layout=kv_layout,
            )
        if len(sizes) == 1:
            return kvlayout.block_major(
                num_blocks,
                len(layers),
                sizes.pop(),
                kv_parts=1,
                tokens_per_block=tokens_per_block,
                dtype=dtype,
            )
        return kvlayout.block_major(
            num_blocks,
            1,
            sum(lay.nbytes for lay in layers),
            kv_parts=1,
            tokens_per_block=tokens_per_block,
            dtype=dtype,
        )

    @staticmethod
    def signature(layers: list[LayerBlocks]) -> str:
        """What two ranks must agree on for their staged blocks to mean the same bytes."""
        text = ";".join(f"{lay.dtype}{list(lay.block_shape)}" for lay in layers)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @property
    def stage(self) -> torch.Tensor:
        if self._stage is None:
            raise RuntimeError("the staging buffer was released")
        return self._stage

    def _index(self, block_ids: Sequence[int]) -> torch.Tensor:
        idx = torch.as_tensor(list(block_ids), dtype=torch.long)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_blocks):
            raise IndexError(f"block ids outside [0, {self.num_blocks})")
        return idx

    def save(self, block_ids: Sequence[int], layers: Sequence[int] | None = None) -> None:
        """KV tensors -> staging (P, before the blocks are reported to the daemon), for
        every layer or only those (indices into `self.layers`)."""
        if not block_ids:
            return
        idx = self._index(block_ids)
        n = idx.numel()
        stage = self.stage
        for i in range(len(self.layers)) if layers is None else layers:
            lay = self.layers[i]
            src = self._to_chunks(lay.blocks.index_select(0, idx.to(lay.blocks.device)))
            raw = src.reshape(n, -1).view(torch.uint8).cpu()
            stage[idx, lay.offset : lay.offset + lay.nbytes] = raw

    def load(self, block_ids: Sequence[int]) -> None:
        """Staging -> KV tensors (D, once the daemon reported every byte arrived)."""
        if not block_ids:
            return
        idx = self._index(block_ids)
        stage = self.stage
        for lay in self.layers:
            raw = stage[idx, lay.offset : lay.offset + lay.nbytes]
            vals = self._from_chunks(raw.view(lay.dtype), lay).to(lay.blocks.device)
            lay.blocks.index_copy_(0, idx.to(lay.blocks.device), vals)

    def _to_chunks(self, blocks: torch.Tensor) -> torch.Tensor:
        """[n, H, T, 2D] blocks -> [n, 2, T, H, D] (NHD) or [n, 2, H, T, D] (HND)."""
        if self.kv_layout is None:
            return blocks
        n, h, t, d2 = blocks.shape
        kv = blocks.reshape(n, h, t, 2, d2 // 2)
        order = (0, 3, 2, 1, 4) if self.kv_layout == "NHD" else (0, 3, 1, 2, 4)
        return kv.permute(*order).contiguous()

    def _from_chunks(self, raw: torch.Tensor, lay: LayerBlocks) -> torch.Tensor:
        """Staged values of n blocks (flat per block) -> [n, *lay.block_shape]."""
        n = raw.shape[0]
        if self.kv_layout is None:
            return raw.reshape(n, *lay.block_shape)
        h, t, d2 = lay.block_shape
        if self.kv_layout == "NHD":
            kv = raw.reshape(n, 2, t, h, d2 // 2).permute(0, 3, 2, 1, 4)
        else:
            kv = raw.reshape(n, 2, h, t, d2 // 2).permute(0, 2, 3, 1, 4)
        return kv.reshape(n, h, t, d2)

    def close(self) -> None:
        """Drop the tensor over the buffer (the region cannot be unmapped while it exists)."""
        self._stage = None


@dataclass(frozen=True)
class ModelKv:
    """What decides the meaning of a rank's KV bytes, from vLLM's config."""

    model: str
    cache_dtype: str
    """vLLM's `cache_config.cache_dtype` ("auto": the KV tensors' own dtype)."""
    total_heads: int
    """KV heads of the whole model."""
    rank_heads: int
    """KV heads this rank holds (vLLM: max(1, total // TP))."""
    head_size: int
    mla: bool = False


@dataclass(frozen=True)
class StagedFormat:
    """How a rank stages its attention layers and the compat it declares for them."""

    kv_layout: str | None
    """NHD/HND: a KV spec region the daemon maps across TP, block sizes and token layouts;
    None: an opaque region (maps only onto an equal one at equal TP)."""
    dtype: str
    compat: str


def staged_format(mk: ModelKv, layers: list[LayerBlocks], tokens_per_block: int) -> StagedFormat:
    """A KV spec (`kvd_client.layout.kv_spec`: model, dtype, KV heads, head size, layers)
    when the layers are vLLM's K/V attention blocks of a known dtype; otherwise the opaque
    hash of the staged format (MLA, or a tensor shape this does not know)."""
    torch_name = torch_dtype_name(layers[0].dtype)
    dtype = mk.cache_dtype if mk.cache_dtype not in ("auto", "") else torch_name
    layout = None
    if not mk.mla and dtype in kvlayout.DTYPE_BYTES:
        layout = kv_format(
            layers, heads=mk.rank_heads, tokens=tokens_per_block, head_size=mk.head_size
        )
    if layout is not None and kvlayout.DTYPE_BYTES[dtype] == layers[0].dtype.itemsize:
        compat = kvlayout.kv_spec(
            model=mk.model,
            dtype=dtype,
            num_kv_heads=mk.total_heads,
            head_size=mk.head_size,
            num_layers=len(layers),
        )
        return StagedFormat(layout, dtype, compat)
    compat = kvlayout.compat_hash(
        model=mk.model,
        dtype=mk.cache_dtype,
        num_kv_heads=mk.total_heads,
        head_size=mk.head_size,
        num_layers=len(layers),
        tokens_per_block=tokens_per_block,
        kv_layout=f"staged:{HostStaging.signature(layers)}",
        transfer_mode="any",  # a kvd P serves push and pull alike
    )
    return StagedFormat(None, torch_name, compat)
