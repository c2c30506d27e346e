"""Storage events of caches whose FULL page lives in several L3 pools (a DeepSeek-V4-like cache:
a logical FULL pool with no bytes, and KV-anchored sidecars): a page is on storage once every
one of those pools was written for it."""

from __future__ import annotations

import random
from collections import Counter

from kvtier.events import MEDIUM_STORAGE, wire
from kvtier.events.mirror import REMOVED, STORED, Mirror
from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import StorageConfig
from kvtier.storage import page_hashes
from tests.events.common import check_index, converge, key_namespace_of, loopback, subscribe, synced
from tests.runtime.l3.helpers import conversations
from tests.runtime.synthetic_v4 import run_turn, v4_config

P = 4  # one C4 group per page


def _storage(root: str) -> StorageConfig:
    return StorageConfig(
        backend="file",
        backend_config={"root": root},
        prefetch_min_tokens=4,
        prefetch_policy="wait_complete",
    )


def _v4_cache(storage: StorageConfig | None, policy: str = "write_through") -> TieredKVCache:
    cfg = v4_config(
        P, policy=policy, device_pages=8, host_ratio=2.0, storage=storage, model_id="v4-events"
    )
    return TieredKVCache(cfg, events=loopback())


def _steps(cache, ix, seen: set[bytes], seed: int, steps: int) -> None:
    """Random turns of a few conversations; the index is checked after every step."""
    rnd = random.Random(seed)
    convs = conversations(seed, n=4)
    for _ in range(steps):
        prompt = rnd.choice(convs)[: rnd.choice((8, 12, 20))]
        hs = page_hashes(prompt, key_namespace_of(cache, None))
        seen.update(bytes.fromhex(h) for h in hs)
        run_turn(cache, prompt)
        synced(cache, ix)
        check_index(cache, ix, seen)


def test_v4_storage_index_equals_exists_every_step(tmp_path):
    cache = _v4_cache(_storage(str(tmp_path / "l3")))
    ix = subscribe(cache)
    inst = cache.events.instance_id
    seen: set[bytes] = set()
    try:
        assert "kv" not in cache.l3.kv_group and len(cache.l3.kv_group) >= 2
        converge(cache, ix)
        _steps(cache, ix, seen, seed=21, steps=16)
        cache.drain()
        synced(cache, ix)
        check_index(cache, ix, seen)
        assert not cache.l3.outstanding
        stored = ix.held(inst, MEDIUM_STORAGE)
        assert stored, "the V4 cache wrote pages to L3 and published none"
        # Nothing in flight now: published exactly what every FULL pool holds.
        assert not cache.events.counters["storage_unknown_pages"]
    finally:
        cache.close()
        ix.close()


def _chunk(hashes: list[str]) -> tuple:
    return (hashes, 0, None, list(range(P * len(hashes))), None)


def _host_pages(n: int) -> tuple[Counter[str], Mirror, list[bytes], list[str]]:
    """A mirror whose host holds one chunk of ``n`` pages: counters, mirror, hashes, hexes."""
    counters: Counter[str] = Counter()
    mirror = Mirror(P, counters)
    hs = [bytes([i]) * 32 for i in range(n)]
    hexes = [h.hex() for h in hs]
    mirror.apply([(STORED, "CPU", [_chunk(hexes)])], None, None)
    return counters, mirror, hs, hexes


def test_a_page_is_stored_once_every_pool_of_its_group_was_written():
    """Written over two jobs (one pool each): stored after the second only; pools outside the
    group (SWA, Mamba) never make a page stored."""
    counters, mirror, hs, hexes = _host_pages(3)
    group = ("c4", "c4_indexer")
    out = mirror.events()
    mirror.apply(None, [(group, [("c4", hexes[0]), ("c4", hexes[1]), ("swa", hexes[2])])], out)
    assert not out.events and not mirror.held[MEDIUM_STORAGE]
    assert set(mirror.partial) == {hexes[0], hexes[1]}
    out = mirror.events()
    mirror.apply(None, [(group, [("c4_indexer", hexes[1]), ("mamba", hexes[0])])], out)
    assert set(mirror.held[MEDIUM_STORAGE]) == {hexes[1]}
    [ev] = out.events
    assert isinstance(ev, wire.BlockStored) and ev.block_hashes == [hs[1]]
    assert ev.parent_block_hash == hs[0] and ev.token_ids == list(range(P, 2 * P))
    assert counters[f"stored_pages.{MEDIUM_STORAGE}"] == 1
    # A page that leaves every medium forgets what was written of it.
    mirror.apply([(1, "CPU", [hexes[0]])], None, None)
    assert set(mirror.partial) == set()


def test_v4_storage_attached_at_run_time_reports_its_pool_group(tmp_path):
    """The pools of a FULL page come with the tier attached at run time."""
    cache = _v4_cache(None)
    ix = subscribe(cache)
    inst = cache.events.instance_id
    seen: set[bytes] = set()
    try:
        converge(cache, ix)
        _steps(cache, ix, seen, seed=22, steps=2)
        change = cache.attach_storage(_storage(str(tmp_path / "l3")))
        for _ in range(100):  # a single rank: the attach is applied at the next poll
            if change.done:
                break
            cache.poll()
        assert change.done and cache.l3 is not None
        converge(cache, ix)
        _steps(cache, ix, seen, seed=23, steps=6)
        cache.drain()
        synced(cache, ix)
        check_index(cache, ix, seen)
        assert ix.held(inst, MEDIUM_STORAGE)
    finally:
        cache.close()
        ix.close()


def test_a_page_written_to_l3_in_the_step_that_evicts_it_is_published_stored():
    """The step that acknowledges a page's L3 write also evicts it from the host (its pin
    released at that acknowledgement): storage holds it, so it is published stored after its
    host removal (it was counted unknown and never published); a page of two pools completes
    alike, and one written nowhere whole is forgotten once no medium holds it."""
    counters, mirror, hs, hexes = _host_pages(3)
    group = ("c4", "c4_indexer")
    mirror.apply(None, [(group, [("c4", hexes[1]), ("c4", hexes[2])])], mirror.events())
    out = mirror.events()
    mirror.apply(
        [(REMOVED, "CPU", list(hexes))],
        [(("kv",), [("kv", hexes[0])]), (group, [("c4_indexer", hexes[1])])],
        out,
    )
    removed, stored = out.events  # the two pages in one event: the second continues the first
    assert isinstance(removed, wire.BlockRemoved) and set(removed.block_hashes) == set(hs)
    assert isinstance(stored, wire.BlockStored) and stored.medium == MEDIUM_STORAGE
    assert stored.block_hashes == hs[:2] and stored.token_ids == list(range(2 * P))
    assert set(mirror.held[MEDIUM_STORAGE]) == {hexes[0], hexes[1]}
    assert not mirror.held["CPU"] and not counters["storage_unknown_pages"]
    assert set(mirror.partial) == set(), "page 2 (one pool of two written) held nowhere now"
