"""Two writer processes and a verifying reader share one segment-store root.

Each writer stores pages of its own keys and of keys both write (same bytes: a page's bytes are a
function of its key), and after every batch reads its own batch back. The reader (this process,
its backend opened before the writers start) reads every key while they write: any page served
must be exact, and the root must stay within its capacity, counted over all processes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes
from kvtier.storage.segments import SegmentBackend
from kvtier.storage.segments.format import RECORD_HEAD
from kvtier.storage.segments.writer import LANE_MIN_RECORD
from tests.children import child_env

NS = Namespace("segment-mp", "bfloat16", 4, "page_first")
PAGE = 16 << 10
BATCH = 16
BATCHES = 12
KEYS = page_hashes(range(4 * 3 * BATCH * BATCHES), NS)
SHARED = KEYS[: BATCH * BATCHES]  # both writers write these, in the same order
OWN = [KEYS[(w + 1) * BATCH * BATCHES : (w + 2) * BATCH * BATCHES] for w in range(2)]

WRITER = """
import sys, numpy as np, torch
from kvtier.storage import Namespace, PageSpans, PoolTransfer, create_backend, page_hashes

root, me, capacity, form = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
B, N, PAGE = {batch}, {batches}, {page}
K = page_hashes(range(4 * 3 * B * N), Namespace("segment-mp", "bfloat16", 4, "page_first"))
shared, own = K[: B * N], K[(me + 1) * B * N : (me + 2) * B * N]

def page(h):
    g = torch.Generator().manual_seed(int(h[:15], 16))
    return torch.randint(0, 256, (PAGE,), dtype=torch.uint8, generator=g)

def as_spans(pages):
    # Two parts a page, as a page_first KV host pool holds them: page i's first half at place i
    # of the pool's first half, its second half at place i of the second half.
    half, n = PAGE // 2, len(pages)
    pool = torch.empty(2 * n * half, dtype=torch.uint8)
    first = np.arange(n, dtype=np.int64) * half
    for i, p in enumerate(pages):
        pool[i * half : (i + 1) * half] = p[:half]
        pool[(n + i) * half : (n + i + 1) * half] = p[half:]
    return pool, PageSpans(pool, np.stack([first, first + n * half], axis=1), (half, half))

def pages_of(pool, n):
    half = PAGE // 2
    return [torch.cat([pool[i * half : (i + 1) * half], pool[(n + i) * half : (n + i + 1) * half]])
            for i in range(n)]

b = create_backend("file", root=root, segment_bytes={segment},
                   capacity_bytes=None if capacity == "none" else int(capacity))
