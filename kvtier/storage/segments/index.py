"""The segment store's books in one process: which record serves each key, the segments it knows,
their read descriptors, and catching up with what other processes wrote.

Index. ``key -> Loc(segment, offset, length, seq, time, checksum)`` in memory, rebuilt at start-up
by reading every journal. When two records carry one key the newest (journal time, then segment
name, then sequence number: the entry's place in its journal) wins; the other is dead. A tombstone
(``delete``) newer than a key's records kills them. Each segment counts its live records and their
bytes, so eviction can prefer dead segments and compaction can find half-dead ones.

Other processes. Every call checks the root's mtime (one ``fstat``) and lists the root when it
changed, at most every max(``list_interval_s``, ten times the last listing's own time) (a forced
listing, ``forget_listing_locked``, never waits); a call with a key the index lacks also reads
what the other writers' journals still open gained since the last look. So a page another
process has written in a segment already seen is found by the next call that asks for it, and
one in a new segment within that interval. A segment missing from a listing is forgotten (its
keys leave the index).

Descriptors. A segment's read descriptor is opened on first use and kept in a least recently used
set of at most ``open_segments``; reads pin the descriptors they use, and a pinned one is never
closed. A segment another process deletes stays readable through an open descriptor (POSIX), so
the bytes of a read in flight are never freed under it; once closed, a deleted segment's records
are misses. The writer's active segment stays pinned until it moves on.

Every method whose name ends in ``_locked`` needs ``mutex`` held.
"""

from __future__ import annotations

import errno
import fcntl
import itertools
import logging
import operator
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from kvtier.storage.segments.format import Entry, foreign_journal, parse_entries
from kvtier.storage.segments.root import open_regular

__all__ = ["NAME", "Index", "Loc", "Segment"]

log = logging.getLogger(__name__)

NAME = re.compile(r"(?P<writer>[1-9][0-9]*-[0-9a-f]{8})-(?P<n>[0-9]{8})\.(?P<ext>kvs|kvj)")
"""A segment's (``kvs``) or journal's (``kvj``) file name: ``<pid>-<8 hex>-<number>.<ext>``."""
_JOURNAL_READ = 16 << 20  # bytes of a journal read per pread while tailing
# A directory's mtime comes from the kernel's coarse clock (one tick, a few ms): an entry made in
# the same tick as the last listing leaves it unchanged, so a lookup that misses lists the root
# again while its mtime is this recent.
_COARSE_NS = 1_000_000_000
# ``Index._dir_mtime`` when it is no root mtime (any int may be one): list on the next call
# (forced, never held back), or after a failed listing (retried, at the rate limit's pace).
_FORCED = None
_RETRY = "retry"


class Segment:
    """One segment file as this process sees it."""

    __slots__ = (
        "count",
        "end",
        "fd",
        "gone",
        "jfd",
        "jpos",
        "keys",
        "live",
        "live_bytes",
        "number",
        "pins",
        "stem",
        "touched",
        "writer",
    )

    def __init__(self, stem: str, writer: str, number: int, fd: int, jfd: int | None) -> None:
        self.stem, self.writer, self.number = stem, writer, number
        self.fd = fd  # read descriptor, -1 while closed (the writer's own while it appends)
        self.jfd = jfd  # journal descriptor while tailing another writer's journal, else None
        self.jpos = 0  # journal bytes parsed
        self.count = 0  # journal entries parsed (the next one's sequence number)
        self.keys: list[str] = []  # every key journaled here (to forget them when it goes)
        self.live = 0  # index entries pointing here
        self.live_bytes = 0  # their record bytes
        self.end = 0  # record bytes journaled (the end of its last journaled record)
        self.pins = 0  # reads in flight using ``fd``, plus one while this process appends to it
        self.gone = False  # deleted: close ``fd`` once unpinned
        self.touched = float("-inf")  # monotonic time of this process's last mtime stamp

    def close(self) -> None:
        for fd in (self.fd, self.jfd):
            if fd is not None and fd >= 0:
                os.close(fd)
        self.fd, self.jfd = -1, None


class Loc(NamedTuple):
    """Where the record serving a key lies."""

    seg: Segment
    offset: int
    length: int  # payload bytes
    seq: int
    time_ns: int
    trusted: bool  # seen written completely or verified by this process ("once" rule only)
    algorithm: int  # of the payload checksum (``page_format``)
    checksum: int


