"""A DeepSeek-V4-like example decoder: compressed attention plus a sliding window, over sidecars.

Every layer is a sliding-window attention layer (its K/V in the SWA pool). A layer with a
compress ratio ``r`` (4 or 128) also pools each group of ``r`` tokens into one compressed K/V
entry, and its queries attend over the compressed entries of every complete group plus the
window. The rule is a fixed, deterministic stand-in for V4's learned compressor, not its math:

    running_t = x_t                     (t starts a group)     x_t: the token's K and V as stored
              = running_{t-1} + x_t     (otherwise)            in the SWA pool, in fp32
    carry_t   = running_{t-1} at a group start (the previous group's sum), else carry_{t-1}
    entry_g   = (running_t + carry_t) / (2 r)   at the group's last token t (overlapping, like C4)

``(running, carry)`` is the compressor's state for the incomplete group, kept per token in an
SWA-anchored sidecar (``c{r}_state``): a request resumed at a page boundary reads the state of
the position before it from the cached window. C4 layers also keep an indexer: a per-token
feature (the sum of the first K head) compressed by the same rule into ``c4_indexer`` entries
(state in ``c4_indexer_state``); a query sees only the groups whose indexer score is >= 0 (a
stand-in for V4's top-k selection). Sums run elementwise, one position at a time, on values read
back from the pools, so every entry is bitwise the same however the positions are chunked, and
generation through the cache equals a cold run.

The FULL pool is logical: ``full_slots`` only address pages. A position's compressed entry lives
in page ``full_slots[t] // P`` at entry ``(full_slots[t] % P) // r`` of ``c{r}``; its state in
page ``swa_slots[t] // P`` at entry ``swa_slots[t] % P`` of ``c{r}_state``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from kvtier.example.config import HybridModelConfig
from kvtier.example.layers import (
    AttentionWeights,
    attend,
    attention_qkv,
    fold_sum,
    linear,
    mlp,
    rope_cos_sin,
    softmax_grid,
)
from kvtier.example.model import HybridModel, _slot_row, _window_keys
from kvtier.runtime.config import CacheConfig
from kvtier.runtime.pools.device import MHADevicePool
from kvtier.runtime.pools.sidecar import SidecarDevicePool, SidecarSpec

__all__ = ["V4Model", "V4ModelConfig", "V4Pools"]

_RATIOS = (0, 4, 128)
_INDEXED = 4  # the ratio whose layers also keep an indexer (V4's CSA layers)


@dataclass(frozen=True)
class V4ModelConfig(HybridModelConfig):
    """A V4-like decoder: every layer "swa", ``compress_ratios[i]`` 0 (window only), 4 or 128.

    The cache's page size must be a multiple of every ratio used (see :meth:`cache_config`), and
    ``swa_window >= 2`` (a group start reads the state of the position before it).
    """

    layer_kinds: tuple[str, ...] = ("swa", "swa", "swa")
    compress_ratios: tuple[int, ...] = (4, 128, 4)
    swa_window: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "compress_ratios", tuple(self.compress_ratios))
        if len(self.compress_ratios) != self.num_layers:
            raise ValueError(
                f"compress_ratios: {len(self.compress_ratios)} ratios for {self.num_layers} layers"
            )
        bad = [r for r in self.compress_ratios if r not in _RATIOS]
        if bad:
            raise ValueError(f"compress_ratios: {bad[0]!r} is not one of {_RATIOS}")
        if not any(self.compress_ratios):
            raise ValueError("compress_ratios: at least one compressed layer holds the prefix")
        if self.swa_window < 2:
            raise ValueError(f"swa_window must be >= 2, got {self.swa_window}")

    def _check_anchor(self) -> None:
        """No "full" layer: the cache's logical FULL pool keys the tree; every layer has a
        window."""
        if set(self.layer_kinds) != {"swa"}:
            raise ValueError(f"layer_kinds: every V4 layer is 'swa', got {self.layer_kinds}")

    @property
    def page_multiple(self) -> int:
        """The smallest page size every compressed group fits in."""
        return math.lcm(*(r for r in self.compress_ratios if r))

    def layers_with(self, ratio: int) -> tuple[int, ...]:
        return tuple(i for i, r in enumerate(self.compress_ratios) if r == ratio)

    def sidecars(self) -> tuple[SidecarSpec, ...]:
        """The cache's sidecars: compressed K/V and compressor states, per ratio used."""
        kv = 2 * self.kv_heads * self.head_dim
        out = []
        for r in sorted({r for r in self.compress_ratios if r}):
            layers = self.layers_with(r)
            out.append(SidecarSpec(f"c{r}", "kv", r, kv * self.dtype.itemsize, layers))
            if r == _INDEXED:
                out.append(SidecarSpec(f"c{r}_indexer", "kv", r, 4, layers))
            out.append(SidecarSpec(f"c{r}_state", "swa", 1, 2 * kv * 4, layers))
            if r == _INDEXED:
                out.append(SidecarSpec(f"c{r}_indexer_state", "swa", 1, 2 * 4, layers))
        return tuple(out)

    def cache_config(self, page_size: int, device_tokens: int, **kw) -> CacheConfig:
        """A ``CacheConfig`` for this model: logical FULL pool, SWA pool, the sidecars."""
        return CacheConfig(
            layer_kinds=self.layer_kinds,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            dtype=self.dtype,
            page_size=page_size,
            device_tokens=device_tokens,
            full_pool="logical",
            sidecars=self.sidecars(),
            swa_window=self.swa_window,
            **kw,
        )


