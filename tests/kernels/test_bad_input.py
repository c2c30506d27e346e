"""Bad input to the copy kernels raises ValueError naming the argument; nothing moves.

Pool construction errors are tested with the pools, in ``tests/runtime/pools/test_bad_input.py``.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.kernels import DeviceBuffers, HostBuffer, copy_device_to_host, copy_host_to_device
from kvtier.kernels.dispatch import select_impl
from tests.kernels.helpers import as_bytes, clone_host, make_device, make_host

P = 4


@pytest.fixture
def pools(device):
    gen = torch.Generator().manual_seed(0)
    dev = make_device("mha", "stacked", 2, 8 * P, (2, 8), torch.bfloat16, device, gen)
    host = make_host(
        "mha", "page_first", 2, 4 * P, P, (2, 8), torch.bfloat16, gen, device.type == "cuda"
    )
    return dev, host


def slots(*pages, device="cpu"):
    return torch.tensor(
        [p * P + i for p in pages for i in range(P)], dtype=torch.int64, device=device
    )


def expect_untouched(host, before):
    assert torch.equal(as_bytes(host.tensor), as_bytes(before.tensor)), "a failed call wrote data"


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda s, d: (s.to(torch.int32), d), "src_indices: dtype"),
        (lambda s, d: (s, d.to(torch.int32)), "dst_indices: dtype"),
        (lambda s, d: (s, d[:P]), "src_indices has 8 entries but dst_indices has 4"),
        (lambda s, d: (s.view(2, -1), d), "src_indices: must be 1-D"),
        (lambda s, d: (s + 100, d), "src_indices: slot .* outside"),
        (lambda s, d: (s, d + 4 * P), "dst_indices: slot .* outside"),
        (
            lambda s, d: (s - 2, d),
            r"src_indices: slot -2 outside|src_indices: slots .* page-aligned",
        ),
        (lambda s, d: (s + 1, d), "src_indices: slots .* page-aligned"),
        (lambda s, d: (s, d[: P + 1]), "entries"),
        (lambda s, d: (s[::2], d[::2]), "contiguous|page-aligned"),
    ],
    ids=[
        "src-dtype",
        "dst-dtype",
        "count",
        "2d",
        "src-range",
        "dst-range",
        "negative",
        "unaligned",
        "count2",
        "strided",
    ],
)
def test_bad_indices(pools, device, mutate, match):
    dev, host = pools
    before = clone_host(host)
    s, d = mutate(slots(1, 2, device=device), slots(0, 3, device=device))
    with pytest.raises(ValueError, match=match):
        copy_device_to_host(dev, host, s, d)
    expect_untouched(host, before)


def test_page_ids_out_of_range(pools, device):
    dev, host = pools
    with pytest.raises(ValueError, match="dst_indices: page id 4 outside"):
        copy_device_to_host(
            dev,
            host,
            torch.tensor([0], device=device),
            torch.tensor([4], device=device),
            index_unit="page",
        )


def test_h2d_names_its_arguments(pools, device):
    dev, host = pools
    with pytest.raises(ValueError, match="src_indices: slot .* outside"):
        copy_host_to_device(host, dev, slots(7, device=device), slots(0, device=device))
    with pytest.raises(ValueError, match="dst_indices: slot .* outside"):
        copy_host_to_device(host, dev, slots(0, device=device), slots(9, device=device))


def test_index_on_wrong_device(pools):
    dev, host = pools
    wrong = "meta"
    with pytest.raises(ValueError, match="src_indices: on meta"):
        copy_device_to_host(dev, host, slots(1).to(wrong), slots(0).to(dev.device))


def test_layer_out_of_range(pools, device):
    dev, host = pools
    with pytest.raises(ValueError, match="layer: 2 outside"):
        copy_device_to_host(dev, host, slots(1, device=device), slots(0, device=device), layer=2)
    # Not an int: 1.0 failed inside the kernel, True was taken as layer 1.
    for bad in (1.0, True, "1"):
        with pytest.raises(TypeError, match="layer: expected an int or None"):
            copy_host_to_device(
                host, dev, slots(0, device=device), slots(1, device=device), layer=bad
            )


def test_mismatched_pools(device):
    gen = torch.Generator().manual_seed(1)
    dev = make_device("mha", "stacked", 2, 8 * P, (2, 8), torch.bfloat16, device, gen)
    s, d = slots(0, device=device), slots(0, device=device)
    other_dtype = make_host("mha", "layer_first", 2, 4 * P, P, (2, 8), torch.float16, gen, False)
    with pytest.raises(ValueError, match="host: dtype"):
        copy_device_to_host(dev, other_dtype, s, d)
    other_shape = make_host("mha", "layer_first", 2, 4 * P, P, (2, 16), torch.bfloat16, gen, False)
    with pytest.raises(ValueError, match="host: item shape"):
        copy_device_to_host(dev, other_shape, s, d)
    other_layers = make_host("mha", "layer_first", 3, 4 * P, P, (2, 8), torch.bfloat16, gen, False)
    with pytest.raises(ValueError, match="host: 2 buffers x 3 layers"):
        copy_device_to_host(dev, other_layers, s, d)
    mla_host = make_host("mla", "layer_first", 2, 4 * P, P, (2, 8), torch.bfloat16, gen, False)
    with pytest.raises(ValueError, match="host: 1 buffers x 2 layers"):
        copy_device_to_host(dev, mla_host, s, d)


def test_device_buffers_validation():
    a = torch.zeros(8, 2, 4)
    with pytest.raises(ValueError, match=r"layers\[0\]\[1\]: dtype"):
        DeviceBuffers.from_layers([[a, a.half()]])
    with pytest.raises(ValueError, match=r"layers\[1\]\[0\]: shape"):
        DeviceBuffers.from_layers([[a], [torch.zeros(8, 2, 8)]])
    with pytest.raises(ValueError, match=r"layers\[0\]\[1\]: must be contiguous"):
        DeviceBuffers.from_layers([[a, torch.zeros(8, 4, 2).transpose(1, 2)]])
    with pytest.raises(ValueError, match=r"layers\[1\]: 1 layers, expected 2"):
        DeviceBuffers.from_layers([[a, a], [a]])


def test_host_buffer_validation():
    t = torch.zeros(2, 3, 16, 2, 8)
    with pytest.raises(ValueError, match="host: shape .* does not match layout page_first_direct"):
        HostBuffer.create(t, "page_first_direct", 2, 3, 4, (2, 8))
    with pytest.raises(ValueError, match="layout: unknown host layout 'page_head'"):
        HostBuffer.create(t, "page_head", 2, 3, 4, (2, 8))
    with pytest.raises(ValueError, match="host: host tensor must be contiguous"):
        HostBuffer.create(t.transpose(0, 1), "layer_first", 2, 3, 4, (2, 8))


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the pinned-memory check is on the GPU path"
)
def test_unpinned_host_on_gpu_path():
    gen = torch.Generator().manual_seed(2)
    dev = make_device("mha", "stacked", 2, 8 * P, (2, 8), torch.bfloat16, "cuda", gen)
    host = make_host("mha", "layer_first", 2, 4 * P, P, (2, 8), torch.bfloat16, gen, pin=False)
    with pytest.raises(ValueError, match="host: host tensor must be pinned"):
        copy_device_to_host(dev, host, slots(0, device="cuda"), slots(0, device="cuda"))


def test_impl_choice_is_checked():
    with pytest.raises(ValueError, match="impl='triton' needs CUDA"):
        select_impl(torch.device("cpu"), "triton")
    with pytest.raises(ValueError, match="impl: unknown"):
        select_impl(torch.device("cpu"), "cuda-graph")


def test_paths_are_reported(pools, device):
    dev, host = pools
    path = copy_device_to_host(dev, host, slots(0, device=device), slots(1, device=device))
    assert path == ("triton" if device.type == "cuda" else "interpreter")
    path = copy_device_to_host(
        dev, host, slots(0, device=device), slots(1, device=device), impl="torch"
    )
    assert path == "torch"


def test_checks_can_be_skipped_but_default_on(pools, device):
    dev, host = pools
    with pytest.raises(ValueError):
        copy_device_to_host(dev, host, slots(1, device=device) + 1, slots(0, device=device))
    # check=False skips the read-back; a valid call still works
    copy_device_to_host(dev, host, slots(1, device=device), slots(0, device=device), check=False)
