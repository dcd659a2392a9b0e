#!/usr/bin/env bash
# Create .venv (once) and install kvd and its thin client into it.
# Usage: scripts/setup.sh [dev]   ("dev" adds the test and lint tools, and vLLM for tests/vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
# torch first, pinned: nixl depends on it, and an unpinned torch pulls a multi-GB CUDA build.
.venv/bin/pip install -q --disable-pip-version-check 'torch==2.13.0'
extra=""
[ "${1:-}" = "dev" ] && extra="[dev]"
.venv/bin/pip install -q --disable-pip-version-check -e ./client -e ".${extra}"
# dev: vLLM 0.33 (CPU, no GPU deps) for the connector tests in tests/vllm; the daemon never needs it.
if [ "${1:-}" = "dev" ]; then
    PIP=.venv/bin/pip scripts/install-vllm.sh
fi
