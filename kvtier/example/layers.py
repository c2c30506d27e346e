"""Chunk math of the example decoder: random weights and each layer kind over a chunk of positions.

Every function here takes the ``M`` positions of a chunk at once, and each position's results are
bitwise the same whatever ``M`` is and wherever the chunk starts. That is what makes the model
exact under caching: a cached run and a cold run group positions into different chunks, yet every
position computes the same bytes. The rules that keep it so, on CPU and GPU alike:

- Long sums are exact. Both operands of a dot product are put on integer grids held in float64
  (:func:`quantize_rows`: ``x = q * scale``, ``|q| <= 2**bits``, ``scale`` a power of two), with
  bits chosen so that ``n * 2**(a + b) <= 2**53`` for ``n`` terms (:func:`split_bits`): every
  product and every partial sum is then an integer float64 holds exactly, so ``matmul`` and
  ``sum`` return the same bits whatever their blocking, split or order (BLAS on CPU, cuBLAS on
  GPU, any batch shape). Scaling back is by powers of two and per-element ops. The bounds hold by
  construction: a row's scale comes from its own maximum (projections, queries), or the values
  are clamped first (K and V read from the pool), or they are at most 1 (softmax weights, whose
  grid shrinks with the number of keys a query sees).
- What a row is quantized against depends only on that row (its maximum, its position), never
  on the rest of the batch; ``amax`` is fine (a maximum does not depend on order).
- Short sums (the conv's taps, the Mamba state's width) use :func:`fold_sum`, a fixed tree of
  elementwise adds.
- Elementwise ops only from a set whose per-element result does not depend on where the element
  sits in the tensor: ``+ - * /``, ``round``, ``rsqrt``, ``exp``, ``log``, ``cos``, ``sin`` and
  exact ones (casts, bit ops, ``where``, ``clamp``). On CPU, ``silu``, ``sigmoid``, ``exp2`` (and,
  reportedly, ``softplus`` and ``log1p``) run a vector loop plus a scalar tail with a different
  formula, so an element's bits depend on the tensor's length (seen on torch 2.13 / AVX-512):
  they are spelled out here from the safe set.
- Masked keys weigh exactly zero, so more keys in a call add only exact zeros to a row's sums.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvtier.example.config import HybridModelConfig

__all__ = [
    "ATTEND_OUT_SCALE",
    "KV_LIMIT",
    "MAX_KEYS",
    "AttentionWeights",
    "MambaWeights",
    "MlpWeights",
    "QuantLinear",
    "attend",
    "attention_qkv",
    "fold_sum",
    "init_weights",
    "linear",
    "mamba_mix",
    "mlp",
    "quantize_rows",
    "rope_cos_sin",
    "rope_frequencies",
    "softmax_grid",
    "split_bits",
]

# Above this softplus(x) == x in fp32; also keeps exp() from overflowing.
_SOFTPLUS_LINEAR = 20.0
# float64 holds every integer of magnitude <= 2**53 exactly.
_EXACT_BITS = 53
_EXP_SHIFT = 52
_EXP_MASK = 0x7FF << _EXP_SHIFT
# K and V read from the pool are clamped to [-KV_LIMIT, KV_LIMIT] (never reached by this model's
# values, which are O(1)); V then sits on a grid of 2**-(_V_BITS - log2 KV_LIMIT) = 2**-18, finer
# than bf16/fp16 resolves the values that matter.
_KV_LIMIT_LOG2 = 8
KV_LIMIT = float(2**_KV_LIMIT_LOG2)
_V_BITS = 26
# :func:`attend` leaves its output in V grid units, this many per unit (the projection after it
# takes the factor out for free: its input is quantized against the row's own maximum anyway).
ATTEND_OUT_SCALE = 2.0 ** (_V_BITS - _KV_LIMIT_LOG2)
# A query may see at most this many keys: its softmax grid is then at least 1 (an integer weight).
MAX_KEYS = 2 ** (_EXACT_BITS - _V_BITS)


def split_bits(n: int) -> tuple[int, int]:
    """``(a, b)`` with ``n * 2**(a + b) <= 2**53``: bits for the two operands of ``n``-term dot
    products (and ``n * 2**(2a) <= 2**53``, for a sum of squares of the first operand)."""
    budget = _EXACT_BITS - max(n - 1, 0).bit_length()
    return budget // 2, budget - budget // 2


def _pow2(bits: torch.Tensor) -> torch.Tensor:
    return bits.view(torch.float64)


def quantize_rows(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Put each row (last dim) of ``x`` on an integer grid: ``(q, scale)``, float64, with
    ``q * scale ~= x``, ``q`` integers of magnitude <= ``2**bits`` and ``scale [..., 1]`` a power of
    two fixed by the row's own largest magnitude (read off its exponent bits, so exactly)."""
    xd = x.double()
    top = torch.linalg.vector_norm(xd, float("inf"), dim=-1, keepdim=True)
    # top in [2**k, 2**(k+1)); its exponent bits are (k + 1023) << 52, those of 2**k. (A zero or
    # subnormal row has none: its scale comes out a huge finite number and its q all zeros.)
    expo = top.view(torch.int64).bitwise_and_(_EXP_MASK)
    scale = _pow2(expo + ((1 - bits) << _EXP_SHIFT))  # 2**(k + 1 - bits)
    # |x| / scale < 2**bits; dividing by a power of two is exact.
    return (xd / scale).round_(), scale


