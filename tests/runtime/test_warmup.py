"""``warmup`` compiles what serving needs and moves no byte; after it, serving compiles nothing."""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.kernels.kv_transfer import _kv_copy_kernel
from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig
from kvtier.runtime.pools.mamba import MambaStateSpec

P = 16
SPEC = MambaStateSpec(temporal_shape=(2, 8), conv_shapes=((8, 3),), conv_dtypes=(torch.float32,))


def make_cache(device, **kw) -> TieredKVCache:
    cfg = CacheConfig(
        layer_kinds=("full", "swa", "mamba", "full"),
        kv_heads=2,
        head_dim=8,
        page_size=P,
        device_tokens=256,
        dtype=torch.bfloat16,
        swa_window=32,
        swa_tokens=128,
        mamba=SPEC,
        mamba_slots=8,
        host_ratio=2.0,
        device=str(device),
        **kw,
    )
    return TieredKVCache(cfg)


def all_bytes(cache: TieredKVCache) -> list[torch.Tensor]:
    out = []
    for pool in (cache.full_pool, cache.swa_pool):
        out += [t.clone() for t in (pool.k_buffer, pool.v_buffer)]
    out += [t.clone() for t in cache.mamba_pool.tensors]
    for host in (cache.host_full, cache.host_swa, cache.host_mamba):
        out.append(host.tensor.clone())
    return out


def test_warmup_moves_no_byte(device):
    cache = make_cache(device)
    for t in [
        cache.full_pool.k_buffer,
        cache.full_pool.v_buffer,
        cache.swa_pool.k_buffer,
        cache.swa_pool.v_buffer,
        *cache.mamba_pool.tensors,
    ]:
        t.view(torch.uint8).random_(0, 256, generator=torch.Generator(t.device).manual_seed(1))
    for h in (cache.host_full, cache.host_swa, cache.host_mamba):
        h.tensor.view(torch.uint8).fill_(0xA5)
    before = all_bytes(cache)
    stats = dict(cache.controller.stats.__dict__)
    cache.warmup()
    after = all_bytes(cache)
    for i, (a, b) in enumerate(zip(before, after)):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"buffer {i} changed"
    assert cache.controller.stats.__dict__ == stats, "warm-up copies were counted"
    cache.check_integrity()


def compiled_variants() -> int:
    return sum(len(v[0]) for v in _kv_copy_kernel.device_caches.values())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiles only on the GPU")
def test_serving_compiles_nothing_after_construction():
    cache = make_cache("cuda")
    n = compiled_variants()
    assert n > 0
    rng = random.Random(0)
    prompts = [[rng.randrange(1000) for _ in range(rng.randrange(20, 120))] for _ in range(6)]
    for turn in range(40):
        base = rng.choice(prompts)
        prompt = base[: rng.randrange(len(base) // 2, len(base) + 1)] + [rng.randrange(1000)] * 3
        req = cache.match(prompt)
        cache.reserve(req, len(prompt) + 4)
        cache.start_loading()
        pos = req.computed_len
        while pos < len(prompt) + 4:
            end = min(len(prompt) + 4, (pos // P + 1) * P)
            cache.begin_step(req, end)
            for layer in range(4):
                cache.wait_layer(layer, [req])
            cache.computed(req, end)
            pos = end
        req.token_ids = prompt + [1] * 4
        cache.cache_finished_req(req)
        cache.poll()
        if turn % 7 == 6:
            cache.drain()
            cache.evict(rng.randrange(16, 256))
        cache.check_integrity()
    cache.drain()
    m = cache.metrics()
    assert m["loads"] > 0 and m["backups"] > 0, m
    assert compiled_variants() == n, "serving compiled a copy-kernel variant"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="loads modules only on the GPU")
@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct"])
def test_first_load_does_not_wait_for_queued_compute(layout):
    """The first host hit of a fresh cache starts its load without waiting for the forward pass
    queued before it: every copy-kernel variant is loaded onto the GPU at construction. The
    large host-to-device variant was only compiled there, and its first launch (a module load)
    waited for the device to go idle: 46 ms of CPU behind a busy H100."""
    cfg = CacheConfig(
        layer_kinds=("full",) * 2,
        kv_heads=8,
        head_dim=128,
        page_size=P,
        device_tokens=8192,
        dtype=torch.bfloat16,
        host_ratio=2.0,
        write_policy="write_through",
        host_layout=layout,
        device="cuda",
    )
    cache = TieredKVCache(cfg)
    prompt = list(range(1, 4097))  # 4 MiB a layer: the large variant
    req = cache.match(prompt)
    cache.reserve(req, len(prompt))
    cache.computed(req, len(prompt))
    req.token_ids = prompt
    cache.cache_finished_req(req)
    cache.drain()
    cache.evict(cfg.device_tokens)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # about a second of queued "forward pass"
    queued = torch.cuda.Event()
    queued.record()
    req = cache.match(prompt + [0])
    cache.reserve(req, len(prompt) + 1)
    assert req.host_hit > 0, req
    cache.start_loading()
    assert not queued.query(), "start_loading waited for the compute stream's queued work"
    for layer in range(2):
        cache.wait_layer(layer, [req])
    torch.cuda.synchronize()
    cache.computed(req, len(prompt))
    req.token_ids = prompt
    cache.cache_finished_req(req)
    cache.drain()
    cache.check_integrity()
    cache.close()
