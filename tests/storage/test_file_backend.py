"""File backend specifics: on-disk format checks, atomic writes, start-up index, LRU capacity."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from kvtier.metrics import TierMetrics
from kvtier.storage import KeyScope, Namespace, PoolTransfer, page_hashes
from kvtier.storage.file_backend import FilePerPageBackend as FileBackend
from kvtier.storage.page_format import HEADER_SIZE


def per_page(
    *, scope: KeyScope | None = None, metrics: TierMetrics | None = None, **config: object
) -> FileBackend:
    """The per-page file store (``create_backend("file")`` is the segment store, tested in
    ``test_segment_store.py``): these tests pin its per-page-file format and defences."""
    return FileBackend(FileBackend.Config(**config), scope=scope, metrics=metrics)


NS = Namespace("test-model", "bfloat16", 4, "page_first")
PAGE = 1024


def pages(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, 256, (n, PAGE), dtype=torch.uint8, generator=g).unbind(0))


def empty(n: int) -> list[torch.Tensor]:
    return list(torch.full((n, PAGE), 0xEE, dtype=torch.uint8).unbind(0))


def files(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir())


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "l3"


def test_one_file_per_page_object(root: Path) -> None:
    b = per_page(root=root)
    h = page_hashes(range(8), NS)
    b.set([PoolTransfer("kv", h, pages(2, 0))])
    assert files(root) == sorted(f"{k}.kvp" for k in KeyScope().object_keys(h, "kv"))
    assert all((root / f).stat().st_size == HEADER_SIZE + PAGE for f in files(root))


@pytest.mark.parametrize("damage", ["flip-payload", "flip-header", "truncate", "rename"])
def test_checksum_miss_is_counted_and_not_served(root: Path, damage: str) -> None:
    b = per_page(root=root)
    h = page_hashes(range(8), NS)
    src = pages(2, 1)
    b.set([PoolTransfer("kv", h, src)])
    victim = root / f"{h[1]}.kv.r0.kvp"
    data = bytearray(victim.read_bytes())
    if damage == "flip-payload":
        data[HEADER_SIZE + 100] ^= 0x01
    elif damage == "flip-header":
        data[12] ^= 0x01  # payload length field
    elif damage == "truncate":
        data = data[:-1]
    if damage == "rename":  # page 0's valid object now sits under page 1's key
        os.replace(root / f"{h[0]}.kv.r0.kvp", victim)
        b = per_page(root=root)
    else:
        victim.write_bytes(bytes(data))
        if damage == "truncate":
            b = per_page(root=root)  # the index learns the new size at start-up
    out = empty(2)
    res = b.get([PoolTransfer("kv", h, out)])
    assert res.ok["kv"][1] is False
    assert b.metrics.snapshot()["checksum_miss_pages"] == 1
    assert not victim.exists(), "a bad object is dropped so a later backup can rewrite it"
    assert b.exists([PoolTransfer("kv", h[1:])]) == 0
    if damage != "rename":
        assert torch.equal(out[0], src[0])
        assert b.set([PoolTransfer("kv", h[1:], src[1:])]).all_ok
        assert b.get([PoolTransfer("kv", h[1:], out[1:])]).all_ok and torch.equal(out[1], src[1])


def test_write_is_atomic(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A write that dies half-way leaves neither a final file nor a temp file behind."""
    b = per_page(root=root)
    h = page_hashes(range(4), NS)
    real_writev = os.writev

    def dying_writev(fd: int, buffers: list) -> int:
        real_writev(fd, [buffers[0], memoryview(buffers[1])[:100]])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "writev", dying_writev)
    assert b.set([PoolTransfer("kv", h, pages(1, 2))]).ok["kv"] == [False]
    monkeypatch.undo()
    assert files(root) == []
    assert b.exists([PoolTransfer("kv", h)]) == 0


