"""Where bench_e2e's overlapped run loses time that no code of kvtier's spends: the floor.

``python3 -m profiling.e2e_floor``: bench_e2e's Llama-shaped forward (1K new tokens over an 8K
context; its K/V in plain device tensors, no cache) timed alone and beside host-to-device copies
of bench_e2e's load (the same bytes) that are all enqueued before the forward starts, as one copy
and as one copy per layer: no CPU of the load runs during the forward, so what the forward loses
is what the copies' HBM and PCIe traffic cost its kernels. Also beside a Python thread that only
spins: what any thread that keeps the GIL does to the forward's launches. Rounds alternate the
cases. Writes ``e2e_floor.md``, ``.json`` and ``.png`` to ``--out``.

``--calls [bench_e2e args]``: instead, bench_e2e itself with every ``cudaMemcpyBatchAsync`` call
recorded (descriptors, bytes, CPU µs, thread), printed at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time

import torch

from profiling.common import environment, header_lines, median


def calls(argv: list[str]) -> None:
    from kvtier.kernels import copy_engine
    from profiling import bench_e2e

    log: list[tuple[int, int, float, str]] = []
    orig = copy_engine._BatchCall.__call__

    def recorded(self, dst, src, sizes, stream):
        t = time.perf_counter()
        orig(self, dst, src, sizes, stream)
        us = (time.perf_counter() - t) * 1e6
        log.append((len(sizes), int(sizes.sum()), us, threading.current_thread().name))

    copy_engine._BatchCall.__call__ = recorded
    sys.argv = ["bench_e2e", *argv]
    bench_e2e.main()
    if not log:
        print("no cudaMemcpyBatchAsync call was made")
        return
    n, nbytes, us = ([x[i] for x in log] for i in range(3))
    print(f"cudaMemcpyBatchAsync calls: {len(log)}, threads {sorted({x[3] for x in log})}")
    print(f"  descriptors per call: min {min(n)}, median {median(n):g}, max {max(n)}")
    print(f"  MiB per call: median {median(nbytes) / 2**20:.1f}")
    print(f"  CPU us per call: median {median(us):.0f}, max {max(us):.0f}")


def contention(reps: int, out: str) -> None:
    from profiling.bench_e2e import HD, KVH, VOCAB, L, LlamaShaped

    dev = torch.device("cuda")
    ctx, new = 8192, 1024

    class Pool:
        def __init__(self) -> None:
            def kv() -> list[torch.Tensor]:
                return [torch.randn(ctx, KVH, HD, device=dev).to(torch.bfloat16) for _ in range(L)]

            self.ks, self.vs = kv(), kv()

        def k(self, layer: int) -> torch.Tensor:
            return self.ks[layer]

        def v(self, layer: int) -> torch.Tensor:
            return self.vs[layer]

    class Cache:  # what LlamaShaped.forward reads of a cache when it does not wait
        full_pool = Pool()

    cache, model = Cache(), LlamaShaped(L, dev)
    tokens = torch.randint(0, VOCAB, (new,), device=dev)
    slots = torch.arange(ctx, device=dev)
    nbytes = (ctx - new) * L * 2 * KVH * HD * 2  # bench_e2e's load: 7K tokens of K and V
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory().random_(0, 255)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    side = torch.cuda.Stream()
    per = nbytes // L

    def forward() -> None:
        with torch.no_grad():
            model.forward(cache, tokens, ctx - new, slots, wait=False)

    def one(case: str) -> tuple[float, float]:
        torch.cuda.synchronize()
        stop, spinner = threading.Event(), None
        if case == "spin":

            def spin() -> None:
                x = 0
                while not stop.is_set():
                    for _ in range(1000):
                        x += 1

            spinner = threading.Thread(target=spin)
            spinner.start()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        with torch.cuda.stream(side):
            if case == "one copy":
                dst.copy_(src, non_blocking=True)
            elif case == "per-layer copies":
                for i in range(L):
                    dst[i * per : (i + 1) * per].copy_(src[i * per : (i + 1) * per], True)
        a.record()
        forward()
        b.record()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        stop.set()
        if spinner is not None:
            spinner.join()
        return a.elapsed_time(b), wall * 1e3

    for _ in range(3):
        forward()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    e0.record(side)
    with torch.cuda.stream(side):
        dst.copy_(src, non_blocking=True)
    e1.record(side)
    torch.cuda.synchronize()
    copy_ms = e0.elapsed_time(e1)
    cases = ("alone", "one copy", "per-layer copies", "spin")
    res: dict[str, list[tuple[float, float]]] = {c: [] for c in cases}
    for r in range(reps):
        for c in cases[r % len(cases) :] + cases[: r % len(cases)]:  # rotated each round
            if c == "spin" and r >= 2:
                continue  # seconds a run: two are enough
            res[c].append(one(c))
    base = median(g for g, _ in res["alone"])
    info = environment() | {"reps": reps, "copy_bytes": nbytes, "copy_alone_ms": copy_ms}
    lines = [
        "# The forward beside the load's copies, with no CPU of the load",
        "",
        *header_lines(info),
        f"- Copy alone: {nbytes / 2**20:.0f} MiB host to device in {copy_ms:.2f} ms "
        f"({nbytes / copy_ms / 1e6:.1f} GB/s)",
        "",
        "| case | forward GPU ms, median | vs alone | wall ms, median | GPU ms per run |",
        "|---|---|---|---|---|",
    ]
    table = {}
    for c, v in res.items():
        g, w = median(x for x, _ in v), median(x for _, x in v)
        table[c] = {"gpu_ms": g, "wall_ms": w, "ratio": g / base, "runs": v}
        runs = " ".join(f"{x:.1f}" for x, _ in v)
        lines.append(f"| {c} | {g:.2f} | {g / base:.3f} | {w:.2f} | {runs} |")
    text = "\n".join(lines) + "\n"
    print(text)
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "e2e_floor.md"), "w") as f:
        f.write(text)
    with open(os.path.join(out, "e2e_floor.json"), "w") as f:
        json.dump({"info": info, "cases": table}, f, indent=1)
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    shown = [c for c in cases if c != "spin"]
    fig, ax = plt.subplots(figsize=(6, 3.2))
    ax.bar(shown, [table[c]["ratio"] for c in shown], color=["#999", "#4a7", "#4a7"])
    ax.axhline(1.05, color="r", ls="--", lw=1, label="issue 12: overlapped ≤ 1.05 of compute")
    ax.set_ylim(0.95, 1.1)
    ax.set_ylabel("forward GPU time / alone")
    ax.set_title(f"Forward beside {nbytes / 2**20:.0f} MiB of H2D copies, no load CPU")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(os.path.join(out, "e2e_floor.png"), dpi=120)


def main() -> None:
    if "--calls" in sys.argv:
        i = sys.argv.index("--calls")
        calls(sys.argv[i + 1 :])
        return
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--out", default="profiling/results")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("e2e_floor needs a CUDA GPU")
    contention(args.reps, args.out)


if __name__ == "__main__":
    main()
