"""Sidecar pages D↔H (DeepSeek-V4-like shapes) against the copy engine, in one run.

Measures, per sidecar and host layout, with the copy kernel at 4 programs:

- D→H and H→D of ``n`` pages, one layer and all layers (a backup moves all layers in one call,
  a layer-wise load-back one layer per step);
- the copy engine on the same bytes: one contiguous ``copy_`` between a device tensor and a pinned
  host tensor; each row reports the kernel as a % of it, timed in alternating rounds
  (``--rounds``, 3) with the median and the spread of the rounds' ratios.

Shapes. DeepSeek-V4 as its technical report describes it ("DeepSeek-V4: Towards Highly Efficient
Million-Token Context Intelligence"), in the summary at https://yiliu30.github.io/posts/ds-v4/:
61 layers, 512-dim compressed KV entries, ratios 4 (C4A) and 128 (C128A), a 128-token window,
an indexer with 128-dim keys. Entry sizes as serving engines store them: SemiAnalysis
InferenceX#2510 counts a DeepSeek-V4 cache entry as a 576-byte fp8_ds_mla entry plus a 132-byte
indexer entry (vLLM's DSv4 layout); the model's config.json was not at hand here, and the state's
size is an assumption. Entry sizes:

    sidecar      anchor  ratio  bytes per entry per layer
    c4           kv      4      576    one compressed K/V entry, fp8_ds_mla (InferenceX#2510)
    c4_indexer   kv      4      132    a 128-byte fp8 key and a 4-byte fp32 scale (as V3.2's)
    c4_state     swa     4      4096   ASSUMED: running K/V sum and score of the incomplete
                                       group, 2 x 512 fp32 (the public config does not give the
                                       state's layout)

61 layers each, pages of 256 tokens (64 entries a page). ``--quick`` shrinks everything (2
layers, 16-token pages, a few pages) so that it runs on a CPU through the Triton interpreter
(``TRITON_INTERPRET=1``): a smoke test of this script, not a measurement.

Usage::

    python3 -m profiling.bench_sidecar --out profiling/results     # on a GPU
    TRITON_INTERPRET=1 python3 -m profiling.bench_sidecar --quick  # CPU smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from collections.abc import Callable

import torch

from kvtier.kernels import TransferKnobs, set_debug_checks
from kvtier.runtime.pools.host import HostPool
from kvtier.runtime.pools.sidecar import SidecarDevicePool, SidecarSpec
from profiling.common import environment, gbs, header_lines, median_ms

LAYERS = 61
PAGE = 256
SIDECARS = (
    ("c4", 4, 576),
    ("c4_indexer", 4, 132),
    ("c4_state", 4, 4096),
)
PAGES_MOVED = (8, 32, 128)
POOL_PAGES = 256
LAYOUTS = ("page_first", "page_first_direct", "layer_first")


def copy_engine_call(nbytes: int, direction: str, device: torch.device) -> Callable[[], object]:
    """The ceiling: one contiguous copy of ``nbytes`` between device and (pinned) host."""
    d = torch.empty(nbytes, dtype=torch.uint8, device=device)
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")
    if direction == "d2h":
        return lambda: h.copy_(d, non_blocking=True)
    return lambda: d.copy_(h, non_blocking=True)


def interleaved(fn, ceiling_fn, nbytes: int, rounds: int) -> tuple[float, float, list[float]]:
    """Kernel and copy-engine timings taken in alternating rounds, so that a slow spell of the
    machine hits both: (median kernel GB/s, median copy-engine GB/s, the rounds' % of CE)."""
    k, c = [], []
    for _ in range(rounds):
        k.append(median_ms(fn))
        c.append(median_ms(ceiling_fn))
    pct = sorted(100 * ci / ki for ki, ci in zip(k, c))
    return gbs(nbytes, statistics.median(k)), gbs(nbytes, statistics.median(c)), pct


def rows_for(
    name: str,
    ratio: int,
    entry: int,
    layers: int,
    page: int,
    pool_pages: int,
    moved: tuple[int, ...],
    layouts: tuple[str, ...],
    device: torch.device,
    rounds: int,
) -> list[dict]:
    knobs = TransferKnobs(num_programs=4)
    spec = SidecarSpec(name, "kv", ratio, entry, tuple(range(layers)))
    pool = SidecarDevicePool(spec, pool_pages, page, device)
    pool.buffer.random_(0, 256)
    out = []
    for layout in layouts:
        host = HostPool(pool, layout, size=pool_pages, knobs=knobs)
        for n in moved:
            gen = torch.Generator().manual_seed(n)
            dev = torch.randperm(pool_pages, generator=gen)[:n].to(device)
            hst = torch.randperm(pool_pages, generator=gen)[:n].to(device)
            per_layer = n * pool.page_bytes
            cases = (
                ("d2h one layer", per_layer, lambda: host.backup(dev, hst, layer=0, check=False)),
                ("d2h all layers", per_layer * layers, lambda: host.backup(dev, hst, check=False)),
                ("h2d one layer", per_layer, lambda: host.load(hst, dev, layer=0, check=False)),
                ("h2d all layers", per_layer * layers, lambda: host.load(hst, dev, check=False)),
            )
            for what, nbytes, fn in cases:
                ceiling_fn = copy_engine_call(nbytes, what[:3], device)
                got, ceiling, pct = interleaved(fn, ceiling_fn, nbytes, rounds)
                del ceiling_fn
                row = {
                    "sidecar": name,
                    "layout": layout,
                    "what": what,
                    "pages": n,
                    "mib": nbytes / 2**20,
                    "gbs": got,
                    "ceiling": ceiling,
                    "pct": statistics.median(pct),
                    "pct_rounds": pct,
                    "programs": knobs.num_programs,
                }
                out.append(row)
                print(
                    f"{name:11s} {layout:17s} {what:15s} {n:4d} pages {row['mib']:9.3f} MiB "
                    f"{got:7.2f} GB/s = {row['pct']:5.1f}% of CE {ceiling:.2f} "
                    f"(rounds {pct[0]:.1f}-{pct[-1]:.1f})",
                    flush=True,
                )
    return out


def markdown(info: dict, rows: list[dict]) -> str:
    lines = ["# Sidecar pages D↔H (DeepSeek-V4-like), % of the copy engine", ""]
    lines += header_lines(info) + [""]
    lines += [
        "| sidecar | layout | copy | pages | MiB | GB/s | copy engine GB/s | % of CE "
        "(median of rounds) | rounds: lowest-highest % |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lo, hi = r["pct_rounds"][0], r["pct_rounds"][-1]
        lines.append(
            f"| {r['sidecar']} | {r['layout']} | {r['what']} | {r['pages']} | {r['mib']:.3f} | "
            f"{r['gbs']:.2f} | {r['ceiling']:.2f} | {r['pct']:.1f} | {lo:.1f}-{hi:.1f} |"
        )
    return "\n".join(lines) + "\n"


def plot(info: dict, rows: list[dict], path: str) -> None:
    """% of the copy engine per row (median of the rounds, bars from lowest to highest round),
    one panel per sidecar; the 90% bar of issue 11 drawn across."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    names = sorted({r["sidecar"] for r in rows}, key=[r["sidecar"] for r in rows].index)
    fig, axes = plt.subplots(len(names), 1, figsize=(16, 4 * len(names)), squeeze=False)
    short = {"layer_first": "lf", "page_first_direct": "pfd", "page_first": "pf"}
    for ax, name in zip(axes[:, 0], names):
        mine = [r for r in rows if r["sidecar"] == name]
        xs = range(len(mine))
        med = [r["pct"] for r in mine]
        lo = [r["pct"] - r["pct_rounds"][0] for r in mine]
        hi = [r["pct_rounds"][-1] - r["pct"] for r in mine]
        colors = ["tab:blue" if r["mib"] >= 1.0 else "tab:gray" for r in mine]
        ax.bar(xs, med, color=colors, yerr=[lo, hi], capsize=2)
        ax.axhline(90, color="tab:red", lw=1, ls="--")
        ax.set_xticks(list(xs))
        ax.set_xticklabels(
            [
                f"{short[r['layout']]} {r['what'].replace(' layers', '').replace(' layer', '')} "
                f"{r['mib']:.2g}M"
                for r in mine
            ],
            rotation=75,
            fontsize=7,
        )
        ax.set_ylim(0, 130)
        ax.set_ylabel("% of copy engine")
        ax.set_title(f"{name}: kernel at 4 programs vs one contiguous copy (gray: < 1 MiB a call)")
    fig.suptitle(f"bench_sidecar, {info.get('gpu')}, {info.get('date')}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=None, help="folder for bench_sidecar.{md,json}")
    ap.add_argument("--quick", action="store_true", help="tiny shapes: a CPU smoke test")
    ap.add_argument(
        "--rounds", type=int, default=3, help="alternating kernel / copy-engine rounds per row"
    )
    ap.add_argument("--replot", metavar="JSON", help="only redraw the PNG from a recorded JSON")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            rec = json.load(f)
        plot(rec["info"], rec["rows"], os.path.splitext(args.replot)[0] + ".png")
        return
    set_debug_checks(False)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if args.quick:
        shape = dict(layers=2, page=16, pool_pages=8, moved=(2,), layouts=LAYOUTS)
    else:
        if device.type != "cuda":
            raise SystemExit("bench_sidecar: measures on a GPU; use --quick for a CPU smoke test")
        shape = dict(
            layers=LAYERS, page=PAGE, pool_pages=POOL_PAGES, moved=PAGES_MOVED, layouts=LAYOUTS
        )
    rows = []
    for name, ratio, entry in SIDECARS:
        rows += rows_for(name, ratio, entry, device=device, rounds=args.rounds, **shape)
    info = environment()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "bench_sidecar.json"), "w") as f:
            json.dump({"info": info, "rows": rows}, f, indent=1)
        with open(os.path.join(args.out, "bench_sidecar.md"), "w") as f:
            f.write(markdown(info, rows))
        plot(info, rows, os.path.join(args.out, "bench_sidecar.png"))


if __name__ == "__main__":
    main()