def test_rename_is_the_commit_point(root: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Until the rename only a temp file exists; the final name appears complete."""
    b = per_page(root=root)
    h = page_hashes(range(4), NS)
    seen: list[list[str]] = []
    real_replace = os.replace

    def spying_replace(src: str, dst: str, **dir_fds) -> None:
        seen.append(files(root))
        assert (root / src).stat().st_size == HEADER_SIZE + PAGE  # names relative to the root
        real_replace(src, dst, **dir_fds)

    monkeypatch.setattr(os, "replace", spying_replace)
    b.set([PoolTransfer("kv", h, pages(1, 3))])
    assert len(seen) == 1 and len(seen[0]) == 1 and seen[0][0].endswith(".tmp")


def test_index_rebuilt_at_startup(root: Path) -> None:
    b = per_page(root=root)
    h = page_hashes(range(16), NS)
    src = pages(4, 4)
    b.set([PoolTransfer("kv", h, src)])
    stale = root / f"{h[0]}.kv.r0.kvp.123-4-5.tmp"  # a writer's, crashed two hours ago
    stale.write_bytes(b"partial")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    (root / "README").write_text("not a page")
    again = per_page(root=root, stale_tmp_s=3600)
    assert again.exists([PoolTransfer("kv", h)]) == 4
    assert not any(f.endswith(".tmp") for f in files(root)), "stale temp files are deleted"
    assert "README" in files(root)
    out = empty(4)
    assert again.get([PoolTransfer("kv", h, out)]).all_ok
    assert all(torch.equal(a, b) for a, b in zip(out, src))
    assert again.used_bytes == 4 * (HEADER_SIZE + PAGE)


def test_lru_capacity_eviction(root: Path) -> None:
    b = per_page(root=root, capacity_bytes=3 * (HEADER_SIZE + PAGE))
    h = page_hashes(range(20), NS)
    src = pages(5, 5)
    assert b.set([PoolTransfer("kv", h[:3], src[:3])]).all_ok
    assert b.get([PoolTransfer("kv", h[:1], empty(1))]).all_ok  # page 0 is now most recent
    assert b.set([PoolTransfer("kv", h[3:4], src[3:4])]).all_ok
    present = [b.exists([PoolTransfer("kv", [k])]) for k in h[:4]]
    assert present == [1, 0, 1, 1], "the least recently used page (1) goes first"
    assert len(files(root)) == 3 and b.used_bytes == 3 * (HEADER_SIZE + PAGE)
    big = torch.zeros(4 * PAGE, dtype=torch.uint8)
    assert b.set([PoolTransfer("kv", h[4:5], [big])]).ok["kv"] == [False], "larger than capacity"


def test_fsync_and_lru_order_survive_restart(root: Path) -> None:
    b = per_page(root=root, fsync=True)
    h = page_hashes(range(12), NS)
    for i in range(3):
        b.set([PoolTransfer("kv", h[i : i + 1], pages(1, i))])
        os.utime(root / f"{h[i]}.kv.r0.kvp", (1000 + i, 1000 + i))
    again = FileBackend(FileBackend.Config(root, capacity_bytes=3 * (HEADER_SIZE + PAGE)))
    again.set([PoolTransfer("kv", [page_hashes(range(100, 104), NS)[0]], pages(1, 9))])
    assert [again.exists([PoolTransfer("kv", [k])]) for k in h] == [0, 1, 1]


def test_config_validates(root: Path) -> None:
    with pytest.raises(ValueError, match="capacity_bytes"):
        per_page(root=root, capacity_bytes=0)
    with pytest.raises(TypeError):
        per_page(root=root, no_such_option=1)


def test_sees_files_other_processes_write_later(root: Path) -> None:
    """Rank 1 reads the replicated pages rank 0 writes after rank 1 started."""
    rank1 = per_page(root=root, scope=KeyScope(tp_rank=1, tp_size=2, replicated=True))
    rank0 = per_page(root=root, scope=KeyScope(tp_rank=0, tp_size=2, replicated=True))
    h = page_hashes(range(8), NS)
    assert rank1.exists([PoolTransfer("kv", h)]) == 0
    src = pages(2, 8)
    assert rank0.set([PoolTransfer("kv", h, src)]).all_ok
    assert rank1.exists([PoolTransfer("kv", h)]) == 2
    out = empty(2)
    assert rank1.get([PoolTransfer("kv", h, out)]).all_ok
    assert all(torch.equal(a, b) for a, b in zip(out, src))
    assert rank1.used_bytes == 2 * (HEADER_SIZE + PAGE)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_batches_split_over_threads_keep_page_order(root: Path, threads: int) -> None:
    """Per-page results stay in page order however the batch is split; a missing page in the
    middle, a corrupted one and a key repeated within one batch are each reported in place."""
    b = per_page(root=root, read_threads=threads, write_threads=threads)
    h = page_hashes(range(4 * 9), NS)
    src = pages(9, 10)
    keys = h[:4] + [h[2]] + h[4:8]  # page 4 repeats page 2's key
    res = b.set([PoolTransfer("kv", keys, src[:4] + [src[2]] + src[4:8])])
    assert res.ok["kv"] == [True] * 9 and len(files(root)) == 8
    (root / f"{h[5]}.kv.r0.kvp").unlink()
    bad = root / f"{h[6]}.kv.r0.kvp"
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0x01
    bad.write_bytes(bytes(data))
    out = empty(8)
    got = b.get([PoolTransfer("kv", h[:8], out)]).ok["kv"]
    assert got == [True, True, True, True, True, False, False, True], got
    assert all(torch.equal(out[i], src[i]) for i in (0, 1, 2, 3, 4, 7))
    assert b.metrics.snapshot()["checksum_miss_pages"] == 1
    b.close()


def test_thread_counts_validate(root: Path) -> None:
    for name in ("read_threads", "write_threads"):
        with pytest.raises(ValueError, match=f"{name} must be >= 1"):
            per_page(root=root, **{name: 0})
