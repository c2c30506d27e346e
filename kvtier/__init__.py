"""kvtier: KV-cache tiering runtime (device pools, pinned host pools, L3 storage)."""

from __future__ import annotations

__version__ = "0.1.0"
