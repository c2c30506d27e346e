"""The frozen, validated configuration of a tiered KV cache (what a model runner builds once)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from kvtier.kernels.kv_transfer import TransferKnobs
from kvtier.kernels.layout import HostLayout
from kvtier.runtime.mamba_pool import MambaStateSpec

__all__ = ["CacheConfig", "LAYER_KINDS", "PREFETCH_POLICIES", "StorageConfig", "WRITE_POLICIES"]

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
LAYER_KINDS = ("full", "swa", "mamba")
PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


@dataclass(frozen=True)
class StorageConfig:
    """The L3 tier: which backend, and how prefetch and backup use it.

    Attributes:
        backend: a registered backend name (``kvtier.storage.available_backends()``).
        backend_config: keyword arguments of that backend's ``Config`` (e.g. ``root`` for
            ``"file"``, ``master_address`` for ``"mooncake"``).
        namespace_key: a deployment-wide salt folded into every page key (with each request's
            own namespace: LoRA id, cache salt); processes share L3 pages only if it matches.
        prefetch_policy: when a prefetch may stop and hand over what arrived:
            ``"best_effort"`` (at the next step), ``"wait_complete"`` (only when every hit page
            arrived or the read failed) or ``"timeout"`` (complete, or after
            ``prefetch_timeout_base_s + prefetch_timeout_per_ki_token_s * tokens / 1024``).
        prefetch_min_tokens: prefetches shorter than this (or than one page) are not started,
            and ones whose agreed hit is shorter are revoked.
        host_occupancy_limit: in-flight prefetches may hold at most this fraction of the FULL
            host pool (tokens); more are not started.
        write_to_storage: back host pages up to L3 after each device→host copy.
        rank_replicated: every TP rank holds the same bytes (MLA-style caches): only rank 0
            writes, under rank-free keys. Otherwise pages are per-rank head shards.
        prefill_tokens_per_s: the model's prefill rate; an L3 hit whose load (at the measured
            storage bandwidth) would take longer than recomputing it is skipped. None: always load.
        assumed_storage_gbps: storage read GB/s to assume before any read was measured.
        backup_retries: extra attempts for pages whose L3 write failed, before counting them.
        batch_pages: pages per backend call.
    """

    backend: str = "file"
    backend_config: Mapping[str, Any] = field(default_factory=dict)
    namespace_key: str = ""
    prefetch_policy: str = "timeout"
    prefetch_timeout_base_s: float = 1.0
    prefetch_timeout_per_ki_token_s: float = 0.25
    prefetch_min_tokens: int = 256
    host_occupancy_limit: float = 0.8
    write_to_storage: bool = True
    rank_replicated: bool = False
    prefill_tokens_per_s: float | None = None
    assumed_storage_gbps: float | None = None
    backup_retries: int = 2
    batch_pages: int = 128

    def __post_init__(self) -> None:
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(
                f"prefetch_policy: unknown {self.prefetch_policy!r}; choose from {PREFETCH_POLICIES}"
            )
        if self.prefetch_timeout_base_s < 0 or self.prefetch_timeout_per_ki_token_s < 0:
            raise ValueError("prefetch timeouts must be >= 0 seconds")
        if self.prefetch_min_tokens < 0:
            raise ValueError("prefetch_min_tokens must be >= 0")
        if not 0 < self.host_occupancy_limit <= 1:
            raise ValueError(
                f"host_occupancy_limit must be in (0, 1], got {self.host_occupancy_limit}"
            )
        for name in ("prefill_tokens_per_s", "assumed_storage_gbps"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be positive or None, got {v}")
        if self.backup_retries < 0 or self.batch_pages < 1:
            raise ValueError("need backup_retries >= 0 and batch_pages >= 1")


@dataclass(frozen=True)
class CacheConfig:
    """Model shape, pool sizes and policies.

    Attributes:
        layer_kinds: one of "full", "swa", "mamba" per model layer, in model order.
        kv_heads, head_dim, dtype: attention K/V shape per token per layer (full and SWA).
        mla_dim: MLA latent width: "full" layers keep one ``[1, mla_dim]`` latent per token
            (``MLADevicePool``) instead of K/V, and ``kv_heads``/``head_dim`` are unused. MLA
            caches are the same on every TP rank: their L3 pages get rank-free keys and only
            rank 0 writes them. None: MHA/GQA K/V.
        indexer: keep the DSA indexer's per-token 128-byte fp8 key and 4-byte fp32 scale of every
            full layer (``IndexerDevicePool``, stored per page). It has no slots of its own:
            its pages are the FULL pool's pages, and move (D→H, H→D, to and from L3) and are
            evicted with them.
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
        model_id: checkpoint identity (name and revision); seeds every L3 page key.
        storage: the L3 tier, or None for none (needs ``model_id``).
    """

    layer_kinds: tuple[str, ...]
    kv_heads: int
    head_dim: int
    page_size: int
    device_tokens: int
    dtype: torch.dtype = torch.bfloat16
    mla_dim: int | None = None
    indexer: bool = False
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
    model_id: str = ""
    storage: StorageConfig | None = None

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
        if self.mla_dim is None:
            for name in ("kv_heads", "head_dim"):
                if getattr(self, name) < 1:
                    raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (self.dtype.is_floating_point or self.dtype.itemsize == 1):
            raise ValueError(f"dtype: KV must be a float or 8-bit type, got {self.dtype}")
        if self.swa_tokens is not None and (self.swa_tokens <= 0 or self.swa_tokens % P):
            raise ValueError(f"swa_tokens={self.swa_tokens} must be a positive multiple of {P}")
        if self.mamba_slots is not None and self.mamba_slots < 1:
            raise ValueError(f"mamba_slots must be >= 1, got {self.mamba_slots}")
        if "swa" in kinds:
            if not self.swa_window or self.swa_window <= 0:
                raise ValueError("swa_window: needed (positive) when a layer is 'swa'")
        if self.mla_dim is not None:
            if self.mla_dim < 1:
                raise ValueError(f"mla_dim must be >= 1, got {self.mla_dim}")
            # Their pages are per-rank head shards under TP, MLA pages are rank-replicated:
            # one cache cannot key both ways.
            other = sorted(set(kinds) - {"full"})
            if other:
                raise ValueError(
                    f"mla_dim: MLA caches hold only 'full' layers, got {other[0]!r} layers"
                )
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
        if self.load_back_max_tokens is not None and (
            self.load_back_max_tokens < max(self.load_back_min_tokens, 1)
        ):
            raise ValueError(
                f"load_back_max_tokens={self.load_back_max_tokens} is below load_back_min_tokens="
                f"{self.load_back_min_tokens}: every load-back would be refused"
            )
        if self.storage is not None and not self.model_id:
            raise ValueError(
                "model_id: needed with storage (L3 keys must name the checkpoint, or two models "
                "would read each other's pages)"
            )

    # -- derived sizes -------------------------------------------------------------------------

    @property
    def rank_replicated(self) -> bool:
        """Every TP rank holds the same cache bytes (MLA, or ``storage.rank_replicated``)."""
        return self.mla_dim is not None or (
            self.storage is not None and self.storage.rank_replicated
        )

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
