"""The segment store reclaims half-dead segments and bounds its read descriptors.

Compaction: a finished segment whose live records take less than ``compact_below`` of its bytes
has them copied into the writer's active segment and is deleted; a reader in the middle of a read
of it (another backend on the root, or another process) still gets every byte right. Records are
killed here the way they die in service: failing verification (a flipped byte) drops them.
Page bytes are a function of the key, so every read is checked byte for byte.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes
from kvtier.storage.segments import SegmentBackend
from kvtier.storage.segments import reader as reader_module
from kvtier.storage.segments.format import RECORD_HEAD
from tests.children import child_env

NS = Namespace("compaction-test", "bfloat16", 4, "page_first")
PAGE = 4096
RECORD = RECORD_HEAD + PAGE
H = page_hashes(range(4 * 64), NS)
WAIT_S = 10.0  # an event not set within this is a hang, not slowness


def expected(h: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(h[:15], 16))
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)


def put(b: SegmentBackend, hashes: list[str]) -> list[bool]:
    return b.set([PoolTransfer("kv", hashes, [expected(h) for h in hashes])]).ok["kv"]


def served(b: SegmentBackend, hashes: list[str]) -> list[bool]:
    """Per page: read back and equal to its expected bytes (a wrong byte fails the test)."""
    out = list(torch.full((len(hashes), PAGE), 0xEE, dtype=torch.uint8).unbind(0))
    ok = b.get([PoolTransfer("kv", hashes, out)]).ok["kv"]
    for i, (h, got) in enumerate(zip(hashes, ok)):
        if got:
            assert torch.equal(out[i], expected(h)), f"page {i} served with wrong bytes"
    return ok


def store(root: Path, **config: object) -> SegmentBackend:
    """Segments of eight records; the journal reservation is ample for eight entries. Stores
    list the root at once (these tests check what another store sees, not when)."""
    config.setdefault("list_interval_s", 0)
    b = create_backend("file", root=root, segment_bytes=8 * RECORD, touch_interval_s=0, **config)
    assert isinstance(b, SegmentBackend)
    return b


def flip(b: SegmentBackend, h: str) -> None:
    """Flip one payload byte of ``h``'s record on disk."""
    span = b.locate(f"{h}.kv.r0")
    assert span is not None
    with open(span.path, "r+b") as f:
        f.seek(span.offset + RECORD_HEAD + 100)
        byte = f.read(1)[0]
        f.seek(span.offset + RECORD_HEAD + 100)
        f.write(bytes([byte ^ 0xFF]))


def half_dead(root: Path, **config: object) -> tuple[SegmentBackend, Path]:
    """A store whose first segment (pages 0-7, finished) has only pages 0 and 1 live: pages 2-7
    failed verification on a read and were dropped. Returns the store and that segment."""
    w = store(root, **config)
    assert put(w, H[:8]) == [True] * 8
    assert put(w, H[8:16]) == [True] * 8  # the first segment is full: a second one is active
    first = w.locate(f"{H[0]}.kv.r0")
    assert first is not None and len(list(root.glob("*.kvs"))) == 2
    for h in H[2:8]:
        flip(w, h)
    assert served(w, H[:8]) == [True, True] + [False] * 6
    assert w.metrics.snapshot()["checksum_miss_pages"] == 6
    return w, first.path


