"""L3 end to end: a producer process writes conversations, a fresh consumer reads them back exact.

Process A (spawned) runs turn 1 of some conversations through a cache with storage and waits
until its backups reached L3. Then a consumer in this process, with an empty tree and the same
namespace, prefetches each follow-up prompt and runs it: the synthetic model's check that every
reused position holds the bytes a cold run writes passes, so the outputs are identical.
Different namespaces (model id, salt, dtype, page size) must see no page at all.
"""

from __future__ import annotations

import multiprocessing

import pytest
import torch

from kvtier.storage import PrefetchOutcome, create_backend
from tests.runtime.l3.helpers import (
    PROMPT_TOKENS,
    conversations,
    make_l3_cache,
    prefetch_and_run,
    produce,
    second_turn,
)
from tests.runtime.synthetic import MODELS, P

SEED = 11


def _backend(kind: str, where: str):
    if kind == "file":
        return create_backend("file", root=where)
    # Segment-less: the pages live in the segment holder and outlive this process.
    return create_backend("mooncake", master_address=where, global_segment_size=0)


def _producer(kind: str, where: str, models: list[str]) -> None:
    backend = _backend(kind, where)
    caches = []  # kept alive: a freed host pool's address may come back, already registered
    for model in models:
        cache = make_l3_cache(model, backend)
        produce(cache, conversations(SEED))
        m = cache.metrics()
        assert m["tier.backup_failures"] == 0 and m["tier.bytes.storage.write"] > 0, m
        cache.close()
        caches.append(cache)
    backend.close()


def _run_producer(kind: str, where: str, models: list[str]) -> None:
    proc = multiprocessing.get_context("spawn").Process(
        target=_producer, args=(kind, where, models)
    )
    proc.start()
    proc.join(120)
    assert proc.exitcode == 0, f"producer process exited with {proc.exitcode}"


@pytest.mark.timeout(180)
def test_producer_consumer_identical_bytes(l3_location):
    kind, where = l3_location
    _run_producer(kind, where, list(MODELS))
    backend = _backend(kind, where)
    caches = []
    try:
        for model in MODELS:
            cache = make_l3_cache(model, backend)
            caches.append(cache)
            for conv in conversations(SEED):
                pf, req = prefetch_and_run(cache, second_turn(conv))
                assert pf.outcome is PrefetchOutcome.COMPLETE, (model, pf)
                assert req.device_hit == 0 and req.host_hit == PROMPT_TOKENS, (model, req)
            cache.drain()
            cache.check_integrity()
            m = cache.metrics()
            assert m["tier.hit_tokens.storage"] == 3 * PROMPT_TOKENS, (model, m)
            assert m["tier.prefetch.complete"] == 3 and m["tier.bytes.storage.read"] > 0
            assert 'kvtier_hit_tokens_total{tier="storage"} 60' in cache.prometheus()
            cache.close()
    finally:
        backend.close()


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "another-checkpoint"},
        {"namespace_key": "tenant-b"},
        {"dtype": torch.float64},
        {"page_size": 2 * P},
    ],
    ids=["model_id", "salt", "dtype", "page_size"],
)
def test_other_namespace_sees_nothing(tmp_path, change):
    backend = create_backend("file", root=tmp_path)
    producer = make_l3_cache("full+swa", backend)
    convs = conversations(SEED + 1, n=2)
    produce(producer, convs)
    producer.close()
    consumer = make_l3_cache("full+swa", backend, **change)
    for conv in convs:
        pf, req = prefetch_and_run(consumer, second_turn(conv))
        assert pf.outcome is PrefetchOutcome.REVOKED and pf.reason == "below_threshold", pf
        assert req.cached_len == 0
    m = consumer.metrics()
    assert m["tier.hit_tokens.storage"] == 0 and m["tier.bytes.storage.read"] == 0
    consumer.close()
    same = make_l3_cache("full+swa", backend)
    pf, req = prefetch_and_run(same, second_turn(convs[0]))
    assert pf.outcome is PrefetchOutcome.COMPLETE and req.host_hit == PROMPT_TOKENS
    same.close()
