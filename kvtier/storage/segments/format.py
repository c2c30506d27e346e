"""The segment store's on-disk encodings, both halves of each: records and journal entries.

A segment file ``<stem>.kvs`` is a run of records, each::

    offset size field
    0      4    magic b"KVSR"
    4      4    reserved, zero
    8      8    sequence number (per writer, from 1; the journal entry names it too)
    16     32   page header (``page_format``: magic, version, algorithm, payload length, key
                digest, payload checksum)
    48     n    the page payload, unchanged

Its journal ``<stem>.kvj`` lists the records that were written completely, appended after their
bytes, one entry each::

    offset size field
    0      4    magic b"KVSJ"
    4      2    key length k (at most ``MAX_KEY_LENGTH``)
    6      2    reserved, zero
    8      8    offset of the record in the segment
    16     8    payload length
    24     8    sequence number
    32     8    write time (ns since the epoch): the newest record of a key wins
    40     4    CRC-32 of bytes 0..40 and the key
    44     k    the object key (ASCII)

An entry whose CRC fails ends the journal for its reader (a torn tail); the reader resumes there
on its next look, since a live writer's entry may still be landing.
"""

from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

from kvtier.storage.base import MAX_KEY_LENGTH
from kvtier.storage.page_format import HEADER_SIZE, verify_at

__all__ = [
    "ENTRY_SIZE",
    "PREFIX_SIZE",
    "RECORD_HEAD",
    "Entry",
    "encode_entry",
    "parse_entries",
    "prefix_matches",
    "record_ok",
    "record_prefix",
]

_RECORD_MAGIC = b"KVSR"
_JOURNAL_MAGIC = b"KVSJ"
_PREFIX = struct.Struct("<4sIQ")
_ENTRY = struct.Struct("<4sHHQQQQ")
_CRC = struct.Struct("<I")
_ENTRY_CRC = struct.Struct("<4sHHQQQQI")  # an entry's fixed part with its CRC, read at once
PREFIX_SIZE = _PREFIX.size
RECORD_HEAD = PREFIX_SIZE + HEADER_SIZE
"""Bytes before a record's payload: the prefix, then the page header."""
ENTRY_SIZE = _ENTRY.size + _CRC.size
"""Bytes of a journal entry before its key."""


class Entry(NamedTuple):
    """One journal entry: where the record of ``key`` lies in its segment, and when it was made."""

    key: str
    offset: int
    length: int  # payload bytes
    seq: int
    time_ns: int


def record_prefix(seq: int) -> bytes:
    return _PREFIX.pack(_RECORD_MAGIC, 0, seq)


def prefix_matches(prefix: memoryview | bytes, seq: int) -> bool:
    """Whether ``prefix`` opens the record with sequence number ``seq``."""
    magic, _, got = _PREFIX.unpack(prefix)
    return magic == _RECORD_MAGIC and got == seq


def record_ok(
    heads: memoryview,
    at: int,
    seq: int,
    key: str,
    parts: list[memoryview],
    length: int,
    trusted: bool,
) -> bool:
    """Whether the record head at ``heads[at:]`` (prefix and page header, as read) opens record
    ``seq`` of ``key`` and, unless ``trusted``, the payload ``parts`` (``length`` bytes) verifies
    against it."""
    magic, _, got = _PREFIX.unpack_from(heads, at)
    if magic != _RECORD_MAGIC or got != seq:
        return False
    return trusted or verify_at(heads, at + PREFIX_SIZE, key, parts, length)


def encode_entry(e: Entry) -> bytes:
    key = e.key.encode("ascii")
    body = _ENTRY.pack(_JOURNAL_MAGIC, len(key), 0, e.offset, e.length, e.seq, e.time_ns)
    return body + _CRC.pack(zlib.crc32(key, zlib.crc32(body))) + key


def parse_entries(buf: bytes) -> tuple[list[Entry], int]:
    """The complete, valid entries at the start of ``buf``, and how many bytes they take.

    Parsing stops at the first entry that is cut short, fails its CRC or holds a key that is not
    ASCII. Keys are not checked further: the store only compares them with object keys that
    ``StorageBackend`` validated, and never turns them into paths.
    """
    out: list[Entry] = []
    pos, end = 0, len(buf)
    view = memoryview(buf)
    unpack, crc32, head = _ENTRY_CRC.unpack_from, zlib.crc32, _ENTRY.size
    new = tuple.__new__
    while pos + ENTRY_SIZE <= end:
        magic, klen, _, offset, length, seq, time_ns, crc = unpack(buf, pos)
        stop = pos + ENTRY_SIZE + klen
        if magic != _JOURNAL_MAGIC or klen > MAX_KEY_LENGTH or stop > end:
            break
        if crc != crc32(view[pos + ENTRY_SIZE : stop], crc32(view[pos : pos + head])):
            break
        try:
            key = buf[pos + ENTRY_SIZE : stop].decode("ascii")
        except UnicodeDecodeError:
            break
        out.append(new(Entry, (key, offset, length, seq, time_ns)))
        pos = stop
    return out, pos
