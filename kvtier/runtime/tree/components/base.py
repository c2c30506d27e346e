"""The plug-in interface every tree component implements.

A component owns one kind of per-node data (FULL KV, SWA KV, a Mamba state) in one device pool
and, optionally, one host pool. The tree keeps the shared books (counters, leaf sets, LRU
membership) through ``TreeBooks``; a component decides *what* its data is at each event:

    match     validator(device_only), finalize_match
    insert    insert_split_point, on_insert_overlap, on_unevict, commit_insert
    split     split
    evict     free_device / free_host (slot release), internal_priority (cascade order)
    pin       pin / unpin, pin_host / unpin_host (in the tree, per component kind)
    refresh   refresh (LRU order after a match or insert)
    tiers     the pool names used in ``Transfer`` descriptors

Cascade order on internal nodes: FULL (2) > SWA (1) > MAMBA (0). On a leaf every component
goes at once.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from kvtier.runtime.tree.node import TreeNode

__all__ = ["InsertContext", "TreeBooks", "TreeComponent", "Validator"]

#: ``validator(node, length) -> accepted``; ``length`` is the node's token count on the path.
Validator = Callable[["TreeNode", int], bool]


class Allocator(Protocol):
    size: int

    def free(self, slots: torch.Tensor) -> None: ...

    def available_size(self) -> int: ...


class TreeBooks(Protocol):
    """The tree's bookkeeping entry points that components call."""

    page_size: int

    def set_device(self, node: TreeNode, slot: int, value: torch.Tensor) -> None: ...

    def clear_device(self, node: TreeNode, slot: int) -> int: ...

    def split(self, node: TreeNode, at: int) -> TreeNode: ...


@dataclass
class InsertContext:
    """Per-insert arguments and the flags components report back.

    Attributes:
        prev_prefix_len: tokens at the head of the key that the request already got from the
            tree (its ``cache_protected_len``); their slots are never freed by the insert.
        swa_evicted_seqlen: page-aligned; the request's slots below it carry no SWA data.
        mamba_value: the request's Mamba state slot to commit at the end node, or None.
        unfinished: the request keeps running; slots the tree cannot take are left to it.
        keep_from: set by a component: the insert stops here and the request keeps its slots
            from this position on (unfinished inserts only).
        mamba_exist, mamba_adopted: see ``InsertResult``.
    """

    prev_prefix_len: int = 0
    swa_evicted_seqlen: int = 0
    mamba_value: torch.Tensor | None = None
    unfinished: bool = False
    keep_from: int | None = None
    mamba_exist: bool = False
    mamba_adopted: bool = False


class TreeComponent(ABC):
    """Base class of FULL, SWA and MAMBA.

    Args:
        name: the pool name used in transfer descriptors and integrity reports.
        device_alloc: device pool allocator.
        host_alloc: host pool allocator, or None when this component has no host tier.
    """

    #: keyword of this component in ``evict``/``evict_host`` and ``EvictResult``.
    kind: str = ""
    internal_priority: int = 0
    #: whether the component keeps device/host LRU lists (aux components do, FULL does not).
    has_lru: bool = True

    def __init__(self, name: str, device_alloc: Allocator, host_alloc: Allocator | None) -> None:
        self.name = name
        self.device_alloc = device_alloc
        self.host_alloc = host_alloc
        self.slot = -1
        self.books: TreeBooks
        # Oldest first; ``move_to_end`` marks most recently used. Device LRU = nodes with device
        # data; host LRU = nodes with host data and no device data.
        self.device_lru: OrderedDict[int, TreeNode] = OrderedDict()
        self.host_lru: OrderedDict[int, TreeNode] = OrderedDict()

    def attach(self, books: TreeBooks, slot: int) -> None:
        self.books = books
        self.slot = slot

    # -- sizes and slot release ------------------------------------------------------------

    def amount(self, node: TreeNode) -> int:
        """Device/host amount the node holds: tokens, or slots for per-request states."""
        return len(node.key)

    def free_device(self, node: TreeNode) -> None:
        """Return ``node.value[slot]`` to the device pool (books are updated by the tree)."""
        self.device_alloc.free(node.value[self.slot])

    def free_host(self, node: TreeNode) -> None:
        assert self.host_alloc is not None
        self.host_alloc.free(node.host_value[self.slot])

    # -- match -----------------------------------------------------------------------------

    @abstractmethod
    def validator(self, device_only: bool) -> Validator:
        """A fresh (possibly stateful) validator, called root-down on each node of the path."""

    def finalize_match(self, best: TreeNode, best_device: TreeNode, best_len: int) -> int:
        """This component's host hit length for the match ending at the two anchors.

        ``best_len`` is how many of ``best``'s tokens the match covers: ``len(best.key)``,
        or fewer when a read-only match ended inside ``best`` without splitting it."""
        return 0

    # -- insert ----------------------------------------------------------------------------

    def insert_split_point(
        self, node: TreeNode, pos: int, n: int, ctx: InsertContext
    ) -> int | None:
        """Offset in ``(0, n)`` where the insert should split ``node`` first, or None."""
        return None

    def on_insert_overlap(
        self, node: TreeNode, pos: int, n: int, fresh: torch.Tensor, ctx: InsertContext
    ) -> int:
        """``node`` (device-resident) covers the request's ``[pos, pos+n)``; ``fresh`` are the
        request's slots there. Return the offset from which the tree consumed ``fresh`` (the
        request's duplicates before it are freed by the tree); ``n`` = consumed none."""
        return n

    def on_unevict(self, node: TreeNode, pos: int, fresh: torch.Tensor, ctx: InsertContext) -> None:
        """FULL of an evicted ``node`` was just refilled from the request's ``fresh`` slots."""

    def commit_insert(self, target: TreeNode, new_leaf: bool, ctx: InsertContext) -> TreeNode:
        """Last insert step on the end node; returns the (possibly split-off) end node."""
        return target

    @abstractmethod
    def split(self, parent: TreeNode, child: TreeNode, at: int) -> None:
        """``parent`` is the new upper piece (``at`` tokens) of ``child``; move this component's
        data and pins. Parent has no data of this component on entry."""

    # -- LRU -------------------------------------------------------------------------------

    def refresh(self, path_bottom_up: list[TreeNode]) -> None:
        """Mark nodes of a just-used path as recently used (bottom node first in the list)."""
