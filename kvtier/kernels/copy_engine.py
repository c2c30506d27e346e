"""The copy-engine path: ``cudaMemcpyBatchAsync`` of whole (buffer, page, layer) chunks.

A copy kernel moves bytes with SMs, and beside a forward pass it gets SMs only between the
model's kernels (issue #12: a per-layer load ran at 14 GB/s instead of 50 next to a GEMM loop,
and an all-layer backup slowed the GEMMs by 24-45%). The copy engines need no SM. They are fed
a batch of ``(src, dst, size)`` descriptors, one per chunk that is contiguous on both sides:

    device  chunk (b, page d, layer l) = layers[b][l].data_ptr() + d * P * I       (P * I bytes)
    host    chunk (b, page h, layer l) = data_ptr + offset + b * s_buf + h * s_page + l * s_layer

which is one range exactly when the host layout keeps a page's tokens of one layer adjacent
(``stride_token == item_bytes``: ``layer_first``, ``page_first_direct``, flat layer-major page
objects; any layout at ``P == 1``). ``page_first`` interleaves layers inside a page, so it stays
on the kernel. Descriptors come from the same four byte strides the Triton kernel takes
(:class:`~kvtier.kernels.layout.HostBuffer`), built with numpy for a whole batch at once, and
adjacent chunks (consecutive pages on both sides) are merged into one.

Needs CUDA >= 12.8 (driver and runtime) and ``cuda-bindings`` (``pip install kvtier[cuda]``).
The call rejects the legacy default stream. :func:`engine_support` says whether the path can
run and, if not, why; :class:`HostCopier` falls back to the kernel with that reason.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvtier.kernels.layout import DeviceBuffers, HostBuffer

__all__ = [
    "MIN_CUDA_VERSION",
    "ChunkGeometry",
    "Descriptors",
    "EngineSupport",
    "LayerEntries",
    "PageRuns",
    "batch_call_kind",
    "build_descriptors",
    "engine_support",
    "layer_descriptors",
    "memcpy_2d",
    "memcpy_batch",
    "page_runs",
    "runs_descriptors",
    "stream_handle",
    "upload_indices",
]

# cudaMemcpyBatchAsync appeared in CUDA 12.8 (encoded as 1000 * major + 10 * minor).
MIN_CUDA_VERSION = 12080


def _import_cudart() -> Any:
    """The ``cuda.bindings.runtime`` module (a seam: tests replace it to fake a machine)."""
    from cuda.bindings import runtime

    return runtime


# The current stream's raw handle without a ``torch.cuda.Stream`` object: ``current_stream``
# builds one per call (~10 us of CPU on an H100 host, eight of them before a load's forward).
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def stream_handle(device: torch.device) -> int:
    """The raw handle of the current stream on ``device`` (0: the legacy stream; 0 off CUDA)."""
    if device.type != "cuda":
        return 0
    if _RAW_STREAM is not None and device.index is not None:
        return _RAW_STREAM(device.index)
    return torch.cuda.current_stream(device).cuda_stream


def upload_indices(parts: Sequence[np.ndarray], device: torch.device) -> torch.Tensor:
    """``parts`` (int64 arrays of one length) stacked as rows of one int64 tensor on
    ``device``. On CUDA the rows go through pinned memory from torch's caching host allocator,
    which keeps a block until the copy that reads it is done: the copy is then an asynchronous
    DMA (from pageable memory the driver first stages the bytes itself: ~100 us of CPU for a
    7K-token load's indices on an H100 host, on the path to the load's first copy)."""
    if device.type != "cuda":
        return torch.from_numpy(np.stack(parts))
    staging = torch.empty((len(parts), len(parts[0])), dtype=torch.int64, pin_memory=True)
    np.stack(parts, out=staging.numpy())
    return staging.to(device, non_blocking=True)


def _version_str(v: int) -> str:
    return f"{v // 1000}.{v % 1000 // 10}"


@dataclass(frozen=True)
class EngineSupport:
    """Whether the copy-engine path can run on a device; ``reason`` says why not."""

    ok: bool
    reason: str = ""


def engine_support(device: torch.device) -> EngineSupport:
    """Probe the copy-engine path for ``device``: CUDA, cuda-bindings, and CUDA >= 12.8."""
    if device.type != "cuda":
        return EngineSupport(False, f"no CUDA: the device pool is on {device}")
    try:
        rt = _import_cudart()
    except ImportError as e:
        return EngineSupport(False, f"cuda-bindings is not installed ({e})")
    if not hasattr(rt, "cudaMemcpyBatchAsync"):
        return EngineSupport(False, "cuda-bindings has no cudaMemcpyBatchAsync (needs >= 12.8)")
    for what, fn in (("driver", rt.cudaDriverGetVersion), ("runtime", rt.cudaRuntimeGetVersion)):
        err, version = fn()
        if int(err) != 0:
            return EngineSupport(False, f"cannot read the CUDA {what} version (error {int(err)})")
        if version < MIN_CUDA_VERSION:
            return EngineSupport(
                False,
                f"the CUDA {what} is {_version_str(version)}; cudaMemcpyBatchAsync needs "
                f"{_version_str(MIN_CUDA_VERSION)}",
            )
    return EngineSupport(True)


@dataclass(frozen=True)
class ChunkGeometry:
    """Where each (buffer, page, layer) chunk of a device/host buffer pair lives, in bytes.

    Built once per pool pair (:meth:`of`); :func:`build_descriptors` turns page ids into
    descriptors with it. ``contiguous`` is False when a chunk is not one range on the host.
    """

    dev_addr: np.ndarray  # int64 [B, L]: data_ptr of layers[b][l]
    host_addr: int  # address of slot 0 of buffer 0, layer 0
    stride_buffer: int
    stride_page: int
    stride_layer: int
    chunk_bytes: int  # P * item_bytes, the same on both sides
    page_size: int
    contiguous: bool

    @classmethod
    def of(cls, dev: DeviceBuffers, host: HostBuffer) -> ChunkGeometry:
        P, item = host.page_size, host.item_bytes
        return cls(
            dev_addr=np.array([[t.data_ptr() for t in buf] for buf in dev.layers], dtype=np.int64),
            host_addr=host.tensor.data_ptr() + host.offset,
            stride_buffer=host.stride_buffer,
            stride_page=host.stride_page,
            stride_layer=host.stride_layer,
            chunk_bytes=P * item,
            page_size=P,
            contiguous=P == 1 or host.stride_token == item,
        )

    @property
    def num_buffers(self) -> int:
        return self.dev_addr.shape[0]


@dataclass(frozen=True)
class Descriptors:
    """A batch of copies, grouped by layer: group ``g`` is entries ``offsets[g]:offsets[g+1]``.

    Attributes:
        src, dst: int64 addresses; sizes: int64 bytes (merged chunks are multiples of one).
        offsets: int64 ``[len(layers) + 1]``.
        layers: the layers the batch covers: group ``g`` is layer ``layers[g]`` when built
            ``per_layer``; otherwise there is one group holding all of them (a backup).
    """

    src: np.ndarray
    dst: np.ndarray
    sizes: np.ndarray
    offsets: np.ndarray
    layers: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(self.sizes.sum())

    def group(self, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        a, b = int(self.offsets[g]), int(self.offsets[g + 1])
        return self.src[a:b], self.dst[a:b], self.sizes[a:b]


def _check_contiguous(geom: ChunkGeometry) -> None:
    if not geom.contiguous:
        raise ValueError("host: chunks are not contiguous in this layout; use the kernel path")


@dataclass(frozen=True)
class PageRuns:
    """A batch's page pairs as runs consecutive on both sides: run ``r`` moves ``pages[r]``
    pages from device page ``dev[r]`` and host page ``host[r]`` on (int64 arrays). Their
    chunks are adjacent alike in every buffer and layer, so a layer's call takes one
    descriptor per (buffer, run) at most (:func:`page_runs`)."""

    dev: np.ndarray
    host: np.ndarray
    pages: np.ndarray

    def __len__(self) -> int:
        return len(self.dev)

    def layer_descriptors(self, geom: ChunkGeometry) -> int:
        """At most how many descriptors a layer's call of these runs takes (see
        :func:`layer_descriptors`)."""
        return geom.num_buffers * len(self.dev)


def page_runs(geom: ChunkGeometry, dev_pages: np.ndarray, host_pages: np.ndarray) -> PageRuns:
    """The runs of device page ``dev_pages[i]`` paired with host page ``host_pages[i]``, pairs
    with a ``-1`` on either side skipped."""
    _check_contiguous(geom)
    # Few numpy calls on the common paths (no skips; one run): each costs ~3 µs of CPU when
    # cold, as a load's first call before its forward pass is.
    dp = dev_pages.astype(np.int64, copy=False)
    hp = host_pages.astype(np.int64, copy=False)
    keep = (dp >= 0) & (hp >= 0)
    if not keep.all():
        dp, hp = dp[keep], hp[keep]
    if not dp.size:
        return PageRuns(dp.copy(), hp.copy(), np.zeros(0, dtype=np.int64))
    brk = np.flatnonzero((np.diff(dp) != 1) | (np.diff(hp) * geom.stride_page != geom.chunk_bytes))
    if not brk.size:  # copies, as every other path gives: never views of the caller's pages
        return PageRuns(dp[:1].copy(), hp[:1].copy(), np.array([dp.size], dtype=np.int64))
    first = np.concatenate((np.zeros(1, dtype=np.int64), brk + 1))
    return PageRuns(dp[first], hp[first], np.diff(np.append(first, dp.size)))


def layer_descriptors(geom: ChunkGeometry, dev_pages: np.ndarray, host_pages: np.ndarray) -> int:
    """At most how many descriptors :func:`build_descriptors` gives one layer of this batch,
    without building any: one per (buffer, run) (a chunk could also continue into the next
    buffer's first page when the two tensors happen to touch; not counted, so this is an upper
    bound). Pairs with a ``-1`` are skipped."""
    return page_runs(geom, dev_pages, host_pages).layer_descriptors(geom)


def build_descriptors(
    geom: ChunkGeometry,
    dev_pages: np.ndarray,
    host_pages: np.ndarray,
    *,
    d2h: bool,
    layers: Sequence[int],
    per_layer: bool,
) -> Descriptors:
    """Descriptors moving device page ``dev_pages[i]`` to/from host page ``host_pages[i]``.

    Pairs where either side is ``-1`` are skipped. ``per_layer``: one group per layer in
    ``layers`` (a layer-by-layer load); otherwise one group for all of them (a backup).
    Within a group, entries run layer-major, then buffer, then page, and a chunk that continues
    the previous one on both sides is merged into it.
    """
    runs = page_runs(geom, dev_pages, host_pages)
    return runs_descriptors(geom, runs, d2h=d2h, layers=layers, per_layer=per_layer)


def runs_descriptors(
    geom: ChunkGeometry, runs: PageRuns, *, d2h: bool, layers: Sequence[int], per_layer: bool
) -> Descriptors:
    """:func:`build_descriptors` of the runs :func:`page_runs` found."""
    lay = np.asarray(layers, dtype=np.int64)
    B, c = geom.num_buffers, geom.chunk_bytes
    # Runs, not pages: the arrays below are runs x buffers x layers, not pages x buffers x
    # layers (a 7K-token load of 448 pages in one run: 64 entries instead of 28,672; the build
    # before its forward took 335 -> 170 µs on an H200 host).
    dp, hp, n = runs.dev, runs.host, len(runs)
    run_bytes = runs.pages * c
    # [layer, buffer, run]: the device side from each tensor's address, the host side from
    # the four strides (the same description the Triton kernel computes offsets from).
    dev = geom.dev_addr[:, lay].T[:, :, None] + (dp * c)[None, None, :]
    host = (
        geom.host_addr
        + (lay * geom.stride_layer)[:, None, None]
        + (np.arange(B, dtype=np.int64) * geom.stride_buffer)[None, :, None]
        + (hp * geom.stride_page)[None, None, :]
    )
    src, dst = (dev, host) if d2h else (host, dev)
    src, dst = src.reshape(-1), dst.reshape(-1)
    size = np.broadcast_to(run_bytes, dev.shape).reshape(-1)
    m = src.size
    row = B * n if per_layer else m
    # A run that continues the previous entry on both sides (the next buffer's tensor may
    # touch this one's end) is merged into it, never across groups.
    starts = np.ones(m, dtype=bool)
    if m > 1:
        step = size[:-1]
        starts[1:] = (src[1:] != src[:-1] + step) | (dst[1:] != dst[:-1] + step)
    starts[:: row or 1] = True  # a group never continues the previous one
    first = np.flatnonzero(starts)
    sizes = np.add.reduceat(size, first) if m else np.zeros(0, dtype=np.int64)
    n_groups = len(lay) if per_layer else 1
    offsets = np.searchsorted(first, np.arange(n_groups + 1, dtype=np.int64) * row)
    return Descriptors(
        src=src[first],
        dst=dst[first],
        sizes=sizes.astype(np.int64, copy=False),
        offsets=offsets.astype(np.int64, copy=False),
        layers=tuple(int(x) for x in lay),
    )


class LayerEntries:
    """One layer's descriptors of a batch of few runs, built in Python when the layer is
    issued: group ``g`` of ``runs_descriptors(..., layers=range(L), per_layer=True)``, for
    the cost of a few list operations instead of its ~25 numpy calls (~3 µs each when cold, as
    a load's first call is: each numpy call's fixed cost, not the data, made the whole build
    170 µs of CPU before the forward pass on an H200 host). Worth it while the entries are
    few (a load the crossover sends inline); many are built with numpy at once."""

    def __init__(self, geom: ChunkGeometry, runs: PageRuns, *, d2h: bool) -> None:
        c = geom.chunk_bytes
        self._dev_addr = geom.dev_addr.tolist()
        self._host = [geom.host_addr + b * geom.stride_buffer for b in range(geom.num_buffers)]
        self._stride_layer = geom.stride_layer
        self._runs = [
            (d * c, h * geom.stride_page, n * c)
            for d, h, n in zip(runs.dev.tolist(), runs.host.tolist(), runs.pages.tolist())
        ]
        self._d2h = d2h

    def __call__(self, layer: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
        """``(dst, src, sizes, bytes)`` of layer ``layer``'s call."""
        src: list[int] = []
        dst: list[int] = []
        size: list[int] = []
        host_layer = layer * self._stride_layer
        for dev_row, host_base in zip(self._dev_addr, self._host):
            dev_base, host_base = dev_row[layer], host_base + host_layer
            for d, h, n in self._runs:
                s, t = (dev_base + d, host_base + h) if self._d2h else (host_base + h, dev_base + d)
                if size and src[-1] + size[-1] == s and dst[-1] + size[-1] == t:
                    size[-1] += n  # continues the previous entry on both sides, merged
                else:
                    src.append(s)
                    dst.append(t)
                    size.append(n)
        return (
            np.array(dst, dtype=np.int64),
            np.array(src, dtype=np.int64),
            np.array(size, dtype=np.int64),
            sum(size),
        )


