"""The copy kernel on 1, 2 and 4 programs (SMs), against the copy engine, in one run.

Issue 12 asks the kernel path to match sgl-kernel's transfer kernels at 2 SMs in every case.
sgl-kernel is not installable on the GPU machine here (its wheel is 511 MiB, built for another
torch), so this compares percentages of the copy engine: kvtier's, measured here against a
contiguous pinned ``copy_`` of the same bytes, and sgl-kernel's as recorded on an H200 in
``shared/reference/limits.md`` (Llama-3-8B-like pool, 8192 tokens in random 16-token pages),
shown beside them. Each kvtier row is timed with the default knobs for that grid size and with
16 warps (the default at 4 programs and up), so the table shows what the grid-size rule buys.

Usage::

    python3 -m profiling.bench_small_grid --out profiling/results   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import os

import torch

from kvtier.kernels import set_debug_checks
from kvtier.kernels.kv_transfer import TransferKnobs, copy_device_to_host, copy_host_to_device
from profiling.bench_transfer import N_TOKENS, Ceiling, make_host, make_pools, random_slots
from profiling.common import environment, gbs, header_lines, median_ms

# (host layout, direction, layer (None: all layers), page size) and sgl-kernel's recorded % of
# the copy engine at 1 / 2 / 4 CTAs (limits.md; None where it records no figure).
CASES = (
    ("layer_first", "d2h", None, 16, (52, 94, 94)),
    ("page_first", "d2h", None, 16, (73, 95, 95)),
    ("layer_first", "h2d", 0, 16, (39, 73, 93)),
    ("page_first", "h2d", 0, 16, (31, 59, 92)),
    ("page_first", "d2h", 0, 1, (None, None, None)),
)
PROGRAMS = (1, 2, 4)
# Knobs named explicitly are measured as named: page-size-1 copies would take the token variant.
NO_TOKEN_VARIANT = {"token_d2h_programs": 0, "token_h2d_programs": 0}


def copy_call(dev, host, didx, hidx, direction: str, layer, knobs: TransferKnobs):
    """The timed call: one copy of the case with these knobs."""
    if direction == "d2h":
        return lambda: copy_device_to_host(
            dev, host, didx, hidx, layer=layer, knobs=knobs, check=False
        )
    return lambda: copy_host_to_device(host, dev, hidx, didx, layer=layer, knobs=knobs, check=False)


def measure(rounds: int) -> list[dict]:
    dev, _stacks, cfg = make_pools("llama3-8b")
    ceiling = Ceiling()
    gen = torch.Generator().manual_seed(1)
    rows = []
    for layout, direction, layer, P, sgl in CASES:
        host = make_host(cfg, layout, P)
        didx, hidx = random_slots(P, gen), random_slots(P, gen)
        n_sel = 1 if layer is not None else dev.num_layers
        nbytes = N_TOKENS * dev.num_buffers * n_sel * dev.item_bytes
        ce = ceiling(nbytes, direction)
        for i, programs in enumerate(PROGRAMS):
            pct = {}
            for name, knobs in (
                ("default", TransferKnobs(programs)),
                ("16 warps", TransferKnobs(programs, num_warps=16, **NO_TOKEN_VARIANT)),
            ):
                fn = copy_call(dev, host, didx, hidx, direction, layer, knobs)
                best = max(gbs(nbytes, median_ms(fn, rep_ms=60)) for _ in range(rounds))
                pct[name] = 100 * best / ce
            rows.append(
                {
                    "layout": layout,
                    "direction": direction,
                    "scope": "all layers" if layer is None else "one layer",
                    "P": P,
                    "programs": programs,
                    "warps": TransferKnobs(programs).warps,
                    "pct_default": pct["default"],
                    "pct_16_warps": pct["16 warps"],
                    "sgl_kernel_pct": sgl[i],
                }
            )
            r = rows[-1]
            print(
                f"{layout:11s} {direction} {r['scope']:10s} P={P:<2d} programs={programs}: "
                f"{r['pct_default']:5.1f}% ({r['warps']} warps), 16 warps {r['pct_16_warps']:5.1f}%, "
                f"sgl-kernel (recorded) {sgl[i]}",
                flush=True,
            )
    return rows


# Token-granular cases (page size 1, each 2 KiB item its own random slot) for the sweep.
TOKEN_CASES = tuple(
    (layout, direction, layer, 1, (None, None, None))
    for layout in ("layer_first", "page_first")
    for direction in ("d2h", "h2d")
    for layer in (0, None)
)


# page_first all-layer device->host, for the layer-rows sweep (rows forced on at every grid).
ROWS_CASES = tuple(
    ("page_first", direction, None, P, (None, None, None))
    for direction in ("d2h", "h2d")
    for P in (16, 1)
)


def sweep(
    rounds: int,
    cases: tuple,
    programs_list: tuple,
    tiles: tuple,
    warps_list: tuple = (8, 16, 32),
    rows_list: tuple = (False,),
) -> list[dict]:
    """Cases over programs x tile bytes x warps (x layer rows off / forced on): where the
    defaults stand against the best knobs of the grid (% of the copy engine, best of
    ``rounds`` medians). The token variant is off: knobs are measured as named."""
    dev, _stacks, cfg = make_pools("llama3-8b")
    ceiling = Ceiling()
    gen = torch.Generator().manual_seed(1)
    out = []
    for layout, direction, layer, P, _sgl in cases:
        host = make_host(cfg, layout, P)
        didx, hidx = random_slots(P, gen), random_slots(P, gen)
        n_sel = 1 if layer is not None else dev.num_layers
        nbytes = N_TOKENS * dev.num_buffers * n_sel * dev.item_bytes
        ce = ceiling(nbytes, direction)
        for programs in programs_list:
            for tile in tiles:
                for warps in warps_list:
                    for rows in rows_list:
                        k = TransferKnobs(
                            programs,
                            tile_bytes=tile,
                            num_warps=warps,
                            layer_rows_programs=1 if rows else 0,
                            **NO_TOKEN_VARIANT,
                        )
                        fn = copy_call(dev, host, didx, hidx, direction, layer, k)
                        best = max(gbs(nbytes, median_ms(fn, rep_ms=60)) for _ in range(rounds))
                        out.append(
                            {
                                "layout": layout,
                                "direction": direction,
                                "layer": layer,
                                "P": P,
                                "programs": programs,
                                "tile_bytes": tile,
                                "warps": warps,
                                "layer_rows": rows,
                                "pct": 100 * best / ce,
                                "gbs": best,
                                "ceiling_gbs": ce,
                            }
                        )
                        print(
                            f"sweep {layout:11s} {direction} layer={layer} P={P:<2d} "
                            f"programs={programs} tile={tile >> 10}K warps={warps} "
                            f"rows={rows}: {out[-1]['pct']:5.1f}%",
                            flush=True,
                        )
    return out


def write_sweep(rows: list[dict], info: dict, out: str, kind: str) -> None:
    """The sweep's JSON, a Markdown table (per case and grid: the default knobs, the token
    variant's 128 KiB / 32 warps, the best cell) and a PNG of the same."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(out, exist_ok=True)
    name = f"bench_small_grid_sweep_{kind}"
    with open(os.path.join(out, name + ".json"), "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        scope = "all layers" if r["layer"] is None else "one layer"
        key = (r["layout"], r["direction"], scope, r["P"], r["programs"], r.get("layer_rows"))
        groups.setdefault(key, []).append(r)
    lines = [f"# Copy kernel knobs swept ({kind}): % of the copy engine", ""]
    lines += header_lines(info) + [""]
    lines += [
        "| layout | copy | P | programs | layer rows | default (64 KiB, warps) | "
        "128 KiB, 32 warps | best |",
        "|---|---|---|---|---|---|---|---|",
    ]
    labels, dflt, wide = [], [], []
    for (layout, direction, scope, P, programs, rows), rs in groups.items():
        warps = TransferKnobs(programs).warps

        def pct(tile, w, rs=rs):
            return next(r["pct"] for r in rs if r["tile_bytes"] == tile and r["warps"] == w)

        best = max(rs, key=lambda r: r["pct"])
        d, t = pct(65536, warps), pct(131072, 32)
        lines.append(
            f"| {layout} | {direction} {scope} | {P} | {programs} | "
            f"{'off' if not rows else 'on'} | {d:.1f}% ({warps}) | "
            f"{t:.1f}% | {best['pct']:.1f}% ({best['tile_bytes'] >> 10} KiB, "
            f"{best['warps']} warps) |"
        )
        labels.append(
            f"{layout[:5]} {direction} {scope[:3]} P{P} x{programs}{' rows' if rows else ''}"
        )
        dflt.append(d)
        wide.append(t)
    with open(os.path.join(out, name + ".md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    fig, ax = plt.subplots(figsize=(12, 5))
    x = range(len(labels))
    ax.bar([i - 0.2 for i in x], dflt, 0.4, label="64 KiB tile, default warps")
    ax.bar([i + 0.2 for i in x], wide, 0.4, label="128 KiB tile, 32 warps")
    ax.set_xticks(list(x), labels, rotation=75, fontsize=7)
    ax.set_ylabel("% of the copy engine")
    ax.set_ylim(0, 100)
    ax.legend(loc="lower right")
    ax.set_title(f"{info['gpu']}: copy kernel knobs ({kind})")
    fig.tight_layout()
    fig.savefig(os.path.join(out, name + ".png"), dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default=None)
    ap.add_argument("--rounds", type=int, default=2, help="best of this many medians per cell")
    ap.add_argument(
        "--sweep",
        choices=("pages", "tokens", "rows"),
        help="instead: tile bytes x warps over the page cases at 2 and 4 programs, over "
        "page-size-1 cases at 2, 4 and 8 programs, or over page_first all-layer D->H with "
        "layer rows forced on at 1, 2 and 4 programs (the others: layer rows off)",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_small_grid measures on a GPU")
    set_debug_checks(False)
    if args.sweep:
        if args.sweep == "pages":
            rows = sweep(args.rounds, CASES, (2, 4), (16384, 32768, 65536, 131072))
        elif args.sweep == "tokens":
            rows = sweep(args.rounds, TOKEN_CASES, (2, 4, 8), (65536, 131072, 262144))
        else:
            rows = sweep(
                args.rounds, ROWS_CASES, (1, 2, 4), (65536, 131072), (16, 32), (False, True)
            )
        if args.out:
            write_sweep(rows, environment(), args.out, args.sweep)
        return
    rows = measure(args.rounds)
    info = environment()
    if not args.out:
        return
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_small_grid.json"), "w") as f:
        json.dump({"info": info, "rows": rows}, f, indent=1)
    lines = ["# The copy kernel on 1, 2 and 4 programs, % of the copy engine", ""]
    lines += header_lines(info) + [""]
    lines += [
        "| layout | copy | P | programs | kvtier, default knobs (warps) | kvtier, 16 warps | "
        "sgl-kernel, recorded (limits.md, H200) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        sgl = "—" if r["sgl_kernel_pct"] is None else f"{r['sgl_kernel_pct']}%"
        lines.append(
            f"| {r['layout']} | {r['direction']} {r['scope']} | {r['P']} | {r['programs']} | "
            f"{r['pct_default']:.1f}% ({r['warps']}) | {r['pct_16_warps']:.1f}% | {sgl} |"
        )
    with open(os.path.join(args.out, "bench_small_grid.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
