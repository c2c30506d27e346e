"""Records larger than one IO run (``io.RUN_BYTES``): written and read in pieces, each hashed while
it is in the core's cache (``Xxh3Stream``), and still verified as a whole: a damaged byte in any
piece, a cut record, another key's record and another checksum algorithm all take the usual paths.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import xxhash

from kvtier.storage import Namespace, PoolTransfer, create_backend, page_format, page_hashes
from kvtier.storage.page_format import Xxh3Stream, buffer_of, xxh3_stream
from kvtier.storage.segments import SegmentBackend, native
from kvtier.storage.segments import writer as writer_module
from kvtier.storage.segments.io import RUN_BYTES, pieces

NS = Namespace("segment-large-test", "bfloat16", 4, "page_first")
H = page_hashes(range(4 * 16), NS)
OBJ = [f"{h}.kv.r0" for h in H]
BIG = 2 * RUN_BYTES + 12_345  # three pieces, the last one short
SMALL = 4096


def expected(h: str, size: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(h[:15], 16) ^ size)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


# A batch that mixes sizes: small records on both sides of large ones, so runs of small records
# are cut before and after each large record.
SIZES = [SMALL, BIG, SMALL, SMALL, BIG, RUN_BYTES + 1, SMALL]


def put(b: SegmentBackend, hashes: list[str], sizes: list[int]) -> list[bool]:
    pages = [expected(h, n) for h, n in zip(hashes, sizes)]
    return b.set([PoolTransfer("kv", hashes, pages)]).ok["kv"]


def served(
    b: SegmentBackend, hashes: list[str], sizes: list[int], split: bool = False
) -> list[bool]:
    """Per page: read back (into two parts with ``split``) and equal to its bytes."""
    outs = [torch.full((n,), 0xEE, dtype=torch.uint8) for n in sizes]
    pages = [(o[: n // 3], o[n // 3 :]) if split else o for o, n in zip(outs, sizes)]
    ok = b.get([PoolTransfer("kv", hashes, pages)]).ok["kv"]
    for i, (h, n, got) in enumerate(zip(hashes, sizes, ok)):
        if got:
            assert torch.equal(outs[i], expected(h, n)), f"page {i} served with wrong bytes"
    return ok


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("ctypes_stream", [True, False])
def test_stream_equals_the_one_shot_digest(
    ctypes_stream: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """By address through ``ctypes`` where the binding exports the streaming calls, else through
    the binding's hasher object (the GPU machine's xxhash 4.0.1): the same digest either way."""
    if ctypes_stream and page_format._STREAM is None:
        pytest.skip("no streaming XXH3 through ctypes here")
    if not ctypes_stream:
        monkeypatch.setattr(page_format, "_STREAM", None)  # this thread's stream is remade
    data = expected(H[0], BIG)
    views = [buffer_of(data[:1000]), buffer_of(data[1000:])]
    stream = xxh3_stream(views)
    assert isinstance(stream, Xxh3Stream)
    assert stream.by_address is ctypes_stream
    for piece in pieces(views, RUN_BYTES):
        assert sum(v.nbytes for v in piece) <= RUN_BYTES
        for v in piece:
            stream.update(v)
    assert stream.digest() == xxhash.xxh3_64_intdigest(data.numpy().tobytes())
    stream = xxh3_stream([memoryview(b"read-only")])
    if ctypes_stream:
        assert stream is None, "by address needs writable views"
    else:
        stream.update(memoryview(b"read-only"))
        assert stream.digest() == xxhash.xxh3_64_intdigest(b"read-only")


def test_pieces_cover_the_payload_in_order() -> None:
    data = torch.arange(10_000, dtype=torch.int64).to(torch.uint8)
    parts = [buffer_of(data[:3]), buffer_of(data[3:7000]), buffer_of(data[7000:])]
    cut = pieces(parts, 4096)
    assert [sum(v.nbytes for v in p) for p in cut] == [4096, 4096, 10_000 - 8192]
    assert b"".join(bytes(v) for p in cut for v in p) == data.numpy().tobytes()


def use_stream(kind: str, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Large records hashed in pieces through ``kind``: "ctypes" (by address, skipped where the
    binding does not export the streaming calls) or "hasher" (the binding's hasher object).
    Returns the count of pieces hashed so far in that mode (one element, updated)."""
    if kind == "ctypes" and page_format._STREAM is None:
        pytest.skip("no streaming XXH3 through ctypes here")
    if kind == "hasher":
        monkeypatch.setattr(page_format, "_STREAM", None)
    monkeypatch.setattr(native, "library", lambda: None)  # the Python loops hash in pieces
    seen = [0]
    update = Xxh3Stream.update

    def counted(self: Xxh3Stream, part: memoryview) -> None:
        seen[0] += self.by_address is (kind == "ctypes")
        update(self, part)

    monkeypatch.setattr(Xxh3Stream, "update", counted)
    return seen


