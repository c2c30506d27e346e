"""Scheduler-side cost of the radix tree per request: match + lock, then insert + unlock.

Replays a synthetic multi-turn chat trace: 16 shared system prompts (1024 tokens), conversations
of 4 turns (128-token user message + 128-token reply each, so prompts reach ~2k tokens), 25% of
conversations branching off another conversation's turn (regenerate/edit). Requests of many
conversations are interleaved. P = 16. Slot allocation and the request-row concat are not timed.

Two tree sizes: "small" (the trace alone on a pool sized so the tree stays near 10^3 live nodes;
when an allocation fails, 1/32 of the pool is evicted, and those calls are timed separately) and
"large" (the tree pre-filled to ~10^5 nodes; no eviction).

    python3 -m profiling.bench_tree --requests 10000 --out profiling/results
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import time
from dataclasses import dataclass

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


def run(name: str, trace: list[list[int]], kv_size: int, n_docs: int, evict_frac: int = 32) -> Row:
    tree = build_tree(TreeConfig(page_size=P, kv_size=kv_size))
    kv = tree.full.device_alloc
    prefill(tree, kv, n_docs, seed=1)
    nodes_start = len(tree.all_nodes())
    # A serving engine freezes long-lived objects after warm-up; without it the cyclic GC walks
    # the whole tree in the middle of random requests.
    gc.collect()
    gc.freeze()
    costs, pages, evicts, match_costs, insert_costs, sizes = [], [], [], [], [], []
    clock = time.perf_counter_ns
    for i, tokens in enumerate(trace):
        if i % 250 == 0:
            sizes.append(len(tree.all_nodes()))
        prompt = tokens[: len(tokens) - MSG_LEN]
        t0 = clock()
        m = tree.match_prefix(prompt)
        handle = tree.pin(m.last_device_node)
        t1 = clock()
        need = len(tokens) - m.device_len
        slots = kv.alloc(need)
        if slots is None:
            e0 = clock()
            tree.evict(full=need + kv_size // evict_frac)
            evicts.append((clock() - e0) / 1e3)
            slots = kv.alloc(need)
        row = torch.cat([m.device_indices, slots])
        t2 = clock()
        tree.insert(tokens, row, prev_prefix_len=m.device_len)
        tree.unpin(handle)
        t3 = clock()
        costs.append((t1 - t0 + t3 - t2) / 1e3)
        match_costs.append((t1 - t0) / 1e3)
        insert_costs.append((t3 - t2) / 1e3)
        pages.append(m.device_len // P)
    sizes.append(len(tree.all_nodes()))
    tree.check_integrity()
    gc.unfreeze()
    buckets: dict[int, list[float]] = {}
    for c, p in zip(costs, pages):
        buckets.setdefault(p // 16 * 16, []).append(c)
    pct = percentiles(costs, (50, 99))
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


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=10000)
    ap.add_argument("--out", default="profiling/results")
    args = ap.parse_args()
    trace = make_trace(args.requests, seed=0)
    rows = [
        run("small", trace, kv_size=P * 18_000, n_docs=0),
        run("large", trace, kv_size=P * 400_000, n_docs=2000),
    ]
    for r in rows:
        print(r)
    plot(rows, f"{args.out}/bench_tree.png")
    lines = [
        "# bench_tree: radix tree scheduler-side cost per request",
        "",
        *header_lines(environment()),
        (
            f"- trace: {args.requests} requests, 16 system prompts of {SYS_LEN} tokens, {TURNS}-turn "
            f"conversations (+{2 * MSG_LEN} tokens a turn, prompts up to ~2k tokens), 25% branches; P={P}"
        ),
        (
            "- cost = match_prefix + lock, then insert + unlock (allocation and row concat not timed);"
            " gc.freeze() after the tree is pre-filled"
        ),
        "- the machine has 2 cores shared with another engineer's test runs: expect noise",
        "",
        (
            "| tree | requests | live nodes: start / mean of 2nd half / max | median µs | p99 µs | mean µs | "
            "median match+lock / insert+unlock µs | evict calls (median µs) |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.name} | {r.requests} | {r.nodes_start:,} / {r.nodes_mean:,} / {r.nodes_max:,} | "
            f"{r.p50_us:.1f} | {r.p99_us:.1f} | {r.mean_us:.1f} | {r.match_p50_us:.1f} / "
            f"{r.insert_p50_us:.1f} | {r.evict_calls} ({r.evict_p50_us:.0f}) |"
        )
    lines += ["", "Median µs by matched pages (bucket start):", ""]
    for r in rows:
        lines.append(f"- {r.name}: " + ", ".join(f"{k}: {v:.1f}" for k, v in r.by_pages.items()))
    lines += ["", "![cost by matched pages](bench_tree.png)", ""]
    with open(f"{args.out}/bench_tree.md", "w") as f:
        f.write("\n".join(lines))


if __name__ == "__main__":
    main()
