"""How the L3 tier sees the host pools: page objects, key namespaces and reserved host slots.

A page object of a pool is what one L3 key stores:

    pool    host pool       page object                          read/written through
    kv      HostPool        one page, every layer, K then V      page_views (page_first*), or
                            (MLA: the latent)                    pack/unpack via staging
    indexer HostPool        one KV page's indexer keys and       same; its host page ids are
                            scales, every full layer             the KV pool's (slot // P)
    swa     HostPool        same as kv, for the SWA layers       same as kv
    mamba   MambaHostPool   one state slot (flat)                slot_views

Prefetches read into host slots before the tree owns them. Those slots are *reserved*: taken from
the tree's host allocator but not yet tree-owned, so the tree's integrity check, which compares an
allocator's use with what the tree owns, is told about them through ``used_size`` (reserved slots
are left out) and the L3 tier recounts them itself.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

import torch

from kvtier.runtime.allocator import PageAllocator, SlotAllocator
from kvtier.runtime.config import CacheConfig
from kvtier.runtime.host_pool import HostPool
from kvtier.runtime.mamba_pool import MambaHostPool
from kvtier.storage import Namespace

__all__ = ["L3Pool", "ReservingPageAllocator", "ReservingSlotAllocator", "namespace_for"]


class _Reserving:
    """Slots handed to in-flight L3 reads: allocated, but not (yet) owned by the tree."""

    reserved: int

    def reserve(self, n: int) -> torch.Tensor | None:
        slots = self.alloc(n)  # type: ignore[attr-defined]
        if slots is not None:
            self.reserved += slots.numel()
        return slots

    def unreserve(self, slots: torch.Tensor) -> None:
        """Give reserved slots back to the pool."""
        if slots.numel() > self.reserved:
            raise ValueError(f"unreserve of {slots.numel()} slots, only {self.reserved} reserved")
        self.free(slots)  # type: ignore[attr-defined]
        self.reserved -= slots.numel()

    def adopt(self, slots: torch.Tensor) -> None:
        """Reserved slots now belong to the tree (they stay allocated)."""
        if slots.numel() > self.reserved:
            raise ValueError(f"adopt of {slots.numel()} slots, only {self.reserved} reserved")
        self.reserved -= slots.numel()

    def used_size(self) -> int:
        """Slots in use by the tree (reserved slots are the L3 tier's)."""
        return super().used_size() - self.reserved  # type: ignore[misc]

    def allocated_size(self) -> int:
        return super().used_size()  # type: ignore[misc]


class ReservingPageAllocator(_Reserving, PageAllocator):
    def __init__(self, size: int, page_size: int, name: str = "pool") -> None:
        super().__init__(size, page_size, name)
        self.reserved = 0


class ReservingSlotAllocator(_Reserving, SlotAllocator):
    def __init__(self, size: int, name: str = "slots") -> None:
        super().__init__(size, name)
        self.reserved = 0


def reserving(alloc: PageAllocator) -> PageAllocator:
    """A fresh reserving allocator of ``alloc``'s size (swap it in before any allocation)."""
    if alloc.used_size():
        raise ValueError(f"{alloc.name}: swap the allocator before it hands out slots")
    if isinstance(alloc, SlotAllocator):
        return ReservingSlotAllocator(alloc.size, alloc.name)
    return ReservingPageAllocator(alloc.size, alloc.page_size, alloc.name)


def namespace_for(cfg: CacheConfig, request_namespace: Hashable, tp_size: int) -> Namespace:
    """The L3 namespace of a request: model, dtype, page size, layout, salts and TP shape.

    The deployment salt and the request's namespace (LoRA id, cache salt) are joined
    length-prefixed, and non-string namespaces by ``repr`` with a type tag, so distinct pairs
    never give the same key.
    """
    st = cfg.storage
    assert st is not None
    ns = request_namespace
    tag = "" if ns is None else (f"s{ns}" if isinstance(ns, str) else f"r{ns!r}")
    key = f"{len(st.namespace_key)}:{st.namespace_key}{tag}"
    return Namespace(
        model_id=cfg.model_id,
        dtype=str(cfg.dtype).removeprefix("torch."),
        page_size=cfg.page_size,
        layout=cfg.host_layout,
        namespace_key=key,
        tp_size=None if cfg.rank_replicated else tp_size,
    )


class L3Pool:
    """One host pool as L3 page objects: page buffers to read into or write from.

    Args:
        name: the pool's L3 name ("kv", "indexer", "swa", "mamba").
        host: the host pool.
        page_size: tokens per page (token-slot pools, and the indexer, whose pages are named by
            the KV pool's token slots); Mamba slots are pages of their own.
        batch_pages: most pages per call (staging rows for layer_first pools).
    """

    def __init__(self, name: str, host: HostPool | MambaHostPool, page_size: int, batch_pages: int):
        self.name = name
        self.host = host
        self.is_mamba = isinstance(host, MambaHostPool)
        self.P = 1 if self.is_mamba else page_size
        self.staged = not self.is_mamba and not host.layout.page_contiguous
        self.page_bytes = host.slot_bytes if self.is_mamba else host.page_bytes
        self.batch_pages = batch_pages
        self._staging = threading.local()
        self._all_staging: list[torch.Tensor] = []
        self._mutex = threading.Lock()
        self.register: list = []  # callbacks run on every new staging buffer (backend registration)

    def region(self) -> torch.Tensor:
        """The pool's memory as one flat uint8 tensor (for backend registration)."""
        return self.host.tensor.view(-1).view(torch.uint8)

    def pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Host page ids of page-aligned token slots (slot ids for Mamba)."""
        return slots if self.is_mamba else slots.view(-1, self.P)[:, 0] // self.P

    def staging(self) -> torch.Tensor:
        """This thread's staging buffer (layer_first pools)."""
        buf = getattr(self._staging, "buf", None)
        if buf is None:
            buf = self.host.new_staging(self.batch_pages)
            for fn in self.register:
                fn(buf)
            with self._mutex:
                self._all_staging.append(buf)
            self._staging.buf = buf
        return buf

    def write_views(self, pages: torch.Tensor) -> list:
        """Page buffers holding ``pages``' objects (packed into staging if needed)."""
        if self.is_mamba:
            return self.host.slot_views(pages)
        if not self.staged:
            return self.host.page_views(pages)
        rows = self.host.pack(pages, self.staging())
        return list(rows.unbind(0))

    def read_views(self, pages: torch.Tensor) -> list:
        """Page buffers to read ``pages``' objects into; call ``finish_read`` after."""
        if self.is_mamba:
            return self.host.slot_views(pages)
        if not self.staged:
            return self.host.page_views(pages)
        return list(self.staging()[: pages.numel()].unbind(0))

    def finish_read(self, pages: torch.Tensor, n_ok: int) -> None:
        """Move the first ``n_ok`` staged pages into the host pool (layer_first)."""
        if self.staged and n_ok:
            self.host.unpack(pages[:n_ok], self.staging()[:n_ok])
