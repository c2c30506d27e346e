"""L3 storage: namespaced page keys, the multi-pool storage contract, file and Mooncake backends."""

from __future__ import annotations

from kvtier.storage.base import (
    ALL_PAGES,
    TRAILING_PAGES,
    BatchResult,
    HitPolicy,
    PoolTransfer,
    StorageBackend,
    available_backends,
    create_backend,
    register_backend,
    usable_prefix,
)
from kvtier.storage.keys import KeyScope, Namespace, page_hashes
from kvtier.storage.metrics import Direction, PrefetchOutcome, StorageMetrics, Tier

__all__ = [
    "ALL_PAGES",
    "TRAILING_PAGES",
    "BatchResult",
    "Direction",
    "HitPolicy",
    "KeyScope",
    "Namespace",
    "PoolTransfer",
    "PrefetchOutcome",
    "StorageBackend",
    "StorageMetrics",
    "Tier",
    "available_backends",
    "create_backend",
    "page_hashes",
    "register_backend",
    "usable_prefix",
]
