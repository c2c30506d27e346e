"""KV events: what each tier of a cache holds, published per step over ZeroMQ, and a reference indexer.

The cache side (``EventsConfig``, the sink the runtime calls) imports no third-party package;
``pyzmq`` and ``msgspec`` (the ``events`` extra) are imported when events are switched on, or
when the wire types or the ``Indexer`` are first used.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvtier.events.config import MEDIA, MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_STORAGE, EventsConfig

if TYPE_CHECKING:
    from kvtier.events.indexer import Indexer, PrefixEstimate
    from kvtier.events.wire import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

__all__ = [
    "MEDIA",
    "MEDIUM_DEVICE",
    "MEDIUM_HOST",
    "MEDIUM_STORAGE",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EventsConfig",
    "Indexer",
    "KVEventBatch",
    "PrefixEstimate",
]

_LAZY = {
    "Indexer": "kvtier.events.indexer",
    "PrefixEstimate": "kvtier.events.indexer",
    "AllBlocksCleared": "kvtier.events.wire",
    "BlockRemoved": "kvtier.events.wire",
    "BlockStored": "kvtier.events.wire",
    "KVEventBatch": "kvtier.events.wire",
}


def __getattr__(name: str):
    # The wire types and the indexer need msgspec/pyzmq: import them on first use only, so that
    # ``import kvtier`` works without the ``events`` extra.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvtier.events' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
