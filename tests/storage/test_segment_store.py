"""The segment store (``create_backend("file")``): records, journals, restart, LRU eviction by
segment, and its defences against foreign entries, damage, a full disk and a read-only root.

Page bytes are a function of the key (``expected``), so every read is checked byte for byte.
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from kvtier.storage import KeyScope, Namespace, PoolTransfer, create_backend, page_hashes
from kvtier.storage.segments import SegmentBackend
from kvtier.storage.segments.format import (
    ENTRY_SIZE,
    MAX_RECORD_END,
    RECORD_HEAD,
    Entry,
    encode_entry,
    parse_entries,
)
from kvtier.storage.segments.index import Index
from tests.children import child_env

pytestmark = pytest.mark.usefixtures("loops")  # the C loops and the Python loops

NS = Namespace("segment-test", "bfloat16", 4, "page_first")
PAGE = 4096
CALL_BOUND_S = 10.0  # a storage call that takes longer than this is hung, not slow
H = page_hashes(range(4 * 64), NS)
OBJ = [f"{h}.kv.r0" for h in H]  # object keys of pool "kv" under the default (sharded) scope
RECORD = RECORD_HEAD + PAGE
BOUND_S = 10.0  # a wait longer than this is a hang, not a slow machine
ENTRY = ENTRY_SIZE + len(OBJ[0])
T = TypeVar("T")


def expected(h: str, size: int = PAGE) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(h[:15], 16))
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)


def empty(n: int, size: int = PAGE) -> list[torch.Tensor]:
    return list(torch.full((n, size), 0xEE, dtype=torch.uint8).unbind(0))


def put(b: SegmentBackend, hashes: list[str]) -> list[bool]:
    return b.set([PoolTransfer("kv", hashes, [expected(h) for h in hashes])]).ok["kv"]


def served(b: SegmentBackend, hashes: list[str]) -> list[bool]:
    """Per page: read back and equal to its expected bytes (a wrong byte fails the test)."""
    out = empty(len(hashes))
    ok = b.get([PoolTransfer("kv", hashes, out)]).ok["kv"]
    for i, (h, got) in enumerate(zip(hashes, ok)):
        if got:
            assert torch.equal(out[i], expected(h)), f"page {i} served with wrong bytes"
    return ok


def bounded(call: Callable[[], T]) -> T:
    box: dict[str, object] = {}
    t = threading.Thread(target=lambda: box.setdefault("v", call()), daemon=True)
    t.start()
    t.join(CALL_BOUND_S)
    assert not t.is_alive(), f"storage call did not return within {CALL_BOUND_S} s"
    return box["v"]  # type: ignore[return-value]


def snapshot(b: SegmentBackend) -> dict[str, float]:
    return b.metrics.snapshot()


def segments(root: Path) -> list[Path]:
    return sorted(root.glob("*.kvs"))


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "l3"


def test_file_is_the_segment_store(root: Path) -> None:
    b = create_backend("file", root=root)
    assert isinstance(b, SegmentBackend)
    assert put(b, H[:8]) == [True] * 8
    assert len(segments(root)) == 1, "a batch goes to one segment, not one file per page"
    assert served(b, H[:8]) == [True] * 8
    b.close()


def test_roundtrip_parts_duplicates_and_idempotent_set(root: Path) -> None:
    b = create_backend("file", root=root)
    src = [expected(h) for h in H[:4]]
    split = [(p[:1000], p[1000:]) for p in src]  # a page_first page: K range, V range
    assert b.set([PoolTransfer("kv", H[:4] + H[:1], [*split, split[0]])]).all_ok
    before = b.used_bytes
    assert put(b, H[:4]) == [True] * 4
    assert b.used_bytes == before, "a stored key is not rewritten"
    outs = [(x[:3000], x[3000:]) for x in empty(5)]
    assert b.get([PoolTransfer("kv", [*H[:4], H[0]], outs)]).all_ok
    for i, h in enumerate([*H[:4], H[0]]):
        assert torch.equal(torch.cat(outs[i]), expected(h)), f"page {i}"
    assert b.exists([PoolTransfer("kv", H[:6])]) == 4
    b.close()


def test_index_rebuilt_at_restart_and_other_process_writes_seen(root: Path) -> None:
    a = create_backend("file", root=root)
    # Opened before the writes: it must find the new segment and tail it (listing at once).
    reader = create_backend("file", root=root, list_interval_s=0)
    assert put(a, H[:10]) == [True] * 10
    assert reader.exists([PoolTransfer("kv", H[:10])]) == 10, "the next call sees them"
    assert served(reader, H[:10]) == [True] * 10
    a.close()
    again = create_backend("file", root=root)
    assert again.exists([PoolTransfer("kv", H[:10])]) == 10
    assert served(again, H[:10]) == [True] * 10
    assert again.object_keys() and sorted(again.object_keys()) == sorted(OBJ[:10])


def test_wrong_buffer_size_is_a_failed_page_not_a_checksum_miss(root: Path) -> None:
    b = create_backend("file", root=root)
    put(b, H[:2])
    out = [torch.empty(PAGE, dtype=torch.uint8), torch.empty(PAGE * 2, dtype=torch.uint8)]
    assert b.get([PoolTransfer("kv", H[:2], out)]).ok["kv"] == [True, False]
    assert snapshot(b)["checksum_miss_pages"] == 0
    assert served(b, H[:2]) == [True, True], "the record was not dropped"


# -- capacity and eviction -----------------------------------------------------------------------


def two_page_segments(root: Path, capacity: int | None = None) -> SegmentBackend:
    """A store whose segments hold two records each (a batch of two fills one)."""
    b = create_backend(
        "file", root=root, segment_bytes=2 * RECORD, capacity_bytes=capacity, touch_interval_s=0
    )
    assert isinstance(b, SegmentBackend)
    return b


# A full two-record segment and its journal, as the capacity counts them (the journal at least
# at its reservation), and a new segment with its journal reservation.
FINISHED = 2 * RECORD + max(2 * ENTRY, 2 * RECORD // 32)
NEW = 2 * RECORD + max(ENTRY_SIZE + 160, 2 * RECORD // 32)


def test_lru_order_by_segment_survives_restart(root: Path) -> None:
    b = two_page_segments(root)
    for lo in (0, 2, 4):  # segments A, B, C
        assert put(b, H[lo : lo + 2]) == [True, True]
    assert served(b, H[0:2]) == [True, True]  # A is now the most recently used
    b.close()
    assert len(segments(root)) == 3
    again = two_page_segments(root, capacity=3 * FINISHED + NEW - 1)  # D needs one evicted
    assert put(again, H[6:8]) == [True, True]
    assert [again.exists([PoolTransfer("kv", H[lo : lo + 2])]) for lo in (0, 2, 4, 6)] == [
        2,
        0,
        2,
        2,
    ], "B, the least recently used segment, is evicted; A survived by its read"
    assert again.used_bytes <= 3 * FINISHED + NEW - 1


def test_capacity_holds_under_many_writes(root: Path) -> None:
    cap = 5 * FINISHED + NEW
    b = two_page_segments(root, capacity=cap)
    for lo in range(0, 40, 2):
        assert put(b, H[lo : lo + 2]) == [True, True]
        assert b.used_bytes <= cap
    assert b.exists([PoolTransfer("kv", H[38:40])]) == 2
    assert b.exists([PoolTransfer("kv", H[:2])]) == 0, "the oldest were evicted"
    assert put(b, H[:1]) == [True] and served(b, H[:1]) == [True], "and can be written again"


def test_dead_segments_go_first(root: Path) -> None:
    b = two_page_segments(root)
    for lo in (0, 2, 4):
        put(b, H[lo : lo + 2])
    for i in (2, 3):  # damage both records of B: once read, none of its records is live
        span = b.locate(OBJ[i])
        assert span is not None
        flip(span.path, span.offset + span.size - 1)
    assert served(b, H[2:4]) == [False, False]
    assert served(b, H[0:2]) == [True, True]  # A older than C, but touched
    b.close()
    again = two_page_segments(root, capacity=3 * FINISHED + NEW - 1)
    assert served(again, H[2:4]) == [False, False]  # this process learns they are dead too
    assert put(again, H[6:8]) == [True, True]
    assert [again.exists([PoolTransfer("kv", H[lo : lo + 2])]) for lo in (0, 4, 6)] == [2, 2, 2]


def test_page_larger_than_the_capacity_fails_alone(root: Path) -> None:
    b = create_backend("file", root=root, capacity_bytes=3 * RECORD)
    big = torch.zeros(4 * PAGE, dtype=torch.uint8)
    res = b.set([PoolTransfer("kv", H[:1], [big])])
    assert res.ok["kv"] == [False] and snapshot(b)["failed_pages.write"] == 1
    assert put(b, H[1:2]) == [True]


# -- damage and foreign entries -------------------------------------------------------------------


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


@pytest.mark.parametrize("where", ["payload", "page-header", "prefix"])
def test_flipped_byte_is_a_counted_miss_and_the_batch_is_served(root: Path, where: str) -> None:
    b = create_backend("file", root=root)
    put(b, H[:3])
    span = b.locate(OBJ[1])
    assert span is not None
    flip(span.path, span.offset + {"payload": span.size - 7, "page-header": 30, "prefix": 9}[where])
    assert bounded(lambda: served(b, H[:3])) == [True, False, True]
    assert snapshot(b)["checksum_miss_pages"] == 1
    assert b.exists([PoolTransfer("kv", H[:3])]) == 1, "the bad record was dropped"
    assert put(b, H[1:2]) == [True] and served(b, H[:3]) == [True] * 3, "and is written anew"


@pytest.mark.parametrize("verify", ["always", "once"])
def test_flipped_bytes_in_a_long_batch_fail_their_pages_only(root: Path, verify: str) -> None:
    """A batch of several read chunks (one ``preadv`` each, hashed at once): a flipped byte in a
    record fails that page only; the rest of its chunk and the other chunks are served. Read by
    another instance, which trusts nothing it has not verified (``verify="once"`` too)."""
    hashes = page_hashes(range(4 * 200), NS)  # 4 KiB pages: 64 per chunk
    w = create_backend("file", root=root)
    put(w, hashes)
    bad = {5, 130, 131, 199}
    spans = {i: w.locate(f"{hashes[i]}.kv.r0") for i in bad}
    w.close()
    for i, span in spans.items():
        assert span is not None
        flip(span.path, span.offset + i % PAGE)
    b = create_backend("file", root=root, verify=verify)
    want = [i not in bad for i in range(200)]
    assert served(b, hashes) == want
    assert served(b, hashes) == want, "served again (verify='once': trusted now)"
    assert snapshot(b)["checksum_miss_pages"] == len(bad), "each bad record counted once"


def test_a_record_that_verified_once_is_verified_again(root: Path) -> None:
    """The verify rule is 'always': even the writer's own, already-read record."""
    b = create_backend("file", root=root)
    put(b, H[:2])
    assert served(b, H[:2]) == [True, True]
    span = b.locate(OBJ[0])
    assert span is not None
    flip(span.path, span.offset + RECORD_HEAD)
    assert served(b, H[:2]) == [False, True] and snapshot(b)["checksum_miss_pages"] == 1


