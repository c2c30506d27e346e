"""Moving a batch's bytes: whole ``preadv`` / ``pwritev`` calls, and runs shared between threads.

A batch is cut into runs of adjacent records (up to ``RUN_BYTES``); each run is one syscall and
its checksums, done by one thread while the data is still in that core's cache. The caller's
thread and the IO threads take runs from one list until none is left (``run_shared``): syscalls
and XXH3 over more than 64 KiB release the GIL, so two threads move about twice the bytes of one.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

__all__ = ["IOV_MAX", "RUN_BYTES", "pieces", "read_all", "run_shared", "write_all"]

IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 1024
RUN_BYTES = 256 << 10
"""Bytes per run: small enough that a run's checksums read it from the core's L2 cache, large
enough that a syscall's fixed cost stays a few percent."""


def write_all(fd: int, iovecs: list, offset: int) -> None:
    """``pwritev`` every byte of ``iovecs`` at ``offset`` (a short write continues; a full disk
    raises ``OSError``), at most ``IOV_MAX`` parts a call (one page may have more)."""
    total = sum(v.nbytes if isinstance(v, memoryview) else len(v) for v in iovecs)
    done = os.pwritev(fd, iovecs[:IOV_MAX] if len(iovecs) > IOV_MAX else iovecs, offset)
    while done < total:
        n = os.pwritev(fd, remaining(iovecs, done)[:IOV_MAX], offset + done)
        if n == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        done += n


def read_all(fd: int, iovecs: list[memoryview], offset: int, want: int) -> int:
    """``preadv`` into ``iovecs`` from ``offset`` until ``want`` bytes or the end of the file,
    at most ``IOV_MAX`` parts a call; the bytes read."""
    got = os.preadv(fd, iovecs[:IOV_MAX] if len(iovecs) > IOV_MAX else iovecs, offset)
    while 0 < got < want:  # short reads are legal; zero means the file ends here
        more = os.preadv(fd, remaining(iovecs, got)[:IOV_MAX], offset + got)
        if more == 0:
            break
        got += more
    return got


def pieces(parts: list[memoryview], size: int) -> list[list[memoryview]]:
    """``parts`` (one payload) cut into consecutive pieces of ``size`` bytes (the last one
    shorter), each a list of slices of the parts."""
    out: list[list[memoryview]] = []
    piece: list[memoryview] = []
    room = size
    for p in parts:
        while p.nbytes:
            take = p[:room]
            piece.append(take)
            room -= take.nbytes
            p = p[take.nbytes :]
            if room == 0:
                out.append(piece)
                piece, room = [], size
    if piece:
        out.append(piece)
    return out


def remaining(iovecs: list, done: int) -> list:
    """The parts of ``iovecs`` still to move once the first ``done`` bytes have moved."""
    rest = []
    for v in iovecs:
        v = memoryview(v)
        if done >= v.nbytes:
            done -= v.nbytes
        else:
            rest.append(v[done:])
            done = 0
    return rest


def run_shared(
    pool: ThreadPoolExecutor | None, helpers: int, jobs: Sequence[Callable[[], None]]
) -> None:
    """Run every job exactly once, on this thread and up to ``helpers`` threads of ``pool``, each
    taking the next job nobody took; return once every job has finished.

    A helper that has not started when this thread runs out of jobs is cancelled rather than
    waited for (the pool may be busy with another call), so a busy pool never delays a call by
    more than the jobs it actually took. Exceptions from jobs propagate.
    """
    n = len(jobs)
    if n == 0:
        return
    taken = 0
    lock = threading.Lock()

    def drain() -> None:
        nonlocal taken
        while True:
            with lock:
                j = taken
                taken += 1
            if j >= n:
                return
            jobs[j]()

    futures = [pool.submit(drain) for _ in range(min(helpers, n - 1))] if pool is not None else []
    try:
        drain()
    finally:
        for f in futures:
            f.cancel()
        wait(futures)  # no helper may still touch the caller's buffers once this returns
    for f in futures:
        if not f.cancelled():
            f.result()
