"""The direct launch of the copy kernel (a cached compiled kernel, without the JIT's per-call
binding): taken from the second call of a pool pair on, bit-exact against the torch reference
for every layout, direction and scope, and left alone while launch hooks are installed. The
host->device small-call variant (``TransferKnobs.small_h2d_bytes``) is chosen by a call's bytes
and compiled beside the default at the first call, so no later call goes through the JIT.

The direct launch exists on CUDA only; on the CPU (interpreter) the cache must stay empty.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtier.kernels import kv_transfer
from kvtier.kernels.kv_transfer import TransferKnobs, copy_device_to_host, copy_host_to_device
from kvtier.kernels.reference import ref_copy_kv
from tests.kernels.helpers import (
    assert_bytes_equal,
    clone_device,
    clone_host,
    device_bytes,
    make_device,
    make_host,
    pages_to_slots,
    pick_pages,
)

CUDA = torch.cuda.is_available()
L = 3
P = 4
DEV_PAGES = 6
HOST_PAGES = 5


def _setup(layout, item, seed, device):
    gen = torch.Generator().manual_seed(seed)
    dev = make_device("mha", "stacked", L, DEV_PAGES * P, item, torch.float16, device, gen)
    host = make_host("mha", layout, L, HOST_PAGES * P, P, item, torch.float16, gen, pin=CUDA)
    return dev, host, gen


def _entries(dev, host):
    return [p for k, p in kv_transfer._PREPARED.items() if k[:2] == (id(dev), id(host))]


def _entry(dev, host):
    hits = _entries(dev, host)
    assert len(hits) == 1, hits
    return hits[0]


def _tiny_knobs(item: tuple[int, int], tile_bytes: int, small_pages: int) -> TransferKnobs:
    """Small tiles for small pools; one-layer host->device calls of up to ``small_pages`` pages
    take the small-call variant (32-byte tiles, 2 warps)."""
    page_bytes = P * 2 * 2 * item[0] * item[1]  # one layer of one page: K and V, fp16
    return TransferKnobs(
        num_programs=2,
        tile_bytes=tile_bytes,
        num_warps=1,
        small_h2d_bytes=small_pages * page_bytes,
        small_tile_bytes=32,
        small_num_warps=2,
        layer_rows_programs=1,  # page_first all-layer calls walk layers in rows here
    )


def _spy(monkeypatch, field: str) -> list:
    """Per launch, ``field`` of the prepared entry it built its arguments for (the first: the
    variant it runs; a first launch also builds its siblings')."""
    seen = []
    args_of = kv_transfer._launch_args

    def spy(prep, *a):
        seen.append(getattr(prep, field))
        return args_of(prep, *a)

    monkeypatch.setattr(kv_transfer, "_launch_args", spy)
    return seen


def _copy_and_compare(dev, host, ref_dev, ref_host, ds, hs, d2h, layer, knobs, what, **unit):
    """One copy through the kernel and the same through the torch reference: both sides equal
    byte for byte (every slot the call does not name untouched)."""
    if d2h:
        copy_device_to_host(dev, host, ds, hs, layer=layer, knobs=knobs, **unit)
    else:
        copy_host_to_device(host, dev, hs, ds, layer=layer, knobs=knobs, **unit)
    ref_copy_kv(ref_dev, ref_host, ds, hs, d2h=d2h, layer=layer, **unit)
    assert_bytes_equal(host.tensor, ref_host.tensor, what + " host")
    assert_bytes_equal(device_bytes(dev), device_bytes(ref_dev), what + " device")


def _count_jit(monkeypatch) -> list[int]:
    """Count launches that go through ``JITFunction.run``."""
    n = [0]
    run = kv_transfer._kv_copy_kernel.run

    def counted(*args, **kwargs):
        n[0] += 1
        return run(*args, **kwargs)

    monkeypatch.setattr(kv_transfer._kv_copy_kernel, "run", counted)
    return n


@pytest.mark.skipif(not CUDA, reason="the direct launch exists on CUDA only")
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("direction", ["d2h", "h2d"])
@pytest.mark.parametrize("item", [(2, 8), (3, 12)])
@pytest.mark.parametrize("rows_from", [1, 0])  # page_first all-layer: layer rows / innermost
def test_direct_launch_matches_reference(layout, direction, item, rows_from, monkeypatch):
    device = torch.device("cuda")
    dev, host, gen = _setup(layout, item, 7, device)
    ref_dev, ref_host = clone_device(dev), clone_host(host)
    jit = _count_jit(monkeypatch)
    knobs = dataclasses.replace(
        _tiny_knobs(item, tile_bytes=64, small_pages=3), layer_rows_programs=rows_from
    )
    d2h = direction == "d2h"
    # Calls of different sizes, layers and scopes: only the first goes through the JIT (which,
    # host->device, also compiles the other variant).
    for i, (n, layer) in enumerate(((2, None), (1, 0), (3, 2), (HOST_PAGES, 1), (2, None))):
        dp = pick_pages(DEV_PAGES, n, gen).to(device)
        hp = pick_pages(HOST_PAGES, n, gen).to(device)
        if d2h:
            copy_device_to_host(dev, host, dp, hp, layer=layer, index_unit="page", knobs=knobs)
        else:
            copy_host_to_device(host, dev, hp, dp, layer=layer, index_unit="page", knobs=knobs)
        ref_copy_kv(ref_dev, ref_host, dp, hp, d2h=d2h, layer=layer, index_unit="page")
        torch.cuda.synchronize()
        what = f"{layout} {direction} call {i} ({n} pages, layer {layer})"
        assert_bytes_equal(host.tensor, ref_host.tensor, what + " host")
        assert_bytes_equal(device_bytes(dev), device_bytes(ref_dev), what + " device")
        entries = _entries(dev, host)
        # host->device: two sizes; page_first: two tile orders for the large size (one-layer
        # and all-layer calls: layer rows or layers innermost; the small size serves one-layer
        # calls only)
        want = (1 if d2h else 2) + (layout == "page_first")
        assert len(entries) == want, what
        assert all(e.compiled is not None for e in entries), what
    if not d2h:
        tiles = sorted(e.meta["num_warps"] for e in _entries(dev, host))  # the two variants
        assert tiles == ([1, 1, 2] if layout == "page_first" else [1, 2]), tiles
    # The first call's launch and the other variants' compiles, nothing later.
    assert jit[0] == want, f"{jit[0]} calls went through the JIT, expected {want}"


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_small_h2d_variant_chosen_by_bytes(layout, device, monkeypatch):
    """Both host->device variants move the same bytes; one-layer calls up to
    ``small_h2d_bytes`` take the small variant, larger and all-layer calls the default."""
    item = (2, 8)
    dev, host, gen = _setup(layout, item, 11, device)
    ref_dev, ref_host = clone_device(dev), clone_host(host)
    knobs = _tiny_knobs(item, tile_bytes=128, small_pages=2)
    launched = _spy(
        monkeypatch, "knobs"
    )  # the variant each launch built its arguments for (first: the one it runs)
    for n, layer, small in ((1, 0, True), (2, 1, True), (3, 2, False), (1, None, False)):
        dp = pick_pages(DEV_PAGES, n, gen).to(device)
        hp = pick_pages(HOST_PAGES, n, gen).to(device)
        launched.clear()
        copy_host_to_device(host, dev, hp, dp, layer=layer, index_unit="page", knobs=knobs)
        ref_copy_kv(ref_dev, ref_host, dp, hp, d2h=False, layer=layer, index_unit="page")
        what = f"{n} pages, layer {layer}"
        assert_bytes_equal(device_bytes(dev), device_bytes(ref_dev), what)
        assert launched[0] == (knobs.small_variant() if small else knobs), what
    assert_bytes_equal(host.tensor, ref_host.tensor, "the host side is only read")
    launched.clear()  # device->host always takes the default
    copy_device_to_host(dev, host, dp, hp, layer=0, index_unit="page", knobs=knobs)
    assert launched == [knobs]


@pytest.mark.parametrize(
    ("page", "programs", "item_limit", "want"),
    [
        (1, 2, 8192, {"d2h": True, "h2d": True}),
        (1, 4, 8192, {"d2h": True, "h2d": False}),
        (1, 8, 8192, {"d2h": False, "h2d": False}),
        (1, 2, 16, {"d2h": False, "h2d": False}),  # items of 32 bytes: over the limit
        (4, 2, 8192, {"d2h": False, "h2d": False}),  # pages: the default
    ],
)
def test_token_variant_chosen_by_page_size_item_and_grid(
    page, programs, item_limit, want, device, monkeypatch
):
    """Host pools of page size 1 with small items take the token variant up to
    ``token_d2h_programs`` / ``token_h2d_programs`` programs; the bytes are the reference's
    either way, every slot the call does not name untouched."""
    item = (2, 8)  # 32-byte items, fp16
    gen = torch.Generator().manual_seed(5)
    dev = make_device("mha", "stacked", L, DEV_PAGES * P, item, torch.float16, device, gen)
    host = make_host("mha", "page_first", L, HOST_PAGES * P, page, item, torch.float16, gen, CUDA)
    ref_dev, ref_host = clone_device(dev), clone_host(host)
    knobs = TransferKnobs(
        num_programs=programs,
        tile_bytes=64,
        num_warps=1,
        small_h2d_bytes=0,
        token_item_bytes=item_limit,
        token_tile_bytes=256,
        token_num_warps=2,
    )
    launched = _spy(monkeypatch, "knobs")
    for direction, layer in (("d2h", None), ("h2d", 1), ("d2h", 2), ("h2d", None)):
        d2h = direction == "d2h"
        ds = torch.randperm(DEV_PAGES * P, generator=gen)[:9].to(device)
        hs = torch.randperm(HOST_PAGES * P, generator=gen)[:9].to(device)
        if page > 1:  # whole pages: token slots in page-aligned runs
            ds = pages_to_slots(pick_pages(DEV_PAGES, 2, gen), P).to(device)
            hs = pages_to_slots(pick_pages(HOST_PAGES, 2, gen), P).to(device)
        launched.clear()
        what = f"{direction} layer {layer}"
        _copy_and_compare(dev, host, ref_dev, ref_host, ds, hs, d2h, layer, knobs, what)
        assert launched[0] == (knobs.token_variant() if want[direction] else knobs), what
    v = knobs.token_variant()
    assert (v.tile_bytes, v.num_warps, v.token_d2h_programs, v.token_h2d_programs) == (256, 2, 0, 0)
    assert not v.prefetch_h2d and knobs.prefetch_h2d and knobs.small_variant().prefetch_h2d
    assert v.num_programs == programs and knobs.token_variant() is v


@pytest.mark.parametrize(("page", "item_limit"), [(P, 8192), (1, 8192), (1, 16)])
@pytest.mark.parametrize("rows_from", [1, 2, 3, 0])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_layer_rows_for_all_layer_calls_where_a_tokens_layers_are_adjacent(
    layout, rows_from, page, item_limit, device, monkeypatch
):
    """All-layer calls into a host layout that keeps each token's layers side by side
    (page_first) walk each token's layers in a tile's rows (``LAYER_ROWS``) on at least
    ``layer_rows_programs`` programs (2 here), and at any grid size with a page-size-1 host of
    small items (0: never); one-layer calls and other layouts keep one (buffer, layer) per tile.
    Bit-exact against the reference either way."""
    if page == 1 and layout == "page_first_direct":
        pytest.skip("page_first_direct with pages of one token is page_first")
    item = (2, 8)  # 32-byte items
    gen = torch.Generator().manual_seed(13)
    dev = make_device("mha", "stacked", L, DEV_PAGES * P, item, torch.float16, device, gen)
    host = make_host("mha", layout, L, HOST_PAGES * P, page, item, torch.float16, gen, pin=CUDA)
    ref_dev, ref_host = clone_device(dev), clone_host(host)
    knobs = dataclasses.replace(
        _tiny_knobs(item, tile_bytes=64, small_pages=0),  # 2 rows a tile, 3 layers: straddles
        layer_rows_programs=rows_from,
        token_item_bytes=item_limit,
    )
    small_tokens = page == 1 and item_limit >= 32
    on = (
        layout == "page_first"
        and rows_from > 0
        and (rows_from <= knobs.num_programs or small_tokens)
    )
    taken = _spy(monkeypatch, "layer_rows")
    for direction, layer in (("d2h", None), ("h2d", None), ("d2h", 1), ("h2d", 2)):
        d2h = direction == "d2h"
        ds = pages_to_slots(pick_pages(DEV_PAGES, 3, gen), P).to(device)
        hs = (
            torch.randperm(HOST_PAGES * P, generator=gen)[: 3 * P]
            if page == 1
            else pages_to_slots(pick_pages(HOST_PAGES, 3, gen), P)
        ).to(device)
        taken.clear()
        what = f"{layout} {direction} layer {layer}"
        _copy_and_compare(dev, host, ref_dev, ref_host, ds, hs, d2h, layer, knobs, what)
        assert taken[0] == (on and layer is None), what


@pytest.mark.parametrize("inner", [True, False])
@pytest.mark.parametrize("rows_from", [0, 1, 3])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_layers_innermost_for_all_layer_calls_without_layer_rows(
    layout, rows_from, inner, device, monkeypatch
):
    """All-layer calls into a host that keeps each token's layers side by side (page_first)
    and that do not take layer rows (``layer_rows_programs`` 0, or above the grid's 2
    programs) walk layers innermost (``LAYER_INNER``: a program's next tile is the next
    (buffer, layer) of the same rows) when ``layer_inner`` is on; one-layer calls, layer-row
    calls and other layouts keep the usual order. Bit-exact either way: 8-row tiles over 3
    layers, 2 buffers and 12 tokens, so each program's tiles cross layers, buffers and row
    blocks, and the last row block is partial."""
    item = (2, 8)  # 32-byte items: one chunk a row, 8 rows a tile
    dev, host, gen = _setup(layout, item, 19, device)
    ref_dev, ref_host = clone_device(dev), clone_host(host)
    knobs = dataclasses.replace(
        _tiny_knobs(item, tile_bytes=256, small_pages=0),
        layer_rows_programs=rows_from,
        layer_inner=inner,
    )
    on = layout == "page_first" and inner and not (0 < rows_from <= knobs.num_programs)
    taken = _spy(monkeypatch, "layer_inner")
    meta = _spy(monkeypatch, "meta")
    for direction, layer in (("d2h", None), ("h2d", None), ("d2h", 1), ("h2d", 2)):
        d2h = direction == "d2h"
        ds = pages_to_slots(pick_pages(DEV_PAGES, 3, gen), P).to(device)
        hs = pages_to_slots(pick_pages(HOST_PAGES, 3, gen), P).to(device)
        taken.clear()
        meta.clear()
        what = f"{layout} {direction} layer {layer}"
        _copy_and_compare(dev, host, ref_dev, ref_host, ds, hs, d2h, layer, knobs, what)
        assert taken[0] == (on and layer is None), what
        # Host->device calls read ahead, except with layers innermost.
        assert meta[0]["PREFETCH"] is (not d2h and not taken[0]), what


@pytest.mark.parametrize("prefetch", [True, False])
@pytest.mark.parametrize("tile_bytes", [64, 256])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_host_to_device_reads_the_next_tiles_indices_ahead(
    layout, tile_bytes, prefetch, device, monkeypatch
):
    """With ``prefetch_h2d`` a host->device program reads its next tile's slot indices and
    table entry before this tile's stores (``PREFETCH``); device->host calls never do.
    Bit-exact either way, one-layer and all-layer, with several tiles per program (64-byte
    tiles) or one (256-byte tiles: the last tile reads its own entries again)."""
    item = (2, 8)
    dev, host, gen = _setup(layout, item, 23, device)
    ref_dev, ref_host = clone_device(dev), clone_host(host)
    knobs = dataclasses.replace(
        _tiny_knobs(item, tile_bytes=tile_bytes, small_pages=0), prefetch_h2d=prefetch
    )
    meta = _spy(monkeypatch, "meta")
    for direction, layer in (("h2d", None), ("d2h", None), ("h2d", 0), ("d2h", 2)):
        d2h = direction == "d2h"
        for n in (1, 3):
            dp = pick_pages(DEV_PAGES, n, gen).to(device)
            hp = pick_pages(HOST_PAGES, n, gen).to(device)
            meta.clear()
            what = f"{layout} {direction} layer {layer}, {n} pages"
            _copy_and_compare(
                dev, host, ref_dev, ref_host, dp, hp, d2h, layer, knobs, what, index_unit="page"
            )
            assert meta[0]["PREFETCH"] is (prefetch and not d2h), what


def test_layer_rows_give_way_where_rows_would_pass_int32(device, monkeypatch):
    """The kernel's tile math is i32: an all-layer call whose rows (tokens x chunks x layers)
    would pass it takes one (buffer, layer) per tile instead (here the limit is lowered to
    what a small call crosses). Bit-exact either way."""
    item = (2, 8)
    dev, host, gen = _setup("page_first", item, 17, device)
    ref_dev, ref_host = clone_device(dev), clone_host(host)
    knobs = _tiny_knobs(item, tile_bytes=64, small_pages=0)
    taken = _spy(monkeypatch, "layer_rows")
    rows_per_page = P * L  # one chunk per 32-byte item
    monkeypatch.setattr(kv_transfer, "_I32_MAX", 2 * rows_per_page)
    for n, want in ((2, True), (3, False)):
        dp = pick_pages(DEV_PAGES, n, gen).to(device)
        hp = pick_pages(HOST_PAGES, n, gen).to(device)
        taken.clear()
        _copy_and_compare(
            dev, host, ref_dev, ref_host, dp, hp, True, None, knobs, f"{n} pages", index_unit="page"
        )
        assert taken[0] is want, n


def test_constant_arguments_follow_the_kernels_signature(device):
    """The direct launch passes each entry's constexprs after the runtime arguments in the
    kernel's signature order: ``consts`` is ``meta``'s values in that order, for every
    variant a pool pair takes (each direction, scope, size variant and tile order)."""
    item = (2, 8)
    names = kv_transfer._constexpr_names(kv_transfer._kv_copy_kernel)
    assert names[:2] == ("D2H", "TOKENS_PER_INDEX") and names[-2:] == ("PREFETCH", "LAYER_INNER")
    for rows_from in (1, 0):
        dev, host, gen = _setup("page_first", item, 29, device)
        ref_dev, ref_host = clone_device(dev), clone_host(host)
        knobs = dataclasses.replace(
            _tiny_knobs(item, tile_bytes=64, small_pages=1), layer_rows_programs=rows_from
        )
        for d2h, layer, n in ((True, None, 2), (False, None, 2), (False, 0, 1), (True, 1, 3)):
            dp = pick_pages(DEV_PAGES, n, gen).to(device)
            hp = pick_pages(HOST_PAGES, n, gen).to(device)
            what = f"d2h {d2h} layer {layer}"
            _copy_and_compare(
                dev, host, ref_dev, ref_host, dp, hp, d2h, layer, knobs, what, index_unit="page"
            )
        entries = _entries(dev, host)
        assert len(entries) >= 4
        for e in entries:
            assert set(e.meta) - {"num_warps"} == set(names)
            assert e.consts == tuple(e.meta[k] for k in names)


def test_token_variant_knobs_are_checked():
    with pytest.raises(ValueError, match="token_tile_bytes"):
        TransferKnobs(token_tile_bytes=96)
    with pytest.raises(ValueError, match="token_num_warps"):
        TransferKnobs(token_num_warps=64)
    with pytest.raises(ValueError, match="token_h2d_programs"):
        TransferKnobs(token_h2d_programs=-1)
    with pytest.raises(TypeError, match="token_item_bytes"):
        TransferKnobs(token_item_bytes=2.0)
    with pytest.raises(ValueError, match="layer_rows_programs"):
        TransferKnobs(layer_rows_programs=-4)
    with pytest.raises(TypeError, match="layer_inner"):
        TransferKnobs(layer_inner=1)
    with pytest.raises(TypeError, match="prefetch_h2d"):
        TransferKnobs(prefetch_h2d="yes")


def test_default_warps_follow_the_grid():
    """One program per SM wants more warps in flight: 32 at 1-2 programs, 16 from 4 up; an
    explicit value is kept."""
    assert [TransferKnobs(n).warps for n in (1, 2, 3, 4, 64)] == [32, 32, 16, 16, 16]
    assert TransferKnobs(2, num_warps=8).warps == 8
    # The default follows the grid through dataclasses.replace too.
    assert dataclasses.replace(TransferKnobs(), num_programs=2).warps == 32
    assert dataclasses.replace(TransferKnobs(1), num_programs=8).warps == 16
    with pytest.raises(TypeError, match="num_programs"):
        TransferKnobs("2")
    with pytest.raises(TypeError, match="num_warps"):
        TransferKnobs(2, num_warps=8.0)
    with pytest.raises(ValueError, match="num_warps"):
        TransferKnobs(2, num_warps=3)


def test_small_variant_knobs_are_checked():
    k = TransferKnobs()
    s = k.small_variant()
    assert (s.tile_bytes, s.num_warps, s.small_h2d_bytes) == (
        k.small_tile_bytes,
        k.small_num_warps,
        0,
    )
    assert s.num_programs == k.num_programs and k.small_variant() is s
    with pytest.raises(ValueError, match="small_tile_bytes"):
        TransferKnobs(small_tile_bytes=48)
    with pytest.raises(ValueError, match="small_num_warps"):
        TransferKnobs(small_num_warps=3)
    with pytest.raises(ValueError, match="small_h2d_bytes"):
        TransferKnobs(small_h2d_bytes=-1)
    with pytest.raises(TypeError, match="small_h2d_bytes"):
        TransferKnobs(small_h2d_bytes=1.5)


@pytest.mark.skipif(not CUDA, reason="the direct launch exists on CUDA only")
def test_direct_launch_off_and_hooks_take_the_jit(monkeypatch):
    device = torch.device("cuda")
    dev, host, gen = _setup("layer_first", (2, 8), 8, device)
    dp = pick_pages(DEV_PAGES, 2, gen).to(device)
    hp = pick_pages(HOST_PAGES, 2, gen).to(device)
    copy_device_to_host(dev, host, dp, hp, index_unit="page")
    jit = _count_jit(monkeypatch)
    monkeypatch.setattr(kv_transfer, "FAST_LAUNCH", False)
    copy_device_to_host(dev, host, dp, hp, index_unit="page")
    assert jit[0] == 1
    monkeypatch.setattr(kv_transfer, "FAST_LAUNCH", True)
    seen = []
    monkeypatch.setattr(kv_transfer._RUNTIME_KNOBS, "launch_enter_hook", seen.append)
    copy_device_to_host(dev, host, dp, hp, index_unit="page")
    assert jit[0] == 2 and len(seen) == 1, (jit[0], seen)
    monkeypatch.undo()
    ref_host = clone_host(host)
    ref_copy_kv(dev, ref_host, dp, hp, d2h=True, layer=None, index_unit="page")
    torch.cuda.synchronize()
    assert_bytes_equal(host.tensor, ref_host.tensor, "after the JIT launches")


@pytest.mark.skipif(CUDA, reason="checks the interpreter path")
def test_interpreter_never_caches_a_compiled_kernel(device):
    dev, host, gen = _setup("page_first_direct", (2, 8), 9, device)
    ref_host = clone_host(host)
    dp = pick_pages(DEV_PAGES, 2, gen)
    hp = pick_pages(HOST_PAGES, 2, gen)
    for _ in range(2):
        copy_device_to_host(dev, host, dp, hp, layer=1, index_unit="page", impl="interpreter")
    ref_copy_kv(dev, ref_host, dp, hp, d2h=True, layer=1, index_unit="page")
    assert_bytes_equal(host.tensor, ref_host.tensor, "interpreter")
    assert _entry(dev, host).compiled is None
    assert not kv_transfer.FAST_LAUNCH