@dataclass
class V4Pools:
    """The memory of a V4-like model: the SWA pool and the sidecars by name.

    ``kv_size`` is the logical FULL pool's token slots (no bytes; they address sidecar pages of
    ``page_size`` tokens). ``mamba_pool`` is always None (the runner's interface).
    """

    swa_pool: MHADevicePool
    sidecars: Mapping[str, SidecarDevicePool]
    kv_size: int
    page_size: int
    mamba_pool: None = None

    def check(self, config: V4ModelConfig) -> None:
        """Raise ``ValueError`` naming the pool that does not fit ``config``."""
        want = {s.name: s for s in config.sidecars()}
        if set(self.sidecars) != set(want):
            raise ValueError(
                f"pools.sidecars: expected {sorted(want)}, got {sorted(self.sidecars)}"
            )
        for name, pool in self.sidecars.items():
            if pool.spec != want[name] or pool.token_page_size != self.page_size:
                raise ValueError(f"pools.sidecars[{name!r}]: {pool.spec} does not fit {want[name]}")
        n, item = config.num_layers, (config.kv_heads, config.head_dim)
        swa = self.swa_pool
        if swa.num_layers != n or swa.item_shape != item or swa.dtype != config.dtype:
            raise ValueError(f"pools.swa_pool: expected {n} layers of {item} {config.dtype}")


