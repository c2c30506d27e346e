"""Host-tier bookkeeping for ``UnifiedRadixTree``: backup (D→H) and load-back (H→D).

Both operations allocate the destination slots, commit the indices to the tree at once and
return ``Transfer`` descriptors for the controller to copy; the controller calls ``finish_*``
when the copy is done. Until then the source side is pinned:

    backup     device pin on the node (the copy's source cannot be evicted)
    load_back  host pin on the anchor (SGLang #27444: host data must outlive the async H→D copy) and a
               device pin on the loaded path (the fresh device slots cannot be evicted)

Load-back admission compares FULL tokens with the FULL pool's free slots only (SGLang #26302): SWA
pressure must not evict unrelated FULL leaves; a SWA shortfall evicts SWA only.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.runtime.tree.node import TreeNode
from kvtier.runtime.tree.types import Backup, LoadBack, Transfer, TreeIntegrityError
from kvtier.runtime.tree.walk import step

if TYPE_CHECKING:
    from kvtier.runtime.tree.tree import UnifiedRadixTree

__all__ = ["HostTier"]


def _transfers(pairs: dict[str, tuple[list, list]], direction: str) -> tuple[Transfer, ...]:
    """One transfer per pool with slots; a pool's one node's slots are used as they are (never
    written in place: a node's slots are replaced, not edited), not copied by ``torch.cat``
    (a 7K-token host hit's two: 51 -> 11 µs of CPU before the forward pass on the dev VM)."""
    return tuple(
        Transfer(pool, _joined(dev), _joined(host), direction)
        for pool, (dev, host) in pairs.items()
        if dev
    )


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0] if len(parts) == 1 else torch.cat(parts)


class HostTier:
    """Backup and load-back books of a tree: its books stay the tree's; this part acts on them."""

    def __init__(self, tree: UnifiedRadixTree) -> None:
        self.tree = tree

    def backup(self, node: TreeNode) -> Backup | None:
        """Allocate host slots for ``node`` (and, with backup continuity, for its unbacked
        ancestors) and record them; returns the D→H copies, or None if host space ran out.

        Host leaves are evicted to make room. Aux data is backed up with FULL where it is on
        device. The nodes are device-locked until ``finish_backup``.
        """
        if not self.tree.host_enabled:
            raise ValueError("backup needs host pools")
        if node.parent is None or node.value[0] is None:
            raise ValueError(f"backup of {node}: not a device node")
        chain = self.backup_chain(node)
        if not chain:
            raise ValueError(f"backup of {node}: everything it holds is on host already")
        comps = [c for c in self.tree.components if c.host_alloc is not None]
        need = {c.slot: 0 for c in comps}
        for x in chain:
            for c in comps:
                if x.value[c.slot] is not None and x.host_value[c.slot] is None:
                    need[c.slot] += c.amount(x)
        for c in comps:
            short = need[c.slot] - c.host_alloc.available_size()
            if short > 0:
                self.tree.evict_host(**{c.kind: short})
                if need[c.slot] > c.host_alloc.available_size():
                    return None
        pairs: dict[str, tuple[list, list]] = {c.name: ([], []) for c in comps}
        for x in chain:
            for c in comps:
                dev = x.value[c.slot]
                if dev is None or x.host_value[c.slot] is not None:
                    continue
                host = c.host_alloc.alloc(c.amount(x))
                assert host is not None
                self.tree.set_host(x, c.slot, host)
                pairs[c.name][0].append(dev)
                pairs[c.name][1].append(host)
            self.tree._update_leaf(x)
        # A pin on `node` pins FULL down the path but SWA and Mamba only near `node`: the
        # ancestors backed up with it need their own, or their aux slots could be freed and
        # reused while the copy still reads them.
        chain_pins = tuple(self.tree.pin(x) for x in chain[:-1]) if self.tree.aux else ()
        books = Backup(tuple(chain), _transfers(pairs, "d2h"), self.tree.pin(node), chain_pins)
        if self.tree.events is not None:
            self.tree.events.backup_started(books)
        return books

    def backup_chain(self, node: TreeNode) -> list[TreeNode]:
        """The nodes a backup of ``node`` copies, top-down: ``node`` and, with backup
        continuity, its ancestors without a host FULL copy; and, within one SWA window of
        ``node``'s end, nodes whose FULL is on host but whose SWA window or Mamba state is on
        device only (an insert restored them after the FULL backup). Empty: nothing to copy."""
        reach = self.tree.swa.window if self.tree.swa is not None else 0
        chain: list[TreeNode] = []
        x, covered = node, 0
        while x.parent is not None:
            near = x is node or covered < reach
            unbacked = x.host_value[0] is None
            if unbacked or (
                near
                and any(
                    x.value[c.slot] is not None and x.host_value[c.slot] is None
                    for c in self.tree.aux
                    if c.host_alloc is not None
                )
            ):
                chain.append(x)
            elif not near:
                break
            if unbacked and not self.tree.backup_continuity:
                break
            covered += len(x.key)
            x = x.parent
        chain.reverse()
        return chain

    def finish_backup(self, backup: Backup) -> None:
        """The D→H copies of ``backup`` are done: drop its device pins."""
        if self.tree.events is not None:
            self.tree.events.backup_done(backup)
        for handle in backup.chain_pins:
            self.tree.unpin(handle)
        self.tree.unpin(backup.pin)

    def load_back(self, anchor: TreeNode) -> LoadBack | None:
        """Give ``anchor``'s path device slots again (FULL of evicted nodes, host-only SWA within
        one window, the anchor's Mamba state) and commit them; returns the H→D copies, or None
        when there is nothing to load or device space could not be found (nothing changes).

        Use ``MatchResult.best_match_node`` as the anchor.
        """
        if anchor.parent is None or not anchor.attached:
            return None
        to_load: list[TreeNode] = []
        x = anchor
        while x.value[0] is None:
            to_load.append(x)
            x = x.parent
        to_load.reverse()
        swa_nodes: list[TreeNode] = []
        swa = self.tree.swa
        if swa is not None:
            covered, x = 0, anchor
            while x.parent is not None and covered < swa.window:
                if x.value[swa.slot] is None:
                    if x.host_value[swa.slot] is None:
                        break
                    swa_nodes.append(x)
                covered += len(x.key)
                x = x.parent
        mamba = self.tree.mamba
        load_mamba = (
            mamba is not None
            and anchor.value[mamba.slot] is None
            and anchor.host_value[mamba.slot] is not None
        )
        if not to_load and not swa_nodes and not load_mamba:
            return None
        pin = self.tree.pin_host(anchor)
        temp = self.tree.pin(anchor)  # keeps pre-eviction off the device part of the path
        taken = self._allocate_load(to_load, swa_nodes, load_mamba)
        self.tree.unpin(temp)
        if taken is None:
            self.tree.unpin_host(pin)
            return None
        full_slots, mamba_slot = taken
        pairs: dict[str, tuple[list, list]] = {c.name: ([], []) for c in self.tree.components}
        l3_tokens = sum(len(x.key) for x in to_load if x.from_l3)  # set_device clears the mark
        for x, slots in zip(to_load, full_slots):
            self.tree.set_device(x, 0, slots)
            pairs[self.tree.full.name][0].append(slots)
            pairs[self.tree.full.name][1].append(x.host_value[0])
        for x in reversed(swa_nodes):
            swa_slots = swa.translate(x.value[0], f"load-back of {x}")
            self.tree.set_device(x, swa.slot, swa_slots)
            pairs[swa.name][0].append(swa_slots)
            pairs[swa.name][1].append(x.host_value[swa.slot])
        if load_mamba:
            self.tree.set_device(anchor, mamba.slot, mamba_slot)
            pairs[mamba.name][0].append(mamba_slot)
            pairs[mamba.name][1].append(anchor.host_value[mamba.slot])
        loaded = sum(len(x.key) for x in to_load)
        return LoadBack(
            anchor, _transfers(pairs, "h2d"), self.tree.pin(anchor), pin, loaded, l3_tokens
        )

    def _allocate_load(
        self, to_load: list[TreeNode], swa_nodes: list[TreeNode], load_mamba: bool
    ) -> tuple[list[torch.Tensor], torch.Tensor | None] | None:
        """Device slots for a load-back, evicting for room; all or nothing."""
        kv = self.tree.full.device_alloc
        swa = self.tree.swa
        full_tokens = sum(len(x.key) for x in to_load)
        full_free = kv.full_available_size() if swa is not None else kv.available_size()
        if full_free < full_tokens:
            self.tree.evict(full=full_tokens - full_free)
        if swa is not None:
            swa_tokens = sum(len(x.key) for x in swa_nodes)
            if kv.swa_available_size() < swa_tokens:
                self.tree.evict(swa=swa_tokens - kv.swa_available_size())
        if load_mamba and self.tree.mamba.device_alloc.available_size() < 1:
            self.tree.evict(mamba=1)
        in_window = {x.id for x in swa_nodes}
        full_slots: list[torch.Tensor] = []
        swa_for: list[TreeNode] = []
        mamba_slot = None
        ok = True
        for x in to_load:
            n = len(x.key)
            slots = kv.alloc(n) if swa is None or x.id in in_window else kv.alloc_full(n)
            if slots is None:
                ok = False
                break
            full_slots.append(slots)
        if ok and swa is not None:
            for x in swa_nodes:
                if x.value[0] is not None:
                    if not kv.alloc_swa_for(x.value[0]):
                        ok = False
                        break
                    swa_for.append(x)
        if ok and load_mamba:
            mamba_slot = self.tree.mamba.device_alloc.alloc(1)
            ok = mamba_slot is not None
        if ok:
            return full_slots, mamba_slot
        for slots in full_slots:
            kv.free(slots)
        for x in swa_for:
            kv.free_swa(x.value[0])
        return None

    def graft_host(
        self,
        anchor: TreeNode,
        tokens: Sequence[int],
        host_slots_per_pool: Mapping[str, torch.Tensor],
        page_hashes: Sequence[str] | None,
        namespace: Hashable,
    ) -> tuple[TreeNode | None, int]:
        """Hang ``tokens``, which continue ``anchor``'s path, below it as host-only data (pages
        read from L3 into host slots the caller allocated).

        Walks down from ``anchor`` along existing children (splitting a partly matching one) and
        skips the tokens they already hold; the rest becomes one host-only node. Under backup
        continuity nothing is hung below a node without host data (SGLang #30106): the walk stops there.

        Args:
            anchor: an attached node (or the root) whose path ``tokens`` continue.
            tokens: page-aligned token ids.
            host_slots_per_pool: host slots holding ``tokens``, one per token, per pool name:
                ``"kv"`` (FULL) always, and any other per-token component (``"swa"``).
            page_hashes: the L3 page hashes of ``tokens``' pages (the new node keeps its part),
                or None.
            namespace: the request namespace (matters where ``anchor`` is the root).

        Returns:
            ``(end, present)``: the node ending at the last token (None if the walk stopped) and
            how many leading tokens the tree already held. When ``end`` is a new node, the tree
            now owns ``slots[present:]`` of every pool given; every other slot stays the caller's.
        """
        P = self.tree.page_size
        key = list(tokens)
        total = len(key)
        if total % P:
            raise ValueError(f"tokens: {total} tokens is not a whole number of pages of {P}")
        comps = {c.name: c for c in self.tree.components}
        if "kv" not in host_slots_per_pool:
            raise ValueError("host_slots_per_pool: the FULL pool 'kv' is required")
        for name, slots in host_slots_per_pool.items():
            comp = comps.get(name)
            if comp is None or comp is self.tree.mamba or comp.host_alloc is None:
                raise ValueError(f"host_slots_per_pool: {name!r} is not a per-token host pool")
            if slots.numel() != total:
                raise ValueError(
                    f"host_slots_per_pool[{name!r}]: {slots.numel()} slots for {total} tokens"
                )
        if page_hashes is not None and len(page_hashes) != total // P:
            raise ValueError(f"page_hashes: {len(page_hashes)} hashes for {total // P} pages")
        node, pos = anchor, 0
        child, n = step(node, key, 0, total, P, namespace)
        while child is not None:
            if n < len(child.key):
                child = self.tree.split(child, n)
            if self.tree.backup_continuity and child.host_value[0] is None:
                return None, pos
            node, pos = child, pos + n
            child, n = step(node, key, pos, total, P, namespace)
        if pos == total:
            return node, pos
        leaf = TreeNode(key[pos:], node, len(self.tree.components), namespace)
        leaf.from_l3 = True
        self.tree._link(node, leaf)
        for name, slots in host_slots_per_pool.items():
            self.tree.set_host(leaf, comps[name].slot, slots[pos:].clone())
        if page_hashes is not None:
            leaf.page_hashes = list(page_hashes[pos // P :])
        if self.tree.events is not None:
            self.tree.events.host_grafted(leaf)
        self.tree._update_leaf(leaf)
        self.tree._update_leaf(node)
        self.tree._touch(leaf)
        return leaf, pos

    def graft_swa_window(
        self, anchor: TreeNode, end: TreeNode, swa_slots: torch.Tensor, swa_pages: int
    ) -> torch.Tensor:
        """Give the nodes from ``end`` up to ``anchor`` that hold FULL but no SWA host data the
        SWA window read from L3 into ``swa_slots`` (the ``swa_pages`` pages ending at ``end``);
        returns a bool mask of the slots the tree took (the caller keeps the others)."""
        tree = self.tree
        s, P = tree.swa.slot, tree.page_size
        lo = end.end - swa_pages * P
        used = torch.zeros(swa_slots.numel(), dtype=torch.bool)
        x = end
        while x is not anchor and x.parent is not None and x.end > lo:
            if x.host_value[s] is None and x.host_value[0] is not None:
                if x.start < lo:
                    tree.split(x, lo - x.start)  # x keeps the lower, in-window piece
                a, b = x.start - lo, x.end - lo
                tree.set_host(x, s, swa_slots[a:b].clone())
                used[a:b] = True
            x = x.parent
        return used

    def finish_load_back(self, load: LoadBack) -> None:
        """The H→D copies of ``load`` are done: drop its device pin and host pin."""
        if self.tree.events is not None:
            self.tree.events.device_loaded(load)
        self.tree.unpin(load.pin)
        self.tree.unpin_host(load.host_pin)
        if not load.anchor.attached:
            raise TreeIntegrityError(f"load-back anchor {load.anchor} left the tree mid-copy")
