"""The file store's two C put arrangements, batch by batch in one process: a write thread of the
C loops' own writing every run while the caller hashes and then prepares the journal entries
and index records (``native.write_start``, the default with IO threads), against one C call in
which a helper hashes while the caller writes, everything after it (``native.write``, used
where no thread can be started). Batches alternate between the two, so both see the same disk,
page cache and neighbours; every batch is checked (``all_ok``) and every store read back.

    taskset -c 0,1 python3 -m profiling.storage_put_overlap --dir /tmp --rounds 4

Per round and arrangement, the median batch seconds; last, the median over rounds of the
paired ratio (one call / write thread: above 1 when the write thread is faster). Batches that
rolled to a new segment (every 8th at 64 KiB) are left out: with strict alternation they would
all fall to one side. Records of 64 KiB only: larger records go through two write lanes, which
take the one-call path each.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvtier.storage import PoolTransfer, create_backend
from kvtier.storage.segments import native
from profiling.bench_storage import BATCH_BYTES, SETTLE, keys_for, page_views, settle_memory


def one_round(work: Path, src: torch.Tensor, page: int, seed: int) -> dict[str, list[float]]:
    """Every batch of ``src`` once, the arrangement alternating batch by batch (which one goes
    first alternates by ``seed``); each batch's seconds by arrangement."""
    started = native.write_start
    times: dict[str, list[float]] = {"thread": [], "one call": [], "rolled": []}
    root = work / f"r{seed}"
    store = create_backend("file", root=root)
    pages = page_views(src, page)
    keys = keys_for(seed, len(pages))
    per = BATCH_BYTES // page
    SETTLE["bytes"] = 2 * src.numel()
    settle_memory()
    try:
        for i, lo in enumerate(range(0, len(keys), per)):
            which = ("thread", "one call")[(i + seed) % 2]
            native.write_start = started if which == "thread" else (lambda *args: None)
            batch = PoolTransfer("kv", keys[lo : lo + per], pages[lo : lo + per])
            lane = store._writer._lanes[0]
            before = lane.active
            t = time.perf_counter()
            assert store.set([batch]).all_ok
            took = time.perf_counter() - t
            times["rolled" if lane.active is not before else which].append(took)
    finally:
        native.write_start = started
    back = torch.zeros_like(src)
    assert store.get([PoolTransfer("kv", keys, page_views(back, page))]).all_ok
    assert torch.equal(back, src), "a page read back differs"
    store.close()
    shutil.rmtree(root)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--total-mib", type=int, default=512)
    args = p.parse_args()
    if native.library() is None:
        raise SystemExit("the C loops are not built here: nothing to compare")
    src = torch.randint(0, 256, (args.total_mib << 20,), dtype=torch.uint8)
    work = Path(tempfile.mkdtemp(dir=args.dir))
    ratios = []
    print(f"{os.cpu_count()} CPUs, affinity {sorted(os.sched_getaffinity(0))}, 64 KiB records")
    try:
        for r in range(args.rounds):
            os.sync()
            t = one_round(work, src, 64 << 10, r)
            a, b = statistics.median(t["thread"]), statistics.median(t["one call"])
            ratios.append(b / a)
            print(
                f"round {r}: write thread {a * 1e3:.3f} ms, one call {b * 1e3:.3f} ms a batch "
                f"(medians of {len(t['thread'])} / {len(t['one call'])}; {len(t['rolled'])} "
                f"batches that rolled left out); one call / thread {b / a:.3f}",
                flush=True,
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"median over rounds, one call / write thread: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
