#!/usr/bin/env bash
# One device-machine call for the copy kernel's small-call speed and launch cost (issues 11, 12):
# the kernel tests without the interpreter, the CPU cost of a launch (direct vs through the JIT,
# with a cProfile of the direct path), a tile/warps sweep of one-layer sidecar calls and of
# all-layer calls, timed two ways (do_bench as the benchmarks do, and back-to-back inside a CUDA
# graph, which leaves out the CPU's launch gaps), then the sidecar benchmark. Logs go to $OUT.
#   OUT=/tmp/gpu bash profiling/gpu_kernel.sh [--no-bench] [--no-sweep]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-profiling/results/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
{
  date -u; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)"
} | tee "$OUT/env.txt"
python3 -m pytest -q -p no:cacheprovider tests/kernels 2>&1 | tail -8 | tee "$OUT/tests.txt"
case " $* " in *" --no-sweep "*) ;; *)
python3 - "$OUT" <<'PY' 2>&1 | tee "$OUT/kernel_sweep.txt"
import cProfile, io, pstats, statistics, sys, time

import torch
from triton.testing import do_bench

from kvtier.kernels import kv_transfer as kt
from kvtier.kernels.kv_transfer import TransferKnobs, copy_device_to_host, copy_host_to_device
from kvtier.kernels.layout import DeviceBuffers, HostBuffer, host_shape

dev_ = torch.device("cuda")


def pools(B, L, pages, P, item, dtype, layout):
    n = pages * P
    d = torch.empty((B, L, n, *item), dtype=dtype, device=dev_)
    d.view(torch.uint8).random_(0, 256)
    db = DeviceBuffers.from_layers([list(d[b].unbind(0)) for b in range(B)])
    h = torch.empty(host_shape(layout, B, L, n, P, item), dtype=dtype, pin_memory=True)
    h.view(torch.uint8).random_(0, 256)
    return db, HostBuffer.create(h, layout, B, L, P, item)


def graph_ms(fn, k=20, reps=30):
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(k):
            fn()
    g.replay(); torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); b.synchronize()
        out.append(a.elapsed_time(b) / k)
    return statistics.median(out)


def ce(nbytes, d2h):
    d = torch.empty(nbytes, dtype=torch.uint8, device=dev_)
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    fn = (lambda: h.copy_(d, non_blocking=True)) if d2h else (lambda: d.copy_(h, non_blocking=True))
    return do_bench(fn, warmup=10, rep=100, return_mode="median"), graph_ms(fn)


def call(db, hb, di, hi, d2h, layer, knobs, unit):
    if d2h:
        return lambda: copy_device_to_host(db, hb, di, hi, layer=layer, index_unit=unit, knobs=knobs, check=False)
    return lambda: copy_host_to_device(hb, db, hi, di, layer=layer, index_unit=unit, knobs=knobs, check=False)


# --- CPU per call --------------------------------------------------------------------------
db, hb = pools(1, 61, 256, 64, (576,), torch.uint8, "page_first_direct")
g = torch.Generator().manual_seed(32)
di = torch.randperm(256, generator=g)[:32].to(dev_)
hi = torch.randperm(256, generator=g)[:32].to(dev_)
kn = TransferKnobs(num_programs=4)
for fast in (False, True, True):
    kt.FAST_LAUNCH = fast
    for i in range(61):
        copy_host_to_device(hb, db, hi, di, layer=i, index_unit="page", knobs=kn, check=False)
    torch.cuda.synchronize()
    t = time.perf_counter(); n = 0
    for _ in range(20):
        for i in range(61):
            copy_host_to_device(hb, db, hi, di, layer=i, index_unit="page", knobs=kn, check=False); n += 1
    cpu = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    print(f"CPU per call, c4 H2D one layer, {'direct' if fast else 'JIT   '} launch: {cpu:6.1f} us", flush=True)
kt.FAST_LAUNCH = True
pr = cProfile.Profile(); pr.enable()
for _ in range(20):
    for i in range(61):
        copy_host_to_device(hb, db, hi, di, layer=i, index_unit="page", knobs=kn, check=False)
pr.disable(); torch.cuda.synchronize()
s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(14); print(s.getvalue())

# --- H->D probe: more warps per program (32) at the same or twice the bytes in flight ----------
print("rows: what | tile | warps | do_bench %CE | graph %CE  (CE = contiguous copy_)")
# "default" = TransferKnobs() as a cache runs it: host->device calls up to small_h2d_bytes take
# the small-call variant; the fixed rows turn that choice off.
variants = (("default", None), (65536, 16), (32768, 32))
for name, B, L, P, item, dtype, pages, n, layout, scopes in (
    ("c4", 1, 8, 64, (576,), torch.uint8, 256, 32, "page_first_direct", (0,)),
    ("c4", 1, 8, 64, (576,), torch.uint8, 256, 32, "layer_first", (0,)),
    ("c4", 1, 8, 64, (576,), torch.uint8, 256, 128, "page_first_direct", (0,)),
    ("kv", 2, 32, 16, (8, 128), torch.bfloat16, 1024, 512, "page_first_direct", (None, 0)),
    ("kv", 2, 4, 16, (8, 128), torch.bfloat16, 4096, 1024, "page_first_direct", (0,)),
    ("kv", 2, 4, 16, (8, 128), torch.bfloat16, 4096, 4096, "page_first_direct", (0,)),
):
    db, hb = pools(B, L, pages, P, item, dtype, layout)
    g = torch.Generator().manual_seed(n)
    di = torch.randperm(pages, generator=g)[:n].to(dev_)
    hi = torch.randperm(pages, generator=g)[:n].to(dev_)
    for layer in scopes:
        nb = n * P * B * db.item_bytes * (L if layer is None else 1)
        c = ce(nb, False)
        for tb, w in variants:
            kn = TransferKnobs(4) if w is None else TransferKnobs(4, tb, w, small_h2d_bytes=0)
            fn = call(db, hb, di, hi, False, layer, kn, "page")
            a = do_bench(fn, warmup=10, rep=100, return_mode="median")
            b = graph_ms(fn) if layer is not None else a
            print(f"{name} {layout} h2d {'all' if layer is None else '1L'} {n}p {nb/2**20:.3f}MiB | {tb} | {w} | "
                  f"{100*c[0]/a:5.1f} | {100*c[1]/b:5.1f}", flush=True)
    del db, hb
    torch.cuda.empty_cache()
PY
;; esac
case " $* " in *" --no-bench "*) ;; *)
python3 -m profiling.bench_sidecar --out "$OUT" 2>&1 | tee "$OUT/sidecar.txt" | tail -5
;; esac
