"""``Request``: one running request as ``TieredKVCache`` and its parts see it.

It lives apart from the facade so that the parts that move a request on (``slots``, ``inserts``)
can name it without importing the facade.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvtier.runtime.tree.requests import CacheRequest

__all__ = ["Request"]


@dataclass(eq=False)
class Request(CacheRequest):
    """A request as the cache sees it (see :class:`CacheRequest` for the slot bookkeeping).

    Attributes:
        device_hit: prompt tokens whose KV was found on the device.
        host_hit: prompt tokens whose KV is loaded back from host. A token counts by its
            full-attention KV: a hybrid model's SWA window and Mamba state, loaded with it or
            alone, count in the copied bytes (``h2d_bytes``, L3 bytes read), not as tokens.
        storage_hit: of ``host_hit``, the tokens an L3 prefetch read for them, served here for the
            first time (a later hit of the same tokens is a device or host hit). The cache's
            per-tier hit counters split a request's hit into device, host (``host_hit -
            storage_hit``) and storage.
        computed_len: tokens whose KV/state the runner has written.
        mamba_ckpt: a slot holding the state at ``mamba_ckpt_len`` tokens (page-aligned).
        released: ``""`` while the request runs; ``"finished"`` or ``"aborted"`` once
            ``cache_finished_req`` or ``abort`` took its slots back (any later use is refused).

    Requests compare and hash by identity (two requests for one prompt are two requests), so
    an engine can keep them in lists, sets and dicts.
    """

    device_hit: int = 0
    host_hit: int = 0
    storage_hit: int = 0
    computed_len: int = 0
    mamba_ckpt: torch.Tensor | None = None
    mamba_ckpt_len: int = 0
    released: str = ""  # "finished" or "aborted" once the cache has taken everything back
    _pending_cow: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, repr=False
    )

    @property
    def cached_len(self) -> int:
        """Prompt tokens served by the cache; the runner starts computing here."""
        return self.device_hit + self.host_hit
