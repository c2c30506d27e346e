"""The wire format: vLLM's KV-event structs (same names, same fields, same framing) plus
kvtier's few additions, encoded with msgspec msgpack.

A published message has three frames, as vLLM's publisher sends them::

    topic (bytes) | sequence number (8 bytes, big-endian) | KVEventBatch (msgpack)

Events are tagged unions (msgspec ``tag=True``: a ``"type"`` field holding the class name).
Page hashes travel as the 32 raw bytes of kvtier's L3 page hash (vLLM's ``ExternalBlockHash``
allows bytes). kvtier's additions are optional fields at the end, which vLLM's decoders skip:

    BlockStored.namespace     the request namespace's canonical encoding (hex); None: none
    AllBlocksCleared.medium   which medium was cleared; None: every medium (vLLM's meaning)
    KVEventBatch.instance     who publishes, how its keys are seeded, its tier bandwidths
    KVEventBatch.run          this run of the publisher (random per start): a subscriber that
                              missed a restart's first batches sees the run change, whatever
                              the sequence numbers say

A snapshot (the reply on the ROUTER endpoint) is one ``KVEventBatch`` that starts with
``AllBlocksCleared()`` and stores every page each medium holds, valid at the sequence number
the reply names.
"""

from __future__ import annotations

import msgspec

__all__ = [
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "InstanceInfo",
    "KVCacheEvent",
    "KVEventBatch",
    "SnapshotRequest",
    "decode_batch",
    "decode_request",
    "encode",
    "seq_bytes",
    "seq_of",
]


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base of every KV-cache event."""


class BlockStored(KVCacheEvent):
    """Pages now held by ``medium``: a chain of pages continuing ``parent_block_hash``."""

    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    namespace: str | None = None


class BlockRemoved(KVCacheEvent):
    """Pages ``medium`` no longer holds (their slots were freed)."""

    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    """``medium`` (every medium when None) holds nothing any more."""

    medium: str | None = None


class InstanceInfo(msgspec.Struct, omit_defaults=True, gc=False):
    """Who publishes, how its page keys are seeded, and what loading costs there.

    A subscriber hashes a prompt exactly as the instance does with ``model_id``, ``dtype``,
    ``page_size``, ``layout``, ``tp_size`` (None for rank-replicated caches) and ``salt``
    (``CacheConfig.key_salt``, hex: the deployment salt's canonical encoding, then the cache's
    16-byte ``key_shape``), and the request's own namespace. ``page_bytes`` is the bytes of one FULL page over every layer; ``h2d_gbps`` and ``storage_gbps`` the
    measured (or assumed) host→device and storage-read rates, 0 when unknown.
    """

    instance_id: str
    model_id: str
    dtype: str
    page_size: int
    layout: str
    tp_size: int | None
    salt: str
    page_bytes: int
    h2d_gbps: float = 0.0
    storage_gbps: float = 0.0
    prefill_tokens_per_s: float | None = None
    snapshot_endpoint: str | None = None


class KVEventBatch(msgspec.Struct, omit_defaults=True, gc=False):
    """The events of one scheduler step, in the order they happened."""

    ts: float
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]
    data_parallel_rank: int | None = None
    instance: InstanceInfo | None = None
    run: int | None = None


class SnapshotRequest(msgspec.Struct, gc=False):
    """What a subscriber sends to the snapshot endpoint: its own name and the instance it
    wants (the instance refuses a request for another instance, or from a peer not allowed)."""

    peer: str
    instance_id: str


_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_request_decoder = msgspec.msgpack.Decoder(SnapshotRequest)


def encode(obj: msgspec.Struct) -> bytes:
    return _encoder.encode(obj)


def decode_batch(payload: bytes) -> KVEventBatch:
    """Raises ``msgspec.DecodeError`` (a ``ValueError``) on anything but a KVEventBatch."""
    return _batch_decoder.decode(payload)


def decode_request(payload: bytes) -> SnapshotRequest:
    return _request_decoder.decode(payload)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)


def seq_of(frame: bytes) -> int:
    """The sequence number frame; raises ``ValueError`` unless it is exactly 8 bytes."""
    if len(frame) != 8:
        raise ValueError(f"sequence frame: expected 8 bytes, got {len(frame)}")
    return int.from_bytes(frame, "big", signed=True)
