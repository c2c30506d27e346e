"""Shared pieces of the KV-event tests: caches that publish, and the truth to compare with.

The truth is read from the cache itself, never from the sink: the tree's nodes (FULL on device,
FULL on host), the L3 backend's ``exists``, and page hashes computed here from each node's token
path with the L3 tier's own namespace (or ``namespace_for`` for a cache without L3).
"""

from __future__ import annotations

import dataclasses
import time
import warnings

import torch
import zmq

from kvtier.events import MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_STORAGE, EventsConfig, Indexer, wire
from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig, KVTierConfigWarning, StorageConfig
from kvtier.runtime.l3.pools import namespace_for
from kvtier.storage import PoolTransfer, page_hashes
from tests.runtime.synthetic import MODELS, SPEC, P

HYBRID = MODELS["full+swa+mamba"]
SYNC_S = 10.0  # bound on waiting for a subscriber (loopback: normally milliseconds)


def loopback(instance_id: str = "inst-0", **kw) -> EventsConfig:
    """Events on ephemeral loopback ports (tests run in a namespace with only ``lo``)."""
    kw.setdefault("endpoint", "tcp://127.0.0.1:0")
    kw.setdefault("snapshot_endpoint", "tcp://127.0.0.1:0")
    return EventsConfig(instance_id=instance_id, **kw)


def make_cache(
    policy: str = "write_through",
    root: str | None = None,
    *,
    events: EventsConfig | None = None,
    ack_delay_steps: int = 0,
    **kw,
) -> TieredKVCache:
    """A synthetic-model cache (``tests.runtime.synthetic``) publishing events; with ``root``, a
    file-store L3 there (see ``make_config``). Close it."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KVTierConfigWarning)  # small host pools on purpose
        return TieredKVCache(
            make_config(policy, root, **kw),
            ack_delay_steps=ack_delay_steps,
            events=events or loopback(),
        )


def make_config(
    policy: str = "write_through",
    root: str | None = None,
    *,
    kinds=HYBRID,
    device_tokens: int = 48,
    host_ratio: float = 2.0,
    namespace_key: str = "",
) -> CacheConfig:
    storage = None
    if root is not None:
        storage = StorageConfig(
            backend="file",
            backend_config={"root": root},
            prefetch_min_tokens=4,
            prefetch_policy="wait_complete",
            namespace_key=namespace_key,
        )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KVTierConfigWarning)
        return CacheConfig(
            layer_kinds=kinds,
            kv_heads=1,
            head_dim=4,
            page_size=P,
            device_tokens=device_tokens,
            dtype=torch.float32,
            swa_window=8 if "swa" in kinds else None,
            mamba=SPEC if "mamba" in kinds else None,
            mamba_slots=8 if "mamba" in kinds else None,
            host_ratio=host_ratio,
            write_policy=policy,
            model_id="synthetic-events",
            storage=storage,
        )


def subscribe(cache: TieredKVCache, name: str = "kvtier-indexer", **kw) -> Indexer:
    ix = Indexer(name, **kw)
    ev = cache.events
    ix.add_instance(ev.instance_id, ev.endpoint, ev.snapshot_endpoint)
    return ix


def key_namespace_of(cache: TieredKVCache, ns):
    """The L3 namespace of request namespace ``ns``: the L3 tier's, or ``namespace_for`` of the
    same config with a storage section (keys must not depend on whether L3 is configured)."""
    if cache.l3 is not None:
        return cache.l3.namespace(ns)
    cfg = cache.config
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", KVTierConfigWarning)
        keyed = dataclasses.replace(cfg, storage=StorageConfig())
    return namespace_for(keyed, ns, 1)


def node_pages(cache: TieredKVCache, keyns=None) -> dict:
    """Every attached non-root node → its page hashes (bytes), computed from its token path
    (seeded by ``keyns(namespace)``, default ``key_namespace_of``)."""
    keyns = keyns or (lambda ns: key_namespace_of(cache, ns))
    out, paths = {}, {}
    for node in cache.tree.all_nodes():
        if node.parent is None:
            paths[node] = []
            continue
        path = paths[node.parent] + list(node.key)
        paths[node] = path
        hs = page_hashes(path, keyns(node.namespace))
        out[node] = [bytes.fromhex(h) for h in hs[node.start // P :]]
    return out


def in_store(cache: TieredKVCache, hashes) -> set[bytes]:
    """The hashes whose FULL page the L3 backend says it has: in every pool holding a FULL
    page's bytes (the KV pool, FULL-anchored sidecars)."""
    backend, group = cache.l3.backend, cache.l3.kv_group
    return {
        h for h in hashes if backend.exists([PoolTransfer(pool, [h.hex()]) for pool in group]) == 1
    }


