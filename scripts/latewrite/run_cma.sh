#!/bin/bash
set -u
DIR=$(mktemp -d /tmp/lwx-XXXX)
cleanup() { kill -CONT $IPID 2>/dev/null; kill $TPID $IPID 2>/dev/null; wait 2>/dev/null; rm -rf $DIR; }
trap cleanup EXIT
date +%s.%N > $DIR/t0
PY=${PY:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}
export UCX_TLS=cma,tcp UCX_NET_DEVICES=lo LW_BYTES=$((256<<20))
$PY $(dirname "$0")/exp.py target $DIR cma & TPID=$!
$PY $(dirname "$0")/exp.py initiator $DIR cma & IPID=$!
for i in $(seq 200); do st=$(awk '{print $3}' /proc/$IPID/stat 2>/dev/null); [ "$st" = T ] && break; sleep 0.05; done
echo "[orch] initiator state $st; target count now $(cat $DIR/count 2>/dev/null)"; sleep 0.6; echo "[orch] count after 0.6s frozen $(cat $DIR/count)"
touch $DIR/cmd.${1:-destroy}; sleep 1; echo "[orch] target did ${1:-destroy}; count $(cat $DIR/count 2>/dev/null); SIGCONT"
kill -CONT $IPID
wait $IPID; wait $TPID
