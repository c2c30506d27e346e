"""The embedded L3 store: page records appended to segment files, several processes on one root.

``SegmentBackend`` wires the parts, each in its own module with its rules:

========== ================================================================================
format     the on-disk encodings (records, journal entries), both halves of each
index      which record serves each key; segments and their read descriptors (a bounded LRU);
           catching up with other processes' journals
reader     a batch read: sorted, one ``preadv`` per run of adjacent records, verified
writer     appends to this process's own segments, one per write lane; then journal entries
space      the root-wide capacity: listing, LRU eviction of whole segments, deletion
compact    copying the live records out of half-dead segments, then deleting them
io         whole syscalls, and runs of a batch shared by the caller's and the IO threads
root       the root directory: permissions, opening only the store's own regular files, the lock
========== ================================================================================

Verify rule: every read checks the record (the payload alone) against the XXH3-64 checksum its
journal entry holds for its key, whoever wrote it and whenever (``verify="always"``, the
default), or once per record this process did not see written completely (``verify="once"``).
A record is hashed as it is read (in pieces of ``io.RUN_BYTES`` for larger ones), while its
bytes are in the reading core's cache. Reads and writes of payloads whose size is a multiple of
4 KiB are 4 KiB-aligned in the segment, as raw file IO is, as long as the records before them in
the segment are too (records are not padded). A writer killed
at any point leaves records that are either journaled and intact, or unjournaled (ignored), or
journaled over lost bytes (the checksum fails: a counted miss, dropped); a power loss likewise,
so a reboot needs no rule of its own.

Delete: a tombstone entry in the deleting process's journal (no record) kills the key's
records journaled before it, in every process once it reads that journal, and across restarts;
their space is reclaimed by compaction and eviction like any dead record's. Compaction carries a
segment's tombstones in force on into its own journal before the segment goes; eviction does not:
a tombstone evicted before an older record of its key lets that record be served again after a
restart (a key names its bytes, so they are still the right ones; eviction takes the least
recently used segments, the older record's first as a rule), and a process that stores the key
again afterwards serves the new record; a process that had not read the tombstone's journal
before its segment went never applies the delete at all.

Restart: the index is rebuilt by reading every journal (``bench_storage`` reports the seconds
per million pages); LRU order is the segments' mtimes, kept on disk.

Defences, as in the per-page store: keys are validated by ``StorageBackend``; only names of the
store's own form are considered, opened relative to the root's descriptor with ``O_NOFOLLOW |
O_NONBLOCK`` and used only when ``fstat`` shows a regular file (a symlink, FIFO, directory or
device in place of a segment or journal is ignored, never followed or deleted); the root is
created 0700 and files 0600 whatever the umask, and a root others can write is refused. Every call
is bounded: file syscalls on a local disk, and a root lock given up after ``lock_timeout_s``.

Close: ``close`` refuses new calls at once, waits for those in flight on other threads (each
bounded), then finishes the active segment and closes every descriptor; a closed store's page
calls fail their pages and its other calls raise ``ValueError``, so a descriptor number another
file reuses is never touched.

Fork: a store belongs to the process that opened it. In a child made by ``fork`` it refuses every
call as a closed store does (the message says to open a new backend there), and the child's
descriptors of the root and of the store's files in it (segments, journals, the lock file) are
closed, touching no file and releasing no lock: the parent's writer names, active segments and IO
threads are not the child's, and copies kept open would hold the parent's writer lock past the
parent's death. Which descriptors: those that are such files at the fork (found through
``/proc/self/fd``, checked against the root's own descriptor, so a renamed root counts), including
any another thread of the parent held for a moment then (a segment being created, a compaction's
source); never a number the store recorded, which another thread may have closed, and the forking
thread reused, just before; never another file in the root (a user's log stays open). A new
backend opened in the child is a process of its own on the root.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import logging
import os
import stat
import threading
import weakref
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from kvtier.metrics import TierMetrics
from kvtier.storage.base import Parts, StorageBackend
from kvtier.storage.keys import KeyScope
from kvtier.storage.page_format import PageViews
from kvtier.storage.segments import native
from kvtier.storage.segments.compact import Compactor
from kvtier.storage.segments.config import SegmentBackendConfig
from kvtier.storage.segments.index import NAME, Index
from kvtier.storage.segments.reader import Reader
from kvtier.storage.segments.root import RootLock, open_root
from kvtier.storage.segments.space import Space
from kvtier.storage.segments.writer import Writer
from kvtier.storage.spans import select_pages

__all__ = ["RecordSpan", "SegmentBackend", "SegmentBackendConfig"]

log = logging.getLogger(__name__)

_LOCK_NAME = "lock"
_SEGMENT_BYTES = 64 << 20


@contextlib.contextmanager
def _collection_paused() -> Iterator[None]:
    """CPython's cyclic collector off (unless it is off already) while the index is rebuilt: the
    rebuild makes two tuples per journal entry, all long-lived, and the collections they trigger
    rescan the growing index again and again (measured: half the rebuild time at 3e5 entries)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class RecordSpan(NamedTuple):
    """A record's place: ``size`` bytes (the payload) at ``offset`` in ``path``."""

    path: Path
    offset: int
    size: int


