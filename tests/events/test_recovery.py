"""Recovery: a subscriber that misses batches (dropped on purpose, undecodable, or sent before
it joined) detects the gap, takes a snapshot and converges to the cache's state."""

from __future__ import annotations

import random
import time

from kvtier.events import MEDIUM_STORAGE
from kvtier.events.wire import seq_of
from tests.events.common import check_index, converge, loopback, make_cache, subscribe, synced
from tests.runtime.l3.helpers import conversations, second_turn
from tests.runtime.synthetic import run_turn


def _lossy(cache, drop) -> list[int]:
    """Make the cache's publisher lose (or, with ``drop`` returning bytes, garble) the batches
    ``drop(seq)`` picks; returns the sequence numbers affected."""
    pub = cache.events.publisher
    send = pub.send
    lost: list[int] = []

    def lossy_send(frames):
        seq = seq_of(frames[0])
        what = drop(seq)
        if what is None:
            return send(frames)
        lost.append(seq)
        if what:
            send((frames[0], what))

    pub.send = lossy_send
    return lost


def _turns(cache, seed: int, n: int):
    convs = conversations(seed, n=n)
    for c in convs:
        yield c
    for c in convs:
        yield second_turn(c)


def test_dropped_batches_are_recovered_by_snapshot(tmp_path):
    cache = make_cache("write_through", str(tmp_path / "l3"))
    ix = subscribe(cache)
    seen: set[bytes] = set()
    try:
        converge(cache, ix)
        rnd = random.Random(3)
        lost = _lossy(cache, lambda seq: b"" if rnd.random() < 0.4 else None)
        for prompt in _turns(cache, seed=4, n=5):
            run_turn(cache, prompt)
            converge(cache, ix)
            check_index(cache, ix, seen)
        assert lost, "the trace must lose batches"
        assert ix.counters["gaps"] > 0 and ix.counters["snapshots"] > 0
        assert cache.events.counters["snapshots_served"] >= ix.counters["snapshots"]
        cache.drain()
        converge(cache, ix)
        check_index(cache, ix, seen)
        assert ix.held(cache.events.instance_id, MEDIUM_STORAGE)
    finally:
        cache.close()
        ix.close()


def test_undecodable_batch_counts_and_recovers():
    cache = make_cache("write_back")
    ix = subscribe(cache)
    seen: set[bytes] = set()
    try:
        converge(cache, ix)
        target = cache.events.seq + 2
        lost = _lossy(cache, lambda seq: b"\xc1 not msgpack" if seq == target else None)
        for prompt in _turns(cache, seed=8, n=3):
            run_turn(cache, prompt)
            converge(cache, ix)
            check_index(cache, ix, seen)
        assert lost == [target]
        assert ix.counters["malformed"] == 1 and ix.counters["snapshots"] >= 1
    finally:
        cache.close()
        ix.close()


def test_lost_last_batch_is_noticed_by_the_heartbeat():
    """Nothing follows the lost batch but heartbeats: the next one shows the gap."""
    cache = make_cache("write_through", events=loopback(heartbeat_s=0.05))
    ix = subscribe(cache)
    seen: set[bytes] = set()
    try:
        converge(cache, ix)
        first_lost = cache.events.seq + 1
        lost = _lossy(cache, lambda seq: b"" if seq == first_lost else None)
        run_turn(cache, conversations(9, n=1)[0])
        assert cache.events.drain()  # the publisher thread has sent (lost) it
        assert lost == [first_lost]
        converge(cache, ix)  # idle steps: heartbeats, then the snapshot
        check_index(cache, ix, seen)
        assert ix.counters["gaps"] >= 1
    finally:
        cache.close()
        ix.close()


def test_late_subscriber_starts_from_a_snapshot(tmp_path):
    cache = make_cache("write_through", str(tmp_path / "l3"))
    seen: set[bytes] = set()
    try:
        for prompt in _turns(cache, seed=6, n=4):
            run_turn(cache, prompt)
        assert cache.events.seq > 3
        ix = subscribe(cache, name="late")
        try:
            converge(cache, ix)
            check_index(cache, ix, seen)
            assert ix.counters["snapshots"] == 1
            run_turn(cache, conversations(7, n=1)[0])
            synced(cache, ix)  # and follows the live stream from there
            check_index(cache, ix, seen)
        finally:
            ix.close()
    finally:
        cache.close()


def test_instance_close_clears_its_index():
    cache = make_cache("write_through")
    ix = subscribe(cache)
    try:
        converge(cache, ix)
        run_turn(cache, conversations(2, n=1)[0])
        synced(cache, ix)
        inst = cache.events.instance_id
        assert ix.held(inst, "GPU")
        last = cache.events.seq
        cache.close()
        assert ix.sync(inst, last + 1, 10.0)
        assert not any(ix.held(inst, m) for m in ("GPU", "CPU", "STORAGE"))
    finally:
        ix.close()


def _first_run(inst: str, seed: int):
    """An instance ``inst`` and a subscriber at its index after three turns."""
    a = make_cache("write_through", events=loopback(inst))
    ix = subscribe(a)
    converge(a, ix)
    for prompt in _turns(a, seed=seed, n=3):
        run_turn(a, prompt)
    synced(a, ix)
    return a, ix


