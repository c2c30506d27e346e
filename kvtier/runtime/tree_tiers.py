"""Host-tier bookkeeping for ``UnifiedRadixTree``: backup (D→H) and load-back (H→D).

Both operations allocate the destination slots, commit the indices to the tree at once and
return ``Transfer`` descriptors for the controller to copy; the controller calls ``finish_*``
when the copy is done. Until then the source side is pinned:

    backup     device lock on the node (the copy's source cannot be evicted)
    load_back  host pin on the anchor (#27444: host data must outlive the async H→D copy) and a
               device lock on the loaded path (the fresh device slots cannot be evicted)

Load-back admission compares FULL tokens with the FULL pool's free slots only (#26302): SWA
pressure must not evict unrelated FULL leaves; a SWA shortfall evicts SWA only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvtier.runtime.tree_types import Backup, LoadBack, Transfer, TreeIntegrityError

if TYPE_CHECKING:
    from kvtier.runtime.tree import UnifiedRadixTree
    from kvtier.runtime.tree_node import TreeNode

__all__ = ["HostTierMixin"]


def _transfers(pairs: dict[str, tuple[list, list]], direction: str) -> tuple[Transfer, ...]:
    return tuple(
        Transfer(pool, torch.cat(dev), torch.cat(host), direction)
        for pool, (dev, host) in pairs.items()
        if dev
    )


class HostTierMixin:
    """Backup and load-back books of ``UnifiedRadixTree``."""

    def backup(self: UnifiedRadixTree, node: TreeNode) -> Backup | None:
        """Allocate host slots for ``node`` (and, with backup continuity, for its unbacked
        ancestors) and record them; returns the D→H copies, or None if host space ran out.

        Host leaves are evicted to make room. Aux data is backed up with FULL where it is on
        device. The nodes are device-locked until ``finish_backup``.
        """
        if not self.host_enabled:
            raise ValueError("backup needs host pools")
        if node.parent is None or node.value[0] is None:
            raise ValueError(f"backup of {node}: not a device node")
        chain: list[TreeNode] = []
        x = node
        while x.parent is not None and x.host_value[0] is None:
            chain.append(x)
            if not self.backup_continuity:
                break
            x = x.parent
        chain.reverse()
        comps = [c for c in self.components if c.host_alloc is not None]
        need = {c.slot: 0 for c in comps}
        for x in chain:
            for c in comps:
                if x.value[c.slot] is not None and x.host_value[c.slot] is None:
                    need[c.slot] += c.amount(x)
        for c in comps:
            short = need[c.slot] - c.host_alloc.available_size()
            if short > 0:
                self.evict_host(**{c.kind: short})
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
                self.set_host(x, c.slot, host)
                pairs[c.name][0].append(dev)
                pairs[c.name][1].append(host)
            self._update_leaf(x)
        return Backup(tuple(chain), _transfers(pairs, "d2h"), self.lock(node))

    def finish_backup(self: UnifiedRadixTree, backup: Backup) -> None:
        """The D→H copies of ``backup`` are done: drop its device lock."""
        self.unlock(backup.lock)

    def load_back(self: UnifiedRadixTree, anchor: TreeNode) -> LoadBack | None:
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
        swa = self.swa
        if swa is not None:
            covered, x = 0, anchor
            while x.parent is not None and covered < swa.window:
                if x.value[swa.slot] is None:
                    if x.host_value[swa.slot] is None:
                        break
                    swa_nodes.append(x)
                covered += len(x.key)
                x = x.parent
        mamba = self.mamba
        load_mamba = (
            mamba is not None
            and anchor.value[mamba.slot] is None
            and anchor.host_value[mamba.slot] is not None
        )
        if not to_load and not swa_nodes and not load_mamba:
            return None
        pin = self.pin_host(anchor)
        temp = self.lock(anchor)  # keeps pre-eviction off the device part of the path
        taken = self._allocate_load(to_load, swa_nodes, load_mamba)
        self.unlock(temp)
        if taken is None:
            self.unpin_host(pin)
            return None
        full_slots, mamba_slot = taken
        pairs: dict[str, tuple[list, list]] = {c.name: ([], []) for c in self.components}
        for x, slots in zip(to_load, full_slots):
            self.set_device(x, 0, slots)
            pairs[self.full.name][0].append(slots)
            pairs[self.full.name][1].append(x.host_value[0])
        for x in reversed(swa_nodes):
            swa_slots = swa.translate(x.value[0], f"load-back of {x}")
            self.set_device(x, swa.slot, swa_slots)
            pairs[swa.name][0].append(swa_slots)
            pairs[swa.name][1].append(x.host_value[swa.slot])
        if load_mamba:
            self.set_device(anchor, mamba.slot, mamba_slot)
            pairs[mamba.name][0].append(mamba_slot)
            pairs[mamba.name][1].append(anchor.host_value[mamba.slot])
        loaded = sum(len(x.key) for x in to_load)
        return LoadBack(anchor, _transfers(pairs, "h2d"), self.lock(anchor), pin, loaded)

    def _allocate_load(
        self: UnifiedRadixTree, to_load: list[TreeNode], swa_nodes: list[TreeNode], load_mamba: bool
    ) -> tuple[list[torch.Tensor], torch.Tensor | None] | None:
        """Device slots for a load-back, evicting for room; all or nothing."""
        kv = self.full.device_alloc
        swa = self.swa
        full_tokens = sum(len(x.key) for x in to_load)
        full_free = kv.full_available_size() if swa is not None else kv.available_size()
        if full_free < full_tokens:
            self.evict(full=full_tokens - full_free)
        if swa is not None:
            swa_tokens = sum(len(x.key) for x in swa_nodes)
            if kv.swa_available_size() < swa_tokens:
                self.evict(swa=swa_tokens - kv.swa_available_size())
        if load_mamba and self.mamba.device_alloc.available_size() < 1:
            self.evict(mamba=1)
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
            mamba_slot = self.mamba.device_alloc.alloc(1)
            ok = mamba_slot is not None
        if ok:
            return full_slots, mamba_slot
        for slots in full_slots:
            kv.free(slots)
        for x in swa_for:
            kv.free_swa(x.value[0])
        return None

    def finish_load_back(self: UnifiedRadixTree, load: LoadBack) -> None:
        """The H→D copies of ``load`` are done: drop its device lock and host pin."""
        self.unlock(load.lock)
        self.unpin_host(load.pin)
        if not load.anchor.attached:
            raise TreeIntegrityError(f"load-back anchor {load.anchor} left the tree mid-copy")