@dataclass
class QuantLinear:
    """A projection ``[out, in]`` on an integer grid: ``weight [in, out]`` float64 integers of
    magnitude <= ``2**w_bits``; inputs go on ``2**x_bits`` grids (see :func:`split_bits`).

    Without ``normalize``, ``weight * scale [out]`` (powers of two) is the real weight, transposed.
    With it, the input is RMS-normalized first and ``scale`` also holds ``sqrt(in)`` (see
    :func:`linear`)."""

    weight: torch.Tensor
    scale: torch.Tensor
    x_bits: int
    normalize: bool

    @classmethod
    def of(
        cls,
        weight: torch.Tensor,
        device: torch.device,
        norm: torch.Tensor | None = None,
        out_scale: float = 1.0,
    ) -> QuantLinear:
        """Quantize ``weight [out, in]`` (on the CPU, so every device gets the same integers).
        ``norm [in]``: an RMSNorm weight before it (folded in). ``out_scale``: a power of two
        the input carries and the output must not (folded in)."""
        if norm is not None:
            weight = weight * norm.cpu()
        fan_in = weight.shape[1]
        x_bits, w_bits = split_bits(fan_in)
        q, scale = quantize_rows(weight, w_bits)
        scale = scale.view(-1) / out_scale
        if norm is not None:
            scale = scale * math.sqrt(fan_in)
        return cls(q.t().contiguous().to(device), scale.to(device), x_bits, norm is not None)


@dataclass
class MlpWeights:
    """SiLU-gated MLP: ``gate_up [hidden -> 2*ffn]`` (gate first, pre-norm weight folded in),
    ``down [ffn -> hidden]``."""

    gate_up: QuantLinear
    down: QuantLinear


@dataclass
class AttentionWeights:
    """``wqkv [hidden -> (q_heads + 2*kv_heads)*head_dim]`` (Q, then K, then V; pre-norm weight
    folded in), ``wo [q_heads*head_dim -> hidden]``."""

    wqkv: QuantLinear
    wo: QuantLinear


@dataclass
class MambaWeights:
    """Mamba-like mixer; ``D = mamba_dim``, ``H = mamba_heads``, ``N = mamba_state``, ``K`` taps.

    ``w_in [hidden -> 2*D + 2*H*N + H]`` (rows: x, z, B, C, dt; pre-norm weight folded in),
    ``dt_bias``/``neg_a``/``d_skip [H]`` (``neg_a = -exp(a_log)``), ``conv_w [D, K]``,
    ``conv_b [D]``, ``out [D -> hidden]``.
    """

    w_in: QuantLinear
    dt_bias: torch.Tensor
    neg_a: torch.Tensor
    d_skip: torch.Tensor
    conv_w: torch.Tensor
    conv_b: torch.Tensor
    out: QuantLinear


