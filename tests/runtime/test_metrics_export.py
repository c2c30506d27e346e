"""One snapshot, one Prometheus text, one prometheus_client collector, all from the same counters."""

from __future__ import annotations

import pytest
import torch

from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig

P = 4


def small_cache(**kw) -> TieredKVCache:
    return TieredKVCache(
        CacheConfig(
            layer_kinds=("full",),
            kv_heads=1,
            head_dim=4,
            page_size=P,
            device_tokens=32,
            dtype=torch.float32,
            host_ratio=4.0,
            **kw,
        )
    )


def served_cache() -> TieredKVCache:
    cache = small_cache()
    for _ in range(2):
        req = cache.match(list(range(1, 14)))
        cache.reserve(req, 16)
        cache.begin_step(req, 16)
        cache.computed(req, 16)
        req.token_ids = list(range(1, 17))
        cache.cache_finished_req(req)
        cache.poll()
    cache.drain()
    cache.evict(32)
    return cache


def test_snapshot_and_text_agree():
    cache = served_cache()
    m = cache.metrics()
    assert m["requests"] == 2 and m["device_hit_tokens"] == 12 and m["backups"] >= 1
    assert m["evicted_tokens"] > 0 and m["tier.hit_tokens.device"] == 12
    text = cache.prometheus()
    assert "kvtier_requests_total 2" in text
    assert f"kvtier_evicted_tokens_total {m['evicted_tokens']}" in text
    assert 'kvtier_copies_total{direction="d2h"} ' + str(m["backups"]) in text
    # Every planned copy is counted by the path it took (on CPU: the torch reference or the
    # interpreter), in the snapshot and in the text alike.
    paths = {k: v for k, v in m.items() if k.startswith("copy_path.d2h.")}
    assert paths and sum(paths.values()) >= 1
    for key, v in paths.items():
        path = key.rsplit(".", 1)[1]
        assert f'kvtier_copy_plans_total{{direction="d2h",path="{path}"}} {v}' in text
    reasons = {k: v for k, v in m.items() if k.startswith("copy_route.")}
    assert sum(reasons.values()) == sum(v for k, v in m.items() if k.startswith("copy_path."))


def test_collector_joins_a_prometheus_client_registry():
    prometheus_client = pytest.importorskip("prometheus_client")
    cache = served_cache()
    registry = prometheus_client.CollectorRegistry()
    registry.register(cache.metrics_collector())
    assert registry.get_sample_value("kvtier_requests_total") == 2
    assert (
        registry.get_sample_value("kvtier_copies_total", {"direction": "d2h"})
        == (cache.metrics()["backups"])
    )
    assert (
        registry.get_sample_value("kvtier_hit_tokens_total", {"tier": "device"})
        == cache.metrics()["tier.hit_tokens.device"]
    )
    text = prometheus_client.generate_latest(registry).decode()
    assert "kvtier_evicted_tokens_total" in text


def series(text: str) -> set[str]:
    """The Prometheus series of ``text``: each sample's name and labels, without its value."""
    return {line.rsplit(" ", 1)[0] for line in text.splitlines() if not line.startswith("#")}


def test_every_key_and_series_is_there_from_the_start(tmp_path):
    """A fresh cache already has every metrics key and Prometheus series (at 0) that serving,
    backups, loads and an attached L3 tier count into: a dashboard or an alert on a series sees it
    before its first count. Keys used to appear with it (``copy_path.*``, ``copy_route.*``,
    ``l3.backup_*``)."""
    from kvtier.runtime.config import StorageConfig

    cache = small_cache(write_policy="write_through", model_id="m")
    keys, text = set(cache.metrics()), series(cache.prometheus())
    assert all(v == 0 for k, v in cache.metrics().items() if k.startswith(("copy_", "l3.")))
    cache.attach_storage(StorageConfig(backend_config={"root": tmp_path / "l3"}))
    cache.poll()
    prompt = list(range(1, 14))
    for _ in range(3):
        req = cache.match(prompt)
        cache.reserve(req, 16)
        cache.start_loading()
        cache.computed(req, 16)
        req.token_ids = prompt + [99, 98, 97]
        cache.cache_finished_req(req)
        cache.poll()
        cache.drain()
        cache.evict(32)
    m = cache.metrics()
    assert m["backups"] >= 1 and m["loads"] >= 1 and m["l3.backup_pages"] >= 1, m
    # Tokens are not events: prefetched tokens have their own family.
    assert 'event="prefetched_tokens"' not in cache.prometheus()
    assert f"kvtier_prefetched_tokens_total {m['l3.prefetched_tokens']}" in cache.prometheus()
    assert set(m) == keys
    assert series(cache.prometheus()) == text
    cache.close()


def test_the_l3_key_list_names_every_counter_the_code_counts():
    """``L3_COUNTERS`` (the keys a snapshot holds from the start) names every key that the L3
    tier and the storage switch count: each literal ``counters["..."]`` in their sources."""
    import re
    from pathlib import Path

    import kvtier.runtime.l3 as l3
    from kvtier.runtime.metrics import L3_COUNTERS

    counted = set()
    for src in Path(l3.__file__).parent.glob("*.py"):
        counted |= set(re.findall(r'counters\[\s*"([a-z0-9_]+)"\s*\]', src.read_text()))
        for a, b in re.findall(
            r'counters\[\s*"([a-z0-9_]+)" if \w+ else "([a-z0-9_]+)"', src.read_text()
        ):
            counted |= {a, b}
    assert counted and counted <= set(L3_COUNTERS), sorted(counted - set(L3_COUNTERS))
