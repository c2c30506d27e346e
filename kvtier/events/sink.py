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
    storage_stored       the L3 writer thread                 the store acknowledged the write

Hooks only record the pages: their hashes where the tree or the L3 tier already has them
(``node.page_hashes``), else a ``_Lazy`` that the publisher thread computes (the next flushes
store it in the node, for the tree, L3 and later hooks). ``flush`` (from ``poll``) only gives
the step's records the next sequence number and appends them to the publisher thread's queue.
The thread (woken every ``PUBLISH_INTERVAL_S``) resolves them against a mirror of what each
medium holds as published (a page stored twice, or removed where it was not, publishes nothing),
builds the wire structs, encodes and sends; the step's cost is collecting facts.

The queue is bounded (``EventsConfig.queue_batches``). When it is full the batch is dropped and
counted (``dropped_batches``): its number is spent, its facts still reach the mirror (ahead of
the next batch queued), and a subscriber sees the gap and recovers from a snapshot. The
scheduler never waits. The thread owns both sockets and the mirror, and answers a snapshot
request between two batches: the reply holds the mirror after batch N, labelled N.

Events report FULL (KV) pages only: a hybrid model's SWA window and Mamba state are not
reported, so a router's hit length is an upper bound there. Storage reports what this instance
wrote; pages a shared store evicts, or that other instances wrote, are not reported.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable

import msgspec
import zmq

from kvtier.events import wire
from kvtier.events.config import MEDIA, MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_STORAGE, EventsConfig
from kvtier.events.keys import KeySeed, chain_hashes
from kvtier.events.publisher import Publisher
from kvtier.storage.keys import canonical_namespace, page_hashes

__all__ = ["EventSink"]

log = logging.getLogger(__name__)

_STORED, _REMOVED, _CLEARED = 0, 1, 2
# How often the publisher thread wakes to send what is queued and to look for snapshot
# requests: a batch leaves at most this long after its step. Waking it on every step instead
# costs the scheduler a system call and a GIL hand-over per step, more than the rest of it.
PUBLISH_INTERVAL_S = 0.005
JOIN_S = 5.0  # how long close() waits for the publisher thread
MAX_LAZY = 4096  # nodes whose hashes wait for the publisher thread (beyond: hashed at once)
# Computed hashes go into their nodes once this many are owed, not every step: until then a
# hook finds them through ``_lazy`` (and the L3 tier, which needs them at once, hashes itself).
WRITE_BACK_AT = 64
_BATCH, _MARK, _STOP = range(3)
_STORED_PAGES = {m: f"stored_pages.{m}" for m in MEDIA}
_REMOVED_PAGES = {m: f"removed_pages.{m}" for m in MEDIA}


# A page as a stored event describes it, kept while some medium holds it: the registry maps its
# hash to its chunk ``(hashes, first, hash before the node, node key, namespace)`` (see
# ``_chunks``), shared by all the chunk's pages, so recording a node is a few C-level bulk
# operations, not Python work per page; the page's place in the chunk is looked up only where
# its parent or tokens are needed (storage events, snapshots). Node keys and hash lists are
# replaced on a split, never changed in place, so a chunk stays valid.


class _Lazy:
    """The page hashes of one node's key, computed when first needed: on the publisher thread
    as it resolves a step's records, or on the scheduler thread if a hook needs them sooner.
    ``prev`` is the hash before the key (hex), or the parent's ``_Lazy``. Both threads may
    compute it at once: they get equal lists, and either is right."""

    __slots__ = ("hashes", "key", "ns", "prev", "seed")

    def __init__(self, key, ns: Hashable, prev: str | _Lazy, seed: KeySeed) -> None:
        self.key, self.ns, self.prev, self.seed = key, ns, prev, seed
        self.hashes: list[str] | None = None

    def get(self) -> list[str]:
        hashes = self.hashes
        if hashes is None:
            prev = self.prev
            if prev.__class__ is _Lazy:
                prev = prev.get()[-1]
            seed = self.seed
            hashes = self.hashes = chain_hashes(self.key, seed.namespace(self.ns), prev)
        return hashes


def _page_info(h: str, chunk: tuple, P: int, i: int | None = None) -> tuple:
    """``(parent hash, token ids, namespace)`` of page ``h`` of ``chunk`` (at ``i`` if known)."""
    hashes, first, up, key, ns = chunk
    if i is None:
        i = hashes.index(h, first)
    return (hashes[i - 1] if i else up), key[i * P : (i + 1) * P], ns


