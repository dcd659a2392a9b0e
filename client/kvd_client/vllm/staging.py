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

Copies are synchronous: `save` returns once the bytes are in staging, `load` once they are
in the KV tensors; but for `save_layer_async` (a layer-wise save, one layer at a time as
the forward pass computes it), which queues the layer's copy and returns at once: on the
device path its blocks are gathered on the GPU and, after the work queued so far (the
layer's compute), DMA'd straight into the staging rows (one strided copy per run of
consecutive blocks, where there are few runs) or into one of `LAYER_SLABS` page-locked
slabs; a thread of the staging's own waits for the DMAs, scatters slabs into the staging
rows and reports the layer done; the forward pass never waits for it (unless every slab
is still in use).
With KV tensors on a GPU the staging buffer is page-locked
(`cudaHostRegister`) and a copy moves at most `DEVICE_CHUNK_BYTES` of blocks at a time:
the blocks' bytes are assembled on the GPU in staging order (gather, K/V split and token
layout in device memory), then cross PCIe in one DMA per run of consecutive staged block
ids (straight into the staging rows), or, when the runs are short or only some layers
move, through a page-locked bounce buffer and one host copy.
"""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from math import prod
from typing import Any, Final

import torch

from kvd_client import layout as kvlayout
from kvd_client import wire

DEVICE_CHUNK_BYTES: Final = 64 << 20
"""A device copy assembles at most this many bytes of blocks in GPU memory at a time (vLLM
leaves little GPU memory free: a request's whole KV is never duplicated there)."""

LAYER_SLABS: Final = 4
"""Bounce slabs of layer-wise saves in flight at once (page-locked with CUDA); a save that
finds none free waits for the staging thread to empty one."""

LAYER_SLAB_BYTES: Final = 16 << 20
"""Bytes of one slab: a layer's blocks are saved in pieces of at most this."""

LAYER_DIRECT_MAX_RUNS: Final = 8
"""A layer-wise piece is DMA'd straight into the staging rows (one strided copy per run of
consecutive block ids: `cudaMemcpy2DAsync`, no slab, no host scatter) when its block ids
form at most this many runs; else it goes through a slab. Each strided copy costs the
forward pass's thread ~10-18 us of CPU (measured on an H100 VM: 128 of them, 1.2-2.3 ms
per layer), where a slab costs it one DMA and the staging thread the scatter."""

DIRECT_RUN_BYTES: Final = 1 << 20
"""A device copy DMAs straight into (or out of) the staging rows when its runs of
consecutive block ids average at least this many bytes; shorter runs go through the
bounce buffer (one DMA, then a host gather or scatter)."""


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Maximal runs of consecutive ascending ids: (position in `block_ids`, first id, end)."""
    runs: list[tuple[int, int, int]] = []
    for pos, b in enumerate(block_ids):
        if runs and runs[-1][2] == b:
            start, lo, _ = runs[-1]
            runs[-1] = (start, lo, b + 1)
        else:
            runs.append((pos, b, b + 1))
    return runs


def _cudart() -> Any:
    return torch.cuda.cudart()  # type: ignore[no-untyped-call]


def host_register(t: torch.Tensor) -> bool:
    """Page-lock a host tensor's memory for the GPU's DMA engines (`cudaHostRegister`).
    False when CUDA refuses (a memlock limit, say): copies then still work, staged by the
    driver, only slower."""
    err = _cudart().cudaHostRegister(t.data_ptr(), t.numel() * t.element_size(), 0)
    if int(err) == 0:
        return True
    _clear_cuda_error()
    return False


def _clear_cuda_error() -> None:
    """Read off CUDA's last error: a refused `cudaHostRegister` leaves it set, and the next
    kernel launch would raise it (seen on an H100 with torch 2.11)."""
    import ctypes

    lib = _loaded_cudart()
    if lib is not None and hasattr(lib, "cudaGetLastError"):
        lib.cudaGetLastError()
        return
    major = (torch.version.cuda or "").split(".")[0]
    for name in (f"libcudart.so.{major}", "libcudart.so"):
        try:
            ctypes.CDLL(name).cudaGetLastError()
            return
        except (OSError, AttributeError):
            continue


def host_unregister(t: torch.Tensor) -> None:
    _cudart().cudaHostUnregister(t.data_ptr())


_MEMCPY_2D: list[Any] = []


def _loaded_cudart() -> Any:
    """The CUDA runtime library this process has loaded (torch's), opened by its path: a
    runtime found by name could be another copy, whose streams are not torch's. None when
    none is loaded as a shared library (then there is no strided copy: slabs only)."""
    import ctypes

    try:
        with open("/proc/self/maps") as maps:
            paths = {ln.split()[-1] for ln in maps if "libcudart.so" in ln and "/" in ln}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            return ctypes.CDLL(path)
        except OSError:
            continue
    return None


def _memcpy_2d_async() -> Any:
    """cudaMemcpy2DAsync of the CUDA runtime torch loaded (torch does not expose it), or
    None."""
    if not _MEMCPY_2D:
        import ctypes

        lib = _loaded_cudart()
        fn = getattr(lib, "cudaMemcpy2DAsync", None) if lib is not None else None
        if fn is not None:
            ptr, size = ctypes.c_void_p, ctypes.c_size_t
            # (one assignment: ctypes converts the arguments the list held when set)
            fn.argtypes = [ptr, size, ptr, size, size, size, ctypes.c_int, ptr]
            fn.restype = ctypes.c_int
        _MEMCPY_2D.append(fn)
    return _MEMCPY_2D[0]


def strided_copies(device: torch.device) -> bool:
    """Whether `copy_2d` can copy from this device's memory."""
    return device.type != "cuda" or _memcpy_2d_async() is not None


def copy_2d(
    dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: Any
) -> None:
    """`height` rows of `width` bytes from `src` (rows `spitch` apart) to `dst` (rows
    `dpitch` apart): from GPU to host memory on CUDA `stream` (asynchronous), or, with no
    stream, host to host at once (the forced device path of the tests)."""
    if stream is None:
        import ctypes

        for r in range(height):
            ctypes.memmove(dst + r * dpitch, src + r * spitch, width)
        return
    fn = _memcpy_2d_async()
    if fn is None:
        raise RuntimeError("no CUDA runtime library with cudaMemcpy2DAsync is loaded")
    err = fn(dst, dpitch, src, spitch, width, height, 2, stream.cuda_stream)
    if err != 0:
        _clear_cuda_error()
        raise RuntimeError(f"cudaMemcpy2DAsync failed (CUDA error {err})")


@dataclass(frozen=True)
class _IdChunk:
    """A piece of a layer-wise save's block ids: as a list, on the host, on the device."""

    ids: list[int]
    host: torch.Tensor
    dev: torch.Tensor


@dataclass(frozen=True)
class _LayerJob:
    """A piece of a layer queued for the staging thread."""

    event: Any
    """The CUDA event recorded after its DMA into the slab (None: copied already)."""
    slab: int
    """Its slab, to scatter into staging from; -1: DMA'd straight into staging."""
    ids: torch.Tensor
    lay: LayerBlocks
    layer: int
    on_done: Callable[[int], None] | None
    """Called with `layer` once this piece is in staging (on the layer's last piece)."""


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
        *,
        device_path: bool | None = None,
        pinned: bool | None = None,
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
        devices = {lay.blocks.device for lay in layers}
        if len(devices) != 1:
            raise ValueError(
                f"a rank's KV tensors are on several devices: {sorted(map(str, devices))}"
            )
        self.device = devices.pop()
        self.chunked = device_path if device_path is not None else self.device.type == "cuda"
        """Copy through the chunked device path (always with CUDA tensors; `device_path`
        forces it for host tensors, to test its bookkeeping without a GPU)."""
        self._owns_pin = pinned is None and self.device.type == "cuda"
        self.pinned = host_register(self.stage) if self._owns_pin else bool(pinned)
        """The staging buffer is page-locked (here, or by the caller when `pinned` is
        given): DMAs go straight to or from its rows."""
        self._owns_pin = self._owns_pin and self.pinned
        self._bounce: torch.Tensor | None = None
        self._copies: Any = None
        """The copy stream (CUDA only, made at the first direct copy)."""
        self._slabs: list[torch.Tensor] = []
        self._free_slabs: queue.SimpleQueue[int] = queue.SimpleQueue()
        self._jobs: queue.Queue[_LayerJob | None] = queue.Queue()
        self._layer_thread: threading.Thread | None = None
        self._layer_error: BaseException | None = None
        self.layer_direct_max_runs = LAYER_DIRECT_MAX_RUNS
        """`LAYER_DIRECT_MAX_RUNS` for this staging (-1: every piece through a slab)."""
        self._layer_ids: tuple[tuple[int, ...], int, list[_IdChunk]] | None = None
        """The last id list's pieces (every layer of a step saves the same blocks)."""

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
        if self.chunked:
            self._save_chunked(
                list(block_ids), list(range(len(self.layers))) if layers is None else list(layers)
            )
            return
        n = idx.numel()
        stage = self.stage
        for i in range(len(self.layers)) if layers is None else layers:
            lay = self.layers[i]
            src = self._to_chunks(lay.blocks.index_select(0, idx.to(lay.blocks.device)))
            raw = src.reshape(n, -1).view(torch.uint8).cpu()
            stage[idx, lay.offset : lay.offset + lay.nbytes] = raw

    def save_layer_async(
        self, block_ids: Sequence[int], layer: int, on_done: Callable[[int], None]
    ) -> None:
        """Layer `layer` (an index into `self.layers`) of these blocks -> staging, without
        waiting: `on_done(layer)` is called once its bytes are in staging, before this
        returns on the plain host path, else from the staging thread (in the order the
        layers were queued). `flush` waits for every queued layer. The copy reads the KV
        tensor after the work queued on the current stream so far (the layer's compute)."""
        if not self.chunked or not block_ids:
            self.save(block_ids, [layer])
            on_done(layer)
            return
        self._raise_layer_error()
        lay = self.layers[layer]
        pieces = self._layer_pieces(list(block_ids), lay.nbytes)
        copies = self._copy_stream()
        self._start_layer_thread()
        view = self._chunk_view(lay.blocks)
        for k, piece in enumerate(pieces):
            m = len(piece.ids)
            rows = view.index_select(0, piece.dev).reshape(m, -1).view(torch.uint8)
            runs = block_runs(piece.ids)
            slab = -1
            with self._copying(rows, after_compute=True):
                few = len(runs) <= self.layer_direct_max_runs
                if self.pinned and few and strided_copies(self.device):
                    self._rows_into_stage(rows, runs, lay, copies)
                else:
                    slab = self._take_slab()
                    dst = self._slabs[slab][: m * lay.nbytes].view(m, lay.nbytes)
                    dst.copy_(rows, non_blocking=True)
            event = None
            if copies is not None:
                event = torch.cuda.Event()  # type: ignore[no-untyped-call]
                event.record(copies)
            done = on_done if k == len(pieces) - 1 else None
            self._jobs.put(_LayerJob(event, slab, piece.host, lay, layer, done))

    def _rows_into_stage(
        self, rows: torch.Tensor, runs: list[tuple[int, int, int]], lay: LayerBlocks, stream: Any
    ) -> None:
        """Each run's rows (a layer's bytes of consecutive blocks, back to back in `rows`)
        into its columns of the staging rows: one strided copy per run (on `stream`; on the
        host, where the device path is forced for tests, at once)."""
        n, bb = lay.nbytes, self.block_bytes
        dst0 = self.stage.data_ptr() + lay.offset
        src0 = rows.data_ptr()
        for pos, lo, hi in runs:
            copy_2d(dst0 + lo * bb, bb, src0 + pos * n, n, n, hi - lo, stream)

    def flush(self) -> None:
        """Wait until every layer queued by `save_layer_async` is in staging (and reported);
        raise what failed."""
        if self._layer_thread is not None:
            self._jobs.join()
        self._raise_layer_error()

    def _raise_layer_error(self) -> None:
        err, self._layer_error = self._layer_error, None
        if err is not None:
            raise RuntimeError(f"a layer-wise save failed: {err!r}") from err

    def _layer_pieces(self, ids: list[int], width: int) -> list[_IdChunk]:
        key = tuple(ids)
        if self._layer_ids is not None and self._layer_ids[:2] == (key, width):
            return self._layer_ids[2]
        self._index(ids)  # (range check)
        pieces = self._chunks(ids, width, LAYER_SLAB_BYTES)
        self._layer_ids = (key, width, pieces)
        return pieces

    def _take_slab(self) -> int:
        """A free slab's index: made while fewer than LAYER_SLABS exist, else the next one
        the staging thread frees (waited for)."""
        try:
            return self._free_slabs.get_nowait()
        except queue.Empty:
            pass
        if len(self._slabs) < LAYER_SLABS:
            pin = self.device.type == "cuda"
            self._slabs.append(torch.empty(LAYER_SLAB_BYTES, dtype=torch.uint8, pin_memory=pin))
            return len(self._slabs) - 1
        while True:
            try:
                return self._free_slabs.get(timeout=1.0)
            except queue.Empty:
                if self._layer_thread is None or not self._layer_thread.is_alive():
                    raise RuntimeError("the staging thread is gone") from None

    def _start_layer_thread(self) -> None:
        if self._layer_thread is None:
            self._layer_thread = threading.Thread(
                target=self._layer_loop, name="kvd-layer-staging", daemon=True
            )
            self._layer_thread.start()

    def _layer_loop(self) -> None:
        """The staging thread: each queued piece, in order, once its DMA is done: scattered
        from its slab into the staging rows, its slab freed, its layer reported."""
        while True:
            job = self._jobs.get()
            try:
                if job is None:
                    return
                if self._layer_error is None:
                    try:
                        if job.event is not None:
                            job.event.synchronize()
                        if job.slab >= 0:
                            m, lay = job.ids.numel(), job.lay
                            src = self._slabs[job.slab][: m * lay.nbytes].view(m, lay.nbytes)
                            self.stage[job.ids, lay.offset : lay.offset + lay.nbytes] = src
                        if job.on_done is not None:
                            job.on_done(job.layer)
                    except BaseException as exc:  # reported by the next save or flush
                        self._layer_error = exc
                if job.slab >= 0:
                    self._free_slabs.put(job.slab)
            finally:
                self._jobs.task_done()

    def load(self, block_ids: Sequence[int]) -> None:
        """Staging -> KV tensors (D, once the daemon reported every byte arrived)."""
        if not block_ids:
            return
        idx = self._index(block_ids)
        if self.chunked:
            self._load_chunked(list(block_ids))
            return
        stage = self.stage
        for lay in self.layers:
            raw = stage[idx, lay.offset : lay.offset + lay.nbytes]
            vals = self._from_chunks(raw.view(lay.dtype), lay).to(lay.blocks.device)
            lay.blocks.index_copy_(0, idx.to(lay.blocks.device), vals)

    def _sync(self) -> None:
        """Wait for this device's work queued so far: the current stream (the one the
        model's kernels wrote or will read the KV tensors on) and the copy stream."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
            if self._copies is not None:
                self._copies.synchronize()

    def _copy_stream(self) -> Any:
        """A second CUDA stream for the DMAs (None on the host)."""
        if self.device.type != "cuda":
            return None
        if self._copies is None:
            self._copies = torch.cuda.Stream(self.device)  # type: ignore[no-untyped-call]
        return self._copies

    @staticmethod
    def _stream(stream: Any) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream) if stream is not None else nullcontext()

    @contextmanager
    def _copying(self, rows: torch.Tensor, *, after_compute: bool) -> Iterator[None]:
        """Queue the copies made inside on the copy stream. `after_compute`: they read
        `rows` the current stream writes (a save); otherwise they fill `rows` for the
        current stream to read (a load), which then waits for them."""
        copies = self._copy_stream()
        if copies is None:
            yield
            return
        compute = torch.cuda.current_stream(self.device)
        if after_compute:
            copies.wait_stream(compute)
        with torch.cuda.stream(copies):
            yield
        if after_compute:
            rows.record_stream(copies)  # not reused before these DMAs have read it
        else:
            compute.wait_stream(copies)
            rows.record_stream(compute)

    def _bounce_rows(self, rows: int, width: int) -> torch.Tensor:
        """A [rows, width] view of the reused bounce buffer (page-locked with CUDA)."""
        need = rows * width
        if self._bounce is None or self._bounce.numel() < need:
            self._bounce = None
            self._bounce = torch.empty(
                need, dtype=torch.uint8, pin_memory=self.device.type == "cuda"
            )
        return self._bounce[:need].view(rows, width)

    def _chunks(self, block_ids: list[int], width: int, piece_bytes: int) -> list[_IdChunk]:
        """The ids in pieces of at most `piece_bytes` (of `width` bytes per block), each
        with its ids on the host and on the device. The ids cross to the device once, from
        page-locked memory (a copy from pageable memory would wait for every copy queued
        before it: no chunk would overlap)."""
        per = max(1, piece_bytes // width)
        host = torch.tensor(block_ids, dtype=torch.long)
        dev = host
        if self.device.type == "cuda":
            dev = host.pin_memory().to(self.device, non_blocking=True)
        return [
            _IdChunk(block_ids[i : i + per], host[i : i + per], dev[i : i + per])
            for i in range(0, len(block_ids), per)
        ]

    def _direct(self, ids: list[int], runs: list[tuple[int, int, int]], width: int) -> bool:
        return (self.pinned or self.device.type != "cuda") and len(
            ids
        ) * width >= DIRECT_RUN_BYTES * len(runs)

    def _chunk_view(self, blocks: torch.Tensor) -> torch.Tensor:
        """A view of [n, H, T, 2D] blocks as their staged chunks: [n, 2, T, H, D] (NHD) or
        [n, 2, H, T, D] (HND); the blocks themselves for an opaque region. Gathering from
        it (`index_select`) permutes in the same pass; `index_copy_` into it writes the KV
        tensor in place."""
        if self.kv_layout is None:
            return blocks
        n, h, t, d2 = blocks.shape
        kv = blocks.view(n, h, t, 2, d2 // 2)
        return kv.permute(0, 3, 2, 1, 4) if self.kv_layout == "NHD" else kv.permute(0, 3, 1, 2, 4)

    def _row_view(self, rows: torch.Tensor, col: int, lay: LayerBlocks) -> torch.Tensor:
        """Columns [col, col + lay.nbytes) of [m, width] uint8 rows as m staged blocks of
        this layer (the shape `_chunk_view` gives)."""
        part = rows[:, col : col + lay.nbytes].view(lay.dtype)
        shape = self._chunk_view(lay.blocks[:1]).shape[1:]
        return part.view(rows.shape[0], *shape)

    def _save_chunked(self, block_ids: list[int], sel: list[int]) -> None:
        stage = self.stage
        width = sum(self.layers[i].nbytes for i in sel)
        whole = sel == list(range(len(self.layers)))
        for piece in self._chunks(block_ids, width, DEVICE_CHUNK_BYTES):
            ids, idx_dev = piece.ids, piece.dev
            m = len(ids)
            parts = [
                self._chunk_view(self.layers[i].blocks)
                .index_select(0, idx_dev)
                .reshape(m, -1)
                .view(torch.uint8)
                for i in sel
            ]
            rows = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
            runs = block_runs(ids)
            if whole and self._direct(ids, runs, width):
                # on the copy stream, after this chunk's gathers: the next chunk's gathers
                # overlap these DMAs; both streams are synchronized once, at the end
                with self._copying(rows, after_compute=True):
                    for pos, lo, hi in runs:
                        stage[lo:hi].copy_(rows[pos : pos + hi - lo], non_blocking=True)
                continue
            bounce = self._bounce_rows(m, width)
            bounce.copy_(rows, non_blocking=True)
            self._sync()
            idx = torch.tensor(ids, dtype=torch.long)
            if whole:
                stage[idx] = bounce
                continue
            col = 0
            for i in sel:
                lay = self.layers[i]
                stage[idx, lay.offset : lay.offset + lay.nbytes] = bounce[:, col : col + lay.nbytes]
                col += lay.nbytes
        self._sync()

    def _load_chunked(self, block_ids: list[int]) -> None:
        stage = self.stage
        width = self.block_bytes
        for piece in self._chunks(block_ids, width, DEVICE_CHUNK_BYTES):
            ids, idx_dev = piece.ids, piece.dev
            m = len(ids)
            runs = block_runs(ids)
            bounced = not self._direct(ids, runs, width)
            if bounced:
                rows = torch.empty((m, width), dtype=torch.uint8, device=self.device)
                bounce = self._bounce_rows(m, width)
                torch.index_select(stage, 0, torch.tensor(ids, dtype=torch.long), out=bounce)
                rows.copy_(bounce, non_blocking=True)
            else:  # on the copy stream: the previous chunk's scatter overlaps these DMAs
                with self._stream(self._copy_stream()):
                    rows = torch.empty((m, width), dtype=torch.uint8, device=self.device)
                with self._copying(rows, after_compute=False):
                    for pos, lo, hi in runs:
                        rows[pos : pos + hi - lo].copy_(stage[lo:hi], non_blocking=True)
            for lay in self.layers:
                view = self._chunk_view(lay.blocks)
                view.index_copy_(0, idx_dev, self._row_view(rows, lay.offset, lay))
            if bounced:
                self._sync()  # the bounce is refilled by the next chunk
        self._sync()  # staging is rewritten as soon as this returns

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
        if self._layer_thread is not None:
            self._jobs.put(None)
            self._layer_thread.join()
            self._layer_thread = None
        self._slabs = []
        if self._stage is not None and self.device.type == "cuda":
            self._sync()
        if self._stage is not None and self._owns_pin:
            host_unregister(self._stage)
            self._owns_pin = self.pinned = False
        self._stage = None
        self._bounce = None


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
