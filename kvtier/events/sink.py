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

Hooks only record the pages (hashes computed then, while the node is what the fact is about);
``flush`` (from ``poll``) turns them into events against a mirror of what each medium holds as
published (a page stored twice, or removed where it was not, publishes nothing), publishes one
``KVEventBatch`` with the next sequence number, and answers snapshot requests with the mirror.

Events report FULL (KV) pages only: a hybrid model's SWA window and Mamba state are not
reported, so a router's hit length is an upper bound there. Storage reports what this instance
wrote; pages a shared store evicts, or that other instances wrote, are not reported.
"""

from __future__ import annotations

import itertools
import logging
import os
import socket
import time
from collections import Counter, deque
from collections.abc import Callable, Hashable

import zmq

from kvtier.events import wire
from kvtier.events.config import MEDIA, MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_STORAGE, EventsConfig
from kvtier.events.keys import KeySeed
from kvtier.events.publisher import Publisher
from kvtier.storage.keys import canonical_namespace, page_hashes

__all__ = ["EventSink"]

log = logging.getLogger(__name__)

_STORED, _REMOVED, _CLEARED = 0, 1, 2
REQUEST_CHECK_S = 0.005  # how often flush() looks for snapshot requests
_STORED_PAGES = {m: f"stored_pages.{m}" for m in MEDIA}
_REMOVED_PAGES = {m: f"removed_pages.{m}" for m in MEDIA}


# A page as a stored event describes it, kept while some medium holds it: the registry maps its
# hash to its chunk ``(hashes, first, hash before the node, node key, namespace)`` (see
# ``_chunks``), shared by all the chunk's pages, so recording a node is a few C-level bulk
# operations, not Python work per page; the page's place in the chunk is looked up only where
# its parent or tokens are needed (storage events, snapshots). Node keys and hash lists are
# replaced on a split, never changed in place, so a chunk stays valid.


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
        self._next_requests = float("-inf")
        self._closed = False

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
        """Hex hashes of the pages ``medium`` holds as published so far."""
        return set(self._held[_medium(medium)])

    # -- hooks ---------------------------------------------------------------------------------

    def device_stored(self, node) -> None:
        self._ops.append((_STORED, MEDIUM_DEVICE, self._chunks(node, node.start)))

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
        self._ops.append((_REMOVED, MEDIUM_DEVICE, self._hashes(node)))

    def backup_started(self, backup) -> None:
        # The pages are taken now: a node of the chain may be split before the copy is acked.
        self._backups[id(backup)] = [c for x in backup.nodes for c in self._chunks(x, x.start)]

    def backup_done(self, backup) -> None:
        records = self._backups.pop(id(backup), None)
        if records:
            self._ops.append((_STORED, MEDIUM_HOST, records))

    def host_grafted(self, node) -> None:
        self._ops.append((_STORED, MEDIUM_HOST, self._chunks(node, node.start)))

    def host_removed(self, node) -> None:
        self._ops.append((_REMOVED, MEDIUM_HOST, self._hashes(node)))

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

    def _hashes(self, node) -> list[str]:
        """``node``'s page hashes, filling in those of it and its ancestors that lack them (the
        same chain and field as the L3 tier's ``node_hashes``)."""
        if node.page_hashes is not None:
            return node.page_hashes
        path, x = [], node
        while x.parent is not None and x.page_hashes is None:
            path.append(x)
            x = x.parent
        prev = x.page_hashes[-1] if x.parent is not None and x.page_hashes else None
        seed = self.seed
        for y in reversed(path):
            # Seeding the chain with the cached digest (what page_hashes does with no prev)
            # saves hashing the namespace again for every node under the root.
            ns = seed.namespace(y.namespace)
            start = prev if prev is not None else seed.digest_hex(y.namespace)
            y.page_hashes = page_hashes(y.key, ns, start)
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
            hashes = self._hashes(x)
            parent = x.parent
            up = parent.page_hashes[-1] if parent.parent is not None else None
            chunks.append((hashes, max(0, start - x.start) // P, up, x.key, x.namespace))
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
        if self._ops or self._written:
            events = self._resolve()
            if events:
                self._publish(events, with_info=False)
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
                nhs = [translate(h) for h in hashes[first:]]
                if None not in nhs:
                    moved.append((nhs, 0, translate(up) if up else None, k[first * P :], ns))
            self._backups[key] = moved
        self.seed, self._held, self._pages = new, held, fresh
        self._info.salt, self._info.tp_size = salt, tp_size
        self.counters["rekeys"] += 1
        self._publish(self.snapshot().events, with_info=True)

    # -- per step ------------------------------------------------------------------------------

    def flush(self) -> int | None:
        """Publish what happened since the last flush as one batch (or a heartbeat when due),
        then answer waiting snapshot requests. Returns the batch's sequence number, or None
        when nothing was published."""
        if self._closed:
            return None
        seq = None
        now = time.monotonic()
        # Routers get the instance's rates with the first batch, then once per heartbeat.
        due = now - self._last_info >= self.config.heartbeat_s
        if self._ops or self._written:
            events = self._resolve()
            if events:
                seq = self._publish(events, with_info=due)
        if seq is None and due:
            seq = self._publish([], with_info=True)
        if self.publisher.router is not None and now >= self._next_requests:
            # Looked at every few milliseconds, not every step: a snapshot is rare, a step is
            # not, and the socket check costs more than the rest of an idle flush.
            self._next_requests = now + REQUEST_CHECK_S
            for frames in self.publisher.requests():
                self._answer(frames)
        return seq

    def _resolve(self) -> list:
        ops, self._ops = self._ops, []
        out = _Events(self)
        dead: set[str] = set()
        for kind, medium, data in ops:
            if kind == _STORED:
                for chunk in data:
                    self._store(medium, chunk, out)
            elif kind == _REMOVED:
                held = self._held[medium]
                gone = held.intersection(data)
                if gone:
                    held -= gone
                    dead |= gone
                    out.add(wire.BlockRemoved(list(map(bytes.fromhex, gone)), medium))
                    self.counters[_REMOVED_PAGES[medium]] += len(gone)
            else:
                for m in MEDIA if medium is None else (medium,):
                    dead |= self._held[m]
                    self._held[m] = set()
                out.add(wire.AllBlocksCleared(medium))
        while self._written:
            self._store_written(self._written.popleft(), out)
        # Records of pages no medium holds any more go only now: a storage write resolved above
        # may name a page whose host copy was evicted in the same step.
        if dead:
            dead -= self._held[MEDIUM_DEVICE]
            dead -= self._held[MEDIUM_HOST]
            dead -= self._held[MEDIUM_STORAGE]
            pop = self._pages.pop
            for h in dead:
                pop(h, None)
        return out.close()

    def _store(self, medium: str, chunk: tuple, out: _Events) -> None:
        """Record the chunk's pages ``medium`` does not hold yet, one event per run of them."""
        hashes, first, up, key, ns = chunk
        held, P = self._held[medium], self.P
        n = len(hashes)
        span = hashes[first:] if first else hashes
        if held.isdisjoint(span):  # the common case: every page is new here
            self._add(held, chunk, span, first)
            out.stored(medium, span, hashes[first - 1] if first else up, key[first * P :], ns)
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
                self._add(held, chunk, run, i)
                out.stored(medium, run, hashes[i - 1] if i else up, key[i * P : j * P], ns)
                self.counters[_STORED_PAGES[medium]] += j - i
            i = j

    def _add(self, held: set[str], chunk: tuple, run: list[str], i: int) -> None:
        held.update(run)
        # Re-pointing a page another medium holds at this chunk is harmless: a hash names its
        # whole prefix, so every chunk that has it says the same about it.
        self._pages.update(zip(run, itertools.repeat(chunk)))

    def _store_written(self, hashes: list[str], out: _Events) -> None:
        held, pages, P = self._held[MEDIUM_STORAGE], self._pages, self.P
        for h in hashes:
            page = pages.get(h)
            if page is None:  # on no medium as published (cannot happen: host-pinned)
                self.counters["storage_unknown_pages"] += 1
                continue
            if h in held:
                continue
            held.add(h)
            parent, tokens, ns = _page_info(h, page, P)
            out.stored(MEDIUM_STORAGE, [h], parent, tokens, ns)
            self.counters[_STORED_PAGES[MEDIUM_STORAGE]] += 1

    def _namespace_hex(self, ns: Hashable) -> str | None:
        try:
            return self._ns_hex[ns]
        except KeyError:
            out = None if ns is None else canonical_namespace(ns).hex()
            self._ns_hex[ns] = out
            return out

    def _current_info(self) -> wire.InstanceInfo:
        info = self._info
        info.h2d_gbps, info.storage_gbps = (float(r) for r in self.rates())
        return info

    def _publish(self, events: list, with_info: bool) -> int:
        self.seq += 1
        batch = wire.KVEventBatch(
            ts=time.time(), events=events, instance=self._current_info() if with_info else None
        )
        try:
            self.publisher.send((wire.seq_bytes(self.seq), wire.encode(batch)))
        except zmq.ZMQError as e:
            # Never the engine's problem: the number is spent, so subscribers see a gap and
            # recover from a snapshot.
            self.counters["publish_errors"] += 1
            log.warning("kv events: batch %d not sent: %s", self.seq, e)
        if with_info:
            self._last_info = time.monotonic()
        self.counters["batches"] += 1
        self.counters["events"] += len(events)
        return self.seq

    # -- snapshots -----------------------------------------------------------------------------

    def snapshot(self) -> wire.KVEventBatch:
        """Everything each medium holds as of ``self.seq``, as one batch."""
        out = _Events(self)
        out.add(wire.AllBlocksCleared())
        pages, P = self._pages, self.P
        for medium in MEDIA:
            # In chunk order, so that pages of one node (and of a path) merge into one event.
            by_chunk: dict[int, list[str]] = {}
            for h in self._held[medium]:
                by_chunk.setdefault(id(pages[h]), []).append(h)
            for hs in by_chunk.values():
                # In chunk order, so that pages of one node merge into one event.
                chunk = pages[hs[0]]
                where = {h: i for i, h in enumerate(chunk[0])}
                for h in sorted(hs, key=where.__getitem__):
                    parent, tokens, ns = _page_info(h, chunk, P, where[h])
                    out.stored(medium, [h], parent, tokens, ns)
        return wire.KVEventBatch(ts=time.time(), events=out.close(), instance=self._current_info())

    def _answer(self, frames: list[bytes]) -> None:
        """Reply to one request: ``[identity, b"", msgpack SnapshotRequest]`` (REQ or DEALER);
        anything else is counted and refused (or dropped when it cannot be replied to)."""
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
        payload = wire.encode(self.snapshot())
        self.publisher.reply([identity, b"", b"OK", wire.seq_bytes(self.seq), payload])
        self.counters["snapshots_served"] += 1

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
            self.publisher.close()


class _Events:
    """Builds a batch's events in order, merging stored pages that continue each other (same
    medium, parent = the open event's last page, same namespace) into one BlockStored."""

    __slots__ = ("_open", "_sink", "events")

    def __init__(self, sink: EventSink) -> None:
        self._sink = sink
        self.events: list = []
        self._open: list | None = None  # [medium, hash runs, tokens, last hash, ns, parent]

    def add(self, event) -> None:
        self._flush()
        self.events.append(event)

    def stored(self, medium: str, hashes: list[str], parent, tokens: list, ns) -> None:
        """A run of pages new on ``medium``: their hashes, the hash before the first, and their
        tokens (lists the caller hands over)."""
        o = self._open
        if o is None or o[0] != medium or o[3] != parent or o[4] != ns:
            self._flush()
            self._open = [medium, [hashes], tokens, hashes[-1], ns, parent]
            return
        o[1].append(hashes)
        o[2] += tokens
        o[3] = hashes[-1]

    def _flush(self) -> None:
        o = self._open
        if o is None:
            return
        self._open = None
        medium, runs, tokens, _, ns, parent = o
        sink = self._sink
        raws = list(map(bytes.fromhex, runs[0] if len(runs) == 1 else itertools.chain(*runs)))
        self.events.append(
            wire.BlockStored(
                block_hashes=raws,
                parent_block_hash=bytes.fromhex(parent) if parent is not None else None,
                token_ids=tokens,
                block_size=sink.P,
                lora_id=None,
                medium=medium,
                lora_name=None,
                namespace=sink._namespace_hex(ns),
            )
        )

    def close(self) -> list:
        self._flush()
        return self.events


def _medium(medium: str) -> str:
    if medium not in MEDIA:
        raise ValueError(f"medium: {medium!r} is not one of {MEDIA}")
    return medium
