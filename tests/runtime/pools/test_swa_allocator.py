"""SWAPageAllocator: paired full/SWA pages with a translation table."""

from __future__ import annotations

import pytest
import torch

from kvtier.runtime import SWAPageAllocator


@pytest.mark.parametrize("P", [1, 4])
def test_alloc_maps_and_free_swa_resets_to_sentinel(P: int) -> None:
    a = SWAPageAllocator(16 * P, 8 * P, P)
    slots = a.alloc(4 * P)
    swa = a.translate(slots)
    assert (swa >= 0).all() and torch.unique(swa).numel() == 4 * P
    assert a.full_available_size() == 12 * P and a.swa_available_size() == 4 * P
    assert a.free_swa(slots[: 2 * P]) == 2 * P
    assert (a.translate(slots[: 2 * P]) == -1).all()
    assert a.free_swa(slots[: 2 * P]) == 0  # sentinel entries are never freed twice
    a.free(slots)
    assert a.full_available_size() == 16 * P and a.swa_available_size() == 8 * P
    assert a.num_mapped_pages() == 0


def test_full_and_swa_availability_are_separate() -> None:
    a = SWAPageAllocator(16, 4, 1)
    assert a.alloc(8) is None  # SWA short: nothing is taken
    assert a.full_available_size() == 16
    full_only = a.alloc_full(12)
    assert full_only is not None and (a.translate(full_only) == -1).all()
    assert a.available_size() == 4
    assert a.alloc_swa_for(full_only[:4])
    assert not a.alloc_swa_for(full_only[4:8])
    with pytest.raises(ValueError):
        a.alloc_swa_for(full_only[:4])


def test_double_free_raises_before_freeing_anything() -> None:
    a = SWAPageAllocator(8, 8, 1)
    s = a.alloc(4)
    a.free(s)
    with pytest.raises(ValueError):
        a.free(s)
    assert a.swa_available_size() == 8 and a.full_available_size() == 8
