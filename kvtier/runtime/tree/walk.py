"""The one radix walk step that match, insert and graft share.

A walk goes down from a node along ``tokens``; at each node it asks for the child that continues
``tokens[pos:end]`` and how far that child's key matches. The caller decides what a partial match
means for it (split the child, or stop).
"""

from __future__ import annotations

from collections.abc import Hashable

from kvtier.runtime.tree.node import TreeNode, match_len

__all__ = ["step"]


def step(
    node: TreeNode, tokens: list[int], pos: int, end: int, page_size: int, namespace: Hashable
) -> tuple[TreeNode | None, int]:
    """The child of ``node`` continuing ``tokens[pos:end]``, and the matched length (whole
    pages; less than the child's key on a divergence or at ``end``). ``(None, 0)`` if none."""
    if pos >= end:
        return None, 0
    # ``child_key`` spelled out: this runs once per node of every match and insert, and the
    # call cost more than the expression.
    page = tokens[pos] if page_size == 1 else tuple(tokens[pos : pos + page_size])
    child = node.children.get(page if node.parent is not None else (namespace, page))
    if child is None:
        return None, 0
    key = child.key
    n = len(key)
    stop = pos + n
    if stop <= end and key == tokens[pos:stop]:
        return child, n
    return child, match_len(key, tokens, pos, page_size, end)
