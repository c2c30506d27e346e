"""The L3 tier of a ``TieredKVCache``: backup to storage, prefetch from it, and their agreement.

Page keys: every node carries its page hashes (``TreeNode.page_hashes``), a SHA-256 chain seeded
by the request's namespace digest (``namespace_for``); they are computed once, when a node is first
backed up or used as a prefetch anchor, and follow the node through splits.

Agreement across TP ranks: each ``poll`` adds one fixed-size int64 vector (laid out and read
back in ``votes``) to the controller's single all-reduce (MIN); each decision is then taken on
the agreed values on every rank, in the same order.

Load or recompute: a hit whose load at the measured storage bandwidth would take longer than
recomputing it at ``prefill_tokens_per_s`` is declined (each decision is counted); that decision
and the graft of an agreed read live in ``graft``.
"""

from __future__ import annotations

import logging
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.metrics import TierMetrics
from kvtier.runtime.l3.backup import BackupJob, BackupWriter, path_job
from kvtier.runtime.l3.graft import alloc_host, free_slots, graft_agreed, load_beats_recompute
from kvtier.runtime.l3.pools import L3Pool, namespace_for
from kvtier.runtime.l3.prefetch import Prefetch, PrefetchWorkers, RevokeReason
from kvtier.runtime.l3.votes import (
    LOAD_SLOTS,
    QUERY_SLOTS,
    VECTOR_LEN,
    LoadVote,
    QueryVote,
    Votes,
    decode,
    encode,
)
from kvtier.runtime.tp import rank_and_size
from kvtier.runtime.tree.node import TreeNode, page_align
from kvtier.runtime.tree.types import Backup
from kvtier.storage import (
    KeyScope,
    Namespace,
    PrefetchOutcome,
    StorageBackend,
    create_backend,
    page_hashes,
)

if TYPE_CHECKING:
    from kvtier.runtime.config import CacheConfig
    from kvtier.runtime.pools.host import HostPool
    from kvtier.runtime.pools.mamba import MambaHostPool
    from kvtier.runtime.tree.tree import UnifiedRadixTree

__all__ = ["L3Tier", "Prefetch"]

log = logging.getLogger(__name__)

_RECHECK_POLLS = 256  # remembered pages are checked against the store at most this often
_NAMESPACE_MEMORY = 4096  # request namespaces whose L3 key namespace is kept
_STORED_MEMORY = 1 << 20  # (pool, hash) pairs remembered as already in L3


