"""``PublisherThread``: resolves, encodes and sends the batches the scheduler queues, and answers
snapshot requests, off the scheduler thread.

It wakes every ``PUBLISH_INTERVAL_S`` (or when the queue is half full, on a drain, on close),
sends what is queued in order, then answers snapshot requests between two batches: a reply holds
the mirror after batch N, labelled N, so it is consistent with the sequence numbers by
construction. It owns the sockets (``Publisher``) and the ``Mirror``. A batch the scheduler had to
drop (the queue was full) reaches the mirror ahead of the next one queued, so a snapshot holds
its facts.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections import Counter, deque

import zmq

from kvtier.events import wire
from kvtier.events.config import EventsConfig
from kvtier.events.mirror import Mirror
from kvtier.events.publisher import Publisher

__all__ = ["BATCH", "JOIN_S", "MARK", "PUBLISH_INTERVAL_S", "STOP", "PublisherThread"]

log = logging.getLogger(__name__)

# How often the thread wakes to send what is queued and to look for snapshot requests: a batch
# leaves at most this long after its step. Waking it on every step instead costs the scheduler a
# system call and a GIL hand-over per step, more than the rest of it.
PUBLISH_INTERVAL_S = 0.005
JOIN_S = 5.0  # how long close() waits for the thread
# Queue items, by their first field:
#   (BATCH, seq, ts, ops, written, records, info, dropped before it)   see send_batch
#   (MARK, threading.Event)                                            set once reached
#   (STOP,)
BATCH, MARK, STOP = range(3)


class PublisherThread:
    """The thread that publishes a sink's batches.

    Args:
        config: the instance's events config (snapshot peers).
        publisher: the bound sockets (used from this thread only, then closed by ``stop``).
        mirror: what subscribers know (updated from this thread only).
        counters: the sink's counters.
        info: the instance info for snapshot replies until a batch carries a fresher one.
        name: the thread's name.
    """

    def __init__(
        self,
        config: EventsConfig,
        publisher: Publisher,
        mirror: Mirror,
        counters: Counter[str],
        info: wire.InstanceInfo,
        name: str,
    ) -> None:
        self.config = config
        self.publisher = publisher
        self.mirror = mirror
        self.counters = counters
        self.run = secrets.randbits(63)  # this start of the publisher, on every batch
        self.queue: deque[tuple] = deque()  # appended by the scheduler, popped here
        self.wake = threading.Event()
        self.mirror_seq = -1  # the batch the mirror is at
        self.sent_info = info  # the latest info sent (rates 0 until then)
        self._out = mirror.events()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def alive(self) -> bool:
        return self._thread.is_alive()

    def drain(self, timeout_s: float = JOIN_S) -> bool:
        """Wait until everything queued so far was handled; False if not within ``timeout_s``."""
        if not self._thread.is_alive():
            return True
        done = threading.Event()
        self.queue.append((MARK, done))
        self.wake.set()
        return done.wait(timeout_s)

    def stop(self) -> None:
        """Stop after what is queued, and close the sockets (left to the process if the thread
        does not stop within ``JOIN_S``: they are its own)."""
        self.queue.append((STOP,))
        self.wake.set()
        self._thread.join(JOIN_S)
        if self._thread.is_alive():
            log.warning("kv events: publisher thread did not stop within %.1f s", JOIN_S)
        else:
            self.publisher.close()

    def _run(self) -> None:
        q, wake, router = self.queue, self.wake, self.publisher.router
        while True:
            wake.wait(PUBLISH_INTERVAL_S)
            wake.clear()  # before popping: a later set() is not lost
            while q:
                item = q.popleft()
                kind = item[0]
                if kind == STOP:
                    return
                try:
                    if kind == BATCH:
                        self.send_batch(*item[1:])
                    else:
                        item[1].set()
                except Exception as e:  # never kill the thread: the next batch may go out
                    self.counters["publish_errors"] += 1
                    log.warning("kv events: publisher thread: %s", e)
            if router is not None:
                try:
                    for frames in self.publisher.requests():
                        self._answer(frames)
                except zmq.ZMQError as e:
                    self.counters["snapshot_errors"] += 1
                    log.warning("kv events: snapshot endpoint: %s", e)

    def send_batch(self, seq: int, ts: float, ops, written, snapshot, info, before) -> None:
        """Resolve one batch against the mirror, encode and send it (after the facts of the
        dropped batches ``before`` it). ``snapshot``: the batch is the whole mirror (rekey)."""
        mirror = self.mirror
        for o, w, s in before:  # dropped batches: their facts only
            if not s:
                mirror.apply(o, w, None)
        out = self._out  # one builder for every batch: a new one per batch costs as much
        out.reset()  # what a batch that raised left there
        if snapshot:
            mirror.snapshot(out)
        else:
            mirror.apply(ops, written, out)
        events = out.reset()
        self.mirror_seq = seq
        if info is not None:
            self.sent_info = info
        self.counters["events"] += len(events)
        payload = wire.encode(wire.KVEventBatch(ts=ts, events=events, instance=info, run=self.run))
        try:
            self.publisher.send((wire.seq_bytes(seq), payload))
        except zmq.ZMQError as e:
            # Never the engine's problem: the number is spent, so subscribers see a gap and
            # recover from a snapshot.
            self.counters["publish_errors"] += 1
            log.warning("kv events: batch %d not sent: %s", seq, e)

    def snapshot(self, info: wire.InstanceInfo | None) -> wire.KVEventBatch:
        """The mirror as one batch (call from this thread, or while it is idle)."""
        out = self.mirror.events()
        self.mirror.snapshot(out)
        return wire.KVEventBatch(ts=time.time(), events=out.events, instance=info, run=self.run)

    def _answer(self, frames: list[bytes]) -> None:
        """Reply to one request: ``[identity, b"", msgpack SnapshotRequest]`` (REQ or DEALER)
        with the mirror between two batches, labelled with the last one applied; anything else
        is counted and refused (or dropped when it cannot be replied to)."""
        if len(frames) < 2:
            self.counters["snapshot_malformed"] += 1
            return
        identity, body = frames[0], frames[1:]
        if body and body[0] == b"":
            body = body[1:]
        if len(body) != 1:
            return self._refuse(identity, "malformed", "expected one SnapshotRequest frame")
        try:
            req = wire.decode_request(body[0])
        except Exception as e:  # anything undecodable is the peer's problem, not the cache's
            return self._refuse(identity, "malformed", f"undecodable request ({e})")
        peers = self.config.snapshot_peers
        if peers is not None and req.peer not in peers:
            return self._refuse(identity, "unknown_peer", f"peer {req.peer!r} is not allowed")
        mine = self.sent_info.instance_id
        if req.instance_id != mine:
            return self._refuse(
                identity, "unknown_instance", f"this is {mine!r}, not {req.instance_id!r}"
            )
        payload = wire.encode(self.snapshot(self.sent_info))
        # Counted first: a subscriber holding the reply may look at the count at once.
        self.counters["snapshots_served"] += 1
        self.publisher.reply([identity, b"", b"OK", wire.seq_bytes(self.mirror_seq), payload])

    def _refuse(self, identity: bytes, why: str, message: str) -> None:
        self.counters[f"snapshot_refused_{why}"] += 1
        log.warning("kv events: snapshot request refused: %s", message)
        self.publisher.reply([identity, b"", b"ERR", message.encode("utf-8")])
