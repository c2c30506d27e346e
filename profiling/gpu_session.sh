#!/usr/bin/env bash
# One device-machine call: the GPU tests without the interpreter (kernels, copy engine, pools,
# tree, facade, DeepSeek-V4 sidecars, retention, the example models), the sidecar copy benchmark,
# the demo, and the warmed-up round trip. Logs go to $OUT.
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
python3 -m pytest -q -p no:cacheprovider tests/kernels tests/runtime/pools tests/runtime/tree \
  tests/runtime/test_warmup.py tests/runtime/test_cache.py tests/runtime/test_facade_contract.py \
  tests/runtime/test_copy_engine_wait.py tests/runtime/test_copy_engine_cache.py \
  tests/runtime/test_v4_sidecars.py tests/runtime/test_retention.py tests/runtime/test_mla_indexer.py \
  tests/runtime/test_metrics_export.py \
  tests/runtime/test_staged_cache.py tests/example -k "not l3 and not demo_tiers and not mooncake" \
  2>&1 | tail -12 | tee "$OUT/tests.txt"
python3 -m profiling.bench_sidecar --out "$OUT" 2>&1 | tee "$OUT/sidecar.txt"
TIMEFORMAT="wall %R s (process start to exit)"
{ time python3 -m kvtier demo --no-progress 2>&1; } 2>&1 | tee "$OUT/demo.txt"
python3 -m kvtier roundtrip 2>&1 | tee "$OUT/roundtrip.txt"
