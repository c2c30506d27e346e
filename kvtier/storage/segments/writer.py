"""Appending records: this process's own segments, one active at a time per write lane.

Each process (each backend instance) writes only its own segments, ``<writer>-<n>.kvs`` with the
journal ``<writer>-<n>.kvj`` beside it, where ``<writer>`` is ``<pid>-<8 random hex>``, one writer
name per write lane (``Lane``; ``Writer`` splits a batch among the lanes). A lane's share is
laid out back to back at the end of its active segment and cut into runs (up to ``io.RUN_BYTES``);
each run is written with one ``pwritev`` of the caller's page buffers (pages adjacent in memory
as one iovec) and every record checksummed. In the C loops (``native``) with IO threads and one
lane, one of the library's worker threads writes every run while the caller hashes the records
and makes the share's journal entries and index records, then waits for the write; the worker
writes the entries right after the runs (then stamps the segment) if they all succeeded and the
entries were handed over before the runs ended, else the caller writes them. Otherwise one C
call hashes and writes: a helper hashes while the caller writes, or, on one thread (each lane
of several, or every batch with ``io_threads=0``), the caller hashes each run just before its
write (just after it with ``io_threads=0``), a record larger than a run in pieces of a run's
size, as the Python loops do. The C loops take pages of
several parts (a page_first KV page's K and V ranges, hashed as one stream) where the binding
has the streaming XXH3 calls (``native.takes``). Else, in the Python loops, each run is hashed
(``PageViews.checksums``, which brings it into the core's cache) and written by the caller's
thread or an IO thread, whichever takes it (``io.run_shared``), a record larger than a run in
pieces of a run's size. Then the journal entries of the records before the first failed run
(entries made beforehand are cut to them), packed for the whole batch at once
(``encode_entries``), follow with one ``pwrite`` (the worker's, or the caller's); with ``fsync``
both files are ``fdatasync``-ed once per batch. Records of one size (a batch's usually are) are
laid out in closed form (``layout``). A segment is preallocated when created, truncated to its
records when the writer moves on (or closes, or, idle, gives its room back to another writer
that asked for it: ``Writer.give_back``), and never written again.

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
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass

import numpy as np

from kvtier.storage.base import MAX_KEY_LENGTH
from kvtier.storage.page_format import (
    XXH3,
    PageViews,
    Xxh3Stream,
    payload_checksum,
    xxh3_stream,
)
from kvtier.storage.segments import native
from kvtier.storage.segments.config import SegmentBackendConfig
from kvtier.storage.segments.format import (
    ENTRY_SIZE,
    Entry,
    encode_entries,
    encode_entry,
)
from kvtier.storage.segments.index import Index, Segment
from kvtier.storage.segments.io import IOV_MAX, RUN_BYTES, pieces, run_shared, write_all
from kvtier.storage.segments.root import create_file
from kvtier.storage.segments.space import Space, journal_reserve

__all__ = ["Lane", "Writer", "layout"]

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
    seq: int = 0  # entries journaled: the next one's sequence number
    full: bool = False  # a failed append: move on to a new segment


def _write_large(fd: int, offset: int, parts: list[memoryview], stream: Xxh3Stream) -> int:
    """Write one record of more than ``RUN_BYTES`` at ``offset`` in pieces of ``RUN_BYTES``,
    each hashed just before it is written (so the write copies it from this core's cache, not
    from memory a second time); its XXH3-64."""
    pos = offset
    for piece in pieces(parts, RUN_BYTES):
        for v in piece:
            stream.update(v)
        write_all(fd, piece, pos)
        pos += sum(v.nbytes for v in piece)
    return stream.digest()


Run = tuple[int, int, int]  # (first record, end record, file offset)


def layout(
    pos: int,
    size: int,
    journal_room: int,
    keys: Sequence[str],
    lengths: Sequence[int],
    counts: Sequence[int],
    j: int,
    uniform: bool,
) -> tuple[int, list[int], list[Run], int]:
    """Where records ``j..`` go in a segment of ``size`` bytes written up to ``pos`` whose
    journal has ``journal_room`` bytes left: (the first record that does not fit, each taken
    record's offset, the runs, the end of the last record). Record ``j`` is always taken (the
    caller made room for it). A run ends before ``RUN_BYTES`` are passed, before ``IOV_MAX``
    parts, and around a record larger than ``RUN_BYTES``. ``uniform``: every record has one
    length, part count and key length, so the layout has a closed form (per run, not per
    record)."""
    m = len(keys)
    if uniform:
        rsize, esize, count = lengths[j], ENTRY_SIZE + len(keys[j]), counts[j]
        room = journal_room // esize
        if rsize:
            room = min(room, (size - pos) // rsize)
        k = min(m, j + max(1, room))
        per = max(1, min(-(-RUN_BYTES // rsize) if rsize else m, IOV_MAX // count))
        offsets = list(range(pos, pos + (k - j) * rsize, rsize)) if rsize else [pos] * (k - j)
        runs = [(x, min(x + per, k), pos + (x - j) * rsize) for x in range(j, k, per)]
        return k, offsets, runs, pos + (k - j) * rsize
    offsets, runs = [], []
    start = pos
    jbytes, k, first, iovs = 0, j, j, 0
    while k < m:
        rsize, esize = lengths[k], ENTRY_SIZE + len(keys[k])
        if k > j and (pos + rsize > size or jbytes + esize > journal_room):
            break
        if k > first and (
            pos - start >= RUN_BYTES
            or rsize > RUN_BYTES  # a large record is a run of its own
            or iovs + counts[k] > IOV_MAX
        ):
            runs.append((first, k, start))
            first, start, iovs = k, pos, 0
        offsets.append(pos)
        pos, jbytes, k, iovs = pos + rsize, jbytes + esize, k + 1, iovs + counts[k]
    if k > first:
        runs.append((first, k, start))
    return k, offsets, runs, pos


class Lane:
    """One write lane: appends to one active segment at a time, named after its own writer name
    ``<pid>-<8 hex>``; ``Writer`` runs its lanes' appends in parallel, each lane on one thread.

    ``roll_lock`` is shared by a process's lanes: the root lock is an ``flock`` of one descriptor,
    which does not exclude this process's other threads."""

    def __init__(
        self,
        config: SegmentBackendConfig,
        segment_bytes: int,
        dirfd: int,
        index: Index,
        space: Space,
        pool: Callable[[], ThreadPoolExecutor | None],
        name: str,
        roll_lock: threading.Lock,
    ) -> None:
        self._config, self._seg_bytes, self._dirfd = config, segment_bytes, dirfd
        self._index, self._space, self._pool = index, space, pool
        self._name, self._roll_lock = name, roll_lock
        self._numbers = 0
        self._active: _Active | None = None
        self._last_append = time.monotonic()
        self._gave_back = -GIVE_BACK_EVERY_S  # when it last gave its room back (monotonic)
        self.native = config.native  # the C loops where they are built (native.available())

    @property
    def active(self) -> Segment | None:
        return None if self._active is None else self._active.seg

    def append(
        self,
        keys: list[str],
        parts: Sequence[list[memoryview]],
        lengths: list[int],
        time_ns: int = 0,
        helpers: int = 0,
    ) -> list[bool]:
        """Append one record per key, moving on to new segments as they fill; per record,
        whether it is stored (and indexed). ``parts[i]``: record i's payload buffers (a list, or
        a ``PageViews``, which makes them in the IO thread that writes the record); ``time_ns``:
        the journal time (0: now); ``helpers``: IO threads that share its runs."""
        counts = parts.counts() if isinstance(parts, PageViews) else [len(p) for p in parts]
        floor: list[int] = []  # past every known record of ``keys``, found at first need

        def stamp() -> int:
            """The journal time of the records appended next."""
            if time_ns:
                return time_ns
            if not floor:
                floor.append(self._after_known(keys))
            return max(time.time_ns(), floor[0])

        m = len(keys)
        ok = [False] * m
        j = 0
        uniform = len(set(lengths)) == 1 and len(set(counts)) == 1 and len(set(map(len, keys))) == 1
        while j < m:
            act = self._active
            need = lengths[j]
            if (
                act is None
                or act.full
                or act.end + need > act.size
                or act.jend + ENTRY_SIZE + len(keys[j]) > act.jcap
            ):
                act = self._roll(need)
                if act is None:
                    break  # no room, no lock, or no disk: the rest of the batch fails
            k = self._append_some(act, keys, parts, lengths, counts, j, stamp, ok, uniform, helpers)
            j = k
        self._last_append = time.monotonic()
        return ok

    def give_back(self, idle_s: float) -> int | None:
        """Finish the active segment if no append ran for ``idle_s`` seconds, giving back its
        preallocated room (the next append starts a new segment, as room allows); the bytes
        given back (0 with no active segment, or one given back within ``GIVE_BACK_EVERY_S``),
        or None where the lane appended since."""
        act = self._active
        now = time.monotonic()
        if act is None or now - self._gave_back < GIVE_BACK_EVERY_S:
            return 0
        if now - self._last_append < idle_s:
            return None
        self._active, self._gave_back = None, now
        self._finish(act)
        return act.size - act.end

    def _append_some(
        self,
        act: _Active,
        keys: list[str],
        parts: Sequence[list[memoryview]],
        lengths: list[int],
        counts: Sequence[int],
        j: int,
        stamp: Callable[[], int],
        ok: list[bool],
        uniform: bool,
        helpers: int,
    ) -> int:
        """Append records ``j..`` while they fit in ``act``; the first record not taken.
        ``stamp()``: their journal time (asked once the write has started, where it starts
        early); ``uniform``: every record has one length, part count and key length;
        ``helpers``: IO threads that share its runs."""
        k, offsets, runs, pos = layout(
            act.end, act.size, act.jcap - act.jend, keys, lengths, counts, j, uniform
        )
        act.end = pos  # never reused, whatever was written
        fd = act.seg.fd
        failed: list[int] = []  # runs whose write failed
        sums: list[tuple[int, int]] = [(0, 0)] * (k - j)  # (algorithm, checksum) per record
        views = parts if isinstance(parts, PageViews) else None

        def job(r: int) -> Callable[[], None]:
            lo, hi, offset = runs[r]

            def write_run() -> None:
                try:
                    stream = None
                    if hi - lo == 1 and lengths[lo] > RUN_BYTES:
                        payload = parts[lo]
                        stream = xxh3_stream(payload)
                    if stream is not None:
                        sums[lo - j] = (XXH3, _write_large(fd, offset, payload, stream))
                    elif views is not None:
                        sums[lo - j : hi - j] = views.checksums(range(lo, hi))  # into the cache
                        write_all(fd, views.iovecs(range(lo, hi)), offset)
                    else:
                        iovecs: list[memoryview] = []
                        for x in range(lo, hi):
                            payload = parts[x]
                            sums[x - j] = payload_checksum(payload)
                            iovecs += payload
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

        lib = native.library() if self.native and views is not None else None
        if lib is not None and not native.takes(lib, views):
            lib = None  # pages of several parts, and no streaming XXH3 to hash them in C
        trusted = self._config.verify == "once"
        journal = b""
        journaled, journal_err = False, 0  # whether the write's worker wrote the journal
        advanced = False  # act.jend and act.seq already count the entries the worker wrote
        seq = act.seq  # the sequence number of this share's first entry
        locs: list | None = None
        if lib is not None:  # the same runs, hashes and writes in the C loops
            table = native.make_runs(
                [fd] * len(runs),
                [offset for _, _, offset in runs],
                [lo - j for lo, _, _ in runs],
                [hi - lo for lo, hi, _ in runs],
            )
            size = np.asarray(lengths[j:k], dtype=np.uint64)
            addr = native.buffers(views, range(j, k))  # type: ignore[arg-type]
            # With a helper: a C worker writes every run (one writer a file) while this one
            # hashes, then makes the journal entries (the worker writes them after the runs if
            # they come in time) and index records of the whole share, which are used as they
            # are unless a run fails. Without a worker (none could be started), one call: a
            # helper hashes while this thread writes (native_io.c).
            pending = native.write_start(lib, table, addr, size) if helpers else None
            if pending is None:
                after = self._config.io_threads == 0  # one thread: see SegmentBackendConfig
                got = native.write(lib, table, addr, size, helpers + 1, RUN_BYTES, after)
                got = got.tolist()
                now = stamp()
            else:
                try:
                    now = stamp()  # under the write
                    hashed = native.hash_records(lib, addr, size)
                    got = hashed.tolist()
                    xxh3 = [XXH3] * (k - j)
                    journal = native.encode_entries(  # the arrays as they are, no copies
                        lib, keys[j:k], offsets, size, now, xxh3, hashed
                    )
                    locs = self._index.new_locs(
                        act.seg, offsets, lengths[j:k], seq, now, xxh3, got, trusted
                    )
                    # Last: once handed over, the worker writes the entries after the runs if
                    # they all succeed (and it has not ended: else they are written below).
                    pending.journal(act.jfd, act.jend, journal, self._config.fsync, fd, now)
                    journaled, journal_err = pending.wait()  # the buffers are the caller's again
                    if journaled:  # at once: the next entries go after these, come what may
                        act.jend, act.seq, advanced = act.jend + len(journal), act.seq + k - j, True
                except BaseException:
                    # The buffers are the caller's again only after the wait (a second wait
                    # returns the first's answer). Entries the worker wrote (an interrupt after
                    # the hand-over, in the wait say) stay the journal's: the next ones go after
                    # them. Their records are whole and checked, so other processes may serve
                    # them; this one reports the batch failed.
                    journaled, journal_err = pending.wait()
                    if journaled and not advanced:
                        act.jend += len(journal)
                        act.seq += k - j
                    elif journal_err:
                        act.full = True  # its journal may end in a partial entry
                    raise
            for r in np.flatnonzero(table["err"]).tolist() if table["err"].any() else ():
                log.warning(
                    "segment store %s: append to %s failed: %s",
                    self._space.root,
                    act.seg.stem,
                    os.strerror(int(table["err"][r])),
                )
                failed.append(r)
        else:
            jobs = [job(r) for r in range(len(runs))]
            run_shared(self._pool() if helpers else None, helpers, jobs)
            now = stamp()
        # Only records before the first failed run are journaled; the segment takes no more.
        # Their entries are packed here for the whole batch at once.
        last = min(failed) if failed else len(runs)
        stored = runs[last][0] if failed else k
        if failed:
            act.full = True
        n = stored - j
        if lib is not None:
            algorithms, checksums = [XXH3] * n, got[:n]
            if n < k - j or not journal:  # made for every record, or not made
                journal = native.encode_entries(
                    lib, keys[j:stored], offsets[:n], lengths[j:stored], now, algorithms, checksums
                )
                locs = None
        else:
            algorithms, checksums = zip(*sums[:n]) if n else ((), ())  # type: ignore[assignment]
            journal = encode_entries(
                keys[j:stored], offsets[:n], lengths[j:stored], now, algorithms, checksums
            )
        try:
            if journal_err:  # the worker's journal step (below, as the worker does it) failed
                raise OSError(journal_err, os.strerror(journal_err))
            if not journaled:
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
        if not advanced:
            act.jend += len(journal)
        with self._index.mutex:
            self._index.insert_new_locked(
                act.seg,
                keys[j:stored],
                offsets[:n],
                lengths[j:stored],
                seq,
                now,
                algorithms,
                checksums,
                trusted=trusted,
                locs=locs,
            )
        if not advanced:
            act.seq += n
        ok[j:stored] = [True] * n
        return k

    def _after_known(self, keys: list[str]) -> int:
        """A time past every record and tombstone this process knows of ``keys``: a new one
        must win over them, and time stamps decide (a clock stepped back, by NTP say, made an
        acknowledged delete lose to the record it deleted, and an acknowledged set to an older
        tombstone; found in a user trial)."""
        index, newest = self._index, 0
        with index.mutex:
            entries, tombs = index.entries, index.tombs
            for key in keys:
                loc = entries.get(key)
                if loc is not None and loc.time_ns > newest:
                    newest = loc.time_ns
                tomb = tombs.get(key)
                if tomb is not None and tomb[0] > newest:
                    newest = tomb[0]
        return newest + 1

    def tombstone(self, keys: list[str], times: Sequence[int] | None = None) -> list[bool]:
        """Journal a tombstone for each key in the active segment (moving on to new segments as
        journals fill), so that every process's index drops the key's older records; per key
        whether its tombstone is journaled (and indexed here). ``times``: each tombstone's time
        (compaction carries a tombstone on with its own time); default now."""
        ok = [False] * len(keys)
        j, now = 0, max(time.time_ns(), self._after_known(keys))
        while j < len(keys):
            act = self._active
            if act is None or act.full or act.jend + ENTRY_SIZE + len(keys[j]) > act.jcap:
                act = self._roll(0, tombstones=len(keys) - j)
                if act is None:
                    break
            entries: list[Entry] = []
            jbytes, k = 0, j
            while k < len(keys) and act.jend + jbytes + ENTRY_SIZE + len(keys[k]) <= act.jcap:
                when = now if times is None else times[k]
                entries.append(Entry(keys[k], 0, 0, act.seq + k - j, when, deleted=True))
                jbytes += ENTRY_SIZE + len(keys[k])
                k += 1
            journal = b"".join(map(encode_entry, entries))
            try:
                write_all(act.jfd, [journal], act.jend)
                if self._config.fsync:
                    os.fdatasync(act.jfd)
            except OSError as e:
                log.warning(
                    "segment store %s: tombstones in %s failed: %s",
                    self._space.root,
                    act.seg.stem,
                    e,
                )
                act.full = True  # its journal may end in a partial entry now
                continue
            act.jend += len(journal)
            act.seq += len(entries)
            with self._index.mutex:
                self._index.insert_locked(act.seg, entries)
            ok[j:k] = [True] * (k - j)
            j = k
        self._last_append = time.monotonic()  # tombstones are appends too
        return ok

    # -- segments of this process -----------------------------------------------------------------

    def _roll(self, need: int, tombstones: int = 0) -> _Active | None:
        """Finish the active segment and create a new one with room for ``need`` bytes, evicting
        under the root lock while the root would pass its capacity; None if it cannot.

        ``tombstones``: a segment of journal only, for that many tombstones (up to a segment's
        usual journal): a delete preallocates no data, so it makes room for a few hundred bytes
        and evicts nothing a whole data segment would (the next append rolls a data segment)."""
        if self._active is not None:
            self._finish(self._active)
            self._active = None
        if tombstones:
            size = 0
            jcap = min(
                journal_reserve(self._seg_bytes),
                max(journal_reserve(0), tombstones * (ENTRY_SIZE + MAX_KEY_LENGTH)),
            )
        else:
            size = max(self._seg_bytes, need)
            jcap = journal_reserve(size)
        cap = self._config.capacity_bytes
        if cap is not None and size + jcap > cap:
            return None
        self._numbers += 1
        stem = f"{self._name}-{self._numbers:08d}"
        mode = self._config.file_mode
        fd = jfd = -1
        try:
            with self._roll_lock, self._space.lock:
                self._space.lock.room_started()
                if cap is not None:
                    # Room for a whole segment, else (other writers' active segments hold the
                    # rest: many writers on one capped root) a smaller one, in half of what
                    # they leave (so another writer can start too), at least the next record.
                    least = need + journal_reserve(need) if size else jcap  # jcap: tombstones
                    granted = self._space.make_room(size + jcap, cap, least)
                    if granted < size + jcap:
                        # Other writers' active segments crowd the root: ask their processes
                        # to give back the preallocated room of the idle ones.
                        self._space.lock.ask_for_room()
                    if not granted:
                        return None
                    if granted < size + jcap:  # its journal's reservation inside the grant
                        size = max(need, granted - journal_reserve(granted))
                        jcap = journal_reserve(size)
                fd = create_file(self._dirfd, stem + ".kvs", mode)
                fcntl.flock(fd, fcntl.LOCK_SH)  # no process deletes it while we write it
                jfd = create_file(self._dirfd, stem + ".kvj", mode)
                try:
                    size = self._preallocate(fd, size, need, jcap)
                except OSError as e:
                    # The disk is full (other files, or a capacity above the disk): the root's
                    # least recently used segments go for the room, then one more try. Without
                    # it every later write failed until an operator freed space (a user trial).
                    if e.errno != errno.ENOSPC or not self._space.make_room(need + jcap, None):
                        raise
                    size = self._preallocate(fd, size, need, jcap)
        except (OSError, TimeoutError) as e:
            log.warning("segment store %s: cannot start a segment: %s", self._space.root, e)
            for fd_, ext in ((fd, ".kvs"), (jfd, ".kvj")):
                if fd_ >= 0:
                    os.close(fd_)
                    self._space.unlink(stem + ext)
            return None
        seg = Segment(stem, self._name, self._numbers, fd, None)
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
        if act.jend == 0 or delete:
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


