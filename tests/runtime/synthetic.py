"""A synthetic hybrid model whose cache contents are predictable, for the runtime tests.

A "forward" writes, for every position ``p`` and layer, a K/V row that is a function of ``(p,
token, layer)`` and advances a Mamba state deterministically; ``check_cached`` proves that every
position a request reuses holds exactly the bytes a cold computation would have written.
Plain functions (not fixtures): spawned TP ranks import them too.
"""

from __future__ import annotations

import torch

from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig
from kvtier.runtime.pools.mamba import MambaStateSpec

P = 4
SPEC = MambaStateSpec(temporal_shape=(2, 3), conv_shapes=((4, 2),), conv_dtypes=(torch.float32,))
MODELS = {
    "full": ("full", "full"),
    "full+swa": ("full", "swa", "full"),
    "full+mamba": ("full", "mamba", "full"),
    "full+swa+mamba": ("swa", "full", "mamba"),
}


def make_cache(kinds, policy, device_tokens=48, **kw) -> TieredKVCache:
    cfg = CacheConfig(
        layer_kinds=kinds,
        kv_heads=1,
        head_dim=4,
        page_size=P,
        device_tokens=device_tokens,
        dtype=torch.float32,
        swa_window=8 if "swa" in kinds else None,
        mamba=SPEC if "mamba" in kinds else None,
        mamba_slots=8 if "mamba" in kinds else None,
        host_ratio=8.0,
        write_policy=policy,
        **kw,
    )
    return TieredKVCache(cfg)


def kv_row(p: int, tok: int, layer: int, which: int) -> torch.Tensor:
    return torch.tensor([p, tok, layer, which], dtype=torch.float32).view(1, 4)


def mamba_states(tokens, n):
    t = torch.zeros(SPEC.temporal_shape)
    c = torch.zeros(SPEC.conv_shapes[0])
    for x in tokens[:n]:
        t = t * 0.5 + x
        c = c * 0.25 + x
    return t, c


def forward(cache: TieredKVCache, req, upto: int) -> None:
    """Write positions [req.computed_len, upto), in page-sized chunks, like a model would."""
    kinds = cache.config.layer_kinds
    while req.computed_len < upto:
        start = req.computed_len
        end = min(upto, (start // P + 1) * P)
        swa_slots = cache.begin_step(req, end)
        for layer, kind in enumerate(kinds):
            cache.wait_layer(layer, [req])
            _, pl = cache.layer_map[layer]
            for p in range(start, end):
                tok = req.token_ids[p]
                if kind == "full":
                    s = int(req.kv_slots[p])
                    cache.full_pool.k(pl)[s] = kv_row(p, tok, layer, 0)
                    cache.full_pool.v(pl)[s] = kv_row(p, tok, layer, 1)
                elif kind == "swa":
                    s = int(swa_slots[p])
                    cache.swa_pool.k(pl)[s] = kv_row(p, tok, layer, 0)
                    cache.swa_pool.v(pl)[s] = kv_row(p, tok, layer, 1)
                else:
                    s = int(req.mamba_slot)
                    mp = cache.mamba_pool
                    mp.temporal[pl, s] = mp.temporal[pl, s] * 0.5 + tok
                    mp.convs[0][pl, s] = mp.convs[0][pl, s] * 0.25 + tok
        cache.computed(req, end)


def check_cached(cache: TieredKVCache, req) -> None:
    """Everything the request reuses equals what a cold run writes."""
    kinds = cache.config.layer_kinds
    n = req.cached_len
    swa_slots = cache.swa_slots(req)
    for layer, kind in enumerate(kinds):
        cache.wait_layer(layer, [req])
        _, pl = cache.layer_map[layer]
        for p in range(n):
            tok = req.token_ids[p]
            if kind == "full":
                got = cache.full_pool.k(pl)[int(req.kv_slots[p])]
                assert torch.equal(got, kv_row(p, tok, layer, 0)), (layer, p)
            elif kind == "swa" and p >= n - cache.config.swa_window:
                got = cache.swa_pool.v(pl)[int(swa_slots[p])]
                assert torch.equal(got, kv_row(p, tok, layer, 1)), ("swa", layer, p)
        if kind == "mamba":
            t, c = mamba_states(req.token_ids, n)
            s = int(req.mamba_slot)
            assert torch.equal(cache.mamba_pool.temporal[pl, s], t), ("mamba", layer, n)
            assert torch.equal(cache.mamba_pool.convs[0][pl, s], c)


def turn_runner(check, write):
    """A whole request of a synthetic model: match, check what it reuses with ``check``, write
    the rest with ``write``, finish, poll, check the books."""

    def run_turn(cache, tokens, new_tokens=3):
        req = cache.match(tokens)
        cache.reserve(req, len(tokens) + new_tokens)
        cache.start_loading()
        check(cache, req)
        req.token_ids = list(tokens) + [7] * new_tokens  # the synthetic model "generates" 7s
        write(cache, req, len(tokens) + new_tokens)
        cache.cache_finished_req(req)
        cache.poll()
        cache.check_integrity()
        return req

    return run_turn


run_turn = turn_runner(check_cached, forward)


def fingerprint(cache: TieredKVCache) -> list:
    """What must be equal on every TP rank: each node's key, tiers and pins, in tree order."""
    out = []
    for node in cache.tree.all_nodes():
        out.append(
            (
                tuple(node.key),
                tuple(v is not None for v in node.value),
                tuple(h is not None for h in node.host_value),
                tuple(node.pins),
            )
        )
    return out
