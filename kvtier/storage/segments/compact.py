"""Compaction: a finished segment whose live records take under ``compact_below`` of its record
bytes has them copied into this process's active segment, and is then deleted.

Records die when a newer record of the same key is journaled (two processes that stored one key
at once, or an earlier compaction), when a newer tombstone of the key is (``delete``), or when
they fail verification. A candidate is a finished
segment: this process's own once it moved on, or another writer's whose journal is final (its
writer moved on to a newer segment, or finished or died: ``Index._released``). Tombstones are
not copied: a segment's tombstones last as long as it does (the store module's Delete rule). The
compactor holds ``flock(LOCK_EX)`` on the candidate from before it reads the live records until
after it deleted the files, so two processes never compact one segment at once, and a writer's
active segment (``LOCK_SH``) is never taken. Every copied record is verified first (a bad one is
dropped and counted, not copied); the copies carry a newer journal time, so every process's index
moves to them once it reads this process's journal, which is written before the old segment is
deleted. Readers in flight keep the old segment's descriptor,
so its bytes are never freed under them (POSIX unlink semantics).
"""

from __future__ import annotations

import fcntl
import logging
import os

from kvtier.storage.page_format import checksum_matches
from kvtier.storage.segments.index import Index, Loc, Segment
from kvtier.storage.segments.io import read_all
from kvtier.storage.segments.root import open_regular
from kvtier.storage.segments.space import Space
from kvtier.storage.segments.writer import Writer

__all__ = ["Compactor"]

log = logging.getLogger(__name__)


