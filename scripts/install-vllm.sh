#!/usr/bin/env bash
# Install vLLM 0.33.0 (CPU-only, for the kvd_client.vllm connector and tests/vllm) into a venv.
#
# vLLM's declared dependencies pin a CUDA torch and ~40 GPU/server packages, so it is
# installed with --no-deps plus the few packages its scheduler and connector code import
# (see shared/references/vllm-on-cpu.md). Never install torchvision here: transformers
# then fails with "operator torchvision::nms does not exist".
# Idempotent: does nothing when vllm 0.33.0 and the last of its extras are installed.
# Usage: scripts/install-vllm.sh            (uses .venv/bin/pip)
#        PIP=/path/to/venv/bin/pip scripts/install-vllm.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-.venv/bin/pip}
PYBIN="$(dirname "$PIP")/python"
if "$PYBIN" -c 'import importlib.metadata as m, sys
sys.exit(m.version("vllm") != "0.33.0" or not all(m.version(p) for p in ("xgrammar", "einops")))' 2>/dev/null; then
    exit 0
fi
pipq=("$PIP" install -q --disable-pip-version-check)
"${pipq[@]}" 'torch==2.13.0'
# pip then reports "dependency conflicts" (exit 0): expected, vLLM's GPU and server deps are
# left out on purpose. Do not run `pip check` on this environment.
"${pipq[@]}" --no-deps 'vllm==0.33.0'
"${pipq[@]}" --no-deps 'xgrammar==0.2.8' 'apache-tvm-ffi==0.1.11'
"${pipq[@]}" packaging psutil 'pyzmq>=25' regex numpy 'transformers>=5.16.1,<5.21.0' cbor2 \
    'aiohttp>=3.14.4' 'requests>=2.33.0' 'oss-harmony>=0.0.11' 'openai>=2.25.0' 'pillow>=13' \
    pybase64 cachetools msgspec cloudpickle uvloop py-cpuinfo 'prometheus_client>=0.18' \
    'fastapi>=0.133.0,<0.137.0' partial-json-parser 'llguidance>=1.7.0,<1.8.0' einops
"$PYBIN" -c 'import importlib.metadata as m; assert m.version("vllm") == "0.33.0"'
