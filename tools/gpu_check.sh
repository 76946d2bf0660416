#!/usr/bin/env bash
# The checks that need a GPU, in one go: the `gpu`-marked tests (SGLang backend, Triton kernels on CUDA)
# and the vLLM backend's suite on a CUDA vLLM. Run on a machine with a GPU, vllm and sglang installed:
#   tools/gpu_check.sh
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pytest -m gpu -q --timeout=900
python -m pytest -q tests/engine/test_backend_conformance.py tests/engine/test_vllm_backend.py --timeout=900
