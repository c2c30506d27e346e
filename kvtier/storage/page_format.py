"""The bytes of one stored page object: a 32-byte header, then the page payload unchanged.

A payload may arrive in parts (a page's K range and V range in a page_first host pool): the object
is their concatenation, and the checksum covers it as one stream.

Header (little-endian)::

    offset size field
    0      4    magic  b"KVTP"
    4      1    format version (1)
    5      1    checksum algorithm (1 = XXH3-64, 2 = CRC-32)
    6      2    reserved, zero
    8      8    payload length in bytes
    16     8    digest of the object key (same algorithm), so a file renamed under another key fails
    24     8    checksum of the payload

XXH3-64 (package ``xxhash``) runs at about 24 GB/s on one core here, against 3.6 GB/s for
``zlib.crc32``: at disk and loopback speeds CRC-32 would cost a quarter of the bandwidth, XXH3
a few percent. Without ``xxhash`` pages are written with CRC-32; the algorithm byte lets a reader
check either (a page whose algorithm the reader lacks counts as a checksum miss).
"""

from __future__ import annotations

import ctypes
import itertools
import operator
import struct
import threading
import zlib
from collections.abc import Callable, Iterable, Sequence

import numpy as np
import torch

from kvtier.storage.spans import SpanPages

Buffer = bytes | bytearray | memoryview

__all__ = [
    "HEADER_SIZE",
    "XXH3",
    "PageViews",
    "Xxh3Stream",
    "buffer_of",
    "buffers_of",
    "checksum_matches",
    "make_header",
    "payload_checksum",
    "payload_length",
    "verify",
    "xxh3_stream",
]

HEADER_SIZE = 32
_MAGIC = b"KVTP"
_VERSION = 1
_XXH3, _CRC32 = 1, 2
_HEADER = struct.Struct("<4sBBHQQQ")
assert _HEADER.size == HEADER_SIZE


def _crc32(parts: Sequence[Buffer]) -> int:
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    return crc


_ALGORITHMS: dict[int, Callable[[Sequence[Buffer]], int]] = {_CRC32: _crc32}
try:
    import xxhash

    def _xxh3_nogil() -> Callable[[int, int], int] | None:
        """XXH3-64 of ``(address, length)`` through ``ctypes``, which releases the GIL during
        the call; None where the binding's library does not export it or disagrees with it.

        Why: the binding keeps the GIL for inputs up to 64 KiB, so two threads cannot checksum
        64 KiB pages at once; through ``ctypes`` one thread's checksum overlaps the other's
        Python work (a page costs a few hundred ns more to call). A run's one-part pages
        (``PageViews.checksums``) go to the binding all the same: there the call measured
        dearer than the GIL hold."""
        try:
            fn = ctypes.CDLL(xxhash._xxhash.__file__).XXH3_64bits_dispatch
        except (OSError, AttributeError):
            return None
        fn.restype, fn.argtypes = ctypes.c_uint64, (ctypes.c_void_p, ctypes.c_size_t)
        for n in (1, 3, 17, 129, 240, 241, 1000, 65536, 100_003):
            probe = (ctypes.c_ubyte * n).from_buffer_copy(bytes(i * 7 % 251 for i in range(n)))
            if fn(ctypes.addressof(probe), n) != xxhash.xxh3_64_intdigest(probe):
                return None
        return fn

    _NOGIL = _xxh3_nogil()
    _from_buffer = ctypes.c_char.from_buffer
    _addressof = ctypes.addressof

    def _xxh3_stream_api() -> tuple[Callable[..., int], ...] | None:
        """The binding library's streaming XXH3-64 calls (create, free, reset, update, digest)
        through ``ctypes`` (GIL-free), or None where they are missing or disagree with the
        binding's one-shot digest (checked on inputs fed in uneven pieces)."""
        if _NOGIL is None:
            return None
        try:
            lib = ctypes.CDLL(xxhash._xxhash.__file__)
            create, free = lib.XXH3_createState, lib.XXH3_freeState
            reset, digest = lib.XXH3_64bits_reset, lib.XXH3_64bits_digest
            update = getattr(lib, "XXH3_64bits_update_dispatch", None) or lib.XXH3_64bits_update
        except (OSError, AttributeError):
            return None
        vp, size = ctypes.c_void_p, ctypes.c_size_t
        create.restype, create.argtypes = vp, ()
        free.restype, free.argtypes = ctypes.c_int, (vp,)
        reset.restype, reset.argtypes = ctypes.c_int, (vp,)
        update.restype, update.argtypes = ctypes.c_int, (vp, vp, size)
        digest.restype, digest.argtypes = ctypes.c_uint64, (vp,)
        state = create()
        if not state:
            return None
        try:
            for n in (1, 240, 241, 1000, 65536, 300_007):
                data = (ctypes.c_ubyte * n).from_buffer_copy(bytes(i * 13 % 251 for i in range(n)))
                reset(state)
                at, base = 0, ctypes.addressof(data)
                for piece in (7, 1024, 65536, n):  # uneven pieces cross the stripe boundaries
                    take = min(piece, n - at)
                    update(state, base + at, take)
                    at += take
                if at != n or digest(state) != xxhash.xxh3_64_intdigest(data):
                    return None
        finally:
            free(state)
        return create, free, reset, update, digest

    _STREAM = _xxh3_stream_api()

    def _xxh3_one(part: Buffer) -> int:
        """XXH3-64 of one buffer; without the GIL where possible (a writable, contiguous, non-empty
        one: ``part`` keeps the memory alive through the call)."""
        if (
            _NOGIL is not None
            and isinstance(part, memoryview)
            and part.nbytes
            and not part.readonly
            and part.c_contiguous
        ):
            return _NOGIL(_addressof(_from_buffer(part)), part.nbytes)
        return xxhash.xxh3_64_intdigest(part)

    def _xxh3(parts: Sequence[Buffer]) -> int:
        if len(parts) == 1:
            return _xxh3_one(parts[0])
        if all(isinstance(p, memoryview) for p in parts):
            stream = xxh3_stream(parts)  # GIL-free (a page_first page's K and V ranges)
            if stream is not None:
                for p in parts:
                    stream.update(p)  # type: ignore[arg-type]
                return stream.digest()
        h = xxhash.xxh3_64()
        for part in parts:
            h.update(part)
        return h.intdigest()

    _ALGORITHMS[_XXH3] = _xxh3
    _DEFAULT = _XXH3
