"""The Mooncake master is killed in the middle of a backup job, inside a batch write.

A backup job of a FULL + SWA conversation goes out in batches of two pages. The store wrapper
lets the first batch through to the live master; the second batch's put is entered, the test
thread then kills the master (handshake by events: the put waits until the master is dead) and
the put runs against the dead master. The batch that reached the store is acknowledged; every
page after it counts as a backup failure and is never marked stored; the nodes' host pins are
released, and the tree stays intact.
"""

from __future__ import annotations

import threading
import time

import pytest

from kvtier.storage import create_backend
from tests.runtime.l3.helpers import conversations, make_l3_cache
from tests.runtime.synthetic import run_turn

BATCH = 2
KILL_AT_PUT = 2  # the first put goes to the live master


class KillInsidePut:
    """Forwards to the real Mooncake store; put number ``KILL_AT_PUT`` signals ``entered`` and
    waits for ``killed`` before it goes on to the (now dead) master."""

    def __init__(self, store) -> None:
        self._store = store
        self.entered = threading.Event()
        self.killed = threading.Event()
        self.puts: list[tuple[list[str], list[int]]] = []  # keys and return codes per put

    def __getattr__(self, name):
        return getattr(self._store, name)

    def batch_put_from_multi_buffers(self, keys, ptrs, sizes):
        if len(self.puts) + 1 == KILL_AT_PUT:
            self.entered.set()
            assert self.killed.wait(30), "the test never killed the master"
        rcs = self._store.batch_put_from_multi_buffers(keys, ptrs, sizes)
        self.puts.append((list(keys), list(rcs)))
        return rcs


@pytest.mark.timeout(120)
def test_mooncake_master_killed_inside_a_backup_batch(fresh_master):
    master = fresh_master
    backend = create_backend(
        "mooncake", master_address=master.address, global_segment_size=16 << 20
    )
    store = KillInsidePut(backend._store)
    backend._store = store
    cache = make_l3_cache("full+swa", backend, backup_retries=0, batch_pages=BATCH)
    start = time.monotonic()
    run_turn(cache, conversations(13, n=1)[0])
    cache.controller.drain()  # the D->H ack queues the backup job
    assert store.entered.wait(30), "the backup never reached its second batch"
    assert master.process.poll() is None, "the master must be alive until the write is inside"
    master.process.kill()
    master.process.wait(10)
    store.killed.set()
    cache.drain()
    assert time.monotonic() - start < 60

    # The first put reached the live master; the second ran against the dead one and failed.
    assert len(store.puts) == KILL_AT_PUT, store.puts
    (first_keys, first_rcs), (dead_keys, dead_rcs) = store.puts
    assert len(first_keys) == BATCH and all(rc == 0 for rc in first_rcs), store.puts
    assert dead_keys and all(rc != 0 for rc in dead_rcs), store.puts

    # Only the first batch reached the store; every other page of the job is a failure.
    l3 = cache.l3
    tree = cache.tree
    swa_pages = sum(
        n.host_value[tree.swa.slot].numel() // 4
        for n in tree.all_nodes()
        if n.parent is not None and n.host_value[tree.swa.slot] is not None
    )
    kv_pages = sum(
        len(n.key) // 4
        for n in tree.all_nodes()
        if n.parent is not None and n.host_value[0] is not None
    )
    m = cache.metrics()
    assert m["l3.backup_pages"] == BATCH, m
    assert (
        m["tier.backup_failures"] == m["l3.backup_failed_pages"] == kv_pages + swa_pages - BATCH
    ), m
    # An incomplete job leaves nothing remembered as stored (what every TP rank can agree on:
    # the whole job, or none of it), so a later backup writes its pages again.
    assert not l3._stored, l3._stored
    assert not l3._pending and not l3._backups

    # Pins released: every node's host copy can go, and the books balance.
    assert all(lock == 0 for n in tree.all_nodes() for lock in n.host_pins)
    cache.check_integrity()
    cache.evict(cache.config.device_tokens)  # host-only now: host eviction may take it all
    tree.evict_host(full=10**6, swa=10**6)
    assert tree.full.host_alloc.used_size() == 0 and tree.swa.host_alloc.used_size() == 0
    cache.check_integrity()
    cache.close()
    backend.close()
