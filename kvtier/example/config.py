"""Shape of the example hybrid decoder: layer kinds, heads, dims, dtypes and the weight seed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from kvtier.runtime.pools.mamba import MambaStateSpec

__all__ = ["HybridModelConfig", "LayerKind"]

LayerKind = Literal["full", "swa", "mamba"]
_KINDS = ("full", "swa", "mamba")


@dataclass(frozen=True)
class HybridModelConfig:
    """A small pre-norm decoder whose layers are full attention, sliding-window attention or Mamba.

    Attention (both kinds): ``q_heads`` query heads over ``kv_heads`` K/V heads of ``head_dim``
    (GQA when ``q_heads > kv_heads``), rotary positions. SWA layers see the last ``swa_window``
    positions, the current one included.

    Mamba-like layer: ``x = W_x h`` (``mamba_dim = mamba_heads * mamba_head_dim`` channels) goes
    through a depthwise causal conv of ``mamba_kernel`` taps (conv state: the previous
    ``mamba_kernel - 1`` inputs, ``[mamba_dim, mamba_kernel - 1]`` in ``dtype``), then a diagonal
    linear recurrence per head ``S_t = a_t * S_{t-1} + dt_t * x_t B_t^T`` (temporal state
    ``[mamba_heads, mamba_head_dim, mamba_state]`` fp32), read out as ``y_t = S_t C_t + D x_t``
    and gated by ``silu(z_t)``.

    ``dtype`` is the storage dtype of K/V and of the conv state (the pools' dtype); the math runs
    in float64 on integer grids (see :mod:`kvtier.example.layers`), the Mamba recurrence in fp32
    (its state's dtype). ``seed`` fixes the random weights. At least one layer must be "full": its token
    slots are the index space the cache tree keys on.
    """

    vocab: int = 256
    hidden: int = 64
    layer_kinds: tuple[LayerKind, ...] = ("full", "swa", "mamba", "full")
    q_heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    swa_window: int = 8
    mamba_heads: int = 2
    mamba_head_dim: int = 16
    mamba_state: int = 8
    mamba_kernel: int = 4
    ffn: int = 128
    rope_theta: float = 10000.0
    dtype: torch.dtype = torch.bfloat16
    seed: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_kinds", tuple(self.layer_kinds))
        bad = [k for k in self.layer_kinds if k not in _KINDS]
        if bad:
            raise ValueError(f"layer_kinds: unknown kinds {bad}, expected one of {_KINDS}")
        self._check_anchor()
        for name in ("vocab", "hidden", "q_heads", "kv_heads", "head_dim", "ffn"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.q_heads % self.kv_heads:
            raise ValueError(
                f"q_heads: {self.q_heads} is not a multiple of kv_heads={self.kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary positions, got {self.head_dim}")
        if "swa" in self.layer_kinds and self.swa_window < 1:
            raise ValueError(f"swa_window must be >= 1, got {self.swa_window}")
        if "mamba" in self.layer_kinds:
            for name in ("mamba_heads", "mamba_head_dim", "mamba_state"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
            if self.mamba_kernel < 2:
                raise ValueError(f"mamba_kernel must be >= 2, got {self.mamba_kernel}")

    def _check_anchor(self) -> None:
        """The model's slot rows must key the cache: here, a "full" layer's (a V4-like model,
        whose FULL pool is logical, overrides this)."""
        if "full" not in self.layer_kinds:
            raise ValueError("layer_kinds: need at least one 'full' layer")

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    @property
    def mamba_dim(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    def layers_of(self, kind: LayerKind) -> tuple[int, ...]:
        """Global indices of the layers of ``kind``, in order."""
        return tuple(i for i, k in enumerate(self.layer_kinds) if k == kind)

    def pool_layer(self, layer: int) -> tuple[LayerKind, int]:
        """``(kind, index in that kind's pool)`` of global layer ``layer``."""
        kind = self.layer_kinds[layer]
        return kind, self.layer_kinds[:layer].count(kind)

    def mamba_spec(self) -> MambaStateSpec:
        """The per-layer state of a Mamba slot: temporal fp32, one conv state in ``dtype``."""
        return MambaStateSpec(
            temporal_shape=(self.mamba_heads, self.mamba_head_dim, self.mamba_state),
            conv_shapes=((self.mamba_dim, self.mamba_kernel - 1),),
            temporal_dtype=torch.float32,
            conv_dtypes=(self.dtype,),
        )
