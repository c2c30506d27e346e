"""``check_integrity``: walk the whole tree, recount every book and every pool, raise with numbers.

Checks the tree invariants (the controller owns the copies in flight) and slot conservation:
for every pool, ``allocator used == tree-owned + request-owned`` and no slot is owned twice.
It costs O(tree); tests call it after every step.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from kvtier.runtime.tree.types import TreeIntegrityError

if TYPE_CHECKING:
    from kvtier.runtime.tree.node import TreeNode
    from kvtier.runtime.tree.tree import UnifiedRadixTree

__all__ = ["Integrity"]


def _fail(msg: str) -> None:
    raise TreeIntegrityError(msg)


class Integrity:
    """The integrity check of a tree: its books stay the tree's; this part acts on them."""

    def __init__(self, tree: UnifiedRadixTree) -> None:
        self.tree = tree

    def all_nodes(self) -> list[TreeNode]:
        """Every node reachable from the root, root first."""
        nodes, stack = [], [self.tree.root]
        while stack:
            node = stack.pop()
            nodes.append(node)
            stack.extend(node.children.values())
        return nodes

    def check_integrity(
        self,
        request_owned: Mapping[str, int] | None = None,
        host_owned: Mapping[str, int] | None = None,
    ) -> None:
        """Raise ``TreeIntegrityError`` naming the first broken invariant, with the numbers.

        Args:
            request_owned: device slots held by running requests per pool name (``"kv"``,
                ``"swa"``, ``"mamba"``); missing pools count 0.
            host_owned: host slots allocated from the tree's host pools but held outside the
                tree (e.g. by an in-flight L3 prefetch) per pool name; missing pools count 0.
        """
        request_owned = request_owned or {}
        host_owned = host_owned or {}
        root = self.tree.root
        if root.value[0] is None or root.pins[0] < 1 or root.key:
            _fail(f"root broken: value={root.value[0]}, pins={root.pins[0]}, key={root.key}")
        nodes = self.all_nodes()
        reachable = set(nodes)
        n_comp = len(self.tree.components)
        evictable, protected = [0] * n_comp, [0] * n_comp
        device_owned = [[] for _ in range(n_comp)]
        host_owned_slots = [[] for _ in range(n_comp)]
        for node in nodes[1:]:
            self._check_node(node, evictable, protected, device_owned, host_owned_slots)
        if self.tree.swa is not None:
            self._check_swa_translation(nodes[1:])
        for slot, comp in enumerate(self.tree.components):
            if (evictable[slot], protected[slot]) != (
                self.tree.evictable[slot],
                self.tree.protected[slot],
            ):
                _fail(
                    f"{comp.name}: evictable/protected books {self.tree.evictable[slot]}/"
                    f"{self.tree.protected[slot]} != recount {evictable[slot]}/{protected[slot]}"
                )
        for name, leaves in (("device", self.tree.device_leaves), ("host", self.tree.host_leaves)):
            stray = [n for n in leaves if n not in reachable]
            if stray:
                _fail(f"{len(stray)} unreachable nodes in the {name} leaf set, e.g. {stray[0]}")
        if self.tree.device_leaves & self.tree.host_leaves:
            _fail(f"{len(self.tree.device_leaves & self.tree.host_leaves)} nodes in both leaf sets")
        for comp in self.tree.aux:
            for name, lru in (("device", comp.device_lru), ("host", comp.host_lru)):
                stray = [n for n in lru.values() if n not in reachable]
                if stray:
                    _fail(
                        f"{comp.name}: {len(stray)} unreachable nodes in the {name} LRU, e.g. {stray[0]}"
                    )
        self._check_pools(device_owned, host_owned_slots, request_owned, host_owned)

    def _check_node(
        self,
        node: TreeNode,
        evictable: list[int],
        protected: list[int],
        device_owned: list[list[torch.Tensor]],
        host_owned: list[list[torch.Tensor]],
    ) -> None:
        parent, P = node.parent, self.tree.page_size
        page = self.tree._page_key(node)
        short = page if type(page) is int else hash(page)
        if (
            not node.attached
            or node.ckey not in (short, page)
            or parent.children.get(node.ckey) is not node
        ):
            _fail(f"{node}: not linked from its parent {parent}")
        for other in (parent.children.get(short), parent.children.get(page)):
            if other is not None and other is not node and self.tree._page_key(other) == page:
                _fail(f"{node} and {other}: two children of {parent} with the same first page")
        if not node.key or len(node.key) % P:
            _fail(f"{node}: key length {len(node.key)} is not a positive multiple of P={P}")
        if node.end != parent.end + len(node.key):
            _fail(f"{node}: end {node.end} != parent end {parent.end} + {len(node.key)}")
        if node.value[0] is None and node.host_value[0] is None:
            _fail(f"{node}: no FULL data on any tier")
        for pins in (node.pins, node.host_pins):
            if type(pins) is not tuple and not any(pins):
                _fail(f"{node}: unpinned but keeps its own pin list {pins} (not zero_pins)")
        if node.value[0] is not None and parent.value[0] is None:
            _fail(f"{node}: on device under evicted parent {parent}")
        if (
            self.tree.backup_continuity
            and node.host_value[0] is not None
            and parent.parent is not None
            and parent.host_value[0] is None
        ):
            _fail(f"{node}: backed up under unbacked parent {parent}")
        for comp in self.tree.components:
            s = comp.slot
            dev, host = node.value[s], node.host_value[s]
            pin, host_pin = node.pins[s], node.host_pins[s]
            amount = comp.amount(node)
            if s and dev is not None and node.value[0] is None:
                _fail(f"{node}: {comp.name} on device without FULL on device")
            if s and host is not None and node.host_value[0] is None:
                _fail(f"{node}: {comp.name} on host without FULL on host")
            if pin < 0 or host_pin < 0 or pin > node.pins[0]:
                _fail(f"{node}: {comp.name} pins {pin}/{host_pin} (FULL pin {node.pins[0]})")
            if (pin and dev is None) or (host_pin and host is None):
                _fail(f"{node}: {comp.name} pinned ({pin}/{host_pin}) without data on that tier")
            if dev is not None:
                if dev.numel() != amount:
                    _fail(f"{node}: {comp.name} device has {dev.numel()} slots, expected {amount}")
                device_owned[s].append(dev)
                if pin:
                    protected[s] += amount
                else:
                    evictable[s] += amount
            if host is not None:
                if host.numel() != amount:
                    _fail(f"{node}: {comp.name} host has {host.numel()} slots, expected {amount}")
                host_owned[s].append(host)
            if comp.has_lru:
                in_dev, in_host = node.id in comp.device_lru, node.id in comp.host_lru
                if in_dev != (dev is not None) or in_host != (dev is None and host is not None):
                    _fail(
                        f"{node}: {comp.name} LRU membership device={in_dev} host={in_host} "
                        f"for data device={dev is not None} host={host is not None}"
                    )
        if (node in self.tree.device_leaves) != self.tree._is_device_leaf(node):
            _fail(f"{node}: device leaf set membership {node in self.tree.device_leaves} is stale")
        if (node in self.tree.host_leaves) != self.tree._is_host_leaf(node):
            _fail(f"{node}: host leaf set membership {node in self.tree.host_leaves} is stale")

    def _check_swa_translation(self, nodes: list[TreeNode]) -> None:
        """SWA device slots equal the translation of the node's FULL slots (one batched
        lookup; the failing node is searched only on a mismatch)."""
        s = self.tree.swa.slot
        with_swa = [n for n in nodes if n.value[s] is not None]
        if not with_swa:
            return
        expect = self.tree.swa.swa_alloc.translate(torch.cat([n.value[0] for n in with_swa]))
        if torch.equal(expect, torch.cat([n.value[s] for n in with_swa])):
            return
        for node in with_swa:
            if not torch.equal(self.tree.swa.swa_alloc.translate(node.value[0]), node.value[s]):
                _fail(f"{node}: SWA slots differ from the translation of its FULL slots")

    def _check_pools(
        self,
        device_owned: list[list[torch.Tensor]],
        host_owned: list[list[torch.Tensor]],
        request_owned: Mapping[str, int],
        held_outside: Mapping[str, int],
    ) -> None:
        kv = self.tree.full.device_alloc
        for comp in self.tree.components:
            s = comp.slot
            for tier, owned, alloc in (
                ("device", device_owned[s], comp.device_alloc),
                ("host", host_owned[s], comp.host_alloc),
            ):
                if alloc is None:
                    continue
                slots = torch.cat(owned) if owned else torch.empty(0, dtype=torch.int64)
                if torch.unique(slots).numel() != slots.numel():
                    _fail(f"{comp.name} {tier}: a slot is owned by two nodes")
                pages = alloc
                if tier == "device" and comp is self.tree.swa:
                    pages = kv.swa
                elif tier == "device" and comp is self.tree.full and self.tree.swa is not None:
                    pages = kv.full
                if slots.numel() and not bool(pages.is_allocated(slots).all()):
                    _fail(f"{comp.name} {tier}: the tree owns slots its allocator has free")
                if comp is self.tree.swa and tier == "device":
                    used = kv.swa.used_size()
                    if kv.num_mapped_pages() * self.tree.page_size != used:
                        _fail(f"swa: {kv.num_mapped_pages()} mapped pages but {used} slots in use")
                else:
                    used = alloc.used_size()
                owners = request_owned if tier == "device" else held_outside
                others = owners.get(comp.name, 0)
                if used != slots.numel() + others:
                    who = "requests" if tier == "device" else "holders outside the tree"
                    _fail(
                        f"{comp.name} {tier}: allocator has {used} slots in use, tree owns "
                        f"{slots.numel()}, {who} own {others} (leak or double free of "
                        f"{used - slots.numel() - others})"
                    )
