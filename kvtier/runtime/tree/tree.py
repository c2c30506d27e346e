"""The unified radix tree: prefix matching and cache books for FULL, SWA and MAMBA components.

The tree maps page-aligned token prefixes to per-component device and host indices. It keeps
the books only; data copies are the controller's, described by ``Transfer`` records.

Books kept here (all recounted by ``check_integrity``):

    evictable[c] / protected[c]   device amount of component c on nodes with pins[c] == 0 / > 0
    device_leaves                 FULL-evictable nodes (see ``_is_device_leaf``)
    host_leaves                   host-evictable nodes (see ``_is_host_leaf``)
    component LRU lists           per aux component: device LRU and host-only LRU

Pins are reference counts. A device ``pin`` pins FULL on the whole path to the root (a prefix
is only usable whole), SWA on one window above the node, and MAMBA on the node itself.

This module holds construction, the books, split and the node links. Match
(``match.Matcher``), insert (``insert.Inserter``), pins (``pins.Pins``), eviction
(``evict.Eviction``), host-tier books (``tiers.HostTier``), request helpers
(``requests.RequestCache``), retention pins (``retention.Retention``) and the integrity check
(``integrity.Integrity``) are parts of their
own that act on these books; ``build_tree`` wires them in, and the methods at the end of the
class hand their calls on.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence

import torch

from kvtier.runtime.tree.components import (
    FullComponent,
    MambaComponent,
    SWAComponent,
    TreeComponent,
)
from kvtier.runtime.tree.node import TreeNode, link_key, page_key
from kvtier.runtime.tree.types import (
    Backup,
    EvictResult,
    HostPinHandle,
    InsertResult,
    LoadBack,
    MambaCopy,
    MatchResult,
    PinHandle,
    TreeIntegrityError,
)

__all__ = ["UnifiedRadixTree"]

_EMPTY = torch.empty(0, dtype=torch.int64)


class UnifiedRadixTree:
    """Radix tree over page-aligned token keys with pluggable per-node components.

    Args:
        components: FULL first, then any of SWA and MAMBA (at most one each).
        page_size: tokens per page P; keys are truncated to multiples of P.
        eviction_policy: ``"lru"`` (last access) or ``"priority"`` (lowest request priority
            first, then last access).
        write_back: called with an unbacked device leaf about to be evicted; it must back the
            node up (``backup`` + the copy) and return True, else the node stays on device.
            None: unbacked leaves are deleted on eviction.
        backup_continuity: backups form a root-anchored prefix (write-through policies);
            ``backup`` then backs up missing ancestors first and the check enforces it.

    Rules callers rely on:
        - pin ``last_device_node`` before using ``device_indices``; unpin with the handle;
        - ``insert`` takes ownership of the request's slots at positions >= ``prev_prefix_len``
          (it frees duplicates itself); the caller frees the unaligned tail.
    """

    def __init__(
        self,
        components: Sequence[TreeComponent],
        page_size: int,
        *,
        eviction_policy: str = "lru",
        write_back: Callable[[TreeNode], bool] | None = None,
        backup_continuity: bool = True,
    ) -> None:
        if not components or not isinstance(components[0], FullComponent):
            raise ValueError("components must start with a FullComponent")
        if eviction_policy not in ("lru", "priority"):
            raise ValueError(
                f"eviction_policy must be 'lru' or 'priority', got {eviction_policy!r}"
            )
        self.components = tuple(components)
        self.page_size = page_size
        self.eviction_policy = eviction_policy
        self.write_back = write_back
        self.backup_continuity = backup_continuity
        self.full: FullComponent = components[0]
        self.swa: SWAComponent | None = None
        self.mamba: MambaComponent | None = None
        for slot, comp in enumerate(self.components):
            comp.attach(self, slot)
            if isinstance(comp, SWAComponent):
                if self.swa is not None:
                    raise ValueError("at most one SWA component")
                self.swa = comp
            elif isinstance(comp, MambaComponent):
                if self.mamba is not None:
                    raise ValueError("at most one MAMBA component")
                self.mamba = comp
            elif slot:
                raise ValueError(f"unknown component {comp!r} at slot {slot}")
        self.aux = self.components[1:]
        self.host_enabled = self.full.host_alloc is not None
        if any(c.host_alloc is not None for c in self.aux) and not self.host_enabled:
            raise ValueError("an aux host pool needs a FULL host pool")
        self.root = self._new_root()
        self.evictable = [0] * len(self.components)
        self.protected = [0] * len(self.components)
        # Told the FULL device tokens each eviction freed, whoever asked for it (the cache's
        # ``evicted_tokens``: a load-back's room too, not only evict() and reserve).
        self.on_evicted: Callable[[int], None] | None = None
        self.device_leaves: set[TreeNode] = set()
        self.host_leaves: set[TreeNode] = set()
        self._clock = 0
        self.events = None  # a kvtier.events sink (set by the facade on rank 0), or None

    def attach_parts(
        self, matcher, inserter, pins, eviction, host_tier, requests, integrity, retention
    ) -> None:
        """The parts that act on this tree's books (``build_tree`` builds and attaches them)."""
        self.matcher, self.inserter, self.pins, self.retention = matcher, inserter, pins, retention
        # A scheduler calls these once or twice per request: go straight to the part (the
        # methods of the same names below document them; an instance attribute saves a frame).
        self.match_prefix = matcher.match_prefix
        self.insert = inserter.insert
        self.pin, self.unpin = pins.pin, pins.unpin
        self.eviction, self.host_tier, self.requests, self.integrity = (
            eviction,
            host_tier,
            requests,
            integrity,
        )

    def alloc_or_evict(self, comp: TreeComponent, n: int) -> torch.Tensor | None:
        """``n`` device units of ``comp`` (tokens, or Mamba slots); when the pool is short,
        evict unpinned data of that component once and try again. None: nothing was taken."""
        slots = comp.device_alloc.alloc(n)
        if slots is None:
            self.evict(**{comp.kind: n})
            slots = comp.device_alloc.alloc(n)
        return slots

    def path_slots(self, node: TreeNode) -> torch.Tensor:
        """FULL device slots of the path root..``node``, in token order (all on device)."""
        values = []
        while node.parent is not None:
            values.append(node.value[0])
            node = node.parent
        return torch.cat(values[::-1]) if values else torch.empty(0, dtype=torch.int64)

    def _new_root(self) -> TreeNode:
        root = TreeNode([], None, len(self.components))
        root.value[0] = _EMPTY
        root.pins = [1] * len(self.components)
        root.priority = -(2**62)
        return root

    # -- books: components and mixins call these ------------------------------------------------

    def set_device(self, node: TreeNode, slot: int, value: torch.Tensor) -> None:
        """Give ``node`` device data of component ``slot`` (it had none)."""
        comp = self.components[slot]
        node.value[slot] = value
        if slot == 0:
            node.from_l3 = False  # served from the device from now on
        amount = comp.amount(node)
        if node.pins[slot]:
            self.protected[slot] += amount
        else:
            self.evictable[slot] += amount
        if comp.has_lru:
            comp.host_lru.pop(node.id, None)
            comp.device_lru[node.id] = node
        elif node.parent is not None:
            self._update_leaf(node)
            self._update_leaf(node.parent)

    def clear_device(self, node: TreeNode, slot: int, *, update_leaves: bool = True) -> int:
        """Free ``node``'s device data of component ``slot``; returns the amount freed.

        ``update_leaves=False`` leaves the leaf books of ``node`` and its parent to the caller:
        eviction passes it for a leaf it detaches next (``_detach`` does both)."""
        comp = self.components[slot]
        comp.free_device(node)
        amount = comp.amount(node)
        if node.pins[slot]:
            self.protected[slot] -= amount
        else:
            self.evictable[slot] -= amount
        node.value[slot] = None
        if slot == 0 and self.events is not None:
            self.events.device_removed(node)
        if comp.has_lru:
            comp.device_lru.pop(node.id, None)
            if node.host_value[slot] is not None:
                comp.host_lru[node.id] = node
        elif update_leaves:
            self._update_leaf(node)
            self._update_leaf(node.parent)
        return amount

    def set_host(self, node: TreeNode, slot: int, host: torch.Tensor) -> None:
        """Record host indices of component ``slot`` on ``node`` (it had none)."""
        comp = self.components[slot]
        node.own_host_values()[slot] = host
        if comp.has_lru and node.value[slot] is None:
            comp.host_lru[node.id] = node

    def clear_host(self, node: TreeNode, slot: int) -> int:
        """Free ``node``'s host data of component ``slot``; returns the amount freed."""
        comp = self.components[slot]
        comp.free_host(node)
        node.own_host_values()[slot] = None
        if slot == 0 and self.events is not None:
            self.events.host_removed(node)
        if comp.has_lru:
            comp.host_lru.pop(node.id, None)
        return comp.amount(node)

    def replace_full(self, node: TreeNode, fresh: torch.Tensor) -> None:
        """Swap an unpinned node's FULL slots for ``fresh`` ones of the same length."""
        if node.pins[0]:
            raise TreeIntegrityError(f"replace_full on pinned {node}")
        self.full.device_alloc.free(node.value[0])
        node.value[0] = fresh.clone()

    def inc_pin(self, node: TreeNode, slot: int) -> int:
        """Add one device pin of component ``slot``; returns the amount newly protected."""
        pins = node.pins
        if pins[slot]:
            pins[slot] += 1  # a pinned node owns its list
            return 0
        amount = self.components[slot].amount(node)
        self.evictable[slot] -= amount
        self.protected[slot] += amount
        node.own_pins()[slot] = 1
        self.device_leaves.discard(node)
        return amount

    def dec_pin(self, node: TreeNode, slot: int) -> None:
        """Drop one device pin of component ``slot``."""
        count = node.drop_pin(slot)
        if count < 0:
            name = self.components[slot].name
            raise TreeIntegrityError(f"unpin of {node} component {name}: pin count would be -1")
        if count == 0:
            amount = self.components[slot].amount(node)
            self.protected[slot] -= amount
            self.evictable[slot] += amount
            self._update_leaf(node)

    def _is_device_leaf(self, node: TreeNode) -> bool:
        """FULL-evictable: unpinned FULL device data, no child with FULL on device, and either
        childless or able to keep its host-only children (backed up, or write-back on)."""
        if node.value[0] is None or node.parent is None or any(node.pins):
            return False
        if node.children:
            for child in node.children.values():
                if child.value[0] is not None:
                    return False
            return node.host_value[0] is not None or self.write_back is not None
        return True

    def _is_host_leaf(self, node: TreeNode) -> bool:
        """Host-evictable: evicted, backed up, unpinned on host, childless, not retained."""
        return (
            node.retention is None
            and node.value[0] is None
            and node.host_value[0] is not None
            and not node.children
            and node.parent is not None
            and not any(node.host_pins)
        )

    def _update_leaf(self, node: TreeNode) -> None:
        if node.parent is None or not node.attached:
            return
        if self._is_device_leaf(node):
            self.device_leaves.add(node)
        else:
            self.device_leaves.discard(node)
        if self._is_host_leaf(node):
            self.host_leaves.add(node)
        else:
            self.host_leaves.discard(node)

    def _touch(self, node: TreeNode) -> list[TreeNode]:
        """Stamp ``node`` and its ancestors, newest at the bottom; returns the path bottom-up."""
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        t = self._clock + len(path)
        for x in path:
            x.last_access = t
            t -= 1
        self._clock += len(path) + 1
        return path

    # -- structure --------------------------------------------------------------------------

    def _page_key(self, node: TreeNode) -> Hashable:
        """``node``'s page key (see node.py) under its parent."""
        return page_key(node.key, 0, self.page_size, node.namespace, node.parent.parent is None)

    def _link(self, parent: TreeNode, node: TreeNode) -> None:
        """Enter ``node`` (whose ``parent`` is set) in ``parent.children``; the child key is kept
        on the node, so unlinking it needs no key slice."""
        children = parent.own_children()
        page = page_key(node.key, 0, self.page_size, node.namespace, parent.parent is None)
        node.ckey = link_key(children, page)
        children[node.ckey] = node

    def split(self, node: TreeNode, at: int) -> TreeNode:
        """Cut ``node`` after ``at`` tokens (page-aligned, inside the key); return the new upper
        piece. ``node`` keeps its identity and end position as the lower piece."""
        P = self.page_size
        if at <= 0 or at >= len(node.key) or at % P:
            raise ValueError(f"split of {node} at {at}: not a page boundary inside the key")
        old_parent = node.parent
        upper = TreeNode(node.key[:at], old_parent, len(self.components), node.namespace)
        upper.ckey = node.ckey  # the same first page: the upper piece takes the node's place
        old_parent.own_children()[upper.ckey] = upper
        node.key = node.key[at:]
        node.parent = upper
        self._link(upper, node)
        upper.last_access = node.last_access
        upper.hit_count = node.hit_count
        upper.priority = node.priority
        upper.retention = node.retention  # covered by exactly the retention pins covering node
        upper.from_l3 = node.from_l3
        if node.page_hashes is not None:
            upper.page_hashes = node.page_hashes[: at // P]
            node.page_hashes = node.page_hashes[at // P :]
        for comp in self.components:
            comp.split(upper, node, at)
        self._update_leaf(upper)
        return upper

    def _add_leaf(
        self, parent: TreeNode, key: list[int], value: torch.Tensor, namespace: Hashable
    ) -> TreeNode:
        leaf = TreeNode(key, parent, len(self.components), namespace)
        self._link(parent, leaf)
        # The books of ``set_device`` without the leaf recomputation: a fresh leaf is unpinned
        # and childless (a device leaf), and its parent now has a device child (not a leaf).
        leaf.value[0] = value.clone()
        self.evictable[0] += len(key)
        self.device_leaves.add(leaf)
        self.device_leaves.discard(parent)
        self.host_leaves.discard(parent)
        if self.events is not None:
            self.events.device_stored(leaf)
        return leaf

    def _detach(self, node: TreeNode) -> None:
        """Remove a node with no device data and no children from the tree; keeps ``parent`` so
        that a handle on it can still walk up."""
        parent = node.parent
        del parent.own_children()[node.ckey]
        node.attached = False
        self.device_leaves.discard(node)
        self.host_leaves.discard(node)
        for comp in self.aux:
            comp.device_lru.pop(node.id, None)
            comp.host_lru.pop(node.id, None)
        self._update_leaf(parent)

    # -- the parts' calls ----------------------------------------------------------------------

    def insert(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        value: torch.Tensor,
        *,
        prev_prefix_len: int = 0,
        swa_evicted_seqlen: int = 0,
        mamba_value: torch.Tensor | None = None,
        priority: int = 0,
        namespace: Hashable = None,
        unfinished: bool = False,
    ) -> InsertResult:
        """See ``Inserter.insert``."""
        return self.inserter.insert(
            token_ids,
            value,
            prev_prefix_len=prev_prefix_len,
            swa_evicted_seqlen=swa_evicted_seqlen,
            mamba_value=mamba_value,
            priority=priority,
            namespace=namespace,
            unfinished=unfinished,
        )

    def match_prefix(
        self,
        token_ids,
        namespace: Hashable = None,
        *,
        read_only: bool = False,
        cow_mamba: bool = False,
    ) -> MatchResult:
        """See ``Matcher.match_prefix``."""
        return self.matcher.match_prefix(
            token_ids, namespace, read_only=read_only, cow_mamba=cow_mamba
        )

    def mamba_copy_on_write(self, node: TreeNode, dst=None) -> MambaCopy | None:
        """See ``Matcher.mamba_copy_on_write``."""
        return self.matcher.mamba_copy_on_write(node, dst)

    def pin(self, node: TreeNode) -> PinHandle:
        """See ``Pins.pin``."""
        return self.pins.pin(node)

    def unpin(self, handle: PinHandle) -> None:
        """See ``Pins.unpin``."""
        self.pins.unpin(handle)

    def unpin_swa(self, handle: PinHandle) -> PinHandle:
        """See ``Pins.unpin_swa``."""
        return self.pins.unpin_swa(handle)

    def pin_host(self, node: TreeNode) -> HostPinHandle:
        """See ``Pins.pin_host``."""
        return self.pins.pin_host(node)

    def unpin_host(self, handle: HostPinHandle) -> None:
        """See ``Pins.unpin_host``."""
        self.pins.unpin_host(handle)

    def inc_host_pin(self, node: TreeNode, slot: int) -> None:
        """See ``Pins.inc_host_pin``."""
        self.pins.inc_host_pin(node, slot)

    def dec_host_pin(self, node: TreeNode, slot: int) -> None:
        """See ``Pins.dec_host_pin``."""
        self.pins.dec_host_pin(node, slot)

    def evict(self, full: int = 0, swa: int = 0, mamba: int = 0) -> EvictResult:
        """See ``Eviction.evict``."""
        res = self.eviction.evict(full, swa, mamba)
        if res.full and self.on_evicted is not None:
            self.on_evicted(res.full)
        return res

    def evict_host(self, full: int = 0, swa: int = 0, mamba: int = 0) -> EvictResult:
        """See ``Eviction.evict_host``."""
        return self.eviction.evict_host(full, swa, mamba)

    def backup(self, node: TreeNode) -> Backup | None:
        """See ``HostTier.backup``."""
        return self.host_tier.backup(node)

    def backup_chain(self, node: TreeNode) -> list[TreeNode]:
        """See ``HostTier.backup_chain``."""
        return self.host_tier.backup_chain(node)

    def finish_backup(self, backup: Backup) -> None:
        """See ``HostTier.finish_backup``."""
        self.host_tier.finish_backup(backup)

    def load_back(self, anchor: TreeNode) -> LoadBack | None:
        """See ``HostTier.load_back``."""
        return self.host_tier.load_back(anchor)

    def finish_load_back(self, load: LoadBack) -> None:
        """See ``HostTier.finish_load_back``."""
        self.host_tier.finish_load_back(load)

    def graft_host(self, anchor, tokens, host_slots_per_pool, page_hashes, namespace):
        """See ``HostTier.graft_host``."""
        return self.host_tier.graft_host(
            anchor, tokens, host_slots_per_pool, page_hashes, namespace
        )

    def graft_swa_window(self, anchor, end, swa_slots, swa_pages) -> torch.Tensor:
        """See ``HostTier.graft_swa_window``."""
        return self.host_tier.graft_swa_window(anchor, end, swa_slots, swa_pages)

    def cache_finished_req(self, req) -> None:
        """See ``RequestCache.cache_finished_req``."""
        self.requests.cache_finished_req(req)

    def release_req(self, req) -> None:
        """See ``RequestCache.release_req``."""
        self.requests.release_req(req)

    def cache_unfinished_req(self, req, *, donate_mamba: bool = False) -> MambaCopy | None:
        """See ``RequestCache.cache_unfinished_req``."""
        return self.requests.cache_unfinished_req(req, donate_mamba=donate_mamba)

    def free_out_of_window(self, req, seqlen: int | None = None) -> int:
        """See ``RequestCache.free_out_of_window``."""
        return self.requests.free_out_of_window(req, seqlen)

    def all_nodes(self) -> list[TreeNode]:
        """See ``Integrity.all_nodes``."""
        return self.integrity.all_nodes()

    def check_integrity(self, request_owned=None, host_owned=None) -> None:
        """See ``Integrity.check_integrity``."""
        self.integrity.check_integrity(request_owned, host_owned)
