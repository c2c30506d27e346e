"""Which pages a router is told reached L3: announced when the tier acknowledges a backup job,
and under TP only once every rank stored its part of it (agreed at the poll). Rank 0 used to
announce its own shard's pages from its writer thread while another rank's writes failed, so
a router sent requests for prefixes no rank could read back (a TP trial)."""

from __future__ import annotations

import pytest

from kvtier.storage import PoolTransfer, create_backend
from tests.runtime.l3.helpers import conversations, make_l3_cache
from tests.runtime.synthetic import run_turn


class Sink:
    """What the tier tells the events sink about stored pages."""

    def __init__(self) -> None:
        self.stored: set = set()

    def storage_stored(self, stored) -> None:
        self.stored |= set(stored)


def _cache(tmp_path, fail_every: int | None):
    backend = create_backend("file", root=tmp_path)
    if fail_every:
        write = backend._write

        def some_fail(keys, pages):  # every ``fail_every``-th page of a batch is not stored
            ok = write(keys, pages)
            return [good and i % fail_every for i, good in enumerate(ok)]

        backend._write = some_fail
    cache = make_l3_cache("full", backend)
    sink = Sink()
    cache.l3.writer.events = sink
    return cache, sink


@pytest.mark.parametrize("tp", [False, True])
@pytest.mark.parametrize("fail_every", [None, 2])
def test_stored_pages_are_announced_when_agreed(tmp_path, tp, fail_every):
    cache, sink = _cache(tmp_path, fail_every)
    if tp:
        # The agreement itself is the poll's all-reduce (tested with real ranks elsewhere):
        # a job counts as stored only if every page of it was, on every rank. One rank whose
        # job is partly stored stands in for a TP group where another rank's part failed.
        cache.l3.tp_group = object()
    for conv in conversations(7, n=3):
        run_turn(cache, conv)
    cache.drain()
    if fail_every is None:  # whole jobs: announced as the tier remembers them
        assert sink.stored and sink.stored == set(cache.l3.stored_pages())
    elif tp:
        assert sink.stored == set(), "a partly stored job was announced under TP"
    else:  # one rank: the pages it stored, every one of them in the store
        assert sink.stored
        backend = cache.l3.backend
        for pool, h in sink.stored:
            assert backend.exists([PoolTransfer(pool, [h])]) == 1, (pool, h)
    cache.close()
