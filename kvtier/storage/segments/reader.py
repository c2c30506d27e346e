"""Reading a batch of pages from segments: plan, one ``preadv`` per run, verify.

A batch is sorted by segment and offset and cut into chunks of about ``io.RUN_BYTES``; a chunk's
adjacent records are read with one ``preadv`` straight into the caller's page buffers and verified
by the same thread at once, while the bytes are still in its cache. A record larger than a chunk is
read in pieces of a chunk's size, each hashed right after it lands. The caller's thread and the IO
threads share the chunks (``io.run_shared``), so one thread's Python work overlaps the other's
syscall.

Verify rule: every read checks the payload against the checksum its journal entry holds for its
key (XXH3-64), always, whoever wrote it and whenever (or, with ``verify="once"``, once per record
this process did not see written completely).
"""

from __future__ import annotations

import functools
import logging
import operator
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

import numpy as np

from kvtier.storage.base import Parts
from kvtier.storage.page_format import XXH3, PageViews, checksum_matches, xxh3_stream
from kvtier.storage.segments import native
from kvtier.storage.segments.index import Index, Loc, Segment
from kvtier.storage.segments.io import IOV_MAX, RUN_BYTES, pieces, read_all, run_shared

__all__ = ["Reader"]

log = logging.getLogger(__name__)


class _Plan(NamedTuple):
    """A batch's records, columns indexed by page (``zip(*locs)``: no attribute access per page),
    and ``order``: the pages to read, sorted by segment and offset. ``algorithms`` and
    ``checksums``: each record's, as ``PageViews.checksums`` gives a page's pair; ``trusting``:
    whether any record read is trusted (``verify="once"`` only); ``used``: the segments read."""

    order: list[int]
    segs: Sequence[Segment]
    offsets: Sequence[int]
    lengths: Sequence[int]
    trusted: Sequence[bool]
    trusting: bool
    used: set[Segment]
    algorithms: Sequence[int]
    checksums: Sequence[int]


def _plan(locs: list[Loc | None], lengths: list[int]) -> _Plan | None:
    """The pages whose record exists and has their page's size, sorted by (segment, offset);
    None if there are none.

    A record of another size than its page is not the caller's page (a pool of another layout):
    not served, and not a checksum miss."""
    n = len(locs)
    if n and None not in locs:
        segs, offsets, sizes, _, _, trusted, algorithms, checksums = zip(*locs)
        if list(sizes) == lengths:
            order = list(range(n))
        else:
            order = [i for i in range(n) if sizes[i] == lengths[i]]
    else:
        order = [i for i, loc in enumerate(locs) if loc is not None and loc.length == lengths[i]]
        if not order:
            return None
        filler = locs[order[0]]  # stands in for the pages not read (never looked at)
        segs, offsets, sizes, _, _, trusted, algorithms, checksums = zip(
            *[filler if loc is None else loc for loc in locs]
        )
    if not order:
        return None
    used = set(segs) if len(order) == n else {segs[i] for i in order}  # every page read: all
    if len(used) == 1:
        order.sort(key=offsets.__getitem__)  # one segment: linear when already in order
    else:  # (segment, offset) as one int: still linear for a batch written in order
        rank = {seg: r << 48 for r, seg in enumerate(sorted(used, key=lambda seg: seg.stem))}
        where = [rank.get(seg, 0) | offset for seg, offset in zip(segs, offsets)]
        order.sort(key=where.__getitem__)
    return _Plan(
        order,
        segs,
        offsets,
        sizes,
        trusted,
        any(trusted),
        used,
        algorithms,
        checksums,
    )


