"""The copy-engine path on a GPU: bit-exact against the torch reference for every layout,
direction and page size, MHA and MLA, and the fallbacks that need a real stream.

Skipped without CUDA or without a copy engine (cuda-bindings, CUDA >= 12.8).
"""

from __future__ import annotations

import pytest
import torch

from kvtier.kernels.copier import HostCopier
from kvtier.kernels.copy_engine import engine_support
from kvtier.kernels.dispatch import RouteReason
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

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)
_SUPPORT = engine_support(torch.device("cuda"))
if not _SUPPORT.ok:
    pytest.skip(f"no copy engine: {_SUPPORT.reason}", allow_module_level=True)

L = 4
DEV_PAGES = 12
HOST_PAGES = 10


def _setup(kind, form, layout, P, seed):
    gen = torch.Generator().manual_seed(seed)
    item = (8, 128) if kind == "mha" else (1, 576)
    dev = make_device(kind, form, L, DEV_PAGES * P, item, torch.bfloat16, "cuda", gen)
    host = make_host(kind, layout, L, HOST_PAGES * P, P, item, torch.bfloat16, gen, pin=True)
    d = pages_to_slots(pick_pages(DEV_PAGES, 6, gen), P)
    h = pages_to_slots(pick_pages(HOST_PAGES, 6, gen), P)
    d[:P] = -1  # one skipped run
    return dev, host, d, h


@pytest.mark.parametrize("P", [1, 16, 64])
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
@pytest.mark.parametrize("kind, form", [("mha", "stacked"), ("mha", "layers"), ("mla", "layers")])
@pytest.mark.parametrize("d2h", [True, False], ids=["d2h", "h2d"])
@pytest.mark.parametrize("per_layer", [True, False], ids=["per-layer", "all-layers"])
def test_copy_engine_bit_exact(kind, form, layout, P, d2h, per_layer):
    dev, host, d, h = _setup(kind, form, layout, P, seed=P + len(layout))
    ref_dev, ref_host = clone_device(dev), clone_host(host)
    ref_copy_kv(ref_dev, ref_host, d.cuda(), h.cuda(), d2h=d2h, layer=None)
    copier = HostCopier(dev, host, io_backend="copy_engine")
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        plan = copier.plan(d, h, d2h=d2h, per_layer=per_layer)
        if per_layer:
            for layer in range(L):
                plan.issue(layer)
        else:
            plan.issue()
    stream.synchronize()
    if layout == "page_first" and P > 1:
        assert plan.route.reason is RouteReason.NOT_CONTIGUOUS and plan.route.path == "triton"
    else:
        assert plan.route.path == "copy_engine", plan.route
    assert_bytes_equal(host.tensor, ref_host.tensor, "host")
    assert_bytes_equal(device_bytes(dev), device_bytes(ref_dev), "device")


def test_legacy_default_stream_falls_back_to_the_kernel():
    dev, host, d, h = _setup("mha", "layers", "layer_first", 16, seed=3)
    ref_host = clone_host(host)
    ref_copy_kv(dev, ref_host, d.cuda(), h.cuda(), d2h=True, layer=None)
    with torch.cuda.stream(torch.cuda.default_stream()):
        plan = HostCopier(dev, host, io_backend="copy_engine").plan(d, h, d2h=True, per_layer=False)
        assert plan.route.reason is RouteReason.LEGACY_STREAM
        assert plan.issue() == "triton"
    torch.cuda.synchronize()
    assert_bytes_equal(host.tensor, ref_host.tensor, "host")
