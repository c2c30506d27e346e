"""The example model through L3: what one process wrote, a fresh process reuses, bit for bit.

Process A (spawned) runs the first turn of some conversations with ``CachedRunner`` over a cache
whose L3 is a file store, and waits until its pages are there. Process B (this one) builds a
fresh cache on the same store and namespace, prefetches each second-turn prompt, and generates:
its greedy tokens and logits must equal a cold run's exactly, with the prefix served from L3.
"""

from __future__ import annotations

import multiprocessing
import time

import pytest

from kvtier.example import HybridModel, HybridModelConfig
from kvtier.example.runner import CachedRunner
from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig, StorageConfig
from kvtier.storage import PrefetchOutcome
from tests.example.helpers import assert_equal, tokens

P = 8
ANSWER = 3
PROMPT = 27  # turn 1; with the answer fed back, 29 tokens are cached: 3 whole pages
CONVERSATIONS = 2
PREFETCH_BOUND_S = 10.0
MODELS = {
    "full+swa+mamba": HybridModelConfig(),  # the default layer kinds
    "full": HybridModelConfig(layer_kinds=("full", "full")),
}


def make_cache(name: str, root: str) -> TieredKVCache:
    mc = MODELS[name]
    has = set(mc.layer_kinds)
    cfg = CacheConfig(
        layer_kinds=mc.layer_kinds,
        kv_heads=mc.kv_heads,
        head_dim=mc.head_dim,
        page_size=P,
        device_tokens=128,
        dtype=mc.dtype,
        swa_window=mc.swa_window if "swa" in has else None,
        mamba=mc.mamba_spec() if "mamba" in has else None,
        mamba_slots=4 if "mamba" in has else None,
        host_ratio=4.0,
        model_id=f"example-{name}",
        storage=StorageConfig(
            backend_config={"root": root}, prefetch_min_tokens=P, prefetch_policy="wait_complete"
        ),
    )
    return TieredKVCache(cfg)


def first_turns(name: str) -> list[list[int]]:
    vocab = MODELS[name].vocab
    return [tokens(PROMPT, vocab, seed=100 + i) for i in range(CONVERSATIONS)]


def _producer(root: str) -> None:
    for name, mc in MODELS.items():
        cache = make_cache(name, root)
        runner = CachedRunner(HybridModel(mc), cache)
        for prompt in first_turns(name):
            runner.generate(prompt, ANSWER)
        cache.drain()
        cache.check_integrity()
        m = cache.metrics()
        assert m["tier.backup_failures"] == 0 and m["tier.bytes.storage.write"] > 0, (name, m)
        cache.close()


@pytest.mark.timeout(120)
def test_fresh_process_reuses_l3_exactly(tmp_path):
    root = str(tmp_path / "l3")
    proc = multiprocessing.get_context("spawn").Process(target=_producer, args=(root,))
    proc.start()
    proc.join(90)
    assert proc.exitcode == 0, f"producer process exited with {proc.exitcode}"
    for name, mc in MODELS.items():
        model = HybridModel(mc)
        cache = make_cache(name, root)
        runner = CachedRunner(model, cache)
        for i, first in enumerate(first_turns(name)):
            # Process A's answer is the cold answer: the model is exact under caching.
            prompt = first + model.generate_cold(first, ANSWER).tokens + tokens(5, mc.vocab, i)
            pf = cache.prefetch(prompt)
            assert pf is not None, f"{name}: prefetch not started"
            start = time.monotonic()
            while not pf.done:
                assert time.monotonic() - start < PREFETCH_BOUND_S, f"{name}: stuck {pf}"
                cache.l3.wait_some(0.05)
                cache.poll()
                cache.check_integrity()
            assert pf.outcome is PrefetchOutcome.COMPLETE, (name, pf)
            got = runner.generate(prompt, ANSWER)
            req = runner.last_request
            cached = (PROMPT + ANSWER - 1) // P * P
            assert req.device_hit == 0 and req.host_hit == cached, (name, req)
            cold = model.generate_cold(prompt, ANSWER)
            assert got.tokens == cold.tokens, (name, got.tokens, cold.tokens)
            assert_equal(f"{name} logits", cold.logits, got.logits)
            cache.check_integrity()
        cache.drain()
        cache.check_integrity()
        m = cache.metrics()
        assert m["tier.hit_tokens.storage"] == CONVERSATIONS * cached, (name, m)
        cache.close()
