"""MLA latents and the DSA indexer through the cache facade: device and host hits are exact.

With the synthetic MLA model (``tests/runtime/synthetic_mla.py``), a later request must find,
for every position it reuses, the latent a cold run writes, and for every page it reuses, the
indexer page (all keys, then all scales) a cold run writes: on device, after load-back from
every host layout, and (``l3/test_mla.py``) after a round trip through L3.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig
from tests.runtime.synthetic_mla import DIM, P, mla_config, run_turn


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_device_then_host_hits_are_exact(policy, layout):
    cache = TieredKVCache(mla_config(policy, layout))
    gen = torch.Generator().manual_seed(len(policy) + len(layout))
    convs = [torch.randint(0, 50, (12,), generator=gen).tolist() for _ in range(3)]
    for c in convs:
        run_turn(cache, c)
    second = run_turn(cache, convs[0] + [7, 7, 7] + [1, 2, 3, 4, 5])
    assert second.device_hit == 12 and second.host_hit == 0, second
    for _ in range(6):  # flood the device so the first conversations leave it
        run_turn(cache, torch.randint(50, 99, (16,), generator=gen).tolist())
    cache.drain()
    cache.evict(cache.config.device_tokens)
    cache.check_integrity()
    # Scribble over every device page: a load-back that skipped the indexer would keep it.
    cache.indexer_pool.buffer.fill_(0xAB)
    cache.full_pool.kv_buffer.fill_(float("nan"))
    third = run_turn(cache, convs[1] + [7, 7, 7] + [9, 9])
    assert third.device_hit == 0 and third.host_hit == 12, third
    cache.drain()
    cache.check_integrity()
    m = cache.metrics()
    per_token = cache.full_pool.bytes_per_token + cache.indexer_pool.bytes_per_token // P
    assert m["h2d_bytes"] == third.host_hit * per_token, m


def test_indexer_pages_follow_kv_eviction():
    """Eviction frees KV slots only; the indexer has nothing of its own to free or leak."""
    cache = TieredKVCache(mla_config())
    run_turn(cache, list(range(1, 13)))
    cache.drain()
    used = cache.kv_alloc.used_size()
    assert cache.evict(cache.config.device_tokens) == used
    assert cache.kv_alloc.used_size() == 0
    cache.check_integrity()
    req = run_turn(cache, list(range(1, 13)) + [7, 7])
    assert req.host_hit == 12


def test_mla_configs():
    base = {"kv_heads": 1, "head_dim": 1, "page_size": P, "device_tokens": 32, "host_ratio": 2.0}
    with pytest.raises(ValueError, match="mla_dim: MLA caches hold only 'full' layers, got 'swa'"):
        CacheConfig(layer_kinds=("full", "swa"), swa_window=8, mla_dim=DIM, **base)
    with pytest.raises(ValueError, match="mla_dim must be >= 1"):
        CacheConfig(layer_kinds=("full",), mla_dim=0, **base)
    assert CacheConfig(layer_kinds=("full",), mla_dim=DIM, **base).rank_replicated
    assert not CacheConfig(layer_kinds=("full",), **base).rank_replicated