class L3Tier:
    """Backup and prefetch between a cache's host pools and a storage backend.

    Args:
        config: the cache's config (``storage`` set).
        tree: the cache's tree.
        host_pools: the host pool of each L3 pool name that exists: ``"kv"`` (absent for a
            logical FULL pool, which has no bytes) and, where the cache has them, ``"swa"``,
            ``"mamba"`` and each sidecar (``config.all_sidecars``: the DSA indexer, ...).
        tp_group: the CPU group of TP ranks that must agree, or None.
        metrics: the cache's tier metrics; the backend counts its transfers there too.
        backend: a backend to use instead of building ``config.storage.backend``.
        counters: where the L3 decisions are counted (a cache keeps one across attaches).

    The controller reports each acknowledged device→host backup to :meth:`on_backup_done`.
    Once ``admitting`` is False (a detach began) no new prefetch or backup is taken.
    """

    def __init__(
        self,
        config: CacheConfig,
        tree: UnifiedRadixTree,
        host_pools: Mapping[str, HostPool | MambaHostPool],
        tp_group,
        metrics: TierMetrics,
        backend: StorageBackend | None = None,
        counters: Counter[str] | None = None,
    ) -> None:
        cfg = config
        st = cfg.storage
        assert st is not None
        self.cfg, self.st, self.tree = cfg, st, tree
        self.tp_group = tp_group
        rank, size = rank_and_size(tp_group)
        self.tp_size = size
        P, B = cfg.page_size, st.batch_pages
        has_swa = "swa" in host_pools
        self.W = math.ceil(cfg.swa_window / P) if has_swa else 0
        if self.W > B:  # refused before a backend is built: nothing to release
            raise ValueError(
                f"storage.batch_pages={B} is smaller than the SWA window of {self.W} pages"
            )
        scope = KeyScope.for_namespace(namespace_for(cfg, None, size), rank, size)
        self.owns_backend = backend is None
        if backend is None:
            backend = create_backend(st.backend, scope=scope, metrics=metrics, **st.backend_config)
        else:
            if backend.scope != scope:
                raise ValueError(
                    f"storage_backend: its key scope {backend.scope} differs from this cache's "
                    f"{scope} (rank-replicated caches such as MLA need replicated=True)"
                )
            backend.metrics = metrics  # a given backend reports into this cache's counters
        self.backend = backend
        self.metrics = metrics
        self.pools = {name: L3Pool(name, host, P, B) for name, host in host_pools.items()}
        # The pools that hold a FULL page's bytes (read per batch, each page from all or none)
        # and a SWA page's (read with the window, all or nothing); sidecars after their anchor.
        riders = {a: [s.name for s in cfg.all_sidecars if s.anchor == a] for a in ("kv", "swa")}
        self.kv_group = (["kv"] if "kv" in host_pools else []) + riders["kv"]
        self.swa_group = ["swa", *riders["swa"]] if has_swa else []
        # Pools that need only some pages of a prefix (SWA's window, Mamba's last page).
        self._trailing = has_swa or "mamba" in host_pools
        for pool in self.pools.values():
            backend.register_host_buffer(pool.region())
            pool.register.append(backend.register_host_buffer)
        self.writer = BackupWriter(
            backend, self.pools, st.backup_retries, self.metrics, backend.scope.writes
        )
        self.workers = PrefetchWorkers(backend, self.pools, self.W, self.kv_group, self.swa_group)
        self.threshold_pages = max(1, math.ceil(st.prefetch_min_tokens / P))
        self.counters: Counter[str] = Counter() if counters is None else counters
        self.admitting = True
        self.inflight_tokens = 0
        self._namespaces: OrderedDict[Hashable, Namespace] = OrderedDict()  # recent ones
        # (pool, hash) -> the poll at which the pages were last known in the store
        self._stored: OrderedDict[tuple[str, str], int] = OrderedDict()
        self._polls = 0  # polls applied: the same count on every rank
        self._pending: set[tuple[str, str]] = set()
        self._unrecorded: set[int] = set()  # ids of jobs in flight at a clear: not "stored"
        self._backups: deque[BackupJob] = deque()
        self._querying: deque[Prefetch] = deque()
        self._loading: deque[Prefetch] = deque()
        self._draining: deque[Prefetch] = deque()
        self._voted: tuple[list[Prefetch], list[Prefetch]] = ([], [])

    # -- keys ----------------------------------------------------------------------------------

    def namespace(self, request_namespace: Hashable) -> Namespace:
        """The L3 key namespace of a request namespace; the latest ``_NAMESPACE_MEMORY`` are
        kept (one per session salt grew without bound: ~0.5 KB each, a soak trial)."""
        spaces = self._namespaces
        ns = spaces.get(request_namespace)
        if ns is None:
            ns = namespace_for(self.cfg, request_namespace, self.tp_size)
            spaces[request_namespace] = ns
            if len(spaces) > _NAMESPACE_MEMORY:
                spaces.popitem(last=False)
        else:
            spaces.move_to_end(request_namespace)
        return ns

    def node_hashes(self, node: TreeNode) -> list[str]:
        """``node``'s page hashes, computing those of it and its ancestors that lack them."""
        path, x = [], node
        while x.parent is not None and x.page_hashes is None:
            path.append(x)
            x = x.parent
        prev = x.page_hashes[-1] if x.parent is not None else None
        for y in reversed(path):
            y.page_hashes = page_hashes(y.key, self.namespace(y.namespace), prev)
            prev = y.page_hashes[-1]
        return node.page_hashes or []

    # -- backup --------------------------------------------------------------------------------

    def on_backup_done(self, books: Backup, event) -> None:
        """A D→H copy was acknowledged: queue the L3 write of the path's host pages not yet
        stored, host-pinning every node it reads until the write is done."""
        if not self.st.write_to_storage:
            return
        if not self.admitting:
            self.counters["backup_not_started_detaching"] += 1
            return
        self._write_path(books.pin.node, event)

    def backfill(self) -> int:
        """Queue the L3 write of every page already on host (an attach with ``backfill``);
        returns the jobs queued. Visits the tree in its own order, so every TP rank queues the
        same jobs; pages on device only reach L3 when they are backed up to host, as usual."""
        if not self.st.write_to_storage:
            return 0
        before = len(self._backups)
        for node in self.tree.all_nodes():
            if node.parent is None or node.host_value[0] is None:
                continue
            # Only the deepest host nodes: a job writes its node's whole path.
            if not any(c.host_value[0] is not None for c in node.children.values()):
                self._write_path(node, None)
        return len(self._backups) - before

    def _write_path(self, node: TreeNode, event) -> None:
        """Queue the L3 write of ``node``'s path (``path_job``)."""
        groups = {"kv": self.kv_group, "swa": self.swa_group}
        job = path_job(
            self.tree,
            node,
            event,
            self.pools,
            groups,
            self.node_hashes,
            self._stored,
            self._pending,
            self._polls - _RECHECK_POLLS,
        )
        if job is not None:
            self._backups.append(job)
            self.writer.submit(job)

    def _finish_backup(self, job: BackupJob, stored: bool) -> None:
        """Unpin an agreed-finished job; ``stored`` (agreed: every rank's pages reached L3, or
        the rank writes nothing): remember its pages as stored, on every rank alike, so that
        every rank's later backups skip the same pages. A rank's own ``job.stored`` decided
        that, and it differed where a rank writes nothing (rank-replicated caches: only rank 0
        writes) or one rank's write failed: the ranks then queued different jobs, their FIFO
        acknowledgements fell out of step, and a drain never ended (found in a TP trial)."""
        for pin in job.pins:
            self.tree.unpin_host(pin)
        for pool, (hashes, _) in job.pages.items():
            for h in hashes:
                self._pending.discard((pool, h))
        unrecorded = id(job) in self._unrecorded
        events = self.writer.events
        if events is not None and job.stored and not unrecorded:
            # Routers learn of pages in storage here, not from the writer thread: under TP
            # only once every rank stored its part of the job (rank 0 announced its own
            # shard's pages while another rank's writes failed: a router then sent requests
            # for prefixes no rank could read back; a TP trial). One rank: what it stored.
            if stored or self.tp_group is None:
                events.storage_stored(job.stored)
        if unrecorded:  # a clear ran while it was written: nothing is known
            self._unrecorded.discard(id(job))
        elif stored:
            for pool, (hashes, _) in job.pages.items():
                for h in hashes:
                    self._stored[(pool, h)] = self._polls
                    self._stored.move_to_end((pool, h))
        while len(self._stored) > _STORED_MEMORY:
            self._stored.popitem(last=False)
        self.counters["backup_pages"] += len(job.stored) - job.held
        self.counters["backup_failed_pages"] += job.failed_pages
        self.counters["backup_revoked_pages"] += job.revoked_pages

    # -- prefetch: start -----------------------------------------------------------------------

    def prefetch(self, token_ids: Sequence[int], namespace: Hashable = None) -> Prefetch | None:
        """Start a prefetch of the tokens beyond the cached prefix of ``token_ids``.

        Returns None when not admitted (too short, or in-flight prefetches hold too much of the
        host pool). Every TP rank must make the same calls in the same order.
        """
        if not self.admitting:
            self.counters["prefetch_not_started_detaching"] += 1
            return None
        P = self.cfg.page_size
        tokens = page_align(list(token_ids)[:-1], P)
        m = self.tree.match_prefix(tokens, namespace)
        anchor = m.best_match_node
        while anchor.parent is not None and anchor.host_value[0] is None:
            anchor = anchor.parent  # hang host-only nodes only below backed-up ones (SGLang #30106)
        key = tokens[anchor.end :]
        if len(key) < self.threshold_pages * P:
            self.counters["prefetch_not_started_short"] += 1
            return None
        limit = self.st.host_occupancy_limit * self.cfg.host_kv_tokens
        if self.inflight_tokens + len(key) > limit:
            self.counters["prefetch_not_started_host_occupancy"] += 1
            return None
        prev = self.node_hashes(anchor)[-1] if anchor.parent is not None else None
        hashes = page_hashes(key, self.namespace(namespace), prev)
        pin = self.tree.pin_host(anchor) if anchor.parent is not None else None
        timeout = (
            self.st.prefetch_timeout_base_s
            + self.st.prefetch_timeout_per_ki_token_s * len(key) / 1024
        )
        op = Prefetch(anchor, pin, namespace, key, hashes, timeout)
        self.inflight_tokens += len(key)
        self._querying.append(op)
        self.workers.query(op)
        return op

    def abort(self, op: Prefetch) -> None:
        """Stop ``op`` and release what it holds (each resource once; a done op is left alone)."""
        if op.done:
            return
        queue = self._querying if op.state == "query" else self._loading
        if not any(x is op for x in queue):
            raise ValueError(
                f"prefetch: not one of this cache's prefetches in flight (another cache's?): {op!r:.120}"
            )
        op.cancel.set()
        if op.state == "query":
            self._querying.remove(op)
        else:
            self._loading.remove(op)
            op.leftovers = self._held_of(op)
            self._draining.append(op)
        self._end(op, PrefetchOutcome.ABORTED)

    # -- agreement -----------------------------------------------------------------------------

    @property
    def vector_len(self) -> int:
        return VECTOR_LEN

    def local_votes(self) -> torch.Tensor:
        """This rank's values for the agreed vector (``votes``)."""
        queries = list(self._querying)[:QUERY_SLOTS]
        loads = list(self._loading)[:LOAD_SLOTS]
        self._voted = (queries, loads)
        query_votes = []
        for op in queries:
            if op.query_done.is_set():
                hits = op.query_hits
            else:
                hits = 0 if op.expired() else -1  # a hung query ends at the timeout
            worth = load_beats_recompute(
                hits, self.st, self.metrics, self.pools, self.cfg.page_size
            )
            query_votes.append(QueryVote(hits, worth))
        load_votes = []
        for op in loads:
            with op.mutex:
                snap = (op.completed_pages, op.swa_hit, op.mamba_hit)
            load_votes.append(LoadVote(self._can_terminate(op), *snap))
        return encode(
            Votes(
                _ready(self._backups, lambda j: j.done.is_set()),
                _ready(self._draining, lambda op: op.io_done.is_set()),
                query_votes,
                load_votes,
                _ready(self._backups, lambda j: j.done.is_set() and j.complete),
            )
        )

    def apply(self, v: torch.Tensor) -> None:
        """Act on the agreed vector: the same decisions on every rank."""
        queries, loads = self._voted
        self._voted = ([], [])
        agreed = decode(v, len(queries), len(loads))
        self._polls += 1
        for i in range(agreed.backups_done):
            self._finish_backup(self._backups.popleft(), i < agreed.backups_stored)
        for _ in range(agreed.drained):
            self._release(self._draining.popleft())
        for op, vote in zip(loads, agreed.loads):
            if vote.can_terminate and not op.done:
                self._commit(op, vote.completed_pages, vote.swa_pages, vote.mamba_state)
        for op, vote in zip(queries, agreed.queries):
            if vote.hits >= 0 and not op.done:
                self._querying.remove(op)
                self._start_load(op, vote.hits, vote.worth)

    @property
    def outstanding(self) -> int:
        return len(self._backups) + len(self._querying) + len(self._loading) + len(self._draining)

    def wait_some(self, timeout: float) -> None:
        """Block until the oldest outstanding background step finishes, or ``timeout``."""
        for q, ev in (
            (self._backups, "done"),
            (self._draining, "io_done"),
            (self._querying, "query_done"),
            (self._loading, "io_done"),
        ):
            if q:
                getattr(q[0], ev).wait(timeout)
                return

    # -- prefetch: decisions ---------------------------------------------------------------------

    def _can_terminate(self, op: Prefetch) -> bool:
        policy = self.st.prefetch_policy
        if policy == "best_effort" or op.io_done.is_set():
            return True
        return policy == "timeout" and op.expired()

    def _start_load(self, op: Prefetch, hits: int, worth: bool) -> None:
        """Act on an agreed query result: revoke, cut for host room, or allocate and read.

        Every value used here is agreed or comes from the tree, which changes identically on
        every rank, so the cut and the re-query happen on every rank alike.
        """
        if hits < self.threshold_pages:
            if not op.query_done.is_set():
                reason = RevokeReason.TIMED_OUT
            elif op.cut_pages:  # no usable prefix fits the host: reading any would be wasted
                reason = RevokeReason.HOST_CAPACITY
            else:
                reason = RevokeReason.BELOW_THRESHOLD
            return self._revoke(op, reason)
        if not op.cut_pages:  # a re-query is the same decision, counted once
            self.counters["l3_decision_load" if worth else "l3_decision_recompute"] += 1
        if not worth:
            return self._revoke(op, RevokeReason.DECLINED)
        P, tree = self.cfg.page_size, self.tree
        fit = self._host_room(hits)
        if fit < hits:
            if fit < self.threshold_pages:
                return self._revoke(op, RevokeReason.HOST_CAPACITY)
            if self._trailing:
                # SWA and Mamba data exist only at some page ends: a prefix cut at an arbitrary
                # page may have neither, and its KV pages could never be matched. Ask the store
                # again for the longest usable prefix that fits (it is at most ``fit``).
                self.counters["prefetch_cut_host_capacity"] += 1
                return self._requery(op, fit)
            hits = fit
        kv = tree.full.host_alloc
        op.kv_slots = kv.alloc(hits * P)
        op.planned_pages = hits
        if tree.swa is not None:
            op.swa_pages = min(self.W, hits)
            op.swa_slots = alloc_host(tree, tree.swa, op.swa_pages * P)
        if tree.mamba is not None:
            op.mamba_slot = alloc_host(tree, tree.mamba, 1)
        if (tree.swa is not None and op.swa_slots is None) or (
            tree.mamba is not None and op.mamba_slot is None
        ):
            self._release_now(op)
            return self._revoke(op, RevokeReason.HOST_CAPACITY)
        op.state = "load"
        self._loading.append(op)
        self.workers.load(op)

    def _host_room(self, pages: int) -> int:
        """Pages (up to ``pages``) the FULL host pool can take now, after evicting host leaves.

        Host leaves are pages evicted from the device whose host pins are gone. With
        ``write_to_storage`` a page's L3 write holds its pin until it is done, so what is
        evicted here is already in L3 (or its write failed and was counted): a later prefetch
        can read it back.
        """
        P, kv = self.cfg.page_size, self.tree.full.host_alloc
        short = pages * P - kv.available_size()
        if short > 0:
            self.tree.evict_host(full=short)
        return min(pages, kv.available_size() // P)

    def _requery(self, op: Prefetch, max_pages: int) -> None:
        """Send ``op`` back to the query thread, looking at its first ``max_pages`` pages only."""
        op.cut_pages = max_pages
        op.query_hits = 0
        op.query_done.clear()
        self._querying.append(op)
        self.workers.query(op)

    def _revoke(self, op: Prefetch, reason: RevokeReason) -> None:
        op.reason = reason
        self.counters[f"prefetch_revoked_{reason.value}"] += 1
        outcome = (
            PrefetchOutcome.TIMED_OUT
            if reason is RevokeReason.TIMED_OUT
            else PrefetchOutcome.REVOKED
        )
        self._end(op, outcome)

    def _end(self, op: Prefetch, outcome: PrefetchOutcome) -> None:
        if op.pin is not None:
            self.tree.unpin_host(op.pin)
            op.pin = None
        self.inflight_tokens -= len(op.tokens)
        op.outcome = outcome
        op.state = "done"
        self.metrics.add_prefetch_outcome(outcome)

    def _commit(self, op: Prefetch, pages: int, swa: int, mamba: int) -> None:
        """Agreed termination: graft the agreed pages; the rest is released once IO stops."""
        op.cancel.set()
        self._loading.remove(op)
        outcome = graft_agreed(self.tree, self.cfg.page_size, op, pages, swa, mamba)
        self._draining.append(op)
        self.counters["prefetched_tokens"] += op.loaded_tokens  # a hit once a match serves it
        self._end(op, outcome)

    # -- releasing held slots ---------------------------------------------------------------------

    def _held_of(self, op: Prefetch) -> dict[str, torch.Tensor]:
        out = {}
        for name, slots in (("kv", op.kv_slots), ("swa", op.swa_slots), ("mamba", op.mamba_slot)):
            if slots is not None:
                out[name] = slots
        return out

    def _release_now(self, op: Prefetch) -> None:
        op.leftovers = self._held_of(op)
        self._release(op)

    def _release(self, op: Prefetch) -> None:
        """Free a finished prefetch's unused host slots (its IO thread is done)."""
        allocs = {c.name: c.host_alloc for c in self.tree.components}
        for name, slots in op.leftovers.items():
            free_slots(allocs[name], slots)
        op.leftovers = {}

    # -- books ------------------------------------------------------------------------------------

    def held_by_ops(self) -> dict[str, int]:
        """Host slots per pool that prefetches hold outside the tree (for its integrity check)."""
        out = Counter()
        for op in list(self._loading) + list(self._draining):
            held = self._held_of(op) if op in self._loading else op.leftovers
            for name, slots in held.items():
                out[name] += slots.numel()
        return dict(out)

    def revoke(self) -> None:
        """Forced detach: take nothing new, abort every prefetch and have the writer skip the
        jobs (and batches) it has not started. What they hold is released as usual, once every
        rank's threads are done with it (``apply``): IO in progress is never raced."""
        self.admitting = False
        self.writer.cancel.set()
        for op in [*self._querying, *self._loading]:
            self.abort(op)
            self.counters["prefetch_revoked_detach"] += 1

    def stored_pages(self) -> list[tuple[str, str]]:
        """The (pool, page hash) pairs this tier remembers writing, oldest first (the latest
        ``_STORED_MEMORY``)."""
        return list(self._stored)

    def forget_stored(self) -> None:
        """The store was cleared: forget which pages it holds, including those of jobs in
        flight (a page written before the clear and acknowledged after it is gone)."""
        self._stored.clear()
        self._unrecorded = {id(job) for job in self._backups}

    def close(self, timeout: float = 5.0, cancel: bool = False) -> None:
        """Stop the IO threads (each join up to ``timeout``) and close the backend this tier
        built. ``cancel``: jobs and prefetches still queued are dropped, a write in progress
        stops at its next batch (the interpreter is exiting). A backend whose threads are still
        running is left open: closing it under them is what aborted exiting processes."""
        if cancel:
            self.writer.cancel.set()
            for op in (*self._querying, *self._loading, *self._draining):
                op.cancel.set()
        self.writer.close(timeout)
        self.workers.close(timeout)
        if self.owns_backend:
            if self.writer.alive or self.workers.alive:
                log.warning("L3: IO threads still running after %.1f s: backend left open", timeout)
            else:
                self.backend.close()


def _ready(q: deque, is_ready) -> int:
    n = 0
    for item in q:
        if not is_ready(item):
            break
        n += 1
    return n
