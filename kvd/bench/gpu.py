"""Scenario 8, `gpu`: the paths that exist only with a CUDA GPU, in absolute GB/s.

- raw device <-> host copies (torch), into pageable and page-locked host memory: the PCIe
  figures the others are read against;
- host staging (`kvd_client.vllm.staging.HostStaging`, what `KvdConnector` runs in the
  worker): a request's blocks from GPU KV tensors (vLLM's [blocks, heads, tokens, K|V]
  per layer) into a shared-memory staging region and back, the chunked device path beside
  the plain one (`.cpu()`, then a host scatter, into pageable staging), for contiguous and
  fragmented block ids; every byte compared;
- kvd push into VRAM: P's daemon WRITEs a request from P's host region straight into a D
  region in GPU memory (kind "cuda-ipc", opened by D's daemon); the clock runs from D's
  registration to its `RecvFinished`; the bytes are compared.

Where torch sees no CUDA GPU the scenario is skipped and says why; nothing is estimated.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
from kvd_client import layout as kvlayout
from kvd_client.client import KvdClient
from kvd_client.shm import SharedRegion, staging_name

from kvd.bench.common import (
    BenchError,
    Env,
    Progress,
    expect_ok,
    fill_pattern,
    leases,
    make_side,
    median,
    new_id,
    wait_for,
    wait_leases,
)

DEVICE = "cuda"
"""The device the KV tensors live on (a dry run of the bookkeeping may name "cpu")."""


@dataclass(frozen=True)
class GpuConfig:
    mib: int = 256
    """Bytes of one request (and of each raw copy)."""
    layers: int = 32
    heads: int = 8
    tokens: int = 16
    head_size: int = 128
    reps: int = 5

    @classmethod
    def quick(cls) -> GpuConfig:
        return cls(mib=64, reps=3)

    @property
    def layer_block_bytes(self) -> int:
        return self.heads * self.tokens * 2 * self.head_size * 2  # bf16 K|V

    @property
    def blocks(self) -> int:
        return max(1, (self.mib << 20) // (self.layers * self.layer_block_bytes))


def steps(cfg: GpuConfig) -> int:
    return 3


def skip_reason() -> str:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible (torch.cuda.is_available() is False)"
    return ""


def _gbps(nbytes: int, seconds: float) -> float:
    return round(nbytes / seconds / 1e9, 2) if seconds > 0 else 0.0


def _timed(fn: Callable[[], object], reps: int) -> float:
    import torch

    fn()  # warm-up (first-touch, allocator)
    torch.cuda.synchronize()
    xs = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        xs.append(time.perf_counter() - t0)
    return median(xs)


def raw_copies(cfg: GpuConfig) -> dict[str, Any]:
    import torch

    n = cfg.mib << 20
    dev = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dev.random_(0, 255)
    pageable = torch.empty(n, dtype=torch.uint8)
    pinned = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    out: dict[str, Any] = {"bytes": n}
    for name, host in (("pageable", pageable), ("pinned", pinned)):
        out[f"d2h_{name}_gbps"] = _gbps(n, _timed(partial(host.copy_, dev), cfg.reps))
        out[f"h2d_{name}_gbps"] = _gbps(n, _timed(partial(dev.copy_, host), cfg.reps))
    half = n // 2
    out["d2d_gbps"] = _gbps(n, _timed(partial(dev[:half].copy_, dev[half:]), cfg.reps))
    return out


def staging(cfg: GpuConfig, seed: int) -> dict[str, Any]:
    """HostStaging save/load of one request, chunked device path vs plain path."""
    import torch
    from kvd_client.vllm.staging import HostStaging, describe

    nb = 2 * cfg.blocks  # the pool: twice the request, so fragmented ids have room
    shape = (nb, cfg.heads, cfg.tokens, 2 * cfg.head_size)
    src = {
        f"l{i}": torch.empty(shape, dtype=torch.bfloat16, device=DEVICE) for i in range(cfg.layers)
    }
    for t in src.values():
        t.view(torch.int16).random_(-(2**15), 2**15 - 1)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    layers, d_layers = describe(src, nb), describe(dst, nb)
    width = sum(x.nbytes for x in layers)
    rng = random.Random(seed)
    ids = {
        "contiguous": list(range(cfg.blocks)),
        "fragmented": rng.sample(range(nb), cfg.blocks),
    }
    nbytes = cfg.blocks * width
    regions = [SharedRegion(staging_name("bench-gpu"), nb * width) for _ in range(2)]
    out: dict[str, Any] = {"bytes": nbytes, "blocks": cfg.blocks, "block_bytes": width}
    stages: list[HostStaging] = []
    a = b = np.zeros((0, 0), dtype=np.uint8)
    try:
        for r in regions:
            np.frombuffer(r.buf, dtype=np.uint8)[:] = 0  # fault the pages in
        fast = HostStaging(layers, nb, regions[0].buf, "HND", device_path=True)
        plain = HostStaging(layers, nb, regions[1].buf, "HND", device_path=False, pinned=False)
        fast_in = HostStaging(
            d_layers, nb, regions[0].buf, "HND", device_path=True, pinned=fast.pinned
        )
        plain_in = HostStaging(d_layers, nb, regions[1].buf, "HND", device_path=False, pinned=False)
        stages = [fast_in, plain_in, fast, plain]
        out["pinned"] = fast.pinned
        a = np.frombuffer(regions[0].buf, dtype=np.uint8).reshape(nb, width)
        b = np.frombuffer(regions[1].buf, dtype=np.uint8).reshape(nb, width)
        for alloc, bl in ids.items():
            fast.save(bl)
            plain.save(bl)
            if not np.array_equal(a[bl], b[bl]):
                raise BenchError(f"staging save ({alloc}): the two paths staged different bytes")
            for path, st_out, st_in in (("chunked", fast, fast_in), ("plain", plain, plain_in)):
                out[f"save_{path}_{alloc}_gbps"] = _gbps(
                    nbytes, _timed(partial(st_out.save, bl), cfg.reps)
                )
                for t in dst.values():
                    t.zero_()
                st_in.load(bl)
                idx = torch.tensor(bl, device=DEVICE)
                for k in src:
                    got, want = dst[k].index_select(0, idx), src[k].index_select(0, idx)
                    if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                        raise BenchError(f"staging load ({path}, {alloc}): wrong bytes in {k}")
                out[f"load_{path}_{alloc}_gbps"] = _gbps(
                    nbytes, _timed(partial(st_in.load, bl), cfg.reps)
                )
    finally:
        for s in stages:
            s.close()
        del a, b  # views of the regions: they must go before the regions close
        for r in regions:
            r.close()
    return out


LAYER_COMPUTE_MS = 2.0
"""Simulated compute per layer of the layer-wise save (a matmul sized to take about this)."""


def layerwise_save(cfg: GpuConfig, seed: int) -> dict[str, Any]:
    """A simulated prefill (one matmul per layer, then that layer's KV written) with each
    layer staged as it is computed, as `KvdConnector.save_kv_layer` does: synchronously
    per layer (`save(ids, [layer])`: the forward waits for each copy) and queued
    (`save_layer_async`: the forward never waits), against the same forward without
    saves. Wall clock from the first layer's launch to the last layer staged (async: its
    report from the staging thread); the staged bytes checked against a plain save."""
    import torch
    from kvd_client.vllm import staging as staging_mod
    from kvd_client.vllm.staging import HostStaging, describe

    rng = random.Random(seed)
    nb = 2 * cfg.blocks
    shape = (nb, cfg.heads, cfg.tokens, 2 * cfg.head_size)
    kv = {
        f"l{i}": torch.zeros(shape, dtype=torch.bfloat16, device=DEVICE) for i in range(cfg.layers)
    }
    layers = describe(kv, nb)
    width = sum(x.nbytes for x in layers)
    ids = rng.sample(range(nb), cfg.blocks)
    n = 4096
    a = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    b = torch.randn(n, n, dtype=torch.bfloat16, device=DEVICE)
    one = _timed(lambda: a @ b, 5)
    reps = max(1, round(LAYER_COMPUTE_MS / 1e3 / one))
    idx = torch.tensor(ids, device=DEVICE)

    def compute(i: int) -> None:
        c = a
        for _ in range(reps):
            c = c @ b
        t = kv[f"l{i}"]
        vals = c.reshape(-1)[: cfg.blocks * t[0].numel()].reshape(cfg.blocks, *t.shape[1:])
        t.index_copy_(0, idx, vals)

    regions = [SharedRegion(staging_name("bench-lw"), nb * width) for _ in range(2)]
    stages: list[HostStaging] = []
    out: dict[str, Any] = {
        "layers": cfg.layers,
        "bytes": cfg.blocks * width,
        "blocks": cfg.blocks,
        "layer_compute_ms": round(reps * one * 1e3, 2),
    }
    arr = ref = np.zeros((0, 0), dtype=np.uint8)
    try:
        for r in regions:
            np.frombuffer(r.buf, dtype=np.uint8)[:] = 0
        st = HostStaging(layers, nb, regions[0].buf, "HND", device_path=True)
        plain = HostStaging(layers, nb, regions[1].buf, "HND", device_path=False, pinned=False)
        stages = [st, plain]
        reported: list[float] = []

        calls: dict[str, list[float]] = {}

        def forward(mode: str) -> float:
            reported.clear()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for i in range(cfg.layers):
                compute(i)
                t1 = time.perf_counter()
                if mode == "sync":
                    st.save(ids, [i])
                elif mode == "async":
                    st.save_layer_async(ids, i, lambda _: reported.append(time.perf_counter()))
                calls.setdefault(mode, []).append(time.perf_counter() - t1)
            if mode == "async":
                st.flush()
                if len(reported) != cfg.layers:
                    raise BenchError("a layer-wise save did not report every layer")
                torch.cuda.synchronize()
                return reported[-1] - t0
            torch.cuda.synchronize()
            return time.perf_counter() - t0

        for mode in ("none", "sync", "async"):
            forward(mode)  # warm-up
            calls.pop(mode, None)
            out[f"{mode}_ms"] = round(median([forward(mode) for _ in range(cfg.reps)]) * 1e3, 2)
            if mode != "none":
                out[f"call_ms_{mode}"] = round(median(calls.pop(mode)) * 1e3, 3)
        # the same blocks' queued saves, every piece DMA'd straight into the staging rows
        # (one strided copy per block here, where the rule above takes slabs)
        st.layer_direct_max_runs = 1 << 20
        forward("async")
        calls.pop("async")
        out["async_direct_ms"] = round(median([forward("async") for _ in range(cfg.reps)]) * 1e3, 2)
        out["call_ms_async_direct"] = round(median(calls.pop("async")) * 1e3, 3)
        st.layer_direct_max_runs = staging_mod.LAYER_DIRECT_MAX_RUNS
        # a request in consecutive blocks (one run: one strided copy per layer)
        arr = np.frombuffer(regions[0].buf, dtype=np.uint8).reshape(nb, width)
        ref = np.frombuffer(regions[1].buf, dtype=np.uint8).reshape(nb, width)
        scattered = list(ids)
        plain.save(scattered)
        if not np.array_equal(arr[scattered], ref[scattered]):
            raise BenchError("layer-wise save: the staged bytes differ from a plain save")
        ids[:] = list(range(cfg.blocks))
        forward("async")
        out["async_contiguous_ms"] = round(
            median([forward("async") for _ in range(cfg.reps)]) * 1e3, 2
        )
        plain.save(ids)
        if not np.array_equal(arr[ids], ref[ids]):
            raise BenchError("layer-wise save: the staged bytes differ from a plain save")
        one_layer = _timed(lambda: st.save(scattered, [0]), cfg.reps)
        out["one_layer_save_ms"] = round(one_layer * 1e3, 2)
    finally:
        for s in stages:
            s.close()
        del arr, ref
        for r in regions:
            r.close()
    out["sync_added_ms"] = round(out["sync_ms"] - out["none_ms"], 2)
    out["async_added_ms"] = round(out["async_ms"] - out["none_ms"], 2)
    out["async_direct_added_ms"] = round(out["async_direct_ms"] - out["none_ms"], 2)
    out["async_contiguous_added_ms"] = round(out["async_contiguous_ms"] - out["none_ms"], 2)
    return out


def push_to_vram(env: Env, cfg: GpuConfig, seed: int) -> dict[str, Any]:
    """P's host region -> a D region in GPU memory, through both daemons."""
    import torch
    from kvd_client.cuda import export_handle

    nb = 2 * cfg.blocks
    lay = kvlayout.block_major(nb, cfg.layers, cfg.layer_block_bytes, kv_parts=1)
    size = kvlayout.region_bytes(lay)
    p = make_side(env.p_socket, "gpu-p", lay, size)
    gpu = torch.zeros(size, dtype=torch.uint8, device=DEVICE)
    d = KvdClient(env.d_socket, role="scheduler", engine_id="gpu-d")
    d.connect()
    stash: list[Any] = []
    try:
        fill_pattern(p, seed)
        blob, nbytes, dev = export_handle(gpu)
        d.register_region(
            None,
            kind="cuda-ipc",
            ipc_handle=blob,
            nbytes=nbytes,
            device=dev,
            layout=lay,
            compat="kvd-bench",
        )
        rng = random.Random(seed)
        lb = list(range(cfg.blocks))
        rb = rng.sample(range(nb), cfg.blocks)
        bb = lay.block_stride
        xs: list[float] = []
        for rep in range(cfg.reps + 1):
            pid, did = new_id("gpu-push-p"), new_id("gpu-push-d")
            base = leases(env)
            p.client.finished(pid, lb)
            wait_leases(env, base + 1)
            if rep == 0:
                gpu.zero_()
            t0 = time.perf_counter()
            d.register_push(
                did,
                rb,
                "127.0.0.1",
                env.p_port,
                remote_engine_id=p.engine_id,
                remote_request_id=pid,
            )
            ev = wait_for(d, did, stash)
            dt = time.perf_counter() - t0
            expect_ok(ev, "kvd push into VRAM at D")
            expect_ok(wait_for(p.client, pid, p.stash), "kvd push into VRAM at P")
            if rep == 0:  # checked run (and warm-up)
                got = gpu.view(nb, bb)[torch.tensor(rb, device=DEVICE)].cpu().numpy()
                if not np.array_equal(got, p.arr.reshape(nb, bb)[lb]):
                    raise BenchError("kvd push into VRAM: wrong bytes at D")
                continue
            xs.append(dt)
        t = median(xs)
        return {
            "bytes": cfg.blocks * bb,
            "ms": round(t * 1e3, 3),
            "gbps": _gbps(cfg.blocks * bb, t),
        }
    finally:
        d.close()
        p.close()
        del gpu


