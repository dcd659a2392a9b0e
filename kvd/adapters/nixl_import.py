"""Import NIXL's Python API without importing torch for nothing.

`import nixl` picks its backend wheel (`nixl_cu12`, `nixl_cu13`) by the CUDA major
version it detects (`nixl_meta_utils.detect_cuda_major`): from a CUDA stack the process
has already imported (torch, cuda-python, cupy), else from torch's `version.py` read off
disk, and as a last resort by importing all of torch to read `torch.version.cuda`. Where
torch is installed as a CPU build (vLLM's CPU wheel, as in the dev and CI environment),
that file says `cuda = None`, so the last resort imports torch (about 1.3 s of CPU and
a few hundred MiB) only to read the same None from the same file; NIXL then takes the
first backend installed. Every daemon imports NIXL when it starts.

`nixl_api()` skips exactly that last step: when no CUDA stack is imported and torch's own
`version.py` says it is not a CUDA build, detection answers None without importing torch.
In every other case (torch, cuda-python or cupy already imported; a CUDA torch; no torch;
a version file that cannot be read; a NIXL without these helpers) NIXL's own detection
runs unchanged.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

_CUDA_STACKS = ("torch", "cuda.bindings", "cupy")


def nixl_api() -> ModuleType:
    """The module `nixl._api` (its `nixl_agent`, `nixl_agent_config`, ...)."""
    if "nixl" not in sys.modules and _torch_is_installed_without_cuda():
        try:
            meta: ModuleType | None = importlib.import_module("nixl_meta_utils")
        except ImportError:
            meta = None
        detect = getattr(meta, "detect_cuda_major", None)
        if meta is not None and detect is not None:
            # nixl/__init__.py binds the name when it runs: patch it for that import only
            meta.detect_cuda_major = _no_cuda  # type: ignore[attr-defined]
            try:
                importlib.import_module("nixl")
            finally:
                meta.detect_cuda_major = detect  # type: ignore[attr-defined]
    return importlib.import_module("nixl._api")


def _no_cuda() -> None:
    return None


def _torch_is_installed_without_cuda() -> bool:
    """True only when no CUDA stack is imported and torch's `version.py`, read without
    importing torch, says `cuda = None` (the value `torch.version.cuda` would give)."""
    if any(name in sys.modules for name in _CUDA_STACKS):
        return False
    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.origin:
            return False
        path = Path(spec.origin).parent / "version.py"
        vspec = importlib.util.spec_from_file_location("_kvd_torch_version", path)
        if vspec is None or vspec.loader is None:
            return False
        module = importlib.util.module_from_spec(vspec)
        vspec.loader.exec_module(module)
    except Exception:
        return False
    return "cuda" in vars(module) and module.cuda is None