class Writer:
    """This process's appends, through ``lanes`` write lanes (segments appended to at once):
    a batch of at least two runs' bytes is cut into one contiguous share per lane, by bytes, and
    each lane appends its share on its own thread (the caller's, or one of ``pool``'s). Buffered
    writes into one file take its inode lock, so two threads writing one segment copy one after
    the other; two segments take the kernel's copies in parallel. Callers hold one lock around
    ``append``, ``tombstone`` and ``close`` (appends are ordered); a key appears at most once per
    ``append``, so which lane holds it does not matter."""

    def __init__(
        self,
        config: SegmentBackendConfig,
        segment_bytes: int,
        dirfd: int,
        index: Index,
        space: Space,
        pool: Callable[[], ThreadPoolExecutor | None],
        names: Sequence[str],
    ) -> None:
        roll = threading.Lock()
        cap = config.capacity_bytes
        per = segment_bytes + journal_reserve(segment_bytes)
        if cap is not None and len(names) * per > cap // 4:
            # Each lane holds a preallocated active segment: under a capacity that several of
            # them would crowd (and that other processes share), one lane.
            names = names[:1]
        self._lanes = [
            Lane(config, segment_bytes, dirfd, index, space, pool, name, roll) for name in names
        ]
        self._pool, self._helpers = pool, config.io_threads
        self._space = space

    def append(
        self,
        keys: list[str],
        parts: Sequence[list[memoryview]],
        lengths: list[int],
        time_ns: int = 0,
    ) -> list[bool]:
        """``Lane.append`` over the lanes: per record, whether it is stored (and indexed)."""
        bounds = _shares(lengths, len(self._lanes))
        if len(bounds) == 2:  # one lane: its runs shared with the IO threads
            return self._lanes[0].append(keys, parts, lengths, time_ns, self._helpers)
        # One time for every lane, after what the store knows of the keys (Lane.append's rule).
        now = time_ns or max(time.time_ns(), self._lanes[0]._after_known(keys))
        views = parts if isinstance(parts, PageViews) else None
        pool = self._pool()
        assert pool is not None  # lanes > 1 needs IO threads (the config checks it)

        def share(n: int) -> list[bool]:
            lo, hi = bounds[n], bounds[n + 1]
            some = views.subset(range(lo, hi)) if views is not None else parts[lo:hi]
            return self._lanes[n].append(keys[lo:hi], some, lengths[lo:hi], now)

        futures = [pool.submit(share, n) for n in range(1, len(bounds) - 1)]
        try:
            ok = share(0)
        finally:
            wait(futures)  # no lane may still touch the caller's buffers once this returns
        for f in futures:
            ok += f.result()
        if not all(ok):
            # A lane that could not store its share (typically: no room under the root's
            # capacity for one more active segment, which lanes multiply) hands what failed to
            # a lane that stored all of its own (it has a segment with room), or else to the
            # first, so lanes never fail a write one lane would have stored. Only records
            # never journaled are retried.
            whole = [n for n in range(len(bounds) - 1) if all(ok[bounds[n] : bounds[n + 1]])]
            lane = self._lanes[whole[0] if whole else 0]
            retry = [i for i, good in enumerate(ok) if not good]
            some = [views[i] for i in retry] if views is not None else [parts[i] for i in retry]
            again = lane.append(
                [keys[i] for i in retry], some, [lengths[i] for i in retry], now, self._helpers
            )
            for i, good in zip(retry, again):
                ok[i] = good
        return ok

    def give_back(self) -> int:
        """Where a writer of any process asked for room since this process last looked
        (``RootLock.ask_for_room``), finish the active segments of lanes idle for
        ``IDLE_GIVE_BACK_S``: a lane holds its preallocated segment however long it stays idle,
        and under a capped root that room is what other writers lack (many engines on one
        root, some of them idle). One ``pread`` of the lock file when nobody asked, none when no
        lane holds a segment. Callers hold the append lock; the bytes given back."""
        if all(lane.active is None for lane in self._lanes):
            return 0  # nothing held (a process that only reads never opens the lock file)
        lock = self._space.lock
        asked = lock.new_room_request()
        if asked is None:
            return 0
        given = [lane.give_back(IDLE_GIVE_BACK_S) for lane in self._lanes]
        if None not in given:  # else a busy lane gives back once it has been idle that long
            lock.room_request_served(asked)
        return sum(g for g in given if g is not None)

    def tombstone(self, keys: list[str], times: Sequence[int] | None = None) -> list[bool]:
        """``Lane.tombstone`` in the first lane."""
        return self._lanes[0].tombstone(keys, times)

    def close(self, delete: bool = False) -> None:
        """Finish every lane's active segment (deleting them with ``delete``)."""
        for lane in self._lanes:
            lane.close(delete)


