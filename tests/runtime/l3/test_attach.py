"""L3 attached, detached and cleared on a live cache (``kvtier.runtime.l3.attach``).

- Attach mid-run with backfill; a fresh process then reads every page back exact.
- Keys after attach (even after a detach from a store with another salt) equal those of a cache
  attached at start-up on the same trace.
- Detach under load, graceful (in time, and past its timeout) and forced, with in-flight
  backups and a prefetch held by a gated backend; ``check_integrity`` after every step.
- Two gloo ranks: a change asked on one rank is applied only at the poll where the other asks
  too; different changes are refused on both; retention expiry agrees although the ranks'
  clocks differ.
- Bad input: TypeError/ValueError naming the argument, books unchanged.
"""

from __future__ import annotations

import multiprocessing
import os
import tempfile
import threading

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig, StorageConfig
from kvtier.runtime.l3.attach import ChangeOutcome
from kvtier.storage import PoolTransfer, PrefetchOutcome, StorageBackend, create_backend
from kvtier.storage.file_backend import FilePerPageBackend, FilePerPageConfig
from tests.runtime.l3.helpers import (
    PROMPT_TOKENS,
    conversations,
    make_l3_cache,
    prefetch_and_run,
    second_turn,
)
from tests.runtime.synthetic import MODELS, SPEC, P, fingerprint, run_turn

STEP_BOUND = 400  # polls a change may take in these tests before they call it stuck
GATE_S = 30.0  # a gated backend call waits at most this long (a test bug must not hang)


def config(model: str, storage: StorageConfig | None = None) -> CacheConfig:
    """The synthetic cache of ``helpers.make_l3_cache``, with ``storage`` (None: no L3)."""
    kinds = MODELS[model]
    return CacheConfig(
        layer_kinds=kinds,
        kv_heads=1,
        head_dim=4,
        page_size=P,
        device_tokens=96,
        dtype=torch.float32,
        swa_window=8 if "swa" in kinds else None,
        mamba=SPEC if "mamba" in kinds else None,
        mamba_slots=8 if "mamba" in kinds else None,
        host_ratio=4.0,
        write_policy="write_through",
        model_id=f"synthetic-{model}",
        storage=storage,
    )


def storage(backend: str = "file", root: str | None = None, **kw) -> StorageConfig:
    """``make_l3_cache``'s storage settings (the same keys), over ``backend`` at ``root``."""
    st = {"prefetch_min_tokens": 4, "prefetch_policy": "wait_complete"}
    st.update(kw)
    return StorageConfig(backend=backend, backend_config={"root": root} if root else {}, **st)


def step_until(cache: TieredKVCache, change, check=None) -> int:
    """Poll until ``change`` is done (bounded), checking the books after every step."""
    for i in range(STEP_BOUND):
        if change.done:
            return i
        if cache.l3 is not None:
            cache.l3.wait_some(0.01)
        cache.poll()
        cache.check_integrity()
        if check is not None:
            check()
    raise AssertionError(f"storage change stuck: {change}")


def node_keys(cache: TieredKVCache) -> dict[tuple, list[str]]:
    """Each cached node's page hashes (from the tier in use), by its whole token path."""
    out = {}
    for node in cache.tree.all_nodes():
        if node.parent is None:
            continue
        path, x = [], node
        while x.parent is not None:
            path = list(x.key) + path
            x = x.parent
        out[tuple(path)] = list(cache.l3.node_hashes(node))
    return out


# -- attach mid-run, read back by a fresh process ---------------------------------------------


def _consumer(root: str, models: list[str]) -> None:
    backend = create_backend("file", root=root)
    for model in models:
        cache = make_l3_cache(model, backend)
        for conv in conversations(5):
            pf, req = prefetch_and_run(cache, second_turn(conv))
            assert pf is not None and pf.outcome is PrefetchOutcome.COMPLETE, (model, pf)
            assert req.device_hit == 0 and req.host_hit == PROMPT_TOKENS, (model, req)
        cache.drain()
        cache.check_integrity()
        cache.close()
    backend.close()


