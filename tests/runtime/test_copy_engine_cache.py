"""``io_backend`` through the cache: config checks, the route of every copy in the metrics, and
the copy-engine route end to end (its batches emulated by memmoves on the CPU)."""

from __future__ import annotations

import ctypes
import dataclasses
import threading

import pytest
import torch

from kvtier.kernels import copier as copier_mod
from kvtier.kernels.copier import IssueWorker
from kvtier.kernels.copy_engine import EngineSupport
from kvtier.kernels.dispatch import RouteReason
from tests.runtime.synthetic import MODELS, make_cache, run_turn


@pytest.mark.parametrize("value, exc", [("fast", ValueError), (3, TypeError)])
def test_config_refuses_bad_io_backend(value, exc):
    cache = make_cache(MODELS["full"], "write_through")
    with pytest.raises(exc, match="io_backend"):
        dataclasses.replace(cache.config, io_backend=value)


def _turns(cache) -> None:
    """Turn 1 of two conversations, evict them, and turn 2 of the first: backups, then a load."""
    gen = torch.Generator().manual_seed(3)
    convs = [torch.randint(0, 50, (12,), generator=gen).tolist() for _ in range(2)]
    for c in convs:
        run_turn(cache, c)
    cache.drain()
    cache.evict(cache.config.device_tokens)
    again = run_turn(cache, convs[0] + [7, 7, 1, 2])
    assert again.host_hit > 0
    cache.drain()
    cache.check_integrity()


def test_cpu_cache_falls_back_and_counts_why():
    cache = make_cache(MODELS["full+swa"], "write_through", io_backend="copy_engine")
    _turns(cache)
    st = cache.controller.stats
    assert set(st.paths) == {"d2h.interpreter", "h2d.interpreter"} or set(st.paths) == {
        "d2h.torch",
        "h2d.torch",
    }
    assert set(st.route_reasons) == {"fallback_no_engine"}
    assert sum(st.route_reasons.values()) == sum(st.paths.values())


@pytest.mark.parametrize("worker", [False, True], ids=["inline", "worker"])
@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct", "page_first"])
def test_engine_route_end_to_end(monkeypatch, layout, worker):
    calls: list[int] = []
    threads: set[str] = set()

    def batch(dsts, srcs, sizes, stream):
        calls.append(len(sizes))
        threads.add(threading.current_thread().name)
        for d, s, n in zip(dsts, srcs, sizes):
            ctypes.memmove(int(d), int(s), int(n))

    monkeypatch.setattr(copier_mod, "engine_support", lambda device: EngineSupport(True))
    monkeypatch.setattr(copier_mod, "memcpy_batch", batch)
    cache = make_cache(
        MODELS["full+swa"], "write_through", io_backend="copy_engine", host_layout=layout
    )
    if worker:  # on the GPU the controller has one; here the emulated batches run on it
        cache.controller._worker = IssueWorker()
    _turns(cache)  # run_turn checks every cached position against a cold computation
    st = cache.controller.stats
    # Every copy-engine load plan has a kernel lead for the first layer a load issues.
    lead = RouteReason.LEAD_LAYER.value
    assert st.route_reasons[lead] == st.paths["h2d.copy_engine"], st.route_reasons
    if layout == "page_first":
        # The two full layers interleave inside a host page: the kernel moves them. The one
        # SWA layer has nothing to interleave with: its pages are contiguous.
        assert set(st.route_reasons) == {"fallback_not_contiguous", "io_backend_copy_engine", lead}
        assert calls
    else:
        leads = set(st.paths) - {"d2h.copy_engine", "h2d.copy_engine"}
        assert leads and leads <= {"h2d.interpreter", "h2d.torch", "h2d.triton"}, st.paths
        assert set(st.route_reasons) == {"io_backend_copy_engine", lead}
        # a load issues one batch per pool layer that holds bytes to move, less its lead layer
        assert len(calls) >= st.paths["d2h.copy_engine"]
    assert threads == ({"kvtier-issue"} if worker else {threading.main_thread().name})
