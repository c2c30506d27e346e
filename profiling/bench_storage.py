"""L3 file store bandwidth: the segment store (``"file"``) and the per-page store it replaced,
against raw sequential file IO on the same directory in the same run.

    python3 profiling/bench_storage.py --dir /tmp --total-mib 256 --repeats 3

Per page size (64 KiB, 256 KiB, 2 MiB) and repeat, in a rotated order on the same directory: raw
IO, the segment store (its batch loops in C, ``segments.native``, where they build), the same
store with its loops in Python (``native=False``), the per-page store. Each writes ``total`` bytes (puts of 8 MiB batches;
raw: 8 MiB ``os.write`` chunks of one file), reads them back at once (warm: page-cache hits for
all three), then again after dropping the page cache (cold: ``/proc/sys/vm/drop_caches`` as root,
else ``posix_fadvise(DONTNEED)`` on every file). ``os.sync()`` runs (untimed) before every timed
phase. Then with one fsync per batch: the segment store with ``fsync=True`` against raw with an
``fsync`` after every 8 MiB chunk (the per-page store, one fsync per page, is left out). Then two
processes on one root: each puts half the bytes under its own keys at the same time, then each
gets the other's half (checked byte for byte); raw: two processes writing and reading a file each.
Last, the index rebuild: ``create_backend`` over a root of synthetic journals (1M entries).

GB/s is the median over repeats (1e9 B/s); batch latency percentiles pool every batch of every
repeat; CPU s/GB is the median over repeats of the process CPU time (user and system, all
threads: ``time.process_time``) per 1e9 bytes, the figure to compare on a busy VM. The VM's
disk and 2 CPUs are shared with other work: compare rows of one run only.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from kvtier.storage import (
    Namespace,
    PageSpans,
    PoolTransfer,
    StorageBackend,
    create_backend,
    page_hashes,
)
from kvtier.storage.file_backend import FilePerPageBackend
from kvtier.storage.segments.format import Entry, encode_entry

BATCH_BYTES = 8 << 20  # bytes per storage call and per raw write
PAGE_SIZES = (64 << 10, 256 << 10, 2 << 20)
NS = Namespace("bench", "bfloat16", 16, "page_first")
STORES = ("segment", "segment-py", "per-page")


class Batches(list[float]):
    """Each batch's wall seconds, and ``cpu_s``: the process CPU seconds (user and system, all
    threads) the batches took together. On a shared VM, CPU per byte is steadier than wall
    time: other work delays a measurement but does not add to its CPU."""

    cpu_s: float | None = None


@dataclass
class Samples:
    """Seconds per repeat, each batch's seconds over every repeat, and CPU seconds per repeat
    (where measured)."""

    totals: list[float] = field(default_factory=list)
    batches: list[float] = field(default_factory=list)
    cpu: list[float] = field(default_factory=list)

    def add(self, batch_seconds: list[float]) -> None:
        self.totals.append(sum(batch_seconds))
        self.batches += batch_seconds
        cpu_s = getattr(batch_seconds, "cpu_s", None)
        if cpu_s is not None:
            self.cpu.append(cpu_s)

    def cpu_per_gb(self, nbytes: int) -> float | None:
        """Median process CPU seconds per 1e9 bytes moved, or None if not measured."""
        return statistics.median(self.cpu) / (nbytes / 1e9) if self.cpu else None

    def gbps(self, nbytes: int) -> float:
        return nbytes / statistics.median(self.totals) / 1e9

    def percentiles_ms(self) -> tuple[float, float, float]:
        if len(self.batches) < 2:
            return (self.batches[0] * 1e3,) * 3
        q = statistics.quantiles(self.batches, n=100, method="inclusive")
        return q[49] * 1e3, q[89] * 1e3, q[98] * 1e3


def make_store(kind: str, root: Path, **config: object) -> StorageBackend:
    if kind == "segment":
        return create_backend("file", root=root, **config)
    if kind == "segment-py":  # its batch loops in Python, not C (segments.native)
        return create_backend("file", root=root, native=False, **config)
    return FilePerPageBackend(FilePerPageBackend.Config(root=root, **config))  # type: ignore[arg-type]


def drop_caches(directory: Path) -> str:
    """Evict the page cache (all of it as root, else the files under ``directory``); how."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "drop_caches"
    except OSError:
        for dirpath, _, names in os.walk(directory):
            for name in names:
                fd = os.open(os.path.join(dirpath, name), os.O_RDONLY | os.O_NOFOLLOW)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                os.close(fd)
        return "posix_fadvise(DONTNEED)"


