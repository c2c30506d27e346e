"""File store knobs A/B on one host: run size, IO threads and write lanes, for puts and warm gets
of one page size, each round running every variant (in a rotated order) and raw file IO.

    taskset -c 0,1 python3 profiling/storage_knobs.py --page-kib 64 --rounds 6
    taskset -c 0,1 python3 profiling/storage_knobs.py --page-kib 2048 --only default whole lane

``--only``: the variants whose names contain one of the words. "large records whole" hashes a
record larger than a run whole before writing it (the C loops before pieces); "one lane" writes
every batch into one segment (the worker writes while the caller hashes).

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

import kvtier.storage.segments.native as native_module
import kvtier.storage.segments.reader as reader_module
import kvtier.storage.segments.writer as writer_module
from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes

NS = Namespace("knobs", "bfloat16", 4, "page_first")
BATCH = 8 << 20
KIB = 1 << 10
# name: (run bytes, backend config, large records hashed whole)
VARIANTS: dict[str, tuple[int, dict, bool]] = {
    "run 256 KiB (default)": (256 * KIB, {}, False),
    "run 512 KiB": (512 * KIB, {}, False),
    "run 1 MiB": (1024 * KIB, {}, False),
    "run 2 MiB": (2048 * KIB, {}, False),
    "io_threads 2": (256 * KIB, {"io_threads": 2}, False),
    "io_threads 0": (256 * KIB, {"io_threads": 0}, False),
    "large records whole": (256 * KIB, {}, True),
    "one lane": (256 * KIB, {"write_lanes": 1}, False),
}
_write = native_module.write


def _whole(*args, **kwargs):
    """``native.write`` with every record hashed whole before its run is written."""
    return _write(*args[:5], 0, *args[6:], **kwargs)


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
    ap.add_argument("--only", nargs="+", help="variants whose names contain one of these words")
    args = ap.parse_args()
    chosen = [v for v in VARIANTS if not args.only or any(w in v for w in args.only)]
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
            names = chosen[rnd % len(chosen) :] + chosen[: rnd % len(chosen)]
            for name in names:
                run_bytes, config, whole = VARIANTS[name]
                writer_module.RUN_BYTES = reader_module.RUN_BYTES = run_bytes
                native_module.write = _whole if whole else _write
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
        native_module.write = _write
        shutil.rmtree(base, ignore_errors=True)
    print(f"page {args.page_kib} KiB, {args.rounds} rounds of {args.total_mib} MiB, medians")
    print("| operation | variant | GB/s | % of raw | CPU s/GB | every round's GB/s |")
    print("|---|---|---|---|---|---|")
    for op in ("put", "get warm"):
        raw = statistics.median(g for g, _ in got[("raw", op)])
        for name in ("raw", *chosen):
            s = got[(name, op)]
            g, c = statistics.median(x for x, _ in s), statistics.median(y for _, y in s)
            rounds = " ".join(f"{x:.2f}" for x, _ in s)
            print(f"| {op} | {name} | {g:.2f} | {100 * g / raw:.0f}% | {c:.3f} | {rounds} |")


if __name__ == "__main__":
    main()
