"""`kvd.adapters.nixl_import`: the same NIXL backend as `import nixl`, without importing a
CPU-only torch to learn that it has no CUDA (each in a fresh interpreter)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from kvd.adapters import nixl_import

_PROBE = """
import json, sys
{imp}
print(json.dumps({{"module": api.__name__, "agent": api.nixl_agent.__module__,
                   "torch": "torch" in sys.modules}}))
"""


def _probe(imp: str) -> dict[str, object]:
    out = subprocess.run(
        [sys.executable, "-c", _PROBE.format(imp=imp)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def _torch_version_file() -> ModuleType | None:
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.origin:
        return None
    vspec = importlib.util.spec_from_file_location("_t", Path(spec.origin).parent / "version.py")
    assert vspec is not None and vspec.loader is not None
    module = importlib.util.module_from_spec(vspec)
    vspec.loader.exec_module(module)
    return module


def test_same_backend_as_nixls_own_import_and_no_torch_for_a_cpu_build() -> None:
    ours = _probe("from kvd.adapters.nixl_import import nixl_api; api = nixl_api()")
    theirs = _probe("import nixl._api as api")
    assert ours["module"] == theirs["module"] and ours["agent"] == theirs["agent"], (
        ours,
        theirs,
    )
    version = _torch_version_file()
    if version is not None and version.cuda is None:
        # nixl's own import loads all of torch here; ours must not
        assert theirs["torch"] is True and ours["torch"] is False, (ours, theirs)


def test_any_other_case_is_left_to_nixls_detection(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    def fake_torch(cuda: str) -> None:
        pkg = tmp_path / cuda.strip('"') / "torch"
        pkg.mkdir(parents=True)
        (pkg / "__init__.py").write_text("")
        (pkg / "version.py").write_text(f"cuda = {cuda}\n")
        spec = importlib.util.spec_from_file_location("torch", pkg / "__init__.py")
        monkeypatch.setattr(nixl_import.importlib.util, "find_spec", lambda name: spec)

    for stack in ("torch", "cuda.bindings", "cupy"):  # other tests may have imported them
        monkeypatch.delitem(sys.modules, stack, raising=False)
    fake_torch("None")
    assert nixl_import._torch_is_installed_without_cuda()
    for stack in ("torch", "cuda.bindings", "cupy"):  # a CUDA stack already imported
        with monkeypatch.context() as m:
            m.setitem(sys.modules, stack, ModuleType(stack))
            assert not nixl_import._torch_is_installed_without_cuda(), stack
    fake_torch('"12.8"')  # a CUDA build of torch
    assert not nixl_import._torch_is_installed_without_cuda()
    monkeypatch.setattr(nixl_import.importlib.util, "find_spec", lambda name: None)  # no torch
    assert not nixl_import._torch_is_installed_without_cuda()
