"""Per-tier hit tokens split a request's hit: device + host + storage = the tokens served.

Storage hits are the tokens an L3 prefetch read for a request, counted when a match serves
them (``req.storage_hit``, part of ``req.host_hit``), not when the prefetch lands: tokens
prefetched and never served are no hit (``l3.prefetched_tokens`` counts them), and the same
tokens served again later are a host or device hit.
"""

from __future__ import annotations

from kvtier.storage import PrefetchOutcome, create_backend
from tests.runtime.l3.helpers import (
    PROMPT_TOKENS,
    conversations,
    make_l3_cache,
    prefetch_to_end,
    produce,
    second_turn,
)
from tests.runtime.synthetic import run_turn

SEED = 43
TIERS = ("device", "host", "storage")


def hits(cache) -> dict[str, int]:
    m = cache.metrics()
    return {t: m[f"tier.hit_tokens.{t}"] for t in TIERS}


def test_storage_hits_are_counted_when_served_and_once(tmp_path):
    backend = create_backend("file", root=tmp_path)
    convs = conversations(SEED, n=2)
    producer = make_l3_cache("full", backend)
    produce(producer, convs)
    producer.close()

    cache = make_l3_cache("full", backend)
    served = 0
    # Read both conversations' pages to host; serve only the first.
    pfs = [prefetch_to_end(cache, second_turn(c)) for c in convs]
    assert all(pf.outcome is PrefetchOutcome.COMPLETE for pf in pfs), pfs
    m = cache.metrics()
    assert m["l3.prefetched_tokens"] == 2 * PROMPT_TOKENS, m
    assert hits(cache) == dict.fromkeys(TIERS, 0), "a prefetch alone serves nothing"

    req = run_turn(cache, second_turn(convs[0]))
    assert req.host_hit == PROMPT_TOKENS and req.storage_hit == PROMPT_TOKENS, req
    served += req.cached_len
    assert hits(cache) == {"device": 0, "host": 0, "storage": PROMPT_TOKENS}

    # Served again from host (evicted from the device): a host hit, not a storage hit.
    cache.drain()
    cache.evict(96)
    req = run_turn(cache, second_turn(convs[0]))
    assert req.host_hit >= PROMPT_TOKENS and req.storage_hit == 0, req
    served += req.cached_len
    # And from the device.
    req = run_turn(cache, second_turn(convs[0]))
    assert req.device_hit >= PROMPT_TOKENS and req.storage_hit == 0, req
    served += req.cached_len
    h = hits(cache)
    assert h["storage"] == PROMPT_TOKENS and sum(h.values()) == served, (h, served)
    m = cache.metrics()
    assert m["device_hit_tokens"] + m["host_hit_tokens"] == served, m
    assert m["l3.prefetched_tokens"] == 2 * PROMPT_TOKENS, m
    cache.drain()
    cache.check_integrity()
    cache.close()
    backend.close()


def test_device_kv_without_the_state_is_a_device_hit(tmp_path):
    """A hybrid model's device path can hold KV without the Mamba state a hit needs: the hit
    loads the rest and the state, and the tokens whose KV stayed on the device are device
    hits (they were counted as loaded back from host; a user trial)."""
    backend = create_backend("file", root=tmp_path)
    prompt = list(range(200, 232))
    producer = make_l3_cache("full+mamba", backend)
    run_turn(producer, prompt)
    producer.drain()
    producer.close()

    cache = make_l3_cache("full+mamba", backend)
    run_turn(cache, prompt[:9])  # [0, 8) on the device, with its state at 8 only
    cache.drain()
    before = hits(cache)
    pf = prefetch_to_end(cache, prompt + [1])
    assert pf.outcome is PrefetchOutcome.COMPLETE and pf.loaded_tokens == 24, pf
    req = run_turn(cache, prompt + [1])
    assert (req.device_hit, req.host_hit, req.storage_hit) == (8, 24, 24), req
    after = hits(cache)
    assert {t: after[t] - before[t] for t in TIERS} == {"device": 8, "host": 0, "storage": 24}
    cache.drain()
    cache.check_integrity()
