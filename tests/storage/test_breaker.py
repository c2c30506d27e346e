"""The circuit breaker and the retry backoff, on a fake clock: no sleeps, no store."""

from __future__ import annotations

import random
import threading

import pytest

from kvtier.metrics import TierMetrics
from kvtier.storage.breaker import (
    Backoff,
    BreakerEvent,
    BreakerState,
    CircuitBreaker,
    RetryPolicy,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def failing_calls(breaker: CircuitBreaker, n: int) -> None:
    """``n`` admitted calls whose store did not answer."""
    for i in range(n):
        ticket = breaker.admit()
        assert ticket is not None and not ticket.probe, f"call {i} of {n} was not admitted"
        breaker.record(ticket, False)


def make(clock: FakeClock, events: list | None = None, **kw) -> CircuitBreaker:
    on_event = None if events is None else (lambda e, s: events.append((e, s)))
    return CircuitBreaker(
        **{"failure_threshold": 3, "cooldown_s": 1.0, "max_cooldown_s": 4.0, **kw},
        clock=clock,
        on_event=on_event,
    )


def test_opens_after_n_consecutive_failures_only() -> None:
    clock = FakeClock()
    b = make(clock)
    failing_calls(b, 2)
    ticket = b.admit()
    b.record(ticket, True)  # an answer (a hit or a miss) ends the run of failures
    assert b.state is BreakerState.CLOSED and b.failing_since is None
    failing_calls(b, 2)
    assert b.state is BreakerState.CLOSED and b.failing_since == clock.now
    clock.now += 3.0
    failing_calls(b, 1)
    assert b.state is BreakerState.OPEN
    assert b.failing_since == clock.now - 3.0, "the outage started at the run's first failure"
    assert b.stats().opens == 1


def test_fails_fast_while_open_and_reports_events() -> None:
    clock = FakeClock()
    events: list[tuple[BreakerEvent, BreakerState]] = []
    b = make(clock, events)
    failing_calls(b, 3)
    clock.now += 0.999
    assert [b.admit() for _ in range(5)] == [None] * 5
    assert b.stats().short_circuited == 5
    assert (
        events
        == [(BreakerEvent.OPENED, BreakerState.OPEN)]
        + [(BreakerEvent.SHORT_CIRCUITED, BreakerState.OPEN)] * 5
    )


def test_one_probe_in_half_open() -> None:
    clock = FakeClock()
    b = make(clock)
    failing_calls(b, 3)
    clock.now += 1.0
    probe = b.admit()
    assert probe is not None and probe.probe
    assert b.state is BreakerState.HALF_OPEN
    assert [b.admit() for _ in range(3)] == [None] * 3, "only one probe while it is in flight"
    clock.now += 100.0
    assert b.admit() is None, "however long the probe takes"
    b.record(probe, True)
    s = b.stats()
    assert s.state is BreakerState.CLOSED and s.probes == 1 and s.recoveries == 1
    assert s.short_circuited == 4 and b.failing_since is None
    ticket = b.admit()
    assert ticket is not None and not ticket.probe


def test_cooldown_doubles_caps_and_resets() -> None:
    clock = FakeClock()
    b = make(clock, cooldown_s=1.0, max_cooldown_s=5.0)
    failing_calls(b, 3)
    waits = []
    for _ in range(5):  # failed probes: cooldowns 2, 4, 5, 5, 5 after the first 1
        waits.append(b.stats().cooldown_s)
        clock.now += b.stats().cooldown_s - 0.001
        assert b.admit() is None, "no probe before the cooldown has passed"
        clock.now += 0.001
        probe = b.admit()
        assert probe is not None and probe.probe
        b.record(probe, False)
        assert b.state is BreakerState.OPEN
    assert waits == [1.0, 2.0, 4.0, 5.0, 5.0]
    assert b.stats().opens == 6
    clock.now += 5.0
    probe = b.admit()
    b.record(probe, True)
    assert b.stats().cooldown_s == 1.0, "a success resets the cooldown"
    failing_calls(b, 3)
    clock.now += 1.0
    assert b.admit().probe, "the next outage starts from the base cooldown"


def test_stale_results_move_nothing() -> None:
    clock = FakeClock()
    b = make(clock)
    slow = b.admit()  # a call in flight when the store goes away
    failing_calls(b, 3)
    b.record(slow, True)
    assert b.state is BreakerState.OPEN, "a call admitted before the outage does not close it"
    clock.now += 1.0
    probe = b.admit()
    b.record(probe, True)
    late = [b.admit() for _ in range(3)]
    old = slow._replace(epoch=probe.epoch)  # a failure from the half-open epoch
    b.record(old, False)
    assert b.stats().consecutive_failures == 0
    for t in late:
        b.record(t, False)
    assert b.state is BreakerState.OPEN, "fresh failures after recovery still count"


def test_bad_arguments_name_the_argument() -> None:
    with pytest.raises(ValueError, match="failure_threshold"):
        CircuitBreaker(0)
    with pytest.raises(TypeError, match="failure_threshold"):
        CircuitBreaker(True)
    with pytest.raises(ValueError, match="cooldown_s"):
        CircuitBreaker(3, 0.0)
    with pytest.raises(TypeError, match="cooldown_s"):
        CircuitBreaker(3, "1")
    with pytest.raises(ValueError, match="max_cooldown_s"):
        CircuitBreaker(3, 2.0, 1.0)
    with pytest.raises(ValueError, match="budget_s"):
        RetryPolicy(budget_s=-1.0)
    with pytest.raises(ValueError, match="budget_s"):
        RetryPolicy(budget_s=float("nan"))
    with pytest.raises(ValueError, match="max_delay_s"):
        RetryPolicy(first_delay_s=1.0, max_delay_s=0.5)


def test_threads_share_one_breaker() -> None:
    """Many threads: one open, one probe per half-open period, every call accounted for."""
    clock = FakeClock()
    b = make(clock, failure_threshold=5, cooldown_s=1.0, max_cooldown_s=1.0)
    threads, calls = 8, 400
    admitted = [0] * threads
    probes: list[int] = []
    start = threading.Barrier(threads)

    def worker(k: int) -> None:
        start.wait()
        for _ in range(calls):
            ticket = b.admit()
            if ticket is None:
                continue
            admitted[k] += 1
            if ticket.probe:
                probes.append(k)
            b.record(ticket, False)

    pool = [threading.Thread(target=worker, args=(k,)) for k in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    s = b.stats()
    assert s.state is BreakerState.OPEN and s.opens == 1 and not probes
    assert sum(admitted) + s.short_circuited == threads * calls
    assert 5 <= sum(admitted) <= 5 + threads - 1, "only calls admitted before it opened"

    # The cooldown has passed and every thread asks at once: exactly one becomes the probe.
    clock.now += 1.0
    start.reset()
    got: list[object] = []

    def racer() -> None:
        start.wait()
        got.append(b.admit())

    pool = [threading.Thread(target=racer) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    winners = [t for t in got if t is not None]
    assert len(winners) == 1 and winners[0].probe, got
    assert b.stats().probes == 1 and b.stats().short_circuited == s.short_circuited + threads - 1


def test_backoff_grows_with_jitter_and_caps() -> None:
    clock = FakeClock()
    policy = RetryPolicy(budget_s=100.0, first_delay_s=0.1, max_delay_s=0.8)
    backoff = Backoff(policy, clock=clock, rng=random.Random(7))
    for k in range(8):
        base = min(0.8, 0.1 * 2**k)
        delay = backoff.next_delay()
        assert base / 2 <= delay <= base, (k, delay, base)
    delays = [Backoff(policy, clock=clock, rng=random.Random(s)).next_delay() for s in range(20)]
    assert len(set(delays)) > 1, "jitter spreads callers that failed together"


def test_backoff_stays_within_its_budget() -> None:
    clock = FakeClock()
    policy = RetryPolicy(budget_s=2.0, first_delay_s=0.1, max_delay_s=0.5)
    start = clock.now
    backoff = Backoff(policy, clock=clock, rng=random.Random(1))
    attempts = 1
    while (delay := backoff.next_delay()) is not None:
        clock.now += delay
        attempts += 1
    assert clock.now == pytest.approx(start + 2.0), "the last attempt starts at the deadline"
    assert attempts == backoff.retries + 1 and attempts >= 5
    assert backoff.next_delay() is None


def test_backoff_budget_runs_from_since() -> None:
    clock = FakeClock()
    policy = RetryPolicy(budget_s=2.0)
    assert Backoff(policy, since=clock.now - 2.0, clock=clock).next_delay() is None
    late = Backoff(policy, since=clock.now - 1.9, clock=clock).next_delay()
    assert late is not None and late <= 0.1 + 1e-9
    assert Backoff(RetryPolicy(budget_s=0.0), clock=clock).next_delay() is None


def test_breaker_state_in_metrics() -> None:
    m = TierMetrics()
    clock = FakeClock()
    b = CircuitBreaker(1, 1.0, 1.0, clock=clock, on_event=m.record_breaker)
    failing_calls(b, 1)
    b.admit()
    s = m.snapshot()
    assert s["breaker.opened"] == 1 and s["breaker.short_circuited"] == 1
    assert s["breaker.state.open"] == 1 and s["breaker.state.closed"] == 0
    clock.now += 1.0
    b.record(b.admit(), True)
    s = m.snapshot()
    assert s["breaker.probe"] == 1 and s["breaker.recovered"] == 1
    states = (s["breaker.state.closed"], s["breaker.state.open"], s["breaker.state.half_open"])
    assert states == (1, 0, 0)
    m.add_retried_pages(3)
    text = m.prometheus()
    assert 'kvtier_storage_breaker_state{state="closed"} 1' in text
    assert 'kvtier_storage_breaker_events_total{event="opened"} 1' in text
    assert "kvtier_storage_retried_pages_total 3" in text


@pytest.mark.parametrize(
    "field,value",
    [
        ("breaker_failures", 0),
        ("breaker_failures", 2.0),
        ("breaker_cooldown_s", 0),
        ("breaker_max_cooldown_s", 0.1),
        ("breaker_max_cooldown_s", float("inf")),
        ("probe_timeout_s", "1"),
        ("write_retry_budget_s", -1.0),
    ],
)
def test_mooncake_config_refuses_bad_breaker_settings(field: str, value: object) -> None:
    from kvtier.storage.mooncake_backend import MooncakeConfig  # no client: nothing connects

    with pytest.raises(ValueError, match=field):
        MooncakeConfig("127.0.0.1:1", **{field: value})
