"""Page allocator: whole pages out, whole pages back, loud on double free or foreign slots."""

from __future__ import annotations

import pytest
import torch

from kvtier.runtime.pools.allocator import PageAllocator, SlotAllocator


@pytest.mark.parametrize("P", [1, 16, 256])
def test_alloc_free_cycle(P):
    a = PageAllocator(8 * P, P)
    assert a.available_size() == 8 * P
    x = a.alloc(3 * P)
    assert x.dtype == torch.int64 and x.numel() == 3 * P
    runs = x.view(-1, P)
    assert bool((runs[:, 0] % P == 0).all())
    assert torch.equal(runs - runs[:, :1], torch.arange(P).expand_as(runs))
    assert a.available_size() == 5 * P
    y = a.alloc(5 * P)
    assert a.alloc(P) is None, "an exhausted allocator returns None"
    assert a.available_size() == 0
    assert torch.unique(torch.cat([x, y])).numel() == 8 * P
    a.free(x)
    assert a.available_size() == 3 * P
    z = a.alloc(3 * P)
    assert set(z.tolist()) == set(x.tolist()), "freed pages are reused"
    a.free(torch.cat([y, z]))
    assert a.available_size() == 8 * P


def test_double_free_and_foreign_slots():
    a = PageAllocator(64, 16, name="kv")
    x = a.alloc(32)
    a.free(x[:16])
    with pytest.raises(ValueError, match="kv: free of page .* not allocated"):
        a.free(x[:16])
    with pytest.raises(ValueError, match="double free"):
        a.free(torch.cat([x[16:], x[16:]]))
    with pytest.raises(ValueError, match="outside"):
        a.free(torch.arange(64, 80))
    with pytest.raises(ValueError, match="not page-aligned"):
        a.free(x[16:] + 1)
    with pytest.raises(ValueError, match="whole number of pages"):
        a.free(x[16:24])
    with pytest.raises(ValueError, match="not a multiple of page_size"):
        a.alloc(10)
    assert a.available_size() == 48, "failed frees changed nothing"
    a.free(x[16:])
    assert a.available_size() == 64


def test_slot_allocator_and_bad_config():
    s = SlotAllocator(4)
    got = s.alloc(3)
    assert sorted(got.tolist()) == [0, 1, 2]
    s.free(got[:1])
    with pytest.raises(ValueError):
        s.free(got[:1])
    with pytest.raises(ValueError, match="page_size must be in"):
        PageAllocator(512, 512)
    with pytest.raises(ValueError, match="positive multiple"):
        PageAllocator(20, 16)


def test_negative_or_large_slots_never_touch_the_books():
    """Negative page ids would wrap in numpy indexing: they are refused before any update."""
    from kvtier.runtime.pools.allocator import SWAPageAllocator

    a = SWAPageAllocator(64, 64, 16)
    x = a.alloc(64)
    with pytest.raises(ValueError, match="page -1, outside"):
        a.free(torch.arange(-16, 0))
    with pytest.raises(ValueError, match="page 4, outside"):
        a.free_swa(torch.arange(64, 80))
    with pytest.raises(ValueError, match="full_slots reach page -1"):
        a.translate(torch.tensor([-1]))
    assert a.num_mapped_pages() == 4 and a.swa.used_size() == 64
    assert bool((a.translate(x) >= 0).all())
    with pytest.raises(ValueError, match="outside"):
        a.full.is_allocated(torch.tensor([-1]))


@pytest.mark.parametrize("order", ["ascending", "descending", "shuffled"])
def test_a_freed_run_comes_back_as_an_ascending_run(order: str) -> None:
    """Pages freed together (in any order) are handed back ascending, so a load into them pairs
    consecutive device pages with consecutive host pages (one copy-engine descriptor per run,
    not one per page). The most recently freed pages still go out first."""
    a = PageAllocator(64 * 16, 16)
    held = a.alloc_pages(40)
    assert held.tolist() == list(range(40))
    run = held[8:32]
    if order == "descending":
        run = run.flip(0)
    elif order == "shuffled":
        run = run[torch.randperm(run.numel(), generator=torch.Generator().manual_seed(3))]
    a.free_pages(run)
    again = a.alloc_pages(24)
    assert again.tolist() == list(range(8, 32))
    slots = a.pages_to_slots(again)
    assert torch.equal(slots, torch.arange(8 * 16, 32 * 16))
    # LIFO across calls: the pages freed last are the ones taken (ascending among themselves).
    a.free_pages(torch.tensor([35, 33]))
    a.free_pages(torch.tensor([2, 1]))
    assert a.alloc_pages(2).tolist() == [1, 2]
    assert a.alloc_pages(2).tolist() == [33, 35]
