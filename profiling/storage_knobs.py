"""File store knobs A/B on one host: run size, IO threads and write lanes, for puts and warm gets
of one page size, each round running every variant (in a rotated order) and raw file IO.

    taskset -c 0,1 python3 profiling/storage_knobs.py --page-kib 64 --rounds 6

A quick look for the next tuning step, not the issue's benchmark (``bench_storage.py`` is): it
sets ``io.RUN_BYTES`` (read by the writer and the reader modules) between variants, so it runs
one process and prints medians of GB/s and process CPU s/GB, with every round's GB/s beside them.
Raw: one ``pwrite``/``preadv`` of 8 MiB at a time into/from one file, as in ``bench_storage``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch

import kvtier.storage.segments.reader as reader_module
import kvtier.storage.segments.writer as writer_module
from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes

NS = Namespace("knobs", "bfloat16", 4, "page_first")
BATCH = 8 << 20
KIB = 1 << 10
# name: (run bytes, backend config)
VARIANTS: dict[str, tuple[int, dict]] = {
    "run 256 KiB (default)": (256 * KIB, {}),
    "run 512 KiB": (512 * KIB, {}),
    "run 1 MiB": (1024 * KIB, {}),
    "run 2 MiB": (2048 * KIB, {}),
    "io_threads 2": (256 * KIB, {"io_threads": 2}),
    "io_threads 0": (256 * KIB, {"io_threads": 0}),
}


def timed(fn: Callable[[], None], nbytes: int) -> tuple[float, float]:
    """GB/s and process CPU seconds per GB of one call of ``fn``."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    dt, dc = time.perf_counter() - t, time.process_time() - c
    return nbytes / dt / 1e9, dc / nbytes * 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page-kib", type=int, default=64)
    ap.add_argument("--total-mib", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    args = ap.parse_args()
    page, total = args.page_kib * KIB, args.total_mib << 20
    n, per = total // page, max(1, BATCH // page)
    src = torch.randint(0, 256, (n, page), dtype=torch.uint8)
    dst = torch.empty_like(src)
    pages, outs = list(src.unbind(0)), list(dst.unbind(0))
    src_mv, dst_mv = memoryview(src.numpy()).cast("B"), memoryview(dst.numpy()).cast("B")
    default_run = writer_module.RUN_BYTES
    base = Path(tempfile.mkdtemp(dir=args.dir))
    got: dict[tuple[str, str], list[tuple[float, float]]] = {}
    try:
        for rnd in range(args.rounds):
            names = list(VARIANTS)
            names = names[rnd % len(names) :] + names[: rnd % len(names)]
            for name in names:
                run_bytes, config = VARIANTS[name]
                writer_module.RUN_BYTES = reader_module.RUN_BYTES = run_bytes
                keys = page_hashes(range(rnd * n * 4, (rnd + 1) * n * 4), NS)
                b = create_backend("file", root=base / "l3", **config)

                def put(b=b, keys=keys) -> None:
                    for lo in range(0, n, per):
                        assert b.set(
                            [PoolTransfer("kv", keys[lo : lo + per], pages[lo : lo + per])]
                        ).all_ok

                def get(b=b, keys=keys) -> None:
                    for lo in range(0, n, per):
                        assert b.get(
                            [PoolTransfer("kv", keys[lo : lo + per], outs[lo : lo + per])]
                        ).all_ok

                got.setdefault((name, "put"), []).append(timed(put, total))
                got.setdefault((name, "get warm"), []).append(timed(get, total))
                b.close()
                shutil.rmtree(base / "l3")
            path = str(base / "raw.bin")
            fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o600)
            try:

                def raw_put() -> None:
                    for off in range(0, total, BATCH):
                        os.pwrite(fd, src_mv[off : off + BATCH], off)

                def raw_get() -> None:
                    for off in range(0, total, BATCH):
                        os.preadv(fd, [dst_mv[off : off + BATCH]], off)

                got.setdefault(("raw", "put"), []).append(timed(raw_put, total))
                got.setdefault(("raw", "get warm"), []).append(timed(raw_get, total))
            finally:
                os.close(fd)
                os.unlink(path)
    finally:
        writer_module.RUN_BYTES = reader_module.RUN_BYTES = default_run
        shutil.rmtree(base, ignore_errors=True)
    print(f"page {args.page_kib} KiB, {args.rounds} rounds of {args.total_mib} MiB, medians")
    print("| operation | variant | GB/s | % of raw | CPU s/GB | every round's GB/s |")
    print("|---|---|---|---|---|---|")
    for op in ("put", "get warm"):
        raw = statistics.median(g for g, _ in got[("raw", op)])
        for name in ("raw", *VARIANTS):
            s = got[(name, op)]
            g, c = statistics.median(x for x, _ in s), statistics.median(y for _, y in s)
            rounds = " ".join(f"{x:.2f}" for x, _ in s)
            print(f"| {op} | {name} | {g:.2f} | {100 * g / raw:.0f}% | {c:.3f} | {rounds} |")


if __name__ == "__main__":
    main()
