"""Host KV pools: one pinned tensor per device pool, in a chosen layout.

A host pool mirrors a device pool's buffers, layers and item shape in one contiguous tensor
(pinned when CUDA is present, plain memory otherwise) laid out as ``layer_first``, ``page_first``
or ``page_first_direct`` (see :mod:`kvtier.kernels.layout`). Slots are handed out in whole pages by
its own :class:`~kvtier.runtime.allocator.PageAllocator`.

Its size is given as token slots, as bytes, or as a ratio of the device pool; it is rounded down
to whole pages.
"""

from __future__ import annotations

import torch

from kvtier.kernels.kv_transfer import TransferKnobs, copy_device_to_host, copy_host_to_device
from kvtier.kernels.layout import HostBuffer, HostLayout, host_shape
from kvtier.runtime.allocator import PageAllocator
from kvtier.runtime.device_pool import DevicePool

__all__ = ["HostPool", "host_size_for"]


def host_size_for(
    device_pool: DevicePool,
    *,
    size: int | None = None,
    size_bytes: int | None = None,
    ratio: float | None = None,
) -> int:
    """Host token slots from exactly one of ``size``, ``size_bytes`` or ``ratio``, in whole pages."""
    given = [x is not None for x in (size, size_bytes, ratio)]
    if sum(given) != 1:
        raise ValueError("give exactly one of size, size_bytes, ratio for the host pool")
    if size_bytes is not None:
        if size_bytes <= 0:
            raise ValueError(f"size_bytes must be > 0, got {size_bytes}")
        size = size_bytes // device_pool.bytes_per_token
    elif ratio is not None:
        if ratio <= 0:
            raise ValueError(f"ratio must be > 0, got {ratio}")
        size = int(device_pool.size * ratio)
    P = device_pool.page_size
    size = (size // P) * P
    if size < P:
        raise ValueError(f"host pool would hold {size} slots, less than one page of {P}")
    return size


class HostPool:
    """Host mirror of a device pool in one layout.

    Args:
        device_pool: the pool whose buffers this mirrors.
        layout: "layer_first", "page_first" or "page_first_direct".
        size / size_bytes / ratio: exactly one; the host capacity.
        pin: pin the tensor (default: when CUDA is available).
        knobs: launch knobs for the transfer kernels.
    """

    def __init__(
        self,
        device_pool: DevicePool,
        layout: HostLayout | str = HostLayout.LAYER_FIRST,
        *,
        size: int | None = None,
        size_bytes: int | None = None,
        ratio: float | None = None,
        pin: bool | None = None,
        knobs: TransferKnobs | None = None,
    ) -> None:
        self.device_pool = device_pool
        self.layout = HostLayout.parse(layout)
        self.page_size = device_pool.page_size
        self.size = host_size_for(device_pool, size=size, size_bytes=size_bytes, ratio=ratio)
        dev = device_pool.buffers
        shape = host_shape(
            self.layout, dev.num_buffers, dev.num_layers, self.size, self.page_size, dev.item_shape
        )
        pin = torch.cuda.is_available() if pin is None else pin
        self.tensor = torch.empty(shape, dtype=dev.dtype, pin_memory=pin)
        self.buffer = HostBuffer.create(
            self.tensor,
            self.layout,
            dev.num_buffers,
            dev.num_layers,
            self.page_size,
            dev.item_shape,
        )
        self.allocator = PageAllocator(self.size, self.page_size, name=f"host {device_pool.kind}")
        self.knobs = knobs

    @property
    def nbytes(self) -> int:
        return self.tensor.numel() * self.tensor.element_size()

    def page_ranges(self, pages: torch.Tensor) -> list[list[tuple[int, int]]]:
        """Where each page's bytes are: ``(offset, nbytes)`` ranges from ``tensor.data_ptr()``."""
        return self.buffer.page_ranges(pages)

    def backup(
        self,
        device_indices: torch.Tensor,
        host_indices: torch.Tensor,
        *,
        layer: int | None = None,
        index_unit: str = "token",
        check: bool | None = None,
    ) -> str:
        """Device → host copy of the given slots (all layers unless ``layer``)."""
        return copy_device_to_host(
            self.device_pool.buffers,
            self.buffer,
            device_indices,
            host_indices,
            layer=layer,
            index_unit=index_unit,
            knobs=self.knobs,
            check=check,
        )

    def load(
        self,
        host_indices: torch.Tensor,
        device_indices: torch.Tensor,
        *,
        layer: int | None = None,
        index_unit: str = "token",
        check: bool | None = None,
    ) -> str:
        """Host → device copy of the given slots (one layer, or all layers)."""
        return copy_host_to_device(
            self.buffer,
            self.device_pool.buffers,
            host_indices,
            device_indices,
            layer=layer,
            index_unit=index_unit,
            knobs=self.knobs,
            check=check,
        )
