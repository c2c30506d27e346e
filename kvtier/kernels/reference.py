"""Torch references for the copy kernels: the same meaning, written with plain indexing.

Tests compare every kernel with these bit for bit; on CPU without the interpreter the public
functions run them directly.
"""

from __future__ import annotations

import torch

from kvtier.kernels.layout import DeviceBuffers, HostBuffer

__all__ = ["expand_page_ids", "host_byte_view", "ref_copy_kv"]


def expand_page_ids(pages: torch.Tensor, page_size: int) -> torch.Tensor:
    """Page ids ``[n]`` → token slots ``[n * P]``; a ``-1`` page gives ``P`` entries of ``-1``."""
    offs = torch.arange(page_size, device=pages.device, dtype=torch.int64)
    slots = pages[:, None] * page_size + offs
    return torch.where(pages[:, None] >= 0, slots, torch.full_like(slots, -1)).reshape(-1)


def host_byte_view(host: HostBuffer) -> torch.Tensor:
    """``[B, N/P, P, L, item_bytes]`` uint8 view of the buffer (no copy), whatever its strides."""
    raw = host.tensor.view(-1).view(torch.uint8)
    P = host.page_size
    return raw[host.offset :].as_strided(
        (host.num_buffers, host.num_slots // P, P, host.num_layers, host.item_bytes),
        (host.stride_buffer, host.stride_page, host.stride_token, host.stride_layer, 1),
    )


def ref_copy_kv(
    dev: DeviceBuffers,
    host: HostBuffer,
    dev_idx: torch.Tensor,
    host_idx: torch.Tensor,
    *,
    d2h: bool,
    layer: int | None,
    index_unit: str = "token",
) -> None:
    """Copy items between device slots ``dev_idx`` and host slots ``host_idx`` (either way)."""
    P = host.page_size
    if index_unit == "page":
        dev_idx = expand_page_ids(dev_idx, P)
        host_idx = expand_page_ids(host_idx, P)
    keep = (dev_idx >= 0) & (host_idx >= 0)
    hview = host_byte_view(host)
    h = host_idx[keep].to(hview.device)
    hp, ht = h // P, h % P
    layers = range(dev.num_layers) if layer is None else (layer,)
    for b in range(dev.num_buffers):
        for l in layers:
            dview = dev.layers[b][l].view(dev.num_slots, -1).view(torch.uint8)
            d = dev_idx[keep].to(dview.device)
            if d2h:
                hview[b, hp, ht, l] = dview[d].to(hview.device)
            else:
                dview[d] = hview[b, hp, ht, l].to(dview.device)
