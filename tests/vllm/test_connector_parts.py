"""The connector's vLLM-free parts: import hygiene, extra-config parsing, host staging.

Staging is checked on KV tensors shaped and strided the ways vLLM lays them out (block axis
first with permuted physical layouts, the older [2, blocks, ...] layout, kernel blocks
splitting a manager block): the bytes a block stages are its logical bytes, so a block
saved from one physical layout loads into another unchanged.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from kvd_client import wire
from kvd_client.layout import KvSpec, parse_kv_spec
from kvd_client.vllm.config import ConnectorConfig
from kvd_client.vllm.staging import (
    HostStaging,
    ModelKv,
    blocks_view,
    describe,
    staged_format,
)

HAVE_VLLM = importlib.util.find_spec("vllm") is not None
CLIENT_ROOT = Path(wire.__file__).resolve().parents[1]

PROBE = """
import json, sys
import kvd_client
after_client = sorted({m.split(".")[0] for m in sys.modules} & {"vllm", "torch", "kvd"})
import kvd_client.vllm
after_pkg = sorted({m.split(".")[0] for m in sys.modules} & {"vllm", "torch", "kvd"})
from kvd_client.vllm import KvdConnector
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import supports_hma
from vllm.config import KVTransferConfig
cls = KVConnectorFactory.get_connector_class(KVTransferConfig(
    kv_connector="KvdConnector", kv_connector_module_path="kvd_client.vllm", kv_role="kv_both"))
kvd = [m for m in sys.modules if m.split(".")[0] == "kvd"]
print(json.dumps({"client": after_client, "pkg": after_pkg, "same": cls is KvdConnector,
                  "hma": supports_hma(cls), "kvd": kvd}))
"""


@pytest.mark.vllm
@pytest.mark.skipif(
    not HAVE_VLLM, reason="vLLM 0.33 is not installed (scripts/install-vllm.sh installs it)"
)
def test_imports_stay_apart_and_vllm_finds_the_connector(tmp_path: Path) -> None:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    # an empty cwd, so that the repository root (and `kvd`) is not on sys.path by accident
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(CLIENT_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", PROBE],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["client"] == [], "import kvd_client pulled in vLLM, torch or the daemon"
    assert got["pkg"] == [], "import kvd_client.vllm is lazy: vLLM loads only with KvdConnector"
    assert got["same"] and got["hma"]
    assert got["kvd"] == [], "the connector imported the daemon"


# ---------------------------------------------------------------------- config


def test_config_defaults_and_nixl_keys(caplog: pytest.LogCaptureFixture) -> None:
    monkey_sock = "/tmp/kvd-test.sock"
    os.environ["KVD_SOCKET"] = monkey_sock
    try:
        cfg = ConnectorConfig.from_extra({})
    finally:
        del os.environ["KVD_SOCKET"]
    assert (
        cfg.socket,
        cfg.transfer_mode,
        cfg.kv_lease_duration,
        cfg.push_registration_timeout,
    ) == (monkey_sock, "pull", None, None)
    with caplog.at_level(logging.WARNING, logger="kvd_client.vllm"):
        cfg = ConnectorConfig.from_extra(
            {
                "kvd_socket": "/run/x.sock",
                "transfer_mode": "push",
                "kv_lease_duration": 20,
                "decoder_kv_blocks_ttl": 300,
                "backends": ["UCX"],
                "engine_ttl": 5,
                "typo_key": 1,
            }
        )
    assert (
        cfg.socket,
        cfg.transfer_mode,
        cfg.kv_lease_duration,
        cfg.push_registration_timeout,
    ) == ("/run/x.sock", "push", 20.0, None)
    assert (cfg.bidirectional, cfg.decoder_kv_blocks_ttl, cfg.kv_recompute_threshold) == (
        False,
        300.0,
        64,
    )
    text = caplog.text
    assert "nixl.backend" in text and "'engine_ttl'" in text and "'typo_key'" in text
    both = ConnectorConfig.from_extra(
        {
            "push_registration_timeout": 60,
            "decoder_kv_blocks_ttl": 300,
            "bidirectional_kv_xfer": True,
            "kv_recompute_threshold": 32,
        }
    )
    assert (both.push_registration_timeout, both.decoder_kv_blocks_ttl) == (60.0, 300.0)
    assert (both.bidirectional, both.kv_recompute_threshold) == (True, 32)
    assert cfg.check_daemon(20.0) == []
    (warning,) = cfg.check_daemon(30.0)
    assert "20.0s" in warning and "30.0s" in warning


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ({"transfer_mode": "write"}, "transfer_mode"),
        ({"kv_lease_duration": 0}, "kv_lease_duration"),
        ({"kv_lease_duration": "30"}, "kv_lease_duration"),
        ({"push_registration_timeout": float("nan")}, "push_registration_timeout"),
        ({"kvd_socket": 5}, "kvd_socket"),
        ({"bidirectional_kv_xfer": "yes"}, "bidirectional_kv_xfer"),
        ({"decoder_kv_blocks_ttl": -1}, "decoder_kv_blocks_ttl"),
        ({"decoder_kv_blocks_ttl": 1e6}, "decoder_kv_blocks_ttl"),
        ({"kv_recompute_threshold": 0}, "kv_recompute_threshold"),
    ],
)
def test_config_bad_values_name_the_key(extra: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        ConnectorConfig.from_extra(extra)


# ---------------------------------------------------------------------- staging

NB, H, N, C = 8, 2, 4, 6


def logical(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous()


def physical(order: tuple[int, ...]) -> torch.Tensor:
    """A [NB, H, N, C] bf16 view whose memory order is `order` (like vLLM's layouts)."""
    shape = (NB, H, N, C)
    raw = torch.empty([shape[i] for i in order], dtype=torch.bfloat16)
    inverse = [order.index(i) for i in range(4)]
    return raw.permute(*inverse)


def fill(t: torch.Tensor, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))