Mixer = AttentionWeights | MambaWeights


def init_weights(
    config: HybridModelConfig, device: torch.device
) -> tuple[torch.Tensor, list[tuple[Mixer, MlpWeights]], QuantLinear]:
    """Seeded weights: ``(embed [vocab, hidden] float64, [(mixer, mlp)] per layer, lm_head
    [hidden -> vocab] with the final norm folded in)``. Drawn and quantized on the CPU, so every device gets
    the same values."""
    gen = torch.Generator().manual_seed(config.seed)
    c = config

    def lin(out: int, fan_in: int) -> torch.Tensor:
        return torch.randn(out, fan_in, generator=gen) / math.sqrt(fan_in)

    def uniform(n: int, lo: float, hi: float) -> torch.Tensor:
        return torch.rand(n, generator=gen) * (hi - lo) + lo

    def normed(*parts: torch.Tensor) -> QuantLinear:
        # The pre-norm weight is ones (a trained model's would be folded in the same way).
        return QuantLinear.of(torch.cat(parts), device, norm=torch.ones(c.hidden))

    def plain(weight: torch.Tensor, out_scale: float = 1.0) -> QuantLinear:
        return QuantLinear.of(weight, device, out_scale=out_scale)

    embed = torch.randn(c.vocab, c.hidden, generator=gen).double().to(device)
    layers: list[tuple[Mixer, MlpWeights]] = []
    for kind in c.layer_kinds:
        mixer: Mixer
        if kind == "mamba":
            H, D, N, K = c.mamba_heads, c.mamba_dim, c.mamba_state, c.mamba_kernel
            dt = torch.exp(uniform(H, math.log(1e-3), math.log(1e-1)))
            w_in = [lin(D, c.hidden), lin(D, c.hidden), lin(H * N, c.hidden), lin(H * N, c.hidden)]
            mixer = MambaWeights(
                w_in=normed(*w_in, lin(H, c.hidden)),
                dt_bias=(dt + torch.log(-torch.expm1(-dt))).double().to(device),  # softplus^-1(dt)
                neg_a=(-uniform(H, 1.0, 16.0)).double().to(device),
                d_skip=torch.ones(H, dtype=torch.float64, device=device),
                conv_w=lin(D, K).double().to(device),
                conv_b=torch.zeros(D, dtype=torch.float64, device=device),
                out=plain(lin(c.hidden, D)),
            )
        else:
            qkv = [lin(n * c.head_dim, c.hidden) for n in (c.q_heads, c.kv_heads, c.kv_heads)]
            mixer = AttentionWeights(
                wqkv=normed(*qkv),
                wo=plain(lin(c.hidden, c.q_heads * c.head_dim), out_scale=ATTEND_OUT_SCALE),
            )
        gate_up = normed(lin(c.ffn, c.hidden), lin(c.ffn, c.hidden))
        layers.append((mixer, MlpWeights(gate_up=gate_up, down=plain(lin(c.hidden, c.ffn)))))
    return embed, layers, normed(lin(c.vocab, c.hidden))


