"""The segment store at the edges of the system it runs on: a umask that hides the new root
from its owner, pages of more parts than one ``pwritev`` takes, and files that will not go away.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes
from kvtier.storage.segments import SegmentBackend
from kvtier.storage.segments import space as space_module
from kvtier.storage.segments.format import RECORD_HEAD
from kvtier.storage.segments.io import IOV_MAX
from tests.children import child_env

pytestmark = pytest.mark.usefixtures("loops")  # the C loops and the Python loops

NS = Namespace("limits-test", "bfloat16", 4, "page_first")
PAGE = 4096
H = page_hashes(range(4 * 256), NS)  # 256 pages


def expected(h: str, n: int = PAGE) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(h[:15], 16))
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def store(root: Path, **config: object) -> SegmentBackend:
    config.setdefault("list_interval_s", 0)
    b = create_backend("file", root=root, touch_interval_s=0, **config)
    assert isinstance(b, SegmentBackend)
    return b


@pytest.mark.skipif(shutil.which("setpriv") is None, reason="needs setpriv (util-linux)")
@pytest.mark.parametrize("umask", [0o077, 0o400, 0o777])
def test_root_created_under_any_umask(tmp_path: Path, umask: int) -> None:
    """Under a umask that strips the owner's own read or search bit the new root still opens
    (its mode set by path before the open), gets exactly 0o700, and serves pages. Run without
    the root user's permission bypass (``setpriv`` drops it), as an ordinary owner would."""
    root = tmp_path / "l3"
    script = textwrap.dedent(
        f"""
        import os, stat, torch
        from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes
        os.umask({umask})
        h = page_hashes(range(8), Namespace("umask", "bfloat16", 4, "page_first"))
        b = create_backend("file", root={str(root)!r})
        page = torch.arange(64, dtype=torch.uint8)
        assert b.set([PoolTransfer("kv", h, [page, page])]).all_ok
        out = [torch.zeros(64, dtype=torch.uint8) for _ in h]
        assert b.get([PoolTransfer("kv", h, out)]).all_ok and torch.equal(out[1], page)
        b.close()
        print(oct(stat.S_IMODE(os.stat({str(root)!r}).st_mode)))
        """
    )
    cmd = ["setpriv", "--bounding-set=-dac_override,-dac_read_search,-fowner"]
    if os.geteuid() != 0:
        cmd = []
    out = subprocess.run(
        [*cmd, sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env=child_env(),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "0o700"


@pytest.mark.parametrize("kind", ["file", "file_per_page"])
@pytest.mark.parametrize("parts", [IOV_MAX - 1, IOV_MAX + 1, 3 * IOV_MAX + 5])
def test_pages_of_more_parts_than_one_syscall_takes(tmp_path: Path, parts: int, kind: str) -> None:
    """A page is any number of parts: written and read back in calls of at most ``IOV_MAX``
    parts (beyond it one ``pwritev`` fails with EINVAL, and the page with it); a page written
    in one part reads back into many and the reverse. The segment store and the per-page one."""
    b = store(tmp_path / "l3") if kind == "file" else create_backend(kind, root=tmp_path / "l3")
    n = parts * 4
    keys = H[:2]
    pages = [expected(h, n) for h in keys]

    def scattered(page: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """``page``'s bytes in 4-byte parts with a gap after each (adjacent parts would be
        merged into one iovec); the backing tensor and the parts."""
        backing = torch.full((2 * page.numel(),), 0xEE, dtype=torch.uint8)
        backing.view(-1, 8)[:, :4] = page.view(-1, 4)
        return backing, list(backing.view(-1, 8)[:, :4].unbind(0))

    _, split = scattered(pages[0])
    assert b.set([PoolTransfer("kv", keys[:1], [split])]).all_ok
    assert b.set([PoolTransfer("kv", keys[1:], pages[1:])]).all_ok
    one = torch.full((n,), 0xEE, dtype=torch.uint8)
    backing, many = scattered(torch.zeros(n, dtype=torch.uint8))
    # the many-part page read into one buffer; the one-part page read into many
    assert b.get([PoolTransfer("kv", keys, [one, many])]).all_ok
    assert torch.equal(one, pages[0])
    assert torch.equal(torch.cat(many), pages[1])
    assert torch.all(backing.view(-1, 8)[:, 4:] == 0xEE), "a gap between parts was written"
    b.close()


def test_segment_that_cannot_be_removed_still_counts(tmp_path: Path, monkeypatch) -> None:
    """Eviction that cannot unlink a segment (EPERM on a shared root, say) counts its bytes as
    still used and keeps its records indexed and served: the root stays within its capacity
    instead of growing past it while the index forgets pages still on disk."""
    record = RECORD_HEAD + PAGE
    cap = 64 * record
    b = store(tmp_path / "l3", capacity_bytes=cap, segment_bytes=8 * record)
    real = os.unlink
    refused: list[str] = []

    def unlink(name, *args, **kwargs):
        if str(name).endswith(".kvs"):
            refused.append(str(name))
            raise PermissionError(1, "Operation not permitted", name)
        return real(name, *args, **kwargs)

    monkeypatch.setattr(space_module.os, "unlink", unlink)
    stored = []
    for i in range(0, 160, 8):
        keys = H[i : i + 8]
        ok = b.set([PoolTransfer("kv", keys, [expected(h) for h in keys])]).ok["kv"]
        stored += [h for h, good in zip(keys, ok) if good]
        used = sum(p.stat().st_size for p in (tmp_path / "l3").iterdir() if p.is_file())
        assert used <= cap + 16 * record, f"root at {used} B past its capacity of {cap} B"
    assert refused, "no eviction was attempted: the test does not test anything"
    # Every page whose segment is still on disk is still served, with its own bytes.
    on_disk = {p.stem for p in (tmp_path / "l3").glob("*.kvs")}
    for h in stored:
        span = b.locate(f"{h}.kv")
        if span is not None and Path(span.path).stem in on_disk:
            out = [torch.zeros(PAGE, dtype=torch.uint8)]
            assert b.get([PoolTransfer("kv", [h], out)]).all_ok
            assert torch.equal(out[0], expected(h))
    b.close()
    assert stat.S_ISDIR(os.stat(tmp_path / "l3").st_mode)


def test_eviction_keeps_fresh_pages_another_store_listed_early(tmp_path: Path, monkeypatch) -> None:
    """A store that listed another writer's segment while its journal was still empty counts
    no live record there until it reads the journal. Eviction must not take that for "all
    superseded" (evicted first, before LRU order): the other writer's fresh pages stay and the
    hour-old ones go. The hooks force a timing that happens by itself with big batches."""
    from kvtier.storage.segments.writer import Lane

    root = tmp_path / "l3"
    record = RECORD_HEAD + PAGE
    kw = dict(capacity_bytes=80 * record, segment_bytes=16 * record, io_threads=0)
    old, fresh, big = H[:48], H[100:116], H[200:232]

    def put(b: SegmentBackend, keys: list[str]) -> bool:
        return b.set([PoolTransfer("kv", keys, [expected(h) for h in keys])]).all_ok

    first = store(root, **kw)
    assert put(first, old)  # three segments
    first.close()
    hour_ago = os.stat(root).st_mtime - 3600
    for p in root.iterdir():
        os.utime(p, (hour_ago, hour_ago))
    a, b = store(root, **kw), store(root, **kw)
    roll, append_some = Lane._roll, Lane._append_some
    state = {"b_rolls": 0, "listed": False}

    def hooked_append(self, *args, **kwargs):
        if self._name in a._index.writers and not state["listed"]:
            state["listed"] = True  # b lists the root: a's new segment, its journal empty
            b.exists([PoolTransfer("kv", [H[255]])])
        return append_some(self, *args, **kwargs)

    def hooked_roll(self, need, tombstones=0):
        if self._name in b._index.writers:
            state["b_rolls"] += 1
            if state["b_rolls"] == 2:  # b in the middle of a big batch: a writes and finishes
                assert put(a, fresh)
                a.close()
        return roll(self, need, tombstones)

    monkeypatch.setattr(Lane, "_append_some", hooked_append)
    monkeypatch.setattr(Lane, "_roll", hooked_roll)
    assert put(b, big)
    monkeypatch.undo()
    assert state["listed"] and state["b_rolls"] >= 2
    reader = store(root, **kw)
    out = [torch.zeros(PAGE, dtype=torch.uint8) for _ in fresh]
    ok = reader.get([PoolTransfer("kv", fresh, out)]).ok["kv"]
    assert all(ok), f"{ok.count(False)} of the freshest pages evicted before hour-old ones"
    assert all(torch.equal(o, expected(h)) for o, h in zip(out, fresh))
    out = [torch.zeros(PAGE, dtype=torch.uint8) for _ in old]
    assert not all(reader.get([PoolTransfer("kv", old, out)]).ok["kv"]), "nothing was evicted"
    for x in (b, reader):
        x.close()


def test_new_root_swapped_for_a_symlink_is_not_followed(tmp_path: Path, monkeypatch) -> None:
    """Someone who can write to the root's parent swaps the new root for a symlink between its
    ``mkdir`` and its ``chmod``: the mode never lands on the link's target, and the store does
    not open through the link."""
    from kvtier.storage.segments import root as root_module

    victim = tmp_path / "secret"
    victim.write_text("key")
    os.chmod(victim, 0o600)
    real_mkdir = os.mkdir

    def racing_mkdir(path, mode=0o777, *args, **kwargs):
        real_mkdir(path, mode, *args, **kwargs)
        if str(path).endswith("l3"):
            os.rename(path, f"{path}.moved")
            os.symlink(victim, path)

    monkeypatch.setattr(root_module.os, "mkdir", racing_mkdir)
    with pytest.raises(ValueError, match="cannot be made or opened as a directory") as e:
        root_module.open_root(tmp_path / "l3", 0o750, False)
    assert isinstance(e.value.__cause__, OSError)  # the symlink was refused, not followed
    assert stat.S_IMODE(os.stat(victim).st_mode) == 0o600


def test_a_system_error_opening_the_root_stays_an_oserror(tmp_path: Path, monkeypatch) -> None:
    """Only what the path given can cause becomes a ``ValueError`` naming the root; a failure
    of the system (out of descriptors, disk full, IO) stays the ``OSError`` it is."""
    import errno

    from kvtier.storage.segments import root as root_module

    def failing_mkdir(path, mode=0o777, *args, **kwargs):
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(root_module.os, "mkdir", failing_mkdir)
    with pytest.raises(OSError) as e:
        root_module.open_root(tmp_path / "l3", 0o700, False)
    assert not isinstance(e.value, ValueError) and e.value.errno == errno.EMFILE


def test_root_lock_follows_a_lock_file_deleted_under_it(tmp_path: Path) -> None:
    """An operator deletes the root's lock file while a process has it open. That process
    locked the deleted file from then on, and one started later created and locked a new one:
    both went on creating segments at once, past the capacity (found in a user trial). A lock
    taken on a file no longer at its name is taken again on the one that is."""
    from kvtier.storage.segments.root import RootLock

    tmp_path.mkdir(exist_ok=True)
    dirfd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        first = RootLock(dirfd, "lock", 0o600, 5.0)
        first.acquire()
        first.release()
        (tmp_path / "lock").unlink()
        first.acquire()  # the process's next segment creation
        later = RootLock(dirfd, "lock", 0o600, 0.2)  # a process started after the deletion
        with pytest.raises(TimeoutError):
            later.acquire()
        first.release()
        later.acquire()
        later.release()
        first.close()
        later.close()
    finally:
        os.close(dirfd)


def test_a_full_disk_evicts_the_least_recently_used_for_room(tmp_path: Path, monkeypatch) -> None:
    """The disk fills before any capacity is reached (none set, one above the disk, other
    files): a new segment's preallocation fails with ENOSPC. The store evicts its least recently
    used segments for the room and tries again; every later write failed until an operator freed
    space (a user trial: 8 MiB of evictable pages, every set refused)."""
    import errno

    import torch

    from kvtier.storage import PoolTransfer, create_backend

    root = tmp_path / "l3"
    disk = 2 << 20
    real = os.posix_fallocate

    def small_disk(fd: int, offset: int, size: int) -> None:
        used = sum(p.stat().st_size for p in root.glob("*.kv?"))
        if used + size > disk:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(fd, offset, size)

    monkeypatch.setattr(os, "posix_fallocate", small_disk)
    b = create_backend("file", root=root, segment_bytes=256 << 10)
    stored = []
    for i in range(40):  # 10 MiB of pages through a 2 MiB disk
        keys = [f"{i:04x}{j:060x}" for j in range(8)]
        pages = [torch.full((32 << 10,), i, dtype=torch.uint8) for _ in keys]
        stored.append(sum(b.set([PoolTransfer("kv", keys, pages)]).ok["kv"]))
    assert stored == [8] * 40, stored
    out = [torch.zeros(32 << 10, dtype=torch.uint8) for _ in range(8)]
    keys = [f"{39:04x}{j:060x}" for j in range(8)]
    assert b.get([PoolTransfer("kv", keys, out)]).all_ok and all(int(o[0]) == 39 for o in out)
    assert sum(p.stat().st_size for p in root.glob("*.kv?")) <= disk
    b.close()


def test_a_disk_full_of_other_files_does_not_wipe_the_store(tmp_path: Path, monkeypatch) -> None:
    """A disk filled by other files, the store holding less than a new record needs: evicting
    all of it would not make the room, so nothing is evicted and the write fails (counted); the
    pages stored stay served."""
    import errno

    import torch

    from kvtier.storage import PoolTransfer, create_backend

    root = tmp_path / "l3"
    b = create_backend("file", root=root, segment_bytes=256 << 10)
    keys = [f"{0:04x}{j:060x}" for j in range(4)]
    pages = [torch.full((16 << 10,), 7, dtype=torch.uint8) for _ in keys]
    assert b.set([PoolTransfer("kv", keys, pages)]).all_ok
    b.close()

    def full_disk(fd: int, offset: int, size: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full_disk)
    b = create_backend("file", root=root, segment_bytes=256 << 10)
    more = [f"{1:04x}{j:060x}" for j in range(2)]
    big = [torch.full((256 << 10,), 9, dtype=torch.uint8) for _ in more]  # more than it holds
    assert not any(b.set([PoolTransfer("kv", more, big)]).ok["kv"])
    out = [torch.zeros(16 << 10, dtype=torch.uint8) for _ in keys]
    assert b.get([PoolTransfer("kv", keys, out)]).all_ok, "the store was wiped for nothing"
    b.close()


def test_writers_beyond_a_capped_roots_room_get_smaller_segments(tmp_path: Path) -> None:
    """Each writer's active segment is held, never evicted: with more writers than whole
    segments fit under the capacity (two TP=8 engines on one root, say), a new segment takes
    half of what is left: after the first rounds every put is stored (while each new segment
    had to be whole, five writers in eight failed round after round, and every failed roll
    evicted every finished segment). The root stays under its capacity; pages read back
    exact."""
    root = tmp_path / "l3"
    record = RECORD_HEAD + PAGE
    cap = 128 * record
    kw = dict(capacity_bytes=cap, segment_bytes=32 * record, io_threads=0)
    hashes = page_hashes(range(4 * 24 * 32), NS)
    writers = [store(root, **kw) for _ in range(8)]  # whole segments: three fit
    failed: list[int] = []
    for rnd in range(24):
        failed.append(0)
        for i, w in enumerate(writers):
            keys = hashes[(rnd * 8 + i) * 4 : (rnd * 8 + i + 1) * 4]
            ok = w.set([PoolTransfer("kv", keys, [expected(h) for h in keys])]).ok["kv"]
            failed[-1] += ok.count(False)
        on_disk = sum(p.stat().st_size for p in root.iterdir() if p.suffix in (".kvs", ".kvj"))
        assert on_disk <= cap, (rnd, on_disk, cap)
    assert failed[-12:] == [0] * 12, failed
    reader = store(root, **kw)  # the last round's pages: those still held are exact
    keys = hashes[23 * 32 : 24 * 32]
    out = [torch.zeros(PAGE, dtype=torch.uint8) for _ in keys]
    ok = reader.get([PoolTransfer("kv", keys, out)]).ok["kv"]
    # Under this little room a writer's finished segments go soon, even its own from the same
    # batch; its active segment's pages stay: the last put's last page, at least.
    assert ok[-1], ok
    assert all(torch.equal(o, expected(h)) for o, h, good in zip(out, keys, ok) if good)
    for w in (*writers, reader):
        w.close()


def test_room_that_cannot_be_made_deletes_nothing(tmp_path: Path) -> None:
    """``Space.make_room``: segments other writers hold (locked) leave less than ``least``
    under the capacity, so no grant: the finished segments stay (before, each such roll
    deleted every one of them, then failed). With room for ``least`` but not ``need``, half
    of the room is granted and only what that takes goes, least recently used first; the held
    ones never go."""
    import fcntl

    root = tmp_path / "l3"
    b = store(root, capacity_bytes=1 << 20)
    space = b._space
    unit = 64 << 10

    def segment(name: str, size: int, age: int) -> int:
        fds = []
        for ext in ("kvs", "kvj"):
            fd = os.open(root / f"{name}.{ext}", os.O_RDWR | os.O_CREAT, 0o600)
            os.ftruncate(fd, size if ext == "kvs" else space_module.journal_reserve(size))
            os.utime(fd, ns=(age, age))
            fds.append(fd)
        os.close(fds[1])
        return fds[0]

    held = [segment(f"1-0000000{i}-00000001", 3 * unit, 10**18) for i in range(3)]
    for fd in held:
        fcntl.flock(fd, fcntl.LOCK_SH)  # a writer's active segment
    finished = [segment(f"2-0000000{i}-00000001", unit, 10**9 * (i + 1)) for i in range(4)]
    for fd in finished:
        os.close(fd)

    def segments() -> list[str]:
        return sorted(p.name for p in root.iterdir() if p.suffix in (".kvs", ".kvj"))

    names = segments()
    used = sum(space_module._accounted(f) for f in space.listing().values())
    cap = used + unit // 2  # room for half a unit without deleting anything
    with space.lock:
        assert space.make_room(8 * unit, cap, least=5 * unit) == 0
        assert segments() == names, "nothing deleted"
        granted = space.make_room(8 * unit, cap, least=unit)
    left = segments()
    room = unit // 2 + 4 * space_module._accounted(space.listing()["2-00000003-00000001"])
    assert granted == room // 2, (granted, room)
    assert all(f"1-0000000{i}-00000001.kvs" in left for i in range(3)), "held ones stay"
    gone = [i for i in range(4) if f"2-0000000{i}-00000001.kvs" not in left]
    assert gone == [0, 1], "the two least recently used went for half the room, no more"
    for fd in held:
        os.close(fd)
    b.close()


def test_a_writer_left_no_room_fails_its_pages_and_changes_nothing(tmp_path: Path) -> None:
    """Writers, each holding its active segment, until the segments held leave less than a
    record under the capacity: that writer's puts fail (counted), again on a second try, and
    leave the root's segments as they were."""
    root = tmp_path / "l3"
    record = RECORD_HEAD + PAGE
    cap = 32 * record
    kw = dict(capacity_bytes=cap, segment_bytes=8 * record, io_threads=0)
    holders, stored = [], 0
    for i in range(40):  # writers until one gets no room at all
        w = store(root, **kw)
        holders.append(w)
        keys = [H[200 + i]]
        if not w.set([PoolTransfer("kv", keys, [expected(h) for h in keys])]).all_ok:
            break
        stored += 1
    else:
        pytest.fail("every writer got a segment: the room never ran out")
    assert stored >= 4
    before = sorted(p.name for p in root.iterdir())
    refused = holders[-1]
    assert not refused.set([PoolTransfer("kv", [H[250]], [expected(H[250])])]).all_ok
    assert sorted(p.name for p in root.iterdir()) == before
    for w in holders:
        w.close()


def _held_segment(root: Path, i: int, size: int) -> int:
    """Another writer's active segment of ``size`` bytes (its journal at its reservation),
    locked as its writer holds it: the descriptor holding the lock."""
    import fcntl

    fds = []
    for ext in ("kvs", "kvj"):
        fd = os.open(root / f"1-{i:08x}-00000001.{ext}", os.O_RDWR | os.O_CREAT, 0o600)
        os.ftruncate(fd, size if ext == "kvs" else space_module.journal_reserve(size))
        fds.append(fd)
    os.close(fds[1])
    fcntl.flock(fds[0], fcntl.LOCK_SH)
    return fds[0]


@pytest.mark.parametrize("slack", [-100, 0, 100, 3000])
def test_a_segment_made_of_a_partial_grant_fits_it(tmp_path: Path, slack: int) -> None:
    """Other writers' active segments leave ``least`` (one record and its journal
    reservation) plus ``slack`` under the capacity: the put is stored only if that is at least
    ``least``, and the root, counted as ``make_room`` counts it, stays under the capacity
    (helper 68's review)."""
    jr = space_module.journal_reserve
    root = tmp_path / "l3"
    seg = 16 * PAGE
    least = PAGE + jr(PAGE)
    held_size = 4 * seg
    cap = 3 * (held_size + jr(held_size)) + least + slack
    b = store(root, capacity_bytes=cap, segment_bytes=seg, io_threads=0)
    held = [_held_segment(root, i, held_size) for i in range(3)]
    ok = b.set([PoolTransfer("kv", [H[7]], [expected(H[7])])]).all_ok
    accounted = sum(space_module._accounted(f) for f in b._space.listing().values())
    assert accounted <= cap, (accounted, cap)
    assert ok == (slack >= 0), ok
    for fd in held:
        os.close(fd)
    b.close()


def test_small_records_in_smaller_segments_stay_under_the_capacity(tmp_path: Path) -> None:
    """Pages under 3.5 KiB (more journal per byte than a segment's reservation) in segments
    made smaller by partial grants: each moves on when the journal reservation counted for its
    own size is used up, so the root, counted as ``make_room`` counts it, stays under the
    capacity (helper 68's review)."""
    jr = space_module.journal_reserve
    root = tmp_path / "l3"
    page = 512
    seg = 64 * page
    cap = 3 * (seg + jr(seg)) + seg // 2
    writers = [store(root, capacity_bytes=cap, segment_bytes=seg, io_threads=0) for _ in range(6)]
    smaller = 0
    for rnd in range(12):
        for i, w in enumerate(writers):
            keys = H[(rnd * 6 + i) * 8 % 256 : (rnd * 6 + i) * 8 % 256 + 8]
            w.set([PoolTransfer("kv", keys, [expected(h, page) for h in keys])])
            listing = writers[0]._space.listing()
            accounted = sum(space_module._accounted(f) for f in listing.values())
            assert accounted <= cap, (rnd, i, accounted, cap)
            act = w._writer._lanes[0]._active
            if act is not None:
                smaller += act.size < seg
                assert act.jcap <= jr(act.size), (act.size, act.jcap)
    assert smaller, "no segment was made smaller"
    for w in writers:
        w.close()


def test_idle_writers_give_back_their_room_when_another_asks(tmp_path: Path, monkeypatch) -> None:
    """Three writers store a page each and go idle, each holding a whole preallocated segment;
    a fourth finds the capped root short and gets a partial segment, which asks for room
    (``RootLock.ask_for_room``). The idle writers' next calls (an ``exists``) give their
    preallocated room back once idle for ``IDLE_GIVE_BACK_S`` (not before: they just wrote),
    and the fourth's next segment is whole. Every page reads back exact, the root never over
    its capacity."""
    from kvtier.storage.segments import writer as writer_module

    root = tmp_path / "l3"
    record = RECORD_HEAD + PAGE
    cap = 32 * record
    kw = dict(capacity_bytes=cap, segment_bytes=8 * record, io_threads=0)

    def put(w: SegmentBackend, keys: list[str]) -> None:
        assert w.set([PoolTransfer("kv", keys, [expected(h) for h in keys])]).all_ok

    def held(w: SegmentBackend) -> int | None:
        """The bytes of the writer's active segment file (None: it holds none)."""
        act = w._writer._lanes[0]._active
        return None if act is None else (root / f"{act.seg.stem}.kvs").stat().st_size

    def on_disk() -> int:
        return sum(p.stat().st_size for p in root.iterdir() if p.suffix in (".kvs", ".kvj"))

    idle = [store(root, **kw) for _ in range(3)]
    for i, w in enumerate(idle):
        put(w, [H[100 + i]])
    whole = held(idle[0])
    assert whole is not None and whole >= 8 * record
    busy = store(root, **kw)
    asked = busy._lock.room_asked()
    put(busy, [H[110]])
    assert held(busy) < whole, "a partial grant: the others hold the room"
    assert busy._lock.room_asked() == asked + 1
    assert on_disk() <= cap
    monkeypatch.setattr(writer_module, "IDLE_GIVE_BACK_S", 3600.0)
    for w in idle:  # idle for less than IDLE_GIVE_BACK_S: they keep it
        assert w.exists([PoolTransfer("kv", [H[110]], [])]) == 1
        assert held(w) == whole
    monkeypatch.setattr(writer_module, "IDLE_GIVE_BACK_S", 0.0)
    short = held(busy)
    assert busy.exists([PoolTransfer("kv", [H[110]], [])]) == 1
    assert held(busy) == short, "its own request is no news to the process that made it"
    for i, w in enumerate(idle):  # the request is still pending for them: given back now
        assert w.exists([PoolTransfer("kv", [H[110]], [])]) == 1
        assert held(w) is None
        stems = {p.stem for p in root.glob(f"{w._writer._lanes[0]._name}-*.kvs")}
        assert [(root / f"{s}.kvs").stat().st_size for s in stems] == [record], i
    for i in range(16):  # past its partial segment: a whole one now
        put(busy, [H[120 + i]])
        assert on_disk() <= cap, i
    assert held(busy) == whole
    # A lane gives its room back at most every GIVE_BACK_EVERY_S: the next request is passed
    # over (a root short all the time would make a segment per put), the one after that limit
    # is served.
    again = idle[0]
    put(again, [H[140]])
    for every, kept in ((writer_module.GIVE_BACK_EVERY_S, True), (0.0, False)):
        monkeypatch.setattr(writer_module, "GIVE_BACK_EVERY_S", every)
        with busy._lock:
            busy._lock.ask_for_room()
        assert again.exists([PoolTransfer("kv", [H[140]], [])]) == 1
        assert (held(again) is not None) == kept, every
    reader = store(root, **kw)
    keys = [H[100], H[101], H[102], H[110], *H[120:136], H[140]]
    out = [torch.zeros(PAGE, dtype=torch.uint8) for _ in keys]
    assert reader.get([PoolTransfer("kv", keys, out)]).all_ok
    assert all(torch.equal(o, expected(h)) for o, h in zip(out, keys))
    for w in (*idle, busy, reader):
        w.close()


def test_an_idle_writer_process_gives_back_its_room(tmp_path: Path) -> None:
    """The same across processes: a child stores a page and waits, holding a whole
    preallocated segment; this process's writers crowd the root until one is granted a partial
    segment (asking for room through the lock file). The child's next call gives its room
    back (its idle limit set to 0 in the child), its page still served."""
    root = tmp_path / "l3"
    record = RECORD_HEAD + PAGE
    cap = 32 * record
    kw = dict(capacity_bytes=cap, segment_bytes=8 * record, io_threads=0)
    script = textwrap.dedent(
        f"""
        import sys, torch
        from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes
        from kvtier.storage.segments import writer
        writer.IDLE_GIVE_BACK_S = 0.0
        h = page_hashes(range(4 * 256), Namespace("limits-test", "bfloat16", 4, "page_first"))
        b = create_backend("file", root={str(root)!r}, touch_interval_s=0, list_interval_s=0,
                           capacity_bytes={cap}, segment_bytes={8 * record}, io_threads=0)
        g = torch.Generator().manual_seed(int(h[90][:15], 16))
        page = torch.randint(0, 256, ({PAGE},), dtype=torch.uint8, generator=g)
        assert b.set([PoolTransfer("kv", [h[90]], [page])]).all_ok
        lane = b._writer._lanes[0]
        print("held", lane._active.size, flush=True)
        sys.stdin.readline()
        assert b.exists([PoolTransfer("kv", [h[90]], [])]) == 1
        print("after", lane._active is None, flush=True)
        b.close()
        """
    )
    child = subprocess.Popen(
        [sys.executable, "-c", script],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=child_env(),
        text=True,
    )
    ours: list[SegmentBackend] = []
    try:
        assert child.stdout is not None and child.stdin is not None
        held = int(child.stdout.readline().split()[1])
        assert held >= 8 * record
        ours += [store(root, **kw) for _ in range(3)]
        for i, w in enumerate(ours):  # two whole segments fit beside the child's; then short
            keys = [H[100 + i]]
            assert w.set([PoolTransfer("kv", keys, [expected(h) for h in keys])]).all_ok
        short = ours[-1]._writer._lanes[0]._active
        assert short.size < held and ours[-1]._lock.room_asked() >= 1
        child.stdin.write("go\n")
        child.stdin.flush()
        assert child.stdout.readline().split() == ["after", "True"]
        assert child.wait(timeout=60) == 0
        child_files = [p for p in root.glob(f"{child.pid}-*.kvs")]
        assert [p.stat().st_size for p in child_files] == [record]
        out = [torch.zeros(PAGE, dtype=torch.uint8)]
        assert ours[0].get([PoolTransfer("kv", [H[90]], out)]).all_ok
        assert torch.equal(out[0], expected(H[90]))
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    for w in ours:
        w.close()


def test_room_requests_are_news_only_once_and_never_to_a_put(tmp_path: Path, monkeypatch) -> None:
    """Helper 72's cases. Puts never give room back (a writer would start a new segment at
    once: on a crowded root, a short one asking again; 32 puts made 32 segments), so writers
    that only put roll exactly as with the give-back off. A count left in the lock file by
    earlier processes is no request to a new one. A lock file replaced under the processes
    (an operator) carries later requests to them all the same."""
    from kvtier.storage.segments import writer as writer_module

    record = RECORD_HEAD + PAGE
    kw = dict(capacity_bytes=32 * record, segment_bytes=8 * record, io_threads=0)
    monkeypatch.setattr(writer_module, "IDLE_GIVE_BACK_S", 0.0)
    monkeypatch.setattr(writer_module, "GIVE_BACK_EVERY_S", 0.0)

    def puts_only(root: Path) -> int:
        ws = [store(root, **kw) for _ in range(4)]
        for rnd in range(8):
            for i, w in enumerate(ws):
                keys = [H[(rnd * 4 + i) % 256]]
                w.set([PoolTransfer("kv", keys, [expected(h) for h in keys])])
        made = sum(w._writer._lanes[0]._numbers for w in ws)
        for w in ws:
            w.close()
        return made

    with_give_back = puts_only(tmp_path / "a")
    monkeypatch.setattr(writer_module.Writer, "give_back", lambda self: 0)
    assert with_give_back == puts_only(tmp_path / "b")
    monkeypatch.undo()
    monkeypatch.setattr(writer_module, "IDLE_GIVE_BACK_S", 0.0)

    root = tmp_path / "c"
    first = store(root, **kw)
    first._lock.room_started()
    with first._lock:
        for _ in range(5):  # requests of processes long gone
            first._lock.ask_for_room()
    first.close()
    w = store(root, **kw)
    assert w.set([PoolTransfer("kv", [H[1]], [expected(H[1])])]).all_ok
    before = w._writer._lanes[0]._active
    assert w.exists([PoolTransfer("kv", [H[1]], [])]) == 1
    assert w._writer._lanes[0]._active is before, "an old count is no request"
    lock = root / "lock"
    count = lock.read_bytes()
    lock.unlink()  # an operator replaces the lock file; acquire follows it, so do the reads
    lock.write_bytes(count)
    other = store(root, **kw)
    with other._lock:
        other._lock.ask_for_room()
    assert w.exists([PoolTransfer("kv", [H[1]], [])]) == 1
    assert w._writer._lanes[0]._active is None, "the request in the new lock file was seen"
    for b in (w, other):
        b.close()
