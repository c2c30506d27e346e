"""Chunk math of the example decoder: random weights and each layer kind over a chunk of positions.

Every function here takes the ``M`` positions of a chunk at once, and each position's results are
bitwise the same whatever ``M`` is and wherever the chunk starts. That is what makes the model
exact under caching: a cached run and a cold run group positions into different chunks, yet every
position computes the same bytes. Three rules keep it so, on CPU and GPU alike:

- No library reduction over an axis that carries values of one position (no ``matmul``,
  ``linear``, ``sum``, ``mean``, ``softmax``): their summation order depends on the batch shape
  (BLAS kernel choice, CUDA's reduce config). Every sum is :func:`fold_sum`, a fixed tree of
  elementwise adds. ``amax`` is allowed: a maximum does not depend on order.
- Elementwise ops only from a set whose per-element result does not depend on where the element
  sits in the tensor: ``+ - * /``, ``reciprocal``, ``rsqrt``, ``exp``, ``log``, ``cos``, ``sin``
  and exact ones (casts, ``where``, ``minimum``, ``masked_fill``). On CPU, ``silu``,
  ``sigmoid``, ``softplus`` and ``log1p`` run a vector loop plus a scalar tail with a different
  formula, so an element's bits depend on the tensor's length (seen on torch 2.13 / AVX-512):
  they are spelled out here from the safe set.
- Attention reads keys on an axis whose index is fixed by position (absolute for full attention,
  offset in the window for SWA), and masked keys weigh exactly zero; :func:`fold_sum` is
  unchanged by trailing zeros, so more keys or more queries in a call change no bit of a row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtier.example.config import HybridModelConfig

__all__ = [
    "AttentionWeights",
    "MambaWeights",
    "MlpWeights",
    "attend",
    "attention_qkv",
    "fold_sum",
    "init_weights",
    "linear",
    "mamba_mix",
    "mlp",
    "rms_norm",
    "rope_cos_sin",
]

_EPS = 1e-6
# Above this softplus(x) == x in fp32; also keeps exp() from overflowing.
_SOFTPLUS_LINEAR = 20.0


@dataclass
class MlpWeights:
    """SiLU-gated MLP: ``norm [hidden]``, ``gate_up [2*ffn, hidden]`` (gate rows first),
    ``down [hidden, ffn]``."""

    norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


@dataclass
class AttentionWeights:
    """``norm [hidden]``, ``wqkv [(q_heads + 2*kv_heads)*head_dim, hidden]`` (Q rows, then K,
    then V), ``wo [hidden, q_heads*head_dim]``."""

    norm: torch.Tensor
    wqkv: torch.Tensor
    wo: torch.Tensor


@dataclass
class MambaWeights:
    """Mamba-like mixer; ``D = mamba_dim``, ``H = mamba_heads``, ``N = mamba_state``, ``K`` taps.

    ``norm [hidden]``, ``w_in [2*D + 2*H*N + H, hidden]`` (rows: x, z, B, C, dt),
    ``dt_bias``/``a_log``/``d_skip [H]``, ``conv_w [D, K]``, ``conv_b [D]``, ``out [hidden, D]``.
    """

    norm: torch.Tensor
    w_in: torch.Tensor
    dt_bias: torch.Tensor
    a_log: torch.Tensor
    d_skip: torch.Tensor
    conv_w: torch.Tensor
    conv_b: torch.Tensor
    out: torch.Tensor


Mixer = AttentionWeights | MambaWeights


def init_weights(
    config: HybridModelConfig, device: torch.device
) -> tuple[torch.Tensor, list[tuple[Mixer, MlpWeights]], torch.Tensor, torch.Tensor]:
    """Seeded fp32 weights: ``(embed [vocab, hidden], [(mixer, mlp)] per layer, final_norm
    [hidden], lm_head [vocab, hidden])``. Drawn on the CPU, so every device gets the same values."""
    gen = torch.Generator().manual_seed(config.seed)
    c = config

    def lin(out: int, fan_in: int) -> torch.Tensor:
        return torch.randn(out, fan_in, generator=gen) / math.sqrt(fan_in)

    def uniform(n: int, lo: float, hi: float) -> torch.Tensor:
        return torch.rand(n, generator=gen) * (hi - lo) + lo

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device)

    def stacked(*parts: torch.Tensor) -> torch.Tensor:
        return torch.cat(parts).to(device)

    embed = torch.randn(c.vocab, c.hidden, generator=gen).to(device)
    layers: list[tuple[Mixer, MlpWeights]] = []
    for kind in c.layer_kinds:
        mixer: Mixer
        if kind == "mamba":
            H, D, N, K = c.mamba_heads, c.mamba_dim, c.mamba_state, c.mamba_kernel
            dt = torch.exp(uniform(H, math.log(1e-3), math.log(1e-1)))
            w_in = [lin(D, c.hidden), lin(D, c.hidden), lin(H * N, c.hidden), lin(H * N, c.hidden)]
            mixer = MambaWeights(
                norm=ones(c.hidden),
                w_in=stacked(*w_in, lin(H, c.hidden)),
                dt_bias=(dt + torch.log(-torch.expm1(-dt))).to(device),  # softplus^-1(dt)
                a_log=torch.log(uniform(H, 1.0, 16.0)).to(device),
                d_skip=ones(H),
                conv_w=lin(D, K).to(device),
                conv_b=torch.zeros(D, device=device),
                out=lin(c.hidden, D).to(device),
            )
        else:
            qkv = [lin(n * c.head_dim, c.hidden) for n in (c.q_heads, c.kv_heads, c.kv_heads)]
            mixer = AttentionWeights(
                norm=ones(c.hidden),
                wqkv=stacked(*qkv),
                wo=lin(c.hidden, c.q_heads * c.head_dim).to(device),
            )
        gate_up = stacked(lin(c.ffn, c.hidden), lin(c.ffn, c.hidden))
        mlp_w = MlpWeights(
            norm=ones(c.hidden), gate_up=gate_up, down=lin(c.hidden, c.ffn).to(device)
        )
        layers.append((mixer, mlp_w))
    return embed, layers, ones(c.hidden), lin(c.vocab, c.hidden).to(device)


def fold_sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Sum over ``dim`` by folding the upper half onto the lower half until one element is left.

    The axis is first padded with zeros to a power of two ``W``; element ``i`` then meets the same
    partners in the same order whatever the other dims are, and padding to ``2W`` only adds
    ``x + 0 == x`` steps first, so trailing zeros (masked keys) never change the result.
    """
    dim %= x.dim()
    n = x.shape[dim]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        pad = list(x.shape)
        pad[dim] = width - n
        x = torch.cat([x, x.new_zeros(pad)], dim)
    while width > 1:
        width //= 2
        low, high = x.chunk(2, dim)
        x = low + high
    return x if keepdim else x.squeeze(dim)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, in] @ weight[out, in].T -> [M, out]``, each row summed by :func:`fold_sum`."""
    return fold_sum(x[:, None, :] * weight, -1)


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.reciprocal(1.0 + torch.exp(-x))


def _softplus(x: torch.Tensor) -> torch.Tensor:
    small = torch.minimum(x, torch.full_like(x, _SOFTPLUS_LINEAR))
    return torch.where(x > _SOFTPLUS_LINEAR, x, torch.log(1.0 + torch.exp(small)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [M, hidden]`` fp32 -> ``[M, hidden]``."""
    mean_sq = fold_sum(x * x, -1, keepdim=True) / x.shape[-1]
    return x * torch.rsqrt(mean_sq + _EPS) * weight


