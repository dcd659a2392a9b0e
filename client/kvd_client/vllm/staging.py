"""Host staging of a worker rank's KV cache: block copies between vLLM's KV tensors and a
shared-memory region the kvd daemon registers with NIXL.

vLLM hands `register_kv_caches` one tensor per attention layer. Nothing here assumes
their shape: each tensor's block axis is found from its shape and the engine's block
count (the axis of size `num_blocks`, preferring the outermost; or an outermost axis
holding a whole number of kernel blocks per block), and a block's bytes are those of the
tensor's block slice in its *logical* order (shape, dtype), whatever the strides. Two
engines whose per-block logical shapes agree therefore exchange blocks even when their
physical layouts (LBNHC, LBHNC, BLNHC, ...) differ.

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


class HostStaging:
    """Copies blocks between a rank's KV tensors and its block-major staging buffer."""

    def __init__(self, layers: list[LayerBlocks], num_blocks: int, buf: memoryview) -> None:
        self.layers = layers
        self.num_blocks = num_blocks
        self.block_bytes = sum(lay.nbytes for lay in layers)
        need = num_blocks * self.block_bytes
        if len(buf) < need:
            raise ValueError(f"staging buffer of {len(buf)} bytes is smaller than {need}")
        flat = torch.frombuffer(buf, dtype=torch.uint8, count=need)
        self._stage: torch.Tensor | None = flat.view(num_blocks, self.block_bytes)

    @staticmethod
    def region_layout(
        layers: list[LayerBlocks], num_blocks: int, tokens_per_block: int
    ) -> wire.RegionLayout:
        sizes = {lay.nbytes for lay in layers}
        dtype = str(layers[0].dtype).removeprefix("torch.")[:32]
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
            src = lay.blocks.index_select(0, idx.to(lay.blocks.device))
            raw = src.reshape(n, -1).view(torch.uint8).cpu()
            stage[idx, lay.offset : lay.offset + lay.nbytes] = raw

    def load(self, block_ids: Sequence[int]) -> None:
        """Staging -> KV tensors (D, once the daemon reported every byte arrived)."""
        if not block_ids:
            return
        idx = self._index(block_ids)
        n = idx.numel()
        stage = self.stage
        for lay in self.layers:
            raw = stage[idx, lay.offset : lay.offset + lay.nbytes]
            vals = raw.view(lay.dtype).reshape(n, *lay.block_shape).to(lay.blocks.device)
            lay.blocks.index_copy_(0, idx.to(lay.blocks.device), vals)

    def close(self) -> None:
        """Drop the tensor over the buffer (the region cannot be unmapped while it exists)."""
        self._stage = None