class _BatchCall:
    """``cudaMemcpyBatchAsync`` with a reusable attribute, called one of two ways.

    Copies are stream-ordered on the source (the data was produced by earlier work on the
    stream's dependencies) and flagged to prefer overlapping with compute.

    cuda-bindings takes Python lists and builds a helper object per pointer: 0.3-1 µs per
    descriptor, 32 ms for a 32768-chunk backup (issue #12 measured 50 ms). Where torch's own CUDA
    runtime is 13 or newer (the signature cuda-bindings 13 describes), the same function is
    called through ctypes with the numpy arrays' buffers instead, at a fixed cost per call; the
    attribute is still cuda-bindings' struct. ``KVTIER_COPY_ENGINE_DIRECT=0`` turns that off.
    """

    def __init__(self) -> None:
        rt = _import_cudart()
        attr = rt.cudaMemcpyAttributes()
        attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        attr.flags = rt.cudaMemcpyFlags.cudaMemcpyFlagPreferOverlapWithCompute
        self.rt = rt
        self.attrs = [attr]
        self.attr_idx = np.zeros(1, dtype=np.uint64)
        self.direct, self.how = _direct_entry()

    def __call__(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: int) -> None:
        n = len(sizes)
        if self.direct is not None:
            err = self.direct(
                dst.ctypes.data,
                src.ctypes.data,
                sizes.ctypes.data,
                n,
                self.attrs[0].getPtr(),
                self.attr_idx.ctypes.data,
                1,
                stream,
            )
            out: object = err
        else:
            rt = self.rt
            out = rt.cudaMemcpyBatchAsync(
                dst.tolist(),
                src.tolist(),
                sizes.tolist(),
                n,
                self.attrs,
                [0],
                1,
                rt.cudaStream_t(stream),
            )
            # cuda-bindings 12.x also returns the index of a failed copy; 13.x only the error.
            err = int(out[0] if isinstance(out, tuple) else out)
        if err != 0:
            _, name = self.rt.cudaGetErrorName(self.rt.cudaError_t(err))
            raise RuntimeError(
                f"cudaMemcpyBatchAsync of {n} copies ({self.how}) failed: {name.decode()} "
                f"(result {out!r})"
            )


