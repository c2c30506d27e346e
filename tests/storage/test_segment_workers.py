"""The C loops' worker threads (``native_io.c``'s pool): a put's write on a worker that also writes
the batch's journal after its runs, helpers kept across calls, and a forked child that starts
with a pool of its own."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes
from kvtier.storage.segments import native
from tests.children import child_env
from tests.storage.conftest import assert_only_the_later_batch_served, native_library

NS = Namespace("segment-workers", "bfloat16", 4, "page_first")
H = page_hashes(range(4096), NS)  # 1,024 pages of 4 tokens
WAIT_S = 60.0
_START = native.write_start  # the real one, for tests that replace it


@pytest.fixture
def lib():
    return native_library()


def pages_of(n: int, size: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, 256, (n, size), dtype=torch.uint8, generator=g).unbind(0))


def started(lib, fd: int, pages: list[torch.Tensor], journal: tuple | None = None):
    """A write of ``pages`` back to back from offset 0 of ``fd``, started on a worker (with
    ``journal``: its entries handed over before the worker starts)."""
    runs = native.make_runs([fd], [0], [0], [len(pages)])
    addr = np.array([p.data_ptr() for p in pages], dtype=np.uint64)
    n = np.array([p.numel() for p in pages], dtype=np.uint64)
    pending = native.write_start(lib, runs, addr, n, journal=journal)
    assert pending is not None
    return pending, runs


def ended(pending) -> None:
    """Until the worker has ended (polled: nothing to wait on without ending the write)."""
    deadline = time.monotonic() + WAIT_S
    while not pending.ended():
        assert time.monotonic() < deadline, "the worker did not end"
        time.sleep(0.001)


def test_the_worker_writes_the_journal_after_the_runs_and_stamps_the_segment(
    tmp_path: Path, lib
) -> None:
    pages = pages_of(4, 8192, 1)
    entries = os.urandom(300)
    stamp = 1_234_567_890_123_456_789
    with open(tmp_path / "seg", "wb+") as seg, open(tmp_path / "jrn", "wb+") as jrn:
        jrn.write(b"\xaa" * 50)  # entries before: left alone
        jrn.flush()
        journal = (jrn.fileno(), 50, entries, True, seg.fileno(), stamp)
        pending, runs = started(lib, seg.fileno(), pages, journal)
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
            pending, runs = started(lib, ro, pages, (jrn.fileno(), 0, b"entries", False, ro, 1))
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
            journal = (ro, 0, b"entries", False, seg.fileno(), 1)
            pending, runs = started(lib, seg.fileno(), pages, journal)
            assert pending.wait() == (False, errno.EBADF)
            assert runs["err"].tolist() == [0]
    finally:
        os.close(ro)


def test_the_worker_syncs_both_files_before_it_stamps_the_segment(tmp_path: Path, lib) -> None:
    """With ``sync`` the worker ``fdatasync``s the segment, then the journal, then stamps the
    segment: a segment descriptor that cannot be synced (a pipe) fails the step and is left
    unstamped, as is a journal that cannot be (``/dev/null`` takes the write, not the sync);
    without ``sync`` the same descriptors pass."""
    pages = pages_of(2, 4096, 8)
    stamp = 987_654_321_000_000_001
    r, w = os.pipe()
    null = os.open("/dev/null", os.O_WRONLY)
    try:
        with open(tmp_path / "seg", "wb+") as seg, open(tmp_path / "jrn", "wb+") as jrn:
            for sync, want in ((True, errno.EINVAL), (False, 0)):
                pending, _ = started(
                    lib, seg.fileno(), pages, (jrn.fileno(), 0, b"e", sync, w, stamp)
                )
                assert pending.wait() == (want == 0, want)
                assert (os.fstat(w).st_mtime_ns == stamp) == (not sync), "stamped after the sync"
            seg_stamp = os.fstat(seg.fileno()).st_mtime_ns
            for sync, want in ((True, errno.EINVAL), (False, 0)):
                journal = (null, 0, b"e", sync, seg.fileno(), stamp)
                pending, _ = started(lib, seg.fileno(), pages, journal)
                assert pending.wait() == (want == 0, want)
                got = os.fstat(seg.fileno()).st_mtime_ns
                assert (got == stamp) == (not sync) and (sync or got != seg_stamp)
    finally:
        for fd in (r, w, null):
            os.close(fd)


def test_entries_handed_over_after_the_runs_ended_are_left_to_the_caller(
    tmp_path: Path, lib
) -> None:
    """The worker never waits for the journal: once its runs are written it ends, and entries
    handed over later are refused (the caller writes them)."""
    pages = pages_of(2, 4096, 4)
    with open(tmp_path / "seg", "wb+") as seg, open(tmp_path / "jrn", "wb+") as jrn:
        pending, runs = started(lib, seg.fileno(), pages)
        ended(pending)
        assert not pending.journal(jrn.fileno(), 0, b"late", False, seg.fileno(), 1)
        assert pending.wait() == (False, 0)
        assert pending.wait() == (False, 0), "a second wait returns the same"
        assert not pending.journal(jrn.fileno(), 0, b"later", False, seg.fileno(), 1)
        assert runs["err"].tolist() == [0]
        assert os.fstat(seg.fileno()).st_size == 2 * 4096
        assert os.fstat(jrn.fileno()).st_size == 0


def in_a_child(tmp_path: Path, body: str) -> str:
    """Run ``body`` (Python, after ``os``, ``sys``, ``numpy as np``, ``torch``, ``native`` and
    its loaded ``lib``; ``sys.argv[1]`` is ``tmp_path``) in a child within ``WAIT_S``, so that a
    hang fails the test; its output."""
    script = tmp_path / "child.py"
    script.write_text(
        "import os, sys\nimport numpy as np, torch\nfrom kvtier.storage.segments import native\n"
        "lib = native.library()\nassert lib is not None\n" + textwrap.dedent(body)
    )
    out = subprocess.run(
        [sys.executable, str(script), str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        env=child_env(),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout


def test_writes_never_ended_hold_no_worker(tmp_path: Path) -> None:
    """More writes than the pool has workers (64), none journaled nor waited for (say, held by
    tracebacks): a later write still ends, with its journal (in a child, so that a hang is a
    failed test)."""
    out = in_a_child(
        tmp_path,
        """
            seg = os.open(sys.argv[1] + "/seg", os.O_RDWR | os.O_CREAT, 0o600)
            jrn = os.open(sys.argv[1] + "/jrn", os.O_RDWR | os.O_CREAT, 0o600)
            page = torch.full((4096,), 7, dtype=torch.uint8)
            addr = np.array([page.data_ptr()], dtype=np.uint64)
            n = np.array([4096], dtype=np.uint64)
            def start():
                return native.write_start(lib, native.make_runs([seg], [0], [0], [1]), addr, n)
            held = [start() for _ in range(100)]
            last = start()
            last.journal(jrn, 0, b"entries", False, seg, 1)
            done, err = last.wait()
            # Taken and written by the worker, or too late and refused: never lost in between.
            assert err == 0 and done == (os.pread(jrn, 16, 0) == b"entries"), (done, err)
            print("ok", lib.kvt_workers())
            """,
    )
    assert out.split()[0] == "ok"


def test_a_child_forked_during_a_write_exits_without_waiting_for_it(tmp_path: Path) -> None:
    """A child forked while a write is in flight on a parent's worker (not in the child) exits
    normally: its exit ends the inherited ``Pending`` (a finalizer), which must not wait for a
    task no thread of the child will run (in a script, so that a hang is a failed test)."""
    out = in_a_child(
        tmp_path,
        """
            fd = os.open(sys.argv[1] + "/seg", os.O_RDWR | os.O_CREAT, 0o600)
            pages = [torch.zeros(1 << 20, dtype=torch.uint8) for _ in range(64)]
            runs = native.make_runs([fd], [0], [0], [64])
            addr = np.array([p.data_ptr() for p in pages], dtype=np.uint64)
            n = np.full(64, 1 << 20, dtype=np.uint64)
            pending = native.write_start(lib, runs, addr, n)  # 64 MiB: still in flight below
            pid = os.fork()
            if pid == 0:
                sys.exit(0)  # a normal exit: the finalizers run, this Pending's included
            _, status = os.waitpid(pid, 0)
            pending.wait()
            print("child", os.waitstatus_to_exitcode(status))
            """,
    )
    assert out.split() == ["child", "0"]


def test_a_journal_the_worker_could_not_write_fails_the_batch_and_the_segment(
    tmp_path: Path, lib, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The worker reports its journal step failed (here: it is handed a bad descriptor, before
    it starts, so that it takes the entries): the batch's pages are not stored, their segment
    takes no more, and the next batch stores and serves its pages (also to a fresh reader)."""
    monkeypatch.setattr(native, "write_start", deferred(lambda j: (-1, *j[1:])))
    root = tmp_path / "l3"
    b = create_backend("file", root=root)
    pages = pages_of(8, 64 << 10, 5)
    assert b.set([PoolTransfer("kv", H[:8], pages)]).ok["kv"] == [False] * 8
    monkeypatch.undo()
    assert b.set([PoolTransfer("kv", H[8:16], pages)]).all_ok
    names = sorted(p.name for p in root.glob("*.kvs"))
    # The failed segment took no more records, and holding none journaled it was dropped.
    assert len(names) == 1 and names[0].endswith("-00000002.kvs"), names
    assert_only_the_later_batch_served(b, root, H, pages)


