"""L3 attached, detached or cleared on a live cache, at the same step on every TP rank.

The engine asks on every rank (``TieredKVCache.attach_storage``, ``detach_storage``,
``clear_storage``); the request waits in :class:`StorageSwitch` until a ``poll`` finds, in the
agreed control header (``votes``), that every rank has asked for the same change. The rule: a
change requested on only some ranks is applied at the first ``poll`` at which all ranks have
requested it, and not before; each rank holds at most one pending change. Ranks that ask for
different changes (attach on one, clear on another) have both refused at that poll
(``ChangeOutcome.REFUSED``, counted), and their books stay as they were.

Clear removes the pages this cache wrote (those its tier remembers as stored) with the backend's
per-page ``delete``, so pages under keys this cache did not write stay (keys are content
hashes: another cache of the same deployment shares them); a backend that cannot delete
single pages is cleared whole. Pages a rank could not remove end its change ``FAILED``.

States of the tier (``StorageSwitch.state``)::

    detached --attach agreed--> attached --graceful detach agreed--> draining
                                attached --forced detach agreed----> revoking
    draining --nothing in flight--> detached (closed)
    draining --agreed clock passes the deadline--> revoking (outcome FORCED_AFTER_TIMEOUT)
    revoking --nothing in flight--> detached (closed)

Draining admits no new prefetch and no new backup and lets those in flight finish; revoking
aborts every prefetch and skips every backup job not started (``L3Tier.revoke``). Either way,
what an op holds (prefetch host slots, backup host pins) is released by the usual agreed paths,
once, when every rank's threads are done with it; the tier is closed once nothing is in flight.
Every decision reads agreed values only (the tree, which changes alike on every rank, and the
control header's MIN clock), so every rank changes state at the same ``poll``.

Keys: page hashes are computed lazily from the root and kept on the nodes. An attach first
checks, for each top-level node that has them, its first page hash against the new tier's key
seed; a subtree hashed under another seed (another salt or TP shape) loses its hashes, which the
new tier then recomputes, so keys equal those of a cache attached at start-up.
"""

from __future__ import annotations

import dataclasses
import logging
import numbers
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import TYPE_CHECKING

import torch

from kvtier.checks import is_finite
from kvtier.runtime.config import CacheConfig, StorageConfig
from kvtier.runtime.l3.tier import L3Tier
from kvtier.runtime.l3.votes import Control, decode_control, encode_poll, l3_part
from kvtier.storage import PoolTransfer, StorageBackend, page_hashes

if TYPE_CHECKING:
    from kvtier.runtime.controller import CacheController
    from kvtier.runtime.tree.node import TreeNode
    from kvtier.runtime.tree.tree import UnifiedRadixTree

__all__ = ["ChangeKind", "ChangeOutcome", "StorageChange", "StorageSwitch"]

log = logging.getLogger(__name__)

_STORAGE = "STORAGE"  # the KV-event medium of L3 (``kvtier.events.MEDIUM_STORAGE``)


class ChangeKind(IntEnum):
    """A storage change; the value is what ranks agree on (never 0: 0 is "none pending")."""

    ATTACH = 1
    ATTACH_BACKFILL = 2
    DETACH_GRACEFUL = 3
    DETACH_FORCED = 4
    CLEAR = 5


class ChangeOutcome(str, Enum):
    APPLIED = "applied"
    FORCED_AFTER_TIMEOUT = "forced_after_timeout"  # a graceful detach ran out of time
    REFUSED = "refused"  # the ranks asked for different changes
    FAILED = "failed"  # pages not removed, or the backend raised (``StorageChange.error``)


@dataclass(eq=False)
class StorageChange:
    """A requested storage change, as ``attach_storage``/``detach_storage``/``clear_storage``
    return it. ``state``: "requested" (waiting for every rank), "agreed" (a detach in progress)
    or "done"; ``outcome`` once done."""

    kind: ChangeKind
    arg_ms: int = 0
    tier: L3Tier | None = None  # the tier an attach brings (built, not yet in use)
    state: str = "requested"
    outcome: ChangeOutcome | None = None
    error: str | None = None

    @property
    def done(self) -> bool:
        return self.state == "done"

    def _finish(self, outcome: ChangeOutcome, error: str | None = None) -> None:
        self.state, self.outcome, self.error = "done", outcome, error


