"""Pages the tier remembers writing are checked against the store before a later backup of
their path skips them: a capped store evicts pages this process wrote while it still caches
them, and every later backup of the path used to skip them for good, so a later prefetch of
the conversation found its chain broken at the root and served nothing (a soak trial)."""

from __future__ import annotations

import torch

from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig, StorageConfig
from kvtier.runtime.l3 import tier as tier_mod
from kvtier.storage import PoolTransfer
from tests.runtime.synthetic import run_turn


def _cache(root) -> TieredKVCache:
    cfg = CacheConfig(
        layer_kinds=("full", "full"), kv_heads=1, head_dim=4, page_size=4,
        device_tokens=64, dtype=torch.float32, host_ratio=2.0, model_id="recheck",
        write_policy="write_through",
        storage=StorageConfig(
            backend_config={"root": str(root), "capacity_bytes": 96 << 10,
                            "segment_bytes": 64 << 10},
            prefetch_min_tokens=4, prefetch_policy="wait_complete",
        ),
    )  # fmt: skip
    return TieredKVCache(cfg)


def test_a_remembered_page_the_store_evicted_is_written_again(tmp_path, monkeypatch):
    monkeypatch.setattr(tier_mod, "_RECHECK_POLLS", 8)  # the store turns over within 60 polls
    cache = _cache(tmp_path / "l3")
    store = cache.l3.backend
    a = list(range(1000, 1015))
    run_turn(cache, a)  # turn 1 of conversation A, written to L3
    cache.drain()
    cache.poll()
    node = cache.tree.match_prefix(a[:12], read_only=True).best_match_node
    hashes = cache.l3.node_hashes(node)
    assert all(store.contains("kv", hashes))
    pin = cache.pin(a + [7], ttl_s=1e5)  # A stays cached while other traffic fills the store
    for i in range(60):
        run_turn(cache, [5000 + 20 * i + j for j in range(15)])
    cache.drain()
    cache.poll()
    assert not any(store.contains("kv", hashes)), "the test needs A's pages evicted"
    assert all(("kv", h) in cache.l3.stored_pages() for h in hashes)  # still remembered
    a2 = a + [7, 7, 7] + list(range(2000, 2011))
    run_turn(cache, a2)  # turn 2: its backup re-checks A's remembered pages
    cache.drain()
    cache.poll()
    assert all(store.contains("kv", hashes)), store.contains("kv", hashes)
    # And the conversation comes back from L3 whole once the cache has lost it.
    cache.unpin(pin)
    for i in range(12):
        run_turn(cache, [9000 + 20 * i + j for j in range(15)])
    cache.drain()
    cache.poll()
    prompt = a2 + [7, 7, 7, 1]
    pf = cache.prefetch(prompt)
    while pf is not None and not pf.done:
        cache.l3.wait_some(0.05)
        cache.poll()
    req = cache.match(prompt)
    assert req.storage_hit == len(prompt) - 1 - (len(prompt) - 1) % 4, (pf, req)
    cache.abort(req)
    cache.check_integrity()
    cache.close()


def test_contains_answers_page_by_page(tmp_path):
    cache = _cache(tmp_path / "l3")
    run_turn(cache, list(range(1000, 1015)))
    cache.drain()
    cache.poll()
    (h0, *_rest) = cache.l3.node_hashes(
        cache.tree.match_prefix(list(range(1000, 1012)), read_only=True).best_match_node
    )
    other = "f" * 64
    assert cache.l3.backend.contains("kv", [other, h0, "not-a-hash"]) == [False, True, False]
    assert cache.l3.backend.exists([PoolTransfer("kv", [other, h0])]) == 0  # a prefix answer
    cache.close()


def test_re_checked_pages_the_store_holds_are_not_written_and_not_left_pending(tmp_path):
    """A later turn's backup re-checks its path's remembered pages; those the store holds are
    counted stored without a write, and none of the job's pages stays marked in flight."""
    cache = _cache(tmp_path / "l3")
    a = list(range(1000, 1015))
    run_turn(cache, a)
    cache.drain()
    cache.poll()
    written = cache.metrics()["l3.backup_pages"]
    run_turn(cache, a + [7, 7, 7] + list(range(2000, 2011)))  # the path's first pages: held
    cache.drain()
    cache.poll()
    assert not cache.l3._pending, "pages of finished jobs left marked in flight"
    new = cache.metrics()["l3.backup_pages"] - written
    assert 0 < new < len(cache.l3.stored_pages()), new  # only the new pages were written
    cache.close()


def test_pages_known_in_the_store_lately_are_not_checked_again(tmp_path, monkeypatch):
    """The re-check costs the scheduler a path's worth of books per backup: a page is checked
    at most once per ``_RECHECK_POLLS`` polls (counted alike on every TP rank)."""
    monkeypatch.setattr(tier_mod, "_RECHECK_POLLS", 4)
    cache = _cache(tmp_path / "l3")
    asked: list[int] = []
    contains = cache.l3.backend.contains

    def counted(pool, hashes):
        asked.append(len(hashes))
        return contains(pool, hashes)

    cache.l3.backend.contains = counted
    a = list(range(1000, 1015))
    run_turn(cache, a)
    cache.drain()
    cache.poll()
    run_turn(cache, a + [7, 7, 7, 1, 2, 3, 4])  # a poll later: A's pages were just written
    cache.drain()
    assert asked == [], asked
    for _ in range(4):
        cache.poll()
    run_turn(cache, a + [7, 7, 7, 1, 2, 3, 4, 5, 6, 7, 8])  # four polls on: checked again
    cache.drain()
    assert asked and sum(asked) >= 3, asked
    cache.close()
