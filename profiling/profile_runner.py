"""A short model-runner session through kvtier, for Nsight: every kvtier region is an NVTX range.

It builds a 4-layer Llama-shaped decoder (``bench_e2e.LlamaShaped``) over a ``TieredKVCache``,
computes a 1K-token prefix (write-through backup: ``kvtier.backup``, ``kvtier.d2h all ...``),
evicts it (``kvtier.evict``), then serves a 1.5K-token prompt that hits it on host: ``kvtier.match``,
per-layer ``kvtier.load layerN kv`` / ``kvtier.h2d layerN ...`` overlapped with the forward, and
``kvtier.insert``. See ``profiling/NSIGHT.md`` for the commands::

    nsys profile -t cuda,nvtx -o kvtier_runner python3 -m profiling.profile_runner
"""

from __future__ import annotations

import argparse
import sys

import torch

from kvtier.kernels import set_debug_checks
from kvtier.nvtx import backend_name
from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig
from profiling.bench_e2e import LlamaShaped
from profiling.common import environment, header_lines


def main() -> None:
    argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    ).parse_args()
    if not torch.cuda.is_available():
        sys.exit("profile_runner needs a CUDA GPU")
    set_debug_checks(False)
    print("\n".join(header_lines(environment())), flush=True)
    layers, prefix_len, prompt_len = 4, 1024, 1536
    cfg = CacheConfig(
        layer_kinds=("full",) * layers,
        kv_heads=8,
        head_dim=128,
        page_size=16,
        device_tokens=8192,
        dtype=torch.bfloat16,
        host_ratio=2.0,
        device="cuda",
    )
    cache = TieredKVCache(cfg)
    model = LlamaShaped(layers, torch.device("cuda"))
    prompt = torch.randint(0, 32000, (prompt_len,), generator=torch.Generator().manual_seed(0))
    prompt_dev = prompt.cuda()
    prefix = prompt[:prefix_len].tolist()
    with torch.no_grad():
        req = cache.match(prefix + [0])
        slots = cache.reserve(req, prefix_len).cuda()
        model.forward(cache, prompt_dev[:prefix_len], 0, slots, wait=False)
        cache.computed(req, prefix_len)
        req.token_ids = prefix
        cache.cache_finished_req(req)
        cache.drain()
        cache.evict(cfg.device_tokens)
        req = cache.match(prompt.tolist())
        slots = cache.reserve(req, prompt_len).cuda()
        cache.start_loading()
        start = req.cached_len
        model.forward(cache, prompt_dev[start:], start, slots, wait=True)
        cache.computed(req, prompt_len)
        cache.cache_finished_req(req)
        cache.drain()
    torch.cuda.synchronize()
    print(
        f"host hit {req.host_hit} tokens, device hit {req.device_hit}; NVTX backend: {backend_name()}"
    )
    print(cache.metrics())


if __name__ == "__main__":
    main()
