"""Room in the root, for every process together: what the segments take, and deleting them.

Creating a segment is the only point where space is taken, under an exclusive ``flock`` on
``<root>/lock`` (``root.RootLock``: held for a few syscalls, never around page IO). The creator sums
the sizes of every segment and journal in the root, and while the new segment (plus its journal's
reservation) does not fit under ``capacity_bytes`` deletes whole segments: first leftovers (a
segment without its journal or the reverse), then segments none of whose records the index still
uses (all superseded or dropped; known only where the index has read the whole journal), then
the least recently used by file mtime. It first finds out what deleting could free, trying each
candidate's lock in that order (a writer's active segment is never deleted): where the segments
other writers hold leave less than the new one needs, it deletes nothing, or, for a writer that
can do with less, deletes for a smaller segment in half of the room they leave (many writers on
one capped root), down to the writer's next record. Writers stamp their segment's mtime after
every batch and readers stamp a segment they read from (at most once per ``touch_interval_s``),
so mtime order is an LRU order at segment granularity, shared by every process and kept across
restarts.

A writer holds ``flock(LOCK_SH)`` on its active segment from creation until it moves on, and a
segment is deleted only while ``flock(LOCK_EX | LOCK_NB)`` on it holds: no process deletes what
another is writing (the lock dies with its holder, so a crashed writer's segment becomes
evictable). Only regular files of the store's own name form are considered; a foreign entry is
never followed or deleted.
"""

from __future__ import annotations

import fcntl
import logging
import os
import stat
from pathlib import Path

from kvtier.storage.base import MAX_KEY_LENGTH
from kvtier.storage.segments.format import ENTRY_SIZE
from kvtier.storage.segments.index import NAME, Index
from kvtier.storage.segments.root import RootLock, open_regular

__all__ = ["Space", "journal_reserve"]

log = logging.getLogger(__name__)

Files = dict[str, os.stat_result]  # "kvs" / "kvj" -> stat of one segment's files


