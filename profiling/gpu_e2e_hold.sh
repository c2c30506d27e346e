#!/bin/bash
# bench_e2e on one GPU: hold off (the default) and on alternated, modes interleaved; then the
# main thread's CPU before the forward (--time-start), page_first, and the GPU tests of the load
# paths. Device tool: `bash profiling/gpu_e2e_hold.sh` (writes logs under $OUT).
set -u
OUT=${OUT:-/tmp/e2e_hold}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,temperature.gpu --format=csv,noheader
args="--host-layout layer_first --io-backend auto --reps 10"
run() { local tag=$1; shift; local t0=$(date +%s)
  python3 -m profiling.bench_e2e --out $OUT/$tag $args "$@" > $OUT/$tag.log 2>&1
  grep -E "^(overlap|compute|transfer) |Overlapped /|Per repetition" $OUT/$tag.log | sed "s/^/$tag: /"
  echo "$tag: $(( $(date +%s) - t0 )) s"; }
run new1
run hold1 --hold
run hold2 --hold
run new2
run new3
run hold3 --hold
run ts --time-start
grep -A25 "time-start:" $OUT/ts.log
run pf --host-layout page_first
t0=$(date +%s)
timeout 400 python3 -m pytest -q -p no:cacheprovider tests/runtime tests/test_api.py tests/kernels/test_bad_input.py tests/kernels/test_issue_pacing.py tests/kernels/test_fast_launch.py -k "not mooncake" -x > $OUT/pytest.log 2>&1
echo "pytest rc=$? $(( $(date +%s) - t0 )) s"; tail -5 $OUT/pytest.log
