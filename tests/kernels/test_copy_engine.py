"""The copy-engine path on the CPU: routes, support probes, descriptors, and the copier.

No GPU here, so the batched copy itself is emulated: each descriptor becomes a ``memmove`` between
CPU tensors. Descriptors are checked twice: against addresses taken from tensor indexing
(``data_ptr`` of the chunk's first element, independent of the byte strides they were built from),
and by running them and comparing the bytes with the torch reference.
"""

from __future__ import annotations

import ctypes
import dataclasses
import types

import numpy as np
import pytest
import torch

from kvtier.kernels import copier as copier_mod
from kvtier.kernels import copy_engine
from kvtier.kernels.copier import HostCopier
from kvtier.kernels.copy_engine import (
    ChunkGeometry,
    LayerEntries,
    build_descriptors,
    engine_support,
    page_runs,
)
from kvtier.kernels.dispatch import CROSSOVERS, Route, RouteReason, check_io_backend, select_route
from kvtier.kernels.reference import ref_copy_kv
from tests.kernels.helpers import (
    as_bytes,
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
DEV_PAGES = 6
HOST_PAGES = 5
LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def _item(kind: str) -> tuple[int, ...]:
    return (2, 8) if kind == "mha" else (1, 24)


def _setup(kind: str, layout: str, P: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    dev = make_device(kind, "layers", L, DEV_PAGES * P, _item(kind), torch.bfloat16, "cpu", gen)
    host = make_host(kind, layout, L, HOST_PAGES * P, P, _item(kind), torch.bfloat16, gen, False)
    return dev, host, gen


def _emulate(dsts, srcs, sizes) -> None:
    """What the copy engine does with a batch, on CPU memory."""
    for d, s, n in zip(dsts, srcs, sizes):
        ctypes.memmove(int(d), int(s), int(n))


def _chunks(src, dst, sizes, chunk):
    """Merged descriptors split back into one (src, dst) pair per chunk."""
    out = set()
    for s, d, n in zip(src.tolist(), dst.tolist(), sizes.tolist()):
        assert n % chunk == 0, f"descriptor of {n} bytes is not whole chunks of {chunk}"
        out.update((s + i * chunk, d + i * chunk) for i in range(n // chunk))
    return out


def _host_chunk_addr(host, kind: str, layout: str, b: int, l: int, page: int) -> int:
    """Address of the first element of host chunk (b, page, l), by tensor indexing."""
    t = host.tensor if kind == "mha" else host.tensor[None]
    P = host.page_size
    if layout == "layer_first":
        return t[b, l, page * P].data_ptr()
    if layout == "page_first":
        return t[b, page * P, l].data_ptr()
    return t[b, page, l, 0].data_ptr()


# -- route selection ---------------------------------------------------------------------------

BIG = 1 << 30


@pytest.mark.parametrize(
    "io_backend, engine_reason, contiguous, legacy, chunk, call, path, reason",
    [
        ("kernel", "", True, False, BIG, BIG, "triton", RouteReason.FORCED_KERNEL),
        ("copy_engine", "", True, False, 2048, 10, "copy_engine", RouteReason.FORCED_ENGINE),
        ("copy_engine", "no cuda-bindings", True, False, BIG, BIG, "triton", RouteReason.NO_ENGINE),
        ("auto", "old driver", True, False, BIG, BIG, "triton", RouteReason.NO_ENGINE),
        ("copy_engine", "", False, False, BIG, BIG, "triton", RouteReason.NOT_CONTIGUOUS),
        ("auto", "", True, True, BIG, BIG, "triton", RouteReason.LEGACY_STREAM),
        ("copy_engine", "", True, True, BIG, BIG, "triton", RouteReason.LEGACY_STREAM),
        ("auto", "", True, False, 2048, BIG, "triton", RouteReason.AUTO_SMALL_CHUNKS),
        ("auto", "", True, False, 32768, 65536, "triton", RouteReason.AUTO_SMALL_TRANSFER),
        ("auto", "", True, False, 32768, BIG, "copy_engine", RouteReason.AUTO_ENGINE),
    ],
    ids=[
        "kernel",
        "forced-engine",
        "forced-no-engine",
        "auto-no-engine",
        "not-contiguous",
        "auto-legacy-stream",
        "forced-legacy-stream",
        "auto-P1-chunks",
        "auto-tiny-call",
        "auto-engine",
    ],
)
@pytest.mark.parametrize("d2h", [True, False], ids=["d2h", "h2d"])
def test_select_route(
    io_backend, engine_reason, contiguous, legacy, chunk, call, path, reason, d2h
):
    r = select_route(
        io_backend,
        kernel_path="triton",
        engine_reason=engine_reason,
        contiguous=contiguous,
        legacy_stream=legacy,
        d2h=d2h,
        chunk_bytes=chunk,
        call_bytes=call,
    )
    assert (r.path, r.reason) == (path, reason), r
    if reason is RouteReason.NO_ENGINE:
        assert r.detail == engine_reason


def test_crossovers_keep_p1_and_tiny_calls_on_the_kernel():
    # A P=1 MHA chunk (8 heads x 128 x bf16) and a one-page call must never reach the engine.
    for x in CROSSOVERS.values():
        assert x.min_chunk_bytes > 8 * 128 * 2
        assert x.min_call_bytes > 16 * 8 * 128 * 2 * 2


@pytest.mark.parametrize(
    "value, exc", [("fast", ValueError), ("Staged", ValueError), (1, TypeError), (None, TypeError)]
)
def test_io_backend_refused(value, exc):
    with pytest.raises(exc, match="io_backend"):
        check_io_backend(value)
    dev, host, _ = _setup("mha", "layer_first", 4, 0)
    with pytest.raises(exc, match="io_backend"):
        HostCopier(dev, host, io_backend=value)


# -- support probes (fallback reasons) ---------------------------------------------------------


def _fake_cudart(driver: int = 13000, runtime: int = 13000, batch: bool = True):
    mod = types.SimpleNamespace(
        cudaDriverGetVersion=lambda: (0, driver),
        cudaRuntimeGetVersion=lambda: (0, runtime),
    )
    if batch:
        mod.cudaMemcpyBatchAsync = lambda *a: (0,)
    return mod


def test_support_needs_cuda():
    s = engine_support(torch.device("cpu"))
    assert not s.ok and "no CUDA" in s.reason


def test_support_without_cuda_bindings(monkeypatch):
    def missing():
        raise ImportError("No module named 'cuda'")

    monkeypatch.setattr(copy_engine, "_import_cudart", missing)
    s = engine_support(torch.device("cuda"))
    assert not s.ok and "cuda-bindings is not installed" in s.reason


@pytest.mark.parametrize(
    "fake, words",
    [
        (dict(driver=12040), "driver is 12.4"),
        (dict(runtime=12060), "runtime is 12.6"),
        (dict(batch=False), "no cudaMemcpyBatchAsync"),
    ],
    ids=["old-driver", "old-runtime", "old-bindings"],
)
def test_support_refuses_old_cuda(monkeypatch, fake, words):
    monkeypatch.setattr(copy_engine, "_import_cudart", lambda: _fake_cudart(**fake))
    s = engine_support(torch.device("cuda"))
    assert not s.ok and words in s.reason, s


def test_support_ok_at_12_8(monkeypatch):
    monkeypatch.setattr(copy_engine, "_import_cudart", lambda: _fake_cudart(12080, 12080))
    assert engine_support(torch.device("cuda")).ok


def test_legacy_stream_refused():
    with pytest.raises(ValueError, match="legacy default stream"):
        copy_engine.memcpy_batch([1], [2], [3], 0)


def test_copier_falls_back_with_reason(monkeypatch):
    monkeypatch.setattr(copy_engine, "_import_cudart", lambda: _fake_cudart(driver=12020))
    dev, host, gen = _setup("mha", "layer_first", 4, 1)
    c = HostCopier(dev, host, io_backend="copy_engine")
    slots = pages_to_slots(pick_pages(DEV_PAGES, 2, gen), 4)
    plan = c.plan(slots, slots, d2h=True, per_layer=False)
    assert plan.route.path in ("interpreter", "torch")
    assert plan.route.reason is RouteReason.NO_ENGINE
    assert "no CUDA" in plan.route.detail  # the device pool is on the CPU


# -- descriptors -------------------------------------------------------------------------------


@pytest.mark.parametrize("P", [1, 16, 64])
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("d2h", [True, False], ids=["d2h", "h2d"])
@pytest.mark.parametrize("per_layer", [True, False], ids=["per-layer", "all-layers"])
def test_descriptors_match_tensor_addresses(kind, layout, P, d2h, per_layer):
    dev, host, gen = _setup(kind, layout, P, seed=P)
    geom = ChunkGeometry.of(dev, host)
    d_pages = pick_pages(DEV_PAGES, 4, gen).numpy()
    h_pages = pick_pages(HOST_PAGES, 4, gen).numpy()
    d_pages[1] = -1  # skipped on the device side
    h_pages[2] = -1  # and on the host side
    layers = range(L)
    if not geom.contiguous:
        assert layout == "page_first" and P > 1
        with pytest.raises(ValueError, match="not contiguous"):
            build_descriptors(geom, d_pages, h_pages, d2h=d2h, layers=layers, per_layer=per_layer)
        return
    desc = build_descriptors(geom, d_pages, h_pages, d2h=d2h, layers=layers, per_layer=per_layer)
    B = dev.num_buffers
    chunk = P * dev.item_bytes
    groups = [[l] for l in layers] if per_layer else [list(layers)]
    assert len(desc.offsets) == len(groups) + 1
    for g, group in enumerate(groups):
        want = set()
        for l in group:
            for b in range(B):
                for dp, hp in zip(d_pages.tolist(), h_pages.tolist()):
                    if dp < 0 or hp < 0:
                        continue
                    da = dev.layers[b][l][dp * P].data_ptr()
                    ha = _host_chunk_addr(host, kind, layout, b, l, hp)
                    want.add((da, ha) if d2h else (ha, da))
        src, dst, sizes = desc.group(g)
        got = _chunks(src, dst, sizes, chunk)
        assert got == want, f"group {g}: {len(got ^ want)} chunks differ"
    assert desc.nbytes == 2 * B * L * chunk  # two of the four pairs are whole


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_adjacent_pages_merge(layout):
    dev, host, _ = _setup("mha", layout, 16, 3)
    geom = ChunkGeometry.of(dev, host)
    d_pages, h_pages = np.array([1, 2, 3]), np.array([0, 1, 2])
    desc = build_descriptors(geom, d_pages, h_pages, d2h=True, layers=range(L), per_layer=True)
    chunk = 16 * dev.item_bytes
    # layer_first keeps a layer's pages adjacent on the host: one range per (layer, buffer).
    # page_first_direct puts the other layers between them: one range per chunk.
    per_group = 2 if layout == "layer_first" else 2 * 3
    assert np.all(np.diff(desc.offsets) == per_group)
    assert desc.nbytes == 3 * 2 * L * chunk
    if layout == "layer_first":
        assert set(desc.sizes.tolist()) == {3 * chunk}


def _naive_descriptors(geom, dev_pages, host_pages, d2h, layers, per_layer):
    """One entry per (layer, buffer, page) chunk in that order, then every entry that continues
    the previous one on both sides merged into it, never across groups."""
    groups = [[l] for l in layers] if per_layer else [list(layers)]
    out = []
    for group in groups:
        entries: list[list[int]] = []
        for l in group:
            for b in range(geom.num_buffers):
                for d, h in zip(dev_pages.tolist(), host_pages.tolist()):
                    if d < 0 or h < 0:
                        continue
                    da = int(geom.dev_addr[b, l]) + d * geom.chunk_bytes
                    ha = (
                        geom.host_addr
                        + l * geom.stride_layer
                        + b * geom.stride_buffer
                        + h * geom.stride_page
                    )
                    s, t = (da, ha) if d2h else (ha, da)
                    if (
                        entries
                        and entries[-1][0] + entries[-1][2] == s
                        and (entries[-1][1] + entries[-1][2] == t)
                    ):
                        entries[-1][2] += geom.chunk_bytes
                    else:
                        entries.append([s, t, geom.chunk_bytes])
        out.append(entries)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_descriptors_equal_the_naive_build(seed):
    """Runs first, then buffers and layers: the same descriptors, in the same order, as one
    entry per chunk merged afterwards. Synthetic geometries (addresses only, nothing copied):
    random strides, device tensors that touch (one buffer's or layer's end the next one's
    start) or not, random pages, runs through the pool's end, skips, layer subsets, both
    directions, per layer or whole."""
    rng = np.random.default_rng(seed)
    pages = 8
    for trial in range(80):
        B, L_ = int(rng.integers(1, 3)), int(rng.integers(1, 4))
        c = int(rng.choice([16, 64]))
        stride_page = int(rng.choice([c, 2 * c, L_ * c]))
        if rng.random() < 0.5:  # one allocation, [B, L, pages] of chunks: tensors touch
            addr = [[(1 << 20) + (b * L_ + l) * pages * c for l in range(L_)] for b in range(B)]
        else:
            addr = [[(1 << 20) * (1 + b * L_ + l) for l in range(L_)] for b in range(B)]
        geom = ChunkGeometry(
            dev_addr=np.array(addr, dtype=np.int64),
            host_addr=1 << 40,
            stride_buffer=int(rng.choice([L_ * pages * stride_page, pages * c])),
            stride_page=stride_page,
            stride_layer=int(rng.choice([pages * stride_page, c])),
            chunk_bytes=c,
            page_size=1,
            contiguous=True,
        )
        n = int(rng.integers(0, pages + 1))
        if trial % 2:  # consecutive on both sides, through the pool's end
            d_pages, h_pages = np.arange(pages - n, pages), np.arange(n)
        else:
            d_pages, h_pages = rng.permutation(pages)[:n], rng.permutation(pages)[:n]
        if n and trial % 3 == 0:
            d_pages[int(rng.integers(0, n))] = -1
        layers = list(range(L_)) if trial % 4 else list(rng.permutation(L_))
        for d2h in (True, False):
            for per_layer in (True, False):
                got = build_descriptors(
                    geom, d_pages, h_pages, d2h=d2h, layers=layers, per_layer=per_layer
                )
                want = _naive_descriptors(geom, d_pages, h_pages, d2h, layers, per_layer)
                assert len(got.offsets) == len(want) + 1
                for g, entries in enumerate(want):
                    src, dst, sizes = got.group(g)
                    rows = [list(x) for x in zip(src.tolist(), dst.tolist(), sizes.tolist())]
                    assert rows == entries, (trial, d2h, per_layer, g)
                if not per_layer:
                    continue
                # The Python build of one layer's call (a load of few runs): the same.
                entries_of = LayerEntries(geom, page_runs(geom, d_pages, h_pages), d2h=d2h)
                for layer, entries in zip(layers, want):
                    dst, src, sizes, nbytes = entries_of(int(layer))
                    assert all(a.dtype == np.int64 for a in (dst, src, sizes))
                    rows = [list(x) for x in zip(src.tolist(), dst.tolist(), sizes.tolist())]
                    assert rows == entries and nbytes == sum(e[2] for e in entries), (trial, d2h)


@pytest.mark.parametrize("B, L_, per_layer", [(1, 3, False), (2, 1, True), (2, 1, False)])
def test_descriptors_merge_across_touching_tensors(B, L_, per_layer):
    """Whole pools of one allocation ([B, L, pages] of chunks on both sides): every layer and
    buffer of a group continues the one before, so each group is one descriptor."""
    pages, c = 8, 64
    geom = ChunkGeometry(
        dev_addr=np.array(
            [[(1 << 20) + (b * L_ + l) * pages * c for l in range(L_)] for b in range(B)],
            dtype=np.int64,
        ),
        host_addr=1 << 40,
        stride_buffer=L_ * pages * c,
        stride_page=c,
        stride_layer=pages * c,
        chunk_bytes=c,
        page_size=1,
        contiguous=True,
    )
    all_pages = np.arange(pages)
    desc = build_descriptors(
        geom, all_pages, all_pages, d2h=True, layers=range(L_), per_layer=per_layer
    )
    groups = L_ if per_layer else 1
    assert np.all(np.diff(desc.offsets) == 1) and len(desc.offsets) == groups + 1
    assert desc.sizes.tolist() == [B * L_ * pages * c // groups] * groups
    if per_layer:  # the Python build of a layer's call merges them alike
        entries_of = LayerEntries(geom, page_runs(geom, all_pages, all_pages), d2h=True)
        for layer in range(L_):
            dst, src, sizes, nbytes = entries_of(layer)
            assert sizes.tolist() == [B * pages * c] == [nbytes]
            assert (src.tolist(), dst.tolist()) == ([geom.dev_addr[0, layer]], [geom.host_addr])


@pytest.mark.parametrize("P", [1, 16, 64])
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_layer_descriptor_count_bounds_the_built_one(kind, layout, P):
    """The route's count (no descriptors built) is never below what the build gives a layer,
    and equals it for these pools (their buffers never touch): random pages, runs, skips."""
    dev, host, gen = _setup(kind, layout, P, seed=11 + P)
    geom = ChunkGeometry.of(dev, host)
    for trial in range(12):
        n = 1 + trial % 4
        d_pages = pick_pages(DEV_PAGES, n, gen).numpy()
        h_pages = pick_pages(HOST_PAGES, n, gen).numpy()
        if trial % 3 == 0:  # consecutive on both sides: runs merge
            d_pages, h_pages = np.arange(n) + 1, np.arange(n)
        if trial % 4 == 1:
            d_pages[0] = -1
        desc = build_descriptors(geom, d_pages, h_pages, d2h=False, layers=range(L), per_layer=True)
        built = int(np.diff(desc.offsets).max())
        assert copy_engine.layer_descriptors(geom, d_pages, h_pages) == built, (d_pages, h_pages)


@pytest.mark.parametrize("P", [1, 16, 64])
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
@pytest.mark.parametrize("d2h", [True, False], ids=["d2h", "h2d"])
def test_emulated_batches_equal_reference(kind, layout, P, d2h):
    dev, host, gen = _setup(kind, layout, P, seed=7 + P)
    d_pages = pick_pages(DEV_PAGES, 4, gen)
    h_pages = pick_pages(HOST_PAGES, 4, gen)
    d_pages[0] = -1
    d_slots, h_slots = pages_to_slots(d_pages, P), pages_to_slots(h_pages, P)
    d_slots[:P] = -1  # a skipped run
    ref_dev, ref_host = clone_device(dev), clone_host(host)
    ref_copy_kv(ref_dev, ref_host, d_slots, h_slots, d2h=d2h, layer=None)
    desc = build_descriptors(
        ChunkGeometry.of(dev, host),
        d_pages.numpy(),
        h_pages.numpy(),
        d2h=d2h,
        layers=range(L),
        per_layer=True,
    )
    for g in range(L):
        src, dst, sizes = desc.group(g)
        _emulate(dst, src, sizes)
    assert_bytes_equal(host.tensor, ref_host.tensor, "host")
    assert_bytes_equal(device_bytes(dev), device_bytes(ref_dev), "device")


# -- the copier's engine route, emulated -------------------------------------------------------


@pytest.fixture
def emulated_engine(monkeypatch):
    """The copy engine 'available' on the CPU: batches run as memmoves, calls are recorded."""
    calls = []

    def batch(dsts, srcs, sizes, stream):
        calls.append(len(sizes))
        _emulate(dsts, srcs, sizes)

    monkeypatch.setattr(
        copier_mod, "engine_support", lambda device: copy_engine.EngineSupport(True)
    )
    monkeypatch.setattr(copier_mod, "memcpy_batch", batch)
    return calls


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
@pytest.mark.parametrize("kind", ["mha", "mla"])
def test_copier_engine_route(emulated_engine, kind, layout):
    P = 16
    dev, host, gen = _setup(kind, layout, P, seed=11)
    c = HostCopier(dev, host, io_backend="copy_engine")
    d_slots = pages_to_slots(pick_pages(DEV_PAGES, 3, gen), P)
    h_slots = pages_to_slots(pick_pages(HOST_PAGES, 3, gen), P)
    ref_dev, ref_host = clone_device(dev), clone_host(host)

    ref_copy_kv(ref_dev, ref_host, d_slots, h_slots, d2h=True, layer=None)
    plan = c.plan(d_slots, h_slots, d2h=True, per_layer=False)
    assert plan.route.reason is RouteReason.FORCED_ENGINE
    assert plan.issue() == "copy_engine"
    assert emulated_engine == [plan_len := emulated_engine[0]] and plan_len > 0  # one call
    assert_bytes_equal(host.tensor, ref_host.tensor, "host after backup")

    # Load back into other device pages, layer by layer: one call per layer, and each call
    # brings exactly its layer.
    emulated_engine.clear()
    d2 = pages_to_slots(pick_pages(DEV_PAGES, 3, gen), P)
    ref_copy_kv(ref_dev, ref_host, d2, h_slots, d2h=False, layer=None)
    plan = c.plan(d2, h_slots, d2h=False, per_layer=True)
    for l in range(L):
        before = [as_bytes(t).clone() for buf in dev.layers for t in buf]  # bytes: NaNs too
        plan.issue(l)
        after = [as_bytes(t) for buf in dev.layers for t in buf]
        changed = {i % L for i, (x, y) in enumerate(zip(before, after)) if not torch.equal(x, y)}
        assert changed == {l}, f"issue({l}) changed layers {sorted(changed)}"
    assert len(emulated_engine) == L
    assert_bytes_equal(device_bytes(dev), device_bytes(ref_dev), "device after load")
    with pytest.raises(ValueError, match="per layer"):
        plan.issue()


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_copier_lead_layer_goes_through_the_kernel(emulated_engine, monkeypatch, layout):
    """Under auto, a per-layer load planned with ``lead=True`` carries a kernel plan of the same copy: the
    first layer a load issues goes through it (no batch call), the others through the engine,
    and the bytes equal the reference. Backups and whole-copy plans get no lead."""
    monkeypatch.setitem(
        CROSSOVERS, "h2d", dataclasses.replace(CROSSOVERS["h2d"], inline_descriptors=0)
    )
    P = 16
    dev, host, gen = _setup("mha", layout, P, seed=12)
    forced = HostCopier(dev, host, io_backend="copy_engine")
    c = HostCopier(dev, host, io_backend="auto")
    # auto takes the copy engine for these (tiny) calls
    c.route = lambda **kw: Route("copy_engine", RouteReason.AUTO_ENGINE)
    d_slots = pages_to_slots(pick_pages(DEV_PAGES, 3, gen), P)
    h_slots = pages_to_slots(pick_pages(HOST_PAGES, 3, gen), P)
    ref_dev, ref_host = clone_device(dev), clone_host(host)
    ref_copy_kv(ref_dev, ref_host, d_slots, h_slots, d2h=False, layer=None)
    plan = c.plan(d_slots, h_slots, d2h=False, per_layer=True, lead=True)
    assert plan.route.path == "copy_engine" and plan.lead is not None
    assert plan.lead.route.reason is RouteReason.LEAD_LAYER
    assert plan.lead.route.path == c.kernel_path
    assert all(any(t is k for k in plan.keep) for t in plan.lead.keep)  # kept alive with it
    before = [as_bytes(t).clone() for buf in dev.layers for t in buf]
    assert plan.lead.issue(1) == c.kernel_path
    after = [as_bytes(t) for buf in dev.layers for t in buf]
    changed = {i % L for i, (x, y) in enumerate(zip(before, after)) if not torch.equal(x, y)}
    assert changed == {1} and emulated_engine == []
    for layer in (0, 2):
        plan.issue(layer)
    assert len(emulated_engine) == 2
    assert_bytes_equal(device_bytes(dev), device_bytes(ref_dev), "device after the load")
    assert c.plan(d_slots, h_slots, d2h=True, per_layer=True, lead=True).lead is None
    assert c.plan(d_slots, h_slots, d2h=False, per_layer=False, lead=True).lead is None
    assert c.plan(d_slots, h_slots, d2h=False, per_layer=True).lead is None
    # A forced copy engine takes no SMs: no lead.
    assert forced.plan(d_slots, h_slots, d2h=False, per_layer=True, lead=True).lead is None


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct"])
def test_few_descriptors_take_no_kernel_lead(emulated_engine, monkeypatch, layout):
    """A load whose largest call has at most ``inline_descriptors`` descriptors gets no kernel
    lead: ``plan_lead`` gives None and the plan has none, every layer goes through the engine,
    and the bytes equal the reference. One descriptor more than the limit: a lead again."""
    P = 16
    dev, host, gen = _setup("mha", layout, P, seed=13)
    c = HostCopier(dev, host, io_backend="auto")
    c.route = lambda **kw: Route("copy_engine", RouteReason.AUTO_ENGINE)
    d_slots = pages_to_slots(pick_pages(DEV_PAGES, 3, gen), P)
    h_slots = pages_to_slots(pick_pages(HOST_PAGES, 3, gen), P)
    most = copy_engine.layer_descriptors(
        c.geometry, d_slots.numpy()[::P] // P, h_slots.numpy()[::P] // P
    )
    assert most >= 2

    def limit(n: int) -> None:
        x = dataclasses.replace(CROSSOVERS["h2d"], inline_descriptors=n)
        monkeypatch.setitem(CROSSOVERS, "h2d", x)

    limit(most - 1)
    assert c.plan_lead(d_slots, h_slots) is not None
    assert c.plan(d_slots, h_slots, d2h=False, per_layer=True, lead=True).lead is not None
    limit(most)
    assert c.plan_lead(d_slots, h_slots) is None
    plan = c.plan(d_slots, h_slots, d2h=False, per_layer=True, lead=True)
    assert plan.route.path == "copy_engine" and plan.lead is None
    ref_dev, ref_host = clone_device(dev), clone_host(host)
    ref_copy_kv(ref_dev, ref_host, d_slots, h_slots, d2h=False, layer=None)
    for layer in range(L):
        plan.issue(layer)
    assert emulated_engine == [most] * L
    assert_bytes_equal(device_bytes(dev), device_bytes(ref_dev), "device after the load")


def test_plan_reuses_plan_leads_counts_for_the_same_indices_only(emulated_engine, monkeypatch):
    """An inline load's ``plan_lead`` works out its page ids and descriptor count once; the
    ``plan`` right after it with the same index tensors reuses them (one ``_pair``, one
    count), and one with other tensors (or after another call consumed them) works its own
    out: the bytes equal the reference."""
    P = 16
    dev, host, gen = _setup("mha", "layer_first", P, seed=14)
    c = HostCopier(dev, host, io_backend="auto")
    c.route = lambda **kw: Route("copy_engine", RouteReason.AUTO_ENGINE)
    pairs, counts = [], []
    pair, count = HostCopier._pair, copier_mod.page_runs
    monkeypatch.setattr(HostCopier, "_pair", lambda self, d, h: pairs.append(1) or pair(self, d, h))
    monkeypatch.setattr(copier_mod, "page_runs", lambda *a: counts.append(1) or count(*a))

    def slots():
        d = pages_to_slots(pick_pages(DEV_PAGES, 2, gen), P)
        return d, pages_to_slots(pick_pages(HOST_PAGES, 2, gen), P)

    (d1, h1), (d2, h2) = slots(), slots()
    assert not torch.equal(d1, d2) or not torch.equal(h1, h2)
    for lead_of, planned, n_pairs in (((d1, h1), (d1, h1), 1), ((d1, h1), (d2, h2), 2)):
        pairs.clear()
        counts.clear()
        ref_dev, ref_host = clone_device(dev), clone_host(host)
        ref_copy_kv(ref_dev, ref_host, *planned, d2h=False, layer=None)
        assert c.plan_lead(*lead_of) is None
        plan = c.plan(*planned, d2h=False, per_layer=True, lead=True)
        for layer in range(L):
            plan.issue(layer)
        assert len(pairs) == n_pairs and len(counts) == n_pairs
        assert_bytes_equal(device_bytes(dev), device_bytes(ref_dev), "device after the load")
    pairs.clear()
    c.plan_lead(d1, h1)
    c.plan(d2, h2, d2h=False, per_layer=True)  # consumes the counts of (d1, h1) unused
    c.plan(d1, h1, d2h=False, per_layer=True)
    assert len(pairs) == 3


def test_plan_after_plan_lead_sees_indices_rewritten_in_place(emulated_engine):
    """``plan_lead(d, h)`` finds the load inline, the caller rewrites ``d`` in place, then
    ``plan(d, h)``: the plan copies to the slots ``d`` names now (helper 70)."""
    P = 16
    dev, host, _ = _setup("mha", "layer_first", P, seed=21)
    c = HostCopier(dev, host, io_backend="auto")
    c.route = lambda **kw: Route("copy_engine", RouteReason.AUTO_ENGINE)
    d = pages_to_slots(torch.tensor([0, 1]), P).clone()
    h = pages_to_slots(torch.tensor([2, 3]), P)
    assert c.plan_lead(d, h) is None
    d.copy_(pages_to_slots(torch.tensor([4, 2]), P))  # the same tensor, other pages
    ref_dev, ref_host = clone_device(dev), clone_host(host)
    ref_copy_kv(ref_dev, ref_host, d, h, d2h=False, layer=None)
    plan = c.plan(d, h, d2h=False, per_layer=True)
    for layer in range(L):
        plan.issue(layer)
    assert_bytes_equal(device_bytes(dev), device_bytes(ref_dev), "device after the load")


def test_copier_index_group(emulated_engine):
    """Sidecar pools (the DSA indexer) hold one item per KV page: slot run s is item s // G."""
    G = 4
    gen = torch.Generator().manual_seed(5)
    dev = make_device("mla", "layers", L, 6, (1, 40), torch.uint8, "cpu", gen)
    host = make_host("mla", "page_first_direct", L, 5, 1, (1, 40), torch.uint8, gen, False)
    c = HostCopier(dev, host, io_backend="copy_engine", index_group=G)
    d_items, h_items = torch.tensor([2, 5, 0]), torch.tensor([4, 1, 3])
    ref_host = clone_host(host)
    ref_copy_kv(dev, ref_host, d_items, h_items, d2h=True, layer=None)
    c.plan(
        pages_to_slots(d_items, G), pages_to_slots(h_items, G), d2h=True, per_layer=False
    ).issue()
    assert_bytes_equal(host.tensor, ref_host.tensor, "host items")
    with pytest.raises(ValueError, match="runs of 4"):
        c.plan(torch.arange(6), torch.arange(6), d2h=True, per_layer=False)


def test_copier_refuses_device_indices():
    dev, host, _ = _setup("mha", "layer_first", 4, 2)
    c = HostCopier(dev, host, io_backend="kernel")
    with pytest.raises(ValueError, match="dev_idx"):
        c.plan(torch.arange(4, dtype=torch.int32), torch.arange(4), d2h=True, per_layer=False)
    with pytest.raises(TypeError, match="host_idx"):
        c.plan(torch.arange(4), [0, 1, 2, 3], d2h=True, per_layer=False)


def test_direct_entry_needs_a_cuda13_runtime(monkeypatch):
    """The ctypes call is used only with torch's CUDA runtime >= 13 (the 13.x signature)."""
    monkeypatch.setenv("KVTIER_COPY_ENGINE_DIRECT", "0")
    fn, how = copy_engine._direct_entry()
    assert fn is None and "KVTIER_COPY_ENGINE_DIRECT=0" in how
    monkeypatch.delenv("KVTIER_COPY_ENGINE_DIRECT")
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    fn, how = copy_engine._direct_entry()
    assert fn is None and "12.8" in how


# -- the issue worker --------------------------------------------------------------------------


def test_issue_worker_runs_jobs_in_order_and_wakes_waiters_per_step():
    worker = copier_mod.IssueWorker()
    log: list[tuple[str, int]] = []
    gate = copier_mod.threading.Event()

    def job(name: str, steps: int, hold: bool):
        def run(ticket):
            for i in range(steps):
                if hold and i == 1:
                    gate.wait()  # step 1 waits: a waiter for step 1 must not return early
                log.append((name, i))
                ticket.advance()

        return run

    a = worker.submit(job("a", 3, hold=True), 3)
    b = worker.submit(job("b", 2, hold=False), 2)
    a.wait(1)
    assert log == [("a", 0)] and not a.done() and not b.done()
    gate.set()
    b.wait()
    assert a.done() and b.done()
    assert log == [("a", 0), ("a", 1), ("a", 2), ("b", 0), ("b", 1)]


def test_issue_worker_hands_errors_to_waiters():
    worker = copier_mod.IssueWorker()

    def bad(ticket):
        ticket.advance()
        raise OSError("driver said no")

    t = worker.submit(bad, 3)
    with pytest.raises(RuntimeError, match="could not be enqueued") as info:
        t.wait(2)
    assert isinstance(info.value.__cause__, OSError)
    with pytest.raises(RuntimeError):
        t.done()
    ok = worker.submit(lambda ticket: ticket.advance(), 1)  # the worker lives on
    ok.wait()


@pytest.mark.parametrize(
    "dev_slots, host_slots, words",
    [
        (list(range(4)), [0, 1, 2, 99], "host_idx: item 99 outside"),
        ([1, 2, 3, 4], list(range(4)), "dev_idx: items [1, 2, 3, 4]... at page 0"),
        ([0, 1, 2, -1], list(range(4)), "dev_idx: items [0, 1, 2, -1]"),
        (list(range(6)), list(range(6)), "not a whole number of pages"),
    ],
    ids=["range", "misaligned", "half-skipped", "partial-page"],
)
def test_copier_checks_indices(dev_slots, host_slots, words):
    dev, host, _ = _setup("mha", "layer_first", 4, 4)
    c = HostCopier(dev, host, io_backend="kernel")
    d, h = torch.tensor(dev_slots), torch.tensor(host_slots)
    with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
        c.plan(d, h, d2h=True, per_layer=False, check=True)


@pytest.mark.parametrize("group, exc", [(0, ValueError), (True, TypeError), (2.0, TypeError)])
def test_copier_refuses_bad_index_group(group, exc):
    dev, host, _ = _setup("mha", "layer_first", 4, 4)
    with pytest.raises(exc, match="index_group"):
        HostCopier(dev, host, index_group=group)
