"""A prefetch's two agreed decisions: is a hit worth reading, and what of a read the tree takes.

Both run in ``L3Tier.apply`` on values every TP rank agreed on, and read or change only the tree
(which changes identically on every rank), so every rank decides and grafts alike:

- ``load_beats_recompute``: an agreed query hit is read only if loading it at the measured
  storage (and host→device) bandwidth is expected to beat recomputing it;
- ``graft_agreed``: an agreed termination hangs the agreed pages, SWA window and Mamba state on
  the tree as host-only nodes, sets aside what the tree did not take (freed once the IO thread is
  done with it) and says how the prefetch ended.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

import torch

from kvtier.metrics import TierMetrics
from kvtier.runtime.l3.pools import L3Pool
from kvtier.runtime.l3.prefetch import Prefetch
from kvtier.storage import PrefetchOutcome

if TYPE_CHECKING:
    from kvtier.runtime.config import StorageConfig
    from kvtier.runtime.tree.tree import UnifiedRadixTree

__all__ = ["alloc_host", "free_slots", "graft_agreed", "load_beats_recompute"]


def load_beats_recompute(
    hits: int,
    storage: StorageConfig,
    metrics: TierMetrics,
    pools: Mapping[str, L3Pool],
    page_size: int,
) -> bool:
    """Whether loading ``hits`` pages from L3 is expected to beat recomputing them at
    ``storage.prefill_tokens_per_s`` (True when there is nothing to compare with)."""
    rate = storage.prefill_tokens_per_s
    if rate is None or hits <= 0:
        return True
    snap = metrics.snapshot()
    gbps = snap["gbps.storage.read"] or storage.assumed_storage_gbps
    if not gbps:
        return True  # nothing measured yet: try it, and measure
    nbytes = hits * sum(p.page_bytes for n, p in pools.items() if n != "mamba")
    if "mamba" in pools:
        nbytes += pools["mamba"].page_bytes  # one state, keyed by the last page
    load_s = nbytes / (gbps * 1e9)
    h2d = snap["gbps.host.read"]
    if h2d:
        load_s += nbytes / (h2d * 1e9)
    return load_s <= hits * page_size / rate


def graft_agreed(
    tree: UnifiedRadixTree, page_size: int, op: Prefetch, pages: int, swa: int, mamba: int
) -> PrefetchOutcome:
    """Graft the agreed ``pages`` (and, if every planned page and the whole window arrived, the
    SWA window and the Mamba state) of ``op`` onto ``tree``; returns how ``op`` ended.

    Sets ``op.loaded_tokens``, ``op.loaded_range`` and ``op.leftovers`` (its slots the tree did
    not take, to free once its IO thread is done: ``L3Tier._release``). Slots of agreed pages
    the tree already had are freed now: every rank has read them, so no IO writes there.
    """
    P = page_size
    end, present = None, 0
    if pages:
        n = pages * P
        end, present = tree.graft_host(
            op.anchor, op.tokens[:n], {"kv": op.kv_slots[:n]}, op.hashes[:pages], op.namespace
        )
        if end is not None:
            op.loaded_range = (op.anchor.end + present, op.anchor.end + n)
    # The agreed pages are read: free what the tree did not take now, the rest once IO stops.
    free_slots(tree.full.host_alloc, op.kv_slots[: present if end is not None else pages * P])
    leftovers = {"kv": op.kv_slots[pages * P :]}
    whole = end is not None and pages == op.planned_pages
    swa_ok = whole and swa == op.swa_pages and op.swa_pages > 0
    if op.swa_slots is not None:
        used = (
            tree.graft_swa_window(op.anchor, end, op.swa_slots, op.swa_pages)
            if swa_ok
            else torch.zeros(0, dtype=torch.bool)
        )
        if used.numel():
            free_slots(tree.swa.host_alloc, op.swa_slots[~used])
        else:
            leftovers["swa"] = op.swa_slots
    if op.mamba_slot is not None:
        ms = tree.mamba.slot
        if whole and mamba >= 1 and end.host_value[ms] is None and end.host_value[0] is not None:
            tree.set_host(end, ms, op.mamba_slot.clone())
        else:
            leftovers["mamba"] = op.mamba_slot
    op.leftovers = leftovers
    op.loaded_tokens = pages * P - present if end is not None else 0
    extras_ok = (op.swa_slots is None or swa_ok) and (
        op.mamba_slot is None or "mamba" not in leftovers
    )
    if op.checksum_misses:
        return PrefetchOutcome.CHECKSUM_MISS
    if pages == op.planned_pages and extras_ok:
        return PrefetchOutcome.COMPLETE
    if not op.io_done.is_set() and op.expired():
        return PrefetchOutcome.TIMED_OUT
    return PrefetchOutcome.PARTIAL


def alloc_host(tree: UnifiedRadixTree, comp, n: int) -> torch.Tensor | None:
    """``n`` host slots of tree component ``comp``, evicting its host leaves if short; None
    (evicting what it could) if even that leaves too few."""
    alloc = comp.host_alloc
    if alloc.available_size() < n:
        tree.evict_host(**{comp.kind: n - alloc.available_size()})
    return alloc.alloc(n) if alloc.available_size() >= n else None


def free_slots(alloc, slots: torch.Tensor) -> None:
    """Return ``slots`` to ``alloc`` (nothing to do for an empty set)."""
    if slots.numel():
        alloc.free(slots)
