"""Hybrid pages: Mamba slots, DSA indexer pages, SWA pages, and flat L3 objects for every pool.

Flat objects are compared with a reference built by plain slicing and ``torch.cat``; round trips
D→H→flat→H→D and D→flat→D must return identical bytes, with poisoned destinations.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.runtime.pools.allocator import PageAllocator, SWAPageAllocator
from kvtier.runtime.pools.device import MHADevicePool, MLADevicePool
from kvtier.runtime.pools.host import HostPool
from kvtier.runtime.pools.indexer import IndexerDevicePool, kv_slots_to_pages
from kvtier.runtime.pools.mamba import MambaDevicePool, MambaHostPool, MambaStateSpec

LAYOUTS = ["layer_first", "page_first", "page_first_direct"]


def fill_random(t: torch.Tensor, gen: torch.Generator) -> None:
    raw = torch.randint(0, 256, (t.numel() * t.element_size(),), dtype=torch.uint8, generator=gen)
    t.view(-1).view(torch.uint8).copy_(raw.to(t.device))


def poison(t: torch.Tensor) -> None:
    t.view(-1).view(torch.uint8).fill_(0xA5)


def dev_idx(x, device):
    return torch.as_tensor(x, dtype=torch.int64).to(device)


# -- reference flat objects, by plain slicing --------------------------------------------------


def ref_kv_page(pool, page: int, token_major: bool) -> torch.Tensor:
    P, parts = pool.page_size, []
    for buf in pool.buffers.layers:
        rows = [t[page * P : page * P + P].reshape(P, -1).view(torch.uint8).cpu() for t in buf]
        if token_major:
            parts += [rows[l][t] for t in range(P) for l in range(len(rows))]
        else:
            parts += [r.reshape(-1) for r in rows]
    return torch.cat(parts)


def ref_mamba_slot(pool: MambaDevicePool, slot: int) -> torch.Tensor:
    return torch.cat(
        [
            t[l, slot].reshape(-1).view(torch.uint8).cpu()
            for t in pool.tensors
            for l in range(t.shape[0])
        ]
    )


# -- KV / MLA / SWA pages ------------------------------------------------------------------------


def make_kv(kind, P, device, gen):
    if kind == "mha":
        pool = MHADevicePool(3, 6 * P, 2, 8, dtype=torch.bfloat16, device=device, page_size=P)
    else:
        pool = MLADevicePool(2, 6 * P, 72, dtype=torch.float16, device=device, page_size=P)
    for buf in pool.buffers.layers:
        for t in buf:
            fill_random(t, gen)
    return pool


@pytest.mark.parametrize("P", [1, 16, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_kv_flat_round_trips(kind, layout, P, device):
    gen = torch.Generator().manual_seed(P * 7 + len(layout))
    pool = make_kv(kind, P, device, gen)
    host = HostPool(pool, layout, size=5 * P)
    poison(host.tensor)
    dev_pages, host_pages = [4, 1, 3], [2, 0, 4]

    def slots(pages):
        return torch.cat([torch.arange(p * P, p * P + P) for p in pages])

    host.backup(dev_idx(slots(dev_pages), device), dev_idx(slots(host_pages), device))
    token_major = layout == "page_first"
    want = [ref_kv_page(pool, p, token_major) for p in dev_pages]

    # H → flat: zero-copy views where the layout allows, a packing kernel otherwise
    staging = host.new_staging(4)
    poison(staging)
    if layout == "layer_first":
        flat = host.pack(dev_idx(host_pages, device), staging)
        objs = [flat[i] for i in range(len(host_pages))]
        with pytest.raises(ValueError, match="not contiguous"):
            host.page_views(torch.tensor(host_pages))
    else:
        objs = [torch.cat(v) for v in host.page_views(torch.tensor(host_pages))]
    for i, (o, w) in enumerate(zip(objs, want, strict=True)):
        assert torch.equal(o.cpu(), w), f"flat object {i} differs from the sliced reference"

    # flat → H (another host pool, other pages) → D (other device pages), layer by layer
    host2 = HostPool(pool, layout, size=5 * P)
    poison(host2.tensor)
    pages2 = [3, 4, 1]
    if layout == "layer_first":
        host2.unpack(dev_idx(pages2, device), flat)
    else:
        for view_list, o in zip(host2.page_views(torch.tensor(pages2)), objs, strict=True):
            off = 0  # the views are the pool's storage: write through them
            for v in view_list:
                v.copy_(o[off : off + v.numel()])
                off += v.numel()
    out_pages = [0, 2, 5]
    for l in range(pool.num_layers):
        host2.load(dev_idx(slots(pages2), device), dev_idx(slots(out_pages), device), layer=l)
    for p_in, p_out in zip(dev_pages, out_pages, strict=True):
        assert torch.equal(ref_kv_page(pool, p_out, False), ref_kv_page(pool, p_in, False))

    # D → flat → D, fused (pinned staging), and device-side (flat buffer on the device)
    for where in ("host", "device"):
        buf = staging if where == "host" else torch.empty_like(staging, device=device)
        poison(buf)
        host.device_to_flat(dev_idx(dev_pages, device), buf)
        for i, w in enumerate(want):
            assert torch.equal(buf[i].cpu(), w), f"fused D->flat ({where}) page {i}"
        assert bool((buf[len(want) :].cpu() == 0xA5).all()), "rows past the batch were written"
        back = [5, 0, 2]
        for b in pool.buffers.layers:
            for t in b:
                t[torch.cat([torch.arange(p * P, p * P + P) for p in back]).to(device)] = 0
        host.flat_to_device(buf, dev_idx(back, device))
        for p_in, p_out in zip(dev_pages, back, strict=True):
            assert torch.equal(ref_kv_page(pool, p_out, False), ref_kv_page(pool, p_in, False))


def test_staging_too_small_and_pages_outside(device):
    gen = torch.Generator().manual_seed(3)
    pool = make_kv("mha", 4, device, gen)
    host = HostPool(pool, "layer_first", size=16)
    with pytest.raises(ValueError, match="staging holds 2 pages, 3 requested"):
        host.pack(dev_idx([0, 1, 2], device), host.new_staging(2))
    with pytest.raises(ValueError, match="page id 4 outside"):
        host.pack(dev_idx([4], device), host.new_staging(2))
    with pytest.raises(ValueError, match=r"staging: expected \[n_pages, \d+\] bytes"):
        host.pack(dev_idx([0], device), torch.empty(2, 7, dtype=torch.uint8))
    with pytest.raises(ValueError, match="pages: page 9 outside"):
        HostPool(pool, "page_first", size=16).page_views(torch.tensor([9]))


def test_swa_pool_translation_and_transfer(device):
    """SWA layers have their own pool and index space; the KV kernels move them by SWA slots."""
    P, W = 4, 8
    alloc = SWAPageAllocator(full_size=64, swa_size=16, page_size=P)
    swa = MHADevicePool(2, 16, 2, 8, device=device, page_size=P)
    gen = torch.Generator().manual_seed(5)
    for b in swa.buffers.layers:
        for t in b:
            fill_random(t, gen)
    full = alloc.alloc(2 * W)
    swa_slots = alloc.translate(full)
    assert bool((swa_slots >= 0).all()) and alloc.swa_available_size() == 16 - 2 * W
    host = HostPool(swa, "page_first_direct", size=16)
    poison(host.tensor)
    hs = PageAllocator(host.size, host.page_size).alloc(2 * W)
    host.backup(swa_slots.to(device), hs.to(device))
    objs = [torch.cat(v) for v in host.page_views(hs.view(-1, P)[:, 0] // P)]
    for o, p in zip(objs, (swa_slots.view(-1, P)[:, 0] // P).tolist(), strict=True):
        assert torch.equal(o, ref_kv_page(swa, p, False))
    # tokens slide out of the window: their SWA slots are freed and translate to the sentinel
    alloc.free_swa(full[:W])
    assert bool((alloc.translate(full[:W]) == -1).all())
    assert alloc.swa_available_size() == 16 - W and alloc.full_available_size() == 64 - 2 * W


# -- Mamba slots ----------------------------------------------------------------------------------


SPEC = MambaStateSpec(temporal_shape=(2, 4, 8), conv_shapes=((12, 3), (5, 3)))


def make_mamba(device, gen, size=6):
    pool = MambaDevicePool(3, size, SPEC, device=device)
    for t in pool.tensors:
        fill_random(t, gen)
    return pool


def test_mamba_slot_spans_name_the_slot_views_bytes_and_refuse_bad_slots(tmp_path, device):
    """``slot_spans`` gives the bytes ``slot_views`` does (the tier's L3 form for Mamba pages),
    round trips through the file store, and refuses slots outside the pool or of a float dtype,
    naming the argument."""
    from kvtier.storage import PageSpans, PoolTransfer, create_backend

    gen = torch.Generator().manual_seed(12)
    pool = make_mamba(device, gen)
    host = MambaHostPool(pool, size=6)
    fill_random(host.tensor, gen)
    slots = torch.tensor([4, 0, 5])
    spans = host.slot_spans(slots)
    assert isinstance(spans, PageSpans) and len(spans) == 3
    for i, view in enumerate(host.slot_views(slots)):
        (part,) = spans.page(i)
        assert part.data_ptr() == view.data_ptr() and torch.equal(part, view)
    store = create_backend("file", root=tmp_path / "l3")
    keys = [f"{i:064x}" for i in range(3)]
    assert store.set([PoolTransfer("mamba", keys, spans)]).all_ok
    want = host.tensor[[4, 0, 5]].clone()
    host.tensor.fill_(0xA5)
    assert store.get([PoolTransfer("mamba", keys, host.slot_spans(torch.tensor([1, 2, 3])))]).all_ok
    assert torch.equal(host.tensor[[1, 2, 3]], want)
    assert bool((host.tensor[[0, 4, 5]] == 0xA5).all()), "untouched host slots changed"
    store.close()
    for bad in (torch.tensor([0, 6]), torch.tensor([-1])):
        with pytest.raises(ValueError, match="slots: slot"):
            host.slot_spans(bad)
    with pytest.raises(TypeError, match="slots"):
        host.slot_spans(torch.tensor([1.0]))


def test_mamba_flat_slot_format_and_round_trips(device):
    gen = torch.Generator().manual_seed(11)
    pool = make_mamba(device, gen)
    host = MambaHostPool(pool, size=5)
    assert host.slot_bytes == 3 * (2 * 4 * 8 * 4 + 12 * 3 * 2 + 5 * 3 * 2)
    poison(host.tensor)
    host.backup(dev_idx([4, 1], device), dev_idx([0, 3], device))
    views = host.slot_views(torch.tensor([0, 3]))
    assert views[0].data_ptr() == host.tensor[0].data_ptr(), "slot views are zero-copy"
    assert torch.equal(views[0], ref_mamba_slot(pool, 4))
    assert torch.equal(views[1], ref_mamba_slot(pool, 1))
    assert bool((host.tensor[[1, 2, 4]] == 0xA5).all()), "untouched host slots changed"
    # H → D: all layers, then layer by layer, into other slots
    host.load(dev_idx([0], device), dev_idx([2], device))
    for l in range(3):
        host.load(dev_idx([3], device), dev_idx([5], device), layer=l)
    assert torch.equal(ref_mamba_slot(pool, 2), ref_mamba_slot(pool, 4))
    assert torch.equal(ref_mamba_slot(pool, 5), ref_mamba_slot(pool, 1))
    # D → flat → D, fused
    flat = torch.full((3, host.slot_bytes), 0xA5, dtype=torch.uint8)
    if device.type == "cuda":
        flat = flat.pin_memory()
    host.device_to_flat(dev_idx([1, 4], device), flat)
    assert torch.equal(flat[0], ref_mamba_slot(pool, 1)) and torch.equal(
        flat[1], ref_mamba_slot(pool, 4)
    )
    assert bool((flat[2] == 0xA5).all())
    host.flat_to_device(flat[:2], dev_idx([0, 3], device))
    assert torch.equal(ref_mamba_slot(pool, 0), ref_mamba_slot(pool, 1))
    assert torch.equal(ref_mamba_slot(pool, 3), ref_mamba_slot(pool, 4))


def test_mamba_copy_on_write(device):
    gen = torch.Generator().manual_seed(12)
    pool = make_mamba(device, gen)
    before = [ref_mamba_slot(pool, s) for s in range(6)]
    pool.copy_slots(dev_idx([0, 2], device), dev_idx([3, 5], device))
    assert torch.equal(ref_mamba_slot(pool, 3), before[0])
    assert torch.equal(ref_mamba_slot(pool, 5), before[2])
    for s in (0, 1, 2, 4):
        assert torch.equal(ref_mamba_slot(pool, s), before[s]), f"slot {s} changed"
    with pytest.raises(ValueError, match="dst: slots must be distinct"):
        pool.copy_slots(dev_idx([0, 1], device), dev_idx([3, 3], device))
    with pytest.raises(ValueError, match="disjoint"):
        pool.copy_slots(dev_idx([0, 1], device), dev_idx([1, 2], device))
    with pytest.raises(ValueError, match="dst: slot outside"):
        pool.copy_slots(dev_idx([0], device), dev_idx([6], device))
    with pytest.raises(ValueError, match="equal 1-D shapes"):
        pool.copy_slots(dev_idx([0, 1], device), dev_idx([2], device))


def test_mamba_bad_input(device):
    gen = torch.Generator().manual_seed(13)
    pool = make_mamba(device, gen)
    host = MambaHostPool(pool, ratio=1.0)
    with pytest.raises(ValueError, match="has 2 entries but"):
        host.backup(dev_idx([0, 1], device), dev_idx([0], device))
    with pytest.raises(ValueError, match="slot 6 outside"):
        host.backup(dev_idx([6], device), dev_idx([0], device))
    with pytest.raises(ValueError, match=r"flat: expected \[n_slots, \d+\] bytes"):
        host.device_to_flat(dev_idx([0], device), torch.empty(1, 10, dtype=torch.uint8))
    other = MambaDevicePool(3, 4, MambaStateSpec((2, 4, 4), ((12, 3), (5, 3))), device=device)
    with pytest.raises(ValueError, match=rf"expected \[n_slots, {pool.slot_bytes}\] bytes"):
        host.flat_to_device(
            torch.empty(1, other.slot_bytes, dtype=torch.uint8), dev_idx([0], device)
        )
    with pytest.raises(ValueError, match="conv_dtypes: 1 dtypes for 2 conv states"):
        MambaStateSpec((2,), ((3, 3), (4, 3)), conv_dtypes=(torch.bfloat16,))


# -- DSA indexer pages ---------------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_indexer_pages(layout, device):
    P = 16
    gen = torch.Generator().manual_seed(21)
    idx = IndexerDevicePool(num_layers=2, num_pages=6, page_size=P, device=device)
    fill_random(idx.buffer, gen)
    assert idx.page_bytes == P * 132
    # keys first, then scales, inside each page
    assert torch.equal(idx.keys(1)[3, 5].cpu(), idx.buffer[1, 3, 5 * 128 : 6 * 128].cpu())
    assert torch.equal(
        idx.scales(0)[2, 7].view(1).view(torch.uint8).cpu(),
        idx.buffer[0, 2, P * 128 + 28 : P * 128 + 32].cpu(),
    )
    host = HostPool(idx, layout, size=4)
    poison(host.tensor)
    kv_slots = torch.cat([torch.arange(5 * P, 6 * P), torch.arange(2 * P, 3 * P)])
    dev_pages = kv_slots_to_pages(kv_slots, P)
    assert dev_pages.tolist() == [5, 2]
    host.backup(dev_pages.to(device), dev_idx([1, 3], device))
    want = [torch.cat([idx.buffer[l, p].cpu() for l in range(2)]) for p in (5, 2)]
    if layout == "layer_first":
        objs = list(host.pack(dev_idx([1, 3], device), host.new_staging(2)))
    else:
        objs = [torch.cat(v) for v in host.page_views(torch.tensor([1, 3]))]
    for o, w in zip(objs, want, strict=True):
        assert torch.equal(o.cpu(), w)
    host.load(dev_idx([1, 3], device), dev_idx([0, 4], device))
    assert torch.equal(idx.buffer[:, 0], idx.buffer[:, 5]) and torch.equal(
        idx.buffer[:, 4], idx.buffer[:, 2]
    )
    with pytest.raises(ValueError, match="not page-aligned"):
        kv_slots_to_pages(kv_slots + 1, P)


@pytest.mark.parametrize("offset", [1, 3, 6])
def test_strided_buffer_at_odd_byte_offsets(offset, device):
    """A raw-byte buffer may start anywhere in its tensor; kernel and reference agree."""
    from kvtier.kernels import DeviceBuffers, HostBuffer, copy_device_to_host, copy_host_to_device

    gen = torch.Generator().manual_seed(offset)
    src = torch.randint(-(2**15), 2**15, (8, 3), dtype=torch.int16, generator=gen).to(device)
    dev = DeviceBuffers.from_layers([[src]])
    raw = torch.full((offset + 8 * 6 + 5,), 0xA5, dtype=torch.uint8)  # size: no word multiple
    if device.type == "cuda":
        raw = raw.pin_memory()
    host = HostBuffer.strided(
        raw,
        num_buffers=1,
        num_layers=1,
        num_slots=8,
        page_size=1,
        item_bytes=6,
        stride_buffer=0,
        stride_page=6,
        stride_token=0,
        stride_layer=0,
        offset=offset,
    )
    idx = torch.arange(8, device=device)
    copy_device_to_host(dev, host, idx, idx.flip(0))
    want = src.flip(0).cpu().contiguous().view(torch.uint8).reshape(-1)
    assert torch.equal(raw[offset : offset + 48], want)
    assert bool((raw[:offset] == 0xA5).all()) and bool((raw[offset + 48 :] == 0xA5).all())
    back = DeviceBuffers.from_layers([[torch.zeros_like(src)]])
    copy_host_to_device(host, back, idx.flip(0), idx)
    assert torch.equal(back.layers[0][0], src)


def test_pack_takes_page_ids_anywhere_and_is_complete_on_return(device):
    """Storage threads hand CPU page ids and read the staging rows right after pack returns."""
    gen = torch.Generator().manual_seed(9)
    pool = make_kv("mha", 4, device, gen)
    host = HostPool(pool, "layer_first", size=16)
    fill_random(host.tensor, gen)
    staging = host.new_staging(3)
    poison(staging)
    rows = host.pack(torch.tensor([3, 0, 2]), staging)  # CPU ids, even with a CUDA pool
    want = torch.cat(
        [
            torch.cat(
                [
                    host.tensor[b, l, p * 4 : p * 4 + 4].reshape(-1).view(torch.uint8)
                    for b in range(2)
                    for l in range(3)
                ]
            ).unsqueeze(0)
            for p in (3, 0, 2)
        ]
    )
    assert torch.equal(rows, want)
    host2 = HostPool(pool, "layer_first", size=16)
    poison(host2.tensor)
    host2.unpack(torch.tensor([1, 2, 3]), rows)
    for i, p in enumerate((3, 0, 2)):
        q = (1, 2, 3)[i]
        got = host2.tensor[:, :, q * 4 : q * 4 + 4].contiguous().view(torch.uint8)
        assert torch.equal(got, host.tensor[:, :, p * 4 : p * 4 + 4].contiguous().view(torch.uint8))
