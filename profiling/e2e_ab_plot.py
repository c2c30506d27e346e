"""Pool an ``e2e_ab.sh`` A/B's per-repetition ratios (overlapped / max(transfer, compute)) by
side and plot them: each run's ratios, and each side's pooled median and quartiles.

    python3 -m profiling.e2e_ab_plot OUT_DIR PNG [--title T]

``OUT_DIR`` holds the A/B's run directories (``old_layer_first_1/bench_e2e.json`` ...) or
their JSONs flattened as ``old_layer_first_1.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics


def load(out_dir: str) -> dict[str, list[tuple[str, list[float]]]]:
    found: dict[str, list[tuple[str, list[float]]]] = {}
    paths = glob.glob(os.path.join(out_dir, "*", "bench_e2e.json"))
    paths += glob.glob(os.path.join(out_dir, "*.json"))
    for p in sorted(paths):
        name = os.path.basename(os.path.dirname(p)) if p.endswith("bench_e2e.json") else p
        m = re.match(r"(old|new)_(\w+?)_(\d+)", os.path.basename(name))
        if m is None:
            continue
        with open(p) as f:
            ratios = json.load(f)["paired_ratios"]
        found.setdefault(m.group(1), []).append((f"{m.group(2)} {m.group(3)}", ratios))
    return found


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("out_dir")
    ap.add_argument("png")
    ap.add_argument("--title", default="bench_e2e A/B: overlapped / max(transfer, compute)")
    args = ap.parse_args()
    found = load(args.out_dir)
    if not found:
        raise SystemExit(f"no old_*/new_* bench_e2e JSONs under {args.out_dir}")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for i, who in enumerate(("old", "new")):
        runs = found.get(who, [])
        pooled = sorted(r for _, rs in runs for r in rs)
        if not pooled:
            continue
        for j, (_, rs) in enumerate(runs):
            x = i + (j - (len(runs) - 1) / 2) * 0.05
            ax.scatter([x] * len(rs), rs, s=10, alpha=0.6)
        q1, med, q3 = statistics.quantiles(pooled, n=4)
        ax.hlines(med, i - 0.3, i + 0.3, colors="k")
        ax.hlines([q1, q3], i - 0.2, i + 0.2, colors="k", linestyles="dotted")
        share = sum(r <= 1.05 for r in pooled) / len(pooled)
        print(
            f"{who}: {len(runs)} runs, {len(pooled)} repetitions, median {med:.4f} "
            f"(quartiles {q1:.4f}-{q3:.4f}), {share:.0%} of repetitions <= 1.05"
        )
    ax.axhline(1.05, color="r", linewidth=0.8, label="issue 12: 1.05")
    ax.set_xticks([0, 1], ["old", "new"])
    ax.set_ylabel("overlapped / max(transfer, compute)")
    ax.set_title(args.title, fontsize=10)
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
