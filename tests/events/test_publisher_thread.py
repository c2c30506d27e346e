"""The publisher thread: batches leave off the scheduler thread through a bounded queue (full:
dropped, counted, recovered by snapshot; the scheduler never waits), snapshots are consistent
with the sequence numbers, and page hashes are computed lazily but equal the L3 chain hashes."""

from __future__ import annotations

import random
import threading
import time

import pytest
import zmq

from kvtier.events import MEDIA, EventsConfig, wire
from kvtier.events.keys import KeySeed, chain_hashes
from kvtier.storage import page_hashes
from tests.events.common import (
    BOUND_S,
    check_index,
    converge,
    loopback,
    make_cache,
    node_pages,
    subscribe,
)
from tests.runtime.l3.helpers import conversations, second_turn
from tests.runtime.synthetic import run_turn


def _gate(cache) -> threading.Event:
    """Stall the publisher thread inside its next send until the returned event is set."""
    gate = threading.Event()
    pub = cache.events.publisher
    send = pub.send

    def gated(frames):
        assert gate.wait(BOUND_S), "the test never opened the gate"
        return send(frames)

    pub.send = gated
    return gate


def test_a_full_queue_drops_counts_and_recovers_without_blocking_the_scheduler():
    cache = make_cache("write_through", events=loopback(queue_batches=2))
    ix = subscribe(cache)
    seen: set[bytes] = set()
    try:
        converge(cache, ix)
        gate = _gate(cache)
        convs = conversations(11, n=4)
        for c in convs:  # the thread is stuck in a send: the steps must not wait for it
            run_turn(cache, c)
            cache.poll()
        ev = cache.events
        assert ev.counters["dropped_batches"] >= 1
        assert len(ev._queue) <= 2  # bounded: what was dropped is not queued
        gate.set()
        for c in convs:
            run_turn(cache, second_turn(c))
            converge(cache, ix)
            check_index(cache, ix, seen)
        assert ix.counters["gaps"] >= 1 and ix.counters["snapshots"] >= 1
    finally:
        cache.close()
        ix.close()


def _apply(state: dict[str, set[bytes]], batch: wire.KVEventBatch) -> None:
    for e in batch.events:
        if isinstance(e, wire.BlockStored):
            state[e.medium].update(e.block_hashes)
        elif isinstance(e, wire.BlockRemoved):
            state[e.medium].difference_update(e.block_hashes)
        else:
            for m in MEDIA if e.medium is None else (e.medium,):
                state[m].clear()


def test_a_snapshot_equals_the_batches_up_to_its_sequence_number():
    """Requested while batches wait in the queue: the reply is labelled N and holds exactly
    what batches 0..N published."""
    cache = make_cache("write_through", device_tokens=32)
    ev = cache.events
    sent: list[tuple[bytes, bytes]] = []
    send = ev.publisher.send
    ev.publisher.send = lambda frames: (sent.append(frames), send(frames))
    ctx = zmq.Context()
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(ev.snapshot_endpoint)
    try:
        convs = conversations(12, n=6)
        run_turn(cache, convs[0])
        dealer.send_multipart([b"", wire.encode(wire.SnapshotRequest("p", ev.instance_id))])
        deadline = time.monotonic() + BOUND_S
        turns = iter(convs[1:] + [second_turn(c) for c in convs])
        while not dealer.poll(0):  # steps go on while the request waits
            assert time.monotonic() < deadline, "no snapshot reply"
            prompt = next(turns, None)
            if prompt is None:
                time.sleep(0.001)  # idle: the thread answers within its interval
                cache.poll()
            else:
                run_turn(cache, prompt)
        reply = dealer.recv_multipart()
        assert reply[1] == b"OK", reply
        label = wire.seq_of(reply[2])
        assert ev.drain()
        state: dict[str, set[bytes]] = {m: set() for m in MEDIA}
        seqs = [wire.seq_of(f) for f, _ in sent]
        assert seqs == list(range(len(sent))) and label in seqs
        for f, payload in sent:
            if wire.seq_of(f) <= label:
                _apply(state, wire.decode_batch(payload))
        snap: dict[str, set[bytes]] = {m: set() for m in MEDIA}
        _apply(snap, wire.decode_batch(reply[3]))
        assert snap == state
        assert state["GPU"], "the snapshot must hold something to compare"
    finally:
        dealer.close()
        ctx.term()
        cache.close()


def test_lazily_computed_hashes_reach_the_nodes_and_equal_the_l3_keys():
    cache = make_cache("write_through")
    try:
        for c in conversations(13, n=3):
            run_turn(cache, c)
            cache.poll()
        assert cache.events.drain()
        cache.events.nodes.write_back()  # what flush does once WRITE_BACK_AT are owed
        want = node_pages(cache)
        filled = 0
        for node, hs in want.items():  # hs: the node's own pages, hashed from its token path
            if node.page_hashes is not None:
                assert [bytes.fromhex(h) for h in node.page_hashes] == hs
                filled += 1
        assert filled, "no node got its hashes"
        assert not cache.events.nodes.lazy, "every computed hash was written back"
    finally:
        cache.close()


def test_chain_hashes_equal_page_hashes():
    rnd = random.Random(5)
    seed = KeySeed("m", "bfloat16", 4, "page_first", 2, "")
    ns = seed.namespace(("tenant", 3))
    for n in (0, 3, 4, 9, 64):
        tokens = [rnd.randrange(2**40) for _ in range(n)]
        prev = seed.digest_hex(("tenant", 3))
        assert chain_hashes(tokens, ns, prev) == page_hashes(tokens, ns, prev)
    with pytest.raises((OverflowError, ValueError)):
        chain_hashes([2**64] * 4, ns, prev)


