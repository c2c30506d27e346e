"""A process that forks with a segment store open: the store is the parent's alone.

The child inherits the store object, its writer names, its active segments and their
descriptors, but not its IO threads. Used there, a put of two write lanes waited forever for
threads that do not exist, and a child appending to the parent's active segment would have
overwritten the parent's records. So in the child the store refuses every call like a closed
store (bounded, with a message saying what to do), the child's descriptors into the root are
closed without touching the files or the parent's locks, and a new backend opened in the child
works as in any process.

Each scenario runs in a fresh interpreter (``subprocess``), which forks: no fork of the test
process itself, with its threads. Children run no torch op (a parallel op in a forked child can
hang on its thread pool): their buffers are made before the fork and compared as bytes.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes
from tests.children import child_env

NS = Namespace("segment-fork", "bfloat16", 4, "page_first")
PAGE = 256 << 10  # at least writer.LANE_MIN_RECORD: a batch is split among the two write lanes
H = page_hashes(range(4 * 64), NS)
TIMEOUT_S = 120  # a scenario that takes longer than this hung

PRELUDE = f"""
import fcntl, os, signal, sys, threading, time, warnings
import numpy as np, torch
from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes
from kvtier.storage.segments import writer as writer_module
warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a threaded process
ROOT = sys.argv[1]
PAGE = {PAGE}
H = page_hashes(range(4 * 64), Namespace("segment-fork", "bfloat16", 4, "page_first"))
def src(h):
    g = torch.Generator().manual_seed(int(h[:15], 16))
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)
def root_fds(root=ROOT):
    # This process's descriptors into the root, by what they point at now.
    out = {{}}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{{fd}}")
        except OSError:
            continue
        if target == root or target.startswith(root + "/"):
            out[int(fd)] = os.path.basename(target)
    return out
def child(body):
    # Run body() in a forked child; its exit status: 0 if it returned, 1 if it raised, -14 if
    # it hung (SIGALRM).
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)
        try:
            body()
        except BaseException as e:
            print("child failed:", repr(e), flush=True)
            os._exit(1)
        os._exit(0)
    return pid
