"""Prefix matching: the longest usable cached prefix, with its device and host anchors.

Each component validates the boundary (SWA needs its window resident, MAMBA a state at the
node); ``best_match_node`` is the deepest boundary usable from device or host, and
``last_device_node`` the deepest usable from device alone.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.runtime.tree.node import TreeNode, token_list
from kvtier.runtime.tree.types import MambaCopy, MatchResult
from kvtier.runtime.tree.walk import step

if TYPE_CHECKING:
    from kvtier.runtime.tree.tree import UnifiedRadixTree

__all__ = ["Matcher"]

_EMPTY = torch.empty(0, dtype=torch.int64)


class Matcher:
    """Prefix matching of a tree, and the Mamba copy-on-write a match may ask for."""

    def __init__(self, tree: UnifiedRadixTree) -> None:
        self.tree = tree

    def match_prefix(
        self,
        token_ids: Sequence[int] | torch.Tensor,
        namespace: Hashable = None,
        *,
        read_only: bool = False,
        cow_mamba: bool = False,
    ) -> MatchResult:
        """Longest usable cached prefix of ``token_ids`` (truncated to whole pages).

        A partial match on a node (device or host-only) splits it so the boundary is a node.
        ``read_only=True`` never splits and never refreshes LRU order; its lengths and indices
        equal a regular match's, but where a regular match would split a node the anchors are
        that whole node, which extends past the match: do not pin a read-only result.

        ``cow_mamba=True`` (MAMBA only, not read-only): when ``best_match_node`` holds a device
        state (the one the request resumes from), give the request a state slot of its own
        and report the copy in ``mamba_cow`` (see ``mamba_copy_on_write``). A host-only state
        gets none: load it back, then call ``mamba_copy_on_write`` on the anchor.
        """
        P = self.tree.page_size
        tokens = token_list(token_ids)
        total = len(tokens) - len(tokens) % P
        root = self.tree.root
        child, n = step(root, tokens, 0, total, P, namespace)
        if child is None:
            return MatchResult(_EMPTY, root, root)
        comps = self.tree.components
        dev_validators = [c.validator(True) for c in comps]
        any_validators = [c.validator(False) for c in comps] if self.tree.host_enabled else None
        pos = 0
        values: list[torch.Tensor] = []
        best = best_dev = root
        best_len = best_end = n_dev_values = 0
        while child is not None:
            klen = len(child.key)
            if n < klen and not read_only:
                child = self.tree.split(child, n)
            value = child.value[0]
            if value is not None:
                values.append(value if n == klen else value[:n])
            # Every validator sees every node: they are stateful (SWA counts a window).
            dev_ok = True
            for v in dev_validators:
                if not v(child, n):
                    dev_ok = False
            if any_validators is not None:
                any_ok = True
                for v in any_validators:
                    if not v(child, n):
                        any_ok = False
                if any_ok:
                    best, best_len, best_end = child, n, pos + n
            if dev_ok:
                best_dev = child
                n_dev_values = len(values)
                if any_validators is None:
                    best, best_len, best_end = child, n, pos + n
            pos += n
            if n < klen:
                break
            child, n = step(child, tokens, pos, total, P, namespace)
        if n_dev_values == 0:
            indices = _EMPTY
        elif n_dev_values == 1:
            indices = values[0].clone()
        else:
            indices = torch.cat(values[:n_dev_values])
        if not read_only and best is not root:
            path = self.tree._touch(best)
            for comp in self.tree.aux:
                comp.refresh(path)
        mamba = self.tree.mamba
        if mamba is None and (any_validators is None or best is best_dev):
            return MatchResult(indices, best_dev, best, matched_len=best_end)
        hits = [0] * len(comps)
        if best is not best_dev:
            hits = [c.finalize_match(best, best_dev, best_len) for c in comps]
        swa_hit = hits[self.tree.swa.slot] if self.tree.swa is not None else 0
        branching, cow = None, None
        if mamba is not None:
            if not self.tree.host_enabled:
                full_len = sum(len(v) for v in values)
                branching = mamba.branching_seqlen(full_len, int(indices.numel()))
            if cow_mamba and not read_only:
                cow = self.mamba_copy_on_write(best)
            hits[mamba.slot] = mamba.finalize_match(best, best_dev, best_len)
        mamba_hit = hits[mamba.slot] if mamba is not None else 0
        return MatchResult(
            indices, best_dev, best, hits[0], swa_hit, mamba_hit, branching, cow, best_end
        )

    def mamba_copy_on_write(
        self, node: TreeNode, dst: torch.Tensor | None = None
    ) -> MambaCopy | None:
        """The copy that gives a request its own Mamba state starting from ``node``'s.

        A request must not advance the tree's state in place, so it decodes from a copy. With
        ``dst`` None a slot is allocated for the request; when the pool is full one unpinned
        state is evicted first, with ``node`` pinned so its own state survives. Returns None
        when ``node`` has no device state or no slot could be found. The caller owns ``dst``
        (it becomes the request's ``mamba_slot``) and must copy ``src`` to it on device
        (``MambaDevicePool.copy_slots(src, dst)``) while ``node`` is locked.
        """
        mamba = self.tree.mamba
        if mamba is None or node.parent is None or node.value[mamba.slot] is None:
            return None
        if dst is None:
            dst = mamba.device_alloc.alloc(1)
        if dst is None:
            pin = self.tree.pin(node)
            dst = self.tree.alloc_or_evict(mamba, 1)
            self.tree.unpin(pin)
            if dst is None:
                return None
        return MambaCopy(node.value[mamba.slot].clone(), dst)
