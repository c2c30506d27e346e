"""The frozen, validated configuration of a tiered KV cache (what a model runner builds once)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier.kernels.kv_transfer import TransferKnobs
from kvtier.kernels.layout import HostLayout
from kvtier.runtime.mamba_pool import MambaStateSpec

__all__ = ["CacheConfig", "WRITE_POLICIES", "LAYER_KINDS"]

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
LAYER_KINDS = ("full", "swa", "mamba")


@dataclass(frozen=True)
class CacheConfig:
    """Model shape, pool sizes and policies.

    Attributes:
        layer_kinds: one of "full", "swa", "mamba" per model layer, in model order.
        kv_heads, head_dim, dtype: attention K/V shape per token per layer (full and SWA).
        page_size: tokens per page P.
        device_tokens: FULL device token slots.
        swa_window: sliding window in tokens (needed when a layer is "swa").
        swa_tokens: SWA device token slots (default: ``device_tokens``).
        mamba: per-layer Mamba state (needed when a layer is "mamba").
        mamba_slots: device Mamba state slots.
        host_tokens / host_ratio: FULL host slots, or their ratio to ``device_tokens``; exactly
            one. SWA and Mamba host pools take the same ratio of their device pools.
        host_layout: KV/SWA host layout; "layer_first", "page_first" or "page_first_direct".
        mamba_host_layout: Mamba host pools hold one flat page per slot: only "flat".
        write_policy: "write_through" (back up new nodes at once), "write_through_selective"
            (back up on the second hit) or "write_back" (back up on device eviction).
        load_back_min_tokens: host hits shorter than this are recomputed instead of loaded.
        load_back_max_tokens: a load larger than this is refused (recomputed); None: no limit.
        knobs: copy-kernel launch knobs (grid cap, tile bytes, warps).
        device: where device pools live.
    """

    layer_kinds: tuple[str, ...]
    kv_heads: int
    head_dim: int
    page_size: int
    device_tokens: int
    dtype: torch.dtype = torch.bfloat16
    swa_window: int | None = None
    swa_tokens: int | None = None
    mamba: MambaStateSpec | None = None
    mamba_slots: int | None = None
    host_tokens: int | None = None
    host_ratio: float | None = None
    host_layout: str = "page_first"
    mamba_host_layout: str = "flat"
    write_policy: str = "write_through"
    load_back_min_tokens: int = 1
    load_back_max_tokens: int | None = None
    knobs: TransferKnobs | None = field(default=None, compare=False)
    device: str = "cpu"

    def __post_init__(self) -> None:
        kinds = tuple(self.layer_kinds)
        object.__setattr__(self, "layer_kinds", kinds)
        if not kinds:
            raise ValueError("layer_kinds: a model has at least one layer")
        bad = [k for k in kinds if k not in LAYER_KINDS]
        if bad:
            raise ValueError(f"layer_kinds: unknown kind {bad[0]!r}; choose from {LAYER_KINDS}")
        if "full" not in kinds:
            raise ValueError("layer_kinds: at least one full-attention layer anchors the cache")
        P = self.page_size
        if not 1 <= P <= 256:
            raise ValueError(f"page_size must be in [1, 256], got {P}")
        if self.device_tokens <= 0 or self.device_tokens % P:
            raise ValueError(f"device_tokens={self.device_tokens} must be a positive multiple of {P}")
        if "swa" in kinds:
            if not self.swa_window or self.swa_window <= 0:
                raise ValueError("swa_window: needed (positive) when a layer is 'swa'")
            swa = self.swa_tokens or self.device_tokens
            if swa % P:
                raise ValueError(f"swa_tokens={swa} must be a multiple of page_size={P}")
        if "mamba" in kinds and (self.mamba is None or not self.mamba_slots):
            raise ValueError("mamba, mamba_slots: needed when a layer is 'mamba'")
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write_policy: unknown {self.write_policy!r}; choose from {WRITE_POLICIES}"
            )
        HostLayout.parse(self.host_layout, arg="host_layout")
        if self.mamba_host_layout != "flat":
            raise ValueError(
                f"mamba_host_layout: Mamba host pools support only 'flat' (one contiguous page "
                f"per slot), not {self.mamba_host_layout!r}"
            )
        if (self.host_tokens is None) == (self.host_ratio is None):
            raise ValueError("give exactly one of host_tokens, host_ratio")
        host = self.host_kv_tokens
        if host < self.device_tokens:
            raise ValueError(
                f"host_tokens: host pool of {host} tokens is smaller than the device pool of "
                f"{self.device_tokens}; the host tier must be able to hold what the device holds"
            )
        if self.load_back_min_tokens < 0:
            raise ValueError("load_back_min_tokens must be >= 0")

    # -- derived sizes -------------------------------------------------------------------------

    def layers_of(self, kind: str) -> list[int]:
        return [i for i, k in enumerate(self.layer_kinds) if k == kind]

    @property
    def host_kv_tokens(self) -> int:
        P = self.page_size
        n = self.host_tokens if self.host_tokens is not None else int(self.device_tokens * self.host_ratio)
        return n // P * P

    @property
    def ratio(self) -> float:
        return self.host_kv_tokens / self.device_tokens

    @property
    def swa_device_tokens(self) -> int:
        return self.swa_tokens or self.device_tokens

    @property
    def host_swa_tokens(self) -> int:
        P = self.page_size
        return max(P, int(self.swa_device_tokens * self.ratio) // P * P)

    @property
    def host_mamba_slots(self) -> int:
        return max(1, int((self.mamba_slots or 0) * self.ratio))