IDLE_GIVE_BACK_S = 1.0
"""A lane that appended nothing for this long gives back its active segment's preallocated
room when a writer asks for room (``Writer.give_back``); a lane that appends more often keeps
it, so two busy writers on a crowded root do not start a segment each per batch."""

GIVE_BACK_EVERY_S = 30.0
"""A lane gives its room back at most this often. On a root short of room all the time (more
writers than whole segments fit), requests for room keep coming, and a writer that puts every
few seconds would otherwise start a segment per put (an earlier release on idleness alone,
reverted in eb24f1f: 102 segments for 300 records against ~19)."""


LANE_MIN_RECORD = 128 << 10
"""Records smaller than this on average stay in one lane (its runs shared with the IO threads):
per-record Python is then what bounds a put, not the kernel's copy, and two lanes measured
slower (64 KiB pages: 96 vs 108 ms per 256 MiB on the dev VM, 50-73% vs 67-75% of raw on the
quiet host); from 256 KiB up two lanes were faster (2 MiB: 98-100% vs 86-93%)."""


def _shares(lengths: Sequence[int], lanes: int) -> list[int]:
    """Bounds cutting records of ``lengths`` into at most ``lanes`` contiguous, non-empty shares
    of about equal bytes, at most one per ``RUN_BYTES`` of the batch (a smaller batch stays
    whole, as does one whose records average under ``LANE_MIN_RECORD``)."""
    n = len(lengths)
    total = sum(lengths)
    k = max(1, min(lanes, n, total // RUN_BYTES))
    if n and total < n * LANE_MIN_RECORD:
        k = 1
    if k == 1:
        return [0, n]
    bounds, acc, cut = [0], 0, 1
    for i, length in enumerate(lengths):
        acc += length
        if acc * k >= cut * total and i + 1 < n:
            bounds.append(i + 1)
            cut += 1
            if cut == k:
                break
    bounds.append(n)
    return bounds
