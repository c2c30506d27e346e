"""A synthetic DeepSeek-V4-like model whose cache contents are predictable.

A logical FULL pool (index-only pages) and SWA layers, with sidecars: C4 KV and the C4 indexer
(KV-anchored, every 4 tokens one entry), C128 KV when the page holds 128 tokens, and two
compressor states (SWA-anchored). A "forward" writes each SWA K/V row as a function of
``(p, token, layer)`` and, when a group of ``ratio`` tokens completes, each sidecar's entry as a
function of ``(sidecar, group, the group's tokens, layer)``; ``check_cached`` proves that every
reused position and entry holds what a cold run writes. Plain functions (not fixtures): spawned
producers and TP ranks import them too.
"""

from __future__ import annotations

import torch

from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig, SidecarSpec, StorageConfig
from tests.runtime.synthetic import kv_row, turn_runner

LAYERS = ("swa", "swa", "swa")
C4_LAYERS = (0, 2)
C128_LAYERS = (1,)


def sidecars(page_size: int) -> tuple[SidecarSpec, ...]:
    """V4's sidecars (odd entry sizes on purpose); C128 only where a page holds a group."""
    cars = [
        SidecarSpec("c4", "kv", 4, 12, C4_LAYERS),
        SidecarSpec("c4_indexer", "kv", 4, 5, C4_LAYERS),
        SidecarSpec("c4_state", "swa", 4, 8, C4_LAYERS),
        SidecarSpec("c4_indexer_state", "swa", 4, 3, C4_LAYERS),
    ]
    if page_size >= 128:
        cars.insert(2, SidecarSpec("c128", "kv", 128, 20, C128_LAYERS))
    return tuple(cars)


def v4_config(
    page_size: int = 16,
    layout: str = "page_first",
    policy: str = "write_through",
    device_pages: int = 8,
    host_ratio: float = 4.0,
    storage: StorageConfig | None = None,
    model_id: str = "",
) -> CacheConfig:
    P = page_size
    return CacheConfig(
        layer_kinds=LAYERS,
        kv_heads=1,
        head_dim=4,
        page_size=P,
        device_tokens=device_pages * P,
        dtype=torch.float32,
        full_pool="logical",
        sidecars=sidecars(P),
        swa_window=P,
        host_ratio=host_ratio,
        host_layout=layout,
        write_policy=policy,
        storage=storage,
        model_id=model_id,
    )


def entry(name: str, group: int, tokens: list[int], layer: int, nbytes: int) -> torch.Tensor:
    """One sidecar entry as a cold run writes it (a function of everything that defines it)."""
    seed = sum(map(ord, name)) * 7 + group * 31 + sum(tokens) * 5 + layer * 97
    return ((torch.arange(nbytes) * 13 + seed) % 256).to(torch.uint8)


def _write(cache: TieredKVCache, req, start: int, end: int, swa_slots: torch.Tensor) -> None:
    P = cache.config.page_size
    for layer in range(len(LAYERS)):
        cache.wait_layer(layer, [req])
        _, pl = cache.layer_map[layer]
        for p in range(start, end):
            s = int(swa_slots[p])
            cache.swa_pool.k(pl)[s] = kv_row(p, req.token_ids[p], layer, 0)
            cache.swa_pool.v(pl)[s] = kv_row(p, req.token_ids[p], layer, 1)
        for spec in cache.config.all_sidecars:
            if layer not in spec.layers:
                continue
            pool = cache.sidecar_pools[spec.name]
            slots = req.kv_slots if spec.anchor == "kv" else swa_slots
            r = spec.ratio
            for q in range(start, end):
                if (q + 1) % r:
                    continue  # the group of position q completes later
                g = q // r
                s = int(slots[q])
                value = entry(spec.name, g, req.token_ids[g * r : q + 1], layer, spec.entry_bytes)
                pool.entries(layer)[s // P, (s % P) // r] = value


def forward(cache: TieredKVCache, req, upto: int) -> None:
    """Write positions [req.computed_len, upto) page by page."""
    P = cache.config.page_size
    while req.computed_len < upto:
        start = req.computed_len
        end = min(upto, (start // P + 1) * P)
        swa_slots = cache.begin_step(req, end)
        _write(cache, req, start, end, swa_slots)
        cache.computed(req, end)


def check_cached(cache: TieredKVCache, req) -> None:
    """Every reused SWA row of the window and every reused sidecar entry is a cold run's."""
    cfg = cache.config
    P, n = cfg.page_size, req.cached_len
    assert n % P == 0, f"cached length {n} is not whole pages"
    window = range(max(0, n - cfg.swa_window), n)
    swa_slots = cache.swa_slots(req)
    for layer in range(len(LAYERS)):
        cache.wait_layer(layer, [req])
        _, pl = cache.layer_map[layer]
        for p in window:
            got = cache.swa_pool.v(pl)[int(swa_slots[p])]
            assert torch.equal(got, kv_row(p, req.token_ids[p], layer, 1)), ("swa", layer, p)
        for spec in cfg.all_sidecars:
            if layer not in spec.layers:
                continue
            pool = cache.sidecar_pools[spec.name]
            slots = req.kv_slots if spec.anchor == "kv" else swa_slots
            r = spec.ratio
            first = 0 if spec.anchor == "kv" else window.start
            for q in range(first + r - 1, n, r):
                s = int(slots[q])
                g = q // r
                ref = entry(spec.name, g, req.token_ids[g * r : q + 1], layer, spec.entry_bytes)
                got = pool.entries(layer)[s // P, (s % P) // r]
                assert torch.equal(got, ref), (spec.name, layer, "group", g, got, ref)


run_turn = turn_runner(check_cached, forward)
