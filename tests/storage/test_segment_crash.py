"""Crash safety of the segment store: a writer killed with SIGKILL at chosen byte positions of
its writes, and a faked reboot (records whose bytes never reached the disk), leave a root from
which a fresh reader serves only intact pages, byte for byte.

The writer runs in a subprocess whose ``os.pwritev`` (the store's one write syscall, for records
and journal entries alike) writes only the bytes left in a budget and then kills the process:
deterministic, and able to stop anywhere, mid-record or mid-entry.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes
from kvtier.storage.segments import SegmentBackend, native
from kvtier.storage.segments.format import ENTRY_SIZE, RECORD_HEAD
from kvtier.storage.segments.writer import LANE_MIN_RECORD
from tests.children import child_env

NS = Namespace("segment-crash", "bfloat16", 4, "page_first")
PAGE = 16 << 10
BATCH = 32
BATCHES = 6
H = page_hashes(range(4 * BATCH * BATCHES), NS)
RECORD = RECORD_HEAD + PAGE
ENTRY = ENTRY_SIZE + len(f"{H[0]}.kv.r0")
BATCH_BYTES = BATCH * (RECORD + ENTRY)  # records, then their journal entries

WRITER = """
import os, signal, sys, torch
from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes

root, budget, progress = sys.argv[1], int(sys.argv[2]), sys.argv[3]
H = page_hashes(range(4 * {batch} * {batches}), Namespace("segment-crash", "bfloat16", 4,
                "page_first"))
real = os.pwritev
left = [budget]

def dying_pwritev(fd, buffers, offset):
    views = [memoryview(b).cast("B") for b in buffers]
    total = sum(v.nbytes for v in views)
    if total >= left[0]:
        cut, n = [], left[0]
        for v in views:
            if n <= 0:
                break
            cut.append(v[:n])
            n -= v.nbytes
        if cut:
            real(fd, cut, offset)
        os.kill(os.getpid(), signal.SIGKILL)
    left[0] -= total
    return real(fd, buffers, offset)

os.pwritev = dying_pwritev

def page(h):
    g = torch.Generator().manual_seed(int(h[:15], 16))
    return torch.randint(0, 256, ({page},), dtype=torch.uint8, generator=g)

b = create_backend("file", root=root, segment_bytes={segment})
with open(progress, "w") as log:
    for n in range({batches}):
        keys = H[n * {batch} : (n + 1) * {batch}]
        assert b.set([PoolTransfer("kv", keys, [page(h) for h in keys])]).all_ok
        log.write(f"{{n}}\\n")
        log.flush()
