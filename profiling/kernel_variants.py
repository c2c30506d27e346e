"""Copy-kernel knobs on and off on 1-4 programs, alternated in one run.

Two tile-order knobs of ``TransferKnobs`` landed together (H200, 2026-11-29), and this tool
measures each against the kernel without it:

- ``prefetch_h2d``: a host->device program reads the next tile's slot indices and table entry
  while this tile's host reads are in flight, before its stores;
- ``layer_inner``: an all-layer call whose host keeps a token's layers side by side (and that
  does not take layer rows) walks layers innermost: a program's next tile is the next
  (buffer, layer) of the same rows, so each row's host side runs along its token's layers.

Variants: the defaults, each knob off, both off (the kernel before them). Each round measures
every variant of a cell in turn (the order rotated each round), as % of the copy engine (a
contiguous pinned ``copy_`` of the same bytes); every round is reported. Cases cover both
directions, both host layouts, one-layer and all-layer calls, the small host->device variant
(a one-layer call of at most ``small_h2d_bytes``) and the token variant (page size 1).

Usage::

    python3 -m profiling.kernel_variants --rounds 3 --out DIR   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import replace

import torch

from kvtier.kernels.kv_transfer import TransferKnobs
from profiling.bench_small_grid import copy_call
from profiling.bench_transfer import N_TOKENS, Ceiling, make_host, make_pools, random_slots
from profiling.common import environment, gbs, header_lines, median_ms

VARIANTS = {
    "defaults": {},
    "no prefetch": {"prefetch_h2d": False},
    "no layer_inner": {"layer_inner": False},
    "neither": {"prefetch_h2d": False, "layer_inner": False},
}

# (host layout, direction, layer (None: all layers), page size, tokens, programs, sgl-kernel's
# recorded % of the copy engine at 1 / 2 / 4 CTAs where limits.md has one).
CASES = (
    ("page_first", "d2h", None, 16, N_TOKENS, (1, 2, 3, 4), {1: 73, 2: 95, 4: 95}),
    ("layer_first", "d2h", None, 16, N_TOKENS, (2, 4), {2: 94, 4: 94}),
    ("layer_first", "h2d", 0, 16, N_TOKENS, (1, 2, 4), {1: 39, 2: 73, 4: 93}),
    ("page_first", "h2d", 0, 16, N_TOKENS, (1, 2, 4), {1: 31, 2: 59, 4: 92}),
    ("page_first", "h2d", None, 16, N_TOKENS, (2, 4), {}),
    ("layer_first", "h2d", None, 16, N_TOKENS, (2, 4), {}),
    ("layer_first", "h2d", 0, 16, 1024, (2, 4), {}),  # 4 MiB: the small variant
    ("page_first", "h2d", 0, 16, 1024, (2, 4), {}),
    ("layer_first", "h2d", 0, 1, N_TOKENS, (1, 2), {}),  # the token variant
    ("page_first", "h2d", None, 1, N_TOKENS, (2, 4), {}),
    ("page_first", "d2h", 0, 1, N_TOKENS, (2, 4), {}),
)


def measure(rounds: int) -> list[dict]:
    dev, _stacks, cfg = make_pools("llama3-8b")
    ceiling = Ceiling()
    gen = torch.Generator().manual_seed(1)
    out = []
    names = list(VARIANTS)
    for layout, direction, layer, P, tokens, programs_list, sgl in CASES:
        host = make_host(cfg, layout, P)
        didx, hidx = random_slots(P, gen)[:tokens], random_slots(P, gen)[:tokens]
        n_sel = 1 if layer is not None else dev.num_layers
        nbytes = tokens * dev.num_buffers * n_sel * dev.item_bytes
        ce = ceiling(nbytes, direction)
        for programs in programs_list:
            base = TransferKnobs(programs)
            fns = {
                n: copy_call(dev, host, didx, hidx, direction, layer, replace(base, **kw))
                for n, kw in VARIANTS.items()
            }
            pcts = {n: [] for n in names}
            for r in range(rounds):
                for n in names[r % len(names) :] + names[: r % len(names)]:
                    pcts[n].append(100 * gbs(nbytes, median_ms(fns[n], rep_ms=60)) / ce)
            row = {
                "layout": layout,
                "direction": direction,
                "scope": "all layers" if layer is None else "one layer",
                "P": P,
                "tokens": tokens,
                "mib": nbytes / 2**20,
                "programs": programs,
                "sgl_kernel_pct": sgl.get(programs),
                "pct": pcts,
                "median": {n: statistics.median(v) for n, v in pcts.items()},
            }
            out.append(row)
            print(
                f"{layout:11s} {direction} {row['scope']:10s} P={P:<2d} {row['mib']:.0f} MiB "
                f"programs={programs}: "
                + ", ".join(f"{n} {' / '.join(f'{x:.1f}' for x in v)}" for n, v in pcts.items()),
                flush=True,
            )
    return out


def write(rows: list[dict], info: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(VARIANTS)
    lines = [
        "# Copy-kernel variants, % of the copy engine, every round",
        "",
        *header_lines(info),
        "",
        "| layout | copy | P | MiB | programs | " + " | ".join(names) + " | sgl-kernel, recorded |",
        "|---|---|---|---|---|" + "---|" * (len(names) + 1),
    ]
    for r in rows:
        cells = [" / ".join(f"{x:.1f}" for x in r["pct"][n]) for n in names]
        lines.append(
            f"| {r['layout']} | {r['direction']} {r['scope']} | {r['P']} | {r['mib']:.0f} | "
            f"{r['programs']} | "
            + " | ".join(cells)
            + f" | {r['sgl_kernel_pct'] if r['sgl_kernel_pct'] is not None else '—'} |"
        )
    with open(os.path.join(out, "kernel_variants.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    with open(os.path.join(out, "kernel_variants.json"), "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    fig, ax = plt.subplots(figsize=(12, 5))
    x = range(len(rows))
    width = 0.8 / len(names)
    for j, n in enumerate(names):
        ax.bar([i + j * width for i in x], [r["median"][n] for r in rows], width, label=n)
    ax.set_xticks([i + 0.4 for i in x])
    ax.set_xticklabels(
        [
            f"{r['layout'][:5]} {r['direction']}\n{r['scope'][:3]} P{r['P']} {r['mib']:.0f}M p{r['programs']}"
            for r in rows
        ],
        fontsize=7,
    )
    ax.set_ylabel("% of the copy engine (median over rounds)")
    ax.set_ylim(0, 105)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "kernel_variants.png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    info = environment()
    info["command"] = "python3 -m profiling.kernel_variants " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items() if v is not None and k != "out"
    )
    rows = measure(args.rounds)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        write(rows, info, args.out)


if __name__ == "__main__":
    main()
