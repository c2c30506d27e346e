#!/usr/bin/env bash
# One device-machine call: the GPU test subset without the interpreter, the demo (cold and warm
# Triton cache) and the warmed-up round trip. Logs go to $OUT (default: profiling/results/gpu).
#   bash profiling/gpu_session.sh
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-profiling/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$OUT/env.txt"
python3 -m pytest -q -x -p no:cacheprovider tests/kernels tests/runtime/test_warmup.py \
  tests/runtime/test_cache.py tests/runtime/test_facade_contract.py tests/example 2>&1 \
  | tail -15 | tee "$OUT/tests.txt"
for run in cold warm; do
  [ "$run" = cold ] && rm -rf ~/.triton/cache
  TIMEFORMAT="wall %R s (process start to exit; Triton cache $run)"
  { time python3 -m kvtier demo --no-progress 2>&1; } 2>&1 | tee "$OUT/demo_$run.txt"
done
python3 -m kvtier roundtrip 2>&1 | tee "$OUT/roundtrip.txt"