def test_another_keys_record_copied_in_is_a_miss(root: Path) -> None:
    b = create_backend("file", root=root)
    put(b, H[:3])
    src, dst = b.locate(OBJ[2]), b.locate(OBJ[1])
    assert src is not None and dst is not None
    with open(src.path, "r+b") as f:
        f.seek(src.offset)
        record = f.read(src.size)
        f.seek(dst.offset)
        f.write(record)
    assert served(b, H[:3]) == [True, False, True]
    assert snapshot(b)["checksum_miss_pages"] == 1


def test_truncated_segment_and_torn_journal(root: Path) -> None:
    b = create_backend("file", root=root)
    put(b, H[:4])
    b.close()
    seg = segments(root)[0]
    journal = seg.with_suffix(".kvj")
    os.truncate(seg, 3 * RECORD + RECORD // 2)  # record 3 cut in half
    os.truncate(journal, 4 * ENTRY - 5)  # entry 3 torn too: both must be harmless
    again = create_backend("file", root=root)
    assert bounded(lambda: served(again, H[:4])) == [True, True, True, False]
    os.truncate(journal, 4 * ENTRY)  # zero-filled tail: not an entry either
    third = create_backend("file", root=root)
    assert served(third, H[:4]) == [True, True, True, False]


def test_journal_entry_pointing_past_the_segment_is_a_miss(root: Path) -> None:
    b = create_backend("file", root=root)
    put(b, H[:2])
    b.close()
    seg = segments(root)[0]
    os.truncate(seg, RECORD + RECORD // 2)
    again = create_backend("file", root=root)
    assert served(again, H[:2]) == [True, False]
    assert snapshot(again)["checksum_miss_pages"] == 1


@pytest.mark.parametrize(
    ("offset", "length"),
    [(2**63, PAGE), (2**63 - 1, PAGE), (2**64 - 4096, PAGE), (0, 2**63), (MAX_RECORD_END, 1)],
)
def test_journal_entry_naming_a_record_no_file_can_hold_is_left_out(
    root: Path, offset: int, length: int
) -> None:
    """An entry written whole (its CRC holds) that names a record ending past any file offset
    is not this store's: it is left out of the index, so the other pages of a batch naming its
    key are served, its key is unknown (not an endless miss), and it can be written anew.
    (Served, such an entry failed the whole batch, on every read.)"""
    b = create_backend("file", root=root)
    put(b, H[:4])
    b.close()
    journal = segments(root)[0].with_suffix(".kvj")
    entries, used = parse_entries(journal.read_bytes())
    assert used == journal.stat().st_size and [e.key for e in entries] == OBJ[:4]
    entries[1] = entries[1]._replace(offset=offset, length=length)
    journal.write_bytes(b"".join(encode_entry(e) for e in entries))
    again = create_backend("file", root=root)
    assert bounded(lambda: served(again, H[:4])) == [True, False, True, True]
    assert again.exists([PoolTransfer("kv", H[:4])]) == 1, "the key is not indexed"
    assert served(again, H[2:4]) == [True, True], "and the pages after it in the journal are"
    assert put(again, H[1:2]) == [True] and served(again, H[:4]) == [True] * 4


def test_journal_entry_ending_at_the_bound_is_read() -> None:
    """The bound itself is a record end an entry may name (parse only: no file reaches it)."""
    e = Entry(OBJ[0], MAX_RECORD_END - PAGE, PAGE, 0, 1)
    entries, used = parse_entries(encode_entry(e) + encode_entry(e._replace(offset=MAX_RECORD_END)))
    assert [x.offset for x in entries] == [MAX_RECORD_END - PAGE] and used == 2 * ENTRY


@pytest.mark.parametrize("what", ["kvs", "kvj"])
@pytest.mark.parametrize("kind", ["fifo", "directory", "symlink-out"])
def test_foreign_entry_in_place_of_a_segment_file(
    root: Path, tmp_path: Path, what: str, kind: str
) -> None:
    b = create_backend("file", root=root)
    put(b, H[:2])
    b.close()
    victim = segments(root)[0].with_suffix("." + what)
    outside = tmp_path / "outside"
    shutil.copy(victim, outside)  # a valid file, out of the root
    victim.unlink()
    if kind == "fifo":
        os.mkfifo(victim)
    elif kind == "directory":
        victim.mkdir()
    else:
        victim.symlink_to(outside)
    other = create_backend("file", root=root)
    put(other, H[2:4])  # pages in another segment, read in the same batch
    reader = bounded(lambda: create_backend("file", root=root))
    assert bounded(lambda: served(reader, H[:4])) == [False, False, True, True]
    assert (
        stat.S_IFMT(os.lstat(victim).st_mode)
        == {
            "fifo": stat.S_IFIFO,
            "directory": stat.S_IFDIR,
            "symlink-out": stat.S_IFLNK,
        }[kind]
    ), "a foreign entry is never deleted"
    reader.clear()
    assert victim.exists() or victim.is_symlink()
    assert outside.exists()


def test_lock_file_replaced_by_a_fifo_fails_writes_in_bounded_time(root: Path) -> None:
    b = create_backend("file", root=root)
    put(b, H[:1])
    b.close()
    (root / "lock").unlink()
    os.mkfifo(root / "lock")
    again = create_backend("file", root=root)
    assert bounded(lambda: served(again, H[:1])) == [True], "reads need no lock"
    assert bounded(lambda: put(again, H[1:2])) == [False]
    assert snapshot(again)["failed_pages.write"] == 1


# -- permissions, full disk, read-only root -------------------------------------------------------


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


def test_modes_ignore_the_umask(root: Path) -> None:
    old = os.umask(0)
    try:
        b = create_backend("file", root=root)
        put(b, H[:2])
    finally:
        os.umask(old)
    assert mode(root) == 0o700
    assert {p.name: mode(p) for p in root.iterdir()} == {
        p.name: 0o600 for p in root.iterdir()
    } and len(list(root.iterdir())) == 3


def test_unsafe_root_is_refused(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    root.mkdir(parents=True)
    root.chmod(0o777)
    with pytest.raises(ValueError, match=r"mode 0o777 lets others write"):
        create_backend("file", root=root)
    assert list(root.iterdir()) == []
    with caplog.at_level(logging.WARNING):
        b = create_backend("file", root=root, allow_unsafe_root=True)
    assert "allow_unsafe_root" in caplog.text
    assert put(b, H[:1]) == [True]


@pytest.mark.parametrize(
    "option,value,error",
    [
        ("capacity_bytes", 0, ValueError),
        ("segment_bytes", 1.5, TypeError),
        ("io_threads", -1, ValueError),
        ("file_mode", 0o200, ValueError),
        ("lock_timeout_s", -1, ValueError),
        ("list_interval_s", float("inf"), ValueError),
        ("list_interval_s", float("nan"), ValueError),
        ("touch_interval_s", "1", TypeError),
        ("list_interval_s", 1e300, ValueError),
        ("compact_below", "0.5", TypeError),
    ],
)
def test_config_validates(root: Path, option: str, value: object, error: type) -> None:
    with pytest.raises(error, match=option):
        create_backend("file", root=root, **{option: value})
    assert not root.exists()
    with pytest.raises(ValueError, match="segment_bytes must be at most capacity_bytes"):
        create_backend("file", root=root, capacity_bytes=10, segment_bytes=11)


def in_private_tmpfs(script: str, tmp_path: Path, mount_opts: str) -> subprocess.CompletedProcess:
    """Run ``script`` (Python; ``ROOT`` is a fresh tmpfs mounted with ``mount_opts``) in a mount
    namespace of its own; skip where mounting is not allowed."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare to mount a private tmpfs")
    where = tmp_path / "mnt"
    where.mkdir()
    code = "import os, sys, torch\nROOT = sys.argv[1]\n" + CHILD_PRELUDE + textwrap.dedent(script)
    (tmp_path / "child.py").write_text(code)
    cmd = (
        f"mount -t tmpfs -o {mount_opts} tmpfs {where} || exit 77; "
        f"{sys.executable} {tmp_path / 'child.py'} {where}"
    )
    out = subprocess.run(
        ["unshare", "-m", "sh", "-c", cmd],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(),
    )
    if out.returncode == 77 or "unshare failed" in out.stderr:
        pytest.skip(f"cannot mount a private tmpfs here: {out.stderr.strip()[-200:]}")
    assert out.returncode == 0, out.stdout + out.stderr
    return out


CHILD_PRELUDE = """
from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes
H = page_hashes(range(4 * 400), Namespace("segment-test", "bfloat16", 4, "page_first"))
def src(h):
    g = torch.Generator().manual_seed(int(h[:15], 16))
    return torch.randint(0, 256, (4096,), dtype=torch.uint8, generator=g)
"""


def test_full_disk_fails_pages_and_keeps_what_is_stored(tmp_path: Path) -> None:
    script = """
    b = create_backend("file", root=ROOT + "/l3", segment_bytes=64 << 10)
    stored, failed_batches = [], 0
    for lo in range(0, 400, 8):
        ok = b.set([PoolTransfer("kv", H[lo:lo + 8], [src(h) for h in H[lo:lo + 8]])]).ok["kv"]
        stored += [h for h, k in zip(H[lo:lo + 8], ok) if k]
        failed_batches += not all(ok)
    assert failed_batches > 0, "a 1 MiB disk must fill up"
    assert b.metrics.snapshot()["failed_pages.write"] > 0
    out = [torch.empty(4096, dtype=torch.uint8) for _ in stored]
    assert b.get([PoolTransfer("kv", stored, out)]).all_ok
    assert all(torch.equal(o, src(h)) for o, h in zip(out, stored))
    b.close()
    again = create_backend("file", root=ROOT + "/l3")
    out = [torch.empty(4096, dtype=torch.uint8) for _ in stored]
    assert again.get([PoolTransfer("kv", stored, out)]).all_ok, "a reader after restart too"
    assert all(torch.equal(o, src(h)) for o, h in zip(out, stored))
    print("stored", len(stored))
    """
    out = in_private_tmpfs(script, tmp_path, "size=1m")
    assert "stored" in out.stdout


def test_read_only_root_serves_reads_and_fails_writes(tmp_path: Path) -> None:
    script = """
    import subprocess
    b = create_backend("file", root=ROOT + "/l3", segment_bytes=256 << 10)
    assert b.set([PoolTransfer("kv", H[:4], [src(h) for h in H[:4]])]).all_ok
    b.close()
    subprocess.run(["mount", "-o", "remount,ro", ROOT], check=True)
    ro = create_backend("file", root=ROOT + "/l3")
    out = [torch.empty(4096, dtype=torch.uint8) for _ in range(4)]
    assert ro.get([PoolTransfer("kv", H[:4], out)]).all_ok
    assert all(torch.equal(o, src(h)) for o, h in zip(out, H[:4]))
    res = ro.set([PoolTransfer("kv", H[4:6], [src(h) for h in H[4:6]])])
    assert res.ok["kv"] == [False, False], res
    assert ro.metrics.snapshot()["failed_pages.write"] == 2
    print("read-only ok")
    """
    out = in_private_tmpfs(script, tmp_path, "size=4m")
    assert "read-only ok" in out.stdout


def test_scope_keys_do_not_alias(root: Path) -> None:
    sharded = create_backend("file", root=root)
    put(sharded, H[:1])
    replicated = create_backend("file", root=root, scope=KeyScope(replicated=True))
    out = empty(1)
    assert replicated.get([PoolTransfer("r0", [H[0] + ".kv"], out)]).ok["r0"] == [False]
    assert replicated.exists([PoolTransfer("kv", H[:1])]) == 0


def test_journal_read_in_chunks_that_cut_entries(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from kvtier.storage.segments import index

    b = create_backend("file", root=root)
    put(b, H[:20])
    b.close()
    monkeypatch.setattr(index, "_JOURNAL_READ", ENTRY * 3 + ENTRY // 2)  # ends mid-entry
    again = create_backend("file", root=root)
    assert again.exists([PoolTransfer("kv", H[:20])]) == 20
    assert served(again, H[:20]) == [True] * 20


def _count_listings(monkeypatch) -> list[int]:
    n = [0]
    rescan = Index._rescan_locked

    def counted(self):
        n[0] += 1
        return rescan(self)

    monkeypatch.setattr(Index, "_rescan_locked", counted)
    return n


def test_a_put_stream_does_not_list_the_root_every_batch(root: Path, monkeypatch) -> None:
    """A listing costs O(files in the root) and this store's own rolls change the root: within
    ``list_interval_s`` of the last listing, batches (and misses) do not list it again; a forced
    listing still does. Another store listing at once sees every page."""
    listings = _count_listings(monkeypatch)
    b = create_backend("file", root=root, segment_bytes=2 * RECORD, list_interval_s=3600)
    assert listings[0] == 1  # at start-up
    for i in range(0, 16, 2):  # a roll every batch
        assert put(b, H[i : i + 2]) == [True, True]
    assert served(b, H[:16]) == [True] * 16
    assert b.exists([PoolTransfer("kv", H[16:20])]) == 0  # misses
    assert listings[0] == 1, "no listing within the interval"
    with b._index.mutex:
        b._index.forget_listing_locked()
        b._index.refresh_locked(tail=True)
    assert listings[0] == 2, "a forced listing is never held back"
    other = create_backend("file", root=root, list_interval_s=0)
    assert served(other, H[:16]) == [True] * 16
    b.close()
    other.close()


def test_another_process_pages_seen_within_the_list_interval(root: Path) -> None:
    """Another store's new segments are seen within ``list_interval_s`` (a small root lists in
    microseconds, so ten times its cost is far below): a reader opened before the writes finds
    them by a call within the interval plus a generous slack for a loaded machine."""
    a = create_backend("file", root=root)
    reader = create_backend("file", root=root, list_interval_s=0.05)
    assert reader.exists([PoolTransfer("kv", H[:10])]) == 0
    assert put(a, H[:10]) == [True] * 10
    deadline = time.monotonic() + 0.05 + 2.0  # slack for a loaded CI machine
    while reader.exists([PoolTransfer("kv", H[:10])]) != 10:
        assert time.monotonic() < deadline, "another store's pages not seen within the interval"
    assert served(reader, H[:10]) == [True] * 10
    a.close()
    reader.close()


def test_a_costly_listing_waits_ten_times_its_cost(root: Path, monkeypatch) -> None:
    """However small ``list_interval_s``, listings are ten times their own cost apart (a root of
    many files is listed at most ~10% of the time); a forced listing still goes at once."""
    listings = _count_listings(monkeypatch)
    b = create_backend("file", root=root, segment_bytes=2 * RECORD, list_interval_s=0)
    with b._index.mutex:
        b._index._list_cost_ns = 10**15  # as if the start-up listing had taken days
    for i in range(0, 8, 2):
        assert put(b, H[i : i + 2]) == [True, True]
    assert listings[0] == 1
    with b._index.mutex:
        b._index.forget_listing_locked()
        b._index.refresh_locked(tail=True)
    assert listings[0] == 2
    b.close()


def test_journals_read_at_start_up_do_not_hold_listings_back(root: Path, monkeypatch) -> None:
    """A listing waits ten times the listing's own cost (the directory read), not the journals
    it tails: a start-up that rebuilds a large index must not hold back the next listings."""
    w = create_backend("file", root=root)
    assert put(w, H[:4]) == [True] * 4
    w.close()
    tail = Index._tail_locked

    def slow_tail(self, seg):
        time.sleep(0.2)  # stands in for parsing a million journal entries
        return tail(self, seg)

    monkeypatch.setattr(Index, "_tail_locked", slow_tail)
    b = create_backend("file", root=root, list_interval_s=0)
    with b._index.mutex:
        assert b._index._list_cost_ns < 100_000_000, b._index._list_cost_ns
    b.close()


def test_a_closed_store_never_touches_the_root_that_reuses_its_descriptor(root: Path) -> None:
    """After ``close()`` the descriptor numbers a store held may name another root: its calls
    fail their pages (and ``clear`` raises) instead of reading or deleting the other root's."""
    a = create_backend("file", root=root / "a")
    assert put(a, H[:2]) == [True, True]
    a.close()
    b = create_backend("file", root=root / "b")  # likely takes a's old descriptor numbers
    assert put(b, H[10:14]) == [True] * 4
    assert a.exists([PoolTransfer("kv", H[10:14])]) == 0
    assert a.get([PoolTransfer("kv", H[10:14], empty(4))]).ok["kv"] == [False] * 4
    assert a.delete([PoolTransfer("kv", H[10:14])]).ok["kv"] == [False] * 4
    assert put(a, H[20:22]) == [False, False]
    with pytest.raises(ValueError, match="used after close"):
        a.object_keys()
    with pytest.raises(ValueError, match="used after close"):
        a.clear()
    assert served(b, H[10:14]) == [True] * 4
    assert sorted(b.object_keys()) == sorted(KeyScope().object_keys(H[10:14], "kv"))
    b.close()


def test_start_up_over_more_segments_than_descriptors(tmp_path: Path) -> None:
    """A root of more segments than the descriptor limit is indexed whole at start-up (one new
    journal open at a time, and none kept open for a writer that has exited), in a child process
    whose soft limit is 128: 100 segments of one writer and one segment each of 100 more."""
    script = f"""
    import resource
    root = {str(tmp_path / "l3")!r}
    record = {RECORD}
    w = create_backend("file", root=root, segment_bytes=record, list_interval_s=0)
    assert all(w.set([PoolTransfer("kv", [h], [src(h)])]).all_ok for h in H[:100])
    w.close()
    for h in H[100:200]:  # 100 writers that have exited (engine restarts): one segment each
        x = create_backend("file", root=root)
        assert x.set([PoolTransfer("kv", [h], [src(h)])]).all_ok
        x.close()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, hard))
    r = create_backend("file", root=root)
    print("seen", r.exists([PoolTransfer("kv", H[:200])]))
    print("journals open", sum(s.jfd is not None for s in r._index.segments.values()))
    """
    code = "import sys, torch\n" + CHILD_PRELUDE + textwrap.dedent(script)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=child_env()
    )
    assert out.returncode == 0, out.stderr
    assert "seen 200" in out.stdout and "journals open 0" in out.stdout, out.stdout


def test_only_segment_names_leave_the_name_books(root: Path) -> None:
    """A file of another extension sharing a segment's stem comes and goes without the segment
    leaving the books; a writer whose segments are all gone is forgotten."""
    w = create_backend("file", root=root, segment_bytes=2 * RECORD, list_interval_s=0)
    assert put(w, H[:3]) == [True] * 3  # two segments: the first finished
    r = create_backend("file", root=root, list_interval_s=0)
    first = sorted(p.stem for p in root.glob("*.kvs"))[0]
    stray = root / f"{first}.tmp"
    stray.write_bytes(b"")
    with r._index.mutex:
        r._index.forget_listing_locked()  # the root's mtime may not have moved (coarse clock)
        r._index.refresh_locked(tail=True)
        assert stray.name in r._index._names
    stray.unlink()
    with r._index.mutex:
        r._index.forget_listing_locked()  # the root's mtime may not have moved (coarse clock)
        r._index.refresh_locked(tail=True)
        assert first in r._index._journals and first in r._index._data
        assert r._index._latest and set(r._index._latest) <= w._index.writers
    w.clear()  # every segment of the root: w's own active one too
    w.close()
    assert r.exists([PoolTransfer("kv", H[:3])]) == 0
    with r._index.mutex:
        assert r._index._latest == {}, "a writer with no segments left is forgotten"
    r.close()


@pytest.mark.parametrize("call", ["put", "get"])
def test_close_waits_for_the_calls_in_flight(root: Path, call: str) -> None:
    """``close`` on one thread while another thread's call is inside the store (a put inside
    the writer, or a get inside the reader, which holds no lock ``close`` takes): the gate shuts
    at once (new calls are refused), ``close`` waits until the call has finished with its pages
    right, and only then closes the descriptors; a new store on the root serves the pages."""
    b = create_backend("file", root=root)
    if call == "get":
        assert put(b, H[:2]) == [True, True]
    entered, release = threading.Event(), threading.Event()
    owner, name = (b._writer, "append") if call == "put" else (b._reader, "read")
    inner = getattr(owner, name)

    def held(*args, **kwargs):
        entered.set()
        assert release.wait(BOUND_S)
        return inner(*args, **kwargs)

    setattr(owner, name, held)
    got: dict[str, object] = {}
    work = (lambda: put(b, H[:2])) if call == "put" else (lambda: served(b, H[:2]))
    caller = threading.Thread(target=lambda: got.setdefault(call, work()))
    caller.start()
    assert entered.wait(BOUND_S)
    closer = threading.Thread(target=b.close)
    closer.start()
    deadline = time.monotonic() + BOUND_S
    while not b._gate.closed:
        assert time.monotonic() < deadline, "close never shut the gate"
    assert put(b, H[4:6]) == [False, False], "a call after close began is refused"
    assert closer.is_alive(), "close returned while a call was inside the store"
    release.set()
    caller.join(BOUND_S)
    closer.join(BOUND_S)
    assert not caller.is_alive() and not closer.is_alive()
    assert got[call] == [True, True]
    again = create_backend("file", root=root)
    assert served(again, H[:2]) == [True, True]
    again.close()


def test_close_from_a_handler_inside_the_gate_refuses(root: Path) -> None:
    """A signal handler runs between any two bytecodes, also while its thread holds the gate's
    own lock (inside ``enter`` or ``leave``): a ``close`` there raises instead of hanging."""
    b = create_backend("file", root=root)
    with b._gate._cv:  # where such a handler would find its thread
        with pytest.raises(RuntimeError, match="same thread"):
            b.close()
    assert put(b, H[:2]) == [True, True]
    b.close()
    assert put(b, H[2:4]) == [False, False]


def test_close_from_inside_a_call_on_the_same_thread_refuses(root: Path) -> None:
    """A ``close`` made by the thread that is inside a call (a signal handler that runs in the
    middle of a put, say) raises ``RuntimeError`` instead of waiting for itself forever; the
    store stays open and works."""
    b = create_backend("file", root=root)
    append = b._writer.append
    raised: list[BaseException] = []

    def closing_append(*args, **kwargs):
        try:
            b.close()
        except RuntimeError as e:
            raised.append(e)
        return append(*args, **kwargs)

    b._writer.append = closing_append
    assert bounded(lambda: put(b, H[:2])) == [True, True]
    assert len(raised) == 1 and "same thread" in str(raised[0])
    b._writer.append = append
    assert put(b, H[2:4]) == [True, True] and served(b, H[:4]) == [True] * 4
    b.close()
    assert put(b, H[4:6]) == [False, False]


def test_a_root_that_cannot_be_listed_is_retried_at_the_interval(root: Path, monkeypatch) -> None:
    """A listing that fails (no descriptor left, say) is logged and retried, but at the rate
    limit's pace, not on every call; once it works again the store catches up."""
    import kvtier.storage.segments.index as index_module

    b = create_backend("file", root=root, list_interval_s=3600)
    other = create_backend("file", root=root, list_interval_s=0)
    assert put(other, H[:2]) == [True, True]
    tries = [0]
    listdir = os.listdir

    def failing(fd):
        tries[0] += 1
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(index_module.os, "listdir", failing)
    with b._index.mutex:
        b._index.forget_listing_locked()
    for _ in range(20):
        assert b.exists([PoolTransfer("kv", H[:2])]) == 0
    assert tries[0] == 1, "a failing listing is retried at the interval, not on every call"
    with b._index.mutex:
        entries = dict(b._index.entries)
    # A delete of keys the store could not list is not reported done (they may be held).
    assert b.delete([PoolTransfer("kv", H[:2])]).ok["kv"] == [False, False]
    monkeypatch.setattr(index_module.os, "listdir", listdir)
    # Later, with nothing forcing a listing and the root unchanged: the failed listing is
    # retried once its turn comes (clocks moved past the interval and the coarse-mtime window).
    real_time = index_module.time

    class Later:
        def __getattr__(self, name):
            return getattr(real_time, name)

        def monotonic_ns(self):
            return real_time.monotonic_ns() + 7200 * 10**9

        def time_ns(self):
            return real_time.time_ns() + 7200 * 10**9

    monkeypatch.setattr(index_module, "time", Later())
    assert b.exists([PoolTransfer("kv", H[:2])]) == 2
    with b._index.mutex:
        assert len(b._index.entries) > len(entries)
    other.close()
    b.close()


@pytest.mark.parametrize("how", ["close", "kill"])
def test_a_writer_gone_leaves_its_newest_journal_final(root: Path, how: str) -> None:
    """Another writer's newest journal is tailed while the writer holds its segment; once the
    writer has finished it (``close``) or died (``kill -9``), the next listing reads it to the
    end and closes it (final: its segment may now be compacted), and its pages stay served."""
    r = create_backend("file", root=root, list_interval_s=0)
    script = f"""
    import os, signal
    w = create_backend("file", root={str(root)!r})
    assert w.set([PoolTransfer("kv", H[:3], [src(h) for h in H[:3]])]).all_ok
    print("stored", flush=True)
    if {how!r} == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    w.close()
    """
    code = "import sys, torch\n" + CHILD_PRELUDE + textwrap.dedent(script)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=child_env()
    )
    assert "stored" in out.stdout, out.stderr
    assert out.returncode == (-9 if how == "kill" else 0), out.stderr
    with r._index.mutex:
        r._index.forget_listing_locked()
        r._index.refresh_locked(tail=True)
        other = [seg for seg in r._index.segments.values() if seg.writer not in r._index.writers]
        assert other and all(seg.jfd is None for seg in other), "a gone writer's journal is final"
    assert served(r, H[:3]) == [True] * 3
    live = create_backend("file", root=root, list_interval_s=0)
    assert put(live, H[3:4]) == [True]
    with r._index.mutex:
        r._index.forget_listing_locked()
        r._index.refresh_locked(tail=True)
        mine = [s for s in r._index.segments.values() if s.writer in live._index.writers]
        assert mine and all(s.jfd is not None for s in mine), "a live writer's journal stays open"
    live.close()
    r.close()


