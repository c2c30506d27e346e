#!/usr/bin/env bash
# One device-machine call for the staged copy path (issue 12): its GPU tests and the copy-engine
# tests beside them, then bench_overlap on every path at P = 16 and 64 (or bench_e2e by layout
# and path with --e2e). Logs and results go to $OUT.
#   OUT=/tmp/gpu bash profiling/gpu_staged.sh [--e2e]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-profiling/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, cuda.bindings as cb; print('torch', torch.__version__, \
'triton', triton.__version__, 'cuda-bindings', cb.__version__)"
} 2>&1 | tee "$OUT/env.txt"
if [ "${1:-}" = "--e2e" ]; then
  for c in "layer_first kernel" "layer_first copy_engine" "page_first kernel" "page_first staged" \
      "page_first_direct staged" "page_first_direct auto"; do
    set -- $c
    python3 -m profiling.bench_e2e --out "$OUT/e2e_$1_$2" --host-layout "$1" --io-backend "$2" \
      2>&1 | tail -4 | tee "$OUT/e2e_$1_$2.txt"
  done
  exit 0
fi
python3 -m pytest -q -p no:cacheprovider tests/kernels/test_staged_gpu.py \
  tests/kernels/test_staged.py tests/runtime/test_staged_cache.py \
  tests/kernels/test_copy_engine_gpu.py tests/runtime/test_copy_engine_wait.py \
  tests/kernels/test_copy_engine.py tests/runtime/test_copy_engine_cache.py 2>&1 | tail -15 \
  | tee "$OUT/tests.txt"
python3 -m profiling.bench_overlap --out "$OUT" --reps 5 --paths kernel copy_engine staged \
  --page-sizes 16 64 2>&1 | tee "$OUT/bench.txt"
