#!/usr/bin/env bash
# One device-machine call for issue #12: cuda-bindings (from .whl when the image lacks it), the
# copy-engine GPU tests, then bench_overlap. Logs and results go to $OUT.
#   OUT=/tmp/gpu bash profiling/gpu_overlap.sh [bench_overlap args...]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-profiling/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
if ! python3 -c "import cuda.bindings.runtime" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
    .whl/*.whl && export PYTHONPATH=$PWD:/tmp/site
fi
{
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton, cuda.bindings as cb; print('torch', torch.__version__, \
'triton', triton.__version__, 'cuda-bindings', cb.__version__)"
  python3 -c "import torch; from kvtier.kernels.copy_engine import engine_support as s; \
print('copy engine:', s(torch.device('cuda')))"
} 2>&1 | tee "$OUT/env.txt"
python3 -m pytest -q -x -p no:cacheprovider -s tests/kernels/test_copy_engine_gpu.py \
  tests/runtime/test_copy_engine_wait.py tests/kernels/test_copy_engine.py \
  tests/runtime/test_copy_engine_cache.py tests/runtime/test_cache.py tests/runtime/test_warmup.py \
  tests/runtime/test_mla_indexer.py tests/runtime/test_facade_contract.py 2>&1 | tail -15 | tee "$OUT/tests.txt"
python3 -m profiling.bench_overlap --out "$OUT" --reps 5 "$@" 2>&1 | tee "$OUT/bench.txt"
