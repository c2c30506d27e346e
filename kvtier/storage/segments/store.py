"""The embedded L3 store: page records appended to segment files, several processes on one root.

Files (formats in ``segments.format``). Each process (each backend instance) writes only its own
segments, ``<writer>-<n>.kvs`` with the journal ``<writer>-<n>.kvj`` beside it, where
``<writer>`` is ``<pid>-<8 random hex>``. A batch of pages is appended to the active segment with
one ``pwritev`` per megabyte (record prefixes, page headers and the caller's page buffers as the
iovecs), then its journal entries with one ``pwrite``; with ``fsync`` both files are
``fdatasync``-ed once per batch. The syscalls run on an IO thread while the caller's thread
checksums the next run (pipelined: XXH3 and the bookkeeping hold the GIL, syscalls do not). A segment is preallocated to ``segment_bytes`` when created, truncated to its records when
the writer moves on (or closes), and never written again.

Verify rule: every read checks the record's prefix (magic and the journal's sequence number) and
its page header (payload length, key digest, XXH3-64 checksum of the payload), always, whoever
wrote it and whenever. A writer killed at any point leaves records whose journal entry is missing
(ignored), torn (parsing stops there) or present with the record's bytes incomplete or lost (the
checksum fails: a counted miss, dropped from the index); after a power loss the same holds, so a
reboot needs no rule of its own.

Index. ``key -> (segment, offset, length, seq, time)`` in memory, rebuilt at start-up by reading
every journal (``bench_storage`` reports the seconds per million pages). When two records carry
one key the newest (journal time) wins. Reads sort a batch by segment and offset and read each
run of adjacent records (up to a megabyte) with one ``preadv`` on an IO thread, directly into the
caller's page buffers, while the caller's thread verifies the run read before.

Several processes. Readers see other processes' pages by tailing their journals: every call
checks the root's mtime (one ``fstat``) and lists the root when it changed; a call with a key the
index lacks also reads what the other writers' latest journals gained since the last look. So a
page another process has written is found by the next call that asks for it.
Other processes' records are read through descriptors this process keeps open: a segment deleted
by another process stays readable through them (POSIX), so pages being read are never freed under
the reader; its descriptors are closed, and its pages forgotten, when a later listing misses it
and no read of this process still uses it.

Capacity and eviction, for the whole root. Creating a segment is the only point where space is
taken, under an exclusive ``flock`` on ``<root>/lock`` (held for a few syscalls, never around page
IO, and given up after ``lock_timeout_s``): the creator sums the sizes of every segment and
journal in the root, and while the new segment (plus its journal's reservation) does not fit
under ``capacity_bytes`` deletes whole segments: first leftovers (a segment without its journal
or the reverse), then segments none of whose records the index still uses (all superseded or
dropped), then the least recently used by file mtime. Writers stamp their segment's mtime after
every batch and readers stamp a segment they read from (at most once per ``touch_interval_s``),
so mtime order is an LRU order at segment granularity, shared by every process and kept across
restarts. A writer holds ``flock(LOCK_SH)`` on its active segment from creation until it moves
on, and a segment is deleted only after ``flock(LOCK_EX | LOCK_NB)`` on it succeeds: no process
deletes what another is writing (the lock dies with its holder, so a crashed writer's segment
becomes evictable).

Defences, as in the per-page store: keys are validated by ``StorageBackend``; only names of the
store's own form are considered, opened relative to the root's descriptor with ``O_NOFOLLOW |
O_NONBLOCK`` and used only when ``fstat`` shows a regular file (a symlink, FIFO, directory or
device in place of a segment or journal is ignored, never followed or deleted); the root is
created 0700 and files 0600 whatever the umask, and a root others can write is refused. Every call
is bounded: file syscalls on a local disk, and a root lock given up after ``lock_timeout_s``.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from kvtier.storage.base import MAX_KEY_LENGTH, Parts, StorageBackend
from kvtier.storage.keys import KeyScope
from kvtier.storage.metrics import StorageMetrics
from kvtier.storage.page_format import buffer_of, make_header, verify
from kvtier.storage.segments.format import (
    ENTRY_SIZE,
    PREFIX_SIZE,
    RECORD_HEAD,
    Entry,
    encode_entry,
    parse_entries,
    prefix_matches,
    record_prefix,
)
from kvtier.storage.segments.root import RootLock, create_file, open_regular, open_root

__all__ = ["RecordSpan", "SegmentBackend", "SegmentBackendConfig"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"(?P<writer>[1-9][0-9]*-[0-9a-f]{8})-(?P<n>[0-9]{8})\.(?P<ext>kvs|kvj)")
_LOCK_NAME = "lock"
_IOV_MAX = min(os.sysconf("SC_IOV_MAX"), 1024) if hasattr(os, "sysconf") else 1024
_JOURNAL_READ = 16 << 20  # bytes of a journal read per pread while tailing
# A directory's mtime comes from the kernel's coarse clock (one tick, a few ms): an entry made in
# the same tick as the last listing leaves it unchanged, so a lookup that misses lists the root
# again while its mtime is this recent.
_COARSE_NS = 1_000_000_000
_SEGMENT_BYTES = 64 << 20
_RUN_BYTES = 1 << 20  # bytes per syscall, so checksumming one run overlaps the IO of the next
_BAD = object()  # a record that failed verification (a checksum miss)


@dataclass(frozen=True)
class SegmentBackendConfig:
    """Attributes:
    root: directory of segment files (created with ``dir_mode`` if missing; its parents with the
        umask's defaults). Several processes may share it.
    capacity_bytes: most bytes of segments and journals in the root, all processes together;
        ``None`` for no limit.
    fsync: ``fdatasync`` the segment and the journal once per batch (durable across power loss).
    segment_bytes: size a segment is preallocated to (a page larger than it gets one of its own);
        ``None``: 64 MiB, or an eighth of ``capacity_bytes`` if smaller, so that eviction (whole
        segments) is fine-grained. At most ``capacity_bytes``.
    io_threads: threads per direction that run the ``preadv`` / ``pwritev`` of a batch while the
        caller's thread checksums the run before or after (syscalls release the GIL; XXH3 and
        the bookkeeping do not); 0: the caller's thread does everything.
    dir_mode: permission bits of a root this backend creates (exactly, whatever the umask); an
        existing root may not be writable by more users than these bits allow. Must include
        ``0o700``.
    file_mode: permission bits of each segment, journal and the lock file; must include ``0o600``.
    allow_unsafe_root: accept an existing root that other users can write into, logging a
        warning, instead of refusing it.
    verify: when a read checks a record's checksum: ``"always"``, or ``"once"`` per record this
        process did not see written completely (its own appends are trusted, another's record
        once it verified). ``"once"`` trusts the disk not to change bytes it has returned.
    lock_timeout_s: longest wait for the root lock (taken to create or delete segments); a write
        that cannot get it fails its pages.
    touch_interval_s: a read stamps the mtime of a segment it reads at most this often.
    """

    root: str | os.PathLike[str]
    capacity_bytes: int | None = None
    fsync: bool = False
    segment_bytes: int | None = None
    io_threads: int = 1
    dir_mode: int = 0o700
    file_mode: int = 0o600
    allow_unsafe_root: bool = False
    verify: str = "always"
    lock_timeout_s: float = 10.0
    touch_interval_s: float = 1.0

    def __post_init__(self) -> None:
        for name in ("capacity_bytes", "segment_bytes", "io_threads"):
            value = getattr(self, name)
            if value is None and name != "io_threads":
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < (0 if name == "io_threads" else 1):
                raise ValueError(
                    f"{name} must be {'>= 0' if name == 'io_threads' else 'positive'}, got {value}"
                )
        cap, seg = self.capacity_bytes, self.segment_bytes
        if cap is not None and seg is not None and seg > cap:
            raise ValueError(f"segment_bytes must be at most capacity_bytes ({cap}), got {seg}")
        for name, owner in (("dir_mode", 0o700), ("file_mode", 0o600)):
            mode = getattr(self, name)
            if isinstance(mode, bool) or not isinstance(mode, int):
                raise TypeError(f"{name} must be an int, got {type(mode).__name__} {mode!r}")
            if not 0 <= mode <= 0o777 or mode & owner != owner:
                raise ValueError(
                    f"{name} must be permission bits within 0o777 that include {owner:#o}, "
                    f"got {mode:#o}"
                )
        if self.verify not in ("always", "once"):
            raise ValueError(f"verify must be 'always' or 'once', got {self.verify!r}")
        for name in ("lock_timeout_s", "touch_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")


def _journal_reserve(segment_size: int) -> int:
    """Journal bytes counted for a segment of ``segment_size`` bytes (it moves on when they are
    used up): room for a 3.5 KiB page's entry per record, and at least one entry."""
    return max(ENTRY_SIZE + MAX_KEY_LENGTH, segment_size // 32)


def _accounted(files: dict[str, os.stat_result]) -> int:
    """Bytes a segment counts against the capacity: its file, and its journal at least at its
    reservation, which another process's active journal may still grow into."""
    seg = files["kvs"].st_size if "kvs" in files else 0
    journal = files["kvj"].st_size if "kvj" in files else 0
    return seg + max(journal, _journal_reserve(seg) if "kvs" in files else 0)


class _Segment:
    """One segment file as this process sees it."""

    __slots__ = (
        "fd",
        "gone",
        "jfd",
        "jpos",
        "keys",
        "live",
        "number",
        "pins",
        "stem",
        "touched",
        "writer",
    )

    def __init__(self, stem: str, writer: str, number: int, fd: int, jfd: int | None) -> None:
        self.stem, self.writer, self.number = stem, writer, number
        self.fd = fd  # read descriptor (the writer's own read-write one for own segments)
        self.jfd = jfd  # journal descriptor while tailing another writer's journal, else None
        self.jpos = 0  # journal bytes parsed
        self.keys: list[str] = []  # every key journaled here (to forget them when it goes)
        self.live = 0  # index entries pointing here
        self.pins = 0  # reads in flight using ``fd``
        self.gone = False  # deleted: close ``fd`` once unpinned
        self.touched = float("-inf")  # monotonic time of this process's last mtime stamp

    def close(self) -> None:
        for fd in (self.fd, self.jfd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.fd, self.jfd = -1, None


class _Loc(NamedTuple):
    seg: _Segment
    offset: int
    length: int
    seq: int
    time_ns: int
    trusted: bool  # seen written completely or verified by this process ("once" rule only)


class RecordSpan(NamedTuple):
    """A record's place: ``size`` bytes (prefix, page header, payload) at ``offset`` in ``path``."""

    path: Path
    offset: int
    size: int


@dataclass
class _Active:
    """The segment this process appends to."""

    seg: _Segment
    size: int  # bytes preallocated
    jfd: int
    jcap: int  # journal bytes reserved in the capacity
    end: int = 0
    jend: int = 0
    seq: int = 0
    full: bool = False  # a failed append: move on to a new segment


def _write_all(fd: int, iovecs: list, offset: int) -> None:
    """``pwritev`` every byte of ``iovecs`` at ``offset`` (a short write continues; a full disk
    raises ``OSError``)."""
    total = sum(v.nbytes if isinstance(v, memoryview) else len(v) for v in iovecs)
    done = os.pwritev(fd, iovecs, offset)
    while done < total:
        n = os.pwritev(fd, _after(iovecs, done), offset + done)
        if n == 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        done += n


def _after(iovecs: list, done: int) -> list:
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


def _submit(pool: ThreadPoolExecutor | None, fn: Callable[..., int], *args: object) -> Future:
    """``fn(*args)`` on ``pool``, or at once on the caller's thread without one."""
    if pool is not None:
        return pool.submit(fn, *args)
    done: Future = Future()
    try:
        done.set_result(fn(*args))
    except OSError as e:
        done.set_exception(e)
    return done


def _read_all(fd: int, iovecs: list[memoryview], offset: int, want: int) -> int:
    """``preadv`` into ``iovecs`` from ``offset`` until ``want`` bytes or the end of the file;
    the bytes read."""
    got = os.preadv(fd, iovecs, offset)
    while 0 < got < want:  # short reads are legal; zero means the file ends here
        more = os.preadv(fd, _after(iovecs, got), offset + got)
        if more == 0:
            break
        got += more
    return got


class _Run(NamedTuple):
    """Adjacent records moved by one ``preadv`` / ``pwritev``."""

    seg: _Segment
    start: int  # file offset of the first record
    iovecs: list
    members: list[int]  # for a read: positions in the batch's sorted plan


class SegmentBackend(StorageBackend):
    """Page records in append-only segment files; see the module docstring for the rules."""

    name = "file"
    Config = SegmentBackendConfig

    def __init__(
        self,
        config: SegmentBackendConfig,
        *,
        scope: KeyScope | None = None,
        metrics: StorageMetrics | None = None,
    ):
        super().__init__(scope=scope, metrics=metrics)
        self.config = config
        self.root = Path(config.root)
        cap = config.capacity_bytes
        self._seg_bytes = config.segment_bytes or (
            _SEGMENT_BYTES if cap is None else min(_SEGMENT_BYTES, max(cap // 8, 1))
        )
        self._mutex = threading.Lock()  # the index and the segment table
        self._append = threading.Lock()  # this process's appends, in order
        self._index: dict[str, _Loc] = {}
        self._segs: dict[str, _Segment] = {}
        self._writer = f"{os.getpid()}-{os.urandom(4).hex()}"
        self._numbers = 0
        self._active: _Active | None = None
        self._dir_mtime = -1
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._verify_once = config.verify == "once"
        self._dirfd = open_root(self.root, config.dir_mode, config.allow_unsafe_root)
        self._lock = RootLock(self._dirfd, _LOCK_NAME, config.file_mode, config.lock_timeout_s)
        try:
            with self._mutex:
                self._refresh_locked(tail=True)
        except BaseException:
            self.close()
            raise

    # -- what other processes wrote ---------------------------------------------------------------

    def _refresh_locked(self, tail: bool) -> None:
        """Catch up with the root: list it if it changed, and with ``tail`` read what the other
        writers' latest journals gained."""
        try:
            mtime = os.fstat(self._dirfd).st_mtime_ns
        except OSError:
            return
        if mtime != self._dir_mtime or (tail and time.time_ns() - mtime < _COARSE_NS):
            self._dir_mtime = mtime
            self._rescan_locked()
        if tail:
            for seg in [s for s in self._segs.values() if s.jfd is not None]:
                self._tail_locked(seg)

    def _rescan_locked(self) -> None:
        try:
            names = os.listdir(self._dirfd)
        except OSError as e:
            log.warning("segment store %s: cannot list the root: %s", self.root, e)
            return
        data, journals = set(), set()
        for name in names:
            m = _NAME.fullmatch(name)
            if m is not None:
                (data if m["ext"] == "kvs" else journals).add(name[:-4])
        active = self._active.seg.stem if self._active is not None else None
        for stem, seg in list(self._segs.items()):
            if stem not in data and stem != active:
                self._remove_locked(seg)
        for stem in sorted((data & journals) - self._segs.keys()):
            writer, _, number = stem.rpartition("-")
            if writer == self._writer:
                continue  # our own leftovers (an append that failed): never served
            fd = open_regular(self._dirfd, stem + ".kvs")
            jfd = open_regular(self._dirfd, stem + ".kvj") if fd is not None else None
            if fd is None or jfd is None:
                if fd is not None:
                    os.close(fd)
                continue  # not a regular file: never ours to serve
            self._segs[stem] = _Segment(stem, writer, int(number), fd, jfd)
        latest: dict[str, int] = {}
        for seg in self._segs.values():
            latest[seg.writer] = max(latest.get(seg.writer, -1), seg.number)
        for seg in self._segs.values():
            if seg.jfd is not None:
                self._tail_locked(seg)
                if seg.number < latest[seg.writer]:
                    # Its writer moved on: the journal is final.
                    os.close(seg.jfd)
                    seg.jfd = None

    def _tail_locked(self, seg: _Segment) -> None:
        """Index the entries ``seg``'s journal gained since the last look."""
        try:
            size = os.fstat(seg.jfd).st_size  # type: ignore[arg-type]
            while size > seg.jpos:
                want = min(size - seg.jpos, _JOURNAL_READ)
                buf = os.pread(seg.jfd, want, seg.jpos)  # type: ignore[arg-type]
                entries, used = parse_entries(buf)
                self._insert_all_locked(seg, entries)
                seg.jpos += used
                # A chunk may end inside an entry: read on from it. Nothing parsed means a torn
                # or still-landing entry: resume there next time.
                if used == 0 or len(buf) < want:
                    break
        except OSError as e:
            log.warning("segment store %s: journal %s unreadable: %s", self.root, seg.stem, e)

    def _insert_all_locked(self, seg: _Segment, entries: list[Entry]) -> None:
        """``_insert_locked`` for many entries of ``seg`` (the start-up path: kept lean)."""
        index, keys, stem, live = self._index, seg.keys, seg.stem, 0
        for key, offset, length, seq, time_ns in entries:
            keys.append(key)
            old = index.get(key)
            if old is not None:
                if (old.time_ns, old.seg.stem, old.seq) >= (time_ns, stem, seq):
                    continue
                old.seg.live -= 1
            index[key] = _Loc(seg, offset, length, seq, time_ns, False)
            live += 1
        seg.live += live

    def _insert_locked(self, seg: _Segment, e: Entry, trusted: bool = False) -> None:
        seg.keys.append(e.key)
        old = self._index.get(e.key)
        if old is not None and (old.time_ns, old.seg.stem, old.seq) >= (e.time_ns, seg.stem, e.seq):
            return
        if old is not None:
            old.seg.live -= 1
        self._index[e.key] = _Loc(seg, e.offset, e.length, e.seq, e.time_ns, trusted)
        seg.live += 1

    def _remove_locked(self, seg: _Segment) -> None:
        """Forget a deleted segment; its descriptor closes when no read of ours uses it."""
        for key in seg.keys:
            loc = self._index.get(key)
            if loc is not None and loc.seg is seg:
                del self._index[key]
        seg.keys, seg.live, seg.gone = [], 0, True
        self._segs.pop(seg.stem, None)
        if seg.pins == 0:
            seg.close()

    def _drop_locked(self, key: str, loc: _Loc) -> None:
        """Forget one record (it failed verification); a later ``set`` writes the key anew."""
        if self._index.get(key) == loc:
            del self._index[key]
            loc.seg.live -= 1

    def _touch_locked(self, segs: Iterable[_Segment]) -> None:
        """Stamp the mtime (the shared LRU clock) of segments just used, rate-limited."""
        now = time.monotonic()
        for seg in segs:
            if not seg.gone and now - seg.touched >= self.config.touch_interval_s:
                seg.touched = now
                t = time.time_ns()
                try:
                    os.utime(seg.fd, ns=(t, t))
                except OSError:
                    pass  # best effort: the segment only ages faster

    # -- StorageBackend --------------------------------------------------------------------------

    def _contains(self, object_keys: list[str]) -> list[bool]:
        with self._mutex:
            index = self._index
            self._refresh_locked(tail=any(k not in index for k in object_keys))
            return [k in index for k in object_keys]

    def _read(self, object_keys: list[str], pages: list[Parts]) -> list[bool]:
        n = len(object_keys)
        with self._mutex:
            index = self._index
            self._refresh_locked(tail=any(k not in index for k in object_keys))
            locs = [index.get(k) for k in object_keys]
            for loc in locs:
                if loc is not None:
                    loc.seg.pins += 1
        out: list[object] = [False] * n
        try:
            parts = [[buffer_of(p) for p in page] for page in pages]
            # A record of another size is not this caller's page (a pool of another layout):
            # not served, and not a checksum miss.
            plan = sorted(
                (loc.seg.stem, loc.offset, i)
                for i, loc in enumerate(locs)
                if loc is not None and loc.length == sum(p.nbytes for p in parts[i])
            )
            self._read_plan([i for _, _, i in plan], object_keys, locs, parts, out)  # type: ignore[arg-type]
        finally:
            with self._mutex:
                bad = [(k, loc) for k, loc, got in zip(object_keys, locs, out) if got is _BAD]
                for key, loc in bad:
                    self._drop_locked(key, loc)  # type: ignore[arg-type]
                used = {loc.seg for loc, got in zip(locs, out) if got is True}  # type: ignore[union-attr]
                if self._verify_once:
                    for key, loc, got in zip(object_keys, locs, out):
                        if got is True and not loc.trusted and index.get(key) == loc:  # type: ignore[union-attr]
                            index[key] = loc._replace(trusted=True)  # type: ignore[union-attr]
                self._touch_locked(used)
                for loc in locs:
                    if loc is not None:
                        loc.seg.pins -= 1
                        if loc.seg.gone and loc.seg.pins == 0:
                            loc.seg.close()
        if bad:
            self.metrics.add_checksum_miss(len(bad))
        return [got is True for got in out]

    def _read_plan(
        self,
        items: list[int],
        keys: list[str],
        locs: list[_Loc],
        parts: list[list[memoryview]],
        out: list[object],
    ) -> None:
        """Read the records ``items`` (sorted by segment and offset) and verify each into
        ``out[i]``: True, False (an IO error) or ``_BAD``. Each run of adjacent records (up to
        ``_RUN_BYTES``) is one ``preadv`` on the IO thread, while this thread verifies the run
        before it."""
        heads = memoryview(bytearray(RECORD_HEAD * len(items)))
        runs: list[_Run] = []
        j = 0
        while j < len(items):
            first = locs[items[j]]
            run = _Run(first.seg, first.offset, [], [])
            pos = first.offset
            while j < len(items):
                i = items[j]
                loc = locs[i]
                if run.members and (
                    loc.seg is not run.seg
                    or loc.offset != pos
                    or pos - run.start >= _RUN_BYTES
                    or len(run.iovecs) + 1 + len(parts[i]) > _IOV_MAX
                ):
                    break
                run.iovecs.append(heads[j * RECORD_HEAD : (j + 1) * RECORD_HEAD])
                run.iovecs.extend(parts[i])
                run.members.append(j)
                pos = loc.offset + RECORD_HEAD + loc.length
                j += 1
            runs.append(run)
        pool = self._io_pool("read")
        reads = [
            _submit(pool, _read_all, r.seg.fd, r.iovecs, r.start, sum(v.nbytes for v in r.iovecs))
            for r in runs
        ]
        try:
            for run, read in zip(runs, reads):
                try:
                    got = read.result()
                except OSError as e:
                    log.warning(
                        "segment store %s: read of %s failed: %s", self.root, run.seg.stem, e
                    )
                    continue  # its pages stay False
                for m in run.members:
                    i = items[m]
                    loc = locs[i]
                    head = heads[m * RECORD_HEAD : (m + 1) * RECORD_HEAD]
                    ok = (
                        loc.offset + RECORD_HEAD + loc.length <= run.start + got
                        and prefix_matches(head[:PREFIX_SIZE], loc.seq)
                        and (loc.trusted or verify(head[PREFIX_SIZE:], keys[i], parts[i]))
                    )
                    out[i] = True if ok else _BAD
        finally:
            wait(reads)  # no thread may still write into the page buffers once this returns

    def _io_pool(self, direction: str) -> ThreadPoolExecutor | None:
        """The thread that runs this direction's syscalls (None with ``io_threads=0``)."""
        if not self.config.io_threads:
            return None
        pool = self._pools.get(direction)
        if pool is None:
            with self._mutex:
                pool = self._pools.get(direction)
                if pool is None:
                    pool = ThreadPoolExecutor(
                        self.config.io_threads, thread_name_prefix=f"kvtier-segment-{direction}"
                    )
                    self._pools[direction] = pool
        return pool

    def _write(self, object_keys: list[str], pages: list[Parts]) -> list[bool]:
        n = len(object_keys)
        out = [False] * n
        todo: list[int] = []
        same: list[tuple[int, int]] = []  # (i, j): page i repeats the key of page j in this batch
        with self._mutex:
            index = self._index
            self._refresh_locked(tail=any(k not in index for k in object_keys))
            first: dict[str, int] = {}
            used = set()
            for i, key in enumerate(object_keys):
                loc = index.get(key)
                if loc is not None:
                    out[i] = True  # stored already (by us or another process): not rewritten
                    used.add(loc.seg)
                elif key in first:
                    same.append((i, first[key]))
                else:
                    first[key] = i
                    todo.append(i)
            self._touch_locked(used)
        if todo:
            keys = [object_keys[i] for i in todo]
            parts = [[buffer_of(p) for p in pages[i]] for i in todo]
            with self._append:
                done = self._append_records(keys, parts)
            for i, ok in zip(todo, done):
                out[i] = ok
        for i, j in same:
            out[i] = out[j]
        return out

    def _append_records(self, keys: list[str], parts: list[list[memoryview]]) -> list[bool]:
        """Append records to the active segment, moving on to new ones as they fill; per record,
        whether it is stored. This thread checksums each run of records (up to ``_RUN_BYTES``)
        while the IO thread ``pwritev``-s the run before it; once a segment's share of the batch
        is written, its journal entries follow with one ``pwrite``."""
        m = len(keys)
        ok = [False] * m
        lengths = [sum(p.nbytes for p in ps) for ps in parts]
        pool = self._io_pool("write")
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
            now = time.time_ns()
            entries: list[Entry] = []
            writes: list[tuple[Future, int]] = []  # each run's write, and the records up to it
            run: list = []
            start = pos = act.end
            jbytes, k = 0, j
            try:
                while k < m:
                    size, esize = RECORD_HEAD + lengths[k], ENTRY_SIZE + len(keys[k])
                    if k > j and (pos + size > act.size or act.jend + jbytes + esize > act.jcap):
                        break
                    if run and (
                        pos - start >= _RUN_BYTES or len(run) + 2 + len(parts[k]) > _IOV_MAX
                    ):
                        writes.append((_submit(pool, _write_all, act.seg.fd, run, start), k))
                        run, start = [], pos
                    act.seq += 1
                    run += [record_prefix(act.seq), make_header(keys[k], parts[k]), *parts[k]]
                    entries.append(Entry(keys[k], pos, lengths[k], act.seq, now))
                    pos, jbytes, k = pos + size, jbytes + esize, k + 1
                if run:
                    writes.append((_submit(pool, _write_all, act.seg.fd, run, start), k))
            finally:
                wait([w for w, _ in writes])  # the page buffers are the caller's again after this
            act.end = pos  # never reused, whatever was written
            stored = j
            for w, upto in writes:
                if w.exception() is not None:
                    log.warning(
                        "segment store %s: append to %s failed: %s",
                        self.root,
                        act.seg.stem,
                        w.exception(),
                    )
                    act.full = True  # records after a failed write are never journaled
                    break
                stored = upto
            journal = b"".join(encode_entry(e) for e in entries[: stored - j])
            try:
                if journal:
                    _write_all(act.jfd, [journal], act.jend)  # after the bytes it describes
                if self.config.fsync:
                    os.fdatasync(act.seg.fd)
                    os.fdatasync(act.jfd)
                os.utime(act.seg.fd, ns=(now, now))  # the shared LRU clock
            except OSError as e:
                # The journal may now end in a partial entry, which ends it for readers: this
                # segment takes no more (its records journaled before stay).
                log.warning(
                    "segment store %s: journal of %s failed: %s", self.root, act.seg.stem, e
                )
                act.full = True
                j = k
                continue
            act.jend += len(journal)
            with self._mutex:
                for e in entries[: stored - j]:
                    self._insert_locked(act.seg, e, trusted=self._verify_once)
            ok[j:stored] = [True] * (stored - j)
            j = k
        return ok

    # -- segments of this process -----------------------------------------------------------------

    def _roll(self, need: int) -> _Active | None:
        """Finish the active segment and create a new one with room for ``need`` bytes, evicting
        under the root lock while the root would pass its capacity; None if it cannot."""
        if self._active is not None:
            self._finish(self._active)
            self._active = None
        size = max(self._seg_bytes, need)
        jcap = _journal_reserve(size)
        cap = self.config.capacity_bytes
        if cap is not None and size + jcap > cap:
            return None
        self._numbers += 1
        stem = f"{self._writer}-{self._numbers:08d}"
        mode = self.config.file_mode
        fd = jfd = -1
        try:
            with self._lock:
                if cap is not None and not self._make_room(size + jcap, cap):
                    return None
                fd = create_file(self._dirfd, stem + ".kvs", mode)
                fcntl.flock(fd, fcntl.LOCK_SH)  # no process deletes it while we write it
                jfd = create_file(self._dirfd, stem + ".kvj", mode)
                size = self._preallocate(fd, size, need, jcap)
        except (OSError, TimeoutError) as e:
            log.warning("segment store %s: cannot start a segment: %s", self.root, e)
            for fd_, ext in ((fd, ".kvs"), (jfd, ".kvj")):
                if fd_ >= 0:
                    os.close(fd_)
                    self._unlink(stem + ext)
            return None
        seg = _Segment(stem, self._writer, self._numbers, fd, None)
        with self._mutex:
            self._segs[stem] = seg
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
            log.warning("segment store %s: cannot finish %s: %s", self.root, seg.stem, e)
        if act.end == 0 or delete:
            # Nothing journaled (never to be served), or clear(): delete it now.
            self._unlink(seg.stem + ".kvj")
            self._unlink(seg.stem + ".kvs")
            with self._mutex:
                self._remove_locked(seg)

    def _listing(self) -> dict[str, dict[str, os.stat_result]]:
        """The store's regular files in the root: stem -> {"kvs"|"kvj": stat}."""
        out: dict[str, dict[str, os.stat_result]] = {}
        for name in os.listdir(self._dirfd):
            m = _NAME.fullmatch(name)
            if m is None:
                continue
            try:
                st = os.stat(name, dir_fd=self._dirfd, follow_symlinks=False)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):  # a symlink, FIFO, directory: never ours
                continue
            out.setdefault(name[:-4], {})[m["ext"]] = st
        return out

    def _make_room(self, need: int, cap: int) -> bool:
        """Delete whole segments until ``need`` more bytes fit under ``cap`` (root lock held)."""
        files = self._listing()
        used = sum(_accounted(f) for f in files.values())
        if used + need <= cap:
            return True
        with self._mutex:
            live = {stem: seg.live for stem, seg in self._segs.items()}

        def order(stem: str) -> tuple[int, int]:
            f = files[stem]
            if len(f) < 2:
                return (0, 0)  # a leftover: half a segment
            return (1 if live.get(stem) == 0 else 2, f["kvs"].st_mtime_ns)

        for stem in sorted(files, key=order):
            if used + need <= cap:
                break
            if self._delete(stem, files[stem]):
                used -= _accounted(files[stem])
        return used + need <= cap

    def _delete(self, stem: str, files: dict[str, os.stat_result]) -> bool:
        """Delete a segment and its journal unless a writer holds it (root lock held). Space
        other processes' open descriptors still pin is freed when they next list the root."""
        fd = open_regular(self._dirfd, stem + ".kvs") if "kvs" in files else None
        if "kvs" in files and fd is None:
            return False
        try:
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return False  # a live writer's active segment
            for ext in ("kvj", "kvs"):
                if ext in files:  # only the regular files listed: a foreign entry stays
                    self._unlink(f"{stem}.{ext}")
        finally:
            if fd is not None:
                os.close(fd)
        with self._mutex:
            seg = self._segs.get(stem)
            if seg is not None:
                self._remove_locked(seg)
        return True

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dirfd)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("segment store %s: could not remove %r: %s", self.root, name, e)

    # -- lifecycle -------------------------------------------------------------------------------

    def clear(self) -> None:
        """Delete every segment in the root that no live writer holds (another process's active
        segment stays, with its pages)."""
        with self._append:
            if self._active is not None:
                self._finish(self._active, delete=True)
                self._active = None
            try:
                with self._lock:
                    for stem, files in self._listing().items():
                        self._delete(stem, files)
            except (OSError, TimeoutError) as e:
                log.warning("segment store %s: clear incomplete: %s", self.root, e)
            with self._mutex:
                self._dir_mtime = -1  # list again on the next call

    def close(self) -> None:
        """Finish the active segment, stop the IO threads and close every descriptor; the backend
        is unusable afterwards."""
        with self._append:
            if self._active is not None:
                self._finish(self._active)
                self._active = None
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.shutdown(wait=True)
        with self._mutex:
            for seg in self._segs.values():
                seg.close()
            self._segs.clear()
            self._index.clear()
        if self._dirfd >= 0:
            self._lock.close()
            os.close(self._dirfd)
            self._dirfd = -1

    def __del__(self) -> None:
        if getattr(self, "_dirfd", -1) >= 0:
            try:
                self.close()
            except Exception:
                log.debug("segment store: close at collection failed", exc_info=True)

    @property
    def used_bytes(self) -> int:
        """Bytes of every segment and journal in the root (all processes), as listed now."""
        return sum(st.st_size for f in self._listing().values() for st in f.values())

    def object_keys(self) -> list[str]:
        """Every object key the root holds, as this process's index sees it after catching up."""
        with self._mutex:
            self._refresh_locked(tail=True)
            return list(self._index)

    def locate(self, object_key: str) -> RecordSpan | None:
        """Where the record of ``object_key`` lies, or None: for tools and fault-injection tests."""
        with self._mutex:
            self._refresh_locked(tail=object_key not in self._index)
            loc = self._index.get(object_key)
        if loc is None:
            return None
        return RecordSpan(self.root / f"{loc.seg.stem}.kvs", loc.offset, RECORD_HEAD + loc.length)