class StorageSwitch:
    """Which L3 tier a cache uses now, and the agreed changes to it.

    Args:
        config: the cache's config (an attached tier's is this one with its ``storage``).
        tier: the tier built at start-up, or None.
        build: builds a tier over the cache's parts (``CacheParts.build_l3``).
        tree: the cache's tree (page hashes; its KV-event sink, if any, is told of clears).
        controller: reports acknowledged backups to the tier in use (``bind_backup_done``).
        metrics: the cache's ``CacheMetrics``; its L3 counters are this switch's ``counters``,
            which every tier attached later counts into as well.
        agreed: TP ranks agree through the poll vector; False (one rank): the control header
            is this rank's own and is not put in the vector (it would cost every poll a few
            tensor operations for nothing).
    """

    def __init__(
        self,
        config: CacheConfig,
        tier: L3Tier | None,
        build: Callable[[CacheConfig, StorageBackend | None, Counter[str] | None], L3Tier],
        tree: UnifiedRadixTree,
        controller: CacheController,
        metrics,
        agreed: bool,
    ) -> None:
        self.config = config
        self.agreed = agreed
        self.build = build
        self.tier = tier
        self.tree = tree
        self.controller = controller
        self.metrics = metrics
        self.counters: Counter[str] = tier.counters if tier is not None else Counter()
        metrics.l3_counters = self.counters  # every l3.* key from the start, attached or not
        self.state = "attached" if tier is not None else "detached"
        self.pending: StorageChange | None = None  # this rank's request, not yet agreed
        self._applied = 0  # changes agreed so far: equal on every rank
        self._polls = 0  # polls so far (named when the ranks are found out of step)
        # The facade's book-changing calls not counted elsewhere (reserve, begin_step,
        # computed, finish, abort, checkpoint, unpin, evict): in the poll's call count, so that
        # one made on one rank only is found at the next poll (a TP trial: an unpin or evict
        # on one rank left the trees apart with no error).
        self.book_calls = 0
        self._config_digest = config.books_digest()
        self._detach: StorageChange | None = None
        self._deadline_ms = 0
        self._control: Control | None = None  # one rank: the header ``apply`` acts on
        self.closed = False  # the cache closed: no change is taken any more

    # -- requests (checked here, applied in ``apply``) -------------------------------------------

    def check_can_request(self, kind: ChangeKind) -> None:
        """Raise ``ValueError`` if ``kind`` cannot be requested now (nothing changes)."""
        if self.closed:
            raise ValueError("storage: the cache is closed (close() was called)")
        if self.pending is not None:
            raise ValueError(
                f"storage: a {self.pending.kind.name.lower()} is already pending (waiting for "
                "every TP rank to ask at a poll()); one change at a time"
            )
        attach = kind in (ChangeKind.ATTACH, ChangeKind.ATTACH_BACKFILL)
        if attach and self.state != "detached":
            raise ValueError(f"storage: already {self.state}; detach it first")
        if not attach and self.state != "attached":
            what = "none is attached" if self.state == "detached" else f"it is {self.state}"
            raise ValueError(f"storage: cannot {kind.name.lower()}: {what}")

    def request(self, change: StorageChange) -> StorageChange:
        self.check_can_request(change.kind)
        self.pending = change
        return change

    def attach(
        self, storage: StorageConfig | StorageBackend, config: StorageConfig | None, backfill: bool
    ) -> StorageChange:
        """Check the arguments, build the tier now (so that a bad config or an unreachable
        store raises here, with nothing changed) and queue its attach."""
        if isinstance(storage, StorageConfig):
            if config is not None:
                raise ValueError("config: pass a StorageConfig either as storage or as config")
            st, backend = storage, None
        elif isinstance(storage, StorageBackend):
            if config is not None and not isinstance(config, StorageConfig):
                raise TypeError(f"config: expected a StorageConfig or None, got {config!r}")
            st, backend = config or self.config.storage or StorageConfig(), storage
        else:
            raise TypeError(
                f"storage: expected a StorageConfig or a StorageBackend, got {storage!r}"
            )
        if type(backfill) is not bool:
            raise TypeError(f"backfill: expected a bool, got {backfill!r}")
        kind = ChangeKind.ATTACH_BACKFILL if backfill else ChangeKind.ATTACH
        self.check_can_request(kind)
        tier = self.build(dataclasses.replace(self.config, storage=st), backend, self.counters)
        return self.request(StorageChange(kind, tier=tier))

    def detach(self, graceful: bool, timeout_s: float) -> StorageChange:
        if type(graceful) is not bool:
            raise TypeError(f"graceful: expected a bool, got {graceful!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
            raise TypeError(f"timeout_s: expected a number of seconds, got {timeout_s!r}")
        if not is_finite(timeout_s) or timeout_s < 0:
            raise ValueError(f"timeout_s: must be finite and >= 0 seconds, got {timeout_s!r}")
        kind = ChangeKind.DETACH_GRACEFUL if graceful else ChangeKind.DETACH_FORCED
        ms = round(timeout_s * 1000) if graceful else 0
        return self.request(StorageChange(kind, arg_ms=ms))

    def clear(self) -> StorageChange:
        return self.request(StorageChange(ChangeKind.CLEAR))

    # -- the poll vector -------------------------------------------------------------------------

    def votes(self, clock_ms: int) -> torch.Tensor | None:
        """This rank's poll vector (``votes.encode_poll``); one rank: the tier's votes alone
        (None without a tier), the header kept aside."""
        ch = self.pending
        self._polls += 1
        c, s = self.metrics.counters, self.controller.stats
        calls = c.requests + c.retention_pins + s.backups + s.loads + self.book_calls
        control = Control(
            self._applied + (ch is not None),
            int(ch.kind) if ch else 0,
            -int(ch.kind) if ch else 0,
            ch.arg_ms if ch else 0,
            clock_ms,
            calls,
            -calls,
            self._config_digest,
            -self._config_digest,
        )
        l3 = self.tier.local_votes() if self.tier is not None else None
        if not self.agreed:
            self._control = control
            return l3
        return encode_poll(control, l3)

    def apply(self, v: torch.Tensor | None) -> Control:
        """Act on the agreed vector (what ``votes`` returned, after the all-reduce): the tier's
        votes, then an agreed change, then a detach's progress. Returns the agreed control
        header (its ``clock_ms`` is the agreed now)."""
        if self.agreed:
            c, l3 = decode_control(v), l3_part(v)
            if not c.in_step:
                # Every rank sees the same MIN and MAX, so every rank raises at this poll: the
                # collectives stay paired while the engine stops, instead of trees and votes
                # drifting apart silently (found in a TP trial).
                raise RuntimeError(
                    f"TP ranks out of step at poll {self._polls}: {c.calls}..{-c.neg_calls} "
                    f"calls that change the cache (requests matched, reserved, stepped, "
                    f"finished or aborted, copies issued, retention pins and unpins, "
                    f"evictions), config digests {c.config}..{-c.neg_config}. Every rank must use "
                    f"the same CacheConfig, make the same calls in the same order and poll() "
                    f"once per step (a call refused or skipped on one rank only, or an extra "
                    f"poll)"
                )
        else:
            c, l3 = self._control, v
        if self.tier is not None:
            self.tier.apply(l3)
        if c.changes > self._applied:  # MIN: every rank has asked
            self._agreed(c)
        if self._detach is not None:
            self._advance(c.clock_ms)
        return c

    def _agreed(self, c: Control) -> None:
        self._applied += 1
        ch, self.pending = self.pending, None
        assert ch is not None
        if not c.kinds_agree:
            log.error(
                "storage: TP ranks asked for different changes (kinds %s..%s); refused on every "
                "rank",
                ChangeKind(c.kind).name,
                ChangeKind(-c.neg_kind).name,
            )
            self.counters["storage_changes_refused"] += 1
            if ch.tier is not None:
                ch.tier.close()
            ch._finish(ChangeOutcome.REFUSED)
            return
        if ch.kind in (ChangeKind.ATTACH, ChangeKind.ATTACH_BACKFILL):
            self._attach(ch)
        elif ch.kind is ChangeKind.CLEAR:
            self._clear(ch)
        else:
            tier = self.tier
            tier.admitting = False
            self._detach = ch
            ch.state = "agreed"
            if ch.kind is ChangeKind.DETACH_FORCED:
                self._revoke()
            else:
                self.state = "draining"
                self._deadline_ms = c.clock_ms + c.arg_ms  # agreed clock, agreed timeout (MIN)

    def _attach(self, ch: StorageChange) -> None:
        tier = ch.tier
        ch.tier = None
        assert tier is not None
        drop_stale_hashes(self.tree, tier)
        # Routers hash prompts with the tier's key seed from now on.
        if self.tree.events is not None:
            self.tree.events.rekey_for_tier(tier)
        tier.writer.events = self.tree.events
        self.tier = tier
        self.state = "attached"
        self.controller.bind_backup_done(tier.on_backup_done)
        self.metrics.l3_counters = self.counters
        self.counters["storage_attached"] += 1
        if ch.kind is ChangeKind.ATTACH_BACKFILL:
            self.counters["storage_backfill_jobs"] += tier.backfill()
        ch._finish(ChangeOutcome.APPLIED)

    def _clear(self, ch: StorageChange) -> None:
        tier = self.tier
        # The pages this cache wrote (the tier remembers the latest ``_STORED_MEMORY``), read
        # before the tier forgets them; pages under keys it did not write stay.
        pages: dict[str, list[str]] = {}
        if tier.backend.scope.writes:  # a rank that writes nothing remembers the writer's pages
            for pool, h in tier.stored_pages():
                pages.setdefault(pool, []).append(h)
        tier.forget_stored()
        error = None
        try:
            failed = _remove(tier.backend, pages)
            if failed:
                error = f"{failed} of this cache's pages could not be removed"
                log.warning("storage: clear incomplete: %s", error)
        except Exception as e:  # the agreed step must complete on every rank: report, go on
            log.exception("storage: clear failed")
            error = f"{type(e).__name__}: {e}"
        if error is None:
            self.counters["storage_cleared"] += 1
            ch._finish(ChangeOutcome.APPLIED)
        else:
            self.counters["storage_clear_failed"] += 1
            ch._finish(ChangeOutcome.FAILED, error)
        if self.tree.events is not None:
            self.tree.events.cleared(_STORAGE)

    def _revoke(self) -> None:
        self.state = "revoking"
        self.tier.revoke()

    def _advance(self, now_ms: int) -> None:
        """A detach in progress: force it past its deadline; close the tier once idle."""
        tier, ch = self.tier, self._detach
        if self.state == "draining" and tier.outstanding and now_ms >= self._deadline_ms:
            self.counters["storage_detach_timeouts"] += 1
            ch.outcome = ChangeOutcome.FORCED_AFTER_TIMEOUT
            self._revoke()
        if tier.outstanding:
            return
        tier.close()
        self.tier, self._detach = None, None
        self.state = "detached"
        self.controller.bind_backup_done(None)
        self.counters["storage_detached"] += 1
        if self.tree.events is not None:
            self.tree.events.cleared(_STORAGE)  # this instance reaches none of those pages now
        ch._finish(ch.outcome or ChangeOutcome.APPLIED)

    def close(self, cancel: bool = False) -> None:
        """Close the tier in use and one a pending attach built (the cache is closing); later
        changes are refused. ``cancel``: drop queued IO (``L3Tier.close``)."""
        self.closed = True
        if self.pending is not None and self.pending.tier is not None:
            self.pending.tier.close(cancel=cancel)
            self.pending.tier = None
        if self.tier is not None:
            self.tier.close(cancel=cancel)


_DELETE_BATCH = 4096  # pages per delete call


def _remove(backend: StorageBackend, pages: dict[str, list[str]]) -> int:
    """Delete ``pages`` (pool -> page hashes) from ``backend``, a batch at a time; the pages it
    could not remove. A backend that cannot remove single pages is cleared whole instead."""
    try:
        backend.delete([])  # refused at once by a backend that cannot delete single pages
    except NotImplementedError:
        log.warning("storage: %s cannot delete single pages; clearing all of it", backend.name)
        if backend.scope.writes:  # rank-replicated: rank 0 stores (and clears) alone
            backend.clear()
        return 0
    failed = 0
    for pool, hashes in pages.items():
        for lo in range(0, len(hashes), _DELETE_BATCH):
            ok = backend.delete([PoolTransfer(pool, hashes[lo : lo + _DELETE_BATCH])]).ok[pool]
            failed += len(ok) - sum(ok)
    return failed


def drop_stale_hashes(tree: UnifiedRadixTree, tier: L3Tier) -> int:
    """Forget the page hashes of every top-level subtree hashed under another key seed than
    ``tier``'s (its first page hash differs); returns the nodes cleared. A subtree is hashed
    from its top down (``node_hashes``), so its first page tells which seed it was hashed with."""
    cleared = 0
    P = tree.page_size
    for top in list(tree.root.children.values()):
        if top.page_hashes is None:
            continue
        want = page_hashes(top.key[:P], tier.namespace(top.namespace), None)
        if want[:1] == top.page_hashes[:1]:
            continue
        stack: list[TreeNode] = [top]
        while stack:
            x = stack.pop()
            stack.extend(x.children.values())
            if x.page_hashes is not None:
                x.page_hashes = None
                cleared += 1
    return cleared
