"""L3 faults: each leaves the tree intact and falls back to recompute in bounded time.

A file backend whose reads can be made to return only a prefix, leave a hole, raise or hang
stands in for a misbehaving store; Mooncake faults use a real master that is killed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from kvtier.storage import PrefetchOutcome, create_backend
from kvtier.storage.file_backend import FileBackend, FileBackendConfig
from tests.runtime.l3.helpers import (
    PREFETCH_BOUND_S,
    PROMPT_TOKENS,
    conversations,
    make_l3_cache,
    prefetch_and_run,
    produce,
    second_turn,
)
from tests.runtime.synthetic import P, run_turn

PAGES = PROMPT_TOKENS // P


class FaultyBackend(FileBackend):
    """A file backend with injected read and write faults (``mode``)."""

    def __init__(self, root: Path) -> None:
        super().__init__(FileBackendConfig(root=root))
        self.mode = "ok"
        self.release = threading.Event()
        self.entered = threading.Event()

    def _read(self, object_keys, pages):
        if self.mode == "raise":
            raise OSError("injected read failure")
        if self.mode == "hang":
            self.entered.set()
            assert self.release.wait(30), "the test never released the hung read"
        done = super()._read(object_keys, pages)
        if self.mode == "prefix":
            return [ok and i < 2 for i, ok in enumerate(done)]
        if self.mode == "hole":
            return [ok and i != 2 for i, ok in enumerate(done)]
        return done

    def _write(self, object_keys, pages):
        if self.mode == "fail_writes":
            return [False] * len(object_keys)
        return super()._write(object_keys, pages)


@pytest.fixture
def stored(tmp_path):
    """Conversations a producer wrote to a file L3, and a faulty backend over the same files."""
    convs = conversations(5, n=1)
    producer = make_l3_cache("full+swa+mamba", create_backend("file", root=tmp_path))
    produce(producer, convs)
    producer.close()
    return convs[0], FaultyBackend(tmp_path)


@pytest.mark.parametrize("mode,pages", [("prefix", 2), ("hole", 2), ("raise", 0)])
def test_short_read_commits_only_the_complete_prefix(stored, mode, pages):
    conv, backend = stored
    backend.mode = mode
    cache = make_l3_cache("full+swa+mamba", backend)
    start = time.monotonic()
    pf, req = prefetch_and_run(cache, second_turn(conv))
    assert time.monotonic() - start < PREFETCH_BOUND_S
    assert pf.outcome is PrefetchOutcome.PARTIAL and pf.loaded_tokens == pages * P, pf
    # The pages read carry no Mamba state or SWA window of their own: nothing usable is served.
    assert req.cached_len == 0 and cache.metrics()["tier.failed_pages.read"] > 0
    cache.drain()
    cache.check_integrity()
    cache.close()


def test_corrupted_file_is_a_checksum_miss(stored, tmp_path):
    conv, backend = stored
    victim = backend.locate(sorted(k for k in backend.object_keys() if k.endswith(".kv.r0"))[0])
    with open(victim.path, "r+b") as f:  # flip the record's last payload byte
        f.seek(victim.offset + victim.size - 1)
        last = f.read(1)[0]
        f.seek(victim.offset + victim.size - 1)
        f.write(bytes([last ^ 0xFF]))
    cache = make_l3_cache("full+swa+mamba", FaultyBackend(tmp_path))
    pf, _req = prefetch_and_run(cache, second_turn(conv))
    m = cache.metrics()
    assert pf.outcome is PrefetchOutcome.CHECKSUM_MISS, pf
    assert m["tier.checksum_miss_pages"] == 1 and m["tier.prefetch.checksum_miss"] == 1
    assert pf.loaded_tokens < PROMPT_TOKENS
    cache.drain()
    cache.check_integrity()
    cache.close()
    del backend


def test_hung_read_times_out_then_releases(stored):
    conv, backend = stored
    backend.mode = "hang"
    cache = make_l3_cache(
        "full+swa+mamba",
        backend,
        prefetch_policy="timeout",
        prefetch_timeout_base_s=0.3,
        prefetch_timeout_per_ki_token_s=0.0,
    )
    start = time.monotonic()
    pf, req = prefetch_and_run(cache, second_turn(conv))
    assert time.monotonic() - start < 3.0
    assert backend.entered.is_set()
    assert pf.outcome is PrefetchOutcome.TIMED_OUT and pf.loaded_tokens == 0, pf
    assert req.cached_len == 0
    held = cache.l3.held_by_ops()
    assert held.get("kv") == PAGES * P, "the hung read's slots stay held until it returns"
    backend.release.set()
    cache.drain()
    cache.check_integrity()
    assert cache.l3.held_by_ops() == {}
    cache.close()


def test_abort_during_prefetch_releases_once(stored):
    conv, backend = stored
    backend.mode = "hang"
    cache = make_l3_cache("full+swa+mamba", backend)
    pf = cache.prefetch(second_turn(conv))
    while pf.state == "query":
        cache.l3.wait_some(0.05)
        cache.poll()
    assert backend.entered.wait(PREFETCH_BOUND_S)
    cache.abort_prefetch(pf)
    cache.abort_prefetch(pf)  # a second abort is a no-op
    assert pf.outcome is PrefetchOutcome.ABORTED
    cache.check_integrity()
    backend.release.set()
    cache.drain()
    cache.check_integrity()
    assert cache.l3.held_by_ops() == {} and cache.l3.inflight_tokens == 0
    run_turn(cache, second_turn(conv))
    assert cache.metrics()["tier.prefetch.aborted"] == 1
    cache.close()


def test_failed_backups_are_counted_not_acked(tmp_path):
    backend = FaultyBackend(tmp_path)
    backend.mode = "fail_writes"
    cache = make_l3_cache("full+mamba", backend, backup_retries=1)
    produce(cache, conversations(9, n=2))
    m = cache.metrics()
    assert m["tier.backup_failures"] > 0 and m["l3.backup_pages"] == 0
    # The retry (backup_retries=1) of each job's failed first batch is counted.
    assert 0 < m["tier.retried_pages"] <= m["tier.backup_failures"]
    assert backend.object_keys() == [], "nothing reached L3"
    backend.mode = "ok"
    cache.tree.evict_host(full=10**6)  # pins from the failed jobs are gone
    cache.check_integrity()
    cache.close()


@pytest.mark.timeout(120)
def test_mooncake_master_killed_mid_prefetch_and_backup(fresh_master):
    master = fresh_master
    backend = create_backend(
        "mooncake", master_address=master.address, global_segment_size=16 << 20
    )
    convs = conversations(21, n=2)
    producer = make_l3_cache("full+swa", backend, backup_retries=0)  # a dead put takes ~4 s
    produce(producer, convs[:1])
    consumer = make_l3_cache("full+swa", backend)
    read = backend._read

    def kill_then_read(keys, pages):
        if master.process.poll() is None:
            master.process.kill()
            master.process.wait(10)
        return read(keys, pages)

    backend._read = kill_then_read
    start = time.monotonic()
    pf, req = prefetch_and_run(consumer, second_turn(convs[0]))
    assert pf.outcome is PrefetchOutcome.PARTIAL and pf.loaded_tokens == 0, pf
    assert req.cached_len == 0
    consumer.drain()
    consumer.check_integrity()
    # Backups into the dead store fail in bounded time, are counted, and unpin their nodes.
    produce(producer, convs[1:])
    assert time.monotonic() - start < 60
    assert producer.metrics()["tier.backup_failures"] > 0
    producer.check_integrity()
    consumer.close()
    producer.close()
    backend.close()
