"""Probe: host<->device page copies through Hopper's bulk tensor copy (TMA) at a few programs.

Issue 12 asks the kernel path for >= 93% of the copy engine host->device at 4 programs; kvtier's
register kernel (and sgl-kernel's, per ``shared/reference/limits.md``) tops out at 92-93% there
at any grid size. A TMA load keeps a whole tile in flight per request from one thread, so
this probe asks whether it lifts that ceiling on this link: a gather of random 16-token pages
(2 KiB token rows, K and V, one layer; the ``bench_small_grid`` one-layer case) from a pinned host
buffer into device slots, by tensor descriptors, against a contiguous ``copy_`` of the same bytes
and kvtier's kernel, in one run. ``d2h`` asks the same of all-layer device->host copies into
``layer_first`` and ``page_first`` hosts. Every TMA call is checked whole against torch before
it is timed. Results: ``profiling/results/tma_probe.md``.

Usage::

    OUT=/tmp/out python3 -m profiling.tma_probe       # on a Hopper GPU: one layer, both ways
    OUT=/tmp/out python3 -m profiling.tma_probe d2h   # all layers, device -> host
    python3 -m profiling.tma_probe plot [results dir] # tma_probe.png from the two JSON files
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import sys

import torch
import triton
import triton.language as tl

POOL_TOKENS = 16384
N_TOKENS = 8192
ROW_WORDS = 512  # a 2 KiB token row as int32 words (8 heads x 128 x bf16)
P = 16


@triton.jit
def _tma_gather(
    src,
    dst,
    src_pages,
    dst_pages,
    n_pages,
    SRC_ROWS,
    DST_ROWS,
    ROWS_PER_BUF_SRC,
    ROWS_PER_BUF_DST,
    P: tl.constexpr,
    W: tl.constexpr,
    BW: tl.constexpr,
    NB: tl.constexpr,
    STAGES: tl.constexpr,
):
    """Copy page ``src_pages[i]`` of each of ``NB`` buffers to page ``dst_pages[i]``, tiles of
    ``P`` rows x ``BW`` words, by TMA loads and stores."""
    sd = tl.make_tensor_descriptor(src, shape=[SRC_ROWS, W], strides=[W, 1], block_shape=[P, BW])
    dd = tl.make_tensor_descriptor(dst, shape=[DST_ROWS, W], strides=[W, 1], block_shape=[P, BW])
    n_col = W // BW
    n_items = n_pages * NB * n_col
    for it in tl.range(tl.program_id(0), n_items, tl.num_programs(0), num_stages=STAGES):
        col = (it % n_col) * BW
        b = (it // n_col) % NB
        i = it // (n_col * NB)
        s = tl.load(src_pages + i).to(tl.int32)
        d = tl.load(dst_pages + i).to(tl.int32)
        x = sd.load([b * ROWS_PER_BUF_SRC + s * P, col])
        dd.store([b * ROWS_PER_BUF_DST + d * P, col], x)


@triton.jit
def _tma_d2h_all(
    dev,
    host,
    dev_pages,
    host_pages,
    n_pages,
    SLOTS,
    HSIZE,
    HOST_ROWS,
    HOST_W: tl.constexpr,
    L: tl.constexpr,
    NB: tl.constexpr,
    P: tl.constexpr,
    W: tl.constexpr,
    BW: tl.constexpr,
    PAGE_FIRST: tl.constexpr,
    STAGES: tl.constexpr,
    DEV_TMA: tl.constexpr = False,
):
    """All layers of pages device -> host: device rows by ordinary loads, or by TMA with
    ``DEV_TMA`` (``dev`` is ``[NB, L, SLOTS, W]`` words), host tiles by TMA stores (``host`` layer_first ``[NB, L, HSIZE,
    W]`` or page_first ``[NB, HSIZE, L, W]``). Items are (page, buffer, layer, column chunk),
    layers inner."""
    hd = tl.make_tensor_descriptor(
        host, shape=[HOST_ROWS, HOST_W], strides=[HOST_W, 1], block_shape=[P, BW]
    )
    dd = tl.make_tensor_descriptor(
        dev, shape=[NB * L * SLOTS, W], strides=[W, 1], block_shape=[P, BW]
    )
    n_col: tl.constexpr = W // BW
    n_items = n_pages * NB * L * n_col
    r = tl.arange(0, P)
    c = tl.arange(0, BW)
    for it in tl.range(tl.program_id(0), n_items, tl.num_programs(0), num_stages=STAGES):
        col = (it % n_col) * BW
        rest = it // n_col
        layer = rest % L
        rest = rest // L
        b = rest % NB
        i = rest // NB
        d = tl.load(dev_pages + i)
        h = tl.load(host_pages + i).to(tl.int32)
        if DEV_TMA:
            x = dd.load([((b * L + layer) * SLOTS + d * P).to(tl.int32), col])
        else:
            rows = ((b * L + layer) * SLOTS + d * P + r).to(tl.int64)
            x = tl.load(dev + rows[:, None] * W + (col + c)[None, :])
        if PAGE_FIRST:
            hd.store([b * HSIZE + h * P, layer * W + col], x)
        else:
            hd.store([(b * L + layer) * HSIZE + h * P, col], x)


def tma_d2h_all(dev, host, dpages, hpages, page_first, programs, bw, stages, warps, dev_tma=False):
    """``dev``: [NB, L, SLOTS, W] words; ``host``: [NB, L, HSIZE, W] or [NB, HSIZE, L, W]."""
    NB, L, SLOTS, W = dev.shape
    HSIZE = host.shape[2] if not page_first else host.shape[1]
    host_rows, host_w = (NB * HSIZE, L * W) if page_first else (NB * L * HSIZE, W)
    _tma_d2h_all[(programs,)](
        dev,
        host,
        dpages,
        hpages,
        dpages.numel(),
        SLOTS,
        HSIZE,
        host_rows,
        HOST_W=host_w,
        L=L,
        NB=NB,
        P=P,
        W=W,
        BW=bw,
        PAGE_FIRST=page_first,
        STAGES=stages,
        DEV_TMA=dev_tma,
        num_warps=warps,
    )


# (box words, stages, warps, device side by TMA too)
VARIANTS = (
    (256, 3, 4, False),
    (256, 3, 4, True),
    (256, 4, 4, True),
    (128, 4, 4, True),
    (256, 3, 8, True),
)


def all_layers(rounds: int = 3) -> list[dict]:
    """kvtier's kernel against the TMA variants, all layers device -> host, on kvtier's pools."""
    from kvtier.kernels.kv_transfer import TransferKnobs
    from profiling.bench_small_grid import copy_call
    from profiling.bench_transfer import N_TOKENS as NT
    from profiling.bench_transfer import Ceiling, make_host, make_pools, random_slots
    from profiling.common import gbs, median_ms

    kdev, stacks, cfg = make_pools("llama3-8b")
    devw = torch.stack(stacks).view(torch.int32)  # [B, L, slots, 8, 128] bf16 -> words
    devw = devw.reshape(devw.shape[0], devw.shape[1], devw.shape[2], -1)
    gen = torch.Generator().manual_seed(3)
    ceiling = Ceiling()
    rows = []
    for layout in ("layer_first", "page_first"):
        khost = make_host(cfg, layout, P)
        hw = khost.tensor.view(torch.int32)
        hw = hw.reshape(*hw.shape[:3], -1)
        didx, hidx = random_slots(P, gen), random_slots(P, gen)
        dpages, hpages = didx.view(-1, P)[:, 0] // P, hidx.view(-1, P)[:, 0] // P
        nbytes = NT * kdev.num_buffers * kdev.num_layers * kdev.item_bytes
        ce = ceiling(nbytes, "d2h")
        # The torch reference over a poisoned host: every copy below, at every grid size, is
        # checked whole against it (the pages it writes and the rows it must leave alone).
        want = torch.full_like(khost.tensor, 7)
        hcpu, dcpu = hidx.cpu(), didx.cpu()
        for b in range(kdev.num_buffers):
            rows_b = stacks[b][:, didx].cpu()  # [L, tokens, *item]
            if layout == "page_first":
                want[b][hcpu] = rows_b.transpose(0, 1)
            else:
                want[b][:, hcpu] = rows_b
        del hcpu, dcpu
        for programs in (1, 2, 4):
            calls = {
                "kvtier": copy_call(kdev, khost, didx, hidx, "d2h", None, TransferKnobs(programs))
            }
            for bw, stages, warps, dt in VARIANTS:
                calls[f"tma{'2' if dt else ''} bw{bw * 4} s{stages} w{warps}"] = functools.partial(
                    tma_d2h_all,
                    devw,
                    hw,
                    dpages,
                    hpages,
                    layout == "page_first",
                    programs,
                    bw,
                    stages,
                    warps,
                    dt,
                )
            exact = {}
            for name, fn in calls.items():
                khost.tensor.fill_(7)
                fn()
                torch.cuda.synchronize()
                exact[name] = bool(torch.equal(khost.tensor, want))
            res = {}
            for _ in range(rounds):
                for name, fn in calls.items():
                    res.setdefault(name, []).append(gbs(nbytes, median_ms(fn, rep_ms=60)))
            row = {"layout": layout, "programs": programs, "exact": exact, "ce_gbs": round(ce, 2)}
            row.update({k: round(100 * max(v) / ce, 1) for k, v in res.items()})
            row.update({k + " all": [round(100 * x / ce, 1) for x in v] for k, v in res.items()})
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def _alloc(size: int, align: int, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def tma_copy(src, dst, sp, dp, programs, bw, stages, warps):
    n = sp.numel()
    _tma_gather[(programs,)](
        src,
        dst,
        sp,
        dp,
        n,
        src.shape[0] * src.shape[1],
        dst.shape[0] * dst.shape[1],
        src.shape[1],
        dst.shape[1],
        P=P,
        W=ROW_WORDS,
        BW=bw,
        NB=src.shape[0],
        STAGES=stages,
        num_warps=warps,
    )


def main() -> None:
    from kvtier.kernels.kv_transfer import TransferKnobs
    from profiling.bench_small_grid import copy_call
    from profiling.bench_transfer import make_host, make_pools, random_slots
    from profiling.common import environment, gbs, median_ms

    triton.set_allocator(_alloc)
    gen = torch.Generator().manual_seed(0)
    host = torch.randint(-(2**31), 2**31 - 1, (2, POOL_TOKENS, ROW_WORDS), dtype=torch.int32)
    host = host.pin_memory()
    dev = torch.randint(-(2**31), 2**31 - 1, (2, POOL_TOKENS, ROW_WORDS), dtype=torch.int32)
    dev = dev.cuda()
    n_pages = N_TOKENS // P
    hp = torch.randperm(POOL_TOKENS // P, generator=gen)[:n_pages].cuda()
    dp = torch.randperm(POOL_TOKENS // P, generator=gen)[:n_pages].cuda()
    nbytes = N_TOKENS * 2 * ROW_WORDS * 4
    ce_d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    ce_h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def ce_h2d():
        ce_d.copy_(ce_h, non_blocking=True)

    def ce_d2h():
        ce_h.copy_(ce_d, non_blocking=True)

    # kvtier's kernel on its own pools, the same case (bench_small_grid's one-layer H2D).
    kpool, _stacks, cfg = make_pools("llama3-8b")
    khost = make_host(cfg, "layer_first", P)
    kd, kh = random_slots(P, gen), random_slots(P, gen)

    rows = []
    configs = list(itertools.product((4, 2, 8), (128, 256), (2, 3, 4), (4, 8)))
    for programs, bw, stages, warps in configs:
        row = {"programs": programs, "bw_bytes": bw * 4, "stages": stages, "warps": warps}
        try:
            dev2 = dev.clone()
            tma_copy(host, dev2, hp, dp, programs, bw, stages, warps)
            torch.cuda.synchronize()
            want = dev.clone()
            for b in range(2):
                want[b].view(-1, P, ROW_WORDS)[dp] = host[b].view(-1, P, ROW_WORDS)[hp.cpu()].cuda()
            row["exact"] = bool(torch.equal(dev2, want))
            # device -> host: the same gather the other way
            host2 = torch.zeros_like(host).pin_memory()
            tma_copy(dev, host2, dp, hp, programs, bw, stages, warps)
            torch.cuda.synchronize()
            wantd = torch.zeros_like(host)
            for b in range(2):
                wantd[b].view(-1, P, ROW_WORDS)[hp.cpu()] = dev[b].view(-1, P, ROW_WORDS)[dp].cpu()
            row["exact_d2h"] = bool(torch.equal(host2, wantd))
            del host2
        except Exception as exc:  # noqa: BLE001 - a probe: report and go on
            row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        calls = {  # timed in this order in each round
            "ce_h2d": ce_h2d,
            "tma_h2d": functools.partial(tma_copy, host, dev, hp, dp, programs, bw, stages, warps),
            "kv_h2d": copy_call(kpool, khost, kd, kh, "h2d", 0, TransferKnobs(programs)),
            "ce_d2h": ce_d2h,
            "tma_d2h": functools.partial(tma_copy, dev, host, dp, hp, programs, bw, stages, warps),
        }
        res = {}
        for _ in range(3):
            for name, fn in calls.items():
                res.setdefault(name, []).append(gbs(nbytes, median_ms(fn, rep_ms=50)))
        best = {k: max(v) for k, v in res.items()}
        row.update({k: round(v, 2) for k, v in best.items()})
        row["tma_h2d_pct"] = round(100 * best["tma_h2d"] / best["ce_h2d"], 1)
        row["kv_h2d_pct"] = round(100 * best["kv_h2d"] / best["ce_h2d"], 1)
        row["tma_d2h_pct"] = round(100 * best["tma_d2h"] / best["ce_d2h"], 1)
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "tma_probe.json"), "w") as f:
            json.dump({"env": environment(), "rows": rows}, f, indent=1)


def plot(results: str) -> None:
    """``tma_probe.png`` from the two JSON files recorded in ``results``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(os.path.join(results, "tma_probe_h2d.json")) as f:
        h2d = json.load(f)["rows"]
    with open(os.path.join(results, "tma_probe_d2h.json")) as f:
        d2h = json.load(f)["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for programs, color in ((2, "tab:blue"), (4, "tab:orange"), (8, "tab:green")):
        rs = [r for r in h2d if r["programs"] == programs and "tma_h2d_pct" in r]
        a.scatter(
            [r["tma_h2d_pct"] for r in rs],
            [programs] * len(rs),
            color=color,
            marker="o",
            label=f"TMA, {programs} programs (12 configs)",
        )
        a.scatter(
            [r["kv_h2d_pct"] for r in rs],
            [programs + 0.3] * len(rs),
            color=color,
            marker="x",
            label=f"kvtier kernel, {programs} programs",
        )
    a.axvline(93, color="gray", ls="--", label="issue 12 target (93%)")
    a.set_xlabel("% of the copy engine (same run)")
    a.set_ylabel("programs")
    a.set_xlim(0, 100)
    a.set_title("H->D, one layer, 16-token pages, 32 MiB")
    a.legend(fontsize=7, loc="lower left")
    labels, xs = [], []
    for r in d2h:
        labels.append(f"{r['layout']}\n{r['programs']} prog.")
        xs.append(r)
    keys = [k for k in d2h[0] if k.startswith("tma") and not k.endswith(" all")]
    width = 0.8 / (1 + len(keys))
    for j, key in enumerate(["kvtier", *keys]):
        b.bar(
            [i + j * width for i in range(len(xs))],
            [r[key] for r in xs],
            width,
            label=key if key != "kvtier" else "kvtier kernel",
        )
    b.axhline(95, color="gray", ls="--", label="issue 12 target (95%)")
    b.set_xticks([i + 0.4 for i in range(len(xs))], labels, fontsize=7)
    b.set_ylim(0, 100)
    b.set_ylabel("% of the copy engine (same run)")
    b.set_title("D->H, all 32 layers, 16-token pages, 1 GiB (tma: host side by TMA; tma2: both)")
    b.legend(fontsize=6, loc="lower right")
    fig.suptitle("TMA bulk copies vs kvtier's register kernel, NVIDIA H200, 2026-11-29")
    fig.tight_layout()
    fig.savefig(os.path.join(results, "tma_probe.png"), dpi=110)


if __name__ == "__main__":
    if sys.argv[1:2] == ["plot"]:
        plot(sys.argv[2] if len(sys.argv) > 2 else "profiling/results")
    elif sys.argv[1:] == ["d2h"]:
        from profiling.common import environment

        triton.set_allocator(_alloc)
        rows = all_layers()
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "tma_d2h.json"), "w") as f:
                json.dump({"env": environment(), "rows": rows}, f, indent=1)
    else:
        sys.exit(main())
