"""Per-token math of the example decoder: random weights and one step of each layer kind.

Every function here takes ONE token (1-D vectors, fixed shapes that depend only on the model
and, for attention, on how many positions the token sees). That is what makes the model exact
under caching: a token's values never depend on how many other tokens a call processes, so a
cached run and a cold run execute the same kernels on the same bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtier.example.config import HybridModelConfig

__all__ = [
    "AttentionWeights",
    "MambaWeights",
    "MlpWeights",
    "attend",
    "attention_qkv",
    "init_weights",
    "mamba_step",
    "mlp",
    "rms_norm",
]

_EPS = 1e-6


@dataclass
class MlpWeights:
    """SiLU-gated MLP: ``norm [hidden]``, ``gate``/``up`` ``[ffn, hidden]``, ``down [hidden, ffn]``."""

    norm: torch.Tensor
    gate: torch.Tensor
    up: torch.Tensor
    down: torch.Tensor


@dataclass
class AttentionWeights:
    """``norm [hidden]``, ``wq [q_heads*head_dim, hidden]``, ``wk``/``wv [kv_heads*head_dim,
    hidden]``, ``wo [hidden, q_heads*head_dim]``, ``inv_freq [head_dim/2]`` (rotary)."""

    norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    inv_freq: torch.Tensor


@dataclass
class MambaWeights:
    """Mamba-like mixer; ``D = mamba_dim``, ``H = mamba_heads``, ``N = mamba_state``, ``K`` taps.

    ``norm [hidden]``, ``in_x``/``in_z [D, hidden]``, ``in_b``/``in_c [H*N, hidden]``,
    ``in_dt [H, hidden]``, ``dt_bias``/``a_log``/``d_skip [H]``, ``conv_w [D, K]``,
    ``conv_b [D]``, ``out [hidden, D]``.
    """

    norm: torch.Tensor
    in_x: torch.Tensor
    in_z: torch.Tensor
    in_b: torch.Tensor
    in_c: torch.Tensor
    in_dt: torch.Tensor
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
        return (torch.randn(out, fan_in, generator=gen) / math.sqrt(fan_in)).to(device)

    def uniform(n: int, lo: float, hi: float) -> torch.Tensor:
        return torch.rand(n, generator=gen) * (hi - lo) + lo

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, device=device)

    embed = torch.randn(c.vocab, c.hidden, generator=gen).to(device)
    layers: list[tuple[Mixer, MlpWeights]] = []
    for kind in c.layer_kinds:
        mixer: Mixer
        if kind == "mamba":
            H, D, N, K = c.mamba_heads, c.mamba_dim, c.mamba_state, c.mamba_kernel
            dt = torch.exp(uniform(H, math.log(1e-3), math.log(1e-1)))
            mixer = MambaWeights(
                norm=ones(c.hidden),
                in_x=lin(D, c.hidden),
                in_z=lin(D, c.hidden),
                in_b=lin(H * N, c.hidden),
                in_c=lin(H * N, c.hidden),
                in_dt=lin(H, c.hidden),
                dt_bias=(dt + torch.log(-torch.expm1(-dt))).to(device),  # softplus^-1(dt)
                a_log=torch.log(uniform(H, 1.0, 16.0)).to(device),
                d_skip=ones(H),
                conv_w=lin(D, K),
                conv_b=torch.zeros(D, device=device),
                out=lin(c.hidden, D),
            )
        else:
            half = torch.arange(0, c.head_dim, 2, dtype=torch.float32) / c.head_dim
            mixer = AttentionWeights(
                norm=ones(c.hidden),
                wq=lin(c.q_heads * c.head_dim, c.hidden),
                wk=lin(c.kv_heads * c.head_dim, c.hidden),
                wv=lin(c.kv_heads * c.head_dim, c.hidden),
                wo=lin(c.hidden, c.q_heads * c.head_dim),
                inv_freq=(1.0 / c.rope_theta**half).to(device),
            )
        mlp_w = MlpWeights(
            norm=ones(c.hidden),
            gate=lin(c.ffn, c.hidden),
            up=lin(c.ffn, c.hidden),
            down=lin(c.hidden, c.ffn),
        )
        layers.append((mixer, mlp_w))
    return embed, layers, ones(c.hidden), lin(c.vocab, c.hidden)


def rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x [hidden]`` fp32 -> ``[hidden]``."""
    return x * torch.rsqrt(x.pow(2).mean() + _EPS) * weight