class Reader:
    """Reads and verifies batches of records through ``index``; ``pool`` gives the IO threads."""

    def __init__(
        self,
        index: Index,
        pool: Callable[[], ThreadPoolExecutor | None],
        helpers: int,
        verify_once: bool,
        native_loops: bool = True,
    ) -> None:
        self._index, self._pool, self._helpers = index, pool, helpers
        self._verify_once = verify_once
        self._native = native_loops  # the C loops where they are built (native.available())

    def read(self, keys: list[str], pages: list[Parts]) -> tuple[list[bool], int]:
        """Read each key's record into its page; per page whether it was served, and how many
        records failed verification (dropped from the index: a later ``set`` rewrites them).

        A record of another size than its page is not the caller's page (a pool of another
        layout): not served, and not a checksum miss.
        """
        index = self._index
        views = PageViews(pages)
        lengths = views.lengths()
        with index.mutex:
            get = index.entries.get
            locs = list(map(get, keys))
            if index.refresh_locked(tail=None in locs):
                locs = list(map(get, keys))
            plan = _plan(locs, lengths)
            fds = {seg: index.pin_locked(seg) for seg in plan.used} if plan is not None else {}
            if any(fd < 0 and index.deleted_locked(seg) for seg, fd in fds.items()):
                # A segment is no longer in the root: another process deleted it (compacted
                # or evicted) since this process last listed the root, which the listing's
                # rate limit may hold back for up to ``list_interval_s``. Live records are
                # copied, and journaled, before a compactor deletes: list and tail now and
                # plan again, once, instead of missing pages still stored. (A segment that
                # is there but cannot be opened, no descriptor left say, is a miss.)
                for seg, fd in fds.items():
                    if fd >= 0:
                        index.unpin_locked(seg)
                index.forget_listing_locked()
                index.refresh_locked(tail=True)
                locs = list(map(get, keys))
                plan = _plan(locs, lengths)
                fds = {seg: index.pin_locked(seg) for seg in plan.used} if plan is not None else {}
        out = [False] * len(keys)
        bad: list[int] = []
        try:
            lib = native.library() if plan is not None and self._native else None
            if (
                lib is not None and native.takes(lib, views) and set(plan.algorithms) == {XXH3}  # type: ignore[union-attr]
            ):
                self._read_native(lib, plan, views, fds, out, bad)  # type: ignore[arg-type]
            elif plan is not None:
                bounds = _chunks(plan.order, lengths)
                adjacent = _adjacent_chunks(plan, bounds, views.counts())
                read = self._read_chunk
                jobs = [
                    functools.partial(read, plan, lo, hi, adj, views, fds, out, bad)
                    for lo, hi, adj in zip(bounds, bounds[1:], adjacent)
                ]
                run_shared(self._pool(), self._helpers, jobs)
        finally:
            with index.mutex:
                for i in bad:
                    index.drop_locked(keys[i], locs[i])  # type: ignore[arg-type]
                if self._verify_once:
                    for key, loc, got in zip(keys, locs, out):
                        if got:
                            index.trust_locked(key, loc)  # type: ignore[arg-type]
                index.touch_locked(seg for seg, fd in fds.items() if fd >= 0)
                for seg, fd in fds.items():
                    if fd >= 0:
                        index.unpin_locked(seg)
        return out, len(bad)

    def _read_native(
        self,
        lib: object,
        plan: _Plan,
        views: PageViews,
        fds: dict[Segment, int],
        out: list[bool],
        bad: list[int],
    ) -> None:
        """The batch's records in one call of the C loops (``native``): the same verdicts as
        ``_read_chunk``'s, on this thread and ``helpers`` threads of the library's own. Runs
        are cut in C; a record larger than a run is read in run-sized pieces, each hashed as it
        lands where the binding's streaming XXH3 calls check out (else the whole after)."""
        order = np.asarray(plan.order, dtype=np.intp)
        if len(plan.used) == 1:
            fd = np.full(len(order), fds[next(iter(plan.used))], dtype=np.int32)
        else:
            segs = plan.segs
            fd = np.fromiter((fds[segs[i]] for i in plan.order), dtype=np.int32, count=len(order))
        status, err = native.read(
            lib,
            fd,
            np.asarray(plan.offsets, dtype=np.int64)[order],
            native.buffers(views, order),
            np.asarray(plan.lengths, dtype=np.uint64)[order],
            np.asarray(plan.checksums, dtype=np.uint64)[order],
            RUN_BYTES,
            self._helpers + 1,
            np.asarray(plan.trusted, dtype=np.uint8)[order] if plan.trusting else None,
        )
        if err:
            log.warning(
                "segment store %s: reads of %d records failed: %s",
                self._index.root,
                int((status == 3).sum()),
                os.strerror(err),
            )
        elif (status == 3).any():  # read, but no hash state could be made to check them
            log.warning(
                "segment store %s: %d records read but not checked (no memory to hash them): "
                "not served",
                self._index.root,
                int((status == 3).sum()),
            )
        if (status == 1).all():  # every page verified: the common case
            for i in plan.order:
                out[i] = True
            return
        for k in np.flatnonzero(status == 1).tolist():
            out[plan.order[k]] = True
        bad.extend(plan.order[k] for k in np.flatnonzero(status == 2).tolist())

    def _read_chunk(
        self,
        plan: _Plan,
        lo: int,
        hi: int,
        adjacent: bool,
        views: PageViews,
        fds: dict[Segment, int],
        out: list[bool],
        bad: list[int],
    ) -> None:
        """Read pages ``plan.order[lo:hi]``, one ``preadv`` per run of adjacent records (one in
        all where ``adjacent``: ``_adjacent`` holds), and verify each record into ``out`` (True)
        or ``bad``; an IO error leaves its pages False."""
        if adjacent:
            self._read_adjacent(plan, lo, hi, views, fds, out, bad)
            return
        order, segs, offsets, sizes, trusted = (
            plan.order,
            plan.segs,
            plan.offsets,
            plan.lengths,
            plan.trusted,
        )
        counts = views.counts()
        j = lo
        while j < hi:
            seg = segs[order[j]]
            fd = fds[seg]
            start = pos = offsets[order[j]]
            members: list[int] = []  # pages of this run, in file order
            iovs = 0
            large = False
            while j < hi:
                i = order[j]
                large = sizes[i] > RUN_BYTES and not trusted[i]
                if members and (
                    large or segs[i] is not seg or offsets[i] != pos or iovs + counts[i] > IOV_MAX
                ):
                    large = False  # this run ends before that record
                    break
                members.append(i)
                iovs += counts[i]
                pos = offsets[i] + sizes[i]
                j += 1
                if large:
                    break  # a large record is a run of its own, read in pieces
            if fd < 0:
                continue  # the segment could not be opened: its pages stay unserved
            try:
                if large:
                    i = members[0]
                    if _read_large(fd, start, plan.algorithms[i], plan.checksums[i], views[i]):
                        out[i] = True
                    else:
                        bad.append(i)
                    continue
                end = start + read_all(fd, views.iovecs(members), start, pos - start)
            except OSError as e:
                log.warning(
                    "segment store %s: read of %s failed: %s", self._index.root, seg.stem, e
                )
                continue
            verify: list[int] = []
            for i in members:
                if offsets[i] + sizes[i] > end:
                    bad.append(i)  # the segment ends inside it
                elif trusted[i]:
                    out[i] = True
                else:
                    verify.append(i)
            _verify(plan, views, verify, out, bad)

    def _read_adjacent(
        self,
        plan: _Plan,
        lo: int,
        hi: int,
        views: PageViews,
        fds: dict[Segment, int],
        out: list[bool],
        bad: list[int],
    ) -> None:
        """``_read_chunk`` of a chunk that ``_adjacent`` accepts: one ``preadv``, its pages
        verified in one pass."""
        members = plan.order[lo:hi]
        first, last = members[0], members[-1]
        fd = fds[plan.segs[first]]
        if fd < 0:
            return  # the segment could not be opened: its pages stay unserved
        start = plan.offsets[first]
        want = plan.offsets[last] + plan.lengths[last] - start
        try:
            got = read_all(fd, views.iovecs(members), start, want)
        except OSError as e:
            log.warning(
                "segment store %s: read of %s failed: %s",
                self._index.root,
                plan.segs[first].stem,
                e,
            )
            return
        if got < want:  # the segment ends inside the chunk: the records it cuts are bad
            end = start + got
            members = [i for i in members if plan.offsets[i] + plan.lengths[i] <= end]
            bad.extend(i for i in plan.order[lo:hi] if plan.offsets[i] + plan.lengths[i] > end)
        if plan.trusting:
            trusted = plan.trusted
            for i in members:
                if trusted[i]:
                    out[i] = True
            members = [i for i in members if not trusted[i]]
        _verify(plan, views, members, out, bad)