def _restart(a, inst: str):
    """``a`` closed and a new instance of the same id on its endpoints."""
    endpoints = {"endpoint": a.events.endpoint, "snapshot_endpoint": a.events.snapshot_endpoint}
    a.close()
    return make_cache("write_through", events=loopback(inst, heartbeat_s=0.1, **endpoints))


def test_restarted_instance_replaces_its_index():
    """An instance restarted on the same endpoints numbers its batches from 0 again: the
    subscriber notices (its first batch, or numbers going back) and takes the new state."""
    a, ix = _first_run("inst-r", seed=12)
    seen: set[bytes] = set()
    try:
        old = ix.held("inst-r", "CPU")
        assert old
        b = _restart(a, "inst-r")
        try:
            run_turn(b, conversations(13, n=1)[0])
            deadline = time.monotonic() + 10.0
            while not ix.counters["restarts"]:  # the old numbers say nothing about the new
                assert time.monotonic() < deadline, ix.counters
                b.poll()
                ix.poll(0.05)
            converge(b, ix)
            check_index(b, ix, seen)
            assert not old & ix.held("inst-r", "CPU")
        finally:
            b.close()
    finally:
        ix.close()


def test_restart_whose_first_batches_were_missed_is_noticed_by_its_run():
    """An instance crashes (no closing batch) and restarts on the same endpoints; the
    subscriber misses the new run's first batches, up to the old run's last number.
    The next batch's number follows the old run's, so numbers alone read it as the old run's
    continuation, and the index kept the dead run's pages for good (found in a user trial).
    Every batch carries its run: the change is a restart, and a snapshot brings the new state."""
    a, ix = _first_run("inst-c", seed=14)
    seen: set[bytes] = set()
    try:
        old, last = ix.held("inst-c", "CPU"), ix.seq("inst-c")
        assert old and last is not None
        _lossy(a, lambda seq: b"")  # the crash: nothing more leaves, not even the close's batch
        b = _restart(a, "inst-c")
        try:
            missed = _lossy(b, lambda seq: b"" if seq <= last else None)
            deadline = time.monotonic() + 10.0
            for prompt in conversations(15, n=1):
                run_turn(b, prompt)
            while not missed or max(missed) < last or not ix.counters["restarts"]:
                assert time.monotonic() < deadline, (missed, dict(ix.counters))
                b.poll()
                ix.poll(0.05)
            converge(b, ix)
            check_index(b, ix, seen)
            assert not old & ix.held("inst-c", "CPU"), "the dead run's pages are still indexed"
            assert ix.counters["restarts"] == 1, ix.counters
        finally:
            b.close()
    finally:
        ix.close()


def test_storage_attached_and_detached_at_run_time(tmp_path):
    """L3 attached on a live cache reports its writes as storage events; a detach clears the
    storage medium (the instance reaches none of those pages any more)."""
    from kvtier.runtime.config import StorageConfig

    cache = make_cache("write_through")
    ix = subscribe(cache)
    seen: set[bytes] = set()
    inst = cache.events.instance_id
    try:
        converge(cache, ix)
        convs = conversations(14, n=3)
        run_turn(cache, convs[0])
        change = cache.attach_storage(
            StorageConfig(backend="file", backend_config={"root": str(tmp_path / "l3")})
        )
        for _ in range(100):  # a single rank: the attach is applied at the next poll
            if change.done:
                break
            cache.poll()
        assert change.done and cache.l3 is not None
        for c in convs[1:]:
            run_turn(cache, c)
        cache.drain()
        converge(cache, ix)
        check_index(cache, ix, seen)
        assert ix.held(inst, MEDIUM_STORAGE)
        change = cache.detach_storage()
        for _ in range(100):
            if change.done:
                break
            cache.poll()
        assert change.done and cache.l3 is None
        converge(cache, ix)
        assert not ix.held(inst, MEDIUM_STORAGE)
        assert ix.held(inst, "GPU") and ix.held(inst, "CPU")
    finally:
        cache.close()
        ix.close()


def test_sync_with_the_run_waits_for_the_new_run_after_a_restart():
    """After a restart the new run's numbers start again, so an index still at the old run's
    number reads as synced with the new run's (a user trial: ``sync`` returned at once and
    the router estimated the old run's pages). ``sync(..., run=cache.events.run)`` waits for
    the index of that run."""
    a, ix = _first_run("inst-s", seed=16)
    try:
        old_seq = ix.seq("inst-s")
        assert old_seq is not None and old_seq >= 1
        old_run = a.events.run
        b = _restart(a, "inst-s")
        try:
            assert b.events.run != old_run
            target = min(old_seq, max(b.events.seq, 0))  # a number the old run already passed
            assert ix.sync("inst-s", target, 0.0)  # by numbers alone: "synced" with the old run
            assert not ix.sync("inst-s", target, 0.0, run=b.events.run)
            run_turn(b, conversations(17, n=1)[0])
            deadline = time.monotonic() + 10.0
            while not ix.sync("inst-s", b.events.seq, 0.05, run=b.events.run):
                assert time.monotonic() < deadline, dict(ix.counters)
                b.poll()
            check_index(b, ix, set())
        finally:
            b.close()
    finally:
        ix.close()
