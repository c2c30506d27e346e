"""Caching requests: hand a request's computed pages to the tree, then apply the write policy.

A finished request gives the tree its whole computed pages and, for a hybrid model with Mamba
layers, the state of its last page boundary (the checkpoint ``slots.RequestSlots.computed``
took); a running one checkpoints its whole pages so far (chunked prefill, decode, and the SWA
window's slide). Each insert then backs the inserted path up to host as
``CacheConfig.write_policy`` asks.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from kvtier.nvtx import nvtx_range
from kvtier.runtime.request import Request
from kvtier.runtime.tokens import token_list

if TYPE_CHECKING:
    from kvtier.runtime.config import CacheConfig
    from kvtier.runtime.controller import CacheController
    from kvtier.runtime.tree.tree import UnifiedRadixTree

__all__ = ["RequestInserts", "check_tokens_cover"]


class RequestInserts:
    """Inserts running and finished requests into the tree and backs them up to host.

    Args:
        config: the cache's config (``page_size``, ``write_policy``).
        tree: the cache's tree.
        controller: issues the device→host backups of inserted paths.

    The caller has checked that the request is one of its running requests.
    """

    def __init__(
        self, config: CacheConfig, tree: UnifiedRadixTree, controller: CacheController
    ) -> None:
        self.config = config
        self.tree = tree
        self.controller = controller

    def finish(self, req: Request) -> None:
        """Insert a finished request's cacheable prefix and free its live Mamba slot; the
        caller then marks it released and calls :meth:`back_up`."""
        P = self.config.page_size
        check_tokens_cover(req, prefix=req.computed_len // P * P >= req.cache_protected_len)
        with nvtx_range(f"kvtier.insert {req.computed_len} tokens"):
            live = self._trim(req)
            self.tree.cache_finished_req(req)
            if live is not None:
                self.tree.mamba.device_alloc.free(live)

    def checkpoint(self, req: Request) -> None:
        """Insert a running request's whole computed pages; it keeps running on them."""
        P = self.config.page_size
        # The tree reads the cached prefix only when whole pages past it are inserted: a decode
        # step that completes no page pays no walk over a long prompt.
        check_tokens_cover(req, prefix=req.computed_len // P * P > req.cache_protected_len)
        with nvtx_range(f"kvtier.insert {req.computed_len} tokens"):
            tokens = req.token_ids
            req.token_ids = tokens[: req.computed_len]
            self.tree.cache_unfinished_req(req)
            req.token_ids = tokens
        self.back_up(req)

    def back_up(self, req: Request) -> None:
        """Write-through backs the inserted path up now; write-through-selective backs up the
        deepest node that an insert has now reached twice (its ancestors come with it)."""
        res = req.last_insert
        policy = self.config.write_policy
        if res is None or policy == "write_back":
            return
        node = res.last_node
        if policy == "write_through_selective":
            while node is not self.tree.root and node.hit_count < 2:
                node = node.parent
        if node is not self.tree.root and self.tree.backup_chain(node):
            self.controller.backup(node)

    def _trim(self, req: Request) -> torch.Tensor | None:
        """Trim the request to what is cacheable; returns its live Mamba slot to free."""
        req.token_ids = req.token_ids[: req.computed_len]
        live = None
        if self.tree.mamba is not None:
            P = self.config.page_size
            aligned = req.computed_len // P * P
            live = req.mamba_slot
            if req.mamba_ckpt is not None and req.mamba_ckpt_len == aligned and aligned > 0:
                req.mamba_slot = req.mamba_ckpt  # the state at the last page boundary
                req.token_ids = req.token_ids[:aligned]
            else:
                if req.mamba_ckpt is not None:
                    self.tree.mamba.device_alloc.free(req.mamba_ckpt)
                req.mamba_slot = None
            req.mamba_ckpt = None
        return live


def check_tokens_cover(req: Request, prefix: bool = True) -> None:
    """Refuse ``req.token_ids`` that the tree cannot take as the request's tokens: values
    ``match`` would refuse (past the cached prefix), too few for the computed positions, or,
    with ``prefix`` (the tree will walk it), another prefix or namespace where the request
    holds the tree's own slots (``cache_protected_len``: inserting those ids would give a
    second node the same slots, then a double free at the next eviction). A list stays the
    caller's own object; a tensor or an array becomes a list, as ``match`` takes them. Nothing
    changes when it raises."""
    tokens, n = req.token_ids, req.cache_protected_len
    if not isinstance(tokens, (Sequence, torch.Tensor, np.ndarray)) or isinstance(
        tokens, (str, bytes, bytearray, memoryview)
    ):
        raise TypeError(
            f"req.token_ids: expected a sequence of ints, a 1-D integer tensor or array, got "
            f"{type(tokens).__name__}"
        )
    # The values past the cached prefix only: a list's prefix is checked against the tree's
    # keys below, which equality makes valid (no second pass over a long prompt).
    some, past = (tokens[n:], n) if isinstance(tokens, list) else (tokens, 0)
    if past and len(some) <= 64 and all(type(t) is int and 0 <= t < 1 << 63 for t in some):
        pass  # a decode step's few new ids: no numpy round trip
    elif len(some):
        try:
            checked = token_list(some)
        except (TypeError, ValueError) as e:
            where = f"req.token_ids[{past}:]" if past else "req.token_ids"
            raise type(e)(str(e).replace("token_ids", where, 1)) from None
        if not isinstance(tokens, list):
            tokens = checked
    if len(tokens) < max(req.computed_len, n):
        raise ValueError(
            f"req.token_ids: {len(tokens)} token ids for {req.computed_len} computed "
            "positions; set req.token_ids to the prompt and the tokens fed back since"
        )
    if prefix and n and req.pin is not None:
        if req.pin.node.namespace != req.namespace:
            raise ValueError(
                f"req.namespace: {req.namespace!r:.80} is not the namespace the request was "
                f"matched in ({req.pin.node.namespace!r:.80}), whose slots it holds"
            )
        node, end = req.pin.node, req.pin.node_end
        while node.parent is not None and end > 0:
            start = end - len(node.key)
            if start < n:
                hi = min(end, n)
                if tokens[start:hi] != node.key[: hi - start]:
                    raise ValueError(
                        f"req.token_ids: positions [{start}, {hi}) differ from the cached "
                        f"prefix the request was matched on ({n} tokens whose slots the tree "
                        "owns); only positions from there on may change"
                    )
            node, end = node.parent, start
    if tokens is not req.token_ids:
        req.token_ids = tokens
