"""Faults aimed at V4 sidecar pages: corrupt, absent, vanished after the query, or hung.

A producer writes one conversation (3 pages) of the synthetic V4 model to a per-page file store;
a fresh consumer prefetches the follow-up prompt while one sidecar object misbehaves:

- a KV-anchored page (C4 indexer, C128) bad in the read: the hit stops at the pages before it,
  and of those pages every sidecar arrived (the other sidecars' copies of the bad page that did
  arrive are not grafted);
- an SWA-anchored compressor-state page bad: the KV pages are grafted, but the SWA window is
  void as a whole (no SWA pool and no state of any of its pages is grafted);
- a page absent before the query: the agreed hit is the longest prefix that has every
  KV-anchored page and its SWA window in the store;
- a state read that hangs: the timeout ends the prefetch, and its slots are freed once the read
  returns.

Every step checks the books; what is served is exact (the synthetic model checks it), the rest
is recomputed, in bounded time.
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

import pytest
import torch

from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import StorageConfig
from kvtier.runtime.l3.pools import namespace_for
from kvtier.storage import KeyScope, PrefetchOutcome, page_hashes
from kvtier.storage.file_backend import FilePerPageBackend, FilePerPageConfig
from tests.runtime.l3.helpers import PREFETCH_BOUND_S, prefetch_and_run, prefetch_to_end
from tests.runtime.synthetic_v4 import run_turn, v4_config

REPLICATED = KeyScope(replicated=True)
PAGES = 3


class FaultyStore(FilePerPageBackend):
    """A per-page file store that deletes (``vanish``) or blocks on (``hang``) one object when
    a read reaches it, after the existence query has seen it."""

    def __init__(self, root: Path, victim: str = "", mode: str = "ok") -> None:
        super().__init__(FilePerPageConfig(root=root), scope=REPLICATED)
        self.victim, self.mode = victim, mode
        self.reached = threading.Event()
        self.release = threading.Event()

    def _read(self, object_keys, pages):
        if self.victim in object_keys:
            self.reached.set()
            if self.mode == "vanish":
                os.remove(self._path(self.victim))
            elif self.mode == "hang":
                assert self.release.wait(30), "the test never released the hung read"
        return super()._read(object_keys, pages)


def make_cache(P: int, backend, **kw) -> TieredKVCache:
    st = {"prefetch_min_tokens": 4, "prefetch_policy": "wait_complete", "batch_pages": 2}
    st.update(kw)
    cfg = v4_config(
        P,
        device_pages=8,
        storage=StorageConfig(rank_replicated=True, **st),
        model_id="synthetic-v4-faults",
    )
    return TieredKVCache(cfg, storage_backend=backend)


def produce(root: Path, P: int) -> tuple[list[int], list[str]]:
    """One conversation into the store; returns the follow-up prompt and its page hashes."""
    conv = torch.randint(0, 50, (PAGES * P + 2,), generator=torch.Generator().manual_seed(P))
    conv = conv.tolist()
    cache = make_cache(P, FaultyStore(root))
    run_turn(cache, conv)
    cache.drain()
    cache.check_integrity()
    assert cache.metrics()["tier.backup_failures"] == 0
    hashes = page_hashes(conv, namespace_for(cache.config, None, 1))
    cache.close()
    return conv + [7, 7, 7, 1, 2], hashes


def corrupt(root: Path, key: str) -> None:
    path = root / f"{key}.kvp"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x5A
    path.write_bytes(bytes(data))


def grafted_swa_pages(cache: TieredKVCache) -> int:
    swa = cache.tree.swa.slot
    return sum(
        n.host_value[swa].numel() for n in cache.tree.all_nodes() if n.host_value[swa] is not None
    )


def finish(cache: TieredKVCache) -> None:
    cache.drain()
    cache.check_integrity()
    assert cache.l3.held_by_ops() == {} and cache.l3.inflight_tokens == 0
    cache.close()


@pytest.mark.parametrize("P, pool", [(16, "c4_indexer"), (128, "c128")])
@pytest.mark.parametrize("fault", ["corrupt", "vanish"])
def test_bad_kv_sidecar_page_truncates_to_whole_pages(tmp_path, P, pool, fault):
    prompt, hashes = produce(tmp_path, P)
    victim = 1  # batch 0 holds pages 0 and 1: page 1's other sidecars arrive, and do not count
    key = f"{hashes[victim]}.{pool}"
    if fault == "corrupt":
        corrupt(tmp_path, key)
    backend = FaultyStore(tmp_path, key, "vanish" if fault == "vanish" else "ok")
    cache = make_cache(P, backend)
    start = time.monotonic()
    pf, req = prefetch_and_run(cache, prompt, run_turn)
    assert time.monotonic() - start < PREFETCH_BOUND_S
    assert backend.reached.is_set() or fault == "corrupt"
    assert pf.planned_pages == PAGES and pf.loaded_tokens == victim * P, pf
    want = PrefetchOutcome.CHECKSUM_MISS if fault == "corrupt" else PrefetchOutcome.PARTIAL
    assert pf.outcome is want, pf
    m = cache.metrics()
    assert m["l3.prefetched_tokens"] == victim * P and m["tier.failed_pages.read"] == 1, m
    # The pages before the bad one carry no window of their own: nothing usable is served, and
    # no storage hit is counted (it counted the prefetched tokens before).
    assert req.cached_len == 0 and m["tier.hit_tokens.storage"] == 0, (req, m)
    finish(cache)


@pytest.mark.parametrize("pool", ["c4_state", "c4_indexer_state"])
@pytest.mark.parametrize("fault", ["corrupt", "vanish"])
def test_bad_state_page_voids_the_swa_tail(tmp_path, pool, fault):
    P = 16
    prompt, hashes = produce(tmp_path, P)
    key = f"{hashes[PAGES - 1]}.{pool}"  # the window's page (the window is one page)
    if fault == "corrupt":
        corrupt(tmp_path, key)
    backend = FaultyStore(tmp_path, key, "vanish" if fault == "vanish" else "ok")
    cache = make_cache(P, backend)
    pf = prefetch_to_end(cache, prompt)
    assert pf.loaded_tokens == PAGES * P, pf  # every KV-anchored page arrived and is grafted
    want = PrefetchOutcome.CHECKSUM_MISS if fault == "corrupt" else PrefetchOutcome.PARTIAL
    assert pf.outcome is want, pf
    assert grafted_swa_pages(cache) == 0, "a partial SWA window must not be grafted"
    req = run_turn(cache, prompt)
    assert req.cached_len == 0, req  # no window: recomputed (and checked exact by run_turn)
    finish(cache)


def test_absent_page_before_the_query_shortens_the_agreed_hit(tmp_path):
    P = 16
    prompt, hashes = produce(tmp_path, P)
    os.remove(tmp_path / f"{hashes[2]}.c4.kvp")
    # The longest usable prefix: pages 0..1 need every KV sidecar (there) and the window of
    # page 1 (the SWA pool and both states): usable iff the store holds them.
    window = [f"{hashes[1]}.{p}.kvp" for p in ("swa", "c4_state", "c4_indexer_state")]
    usable = 2 if all((tmp_path / w).exists() for w in window) else 0
    cache = make_cache(P, FaultyStore(tmp_path))
    pf, req = prefetch_and_run(cache, prompt, run_turn)
    assert pf.loaded_tokens == usable * P, (usable, pf)
    assert req.cached_len == usable * P, req
    finish(cache)


def test_hung_state_read_times_out_then_releases(tmp_path):
    P = 16
    prompt, hashes = produce(tmp_path, P)
    backend = FaultyStore(tmp_path, f"{hashes[PAGES - 1]}.c4_state", "hang")
    cache = make_cache(
        P,
        backend,
        prefetch_policy="timeout",
        prefetch_timeout_base_s=0.3,
        prefetch_timeout_per_ki_token_s=0.0,
    )
    pf = prefetch_to_end(cache, prompt)
    assert backend.reached.is_set()
    assert pf.outcome is PrefetchOutcome.TIMED_OUT, pf
    assert grafted_swa_pages(cache) == 0
    # The SWA slots the hung read writes into are still held (draining), not given away.
    assert cache.l3.held_by_ops().get("swa", 0) > 0
    backend.release.set()
    req = run_turn(cache, prompt)
    assert req.cached_len == 0, req
    finish(cache)


def test_abort_mid_read_and_abort_request_release_everything(tmp_path):
    """An aborted prefetch holds its slots until its hung read returns, then frees them; an
    aborted request gives back its slots; the sidecars have nothing of their own to leak."""
    P = 16
    prompt, hashes = produce(tmp_path, P)
    backend = FaultyStore(tmp_path, f"{hashes[0]}.c4_indexer", "hang")
    cache = make_cache(P, backend)
    pf = cache.prefetch(prompt)
    start = time.monotonic()
    while not backend.reached.is_set():  # the IO thread is inside the read
        assert time.monotonic() - start < PREFETCH_BOUND_S, pf
        cache.l3.wait_some(0.05)
        cache.poll()
        cache.check_integrity()
    cache.abort_prefetch(pf)
    assert pf.outcome is PrefetchOutcome.ABORTED and pf.loaded_tokens == 0, pf
    cache.poll()
    cache.check_integrity()
    assert cache.l3.held_by_ops().get("kv", 0) == PAGES * P  # still under the hung read
    backend.release.set()
    cache.drain()
    cache.check_integrity()
    assert cache.l3.held_by_ops() == {}
    req = cache.match(prompt)
    cache.reserve(req, len(prompt) + 4)
    cache.begin_step(req, P)
    cache.abort(req)
    cache.check_integrity()
    assert cache.kv_alloc.used_size() == sum(
        n.value[0].numel() for n in cache.tree.all_nodes() if n.value[0] is not None
    )
    finish(cache)