def run(env: Env, cfg: GpuConfig, seed: int, progress: Progress) -> dict[str, Any]:
    reason = skip_reason()
    if reason:
        for _ in range(steps(cfg)):
            progress("gpu: skipped")
        return {"skipped": reason}
    import torch

    out: dict[str, Any] = {
        "device": torch.cuda.get_device_name(0),
        "torch": str(torch.__version__),
        "raw": raw_copies(cfg),
    }
    progress("gpu: raw device<->host copies")
    out["staging"] = staging(cfg, seed)
    try:
        out["layerwise"] = layerwise_save(cfg, seed)
    except Exception as exc:
        out["layerwise"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    progress("gpu: host staging, layer by layer")
    try:
        out["push_to_vram"] = push_to_vram(env, cfg, seed)
    except Exception as exc:  # reported, not hidden: the row says what failed
        out["push_to_vram"] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
    progress("gpu: kvd push into VRAM")
    raw = out["raw"]
    st = out["staging"]
    for alloc in ("contiguous", "fragmented"):
        st[f"save_vs_pinned_d2h_{alloc}"] = round(
            st[f"save_chunked_{alloc}_gbps"] / raw["d2h_pinned_gbps"], 2
        )
        st[f"load_vs_pinned_h2d_{alloc}"] = round(
            st[f"load_chunked_{alloc}_gbps"] / raw["h2d_pinned_gbps"], 2
        )
    return out
