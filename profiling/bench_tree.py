"""Scheduler-side cost of the radix tree per request: match + lock, then insert + unlock.

Replays a synthetic multi-turn chat trace: 16 shared system prompts (1024 tokens), conversations
of 4 turns (128-token user message + 128-token reply each, so prompts reach ~2k tokens), 25% of
conversations branching off another conversation's turn (regenerate/edit). Requests of many
conversations are interleaved. P = 16. Slot allocation and the request-row concat are not timed.

Two tree sizes: "small" (the trace alone on a pool sized so the tree stays near 10^3 live nodes;
when an allocation fails, 1/32 of the pool is evicted, and those calls are timed separately) and
"large" (the tree pre-filled to ~10^5 nodes; no eviction).

Each request's cost is also split by whether CPython's cyclic GC ran inside it (``gc.callbacks``):
the p99 of the requests no collection touched is the tree's own tail; collections are counted
with their median pause, beside the mean net count of GC-tracked objects a request leaves
allocated (what brings the next generation-0 collection closer). ``--baseline DIR`` replays
the same trace, in the same session, on an older checkout (``git worktree add DIR <commit>``)
for a before/after table. The p99 of the thread's CPU time per request sits beside the wall-clock
one: on a shared machine the wall-clock tail also holds the time slices of other processes.

    python3 -m profiling.bench_tree --requests 10000 --out profiling/results --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

import torch

from kvtier.runtime import TreeConfig, build_tree
from profiling.common import environment, header_lines, median, percentiles

P = 16
SYS_LEN, MSG_LEN, TURNS = 1024, 128, 4


@dataclass(frozen=True)
class Row:
    """One tree size: per-request cost percentiles (µs) and tree size (nodes)."""

    name: str
    requests: int
    p50_us: float
    p99_us: float
    mean_us: float
    nodes_start: int
    nodes_mean: int
    nodes_max: int
    match_p50_us: float
    insert_p50_us: float
    evict_calls: int
    evict_p50_us: float
    by_pages: dict[int, float]
    p99_no_gc_us: float  # p99 over the requests no GC collection ran inside
    gc_collections: dict[int, int]  # generation -> collections inside timed requests
    gc_pause_p50_us: float  # median pause of those collections
    p999_us: float = 0.0
    # mean net count of GC-tracked objects a request leaves allocated (CPython's gen-0 trigger)
    gc_allocs: float = 0.0
    # p99 of the thread's CPU time per request (GC pauses in, time the OS gave other processes
    # out): on a shared machine the wall-clock tail also holds other processes' time slices
    cpu_p99_us: float = 0.0


def make_trace(n_requests: int, seed: int) -> list[list[int]]:
    """Prompt+reply token lists in arrival order."""
    rng = random.Random(seed)
    systems = [[rng.randrange(32000) for _ in range(SYS_LEN)] for _ in range(16)]

    def msg() -> list[int]:
        return [rng.randrange(32000) for _ in range(MSG_LEN)]

    finished: list[list[list[int]]] = []  # turns of finished conversations, for branching
    active: list[list[list[int]]] = []  # per conversation: context after each turn
    trace: list[list[int]] = []
    while len(trace) < n_requests:
        if len(active) < 32:
            if finished and rng.random() < 0.25:
                turns = rng.choice(finished)
                active.append(turns[: rng.randrange(1, len(turns))])
            else:
                active.append([rng.choice(systems)])
        i = rng.randrange(len(active))
        turns = active[i]
        ctx = turns[-1] + msg() + msg()
        trace.append(ctx)
        turns = turns + [ctx]
        if len(turns) > TURNS:
            active.pop(i)
            finished.append(turns)
        else:
            active[i] = turns
    return trace


def prefill(tree, kv, n_docs: int, seed: int) -> None:
    """Fill the tree with ``n_docs`` documents of 2 pages, each with 48 one-page branches."""
    rng = random.Random(seed)
    for _ in range(n_docs):
        doc = [rng.randrange(32000) for _ in range(2 * P)]
        tree.insert(doc, kv.alloc(2 * P))
        for _ in range(48):
            seq = doc + [rng.randrange(32000) for _ in range(P)]
            m = tree.match_prefix(seq)
            tree.insert(
                seq, torch.cat([m.device_indices, kv.alloc(P)]), prev_prefix_len=m.device_len
            )


class _GcWatch:
    """Collections (generation, pause) while ``armed``: a request that saw one is marked.

    ``allocated()`` is the net count of GC-tracked allocations so far: the generation-0 count
    rises by one per GC-tracked allocation and falls by one per such deallocation, and a
    collection resets it (the watch carries what it had)."""

    def __init__(self) -> None:
        self.armed = False
        self.events: list[tuple[int, float]] = []
        self._t0 = 0
        self._carried = 0

    def allocated(self) -> int:
        return self._carried + gc.get_count()[0]

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._carried += gc.get_count()[0]
        if not self.armed:
            return
        if phase == "start":
            self._t0 = time.perf_counter_ns()
        else:
            self.events.append((info["generation"], (time.perf_counter_ns() - self._t0) / 1e3))


def run(name: str, trace: list[list[int]], kv_size: int, n_docs: int, evict_frac: int = 32) -> Row:
    tree = build_tree(TreeConfig(page_size=P, kv_size=kv_size))
    # Checkouts from before the rename of lock/unlock to pin/unpin run the same trace.
    pin = getattr(tree, "pin", None) or tree.lock
    unpin = getattr(tree, "unpin", None) or tree.unlock
    kv = tree.full.device_alloc
    prefill(tree, kv, n_docs, seed=1)
    nodes_start = len(tree.all_nodes())
    # A serving engine freezes long-lived objects after warm-up; without it the cyclic GC walks
    # the whole tree in the middle of random requests.
    gc.collect()
    gc.freeze()
    costs, pages, evicts, match_costs, insert_costs, sizes = [], [], [], [], [], []
    gc_hit: list[bool] = []
    net_allocs: list[int] = []
    watch = _GcWatch()
    gc.callbacks.append(watch)
    clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    cpu_costs: list[float] = []
    for i, tokens in enumerate(trace):
        if i % 250 == 0:
            sizes.append(len(tree.all_nodes()))
        prompt = tokens[: len(tokens) - MSG_LEN]
        seen = len(watch.events)
        allocated = watch.allocated()
        watch.armed = True
        c0 = cpu_clock()
        t0 = clock()
        m = tree.match_prefix(prompt)
        handle = pin(m.last_device_node)
        t1 = clock()
        c1 = cpu_clock()
        watch.armed = False
        need = len(tokens) - m.device_len
        slots = kv.alloc(need)
        if slots is None:
            e0 = clock()
            tree.evict(full=need + kv_size // evict_frac)
            evicts.append((clock() - e0) / 1e3)
            slots = kv.alloc(need)
        row = torch.cat([m.device_indices, slots])
        watch.armed = True
        c2 = cpu_clock()
        t2 = clock()
        tree.insert(tokens, row, prev_prefix_len=m.device_len)
        unpin(handle)
        t3 = clock()
        c3 = cpu_clock()
        watch.armed = False
        gc_hit.append(len(watch.events) > seen)
        net_allocs.append(watch.allocated() - allocated)
        costs.append((t1 - t0 + t3 - t2) / 1e3)
        cpu_costs.append((c1 - c0 + c3 - c2) / 1e3)
        match_costs.append((t1 - t0) / 1e3)
        insert_costs.append((t3 - t2) / 1e3)
        pages.append(m.device_len // P)
    sizes.append(len(tree.all_nodes()))
    tree.check_integrity()
    gc.callbacks.remove(watch)
    gc.unfreeze()
    clean = [c for c, hit in zip(costs, gc_hit) if not hit]
    collections: dict[int, int] = {}
    for gen, _ in watch.events:
        collections[gen] = collections.get(gen, 0) + 1
    buckets: dict[int, list[float]] = {}
    for c, p in zip(costs, pages):
        buckets.setdefault(p // 16 * 16, []).append(c)
    pct = percentiles(costs, (50, 99, 99.9))
    return Row(
        name,
        len(costs),
        pct[50],
        pct[99],
        statistics.fmean(costs),
        nodes_start,
        round(statistics.fmean(sizes[len(sizes) // 2 :])),
        max(sizes),
        median(match_costs),
        median(insert_costs),
        len(evicts),
        median(evicts) if evicts else 0.0,
        {k: median(v) for k, v in sorted(buckets.items()) if len(v) >= 20},
        percentiles(clean, (99,))[99],
        collections,
        median([p for _, p in watch.events]) if watch.events else 0.0,
        pct[99.9],
        statistics.fmean(net_allocs),
        percentiles(cpu_costs, (99,))[99],
    )


def plot(rows: list[Row], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for r in rows:
        xs = list(r.by_pages)
        ax.plot(
            xs, [r.by_pages[x] for x in xs], marker="o", label=f"{r.name} (~{r.nodes_mean:,} nodes)"
        )
    ax.axhline(50, color="grey", ls="--", lw=1, label="target median 50 µs")
    ax.set_xlabel("matched pages (bucket start, P=16)")
    ax.set_ylabel("median µs per request (match+lock+insert+unlock)")
    ax.set_ylim(bottom=0)
    ax.legend()
    ax.set_title("kvtier radix tree: scheduler-side cost per request")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


SIZES = {"small": (P * 18_000, 0), "large": (P * 400_000, 2000)}


def worker(name: str, requests: int, gen0: int | None) -> Row:
    """One tree size in this process (``gen0``: a gen-0 GC threshold, as engines tune it)."""
    if gen0 is not None:
        gc.set_threshold(gen0, *gc.get_threshold()[1:])
    kv_size, n_docs = SIZES[name]
    return run(name, make_trace(requests, seed=0), kv_size=kv_size, n_docs=n_docs)


def spawn(name: str, requests: int, code_dir: str | None, gen0: int | None = None) -> Row:
    """``worker`` in a fresh process, importing kvtier from ``code_dir`` (None: this checkout)."""
    args = ["--worker", name, "--requests", str(requests)] + (["--gen0", str(gen0)] if gen0 else [])
    if code_dir is None:
        cmd = [sys.executable, "-m", "profiling.bench_tree", *args]
    else:
        # An editable install puts a finder for kvtier ahead of sys.path (PYTHONPATH would lose
        # to it): drop that finder, then import kvtier from ``code_dir``.
        boot = (
            "import runpy, sys; "
            "sys.meta_path[:] = [f for f in sys.meta_path "
            "if not getattr(f, '__module__', '').startswith('__editable__')]; "
            f"sys.path[:0] = [{os.path.abspath(code_dir)!r}, {os.getcwd()!r}]; "
            f"sys.argv = ['bench_tree', *{args!r}]; "
            "runpy.run_module('profiling.bench_tree', run_name='__main__')"
        )
        cmd = [sys.executable, "-c", boot]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    lines = out.strip().splitlines()
    code = lines[-2].removeprefix("kvtier from ")
    expect = os.path.abspath(code_dir or os.getcwd())
    if not code.startswith(expect):
        raise RuntimeError(f"the worker imported kvtier from {code}, not from {expect}")
    d = json.loads(lines[-1])
    d["by_pages"] = {int(k): v for k, v in d["by_pages"].items()}
    d["gc_collections"] = {int(k): v for k, v in d["gc_collections"].items()}
    return Row(**d)


def table(rows: list[tuple[str, Row]]) -> list[str]:
    lines = [
        (
            "| code | tree | live nodes: start / mean of 2nd half / max | median µs | p99 µs | "
            "p99.9 µs | p99 of CPU time µs | p99 without a GC pause µs | "
            "GC collections in requests (gen 0/1/2), "
            "median pause µs | net GC-tracked allocations per request | "
            "median match+lock / insert+unlock µs | evict calls (median µs) |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for code, r in rows:
        gcs = "/".join(str(r.gc_collections.get(g, 0)) for g in range(3))
        lines.append(
            f"| {code} | {r.name} | {r.nodes_start:,} / {r.nodes_mean:,} / {r.nodes_max:,} | "
            f"{r.p50_us:.1f} | {r.p99_us:.1f} | {r.p999_us:.0f} | {r.cpu_p99_us:.1f} | "
            f"{r.p99_no_gc_us:.1f} | "
            f"{gcs}, {r.gc_pause_p50_us:.0f} | {r.gc_allocs:.2f} | "
            f"{r.match_p50_us:.1f} / {r.insert_p50_us:.1f} | "
            f"{r.evict_calls} ({r.evict_p50_us:.0f}) |"
        )
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--out", default="profiling/results")
    ap.add_argument("--baseline", help="an older checkout to replay the same trace on")
    ap.add_argument("--baseline-name", default="before")
    ap.add_argument("--worker", choices=sorted(SIZES), help=argparse.SUPPRESS)
    ap.add_argument("--gen0", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        import kvtier

        row = worker(args.worker, args.requests, args.gen0)
        print(f"kvtier from {kvtier.__file__}")
        print(json.dumps(asdict(row)))
        return
    rows: list[tuple[str, Row]] = []
    for name in SIZES:  # interleaved, so both checkouts see the same load
        rows.append(("now", spawn(name, args.requests, None)))
        if args.baseline:
            rows.append((args.baseline_name, spawn(name, args.requests, args.baseline)))
    rows.append(("now, gen-0 GC threshold 50,000", spawn("large", args.requests, None, 50_000)))
    for code, r in rows:
        print(code, r)
    now = [r for code, r in rows if code == "now"]
    os.makedirs(args.out, exist_ok=True)
    plot(now, f"{args.out}/bench_tree.png")
    load = os.getloadavg()
    lines = [
        "# bench_tree: radix tree scheduler-side cost per request",
        "",
        *header_lines(environment()),
        (
            f"- trace: {args.requests} requests, 16 system prompts of {SYS_LEN} tokens, {TURNS}-turn "
            f"conversations (+{2 * MSG_LEN} tokens a turn, prompts up to ~2k tokens), 25% branches; P={P}"
        ),
        (
            "- cost = match_prefix + pin, then insert + unpin (allocation and row concat not timed);"
            " gc.freeze() after the tree is pre-filled; each row in a fresh process, rows interleaved"
        ),
        f"- load average at the end: {load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f} (2 cores)",
        "",
        *table(rows),
        "",
        "Median µs by matched pages (bucket start), this checkout:",
        "",
    ]
    for r in now:
        lines.append(f"- {r.name}: " + ", ".join(f"{k}: {v:.1f}" for k, v in r.by_pages.items()))
    lines += ["", "![cost by matched pages](bench_tree.png)", ""]
    with open(f"{args.out}/bench_tree.md", "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
