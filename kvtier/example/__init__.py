"""Example hybrid model runner: a small random-weight decoder over kvtier's pools.

Full-attention, sliding-window and Mamba-like layers, paged over :class:`MHADevicePool` and
:class:`MambaDevicePool`, with greedy generation. Its outputs are bitwise independent of how a
sequence is split into calls, so a run that reuses cached prefixes equals a cold run exactly.
``kvtier.example.v4`` holds a DeepSeek-V4-like model of the same kind: compressed attention over
sidecar pools, on a cache whose FULL pool is logical.
"""

from __future__ import annotations

from kvtier.example.config import HybridModelConfig, LayerKind
from kvtier.example.model import Generation, HybridModel
from kvtier.example.pools import ModelPools

__all__ = ["Generation", "HybridModel", "HybridModelConfig", "LayerKind", "ModelPools"]
