#!/usr/bin/env bash
# Sets kvtier up on a fresh machine. `--test` also installs what the test suite needs.
# An existing torch (CUDA or CPU) is left alone; without one, the CPU wheel is installed so that a
# CPU-only machine never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  "$PY" -m pip install -q "torch==2.13.0"
fi

extras=""
if [ "${1:-}" = "--test" ]; then
  extras="[test]"
fi
"$PY" -m pip install -q -e ".${extras}"
