"""The segment store's settings, validated on construction."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvtier.storage.base import check_modes

__all__ = ["SegmentBackendConfig"]


_MAX_SECONDS = 1e6  # the time knobs' bound (11.6 days): larger ones overflow ns counters


@dataclass(frozen=True)
class SegmentBackendConfig:
    """Attributes:
    root: directory of segment files (created with ``dir_mode`` if missing; its parents with the
        umask's defaults). Several processes may share it.
    capacity_bytes: most bytes of segments and journals in the root, all processes together;
        ``None`` for no limit.
    fsync: ``fdatasync`` the segment and the journal once per batch (durable across power loss).
    segment_bytes: size a segment is preallocated to (a page larger than it gets one of its own);
        ``None``: 64 MiB, or an eighth of ``capacity_bytes`` shared by the write lanes if
        smaller, so that eviction (whole segments) is fine-grained. At most ``capacity_bytes``.
        Less where the other writers' active segments leave less than that under the capacity
        (many writers on one root): half of the room they leave, down to the next record.
    io_threads: threads per direction that share a batch's runs of records with the caller's
        thread (each run: one ``preadv`` or ``pwritev`` and its checksums; syscalls and XXH3 of
        more than 64 KiB release the GIL); 0: the caller's thread does everything, and in the
        C loops hashes each run right after writing it, from the cache the write's copy left
        it in: fewer CPU seconds per byte, the better choice where processes share few CPUs
        (H100 host, 64 KiB pages, 2 CPUs: two processes on one root put 56-66% of raw
        against 42-58% with the default; one process alone 62-95% against 77-116%).
    write_lanes: segments this process appends to at once: a batch of at least two runs'
        bytes is split among them by bytes, each share appended by one thread (the caller's and
        IO threads), so the kernel copies several segments' pages in parallel (one file's
        buffered writes take turns on its inode lock). At most ``io_threads + 1``; ``None``:
        ``min(2, io_threads + 1)``. Each lane preallocates its own segment, so under a
        ``capacity_bytes`` that the lanes' segments would take more than a quarter of, one lane
        is used; a lane that gets no segment (no room) hands its share to a lane that has one.
    dir_mode: permission bits of a root this backend creates (exactly, whatever the umask); an
        existing root may not be writable by more users than these bits allow. Must include
        ``0o700``.
    file_mode: permission bits of each segment, journal and the lock file; must include ``0o600``.
    allow_unsafe_root: accept an existing root that other users can write into, logging a
        warning, instead of refusing it.
    verify: when a read checks a record's checksum: ``"always"``, or ``"once"`` per record this
        process did not see written completely (its own appends are trusted, another's record
        once it verified). ``"once"`` trusts the disk not to change bytes it has returned.
    native: run a batch's runs (syscalls, checksums, the journal's entries) in the C loops of
        ``native_io.c``, built on first use with the system C compiler (``segments.native``),
        without the GIL; where they cannot be built, or with False, the same loops run in Python.
        Both write and read the same bytes.
    The time knobs (``lock_timeout_s``, ``touch_interval_s``, ``list_interval_s``) take seconds
    in [0, 1e6].

    lock_timeout_s: longest wait for the root lock (taken to create or delete segments); a write
        that cannot get it fails its pages.
    touch_interval_s: a read stamps the mtime of a segment it reads at most this often.
    list_interval_s: listings of the root that its changes prompt are at least this far apart
        (the first, at start-up, is never held back). A listing costs O(files in the root)
        (20,000 files: ~13 ms on a 2-core VM) and this process's own segment rolls change the
        root, so without it a put stream with a large root would list it on every batch; and
        listings are at least ten times their own CPU time apart (a root of many files is listed at
        most ~10% of the time). Another process's new segments, and the records and tombstones
        in them, are seen within max(list_interval_s, 10 x the listing's CPU time); its later records
        in a segment already seen come through its journal at once. ``delete`` of a key this
        process has not seen lists at once.
    compact_below: a finished segment whose live records (those the index still serves from it)
        take less than this fraction of its record bytes is compacted: its live records are
        copied into this process's active segment and it is deleted. 0 turns compaction off.
    open_segments: most segment descriptors this process keeps open for reading (least
        recently used closed first; one in use by a read is never closed).
    """

    root: str | os.PathLike[str]
    capacity_bytes: int | None = None
    fsync: bool = False
    segment_bytes: int | None = None
    io_threads: int = 1
    write_lanes: int | None = None
    dir_mode: int = 0o700
    file_mode: int = 0o600
    allow_unsafe_root: bool = False
    verify: str = "always"
    lock_timeout_s: float = 10.0
    touch_interval_s: float = 1.0
    list_interval_s: float = 0.1
    compact_below: float = 0.5
    open_segments: int = 256
    native: bool = True

    def __post_init__(self) -> None:
        for name in ("capacity_bytes", "segment_bytes", "io_threads", "open_segments"):
            value = getattr(self, name)
            if value is None and name in ("capacity_bytes", "segment_bytes"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}")
            if value < (0 if name == "io_threads" else 1):
                raise ValueError(
                    f"{name} must be {'>= 0' if name == 'io_threads' else 'positive'}, got {value}"
                )
        lanes = self.write_lanes
        if lanes is not None:
            if isinstance(lanes, bool) or not isinstance(lanes, int):
                raise TypeError(f"write_lanes must be an int, got {type(lanes).__name__} {lanes!r}")
            if not 1 <= lanes <= self.io_threads + 1:
                raise ValueError(
                    f"write_lanes must be in [1, io_threads + 1 = {self.io_threads + 1}], "
                    f"got {lanes}"
                )
        cap, seg = self.capacity_bytes, self.segment_bytes
        if cap is not None and seg is not None and seg > cap:
            raise ValueError(f"segment_bytes must be at most capacity_bytes ({cap}), got {seg}")
        check_modes(self)
        if not isinstance(self.native, bool):
            raise TypeError(
                f"native must be a bool, got {type(self.native).__name__} {self.native!r}"
            )
        if self.verify not in ("always", "once"):
            raise ValueError(f"verify must be 'always' or 'once', got {self.verify!r}")
        for name in ("lock_timeout_s", "touch_interval_s", "list_interval_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                raise TypeError(f"{name} must be a number, got {type(value).__name__} {value!r}")
            if not 0 <= value <= _MAX_SECONDS:
                raise ValueError(f"{name} must be a number in [0, {_MAX_SECONDS:g}], got {value!r}")
        value = self.compact_below
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise TypeError(f"compact_below must be a number, got {type(value).__name__} {value!r}")
        if not 0 <= value < 1:
            raise ValueError(f"compact_below must be a number in [0, 1), got {value!r}")

    @property
    def lanes(self) -> int:
        """The write lanes in use (``write_lanes`` resolved)."""
        return min(2, self.io_threads + 1) if self.write_lanes is None else self.write_lanes
