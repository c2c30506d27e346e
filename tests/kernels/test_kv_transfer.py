"""Copy kernels vs the torch reference: every kind, form, layout, scope, direction, page size, dtype.

Destinations start as random bytes (the poison); after a copy the kernel's destination must equal
the reference's byte for byte, and every slot that was not addressed must still hold the poison.
"""

from __future__ import annotations

import gc
import weakref
import zlib

import pytest
import torch

from kvtier.kernels import copy_device_to_host, copy_host_to_device, kv_transfer
from kvtier.kernels.reference import host_byte_view
from tests.kernels.helpers import (
    DTYPES,
    assert_bytes_equal,
    clone_device,
    clone_host,
    device_bytes,
    make_device,
    make_host,
    pages_to_slots,
    pick_pages,
)

L = 3
HOST_PAGES = 5
DEV_PAGES = 6
N_PAGES = 3


def _item(kind: str, head_dim: int) -> tuple:
    return (2, head_dim) if kind == "mha" else (1, 576 if head_dim == 0 else head_dim)


def _setup(kind, form, layout, P, dtype, head_dim, device, seed):
    gen = torch.Generator().manual_seed(seed)
    item = _item(kind, head_dim)
    dev = make_device(kind, form, L, DEV_PAGES * P, item, dtype, device, gen)
    host = make_host(
        kind, layout, L, HOST_PAGES * P, P, item, dtype, gen, pin=device.type == "cuda"
    )
    dev_pages = pick_pages(DEV_PAGES, N_PAGES, gen)
    host_pages = pick_pages(HOST_PAGES, N_PAGES, gen)
    return dev, host, dev_pages, host_pages


