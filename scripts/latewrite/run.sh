#!/bin/bash
# usage: run.sh MODE  (env LW_* passed through)
set -u
MODE=$1
TAG=lw$$$(printf %04x $RANDOM)
P=lwx-$TAG-p; D=lwx-$TAG-d; VP=lp$TAG; VD=ld$TAG
VP=${VP:0:15}; VD=${VD:0:15}
DIR=$(mktemp -d /tmp/lwx-XXXX)
cleanup() { kill $TPID $IPID 2>/dev/null; wait 2>/dev/null; ip netns del $P 2>/dev/null; ip netns del $D 2>/dev/null; rm -rf $DIR; }
trap cleanup EXIT
ip netns add $P && ip netns add $D
ip link add $VP netns $P type veth peer $VD netns $D
ip -n $P addr add 10.78.0.1/24 dev $VP; ip -n $D addr add 10.78.0.2/24 dev $VD
for n in $P $D; do ip -n $n link set lo up; done
ip -n $P link set $VP up; ip -n $D link set $VD up
date +%s.%N > $DIR/t0
PY=${PY:-$(cd "$(dirname "$0")/../.." && pwd)/.venv/bin/python}
export UCX_TLS=${UCX_TLS:-tcp}
LW_VETH=$VD UCX_NET_DEVICES=$VD ip netns exec $D $PY $(dirname "$0")/exp.py target $DIR $MODE & TPID=$!
LW_VETH=$VP UCX_NET_DEVICES=$VP ip netns exec $P $PY $(dirname "$0")/exp.py initiator $DIR $MODE & IPID=$!
wait $IPID; wait $TPID
