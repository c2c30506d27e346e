"""L3 storage: namespaced page keys, the multi-pool storage contract, file and Mooncake backends."""

from __future__ import annotations

# The counters moved to kvtier.metrics (every layer shares them); the old name stays importable here.
from kvtier.metrics import Direction, PrefetchOutcome, StorageMetrics, Tier
from kvtier.storage.base import (
    ALL_PAGES,
    TRAILING_PAGES,
    BatchResult,
    HitPolicy,
    PageSpans,
    PoolTransfer,
    StorageBackend,
    available_backends,
    create_backend,
    register_backend,
    usable_prefix,
)
from kvtier.storage.keys import KeyScope, Namespace, page_hashes

__all__ = [
    "ALL_PAGES",
    "TRAILING_PAGES",
    "BatchResult",
    "Direction",
    "HitPolicy",
    "KeyScope",
    "Namespace",
    "PageSpans",
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
