"""Test set-up: run Triton kernels through the interpreter where there is no GPU.

TRITON_INTERPRET must be set before any ``@triton.jit`` decorator runs, so it is set here, before
kvtier is imported by any test module.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Test tensors are tiny: intra-op threads only add overhead, and thrash when the machine is busy.
torch.set_num_threads(1)

import pytest  # noqa: E402  (after TRITON_INTERPRET is set)


@pytest.fixture
def device() -> torch.device:
    """Where device pools live: the GPU when there is one, else the CPU (interpreter path)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
