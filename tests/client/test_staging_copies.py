"""Host staging's chunked device path (`HostStaging` with `device_path`, always taken with
CUDA tensors) against the plain host path, byte for byte.

Both paths stage the same KV tensors into two buffers; the buffers must be equal, and a
load from either must put every value back. The chunked path's bookkeeping (chunks of
`DEVICE_CHUNK_BYTES`, runs of consecutive ids DMA'd straight into staging rows, short runs
and per-layer saves through the bounce buffer) runs here on host tensors; the same tests
run on a CUDA GPU where one is visible (device <-> host copies, the page-locked staging
buffer), and skip saying so where none is.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch
from kvd_client.vllm import staging as st
from kvd_client.vllm.staging import HostStaging, block_runs, describe

NB, H, N, C = 24, 2, 16, 64  # blocks, heads, tokens per block, K|V elements


def _devices() -> list[str]:
    return ["cpu", "cuda"]


def _skip_without(device: str) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (torch.cuda.is_available() is False): device copies untested")


def _kv(device: str, order: tuple[int, ...], seed: int, layers: int = 3) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i in range(layers):
        shape = [NB, H, N, C]
        phys = [shape[d] for d in order]
        t = torch.randint(-(2**15), 2**15 - 1, phys, generator=g, dtype=torch.int16)
        t = t.view(torch.bfloat16).to(device)
        inv = [order.index(d) for d in range(4)]
        out[f"l{i}"] = t.permute(*inv)
    return out


def test_block_runs() -> None:
    assert block_runs([]) == []
    assert block_runs([4, 5, 6, 9, 1, 2]) == [(0, 4, 7), (3, 9, 10), (4, 1, 3)]
    assert block_runs([3, 3]) == [(0, 3, 4), (1, 3, 4)]


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("kv_layout", [None, "NHD", "HND"])
@pytest.mark.parametrize("chunk", [1 << 20, 3 * 2 * H * N * C * 2 + 7])
def test_chunked_path_equals_the_host_path(
    device: str, kv_layout: str | None, chunk: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    _skip_without(device)
    # chunk: every copy in one chunk, or one block per chunk (a block is 3 layers' bytes)
    monkeypatch.setattr(st, "DEVICE_CHUNK_BYTES", chunk)
    order = (0, 2, 1, 3) if kv_layout == "NHD" else (0, 1, 2, 3)
    src = _kv(device, order, seed=1)
    host_src = {k: v.cpu() for k, v in src.items()}
    lays, host_lays = describe(src, NB), describe(host_src, NB)
    width = sum(x.nbytes for x in lays)
    ref_buf, buf = bytearray(NB * width), bytearray(NB * width)
    ref = HostStaging(host_lays, NB, memoryview(ref_buf), kv_layout)
    dev = HostStaging(lays, NB, memoryview(buf), kv_layout, device_path=True)
    assert dev.chunked and not ref.chunked
    rng = random.Random(7)
    # long runs (straight into staging rows), scattered ids (the bounce), one layer, two
    cases: list[tuple[list[int], list[int] | None]] = [
        (list(range(2, 12)), None),
        (rng.sample(range(NB), 9), None),
        ([13, 14, 20, 0], [1]),
        ([5, 17, 18, 19], [2, 0]),
    ]
    for ids, which in cases:
        ref.save(ids, which)
        dev.save(ids, which)
        assert buf == ref_buf, (ids, which)
    # a load puts back exactly the loaded blocks, from the staged bytes
    full = bytearray(NB * width)
    HostStaging(host_lays, NB, memoryview(full), kv_layout).save(list(range(NB)))
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    d_buf = memoryview(full)
    d_stage = HostStaging(describe(dst, NB), NB, d_buf, kv_layout, device_path=True)
    ids = [2, 3, 4, 5, 9, 0, 21]
    d_stage.load(ids)
    for name in src:
        for b in range(NB):
            got = dst[name][b].cpu().view(torch.int16)
            if b in ids:
                assert torch.equal(got, host_src[name][b].view(torch.int16)), (name, b)
            else:
                assert not got.any(), (name, b)
    for s in (ref, dev, d_stage):
        s.close()


@pytest.mark.parametrize("device", _devices())
def test_a_large_copy_is_cut_into_chunks_and_loses_nothing(
    device: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Blocks larger than a chunk, many blocks per chunk, ids in descending order."""
    _skip_without(device)
    src = _kv(device, (0, 1, 2, 3), seed=3, layers=2)
    lays = describe(src, NB)
    width = sum(x.nbytes for x in lays)
    monkeypatch.setattr(st, "DEVICE_CHUNK_BYTES", width * 5)
    monkeypatch.setattr(st, "DIRECT_RUN_BYTES", 1)
    buf = bytearray(NB * width)
    dev = HostStaging(lays, NB, memoryview(buf), device_path=True)
    ids = list(range(NB - 1, -1, -1))
    dev.save(ids)
    host = describe({k: v.cpu() for k, v in src.items()}, NB)
    for b in range(NB):
        want = b"".join(x.blocks[b].contiguous().view(torch.uint8).numpy().tobytes() for x in host)
        assert bytes(buf[b * width : (b + 1) * width]) == want, b
    dev.close()


