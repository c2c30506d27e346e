"""The one place that wires a cache's parts: ``CacheConfig`` → pools, tree, controller, L3.

Parts get their collaborators as constructor arguments and their callbacks when they are built;
none of them knows the facade. The order follows what each part needs:

    device pools → host pools → tree (write-back calls the controller, bound below)
                 → L3 tier (tree, host pools, TP group, metrics, backend)
                 → controller (tree, copy bindings, TP group, L3's backup callback)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtier.runtime.config import CacheConfig
from kvtier.runtime.controller import CacheController, PoolBinding
from kvtier.runtime.l3.tier import L3Tier
from kvtier.runtime.pools.device import MHADevicePool, MLADevicePool
from kvtier.runtime.pools.host import HostPool
from kvtier.runtime.pools.indexer import IndexerDevicePool
from kvtier.runtime.pools.mamba import MambaDevicePool, MambaHostPool
from kvtier.runtime.tree.config import TreeConfig, build_tree
from kvtier.runtime.tree.node import TreeNode
from kvtier.runtime.tree.tree import UnifiedRadixTree
from kvtier.storage import StorageBackend, StorageMetrics

__all__ = ["CacheParts", "build_cache_parts"]

_POOL_OF_KIND = {"full": "kv", "swa": "swa", "mamba": "mamba"}


@dataclass
class CacheParts:
    """Everything a ``TieredKVCache`` runs on (see the attributes of the same names there)."""

    device: torch.device
    full_pool: MHADevicePool | MLADevicePool
    indexer_pool: IndexerDevicePool | None
    swa_pool: MHADevicePool | None
    mamba_pool: MambaDevicePool | None
    host_full: HostPool
    host_indexer: HostPool | None
    host_swa: HostPool | None
    host_mamba: MambaHostPool | None
    tree: UnifiedRadixTree
    controller: CacheController
    layer_map: list[tuple[str, int]]
    tier_metrics: StorageMetrics
    l3: L3Tier | None


def build_cache_parts(
    cfg: CacheConfig,
    tp_group=None,
    ack_delay_steps: int = 0,
    storage_backend: StorageBackend | None = None,
) -> CacheParts:
    """Build and wire every part of a cache described by ``cfg``."""
    if storage_backend is not None and cfg.storage is None:
        raise ValueError("storage_backend needs config.storage")
    device = torch.device(cfg.device)
    P, k = cfg.page_size, cfg.knobs
    full, swa, mamba = cfg.layers_of("full"), cfg.layers_of("swa"), cfg.layers_of("mamba")
    H, D, dt = cfg.kv_heads, cfg.head_dim, cfg.dtype
    full_pool: MHADevicePool | MLADevicePool = (
        MLADevicePool(len(full), cfg.device_tokens, cfg.mla_dim, dt, device, P)
        if cfg.mla_dim is not None
        else MHADevicePool(len(full), cfg.device_tokens, H, D, dt, device, P)
    )
    indexer_pool = (
        IndexerDevicePool(len(full), cfg.device_tokens // P, P, device=device)
        if cfg.indexer
        else None
    )
    swa_pool = MHADevicePool(len(swa), cfg.swa_device_tokens, H, D, dt, device, P) if swa else None
    mamba_pool = MambaDevicePool(len(mamba), cfg.mamba_slots, cfg.mamba, device) if mamba else None

    host_full = HostPool(full_pool, cfg.host_layout, size=cfg.host_kv_tokens, knobs=k)
    # Host page p of the indexer belongs to host KV page p (slots [p * P, p * P + P)).
    host_indexer = (
        HostPool(indexer_pool, cfg.host_layout, size=cfg.host_kv_tokens // P, knobs=k)
        if indexer_pool is not None
        else None
    )
    host_swa = (
        HostPool(swa_pool, cfg.host_layout, size=cfg.host_swa_tokens, knobs=k) if swa_pool else None
    )
    host_mamba = (
        MambaHostPool(mamba_pool, size=cfg.host_mamba_slots, knobs=k) if mamba_pool else None
    )

    controller: CacheController | None = None

    def write_back(node: TreeNode) -> bool:
        """Write-back: back a device leaf up as it is evicted; False keeps it on device."""
        return controller.backup(node, wait=True)

    wb = cfg.write_policy == "write_back"
    tree = build_tree(
        TreeConfig(
            page_size=P,
            kv_size=cfg.device_tokens,
            swa_window=cfg.swa_window if swa else None,
            swa_size=cfg.swa_device_tokens if swa else None,
            mamba_size=cfg.mamba_slots if mamba else None,
            mamba_chunk_size=P,
            host_kv_size=cfg.host_kv_tokens,
            host_swa_size=cfg.host_swa_tokens if swa else None,
            host_mamba_size=cfg.host_mamba_slots if mamba else None,
            backup_continuity=not wb,
        ),
        write_back=write_back if wb else None,
    )

    tier_metrics = StorageMetrics()
    l3 = None
    if cfg.storage is not None:
        hosts = {"kv": host_full, "indexer": host_indexer, "swa": host_swa, "mamba": host_mamba}
        l3 = L3Tier(
            cfg,
            tree,
            {n: h for n, h in hosts.items() if h is not None},
            tp_group,
            tier_metrics,
            storage_backend,
        )

    bindings = {"kv": _kv_binding("kv", host_full, host_indexer)}
    if host_swa is not None:
        bindings["swa"] = _kv_binding("swa", host_swa)
    if host_mamba is not None:
        bindings["mamba"] = PoolBinding(
            "mamba",
            lambda d, h: host_mamba.backup(d, h, check=False),
            lambda h, d, layer: host_mamba.load(h, d, layer=layer, check=False),
            mamba_pool.slot_bytes,
            len(mamba),
        )
    layer_map: list[tuple[str, int]] = []
    for kind in cfg.layer_kinds:
        pool = _POOL_OF_KIND[kind]
        layer_map.append((pool, sum(1 for p, _ in layer_map if p == pool)))
    controller = CacheController(
        tree,
        bindings,
        layer_map,
        device,
        tp_group,
        ack_delay_steps,
        on_backup_done=l3.on_backup_done if l3 is not None else None,
    )
    return CacheParts(
        device,
        full_pool,
        indexer_pool,
        swa_pool,
        mamba_pool,
        host_full,
        host_indexer,
        host_swa,
        host_mamba,
        tree,
        controller,
        layer_map,
        tier_metrics,
        l3,
    )


def _kv_binding(name: str, host: HostPool, indexer: HostPool | None = None) -> PoolBinding:
    """Copies of a KV pool; with ``indexer``, its pages ride along with the KV pages."""
    if indexer is None:
        return PoolBinding(
            name,
            lambda d, h: host.backup(d, h, check=False),
            lambda h, d, layer: host.load(h, d, layer=layer, check=False),
            host.device_pool.bytes_per_token,
            host.device_pool.num_layers,
        )
    P = host.page_size

    def backup(d: torch.Tensor, h: torch.Tensor) -> None:
        host.backup(d, h, check=False)
        # Tree slots come in whole, page-aligned pages: a page's first slot names it.
        indexer.backup(d[::P] // P, h[::P] // P, check=False)

    def load(h: torch.Tensor, d: torch.Tensor, layer: int) -> None:
        host.load(h, d, layer=layer, check=False)
        indexer.load(h[::P] // P, d[::P] // P, layer=layer, check=False)

    per_token = host.device_pool.bytes_per_token + indexer.device_pool.bytes_per_token // P
    return PoolBinding(name, backup, load, per_token, host.device_pool.num_layers)
