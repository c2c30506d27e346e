"""L3 page keys name the pools' shape: two caches of one ``model_id`` whose pools mean different
things (an engine upgrade that moved a sidecar to other layers, changed the layer kinds or the
Mamba state) miss each other's pages. They used to read them as their own when the page sizes
happened to agree (found in a user trial: wrong sidecar entries served, no checksum miss)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtier.runtime.config import CacheConfig, StorageConfig
from kvtier.runtime.l3.pools import namespace_for
from kvtier.runtime.pools.mamba import MambaStateSpec
from kvtier.runtime.pools.sidecar import SidecarSpec

SPEC = MambaStateSpec(temporal_shape=(2, 8), conv_shapes=((8, 3),), conv_dtypes=(torch.float32,))


def base(**kw) -> CacheConfig:
    cfg = dict(
        layer_kinds=("full", "swa", "full", "mamba"),
        kv_heads=2,
        head_dim=8,
        page_size=8,
        device_tokens=128,
        dtype=torch.float32,
        swa_window=16,
        mamba=SPEC,
        mamba_slots=4,
        sidecars=(SidecarSpec("c4", "kv", 4, 16, (0, 2)),),
        host_ratio=2.0,
        model_id="org/model@rev",
        storage=StorageConfig(),
    )
    cfg.update(kw)
    return CacheConfig(**cfg)


def seed(cfg: CacheConfig) -> bytes:
    return namespace_for(cfg, None, 1).digest()


CHANGED = {
    "layer-kinds-order": dict(layer_kinds=("swa", "full", "full", "mamba")),
    "kv-heads": dict(kv_heads=1, head_dim=16),
    "sidecar-layers": dict(sidecars=(SidecarSpec("c4", "kv", 4, 16, (0,)),)),
    "sidecar-entry": dict(sidecars=(SidecarSpec("c4", "kv", 4, 8, (0, 2)),)),
    "mamba-state": dict(
        mamba=MambaStateSpec(
            temporal_shape=(4, 4), conv_shapes=((8, 3),), conv_dtypes=(torch.float32,)
        )
    ),
}
SAME = {
    "device-tokens": dict(device_tokens=256),
    "host-size": dict(host_ratio=4.0),
    "swa-window": dict(swa_window=24),
    "write-policy": dict(write_policy="write_back"),
}


@pytest.mark.parametrize("change", CHANGED, ids=list(CHANGED))
def test_pools_that_mean_other_bytes_get_other_keys(change):
    assert seed(base(**CHANGED[change])) != seed(base())


@pytest.mark.parametrize("change", SAME, ids=list(SAME))
def test_sizes_and_policies_keep_the_keys(change):
    assert seed(base(**SAME[change])) == seed(base())


def test_key_shape_is_stable_across_equal_configs():
    a, b = base(), dataclasses.replace(base())
    assert a.key_shape() == b.key_shape() and len(a.key_shape()) == 16


def test_mla_keys_ignore_the_unused_head_fields():
    """MLA caches ignore ``kv_heads`` and ``head_dim`` (and share pages across TP sizes): two
    MLA deployments that fill them differently still share their pages."""
    mla = dict(layer_kinds=("full",) * 2, mla_dim=16, sidecars=(), mamba=None, mamba_slots=None)
    mla.update(swa_window=None)
    assert seed(base(**mla, kv_heads=1, head_dim=8)) == seed(base(**mla, kv_heads=8, head_dim=64))
    assert seed(base(**{**mla, "mla_dim": 32})) != seed(base(**mla))
