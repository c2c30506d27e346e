"""What an event means: emitted only once its fact is true, keyed like L3, readable by vLLM's
decoders, published by rank 0 only; and what the indexer estimates from it."""

from __future__ import annotations

import subprocess
import sys
import time

import msgspec

from kvtier.events import MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_STORAGE, Indexer, wire
from kvtier.events.keys import KeySeed, prompt_hashes
from kvtier.runtime import cache as cache_module
from kvtier.storage import page_hashes
from kvtier.storage.keys import canonical_namespace
from tests.children import child_env
from tests.events.common import (
    BOUND_S,
    RawPublisher,
    check_index,
    converge,
    key_namespace_of,
    loopback,
    make_cache,
    make_config,
    subscribe,
    synced,
)
from tests.runtime.l3.helpers import conversations
from tests.runtime.synthetic import P, forward

FULL = ("full", "full")


def _pages(cache, tokens, ns=None) -> set[bytes]:
    return {bytes.fromhex(h) for h in page_hashes(tokens, key_namespace_of(cache, ns))}


def _finish(cache, tokens, ns=None):
    req = cache.match(tokens, ns)
    cache.reserve(req, len(tokens))
    cache.start_loading()
    forward(cache, req, len(tokens))
    cache.cache_finished_req(req)
    return req


def test_host_and_device_events_wait_for_the_acknowledgement():
    """Stored on host only once the D→H copy is acknowledged; on device after a load-back
    only once the H→D copy is; a load-back keeps the host copy."""
    cache = make_cache("write_through", kinds=FULL, ack_delay_steps=2)
    ix = subscribe(cache)
    inst = cache.events.instance_id
    try:
        converge(cache, ix)
        tokens = conversations(1, n=1)[0]  # 20 tokens: 5 pages
        pages = _pages(cache, tokens)
        _finish(cache, tokens)
        for _ in range(5):
            cache.poll()
            synced(cache, ix)
            assert ix.held(inst, MEDIUM_DEVICE) == pages
            acked = not cache.controller.in_flight
            assert (ix.held(inst, MEDIUM_HOST) == pages) is acked
            assert ix.held(inst, MEDIUM_HOST) in (set(), pages)
        assert acked
        # Evicting the device copy: removed from the device, still on host.
        assert cache.evict(len(tokens)) == len(tokens)
        cache.poll()
        synced(cache, ix)
        assert not ix.held(inst, MEDIUM_DEVICE) and ix.held(inst, MEDIUM_HOST) == pages
        # Load it back: on device only once the load is acknowledged; the host keeps its copy.
        req = cache.match(tokens + [1])
        assert req.host_hit == len(tokens)
        cache.start_loading()
        loaded = False
        for _ in range(5):
            cache.poll()
            synced(cache, ix)
            loaded = not cache.controller.in_flight
            assert (ix.held(inst, MEDIUM_DEVICE) == pages) is loaded
            assert ix.held(inst, MEDIUM_HOST) == pages
        assert loaded
        cache.abort(req)
        check_index(cache, ix, set())
    finally:
        cache.close()
        ix.close()


