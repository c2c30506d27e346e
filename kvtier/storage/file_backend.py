"""The embedded L3 backend: one file per page object in a local (or shared) directory.

File ``<root>/<object key>.kvp`` holds the 32-byte header then the page (``page_format``). Writes
go to ``<object key>.kvp.<unique>.tmp`` in the same directory and are renamed into place, so a
reader sees either no file or the whole file; temp files left by a crash are deleted at start-up.

Bytes move with ``os.writev`` / ``os.readv`` straight between the page buffers and the kernel: the
header and the page's parts are the iovecs of one syscall, with no Python-side copy. Per page a
write costs open, writev, close and rename, a read open, readv and close, all relative to one
directory descriptor; the index is locked once per batch, not per page. A batch's pages may be
split over ``read_threads`` / ``write_threads`` threads.

Existence is answered from an in-memory index (key -> size, in least-recently-used order) built by
scanning the directory at start-up (oldest mtime first). A key the index lacks costs one ``stat``,
so files that other processes sharing the directory wrote later (TP ranks, a producer) are found
and indexed. ``get`` refreshes a key's recency; ``exists`` does not. With ``capacity_bytes`` set,
a write first evicts least-recently-used files until the new file fits; each process enforces it
over the files it knows. One mutex guards the index; file IO runs outside it.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

from kvtier.storage.base import Parts, StorageBackend
from kvtier.storage.keys import KeyScope
from kvtier.storage.metrics import StorageMetrics
from kvtier.storage.page_format import (
    HEADER_SIZE,
    buffer_of,
    make_header,
    payload_length,
    verify,
)

__all__ = ["FileBackend", "FileBackendConfig"]

_SUFFIX = ".kvp"
_TMP_SUFFIX = ".tmp"
_BAD = object()  # a read whose object failed verification (a checksum miss)


@dataclass(frozen=True)
class FileBackendConfig:
    """Attributes:
    root: directory of page files (created if missing).
    capacity_bytes: most bytes of page files kept (headers included); ``None`` for no limit.
    fsync: fsync each file before the rename (durable across power loss; slower).
    read_threads, write_threads: threads that move one batch's pages (the caller's and the
        rest pooled): file syscalls release the GIL, so one thread's IO overlaps another's
        checksumming. Two readers gain on ext4 and tmpfs; two writers gain on tmpfs but were
        3x slower for 2 MiB pages on ext4 here (profiling/results/bench_storage.md), so writes
        default to one.
    """

    root: str | os.PathLike[str]
    capacity_bytes: int | None = None
    fsync: bool = False
    read_threads: int = 2
    write_threads: int = 1

    def __post_init__(self) -> None:
        for name in ("read_threads", "write_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.capacity_bytes is not None and self.capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive or None, got {self.capacity_bytes}")


def _after(iovecs: list[memoryview], done: int) -> list[memoryview]:
    """The parts of ``iovecs`` still to move once the first ``done`` bytes have moved."""
    rest = []
    for v in iovecs:
        if done >= v.nbytes:
            done -= v.nbytes
        else:
            rest.append(v[done:])
            done = 0
    return rest


class FileBackend(StorageBackend):
    """Page objects as files in one directory; see the module docstring for the format and rules."""

    name = "file"
    Config = FileBackendConfig

    def __init__(
        self,
        config: FileBackendConfig,
        *,
        scope: KeyScope | None = None,
        metrics: StorageMetrics | None = None,
    ):
        super().__init__(scope=scope, metrics=metrics)
        self.config = config
        self.root = Path(config.root)
        self.root.mkdir(parents=True, exist_ok=True)
        self._mutex = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> file size, LRU first
        self._stored = 0  # bytes of the files in the index
        self._reserved = 0  # bytes reserved by writes in flight
        self._tmp_ids = itertools.count()
        self._pool: ThreadPoolExecutor | None = None
        self._dirfd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
        self._scan()

    # -- index ---------------------------------------------------------------------------------

    def _scan(self) -> None:
        found: list[tuple[float, str, int]] = []
        with os.scandir(self.root) as entries:
            for e in entries:
                if e.name.endswith(_TMP_SUFFIX):
                    Path(e.path).unlink(missing_ok=True)
                elif e.name.endswith(_SUFFIX) and e.is_file():
                    st = e.stat()
                    found.append((st.st_mtime, e.name[: -len(_SUFFIX)], st.st_size))
        for _, key, size in sorted(found):
            self._index[key] = size
            self._stored += size

    def _path(self, key: str) -> str:
        return os.path.join(self.root, key + _SUFFIX)

    def _forget(self, key: str) -> None:
        """Drop ``key`` from the index and the disk (a bad or vanished file)."""
        with self._mutex:
            size = self._index.pop(key, None)
            if size is not None:
                self._stored -= size
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
        wrote since start-up, e.g. rank 0's replicated pages), which are then indexed."""
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
                    sizes[i] = found[k] = os.stat(k + _SUFFIX, dir_fd=self._dirfd).st_size
                except OSError:
                    pass
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
            return [self._read_one(object_keys[i], pages[i], sizes[i], header, hview)
                    for i in range(lo, hi)]

        got = self._map(read, len(object_keys), self.config.read_threads)
        out, bad = [], 0
        for key, ok in zip(object_keys, got):
            if ok is None:  # a bad object (counted) or one that vanished since the lookup
                self._forget(key)
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

    def _read_one(self, key: str, page: Parts, size: int | None, header: bytearray,
                  hview: memoryview) -> object:
        """Read one object into ``page``: True, False (absent, or another size: not ours to
        judge), ``_BAD`` (failed verification) or None (vanished since the lookup)."""
        if size is None:
            return False
        parts = [buffer_of(p) for p in page]
        want = HEADER_SIZE + (parts[0].nbytes if len(parts) == 1 else sum(p.nbytes for p in parts))
        if size != want:
            # A whole object of another size: the caller's buffer is wrong; else a torn one.
            return False if self._self_consistent(key, size) else _BAD
        try:
            fd = os.open(key + _SUFFIX, os.O_RDONLY, dir_fd=self._dirfd)
        except FileNotFoundError:
            return None
        try:
            iovecs = [hview, *parts]
            got = os.readv(fd, iovecs)
            while got < want:  # short reads are rare on regular files but legal
                n = os.readv(fd, _after(iovecs, got))
                if n == 0:
                    return _BAD
                got += n
        except OSError:
            return False  # an IO error: not served, not a checksum miss
        finally:
            os.close(fd)
        return True if verify(header, key, parts) else _BAD

    def _self_consistent(self, key: str, size: int) -> bool:
        """Whether the file's header declares exactly the payload the file holds."""
        try:
            fd = os.open(key + _SUFFIX, os.O_RDONLY, dir_fd=self._dirfd)
        except OSError:
            return False
        try:
            return payload_length(os.read(fd, HEADER_SIZE)) == size - HEADER_SIZE
        except OSError:
            return False
        finally:
            os.close(fd)

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
            tag = f"{os.getpid()}-{next(self._tmp_ids)}-"

            def write(lo: int, hi: int) -> list[bool]:
                return [self._write_one(object_keys[todo[j]], pages[todo[j]], f"{tag}{j}")
                        for j in range(lo, hi)]

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
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=d)
            try:
                done = os.writev(fd, iovecs)
                while done < want:  # a short write (full disk, signal): write the rest
                    done += os.writev(fd, _after(iovecs, done))
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=d, dst_dir_fd=d)
            return True
        except OSError:
            self._unlink(tmp)
            return False

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dirfd)
        except FileNotFoundError:
            pass

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
