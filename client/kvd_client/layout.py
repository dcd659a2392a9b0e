"""Helpers to describe a KV region: its layout record and the compatibility hash.

A region declares a `compat` string. Either an opaque hash (`compat_hash`): two regions
exchange blocks only if their hashes match (protocol version, model, dtype, KV heads,
head size, layers, tokens per block, token layout and transfer mode all go into it), at
equal TP. Or a structured KV spec (`kv_spec`): model, dtype, KV heads, head size, layers
and MLA must agree, and kvd maps different TP sizes, block sizes and token layouts
(NHD/HND) onto each other itself (see the README's support matrix).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

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


# ----------------------------------------------------------------------- KV spec

KV_SPEC_PREFIX = "kvspec1"
"""First field of a structured compat string (`kv_spec`)."""

DTYPE_BYTES: dict[str, int] = {
    "float32": 4,
    "float": 4,
    "bfloat16": 2,
    "float16": 2,
    "half": 2,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
"""Bytes per element of the dtypes a KV spec may name."""

_SPEC_LIMIT = 128  # wire limit of a compat string


@dataclass(frozen=True, slots=True)
class KvSpec:
    """What a KV region holds, in the terms that decide how two sides map onto each other.

    A region whose compat is a KV spec (`kv_spec`) may exchange blocks with a region of a
    different TP size, block size or token layout (NHD/HND): kvd maps heads, tokens and
    layouts itself. Model, dtype, KV heads, head size, layers and MLA must agree.
    """

    model: str
    dtype: str
    num_kv_heads: int
    """KV heads of the whole model (all TP ranks together); 1 for MLA."""
    head_size: int
    """Elements per head (for MLA: the latent KV width, rope part included)."""
    num_layers: int
    mla: bool = False
    """One latent KV per token, replicated on every TP rank (kv_parts 1)."""

    @property
    def head_bytes(self) -> int:
        return self.head_size * DTYPE_BYTES[self.dtype]

    def heads_on(self, tp_size: int, tp_rank: int) -> tuple[int, int]:
        """(first global head, count) that rank `tp_rank` of `tp_size` holds.

        KV heads are split evenly over the ranks; with fewer heads than ranks each head
        is replicated on tp_size / num_kv_heads consecutive ranks (vLLM's rule); MLA's
        latent is on every rank. Raises ValueError for a split that does not divide.
        """
        if self.mla:
            return 0, 1
        heads = self.num_kv_heads
        if heads >= tp_size:
            if heads % tp_size:
                raise ValueError(f"{heads} KV heads do not split over TP {tp_size}")
            per = heads // tp_size
            return tp_rank * per, per
        if tp_size % heads:
            raise ValueError(f"TP {tp_size} is not a multiple of {heads} KV heads")
        return tp_rank * heads // tp_size, 1


def kv_spec(
    *,
    model: str,
    dtype: str,
    num_kv_heads: int,
    head_size: int,
    num_layers: int,
    mla: bool = False,
) -> str:
    """A structured compat string (see `KvSpec`), at most 128 characters.

    A model name too long to fit is shortened to a prefix and a hash of the whole name.
    """
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    for name, value in (
        ("num_kv_heads", num_kv_heads),
        ("head_size", head_size),
        ("num_layers", num_layers),
    ):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")
    if mla and num_kv_heads != 1:
        raise ValueError(f"MLA has one latent KV head, got num_kv_heads={num_kv_heads}")
    head = "|".join(
        (KV_SPEC_PREFIX, dtype, str(num_kv_heads), str(head_size), str(num_layers), str(int(mla)))
    )
    room = _SPEC_LIMIT - len(head) - 1
    if len(model) > room:
        digest = hashlib.sha256(model.encode()).hexdigest()[:12]
        model = f"{model[: room - 13]}#{digest}"
    return f"{head}|{model}"


def parse_kv_spec(compat: str) -> KvSpec | None:
    """The KvSpec a compat string states; None for an opaque compat (`compat_hash`).

    Raises ValueError for a string that claims to be a spec but is malformed.
    """
    if not compat.startswith(KV_SPEC_PREFIX + "|"):
        return None
    parts = compat.split("|", 6)
    if len(parts) != 7:
        raise ValueError(f"malformed KV spec {compat!r}: expected 7 '|'-separated fields")
    _, dtype, heads, size, layers, mla, model = parts
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"KV spec dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    nums: list[int] = []
    for name, text in (("num_kv_heads", heads), ("head_size", size), ("num_layers", layers)):
        if not text.isdigit() or int(text) <= 0 or len(text) > 9:
            raise ValueError(f"KV spec {name} {text!r} is not a positive int")
        nums.append(int(text))
    if mla not in ("0", "1"):
        raise ValueError(f"KV spec mla flag {mla!r} is not 0 or 1")
    if mla == "1" and nums[0] != 1:
        raise ValueError(f"KV spec: MLA has one latent KV head, not {nums[0]}")
    if not model:
        raise ValueError("KV spec names no model")
    return KvSpec(model, dtype, nums[0], nums[1], nums[2], mla == "1")


def kv_region_layout(
    spec: KvSpec,
    *,
    tp_size: int,
    tp_rank: int,
    num_blocks: int,
    tokens_per_block: int,
    kv_layout: str = "NHD",
    layer_major: bool = False,
) -> wire.RegionLayout:
    """The layout of one rank's region for a KV spec: chunks of tokens_per_block tokens x
    the rank's heads x head bytes, in `kv_layout` (NHD or HND); K and V apart (one latent
    chunk for MLA); block-major unless `layer_major`."""
    _, heads = spec.heads_on(tp_size, tp_rank)
    make = _LAYER_MAJOR if layer_major else block_major
    return make(
        num_blocks,
        spec.num_layers,
        tokens_per_block * heads * spec.head_bytes,
        kv_parts=1 if spec.mla else 2,
        tokens_per_block=tokens_per_block,
        dtype=spec.dtype,
        kv_layout=kv_layout,
    )


_LAYER_MAJOR = layer_major


# ----------------------------------------------------------------- hybrid models

GROUP_KINDS = ("full", "window", "state")
"""Kinds of KV cache group a hybrid region may hold (`wire.KvGroup`)."""

STATE_SPEC_PREFIX = "statespec1"
"""First field of a state group's compat string (`state_spec`)."""