@pytest.mark.timeout(180)
def test_attach_mid_run_then_a_fresh_process_reads_the_pages(tmp_path):
    root = str(tmp_path / "l3")
    models = ["full", "full+swa+mamba"]
    for model in models:
        cache = TieredKVCache(config(model))
        convs = conversations(5)
        for conv in convs[:2]:  # cached before any storage: written by the backfill
            run_turn(cache, conv)
        assert cache.prefetch(second_turn(convs[0])) is None  # no L3 yet
        change = cache.attach_storage(storage(root=root), backfill=True)
        assert cache.l3 is None and change.state == "requested"  # applied in poll only
        step_until(cache, change)
        assert change.outcome is ChangeOutcome.APPLIED and cache.storage_state == "attached"
        assert cache.metrics()["l3.storage_backfill_jobs"] >= 1
        run_turn(cache, convs[2])  # cached after the attach: written as usual
        cache.drain()
        cache.check_integrity()
        m = cache.metrics()
        assert m["tier.backup_failures"] == 0 and m["l3.backup_pages"] > 0, m
        cache.close()
    proc = multiprocessing.get_context("spawn").Process(target=_consumer, args=(root, models))
    proc.start()
    proc.join(150)
    assert proc.exitcode == 0, f"consumer process exited with {proc.exitcode}"


# -- keys equal those of a cache attached at start-up -----------------------------------------


def test_keys_after_attach_equal_keys_attached_at_start(tmp_path):
    model = "full+swa"
    convs = conversations(8, n=4)
    ref = TieredKVCache(config(model, storage(root=str(tmp_path / "a"))))
    for conv in convs:
        run_turn(ref, conv)
    ref.drain()

    # Attached at start-up under another salt: its pages are hashed with that seed.
    cache = TieredKVCache(config(model, storage(root=str(tmp_path / "b"), namespace_key="old")))
    for conv in convs[:2]:
        run_turn(cache, conv)
    cache.drain()
    old = node_keys(cache)
    step_until(cache, cache.detach_storage())
    assert cache.l3 is None and cache.storage_state == "detached"
    for conv in convs[2:]:
        run_turn(cache, conv)
    # The hashes the old seed left on the nodes differ from the reference's: the check can fail.
    want = node_keys(ref)
    assert any(want[path] != hashes for path, hashes in old.items())
    step_until(cache, cache.attach_storage(storage(root=str(tmp_path / "c")), backfill=True))
    assert fingerprint(cache) == fingerprint(ref)
    assert node_keys(cache) == want
    cache.drain()
    # The new store holds every page under the reference's keys.
    ref_store = create_backend("file", root=str(tmp_path / "a"))
    new_store = create_backend("file", root=str(tmp_path / "c"))
    try:
        for path, hashes in want.items():
            for h in hashes:
                key = ref.l3.backend.scope.object_key(h, "kv")
                assert new_store._contains([key]) == ref_store._contains([key]) == [True], path
    finally:
        ref_store.close()
        new_store.close()
    cache.close()
    ref.close()


# -- detach under load --------------------------------------------------------------------------


class GatedBackend(FilePerPageBackend):
    """A file store whose reads and writes wait until ``gate`` is set (at most ``GATE_S``), so
    that a test holds backups and a prefetch in flight for as long as it needs."""

    def __init__(self, root: str) -> None:
        super().__init__(FilePerPageConfig(root=root))
        self.gate = threading.Event()
        self.gate.set()

    def _read(self, object_keys, pages):
        self.gate.wait(GATE_S)
        return super()._read(object_keys, pages)

    def _write(self, object_keys, pages):
        self.gate.wait(GATE_S)
        return super()._write(object_keys, pages)


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def _loaded_cache(tmp_path, clock: FakeClock):
    """A cache over a gated store with three backup jobs (one being written) and a prefetch
    reading, all held by the closed gate."""
    model = "full+swa"
    backend = GatedBackend(str(tmp_path / "l3"))
    convs = conversations(21, n=4)
    producer = make_l3_cache(model, backend)
    run_turn(producer, convs[0])
    producer.drain()
    producer.close()
    cfg = config(model, storage(prefetch_policy="wait_complete"))
    cache = TieredKVCache(cfg, storage_backend=backend, clock=clock)
    backend.gate.clear()
    for conv in convs[1:]:
        run_turn(cache, conv)
    pf = cache.prefetch(second_turn(convs[0]))
    assert pf is not None
    for _ in range(STEP_BOUND):  # until its query is agreed and its pages are being read
        if pf.state == "load":
            break
        cache.l3.wait_some(0.01)
        cache.poll()
        cache.check_integrity()
    assert pf.state == "load", pf
    assert len(cache.l3._backups) >= 2 and cache.l3.held_by_ops()
    return cache, backend, pf, convs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["graceful", "graceful_timeout", "forced"])
