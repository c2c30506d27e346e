"""How the L3 tier sees the host pools: page objects and key namespaces.

A page object of a pool is what one L3 key stores:

    pool    host pool       page object                          read/written through
    kv      HostPool        one page, every layer, K then V      page_spans (page_first*), or
                            (MLA: the latent)                    pack/unpack via staging
    <car>   HostPool        one anchor page of a sidecar         same; its host page ids are
                            (DSA indexer: keys then scales),     its anchor's (slot // P)
                            every layer it holds
    swa     HostPool        same as kv, for the SWA layers       same as kv
    mamba   MambaHostPool   one state slot (flat)                slot_spans
"""

from __future__ import annotations

import threading
from collections.abc import Hashable

import numpy as np
import torch

from kvtier.runtime.config import CacheConfig
from kvtier.runtime.pools.host import HostPool
from kvtier.runtime.pools.mamba import MambaHostPool
from kvtier.storage import Namespace
from kvtier.storage.keys import canonical_namespace
from kvtier.storage.spans import PageSpans

__all__ = ["L3Pool", "namespace_for"]


def namespace_for(cfg: CacheConfig, request_namespace: Hashable, tp_size: int) -> Namespace:
    """The L3 namespace of a request: model, dtype, page size, layout, salts and TP shape.

    The deployment salt (``cfg.storage.namespace_key``), the pools' shape
    (``CacheConfig.key_shape``, 16 bytes) and the request's namespace (LoRA id, cache salt) are
    joined back to back, the two namespaces as ``canonical_namespace`` encodings: each is
    self-delimiting, so distinct triples never give the same key, and namespaces the radix tree
    keeps apart never share a page. Raises ``TypeError`` (``ValueError``) for a namespace that
    ``canonical_namespace`` refuses.
    """
    st = cfg.storage
    assert st is not None
    joined = cfg.key_salt(st.namespace_key) + canonical_namespace(request_namespace)
    return Namespace(
        model_id=cfg.model_id,
        dtype=str(cfg.dtype).removeprefix("torch."),
        page_size=cfg.page_size,
        layout=cfg.host_layout,
        namespace_key=joined.hex(),
        tp_size=None if cfg.rank_replicated else tp_size,
    )


class L3Pool:
    """One host pool as L3 page objects: page buffers to read into or write from.

    Args:
        name: the pool's L3 name ("kv", "swa", "mamba" or a sidecar's).
        host: the host pool.
        page_size: tokens per page (token-slot pools, and sidecars, whose pages are named by
            their anchor's token slots); Mamba slots are pages of their own.
        batch_pages: most pages per call (staging rows for layer_first pools).
    """

    def __init__(self, name: str, host: HostPool | MambaHostPool, page_size: int, batch_pages: int):
        self.name = name
        self.host = host
        self.is_mamba = isinstance(host, MambaHostPool)
        self.P = 1 if self.is_mamba else page_size
        self.staged = not self.is_mamba and not host.layout.page_contiguous
        self.page_bytes = host.slot_bytes if self.is_mamba else host.page_bytes
        self.batch_pages = batch_pages
        self._staging = threading.local()
        self._all_staging: list[torch.Tensor] = []
        self._mutex = threading.Lock()
        self.register: list = []  # callbacks run on every new staging buffer (backend registration)

    def region(self) -> torch.Tensor:
        """The pool's memory as one flat uint8 tensor (for backend registration)."""
        return self.host.tensor.view(-1).view(torch.uint8)

    def pages_of(self, slots: torch.Tensor) -> torch.Tensor:
        """Host page ids of page-aligned token slots (slot ids for Mamba)."""
        return slots if self.is_mamba else slots.view(-1, self.P)[:, 0] // self.P

    def staging(self) -> torch.Tensor:
        """This thread's staging buffer (layer_first pools)."""
        buf = getattr(self._staging, "buf", None)
        if buf is None:
            buf = self.host.new_staging(self.batch_pages)
            for fn in self.register:
                fn(buf)
            with self._mutex:
                self._all_staging.append(buf)
            self._staging.buf = buf
        return buf

    def write_views(self, pages: torch.Tensor) -> list | PageSpans:
        """Page buffers holding ``pages``' objects (packed into staging if needed)."""
        if self.is_mamba:
            return self.host.slot_spans(pages)
        if not self.staged:
            return self.host.page_spans(pages)
        rows = self.host.pack(pages, self.staging())
        return self._rows(rows.shape[0])

    def read_views(self, pages: torch.Tensor) -> list | PageSpans:
        """Page buffers to read ``pages``' objects into; call ``finish_read`` after."""
        if self.is_mamba:
            return self.host.slot_spans(pages)
        if not self.staged:
            return self.host.page_spans(pages)
        return self._rows(pages.numel())

    def _rows(self, n: int) -> PageSpans:
        """The first ``n`` rows of this thread's staging buffer as ``PageSpans``."""
        buf = self.staging()
        at = np.arange(n, dtype=np.int64)[:, None] * buf.shape[1]
        at.setflags(write=False)
        return PageSpans._made(buf.view(-1), at, (buf.shape[1],))

    def finish_read(self, pages: torch.Tensor, n_ok: int) -> None:
        """Move the first ``n_ok`` staged pages into the host pool (layer_first)."""
        if self.staged and n_ok:
            self.host.unpack(pages[:n_ok], self.staging()[:n_ok])
