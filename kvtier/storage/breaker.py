"""A circuit breaker and a retry budget for calls to a remote store, backend-agnostic.

``CircuitBreaker`` stops calling a store that keeps failing to answer, so that callers fail in
microseconds instead of each waiting out the client's own connection timeout:

=========== ================================================ =====================================
state       ``admit()``                                      leaves when
=========== ================================================ =====================================
closed      every call                                       ``failure_threshold`` consecutive
                                                             failures: open
open        none (``None``: short-circuited)                 the cooldown has passed: the next
                                                             ``admit()`` is the probe (half-open)
half_open   none while the one probe is in flight            the probe's result: closed on
                                                             success (cooldown back to its base),
                                                             open on failure (cooldown doubled,
                                                             up to the cap)
=========== ================================================ =====================================

Only failures of the store to answer (connection or transport errors) count as failures; a call
the store answered, even with a per-key miss, is a success. Results of calls admitted before the
breaker last changed state are stale and move nothing, so a slow call from before an outage can
neither close an open breaker nor re-open one a probe has just closed.

``Backoff`` spaces out the attempts of one operation (exponential, jittered) within a total time
budget ``RetryPolicy.budget_s``.

Both take the clock as an argument, so tests drive them with a fake clock and no sleeps.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

from kvtier.metrics import BreakerEvent, BreakerState

__all__ = [
    "Backoff",
    "BreakerEvent",
    "BreakerState",
    "BreakerStats",
    "CircuitBreaker",
    "RetryPolicy",
    "Ticket",
]

Clock = Callable[[], float]


class Ticket(NamedTuple):
    """An admitted call; hand it back to ``CircuitBreaker.record`` with the call's result."""

    probe: bool  # this call is the half-open probe
    epoch: int  # the breaker's state epoch at admission (results from older epochs are stale)


class BreakerStats(NamedTuple):
    state: BreakerState
    consecutive_failures: int
    cooldown_s: float  # the current (open) or next cooldown
    opens: int
    probes: int
    short_circuited: int
    recoveries: int


class CircuitBreaker:
    """Closed / open / half-open breaker; thread-safe.

    Args:
        failure_threshold: consecutive failures that open a closed breaker (>= 1).
        cooldown_s: time an opened breaker refuses calls before it lets one probe through (> 0).
        max_cooldown_s: cap of the cooldown, which doubles after each failed probe
            (>= ``cooldown_s``).
        clock: monotonic seconds.
        on_event: called with each event and the state after it, under the breaker's lock (so
            in order); it must be quick and must not call back into the breaker.
    """

    def __init__(
        self,
        failure_threshold: int = 3,
        cooldown_s: float = 0.5,
        max_cooldown_s: float = 8.0,
        *,
        clock: Clock = time.monotonic,
        on_event: Callable[[BreakerEvent, BreakerState], None] | None = None,
    ) -> None:
        if isinstance(failure_threshold, bool) or not isinstance(failure_threshold, int):
            raise TypeError(f"failure_threshold must be an int, got {failure_threshold!r}")
        if failure_threshold < 1:
            raise ValueError(f"failure_threshold must be >= 1, got {failure_threshold}")
        _check_seconds("cooldown_s", cooldown_s, positive=True)
        _check_seconds("max_cooldown_s", max_cooldown_s, positive=True)
        if max_cooldown_s < cooldown_s:
            raise ValueError(
                f"max_cooldown_s must be >= cooldown_s ({cooldown_s}), got {max_cooldown_s!r}"
            )
        self.failure_threshold = failure_threshold
        self.base_cooldown_s = float(cooldown_s)
        self.max_cooldown_s = float(max_cooldown_s)
        self._clock = clock
        self._on_event = on_event
        self._mutex = threading.Lock()
        self._state = BreakerState.CLOSED
        self._epoch = 0
        self._failures = 0
        self._failing_since: float | None = None
        self._opened_at = 0.0
        self._cooldown = self.base_cooldown_s
        self._opens = self._probes = self._short_circuited = self._recoveries = 0

    @property
    def state(self) -> BreakerState:
        with self._mutex:
            return self._state

    @property
    def failing_since(self) -> float | None:
        """Clock time of the first failure of the current run of failures; None after a success.

        It spans the whole outage: it is kept while the breaker is open and cleared when a probe
        (or, while closed, any call) succeeds.
        """
        with self._mutex:
            return self._failing_since

    def stats(self) -> BreakerStats:
        with self._mutex:
            return BreakerStats(
                self._state,
                self._failures,
                self._cooldown,
                self._opens,
                self._probes,
                self._short_circuited,
                self._recoveries,
            )

    def admit(self) -> Ticket | None:
        """A ticket for a call that may go to the store, or None: fail it without calling.

        Every ticket must go back to ``record`` exactly once (use ``try``/``finally``): a probe
        that is never recorded leaves the breaker half-open, refusing every call.
        """
        with self._mutex:
            if self._state is BreakerState.CLOSED:
                return Ticket(False, self._epoch)
            if (
                self._state is BreakerState.OPEN
                and self._clock() >= self._opened_at + self._cooldown
            ):
                self._move(BreakerState.HALF_OPEN)
                self._probes += 1
                self._emit(BreakerEvent.PROBE)
                return Ticket(True, self._epoch)
            self._short_circuited += 1
            self._emit(BreakerEvent.SHORT_CIRCUITED)
            return None

    def record(self, ticket: Ticket, ok: bool) -> None:
        """The result of an admitted call: ``ok`` unless the store failed to answer."""
        with self._mutex:
            if ticket.epoch != self._epoch:
                return  # admitted before the last state change: says nothing about now
            now = self._clock()
            if ticket.probe:
                if ok:
                    self._failures, self._failing_since = 0, None
                    self._cooldown = self.base_cooldown_s
                    self._recoveries += 1
                    self._move(BreakerState.CLOSED)
                    self._emit(BreakerEvent.RECOVERED)
                else:
                    self._failures += 1
                    self._cooldown = min(2 * self._cooldown, self.max_cooldown_s)
                    self._open(now)
                return
            if ok:
                self._failures, self._failing_since = 0, None
                return
            self._failures += 1
            if self._failing_since is None:
                self._failing_since = now
            if self._failures >= self.failure_threshold:
                self._cooldown = self.base_cooldown_s
                self._open(now)

    # -- under the lock -------------------------------------------------------------------------

    def _open(self, now: float) -> None:
        self._opened_at = now
        self._opens += 1
        self._move(BreakerState.OPEN)
        self._emit(BreakerEvent.OPENED)

    def _move(self, state: BreakerState) -> None:
        self._state = state
        self._epoch += 1

    def _emit(self, event: BreakerEvent) -> None:
        if self._on_event is not None:
            self._on_event(event, self._state)


