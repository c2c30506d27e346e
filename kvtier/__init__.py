"""kvtier: KV-cache tiering runtime (device pools, pinned host pools, L3 storage).

The names a serving engine needs are here; the subpackages hold the rest:
``kvtier.kernels`` (copy kernels), ``kvtier.runtime`` (pools, tree, controller, cache facade),
``kvtier.storage`` (L3 keys and backends), ``kvtier.example`` (an example model runner).
"""

from __future__ import annotations

from kvtier.kernels import HostLayout, TransferKnobs
from kvtier.runtime.cache import Request, TieredKVCache
from kvtier.runtime.config import CacheConfig, KVTierConfigWarning, StorageConfig
from kvtier.runtime.pools.device import MHADevicePool, MLADevicePool
from kvtier.runtime.pools.host import HostPool
from kvtier.runtime.pools.indexer import IndexerDevicePool
from kvtier.runtime.pools.mamba import MambaDevicePool, MambaHostPool, MambaStateSpec
from kvtier.runtime.pools.sidecar import SidecarSpec

__version__ = "0.1.0"

__all__ = [
    "CacheConfig",
    "HostLayout",
    "HostPool",
    "IndexerDevicePool",
    "KVTierConfigWarning",
    "MHADevicePool",
    "MLADevicePool",
    "MambaDevicePool",
    "MambaHostPool",
    "MambaStateSpec",
    "Request",
    "SidecarSpec",
    "StorageConfig",
    "TieredKVCache",
    "TransferKnobs",
]