except ImportError:  # pragma: no cover - depends on the environment
    _DEFAULT = _CRC32
    _NOGIL = None
    _STREAM = None


class Xxh3Stream:
    """XXH3-64 of a payload fed in pieces, without the GIL: a piece can be hashed right after it
    was read or before it is written, while it is still in the core's cache.

    By address through ``ctypes`` where the binding library exports the streaming calls;
    elsewhere (xxhash builds that hide them, such as the GPU machine's 4.0.1) through the
    binding's own hasher object, whose ``update`` also runs without the GIL. One per thread
    (``xxh3_stream``); the memory fed must stay alive through each ``update``.
    """

    __slots__ = ("_api", "_hasher", "_state")

    def __init__(self) -> None:
        self._api = _STREAM  # the calls this stream was made with, for its whole life
        self._state = None
        self._hasher = None
        if self._api is None:
            self._hasher = xxhash.xxh3_64()
            return
        self._state = self._api[0]()
        if not self._state:
            raise MemoryError("XXH3_createState failed")

    @property
    def by_address(self) -> bool:
        """Whether pieces are hashed by address (``ctypes``), which needs writable views."""
        return self._hasher is None

    def reset(self) -> None:
        if self._hasher is not None:
            self._hasher.reset()
        else:
            self._api[2](self._state)  # type: ignore[index]

    def update(self, part: memoryview) -> None:
        """Hash ``part`` next: a contiguous memoryview (writable where ``by_address``)."""
        if part.nbytes:
            if self._hasher is not None:
                self._hasher.update(part)
            else:
                self._api[3](self._state, _addressof(_from_buffer(part)), part.nbytes)  # type: ignore[index]

    def update_at(self, address: int, nbytes: int) -> None:
        """Hash ``nbytes`` at ``address`` next (``by_address`` streams only)."""
        self._api[3](self._state, address, nbytes)  # type: ignore[index]

    def digest(self) -> int:
        if self._hasher is not None:
            return self._hasher.intdigest()
        return self._api[4](self._state)  # type: ignore[index]

    def __del__(self) -> None:
        if getattr(self, "_state", None) and self._api is not None:
            self._api[1](self._state)


_streams = threading.local()


def xxh3_stream(parts: Sequence[memoryview]) -> Xxh3Stream | None:
    """This thread's ``Xxh3Stream``, reset, if it can hash ``parts`` (contiguous memoryviews,
    writable where the stream hashes by address) and pages are written with XXH3; else None (the
    caller hashes the whole payload the usual way). There is one per thread: its user finishes a
    digest before hashing another payload."""
    if _DEFAULT != _XXH3:
        return None
    for p in parts:
        if not p.c_contiguous or (p.readonly and _STREAM is not None):
            return None
    return _thread_stream()