def test_a_delete_lists_the_root_at_most_once(root: Path, monkeypatch) -> None:
    """A delete of keys this store has not seen lists the root, once: not again when its first
    catch-up has just listed (the root changed since the last listing)."""
    listings = _count_listings(monkeypatch)
    b = create_backend("file", root=root, list_interval_s=0)
    other = create_backend("file", root=root, list_interval_s=0)
    assert put(other, H[:2]) == [True, True]  # a new segment: the root changed
    before = listings[0]
    assert b.delete([PoolTransfer("kv", H[:2] + H[10:12])]).all_ok  # two never stored
    assert listings[0] == before + 1
    assert b.delete([PoolTransfer("kv", H[10:12])]).all_ok  # root unchanged: a forced listing
    assert listings[0] == before + 2
    assert other.exists([PoolTransfer("kv", H[:2])]) == 0
    other.close()
    b.close()


def test_close_under_load_from_other_threads(root: Path) -> None:
    """Four threads put and read back their own pages while another thread closes the store:
    every call returns (refused ones fail their pages, nothing raises), every page read back is
    right, and every page a put reported stored is served by a new store on the root."""
    b = create_backend("file", root=root, segment_bytes=8 * RECORD)
    started = threading.Barrier(5)
    warmed = [threading.Event() for _ in range(4)]
    stored: list[list[str]] = [[] for _ in range(4)]
    errors: list[BaseException] = []

    def worker(w: int) -> None:
        try:
            started.wait(BOUND_S)
            for i in range(w, len(H), 4):
                ok = put(b, [H[i]])
                if ok == [True]:
                    stored[w].append(H[i])
                got = served(b, stored[w])  # asserts the bytes of every page served
                if len(stored[w]) >= 3:
                    warmed[w].set()
                if ok == [False]:
                    assert got == [False] * len(stored[w]), "a closed store serves nothing"
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            warmed[w].set()

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    started.wait(BOUND_S)
    for e in warmed:
        assert e.wait(BOUND_S)
    bounded(b.close)
    for t in threads:
        t.join(BOUND_S)
        assert not t.is_alive()
    assert not errors, errors
    again = create_backend("file", root=root)
    everything = [h for pages in stored for h in pages]
    assert len(everything) >= 12
    assert served(again, everything) == [True] * len(everything)
    again.close()


