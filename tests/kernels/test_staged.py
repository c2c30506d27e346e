"""The staged path on the CPU: slot layouts, host regions, routes, and whole copies bit-exact
against the torch reference through the interpreter.

No GPU here, so the copy-engine step (:func:`kvtier.kernels.staged.engine_copy`) is emulated:
each range and each row of a 2-D copy becomes a ``memmove`` between CPU tensors. The gather and
scatter are the real copy kernel, run by Triton's interpreter on a CPU "device" ring.
"""

from __future__ import annotations

import contextlib
import ctypes

import numpy as np
import pytest
import torch

from kvtier.kernels import copier as copier_mod
from kvtier.kernels import copy_engine
from kvtier.kernels import staged as staged_mod
from kvtier.kernels.copier import HostCopier
from kvtier.kernels.dispatch import CROSSOVERS, Crossover, RouteReason, select_route
from kvtier.kernels.reference import host_byte_view, ref_copy_kv
from kvtier.kernels.staged import host_regions, stage_strides
from kvtier.nvtx import copy_range_name
from tests.kernels.helpers import (
    as_bytes,
    assert_bytes_equal,
    clone_device,
    clone_host,
    device_bytes,
    make_device,
    make_host,
    pages_to_slots,
)

L = 3
DEV_PAGES = 7
HOST_PAGES = 9
LAYOUTS = ("layer_first", "page_first", "page_first_direct")
POISON = 0xA5


def _item(kind: str) -> tuple[int, ...]:
    return (2, 8) if kind == "mha" else (1, 24)  # 32 B and 48 B (not a power of two) of bf16


