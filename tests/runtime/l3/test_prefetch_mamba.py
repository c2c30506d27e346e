"""An L3 prefetch on a Mamba hybrid that the host pool cannot take whole.

L3 holds one conversation (page size 4): pages 1-6 of KV, Mamba states after pages 3 and 6 (its
two turns ended there). A fresh cache whose host pool is partly held by device-resident pages
prefetches the conversation's third turn, a 6-page hit:

    host free    what happens
    20 tokens    5 pages fit; page 5 has no state, so the cut re-queries and reads pages 1-3
     8 tokens    2 pages fit and no prefix of <= 2 pages has a state: revoked, nothing read
    16 tokens    host-only pages of another conversation (already in L3) are evicted: all 6 read
"""

from __future__ import annotations

import time

import pytest
import torch

from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig, StorageConfig
from kvtier.storage import PoolTransfer, PrefetchOutcome, create_backend, page_hashes
from tests.runtime.l3.helpers import PREFETCH_BOUND_S, make_l3_cache
from tests.runtime.synthetic import MODELS, SPEC, P, run_turn

DEVICE_TOKENS = 32
HOST_TOKENS = 40
X1 = list(range(10, 22))  # turn 1: 12 tokens; 3 generated -> state after 12 (page 3)
X2 = X1 + [7, 7, 7] + list(range(30, 39))  # turn 2: 24 tokens -> state after 24 (page 6)
X3 = X2 + [7, 7, 7] + [1, 2]  # turn 3: 29 tokens, 28 page-aligned (the 7th page is new)


def consumer(root) -> TieredKVCache:
    cfg = CacheConfig(
        layer_kinds=MODELS["full+mamba"],
        kv_heads=1,
        head_dim=4,
        page_size=P,
        device_tokens=DEVICE_TOKENS,
        dtype=torch.float32,
        mamba=SPEC,
        mamba_slots=8,
        host_tokens=HOST_TOKENS,
        write_policy="write_through",
        model_id="synthetic-full+mamba",  # make_l3_cache's, so the page keys match
        storage=StorageConfig(prefetch_min_tokens=P, prefetch_policy="wait_complete"),
    )
    return TieredKVCache(cfg, storage_backend=create_backend("file", root=root))


@pytest.fixture
def root(tmp_path):
    producer = make_l3_cache("full+mamba", create_backend("file", root=tmp_path))
    run_turn(producer, X1)
    run_turn(producer, X2)
    producer.drain()
    producer.check_integrity()
    producer.close()
    return tmp_path


def prefetch(cache: TieredKVCache, prompt: list[int]):
    pf = cache.prefetch(prompt)
    assert pf is not None
    start = time.monotonic()
    while not pf.done:
        assert time.monotonic() - start < PREFETCH_BOUND_S, f"prefetch stuck: {pf}"
        cache.l3.wait_some(0.05)
        cache.poll()
        cache.check_integrity()
    return pf


def host_only_leaves_have_states(cache: TieredKVCache) -> bool:
    ms = cache.tree.mamba.slot
    return all(
        n.host_value[ms] is not None
        for n in cache.tree.all_nodes()[1:]
        if not n.children and n.value[0] is None
    )


def fill(cache: TieredKVCache, evicted: int, resident: int) -> None:
    """Cache ``evicted`` tokens that then leave the device (host-only, written to L3), then
    ``resident`` tokens that stay on device and so hold host slots that cannot be evicted."""
    if evicted:
        run_turn(cache, [60] * evicted)
        cache.drain()
        cache.evict(DEVICE_TOKENS)
    if resident:
        run_turn(cache, [80] * resident)
    cache.drain()
    cache.check_integrity()


def test_cut_ends_at_a_page_with_a_state(root):
    cache = consumer(root)
    fill(cache, evicted=0, resident=20)
    assert cache.tree.full.host_alloc.available_size() == 20
    pf = prefetch(cache, X3)
    assert pf.outcome is PrefetchOutcome.COMPLETE, pf
    assert pf.cut_pages == 5 and pf.planned_pages == 3 and pf.loaded_range == (0, 12), pf
    assert cache.l3.counters["prefetch_cut_host_capacity"] == 1
    assert host_only_leaves_have_states(cache), "a grafted prefix has no Mamba state"
    req = run_turn(cache, X3)
    assert req.host_hit == 12 and req.device_hit == 0, req
    cache.drain()
    cache.check_integrity()
    cache.close()


def test_no_usable_cut_is_revoked_before_reading(root):
    cache = consumer(root)
    fill(cache, evicted=0, resident=29)
    used = cache.tree.full.host_alloc.used_size()
    assert cache.tree.full.host_alloc.available_size() == 8
    pf = prefetch(cache, X3)
    assert pf.outcome is PrefetchOutcome.REVOKED and pf.reason == "host_capacity", pf
    assert pf.planned_pages == 0 and pf.loaded_range is None, pf
    assert cache.tree.full.host_alloc.used_size() == used, "pages were read and kept"
    assert cache.metrics()["tier.bytes.storage.read"] == 0, "pages were read"
    assert cache.l3.counters["prefetch_revoked_host_capacity"] == 1
    req = run_turn(cache, X3)
    assert req.cached_len == 0, req
    cache.drain()
    cache.check_integrity()
    cache.close()


def test_pages_l3_holds_are_evicted_from_host_to_make_room(root):
    cache = consumer(root)
    fill(cache, evicted=16, resident=8)
    z = [60] * 16
    assert cache.tree.match_prefix(z + [1]).host_hit_length == 16  # on host only
    assert cache.tree.full.host_alloc.available_size() == 16
    pf = prefetch(cache, X3)
    assert pf.outcome is PrefetchOutcome.COMPLETE and pf.cut_pages == 0, pf
    assert pf.planned_pages == 6 and pf.loaded_range == (0, 24), pf
    assert cache.tree.match_prefix(z + [1]).host_hit_length == 0, "the L3-held pages stayed"
    hashes = page_hashes(z, cache.l3.namespace(None), None)
    assert cache.l3.backend.exists([PoolTransfer("kv", hashes)]) == 4, "evicted pages not in L3"
    assert host_only_leaves_have_states(cache)
    req = run_turn(cache, X3)
    assert req.host_hit == 24, req
    cache.drain()
    cache.check_integrity()
    cache.close()
