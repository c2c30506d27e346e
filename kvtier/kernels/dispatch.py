"""Which implementation runs a kernel call, and the shared argument checks.

``impl="auto"`` picks:

- ``"triton"``: the tensors are on a CUDA device;
- ``"interpreter"``: CPU tensors with ``TRITON_INTERPRET=1`` (Triton's interpreter runs the same
  kernel body on the CPU, in place);
- ``"torch"``: CPU tensors otherwise (the torch reference).

Every public kernel function returns the name of the path it took.

A device↔host copy between pools can also run on the copy engine (:mod:`kvtier.kernels.copy_engine`);
``io_backend`` (``"auto"``, ``"kernel"`` or ``"copy_engine"``) chooses, per transfer, through
:func:`select_route`, and every choice comes with a :class:`RouteReason`.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Literal, NamedTuple

import torch

__all__ = [
    "CROSSOVERS",
    "IO_BACKENDS",
    "Crossover",
    "Impl",
    "Route",
    "RouteReason",
    "check_io_backend",
    "debug_checks",
    "interpreter_enabled",
    "select_impl",
    "select_route",
    "set_debug_checks",
]

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


# -- io_backend: kernel or copy engine ---------------------------------------------------------

IO_BACKENDS = ("auto", "kernel", "copy_engine")


def check_io_backend(value: object, arg: str = "io_backend") -> str:
    """``value`` if it names an io backend; TypeError/ValueError naming ``arg`` otherwise."""
    if not isinstance(value, str):
        raise TypeError(
            f"{arg}: expected one of {IO_BACKENDS}, got {value!r} ({type(value).__name__})"
        )
    if value not in IO_BACKENDS:
        raise ValueError(f"{arg}: unknown io backend {value!r}; choose from {IO_BACKENDS}")
    return value


class RouteReason(str, enum.Enum):
    """Why a transfer took its path (counted per reason in the cache's copy metrics)."""

    FORCED_KERNEL = "io_backend_kernel"
    FORCED_ENGINE = "io_backend_copy_engine"
    AUTO_ENGINE = "auto_copy_engine"
    AUTO_SMALL_CHUNKS = "auto_small_chunks"
    AUTO_SMALL_TRANSFER = "auto_small_transfer"
    NO_ENGINE = "fallback_no_engine"  # no CUDA, no cuda-bindings, or CUDA < 12.8
    NOT_CONTIGUOUS = "fallback_not_contiguous"  # page_first: a page's layers interleave
    LEGACY_STREAM = "fallback_legacy_stream"


class Route(NamedTuple):
    """A transfer's path (``"copy_engine"`` or a kernel impl: ``"triton"``, ``"interpreter"``,
    ``"torch"``), why it was taken, and the detail behind a fallback."""

    path: str
    reason: RouteReason
    detail: str = ""


@dataclass(frozen=True)
class Crossover:
    """Where the copy engine starts to win: every chunk and every call at least this large."""

    min_chunk_bytes: int
    min_call_bytes: int


# Shipped crossovers (``io_backend="auto"``), from profiling/results/bench_overlap.md (H100):
# 2 KiB chunks (P=1, 8x128 bf16) ran at 1.3-5 GB/s on the copy engine against 50 on the kernel,
# while 32 and 128 KiB chunks (P=16, 64) matched the kernel alone, overlapped a GEMM loop better
# (fixed-work ratio 1.05-1.22 against 1.23-1.56) and left it alone during backups (-5% to +2%
# against +21% to +50%). A batch call costs more CPU than a launch (about 0.6 µs a descriptor),
# so calls under a few hundred KiB stay on the kernel.
CROSSOVERS = {
    "d2h": Crossover(min_chunk_bytes=16 << 10, min_call_bytes=256 << 10),
    "h2d": Crossover(min_chunk_bytes=16 << 10, min_call_bytes=256 << 10),
}


def select_route(
    io_backend: str,
    *,
    kernel_path: str,
    engine_reason: str,
    contiguous: bool,
    legacy_stream: bool,
    d2h: bool,
    chunk_bytes: int,
    call_bytes: int,
) -> Route:
    """Pick the path of one transfer.

    Args:
        io_backend: "auto", "kernel" or "copy_engine".
        kernel_path: what the kernel path would run (:func:`select_impl`).
        engine_reason: "" when the copy engine can run here, else why not.
        contiguous: every (buffer, page, layer) chunk is one range on both sides.
        legacy_stream: the copy would be issued on the legacy default stream.
        d2h: direction; chunk_bytes: bytes per chunk; call_bytes: bytes of the call (one layer
            of a per-layer load, all layers of a backup).

    ``"copy_engine"`` falls back to the kernel (with the reason) where the engine cannot run;
    ``"auto"`` also stays on the kernel below the crossovers in :data:`CROSSOVERS`.
    """
    check_io_backend(io_backend)
    if io_backend == "kernel":
        return Route(kernel_path, RouteReason.FORCED_KERNEL)
    if engine_reason:
        return Route(kernel_path, RouteReason.NO_ENGINE, engine_reason)
    if not contiguous:
        return Route(
            kernel_path, RouteReason.NOT_CONTIGUOUS, "a page's layers interleave on the host"
        )
    if legacy_stream:
        return Route(
            kernel_path,
            RouteReason.LEGACY_STREAM,
            "cudaMemcpyBatchAsync rejects the legacy default stream; issue on a stream",
        )
    if io_backend == "copy_engine":
        return Route("copy_engine", RouteReason.FORCED_ENGINE)
    x = CROSSOVERS["d2h" if d2h else "h2d"]
    if chunk_bytes < x.min_chunk_bytes:
        return Route(
            kernel_path,
            RouteReason.AUTO_SMALL_CHUNKS,
            f"{chunk_bytes} B chunks < {x.min_chunk_bytes} B",
        )
    if call_bytes < x.min_call_bytes:
        return Route(
            kernel_path,
            RouteReason.AUTO_SMALL_TRANSFER,
            f"{call_bytes} B per call < {x.min_call_bytes} B",
        )
    return Route("copy_engine", RouteReason.AUTO_ENGINE)
