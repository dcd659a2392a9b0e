"""A numpy reference of what D's KV must hold after a transfer from P, for any TP, block
size, token layout (NHD/HND), region layout (block-/layer-major), MLA and replicated heads.

It works in the model's terms, not in byte offsets: a request's KV is a tensor
``[token, layer, part, global head, byte]``; a rank holds some of its heads; a side's
blocks hold consecutive tokens. P's regions are filled from that tensor, and D's expected
bytes are read back out of it, through strided numpy views of each region built from the
layout record: nothing here shares code with the planner.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from kvd_client import layout as kvlayout
from kvd_client import wire
from kvd_client.layout import KvSpec


@dataclass(frozen=True)
class Side:
    """One engine's KV format (the model's part is the shared `KvSpec`)."""

    tp: int
    tokens: int = 16
    """Tokens per physical block."""
    kv_layout: str = "NHD"
    major: str = "block"
    num_blocks: int = 48

    def label(self) -> str:
        return f"tp{self.tp}-b{self.tokens}-{self.kv_layout}-{self.major[0]}"


def spec_of(heads: int, *, mla: bool = False, head_size: int = 8, layers: int = 2) -> KvSpec:
    return KvSpec("org/sim-model", "bfloat16", heads, head_size, layers, mla)


def compat(spec: KvSpec) -> str:
    return kvlayout.kv_spec(
        model=spec.model,
        dtype=spec.dtype,
        num_kv_heads=spec.num_kv_heads,
        head_size=spec.head_size,
        num_layers=spec.num_layers,
        mla=spec.mla,
    )


def heads_of(spec: KvSpec, tp: int, rank: int) -> range:
    """Global heads a rank holds (independent of KvSpec.heads_on on purpose)."""
    if spec.mla:
        return range(0, 1)
    h = spec.num_kv_heads
    if h >= tp:
        return range(rank * (h // tp), (rank + 1) * (h // tp))
    rep = tp // h
    return range(rank // rep, rank // rep + 1)


def rank_layout(spec: KvSpec, side: Side, rank: int) -> wire.RegionLayout:
    chunk = side.tokens * len(heads_of(spec, side.tp, rank)) * spec.head_bytes
    make = kvlayout.block_major if side.major == "block" else kvlayout.layer_major
    return make(
        side.num_blocks,
        spec.num_layers,
        chunk,
        kv_parts=1 if spec.mla else 2,
        tokens_per_block=side.tokens,
        dtype=spec.dtype,
        kv_layout=side.kv_layout,
    )


def kv_view(buf: np.ndarray, lay: wire.RegionLayout, heads: int, head_bytes: int) -> np.ndarray:
    """A writable ``[block, layer, part, token, head, byte]`` view of a region's bytes."""
    t = lay.tokens_per_block
    if lay.kv_layout == "NHD":
        tok, head = heads * head_bytes, head_bytes
    else:
        tok, head = head_bytes, t * head_bytes
    shape = (lay.num_blocks, lay.num_layers, lay.kv_parts, t, heads, head_bytes)
    strides = (lay.block_stride, lay.layer_stride, lay.kv_stride, tok, head, 1)
    return np.lib.stride_tricks.as_strided(buf, shape=shape, strides=strides)


def request_kv(spec: KvSpec, tokens: int, rng: np.random.Generator) -> np.ndarray:
    """A request's KV: ``[token, layer, part, global head, byte]`` random bytes."""
    parts = 1 if spec.mla else 2
    heads = 1 if spec.mla else spec.num_kv_heads
    return rng.integers(0, 256, (tokens, spec.num_layers, parts, heads, spec.head_bytes), np.uint8)


def fill(
    buf: np.ndarray,
    lay: wire.RegionLayout,
    spec: KvSpec,
    tp: int,
    rank: int,
    blocks: list[int],
    kv: np.ndarray,
) -> None:
    """Write the rank's heads of `kv` (tokens from 0, `lay.tokens_per_block` per block) into
    `blocks` of the region (the last block may be partly filled; its tail keeps its bytes)."""
    hs = heads_of(spec, tp, rank)
    view = kv_view(buf, lay, len(hs), spec.head_bytes)
    t = lay.tokens_per_block
    for i, b in enumerate(blocks):
        part = kv[i * t : (i + 1) * t, :, :, hs.start : hs.stop]  # [tok, layer, part, head, byte]
        view[b, :, :, : part.shape[0]] = part.transpose(1, 2, 0, 3, 4)


def expected(
    before: np.ndarray,
    lay: wire.RegionLayout,
    spec: KvSpec,
    tp: int,
    rank: int,
    blocks: list[int],
    first_token: int,
    kv: np.ndarray,
    only: tuple[int, int] | None = None,
) -> np.ndarray:
    """D rank's region after the transfer: `blocks` hold the request's tokens from
    `first_token` on (as far as `kv` goes); every other byte as `before`. `only`: just
    the tokens in [lo, hi) are written (the rest of those blocks as `before`)."""
    out = before.copy()
    hs = heads_of(spec, tp, rank)
    view = kv_view(out, lay, len(hs), spec.head_bytes)
    t = lay.tokens_per_block
    lo_tok, hi_tok = only if only is not None else (0, kv.shape[0])
    for i, b in enumerate(blocks):
        lo = max(first_token + i * t, lo_tok)
        hi = min(first_token + (i + 1) * t, hi_tok, kv.shape[0])
        if hi > lo:
            part = kv[lo:hi, :, :, hs.start : hs.stop]
            at = lo - (first_token + i * t)
            view[b, :, :, at : at + part.shape[0]] = part.transpose(1, 2, 0, 3, 4)
    return out
