"""Which implementation runs a kernel call, and the shared argument checks.

``impl="auto"`` picks:

- ``"triton"``: the tensors are on a CUDA device;
- ``"interpreter"``: CPU tensors with ``TRITON_INTERPRET=1`` (Triton's interpreter runs the same
  kernel body on the CPU, in place);
- ``"torch"``: CPU tensors otherwise (the torch reference).

Every public kernel function returns the name of the path it took.

A device↔host copy between pools can also run on the copy engine (:mod:`kvtier.kernels.copy_engine`)
or staged through a device ring (:mod:`kvtier.kernels.staged`: a gather or scatter kernel on the
device plus contiguous copy-engine transfers); ``io_backend`` (``"auto"``, ``"kernel"``,
``"copy_engine"`` or ``"staged"``) chooses, per transfer, through :func:`select_route`, and every
choice comes with a :class:`RouteReason`.
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


# -- io_backend: kernel, copy engine or staged -----------------------------------------------------

IO_BACKENDS = ("auto", "kernel", "copy_engine", "staged")


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
    FORCED_STAGED = "io_backend_staged"
    AUTO_ENGINE = "auto_copy_engine"
    AUTO_SMALL_CHUNKS = "auto_small_chunks"
    AUTO_SMALL_TRANSFER = "auto_small_transfer"
    AUTO_MANY_DESCRIPTORS = "auto_many_descriptors"  # enqueue would rival the copy itself
    AUTO_STAGED = "auto_staged"  # not contiguous or too many descriptors, and staging wins
    NO_ENGINE = "fallback_no_engine"  # no CUDA, no cuda-bindings, or CUDA < 12.8
    NOT_CONTIGUOUS = "fallback_not_contiguous"  # page_first: a page's layers interleave
    LEGACY_STREAM = "fallback_legacy_stream"
    # The first layer of a load under "auto" goes through the kernel, issued before the rest
    # of the batch is planned: nothing computes yet, so its SMs cost nothing, and the launch
    # starts the copy at once where a batch of descriptors (copy engine) or the staging ring
    # would first spend its set-up (HostCopier.plan_lead, plan(lead=, lead_plan=)). Counted
    # where the rest takes another path; on the kernel route the lead is the plan itself. A
    # copy-engine load of few descriptors takes none (Crossover.inline_descriptors).
    LEAD_LAYER = "lead_layer_kernel"


class Route(NamedTuple):
    """A transfer's path (``"copy_engine"``, ``"staged"`` or a kernel impl: ``"triton"``,
    ``"interpreter"``, ``"torch"``), why it was taken, and the detail behind a fallback."""

    path: str
    reason: RouteReason
    detail: str = ""


@dataclass(frozen=True)
class Crossover:
    """Where the copy engine starts to win, for one direction.

    Attributes:
        min_chunk_bytes: every (buffer, page, layer) chunk at least this large.
        min_call_bytes: every call at least this large.
        free_descriptors: a call of up to this many descriptors is cheap to enqueue whatever
            their size.
        min_descriptor_bytes: above ``free_descriptors``, the mean bytes per descriptor of the
            largest call (after adjacent chunks merged) must reach this, or enqueueing it would
            take about as long as the copy.
        staged: send what the copy engine takes badly (chunks not contiguous on the host, too
            many descriptors) to the staged path instead of the kernel.
        inline_descriptors: a copy-engine batch whose largest call has at most this many
            descriptors (after adjacent chunks merged: a load whose device and host pages both
            run consecutively is one per buffer and layer) costs the CPU tens of µs a call. It
            is enqueued by the thread that needs it (a load: step by step as the forward pass
            waits) with no issue worker, whose Python would contend with the forward's launches
            for the GIL, and a load takes no kernel lead for its first layer, whose index
            upload and launch cost more than the call. Larger batches keep both.
    """

    min_chunk_bytes: int
    min_call_bytes: int
    free_descriptors: int = 128
    min_descriptor_bytes: int = 0
    staged: bool = False
    inline_descriptors: int = 32


# Shipped crossovers (``io_backend="auto"``), from profiling/results/bench_overlap.md (H100):
# 2 KiB chunks (P=1, 8x128 bf16) ran at 1.3-5 GB/s on the copy engine against 50 on the kernel,
# while 32 and 128 KiB chunks (P=16, 64) matched the kernel alone, overlapped a GEMM loop better
# (fixed-work ratio 1.05-1.22 against 1.23-1.56) and left it alone during backups (-5% to +2%
# against +21% to +50%). A batch call costs more CPU than a launch (about 0.6 µs a descriptor),
# so calls under a few hundred KiB stay on the kernel.
#
# Descriptors: the driver takes about 0.55 µs per descriptor, and a copy runs at about 50 GB/s,
# so a descriptor of ~28 KB costs as much CPU time as the engine spends moving it. A per-layer
# load gates the forward pass: bench_e2e_paths.md measured page_first_direct at P=16 (896
# unmerged descriptors of 32 KiB per layer, 0.5 ms of enqueue per layer) at 1.59x the bound
# against 1.15x on the kernel, while layer_first on the same run (where consecutive pages on
# both sides merge into fewer, larger descriptors) reached 1.10x, and 128 KiB descriptors (P=64)
# kept up in bench_overlap. Loads therefore need a mean of 64 KiB per descriptor once a call has
# more than a few. (bench_overlap's GEMM loop, a few long kernels, did not feel 1024-descriptor
# calls: the cost falls on a forward pass's many launches, so bench_e2e is the measure for this
# rule; the counts per call in that run were not recorded.) A backup is enqueued by the
# issue worker off the forward pass, and the engine still spared the GEMMs at 32 KiB (32768
# descriptors: -5% to -2%): its floor is the chunk floor.
#
# ``staged`` stays off until bench_overlap's and bench_e2e's staged rows are measured on a GPU.
CROSSOVERS = {
    "d2h": Crossover(min_chunk_bytes=16 << 10, min_call_bytes=256 << 10),
    "h2d": Crossover(
        min_chunk_bytes=16 << 10, min_call_bytes=256 << 10, min_descriptor_bytes=64 << 10
    ),
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
    descriptors: int = 0,
    crossovers: dict[str, Crossover] | None = None,
) -> Route:
    """Pick the path of one transfer.

    Args:
        io_backend: "auto", "kernel", "copy_engine" or "staged".
        kernel_path: what the kernel path would run (:func:`select_impl`).
        engine_reason: "" when the copy engine can run here, else why not.
        contiguous: every (buffer, page, layer) chunk is one range on both sides.
        legacy_stream: the copy would be issued on the legacy default stream.
        d2h: direction; chunk_bytes: bytes per chunk; call_bytes: bytes of the call (one layer
            of a per-layer load, all layers of a backup).
        descriptors: copy-engine descriptors of the largest call after adjacent chunks merged
            (:func:`~kvtier.kernels.copy_engine.count_descriptors`); 0: not weighed.
        crossovers: the table ``"auto"`` reads (default :data:`CROSSOVERS`).

    ``"copy_engine"`` and ``"staged"`` fall back to the kernel (with the reason) where the
    engine cannot run; ``"auto"`` also stays on the kernel below the crossovers, and goes to the
    staged path instead where the table says ``staged``.
    """
    check_io_backend(io_backend)
    if io_backend == "kernel":
        return Route(kernel_path, RouteReason.FORCED_KERNEL)
    if engine_reason:
        return Route(kernel_path, RouteReason.NO_ENGINE, engine_reason)
    if legacy_stream:
        return Route(
            kernel_path,
            RouteReason.LEGACY_STREAM,
            "cudaMemcpyBatchAsync rejects the legacy default stream; issue on a stream",
        )
    if io_backend == "staged":
        return Route("staged", RouteReason.FORCED_STAGED)
    x = (crossovers or CROSSOVERS)["d2h" if d2h else "h2d"]
    if not contiguous:
        if io_backend == "auto" and x.staged and call_bytes >= x.min_call_bytes:
            return Route(
                "staged", RouteReason.AUTO_STAGED, "a page's layers interleave on the host"
            )
        return Route(
            kernel_path, RouteReason.NOT_CONTIGUOUS, "a page's layers interleave on the host"
        )
    if io_backend == "copy_engine":
        return Route("copy_engine", RouteReason.FORCED_ENGINE)
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
    if descriptors > x.free_descriptors and call_bytes < descriptors * x.min_descriptor_bytes:
        detail = (
            f"{descriptors} descriptors of {call_bytes // descriptors} B on average per call "
            f"(> {x.free_descriptors} and < {x.min_descriptor_bytes} B)"
        )
        if x.staged:
            return Route("staged", RouteReason.AUTO_STAGED, detail)
        return Route(kernel_path, RouteReason.AUTO_MANY_DESCRIPTORS, detail)
    return Route("copy_engine", RouteReason.AUTO_ENGINE)
