"""``page_format.PageViews``: byte views of a batch's pages sliced from one view per storage.

Each view must alias exactly its tensor's bytes (writes through it land in the tensor and nowhere
else), whatever the tensor's offset in its storage, the storage's dtype or the number of parts.
"""

from __future__ import annotations

import threading

import torch

from kvtier.storage.page_format import PageViews, buffer_of, buffers_of


def batch() -> tuple[torch.Tensor, list[tuple[torch.Tensor, ...]]]:
    pool = torch.zeros(4096, dtype=torch.uint8)
    wide = torch.zeros(64, dtype=torch.int64)  # a storage of another dtype, viewed as bytes
    pages = [
        (pool[0:100],),
        (pool[1000:1300], pool[2000:2050]),  # a page_first page: K range, V range
        (pool[100:1000][7:19],),  # a view of a view
        (wide.view(torch.uint8)[8:72],),
        (torch.zeros(33, dtype=torch.uint8),),  # a storage of its own
        (pool[5:5],),  # an empty part
    ]
    return pool, pages


def test_views_alias_exactly_their_tensors() -> None:
    pool, pages = batch()
    views = PageViews(pages)
    assert views.lengths() == [100, 350, 12, 64, 33, 0]
    for i, parts in enumerate(pages):
        got = views[i]
        assert [v.nbytes for v in got] == [p.numel() for p in parts], f"page {i}"
        for j, (v, p) in enumerate(zip(got, parts)):
            assert bytes(v) == bytes(buffer_of(p)), f"page {i} part {j}"
            if v.nbytes:
                before = pool.clone()
                v[0] = (p[0].item() + 1) % 256
                v[-1] = 0xAB
                assert p[0].item() == v[0] and p[-1].item() == 0xAB, f"page {i} part {j}"
                if p.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr():
                    changed = (pool != before).nonzero().flatten().tolist()
                    start = p.storage_offset()
                    assert set(changed) <= {start, start + p.numel() - 1}, (i, j, changed)


def test_buffers_of_matches_buffer_of() -> None:
    _, pages = batch()
    views, lengths = buffers_of(pages)
    assert lengths == [sum(p.numel() for p in parts) for parts in pages]
    for got, parts in zip(views, pages):
        assert [bytes(v) for v in got] == [bytes(buffer_of(p)) for p in parts]


def test_views_made_from_several_threads() -> None:
    threads = 2
    pool = torch.arange(1 << 16, dtype=torch.int32).view(torch.uint8)
    pages = [(pool[i * 256 : (i + 1) * 256],) for i in range(1024)]
    views = PageViews(pages)
    out: list[list[memoryview] | None] = [None] * len(pages)

    def work(k: int) -> None:
        for i in range(k, len(pages), threads):
            out[i] = views[i]

    ts = [threading.Thread(target=work, args=(k,)) for k in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for i, got in enumerate(out):
        assert got is not None and bytes(got[0]) == bytes(pages[i][0].numpy()), f"page {i}"
