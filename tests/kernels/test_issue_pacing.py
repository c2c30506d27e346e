"""Paced issue tickets: the worker enqueues a step only once a waiter has allowed it (or stops
pacing after ``pace_s`` where nobody waits step by step); waiters never block for good."""

from __future__ import annotations

import threading

import pytest

from kvtier.kernels.copier import IssueWorker, Ticket

BOUND_S = 10.0  # a job that takes longer than this is stuck, not slow


def _paced_job(log: list[tuple[int, int]], finished: threading.Event, waited=None):
    """A job that records, per step, the allowance it was enqueued under (and in ``waited``,
    what ``gate`` said: whether it had to wait)."""

    def job(ticket: Ticket, first: int = 0) -> None:
        for i in range(first, ticket.steps):
            w = ticket.gate(i)
            if waited is not None:
                waited.append(w)
            with ticket._cond:
                log.append((i, ticket._allowed))
            ticket.advance()
        finished.set()

    return job


@pytest.mark.parametrize(("done", "ahead"), [(0, 1), (0, 2), (1, 2), (1, 5)])
def test_steps_are_enqueued_only_ahead_of_the_waits(done: int, ahead: int) -> None:
    steps = 12
    log: list[tuple[int, int]] = []
    finished = threading.Event()
    ticket = Ticket(steps, done, ahead=ahead, pace_s=BOUND_S)  # only waits move it on here
    job = _paced_job(log, finished)
    threading.Thread(target=job, args=(ticket, done), daemon=True).start()
    for step in range(done, steps):
        ticket.wait(step + 1)  # like wait_layer(step): returns once step is enqueued
        with ticket._cond:
            assert ticket._done <= min(steps, step + 1 + ahead)
    assert finished.wait(BOUND_S)
    assert [i for i, _ in log] == list(range(done, steps))
    assert all(i < allowed for i, allowed in log), log  # never enqueued before allowed


def test_a_ticket_nobody_waits_on_stops_pacing() -> None:
    log: list[tuple[int, int]] = []
    finished = threading.Event()
    waited: list[bool] = []
    ticket = Ticket(8, 0, ahead=1, pace_s=0.005)
    job = _paced_job(log, finished, waited)
    threading.Thread(target=job, args=(ticket,), daemon=True).start()
    assert finished.wait(BOUND_S)  # the first gate gives up, then every step goes at once
    assert [i for i, _ in log] == list(range(8))
    assert [a for _, a in log] == [2, 2] + [8] * 6  # the first step and one ahead, then all
    # Only the step that waited says so (the controller starts a new timed run there).
    assert waited == [False, False, True] + [False] * 5
    ticket.wait()
    assert ticket.done()


def test_worker_submits_paced_tickets() -> None:
    """``IssueWorker.submit(..., ahead=)`` hands the job a paced ticket: waits move it on."""
    log: list[tuple[int, int]] = []
    finished = threading.Event()
    ticket = IssueWorker("test-issue").submit(_paced_job(log, finished), 5, ahead=2)
    assert ticket._ahead == 2
    ticket.wait()
    assert finished.wait(BOUND_S)
    assert [i for i, _ in log] == list(range(5))


def test_an_unpaced_ticket_never_gates() -> None:
    ticket = Ticket(4, 1)
    for i in range(4):
        assert not ticket.gate(i)  # returns at once: everything is allowed
    assert ticket._allowed == 4


def test_waiting_for_all_allows_all() -> None:
    log: list[tuple[int, int]] = []
    finished = threading.Event()
    ticket = Ticket(6, 0, ahead=1, pace_s=BOUND_S)
    threading.Thread(target=_paced_job(log, finished), args=(ticket,), daemon=True).start()
    ticket.wait()
    assert finished.wait(BOUND_S)
    assert [i for i, _ in log] == list(range(6))


def test_a_job_queued_behind_a_paced_one_ends_its_pacing() -> None:
    """A paced load must not hold up what the worker runs next (a later batch's load, a
    backup): submitting another job lets the running one enqueue the rest at once."""
    worker = IssueWorker("test-issue")
    first_log: list[tuple[int, int]] = []
    first_done, second_done = threading.Event(), threading.Event()
    # Only the queued job may end its pacing: no gate gives up within the test's bound.
    first = worker.submit(_paced_job(first_log, first_done), 10, ahead=1, pace_s=BOUND_S)
    first.wait(1)  # the job runs and is held at its gate (nobody waits further)
    second = worker.submit(_paced_job([], second_done), 3)
    assert first_done.wait(BOUND_S), "the paced job was not released by the queued one"
    assert second_done.wait(BOUND_S)
    assert [i for i, _ in first_log] == list(range(10))
    second.wait()


@pytest.mark.parametrize("ahead", [1, 2])
def test_a_held_ticket_enqueues_nothing_before_the_first_wait(ahead: int) -> None:
    """``hold``: the worker's first step waits for the forward pass's first wait (its launches
    go first), then it runs ``ahead`` steps past each wait as a paced ticket does."""
    steps, done = 8, 1
    log: list[tuple[int, int]] = []
    waited: list[bool] = []
    finished, gating = threading.Event(), threading.Event()
    ticket = Ticket(steps, done, ahead=ahead, pace_s=BOUND_S, hold=True)
    assert ticket._allowed == done
    gate = ticket.gate

    def first_gate(step: int) -> bool:
        gating.set()
        return gate(step)

    ticket.gate = first_gate  # type: ignore[method-assign]
    threading.Thread(
        target=_paced_job(log, finished, waited), args=(ticket, done), daemon=True
    ).start()
    assert gating.wait(BOUND_S)  # the job is at its first gate before the first wait
    with ticket._cond:
        assert ticket._done == done
    for step in range(done, steps):
        ticket.wait(step + 1)  # wait_layer(0) first: step 0 was the caller's
        with ticket._cond:
            assert ticket._done <= min(steps, step + 1 + ahead)
    assert finished.wait(BOUND_S)
    assert [i for i, _ in log] == list(range(done, steps))
    assert all(i < allowed for i, allowed in log), log
    assert waited[0]  # it was held: the first gate had to wait for the wait


def test_an_unheld_ticket_does_not_wait_for_the_first_wait() -> None:
    """The control of the test above: without ``hold`` the first gate passes at once."""
    ticket = Ticket(8, 1, ahead=2, pace_s=BOUND_S)
    assert not ticket.gate(1) and not ticket.gate(2)


def test_a_held_ticket_nobody_waits_on_stops_holding() -> None:
    finished = threading.Event()
    log: list[tuple[int, int]] = []
    ticket = Ticket(5, 1, ahead=2, pace_s=0.005, hold=True)
    threading.Thread(target=_paced_job(log, finished), args=(ticket, 1), daemon=True).start()
    assert finished.wait(BOUND_S)  # the first gate gives up after pace_s, then all at once
    assert [a for _, a in log] == [5] * 4