b.close()
"""


def expected(h: str, page: int = PAGE) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(h[:15], 16))
    return torch.randint(0, 256, (page,), dtype=torch.uint8, generator=g)


def check_served(b: SegmentBackend, page: int = PAGE, n: int = BATCH * BATCHES) -> list[bool]:
    """Read the first ``n`` pages; any page served must equal its expected bytes."""
    out = [torch.full((page,), 0xEE, dtype=torch.uint8) for _ in H[:n]]
    keys = H[:n]
    ok = b.get([PoolTransfer("kv", keys, out)]).ok["kv"]
    for i, (h, got) in enumerate(zip(keys, ok)):
        if got:
            assert torch.equal(out[i], expected(h, page)), f"page {i} served with wrong bytes"
    return ok


def killed_writer(tmp_path: Path, budget: int, page: int, batch: int, segment: int) -> int:
    """Run the dying writer with ``budget`` bytes; the batches it logged complete."""
    root, progress = tmp_path / "l3", tmp_path / "progress"
    script = tmp_path / "writer.py"
    script.write_text(
        textwrap.dedent(WRITER).format(batch=batch, batches=BATCHES, page=page, segment=segment)
    )
    proc = subprocess.run(
        [sys.executable, str(script), str(root), str(budget), str(progress)],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
        env=child_env(**{native.ENV_DISABLE: "0"}),  # the Python loops, whose pwritev it hooks
    )
    assert proc.returncode == -9, f"the writer was to be killed: {proc.returncode} {proc.stderr}"
    return len(progress.read_text().split()) if progress.exists() else 0


# Segments of 5 batches' records less a bit: the third batch rolls over to a second segment.
SEGMENT = 2 * BATCH * RECORD + BATCH * RECORD // 2
rng = random.Random(1234)
BUDGETS = {
    "before-anything": 0,
    "mid-first-record": RECORD_HEAD + 100,
    "record-boundary": 7 * RECORD,
    "end-of-records": BATCH * RECORD,  # every record of batch 0 written, no journal entry
    "mid-journal": BATCH * RECORD + 5 * ENTRY + 17,
    "after-batch-1": 2 * BATCH_BYTES,
    **{f"random-{i}": rng.randrange(BATCHES * BATCH_BYTES) for i in range(4)},
}


@pytest.mark.parametrize("budget", list(BUDGETS.values()), ids=list(BUDGETS))
def test_writer_killed_mid_batch_leaves_only_intact_pages(tmp_path: Path, budget: int) -> None:
    root = tmp_path / "l3"
    done = killed_writer(tmp_path, budget, PAGE, BATCH, SEGMENT)
    reader = create_backend("file", root=root)
    assert isinstance(reader, SegmentBackend)
    ok = check_served(reader)
    assert all(ok[: done * BATCH]), "every page of a batch the writer saw complete is served"
    # Nothing beyond what the budget covered can have been journaled.
    assert sum(ok) <= budget // (RECORD + ENTRY) + BATCH

    # The dead writer holds nothing: a new writer completes the set and clear() frees the root.
    writer = create_backend("file", root=root)
    keys = H[: BATCH * BATCHES]
    assert writer.set([PoolTransfer("kv", keys, [expected(h) for h in keys])]).all_ok
    assert all(check_served(create_backend("file", root=root)))
    writer.clear()
    assert list(root.glob("*.kvs")) == [], "the crashed writer's segment was evictable"


# Pages large enough for two write lanes: each batch is split between two segments written by
# two threads at once (the budget is shared, so either thread may be the one that dies).
LANE_PAGE = LANE_MIN_RECORD
LANE_BATCH = 8
LANE_SEGMENT = 5 * LANE_PAGE  # a lane takes 4 pages a batch: its second batch rolls over
lane_rng = random.Random(99)
LANE_BUDGETS = {
    "mid-first-share": 2 * LANE_PAGE + 100,
    "end-of-first-batch-records": LANE_BATCH * LANE_PAGE,
    **{f"random-{i}": lane_rng.randrange(BATCHES * LANE_BATCH * LANE_PAGE) for i in range(4)},
}


@pytest.mark.parametrize("budget", list(LANE_BUDGETS.values()), ids=list(LANE_BUDGETS))
def test_two_lane_writer_killed_mid_batch(tmp_path: Path, budget: int) -> None:
    """Killed while both lanes write: only intact pages are served, every batch the writer saw
    complete is, and a new writer can complete the set and clear the root."""
    root = tmp_path / "l3"
    n = LANE_BATCH * BATCHES
    done = killed_writer(tmp_path, budget, LANE_PAGE, LANE_BATCH, LANE_SEGMENT)
    lanes = {p.name.rsplit("-", 1)[0] for p in root.glob("*.kvs")}
    assert done == 0 or len(lanes) == 2, lanes  # the complete batches went through two lanes
    ok = check_served(create_backend("file", root=root), LANE_PAGE, n)
    assert all(ok[: done * LANE_BATCH]), "every page of a batch the writer saw complete is served"
    assert sum(ok) <= budget // LANE_PAGE
    writer = create_backend("file", root=root)
    keys = H[:n]
    assert writer.set([PoolTransfer("kv", keys, [expected(h, LANE_PAGE) for h in keys])]).all_ok
    assert all(check_served(create_backend("file", root=root), LANE_PAGE, n))
    writer.clear()
    assert list(root.glob("*.kvs")) == [], "the crashed writer's segments were evictable"


def test_faked_reboot_serves_what_reached_the_disk(tmp_path: Path) -> None:
    """After a power loss the journal may name records whose bytes were lost (zeros) or torn;
    the always-verify rule makes them counted misses, whoever reads them."""
    root = tmp_path / "l3"
    b = create_backend("file", root=root, segment_bytes=SEGMENT)
    keys = H[: 3 * BATCH]
    assert b.set([PoolTransfer("kv", keys, [expected(h) for h in keys])]).all_ok
    lost = [b.locate(f"{h}.kv.r0") for h in keys[2 * BATCH :]]  # the last batch's records
    b.close()
    del b
    for span in lost:  # the page cache never reached the disk: zeros, except one torn record
        assert span is not None
        with open(span.path, "r+b") as f:
            f.seek(span.offset)
            f.write(bytes(span.size if span is not lost[0] else span.size // 2))
    os.sync()
    after = create_backend("file", root=root)  # a new process of a new boot: nothing remembered
    assert isinstance(after, SegmentBackend)
    ok = check_served(after)
    assert ok[: 2 * BATCH] == [True] * (2 * BATCH)
    assert ok[2 * BATCH : 3 * BATCH] == [False] * BATCH
    assert after.metrics.snapshot()["checksum_miss_pages"] == BATCH
    assert after.exists([PoolTransfer("kv", keys)]) == 2 * BATCH, "the lost records are dropped"


def test_a_killed_writers_segment_gives_its_preallocation_back(tmp_path: Path) -> None:
    """A writer killed with its active segment preallocated (mid-way through its second
    segment) left that file at its whole preallocated size for good: against the root's
    capacity and the disk, reclaimed by no later process (a user trial: 3 kills, 3 MiB of
    pages, 192 MiB on disk). The next process to list the root truncates it to its journaled
    records, once no writer holds it; every page journaled is still served."""
    from kvtier.storage.segments.format import parse_entries

    root = tmp_path / "l3"
    budget = 3 * BATCH_BYTES + BATCH_BYTES // 2  # three batches, then dead mid-batch
    done = killed_writer(tmp_path, budget, PAGE, BATCH, SEGMENT)
    assert done == 3
    before = {p.name: p.stat().st_size for p in root.glob("*.kvs")}
    assert max(before.values()) == SEGMENT, before  # the active one, preallocated
    reader = create_backend("file", root=root)
    assert all(check_served(reader)[: done * BATCH])
    for seg in root.glob("*.kvs"):
        entries, _ = parse_entries(seg.with_suffix(".kvj").read_bytes())
        end = max((e.offset + e.length for e in entries if not e.deleted), default=0)
        assert seg.stat().st_size == end, (seg.name, seg.stat().st_size, end, before)
    reader.close()
