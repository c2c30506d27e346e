"""Load or recompute: an L3 hit that would load slower than recomputing it is declined, counted."""

from __future__ import annotations

from kvtier.storage import PrefetchOutcome, create_backend
from tests.runtime.l3.helpers import (
    PROMPT_TOKENS,
    conversations,
    make_l3_cache,
    prefetch_and_run,
    produce,
    second_turn,
)


def _decisions(cache) -> tuple[int, int]:
    m = cache.metrics()
    load = sum(v for k, v in m.items() if k.endswith("decision_load"))
    recompute = sum(v for k, v in m.items() if k.endswith("decision_recompute"))
    return int(load), int(recompute)


def test_slow_storage_is_declined_and_fast_storage_is_loaded(tmp_path):
    backend = create_backend("file", root=tmp_path)
    producer = make_l3_cache("full", backend)
    convs = conversations(77, n=2)
    produce(producer, convs)
    producer.close()

    # Prefill at 10^12 tokens/s beats any storage read: the hit is declined and recomputed.
    fast_prefill = make_l3_cache(
        "full", backend, prefill_tokens_per_s=1e12, assumed_storage_gbps=1.0
    )
    pf, req = prefetch_and_run(fast_prefill, second_turn(convs[0]))
    assert pf.outcome is PrefetchOutcome.REVOKED and pf.reason == "declined", pf
    assert req.cached_len == 0, "a declined hit is recomputed"
    assert fast_prefill.metrics()["tier.bytes.storage.read"] == 0
    assert _decisions(fast_prefill) == (0, 1)
    fast_prefill.close()

    # Prefill at 1 token/s: loading wins, the pages come back and are reused exactly.
    slow_prefill = make_l3_cache(
        "full", backend, prefill_tokens_per_s=1.0, assumed_storage_gbps=1.0
    )
    pf, req = prefetch_and_run(slow_prefill, second_turn(convs[1]))
    assert pf.outcome is PrefetchOutcome.COMPLETE, pf
    assert req.host_hit == PROMPT_TOKENS
    assert _decisions(slow_prefill) == (1, 0)
    slow_prefill.close()
