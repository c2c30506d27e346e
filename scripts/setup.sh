#!/usr/bin/env bash
# Sets kvtier up on a fresh machine. `--test` also installs what the test suite needs, including
# the Mooncake store (its CPU build) that the L3 tests run against.
# An existing torch (CUDA or CPU) is left alone; without one, the CPU wheel is installed so that a
# CPU-only machine never pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    "$PY" -m pip install -q "torch==2.13.0"  # a GPU host: PyPI's torch is the CUDA build
  else
    # No GPU: the CPU build by its local version, so that no CUDA wheel can be chosen (a plain
    # "torch==2.13.0" resolves to the CUDA build and a dozen nvidia-* wheels on PyPI). From the
    # configured indexes first (a local wheel house), else from PyTorch's CPU index.
    "$PY" -m pip install -q "torch==2.13.0+cpu" ||
      "$PY" -m pip install -q "torch==2.13.0+cpu" \
        --index-url https://download.pytorch.org/whl/cpu --extra-index-url https://pypi.org/simple
  fi
fi

if [ "${1:-}" = "--test" ]; then
  # Mooncake's store library links libibverbs, libnuma and libcurl.
  if ! ldconfig -p | grep -q libibverbs.so.1 && [ "$(id -u)" = 0 ]; then
    apt-get update -qq
    apt-get install -y -qq libibverbs1 libnuma1 libcurl4 >/dev/null
  fi
  "$PY" -m pip install -q -e ".[test]"
  if ! "$PY" -c "import torch, sys; sys.exit(torch.cuda.is_available())"; then
    : # a GPU host wants the CUDA build of Mooncake (mooncake-transfer-engine); not installed here
  else
    "$PY" -m pip install -q "mooncake-transfer-engine-non-cuda==0.3.13.post1"
  fi
else
  "$PY" -m pip install -q -e .
fi
