"""Fast bring-up of large pinned host buffers (issue 12).

``torch.empty(..., pin_memory=True)`` faults, zeroes and pins every page from one thread: about
2 GiB/s, minutes for the pools of hundreds of GiB a serving host keeps. :func:`alloc_pinned` does
the same work in parallel:

1. one anonymous ``mmap``, aligned to 2 MiB and advised ``MADV_HUGEPAGE`` so that transparent huge
   pages back it where the kernel allows (silently 4 KiB pages otherwise);
2. worker threads fault in chunks (one write per base page: the kernel zeroes each page on its
   first touch, so the buffer starts as zeros), each bound to the CPUs of one NUMA node so that
   first touch places the pages there;
3. the whole range is registered once with ``cudaHostRegister`` (portable, mapped).

Registration is whole, not per chunk, for two measured reasons (H100, 16 threads, huge pages,
``profiling/results/bench_pool_bringup.md``): per-chunk registration from the touching threads
was slower (16 GiB: 4.9 GiB/s against 24.3 GiB/s whole; the driver serialises registrations),
and a ``cudaMemcpy`` whose range spans two registrations fails with ``cudaErrorInvalidValue``,
so ``Tensor.copy_`` across a chunk boundary broke.

Registered memory is page-locked and mapped into the GPU's address space like
``cudaHostAlloc`` memory: ``cudaPointerGetAttributes`` reports it as host memory, which is what
``Tensor.is_pinned()`` asks, and the Triton copy kernels read and write it through its host
address.

Lifetime. The tensor is ``torch.frombuffer`` over a private ``mmap`` subclass instance. Its storage
holds a reference to that object (not a buffer export), and every view shares the storage, so the
object dies only when the last view of the buffer is gone. A ``weakref.finalize`` on it then
unregisters the range, exactly once; the weakref callback runs before the base
``mmap`` deallocator unmaps the region. Nothing else holds the object, so the mapping cannot be
closed early.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["DEFAULT_CHUNK_BYTES", "PinStats", "alloc_pinned", "host_empty", "last_stats"]

log = logging.getLogger(__name__)

GiB = 1 << 30
HUGE_PAGE = 2 << 20
DEFAULT_CHUNK_BYTES = 256 << 20
DEFAULT_MAX_THREADS = 16
# A bar is worth drawing only when bring-up takes visible time.
PROGRESS_MIN_BYTES = 4 * GiB

_CUDA_HOST_REGISTER_PORTABLE = 0x01
_CUDA_HOST_REGISTER_MAPPED = 0x02
_REGISTER_FLAGS = _CUDA_HOST_REGISTER_PORTABLE | _CUDA_HOST_REGISTER_MAPPED
# At interpreter exit the runtime may be gone before the last buffer; nothing is left to undo.
_CUDA_ERROR_DEINITIALIZED = 4


@dataclass(frozen=True)
class PinStats:
    """How the last :func:`alloc_pinned` call went (seconds are wall time)."""

    nbytes: int
    threads: int
    chunk_bytes: int
    huge_pages: bool
    registration: str  # "whole", "torch" (fallback) or "none" (no CUDA)
    numa_node: int | None
    seconds: float

    @property
    def gib_per_s(self) -> float:
        return self.nbytes / GiB / self.seconds if self.seconds > 0 else float("inf")


_last: list[PinStats] = []


def last_stats() -> PinStats | None:
    """The statistics of the most recent :func:`alloc_pinned` call in this process."""
    return _last[-1] if _last else None


class _Region(mmap.mmap):
    """The anonymous mapping behind one buffer; a subclass so that it takes a finalizer."""


class _HostRegistrar:
    """``cudaHostRegister`` / ``cudaHostUnregister`` through torch's cudart or cuda-bindings."""

    def __init__(self, register: Callable[[int, int, int], int], unregister: Callable[[int], int]):
        self._register = register
        self._unregister = unregister

    @classmethod
    def find(cls) -> _HostRegistrar | None:
        with contextlib.suppress(Exception):
            rt = torch.cuda.cudart()
            if hasattr(rt, "cudaHostRegister") and hasattr(rt, "cudaHostUnregister"):
                return cls(
                    lambda p, n, f: int(rt.cudaHostRegister(p, n, f)),
                    lambda p: int(rt.cudaHostUnregister(p)),
                )
        with contextlib.suppress(ImportError):
            from cuda.bindings import runtime as cb

            return cls(
                lambda p, n, f: int(cb.cudaHostRegister(p, n, f)[0]),
                lambda p: int(cb.cudaHostUnregister(p)[0]),
            )
        return None

    def register(self, ptr: int, nbytes: int) -> None:
        err = self._register(ptr, nbytes, _REGISTER_FLAGS)
        if err != 0:
            raise RuntimeError(
                f"cudaHostRegister(0x{ptr:x}, {nbytes}) failed with CUDA error {err}"
            )

    def unregister(self, ptr: int) -> int:
        return self._unregister(ptr)


