#!/usr/bin/env bash
# The CUDA checks, for a machine with a GPU: the gpu-marked tests (tests/test_gpu.py), then the shipped
# SmolLM2 draft decoding on the GPU (benchmarks/gpu/gpu_decode.py). Logs and results go to $OUT
# (default outputs/gpu_check).
#   benchmarks/gpu/gpu_check.sh [tests|bench|all]   (BUDGET_S: the decode benchmark's seconds, default 420)
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-outputs/gpu_check}
PY=${PY:-python3}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
what=${1:-all}
rc=0
if [ "$what" != bench ]; then
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__, 'cuda', torch.cuda.is_available())"
  $PY -m pytest -m gpu tests/test_gpu.py -v -p no:cacheprovider --timeout 240 --durations=0 \
    --junitxml "$OUT/gpu_tests.xml" 2>&1 | tee "$OUT/gpu_tests.log" || rc=1
fi
if [ "$what" != tests ]; then
  $PY benchmarks/gpu/gpu_decode.py --out "$OUT" --budget-s "${BUDGET_S:-420}" 2>&1 | tee "$OUT/gpu_decode.log" || rc=1
fi
exit $rc
