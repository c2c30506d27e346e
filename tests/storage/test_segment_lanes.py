"""Write lanes of the segment store: a batch split among segments appended to in parallel.

Page bytes are a function of the key, so every read is checked byte for byte; ``check`` also
compares what each backend serves with what its ``set`` answered.
"""

from __future__ import annotations

import errno
import os
import random
from pathlib import Path

import pytest
import torch

from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes
from kvtier.storage.page_format import PageViews
from kvtier.storage.segments import SegmentBackend, SegmentBackendConfig
from kvtier.storage.segments import writer as writer_mod
from kvtier.storage.segments.index import NAME
from kvtier.storage.segments.io import RUN_BYTES

pytestmark = pytest.mark.usefixtures("loops")  # the C loops and the Python loops

NS = Namespace("lanes-test", "bfloat16", 4, "page_first")
PAGE = writer_mod.LANE_MIN_RECORD  # pages large enough to be split among lanes
BATCH = 4 * RUN_BYTES // PAGE  # pages of a batch big enough for two lanes
H = page_hashes(range(NS.page_size * 2 * BATCH), NS)  # two batches of pages


def expected(h: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(h[:15], 16))
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)


def put(b: SegmentBackend, hashes: list[str]) -> list[bool]:
    pool = torch.stack([expected(h) for h in hashes])  # one pool: pages adjacent in memory
    return b.set([PoolTransfer("kv", hashes, list(pool.unbind(0)))]).ok["kv"]


def served(b: SegmentBackend, hashes: list[str]) -> list[bool]:
    out = list(torch.full((len(hashes), PAGE), 0xEE, dtype=torch.uint8).unbind(0))
    ok = b.get([PoolTransfer("kv", hashes, out)]).ok["kv"]
    for i, (h, got) in enumerate(zip(hashes, ok)):
        if got:
            assert torch.equal(out[i], expected(h)), f"page {i} served with wrong bytes"
    return ok


def writers(root: Path) -> dict[str, int]:
    """Writer name -> segment files of it in ``root``."""
    out: dict[str, int] = {}
    for name in os.listdir(root):
        m = NAME.fullmatch(name)
        if m is not None and m["ext"] == "kvs":
            out[m["writer"]] = out.get(m["writer"], 0) + 1
    return out


@pytest.mark.parametrize(
    ("kwargs", "error", "text"),
    [
        ({"write_lanes": 0}, ValueError, "write_lanes must be in [1, io_threads + 1 = 2], got 0"),
        ({"write_lanes": 3}, ValueError, "write_lanes must be in [1, io_threads + 1 = 2], got 3"),
        (
            {"write_lanes": 2, "io_threads": 0},
            ValueError,
            "write_lanes must be in [1, io_threads + 1 = 1], got 2",
        ),
        ({"write_lanes": "2"}, TypeError, "write_lanes must be an int, got str '2'"),
        ({"write_lanes": True}, TypeError, "write_lanes must be an int, got bool True"),
        ({"write_lanes": 1.5}, TypeError, "write_lanes must be an int, got float 1.5"),
    ],
)
def test_write_lanes_validated(tmp_path: Path, kwargs: dict, error: type, text: str) -> None:
    with pytest.raises(error) as e:
        SegmentBackendConfig(root=tmp_path / "r", **kwargs)
    assert str(e.value) == text
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize(
    ("io_threads", "write_lanes", "lanes"), [(0, None, 1), (1, None, 2), (3, None, 2), (3, 4, 4)]
)
def test_lanes_resolved(
    tmp_path: Path, io_threads: int, write_lanes: int | None, lanes: int
) -> None:
    config = SegmentBackendConfig(root=tmp_path, io_threads=io_threads, write_lanes=write_lanes)
    assert config.lanes == lanes


