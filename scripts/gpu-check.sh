#!/usr/bin/env bash
# The checks that need a CUDA GPU, on a machine that has one: the GPU tests (CUDA IPC
# regions, the GDS VRAM round trip, host staging of GPU KV tensors) and `kvd bench --only
# gpu` (absolute GB/s). Uses the machine's own python3 (with CUDA torch); the daemon's
# other dependencies come from the wheels in .whl/ when present (a machine without an
# index), else from pip. Writes what it measured under ${OUT:-/tmp/kvd-gpu-check}.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-/tmp/kvd-gpu-check}"
mkdir -p "$out"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvd-site .whl/*.whl || exit 1
    export PYTHONPATH="/tmp/kvd-site:$PWD:$PWD/client"
else
    export PYTHONPATH="$PWD:$PWD/client"
fi
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current --format=csv
python3 - <<'PY'
import torch, nixl, zmq
print("torch", torch.__version__, "cuda", torch.version.cuda, torch.cuda.get_device_name(0))
print("nixl", nixl.__file__, "pyzmq", zmq.__version__)
from nixl._api import nixl_agent
try:
    print("nixl plugins:", nixl_agent("probe").get_plugin_list())
except Exception as exc:
    print("nixl plugins: ?", exc)
# A refused cudaHostRegister (the same pages twice) must not poison later CUDA work.
from kvd_client.vllm.staging import host_register, host_unregister
t = torch.empty(1 << 20, dtype=torch.uint8)
print("register:", host_register(t), "again (refused):", host_register(t))
x = torch.ones(1 << 20, device="cuda") * 2
torch.cuda.synchronize()
print("a kernel after the refusal ran:", float(x.sum()))
host_unregister(t)
from kvd_client.vllm.staging import _loaded_cudart, strided_copies
print("CUDA runtime:", _loaded_cudart(), "strided copies:", strided_copies(torch.device("cuda")))
PY
echo "== GPU tests"
timeout 300 python3 -m pytest -p no:cacheprovider -q -rs \
    tests/client tests/integration/test_cuda_ipc.py tests/integration/test_gds.py \
    2>&1 | tee "$out/gpu-tests.txt" | tail -25
echo "== kvd bench --only gpu"
timeout 300 python3 -m kvd bench --only gpu --json "$out/bench-gpu.json" 2>&1 \
    | tee "$out/bench-gpu.txt" | grep -v "━━" | tail -40