def _torch_cudart() -> tuple[Any, str]:
    """torch's own ``libcudart`` through ctypes (already loaded by torch: dlopen finds it by its
    soname), or None; and why not."""
    major = int((torch.version.cuda or "0").split(".")[0])
    if not major:
        return None, "torch has no CUDA runtime"
    try:
        return ctypes.CDLL(f"libcudart.so.{major}"), ""
    except OSError as e:
        return None, f"no libcudart.so.{major} ({e})"


def _direct_entry() -> tuple[Any, str]:
    """torch's ``cudaMemcpyBatchAsync`` through ctypes, or None; and which call is used."""
    if os.environ.get("KVTIER_COPY_ENGINE_DIRECT", "1") in ("0", "false", "False"):
        return None, "cuda-bindings (KVTIER_COPY_ENGINE_DIRECT=0)"
    major = int((torch.version.cuda or "0").split(".")[0])
    if major < 13:  # 12.8/12.9 have an extra failIdx argument: stay on cuda-bindings
        return None, f"cuda-bindings (torch's CUDA runtime is {torch.version.cuda})"
    lib, why = _torch_cudart()
    fn = getattr(lib, "cudaMemcpyBatchAsync", None) if lib is not None else None
    if fn is None:
        return None, f"cuda-bindings (no direct entry: {why or 'no cudaMemcpyBatchAsync'})"
    version = ctypes.c_int(0)
    if lib.cudaRuntimeGetVersion(ctypes.byref(version)) != 0 or version.value < 13000:
        return None, f"cuda-bindings (torch's CUDA runtime reports {version.value})"
    fn.restype = ctypes.c_int
    vp, sz = ctypes.c_void_p, ctypes.c_size_t
    fn.argtypes = [vp, vp, vp, sz, vp, vp, sz, vp]
    return fn, f"ctypes (libcudart.so.{major}, runtime {_version_str(version.value)})"


