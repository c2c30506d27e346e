"""Prefetch from L3: a background existence query and page reads, then a graft.

One prefetch, :class:`Prefetch`, goes through three states; the scheduler thread moves it on in
``L3Tier.poll`` only on values every TP rank agreed on, so all trees change identically:

    query  the query thread asks the backend how many leading pages exist (all pools under their
           hit policies); agreed: MIN of the hit pages -> revoke, or allocate host slots and load.
           A hit the host cannot take, even after evicting host leaves (already in L3), is cut:
           FULL-only models read the pages that fit; models with SWA or Mamba query again for
           the longest prefix that fits and still has its window and state (``cut_pages``),
           and are revoked (``RevokeReason.HOST_CAPACITY``) if there is none
    load   the IO thread reads KV pages in batches into the prefetch's host slots, stopping at the
           first shortfall; the KV-anchored sidecars' pages (the DSA indexer, V4's compressed
           KV; in the KV pages' host pages) follow each batch, each pool reading only the
           pages every pool before it delivered, so a page counts only with all of them (with
           a logical FULL pool, the sidecars alone); only when every page arrived does it read
           the extra pools (SWA and its sidecars: the trailing window pages, all or nothing;
           Mamba: the state keyed by the last page)
    done   agreed termination (policy), then one packed MIN of [completed pages, SWA pages,
           Mamba state]; the agreed pages are grafted onto the tree as host-only nodes

A prefetch allocates its host slots from the tree's host pools and holds them outside the tree
(the tree's integrity check is told how many: ``L3Tier.held_by_ops``) until the graft hands the
used ones to the tree. Slots it did not graft are freed only once the IO thread is done with
them (agreed across ranks), so a read still in flight after a timeout or an abort never writes
into slots someone else owns (SGLang #31668).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Hashable
from dataclasses import dataclass, field
from enum import Enum

import torch

from kvtier.runtime.l3.pools import L3Pool
from kvtier.runtime.tree.node import TreeNode
from kvtier.runtime.tree.types import HostPinHandle
from kvtier.storage import ALL_PAGES, TRAILING_PAGES, PoolTransfer, PrefetchOutcome, StorageBackend

__all__ = ["Prefetch", "PrefetchWorkers", "RevokeReason"]

log = logging.getLogger(__name__)


class RevokeReason(str, Enum):
    """Why a prefetch was revoked before anything was grafted."""

    BELOW_THRESHOLD = "below_threshold"  # L3 holds less than ``prefetch_min_tokens`` more
    DECLINED = "declined"  # loading would be slower than recomputing
    HOST_CAPACITY = "host_capacity"  # no usable prefix fits the host pool
    TIMED_OUT = "timed_out"  # the existence query did not answer in time


@dataclass(eq=False)
class Prefetch:
    """One request's prefetch; returned by ``TieredKVCache.prefetch``.

    Attributes:
        tokens: the page-aligned tokens after the anchor that were looked up.
        state: "query", "load" or "done".
        outcome: how it ended (a ``PrefetchOutcome``), once done.
        reason: why it was revoked (a ``RevokeReason``), else None.
        planned_pages: agreed hit pages that were read (0 until loading).
        loaded_tokens: tokens grafted onto the tree from L3.
        loaded_range: the positions ``[start, end)`` of the request those tokens fill (the
            prompt's own positions), or None if nothing was grafted.
        cut_pages: 0, or the page count a host-capacity cut limited the re-query to.
    """

    anchor: TreeNode
    pin: HostPinHandle | None
    namespace: Hashable
    tokens: list[int]
    hashes: list[str]
    timeout_s: float
    start: float = field(default_factory=time.monotonic)
    state: str = "query"
    outcome: PrefetchOutcome | None = None
    reason: RevokeReason | None = None
    planned_pages: int = 0
    loaded_tokens: int = 0
    loaded_range: tuple[int, int] | None = None
    cut_pages: int = 0
    # query thread
    query_done: threading.Event = field(default_factory=threading.Event, repr=False)
    query_hits: int = 0
    # host slots held outside the tree until the graft (scheduler thread)
    kv_slots: torch.Tensor | None = field(default=None, repr=False)
    swa_pages: int = 0
    swa_slots: torch.Tensor | None = field(default=None, repr=False)
    mamba_slot: torch.Tensor | None = field(default=None, repr=False)
    leftovers: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    # IO thread progress, under ``mutex``
    mutex: threading.Lock = field(default_factory=threading.Lock, repr=False)
    completed_pages: int = 0
    swa_hit: int = 0
    mamba_hit: int = 0
    checksum_misses: int = 0
    cancel: threading.Event = field(default_factory=threading.Event, repr=False)
    io_done: threading.Event = field(default_factory=threading.Event, repr=False)

    @property
    def done(self) -> bool:
        return self.state == "done"

    def expired(self) -> bool:
        return time.monotonic() - self.start > self.timeout_s


class PrefetchWorkers:
    """The query thread and the IO thread, each serving its queue in order.

    Args:
        backend: the L3 store.
        pools: L3 pools by name.
        swa_window_pages: SWA window in pages (TRAILING_PAGES policy), or 0.
        kv_group: the pools holding a FULL page's bytes, in read order (ALL_PAGES).
        swa_group: the pools holding a SWA page's bytes (TRAILING_PAGES), or none.
    """

    def __init__(
        self,
        backend: StorageBackend,
        pools: dict[str, L3Pool],
        swa_window_pages: int,
        kv_group: list[str],
        swa_group: list[str],
    ):
        if not kv_group:
            raise ValueError("kv_group: a FULL page's bytes live in at least one pool")
        self.backend = backend
        self.pools = pools
        self.W = swa_window_pages
        self.kv_group = kv_group
        self.swa_group = swa_group
        self._queries: queue.Queue[Prefetch | None] = queue.Queue()
        self._loads: queue.Queue[Prefetch | None] = queue.Queue()
        self._threads = [
            threading.Thread(
                target=self._serve,
                args=(self._queries, self._query),
                name="kvtier-l3-query",
                daemon=True,
            ),
            threading.Thread(
                target=self._serve,
                args=(self._loads, self._load),
                name="kvtier-l3-prefetch",
                daemon=True,
            ),
        ]
        for t in self._threads:
            t.start()

    def query(self, op: Prefetch) -> None:
        self._queries.put(op)

    def load(self, op: Prefetch) -> None:
        self._loads.put(op)

    def close(self, timeout: float) -> None:
        self._queries.put(None)
        self._loads.put(None)
        for t in self._threads:
            t.join(timeout)

    @property
    def alive(self) -> bool:
        return any(t.is_alive() for t in self._threads)

    @staticmethod
    def _serve(q: queue.Queue, fn) -> None:
        while True:
            op = q.get()
            if op is None:
                return
            try:
                fn(op)
            except Exception:  # a backend bug must not kill the thread: the op reads as a miss
                log.exception("L3 prefetch of %d tokens failed", len(op.tokens))
            finally:
                if fn.__name__ == "_query":
                    op.query_done.set()
                else:
                    op.io_done.set()

    # -- query thread --------------------------------------------------------------------------

    def _query(self, op: Prefetch) -> None:
        if op.cancel.is_set():
            return
        hashes = op.hashes[: op.cut_pages] if op.cut_pages else op.hashes
        transfers = [PoolTransfer(n, hashes, policy=ALL_PAGES) for n in self.kv_group]
        transfers += [
            PoolTransfer(n, hashes, policy=TRAILING_PAGES(self.W)) for n in self.swa_group
        ]
        if "mamba" in self.pools:
            transfers.append(PoolTransfer("mamba", hashes, policy=TRAILING_PAGES(1)))
        op.query_hits = self.backend.exists(transfers)

    # -- IO thread -----------------------------------------------------------------------------

    def _get(self, op: Prefetch, transfers: list[PoolTransfer]):
        before = self.backend.metrics.snapshot()["checksum_miss_pages"]
        res = self.backend.get(transfers)
        misses = self.backend.metrics.snapshot()["checksum_miss_pages"] - before
        if misses:
            with op.mutex:
                op.checksum_misses += int(misses)
        return res

    def _read_pages(self, op: Prefetch, name: str, slots: torch.Tensor, hashes: list[str]) -> int:
        """Read one batch of ``name``'s pages into the pages of KV host ``slots``; returns the
        leading pages that arrived (and are in place)."""
        pool = self.pools[name]
        pages = pool.pages_of(slots)
        res = self._get(op, [PoolTransfer(name, hashes, pool.read_views(pages))])
        ok = res.hit_pages(name)
        pool.finish_read(pages, ok)
        return ok

    def _load(self, op: Prefetch) -> None:
        first = self.pools[self.kv_group[0]]
        P, B, n = first.P, first.batch_pages, op.planned_pages
        for i in range(0, n, B):
            if op.cancel.is_set():
                return
            j = min(i + B, n)
            slots, hashes = op.kv_slots[i * P : j * P], op.hashes[i:j]
            ok = j - i
            for name in self.kv_group:
                if not ok or op.cancel.is_set():
                    ok = 0
                    break
                # Each pool reads only the pages every pool before it delivered, so a partial
                # prefetch still hands over whole pages: every sidecar of a page, or none.
                ok = self._read_pages(op, name, slots[: ok * P], hashes[:ok])
            with (
                op.mutex
            ):  # pages [0, completed) are in place before they are counted (SGLang #8901)
                op.completed_pages = i + ok
            if ok < j - i:
                return
        # Extra pools only once every KV page arrived: a partial KV prefix would misalign them.
        transfers, swa_pages = [], None
        if self.swa_group and op.swa_pages:
            swa_pages = self.pools["swa"].pages_of(op.swa_slots)
            keys = op.hashes[n - op.swa_pages : n]
            for name in self.swa_group:  # sidecars' pages are their anchor's
                pool = self.pools[name]
                transfers.append(PoolTransfer(name, keys, pool.read_views(swa_pages)))
        if "mamba" in self.pools and op.mamba_slot is not None:
            views = self.pools["mamba"].read_views(op.mamba_slot)
            transfers.append(PoolTransfer("mamba", [op.hashes[n - 1]], views))
        if not transfers or op.cancel.is_set():
            return
        res = self._get(op, transfers)
        swa_ok = swa_pages is not None and all(all(res.ok[name]) for name in self.swa_group)
        if swa_ok:
            for name in self.swa_group:
                self.pools[name].finish_read(swa_pages, op.swa_pages)
        with op.mutex:
            op.swa_hit = op.swa_pages if swa_ok else 0
            op.mamba_hit = int("mamba" in res.ok and all(res.ok["mamba"]))
