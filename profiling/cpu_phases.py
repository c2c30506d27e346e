"""CPU phases of a host hit before the forward pass: ``match`` and ``start_loading`` and the calls
inside them, timed with ``perf_counter`` wrappers while ``bench_e2e`` runs (its arguments pass
through), averaged per call:

    python3 -m profiling.cpu_phases --host-layout layer_first --io-backend auto --reps 8

Wrappers count only while ``match`` or ``start_loading`` runs; each costs well under a
microsecond, so the phases add up to a little more than the calls themselves. Unlike
``bench_e2e --profile-start`` (cProfile), per-element Python is not inflated.
"""

import atexit
import collections
import sys
import time

import torch

import kvtier.kernels.copier as C
import kvtier.kernels.kv_transfer as KT
import kvtier.runtime.cache as CA
import kvtier.runtime.controller as CT
from profiling import bench_e2e

acc = collections.Counter()
cnt = collections.Counter()
inside = [0]


def wrap(obj, name, label, gate=True):
    raw = obj.__dict__.get(name) if isinstance(obj, type) else None
    f = getattr(obj, name)

    def g(*a, **k):
        if gate and not inside[0]:
            return f(*a, **k)
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t
            cnt[label] += 1

    setattr(obj, name, staticmethod(g) if isinstance(raw, (classmethod, staticmethod)) else g)


def install() -> None:
    """Wrap match, start_loading and the calls inside them."""
    orig_sl = CT.CacheController.start_loading

    def sl(self):
        inside[0] = 1
        t = time.perf_counter()
        try:
            return orig_sl(self)
        finally:
            inside[0] = 0
            acc["start_loading"] += time.perf_counter() - t
            cnt["start_loading"] += 1

    CT.CacheController.start_loading = sl
    orig_m = CA.TieredKVCache.match

    def m(self, *a, **k):
        inside[0] = 2
        t = time.perf_counter()
        try:
            return orig_m(self, *a, **k)
        finally:
            inside[0] = 0
            acc["match"] += time.perf_counter() - t
            cnt["match"] += 1

    CA.TieredKVCache.match = m
    wrap(C.HostCopier, "plan", "copier.plan")
    wrap(C.HostCopier, "_plan_kernel", "_plan_kernel")
    wrap(C.HostCopier, "_items", "_items")
    wrap(C.HostCopier, "route", "route")
    wrap(C.HostCopier, "_pages", "_pages")
    wrap(C, "layer_descriptors", "layer_descriptors")
    wrap(C.HostCopier, "_plan_engine", "_plan_engine")
    wrap(KT, "copy_host_to_device", "copy_host_to_device(launch)")
    wrap(C.IssueWorker, "submit", "worker.submit")
    wrap(CT.CacheController, "_after_compute", "_after_compute")
    wrap(CT.CacheController, "_event", "_event")
    wrap(CT.CacheController, "_offload", "_offload")
    wrap(torch, "cat", "torch.cat")
    wrap(CA, "token_list", "token_list")
    wrap(CT.CacheController, "load_back", "load_back")


def report() -> None:
    n = max(1, cnt["start_loading"])
    print(f"per start_loading call ({n} calls; match {cnt['match']} calls):", flush=True)
    for k, v in sorted(acc.items(), key=lambda kv: -kv[1]):
        c = cnt[k] / (cnt["match"] if k in ("match", "token_list", "load_back") else n)
        d = cnt["match"] if k in ("match", "token_list", "load_back") else n
        print(f"  {k:30s} {v / d * 1e6:8.1f} us  ({c:.1f} calls each)", flush=True)


def main() -> None:
    install()
    atexit.register(report)
    sys.argv = ["profiling.cpu_phases (bench_e2e's arguments)", *sys.argv[1:]]
    bench_e2e.main()


if __name__ == "__main__":
    main()
