"""Bad input to the pool constructors raises ValueError naming the argument."""

from __future__ import annotations

import pytest
import torch

from kvtier.runtime.pools.device import MHADevicePool, MLADevicePool
from kvtier.runtime.pools.host import HostPool


def test_pool_construction_errors(device):
    with pytest.raises(ValueError, match="page_size must be in"):
        MHADevicePool(2, 16, 2, 8, device=device, page_size=0)
    with pytest.raises(ValueError, match="multiple of page_size"):
        MHADevicePool(2, 18, 2, 8, device=device, page_size=4)
    pool = MLADevicePool(2, 16, 64, device=device, page_size=4)
    with pytest.raises(ValueError, match="exactly one of size, size_bytes, ratio"):
        HostPool(pool, "layer_first", size=16, ratio=2.0)
    with pytest.raises(ValueError, match="less than one page"):
        HostPool(pool, "layer_first", size_bytes=10)
    with pytest.raises(ValueError, match="layout: unknown host layout"):
        HostPool(pool, "page_head", ratio=1.0)
    with pytest.raises(ValueError, match=r"k_layers: expected \[size, kv_heads, head_dim\]"):
        MHADevicePool.wrap(
            [torch.zeros(16, 8, device=device)], [torch.zeros(16, 8, device=device)], 4
        )
