"""Helpers to describe a KV region: its layout record and the compatibility hash.

Two regions can exchange blocks only if their compatibility hashes match: protocol
version, model, dtype, KV heads, head size, layers, tokens per block, token layout and
transfer mode all go into it.
"""

from __future__ import annotations

import hashlib

from kvd_client import wire


def block_major(
    num_blocks: int,
    num_layers: int,
    chunk_bytes: int,
    *,
    kv_parts: int = 2,
    tokens_per_block: int = 16,
    dtype: str = "bfloat16",
    kv_layout: str = "NHD",
    physical_per_logical: int = 1,
) -> wire.RegionLayout:
    """Each block holds all its layers and K/V parts contiguously.

    A run of blocks is then one descriptor.
    """
    return wire.RegionLayout(
        num_blocks=num_blocks,
        num_layers=num_layers,
        kv_parts=kv_parts,
        chunk_bytes=chunk_bytes,
        block_stride=num_layers * kv_parts * chunk_bytes,
        layer_stride=kv_parts * chunk_bytes,
        kv_stride=chunk_bytes,
        tokens_per_block=tokens_per_block,
        physical_per_logical=physical_per_logical,
        kv_layout=kv_layout,
        dtype=dtype,
    )


def layer_major(
    num_blocks: int,
    num_layers: int,
    chunk_bytes: int,
    *,
    kv_parts: int = 2,
    tokens_per_block: int = 16,
    dtype: str = "bfloat16",
    kv_layout: str = "NHD",
    physical_per_logical: int = 1,
) -> wire.RegionLayout:
    """vLLM-like: per layer, per K/V part, all blocks (one descriptor per layer, part and run)."""
    return wire.RegionLayout(
        num_blocks=num_blocks,
        num_layers=num_layers,
        kv_parts=kv_parts,
        chunk_bytes=chunk_bytes,
        block_stride=chunk_bytes,
        layer_stride=kv_parts * num_blocks * chunk_bytes,
        kv_stride=num_blocks * chunk_bytes,
        tokens_per_block=tokens_per_block,
        physical_per_logical=physical_per_logical,
        kv_layout=kv_layout,
        dtype=dtype,
    )


def region_bytes(layout: wire.RegionLayout) -> int:
    """The smallest region size that holds every chunk of the layout."""
    return (
        (layout.num_blocks - 1) * layout.block_stride
        + (layout.num_layers - 1) * layout.layer_stride
        + (layout.kv_parts - 1) * layout.kv_stride
        + layout.chunk_bytes
    )


def compat_hash(
    *,
    model: str,
    dtype: str,
    num_kv_heads: int,
    head_size: int,
    num_layers: int,
    tokens_per_block: int,
    kv_layout: str,
    transfer_mode: str,
) -> str:
    """Stable hex digest of what must agree between the two ends of a transfer."""
    text = "|".join(
        str(x)
        for x in (
            wire.PROTOCOL_VERSION,
            model,
            dtype,
            num_kv_heads,
            head_size,
            num_layers,
            tokens_per_block,
            kv_layout,
            transfer_mode,
        )
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]
