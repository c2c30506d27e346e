"""Bad input on both sides: refused with a clear error (nothing changed), or dropped and
counted while the cache keeps working."""

from __future__ import annotations

import time

import pytest
import torch
import zmq

from kvtier.events import MEDIUM_DEVICE, EventsConfig, Indexer, wire
from kvtier.runtime.cache import TieredKVCache
from tests.events.common import (
    BOUND_S,
    RawPublisher,
    check_index,
    converge,
    loopback,
    make_cache,
    make_config,
    subscribe,
    synced,
)
from tests.runtime.l3.helpers import conversations
from tests.runtime.synthetic import run_turn


@pytest.mark.parametrize(
    "kw, err, words",
    [
        ({"endpoint": "127.0.0.1:5557"}, ValueError, "endpoint"),
        ({"endpoint": 5557}, TypeError, "endpoint"),
        ({"endpoint": "tcp://127.0.0.1:99999"}, ValueError, r"endpoint: .*port in \[0, 65535\]"),
        ({"snapshot_endpoint": "tcp://127.0.0.1:x"}, ValueError, "snapshot_endpoint"),
        ({"endpoint": "tcp://127.0.0.1:\u0665\u0665\u0665\u0665"}, ValueError, "endpoint"),
        ({"endpoint": "tcp://127.0.0.1"}, ValueError, "endpoint"),
        ({"snapshot_endpoint": "http://x"}, ValueError, "snapshot_endpoint"),
        ({"heartbeat_s": 0}, ValueError, "heartbeat_s"),
        ({"heartbeat_s": float("nan")}, ValueError, "heartbeat_s"),
        ({"heartbeat_s": 10**400}, ValueError, "heartbeat_s"),
        ({"heartbeat_s": True}, TypeError, "heartbeat_s"),
        ({"snapshot_peers": ["a"]}, TypeError, "snapshot_peers"),
        ({"prefill_tokens_per_s": -1.0}, ValueError, "prefill_tokens_per_s"),
        ({"hwm": 0}, ValueError, "hwm"),
        ({"topic": b"x"}, TypeError, "topic"),
    ],
)
def test_config_refuses_bad_values(kw, err, words):
    with pytest.raises(err, match=words):
        EventsConfig(**kw)


def test_cache_refuses_events_of_the_wrong_type():
    cfg = make_config()
    with pytest.raises(TypeError, match="events"):
        TieredKVCache(cfg, events="tcp://127.0.0.1:0")


def test_events_need_a_model_id():
    import dataclasses

    cfg = dataclasses.replace(make_config(), model_id="")
    with pytest.raises(ValueError, match="model_id"):
        TieredKVCache(cfg, events=loopback())


def test_endpoint_in_use_is_refused_and_the_other_cache_keeps_working(tmp_path):
    a = make_cache("write_through")
    ix = subscribe(a)
    try:
        converge(a, ix)
        for ep in ({"endpoint": a.events.endpoint}, {"snapshot_endpoint": a.events.endpoint}):
            with pytest.raises(ValueError, match="already in use"):
                make_cache("write_through", str(tmp_path / "l3"), events=loopback("b", **ep))
        run_turn(a, conversations(1, n=1)[0])
        synced(a, ix)
        assert ix.held(a.events.instance_id, MEDIUM_DEVICE)
    finally:
        a.close()
        ix.close()


def test_sink_refuses_an_unknown_medium_and_changes_nothing():
    cache = make_cache()
    try:
        before = list(cache.events._ops)
        with pytest.raises(ValueError, match="medium: 'NVME'"):
            cache.events.cleared("NVME")
        with pytest.raises(ValueError, match="medium"):
            cache.events.held("NVME")
        assert cache.events._ops == before
    finally:
        cache.close()


def _stored(h: bytes, medium: str) -> wire.BlockStored:
    return wire.BlockStored([h], None, [1, 2, 3, 4], 4, None, medium, None)


def test_subscriber_drops_and_counts_unknown_media_and_malformed_messages():
    pub = RawPublisher()
    ix = Indexer()
    try:
        ix.add_instance("raw", pub.endpoint)
        pub.handshake(ix, "raw")
        good, bad = b"\x01" * 32, b"\x02" * 32
        pub.batch(1, [_stored(bad, "NVME"), _stored(good, "GPU"), wire.BlockRemoved([bad], "?")])
        pub.send(b"", wire.seq_bytes(2))  # two frames
        pub.send(b"", b"\x00\x03", b"")  # a sequence frame of the wrong length
        pub.send(b"", wire.seq_bytes(2), b"\xc1garbage")  # undecodable batch 2
        pub.send(b"", wire.seq_bytes(3), wire.encode(wire.SnapshotRequest("x", "y")))  # not a batch
        pub.batch(4, [wire.AllBlocksCleared("TAPE")])
        deadline = time.monotonic() + BOUND_S
        while ix.seq("raw") != 4:
            assert time.monotonic() < deadline, ix.counters
            ix.poll(0.05)
        assert ix.counters["unknown_medium"] == 3
        assert ix.counters["malformed"] == 4
        # No snapshot endpoint: the gap is counted and the stream applied as it comes.
        assert ix.counters["gaps"] == 1
        assert ix.held("raw", "GPU") == {good}
        assert not ix.held("raw", "CPU") and not ix.held("raw", "STORAGE")
    finally:
        ix.close()
        pub.close()


def _dealer(endpoint: str):
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(endpoint)
    return ctx, d


def _reply(cache, dealer) -> list[bytes]:
    deadline = time.monotonic() + BOUND_S
    while not dealer.poll(50):
        assert time.monotonic() < deadline, "no reply"
        cache.poll()
    return dealer.recv_multipart()


