"""Hybrid pages: Mamba slot D↔H, and packing pages into flat L3 objects, beside their ceilings.

Measures, in one run on one GPU:

- Mamba slot transfers, D2H and H2D, all layers, for a Qwen3-Next-like state (24 Mamba layers,
  temporal [32, 128, 128] fp32 + conv [8192, 3] bf16 per layer, ~50 MiB a slot), against a
  contiguous pinned ``copy_`` of the same bytes (copy engine);
- device-side pack (device pool → flat page objects in device memory) and unpack, for a
  Llama-3-8B-like KV pool (32 layers, 8 KV heads, head_dim 128, bf16, page 16) and the DSA indexer
  pool (61 layers, 64-token pages of 132-byte entries), against a device ``copy_`` of the same bytes;
- the same packing done by a per-page ``torch.cat`` baseline, batches of 64 pages and more;
- fused D→flat into pinned host staging, against the copy engine.

Usage::

    python3 -m profiling.bench_hybrid --out profiling/results
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

from kvtier.kernels import DEFAULT_KNOBS, TransferKnobs, set_debug_checks
from kvtier.kernels.pack import device_knobs
from kvtier.runtime.pools.device import MHADevicePool
from kvtier.runtime.pools.host import HostPool
from kvtier.runtime.pools.indexer import IndexerDevicePool
from kvtier.runtime.pools.mamba import MambaDevicePool, MambaHostPool, MambaStateSpec
from profiling.common import environment, gbs, header_lines, median_ms


def ce_ceiling(nbytes: int, direction: str) -> float:
    d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    if direction == "d2h":
        return gbs(nbytes, median_ms(lambda: h.copy_(d, non_blocking=True)))
    return gbs(nbytes, median_ms(lambda: d.copy_(h, non_blocking=True)))


def d2d_ceiling(nbytes: int) -> float:
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return gbs(nbytes, median_ms(lambda: b.copy_(a)))


def mamba_rows(out: list, knobs: TransferKnobs) -> None:
    spec = MambaStateSpec(temporal_shape=(32, 128, 128), conv_shapes=((8192, 3),))
    pool = MambaDevicePool(24, 20, spec, device="cuda")
    for t in pool.tensors:
        t.view(torch.uint8).random_(0, 256)
    host = MambaHostPool(pool, size=20, knobs=knobs)
    for n in (1, 4, 16):
        dev = torch.randperm(20)[:n].cuda()
        hs = torch.randperm(20)[:n].cuda()
        nbytes = n * pool.slot_bytes
        for direction in ("d2h", "h2d"):
            if direction == "d2h":
                ms = median_ms(lambda: host.backup(dev, hs, check=False))
            else:
                ms = median_ms(lambda: host.load(hs, dev, check=False))
            g, c = gbs(nbytes, ms), ce_ceiling(nbytes, direction)
            out.append(
                {
                    "what": "mamba slots",
                    "direction": direction,
                    "n": n,
                    "mib": nbytes / 2**20,
                    "gbs": g,
                    "ceiling": c,
                    "pct": 100 * g / c,
                    "programs": knobs.num_programs,
                }
            )
            print(
                f"mamba {direction} {n:3d} slots {nbytes / 2**20:8.1f} MiB {g:6.1f} GB/s "
                f"= {100 * g / c:5.1f}% of CE {c:.1f}",
                flush=True,
            )


def kv_pack_rows(out: list, sweep: list) -> None:
    P = 16
    pool = MHADevicePool(32, 16384, 8, 128, dtype=torch.bfloat16, device="cuda", page_size=P)
    pool.k_buffer.view(torch.uint8).random_(0, 256)
    pool.v_buffer.view(torch.uint8).random_(0, 256)
    idx = IndexerDevicePool(61, 512, 64, device="cuda")
    idx.buffer.random_(0, 256)
    cases = [
        ("kv page_first_direct", HostPool(pool, "page_first_direct", size=P * 64), pool),
        ("kv page_first", HostPool(pool, "page_first", size=P * 64), pool),
        ("indexer page_first", HostPool(idx, "page_first", size=64), idx),
    ]
    for name, host, dpool in cases:
        n_pages_pool = dpool.size // dpool.page_size
        for n in (64, 256):
            pages = torch.randperm(n_pages_pool)[:n].cuda()
            flat = torch.empty((n, host.page_bytes), dtype=torch.uint8, device="cuda")
            nbytes = n * host.page_bytes
            ceil = d2d_ceiling(nbytes)
            pack = median_ms(lambda: host.device_to_flat(pages, flat, check=False))
            unpack = median_ms(lambda: host.flat_to_device(flat, pages, check=False))
            cat = None
            if dpool is pool:
                slots = [torch.arange(p * P, p * P + P, device="cuda") for p in pages.tolist()]
                token_major = host.flat_token_major

                def cat_pack():
                    objs = []
                    for s in slots:
                        parts = []
                        for buf in pool.buffers.layers:
                            rows = [t[s] for t in buf]
                            if token_major:
                                parts.append(torch.stack(rows, 1).reshape(-1).view(torch.uint8))
                            else:
                                parts += [r.reshape(-1).view(torch.uint8) for r in rows]
                        objs.append(torch.cat(parts))
                    return objs

                cat = median_ms(cat_pack, rep_ms=50)
            else:

                def cat_pack():
                    return [
                        torch.cat([idx.buffer[l, p] for l in range(idx.num_layers)])
                        for p in pages.tolist()
                    ]

                cat = median_ms(cat_pack, rep_ms=50)
            row = {
                "what": f"{name} pack",
                "n": n,
                "mib": nbytes / 2**20,
                "gbs": gbs(nbytes, pack),
                "ceiling": ceil,
                "pct": 100 * gbs(nbytes, pack) / ceil,
                "cat_gbs": gbs(nbytes, cat),
                "speedup": cat / pack,
            }
            out.append(row)
            out.append(
                {
                    "what": f"{name} unpack",
                    "n": n,
                    "mib": nbytes / 2**20,
                    "gbs": gbs(nbytes, unpack),
                    "ceiling": ceil,
                    "pct": 100 * gbs(nbytes, unpack) / ceil,
                }
            )
            print(
                f"{name:22s} n={n:4d} pack {gbs(nbytes, pack):7.0f} GB/s unpack {gbs(nbytes, unpack):7.0f} "
                f"GB/s device copy_ {ceil:7.0f} GB/s ({row['pct']:.0f}%) torch.cat {gbs(nbytes, cat):6.1f} GB/s "
                f"-> {row['speedup']:.1f}x",
                flush=True,
            )
            # fused D→flat straight into pinned host staging
            stage = host.new_staging(n)
            fused = median_ms(lambda: host.device_to_flat(pages, stage, check=False))
            c = ce_ceiling(nbytes, "d2h")
            out.append(
                {
                    "what": f"{name} fused D->flat pinned",
                    "n": n,
                    "mib": nbytes / 2**20,
                    "gbs": gbs(nbytes, fused),
                    "ceiling": c,
                    "pct": 100 * gbs(nbytes, fused) / c,
                }
            )
            print(
                f"{name:22s} n={n:4d} fused D->flat pinned {gbs(nbytes, fused):6.1f} GB/s "
                f"= {100 * gbs(nbytes, fused) / c:.1f}% of CE",
                flush=True,
            )
    # grid/tile sweep for device-side packing (KV, 256 pages)
    host = cases[0][1]
    pages = torch.randperm(1024)[:256].cuda()
    flat = torch.empty((256, host.page_bytes), dtype=torch.uint8, device="cuda")
    nbytes = 256 * host.page_bytes
    ceil = d2d_ceiling(nbytes)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for mult in (1, 2, 4, 8):
        for tile in (8192, 16384, 32768):
            for nw in (4, 8):
                k = TransferKnobs(sms * mult, tile, nw, small_h2d_bytes=0)
                g = gbs(
                    nbytes,
                    median_ms(
                        lambda: host.device_to_flat(pages, flat, knobs=k, check=False), rep_ms=40
                    ),
                )
                sweep.append(
                    {
                        "programs": sms * mult,
                        "tile_bytes": tile,
                        "num_warps": nw,
                        "gbs": g,
                        "pct": 100 * g / ceil,
                    }
                )
                print(
                    f"pack sweep programs={sms * mult} tile={tile} warps={nw}: {g:.0f} GB/s "
                    f"{100 * g / ceil:.0f}%",
                    flush=True,
                )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="profiling/results")
    ap.add_argument("--mamba-programs", type=int, default=None)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_hybrid needs a CUDA GPU")
    set_debug_checks(False)
    info = environment() | {"device_knobs": repr(device_knobs(torch.device("cuda")))}
    print(info, flush=True)
    mk = (
        TransferKnobs(args.mamba_programs, DEFAULT_KNOBS.tile_bytes, DEFAULT_KNOBS.num_warps)
        if args.mamba_programs
        else DEFAULT_KNOBS
    )
    rows, sweep = [], []
    mamba_rows(rows, mk)
    kv_pack_rows(rows, sweep)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bench_hybrid.json"), "w") as f:
        json.dump({"info": info, "rows": rows, "sweep": sweep}, f, indent=1)
    lines = [
        "# Hybrid pages: Mamba slots and flat-page packing",
        "",
        *header_lines(info),
        f"- Mamba knobs: {mk!r}; device-side packing knobs: {info['device_knobs']}",
        (
            "- Ceilings measured in the same run: contiguous pinned `copy_` (copy engine) for D↔H, "
            "device `copy_` of the same bytes for on-device packing. GB/s = bytes of the page "
            "objects / median time."
        ),
        "",
        "| what | dir | n | MiB | GB/s | ceiling GB/s | % ceiling | per-page torch.cat GB/s | speed-up vs cat |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['what']} | {r.get('direction', '')} | {r['n']} | {r['mib']:.1f} | {r['gbs']:.1f} | "
            f"{r['ceiling']:.1f} | {r['pct']:.1f}% | {r.get('cat_gbs', 0) or '':.4} | "
            f"{(str(round(r['speedup'], 1)) + 'x') if 'speedup' in r else ''} |"
        )
    lines += [
        "",
        "## Device-side pack: grid and tile sweep (KV page_first_direct, 256 pages)",
        "",
        "| programs | tile bytes | warps | GB/s | % device copy_ |",
        "|---|---|---|---|---|",
    ]
    for s in sweep:
        lines.append(
            f"| {s['programs']} | {s['tile_bytes']} | {s['num_warps']} | {s['gbs']:.0f} | {s['pct']:.0f}% |"
        )
    with open(os.path.join(args.out, "bench_hybrid.md"), "w") as f:
        f.write("\n".join(lines) + "\n")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(15, 5))
    labels = [f"{r['what']} {r.get('direction', '')} n={r['n']}" for r in rows]
    ax[0].barh(range(len(rows)), [r["pct"] for r in rows])
    ax[0].set_yticks(range(len(rows)))
    ax[0].set_yticklabels(labels, fontsize=6)
    ax[0].axvline(95, ls="--", color="k", lw=0.7)
    ax[0].axvline(80, ls=":", color="k", lw=0.7)
    ax[0].set_xlabel("% of the ceiling measured in the same run")
    cats = [r for r in rows if "speedup" in r]
    ax[1].bar(range(len(cats)), [r["speedup"] for r in cats])
    ax[1].set_xticks(range(len(cats)))
    ax[1].set_xticklabels(
        [f"{r['what'].replace(' pack', '')}\nn={r['n']}" for r in cats], fontsize=6
    )
    ax[1].axhline(10, ls="--", color="k", lw=0.7)
    ax[1].set_yscale("log")
    ax[1].set_ylabel("speed-up of kvtier pack over per-page torch.cat")
    fig.suptitle(f"{info['gpu']} — {info['date']}")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "bench_hybrid.png"), dpi=130)


if __name__ == "__main__":
    main()
