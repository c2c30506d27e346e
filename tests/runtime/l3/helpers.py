"""Shared pieces of the L3 tests: caches with storage, producer runs, prefetch-then-match.

Plain functions (not fixtures): spawned producers and TP ranks call them too.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig, StorageConfig
from kvtier.storage import StorageBackend
from tests.runtime import synthetic_mla
from tests.runtime.synthetic import MODELS, SPEC, P, run_turn

PROMPT_TOKENS = 20
PREFETCH_BOUND_S = 10.0


def make_l3_cache(
    model: str,
    backend: StorageBackend | None = None,
    *,
    model_id: str | None = None,
    page_size: int = P,
    dtype: torch.dtype = torch.float32,
    tp_group=None,
    **storage,
) -> TieredKVCache:
    kinds = MODELS[model]
    st = {"prefetch_min_tokens": 4, "prefetch_policy": "wait_complete"}
    st.update(storage)
    cfg = CacheConfig(
        layer_kinds=kinds,
        kv_heads=1,
        head_dim=4,
        page_size=page_size,
        device_tokens=96,
        dtype=dtype,
        swa_window=8 if "swa" in kinds else None,
        mamba=SPEC if "mamba" in kinds else None,
        mamba_slots=8 if "mamba" in kinds else None,
        host_ratio=4.0,
        write_policy="write_through",
        model_id=model_id or f"synthetic-{model}",
        storage=StorageConfig(**st),
    )
    return TieredKVCache(cfg, tp_group=tp_group, storage_backend=backend)


def make_mla_l3_cache(
    backend: StorageBackend, layout: str = "page_first", batch_pages: int = 128
) -> TieredKVCache:
    """An MLA + indexer cache of the synthetic MLA model over ``backend``."""
    st = StorageConfig(
        prefetch_min_tokens=4, prefetch_policy="wait_complete", batch_pages=batch_pages
    )
    cfg = synthetic_mla.mla_config(
        layout=layout, device_tokens=96, host_ratio=4.0, storage=st, model_id="synthetic-mla"
    )
    return TieredKVCache(cfg, storage_backend=backend)


def conversations(seed: int, n: int = 3) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (PROMPT_TOKENS,), generator=gen).tolist() for _ in range(n)]


def second_turn(conv: list[int]) -> list[int]:
    """The follow-up prompt: turn 1, the 7s the synthetic model generated, then new tokens."""
    return conv + [7, 7, 7] + [1, 2]


def produce(cache: TieredKVCache, convs: list[list[int]]) -> None:
    """Run turn 1 of each conversation and wait until it is in L3."""
    for c in convs:
        run_turn(cache, c)
    cache.drain()
    cache.check_integrity()


def prefetch_to_end(cache: TieredKVCache, prompt: list[int]):
    """Prefetch ``prompt`` to the end (bounded), checking the books after every step."""
    pf = cache.prefetch(prompt)
    start = time.monotonic()
    while pf is not None and not pf.done:
        assert time.monotonic() - start < PREFETCH_BOUND_S, f"prefetch stuck: {pf}"
        cache.l3.wait_some(0.05)
        cache.poll()
        cache.check_integrity()
    return pf


def prefetch_and_run(cache: TieredKVCache, prompt: list[int], run: Callable = run_turn):
    """Prefetch ``prompt``, stepping until done (bounded), then run it; returns (prefetch, req).

    ``run`` is the synthetic model's ``run_turn`` (``synthetic_mla.run_turn`` for MLA caches):
    it checks that every reused position holds what a cold run writes.
    """
    pf = prefetch_to_end(cache, prompt)
    req = run(cache, prompt)
    cache.check_integrity()
    return pf, req
