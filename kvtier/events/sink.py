"""``EventSink``: what the runtime reports as it happens, published once per scheduler step.

The runtime calls one hook where a fact becomes true (nothing else; ``tree.events`` and the L3
writer's ``events`` are None when events are off, and each hook is guarded by that test):

    hook                 called from                          fact
    device_stored        tree insert (new leaf, unevict)      computed KV is in the tree
    device_loaded        HostTier.finish_load_back            the H→D load was acknowledged
    device_removed       tree.clear_device (FULL)             device slots freed
    backup_started       HostTier.backup                      (remembers the pages of a backup)
    backup_done          HostTier.finish_backup               the D→H copy was acknowledged
    host_grafted         HostTier.graft_host                  pages read from L3 are on host
    host_removed         tree.clear_host (FULL)               host slots freed
    storage_stored       the scheduler thread (poll)          a backup job is acknowledged: its
                                                              pages reached the store (under TP:
                                                              every rank's part of the job)

The work is split three ways:

- the hooks and ``flush`` (here, on the scheduler thread) only record facts: a node's pages as
  chunks (``NodeHashes``: hashes reused from the nodes, or deferred as a ``Lazy``), appended to
  one flat list per step; ``flush`` (from ``poll``) gives the step's list the next sequence
  number and appends it to the publisher thread's queue. Hashes the thread computed go into
  their nodes every ``WRITE_BACK_AT`` owed, and at once for an acknowledged backup (the L3 tier
  hashes its nodes next);
- the ``PublisherThread`` resolves each batch against the ``Mirror`` of what each medium holds as
  published (a page stored twice, or removed where it was not, publishes nothing), builds the
  wire structs straight from it, encodes and sends, and answers snapshot requests;
- the ``Mirror`` is the state subscribers know, and what snapshots are made of.

The queue is bounded (``EventsConfig.queue_batches``). When it is full the batch is dropped and
counted (``dropped_batches``): its number is spent, its facts still reach the mirror (ahead of
the next batch queued), and a subscriber sees the gap and recovers from a snapshot. The
scheduler never waits.

Events report FULL pages only: a hybrid model's SWA window and Mamba state are not reported, so
a router's hit length is an upper bound there. A page is on storage once every pool holding a
FULL page's bytes was written for it (the KV pool and FULL-anchored sidecars). Storage reports
what this instance wrote; pages a shared store evicts, or that other instances wrote, are not.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections import Counter, deque
from collections.abc import Callable

import msgspec

from kvtier.events import wire
from kvtier.events.config import MEDIA, MEDIUM_DEVICE, MEDIUM_HOST, EventsConfig
from kvtier.events.keys import KeySeed
from kvtier.events.mirror import CLEARED, REMOVED, STORED, Mirror
from kvtier.events.nodes import Lazy, NodeHashes, chunk_hashes
from kvtier.events.publisher import Publisher
from kvtier.events.thread import BATCH, JOIN_S, PublisherThread
from kvtier.storage.keys import page_hashes

__all__ = ["EventSink"]

log = logging.getLogger(__name__)

# Computed hashes go into their nodes once this many are owed, not every step: until then a
# hook finds them through ``NodeHashes.lazy`` (and the L3 tier, which needs them at once,
# hashes itself).
WRITE_BACK_AT = 64


class EventSink:
    """Collects a cache's KV events and publishes them (rank 0 of a TP group only).

    Args:
        config: where to publish.
        seed: the page-key seed (model, dtype, page size, layout, TP shape, salt).
        page_bytes: bytes of one FULL page over every layer (reported to routers).
        rates: returns ``(h2d_gbps, storage_gbps)`` now (0 when unknown).
        prefill_tokens_per_s: reported to routers; None: unknown.
        publisher: sockets to use instead of binding ``config``'s (tests).
        storage_pools: the L3 pools that hold a FULL page's bytes (``L3Tier.kv_group``): a page
            is on storage once all of them were written.

    Raises:
        ValueError: an endpoint is in use or cannot be bound (nothing stays bound).
    """

    def __init__(
        self,
        config: EventsConfig,
        seed: KeySeed,
        page_bytes: int,
        rates: Callable[[], tuple[float, float]],
        prefill_tokens_per_s: float | None = None,
        publisher: Publisher | None = None,
        storage_pools: tuple[str, ...] = ("kv",),
    ) -> None:
        self.config = config
        self.seed = seed
        self.rates = rates
        self.publisher = publisher if publisher is not None else Publisher(config)
        self.instance_id = config.instance_id or f"{socket.gethostname()}:{os.getpid()}"
        self._info = wire.InstanceInfo(
            instance_id=self.instance_id,
            model_id=seed.model_id,
            dtype=seed.dtype,
            page_size=seed.page_size,
            layout=seed.layout,
            tp_size=seed.tp_size,
            salt=seed.salt,
            page_bytes=page_bytes,
            prefill_tokens_per_s=prefill_tokens_per_s,
            snapshot_endpoint=self.publisher.snapshot_endpoint,
        )
        self.seq = -1  # the last published sequence number
        self.counters: Counter[str] = Counter()
        self.nodes = NodeHashes(seed)
        self._lazy = self.nodes.lazy  # the same dict for the sink's life (cleared, not replaced)
        self._heartbeat_s = config.heartbeat_s
        self.storage_pools = storage_pools
        self._ops: list[tuple] = [(CLEARED, None, None)]  # a (re)started instance holds nothing
        self._written: deque[tuple] = deque()  # from the L3 writer thread
        self._backups: dict[int, list[tuple]] = {}
        self._last_node, self._last_chunk = None, None  # see device_stored
        self._last_info = float("-inf")
        self._closed = False
        self._max_queued = config.queue_batches
        # Batches dropped while the queue was full: their facts still reach the mirror, ahead
        # of the next batch queued (see _enqueue).
        self._overflow: list[tuple] = []
        self.mirror = Mirror(seed.page_size, self.counters)
        self.thread = PublisherThread(
            config,
            self.publisher,
            self.mirror,
            self.counters,
            self._info,
            f"kvtier-events-{self.instance_id}",
        )
        self._queue = self.thread.queue

    @classmethod
    def for_cache(cls, cache, config: EventsConfig, tp_size: int) -> EventSink:
        """Bind ``config``'s endpoints and hook the sink into ``cache`` (a ``TieredKVCache``:
        its tree, and its L3 writer if any). Keys are seeded as the cache's L3 keys are (also
        without L3), which needs ``CacheConfig.model_id``."""
        cfg = cache.config
        st = cfg.storage
        seed = KeySeed(
            cfg.model_id,
            str(cfg.dtype).removeprefix("torch."),
            cfg.page_size,
            cfg.host_layout,
            None if cfg.rank_replicated else tp_size,
            cfg.key_salt(st.namespace_key if st is not None else "").hex(),
        )
        kv = cache.controller.bindings.get("kv")
        page_bytes = kv.bytes_per_index * cfg.page_size if kv is not None else 0
        stats, tiers = cache.controller.stats, cache.tier_metrics
        assumed = (st.assumed_storage_gbps if st is not None else None) or 0.0

        def rates() -> tuple[float, float]:
            return stats.gbps("h2d"), tiers.snapshot()["gbps.storage.read"] or assumed

        prefill = config.prefill_tokens_per_s
        if prefill is None and st is not None:
            prefill = st.prefill_tokens_per_s
        pools = tuple(cache.l3.kv_group) if cache.l3 is not None else ("kv",)
        sink = cls(config, seed, page_bytes, rates, prefill, storage_pools=pools)
        cache.tree.events = sink
        if cache.l3 is not None:
            cache.l3.writer.events = sink
        return sink

    @property
    def endpoint(self) -> str:
        return self.publisher.endpoint

    @property
    def snapshot_endpoint(self) -> str | None:
        return self.publisher.snapshot_endpoint

    @property
    def run(self) -> int:
        """This start of the publisher (random, on every batch): with ``seq``, what a router's
        ``Indexer.sync`` waits for across the instance's restarts."""
        return self.thread.run

    def held(self, medium: str) -> set[str]:
        """Hex hashes of the pages ``medium`` holds as published so far (waits for the
        publisher thread, which keeps the mirror)."""
        medium = _medium(medium)
        self.drain()
        return set(self.mirror.held[medium])

    # -- hooks (scheduler thread) ---------------------------------------------------------------

    def device_stored(self, node) -> None:
        chunk = self.nodes.leaf(node)
        # Kept for a backup of the same node in the same step (write-through): no second walk.
        self._last_node, self._last_chunk = node, chunk
        self._ops.append((STORED, MEDIUM_DEVICE, (chunk,)))

    def device_loaded(self, load) -> None:
        # The loaded pages end at the anchor (the evicted part of its path, committed at
        # load_back); walking back by length also covers nodes split since.
        anchor = load.anchor
        if load.loaded_tokens:
            chunks = self.nodes.chunks(anchor, anchor.end - load.loaded_tokens)
            self._ops.append((STORED, MEDIUM_DEVICE, chunks))

    def device_removed(self, node) -> None:
        # The list itself: a node's hash list is replaced on a split, never changed in place.
        hashes = node.page_hashes
        self._ops.append(
            (REMOVED, MEDIUM_DEVICE, self.nodes.of(node) if hashes is None else hashes)
        )

    def backup_started(self, backup) -> None:
        # The pages are taken now: a node of the chain may be split before the copy is acked.
        last_node, last_chunk = self._last_node, self._last_chunk
        nodes = backup.nodes
        if len(nodes) == 1 and nodes[0] is last_node and last_node.key is last_chunk[3]:
            self._backups[id(backup)] = (last_chunk,)
            return
        records = []
        for x in nodes:
            if x is last_node and x.key is last_chunk[3]:
                records.append(last_chunk)
            else:
                records += self.nodes.chunks(x, x.start)
        self._backups[id(backup)] = records

    def backup_done(self, backup) -> None:
        records = self._backups.pop(id(backup), None)
        if records:
            self._ops.append((STORED, MEDIUM_HOST, records))
            # An L3 tier writes the backup on next, hashing its nodes: hand it the hashes the
            # publisher thread has computed since, rather than let it hash them again.
            for chunk in records:
                lz = chunk[0]
                if lz.__class__ is Lazy and lz.hashes is not None:
                    self.nodes.settle(lz)

    def host_grafted(self, node) -> None:
        self._ops.append((STORED, MEDIUM_HOST, self.nodes.chunks(node, node.start)))

    def host_removed(self, node) -> None:
        hashes = node.page_hashes
        self._ops.append((REMOVED, MEDIUM_HOST, self.nodes.of(node) if hashes is None else hashes))

    def storage_stored(self, stored) -> None:
        """``(pool, hash)`` pairs written to L3 (called by the L3 tier when it acknowledges the
        job; a deque append, resolved on the publisher thread)."""
        self._written.append((self.storage_pools, stored))

    def cleared(self, medium: str | None = None) -> None:
        """``medium`` (every medium when None) was emptied at once (e.g. storage detached)."""
        self._ops.append((CLEARED, None if medium is None else _medium(medium), None))

    # -- per step (scheduler thread) -----------------------------------------------------------

    def flush(self) -> int | None:
        """Queue what the hooks recorded since the last flush as the next batch (or a heartbeat
        when due) for the publisher thread. Returns the batch's sequence number, or None when
        there was nothing."""
        if self._closed:
            return None
        if len(self._lazy) >= WRITE_BACK_AT:
            self.nodes.write_back()
        # Routers get the instance's rates with the first batch, then once per heartbeat.
        due = time.monotonic() - self._last_info >= self._heartbeat_s
        ops = self._ops
        if ops or self._written:
            self._ops = []
            written = None
            if self._written:
                pop, written = self._written.popleft, []
                while self._written:
                    written.append(pop())
            return self._enqueue(ops, written, due)
        if due:
            return self._enqueue(None, None, True)
        return None

    def _enqueue(self, ops, written, with_info: bool, snapshot: bool = False) -> int:
        """Give the hooks' ``ops`` and the L3 writer's ``written`` (or, with ``snapshot``, the
        whole mirror) the next sequence number and queue them; when the publisher thread is
        ``queue_batches`` behind, keep their facts for the mirror but drop the batch (counted):
        never wait."""
        self.seq += 1
        info = None
        if with_info:
            h2d, storage = (float(r) for r in self.rates())
            info = msgspec.structs.replace(self._info, h2d_gbps=h2d, storage_gbps=storage)
            self._last_info = time.monotonic()
        q = self._queue
        if len(q) >= self._max_queued:
            # The number is spent: subscribers see the gap and take a snapshot of the mirror,
            # which gets these facts ahead of the next batch that is queued.
            self._overflow.append((ops, written, snapshot))
            self.counters["dropped_batches"] += 1
        else:
            before = self._overflow
            if before:  # handed over whole: the thread must not see later appends
                self._overflow = []
            else:
                before = ()
            q.append((BATCH, self.seq, time.time(), ops, written, snapshot, info, before))
            if 2 * len(q) >= self._max_queued:
                self.thread.wake.set()
        self.counters["batches"] += 1
        return self.seq

    def drain(self, timeout_s: float = JOIN_S) -> bool:
        """Wait until the publisher thread has handled everything queued so far (tests, close,
        rekey); False if it did not within ``timeout_s``."""
        return self.thread.drain(timeout_s)

    def snapshot(self) -> wire.KVEventBatch:
        """Everything each medium holds as of ``self.seq``, as one batch (waits for the
        publisher thread)."""
        self.drain()
        h2d, storage = (float(r) for r in self.rates())
        return self.thread.snapshot(
            msgspec.structs.replace(self._info, h2d_gbps=h2d, storage_gbps=storage)
        )

    # -- a new key seed ------------------------------------------------------------------------

    def rekey_for_tier(self, tier) -> None:
        """L3 was attached at run time (``tier``, an ``L3Tier``): take its key seed (see
        ``rekey``) and the pools that hold its FULL pages."""
        self.storage_pools = tuple(tier.kv_group)
        ns = tier.namespace(None)
        self.rekey(tier.cfg.key_salt(tier.st.namespace_key).hex(), ns.tp_size)

    def rekey(self, salt: str, tp_size: int | None) -> None:
        """The instance's page keys are now seeded with ``salt`` and ``tp_size`` (L3 attached
        with another deployment salt or rank scope, whose tier re-hashes the tree's nodes):
        publish what is pending under the old keys, translate every page held (and every
        backup in flight) to its new hash, and publish the whole new state at once, after an
        ``AllBlocksCleared``, with the new seed in the batch's instance info, so that routers
        hash prompts the new way from that batch on. Nothing happens if the seed is the same."""
        old = self.seed
        if (salt, tp_size) == (old.salt, old.tp_size):
            return
        new = KeySeed(old.model_id, old.dtype, old.page_size, old.layout, tp_size, salt)
        # Hashes still owed are under the old seed: computed for the records only.
        self.nodes.rekey(new)
        self.flush()  # what is pending goes under the old keys
        if not self.drain():
            log.warning("kv events: rekey while the publisher thread is behind")
        # The thread is idle now (only snapshot requests read the mirror, which is replaced,
        # not changed, below) until the next flush.

        def one_page(tokens: list[int], ns, prev: str | None) -> str:
            start = prev if prev is not None else new.digest_hex(ns)
            return page_hashes(tokens, new.namespace(ns), start)[0]

        P = old.page_size
        translate = self.mirror.rekey(one_page)
        for key, chunks in self._backups.items():
            moved = []
            for chunk in chunks:  # backups taken before the change: hashes under the old seed
                hashes, first, up, k, ns = chunk_hashes(chunk)
                nhs = [translate(h) for h in hashes[first:]]
                if None not in nhs:
                    moved.append((nhs, 0, translate(up) if up else None, k[first * P :], ns))
            self._backups[key] = moved
        self.seed = new
        self._info.salt, self._info.tp_size = salt, tp_size
        self._last_node, self._last_chunk = None, None
        self.counters["rekeys"] += 1
        self._enqueue(None, None, True, snapshot=True)

    def close(self) -> None:
        """Publish that this instance holds nothing any more, and release the sockets."""
        if self._closed:
            return
        try:
            self.cleared()
            self.flush()
        finally:
            self._closed = True
            self.thread.stop()


def _medium(medium: str) -> str:
    if medium not in MEDIA:
        raise ValueError(f"medium: {medium!r} is not one of {MEDIA}")
    return medium