def test_block_axis_is_found_from_the_shape() -> None:
    t = torch.zeros(NB, H, N, C)
    assert blocks_view(t, NB).data_ptr() == t.data_ptr() and blocks_view(t, NB).shape == (
        NB,
        H,
        N,
        C,
    )
    legacy = torch.zeros(2, NB, N, H, C)  # [K/V, blocks, tokens, heads, dim]
    v = blocks_view(legacy, NB)
    assert v.shape == (NB, 2, N, H, C)
    v[3] = 1.0
    assert legacy[:, 3].eq(1.0).all() and legacy.sum() == 2 * N * H * C  # a view, not a copy
    split = torch.zeros(NB * 2, H, N // 2, C)  # two kernel blocks per manager block
    assert blocks_view(split, NB).shape == (NB, 2, H, N // 2, C)
    with pytest.raises(ValueError, match="holds 8 blocks"):
        blocks_view(torch.zeros(7, 3), NB)


@pytest.mark.parametrize("dst_order", [(0, 1, 2, 3), (0, 2, 1, 3), (1, 0, 2, 3)])
def test_blocks_cross_physical_layouts_byte_exact(dst_order: tuple[int, ...]) -> None:
    src = {f"l{i}": physical((0, 2, 1, 3)) for i in range(3)}  # LBNHC-like: [B, N, H, C] in memory
    for i, t in enumerate(src.values()):
        fill(t, i)
    dst = {f"l{i}": physical(dst_order) for i in range(3)}
    for t in dst.values():
        t.zero_()
    p_layers, d_layers = describe(src, NB), describe(dst, NB)
    assert HostStaging.signature(p_layers) == HostStaging.signature(d_layers)
    p_buf, d_buf = bytearray(NB * 3 * H * N * C * 2), bytearray(NB * 3 * H * N * C * 2)
    p_stage = HostStaging(p_layers, NB, memoryview(p_buf))
    d_stage = HostStaging(d_layers, NB, memoryview(d_buf))
    p_stage.save([1, 2, 5])
    # block-major: block b's bytes are every layer's logical bytes, back to back
    bb = p_stage.block_bytes
    assert bb == 3 * H * N * C * 2
    want = b"".join(logical(t[2]).view(torch.uint8).numpy().tobytes() for t in src.values())
    assert bytes(p_buf[2 * bb : 3 * bb]) == want
    assert bytes(p_buf[0:bb]) == bytes(bb)  # unstaged blocks untouched
    d_buf[:] = p_buf  # what NIXL does between the two regions
    d_stage.load([1, 2, 5])
    for s, d in zip(src.values(), dst.values(), strict=True):
        for b in range(NB):
            same = torch.equal(s[b].view(torch.int16), d[b].view(torch.int16))
            assert same == (b in (1, 2, 5)), b
    lay = HostStaging.region_layout(p_layers, NB, 16)
    assert (lay.num_blocks, lay.num_layers, lay.kv_parts, lay.block_stride) == (NB, 3, 1, bb)
    p_stage.close()
    d_stage.close()


def test_uneven_layers_stage_as_one_chunk_per_block() -> None:
    kv = {
        "a": torch.zeros(NB, H, N, C, dtype=torch.bfloat16),
        "b": torch.zeros(NB, 1, N, 2, dtype=torch.float32),
        "a_alias": torch.zeros(1),
    }
    kv["a_alias"] = kv["a"]  # layers sharing one KV (KV sharing) stage once
    layers = describe(kv, NB)
    assert [x.name for x in layers] == ["a", "b"]
    lay = HostStaging.region_layout(layers, NB, 16)
    assert lay.num_layers == 1 and lay.chunk_bytes == H * N * C * 2 + N * 2 * 4
    with pytest.raises(IndexError):
        HostStaging(layers, NB, memoryview(bytearray(NB * lay.chunk_bytes))).save([NB])


MODEL_KV = ModelKv(model="m", cache_dtype="auto", total_heads=2 * H, rank_heads=H, head_size=C // 2)


@pytest.mark.parametrize(("order", "want"), [((0, 2, 1, 3), "NHD"), ((0, 1, 2, 3), "HND")])
def test_attention_layers_stage_as_a_kv_spec_in_their_physical_order(
    order: tuple[int, ...], want: str
) -> None:
    """[blocks, heads, tokens, K|V] tensors stage per layer as K then V chunks of
    [token][head][elem] (NHD, tensors laid out LBNHC) or [head][token][elem] (HND, LBHNC):
    the chunks of the KV spec region the daemon maps; a load puts every value back."""
    src = {f"l{i}": physical(order) for i in range(2)}
    for i, t in enumerate(src.values()):
        fill(t, 10 + i)
    layers = describe(src, NB)
    fmt = staged_format(MODEL_KV, layers, N)
    assert fmt.kv_layout == want and fmt.dtype == "bfloat16"
    assert parse_kv_spec(fmt.compat) == KvSpec("m", "bfloat16", 2 * H, C // 2, 2)
    lay = HostStaging.region_layout(layers, NB, N, fmt.kv_layout, fmt.dtype)
    assert (lay.num_layers, lay.kv_parts, lay.chunk_bytes, lay.kv_layout) == (
        2,
        2,
        N * H * (C // 2) * 2,
        want,
    )
    buf = bytearray(NB * lay.block_stride)
    stage = HostStaging(layers, NB, memoryview(buf), fmt.kv_layout)
    stage.save([3, 6])
    for b in (3, 6):
        for i, t in enumerate(src.values()):
            kv = t[b].reshape(H, N, 2, C // 2)  # [head, token, K|V, elem]
            for part in (0, 1):
                x = kv[:, :, part, :]
                chunk = x.transpose(0, 1) if want == "NHD" else x
                at = b * lay.block_stride + i * lay.layer_stride + part * lay.kv_stride
                got = bytes(buf[at : at + lay.chunk_bytes])
                assert got == chunk.contiguous().view(torch.uint8).numpy().tobytes()
    for t in src.values():
        t.zero_()
    stage.load([3, 6])
    for i, t in enumerate(src.values()):
        ref = physical(order)
        fill(ref, 10 + i)
        for b in range(NB):
            same = torch.equal(t[b].view(torch.int16), ref[b].view(torch.int16))
            assert same == (b in (3, 6)), b
    stage.close()


def test_mla_and_unknown_shapes_stage_opaquely() -> None:
    layers = describe({"a": torch.zeros(NB, N, C, dtype=torch.bfloat16)}, NB)
    fmt = staged_format(MODEL_KV, layers, N)  # not [heads, tokens, K|V]
    assert fmt.kv_layout is None and parse_kv_spec(fmt.compat) is None
    attn = describe({"a": physical((0, 2, 1, 3))}, NB)
    mla = ModelKv("m", "auto", 1, 1, C, mla=True)
    assert staged_format(mla, attn, N).kv_layout is None
    fp8 = ModelKv("m", "fp8_e4m3", 2 * H, H, C // 2)  # a 1-byte dtype over 2-byte tensors
    assert staged_format(fp8, attn, N).kv_layout is None
