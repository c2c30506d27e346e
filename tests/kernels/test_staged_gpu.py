"""The staged path on a GPU: bit-exact against the torch reference for every layout, direction
and page size, MHA and MLA, per layer and all layers, with a ring small enough to wrap, and a
ring shared by a backup and a load on two streams at once.

Skipped without CUDA or without a copy engine (cuda-bindings, CUDA >= 12.8).
"""

from __future__ import annotations

import pytest
import torch

from kvtier.kernels.copier import HostCopier
from kvtier.kernels.copy_engine import engine_support
from kvtier.kernels.dispatch import RouteReason
from kvtier.kernels.reference import host_byte_view, ref_copy_kv
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

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
_SUPPORT = engine_support(torch.device("cuda"))
if not _SUPPORT.ok:
    pytest.skip(f"no copy engine: {_SUPPORT.reason}", allow_module_level=True)

L = 4
DEV_PAGES = 12
HOST_PAGES = 10


def _item(kind):
    return (8, 128) if kind == "mha" else (1, 576)


def _setup(kind, form, layout, P, seed):
    gen = torch.Generator().manual_seed(seed)
    dev = make_device(kind, form, L, DEV_PAGES * P, _item(kind), torch.bfloat16, "cuda", gen)
    host = make_host(kind, layout, L, HOST_PAGES * P, P, _item(kind), torch.bfloat16, gen, pin=True)
    d = pages_to_slots(pick_pages(DEV_PAGES, 6, gen), P)
    h = pages_to_slots(torch.tensor([7, 8, 9, 2, 3, 5]), P)  # host runs once sorted
    d[:P] = -1  # one skipped run
    return dev, host, d, h


def _poison(dev, host, d, h, d2h):
    keep = (d >= 0) & (h >= 0)
    if d2h:
        hs = h[keep]
        host_byte_view(host)[:, hs // host.page_size, hs % host.page_size] = 0xA5
    else:
        for buf in dev.layers:
            for t in buf:
                t.view(t.shape[0], -1).view(torch.uint8)[d[keep].cuda()] = 0xA5


@pytest.mark.parametrize("ring", ["small", "default"])
@pytest.mark.parametrize("P", [1, 16, 64])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("kind, form", [("mha", "stacked"), ("mha", "layers"), ("mla", "layers")])
@pytest.mark.parametrize("d2h", [True, False], ids=["d2h", "h2d"])
@pytest.mark.parametrize("per_layer", [True, False], ids=["per-layer", "all-layers"])
def test_staged_bit_exact(kind, form, layout, P, d2h, per_layer, ring):
    dev, host, d, h = _setup(kind, form, layout, P, seed=P + len(layout) + d2h)
    _poison(dev, host, d, h, d2h)
    ref_dev, ref_host = clone_device(dev), clone_host(host)
    ref_copy_kv(ref_dev, ref_host, d.cuda(), h.cuda(), d2h=d2h, layer=None)
    B, I = dev.num_buffers, dev.item_bytes
    kw = {"staging_bytes": 2 * (2 * B * P * I)} if ring == "small" else {}
    copier = HostCopier(dev, host, io_backend="staged", **kw)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        plan = copier.plan(d, h, d2h=d2h, per_layer=per_layer)
        if per_layer:
            for layer in range(L):
                plan.issue(layer)
        else:
            plan.issue()
    stream.synchronize()
    assert (plan.route.path, plan.route.reason) == ("staged", RouteReason.FORCED_STAGED)
    assert_bytes_equal(host.tensor, ref_host.tensor, "host")
    assert_bytes_equal(device_bytes(dev), device_bytes(ref_dev), "device")


@pytest.mark.parametrize("layout", ["page_first", "page_first_direct"])
def test_ring_shared_by_two_streams(layout):
    """A backup on one stream and a load on another share a two-slot ring at once: the slot
    events keep either from overwriting a slot the other still reads."""
    P, n = 16, 64
    gen = torch.Generator().manual_seed(11)
    dev = make_device("mha", "stacked", L, 4 * n * P, (8, 128), torch.bfloat16, "cuda", gen)
    host = make_host("mha", layout, L, 4 * n * P, P, (8, 128), torch.bfloat16, gen, pin=True)
    pages = torch.randperm(4 * n, generator=gen)
    d1, d2 = pages_to_slots(pages[:n], P), pages_to_slots(pages[n : 2 * n], P)
    hp = torch.randperm(4 * n, generator=gen)
    h1, h2 = pages_to_slots(hp[:n], P), pages_to_slots(hp[n : 2 * n], P)
    ref_dev, ref_host = clone_device(dev), clone_host(host)
    ref_copy_kv(ref_dev, ref_host, d1.cuda(), h1.cuda(), d2h=True, layer=None)
    ref_copy_kv(ref_dev, ref_host, d2.cuda(), h2.cuda(), d2h=False, layer=None)
    copier = HostCopier(dev, host, io_backend="staged", staging_bytes=2 * 8 * 2 * P * 2048)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    with torch.cuda.stream(s1):
        backup = copier.plan(d1, h1, d2h=True, per_layer=False)
    with torch.cuda.stream(s2):
        load = copier.plan(d2, h2, d2h=False, per_layer=True)
    torch.cuda.synchronize()
    for layer in range(L):  # interleave the two streams' chunks on the ring
        with torch.cuda.stream(s2):
            load.issue(layer)
        if layer == 0:
            with torch.cuda.stream(s1):
                backup.issue()
    torch.cuda.synchronize()
    assert_bytes_equal(host.tensor, ref_host.tensor, "host")
    assert_bytes_equal(device_bytes(dev), device_bytes(ref_dev), "device")


def test_staged_legacy_default_stream_falls_back_to_the_kernel():
    dev, host, d, h = _setup("mha", "layers", "page_first", 16, seed=3)
    ref_host = clone_host(host)
    ref_copy_kv(dev, ref_host, d.cuda(), h.cuda(), d2h=True, layer=None)
    with torch.cuda.stream(torch.cuda.default_stream()):
        plan = HostCopier(dev, host, io_backend="staged").plan(d, h, d2h=True, per_layer=False)
        assert plan.route.reason is RouteReason.LEGACY_STREAM
        assert plan.issue() == "triton"
    torch.cuda.synchronize()
    assert_bytes_equal(host.tensor, ref_host.tensor, "host")


def test_warmup_compiles_without_moving_bytes():
    dev, host, _, _ = _setup("mha", "stacked", "page_first", 16, seed=4)
    before_dev, before_host = device_bytes(dev).clone(), host.tensor.clone()
    copier = HostCopier(dev, host, io_backend="staged")
    copier.warmup()
    torch.cuda.synchronize()
    assert torch.equal(device_bytes(dev), before_dev)
    assert_bytes_equal(host.tensor, before_host, "host")