for n in range(N):
    # Half a batch of shared keys, half of own: interleaved so that both writers race on them.
    keys = shared[n * B : n * B + B // 2] + own[n * B : n * B + B // 2]
    if form == "tensors":
        assert b.set([PoolTransfer("kv", keys, [page(h) for h in keys])]).all_ok, n
        out = [torch.empty(PAGE, dtype=torch.uint8) for _ in keys]
        got = b.get([PoolTransfer("kv", keys, out)]).ok["kv"]
    else:
        _, spans = as_spans([page(h) for h in keys])
        assert b.set([PoolTransfer("kv", keys, spans)]).all_ok, n
        back, into = as_spans([torch.full((PAGE,), 0xEE, dtype=torch.uint8) for _ in keys])
        got = b.get([PoolTransfer("kv", keys, into)]).ok["kv"]
        out = pages_of(back, len(keys))
    # Under a root capacity the other writer may evict any page at any time (a shared key this
    # set found stored may sit in the other writer's oldest segment): only unbounded roots must
    # serve the whole batch at once. Whatever is served is right.
    assert capacity != "none" or all(got), f"batch {{n}} not readable at once"
    assert all(torch.equal(o, page(h)) for o, h, ok in zip(out, keys, got) if ok), n
print("written", b.metrics.snapshot()["failed_pages.write"])
b.close()
"""


def expected(h: str, page: int = PAGE) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(h[:15], 16))
    return torch.randint(0, 256, (page,), dtype=torch.uint8, generator=g)


def written_keys() -> list[str]:
    half = BATCH // 2
    out = []
    for n in range(BATCHES):
        out += SHARED[n * BATCH : n * BATCH + half]
        for w in range(2):
            out += OWN[w][n * BATCH : n * BATCH + half]
    return out


def verify_all(reader: SegmentBackend, keys: list[str], page: int = PAGE) -> list[bool]:
    out = [torch.full((page,), 0xEE, dtype=torch.uint8) for _ in keys]
    ok = reader.get([PoolTransfer("kv", keys, out)]).ok["kv"]
    for i, (h, got) in enumerate(zip(keys, ok)):
        if got:
            assert torch.equal(out[i], expected(h, page)), f"key {i} served with wrong bytes"
    return ok


# 16 KiB pages go through one write lane per writer; 128 KiB pages through two (each batch
# split between two segments of that writer, appended by two threads) on the unbounded root,
# and through one under the capacity (four segments: two lanes' would take half of it).
# "spans2": the writers' pages as a page_first KV pool's (two parts each, as PageSpans), which
# the reader reads back as one tensor a page.
@pytest.mark.parametrize(
    "page,form",
    [(PAGE, "tensors"), (LANE_MIN_RECORD, "tensors"), (PAGE, "spans2")],
    ids=["16KiB", "128KiB", "16KiB-spans2"],
)
@pytest.mark.parametrize("capacity", [None, 4], ids=["unbounded", "capacity"])
def test_two_writers_and_a_reader_share_one_root(
    tmp_path: Path, capacity: int | None, page: int, form: str
) -> None:
    segment = 4 * BATCH * (RECORD_HEAD + page)
    capacity = None if capacity is None else capacity * segment
    root = tmp_path / "l3"
    reader = create_backend("file", root=root, segment_bytes=segment, capacity_bytes=capacity)
    assert isinstance(reader, SegmentBackend)
    script = tmp_path / "writer.py"
    script.write_text(
        textwrap.dedent(WRITER).format(batch=BATCH, batches=BATCHES, page=page, segment=segment)
    )
    cap_arg = "none" if capacity is None else str(capacity)
    writers = [
        subprocess.Popen(
            [sys.executable, str(script), str(root), str(w), cap_arg, form],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=child_env(),
        )
        for w in range(2)
    ]
    keys = written_keys()
    rounds = served = 0
    try:
        while any(w.poll() is None for w in writers):
            served += sum(verify_all(reader, keys, page))  # while they write: no wrong byte
            if capacity is not None:
                assert reader.used_bytes <= capacity
            rounds += 1
        results = [w.communicate(timeout=60) for w in writers]
    finally:
        for w in writers:
            if w.poll() is None:
                w.kill()
                w.wait()
    for w, (out, err) in zip(writers, results):
        assert w.returncode == 0, err[-3000:]
        assert out.split() == ["written", "0"], "every write of both writers succeeded"
    ok = verify_all(reader, keys, page)
    if capacity is None:
        assert all(ok), f"{ok.count(False)} pages another process wrote are not seen"
    else:
        assert reader.used_bytes <= capacity
        assert any(ok) and not all(ok), "some pages were evicted"
        # The writer that finished last evicted nothing of its own last segment after closing.
        last = [
            [keys.index(h) for h in OWN[w][(BATCHES - 1) * BATCH :][: BATCH // 2]] for w in (0, 1)
        ]
        assert any(all(ok[i] for i in idx) for idx in last), "the newest pages were kept"
    # A fresh process's view, rebuilt from the journals, serves at least as much (a key both
    # wrote whose newer record was evicted may still have the older one).
    again = verify_all(create_backend("file", root=root), keys, page)
    assert all(a or not b for a, b in zip(again, ok)), "a fresh reader lost pages"