@pytest.mark.parametrize("stream", ["ctypes", "hasher"])
@pytest.mark.parametrize("io_threads", [0, 1])
@pytest.mark.parametrize("split", [False, True])
def test_mixed_sizes_roundtrip(
    tmp_path: Path, io_threads: int, split: bool, stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pieces_hashed = use_stream(stream, monkeypatch)
    b = create_backend("file", root=tmp_path / "l3", io_threads=io_threads)
    keys = H[: len(SIZES)]
    if split:
        pages = [expected(h, n) for h, n in zip(keys, SIZES)]
        assert b.set([PoolTransfer("kv", keys, [(p[:999], p[999:]) for p in pages])]).all_ok
    else:
        assert put(b, keys, SIZES) == [True] * len(SIZES)
    assert served(b, keys, SIZES, split=not split) == [True] * len(SIZES)
    again = create_backend("file", root=tmp_path / "l3")
    assert served(again, keys, SIZES) == [True] * len(SIZES), "a fresh reader verifies them"
    b.close()
    again.close()
    assert pieces_hashed[0] > 0, f"large records went through the {stream} stream"


def test_large_record_is_the_payload_alone(tmp_path: Path) -> None:
    """The record is the page's bytes, at a 4 KiB-aligned offset after 4 KiB-multiple pages."""
    b = create_backend("file", root=tmp_path / "l3")
    assert put(b, H[:2], [SMALL, BIG]) == [True, True]
    span = b.locate(OBJ[1])
    assert span is not None and span.size == BIG and span.offset == SMALL
    with open(span.path, "rb") as f:
        f.seek(span.offset)
        assert f.read(span.size) == expected(H[1], BIG).numpy().tobytes()
    b.close()


@pytest.mark.parametrize("stream", ["ctypes", "hasher"])
@pytest.mark.parametrize("piece", [0, 1, 2])
def test_flipped_byte_in_any_piece_is_a_counted_miss(
    tmp_path: Path, piece: int, stream: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    pieces_hashed = use_stream(stream, monkeypatch)
    b = create_backend("file", root=tmp_path / "l3")
    keys = H[: len(SIZES)]
    assert put(b, keys, SIZES) == [True] * len(SIZES)
    span = b.locate(OBJ[1])
    assert span is not None
    flip(span.path, span.offset + piece * RUN_BYTES + 77)
    ok = served(b, keys, SIZES)
    assert ok == [i != 1 for i in range(len(SIZES))]
    assert b.metrics.snapshot()["checksum_miss_pages"] == 1
    assert b.exists([PoolTransfer("kv", keys[:2])]) == 1, "the bad record was dropped"
    b.close()
    assert pieces_hashed[0] > 0, f"large records went through the {stream} stream"


def test_cut_and_foreign_large_records_are_misses(tmp_path: Path) -> None:
    root = tmp_path / "l3"
    b = create_backend("file", root=root)
    keys = H[:3]
    assert put(b, keys, [BIG, BIG, BIG]) == [True] * 3
    first, last = b.locate(OBJ[0]), b.locate(OBJ[2])
    assert first is not None and last is not None
    with open(first.path, "r+b") as f:  # record 0 becomes a copy of record 1 (another key)
        f.seek(first.offset + first.size)
        record = f.read(first.size)
        f.seek(first.offset)
        f.write(record)
    b.close()
    os.truncate(last.path, last.offset + RUN_BYTES + 10)  # record 2 cut mid-piece
    again = create_backend("file", root=root)
    assert served(again, keys, [BIG] * 3) == [False, True, False]
    assert again.metrics.snapshot()["checksum_miss_pages"] == 2
    again.close()


def test_crc32_and_unstreamed_large_records_are_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, python_loops: None
) -> None:
    """Records written without the streaming path (no ctypes streaming, or CRC-32 where xxhash
    is missing) are verified by the whole-page check, with the algorithm their entry names."""
    root = tmp_path / "l3"
    b = create_backend("file", root=root)
    with monkeypatch.context() as m:
        m.setattr(writer_module, "xxh3_stream", lambda parts: None)
        assert put(b, H[:1], [BIG]) == [True]
    with monkeypatch.context() as m:
        m.setattr(page_format, "_DEFAULT", page_format._CRC32)
        assert xxh3_stream([buffer_of(expected(H[1], 10))]) is None
        assert put(b, H[1:2], [BIG]) == [True]
    b.close()
    again = create_backend("file", root=root)
    span = again.locate(OBJ[1])
    assert span is not None
    assert again._index.entries[OBJ[1]].algorithm == page_format._CRC32
    assert served(again, H[:2], [BIG, BIG]) == [True, True]
    flip(span.path, span.offset + 2 * RUN_BYTES + 1)
    assert served(again, H[:2], [BIG, BIG]) == [True, False]
    again.close()


def test_verify_once_trusts_own_large_records(tmp_path: Path) -> None:
    b = create_backend("file", root=tmp_path / "l3", verify="once")
    assert put(b, H[:2], [BIG, BIG]) == [True, True]
    assert served(b, H[:2], [BIG, BIG]) == [True, True]
    b.close()


def test_first_format_journals_are_ignored_and_not_reread(tmp_path: Path) -> None:
    """A segment left by the first record format (its journal starts ``KVSJ``) serves nothing
    and its journal is not read again on every lookup that misses."""
    root = tmp_path / "l3"
    root.mkdir(mode=0o700)
    stem = "4242-0badcafe-00000001"
    (root / f"{stem}.kvj").write_bytes(b"KVSJ" + bytes(200))
    (root / f"{stem}.kvs").write_bytes(bytes(4096))
    for name in (f"{stem}.kvj", f"{stem}.kvs"):
        os.chmod(root / name, 0o600)
    b = create_backend("file", root=root)
    assert b.exists([PoolTransfer("kv", H[:1])]) == 0
    assert b._index.segments[stem].jfd is None, "its journal is closed, never tailed again"
    assert put(b, H[:1], [SMALL]) == [True]
    assert served(b, H[:1], [SMALL]) == [True]
    b.close()
