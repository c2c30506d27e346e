"""DeepSeek-V4-like caches through L3: a producer process writes, a fresh consumer reads exact.

Process A (spawned) runs turn 1 of some conversations through a V4-like cache (logical FULL pool,
SWA layers, KV-anchored C4/C4-indexer/C128 sidecars, SWA-anchored compressor states) and waits
until its backups reached L3. A consumer in this process, with an empty tree, prefetches each
follow-up prompt and runs it: every reused SWA row of the window and every reused sidecar entry
must hold what a cold run writes, under every host layout and page sizes 16, 64 and 256.
The logical FULL pool writes nothing to L3: a page is its sidecars, plus the SWA window.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import StorageConfig
from kvtier.storage import PrefetchOutcome
from tests.runtime.l3.helpers import prefetch_and_run
from tests.runtime.synthetic_v4 import run_turn, v4_config

SEED = 47
N_CONVS = 2
LAYOUTS = ["page_first", "layer_first", "page_first_direct"]
PAGE_SIZES = [16, 64, 256]


def storage(kind: str, where: str, **kw) -> StorageConfig:
    if kind == "file":
        where_cfg = {"root": where}
    else:  # the fixture's segment holder keeps the objects: writers lend no memory
        where_cfg = {"master_address": where, "global_segment_size": 0}
    st = {"prefetch_min_tokens": 4, "prefetch_policy": "wait_complete", "batch_pages": 2}
    st.update(kw)
    return StorageConfig(backend=kind, backend_config=where_cfg, **st)


def make_v4_l3_cache(
    kind: str, where: str, P: int, layout: str = "page_first", tp_group=None, **kw
) -> TieredKVCache:
    cfg = v4_config(
        P, layout, device_pages=8, storage=storage(kind, where, **kw), model_id="synthetic-v4"
    )
    return TieredKVCache(cfg, tp_group=tp_group)


def conversations(P: int, seed: int = SEED, n: int = N_CONVS) -> list[list[int]]:
    """Prompts of 3 pages and a bit: the follow-up turn reuses 3 whole pages."""
    gen = torch.Generator().manual_seed(seed + P)
    return [torch.randint(0, 50, (3 * P + 2,), generator=gen).tolist() for _ in range(n)]


def second_turn(conv: list[int]) -> list[int]:
    return conv + [7, 7, 7] + [1, 2]


def _producer(kind: str, where: str, shapes: list[tuple[int, str]]) -> None:
    for P, layout in shapes:
        cache = make_v4_l3_cache(kind, where, P, layout)
        for conv in conversations(P):
            run_turn(cache, conv)
        cache.drain()
        cache.check_integrity()
        m = cache.metrics()
        assert m["tier.backup_failures"] == 0 and m["tier.bytes.storage.write"] > 0, m
        assert "kv" not in cache.l3.pools, "a logical FULL pool has no L3 objects"
        cache.close()


def run_producer(kind: str, where: str, shapes: list[tuple[int, str]]) -> None:
    ctx = multiprocessing.get_context("spawn")
    proc = ctx.Process(target=_producer, args=(kind, where, shapes))
    proc.start()
    proc.join(240)
    assert proc.exitcode == 0, f"producer process exited with {proc.exitcode}"


def consume(kind: str, where: str, P: int, layout: str) -> None:
    cache = make_v4_l3_cache(kind, where, P, layout)
    pools = sorted(cache.l3.pools)
    assert pools == sorted(["swa", *cache.sidecar_pools]), pools
    for conv in conversations(P):
        pf, req = prefetch_and_run(cache, second_turn(conv), run_turn)
        assert pf.outcome is PrefetchOutcome.COMPLETE, (P, layout, pf)
        assert req.device_hit == 0 and req.host_hit == 3 * P, (P, layout, req)
    cache.drain()
    cache.check_integrity()
    m = cache.metrics()
    assert m["tier.hit_tokens.storage"] == N_CONVS * 3 * P, (P, layout, m)
    # Read: every KV-anchored sidecar page of the prompt, and the window's SWA pages.
    kv_pages = sum(
        cache.l3.pools[s.name].page_bytes for s in cache.config.all_sidecars if s.anchor == "kv"
    )
    swa_pages = sum(cache.l3.pools[n].page_bytes for n in cache.l3.swa_group)
    assert m["tier.bytes.storage.read"] == N_CONVS * (3 * kv_pages + swa_pages), m
    cache.close()


@pytest.mark.timeout(300)
def test_v4_producer_consumer_file(tmp_path):
    shapes = [(P, layout) for P in PAGE_SIZES for layout in LAYOUTS]
    run_producer("file", str(tmp_path), shapes)
    for P, layout in shapes:
        consume("file", str(tmp_path), P, layout)


@pytest.mark.timeout(180)
def test_v4_producer_consumer_mooncake(segment_holder):
    shapes = [(16, "page_first"), (256, "layer_first")]
    run_producer("mooncake", segment_holder, shapes)
    for P, layout in shapes:
        consume("mooncake", segment_holder, P, layout)
