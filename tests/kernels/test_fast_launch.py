"""The direct launch of the copy kernel (a cached compiled kernel, without the JIT's per-call
binding): taken from the second call of a pool pair on, bit-exact against the torch reference
for every layout, direction and scope, and left alone while launch hooks are installed.

The direct launch exists on CUDA only; on the CPU (interpreter) the cache must stay empty.
"""

from __future__ import annotations

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


def _entry(dev, host):
    hits = [p for k, p in kv_transfer._PREPARED.items() if k[:2] == (id(dev), id(host))]
    assert len(hits) == 1, hits
    return hits[0]


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
def test_direct_launch_matches_reference(layout, direction, item, monkeypatch):
    device = torch.device("cuda")
    dev, host, gen = _setup(layout, item, 7, device)
    ref_dev, ref_host = clone_device(dev), clone_host(host)
    jit = _count_jit(monkeypatch)
    knobs = TransferKnobs(num_programs=2, tile_bytes=64, num_warps=1)
    d2h = direction == "d2h"
    # Calls of different sizes, layers and scopes: only the first goes through the JIT.
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
        assert _entry(dev, host).compiled is not None, what
    assert jit[0] == 1, f"{jit[0]} launches went through the JIT, expected only the first"


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
