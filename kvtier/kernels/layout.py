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

import torch

__all__ = [
    "DeviceBuffers",
    "HostBuffer",
    "HostLayout",
    "host_shape",
    "word_bytes_for",
]


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
        cls, layers: Sequence[Sequence[torch.Tensor]], arg: str = "layers"
    ) -> DeviceBuffers:
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
        table = torch.tensor([d // unit for d in deltas], dtype=torch.int64, device=ref.device)
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
        return self.base.device


@dataclass(frozen=True)
class HostBuffer:
    """One contiguous host tensor holding ``B`` buffers x ``L`` layers x ``N`` slots in a layout.

    Strides are in bytes (see the module docstring for the formula).
    """

    tensor: torch.Tensor
    layout: HostLayout
    num_buffers: int
    num_layers: int
    num_slots: int
    page_size: int
    item_shape: tuple[int, ...]
    item_bytes: int
    stride_buffer: int
    stride_page: int
    stride_token: int
    stride_layer: int
    align: int

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

    def page_ranges(self, pages: torch.Tensor) -> list[list[tuple[int, int]]]:
        """For each page id, the ``(byte offset, nbytes)`` ranges that hold its bytes.

        Page-first layouts give one range per buffer (K and V for MHA, one for MLA), each
        ``P * L * I`` bytes; layer_first gives one range per (buffer, layer) of ``P * I`` bytes.
        Offsets are from ``tensor.data_ptr()``.
        """
        out = []
        span = self.page_size * self.item_bytes
        for p in pages.tolist():
            if not 0 <= p < self.num_slots // self.page_size:
                raise ValueError(f"pages: page {p} outside [0, {self.num_slots // self.page_size})")
            base = p * self.stride_page
            if self.layout.page_contiguous:
                out.append(
                    [
                        (b * self.stride_buffer + base, span * self.num_layers)
                        for b in range(self.num_buffers)
                    ]
                )
            else:
                out.append(
                    [
                        (b * self.stride_buffer + l * self.stride_layer + base, span)
                        for b in range(self.num_buffers)
                        for l in range(self.num_layers)
                    ]
                )
        return out