def mlp(h: torch.Tensor, w: MlpWeights) -> torch.Tensor:
    """Residual MLP block: ``h [M, hidden]`` -> ``[M, hidden]``."""
    gate, up = linear(rms_norm(h, w.norm), w.gate_up).chunk(2, dim=-1)
    return h + linear(_silu(gate) * up, w.down)


def rope_cos_sin(
    positions: torch.Tensor, config: HybridModelConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables of ``positions [M]`` (int64): ``cos, sin [M, 1, head_dim/2]`` fp32."""
    half = torch.arange(0, config.head_dim, 2, dtype=torch.float32) / config.head_dim
    inv_freq = (1.0 / config.rope_theta**half).to(positions.device)
    angle = positions.to(torch.float32)[:, None, None] * inv_freq
    return torch.cos(angle), torch.sin(angle)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [M, heads, head_dim]`` by the tables of :func:`rope_cos_sin` (rotate-half)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention_qkv(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    w: AttentionWeights,
    config: HybridModelConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated ``q [M, q_heads, head_dim]``, ``k [M, kv_heads, head_dim]`` and ``v`` (fp32) of
    ``h [M, hidden]``: one projection and one rotation for the whole chunk."""
    qh, kvh = config.q_heads, config.kv_heads
    qkv = linear(rms_norm(h, w.norm), w.wqkv).view(h.shape[0], qh + 2 * kvh, config.head_dim)
    qk = _rope(qkv[:, : qh + kvh], cos, sin)
    return qk[:, :qh], qk[:, qh:], qkv[:, qh + kvh :]


def attend(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, visible: torch.Tensor
) -> torch.Tensor:
    """Masked GQA attention of ``M`` queries over ``S`` key rows.

    Args:
        q: ``[M, q_heads, head_dim]`` fp32.
        keys, values: ``[B, S, kv_heads, head_dim]`` fp32 as read back from the pool, ``B`` 1
            (keys shared by all queries) or ``M`` (one key set per query).
        visible: ``[M, S]`` bool, at least one True per row; hidden keys get weight exactly 0.
    Returns:
        ``[M, q_heads * head_dim]`` fp32.
    """
    M, q_heads, head_dim = q.shape
    kv_heads = keys.shape[2]
    qg = q.view(M, kv_heads, q_heads // kv_heads, 1, head_dim)
    kt, vt = keys.permute(0, 2, 1, 3)[:, :, None], values.permute(0, 2, 1, 3)[:, :, None]
    scores = fold_sum(qg * kt, -1) / math.sqrt(head_dim)  # [M, kv_heads, group, S]
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    weights = torch.exp(scores - scores.amax(-1, keepdim=True))
    # A column of ones after V makes one fold give both the weighted sum and the softmax total.
    vt1 = torch.cat([vt, torch.ones_like(vt[..., :1])], -1)
    acc = fold_sum(weights[..., None] * vt1, -2)  # [M, kv_heads, group, head_dim + 1]
    return (acc[..., :head_dim] / acc[..., head_dim:]).reshape(M, -1)


def mamba_mix(
    h: torch.Tensor, w: MambaWeights, conv: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk through the Mamba-like mixer (residual included).

    Projections, conv and read-out run on the whole chunk; only the recurrence steps position by
    position (one multiply and one add each).

    Args:
        h: ``[M, hidden]`` fp32.
        conv: ``[D, K-1]`` conv inputs before the chunk, oldest first, in the pool's conv dtype.
        state: ``[H, P, N]`` fp32 recurrent state before the chunk.
    Returns:
        ``(h' [M, hidden], inputs [K-1+M, D], states [M, H, P, N])``: ``inputs`` are the conv
        inputs in the conv dtype, oldest first, so the conv state after the chunk's first ``i``
        positions is ``inputs[i : i+K-1].T``; ``states[i]`` is the state after position ``i``.
    """
    M = h.shape[0]
    H, P, N = state.shape
    D, K = w.conv_w.shape
    proj = linear(rms_norm(h, w.norm), w.w_in)
    x, z, b, c, dt = proj.split([D, D, H * N, H * N, H], dim=-1)
    dt = _softplus(dt + w.dt_bias)  # [M, H]
    # The conv sees the input as the state stores it, so a restored state replays exactly.
    inputs = torch.cat([conv.t(), x.to(conv.dtype)])  # [K-1+M, D]
    windows = inputs.unfold(0, K, 1).float()  # [M, D, K]
    xc = _silu(fold_sum(windows * w.conv_w, -1) + w.conv_b).view(M, H, P)
    decay = torch.exp(-dt * torch.exp(w.a_log))[:, :, None, None]  # [M, H, 1, 1]
    drive = (dt[:, :, None] * xc)[..., None] * b.view(M, H, 1, N)  # [M, H, P, N]
    states = torch.empty_like(drive)
    for i in range(M):
        torch.mul(decay[i], state, out=states[i])
        state = states[i].add_(drive[i])
    y = fold_sum(states * c.view(M, H, 1, N), -1) + w.d_skip.view(H, 1) * xc  # [M, H, P]
    return h + linear(y.reshape(M, D) * _silu(z), w.out), inputs, states
