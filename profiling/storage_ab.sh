#!/usr/bin/env bash
# Old and new file store alternated on one host, both run by this checkout's bench_storage.py
# (issue 13's "old store's figures beside them"), pinned to 2 CPUs like CI's machine.
#   OUT=/tmp/ab bash profiling/storage_ab.sh OLD_TAR [bench_storage args...]
# OLD_TAR: `git archive -o old.tar <rev> kvtier` of the store to compare with.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/storage_ab}
OLD_TAR=$1
shift
mkdir -p "$OUT" /tmp/storage_ab_old
tar -xf "$OLD_TAR" -C /tmp/storage_ab_old
NEW=$PWD
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--dir /tmp --pages 64 256 2048 --single-only --total-mib 256 --repeats 3)
for round in 1 2; do
  for which in old new; do
    code=$NEW
    [ "$which" = old ] && code=/tmp/storage_ab_old
    got=$(cd / && PYTHONPATH=$code python3 -c 'import kvtier; print(kvtier.__file__)')
    case $got in
      "$code"/*) echo "== round $round: $which: $got" ;;
      *) echo "PYTHONPATH=$code imports $got (an editable install wins): run where none is"; exit 1 ;;
    esac
    PYTHONPATH=$code taskset -c 0,1 python3 "$NEW/profiling/bench_storage.py" "${ARGS[@]}" \
      --out "$OUT/${which}_$round" 2>&1 | grep -E "^\| |load average|command|touched" | tee "$OUT/${which}_$round.txt"
  done
done
