"""KV cache groups of a hybrid vLLM model (`SupportsHMA`) as one kvd hybrid region.

vLLM's hybrid allocator gives every group (full attention, sliding window, Mamba/DeltaNet
state) block ids from one pool; a group's layers are indexed by its own ids. The worker
stages each group in its own part of one shared-memory region (`HybridStaging`), with the
group's ids at `base(g) + id` of the region's block id space (`kvd_client.layout.
hybrid_region`), so a request's blocks of every group travel as one id list: one
registration, one lease, one heartbeat stream, one done per request, as for one group.

What each group moves (the daemon's rules, `kvd.core.hybrid`): full groups every computed
block; sliding-window groups only the blocks holding the window's tokens (the last
window - 1 before the end: P and D clip alike from the same token count, so their tails
pair exactly; D copies in only those); state groups the request's running-state slot
(vLLM's speculative scratch slots are not sent). As vLLM's NixlConnector does, a model
with state makes P stop one prompt token short (`backoff`): D loads the state after
N - 1 tokens and computes the last one itself (its state must not take it twice).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

from kvd_client import layout as kvlayout
from kvd_client import wire
from kvd_client.layout import shard_units, state_part_bytes
from kvd_client.vllm.staging import (
    HostStaging,
    ModelKv,
    describe,
    host_register,
    host_unregister,
    staged_format,
)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


_KINDS: dict[type[Any], str] = {
    FullAttentionSpec: "full",
    MLAAttentionSpec: "full",
    SlidingWindowSpec: "window",
    SlidingWindowMLASpec: "window",
    MambaSpec: "state",
}


@dataclass(frozen=True)
class GroupInfo:
    kind: str
    window: int
    """Sliding window in tokens (kind "window")."""
    block_size: int
    """Tokens per block (attention groups)."""
    spec_slots: int
    """Speculative scratch slots a state group allocates after its running state."""
    layers: tuple[str, ...]
    spec: Any = None
    """vLLM's KV cache spec of the group (a state group's `MambaSpec`: `state_parts`)."""


_GROUP_ATTRS = ("n_groups", "mamba_n_groups", "mamba_ngroups", "ngroups")
"""Where hybrid models' HF configs name Mamba2's number of groups (Mamba2, NemotronH,
Granite 4 / Falcon-H1, Zamba2)."""


def state_parts(spec: Any, tp: int, hf_config: Any) -> tuple[wire.StatePart, ...]:
    """How TP cuts a state group's chunk (`wire.KvGroup.parts`), from vLLM's `MambaSpec`
    at TP `tp` and the model's HF config, as vLLM shards it
    (`MambaStateShapeCalculator`): a chunk is the layer's conv state then its SSM state.

    - Mamba2: conv channels [x by heads, B and C by groups] (a single group is replicated
      on every rank: `extra_groups_for_head_shards`), SSM state by heads;
    - Gated DeltaNet: conv channels [q and k by key heads, v by value heads], SSM state by
      value heads;
    - Mamba1: conv channels and SSM state by channels;
    - a state every rank holds whole (`tp_replicated`): one replicated piece.

    The conv state is [state_len][channels] (vLLM's "SD" layout: `rows` = state_len) or
    [channels][state_len] ("DS"). Empty (the group then maps only rank i to rank i at
    equal TP, and the daemon says so) for any other state, or where the shapes do not
    decompose so (or Mamba2's groups are not in the HF config and cannot be inferred)."""
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.utils.torch_utils import get_dtype_size

    shapes = tuple(tuple(int(x) for x in shape) for shape in spec.shapes)
    sizes = [int(get_dtype_size(dt)) for dt in spec.dtypes]
    content = sum(math.prod(shape) * e for shape, e in zip(shapes, sizes, strict=True))
    if getattr(spec, "tp_replicated", False):
        return (wire.StatePart(1, (wire.StateShard(1, content),)),)
    kind = getattr(getattr(spec, "mamba_type", None), "name", "")
    if len(shapes) != 2 or len(shapes[0]) != 2:
        return ()
    dim_first = is_conv_state_dim_first()
    dim, slen = shapes[0] if dim_first else shapes[0][::-1]
    e0, e1 = sizes
    per = slen * e0 if dim_first else e0  # a channel's bytes in one row
    rows = 1 if dim_first else slen
    ssm = shapes[1]
    conv: tuple[wire.StateShard, ...]
    temporal: tuple[wire.StateShard, ...]
    try:
        if kind == "MAMBA2" and len(ssm) == 3:
            nh, hd, ds = ssm
            b_c = dim - nh * hd
            if b_c <= 0 or b_c % (2 * ds):
                return ()
            groups_r = b_c // (2 * ds)
            groups = next(
                (int(v) for a in _GROUP_ATTRS if isinstance(v := getattr(hf_config, a, None), int)),
                groups_r * tp if groups_r > 1 else 0,
            )
            if groups <= 0 or (groups % tp and groups != 1):
                return ()  # (vLLM replicates a single group only)
            if len(shard_units(groups, tp, 0)) != groups_r:
                return ()
            conv = (
                wire.StateShard(nh * tp, hd * per),
                wire.StateShard(groups, ds * per),
                wire.StateShard(groups, ds * per),
            )
            temporal = (wire.StateShard(nh * tp, hd * ds * e1),)
        elif kind == "GDN_ATTN" and len(ssm) == 3:
            nv, hv, hk = ssm
            qk = dim - nv * hv
            if qk <= 0 or qk % (2 * hk):
                return ()
            nk = qk // (2 * hk)
            conv = (
                wire.StateShard(nk * tp, hk * per),
                wire.StateShard(nk * tp, hk * per),
                wire.StateShard(nv * tp, hv * per),
            )
            temporal = (wire.StateShard(nv * tp, hv * hk * e1),)
        elif kind == "MAMBA1" and len(ssm) == 2 and ssm[0] == dim:
            conv = (wire.StateShard(dim * tp, per),)
            temporal = (wire.StateShard(dim * tp, ssm[1] * e1),)
        else:
            return ()
        parts = (wire.StatePart(rows, conv), wire.StatePart(1, temporal))
        if sum(state_part_bytes(p, tp) for p in parts) != content:
            return ()
    except ValueError:  # (units that cannot be cut over this TP)
        return ()
    return parts


class KvGroups:
    """The groups of a hybrid KVCacheConfig and how a request's blocks map to region ids."""

    def __init__(self, groups: list[GroupInfo], num_blocks: int) -> None:
        self.groups = groups
        self.num_blocks = num_blocks

    @classmethod
    def from_config(cls, kv_cache_config: Any) -> KvGroups | None:
        """The groups of a hybrid config; None for one full-attention group (a plain
        region). Raises ValueError, naming the group, for what kvd cannot transfer."""
        groups: list[GroupInfo] = []
        for i, g in enumerate(kv_cache_config.kv_cache_groups):
            spec = g.kv_cache_spec
            kind = _KINDS.get(type(spec))
            if kind is None:
                raise ValueError(
                    f"KvdConnector cannot transfer KV cache group {i} "
                    f"({type(spec).__name__}): supported are full attention, sliding window "
                    "and Mamba-style state"
                )
            if not getattr(g, "enable_kv_transfer", True):
                raise ValueError(f"KV cache group {i} does not take part in KV transfer")
            groups.append(
                GroupInfo(
                    kind,
                    int(spec.sliding_window) if kind == "window" else 0,
                    int(spec.block_size),
                    int(spec.num_speculative_blocks) if kind == "state" else 0,
                    tuple(g.layer_names),
                    spec,
                )
            )
        if len(groups) == 1 and groups[0].kind == "full":
            return None
        return cls(groups, int(kv_cache_config.num_blocks))

    @property
    def backoff(self) -> int:
        """Prompt tokens P leaves for D to compute (1 with a state group)."""
        return 1 if any(g.kind == "state" for g in self.groups) else 0

    def base(self, g: int) -> int:
        return g * self.num_blocks

    def _held(self, g: int, ids: Sequence[int], start: int, end: int, null: int) -> list[int]:
        """Group g's blocks worth moving for tokens [start, end) (`ids`: the group's list,
        by position from token 0), as the group's own ids: a full group's blocks holding
        those tokens; a window group's blocks holding the last window - 1 tokens before
        `end` (P and D clip alike from the same token count, so their tails pair exactly,
        within the daemon's `window_blocks` bound); a state group's running slot."""
        info = self.groups[g]
        if info.kind == "state":
            real = [b for b in ids if b != null]
            if info.spec_slots and len(real) > 1:
                real = real[: max(1, len(real) - info.spec_slots)]
            return real[-1:]
        first = start
        if info.kind == "window":
            first = max(start, end - (info.window - 1))
        span = list(ids[first // info.block_size : _cdiv(end, info.block_size)])
        return [b for b in span if b != null] if info.kind == "window" else span

    def to_region(self, per_group: Sequence[Sequence[int]]) -> tuple[list[int], ...]:
        return tuple([self.base(g) + b for b in ids] for g, ids in enumerate(per_group))

    def finished(
        self, block_ids: Sequence[Sequence[int]], tokens: int, null: int
    ) -> tuple[list[int], ...]:
        """P: the region ids of the blocks that move of a request whose first `tokens`
        tokens were computed, per group."""
        return self.to_region(
            [self._held(g, ids, 0, tokens, null) for g, ids in enumerate(block_ids)]
        )

    def loading(
        self, block_ids: Sequence[Sequence[int]], start: int, end: int, null: int
    ) -> tuple[list[int], ...]:
        """D: the region ids of the blocks that receive tokens [start, end) (start on a
        block boundary: the local hit), per group."""
        return self.to_region(
            [self._held(g, ids, start, end, null) for g, ids in enumerate(block_ids)]
        )

    def remote_for(
        self,
        remote: Sequence[Sequence[int]],
        start: int,
        end: int,
        remote_block_size: int,
    ) -> list[int] | None:
        """D (pull): P's region ids for D's blocks of tokens [start, end): full groups P's
        blocks holding those tokens, in P's block size (`remote_block_size`, 0: D's; None
        where `start` is not on a boundary of P's blocks: they cannot pair), window and
        state groups whole (the daemon aligns their tails)."""
        out: list[int] = []
        for info, ids in zip(self.groups, remote, strict=True):
            if info.kind == "full":
                pbs = remote_block_size or info.block_size
                if start % pbs:
                    return None
                out += list(ids[start // pbs : _cdiv(end, pbs)])
            else:
                out += list(ids)
        return out

    @property
    def kinds(self) -> list[str]:
        return [g.kind for g in self.groups]


class HybridStaging:
    """Host staging of a hybrid rank: one `HostStaging` per group, each in its part of one
    shared-memory region; ids are region ids (`KvGroups.base(g) + id`)."""

    def __init__(
        self,
        groups: KvGroups,
        kv_caches: Mapping[str, torch.Tensor],
        model: ModelKv,
        state_cuts: Sequence[tuple[wire.StatePart, ...]] = (),
    ) -> None:
        """`state_cuts`: per group, how TP cuts a state group's chunks (`state_parts`;
        empty for other groups, or all of them: the state then moves at equal TP only)."""
        self.groups = groups
        self.parts: list[tuple[str, wire.RegionLayout, str, int]] = []
        self._layers = []
        self._formats: list[str | None] = []
        for info in groups.groups:
            layers = describe({n: kv_caches[n] for n in info.layers}, groups.num_blocks)
            if info.kind == "state":
                lay = HostStaging.region_layout(layers, groups.num_blocks, info.block_size)
                compat = kvlayout.state_spec(
                    model=model.model,
                    dtype=lay.dtype,
                    slot_bytes=lay.kv_parts * lay.chunk_bytes,
                    num_layers=lay.num_layers,
                )
                fmt_layout: str | None = None
            else:  # a KV spec when the layers are K/V attention blocks (maps across TP)
                fmt = staged_format(model, layers, info.block_size)
                lay = HostStaging.region_layout(
                    layers, groups.num_blocks, info.block_size, fmt.kv_layout, fmt.dtype
                )
                compat, fmt_layout = fmt.compat, fmt.kv_layout
            self.parts.append((info.kind, lay, compat, info.window))
            self._layers.append(layers)
            self._formats.append(fmt_layout)
        self.layout, kv_groups, self.nbytes = kvlayout.hybrid_region(self.parts)
        cuts = list(state_cuts) or [()] * len(kv_groups)
        self.kv_groups = tuple(
            dataclasses.replace(g, parts=cut) if g.kind == "state" and cut else g
            for g, cut in zip(kv_groups, cuts, strict=True)
        )
        self._staging: list[HostStaging] = []
        self._pinned: torch.Tensor | None = None
        """The whole region's buffer, page-locked (GPU KV tensors only)."""

    def attach(self, buf: memoryview) -> None:
        """Start staging into the region's buffer (of `self.nbytes` bytes), page-locked
        once as a whole when the KV tensors are on a GPU (its groups' parts may share a
        page: CUDA refuses to lock a page twice)."""
        cuda = any(lay.blocks.device.type == "cuda" for layers in self._layers for lay in layers)
        if cuda:
            whole = torch.frombuffer(buf, dtype=torch.uint8, count=self.nbytes)
            self._pinned = whole if host_register(whole) else None
        for g, layers, fmt in zip(self.kv_groups, self._layers, self._formats, strict=True):
            size = kvlayout.region_bytes(g.layout)
            part = buf[g.offset : g.offset + size]
            pinned = self._pinned is not None if cuda else None
            self._staging.append(
                HostStaging(layers, self.groups.num_blocks, part, fmt, pinned=pinned)
            )

    def _split(self, ids: Sequence[int]) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.groups.groups]
        n = self.groups.num_blocks
        for b in ids:
            g = b // n
            if not 0 <= g < len(out):
                raise IndexError(f"region block id {b} is outside every KV cache group")
            out[g].append(b - g * n)
        return out

    def save(self, ids: Sequence[int]) -> None:
        for staging, part in zip(self._staging, self._split(ids), strict=True):
            staging.save(part)

    def load(self, ids: Sequence[int]) -> None:
        for staging, part in zip(self._staging, self._split(ids), strict=True):
            staging.load(part)

    def close(self) -> None:
        for staging in self._staging:
            staging.close()
        self._staging = []
        if self._pinned is not None:
            host_unregister(self._pinned)
            self._pinned = None