def _verify(
    plan: _Plan, views: PageViews, pages: list[int], out: list[bool], bad: list[int]
) -> None:
    """Check each of ``pages`` (read in full) against its journal checksum, a run's hashes at
    once: into ``out`` (True) or ``bad``."""
    algorithms, checksums = plan.algorithms, plan.checksums
    wants = [(algorithms[i], checksums[i]) for i in pages]
    got_all = views.checksums(pages)
    if got_all == wants:  # every one verified: the common case
        for i in pages:
            out[i] = True
        return
    for i, got, want in zip(pages, got_all, wants):
        if got == want or (got[0] != want[0] and views.matches(i, *want)):
            out[i] = True
        else:
            bad.append(i)


def _adjacent(plan: _Plan, lo: int, hi: int, counts: Sequence[int]) -> bool:
    """Whether records ``plan.order[lo:hi]`` lie back to back in one segment and none needs the
    pieces of a large record: then they are one ``preadv`` (the usual chunk of a batch that was
    written together): each starts where the one before it ends. ``counts``: each page's
    parts."""
    order, segs, offsets, lengths = plan.order, plan.segs, plan.offsets, plan.lengths
    first, last = order[lo], order[hi - 1]
    if segs[first] is not segs[last] or sum(counts[i] for i in order[lo:hi]) > IOV_MAX:
        return False
    members = order[lo:hi]
    # Each record where the one before it ends (a span equal to the sum of the lengths would
    # also pass a key read twice, its offset repeated, with another record in the gap).
    if any(offsets[b] != offsets[a] + lengths[a] for a, b in zip(members, members[1:])):
        return False
    return max(lengths[i] for i in members) <= RUN_BYTES or (hi - lo == 1 and plan.trusted[first])


