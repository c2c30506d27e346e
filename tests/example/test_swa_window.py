"""SWA pools hold the window, not the sequence.

A request takes SWA slots step by step (``begin_step``) and gives back those that slid out of
the window as ``computed`` advances, so it never holds more than the window rounded up to pages,
one page, and the positions of the current step. Window 32, an SWA pool of 128 slots beside a
full pool of 1024: long generations through the cache equal a cold run bit for bit, the bound
holds at every step, and ``check_integrity`` holds after every step.
"""

from __future__ import annotations

import torch

from kvtier.example import HybridModel, HybridModelConfig
from kvtier.example.runner import CachedRunner
from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig

P, W = 16, 32
KINDS = ("full", "swa", "full")


def setup(swa_tokens: int, device, device_tokens: int = 1024):
    mc = HybridModelConfig(
        layer_kinds=KINDS,
        hidden=16,
        q_heads=2,
        kv_heads=1,
        head_dim=8,
        swa_window=W,
        ffn=16,
        vocab=64,
    )
    model = HybridModel(mc, device=device)
    cfg = CacheConfig(
        layer_kinds=KINDS,
        kv_heads=1,
        head_dim=8,
        page_size=P,
        device_tokens=device_tokens,
        dtype=mc.dtype,
        swa_window=W,
        swa_tokens=swa_tokens,
        host_ratio=2.0,
        device=str(device),
    )
    cache = TieredKVCache(cfg)
    return model, cache


def swa_held(cache: TieredKVCache, req) -> int:
    """SWA slots the request itself holds (the tree's are counted by the tree)."""
    own = req.kv_slots[req.cache_protected_len :]
    return int((cache.kv_alloc.translate(own) >= 0).sum())


def bound(step_tokens: int) -> int:
    return -(-W // P) * P + P + step_tokens


class CheckedRunner(CachedRunner):
    """The example runner, checking the SWA bound at the peak of every step (after the step's
    slots were taken) and the books after it."""

    peak = 0

    def _forward(self, req, tokens, start):
        cache = self.cache
        begin = cache.begin_step

        def checked_begin(r, end):
            out = begin(r, end)
            held = swa_held(cache, r)
            assert held <= bound(end - start), (start, end, held)
            CheckedRunner.peak = max(CheckedRunner.peak, held)
            return out

        cache.begin_step = checked_begin
        try:
            logits = super()._forward(req, tokens, start)
        finally:
            del cache.begin_step
        assert swa_held(cache, req) <= bound(0)
        cache.check_integrity()
        return logits


def same(got, cold) -> bool:
    return got.tokens == cold.tokens and torch.equal(got.logits.cpu(), cold.logits.cpu())


def test_long_generations_fit_a_small_swa_pool(device):
    model, cache = setup(swa_tokens=128, device=device)
    runner = CheckedRunner(model, cache)
    gen = torch.Generator().manual_seed(3)
    first = torch.randint(0, 64, (40,), generator=gen).tolist()
    got = runner.generate(first, 600)
    assert same(got, model.generate_cold(first, 600)), "600 tokens through the cache"
    assert CheckedRunner.peak > W, "the bound was never approached: the test checks nothing"
    cache.check_integrity()
    # The next turn extends the first: its whole pages hit the device, the window at their end
    # is SWA-resident, and 900 more tokens still fit.
    second = first + got.tokens[:-1] + [5, 6, 7]
    cache.drain()
    cache.evict(1024)  # make room for 900 more: the first turn goes to host
    cache.check_integrity()
    third = torch.randint(0, 64, (24,), generator=gen).tolist()
    got = runner.generate(third, 900)
    assert same(got, model.generate_cold(third, 900)), "900 tokens through the cache"
    cache.check_integrity()
    got = runner.generate(second, 4)
    cached = (len(first) + 599) // P * P  # the first turn's whole pages, from host
    assert runner.last_request.cached_len == cached, runner.last_request
    assert same(got, model.generate_cold(second, 4))
    cache.drain()
    cache.check_integrity()


def test_four_requests_at_once_share_the_swa_pool(device):
    """Four interleaved requests, each generating 200 tokens: the SWA pool holds four windows
    and pages (256 slots), not four sequences (960)."""
    model, cache = setup(swa_tokens=4 * bound(P), device=device)
    runner = CheckedRunner(model, cache)
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 64, (40,), generator=gen).tolist() for _ in range(4)]
    new = 200
    reqs = []
    for prompt in prompts:
        req = cache.match(prompt)
        cache.reserve(req, len(prompt) + new)
        reqs.append(req)
    cache.start_loading()
    outs: list[list[int]] = [[] for _ in reqs]
    rows: list[list[torch.Tensor]] = [[] for _ in reqs]
    while any(len(o) < new for o in outs):
        for i, (req, prompt) in enumerate(zip(reqs, prompts)):
            if len(outs[i]) >= new:
                continue
            pos = req.computed_len
            if pos < len(prompt):  # one prefill chunk, cut at a page boundary
                end = min(len(prompt), (pos // P + 1) * P)
                logits = runner._forward(req, prompt[pos:end], pos)
                if end < len(prompt):
                    continue
            else:  # one decode step
                logits = runner._forward(req, [outs[i][-1]], pos)
            rows[i].append(logits[-1])
            outs[i].append(int(torch.argmax(logits[-1])))
            total = sum(swa_held(cache, r) for r in reqs)
            assert total <= cache.config.swa_tokens
    for req, prompt, out, row in zip(reqs, prompts, outs, rows):
        cold = model.generate_cold(prompt, new)
        assert out == cold.tokens
        assert torch.equal(torch.stack(row).cpu(), cold.logits.cpu())
        req.token_ids = prompt + out[:-1]
        cache.cache_finished_req(req)
        cache.check_integrity()
    assert cache.config.swa_tokens < 4 * (40 + new)