def test_keys_are_the_l3_keys_and_the_indexer_computes_them(tmp_path):
    """Every instance and router speak the same keys: the L3 chain, with the deployment salt
    and the request namespace, whether or not L3 is configured."""
    ns = ("lora", 3)
    tokens = conversations(2, n=1)[0][:16]
    with_l3 = make_cache("write_through", str(tmp_path / "l3"), namespace_key="salt", kinds=FULL)
    ix = subscribe(with_l3)
    try:
        converge(with_l3, ix)
        _finish(with_l3, tokens, ns)
        with_l3.drain()
        converge(with_l3, ix)
        inst = with_l3.events.instance_id
        want = [bytes.fromhex(h) for h in page_hashes(tokens, with_l3.l3.namespace(ns))]
        assert ix.hashes(inst, tokens, ns) == want
        assert ix.hashes(inst, tokens) != want  # another namespace: other keys
        for medium in (MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_STORAGE):
            assert set(want) <= ix.held(inst, medium)
        # The node keys the L3 tier wrote under are the ones published.
        node = with_l3.tree.match_prefix(tokens, ns).best_match_node
        assert bytes.fromhex(with_l3.l3.node_hashes(node)[-1]) == want[-1]
    finally:
        with_l3.close()
        ix.close()
    no_l3 = make_cache("write_through", kinds=FULL, events=loopback("no-l3"))
    ix = subscribe(no_l3)
    try:
        converge(no_l3, ix)
        _finish(no_l3, tokens, ns)
        no_l3.poll()
        synced(no_l3, ix)
        want = _pages(no_l3, tokens, ns)
        assert set(ix.hashes("no-l3", tokens, ns)) == want
        assert ix.held("no-l3", MEDIUM_DEVICE) == want
    finally:
        no_l3.close()
        ix.close()


class _VllmBlockStored(msgspec.Struct, tag="BlockStored"):
    """vLLM's ``BlockStored`` as its decoders see it (fields from vllm/distributed/kv_events.py)."""

    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None
    group_idx: int | None = None


