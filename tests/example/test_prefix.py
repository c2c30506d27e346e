"""A request that reuses another request's cached prefix equals a cold run, bit for bit."""

from __future__ import annotations

import pytest
import torch

from kvtier.example import HybridModel, ModelPools
from tests.example.helpers import (
    CONFIGS,
    assert_equal,
    mamba_slot,
    poisoned_pools,
    scattered_rows,
    tokens,
)


def copy_prefix(
    model: HybridModel,
    pools: ModelPools,
    src: tuple[torch.Tensor, torch.Tensor | None],
    dst: tuple[torch.Tensor, torch.Tensor | None],
    n: int,
) -> torch.Tensor | None:
    """Copy positions ``[0, n)`` slot by slot as a cache would: all FULL K/V, only the SWA
    window the next token sees (older SWA slots of ``dst`` become -1). Returns the new SWA row."""
    for l in range(pools.full_pool.num_layers):
        for s, d in zip(src[0][:n].tolist(), dst[0][:n].tolist()):
            pools.full_pool.k(l)[d] = pools.full_pool.k(l)[s]
            pools.full_pool.v(l)[d] = pools.full_pool.v(l)[s]
    if pools.swa_pool is None:
        return None
    lo = max(0, n - model.config.swa_window + 1)
    for l in range(pools.swa_pool.num_layers):
        for s, d in zip(src[1][lo:n].tolist(), dst[1][lo:n].tolist()):
            pools.swa_pool.k(l)[d] = pools.swa_pool.k(l)[s]
            pools.swa_pool.v(l)[d] = pools.swa_pool.v(l)[s]
    swa = dst[1].clone()
    swa[:lo] = -1
    return swa


@pytest.mark.parametrize("name", list(CONFIGS))
@pytest.mark.parametrize("prefix", [1, 8, 13])
def test_copied_prefix_equals_cold(name: str, prefix: int, device) -> None:
    model = HybridModel(CONFIGS[name], device)
    vocab = model.config.vocab
    shared = tokens(prefix, vocab, seed=20)
    toks_a, toks_b = shared + tokens(6, vocab, seed=21), shared + tokens(7, vocab, seed=22)
    pools = poisoned_pools(model)
    rows_a = scattered_rows(pools, len(toks_a), seed=23)
    rows_b = scattered_rows(pools, len(toks_b), seed=24, exclude=rows_a)
    has_mamba = pools.mamba_pool is not None
    # Request A runs in one call; its state at the prefix boundary is checkpointed to slot 2.
    model.forward(
        toks_a, 0, *rows_a, mamba_slot(pools), pools,
        mamba_checkpoints={prefix: 2} if has_mamba else None,
    )  # fmt: skip
    swa_b = copy_prefix(model, pools, rows_a, rows_b, prefix)
    if has_mamba:
        slot = torch.tensor([2], device=device)
        pools.mamba_pool.copy_slots(slot, slot - 1)
    got = model.forward(toks_b[prefix:], prefix, rows_b[0], swa_b, mamba_slot(pools, 1), pools)
    assert_equal("request B logits vs cold", model.cold_forward(toks_b)[prefix:], got)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_next_turn_generates_like_cold(name: str, device) -> None:
    """Turn 2 = turn 1's prompt and answer plus new tokens, continued in turn 1's rows."""
    model = HybridModel(CONFIGS[name], device)
    vocab, new = model.config.vocab, 5
    turn1 = tokens(9, vocab, seed=30)
    pools = poisoned_pools(model)
    full, swa = scattered_rows(pools, 40, seed=31)
    slot = mamba_slot(pools)
    out1 = model.generate(turn1, new, full, swa, slot, pools)
    ref1 = model.generate_cold(turn1, new)
    assert out1.tokens == ref1.tokens
    assert_equal("turn 1 logits", ref1.logits, out1.logits)

    turn2 = turn1 + out1.tokens + tokens(6, vocab, seed=32)
    cached = len(turn1) + new - 1  # the last answer token was never fed back
    out2 = model.generate(turn2, new, full, swa, slot, pools, start_pos=cached)
    ref2 = model.generate_cold(turn2, new)
    assert out2.tokens == ref2.tokens
    assert_equal("turn 2 logits", ref2.logits, out2.logits)


def test_generation_is_deterministic(device) -> None:
    config = CONFIGS["hybrid"]
    prompt = tokens(10, config.vocab, seed=40)
    ref = HybridModel(config, device).generate_cold(prompt, 6)
    again = HybridModel(config, device).generate_cold(prompt, 6)
    assert again.tokens == ref.tokens
    assert_equal("logits of a second model with the same seed", ref.logits, again.logits)
    assert ref.tokens == ref.logits.argmax(-1).tolist()
    other = HybridModel(type(config)(**{**config.__dict__, "seed": 8}), device)
    assert not torch.equal(other.generate_cold(prompt, 6).logits, ref.logits)
