"""Copy GB/s by transfer size, timed the way the cache times its own copies.

The cache reports each backup's and load's "own time" with CUDA events recorded right before the
first launch and after the last, on an otherwise idle copy stream: for small transfers that span
is the launch, not the bytes. This measures single D->H backups (all layers) and H->D per-layer
loads of one KV pool at the demo's shape over transfer sizes from one page up, so the demo's
figures can be read against the size they moved.

    python3 profiling/bench_copy_sizes.py            # needs CUDA
"""

from __future__ import annotations

import statistics

import torch

from kvtier.runtime.pools.allocator import PageAllocator
from kvtier.runtime.pools.device import MHADevicePool
from kvtier.runtime.pools.host import HostPool


def main() -> None:
    dev = torch.device("cuda")
    layers, heads, dim, P, size = 2, 2, 64, 16, 65536  # the demo's full-attention pool shape
    pool = MHADevicePool(layers, size, heads, dim, torch.bfloat16, dev, P)
    host = HostPool(pool, "page_first", size=size)
    alloc, halloc = PageAllocator(size, P), PageAllocator(size, P)
    print(
        f"GPU: {torch.cuda.get_device_name()}; torch {torch.__version__}; pool {layers} layers "
        f"x {heads} heads x {dim} bf16, page {P}, host page_first"
    )
    print("tokens | bytes/call | D->H all layers: GB/s (median us) | H->D one layer: GB/s (us)")
    for tokens in (16, 64, 256, 1024, 4096, 16384):
        d = alloc.alloc(tokens).to(dev)
        h = halloc.alloc(tokens).to(dev)
        row = []
        for fn, nbytes in (
            (lambda d=d, h=h: host.backup(d, h, check=False), tokens * pool.bytes_per_token),
            (
                lambda d=d, h=h: host.load(h, d, layer=0, check=False),
                tokens * pool.bytes_per_token // layers,
            ),
        ):
            fn()  # warm-up (compile, first touch)
            times = []
            for _ in range(20):
                torch.cuda.synchronize()
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3)
            us = statistics.median(times)
            row.append(f"{nbytes / us / 1e3:7.2f} ({us:7.1f})")
        print(f"{tokens:6d} | {tokens * pool.bytes_per_token:10d} | {row[0]} | {row[1]}")
        alloc.free(d.cpu())
        halloc.free(h.cpu())


if __name__ == "__main__":
    main()
