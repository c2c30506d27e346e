"""kvtier runtime: page allocators and the unified radix tree (prefix cache books)."""

from __future__ import annotations

from kvtier.runtime.allocator import PageAllocator, SlotAllocator, SWAPageAllocator
from kvtier.runtime.components import FullComponent, MambaComponent, SWAComponent, TreeComponent
from kvtier.runtime.tree import UnifiedRadixTree
from kvtier.runtime.tree_config import TreeConfig, build_tree
from kvtier.runtime.tree_node import TreeNode
from kvtier.runtime.tree_requests import CacheRequest
from kvtier.runtime.tree_types import (
    Backup,
    EvictResult,
    HostPinHandle,
    InsertResult,
    LoadBack,
    LockHandle,
    MambaCopy,
    MatchResult,
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
    "LockHandle",
    "MambaComponent",
    "MambaCopy",
    "MatchResult",
    "PageAllocator",
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