def fold_sum(x: torch.Tensor, dim: int, keepdim: bool = False) -> torch.Tensor:
    """Sum over a short ``dim`` by folding the upper half onto the lower half until one element
    is left.

    The axis is first padded with zeros to a power of two ``W``; element ``i`` then meets the same
    partners in the same order whatever the other dims are, and padding to ``2W`` only adds
    ``x + 0 == x`` steps first, so trailing zeros never change the result.
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


def linear(x: torch.Tensor, w: QuantLinear) -> torch.Tensor:
    """``x [M, in] -> [M, out]`` float64 through ``w``: one exact float64 GEMM on grid integers.

    With ``w.normalize``, RMSNorm first: ``x / rms(x) = q * sqrt(in) / |q|`` for ``x = q * s``, so
    the row's own scale cancels and ``1 / |q|`` is a per-row factor applied after the product
    (``|q|``: ``sqrt`` of an exact integer sum of squares); ``sqrt(in)`` is folded into
    ``w.scale``. (No epsilon: ``|q| >= 1`` unless the row is zero; a zero row stays zero.)
    """
    xq, scale = quantize_rows(x, w.x_bits)
    y = xq @ w.weight
    if w.normalize:
        norm = torch.linalg.vector_norm(xq, dim=-1, keepdim=True).clamp_min_(1.0)
        return y / norm * w.scale
    return y * scale * w.scale


def _silu(x: torch.Tensor) -> torch.Tensor:
    return x / (1.0 + torch.exp(-x))


def _softplus(x: torch.Tensor) -> torch.Tensor:
    small = x.clamp(max=_SOFTPLUS_LINEAR)
    return torch.where(x > _SOFTPLUS_LINEAR, x, torch.log(1.0 + torch.exp(small)))


def mlp(h: torch.Tensor, w: MlpWeights) -> torch.Tensor:
    """Residual pre-norm MLP block: ``h [M, hidden]`` -> ``[M, hidden]``."""
    gate, up = linear(h, w.gate_up).chunk(2, dim=-1)
    return h + linear(_silu(gate) * up, w.down)


def rope_frequencies(config: HybridModelConfig, device: torch.device) -> torch.Tensor:
    """``[2, head_dim]`` float64: the rotary frequencies, twice over (one per half of a head), and
    the sign of the sine for each column (rotate-half: ``-1`` for the first half)."""
    half = torch.arange(0, config.head_dim, 2, dtype=torch.float64) / config.head_dim
    inv_freq = 1.0 / config.rope_theta**half
    sign = torch.ones_like(inv_freq)
    return torch.stack([inv_freq.repeat(2), torch.cat([-sign, sign])]).to(device)


def rope_cos_sin(
    positions: torch.Tensor, frequencies: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary tables of ``positions [M]`` (int64) for :func:`rope_frequencies`, laid out for
    rotate-half over the whole head: ``cos [M, 1, head_dim]`` (``cos, cos``) and ``sin``
    (``-sin, sin``), float64."""
    inv_freq, sign = frequencies
    angle = positions.double()[:, None, None] * inv_freq
    return torch.cos(angle), torch.sin(angle) * sign


