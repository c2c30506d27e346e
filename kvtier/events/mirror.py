"""``Mirror``: what each medium holds as published, i.e. what subscribers know.

The publisher thread resolves a step's records against it (a page stored twice, or removed
where it was not, publishes nothing) and turns them straight into wire events; snapshots are
built from it. It is touched by the publisher thread only, except while that thread is idle
(``EventSink.drain`` returned and no flush came since).

Each medium maps the hashes it holds to their chunk ``(hashes, first, hash before the node, node
key, namespace)`` (see ``kvtier.events.nodes``), shared by all the chunk's pages, so recording a
node is a few C-level bulk operations; the page's place in the chunk is looked up only where its
parent or tokens are needed (storage events, snapshots).

Storage: a page is stored once every pool holding a FULL page's bytes was written for it (``kv``,
and the FULL-anchored sidecars; a logical FULL pool has no bytes, so only its sidecars count):
the writer reports ``(pool, hash)`` pairs, possibly over several jobs.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Hashable

from kvtier.events import wire
from kvtier.events.config import MEDIA, MEDIUM_STORAGE
from kvtier.events.nodes import Lazy, chunk_hashes
from kvtier.storage.keys import canonical_namespace

__all__ = ["CLEARED", "REMOVED", "STORED", "Mirror", "page_info"]

STORED, REMOVED, CLEARED = 0, 1, 2
_STORED_PAGES = {m: f"stored_pages.{m}" for m in MEDIA}
_REMOVED_PAGES = {m: f"removed_pages.{m}" for m in MEDIA}
_hexb = bytes.fromhex


def page_info(h: str, chunk: tuple, P: int, i: int | None = None) -> tuple:
    """``(parent hash, token ids, namespace)`` of page ``h`` of ``chunk`` (at ``i`` if known)."""
    hashes, first, up, key, ns = chunk
    if i is None:
        i = hashes.index(h, first)
    return (hashes[i - 1] if i else up), key[i * P : (i + 1) * P], ns


class _Events:
    """Wire events under construction: a stored run that continues the previous BlockStored
    (same medium and namespace, parent = its last page) extends it instead of starting one."""

    __slots__ = ("P", "events", "ns_hex", "tail")

    def __init__(self, P: int, ns_hex: Callable[[Hashable], str | None]) -> None:
        self.P, self.ns_hex = P, ns_hex
        self.events: list = []
        self.tail: str | None = None  # the last page of the last event, if a BlockStored

    def stored(self, medium: str, run: list[str], parent: str | None, tokens: list[int], ns):
        events = self.events
        if self.tail is not None and parent == self.tail:
            last = events[-1]
            if last.medium == medium and last.namespace == self.ns_hex(ns):
                last.block_hashes += map(_hexb, run)
                last.token_ids += tokens
                self.tail = run[-1]
                return
        events.append(
            wire.BlockStored(
                list(map(_hexb, run)),
                None if parent is None else _hexb(parent),
                tokens,
                self.P,
                None,
                medium,
                None,
                self.ns_hex(ns),
            )
        )
        self.tail = run[-1]

    def reset(self) -> list:
        """Start a new batch; returns the events of the last one."""
        events, self.events, self.tail = self.events, [], None
        return events

    def other(self, event) -> None:
        self.events.append(event)
        self.tail = None


class Mirror:
    """The pages each medium holds as published.

    Args:
        page_size: tokens per page.
        counters: where published pages are counted (the sink's).
    """

    def __init__(self, page_size: int, counters: Counter[str]) -> None:
        self.P = page_size
        self.counters = counters
        # medium -> {hash: its chunk} (see page_info): one bulk update records a node's pages
        # with what a snapshot or a storage event needs about them.
        self.held: dict[str, dict[str, tuple]] = {m: {} for m in MEDIA}
        # Storage pages some but not all of whose pools were written: hash -> pools written.
        self.partial: dict[str, set[str]] = {}
        self._ns_hex: dict[Hashable, str | None] = {}

    def events(self) -> _Events:
        return _Events(self.P, self.namespace_hex)

    def namespace_hex(self, ns: Hashable) -> str | None:
        try:
            return self._ns_hex[ns]
        except KeyError:
            out = self._ns_hex[ns] = None if ns is None else canonical_namespace(ns).hex()
            return out

    def chunk_of(self, h: str) -> tuple | None:
        """The chunk of page ``h`` as some medium holds it; None: no medium does."""
        for held in self.held.values():
            chunk = held.get(h)
            if chunk is not None:
                return chunk
        return None

    def apply(self, ops, written, out: _Events | None) -> None:
        """Resolve the hooks' ``ops`` and the L3 writer's ``written`` into the mirror, adding
        what changed to ``out`` (None: the mirror only, for a dropped batch)."""
        counters, held_by, partial = self.counters, self.held, self.partial
        # Pages this step removed from the device or host, with their chunks: an L3 write the
        # same step finished was of a page then still held (its host copy is pinned while it is
        # written), so it is stored even where the step's eviction came first (it was published
        # as lost before). What was written of pages gone from every medium is forgotten after.
        dropped: dict[str, tuple] = {}
        forget: list = []
        for kind, medium, data in ops or ():
            if kind == STORED:
                for chunk in data:
                    self._store(medium, chunk, out)
            elif kind == REMOVED:
                held = held_by[medium]
                gone = held.keys() & (data.get() if data.__class__ is Lazy else data)
                if gone:
                    pop = held.pop
                    for h in gone:
                        dropped[h] = pop(h)
                    if out is not None:
                        out.other(wire.BlockRemoved(list(map(_hexb, gone)), medium))
                    counters[_REMOVED_PAGES[medium]] += len(gone)
                    forget.append(gone)
            else:
                for m in MEDIA if medium is None else (medium,):
                    gone, held_by[m] = held_by[m], {}
                    if m != MEDIUM_STORAGE:
                        dropped.update(gone)
                    forget.append(gone)
                if medium in (None, MEDIUM_STORAGE):
                    partial.clear()
                if out is not None:
                    out.other(wire.AllBlocksCleared(medium))
        for group, pairs in written or ():
            self._store_written(group, pairs, out, dropped)
        if partial:
            for gone in forget:
                self._forget(gone)

    def _forget(self, gone) -> None:
        """Forget what was written of pages no medium holds any more."""
        for h in gone:
            if h in self.partial and self.chunk_of(h) is None:
                del self.partial[h]

    def _store(self, medium: str, chunk: tuple, out: _Events | None) -> None:
        """The chunk's pages ``medium`` does not hold yet, one event run per run of them."""
        hashes, first, up, key, ns = chunk
        if hashes.__class__ is Lazy or up.__class__ is Lazy:  # the mirror keeps hashes only
            chunk = chunk_hashes(chunk)
            hashes, up = chunk[0], chunk[2]
        held, P = self.held[medium], self.P
        n = len(hashes)
        span = hashes[first:] if first else hashes
        if held.keys().isdisjoint(span):  # the common case: every page is new here
            held.update(zip(span, itertools.repeat(chunk)))
            if out is not None and span:
                parent = hashes[first - 1] if first else up
                out.stored(medium, span, parent, key[first * P : n * P], ns)
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
                held.update(zip(run, itertools.repeat(chunk)))
                if out is not None:
                    out.stored(medium, run, hashes[i - 1] if i else up, key[i * P : j * P], ns)
                self.counters[_STORED_PAGES[medium]] += j - i
            i = j

    def _store_written(
        self, group: tuple[str, ...], pairs, out: _Events | None, dropped: dict[str, tuple]
    ) -> None:
        """``pairs`` of ``(pool, hash)`` written to L3; ``group``: the pools of a FULL page;
        ``dropped``: chunks of pages the same step removed from the other media."""
        held, partial, P = self.held[MEDIUM_STORAGE], self.partial, self.P
        whole = len(group) == 1
        for pool, h in pairs:
            if pool not in group or h in held:
                continue
            if not whole:
                done = partial.setdefault(h, set())
                done.add(pool)
                if len(done) < len(group):
                    continue
                del partial[h]
            # Re-pointing a page at another medium's chunk is harmless: a hash names its whole
            # prefix, so every chunk that has it says the same about it.
            page = self.chunk_of(h) or dropped.get(h)
            if page is None:  # on no medium as published (cannot happen: host-pinned)
                self.counters["storage_unknown_pages"] += 1
                continue
            held[h] = page
            chain, first, up, key, ns = page
            i = chain.index(h, first)
            if out is not None:
                parent = chain[i - 1] if i else up
                out.stored(MEDIUM_STORAGE, [h], parent, key[i * P : (i + 1) * P], ns)
            self.counters[_STORED_PAGES[MEDIUM_STORAGE]] += 1

    def snapshot(self, out: _Events) -> None:
        """Everything held, after AllBlocksCleared: a chunk's pages in chain order, so that
        consecutive ones merge into one event."""
        out.other(wire.AllBlocksCleared())
        P = self.P
        for medium in MEDIA:
            by_chunk: dict[int, tuple[tuple, list[str]]] = {}
            for h, chunk in self.held[medium].items():
                by_chunk.setdefault(id(chunk), (chunk, []))[1].append(h)
            for chunk, hs in by_chunk.values():
                chain, _, up, key, ns = chunk
                where = {h: i for i, h in enumerate(chain)}
                idx = sorted(where[h] for h in hs)
                a = 0
                while a < len(idx):  # runs of consecutive pages
                    b = a + 1
                    while b < len(idx) and idx[b] == idx[b - 1] + 1:
                        b += 1
                    i, j = idx[a], idx[b - 1] + 1
                    parent = chain[i - 1] if i else up
                    out.stored(medium, chain[i:j], parent, key[i * P : j * P], ns)
                    a = b

    def rekey(self, page_hash: Callable[[list[int], Hashable, str | None], str]):
        """Translate every page held to its hash under a new seed; ``page_hash(tokens,
        namespace, parent's new hash or None under the root)`` hashes one page. Returns the
        translation (old hash -> new, None where its prefix is not known) for records taken
        under the old seed."""
        P, chunk_of = self.P, self.chunk_of
        tr: dict[str, str | None] = {}

        def translate(h: str) -> str | None:
            path = []
            while h is not None and h not in tr:
                page = chunk_of(h)
                if page is None:  # a parent no medium holds: the chain cannot be rebuilt
                    tr[h] = None
                    break
                path.append((h, page))
                h = page_info(h, page, P)[0]
            prev = tr[h] if h is not None else None
            for x, page in reversed(path):
                parent, tokens, ns = page_info(x, page, P)
                if parent is not None and prev is None:
                    tr[x] = None
                    continue
                tr[x] = prev = page_hash(tokens, ns, prev)
            return tr[path[0][0]] if path else tr.get(h)

        fresh: dict[str, tuple] = {}
        held: dict[str, dict[str, tuple]] = {m: {} for m in MEDIA}
        for m in MEDIA:
            for h, chunk in self.held[m].items():
                nh = translate(h)
                if nh is None:
                    self.counters["rekey_dropped_pages"] += 1
                    continue
                if nh not in fresh:
                    parent, tokens, ns = page_info(h, chunk, P)
                    fresh[nh] = ([nh], 0, tr.get(parent) if parent else None, tokens, ns)
                held[m][nh] = fresh[nh]
        self.held = held
        self.partial.clear()
        return translate