def _thread_stream() -> Xxh3Stream:
    """This thread's ``Xxh3Stream``, reset; a new one if the streaming calls available changed
    since it was made (tests switch them)."""
    s = getattr(_streams, "s", None)
    if s is None or s._api is not _STREAM:
        s = _streams.s = Xxh3Stream()
    s.reset()
    return s


XXH3 = _XXH3
"""The algorithm byte of XXH3-64 (what ``Xxh3Stream`` computes)."""


def payload_checksum(parts: Sequence[memoryview]) -> tuple[int, int]:
    """(algorithm, checksum) of the payload ``parts`` (concatenated), with the default
    algorithm (XXH3-64 without the GIL where possible)."""
    return _DEFAULT, _ALGORITHMS[_DEFAULT](parts)


def checksum_matches(algorithm: int, checksum: int, parts: Sequence[memoryview]) -> bool:
    """Whether the payload ``parts`` hashes to ``checksum`` under ``algorithm`` (one this
    process lacks never matches)."""
    if algorithm == _DEFAULT == _XXH3 and len(parts) == 1:  # the read path's case: fewer calls
        return _xxh3_one(parts[0]) == checksum
    digest = _ALGORITHMS.get(algorithm)
    return digest is not None and digest(parts) == checksum


def buffer_of(page: torch.Tensor) -> memoryview:
    """A writable byte memoryview over a 1-D contiguous uint8 CPU tensor, sharing its memory."""
    return memoryview(page.numpy()).cast("B")


