"""tests/vllm reuses the integration fixtures: real `kvd serve` daemons (`daemons`).

This directory is deliberately not a package: without tests/__init__.py a package here
would be imported as a top-level `vllm` and shadow vLLM itself. So the integration
conftest is loaded by path, whatever `tests` is on sys.path.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parents[1] / "integration" / "conftest.py"
_NAME = "kvd_tests_integration_fixtures"
if _NAME not in sys.modules:
    _spec = importlib.util.spec_from_file_location(_NAME, _PATH)
    assert _spec is not None and _spec.loader is not None
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules[_NAME] = _mod
    _spec.loader.exec_module(_mod)

daemons = sys.modules[_NAME].daemons
workdir = sys.modules[_NAME].workdir

__all__ = ["daemons", "workdir"]
