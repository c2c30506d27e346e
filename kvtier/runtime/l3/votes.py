"""The vector every ``poll`` agrees on: laid out and read back in one place.

Each ``poll`` adds one fixed-size int64 vector to the controller's single all-reduce (MIN). Its
length never depends on local state (nor on whether L3 is attached), so every rank's collective
has the same shape. It is a control header and then the L3 tier's votes:

    control (CONTROL_LEN)
    [0]                 storage changes asked for so far        -> MIN > applied: every rank
                        (applied + 1 while one is pending)          asked, apply it now
    [1], [2]            the pending change's kind, and minus it  -> MIN, -MAX: ranks asked alike?
    [3]                 the pending change's argument (ms)       -> MIN (graceful detach timeout)
    [4]                 this rank's clock (ms since the cache    -> MIN: the agreed "now" (retention
                        was built)                                  expiry, detach deadlines)
    [5], [6]            calls that change the books so far       -> MIN, -MAX: every rank made
                        (requests matched, copies issued,           the same calls? (else every
                        retention pins), and minus it               rank raises at this poll)
    [7], [8]            the config's books digest, and minus it  -> MIN, -MAX: the same config
                        (``CacheConfig.books_digest``)             on every rank? (else raises)
    L3 votes (VECTOR_LEN; zeros while no L3 is attached, on every rank alike)
    [0]                 backup jobs finished (FIFO prefix)      -> unpin that many jobs
    [1]                 terminated prefetches whose IO stopped  -> release their leftover slots
    [2 + 2i, 3 + 2i]    query i (oldest QUERY_SLOTS): hit pages or -1 if not back, worth loading
    [2 + 2Q + 4j ...]   load j (oldest LOAD_SLOTS): may terminate, completed pages, SWA pages,
                        Mamba state                             -> terminate and commit
    [last]              backup jobs finished with every page    -> remember those jobs' pages as
                        in L3 (FIFO prefix; a rank that writes     stored (skipped by later
                        nothing counts each finished job)          backups) on every rank alike

A value a rank has not got yet is -1 (or 0 for a vote), so MIN waits for the slowest rank.
Without TP nothing is reduced: the vector is then the L3 votes alone, and the control header
stays with its one reader (``attach.StorageSwitch``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "CONTROL_LEN",
    "LOAD_SLOTS",
    "QUERY_SLOTS",
    "VECTOR_LEN",
    "Control",
    "LoadVote",
    "QueryVote",
    "Votes",
    "decode",
    "decode_control",
    "encode",
    "encode_poll",
    "l3_part",
]

QUERY_SLOTS = 4
LOAD_SLOTS = 4
VECTOR_LEN = 2 + 2 * QUERY_SLOTS + 4 * LOAD_SLOTS + 1
CONTROL_LEN = 9


class Control(NamedTuple):
    """One rank's (or, after the all-reduce, the agreed) control header.

    ``kind``/``neg_kind`` are the pending change's kind and minus it: after MIN they are the
    least and minus the greatest kind over ranks, equal (up to sign) only if every rank asked
    for the same change.
    """

    changes: int
    kind: int
    neg_kind: int
    arg_ms: int
    clock_ms: int
    calls: int = 0
    neg_calls: int = 0
    config: int = 0
    neg_config: int = 0

    @property
    def kinds_agree(self) -> bool:
        return self.kind == -self.neg_kind

    @property
    def in_step(self) -> bool:
        """Every rank made the same number of book-changing calls before this poll (each
        rank's n-th poll meets the others' n-th, so an extra poll shows here too: the calls
        made before it differ)."""
        return self.calls == -self.neg_calls and self.config == -self.neg_config


class QueryVote(NamedTuple):
    """A prefetch's existence query: hit pages (-1: not back yet) and whether loading is worth it."""

    hits: int
    worth: bool


class LoadVote(NamedTuple):
    """A loading prefetch: may it terminate, and what arrived."""

    can_terminate: bool
    completed_pages: int
    swa_pages: int
    mamba_state: int


class Votes(NamedTuple):
    """One rank's (or, after the all-reduce, the agreed) values."""

    backups_done: int
    drained: int
    queries: list[QueryVote]  # at most QUERY_SLOTS
    loads: list[LoadVote]  # at most LOAD_SLOTS
    backups_stored: int = 0  # of ``backups_done``, the leading jobs whose pages all reached L3


def encode(votes: Votes) -> torch.Tensor:
    """The fixed-size vector of ``votes`` (missing queries and loads are padded)."""
    if len(votes.queries) > QUERY_SLOTS or len(votes.loads) > LOAD_SLOTS:
        raise ValueError(f"votes: at most {QUERY_SLOTS} queries and {LOAD_SLOTS} loads")
    v = [votes.backups_done, votes.drained]
    for i in range(QUERY_SLOTS):
        q = votes.queries[i] if i < len(votes.queries) else QueryVote(0, False)
        v += [q.hits, int(q.worth)]
    for j in range(LOAD_SLOTS):
        ld = votes.loads[j] if j < len(votes.loads) else LoadVote(False, 0, 0, 0)
        v += [int(ld.can_terminate), ld.completed_pages, ld.swa_pages, ld.mamba_state]
    v.append(votes.backups_stored)
    return torch.tensor(v, dtype=torch.int64)


def encode_poll(control: Control, l3_votes: torch.Tensor | None) -> torch.Tensor:
    """The whole poll vector: ``control`` then ``l3_votes`` (``encode``), or zeros without L3."""
    if l3_votes is None:
        l3_votes = torch.zeros(VECTOR_LEN, dtype=torch.int64)
    if l3_votes.shape != (VECTOR_LEN,):
        raise ValueError(f"l3_votes: expected {VECTOR_LEN} values, got {tuple(l3_votes.shape)}")
    return torch.cat([torch.tensor(list(control), dtype=torch.int64), l3_votes])


def decode_control(v: torch.Tensor) -> Control:
    """The control header of a poll vector."""
    return Control(*v[:CONTROL_LEN].tolist())


def l3_part(v: torch.Tensor) -> torch.Tensor:
    """The L3 votes of a poll vector (a view)."""
    return v[CONTROL_LEN:]


def decode(v: torch.Tensor, n_queries: int, n_loads: int) -> Votes:
    """The agreed values of the first ``n_queries`` queries and ``n_loads`` loads (of the L3
    part of a poll vector, ``l3_part``)."""
    vals = v.tolist()
    queries = [QueryVote(vals[2 + 2 * i], bool(vals[3 + 2 * i])) for i in range(n_queries)]
    base = 2 + 2 * QUERY_SLOTS
    loads = [
        LoadVote(bool(vals[base + 4 * j]), *vals[base + 4 * j + 1 : base + 4 * j + 4])
        for j in range(n_loads)
    ]
    return Votes(vals[0], vals[1], queries, loads, vals[-1])
