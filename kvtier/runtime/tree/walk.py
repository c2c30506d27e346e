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
    children = node.children
    if pos >= end or not children:  # a walk ends at a leaf often: no page key to build
        return None, 0
    # Children are keyed by their page key's hash, an int the GC does not track (node.py). What
    # the hash finds is verified: a child whose tokens (or namespace, at the root) differ merely
    # shares the hash, and a child linked while its hash was taken is under the page key itself.
    # The page key is spelled out (``node.page_key``): this runs once per node of every match and
    # insert, and the call cost more than the expression.
    if node.parent is not None:
        if page_size == 1:
            child = children.get(tokens[pos])  # an int key: exact
            if child is None:
                return None, 0
            return child, _matched(child, tokens, pos, end, page_size)
        page = tuple(tokens[pos : pos + page_size])
        child = children.get(hash(page))
        if child is not None:
            key = child.key  # ``_matched`` inlined on the common path
            stop = pos + len(key)
            if stop <= end and key == tokens[pos:stop]:
                return child, len(key)
            n = match_len(key, tokens, pos, page_size, end)
            if n:
                return child, n
    else:
        page = (namespace, tokens[pos] if page_size == 1 else tuple(tokens[pos : pos + page_size]))
        child = children.get(hash(page))
        if child is not None and child.namespace == namespace:
            n = _matched(child, tokens, pos, end, page_size)
            if n:
                return child, n
    child = children.get(page)
    if child is None:
        return None, 0
    return child, _matched(child, tokens, pos, end, page_size)


def _matched(child: TreeNode, tokens: list[int], pos: int, end: int, page_size: int) -> int:
    """How far ``child``'s key matches ``tokens[pos:end]`` (whole pages; 0: not its page)."""
    key = child.key
    stop = pos + len(key)
    if stop <= end and key == tokens[pos:stop]:
        return len(key)
    return match_len(key, tokens, pos, page_size, end)
