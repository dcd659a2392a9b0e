"""CUDA IPC (VRAM) regions: the same registration interface as shared memory.

Where no GPU exists the daemon must refuse such a region with a clear, typed error and
keep serving; the GPU data path itself is tested only where a GPU is visible.
"""

from __future__ import annotations

import pytest
from kvd_client.client import KvdClient
from kvd_client.errors import InvalidRequest
from kvd_client.layout import block_major, region_bytes

from kvd.demo import DEMO_COMPAT, make_engine

from .conftest import StartDaemon


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def test_cuda_ipc_region_refused_clearly_without_gpu(daemons: StartDaemon) -> None:
    if _has_gpu():
        pytest.skip("a GPU is visible: the refusal path does not apply")
    d = daemons("kvd-gpu")
    lay = block_major(16, 2, 4096)
    with KvdClient(d.socket, role="worker", engine_id="e") as c:
        blob = __import__("msgpack").packb(
            [0, b"\0" * 64, region_bytes(lay), 0, b"\0" * 64, 0, b"\0" * 64, False]
        )
        with pytest.raises(InvalidRequest, match="CUDA GPU"):
            c.register_region(
                None,
                kind="cuda-ipc",
                ipc_handle=blob,
                nbytes=region_bytes(lay),
                device=0,
                layout=lay,
                compat=DEMO_COMPAT,
            )
        with pytest.raises(InvalidRequest, match="fields"):
            c.register_region(
                None,
                kind="cuda-ipc",
                ipc_handle=b"\x91\x00",
                nbytes=region_bytes(lay),
                device=0,
                layout=lay,
                compat=DEMO_COMPAT,
            )
        assert c.status()["regions"] == []


@pytest.mark.gpu
@pytest.mark.skipif(not _has_gpu(), reason="needs a CUDA GPU (torch.cuda.is_available() is False)")
def test_push_into_gpu_region(daemons: StartDaemon) -> None:  # pragma: no cover - GPU only
    import torch
    from kvd_client.cuda import export_handle

    p_d, d_d = daemons("kvd-p"), daemons("kvd-d")
    p = make_engine(p_d.socket, "prefill", num_blocks=64, num_layers=2, chunk_bytes=4096)
    lay = block_major(64, 2, 4096)
    gpu = torch.zeros(region_bytes(lay), dtype=torch.uint8, device="cuda:0")
    blob, nbytes, dev = export_handle(gpu)
    d = KvdClient(d_d.socket, role="scheduler", engine_id="decode")
    d.connect()
    try:
        d.register_region(
            None,
            kind="cuda-ipc",
            ipc_handle=blob,
            nbytes=nbytes,
            device=dev,
            layout=lay,
            compat=DEMO_COMPAT,  # P's engine declares make_engine's default
        )
        p.block(0, 3)[:] = 7
        d.register_push("r-aaaaaaaa", [5], "127.0.0.1", p_d.side_port)
        p.client.finished("r-bbbbbbbb", [3])
        assert [type(e).__name__ for e in d.wait_events(10)] == ["RecvFinished"]
        bb = lay.block_stride
        assert bool((gpu[5 * bb : 6 * bb] == 7).all())
        assert bool((gpu[: 5 * bb] == 0).all())
    finally:
        p.close()
        d.close()
