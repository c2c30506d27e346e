"""The segment store's on-disk encodings, both halves of each: records and journal entries.

A segment file ``<stem>.kvs`` is a run of records, each the page payload alone, unchanged, back
to back: a payload whose size is a multiple of 4 KiB starts at a 4 KiB-aligned file offset when the
records before it in its segment are multiples of 4 KiB too (a segment mixing other sizes, such
as 33 KiB indexer pages beside 64 KiB KV pages, shifts what follows them; records are not
padded), so the kernel copies between the page cache and the caller's (page-aligned) buffers aligned, which
on the measured hosts costs 11-21% less CPU than at an offset 48 bytes off (a per-record head).

Its journal ``<stem>.kvj`` lists the records that were written completely, appended after their
bytes, one entry each, with what verifies the record::

    offset size field
    0      4    magic b"KVS2"
    4      2    key length k (at most ``MAX_KEY_LENGTH``)
    6      1    flags: bit 0 set for a tombstone (the key was deleted; no record), others zero
    7      1    checksum algorithm (``page_format``: 1 = XXH3-64, 2 = CRC-32; 0 for a tombstone)
    8      8    offset of the record in the segment (0 for a tombstone)
    16     8    payload length (0 for a tombstone)
    24     8    checksum of the payload (0 for a tombstone)
    32     8    write time (ns since the epoch): the newest record or tombstone of a key wins
    40     4    CRC-32 of bytes 0..40 and the key
    44     k    the object key (ASCII)

An entry's place in its journal is its sequence number (from 0): with the segment and the
write time it orders two entries of one key. An entry whose CRC fails ends the journal for its
reader (a torn tail); the reader resumes there on its next look, since a live writer's entry may
still be landing. The key and the payload's checksum sit in one CRC-checked entry, so a record
is served only when its bytes hash to what was journaled for that key: a torn record, another
key's record copied in or bytes never written (a preallocated hole) fail.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Sequence
from typing import NamedTuple

from kvtier.storage.base import MAX_KEY_LENGTH

__all__ = [
    "ENTRY_SIZE",
    "MAX_RECORD_END",
    "RECORD_HEAD",
    "Entry",
    "encode_entries",
    "encode_entry",
    "foreign_journal",
    "parse_entries",
]

_JOURNAL_MAGIC = b"KVS2"  # the first format's journals (b"KVSJ") are not read: never served
_ENTRY = struct.Struct("<4sHBBQQQQ")
_CRC = struct.Struct("<I")
_ENTRY_CRC = struct.Struct("<4sHBBQQQQI")  # an entry's fixed part with its CRC, read at once
_TOMBSTONE = 1  # flags bit: a deletion
RECORD_HEAD = 0
"""Bytes before a record's payload in its segment: none (what verifies it is journaled)."""
ENTRY_SIZE = _ENTRY.size + _CRC.size
"""Bytes of a journal entry before its key."""
MAX_RECORD_END = 2**62
"""The furthest end (offset + length) of a record that a parsed entry may name: far past any
file this store writes, well inside a signed 64-bit file offset."""


class Entry(NamedTuple):
    """One journal entry: where the record of ``key`` lies in its segment, its checksum, and when
    it was made; or, with ``deleted``, a tombstone: ``key``'s records older than it are dead."""

    key: str
    offset: int
    length: int  # payload bytes
    seq: int  # the entry's place in its journal
    time_ns: int
    algorithm: int = 0  # page_format's checksum algorithm
    checksum: int = 0
    deleted: bool = False


def encode_entry(e: Entry) -> bytes:
    key = e.key.encode("ascii")
    flags = _TOMBSTONE if e.deleted else 0
    body = _ENTRY.pack(
        _JOURNAL_MAGIC, len(key), flags, e.algorithm, e.offset, e.length, e.checksum, e.time_ns
    )
    return body + _CRC.pack(zlib.crc32(key, zlib.crc32(body))) + key


def encode_entries(
    keys: Sequence[str],
    offsets: Sequence[int],
    lengths: Sequence[int],
    time_ns: int,
    algorithms: Sequence[int],
    checksums: Sequence[int],
) -> bytes:
    """The journal entries of records ``keys`` (one time for all), as ``encode_entry`` of each,
    concatenated, in one loop of C calls: ~0.8 us an entry (a numpy record array packed field by
    field cost as much at 128 entries, and far more for the few entries of one run)."""
    pack, pack_crc, crc32, magic = _ENTRY.pack, _CRC.pack, zlib.crc32, _JOURNAL_MAGIC
    out: list[bytes] = []
    for key, offset, length, algorithm, checksum in zip(
        keys, offsets, lengths, algorithms, checksums
    ):
        raw = key.encode("ascii")
        body = pack(magic, len(raw), 0, algorithm, offset, length, checksum, time_ns)
        out += (body, pack_crc(crc32(raw, crc32(body))), raw)
    return b"".join(out)


def foreign_journal(head: bytes) -> bool:
    """Whether a journal starting with ``head`` is of another format (the first one's, say),
    whose entries this store never reads: not worth reading again."""
    return len(head) >= len(_JOURNAL_MAGIC) and head[: len(_JOURNAL_MAGIC)] != _JOURNAL_MAGIC


def parse_entries(buf: bytes, seq: int = 0) -> tuple[list[Entry], int]:
    """The complete, valid entries at the start of ``buf``, numbered from ``seq`` (the place of
    the first in its journal), and how many bytes they take.

    Parsing stops at the first entry that is cut short, fails its CRC, has unknown flags or holds
    a key that is not ASCII. Keys are not checked further: the store only compares them with
    object keys that ``StorageBackend`` validated, and never turns them into paths.

    An entry whose record would end past ``MAX_RECORD_END`` (no file offset reaches it, and an
    ``off_t`` could not hold it) is left out, with no number, and parsing goes on past it: its
    CRC holds, so it was written whole, but not by this store. Served, it would fail every read
    batch that names its key, not just its own page.
    """
    out: list[Entry] = []
    pos, end = 0, len(buf)
    view = memoryview(buf)
    unpack, crc32, head = _ENTRY_CRC.unpack_from, zlib.crc32, _ENTRY.size
    new = tuple.__new__
    while pos + ENTRY_SIZE <= end:
        magic, klen, flags, algorithm, offset, length, checksum, time_ns, crc = unpack(buf, pos)
        stop = pos + ENTRY_SIZE + klen
        if magic != _JOURNAL_MAGIC or klen > MAX_KEY_LENGTH or stop > end or flags & ~_TOMBSTONE:
            break
        if crc != crc32(view[pos + ENTRY_SIZE : stop], crc32(view[pos : pos + head])):
            break
        try:
            key = buf[pos + ENTRY_SIZE : stop].decode("ascii")
        except UnicodeDecodeError:
            break
        if offset + length <= MAX_RECORD_END:
            out.append(
                new(Entry, (key, offset, length, seq, time_ns, algorithm, checksum, flags != 0))
            )
            seq += 1
        pos = stop
    return out, pos
