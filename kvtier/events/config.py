"""``EventsConfig``: where a cache publishes its KV events, and the names of the media.

Media follow vLLM's KV-event names where vLLM has one (``"GPU"``, ``"CPU"``), so routers that
read vLLM's events read ours:

    kvtier tier          medium
    L1 device pools      "GPU"      (also on a CPU-only test machine: it names the tier)
    L2 pinned host       "CPU"
    L3 storage           "STORAGE"
"""

from __future__ import annotations

import numbers
import re
from dataclasses import dataclass

from kvtier.checks import is_finite

__all__ = ["MEDIA", "MEDIUM_DEVICE", "MEDIUM_HOST", "MEDIUM_STORAGE", "EventsConfig"]

MEDIUM_DEVICE = "GPU"
MEDIUM_HOST = "CPU"
MEDIUM_STORAGE = "STORAGE"
MEDIA = (MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_STORAGE)

_ENDPOINT = re.compile(r"(tcp|ipc|inproc)://\S+")


def check_endpoint(value: object, name: str, optional: bool = False) -> None:
    """A ZeroMQ endpoint ``tcp://host:port`` (port 0 or ``*``: ephemeral), ``ipc://path`` or
    ``inproc://name``; raises naming ``name``."""
    if value is None and optional:
        return
    if not isinstance(value, str):
        raise TypeError(f"{name}: expected a ZeroMQ endpoint str, got {value!r}")
    if not _ENDPOINT.fullmatch(value):
        raise ValueError(
            f"{name}: {value!r} is not a ZeroMQ endpoint (tcp://host:port, ipc://path or "
            "inproc://name)"
        )
    if value.startswith("tcp://"):
        port = value.rsplit(":", 1)[-1] if value.count(":") >= 2 else ""
        # libzmq takes the port modulo 65536 (99999 binds 34463): a router given the
        # configured port would never connect.
        if port != "*" and not (port.isascii() and port.isdigit() and int(port) <= 65535):
            raise ValueError(f"{name}: {value!r} needs a port in [0, 65535] or '*'")


@dataclass(frozen=True)
class EventsConfig:
    """KV events of one cache instance (pass it as ``TieredKVCache(..., events=...)``).

    Attributes:
        endpoint: the PUB socket's bind address. Loopback by default: a router elsewhere needs
            an address it can reach (``tcp://0.0.0.0:5557``).
        snapshot_endpoint: the ROUTER socket's bind address where a subscriber that missed a
            sequence number asks for the current state; None: no snapshots.
        topic: the first frame of every published message (vLLM's ``topic``).
        instance_id: names the instance in its batches and snapshots; ``""``: host name and pid.
        heartbeat_s: an empty batch (carrying the instance's bandwidths) goes out after this
            long without events, so a subscriber notices a lost last batch and sees fresh rates
            (sent from ``poll``: an engine that stops polling sends none).
        snapshot_peers: subscriber names allowed to ask for a snapshot; None: any.
        prefill_tokens_per_s: the model's prefill rate, reported to routers so that they can
            weigh loading a prefix against recomputing it; None: the storage config's, if any.
        hwm: the PUB socket's high-water mark (messages queued per subscriber before dropping).
        queue_batches: batches waiting for the publisher thread (which encodes and sends them
            off the scheduler thread) before the next ones are dropped and counted
            (``dropped_batches``): the scheduler never waits; a subscriber sees the gap and
            recovers from a snapshot.
    """

    endpoint: str = "tcp://127.0.0.1:5557"
    snapshot_endpoint: str | None = "tcp://127.0.0.1:5558"
    topic: str = ""
    instance_id: str = ""
    heartbeat_s: float = 1.0
    snapshot_peers: tuple[str, ...] | None = None
    prefill_tokens_per_s: float | None = None
    hwm: int = 100_000
    queue_batches: int = 1024

    def __post_init__(self) -> None:
        check_endpoint(self.endpoint, "endpoint")
        check_endpoint(self.snapshot_endpoint, "snapshot_endpoint", optional=True)
        for name in ("topic", "instance_id"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{name}: expected a str, got {getattr(self, name)!r}")
        _positive(self, "heartbeat_s")
        if self.prefill_tokens_per_s is not None:
            _positive(self, "prefill_tokens_per_s")
        peers = self.snapshot_peers
        if peers is not None:
            if not isinstance(peers, tuple) or not all(isinstance(p, str) for p in peers):
                raise TypeError(f"snapshot_peers: expected a tuple of str or None, got {peers!r}")
        if isinstance(self.hwm, bool) or not isinstance(self.hwm, int):
            raise TypeError(f"hwm: expected an int, got {self.hwm!r}")
        if self.hwm < 1:
            raise ValueError(f"hwm must be >= 1, got {self.hwm}")
        q = self.queue_batches
        if isinstance(q, bool) or not isinstance(q, int):
            raise TypeError(f"queue_batches: expected an int, got {q!r}")
        if q < 1:
            raise ValueError(f"queue_batches must be >= 1, got {q}")


def _positive(obj: object, name: str) -> None:
    check_positive(getattr(obj, name), name)


def check_positive(v: object, name: str) -> None:
    """A positive, finite number of ``name``; raises naming it."""
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{name}: expected a number, got {v!r}")
    if not is_finite(v) or v <= 0:
        raise ValueError(f"{name} must be positive and finite, got {v!r}")
