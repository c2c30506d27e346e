"""Segment store puts into a root that already holds many files: what a large L3 root costs the
write path (listings of the root, compaction candidates), against an empty root, in one run.

    python3 profiling/bench_storage_scale.py --files 0 20000 --rounds 2

Each case fills a fresh root under ``--dir`` with ``files / 2`` empty segment and journal pairs
of another writer (what another process's segments cost to list and to keep in the books), then
times 256 MiB of 64 KiB puts in 8 MiB batches (wall and process CPU).
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes

NS = Namespace("bench", "bfloat16", 16, "page_first")
PAGE = 64 << 10
BATCH = 8 << 20
TOTAL = 256 << 20


def one(parent: str, files: int) -> tuple[float, float]:
    root = tempfile.mkdtemp(dir=parent)
    os.chmod(root, 0o700)
    try:
        for i in range(files // 2):
            for ext in ("kvs", "kvj"):
                os.close(os.open(f"{root}/123-deadbeef-{i:08d}.{ext}", os.O_CREAT, 0o600))
        b = create_backend("file", root=root)
        per, n = BATCH // PAGE, TOTAL // PAGE
        data = torch.randint(0, 256, (n, PAGE), dtype=torch.uint8)
        keys = page_hashes(torch.arange(n * 16), NS)
        t, c = time.perf_counter(), time.process_time()
        for lo in range(0, n, per):
            batch = PoolTransfer("kv", keys[lo : lo + per], list(data[lo : lo + per]))
            assert b.set([batch]).all_ok
        wall, cpu = time.perf_counter() - t, time.process_time() - c
        b.close()
        return wall, cpu
    finally:
        shutil.rmtree(root)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--files", type=int, nargs="+", default=[0, 20000])
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    for r in range(args.rounds):
        for files in args.files:
            wall, cpu = one(args.dir, files)
            print(
                f"round {r + 1}: {files:6d} files in the root: 256 MiB of 64 KiB puts in "
                f"{wall * 1e3:6.0f} ms ({TOTAL / wall / 1e9:.2f} GB/s), CPU {cpu * 1e3:.0f} ms",
                flush=True,
            )


if __name__ == "__main__":
    main()
