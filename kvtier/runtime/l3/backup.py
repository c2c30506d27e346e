"""Backup to L3: after a device→host ack, write the host pages on to storage.

The scheduler thread builds a job (page hashes and host slots per pool, read from the tree) and
host-pins every node it covers; a background thread writes it, auxiliary pools (SWA, Mamba)
first, then KV, in batches, reading the host pool's pages in place (layer_first pools are packed
through a staging buffer). Failed pages are retried a bounded number of times; what still fails
is counted as a backup failure and never marked stored. The pins are released when every TP rank
has finished the job (``L3Tier.poll``), so all trees unpin in the same step. Jobs that write a
retained prefix (a retention pin covers one of their nodes) are written before the others.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvtier.metrics import TierMetrics
from kvtier.runtime.l3.pools import L3Pool
from kvtier.runtime.tree.node import TreeNode
from kvtier.runtime.tree.types import HostPinHandle
from kvtier.storage import PoolTransfer, StorageBackend

if TYPE_CHECKING:
    from kvtier.runtime.tree.tree import UnifiedRadixTree

__all__ = ["BackupJob", "BackupWriter", "path_job"]

log = logging.getLogger(__name__)


@dataclass
class BackupJob:
    """Pages to write: per pool, page hashes and the host pages (ids) holding them.

    ``pins`` are released by the scheduler once ``done`` is set on every rank; ``stored`` lists
    the ``(pool, hash)`` pairs that reached L3. ``complete``: every page reached L3, or this
    rank writes nothing (the writing ranks' votes decide); the ranks agree on it before any of
    them remembers the job's pages as stored.
    """

    pages: dict[str, tuple[list[str], torch.Tensor]]
    pins: list[HostPinHandle]
    event: object = None  # CUDA event of the D→H copy (complete before the job is queued)
    # Pages the tier remembers as stored, listed in ``pages`` too: the writer asks the store
    # first and writes only those it no longer holds (a capped store evicts what this process
    # remembers writing, and a path's later backups then skipped its evicted pages for good,
    # breaking every later prefetch of it; a soak trial).
    recheck: set[tuple[str, str]] = field(default_factory=set)
    held: int = 0  # re-checked pages the store still held: in ``stored``, not written again
    done: threading.Event = field(default_factory=threading.Event)
    stored: list[tuple[str, str]] = field(default_factory=list)
    failed_pages: int = 0
    revoked_pages: int = 0  # not written because a forced detach cancelled the writer
    complete: bool = False

    @property
    def num_pages(self) -> int:
        return sum(len(h) for h, _ in self.pages.values())


class BackupWriter:
    """The background thread that writes backup jobs, in order.

    Args:
        backend: the L3 store.
        pools: the L3 pools by name.
        retries: extra attempts for failed pages.
        metrics: where backup failures are counted.
        writes: False on ranks that do not write (rank-replicated caches, rank > 0): jobs are
            finished without IO.
    """

    def __init__(
        self,
        backend: StorageBackend,
        pools: dict[str, L3Pool],
        retries: int,
        metrics: TierMetrics,
        writes: bool,
    ) -> None:
        self.backend = backend
        self.pools = pools
        self.retries = retries
        self.metrics = metrics
        self.writes = writes
        self.events = None  # a kvtier.events sink: told which pages reached the store (by
        # the tier, when it acknowledges the job: L3Tier._finish_backup)
        # Set by a forced detach: jobs not started are finished unwritten, a job in progress
        # stops at its next batch (pages are never torn: a batch in progress completes).
        self.cancel = threading.Event()
        # (rank, sequence, job): retained prefixes first (rank 0), then in submission order;
        # the stop marker (rank 2) after every job submitted before it.
        self._queue: queue.PriorityQueue[tuple[int, int, BackupJob | None]] = queue.PriorityQueue()
        self._seq = itertools.count()
        self._thread = threading.Thread(target=self._run, name="kvtier-l3-backup", daemon=True)
        self._thread.start()

    def submit(self, job: BackupJob) -> None:
        retained = any(pin.node.retention is not None for pin in job.pins)
        self._queue.put((0 if retained else 1, next(self._seq), job))

    def close(self, timeout: float) -> None:
        self._queue.put((2, next(self._seq), None))
        self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _run(self) -> None:
        while True:
            _, _, job = self._queue.get()
            if job is None:
                return
            try:
                if self.writes and not self.cancel.is_set():
                    self._write(job)
                    job.complete = len(job.stored) == job.num_pages
                elif self.cancel.is_set():
                    job.revoked_pages = job.num_pages
                else:
                    job.complete = True
            except Exception:  # a backend bug must not kill the thread: count the job failed
                log.exception("L3 backup job of %d pages failed", job.num_pages)
                job.failed_pages = job.num_pages - len(job.stored)
            if job.failed_pages:
                self.metrics.add_backup_failure(job.failed_pages)
            job.done.set()

    def _write(self, job: BackupJob) -> None:
        if job.event is not None:
            job.event.synchronize()
        # ``job.pages`` stays as the tier built it (every TP rank remembers the same pages);
        # the pages to write are those less the re-checked ones the store still holds.
        todo = self._to_write(job)
        # Aux pools first: a KV hit then implies its aux pages were written (or failed loudly).
        order = [p for p in todo if p != "kv"] + (["kv"] if "kv" in todo else [])
        for name in order:
            hashes, pages = todo[name]
            pool = self.pools[name]
            B = pool.batch_pages
            for i in range(0, len(hashes), B):
                if self.cancel.is_set():
                    job.revoked_pages = job.num_pages - len(job.stored) - job.failed_pages
                    return
                ok = self._write_batch(pool, hashes[i : i + B], pages[i : i + B])
                job.stored += [(name, h) for h, good in zip(hashes[i : i + B], ok) if good]
                failed = len(ok) - sum(ok)
                if failed:
                    # Stop at the first failed batch: later pages of a prefix are useless
                    # without it. Every page not written counts as failed.
                    job.failed_pages += failed + len(hashes) - (i + len(ok))
                    job.failed_pages += sum(len(todo[n][0]) for n in order[order.index(name) + 1 :])
                    return

    def _to_write(self, job: BackupJob) -> dict[str, tuple[list[str], torch.Tensor]]:
        """The job's pages less the re-checked ones the store still holds, which count as
        stored (``job.held``)."""
        if not job.recheck:
            return job.pages
        todo = {}
        for name, (hashes, pages) in job.pages.items():
            check = [i for i, h in enumerate(hashes) if (name, h) in job.recheck]
            held = set()
            if check:
                found = self.backend.contains(name, [hashes[i] for i in check])
                held = {i for i, ok in zip(check, found) if ok}
            if not held:
                todo[name] = (hashes, pages)
                continue
            job.stored += [(name, hashes[i]) for i in sorted(held)]
            job.held += len(held)
            keep = [i for i in range(len(hashes)) if i not in held]
            todo[name] = ([hashes[i] for i in keep], pages[torch.tensor(keep, dtype=torch.int64)])
        return todo

    def _write_batch(self, pool: L3Pool, hashes: list[str], pages: torch.Tensor) -> list[bool]:
        ok = [False] * len(hashes)
        todo = list(range(len(hashes)))
        for attempt in range(1 + self.retries):
            if attempt:
                self.metrics.add_retried_pages(len(todo))
            idx = torch.tensor(todo, dtype=torch.int64)
            views = pool.write_views(pages[idx])
            keys = [hashes[i] for i in todo]
            res = self.backend.set([PoolTransfer(pool.name, keys, views)]).ok[pool.name]
            for i, good in zip(todo, res):
                ok[i] = good
            todo = [i for i in todo if not ok[i]]
            if not todo:
                break
        return ok


def path_job(
    tree: UnifiedRadixTree,
    node: TreeNode,
    event,
    pools: Mapping[str, L3Pool],
    groups: Mapping[str, Sequence[str]],
    node_hashes: Callable[[TreeNode], list[str]],
    stored: Mapping[tuple[str, str], int],
    pending: set[tuple[str, str]],
    recheck_before: int,
) -> BackupJob | None:
    """The L3 write of ``node``'s path, or None when nothing on it is new: its pages not
    written yet (not in ``stored``, not ``pending``), and then the path's pages ``stored``
    says were last known in the store before poll ``recheck_before``, which the writer checks
    against the store first and writes again where it no longer holds them
    (``BackupJob.recheck``); polls are counted alike on every TP rank. Marks the job's pages
    ``pending`` and host-pins their nodes. ``groups``: the pools of the ``"kv"`` and
    ``"swa"`` groups (sidecars are addressed by their anchor's host slots)."""
    if node.parent is None or not node.attached:
        return None
    path = []
    while node.parent is not None:
        path.append(node)
        node = node.parent
    swa, mamba = tree.swa, tree.mamba
    parts: list[tuple[TreeNode, str, list[str], torch.Tensor]] = []
    for x in reversed(path):
        if x.host_value[0] is None:
            continue  # write-back: a leaf is backed up before its parent
        hashes = node_hashes(x)
        parts += [(x, name, hashes, x.host_value[0]) for name in groups["kv"]]
        if swa is not None and x.host_value[swa.slot] is not None:
            parts += [(x, name, hashes, x.host_value[swa.slot]) for name in groups["swa"]]
        if mamba is not None and x.host_value[mamba.slot] is not None:
            parts.append((x, "mamba", hashes[-1:], x.host_value[mamba.slot]))
    if all((name, h) in stored or (name, h) in pending for _, name, hs, _ in parts for h in hs):
        return None  # nothing new on the path (its remembered pages stay unchecked)
    pages: dict[str, tuple[list[str], list[torch.Tensor]]] = {}
    recheck: set[tuple[str, str]] = set()
    pins, pinned = [], set()
    for x, name, hashes, slots in parts:
        keep = []
        for i, h in enumerate(hashes):
            key = (name, h)
            if key in pending:
                continue
            seen = stored.get(key)
            if seen is not None:
                if seen >= recheck_before:
                    continue  # known in the store lately
                recheck.add(key)
            keep.append(i)
        if not keep:
            continue
        hs, chunks = pages.setdefault(name, ([], []))
        for i in keep:
            pending.add((name, hashes[i]))
            hs.append(hashes[i])
        chunks.append(pools[name].pages_of(slots)[torch.tensor(keep, dtype=torch.int64)])
        if id(x) not in pinned:
            pinned.add(id(x))
            pins.append(tree.pin_host(x))
    job = BackupJob({p: (h, torch.cat(c)) for p, (h, c) in pages.items()}, pins, event)
    job.recheck = recheck
    return job
