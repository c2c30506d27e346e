"""Page allocators: hand out token slots of a pool in whole pages.

A pool of ``size`` token slots is cut into ``size // page_size`` pages. ``alloc`` returns the
token slots of whole pages (an int64 tensor of ``n_pages * page_size`` slots, each page a
page-aligned run ``[p * P, p * P + P)``); ``free`` takes such slots back. The allocator keeps one
bit per page, so freeing a page twice, or freeing a slot it never handed out, raises instead of
corrupting the free list.

The free list is a stack of page ids: the most recently freed pages are handed out first, which
keeps a warm working set small.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["PageAllocator", "SlotAllocator"]


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
            raise ValueError(f"size must be a positive multiple of page_size={page_size}, got {size}")
        self.size = size
        self.page_size = page_size
        self.name = name
        self.num_pages = size // page_size
        self._in_use = np.zeros(self.num_pages, dtype=bool)
        # Stack of free page ids; pages are popped from the end.
        self._free = np.arange(self.num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = self.num_pages
        self._page_offsets = torch.arange(page_size, dtype=torch.int64)

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
        pages = slots.detach().cpu().numpy() // self.page_size
        return torch.from_numpy(self._in_use[pages].copy())

    # -- alloc / free ------------------------------------------------------------------------

    def alloc_pages(self, n_pages: int) -> torch.Tensor | None:
        """Return ``n_pages`` page ids (int64), or None if fewer are free. Nothing is taken then."""
        if n_pages < 0:
            raise ValueError(f"n_pages must be >= 0, got {n_pages}")
        if n_pages > self._num_free:
            return None
        top = self._num_free
        pages = self._free[top - n_pages : top][::-1].copy()
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
        if np.unique(p).size != p.size:
            raise ValueError(f"{self.name}: free lists a page more than once (double free)")
        not_owned = ~self._in_use[p]
        if not_owned.any():
            raise ValueError(
                f"{self.name}: free of page {int(p[not_owned][0])} that is not allocated "
                "(double free, or never handed out)"
            )
        self._in_use[p] = False
        self._free[self._num_free : self._num_free + p.size] = p
        self._num_free += p.size

    def free(self, slots: torch.Tensor) -> None:
        """Give back token slots; they must cover whole pages (page-aligned runs)."""
        self.free_pages(self.slots_to_pages(slots))

    # -- helpers ---------------------------------------------------------------------------

    def pages_to_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """Page ids → token slots, ``[n] → [n * P]``."""
        if self.page_size == 1:
            return pages.to(torch.int64)
        return (pages.to(torch.int64)[:, None] * self.page_size + self._page_offsets).reshape(-1)

    def slots_to_pages(self, slots: torch.Tensor) -> torch.Tensor:
        """Token slots that form whole page-aligned runs → page ids. Raises otherwise."""
        s = slots.detach().to("cpu", torch.int64).reshape(-1)
        P = self.page_size
        if P == 1:
            return s
        if s.numel() % P:
            raise ValueError(
                f"{self.name}: {s.numel()} slots is not a whole number of pages of {P}"
            )
        runs = s.view(-1, P)
        first = runs[:, 0]
        if bool((first % P != 0).any()) or not torch.equal(runs - first[:, None], self._page_offsets.expand_as(runs)):
            raise ValueError(f"{self.name}: slots are not page-aligned runs of {P} tokens")
        return first // P

    def clear(self) -> None:
        """Return every page (used when a pool is reset)."""
        self._in_use[:] = False
        self._free = np.arange(self.num_pages - 1, -1, -1, dtype=np.int64)
        self._num_free = self.num_pages


class SlotAllocator(PageAllocator):
    """A page allocator with one slot per page: request-indexed pools such as Mamba state."""

    def __init__(self, size: int, name: str = "slots") -> None:
        super().__init__(size, 1, name)
