"""The cache facade end to end with the synthetic model (``tests/runtime/synthetic.py``).

After matching a later request, every cached position it reuses — from device, or loaded back
from host after eviction — must hold exactly the bytes a cold computation would have written.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.runtime.config import CacheConfig
from tests.runtime.synthetic import MODELS, SPEC, check_cached, forward, make_cache, run_turn


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("model", list(MODELS))
def test_device_then_host_hits_are_exact(model, policy):
    cache = make_cache(MODELS[model], policy)
    gen = torch.Generator().manual_seed(len(model) * 3 + len(policy))
    convs = [torch.randint(0, 50, (12,), generator=gen).tolist() for _ in range(3)]
    # turn 1 of each conversation, then turn 2 extends it: a device hit
    reqs = [run_turn(cache, c) for c in convs]
    second = run_turn(cache, convs[0] + [7, 7, 7] + [1, 2, 3, 4, 5])
    assert second.cached_len > 0 and second.host_hit == 0, "turn 2 should hit the device"
    # flood the device with other prompts so the first conversations leave it
    for _ in range(6):
        run_turn(cache, torch.randint(50, 99, (16,), generator=gen).tolist())
    cache.drain()
    cache.evict(cache.config.device_tokens)
    cache.check_integrity()
    third = run_turn(cache, convs[1] + [7, 7, 7] + [9, 9])
    if policy == "write_through_selective":
        return  # backed up only after a second hit: the first turn may have been recomputed
    assert third.host_hit > 0, f"{model}/{policy}: expected a host hit, got {third}"
    assert third.cached_len >= 8
    cache.drain()
    cache.check_integrity()
    m = cache.metrics()
    assert m["host_hit_tokens"] >= third.host_hit and m["h2d_bytes"] > 0
    del reqs


def test_in_flight_load_pins_host_and_device():
    """While a load is in flight its host data cannot be evicted and its slots stay allocated."""
    cache = make_cache(MODELS["full"], "write_through")
    toks = list(range(1, 14))
    run_turn(cache, toks)
    cache.drain()
    cache.evict(cache.config.device_tokens)
    cache.controller.ack_delay_steps = 3
    req = cache.match(toks + [1, 2])
    assert req.host_hit > 0
    cache.start_loading()
    host_used = cache.tree.full.host_alloc.used_size()
    # host eviction must not touch the pinned path; device eviction must not free loaded slots
    cache.tree.evict_host(full=cache.config.host_kv_tokens)
    cache.evict(cache.config.device_tokens)
    assert cache.tree.full.host_alloc.used_size() >= req.host_hit
    assert bool(cache.kv_alloc.is_allocated(req.kv_slots[: req.cached_len]).all())
    cache.check_integrity()
    cache.poll()
    assert cache.controller.in_flight == 1, "the delayed ack is still outstanding"
    cache.drain()
    assert cache.controller.in_flight == 0
    del host_used


def test_bad_configs():
    base = {"kv_heads": 1, "head_dim": 4, "page_size": 4, "device_tokens": 32, "host_ratio": 2.0}
    with pytest.raises(ValueError, match="host_layout: unknown host layout 'page_head'"):
        CacheConfig(layer_kinds=("full",), host_layout="page_head", **base)
    with pytest.raises(ValueError, match="mamba_host_layout: Mamba host pools support only 'flat'"):
        CacheConfig(
            layer_kinds=("full", "mamba"),
            mamba=SPEC,
            mamba_slots=4,
            mamba_host_layout="layer_first",
            **base,
        )
    with pytest.raises(ValueError, match="host_tokens: host pool of 16 tokens is smaller"):
        CacheConfig(layer_kinds=("full",), **{**base, "host_ratio": 0.5})
    with pytest.raises(ValueError, match="write_policy: unknown 'write_around'"):
        CacheConfig(layer_kinds=("full",), write_policy="write_around", **base)
    with pytest.raises(ValueError, match="swa_window: needed"):
        CacheConfig(layer_kinds=("full", "swa"), **base)
    with pytest.raises(ValueError, match="layer_kinds: unknown kind 'moe'"):
        CacheConfig(layer_kinds=("full", "moe"), **base)


def test_failed_reserve_evicts_nothing_and_abort_releases_everything():
    cache = make_cache(MODELS["full+mamba"], "write_through")
    first = run_turn(cache, list(range(20)))
    del first
    req = cache.match(list(range(20)) + [99])
    assert req.device_hit > 0 and req.pin is not None
    free_before = cache.kv_alloc.available_size()
    with pytest.raises(RuntimeError, match="device KV pool exhausted"):
        cache.reserve(req, 10_000)
    assert cache.kv_alloc.available_size() == free_before, "a hopeless reserve evicted the cache"
    assert cache.counters.evicted_tokens == 0
    cache.abort(req)
    assert not cache.requests, "the aborted request is still registered"
    assert all(not any(n.pins) for n in cache.tree.all_nodes()[1:]), "a pin leaked"
    cache.check_integrity()
    # reserve evicts only the shortfall
    for i in range(4):
        run_turn(cache, [100 + i] * 12)
    cache.drain()
    req = cache.match([7] * 9)
    short = 40 - cache.kv_alloc.available_size()
    before = cache.counters.evicted_tokens
    cache.reserve(req, 40)
    evicted = cache.counters.evicted_tokens - before
    assert short > 0 and short <= evicted < short + 12, (short, evicted)  # whole nodes at most
    cache.abort(req)
    cache.check_integrity()


@pytest.mark.parametrize("model", ["full+mamba", "full+swa+mamba", "full+swa"])
@pytest.mark.parametrize("when", ["next batch matched mid-forward", "wait before start_loading"])
def test_a_wait_never_passes_a_queued_load(model, when):
    """A host hit's load queued by ``match`` and not started yet: a ``wait_layer`` that covers
    the request (the running batch's, whose default ``requests`` is every running request; or
    the request's own before its ``start_loading``) starts it first. It used to return at once:
    the matched Mamba state was copied from slots nothing had loaded (its pending copy used up,
    so the state stayed wrong after the load landed) and SWA rows read stale bytes (a user
    trial)."""
    cache = make_cache(MODELS[model], "write_through", device_tokens=64)
    conv = torch.randint(0, 50, (20,), generator=torch.Generator().manual_seed(5)).tolist()
    run_turn(cache, conv)
    cache.drain()
    cache.evict(cache.config.device_tokens)
    cache.poll()
    layers = len(cache.config.layer_kinds)
    running = None
    if when == "next batch matched mid-forward":
        running = cache.match(list(range(300, 310)))
        cache.reserve(running, 16)
        cache.start_loading()
        running.token_ids = list(range(300, 310))
        forward(cache, running, 8)
    later = cache.match(conv + [7, 7, 7, 1])
    assert later.host_hit > 0 and cache.controller._queued, "the test needs a queued load"
    cache.reserve(later, len(later.token_ids) + 2)
    for layer in range(layers):
        cache.wait_layer(layer)  # every running request: the queued one too
    check_cached(cache, later)  # right after the waits, as the forward reads
    cache.start_loading()  # nothing is left to start: the bytes stay right
    assert not cache.controller._queued
    check_cached(cache, later)
    cache.drain()
    cache.check_integrity()
