"""usable_prefix: the minimum over pools under ALL_PAGES and TRAILING_PAGES(n)."""

from __future__ import annotations

import random

import pytest

from kvtier.storage import ALL_PAGES, TRAILING_PAGES, HitPolicy, usable_prefix

T, F = True, False


def naive(present: list[list[bool]], policies: list[HitPolicy]) -> int:
    """Largest l whose required pages every pool holds, by trying every l."""
    n = min(len(p) for p in present)
    for length in range(n, -1, -1):
        ok = True
        for flags, pol in zip(present, policies):
            lo = 0 if pol.trailing is None else max(0, length - pol.trailing)
            ok &= all(flags[lo:length])
        if ok:
            return length
    return 0


@pytest.mark.parametrize(
    ("present", "policies", "want"),
    [
        ([[T, T, T, F, T]], [ALL_PAGES], 3),
        ([[F, T, T, T, T]], [TRAILING_PAGES(2)], 5),
        ([[T, T, T, T], [F, F, T, F]], [ALL_PAGES, TRAILING_PAGES(1)], 3),
        ([[T, T, T, T], [T, T, F, T]], [ALL_PAGES, TRAILING_PAGES(2)], 2),
        (
            [[T] * 6, [F, T, T, T, F, T], [T, F, T, F, T, F]],
            [ALL_PAGES, TRAILING_PAGES(2), TRAILING_PAGES(1)],
            3,
        ),
        ([[T, T], [F, F]], [ALL_PAGES, TRAILING_PAGES(1)], 0),
        ([[]], [ALL_PAGES], 0),
        ([], [], 0),
    ],
    ids=[
        "kv-hole",
        "swa-window",
        "mamba-last",
        "swa-window-moves",
        "two-trailing-fixed-point",
        "no-state",
        "empty",
        "no-pools",
    ],
)
def test_cases(present: list[list[bool]], policies: list[HitPolicy], want: int) -> None:
    assert usable_prefix(present, policies) == want


def test_random_against_naive() -> None:
    rng = random.Random(0)
    for trial in range(2000):
        n = rng.randint(0, 12)
        pools = rng.randint(1, 4)
        policies = [
            rng.choice([ALL_PAGES, TRAILING_PAGES(rng.randint(1, 4))]) for _ in range(pools)
        ]
        present = [[rng.random() < 0.8 for _ in range(n)] for _ in range(pools)]
        assert usable_prefix(present, policies) == naive(present, policies), (
            trial,
            present,
            policies,
        )


def test_policy_validates_and_reads_well() -> None:
    with pytest.raises(ValueError, match="n >= 1"):
        TRAILING_PAGES(0)
    assert repr(ALL_PAGES) == "ALL_PAGES" and repr(TRAILING_PAGES(3)) == "TRAILING_PAGES(3)"