HYBRID_PREFIX = "hybrid1"
"""First field of a hybrid region's own compat string (`hybrid_compat`)."""

GROUP_ALIGN = 64
"""Bytes each group's part of a hybrid region is aligned to (`hybrid_region`)."""


@dataclass(frozen=True, slots=True)
class StateSpec:
    """What a state group holds per rank: per layer, one slot of `slot_bytes` bytes (K/V
    parts together) of a recurrent state (Mamba conv+SSM, Gated DeltaNet). It is not paged
    by tokens, so block sizes and token layouts do not apply; its inner shape is the
    model's, so it maps only rank i to rank i at equal TP, slot for slot."""

    model: str
    dtype: str
    slot_bytes: int
    num_layers: int


def state_spec(*, model: str, dtype: str, slot_bytes: int, num_layers: int) -> str:
    """A state group's compat string (see `StateSpec`), at most 128 characters."""
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    for name, value in (("slot_bytes", slot_bytes), ("num_layers", num_layers)):
        if not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name}={value!r} must be a positive int")
    head = "|".join((STATE_SPEC_PREFIX, dtype, str(slot_bytes), str(num_layers)))
    room = _SPEC_LIMIT - len(head) - 1
    if len(model) > room:
        digest = hashlib.sha256(model.encode()).hexdigest()[:12]
        model = f"{model[: room - 13]}#{digest}"
    return f"{head}|{model}"


