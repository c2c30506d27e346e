"""The segment store's put arrangements, one process or two at once on one root, against raw
writes: GB/s and CPU s/GB. The store's default (small pages: a worker writes while the caller
hashes; large ones: two lanes, each on its thread hashing each run just before its write) and
``io_threads=0`` (the caller's thread alone, each run hashed right after its write).

    taskset -c 0,1 python3 -m profiling.storage_write_threads --dir /tmp --rounds 3 --pages 64

Each child imports torch and makes its pages before the clock starts: about 5 s a measurement
on the H100 host, so keep ``--rounds`` and ``--pages`` small there.

Each process puts ``--mib`` MiB of pages in 8 MiB batches (two processes: each its own keys, at
once, started together by a pipe), after ``os.sync()``; raw writes the same bytes with 8 MiB
``os.write`` calls. Rounds rotate the variants' order. CPU is each process's own over its puts
(``time.process_time``: user and system, all its threads), summed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

BATCH = 8 << 20


def child(kind: str, threads: int, root: str, tag: int, page: int, mib: int) -> None:
    import torch

    from kvtier.storage import PoolTransfer, create_backend
    from profiling.bench_storage import keys_for, page_views

    total = mib << 20
    src = torch.randint(0, 255, (total,), dtype=torch.uint8)
    if kind == "raw":
        path = Path(root) / f"raw{tag}.bin"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        buf = memoryview(src.numpy())
        sys.stdin.readline()
        t, c = time.perf_counter(), time.process_time()
        for i in range(total // BATCH):
            os.write(fd, buf[i * BATCH : (i + 1) * BATCH])
        print(time.perf_counter() - t, time.process_time() - c, flush=True)
        os.close(fd)
        return
    b = create_backend("file", root=root, **({} if threads < 0 else {"io_threads": threads}))
    pages = page_views(src, page)
    keys = keys_for(tag, len(pages))
    per = BATCH // page
    sys.stdin.readline()
    t, c = time.perf_counter(), time.process_time()
    for i in range(len(pages) // per):
        lo = i * per
        assert b.set([PoolTransfer("kv", keys[lo : lo + per], pages[lo : lo + per])]).all_ok
    print(time.perf_counter() - t, time.process_time() - c, flush=True)
    b.close()


def run(
    kind: str, threads: int, procs: int, work: Path, page: int, mib: int
) -> tuple[float, float]:
    """Aggregate GB/s and CPU s/GB of ``procs`` processes putting at once."""
    root = work / "root"
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(mode=0o700)
    os.sync()
    ps = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "profiling.storage_write_threads",
                "--child",
                kind,
                str(threads),
                str(root),
                str(n + 1),
                str(page),
                str(mib),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for n in range(procs)
    ]
    time.sleep(2.0)  # imports: untimed, the clock starts at the go line
    for p in ps:
        p.stdin.write("go\n")
        p.stdin.flush()
    times = [tuple(map(float, p.stdout.readline().split())) for p in ps]
    for p in ps:
        p.wait()
    walls = [w for w, _ in times]
    cpu = sum(c for _, c in times)  # each process's own CPU (all its threads) while it put
    gb = procs * (mib << 20) / 1e9
    shutil.rmtree(root, ignore_errors=True)
    return gb / max(walls), cpu / gb


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, threads, root, tag, page, mib = sys.argv[2:8]
        child(kind, int(threads), root, int(tag), int(page), int(mib))
        return
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dir", default="/tmp")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--pages", type=int, nargs="+", default=[64, 2048], help="KiB")
    args = ap.parse_args()
    work = Path(args.dir) / f"write_threads_{os.getpid()}"
    work.mkdir()
    # (kind, io_threads: -1 the default)
    variants = [("raw", 1), ("store", -1), ("store", 0)]
    names = {("raw", 1): "raw", ("store", -1): "store (default)", ("store", 0): "io_threads 0"}
    try:
        for page in args.pages:
            for procs in (1, 2):
                got: dict[str, list[tuple[float, float]]] = {}
                for r in range(args.rounds):
                    k = r % len(variants)
                    for v in variants[k:] + variants[:k]:
                        got.setdefault(names[v], []).append(
                            run(v[0], v[1], procs, work, page << 10, args.mib)
                        )
                raw = statistics.median(g for g, _ in got["raw"])
                for name, v in got.items():
                    gbps = statistics.median(g for g, _ in v)
                    cpu = statistics.median(c for _, c in v)
                    print(
                        f"{page:5d} KiB  {procs} process(es)  {name:26s} {gbps:5.2f} GB/s "
                        f"({100 * gbps / raw:3.0f}% of raw)  CPU {cpu:.3f} s/GB  "
                        f"rounds: {' '.join(f'{g:.2f}' for g, _ in v)}",
                        flush=True,
                    )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
