"""Where ``start_loading``'s CPU goes on a GPU host, and how far each piece is from its cost when
called back to back: wrappers on the pieces of a 7K-token host hit's load (bench_e2e's shapes,
``layer_first``, ``io_backend="auto"``), then the same calls repeated in a tight loop.

    python3 -m profiling.start_loading_cpu        # needs a CUDA GPU

Each host hit starts from an idle, synchronized GPU (as bench_e2e's runs do); the tight-loop
figures are what the same calls cost when they run hot.
"""

from __future__ import annotations

import statistics
import time

import numpy as np
import torch

import kvtier.kernels.copier as copier_mod
import kvtier.kernels.kv_transfer as kt
import kvtier.runtime.controller as ctl
from kvtier.kernels import set_debug_checks
from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig
from profiling.common import environment, header_lines


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("start_loading_cpu needs a CUDA GPU")
    set_debug_checks(False)
    cfg = CacheConfig(
        layer_kinds=("full",) * 32, kv_heads=8, head_dim=128, page_size=16,
        device_tokens=32768, dtype=torch.bfloat16, host_ratio=2.0,
        write_policy="write_through", device="cuda", host_layout="layer_first",
        io_backend="auto",
    )  # fmt: skip
    cache = TieredKVCache(cfg)
    prefix = torch.randint(0, 32000, (7168,), generator=torch.Generator().manual_seed(1)).tolist()
    req = cache.match(prefix + [0])
    cache.reserve(req, 7168)
    cache.computed(req, 7168)
    req.token_ids = prefix
    cache.cache_finished_req(req)
    cache.drain()

    acc: dict[str, list[float]] = {}

    def wrap(owner, name):
        fn = getattr(owner, name)

        def timed(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc.setdefault(name, []).append(time.perf_counter() - t)

        setattr(owner, name, timed)

    for owner, name in (
        (ctl.CacheController, "_after_compute"),
        (ctl.CacheController, "_event"),
        (copier_mod.HostCopier, "plan_lead"),
        (copier_mod.HostCopier, "_pair"),
        (copier_mod, "upload_indices"),
        (copier_mod, "copy_host_to_device"),
        (kt, "_launch"),
        (copier_mod.HostCopier, "plan"),
    ):
        wrap(owner, name)
    rows = []
    for rep in range(12):
        cache.drain()
        cache.evict(cfg.device_tokens)
        torch.cuda.synchronize()
        acc.clear()
        req = cache.match(prefix + [1, 2, 3])
        cache.reserve(req, 7171)
        t0 = time.perf_counter()
        cache.start_loading()
        t1 = time.perf_counter()
        if rep >= 2:
            rows.append(
                {k: (sum(v), len(v)) for k, v in acc.items()} | {"= start_loading": (t1 - t0, 1)}
            )
        for layer in range(32):
            cache.wait_layer(layer, [req])
        torch.cuda.synchronize()
        cache.computed(req, req.cached_len)
        req.token_ids = req.token_ids[: req.computed_len]
        cache.cache_finished_req(req)
        cache.drain()

    def hot(fn, n: int = 30) -> float:
        ts = []
        for _ in range(n):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
        return statistics.median(ts[1:])

    idx = np.arange(7168, dtype=np.int64)
    staging = torch.empty((2, 7168), dtype=torch.int64, pin_memory=True)
    load = cache.controller.load_stream
    hot_rows = {
        "pinned empty (2 x 7168 int64)": hot(
            lambda: torch.empty((2, 7168), dtype=torch.int64, pin_memory=True)
        ),
        "np.stack into it": hot(lambda: np.stack((idx, idx), out=staging.numpy())),
        "pinned .to(cuda), idle GPU": hot(lambda: staging.to("cuda", non_blocking=True)),
        "torch.cuda.Event()": hot(lambda: torch.cuda.Event(enable_timing=True)),
        "load.wait_stream(current)": hot(lambda: load.wait_stream(torch.cuda.current_stream())),
    }
    lines = [
        "# start_loading's CPU: each piece in a host hit, and called back to back",
        "",
        *header_lines(environment()),
        "",
        "| piece | in start_loading, µs (median of 10, calls) | |",
        "|---|---|---|",
    ]
    for k in rows[0]:
        med = statistics.median(r[k][0] for r in rows if k in r) * 1e6
        lines.append(f"| {k} | {med:.1f} | {rows[0][k][1]} |")
    lines += ["", "| the same kind of call, back to back | µs (median of 29) |", "|---|---|"]
    lines += [f"| {k} | {v * 1e6:.1f} |" for k, v in hot_rows.items()]
    print("\n".join(lines))


if __name__ == "__main__":
    main()