class Index:
    """The books above, shared by the reader, the writer and the space manager of one backend."""

    def __init__(
        self,
        root: Path,
        dirfd: int,
        writers: Iterable[str],
        open_segments: int,
        touch_interval_s: float,
        list_interval_s: float = 0.0,
    ) -> None:
        self.root, self._dirfd = root, dirfd
        self.writers = frozenset(writers)  # this process's writer names (one per write lane)
        self.mutex = threading.Lock()
        self.entries: dict[str, Loc] = {}
        # key -> (time, segment, seq) of its newest tombstone (``Entry.deleted``): records not
        # newer than it are dead. Kept while the segment whose journal holds it exists.
        self.tombs: dict[str, tuple[int, str, int]] = {}
        self.segments: dict[str, Segment] = {}
        self.active: set[Segment] = set()  # this process's segments being appended to
        # Segments whose live bytes, end or finished state changed since the compactor last
        # looked: only these can have become (or stopped being) compaction candidates, so the
        # compactor looks at them instead of every segment on each batch.
        self.changed: set[Segment] = set()
        self._open: OrderedDict[str, Segment] = OrderedDict()  # open read descriptors, LRU first
        self._open_max = open_segments
        self._touch_interval_s = touch_interval_s
        self._dir_mtime: int | str | None = _FORCED
        # Listings the root's changes prompt are at least this far apart (SegmentBackendConfig.
        # list_interval_s); a forced one (the first, ``forget_listing_locked``) never waits.
        self._list_every_ns = int(list_interval_s * 1e9)
        self._listed_at = 0  # time.monotonic_ns() of the last listing attempted
        self.listings = 0  # listings done
        self._list_cost_ns = 0  # the CPU the last listing took
        # The last listing's names, and the stems of those that are segment (``kvs``) and
        # journal (``kvj``) files: a listing parses only the names that are new since.
        self._names: set[str] = set()
        self._data: set[str] = set()
        self._journals: set[str] = set()
        self._latest: dict[str, int] = {}  # each writer's newest segment number seen

    # -- catching up with the root ----------------------------------------------------------------

    def refresh_locked(self, tail: bool) -> bool:
        """Catch up with the root: list it if it changed, and with ``tail`` read what the other
        writers' latest journals gained. Whether it looked (the index may have changed)."""
        try:
            mtime = os.fstat(self._dirfd).st_mtime_ns
        except OSError:
            return False
        looked = tail
        if mtime != self._dir_mtime or (tail and time.time_ns() - mtime < _COARSE_NS):
            now = time.monotonic_ns()
            # At least list_interval_s apart, and ten times the last listing's own time (a
            # root of many files is listed at most ~10% of the time).
            every = max(self._list_every_ns, 10 * self._list_cost_ns)
            if self._dir_mtime is _FORCED or now - self._listed_at >= every:
                # Attempts count for the rate limit (a root that cannot be listed, say with no
                # descriptor left, is retried at that pace, not on every call).
                self._listed_at = now
                if self._rescan_locked():
                    self._dir_mtime = mtime
                    self.listings += 1
                    looked = True
                else:
                    self._dir_mtime = _RETRY  # not the root's mtime: retried, rate-limited
        if tail:
            for seg in [s for s in self.segments.values() if s.jfd is not None]:
                self._tail_locked(seg)
        return looked

    def forget_listing_locked(self) -> None:
        """List the root again on the next call."""
        self._dir_mtime = _FORCED

    def _rescan_locked(self) -> bool:
        """List the root and catch up with what changed; False if it could not be listed."""
        cpu = time.thread_time_ns()
        try:
            names = set(os.listdir(self._dirfd))
        except OSError as e:
            log.warning("segment store %s: cannot list the root: %s", self.root, e)
            return False
        data, journals = self._data, self._journals
        for name in self._names - names:
            if NAME.fullmatch(name) is not None:
                (data if name.endswith(".kvs") else journals).discard(name[:-4])
        for name in names - self._names:
            m = NAME.fullmatch(name)
            if m is not None:
                (data if m["ext"] == "kvs" else journals).add(name[:-4])
        self._names = names
        # The listing's own cost (what the rate limit scales with): the CPU it took, not the
        # wall time, which a preemption on a loaded machine stretched (one 16 ms listing then
        # held every other process's new segments back for 160 ms); the journals read below
        # are new records, paid once whatever the cadence.
        self._list_cost_ns = time.thread_time_ns() - cpu
        active = {seg.stem for seg in self.active}
        gone = self.segments.keys() - data - active
        for stem in gone:
            self.remove_locked(self.segments[stem])
        latest = self._latest
        if gone:
            # Writers whose segments are all gone: nothing of theirs is left to mark final.
            alive = {seg.writer for seg in self.segments.values()}
            for writer in latest.keys() - alive:
                del latest[writer]
        new = []
        for stem in sorted((data & journals) - self.segments.keys()):
            writer, _, number = stem.rpartition("-")
            if writer in self.writers:
                continue  # our own leftovers (an append that failed): never served
            new.append((stem, writer, int(number)))
            latest[writer] = max(latest.get(writer, -1), int(number))
        for seg in [s for s in self.segments.values() if s.jfd is not None]:
            self._catch_up_locked(seg)
        # One new journal open at a time (only a live writer's newest stays open): a root of
        # more segments than the descriptor limit is indexed whole.
        for stem, writer, number in new:
            jfd = open_regular(self._dirfd, stem + ".kvj")
            if jfd is None:
                continue  # not a regular file (or no descriptor left): never served
            # The segment file is opened (and checked to be a regular file) when first read.
            seg = self.segments[stem] = Segment(stem, writer, number, -1, jfd)
            self._catch_up_locked(seg)
        return True

    def _catch_up_locked(self, seg: Segment) -> None:
        """Tail ``seg``'s journal; close it once it is final: its writer moved on to a newer
        segment, or holds it no more (finished it, or exited or died: ``_released``)."""
        # Asked before tailing: a journal tailed after its release holds every entry it will.
        final = seg.number < self._latest.get(seg.writer, -1) or self._released(seg)
        read = self._tail_locked(seg)
        if final and seg.jfd is not None:
            os.close(seg.jfd)
            seg.jfd = None
            self.changed.add(seg)
            if read:  # every entry it holds is known: none of its records is cut off
                self._trim(seg)

    def _trim(self, seg: Segment) -> None:
        """Give back the preallocated tail of a final segment whose writer died before finishing
        it (``kill -9``: it kept its whole preallocated size, for good, against the root's
        capacity and the disk; found in a user trial): truncated to its last journaled record,
        under ``LOCK_EX`` (no writer, compaction or eviction holds it then). A finished segment
        is already that size: nothing changes."""
        fd = open_regular(self._dirfd, seg.stem + ".kvs", os.O_WRONLY)
        if fd is None:
            return
        try:
            if os.fstat(fd).st_size <= seg.end:
                return
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            os.ftruncate(fd, seg.end)  # the records journaled stay; the rest is never served
        except OSError as e:  # held again (an eviction, a compaction), or a read-only root
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN):
                log.warning("segment store %s: cannot trim %s: %s", self.root, seg.stem, e)
        finally:
            os.close(fd)  # and its lock

    def _released(self, seg: Segment) -> bool:
        """Whether no writer holds ``seg`` (a writer keeps ``flock(LOCK_SH)`` on its active
        segment from before its journal exists until it has journaled its last entry; the kernel
        drops it when the process dies): ``LOCK_EX | LOCK_NB`` taken and dropped at once. So a
        dead writer's newest journal does not stay open here for as long as its segment lives
        (one descriptor per restart of every process on the root)."""
        fd = seg.fd if seg.fd >= 0 else open_regular(self._dirfd, seg.stem + ".kvs")
        if fd is None:
            return False  # gone, or no descriptor left: try again at the next listing
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # its writer holds it (or a compactor or an eviction, for a moment)
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            return True
        finally:
            if fd != seg.fd:
                os.close(fd)

    def _tail_locked(self, seg: Segment) -> bool:
        """Index the entries ``seg``'s journal gained since the last look; False if it could
        not be read."""
        try:
            size = os.fstat(seg.jfd).st_size  # type: ignore[arg-type]
            while size > seg.jpos:
                want = min(size - seg.jpos, _JOURNAL_READ)
                buf = os.pread(seg.jfd, want, seg.jpos)  # type: ignore[arg-type]
                entries, used = parse_entries(buf, seg.count)
                if seg.jpos == 0 and used == 0 and foreign_journal(buf):
                    os.close(seg.jfd)  # type: ignore[arg-type]  # never ours to read: stop
                    seg.jfd = None
                    break
                self.insert_locked(seg, entries)
                seg.jpos += used
                seg.count += len(entries)
                # A chunk may end inside an entry: read on from it. Nothing parsed means a torn
                # or still-landing entry: resume there next time.
                if used == 0 or len(buf) < want:
                    break
        except OSError as e:
            log.warning("segment store %s: journal %s unreadable: %s", self.root, seg.stem, e)
            return False
        return True

    # -- the index --------------------------------------------------------------------------------

    def add_own_locked(self, seg: Segment) -> None:
        """A segment this process just created; pinned while it appends to it."""
        seg.pins += 1
        self.segments[seg.stem] = seg
        self.active.add(seg)

    def finish_own_locked(self, seg: Segment) -> None:
        """This process stopped appending to ``seg``: its descriptor joins the read LRU."""
        self.active.discard(seg)
        self.changed.add(seg)
        if not seg.gone and seg.fd >= 0:
            self._open[seg.stem] = seg
        self.unpin_locked(seg)

    def insert_locked(self, seg: Segment, entries: Iterable[Entry], trusted: bool = False) -> None:
        """Index journal entries of ``seg`` (tuples of ``Entry``'s fields): the start-up path and
        every append, so kept lean (no per-entry call but the dict's)."""
        index, stem, tombs = self.entries, seg.stem, self.tombs
        get, keep, new, changed = index.get, seg.keys.append, tuple.__new__, self.changed.add
        changed(seg)
        live = live_bytes = 0
        end = seg.end
        for key, offset, length, seq, time_ns, algorithm, checksum, deleted in entries:
            keep(key)
            if deleted:
                self._tombstone_locked(key, (time_ns, stem, seq))
                continue
            # The segment's end counts every record, deleted or not, whatever the order its
            # journal and a tombstone's are read in (compaction reads it).
            if offset + length > end:
                end = offset + length
            if tombs:
                tomb = tombs.get(key)
                if tomb is not None and tomb >= (time_ns, stem, seq):
                    continue  # deleted after it was written
            old = get(key)
            if old is not None:
                if (old.time_ns, old.seg.stem, old.seq) >= (time_ns, stem, seq):
                    continue
                old.seg.live -= 1
                old.seg.live_bytes -= old.length
                changed(old.seg)
            index[key] = new(Loc, (seg, offset, length, seq, time_ns, trusted, algorithm, checksum))
            live += 1
            live_bytes += length
        seg.live += live
        seg.live_bytes += live_bytes
        seg.end = end

    @staticmethod
    def new_locs(
        seg: Segment,
        offsets: Sequence[int],
        lengths: Sequence[int],
        seq: int,
        time_ns: int,
        algorithms: Sequence[int],
        checksums: Sequence[int],
        trusted: bool,
    ) -> list[Loc]:
        """The index records of records appended to ``seg`` (entries ``seq..``, one time)."""
        return list(
            map(
                tuple.__new__,  # Loc._make is a Python call per record; this is not
                itertools.repeat(Loc),
                zip(
                    itertools.repeat(seg),
                    offsets,
                    lengths,
                    itertools.count(seq),
                    itertools.repeat(time_ns),
                    itertools.repeat(trusted),
                    algorithms,
                    checksums,
                ),
            )
        )

    def insert_new_locked(
        self,
        seg: Segment,
        keys: Sequence[str],
        offsets: Sequence[int],
        lengths: Sequence[int],
        seq: int,
        time_ns: int,
        algorithms: Sequence[int],
        checksums: Sequence[int],
        trusted: bool = False,
        locs: Sequence[Loc] | None = None,
    ) -> None:
        """``insert_locked`` of records just appended to ``seg`` (entries ``seq..``, one time),
        in C loops where no key is indexed or tombstoned yet (a batch of new pages, the common
        append), else entry by entry. ``locs``: their ``new_locs``, made beforehand (outside
        the mutex, while the bytes were being written), or None."""
        index, tombs = self.entries, self.tombs
        if any(map(index.__contains__, keys)) or (tombs and any(map(tombs.__contains__, keys))):
            n = len(keys)
            self.insert_locked(
                seg,
                zip(
                    keys,
                    offsets,
                    lengths,
                    range(seq, seq + n),
                    itertools.repeat(time_ns, n),
                    algorithms,
                    checksums,
                    itertools.repeat(False, n),
                ),
                trusted,
            )
            return
        self.changed.add(seg)
        seg.keys += keys
        if locs is None:
            locs = self.new_locs(
                seg, offsets, lengths, seq, time_ns, algorithms, checksums, trusted
            )
        index.update(zip(keys, locs))
        if keys:
            seg.live += len(keys)
            seg.live_bytes += sum(lengths)
            seg.end = max(seg.end, max(map(operator.add, offsets, lengths)))

    def _tombstone_locked(self, key: str, when: tuple[int, str, int]) -> None:
        """A tombstone of ``key`` made at ``when`` (time, segment, seq): the record serving it,
        if older, dies."""
        tomb = self.tombs.get(key)
        if tomb is None or tomb < when:
            self.tombs[key] = when
        old = self.entries.get(key)
        if old is None or (old.time_ns, old.seg.stem, old.seq) >= when:
            return
        del self.entries[key]
        old.seg.live -= 1
        old.seg.live_bytes -= old.length
        self.changed.add(old.seg)

    def remove_locked(self, seg: Segment) -> None:
        """Forget a deleted segment; its descriptor closes when no read of ours uses it."""
        index, tombs, stem = self.entries, self.tombs, seg.stem
        for key in seg.keys:
            loc = index.get(key)
            if loc is not None and loc.seg is seg:
                del index[key]
            if tombs:
                tomb = tombs.get(key)
                if tomb is not None and tomb[1] == stem:
                    del tombs[key]
        seg.keys, seg.live, seg.live_bytes, seg.gone = [], 0, 0, True
        self.segments.pop(seg.stem, None)
        self.changed.discard(seg)
        self._open.pop(seg.stem, None)
        if seg.pins == 0:
            seg.close()
        elif seg.jfd is not None:
            os.close(seg.jfd)
            seg.jfd = None

    def drop_locked(self, key: str, loc: Loc) -> None:
        """Forget one record (it failed verification); a later ``set`` writes the key anew."""
        if self.entries.get(key) == loc:
            del self.entries[key]
            loc.seg.live -= 1
            loc.seg.live_bytes -= loc.length
            self.changed.add(loc.seg)

    def trust_locked(self, key: str, loc: Loc) -> None:
        """Mark ``key``'s record verified (``verify="once"``), unless it changed meanwhile."""
        if not loc.trusted and self.entries.get(key) == loc:
            self.entries[key] = loc._replace(trusted=True)

    # -- descriptors ------------------------------------------------------------------------------

    def pin_locked(self, seg: Segment) -> int:
        """``seg``'s read descriptor, opened if closed, kept open until ``unpin_locked``; -1 if
        the segment is gone or no longer a regular file of ours."""
        if seg.gone:
            return -1
        if seg.fd < 0:
            fd = open_regular(self._dirfd, seg.stem + ".kvs")
            if fd is None:
                return -1
            seg.fd = fd
        seg.pins += 1
        if seg not in self.active:
            self._open[seg.stem] = seg
            self._open.move_to_end(seg.stem)
            self._trim_locked()
        return seg.fd

    def deleted_locked(self, seg: Segment) -> bool:
        """Whether ``seg``'s file is gone from the root (known gone, or absent now)."""
        if seg.gone:
            return True
        try:
            os.stat(seg.stem + ".kvs", dir_fd=self._dirfd, follow_symlinks=False)
        except FileNotFoundError:
            return True
        except OSError:
            return False
        return False

    def unpin_locked(self, seg: Segment) -> None:
        seg.pins -= 1
        if seg.pins == 0:
            if seg.gone:
                seg.close()
            else:
                self._trim_locked()

    def _trim_locked(self) -> None:
        """Close least recently used descriptors beyond ``open_segments`` (never a pinned one)."""
        if len(self._open) <= self._open_max:
            return
        for stem in [s for s, seg in self._open.items() if seg.pins == 0]:
            seg = self._open.pop(stem)
            os.close(seg.fd)
            seg.fd = -1
            if len(self._open) <= self._open_max:
                return

    @property
    def open_descriptors(self) -> int:
        """Segment descriptors open for reading (the active segment's not counted)."""
        return len(self._open)

    def touch_locked(self, segs: Iterable[Segment]) -> None:
        """Stamp the mtime (the shared LRU clock) of segments just used, rate-limited: through
        the open descriptor, or by name (never following a symlink) when it is closed."""
        now = time.monotonic()
        for seg in segs:
            if not seg.gone and now - seg.touched >= self._touch_interval_s:
                seg.touched = now
                t = time.time_ns()
                try:
                    if seg.fd >= 0:
                        os.utime(seg.fd, ns=(t, t))
                    else:
                        name = seg.stem + ".kvs"
                        os.utime(name, ns=(t, t), dir_fd=self._dirfd, follow_symlinks=False)
                except OSError:
                    pass  # best effort: the segment only ages faster

    def close_locked(self) -> None:
        for seg in self.segments.values():
            seg.close()
        for books in (
            self.segments,
            self._open,
            self.entries,
            self.tombs,
            self.active,
            self.changed,
            self._names,
            self._data,
            self._journals,
            self._latest,
        ):
            books.clear()
        self._dir_mtime = _FORCED
        self._dirfd = -1  # the number may be reused by another root: never list or open by it