class Compactor:
    """Compacts at most one segment per call of ``step``; callers hold the append lock."""

    def __init__(self, index: Index, writer: Writer, space: Space, dirfd: int, below: float):
        self._index, self._writer, self._space, self._dirfd = index, writer, space, dirfd
        self._below = below
        # Finished segments under the threshold. Kept up to date from ``Index.changed`` (the
        # segments whose books moved since the last look), so a batch costs O(changed +
        # candidates), not O(segments in the root): a scan of 10,000 segments per put batch
        # cost about as much as writing the batch.
        self._candidates: set[Segment] = set()
        # Segments copied out whose files could not be removed (EPERM, a read-only root):
        # not candidates again, or each batch would copy nothing and fail the unlink anew.
        self._stuck: set[str] = set()

    def _eligible(self, seg: Segment) -> bool:
        """Finished (not a journal still growing, not this process's active segment), not
        deleted, with records, and under the threshold."""
        return (
            not seg.gone
            and seg.stem not in self._stuck
            and seg.jfd is None
            and seg.end > 0
            and seg not in self._index.active
            and seg.live_bytes / seg.end < self._below
        )

    def _candidate_locked(self) -> Segment | None:
        """The finished segment with the smallest live fraction under the threshold, if any."""
        changed, candidates = self._index.changed, self._candidates
        for seg in changed:
            if self._eligible(seg):
                candidates.add(seg)
            else:
                candidates.discard(seg)
        changed.clear()
        best, best_ratio = None, self._below
        for seg in list(candidates):
            if seg.gone:
                candidates.discard(seg)
                continue
            ratio = seg.live_bytes / seg.end
            if ratio < best_ratio:
                best, best_ratio = seg, ratio
        return best

    def step(self) -> tuple[int, int]:
        """Compact one candidate segment, if any: (records copied, records that failed
        verification). Nothing happens while another process holds the candidate."""
        index = self._index
        if self._below <= 0:
            with index.mutex:
                index.changed.clear()  # nothing looks at them
            return 0, 0
        with index.mutex:
            seg = self._candidate_locked()
        if seg is None:
            return 0, 0
        fd = open_regular(self._dirfd, seg.stem + ".kvs")
        if fd is None:
            return 0, 0
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return 0, 0  # a writer's active segment, or another compactor's
            with index.mutex:
                live = [
                    (k, loc)
                    for k, loc in ((k, index.entries.get(k)) for k in dict.fromkeys(seg.keys))
                    if loc is not None and loc.seg is seg
                ]
            copied, bad = self._copy(fd, live)
            self._carry_tombstones(seg)
            with self._space.lock:
                files = self._space.listing().get(seg.stem, {})
                deleted = self._space.delete(seg.stem, files, held_fd=fd)
            if not deleted:
                with index.mutex:
                    self._stuck.add(seg.stem)
                    self._candidates.discard(seg)
            return copied, bad
        except (OSError, TimeoutError) as e:
            log.warning(
                "segment store %s: compaction of %s stopped: %s", self._space.root, seg.stem, e
            )
            return 0, 0
        finally:
            os.close(fd)

    def _carry_tombstones(self, seg: Segment) -> None:
        """Journal again, in this process's active segment, the tombstones in force that
        ``seg``'s journal holds, before ``seg`` goes: a delete must outlive the segment it was
        journaled in, or an older record of its key in another segment is served again after a
        restart. Each keeps its time plus 1 ns, as record copies do: it still loses to a record
        written after the delete and wins over its original. Raises ``OSError`` (``seg`` then
        stays) when they cannot all be journaled."""
        index = self._index
        with index.mutex:
            tombs, entries, carried = index.tombs, index.entries, []
            for k in dict.fromkeys(seg.keys):  # the segment's own keys, not every tombstone
                when = tombs.get(k)
                if when is None or when[1] != seg.stem:
                    continue
                loc = entries.get(k)
                if loc is not None and (loc.time_ns, loc.seg.stem, loc.seq) > when:
                    continue  # stored again since: the newer record wins without it
                carried.append((k, when[0] + 1))
        if not carried:
            return
        keys, times = [k for k, _ in carried], [t for _, t in carried]
        done = self._writer.tombstone(keys, times)
        if not all(done):
            raise OSError(f"{done.count(False)} of {len(keys)} tombstones not carried")

    def _copy(self, fd: int, live: list[tuple[str, Loc]]) -> tuple[int, int]:
        """Read, verify and append the records ``live``; (copied, failed verification). Raises
        ``OSError`` when a record cannot be read or appended: the segment then stays."""
        if not live:
            return 0, 0
        # A record that would end past the segment's file is not one (a journal entry that
        # lies, crafted or from another file): dropped, never sized into the buffer.
        size = os.fstat(fd).st_size
        bad = [(key, loc) for key, loc in live if loc.offset + loc.length > size]
        if bad:
            live = [(key, loc) for key, loc in live if loc.offset + loc.length <= size]
        buf = memoryview(bytearray(sum(loc.length for _, loc in live)))
        keys, parts, lengths = [], [], []
        at = 0
        for key, loc in live:
            payload = buf[at : at + loc.length]
            got = read_all(fd, [payload], loc.offset, loc.length)
            if got == loc.length and checksum_matches(loc.algorithm, loc.checksum, [payload]):
                keys.append(key)
                parts.append([payload])
                lengths.append(loc.length)
            else:
                bad.append((key, loc))
            at += loc.length
        with self._index.mutex:
            for key, loc in bad:
                self._index.drop_locked(key, loc)
        # Each copy carries its record's own time plus 1 ns, not now: a tombstone another
        # process made after a record was written must still win over its copy, even if this
        # process has not read that tombstone yet; and the copy must win over its original
        # (which goes with this segment), whatever the segments' names: with an older time, or
        # the same time and a smaller name, the index kept the original and lost the key when
        # the segment went. Records are appended in groups of one time (one per batch written).
        times = {key: loc.time_ns for key, loc in live}
        groups: dict[int, list[int]] = {}
        for i, key in enumerate(keys):
            groups.setdefault(times[key], []).append(i)
        failed = 0
        for t, idx in sorted(groups.items()):
            stored = self._writer.append(
                [keys[i] for i in idx],
                [parts[i] for i in idx],
                [lengths[i] for i in idx],
                time_ns=t + 1,
            )
            failed += stored.count(False)
        if failed:
            raise OSError(f"{failed} of {len(keys)} live records not copied")
        return len(keys), len(bad)
