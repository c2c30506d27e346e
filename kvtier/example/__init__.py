"""Example hybrid model runner: a small random-weight decoder over kvtier's pools.

Full-attention, sliding-window and Mamba-like layers, paged over :class:`MHADevicePool` and
:class:`MambaDevicePool`, with greedy generation. Its outputs are bitwise independent of how a
sequence is split into calls, so a run that reuses cached prefixes equals a cold run exactly.
"""

from __future__ import annotations

from kvtier.example.config import HybridModelConfig, LayerKind
from kvtier.example.model import Generation, HybridModel
from kvtier.example.pools import ModelPools

__all__ = ["Generation", "HybridModel", "HybridModelConfig", "LayerKind", "ModelPools"]
