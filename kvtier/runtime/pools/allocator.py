"""Page allocators: hand out token slots of a pool in whole pages.

A pool of ``size`` token slots is cut into ``size // page_size`` pages. ``alloc`` returns the
token slots of whole pages (an int64 tensor of ``n_pages * page_size`` slots, each page a
page-aligned run ``[p * P, p * P + P)``); ``free`` takes such slots back. The allocator keeps one
bit per page, so freeing a page twice, or freeing a slot it never handed out, raises instead of
corrupting the free list.

The free list is a stack of page ids: the most recently freed pages are handed out first, which
keeps a warm working set small. The pages of one ``alloc`` come in ascending order, so pages
freed together as a run come back as a run: a load into them pairs consecutive device pages with
consecutive host pages, which the copy engine moves as one descriptor instead of one per page
(a stack alone hands a freed run back reversed).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager

import numpy as np
import torch

__all__ = ["PageAllocator", "SWAPageAllocator", "SlotAllocator"]


@contextmanager
def _batched_free(alloc: PageAllocator | SWAPageAllocator) -> Iterator[None]:
    """While open, ``alloc.free`` collects its slots; they are freed in one call at the end."""
    if alloc._batch is not None:  # nested: the outer batch frees
        yield
        return
    alloc._batch = batch = []
    try:
        yield
    finally:
        alloc._batch = None
        if batch:
            alloc.free(batch[0] if len(batch) == 1 else torch.cat(batch))


class PageAllocator:
    """Allocates whole pages of ``page_size`` token slots out of ``size`` slots.

    Args:
        size: token slots in the pool; must be a positive multiple of ``page_size``.
        page_size: tokens per page, 1 to 256.
        name: used in error messages ("kv", "swa", "host kv", ...).
    """

    def __init__(self, size: int, page_size: int, name: str = "pool") -> None:
        if not 1 <= page_size <= 256:
            raise ValueError(f"page_size must be in [1, 256], got {page_size}")
        if size <= 0 or size % page_size:
            raise ValueError(
                f"size must be a positive multiple of page_size={page_size}, got {size}"
            )
        self.size = size
        self.page_size = page_size
        self.name = name
        self.num_pages = size // page_size
        self._in_use = np.zeros(self.num_pages, dtype=bool)
        # Stack of free page ids; pages are popped from the end.
        self._free = np.arange(self.num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = self.num_pages
        self._np_page_offsets = np.arange(page_size, dtype=np.int64)
        self._batch: list[torch.Tensor] | None = None

    # -- queries ---------------------------------------------------------------------------

    def available_size(self) -> int:
        """Free token slots."""
        return self._num_free * self.page_size

    def available_pages(self) -> int:
        return self._num_free

    def used_size(self) -> int:
        return (self.num_pages - self._num_free) * self.page_size

    def is_allocated(self, slots: torch.Tensor) -> torch.Tensor:
        """Bool tensor: whether each slot's page is currently handed out."""
        pages = self._check_pages(slots.detach().cpu().numpy() // self.page_size, "slots")
        return torch.from_numpy(self._in_use[pages].copy())

    # -- alloc / free ------------------------------------------------------------------------

    def alloc_pages(self, n_pages: int) -> torch.Tensor | None:
        """Return ``n_pages`` page ids (int64), or None if fewer are free. Nothing is taken then."""
        if n_pages < 0:
            raise ValueError(f"n_pages must be >= 0, got {n_pages}")
        if n_pages > self._num_free:
            return None
        top = self._num_free
        pages = np.sort(self._free[top - n_pages : top])  # ascending: runs stay runs
        self._num_free -= n_pages
        self._in_use[pages] = True
        return torch.from_numpy(pages)

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Return the slots of ``num_tokens / page_size`` whole pages, or None if they don't fit.

        ``num_tokens`` must be a multiple of ``page_size``.
        """
        if num_tokens % self.page_size:
            raise ValueError(
                f"{self.name}: num_tokens={num_tokens} is not a multiple of page_size={self.page_size}"
            )
        pages = self.alloc_pages(num_tokens // self.page_size)
        if pages is None:
            return None
        return self.pages_to_slots(pages)

    def free_pages(self, pages: torch.Tensor) -> None:
        """Give pages back. Raises ValueError on a page out of range, not handed out, or repeated."""
        p = pages.detach().cpu().numpy().astype(np.int64, copy=False).reshape(-1)
        if p.size == 0:
            return
        if p.min() < 0 or p.max() >= self.num_pages:
            bad = int(p[(p < 0) | (p >= self.num_pages)][0])
            raise ValueError(f"{self.name}: free of page {bad} outside [0, {self.num_pages})")
        not_owned = ~self._in_use[p]
        if not_owned.any():
            raise ValueError(
                f"{self.name}: free of page {int(p[not_owned][0])} that is not allocated "
                "(double free, or never handed out)"
            )
        # A repeated page flips its bit once: fewer bits flip than pages were listed (a count
        # over the bitmap is cheaper than sorting the batch).
        in_use = self.num_pages - self._num_free
        self._in_use[p] = False
        if in_use - int(np.count_nonzero(self._in_use)) != p.size:
            self._in_use[p] = True
            raise ValueError(f"{self.name}: free lists a page more than once (double free)")
        self._free[self._num_free : self._num_free + p.size] = p
        self._num_free += p.size

    def free(self, slots: torch.Tensor) -> None:
        """Give back token slots; they must cover whole pages (page-aligned runs).

        Inside ``batched_free`` the slots are freed when the batch closes."""
        if self._batch is not None:
            self._batch.append(slots)
            return
        self.free_pages(self.slots_to_pages(slots))

    def batched_free(self) -> AbstractContextManager[None]:
        """Collect every ``free`` made inside, and free them in one call at the end (with the
        same checks, over the whole batch): an eviction that drops many nodes pays the
        per-call cost once. Nothing may allocate from the pool inside."""
        return _batched_free(self)

    # -- helpers ---------------------------------------------------------------------------

    def pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """Page ids → token slots, ``[n] → [n * P]``."""
        if self.page_size == 1:
            return pages.to(torch.int64)
        # numpy: half the CPU of the same torch ops (a load-back's books, on the critical path
        # before the forward pass)
        p = pages.numpy().astype(np.int64)
        return torch.from_numpy((p[:, None] * self.page_size + self._np_page_offsets).reshape(-1))

    def slots_to_pages(self, slots: torch.Tensor) -> torch.Tensor:
        """Token slots that form whole page-aligned runs → page ids. Raises otherwise."""
        s = slots.detach().to("cpu", torch.int64).reshape(-1).numpy()
        P = self.page_size
        if P == 1:
            return torch.from_numpy(self._check_pages(s, "slots"))
        if s.size % P:
            raise ValueError(f"{self.name}: {s.size} slots is not a whole number of pages of {P}")
        # numpy, not torch: an eviction frees thousands of slots in one call, and each torch op
        # here cost more in dispatch than in work.
        runs = s.reshape(-1, P)
        first = runs[:, 0]
        if (first % P).any() or ((runs - first[:, None]) != self._np_page_offsets).any():
            raise ValueError(f"{self.name}: slots are not page-aligned runs of {P} tokens")
        return torch.from_numpy(self._check_pages(first // P, "slots"))

    def _check_pages(self, pages: np.ndarray, arg: str) -> np.ndarray:
        """Page ids in range, before any array is indexed with them (negative ids would wrap)."""
        if pages.size and (pages.min() < 0 or pages.max() >= self.num_pages):
            bad = int(pages[(pages < 0) | (pages >= self.num_pages)][0])
            raise ValueError(f"{self.name}: {arg} reach page {bad}, outside [0, {self.num_pages})")
        return pages

    def clear(self) -> None:
        """Return every page (used when a pool is reset)."""
        self._in_use[:] = False
        self._free = np.arange(self.num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = self.num_pages


class SlotAllocator(PageAllocator):
    """A page allocator with one slot per page: request-indexed pools such as Mamba state."""

    def __init__(self, size: int, name: str = "slots") -> None:
        super().__init__(size, 1, name)


class SWAPageAllocator:
    """Paired full-attention and sliding-window pools with a full→SWA page translation table.

    Hybrid SWA models keep full-attention KV for every token and SWA KV only for tokens inside
    the window. Both pools are paged with the same ``page_size``; every full page maps to at most
    one SWA page (``-1`` = no SWA data, the sentinel), so the SWA slots of a run of full slots are
    ``swa_page * P + offset``.

    Invariants:
        - a mapped SWA page is allocated in ``swa`` and mapped from exactly one full page;
        - every allocated SWA page is mapped (``num_mapped_pages() == swa.used_size() / P``);
        - a mapped full page is allocated in ``full``.

    ``alloc`` hands out full slots that carry SWA slots (tokens inside the window); ``alloc_full``
    hands out full slots without SWA (tokens the window has already passed); ``free`` returns full
    slots and whatever SWA slots they map; ``free_swa`` returns only the SWA slots of tokens that
    slid out of the window and resets their table entries to the sentinel.

    Args:
        full_size: full-attention token slots (multiple of ``page_size``).
        swa_size: SWA token slots (multiple of ``page_size``).
        page_size: tokens per page, shared by both pools.
        name: used in error messages; the SWA pool is named ``f"{name} swa"``.
    """

    def __init__(self, full_size: int, swa_size: int, page_size: int, name: str = "kv") -> None:
        self.full = PageAllocator(full_size, page_size, name)
        self.swa = PageAllocator(swa_size, page_size, f"{name} swa")
        self.size = full_size
        self.page_size = page_size
        self.name = name
        self._page_map = np.full(self.full.num_pages, -1, dtype=np.int64)
        self._batch: list[torch.Tensor] | None = None

    # -- queries ---------------------------------------------------------------------------

    def full_available_size(self) -> int:
        """Free full-attention token slots."""
        return self.full.available_size()

    def swa_available_size(self) -> int:
        """Free SWA token slots."""
        return self.swa.available_size()

    def available_size(self) -> int:
        """Tokens that can be allocated with SWA data: ``min(full, swa)``."""
        return min(self.full.available_size(), self.swa.available_size())

    def used_size(self) -> int:
        """Full-attention token slots handed out."""
        return self.full.used_size()

    def num_mapped_pages(self) -> int:
        """Full pages that currently map to an SWA page."""
        return int((self._page_map >= 0).sum())

    def translate(self, full_slots: torch.Tensor) -> torch.Tensor:
        """Full slots → SWA slots (``-1`` where a slot has no SWA data), same shape."""
        s = full_slots.detach().cpu().numpy().astype(np.int64, copy=False)
        P = self.page_size
        swa_pages = self._page_map[self.full._check_pages(s // P, "full_slots")]
        out = np.where(swa_pages >= 0, swa_pages * P + s % P, -1)
        return torch.from_numpy(out)

    # -- alloc / free ------------------------------------------------------------------------

    def alloc(self, num_tokens: int) -> torch.Tensor | None:
        """Full slots for ``num_tokens`` tokens, each page mapped to a fresh SWA page; or None."""
        if num_tokens % self.page_size:
            raise ValueError(f"{self.name}: num_tokens={num_tokens} is not page-aligned")
        n = num_tokens // self.page_size
        if n > self.full.available_pages() or n > self.swa.available_pages():
            return None
        full_pages = self.full.alloc_pages(n)
        swa_pages = self.swa.alloc_pages(n)
        assert full_pages is not None and swa_pages is not None
        self._page_map[full_pages.numpy()] = swa_pages.numpy()
        return self.full.pages_to_slots(full_pages)

    def alloc_full(self, num_tokens: int) -> torch.Tensor | None:
        """Full slots without SWA data (table entries stay at the sentinel); or None."""
        return self.full.alloc(num_tokens)

    def alloc_swa_for(self, full_slots: torch.Tensor) -> bool:
        """Give SWA pages to allocated full slots that have none. False (nothing taken) if short."""
        pages = self.full.slots_to_pages(full_slots).numpy()
        if self._page_map[pages].max(initial=-1) >= 0:
            raise ValueError(f"{self.name}: alloc_swa_for on full slots that already map SWA")
        swa_pages = self.swa.alloc_pages(pages.size)
        if swa_pages is None:
            return False
        self._page_map[pages] = swa_pages.numpy()
        return True

    def free_swa(self, full_slots: torch.Tensor) -> int:
        """Free the SWA slots mapped by ``full_slots``; returns SWA tokens freed."""
        pages = self.full.slots_to_pages(full_slots).numpy()
        swa_pages = self._page_map[pages]
        mapped = swa_pages >= 0
        if not mapped.any():
            return 0
        self.swa.free_pages(torch.from_numpy(swa_pages[mapped]))
        self._page_map[pages[mapped]] = -1
        return int(mapped.sum()) * self.page_size

    def batched_free(self) -> AbstractContextManager[None]:
        """``PageAllocator.batched_free`` for the full slots (and the SWA slots they map)."""
        return _batched_free(self)

    def free(self, full_slots: torch.Tensor) -> None:
        """Free full slots and any SWA slots they map. Raises before freeing anything on a double
        free. Inside ``batched_free`` they are freed when the batch closes (their SWA slots are
        still mapped until then)."""
        if self._batch is not None:
            self._batch.append(full_slots)
            return
        pages = self.full.slots_to_pages(full_slots).numpy()
        if pages.size and not self.full._in_use[pages].all():
            self.full.free_pages(torch.from_numpy(pages))  # raises with the offending page
        self.free_swa(full_slots)
        self.full.free_pages(torch.from_numpy(pages))

    def clear(self) -> None:
        """Return every page of both pools and reset the table."""
        self.full.clear()
        self.swa.clear()
        self._page_map[:] = -1
