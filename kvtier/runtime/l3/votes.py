"""The L3 tier's agreed vector: laid out and read back in one place.

Each ``poll`` adds one fixed-size int64 vector to the controller's single all-reduce (MIN). Its
length never depends on local state, so every rank's collective has the same shape:

    [0]                 backup jobs finished (FIFO prefix)      -> unpin that many jobs
    [1]                 terminated prefetches whose IO stopped  -> release their leftover slots
    [2 + 2i, 3 + 2i]    query i (oldest QUERY_SLOTS): hit pages or -1 if not back, worth loading
    [2 + 2Q + 4j ...]   load j (oldest LOAD_SLOTS): may terminate, completed pages, SWA pages,
                        Mamba state                             -> terminate and commit

A value a rank has not got yet is -1 (or 0 for a vote), so MIN waits for the slowest rank.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

__all__ = [
    "LOAD_SLOTS",
    "QUERY_SLOTS",
    "VECTOR_LEN",
    "LoadVote",
    "QueryVote",
    "Votes",
    "decode",
    "encode",
]

QUERY_SLOTS = 4
LOAD_SLOTS = 4
VECTOR_LEN = 2 + 2 * QUERY_SLOTS + 4 * LOAD_SLOTS


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
    return torch.tensor(v, dtype=torch.int64)


def decode(v: torch.Tensor, n_queries: int, n_loads: int) -> Votes:
    """The agreed values of the first ``n_queries`` queries and ``n_loads`` loads."""
    vals = v.tolist()
    queries = [QueryVote(vals[2 + 2 * i], bool(vals[3 + 2 * i])) for i in range(n_queries)]
    base = 2 + 2 * QUERY_SLOTS
    loads = [
        LoadVote(bool(vals[base + 4 * j]), *vals[base + 4 * j + 1 : base + 4 * j + 4])
        for j in range(n_loads)
    ]
    return Votes(vals[0], vals[1], queries, loads)