T = TypeVar("T")


class _Gate:
    """Calls in flight, and ``close``: a call enters unless the store is closed (then it is
    refused); ``shut`` refuses new calls and waits for those inside to leave before any
    descriptor is closed, so no call ever uses a descriptor number another file reuses."""

    def __init__(self, root: Path) -> None:
        self._root = root
        # Reentrant: a signal handler runs on the main thread between any two bytecodes, also
        # while that thread holds this lock in ``enter``/``leave``; ``shut`` then refuses.
        self._cv = threading.Condition(threading.RLock())
        self._inside: dict[int, int] = {}  # thread id -> calls of that thread inside
        self.closed = False
        self._why = "used after close()"

    def abandon(self, why: str) -> None:
        """Refuse every call from now on, with ``why``, in a forked child: its only thread runs
        this, and the lock and the calls inside belong to threads of the parent that do not
        exist here (one of them may have held the lock when the process forked)."""
        self._cv = threading.Condition(threading.RLock())
        self._inside = {}
        self._why = why
        self.closed = True

    def enter(self) -> None:
        ident = threading.get_ident()
        with self._cv:
            if self.closed:
                raise ValueError(f"segment store {self._root}: {self._why}")
            self._inside[ident] = self._inside.get(ident, 0) + 1

    def leave(self) -> None:
        ident = threading.get_ident()
        with self._cv:
            n = self._inside[ident] - 1
            if n:
                self._inside[ident] = n
            else:
                del self._inside[ident]
                if self.closed and not self._inside:
                    self._cv.notify_all()

    def shut(self) -> bool:
        """Refuse new calls and wait for those inside (each ends in bounded time); False if the
        gate was shut already. From a thread that is itself inside a call (a signal handler run
        in the middle of one, say) it raises ``RuntimeError`` and changes nothing: waiting for
        itself would never end, and closing under its own call would let that call reach
        whatever file reuses the descriptors."""
        held = self._cv._is_owned()  # a handler run inside ``enter``/``leave`` on this thread
        with self._cv:
            if self.closed and not held:
                return False
            if held or threading.get_ident() in self._inside:
                raise RuntimeError(
                    f"segment store {self._root}: close() from inside a call on the same thread"
                )
            self.closed = True
            while self._inside:
                self._cv.wait()
        return True


def _gated(method: Callable[..., T]) -> Callable[..., T]:
    """Run ``method`` inside the store's gate (``_Gate``)."""

    @functools.wraps(method)
    def gated(self: SegmentBackend, *args: Any, **kwargs: Any) -> T:
        gate = self._gate
        gate.enter()
        try:
            return method(self, *args, **kwargs)
        finally:
            gate.leave()

    return gated


_LIVE: weakref.WeakSet[SegmentBackend] = weakref.WeakSet()  # stores of this process


def _abandon_in_child() -> None:
    """After ``fork``, in the child: every store the parent had open is abandoned there, and the
    child's descriptors of their files are closed."""
    stores = [store for store in list(_LIVE) if getattr(store, "_dirfd", -1) >= 0]
    roots = [(store._dirfd, store._root_id) for store in stores]
    for store in stores:
        store._abandon_in_child()
    if roots:
        _close_descriptors_into(roots)


