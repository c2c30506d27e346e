"""The pools the example model reads and writes: kvtier's own device pools, one per layer kind."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.example.config import HybridModelConfig
from kvtier.runtime.pools.device import MHADevicePool
from kvtier.runtime.pools.mamba import MambaDevicePool

__all__ = ["ModelPools"]


@dataclass
class ModelPools:
    """Device memory of one model: FULL K/V, SWA K/V (own slot space) and Mamba states.

    ``full_pool`` layer ``i`` is the ``i``-th "full" layer, ``swa_pool`` layer ``j`` the ``j``-th
    "swa" layer, ``mamba_pool`` layer ``m`` the ``m``-th "mamba" layer (see
    :meth:`HybridModelConfig.pool_layer`).
    """

    full_pool: MHADevicePool
    swa_pool: MHADevicePool | None = None
    mamba_pool: MambaDevicePool | None = None

    @classmethod
    def create(
        cls,
        config: HybridModelConfig,
        full_size: int,
        swa_size: int | None = None,
        mamba_size: int = 1,
        device: torch.device | str = "cpu",
        page_size: int = 1,
    ) -> ModelPools:
        """Allocate the pools ``config`` needs: ``full_size`` / ``swa_size`` token slots (SWA
        defaults to ``full_size``) and ``mamba_size`` request slots; kinds the model lacks get
        ``None``."""
        n_full, n_swa = len(config.layers_of("full")), len(config.layers_of("swa"))
        n_mamba = len(config.layers_of("mamba"))
        kv = (config.kv_heads, config.head_dim, config.dtype, device, page_size)
        swa = MHADevicePool(n_swa, swa_size or full_size, *kv) if n_swa else None
        mamba = (
            MambaDevicePool(n_mamba, mamba_size, config.mamba_spec(), device) if n_mamba else None
        )
        return cls(MHADevicePool(n_full, full_size, *kv), swa, mamba)

    def check(self, config: HybridModelConfig) -> None:
        """Raise ``ValueError`` naming the pool whose layers, shape or dtype don't fit ``config``."""
        item = (config.kv_heads, config.head_dim)
        for name, pool, kind in (
            ("full_pool", self.full_pool, "full"),
            ("swa_pool", self.swa_pool, "swa"),
        ):
            n = len(config.layers_of(kind))
            if n == 0:
                continue
            if pool is None:
                raise ValueError(f"pools.{name}: the model has {n} {kind} layers but no pool")
            if pool.num_layers != n or pool.item_shape != item or pool.dtype != config.dtype:
                raise ValueError(
                    f"pools.{name}: expected {n} layers of {item} {config.dtype}, got "
                    f"{pool.num_layers} layers of {pool.item_shape} {pool.dtype}"
                )
        n = len(config.layers_of("mamba"))
        if n:
            if self.mamba_pool is None:
                raise ValueError(f"pools.mamba_pool: the model has {n} mamba layers but no pool")
            if self.mamba_pool.num_layers != n or self.mamba_pool.spec != config.mamba_spec():
                raise ValueError(
                    f"pools.mamba_pool: expected {n} layers of {config.mamba_spec()}, got "
                    f"{self.mamba_pool.num_layers} layers of {self.mamba_pool.spec}"
                )
