"""The C loops' worker threads (``native_io.c``'s pool): a put's write on a worker that also writes
the batch's journal after its runs, helpers kept across calls, and a forked child that starts
with a pool of its own."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes
from kvtier.storage.segments import native
from tests.storage.conftest import assert_only_the_later_batch_served, native_library

NS = Namespace("segment-workers", "bfloat16", 4, "page_first")
H = page_hashes(range(4096), NS)  # 1,024 pages of 4 tokens
WAIT_S = 60.0


@pytest.fixture
def lib():
    return native_library()


def pages_of(n: int, size: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=g).unbind(0))


def started(lib, fd: int, pages: list[torch.Tensor]):
    """A write of ``pages`` back to back from offset 0 of ``fd``, started on a worker."""
    runs = native.make_runs([fd], [0], [0], [len(pages)])
    addr = np.array([p.data_ptr() for p in pages], dtype=np.uint64)
    n = np.array([p.numel() for p in pages], dtype=np.uint64)
    pending = native.write_start(lib, runs, addr, n)
    assert pending is not None
    return pending, runs


def test_the_worker_writes_the_journal_after_the_runs_and_stamps_the_segment(
    tmp_path: Path, lib
) -> None:
    pages = pages_of(4, 8192, 1)
    entries = os.urandom(300)
    stamp = 1_234_567_890_123_456_789
    with open(tmp_path / "seg", "wb+") as seg, open(tmp_path / "jrn", "wb+") as jrn:
        jrn.write(b"\xaa" * 50)  # entries before: left alone
        jrn.flush()
        pending, runs = started(lib, seg.fileno(), pages)
        pending.journal(jrn.fileno(), 50, entries, True, seg.fileno(), stamp)
        assert pending.wait() == (True, 0)
        st = os.fstat(seg.fileno())  # before the reads below, which may set its atime
        assert st.st_mtime_ns == stamp and st.st_atime_ns == stamp, "the shared LRU clock"
        assert runs["err"].tolist() == [0]
        assert os.pread(seg.fileno(), 4 * 8192, 0) == b"".join(p.numpy().tobytes() for p in pages)
        assert os.pread(jrn.fileno(), 400, 0) == b"\xaa" * 50 + entries


def test_a_failed_run_leaves_the_journal_to_the_caller(tmp_path: Path, lib) -> None:
    """A run whose write fails (a descriptor opened read-only): the worker writes no journal,
    and says so."""
    pages = pages_of(2, 4096, 2)
    (tmp_path / "seg").write_bytes(b"")
    ro = os.open(tmp_path / "seg", os.O_RDONLY)
    try:
        with open(tmp_path / "jrn", "wb+") as jrn:
            pending, runs = started(lib, ro, pages)
            pending.journal(jrn.fileno(), 0, b"entries", False, ro, 1)
            assert pending.wait() == (False, 0)
            assert runs["err"].tolist() == [errno.EBADF]
            assert os.fstat(jrn.fileno()).st_size == 0, "nothing journaled for a failed run"
    finally:
        os.close(ro)


def test_a_journal_that_cannot_be_written_is_reported(tmp_path: Path, lib) -> None:
    pages = pages_of(2, 4096, 3)
    (tmp_path / "jrn").write_bytes(b"")
    ro = os.open(tmp_path / "jrn", os.O_RDONLY)
    try:
        with open(tmp_path / "seg", "wb+") as seg:
            pending, runs = started(lib, seg.fileno(), pages)
            pending.journal(ro, 0, b"entries", False, seg.fileno(), 1)
            assert pending.wait() == (False, errno.EBADF)
            assert runs["err"].tolist() == [0]
    finally:
        os.close(ro)


def test_a_write_given_no_journal_ends_without_one(tmp_path: Path, lib) -> None:
    """The worker waits for the journal only until the caller waits for the write."""
    pages = pages_of(2, 4096, 4)
    with open(tmp_path / "seg", "wb+") as seg:
        pending, runs = started(lib, seg.fileno(), pages)
        assert pending.wait() == (False, 0)
        assert pending.wait() == (False, 0), "a second wait returns the same"
        assert runs["err"].tolist() == [0]
        assert os.fstat(seg.fileno()).st_size == 2 * 4096


def test_a_journal_the_worker_could_not_write_fails_the_batch_and_the_segment(
    tmp_path: Path, lib, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker's journal write fails (here: handed a bad descriptor): the batch's pages are
    not stored, their segment takes no more, and the next batch stores and serves its pages
    (also to a fresh reader)."""
    journal = native.Pending.journal

    def bad_descriptor(self, jfd, *args):
        return journal(self, -1, *args)

    root = tmp_path / "l3"
    b = create_backend("file", root=root)
    pages = pages_of(8, 64 << 10, 5)
    monkeypatch.setattr(native.Pending, "journal", bad_descriptor)
    assert b.set([PoolTransfer("kv", H[:8], pages)]).ok["kv"] == [False] * 8
    monkeypatch.undo()
    assert b.set([PoolTransfer("kv", H[8:16], pages)]).all_ok
    names = sorted(p.name for p in root.glob("*.kvs"))
    # The failed segment took no more records, and holding none journaled it was dropped.
    assert len(names) == 1 and names[0].endswith("-00000002.kvs"), names
    assert_only_the_later_batch_served(b, root, H, pages)


def test_workers_are_kept_across_batches(tmp_path: Path, lib) -> None:
    """Puts and gets through the C loops run on the pool's workers, which stay for the next
    calls: after the first batches no worker is started and no thread comes or goes."""
    b = create_backend("file", root=tmp_path / "l3")
    pages = pages_of(16, 64 << 10, 6)
    out = [torch.empty(64 << 10, dtype=torch.uint8) for _ in range(16)]

    def batch(i: int) -> None:
        keys = H[16 * i : 16 * i + 16]
        assert b.set([PoolTransfer("kv", keys, pages)]).all_ok
        assert b.get([PoolTransfer("kv", keys, out)]).all_ok

    for i in range(3):
        batch(i)
    workers, threads = lib.kvt_workers(), set(os.listdir("/proc/self/task"))
    assert 1 <= workers <= 64
    for i in range(3, 30):
        batch(i)
        assert lib.kvt_workers() == workers
        assert set(os.listdir("/proc/self/task")) == threads
    b.close()


def test_a_forked_child_starts_its_own_workers(tmp_path: Path, lib) -> None:
    """A child forked after the parent's workers started (they are not in the child) puts and
    gets through the C loops, in bounded time."""
    b = create_backend("file", root=tmp_path / "parent")
    pages = pages_of(16, 64 << 10, 7)
    assert b.set([PoolTransfer("kv", H[:16], pages)]).all_ok  # the parent's workers run
    pid = os.fork()
    if pid == 0:  # the child: exit 0 only if its own store writes and reads back
        code = 1
        try:
            c = create_backend("file", root=tmp_path / "child")
            out = [torch.empty(64 << 10, dtype=torch.uint8) for _ in range(16)]
            ok = c.set([PoolTransfer("kv", H[16:32], pages)]).all_ok
            ok = ok and c.get([PoolTransfer("kv", H[16:32], out)]).all_ok
            ok = ok and all(torch.equal(o, p) for o, p in zip(out, pages))
            code = 0 if ok else 1
        finally:
            os._exit(code)
    deadline = time.monotonic() + WAIT_S
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child's put or get did not end")
        time.sleep(0.05)  # polling the child's exit, not standing in for synchronisation
    assert os.waitstatus_to_exitcode(status) == 0
    b.close()
