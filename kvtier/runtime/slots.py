"""The slots a running request writes into, step by step.

    reserve(req, total)    FULL slots, whole pages, for every position the request will reach
    begin_step(req, end)   SWA slots for positions [computed_len, end) (hybrid models)
    computed(req, n)       n positions are written: the SWA window slides (slots no later
                           position reads are freed) and, at a page boundary, the live Mamba
                           state is checkpointed
    give_mamba_state       at match: a live state slot, a copy of the matched prefix's state
    copy_states(layer)     in wait_layer: that copy, layer by layer, once the layer's load is done

A slot that is short is made by evicting cached pages (never pinned ones); a step that cannot be
served even so raises ``RuntimeError`` taking nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch

from kvtier.nvtx import nvtx_range
from kvtier.runtime.inserts import RequestInserts
from kvtier.runtime.request import Request
from kvtier.runtime.tree.node import TreeNode

if TYPE_CHECKING:
    from kvtier.runtime.config import CacheConfig
    from kvtier.runtime.pools.mamba import MambaDevicePool
    from kvtier.runtime.tree.tree import UnifiedRadixTree

__all__ = ["RequestSlots", "check_end"]


class RequestSlots:
    """Gives running requests the FULL, SWA and Mamba slots of their new positions.

    Args:
        config: the cache's config (``page_size``, ``swa_window``).
        tree: the cache's tree; its allocators hold every slot.
        inserts: checkpoints a request's prompt pages into the tree before its SWA window
            slides past them (so that their SWA data stays cached).
        swa: whether the model has SWA layers.
        mamba_pool: the device Mamba pool, or None without Mamba layers.
        layer_map: per model layer, its pool and pool-local layer.
        device: the device the pools live on.

    The caller has checked that each request is one of its running requests.
    """

    def __init__(
        self,
        config: CacheConfig,
        tree: UnifiedRadixTree,
        inserts: RequestInserts,
        swa: bool,
        mamba_pool: MambaDevicePool | None,
        layer_map: list[tuple[str, int]],
        device: torch.device,
    ) -> None:
        self.config = config
        self.tree = tree
        self.kv_alloc = tree.full.device_alloc
        self.inserts = inserts
        self.swa = swa
        self.mamba_pool = mamba_pool
        self.layer_map = layer_map
        self.device = device

    # -- FULL slots ----------------------------------------------------------------------------

    def reserve(self, req: Request, total_tokens: int) -> torch.Tensor:
        """Make ``req.kv_slots`` cover ``total_tokens`` positions (whole pages); returns them."""
        P = self.config.page_size
        need = -(-total_tokens // P) * P - req.kv_slots.numel()
        if need > 0:
            alloc = self.kv_alloc.alloc_full if self.swa else self.kv_alloc.alloc
            slots = alloc(need)
            if slots is None:
                self._make_room(need)
                slots = alloc(need)
            if slots is None:
                raise RuntimeError(f"device KV pool exhausted: {need} tokens needed")
            req.kv_slots = torch.cat([req.kv_slots, slots])
        return req.kv_slots

    def _make_room(self, need: int) -> None:
        """Evict just the shortfall for ``need`` new FULL slots; raise, evicting nothing, if even
        every evictable token would not be enough. That count includes leaves eviction then
        keeps on device (write-back with no host room, retained data with no host copy): then
        the caller raises after evicting what it could, whose data stays on host."""
        a = self.kv_alloc
        free = a.full_available_size() if self.swa else a.available_size()
        short = need - free
        evictable = self.tree.evictable[0]
        if short > evictable:
            raise RuntimeError(
                f"device KV pool exhausted: {need} tokens needed, {free} free, "
                f"{evictable} evictable (pinned by running requests, or by loads and backups "
                f"in flight, which poll() releases once they land)"
            )
        self._evict(short, 0)

    def _evict(self, full: int, swa: int) -> None:
        with nvtx_range(f"kvtier.evict {full} tokens"):
            self.tree.evict(full=full, swa=swa)  # counted by the tree's on_evicted

    # -- SWA slots and the window ----------------------------------------------------------------

    def begin_step(self, req: Request, end: int) -> torch.Tensor | None:
        """Give positions ``[req.computed_len, end)`` SWA slots; returns ``swa_slots(req)``."""
        check_end(req, end, "end")
        if not self.swa:
            return None
        P, a = self.config.page_size, self.kv_alloc
        lo = max(req.cache_protected_len, req.computed_len // P * P)
        hi = -(-end // P) * P
        firsts = req.kv_slots[lo:hi:P]
        missing = firsts[a.translate(firsts) < 0]
        if missing.numel():
            pages = a.full.pages_to_slots(missing // P)
            if not a.alloc_swa_for(pages):
                short = pages.numel() - a.swa_available_size()
                evictable = self.tree.evictable[self.tree.swa.slot]
                if short > evictable:
                    raise RuntimeError(
                        f"device SWA pool exhausted: {pages.numel()} SWA slots needed for "
                        f"positions [{req.computed_len}, {end}), {a.swa_available_size()} free, "
                        f"{evictable} evictable (pinned by running requests, or by loads and "
                        f"backups in flight, which poll() releases once they land)"
                    )
                self._evict(0, short)
                if not a.alloc_swa_for(pages):
                    raise RuntimeError(f"device SWA pool exhausted after evicting {short} tokens")
        return self.swa_slots(req)

    def swa_slots(self, req: Request) -> torch.Tensor | None:
        """SWA pool slots of the request's positions (-1 where none), or None without SWA."""
        if not self.swa:
            return None
        return self.kv_alloc.translate(req.kv_slots)

    def computed(self, req: Request, n_tokens: int) -> None:
        """The first ``n_tokens`` positions are written: slide the SWA window, and checkpoint
        the Mamba state at a page boundary."""
        check_end(req, n_tokens, "n_tokens")
        if self.swa and n_tokens > req.computed_len:
            swa = self.kv_alloc.translate(req.kv_slots[req.computed_len : n_tokens])
            if int(swa.min()) < 0:
                first = req.computed_len + int((swa < 0).nonzero()[0])
                raise ValueError(
                    f"n_tokens: position {first} of [{req.computed_len}, {n_tokens}) has no SWA "
                    f"slot; call begin_step(req, {n_tokens}) before writing the positions"
                )
        req.computed_len = n_tokens
        if self.swa:
            self._slide_window(req, n_tokens)
        if self.mamba_pool is None or n_tokens % self.config.page_size:
            return
        if req.mamba_ckpt is None:
            req.mamba_ckpt = self.tree.alloc_or_evict(self.tree.mamba, 1)
            if req.mamba_ckpt is None:
                return  # no slot: this request's state will not be cached
        self.mamba_pool.copy_slots(req.mamba_slot, req.mamba_ckpt)
        req.mamba_ckpt_len = n_tokens

    def _slide_window(self, req: Request, n: int) -> None:
        """``n`` positions are computed: SWA data no later position of the request reads leaves
        it. Prompt pages go to the tree first (``inserts.checkpoint``), which keeps their SWA
        data as evictable cache, so a later prompt sharing a prefix that ends inside this one
        still finds its window; the request's own slots of positions it generated are freed.
        Once no later position reads SWA data the tree owns, the request's window pin on it
        is released too."""
        P = self.config.page_size
        tail = -(-self.config.swa_window // P) * P
        slid = n // P * P - tail  # positions below it leave the request's window
        if slid > max(req.swa_evicted_seqlen, req.cache_protected_len):
            if n <= len(req.token_ids):
                self.inserts.checkpoint(req)
            self.tree.free_out_of_window(req, n)
        lock = req.pin
        if (
            lock is not None
            and lock.swa_boundary is not None
            and (n - self.config.swa_window >= req.cache_protected_len)
        ):
            req.pin = self.tree.unpin_swa(lock)

    # -- Mamba state -----------------------------------------------------------------------------

    def give_mamba_state(self, req: Request, node: TreeNode, slot: torch.Tensor) -> None:
        """The request's state slot ``slot`` (taken by the caller): a copy of the anchor's
        state, or zeros from position 0."""
        tree, pool = self.tree, self.mamba_pool
        req.mamba_slot = slot
        src = node.value[tree.mamba.slot] if node is not tree.root else None
        if req.cached_len and src is None:
            raise RuntimeError(f"mamba: matched {req.cached_len} tokens but {node} has no state")
        d = slot.to(self.device)
        if src is None:
            for t in pool.tensors:
                t[:, d] = 0
            return
        # Copied layer by layer in wait_layer: a loaded state arrives with its layer's event.
        s = src.to(self.device)
        for i, (kind, _) in enumerate(self.layer_map):
            if kind == "mamba":
                req._pending_cow[i] = (s, d)

    def copy_states(self, layer: int, requests: Iterable[Request]) -> None:
        """Model layer ``layer``'s loads are done: copy the matched states ``give_mamba_state``
        left pending for it into the requests' live slots (nothing for a non-Mamba layer)."""
        kind, pool_layer = self.layer_map[layer]
        if kind != "mamba":
            return
        for req in requests:
            cow = req._pending_cow.pop(layer, None)
            if cow is not None:
                src, dst = cow
                for t in self.mamba_pool.tensors:
                    t[pool_layer, dst] = t[pool_layer, src]

    # -- books -----------------------------------------------------------------------------------

    def owned(self, requests: Iterable[Request]) -> dict[str, int]:
        """Device slots per pool that ``requests`` hold outside the tree."""
        owned = {"kv": 0, "swa": 0, "mamba": 0}
        for req in requests:
            own = req.kv_slots[req.cache_protected_len :]
            owned["kv"] += own.numel()
            if self.swa:
                owned["swa"] += int((self.kv_alloc.translate(own) >= 0).sum())
            owned["mamba"] += (req.mamba_slot is not None) + (req.mamba_ckpt is not None)
        return owned


def check_end(req: Request, end: int, arg: str) -> None:
    """Refuse a position ``end`` (argument ``arg``) that goes back or passes the reserved slots."""
    if type(end) is not int:
        raise TypeError(f"{arg}: expected an int position, got {end!r}")
    reserved = req.kv_slots.numel()
    if not req.computed_len <= end <= reserved:
        raise ValueError(
            f"{arg}: {end} is outside [computed_len={req.computed_len}, reserved={reserved}]"
            f"; positions only advance, and only over slots taken by reserve()"
        )