class _VllmBlockRemoved(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None


class _VllmAllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


class _VllmBatch(msgspec.Struct):
    ts: float
    events: list[_VllmBlockStored | _VllmBlockRemoved | _VllmAllBlocksCleared]
    data_parallel_rank: int | None = None


def test_batches_decode_with_vllms_schema():
    cache = make_cache("write_through", kinds=FULL, device_tokens=32)
    sent: list[tuple[bytes, bytes]] = []
    send = cache.events.publisher.send
    cache.events.publisher.send = lambda frames: (sent.append(frames), send(frames))
    try:
        convs = conversations(3, n=3)
        for c in convs:  # 3 x 20 tokens through a 32-token device pool: evictions
            _finish(cache, c)
            cache.poll()
        assert cache.events.drain()
        decoder = msgspec.msgpack.Decoder(_VllmBatch)
        kinds = set()
        for _seq, payload in sent:
            batch = decoder.decode(payload)
            for ev in batch.events:
                kinds.add((type(ev).__name__, getattr(ev, "medium", None)))
                if isinstance(ev, _VllmBlockStored):
                    assert len(ev.token_ids) == len(ev.block_hashes) * ev.block_size
        assert [wire.seq_of(f) for f, _ in sent] == list(range(len(sent)))
        assert {
            ("_VllmAllBlocksCleared", None),
            ("_VllmBlockStored", MEDIUM_DEVICE),
            ("_VllmBlockStored", MEDIUM_HOST),
            ("_VllmBlockRemoved", MEDIUM_DEVICE),
        } <= kinds
    finally:
        cache.close()


def test_only_rank_0_publishes(monkeypatch):
    monkeypatch.setattr(cache_module, "rank_and_size", lambda group: (1, 2))
    cache = cache_module.TieredKVCache(make_config(kinds=FULL), events=loopback())
    try:
        assert cache.events is None and cache.tree.events is None
        _finish(cache, conversations(4, n=1)[0])
        cache.poll()
    finally:
        cache.close()


def test_runtime_imports_no_zmq_until_events_are_on():
    code = (
        "import sys, kvtier, kvtier.runtime.cache, kvtier.events\n"
        "assert 'zmq' not in sys.modules and 'msgspec' not in sys.modules, 'eager import'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120, env=child_env())


def test_estimate_weighs_loading_against_recomputing():
    """A prompt whose pages sit on device, host and storage: hits per medium, and the load and
    recompute times from the rates the instance reports."""
    info = wire.InstanceInfo(
        instance_id="raw",
        model_id="m",
        dtype="bfloat16",
        page_size=4,
        layout="page_first",
        tp_size=1,
        salt="",
        page_bytes=2_000_000,
        h2d_gbps=20.0,
        storage_gbps=2.0,
        prefill_tokens_per_s=4000.0,
    )
    prompt = list(range(100, 130))  # 7 whole pages and 2 tokens
    hs = [bytes.fromhex(h) for h in prompt_hashes(KeySeed.of(info), prompt, None)]
    on = {MEDIUM_DEVICE: hs[:2], MEDIUM_HOST: hs[:3], MEDIUM_STORAGE: hs[1:5] + hs[6:]}
    pub, ix = RawPublisher(), Indexer()
    try:
        ix.add_instance("raw", pub.endpoint)
        pub.handshake(ix, "raw")
        events = [wire.BlockStored(on[m], None, [0] * 4 * len(on[m]), 4, None, m, None) for m in on]
        pub.batch(1, events, info)
        deadline = time.monotonic() + BOUND_S
        while ix.seq("raw") != 1:
            assert time.monotonic() < deadline
            ix.poll(0.05)
        est = ix.estimate("raw", prompt)
        assert (est.device_tokens, est.host_tokens, est.storage_tokens) == (2 * P, 3 * P, 0)
        # Pages 0-1 from device, 2 from host, 3-4 from storage; page 5 is nowhere.
        assert (est.from_device, est.from_host, est.from_storage) == (2 * P, P, 2 * P)
        want_load = 3 * info.page_bytes / 20e9 + 2 * info.page_bytes / 2e9
        assert abs(est.load_s - want_load) < 1e-12
        assert abs(est.recompute_s - 3 * P / 4000.0) < 1e-12
        assert est.saved_s > 0
        slow = ix.estimate("raw", prompt, prefill_tokens_per_s=1e9)
        assert slow.recompute_s < slow.load_s  # a fast prefill: recomputing wins
        # As match serves: a prompt of exactly 2 pages, both on device, gets its first page (its
        # last token is always computed); the estimate promised both.
        two = ix.estimate("raw", prompt[: 2 * P])
        assert (two.device_tokens, two.from_device) == (P, P), two
        assert ix.estimate("raw", prompt[: 2 * P + 1]).device_tokens == 2 * P
    finally:
        ix.close()
        pub.close()


def test_a_new_key_seed_republishes_everything_under_the_new_keys():
    """L3 attached at run time with another deployment salt re-hashes the tree (its attach
    drops the nodes' hashes); the sink translates what it holds and republishes it, and keeps
    publishing under the new keys."""
    cache = make_cache("write_through", kinds=FULL, device_tokens=32)
    ix = subscribe(cache)
    inst = cache.events.instance_id
    try:
        converge(cache, ix)
        convs = conversations(8, n=4)
        for c in convs[:3]:
            _finish(cache, c)
            cache.poll()
        synced(cache, ix)
        old = ix.held(inst, MEDIUM_HOST)
        for node in cache.tree.all_nodes():  # what the attach does to a subtree of another seed
            node.page_hashes = None
        salt = canonical_namespace("tenant-b").hex()
        cache.events.rekey(salt, 1)
        new_seed = KeySeed(cache.config.model_id, "float32", P, "page_first", 1, salt)
        synced(cache, ix)
        check_index(cache, ix, set(), keyns=new_seed.namespace)
        assert not old & ix.held(inst, MEDIUM_HOST) and ix.held(inst, MEDIUM_HOST)
        assert ix.info(inst).salt == salt
        want = [bytes.fromhex(h) for h in prompt_hashes(new_seed, convs[0], None)]
        assert ix.hashes(inst, convs[0]) == want
        _finish(cache, convs[3])  # and on from there, under the new keys
        cache.poll()
        synced(cache, ix)
        check_index(cache, ix, set(), keyns=new_seed.namespace)
        assert cache.events.counters["rekeys"] == 1
    finally:
        cache.close()
        ix.close()
