"""End to end through the tiered cache: the example model's outputs equal a cold run exactly.

For each model family and write policy, a conversation's later turns hit the device, then (after
the device is flooded and evicted) the host; greedy tokens and logits must equal a cold run bit
for bit, and the tree's books must balance after every request.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.example import HybridModel, HybridModelConfig
from kvtier.example.demo import run_demo
from kvtier.example.runner import CachedRunner
from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig

MODELS = {
    "full": ("full", "full"),
    "full+swa": ("full", "swa", "full"),
    "full+mamba": ("full", "mamba", "full"),
    "full+swa+mamba": ("swa", "full", "mamba"),
}
P = 8


def setup(kinds, policy, device):
    mc = HybridModelConfig(
        layer_kinds=kinds,
        hidden=32,
        q_heads=2,
        kv_heads=1,
        head_dim=8,
        swa_window=6,
        mamba_heads=1,
        mamba_head_dim=8,
        mamba_state=4,
        ffn=32,
    )
    model = HybridModel(mc, device=device)
    cfg = CacheConfig(
        layer_kinds=kinds,
        kv_heads=1,
        head_dim=8,
        page_size=P,
        device_tokens=96,
        dtype=mc.dtype,
        swa_window=6 if "swa" in kinds else None,
        mamba=mc.mamba_spec() if "mamba" in kinds else None,
        mamba_slots=8 if "mamba" in kinds else None,
        host_ratio=8.0,
        write_policy=policy,
        device=str(device),
    )
    cache = TieredKVCache(cfg)
    return model, cache, CachedRunner(model, cache)


def same(got, cold) -> bool:
    return got.tokens == cold.tokens and torch.equal(got.logits.cpu(), cold.logits.cpu())


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("model_name", list(MODELS))
def test_turns_hit_device_then_host_and_equal_cold(model_name, policy, device):
    model, cache, runner = setup(MODELS[model_name], policy, device)
    gen = torch.Generator().manual_seed(11)
    history = torch.randint(0, 256, (21,), generator=gen).tolist()
    hits = []
    for turn in range(4):
        if turn == 2:  # other users flood the device; then force the rest out
            for _ in range(3):
                runner.generate(torch.randint(0, 256, (30,), generator=gen).tolist(), 2)
                cache.check_integrity()
            cache.drain()
            cache.evict(cache.config.device_tokens)
            cache.check_integrity()
        prompt = history + torch.randint(0, 256, (5,), generator=gen).tolist()
        got = runner.generate(prompt, 3)
        cache.check_integrity()
        assert same(got, model.generate_cold(prompt, 3)), f"turn {turn} differs from a cold run"
        req = runner.last_request
        hits.append((req.device_hit, req.host_hit))
        history = prompt + got.tokens
    assert hits[0] == (0, 0)
    assert hits[1][0] > 0, f"turn 1 should hit the device: {hits}"
    if policy != "write_through_selective":
        assert hits[2][1] > 0, f"turn 2 should hit the host after eviction: {hits}"
    cache.drain()
    cache.check_integrity()


def test_selective_policy_backs_up_on_second_hit(device):
    model, cache, runner = setup(MODELS["full"], "write_through_selective", device)
    prompt = list(range(40))
    runner.generate(prompt, 2)
    assert cache.metrics()["backups"] == 0, "a first use is not backed up"
    runner.generate(prompt + [1, 2], 2)
    runner.generate(prompt + [3, 4], 2)
    assert cache.metrics()["backups"] >= 1, "a node hit twice is backed up"


def test_demo_runs_and_is_exact():
    lines = []
    res = run_demo(users=3, turns=3, progress=False, out=lines.append)
    assert res.identical
    assert res.metrics["host_hit_tokens"] > 0 or res.metrics["device_hit_tokens"] > 0
    assert any("outputs equal a cold run with no cache: yes" in s for s in lines)


def test_runner_refuses_a_cache_with_other_layer_order(device):
    model, cache, _ = setup(MODELS["full+swa+mamba"], "write_through", device)
    other = HybridModel(
        HybridModelConfig(
            layer_kinds=("full", "mamba", "swa"),
            hidden=32,
            q_heads=2,
            kv_heads=1,
            head_dim=8,
            swa_window=6,
            mamba_heads=1,
            mamba_head_dim=8,
            mamba_state=4,
            ffn=32,
        ),
        device=device,
    )
    with pytest.raises(ValueError, match="cache: layer kinds"):
        CachedRunner(other, cache)


def test_a_failed_generation_releases_its_request(device):
    model, cache, runner = setup(MODELS["full+mamba"], "write_through", device)
    runner.generate(list(range(30)), 2)
    with pytest.raises(RuntimeError, match="device KV pool exhausted"):
        runner.generate(list(range(30)) + [1] * 200, 2)
    assert not cache.requests
    cache.check_integrity()
    got = runner.generate(list(range(30)) + [5, 6], 2)
    assert same(got, model.generate_cold(list(range(30)) + [5, 6], 2))
