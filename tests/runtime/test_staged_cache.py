"""``io_backend="staged"`` through the cache on the CPU: every backup and load of a hybrid model
staged through the device ring (the copy-engine step emulated by memmoves), every reused
position equal to a cold computation, and the path and reason counted."""

from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from kvtier.kernels import copier as copier_mod
from kvtier.kernels import staged as staged_mod
from kvtier.kernels.copy_engine import EngineSupport
from tests.runtime.synthetic import MODELS, make_cache, run_turn


def taken(counts: dict[str, int]) -> set[str]:
    """The paths or reasons counted at least once (every one is a key from the start, at 0)."""
    return {k for k, v in counts.items() if v}


def _turns(cache) -> None:
    """Turn 1 of two conversations, evict them, and turn 2 of the first: backups, then a load."""
    gen = torch.Generator().manual_seed(4)
    convs = [torch.randint(0, 50, (12,), generator=gen).tolist() for _ in range(2)]
    for c in convs:
        run_turn(cache, c)
    cache.drain()
    cache.evict(cache.config.device_tokens)
    again = run_turn(cache, convs[0] + [7, 7, 1, 2])  # checks reused positions vs a cold run
    assert again.host_hit > 0
    cache.drain()
    cache.check_integrity()


@pytest.mark.parametrize("layout", ["layer_first", "page_first_direct", "page_first"])
def test_staged_route_end_to_end(monkeypatch, layout):
    calls: list[tuple[int, int]] = []

    def copy(dst, src, sizes, mats, stream):
        calls.append((len(sizes), len(mats)))
        for d, s, n in zip(dst.tolist(), src.tolist(), sizes.tolist()):
            ctypes.memmove(d, s, n)
        for d, dp, s, sp, w, h in mats.tolist():
            for i in range(h):
                ctypes.memmove(d + i * dp, s + i * sp, w)

    monkeypatch.setattr(copier_mod, "engine_support", lambda device: EngineSupport(True))
    monkeypatch.setattr(staged_mod, "engine_copy", copy)
    cache = make_cache(MODELS["full+swa"], "write_through", io_backend="staged", host_layout=layout)
    _turns(cache)
    st = cache.controller.stats
    assert taken(st.paths) == {"d2h.staged", "h2d.staged"}, st.paths
    assert taken(st.route_reasons) == {"io_backend_staged"}
    assert calls
    metrics = cache.metrics()
    assert metrics["copy_path.h2d.staged"] >= 1 and metrics["copy_route.io_backend_staged"] >= 1


def test_config_takes_staged():
    cache = make_cache(MODELS["full"], "write_through")
    assert dataclasses.replace(cache.config, io_backend="staged").io_backend == "staged"
