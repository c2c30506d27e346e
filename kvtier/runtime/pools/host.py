"""Host KV pools: one pinned tensor per device pool, in a chosen layout.

A host pool mirrors a device pool's buffers, layers and item shape in one contiguous tensor
(pinned when CUDA is present, plain memory otherwise) laid out as ``layer_first``, ``page_first``
or ``page_first_direct`` (see :mod:`kvtier.kernels.layout`). It holds memory only: its slots are
handed out by the caller's allocator (the tree's, inside a ``TieredKVCache``).

Its size is given as token slots, as bytes, or as a ratio of the device pool; it is rounded down
to whole pages.
"""

from __future__ import annotations

import contextlib

import torch

from kvtier.kernels.dispatch import Impl
from kvtier.kernels.kv_transfer import TransferKnobs, copy_device_to_host, copy_host_to_device
from kvtier.kernels.layout import DeviceBuffers, HostBuffer, HostLayout, host_shape
from kvtier.kernels.pack import pack_pages, unpack_pages
from kvtier.runtime.pools.device import DevicePool
from kvtier.runtime.pools.pinned import host_empty
from kvtier.storage.spans import PageSpans

__all__ = ["HostPool", "host_size_for"]

# L3 objects. A page's flat object is its bytes in the host layout's page order: for
# page_first and page_first_direct the page's ranges (one per buffer) concatenated, read in
# place through page_views(); for layer_first the same layer-major order as page_first_direct,
# packed by a kernel into a reusable pinned staging buffer.


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
        self.tensor = host_empty(shape, dev.dtype, pin=pin)
        self.buffer = HostBuffer.create(
            self.tensor,
            self.layout,
            dev.num_buffers,
            dev.num_layers,
            self.page_size,
            dev.item_shape,
        )
        self.knobs = knobs
        self._raw: torch.Tensor | None = None  # the pool's bytes for page_spans, made once

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

    # -- L3 page objects -------------------------------------------------------------------

    @property
    def page_bytes(self) -> int:
        """Bytes of one page's flat object (all buffers, all layers)."""
        return self.buffer.page_bytes

    @property
    def flat_token_major(self) -> bool:
        return self.layout is HostLayout.PAGE_FIRST

    def flat_buffer(self, flat: torch.Tensor, arg: str = "flat") -> HostBuffer:
        """Describe ``flat`` (``[n, page_bytes]`` bytes, host or device) in this pool's page order."""
        return HostBuffer.flat(
            flat.view(torch.uint8) if flat.dtype != torch.uint8 else flat,
            num_buffers=self.buffer.num_buffers,
            num_layers=self.buffer.num_layers,
            page_size=self.page_size,
            item_bytes=self.buffer.item_bytes,
            token_major=self.flat_token_major,
            arg=arg,
        )

    def new_staging(self, max_pages: int) -> torch.Tensor:
        """A reusable ``[max_pages, page_bytes]`` uint8 staging buffer (pinned like the pool)."""
        return torch.empty(
            (max_pages, self.page_bytes), dtype=torch.uint8, pin_memory=self.tensor.is_pinned()
        )

    def page_views(self, pages: torch.Tensor) -> list[list[torch.Tensor]]:
        """Zero-copy 1-D uint8 views of each page's ranges (one per buffer), in flat order.

        Only page-contiguous layouts have them; layer_first pages must be packed (:meth:`pack`).
        """
        if not self.layout.page_contiguous:
            raise ValueError(
                f"layout: {self.layout.value} pages are not contiguous; pack them into staging"
            )
        raw = self.tensor.view(-1).view(torch.uint8)
        return [[raw[o : o + n] for o, n in ranges] for ranges in self.page_ranges(pages)]

    def page_spans(self, pages: torch.Tensor) -> PageSpans:
        """``page_views`` as ``PageSpans`` for a ``PoolTransfer``: the same ranges, as offsets
        into the pool's bytes, with no tensor per page (what the L3 tier hands its store)."""
        if not self.layout.page_contiguous:
            raise ValueError(
                f"layout: {self.layout.value} pages are not contiguous; pack them into staging"
            )
        offsets, sizes = self.buffer.page_parts(pages)  # checked, in range, read-only
        raw = self._raw
        if raw is None:
            raw = self._raw = self.tensor.view(-1).view(torch.uint8)
        return PageSpans._made(raw, offsets, sizes)

    def _as_slot_buffers(self) -> DeviceBuffers:
        """This layer_first pool as per-(buffer, layer) slot tensors, for the packing kernel."""
        if self.layout is not HostLayout.LAYER_FIRST:
            raise ValueError(f"layout: only layer_first pools are packed, not {self.layout.value}")
        cached = getattr(self, "_slot_buffers", None)
        if cached is None:
            t = self.tensor if self.buffer.num_buffers > 1 else self.tensor[None]
            layers = [list(t[b].unbind(0)) for b in range(self.buffer.num_buffers)]
            cached = DeviceBuffers.from_layers(
                layers, arg="host", table_device=self.device_pool.device
            )
            self._slot_buffers = cached
        return cached

    def pack(
        self,
        pages: torch.Tensor,
        staging: torch.Tensor,
        *,
        check: bool | None = None,
        impl: Impl = "auto",
    ) -> torch.Tensor:
        """Pack host ``pages`` (layer_first) into rows of ``staging``; returns the used rows.

        ``pages`` are host page ids (on any device). One kernel launch; synchronous: the rows
        are complete on return, so storage can read them at once (from any thread).
        """
        flat = self.flat_buffer(staging, arg="staging")
        with self._host_copy_stream():
            pack_pages(
                self._as_slot_buffers(),
                flat,
                self._on_kernel_device(pages),
                knobs=self.knobs,
                check=check,
                impl=impl,
            )
        return staging[: pages.numel()]

    def unpack(
        self,
        pages: torch.Tensor,
        staging: torch.Tensor,
        *,
        check: bool | None = None,
        impl: Impl = "auto",
    ) -> None:
        """Inverse of :meth:`pack`: row ``i`` of ``staging`` into host page ``pages[i]``.

        Synchronous, like :meth:`pack`: the host pages hold the data on return.
        """
        flat = self.flat_buffer(staging, arg="staging")
        with self._host_copy_stream():
            unpack_pages(
                flat,
                self._as_slot_buffers(),
                self._on_kernel_device(pages),
                knobs=self.knobs,
                check=check,
                impl=impl,
            )

    def _on_kernel_device(self, pages: torch.Tensor) -> torch.Tensor:
        return pages.to(self.device_pool.device, non_blocking=False)

    @contextlib.contextmanager
    def _host_copy_stream(self):
        """Host-to-host packing on the GPU runs on this pool's own stream and is waited for:
        it may be called from a storage thread, and its caller reads the bytes right after."""
        device = self.device_pool.device
        if device.type != "cuda":
            yield
            return
        stream = getattr(self, "_pack_stream", None)
        if stream is None:
            stream = self._pack_stream = torch.cuda.Stream(device)
        with torch.cuda.stream(stream):
            yield
        stream.synchronize()

    def device_to_flat(
        self,
        device_pages: torch.Tensor,
        flat: torch.Tensor,
        *,
        knobs: TransferKnobs | None = None,
        check: bool | None = None,
        impl: Impl = "auto",
    ) -> str:
        """Fused D→flat: device page ``device_pages[i]`` into row ``i`` of ``flat``."""
        return pack_pages(
            self.device_pool.buffers,
            self.flat_buffer(flat),
            device_pages,
            knobs=knobs or self.knobs,
            check=check,
            impl=impl,
        )

    def flat_to_device(
        self,
        flat: torch.Tensor,
        device_pages: torch.Tensor,
        *,
        layer: int | None = None,
        knobs: TransferKnobs | None = None,
        check: bool | None = None,
        impl: Impl = "auto",
    ) -> str:
        """Fused flat→D: row ``i`` of ``flat`` into device page ``device_pages[i]``."""
        return unpack_pages(
            self.flat_buffer(flat),
            self.device_pool.buffers,
            device_pages,
            layer=layer,
            knobs=knobs or self.knobs,
            check=check,
            impl=impl,
        )
