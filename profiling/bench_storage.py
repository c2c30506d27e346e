"""L3 storage bandwidth: file backend against raw sequential file IO on the same disk, Mooncake
loopback, and the per-page Python cost of the file backend over 10k pages.

    unshare -n bash -c 'ip link set lo up && python3 profiling/bench_storage.py'

The ceiling is one big file written with ``os.write`` and read with ``readinto`` in 8 MiB chunks,
same total bytes, same directory, same source and destination memory, measured in the same run. Caches cannot be dropped here
(no root on /proc/sys/vm/drop_caches in every environment), so reads of both the backend and the
ceiling may be page-cache hits: both are measured the same way (written, then read back at once).
Writes are not fsynced on either side; ``os.sync()`` runs (untimed) before every timed phase so
each starts with no dirty pages, and raw and backend runs alternate within every repeat. Mooncake needs an isolated network namespace (its client
listens on every interface); without one, or without Mooncake, that part is skipped.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import io
import os
import platform
import pstats
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvtier.storage import Namespace, PoolTransfer, StorageBackend, create_backend, page_hashes

CHUNK = 8 << 20
BATCH = 128  # pages per storage call, as the prefetch and backup threads issue them
# Llama-3-8B, page_first, 16 tokens, bf16: K and V x 32 layers x 8 heads x 128 dims x 2 B x 16.
LLAMA_PAGE = 2 * 32 * 8 * 128 * 2 * 16
SMALL_PAGE = 64 << 10
NS = Namespace("bench", "bfloat16", 16, "page_first")


@dataclass(frozen=True)
class Row:
    where: str  # filesystem (file rows) or "loopback" (Mooncake)
    what: str
    page_bytes: int
    gbps: float  # median over repeats, GB/s (1e9 B/s)
    ceiling_gbps: float | None

    @property
    def percent(self) -> str:
        return "" if self.ceiling_gbps is None else f"{100 * self.gbps / self.ceiling_gbps:.0f}%"


def _median_gbps(nbytes: int, seconds: list[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def raw_write_read(directory: Path, pool: torch.Tensor, total: int) -> tuple[float, float]:
    """Seconds to write, then read back, one ``total``-byte file in ``CHUNK`` pieces.

    Like the backend, it writes from the first ``total`` bytes of ``pool`` and reads into the next
    ``total`` bytes, so both move the same bytes through the same (cold) memory.
    """
    src = memoryview(pool[:total].numpy())
    dst = memoryview(pool[total : 2 * total].numpy())
    path = directory / "raw.bin"
    os.sync()
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    for lo in range(0, total, CHUNK):
        os.write(fd, src[lo : lo + CHUNK])
    os.close(fd)
    w = time.perf_counter() - start
    os.sync()
    start = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        for lo in range(0, total, CHUNK):
            f.readinto(dst[lo : lo + CHUNK])
    r = time.perf_counter() - start
    path.unlink()
    return w, r


def files_write_read(directory: Path, pool: torch.Tensor, page_bytes: int, total: int
                     ) -> tuple[float, float]:
    """Seconds to write, then read back, ``total`` bytes as one file per page with the backend's
    syscalls (open, writev, close, rename; open, readv, close) and nothing else: no header, no
    checksum, no index. The floor under any one-file-per-page store on this disk."""
    n = total // page_bytes
    src = memoryview(pool[:total].numpy())
    dst = memoryview(pool[total : 2 * total].numpy())
    d = os.open(tempfile.mkdtemp(dir=directory), os.O_RDONLY | os.O_DIRECTORY)
    os.sync()
    start = time.perf_counter()
    for i in range(n):
        fd = os.open(f"{i}.tmp", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644, dir_fd=d)
        os.writev(fd, [src[i * page_bytes : (i + 1) * page_bytes]])
        os.close(fd)
        os.replace(f"{i}.tmp", str(i), src_dir_fd=d, dst_dir_fd=d)
    w = time.perf_counter() - start
    os.sync()
    start = time.perf_counter()
    for i in range(n):
        fd = os.open(str(i), os.O_RDONLY, dir_fd=d)
        os.readv(fd, [dst[i * page_bytes : (i + 1) * page_bytes]])
        os.close(fd)
    r = time.perf_counter() - start
    for i in range(n):
        os.unlink(str(i), dir_fd=d)
    os.close(d)
    return w, r


def backend_put_get(
    backend: StorageBackend, pool: torch.Tensor, page_bytes: int, total: int, tag: int
) -> tuple[float, float]:
    """Seconds to ``set``, then ``get`` back, ``total`` bytes of pages in ``BATCH``-page calls."""
    n = total // page_bytes
    src = list(pool[: n * page_bytes].view(n, page_bytes).unbind(0))
    dst = list(pool[n * page_bytes : 2 * n * page_bytes].view(n, page_bytes).unbind(0))
    keys = page_hashes(torch.arange(tag * n * 16, (tag + 1) * n * 16), NS)
    os.sync()
    start = time.perf_counter()
    for lo in range(0, n, BATCH):
        assert backend.set([PoolTransfer("kv", keys[lo : lo + BATCH], src[lo : lo + BATCH])]).all_ok
    w = time.perf_counter() - start
    os.sync()
    start = time.perf_counter()
    for lo in range(0, n, BATCH):
        assert backend.get([PoolTransfer("kv", keys[lo : lo + BATCH], dst[lo : lo + BATCH])]).all_ok
    r = time.perf_counter() - start
    assert torch.equal(pool[: n * page_bytes], pool[n * page_bytes : 2 * n * page_bytes])
    backend.clear()
    return w, r


def file_rows(work: Path, pool: torch.Tensor, total: int, repeats: int) -> list[Row]:
    """Raw IO and the file backend, interleaved in each repeat so both see the same disk state."""
    where = subprocess.run(["findmnt", "-no", "FSTYPE", "-T", str(work)], check=False,
                           capture_output=True, text=True).stdout.strip().split("\n")[0] or str(work)
    rows = []
    backend = create_backend("file", root=work / "l3")
    for page_bytes in (LLAMA_PAGE, SMALL_PAGE):
        t: dict[str, list[float]] = {"rw": [], "rr": [], "fw": [], "fr": [], "pw": [], "pr": []}
        for rep in range(repeats):
            rw, rr = raw_write_read(work, pool, total)
            fw, fr = backend_put_get(backend, pool, page_bytes, total, rep)
            pw, pr = files_write_read(work, pool, page_bytes, total)
            for k, v in zip(t, (rw, rr, fw, fr, pw, pr)):
                t[k].append(v)
        raw_w, raw_r = _median_gbps(total, t["rw"]), _median_gbps(total, t["rr"])
        rows += [
            Row(where, "raw write", page_bytes, raw_w, None),
            Row(where, "file put", page_bytes, _median_gbps(total, t["fw"]), raw_w),
            Row(where, "bare per-page files write", page_bytes, _median_gbps(total, t["pw"]), raw_w),
            Row(where, "raw read", page_bytes, raw_r, None),
            Row(where, "file get", page_bytes, _median_gbps(total, t["fr"]), raw_r),
            Row(where, "bare per-page files read", page_bytes, _median_gbps(total, t["pr"]), raw_r),
        ]
    return rows


def create_cost_us(directory: Path, files: int = 1000) -> float:
    """µs to create (and close) one empty file here: the floor under one-file-per-page writes."""
    d = Path(tempfile.mkdtemp(dir=directory))
    os.sync()
    start = time.perf_counter()
    for i in range(files):
        os.close(os.open(d / str(i), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644))
    us = (time.perf_counter() - start) / files * 1e6
    shutil.rmtree(d)
    return us


def profile_pages(directory: Path, pages: int, page_bytes: int) -> tuple[str, str]:
    """Per-page cost of ``pages`` pages through the file backend: a summary and cProfile."""
    backend = create_backend("file", root=directory / "profile")
    pool = torch.randint(0, 256, (pages, page_bytes), dtype=torch.uint8)
    bufs = list(pool.unbind(0))

    def run(tag: int) -> tuple[float, float]:
        keys = page_hashes(torch.arange(tag * pages * 16, (tag + 1) * pages * 16), NS)
        os.sync()
        start = time.perf_counter()
        for lo in range(0, pages, BATCH):
            backend.set([PoolTransfer("kv", keys[lo : lo + BATCH], bufs[lo : lo + BATCH])])
        mid = time.perf_counter()
        for lo in range(0, pages, BATCH):
            backend.get([PoolTransfer("kv", keys[lo : lo + BATCH], bufs[lo : lo + BATCH])])
        return (mid - start) / pages * 1e6, (time.perf_counter() - mid) / pages * 1e6

    set_us, get_us = run(0)
    prof = cProfile.Profile()
    prof.enable()
    run(1)
    prof.disable()
    backend.clear()
    stats = pstats.Stats(prof)
    # Own time of kvtier's storage code, leaving out syscalls, hashing and the benchmark's loop.
    py_us = sum(tt for (file, _, _), (_, _, tt, _, _) in stats.stats.items()
                if f"kvtier{os.sep}storage" in file)
    py_us = py_us / (2 * pages) * 1e6
    out = io.StringIO()
    stats.stream = out
    stats.sort_stats("tottime").print_stats(14)
    text = out.getvalue()
    summary = (
        f"{pages} pages of {page_bytes >> 10} KiB. "
        f"Without the profiler: set {set_us:.1f} µs/page, get {get_us:.1f} µs/page. "
        f"Under cProfile (which inflates it), kvtier.storage's own Python code takes {py_us:.1f} µs "
        "per page operation; the rest is syscalls and hashing. cProfile sees only the calling "
        "thread: with read_threads=2 half the reads run in the pool thread. Top entries by own time:"
    )
    return summary, text[text.find("   ncalls") :].rstrip()


def mooncake_rows(total: int, repeats: int, pool: torch.Tensor) -> list[Row] | str:
    if sorted(name for _, name in socket.if_nameindex()) != ["lo"]:
        return "skipped: not in a network namespace with only lo (run under unshare -n)"
    binary = shutil.which("mooncake_master")
    if binary is None:
        return "skipped: mooncake_master not installed"

    def port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    rpc = port()
    master = subprocess.Popen(
        [binary, "--rpc_address=127.0.0.1", f"--rpc_port={rpc}", "--metrics_host=127.0.0.1",
         f"--metrics_port={port()}", "--enable_http_metadata_server=false",
         "--enable_metric_reporting=false"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                socket.create_connection(("127.0.0.1", rpc), 0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    return "skipped: mooncake_master did not start"
                time.sleep(0.05)
        backend = create_backend("mooncake", master_address=f"127.0.0.1:{rpc}",
                                 global_segment_size=2 * total)
        backend.register_host_buffer(pool)
        rows = []
        for page_bytes in (LLAMA_PAGE, SMALL_PAGE):
            runs = [backend_put_get(backend, pool, page_bytes, total, rep) for rep in range(repeats)]
            rows += [
                Row("loopback", "mooncake put", page_bytes,
                    _median_gbps(total, [w for w, _ in runs]), None),
                Row("loopback", "mooncake get", page_bytes,
                    _median_gbps(total, [r for _, r in runs]), None),
            ]
        backend.close()
        return rows
    finally:
        master.kill()
        master.wait()


def environment(directory: Path) -> dict[str, str]:
    cpu = next((ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                if ln.startswith("model name")), platform.processor())
    mount = subprocess.run(["findmnt", "-no", "SOURCE,FSTYPE,OPTIONS", "-T", str(directory)],
                           check=False, capture_output=True, text=True).stdout.strip().split("\n")[0]
    versions = [f"python {platform.python_version()}", f"torch {torch.__version__}"]
    for dist in ("xxhash", "mooncake-transfer-engine-non-cuda"):
        try:
            from importlib.metadata import version

            versions.append(f"{dist} {version(dist)}")
        except Exception:  # noqa: BLE001 - optional packages
            versions.append(f"{dist} absent")
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": f"{cpu}, {os.cpu_count()} logical CPUs",
        "disk": f"{directory} on {mount}",
        "versions": ", ".join(versions),
        "command": "python3 " + " ".join(sys.argv),
    }


def plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5))
    labels = [f"{r.what} {r.page_bytes >> 10} KiB ({r.where})" for r in rows]
    colors = ["0.6" if r.what.startswith("raw") else "0.85" if r.what.startswith("bare")
              else "C0" if r.what.startswith("file") else "C1" for r in rows]
    ax.bar(range(len(rows)), [r.gbps for r in rows], color=colors)
    ax.set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize=8)
    ax.set_ylabel("GB/s")
    ax.set_title("L3 storage: file backend (blue), raw sequential file IO (grey), bare per-page "
                 "files (light grey), Mooncake loopback (orange)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, nargs="+", default=[Path(tempfile.gettempdir())],
                   help="directories on the disks to measure (default: the system temp dir)")
    p.add_argument("--total-mib", type=int, default=512, help="bytes per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--profile-pages", type=int, default=10_000,
                   help="pages of 4 KiB and of 64 KiB to profile (2 MiB: 1/40 of it)")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    args = p.parse_args()
    total = args.total_mib << 20
    load0 = os.getloadavg()[0]
    pool = torch.randint(0, 256, (2 * total,), dtype=torch.uint8)
    rows: list[Row] = []
    disks, creates = [], []
    for i, directory in enumerate(args.dir):
        directory.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=directory))
        try:
            env = environment(work)
            disks.append(env["disk"])
            rows += file_rows(work, pool, total, args.repeats)
            creates.append(f"{env['disk'].split(' on ')[1].split()[1]} {create_cost_us(work):.0f} µs")
            if i == 0:
                profiles = [profile_pages(work, args.profile_pages, 4096),
                            profile_pages(work, args.profile_pages, SMALL_PAGE),
                            profile_pages(work, max(1, args.profile_pages // 40), LLAMA_PAGE)]
        finally:
            shutil.rmtree(work, ignore_errors=True)
    env["disk"] = "; ".join(disks)
    mc = mooncake_rows(total // 2, args.repeats, pool)
    if isinstance(mc, list):
        rows += mc

    args.out.mkdir(parents=True, exist_ok=True)
    plot(rows, args.out / "bench_storage.png")
    lines = ["# L3 storage bandwidth", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [
        (f"- bytes per measurement: {total >> 20} MiB (Mooncake: {total >> 21} MiB), median of "
        f"{args.repeats}; {BATCH} pages per storage call; os.sync() before every timed phase"),
        "",
    ]
    lines += ["| where | what | page | GB/s | % of raw (same run) |", "|---|---|---|---|---|"]
    lines += [f"| {r.where} | {r.what} | {r.page_bytes >> 10} KiB | {r.gbps:.2f} | {r.percent} |"
              for r in rows]
    if not isinstance(mc, list):
        lines += ["", f"Mooncake: {mc}"]
    lines += [
        "",
        "Target: file backend >= 80% of raw in the same run. One file per page object costs a file",
        "creation per put and an open per get; where creating a file is slow (line below) small",
        "pages cannot approach one big sequential file. Raw figures on a VM disk vary a lot between",
        "runs: compare rows of one run only.",
    ]
    lines += ["", f"Creating one empty file (same run, after os.sync): {', '.join(creates)}.",
              "", f"Load average (1 min) before / after the run: {load0:.2f} / {os.getloadavg()[0]:.2f}.",
              "", f"## Per-page cost, file backend on {args.dir[0]}", ""]
    for summary, prof in profiles:
        lines += [summary, "", "```", prof, "```", ""]
    (args.out / "bench_storage.md").write_text("\n".join(lines))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