def test_half_dead_segment_is_compacted_on_the_next_write(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    w, first = half_dead(root)
    assert first.exists(), "a write triggers compaction, a read does not"
    assert put(w, H[16:17]) == [True]
    assert not first.exists(), "the half-dead segment was dropped"
    for h in H[:2]:
        span = w.locate(f"{h}.kv.r0")
        assert span is not None and span.path != first, "live records were copied out"
    assert served(w, H[:2] + H[8:17]) == [True] * 11
    assert served(w, H[2:8]) == [False] * 6, "dead records stay dead"
    assert w.metrics.snapshot()["checksum_miss_pages"] == 6, "copies verified, none bad"
    again = store(root)  # a restart sees the copies, and only them
    assert sorted(again.object_keys()) == sorted(f"{h}.kv.r0" for h in H[:2] + H[8:17])
    assert served(again, H[:2] + H[8:17]) == [True] * 11
    assert put(w, H[2:8]) == [True] * 6, "dropped keys can be stored again"
    assert served(again, H[2:8]) == [True] * 6


def test_no_compaction_above_the_threshold_or_when_off(tmp_path: Path) -> None:
    w, first = half_dead(tmp_path / "off", compact_below=0)
    assert put(w, H[16:17]) == [True]
    assert first.exists(), "compact_below=0 turns compaction off"
    w, first = half_dead(tmp_path / "low", compact_below=0.2)  # 2 of 8 live is 25%
    assert put(w, H[16:17]) == [True]
    assert first.exists(), "25% live is above a 20% threshold"


def test_compaction_never_frees_bytes_under_a_read_in_flight(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, python_loops: None
) -> None:
    """Another backend on the root (its own descriptors and books, as another process has)
    reads the live pages of the half-dead segment; its read is held inside ``preadv`` while the
    writer compacts and deletes that segment, then completes with every byte right. (The
    Python loops, whose ``preadv`` can be held; the C loops read under the same pins.)"""
    root = tmp_path / "l3"
    w, first = half_dead(root)
    r = store(root)  # opened after the damage: it still indexes all eight records of ``first``
    reading, compacted = threading.Event(), threading.Event()
    real = reader_module.read_all

    def held(fd: int, iovecs: list[memoryview], offset: int, want: int) -> int:
        if not reading.is_set():  # the first read: the reader's, of pages 0 and 1
            reading.set()
            assert compacted.wait(WAIT_S), "the writer did not compact"
        return real(fd, iovecs, offset, want)

    monkeypatch.setattr(reader_module, "read_all", held)
    box: dict[str, list[bool]] = {}
    t = threading.Thread(target=lambda: box.setdefault("ok", served(r, H[:2])), daemon=True)
    t.start()
    assert reading.wait(WAIT_S), "the reader did not start reading"
    assert put(w, H[16:17]) == [True]
    assert not first.exists(), "deleted while the reader holds it"
    compacted.set()
    t.join(WAIT_S)
    assert not t.is_alive()
    assert box["ok"] == [True, True], "the read in flight got its pages (checked byte for byte)"
    assert served(r, H[:2] + H[8:17]) == [True] * 11, "the reader moves to the copies"


READER = """
import sys, torch
from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes
PAGE = {page}
H = page_hashes(range(4 * 64), Namespace("compaction-test", "bfloat16", 4, "page_first"))
def expected(h):
    g = torch.Generator().manual_seed(int(h[:15], 16))
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)
def served(b, hashes):
    out = list(torch.full((len(hashes), PAGE), 0xEE, dtype=torch.uint8).unbind(0))
    ok = b.get([PoolTransfer("kv", hashes, out)]).ok["kv"]
    wrong = sum(1 for h, o, k in zip(hashes, out, ok) if k and not torch.equal(o, expected(h)))
    return sum(ok), wrong
b = create_backend("file", root=sys.argv[1], list_interval_s=0)  # sees at once
print(*served(b, H[:17]), flush=True)  # before: every live page, through its descriptors
sys.stdin.readline()
print(*served(b, H[:17]), flush=True)  # after the other process compacted
"""


def test_another_process_reads_through_a_compaction(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    w, first = half_dead(root)
    script = tmp_path / "reader.py"
    script.write_text(textwrap.dedent(READER).format(page=PAGE))
    env = child_env()
    child = subprocess.Popen(
        [sys.executable, str(script), str(root)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert child.stdout is not None and child.stdin is not None
        before = child.stdout.readline().split()
        # The child opened the root after the damage: it reads pages 2-7 too and finds them bad.
        assert before == ["10", "0"], (before, child.stderr.read() if not before else "")
        assert put(w, H[16:17]) == [True]
        assert not first.exists()
        child.stdin.write("go\n")
        child.stdin.flush()
        after = child.stdout.readline().split()
        assert after == ["11", "0"], after  # pages 0, 1 (copied), 8-15 and the new 16
        assert child.wait(timeout=60) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_read_descriptors_are_bounded(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    w = create_backend("file", root=root, segment_bytes=2 * RECORD)
    for lo in range(0, 20, 2):
        assert put(w, H[lo : lo + 2]) == [True, True]  # ten segments
    r = create_backend("file", root=root, open_segments=3)
    assert isinstance(r, SegmentBackend)
    fds_before = len(os.listdir("/proc/self/fd"))
    assert served(r, H[:20]) == [True] * 20  # one batch over ten segments: all pinned at once
    assert r.open_descriptors == 3, "the least recently used are closed after the read"
    for _ in range(2):
        assert served(r, H[:20:3]) == [True] * 7
        assert r.open_descriptors == 3
    assert len(os.listdir("/proc/self/fd")) - fds_before <= 3
    r.close()
    w.close()


def test_a_failed_compaction_keeps_the_segment_and_the_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy cannot be appended (a full disk, say): the segment and its live records stay,
    and the write that triggered the compaction still succeeds."""
    root = tmp_path / "l3"
    w, first = half_dead(root)
    real = w._writer.append
    calls = {"n": 0}

    def append(keys: list[str], parts: list, lengths: list[int], time_ns: int = 0) -> list[bool]:
        calls["n"] += 1
        if calls["n"] == 2:  # the first call stores the page, the second is the compaction's
            return [False] * len(keys)
        return real(keys, parts, lengths, time_ns)

    monkeypatch.setattr(w._writer, "append", append)
    assert put(w, H[16:17]) == [True]
    assert calls["n"] == 2, "compaction was attempted"
    assert first.exists(), "the segment stays when its live records could not be copied"
    assert served(w, H[:2] + H[8:17]) == [True] * 11
    monkeypatch.undo()
    assert put(w, H[17:18]) == [True]
    assert not first.exists(), "the next write compacts it"
    assert served(w, H[:2] + H[8:18]) == [True] * 12


def test_compacted_copy_does_not_outrank_a_newer_tombstone(tmp_path):
    """Process A deletes a page while process B, which has not read A's journal yet, compacts
    the page's segment: the copy keeps the record's old time, so A's tombstone still wins, in A
    and after a restart."""
    root = tmp_path / "l3"
    b = store(root)
    assert put(b, H[:8]) == [True] * 8
    assert put(b, H[8:16]) == [True] * 8  # the first segment finished
    b.delete([PoolTransfer("kv", H[2:8])])  # that segment is now a compaction candidate
    a = store(root)
    assert a.delete([PoolTransfer("kv", [H[0]])]).ok == {"kv": [True]}
    with b._append:  # b compacts without having read a's journal since the delete
        copied, bad = b._compactor.step()
    assert copied >= 1 and bad == 0
    assert served(a, [H[0]]) == [False]
    assert served(store(root), [H[0]]) == [False]
    assert served(store(root), [H[1]]) == [True]  # the live copy of the other page is served


@pytest.mark.parametrize("lanes", [1, 2])
def test_compaction_keeps_every_batchs_live_records(tmp_path: Path, lanes: int) -> None:
    """A segment holding two batches (two journal times), most of it dead: its live records of
    both batches are copied (each keeps its own time, plus 1 ns, so the copy wins over its
    original whatever the segments' names) and stay served, also after a restart."""
    root = tmp_path / "l3"
    w = store(root, write_lanes=lanes)
    assert all(put(w, H[:4])) and all(put(w, H[4:8]))  # one segment, two batch times
    first = w.locate(f"{H[0]}.kv.r0")
    assert first is not None and first.path == w.locate(f"{H[5]}.kv.r0").path  # type: ignore[union-attr]
    assert all(put(w, H[8:16]))  # the first segment is finished
    for h in H[1:5] + H[6:8]:
        flip(w, h)
    assert served(w, H[:8]) == [True, False, False, False, False, True, False, False]
    assert all(put(w, H[16:17]))  # the next put compacts the 2/8-live segment
    assert not first.path.exists(), "the half-dead segment was compacted away"
    assert served(w, [H[0], H[5]]) == [True, True]
    w.close()
    again = store(root)
    assert served(again, [H[0], H[5]]) == [True, True]


@pytest.mark.parametrize("verify", ["always", "once"])
def test_a_key_read_twice_in_a_batch_gets_its_own_bytes(tmp_path: Path, verify: str) -> None:
    """Reading [A, A, C] of records A, B, C written back to back (one chunk of the read): its
    span equals the sum of its lengths, yet the second A is not where B is. Each page gets its
    own record, no checksum miss is counted and A stays in the index. (Kept here for the
    small pages a read chunk holds several of.)"""
    b = store(tmp_path, verify=verify)
    try:
        a, bb, c = H[:3]
        assert all(put(b, [a, bb, c]))
        for _ in range(2):  # the second time A is trusted under verify="once"
            assert served(b, [a, a, c]) == [True, True, True]
        assert b.metrics.snapshot()["checksum_miss_pages"] == 0
        assert all(served(b, [a, bb, c]))
    finally:
        b.close()


def _scan(b: SegmentBackend) -> float | None:
    """The candidate a scan of every segment picks: its live fraction (None: no candidate)."""
    index, below = b._index, b._compactor._below
    ratios = [
        s.live_bytes / s.end
        for s in index.segments.values()
        if s.jfd is None and s not in index.active and s.end > 0 and not s.gone
    ]
    ratios = [r for r in ratios if r < below]
    return min(ratios) if ratios else None


@pytest.mark.parametrize("seed", range(40))
def test_compaction_candidates_kept_up_to_date_equal_a_full_scan(tmp_path: Path, seed: int) -> None:
    """The compactor looks only at segments whose books changed (``Index.changed``), not at
    every segment on each batch: after random puts, deletes and rewrites by three stores on one
    root, its candidate's live fraction is always the one a scan of every segment finds. The
    third store lists the root only when forced, so it writes keys the others hold again
    (superseding their records) and its segments' journals are closed as final late."""
    import random

    root = tmp_path / "l3"
    rng = random.Random(seed)
    a, b = store(root, compact_below=0.6), store(root, compact_below=0.6)
    late = store(root, compact_below=0.6, list_interval_s=3600)
    stores = (a, b, late)
    stored: list[str] = []
    fresh = iter(page_hashes(range(4 * 128), NS))
    for _ in range(60):  # at most 120 fresh keys
        who = rng.choice(stores)
        r = rng.random()
        if stored and r < 0.3:
            gone = rng.sample(stored, min(len(stored), rng.randint(1, 3)))
            assert who.delete([PoolTransfer("kv", gone)]).all_ok
            stored = [h for h in stored if h not in gone]
        elif stored and r < 0.5:
            # Keys in segments the late store has not listed yet: written again, newer.
            known = late._index.entries
            unseen = [h for h in stored if late.scope.object_key(h, "kv") not in known] or stored
            again = rng.sample(unseen, min(len(unseen), rng.randint(1, 3)))
            assert put(late, again) == [True] * len(again)
        else:
            new = [next(fresh) for _ in range(rng.randint(1, 2))]
            assert put(who, new) == [True] * len(new)
            stored += new
        if rng.random() < 0.2:
            with late._index.mutex:
                late._index.forget_listing_locked()
        for x in stores:
            with x._index.mutex:
                x._index.refresh_locked(tail=True)
                got = x._compactor._candidate_locked()
                want = _scan(x)
                assert (None if got is None else got.live_bytes / got.end) == want
    # Another store's new segments reach ``a`` within max(list_interval_s, 10 x a listing's
    # own time): not at once even with list_interval_s=0 when a listing was slow (a loaded
    # machine), so ``a`` lists now. (A segment compacted away under ``a``'s books is found
    # by the read itself: ``Reader.read`` lists again when a segment cannot be opened.)
    with a._index.mutex:
        a._index.forget_listing_locked()
    assert served(a, stored) == [True] * len(stored)
    for x in stores:
        x.close()


def test_read_finds_records_another_store_compacted_away(tmp_path: Path) -> None:
    """Store ``a`` indexed a segment (without opening it) that store ``b`` then compacted away
    (its live records copied to a new segment first). ``a`` lists the root rarely
    (``list_interval_s``), and a key it holds does not make it look: the read itself, finding
    the old segment gone, lists and plans again, so the pages stay served instead of missing
    until the next listing."""
    root = tmp_path / "l3"
    b = store(root, compact_below=0.6)
    first, second = H[:8], H[8:16]
    assert put(b, first) == [True] * 8  # one whole segment
    assert put(b, second) == [True] * 8  # the first one finished
    a = store(root, list_interval_s=3600, compact_below=0)  # lists once, at start
    span = a.locate(f"{first[0]}.kv.r0")  # indexed; its segment not opened by a yet
    assert span is not None
    old = Path(span.path)
    assert b.delete([PoolTransfer("kv", first[2:])]).all_ok
    assert put(b, H[16:17]) == [True]  # b's compactor copies first[:2] and deletes the segment
    assert not old.exists(), "the test needs b to compact the segment away"
    assert served(a, first[:2]) == [True, True]
    for x in (a, b):
        x.close()


def test_compaction_drops_a_record_that_would_end_past_its_segment(tmp_path: Path) -> None:
    """A journal entry whose record would end past its segment's file (crafted, or another
    file's) is dropped by compaction, not sized into its copy buffer (a length of a terabyte
    failed the whole compaction; a few GB would have been allocated): the other live records
    are copied, the segment goes, and the liar's key is a miss."""
    root = tmp_path / "l3"
    b = store(root, compact_below=0.6)
    first = H[:8]
    assert put(b, first) == [True] * 8
    assert put(b, H[8:16]) == [True] * 8  # the first segment finished
    key = f"{first[0]}.kv.r0"
    with b._index.mutex:
        b._index.entries[key] = b._index.entries[key]._replace(length=1 << 40)
    old = Path(b.locate(key).path)  # type: ignore[union-attr]
    assert b.delete([PoolTransfer("kv", first[2:])]).all_ok
    assert put(b, H[16:17]) == [True]  # compaction of the first segment
    assert not old.exists()
    assert served(b, first[:2]) == [False, True]
    b.close()


def test_compaction_moves_past_a_segment_it_cannot_remove(tmp_path: Path, monkeypatch) -> None:
    """A segment copied out whose file cannot be removed (EPERM) stays on disk and indexed; it
    is not the compactor's candidate again (it would be the best one on every batch: a listing
    and a failed unlink each time, and no other segment compacted)."""
    from kvtier.storage.segments import space as space_module

    root = tmp_path / "l3"
    b = store(root, compact_below=0.6)
    assert put(b, H[:8]) == [True] * 8 and put(b, H[8:16]) == [True] * 8
    first = Path(b.locate(f"{H[0]}.kv.r0").path).stem  # type: ignore[union-attr]
    second = Path(b.locate(f"{H[8]}.kv.r0").path)  # type: ignore[union-attr]
    real, attempts = os.unlink, []

    def unlink(name, *args, **kwargs):
        if str(name) == f"{first}.kvs":
            attempts.append(name)
            raise PermissionError(1, "Operation not permitted", name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(space_module.os, "unlink", unlink)
    assert b.delete([PoolTransfer("kv", H[2:8])]).all_ok
    assert put(b, H[16:17]) == [True]  # the first segment copied out, its file stays
    assert b.delete([PoolTransfer("kv", H[10:16])]).all_ok
    for i in range(17, 25):
        assert put(b, H[i : i + 1]) == [True]
    assert len(attempts) == 1, f"{len(attempts)} tries to remove the stuck segment"
    assert not second.exists(), "the second half-dead segment was never compacted"
    assert served(b, [*H[:2], *H[8:10], *H[16:25]]) == [True] * 13
    b.close()


def test_read_of_an_unopenable_segment_keeps_the_listing_rate(tmp_path: Path) -> None:
    """A segment that is in the root but cannot be opened (here a symlink in its place) is a
    miss, and does not make every read list the root (only a segment gone from the root
    does): listings stay at the rate ``list_interval_s`` sets."""
    root = tmp_path / "l3"
    w = store(root)
    assert put(w, H[:8]) == [True] * 8
    w.close()
    r = store(root, list_interval_s=3600)
    for seg in root.glob("*.kvs"):
        os.rename(seg, f"{seg}.moved")
        os.symlink(f"{seg.name}.moved", seg)
    listings = r._index.listings
    for _ in range(20):
        assert served(r, H[:1]) == [False]
    assert r._index.listings == listings
    r.close()


def test_a_delete_outlives_the_compaction_of_its_tombstones_segment(tmp_path: Path) -> None:
    """A key deleted while its record sits in one segment and its tombstone lands in another:
    compacting the tombstone's segment carries the tombstone on, so a restart does not serve
    the deleted key again from the older segment; a key stored again after its delete stays."""
    root = tmp_path / "l3"
    b = store(root, compact_below=0.6)
    assert put(b, H[:8]) == [True] * 8  # the first segment: H[0]'s record stays in it
    assert put(b, H[8:12]) == [True] * 4
    assert b.delete([PoolTransfer("kv", [H[0], H[1]])]).all_ok  # tombstones in the second
    assert put(b, [H[1]]) == [True]  # stored again after its delete: newer than its tombstone
    assert put(b, H[12:15]) == [True] * 3  # the second segment full: finished
    tombstones = Path(b.locate(f"{H[8]}.kv.r0").path)  # type: ignore[union-attr]
    assert b.delete([PoolTransfer("kv", H[8:14])]).all_ok
    assert put(b, H[16:17]) == [True]  # compacts the second segment away
    assert not tombstones.exists(), "the test needs the tombstones' segment compacted"
    b.close()
    again = store(root)
    assert served(again, [H[0]]) == [False], "a deleted key came back after a restart"
    assert served(again, [H[1], *H[2:8], H[14], H[16]]) == [True] * 9
    again.close()