def test_events_config_refuses_a_bad_queue_size():
    with pytest.raises(TypeError, match="queue_batches"):
        EventsConfig(queue_batches=2.0)
    with pytest.raises(ValueError, match="queue_batches"):
        EventsConfig(queue_batches=0)


def test_a_step_never_waits_for_the_thread_and_close_still_finishes():
    """A stalled publisher thread: steps go on; close() returns once the thread is freed."""
    cache = make_cache("write_through", events=loopback(queue_batches=1))
    gate = _gate(cache)
    try:
        for c in conversations(14, n=3):
            run_turn(cache, c)
            cache.poll()
        assert cache.events.counters["dropped_batches"] >= 1
        cache.check_integrity()
    finally:
        gate.set()
        cache.close()


def test_a_batch_that_fails_to_resolve_is_counted_and_leaks_nothing_into_the_next():
    """A record the thread cannot resolve: the batch is lost (its number spent, counted), and
    what it had built before failing is not sent with the next batch."""
    from kvtier.events.mirror import STORED

    cache = make_cache("write_through", kinds=("full", "full"))
    ev = cache.events
    sent: list[tuple[bytes, bytes]] = []
    send = ev.publisher.send
    ev.publisher.send = lambda frames: (sent.append(frames), send(frames))
    try:
        assert ev.drain()
        good = (["aa" * 32], 0, None, [1, 2, 3, 4], None)
        bad = (None, 0, None, [5, 6, 7, 8], None)  # no hashes: resolving it raises
        ev._ops += [(STORED, "GPU", [good]), (STORED, "GPU", [bad])]
        failed = ev.flush()
        other = (["bb" * 32], 0, None, [9, 9, 9, 9], None)
        ev._ops.append((STORED, "CPU", [other]))
        ok = ev.flush()
        assert ev.drain()
        assert ev.counters["publish_errors"] == 1
        seqs = {wire.seq_of(f): p for f, p in sent}
        assert failed not in seqs and ok in seqs
        [event] = wire.decode_batch(seqs[ok]).events
        assert event.medium == "CPU" and event.block_hashes == [bytes.fromhex("bb" * 32)]
    finally:
        cache.close()


def test_an_acknowledged_backup_hands_the_computed_hashes_to_l3(tmp_path, monkeypatch):
    """Hashes the publisher thread computed reach the nodes when their backup is acknowledged,
    before the L3 tier writes it on: the tier does not hash those pages again."""
    from kvtier.runtime.l3 import tier as tier_module

    cache = make_cache(
        "write_through", str(tmp_path / "l3"), kinds=("full", "full"), ack_delay_steps=2
    )
    hashed: list[int] = []
    real = tier_module.page_hashes

    def counted(tokens, *a, **kw):
        hashed.append(len(tokens))
        return real(tokens, *a, **kw)

    monkeypatch.setattr(tier_module, "page_hashes", counted)
    try:
        for c in conversations(15, n=2):
            run_turn(cache, c)  # its poll acknowledges nothing yet
            assert cache.events.drain()  # the thread has hashed the new pages
            assert cache.controller.in_flight
            hashed.clear()
            cache.poll()  # acknowledges the backup: the L3 tier writes it on
            assert not cache.controller.in_flight and cache.l3.outstanding
            assert hashed == [], f"the L3 tier hashed {sum(hashed)} tokens again"
        cache.drain()
        want = node_pages(cache)
        assert all([bytes.fromhex(h) for h in node.page_hashes] == hs for node, hs in want.items())
    finally:
        cache.close()


def test_a_dropped_batch_reaches_the_mirror_after_the_batches_queued_before_it():
    """Queue A, drop B (the queue is full): the mirror after A holds A's facts only; B's
    reach it ahead of the next batch queued, once."""
    from kvtier.events.mirror import STORED
    from kvtier.events.sink import EventSink

    seed = KeySeed("m", "bfloat16", 4, "page_first", 1, "")
    sink = EventSink(loopback("drop", queue_batches=1), seed, 64, lambda: (0.0, 0.0))
    entered, gate = threading.Event(), threading.Event()
    send = sink.publisher.send

    def gated(frames):
        entered.set()
        assert gate.wait(BOUND_S), "the test never opened the gate"
        return send(frames)

    sink.publisher.send = gated
    try:
        sink.flush()  # batch 0 (AllBlocksCleared): the thread stalls sending it
        assert entered.wait(BOUND_S), "the publisher thread never sent batch 0"
        x, z = "aa" * 32, "bb" * 32
        sink._ops.append((STORED, "GPU", [([x], 0, None, [1, 2, 3, 4], None)]))
        sink.flush()  # A: queued
        sink._ops.append((STORED, "GPU", [([z], 0, None, [5, 6, 7, 8], None)]))
        sink.flush()  # B: dropped
        assert sink.counters["dropped_batches"] == 1
        gate.set()
        assert sink.held("GPU") == {x}  # after A: B is not there yet
        sink.cleared("STORAGE")
        sink.flush()  # C carries B's facts ahead of its own
        assert sink.held("GPU") == {x, z}
        assert sink.counters["stored_pages.GPU"] == 2
    finally:
        gate.set()
        sink.close()