_CALL: _BatchCall | None = None


def batch_call_kind() -> str:
    """How batches are enqueued here: "ctypes (...)" or "cuda-bindings (...)" (needs CUDA)."""
    global _CALL
    if _CALL is None:
        _CALL = _BatchCall()
    return _CALL.how


def memcpy_batch(dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: int) -> None:
    """Enqueue one batch on ``stream`` (a raw ``cudaStream_t``, never the legacy default 0).

    ``dst``, ``src``: int64 addresses; ``sizes``: int64 bytes; contiguous, of equal length.
    """
    global _CALL
    if not len(sizes):
        return
    if stream == 0:
        raise ValueError("stream: cudaMemcpyBatchAsync rejects the legacy default stream")
    if _CALL is None:
        _CALL = _BatchCall()
    _CALL(dst, src, sizes, stream)


# cudaMemcpyDefault: the direction follows from the addresses (unified virtual addressing).
_MEMCPY_DEFAULT = 4


class _Copy2D:
    """``cudaMemcpy2DAsync``: through torch's libcudart with ctypes where it loads (its signature
    is the same in every CUDA release), else through cuda-bindings."""

    def __init__(self) -> None:
        lib, why = _torch_cudart()
        self.rt = None
        if lib is not None:
            fn = lib.cudaMemcpy2DAsync
            fn.restype = ctypes.c_int
            sz, vp = ctypes.c_size_t, ctypes.c_void_p
            fn.argtypes = [vp, sz, vp, sz, sz, sz, ctypes.c_int, vp]
            self.fn, self.how = fn, "ctypes"
        else:
            self.fn, self.how = None, f"cuda-bindings ({why})"
            self.rt = _import_cudart()

    def __call__(
        self, dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int
    ) -> None:
        if self.fn is not None:
            out: object = self.fn(dst, dpitch, src, spitch, width, height, _MEMCPY_DEFAULT, stream)
            err = int(out)
        else:
            rt = self.rt
            out = rt.cudaMemcpy2DAsync(
                dst,
                dpitch,
                src,
                spitch,
                width,
                height,
                rt.cudaMemcpyKind.cudaMemcpyDefault,
                rt.cudaStream_t(stream),
            )
            err = int(out[0] if isinstance(out, tuple) else out)
        if err != 0:
            raise RuntimeError(
                f"cudaMemcpy2DAsync of {height} rows of {width} B (pitches {spitch} -> {dpitch}, "
                f"{self.how}) failed with error {err}"
            )


_CALL_2D: _Copy2D | None = None


def memcpy_2d(
    dst: int, dpitch: int, src: int, spitch: int, width: int, height: int, stream: int
) -> None:
    """Enqueue one 2-D copy on ``stream``: ``height`` rows of ``width`` bytes, rows ``spitch``
    bytes apart at ``src`` and ``dpitch`` bytes apart at ``dst`` (addresses as ints)."""
    global _CALL_2D
    if _CALL_2D is None:
        _CALL_2D = _Copy2D()
    _CALL_2D(dst, dpitch, src, spitch, width, height, stream)
