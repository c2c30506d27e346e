"""``StorageBackend.delete``: per-page removal on every backend (the segment store, the per-page
store, and Mooncake against a real master), bad keys failing their own page only, and the
segment store's tombstones seen by other processes and across restarts."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvtier.storage import (
    KeyScope,
    Namespace,
    PoolTransfer,
    StorageBackend,
    create_backend,
    page_hashes,
)
from kvtier.storage.segments import SegmentBackend

NS = Namespace("delete-test", "bfloat16", 4, "page_first", tp_size=1)
PAGE = 4096


def hashes(n: int, seed: int = 0) -> list[str]:
    return page_hashes(torch.arange(seed * 10_000, seed * 10_000 + 4 * n), NS)


def expected(h: str, size: int = PAGE) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(h[:15], 16))
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


def put(b: StorageBackend, hs: list[str], make_pages, pool: str = "kv") -> None:
    pages = make_pages(len(hs), PAGE)
    for p, h in zip(pages, hs):
        p.copy_(expected(h))
    assert b.set([PoolTransfer(pool, hs, pages)]).all_ok


def served(b: StorageBackend, hs: list[str], make_pages, pool: str = "kv") -> list[bool]:
    """Per page: read back and equal to its bytes (a wrong byte fails the test)."""
    out = make_pages(len(hs), PAGE)
    for p in out:
        p.fill_(0xEE)
    ok = b.get([PoolTransfer(pool, hs, out)]).ok[pool]
    for i, (h, got) in enumerate(zip(hs, ok)):
        if got:
            assert torch.equal(out[i], expected(h)), f"page {i} served with wrong bytes"
    return ok


@pytest.fixture(params=["file", "file_per_page", "mooncake"])
def any_backend(request: pytest.FixtureRequest, tmp_path: Path):
    """Every backend that can delete, empty."""
    if request.param != "mooncake":
        b = create_backend(request.param, root=tmp_path / "l3")
        yield b
        b.close()
        return
    shared = request.getfixturevalue("mooncake_backend")  # skips where Mooncake cannot run
    shared.clear()
    yield shared
    shared.clear()


def test_delete_removes_listed_pages_only(any_backend: StorageBackend, make_pages) -> None:
    b = any_backend
    h, other = hashes(6), hashes(2, seed=1)
    put(b, h, make_pages)
    put(b, h[:2], make_pages, pool="swa")
    res = b.delete([PoolTransfer("kv", [h[1], h[3], *other])])
    assert res.ok == {"kv": [True] * 4}, "absent pages are gone already"
    assert served(b, h, make_pages) == [True, False, True, False, True, True]
    assert b.exists([PoolTransfer("kv", h)]) == 1
    assert served(b, h[:2], make_pages, pool="swa") == [True, True], "another pool is untouched"
    assert b.delete([PoolTransfer("kv", [h[1]])]).ok == {"kv": [True]}, "deleting twice is fine"
    put(b, h[1:2], make_pages)
    assert served(b, h[:2], make_pages) == [True, True], "a deleted page can be stored again"


def test_bad_key_fails_its_own_page(any_backend: StorageBackend, make_pages) -> None:
    b = any_backend
    h = hashes(3)
    put(b, h, make_pages)
    bad = ["../../escape", h[1].upper(), f"{h[2]}.kv", ""]
    res = b.delete([PoolTransfer("kv", [h[0], *bad, h[2]])])
    assert res.ok["kv"] == [True, False, False, False, False, True]
    assert served(b, h, make_pages) == [False, True, False]


def test_misuse_raises_and_changes_nothing(any_backend: StorageBackend, make_pages) -> None:
    b = any_backend
    h = hashes(2)
    put(b, h, make_pages)
    with pytest.raises(TypeError, match="keys must be a sequence"):
        b.delete([PoolTransfer("kv", h[0])])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="one transfer per pool"):
        b.delete([PoolTransfer("kv", h[:1]), PoolTransfer("kv", h[1:])])
    assert served(b, h, make_pages) == [True, True]


def test_replicated_rank_other_than_0_removes_nothing(
    any_backend: StorageBackend, make_pages
) -> None:
    b = any_backend
    h = hashes(2)
    scope = b.scope
    try:
        b.scope = KeyScope(tp_rank=0, tp_size=2, replicated=True)
        put(b, h, make_pages, pool="mla")
        b.scope = KeyScope(tp_rank=1, tp_size=2, replicated=True)
        assert b.delete([PoolTransfer("mla", h)]).ok == {"mla": [True, True]}
        assert b.exists([PoolTransfer("mla", h)]) == 2, "rank 0 alone removes replicated pages"
        b.scope = KeyScope(tp_rank=0, tp_size=2, replicated=True)
        assert b.delete([PoolTransfer("mla", h)]).all_ok
        assert b.exists([PoolTransfer("mla", h)]) == 0
    finally:
        b.scope = scope


def test_backend_without_delete_says_so(tmp_path: Path) -> None:
    class NoDelete(StorageBackend):
        name = "no-delete"

        def _contains(self, object_keys):  # noqa: ANN001, ANN202
            return [False] * len(object_keys)

        def _read(self, object_keys, pages):  # noqa: ANN001, ANN202
            return [False] * len(object_keys)

        def _write(self, object_keys, pages):  # noqa: ANN001, ANN202
            return [False] * len(object_keys)

        def clear(self) -> None:
            pass

    with pytest.raises(NotImplementedError, match="no-delete"):
        NoDelete().delete([PoolTransfer("kv", hashes(1))])


# -- the segment store's tombstones ------------------------------------------------------------


def segment_store(root: Path, **config: object) -> SegmentBackend:
    # The default list interval: a delete must reach another store's segments made since its
    # last listing.
    b = create_backend("file", root=root, **config)
    assert isinstance(b, SegmentBackend)
    return b


def pages_of(hs: list[str]) -> list[torch.Tensor]:
    return [expected(h) for h in hs]


def empty(n: int) -> list[torch.Tensor]:
    return [torch.empty(PAGE, dtype=torch.uint8) for _ in range(n)]


def test_tombstones_reach_other_processes_and_restarts(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    # The writer lists at once (what it sees, not when); the deleter would not list again for an
    # hour, and the writer's segment is new since its last listing: its delete must list.
    writer = segment_store(root, list_interval_s=0)
    deleter = segment_store(root, list_interval_s=3600)
    h = hashes(4)
    assert writer.set([PoolTransfer("kv", h, pages_of(h))]).all_ok
    assert deleter.delete([PoolTransfer("kv", h[:2])]).all_ok, "another process's records"
    # The deleter's new segment reaches the writer within 10 x the writer's last listing's CPU
    # time (a few ms after a busy test run): what is checked here is what it sees, not when.
    with writer._index.mutex:
        writer._index.forget_listing_locked()
    assert writer.exists([PoolTransfer("kv", h)]) == 0, "the writer sees the tombstones"
    assert writer.get([PoolTransfer("kv", h, empty(4))]).ok["kv"] == [False, False, True, True]
    assert writer.metrics.snapshot()["checksum_miss_pages"] == 0, "a deletion is not damage"
    deleter.close()
    writer.close()
    again = segment_store(root)
    assert again.get([PoolTransfer("kv", h, empty(4))]).ok["kv"] == [False, False, True, True]
    assert again.set([PoolTransfer("kv", h[:1], pages_of(h[:1]))]).all_ok
    again.close()
    third = segment_store(root)
    out = empty(4)
    assert third.get([PoolTransfer("kv", h, out)]).ok["kv"] == [True, False, True, True], (
        "a record newer than the tombstone is served"
    )
    assert torch.equal(out[0], expected(h[0]))
    third.close()


def test_deleted_records_are_reclaimed(tmp_path: Path) -> None:
    """Records a tombstone killed are dead: the segment holding them is compacted or evicted
    like any other dead segment."""
    root = tmp_path / "l3"
    record = 48 + PAGE
    b = segment_store(root, segment_bytes=8 * record, touch_interval_s=0)
    h = hashes(16)
    assert b.set([PoolTransfer("kv", h[:8], pages_of(h[:8]))]).all_ok  # fills segment 1
    first = sorted(root.glob("*.kvs"))[0]
    assert b.delete([PoolTransfer("kv", h[:7])]).all_ok
    assert b.set([PoolTransfer("kv", h[8:16], pages_of(h[8:16]))]).all_ok
    assert not first.exists(), "a segment with one live record in eight was compacted away"
    out = empty(16)
    assert b.get([PoolTransfer("kv", h, out)]).ok["kv"] == [False] * 7 + [True] * 9
    assert all(torch.equal(o, expected(x)) for o, x in zip(out[7:], h[7:]))
    b.close()


# -- review regressions ------------------------------------------------------------------------


@pytest.mark.parametrize("tombstones_first", [False, True])
def test_segment_end_does_not_depend_on_journal_order(tombstones_first):
    """A record segment's end (what compaction reads) is the same whether a tombstone of its
    records was indexed before or after the records."""
    from kvtier.storage.segments.format import Entry
    from kvtier.storage.segments.index import Index, Segment

    ix = Index(Path("/nonexistent"), -1, "me", 8, 1.0)
    rec, tomb = Segment("a-1", "a", 1, -1, None), Segment("b-1", "b", 1, -1, None)
    ix.segments = {"a-1": rec, "b-1": tomb}
    records = [Entry(f"k{i}", i * 4096, 4096, i, 100 + i, 1, 0) for i in range(4)]
    deletes = [Entry(f"k{i}", 0, 0, i, 1000, deleted=True) for i in range(2)]
    order = (
        [(tomb, deletes), (rec, records)] if tombstones_first else [(rec, records), (tomb, deletes)]
    )
    for seg, entries in order:
        ix.insert_locked(seg, entries)
    assert rec.end == 4 * 4096
    assert (rec.live, rec.live_bytes) == (2, 2 * 4096)


def test_a_delete_preallocates_no_data_segment(tmp_path, make_pages):
    """A process with no active segment journals its tombstones in a segment of journal only,
    and eviction keeps that segment after dead data segments (it is not dead while its
    tombstones are in force)."""
    root = tmp_path / "l3"
    a = segment_store(root, list_interval_s=0)  # sees b's new segment at once
    hs = hashes(3)
    put(a, hs, make_pages)
    before = {p.name for p in root.iterdir() if p.suffix == ".kvs"}
    b = segment_store(root)
    assert b.delete([PoolTransfer("kv", hs)]).ok == {"kv": [True] * 3}
    kvs = [p for p in root.iterdir() if p.suffix == ".kvs" and p.name not in before]
    assert len(kvs) == 1 and kvs[0].stat().st_size == 0, kvs
    assert served(a, hs, make_pages) == [False] * 3
    stem = kvs[0].stem
    with b._index.mutex:
        assert b._index.segments[stem].live == 0
        assert {t[1] for t in b._index.tombs.values()} == {stem}


class _ShortAnswer(StorageBackend):
    """A backend whose ``_delete`` answers for fewer pages than asked."""

    name = "short"

    def _contains(self, object_keys):  # pragma: no cover - not used
        return [False] * len(object_keys)

    def _read(self, object_keys, pages):  # pragma: no cover - not used
        return [False] * len(object_keys)

    def _write(self, object_keys, pages):  # pragma: no cover - not used
        return [False] * len(object_keys)

    def clear(self) -> None:  # pragma: no cover - not used
        pass

    def _delete(self, object_keys):
        return [True] * (len(object_keys) - 1)


def test_a_short_delete_answer_fails_the_pages_and_does_not_raise():
    b = _ShortAnswer()
    assert b.delete([PoolTransfer("kv", hashes(3))]).ok == {"kv": [False] * 3}


def _pages(n: int, size: int) -> list[torch.Tensor]:
    return list(torch.empty(n, size, dtype=torch.uint8).unbind(0))


@pytest.mark.parametrize("lanes", [1, 2])
def test_a_clock_stepped_back_does_not_undo_deletes_or_stores(
    tmp_path: Path, monkeypatch, lanes: int
):
    """A record and its tombstone are ordered by their journal times. With the system clock
    stepped back between them (NTP correcting a clock that ran ahead), an acknowledged delete
    lost to the record it deleted, and an acknowledged set to the tombstone before it (found in
    a user trial). A new record or tombstone is stamped after what the store knows of its key;
    with two write lanes too, which split a batch of big pages and share the batch's time."""
    import time

    from kvtier.storage.segments.io import RUN_BYTES
    from kvtier.storage.segments.writer import LANE_MIN_RECORD

    size = LANE_MIN_RECORD if lanes > 1 else PAGE
    n = 4 * RUN_BYTES // LANE_MIN_RECORD if lanes > 1 else 1

    def store(b: StorageBackend, hs: list[str]) -> None:
        assert b.set([PoolTransfer("kv", hs, [expected(h, size) for h in hs])]).all_ok

    def served_now(b: StorageBackend, hs: list[str]) -> list[bool]:
        out = [torch.full((size,), 0xEE, dtype=torch.uint8) for _ in hs]
        ok = b.get([PoolTransfer("kv", hs, out)]).ok["kv"]
        assert all(torch.equal(o, expected(h, size)) for o, h, g in zip(out, hs, ok) if g)
        return ok

    real = time.time_ns
    b = create_backend("file", root=tmp_path / "l3", io_threads=1, write_lanes=lanes)
    gone, back = hashes(n, seed=1), hashes(n, seed=2)
    monkeypatch.setattr(time, "time_ns", lambda: real() + 3600 * 10**9)  # an hour ahead
    store(b, gone)
    store(b, back)
    assert all(b.delete([PoolTransfer("kv", back)]).ok["kv"])
    monkeypatch.setattr(time, "time_ns", real)  # stepped back
    assert all(b.delete([PoolTransfer("kv", gone)]).ok["kv"])
    store(b, back)
    assert not any(served_now(b, gone)), "a deleted page is served"
    assert all(served_now(b, back)), "a page stored after its delete is a miss"
    b.close()
    again = create_backend("file", root=tmp_path / "l3")  # and after a restart
    assert not any(served_now(again, gone)) and all(served_now(again, back))
    again.close()
