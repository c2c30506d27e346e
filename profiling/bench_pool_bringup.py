"""Pinned host pool bring-up (issue 12): ``torch.empty(pin_memory=True)`` against ``alloc_pinned``.

For each size (GiB) the baseline is timed once, then ``alloc_pinned`` over thread counts, with
and without transparent huge pages. Each case is
one cold allocation (bring-up happens once per process, so there is nothing to warm up); the time
to free it (unregister + unmap) is reported beside it. Cases run most telling first and stop when
``--budget-s`` is spent; the Markdown report is rewritten after every case.

    PYTHONPATH=. python3 profiling/bench_pool_bringup.py --out profiling/results
"""

from __future__ import annotations

import argparse
import datetime
import gc
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass

import torch

from kvtier.runtime.pools.pinned import DEFAULT_CHUNK_BYTES, alloc_pinned, last_stats, numa_nodes

GiB = 1 << 30


@dataclass(frozen=True)
class Row:
    gib: int
    method: str
    threads: int
    huge_pages: str
    seconds: float
    free_s: float
    pinned: bool

    @property
    def gib_s(self) -> float:
        return self.gib / self.seconds


def _run(cmd: list[str]) -> str:
    if shutil.which(cmd[0]) is None:
        return f"({cmd[0]} not installed)"
    try:
        return subprocess.run(
            cmd, check=False, capture_output=True, text=True, timeout=20
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError) as e:
        return f"({cmd[0]} failed: {e})"


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return "(unavailable)"


def environment() -> list[str]:
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU only)"
    mem = next(
        (ln.split(":", 1)[1].strip() for ln in _read("/proc/meminfo").splitlines()
         if ln.startswith("MemTotal")),
        "?",
    )  # fmt: skip
    try:
        from cuda import bindings

        cb = bindings.__version__
    except (ImportError, AttributeError):
        cb = "not installed"
    lscpu = "\n".join(
        ln for ln in _run(["lscpu"]).splitlines() if "NUMA" in ln or "Model name" in ln
    )
    return [
        f"- GPU: {gpu}",
        f"- date: {datetime.datetime.now().isoformat(timespec='seconds')}",
        (
            f"- torch {torch.__version__}, CUDA {torch.version.cuda}, cuda-bindings {cb}, "
            f"Python {platform.python_version()}"
        ),
        f"- command: `{shlex.join([sys.executable, *sys.argv])}`",
        (
            f"- host memory: {mem}; CPUs usable: {len(os.sched_getaffinity(0))}; NUMA nodes "
            f"with usable CPUs: {sorted(numa_nodes())}"
        ),
        (
            f"- transparent huge pages: `{_read('/sys/kernel/mm/transparent_hugepage/enabled')}`,"
            f" defrag `{_read('/sys/kernel/mm/transparent_hugepage/defrag')}`"
        ),
        f"- alloc_pinned chunk: {DEFAULT_CHUNK_BYTES >> 20} MiB",
        "",
        "```",
        lscpu,
        _run(["numactl", "-H"]),
        "```",
    ]


def time_case(gib: int, method: str, threads: int, huge: bool) -> Row:
    gc.collect()
    t0 = time.perf_counter()
    if method == "torch.empty(pin_memory=True)":
        t = torch.empty(gib * GiB, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    else:
        t = alloc_pinned(gib * GiB, threads=threads, huge_pages=huge)
    seconds = time.perf_counter() - t0
    pinned = t.is_pinned()
    stats = last_stats() if method == "alloc_pinned" else None
    t0 = time.perf_counter()
    del t
    gc.collect()
    # torch's caching host allocator keeps freed pinned blocks: give them back, or the next
    # case runs out of host memory.
    if torch.cuda.is_available():
        torch._C._host_emptyCache()
    free_s = time.perf_counter() - t0
    return Row(
        gib,
        method,
        threads,
        ("advised" if stats.huge_pages else "off") if stats else "-",
        seconds,
        free_s,
        pinned,
    )


def cases(sizes: list[int], threads: list[int]) -> list[tuple[int, str, int, bool]]:
    """Most telling first: baseline and the default per size, then the sweeps."""
    out: list[tuple[int, str, int, bool]] = []
    top = max(threads)
    for gib in sizes:
        out.append((gib, "torch.empty(pin_memory=True)", 1, False))
        out.append((gib, "alloc_pinned", top, True))
    small = min(sizes)
    for n in threads:
        for huge in (True, False):
            c = (small, "alloc_pinned", n, huge)
            if c not in out:
                out.append(c)
    for gib in sizes[1:]:
        for n in threads:
            if n >= 4:
                for c in ((gib, "alloc_pinned", n, True), (gib, "alloc_pinned", n, False)):
                    if c not in out:
                        out.append(c)
    return out


def report(rows: list[Row], env: list[str], skipped: int) -> str:
    lines = ["# Pinned host pool bring-up (issue 12)", "", *env, ""]
    lines += [
        ("| GiB | method | threads | huge pages | bring-up s | GiB/s | free s | is_pinned |"),
        "|---:|---|---:|---|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.gib} | {r.method} | {r.threads} | {r.huge_pages} "
            f"| {r.seconds:.2f} | {r.gib_s:.2f} | {r.free_s:.2f} | {r.pinned} |"
        )
    if skipped:
        lines += ["", f"{skipped} further cases not run (budget spent, or still running)."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[4, 16, 48], help="GiB")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 4, 8, 16])
    ap.add_argument("--budget-s", type=float, default=200.0)
    ap.add_argument("--out", default="profiling/results")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "bench_pool_bringup.md")
    env = environment()
    todo = cases(sorted(args.sizes), sorted(args.threads))
    rows: list[Row] = []
    start = time.perf_counter()
    for i, c in enumerate(todo):
        if time.perf_counter() - start > args.budget_s:
            break
        rows.append(time_case(*c))
        r = rows[-1]
        print(
            f"{r.gib:3d} GiB {r.method:30s} threads={r.threads:2d} huge={r.huge_pages:7s} "
            f"{r.seconds:7.2f} s {r.gib_s:6.2f} GiB/s "
            f"free {r.free_s:.2f} s pinned={r.pinned}",
            flush=True,
        )
        with open(path, "w") as f:
            f.write(report(rows, env, len(todo) - i - 1))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