def test_detach_under_load(tmp_path, mode):
    clock = FakeClock()
    cache, backend, pf, convs = _loaded_cache(tmp_path, clock)
    tier = cache.l3
    change = cache.detach_storage(graceful=mode != "forced", timeout_s=5.0)
    cache.poll()
    cache.check_integrity()
    assert change.state == "agreed" and not change.done
    assert cache.storage_state == ("revoking" if mode == "forced" else "draining")
    assert cache.prefetch(second_turn(convs[1])) is None  # nothing new is admitted
    with pytest.raises(ValueError, match="storage"):
        cache.detach_storage(graceful=False)  # a second detach is refused
    if mode == "forced":
        assert pf.outcome is PrefetchOutcome.ABORTED  # revoked at once; its slots wait for IO
        assert tier.held_by_ops()
    for _ in range(3):  # the gate holds everything: a graceful detach waits
        cache.poll()
        cache.check_integrity()
    assert not change.done and cache.l3 is tier
    if mode == "graceful_timeout":
        clock.t += 6.0  # past the timeout on the (agreed) clock: the rest is revoked
        cache.poll()
        cache.check_integrity()
        assert cache.storage_state == "revoking" and pf.outcome is PrefetchOutcome.ABORTED
    backend.gate.set()
    if mode == "graceful":
        cache.drain()  # drains the tier and, in its polls, ends the detach
        cache.check_integrity()
    step_until(cache, change)
    assert cache.l3 is None and cache.storage_state == "detached"
    assert tier.outstanding == 0 and not tier.held_by_ops()
    c = tier.counters
    if mode == "graceful":
        assert change.outcome is ChangeOutcome.APPLIED
        assert pf.outcome is PrefetchOutcome.COMPLETE
        assert c["backup_revoked_pages"] == 0 and c["backup_pages"] > 0
    else:
        want = ChangeOutcome.APPLIED if mode == "forced" else ChangeOutcome.FORCED_AFTER_TIMEOUT
        assert change.outcome is want
        assert c["backup_revoked_pages"] > 0  # queued jobs were skipped
        assert c["storage_detach_timeouts"] == (mode == "graceful_timeout")
    # No host pin or slot is left behind: the cache runs on, and evicting everything frees all.
    run_turn(cache, convs[1])
    cache.drain()
    cache.check_integrity()
    assert not any(any(n.host_pins) for n in cache.tree.all_nodes())
    cache.close()
    backend.close()


def _foreign_pages(backend, n: int = 3) -> list[str]:
    """``n`` pages another cache stored in ``backend`` (keys no conversation here produces)."""
    hashes = [f"{i:064x}" for i in range(1, n + 1)]
    pages = [torch.full((64,), i, dtype=torch.uint8) for i in range(n)]
    assert backend.set([PoolTransfer("kv", hashes, pages)]).all_ok
    return hashes


@pytest.mark.parametrize("kind", ["file", "file_per_page"])
def test_clear_storage_removes_this_caches_pages_only(tmp_path, kind):
    cache = make_l3_cache("full", create_backend(kind, root=str(tmp_path / "l3")))
    backend = cache.l3.backend
    foreign = _foreign_pages(backend)
    conv = conversations(3, n=1)[0]
    run_turn(cache, conv)
    cache.drain()
    key = node_keys(cache)
    hashes = [h for hs in key.values() for h in hs]
    keys = [backend.scope.object_key(h, "kv") for h in hashes]
    assert all(backend._contains(keys))
    change = cache.clear_storage()
    step_until(cache, change)
    assert change.outcome is ChangeOutcome.APPLIED
    assert not any(backend._contains(keys))
    assert backend.exists([PoolTransfer("kv", foreign)]) == len(foreign), "another cache's pages"
    assert not cache.l3._stored  # forgotten: later backups write the pages again
    assert cache.metrics()["l3.storage_cleared"] == 1
    run_turn(cache, conversations(4, n=1)[0])  # new pages: stored, so the next clear has work
    cache.drain()
    assert cache.l3._stored

    def refuse(object_keys):
        raise OSError("read-only store")

    backend._delete = refuse
    failed = cache.clear_storage()
    step_until(cache, failed)
    assert failed.outcome is ChangeOutcome.FAILED and "could not be removed" in failed.error
    assert cache.metrics()["l3.storage_clear_failed"] == 1
    del backend._delete
    run_turn(cache, conv)  # the cache keeps working
    cache.drain()
    cache.check_integrity()
    cache.close()
    backend.close()