@dataclass(frozen=True)
class RetryPolicy:
    """Attempts of one operation: exponential backoff with jitter, within a time budget.

    Attributes:
        budget_s: total time from the start (see ``Backoff``) after which no attempt begins;
            0 disables retries.
        first_delay_s: base of the delay before the first retry (> 0).
        max_delay_s: cap of the base delay, which doubles after each retry (>= first_delay_s).
    """

    budget_s: float = 5.0
    first_delay_s: float = 0.05
    max_delay_s: float = 1.0

    def __post_init__(self) -> None:
        _check_seconds("budget_s", self.budget_s, positive=False)
        _check_seconds("first_delay_s", self.first_delay_s, positive=True)
        _check_seconds("max_delay_s", self.max_delay_s, positive=True)
        if self.max_delay_s < self.first_delay_s:
            raise ValueError(
                f"max_delay_s must be >= first_delay_s ({self.first_delay_s}), "
                f"got {self.max_delay_s!r}"
            )


class Backoff:
    """The delays between the attempts of one operation under ``policy``.

    Retry ``k`` (from 0) waits a delay drawn uniformly from ``[d/2, d]``, where
    ``d = min(max_delay_s, first_delay_s * 2**k)``: the jitter keeps callers that failed together
    from retrying together. The budget runs from ``since`` (default: now); a caller that knows the
    store has been failing for a while passes the time it started failing, so an outage longer
    than the budget is not waited out again by every operation.

    Args:
        policy: the budget and delays.
        since: clock time the budget runs from; default now.
        clock: monotonic seconds.
        rng: the jitter's random source (seed it in tests).
    """

    def __init__(
        self,
        policy: RetryPolicy,
        *,
        since: float | None = None,
        clock: Clock = time.monotonic,
        rng: random.Random | None = None,
    ) -> None:
        self.policy = policy
        self._clock = clock
        self._rng = rng or random.Random()
        self.deadline = (clock() if since is None else since) + policy.budget_s
        self.retries = 0

    def next_delay(self) -> float | None:
        """Seconds to wait before the next attempt, or None: the budget is spent, give up.

        The last delay is cut short at the deadline, so the final attempt starts at the latest
        there.
        """
        remaining = self.deadline - self._clock()
        if remaining <= 0:
            return None
        base = min(self.policy.max_delay_s, self.policy.first_delay_s * 2.0**self.retries)
        self.retries += 1
        return min(remaining, base * (0.5 + 0.5 * self._rng.random()))


def _check_seconds(name: str, value: object, *, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a number of seconds, got {value!r}")
    if not (value > 0 if positive else value >= 0) or value == float("inf"):
        bound = "> 0" if positive else ">= 0"
        raise ValueError(f"{name} must be finite and {bound}, got {value!r}")
