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
import struct
import zlib
from collections.abc import Callable, Sequence

import torch

Buffer = bytes | bytearray | memoryview

__all__ = [
    "HEADER_SIZE",
    "PageViews",
    "buffer_of",
    "buffers_of",
    "make_header",
    "payload_length",
    "verify",
    "verify_at",
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
        Python work (a page costs a few hundred ns more to call)."""
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
        h = xxhash.xxh3_64()
        for part in parts:
            h.update(part)
        return h.intdigest()

    _ALGORITHMS[_XXH3] = _xxh3
    _DEFAULT = _XXH3
except ImportError:  # pragma: no cover - depends on the environment
    _DEFAULT = _CRC32


def buffer_of(page: torch.Tensor) -> memoryview:
    """A writable byte memoryview over a 1-D contiguous uint8 CPU tensor, sharing its memory."""
    return memoryview(page.numpy()).cast("B")


class PageViews:
    """Byte views of a batch's pages, made on demand: ``views[i]`` is ``buffer_of`` of each part
    of page ``i``.

    Parts are 1-D contiguous uint8 CPU tensors (``StorageBackend`` checked them). A batch's pages
    are normally views into one host pool, so this makes one memoryview per distinct storage and
    slices it per part (a few hundred ns) instead of a numpy array per part (microseconds). The
    views share the caller's memory and are valid while the caller holds its tensors: for the
    duration of the call that passes them in. Several threads may index one ``PageViews``.
    """

    def __init__(self, pages: Sequence[Sequence[torch.Tensor]]) -> None:
        self._pages = pages
        # id(storage) -> (storage, a view of all of it); the storage stays referenced here so
        # that its id cannot be reused while the entry exists.
        self._whole: dict[int, tuple[torch.UntypedStorage, memoryview]] = {}

    def lengths(self) -> list[int]:
        """Each page's length in bytes."""
        return [
            parts[0].numel() if len(parts) == 1 else sum(p.numel() for p in parts)
            for parts in self._pages
        ]

    def __getitem__(self, i: int) -> list[memoryview]:
        out = []
        whole = self._whole
        for p in self._pages[i]:
            storage = p.untyped_storage()
            got = whole.get(id(storage))
            if got is None:
                # A view of the storage's bytes by address (no torch call: cheaper, and it never
                # gives up the GIL mid-batch); ``storage`` itself is kept alive in ``whole``.
                raw = (ctypes.c_ubyte * storage.nbytes()).from_address(storage.data_ptr())
                got = whole.setdefault(id(storage), (storage, memoryview(raw).cast("B")))
            start = p.storage_offset()
            out.append(got[1][start : start + p.numel()])
        return out


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


def verify_at(buf: Buffer, offset: int, key: str, parts: Sequence[memoryview], length: int) -> bool:
    """``verify`` of the header at ``buf[offset:]`` for a payload of ``length`` bytes (the sum of
    the parts' sizes, which the caller knows): the read path's variant, with no slicing."""
    magic, version, algorithm, _, declared, key_digest, checksum = _HEADER.unpack_from(buf, offset)
    if magic != _MAGIC or version != _VERSION or declared != length:
        return False
    digest = _ALGORITHMS.get(algorithm)
    if digest is None:
        return False
    if algorithm == _XXH3 and len(parts) == 1:  # the common case without the list wrapping
        return key_digest == xxhash.xxh3_64_intdigest(key.encode()) and checksum == _xxh3_one(
            parts[0]
        )
    return key_digest == digest([key.encode()]) and checksum == digest(parts)


def payload_length(header: Buffer) -> int | None:
    """The payload length a header declares, or None if it is not a kvtier page header."""
    if len(header) != HEADER_SIZE:
        return None
    magic, version, _, _, length, _, _ = _HEADER.unpack(header)
    return length if magic == _MAGIC and version == _VERSION else None
