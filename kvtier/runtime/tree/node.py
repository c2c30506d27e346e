"""Radix tree nodes and page-aligned keys.

A key is a list of token ids, truncated to whole pages of ``P`` tokens. It is a list because
schedulers hold token ids in lists: a request's tokens are compared slice by slice with node keys
and never converted whole. Children are found by their first page: the child-dict key is
``tuple(key[:P])`` (one token id, as an int, when P = 1). Under the root the namespace (LoRA
id, cache salt) is part of the child key, so two namespaces never share a node; below the root
every node inherits its namespace.

Per-component data lives in parallel lists indexed by the component's slot (FULL is slot 0):

    value[c]      device indices (int64 tensor) or None (tombstone / evicted)
    host_value[c] host indices or None (not backed up); write through ``own_host_values()``
    pins[c]       device pin count
    host_pins[c]  host pin count; write through ``own_host_pins()``

``retention`` marks a node covered by retention pins (``retention.py``): the highest priority
among them, None when it is not retained.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Sequence

import torch

__all__ = ["TreeNode", "child_key", "match_len", "page_align", "token_list"]

_ids = itertools.count()


class TreeNode:
    """One edge of the radix tree with the data of every component for its tokens.

    Invariants (checked by ``UnifiedRadixTree.check_integrity``): ``end`` equals the parent's
    ``end`` plus ``len(key)``; a non-root node has FULL data on device or host; a node keeps its
    identity when split (the new node is the upper piece), so ``end`` of a node never changes.
    """

    __slots__ = (
        "attached",
        "children",
        "ckey",
        "end",
        "hit_count",
        "host_pins",
        "host_value",
        "id",
        "key",
        "last_access",
        "namespace",
        "page_hashes",
        "parent",
        "pins",
        "priority",
        "retention",
        "value",
    )

    def __init__(
        self,
        key: list[int],
        parent: TreeNode | None,
        num_components: int,
        namespace: Hashable = None,
    ) -> None:
        self.id = next(_ids)
        self.key = key
        self.namespace = namespace
        self.parent = parent
        self.children: dict[Hashable, TreeNode] = {}
        self.ckey: Hashable = None  # this node's key in its parent's ``children`` (set on link)
        self.end = (parent.end if parent is not None else 0) + len(key)
        self.value: list[torch.Tensor | None] = [None] * num_components
        self.pins = [0] * num_components
        # Host data and host pins start as shared, immutable empty tuples and become the node's
        # own lists on the first write (``own_host_values``, ``own_host_pins``): most nodes never
        # reach the host tier, and every GC-tracked object a new node allocates brings CPython's
        # next generation-0 collection closer (a pause inside some request; see bench_tree).
        self.host_value: list[torch.Tensor | None] | tuple = _nones(num_components)
        self.host_pins: list[int] | tuple = _zeros(num_components)
        self.last_access = 0
        self.hit_count = 0
        self.priority = 0
        self.retention: int | None = None  # highest priority of the retention pins covering it
        self.page_hashes: list[str] | None = None
        self.attached = True

    def own_host_values(self) -> list[torch.Tensor | None]:
        """``host_value`` as this node's own list, for writing."""
        hv = self.host_value
        if type(hv) is tuple:
            hv = self.host_value = list(hv)
        return hv

    def own_host_pins(self) -> list[int]:
        """``host_pins`` as this node's own list, for writing."""
        hp = self.host_pins
        if type(hp) is tuple:
            hp = self.host_pins = list(hp)
        return hp

    @property
    def start(self) -> int:
        """Token position where this node's key begins."""
        return self.end - len(self.key)

    @property
    def evicted(self) -> bool:
        """FULL has no device data (the node may still be backed up on host)."""
        return self.value[0] is None

    @property
    def backed_up(self) -> bool:
        """FULL has host data."""
        return self.host_value[0] is not None

    def __lt__(self, other: TreeNode) -> bool:
        return self.id < other.id

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, tokens=[{self.start}, {self.end}), children={len(self.children)})"


_NONES: dict[int, tuple[None, ...]] = {}
_ZEROS: dict[int, tuple[int, ...]] = {}


def _nones(n: int) -> tuple[None, ...]:
    t = _NONES.get(n)
    if t is None:
        t = _NONES[n] = (None,) * n
    return t


def _zeros(n: int) -> tuple[int, ...]:
    t = _ZEROS.get(n)
    if t is None:
        t = _ZEROS[n] = (0,) * n
    return t


def token_list(tokens: Sequence[int] | torch.Tensor) -> list[int]:
    """Token ids as a list (not truncated); a list is returned as is, not copied."""
    if isinstance(tokens, list):
        return tokens
    if isinstance(tokens, torch.Tensor):
        return tokens.tolist()
    return list(tokens)


def page_align(tokens: Sequence[int] | torch.Tensor, page_size: int) -> list[int]:
    """Token ids as a list, truncated to a multiple of ``page_size``."""
    tokens = token_list(tokens)
    return tokens[: len(tokens) - len(tokens) % page_size]


def child_key(
    tokens: list[int], pos: int, page_size: int, namespace: Hashable, at_root: bool
) -> Hashable:
    """The child-dict key of the page starting at ``pos``."""
    page = tokens[pos] if page_size == 1 else tuple(tokens[pos : pos + page_size])
    return (namespace, page) if at_root else page


def match_len(
    key: list[int], tokens: list[int], pos: int, page_size: int, end: int | None = None
) -> int:
    """Length (a multiple of ``page_size``) of the common prefix of ``key`` and
    ``tokens[pos:end]`` (``end`` defaults to ``len(tokens)``)."""
    n = min(len(key), (len(tokens) if end is None else end) - pos)
    n -= n % page_size
    if key[:n] == tokens[pos : pos + n]:
        return n
    # Divergence: bisect on page count; slices compare in C, so this is O(n log n / P) work
    # done only where a node is split.
    lo, hi = 0, n // page_size  # pages [0, lo) match; page hi - 1 ... unknown
    while lo < hi:
        mid = (lo + hi + 1) // 2
        m = mid * page_size
        if key[:m] == tokens[pos : pos + m]:
            lo = mid
        else:
            hi = mid - 1
    return lo * page_size