def test_collection_does_not_join_the_io_threads(root: Path, monkeypatch, python_loops) -> None:
    """A store collected as garbage closes without joining its IO threads: a collection can run
    inside ``threading``'s bookkeeping of a thread starting, holding a lock the exiting threads
    need (the suite once hung there); they are told to stop and exit on their own."""
    from concurrent.futures import ThreadPoolExecutor

    b = create_backend("file", root=root)
    assert put(b, H[:2]) == [True, True] and served(b, H[:2]) == [True, True]
    pools = list(b._pools.values())
    assert pools
    waits: list[bool] = []
    shutdown = ThreadPoolExecutor.shutdown
    monkeypatch.setattr(
        ThreadPoolExecutor, "shutdown", lambda self, wait=True, **kw: waits.append(wait)
    )
    b.__del__()
    monkeypatch.setattr(ThreadPoolExecutor, "shutdown", shutdown)
    assert waits and not any(waits), waits
    for pool in pools:
        pool.shutdown(wait=True)
    assert put(b, H[2:4]) == [False, False]
    again = create_backend("file", root=root)
    assert served(again, H[:2]) == [True, True]
    again.close()


def test_a_listing_stretched_by_preemption_does_not_hold_the_next_back(
    root: Path, monkeypatch
) -> None:
    """The rate limit scales with the CPU a listing took, not its wall time: a listing whose
    thread lost the CPU for a while (a loaded machine; a sleep stands in for it) costs little,
    and another store's new segments are still seen at once with ``list_interval_s=0``."""
    from kvtier.storage.segments import index as index_module

    real = index_module.os.listdir

    def preempted(fd):
        time.sleep(0.05)
        return real(fd)

    reader = create_backend("file", root=root, list_interval_s=0)
    monkeypatch.setattr(index_module.os, "listdir", preempted)
    with reader._index.mutex:
        reader._index.forget_listing_locked()
        reader._index.refresh_locked(tail=True)
        assert reader._index._list_cost_ns < 20_000_000, reader._index._list_cost_ns
    monkeypatch.setattr(index_module.os, "listdir", real)
    w = create_backend("file", root=root)
    assert put(w, H[:4]) == [True] * 4
    assert served(reader, H[:4]) == [True] * 4  # listed at once: not 10 x 50 ms later
    w.close()
    reader.close()
