"""Packing whole pages into flat L3 objects and back, one kernel launch per batch.

A flat object is one page's bytes in one contiguous row (see :meth:`HostBuffer.flat` for the byte
order). Packing reads pages from slot-indexed buffers (a device pool, or a layer_first host pool
described as :class:`DeviceBuffers`) and writes rows ``0..n-1`` of a flat buffer; unpacking is the
exact inverse. The flat buffer may be pinned host memory (the fused D→flat and flat→D paths, or
host staging) or device memory (device-side packing). The same copy kernel does the work, so
there is never a per-page ``torch.cat``.
"""

from __future__ import annotations

import torch

from kvtier.kernels.dispatch import Impl
from kvtier.kernels.kv_transfer import TransferKnobs, copy_device_to_host, copy_host_to_device
from kvtier.kernels.layout import DeviceBuffers, HostBuffer
from kvtier.nvtx import fmt_bytes, nvtx_range

__all__ = ["device_knobs", "pack_pages", "unpack_pages"]


def device_knobs(device: torch.device) -> TransferKnobs:
    """Knobs for copies whose both ends are device memory: HBM wants the whole GPU, not 4 SMs."""
    sms = (
        torch.cuda.get_device_properties(device).multi_processor_count
        if device.type == "cuda"
        else 4
    )
    # The small host->device variant is for latency-bound reads of host memory, not HBM.
    return TransferKnobs(num_programs=4 * sms, tile_bytes=16384, num_warps=4, small_h2d_bytes=0)


def _knobs(
    knobs: TransferKnobs | None, src: DeviceBuffers, flat: HostBuffer
) -> TransferKnobs | None:
    if knobs is None and src.base.device.type == "cuda" and flat.tensor.device.type == "cuda":
        return device_knobs(src.base.device)
    return knobs


def _rows(flat: HostBuffer, n: int, device: torch.device) -> torch.Tensor:
    capacity = flat.num_slots // flat.page_size
    if n > capacity:
        raise ValueError(f"flat: staging holds {capacity} pages, {n} requested")
    return torch.arange(n, dtype=torch.int64, device=device)


def pack_pages(
    src: DeviceBuffers,
    flat: HostBuffer,
    pages: torch.Tensor,
    *,
    layer: int | None = None,
    knobs: TransferKnobs | None = None,
    check: bool | None = None,
    impl: Impl = "auto",
) -> str:
    """Write page ``pages[i]`` of ``src`` (all buffers, all layers) into row ``i`` of ``flat``.

    Args:
        src: slot-indexed buffers; page ``p`` is slots ``[p * P, p * P + P)``.
        flat: ``HostBuffer.flat`` over ``[>= n, page_bytes]`` bytes.
        pages: int64 ``[n]`` page ids on ``src.device``; ``-1`` leaves that row untouched.
    """
    return _page_copy(src, flat, pages, True, layer, knobs, check, impl)


def unpack_pages(
    flat: HostBuffer,
    dst: DeviceBuffers,
    pages: torch.Tensor,
    *,
    layer: int | None = None,
    knobs: TransferKnobs | None = None,
    check: bool | None = None,
    impl: Impl = "auto",
) -> str:
    """Write row ``i`` of ``flat`` into page ``pages[i]`` of ``dst``: the inverse of packing."""
    return _page_copy(dst, flat, pages, False, layer, knobs, check, impl)


def _page_copy(buffers, flat, pages, pack, layer, knobs, check, impl) -> str:
    """Pages ``pages`` of ``buffers`` to (``pack``) or from rows ``0..n-1`` of ``flat``."""
    rows = _rows(flat, pages.numel(), buffers.device)
    op = "pack" if pack else "unpack"
    knobs = _knobs(knobs, buffers, flat)
    with nvtx_range(
        f"kvtier.{op} {pages.numel()} pages {fmt_bytes(pages.numel() * flat.page_bytes)}"
    ):
        if pack:
            return copy_device_to_host(
                buffers,
                flat,
                pages,
                rows,
                layer=layer,
                index_unit="page",
                knobs=knobs,
                check=check,
                impl=impl,
            )
        return copy_host_to_device(
            flat,
            buffers,
            rows,
            pages,
            layer=layer,
            index_unit="page",
            knobs=knobs,
            check=check,
            impl=impl,
        )
