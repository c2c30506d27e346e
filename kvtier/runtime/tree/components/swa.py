"""SWA: sliding-window KV for tokens inside the last ``window`` positions of a sequence.

Device values are SWA-pool slots, always equal to the translation of the node's FULL slots
through the ``SWAPageAllocator`` table; slots are freed through that table, so a full slot whose
SWA data is already gone maps to the sentinel and is never freed twice.

A node without SWA data while FULL is present is a tombstone. A match boundary is valid only
when the ``window`` tokens above it are SWA-resident, so tombstones far above a boundary do no
harm. New leaves are capped at one page-aligned window (``tail``) so that a pin, which covers
one window, never holds more SWA than that.

Inserts (``swa_evicted_seqlen`` = first position whose SWA data the request still holds):

    node vs boundary b          tombstone node beyond prev_prefix_len, FULL unpinned
    b <= node start             adopt the request's slots as FULL and SWA; free the old FULL
    start < b < end             split at b first; the lower piece is then the case above
    b >= node end               nothing (the node stays a tombstone)
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kvtier.runtime.tree.components.base import InsertContext, TreeComponent, Validator

if TYPE_CHECKING:
    from kvtier.runtime.pools.allocator import PageAllocator, SWAPageAllocator
    from kvtier.runtime.tree.node import TreeNode

__all__ = ["SWAComponent"]


class SWAComponent(TreeComponent):
    """Sliding-window KV with window ``window`` tokens.

    Args:
        window: the sliding window in tokens (any positive size; it need not be page-aligned).
        device_alloc: the ``SWAPageAllocator`` shared with FULL.
        host_alloc: SWA host pool, or None.
    """

    kind = "swa"
    internal_priority = 1

    def __init__(
        self,
        window: int,
        device_alloc: SWAPageAllocator,
        host_alloc: PageAllocator | None = None,
        name: str = "swa",
    ) -> None:
        if window <= 0:
            raise ValueError(f"window must be positive, got {window}")
        super().__init__(name, device_alloc, host_alloc)
        self.window = window
        self.swa_alloc = device_alloc
        P = device_alloc.page_size
        self.tail = math.ceil(window / P) * P

    def free_device(self, node: TreeNode) -> None:
        self.swa_alloc.free_swa(node.value[0])

    def translate(self, full_slots: torch.Tensor, where: str) -> torch.Tensor:
        """SWA slots of ``full_slots``; raises if any of them carries no SWA data."""
        swa = self.swa_alloc.translate(full_slots)
        if swa.numel() and int(swa.min()) < 0:
            raise ValueError(
                f"swa: full slots for {where} carry no SWA data (first: slot "
                f"{int(full_slots[swa < 0][0])}); pass the right swa_evicted_seqlen"
            )
        return swa

    # -- match -----------------------------------------------------------------------------

    def validator(self, device_only: bool) -> Validator:
        s, window = self.slot, self.window
        run = math.inf  # SWA-resident tokens directly above (and including) the current node

        def window_resident(node: TreeNode, length: int) -> bool:
            nonlocal run
            if node.value[s] is None and (device_only or node.host_value[s] is None):
                run = 0
                return False
            run += length
            return run >= window

        return window_resident

    def finalize_match(self, best: TreeNode, best_device: TreeNode, best_len: int) -> int:
        """SWA tokens ``load_back`` would restore for ``best``: host-only SWA within the window."""
        s, hit, covered, length = self.slot, 0, 0, best_len
        node = best
        while node.parent is not None and covered < self.window:
            if node.value[s] is None:
                if node.host_value[s] is None:
                    break
                hit += length
            covered += length
            node = node.parent
            length = len(node.key)
        return hit

    # -- insert ----------------------------------------------------------------------------

    def _restorable(self, node: TreeNode, pos: int, ctx: InsertContext) -> bool:
        return node.value[self.slot] is None and pos >= ctx.prev_prefix_len and node.pins[0] == 0

    def insert_split_point(
        self, node: TreeNode, pos: int, n: int, ctx: InsertContext
    ) -> int | None:
        b = ctx.swa_evicted_seqlen
        if pos < b < pos + n and self._restorable(node, pos, ctx):
            return b - pos
        return None

    def on_insert_overlap(
        self, node: TreeNode, pos: int, n: int, fresh: torch.Tensor, ctx: InsertContext
    ) -> int:
        s = self.slot
        if (
            node.value[s] is not None
            or pos < ctx.prev_prefix_len
            or pos + n <= ctx.swa_evicted_seqlen
        ):
            return n
        if not self._restorable(node, pos, ctx) or pos < ctx.swa_evicted_seqlen:
            # A pinned tombstone keeps its FULL slots (a reader may use them), so it cannot take
            # the request's slots. A finished request's duplicates are freed; a running one keeps
            # its slots, which still carry the SWA data it needs.
            if ctx.unfinished:
                ctx.keep_from = pos
            return n
        swa = self.translate(fresh, f"tokens [{pos}, {pos + n})")
        self.books.replace_full(node, fresh)
        self.books.set_device(node, s, swa)
        return 0

    def on_unevict(self, node: TreeNode, pos: int, fresh: torch.Tensor, ctx: InsertContext) -> None:
        if pos >= ctx.swa_evicted_seqlen:
            self.books.set_device(
                node, self.slot, self.translate(fresh, f"tokens [{pos}, {node.end})")
            )

    def commit_insert(self, target: TreeNode, new_leaf: bool, ctx: InsertContext) -> TreeNode:
        if not new_leaf:
            return target
        cut = ctx.swa_evicted_seqlen - target.start
        if cut >= len(target.key):
            return target  # the whole leaf slid out of the window: SWA tombstone
        if cut > 0:
            self.books.split(target, cut)  # upper piece: tombstone; target: in-window suffix
        self.books.set_device(target, self.slot, self.translate(target.value[0], f"leaf {target}"))
        if len(target.key) > self.tail:
            self.books.split(target, len(target.key) - self.tail)
        return target

    def split(self, parent: TreeNode, child: TreeNode, at: int) -> None:
        s = self.slot
        value, host = child.value[s], child.host_value[s]
        if value is not None:
            parent.value[s], child.value[s] = value[:at], value[at:]
            self.device_lru[parent.id] = parent
            self.device_lru.move_to_end(child.id)
        if host is not None:
            parent.own_host_values()[s], child.own_host_values()[s] = host[:at], host[at:]
            if value is None:
                self.host_lru[parent.id] = parent
                self.host_lru.move_to_end(child.id)
        # A window pin covers consecutive nodes, so both pieces are inside it.
        if child.pins[s]:
            parent.own_pins()[s] = child.pins[s]
        if child.host_pins[s]:
            parent.own_host_pins()[s] = child.host_pins[s]

    # -- LRU -------------------------------------------------------------------------------

    def refresh(self, path_bottom_up: list[TreeNode]) -> None:
        """Refresh only the nodes within ``window + P`` tokens of the bottom: older ancestors
        stay old, so their SWA data (far from any boundary) is evicted first."""
        limit = self.window + self.books.page_size
        covered = 0
        recent: list[TreeNode] = []
        for node in path_bottom_up:
            if covered >= limit or node.parent is None:
                break
            recent.append(node)
            covered += len(node.key)
        for node in reversed(recent):
            if node.id in self.device_lru:
                self.device_lru.move_to_end(node.id)
            elif node.id in self.host_lru:
                self.host_lru.move_to_end(node.id)
