"""The arithmetic the example model's exactness rests on (see :mod:`kvtier.example.layers`).

Integer grids in float64 make every long sum exact, so batch shape, key count and BLAS blocking
change no bit; the bounds that keep the integers below 2**53 hold; the elementwise ops the model
uses give an element the same bits wherever it sits in a tensor; short sums fold in a fixed order.
"""

from __future__ import annotations

import math

import pytest
import torch

from kvtier.example import HybridModel
from kvtier.example.layers import (
    ATTEND_OUT_SCALE,
    KV_LIMIT,
    MAX_KEYS,
    QuantLinear,
    attend,
    fold_sum,
    linear,
    quantize_rows,
    softmax_grid,
    split_bits,
)
from tests.example.helpers import CONFIGS, assert_equal, poisoned_pools, scattered_rows

EXACT = 2.0**53


def randn(*shape: int, seed: int, device, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(device)


def test_split_bits_keep_every_sum_below_2_pow_53() -> None:
    for n in (1, 2, 3, 12, 16, 17, 64, 100, 512, 1024, 1536, 4096, 1 << 20):
        a, b = split_bits(n)
        assert n * 2.0 ** (a + b) <= EXACT and n * 2.0 ** (2 * a) <= EXACT, n
        assert a >= 14 and b >= a, f"{n} terms leave too few bits: {a}, {b}"


@pytest.mark.parametrize("scale", [1e-30, 1e-3, 1.0, 7.5, 1e20])
def test_quantize_rows_gives_bounded_integers_and_power_of_two_scales(scale, device) -> None:
    x = randn(9, 37, seed=60, device=device, scale=scale)
    x[3] = 0.0  # a zero row stays zero
    x[4, 5] = 2.0 ** math.ceil(math.log2(x[4].abs().max().item()))  # a maximum on a power of 2
    for bits in (10, 23):
        q, s = quantize_rows(x, bits)
        assert q.dtype == s.dtype == torch.float64 and s.shape == (9, 1)
        assert torch.equal(q, q.round()) and q.abs().max() <= 2.0**bits
        assert not q[3].any()
        live = torch.ones(9, dtype=torch.bool, device=device)
        live[3] = False
        mantissa, _ = torch.frexp(s[live])
        assert torch.all(mantissa == 0.5), "scales must be powers of two"
        err = (q * s - x.double()).abs().amax(-1, keepdim=True)
        assert torch.all((err <= s / 2)[live]), "more than half a step of rounding error"
        assert q[live].abs().amax(-1).min() >= 2.0 ** (bits - 1), "a row must use its bits"


def test_linear_is_exact_whatever_the_batch(device) -> None:
    """Row blocks vs the whole batch: equal bits (one GEMM of grid integers either way), and
    close to the real product."""
    for n, out in ((1, 3), (12, 7), (64, 130), (1024, 96)):
        x = randn(45, n, seed=61 + n, device=device, scale=10.0)
        weight = randn(out, n, seed=62 + n, device="cpu") / math.sqrt(n)
        for norm in (None, torch.ones(n)):
            w = QuantLinear.of(weight, torch.device(device), norm=norm)
            whole = linear(x, w)
            rows = torch.cat([linear(x[i : i + 1], w) for i in range(45)])
            assert_equal(f"linear over {n} (norm={norm is not None}): rows vs batch", rows, whole)
            blocks = torch.cat([linear(x[i : i + 7], w) for i in range(0, 45, 7)])
            assert_equal(f"linear over {n}: blocks of 7 vs batch", blocks, whole)
            xr = x.double().cpu()
            if norm is not None:
                xr = xr / xr.pow(2).mean(-1, keepdim=True).sqrt()
            ref = xr @ weight.double().t()
            err = (whole.cpu() - ref).abs().max() / ref.abs().max()
            assert err < 1e-5, f"linear over {n}: relative error {err}"


def test_attention_ignores_batch_and_hidden_keys(device) -> None:
    """A query's output is the same alone or in a batch, and with more hidden keys after (or
    between) its visible ones; it matches a float64 softmax closely."""
    M, S, q_heads, kv_heads, d = 5, 11, 6, 2, 12
    group = q_heads // kv_heads
    q = randn(M, q_heads, d, seed=63, device=device, scale=3.0)
    keys = randn(S, kv_heads, d, seed=64, device=device).to(torch.bfloat16)
    values = randn(S, kv_heads, d, seed=65, device=device).to(torch.bfloat16)
    visible = randn(M, S, seed=66, device=device) > 0
    visible[:, 0] = True
    count = visible.sum(-1).tolist()

    def run(rows: torch.Tensor, keep: torch.Tensor, extra_count: int = 0) -> torch.Tensor:
        bias = torch.zeros(len(rows), 1, int(keep.sum()), dtype=torch.float64, device=device)
        bias.masked_fill_(~visible[rows][:, None, keep], float("-inf"))
        grid = [softmax_grid(count[m] + extra_count) for m in rows.tolist()]
        grid = torch.tensor(grid, dtype=torch.float64, device=device)[:, None, None]
        return attend(q[rows], keys[keep], values[keep], bias, grid)

    everything = torch.arange(M, device=device)
    all_keys = torch.ones(S, dtype=torch.bool, device=device)
    whole = run(everything, all_keys)
    for m in range(M):
        alone = run(everything[m : m + 1], all_keys)
        assert_equal(f"query {m} alone vs in a batch", alone, whole[m : m + 1])
        only_visible = run(everything[m : m + 1], visible[m])
        assert_equal(f"query {m} without its hidden keys", only_visible, whole[m : m + 1])
    # A grid for more keys than are visible is still exact; it only rounds more finely.
    assert torch.isfinite(run(everything, all_keys, extra_count=1000)).all()
    scores = torch.einsum(
        "mkgd,skd->mkgs", q.double().view(M, kv_heads, group, d), keys.double()
    ) / math.sqrt(d)
    weights = scores.masked_fill(~visible[:, None, None], float("-inf")).softmax(-1)
    ref = torch.einsum("mkgs,skd->mkgd", weights, values.double()).reshape(M, -1)
    err = (whole / ATTEND_OUT_SCALE - ref).abs().max()
    assert err < 1e-4, f"attention error {err}"


def test_softmax_grid_bounds_the_weighted_sum() -> None:
    for n in (1, 2, 3, 4, 5, 1000, 1024, 1025, MAX_KEYS - 1, MAX_KEYS):
        grid = softmax_grid(n)
        assert grid * (1 << (n - 1).bit_length()) == MAX_KEYS, (n, grid)
        # n weights of at most grid each, times V integers of at most 2**26: within 2**53.
        assert n * grid * 2.0**26 <= EXACT and grid >= 1, (n, grid)
    for n in (0, MAX_KEYS + 1):
        with pytest.raises(ValueError, match="visible_count"):
            softmax_grid(n)
    assert KV_LIMIT >= 16, "K/V of this model's scale must not be clamped"


def test_forward_refuses_more_positions_than_the_grid_allows(device) -> None:
    model = HybridModel(CONFIGS["full"], device)
    pools = poisoned_pools(model)
    full, _ = scattered_rows(pools, 4, seed=67)
    with pytest.raises(ValueError, match="start_pos: .* exceed"):
        model.forward([1, 2], MAX_KEYS - 1, full, None, None, pools)


# Every elementwise op layers.py applies to whole [M, ...] tensors, on inputs of its range, and
# the row reductions it relies on being exact (integer sums of squares, maxima).
ELEMENTWISE = {
    "exp": lambda x: torch.exp(-x.abs()),
    "exp_silu": lambda x: x / (1.0 + torch.exp(-x)),
    "log": lambda x: torch.log(1.0 + torch.exp(x.clamp(max=20.0))),
    "div_round": lambda x: (x / 0.125).round_(),
    "cos_sin": lambda x: torch.cos(x * 30) * torch.sin(x * 30),
    "clamp_mul_round": lambda x: x.clamp(-1.0, 1.0).mul_(2.0**20).round_(),
    "norm2_of_integers": lambda x: torch.linalg.vector_norm((x * 2**20).round(), dim=-1),
    "max_abs": lambda x: torch.linalg.vector_norm(x, float("inf"), dim=-1),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("name", list(ELEMENTWISE))
def test_elementwise_ops_do_not_depend_on_tensor_length(name, dtype, device) -> None:
    """On CPU some ops (silu, sigmoid, exp2) run a vector loop and a scalar tail with different
    formulas; the ones the model uses must give each element (row, for the reductions) the same
    bits however many rows the tensor has."""
    f = ELEMENTWISE[name]
    x = randn(300, 37, seed=68, device=device, scale=4.0).to(dtype)
    ref = torch.cat([f(x[i : i + 1]) for i in range(300)])
    for n in (2, 3, 7, 8, 9, 16, 17, 33, 64, 100, 300):
        for start in (0, 1, 300 - n):
            got = f(x[start : start + n])
            assert_equal(f"{name} on {n} rows from {start}", ref[start : start + n], got)


def test_fold_sum_ignores_batch_shape_and_trailing_zeros(device) -> None:
    """The short sums (conv taps, Mamba read-out) fold in a fixed order."""
    gen = torch.Generator().manual_seed(56)
    for n in (1, 3, 12, 16, 37):
        x = torch.randn(9, 5, n, generator=gen).to(device) * 100
        ref = torch.stack([fold_sum(x[i, j], -1) for i in range(9) for j in range(5)]).view(9, 5)
        assert_equal(f"fold_sum over {n}: batched vs one row at a time", ref, fold_sum(x, -1))
        padded = torch.cat([x, torch.zeros(9, 5, 2 * n + 1, device=device)], -1)
        assert_equal(f"fold_sum over {n}: with trailing zeros", ref, fold_sum(padded, -1))
