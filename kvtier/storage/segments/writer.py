"""Appending records: this process's own segments, one active at a time.

Each process (each backend instance) writes only its own segments, ``<writer>-<n>.kvs`` with the
journal ``<writer>-<n>.kvj`` beside it, where ``<writer>`` is ``<pid>-<8 random hex>``. A batch
is laid out back to back at the end of the active segment and cut into runs (up to
``io.RUN_BYTES``); each run's headers are checksummed and the run written with one ``pwritev``
(record prefixes, page headers and the caller's page buffers as the iovecs) by the caller's
thread or an IO thread, whichever takes it (``io.run_shared``). Then the journal entries of the
records before the first failed run follow with one ``pwrite``; with ``fsync`` both files are
``fdatasync``-ed once per batch. A segment is preallocated when created, truncated to its
records when the writer moves on (or closes), and never written again.

A writer killed at any point leaves records whose journal entry is missing (ignored), torn
(parsing stops there) or present with the record's bytes incomplete or lost (the checksum fails:
a counted miss, dropped from the index); after a power loss the same holds, so a reboot needs no
rule of its own.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from kvtier.storage.page_format import make_header
from kvtier.storage.segments.config import SegmentBackendConfig
from kvtier.storage.segments.format import (
    ENTRY_SIZE,
    RECORD_HEAD,
    Entry,
    encode_entry,
    record_prefix,
)
from kvtier.storage.segments.index import Index, Segment
from kvtier.storage.segments.io import IOV_MAX, RUN_BYTES, run_shared, write_all
from kvtier.storage.segments.root import create_file
from kvtier.storage.segments.space import Space, journal_reserve

__all__ = ["Writer"]

log = logging.getLogger(__name__)


@dataclass
class _Active:
    """The segment this process appends to."""

    seg: Segment
    size: int  # bytes preallocated
    jfd: int
    jcap: int  # journal bytes reserved in the capacity
    end: int = 0
    jend: int = 0
    seq: int = 0
    full: bool = False  # a failed append: move on to a new segment


class Writer:
    """This process's appends; callers hold one lock around ``append`` and ``close`` (appends are
    ordered)."""

    def __init__(
        self,
        config: SegmentBackendConfig,
        segment_bytes: int,
        dirfd: int,
        index: Index,
        space: Space,
        pool: Callable[[], ThreadPoolExecutor | None],
    ) -> None:
        self._config, self._seg_bytes, self._dirfd = config, segment_bytes, dirfd
        self._index, self._space, self._pool = index, space, pool
        self._numbers = 0
        self._active: _Active | None = None

    @property
    def active(self) -> Segment | None:
        return None if self._active is None else self._active.seg

    def append(
        self, keys: list[str], parts: list[list[memoryview]], lengths: list[int], time_ns: int = 0
    ) -> list[bool]:
        """Append one record per key, moving on to new segments as they fill; per record,
        whether it is stored (and indexed). ``time_ns``: the journal time (0: now)."""
        m = len(keys)
        ok = [False] * m
        j = 0
        while j < m:
            act = self._active
            need = RECORD_HEAD + lengths[j]
            if (
                act is None
                or act.full
                or act.end + need > act.size
                or act.jend + ENTRY_SIZE + len(keys[j]) > act.jcap
            ):
                act = self._roll(need)
                if act is None:
                    break  # no room, no lock, or no disk: the rest of the batch fails
            k = self._append_some(act, keys, parts, lengths, j, time_ns or time.time_ns(), ok)
            j = k
        return ok

    def _append_some(
        self,
        act: _Active,
        keys: list[str],
        parts: list[list[memoryview]],
        lengths: list[int],
        j: int,
        now: int,
        ok: list[bool],
    ) -> int:
        """Append records ``j..`` while they fit in ``act``; the first record not taken."""
        m = len(keys)
        entries: list[Entry] = []
        runs: list[tuple[int, int, int]] = []  # (first record, end record, file offset)
        start = pos = act.end
        jbytes, k, first, iovs = 0, j, j, 0
        while k < m:
            size, esize = RECORD_HEAD + lengths[k], ENTRY_SIZE + len(keys[k])
            if k > j and (pos + size > act.size or act.jend + jbytes + esize > act.jcap):
                break
            if k > first and (pos - start >= RUN_BYTES or iovs + 2 + len(parts[k]) > IOV_MAX):
                runs.append((first, k, start))
                first, start, iovs = k, pos, 0
            act.seq += 1
            entries.append(Entry(keys[k], pos, lengths[k], act.seq, now))
            pos, jbytes, k, iovs = pos + size, jbytes + esize, k + 1, iovs + 2 + len(parts[k])
        if k > first:
            runs.append((first, k, start))
        act.end = pos  # never reused, whatever was written
        failed: list[int] = []  # runs whose write failed
        fd, seq0 = act.seg.fd, entries[0].seq - j

        def job(r: int) -> Callable[[], None]:
            lo, hi, offset = runs[r]

            def write_run() -> None:
                iovecs: list = []
                for x in range(lo, hi):
                    iovecs += [record_prefix(seq0 + x), make_header(keys[x], parts[x]), *parts[x]]
                try:
                    write_all(fd, iovecs, offset)
                except OSError as e:
                    log.warning(
                        "segment store %s: append to %s failed: %s",
                        self._space.root,
                        act.seg.stem,
                        e,
                    )
                    failed.append(r)

            return write_run

        run_shared(self._pool(), self._config.io_threads, [job(r) for r in range(len(runs))])
        # Only records before the first failed run are journaled; the segment takes no more.
        stored = runs[min(failed)][0] if failed else k
        if failed:
            act.full = True
        journal = b"".join(encode_entry(e) for e in entries[: stored - j])
        try:
            if journal:
                write_all(act.jfd, [journal], act.jend)  # after the bytes it describes
            if self._config.fsync:
                os.fdatasync(fd)
                os.fdatasync(act.jfd)
            os.utime(fd, ns=(now, now))  # the shared LRU clock
        except OSError as e:
            # The journal may now end in a partial entry, which ends it for readers: this
            # segment takes no more (its records journaled before stay).
            log.warning(
                "segment store %s: journal of %s failed: %s", self._space.root, act.seg.stem, e
            )
            act.full = True
            return k
        act.jend += len(journal)
        with self._index.mutex:
            self._index.insert_locked(
                act.seg, entries[: stored - j], trusted=self._config.verify == "once"
            )
        ok[j:stored] = [True] * (stored - j)
        return k

    # -- segments of this process -----------------------------------------------------------------

    def _roll(self, need: int) -> _Active | None:
        """Finish the active segment and create a new one with room for ``need`` bytes, evicting
        under the root lock while the root would pass its capacity; None if it cannot."""
        if self._active is not None:
            self._finish(self._active)
            self._active = None
        size = max(self._seg_bytes, need)
        jcap = journal_reserve(size)
        cap = self._config.capacity_bytes
        if cap is not None and size + jcap > cap:
            return None
        self._numbers += 1
        stem = f"{self._index.writer}-{self._numbers:08d}"
        mode = self._config.file_mode
        fd = jfd = -1
        try:
            with self._space.lock:
                if cap is not None and not self._space.make_room(size + jcap, cap):
                    return None
                fd = create_file(self._dirfd, stem + ".kvs", mode)
                fcntl.flock(fd, fcntl.LOCK_SH)  # no process deletes it while we write it
                jfd = create_file(self._dirfd, stem + ".kvj", mode)
                size = self._preallocate(fd, size, need, jcap)
        except (OSError, TimeoutError) as e:
            log.warning("segment store %s: cannot start a segment: %s", self._space.root, e)
            for fd_, ext in ((fd, ".kvs"), (jfd, ".kvj")):
                if fd_ >= 0:
                    os.close(fd_)
                    self._space.unlink(stem + ext)
            return None
        seg = Segment(stem, self._index.writer, self._numbers, fd, None)
        with self._index.mutex:
            self._index.add_own_locked(seg)
        self._active = _Active(seg, size, jfd, jcap)
        return self._active

    @staticmethod
    def _preallocate(fd: int, size: int, need: int, jcap: int) -> int:
        """Reserve the segment's blocks now, so a full disk fails here and not in the middle of
        a batch; on a nearly full disk settle for less, down to ``need``, leaving room for the
        journal (``jcap``). The size reserved."""
        while True:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno == errno.ENOSPC and size > need:
                    st = os.fstatvfs(fd)
                    size = max(need, min(size // 4, st.f_bavail * st.f_frsize - 2 * jcap))
                    continue
                if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
            os.ftruncate(fd, size)  # exactly (a failed larger try may have left more)
            return size

    def _finish(self, act: _Active, delete: bool = False) -> None:
        """Stop appending to ``act``: give back its unused space and let it be evicted."""
        seg = act.seg
        try:
            os.close(act.jfd)
            os.ftruncate(seg.fd, act.end)
            t = time.time_ns()
            os.utime(seg.fd, ns=(t, t))
            fcntl.flock(seg.fd, fcntl.LOCK_UN)
        except OSError as e:
            log.warning("segment store %s: cannot finish %s: %s", self._space.root, seg.stem, e)
        with self._index.mutex:
            self._index.finish_own_locked(seg)
        if act.end == 0 or delete:
            # Nothing journaled (never to be served), or clear(): delete it now.
            self._space.unlink(seg.stem + ".kvj")
            self._space.unlink(seg.stem + ".kvs")
            with self._index.mutex:
                self._index.remove_locked(seg)

    def close(self, delete: bool = False) -> None:
        """Finish the active segment (deleting it with ``delete``)."""
        if self._active is not None:
            self._finish(self._active, delete)
            self._active = None
