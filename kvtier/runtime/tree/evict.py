"""Device and host eviction for ``UnifiedRadixTree`` (a part acting on the books in tree.py).

Order and rules:

- FULL device eviction pops a min-heap over the evictable device leaves, keyed by last access
  (``lru``) or by (priority, last access) (``priority``); a parent that becomes a leaf is pushed.
  A leaf goes with all its components at once: a backed-up leaf is demoted (device data freed,
  host data kept); an unbacked one is deleted, unless a ``write_back`` hook is set, in which case
  it is backed up first and stays on device if that fails.
- SWA and MAMBA device eviction scan their device LRU, oldest first, skipping pinned nodes. A
  device leaf is evicted whole; on any other node only this component's data is tombstoned,
  together with co-located components of lower cascade priority (FULL 2 > SWA 1 > MAMBA 0). A
  pinned lower-priority component there is a stranded pin and raises.
- Host eviction mirrors this: FULL pops host leaves (evicted, backed up, childless, unpinned) and
  deletes them; SWA and MAMBA scan their host-only LRU.
- Retained nodes (``retention.py``) go last: on device their leaves sort after every unretained
  leaf (then by pin priority and last access), and they are only demoted, never deleted; their
  SWA and MAMBA device data go, after all unretained data, only where a host copy exists. On
  host they are not evicted at all.

Empty tombstones cannot arise: every node keeps FULL data on some tier until it is deleted, and
a deleted node is always a leaf, so no upward cleanup pass is needed.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from contextlib import nullcontext
from typing import TYPE_CHECKING

from kvtier.runtime.tree.types import EvictResult, TreeIntegrityError

if TYPE_CHECKING:
    from kvtier.runtime.tree.components import TreeComponent
    from kvtier.runtime.tree.node import TreeNode
    from kvtier.runtime.tree.tree import UnifiedRadixTree

__all__ = ["Eviction"]


class Eviction:
    """Device and host eviction of a tree: its books stay the tree's; this part acts on them."""

    def __init__(self, tree: UnifiedRadixTree) -> None:
        self.tree = tree

    def evict(self, full: int = 0, swa: int = 0, mamba: int = 0) -> EvictResult:
        """Free at least the requested device amounts where unpinned data allows.

        Args:
            full: FULL tokens; swa: SWA tokens; mamba: Mamba slots.
        Returns:
            device amounts freed per component (demoted data counts as freed).
        """
        return self._evict_tier(
            self.tree.full.device_alloc,
            self._evict_full_device,
            self._evict_aux_device,
            full,
            swa,
            mamba,
        )

    def evict_host(self, full: int = 0, swa: int = 0, mamba: int = 0) -> EvictResult:
        """Free at least the requested host amounts where unpinned host data allows."""
        return self._evict_tier(
            self.tree.full.host_alloc, self._evict_full_host, self._evict_aux_host, full, swa, mamba
        )

    def _evict_tier(
        self,
        full_alloc,
        evict_full: Callable[[int, list[int]], None],
        evict_aux: Callable[[TreeComponent, int, list[int]], None],
        full: int,
        swa: int,
        mamba: int,
    ) -> EvictResult:
        """One tier's eviction: FULL, then SWA, then MAMBA, frees batched in ``full_alloc``."""
        freed = [0] * len(self.tree.components)
        with full_alloc.batched_free() if full_alloc is not None else nullcontext():
            if full > 0:
                evict_full(full, freed)
            if swa > 0 and self.tree.swa is not None:
                evict_aux(self.tree.swa, swa, freed)
            if mamba > 0 and self.tree.mamba is not None:
                evict_aux(self.tree.mamba, mamba, freed)
        return self._evict_result(freed)

    def _evict_result(self, freed: list[int]) -> EvictResult:
        swa = freed[self.tree.swa.slot] if self.tree.swa is not None else 0
        mamba = freed[self.tree.mamba.slot] if self.tree.mamba is not None else 0
        return EvictResult(freed[0], swa, mamba)

    def _leaf_order(self, node: TreeNode) -> tuple:
        if self.tree.eviction_policy == "priority":
            key = (node.priority, node.last_access, node.id)
        else:
            key = (node.last_access, node.id)
        if not self.tree.retention.handles:
            return key
        # Retained leaves after every unretained one, then by their pins' priority.
        r = node.retention
        return (r is not None, 0 if r is None else r, *key)

    # -- device --------------------------------------------------------------------------------

    def _leaf_heap(self, leaves: set[TreeNode]) -> list[tuple]:
        # Built inline (not through _leaf_order): an eviction call orders every leaf once, and a
        # method call per leaf was a fifth of the call's cost.
        if self.tree.retention.handles:
            heap = [(self._leaf_order(n), n) for n in leaves]
        elif self.tree.eviction_policy == "priority":
            heap = [((n.priority, n.last_access, n.id), n) for n in leaves]
        else:
            heap = [((n.last_access, n.id), n) for n in leaves]
        heapq.heapify(heap)
        return heap

    def _evict_full_device(self, target: int, freed: list[int]) -> None:
        self._evict_leaves(self.tree.device_leaves, self._evict_device_leaf, target, freed)

    def _evict_leaves(
        self,
        leaves: set[TreeNode],
        evict_leaf: Callable[[TreeNode, list[int]], bool],
        target: int,
        freed: list[int],
    ) -> None:
        """Pop ``leaves`` (a tier's leaf set) in eviction order until FULL's ``target`` is freed;
        a parent that becomes a leaf joins the heap."""
        heap = self._leaf_heap(leaves)
        while freed[0] < target and heap:
            _, node = heapq.heappop(heap)
            if node not in leaves:
                continue  # already gone, or pinned since the heap was built
            parent = node.parent
            if evict_leaf(node, freed) and parent in leaves:
                heapq.heappush(heap, (self._leaf_order(parent), parent))

    def _evict_device_leaf(self, node: TreeNode, freed: list[int]) -> bool:
        """Evict a device leaf with all components; False if it must stay (write-back failed,
        or it is retained and holds data with no host copy)."""
        # A retained prefix is demoted, never lost: data without a host copy keeps it on device
        # (but write-back backs up a leaf whose FULL has none, aux data with it).
        if (
            node.retention is not None
            and not (self.tree.write_back and node.host_value[0] is None)
            and self._device_only(node, self.tree.components)
        ):
            return False
        # Never demote data that has no host copy (SGLang #27108): a failed backup keeps the node.
        if (
            node.host_value[0] is None
            and self.tree.write_back is not None
            and (not self.tree.write_back(node) or node.host_value[0] is None)
        ):
            return False
        for comp in reversed(self.tree.aux):
            if node.value[comp.slot] is not None:
                freed[comp.slot] += self.tree.clear_device(node, comp.slot)
        deleted = node.host_value[0] is None
        # A deleted leaf's books (its leaf sets, its parent's) are redone once, by _detach.
        freed[0] += self.tree.clear_device(node, 0, update_leaves=not deleted)
        if deleted:
            if node.children:
                raise TreeIntegrityError(f"deleting unbacked {node} that has children")
            self.tree._detach(node)
        return True

    def _evict_aux_device(self, comp: TreeComponent, target: int, freed: list[int]) -> None:
        s = comp.slot
        retained = []
        for node in list(comp.device_lru.values()):
            if freed[s] >= target:
                return
            if node.value[s] is None or node.pins[s] or not node.attached:
                continue
            if node.retention is not None:
                retained.append(node)
                continue
            if node in self.tree.device_leaves and self._evict_device_leaf(node, freed):
                continue
            self._tombstone(node, comp, freed, host=False)
        lower = [c for c in self.tree.aux if c.internal_priority <= comp.internal_priority]
        for node in retained:  # last, and only data that a host copy keeps (demoted)
            if freed[s] >= target:
                return
            if node.value[s] is None or node.pins[s] or not node.attached:
                continue
            if self._device_only(node, lower):
                continue
            if node in self.tree.device_leaves and self._evict_device_leaf(node, freed):
                continue
            self._tombstone(node, comp, freed, host=False)

    @staticmethod
    def _device_only(node: TreeNode, comps) -> bool:
        """Some component of ``comps`` has data on device only (nothing to demote it to)."""
        return any(
            node.value[c.slot] is not None and node.host_value[c.slot] is None for c in comps
        )

    def _tombstone(self, node: TreeNode, comp: TreeComponent, freed: list[int], host: bool) -> None:
        """Drop ``comp``'s data on one tier of ``node`` and cascade to lower-priority components."""
        victims = []
        for other in self.tree.aux:
            if other.internal_priority > comp.internal_priority:
                continue
            data = node.host_value if host else node.value
            if data[other.slot] is None:
                continue
            pins = node.host_pins if host else node.pins
            if pins[other.slot]:
                raise TreeIntegrityError(
                    f"stranded {'host ' if host else ''}pin: {other.name} is pinned "
                    f"({pins[other.slot]}) on {node} while its {comp.name} data is evicted"
                )
            victims.append(other.slot)
        for slot in victims:
            if host:
                freed[slot] += self.tree.clear_host(node, slot)
            else:
                freed[slot] += self.tree.clear_device(node, slot)

    # -- host ----------------------------------------------------------------------------------

    def _evict_full_host(self, target: int, freed: list[int]) -> None:
        self._evict_leaves(self.tree.host_leaves, self._evict_host_leaf, target, freed)

    def _evict_host_leaf(self, node: TreeNode, freed: list[int]) -> bool:
        """Delete a host leaf with all components (a host leaf always goes: True)."""
        for comp in self.tree.components:
            if node.host_value[comp.slot] is not None:
                freed[comp.slot] += self.tree.clear_host(node, comp.slot)
        self.tree._detach(node)
        return True

    def _evict_aux_host(self, comp: TreeComponent, target: int, freed: list[int]) -> None:
        s = comp.slot
        for node in list(comp.host_lru.values()):
            if freed[s] >= target:
                break
            if (
                node.host_value[s] is None
                or node.host_pins[s]
                or not node.attached
                or node.retention is not None
            ):
                continue
            if node in self.tree.host_leaves:
                self._evict_host_leaf(node, freed)
            else:
                self._tombstone(node, comp, freed, host=True)
