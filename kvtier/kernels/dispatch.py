"""Which implementation runs a kernel call, and the shared argument checks.

``impl="auto"`` picks:

- ``"triton"``: the tensors are on a CUDA device;
- ``"interpreter"``: CPU tensors with ``TRITON_INTERPRET=1`` (Triton's interpreter runs the same
  kernel body on the CPU, in place);
- ``"torch"``: CPU tensors otherwise (the torch reference).

Every public kernel function returns the name of the path it took.
"""

from __future__ import annotations

import os
from typing import Literal

import torch

__all__ = ["Impl", "debug_checks", "interpreter_enabled", "select_impl", "set_debug_checks"]

Impl = Literal["auto", "triton", "interpreter", "torch"]

_DEBUG_CHECKS = os.environ.get("KVTIER_DEBUG_CHECKS", "1") not in ("0", "false", "False")


def interpreter_enabled() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("0", "")


def debug_checks() -> bool:
    """Whether index range/alignment checks run by default (they read indices back: a sync)."""
    return _DEBUG_CHECKS


def set_debug_checks(enabled: bool) -> None:
    """Turn the default index checks on or off (``KVTIER_DEBUG_CHECKS=0`` turns them off)."""
    global _DEBUG_CHECKS
    _DEBUG_CHECKS = bool(enabled)


def select_impl(device: torch.device, impl: Impl = "auto") -> str:
    """Resolve ``impl`` for tensors on ``device``; raises ValueError for an impossible choice."""
    on_cuda = device.type == "cuda"
    if impl == "auto":
        if on_cuda:
            return "triton"
        return "interpreter" if interpreter_enabled() else "torch"
    if impl == "triton" and not on_cuda:
        raise ValueError("impl='triton' needs CUDA tensors (use 'interpreter' on CPU)")
    if impl == "interpreter" and (on_cuda or not interpreter_enabled()):
        raise ValueError(
            "impl='interpreter' needs CPU tensors and TRITON_INTERPRET=1 set at import"
        )
    if impl not in ("triton", "interpreter", "torch"):
        raise ValueError(f"impl: unknown implementation {impl!r}")
    return impl