def test_snapshot_refused_for_unknown_peers_and_bad_requests():
    cache = make_cache(events=loopback("inst-p", snapshot_peers=("router-1",)))
    ctx, dealer = _dealer(cache.events.snapshot_endpoint)
    try:
        cases = [
            ([b"", wire.encode(wire.SnapshotRequest("intruder", "inst-p"))], "unknown_peer"),
            ([b"", wire.encode(wire.SnapshotRequest("router-1", "other"))], "unknown_instance"),
            ([b"", b"\xc1 not msgpack"], "malformed"),
            ([b"", b"a", b"b"], "malformed"),
        ]
        for frames, why in cases:
            dealer.send_multipart(frames)
            reply = _reply(cache, dealer)
            assert reply[:2] == [b"", b"ERR"], reply
            assert cache.events.counters[f"snapshot_refused_{why}"] >= 1
        dealer.send_multipart([b"", wire.encode(wire.SnapshotRequest("router-1", "inst-p"))])
        reply = _reply(cache, dealer)
        assert reply[:2] == [b"", b"OK"]
        assert wire.seq_of(reply[2]) == cache.events.seq
        snap = wire.decode_batch(reply[3])
        assert isinstance(snap.events[0], wire.AllBlocksCleared)
        assert snap.instance.instance_id == "inst-p"
        # The cache kept working throughout.
        run_turn(cache, conversations(5, n=1)[0])
        cache.check_integrity()
    finally:
        dealer.close()
        ctx.term()
        cache.close()


def test_refused_subscriber_counts_it_and_the_cache_keeps_working():
    cache = make_cache(events=loopback("inst-q", snapshot_peers=("router-1",)))
    ix = subscribe(cache, name="intruder")
    try:
        deadline = time.monotonic() + BOUND_S
        # A lost batch (or joining late) needs a snapshot, which is refused.
        pub = cache.events.publisher
        send = pub.send
        pub.send = lambda frames: None  # this batch is lost
        cache.poll()
        assert cache.events.drain()  # sent (lost) by the publisher thread before restoring
        pub.send = send
        run_turn(cache, conversations(3, n=1)[0])
        while not ix.counters["snapshot_refused"]:
            assert time.monotonic() < deadline, ix.counters
            ix.poll(0.05)
            cache.poll()
        assert "intruder" in ix._instance("inst-q").last_error
        assert cache.events.counters["snapshot_refused_unknown_peer"] >= 1
        run_turn(cache, conversations(4, n=1)[0])
        cache.check_integrity()
    finally:
        cache.close()
        ix.close()


def test_indexer_refuses_bad_arguments():
    ix = Indexer()
    try:
        with pytest.raises(ValueError, match="endpoint"):
            ix.add_instance("a", "localhost:1")
        with pytest.raises(ValueError, match="instance_id"):
            ix.add_instance("", "tcp://127.0.0.1:1")
        ix.add_instance("a", "tcp://127.0.0.1:1")
        with pytest.raises(ValueError, match="already subscribed"):
            ix.add_instance("a", "tcp://127.0.0.1:2")
        with pytest.raises(ValueError, match="'b' is not subscribed"):
            ix.estimate("b", [1, 2, 3, 4])
        with pytest.raises(TypeError, match="tokens"):
            ix.estimate("a", [1.0, 2])
        with pytest.raises(TypeError, match="tokens"):
            ix.estimate("a", torch.arange(4))
        with pytest.raises(ValueError, match="tokens"):
            ix.estimate("a", [-1])
        with pytest.raises(TypeError, match="namespace"):
            ix.estimate("a", [1, 2, 3, 4], namespace=[1])
        with pytest.raises(RuntimeError, match="key seed"):
            ix.estimate("a", [1, 2, 3, 4])  # nothing received from it yet
        with pytest.raises(ValueError, match="medium"):
            ix.held("a", "NVME")
        assert ix.instances() == ["a"]
    finally:
        ix.close()


def test_a_failing_send_is_counted_and_recovered():
    """A socket error never reaches the engine: the batch's number is spent, the subscriber
    sees the gap and recovers from a snapshot."""
    cache = make_cache("write_through")
    ix = subscribe(cache)
    try:
        converge(cache, ix)
        pub = cache.events.publisher
        send = pub.send

        def broken(frames):
            raise zmq.ZMQError(zmq.ETERM)

        pub.send = broken
        run_turn(cache, conversations(6, n=1)[0])  # poll() publishes: the error stays inside
        assert cache.events.drain()
        assert cache.events.counters["publish_errors"] >= 1
        pub.send = send
        run_turn(cache, conversations(7, n=1)[0])
        converge(cache, ix)
        check_index(cache, ix, set())
        assert ix.counters["gaps"] >= 1
    finally:
        cache.close()
        ix.close()


@pytest.mark.parametrize("rate", [-5, 0, "fast", float("nan"), float("inf"), 10**400, True])
def test_indexer_refuses_a_bad_prefill_rate(rate):
    """``Indexer`` and its ``estimate`` take a prefill rate as ``EventsConfig`` does: positive
    and finite, refused by name otherwise (a negative rate made every load look free)."""
    with pytest.raises((TypeError, ValueError), match="prefill_tokens_per_s"):
        Indexer(prefill_tokens_per_s=rate)
    ix = Indexer()
    try:
        with pytest.raises((TypeError, ValueError), match="prefill_tokens_per_s"):
            ix.estimate("any", [1, 2, 3], prefill_tokens_per_s=rate)
    finally:
        ix.close()
