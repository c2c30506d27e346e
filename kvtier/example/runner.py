"""Greedy generation through ``TieredKVCache``: the model-runner side of the embedding.

``CachedRunner.generate`` is what a serving engine does for one request: match the prompt, load
host hits back layer by layer while the forward pass runs, compute only the tokens the cache did
not have, decode greedily, and hand the result back to the cache. The prefill is cut at page
boundaries so the cache can checkpoint the Mamba state there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvtier.example.model import Generation, HybridModel
from kvtier.runtime.cache import Request, TieredKVCache

__all__ = ["CachedRunner"]


class CachedRunner:
    """Drives a :class:`HybridModel` whose pools are the cache's device pools."""

    def __init__(self, model: HybridModel, cache: TieredKVCache) -> None:
        self.model = model
        self.cache = cache
        mc, cc = model.config, cache.config
        if tuple(mc.layer_kinds) != tuple(cc.layer_kinds):
            raise ValueError(
                f"cache: layer kinds {cc.layer_kinds} differ from the model's {mc.layer_kinds} "
                "(wait_layer would map layers to the wrong pools)"
            )
        if "swa" in mc.layer_kinds and mc.swa_window != cc.swa_window:
            raise ValueError(f"cache: swa_window {cc.swa_window} != the model's {mc.swa_window}")
        self.pools = model.cache_pools(cache)
        self.last_request: Request | None = None

    def _forward(self, req: Request, tokens: Sequence[int], start: int) -> torch.Tensor:
        """One step: positions ``[start, start + len(tokens))`` are computed and marked so."""
        cache = self.cache
        end = start + len(tokens)
        swa_slots = cache.begin_step(req, end)  # SWA slots for this step, -1 out of the window
        mamba = int(req.mamba_slot) if req.mamba_slot is not None else None
        logits = self.model.forward(
            tokens,
            start,
            req.kv_slots,
            swa_slots,
            mamba,
            self.pools,
            wait_layer=lambda layer: cache.wait_layer(layer, [req]),
        )
        cache.computed(req, end)  # frees SWA slots that slid out of the window
        return logits

    def generate(self, prompt: Sequence[int], max_new_tokens: int, namespace=None) -> Generation:
        """Greedy decode ``max_new_tokens`` after ``prompt``, reusing whatever the cache holds."""
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        cache = self.cache
        prompt = list(prompt)
        if not prompt:
            raise ValueError("prompt: needs at least one token")
        req = cache.match(prompt, namespace)
        try:
            out, rows = self._run(req, prompt, max_new_tokens)
        except BaseException:
            cache.abort(req)  # nothing it holds may outlive a failed request
            raise
        req.token_ids = prompt + out[:-1]
        cache.cache_finished_req(req)
        cache.poll()
        self.last_request = req
        return Generation(out, torch.stack(rows))

    def _run(self, req: Request, prompt: list[int], max_new_tokens: int):
        cache, P = self.cache, self.cache.config.page_size
        cache.reserve(req, len(prompt) + max_new_tokens)
        cache.start_loading()
        pos = req.cached_len
        logits = None
        while pos < len(prompt):  # prefill, cut at page boundaries
            end = min(len(prompt), (pos // P + 1) * P)
            logits = self._forward(req, prompt[pos:end], pos)
            pos = end
        rows = [logits[-1]]
        out = [int(torch.argmax(rows[-1]))]
        while len(out) < max_new_tokens:  # decode: the last answer token is never fed back
            step = self._forward(req, [out[-1]], pos)
            pos += 1
            rows.append(step[-1])
            out.append(int(torch.argmax(rows[-1])))
        return out, rows
