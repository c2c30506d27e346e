"""Pin the public names, so that removing or renaming one is a deliberate change."""

from __future__ import annotations

import kvtier
import kvtier.kernels


def test_top_level_api():
    assert sorted(kvtier.__all__) == [
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
    for name in kvtier.__all__:
        assert getattr(kvtier, name) is not None


def test_kernels_api():
    assert sorted(kvtier.kernels.__all__) == [
        "DEFAULT_KNOBS",
        "DeviceBuffers",
        "HostBuffer",
        "HostLayout",
        "TransferKnobs",
        "copy_device_to_host",
        "copy_host_to_device",
        "debug_checks",
        "host_shape",
        "select_impl",
        "set_debug_checks",
    ]


def test_cache_facade_methods():
    for name in (
        "match",
        "reserve",
        "start_loading",
        "wait_layer",
        "computed",
        "swa_slots",
        "cache_finished_req",
        "cache_unfinished_req",
        "poll",
        "evict",
        "drain",
        "check_integrity",
        "metrics",
    ):
        assert callable(getattr(kvtier.TieredKVCache, name)), name
