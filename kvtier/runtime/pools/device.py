"""Device KV pools: per-layer token-slot buffers on the GPU (or CPU in tests).

Two kinds, each in two forms:

- :class:`MHADevicePool`: per layer a K and a V buffer ``[slots, kv_heads, head_dim]``.
- :class:`MLADevicePool`: per layer one latent buffer ``[slots, 1, dim]`` (e.g. dim 576).

The constructor allocates stacked storage (``[L, slots, ...]``, one tensor per buffer). ``wrap``
takes the per-layer tensors a model runner already owns, without copying them. Either way the
copy kernels see a :class:`~kvtier.kernels.layout.DeviceBuffers`: per-layer tensors plus a table of
their offsets.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.kernels.layout import DeviceBuffers

__all__ = ["DevicePool", "MHADevicePool", "MLADevicePool"]


class DevicePool:
    """Token-slot pool: ``B`` buffers x ``L`` layers of ``[size, *item_shape]``.

    Pools hold memory only: which slots are in use is kept by whoever allocates them (inside a
    ``TieredKVCache``, the tree's allocators; standalone, a ``PageAllocator(pool.size,
    pool.page_size)`` of your own)."""

    kind = "kv"

    def __init__(self, layers: Sequence[Sequence[torch.Tensor]], page_size: int, name: str) -> None:
        self.buffers = DeviceBuffers.from_layers(layers, arg="layers")
        self.size = self.buffers.num_slots
        if not 1 <= page_size <= 256:
            raise ValueError(f"page_size must be in [1, 256], got {page_size}")
        if self.size <= 0 or self.size % page_size:
            raise ValueError(
                f"{name}: size must be a positive multiple of page_size={page_size}, got {self.size}"
            )
        self.page_size = page_size

    @property
    def num_layers(self) -> int:
        return self.buffers.num_layers

    @property
    def dtype(self) -> torch.dtype:
        return self.buffers.dtype

    @property
    def device(self) -> torch.device:
        return self.buffers.device

    @property
    def item_shape(self) -> tuple[int, ...]:
        return self.buffers.item_shape

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token slot across all buffers and layers."""
        return self.buffers.num_buffers * self.buffers.num_layers * self.buffers.item_bytes

    @property
    def nbytes(self) -> int:
        return self.bytes_per_token * self.size


def _stack(num_layers: int, size: int, item: tuple[int, ...], dtype, device) -> torch.Tensor:
    if num_layers < 1:
        raise ValueError(f"num_layers must be >= 1, got {num_layers}")
    if size < 1:
        raise ValueError(f"size must be >= 1, got {size}")
    return torch.empty((num_layers, size, *item), dtype=dtype, device=device)


class MHADevicePool(DevicePool):
    """MHA/GQA pool: per layer K and V ``[size, kv_heads, head_dim]``."""

    def __init__(
        self,
        num_layers: int,
        size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        page_size: int = 16,
    ) -> None:
        item = (kv_heads, head_dim)
        self.k_buffer = _stack(num_layers, size, item, dtype, device)
        self.v_buffer = _stack(num_layers, size, item, dtype, device)
        super().__init__(
            [list(self.k_buffer.unbind(0)), list(self.v_buffer.unbind(0))], page_size, "kv"
        )

    @classmethod
    def wrap(
        cls, k_layers: Sequence[torch.Tensor], v_layers: Sequence[torch.Tensor], page_size: int
    ) -> MHADevicePool:
        """Use per-layer ``[size, kv_heads, head_dim]`` tensors owned by the caller (no copy)."""
        if len(k_layers) != len(v_layers):
            raise ValueError(f"v_layers: {len(v_layers)} layers, k_layers has {len(k_layers)}")
        self = cls.__new__(cls)
        self.k_buffer = self.v_buffer = None
        DevicePool.__init__(self, [list(k_layers), list(v_layers)], page_size, "kv")
        if len(self.item_shape) != 2:
            raise ValueError(
                f"k_layers: expected [size, kv_heads, head_dim], got item {self.item_shape}"
            )
        return self

    def k(self, layer: int) -> torch.Tensor:
        return self.buffers.layers[0][layer]

    def v(self, layer: int) -> torch.Tensor:
        return self.buffers.layers[1][layer]


class MLADevicePool(DevicePool):
    """MLA pool: per layer one latent buffer ``[size, 1, dim]``."""

    def __init__(
        self,
        num_layers: int,
        size: int,
        dim: int = 576,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        page_size: int = 16,
    ) -> None:
        self.kv_buffer = _stack(num_layers, size, (1, dim), dtype, device)
        super().__init__([list(self.kv_buffer.unbind(0))], page_size, "kv")

    @classmethod
    def wrap(cls, layers: Sequence[torch.Tensor], page_size: int) -> MLADevicePool:
        """Use per-layer ``[size, 1, dim]`` tensors owned by the caller (no copy)."""
        self = cls.__new__(cls)
        self.kv_buffer = None
        DevicePool.__init__(self, [list(layers)], page_size, "kv")
        if len(self.item_shape) != 2 or self.item_shape[0] != 1:
            raise ValueError(f"layers: expected [size, 1, dim], got item {self.item_shape}")
        return self

    def latent(self, layer: int) -> torch.Tensor:
        return self.buffers.layers[0][layer]
