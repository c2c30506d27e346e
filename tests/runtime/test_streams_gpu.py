"""The controller's stream switch (``_OnStream``) and its indexed device, on the GPU: the stream
is current inside the block and the caller's stream comes back after it, also after an error and
when nested; a bare ``device="cuda"`` becomes the current device's index. Skipped without a GPU.
"""

from __future__ import annotations

import threading

import pytest
import torch

from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig
from kvtier.runtime.controller import _OnStream

if not torch.cuda.is_available():
    pytest.skip("needs a GPU", allow_module_level=True)


def test_stream_is_current_inside_and_restored_after() -> None:
    a, b = torch.cuda.Stream(), torch.cuda.Stream()
    outer = torch.cuda.current_stream()
    with _OnStream(a):
        assert torch.cuda.current_stream() == a
        with _OnStream(b):
            assert torch.cuda.current_stream() == b
        assert torch.cuda.current_stream() == a
    assert torch.cuda.current_stream() == outer
    with pytest.raises(KeyError), _OnStream(a):
        raise KeyError("inside")
    assert torch.cuda.current_stream() == outer


def test_stream_switch_in_another_thread_leaves_this_one_alone() -> None:
    a = torch.cuda.Stream()
    outer = torch.cuda.current_stream()
    seen = []

    def other() -> None:
        with _OnStream(a):
            seen.append(torch.cuda.current_stream() == a)
        seen.append(torch.cuda.current_stream() != a)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert seen == [True, True]
    assert torch.cuda.current_stream() == outer


def test_bare_cuda_device_is_indexed() -> None:
    cache = TieredKVCache(
        CacheConfig(
            layer_kinds=("full",) * 2,
            kv_heads=2,
            head_dim=16,
            page_size=4,
            device_tokens=64,
            host_ratio=2.0,
            device="cuda",
        )
    )
    try:
        assert cache.controller.device == torch.device("cuda", torch.cuda.current_device())
    finally:
        cache.close()
