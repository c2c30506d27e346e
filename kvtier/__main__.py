"""Command line: ``kvtier demo`` (also ``python -m kvtier demo``) and ``kvtier roundtrip``.

``demo`` runs the example hybrid model through the tiered cache on a multi-user, multi-turn
workload (see :mod:`kvtier.example.demo`). ``roundtrip`` backs pages of a KV pool up to host memory
in every host layout, loads them back layer by layer into other device slots, and reports bytes
moved, bandwidth, the kernel path taken and whether every byte came back identical.
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial

__all__ = ["main"]


def _sync(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _load_layers(host, hslots, dst, layers: int) -> None:
    for layer in range(layers):
        host.load(hslots, dst, layer=layer)


def _timed(fn, device, repeats: int) -> float:
    """Median wall seconds of ``fn()`` over ``repeats`` calls, after one untimed warm-up call
    (which pays for Triton's compile and autotuning and for first-touch page faults)."""
    import statistics

    fn()
    _sync(device)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def roundtrip(args: argparse.Namespace) -> int:
    import torch

    from kvtier.kernels import HostLayout
    from kvtier.runtime.pools.allocator import PageAllocator
    from kvtier.runtime.pools.device import MHADevicePool
    from kvtier.runtime.pools.host import HostPool

    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1, got {args.repeats}")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    P, L, H, D = args.page_size, args.layers, args.kv_heads, args.head_dim
    pool = MHADevicePool(L, args.tokens * 2, H, D, dtype=torch.bfloat16, device=device, page_size=P)
    gen = torch.Generator().manual_seed(0)
    for buf in (pool.k_buffer, pool.v_buffer):
        buf.view(torch.int16).copy_(
            torch.randint(-(2**15), 2**15, buf.shape, dtype=torch.int16, generator=gen)
        )
    print(
        f"kvtier roundtrip: MHA pool {L} layers x {H} kv heads x {D} head_dim bf16, page {P}, "
        f"{args.tokens} tokens per round trip, device {device}\n"
        f"  GB/s = bytes of all layers / median wall time of {args.repeats} timed calls, after "
        "one untimed warm-up call per path\n"
        "  (D->H: one backup launch over all layers; H->D: one load launch per layer)"
    )
    ok = True
    for layout in HostLayout:
        host = HostPool(pool, layout, ratio=1.0)
        dev_alloc = PageAllocator(pool.size, pool.page_size, "kv")
        host_alloc = PageAllocator(host.size, host.page_size, "host kv")
        src = dev_alloc.alloc(args.tokens).to(device)
        dst = dev_alloc.alloc(args.tokens).to(device)
        hslots = host_alloc.alloc(args.tokens).to(device)
        nbytes = args.tokens * pool.bytes_per_token
        path = host.backup(src, hslots)
        d2h = _timed(partial(host.backup, src, hslots), device, args.repeats)
        h2d = _timed(partial(_load_layers, host, hslots, dst, L), device, args.repeats)
        same = all(
            torch.equal(buf[:, src].view(torch.int16), buf[:, dst].view(torch.int16))
            for buf in (pool.k_buffer, pool.v_buffer)
        )
        ok &= same
        print(
            f"  {layout.value:18s} D->H {nbytes / 2**20:8.1f} MiB {nbytes / d2h / 1e9:7.2f} GB/s | "
            f"H->D layer by layer {nbytes / h2d / 1e9:7.2f} GB/s | path {path} | "
            f"identical: {'yes' if same else 'NO'}"
        )
        dev_alloc.free(src.cpu())
        dev_alloc.free(dst.cpu())
    print(
        "all layouts returned identical bytes"
        if ok
        else "MISMATCH: data did not come back identical"
    )
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kvtier", description="KV-cache tiering runtime")
    sub = ap.add_subparsers(dest="cmd", required=True)
    demo = sub.add_parser("demo", help="multi-user chat through the tiered cache vs a cold run")
    demo.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    # None: the demo's own defaults (kvtier.example.demo.DemoConfig)
    demo.add_argument("--users", type=int, default=None)
    demo.add_argument("--turns", type=int, default=None)
    demo.add_argument(
        "--host-ratio", type=float, default=None, help="host pool size over the device pool's"
    )
    demo.add_argument(
        "--write-policy",
        default=None,
        choices=["write_through", "write_through_selective", "write_back"],
    )
    demo.add_argument("--seed", type=int, default=None)
    demo.add_argument("--no-progress", action="store_true")
    demo.add_argument("--no-l3", action="store_true", help="run without the L3 file store")
    d = sub.add_parser("roundtrip", help="D->H->D round trip through every host layout")
    d.add_argument("--device", default=None, help="cuda or cpu (default: cuda if available)")
    d.add_argument("--layers", type=int, default=8)
    d.add_argument("--kv-heads", type=int, default=8)
    d.add_argument("--head-dim", type=int, default=128)
    d.add_argument("--page-size", type=int, default=16)
    d.add_argument("--tokens", type=int, default=4096)
    d.add_argument("--repeats", type=int, default=5, help="timed calls per path (median)")
    args = ap.parse_args(argv)
    if args.cmd == "demo":
        import torch

        from kvtier.example.demo import DemoConfig, run_demo

        # The example model's ops are tiny: intra-op threads cost more than they give, and on a
        # busy machine they thrash (8 ms instead of 60 us per attention call on 2 cores).
        torch.set_num_threads(1)

        given = {
            k: getattr(args, k)
            for k in ("users", "turns", "host_ratio", "write_policy", "seed", "device")
        }
        config = DemoConfig(l3=not args.no_l3, **{k: v for k, v in given.items() if v is not None})
        res = run_demo(config, progress=not args.no_progress)
        return 0 if res.identical else 1
    if args.cmd == "roundtrip":
        return roundtrip(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
