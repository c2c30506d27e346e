"""``kvtier demo``: a multi-user, multi-turn chat workload through the tiered cache.

Several users share a system prompt and each holds a conversation of several turns; their turns
are interleaved, and the device pool is small, so a user's earlier turns are evicted to host
between their turns and come back through layer-wise load-back. Every answer (greedy tokens and
logits) is compared with a cold run of the same model that uses no cache.
"""

from __future__ import annotations

import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from kvtier.example.config import HybridModelConfig
from kvtier.example.model import HybridModel
from kvtier.example.runner import CachedRunner
from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig, StorageConfig

__all__ = ["DemoResult", "run_demo"]


@dataclass
class DemoResult:
    requests: int
    identical: bool
    metrics: dict
    seconds: float


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled, self.t0 = total, 0, enabled, time.perf_counter()

    def step(self, note: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        width = 30
        fill = width * self.done // self.total
        elapsed = time.perf_counter() - self.t0
        sys.stderr.write(
            f"\r[{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} {elapsed:5.1f}s {note:<40}"
        )
        if self.done == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


def run_demo(
    users: int = 8,
    turns: int = 4,
    answer_tokens: int = 8,
    device: str | None = None,
    write_policy: str = "write_through",
    seed: int = 0,
    progress: bool = True,
    l3: bool = True,
    out=print,
) -> DemoResult:
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    with tempfile.TemporaryDirectory(prefix="kvtier-l3-") as root:
        return _run(users, turns, answer_tokens, device, write_policy, seed, progress,
                    root if l3 else None, out)


def _run(users, turns, answer_tokens, device, write_policy, seed, progress, l3_root, out) -> DemoResult:
    mc = HybridModelConfig(layer_kinds=("full", "swa", "mamba", "full", "swa", "full"), seed=seed)
    model = HybridModel(mc, device=device)
    cfg = CacheConfig(
        layer_kinds=mc.layer_kinds, kv_heads=mc.kv_heads, head_dim=mc.head_dim, page_size=16,
        device_tokens=512, dtype=mc.dtype, swa_window=mc.swa_window, swa_tokens=512,
        mamba=mc.mamba_spec(), mamba_slots=16, write_policy=write_policy, device=device,
        # With L3 the host holds one device pool's worth, so early turns drop out of host
        # memory and come back from storage.
        host_ratio=1.0 if l3_root else 8.0,
        model_id=f"kvtier-demo-{seed}",
        storage=StorageConfig(
            backend="file", backend_config={"root": l3_root}, prefetch_min_tokens=16,
            prefetch_policy="wait_complete",
        ) if l3_root else None,
    )
    cache = TieredKVCache(cfg)
    runner = CachedRunner(model, cache)
    gen = torch.Generator().manual_seed(seed)
    system = torch.randint(0, mc.vocab, (48,), generator=gen).tolist()
    history = [system + [u] for u in range(users)]
    out(
        f"kvtier demo: {users} users x {turns} turns, hybrid model {mc.layer_kinds} on {device}; "
        f"device pool {cfg.device_tokens} tokens, host {cfg.host_kv_tokens}, page {cfg.page_size}, "
        f"{write_policy}, L3 {'file store in ' + l3_root if l3_root else 'off'}"
    )
    bar = _Progress(users * turns, progress)
    identical = True
    t0 = time.perf_counter()
    for turn in range(turns):
        for u in range(users):
            msg = torch.randint(0, mc.vocab, (16 + 8 * ((u + turn) % 3),), generator=gen).tolist()
            prompt = history[u] + msg
            pf = cache.prefetch(prompt)  # read what only L3 has back to host first
            while pf is not None and not pf.done:
                cache.poll()
                time.sleep(0.001)  # a scheduler step: the read runs on the L3 thread
            got = runner.generate(prompt, answer_tokens)
            req = runner.last_request
            cold = model.generate_cold(prompt, answer_tokens)
            same = got.tokens == cold.tokens and torch.equal(got.logits, cold.logits)
            identical &= same
            history[u] = prompt + got.tokens
            bar.step(f"user {u} turn {turn}: hit {req.device_hit}D+{req.host_hit}H/{len(prompt)}")
    cache.drain()
    cache.check_integrity()
    seconds = time.perf_counter() - t0
    m = cache.metrics()
    cache.close()
    total = m["prompt_tokens"]
    out(f"prompt tokens          {total}")
    out(f"hit tokens, device     {m['device_hit_tokens']} ({100 * m['device_hit_tokens'] / total:.1f}%)")
    out(f"hit tokens, host       {m['host_hit_tokens']} ({100 * m['host_hit_tokens'] / total:.1f}%)")
    storage = int(m.get("tier.hit_tokens.storage", 0))
    out(f"hit tokens, storage    {storage} (read from L3 to host ahead of the request; counted again as host hits)")
    if l3_root:
        wb = m.get("tier.bytes.storage.write", 0)
        rb = m.get("tier.bytes.storage.read", 0)
        out(f"L3 written / read      {wb / 2**20:.2f} / {rb / 2**20:.2f} MiB, "
            f"{m.get('tier.gbps.storage.write', 0):.3g} / {m.get('tier.gbps.storage.read', 0):.3g} GB/s")
    out(f"evicted from device    {m['evicted_tokens']} tokens")
    out(f"backed up D->H         {m['d2h_bytes'] / 2**20:.2f} MiB in {m['backups']} backups, {m['d2h_gbps']:.3g} GB/s")
    out(f"loaded back H->D       {m['h2d_bytes'] / 2**20:.2f} MiB in {m['loads']} loads, {m['h2d_gbps']:.3g} GB/s")
    out(f"outputs equal a cold run with no cache: {'yes' if identical else 'NO'} "
        f"({users * turns} requests, tokens and logits bit for bit) in {seconds:.1f}s")
    return DemoResult(users * turns, identical, m, seconds)
