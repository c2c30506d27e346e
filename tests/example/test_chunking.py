"""A chunk is computed in one forward, and however a prompt is cut into chunks, every bit agrees.

The model prefills a chunk with one projection, one rotation and one masked attention per layer;
these tests prove that grouping positions differently changes no logit and no pool byte (full
K/V, SWA K/V, Mamba state), on the test shapes and on the demo's wider model, and that the
per-layer functions run once per layer per forward. The math they rest on is tested in
``test_exact_math.py``.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch

import kvtier.example.model as model_module
from kvtier.example import HybridModel
from kvtier.example.demo import DemoConfig
from tests.example.helpers import (
    CONFIGS,
    assert_equal,
    mamba_slot,
    poisoned_pools,
    scattered_rows,
    tokens,
)

# Long enough that the full-attention key axis crosses a power of two (32 -> 64) mid-prompt.
N = 35


def chunk_bounds(size: int, first: int) -> list[int]:
    """``0, first, first + size, ...`` up to ``N``: one short chunk, then chunks of ``size``."""
    bounds = [0] + ([first] if 0 < first < N else [])
    while bounds[-1] < N:
        bounds.append(min(N, bounds[-1] + size))
    return bounds


def run_chunks(model: HybridModel, toks: list[int], bounds: list[int], seed: int):
    """Forward ``toks`` chunk by chunk as a runner does: before each chunk the SWA slots that
    slid out of every query's window are marked -1 and poisoned, so a read of one would show."""
    pools = poisoned_pools(model)
    full, swa = scattered_rows(pools, N, seed=seed)
    swa_row = swa.clone() if swa is not None else None
    W = model.config.swa_window
    logits = []
    for a, b in pairwise(bounds):
        if swa_row is not None:
            gone = swa_row[: max(0, a - W + 1)]
            for layer in range(pools.swa_pool.num_layers):
                pools.swa_pool.k(layer)[gone[gone >= 0]] = float("nan")
                pools.swa_pool.v(layer)[gone[gone >= 0]] = float("nan")
            gone.fill_(-1)
        logits.append(model.forward(toks[a:b], a, full, swa_row, mamba_slot(pools), pools))
    return torch.cat(logits), pools, full, swa


def assert_same_state(model, ref, got) -> None:
    """Logits, every position's full K/V, the SWA K/V still in the window, the Mamba slot."""
    (ref_logits, ref_pools, ref_full, ref_swa), (logits, pools, full, swa) = ref, got
    assert torch.isfinite(logits).all(), "a poisoned or freed slot was read"
    assert_equal("logits", ref_logits, logits)
    kept = slice(N - model.config.swa_window + 1, N)
    for name, ref_pool, pool, ref_row, row in (
        ("full", ref_pools.full_pool, pools.full_pool, ref_full, full),
        ("swa", ref_pools.swa_pool, pools.swa_pool, ref_swa, swa),
    ):
        if pool is None:
            continue
        if name == "swa":
            ref_row, row = ref_row[kept], row[kept]
        for layer in range(pool.num_layers):
            assert_equal(f"{name} K layer {layer}", ref_pool.k(layer)[ref_row], pool.k(layer)[row])
            assert_equal(f"{name} V layer {layer}", ref_pool.v(layer)[ref_row], pool.v(layer)[row])
    if pools.mamba_pool is not None:
        for i, (ref_t, t) in enumerate(zip(ref_pools.mamba_pool.tensors, pools.mamba_pool.tensors)):
            assert_equal(f"mamba component {i}", ref_t[:, 0], t[:, 0])


@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_chunk_size_and_offset_equals_one_chunk(name: str, device) -> None:
    model = HybridModel(CONFIGS[name], device)
    toks = tokens(N, model.config.vocab, seed=50 + len(name))
    ref = run_chunks(model, toks, [0, N], seed=51)
    for size in range(1, N + 1):
        for first in sorted({0, 1 + size // 2, 1 + (7 * size) % N}):
            got = run_chunks(model, toks, chunk_bounds(size, first), seed=52 + size)
            assert_same_state(model, ref, got)


@pytest.mark.parametrize("name", ["full_swa", "hybrid"])
def test_reading_a_freed_swa_slot_is_refused(name: str, device) -> None:
    """A -1 inside some query's window is refused before any pool is touched; just outside the
    window of every query it is fine (that is what the runner passes)."""
    model = HybridModel(CONFIGS[name], device)
    W, split = model.config.swa_window, 20
    toks = tokens(N, model.config.vocab, seed=53)
    pools = poisoned_pools(model)
    full, swa = scattered_rows(pools, N, seed=54)
    slot = mamba_slot(pools)
    model.forward(toks[:split], 0, full, swa, slot, pools)
    snapshot = [t.clone() for t in (pools.full_pool.k_buffer, pools.swa_pool.k_buffer)]
    swa_gone = swa.clone()
    swa_gone[: split - W + 1] = -1
    swa_gone[split - W + 1] = -1  # the first new token still sees this position
    with pytest.raises(ValueError, match=rf"swa_slots: .*position {split - W + 1} has slot -1"):
        model.forward(toks[split:], split, full, swa_gone, slot, pools)
    for before, after in zip(snapshot, (pools.full_pool.k_buffer, pools.swa_pool.k_buffer)):
        assert torch.equal(before.nan_to_num(7.0), after.nan_to_num(7.0)), "a refused call wrote"


def test_one_call_per_layer_per_forward(device, monkeypatch) -> None:
    """The chunk goes through each per-layer function once, whatever its length."""
    model = HybridModel(CONFIGS["hybrid"], device)
    c = model.config
    calls: dict[str, int] = {}

    def counting(name: str):
        real = getattr(model_module, name)

        def wrapper(*args, **kwargs):
            calls[name] = calls.get(name, 0) + 1
            return real(*args, **kwargs)

        return wrapper

    for name in ("attention_qkv", "attend", "mamba_mix", "mlp"):
        monkeypatch.setattr(model_module, name, counting(name))
    pools = poisoned_pools(model)
    full, swa = scattered_rows(pools, N, seed=55)
    attn = len(c.layers_of("full")) + len(c.layers_of("swa"))
    mamba = len(c.layers_of("mamba"))
    for a, b in ((0, N - 1), (N - 1, N)):  # a long prefill, then a decode step
        calls.clear()
        model.forward(tokens(b - a, c.vocab, seed=a), a, full, swa, 0, pools)
        expected = {"attention_qkv": attn, "attend": attn, "mamba_mix": mamba}
        assert calls == {**expected, "mlp": c.num_layers}, f"positions [{a}, {b})"


def test_demo_model_chunkings_equal_one_chunk(device) -> None:
    """The demo's wider default model (GEMM-sized projections) under a few chunkings."""
    model = HybridModel(DemoConfig().model, device)
    toks = tokens(N, model.config.vocab, seed=57)
    ref = run_chunks(model, toks, [0, N], seed=58)
    for size, first in ((1, 0), (16, 0), (16, 7), (5, 3)):
        assert_same_state(model, ref, run_chunks(model, toks, chunk_bounds(size, first), seed=59))
