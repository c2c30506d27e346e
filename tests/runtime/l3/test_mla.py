"""L3 for MLA + DSA indexer caches: a producer process writes, a fresh consumer reads back exact.

Process A (spawned) runs turn 1 of some conversations through an MLA cache with the indexer
sidecar and waits until its backups reached L3. A consumer in this process, with an empty tree
and the same namespace, prefetches each follow-up prompt and runs it: every reused latent and
every reused indexer page must hold what a cold run writes. MLA pages are rank-replicated: they
are stored under rank-free keys, the indexer under its own pool suffix.
"""

from __future__ import annotations

import multiprocessing
import os

import pytest

from kvtier.runtime.cache import TieredKVCache
from kvtier.storage import KeyScope, PoolTransfer, PrefetchOutcome, create_backend
from tests.runtime.l3.helpers import (
    PROMPT_TOKENS,
    conversations,
    make_mla_l3_cache,
    prefetch_and_run,
    second_turn,
)
from tests.runtime.synthetic_mla import P, run_turn

SEED = 23
REPLICATED = KeyScope(replicated=True)


def _backend(kind: str, where: str):
    if kind in ("file", "file_per_page"):  # file_per_page: one file per object, for tests that
        return create_backend(kind, root=where, scope=REPLICATED)  # delete single objects
    return create_backend("mooncake", master_address=where, global_segment_size=0, scope=REPLICATED)


def _producer(kind: str, where: str, layouts: list[str]) -> None:
    backend = _backend(kind, where)
    caches = []  # kept alive: a freed host pool's address may come back, already registered
    for layout in layouts:
        cache = make_mla_l3_cache(backend, layout, batch_pages=2)
        for conv in conversations(SEED):
            run_turn(cache, conv)
        cache.drain()
        cache.check_integrity()
        m = cache.metrics()
        assert m["tier.backup_failures"] == 0 and m["tier.bytes.storage.write"] > 0, m
        cache.close()
        caches.append(cache)
    backend.close()


def run_producer(kind: str, where: str, layouts: list[str]) -> None:
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_producer, args=(kind, where, layouts))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0, f"producer process exited with {proc.exitcode}"


def consume(backend, layout: str) -> TieredKVCache:
    """A fresh cache that prefetches and runs every follow-up prompt exactly."""
    # several KV + indexer batches per read
    cache = make_mla_l3_cache(backend, layout, batch_pages=2)
    for conv in conversations(SEED):
        pf, req = prefetch_and_run(cache, second_turn(conv), run_turn)
        assert pf.outcome is PrefetchOutcome.COMPLETE, (layout, pf)
        assert req.device_hit == 0 and req.host_hit == PROMPT_TOKENS, (layout, req)
    cache.drain()
    cache.check_integrity()
    m = cache.metrics()
    assert m["tier.hit_tokens.storage"] == 3 * PROMPT_TOKENS, (layout, m)
    kv_page, idx_page = (cache.l3.pools[n].page_bytes for n in ("kv", "indexer"))
    pages = 3 * PROMPT_TOKENS // P
    assert m["tier.bytes.storage.read"] >= pages * (kv_page + idx_page), m
    return cache


@pytest.mark.timeout(180)
def test_mla_indexer_producer_consumer(l3_location):
    kind, where = l3_location
    # On the file store, every host layout: layer_first packs the indexer through staging too.
    layouts = (
        ["page_first", "layer_first", "page_first_direct"] if kind == "file" else ["page_first"]
    )
    run_producer(kind, where, layouts)
    if kind == "file":
        pools = sorted({k.split(".", 1)[1] for k in _backend(kind, where).object_keys()})
        assert pools == ["indexer", "kv"], f"MLA pages must have rank-free keys: {pools}"
    backend = _backend(kind, where)
    try:
        for layout in layouts:
            consume(backend, layout).close()
    finally:
        backend.close()


@pytest.mark.parametrize("kind", ["file", "file_per_page"])
def test_missing_indexer_pages_are_a_miss(tmp_path, kind):
    """KV pages without their indexer pages are no hit: the indexer moves with KV or not at all.
    The segment store's indexer pages are deleted through its API (they share segment files
    with KV pages); the per-page store's files are removed from the root."""
    run_producer(kind, str(tmp_path), ["page_first"])
    if kind == "file":
        store = _backend(kind, str(tmp_path))
        hashes = [k.split(".")[0] for k in store.object_keys() if k.split(".")[1] == "indexer"]
        assert hashes and all(store.delete([PoolTransfer("indexer", hashes)]).ok["indexer"])
        assert not any(k.split(".")[1] == "indexer" for k in store.object_keys())
        store.close()
    else:
        for name in os.listdir(tmp_path):
            if name.split(".")[1] == "indexer":
                os.remove(tmp_path / name)
    backend = _backend(kind, str(tmp_path))
    cache = make_mla_l3_cache(backend)
    pf, req = prefetch_and_run(cache, second_turn(conversations(SEED)[0]), run_turn)
    assert pf.outcome is PrefetchOutcome.REVOKED and pf.reason == "below_threshold", pf
    assert req.cached_len == 0
    cache.check_integrity()
    cache.close()


def test_given_backend_needs_the_cache_key_scope(tmp_path):
    with pytest.raises(ValueError, match="storage_backend: its key scope"):
        make_mla_l3_cache(create_backend("file", root=tmp_path))