def test_shares_cut_by_bytes() -> None:
    rng = random.Random(7)
    for _ in range(500):
        n = rng.randint(1, 40)
        lengths = [rng.choice([0, 100, 4096, PAGE, RUN_BYTES, 2 * RUN_BYTES]) for _ in range(n)]
        lanes = rng.randint(1, 4)
        bounds = writer_mod._shares(lengths, lanes)
        assert bounds[0] == 0 and bounds[-1] == n
        assert all(a < b for a, b in zip(bounds, bounds[1:])), bounds  # no empty share
        assert len(bounds) - 1 <= lanes
        if sum(lengths) < max(2 * RUN_BYTES, n * writer_mod.LANE_MIN_RECORD):
            assert bounds == [0, n]  # too small to split, or records too small on average
    # Equal records split evenly; small ones stay in one lane whatever the batch's size.
    assert writer_mod._shares([PAGE] * BATCH, 2) == [0, BATCH // 2, BATCH]
    assert writer_mod._shares([2 * RUN_BYTES] * 6, 4) == [0, 2, 3, 5, 6]
    assert writer_mod._shares([PAGE] * 3, 4) == [0, 3]  # 384 KiB: one share
    assert writer_mod._shares([64 << 10] * 128, 2) == [0, 128]  # 8 MiB of 64 KiB pages


def test_page_views_subset() -> None:
    pool = torch.arange(64 * 10, dtype=torch.int64).to(torch.uint8).view(10, 64)
    pages = [(p,) for p in pool.unbind(0)] + [(pool[0, :8].clone(), pool[1, :8].clone())]
    views = PageViews(pages)
    for lo, hi in [(0, 11), (2, 5), (9, 11), (4, 4)]:
        sub = views.subset(range(lo, hi))
        assert len(sub) == hi - lo
        assert sub.counts() == views.counts()[lo:hi]
        assert sub.lengths() == views.lengths()[lo:hi]
        for k in range(hi - lo):
            assert [bytes(v) for v in sub[k]] == [bytes(v) for v in views[lo + k]]
            assert sub.checksum(k) == views.checksum(lo + k)
        assert b"".join(sub.iovecs(range(hi - lo))) == b"".join(views.iovecs(range(lo, hi)))
    for bad in [range(0, 12), range(-1, 3), range(0, 4, 2)]:
        with pytest.raises(ValueError, match="pages must be a range of step 1 within 11"):
            views.subset(bad)


def test_batch_split_between_lanes_is_served_everywhere(tmp_path: Path) -> None:
    """Two lanes, two writer names: the batch's pages are served by this backend, by one that
    was open before the writes (it tails both lanes' journals, also after a second batch goes
    into the same active segments), and after a restart."""
    a = create_backend("file", root=tmp_path, list_interval_s=0)
    other = create_backend("file", root=tmp_path, list_interval_s=0)  # sees at once
    try:
        first, second = H[:BATCH], H[BATCH : 2 * BATCH]
        assert all(put(a, first))
        names = writers(tmp_path)
        assert len(names) == 2 and set(names.values()) == {1}, names  # one segment per lane
        assert all(served(a, first))
        assert all(served(other, first))
        assert all(put(a, second))
        assert writers(tmp_path) == names  # appended to the same active segments
        assert all(served(other, second))
        assert all(served(other, first))
        a.close()
        again = create_backend("file", root=tmp_path)
        try:
            assert all(served(again, first + second))
        finally:
            again.close()
    finally:
        a.close()
        other.close()


def test_one_lane_writes_one_segment(tmp_path: Path) -> None:
    b = create_backend("file", root=tmp_path, write_lanes=1)
    try:
        assert all(put(b, H[:BATCH]))
        assert len(writers(tmp_path)) == 1
        assert all(served(b, H[:BATCH]))
    finally:
        b.close()


def test_a_failing_lane_hands_its_share_to_a_lane_that_stored(tmp_path: Path) -> None:
    """The second lane gets no segment (as under a root capacity that has no room for one more
    active segment): the first lane stores its own share and then the failed one, so the batch
    is stored as one lane would have stored it; served whole, also after a restart."""
    b = create_backend("file", root=tmp_path)
    try:
        tried: list[int] = []

        def no_room(need: int, tombstones: int = 0) -> None:
            tried.append(need)
            return None

        b._writer._lanes[1]._roll = no_room  # type: ignore[method-assign]
        assert all(put(b, H[:BATCH]))
        assert tried, "the second lane was given a share"
        assert len(writers(tmp_path)) == 1  # everything went into the first lane's segment
        assert all(served(b, H[:BATCH]))
    finally:
        b.close()
    again = create_backend("file", root=tmp_path)
    try:
        assert all(served(again, H[:BATCH]))
    finally:
        again.close()


def test_lanes_that_all_fail_store_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every write fails: each page is reported failed, nothing is served, and the books hold
    nothing of the batch (a later put stores it whole)."""
    b = create_backend("file", root=tmp_path)
    try:

        def failing(fd: int, iovecs: list, offset: int) -> None:
            raise OSError(errno.ENOSPC, "no space (injected)")

        with monkeypatch.context() as m:
            m.setattr(writer_mod, "write_all", failing)
            assert put(b, H[:BATCH]) == [False] * BATCH
        assert served(b, H[:BATCH]) == [False] * BATCH
        assert b.exists([PoolTransfer("kv", H[:BATCH])]) == 0
        assert all(put(b, H[:BATCH]))
        assert all(served(b, H[:BATCH]))
    finally:
        b.close()
