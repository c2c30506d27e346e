"""Shared builders for the example-model tests: configs, poisoned pools, scattered slot rows."""

from __future__ import annotations

import torch

from kvtier.example import HybridModel, HybridModelConfig, ModelPools

CONFIGS = {
    "full": HybridModelConfig(layer_kinds=("full", "full")),
    "full_swa": HybridModelConfig(layer_kinds=("full", "swa", "swa"), swa_window=5),
    "full_mamba": HybridModelConfig(layer_kinds=("mamba", "full", "mamba")),
    # Awkward shapes: odd GQA group, non-power-of-2 head dim, 3-tap conv, fp16 storage.
    "hybrid": HybridModelConfig(
        layer_kinds=("full", "swa", "mamba", "swa", "full", "mamba"),
        q_heads=3,
        kv_heads=1,
        head_dim=12,
        swa_window=4,
        mamba_heads=3,
        mamba_head_dim=10,
        mamba_state=6,
        mamba_kernel=3,
        dtype=torch.float16,
        seed=7,
    ),
}
POOL_SIZE = 64
MAMBA_SLOTS = 4


def first_mismatch(name: str, ref: torch.Tensor, got: torch.Tensor) -> str:
    """A failure message naming what was compared and the first differing index."""
    if ref.shape != got.shape:
        return f"{name}: shape {tuple(got.shape)} != reference {tuple(ref.shape)}"
    diff = (ref != got) & ~(ref.isnan() & got.isnan())
    idx = diff.nonzero()
    if not idx.numel():
        return f"{name}: equal"
    i = tuple(idx[0].tolist())
    return f"{name}: first mismatch at {i}: {got[i].item()} != reference {ref[i].item()}"


def assert_equal(name: str, ref: torch.Tensor, got: torch.Tensor) -> None:
    assert torch.equal(ref, got), first_mismatch(name, ref, got)


def poisoned_pools(model: HybridModel) -> ModelPools:
    """Pools whose every slot is NaN, so reading a slot nobody wrote shows up in the logits."""
    pools = model.new_pools(POOL_SIZE, POOL_SIZE, MAMBA_SLOTS)
    for pool in (pools.full_pool, pools.swa_pool):
        if pool is not None:
            pool.k_buffer.fill_(float("nan"))
            pool.v_buffer.fill_(float("nan"))
    if pools.mamba_pool is not None:
        for t in pools.mamba_pool.tensors:
            t.fill_(float("nan"))
    return pools


def scattered_rows(
    pools: ModelPools, n: int, seed: int, exclude: tuple[torch.Tensor, torch.Tensor | None] = ()
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Random distinct full and SWA slots for ``n`` positions, avoiding the ``exclude`` rows."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i, pool in enumerate((pools.full_pool, pools.swa_pool)):
        if pool is None:
            out.append(None)
            continue
        taken = set(exclude[i].tolist()) if exclude and exclude[i] is not None else set()
        free = [s for s in torch.randperm(pool.size, generator=gen).tolist() if s not in taken]
        out.append(torch.tensor(free[:n], dtype=torch.int64, device=pool.device))
    return out[0], out[1]


def tokens(n: int, vocab: int, seed: int) -> list[int]:
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def mamba_slot(pools: ModelPools, slot: int = 0) -> int | None:
    return slot if pools.mamba_pool is not None else None
