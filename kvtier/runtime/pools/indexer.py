"""DSA indexer sidecar pool: per token per layer a 128-byte fp8 key and a 4-byte fp32 scale.

One instance of a sidecar (:mod:`kvtier.runtime.pools.sidecar`): anchored on the KV pool, one
entry per token (ratio 1), ``key_bytes + scale_bytes`` per entry. The indexer's attention kernels
read each page as all keys, then all scales::

    page p of layer l: | key t0 | key t1 | ... | key t(P-1) | scale t0 | ... | scale t(P-1) |

which is just how it interprets the page's bytes; the pool moves them as a sidecar page.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.runtime.pools.sidecar import SidecarDevicePool, SidecarSpec

__all__ = ["INDEXER", "IndexerDevicePool", "indexer_spec", "kv_slots_to_pages"]

INDEXER = "indexer"


def indexer_spec(layers: Sequence[int], key_bytes: int = 128, scale_bytes: int = 4) -> SidecarSpec:
    """The DSA indexer as a sidecar of the given model layers (``CacheConfig(indexer=True)``)."""
    return SidecarSpec(INDEXER, "kv", 1, key_bytes + scale_bytes, tuple(layers))


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


class IndexerDevicePool(SidecarDevicePool):
    """Per layer ``[num_pages, P * (key_bytes + scale_bytes)]`` uint8 on the device.

    ``layers``: the model layers it holds (default ``0 .. num_layers - 1``); ``keys`` and
    ``scales`` take the pool's own layer index.
    """

    kind = INDEXER

    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        key_bytes: int = 128,
        scale_bytes: int = 4,
        device: torch.device | str = "cpu",
        layers: Sequence[int] | None = None,
    ) -> None:
        if num_layers < 1 or num_pages < 1 or page_size < 1:
            raise ValueError("num_layers, num_pages and page_size must be >= 1")
        layers = tuple(range(num_layers)) if layers is None else tuple(layers)
        if len(layers) != num_layers:
            raise ValueError(f"layers: {len(layers)} model layers for num_layers={num_layers}")
        self.key_bytes = key_bytes
        self.scale_bytes = scale_bytes
        super().__init__(indexer_spec(layers, key_bytes, scale_bytes), num_pages, page_size, device)

    def keys(self, layer: int) -> torch.Tensor:
        """``[num_pages, P, key_bytes]`` uint8 view of a layer's keys (fp8 bytes)."""
        P = self.token_page_size
        return self.buffer[layer][:, : P * self.key_bytes].view(-1, P, self.key_bytes)

    def scales(self, layer: int) -> torch.Tensor:
        """``[num_pages, P]`` fp32 view of a layer's scales."""
        P = self.token_page_size
        return self.buffer[layer][:, P * self.key_bytes :].view(torch.float32)
