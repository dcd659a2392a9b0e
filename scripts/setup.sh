#!/usr/bin/env bash
# Create .venv (once) and install kvd and its thin client into it.
# Usage: scripts/setup.sh [dev]   ("dev" adds the test and lint tools, and vLLM for tests/vllm)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
say() { echo "setup: $*" >&2; }
if [ ! -x .venv/bin/python ]; then
    say "creating .venv with $PY"
    "$PY" -m venv .venv
fi
# torch first, pinned: nixl depends on it, and an unpinned torch pulls a multi-GB CUDA build.
say "installing torch==2.13.0 (pinned; already there after the first run)"
.venv/bin/pip install -q --disable-pip-version-check 'torch==2.13.0'
extra=""
[ "${1:-}" = "dev" ] && extra="[dev]"
# One pip command for both: kvd depends on kvd-client==0.1.0, which is not on PyPI; pip
# takes it from ./client only when both are named together (plain `pip install -e .`
# fails with "No matching distribution found for kvd-client==0.1.0").
say "installing kvd-client and kvd${extra} (editable)"
.venv/bin/pip install -q --disable-pip-version-check -e ./client -e ".${extra}"
# dev: vLLM 0.33 (CPU, no GPU deps) for the connector tests in tests/vllm; the daemon never needs it.
if [ "${1:-}" = "dev" ]; then
    say "installing vLLM 0.33 (CPU) for tests/vllm"
    PIP=.venv/bin/pip scripts/install-vllm.sh
fi
say "done: .venv/bin/kvd"
