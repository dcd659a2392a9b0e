"""Files to and from VRAM with NIXL's GDS backend (`NixlEngine.file_transfer`, mem="VRAM").

The GPU path is written behind the same call as the POSIX one and is tested only where a
GPU and NIXL's GDS plugin exist (never here: it skips, saying why). What runs everywhere:
host memory through the same call, and a VRAM transfer refused clearly without GDS.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import pytest
from kvd_client.errors import TransferError

from kvd.adapters.nixl import NixlEngine
from kvd.adapters.shm import AnonRegion

NBYTES = 1 << 20


@asynccontextmanager
async def engine(name: str) -> AsyncIterator[NixlEngine]:
    eng = NixlEngine(f"{name}-{os.getpid()}", file_backend=True)
    await eng.start(lambda agent, msgs: None)
    try:
        yield eng
    finally:
        await eng.close()


def _pattern(seed: int) -> bytes:
    return bytes((i * 131 + seed) & 0xFF for i in range(256)) * (NBYTES // 256)


async def test_host_memory_round_trip_and_vram_refused_without_gds(tmp_path: Path) -> None:
    mem = AnonRegion(NBYTES)
    path = tmp_path / "block"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        async with engine("kvdt-gds-host") as eng:
            reg = await eng.register(mem.addr, NBYTES)
            try:
                mem.view()[:] = _pattern(1)
                await eng.file_transfer("WRITE", [(mem.addr, NBYTES, fd)], 10.0)
                assert path.read_bytes() == _pattern(1)
                mem.view()[:] = bytes(NBYTES)
                await eng.file_transfer("READ", [(mem.addr, NBYTES, fd)], 10.0)
                assert bytes(mem.view()) == _pattern(1)
                if not eng.gds:
                    with pytest.raises(TransferError, match="GDS"):
                        await eng.file_transfer("READ", [(mem.addr, NBYTES, fd)], 10.0, "VRAM")
            finally:
                await eng.deregister(reg)
    finally:
        os.close(fd)
        mem.close()


def _gds_skip_reason() -> str:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA GPU visible: NIXL's GDS path is untested here"
    return ""


async def test_vram_file_round_trip_with_gds(tmp_path: Path) -> None:
    """GPU only: VRAM -> file -> other VRAM through the GDS backend, bytes checked."""
    reason = _gds_skip_reason()
    if reason:
        pytest.skip(reason)
    import torch

    src = torch.frombuffer(bytearray(_pattern(7)), dtype=torch.uint8).cuda()
    dst = torch.zeros(NBYTES, dtype=torch.uint8, device="cuda")
    dev = src.device.index or 0
    path = tmp_path / "block"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        async with engine("kvdt-gds-vram") as eng:
            if not eng.gds:
                pytest.skip(
                    "a GPU is visible but GDS is unusable here: "
                    + (eng.gds_problem or "NIXL's GDS backend could not be created")
                )
            regs = [await eng.register(t.data_ptr(), NBYTES, "VRAM", dev) for t in (src, dst)]
            try:
                await eng.file_transfer("WRITE", [(src.data_ptr(), NBYTES, fd)], 30.0, "VRAM", dev)
                assert path.read_bytes() == _pattern(7)
                await eng.file_transfer("READ", [(dst.data_ptr(), NBYTES, fd)], 30.0, "VRAM", dev)
                torch.cuda.synchronize()
                assert bytes(dst.cpu().numpy().tobytes()) == _pattern(7)
            finally:
                for reg in regs:
                    await eng.deregister(reg)
    finally:
        os.close(fd)
