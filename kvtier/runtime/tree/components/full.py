"""FULL: full-attention KV, one slot per token; the backbone of the tree.

"Evicted" and "backed up" are judged by FULL alone, and every non-root node has FULL data on at
least one tier. FULL keeps no LRU lists: its device eviction order comes from a heap over the
tree's evictable device leaves (timestamps), its host eviction order from one over host leaves.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.runtime.tree.components.base import TreeComponent, Validator

if TYPE_CHECKING:
    from kvtier.runtime.tree.node import TreeNode

__all__ = ["FullComponent"]


def _on_device(node: TreeNode, length: int) -> bool:
    return node.value[0] is not None


def _anywhere(node: TreeNode, length: int) -> bool:
    return True


class FullComponent(TreeComponent):
    """Full-attention KV. Must be slot 0. Device value: int64 token slots, one per key token."""

    kind = "full"
    internal_priority = 2
    has_lru = False

    def validator(self, device_only: bool) -> Validator:
        # A non-root node always has FULL data somewhere, so device-or-host accepts every node.
        return _on_device if device_only else _anywhere

    def finalize_match(self, best: TreeNode, best_device: TreeNode, best_len: int) -> int:
        """FULL tokens from ``best`` up to (excluding) ``best_device`` that are only on host."""
        hit, length = 0, best_len
        node = best
        while node is not best_device:
            if node.value[0] is None:
                hit += length
            node = node.parent
            length = len(node.key)
        return hit

    def split(self, parent: TreeNode, child: TreeNode, at: int) -> None:
        # A path pin covers every node above the pinned one, so the upper piece inherits the
        # count; the host pin is on one node (the anchor) and stays with the lower piece.
        value, host = child.value[0], child.host_value[0]
        if value is not None:
            parent.value[0], child.value[0] = value[:at], value[at:]
        if host is not None:
            parent.own_host_values()[0], child.own_host_values()[0] = host[:at], host[at:]
        if child.pins[0]:
            parent.own_pins()[0] = child.pins[0]
