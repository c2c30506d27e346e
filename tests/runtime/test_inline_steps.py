"""``InlineSteps``: a kernel-path load's steps issued by its waiters, ``ahead`` past each wait,
the rest when the load is acknowledged (``done``), each step exactly once and in order; and the
load's time, summed over its runs of steps."""

from __future__ import annotations

import pytest

from kvtier.runtime.controller import CacheController, InlineSteps, TransferStats, _Op


def _steps(total: int, issued: int, ahead: int) -> tuple[InlineSteps, list[tuple[int, int]]]:
    calls: list[tuple[int, int]] = []
    return InlineSteps(lambda a, b: calls.append((a, b)), total, issued, ahead), calls


def _flat(calls: list[tuple[int, int]]) -> list[int]:
    return [i for a, b in calls for i in range(a, b)]


@pytest.mark.parametrize("ahead", [1, 2, 5])
def test_waits_issue_ahead_in_order_exactly_once(ahead: int) -> None:
    total = 12
    steps, calls = _steps(total, 1 + ahead, ahead)
    for layer in range(total):
        steps.wait(layer + 1)  # wait_layer(layer)
        issued = 1 + ahead + len(_flat(calls))
        assert issued == min(total, layer + 1 + ahead)  # never more than ahead past the wait
    assert _flat(calls) == list(range(1 + ahead, total))  # each step once, in order
    assert steps.done()
    assert _flat(calls) == list(range(1 + ahead, total))  # done() had nothing left to issue


def test_done_issues_the_rest_for_a_load_nobody_waits_on() -> None:
    steps, calls = _steps(8, 3, 2)
    steps.wait(2)  # up to 4
    assert steps.done()
    assert _flat(calls) == list(range(3, 8))
    steps.wait()
    steps.wait(3)
    assert _flat(calls) == list(range(3, 8))  # nothing twice


def test_wait_for_all_and_out_of_order_waits() -> None:
    steps, calls = _steps(10, 2, 1)
    steps.wait(6)
    steps.wait(3)  # an earlier step: already issued, nothing happens
    assert _flat(calls) == list(range(2, 7))
    steps.wait()
    assert _flat(calls) == list(range(2, 10))


def test_a_failing_issue_fails_every_later_wait() -> None:
    calls: list[tuple[int, int]] = []

    def issue(a: int, b: int) -> None:
        calls.append((a, b))
        raise RuntimeError("launch failed")

    steps = InlineSteps(issue, 6, 2, 1)
    with pytest.raises(RuntimeError, match="could not be enqueued") as e:
        steps.wait(2)
    assert "launch failed" in str(e.value.__cause__)
    for again in (lambda: steps.wait(1), steps.done, steps.wait):  # every later wait fails too
        with pytest.raises(RuntimeError, match="could not be enqueued"):
            again()
    assert calls == [(2, 3)]  # never retried behind the waiter's back


class _At:
    """A stand-in for a timed CUDA event: recorded at ``t`` ms of the stream's clock."""

    def __init__(self, t: float) -> None:
        self.t = t

    def elapsed_time(self, end: _At) -> float:
        return end.t - self.t

    def synchronize(self) -> None:
        pass


def test_a_load_is_timed_over_its_runs_of_steps() -> None:
    """Steps 0-2 issued at start (copies 0-3 ms), step 3 and steps 4-5 later as the forward
    waits (10-11 ms, 20-22 ms): 6 ms of copying, not the 22 ms from first to last."""
    layer_events = [_At(t) for t in (1, 2, 3, 11, 21, 22)]
    starts = [(0, _At(0)), (3, _At(10)), (4, _At(20))]
    op = _Op("load", [], layer_events[-1], starts=starts, nbytes=6, layer_events=layer_events)
    ctl = CacheController.__new__(CacheController)
    ctl.stats = TransferStats()
    ctl._time(op, "h2d")
    assert ctl.stats.h2d_seconds == pytest.approx(6e-3)
    assert ctl.stats.h2d_timed_bytes == 6
