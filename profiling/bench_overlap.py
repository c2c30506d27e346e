"""Copies beside compute: do they hide under a GEMM loop, and do they slow it?

A Llama-3-8B MLP GEMM pair (``[M, 4096] @ [4096, 14336]``, then ``@ [14336, 4096]``, bf16) loops
on one stream while a KV transfer of the same order of duration runs on another:

- load (H→D): 32 layers, one call and one event per layer, as ``start_loading`` issues it;
- backup (D→H): all 32 layers in one call, as a write-through backup issues it.

The transfer moves ``--tokens`` tokens (8 KV heads x 128 x bf16, K and V: 4 KiB a token and
layer) between random pages of a device pool and a pinned host pool, through
:class:`kvtier.kernels.copier.HostCopier` with ``io_backend`` forced to each path. For every row
(path x direction x layout x P) it reports:

- fixed-work ratio: wall time until both are done / max(each alone); 1.00 is perfect overlap;
- GEMM slowdown: the loop's own time (events) beside the transfer over its time alone, with the
  A/A control beside it (the loop alone timed twice: its drift here);
- GB/s of the transfer alone and beside compute (events on its stream);
- CPU µs per call (the issue loop's host time over its calls) and the plan's host ms (descriptors
  or index uploads, once per batch).

The GEMM loop is sized per row to take as long as the transfer alone (the fixed work).

Usage::

    python3 -m profiling.bench_overlap --out profiling/results
    python3 -m profiling.bench_overlap --smoke          # tiny shapes: the flow only (GPU)
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from kvtier.kernels import copy_engine, copy_host_to_device
from kvtier.kernels.copier import HostCopier
from kvtier.kernels.copy_engine import (
    ChunkGeometry,
    batch_call_kind,
    build_descriptors,
    engine_support,
)
from kvtier.kernels.layout import DeviceBuffers, HostBuffer, host_shape
from kvtier.runtime.pools.pinned import host_empty
from profiling.common import environment, gbs, header_lines, median

L, H, D, HIDDEN, FFN = 32, 8, 128, 4096, 14336
LAYOUTS = ("layer_first", "page_first_direct", "page_first")
PATHS = ("kernel", "copy_engine", "staged")
PAGE_SIZES = (1, 16, 64)


@dataclass
class Row:
    path: str
    route: str
    direction: str
    layout: str
    page_size: int
    nbytes: int
    calls: int
    descriptors: int
    xfer_ms: float
    gemm_iters: int
    gemm_ms: float
    both_ms: float
    ratio: float
    gemm_slowdown: float
    aa_drift: float
    gbs_alone: float
    gbs_beside: float
    cpu_us_per_call: float
    plan_ms: float


class Gemm:
    """The MLP GEMM pair on its own stream."""

    def __init__(self, m: int, device: torch.device) -> None:
        g = torch.Generator(device=device).manual_seed(0)
        self.x = torch.randn(m, HIDDEN, device=device, generator=g).to(torch.bfloat16)
        self.w1 = (torch.randn(HIDDEN, FFN, device=device, generator=g) * 0.02).to(torch.bfloat16)
        self.w2 = (torch.randn(FFN, HIDDEN, device=device, generator=g) * 0.02).to(torch.bfloat16)
        self.stream = torch.cuda.Stream(device)

    def enqueue(self, iters: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            a.record()
            for _ in range(iters):
                torch.mm(torch.mm(self.x, self.w1), self.w2)
            b.record()
        return a, b


class Transfer:
    """One row's transfer, planned once (as ``start_loading`` plans a batch) and issued per run
    on its own stream."""

    def __init__(self, copier: HostCopier, d_slots, h_slots, d2h: bool, stream) -> None:
        self.d2h, self.stream = d2h, stream
        with torch.cuda.stream(stream):
            t0 = time.perf_counter()
            self.plan = copier.plan(d_slots, h_slots, d2h=d2h, per_layer=not d2h)
            torch.cuda.synchronize()
            self.plan_ms = (time.perf_counter() - t0) * 1e3
        self.issue_s: list[float] = []

    def enqueue(self) -> tuple[torch.cuda.Event, torch.cuda.Event]:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(self.stream):
            t0 = time.perf_counter()
            a.record()
            if self.d2h:
                self.plan.issue()
            else:
                for layer in range(L):
                    self.plan.issue(layer)
                    torch.cuda.Event().record()  # one event per layer, as the controller does
            b.record()
            self.issue_s.append(time.perf_counter() - t0)
        return a, b

    @property
    def calls(self) -> int:
        return 1 if self.d2h else L


def _wall(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def _pool(layout: str, P: int, slots: int, device):
    dev_t = [
        torch.randint(-(2**15), 2**15, (L, slots, H, D), dtype=torch.int16, device=device).view(
            torch.bfloat16
        )
        for _ in range(2)
    ]
    dev = DeviceBuffers.from_layers([list(t.unbind(0)) for t in dev_t])
    host_t = host_empty(host_shape(layout, 2, L, slots, P, (H, D)), torch.bfloat16, pin=True)
    host = HostBuffer.create(host_t, layout, 2, L, P, (H, D))
    return dev, host


def run_row(path, d2h, layout, P, dev, host, tokens, gemm: Gemm, reps: int, gen) -> Row | None:
    slots = dev.num_slots
    n_pages = tokens // P
    d_pages = torch.randperm(slots // P, generator=gen)[:n_pages]
    h_pages = torch.randperm(host.num_slots // P, generator=gen)[:n_pages]
    offs = torch.arange(P)
    d_slots = (d_pages[:, None] * P + offs).reshape(-1)
    h_slots = (h_pages[:, None] * P + offs).reshape(-1)
    copier = HostCopier(dev, host, io_backend=path)
    xs = torch.cuda.Stream(dev.device)
    x = Transfer(copier, d_slots, h_slots, d2h, xs)
    plan = x.plan
    if path != "kernel" and plan.route.path != path:
        print(f"{path} {layout} P={P}: falls back ({plan.route.reason.value})", flush=True)
        return None  # page_first at P > 1 on the copy engine: the kernel row covers it
    x.enqueue()  # warm-up (compiles the kernel variant)
    torch.cuda.synchronize()
    x.issue_s.clear()
    nbytes = tokens * 2 * L * dev.item_bytes

    # Size the GEMM loop to the transfer's time alone.
    t_x0 = median([_wall(x.enqueue) for _ in range(2)])
    gemm.enqueue(2)
    one = median([_wall(lambda: gemm.enqueue(4)) / 4 for _ in range(3)])
    iters = max(1, round(t_x0 / one))

    def gemm_alone() -> tuple[float, float]:
        ev = []
        wall = _wall(lambda: ev.extend(gemm.enqueue(iters)))
        return wall, ev[0].elapsed_time(ev[1])

    # Each rep runs GEMM alone, transfer alone, both, GEMM alone: the GEMM's drift over a rep
    # (clocks, power) is the A/A control, and its mean is the reference of that rep.
    m: dict[str, list[float]] = {k: [] for k in ("x", "xd", "g", "both", "ratio", "slow", "aa")}
    m["xb"] = []
    for _ in range(reps):
        ga_w, ga_e = gemm_alone()
        ev: list = []
        x_w = _wall(lambda ev=ev: ev.extend(x.enqueue()))
        x_d = ev[0].elapsed_time(ev[1])
        ev = []

        def run(ev=ev):
            ev.extend(gemm.enqueue(iters))
            ev.extend(x.enqueue())

        b_w = _wall(run)
        g_beside, x_beside = ev[0].elapsed_time(ev[1]), ev[2].elapsed_time(ev[3])
        gb_w, gb_e = gemm_alone()
        g_w, g_e = (ga_w + gb_w) / 2, (ga_e + gb_e) / 2
        for k, v in (
            ("x", x_w),
            ("xd", x_d),
            ("g", g_w),
            ("both", b_w),
            ("ratio", b_w / max(x_w, g_w)),
            ("slow", g_beside / g_e - 1),
            ("aa", gb_e / ga_e - 1),
            ("xb", x_beside),
        ):
            m[k].append(v)
    return Row(
        path=path,
        route=plan.route.reason.value,
        direction="d2h" if d2h else "h2d",
        layout=layout,
        page_size=P,
        nbytes=nbytes,
        calls=x.calls,
        descriptors=plan.descriptors,
        xfer_ms=median(m["x"]),
        gemm_iters=iters,
        gemm_ms=median(m["g"]),
        both_ms=median(m["both"]),
        ratio=median(m["ratio"]),
        gemm_slowdown=median(m["slow"]),
        aa_drift=median(m["aa"]),
        gbs_alone=gbs(nbytes, median(m["xd"])),
        gbs_beside=gbs(nbytes, median(m["xb"])),
        cpu_us_per_call=median(x.issue_s) * 1e6 / x.calls,
        plan_ms=x.plan_ms,
    )


def cpu_costs(device, tokens: int, calls: int = 200) -> dict[str, float]:
    """CPU µs per call, alone: the kernel path's per-layer launch, and one copy-engine batch of
    1024 / 32768 descriptors through each way of calling it (ctypes, cuda-bindings)."""
    out: dict[str, float] = {}
    dev, host = _pool("page_first_direct", 16, 2 * tokens, device)
    offs = torch.arange(16)
    gen = torch.Generator().manual_seed(1)
    d = torch.randperm(2 * tokens // 16, generator=gen)[: tokens // 16][:, None] * 16 + offs
    h = torch.randperm(2 * tokens // 16, generator=gen)[: tokens // 16][:, None] * 16 + offs
    d, h = d.reshape(-1).to(device), h.reshape(-1).to(device)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        for layer in range(L):  # compile and warm
            copy_host_to_device(host, dev, h, d, layer=layer, check=False)
        torch.cuda.synchronize()
        per = []
        for i in range(calls):
            t0 = time.perf_counter()
            copy_host_to_device(host, dev, h, d, layer=i % L, check=False)
            per.append(time.perf_counter() - t0)
            if i % L == L - 1:
                stream.synchronize()  # keep the launch queue short: time the host side only
        out["kernel launch, per layer"] = median(per) * 1e6
        prof = cProfile.Profile()
        prof.enable()
        for i in range(calls):
            copy_host_to_device(host, dev, h, d, layer=i % L, check=False)
        prof.disable()
        torch.cuda.synchronize()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(14)
        print(buf.getvalue(), flush=True)
    geom = ChunkGeometry.of(dev, host)
    call = copy_engine._CALL or copy_engine._BatchCall()
    copy_engine._CALL = call
    for n_pages in (16, 512):  # 1024 and 32768 descriptors (2 buffers x 32 layers each)
        pages = np.arange(min(n_pages, tokens // 16))  # host pages never adjacent: no merge
        desc = build_descriptors(geom, pages, pages, d2h=False, layers=range(L), per_layer=False)
        n = len(desc.sizes)
        for how, direct in (("ctypes", call.direct), ("cuda-bindings", None)):
            if how == "ctypes" and direct is None:
                continue
            saved, call.direct = call.direct, direct
            with torch.cuda.stream(stream):
                per = []
                for _ in range(5):
                    t0 = time.perf_counter()
                    copy_engine.memcpy_batch(desc.dst, desc.src, desc.sizes, stream.cuda_stream)
                    per.append(time.perf_counter() - t0)
                    stream.synchronize()
            call.direct = saved
            out[f"copy engine, {n} descriptors, {how}"] = median(per) * 1e6
    del dev, host
    torch.cuda.empty_cache()
    return out


def ceilings(nbytes: int, device) -> dict[str, float]:
    """Contiguous pinned↔device copies of the same bytes, alone (the copy engine's best)."""
    h = host_empty((nbytes,), torch.uint8, pin=True)
    d = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    copies = {
        "h2d": lambda: d.copy_(h, non_blocking=True),
        "d2h": lambda: h.copy_(d, non_blocking=True),
    }
    for name, fn in copies.items():
        fn()
        out[name] = gbs(nbytes, median([_wall(fn) for _ in range(5)]))
    return out


def write_report(out: str, info: dict, rows: list[Row], ceil: dict, cpu: dict, args) -> None:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "bench_overlap.json"), "w") as f:
        json.dump(
            {"info": info, "ceilings": ceil, "cpu_us": cpu, "rows": [asdict(r) for r in rows]},
            f,
            indent=1,
        )
    lines = [
        "# Copies beside compute (fixed work)",
        "",
        *header_lines(info),
        (
            f"- Transfer: {args.tokens} tokens in random pages, {L} layers, K and V of {H}x{D} "
            f"bf16 ({args.tokens * 4096 * L / 2**30:.2f} GiB); load = one call + one event per "
            "layer on its own stream; backup = all layers in one call. GEMM: "
            f"[{args.m}, {HIDDEN}] @ [{HIDDEN}, {FFN}] @ [{FFN}, {HIDDEN}] bf16 on another stream, "
            "looped to last as long as the transfer alone."
        ),
        (
            f"- Contiguous pinned copy of the same bytes alone: H→D {ceil['h2d']:.1f} GB/s, "
            f"D→H {ceil['d2h']:.1f} GB/s. Medians of {args.reps} runs."
        ),
        (
            "- Each rep runs: GEMM loop alone, transfer alone, both, GEMM loop alone; medians over "
            "reps. ratio = wall time until both are done / max(transfer alone, GEMM loop alone "
            "(mean of the two)). GEMM slowdown = the loop's event time beside the transfer / "
            "alone − 1; A/A = the second alone run / the first − 1 (the GEMM's own drift within "
            "a rep). CPU µs/call = host time of the "
            "issue loop / calls (32 for a load, 1 for a backup); plan ms = descriptors or index "
            "upload, once per batch. descr./call = copy-engine descriptors of the largest call "
            "after adjacent chunks merged (staged: copy-engine calls plus gather/scatter "
            "launches of the largest call)."
        ),
        "",
        (
            "| path | dir | layout | P | descr./call | alone ms | GB/s alone | GEMM iters | "
            "both ms | ratio | GEMM slowdown | A/A | GB/s beside | CPU µs/call | plan ms |"
        ),
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r.path} | {r.direction} | {r.layout} | {r.page_size} | {r.descriptors or '—'} | "
            f"{r.xfer_ms:.1f} | {r.gbs_alone:.1f} | {r.gemm_iters} | {r.both_ms:.1f} | "
            f"{r.ratio:.3f} | {100 * r.gemm_slowdown:+.1f}% | {100 * r.aa_drift:+.1f}% | "
            f"{r.gbs_beside:.1f} | {r.cpu_us_per_call:.0f} | {r.plan_ms:.2f} |"
        )
    lines += [
        "",
        f"## CPU µs per call, alone (batches enqueued through {info['batch_call']})",
        "",
        "| call | µs |",
        "|---|---|",
        *[f"| {k} | {v:.1f} |" for k, v in cpu.items()],
    ]
    with open(os.path.join(out, "bench_overlap.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    plot(out, info, rows)


def plot(out: str, info: dict, rows: list[Row]) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no PNG")
        return
    fig, axes = plt.subplots(1, 2, figsize=(15, 6))
    short = {"layer_first": "lf", "page_first_direct": "pfd", "page_first": "pf"}
    labels = [f"{r.direction} {short.get(r.layout, r.layout)} P{r.page_size}" for r in rows]
    keys = sorted(set(labels), key=labels.index)
    for ax, attr, title in (
        (axes[0], "ratio", "fixed-work ratio (1.0 = perfect overlap)"),
        (axes[1], "gemm_slowdown", "GEMM slowdown beside the transfer"),
    ):
        width = 0.8 / len(PATHS)
        for i, path in enumerate(PATHS):
            vals = {lab: getattr(r, attr) for lab, r in zip(labels, rows) if r.path == path}
            xs = [k + (i - (len(PATHS) - 1) / 2) * width for k in range(len(keys))]
            ax.bar(xs, [vals.get(k, 0.0) for k in keys], width, label=path)
        ax.set_xticks(range(len(keys)))
        ax.set_xticklabels(keys, rotation=70, fontsize=7)
        ax.set_title(title)
        ax.legend()
    axes[0].axhline(1.0, color="k", lw=0.8)
    axes[1].axhline(0.0, color="k", lw=0.8)
    fig.suptitle(f"kvtier copies beside a GEMM loop — {info['gpu']}, {info['date']}")
    fig.tight_layout()
    fig.savefig(os.path.join(out, "bench_overlap.png"), dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="profiling/results")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--m", type=int, default=4096, help="GEMM rows (tokens of the MLP)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--page-sizes", type=int, nargs="+", default=list(PAGE_SIZES))
    ap.add_argument("--layouts", nargs="+", default=list(LAYOUTS))
    ap.add_argument("--paths", nargs="+", default=list(PATHS))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes: the flow only")
    ap.add_argument("--replot", metavar="JSON", help="redraw the PNG of a recorded run into --out")
    args = ap.parse_args()
    if args.replot:
        with open(args.replot) as f:
            rec = json.load(f)
        plot(args.out, rec["info"], [Row(**r) for r in rec["rows"]])
        return
    if not torch.cuda.is_available():
        raise SystemExit("bench_overlap needs a GPU")
    if args.smoke:
        args.tokens, args.m, args.reps = 256, 256, 1
    device = torch.device("cuda")
    support = engine_support(device)
    print(f"copy engine: {'available' if support.ok else support.reason}", flush=True)
    info = environment()
    info["batch_call"] = batch_call_kind() if support.ok else "—"
    print(f"batches enqueued through {info['batch_call']}", flush=True)
    cpu = cpu_costs(device, args.tokens)
    for k, v in cpu.items():
        print(f"cpu {k}: {v:.1f} us", flush=True)
    gemm = Gemm(args.m, device)
    gen = torch.Generator().manual_seed(0)
    rows: list[Row] = []
    slots = 2 * args.tokens
    for layout in args.layouts:
        for P in args.page_sizes:
            dev, host = _pool(layout, P, slots, device)
            for d2h in (False, True):
                for path in args.paths:
                    r = run_row(path, d2h, layout, P, dev, host, args.tokens, gemm, args.reps, gen)
                    if r is None:
                        continue
                    rows.append(r)
                    print(
                        f"{r.path:11s} {r.direction} {r.layout:17s} P={r.page_size:<3d} "
                        f"ratio {r.ratio:.3f}  gemm {100 * r.gemm_slowdown:+5.1f}% "
                        f"(A/A {100 * r.aa_drift:+.1f}%)  {r.gbs_alone:5.1f} -> "
                        f"{r.gbs_beside:5.1f} GB/s  cpu {r.cpu_us_per_call:7.0f} us/call  "
                        f"plan {r.plan_ms:6.2f} ms  descr {r.descriptors}",
                        flush=True,
                    )
            del dev, host
            torch.cuda.empty_cache()
    ceil = ceilings(args.tokens * 2 * L * H * D * 2, device)
    write_report(args.out, info, rows, ceil, cpu, args)


if __name__ == "__main__":
    main()
