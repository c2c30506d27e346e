#!/usr/bin/env bash
# One device-machine call: the GPU test subset without the interpreter, the demo, copy GB/s by
# transfer size, pinned pool bring-up, and the warmed-up round trip. Logs go to $OUT.
#   OUT=/tmp/gpu bash profiling/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-profiling/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$OUT/env.txt"
python3 -m pytest -q -x -p no:cacheprovider tests/kernels tests/runtime/pools tests/runtime/tree \
  tests/runtime/test_warmup.py tests/runtime/test_pinned_bringup.py tests/runtime/test_cache.py \
  tests/runtime/test_facade_contract.py tests/example -k "not l3 and not demo_tiers" 2>&1 \
  | tail -8 | tee "$OUT/tests.txt"
TIMEFORMAT="wall %R s (process start to exit)"
{ time python3 -m kvtier demo --no-progress 2>&1; } 2>&1 | tee "$OUT/demo.txt"
python3 -m profiling.bench_copy_sizes 2>&1 | tee "$OUT/copy_sizes.txt"
python3 -m kvtier roundtrip 2>&1 | tee "$OUT/roundtrip.txt"
python3 -m profiling.bench_pool_bringup --sizes 4 16 48 --threads 4 16 --budget-s 150 \
  --out "$OUT" 2>&1 | tail -25 | tee "$OUT/bringup.txt"
