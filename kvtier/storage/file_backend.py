"""The embedded L3 backend: one file per page object in a local (or shared) directory.

File ``<root>/<object key>.kvp`` holds the 32-byte header then the page (``page_format``). Writes
go to ``<object key>.kvp.<unique>.tmp`` in the same directory and are renamed into place, so a
reader sees either no file or the whole file; temp files left by a crash are deleted at start-up.

Bytes move with ``os.writev`` / ``os.readv`` straight between the page buffers and the kernel: the
header and the page's parts are the iovecs of one syscall, with no Python-side copy.

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


@dataclass(frozen=True)
class FileBackendConfig:
    """Attributes:
    root: directory of page files (created if missing).
    capacity_bytes: most bytes of page files kept (headers included); ``None`` for no limit.
    fsync: fsync each file before the rename (durable across power loss; slower).
    """

    root: str | os.PathLike[str]
    capacity_bytes: int | None = None
    fsync: bool = False

    def __post_init__(self) -> None:
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
        Path(self._path(key)).unlink(missing_ok=True)

    def _reserve(self, size: int) -> list[str] | None:
        """Reserve ``size`` bytes, evicting LRU keys; returns their paths to unlink, or None."""
        cap = self.config.capacity_bytes
        if cap is not None and size > cap:
            return None
        victims = []
        while cap is not None and self._stored + self._reserved + size > cap and self._index:
            key, vsize = self._index.popitem(last=False)
            self._stored -= vsize
            victims.append(self._path(key))
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
                    sizes[i] = found[k] = os.stat(self._path(k)).st_size
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

    def _read(self, object_keys: list[str], pages: list[Parts]) -> list[bool]:
        sizes = self._lookup(object_keys, touch=True)
        header = bytearray(HEADER_SIZE)
        out = []
        bad = 0
        for key, page, size in zip(object_keys, pages, sizes):
            if size is None:
                out.append(False)
                continue
            parts = [buffer_of(p) for p in page]
            want = HEADER_SIZE + sum(p.nbytes for p in parts)
            if size != want and self._self_consistent(key, size):
                out.append(False)  # a whole object of another size: the caller's buffer is wrong
                continue
            ok = size == want and self._read_file(key, [memoryview(header), *parts])
            if ok is None:  # evicted or cleared since the index lookup
                self._forget(key)
                out.append(False)
                continue
            ok = ok and verify(header, key, parts)
            if not ok:
                bad += 1
                self._forget(key)
            out.append(ok)
        if bad:
            self.metrics.add_checksum_miss(bad)
        return out

    def _self_consistent(self, key: str, size: int) -> bool:
        """Whether the file's header declares exactly the payload the file holds."""
        try:
            with open(self._path(key), "rb") as f:
                return payload_length(f.read(HEADER_SIZE)) == size - HEADER_SIZE
        except OSError:
            return False

    def _read_file(self, key: str, iovecs: list[memoryview]) -> bool | None:
        """Fill ``iovecs`` (header, then payload parts) from the file; None if it is missing."""
        try:
            fd = os.open(self._path(key), os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            want = sum(v.nbytes for v in iovecs)
            got = os.readv(fd, iovecs)
            while got < want:  # short reads are rare on regular files but legal
                n = os.readv(fd, _after(iovecs, got))
                if n == 0:
                    return False
                got += n
        finally:
            os.close(fd)
        return True

    def _write(self, object_keys: list[str], pages: list[Parts]) -> list[bool]:
        out = []
        for key, page in zip(object_keys, pages):
            parts = [buffer_of(p) for p in page]
            size = HEADER_SIZE + sum(p.nbytes for p in parts)
            with self._mutex:
                if key in self._index:
                    self._index.move_to_end(key)
                    out.append(True)
                    continue
                victims = self._reserve(size)
            if victims is None:
                out.append(False)
                continue
            for path in victims:
                Path(path).unlink(missing_ok=True)
            ok = self._write_file(key, [memoryview(make_header(key, parts)), *parts])
            with self._mutex:
                self._reserved -= size
                if ok and key not in self._index:
                    self._index[key] = size
                    self._stored += size
            out.append(ok)
        return out

    def _write_file(self, key: str, iovecs: list[memoryview]) -> bool:
        path = self._path(key)
        tmp = f"{path}.{os.getpid()}-{threading.get_ident()}-{next(self._tmp_ids)}{_TMP_SUFFIX}"
        want = sum(v.nbytes for v in iovecs)
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            try:
                done = os.writev(fd, iovecs)
                while done < want:  # a short write (full disk, signal): write the rest
                    done += os.writev(fd, _after(iovecs, done))
                if self.config.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
            return True
        except OSError:
            Path(tmp).unlink(missing_ok=True)
            return False

    def clear(self) -> None:
        """Delete every page file in the index (writes still in flight may land afterwards)."""
        with self._mutex:
            keys = list(self._index)
            self._index.clear()
            self._stored = 0
        for key in keys:
            Path(self._path(key)).unlink(missing_ok=True)

    @property
    def used_bytes(self) -> int:
        """Bytes of the indexed page files, headers included."""
        with self._mutex:
            return self._stored
