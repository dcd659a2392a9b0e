"""tests/vllm reuses the integration fixtures: real `kvd serve` daemons (`daemons`)."""

from __future__ import annotations

try:  # `tests` is a package when tests/__init__.py exists, else `integration` is top level
    from tests.integration.conftest import daemons, workdir
except ImportError:
    from integration.conftest import daemons, workdir  # type: ignore[no-redef]

__all__ = ["daemons", "workdir"]
