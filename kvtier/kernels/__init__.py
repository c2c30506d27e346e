"""Device↔host copies: the Triton copy kernel, the copy-engine and staged paths, page packing
for L3, with torch references beside them."""

from __future__ import annotations

from kvtier.kernels.dispatch import debug_checks, select_impl, set_debug_checks
from kvtier.kernels.kv_transfer import (
    DEFAULT_KNOBS,
    TransferKnobs,
    copy_device_to_host,
    copy_host_to_device,
)
from kvtier.kernels.layout import DeviceBuffers, HostBuffer, HostLayout, host_shape

__all__ = [
    "DEFAULT_KNOBS",
    "DeviceBuffers",
    "HostBuffer",
    "HostLayout",
    "TransferKnobs",
    "copy_device_to_host",
    "copy_host_to_device",
    "debug_checks",
    "host_shape",
    "select_impl",
    "set_debug_checks",
]
