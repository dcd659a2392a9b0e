#!/usr/bin/env bash
# Set up .venv and run `kvd demo`: a P daemon and a D daemon, push then pull, every byte verified.
set -euo pipefail
cd "$(dirname "$0")/.."
echo "demo: setting up .venv (the first run downloads torch and nixl: a few minutes)" >&2
scripts/setup.sh
echo "demo: running kvd demo $* (two daemons, simulated P and D engines)" >&2
exec .venv/bin/kvd demo "$@"