@pytest.mark.parametrize("device", _devices())
@pytest.mark.parametrize("kv_layout", [None, "NHD", "HND"])
@pytest.mark.parametrize("direct", [False, True], ids=["slabs", "direct"])
def test_layer_wise_saves_are_queued_and_each_layer_reported_once_staged(
    device: str, kv_layout: str | None, direct: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`save_layer_async` on the device path: each layer's blocks go through slabs (here
    two, of two blocks of a layer each: pieces wait for slabs the staging thread frees)
    or straight into the staging rows (one strided copy per run of consecutive ids), and
    the staging thread reports each layer once, in order, after its bytes are in staging;
    the result equals the plain path's, byte for byte."""
    _skip_without(device)
    lay_bytes = 2 * H * N * C * 2  # one block of one layer (K and V, bf16)
    monkeypatch.setattr(st, "LAYER_SLABS", 2)
    monkeypatch.setattr(st, "LAYER_SLAB_BYTES", 2 * lay_bytes)
    monkeypatch.setattr(st, "LAYER_DIRECT_MAX_RUNS", 1 << 20 if direct else -1)
    order = (0, 2, 1, 3) if kv_layout == "NHD" else (0, 1, 2, 3)
    src = _kv(device, order, seed=5, layers=4)
    host_src = {k: v.cpu() for k, v in src.items()}
    lays, host_lays = describe(src, NB), describe(host_src, NB)
    width = sum(x.nbytes for x in lays)
    ref_buf, buf = bytearray(NB * width), bytearray(NB * width)
    ref = HostStaging(host_lays, NB, memoryview(ref_buf), kv_layout)
    # (on the host, `pinned` lets the direct path run: its copies are then host memmoves)
    pinned = True if device == "cpu" else None
    dev = HostStaging(lays, NB, memoryview(buf), kv_layout, device_path=True, pinned=pinned)
    assert dev.pinned
    ids = [7, 3, 4, 5, 19, 0, 11]  # four pieces of at most two blocks per layer
    ref.save(ids)
    done: list[tuple[int, bool]] = []
    main = threading.get_ident()

    def on_done(layer: int) -> None:
        # the layer's bytes are in staging when it is reported
        lay = lays[layer]
        for b in ids:
            row = slice(b * width + lay.offset, b * width + lay.offset + lay.nbytes)
            assert buf[row] == ref_buf[row], (layer, b)
        done.append((layer, threading.get_ident() == main))

    for layer in range(len(lays)):
        dev.save_layer_async(ids, layer, on_done)
    dev.flush()
    assert done == [(i, False) for i in range(len(lays))]
    assert buf == ref_buf
    # pieces went through slabs (at most LAYER_SLABS made: one freed by the staging thread
    # before the next piece asks is taken again instead of a new one), or through none
    if direct:
        assert dev._slabs == []
    else:
        assert 1 <= len(dev._slabs) <= 2
    # the next step's blocks (other ids) through the same slabs
    more = [1, 2, 23]
    ref.save(more)
    for layer in range(len(lays)):
        dev.save_layer_async(more, layer, lambda _: None)
    dev.flush()
    assert buf == ref_buf
    # on the plain path a layer is staged (and reported) before the call returns
    plain: list[int] = []
    ref.save_layer_async(ids, 1, plain.append)
    assert plain == [1]
    for s in (ref, dev):
        s.close()


def test_a_failed_layer_wise_save_is_raised_once_by_flush() -> None:
    src = _kv("cpu", (0, 1, 2, 3), seed=6, layers=2)
    lays = describe(src, NB)
    buf = bytearray(NB * sum(x.nbytes for x in lays))
    dev = HostStaging(lays, NB, memoryview(buf), device_path=True)

    def boom(layer: int) -> None:
        raise ValueError(f"layer {layer}")

    dev.save_layer_async([1, 2], 0, boom)
    with pytest.raises(RuntimeError, match="layer-wise save failed"):
        dev.flush()
    dev.flush()  # reported once
    got: list[int] = []
    dev.save_layer_async([1, 2], 1, got.append)
    dev.flush()
    assert got == [1]
    dev.close()
    assert dev._layer_thread is None