def _close_descriptors_into(roots: list[tuple[int, tuple[int, int]]]) -> None:
    """Close this process's descriptors of the stores' roots (each given as the child's copy of
    its descriptor and its device and inode) and of the files a store makes in them (segments,
    journals, the lock file), whoever opened them: in a forked child, the copies of descriptors
    the parent's threads held at the fork, including those only opened for a moment (a segment
    being created, a compaction's source, a listing).

    It looks at what each descriptor is now, never at numbers the stores recorded (another thread
    may have closed one, and the number been reused, just before the fork): its path through
    ``/proc/self/fd``, compared with the root's path now (the path of the root's own descriptor,
    so a root renamed since it was opened is still found); then, only for a store's file name in
    a root, ``fstat`` against what that name is in the root (a deleted one: any file of the
    root's device that is no longer linked). Other files in a root, the user's own, stay open,
    and no other file system is asked anything. Without ``/proc`` nothing is closed: the copies
    stay open, which is a leak, never a wrong close."""
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return
    here: dict[str, tuple[int, tuple[int, int]]] = {}  # a root's path now -> (its fd, its id)
    for d, ident in roots:
        try:
            st = os.fstat(d)
            if (st.st_dev, st.st_ino) == ident:
                here[os.readlink(f"/proc/self/fd/{d}")] = (d, ident)
        except OSError:
            continue
    dirs = []  # closed last: the files are looked up through them
    for name in names:
        try:
            fd = int(name)
            target = os.readlink(f"/proc/self/fd/{name}").removesuffix(" (deleted)")
            if target in here:
                st = os.fstat(fd)
                if stat.S_ISDIR(st.st_mode) and (st.st_dev, st.st_ino) == here[target][1]:
                    dirs.append(fd)
                continue
            parent, base = os.path.split(target)
            if parent not in here or (base != _LOCK_NAME and NAME.fullmatch(base) is None):
                continue
            d, (dev, _) = here[parent]
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_dev != dev:
                continue
            try:
                now = os.stat(base, dir_fd=d, follow_symlinks=False)
                ours = (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino)
            except FileNotFoundError:  # deleted, maybe this moment by the parent, which runs on
                ours = os.fstat(fd).st_nlink == 0
            if ours:
                os.close(fd)
        except (OSError, ValueError):
            continue  # gone (the listing's own descriptor), or its name is
    for fd in dirs:
        with contextlib.suppress(OSError):
            os.close(fd)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_abandon_in_child)


