#!/usr/bin/env bash
# Sets up and runs the test suite. Servers the tests start (the Mooncake master) listen on
# loopback only: as root, the suite runs inside a fresh network namespace with only `lo` up.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
PY=${PYTHON:-python3}
# Lint and format are part of the suite (the rules and the pinned ruff are in pyproject.toml).
"$PY" -m ruff check kvtier tests profiling
"$PY" -m ruff format --check kvtier tests profiling

# Two workers (pytest-xdist) by default: the suite is CPU-bound single-threaded Python (Triton's
# interpreter), so two workers on CI's 2 cores take ~60% of one's time. One process on a GPU host
# (its timed GPU tests would share one card) and for debugging (--pdb, --trace, -s need one).
# KVTIER_TEST_WORKERS sets the count; 0 runs in one process.
workers=${KVTIER_TEST_WORKERS:-}
if [ -z "$workers" ]; then
  workers=2
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    workers=0
  fi
  for arg in "$@"; do
    case "$arg" in
      --pdb | --trace | -s | --capture=no) workers=0 ;;
    esac
  done
fi
set -- -n "$workers" "$@"

if [ "$(id -u)" = 0 ] && command -v unshare >/dev/null && unshare -n true 2>/dev/null; then
  exec unshare -n bash -c 'ip link set lo up && exec "$0" -m pytest -q "$@"' "$PY" "$@"
fi
if [ "${CI:-}" = "true" ]; then
  echo "CI needs root and unshare to isolate the network; refusing to run servers on open interfaces" >&2
  exit 1
fi
exec "$PY" -m pytest -q "$@"