def status(pid):
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
"""


def expected(h: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(h[:15], 16))
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)


def run(script: str, root: Path, *args: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(script), str(root), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        env=child_env(),
    )


def fresh_reader_serves(root: Path, hashes: list[str]) -> None:
    fresh = create_backend("file", root=root)
    pages = [torch.full((PAGE,), 0xEE, dtype=torch.uint8) for _ in hashes]
    assert fresh.get([PoolTransfer("kv", hashes, pages)]).all_ok
    assert all(torch.equal(p, expected(h)) for p, h in zip(pages, hashes))
    fresh.close()


def test_a_forked_child_refuses_the_parents_store_and_opens_its_own(tmp_path: Path) -> None:
    """Forked while another thread of the parent holds the store's gate: in the child no
    descriptor into the root is left, every call on the parent's store ends at once (pages
    failed, other calls ``ValueError`` naming the fork), ``close`` there changes nothing, and a
    new backend in the child reads the parent's pages and stores its own. The parent keeps its
    active segments as they were (its writer locks held, nothing truncated) and appends on."""
    root = tmp_path / "l3"
    script = """
    b = create_backend("file", root=ROOT, io_threads=1, write_lanes=2)
    assert b.set([PoolTransfer("kv", H[:8], [src(h) for h in H[:8]])]).all_ok
    active = [lane.active.stem for lane in b._writer._lanes if lane.active is not None]
    assert len(active) == 2, active
    sizes = {s: os.path.getsize(f"{ROOT}/{s}.kvs") for s in active}
    child_pages = [src(h) for h in H[8:16]]
    parent_pages = [src(h) for h in H[16:24]]
    want = [src(h).numpy().tobytes() for h in H[:8]]
    out = [torch.empty(PAGE, dtype=torch.uint8) for _ in range(8)]
    held, release = threading.Event(), threading.Event()
    def hold():
        with b._gate._cv:  # a call of another thread entering, at the moment of the fork
            held.set()
            release.wait()
    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    def body():
        assert root_fds() == {}, f"descriptors into the root left: {root_fds()}"
        assert not any(b.set([PoolTransfer("kv", H[8:16], child_pages)]).ok["kv"])
        assert not any(b.get([PoolTransfer("kv", H[:8], out)]).ok["kv"])
        assert b.exists([PoolTransfer("kv", H[:8])]) == 0
        try:
            b.object_keys()
            raise AssertionError("object_keys on the parent's store did not raise")
        except ValueError as e:
            assert "forked child" in str(e), e
        b.close()  # nothing to finish here: the parent's segments are the parent's
        mine = create_backend("file", root=ROOT, io_threads=1, write_lanes=2)
        assert mine.get([PoolTransfer("kv", H[:8], out)]).all_ok
        assert [o.numpy().tobytes() for o in out] == want, "the parent's pages, read here"
        assert mine.set([PoolTransfer("kv", H[8:16], child_pages)]).all_ok
        mine.close()
    pid = child(body)
    release.set()
    t.join()
    assert status(pid) == 0, "the child failed"
    for s in active:  # still the parent's: locked, and as long as they were
        fd = os.open(f"{ROOT}/{s}.kvs", os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            raise AssertionError(f"{s}: the parent's writer lock is gone")
        except BlockingIOError:
            pass
        finally:
            os.close(fd)
        assert os.path.getsize(f"{ROOT}/{s}.kvs") == sizes[s], f"{s} changed size"
    assert b.set([PoolTransfer("kv", H[16:24], parent_pages)]).all_ok
    assert [lane.active.stem for lane in b._writer._lanes] == active, "appended where it was"
    b.close()
    print("ok", flush=True)
    """
    out = run(script, root)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr
    fresh_reader_serves(root, H[:24])


def test_a_fork_while_a_segment_is_made_leaves_no_lock_behind(tmp_path: Path) -> None:
    """Forked while another thread creates a segment (its descriptors and writer lock exist
    before the store records them), and the writer then killed (``kill -9``) while the forked
    child lives on: the child kept no descriptor into the root, so the other processes see the
    writer gone (its newest journal final) and ``clear`` deletes all of its files."""
    root = tmp_path / "l3"
    root.mkdir(mode=0o700)
    observer = create_backend("file", root=root, list_interval_s=0)
    script = """
    w = create_backend("file", root=ROOT, io_threads=0)
    in_roll, go = threading.Event(), threading.Event()
    preallocate = writer_module.Lane._preallocate
    def slow(fd, size, need, jcap):  # holds open a window that is there anyway
        in_roll.set()
        go.wait()
        return preallocate(fd, size, need, jcap)
    writer_module.Lane._preallocate = staticmethod(slow)
    pages = [src(h) for h in H[:3]]
    t = threading.Thread(target=lambda: w.set([PoolTransfer("kv", H[:3], pages)]))
    t.start()
    in_roll.wait()
    r, wr = os.pipe()
    def body():
        os.write(wr, repr(root_fds()).encode() + b"\\n")
        time.sleep(TIMEOUT)  # outlives the writer; the test kills it
    pid = child(body)
    go.set()
    t.join()
    print("left", os.read(r, 4096).decode().strip(), flush=True)
    print("child", pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """.replace("TIMEOUT", str(TIMEOUT_S))
    proc = subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(script), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=child_env(),
    )
    child = None
    try:
        left = proc.stdout.readline()  # the child keeps the pipe open: read lines, never drain
        line = proc.stdout.readline()
        assert line.startswith("child"), left + line + proc.stderr.read()
        child = int(line.split()[1])
        assert left.strip() == "left {}", f"the forked child kept descriptors: {left}"
        assert proc.wait(timeout=TIMEOUT_S) == -signal.SIGKILL
        os.kill(child, 0)  # still alive while the root is looked at
        with observer._index.mutex:
            observer._index.forget_listing_locked()
            observer._index.refresh_locked(tail=True)
            segments = list(observer._index.segments.values())
            assert segments, "the writer's segment is listed"
            assert all(s.jfd is None for s in segments), "the dead writer's journal is final"
        observer.clear()
        assert sorted(os.listdir(root)) == ["lock"], "a dead writer's files are all deletable"
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        observer.close()


def test_a_fork_never_closes_a_descriptor_that_is_not_the_stores(tmp_path: Path) -> None:
    """A writer thread closed a journal and has not yet forgotten its number when the forking
    thread opens a file of its own, which gets that number: in the child that file stays open
    (the child closes what points into the root now, not numbers the store recorded)."""
    root = tmp_path / "l3"
    other = tmp_path / "other.txt"
    script = """
    b = create_backend("file", root=ROOT, io_threads=0, segment_bytes=1 << 20)
    pages = [src(h) for h in H[:8]]
    assert b.set([PoolTransfer("kv", H[:4], pages[:4])]).all_ok  # fills the first segment
    stale = b._writer._lanes[0]._active.jfd
    closed, go = threading.Event(), threading.Event()
    ftruncate = os.ftruncate
    def paused(fd, n):  # in Lane._finish, just after the journal's descriptor was closed
        if threading.current_thread() is not threading.main_thread():
            closed.set()
            go.wait()
        return ftruncate(fd, n)
    os.ftruncate = paused
    t = threading.Thread(target=lambda: b.set([PoolTransfer("kv", H[4:8], pages[4:8])]))
    t.start()  # rolls to a new segment
    closed.wait()
    fd = os.open(sys.argv[2], os.O_WRONLY | os.O_CREAT, 0o600)
    mine = stale
    if fd != stale:  # the lowest free number may be another: reuse the journal's on purpose
        os.dup2(fd, stale)
        os.close(fd)
    def body():
        assert os.readlink(f"/proc/self/fd/{mine}") == sys.argv[2], "the child's own file"
        os.write(mine, b"still open")
    pid = child(body)
    go.set()
    t.join()
    assert status(pid) == 0, "the child lost a descriptor that was not the store's"
    os.ftruncate = ftruncate
    b.close()
    print("ok", flush=True)
    """
    out = run(script, root, other)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr
    assert other.read_bytes() == b"still open"


def test_a_fork_keeps_the_users_files_and_finds_a_renamed_root(tmp_path: Path) -> None:
    """The user's own file in the root (a log, say) stays open in the child, while the store's
    descriptors are closed there even after the root was renamed (the store works through its
    directory's descriptor, so a rename does not stop it)."""
    root = tmp_path / "l3"
    moved = tmp_path / "l3-moved"
    script = """
    b = create_backend("file", root=ROOT, io_threads=0)
    assert b.set([PoolTransfer("kv", H[:3], [src(h) for h in H[:3]])]).all_ok
    log = os.open(f"{ROOT}/app.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    os.rename(ROOT, sys.argv[2])
    def body():
        left = root_fds(sys.argv[2])
        assert left == {log: "app.log"}, f"left open: {left}"
        os.write(log, b"child")
    pid = child(body)
    assert status(pid) == 0, "the child failed"
    assert b.set([PoolTransfer("kv", H[3:6], [src(h) for h in H[3:6]])]).all_ok
    b.close()
    print("ok", flush=True)
    """
    out = run(script, root, moved)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr
    assert (moved / "app.log").read_bytes() == b"child"
    fresh_reader_serves(moved, H[:6])