class _NoDelete(FilePerPageBackend):
    """A backend that cannot remove single pages (``delete`` raises NotImplementedError)."""

    _delete = StorageBackend._delete


def test_clear_storage_clears_a_backend_that_cannot_delete(tmp_path):
    backend = _NoDelete(FilePerPageConfig(root=str(tmp_path / "l3")))
    cache = make_l3_cache("full", backend)
    foreign = _foreign_pages(backend)
    run_turn(cache, conversations(3, n=1)[0])
    cache.drain()
    change = cache.clear_storage()
    step_until(cache, change)
    assert change.outcome is ChangeOutcome.APPLIED
    assert backend.exists([PoolTransfer("kv", foreign)]) == 0, "cleared whole"

    def refuse():
        raise OSError("read-only store")

    backend.clear = refuse
    failed = cache.clear_storage()
    step_until(cache, failed)
    assert failed.outcome is ChangeOutcome.FAILED and "read-only store" in failed.error
    cache.close()
    backend.close()


# -- bad input ----------------------------------------------------------------------------------


def _books(cache: TieredKVCache):
    return (
        fingerprint(cache),
        cache.storage_state,
        cache._storage.pending,
        cache.l3,
        cache.metrics(),
    )


def test_bad_input_is_refused_and_changes_nothing(tmp_path):
    cache = TieredKVCache(config("full"))
    run_turn(cache, conversations(4, n=1)[0])
    st = storage(root=str(tmp_path / "l3"))
    before = _books(cache)
    cases = [
        (TypeError, "storage", lambda: cache.attach_storage("file")),
        (TypeError, "storage", lambda: cache.attach_storage(None)),
        (TypeError, "backfill", lambda: cache.attach_storage(st, backfill=1)),
        (ValueError, "config", lambda: cache.attach_storage(st, config=st)),
        (ValueError, "storage", lambda: cache.detach_storage()),  # none attached
        (ValueError, "storage", lambda: cache.clear_storage()),
        (TypeError, "graceful", lambda: cache.detach_storage(graceful="yes")),
        (TypeError, "timeout_s", lambda: cache.detach_storage(timeout_s="3")),
        (ValueError, "timeout_s", lambda: cache.detach_storage(timeout_s=-1.0)),
        (ValueError, "timeout_s", lambda: cache.detach_storage(timeout_s=float("nan"))),
        (ValueError, "timeout_s", lambda: cache.detach_storage(timeout_s=10**400)),
        (ValueError, "backend", lambda: cache.attach_storage(storage("no-such-store"))),
    ]
    for exc, arg, call in cases:
        with pytest.raises(exc, match=arg):
            call()
        assert _books(cache) == before, arg
        cache.check_integrity()
    backend = create_backend("file", root=str(tmp_path / "l3b"))
    with pytest.raises(TypeError, match="config"):
        cache.attach_storage(backend, config="fast")
    assert _books(cache) == before

    change = cache.attach_storage(st)
    with pytest.raises(ValueError, match="pending"):  # attach twice, before the poll
        cache.attach_storage(backend)
    with pytest.raises(ValueError, match="pending"):
        cache.detach_storage()
    step_until(cache, change)
    attached = _books(cache)
    with pytest.raises(ValueError, match="already attached"):  # attach twice, after it
        cache.attach_storage(backend)
    assert _books(cache) == attached
    step_until(cache, cache.detach_storage(graceful=False))
    with pytest.raises(ValueError, match="none is attached"):  # detach twice
        cache.detach_storage()
    cache.check_integrity()
    cache.close()
    backend.close()


# -- two TP ranks ------------------------------------------------------------------------------


def _gather(value) -> list:
    out = [None, None]
    dist.all_gather_object(out, value)
    return out


