"""Device and host pools: shapes per layout, sizing, page byte ranges, round trips through pools."""

from __future__ import annotations

import pytest
import torch

from kvtier.kernels.reference import host_byte_view
from kvtier.runtime.pools.allocator import PageAllocator
from kvtier.runtime.pools.device import MHADevicePool, MLADevicePool
from kvtier.runtime.pools.host import HostPool


@pytest.mark.parametrize(
    "layout,mha_shape,mla_shape",
    [
        ("layer_first", (2, 3, 32, 2, 8), (3, 32, 1, 16)),
        ("page_first", (2, 32, 3, 2, 8), (32, 3, 1, 16)),
        ("page_first_direct", (2, 8, 3, 4, 2, 8), (8, 3, 4, 1, 16)),
    ],
)
def test_host_shapes(layout, mha_shape, mla_shape, device):
    mha = MHADevicePool(3, 16, 2, 8, device=device, page_size=4)
    mla = MLADevicePool(3, 16, 16, device=device, page_size=4)
    assert tuple(HostPool(mha, layout, ratio=2.0).tensor.shape) == mha_shape
    assert tuple(HostPool(mla, layout, size=32).tensor.shape) == mla_shape
    h = HostPool(mha, layout, size_bytes=mha.bytes_per_token * 33)
    assert h.size == 32, "sizes round down to whole pages"
    assert h.tensor.is_pinned() == torch.cuda.is_available()


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_page_ranges_hold_the_page(layout, device):
    """The (offset, nbytes) ranges of a page, read from the raw tensor, are exactly its bytes."""
    P, L = 4, 3
    pool = MHADevicePool(L, 16, 2, 8, device=device, page_size=P)
    host = HostPool(pool, layout, size=32)
    host.tensor.view(torch.uint8).view(-1).copy_(
        torch.randint(0, 256, (host.nbytes,), dtype=torch.uint8)
    )
    raw = host.tensor.view(-1).view(torch.uint8)
    view = host_byte_view(host.buffer)
    for page in (0, 5, 7):
        ranges = host.page_ranges(torch.tensor([page]))[0]
        assert len(ranges) == (2 if layout != "layer_first" else 2 * L)
        got = torch.cat([raw[o : o + n] for o, n in ranges])
        # the page's bytes in (buffer, [layer,] token) order
        if layout == "layer_first":
            want = view[:, page].permute(0, 2, 1, 3).reshape(-1)
        elif layout == "page_first":
            want = view[:, page].reshape(-1)
        else:
            want = view[:, page].permute(0, 2, 1, 3).reshape(-1)
        assert torch.equal(got, want), (layout, page)
        assert sum(n for _, n in ranges) == host.buffer.page_bytes


@pytest.mark.parametrize("form", ["stacked", "wrapped"])
def test_pool_round_trip(form, device):
    P, L = 16, 2
    if form == "stacked":
        pool = MHADevicePool(L, 64, 2, 72, dtype=torch.float16, device=device, page_size=P)
    else:
        k = [torch.empty(64, 2, 72, dtype=torch.float16, device=device) for _ in range(L)]
        v = [torch.empty(64, 2, 72, dtype=torch.float16, device=device) for _ in range(L)]
        pool = MHADevicePool.wrap(k, v, page_size=P)
        assert pool.k(1) is k[1], "wrap keeps the caller's tensors"
    for b in pool.buffers.layers:
        for t in b:
            t.copy_(torch.randn_like(t, dtype=torch.float32).to(t.dtype))
    host = HostPool(pool, "page_first", ratio=1.0)
    d = PageAllocator(pool.size, pool.page_size).alloc(32).to(device)
    h = PageAllocator(host.size, host.page_size).alloc(32).to(device)
    want = [pool.k(l)[d].clone() for l in range(L)] + [pool.v(l)[d].clone() for l in range(L)]
    host.backup(d, h)
    for l in range(L):
        pool.k(l)[d] = 0
        pool.v(l)[d] = 0
    for l in range(L):
        host.load(h, d, layer=l)
    got = [pool.k(l)[d] for l in range(L)] + [pool.v(l)[d] for l in range(L)]
    for g, w in zip(got, want):
        assert torch.equal(g.view(torch.int16), w.view(torch.int16))
