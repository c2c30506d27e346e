"""The per-page file store: one file per page object in a local (or shared) directory.

``create_backend("file")`` builds the segment store (``kvtier.storage.segments``), which this
module re-exports as ``FileBackend`` / ``FileBackendConfig``; this older store is
``FilePerPageBackend``, kept for comparison (``profiling/bench_storage.py``) and for roots written
by it. Creating a file per page costs more than the page's bytes on ext4 for pages under a few
hundred KiB, which is why the segment store replaced it.

File ``<root>/<object key>.kvp`` holds the 32-byte header then the page (``page_format``). Writes
go to ``<object key>.kvp.<token>-<pid>-<n>-<j>.tmp`` in the same directory and are renamed into
place, so a reader sees either no file or the whole file. ``<token>`` tells this kernel boot and
PID namespace apart from others sharing the directory, ``<pid>`` is the writer's process. At
start-up a temp file is deleted when its writer is dead (same token, no such process) or when it
is older than ``stale_tmp_s`` (a writer elsewhere, or a reused pid); an in-flight temp file of a
live process writing the same directory is left alone.

Bytes move with ``os.writev`` / ``os.readv`` straight between the page buffers and the kernel: the
header and the page's parts are the iovecs of one syscall, with no Python-side copy. Per page a
write costs open, fchmod, writev, close and rename, a read open, fstat, readv and close, all
relative to one directory descriptor; the index is locked once per batch, not per page. A batch's
pages may be split over ``read_threads`` / ``write_threads`` threads.

Existence is answered from an in-memory index (key -> size, in least-recently-used order) built by
scanning the directory at start-up (oldest mtime first). A key the index lacks costs one ``lstat``,
so files that other processes sharing the directory wrote later (TP ranks, a producer) are found
and indexed. ``get`` refreshes a key's recency; ``exists`` does not. With ``capacity_bytes`` set,
a write first evicts least-recently-used files until the new file fits; each process enforces it
over the files it knows. One mutex guards the index; file IO runs outside it.

Security. The checksum in each header detects corruption (torn writes, bit rot, a file renamed
under another key), not forgery: anyone who can write into the root can store a page that
verifies. The root directory's permissions are therefore the security boundary. The root is
created with mode ``dir_mode`` (0700) and page files with ``file_mode`` (0600), whatever the
umask. A root that already exists and that other users could write into (group or other write
bits beyond ``dir_mode``, or another owner) is refused with ``ValueError``, unless
``allow_unsafe_root`` is set, which only logs a warning. Within the root only the store's own
entries are served: object keys are validated by ``StorageBackend`` before they reach this file
(no ``/``, ``..`` or NUL can form a path), files are opened with ``O_NOFOLLOW | O_NONBLOCK``
relative to the root's descriptor and used only if ``fstat`` shows a regular file, and the
start-up scan indexes only regular files of at least a header's size. A symlink, FIFO, directory
or device at a page's name is a miss (read) or a failed page (write), answered in bounded time;
such foreign entries are dropped from the index but never deleted or followed.
"""

from __future__ import annotations

import errno
import hashlib
import itertools
import logging
import os
import re
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from kvtier.metrics import TierMetrics
from kvtier.storage.base import Parts, StorageBackend, check_modes, validate_key
from kvtier.storage.keys import KeyScope
from kvtier.storage.page_format import (
    HEADER_SIZE,
    buffer_of,
    make_header,
    payload_length,
    verify,
)
from kvtier.storage.segments import SegmentBackend, SegmentBackendConfig
from kvtier.storage.segments.io import IOV_MAX, remaining
from kvtier.storage.segments.root import open_root

__all__ = ["FileBackend", "FileBackendConfig", "FilePerPageBackend", "FilePerPageConfig"]

log = logging.getLogger(__name__)

