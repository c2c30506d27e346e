"""Paged forward: splitting a sequence into calls changes nothing, bit for bit."""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

from kvtier.example import HybridModel
from tests.example.helpers import (
    CONFIGS,
    assert_equal,
    mamba_slot,
    poisoned_pools,
    scattered_rows,
    tokens,
)

N = 18


def kv_layers(pools):
    return [
        (p, i)
        for p in (pools.full_pool, pools.swa_pool)
        if p is not None
        for i in range(p.num_layers)
    ]


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("splits", [(1,), (7,), (N - 1,), (5, 9, 10, 11)], ids=str)
def test_split_calls_equal_one_call(name: str, splits: tuple[int, ...], device) -> None:
    model = HybridModel(CONFIGS[name], device)
    toks = tokens(N, model.config.vocab, seed=1)
    ref_pools = poisoned_pools(model)
    ref_full, ref_swa = scattered_rows(ref_pools, N, seed=2)
    ref = model.forward(toks, 0, ref_full, ref_swa, mamba_slot(ref_pools), ref_pools)

    pools = poisoned_pools(model)
    full, swa = scattered_rows(pools, N, seed=3)
    bounds = (0, *splits, N)
    got = torch.cat(
        [
            model.forward(toks[a:b], a, full, swa, mamba_slot(pools), pools)
            for a, b in pairwise(bounds)
        ]
    )
    assert_equal("logits split vs one call", ref, got)
    assert_equal("logits one call vs cold", model.cold_forward(toks), ref)
    assert torch.isfinite(ref).all(), "a poisoned slot was read"
    for (ref_pool, layer), (pool, _) in zip(kv_layers(ref_pools), kv_layers(pools)):
        row, ref_row = (full, ref_full) if pool is pools.full_pool else (swa, ref_swa)
        assert_equal(f"K layer {layer}", ref_pool.k(layer)[ref_row], pool.k(layer)[row])
        assert_equal(f"V layer {layer}", ref_pool.v(layer)[ref_row], pool.v(layer)[row])
        untouched = torch.ones(pool.size, dtype=torch.bool, device=pool.device)
        untouched[row] = False
        assert pool.k(layer)[untouched].isnan().all(), f"layer {layer}: wrote outside the row"
    if pools.mamba_pool is not None:
        for ref_t, t in zip(ref_pools.mamba_pool.tensors, pools.mamba_pool.tensors):
            assert_equal("mamba state", ref_t[:, 0], t[:, 0])
            assert t[:, 1:].isnan().all(), "mamba: wrote outside the request's slot"


@pytest.mark.parametrize("name", ["full_swa", "hybrid"])
def test_swa_positions_past_the_window_may_be_unset(name: str, device) -> None:
    model = HybridModel(CONFIGS[name], device)
    W, split = model.config.swa_window, 12
    toks = tokens(N, model.config.vocab, seed=4)
    pools = poisoned_pools(model)
    full, swa = scattered_rows(pools, N, seed=5)
    slot = mamba_slot(pools)
    model.forward(toks[:split], 0, full, swa, slot, pools)
    swa_gone = swa.clone()
    swa_gone[: split - W + 1] = -1
    got = model.forward(toks[split:], split, full, swa_gone, slot, pools)
    assert_equal("logits with slid-out SWA slots", model.cold_forward(toks)[split:], got)

    swa_gone[split - W + 1] = -1  # the first new token still sees this position
    with pytest.raises(ValueError, match="swa_slots"):
        model.forward(toks[split:], split, full, swa_gone, slot, pools)


def test_wait_layer_runs_before_each_layer_touches_its_pool(device) -> None:
    model = HybridModel(CONFIGS["hybrid"], device)
    c = model.config
    pools = poisoned_pools(model)
    full, swa = scattered_rows(pools, N, seed=6)
    seen: list[int] = []

    def written(layer: int) -> bool:
        kind, i = c.pool_layer(layer)
        if kind == "mamba":
            return not pools.mamba_pool.temporal[i, 0].isnan().any()
        pool, row = (pools.full_pool, full) if kind == "full" else (pools.swa_pool, swa)
        return not pool.k(i)[row].isnan().any()

    def wait_layer(layer: int) -> None:
        seen.append(layer)
        assert [written(i) for i in range(c.num_layers)] == [i < layer for i in range(c.num_layers)]

    model.forward(tokens(N, c.vocab, seed=7), 0, full, swa, 0, pools, wait_layer)
    assert seen == list(range(c.num_layers))


@pytest.mark.parametrize("name", ["full_mamba", "hybrid"])
def test_mamba_state_matters(name: str, device) -> None:
    model = HybridModel(CONFIGS[name], device)
    split = 9
    toks = tokens(N, model.config.vocab, seed=8)
    pools = poisoned_pools(model)
    full, swa = scattered_rows(pools, N, seed=9)
    model.forward(toks[:split], 0, full, swa, 0, pools)
    mp = pools.mamba_pool
    src, dst = torch.tensor([0], device=mp.device), torch.tensor([1], device=mp.device)
    ref = model.forward(toks[split:], split, full, swa, 0, pools)
    for i in range(len(mp.tensors)):
        mp.copy_slots(src, dst)
        mp.tensors[i][:, 1] += 0.25
        got = model.forward(toks[split:], split, full, swa, 1, pools)
        assert not torch.equal(ref, got), f"mamba component {i} does not change the logits"


@pytest.mark.parametrize("name", ["full_mamba", "hybrid"])
def test_mamba_checkpoints_hold_the_state_at_their_seqlen(name: str, device) -> None:
    model = HybridModel(CONFIGS[name], device)
    toks = tokens(N, model.config.vocab, seed=10)
    pools = poisoned_pools(model)
    full, swa = scattered_rows(pools, N, seed=11)
    model.forward(toks, 0, full, swa, 0, pools, mamba_checkpoints={5: 1, 11: 2, N: 3})

    ref_pools = poisoned_pools(model)
    for a, b, slot in ((0, 5, 1), (5, 11, 2), (11, N, 3)):
        model.forward(toks[a:b], a, full, swa, 0, ref_pools)
        for i, (ref_t, t) in enumerate(zip(ref_pools.mamba_pool.tensors, pools.mamba_pool.tensors)):
            assert_equal(f"component {i} state after {b} tokens", ref_t[:, 0], t[:, slot])
