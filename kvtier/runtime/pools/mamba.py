"""Mamba / linear-attention state pools: one state per request slot, not per token.

Per Mamba layer a slot holds one temporal (SSM) state, e.g. ``[heads, head_dim, state]`` fp32,
and one or more conv states, e.g. ``[dim, kernel - 1]`` bf16; shapes and dtypes differ between
them. On the device each component is a ``[L, slots, *shape]`` tensor. On the host each slot is
one contiguous flat page of raw bytes, in this order::

    | temporal L0 | temporal L1 | ... | conv0 L0 | conv0 L1 | ... | conv1 L0 | ... |

that is, every layer's temporal state, then each conv state of every layer. That page is exactly
the L3 object of the slot, so storage reads and writes host slots in place.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvtier.kernels.dispatch import Impl
from kvtier.kernels.kv_transfer import TransferKnobs, copy_device_to_host, copy_host_to_device
from kvtier.kernels.layout import DeviceBuffers, HostBuffer, checked_ids
from kvtier.runtime.pools.host import host_size_for
from kvtier.runtime.pools.pinned import host_empty
from kvtier.storage.spans import PageSpans

__all__ = ["MambaDevicePool", "MambaHostPool", "MambaStateSpec", "slot_buffers"]


@dataclass(frozen=True)
class MambaStateSpec:
    """Per-layer state of one slot: a temporal state and ``len(conv_shapes)`` conv states.

    Every dimension is a positive int (a zero-sized state would hold no bytes), shapes are stored
    as tuples and ``conv_dtypes`` defaults to bf16 for each conv state.
    """

    temporal_shape: tuple[int, ...]
    conv_shapes: tuple[tuple[int, ...], ...]
    temporal_dtype: torch.dtype = torch.float32
    conv_dtypes: tuple[torch.dtype, ...] | None = None

    def __post_init__(self) -> None:
        temporal = self._shape(self.temporal_shape, "temporal_shape")
        shapes = self.conv_shapes
        if not isinstance(shapes, (tuple, list)):
            raise TypeError(
                f"conv_shapes: expected a tuple of shapes, got {shapes!r} ({type(shapes).__name__})"
            )
        if not shapes:
            raise ValueError("conv_shapes: a Mamba layer has at least one conv state")
        convs = tuple(self._shape(s, f"conv_shapes[{i}]") for i, s in enumerate(shapes))
        self._dtype(self.temporal_dtype, "temporal_dtype")
        dtypes = self.conv_dtypes
        if dtypes is None:
            dtypes = (torch.bfloat16,) * len(convs)
        elif not isinstance(dtypes, (tuple, list)):
            raise TypeError(
                f"conv_dtypes: expected a tuple of torch.dtype or None, got {dtypes!r} "
                f"({type(dtypes).__name__})"
            )
        for i, d in enumerate(dtypes):
            self._dtype(d, f"conv_dtypes[{i}]")
        if len(dtypes) != len(convs):
            raise ValueError(f"conv_dtypes: {len(dtypes)} dtypes for {len(convs)} conv states")
        object.__setattr__(self, "temporal_shape", temporal)
        object.__setattr__(self, "conv_shapes", convs)
        object.__setattr__(self, "conv_dtypes", tuple(dtypes))

    @staticmethod
    def _shape(shape: object, name: str) -> tuple[int, ...]:
        """``shape`` as a tuple of positive ints, or a TypeError / ValueError naming ``name``."""
        # A bare int (conv_shapes=((4, 2)) missing a comma) or a str is not a shape.
        if not isinstance(shape, (tuple, list)):
            raise TypeError(
                f"{name}: expected a tuple of ints, got {shape!r} ({type(shape).__name__})"
            )
        for j, n in enumerate(shape):
            if isinstance(n, bool) or not isinstance(n, numbers.Integral):
                raise TypeError(
                    f"{name}[{j}]: expected an int, got {n!r} ({type(n).__name__}) in {shape!r}"
                )
            if n <= 0:
                raise ValueError(f"{name}[{j}]: sizes must be >= 1, got {n!r} in {shape!r}")
        return tuple(int(n) for n in shape)

    @staticmethod
    def _dtype(dtype: object, name: str) -> None:
        if not isinstance(dtype, torch.dtype):
            raise TypeError(
                f"{name}: expected a torch.dtype, got {dtype!r} ({type(dtype).__name__})"
            )

    def component_shapes(self) -> list[tuple[tuple[int, ...], torch.dtype]]:
        return [(self.temporal_shape, self.temporal_dtype)] + [
            (s, d) for s, d in zip(self.conv_shapes, self.conv_dtypes, strict=True)
        ]


def _nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    return math.prod(shape) * torch.empty((), dtype=dtype).element_size()


class MambaDevicePool:
    """Slot-indexed Mamba states on the device: ``temporal [L, size, ...]``, ``convs[i] [L, size, ...]``.

    Components with zero bytes (conv-only models) are kept as tensors but never transferred.
    """

    kind = "mamba"
    page_size = 1

    def __init__(
        self,
        num_layers: int,
        size: int,
        spec: MambaStateSpec,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_layers < 1 or size < 1:
            raise ValueError(f"num_layers and size must be >= 1, got {num_layers}, {size}")
        self.spec = spec
        self.size = size
        self.tensors = [
            torch.zeros((num_layers, size, *shape), dtype=dtype, device=device)
            for shape, dtype in spec.component_shapes()
        ]
        self.components = [
            DeviceBuffers.from_layers([list(t.unbind(0))], arg=f"mamba component {i}")
            for i, t in enumerate(self.tensors)
            if t[0, 0].numel()
        ]

    @property
    def temporal(self) -> torch.Tensor:
        return self.tensors[0]

    @property
    def convs(self) -> list[torch.Tensor]:
        return self.tensors[1:]

    @property
    def num_layers(self) -> int:
        return self.tensors[0].shape[0]

    @property
    def device(self) -> torch.device:
        return self.tensors[0].device

    @property
    def slot_bytes(self) -> int:
        """Bytes of one slot's state across all layers: the flat page size."""
        return self.num_layers * sum(c.item_bytes for c in self.components)

    bytes_per_token = slot_bytes  # one slot per "token" for host sizing

    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy-on-write: copy each ``src[i]`` slot's whole state to ``dst[i]``, on the device.

        ``dst`` entries must be distinct and must not appear in ``src`` (a batch reads every
        source before writing, so overlapping would be ambiguous).
        """
        if src.dtype != torch.int64 or dst.dtype != torch.int64:
            raise ValueError("src, dst: slot indices must be int64")
        if src.shape != dst.shape or src.dim() != 1:
            raise ValueError(
                f"src and dst: need equal 1-D shapes, got {tuple(src.shape)} and {tuple(dst.shape)}"
            )
        for name, t in (("src", src), ("dst", dst)):
            if t.numel() and (int(t.min()) < 0 or int(t.max()) >= self.size):
                raise ValueError(f"{name}: slot outside [0, {self.size})")
        d = dst.tolist()
        if len(set(d)) != len(d) or set(d) & set(src.tolist()):
            raise ValueError("dst: slots must be distinct and disjoint from src")
        src, dst = src.to(self.device), dst.to(self.device)
        for t in self.tensors:
            t[:, dst] = t[:, src]


def slot_buffers(
    tensor: torch.Tensor, pool: MambaDevicePool, arg: str = "flat"
) -> list[HostBuffer]:
    """One strided view per transferable component over ``[n_slots, slot_bytes]`` bytes."""
    if tensor.dim() != 2 or tensor.shape[1] * tensor.element_size() != pool.slot_bytes:
        raise ValueError(
            f"{arg}: expected [n_slots, {pool.slot_bytes}] bytes, got {tuple(tensor.shape)} of {tensor.dtype}"
        )
    out, offset = [], 0
    L = pool.num_layers
    for comp in pool.components:
        I = comp.item_bytes
        out.append(
            HostBuffer.strided(
                tensor,
                num_buffers=1,
                num_layers=L,
                num_slots=tensor.shape[0],
                page_size=1,
                item_bytes=I,
                stride_buffer=0,
                stride_page=pool.slot_bytes,
                stride_token=0,
                stride_layer=I,
                offset=offset,
                arg=arg,
            )
        )
        offset += L * I
    return out


class MambaHostPool:
    """Host Mamba states: ``[size, slot_bytes]`` raw bytes, one flat page per slot.

    Args:
        device_pool: the device pool it mirrors.
        size / size_bytes / ratio: exactly one; the number of host slots.
        pin: pin the tensor (default: when CUDA is available).
    """

    kind = "mamba"

    def __init__(
        self,
        device_pool: MambaDevicePool,
        *,
        size: int | None = None,
        size_bytes: int | None = None,
        ratio: float | None = None,
        pin: bool | None = None,
        knobs: TransferKnobs | None = None,
    ) -> None:
        self.device_pool = device_pool
        self.size = host_size_for(device_pool, size=size, size_bytes=size_bytes, ratio=ratio)
        pin = torch.cuda.is_available() if pin is None else pin
        self.tensor = host_empty((self.size, device_pool.slot_bytes), torch.uint8, pin=pin)
        self.buffers = slot_buffers(self.tensor, device_pool, arg="host")
        self.knobs = knobs

    @property
    def slot_bytes(self) -> int:
        return self.device_pool.slot_bytes

    def slot_views(self, slots: torch.Tensor) -> list[torch.Tensor]:
        """Zero-copy 1-D uint8 views of each host slot's flat page (what L3 stores per key)."""
        out = []
        for s in slots.tolist():
            if not 0 <= s < self.size:
                raise ValueError(f"slots: slot {s} outside [0, {self.size})")
            out.append(self.tensor[s])
        return out

    def slot_spans(self, slots: torch.Tensor) -> PageSpans:
        """``slot_views`` as ``PageSpans`` for a ``PoolTransfer``: each slot's flat page as an
        offset into the pool's bytes, with no tensor per slot (what the L3 tier hands its store,
        so that a call with a hybrid model's KV or SWA pages keeps them as spans too)."""
        ids = checked_ids(slots, self.size, "slots", "slot")
        offsets = ids[:, None] * self.slot_bytes
        offsets.setflags(write=False)
        return PageSpans._made(self.tensor.view(-1), offsets, (self.slot_bytes,))

    def backup(
        self,
        device_slots: torch.Tensor,
        host_slots: torch.Tensor,
        *,
        layer: int | None = None,
        check: bool | None = None,
        impl: Impl = "auto",
    ) -> str:
        """Device → host of whole slot states (one launch per state component)."""
        return self._copy(self.buffers, device_slots, host_slots, True, layer, check, impl)

    def load(
        self,
        host_slots: torch.Tensor,
        device_slots: torch.Tensor,
        *,
        layer: int | None = None,
        check: bool | None = None,
        impl: Impl = "auto",
    ) -> str:
        """Host → device of slot states (all layers, or one layer for layer-wise load-back)."""
        return self._copy(self.buffers, device_slots, host_slots, False, layer, check, impl)

    def device_to_flat(
        self,
        device_slots: torch.Tensor,
        flat: torch.Tensor,
        *,
        check: bool | None = None,
        impl: Impl = "auto",
    ) -> str:
        """Fused D→flat: slot ``device_slots[i]`` into row ``i`` of ``flat`` ``[n, slot_bytes]``."""
        return self._copy_flat(flat, device_slots, True, check, impl)

    def flat_to_device(
        self,
        flat: torch.Tensor,
        device_slots: torch.Tensor,
        *,
        check: bool | None = None,
        impl: Impl = "auto",
    ) -> str:
        """Fused flat→D: row ``i`` of ``flat`` into slot ``device_slots[i]``."""
        return self._copy_flat(flat, device_slots, False, check, impl)

    def _copy_flat(self, flat, device_slots, d2h, check, impl) -> str:
        rows = torch.arange(device_slots.numel(), dtype=torch.int64, device=device_slots.device)
        return self._copy(
            slot_buffers(flat, self.device_pool), device_slots, rows, d2h, None, check, impl
        )

    def _copy(self, bufs, dev_slots, flat_slots, d2h, layer, check, impl) -> str:
        """One launch per state component between device slots and rows of ``bufs``."""
        pool = self.device_pool
        if pool.device.type == "cuda" and flat_slots.device != pool.device:
            raise ValueError(f"slots: on {flat_slots.device}, the device pool is on {pool.device}")
        path = "torch"
        for comp, buf in zip(pool.components, bufs, strict=True):
            if d2h:
                path = copy_device_to_host(
                    comp,
                    buf,
                    dev_slots,
                    flat_slots,
                    layer=layer,
                    knobs=self.knobs,
                    check=check,
                    impl=impl,
                )
            else:
                path = copy_host_to_device(
                    buf,
                    comp,
                    flat_slots,
                    dev_slots,
                    layer=layer,
                    knobs=self.knobs,
                    check=check,
                    impl=impl,
                )
        return path
