"""L3 round trips through the host layouts whose page objects are built differently.

``page_first`` (covered by ``test_l3.py``) reads and writes each page in place; ``layer_first``
packs and unpacks pages through a staging buffer; ``page_first_direct`` keeps each layer's block
of a page together. For each, a spawned producer writes a FULL+SWA+MAMBA model's conversations
to a file store and a fresh consumer prefetches and reproduces every reused byte exactly.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig, StorageConfig
from kvtier.storage import PrefetchOutcome, create_backend
from tests.runtime.l3.helpers import (
    PROMPT_TOKENS,
    conversations,
    prefetch_and_run,
    produce,
    second_turn,
)
from tests.runtime.synthetic import MODELS, SPEC, P

SEED = 31
LAYOUTS = ["layer_first", "page_first_direct"]


def make_cache(layout: str, backend) -> TieredKVCache:
    # Two pages per backend call: reads and writes span several staging batches.
    st = StorageConfig(prefetch_min_tokens=4, prefetch_policy="wait_complete", batch_pages=2)
    cfg = CacheConfig(
        layer_kinds=MODELS["full+swa+mamba"],
        kv_heads=1,
        head_dim=4,
        page_size=P,
        device_tokens=96,
        dtype=torch.float32,
        swa_window=8,
        mamba=SPEC,
        mamba_slots=8,
        host_ratio=4.0,
        host_layout=layout,
        model_id="synthetic-layouts",
        storage=st,
    )
    return TieredKVCache(cfg, storage_backend=backend)


def _producer(root: str) -> None:
    backend = create_backend("file", root=root)
    caches = []
    for layout in LAYOUTS:
        cache = make_cache(layout, backend)
        produce(cache, conversations(SEED))
        m = cache.metrics()
        assert m["tier.backup_failures"] == 0 and m["tier.bytes.storage.write"] > 0, m
        cache.close()
        caches.append(cache)
    backend.close()


@pytest.fixture(scope="module")
def produced(tmp_path_factory) -> str:
    root = str(tmp_path_factory.mktemp("l3_layouts"))
    proc = multiprocessing.get_context("spawn").Process(target=_producer, args=(root,))
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0, f"producer process exited with {proc.exitcode}"
    return root


@pytest.mark.timeout(180)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_producer_consumer(produced, layout):
    backend = create_backend("file", root=produced)
    cache = make_cache(layout, backend)
    for conv in conversations(SEED):
        pf, req = prefetch_and_run(cache, second_turn(conv))
        assert pf.outcome is PrefetchOutcome.COMPLETE, (layout, pf)
        assert req.device_hit == 0 and req.host_hit == PROMPT_TOKENS, (layout, req)
    cache.drain()
    cache.check_integrity()
    assert cache.metrics()["tier.hit_tokens.storage"] == 3 * PROMPT_TOKENS
    cache.close()
    backend.close()
