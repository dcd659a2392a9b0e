#!/usr/bin/env bash
# Set up .venv and run `kvd demo`: a P daemon and a D daemon, push then pull, every byte verified.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/kvd demo "$@"
