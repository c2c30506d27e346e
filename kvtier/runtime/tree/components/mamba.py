"""MAMBA: one recurrent-state snapshot per node, in a request-slot pool (page size 1).

A state summarises every token from the root to the end of its node, so only nodes that hold a
state are valid match boundaries, a split leaves the state on the lower piece, and a pin is
taken on the anchor alone. Device and host LRU lists order its eviction.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from kvtier.runtime.tree.components.base import Allocator, InsertContext, TreeComponent, Validator

if TYPE_CHECKING:
    from kvtier.runtime.tree.node import TreeNode

__all__ = ["MambaComponent"]


class MambaComponent(TreeComponent):
    """Mamba/linear-attention state. Device value: int64 tensor of one request slot."""

    kind = "mamba"
    internal_priority = 0

    def __init__(
        self,
        name: str,
        device_alloc: Allocator,
        host_alloc: Allocator | None = None,
        *,
        page_size: int = 1,
        chunk_size: int = 64,
    ) -> None:
        if chunk_size <= 0:
            raise ValueError(f"chunk_size must be positive, got {chunk_size}")
        super().__init__(name, device_alloc, host_alloc)
        self.chunk_size = chunk_size
        #: positions where a request can checkpoint a state that a node can hold: multiples of
        #: the kernel's chunk (states exist there) and of the page (nodes end there).
        self.grid = math.lcm(chunk_size, page_size)

    def amount(self, node: TreeNode) -> int:
        return 1

    def validator(self, device_only: bool) -> Validator:
        s = self.slot

        def has_state(node: TreeNode, length: int) -> bool:
            # A partial piece of a node (length < key) never holds the state.
            if length != len(node.key):
                return False
            return node.value[s] is not None or (not device_only and node.host_value[s] is not None)

        return has_state

    def branching_seqlen(self, full_len: int, state_len: int) -> int | None:
        """Where a request should checkpoint its state so later requests can branch there.

        ``full_len``: FULL tokens matched on device; ``state_len``: where the matched state
        ends. The last grid position within the FULL match, if it lies past the state."""
        aligned = full_len - full_len % self.grid
        return aligned if aligned > state_len else None

    def finalize_match(self, best: TreeNode, best_device: TreeNode, best_len: int) -> int:
        # 1 asks the caller to load the anchor's state back from host.
        if best.parent is None or best.value[self.slot] is not None:
            return 0
        return 1

    def commit_insert(self, target: TreeNode, new_leaf: bool, ctx: InsertContext) -> TreeNode:
        if ctx.mamba_value is None or target.parent is None:
            return target
        if target.value[self.slot] is not None:
            ctx.mamba_exist = True
            self.refresh([target])
            return target
        self.books.set_device(target, self.slot, ctx.mamba_value.reshape(1).to(torch.int64))
        ctx.mamba_adopted = True
        return target

    def split(self, parent: TreeNode, child: TreeNode, at: int) -> None:
        """The state stays with ``child``; the upper piece has none."""

    def refresh(self, path_bottom_up: list[TreeNode]) -> None:
        # Only the anchor's state is used by a match; ancestors' states are not refreshed.
        if path_bottom_up:
            node = path_bottom_up[0]
            if node.id in self.device_lru:
                self.device_lru.move_to_end(node.id)
            elif node.id in self.host_lru:
                self.host_lru.move_to_end(node.id)
