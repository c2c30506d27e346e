"""``io_backend`` through the cache: config checks, the route of every copy in the metrics, and
the copy-engine route end to end (its batches emulated by memmoves on the CPU)."""

from __future__ import annotations

import ctypes
import dataclasses
import threading

import pytest
import torch

from kvtier.kernels import copier as copier_mod
from kvtier.kernels import dispatch
from kvtier.kernels.copier import IssueWorker
from kvtier.kernels.copy_engine import EngineSupport
from kvtier.kernels.dispatch import RouteReason
from tests.runtime.engine_emulation import auto_engine
from tests.runtime.synthetic import MODELS, check_cached, make_cache, run_turn


def taken(counts: dict[str, int]) -> set[str]:
    """The paths or reasons counted at least once (every one is a key from the start, at 0)."""
    return {k for k, v in counts.items() if v}


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
    assert taken(st.paths) == {"d2h.interpreter", "h2d.interpreter"} or taken(st.paths) == {
        "d2h.torch",
        "h2d.torch",
    }
    assert taken(st.route_reasons) == {"fallback_no_engine"}
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
        for d in ("d2h", "h2d"):  # every batch, however few its descriptors, goes to it
            monkeypatch.setitem(
                dispatch.CROSSOVERS,
                d,
                dataclasses.replace(dispatch.CROSSOVERS[d], inline_descriptors=0),
            )
    _turns(cache)  # run_turn checks every cached position against a cold computation
    st = cache.controller.stats
    if layout == "page_first":
        # The two full layers interleave inside a host page: the kernel moves them. The one
        # SWA layer has nothing to interleave with: its pages are contiguous.
        assert taken(st.route_reasons) == {"fallback_not_contiguous", "io_backend_copy_engine"}
        assert calls
    else:
        # A forced copy engine takes no SMs: no kernel lead layer.
        assert taken(st.paths) == {"d2h.copy_engine", "h2d.copy_engine"}
        assert taken(st.route_reasons) == {"io_backend_copy_engine"}
        # a load issues one batch per pool layer that holds bytes to move
        assert len(calls) >= st.paths["d2h.copy_engine"] + st.paths["h2d.copy_engine"]
    assert threads == ({"kvtier-issue"} if worker else {threading.main_thread().name})


def test_auto_engine_loads_lead_with_the_kernel(monkeypatch):
    """Under auto, a copy-engine load issues its first step through the kernel, inline; the
    issue thread enqueues the rest; every position equals a cold computation."""
    threads = auto_engine(monkeypatch)
    cache = make_cache(
        MODELS["full+swa"], "write_through", io_backend="auto", host_layout="layer_first"
    )
    cache.controller._worker = IssueWorker()
    _turns(cache)
    st = cache.controller.stats
    lead = RouteReason.LEAD_LAYER.value
    # One lead per load batch, for the copier of the batch's first step only.
    assert st.route_reasons.get(lead) == 1, (st.route_reasons, st.paths)
    assert st.route_reasons["auto_copy_engine"] >= 2 and threads, st.route_reasons
    assert set(threads) == {"kvtier-issue"}


def test_auto_engine_loads_of_few_descriptors_stay_inline(monkeypatch):
    """Under auto, batches of few descriptors are enqueued by the thread that needs them even
    with an issue worker, and a load takes no kernel lead; every position equals a cold
    computation, and each wait issues what it needs (``InlineSteps``)."""
    threads = auto_engine(monkeypatch, inline=10**6)
    cache = make_cache(
        MODELS["full+swa"], "write_through", io_backend="auto", host_layout="layer_first"
    )
    cache.controller._worker = IssueWorker()
    _turns(cache)
    st = cache.controller.stats
    assert st.route_reasons[RouteReason.LEAD_LAYER.value] == 0, st.route_reasons
    assert st.paths["h2d.copy_engine"] >= 1 and st.paths["d2h.copy_engine"] >= 1, st.paths
    assert threads and set(threads) == {threading.main_thread().name}


def test_inline_first_step_failure_requeues_the_batch(monkeypatch):
    """A failure while the first step is issued inline leaves the batch queued (nothing on the
    books in flight); a later start_loading issues it and the hit is served exactly."""
    auto_engine(monkeypatch)
    cache = make_cache(
        MODELS["full"], "write_through", io_backend="auto", host_layout="layer_first"
    )
    cache.controller._worker = IssueWorker()
    gen = torch.Generator().manual_seed(5)
    conv = torch.randint(0, 50, (12,), generator=gen).tolist()
    run_turn(cache, conv)
    cache.drain()
    cache.evict(cache.config.device_tokens)
    real = copier_mod.copy_host_to_device

    def broken(*args, **kwargs):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(copier_mod, "copy_host_to_device", broken)
    req = cache.match(conv + [7, 7, 1, 2])
    assert req.host_hit > 0
    cache.reserve(req, len(req.token_ids) + 3)
    ctl = cache.controller
    queued = list(ctl._queued)
    with pytest.raises(RuntimeError, match="launch failed"):
        cache.start_loading()
    assert ctl._queued == queued and not ctl._loads
    monkeypatch.setattr(copier_mod, "copy_host_to_device", real)
    assert cache.start_loading()
    check_cached(cache, req)
    cache.abort(req)
    cache.drain()
    cache.check_integrity()