class SegmentBackend(StorageBackend):
    """Page records in append-only segment files; see the module docstring for the rules."""

    name = "file"
    Config = SegmentBackendConfig

    def __init__(
        self,
        config: SegmentBackendConfig,
        *,
        scope: KeyScope | None = None,
        metrics: TierMetrics | None = None,
    ):
        super().__init__(scope=scope, metrics=metrics)
        self.config = config
        self.root = Path(config.root)
        cap = config.capacity_bytes
        seg_bytes = config.segment_bytes or (
            _SEGMENT_BYTES
            if cap is None
            else min(_SEGMENT_BYTES, max(cap // (8 * config.lanes), 1))
        )
        self._gate = _Gate(self.root)
        self._pid = os.getpid()
        self._append = threading.Lock()  # this process's appends (and compactions), in order
        self._pools: dict[str, ThreadPoolExecutor] = {}
        self._pools_mutex = threading.Lock()
        self._dirfd = open_root(self.root, config.dir_mode, config.allow_unsafe_root)
        st = os.fstat(self._dirfd)
        self._root_id = (st.st_dev, st.st_ino)
        self._lock = RootLock(self._dirfd, _LOCK_NAME, config.file_mode, config.lock_timeout_s)
        # One writer name per write lane: each lane's segments are numbered on their own, so
        # another process tails the newest segment of each (older ones are final).
        names = [f"{os.getpid()}-{os.urandom(4).hex()}" for _ in range(config.lanes)]
        self._index = Index(
            self.root,
            self._dirfd,
            names,
            config.open_segments,
            config.touch_interval_s,
            config.list_interval_s,
        )
        self._space = Space(self.root, self._dirfd, self._lock, self._index)
        self._reader = Reader(
            self._index,
            lambda: self._io_pool("read"),
            config.io_threads,
            config.verify == "once",
            config.native,
        )
        self._writer = Writer(
            config,
            seg_bytes,
            self._dirfd,
            self._index,
            self._space,
            lambda: self._io_pool("write"),
            names,
        )
        self._compactor = Compactor(
            self._index, self._writer, self._space, self._dirfd, config.compact_below
        )
        if config.native:
            native.library()  # built (first use on this machine) or loaded now, not in a batch
        _LIVE.add(self)
        try:
            with self._index.mutex, _collection_paused():
                self._index.refresh_locked(tail=True)
        except BaseException:
            self.close()
            raise

    def _io_pool(self, direction: str) -> ThreadPoolExecutor | None:
        """The threads that share this direction's runs (None with ``io_threads=0``)."""
        if not self.config.io_threads:
            return None
        pool = self._pools.get(direction)
        if pool is None:
            with self._pools_mutex:
                pool = self._pools.get(direction)
                if pool is None:
                    pool = ThreadPoolExecutor(
                        self.config.io_threads, thread_name_prefix=f"kvtier-segment-{direction}"
                    )
                    self._pools[direction] = pool
        return pool

    # -- StorageBackend --------------------------------------------------------------------------

    def _give_back_idle(self) -> None:
        """``Writer.give_back`` from a lookup or a get, unless an append is running (this
        process's writer is busy then). Not from a put or a delete: their writer would give its
        segment back only to start a new one at once, on a crowded root a short one that asks
        for room again (helper 72: a segment per put among writers putting every second)."""
        if self._append.acquire(blocking=False):
            try:
                self._writer.give_back()
            finally:
                self._append.release()

    @_gated
    def _contains(self, object_keys: list[str]) -> list[bool]:
        self._give_back_idle()
        index = self._index
        with index.mutex:
            entries = index.entries
            index.refresh_locked(tail=any(k not in entries for k in object_keys))
            return [k in entries for k in object_keys]

    @_gated
    def _read(self, object_keys: list[str], pages: list[Parts]) -> list[bool]:
        self._give_back_idle()
        ok, bad = self._reader.read(object_keys, pages)
        if bad:
            self.metrics.add_checksum_miss(bad)
        return ok

    @_gated
    def _write(self, object_keys: list[str], pages: list[Parts]) -> list[bool]:
        n = len(object_keys)
        out = [False] * n
        todo: list[int] = []
        same: list[tuple[int, int]] = []  # (i, j): page i repeats the key of page j in this batch
        index = self._index
        with index.mutex:
            get = index.entries.get
            locs = list(map(get, object_keys))
            if index.refresh_locked(tail=None in locs):
                locs = list(map(get, object_keys))
            if locs.count(None) == n and len(set(object_keys)) == n:
                todo = list(range(n))  # the common case: every key new, none repeated
            else:
                first: dict[str, int] = {}
                used = set()
                for i, (key, loc) in enumerate(zip(object_keys, locs)):
                    if loc is not None:
                        out[i] = True  # stored already (by us or another process): not rewritten
                        used.add(loc.seg)
                    elif key in first:
                        same.append((i, first[key]))
                    else:
                        first[key] = i
                        todo.append(i)
                index.touch_locked(used)
        if todo:
            if len(todo) == n:
                keys, some = object_keys, pages
            else:
                keys, some = [object_keys[i] for i in todo], select_pages(pages, todo)
            views = PageViews(some)
            with self._append:
                done = self._writer.append(keys, views, views.lengths())
                try:
                    _, bad = self._compactor.step()
                except Exception:  # housekeeping: it must never fail the pages just stored
                    log.exception("segment store %s: compaction failed", self.root)
                    bad = 0
            if bad:
                self.metrics.add_checksum_miss(bad)
            for i, ok in zip(todo, done):
                out[i] = ok
        for i, j in same:
            out[i] = out[j]
        return out

    @_gated
    def _delete(self, object_keys: list[str]) -> list[bool]:
        """Tombstones in this process's journal for the keys the root holds (see the module
        docstring); a key it does not hold is gone already."""
        index = self._index
        with index.mutex:
            listed = index.listings
            index.refresh_locked(tail=True)  # another process's newest records die too
            keys = dict.fromkeys(object_keys)
            absent_ok = True  # a key the root does not hold is gone already
            if index.listings == listed and any(k not in index.entries for k in keys):
                # A key may lie in a segment made since the last listing (which the rate limit
                # may have held back): list now, or the key would outlive its delete.
                index.forget_listing_locked()
                index.refresh_locked(tail=True)
                # If the root could not be listed, an absent key may still be held: not done.
                absent_ok = index.listings != listed
            present = [k for k in keys if k in index.entries]
        if not present:
            return [absent_ok] * len(object_keys)
        with self._append:
            done = dict(zip(present, self._writer.tombstone(present)))
        return [done.get(k, absent_ok) for k in object_keys]

    # -- lifecycle -------------------------------------------------------------------------------

    @_gated
    def clear(self) -> None:
        """Delete every segment in the root that no live writer holds (another process's active
        segment stays, with its pages)."""
        with self._append:
            self._writer.close(delete=True)
            try:
                self._space.clear()
            except (OSError, TimeoutError) as e:
                log.warning("segment store %s: clear incomplete: %s", self.root, e)
            with self._index.mutex:
                self._index.forget_listing_locked()

    def close(self) -> None:
        """Finish the active segment, stop the IO threads and close every descriptor, once the
        calls in flight (on other threads) have returned. The backend is unusable afterwards:
        page calls fail their pages (``set``/``get``/``delete``: False, ``exists``: none), and
        ``clear``, ``object_keys``, ``locate``, ``used_bytes`` and ``open_descriptors`` raise
        ``ValueError``. A second ``close`` does nothing."""
        self._close(join=True)

    def _close(self, join: bool) -> None:
        """``close``; ``join``: wait for the IO threads to exit. Not at collection: a collection
        may run inside ``threading``'s own bookkeeping of a thread starting or stopping, with a
        lock held that exiting threads need (joining them there deadlocks); they exit on their
        own once told to."""
        if getattr(self, "_dirfd", -1) < 0 or not self._gate.shut():
            return
        with self._append:
            if hasattr(self, "_writer"):
                self._writer.close()
        pools, self._pools = self._pools, {}
        for pool in pools.values():
            pool.shutdown(wait=join)
        if hasattr(self, "_index"):
            with self._index.mutex:
                self._index.close_locked()
        self._lock.close()
        os.close(self._dirfd)
        self._dirfd = -1

    def _abandon_in_child(self) -> None:
        """The process forked and this is the child: the store is the parent's (its writer
        names, active segments and IO threads), so here it refuses every call like a closed
        store and never touches a descriptor again; ``_close_descriptors_into`` closes the
        child's copies, with no other effect (no segment finished or truncated, no lock
        released: the parent keeps all of it). Before: a put in the child waited forever for IO
        threads that did not fork with it, and the copies held the parent's writer lock past the
        parent's death."""
        self._gate.abandon(
            f"opened by process {self._pid}, unusable in its forked child {os.getpid()} "
            "(open a new backend there)"
        )
        self._pools = {}
        self._dirfd = -1

    def __del__(self) -> None:
        if getattr(self, "_dirfd", -1) >= 0:
            try:
                self._close(join=False)
            except Exception:
                log.debug("segment store: close at collection failed", exc_info=True)

    # -- for tools and tests ---------------------------------------------------------------------

    @property
    @_gated
    def used_bytes(self) -> int:
        """Bytes of every segment and journal in the root (all processes), as listed now."""
        return self._space.used_bytes()

    @property
    @_gated
    def open_descriptors(self) -> int:
        """Segment descriptors this process keeps open for reading (at most ``open_segments``
        while no read is in flight)."""
        with self._index.mutex:
            return self._index.open_descriptors

    @_gated
    def object_keys(self) -> list[str]:
        """Every object key the root holds, as this process's index sees it after catching up."""
        with self._index.mutex:
            self._index.refresh_locked(tail=True)
            return list(self._index.entries)

    @_gated
    def locate(self, object_key: str) -> RecordSpan | None:
        """Where the record of ``object_key`` lies, or None: for tools and fault-injection tests."""
        index = self._index
        with index.mutex:
            index.refresh_locked(tail=object_key not in index.entries)
            loc = index.entries.get(object_key)
        if loc is None:
            return None
        return RecordSpan(self.root / f"{loc.seg.stem}.kvs", loc.offset, loc.length)
