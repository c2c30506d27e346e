"""A load's per-step CUDA events on CPU, through a fake CUDA (helper 70's harness): events that
know whether they were recorded, streams that refuse to wait on an unrecorded one, a check after
every ``wait_layer`` that each load in flight has a recorded event for the step waited on, and a
check that ``poll`` acknowledges no load with an event missing. Copy-engine batches run as
memmoves, so ``run_turn``'s comparison with a cold computation also checks the bytes."""

from __future__ import annotations

import contextlib
import itertools

import pytest
import torch

from kvtier.kernels import copier as copier_mod
from kvtier.kernels.copier import IssueWorker
from kvtier.runtime import controller as ctl_mod
from kvtier.runtime.controller import InlineSteps
from tests.runtime.engine_emulation import auto_engine
from tests.runtime.synthetic import MODELS, check_cached, make_cache, run_turn

_SEQ = itertools.count()


class _Event:
    def __init__(self) -> None:
        self.at: int | None = None

    def record(self, stream=None) -> None:
        self.at = next(_SEQ)

    def query(self) -> bool:
        return self.at is not None

    def synchronize(self) -> None:
        assert self.at is not None, "synchronize on an unrecorded event"

    def elapsed_time(self, other) -> float:
        assert self.at is not None and other.at is not None
        return 0.0


class _Stream:
    device_index = 0

    def wait_event(self, ev) -> None:
        assert isinstance(ev, _Event) and ev.at is not None, "a wait on an unrecorded event"

    def wait_stream(self, other) -> None:
        pass


def _fake_cuda(monkeypatch, cache):
    """The cache's controller on a fake CUDA."""
    ctl = cache.controller
    ctl.cuda = True
    ctl.load_stream, ctl.write_stream = _Stream(), _Stream()
    monkeypatch.setattr(ctl, "_event", _Event)
    monkeypatch.setattr(ctl_mod, "_OnStream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: _Stream())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: None)
    real_wait, real_ready = type(ctl).wait_layer, type(ctl)._ready

    def wait_layer(self, step):
        real_wait(self, step)
        for op in self._loads:
            ev = op.layer_events[step]
            assert ev is not None and ev.at is not None, f"step {step}: no event after the wait"

    def ready(self, queue):
        n = real_ready(self, queue)
        for op in list(queue)[:n]:
            if op.kind == "load":
                assert all(e is not None and e.at is not None for e in op.layer_events), (
                    "a load acknowledged with an event missing"
                )
        return n

    monkeypatch.setattr(type(ctl), "wait_layer", wait_layer)
    monkeypatch.setattr(type(ctl), "_ready", ready)
    return ctl


def _host_hit(cache, seed: int = 3):
    gen = torch.Generator().manual_seed(seed)
    conv = torch.randint(0, 50, (12,), generator=gen).tolist()
    run_turn(cache, conv)
    cache.drain()
    cache.evict(cache.config.device_tokens)
    return conv


@pytest.mark.parametrize("ahead", [None, 2])
@pytest.mark.parametrize("worker", [False, True], ids=["no-worker", "worker"])
@pytest.mark.parametrize("inline", [0, 10**6], ids=["worker-sized", "inline-sized"])
@pytest.mark.parametrize("backend", ["auto", "copy_engine"])
@pytest.mark.parametrize("model", ["full", "full+swa+mamba"])
def test_every_wait_and_ack_has_its_event(monkeypatch, model, backend, inline, worker, ahead):
    auto_engine(monkeypatch, inline)
    cache = make_cache(
        MODELS[model], "write_through", io_backend=backend, host_layout="layer_first"
    )
    ctl = _fake_cuda(monkeypatch, cache)
    paths = ctl.stats.paths
    ctl._worker = IssueWorker() if worker else None
    ctl.load_ahead = ahead
    conv = _host_hit(cache)
    again = run_turn(cache, conv + [7, 7, 1, 2])  # checks every position against a cold run
    assert again.host_hit > 0
    cache.drain()
    cache.check_integrity()
    assert paths["h2d.copy_engine"] >= 1 and paths["d2h.copy_engine"] >= 1, paths


@pytest.mark.parametrize("inline", [0, 10**6], ids=["worker-sized", "inline-sized"])
def test_a_load_is_not_acknowledged_before_its_copies_finish(monkeypatch, inline):
    auto_engine(monkeypatch, inline)
    cache = make_cache(
        MODELS["full+swa"], "write_through", io_backend="auto", host_layout="layer_first"
    )
    ctl = _fake_cuda(monkeypatch, cache)
    ctl._worker = IssueWorker()
    ctl.load_ahead = 1  # three steps: two issued at the start, one left for the waits
    conv = _host_hit(cache)
    req = cache.match(conv + [7, 7, 1, 2])
    assert req.host_hit > 0
    cache.reserve(req, len(req.token_ids) + 3)
    assert cache.start_loading()
    op = ctl._loads[-1]
    if inline:  # a small copy-engine batch: 1 + ahead steps now, the rest as the forward waits
        assert isinstance(op.ticket, InlineSteps)
        assert op.ticket.issued == 1 + ctl.load_ahead < op.ticket.steps
    monkeypatch.setattr(_Event, "query", lambda self: False)  # the GPU is still copying
    for _ in range(3):
        assert ctl.poll() == (0, 0)
    monkeypatch.setattr(_Event, "query", lambda self: self.at is not None)
    cache.abort(req)
    cache.drain()
    cache.check_integrity()


@pytest.mark.parametrize("model", ["full", "full+swa"])
def test_a_failed_inline_first_call_requeues_the_batch(monkeypatch, model):
    """A small copy-engine load whose first batch call fails (helper 70): the batch goes back
    to the queue with the books as they were, nothing in flight, and a later start_loading
    serves the hit exactly."""
    auto_engine(monkeypatch, 10**6)
    cache = make_cache(MODELS[model], "write_through", io_backend="auto", host_layout="layer_first")
    ctl = _fake_cuda(monkeypatch, cache)
    ctl._worker = IssueWorker()
    conv = _host_hit(cache)
    req = cache.match(conv + [7, 7, 1, 2])
    assert req.host_hit > 0
    cache.reserve(req, len(req.token_ids) + 3)
    real = copier_mod.memcpy_batch

    def broken(*args):
        raise RuntimeError("batch failed")

    monkeypatch.setattr(copier_mod, "memcpy_batch", broken)
    queued = list(ctl._queued)
    with pytest.raises(RuntimeError, match="batch failed"):
        cache.start_loading()
    assert ctl._queued == queued and not ctl._loads
    monkeypatch.setattr(copier_mod, "memcpy_batch", real)
    assert cache.start_loading()
    check_cached(cache, req)
    cache.abort(req)
    cache.drain()
    cache.check_integrity()
