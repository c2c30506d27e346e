"""Insert: cache a request's tokens with its FULL slots, one radix walk down the tree.

The walk splits a node where the request diverges inside it (and where an aux component needs a
boundary), gives evicted nodes on the path the request's slots back ("unevict"), frees the
request's slots that duplicate tree data (once, past its protected prefix), and hangs the rest
as a new leaf.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING

import torch

from kvtier.runtime.tree.components import InsertContext
from kvtier.runtime.tree.node import token_list
from kvtier.runtime.tree.types import InsertResult, TreeIntegrityError
from kvtier.runtime.tree.walk import step

if TYPE_CHECKING:
    from kvtier.runtime.tree.tree import UnifiedRadixTree

__all__ = ["Inserter"]


class Inserter:
    """Inserts into a tree: its books stay the tree's; this part acts on them."""

    def __init__(self, tree: UnifiedRadixTree) -> None:
        self.tree = tree

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
        """Cache ``token_ids`` (truncated to whole pages) with FULL slots ``value``.

        Args:
            value: int64 ``[>= aligned len]`` FULL slots of the request, one per token.
            prev_prefix_len: the request's protected prefix (slots it got from the tree); slots
                at or past it that duplicate tree data are freed here, exactly once.
            swa_evicted_seqlen: page-aligned; the request's slots below it have no SWA data.
            mamba_value: one-slot tensor: the request's state at the end of the key.
            unfinished: the request keeps running (``cache_unfinished_req``); an SWA tombstone
                that cannot take its slots stops the insert and the request keeps them.

        Evicted (host-only) nodes on the path take the request's slots back ("unevict").
        """
        tree = self.tree
        P = tree.page_size
        if swa_evicted_seqlen % P:
            raise ValueError(f"swa_evicted_seqlen={swa_evicted_seqlen} is not a multiple of P={P}")
        tokens = token_list(token_ids)
        total = len(tokens) - len(tokens) % P
        if value.numel() < total:
            raise ValueError(f"value has {value.numel()} slots for {total} tokens")
        aux = tree.aux
        ctx = None
        if aux:
            ctx = InsertContext(prev_prefix_len, swa_evicted_seqlen, mamba_value, unfinished)
        root = tree.root
        node, pos = root, 0
        child, n = step(root, tokens, 0, total, P, namespace)
        while child is not None:
            if n < len(child.key):
                child = tree.split(child, n)
            for comp in aux:
                cut = comp.insert_split_point(child, pos, n, ctx)
                if cut is not None:
                    child = tree.split(child, cut)
                    n = cut
            if priority > child.priority:
                child.priority = priority
            if child.value[0] is None:
                if pos < prev_prefix_len:
                    raise TreeIntegrityError(f"{child} is evicted inside the protected prefix")
                fresh = value[pos : pos + n]
                tree.set_device(child, 0, fresh.clone())
                if tree.events is not None:
                    tree.events.device_stored(child)
                for comp in aux:
                    comp.on_unevict(child, pos, fresh, ctx)
            elif aux or pos + n > prev_prefix_len:
                # Nodes inside the protected prefix hold the request's own matched slots (the
                # common case): nothing to slice or free there.
                fresh = value[pos : pos + n]
                consumed = n
                for comp in aux:
                    consumed = min(consumed, comp.on_insert_overlap(child, pos, n, fresh, ctx))
                if aux and ctx.keep_from is not None:
                    break
                dup = max(0, prev_prefix_len - pos)
                if dup < consumed:
                    tree.full.device_alloc.free(fresh[dup:consumed])
            child.hit_count += 1
            node = child
            pos += n
            # After a partial match this finds nothing (the tokens diverge from the lower piece).
            child, n = step(node, tokens, pos, total, P, namespace)
        kept = ctx is None or ctx.keep_from is None
        prefix_len = pos
        new_leaf = pos < total and kept
        if new_leaf:
            node = tree._add_leaf(node, tokens[pos:total], value[pos:total], namespace)
            node.priority = priority
            node.hit_count = 1  # the insert that creates a node counts as its first
        if node is not root and kept:
            for comp in aux:
                node = comp.commit_insert(node, new_leaf, ctx)
        if node is not root:
            path = tree._touch(node)
            for comp in aux:
                comp.refresh(path)
        if ctx is None:
            return InsertResult(prefix_len, total, total, node)
        cached = total if kept else ctx.keep_from
        return InsertResult(prefix_len, total, cached, node, ctx.mamba_exist, ctx.mamba_adopted)