def journal_reserve(segment_size: int) -> int:
    """Journal bytes counted for a segment of ``segment_size`` bytes (it moves on when they are
    used up): room for a 3.5 KiB page's entry per record, and at least one entry."""
    return max(ENTRY_SIZE + MAX_KEY_LENGTH, segment_size // 32)


def _accounted(files: Files) -> int:
    """Bytes a segment counts against the capacity: its file, and its journal at least at its
    reservation, which another process's active journal may still grow into."""
    seg = files["kvs"].st_size if "kvs" in files else 0
    journal = files["kvj"].st_size if "kvj" in files else 0
    return seg + max(journal, journal_reserve(seg) if "kvs" in files else 0)


class Space:
    """Listing, capacity and deletion for one backend; ``lock`` is the root lock."""

    def __init__(self, root: Path, dirfd: int, lock: RootLock, index: Index) -> None:
        self.root, self._dirfd, self.lock, self._index = root, dirfd, lock, index

    def listing(self) -> dict[str, Files]:
        """The store's regular files in the root: stem -> {"kvs"|"kvj": stat}."""
        out: dict[str, Files] = {}
        for name in os.listdir(self._dirfd):
            m = NAME.fullmatch(name)
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

    def used_bytes(self) -> int:
        return sum(st.st_size for f in self.listing().values() for st in f.values())

    def make_room(self, need: int, cap: int | None, least: int | None = None) -> int:
        """Delete whole segments until ``need`` more bytes fit under ``cap`` (root lock held);
        the bytes granted: ``need``, or 0 if that room cannot be made, in which case nothing is
        deleted. With ``least``: where the segments other writers hold (their active ones,
        never deleted) leave less than ``need`` under ``cap``, half of what they leave (so that
        another writer can start too), at least ``least`` if they leave that much; only what
        the grant takes is deleted. ``cap`` None: until ``need`` bytes are freed (a full
        disk)."""
        files = self.listing()
        used = sum(_accounted(f) for f in files.values())
        if cap is None:
            if used < need:  # the disk is full of other files: wiping the store would not do
                return 0
            cap = used
        if used + need <= cap:
            return need
        with self._index.mutex:
            own = self._index.writers
            # Live counts known to be whole: this process's own segments (it indexes what it
            # journals), and others' whose journal this process has read up to its size in the
            # listing. Another writer's segment listed while its journal was still empty (its
            # data landing) would otherwise count zero live records until a catch-up, and its
            # newest pages go first (measured: ~3% of evictions with two writers).
            live = {
                stem: seg.live
                for stem, seg in self._index.segments.items()
                if seg.writer in own
                or ("kvj" in files.get(stem, {}) and seg.jpos >= files[stem]["kvj"].st_size)
            }
            # A segment whose journal holds a tombstone in force is not dead: dropping it early
            # would bring the deleted records back (after a restart, or in a process that had
            # not read it yet).
            tombs = {t[1] for t in self._index.tombs.values()}

        def order(stem: str) -> tuple[int, int]:
            f = files[stem]
            if len(f) < 2:
                return (0, 0)  # a leftover: half a segment
            dead = live.get(stem) == 0 and stem not in tombs
            return (1 if dead else 2, f["kvs"].st_mtime_ns)

        # What deleting could free, known before anything goes: the segments in eviction order
        # up to the room wanted, less those a writer holds (probed, lock by lock).
        candidates, freeable, held = sorted(files, key=order), 0, set()
        for stem in candidates:
            if used - freeable + need <= cap:
                break
            if self._held(stem, files[stem]):
                held.add(stem)
            else:
                freeable += _accounted(files[stem])
        grant = need if used - freeable + need <= cap else cap - (used - freeable)
        if grant < need and (least is None or grant < least):
            return 0  # nothing deleted for room that would still not do
        if grant < need:
            grant = max(least, grant // 2)
        for stem in candidates:
            if used + grant <= cap:
                break
            if stem not in held and self.delete(stem, files[stem]):
                used -= _accounted(files[stem])
        return grant if used + grant <= cap else 0

    def _held(self, stem: str, files: Files) -> bool:
        """Whether a writer holds the segment (its active one), probed without deleting it."""
        if "kvs" not in files:
            return False
        fd = open_regular(self._dirfd, stem + ".kvs")
        if fd is None:
            return False  # gone, or not ours: delete() decides
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # the probe's lock goes with its descriptor
        return False

    def delete(self, stem: str, files: Files, held_fd: int | None = None) -> bool:
        """Delete a segment and its journal unless a writer holds it (root lock held). Space
        other processes' open descriptors still pin is freed when they close them.

        ``held_fd``: a descriptor of the segment on which the caller already holds
        ``LOCK_EX`` (compaction); otherwise one is opened and locked here.
        """
        fd = held_fd
        if fd is None and "kvs" in files:
            fd = open_regular(self._dirfd, stem + ".kvs")
            if fd is None:
                return False
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                return False  # a live writer's active segment
        gone = True
        try:
            for ext in ("kvj", "kvs"):
                if ext in files:  # only the regular files listed: a foreign entry stays
                    gone = self.unlink(f"{stem}.{ext}") and gone
        finally:
            if fd is not None and fd != held_fd:
                os.close(fd)
        if not gone:
            # Still on disk (EPERM, EACCES, EROFS...): its bytes still count against the
            # capacity, and its records stay indexed here and served from what remains.
            return False
        with self._index.mutex:
            seg = self._index.segments.get(stem)
            if seg is not None:
                self._index.remove_locked(seg)
        return True

    def clear(self) -> None:
        """Delete every segment no live writer holds (root lock taken here)."""
        with self.lock:
            for stem, files in self.listing().items():
                self.delete(stem, files)

    def unlink(self, name: str) -> bool:
        """Remove ``name`` from the root; whether it is gone (removed now, or absent)."""
        try:
            os.unlink(name, dir_fd=self._dirfd)
        except FileNotFoundError:
            pass
        except OSError as e:
            log.warning("segment store %s: could not remove %r: %s", self.root, name, e)
            return False
        return True
