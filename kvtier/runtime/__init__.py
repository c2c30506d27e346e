"""The runtime: the cache facade and its builder, the controller, and the parts they wire:
pools (memory), the radix tree (books), the L3 tier (storage)."""

from __future__ import annotations

from kvtier.runtime.pools.allocator import PageAllocator, SlotAllocator, SWAPageAllocator
from kvtier.runtime.tree.components import (
    FullComponent,
    MambaComponent,
    SWAComponent,
    TreeComponent,
)
from kvtier.runtime.tree.config import TreeConfig, build_tree
from kvtier.runtime.tree.node import TreeNode
from kvtier.runtime.tree.requests import CacheRequest
from kvtier.runtime.tree.tree import UnifiedRadixTree
from kvtier.runtime.tree.types import (
    Backup,
    EvictResult,
    HostPinHandle,
    InsertResult,
    LoadBack,
    MambaCopy,
    MatchResult,
    PinHandle,
    Transfer,
    TreeIntegrityError,
)

__all__ = [
    "Backup",
    "CacheRequest",
    "EvictResult",
    "FullComponent",
    "HostPinHandle",
    "InsertResult",
    "LoadBack",
    "MambaComponent",
    "MambaCopy",
    "MatchResult",
    "PageAllocator",
    "PinHandle",
    "SWAComponent",
    "SWAPageAllocator",
    "SlotAllocator",
    "Transfer",
    "TreeComponent",
    "TreeConfig",
    "TreeIntegrityError",
    "TreeNode",
    "UnifiedRadixTree",
    "build_tree",
]
