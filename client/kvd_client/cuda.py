"""Export a CUDA tensor's memory for the daemon (GPU-direct regions, kind "cuda-ipc").

torch is imported lazily: the thin client itself never needs it.
"""

from __future__ import annotations

from typing import Any

import msgpack


def export_handle(tensor: Any) -> tuple[bytes, int, int]:
    """(handle blob, nbytes, device) for a contiguous CUDA tensor's whole storage.

    Register it with `KvdClient.register_region(None, kind="cuda-ipc", ipc_handle=blob,
    nbytes=nbytes, device=device, layout=...)`; the layout's addresses are relative to
    the start of the storage.
    """
    if not getattr(tensor, "is_cuda", False):
        raise ValueError("export_handle needs a CUDA tensor")
    storage = tensor.untyped_storage()
    fields = storage._share_cuda_()
    device, handle, size, offset, ref_handle, ref_offset, event, sync = fields
    blob = msgpack.packb(
        [
            int(device),
            bytes(handle),
            int(size),
            int(offset),
            bytes(ref_handle),
            int(ref_offset),
            bytes(event),
            bool(sync),
        ],
        use_bin_type=True,
    )
    return blob, int(storage.nbytes()), int(device)