def _setup(kind: str, layout: str, P: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    dev = make_device(kind, "layers", L, DEV_PAGES * P, _item(kind), torch.bfloat16, "cpu", gen)
    host = make_host(kind, layout, L, HOST_PAGES * P, P, _item(kind), torch.bfloat16, gen, False)
    return dev, host, gen


def _emulate(dst, src, sizes, mats, stream) -> None:
    """What the copy engine does with a staged chunk, on CPU memory."""
    for d, s, n in zip(dst.tolist(), src.tolist(), sizes.tolist()):
        ctypes.memmove(d, s, n)
    for d, dp, s, sp, w, h in mats.tolist():
        for i in range(h):
            ctypes.memmove(d + i * dp, s + i * sp, w)


@pytest.fixture
def engine(monkeypatch):
    """The copy engine 'available' on the CPU; staged chunks' copies emulated and recorded as
    (ranges, 2-D copies) per call."""
    calls: list[tuple[int, int]] = []

    def copy(dst, src, sizes, mats, stream):
        calls.append((len(sizes), len(mats)))
        _emulate(dst, src, sizes, mats, stream)

    monkeypatch.setattr(
        copier_mod, "engine_support", lambda device: copy_engine.EngineSupport(True)
    )
    monkeypatch.setattr(staged_mod, "engine_copy", copy)
    return calls


def _poison_dev(dev, slots: torch.Tensor) -> None:
    keep = slots[slots >= 0]
    for buf in dev.layers:
        for t in buf:
            t.view(t.shape[0], -1).view(torch.uint8)[keep] = POISON


def _poison_host(host, slots: torch.Tensor) -> None:
    keep = slots[slots >= 0]
    P = host.page_size
    host_byte_view(host)[:, keep // P, keep % P] = POISON


# -- slot layout and regions -------------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
def test_stage_strides_mirror_the_host_order(layout):
    P, C = 4, 5
    _, host, _ = _setup("mha", layout, P, 0)
    I = host.item_bytes
    sb, sp, st, sl = stage_strides(host, C, L)
    want = {
        "layer_first": (L * C * P * I, P * I, I, C * P * I),
        "page_first": (C * P * L * I, P * L * I, L * I, I),
        "page_first_direct": (C * L * P * I, L * P * I, I, P * I),
    }[layout]
    assert (sb, sp, st, sl) == want


# (layout, staged layers) → (rows, 2-D copies) per buffer for one run of 3 pages; each row
# / copy given as (width, height); the module docstring's table, with N = host slots.
@pytest.mark.parametrize(
    "layout, layers, want",
    [
        ("layer_first", 1, ("row", 3 * 16 * 32, 1)),
        ("layer_first", L, ("mat", 3 * 16 * 32, L)),
        ("page_first", 1, ("mat", 32, 3 * 16)),
        ("page_first", L, ("row", 3 * 16 * L * 32, 1)),
        ("page_first_direct", 1, ("mat", 16 * 32, 3)),
        ("page_first_direct", L, ("row", 3 * L * 16 * 32, 1)),
    ],
)
def test_host_regions_per_layout(layout, layers, want):
    P = 16
    _, host, _ = _setup("mha", layout, P, 1)
    stage = stage_strides(host, 6, layers)
    runs = np.array([[4, 2, 3]], dtype=np.int64)  # host pages 4..6 into slot pages 2..4
    g = host_regions(host, stage, runs, layers)
    kind, width, height = want
    if kind == "row":
        assert len(g.mats) == 0 and g.rows_size.tolist() == [width] * host.num_buffers
        assert g.rows_host[0] == 4 * host.stride_page
        assert g.rows_stage[0] == 2 * stage[1]
    else:
        assert len(g.rows_size) == 0 and len(g.mats) == host.num_buffers
        assert g.mats[:, 2].tolist() == [width] * 2 and g.mats[:, 3].tolist() == [height] * 2
        assert g.mats[1, 0] - g.mats[0, 0] == host.stride_buffer
    assert g.calls == (1 if kind == "row" else host.num_buffers)


def test_wide_rows_go_to_the_batch():
    """Rows of at least ROW_BATCH_BYTES are descriptors, not a 2-D copy."""
    P = 64
    gen = torch.Generator().manual_seed(2)
    item = (8, 128)  # 2 KiB: a page of one layer is 128 KiB
    host = make_host("mla", "page_first_direct", L, 4 * P, P, item, torch.bfloat16, gen, False)
    runs = np.array([[0, 0, 3]], dtype=np.int64)
    g = host_regions(host, stage_strides(host, 4, 1), runs, 1)
    assert len(g.mats) == 0 and g.rows_size.tolist() == [P * 2048] * 3
    assert np.diff(g.rows_host).tolist() == [host.stride_page] * 2


# -- routes ------------------------------------------------------------------------------------

BIG = 1 << 30


def _route(io_backend, crossovers=None, **kw):
    args = dict(
        kernel_path="triton",
        engine_reason="",
        contiguous=True,
        legacy_stream=False,
        d2h=False,
        chunk_bytes=32768,
        call_bytes=BIG,
        descriptors=0,
    )
    args.update(kw)
    return select_route(io_backend, crossovers=crossovers, **args)


STAGED_TABLE = {k: Crossover(**{**vars(x), "staged": True}) for k, x in CROSSOVERS.items()}


@pytest.mark.parametrize(
    "io_backend, table, kw, path, reason",
    [
        ("staged", None, {}, "staged", RouteReason.FORCED_STAGED),
        ("staged", None, dict(contiguous=False), "staged", RouteReason.FORCED_STAGED),
        ("staged", None, dict(engine_reason="old driver"), "triton", RouteReason.NO_ENGINE),
        ("staged", None, dict(legacy_stream=True), "triton", RouteReason.LEGACY_STREAM),
        ("auto", None, dict(contiguous=False), "triton", RouteReason.NOT_CONTIGUOUS),
        ("auto", "staged", dict(contiguous=False), "staged", RouteReason.AUTO_STAGED),
        (
            "auto",
            "staged",
            dict(contiguous=False, call_bytes=1000),
            "triton",
            RouteReason.NOT_CONTIGUOUS,
        ),
        # page_first_direct, P=16, per-layer load: 896 descriptors of 32 KiB.
        (
            "auto",
            None,
            dict(descriptors=896, call_bytes=896 * 32768),
            "triton",
            RouteReason.AUTO_MANY_DESCRIPTORS,
        ),
        (
            "auto",
            "staged",
            dict(descriptors=896, call_bytes=896 * 32768),
            "staged",
            RouteReason.AUTO_STAGED,
        ),
        # P=64: 128 KiB descriptors keep up; a backup's 32 KiB ones are enqueued off the
        # forward pass; few descriptors are cheap whatever their size.
        ("auto", None, dict(descriptors=224, call_bytes=224 << 17), "copy_engine", None),
        (
            "auto",
            None,
            dict(descriptors=32768, call_bytes=32768 << 15, d2h=True),
            "copy_engine",
            None,
        ),
        ("auto", None, dict(descriptors=100, call_bytes=100 << 15), "copy_engine", None),
        ("copy_engine", None, dict(descriptors=896, call_bytes=896 << 15), "copy_engine", None),
    ],
    ids=[
        "forced",
        "forced-not-contiguous",
        "forced-no-engine",
        "forced-legacy-stream",
        "auto-not-contiguous",
        "auto-not-contiguous-staged-table",
        "auto-not-contiguous-staged-table-tiny-call",
        "auto-many-descriptors",
        "auto-many-descriptors-staged-table",
        "auto-large-descriptors",
        "auto-backup",
        "auto-few-descriptors",
        "forced-engine-many-descriptors",
    ],
)
def test_select_route_staged_and_descriptors(io_backend, table, kw, path, reason):
    r = _route(io_backend, STAGED_TABLE if table else None, **kw)
    assert r.path == path, r
    if reason is not None:
        assert r.reason is reason, r
    if reason in (RouteReason.AUTO_MANY_DESCRIPTORS, RouteReason.AUTO_STAGED) and "descr" in str(
        kw
    ):
        assert "896 descriptors of 32768 B" in r.detail, r.detail


@pytest.mark.parametrize(
    "layout, consecutive, path, reason",
    [
        ("page_first_direct", False, "kernel", RouteReason.AUTO_MANY_DESCRIPTORS),
        ("layer_first", True, "copy_engine", RouteReason.AUTO_ENGINE),
    ],
    ids=["pfd-scattered", "lf-consecutive"],
)
def test_copier_weighs_descriptors(engine, layout, consecutive, path, reason):
    """A per-layer load of 160 pages: 320 descriptors of 16 KiB per layer in page_first_direct
    (scattered pages); 2 merged ones in layer_first (consecutive pages on both sides)."""
    P, n = 16, 160
    gen = torch.Generator().manual_seed(3)
    item = (8, 64)  # 1 KiB of bf16: a chunk (a page of one layer) is 16 KiB
    dev = make_device("mha", "layers", 2, (n + 8) * P, item, torch.bfloat16, "cpu", gen)
    host = make_host("mha", layout, 2, (n + 8) * P, P, item, torch.bfloat16, gen, False)
    c = HostCopier(dev, host, io_backend="auto")
    if consecutive:
        d_pages, h_pages = torch.arange(n), torch.arange(n) + 3
    else:
        d_pages, h_pages = torch.randperm(n + 8, generator=gen)[:n], torch.randperm(n + 8)[:n]
    plan = c.plan(pages_to_slots(d_pages, P), pages_to_slots(h_pages, P), d2h=False, per_layer=True)
    want = c.kernel_path if path == "kernel" else path  # "interpreter", or "torch" beside a GPU
    assert (plan.route.path, plan.route.reason) == (want, reason), plan.route
    if path == "copy_engine":
        assert plan.descriptors == 2


# -- whole copies, bit-exact -------------------------------------------------------------------


@pytest.mark.parametrize("ring", ["small", "large"])
@pytest.mark.parametrize("per_layer", [True, False], ids=["per-layer", "all-layers"])
@pytest.mark.parametrize("d2h", [True, False], ids=["d2h", "h2d"])
@pytest.mark.parametrize("P", [1, 16, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_staged_bit_exact(engine, kind, layout, P, d2h, per_layer, ring):
    """Random pages (some consecutive on the host), skipped pairs on either side, destinations
    poisoned; the whole of both sides must equal the reference (untouched slots untouched).
    ``small``: two pages per slot, so chunks wrap the ring and a backup stages one layer at a
    time; ``large``: one chunk, and a backup stages every layer at once."""
    dev, host, gen = _setup(kind, layout, P, seed=P + 3 * len(layout) + d2h)
    B, I = dev.num_buffers, dev.item_bytes
    staging = 2 * (2 * B * P * I) if ring == "small" else 1 << 20
    c = HostCopier(dev, host, io_backend="staged", staging_bytes=staging)
    d_pages = torch.randperm(DEV_PAGES, generator=gen)[:6]
    h_pages = torch.tensor([5, 6, 7, 1, 2, 8])  # runs 5-7 and 1-2 once sorted
    d_slots, h_slots = pages_to_slots(d_pages, P), pages_to_slots(h_pages, P)
    d_slots[:P] = -1  # skipped on the device side
    h_slots[4 * P : 5 * P] = -1  # and on the host side
    if d2h:
        _poison_host(host, h_slots[(d_slots >= 0) & (h_slots >= 0)])
    else:
        _poison_dev(dev, d_slots[(d_slots >= 0) & (h_slots >= 0)])
    ref_dev, ref_host = clone_device(dev), clone_host(host)
    ref_copy_kv(ref_dev, ref_host, d_slots, h_slots, d2h=d2h, layer=None)

    plan = c.plan(d_slots, h_slots, d2h=d2h, per_layer=per_layer)
    assert (plan.route.path, plan.route.reason) == ("staged", RouteReason.FORCED_STAGED)
    assert plan.nbytes == 4 * B * L * P * I
    stager = c.stager()
    if per_layer:
        for layer in range(L):
            assert plan.issue(layer) == "staged"
        with pytest.raises(ValueError, match="per layer"):
            plan.issue()
    else:
        assert plan.issue() == "staged"
        fits = B * L * P * I <= stager.ring.slot_bytes
        assert stager.group == (L if fits else 1)
        assert fits == (ring == "large" or P == 1)  # slots are at least 256 B
    assert engine, "no copy-engine step ran"
    assert_bytes_equal(host.tensor, ref_host.tensor, "host")
    assert_bytes_equal(device_bytes(dev), device_bytes(ref_dev), "device")


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_layer_issue_brings_its_layer_only(engine, layout):
    P = 16
    dev, host, gen = _setup("mha", layout, P, seed=21)
    c = HostCopier(dev, host, io_backend="staged", staging_bytes=4 * 2 * P * dev.item_bytes)
    d_slots = pages_to_slots(torch.randperm(DEV_PAGES, generator=gen)[:5], P)
    h_slots = pages_to_slots(torch.randperm(HOST_PAGES, generator=gen)[:5], P)
    _poison_dev(dev, d_slots)
    ref_dev = clone_device(dev)
    ref_copy_kv(ref_dev, host, d_slots, h_slots, d2h=False, layer=None)
    plan = c.plan(d_slots, h_slots, d2h=False, per_layer=True)
    for l in range(L):
        before = [as_bytes(t).clone() for buf in dev.layers for t in buf]
        plan.issue(l)
        after = [as_bytes(t) for buf in dev.layers for t in buf]
        changed = {i % L for i, (x, y) in enumerate(zip(before, after)) if not torch.equal(x, y)}
        assert changed == {l}, f"issue({l}) changed layers {sorted(changed)}"
    assert_bytes_equal(device_bytes(dev), device_bytes(ref_dev), "device after load")


def test_page_first_per_layer_uses_2d_copies_and_all_layers_one_range(engine):
    """page_first: a layer of a host run is rows of one item (2-D copies); all layers of a run
    are one range per buffer, so a backup of 3 consecutive host pages (out of order in the
    batch: sorted by host page first) is one batch of 2."""
    P = 16
    dev, host, _ = _setup("mha", "page_first", P, seed=5)
    c = HostCopier(dev, host, io_backend="staged")
    d, h = pages_to_slots(torch.tensor([4, 0, 2]), P), pages_to_slots(torch.tensor([5, 3, 4]), P)
    c.plan(d, h, d2h=True, per_layer=False).issue()
    assert engine == [(2, 0)]
    engine.clear()
    c.plan(d, h, d2h=False, per_layer=True).issue(1)
    assert engine == [(0, 2)]


def test_empty_and_fully_skipped_batches_move_nothing(engine):
    P = 4
    dev, host, _ = _setup("mla", "page_first", P, seed=6)
    before_dev, before_host = device_bytes(dev).clone(), as_bytes(host.tensor).clone()
    c = HostCopier(dev, host, io_backend="staged")
    empty = torch.empty(0, dtype=torch.int64)
    skip = torch.full((2 * P,), -1, dtype=torch.int64)
    for d, h in ((empty, empty), (skip, pages_to_slots(torch.tensor([1, 2]), P))):
        for d2h in (True, False):
            plan = c.plan(d, h, d2h=d2h, per_layer=False)
            assert plan.nbytes == 0
            plan.issue()
    assert engine == []
    assert torch.equal(device_bytes(dev), before_dev)
    assert torch.equal(as_bytes(host.tensor), before_host)


def test_two_plans_share_the_ring(engine):
    """A backup and a load planned on one copier, issued interleaved, reuse the same slots."""
    P = 16
    dev, host, gen = _setup("mha", "page_first_direct", P, seed=8)
    c = HostCopier(dev, host, io_backend="staged", staging_bytes=2 * 2 * P * dev.item_bytes)
    d1, h1 = pages_to_slots(torch.tensor([0, 1, 2]), P), pages_to_slots(torch.tensor([6, 7, 8]), P)
    d2, h2 = pages_to_slots(torch.tensor([4, 5]), P), pages_to_slots(torch.tensor([1, 3]), P)
    ref_dev, ref_host = clone_device(dev), clone_host(host)
    ref_copy_kv(ref_dev, ref_host, d1, h1, d2h=True, layer=None)
    ref_copy_kv(ref_dev, ref_host, d2, h2, d2h=False, layer=None)
    backup = c.plan(d1, h1, d2h=True, per_layer=False)
    load = c.plan(d2, h2, d2h=False, per_layer=True)
    load.issue(0)
    backup.issue()
    for l in range(1, L):
        load.issue(l)
    assert_bytes_equal(host.tensor, ref_host.tensor, "host")
    assert_bytes_equal(device_bytes(dev), device_bytes(ref_dev), "device")


@pytest.mark.parametrize(
    "kw, exc, words",
    [
        (dict(staging_bytes=0), ValueError, "staging_bytes"),
        (dict(staging_bytes=True), TypeError, "staging_bytes"),
        (dict(staging_bytes=1.5), TypeError, "staging_bytes"),
        (dict(staged_knobs=4), TypeError, "staged_knobs"),
    ],
)
def test_copier_refuses_bad_staging_args(kw, exc, words):
    dev, host, _ = _setup("mha", "layer_first", 4, 0)
    with pytest.raises(exc, match=words):
        HostCopier(dev, host, io_backend="staged", **kw)


def test_staged_without_engine_falls_back_to_the_kernel():
    dev, host, gen = _setup("mha", "page_first", 4, 9)
    c = HostCopier(dev, host, io_backend="staged")
    slots = pages_to_slots(torch.tensor([1, 2]), 4)
    plan = c.plan(slots, slots, d2h=True, per_layer=False)
    assert plan.route.reason is RouteReason.NO_ENGINE and plan.route.path != "staged"
    assert c._stager is None  # no ring allocated


@pytest.mark.parametrize("layout", LAYOUTS)
def test_staged_index_group(engine, layout):
    """Sidecar pools (the DSA indexer) hold one item per KV page: slot run s is item s // G."""
    G = 4
    gen = torch.Generator().manual_seed(5)
    dev = make_device("mla", "layers", L, 6, (1, 40), torch.uint8, "cpu", gen)
    host = make_host("mla", layout, L, 5, 1, (1, 40), torch.uint8, gen, False)
    c = HostCopier(dev, host, io_backend="staged", index_group=G)
    d_items, h_items = torch.tensor([2, 5, 0]), torch.tensor([4, 1, 3])
    ref_host = clone_host(host)
    ref_copy_kv(dev, ref_host, d_items, h_items, d2h=True, layer=None)
    plan = c.plan(pages_to_slots(d_items, G), pages_to_slots(h_items, G), d2h=True, per_layer=False)
    assert plan.issue() == "staged"
    assert_bytes_equal(host.tensor, ref_host.tensor, "host items")


def test_nvtx_range_names_the_staged_path(engine, monkeypatch):
    names: list[str] = []
    monkeypatch.setattr(
        staged_mod, "nvtx_range", lambda name: names.append(name) or contextlib.nullcontext()
    )
    P = 4
    dev, host, _ = _setup("mha", "page_first", P, seed=12)
    c = HostCopier(dev, host, io_backend="staged")
    slots = pages_to_slots(torch.tensor([1, 2]), P)
    c.plan(slots, slots, d2h=False, per_layer=True).issue(2)
    c.plan(slots, slots, d2h=True, per_layer=False).issue()
    layer_bytes = 2 * P * dev.num_buffers * dev.item_bytes
    assert names == [
        copy_range_name(False, "staged", 2, "page_first", layer_bytes),
        copy_range_name(True, "staged", None, "page_first", L * layer_bytes),
    ]
    assert names[0].startswith("kvtier.h2d staged layer2 page_first ")
