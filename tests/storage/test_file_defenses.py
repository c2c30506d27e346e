"""The file store defends itself: malformed keys, foreign entries in the root, permissions, and
the temp files of live writers.

Each case checks that the offending page alone fails (the batch's other pages are served), that
the failure is counted, and that nothing outside the root is created, read or followed.
"""

from __future__ import annotations

import logging
import os
import stat
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import torch

from kvtier.metrics import TierMetrics
from kvtier.storage import (
    KeyScope,
    Namespace,
    PoolTransfer,
    StorageBackend,
    page_hashes,
)
from kvtier.storage.base import MAX_KEY_LENGTH, Parts, validate_key
from kvtier.storage.file_backend import FilePerPageBackend as FileBackend
from kvtier.storage.page_format import HEADER_SIZE

pytestmark = pytest.mark.usefixtures("loops")  # the C loops and the Python loops


def per_page(
    *, scope: KeyScope | None = None, metrics: TierMetrics | None = None, **config: object
) -> FileBackend:
    """The per-page file store (``create_backend("file")`` is the segment store, tested in
    ``test_segment_store.py``): these tests pin its per-page-file format and defences."""
    return FileBackend(FileBackend.Config(**config), scope=scope, metrics=metrics)


NS = Namespace("test-model", "bfloat16", 4, "page_first")
PAGE = 1024
CALL_BOUND_S = 10.0  # a storage call that takes longer than this is hung, not slow
T = TypeVar("T")

H = page_hashes(range(4 * 8), NS)
GOOD = [H[0], H[2]]  # the good pages around a bad one in each batch

BAD_HASHES = {
    "dotdot-escape": "../../escape",
    "absolute": "/abs",
    "slash": "a/b",
    "dotdot": "..",
    "nul": H[1][:10] + "\0" + H[1][11:],
    "empty": "",
    "too-long": H[1] * 4,
    "upper-hex": H[1].upper(),
    "short-hex": H[1][:63],
    "hash-with-pool": H[1] + ".kv",
    # Against the batch check (one regex over the hashes joined by newlines):
    "newline-inside": H[1][:32] + "\n" + H[1][33:],
    "two-hashes-in-one": H[1] + "\n" + H[3],
    "trailing-newline": H[1] + "\n",
    "int": 5,
    "none": None,
    "bytes": H[1].encode(),
}