def _adjacent_chunks(plan: _Plan, bounds: list[int], counts: Sequence[int]) -> list[bool]:
    """``_adjacent`` of each chunk ``bounds`` cut: for the whole batch at once where its records
    lie back to back in one segment (sorted by segment, so its first and last records share
    one), none larger than a run and no chunk over ``IOV_MAX`` parts (a batch written
    together); else chunk by chunk."""
    order, lengths = plan.order, plan.lengths
    starts = [plan.offsets[i] for i in order]
    sizes = [lengths[i] for i in order]
    if (
        plan.segs[order[0]] is plan.segs[order[-1]]
        and max(sizes) <= RUN_BYTES
        and max(counts) * max(map(operator.sub, bounds[1:], bounds)) <= IOV_MAX
        and starts[1:] == list(map(operator.add, starts, sizes))[:-1]
    ):
        return [True] * (len(bounds) - 1)
    return [_adjacent(plan, lo, hi, counts) for lo, hi in zip(bounds, bounds[1:])]


def _read_large(
    fd: int, offset: int, algorithm: int, checksum: int, parts: list[memoryview]
) -> bool:
    """Read and verify one record of more than ``RUN_BYTES`` at ``offset`` in pieces of
    ``RUN_BYTES``, each hashed right after it lands (while it is still in this core's cache;
    hashing the whole page after reading it would fetch it from memory a second time). Whether
    it verified."""
    stream = xxh3_stream(parts) if algorithm == XXH3 else None
    pos = offset
    for piece in pieces(parts, RUN_BYTES):
        want = sum(v.nbytes for v in piece)
        if read_all(fd, piece, pos, want) < want:
            return False  # the segment ends inside the record
        pos += want
        if stream is not None:
            for v in piece:
                stream.update(v)
    if stream is None:  # another algorithm, or no streaming hash here: the whole-page check
        return checksum_matches(algorithm, checksum, parts)
    return stream.digest() == checksum


def _chunks(order: list[int], lengths: list[int]) -> list[int]:
    """Bounds cutting ``order`` into chunks of about ``RUN_BYTES`` each (at least one record)."""
    n = len(order)
    if n == 0:
        return [0]
    sizes = {lengths[i] for i in order}
    if len(sizes) == 1:  # the common case: one page size
        step = max(1, RUN_BYTES // max(1, sizes.pop()))
        return [*range(0, n, step), n]
    bounds, acc = [0], 0
    for j, i in enumerate(order):
        acc += lengths[i]
        if acc >= RUN_BYTES:
            bounds.append(j + 1)
            acc = 0
    if bounds[-1] != n:
        bounds.append(n)
    return bounds