def mlp(h: torch.Tensor, w: MlpWeights) -> torch.Tensor:
    """Residual MLP block of one token: ``h [hidden]`` -> ``[hidden]``."""
    x = rms_norm(h, w.norm)
    return h + F.linear(F.silu(F.linear(x, w.gate)) * F.linear(x, w.up), w.down)


def _rope(x: torch.Tensor, pos: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [heads, head_dim]`` to position ``pos`` (rotate-half convention)."""
    angle = inv_freq * float(pos)
    cos, sin = torch.cos(angle), torch.sin(angle)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention_qkv(
    h: torch.Tensor, pos: int, w: AttentionWeights, kv_heads: int, head_dim: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated ``q [q_heads, head_dim]``, ``k [kv_heads, head_dim]`` and ``v`` of one token, fp32."""
    x = rms_norm(h, w.norm)
    q = F.linear(x, w.wq).view(-1, head_dim)
    k = F.linear(x, w.wk).view(kv_heads, head_dim)
    v = F.linear(x, w.wv).view(kv_heads, head_dim)
    return _rope(q, pos, w.inv_freq), _rope(k, pos, w.inv_freq), v


def attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """One query over ``n`` positions with GQA.

    Args:
        q: ``[q_heads, head_dim]`` fp32.
        keys, values: ``[n, kv_heads, head_dim]`` fp32, as read back from the pool.
    Returns:
        ``[q_heads * head_dim]`` fp32.
    """
    _, kv_heads, head_dim = keys.shape
    qg = q.view(kv_heads, -1, head_dim)  # [kv_heads, group, head_dim]
    scores = qg @ keys.permute(1, 2, 0) / math.sqrt(head_dim)  # [kv_heads, group, n]
    # Spelled out: torch.softmax on CPU goes through a thread pool that costs ~ms per tiny call.
    probs = torch.exp(scores - scores.amax(-1, keepdim=True))
    probs = probs / probs.sum(-1, keepdim=True)
    out = probs @ values.permute(1, 0, 2)  # [kv_heads, group, head_dim]
    return out.reshape(-1)


def mamba_step(
    h: torch.Tensor, w: MambaWeights, conv: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One token through the Mamba-like mixer (residual included).

    Args:
        h: ``[hidden]`` fp32.
        conv: ``[D, K-1]`` previous conv inputs, oldest first, in the pool's conv dtype.
        state: ``[H, P, N]`` fp32 recurrent state.
    Returns:
        ``(h' [hidden], conv' [D, K-1], state' [H, P, N])``; the new states are fresh tensors
        whose bytes are what the pool stores.
    """
    H, P, N = state.shape
    x_in = rms_norm(h, w.norm)
    x = F.linear(x_in, w.in_x)
    z = F.linear(x_in, w.in_z)
    b = F.linear(x_in, w.in_b).view(H, 1, N)
    c = F.linear(x_in, w.in_c).view(H, 1, N)
    dt = F.softplus(F.linear(x_in, w.in_dt) + w.dt_bias).view(H, 1, 1)
    # The conv sees the input as the state stores it, so a restored state replays exactly.
    window = torch.cat([conv, x.to(conv.dtype)[:, None]], dim=1)  # [D, K]
    xc = F.silu((window.float() * w.conv_w).sum(-1) + w.conv_b).view(H, P, 1)
    a = torch.exp(-dt * torch.exp(w.a_log).view(H, 1, 1))
    state = a * state + (dt * xc) * b  # [H, P, N]
    y = (state * c).sum(-1) + w.d_skip.view(H, 1) * xc.view(H, P)
    out = F.linear(y.reshape(-1) * F.silu(z), w.out)
    return h + out, window[:, 1:].contiguous(), state