class EventSink:
    """Collects a cache's KV events and publishes them (rank 0 of a TP group only).

    Args:
        config: where to publish.
        seed: the page-key seed (model, dtype, page size, layout, TP shape, salt).
        page_bytes: bytes of one FULL page over every layer (reported to routers).
        rates: returns ``(h2d_gbps, storage_gbps)`` now (0 when unknown).
        prefill_tokens_per_s: reported to routers; None: unknown.
        publisher: sockets to use instead of binding ``config``'s (tests).

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
    ) -> None:
        self.config = config
        self.seed = seed
        self.P = seed.page_size
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
        self._ops: list[tuple] = [(_CLEARED, None, None)]  # a (re)started instance holds nothing
        self._written: deque[list[str]] = deque()  # from the L3 writer thread
        self._backups: dict[int, list[tuple]] = {}
        self._held: dict[str, set[str]] = {m: set() for m in MEDIA}
        self._pages: dict[str, tuple] = {}  # hash -> its chunk: see _page_info
        self._ns_hex: dict[Hashable, str | None] = {}
        self._last_info = float("-inf")
        self._closed = False
        self._max_queued = config.queue_batches
        self._queue: deque[tuple] = deque()  # appended here, popped by the thread
        self._wake = threading.Event()  # set when the queue is half full, to drain, to stop
        # Batches dropped while the queue was full: their facts still reach the mirror, ahead
        # of the next batch queued (see _enqueue).
        self._overflow: list[tuple] = []
        self._lazy: dict[int, tuple] = {}  # id(node) -> (node, _Lazy): see _lazy_hashes
        self._last_stored: tuple = (None, None, None)  # see device_stored
        self._mirror_seq = -1  # the batch the mirror is at (publisher thread)
        self._sent_info = self._info  # the latest info the thread sent (rates 0 until then)
        self._thread = threading.Thread(
            target=self._run, name=f"kvtier-events-{self.instance_id}", daemon=True
        )
        self._thread.start()

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
            canonical_namespace(st.namespace_key if st is not None else "").hex(),
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
        sink = cls(config, seed, page_bytes, rates, prefill)
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

    def held(self, medium: str) -> set[str]:
        """Hex hashes of the pages ``medium`` holds as published so far (waits for the
        publisher thread, which keeps the mirror)."""
        medium = _medium(medium)
        self.drain()
        return set(self._held[medium])

    # -- hooks ---------------------------------------------------------------------------------

    def device_stored(self, node) -> None:
        chunks = self._chunks(node, node.start)
        # Kept for a backup of the same node in the same step (write-through): one walk.
        self._last_stored = (node, node.key, chunks)
        self._ops.append((_STORED, MEDIUM_DEVICE, chunks))

    def device_loaded(self, load) -> None:
        # The loaded pages end at the anchor (the evicted part of its path, committed at
        # load_back); walking back by length also covers nodes split since.
        anchor = load.anchor
        if load.loaded_tokens:
            self._ops.append(
                (_STORED, MEDIUM_DEVICE, self._chunks(anchor, anchor.end - load.loaded_tokens))
            )

    def device_removed(self, node) -> None:
        # The list itself: a node's hash list is replaced on a split, never changed in place.
        self._ops.append((_REMOVED, MEDIUM_DEVICE, self._lazy_hashes(node)))

    def backup_started(self, backup) -> None:
        # The pages are taken now: a node of the chain may be split before the copy is acked.
        last_node, last_key, last_chunks = self._last_stored
        records = []
        for x in backup.nodes:
            if x is last_node and x.key is last_key:
                records += last_chunks
            else:
                records += self._chunks(x, x.start)
        self._backups[id(backup)] = records

    def backup_done(self, backup) -> None:
        records = self._backups.pop(id(backup), None)
        if records:
            self._ops.append((_STORED, MEDIUM_HOST, records))

    def host_grafted(self, node) -> None:
        self._ops.append((_STORED, MEDIUM_HOST, self._chunks(node, node.start)))

    def host_removed(self, node) -> None:
        self._ops.append((_REMOVED, MEDIUM_HOST, self._lazy_hashes(node)))

    def storage_stored(self, stored) -> None:
        """``(pool, hash)`` pairs written to L3 (called from the writer thread: a deque append
        is atomic, and the pairs are resolved in ``flush``)."""
        kv = [h for pool, h in stored if pool == "kv"]
        if kv:
            self._written.append(kv)

    def cleared(self, medium: str | None = None) -> None:
        """``medium`` (every medium when None) was emptied at once (e.g. storage detached)."""
        self._ops.append((_CLEARED, None if medium is None else _medium(medium), None))

    # -- pages of nodes ------------------------------------------------------------------------

    def _lazy_hashes(self, node) -> list[str] | _Lazy:
        """``node``'s page hashes if known, else a ``_Lazy`` that the publisher thread computes
        (and the next ``flush`` stores in ``node.page_hashes``): hashing is most of a hook's
        cost. Hashed now only where the chain before the node is not known either."""
        hashes = node.page_hashes
        if hashes is not None:
            return hashes
        key = node.key
        entry = self._lazy.get(id(node))
        if entry is not None and entry[0] is node and entry[1].key is key:
            lz = entry[1]
            return lz if lz.hashes is None else lz.hashes
        parent = node.parent
        if parent is None or len(key) < self.P:
            return self._hashes(node)
        if parent.parent is None:
            prev = self.seed.digest_hex(node.namespace)
        elif parent.page_hashes:
            prev = parent.page_hashes[-1]
        else:
            up = self._lazy.get(id(parent))
            if up is None or up[0] is not parent or up[1].key is not parent.key:
                return self._hashes(node)
            prev = up[1] if up[1].hashes is None else up[1].hashes[-1]
        if len(self._lazy) >= MAX_LAZY:  # the thread is far behind: stop deferring
            return self._hashes(node)
        lz = _Lazy(key, node.namespace, prev, self.seed)
        self._lazy[id(node)] = (node, lz)
        return lz

    def _write_back(self) -> None:
        """Store the hashes the publisher thread has computed in their nodes (if still the
        same key: a node split since has other lists), for the tree, L3 and later hooks."""
        seed, lazy = self.seed, self._lazy
        for k, (node, lz) in list(lazy.items()):  # a few a step: those of the last steps
            hashes = lz.hashes
            if hashes is not None:
                del lazy[k]
                if node.page_hashes is None and node.key is lz.key and lz.seed is seed:
                    node.page_hashes = hashes

    def _hashes(self, node) -> list[str]:
        """``node``'s page hashes, filling in those of it and its ancestors that lack them (the
        same chain and field as the L3 tier's ``node_hashes``)."""
        if node.page_hashes is not None:
            return node.page_hashes
        path, x = [], node
        while x.parent is not None and x.page_hashes is None:
            entry = self._lazy.pop(id(x), None)
            if entry is not None and entry[0] is x and entry[1].key is x.key:
                x.page_hashes = entry[1].get()  # the same list the thread uses (or will)
                break
            path.append(x)
            x = x.parent
        prev = x.page_hashes[-1] if x.parent is not None and x.page_hashes else None
        seed = self.seed
        for y in reversed(path):
            # Seeding the chain with the cached digest (what page_hashes does with no prev)
            # saves hashing the namespace again for every node under the root.
            ns = seed.namespace(y.namespace)
            start = prev if prev is not None else seed.digest_hex(y.namespace)
            y.page_hashes = chain_hashes(y.key, ns, start)
            prev = y.page_hashes[-1] if y.page_hashes else prev
        return node.page_hashes

    def _chunks(self, node, start: int) -> list[tuple]:
        """The pages in ``[start, node.end)`` as one chunk per node, top-down (walking up from
        ``node`` through as many ancestors as the range covers): ``(hashes, first page, hash
        before the node, key, namespace)``. Nothing per page here: the hooks stay cheap."""
        P = self.P
        chunks = []
        x = node
        while x.parent is not None and x.end > start:
            hashes = self._lazy_hashes(x)
            parent = x.parent
            up = None
            if parent.parent is not None:
                up = self._lazy_hashes(parent)
                if up.__class__ is not _Lazy:
                    up = up[-1]
            key = x.key
            first = start - (x.end - len(key))  # x.start, a property: computed once here
            chunks.append((hashes, first // P if first > 0 else 0, up, key, x.namespace))
            x = parent
        chunks.reverse()
        return chunks

    # -- a new key seed ------------------------------------------------------------------------

    def rekey_for_tier(self, tier) -> None:
        """L3 was attached at run time (``tier``, an ``L3Tier``): take its key seed (see
        ``rekey``)."""
        ns = tier.namespace(None)
        self.rekey(canonical_namespace(tier.st.namespace_key).hex(), ns.tp_size)

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
        # Hashes still owed are under the old seed: none of them may go into a node now (the
        # nodes are re-hashed under the new one), so they are computed for the records only.
        self._lazy.clear()
        self.flush()  # what is pending goes under the old keys
        if not self.drain():
            log.warning("kv events: rekey while the publisher thread is behind")
        # The thread is idle now (only snapshot requests read the mirror, which is replaced,
        # not changed, below) until the next flush.
        new = KeySeed(old.model_id, old.dtype, old.page_size, old.layout, tp_size, salt)
        P, pages = self.P, self._pages
        tr: dict[str, str | None] = {}  # old hash -> new (None: its prefix is not known)

        def translate(h: str) -> str | None:
            path = []
            while h is not None and h not in tr:
                page = pages.get(h)
                if page is None:  # a parent no medium holds: the chain cannot be rebuilt
                    tr[h] = None
                    break
                path.append(h)
                h = _page_info(h, page, P)[0]
            prev = tr[h] if h is not None else None
            for x in reversed(path):
                parent, tokens, ns = _page_info(x, pages[x], P)
                if parent is not None and prev is None:
                    tr[x] = None
                    continue
                start = prev if parent is not None else new.digest_hex(ns)
                tr[x] = prev = page_hashes(tokens, new.namespace(ns), start)[0]
            return tr[path[0]] if path else tr.get(h)

        fresh: dict[str, tuple] = {}
        held = {m: set() for m in MEDIA}
        for m in MEDIA:
            for h in self._held[m]:
                nh = translate(h)
                if nh is None:
                    self.counters["rekey_dropped_pages"] += 1
                    continue
                held[m].add(nh)
                if nh not in fresh:
                    parent, tokens, ns = _page_info(h, pages[h], P)
                    fresh[nh] = ([nh], 0, tr.get(parent) if parent else None, tokens, ns)
        for key, chunks in self._backups.items():
            moved = []
            for hashes, first, up, k, ns in chunks:
                # Backups recorded before the change: their hashes under the old seed.
                hashes = hashes.get() if hashes.__class__ is _Lazy else hashes
                up = up.get()[-1] if up.__class__ is _Lazy else up
                nhs = [translate(h) for h in hashes[first:]]
                if None not in nhs:
                    moved.append((nhs, 0, translate(up) if up else None, k[first * P :], ns))
            self._backups[key] = moved
        self.seed, self._held, self._pages = new, held, fresh
        self._info.salt, self._info.tp_size = salt, tp_size
        self.counters["rekeys"] += 1
        self._enqueue(None, None, True, _snapshot_records(self._held, self._pages, P))

    # -- per step (scheduler thread) -----------------------------------------------------------

    def flush(self) -> int | None:
        """Queue what the hooks recorded since the last flush as the next batch (or a heartbeat
        when due) for the publisher thread, which resolves it against the mirror, encodes and
        sends it. Returns the batch's sequence number, or None when there was nothing."""
        if self._closed:
            return None
        if len(self._lazy) >= WRITE_BACK_AT:
            self._write_back()
        now = time.monotonic()
        # Routers get the instance's rates with the first batch, then once per heartbeat.
        due = now - self._last_info >= self.config.heartbeat_s
        if self._ops or self._written:
            ops, self._ops = self._ops, []
            written = None
            if self._written:
                pop, written = self._written.popleft, []
                while self._written:
                    written.append(pop())
            return self._enqueue(ops, written, due)
        if due:
            return self._enqueue(None, None, True)
        return None

    def drain(self, timeout_s: float = JOIN_S) -> bool:
        """Wait until the publisher thread has handled everything queued so far (tests, close,
        rekey); False if it did not within ``timeout_s``."""
        if not self._thread.is_alive():
            return True
        done = threading.Event()
        self._queue.append((_MARK, done))
        self._wake.set()
        return done.wait(timeout_s)

    def _current_info(self) -> wire.InstanceInfo:
        """A copy of the instance info with fresh rates (the thread encodes it later)."""
        h2d, storage = (float(r) for r in self.rates())
        return msgspec.structs.replace(self._info, h2d_gbps=h2d, storage_gbps=storage)

    def _enqueue(self, ops, written, with_info: bool, records: list | None = None) -> int:
        """Give the hooks' ``ops`` and the L3 writer's ``written`` (or ready ``records``) the
        next sequence number and queue them; when the publisher thread is ``queue_batches``
        behind, keep their facts for the mirror but drop the batch (counted): never wait."""
        self.seq += 1
        info = None
        if with_info:
            info = self._current_info()
            self._last_info = time.monotonic()
        q = self._queue
        if len(q) >= self._max_queued:
            # The number is spent: subscribers see the gap and take a snapshot of the mirror,
            # which gets these facts ahead of the next batch that is queued.
            self._overflow.append((ops, written, records))
            self.counters["dropped_batches"] += 1
        else:
            before = self._overflow
            if before:  # handed over whole: the thread must not see later appends
                self._overflow = []
            else:
                before = ()
            q.append((_BATCH, self.seq, time.time(), ops, written, records, info, before))
            if 2 * len(q) >= self._max_queued:
                self._wake.set()
        self.counters["batches"] += 1
        return self.seq

    # -- the mirror (publisher thread) ---------------------------------------------------------

    def _resolve(self, ops: list | None, written: list | None) -> list:
        """The hooks' records against the mirror: compact records in order (see ``_build``)."""
        out: list[tuple] = []
        dead: set[str] = set()
        counters = self.counters
        for kind, medium, data in ops or ():
            if kind == _STORED:
                for chunk in data:
                    self._store(medium, chunk, out)
            elif kind == _REMOVED:
                held = self._held[medium]
                gone = held.intersection(data.get() if data.__class__ is _Lazy else data)
                if gone:
                    held -= gone
                    dead |= gone
                    out.append((_REMOVED, medium, gone))
                    counters[_REMOVED_PAGES[medium]] += len(gone)
            else:
                for m in MEDIA if medium is None else (medium,):
                    dead |= self._held[m]
                    self._held[m] = set()
                out.append((_CLEARED, medium))
        for hashes in written or ():
            self._store_written(hashes, out)
        # Records of pages no medium holds any more go only now: a storage write resolved above
        # may name a page whose host copy was evicted in the same step.
        if dead:
            dead -= self._held[MEDIUM_DEVICE]
            dead -= self._held[MEDIUM_HOST]
            dead -= self._held[MEDIUM_STORAGE]
            pop = self._pages.pop
            for h in dead:
                pop(h, None)
        return out

    def _store(self, medium: str, chunk: tuple, out: list) -> None:
        """Record the chunk's pages ``medium`` does not hold yet, one record per run of them:
        ``(_STORED, medium, hashes, parent, key, first token, end token, namespace)`` (the key
        is sliced on the publisher thread: node keys are replaced, never changed in place)."""
        hashes, first, up, key, ns = chunk
        if hashes.__class__ is _Lazy or up.__class__ is _Lazy:
            hashes = hashes.get() if hashes.__class__ is _Lazy else hashes
            up = up.get()[-1] if up.__class__ is _Lazy else up
            chunk = (hashes, first, up, key, ns)  # the mirror keeps hashes, not _Lazy
        held, P = self._held[medium], self.P
        n = len(hashes)
        span = hashes[first:] if first else hashes
        if held.isdisjoint(span):  # the common case: every page is new here
            self._add(held, chunk, span)
            out.append(
                (
                    _STORED,
                    medium,
                    span,
                    hashes[first - 1] if first else up,
                    key,
                    first * P,
                    n * P,
                    ns,
                )
            )
            self.counters[_STORED_PAGES[medium]] += n - first
            return
        i = first
        while i < n:  # runs of new pages between pages already held
            while i < n and hashes[i] in held:
                i += 1
            j = i
            while j < n and hashes[j] not in held:
                j += 1
            if j > i:
                run = hashes[i:j]
                self._add(held, chunk, run)
                out.append(
                    (_STORED, medium, run, hashes[i - 1] if i else up, key, i * P, j * P, ns)
                )
                self.counters[_STORED_PAGES[medium]] += j - i
            i = j

    def _add(self, held: set[str], chunk: tuple, run: list[str]) -> None:
        held.update(run)
        # Re-pointing a page another medium holds at this chunk is harmless: a hash names its
        # whole prefix, so every chunk that has it says the same about it.
        self._pages.update(zip(run, itertools.repeat(chunk)))

    def _store_written(self, hashes: list[str], out: list) -> None:
        held, pages, P = self._held[MEDIUM_STORAGE], self._pages, self.P
        for h in hashes:
            page = pages.get(h)
            if page is None:  # on no medium as published (cannot happen: host-pinned)
                self.counters["storage_unknown_pages"] += 1
                continue
            if h in held:
                continue
            held.add(h)
            chain, _, up, key, ns = page
            i = chain.index(h, page[1])
            out.append(
                (
                    _STORED,
                    MEDIUM_STORAGE,
                    [h],
                    chain[i - 1] if i else up,
                    key,
                    i * P,
                    (i + 1) * P,
                    ns,
                )
            )
            self.counters[_STORED_PAGES[MEDIUM_STORAGE]] += 1

    # -- snapshots -----------------------------------------------------------------------------

    def snapshot(self) -> wire.KVEventBatch:
        """Everything each medium holds as of ``self.seq``, as one batch (waits for the
        publisher thread)."""
        self.drain()
        records = _snapshot_records(self._held, self._pages, self.P)
        return wire.KVEventBatch(
            ts=time.time(), events=self._build(records), instance=self._current_info()
        )

    # -- the publisher thread ------------------------------------------------------------------

    def _run(self) -> None:
        """Every ``PUBLISH_INTERVAL_S`` (or when woken): send what ``flush`` queued, in order,
        then answer snapshot requests (between two batches: the mirror is at one of them)."""
        q, wake, router = self._queue, self._wake, self.publisher.router
        while True:
            wake.wait(PUBLISH_INTERVAL_S)
            wake.clear()  # before popping: a later set() is not lost
            while q:
                item = q.popleft()
                kind = item[0]
                if kind == _STOP:
                    return
                try:
                    if kind == _BATCH:
                        self._send_batch(*item[1:])
                    else:
                        item[1].set()
                except Exception as e:  # never kill the thread: the next batch may go out
                    self.counters["publish_errors"] += 1
                    log.warning("kv events: publisher thread: %s", e)
            if router is not None:
                try:
                    for frames in self.publisher.requests():
                        self._answer(frames)
                except zmq.ZMQError as e:
                    self.counters["snapshot_errors"] += 1
                    log.warning("kv events: snapshot endpoint: %s", e)

    def _send_batch(self, seq: int, ts: float, ops, written, records, info, before) -> None:
        """Resolve, build, encode and send one batch (after the facts of dropped ones)."""
        for o, w, r in before:  # dropped batches: their facts only
            if r is None:
                self._resolve(o, w)
        if records is None:
            records = self._resolve(ops, written)
        self._mirror_seq = seq
        if info is not None:
            self._sent_info = info
        self.counters["events"] += len(records)
        batch = wire.KVEventBatch(ts=ts, events=self._build(records), instance=info)
        try:
            self.publisher.send((wire.seq_bytes(seq), wire.encode(batch)))
        except zmq.ZMQError as e:
            # Never the engine's problem: the number is spent, so subscribers see a gap and
            # recover from a snapshot.
            self.counters["publish_errors"] += 1
            log.warning("kv events: batch %d not sent: %s", seq, e)

    def _build(self, records: list) -> list:
        """Wire events from compact records, merging stored runs that continue each other
        (same medium, parent = the previous run's last page, same namespace) into one
        BlockStored."""
        events: list = []
        P = self.P
        hexb = bytes.fromhex
        i, n = 0, len(records)
        while i < n:
            r = records[i]
            kind = r[0]
            if kind == _REMOVED:
                events.append(wire.BlockRemoved(list(map(hexb, r[2])), r[1]))
                i += 1
                continue
            if kind == _CLEARED:
                events.append(wire.AllBlocksCleared(r[1]))
                i += 1
                continue
            _, medium, hashes, parent, key, a, b, ns = r
            j = i + 1
            last = hashes[-1]
            while j < n:
                s = records[j]
                if s[0] != _STORED or s[1] != medium or s[3] != last or s[7] != ns:
                    break
                last = s[2][-1]
                j += 1
            if j == i + 1:
                raws = list(map(hexb, hashes))
                tokens = key[a:b] if (a or b != len(key)) else list(key)
            else:
                run = records[i:j]
                raws = list(map(hexb, itertools.chain.from_iterable(x[2] for x in run)))
                tokens = list(itertools.chain.from_iterable(x[4][x[5] : x[6]] for x in run))
            events.append(
                wire.BlockStored(
                    block_hashes=raws,
                    parent_block_hash=hexb(parent) if parent is not None else None,
                    token_ids=tokens,
                    block_size=P,
                    lora_id=None,
                    medium=medium,
                    lora_name=None,
                    namespace=self._namespace_hex(ns),
                )
            )
            i = j
        return events

    def _namespace_hex(self, ns: Hashable) -> str | None:
        try:
            return self._ns_hex[ns]
        except KeyError:
            out = None if ns is None else canonical_namespace(ns).hex()
            self._ns_hex[ns] = out
            return out

    def _answer(self, frames: list[bytes]) -> None:
        """Reply to one request: ``[identity, b"", msgpack SnapshotRequest]`` (REQ or DEALER)
        with the mirror between two batches, labelled with the last one applied; anything else
        is counted and refused (or dropped when it cannot be replied to)."""
        if len(frames) < 2:
            self.counters["snapshot_malformed"] += 1
            return
        identity, body = frames[0], frames[1:]
        if body and body[0] == b"":
            body = body[1:]
        if len(body) != 1:
            return self._refuse(identity, "malformed", "expected one SnapshotRequest frame")
        try:
            req = wire.decode_request(body[0])
        except Exception as e:  # anything undecodable is the peer's problem, not the cache's
            return self._refuse(identity, "malformed", f"undecodable request ({e})")
        peers = self.config.snapshot_peers
        if peers is not None and req.peer not in peers:
            return self._refuse(identity, "unknown_peer", f"peer {req.peer!r} is not allowed")
        if req.instance_id != self.instance_id:
            return self._refuse(
                identity,
                "unknown_instance",
                f"this is {self.instance_id!r}, not {req.instance_id!r}",
            )
        seq = self._mirror_seq
        records = _snapshot_records(self._held, self._pages, self.P)
        snap = wire.KVEventBatch(
            ts=time.time(), events=self._build(records), instance=self._sent_info
        )
        payload = wire.encode(snap)
        # Counted first: a subscriber holding the reply may look at the count at once.
        self.counters["snapshots_served"] += 1
        self.publisher.reply([identity, b"", b"OK", wire.seq_bytes(seq), payload])

    def _refuse(self, identity: bytes, why: str, message: str) -> None:
        self.counters[f"snapshot_refused_{why}"] += 1
        log.warning("kv events: snapshot request refused: %s", message)
        self.publisher.reply([identity, b"", b"ERR", message.encode("utf-8")])

    def close(self) -> None:
        """Publish that this instance holds nothing any more, and release the sockets."""
        if self._closed:
            return
        try:
            self.cleared()
            self.flush()
        finally:
            self._closed = True
            self._queue.append((_STOP,))
            self._wake.set()
            self._thread.join(JOIN_S)
            if self._thread.is_alive():  # its sockets are its own: leave them to the process
                log.warning("kv events: publisher thread did not stop within %.1f s", JOIN_S)
            else:
                self.publisher.close()


def _snapshot_records(held: dict[str, set[str]], pages: dict[str, tuple], P: int) -> list:
    """Records (as ``_resolve`` makes) of everything ``held`` names, after AllBlocksCleared."""
    out: list[tuple] = [(_CLEARED, None)]
    for medium in MEDIA:
        by_chunk: dict[int, list[str]] = {}
        for h in held[medium]:
            by_chunk.setdefault(id(pages[h]), []).append(h)
        for hs in by_chunk.values():
            # In chunk order, so that pages of one node merge into one event.
            chunk = pages[hs[0]]
            chain, _, up, key, ns = chunk
            where = {h: i for i, h in enumerate(chain)}
            for h in sorted(hs, key=where.__getitem__):
                i = where[h]
                out.append(
                    (_STORED, medium, [h], chain[i - 1] if i else up, key, i * P, (i + 1) * P, ns)
                )
    return out


def _medium(medium: str) -> str:
    if medium not in MEDIA:
        raise ValueError(f"medium: {medium!r} is not one of {MEDIA}")
    return medium
