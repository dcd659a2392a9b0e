"""How TP cuts vLLM's Mamba-style state (`kvd_client.vllm.groups.state_parts`), checked
against vLLM's own `MambaStateShapeCalculator` at every TP: the description is the same
at every TP (P and D must agree on it), it cuts exactly a rank's state bytes, and each
rank's share of a model's whole state (x by heads, B and C by groups, replicated when
fewer than TP; GDN's q, k, v by heads) is what the description's units give that rank.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("vllm")

import torch
from kvd_client.layout import shard_units, state_part_bytes
from kvd_client.vllm.groups import state_parts
from vllm.model_executor.layers.mamba.mamba_utils import (
    MambaStateShapeCalculator as Calc,
)
from vllm.v1.attention.backends.registry import MambaAttentionBackendEnum as Kind
from vllm.v1.kv_cache_interface import MambaSpec

BF16 = (torch.bfloat16, torch.bfloat16)


def mamba2(tp: int, nh: int, hd: int, ng: int, ds: int, k: int) -> MambaSpec:
    shapes = Calc.mamba2_state_shape(tp, nh * hd, ng, nh, hd, ds, k)
    return MambaSpec(block_size=16, shapes=shapes, dtypes=BF16, mamba_type=Kind.MAMBA2)


def gdn(tp: int, nk: int, nv: int, hk: int, hv: int, k: int) -> MambaSpec:
    shapes = Calc.gated_delta_net_state_shape(tp, nk, nv, hk, hv, k)
    return MambaSpec(block_size=16, shapes=shapes, dtypes=BF16, mamba_type=Kind.GDN_ATTN)


def content_bytes(spec: MambaSpec) -> int:
    return sum(int(np.prod(s)) * 2 for s in spec.shapes)


def rank_bytes(parts: tuple, tp: int, rank: int, whole: list[list[np.ndarray]]) -> bytes:
    """A rank's chunk cut from the model's whole state by the description: per part, per
    row, each shard's units that rank holds (`whole[part][row]` is a list of per-shard
    arrays of [units, unit_bytes])."""
    out = bytearray()
    for p, part in enumerate(parts):
        for row in range(part.rows):
            for s, shard in enumerate(part.shards):
                units = shard_units(shard.units, tp, rank)
                out += whole[p][row][s][units.start : units.stop].tobytes()
    return bytes(out)


@pytest.mark.parametrize(
    ("nh", "hd", "ng", "ds", "k"),
    [(8, 4, 1, 8, 4), (8, 4, 2, 8, 4), (8, 4, 8, 4, 4), (8, 2, 4, 16, 3)],
)
def test_mamba2_cut_is_one_description_that_cuts_each_rank_as_vllm_shards(
    nh: int, hd: int, ng: int, ds: int, k: int
) -> None:
    hf = SimpleNamespace(n_groups=ng)
    # vLLM runs Mamba2 where the groups split over TP, or there is one (replicated)
    tps = [tp for tp in (1, 2, 4, 8) if ng % tp == 0 or ng == 1]
    for tp in {1, 2, 4, 8} - set(tps):
        assert state_parts(mamba2(tp, nh, hd, ng, ds, k), tp, hf) == ()
    cuts = {tp: state_parts(mamba2(tp, nh, hd, ng, ds, k), tp, hf) for tp in tps}
    assert cuts[1], "no description at TP 1"
    assert all(c == cuts[1] for c in cuts.values()), cuts
    parts = cuts[1]
    conv, ssm = parts
    assert conv.rows == k - 1 and [s.units for s in conv.shards] == [nh, ng, ng]
    assert [s.units for s in ssm.shards] == [nh]
    rng = np.random.default_rng(0)
    # the whole model's state: per conv row x [heads, hd], B and C [groups, ds]; SSM [heads]
    x = rng.integers(0, 256, (k - 1, nh, hd * 2), dtype=np.uint8)
    b = rng.integers(0, 256, (k - 1, ng, ds * 2), dtype=np.uint8)
    c = rng.integers(0, 256, (k - 1, ng, ds * 2), dtype=np.uint8)
    h = rng.integers(0, 256, (nh, hd * ds * 2), dtype=np.uint8)
    whole = [[[x[r], b[r], c[r]] for r in range(k - 1)], [[h]]]
    for tp in tps:
        spec = mamba2(tp, nh, hd, ng, ds, k)
        assert sum(state_part_bytes(p, tp) for p in parts) == content_bytes(spec)
        ext = ng + Calc.extra_groups_for_head_shards(ng, tp)
        for rank in range(tp):
            # vLLM: a rank's conv row is [its heads' x, its groups' B, its groups' C] (a
            # group replicated over the ranks of the heads that use it), SSM its heads
            heads = slice(rank * nh // tp, (rank + 1) * nh // tp)
            g = slice(rank * ext // tp, (rank + 1) * ext // tp)
            if ext != ng:  # one group, replicated: every rank loads group 0
                g = slice(0, 1)
            want = b""
            for r in range(k - 1):
                want += x[r][heads].tobytes() + b[r][g].tobytes() + c[r][g].tobytes()
            want += h[heads].tobytes()
            assert rank_bytes(parts, tp, rank, whole) == want, (tp, rank)


def test_gdn_cut_is_one_description_over_tp() -> None:
    nk, nv, hk, hv, k = 4, 8, 16, 16, 4
    cuts = {tp: state_parts(gdn(tp, nk, nv, hk, hv, k), tp, None) for tp in (1, 2, 4)}
    assert cuts[1] and all(c == cuts[1] for c in cuts.values()), cuts
    conv, ssm = cuts[1]
    assert conv.rows == k - 1 and [s.units for s in conv.shards] == [nk, nk, nv]
    assert [(s.units, s.unit_bytes) for s in ssm.shards] == [(nv, hv * hk * 2)]
    for tp in (1, 2, 4):
        spec = gdn(tp, nk, nv, hk, hv, k)
        assert sum(state_part_bytes(p, tp) for p in cuts[1]) == content_bytes(spec)


def test_what_cannot_be_described_moves_at_equal_tp_only() -> None:
    # groups replicated at TP 2 and the HF config silent about them: not inferred
    assert state_parts(mamba2(2, 8, 4, 1, 8, 4), 2, SimpleNamespace()) == ()
    # made-up shapes (not a Mamba2 conv of these heads)
    odd = MambaSpec(block_size=16, shapes=((4, 33), (2, 16, 8)), dtypes=BF16)
    assert state_parts(odd, 1, SimpleNamespace(n_groups=1)) == ()
    # another state kind
    short = MambaSpec(
        block_size=16, shapes=((3, 64),), dtypes=(torch.bfloat16,), mamba_type=Kind.SHORT_CONV
    )
    assert state_parts(short, 1, None) == ()
    # a state every rank holds whole: one replicated piece
    whole = MambaSpec(
        block_size=16, shapes=((3, 64),), dtypes=(torch.bfloat16,), tp_replicated=True
    )
    (part,) = state_parts(whole, 4, None)
    assert state_part_bytes(part, 4) == state_part_bytes(part, 1) == 3 * 64 * 2


def test_mamba2_cut_in_the_channels_first_conv_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's "DS" conv layout ([channels][state_len]): one row, a unit holds a head's (or
    group's) channels with their whole history; a rank's bytes as vLLM shards them."""
    from vllm.model_executor.layers.mamba import mamba_utils

    monkeypatch.setattr(mamba_utils, "is_conv_state_dim_first", lambda: True)
    nh, hd, ng, ds, k = 8, 4, 2, 8, 4
    hf = SimpleNamespace(n_groups=ng)
    cuts = {tp: state_parts(mamba2(tp, nh, hd, ng, ds, k), tp, hf) for tp in (1, 2)}
    assert cuts[1] and cuts[1] == cuts[2]
    conv, _ = cuts[1]
    slen = k - 1
    assert conv.rows == 1
    assert [(s.units, s.unit_bytes) for s in conv.shards] == [
        (nh, hd * slen * 2),
        (ng, ds * slen * 2),
        (ng, ds * slen * 2),
    ]
    rng = np.random.default_rng(1)
    x = rng.integers(0, 256, (nh, hd * slen * 2), dtype=np.uint8)
    b = rng.integers(0, 256, (ng, ds * slen * 2), dtype=np.uint8)
    c = rng.integers(0, 256, (ng, ds * slen * 2), dtype=np.uint8)
    h = rng.integers(0, 256, (nh, hd * ds * 2), dtype=np.uint8)
    for tp in (1, 2):
        assert mamba2(tp, nh, hd, ng, ds, k).shapes[0][1] == slen  # (channels, state_len)
        for rank in range(tp):
            heads = slice(rank * nh // tp, (rank + 1) * nh // tp)
            g = slice(rank * ng // tp, (rank + 1) * ng // tp)
            want = x[heads].tobytes() + b[g].tobytes() + c[g].tobytes() + h[heads].tobytes()
            assert rank_bytes(cuts[1], tp, rank, [[[x, b, c]], [[h]]]) == want