def parse_state_spec(compat: str) -> StateSpec:
    """The StateSpec a state group's compat states; ValueError for anything else."""
    parts = compat.split("|", 4)
    if len(parts) != 5 or parts[0] != STATE_SPEC_PREFIX:
        raise ValueError(f"state group compat {compat!r} is not a state spec (state_spec)")
    _, dtype, slot, layers, model = parts
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"state spec dtype {dtype!r} is not one of {sorted(DTYPE_BYTES)}")
    nums: list[int] = []
    for name, text in (("slot_bytes", slot), ("num_layers", layers)):
        if not text.isdigit() or int(text) <= 0 or len(text) > 12:
            raise ValueError(f"state spec {name} {text!r} is not a positive int")
        nums.append(int(text))
    if not model:
        raise ValueError("state spec names no model")
    return StateSpec(model, dtype, nums[0], nums[1])


def shard_units(units: int, tp: int, rank: int) -> range:
    """The units of a `wire.StateShard` of `units` that rank `rank` of `tp` holds: an even
    split, or (units < tp) one replicated unit. ValueError where neither divides."""
    if units >= tp:
        if units % tp:
            raise ValueError(f"{units} units do not split over {tp} ranks")
        n = units // tp
        return range(rank * n, (rank + 1) * n)
    if tp % units:
        raise ValueError(f"{units} units cannot be replicated over {tp} ranks")
    u = rank // (tp // units)
    return range(u, u + 1)


def state_part_bytes(part: wire.StatePart, tp: int) -> int:
    """Bytes of a rank's chunk of a state part cut as `part` at TP `tp`."""
    row = sum(len(shard_units(s.units, tp, 0)) * s.unit_bytes for s in part.shards)
    return part.rows * row


def hybrid_compat(model: str) -> str:
    """The compat string of a hybrid region itself (its groups carry their own)."""
    text = f"{HYBRID_PREFIX}|{model}"
    if len(text) > _SPEC_LIMIT:
        text = f"{HYBRID_PREFIX}|#{hashlib.sha256(model.encode()).hexdigest()[:32]}"
    return text


def window_blocks(window_tokens: int, tokens_per_block: int) -> int:
    """Blocks at the end of a request that can hold a token its next step attends to,
    with a sliding window of `window_tokens` (the last window_tokens - 1 tokens, wherever
    the request ends inside its last block): the blocks a window group moves at most."""
    if window_tokens <= 0 or tokens_per_block <= 0:
        raise ValueError(f"window {window_tokens} / block size {tokens_per_block} must be > 0")
    return -(-(window_tokens - 1) // tokens_per_block) + 1


def group_bases(groups: tuple[wire.KvGroup, ...]) -> tuple[int, ...]:
    """First logical id of each group in a hybrid region's id space."""
    out: list[int] = []
    at = 0
    for g in groups:
        out.append(at)
        at += g.layout.num_blocks
    return tuple(out)


def hybrid_layout(groups: tuple[wire.KvGroup, ...]) -> wire.RegionLayout:
    """The `layout` a hybrid region registers with: its block id space (one byte-sized
    'chunk' per logical id, the groups' ids one after the other); the bytes are the
    groups' (`wire.KvGroup.layout`). kvd refuses a hybrid region with any other."""
    total = sum(g.layout.num_blocks for g in groups)
    return wire.RegionLayout(
        num_blocks=max(total, 1),
        num_layers=1,
        kv_parts=1,
        chunk_bytes=1,
        block_stride=1,
        layer_stride=0,
        kv_stride=0,
        tokens_per_block=1,
        physical_per_logical=1,
        kv_layout="NHD",
        dtype="uint8",
    )


def hybrid_region(
    parts: list[tuple[str, wire.RegionLayout, str, int]],
) -> tuple[wire.RegionLayout, tuple[wire.KvGroup, ...], int]:
    """A hybrid region from its groups, each (kind, layout, compat, window_tokens), placed
    one after the other (each aligned to GROUP_ALIGN bytes): (the region's layout, its
    groups, the bytes it needs)."""
    groups: list[wire.KvGroup] = []
    at = 0
    for kind, lay, compat, window in parts:
        if kind not in GROUP_KINDS:
            raise ValueError(f"group kind {kind!r} is not one of {GROUP_KINDS}")
        at = -(-at // GROUP_ALIGN) * GROUP_ALIGN
        groups.append(wire.KvGroup(kind, window, at, lay, compat))
        at += region_bytes(lay)
    out = tuple(groups)
    return hybrid_layout(out), out, at