class PageViews:
    """Byte views of a batch's pages: ``views[i]`` is ``buffer_of`` of each part of page ``i``;
    ``iovecs`` gives several pages' bytes as few views as their memory allows, and ``checksum``
    hashes a page by address.

    Parts are 1-D contiguous uint8 CPU tensors (``StorageBackend`` checked them). A batch's pages
    are normally views into one host pool: every part's address and size is read once (two
    cheap calls per part), and when all of them lie inside the first part's storage (the common
    case) every view is a slice of one memoryview of that storage; other parts get a view of
    their own storage. Pages next to each other in memory come out as one view (``iovecs``), so a
    run of a host pool's consecutive pages is one iovec, and a page is hashed by its address
    (``checksum``) with no view at all, or a run's one-part pages through a view each
    (``checksums``). The views share the caller's memory and are valid while the caller holds
    its tensors: for the duration of the call that passes them in. Several threads may use one
    ``PageViews``.
    """

    def __init__(self, pages: Sequence[Sequence[torch.Tensor]]) -> None:
        if isinstance(pages, SpanPages):
            self._from_spans(pages)
            return
        self._pages = pages
        # C loops (map) where a batch's parts are walked: ~0.1 us a part against ~0.4.
        self._counts = list(map(len, pages))
        flat = list(itertools.chain.from_iterable(pages))
        self._single = self._counts.count(1) == len(pages)  # one part each: part k is page k
        self._first = None if self._single else [0, *itertools.accumulate(self._counts)]
        self._ptrs = list(map(torch.Tensor.data_ptr, flat))
        self._sizes = list(map(torch.Tensor.numel, flat))
        # Region of each part: (address of a view's first byte, the view); a part whose bytes
        # lie in the first part's storage shares its region (the storage stays referenced here
        # while the views exist, as does every other region's).
        self._keep: list[torch.UntypedStorage] = []
        self._regions: list[tuple[int, memoryview]] = []
        self._region: list[int] = []
        if flat:
            lo, hi = self._add_region(flat[0].untyped_storage())
            ptrs, sizes = self._ptrs, self._sizes
            if lo <= min(ptrs) and max(map(operator.add, ptrs, sizes)) <= hi:
                self._region = [0] * len(flat)  # all inside: the common case, in C loops
            else:
                inside = [n == 0 or (lo <= a and a + n <= hi) for a, n in zip(ptrs, sizes)]
                known = {(lo, hi - lo): 0}
                for k, p in enumerate(flat):
                    self._region.append(0 if inside[k] else self._region_of(p, known))

    def _from_spans(self, pages: SpanPages) -> None:
        """The views of pages given as byte ranges of host buffers: addresses and sizes from
        their arrays (no tensor per page); each buffer's storage is a region."""
        self._pages = pages
        self._counts = [n for c in pages.chunks for n in itertools.repeat(len(c.sizes), len(c))]
        self._single = all(len(c.sizes) == 1 for c in pages.chunks)
        self._first = None if self._single else [0, *itertools.accumulate(self._counts)]
        self._keep, self._regions, self._region = [], [], []
        known: dict[tuple[int, int], int] = {}
        self._ptrs, self._sizes = [], []
        for c in pages.chunks:
            self._region += [self._region_of(c.buffer, known)] * c.offsets.size
            self._ptrs += (c.offsets + c.buffer.data_ptr()).ravel().tolist()
            self._sizes += list(c.sizes) * len(c)

    def _region_of(self, part: torch.Tensor, known: dict[tuple[int, int], int]) -> int:
        """The region of ``part``'s storage, added on first sight. Keyed by address and length:
        two storages may start at one address (views of one mapping), and a region must hold
        all of each part it serves."""
        storage = part.untyped_storage()
        at = (storage.data_ptr(), storage.nbytes())
        r = known.get(at)
        if r is None:
            r = known[at] = len(self._regions)
            self._add_region(storage)
        return r

    def _add_region(self, storage: torch.UntypedStorage) -> tuple[int, int]:
        """A view of all of ``storage`` by address (no torch call per part: cheaper, and it never
        gives up the GIL mid-batch); its address range."""
        lo, n = storage.data_ptr(), storage.nbytes()
        raw = (ctypes.c_ubyte * n).from_address(lo) if n else bytearray()
        self._keep.append(storage)
        self._regions.append((lo, memoryview(raw).cast("B")))
        return lo, lo + n

    def __len__(self) -> int:
        return len(self._pages)

    def subset(self, pages: range) -> PageViews:
        """The views of ``pages`` (consecutive, step 1) as a ``PageViews`` of their own, page
        ``pages[0]`` its page 0; it shares this one's regions (no call per part)."""
        lo, hi = pages.start, pages.stop
        if pages.step != 1 or not 0 <= lo <= hi <= len(self._pages):
            raise ValueError(
                f"pages must be a range of step 1 within {len(self._pages)}, got {pages}"
            )
        out = PageViews.__new__(PageViews)
        a, b = (lo, hi) if self._single else (self._first[lo], self._first[hi])  # type: ignore[index]
        out._pages = self._pages[lo:hi]
        out._counts = self._counts[lo:hi]
        out._single = self._single
        out._first = None if self._single else [x - a for x in self._first[lo : hi + 1]]  # type: ignore[index]
        out._ptrs, out._sizes = self._ptrs[a:b], self._sizes[a:b]
        out._keep, out._regions, out._region = self._keep, self._regions, self._region[a:b]
        return out

    def single(self) -> bool:
        """Whether every page is one part (then part ``i`` is page ``i``)."""
        return self._single

    def addresses(self) -> list[int]:
        """Each part's address (shared with this object: not to be changed)."""
        return self._ptrs

    def counts(self) -> list[int]:
        """How many parts each page has (shared with this object: not to be changed)."""
        return self._counts

    def part_arrays(self, pages: Sequence[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The parts of ``pages``, in that order, as arrays: (start, address, size), page
        ``pages[i]``'s parts at ``start[i]`` .. ``start[i + 1] - 1`` (int64, one more than the
        pages; address and size uint64)."""
        sel = np.asarray(pages, dtype=np.int64)
        if self._single:
            first = np.arange(len(self._pages) + 1, dtype=np.int64)
        else:
            first = np.asarray(self._first, dtype=np.int64)
        counts = (first[1:] - first[:-1])[sel]
        start = np.zeros(len(sel) + 1, dtype=np.int64)
        np.cumsum(counts, out=start[1:])
        idx = np.repeat(first[sel] - start[:-1], counts) + np.arange(start[-1], dtype=np.int64)
        ptrs, sizes = self.address_arrays()
        return start, ptrs[idx], sizes[idx]

    def address_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """Each part's address and size as uint64 arrays, made once (not to be changed)."""
        arrays = self.__dict__.get("_arrays")
        if arrays is None:
            arrays = self._arrays = (
                np.asarray(self._ptrs, dtype=np.uint64),
                np.asarray(self._sizes, dtype=np.uint64),
            )
        return arrays

    def lengths(self) -> list[int]:
        """Each page's length in bytes (shared with this object: not to be changed)."""
        if self._single:
            return self._sizes
        sizes, first = self._sizes, self._first
        return [sum(sizes[first[i] : first[i + 1]]) for i in range(len(self._pages))]  # type: ignore[index]

    def _parts(self, i: int) -> range:
        return range(i, i + 1) if self._single else range(self._first[i], self._first[i + 1])  # type: ignore[index]

    def __getitem__(self, i: int) -> list[memoryview]:
        out = []
        for k in self._parts(i):
            base, view = self._regions[self._region[k]]
            start = self._ptrs[k] - base
            out.append(view[start : start + self._sizes[k]])
        return out

    def iovecs(self, pages: Iterable[int]) -> list[memoryview]:
        """The bytes of ``pages``, in that order, as views: parts that follow each other in one
        region's memory are one view; empty parts are left out."""
        out: list[memoryview] = []
        ptrs, sizes, region, regions = self._ptrs, self._sizes, self._region, self._regions
        r0 = start = end = -1
        parts = pages if self._single else (k for i in pages for k in self._parts(i))
        for k in parts:
            a, n, r = ptrs[k], sizes[k], region[k]
            if not n:
                continue
            if a == end and r == r0:
                end += n
                continue
            if start >= 0:
                base, view = regions[r0]
                out.append(view[start - base : end - base])
            r0, start, end = r, a, a + n
        if start >= 0:
            base, view = regions[r0]
            out.append(view[start - base : end - base])
        return out

    def checksum(self, i: int) -> tuple[int, int]:
        """``payload_checksum`` of page ``i``: by address where XXH3 runs without the GIL."""
        if _DEFAULT == _XXH3 and _NOGIL is not None:
            if self._single:
                n = self._sizes[i]
                if n:
                    return _XXH3, _NOGIL(self._ptrs[i], n)
            elif _STREAM is not None:
                stream = _thread_stream()
                for k in self._parts(i):
                    if self._sizes[k]:
                        stream.update_at(self._ptrs[k], self._sizes[k])
                return _XXH3, stream.digest()
        return payload_checksum(self[i])

    def checksums(self, pages: Iterable[int]) -> list[tuple[int, int]]:
        """``checksum`` of each of ``pages``, in a tight loop (a run's pages at once). One-part
        pages go to the binding as views: a call costs ~0.2 us against ~0.8 through ``ctypes``.
        The binding keeps the GIL for inputs up to 64 KiB, which measured cheaper than the
        ``ctypes`` call it saves (dev VM, 64 KiB pages, one IO thread: a warm get 0.6-0.9 us
        less CPU per page and 2-4% more GB/s; puts within the noise)."""
        if _DEFAULT == _XXH3 and self._single:
            ptrs, sizes, region, regions = self._ptrs, self._sizes, self._region, self._regions
            digest = xxhash.xxh3_64_intdigest
            out = []
            for i in pages:
                base, view = regions[region[i]]
                start = ptrs[i] - base
                out.append((_XXH3, digest(view[start : start + sizes[i]])))
            return out
        return [self.checksum(i) for i in pages]

    def matches(self, i: int, algorithm: int, checksum: int) -> bool:
        """Whether page ``i`` hashes to ``checksum`` under ``algorithm`` (``checksum_matches``;
        by address for the default algorithm)."""
        if algorithm == _DEFAULT:
            return self.checksum(i)[1] == checksum
        return checksum_matches(algorithm, checksum, self[i])


def buffers_of(pages: Sequence[Sequence[torch.Tensor]]) -> tuple[list[list[memoryview]], list[int]]:
    """``buffer_of`` of every part of every page (through ``PageViews``), and each page's length
    in bytes."""
    views = PageViews(pages)
    return [views[i] for i in range(len(pages))], views.lengths()


def make_header(key: str, parts: Sequence[memoryview]) -> bytes:
    """The header for the payload ``parts`` (concatenated) stored under ``key``.

    Reads the payload once and copies nothing.
    """
    digest = _ALGORITHMS[_DEFAULT]
    length = sum(p.nbytes for p in parts)
    return _HEADER.pack(
        _MAGIC, _VERSION, _DEFAULT, 0, length, digest([key.encode()]), digest(parts)
    )


def verify(header: Buffer, key: str, parts: Sequence[memoryview]) -> bool:
    """Whether ``header`` is a valid header for the payload ``parts`` stored under ``key``."""
    if len(header) != HEADER_SIZE:
        return False
    magic, version, algorithm, _, length, key_digest, checksum = _HEADER.unpack(header)
    digest = _ALGORITHMS.get(algorithm)
    return (
        magic == _MAGIC
        and version == _VERSION
        and digest is not None
        and length == sum(p.nbytes for p in parts)
        and key_digest == digest([key.encode()])
        and checksum == digest(parts)
    )


def payload_length(header: Buffer) -> int | None:
    """The payload length a header declares, or None if it is not a kvtier page header."""
    if len(header) != HEADER_SIZE:
        return None
    magic, version, _, _, length, _, _ = _HEADER.unpack(header)
    return length if magic == _MAGIC and version == _VERSION else None
