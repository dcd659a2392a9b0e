#!/usr/bin/env bash
# Set up .venv with the dev tools and run every check: ruff, mypy (strict) and the test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh dev
.venv/bin/ruff check kvd client tests
.venv/bin/mypy
.venv/bin/pytest -q -p no:cacheprovider "$@"