def _check_untouched_host(tri, poison, host_slots_used):
    P = tri.page_size
    used = torch.zeros(tri.num_slots, dtype=torch.bool)
    used[host_slots_used] = True
    free = (~used).nonzero().squeeze(1)
    a = host_byte_view(tri)[:, free // P, free % P]
    b = host_byte_view(poison)[:, free // P, free % P]
    assert torch.equal(a, b), "host slots that were not addressed changed"


def _check_untouched_device(tri, poison, dev_slots_used, layer):
    used = torch.zeros(tri.num_slots, dtype=torch.bool)
    used[dev_slots_used] = True
    for b, buf in enumerate(tri.layers):
        for l, t in enumerate(buf):
            rows = slice(None) if layer is not None and l != layer else ~used
            got = t.view(tri.num_slots, -1).cpu()[rows]
            want = poison.layers[b][l].view(tri.num_slots, -1).cpu()[rows]
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (
                f"device buffer {b} layer {l}: slots that were not addressed changed"
            )


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize("P", [1, 16, 64])
@pytest.mark.parametrize("scope", ["layer", "all"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize(
    "kind,form", [("mha", "stacked"), ("mha", "wrapped"), ("mla", "stacked"), ("mla", "wrapped")]
)
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_copy_matches_reference(direction, kind, form, layout, scope, P, dtype_name, device):
    dtype = DTYPES[dtype_name]
    head_dim = 8 if kind == "mha" else 0
    seed = zlib.crc32(repr((direction, kind, form, layout, scope, P, dtype_name)).encode())
    dev, host, dev_pages, host_pages = _setup(kind, form, layout, P, dtype, head_dim, device, seed)
    dev_slots = pages_to_slots(dev_pages, P)
    host_slots = pages_to_slots(host_pages, P)
    layer = 1 if scope == "layer" else None
    di, hi = dev_slots.to(device), host_slots.to(device)
    if direction == "d2h":
        tri, ref = clone_host(host), clone_host(host)
        copy_device_to_host(dev, tri, di, hi, layer=layer)
        copy_device_to_host(dev, ref, di, hi, layer=layer, impl="torch")
        assert_bytes_equal(tri.tensor, ref.tensor, "host after d2h")
        _check_untouched_host(tri, host, host_slots)
        assert not torch.equal(tri.tensor.view(torch.uint8), host.tensor.view(torch.uint8))
    else:
        tri, ref = clone_device(dev), clone_device(dev)
        copy_host_to_device(host, tri, hi, di, layer=layer)
        copy_host_to_device(host, ref, hi, di, layer=layer, impl="torch")
        assert_bytes_equal(device_bytes(tri), device_bytes(ref), "device after h2d")
        _check_untouched_device(tri, dev, dev_slots, layer)
        assert not torch.equal(device_bytes(tri), device_bytes(dev))


@pytest.mark.parametrize(
    "case", ["one_token", "one_page", "empty", "head_dim_72", "mla_576", "skip"]
)
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_awkward_shapes(case, layout, direction, device):
    kind = "mla" if case == "mla_576" else "mha"
    head_dim = {"head_dim_72": 72, "mla_576": 0}.get(case, 8)
    P = 1 if case == "one_token" else 16
    seed = zlib.crc32(repr((case, layout, direction)).encode())
    dev, host, dev_pages, host_pages = _setup(
        kind, "wrapped", layout, P, torch.bfloat16, head_dim, device, seed
    )
    n = {"one_token": 1, "one_page": 1, "empty": 0}.get(case, N_PAGES)
    dev_slots = pages_to_slots(dev_pages[:n], P)
    host_slots = pages_to_slots(host_pages[:n], P)
    if case == "skip":  # the middle page is padding on one side: it must be skipped
        dev_slots = dev_slots.clone()
        dev_slots[P : 2 * P] = -1
    di, hi = dev_slots.to(device), host_slots.to(device)
    for layer in (None, 0):
        if direction == "d2h":
            tri, ref = clone_host(host), clone_host(host)
            copy_device_to_host(dev, tri, di, hi, layer=layer)
            copy_device_to_host(dev, ref, di, hi, layer=layer, impl="torch")
            assert_bytes_equal(tri.tensor, ref.tensor, f"{case} host after d2h")
            written = host_slots[dev_slots >= 0]
            _check_untouched_host(tri, host, written)
        else:
            tri, ref = clone_device(dev), clone_device(dev)
            copy_host_to_device(host, tri, hi, di, layer=layer)
            copy_host_to_device(host, ref, hi, di, layer=layer, impl="torch")
            assert_bytes_equal(device_bytes(tri), device_bytes(ref), f"{case} device after h2d")
            _check_untouched_device(tri, dev, dev_slots[dev_slots >= 0], layer)


@pytest.mark.parametrize("P", [1, 16])
def test_page_id_indices_equal_token_indices(P, device):
    dev, host, dev_pages, host_pages = _setup(
        "mha", "stacked", "page_first", P, torch.float16, 8, device, 7
    )
    a, b = clone_host(host), clone_host(host)
    copy_device_to_host(dev, a, dev_pages.to(device), host_pages.to(device), index_unit="page")
    copy_device_to_host(
        dev, b, pages_to_slots(dev_pages, P).to(device), pages_to_slots(host_pages, P).to(device)
    )
    assert_bytes_equal(a.tensor, b.tensor, "page-id vs token-slot indices")


@pytest.mark.parametrize("P", [1, 16, 64])
def test_round_trip_across_layouts(P, device):
    """D→H in one layout, H→D back, for every layout: the bytes come back identical."""
    gen = torch.Generator().manual_seed(P)
    item = (2, 8)
    src = make_device("mha", "stacked", L, DEV_PAGES * P, item, torch.bfloat16, device, gen)
    dev_pages = pick_pages(DEV_PAGES, N_PAGES, gen)
    out_pages = pick_pages(DEV_PAGES, N_PAGES, gen)
    for layout in ("layer_first", "page_first", "page_first_direct"):
        host = make_host(
            "mha", layout, L, HOST_PAGES * P, P, item, torch.bfloat16, gen, device.type == "cuda"
        )
        host_pages = pick_pages(HOST_PAGES, N_PAGES, gen)
        dst = make_device("mha", "wrapped", L, DEV_PAGES * P, item, torch.bfloat16, device, gen)
        hs = pages_to_slots(host_pages, P).to(device)
        copy_device_to_host(src, host, pages_to_slots(dev_pages, P).to(device), hs)
        for layer in range(L):  # the layer-wise load path
            copy_host_to_device(host, dst, hs, pages_to_slots(out_pages, P).to(device), layer=layer)
        for b in range(2):
            for l in range(L):
                got = dst.layers[b][l][pages_to_slots(out_pages, P).to(device)]
                want = src.layers[b][l][pages_to_slots(dev_pages, P).to(device)]
                assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (layout, b, l)


def test_launch_cache_keeps_no_pool_alive(device):
    """The per-pair launch cache must not hold a freed pool's memory."""
    dev, host, dev_pages, host_pages = _setup(
        "mha", "layers", "layer_first", 4, DTYPES["bf16"], 8, device, 3
    )
    d, h = pages_to_slots(dev_pages, 4).to(device), pages_to_slots(host_pages, 4).to(device)
    copy_device_to_host(dev, host, d, h)
    copy_device_to_host(dev, host, d, h)  # the second call takes the cached entry
    assert any(k[:2] == (id(dev), id(host)) for k in kv_transfer._PREPARED), "cache unused"
    host_mem, dev_mem = weakref.ref(host.tensor), weakref.ref(dev.base)
    del dev, host
    gc.collect()
    assert host_mem() is None and dev_mem() is None


@pytest.mark.parametrize("programs", [1, 2, 3])
@pytest.mark.parametrize("scope", ["layer", "all"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("kind,P", [("mha", 4), ("mla", 1)])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
def test_grid_stride_walk_matches_reference(direction, kind, P, layout, scope, programs, device):
    """Items wide enough that a row is several warp-wide pieces (2 KiB: ``REPS`` > 1), tiles
    small enough that each program walks several, a tile count no grid divides evenly, and a
    skipped page on one side: the bytes equal the reference's and unaddressed slots keep their
    poison."""
    seed = zlib.crc32(repr(("walk", direction, kind, P, layout, scope, programs)).encode())
    dev, host, dev_pages, host_pages = _setup(
        kind, "wrapped", layout, P, torch.bfloat16, 512, device, seed
    )
    dev_slots = pages_to_slots(dev_pages, P).clone()
    host_slots = pages_to_slots(host_pages, P)
    dev_slots[P : 2 * P] = -1  # the middle page skipped
    di, hi = dev_slots.to(device), host_slots.to(device)
    layer = 1 if scope == "layer" else None
    knobs = kv_transfer.TransferKnobs(
        programs,
        tile_bytes=4096,
        num_warps=1,
        small_h2d_bytes=0,
        token_d2h_programs=0,
        token_h2d_programs=0,
    )
    prep = kv_transfer._prepared(dev, host, 1, direction == "d2h", knobs)
    assert prep.meta["REPS"] > 1 and prep.meta["REPS"] * prep.meta["W2"] == prep.meta["BLOCK_W"]
    if direction == "d2h":
        tri, ref = clone_host(host), clone_host(host)
        copy_device_to_host(dev, tri, di, hi, layer=layer, knobs=knobs)
        copy_device_to_host(dev, ref, di, hi, layer=layer, impl="torch")
        assert_bytes_equal(tri.tensor, ref.tensor, "host after d2h")
        _check_untouched_host(tri, host, host_slots[dev_slots >= 0])
    else:
        tri, ref = clone_device(dev), clone_device(dev)
        copy_host_to_device(host, tri, hi, di, layer=layer, knobs=knobs)
        copy_host_to_device(host, ref, hi, di, layer=layer, impl="torch")
        assert_bytes_equal(device_bytes(tri), device_bytes(ref), "device after h2d")
        _check_untouched_device(tri, dev, dev_slots[dev_slots >= 0], layer)
