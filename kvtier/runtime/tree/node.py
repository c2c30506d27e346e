"""Radix tree nodes and page-aligned keys.

A key is a list of token ids, truncated to whole pages of ``P`` tokens. It is a list because
schedulers hold token ids in lists: a request's tokens are compared slice by slice with node keys
and never converted whole (converting a 2k-token list to an array costs more than comparing it).
Children are found by their first page, whose page key is ``tuple(key[:P])`` (one token id, as
an int, when P = 1). Under the root the namespace (LoRA id, cache salt) is part of the page key,
``(namespace, page)``, so two namespaces never share a node; below the root every node inherits
its namespace. The child-dict key (``ckey``) is ``hash(page key)``, or the page key itself where
it is an int or where a sibling with another page already holds that hash (``link_key``); a
lookup verifies what the hash found (``walk.step``).

Per-component data lives in parallel lists indexed by the component's slot (FULL is slot 0):

    value[c]      device indices (int64 tensor) or None (tombstone / evicted)
    host_value[c] host indices or None (not backed up); write through ``own_host_values()``
    pins[c]       device pin count; write through ``own_pins()``
    host_pins[c]  host pin count; write through ``own_host_pins()``

What a node allocates is kept small on purpose. Every GC-tracked object that outlives a request
(a list, a dict, a tuple, a tensor, the node itself) brings CPython's next generation-0
collection closer, and with ~10^5 nodes alive a collection is a pause of some 200 µs inside the
request it falls in. So a leaf has no ``children`` dict until its first child (it shares one
read-only empty mapping: write through ``own_children()``); host data is a shared tuple of Nones
until first written; pin counts are a shared tuple of zeros whenever all are zero (a node owns a
list only while it is pinned: ``own_pins``, ``zero_pins``); and a child is entered in its
parent's ``children`` under the hash of its page key (an int, which the GC does not track)
rather than under the page tuple.

``retention`` marks a node covered by retention pins (``retention.py``): the highest priority
among them, None when it is not retained.
"""

from __future__ import annotations

import itertools
from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType

import torch

__all__ = [
    "NO_CHILDREN",
    "TreeNode",
    "link_key",
    "match_len",
    "page_align",
    "page_key",
    "token_list",
    "zero_pins",
]

_ids = itertools.count()

#: ``children`` of every node that has none yet: read-only, so a stray write fails loudly.
NO_CHILDREN: Mapping[Hashable, TreeNode] = MappingProxyType({})


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
        "from_l3",
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
        self.children: Mapping[Hashable, TreeNode] = NO_CHILDREN
        self.ckey: Hashable = None  # this node's key in its parent's ``children`` (set on link)
        self.end = (parent.end if parent is not None else 0) + len(key)
        self.value: list[torch.Tensor | None] = [None] * num_components
        # Shared, immutable tuples until written (see the module docstring for why this counts):
        # most nodes are unpinned between requests and never reach the host tier.
        self.pins: list[int] | tuple[int, ...] = _ZEROS[num_components]
        self.host_value: list[torch.Tensor | None] | tuple = _NONES[num_components]
        self.host_pins: list[int] | tuple[int, ...] = _ZEROS[num_components]
        self.last_access = 0
        self.hit_count = 0
        self.priority = 0
        self.retention: int | None = None  # highest priority of the retention pins covering it
        self.page_hashes: list[str] | None = None
        # Host data a prefetch read from L3, not yet on the device: its first load-back counts
        # its tokens as L3 hits (``LoadBack.l3_tokens``); device data clears it (``set_device``).
        self.from_l3 = False
        self.attached = True

    def own_pins(self) -> list[int]:
        """``pins`` as this node's own list, for writing. Whoever drops the last count to 0
        puts the shared ``zero_pins`` back, so that an unpinned node holds no list."""
        pins = self.pins
        if type(pins) is tuple:
            pins = self.pins = list(pins)
        return pins

    def drop_pin(self, slot: int, host: bool = False) -> int:
        """One device (``host``: host) pin of component ``slot`` less; returns the count left.
        With no count left the node gives its list back (``zero_pins``); below 0 (an unpin too
        many) nothing changes and the caller raises."""
        pins = self.host_pins if host else self.pins
        count = pins[slot] - 1
        if count < 0:
            return count
        pins[slot] = count  # a count above 0 lives in the node's own list
        if count == 0 and not any(pins):
            if host:
                self.host_pins = _ZEROS[len(pins)]
            else:
                self.pins = _ZEROS[len(pins)]
        return count

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

    def own_children(self) -> dict[Hashable, TreeNode]:
        """``children`` as this node's own dict, for writing."""
        children = self.children
        if type(children) is not dict:
            children = self.children = {}
        return children

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


# Indexed by the number of components (FULL and at most one SWA and one MAMBA).
_NONES = [(None,) * n for n in range(4)]
_ZEROS = [(0,) * n for n in range(4)]


def zero_pins(n: int) -> tuple[int, ...]:
    """The shared pin counts of a node with ``n`` components and no pin (also no host pin)."""
    return _ZEROS[n]


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


def page_key(
    tokens: list[int], pos: int, page_size: int, namespace: Hashable, at_root: bool
) -> Hashable:
    """The page key of the page starting at ``pos`` (exact: equal keys, equal pages)."""
    page = tokens[pos] if page_size == 1 else tuple(tokens[pos : pos + page_size])
    return (namespace, page) if at_root else page


def link_key(children: Mapping[Hashable, TreeNode], page: Hashable) -> Hashable:
    """The ``ckey`` under which a new child with page key ``page`` enters ``children`` (which
    holds no child with that page): its hash, unless a sibling holds that hash already."""
    if type(page) is int:
        return page
    short = hash(page)
    return page if short in children else short


def match_len(
    key: list[int], tokens: list[int], pos: int, page_size: int, end: int | None = None
) -> int:
    """Length (a multiple of ``page_size``) of the common prefix of ``key`` and
    ``tokens[pos:end]`` (``end`` defaults to ``len(tokens)``)."""
    n = min(len(key), (len(tokens) if end is None else end) - pos)
    n -= n % page_size
    if key[:n] == tokens[pos : pos + n]:
        return n
    # Divergence: bisect on pages, comparing only the half window still in doubt (slices
    # compare in C), so the whole search compares about n tokens once; done where a node splits.
    lo, hi = 0, n // page_size  # pages [0, lo) match; the first differing page is in [lo, hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        a, b = lo * page_size, mid * page_size
        if key[a:b] == tokens[pos + a : pos + b]:
            lo = mid
        else:
            hi = mid
    return lo * page_size
