#!/bin/bash
# One device call: the copy kernel before and after a change (OLD_TAR: `git archive -o old.tar
# <rev> kvtier`), alternated, by bench_small_grid's default table; then the kernel tests without
# the interpreter. Logs under $OUT.
set -u
OUT=${OUT:-/tmp/gpu_rows}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
here=$PWD
{ date -u; nvidia-smi --query-gpu=name,driver_version,temperature.gpu --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"; } | tee "$OUT/env.txt"
old=/tmp/kv_old; rm -rf $old; mkdir -p $old; tar -xf "$OLD_TAR" -C $old; cp -r profiling $old/
step() { local tag=$1 limit=$2 dir=$3; shift 3; local t0=$(date +%s)
  (cd "$dir" && PYTHONPATH=$dir timeout "$limit" "$@") > "$OUT/$tag.log" 2>&1; local rc=$?
  echo "$tag: rc=$rc $(( $(date +%s) - t0 )) s"
  python3 -c "import sys; print(open('$OUT/$tag.log').read().count('Traceback'), 'tracebacks')"; }
for side in ${ORDER:-old new new old}; do
  dir=$here; [ $side = old ] && dir=$old
  n=$(ls $OUT | grep -c "^sg_$side"); tag=sg_${side}$n
  step $tag ${SG_S:-120} $dir python3 -m profiling.bench_small_grid --rounds 2
  grep "programs=" "$OUT/$tag.log" | sed "s/^/$tag /" | sed 's/, 16 warps.*//'
done
step tests ${TESTS_S:-200} $here python3 -m pytest -q -p no:cacheprovider -x tests/kernels/test_kv_transfer.py tests/kernels/test_fast_launch.py
tail -3 "$OUT/tests.log"