def _storage_rank(rank: int, init: str, root: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    group = dist.group.WORLD
    convs = conversations(41, n=2)
    cache = TieredKVCache(config("full+swa"), tp_group=group)
    run_turn(cache, convs[0])
    log = []  # per step: (states of both ranks, whether their trees are equal)

    def step(label: str) -> None:
        cache.poll()
        cache.check_integrity()
        states = _gather(cache.storage_state)
        prints = _gather(fingerprint(cache))
        log.append((label, states, prints[0] == prints[1]))

    # Attach: rank 0 asks at once, rank 1 two steps later.
    change = None
    for i in range(4):
        if change is None and i == 2 * rank:
            change = cache.attach_storage(storage(root=root), backfill=True)
        step(f"attach {i}")
    run_turn(cache, convs[1])
    cache.drain()
    stored = _gather(cache.l3.counters["backup_pages"])
    # Different changes on the two ranks: refused on both at the same poll.
    other = cache.clear_storage() if rank == 0 else cache.detach_storage(graceful=False)
    step("disagree")
    outcome = other.outcome
    # Graceful detach: rank 1 asks first.
    detach = None
    for i in range(3):
        if detach is None and i == 1 - rank:
            detach = cache.detach_storage()
        step(f"detach {i}")
    result = (log, stored, outcome, change.outcome, detach.outcome)
    results = _gather(result)
    if rank == 0:
        torch.save(results, out)
    cache.close()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # as in test_tp: skip interpreter teardown under gloo's threads


def _spawn(fn, *args) -> object:
    with tempfile.TemporaryDirectory() as d:
        init = f"file://{os.path.join(d, 'store')}"
        out = os.path.join(d, "out.pt")
        mp.start_processes(fn, args=(init, *args, out), nprocs=2, start_method="spawn")
        return torch.load(out, weights_only=False)


@pytest.mark.timeout(180)
def test_two_ranks_change_storage_at_the_same_step(tmp_path):
    results = _spawn(_storage_rank, str(tmp_path / "l3"))
    log, stored, outcome, attached, detached = results[0]
    assert results[0] == results[1]
    assert all(same for _, _, same in log), log
    states = {label: s for label, s, _ in log}
    # Rank 0 asked at step 0; nothing changed until rank 1 asked at step 2.
    assert states["attach 0"] == states["attach 1"] == ["detached", "detached"], log
    assert states["attach 2"] == states["attach 3"] == ["attached", "attached"], log
    assert attached is ChangeOutcome.APPLIED and stored[0] == stored[1] > 0
    assert outcome is ChangeOutcome.REFUSED and states["disagree"] == ["attached"] * 2
    assert states["detach 0"] == ["attached", "attached"], log  # only rank 1 had asked
    assert states["detach 1"] == ["detached", "detached"], log
    assert detached is ChangeOutcome.APPLIED


def _expiry_rank(rank: int, init: str, out: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    # Different origins and rates: rank 1's clock starts 1000 s later and runs 1.5x as fast.
    rate = 1.0 + 0.5 * rank
    clock = FakeClock()
    clock.t = 1000.0 * rank
    cache = TieredKVCache(config("full"), tp_group=dist.group.WORLD, clock=clock)
    convs = conversations(51, n=2)
    for conv in convs:
        run_turn(cache, conv)
    ttl = 5.0
    cache.pin(convs[0], ttl_s=ttl)
    origin = clock.t
    log = []
    local_expiry = None  # the step at which this rank's own clock would have expired the pin
    for i in range(1, 9):
        clock.t += rate
        if local_expiry is None and clock.t - origin >= ttl:
            local_expiry = i
        cache.poll()
        cache.check_integrity()
        marks = [(tuple(n.key), n.retention) for n in cache.tree.all_nodes()]
        prints = _gather((fingerprint(cache), marks, len(cache.tree.retention.handles)))
        log.append((i, prints[0] == prints[1], prints[rank][2]))
    results = _gather((log, local_expiry, cache.metrics()["retention_expired"]))
    if rank == 0:
        torch.save(results, out)
    cache.close()
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


@pytest.mark.timeout(120)
def test_two_ranks_expire_retention_pins_at_the_same_step():
    results = _spawn(_expiry_rank)
    (log0, local0, expired0), (log1, local1, expired1) = results
    assert local0 != local1  # each rank's own clock would expire the pin at another step
    assert all(same for _, same, _ in log0), log0
    live = [(i, n) for i, _, n in log0]
    assert live == [(i, n) for i, _, n in log1]
    first_gone = next(i for i, n in live if n == 0)
    # The pin lives ttl_s from the first poll after it was taken (that poll's agreed time, on
    # every rank; Retention.restamp_at_poll): one step after rank 0's own clock would say.
    assert first_gone == local0 + 1 and expired0 == expired1 == 1, (live, local0, local1)
