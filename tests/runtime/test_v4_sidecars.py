"""DeepSeek-V4-like caches: a logical FULL pool and sidecar pools, device and host hits exact.

With the synthetic V4 model (``tests/runtime/synthetic_v4.py``), a later request must find every
entry of every sidecar a cold run writes: on device, and after load-back from every host layout,
for page sizes 16, 64 and 256 (C128 only where a page holds a group of 128). The FULL pool is
index-only: it allocates no bytes and is never copied, while its slots still bound capacity.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig, SidecarSpec
from kvtier.runtime.pools.host import HostPool
from kvtier.runtime.pools.sidecar import LogicalDevicePool, LogicalHostPool, SidecarDevicePool
from tests.runtime.synthetic_v4 import C4_LAYERS, LAYERS, run_turn, sidecars, v4_config

LAYOUTS = ["page_first", "layer_first", "page_first_direct"]


def _conversations(P: int, seed: int, n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 50, (2 * P + 4,), generator=gen).tolist() for _ in range(n)]


def _scribble(cache: TieredKVCache) -> None:
    """Poison every device byte a load-back must restore (a skipped copy keeps the poison)."""
    for pool in cache.sidecar_pools.values():
        pool.buffer.fill_(0xAB)
    cache.swa_pool.k_buffer.fill_(float("nan"))
    cache.swa_pool.v_buffer.fill_(float("nan"))


@pytest.mark.parametrize("P", [16, 64, 256])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_device_then_host_hits_are_exact(layout, P):
    policy = "write_back" if layout == "layer_first" else "write_through"
    cache = TieredKVCache(v4_config(P, layout, policy, device_pages=6))
    convs = _conversations(P, seed=P + len(layout), n=3)
    run_turn(cache, convs[0])
    again = run_turn(cache, convs[0] + [7, 7, 7] + [1])
    assert again.device_hit == 2 * P and again.host_hit == 0, again
    for c in convs[1:]:  # the device holds 6 pages: conv 0 leaves it (to host)
        run_turn(cache, c)
    cache.drain()
    cache.evict(cache.config.device_tokens)
    cache.check_integrity()
    _scribble(cache)
    third = run_turn(cache, convs[0] + [7, 7, 7] + [2])
    assert third.device_hit == 0 and third.host_hit == 2 * P, third
    cache.drain()
    cache.check_integrity()


def test_logical_full_pool_allocates_no_bytes():
    P = 16
    cfg = v4_config(P, device_pages=6)
    cache = TieredKVCache(cfg)
    assert isinstance(cache.full_pool, LogicalDevicePool)
    assert isinstance(cache.host_full, LogicalHostPool)
    assert cache.full_pool.nbytes == 0 and cache.host_full.nbytes == 0
    assert not any(isinstance(v, torch.Tensor) for v in vars(cache.full_pool).values())
    assert not any(isinstance(v, torch.Tensor) for v in vars(cache.host_full).values())
    # Nothing to copy, and no copy to fake: the logical pools have no copy methods at all.
    assert not hasattr(cache.host_full, "backup") and not hasattr(cache.host_full, "load")
    # Every byte the cache holds is a sidecar's or the SWA pool's.
    host_pages, dev_pages = cfg.host_kv_tokens // P, cfg.device_tokens // P
    for spec in cfg.all_sidecars:
        pages = dev_pages if spec.anchor == "kv" else cfg.swa_device_tokens // P
        want = pages * len(spec.layers) * spec.page_bytes(P)
        assert cache.sidecar_pools[spec.name].buffer.numel() == want, spec.name
        hpages = host_pages if spec.anchor == "kv" else cfg.host_swa_tokens // P
        assert cache.host_sidecars[spec.name].nbytes == hpages * len(spec.layers) * spec.page_bytes(
            P
        ), spec.name
    # The index-only slots still bound capacity and eviction.
    assert cache.kv_alloc.size == cfg.device_tokens
    assert cache.tree.full.host_alloc.size == cfg.host_kv_tokens
    # The FULL binding copies the KV-anchored sidecars and nothing else.
    kv_cars = [s for s in cfg.all_sidecars if s.anchor == "kv"]
    per_page = sum(len(s.layers) * s.page_bytes(P) for s in kv_cars)
    assert cache.controller.bindings["kv"].bytes_per_index == per_page // P
    req = run_turn(cache, list(range(2 * P + 4)))
    cache.drain()
    m = cache.metrics()
    swa_per_token = (
        cache.swa_pool.bytes_per_token
        + sum(len(s.layers) * s.page_bytes(P) for s in cfg.all_sidecars if s.anchor == "swa") // P
    )
    # Backed up: 2 whole pages of FULL (sidecars only), and SWA's window page(s).
    swa_tokens = m["d2h_bytes"] - 2 * P * (per_page // P)
    assert swa_tokens > 0 and swa_tokens % swa_per_token == 0, (m, swa_per_token)
    assert req.cached_len == 0


def test_load_steps_cover_every_pool_of_a_layer():
    """A V4 layer loads its SWA window and its KV-anchored sidecars: two steps, waited on the
    last; layers without sidecars (or plain models) keep one step per layer."""
    cache = TieredKVCache(v4_config(16))
    assert cache.controller.layer_map == [
        ("swa", 0),
        ("kv", 0),
        ("swa", 1),
        ("swa", 2),
        ("kv", 2),
    ]
    assert cache._wait_steps == [1, 2, 4]
    assert [s.layers for s in sidecars(16) if s.anchor == "kv"] == [C4_LAYERS, C4_LAYERS]
    assert len(LAYERS) == 3


BASE = dict(kv_heads=1, head_dim=4, page_size=16, device_tokens=64, host_ratio=2.0)


@pytest.mark.parametrize(
    "kw, match",
    [
        (
            dict(sidecars=(SidecarSpec("c128", "kv", 128, 8, (0,)),)),
            r"page_size=16 is not a multiple of the ratio 128 of sidecar 'c128'",
        ),
        (
            dict(sidecars=(SidecarSpec("st", "swa", 4, 8, (0,)),)),
            r"'st' is anchored on 'swa', but no layer is 'swa'",
        ),
        (
            dict(sidecars=(SidecarSpec("a", "kv", 4, 8, (0,)), SidecarSpec("a", "kv", 4, 1, (0,)))),
            r"sidecars\[1\]: duplicate sidecar name 'a'",
        ),
        (
            dict(indexer=True, sidecars=(SidecarSpec("indexer", "kv", 1, 8, (0,)),)),
            r"duplicate sidecar name 'indexer' \(indexer=True adds one\)",
        ),
        (
            dict(sidecars=(SidecarSpec("a", "kv", 4, 8, (0, 5)),)),
            r"'a' holds layer 5, but the model has 1 layers",
        ),
        (dict(full_pool="logical"), r"no layer can be 'full'"),
        (dict(full_pool="bytes"), r"full_pool: unknown 'bytes'"),
    ],
)
def test_config_refuses(kw, match):
    with pytest.raises(ValueError, match=match):
        CacheConfig(layer_kinds=("full",), **BASE, **kw)


def test_config_refuses_logical_without_kv_sidecar():
    car = SidecarSpec("st", "swa", 4, 8, (0,))
    with pytest.raises(ValueError, match="needs at least one KV-anchored sidecar"):
        CacheConfig(
            layer_kinds=("swa",), swa_window=16, full_pool="logical", sidecars=(car,), **BASE
        )


@pytest.mark.parametrize(
    "args, exc, match",
    [
        (("c4", "kv", 4, 0, (0,)), ValueError, r"entry_bytes must be >= 1, got 0"),
        (("c4", "kv", 0, 8, (0,)), ValueError, r"ratio must be >= 1, got 0"),
        (("c4", "ring", 4, 8, (0,)), ValueError, r"anchor: unknown 'ring'"),
        (("kv", "kv", 4, 8, (0,)), ValueError, r"name: 'kv' must be"),
        (("C4", "kv", 4, 8, (0,)), ValueError, r"name: 'C4' must be"),
        (("c4", "kv", 4.0, 8, (0,)), TypeError, r"ratio: expected an int, got 4.0"),
        (("c4", "kv", 4, 8, ()), ValueError, r"holds at least one layer"),
        (("c4", "kv", 4, 8, (1, 0)), ValueError, r"ascending distinct layers"),
        (("c4", "kv", 4, 8, 0), TypeError, r"layers: expected a tuple"),
        (("c4", "kv", 4, 8, (0,), "trailing_pages"), ValueError, r"must be 'all_pages'"),
        (("c4", "swa", 4, 8, (0,), "every"), ValueError, r"hit_policy: unknown 'every'"),
    ],
)
def test_sidecar_spec_refuses(args, exc, match):
    with pytest.raises(exc, match=match):
        SidecarSpec(*args)


def test_sidecar_spec_defaults_to_its_anchors_policy():
    assert SidecarSpec("c4", "kv", 4, 8, [0, 1]).hit_policy == "all_pages"
    assert SidecarSpec("st", "swa", 4, 8, range(2)).layers == (0, 1)
    assert SidecarSpec("st", "swa", 4, 8, (0,)).hit_policy == "trailing_pages"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ratio, entry", [(1, 132), (4, 12), (128, 20)], ids=["r1", "r4", "r128"])
def test_sidecar_pool_round_trip_touches_only_its_pages(layout, ratio, entry):
    """D→H of some pages, then H→D layer by layer into other pages: bit-exact, and every page
    the copies do not name keeps its poison (host and device)."""
    P = 256
    spec = SidecarSpec("car", "kv", ratio, entry, (1, 4, 6))
    dev = SidecarDevicePool(spec, num_pages=5, page_size=P)
    assert dev.page_bytes == P // ratio * entry and dev.entries(4).shape == (5, P // ratio, entry)
    gen = torch.Generator().manual_seed(ratio)
    dev.buffer.copy_(torch.randint(0, 256, dev.buffer.shape, generator=gen, dtype=torch.uint8))
    ref = dev.buffer.clone()
    host = HostPool(dev, layout, size=6)
    host.tensor.view(torch.uint8).fill_(0xEE)
    src, hst = torch.tensor([3, 0]), torch.tensor([5, 1])
    host.backup(src, hst, check=True)
    dev.buffer.fill_(0xAB)
    dst = torch.tensor([2, 4])
    for layer in range(len(spec.layers)):
        host.load(hst, dst, layer=layer, check=True)
    for layer in range(len(spec.layers)):
        for s, d in zip(src.tolist(), dst.tolist()):
            assert torch.equal(dev.buffer[layer, d], ref[layer, s]), (layer, s, d)
        for untouched in (0, 1, 3):
            assert bool((dev.buffer[layer, untouched] == 0xAB).all()), (layer, untouched)
    staged = torch.empty((6, host.page_bytes), dtype=torch.uint8)
    if layout == "layer_first":
        rows = host.pack(torch.arange(6), staged)
    else:
        rows = torch.stack([torch.cat(v) for v in host.page_views(torch.arange(6))])
    for page in (0, 2, 3, 4):
        assert bool((rows[page] == 0xEE).all()), page
    with pytest.raises(ValueError, match=r"holds layers \(1, 4, 6\), not 2"):
        dev.entries(2)


def test_sidecar_pool_refuses_a_page_size_its_ratio_does_not_divide():
    with pytest.raises(ValueError, match="page_size: 64 is not a multiple of the ratio 128"):
        SidecarDevicePool(SidecarSpec("c128", "kv", 128, 8, (0,)), num_pages=2, page_size=64)
