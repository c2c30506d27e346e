"""DSA indexer sidecar pool: per token per layer a 128-byte fp8 key and a 4-byte fp32 scale.

Stored per page as all keys, then all scales (the paged byte layout the indexer's attention
kernels read)::

    page p of layer l: | key t0 | key t1 | ... | key t(P-1) | scale t0 | ... | scale t(P-1) |

The pool has no allocator of its own: it is addressed by the KV pool's pages (page ``p`` holds the
tokens of KV slots ``[p * P, p * P + P)``). Its device and host pools therefore move whole pages,
as raw bytes: the copy kernels see one buffer whose "slot" is a page (``page_size`` 1 for them).
"""

from __future__ import annotations

import torch

from kvtier.runtime.pools.device import DevicePool

__all__ = ["IndexerDevicePool", "kv_slots_to_pages"]


def kv_slots_to_pages(slots: torch.Tensor, page_size: int) -> torch.Tensor:
    """KV token slots in page-aligned runs → page ids (a run of ``-1`` gives ``-1``)."""
    if slots.numel() % page_size:
        raise ValueError(
            f"slots: {slots.numel()} slots is not a whole number of pages of {page_size}"
        )
    runs = slots.view(-1, page_size)
    first = runs[:, 0]
    offs = torch.arange(page_size, device=slots.device, dtype=slots.dtype)
    ok = ((runs == first[:, None] + offs).all(1) & (first % page_size == 0)) | (runs == -1).all(1)
    if not bool(ok.all()):
        raise ValueError(f"slots: not page-aligned runs of {page_size} tokens")
    return torch.where(first >= 0, first // page_size, first)


class IndexerDevicePool(DevicePool):
    """Per layer ``[num_pages, P * (key_bytes + scale_bytes)]`` uint8 on the device."""

    kind = "indexer"

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        key_bytes: int = 128,
        scale_bytes: int = 4,
        device: torch.device | str = "cpu",
    ) -> None:
        if num_layers < 1 or num_pages < 1 or page_size < 1:
            raise ValueError("num_layers, num_pages and page_size must be >= 1")
        self.token_page_size = page_size
        self.key_bytes = key_bytes
        self.scale_bytes = scale_bytes
        page_bytes = page_size * (key_bytes + scale_bytes)
        self.buffer = torch.zeros(
            (num_layers, num_pages, page_bytes), dtype=torch.uint8, device=device
        )
        super().__init__([list(self.buffer.unbind(0))], page_size=1, name="indexer")

    @property
    def page_bytes(self) -> int:
        return self.buffer.shape[-1]

    def keys(self, layer: int) -> torch.Tensor:
        """``[num_pages, P, key_bytes]`` uint8 view of a layer's keys (fp8 bytes)."""
        P = self.token_page_size
        return self.buffer[layer][:, : P * self.key_bytes].view(-1, P, self.key_bytes)

    def scales(self, layer: int) -> torch.Tensor:
        """``[num_pages, P]`` fp32 view of a layer's scales."""
        P = self.token_page_size
        return self.buffer[layer][:, P * self.key_bytes :].view(torch.float32)
