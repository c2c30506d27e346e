"""A process that forks with a segment store open: the store is the parent's alone.

The child inherits the store object, its writer names, its active segments and their
descriptors, but not its IO threads. Used there, a put of two write lanes waited forever for
threads that do not exist, and a child appending to the parent's active segment would have
overwritten the parent's records. So in the child the store refuses every call like a closed
store (bounded, with a message saying what to do), closes its copies of the parent's descriptors
without touching the files, and a new backend opened in the child works as in any process.

Each scenario runs in a fresh interpreter (``subprocess``), which forks: no fork of the test
process itself, with its threads.
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

NS = Namespace("segment-fork", "bfloat16", 4, "page_first")
PAGE = 256 << 10  # at least writer.LANE_MIN_RECORD: a batch is split among the two write lanes
H = page_hashes(range(4 * 64), NS)
TIMEOUT_S = 120  # a scenario that takes longer than this hung

PRELUDE = f"""
import os, signal, sys, threading, time, torch
from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes
ROOT = sys.argv[1]
PAGE = {PAGE}
H = page_hashes(range(4 * 64), Namespace("segment-fork", "bfloat16", 4, "page_first"))
def src(h):
    g = torch.Generator().manual_seed(int(h[:15], 16))
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)
def served(b, hashes):
    out = [torch.full((PAGE,), 0xEE, dtype=torch.uint8) for _ in hashes]
    ok = b.get([PoolTransfer("kv", hashes, out)]).ok["kv"]
    assert all(torch.equal(o, src(h)) for o, h, k in zip(out, hashes, ok) if k), "wrong bytes"
    return ok
"""


def expected(h: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(h[:15], 16))
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)


def run(script: str, root: Path, **kwargs) -> subprocess.CompletedProcess:
    code = PRELUDE + textwrap.dedent(script)
    return subprocess.run(
        [sys.executable, "-c", code, str(root)],
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
        cwd=Path(__file__).resolve().parents[2],
        **kwargs,
    )


def test_a_forked_child_refuses_the_parents_store_and_opens_its_own(tmp_path: Path) -> None:
    """Forked while another thread of the parent holds the store's gate: in the child every call
    on the parent's store ends at once (pages failed, other calls ``ValueError`` naming the fork),
    ``close`` there does nothing to the files, a new backend in the child reads the parent's
    pages and stores its own, and the parent's store goes on appending to its active segment."""
    root = tmp_path / "l3"
    script = """
    import warnings
    warnings.simplefilter("ignore", DeprecationWarning)  # fork() of a threaded process
    b = create_backend("file", root=ROOT, io_threads=1, write_lanes=2)
    assert b.set([PoolTransfer("kv", H[:8], [src(h) for h in H[:8]])]).all_ok
    child_pages = [src(h) for h in H[8:16]]  # made before the fork: the child runs no torch op
    parent_pages = [src(h) for h in H[16:24]]
    held, release = threading.Event(), threading.Event()
    def hold():
        with b._gate._cv:  # a call of another thread entering, at the moment of the fork
            held.set()
            release.wait()
    t = threading.Thread(target=hold)
    t.start()
    held.wait()
    pid = os.fork()
    if pid == 0:
        signal.alarm(60)  # a hang here ends the child with SIGALRM, which the parent reports
        try:
            assert not any(b.set([PoolTransfer("kv", H[8:16], child_pages)]).ok["kv"])
            out = [torch.empty(PAGE, dtype=torch.uint8) for _ in range(8)]
            assert not any(b.get([PoolTransfer("kv", H[:8], out)]).ok["kv"])
            assert b.exists([PoolTransfer("kv", H[:8])]) == 0
            try:
                b.object_keys()
                raise AssertionError("object_keys on the parent's store did not raise")
            except ValueError as e:
                assert "forked child" in str(e), e
            b.close()  # nothing to finish here: the parent's segments are the parent's
            mine = create_backend("file", root=ROOT, io_threads=1, write_lanes=2)
            assert mine.exists([PoolTransfer("kv", H[:8])]) == 8
            assert all(served(mine, H[:8])), "the parent's pages, read in the child"
            assert mine.set([PoolTransfer("kv", H[8:16], child_pages)]).all_ok
            mine.close()
        except BaseException as e:
            print("child failed:", repr(e), flush=True)
            os._exit(1)
        os._exit(0)
    release.set()
    t.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, f"child exit {os.waitstatus_to_exitcode(status)}"
    # The parent's active segment is intact and still its own to append to.
    assert b.set([PoolTransfer("kv", H[16:24], parent_pages)]).all_ok
    assert all(served(b, H[:8] + H[16:24]))  # the child's: after a listing (a fresh store below)
    b.close()
    print("ok", flush=True)
    """
    out = run(script, root)
    assert out.returncode == 0 and "ok" in out.stdout, out.stdout + out.stderr
    fresh = create_backend("file", root=root)
    pages = [torch.full((PAGE,), 0xEE, dtype=torch.uint8) for _ in range(24)]
    assert fresh.get([PoolTransfer("kv", H[:24], pages)]).all_ok
    assert all(torch.equal(p, expected(h)) for p, h in zip(pages, H[:24]))
    fresh.close()


def test_a_forked_child_does_not_keep_a_dead_writer_alive(tmp_path: Path) -> None:
    """A writer that forked and was then killed (``kill -9``) is seen gone by the other
    processes while its child still runs: the child closed its copies of the writer's segment
    descriptors, whose shared lock otherwise outlived the writer, so the writer's newest journal
    stays final-less (tailed, its segment never compacted) for as long as the child lives."""
    root = tmp_path / "l3"
    root.mkdir(mode=0o700)
    reader = create_backend("file", root=root, list_interval_s=0)
    script = """
    import warnings
    warnings.simplefilter("ignore", DeprecationWarning)
    w = create_backend("file", root=ROOT, io_threads=0)
    assert w.set([PoolTransfer("kv", H[:3], [src(h) for h in H[:3]])]).all_ok
    pid = os.fork()
    if pid == 0:
        time.sleep(TIMEOUT)  # outlives the writer; the test kills it
        os._exit(0)
    print("stored", pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
    """.replace("TIMEOUT", str(TIMEOUT_S))
    proc = subprocess.Popen(
        [sys.executable, "-c", PRELUDE + textwrap.dedent(script), str(root)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parents[2],
    )
    child = None
    try:
        line = proc.stdout.readline()  # the grandchild keeps the pipe open: read, never drain
        assert line.startswith("stored"), line + proc.stderr.read()
        child = int(line.split()[1])
        assert proc.wait(timeout=TIMEOUT_S) == -signal.SIGKILL
        os.kill(child, 0)  # still alive while the root is looked at
        with reader._index.mutex:
            reader._index.forget_listing_locked()
            reader._index.refresh_locked(tail=True)
            other = [
                s for s in reader._index.segments.values() if s.writer not in reader._index.writers
            ]
            assert other, "the writer's segment is listed"
            assert all(s.jfd is None for s in other), "the dead writer's journal is final"
        pages = [torch.full((PAGE,), 0xEE, dtype=torch.uint8) for _ in range(3)]
        assert reader.get([PoolTransfer("kv", H[:3], pages)]).all_ok
        assert all(torch.equal(p, expected(h)) for p, h in zip(pages, H[:3]))
    finally:
        if child is not None:
            os.kill(child, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        proc.stdout.close()
        proc.stderr.close()
        reader.close()