_SUFFIX = ".kvp"
_TMP_SUFFIX = ".tmp"
_TMP_NAME = re.compile(r"(?P<key>.+)\.kvp\.(?P<tag>[^/]+)\.tmp")
_OUR_TAG = re.compile(r"(?P<token>[0-9a-f]{12})-(?P<pid>[1-9][0-9]*)-[0-9]+-[0-9]+")
_BAD = object()  # a read whose object failed verification (a checksum miss)
_FOREIGN = object()  # something other than a regular file at a page's name: never ours to serve
# A read never follows a symlink and never blocks opening a FIFO or device; a temp file is
# always a new entry (O_EXCL fails on anything already there, a symlink included).
_OPEN_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_OPEN_TMP = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


def _writer_token() -> str:
    """12 hex chars naming this kernel boot and PID namespace: a pid in a temp file's name can
    only be checked with ``kill(pid, 0)`` by a process that shares both."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        # Unknowable: a token of our own makes every other writer's temp files wait for the age.
        return os.urandom(6).hex()
    try:
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return os.urandom(6).hex()
    return hashlib.sha256(f"{boot}:{pid_ns}".encode()).hexdigest()[:12]


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists (in this PID namespace)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, as another user's process
        return True
    return True


@dataclass(frozen=True)
class FilePerPageConfig:
    """Attributes:
    root: directory of page files (created with ``dir_mode`` if missing; its parents with the
        umask's defaults).
    capacity_bytes: most bytes of page files kept (headers included); ``None`` for no limit.
    fsync: fsync each file before the rename (durable across power loss; slower).
    read_threads, write_threads: threads that move one batch's pages (the caller's and the
        rest pooled): file syscalls release the GIL, so one thread's IO overlaps another's
        checksumming. Two readers gain on ext4 and tmpfs; two writers gain on tmpfs but were
        3x slower for 2 MiB pages on ext4 here (profiling/results/bench_storage.md), so writes
        default to one.
    dir_mode: permission bits of a root this backend creates (exactly, whatever the umask); an
        existing root may not be writable by more users than these bits allow. Must include
        ``0o700``. For a root shared by a group of users (TP ranks under several accounts), e.g.
        ``0o770`` with ``file_mode=0o660``.
    file_mode: permission bits of each page file (exactly, whatever the umask); must include
        ``0o600``.
    allow_unsafe_root: accept an existing root that other users can write into (more write bits
        than ``dir_mode``, or owned by another user), logging a warning, instead of refusing it.
    stale_tmp_s: at start-up, temp files older than this are deleted whoever wrote them; younger
        ones only when their writer is known dead.
    """

    root: str | os.PathLike[str]
    capacity_bytes: int | None = None
    fsync: bool = False
    read_threads: int = 2
    write_threads: int = 1
    dir_mode: int = 0o700
    file_mode: int = 0o600
    allow_unsafe_root: bool = False
    stale_tmp_s: float = 3600.0

    def __post_init__(self) -> None:
        for name in ("read_threads", "write_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive or None, got {self.capacity_bytes}")
        check_modes(self)
        if not self.stale_tmp_s > 0:
            raise ValueError(f"stale_tmp_s must be positive, got {self.stale_tmp_s}")


class FilePerPageBackend(StorageBackend):
    """Page objects as files in one directory; see the module docstring for the format and rules."""

    name = "file_per_page"
    Config = FilePerPageConfig

    def __init__(
        self,
        config: FilePerPageConfig,
        *,
        scope: KeyScope | None = None,
        metrics: TierMetrics | None = None,
    ):
        super().__init__(scope=scope, metrics=metrics)
        self.config = config
        self.root = Path(config.root)
        self._mutex = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, LRU first
        self._stored = 0  # bytes of the files in the index
        self._reserved = 0  # bytes reserved by writes in flight
        self._tmp_ids = itertools.count()
        self._token = _writer_token()
        self._pool: ThreadPoolExecutor | None = None
        self._dirfd = self._open_root()
        try:
            self._scan()
        except BaseException:
            os.close(self._dirfd)
            self._dirfd = -1
            raise

    def _open_root(self) -> int:
        """Create the root (mode ``dir_mode``) or check the existing one; its descriptor."""
        return open_root(self.root, self.config.dir_mode, self.config.allow_unsafe_root)

    # -- index ---------------------------------------------------------------------------------

    def _scan(self) -> None:
        """Index the regular page files of the root (oldest first); delete dead writers' temps."""
        found: list[tuple[float, str, int]] = []
        now = time.time()
        with os.scandir(self._dirfd) as entries:
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue  # gone since the listing
                if not stat.S_ISREG(st.st_mode):
                    continue  # a symlink, FIFO, directory, device: never ours
                if e.name.endswith(_TMP_SUFFIX):
                    if self._stale_tmp(e.name, now - st.st_mtime):
                        self._unlink(e.name)
                elif e.name.endswith(_SUFFIX) and st.st_size >= HEADER_SIZE:
                    key = e.name[: -len(_SUFFIX)]
                    if self._valid_key(key):
                        found.append((st.st_mtime, key, st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._stored += size

    def _stale_tmp(self, name: str, age_s: float) -> bool:
        """Whether ``name`` is one of our temp files whose writer will never finish it."""
        m = _TMP_NAME.fullmatch(name)
        if m is None or not self._valid_key(m["key"]):
            return False  # not a temp file of this store
        if age_s > self.config.stale_tmp_s:
            return True
        ours = _OUR_TAG.fullmatch(m["tag"])
        # Another boot or PID namespace (or an older naming) cannot be checked: wait for the age.
        return ours is not None and ours["token"] == self._token and not _alive(int(ours["pid"]))

    @staticmethod
    def _valid_key(key: str) -> bool:
        try:
            validate_key(key)
        except ValueError:
            return False
        return True

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key + _SUFFIX)

    def _forget(self, key: str) -> None:
        """Drop ``key`` from the index and the disk (a bad or vanished file)."""
        self._drop(key)
        self._unlink(key + _SUFFIX)

    def _reserve(self, size: int) -> list[str] | None:
        """Reserve ``size`` bytes, evicting LRU keys; returns those keys (files to unlink), or None."""
        cap = self.config.capacity_bytes
        if cap is not None and size > cap:
            return None
        victims = []
        while cap is not None and self._stored + self._reserved + size > cap and self._index:
            key, vsize = self._index.popitem(last=False)
            self._stored -= vsize
            victims.append(key)
        if cap is not None and self._stored + self._reserved + size > cap:
            return None  # the rest is reserved by writes in flight
        self._reserved += size
        return victims

    # -- StorageBackend ----------------------------------------------------------------------------

    def _lookup(self, object_keys: list[str], touch: bool) -> list[int | None]:
        """File size per key, from the index, else from the directory (files other processes
        wrote since start-up, e.g. rank 0's replicated pages), which are then indexed. Only a
        regular file of at least a header's size counts; an index entry may be stale."""
        with self._mutex:
            sizes = [self._index.get(k) for k in object_keys]
            if touch:
                for k, size in zip(object_keys, sizes):
                    if size is not None:
                        self._index.move_to_end(k)
        found = {}
        for i, (k, size) in enumerate(zip(object_keys, sizes)):
            if size is None:
                try:
                    st = os.stat(k + _SUFFIX, dir_fd=self._dirfd, follow_symlinks=False)
                except OSError:
                    continue
                if stat.S_ISREG(st.st_mode) and st.st_size >= HEADER_SIZE:
                    sizes[i] = found[k] = st.st_size
        if found:
            with self._mutex:
                for k, size in found.items():
                    if k not in self._index:
                        self._index[k] = size
                        self._stored += size
        return sizes

    def _contains(self, object_keys: list[str]) -> list[bool]:
        return [size is not None for size in self._lookup(object_keys, touch=False)]

    def _map(self, fn: Callable[[int, int], list], n: int, threads: int) -> list:
        """``fn(lo, hi)`` over ``[0, n)`` in ``threads`` contiguous chunks (the caller's thread
        takes the first), concatenated in order. The GIL is released in every syscall, so one
        thread's file IO overlaps another's hashing and Python work."""
        k = min(threads, n)
        if k <= 1:
            return fn(0, n)
        if self._pool is None:
            with self._mutex:
                if self._pool is None:
                    most = max(self.config.read_threads, self.config.write_threads)
                    self._pool = ThreadPoolExecutor(most - 1, thread_name_prefix="kvtier-file-io")
        bounds = [n * i // k for i in range(k + 1)]
        futures = [self._pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, k)]
        try:
            out = fn(bounds[0], bounds[1])
        finally:
            wait(futures)  # no thread may still touch the page buffers once this returns
        for f in futures:
            out += f.result()
        return out

    def _read(self, object_keys: list[str], pages: list[Parts]) -> list[bool | None]:
        sizes = self._lookup(object_keys, touch=True)

        def read(lo: int, hi: int) -> list[bool | None]:
            header = bytearray(HEADER_SIZE)
            hview = memoryview(header)
            return [
                self._read_one(object_keys[i], pages[i], sizes[i], header, hview)
                for i in range(lo, hi)
            ]

        got = self._map(read, len(object_keys), self.config.read_threads)
        out, bad = [], 0
        for key, ok in zip(object_keys, got):
            if ok is None:  # vanished since the lookup
                self._forget(key)
                out.append(False)
            elif ok is _FOREIGN:  # not ours: leave it where it is, but stop answering for it
                self._drop(key)
                out.append(False)
            elif ok is _BAD:
                bad += 1
                self._forget(key)
                out.append(False)
            else:
                out.append(ok)
        if bad:
            self.metrics.add_checksum_miss(bad)
        return out

    def _read_one(
        self, key: str, page: Parts, size: int | None, header: bytearray, hview: memoryview
    ) -> object:
        """Read one object into ``page``: True, False (absent, an IO error, or another size: not
        ours to judge), ``_BAD`` (failed verification), ``_FOREIGN`` (not a regular file) or None
        (vanished since the lookup)."""
        if size is None:
            return False
        parts = [buffer_of(p) for p in page]
        want = HEADER_SIZE + (parts[0].nbytes if len(parts) == 1 else sum(p.nbytes for p in parts))
        try:
            fd = os.open(key + _SUFFIX, _OPEN_READ, dir_fd=self._dirfd)
        except FileNotFoundError:
            return None
        except OSError as e:
            # ELOOP: a symlink, which O_NOFOLLOW refuses; anything else is an IO error.
            return _FOREIGN if e.errno == errno.ELOOP else False
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                return _FOREIGN
            if st.st_size != want:
                # A whole object of another size: the caller's buffer is wrong; else a torn one.
                return False if self._self_consistent(fd, st.st_size) else _BAD
            iovecs = [hview, *parts]
            got = os.readv(fd, iovecs[:IOV_MAX])  # a page may have more parts than one call takes
            while got < want:  # short reads are rare on regular files but legal
                n = os.readv(fd, remaining(iovecs, got)[:IOV_MAX])
                if n == 0:
                    return _BAD
                got += n
        except OSError:
            return False  # an IO error: not served, not a checksum miss
        finally:
            os.close(fd)
        return True if verify(header, key, parts) else _BAD

    @staticmethod
    def _self_consistent(fd: int, size: int) -> bool:
        """Whether the open file's header declares exactly the payload the file holds."""
        try:
            return payload_length(os.pread(fd, HEADER_SIZE, 0)) == size - HEADER_SIZE
        except OSError:
            return False

    def _write(self, object_keys: list[str], pages: list[Parts]) -> list[bool]:
        n = len(object_keys)
        out = [False] * n
        sizes = [HEADER_SIZE + sum(p.nbytes for p in page) for page in pages]
        todo: list[int] = []
        same: list[tuple[int, int]] = []  # (i, j): page i repeats the key of page j in this batch
        victims: list[str] = []
        with self._mutex:  # one index pass and one reservation pass per batch
            first: dict[str, int] = {}
            for i, key in enumerate(object_keys):
                if key in self._index:
                    self._index.move_to_end(key)
                    out[i] = True
                elif key in first:
                    same.append((i, first[key]))
                else:
                    evict = self._reserve(sizes[i])
                    if evict is not None:
                        victims += evict
                        first[key] = i
                        todo.append(i)
        for key in victims:
            self._unlink(key + _SUFFIX)
        done: list[bool] = []
        try:
            tag = f"{self._token}-{os.getpid()}-{next(self._tmp_ids)}-"

            def write(lo: int, hi: int) -> list[bool]:
                return [
                    self._write_one(object_keys[todo[j]], pages[todo[j]], f"{tag}{j}")
                    for j in range(lo, hi)
                ]

            done = self._map(write, len(todo), self.config.write_threads)
        finally:
            with self._mutex:
                for j, i in enumerate(todo):
                    self._reserved -= sizes[i]
                    ok = j < len(done) and done[j]
                    if ok and object_keys[i] not in self._index:
                        self._index[object_keys[i]] = sizes[i]
                        self._stored += sizes[i]
                    out[i] = ok
        for i, j in same:
            out[i] = out[j]
        return out

    def _write_one(self, key: str, page: Parts, unique: str) -> bool:
        """Write one object: a temp file (header and payload in one ``writev``), then rename."""
        parts = [buffer_of(p) for p in page]
        iovecs = [memoryview(make_header(key, parts)), *parts]
        want = sum(v.nbytes for v in iovecs)
        name = key + _SUFFIX
        tmp = f"{name}.{unique}{_TMP_SUFFIX}"
        d = self._dirfd
        try:
            fd = os.open(tmp, _OPEN_TMP, self.config.file_mode, dir_fd=d)
            try:
                os.fchmod(fd, self.config.file_mode)  # exactly, whatever the umask took away
                done = os.writev(fd, iovecs[:IOV_MAX])  # at most IOV_MAX parts a call
                while done < want:  # a short write (full disk, signal): write the rest
                    done += os.writev(fd, remaining(iovecs, done)[:IOV_MAX])
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            # Replaces a symlink or FIFO at ``name`` itself (never its target); fails on a
            # directory, so that page is reported failed.
            os.replace(tmp, name, src_dir_fd=d, dst_dir_fd=d)
            return True
        except OSError:
            self._unlink(tmp)
            return False

    def _drop(self, key: str) -> None:
        """Drop ``key`` from the index only (whatever sits at its name is not ours to delete)."""
        with self._mutex:
            size = self._index.pop(key, None)
            if size is not None:
                self._stored -= size

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dirfd)
        except FileNotFoundError:
            pass
        except OSError as e:  # e.g. a directory now stands there: nothing of ours to remove
            log.warning("file backend: could not remove %r in %s: %s", name, self.root, e)

    def _delete(self, object_keys: list[str]) -> list[bool]:
        """Unlink each key's page file (never following a symlink); a key with no file is gone
        already."""
        out = []
        for key in object_keys:
            self._drop(key)
            try:
                os.unlink(key + _SUFFIX, dir_fd=self._dirfd)
                out.append(True)
            except FileNotFoundError:
                out.append(True)
            except OSError as e:  # a read-only root, or a directory standing at the name
                log.warning("file backend: could not remove %r in %s: %s", key, self.root, e)
                out.append(False)
        return out

    def clear(self) -> None:
        """Delete every page file in the index (writes still in flight may land afterwards)."""
        with self._mutex:
            keys = list(self._index)
            self._index.clear()
            self._stored = 0
        for key in keys:
            self._unlink(key + _SUFFIX)

    def close(self) -> None:
        """Stop the IO threads and close the directory; the backend is unusable afterwards."""
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        if self._dirfd >= 0:
            os.close(self._dirfd)
            self._dirfd = -1

    def __del__(self) -> None:
        fd = getattr(self, "_dirfd", -1)
        if fd >= 0:
            os.close(fd)

    @property
    def used_bytes(self) -> int:
        """Bytes of the indexed page files, headers included."""
        with self._mutex:
            return self._stored


FileBackend = SegmentBackend
"""The ``"file"`` backend: the segment store."""
FileBackendConfig = SegmentBackendConfig
