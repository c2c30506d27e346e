#!/usr/bin/env bash
# The file store's benchmark on the device tool's GPU host (CPU and disk only): the segment store
# with its C loops and with its Python loops in the same run, pinned to 2 CPUs (CI's size) with
# two processes and the index rebuild, then on all CPUs, then two processes on 4 CPUs (two each:
# on 2 they are bound by the CPU), then the two C put arrangements paired batch by batch.
# About 8 minutes.
#   OUT=/tmp/out bash profiling/gpu_host_storage.sh
# MODE=parts: instead, pages of two parts (a page_first KV pool's K and V ranges; the store's C
# loops against its Python loops in the same runs) on 2 CPUs and on all, then one-part pages on
# 2 CPUs. About 8 minutes. MODE=forms: a page_first pool's pages as tensors against PageSpans,
# the pages' making and the store call timed together (storage_page_forms), then the benchmark
# with two-part pages as spans on 2 CPUs. About 5 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/storage_host}
mkdir -p "$OUT"
export PYTHONPATH=$PWD KVTIER_CACHE_DIR=${KVTIER_CACHE_DIR:-/tmp/kvtier-cache}
{
  date -u; nproc; uptime; uname -r
  python3 -c 'import sys, xxhash, torch; print(sys.version.split()[0], "xxhash", xxhash.VERSION, "torch", torch.__version__)'
  command -v cc gcc || echo "no C compiler"
  python3 -c 'from kvtier.storage.segments import native; lib = native.library(); print("native loops:", lib is not None, "streaming XXH3:", lib is not None and lib.stream_at is not None)'
} 2>&1 | tee "$OUT/host.txt"
if [ "${MODE:-all}" = forms ]; then
  all="0-$(($(nproc) - 1))"
  for run in "0,1 64 3" "0,1 256 2" "0,1 2048 2" "$all 64 3" "$all 256 2"; do
    set -- $run
    echo "== CPUs $1, $2 KiB pages"
    taskset -c "$1" timeout 120 python3 -m profiling.storage_page_forms --dir /tmp --page-kib "$2" \
      --rounds "$3" 2>&1 | tee -a "$OUT/page_forms.txt"
  done
  taskset -c 0,1 timeout 200 python3 profiling/bench_storage.py --dir /tmp --single-only \
    --pages 64 256 2048 --total-mib 256 --repeats 3 --parts 2 --spans --out "$OUT/pinned_spans2" \
    2>&1 | grep -E "^\| |load average|command|touched|pages of|no plot" | tee "$OUT/pinned_spans2.txt"
  exit 0
fi
if [ "${MODE:-all}" = parts ]; then
  all="0-$(($(nproc) - 1))"
  for run in "0,1 2 pinned_parts2" "$all 2 all_parts2" "0,1 1 pinned_parts1"; do
    set -- $run
    taskset -c "$1" timeout 190 python3 profiling/bench_storage.py --dir /tmp --single-only \
      --pages 64 256 2048 --total-mib 256 --repeats 3 --parts "$2" --out "$OUT/$3" 2>&1 \
      | grep -E "^\| |load average|command|touched|pages of|no plot" | tee "$OUT/$3.txt"
  done
  exit 0
fi
taskset -c 0,1 python3 profiling/bench_storage.py --dir /tmp --total-mib 256 --repeats 3 \
  --out "$OUT/pinned" 2>&1 | grep -E "^\| |load average|command|rebuild|touched|no plot" | tee "$OUT/pinned.txt"
python3 profiling/bench_storage.py --dir /tmp --pages 64 256 2048 --single-only --total-mib 256 \
  --repeats 3 --out "$OUT/all_cpus" 2>&1 | grep -E "^\| |load average|command|touched|no plot" | tee "$OUT/all_cpus.txt"
taskset -c 0-3 python3 profiling/bench_storage.py --dir /tmp --two-only --total-mib 256 \
  --repeats 3 --out "$OUT/two_4cpus" 2>&1 | grep -E "^\| |load average|touched|no plot" | tee "$OUT/two_4cpus.txt"
taskset -c 0,1 python3 -m profiling.storage_put_overlap --dir /tmp --rounds 6 2>&1 | tee "$OUT/put_overlap.txt"
