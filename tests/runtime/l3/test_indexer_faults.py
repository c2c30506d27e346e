"""Faults aimed at DSA indexer reads: a partial indexer batch.

Every KV page of the prefix is in L3 and arrives, but one indexer page of a batch does not: it
fails its checksum, or its file vanished between the existence query and the read (another
process evicted it). A page counts only when both its KV and its indexer parts arrived, so the
prefetch hands over exactly the pages before the bad one; the KV page that did arrive without
its indexer page is not grafted. The tree stays intact at every step, the request reuses exact
bytes for the counted pages and recomputes the rest, all in bounded time.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from kvtier.runtime.l3.pools import namespace_for
from kvtier.storage import KeyScope, PrefetchOutcome, page_hashes

# The per-page store: these faults delete or damage one page object's own file.
from kvtier.storage.file_backend import FilePerPageBackend as FileBackend
from kvtier.storage.file_backend import FilePerPageConfig as FileBackendConfig
from tests.runtime.l3.helpers import (
    PREFETCH_BOUND_S,
    PROMPT_TOKENS,
    conversations,
    make_mla_l3_cache,
    prefetch_and_run,
    second_turn,
)
from tests.runtime.synthetic_mla import P, run_turn

BATCH = 2  # pages per backend call: the prefix of 5 pages takes 3 KV + indexer batches
PAGES = PROMPT_TOKENS // P
REPLICATED = KeyScope(replicated=True)


class VanishingBackend(FileBackend):
    """Deletes one object's file just before the batch that reads it (after the query)."""

    def __init__(self, root: Path, victim: str) -> None:
        super().__init__(FileBackendConfig(root=root), scope=REPLICATED)
        self.victim = victim
        self.vanished = False

    def _read(self, object_keys, pages):
        if self.victim in object_keys:
            os.remove(self._path(self.victim))
            self.vanished = True
        return super()._read(object_keys, pages)


def produce(root: Path) -> tuple[list[int], list[str]]:
    """Turn 1 of one conversation into a file L3; returns it and its page hashes."""
    conv = conversations(29, n=1)[0]
    backend = FileBackend(FileBackendConfig(root=root), scope=REPLICATED)
    cache = make_mla_l3_cache(backend, batch_pages=BATCH)
    run_turn(cache, conv)
    cache.drain()
    cache.check_integrity()
    assert cache.metrics()["tier.backup_failures"] == 0
    ns = namespace_for(cache.config, None, 1)
    cache.close()
    return conv, page_hashes(conv, ns)


@pytest.mark.parametrize("victim", [0, 2, 3])
@pytest.mark.parametrize("fault", ["corrupt", "vanished"])
def test_partial_indexer_batch_counts_only_whole_pages(tmp_path, fault, victim):
    conv, hashes = produce(tmp_path)
    key = f"{hashes[victim]}.indexer"
    assert (tmp_path / f"{hashes[victim]}.kv.kvp").exists()
    if fault == "corrupt":
        path = tmp_path / f"{key}.kvp"
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x5A
        path.write_bytes(bytes(data))
        backend = FileBackend(FileBackendConfig(root=tmp_path), scope=REPLICATED)
    else:
        backend = VanishingBackend(tmp_path, key)
    cache = make_mla_l3_cache(backend, batch_pages=BATCH)
    kv_page, idx_page = (cache.l3.pools[n].page_bytes for n in ("kv", "indexer"))

    start = time.monotonic()
    pf, req = prefetch_and_run(cache, second_turn(conv), run_turn)
    assert time.monotonic() - start < PREFETCH_BOUND_S
    if fault == "vanished":
        assert backend.vanished, "the victim was never read"

    # Only the pages before the victim count, though the victim's KV page arrived.
    assert pf.planned_pages == PAGES, pf
    assert pf.loaded_tokens == victim * P, pf
    m = cache.metrics()
    assert m["tier.hit_tokens.storage"] == victim * P, m
    # Every KV page of the batches read arrived, and every indexer page of them but the victim
    # (one after it in the same batch arrives too, and still does not count).
    kv_read = min(PAGES, (victim // BATCH + 1) * BATCH)
    assert m["tier.bytes.storage.read"] == kv_read * kv_page + (kv_read - 1) * idx_page, m
    assert m["tier.failed_pages.read"] == 1, m
    if fault == "corrupt":
        assert pf.outcome is PrefetchOutcome.CHECKSUM_MISS, pf
        assert m["tier.checksum_miss_pages"] == 1 and m["tier.prefetch.checksum_miss"] == 1, m
    else:
        assert pf.outcome is PrefetchOutcome.PARTIAL, pf
        assert m["tier.checksum_miss_pages"] == 0, m

    # The request reuses the counted pages (run_turn checks their latents and indexer bytes
    # against a cold run) and recomputes the rest.
    assert req.device_hit == 0 and req.host_hit == victim * P and req.cached_len == victim * P, req
    cache.drain()
    cache.check_integrity()
    assert cache.l3.held_by_ops() == {} and cache.l3.inflight_tokens == 0
    cache.close()

    # The bad object was dropped, never served; the recompute's backup wrote it anew, so a fresh
    # consumer gets the whole prompt (and the generated page) back.
    fresh = make_mla_l3_cache(
        FileBackend(FileBackendConfig(root=tmp_path), scope=REPLICATED), batch_pages=BATCH
    )
    pf, req = prefetch_and_run(fresh, second_turn(conv), run_turn)
    assert pf.outcome is PrefetchOutcome.COMPLETE and pf.loaded_tokens == PAGES * P + P, pf
    assert req.host_hit == PAGES * P + P, req
    fresh.drain()
    fresh.check_integrity()
    fresh.close()
