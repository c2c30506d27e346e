"""Build a ``UnifiedRadixTree`` with its pools from one validated, frozen config."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kvtier.runtime.pools.allocator import PageAllocator, SlotAllocator, SWAPageAllocator
from kvtier.runtime.tree.components import (
    FullComponent,
    MambaComponent,
    SWAComponent,
    TreeComponent,
)
from kvtier.runtime.tree.evict import Eviction
from kvtier.runtime.tree.insert import Inserter
from kvtier.runtime.tree.integrity import Integrity
from kvtier.runtime.tree.match import Matcher
from kvtier.runtime.tree.node import TreeNode
from kvtier.runtime.tree.pins import Pins
from kvtier.runtime.tree.requests import RequestCache
from kvtier.runtime.tree.retention import Retention
from kvtier.runtime.tree.tiers import HostTier
from kvtier.runtime.tree.tree import UnifiedRadixTree

__all__ = ["TreeConfig", "build_tree"]


@dataclass(frozen=True)
class TreeConfig:
    """Which components a model has and how large each pool is.

    Attributes:
        page_size: tokens per page P.
        kv_size: FULL device token slots (multiple of P).
        swa_window: SWA window in tokens; None = no SWA component.
        swa_size: SWA device token slots (default ``kv_size``).
        mamba_size: Mamba device state slots; None = no MAMBA component.
        mamba_chunk_size: tokens per chunk of the Mamba scan kernel; requests checkpoint
            states on multiples of it (and of P), see ``MatchResult.mamba_branching_seqlen``.
        host_kv_size: FULL host token slots; None = no host tier.
        host_swa_size, host_mamba_size: aux host pools (default: as large as their device pool).
        eviction_policy: ``"lru"`` or ``"priority"``.
        backup_continuity: backups must form a root-anchored prefix (write-through).
    """

    page_size: int
    kv_size: int
    swa_window: int | None = None
    swa_size: int | None = None
    mamba_size: int | None = None
    mamba_chunk_size: int = 64
    host_kv_size: int | None = None
    host_swa_size: int | None = None
    host_mamba_size: int | None = None
    eviction_policy: str = "lru"
    backup_continuity: bool = True

    def __post_init__(self) -> None:
        P = self.page_size
        for name in ("kv_size", "swa_size", "host_kv_size", "host_swa_size"):
            v = getattr(self, name)
            if v is not None and (v <= 0 or v % P):
                raise ValueError(f"{name}={v} must be a positive multiple of page_size={P}")
        if self.swa_window is not None and self.swa_window <= 0:
            raise ValueError(f"swa_window must be positive, got {self.swa_window}")
        if self.swa_window is None and self.swa_size is not None:
            raise ValueError("swa_size given without swa_window")
        if self.mamba_chunk_size <= 0:
            raise ValueError(f"mamba_chunk_size must be positive, got {self.mamba_chunk_size}")
        for name in ("mamba_size", "host_mamba_size"):
            v = getattr(self, name)
            if v is not None and v <= 0:
                raise ValueError(f"{name} must be positive, got {v}")


def build_tree(
    cfg: TreeConfig, write_back: Callable[[TreeNode], bool] | None = None
) -> UnifiedRadixTree:
    """Pools and components for ``cfg``, wired into a tree. Pool names: kv, swa, mamba."""
    P = cfg.page_size
    host = cfg.host_kv_size is not None
    if cfg.swa_window is not None:
        kv = SWAPageAllocator(cfg.kv_size, cfg.swa_size or cfg.kv_size, P, "kv")
    else:
        kv = PageAllocator(cfg.kv_size, P, "kv")
    host_kv = PageAllocator(cfg.host_kv_size, P, "host kv") if host else None
    comps: list[TreeComponent] = [FullComponent("kv", kv, host_kv)]
    if cfg.swa_window is not None:
        host_swa = None
        if host:
            host_swa = PageAllocator(
                cfg.host_swa_size or cfg.swa_size or cfg.kv_size, P, "host swa"
            )
        comps.append(SWAComponent(cfg.swa_window, kv, host_swa))
    if cfg.mamba_size is not None:
        host_mamba = (
            SlotAllocator(cfg.host_mamba_size or cfg.mamba_size, "host mamba") if host else None
        )
        mamba = SlotAllocator(cfg.mamba_size, "mamba")
        comps.append(
            MambaComponent("mamba", mamba, host_mamba, page_size=P, chunk_size=cfg.mamba_chunk_size)
        )
    tree = UnifiedRadixTree(
        comps,
        P,
        eviction_policy=cfg.eviction_policy,
        write_back=write_back,
        backup_continuity=cfg.backup_continuity,
    )
    tree.attach_parts(
        Matcher(tree),
        Inserter(tree),
        Pins(tree),
        Eviction(tree),
        HostTier(tree),
        RequestCache(tree),
        Integrity(tree),
        Retention(tree),
    )
    return tree
