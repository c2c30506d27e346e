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

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from kvtier.storage.base import Parts
from kvtier.storage.page_format import XXH3, PageViews, checksum_matches, xxh3_stream
from kvtier.storage.segments.index import Index, Loc, Segment
from kvtier.storage.segments.io import IOV_MAX, RUN_BYTES, pieces, read_all, run_shared

__all__ = ["Reader"]

log = logging.getLogger(__name__)

Plan = list[tuple[str, int, int]]  # (segment stem, offset, page in the batch), sorted


class Reader:
    """Reads and verifies batches of records through ``index``; ``pool`` gives the IO threads."""

    def __init__(
        self,
        index: Index,
        pool: Callable[[], ThreadPoolExecutor | None],
        helpers: int,
        verify_once: bool,
    ) -> None:
        self._index, self._pool, self._helpers = index, pool, helpers
        self._verify_once = verify_once

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
            entries = index.entries
            index.refresh_locked(tail=any(k not in entries for k in keys))
            locs = [entries.get(k) for k in keys]
            plan = sorted(
                (loc.seg.stem, loc.offset, i)
                for i, loc in enumerate(locs)
                if loc is not None and loc.length == lengths[i]
            )
            fds: dict[Segment, int] = {}
            for _, _, i in plan:
                seg = locs[i].seg  # type: ignore[union-attr]
                if seg not in fds:
                    fds[seg] = index.pin_locked(seg)
        out = [False] * len(keys)
        bad: list[int] = []
        try:

            def job(lo: int, hi: int) -> Callable[[], None]:
                return lambda: self._read_chunk(
                    plan,
                    lo,
                    hi,
                    locs,  # type: ignore[arg-type]
                    views,
                    fds,
                    out,
                    bad,
                )

            bounds = _chunks(plan, lengths)
            run_shared(self._pool(), self._helpers, [job(a, b) for a, b in zip(bounds, bounds[1:])])
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

    def _read_chunk(
        self,
        plan: Plan,
        lo: int,
        hi: int,
        locs: list[Loc],
        views: PageViews,
        fds: dict[Segment, int],
        out: list[bool],
        bad: list[int],
    ) -> None:
        """Read ``plan[lo:hi]``, one ``preadv`` per run of adjacent records, and verify each
        record into ``out`` (True) or ``bad``; an IO error leaves its pages False."""
        j = lo
        while j < hi:
            seg = locs[plan[j][2]].seg
            fd = fds[seg]
            start = pos = plan[j][1]
            iovecs: list[memoryview] = []
            members: list[tuple[int, list[memoryview]]] = []  # (page, its views)
            large = False
            while j < hi:
                _, offset, i = plan[j]
                loc = locs[i]
                parts = views[i]
                large = loc.length > RUN_BYTES and not loc.trusted
                if members and (
                    large
                    or loc.seg is not seg
                    or offset != pos
                    or len(iovecs) + len(parts) > IOV_MAX
                ):
                    large = False  # this run ends before that record
                    break
                iovecs += parts
                members.append((i, parts))
                pos = offset + loc.length
                j += 1
                if large:
                    break  # a large record is a run of its own, read in pieces
            if fd < 0:
                continue  # the segment could not be opened: its pages stay unserved
            try:
                if large:
                    i, parts = members[0]
                    if _read_large(fd, locs[i], parts):
                        out[i] = True
                    else:
                        bad.append(i)
                    continue
                end = start + read_all(fd, iovecs, start, pos - start)
            except OSError as e:
                log.warning(
                    "segment store %s: read of %s failed: %s", self._index.root, seg.stem, e
                )
                continue
            for i, parts in members:
                loc = locs[i]
                if loc.offset + loc.length <= end and (
                    loc.trusted or checksum_matches(loc.algorithm, loc.checksum, parts)
                ):
                    out[i] = True
                else:
                    bad.append(i)


def _read_large(fd: int, loc: Loc, parts: list[memoryview]) -> bool:
    """Read and verify one record of more than ``RUN_BYTES`` in pieces of ``RUN_BYTES``, each
    hashed right after it lands (while it is still in this core's cache; hashing the whole page
    after reading it would fetch it from memory a second time). Whether it verified."""
    stream = xxh3_stream(parts) if loc.algorithm == XXH3 else None
    pos = loc.offset
    for piece in pieces(parts, RUN_BYTES):
        want = sum(v.nbytes for v in piece)
        if read_all(fd, piece, pos, want) < want:
            return False  # the segment ends inside the record
        pos += want
        if stream is not None:
            for v in piece:
                stream.update(v)
    if stream is None:  # another algorithm, or no streaming hash here: the whole-page check
        return checksum_matches(loc.algorithm, loc.checksum, parts)
    return stream.digest() == loc.checksum


def _chunks(plan: Plan, lengths: list[int]) -> list[int]:
    """Bounds cutting ``plan`` into chunks of about ``RUN_BYTES`` each (at least one record)."""
    n = len(plan)
    if n == 0:
        return [0]
    sizes = {lengths[i] for _, _, i in plan}
    if len(sizes) == 1:  # the common case: one page size
        step = max(1, RUN_BYTES // max(1, sizes.pop()))
        return [*range(0, n, step), n]
    bounds, acc = [0], 0
    for j, (_, _, i) in enumerate(plan):
        acc += lengths[i]
        if acc >= RUN_BYTES:
            bounds.append(j + 1)
            acc = 0
    if bounds[-1] != n:
        bounds.append(n)
    return bounds