class V4Model(HybridModel):
    """Random-weight V4-like decoder over a :class:`V4Pools` (see the module docstring)."""

    config: V4ModelConfig

    def new_pools(
        self,
        full_size: int,
        swa_size: int | None = None,
        mamba_size: int = 1,
        page_size: int | None = None,
    ) -> V4Pools:
        """Pools of ``full_size`` logical and ``swa_size`` SWA token slots (rounded up to pages
        of ``page_size``, default the smallest that fits every group)."""
        c = self.config
        P = page_size or c.page_multiple
        full = -(-full_size // P) * P
        swa = -(-(swa_size or full_size) // P) * P
        swa_pool = MHADevicePool(c.num_layers, swa, c.kv_heads, c.head_dim, c.dtype, self.device, P)
        pages = {"kv": full // P, "swa": swa // P}
        cars = {s.name: SidecarDevicePool(s, pages[s.anchor], P, self.device) for s in c.sidecars()}
        return V4Pools(swa_pool, cars, full, P)

    def cache_pools(self, cache) -> V4Pools:
        """The pools of a ``TieredKVCache`` built from :meth:`V4ModelConfig.cache_config`."""
        pools = V4Pools(
            cache.swa_pool, cache.sidecar_pools, cache.config.device_tokens, cache.config.page_size
        )
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
        pools: V4Pools,
        wait_layer: Callable[[int], None] | None = None,
        mamba_checkpoints: Mapping[int, int] | None = None,
    ) -> torch.Tensor:
        """Positions ``[start_pos, start_pos + n)``, as :meth:`HybridModel.forward`; the prefix
        is read from the window and the compressed entries (``full_slots`` from 0 address
        their pages), the new positions' K/V, states and entries are written."""
        c = self.config
        if mamba_slot is not None or mamba_checkpoints:
            raise ValueError("mamba_slot: a V4-like model has no Mamba layers")
        if swa_slots is None:
            raise ValueError("swa_slots: required, every V4 layer has a window")
        self._check_args(token_ids, start_pos, pools)
        end = start_pos + len(token_ids)
        full = _slot_row("full_slots", full_slots, 0, end, pools.kv_size).to(self.device)
        lo = max(0, start_pos - c.swa_window + 1)
        swa = _slot_row("swa_slots", swa_slots, lo, end, pools.swa_pool.size).to(self.device)
        positions = torch.arange(start_pos, end, device=self.device)
        cos, sin = rope_cos_sin(positions, self._rope)
        window = _window_keys(swa, positions, c.swa_window, start_pos, lo)
        h = self.embed[torch.tensor(list(token_ids), device=self.device)]
        for layer in range(c.num_layers):
            if wait_layer is not None:
                wait_layer(layer)
            mixer, mlp_w = self.layers[layer]
            assert isinstance(mixer, AttentionWeights)
            q, k, v = attention_qkv(h, cos, sin, mixer, c)
            kb, vb = pools.swa_pool.k(layer), pools.swa_pool.v(layer)
            kb[swa[start_pos:]] = k.to(kb.dtype)
            vb[swa[start_pos:]] = v.to(vb.dtype)
            keys, values, bias = kb[window.slots], vb[window.slots], window.bias
            r = c.compress_ratios[layer]
            if r:
                self._compress(layer, r, start_pos, end, full, swa, pools)
                ck, cv, cbias = self._compressed_keys(layer, r, positions, full, pools)
                keys, values = torch.cat([ck, keys]), torch.cat([cv, values])
                bias = torch.cat([cbias, bias], -1)
            counts = (bias == 0).sum(-1).flatten().tolist()
            grid = torch.tensor([softmax_grid(n) for n in counts], dtype=torch.float64)
            out = attend(q, keys, values, bias, grid.to(self.device)[:, None, None])
            h = mlp(h + linear(out, mixer.wo), mlp_w)
        return linear(h, self.lm_head).float()

    def _compress(
        self,
        layer: int,
        r: int,
        start: int,
        end: int,
        full: torch.Tensor,
        swa: torch.Tensor,
        pools: V4Pools,
    ) -> None:
        """Advance the compressor over ``[start, end)``, one position at a time (the order a
        cold run and a resumed run share); write each completed group's entries."""
        c, P = self.config, pools.page_size
        kb, vb = pools.swa_pool.k(layer), pools.swa_pool.v(layer)
        shape = (2, c.kv_heads, c.head_dim)
        kv = _Rule(pools, f"c{r}", layer, r, P, shape, c.dtype)
        idx = _Rule(pools, f"c{r}_indexer", layer, r, P, (1,), torch.float32)
        for t in range(start, end):
            s = int(swa[t])
            x = torch.stack([kb[s], vb[s]]).float()
            kv.step(t, x, swa, full)
            if idx.present:
                idx.step(t, fold_sum(x[0, 0], 0, keepdim=True), swa, full)

    def _compressed_keys(
        self, layer: int, r: int, positions: torch.Tensor, full: torch.Tensor, pools: V4Pools
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """K and V ``[G, kv_heads, head_dim]`` of the complete groups, and each query's bias
        ``[M, 1, G]``: a query sees a group once it is complete (and its indexer keeps it)."""
        c, P = self.config, pools.page_size
        end = full.numel()
        G = end // r
        firsts = full[: G * r : r]
        pages, entry = firsts // P, (firsts % P) // r
        raw = pools.sidecars[f"c{r}"].entries(layer)[pages, entry]
        kv = raw.view(c.dtype).view(G, 2, c.kv_heads, c.head_dim)
        last = torch.arange(G, device=full.device) * r + r - 1
        visible = last[None] <= positions[:, None]
        name = f"c{r}_indexer"
        if name in pools.sidecars:
            score = pools.sidecars[name].entries(layer)[pages, entry].view(torch.float32)
            visible &= score.view(1, G) >= 0
        bias = torch.where(visible, 0.0, float("-inf")).to(torch.float64)[:, None]
        return kv[:, 0], kv[:, 1], bias


class _Rule:
    """The compression rule of one sidecar pair (entries ``name``, state ``name_state``) in one
    layer: see the module docstring."""

    def __init__(self, pools: V4Pools, name: str, layer: int, r: int, P: int, shape, dtype):
        self.present = name in pools.sidecars
        if not self.present:
            return
        self.entries = pools.sidecars[name].entries(layer)
        self.states = pools.sidecars[f"{name}_state"].entries(layer)
        self.r, self.P, self.shape, self.dtype = r, P, shape, dtype

    def _state(self, swa_slot: int) -> torch.Tensor:
        """``[2, *shape]`` fp32 view of one position's ``(running, carry)``."""
        return (
            self.states[swa_slot // self.P, swa_slot % self.P]
            .view(torch.float32)
            .view(2, *self.shape)
        )

    def step(self, t: int, x: torch.Tensor, swa: torch.Tensor, full: torch.Tensor) -> None:
        """Fold position ``t``'s value ``x`` in; write the entry if it completes a group."""
        r = self.r
        if t % r == 0:
            carry = self._state(int(swa[t - 1]))[0] if t else torch.zeros_like(x)
            run = x
        else:
            prev = self._state(int(swa[t - 1]))
            run, carry = prev[0] + x, prev[1]
        self._state(int(swa[t]))[:] = torch.stack([run, carry])
        if (t + 1) % r:
            return
        s = int(full[t])
        dst = self.entries[s // self.P, (s % self.P) // r].view(self.dtype).view(self.shape)
        dst[:] = ((run + carry) / (2 * r)).to(self.dtype)