def _release(registrar: _HostRegistrar, ranges: list[tuple[int, int]]) -> None:
    """Unregister ``ranges`` (the finalizer: it must not raise, so failures become warnings)."""
    for ptr, _ in ranges:
        err = registrar.unregister(ptr)
        if err not in (0, _CUDA_ERROR_DEINITIALIZED):
            warnings.warn(
                f"cudaHostUnregister(0x{ptr:x}) failed with CUDA error {err}", stacklevel=1
            )


def _check_count(value: object, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: must be >= {minimum}, got {value}")
    return value


def default_threads() -> int:
    """Touch threads when none are given: the usable CPUs, at most 16 (memory bandwidth caps it)."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:
        cpus = os.cpu_count() or 1
    return max(1, min(DEFAULT_MAX_THREADS, cpus))


def _parse_cpulist(text: str) -> list[int]:
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def numa_nodes() -> dict[int, list[int]]:
    """``{node: cpus}`` of the host's NUMA nodes that have CPUs this process may use."""
    root = "/sys/devices/system/node"
    out: dict[int, list[int]] = {}
    try:
        names = os.listdir(root)
        allowed = os.sched_getaffinity(0)
    except (OSError, AttributeError):
        return out
    for name in names:
        if not (name.startswith("node") and name[4:].isdigit()):
            continue
        try:
            with open(f"{root}/{name}/cpulist") as f:
                cpus = [c for c in _parse_cpulist(f.read()) if c in allowed]
        except (OSError, ValueError):
            continue
        if cpus:
            out[int(name[4:])] = cpus
    return out


def gpu_numa_node(device: int | None = None) -> int | None:
    """The NUMA node the current (or given) GPU hangs off, from sysfs; None where unknown."""
    if not torch.cuda.is_available():
        return None
    try:
        props = torch.cuda.get_device_properties(
            torch.cuda.current_device() if device is None else device
        )
        bus = f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
        with open(f"/sys/bus/pci/devices/{bus}/numa_node") as f:
            node = int(f.read())
    except (AttributeError, OSError, ValueError, RuntimeError):
        return None
    return node if node >= 0 else None


@contextlib.contextmanager
def _bound_to(cpus: list[int] | None) -> Iterator[None]:
    """Run the calling thread on ``cpus`` (so its first touches allocate on their node)."""
    if not cpus:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)  # pid 0 is the calling thread on Linux
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _progress_bar(total: int, enabled: bool):  # -> tqdm-like or None
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="pinned pool")


