"""The demo's workload on every layer set: a host smaller than the working set plus an L3 file
store serves (almost) what a host holding everything serves, and every answer is exact.

Also pins :func:`reusable_bound` on a trace small enough to work out by hand.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.example import HybridModelConfig
from kvtier.example.demo import DemoConfig, Turn, reusable_bound, run_demo

LAYER_SETS = {
    "full": ("full",),
    "full+swa": ("full", "swa"),
    "full+mamba": ("full", "mamba"),
    "full+swa+mamba": ("full", "swa", "mamba"),
}
SMALL_HOST = 2.0  # 128 host tokens against a working set of about 700
LARGE_HOST = 16.0  # 1024: everything stays on host
SHARE = 0.95


@pytest.fixture(autouse=True)
def one_thread():
    # The model's ops are tiny: intra-op threads cost more than they give on 2 cores.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def workload(kinds: tuple[str, ...], host_ratio: float, l3: bool, compare: bool) -> DemoConfig:
    model = HybridModelConfig(
        layer_kinds=kinds,
        hidden=16,
        q_heads=2,
        kv_heads=1,
        head_dim=8,
        swa_window=8,
        mamba_heads=1,
        mamba_head_dim=8,
        mamba_state=4,
        mamba_kernel=2,
        ffn=16,
    )
    return DemoConfig(
        users=16,
        turns=4,
        answer_tokens=2,
        system_tokens=8,
        message_tokens=(4, 6, 8),
        model=model,
        page_size=4,
        device_tokens=64,
        host_ratio=host_ratio,
        l3=l3,
        device="cpu",
        check_integrity=True,
        compare_cold=compare,
    )


@pytest.mark.parametrize("name", list(LAYER_SETS))
def test_small_host_with_l3_serves_what_a_large_host_serves(name):
    kinds = LAYER_SETS[name]
    lines: list[str] = []
    small = run_demo(workload(kinds, SMALL_HOST, l3=True, compare=True), False, lines.append)
    large = run_demo(workload(kinds, LARGE_HOST, l3=False, compare=False), False, lambda _: None)
    report = "\n".join(lines)
    assert small.identical, f"{name}: outputs differ from a cold run\n{report}"
    # The same answers make the same trace, so both runs face the same bound.
    assert small.bound_tokens == large.bound_tokens, (small.bound_tokens, large.bound_tokens)
    assert large.hit_tokens > 0, f"{name}: the large host served nothing"
    assert small.metrics["tier.bytes.storage.read"] > 0 and small.storage_hits > 0, (
        f"{name}: L3 served nothing; the small host did not overflow?\n{report}"
    )
    assert small.hit_tokens >= SHARE * large.hit_tokens, (
        f"{name}: small host + L3 served {small.hit_tokens} tokens, large host "
        f"{large.hit_tokens}\n{report}"
    )
    assert large.hit_tokens <= large.bound_tokens and small.hit_tokens <= small.bound_tokens


def test_reusable_bound_by_hand():
    """Page size 4. ``seq`` is what a finished request caches: prompt + answer[:-1].

    1. prompt 0..9, answer [100, 101, 102]: nothing cached yet -> 0. It caches 0..9 100 101
       (12 tokens): pages ending at 4, 8, 12; with Mamba only the state at 12.
    2. that prefix + [102, 50, 51] (15 tokens): at most (15 - 1) // 4 * 4 = 12 can hit, and
       the 12-token prefix is cached both ways -> 12.
    3. 0..5 + [60, 61, 62] (9 tokens): at most 8; its 8-prefix differs from 0..7, its 4-prefix
       0..3 is cached -> 4, but no Mamba state sits at 4 -> 0 with Mamba.
    4. the same tokens as 2 in another namespace -> 0.
    5. 0..8 (9 tokens): at most 8, and 0..7 is a cached page prefix -> 8; with Mamba 0.
    6. 0..11 + [7] (13 tokens), one answer token: at most 12; 0..11 is not cached (request 1
       continued with 100 after 9), 0..7 is -> 8; with Mamba, request 5 cached its state at
       8 (9 tokens + no answer fed back -> 8 aligned) -> 8.
    """
    p1 = list(range(10))
    p2 = p1 + [100, 101, 102, 50, 51]
    trace = [
        Turn(p1, [100, 101, 102]),
        Turn(p2, [7]),
        Turn(list(range(6)) + [60, 61, 62], [1]),
        Turn(p2, [7], namespace="lora-a"),
        Turn(list(range(9)), [5]),
        Turn(list(range(12)) + [7], [3]),
    ]
    assert reusable_bound(trace, 4, mamba=False) == [0, 12, 4, 0, 8, 8]
    assert reusable_bound(trace, 4, mamba=True) == [0, 12, 0, 0, 0, 8]


def test_demo_config_rejects_bad_input():
    with pytest.raises(ValueError, match="users must be >= 1, got 0"):
        DemoConfig(users=0)
    with pytest.raises(ValueError, match="host_ratio must be >= 1, got 0.5"):
        DemoConfig(host_ratio=0.5)
    with pytest.raises(ValueError, match="write_policy: unknown 'nope'"):
        DemoConfig(write_policy="nope")
    with pytest.raises(ValueError, match="page_size must be >= 1, got 0"):
        reusable_bound([], 0, mamba=False)