def truth(cache: TieredKVCache, keyns=None) -> dict[str, set[bytes]]:
    """Device and host pages from the tree (the cache is between steps: nothing in flight)."""
    pages = node_pages(cache, keyns)
    dev, host = set(), set()
    for node, hs in pages.items():
        if node.value[0] is not None:
            dev.update(hs)
        if node.host_value[0] is not None:
            host.update(hs)
    return {MEDIUM_DEVICE: dev, MEDIUM_HOST: host}


def inflight_writes(cache: TieredKVCache) -> set[bytes]:
    """FULL pages with an L3 write (of any of their pools) the cache has not acknowledged."""
    out = set()
    for job in cache.l3._backups:
        for pool in cache.l3.kv_group:
            hashes, _ = job.pages.get(pool, ([], None))
            out.update(bytes.fromhex(h) for h in hashes)
    return out


def synced(cache: TieredKVCache, ix: Indexer) -> None:
    ev = cache.events
    assert ix.sync(ev.instance_id, ev.seq, SYNC_S, run=ev.run), (
        f"subscriber stuck at {ix.seq(ev.instance_id)}, published {ev.seq}: {ix.counters}"
    )


def converge(cache: TieredKVCache, ix: Indexer, bound_s: float = SYNC_S) -> None:
    """Step the cache (its publisher thread answers snapshot requests) until the subscriber is at
    the last published batch, within ``bound_s``."""
    ev = cache.events
    deadline = time.monotonic() + bound_s
    while not ix.sync(ev.instance_id, ev.seq, 0.05, run=ev.run):
        assert time.monotonic() < deadline, f"no convergence: {ix.counters} {ev.counters}"
        cache.poll()


def check_index(cache: TieredKVCache, ix: Indexer, seen: set[bytes], keyns=None) -> None:
    """The subscriber's index equals the cache's state on every tier. ``seen`` collects every
    page hash met so far (the candidates for the storage check)."""
    inst = cache.events.instance_id
    assert not cache.controller.in_flight, "check between steps, with every copy acknowledged"
    want = truth(cache, keyns)
    for medium in (MEDIUM_DEVICE, MEDIUM_HOST):
        got = ix.held(inst, medium)
        assert got == want[medium], (
            f"{medium}: index has {len(got - want[medium])} extra, misses {len(want[medium] - got)}"
        )
        seen |= got
    got = ix.held(inst, MEDIUM_STORAGE)
    if cache.l3 is None:
        assert not got
        return
    seen |= got
    stored = in_store(cache, seen)
    # Published only once written; a write may finish after the step published its batch.
    assert got <= stored, f"storage: {len(got - stored)} published pages are not in the store"
    late = stored - got
    assert late <= inflight_writes(cache), f"storage: {len(late)} stored pages never published"


BOUND_S = 10.0  # bound on a hand-driven publisher's handshake


class RawPublisher:
    """A hand-driven PUB socket standing in for an instance, to send what no cache sends."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUB)
        self.sock.bind("tcp://127.0.0.1:0")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(self, *frames: bytes) -> None:
        self.sock.send_multipart(frames)

    def batch(self, seq: int, events, info=None) -> None:
        b = wire.KVEventBatch(ts=time.time(), events=events, instance=info)
        self.send(b"", wire.seq_bytes(seq), wire.encode(b))

    def handshake(self, ix: Indexer, name: str) -> None:
        """Send batch 0 until the subscriber has it (a SUB misses what is sent before it is
        connected), within a bound."""
        deadline = time.monotonic() + BOUND_S
        while ix.seq(name) is None:
            assert time.monotonic() < deadline, "subscriber never connected"
            self.batch(0, [wire.AllBlocksCleared()])
            ix.poll(0.05)

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