def alloc_pinned(
    nbytes: int,
    *,
    threads: int | None = None,
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    progress: bool = False,
    huge_pages: bool = True,
    numa_node: int | None = -1,
) -> torch.Tensor:
    """A zero-filled 1-D uint8 CPU tensor of ``nbytes`` bytes, pinned where CUDA is present.

    Args:
        nbytes: size in bytes (> 0).
        threads: worker threads that fault in chunks; default :func:`default_threads`.
        chunk_bytes: the unit of work, a multiple of 2 MiB so that chunks cover whole huge pages.
        progress: draw a tqdm bar (when tqdm is installed) for buffers of 4 GiB or more.
        huge_pages: advise transparent huge pages (ignored silently where unsupported).
        numa_node: bind touching threads to this node's CPUs; -1 (default): the current GPU's
            node when the host has several nodes; None: no binding.

    Without CUDA the buffer is plain pageable memory. Without a way to call ``cudaHostRegister``
    (torch's cudart, else ``cuda-bindings``) it falls back to ``torch.empty(pin_memory=True)``.
    CUDA errors raise ``RuntimeError`` with the error code.
    """
    nbytes = _check_count(nbytes, "nbytes", 1)
    n_threads = default_threads() if threads is None else _check_count(threads, "threads", 1)
    chunk_bytes = _check_count(chunk_bytes, "chunk_bytes", HUGE_PAGE)
    if chunk_bytes % HUGE_PAGE:
        raise ValueError(f"chunk_bytes: must be a multiple of {HUGE_PAGE}, got {chunk_bytes}")
    if numa_node is not None and (isinstance(numa_node, bool) or not isinstance(numa_node, int)):
        raise TypeError(f"numa_node: must be an int or None, got {numa_node!r}")
    nodes = numa_nodes()
    if numa_node is not None and numa_node != -1 and numa_node not in nodes:
        raise ValueError(f"numa_node: {numa_node} is not one of this host's nodes {sorted(nodes)}")

    start = time.perf_counter()
    registrar: _HostRegistrar | None = None
    if torch.cuda.is_available():
        registrar = _HostRegistrar.find()
        if registrar is None:
            t = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).zero_()
            _record(nbytes, 1, chunk_bytes, False, "torch", None, start)
            return t
        torch.cuda.init()  # register in the primary context, the one kernels run in
    if numa_node == -1:
        numa_node = gpu_numa_node() if len(nodes) > 1 else None
    cpus = nodes.get(numa_node) if numa_node is not None else None

    # Over-map by one huge page so the buffer can start on a 2 MiB boundary: THP only backs
    # aligned 2 MiB ranges. The unused head is never touched, so it costs no memory.
    region = _Region(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    base = ctypes.addressof(ctypes.c_char.from_buffer(region))
    pad = -base % HUGE_PAGE
    used_huge = False
    if huge_pages and hasattr(mmap, "MADV_HUGEPAGE"):
        with contextlib.suppress(OSError):
            region.madvise(mmap.MADV_HUGEPAGE)
            used_huge = True
    ptr = base + pad

    chunks = [(o, min(chunk_bytes, nbytes - o)) for o in range(0, nbytes, chunk_bytes)]
    lock = threading.Lock()
    bar = _progress_bar(nbytes, progress and nbytes >= PROGRESS_MIN_BYTES)
    # One write per base page is enough to fault it in; numpy's strided fill drops the GIL.
    view = np.frombuffer(region, dtype=np.uint8, count=nbytes, offset=pad)
    page = mmap.PAGESIZE

    def work(chunk: tuple[int, int]) -> None:
        off, n = chunk
        with _bound_to(cpus):
            view[off : off + n : page] = 0
        if bar is not None:
            with lock:
                bar.update(n)

    try:
        with ThreadPoolExecutor(max_workers=min(n_threads, len(chunks))) as pool:
            # list() re-raises the first worker error once every submitted chunk is done.
            list(pool.map(work, chunks))
    finally:
        if bar is not None:
            bar.close()
    if registrar is not None:
        # On failure nothing is registered and the mapping goes with ``region``.
        registrar.register(ptr, nbytes)
        weakref.finalize(region, _release, registrar, [(ptr, nbytes)]).atexit = False
    tensor = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=pad)
    _record(
        nbytes, n_threads, chunk_bytes, used_huge,
        "none" if registrar is None else "whole", numa_node, start,
    )  # fmt: skip
    return tensor


def _record(
    nbytes: int,
    threads: int,
    chunk_bytes: int,
    huge: bool,
    registration: str,
    node: int | None,
    start: float,
) -> None:
    stats = PinStats(
        nbytes, threads, chunk_bytes, huge, registration, node, time.perf_counter() - start
    )
    _last[:] = [stats]
    log.info(
        "host buffer: %.2f GiB in %.2f s (%.2f GiB/s; %d threads, %s registration, "
        "huge pages %s, NUMA node %s)",
        nbytes / GiB, stats.seconds, stats.gib_per_s, threads, registration,
        "advised" if huge else "off", node,
    )  # fmt: skip


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, *, pin: bool) -> torch.Tensor:
    """A host pool's tensor: through :func:`alloc_pinned` (zeros) when ``pin``, else ``torch.empty``.

    Pool-sized buffers get a progress bar (over 4 GiB, when tqdm is installed).
    """
    if not pin:
        return torch.empty(shape, dtype=dtype)
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    return alloc_pinned(nbytes, progress=True).view(dtype).view(shape)