def _host_hit(cache, seed: int):
    """A request whose prefix is on host only (device copy evicted), slots reserved."""
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randint(0, 50, (12,), generator=gen).tolist()
    run_turn(cache, conv)
    cache.drain()
    cache.evict(cache.config.device_tokens)
    req = cache.match(conv + [7, 7, 1, 2])
    assert req.host_hit > 0
    cache.reserve(req, len(req.token_ids) + 3)
    return req


@pytest.mark.parametrize("backend", ["auto", "kernel"])
def test_first_step_is_issued_before_the_rest_is_planned(monkeypatch, backend):
    """The batch's first step goes out through the kernel before the batch's full plans (route,
    page ids, descriptor counts) are made, so that work is no longer ahead of the first copy;
    the full plan then reuses the lead's indices; every position equals a cold computation."""
    if backend == "auto":
        auto_engine(monkeypatch)
    cache = make_cache(
        MODELS["full"], "write_through", io_backend=backend, host_layout="layer_first"
    )
    cache.controller._worker = IssueWorker()
    req = _host_hit(cache, 6)
    log: list[str] = []
    plan, h2d = copier_mod.HostCopier.plan, copier_mod.copy_host_to_device
    made: list[tuple] = []

    def spy_plan(self, *args, **kwargs):
        log.append("plan")
        out = plan(self, *args, **kwargs)
        made.append((kwargs.get("lead_plan"), out))
        return out

    def spy_h2d(host, dev, h, d, layer=None, **kwargs):
        log.append(f"h2d {layer}")
        return h2d(host, dev, h, d, layer=layer, **kwargs)

    monkeypatch.setattr(copier_mod.HostCopier, "plan", spy_plan)
    monkeypatch.setattr(copier_mod, "copy_host_to_device", spy_h2d)
    assert cache.start_loading()
    for layer in range(len(cache.config.layer_kinds)):
        cache.wait_layer(layer, [req])
    assert log[:2] == ["h2d 0", "plan"], log
    assert log.count("h2d 0") == 1, log
    # The plan reuses the lead made first (its indices uploaded once): as its lead on the
    # copy-engine route, as the plan itself on the kernel route.
    (lead, full), *_ = made
    assert lead is not None
    if full.route.path == "copy_engine":
        assert full.lead is lead
    else:
        assert full._issue is lead._issue and full.keep == lead.keep
    check_cached(cache, req)
    cache.abort(req)
    cache.drain()
    cache.check_integrity()


def test_a_failure_planning_the_rest_after_the_first_step_requeues_the_batch(monkeypatch):
    """The first step is already issued when planning the rest fails: the batch goes back to
    the queue (nothing on the books in flight), and a later start_loading serves it exactly."""
    auto_engine(monkeypatch)
    cache = make_cache(
        MODELS["full"], "write_through", io_backend="auto", host_layout="layer_first"
    )
    cache.controller._worker = IssueWorker()
    req = _host_hit(cache, 7)
    plan = copier_mod.HostCopier.plan

    def broken(self, *args, **kwargs):
        raise RuntimeError("planning failed")

    log: list[int | None] = []
    h2d = copier_mod.copy_host_to_device

    def spy_h2d(host, dev, h, d, layer=None, **kwargs):
        log.append(layer)
        return h2d(host, dev, h, d, layer=layer, **kwargs)

    monkeypatch.setattr(copier_mod.HostCopier, "plan", broken)
    monkeypatch.setattr(copier_mod, "copy_host_to_device", spy_h2d)
    ctl = cache.controller
    queued = list(ctl._queued)
    with pytest.raises(RuntimeError, match="planning failed"):
        cache.start_loading()
    assert log == [0], "the first step went out before the planning failed"
    assert ctl._queued == queued and not ctl._loads
    monkeypatch.setattr(copier_mod.HostCopier, "plan", plan)
    assert cache.start_loading()
    check_cached(cache, req)
    cache.abort(req)
    cache.drain()
    cache.check_integrity()


def test_a_lead_plan_only_serves_a_per_layer_load():
    """``plan(lead_plan=)`` refuses a call the lead cannot stand for (a backup, a whole plan)."""
    cache = make_cache(MODELS["full"], "write_through", io_backend="kernel")
    copier = cache.controller.bindings["kv"].copiers[0].copier
    d, h = torch.arange(4), torch.arange(4, 8)
    lead = copier.plan_lead(d, h)
    for d2h, per_layer in ((True, True), (False, False)):
        with pytest.raises(ValueError, match="lead_plan"):
            copier.plan(d, h, d2h=d2h, per_layer=per_layer, lead_plan=lead)
    assert copier.plan(d, h, d2h=False, per_layer=True, lead_plan=lead)._issue is lead._issue
