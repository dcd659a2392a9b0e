#!/usr/bin/env bash
# Set up .venv with the dev tools and run every check: ruff, mypy (strict) and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
.venv/bin/ruff check kvd client tests
.venv/bin/mypy
# tests/vllm must run here, not skip: setup.sh dev installed vLLM.
KVD_REQUIRE_VLLM=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 .venv/bin/pytest -q -p no:cacheprovider "$@"
