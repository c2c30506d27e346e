"""The storage contract, run on every backend (file, and Mooncake against a real master)."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.storage import (
    ALL_PAGES,
    TRAILING_PAGES,
    KeyScope,
    Namespace,
    PoolTransfer,
    StorageBackend,
    page_hashes,
)

NS = Namespace("test-model", "bfloat16", 4, "page_first", tp_size=1)
PAGE = 4096


def hashes(n: int, seed: int = 0) -> list[str]:
    return page_hashes(torch.arange(seed * 10_000, seed * 10_000 + 4 * n), NS)


def fill(pages: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    for p in pages:
        p.copy_(torch.randint(0, 256, p.shape, dtype=torch.uint8, generator=g))
    return [p.clone() for p in pages]


def first_mismatch(got: list[torch.Tensor], ref: list[torch.Tensor]) -> int | None:
    return next((i for i, (g, r) in enumerate(zip(got, ref)) if not torch.equal(g, r)), None)


def test_multi_pool_round_trip(backend: StorageBackend, make_pages) -> None:
    h = hashes(6)
    kv, swa, mamba = make_pages(6, PAGE), make_pages(2, 1024), make_pages(1, 8192)
    ref = fill(kv, 1), fill(swa, 2), fill(mamba, 3)
    res = backend.set(
        [
            PoolTransfer("kv", h, kv),
            PoolTransfer("swa", h[4:], swa),
            PoolTransfer("mamba", h[5:], mamba),
        ]
    )
    assert res.all_ok, res
    out = make_pages(6, PAGE), make_pages(2, 1024), make_pages(1, 8192)
    res = backend.get(
        [
            PoolTransfer("kv", h, out[0]),
            PoolTransfer("swa", h[4:], out[1]),
            PoolTransfer("mamba", h[5:], out[2]),
        ]
    )
    assert res.ok == {"kv": [True] * 6, "swa": [True] * 2, "mamba": [True]}
    for name, got, want in zip(("kv", "swa", "mamba"), out, ref):
        assert first_mismatch(got, want) is None, f"{name} page {first_mismatch(got, want)} differs"
    snap = backend.metrics.snapshot()
    assert snap["bytes.storage.read"] == snap["bytes.storage.write"] == 6 * PAGE + 2048 + 8192


def test_exists_under_policies(backend: StorageBackend, make_pages) -> None:
    h = hashes(8)
    # kv: pages 0..6 (7 missing); swa: 0, 1, 2, 4, 5; mamba: 2 and 5
    backend.set(
        [
            PoolTransfer("kv", h[:7], make_pages(7, 256)),
            PoolTransfer("swa", [h[i] for i in (0, 1, 2, 4, 5)], make_pages(5, 256)),
            PoolTransfer("mamba", [h[2], h[5]], make_pages(2, 256)),
        ]
    )
    kv = PoolTransfer("kv", h)
    assert backend.exists([kv]) == 7
    assert backend.exists([kv, PoolTransfer("mamba", h, policy=TRAILING_PAGES(1))]) == 6
    assert backend.exists([kv, PoolTransfer("swa", h, policy=TRAILING_PAGES(2))]) == 6
    assert backend.exists([kv, PoolTransfer("swa", h, policy=TRAILING_PAGES(3))]) == 3
    assert (
        backend.exists(
            [
                kv,
                PoolTransfer("swa", h, policy=TRAILING_PAGES(2)),
                PoolTransfer("mamba", h, policy=TRAILING_PAGES(1)),
            ]
        )
        == 6
    )
    assert backend.exists([kv, PoolTransfer("swa", h, policy=ALL_PAGES)]) == 3
    assert backend.exists([kv, PoolTransfer("mamba", h, policy=ALL_PAGES)]) == 0
    assert backend.exists([PoolTransfer("kv", hashes(8, seed=9))]) == 0
    assert backend.exists([]) == 0


def test_per_page_success_with_holes(backend: StorageBackend, make_pages) -> None:
    h = hashes(5)
    src = make_pages(5, PAGE)
    ref = fill(src, 4)
    stored = [0, 1, 3]
    assert backend.set(
        [PoolTransfer("kv", [h[i] for i in stored], [src[i] for i in stored])]
    ).all_ok
    out = make_pages(5, PAGE)
    res = backend.get([PoolTransfer("kv", h, out)])
    assert res.ok["kv"] == [True, True, False, True, False]
    assert res.hit_pages("kv") == 2
    for i in stored:
        assert torch.equal(out[i], ref[i]), f"page {i}"
    assert backend.metrics.snapshot()["failed_pages.read"] == 2


def test_set_is_idempotent(backend: StorageBackend, make_pages) -> None:
    h = hashes(2)
    first = make_pages(2, PAGE)
    ref = fill(first, 5)
    assert backend.set([PoolTransfer("kv", h, first)]).all_ok
    other = make_pages(2, PAGE)
    fill(other, 6)
    assert backend.set([PoolTransfer("kv", h, other)]).all_ok, "an existing key reports success"
    out = make_pages(2, PAGE)
    assert backend.get([PoolTransfer("kv", h, out)]).all_ok
    assert first_mismatch(out, ref) is None, "an existing key must not be rewritten"


def test_wrong_size_page_is_not_served(backend: StorageBackend, make_pages) -> None:
    h = hashes(1)
    backend.set([PoolTransfer("kv", h, make_pages(1, PAGE))])
    assert backend.get([PoolTransfer("kv", h, make_pages(1, PAGE // 2))]).ok["kv"] == [False]
    assert backend.metrics.snapshot()["checksum_miss_pages"] == 0, "a caller's mistake, not damage"
    assert backend.exists([PoolTransfer("kv", h)]) == 1, "the stored object is left alone"


def test_clear(backend: StorageBackend, make_pages) -> None:
    h = hashes(3)
    backend.set([PoolTransfer("kv", h, make_pages(3, 256))])
    assert backend.exists([PoolTransfer("kv", h)]) == 3
    backend.clear()
    assert backend.exists([PoolTransfer("kv", h)]) == 0
    assert backend.get([PoolTransfer("kv", h, make_pages(3, 256))]).ok["kv"] == [False] * 3


def test_ranks_are_isolated_and_replicated_ranks_share(backend: StorageBackend, make_pages) -> None:
    h = hashes(2)
    scope = backend.scope
    try:
        backend.scope = KeyScope(tp_rank=0, tp_size=2)
        assert backend.set([PoolTransfer("kv", h, make_pages(2, 256))]).all_ok
        backend.scope = KeyScope(tp_rank=1, tp_size=2)
        assert backend.exists([PoolTransfer("kv", h)]) == 0, "rank 1 must not see rank 0's shard"
        backend.scope = KeyScope(tp_rank=1, tp_size=2, replicated=True)
        assert backend.set([PoolTransfer("mla", h, make_pages(2, 256))]).all_ok
        assert backend.exists([PoolTransfer("mla", h)]) == 0, "only rank 0 writes replicated pages"
        backend.scope = KeyScope(tp_rank=0, tp_size=2, replicated=True)
        assert backend.set([PoolTransfer("mla", h, make_pages(2, 256))]).all_ok
        backend.scope = KeyScope(tp_rank=1, tp_size=2, replicated=True)
        assert backend.exists([PoolTransfer("mla", h)]) == 2, "every rank reads rank 0's pages"
    finally:
        backend.scope = scope


def test_misuse_raises(backend: StorageBackend, make_pages) -> None:
    h = hashes(2)
    with pytest.raises(ValueError, match="2 keys but 1 page"):
        backend.set([PoolTransfer("kv", h, make_pages(1, 256))])
    with pytest.raises(ValueError, match="one transfer per pool"):
        backend.get(
            [
                PoolTransfer("kv", h[:1], make_pages(1, 256)),
                PoolTransfer("kv", h[1:], make_pages(1, 256)),
            ]
        )
    with pytest.raises(ValueError, match="uint8"):
        backend.get([PoolTransfer("kv", h[:1], [torch.zeros(64, dtype=torch.float32)])])
    with pytest.raises(ValueError, match="same page count"):
        backend.exists([PoolTransfer("kv", h), PoolTransfer("swa", h[:1])])


@pytest.mark.timeout(60)
def test_concurrent_backup_and_prefetch(backend: StorageBackend, make_pages) -> None:
    """A writer and readers race on overlapping keys; every served page must be exact."""
    n, rounds = 16, 20
    h = hashes(n)
    src = make_pages(n, PAGE)
    ref = fill(src, 7)
    outs = [make_pages(n, PAGE) for _ in range(2)]
    errors: list[str] = []

    def writer() -> None:
        for r in range(rounds):
            res = backend.set([PoolTransfer("kv", h[: (r % n) + 1], src[: (r % n) + 1])])
            if not res.all_ok:
                errors.append(f"write round {r}: {res.ok}")

    def reader(out: list[torch.Tensor]) -> None:
        for _ in range(rounds):
            got = backend.get([PoolTransfer("kv", h, out)]).ok["kv"]
            errors.extend(
                f"page {i} served wrong bytes"
                for i, ok in enumerate(got)
                if ok and not torch.equal(out[i], ref[i])
            )

    threads = [threading.Thread(target=writer)] + [
        threading.Thread(target=reader, args=(o,)) for o in outs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    assert not any(t.is_alive() for t in threads), "a storage call hung"
    assert not errors, errors[:5]
    assert backend.exists([PoolTransfer("kv", h)]) == n


def test_pages_in_parts_are_one_object(backend: StorageBackend, make_pages) -> None:
    """A page given as K and V ranges is stored as their concatenation, and read back as parts
    or whole."""
    h = hashes(3)
    k, v = make_pages(3, 1024), make_pages(3, 3072)
    ref_k, ref_v = fill(k, 10), fill(v, 11)
    assert backend.set([PoolTransfer("kv", h, [[a, b] for a, b in zip(k, v)])]).all_ok
    whole = make_pages(3, 4096)
    assert backend.get([PoolTransfer("kv", h, whole)]).all_ok
    for i in range(3):
        assert torch.equal(whole[i], torch.cat([ref_k[i], ref_v[i]])), f"page {i}"
    k2, v2 = make_pages(3, 1024), make_pages(3, 3072)
    assert backend.get([PoolTransfer("kv", h, [[a, b] for a, b in zip(k2, v2)])]).all_ok
    assert first_mismatch(k2, ref_k) is None and first_mismatch(v2, ref_v) is None
    odd = make_pages(1, 1024) + make_pages(1, 2048)
    assert backend.get([PoolTransfer("kv", h[:1], [odd])]).ok["kv"] == [False], "short by 1 KiB"
    with pytest.raises(ValueError, match="no parts"):
        backend.get([PoolTransfer("kv", h[:1], [[]])])


def test_a_failed_existence_check_is_counted(backend: StorageBackend, monkeypatch) -> None:
    """A store that cannot answer ``exists`` counts as absent (a miss, not an error to the
    caller) and its pages are counted in ``failed_pages.read``: an outage does not pass for a
    cold cache in the metrics."""

    def broken(object_keys):
        raise OSError("the store is unreachable")

    monkeypatch.setattr(backend, "_contains", broken)
    keys = hashes(3)
    before = backend.metrics.snapshot()["failed_pages.read"]
    assert backend.exists([PoolTransfer("kv", keys)]) == 0
    assert backend.metrics.snapshot()["failed_pages.read"] == before + 3