class _InterruptedAfterHandOver(Exception):
    pass


@pytest.mark.parametrize("where", ["after the hand-over", "in the wait"])
def test_entries_the_worker_wrote_before_the_put_failed_stay_the_journals(
    tmp_path: Path, lib, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """An interrupt after the entries were handed over and written (right after the hand-over,
    or as the wait returns: a signal that came while it blocked): the batch is reported failed,
    and the next batch's entries go after the written ones, so a reader that already read them
    still finds the next batch (they were overwritten, and such a reader never saw the
    acknowledged batch: found in review)."""

    def failing(*args, journal=None):
        pending = deferred(lambda j: j)(*args)
        taken, waited, raised = pending.journal, pending.wait, []

        def journal_then_fail(*j):
            taken(*j)
            if where == "after the hand-over":
                raise _InterruptedAfterHandOver

        def wait_then_fail():
            got = waited()
            if where == "in the wait" and not raised:
                raised.append(True)
                raise _InterruptedAfterHandOver
            return got

        pending.journal, pending.wait = journal_then_fail, wait_then_fail
        return pending

    root = tmp_path / "l3"
    b = create_backend("file", root=root)
    reader = create_backend("file", root=root, list_interval_s=0)
    pages = pages_of(8, 64 << 10, 9)
    monkeypatch.setattr(native, "write_start", failing)
    assert b.set([PoolTransfer("kv", H[:8], pages)]).ok["kv"] == [False] * 8
    monkeypatch.setattr(native, "write_start", _START)
    out = [torch.full((64 << 10,), 0xEE, dtype=torch.uint8) for _ in range(8)]
    first = reader.get([PoolTransfer("kv", H[:8], out)]).ok["kv"]
    assert first == [True] * 8, "the written entries describe whole, checked records"
    assert all(torch.equal(o, p) for o, p in zip(out, pages))
    assert b.set([PoolTransfer("kv", H[8:16], pages)]).all_ok
    for store in (reader, b, create_backend("file", root=root)):
        assert store.get([PoolTransfer("kv", H[8:16], out)]).all_ok
        assert all(torch.equal(o, p) for o, p in zip(out, pages))


def test_entries_made_after_the_runs_ended_are_written_by_the_caller(
    tmp_path: Path, lib, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store hands the entries over after its worker has ended (a caller slower than its
    write): they are refused, the store writes them itself, and a fresh reader serves the batch."""
    taken = native.Pending.journal
    refused = []

    def after_the_end(self, *j):
        ended(self)
        refused.append(not taken(self, *j))
        return False

    monkeypatch.setattr(native.Pending, "journal", after_the_end)
    root = tmp_path / "l3"
    b = create_backend("file", root=root)
    pages = pages_of(8, 64 << 10, 10)
    assert b.set([PoolTransfer("kv", H[:8], pages)]).all_ok
    assert refused == [True]
    monkeypatch.undo()
    out = [torch.full((64 << 10,), 0xEE, dtype=torch.uint8) for _ in range(8)]
    for store in (b, create_backend("file", root=root)):
        assert store.get([PoolTransfer("kv", H[:8], out)]).all_ok
        assert all(torch.equal(o, p) for o, p in zip(out, pages))


@pytest.mark.parametrize("fsync", [False, True])
def test_a_put_hands_its_worker_the_stores_sync_and_time(
    tmp_path: Path, lib, monkeypatch: pytest.MonkeyPatch, fsync: bool
) -> None:
    """The worker is asked to sync exactly when the store syncs, and stamps the segment with
    the batch's journal time (the shared LRU clock every process reads)."""
    asked = []

    def seen(journal):
        asked.append(journal[3])
        return journal

    monkeypatch.setattr(native, "write_start", deferred(seen))
    b = create_backend("file", root=tmp_path / "l3", fsync=fsync)
    pages = pages_of(4, 64 << 10, 11)
    assert b.set([PoolTransfer("kv", H[:4], pages)]).all_ok
    assert asked == [fsync]
    where = b.locate(b._object_keys(PoolTransfer("kv", H[:1]))[0])
    assert where is not None
    with b._index.mutex:
        when = {loc.time_ns for loc in b._index.entries.values()}
    assert os.stat(where.path).st_mtime_ns in when and len(when) == 1
    b.close()


class _Deferred:
    """A write whose worker starts only when the entries are handed over (then before it
    starts: it always takes them) or when it is waited for: the store's order made certain."""

    def __init__(self, args: tuple, change) -> None:
        self._args, self._change, self._pending = args, change, None

    def journal(self, *journal) -> bool:
        self._pending = _START(*self._args, journal=self._change(journal))
        return True

    def wait(self):
        if self._pending is None:
            self._pending = _START(*self._args)
        return self._pending.wait()


def deferred(change):
    """A ``native.write_start`` whose writes are ``_Deferred`` (their entries changed by
    ``change`` before they go to the worker)."""
    return lambda *args, journal=None: _Deferred(args, change)


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
