"""The segment store's C loops (``segments.native``) against its Python loops: the same records,
runs, journal bytes and verdicts, each path reading what the other wrote; the loader's refusals;
and a writer in the C loops killed at a random point of its batches."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import random
import resource
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes
from kvtier.storage.segments import format as fmt
from kvtier.storage.segments import native
from kvtier.storage.segments.io import RUN_BYTES
from tests.children import child_env
from tests.storage.conftest import assert_only_the_later_batch_served, native_library

NS = Namespace("segment-native", "bfloat16", 4, "page_first")
H = page_hashes(range(4096), NS)
WAIT_S = 60.0


@pytest.fixture
def lib():
    return native_library()


def pages_of(sizes: list[int], seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    pool = torch.randint(0, 256, (sum(sizes),), dtype=torch.uint8, generator=g)
    return list(pool.split(sizes))


def split_into_parts(
    sizes: list[int], rng: random.Random
) -> tuple[native.Parts, list[list[torch.Tensor]]]:
    """Each record cut into 1-3 parts (some empty), each part a buffer of its own poisoned with
    0xEE and one guard byte past it: the ``Parts`` and the part buffers (guard included)."""
    start, addr, size, bufs = [0], [], [], []
    for n in sizes:
        cuts = sorted(rng.randrange(n + 1) for _ in range(rng.randrange(3)))
        lens = [b - a for a, b in zip([0, *cuts], [*cuts, n])]
        mine = [torch.full((k + 1,), 0xEE, dtype=torch.uint8) for k in lens]
        addr += [b.data_ptr() for b in mine]
        size += lens
        start.append(start[-1] + len(lens))
        bufs.append(mine)
    parts = native.Parts(
        np.array(start, dtype=np.int64), np.array(addr, dtype=np.uint64), np.array(size, np.uint64)
    )
    return parts, bufs


@pytest.mark.parametrize("in_parts", [False, True], ids=["one-part", "parts"])
@pytest.mark.parametrize("trusting", [False, True], ids=["always", "once"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
def test_records_in_any_arrangement_are_read_and_checked(
    tmp_path: Path,
    lib,
    stream: bool,
    trusting: bool,
    in_parts: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Records in two files with gaps, sizes around a run's, empty ones and a closed file's
    (negative descriptor), read into scattered buffers, or into 1-3 scattered parts each: each
    record's verdict and bytes as a plain loop says (the C loop cuts the runs itself). Records
    over a run are hashed as their pieces land (the binding's streaming XXH3) or, without it,
    whole after the last. Trusted records (``verify="once"``) are served once read in full,
    unchecked, as the Python loops do. Parts need the streaming calls (refused without)."""
    if stream and lib.stream_at is None:
        pytest.skip("the binding's streaming XXH3 calls are not callable here")
    if not stream:
        monkeypatch.setattr(lib, "stream_at", None)
    if in_parts and not stream:
        parts, _ = split_into_parts([10, 20], random.Random(1))
        n = np.array([10, 20], dtype=np.uint64)
        with pytest.raises(ValueError, match="several parts"):
            native.read(
                lib, np.zeros(2, np.int32), np.zeros(2, np.int64), parts, n, n, RUN_BYTES, 1
            )
        with pytest.raises(ValueError, match="several parts"):
            native.hash_records(lib, parts, n)
        return
    rng = random.Random(5)
    files = [os.open(tmp_path / f"f{k}", os.O_RDWR | os.O_CREAT, 0o600) for k in range(2)]
    try:
        for trial in range(40):
            n = rng.randrange(1, 30)
            recs = []
            ends = [0, 0]
            for _ in range(n):
                k = rng.randrange(2)
                if rng.random() < 0.2:
                    ends[k] += rng.randrange(1, 5000)  # a gap
                size = rng.choice([0, 1, 4096, 65536, RUN_BYTES, RUN_BYTES + 1, 2 * RUN_BYTES + 5])
                recs.append((k, ends[k], size))
                ends[k] += size
            recs.sort(key=lambda r: (r[0], r[1]))
            data = [pages_of([size], trial * 100 + i)[0] for i, (_, _, size) in enumerate(recs)]
            for (k, at, _), page in zip(recs, data):
                os.pwrite(files[k], page.numpy().tobytes(), at)
            sums = [xxhash.xxh3_64_intdigest(page.numpy().tobytes()) for page in data]
            flipped = rng.randrange(n)
            sums[flipped] ^= 1  # a record whose checksum does not match
            closed = {i for i in range(n) if rng.random() < 0.1}
            torn = -1  # a file cut inside its last record: never served, trusted or not
            if rng.random() < 0.3:
                k = rng.randrange(2)
                mine = [i for i in range(n) if recs[i][0] == k]  # sorted by offset
                if mine and recs[mine[-1]][2] >= 2:  # its last record, nothing after it
                    _, at, size = recs[mine[-1]]
                    os.ftruncate(files[k], at + size // 2)
                    torn = mine[-1]
            trusted = [trusting and rng.random() < 0.4 for _ in range(n)]
            if trusting:
                trusted[flipped] = rng.random() < 0.5
            out = [torch.full((size + 1,), 0xEE, dtype=torch.uint8) for _, _, size in recs]
            into: np.ndarray | native.Parts = np.array([o.data_ptr() for o in out], np.uint64)
            if in_parts:
                into, bufs = split_into_parts([size for _, _, size in recs], rng)
            status, err = native.read(
                lib,
                np.array(
                    [-1 if i in closed else files[k] for i, (k, _, _) in enumerate(recs)],
                    dtype=np.int32,
                ),
                np.array([at for _, at, _ in recs], dtype=np.int64),
                into,
                np.array([size for _, _, size in recs], dtype=np.uint64),
                np.array(sums, dtype=np.uint64),
                RUN_BYTES,
                rng.choice([1, 2, 3]),
                np.array(trusted, dtype=np.uint8) if trusting else None,
            )
            assert err == 0
            if in_parts:  # each record's parts, guard bytes dropped, back to back
                for i, mine in enumerate(bufs):
                    assert all(int(b[-1]) == 0xEE for b in mine), "nothing past a part"
                    out[i][:-1] = torch.cat([b[:-1] for b in mine])
            for i, (got, o, page) in enumerate(zip(status.tolist(), out, data)):
                if i in closed:
                    assert got == 0 and bool((o == 0xEE).all()), "not read: untouched"
                    continue
                if i == torn:
                    assert got == 2, (trial, i, "a record cut short is never served")
                    continue
                assert got == (2 if i == flipped and not trusted[i] else 1), (trial, i)
                assert torch.equal(o[:-1], page) and int(o[-1]) == 0xEE, "exact, nothing past it"
            for k in range(2):
                os.ftruncate(files[k], 0)
    finally:
        for fd in files:
            os.close(fd)


def test_journal_entries_equal_the_python_encoding(lib) -> None:
    rng = random.Random(7)
    for n in (1, 2, 17, 300):
        keys = [
            "".join(rng.choice("0123456789abcdef.kvr") for _ in range(rng.randrange(1, 90)))
            for _ in range(n)
        ]
        offsets = [rng.randrange(fmt.MAX_RECORD_END - 2**40) for _ in range(n)]  # parsed too
        lengths = [rng.randrange(2**40) for _ in range(n)]
        algorithms = [rng.choice([1, 2]) for _ in range(n)]
        sums = [rng.randrange(2**64) for _ in range(n)]
        t = rng.randrange(2**63)
        got = native.encode_entries(lib, keys, offsets, lengths, t, algorithms, sums)
        assert got == fmt.encode_entries(keys, offsets, lengths, t, algorithms, sums)
        parsed, used = fmt.parse_entries(got)
        assert used == len(got) and [e.key for e in parsed] == keys


def as_parts(pages: list[torch.Tensor], pool: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    """Each page as two parts, as a page_first KV page's K and V ranges: its first half at
    page i's place in the first half of ``pool``, its second half at that place in the second
    half (``pool`` holds twice the pages' bytes, poisoned; what lies between stays so)."""
    out, at, half = [], 0, pool.numel() // 2
    for page in pages:
        k = page.numel() // 2
        first, second = pool[at : at + k], pool[half + at : half + at + page.numel() - k]
        first.copy_(page[:k])
        second.copy_(page[k:])
        out.append((first, second))
        at += page.numel() + 1  # a poisoned byte between pages
    return out


def counting(monkeypatch: pytest.MonkeyPatch, names: tuple[str, ...]) -> dict[str, int]:
    """How often each of ``native``'s calls ``names`` runs from here on."""
    calls = dict.fromkeys(names, 0)
    for name in names:
        real = getattr(native, name)

        def counted(*args, _real=real, _name=name, **kwargs):
            calls[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(native, name, counted)
    return calls


@pytest.mark.parametrize("parts", [1, 2], ids=["one-part", "two-parts"])
@pytest.mark.parametrize("writer", ["native", "python"])
@pytest.mark.parametrize("reader", ["native", "python"])
def test_each_path_reads_what_the_other_wrote(
    tmp_path: Path, writer: str, reader: str, parts: int, lib, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mixed sizes (empty, odd, a run's, larger than a run), several batches and segments,
    a get in shuffled order with absent keys: served pages are exact, absent ones untouched;
    pages of one part, or of two (a page_first KV page's K and V ranges), which the C loops
    move too where the binding has the streaming XXH3 calls."""
    sizes = [0, 1, 4095, 65536, RUN_BYTES, RUN_BYTES + 3, 3 * RUN_BYTES + 7, 12_345] * 3
    keys = H[: len(sizes)]
    pages = pages_of(sizes, 11)
    room = 2 * (sum(sizes) + len(sizes) + 77 + 2)
    src: list = pages
    if parts == 2:
        src = as_parts(pages, torch.full((room,), 0xEE, dtype=torch.uint8))
    calls = counting(monkeypatch, ("write_start", "write", "read"))
    root = tmp_path / "l3"
    w = create_backend("file", root=root, segment_bytes=2 << 20, native=writer == "native")
    for lo in range(0, len(keys), 5):
        assert w.set([PoolTransfer("kv", keys[lo : lo + 5], src[lo : lo + 5])]).all_ok
    r = create_backend("file", root=root, native=reader == "native")
    order = list(range(len(keys))) + [len(keys), len(keys) + 1]  # two never written
    random.Random(3).shuffle(order)
    want_keys = [H[i] for i in order]
    wanted = [sizes[i] if i < len(sizes) else 77 for i in order]
    out = [torch.full((n,), 0xEE, dtype=torch.uint8) for n in wanted]
    into: list = out
    if parts == 2:
        pool = torch.full((room,), 0xEE, dtype=torch.uint8)
        into = as_parts(out, pool)
        pool.fill_(0xEE)  # as_parts copied the poison in; refill the gaps all the same
    ok = r.get([PoolTransfer("kv", want_keys, into)]).ok["kv"]
    if parts == 2:
        for buf, (first, second) in zip(out, into):
            buf.copy_(torch.cat([first, second]))
        ends = [p.data_ptr() - pool.data_ptr() + p.numel() for q in into for p in q if p.numel()]
        assert all(int(pool[e]) == 0xEE for e in ends if e < room), "nothing between parts"
    for got, i, buf in zip(ok, order, out):
        if i < len(sizes):
            assert got and torch.equal(buf, pages[i]), f"page {i}"
        else:
            assert not got and bool((buf == 0xEE).all()), "an absent page's buffer untouched"
    assert r.metrics.snapshot()["checksum_miss_pages"] == 0
    if parts == 1 or lib.stream_at is not None:  # the C loops took every batch of their side
        assert (calls["write_start"] + calls["write"] > 0) == (writer == "native")
        assert (calls["read"] > 0) == (reader == "native")
    w.close()
    r.close()


@pytest.mark.parametrize("parts", [1, 2], ids=["one-part", "two-parts"])
@pytest.mark.parametrize("loops", ["native", "python"], indirect=True)
def test_torn_and_flipped_records_are_counted_misses(
    tmp_path: Path, loops: str, parts: int
) -> None:
    """A flipped byte in one record and a segment cut inside another: both misses (counted,
    dropped from the index), every other page of the batch served exactly; pages of one part,
    and of two (written and read as two)."""
    sizes = [65536] * 6 + [RUN_BYTES + 100]
    keys, pages = H[100 : 100 + len(sizes)], pages_of(sizes, 12)
    room = 2 * (sum(sizes) + len(sizes))
    src = pages if parts == 1 else as_parts(pages, torch.zeros(room, dtype=torch.uint8))
    root = tmp_path / "l3"
    w = create_backend("file", root=root)
    assert w.set([PoolTransfer("kv", keys, src)]).all_ok
    w.close()
    (seg,) = root.glob("*.kvs")
    flip = 2 * 65536 + (999 if parts == 1 else 40_000)  # in the second part's bytes
    with open(seg, "r+b") as f:
        f.seek(flip)
        byte = f.read(1)
        f.seek(flip)
        f.write(bytes([byte[0] ^ 1]))
        f.truncate(6 * 65536 + RUN_BYTES // 2)  # inside the last (large) record
    r = create_backend("file", root=root)
    out = [torch.full((n,), 0xEE, dtype=torch.uint8) for n in sizes]
    into: list = out
    if parts == 2:
        into = as_parts(out, torch.zeros(room, dtype=torch.uint8))
    ok = r.get([PoolTransfer("kv", keys, into)]).ok["kv"]
    if parts == 2:
        for buf, (first, second) in zip(out, into):
            buf.copy_(torch.cat([first, second]))
    assert ok == [True, True, False, True, True, True, False]
    for i in (0, 1, 3, 4, 5):
        assert torch.equal(out[i], pages[i])
    assert r.metrics.snapshot()["checksum_miss_pages"] == 2
    assert r.contains("kv", [keys[2], keys[6]]) == [False, False], "dropped from the index"
    r.close()


def test_the_wrappers_report_short_files_and_bad_descriptors(tmp_path: Path, lib) -> None:
    data = pages_of([5000], 1)[0]
    path = tmp_path / "f"
    path.write_bytes(data.numpy().tobytes()[:4000])
    fd = os.open(path, os.O_RDONLY)
    try:
        back = torch.full((5000,), 0xEE, dtype=torch.uint8)
        addr = np.array([back.data_ptr(), back.data_ptr() + 3000], dtype=np.uint64)
        n = np.array([3000, 2000], dtype=np.uint64)
        sums = np.array(
            [xxhash.xxh3_64_intdigest(data.numpy()[:3000].tobytes()), 0], dtype=np.uint64
        )
        offsets = np.array([0, 3000], dtype=np.int64)
        status, err = native.read(
            lib, np.array([fd, fd], dtype=np.int32), offsets, addr, n, sums, RUN_BYTES, 2
        )
        assert status.tolist() == [1, 2] and err == 0  # the file ends inside the second
        written = native.make_runs([fd], [0], [0], [2])
        native.write(lib, written, addr, n, 1)
        assert written["err"].tolist() == [9]  # EBADF: opened read-only
        started = native.make_runs([fd], [0], [0], [2])
        pending = native.write_start(lib, started, addr, n)
        assert pending is not None
        pending.wait()
        pending.wait()  # a second wait is a no-op
        assert started["err"].tolist() == [9]
        os.close(fd)
        status, err = native.read(
            lib, np.array([fd, fd], dtype=np.int32), offsets, addr, n, sums, RUN_BYTES, 1
        )
        assert status.tolist() == [3, 3] and err == 9  # EBADF: closed
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    assert path.read_bytes() == data.numpy().tobytes()[:4000], "the failed write wrote nothing"


@pytest.mark.parametrize("parts", [1, 2], ids=["one-part", "two-parts"])
@pytest.mark.parametrize("started", [True, False], ids=["write-thread", "one-call"])
def test_a_failed_run_stores_only_the_records_before_it(
    tmp_path: Path, lib, monkeypatch: pytest.MonkeyPatch, started: bool, parts: int
) -> None:
    """A run whose write fails (its descriptor swapped for a read-only one) fails its records and
    every later record of the batch; the records before it are stored, journaled and indexed
    (the entries and index records made while the bytes were written are cut to them), for this
    store and for a fresh reader; the segment takes no more. Both C write paths: a thread of its
    own writing while the caller hashes, and the one call (no thread could be started); pages
    of one part and of two."""
    if parts == 2 and lib.stream_at is None:
        pytest.skip("the binding's streaming XXH3 calls are not callable here")
    ro = os.open(tmp_path / "read-only", os.O_RDONLY | os.O_CREAT, 0o600)
    make_runs = native.make_runs

    def second_run_fails(fds, offsets, first, count):
        table = make_runs(fds, offsets, first, count)
        if len(table) > 1:
            table["fd"][1] = ro
        return table

    monkeypatch.setattr(native, "make_runs", second_run_fails)
    if not started:
        monkeypatch.setattr(native, "write_start", lambda *args: None)
    sizes = [64 << 10] * 12  # runs of RUN_BYTES: four records each
    pages, keys = pages_of(sizes, 5), H[:12]
    src = (
        pages
        if parts == 1
        else as_parts(pages, torch.zeros(2 * (sum(sizes) + 12), dtype=torch.uint8))
    )
    root = tmp_path / "l3"
    try:
        b = create_backend("file", root=root)
        assert b.set([PoolTransfer("kv", keys, src)]).ok["kv"] == [True] * 4 + [False] * 8
        monkeypatch.undo()
        assert b.set([PoolTransfer("kv", H[12:14], pages_of([4096, 4096], 6))]).all_ok
        fresh = create_backend("file", root=root)
        for store in (b, fresh):
            out = [torch.full((n,), 0xEE, dtype=torch.uint8) for n in sizes]
            assert store.get([PoolTransfer("kv", keys, out)]).ok["kv"] == [True] * 4 + [False] * 8
            assert all(torch.equal(o, p) for o, p in zip(out[:4], pages[:4]))
            assert all(bool((o == 0xEE).all()) for o in out[4:]), "unserved pages untouched"
            assert store.metrics.snapshot()["checksum_miss_pages"] == 0
        assert len(list(root.glob("*.kvs"))) == 2, "the failed segment took no more"
        b.close()
        fresh.close()
    finally:
        os.close(ro)


def test_a_put_that_fails_while_its_write_thread_runs_waits_for_it_and_journals_nothing(
    tmp_path: Path, lib, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An error on the caller's side while the C thread writes (here: the hashing raises): the
    write is waited for before the batch fails, nothing of it is journaled or indexed (a fresh
    reader serves none of it), and the next put stores and serves its pages."""
    waited = []
    write_start = native.write_start

    def started(*args):
        pending = write_start(*args)
        wait = pending.wait
        pending_wait = lambda: (wait(), waited.append(True))[0]  # noqa: E731
        return _Watched(pending_wait)

    def broken(*args):
        raise MemoryError("injected")

    monkeypatch.setattr(native, "write_start", started)
    monkeypatch.setattr(native, "hash_records", broken)
    root = tmp_path / "l3"
    b = create_backend("file", root=root)
    pages = pages_of([64 << 10] * 8, 9)
    assert b.set([PoolTransfer("kv", H[:8], pages)]).ok["kv"] == [False] * 8
    assert waited == [True], "the write was waited for before the batch failed"
    monkeypatch.undo()
    assert b.set([PoolTransfer("kv", H[8:16], pages)]).all_ok
    assert_only_the_later_batch_served(b, root, H, pages)


def test_every_waiter_of_a_write_returns_after_it(tmp_path: Path, lib) -> None:
    """Two threads wait for one started write: neither returns before all its bytes are in the
    file (the second waiter used to return at once while the first joined)."""
    data = pages_of([32 << 20], 4)[0]
    with open(tmp_path / "f", "wb+") as f:
        runs = native.make_runs([f.fileno()], [0], [0], [1])
        addr = np.array([data.data_ptr()], dtype=np.uint64)
        n = np.array([data.numel()], dtype=np.uint64)
        pending = native.write_start(lib, runs, addr, n)
        assert pending is not None
        sizes = []
        other = threading.Thread(
            target=lambda: (pending.wait(), sizes.append(os.fstat(f.fileno()).st_size))
        )
        other.start()
        pending.wait()
        sizes.append(os.fstat(f.fileno()).st_size)
        other.join()
        assert sizes == [data.numel()] * 2 and runs["err"].tolist() == [0]
        assert os.pread(f.fileno(), data.numel(), 0) == data.numpy().tobytes()


class _Watched:
    def __init__(self, wait) -> None:
        self.wait = wait


def test_the_loader_builds_privately_and_refuses_what_it_cannot_trust(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lib
) -> None:
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(cache))
    assert native._load() is not None
    assert stat.S_IMODE(cache.stat().st_mode) == 0o700
    (built,) = cache.glob("native_io-*.so")
    assert stat.S_IMODE(built.stat().st_mode) == 0o700
    assert not list(cache.glob("*.tmp")), "the build's temporary file is gone"

    for off in ("0", "false", "Off"):
        monkeypatch.setenv(native.ENV_DISABLE, off)
        assert native._load() is None, f"turned off by {off!r}"
    monkeypatch.delenv(native.ENV_DISABLE)

    corrupt = tmp_path / "corrupt"
    corrupt.mkdir(mode=0o700)
    (corrupt / built.name).write_bytes(b"not a library")  # a crash or a full disk, say
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(corrupt))
    assert native._load() is not None, "rebuilt once"
    assert (corrupt / built.name).stat().st_size > 1000

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(shared))
    assert native._load() is None, "a cache others can write into is not used"
    assert not list(shared.iterdir()), "nothing was built there"

    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "fresh"))
    monkeypatch.setenv("CC", "false")  # a compiler that fails
    assert native._load() is None
    (mark,) = (tmp_path / "fresh").iterdir()  # nothing but the failure's marker
    assert mark.name.endswith(".so.failed") and stat.S_IMODE(mark.stat().st_mode) == 0o600

    # A build killed mid-way leaves its temporary file: swept once older than any build.
    dead, live = (tmp_path / "fresh" / f"{built.name}.{tag}.tmp" for tag in ("dead", "live"))
    dead.write_bytes(b"half a library")
    live.write_bytes(b"a build in progress")
    old = time.time() - 3 * native._BUILD_TIMEOUT_S
    os.utime(dead, (old, old))
    mark.unlink()  # a build is tried again at once
    assert native._load() is None  # still no compiler
    assert not dead.exists() and live.exists()


WRITER = """
import sys, torch
from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes
from kvtier.storage.segments import native
assert native.available()
root, progress, parts = sys.argv[1], sys.argv[2], int(sys.argv[3])
H = page_hashes(range(64 * 1024), Namespace("segment-native", "bfloat16", 4, "page_first"))
b = create_backend("file", root=root, segment_bytes=8 << 20)
pool = torch.zeros(2 * 64 * 16384, dtype=torch.uint8)  # two halves: K ranges, then V ranges

def page(h, i):
    g = torch.Generator().manual_seed(int(h[:15], 16))
    x = torch.randint(0, 256, (16384,), dtype=torch.uint8, generator=g)
    if parts == 1:
        return x
    k, v = pool[i * 8192 : (i + 1) * 8192], pool[(64 + i) * 8192 : (65 + i) * 8192]
    k.copy_(x[:8192])
    v.copy_(x[8192:])
    return (k, v)

with open(progress, "w") as log:
    for n in range(1024):
        keys = H[n * 64 : (n + 1) * 64]
        assert b.set([PoolTransfer("kv", keys, [page(h, i) for i, h in enumerate(keys)])]).all_ok
        log.write(f"{n}\\n")
        log.flush()
"""
BIG = page_hashes(range(64 * 1024), NS)


def expected(h: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(h[:15], 16))
    return torch.randint(0, 256, (16384,), dtype=torch.uint8, generator=g)


@pytest.mark.parametrize(
    ("seed", "parts"), [(0, 1), (1, 1), (2, 1), (3, 2), (4, 2)], ids=lambda v: str(v)
)
def test_a_writer_in_the_c_loops_killed_at_a_random_point(
    tmp_path: Path, seed: int, parts: int, lib
) -> None:
    """SIGKILL at a random moment of a stream of batches (16 KiB pages, 64 a batch; of one part
    each, or of two, as page_first KV pages): every page a fresh reader serves has exactly the
    bytes written, every batch the writer saw complete is served, and a new writer takes the
    root over."""
    if parts == 2 and lib.stream_at is None:
        pytest.skip("the binding's streaming XXH3 calls are not callable here")
    root, progress = tmp_path / "l3", tmp_path / "progress"
    script = tmp_path / "writer.py"
    script.write_text(textwrap.dedent(WRITER))
    proc = subprocess.Popen(
        [sys.executable, str(script), str(root), str(progress), str(parts)],
        env=child_env(),
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + WAIT_S
        while not (progress.exists() and progress.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.stderr.read().decode()  # type: ignore[union-attr]
            assert time.monotonic() < deadline, "the writer made no progress"
            time.sleep(0.01)
        time.sleep(random.Random(seed).uniform(0, 0.05))  # the kill's point in the stream
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(WAIT_S)
    assert proc.returncode == -signal.SIGKILL, "killed before it finished"
    done = progress.read_text().count("\n")
    reader = create_backend("file", root=root)
    keys = BIG[: 64 * (done + 4)]
    out = [torch.full((16384,), 0xEE, dtype=torch.uint8) for _ in keys]
    ok = reader.get([PoolTransfer("kv", keys, out)]).ok["kv"]
    assert all(ok[: 64 * done]), "every batch the writer saw complete is served"
    for i, (got, buf) in enumerate(zip(ok, out)):
        if got:
            assert torch.equal(buf, expected(keys[i])), f"page {i} served with wrong bytes"
    writer = create_backend("file", root=root)
    assert writer.set([PoolTransfer("kv", keys[-64:], out[-64:])]).all_ok
    writer.clear()
    assert list(root.glob("*.kvs")) == [], "the killed writer's segments were reclaimable"


def test_a_child_forked_while_the_library_loads_does_not_wait_forever() -> None:
    """The loader's lock held by another thread at ``fork()`` (a build in progress) is a fresh
    lock in the child."""
    native._lock.acquire()
    try:
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if the lock is free
            os._exit(0 if native._lock.acquire(timeout=5) else 1)
    finally:
        native._lock.release()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0


def test_a_build_deletes_libraries_no_process_loaded_for_a_month(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lib
) -> None:
    """Each load stamps its library; a build deletes the libraries (and digests) of other
    sources or compilers unloaded for ``_STALE_S``, keeps recent ones and other files."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(cache))
    assert native._load() is not None
    (built,) = cache.glob("native_io-*.so")
    month = time.time() - native._STALE_S - 3600
    os.utime(built, (month, month))
    assert native._load() is not None
    assert built.stat().st_mtime > month + 3000, "a load stamps its library"
    stale, recent = cache / "native_io-0000000000000000.so", cache / "native_io-1111.so"
    other = cache / "notes.txt"
    for f in (stale, native._digest_path(stale), recent, other):
        f.write_bytes(b"x")
    os.utime(stale, (month, month))
    os.utime(built, (month, month))  # unloaded for a month from here
    monkeypatch.setenv("CC", "cc -O1")  # another name: a build
    assert native._load() is not None
    assert not stale.exists() and not native._digest_path(stale).exists()
    assert recent.exists() and other.exists()
    assert not built.exists(), "unloaded for a month, and not this build's"
    assert len(list(cache.glob("native_io-*.so"))) == 2  # recent, and the new build


def test_a_build_that_hangs_is_cut_off_and_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiler that never finishes (and starts a process of its own): the build ends at its
    time limit, the store would run its Python loops, no temporary file is left."""
    slow = tmp_path / "slowcc"
    slow.write_text("#!/bin/sh\nsleep 60 &\nwait\n")
    slow.chmod(0o700)
    monkeypatch.setenv("CC", str(slow))
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(native, "_BUILD_TIMEOUT_S", 1.0)
    start = time.monotonic()
    assert native._load() is None
    assert time.monotonic() - start < 30, "the build's time limit held"
    left = [p.name for p in (tmp_path / "cache").iterdir()]
    assert len(left) == 1 and left[0].endswith(".so.failed"), left  # the failure's marker only


def _fake_cc(tmp_path: Path, name: str, then: str) -> tuple[Path, Path]:
    """A ``$CC`` script that logs each call (an ``x`` a line in the returned ``calls`` file),
    then runs ``then``."""
    calls = tmp_path / "calls"
    script = tmp_path / name
    script.write_text(f"#!/bin/sh\necho x >> {calls}\n{then}\n")
    script.chmod(0o700)
    return script, calls


def test_a_failed_build_is_not_tried_again_for_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A compiler that fails: the next loads (each process start, say) do not run it again
    while the failure's marker is younger than ``_RETRY_S``; an older marker, or none, and
    the build is tried again; the marker of a build that worked is swept."""
    failing, calls = _fake_cc(tmp_path, "failcc", "exit 1")
    cache = tmp_path / "cache"
    monkeypatch.setenv("CC", str(failing))
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(cache))
    assert native._load() is None
    assert native._load() is None
    assert calls.read_text().count("x") == 1, "tried once"
    (mark,) = cache.glob("*.so.failed")
    old = time.time() - native._RETRY_S - 60
    os.utime(mark, (old, old))
    assert native._load() is None
    assert calls.read_text().count("x") == 2, "tried again once the marker aged"
    assert mark.stat().st_mtime > old + 30, "and marked again"
    mark.unlink()
    assert native._load() is None
    assert calls.read_text().count("x") == 3, "tried at once without the marker"
    ahead = time.time() + 30 * 86400  # written while the clock was a month ahead
    os.utime(mark, (ahead, ahead))
    assert native._load() is None
    assert calls.read_text().count("x") == 4, "a marker from the future does not hold"
    os.utime(mark, (old, old))
    monkeypatch.delenv("CC")  # another compiler: another library, built
    assert native._load() is not None
    assert not mark.exists(), "an aged marker is swept by a build"


def test_the_cache_guards_against_cut_files_other_compilers_and_open_parents(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, lib
) -> None:
    """A library cut short is never mapped (that is SIGBUS) but rebuilt; the compiler command is
    part of the library's name; missing parents are made 0700 under umask 0; a cache under a
    directory others can write into is refused; a symlink to a private directory is used."""
    home = tmp_path / "home"
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(home))
    assert native._load() is not None
    (built,) = home.glob("native_io-*.so")
    digest = native._digest_path(built)

    cut = tmp_path / "cut"
    cut.mkdir(mode=0o700)
    (cut / built.name).write_bytes(built.read_bytes()[:10_000])  # a partial copy, say
    (cut / digest.name).write_text(digest.read_text())
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(cut))
    assert native._load() is not None, "rebuilt, not mapped"
    assert (cut / built.name).read_bytes() == built.read_bytes()

    monkeypatch.setenv("KVTIER_CACHE_DIR", str(home))
    monkeypatch.setenv("CC", "cc -O1")
    assert native._load() is not None
    assert len(list(home.glob("native_io-*.so"))) == 2, "another compiler, another library"
    monkeypatch.delenv("CC")

    old = os.umask(0)
    try:
        deep = tmp_path / "u" / "a" / "b"
        monkeypatch.setenv("KVTIER_CACHE_DIR", str(deep))
        assert native._load() is not None
    finally:
        os.umask(old)
    for d in (tmp_path / "u", tmp_path / "u" / "a", deep):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d

    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)  # not sticky: anyone may rename what lies in it
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(shared / "kvtier"))
    assert native._load() is None

    (tmp_path / "link").symlink_to(home)
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "link"))
    assert native._load() is not None


def test_pages_of_more_parts_than_a_syscall_takes_go_through_the_python_loops(
    tmp_path: Path, lib, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A page of more parts than one ``pwritev`` takes (1,100 parts of 7 bytes) is written and
    read by the Python loops, which cut it into several syscalls; exact both ways."""
    calls = counting(monkeypatch, ("write_start", "write", "read"))
    page = pages_of([7 * 1100], 21)[0]
    b = create_backend("file", root=tmp_path / "l3")
    assert b.set([PoolTransfer("kv", H[:1], [list(page.split(7))])]).all_ok
    out = torch.full((7 * 1100,), 0xEE, dtype=torch.uint8)
    assert b.get([PoolTransfer("kv", H[:1], [list(out.split(7))])]).all_ok
    assert torch.equal(out, page)
    assert calls == {"write_start": 0, "write": 0, "read": 0}
    b.close()


def test_runs_of_more_parts_than_a_syscall_takes_are_cut_between_records(
    tmp_path: Path, lib
) -> None:
    """3,000 records of three 21-byte parts each (an odd count: a syscall's 1,024 iovecs end
    inside a record unless the loop cuts between records) in one run of each write path and
    read back in runs of ~256 KiB: the file, the checksums and the bytes read are exact."""
    if lib.stream_at is None:
        pytest.skip("the binding's streaming XXH3 calls are not callable here")
    n, k, size = 3000, 3, 21
    data = torch.randint(0, 256, (n * k * (size + 1),), dtype=torch.uint8)
    base = data.data_ptr()
    # Part j of record i at (j * n + i) * (size + 1): no two parts adjacent in memory.
    addr = np.array(
        [base + (j * n + i) * (size + 1) for i in range(n) for j in range(k)], dtype=np.uint64
    )
    parts = native.Parts(
        np.arange(0, n * k + 1, k, dtype=np.int64), addr, np.full(n * k, size, np.uint64)
    )
    lengths = np.full(n, k * size, dtype=np.uint64)
    flat = data.numpy()
    records = [
        b"".join(
            flat[int(a) - base : int(a) - base + size].tobytes() for a in addr[i * k : i * k + k]
        )
        for i in range(n)
    ]
    want = [xxhash.xxh3_64_intdigest(r) for r in records]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        for started in (True, False):
            os.ftruncate(fd, 0)
            runs = native.make_runs([fd], [0], [0], [n])
            if started:
                pending = native.write_start(lib, runs, parts, lengths)
                assert pending is not None
                try:
                    sums = native.hash_records(lib, parts, lengths)
                finally:
                    pending.wait()
            else:
                sums = native.write(lib, runs, parts, lengths, 2)
            assert not runs["err"].any() and sums.tolist() == want
            assert os.pread(fd, n * k * size + 1, 0) == b"".join(records)
        back = torch.full_like(data, 0xEE)
        into = native.Parts(
            parts.start, addr - np.uint64(base) + np.uint64(back.data_ptr()), parts.size
        )
        offsets = np.arange(n, dtype=np.int64) * (k * size)
        status, err = native.read(
            lib, np.full(n, fd, np.int32), offsets, into, lengths, sums, RUN_BYTES, 2
        )
        assert err == 0 and status.tolist() == [1] * n
        gaps = torch.ones(len(data), dtype=torch.bool)
        gaps.view(n * k, size + 1)[:, :size] = False
        assert torch.equal(back[~gaps], data[~gaps]) and bool((back[gaps] == 0xEE).all())
    finally:
        os.close(fd)


@pytest.mark.parametrize("after", [False, True], ids=["hash-first", "hash-after"])
@pytest.mark.parametrize("in_parts", [False, True], ids=["one-part", "parts"])
def test_a_large_record_on_one_thread_is_hashed_and_written_piece_by_piece(
    tmp_path: Path, lib, in_parts: bool, after: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On one thread, a record larger than ``piece`` that is a run of its own is hashed piece by
    piece, each piece just before its write (so the write copies it from the core's cache): at
    every hash update the file holds exactly the pieces before it; with ``after``, right after
    its write (from the cache the copy left it in): the file holds that piece too. Small
    records in a run of several are hashed whole, before (after) their run's write. Bytes and
    checksums equal the records', the bytes before them stay; ``piece`` 0: each record hashed
    whole, then written (or each run written, then hashed). A write that fails partway gives
    that run's errno, the runs before it written."""
    if lib.stream_at is None:
        pytest.skip("the binding's streaming XXH3 calls are not callable here")
    piece = 4096
    sizes = [3 * piece + 17, 100, 200, 2 * piece]  # runs: [0], [1, 2], [3]
    pages = pages_of(sizes, 41)
    if in_parts:
        parts, bufs = split_into_parts(sizes, random.Random(41))
        for page, mine in zip(pages, bufs):
            at = 0
            for b in mine:
                b[:-1] = page[at : at + len(b) - 1]
                at += len(b) - 1
    else:
        parts = native.Parts(
            np.arange(len(pages) + 1, dtype=np.int64),
            np.array([p.data_ptr() for p in pages], dtype=np.uint64),
            np.array(sizes, dtype=np.uint64),
        )
    lengths = np.array(sizes, dtype=np.uint64)
    want = [xxhash.xxh3_64_intdigest(p.numpy().tobytes()) for p in pages]
    lead = 33  # bytes before the first record, kept
    offsets = [lead, lead + sizes[0], lead + sum(sizes[:3])]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    seen: list[int] = []  # the file's size at each hash update
    proto = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)
    real = proto(lib.stream_table[3])

    @proto
    def update(state, data, n):
        seen.append(os.fstat(fd).st_size)
        return real(state, data, n)

    table = (ctypes.c_void_p * 5)(*list(lib.stream_table))
    table[3] = ctypes.cast(update, ctypes.c_void_p).value
    monkeypatch.setattr(lib, "stream_at", ctypes.addressof(table))

    def runs() -> np.ndarray:
        return native.make_runs([fd] * 3, offsets, [0, 1, 3], [1, 2, 1])

    try:
        for p in (piece, 0):
            os.ftruncate(fd, 0)
            os.pwrite(fd, b"\x5a" * lead, 0)
            seen.clear()
            table_ = runs()
            sums = native.write(lib, table_, parts, lengths, 1, p, after)
            assert not table_["err"].any() and sums.tolist() == want
            end = lead + sum(sizes)
            data = os.pread(fd, end + 1, 0)
            assert data == b"\x5a" * lead + b"".join(q.numpy().tobytes() for q in pages)
            if p and not in_parts and not after:  # a piece's update, then its write
                first = [lead + i * piece for i in range(4)]
                assert seen == first + [offsets[2], offsets[2] + piece]
            elif p and not in_parts:  # a piece's write, then its update
                first = [lead + i * piece for i in (1, 2, 3)]
                assert seen == first + [offsets[1], offsets[2] + piece, end]
            elif p:  # parts cut the pieces further; never ahead of the file (behind) it
                assert seen == sorted(seen) and (seen[0] > lead if after else seen[0] == lead)
                assert seen[-1] == end if after else offsets[2] < seen[-1] < end
            elif not after:  # hashed whole before each write (one part: no update at all)
                assert set(seen) <= {lead, offsets[1], offsets[2]}
            else:  # each run hashed once written
                assert set(seen) <= {offsets[1], offsets[2], end}
                assert not in_parts or {offsets[1], end} <= set(seen)  # records 0, 3: parts
        if in_parts:
            return
        whole = b"".join(q.numpy().tobytes() for q in pages)
        for threads, table_ in ((2, runs()), (1, native.make_runs([fd], [lead], [0], [2]))):
            # A helper hashes (threads 2: one-shot, no piece of the caller's), or a large
            # record leads a run of two (pieces are for a run of one): each written whole.
            os.ftruncate(fd, lead)
            seen.clear()
            sums = native.write(lib, table_, parts, lengths, threads, piece, after)
            assert not table_["err"].any() and seen == []
            assert sums.tolist()[: table_["count"].sum()] == want[: table_["count"].sum()]
            got = os.pread(fd, end, lead)
            assert got == whole[: len(got)] and len(got) >= sizes[0] + sizes[1]
        for limit, err, hashed in (
            # The file may not grow past the last record's first piece and 5 bytes...
            (offsets[2] + piece + 5, [0, 0, errno.EFBIG], None),
            # ... or past the first record's: the rest of its pieces are neither hashed nor
            # tried (the last record's first piece is, hashed first, then refused).
            (
                lead + piece + 5,
                [errno.EFBIG] * 3,
                [lead + piece] if after else [0, lead + piece, lead + piece + 5],
            ),
        ):
            os.ftruncate(fd, 0)
            seen.clear()
            old = resource.getrlimit(resource.RLIMIT_FSIZE)
            handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            resource.setrlimit(resource.RLIMIT_FSIZE, (limit, old[1]))
            try:
                table_ = runs()
                native.write(lib, table_, parts, lengths, 1, piece, after)
            finally:
                resource.setrlimit(resource.RLIMIT_FSIZE, old)
                signal.signal(signal.SIGXFSZ, handler)
            assert table_["err"].tolist() == err
            assert os.fstat(fd).st_size == limit
            assert hashed is None or seen == hashed, seen
        # Without the binding's streaming calls, a large record of one part is written whole.
        monkeypatch.setattr(lib, "stream_at", None)
        os.ftruncate(fd, 0)
        table_ = runs()
        addr = np.array([p.data_ptr() for p in pages], dtype=np.uint64)  # one part each
        assert native.write(lib, table_, addr, lengths, 1, piece, after).tolist() == want
        assert os.pread(fd, end + 1, 0)[lead:] == whole
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    ("config", "page", "want"),
    [
        ({}, 16 << 10, "worker"),
        ({"io_threads": 0}, 16 << 10, "write threads=1 piece=262144 after=True"),
        ({"io_threads": 0}, 1 << 20, "write threads=1 piece=262144 after=True"),
        ({"write_lanes": 2}, 1 << 20, "write threads=1 piece=262144 after=False"),
        ({"no worker": True}, 16 << 10, "write threads=2 piece=262144 after=False"),
    ],
    ids=["default", "io_threads-0", "io_threads-0-large", "lanes", "no-worker"],
)
def test_each_arrangement_of_a_put_takes_its_write_call(
    tmp_path: Path, lib, monkeypatch: pytest.MonkeyPatch, config: dict, page: int, want: str
) -> None:
    """Small pages by default: a worker writes (the caller hashes beside it). With
    ``io_threads=0``: one call on the caller's thread, each run hashed right after its write
    (fewer CPU seconds a byte), large records in pieces of a run. Each lane of several: one
    call on its thread, each run hashed just before its write, in pieces. No worker to be
    had: one call, a helper hashing while the caller writes. Pages read back."""
    calls: list[str] = []
    write, start = native.write, native.write_start

    def counted_write(lib, runs, buffers, lengths, threads, piece=0, after=False):
        calls.append(f"write threads={threads} piece={piece} after={after}")
        return write(lib, runs, buffers, lengths, threads, piece, after)

    def counted_start(*args, **kwargs):
        calls.append("worker")
        return start(*args, **kwargs)

    if config.pop("no worker", False):  # none could be had: one call, a helper hashing

        def counted_start(*args, **kwargs):
            return None

    monkeypatch.setattr(native, "write", counted_write)
    monkeypatch.setattr(native, "write_start", counted_start)
    b = create_backend("file", root=tmp_path / "l3", **config)
    n = max(2, (2 << 20) // page)
    pages = pages_of([page] * n, 51)
    assert b.set([PoolTransfer("kv", H[:n], pages)]).all_ok
    assert calls and set(calls) == {want}, calls
    out = [torch.full((page,), 0xEE, dtype=torch.uint8) for _ in range(n)]
    assert b.get([PoolTransfer("kv", H[:n], out)]).all_ok
    assert all(torch.equal(o, p) for o, p in zip(out, pages))
    b.close()


def test_pages_of_several_parts_take_the_python_loops_without_the_streaming_calls(
    tmp_path: Path, lib, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the binding's streaming XXH3 calls are not callable, two-part pages go to the
    Python loops (one-part pages stay in C), and round-trip exactly."""
    monkeypatch.setattr(lib, "stream_at", None)
    calls = counting(monkeypatch, ("write_start", "write", "read"))
    sizes = [4096, 65536, RUN_BYTES + 9]
    pages = pages_of(sizes, 31)
    room = 2 * (sum(sizes) + len(sizes))
    src = as_parts(pages, torch.zeros(room, dtype=torch.uint8))
    b = create_backend("file", root=tmp_path / "l3")
    assert b.set([PoolTransfer("kv", H[:3], src)]).all_ok
    out = [torch.full((n,), 0xEE, dtype=torch.uint8) for n in sizes]
    into = as_parts(out, torch.zeros(room, dtype=torch.uint8))
    assert b.get([PoolTransfer("kv", H[:3], into)]).all_ok
    assert all(torch.equal(torch.cat(q), p) for q, p in zip(into, pages))
    assert calls == {"write_start": 0, "write": 0, "read": 0}
    assert b.set([PoolTransfer("kv", H[3:5], pages_of([100, 200], 32))]).all_ok
    assert calls["write_start"] + calls["write"] == 1, "one-part pages stay in the C loops"
    b.close()


def test_a_hash_state_that_cannot_be_made_fails_the_call_not_the_records(
    tmp_path: Path, lib, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No memory for a streaming hash state (its create returns NULL): hashing and writing
    records of several parts raise ``MemoryError``; reading them gives status 3 (not read, so
    not a checksum miss that would drop a good record), one-part records unaffected."""
    if lib.stream_at is None:
        pytest.skip("the binding's streaming XXH3 calls are not callable here")
    create = ctypes.CFUNCTYPE(ctypes.c_void_p)(lambda: None)
    table = (ctypes.c_void_p * 5)(
        ctypes.cast(create, ctypes.c_void_p).value, *list(lib.stream_table)[1:]
    )
    data = pages_of([20_000], 33)[0]
    base = data.data_ptr()
    # Records: two parts, one part, two parts (the last large: read in pieces).
    parts = native.Parts(
        np.array([0, 2, 3, 5], dtype=np.int64),
        np.array([base + x for x in (500, 0, 1000, 2000, 11000)], dtype=np.uint64),
        np.array([500, 500, 1000, 9000, 9000], dtype=np.uint64),
    )
    lengths = np.array([1000, 1000, 18000], dtype=np.uint64)
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        runs = native.make_runs([fd], [0], [0], [3])
        sums = native.write(lib, runs, parts, lengths, 1)  # with a working state
        monkeypatch.setattr(lib, "stream_at", ctypes.addressof(table))
        with pytest.raises(MemoryError):
            native.hash_records(lib, parts, lengths)
        for threads in (1, 2):
            with pytest.raises(MemoryError):
                native.write(lib, native.make_runs([fd], [0], [0], [3]), parts, lengths, threads)
        with pytest.raises(MemoryError):  # the large record, a run of its own, in pieces
            native.write(lib, native.make_runs([fd], [2000], [2], [1]), parts, lengths, 1, 4096)
        # A large record of one part needs no state: without one it is written whole, its sum
        # the one-shot hash's.
        one = native.Parts(
            np.array([0, 1], dtype=np.int64),
            np.array([base], dtype=np.uint64),
            np.array([18000], dtype=np.uint64),
        )
        fd2 = os.open(tmp_path / "g", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            n = np.array([18000], np.uint64)
            got = native.write(lib, native.make_runs([fd2], [0], [0], [1]), one, n, 1, 4096)
            assert got.tolist() == [xxhash.xxh3_64_intdigest(data[:18000].numpy().tobytes())]
            assert os.pread(fd2, 18001, 0) == data[:18000].numpy().tobytes()
        finally:
            os.close(fd2)
        back = torch.zeros_like(data)
        into = native.Parts(
            parts.start, parts.addr - np.uint64(base) + np.uint64(back.data_ptr()), parts.size
        )
        offsets = np.array([0, 1000, 2000], dtype=np.int64)
        for piece in (RUN_BYTES, 4096):  # the large record whole, then in pieces
            status, err = native.read(
                lib, np.full(3, fd, np.int32), offsets, into, lengths, sums, piece, 2
            )
            assert status.tolist() == [3, 1, 3] and err == 0
    finally:
        os.close(fd)


@pytest.mark.parametrize("in_parts", [False, True], ids=["one-part", "parts"])
def test_a_trusted_record_cut_short_is_never_served(tmp_path: Path, lib, in_parts: bool) -> None:
    """A record trusted unchecked (``verify="once"``) whose file now ends inside it: not served,
    read whole or in pieces, one part or several."""
    if in_parts and lib.stream_at is None:
        pytest.skip("the binding's streaming XXH3 calls are not callable here")
    size = 2 * RUN_BYTES + 5
    page = pages_of([size], 34)[0]
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        os.pwrite(fd, page.numpy().tobytes(), 0)
        os.ftruncate(fd, size - 1000)
        out = torch.full((size,), 0xEE, dtype=torch.uint8)
        into: np.ndarray | native.Parts = np.array([out.data_ptr()], dtype=np.uint64)
        if in_parts:
            half = size // 2
            into = native.Parts(
                np.array([0, 2], dtype=np.int64),
                np.array([out.data_ptr(), out.data_ptr() + half], dtype=np.uint64),
                np.array([half, size - half], dtype=np.uint64),
            )
        sums = np.array([xxhash.xxh3_64_intdigest(page.numpy().tobytes())], dtype=np.uint64)
        for piece in (RUN_BYTES, 4 * RUN_BYTES):  # in pieces, and whole
            status, err = native.read(
                lib,
                np.array([fd], np.int32),
                np.zeros(1, np.int64),
                into,
                np.array([size], np.uint64),
                sums,
                piece,
                1,
                np.ones(1, np.uint8),
            )
            assert status.tolist() == [2] and err == 0
    finally:
        os.close(fd)


def test_a_library_that_never_tests_right_is_not_built_again_for_a_while(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Built, then rebuilt, and each time its self-test fails: the failure's marker keeps the
    next loads (each process start) from building it twice again within ``_RETRY_S``."""
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path / "cache"))
    builds: list[Path] = []
    build = native._build

    def counted(target, cc):
        builds.append(target)
        return build(target, cc)

    monkeypatch.setattr(native, "_build", counted)
    monkeypatch.setattr(native, "_self_test", lambda lib: False)
    assert native._load() is None
    assert len(builds) == 2, "built, then rebuilt once"
    assert native._load() is None
    assert len(builds) == 2, "not built again"
    assert list((tmp_path / "cache").glob("*.so.failed"))


def test_processes_started_together_build_the_library_once(tmp_path: Path) -> None:
    """Three processes open the C loops at once on an empty cache (the ranks of a TP engine
    starting on one host): one compiles while the others wait on its lock, and all three load
    what it built; no lock file is left."""
    real = subprocess.run(["sh", "-c", "command -v cc || command -v gcc"], capture_output=True)
    cc = real.stdout.decode().strip()
    if not cc:
        pytest.skip("no C compiler")
    slow, calls = _fake_cc(tmp_path, "slowcc", f'sleep 1\nexec {cc} "$@"')  # a second longer
    cache = tmp_path / "cache"
    script = "from kvtier.storage.segments import native; print(native._load() is not None)"
    env = child_env(CC=str(slow), KVTIER_CACHE_DIR=str(cache))
    procs = [
        subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, env=env, text=True)
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=300)[0].strip() for p in procs]
    assert outs == ["True"] * 3, outs
    assert calls.read_text().count("x") == 1, "built once"
    assert not list(cache.glob("*.lock")), "the lock file goes with the build"


def test_a_build_lock_held_too_long_leaves_the_python_loops(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process holds the build lock past ``_LOCK_WAIT_S`` (a build that hangs there):
    this one runs the Python loops without compiling or marking a failure, and builds once the
    lock is free."""
    import fcntl
    import shutil

    if shutil.which("cc") is None:
        pytest.skip("no C compiler")
    logged, calls = _fake_cc(tmp_path, "logcc", 'exec cc "$@"')
    cache = tmp_path / "cache"
    monkeypatch.setenv("CC", str(logged))
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(cache))
    monkeypatch.setattr(native, "_LOCK_WAIT_S", 0.3)
    assert native._load() is not None  # the library's name, then a fresh cache for the test
    (built,) = cache.glob("native_io-*.so")
    for p in cache.iterdir():
        p.unlink()
    calls.unlink()
    fd = os.open(cache / f"{built.name}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        start = time.monotonic()
        assert native._load() is None
        assert time.monotonic() - start < 10
        assert not calls.exists(), "nothing compiled"
        assert not list(cache.glob("*.failed")), "no failure marked: the next start builds"
    finally:
        os.close(fd)
    assert native._load() is not None
    assert calls.read_text().count("x") == 1
