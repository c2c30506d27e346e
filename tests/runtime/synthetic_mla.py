"""A synthetic MLA + DSA indexer model whose cache contents are predictable.

A "forward" writes, for every position ``p`` and full layer, an MLA latent row and an indexer
key and scale that are functions of ``(p, token, layer)``; ``check_cached`` proves that every
reused latent and every reused indexer page (all keys, then all scales) holds what a cold run
writes. Plain functions (not fixtures): spawned producers and TP ranks import them too.
"""

from __future__ import annotations

import torch

from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig, StorageConfig
from tests.runtime.synthetic import turn_runner

P = 4
DIM = 5  # latent width: not a power of two
LAYERS = ("full", "full")
KEY_BYTES = 128


def mla_config(
    policy: str = "write_through",
    layout: str = "page_first",
    device_tokens: int = 48,
    host_ratio: float = 8.0,
    storage: StorageConfig | None = None,
    model_id: str = "",
) -> CacheConfig:
    return CacheConfig(
        layer_kinds=LAYERS,
        kv_heads=1,
        head_dim=1,
        mla_dim=DIM,
        indexer=True,
        page_size=P,
        device_tokens=device_tokens,
        dtype=torch.float32,
        host_ratio=host_ratio,
        host_layout=layout,
        write_policy=policy,
        storage=storage,
        model_id=model_id,
    )


def latent_row(p: int, tok: int, layer: int) -> torch.Tensor:
    return torch.tensor([p, tok, layer, 0.5, -1.0], dtype=torch.float32).view(1, DIM)


def indexer_key(p: int, tok: int, layer: int) -> torch.Tensor:
    return ((torch.arange(KEY_BYTES) * 7 + p * 31 + tok * 5 + layer * 97) % 256).to(torch.uint8)


def indexer_scale(p: int, tok: int, layer: int) -> float:
    return p + tok / 64 + layer * 1000  # exact in fp32


def expected_indexer_page(tokens: list[int], page: int, layer: int) -> torch.Tensor:
    """The bytes of one indexer page as a cold run writes them: P keys, then P fp32 scales."""
    pos = range(page * P, page * P + P)
    keys = torch.cat([indexer_key(p, tokens[p], layer) for p in pos])
    scales = torch.tensor([indexer_scale(p, tokens[p], layer) for p in pos], dtype=torch.float32)
    return torch.cat([keys, scales.view(torch.uint8)])


def forward(cache: TieredKVCache, req, upto: int) -> None:
    """Write positions [req.computed_len, upto) page by page: latents and indexer entries."""
    idx = cache.indexer_pool
    while req.computed_len < upto:
        start = req.computed_len
        end = min(upto, (start // P + 1) * P)
        for layer in range(len(LAYERS)):
            cache.wait_layer(layer, [req])
            for p in range(start, end):
                tok, s = req.token_ids[p], int(req.kv_slots[p])
                cache.full_pool.latent(layer)[s] = latent_row(p, tok, layer)
                idx.keys(layer)[s // P, s % P] = indexer_key(p, tok, layer)
                idx.scales(layer)[s // P, s % P] = indexer_scale(p, tok, layer)
        cache.computed(req, end)


def check_cached(cache: TieredKVCache, req) -> None:
    """Every reused latent and every reused indexer page equals what a cold run writes."""
    n = req.cached_len
    assert n % P == 0, f"cached length {n} is not whole pages"
    for layer in range(len(LAYERS)):
        cache.wait_layer(layer, [req])
        for p in range(n):
            got = cache.full_pool.latent(layer)[int(req.kv_slots[p])]
            assert torch.equal(got, latent_row(p, req.token_ids[p], layer)), ("latent", layer, p)
        for page in range(n // P):
            dev_page = int(req.kv_slots[page * P]) // P
            got = cache.indexer_pool.buffer[layer, dev_page]
            ref = expected_indexer_page(req.token_ids, page, layer)
            bad = (got != ref).nonzero()
            assert bad.numel() == 0, (
                f"indexer layer {layer} page {page} (device page {dev_page}): first mismatch at "
                f"byte {int(bad[0])}: {int(got[bad[0]])} != {int(ref[bad[0]])}"
            )


run_turn = turn_runner(check_cached, forward)
