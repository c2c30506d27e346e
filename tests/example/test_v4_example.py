"""The V4-like example model through every tier: generation equals a cold run, bit for bit.

The model (``kvtier.example.v4``) compresses groups of 4 and of 128 tokens into sidecar entries,
keeps its compressor state for the incomplete group in SWA-anchored sidecars, and attends over
the compressed entries plus a sliding window; the cache's FULL pool is logical. Its greedy
tokens and logits through ``CachedRunner`` must equal a cold run's with device hits, host hits
(every host layout) and L3 hits, where a spawned producer writes a file store or Mooncake and a
fresh consumer in this process reads it back.
"""

from __future__ import annotations

import multiprocessing
import time

import pytest

from kvtier.example.runner import CachedRunner
from kvtier.example.v4 import V4Model, V4ModelConfig
from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import StorageConfig
from kvtier.storage import PrefetchOutcome
from tests.example.helpers import assert_equal, tokens

ANSWER = 3
PREFETCH_BOUND_S = 20.0
SHAPE = dict(hidden=32, q_heads=2, kv_heads=1, head_dim=8, ffn=64, vocab=128)
MODELS = {
    # C4 layers (with indexer) and a window-only layer, on small pages.
    16: V4ModelConfig(compress_ratios=(4, 0, 4), swa_window=8, seed=3, **SHAPE),
    # C4 and C128 layers: a page holds one C128 group.
    128: V4ModelConfig(
        compress_ratios=(4, 128), layer_kinds=("swa", "swa"), swa_window=16, **SHAPE
    ),
}


def make_cache(P: int, layout: str = "page_first", storage: StorageConfig | None = None):
    cfg = MODELS[P].cache_config(
        P,
        device_tokens=5 * P,
        host_ratio=4.0,
        host_layout=layout,
        storage=storage,
        model_id=f"example-v4-{P}" if storage is not None else "",
    )
    return TieredKVCache(cfg)


def first_turn(P: int, seed: int) -> list[int]:
    return tokens(2 * P + P // 2, MODELS[P].vocab, seed=seed)


def check(model: V4Model, runner: CachedRunner, prompt: list[int]) -> None:
    got = runner.generate(prompt, ANSWER)
    cold = model.generate_cold(prompt, ANSWER)
    assert got.tokens == cold.tokens, (got.tokens, cold.tokens)
    assert_equal("logits", cold.logits, got.logits)
    runner.cache.check_integrity()


@pytest.mark.parametrize("layout", ["page_first", "layer_first", "page_first_direct"])
@pytest.mark.parametrize("P", [16, 128])
def test_device_and_host_hits_equal_a_cold_run(P, layout):
    model = V4Model(MODELS[P])
    cache = make_cache(P, layout)
    runner = CachedRunner(model, cache)
    first = first_turn(P, seed=1)
    check(model, runner, first)
    follow = first + runner.generate(first, ANSWER).tokens + tokens(5, model.config.vocab, 2)
    check(model, runner, follow)
    assert runner.last_request.device_hit == 2 * P, runner.last_request
    for seed in (3, 4):  # the device holds 5 pages: the first conversation leaves it
        check(model, runner, first_turn(P, seed))
    cache.drain()
    cache.evict(cache.config.device_tokens)
    cache.check_integrity()
    check(model, runner, follow + [5])
    req = runner.last_request
    assert req.device_hit == 0 and req.host_hit >= 2 * P, req
    cache.drain()
    cache.check_integrity()


def _storage(kind: str, where: str) -> StorageConfig:
    cfg = {"root": where} if kind == "file" else {"master_address": where, "global_segment_size": 0}
    return StorageConfig(
        backend=kind,
        backend_config=cfg,
        rank_replicated=True,
        prefetch_min_tokens=4,
        prefetch_policy="wait_complete",
    )


def _producer(kind: str, where: str, sizes: list[int]) -> None:
    for P in sizes:
        cache = make_cache(P, storage=_storage(kind, where))
        runner = CachedRunner(V4Model(MODELS[P]), cache)
        runner.generate(first_turn(P, seed=10), ANSWER)
        cache.drain()
        cache.check_integrity()
        m = cache.metrics()
        assert m["tier.backup_failures"] == 0 and m["tier.bytes.storage.write"] > 0, m
        cache.close()


def _consume(kind: str, where: str, P: int) -> None:
    model = V4Model(MODELS[P])
    cache = make_cache(P, storage=_storage(kind, where))
    runner = CachedRunner(model, cache)
    first = first_turn(P, seed=10)
    # The producer's answer is the cold answer: the model is exact under caching.
    prompt = first + model.generate_cold(first, ANSWER).tokens + tokens(5, model.config.vocab, 11)
    pf = cache.prefetch(prompt)
    assert pf is not None, "prefetch not started"
    start = time.monotonic()
    while not pf.done:
        assert time.monotonic() - start < PREFETCH_BOUND_S, f"stuck {pf}"
        cache.l3.wait_some(0.05)
        cache.poll()
        cache.check_integrity()
    assert pf.outcome is PrefetchOutcome.COMPLETE, pf
    check(model, runner, prompt)
    req = runner.last_request
    cached = (len(first) + ANSWER - 1) // P * P
    assert req.device_hit == 0 and req.host_hit == cached, req
    assert cache.metrics()["tier.hit_tokens.storage"] == cached
    cache.drain()
    cache.check_integrity()
    cache.close()


def _run_producer(kind: str, where: str, sizes: list[int]) -> None:
    proc = multiprocessing.get_context("spawn").Process(target=_producer, args=(kind, where, sizes))
    proc.start()
    proc.join(150)
    assert proc.exitcode == 0, f"producer process exited with {proc.exitcode}"


@pytest.mark.timeout(240)
def test_fresh_process_reuses_file_l3_exactly(tmp_path):
    _run_producer("file", str(tmp_path / "l3"), [16, 128])
    for P in (16, 128):
        _consume("file", str(tmp_path / "l3"), P)


@pytest.mark.timeout(240)
def test_fresh_process_reuses_mooncake_l3_exactly(segment_holder):
    _run_producer("mooncake", segment_holder, [128])
    _consume("mooncake", segment_holder, 128)


def test_v4_model_config_refuses():
    with pytest.raises(ValueError, match="every V4 layer is 'swa'"):
        V4ModelConfig(layer_kinds=("full", "swa", "swa"))
    with pytest.raises(ValueError, match="compress_ratios: 3 ratios for 2 layers"):
        V4ModelConfig(layer_kinds=("swa", "swa"))
    with pytest.raises(ValueError, match="compress_ratios: 8 is not one of"):
        V4ModelConfig(compress_ratios=(4, 8, 4))
    with pytest.raises(ValueError, match="page_size=16 is not a multiple of the ratio 128"):
        V4ModelConfig().cache_config(16, device_tokens=64, host_ratio=2.0)
    assert V4ModelConfig().page_multiple == 128
