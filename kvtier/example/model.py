"""The example hybrid decoder: paged full/SWA attention and a Mamba-like layer over kvtier pools.

``forward`` runs layer by layer (so a cache can load layer ``l`` while layer ``l - 1`` computes)
and, inside a layer, the whole chunk at once, as a serving engine's prefill does: one projection,
one rotation, one K/V scatter into the pool and one masked attention over [cached context +
chunk]; a decode step is a chunk of one. Each position's outputs are bitwise the same however the
positions are grouped into calls (see :mod:`kvtier.example.layers` for how), so what a position
writes to the pools and its logits do not depend on where its prefix came from.

Slot rows, for one request (``P = start_pos``, ``n = len(token_ids)``)::

    position      0 ... P-1 | P ... P+n-1
    full_slots    cached    | written now        (all read: full attention)
    swa_slots     -1 ok ..  | written now        (read: [t - swa_window + 1, t] for each t)
                  ^ needed from P - swa_window + 1
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import torch

from kvtier.example.config import HybridModelConfig
from kvtier.example.layers import (
    MAX_KEYS,
    AttentionWeights,
    MambaWeights,
    attend,
    attention_qkv,
    init_weights,
    linear,
    mamba_mix,
    mlp,
    rope_cos_sin,
    rope_frequencies,
    softmax_grid,
)
from kvtier.example.pools import ModelPools
from kvtier.runtime.pools.device import MHADevicePool

__all__ = ["Generation", "HybridModel", "HybridModelConfig", "ModelPools"]


class Generation(NamedTuple):
    """Greedy output: ``tokens[i]`` is the argmax of ``logits[i]`` (``[len(tokens), vocab]`` fp32)."""

    tokens: list[int]
    logits: torch.Tensor


class _KeyPlan(NamedTuple):
    """Which pool slots an attention layer reads for a chunk, shared by all its queries:
    ``slots [S]`` (never -1), ``bias [M, 1, S]`` float64 (0 where a query sees the key, ``-inf``
    where not) and ``grid [M, 1, 1]`` (:func:`softmax_grid`), the layout :func:`attend` takes."""

    slots: torch.Tensor
    bias: torch.Tensor
    grid: torch.Tensor


def _key_plan(slots: torch.Tensor, visible: torch.Tensor, counts: list[int]) -> _KeyPlan:
    bias = torch.where(visible, 0.0, float("-inf")).to(torch.float64)[:, None]
    grid = [softmax_grid(n) for n in counts]
    return _KeyPlan(
        slots, bias, torch.tensor(grid, dtype=torch.float64).to(slots.device)[:, None, None]
    )


def _full_keys(row: torch.Tensor, positions: torch.Tensor, start: int) -> _KeyPlan:
    """Keys: positions ``[0, end)``; query ``t`` sees ``[0, t]``. Sums over keys are exact, so
    where a key sits on the axis, and how many hidden keys follow, change no bit."""
    end = row.numel()
    j = torch.arange(end, device=row.device)
    return _key_plan(row, j[None] <= positions[:, None], list(range(start + 1, end + 1)))


def _window_keys(
    row: torch.Tensor, positions: torch.Tensor, window: int, start: int, lo: int
) -> _KeyPlan:
    """Keys: positions ``[lo, end)`` (``lo`` is where the first query's window starts); query
    ``t`` sees ``[t - window + 1, t]``."""
    end = row.numel()
    j = torch.arange(lo, end, device=row.device)[None]
    t = positions[:, None]
    visible = (j <= t) & (j > t - window)
    return _key_plan(row[lo:], visible, [min(t + 1, window) for t in range(start, end)])


def _slot_row(name: str, row: torch.Tensor | None, lo: int, end: int, size: int) -> torch.Tensor:
    """Check that ``row[lo:end]`` are slots of a ``size``-slot pool; return ``row[:end]``."""
    if not isinstance(row, torch.Tensor) or row.dtype != torch.int64 or row.dim() != 1:
        got = f"{row.dtype} {tuple(row.shape)}" if isinstance(row, torch.Tensor) else type(row)
        raise ValueError(f"{name}: expected a 1-D int64 tensor, got {got}")
    if row.numel() < end:
        raise ValueError(f"{name}: {row.numel()} slots for positions [0, {end})")
    used = row[lo:end]
    low, high = (int(v) for v in torch.aminmax(used))  # one reduction on the common path
    if low < 0 or high >= size:  # checked here so that no slot, -1 least of all, indexes a pool
        i = int(((used < 0) | (used >= size)).nonzero()[0])
        raise ValueError(
            f"{name}: slots of positions [{lo}, {end}) must lie in [0, {size}) (the new tokens "
            f"read them); position {lo + i} has slot {int(used[i])}"
        )
    return row[:end]


class HybridModel:
    """Random-weight hybrid decoder over kvtier's device pools (see module docstring).

    Args:
        config: shapes, dtypes and seed; equal configs give bitwise-equal weights.
        device: where weights and compute live; the pools passed in must be there too.
    """

    def __init__(self, config: HybridModelConfig, device: torch.device | str = "cpu") -> None:
        self.config = config
        self.device = torch.device(device)
        self.embed, self.layers, self.lm_head = init_weights(config, self.device)
        self._rope = rope_frequencies(config, self.device)

    def new_pools(
        self, full_size: int, swa_size: int | None = None, mamba_size: int = 1, page_size: int = 1
    ) -> ModelPools:
        """Pools for this model on its device (see :meth:`ModelPools.create`)."""
        return ModelPools.create(
            self.config, full_size, swa_size, mamba_size, self.device, page_size
        )

    def cache_pools(self, cache) -> ModelPools:
        """The device pools of a ``TieredKVCache`` as this model's pools (checked)."""
        pools = ModelPools(cache.full_pool, cache.swa_pool, cache.mamba_pool)
        pools.check(self.config)
        return pools

    @torch.no_grad()
    def forward(
        self,
        token_ids: Sequence[int],
        start_pos: int,
        full_slots: torch.Tensor,
        swa_slots: torch.Tensor | None,
        mamba_slot: int | None,
        pools: ModelPools,
        wait_layer: Callable[[int], None] | None = None,
        mamba_checkpoints: Mapping[int, int] | None = None,
    ) -> torch.Tensor:
        """Compute positions ``[start_pos, start_pos + n)`` of one request, reading its prefix
        from the pools and writing the new tokens' K/V and Mamba state into them.

        Args:
            token_ids: the ``n >= 1`` new tokens.
            start_pos: tokens already in the pools (K/V at their slots, Mamba state in
                ``mamba_slot`` as of exactly ``start_pos`` tokens). At 0 the state is reset.
            full_slots: int64 ``[>= start_pos + n]``; ``full_slots[t]`` is position ``t``'s slot in
                ``pools.full_pool``. Entries past ``start_pos + n`` are ignored.
            swa_slots: like ``full_slots`` for ``pools.swa_pool``; only positions from
                ``start_pos - swa_window + 1`` on are read, older ones may be -1. Required iff the
                model has SWA layers.
            mamba_slot: the request's slot in ``pools.mamba_pool``; required iff the model has
                Mamba layers. Holds the state after ``start_pos + n`` tokens on return.
            pools: the pools of this model.
            wait_layer: called with each global layer index before that layer touches a pool
                (layer-wise load-back waits there).
            mamba_checkpoints: ``{seqlen: slot}`` with ``start_pos < seqlen <= start_pos + n``:
                also store the state after ``seqlen`` tokens into ``slot`` (for prefix caching
                at a boundary inside this call).
        Returns:
            ``[n, vocab]`` fp32 logits; row ``i`` predicts position ``start_pos + i + 1``.
        """
        c = self.config
        end = start_pos + len(token_ids)
        self._check_args(token_ids, start_pos, pools)
        full = _slot_row("full_slots", full_slots, 0, end, pools.full_pool.size)
        full = full.to(self.device)
        swa = None
        if c.layers_of("swa"):
            if swa_slots is None:
                raise ValueError("swa_slots: required, the model has SWA layers")
            lo = max(0, start_pos - c.swa_window + 1)
            swa = _slot_row("swa_slots", swa_slots, lo, end, pools.swa_pool.size).to(self.device)
        checkpoints = self._check_mamba(mamba_slot, mamba_checkpoints, start_pos, end, pools)

        positions = torch.arange(start_pos, end, device=self.device)
        cos, sin = rope_cos_sin(positions, self._rope)
        plans = {"full": _full_keys(full, positions, start_pos)}
        if swa is not None:
            plans["swa"] = _window_keys(swa, positions, c.swa_window, start_pos, lo)
        h = self.embed[torch.tensor(list(token_ids), device=self.device)]  # [n, hidden]
        for layer, kind in enumerate(c.layer_kinds):
            if wait_layer is not None:
                wait_layer(layer)
            mixer, mlp_w = self.layers[layer]
            idx = c.pool_layer(layer)[1]
            if kind == "mamba":
                assert isinstance(mixer, MambaWeights)
                h = self._mamba_layer(h, start_pos, mixer, idx, pools, mamba_slot, checkpoints)
            else:
                assert isinstance(mixer, AttentionWeights)
                pool = pools.full_pool if kind == "full" else pools.swa_pool
                new_slots = (full if kind == "full" else swa)[start_pos:]
                h = self._attention_layer(h, cos, sin, mixer, pool, idx, new_slots, plans[kind])
            h = mlp(h, mlp_w)
        return linear(h, self.lm_head).float()

    def _attention_layer(
        self,
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        w: AttentionWeights,
        pool: MHADevicePool,
        layer: int,
        new_slots: torch.Tensor,
        keys: _KeyPlan,
    ) -> torch.Tensor:
        """Write the chunk's K/V at ``new_slots``, then attend over the keys of ``keys`` read back
        from the pool (so fresh and cached positions look alike)."""
        k_buf, v_buf = pool.k(layer), pool.v(layer)
        q, k, v = attention_qkv(h, cos, sin, w, self.config)
        k_buf[new_slots] = k.to(k_buf.dtype)
        v_buf[new_slots] = v.to(v_buf.dtype)
        out = attend(q, k_buf[keys.slots], v_buf[keys.slots], keys.bias, keys.grid)
        return h + linear(out, w.wo)

    def _mamba_layer(
        self,
        h: torch.Tensor,
        start_pos: int,
        w: MambaWeights,
        layer: int,
        pools: ModelPools,
        slot: int,
        checkpoints: Mapping[int, int],
    ) -> torch.Tensor:
        """Run the chunk from the slot's state; store the state after it (and at checkpoints)."""
        pool = pools.mamba_pool
        temporal, conv_buf = pool.temporal[layer], pool.convs[0][layer]
        if start_pos == 0:
            state, conv = torch.zeros_like(temporal[slot]), torch.zeros_like(conv_buf[slot])
        else:
            state, conv = temporal[slot], conv_buf[slot]
        h, inputs, states = mamba_mix(h, w, conv, state)
        taps = conv_buf.shape[-1]
        for seqlen, dst in checkpoints.items():
            i = seqlen - start_pos
            temporal[dst], conv_buf[dst] = states[i - 1], inputs[i : i + taps].t()
        temporal[slot], conv_buf[slot] = states[-1], inputs[-taps:].t()
        return h

    def _check_args(self, token_ids: Sequence[int], start_pos: int, pools: ModelPools) -> None:
        if len(token_ids) == 0:
            raise ValueError("token_ids: need at least one new token")
        bad = [t for t in token_ids if not 0 <= int(t) < self.config.vocab]
        if bad:
            raise ValueError(f"token_ids: {bad[:4]} outside [0, {self.config.vocab})")
        if start_pos < 0:
            raise ValueError(f"start_pos must be >= 0, got {start_pos}")
        if start_pos + len(token_ids) > MAX_KEYS:  # past it the attention sums could round
            raise ValueError(
                f"start_pos: {start_pos} + {len(token_ids)} tokens exceed {MAX_KEYS} positions"
            )
        pools.check(self.config)

    def _check_mamba(
        self,
        mamba_slot: int | None,
        checkpoints: Mapping[int, int] | None,
        start_pos: int,
        end: int,
        pools: ModelPools,
    ) -> dict[int, int]:
        if not self.config.layers_of("mamba"):
            if checkpoints:
                raise ValueError("mamba_checkpoints: the model has no Mamba layers")
            return {}
        size = pools.mamba_pool.size
        if mamba_slot is None or not 0 <= mamba_slot < size:
            raise ValueError(f"mamba_slot: need a slot in [0, {size}), got {mamba_slot}")
        checkpoints = dict(checkpoints or {})
        for seqlen, slot in checkpoints.items():
            if not start_pos < seqlen <= end:
                raise ValueError(f"mamba_checkpoints: seqlen {seqlen} outside ({start_pos}, {end}]")
            if not 0 <= slot < size or slot == mamba_slot:
                raise ValueError(f"mamba_checkpoints: slot {slot} not a free slot in [0, {size})")
        if len(set(checkpoints.values())) != len(checkpoints):
            raise ValueError("mamba_checkpoints: slots must be distinct")
        return checkpoints

    def generate(
        self,
        token_ids: Sequence[int],
        max_new_tokens: int,
        full_slots: torch.Tensor,
        swa_slots: torch.Tensor | None,
        mamba_slot: int | None,
        pools: ModelPools,
        start_pos: int = 0,
        wait_layer: Callable[[int], None] | None = None,
    ) -> Generation:
        """Greedy decoding of ``max_new_tokens`` after the prompt ``token_ids``.

        The first ``start_pos < len(token_ids)`` prompt tokens must already be in the pools (as
        for :meth:`forward`); the rest are prefilled in one call, then each new token but the
        last is fed back one call at a time. Slot rows must cover
        ``len(token_ids) + max_new_tokens - 1`` positions; on return the pools hold K/V of all of
        them and ``mamba_slot`` holds the state after them.
        """
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        if not 0 <= start_pos < len(token_ids):
            raise ValueError(
                f"start_pos: {start_pos} must be in [0, {len(token_ids)}): the last prompt "
                "token is recomputed to get its logits"
            )
        args = (full_slots, swa_slots, mamba_slot, pools, wait_layer)
        logits = [self.forward(list(token_ids[start_pos:]), start_pos, *args)[-1]]
        tokens = [int(logits[-1].argmax())]
        for pos in range(len(token_ids), len(token_ids) + max_new_tokens - 1):
            logits.append(self.forward([tokens[-1]], pos, *args)[-1])
            tokens.append(int(logits[-1].argmax()))
        return Generation(tokens, torch.stack(logits))

    def _scratch(self, num_tokens: int) -> tuple[ModelPools, torch.Tensor]:
        pools = self.new_pools(num_tokens)
        return pools, torch.arange(num_tokens, dtype=torch.int64, device=self.device)

    def cold_forward(self, token_ids: Sequence[int]) -> torch.Tensor:
        """Reference: ``[n, vocab]`` logits of the whole sequence from private scratch pools."""
        pools, slots = self._scratch(len(token_ids))
        swa = slots if pools.swa_pool is not None else None
        mamba = 0 if pools.mamba_pool is not None else None
        return self.forward(token_ids, 0, slots, swa, mamba, pools)

    def generate_cold(self, token_ids: Sequence[int], max_new_tokens: int) -> Generation:
        """Reference: :meth:`generate` from scratch pools, no cache."""
        pools, slots = self._scratch(len(token_ids) + max_new_tokens)
        swa = slots if pools.swa_pool is not None else None
        mamba = 0 if pools.mamba_pool is not None else None
        return self.generate(token_ids, max_new_tokens, slots, swa, mamba, pools)
