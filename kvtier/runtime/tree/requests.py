"""Request-level helpers of ``UnifiedRadixTree``: cache a finished or a running request.

A request owns the FULL slots ``kv_slots[cache_protected_len:]`` (whole pages) and, optionally,
one Mamba slot; positions below ``cache_protected_len`` hold tree-owned slots it matched and
pinned with ``pin``. Caching hands the page-aligned part to the tree and frees the rest:

    [0, protected)        tree-owned, pinned by req.pin      untouched
    [protected, aligned)  request-owned, inserted             tree keeps them or frees duplicates
    [aligned, len(row))   request-owned, unaligned tail       freed (finished requests only)

A request's Mamba state summarises all of ``token_ids``, so the tree takes it only where the
tokens end on a page boundary (a node can hold it there): a finished request hands its slot
over, a running one can donate a copy (``cache_unfinished_req(donate_mamba=True)`` returns
the copy to issue).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from kvtier.runtime.tree.types import InsertResult, MambaCopy, PinHandle

if TYPE_CHECKING:
    from kvtier.runtime.tree.tree import UnifiedRadixTree

__all__ = ["CacheRequest", "RequestCache"]


@dataclass(eq=False)
class CacheRequest:
    """The cache state of one request, as a scheduler keeps it.

    Attributes:
        token_ids: tokens whose KV is computed (prompt and output so far).
        kv_slots: int64 FULL slots; the first ``len(token_ids)`` are the tokens' slots, and the
            row covers whole pages (its length is a multiple of P).
        cache_protected_len: leading tokens whose slots belong to the tree.
        pin: pin on the node ending at ``cache_protected_len`` (None: nothing pinned).
        swa_evicted_seqlen: page-aligned; the request's SWA data below it was freed.
        mamba_slot: one-slot tensor with the request's live Mamba state (covering all of
            ``token_ids``), or None.
        namespace, priority: as in ``insert``.
    """

    token_ids: list[int]
    kv_slots: torch.Tensor
    cache_protected_len: int = 0
    pin: PinHandle | None = None
    swa_evicted_seqlen: int = 0
    mamba_slot: torch.Tensor | None = None
    namespace: Hashable = None
    priority: int = 0
    last_insert: InsertResult | None = field(default=None, repr=False)


class RequestCache:
    """Caching finished and running requests into a tree: its books stay the tree's; this part acts on them."""

    def __init__(self, tree: UnifiedRadixTree) -> None:
        self.tree = tree

    def cache_finished_req(self, req: CacheRequest) -> None:
        """Insert the request's page-aligned tokens, free what the tree does not keep, release
        its pin and its Mamba slot (unless the tree adopted it: only when the tokens end on a
        page boundary)."""
        tree = self.tree
        protected = req.cache_protected_len
        aligned = len(req.token_ids) // tree.page_size * tree.page_size
        if aligned < protected:
            return self.release_req(req)
        res = tree.insert(
            req.token_ids[:aligned],
            req.kv_slots[:aligned],
            prev_prefix_len=protected,
            swa_evicted_seqlen=min(req.swa_evicted_seqlen, aligned),
            mamba_value=req.mamba_slot if aligned == len(req.token_ids) else None,
            priority=req.priority,
            namespace=req.namespace,
        )
        req.last_insert = res
        if req.kv_slots.numel() > aligned:
            tree.full.device_alloc.free(req.kv_slots[aligned:])
        if req.mamba_slot is not None and not res.mamba_adopted:
            tree.mamba.device_alloc.free(req.mamba_slot)
        self._unpin(req)

    def release_req(self, req: CacheRequest) -> None:
        """Free every slot the request owns without caching anything (an aborted or failed
        request), and release its pin."""
        tree = self.tree
        if req.kv_slots.numel() > req.cache_protected_len:
            tree.full.device_alloc.free(req.kv_slots[req.cache_protected_len :])
        if req.mamba_slot is not None:
            tree.mamba.device_alloc.free(req.mamba_slot)
        self._unpin(req)

    def _unpin(self, req: CacheRequest) -> None:
        if req.pin is not None:
            self.tree.unpin(req.pin)
        req.pin = None
        req.mamba_slot = None
        req.kv_slots = req.kv_slots[:0]
        req.cache_protected_len = 0

    def cache_unfinished_req(
        self, req: CacheRequest, *, donate_mamba: bool = False
    ) -> MambaCopy | None:
        """Checkpoint a running request (chunked prefill, decode): insert its page-aligned
        tokens, write the tree's slots into ``kv_slots``, move its pin to the new end node and
        advance ``cache_protected_len``.

        ``donate_mamba=True`` (MAMBA): when the tokens end on a page boundary, the tree gets a
        new state slot at the end node (one unpinned state is evicted if the pool is full) and
        the request keeps its live slot. Returns the copy ``req.mamba_slot`` → the tree's slot,
        which the caller must issue before the next step (None: nothing donated, e.g. the node
        already had a state). Until that copy runs the tree's slot holds no valid state, so
        the flag is opt-in: a caller that does not issue copies must leave it off.

        The pin moves to the node ending at the cached length (not to the match anchor): every
        slot the request keeps using must be pinned. Where an SWA tombstone cannot take the
        request's slots (its FULL is pinned by another reader), caching stops there and the
        request keeps its own slots, which still carry the SWA data it needs.
        """
        aligned = len(req.token_ids) // self.tree.page_size * self.tree.page_size
        if aligned <= req.cache_protected_len:
            return None
        donated = None
        if donate_mamba and req.mamba_slot is not None and aligned == len(req.token_ids):
            donated = self.tree.alloc_or_evict(self.tree.mamba, 1)
        res = self.tree.insert(
            req.token_ids[:aligned],
            req.kv_slots[:aligned],
            prev_prefix_len=req.cache_protected_len,
            swa_evicted_seqlen=min(req.swa_evicted_seqlen, aligned),
            mamba_value=donated,
            priority=req.priority,
            namespace=req.namespace,
            unfinished=True,
        )
        req.last_insert = res
        copy = None
        if donated is not None:
            if res.mamba_adopted:
                copy = MambaCopy(req.mamba_slot.reshape(1).clone(), donated)
            else:
                self.tree.mamba.device_alloc.free(donated)
        if res.cached_len:
            req.kv_slots[: res.cached_len] = self.tree.path_slots(res.last_node)
        new_lock = self.tree.pin(res.last_node)
        if req.pin is not None:
            self.tree.unpin(req.pin)
        req.pin = new_lock
        req.cache_protected_len = res.cached_len
        return copy

    def free_out_of_window(self, req: CacheRequest, seqlen: int | None = None) -> int:
        """Free the request's own SWA slots that no later position can read; advances
        ``swa_evicted_seqlen``. Returns SWA tokens freed.

        ``seqlen`` (default ``len(req.token_ids)``) positions are computed. What stays is the
        window, rounded up to whole pages, below the last page boundary at or under ``seqlen``:
        exactly what a later match ending there needs (a boundary is valid only when ``window``
        tokens above it are SWA-resident), and more than any position from ``seqlen`` on reads.
        A request therefore holds at most ``ceil(window / P) * P`` + one page of SWA slots, plus
        the slots of the positions it is computing.
        """
        P = self.tree.page_size
        n = len(req.token_ids) if seqlen is None else seqlen
        tail = -(-self.tree.swa.window // P) * P
        new = max(0, n // P * P - tail)
        start = max(req.swa_evicted_seqlen, req.cache_protected_len)
        freed = 0
        if new > start:
            freed = self.tree.full.device_alloc.free_swa(req.kv_slots[start:new])
        req.swa_evicted_seqlen = max(req.swa_evicted_seqlen, new)
        return freed
