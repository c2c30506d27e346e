"""NVTX ranges for Nsight: one helper, one range per region.

Uses the ``nvtx`` package when it is installed, else ``torch.cuda.nvtx``; with no CUDA it is a
no-op. Ranges are named after the operation and its size, e.g. ``kvtier.d2h copy_engine all
layer_first 2.0MiB``, so a timeline reads without a legend (and shows which path each copy took).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

__all__ = ["annotate", "backend_name", "copy_range_name", "fmt_bytes", "nvtx_range"]

_F = TypeVar("_F", bound=Callable)

try:  # the nvtx package pushes ranges without touching CUDA state
    import nvtx as _nvtx_pkg
except ImportError:  # pragma: no cover - depends on the environment
    _nvtx_pkg = None


@functools.cache
def _cuda_available() -> bool:
    # Asked once: every copy call opens a range, and the query costs microseconds each time.
    return torch.cuda.is_available()


def backend_name() -> str:
    """Which NVTX implementation ranges go to: "nvtx", "torch.cuda.nvtx" or "none"."""
    if not _cuda_available():
        return "none"
    return "nvtx" if _nvtx_pkg is not None else "torch.cuda.nvtx"


@contextlib.contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    """Push an NVTX range around the block (no-op without CUDA)."""
    backend = backend_name()
    if backend == "none":
        yield
        return
    if backend == "nvtx":
        _nvtx_pkg.push_range(name)
        try:
            yield
        finally:
            _nvtx_pkg.pop_range()
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def annotate(name: str) -> Callable[[_F], _F]:
    """Decorator form of :func:`nvtx_range` with a fixed name."""

    def wrap(fn: _F) -> _F:
        @functools.wraps(fn)
        def inner(*args, **kwargs):
            with nvtx_range(name):
                return fn(*args, **kwargs)

        return inner  # type: ignore[return-value]

    return wrap


def fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n}B"


def copy_range_name(d2h: bool, path: str, layer: int | None, layout: str, nbytes: int) -> str:
    """The range of one device-host copy: direction, path taken, layer(s), host layout, size."""
    which = "all" if layer is None else f"layer{layer}"
    return f"kvtier.{'d2h' if d2h else 'h2d'} {path} {which} {layout} {fmt_bytes(nbytes)}"
