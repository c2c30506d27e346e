"""The one place that wires a cache's parts: ``CacheConfig`` → pools, tree, controller, L3.

Parts get their collaborators as constructor arguments and their callbacks when they are built;
none of them knows the facade. The order follows what each part needs:

    device pools → host pools → tree (write-back calls the controller, bound below)
                 → L3 tier (tree, host pools, TP group, metrics, backend)
                 → controller (tree, copy bindings, TP group, L3's backup callback)

Sidecars ride on their anchor's copies: the binding of ``kv`` (``swa``) copies the anchor pool and
then, for the same pages, every sidecar anchored on it. A logical FULL pool has no bytes, so its
binding copies the sidecars only.

Load steps. The controller loads layer by layer, one binding per step, and records one event per
step. A model layer may need several pools (a DeepSeek V4 layer: its SWA window and its
KV-anchored sidecars), so the controller gets *steps* ``(pool, model layer)`` in model order, and
the facade waits for the last step of a layer (a stream runs in order: that covers them all).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.kernels.copier import HostCopier
from kvtier.metrics import TierMetrics
from kvtier.runtime.config import CacheConfig
from kvtier.runtime.controller import BoundCopier, CacheController, PoolBinding
from kvtier.runtime.l3.tier import L3Tier
from kvtier.runtime.pools.device import MHADevicePool, MLADevicePool
from kvtier.runtime.pools.host import HostPool
from kvtier.runtime.pools.indexer import INDEXER, IndexerDevicePool
from kvtier.runtime.pools.mamba import MambaDevicePool, MambaHostPool
from kvtier.runtime.pools.sidecar import LogicalDevicePool, LogicalHostPool, SidecarDevicePool
from kvtier.runtime.tree.config import TreeConfig, build_tree
from kvtier.runtime.tree.node import TreeNode
from kvtier.runtime.tree.tree import UnifiedRadixTree
from kvtier.storage import StorageBackend

__all__ = ["CacheParts", "build_cache_parts", "build_l3_tier"]

_POOL_OF_KIND = {"full": "kv", "swa": "swa", "mamba": "mamba"}


@dataclass
class CacheParts:
    """Everything a ``TieredKVCache`` runs on (see the attributes of the same names there).

    ``layer_map``: per model layer, its own pool and pool-local layer; ``wait_steps``: per model
    layer, the controller's load step to wait for (see the module docstring). ``build_l3``:
    builds an L3 tier over these parts from a config with ``storage`` set, an optional backend
    and the counters to count into (an attach at run time).
    """

    device: torch.device
    full_pool: MHADevicePool | MLADevicePool | LogicalDevicePool
    sidecar_pools: dict[str, SidecarDevicePool]
    swa_pool: MHADevicePool | None
    mamba_pool: MambaDevicePool | None
    host_full: HostPool | LogicalHostPool
    host_sidecars: dict[str, HostPool]
    host_swa: HostPool | None
    host_mamba: MambaHostPool | None
    tree: UnifiedRadixTree
    controller: CacheController
    layer_map: list[tuple[str, int]]
    wait_steps: list[int]
    tier_metrics: TierMetrics
    l3: L3Tier | None
    build_l3: Callable[[CacheConfig, StorageBackend | None, Counter[str] | None], L3Tier]


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
    if device.type == "cuda" and device.index is None:
        # The device by its index: torch's stream calls resolve a bare "cuda" through an
        # environment read each time (~15 us of CPU per call on an H100 host).
        device = torch.device("cuda", torch.cuda.current_device())
    P, k = cfg.page_size, cfg.knobs
    full, swa, mamba = cfg.layers_of("full"), cfg.layers_of("swa"), cfg.layers_of("mamba")
    H, D, dt = cfg.kv_heads, cfg.head_dim, cfg.dtype
    full_pool: MHADevicePool | MLADevicePool | LogicalDevicePool
    host_full: HostPool | LogicalHostPool
    if cfg.full_pool == "logical":
        full_pool = LogicalDevicePool(cfg.device_tokens, P)
        host_full = LogicalHostPool(full_pool, cfg.host_kv_tokens)
    else:
        full_pool = (
            MLADevicePool(len(full), cfg.device_tokens, cfg.mla_dim, dt, device, P)
            if cfg.mla_dim is not None
            else MHADevicePool(len(full), cfg.device_tokens, H, D, dt, device, P)
        )
        host_full = HostPool(full_pool, cfg.host_layout, size=cfg.host_kv_tokens, knobs=k)
    swa_pool = MHADevicePool(len(swa), cfg.swa_device_tokens, H, D, dt, device, P) if swa else None
    mamba_pool = MambaDevicePool(len(mamba), cfg.mamba_slots, cfg.mamba, device) if mamba else None
    host_swa = (
        HostPool(swa_pool, cfg.host_layout, size=cfg.host_swa_tokens, knobs=k) if swa_pool else None
    )
    host_mamba = (
        MambaHostPool(mamba_pool, size=cfg.host_mamba_slots, knobs=k) if mamba_pool else None
    )

    # Sidecar page p belongs to anchor page p, on device and on host alike.
    pages = {
        "kv": (cfg.device_tokens // P, cfg.host_kv_tokens // P),
        "swa": (cfg.swa_device_tokens // P, cfg.host_swa_tokens // P),
    }
    sidecar_pools: dict[str, SidecarDevicePool] = {}
    host_sidecars: dict[str, HostPool] = {}
    for spec in cfg.all_sidecars:
        dev_pages, host_pages = pages[spec.anchor]
        if spec.name == INDEXER:
            pool = IndexerDevicePool(len(spec.layers), dev_pages, P, device=device, layers=full)
        else:
            pool = SidecarDevicePool(spec, dev_pages, P, device)
        sidecar_pools[spec.name] = pool
        host_sidecars[spec.name] = HostPool(pool, cfg.host_layout, size=host_pages, knobs=k)

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

    tier_metrics = TierMetrics()
    hosts = {"kv": host_full, "swa": host_swa, "mamba": host_mamba, **host_sidecars}

    def build_l3(
        l3_cfg: CacheConfig, backend: StorageBackend | None, counters: Counter[str] | None
    ) -> L3Tier:
        return build_l3_tier(l3_cfg, tree, hosts, tp_group, tier_metrics, backend, counters)

    l3 = build_l3(cfg, storage_backend, None) if cfg.storage is not None else None

    def riders(anchor: str) -> list[HostPool]:
        return [host_sidecars[s.name] for s in cfg.all_sidecars if s.anchor == anchor]

    own_full = host_full if isinstance(host_full, HostPool) else None
    io = cfg.io_backend
    bindings = {"kv": _anchor_binding("kv", P, own_full, full, riders("kv"), io_backend=io)}
    if host_swa is not None:
        bindings["swa"] = _anchor_binding("swa", P, host_swa, swa, riders("swa"), io_backend=io)
    if host_mamba is not None:
        bindings["mamba"] = PoolBinding(
            "mamba",
            lambda d, h: host_mamba.backup(d, h, check=False),
            lambda h, d, layer: host_mamba.load(h, d, layer=mamba.index(layer), check=False),
            mamba_pool.slot_bytes,
            len(mamba),
        )
    layer_map: list[tuple[str, int]] = []
    for kind in cfg.layer_kinds:
        pool = _POOL_OF_KIND[kind]
        layer_map.append((pool, sum(1 for p, _ in layer_map if p == pool)))
    steps, wait_steps = _load_steps(cfg, layer_map)
    controller = CacheController(
        tree,
        bindings,
        steps,
        device,
        tp_group,
        ack_delay_steps,
        on_backup_done=l3.on_backup_done if l3 is not None else None,
    )
    return CacheParts(
        device,
        full_pool,
        sidecar_pools,
        swa_pool,
        mamba_pool,
        host_full,
        host_sidecars,
        host_swa,
        host_mamba,
        tree,
        controller,
        layer_map,
        wait_steps,
        tier_metrics,
        l3,
        build_l3,
    )


def build_l3_tier(
    cfg: CacheConfig,
    tree: UnifiedRadixTree,
    hosts: dict[str, HostPool | LogicalHostPool | MambaHostPool | None],
    tp_group,
    metrics: TierMetrics,
    backend: StorageBackend | None = None,
    counters: Counter[str] | None = None,
) -> L3Tier:
    """The L3 tier of a cache (``cfg.storage`` set) over its tree and host pools, at start-up or
    attached at run time (``TieredKVCache.attach_storage``). ``hosts``: the host pool of each
    pool name, None where the cache has none; a logical FULL pool has no bytes to store."""
    pools = {n: h for n, h in hosts.items() if isinstance(h, (HostPool, MambaHostPool))}
    return L3Tier(cfg, tree, pools, tp_group, metrics, backend, counters)


def _load_steps(
    cfg: CacheConfig, layer_map: list[tuple[str, int]]
) -> tuple[list[tuple[str, int]], list[int]]:
    """The controller's load steps ``(pool, model layer)`` and, per model layer, its last step.

    A layer loads its own pool, then the anchors of the sidecars that hold it (each once).
    """
    steps: list[tuple[str, int]] = []
    wait_steps: list[int] = []
    for layer, (own, _) in enumerate(layer_map):
        pools = [own]
        for spec in cfg.all_sidecars:
            if layer in spec.layers and spec.anchor not in pools:
                pools.append(spec.anchor)
        steps += [(pool, layer) for pool in pools]
        wait_steps.append(len(steps) - 1)
    return steps, wait_steps


def _anchor_binding(
    name: str,
    page_size: int,
    host: HostPool | None,
    host_layers: list[int],
    sidecars: list[HostPool],
    *,
    io_backend: str = "kernel",
) -> PoolBinding:
    """Copies of an anchor pool (``host``, None for a logical pool: no bytes, no copy) and of
    the sidecars that ride on its pages.

    Load takes a model layer: ``host`` loads it if it is one of ``host_layers`` (its layers in
    model order), each sidecar if it holds it.
    """
    P = page_size
    local = {layer: i for i, layer in enumerate(host_layers)}
    rider_layers = [
        {layer: i for i, layer in enumerate(sc.device_pool.spec.layers)} for sc in sidecars
    ]

    def backup(d: torch.Tensor, h: torch.Tensor) -> None:
        if host is not None:
            host.backup(d, h, check=False)
        if sidecars:
            # Tree slots come in whole, page-aligned pages: a page's first slot names it.
            dp, hp = d[::P] // P, h[::P] // P
            for sc in sidecars:
                sc.backup(dp, hp, check=False)

    def load(h: torch.Tensor, d: torch.Tensor, layer: int) -> None:
        if host is not None and layer in local:
            host.load(h, d, layer=local[layer], check=False)
        todo = [(sc, m[layer]) for sc, m in zip(sidecars, rider_layers) if layer in m]
        if todo:
            dp, hp = d[::P] // P, h[::P] // P
            for sc, i in todo:
                sc.load(hp, dp, layer=i, check=False)

    # Bytes per anchor slot: the pool's own, plus each sidecar's page (all layers) over P.
    per_page = sum(sc.device_pool.bytes_per_token for sc in sidecars)
    own = host.device_pool.bytes_per_token if host is not None else 0
    # The same copies on the path io_backend picks, from the tree's CPU indices.
    pairs = [(host, local, 1)] if host is not None else []
    pairs += [(sc, m, P) for sc, m in zip(sidecars, rider_layers)]
    copiers = tuple(
        BoundCopier(
            HostCopier(
                hp.device_pool.buffers,
                hp.buffer,
                io_backend=io_backend,
                knobs=hp.knobs,
                index_group=group,
            ),
            layers,
        )
        for hp, layers, group in pairs
    )
    for bc in copiers:  # the staged path's gather and scatter compile here, not on a request
        bc.copier.warmup()
    return PoolBinding(name, backup, load, own + per_page // P, len(host_layers), copiers)
