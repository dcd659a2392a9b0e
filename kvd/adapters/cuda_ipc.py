"""The daemon's side of GPU-direct regions: open a worker's CUDA IPC handle (VRAM).

The worker exports its KV tensor's storage with `kvd_client.cuda.export_handle`
(torch's `_share_cuda_` tuple, msgpack-encoded: never pickle). The daemon opens it with
`torch.UntypedStorage._new_shared_cuda`, keeps the storage alive while the region is
registered, and registers `data_ptr()` with NIXL as VRAM on that device. torch is
imported only here and only when such a region is registered: a daemon that serves
host-staging regions never imports it.
"""

from __future__ import annotations

from typing import Any, Final

import msgpack
from kvd_client.errors import InvalidRequest

HANDLE_FIELDS: Final = 8


def decode_handle(blob: bytes) -> tuple[Any, ...]:
    """Validate an exported handle.

    Fields: device, handle, size, offset, ref_handle, ref_offset, event, sync.
    """
    try:
        raw = msgpack.unpackb(blob, raw=False, max_bin_len=4096, max_str_len=4096, max_array_len=16)
    except Exception:
        raise InvalidRequest("cuda-ipc handle is not valid msgpack") from None
    if not isinstance(raw, list) or len(raw) != HANDLE_FIELDS:
        raise InvalidRequest(f"cuda-ipc handle must have {HANDLE_FIELDS} fields")
    device, handle, size, offset, ref_handle, ref_offset, event, sync = raw
    ints_ok = all(
        isinstance(x, int) and not isinstance(x, bool) and x >= 0
        for x in (device, size, offset, ref_offset)
    )
    if not ints_ok or not isinstance(handle, bytes) or not isinstance(ref_handle, bytes):
        raise InvalidRequest("cuda-ipc handle fields have the wrong types")
    if not isinstance(event, bytes) or not isinstance(sync, bool):
        raise InvalidRequest("cuda-ipc handle event fields have the wrong types")
    return (device, handle, size, offset, ref_handle, ref_offset, event, sync)


class CudaIpcRegion:
    """A worker's GPU memory opened in the daemon through CUDA IPC."""

    def __init__(self, blob: bytes, nbytes: int, device: int) -> None:
        fields = decode_handle(blob)
        try:
            import torch
        except ImportError:
            raise InvalidRequest(
                "cuda-ipc regions need torch in the daemon's environment"
            ) from None
        if not torch.cuda.is_available():
            raise InvalidRequest("cuda-ipc regions need a CUDA GPU visible to the daemon; none is")
        if device >= 0 and fields[0] != device:
            raise InvalidRequest(f"handle is for device {fields[0]}, the region says {device}")
        if fields[2] < nbytes:
            raise InvalidRequest(
                f"the shared storage has {fields[2]} bytes, the region claims {nbytes}"
            )
        torch.cuda.set_device(fields[0])
        self._storage: Any = torch.UntypedStorage._new_shared_cuda(*fields)
        self.addr: Final[int] = int(self._storage.data_ptr())
        self.nbytes: Final = nbytes
        self.device: Final[int] = int(fields[0])

    def close(self) -> None:
        self._storage = None
