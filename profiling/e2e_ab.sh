#!/usr/bin/env bash
# bench_e2e of an older kvtier against this checkout's, alternated, on one GPU.
#   OUT=/tmp/e2e_ab [ROUNDS=2] [LAYOUTS='layer_first page_first'] bash profiling/e2e_ab.sh OLD_TAR [bench_e2e args...]
# OLD_TAR: `git archive -o old.tar <rev> kvtier`. Both sides run this checkout's bench_e2e.py,
# each from a directory whose kvtier is the one measured: `python -m` puts the working directory
# first on sys.path, so PYTHONPATH cannot make it import another kvtier (an earlier A/B measured
# one code twice that way).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/e2e_ab}
OLD_TAR=$1
shift
ARGS=("$@")
[ ${#ARGS[@]} -eq 0 ] && ARGS=(--io-backend auto --reps 10)
NEW=$PWD
OLD=$(mktemp -d)
tar -xf "$OLD_TAR" -C "$OLD" && cp -r profiling "$OLD/"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
for who in old new; do
  dir=$NEW; [ $who = old ] && dir=$OLD
  got=$(cd "$dir" && python3 -c 'import kvtier; print(kvtier.__file__)')
  case $got in
    "$dir"/*) echo "$who: $got" ;;
    *) echo "$who imports $got, not $dir's kvtier"; exit 1 ;;
  esac
done
run() { local who=$1 tag=$2; shift 2; local dir=$NEW; [ "$who" = old ] && dir=$OLD
  (cd "$dir" && python3 -m profiling.bench_e2e --out "$OUT/$tag" "${ARGS[@]}" "$@" > "$OUT/$tag.log" 2>&1)
  grep -E "Overlapped /|Per repetition" "$OUT/$tag.log" | sed "s/^/$tag: /"; }
for round in $(seq 1 ${ROUNDS:-2}); do
  order="old new"; [ $((round % 2)) = 0 ] && order="new old"
  for who in $order; do
    for layout in ${LAYOUTS:-layer_first page_first}; do
      run $who "${who}_${layout}_$round" --host-layout $layout
    done
  done
done
