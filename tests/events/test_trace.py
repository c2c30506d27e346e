"""A subscriber replays the events of a random trace; after every step its index equals the
cache's state on every tier (device and host from the tree, storage from the backend)."""

from __future__ import annotations

import random

import pytest

from kvtier.events import MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_STORAGE
from kvtier.storage import page_hashes
from tests.events.common import (
    HYBRID,
    check_index,
    converge,
    key_namespace_of,
    make_cache,
    subscribe,
    synced,
)
from tests.runtime.l3.helpers import conversations, prefetch_and_run
from tests.runtime.synthetic import run_turn


def _prompt(rnd: random.Random, convs: list[list[int]], histories: list[list[int]]) -> list[int]:
    """A multi-turn chat: a new conversation (a prefix of one, sharing pages with others that
    start alike), or the next turn of an earlier one (its prompt, the 7s the synthetic model
    generated, and a new user message), which hits what that turn cached on some tier."""
    if histories and rnd.random() < 0.6:
        i = rnd.randrange(len(histories))
        prompt = histories[i] + [7, 7, 7] + [rnd.randrange(50) for _ in range(rnd.randrange(1, 5))]
        if len(prompt) > 40:  # a finished chat: start over in its place
            prompt = rnd.choice(convs)[: rnd.choice((6, 9, 13))]
        histories[i] = prompt
    else:
        prompt = rnd.choice(convs)[: rnd.choice((6, 9, 13, 20))]
        histories.append(prompt)
    return prompt


def _trace(cache, ix, seed: int, steps: int, prefetch: bool) -> set[str]:
    rnd = random.Random(seed)
    convs = conversations(seed, n=5)
    seen: set[bytes] = set()
    histories: list[list[int]] = []
    kinds = set()
    converge(cache, ix)  # joining may miss the first batches: a snapshot catches up
    gaps = ix.counters["gaps"]
    for _ in range(steps):
        prompt = _prompt(rnd, convs, histories)
        hs = page_hashes(prompt, key_namespace_of(cache, None))
        seen.update(bytes.fromhex(h) for h in hs)
        if prefetch and rnd.random() < 0.3:
            prefetch_and_run(cache, prompt)
        else:
            run_turn(cache, prompt)
        synced(cache, ix)
        check_index(cache, ix, seen)
        inst = cache.events.instance_id
        kinds |= {m for m in (MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_STORAGE) if ix.held(inst, m)}
    assert ix.counters["gaps"] == gaps, "a batch was lost on loopback"
    cache.drain()
    synced(cache, ix)
    check_index(cache, ix, seen)
    if cache.l3 is not None:  # nothing in flight: the index holds exactly what the store has
        assert not cache.l3.outstanding
    return kinds


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_index_follows_the_cache_with_l3(tmp_path, policy):
    cache = make_cache(policy, str(tmp_path / "l3"))
    ix = subscribe(cache)
    try:
        kinds = _trace(
            cache, ix, seed=11 if policy == "write_through" else 12, steps=40, prefetch=True
        )
        # The trace went through every path: every tier held pages, both lost some (device and
        # host eviction), host hits were loaded back, and (write-through) L3 hits prefetched.
        assert kinds == {MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_STORAGE}
        published = cache.events.counters
        assert published[f"removed_pages.{MEDIUM_DEVICE}"] > 0
        assert published[f"removed_pages.{MEDIUM_HOST}"] > 0
        assert cache.counters.load_backs > 0
        if policy == "write_through":
            assert cache.metrics()["tier.prefetch.complete"] > 0
        assert ix.counters["malformed"] == 0
    finally:
        cache.close()
        ix.close()


def test_index_follows_the_cache_without_l3():
    """Without L3 the keys are the same chain (computed for events alone)."""
    cache = make_cache("write_through", kinds=HYBRID)
    ix = subscribe(cache)
    try:
        _trace(cache, ix, seed=5, steps=25, prefetch=False)
        assert not ix.held(cache.events.instance_id, MEDIUM_STORAGE)
    finally:
        cache.close()
        ix.close()
