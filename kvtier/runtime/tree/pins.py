"""Device and host pins of the tree: reference counts that keep data from eviction.

A device ``pin`` holds FULL on the whole path to the root (a prefix is only usable whole), SWA
on one window above the node and MAMBA on the node itself; ``unpin_swa`` lets the window go
early (decode moved past it). A host pin (``pin_host``) keeps a node's host data from host
eviction while a copy or an L3 write reads it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.runtime.tree.node import TreeNode, zero_pins
from kvtier.runtime.tree.types import HostPinHandle, PinHandle, TreeIntegrityError

if TYPE_CHECKING:
    from kvtier.runtime.tree.tree import UnifiedRadixTree

__all__ = ["Pins"]


class Pins:
    """Device and host pins of a tree: reference counts that keep data from eviction."""

    def __init__(self, tree: UnifiedRadixTree) -> None:
        self.tree = tree
        self._zeros = zero_pins(len(tree.components))  # an unpinned node's pins (node.py)

    def pin(self, node: TreeNode) -> PinHandle:
        """Pin ``node`` against device eviction; pass the handle back to ``unlock``.

        FULL is pinned on every device node from ``node`` to the root; evicted nodes at the
        bottom are skipped (recorded as ``full_end``). SWA is pinned on one window above
        ``node``, MAMBA on ``node`` itself.
        """
        if node.parent is None:
            return PinHandle(node, 0, 0)
        x = node
        while x.parent is not None and x.value[0] is None:
            x = x.parent
        full_end, delta = x.end, 0
        # ``tree.inc_pin(x, 0)`` inlined, books summed over the path (a scheduler pins a path
        # per request): a node pinned for the first time takes its own pin list (node.py).
        device_leaves = self.tree.device_leaves
        while x.parent is not None:
            pins = x.pins
            if pins[0]:
                pins[0] += 1
            else:
                if type(pins) is tuple:
                    pins = x.pins = list(pins)
                pins[0] = 1
                delta += len(x.key)
                device_leaves.discard(x)
            x = x.parent
        self.tree.evictable[0] -= delta
        self.tree.protected[0] += delta
        swa_boundary, swa_skipped = None, ()
        if self.tree.swa is not None:
            swa_boundary, swa_skipped = self._pin_window(node, device=True)
        mamba = False
        if self.tree.mamba is not None and node.value[self.tree.mamba.slot] is not None:
            self.tree.inc_pin(node, self.tree.mamba.slot)
            mamba = True
        return PinHandle(node, node.end, full_end, swa_boundary, swa_skipped, mamba, delta)

    def unpin(self, handle: PinHandle) -> None:
        """Release every pin ``handle`` holds."""
        handle = self.unpin_swa(handle)
        x = handle.node
        while x.end > handle.full_end:
            x = x.parent
        if x.parent is None:
            return
        self.tree.dec_pin(x, 0)
        # Every node above keeps a device child (the one just unpinned), so unpinning it cannot
        # make it a device leaf: only the counters change.
        x = x.parent
        evictable = 0
        zeros = self._zeros
        while x.parent is not None:
            pins = x.pins
            count = pins[0] - 1
            if count > 0:
                pins[0] = count
            elif count == 0:
                # The shared zeros back (node.py); no aux pin outlives the FULL pin (an aux
                # count never exceeds FULL's; check_integrity checks it).
                x.pins = zeros
                evictable += len(x.key)
            else:
                raise TreeIntegrityError(f"unpin of {x} component full: pin count would be -1")
            x = x.parent
        self.tree.evictable[0] += evictable
        self.tree.protected[0] -= evictable

    def unpin_swa(self, handle: PinHandle) -> PinHandle:
        """Release the SWA window pin early (decode moved past it); the FULL pin stays.

        The Mamba pin goes too: it is only useful with the window, and a pinned Mamba state
        under an unpinned SWA node would strand the SWA eviction cascade.
        """
        if handle.swa_boundary is not None:
            self._unpin_window(handle.node, handle.swa_boundary, handle.swa_skipped, device=True)
        if handle.mamba:
            self.tree.dec_pin(handle.node, self.tree.mamba.slot)
        if handle.swa_boundary is None and not handle.mamba:
            return handle
        return handle._replace(swa_boundary=None, swa_skipped=(), mamba=False)

    def _pin_window(self, node: TreeNode, device: bool) -> tuple[int, tuple[tuple[int, int], ...]]:
        """Pin SWA data (device or host) on nodes above ``node`` until ``window`` tokens are
        covered; returns the boundary position and the skipped (data-less) ranges."""
        s, window = self.tree.swa.slot, self.tree.swa.window
        covered, skipped = 0, []
        x = node
        while x.parent is not None and covered < window:
            if (x.value[s] if device else x.host_value[s]) is None:
                skipped.append((x.start, x.end))
            else:
                if device:
                    self.tree.inc_pin(x, s)
                else:
                    self.inc_host_pin(x, s)
                covered += len(x.key)
            x = x.parent
        return x.end, tuple(skipped)

    def _unpin_window(
        self, node: TreeNode, boundary: int, skipped: tuple[tuple[int, int], ...], device: bool
    ) -> None:
        s = self.tree.swa.slot
        x = node
        while x.end > boundary:
            if not any(lo <= x.start and x.end <= hi for lo, hi in skipped):
                if device:
                    self.tree.dec_pin(x, s)
                else:
                    self.dec_host_pin(x, s)
            x = x.parent

    def inc_host_pin(self, node: TreeNode, slot: int) -> None:
        node.own_host_pins()[slot] += 1
        self.tree.host_leaves.discard(node)

    def dec_host_pin(self, node: TreeNode, slot: int) -> None:
        count = node.drop_pin(slot, host=True)
        if count < 0:
            name = self.tree.components[slot].name
            raise TreeIntegrityError(f"host unpin of {node} component {name}: count would be -1")
        if count == 0:
            self.tree._update_leaf(node)

    def pin_host(self, node: TreeNode) -> HostPinHandle:
        """Pin ``node``'s host data (FULL and MAMBA on the node, SWA over one window) against
        host eviction, e.g. for an in-flight load-back or storage write."""
        if node.parent is None:
            return HostPinHandle(node, 0)
        full = node.host_value[0] is not None
        if full:
            self.inc_host_pin(node, 0)
        swa_boundary, swa_skipped = None, ()
        if self.tree.swa is not None:
            swa_boundary, swa_skipped = self._pin_window(node, device=False)
        mamba = self.tree.mamba is not None and node.host_value[self.tree.mamba.slot] is not None
        if mamba:
            self.inc_host_pin(node, self.tree.mamba.slot)
        return HostPinHandle(node, node.end, full, swa_boundary, swa_skipped, mamba)

    def unpin_host(self, handle: HostPinHandle) -> None:
        """Release every host pin ``handle`` holds."""
        if handle.full:
            self.dec_host_pin(handle.node, 0)
        if handle.swa_boundary is not None:
            self._unpin_window(handle.node, handle.swa_boundary, handle.swa_skipped, device=False)
        if handle.mamba:
            self.dec_host_pin(handle.node, self.tree.mamba.slot)