def pages(n: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return list(torch.randint(0, 256, (n, PAGE), dtype=torch.uint8, generator=g).unbind(0))


def empty(n: int) -> list[torch.Tensor]:
    return list(torch.full((n, PAGE), 0xEE, dtype=torch.uint8).unbind(0))


def tree(top: Path) -> list[str]:
    """Every entry under ``top`` (symlinks listed, never followed), relative to it."""
    out = []
    for d, dirs, names in os.walk(top, followlinks=False):
        out += [os.path.relpath(os.path.join(d, n), top) for n in dirs + names]
    return sorted(out)


def bounded(call: Callable[[], T], fifo: Path | None = None) -> T:
    """``call()`` on a daemon thread, asserting that it ends within ``CALL_BOUND_S``."""
    box: dict[str, object] = {}

    def run() -> None:
        try:
            box["value"] = call()
        except Exception as e:  # noqa: BLE001 - re-raised in the test thread below
            box["error"] = e

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(CALL_BOUND_S)
    if t.is_alive():
        if fifo is not None:  # release a reader blocked on the FIFO, so the thread can end
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError:
                pass
        pytest.fail(f"storage call did not return within {CALL_BOUND_S} s")
    if "error" in box:
        raise box["error"]  # type: ignore[misc]
    return box["value"]  # type: ignore[return-value]


def page_file(root: Path, h: str) -> Path:
    return root / f"{h}.kv.r0.kvp"


@pytest.fixture
def root(tmp_path: Path) -> Path:
    return tmp_path / "outer" / "l3"


@pytest.fixture
def stored(root: Path) -> Iterator[tuple[FileBackend, list[torch.Tensor]]]:
    """A backend that stored pages 0..2 (and so indexed them), and their bytes."""
    b = per_page(root=root)
    src = pages(3, 0)
    assert b.set([PoolTransfer("kv", H[:3], src)]).all_ok
    yield b, src
    b.close()


def failed(b: StorageBackend, direction: str) -> float:
    return b.metrics.snapshot()[f"failed_pages.{direction}"]


def assert_good_pages_served(b: StorageBackend, src: list[torch.Tensor]) -> None:
    """Pages 0 and 2 read back exactly and page 1 is a miss, in one batch, in bounded time."""
    out = empty(3)
    res = bounded(lambda: b.get([PoolTransfer("kv", H[:3], out)]))
    assert res.ok["kv"] == [True, False, True], res.ok
    assert torch.equal(out[0], src[0]) and torch.equal(out[2], src[2])


# -- keys ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", list(BAD_HASHES.values()), ids=list(BAD_HASHES))
def test_bad_key_fails_only_its_page(tmp_path: Path, root: Path, bad: object) -> None:
    b = per_page(root=root)
    before = tree(tmp_path)
    keys = [GOOD[0], bad, GOOD[1]]
    src = pages(3, 1)
    res = b.set([PoolTransfer("kv", keys, src)])  # type: ignore[list-item]
    assert res.ok["kv"] == [True, False, True], res.ok
    assert failed(b, "write") == 1
    out = empty(3)
    res = b.get([PoolTransfer("kv", keys, out)])  # type: ignore[list-item]
    assert res.ok["kv"] == [True, False, True], res.ok
    assert torch.equal(out[0], src[0]) and torch.equal(out[2], src[2])
    assert torch.equal(out[1], empty(1)[0]), "a refused page's buffer is left alone"
    assert failed(b, "read") == 1
    assert b.exists([PoolTransfer("kv", keys)]) == 1, "a bad key is absent"  # type: ignore[list-item]
    assert b.exists([PoolTransfer("kv", GOOD)]) == 2
    assert b.metrics.snapshot()["checksum_miss_pages"] == 0
    new = sorted(set(tree(tmp_path)) - set(before))
    pagefiles = sorted(os.path.join("outer", "l3", page_file(root, h).name) for h in GOOD)
    assert new == pagefiles, "only the good pages' files appear, inside the root"


def test_hashes_whose_lengths_add_up_are_refused(root: Path) -> None:
    """A 63-char and a 65-char key join to the length of two hashes; both still fail."""
    b = per_page(root=root)
    keys = [GOOD[0], H[1][:63], H[3] + "0", GOOD[1]]
    src = pages(4, 3)
    assert b.set([PoolTransfer("kv", keys, src)]).ok["kv"] == [True, False, False, True]
    out = empty(4)
    assert b.get([PoolTransfer("kv", keys, out)]).ok["kv"] == [True, False, False, True]
    assert torch.equal(out[0], src[0]) and torch.equal(out[3], src[3])
    assert sorted(p.name for p in root.iterdir()) == sorted(page_file(root, h).name for h in GOOD)


def test_hash_carrying_a_suffix_cannot_alias_another_pool(root: Path) -> None:
    """``<hash>.kv`` in a replicated pool ``r0`` would name ``<hash>.kv.r0``, rank 0's kv page."""
    sharded = per_page(root=root)
    src = pages(1, 2)
    assert sharded.set([PoolTransfer("kv", H[:1], src)]).all_ok
    replicated = per_page(root=root, scope=KeyScope(replicated=True))
    out = empty(1)
    assert replicated.get([PoolTransfer("r0", [H[0] + ".kv"], out)]).ok["r0"] == [False]
    assert replicated.exists([PoolTransfer("r0", [H[0] + ".kv"])]) == 0
    assert not torch.equal(out[0], src[0])


def test_bad_key_on_a_rank_that_does_not_write(root: Path) -> None:
    """Rank 1 of a replicated cache writes nothing, but still reports a bad key as failed."""
    b = per_page(root=root, scope=KeyScope(tp_rank=1, tp_size=2, replicated=True))
    res = b.set([PoolTransfer("kv", [GOOD[0], "../x", GOOD[1]], pages(3, 3))])
    assert res.ok["kv"] == [True, False, True]
    assert failed(b, "write") == 1


GOOD_KEYS = [f"{H[0]}.kv", f"{H[0]}.kv.r0", f"{H[0]}.mamba_2.r15"]
BAD_KEYS = {
    "dotdot-escape": "../../escape",
    "absolute": "/abs",
    "slash": "a/b",
    "dotdot": "..",
    "nul": f"{H[0]}.k\0v",
    "empty": "",
    "too-long": f"{H[0]}." + "a" * MAX_KEY_LENGTH,
    "upper-hex": f"{H[0].upper()}.kv",
    "no-pool": H[0],
    "upper-pool": f"{H[0]}.KV",
    "dash-pool": f"{H[0]}.kv-x",
    "empty-pool": f"{H[0]}..kv",
    "bad-rank": f"{H[0]}.kv.r",
    "padded-rank": f"{H[0]}.kv.r01",
    "suffix": f"{H[0]}.kv.r0.kvp",
}


@pytest.mark.parametrize("key", GOOD_KEYS)
def test_validate_key_accepts_object_names(key: str) -> None:
    assert validate_key(key) == key


@pytest.mark.parametrize("key", list(BAD_KEYS.values()), ids=list(BAD_KEYS))
def test_validate_key_names_the_bad_key(key: str) -> None:
    with pytest.raises(ValueError) as e:
        validate_key(key)
    assert str(e.value).startswith("key "), str(e.value)
    assert repr(key)[:40] in str(e.value)


@pytest.mark.parametrize("key", [5, None, b"abc", ["a"]], ids=["int", "none", "bytes", "list"])
def test_validate_key_refuses_non_str(key: object) -> None:
    with pytest.raises(TypeError, match=f"key .* must be a str, got {type(key).__name__}"):
        validate_key(key)


def test_misuse_of_a_whole_transfer_raises_and_changes_nothing(tmp_path: Path, root: Path) -> None:
    b = per_page(root=root)
    before = tree(tmp_path)
    with pytest.raises(TypeError, match="keys must be a sequence of page hashes, got one str"):
        b.set([PoolTransfer("kv", H[0], pages(1, 4))])
    with pytest.raises(TypeError, match="keys must be a sequence"):
        b.exists([PoolTransfer("kv", H[0])])
    with pytest.raises(ValueError, match="pool name must match"):
        b.set([PoolTransfer("../x", H[:1], pages(1, 4))])
    with pytest.raises(ValueError, match="pool name must be at most 64 chars"):
        b.get([PoolTransfer("p" * 65, H[:1], empty(1))])
    assert tree(tmp_path) == before


class Recording(StorageBackend):
    """An in-memory backend that records every object key the base class hands it."""

    name = "recording-test"

    def __init__(self) -> None:
        super().__init__()
        self.objects: dict[str, bytes] = {}
        self.seen: list[str] = []

    def _contains(self, object_keys: list[str]) -> list[bool]:
        self.seen += object_keys
        return [k in self.objects for k in object_keys]

    def _read(self, object_keys: list[str], pages: list[Parts]) -> list[bool]:
        self.seen += object_keys
        for k, parts in zip(object_keys, pages):
            parts[0].copy_(torch.frombuffer(bytearray(self.objects[k]), dtype=torch.uint8))
        return [True] * len(object_keys)

    def _write(self, object_keys: list[str], pages: list[Parts]) -> list[bool]:
        self.seen += object_keys
        for k, parts in zip(object_keys, pages):
            self.objects[k] = parts[0].numpy().tobytes()
        return [True] * len(object_keys)

    def clear(self) -> None:
        self.objects.clear()


def test_every_backend_gets_only_valid_keys() -> None:
    """Validation lives in the base class's entry points, so Mooncake (or any backend) gets it."""
    b = Recording()
    bad = list(BAD_HASHES.values())
    keys = [GOOD[0], *bad, GOOD[1]]
    src = pages(len(keys), 5)
    assert b.set([PoolTransfer("kv", keys, src)]).ok["kv"] == [True] + [False] * len(bad) + [True]
    assert b.get([PoolTransfer("kv", keys, empty(len(keys)))]).ok["kv"][1:-1] == [False] * len(bad)
    assert b.exists([PoolTransfer("kv", keys)]) == 1
    assert all(validate_key(k) for k in b.seen)
    assert set(b.seen) == {f"{h}.kv.r0" for h in GOOD}


# -- foreign entries in the root ---------------------------------------------------------------------


def test_fifo_in_place_of_an_indexed_page_is_a_prompt_miss(root: Path, stored) -> None:
    b, src = stored
    fifo = page_file(root, H[1])
    fifo.unlink()
    os.mkfifo(fifo)
    out = empty(3)
    res = bounded(lambda: b.get([PoolTransfer("kv", H[:3], out)]), fifo)
    assert res.ok["kv"] == [True, False, True]
    assert torch.equal(out[0], src[0]) and torch.equal(out[2], src[2])
    assert failed(b, "read") == 1 and b.metrics.snapshot()["checksum_miss_pages"] == 0
    # The index may say True for a page it has not read since (the contract allows a stale
    # True); once a read found the FIFO, exists asks the directory again.
    assert bounded(lambda: b.exists([PoolTransfer("kv", H[:3])]), fifo) == 1
    assert stat.S_ISFIFO(fifo.lstat().st_mode), "a foreign entry is left where it is"


def test_fifo_at_a_page_path_at_startup_is_a_prompt_miss(root: Path, stored) -> None:
    _, src = stored
    fifo = page_file(root, H[1])
    fifo.unlink()
    os.mkfifo(fifo)
    b = per_page(root=root)  # the start-up scan must skip it
    assert bounded(lambda: b.exists([PoolTransfer("kv", H[:3])]), fifo) == 1
    assert_good_pages_served(b, src)
    assert failed(b, "read") == 1
    again = pages(1, 6)
    assert b.set([PoolTransfer("kv", H[1:2], again)]).all_ok, "a write replaces the FIFO itself"
    out = empty(1)
    assert bounded(lambda: b.get([PoolTransfer("kv", H[1:2], out)])).all_ok
    assert torch.equal(out[0], again[0])


def test_directory_at_a_page_path(root: Path) -> None:
    b = per_page(root=root)
    src = pages(3, 7)
    (page_file(root, H[1])).mkdir()
    (page_file(root, H[1]) / "inside").write_bytes(b"x")
    assert b.exists([PoolTransfer("kv", H[1:2])]) == 0
    res = b.set([PoolTransfer("kv", H[:3], src)])
    assert res.ok["kv"] == [True, False, True], "a page that could not be stored is not a success"
    assert failed(b, "write") == 1
    assert b.exists([PoolTransfer("kv", H[:3])]) == 1
    assert b.exists([PoolTransfer("kv", H[1:2])]) == 0, "still absent after the failed write"
    assert_good_pages_served(b, src)
    assert failed(b, "read") == 1
    assert per_page(root=root).exists([PoolTransfer("kv", H[:3])]) == 1


def test_directory_in_place_of_an_indexed_page(root: Path, stored) -> None:
    b, src = stored
    page_file(root, H[1]).unlink()
    page_file(root, H[1]).mkdir()
    assert_good_pages_served(b, src)
    assert failed(b, "read") == 1
    assert b.exists([PoolTransfer("kv", H[:3])]) == 1
    assert page_file(root, H[1]).is_dir()


def _outside_object(tmp_path: Path, src: torch.Tensor) -> Path:
    """A valid page object for ``H[1]``, written by a store outside the root."""
    elsewhere = tmp_path / "elsewhere"
    assert per_page(root=elsewhere).set([PoolTransfer("kv", H[1:2], [src])]).all_ok
    return page_file(elsewhere, H[1])


@pytest.mark.parametrize("when", ["at-startup", "after-indexing"])
def test_symlink_out_of_the_root_is_not_followed(
    tmp_path: Path, root: Path, stored, when: str
) -> None:
    b, src = stored
    target = _outside_object(tmp_path, src[1])
    content = target.read_bytes()
    link = page_file(root, H[1])
    link.unlink()
    link.symlink_to(target)
    if when == "at-startup":
        b = per_page(root=root)
        assert b.exists([PoolTransfer("kv", H[:3])]) == 1
    assert_good_pages_served(b, src)
    assert failed(b, "read") == 1 and b.metrics.snapshot()["checksum_miss_pages"] == 0
    assert b.exists([PoolTransfer("kv", H[:3])]) == 1
    assert link.is_symlink() and target.read_bytes() == content, "neither link nor target touched"
    other = pages(1, 8)
    assert b.set([PoolTransfer("kv", H[1:2], other)]).all_ok
    assert not link.is_symlink() and target.read_bytes() == content, "written beside, not through"


@pytest.mark.parametrize("size", [0, 10, HEADER_SIZE - 1])
def test_file_shorter_than_a_header(root: Path, stored, size: int) -> None:
    b, src = stored
    with open(page_file(root, H[1]), "r+b") as f:
        f.truncate(size)
    fresh = per_page(root=root)
    assert fresh.exists([PoolTransfer("kv", H[:3])]) == 1, "not a page object: absent"
    assert_good_pages_served(fresh, src)
    assert failed(fresh, "read") == 1
    assert_good_pages_served(b, src)  # indexed with its old size: a torn object, counted
    assert b.metrics.snapshot()["checksum_miss_pages"] == 1
    assert fresh.set([PoolTransfer("kv", H[1:2], src[1:2])]).all_ok, "rewritten by a backup"
    out = empty(1)
    assert fresh.get([PoolTransfer("kv", H[1:2], out)]).all_ok and torch.equal(out[0], src[1])


# -- permissions -------------------------------------------------------------------------------------


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.mark.parametrize(
    "umask,config,want",
    [(0o000, {}, (0o700, 0o600)), (0o077, {"dir_mode": 0o750, "file_mode": 0o640}, (0o750, 0o640))],
    ids=["umask-0-defaults", "umask-077-configured"],
)
def test_modes_ignore_the_umask(
    root: Path, umask: int, config: dict, want: tuple[int, int]
) -> None:
    old = os.umask(umask)
    try:
        b = per_page(root=root, **config)
        assert b.set([PoolTransfer("kv", H[:2], pages(2, 9))]).all_ok
    finally:
        os.umask(old)
    assert mode(root) == want[0], f"root {mode(root):#o}"
    got = {p.name: mode(p) for p in root.iterdir()}
    assert len(got) == 2 and set(got.values()) == {want[1]}, got


def test_world_writable_root_is_refused(root: Path, caplog: pytest.LogCaptureFixture) -> None:
    root.mkdir(parents=True)
    root.chmod(0o777)
    with pytest.raises(ValueError, match=r"root .*l3.*mode 0o777 lets others write \(0o22\)"):
        per_page(root=root)
    assert list(root.iterdir()) == []
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.file_backend"):
        b = per_page(root=root, allow_unsafe_root=True)
    assert "allow_unsafe_root" in caplog.text
    assert b.set([PoolTransfer("kv", H[:1], pages(1, 10))]).all_ok
    assert mode(root) == 0o777, "an existing root's mode is not changed behind the owner's back"


@pytest.mark.parametrize("existing,config", [(0o755, {}), (0o770, {"dir_mode": 0o770})])
def test_roots_others_cannot_write_are_accepted(
    root: Path, caplog: pytest.LogCaptureFixture, existing: int, config: dict
) -> None:
    root.mkdir(parents=True)
    root.chmod(existing)
    with caplog.at_level(logging.WARNING, logger="kvtier.storage.file_backend"):
        b = per_page(root=root, **config)
    assert caplog.text == ""
    assert b.set([PoolTransfer("kv", H[:1], pages(1, 11))]).all_ok


@pytest.mark.skipif(os.geteuid() != 0, reason="giving a directory to another user needs root")
def test_root_owned_by_another_user_is_refused(root: Path) -> None:
    root.mkdir(parents=True)
    os.chown(root, 12345, -1)
    with pytest.raises(ValueError, match="owned by uid 12345"):
        per_page(root=root)


@pytest.mark.parametrize(
    "option,value,error",
    [
        ("dir_mode", 0o600, ValueError),
        ("dir_mode", 0o1777, ValueError),
        ("file_mode", 0o200, ValueError),
        ("file_mode", "0600", TypeError),
        ("stale_tmp_s", 0, ValueError),
    ],
)
def test_security_options_validate(
    root: Path, option: str, value: object, error: type[Exception]
) -> None:
    with pytest.raises(error, match=option):
        per_page(root=root, **{option: value})
    assert not root.exists()


# -- temp files of other writers ---------------------------------------------------------------------


def temp_tag(root: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """The (token, pid) of this process's temp files, seen at the rename of a real write."""
    seen: list[str] = []
    real_replace = os.replace

    def spy(src: str, dst: str, **dir_fds) -> None:
        seen.append(src)
        real_replace(src, dst, **dir_fds)

    b = per_page(root=root)
    with monkeypatch.context() as m:
        m.setattr(os, "replace", spy)
        assert b.set([PoolTransfer("kv", H[7:8], pages(1, 12))]).all_ok
    token, pid, _, _ = seen[0].split(".kvp.")[1].removesuffix(".tmp").split("-")
    assert pid == str(os.getpid())
    return token, pid


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    with pytest.raises(ProcessLookupError):  # reaped: no such process any more
        os.kill(p.pid, 0)
    return p.pid


def test_startup_deletes_only_temp_files_nobody_will_finish(
    root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    token, me = temp_tag(root, monkeypatch)
    other_token = "0" * 12 if token != "0" * 12 else "1" * 12
    name = page_file(root, H[1]).name
    old = time.time() - 7200
    temps = {
        "live": (f"{name}.{token}-{me}-0-0.tmp", None),
        "dead": (f"{name}.{token}-{dead_pid()}-0-0.tmp", None),
        "other-host": (f"{name}.{other_token}-{dead_pid()}-0-0.tmp", None),
        "other-host-old": (f"{name}.{other_token}-1-0-0.tmp", old),
        "live-old": (f"{name}.{token}-{me}-1-0.tmp", old),
        "not-ours": ("notes.tmp", old),
    }
    for fname, mtime in temps.values():
        (root / fname).write_bytes(b"partial page")
        if mtime is not None:
            os.utime(root / fname, (mtime, mtime))
    (root / f"{name}.{token}-{dead_pid()}-2-0.tmp").mkdir()  # not a regular file: left alone
    per_page(root=root, stale_tmp_s=3600)
    left = {k for k, (fname, _) in temps.items() if (root / fname).exists()}
    assert left == {"live", "other-host", "not-ours"}, left
    assert sum(1 for p in root.iterdir() if p.is_dir()) == 1


def segment_store(**config: object) -> StorageBackend:
    from kvtier.storage import create_backend

    return create_backend("file", **config)


@pytest.mark.parametrize("make", [per_page, segment_store], ids=["per-page", "segments"])
@pytest.mark.parametrize("where", ["a-file", "under-a-file", "empty", "nul", "int", "bytes"])
def test_a_root_that_cannot_be_one_is_refused_by_name(
    tmp_path: Path, make: Callable[..., StorageBackend], where: str
) -> None:
    """A root that is a file, or lies under one, is a ``ValueError`` naming the root and why (it
    was ``NotADirectoryError``/``FileExistsError``); an empty path, one with NUL, or one that is
    not a path at all is refused before anything is touched."""
    blocker = tmp_path / "blocker"
    blocker.write_bytes(b"not a directory")
    value, error, says = {
        "a-file": (blocker, ValueError, "Not a directory"),
        "under-a-file": (blocker / "l3", ValueError, "(Not a directory|File exists)"),
        "empty": ("", ValueError, "non-empty"),
        "nul": (str(tmp_path / "a\0b"), ValueError, "NUL"),
        "int": (5, TypeError, "os.PathLike"),
        "bytes": (os.fsencode(tmp_path / "l3"), TypeError, "os.PathLike"),
    }[where]
    before = sorted(p.name for p in tmp_path.iterdir())
    with pytest.raises(error, match=rf"root.*{says}"):
        make(root=value)
    assert blocker.read_bytes() == b"not a directory"
    assert sorted(p.name for p in tmp_path.iterdir()) == before