SETTLE = {"bytes": 0, "seconds": []}  # set by main: memory touched before each timed phase


def settle_memory() -> None:
    """Touch and free ``SETTLE["bytes"]`` of anonymous memory (untimed), so that the page cache a
    timed phase fills comes from memory this guest has already touched. On a VM whose balloon
    reports free pages back to the host (Firecracker: the dev VM and the GPU hosts), memory the
    guest has not touched lately is faulted in from the host on first use, at ~0.5 GB/s on the
    dev VM (measured: the first 256 MiB buffered write of a process at 0.41 GB/s and 0.64 s of
    system CPU, the next ones at 4.7-5.2 GB/s); whichever side of a comparison ran first paid
    it. Freed right away (the allocation is one mapping), its pages are the first the kernel
    hands out again."""
    if SETTLE["bytes"]:
        start = time.perf_counter()
        block = np.ones(SETTLE["bytes"], dtype=np.uint8)
        del block
        SETTLE["seconds"].append(time.perf_counter() - start)


def timed(fn: Callable[[int], None], n: int) -> Batches:
    settle_memory()
    out = Batches()
    cpu = time.process_time()
    for i in range(n):
        start = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - start)
    out.cpu_s = time.process_time() - cpu
    return out


# -- raw sequential IO --------------------------------------------------------------------------


