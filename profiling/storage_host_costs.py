"""Two costs of the file store's host, measured bare: XXH3-64 through the ``xxhash`` binding
(the checksum of every record; its rate bounds a put's CPU), and a segment roll's syscalls
(create the segment and its journal, preallocate 64 MiB, and later shrink the written segment
to its end).

    taskset -c 0 python3 -m profiling.storage_host_costs    # one CPU; in the system temp dir
"""

from __future__ import annotations

import fcntl
import os
import shutil
import statistics
import tempfile
import time

import numpy as np
import xxhash


def main() -> None:
    buf = np.random.randint(0, 255, 256 << 20, dtype=np.uint8)
    small = buf[: 1 << 20].copy()

    def hashed(data: np.ndarray, reps: int, piece: int) -> float:
        mv, k = memoryview(data), 0
        t = time.perf_counter()
        for _ in range(reps):
            for off in range(0, data.nbytes, piece):
                xxhash.xxh3_64_intdigest(mv[off : off + piece])
                k += piece
        return k / (time.perf_counter() - t) / 1e9

    for n in (64 << 10, 8 << 20):
        gbs = hashed(buf, 1, n)
        print(f"xxh3 over 256 MiB in {n >> 10} KiB pieces: {gbs:.1f} GB/s ({1 / gbs:.3f} s/GB)")
    print(
        f"xxh3 in cache (1 MiB 256 times, 64 KiB pieces): {hashed(small, 256, 64 << 10):.1f} GB/s"
    )
    t = time.perf_counter()
    int(buf.view(np.uint64).sum())
    print(
        f"one core reading memory (numpy sum of 256 MiB): {buf.nbytes / (time.perf_counter() - t) / 1e9:.1f} GB/s"
    )
    d = tempfile.mkdtemp()
    seg = 64 << 20
    res: dict[str, list[float]] = {"create": [], "fallocate": [], "shrink": []}
    try:
        for i in range(6):
            t0 = time.perf_counter()
            fd = os.open(f"{d}/s{i}.kvs", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)
            jfd = os.open(f"{d}/s{i}.kvj", os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            t1 = time.perf_counter()
            os.posix_fallocate(fd, 0, seg)
            os.ftruncate(fd, seg)
            t2 = time.perf_counter()
            os.pwrite(fd, buf[: seg - 65536], 0)
            t3 = time.perf_counter()
            os.close(jfd)
            os.ftruncate(fd, seg - 65536)
            t4 = time.perf_counter()
            res["create"].append(t1 - t0)
            res["fallocate"].append(t2 - t1)
            res["shrink"].append(t4 - t3)
            os.close(fd)
    finally:
        shutil.rmtree(d)
    print(
        "segment roll, median of 6, us: "
        + ", ".join(f"{k} {statistics.median(v) * 1e6:.0f}" for k, v in res.items())
    )


if __name__ == "__main__":
    main()
