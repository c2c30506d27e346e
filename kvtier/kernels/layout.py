"""Byte-level descriptions of device and host KV buffers, as the copy kernels see them.

The kernels move *items*: one token slot's row of one buffer in one layer (``item_bytes`` bytes,
e.g. ``kv_heads * head_dim * 2`` for bf16 K). A pool has ``B`` buffers (2 for MHA: K and V; 1 for
MLA, Mamba components, indexer bytes) and ``L`` layers.

Device side (:class:`DeviceBuffers`): ``B x L`` tensors ``[slots, *item_shape]``, either views of
one stacked allocation or per-layer tensors a model runner owns. The kernels reach them through a
table of per-(buffer, layer) offsets from the first tensor, so both forms use the same kernel and
nothing is copied.

Host side (:class:`HostBuffer`): one contiguous tensor in a layout. Byte offset of token slot
``s`` of buffer ``b`` in layer ``l`` (``P`` = page size, ``N`` = host slots, ``I`` = item bytes)::

    layout             shape (MHA / single buffer)          offset = b*L*N*I + ...
    layer_first        [2, L, N, H, D] / [L, N, *item]      l*N*I   + (s//P)*P*I   + (s%P)*I
    page_first         [2, N, L, H, D] / [N, L, *item]      l*I     + (s//P)*P*L*I + (s%P)*L*I
    page_first_direct  [2, N/P, L, P, H, D] / [N/P, L, P, *item]
                                                            l*P*I   + (s//P)*L*P*I + (s%P)*I

so every layout is four strides: buffer, page, token-in-page, layer. In page-first layouts a page
of one buffer is one contiguous range of ``P*L*I`` bytes.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = [
    "DeviceBuffers",
    "HostBuffer",
    "HostLayout",
    "checked_ids",
    "host_shape",
    "word_bytes_for",
]


def checked_ids(ids: torch.Tensor, count: int, arg: str, what: str) -> np.ndarray:
    """``ids`` (integer ids of pages or slots, any shape and device) as a 1-D int64 array, each
    in ``[0, count)``; ``TypeError`` for a non-integer dtype and ``ValueError`` for an id out of
    range, both naming ``arg`` (``what``: one id's noun in the message)."""
    if ids.dtype.is_floating_point or ids.dtype.is_complex or ids.dtype is torch.bool:
        raise TypeError(f"{arg}: expected integer {what} ids, got dtype {ids.dtype}")
    if ids.dtype is torch.int64 and ids.dim() == 1 and ids.is_cpu:
        out = ids.detach().numpy()
    else:
        out = ids.detach().reshape(-1).cpu().numpy().astype(np.int64)
    if len(out) and (out.min() < 0 or out.max() >= count):
        bad = int(out[np.flatnonzero((out < 0) | (out >= count))[0]])
        raise ValueError(f"{arg}: {what} {bad} outside [0, {count})")
    return out


class HostLayout(str, enum.Enum):
    LAYER_FIRST = "layer_first"
    PAGE_FIRST = "page_first"
    PAGE_FIRST_DIRECT = "page_first_direct"

    @classmethod
    def parse(cls, value: str | HostLayout, arg: str = "layout") -> HostLayout:
        try:
            return cls(value)
        except ValueError:
            choices = ", ".join(m.value for m in cls)
            raise ValueError(
                f"{arg}: unknown host layout {value!r}; choose one of {choices}"
            ) from None

    @property
    def page_contiguous(self) -> bool:
        """Whether one page of one buffer is a single contiguous byte range."""
        return self is not HostLayout.LAYER_FIRST


def word_bytes_for(*values: int) -> int:
    """Largest power of two <= 16 that divides every value (byte counts or addresses)."""
    w = 16
    for v in values:
        while v % w:
            w //= 2
    return w


def host_shape(
    layout: HostLayout,
    num_buffers: int,
    num_layers: int,
    size: int,
    page_size: int,
    item_shape: Sequence[int],
) -> tuple[int, ...]:
    """Host tensor shape for a layout. ``num_buffers == 1`` drops the leading buffer dim."""
    layout = HostLayout.parse(layout)
    if size % page_size:
        raise ValueError(f"size={size} must be a multiple of page_size={page_size}")
    item = tuple(item_shape)
    if layout is HostLayout.LAYER_FIRST:
        shape = (num_layers, size, *item)
    elif layout is HostLayout.PAGE_FIRST:
        shape = (size, num_layers, *item)
    else:
        shape = (size // page_size, num_layers, page_size, *item)
    return shape if num_buffers == 1 else (num_buffers, *shape)


@dataclass(frozen=True)
class DeviceBuffers:
    """``B x L`` per-layer device tensors of identical shape ``[slots, *item_shape]`` and dtype.

    Attributes:
        layers: ``layers[b][l]``, each contiguous.
        base: the first tensor; kernel addresses are offsets from it.
        table: int64 ``[B * L]`` on the tensors' device: offset of ``layers[b][l]`` from ``base``,
            in units of ``table_unit`` bytes.
        table_unit: alignment (bytes) shared by every tensor start and the item size.
    """

    layers: tuple[tuple[torch.Tensor, ...], ...]
    base: torch.Tensor
    table: torch.Tensor
    table_unit: int
    num_slots: int
    item_shape: tuple[int, ...]
    item_bytes: int
    dtype: torch.dtype

    @classmethod
    def from_layers(
        cls,
        layers: Sequence[Sequence[torch.Tensor]],
        arg: str = "layers",
        table_device: torch.device | str | None = None,
    ) -> DeviceBuffers:
        """Describe ``layers[b][l]`` (no copy). ``table_device`` is where kernels run (default:
        the tensors' device); pinned host tensors with a CUDA table are reached from the GPU."""
        if not layers or not layers[0]:
            raise ValueError(f"{arg}: need at least one buffer with at least one layer")
        num_layers = len(layers[0])
        ref = layers[0][0]
        for b, buf in enumerate(layers):
            if len(buf) != num_layers:
                raise ValueError(f"{arg}[{b}]: {len(buf)} layers, expected {num_layers}")
            for l, t in enumerate(buf):
                name = f"{arg}[{b}][{l}]"
                if t.dtype != ref.dtype:
                    raise ValueError(f"{name}: dtype {t.dtype}, expected {ref.dtype}")
                if t.shape != ref.shape:
                    raise ValueError(f"{name}: shape {tuple(t.shape)}, expected {tuple(ref.shape)}")
                if t.device != ref.device:
                    raise ValueError(f"{name}: on {t.device}, expected {ref.device}")
                if not t.is_contiguous():
                    raise ValueError(f"{name}: must be contiguous (strides {t.stride()})")
        if ref.dim() < 2:
            raise ValueError(f"{arg}: tensors must be [slots, *item_shape], got {tuple(ref.shape)}")
        item_shape = tuple(ref.shape[1:])
        item_bytes = math.prod(item_shape) * ref.element_size()
        base_addr = ref.data_ptr()
        deltas = [t.data_ptr() - base_addr for buf in layers for t in buf]
        unit = word_bytes_for(item_bytes, base_addr, *deltas)
        table = torch.tensor(
            [d // unit for d in deltas], dtype=torch.int64, device=table_device or ref.device
        )
        return cls(
            layers=tuple(tuple(buf) for buf in layers),
            base=ref,
            table=table,
            table_unit=unit,
            num_slots=ref.shape[0],
            item_shape=item_shape,
            item_bytes=item_bytes,
            dtype=ref.dtype,
        )

    @property
    def num_buffers(self) -> int:
        return len(self.layers)

    @property
    def num_layers(self) -> int:
        return len(self.layers[0])

    @property
    def device(self) -> torch.device:
        """Where the kernels that use these buffers run (the table's device)."""
        return self.table.device


@dataclass(frozen=True)
class HostBuffer:
    """``B`` buffers x ``L`` layers x ``N`` slots of ``item_bytes`` at four byte strides in a tensor.

    Built by :meth:`create` for a host pool layout (see the module docstring for the formula), by
    :meth:`flat` for packed L3 page objects, or by :meth:`strided` for any other arrangement
    (Mamba's flat slots). ``offset`` is where slot 0 of buffer 0, layer 0 starts, in bytes from the
    tensor's start. ``item_shape`` is None for raw-byte buffers, whose items are matched with a
    device pool by size only. The tensor may live in pinned host memory or on the device.
    """

    tensor: torch.Tensor
    layout: HostLayout | None
    num_buffers: int
    num_layers: int
    num_slots: int
    page_size: int
    item_shape: tuple[int, ...] | None
    item_bytes: int
    stride_buffer: int
    stride_page: int
    stride_token: int
    stride_layer: int
    align: int
    offset: int = 0

    @classmethod
    def strided(
        cls,
        tensor: torch.Tensor,
        *,
        num_buffers: int,
        num_layers: int,
        num_slots: int,
        page_size: int,
        item_bytes: int,
        stride_buffer: int,
        stride_page: int,
        stride_token: int,
        stride_layer: int,
        offset: int = 0,
        arg: str = "buffer",
    ) -> HostBuffer:
        """Raw-byte buffer at explicit byte strides; checks every item lies inside ``tensor``."""
        if not tensor.is_contiguous():
            raise ValueError(f"{arg}: tensor must be contiguous")
        if num_slots % page_size:
            raise ValueError(
                f"{arg}: num_slots={num_slots} is not a multiple of page_size={page_size}"
            )
        last = (
            offset
            + (num_buffers - 1) * stride_buffer
            + (num_slots // page_size - 1) * stride_page
            + (page_size - 1) * stride_token
            + (num_layers - 1) * stride_layer
            + item_bytes
        )
        nbytes = tensor.numel() * tensor.element_size()
        if num_slots and last > nbytes:
            raise ValueError(f"{arg}: needs {last} bytes, tensor has {nbytes}")
        return cls(
            tensor=tensor,
            layout=None,
            num_buffers=num_buffers,
            num_layers=num_layers,
            num_slots=num_slots,
            page_size=page_size,
            item_shape=None,
            item_bytes=item_bytes,
            stride_buffer=stride_buffer,
            stride_page=stride_page,
            stride_token=stride_token,
            stride_layer=stride_layer,
            align=word_bytes_for(
                item_bytes,
                tensor.data_ptr() + offset,
                stride_buffer,
                stride_page,
                stride_token,
                stride_layer,
            ),
            offset=offset,
        )

    @classmethod
    def flat(
        cls,
        tensor: torch.Tensor,
        *,
        num_buffers: int,
        num_layers: int,
        page_size: int,
        item_bytes: int,
        token_major: bool,
        arg: str = "flat",
    ) -> HostBuffer:
        """Packed page objects: ``tensor`` is ``[n_pages, page_bytes]`` bytes, one page per row.

        Inside a page: buffer-major, then ``[L, P]`` items (layer-major, the order of
        layer_first and page_first_direct pages) or ``[P, L]`` items (``token_major``, the order
        of page_first pages). This is exactly the byte order of the page's ranges in a host pool
        of the matching layout, concatenated.
        """
        L, P, I = num_layers, page_size, item_bytes
        page_bytes = num_buffers * L * P * I
        if tensor.dim() != 2 or tensor.shape[1] * tensor.element_size() != page_bytes:
            raise ValueError(
                f"{arg}: expected [n_pages, {page_bytes}] bytes, got {tuple(tensor.shape)} "
                f"of {tensor.dtype}"
            )
        s_tok, s_layer = (L * I, I) if token_major else (I, P * I)
        return cls.strided(
            tensor,
            num_buffers=num_buffers,
            num_layers=L,
            num_slots=tensor.shape[0] * P,
            page_size=P,
            item_bytes=I,
            stride_buffer=L * P * I,
            stride_page=page_bytes,
            stride_token=s_tok,
            stride_layer=s_layer,
            arg=arg,
        )

    @classmethod
    def create(
        cls,
        tensor: torch.Tensor,
        layout: HostLayout | str,
        num_buffers: int,
        num_layers: int,
        page_size: int,
        item_shape: Sequence[int],
        arg: str = "host",
    ) -> HostBuffer:
        layout = HostLayout.parse(layout)
        if not tensor.is_contiguous():
            raise ValueError(f"{arg}: host tensor must be contiguous")
        item_shape = tuple(item_shape)
        item_bytes = math.prod(item_shape) * tensor.element_size()
        per_buffer = tensor.numel() // num_buffers
        num_slots = per_buffer // (num_layers * math.prod(item_shape)) if per_buffer else 0
        expect = host_shape(layout, num_buffers, num_layers, num_slots, page_size, item_shape)
        if tuple(tensor.shape) != expect:
            raise ValueError(
                f"{arg}: shape {tuple(tensor.shape)} does not match layout {layout.value} "
                f"(expected {expect})"
            )
        L, N, P, I = num_layers, num_slots, page_size, item_bytes
        if layout is HostLayout.LAYER_FIRST:
            s_layer, s_page, s_tok = N * I, P * I, I
        elif layout is HostLayout.PAGE_FIRST:
            s_layer, s_page, s_tok = I, P * L * I, L * I
        else:
            s_layer, s_page, s_tok = P * I, L * P * I, I
        return cls(
            tensor=tensor,
            layout=layout,
            num_buffers=num_buffers,
            num_layers=L,
            num_slots=N,
            page_size=P,
            item_shape=item_shape,
            item_bytes=I,
            stride_buffer=L * N * I,
            stride_page=s_page,
            stride_token=s_tok,
            stride_layer=s_layer,
            align=word_bytes_for(I, tensor.data_ptr()),
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype

    @property
    def page_bytes(self) -> int:
        """Bytes of one page across all buffers and layers."""
        return self.num_buffers * self.num_layers * self.page_size * self.item_bytes

    def page_parts(self, pages: torch.Tensor) -> tuple[np.ndarray, tuple[int, ...]]:
        """Where each page id's bytes are, in one array: ``(offsets, sizes)``, ``offsets[i, k]``
        the byte offset from ``tensor.data_ptr()`` of page ``pages[i]``'s part ``k`` (int64,
        read-only), ``sizes[k]`` that part's bytes.

        Page-first layouts give one part per buffer (K and V for MHA, one for MLA), each
        ``P * L * I`` bytes; layer_first gives one part per (buffer, layer) of ``P * I`` bytes.
        """
        ids = checked_ids(pages, self.num_slots // self.page_size, "pages", "page")
        span = self.page_size * self.item_bytes
        bufs = np.arange(self.num_buffers, dtype=np.int64) * self.stride_buffer
        if self.layout is not None and self.layout.page_contiguous:
            parts, sizes = bufs, (span * self.num_layers,) * self.num_buffers
        else:
            layers = np.arange(self.num_layers, dtype=np.int64) * self.stride_layer
            parts = (bufs[:, None] + layers[None, :]).reshape(-1)
            sizes = (span,) * (self.num_buffers * self.num_layers)
        offsets = ids[:, None] * self.stride_page + parts[None, :]
        offsets.setflags(write=False)
        return offsets, sizes

    def page_ranges(self, pages: torch.Tensor) -> list[list[tuple[int, int]]]:
        """For each page id, the ``(byte offset, nbytes)`` ranges that hold its bytes
        (``page_parts`` as lists)."""
        offsets, sizes = self.page_parts(pages)
        return [list(zip(row, sizes)) for row in offsets.tolist()]