def raw_write(path: Path, src: memoryview, fsync: bool) -> Batches:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)

    def one(i: int) -> None:
        os.write(fd, src[i * BATCH_BYTES : (i + 1) * BATCH_BYTES])
        if fsync:
            os.fsync(fd)

    try:
        return timed(one, src.nbytes // BATCH_BYTES)
    finally:
        os.close(fd)


def raw_read(path: Path, dst: memoryview) -> Batches:
    fd = os.open(path, os.O_RDONLY)
    try:
        return timed(
            lambda i: os.preadv(
                fd, [dst[i * BATCH_BYTES : (i + 1) * BATCH_BYTES]], i * BATCH_BYTES
            ),
            dst.nbytes // BATCH_BYTES,
        )
    finally:
        os.close(fd)


# -- stores ---------------------------------------------------------------------------------------


PAGES = {"parts": 1, "spans": False}  # set by main (--parts, --spans)


def page_views(pool: torch.Tensor, page_bytes: int) -> list | PageSpans:
    """``pool``'s pages of ``page_bytes``: one tensor each, or with ``--parts 2`` two, as a
    page_first KV host pool gives them (its K range and its V range: page i's first half at
    place i of the pool's first half, its second half at place i of the second half); with
    ``--spans`` the same ranges as ``PageSpans`` (no tensor per page, as the L3 tier passes a
    page_first pool's pages)."""
    n = pool.numel() // page_bytes
    if PAGES["spans"]:
        parts = PAGES["parts"]
        size = page_bytes // parts
        first = np.arange(n, dtype=np.int64) * size
        offsets = np.stack([first + k * n * size for k in range(parts)], axis=1)
        return PageSpans(pool[: n * page_bytes], offsets, (size,) * parts)
    if PAGES["parts"] == 1:
        return list(pool[: n * page_bytes].view(n, page_bytes).unbind(0))
    half = page_bytes // 2
    k, v = pool[: n * page_bytes].view(2, n, half).unbind(0)
    return list(zip(k.unbind(0), v.unbind(0)))


def _batches(pages: list | PageSpans) -> tuple[int, Callable[[int], list | PageSpans]]:
    """Pages per storage call, and the call's pages by batch number (spans: their rows)."""
    if isinstance(pages, PageSpans):
        per = max(1, BATCH_BYTES // sum(pages.sizes))
        return per, lambda i: pages.rows(np.arange(i * per, (i + 1) * per))
    first = pages[0]
    size = first.numel() if isinstance(first, torch.Tensor) else sum(p.numel() for p in first)
    per = max(1, BATCH_BYTES // size)
    return per, lambda i: pages[i * per : (i + 1) * per]


def store_put(b: StorageBackend, keys: list[str], pages: list | PageSpans) -> Batches:
    per, batch = _batches(pages)

    def one(i: int) -> None:
        lo = i * per
        assert b.set([PoolTransfer("kv", keys[lo : lo + per], batch(i))]).all_ok

    return timed(one, len(keys) // per)


def store_get(b: StorageBackend, keys: list[str], pages: list | PageSpans) -> Batches:
    per, batch = _batches(pages)

    def one(i: int) -> None:
        lo = i * per
        assert b.get([PoolTransfer("kv", keys[lo : lo + per], batch(i))]).all_ok

    return timed(one, len(keys) // per)


def keys_for(tag: int, n: int) -> list[str]:
    return page_hashes(torch.arange(tag * n * 16, (tag + 1) * n * 16), NS)


@dataclass(frozen=True)
class Row:
    page_bytes: int
    op: str
    raw: Samples
    stores: dict[str, Samples | None]
    where: str = ""  # filesystem
    load: float = 0.0  # 1-minute load average when the row's measurements ended


def raw_cycle(work: Path, src: torch.Tensor, dst: torch.Tensor, raw: dict[str, Samples]) -> None:
    """Raw IO: write, read warm, read cold."""
    path = work / "raw.bin"
    os.sync()
    raw["put"].add(raw_write(path, memoryview(src.numpy()), fsync=False))
    os.sync()
    raw["get warm"].add(raw_read(path, memoryview(dst.numpy())))
    drop_caches(work)
    raw["get cold"].add(raw_read(path, memoryview(dst.numpy())))
    path.unlink()


def store_cycle(
    work: Path,
    kind: str,
    keys: list[str],
    src: torch.Tensor,
    dst: torch.Tensor,
    page_bytes: int,
    st: dict[str, dict[str, Samples]],
) -> None:
    """One store: put, get warm, get cold, each read checked byte for byte."""
    root = work / kind
    b = make_store(kind, root)
    dst.fill_(0)
    os.sync()
    st["put"][kind].add(store_put(b, keys, page_views(src, page_bytes)))
    os.sync()
    st["get warm"][kind].add(store_get(b, keys, page_views(dst, page_bytes)))
    assert torch.equal(src, dst), f"{kind}: warm read differs"
    dst.fill_(0)
    drop_caches(work)
    st["get cold"][kind].add(store_get(b, keys, page_views(dst, page_bytes)))
    assert torch.equal(src, dst), f"{kind}: cold read differs"
    b.clear()
    b.close()
    shutil.rmtree(root)


def single_process(
    work: Path, pool: torch.Tensor, total: int, repeats: int, sizes: tuple[int, ...] = PAGE_SIZES
) -> list[Row]:
    src, dst = pool[:total], pool[total : 2 * total]
    rows = []
    for page_bytes in sizes:
        ops = ("put", "get warm", "get cold", "put fsync/batch")
        raw = {op: Samples() for op in ops}
        st = {op: {s: Samples() for s in STORES} for op in ops}
        n = total // page_bytes
        for rep in range(repeats):
            # Rotate who goes first each repeat: deleting the last run's files (the disk is
            # mounted with discard) and writeback weigh on whatever runs next.
            order = ["raw", *STORES]
            order = order[rep % len(order) :] + order[: rep % len(order)]
            for kind in order:
                if kind == "raw":
                    raw_cycle(work, src, dst, raw)
                else:
                    store_cycle(work, kind, keys_for(rep, n), src, dst, page_bytes, st)
            # One fsync per batch: raw and the segment store, same cadence (8 MiB).
            for kind in ("raw", "segment")[:: 1 if rep % 2 == 0 else -1]:
                os.sync()
                if kind == "raw":
                    path = work / "raw.bin"
                    raw["put fsync/batch"].add(raw_write(path, memoryview(src.numpy()), True))
                    path.unlink()
                    continue
                b = make_store("segment", work / "fsync", fsync=True)
                os.sync()
                st["put fsync/batch"]["segment"].add(
                    store_put(b, keys_for(rep, n), page_views(src, page_bytes))
                )
                b.clear()
                b.close()
                shutil.rmtree(work / "fsync")
        for kind in STORES[1:]:
            st["put fsync/batch"][kind] = Samples()
        load = os.getloadavg()[0]
        for op in ops:
            stores = {k: v if v.totals else None for k, v in st[op].items()}
            rows.append(Row(page_bytes, op, raw[op], stores, load=load))
    return rows


# -- two processes on one root ----------------------------------------------------------------------


def child(args: list[str]) -> None:
    """One of two benchmark processes: ``role root me total page_bytes``; waits for "go" lines
    on stdin before each timed phase and prints its seconds."""
    role, root, me, total, page_bytes = args[0], Path(args[1]), int(args[2]), *map(int, args[3:5])
    PAGES["parts"], PAGES["spans"] = int(args[5]), args[6] == "spans"
    half = total // 2
    g = torch.Generator().manual_seed(me)
    mine = torch.randint(0, 256, (half,), dtype=torch.uint8, generator=g)
    g = torch.Generator().manual_seed(1 - me)
    theirs = torch.randint(0, 256, (half,), dtype=torch.uint8, generator=g)
    got = torch.zeros(half, dtype=torch.uint8)
    n = half // page_bytes
    print("ready", flush=True)
    sys.stdin.readline()
    if role == "raw":
        seconds = sum(raw_write(root / f"raw{me}.bin", memoryview(mine.numpy()), fsync=False))
    else:
        b = create_backend("file", root=root)
        seconds = sum(store_put(b, keys_for(me, n), page_views(mine, page_bytes)))
    print(f"put {seconds}", flush=True)
    sys.stdin.readline()
    if role == "raw":
        seconds = sum(raw_read(root / f"raw{1 - me}.bin", memoryview(got.numpy())))
    else:
        keys = keys_for(1 - me, n)
        # Untimed: another process's newest segments are seen within list_interval_s.
        deadline = time.monotonic() + 30
        while b.exists([PoolTransfer("kv", keys)]) != n:
            assert time.monotonic() < deadline, "the other process's pages never seen"
        seconds = sum(store_get(b, keys, page_views(got, page_bytes)))
    assert torch.equal(got, theirs), "the other process's pages differ"
    print(f"get {seconds}", flush=True)


def two_processes(
    work: Path, total: int, repeats: int, sizes: tuple[int, ...] = PAGE_SIZES
) -> list[Row]:
    rows = []
    for page_bytes in sizes:
        samples = {
            "raw": {"put": Samples(), "get": Samples()},
            "segment": {"put": Samples(), "get": Samples()},
        }
        for rep in range(repeats):
            for role in ("raw", "segment")[:: 1 if rep % 2 == 0 else -1]:  # who goes first
                root = work / f"mp-{role}"
                root.mkdir(mode=0o700)
                procs = [
                    subprocess.Popen(
                        [
                            sys.executable,
                            __file__,
                            "--child",
                            role,
                            str(root),
                            str(me),
                            str(total),
                            str(page_bytes),
                            str(PAGES["parts"]),
                            "spans" if PAGES["spans"] else "tensors",
                        ],
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        text=True,
                    )
                    for me in (0, 1)
                ]
                for p in procs:
                    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
                for phase in ("put", "get"):
                    os.sync()
                    if phase == "get":
                        drop_caches(root)
                    settle_memory()  # here, not in the children: the pages are the guest's
                    for p in procs:
                        assert p.stdin is not None
                        p.stdin.write("go\n")
                        p.stdin.flush()
                    secs = []
                    for p in procs:
                        assert p.stdout is not None
                        word, value = p.stdout.readline().split()
                        assert word == phase
                        secs.append(float(value))
                    samples[role][phase].add([max(secs)])  # aggregate: both halves by the last
                for p in procs:
                    assert p.wait(timeout=120) == 0, f"{role} child failed"
                shutil.rmtree(root)
        load = os.getloadavg()[0]
        for phase in ("put", "get"):
            rows.append(
                Row(
                    page_bytes,
                    f"2 processes {phase} (cold)" if phase == "get" else "2 processes put",
                    samples["raw"][phase],
                    {"segment": samples["segment"][phase]},
                    load=load,
                )
            )
    return rows


# -- restart --------------------------------------------------------------------------------------


def rebuild_seconds_per_million(work: Path, entries: int = 1_000_000, segments: int = 16) -> float:
    """Seconds per million pages to open a root of ``entries`` journal entries (64 KiB pages)."""
    root = work / "rebuild"
    root.mkdir(mode=0o700)
    keys = page_hashes(torch.arange(entries * 16), NS)
    per = entries // segments
    record = 64 << 10
    for s in range(segments):
        stem = f"{1000 + s}-{s:08x}-00000001"
        with open(root / f"{stem}.kvj", "wb") as f:
            f.write(
                b"".join(
                    encode_entry(Entry(f"{k}.kv.r0", j * record, 64 << 10, j, j, 1, j))
                    for j, k in enumerate(keys[s * per : (s + 1) * per])
                )
            )
        with open(root / f"{stem}.kvs", "wb") as f:
            f.truncate(per * record)  # sparse: the rebuild reads journals only
        os.chmod(root / f"{stem}.kvj", 0o600)
        os.chmod(root / f"{stem}.kvs", 0o600)
    os.sync()
    drop_caches(root)
    start = time.perf_counter()
    b = create_backend("file", root=root)
    seconds = time.perf_counter() - start
    assert b.exists([PoolTransfer("kv", keys[:8])]) == 8
    b.close()
    shutil.rmtree(root)
    return seconds / entries * 1e6


# -- report -----------------------------------------------------------------------------------------


def command_output(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, check=False, capture_output=True, text=True).stdout.strip()
    except OSError as e:
        return f"({cmd[0]}: {e})"


def environment(directory: Path) -> dict[str, str]:
    cpu = next(
        (
            ln.split(":", 1)[1].strip()
            for ln in Path("/proc/cpuinfo").read_text().splitlines()
            if ln.startswith("model name")
        ),
        platform.processor(),
    )
    from importlib.metadata import version

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": f"{cpu}, {os.cpu_count()} logical CPUs",
        "mount": command_output(
            ["findmnt", "-no", "SOURCE,FSTYPE,OPTIONS", "-T", str(directory)]
        ).splitlines()[0],
        "df": command_output(["df", "-h", str(directory)]).splitlines()[-1],
        "lsblk": "; ".join(command_output(["lsblk", "-dno", "NAME,SIZE,ROTA,TYPE"]).splitlines()),
        "versions": f"python {platform.python_version()}, torch {torch.__version__}, "
        f"xxhash {version('xxhash')}",
        "command": "python3 " + " ".join(sys.argv),
    }


def settle_line() -> str:
    sec = SETTLE["seconds"]
    if not SETTLE["bytes"]:
        return "- no memory touched before the timed phases (--settle-mib 0)"
    rate = f", {SETTLE['bytes'] / statistics.median(sec) / 1e9:.1f} GB/s median" if sec else ""
    worst = f", slowest {SETTLE['bytes'] / max(sec) / 1e9:.2f} GB/s" if sec else ""
    return (
        f"- before each timed phase {SETTLE['bytes'] >> 20} MiB of memory "
        f"touched and freed, untimed ({len(sec)} times here{rate}{worst})"
    )


def table(rows: list[Row], total: int) -> list[str]:
    out = [
        (
            "| where | page | operation | raw GB/s | segment GB/s | % of raw | segment batch p50 / p90 / p99 ms "
            "| segment, Python loops GB/s | % of raw | per-page GB/s | % of raw "
            "| CPU s/GB raw / segment | load |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        raw = r.raw.gbps(total)
        cells = [r.where, f"{r.page_bytes >> 10} KiB", r.op, f"{raw:.2f}"]
        for kind in STORES:
            s = r.stores.get(kind)
            if s is None or not s.totals:
                cells += ["-", "-"] + (["-"] if kind == "segment" else [])
                continue
            cells += [f"{s.gbps(total):.2f}", f"{100 * s.gbps(total) / raw:.0f}%"]
            if kind == "segment":
                p50, p90, p99 = s.percentiles_ms()
                cells.append(f"{p50:.1f} / {p90:.1f} / {p99:.1f}")
        seg = r.stores.get("segment")
        cpu = (r.raw.cpu_per_gb(total), seg.cpu_per_gb(total) if seg is not None else None)
        cells.append(" / ".join("-" if c is None else f"{c:.3f}" for c in cpu))
        cells.append(f"{r.load:.1f}")
        out.append("| " + " | ".join(cells) + " |")
    return out


def plot(rows: list[Row], total: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(11, 0.32 * len(rows)), 5.5))
    labels, width = [f"{r.op} {r.page_bytes >> 10} KiB ({r.where})" for r in rows], 0.2
    xs = range(len(rows))
    ax.bar(
        [x - width for x in xs],
        [r.raw.gbps(total) for r in rows],
        width,
        color="0.6",
        label="raw sequential IO",
    )
    for k, (kind, color) in enumerate(zip(STORES, ("C0", "C2", "C1"))):
        ax.bar(
            [x + k * width for x in xs],
            [r.stores[kind].gbps(total) if r.stores.get(kind) else 0 for r in rows],
            width,
            color=color,
            label={"segment-py": "segment store, Python loops"}.get(kind, f"{kind} store"),
        )
    ax.set_xticks(list(xs), labels, rotation=60, ha="right", fontsize=7)
    ax.set_ylabel("GB/s")
    ax.legend(fontsize=8)
    ax.set_title(
        "L3 file stores against raw sequential file IO (same directory, same run)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--dir",
        type=Path,
        nargs="+",
        default=[Path(tempfile.gettempdir())],
        help="directories on the disks to measure (default: the system temp dir)",
    )
    p.add_argument("--total-mib", type=int, default=256, help="bytes per measurement")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "results")
    p.add_argument(
        "--pages",
        type=int,
        nargs="+",
        default=[n >> 10 for n in PAGE_SIZES],
        help="page object sizes in KiB (default: 64 256 2048)",
    )
    p.add_argument(
        "--settle-mib",
        type=int,
        default=None,
        help="memory touched and freed before each timed phase (default: twice --total-mib; 0: "
        "none), see settle_memory",
    )
    p.add_argument(
        "--parts",
        type=int,
        choices=(1, 2),
        default=1,
        help="parts per page: 1, or 2 as a page_first KV host pool's pages (K and V ranges)",
    )
    p.add_argument(
        "--spans",
        action="store_true",
        help="pages as PageSpans (byte ranges of the pool, as the L3 tier passes a page_first "
        "pool's pages) instead of a tensor per page",
    )
    p.add_argument(
        "--two-only",
        action="store_true",
        help="only the two-process rows (run it under taskset to give the two processes more CPUs)",
    )
    p.add_argument(
        "--single-only",
        action="store_true",
        help="only the one-process rows (no two-process rows, no index rebuild): a quick check",
    )
    args = p.parse_args()
    if args.two_only and args.single_only:
        p.error("--two-only and --single-only exclude each other")
    sizes = tuple(n << 10 for n in args.pages)
    if any(n <= 0 or (8 << 20) % (n << 10) for n in args.pages):
        p.error(f"--pages must divide 8 MiB (one storage call), got {args.pages}")
    total = args.total_mib << 20
    PAGES["parts"], PAGES["spans"] = args.parts, args.spans
    SETTLE["bytes"] = (2 * args.total_mib if args.settle_mib is None else args.settle_mib) << 20
    rebuild_us = None
    assert total % (2 * BATCH_BYTES) == 0, "--total-mib must be a multiple of 16"
    load0 = os.getloadavg()
    rows: list[Row] = []
    envs: list[dict[str, str]] = []
    pool = torch.randint(0, 256, (2 * total,), dtype=torch.uint8)
    for i, directory in enumerate(args.dir):
        directory.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=directory))
        try:
            envs.append(environment(work))
            how_cold = drop_caches(work)
            fs = command_output(["findmnt", "-no", "FSTYPE", "-T", str(work)]) or str(directory)
            fs = fs.splitlines()[0]
            here = [] if args.two_only else single_process(work, pool, total, args.repeats, sizes)
            if not args.single_only:
                here += two_processes(work, total, args.repeats, sizes)
            rows += [dataclasses.replace(r, where=fs) for r in here]
            if i == 0 and not (args.single_only or args.two_only):
                rebuild_us = rebuild_seconds_per_million(work)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    env = envs[0]
    for key in ("mount", "df"):
        env[key] = "; ".join(e[key] for e in envs)
    load1 = os.getloadavg()

    args.out.mkdir(parents=True, exist_ok=True)
    lines = ["# L3 file stores: segment store vs per-page files vs raw IO", ""]
    lines += [f"- {k}: {v}" for k, v in env.items()]
    lines += [
        (
            f"- load average (1/5/15 min) before: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}; "
            f"after: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}"
        ),
        (
            f"- {total >> 20} MiB per measurement, median of {args.repeats} repeats; "
            f"{BATCH_BYTES >> 20} MiB per storage call (raw: per write); cold reads after {how_cold}"
        ),
        (
            (
                "- pages of one part each"
                if args.parts == 1
                else "- pages of two parts each "
                "(page_first KV: K range and V range, half a page each)"
            )
            + (", given as PageSpans (no tensor per page)" if args.spans else ", a tensor per part")
        ),
        settle_line(),
        "",
    ]
    lines += table(rows, total)
    if rebuild_us is not None:
        lines += [
            "",
            (
                f"Index rebuild at start-up (1M synthetic journal entries, cold cache): "
                f"{rebuild_us:.2f} s per million pages."
            ),
        ]
    lines.append("")
    (args.out / "bench_storage.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    try:
        plot(rows, total, args.out / "bench_storage.png")
    except ImportError as e:  # matplotlib is the bench extra: the table stands without it
        print(f"no plot: {e}")


if __name__ == "__main__":
    main()
