"""``Indexer``: the reference subscriber a router runs, one index of page hashes per instance.

It subscribes to each instance's PUB endpoint, applies batches in sequence order and, on a gap
(a lost or undecodable message, or joining late), asks the instance's snapshot endpoint for its
current state, buffering what arrives meanwhile, then resumes from the snapshot's sequence
number. It answers, per instance and prompt:

- how many leading tokens each medium holds (``hits``), and
- what serving the prefix would cost: the longest prefix held anywhere, each page from the
  fastest medium that holds it, its load time at the bandwidths the instance reports, and the
  time to recompute the same tokens at a prefill rate (``estimate``). A router should score
  that difference, not hit counts.

Nothing here blocks without a bound: ``poll`` and ``sync`` take timeouts.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import msgspec
import zmq

from kvtier.events import wire
from kvtier.events.config import (
    MEDIA,
    MEDIUM_DEVICE,
    MEDIUM_HOST,
    MEDIUM_STORAGE,
    check_endpoint,
    check_positive,
)
from kvtier.events.keys import KeySeed, prompt_hashes
from kvtier.storage.keys import canonical_namespace

__all__ = ["Indexer", "PrefixEstimate"]

# A snapshot request with no answer after this long is sent again (the instance may be
# between scheduler steps, or the request was lost).
SNAPSHOT_RETRY_S = 2.0
# Batches kept while a snapshot is awaited; past it they are dropped (the snapshot and the
# batches after it still converge; a stuck instance cannot grow the subscriber without bound).
MAX_BUFFERED = 10_000


@dataclass(frozen=True)
class PrefixEstimate:
    """What instance ``instance`` holds of a prompt, and what using it would cost.

    Attributes:
        device_tokens, host_tokens, storage_tokens: leading tokens each medium holds alone.
        from_device, from_host, from_storage: the longest prefix held anywhere, split by the
            fastest medium holding each page (device, then host, then storage).
        load_s: time to bring ``from_host + from_storage`` tokens to the device at the reported
            bandwidths; None when a bandwidth it needs is unknown.
        recompute_s: time to prefill the same tokens; None without a prefill rate.
    """

    instance: str
    device_tokens: int
    host_tokens: int
    storage_tokens: int
    from_device: int
    from_host: int
    from_storage: int
    load_s: float | None
    recompute_s: float | None

    @property
    def saved_s(self) -> float | None:
        """Prefill time the cached prefix saves: its device part, plus the rest where loading
        beats recomputing (None without a prefill rate)."""
        if self.recompute_s is None:
            return None
        rate = (self.from_host + self.from_storage) / self.recompute_s if self.recompute_s else 0
        device_s = self.from_device / rate if rate else 0.0
        gain = self.recompute_s - self.load_s if self.load_s is not None else 0.0
        return device_s + max(0.0, gain)


class _Instance:
    def __init__(self, instance_id: str, sub: zmq.Socket, dealer: zmq.Socket | None) -> None:
        self.id = instance_id
        self.sub, self.dealer = sub, dealer
        self.seq: int | None = None  # last applied; None: not synced yet
        self.run: int | None = None  # the publisher run applied (KVEventBatch.run)
        self.media: dict[str, set[bytes]] = {m: set() for m in MEDIA}
        self.info: wire.InstanceInfo | None = None
        self.seed: KeySeed | None = None
        self.waiting_since: float | None = None  # a snapshot request is out
        self.buffer: dict[int, wire.KVEventBatch] = {}
        self.snapshot_seq = -1  # sequence number of the last snapshot applied
        self.refused_until = float("-inf")
        self.last_error = ""


class Indexer:
    """Subscribes to instances' KV events and keeps, per instance, the page hashes per medium.

    Args:
        name: this subscriber's name in snapshot requests (an instance may allow only some).
        prefill_tokens_per_s: the prefill rate ``estimate`` uses when an instance reports none.

    Counters (``counters``): ``batches``, ``events``, ``gaps``, ``duplicates``, ``restarts``
    (an instance's numbers started over), ``malformed`` (messages dropped),
    ``unknown_medium`` (events dropped), ``snapshots``, ``snapshot_refused``,
    ``snapshot_requests``.
    """

    def __init__(
        self, name: str = "kvtier-indexer", prefill_tokens_per_s: float | None = None
    ) -> None:
        if not isinstance(name, str) or not name:
            raise ValueError(f"name: expected a non-empty str, got {name!r}")
        if prefill_tokens_per_s is not None:
            check_positive(prefill_tokens_per_s, "prefill_tokens_per_s")
        self.name = name
        self.prefill_tokens_per_s = prefill_tokens_per_s
        self.ctx = zmq.Context()
        self.poller = zmq.Poller()
        self._instances: dict[str, _Instance] = {}
        self._by_socket: dict[zmq.Socket, tuple[_Instance, bool]] = {}
        self.counters: Counter[str] = Counter()

    # -- connections ---------------------------------------------------------------------------

    def add_instance(
        self,
        instance_id: str,
        endpoint: str,
        snapshot_endpoint: str | None = None,
        topic: str = "",
    ) -> None:
        """Subscribe to ``instance_id``'s events at ``endpoint`` (its ``EventsConfig.endpoint``
        as bound); ``snapshot_endpoint``: where to recover after a gap (None: gaps are counted
        and the index may be stale)."""
        if not isinstance(instance_id, str) or not instance_id:
            raise ValueError(f"instance_id: expected a non-empty str, got {instance_id!r}")
        if instance_id in self._instances:
            raise ValueError(f"instance_id: {instance_id!r} is already subscribed")
        check_endpoint(endpoint, "endpoint")
        check_endpoint(snapshot_endpoint, "snapshot_endpoint", optional=True)
        sub = self.ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt(zmq.SUBSCRIBE, topic.encode("utf-8"))
        sub.setsockopt(zmq.RCVHWM, 0)  # never drop here: the publisher's HWM bounds memory
        sub.connect(endpoint)
        dealer = None
        if snapshot_endpoint is not None:
            dealer = self.ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.connect(snapshot_endpoint)
        inst = _Instance(instance_id, sub, dealer)
        self._instances[instance_id] = inst
        for sock, is_sub in ((sub, True), (dealer, False)):
            if sock is not None:
                self.poller.register(sock, zmq.POLLIN)
                self._by_socket[sock] = (inst, is_sub)

    def close(self) -> None:
        for sock in self._by_socket:
            sock.close(linger=0)
        self._by_socket.clear()
        self.ctx.term()

    # -- receiving -----------------------------------------------------------------------------

    def poll(self, timeout_s: float = 0.0) -> int:
        """Handle every message waiting now, waiting up to ``timeout_s`` for the first; returns
        how many messages were handled."""
        handled = 0
        wait_ms = max(0, int(timeout_s * 1000))
        while True:
            ready = dict(self.poller.poll(wait_ms))
            if not ready:
                break
            wait_ms = 0
            for sock in ready:
                inst, is_sub = self._by_socket[sock]
                while sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                    frames = sock.recv_multipart(zmq.NOBLOCK)
                    if is_sub:
                        self._on_batch(inst, frames)
                    else:
                        self._on_snapshot(inst, frames)
                    handled += 1
        now = time.monotonic()
        for inst in self._instances.values():
            if inst.waiting_since is not None and now - inst.waiting_since > SNAPSHOT_RETRY_S:
                self._request_snapshot(inst)
        return handled

    def sync(self, instance_id: str, seq: int, timeout_s: float, run: int | None = None) -> bool:
        """Poll until ``instance_id``'s index is at sequence ``seq`` or later (and no snapshot is
        outstanding), at most ``timeout_s``; returns whether it got there. ``run``: the
        publisher run ``seq`` belongs to (``cache.events.run``): the index must be of that run
        too. Without it, an index of the instance's previous run (before a restart, whose
        numbers start again) reads as synced (a user trial)."""
        inst = self._instance(instance_id)
        deadline = time.monotonic() + timeout_s
        while True:
            if (
                inst.seq is not None
                and inst.seq >= seq
                and inst.waiting_since is None
                and (run is None or inst.run == run)
            ):
                return True
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.poll(min(left, 0.05))

    def _on_batch(self, inst: _Instance, frames: list[bytes]) -> None:
        try:
            if len(frames) != 3:
                raise ValueError(f"expected 3 frames, got {len(frames)}")
            seq = wire.seq_of(frames[1])
        except ValueError:
            self.counters["malformed"] += 1  # no sequence number: the next batch shows the gap
            return
        try:
            batch = wire.decode_batch(frames[2])
        except (msgspec.DecodeError, msgspec.ValidationError):
            self.counters["malformed"] += 1  # a lost batch: recovered as a gap
            return
        if inst.waiting_since is not None:
            if len(inst.buffer) >= MAX_BUFFERED:  # the instance is not answering: start over
                inst.buffer.clear()
            inst.buffer[seq] = batch
            return
        if batch.run is not None and inst.run is not None and batch.run != inst.run:
            # Another run of the instance (a restart) whose first batches were missed: what
            # was known of the old run is void, whatever the numbers say (a new run's numbers
            # can repeat or pass the old run's, which read as duplicates or as the next batch).
            self.counters["restarts"] += 1
            self._forget(inst)
        if seq == 0:  # an instance's first batch (it clears everything): a start or a restart
            if inst.seq is not None:
                self.counters["restarts"] += 1
            inst.seq, inst.snapshot_seq = None, -1
            inst.buffer.clear()
            self._apply(inst, seq, batch)
            return
        if inst.seq is not None and seq <= inst.seq:
            if seq <= inst.snapshot_seq:  # sent before the snapshot it already has
                self.counters["duplicates"] += 1
                return
            # Numbers went back (ZeroMQ never reorders): a restart whose first batch was missed.
            self.counters["restarts"] += 1
            inst.seq = None
        if inst.seq is None or seq != inst.seq + 1:
            self.counters["gaps"] += 1
            if inst.dealer is not None and time.monotonic() >= inst.refused_until:
                inst.buffer[seq] = batch
                self._request_snapshot(inst)
                return
            if inst.dealer is not None:
                return  # refused a moment ago: not asking again yet (counted above)
            # No way to recover: apply and carry on (counted above).
        self._apply(inst, seq, batch)

    @staticmethod
    def _forget(inst: _Instance) -> None:
        """Nothing known of the instance any more (as after its first batch's clear)."""
        inst.seq, inst.snapshot_seq, inst.run = None, -1, None
        inst.buffer.clear()
        for held in inst.media.values():
            held.clear()

    def _request_snapshot(self, inst: _Instance) -> None:
        req = wire.SnapshotRequest(peer=self.name, instance_id=inst.id)
        inst.dealer.send_multipart([b"", wire.encode(req)], zmq.NOBLOCK)
        inst.waiting_since = time.monotonic()
        self.counters["snapshot_requests"] += 1

    def _on_snapshot(self, inst: _Instance, frames: list[bytes]) -> None:
        if inst.waiting_since is None:
            return  # the answer to a request sent again: the first one was applied
        if len(frames) >= 3 and frames[1] == b"ERR":
            inst.last_error = frames[2].decode("utf-8", "replace")
            inst.waiting_since = None
            inst.buffer.clear()
            inst.refused_until = time.monotonic() + SNAPSHOT_RETRY_S  # no request per batch
            self.counters["snapshot_refused"] += 1
            return
        try:
            if len(frames) != 4 or frames[1] != b"OK":
                raise ValueError(f"unexpected snapshot reply of {len(frames)} frames")
            seq = wire.seq_of(frames[2])
            batch = wire.decode_batch(frames[3])
        except (ValueError, msgspec.ValidationError):
            self.counters["malformed"] += 1
            return  # still waiting: the request is sent again after SNAPSHOT_RETRY_S
        inst.waiting_since = None
        self.counters["snapshots"] += 1
        if batch.run is not None and inst.run is not None and batch.run != inst.run:
            self.counters["restarts"] += 1  # the snapshot is of a run after the one applied
        self._apply(inst, seq, batch)
        inst.snapshot_seq = seq
        buffered, inst.buffer = inst.buffer, {}
        if batch.run is not None:  # batches of another run than the snapshot's are void
            buffered = {k: v for k, v in buffered.items() if v.run in (None, batch.run)}
        for s in sorted(buffered):
            if s <= inst.seq:
                continue
            if s != inst.seq + 1:  # lost again after the snapshot: ask once more
                inst.buffer = {k: v for k, v in buffered.items() if k >= s}
                self.counters["gaps"] += 1
                self._request_snapshot(inst)
                return
            self._apply(inst, s, buffered[s])

    def _apply(self, inst: _Instance, seq: int, batch: wire.KVEventBatch) -> None:
        media = inst.media
        for ev in batch.events:
            if type(ev) is wire.BlockStored:
                held = media.get(ev.medium)
                if held is None:
                    self.counters["unknown_medium"] += 1
                    continue
                held.update(ev.block_hashes)
            elif type(ev) is wire.BlockRemoved:
                held = media.get(ev.medium)
                if held is None:
                    self.counters["unknown_medium"] += 1
                    continue
                held.difference_update(ev.block_hashes)
            elif ev.medium is None:
                for held in media.values():
                    held.clear()
            elif ev.medium in media:
                media[ev.medium].clear()
            else:
                self.counters["unknown_medium"] += 1
        if batch.instance is not None:
            info = batch.instance
            if inst.seed is None or _seed_changed(inst.info, info):
                inst.seed = KeySeed.of(info)
            inst.info = info
        inst.seq = seq
        if batch.run is not None:
            inst.run = batch.run
        self.counters["batches"] += 1
        self.counters["events"] += len(batch.events)

    # -- queries -------------------------------------------------------------------------------

    def instances(self) -> list[str]:
        return list(self._instances)

    def seq(self, instance_id: str) -> int | None:
        """The last sequence number applied for ``instance_id`` (None: not synced yet)."""
        return self._instance(instance_id).seq

    def held(self, instance_id: str, medium: str) -> set[bytes]:
        """The page hashes (32 bytes each) ``medium`` of ``instance_id`` holds."""
        inst = self._instance(instance_id)
        if medium not in MEDIA:
            raise ValueError(f"medium: {medium!r} is not one of {MEDIA}")
        return set(inst.media[medium])

    def info(self, instance_id: str) -> wire.InstanceInfo | None:
        return self._instance(instance_id).info

    def hashes(
        self, instance_id: str, tokens: Sequence[int], namespace: Hashable = None
    ) -> list[bytes]:
        """The page hashes ``instance_id`` gives the whole pages of ``tokens``."""
        inst = self._instance(instance_id)
        _check_tokens(tokens)
        canonical_namespace(namespace)  # refuses, naming it, what cannot be a namespace
        if inst.seed is None:
            raise RuntimeError(
                f"instance {instance_id!r} has not reported its key seed yet (no batch with "
                "instance info received): poll() first"
            )
        return [bytes.fromhex(h) for h in prompt_hashes(inst.seed, tokens, namespace)]

    def estimate(
        self,
        instance_id: str,
        tokens: Sequence[int],
        namespace: Hashable = None,
        prefill_tokens_per_s: float | None = None,
    ) -> PrefixEstimate:
        """How much of ``tokens`` ``instance_id`` holds per medium, and load vs recompute time
        of the part not on the device (see ``PrefixEstimate``). As ``match`` serves: the pages
        of all but the last token (that one is always computed, for its logits)."""
        if prefill_tokens_per_s is not None:
            check_positive(prefill_tokens_per_s, "prefill_tokens_per_s")
        hashes = self.hashes(instance_id, tokens, namespace)
        inst = self._instances[instance_id]
        info = inst.info
        P = info.page_size
        hashes = hashes[: max(len(tokens) - 1, 0) // P]
        dev, host, sto = (inst.media[m] for m in (MEDIUM_DEVICE, MEDIUM_HOST, MEDIUM_STORAGE))
        alone = {}
        for medium, held in ((MEDIUM_DEVICE, dev), (MEDIUM_HOST, host), (MEDIUM_STORAGE, sto)):
            n = 0
            while n < len(hashes) and hashes[n] in held:
                n += 1
            alone[medium] = n * P
        split = [0, 0, 0]
        for h in hashes:
            if h in dev:
                split[0] += 1
            elif h in host:
                split[1] += 1
            elif h in sto:
                split[2] += 1
            else:
                break
        d, hh, s = (n * P for n in split)
        load_s: float | None = 0.0
        page_bytes = info.page_bytes
        if split[1] or split[2]:
            if not info.h2d_gbps or (split[2] and not info.storage_gbps):
                load_s = None
            else:
                load_s = (split[1] + split[2]) * page_bytes / (info.h2d_gbps * 1e9)
                if split[2]:
                    load_s += split[2] * page_bytes / (info.storage_gbps * 1e9)
        rate = prefill_tokens_per_s or info.prefill_tokens_per_s or self.prefill_tokens_per_s
        recompute_s = (hh + s) / rate if rate else None
        return PrefixEstimate(
            instance_id,
            alone[MEDIUM_DEVICE],
            alone[MEDIUM_HOST],
            alone[MEDIUM_STORAGE],
            d,
            hh,
            s,
            load_s,
            recompute_s,
        )

    def _instance(self, instance_id: str) -> _Instance:
        inst = self._instances.get(instance_id)
        if inst is None:
            raise ValueError(
                f"instance_id: {instance_id!r} is not subscribed (known: {sorted(self._instances)})"
            )
        return inst


def _seed_changed(old: wire.InstanceInfo | None, new: wire.InstanceInfo) -> bool:
    if old is None:
        return True
    fields = ("model_id", "dtype", "page_size", "layout", "tp_size", "salt")
    return any(getattr(old, f) != getattr(new, f) for f in fields)


def _check_tokens(tokens: Sequence[int]) -> None:
    if isinstance(tokens, (str, bytes)) or not isinstance(tokens, Sequence):
        raise TypeError(f"tokens: expected a sequence of ints, got {type(tokens).__name__}")
    for i, t in enumerate(tokens):
        if type(t) is not int:
            raise TypeError(f"tokens: position {i} holds {t!r} ({type(t).__name__}), not an int")
        if not 0 <= t < 2**63:
            raise ValueError(f"tokens: token id {t} at position {i} is outside [0, 2**63)")
