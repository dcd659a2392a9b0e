#!/usr/bin/env bash
# Set up .venv with the dev tools and run every check: ruff, mypy (strict) and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
.venv/bin/ruff check kvd client tests
.venv/bin/mypy
# tests/vllm must run here, not skip: setup.sh dev installed vLLM.
export KVD_REQUIRE_VLLM=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Most tests wait on their own daemons' timeouts: they run on KVD_TEST_WORKERS processes
# (3 by default: on 2 cores the machine is ~90 % busy, and the part takes ~6.7 minutes
# against ~9.5 with 2), a file per worker. Those marked `serial` watch the whole machine and run
# alone afterwards. (pytest exits 5 when a selection leaves one part empty.)
run() { .venv/bin/pytest -q -p no:cacheprovider "$@" || [ $? -eq 5 ]; }
run -n "${KVD_TEST_WORKERS:-3}" --dist loadfile -m "not serial" "$@"
run -m serial "$@"
