"""Shared builders for kernel tests: random pools, poisoned destinations, readable mismatches."""

from __future__ import annotations

import torch

from kvtier.kernels.layout import DeviceBuffers, HostBuffer, host_shape

DTYPES = {
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp32": torch.float32,
    "fp8": torch.float8_e4m3fn,
}


def random_bytes(shape, dtype: torch.dtype, device, gen: torch.Generator) -> torch.Tensor:
    """A tensor of ``dtype`` whose bytes are uniformly random (NaN payloads included)."""
    elem = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * elem,), dtype=torch.uint8, generator=gen)
    return raw.view(dtype).view(shape).to(device)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1).view(torch.uint8).cpu()


def assert_bytes_equal(tri: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    a, b = as_bytes(tri), as_bytes(ref)
    assert a.shape == b.shape, f"{what}: {a.shape} vs {b.shape}"
    if not torch.equal(a, b):
        i = int((a != b).nonzero()[0, 0])
        n = int((a != b).sum())
        raise AssertionError(f"{what}: {n} bytes differ, first at byte {i}: tri={a[i]} ref={b[i]}")


def make_device(kind: str, form: str, L: int, slots: int, item: tuple, dtype, device, gen):
    """``B x L`` per-layer tensors: stacked views of one allocation, or separate tensors."""
    B = 2 if kind == "mha" else 1
    if form == "stacked":
        bufs = [random_bytes((L, slots, *item), dtype, device, gen) for _ in range(B)]
        layers = [list(b.unbind(0)) for b in bufs]
    else:
        layers = [
            [random_bytes((slots, *item), dtype, device, gen) for _ in range(L)] for _ in range(B)
        ]
    return DeviceBuffers.from_layers(layers)


def make_host(
    kind: str, layout: str, L: int, slots: int, P: int, item: tuple, dtype, gen, pin: bool
):
    B = 2 if kind == "mha" else 1
    t = random_bytes(host_shape(layout, B, L, slots, P, item), dtype, "cpu", gen)
    if pin:
        t = t.pin_memory()
    return HostBuffer.create(t, layout, B, L, P, item)


def clone_device(dev: DeviceBuffers) -> DeviceBuffers:
    return DeviceBuffers.from_layers([[t.clone() for t in buf] for buf in dev.layers])


def clone_host(host: HostBuffer) -> HostBuffer:
    t = host.tensor.clone()
    if host.tensor.is_pinned():
        t = t.pin_memory()
    return HostBuffer.create(
        t, host.layout, host.num_buffers, host.num_layers, host.page_size, host.item_shape
    )


def device_bytes(dev: DeviceBuffers) -> torch.Tensor:
    return torch.cat([as_bytes(t) for buf in dev.layers for t in buf])


def pick_pages(n_pages_pool: int, n: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randperm(n_pages_pool, generator=gen)[:n]


def pages_to_slots(pages: torch.Tensor, P: int) -> torch.Tensor:
    return (pages[:, None] * P + torch.arange(P)).reshape(-1)