def attention_qkv(
    h: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    w: AttentionWeights,
    config: HybridModelConfig,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rotated ``q [M, q_heads, head_dim]``, ``k [M, kv_heads, head_dim]`` and ``v`` (float64)
    of ``h [M, hidden]``: one projection and one rotation for the whole chunk."""
    qh, kvh, d = config.q_heads, config.kv_heads, config.head_dim
    qkv = linear(h, w.wqkv).view(h.shape[0], qh + 2 * kvh, d)
    qk = qkv[:, : qh + kvh]
    # x * (cos, cos) + (x2, x1) * (-sin, sin): the two halves of rotate-half, bit for bit.
    swapped = torch.cat([qk[..., d // 2 :], qk[..., : d // 2]], -1)
    qk = qk * cos + swapped * sin
    return qk[:, :qh], qk[:, qh:], qkv[:, qh + kvh :]


def softmax_grid(visible_count: int) -> float:
    """The power of two that a query's softmax weights (at most 1) are scaled by before rounding:
    ``2**(53 - V bits - ceil(log2 n))`` for ``n`` visible keys (``1 <= n <= MAX_KEYS``), so the
    weighted sum of ``n`` V rows and the weights' total stay exact. Fixed by the count, which a
    query's position fixes, so a query gets the same grid in any chunk."""
    if not 1 <= visible_count <= MAX_KEYS:
        raise ValueError(f"visible_count: {visible_count} outside [1, {MAX_KEYS}]")
    return 2.0 ** (_EXACT_BITS - _V_BITS - (visible_count - 1).bit_length())


def _kv_grid(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Pool values clamped to ``[-KV_LIMIT, KV_LIMIT]`` on the integer grid of ``2**bits`` steps
    per ``KV_LIMIT``: float64 integers of magnitude <= ``2**bits``."""
    return x.double().clamp_(-KV_LIMIT, KV_LIMIT).mul_(2.0 ** (bits - _KV_LIMIT_LOG2)).round_()


def attend(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    bias: torch.Tensor,
    grid: torch.Tensor,
) -> torch.Tensor:
    """Masked GQA attention of ``M`` queries over ``S`` key rows shared by all of them.

    Args:
        q: ``[M, q_heads, head_dim]``.
        keys, values: ``[S, kv_heads, head_dim]`` as read back from the pool (any float dtype).
        bias: ``[M, 1, S]`` float64, 0 where the query sees the key and ``-inf`` where not; at
            least one 0 per query.
        grid: ``[M, 1, 1]`` float64, :func:`softmax_grid` of the query's number of visible keys
            (or of a larger count).
    Returns:
        ``[M, q_heads * head_dim]`` float64, times :data:`ATTEND_OUT_SCALE`.
    """
    M, q_heads, head_dim = q.shape
    kv_heads = keys.shape[1]
    group = q_heads // kv_heads
    q_bits, k_bits = split_bits(head_dim)
    # Heads first: [kv_heads, M, group, head_dim]; one batched GEMM per K/V head.
    qg = q.view(M, kv_heads, group, head_dim).transpose(0, 1)
    qq, q_scale = quantize_rows(qg, q_bits)
    kq = _kv_grid(keys, k_bits).permute(1, 2, 0)  # [kv_heads, head_dim, S]
    unit = 2.0 ** (_KV_LIMIT_LOG2 - k_bits) / math.sqrt(head_dim)
    dots = (qq.reshape(kv_heads, M * group, head_dim) @ kq).view(kv_heads, M, group, -1)
    # bias + product: the bias is 0 or -inf, so fused or not this rounds once.
    scores = torch.addcmul(bias, dots, q_scale * unit)
    weights = torch.exp(scores - scores.amax(-1, keepdim=True)).mul_(grid).round_()
    vq = _kv_grid(values, _V_BITS).transpose(0, 1)  # [kv_heads, S, head_dim]
    out = (weights.view(kv_heads, M * group, -1) @ vq).view(kv_heads, M, group, head_dim)
    out = out / weights.sum(-1, keepdim=True)
    return out.transpose(0, 1).reshape(M, -1)


def mamba_mix(
    h: torch.Tensor, w: MambaWeights, conv: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A chunk through the Mamba-like mixer (residual included).

    Projections, conv and read-out run on the whole chunk; only the recurrence steps position by
    position (one multiply and one add each, on tensors of one position's shape), in fp32, the
    dtype the state is stored in (so a restored state continues bit for bit).

    Args:
        h: ``[M, hidden]`` float64.
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
    proj = linear(h, w.w_in)
    x, z, b, c, dt = proj.split([D, D, H * N, H * N, H], dim=-1)
    dt = _softplus(dt + w.dt_bias)  # [M, H]
    # The conv sees the input as the state stores it, so a restored state replays exactly.
    inputs = torch.cat([conv.t(), x.to(conv.dtype)])  # [K-1+M, D]
    windows = inputs.unfold(0, K, 1).double()  # [M, D, K]
    xc = _silu(fold_sum(windows * w.conv_w, -1) + w.conv_b).view(M, H, P)
    decay = torch.exp(dt * w.neg_a).to(state.dtype)[:, :, None, None]  # [M, H, 1, 1]
    drive = ((dt[:, :, None] * xc)[..., None] * b.view(M, H, 1, N)).to(state.dtype)
    states = torch.empty_like(drive)  # [M, H, P, N]
    for i in range(M):
        torch.mul(decay[i], state, out=states[i])
        state = states[i].add_(drive[i])
    y = fold_sum(states * c.view(M, H, 1, N), -1) + w.d_skip.view(H, 1) * xc  # [M, H, P]
    return h + linear(y.reshape(M, D) * _silu(z), w.out), inputs, states
