"""Pages as byte ranges of a host buffer: a batch of pages with no tensor per page.

A list of page tensors costs a tensor view per part (about a microsecond each to make, and as
much again for every check a store runs on it): a 128-page batch of a page_first MHA pool, two
parts a page, spent ~0.4 ms in ``HostPool.page_views`` alone on the dev VM, more than the file
store's own Python for that batch. ``PageSpans`` names the same bytes with one buffer and an
array of offsets: the store checks the batch with a few array operations and takes the
addresses from them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["PageSpans", "SpanPages"]

_I64_MAX = 2**63 - 1

Parts = tuple[torch.Tensor, ...]


def _shown(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


@dataclass(frozen=True, eq=False)
class PageSpans:
    """A pool's pages as byte ranges of one host buffer, for ``PoolTransfer.pages``.

    Page ``i`` is the concatenation of ``buffer[offsets[i, k] : offsets[i, k] + sizes[k]]`` over
    its parts ``k`` (a page_first KV page: its K range, then its V range). ``HostPool.page_spans``
    makes them for a host pool's pages.

    Attributes:
        buffer: a 1-D contiguous uint8 CPU tensor (a host pool's bytes, viewed as uint8).
        offsets: each page's parts' byte offsets into ``buffer``: int64 ``[pages, parts]``
            (a numpy array, a CPU tensor, or nested sequences of ints).
        sizes: the bytes of each part, the same for every page (one int per part).

    ``set`` only reads the ranges; ``get`` writes into them. The buffer must stay alive and
    unchanged by others for the call. A call's transfers must all be ``PageSpans`` for the store
    to skip the tensor per page; mixed with lists of tensors, the spans are made into tensors.
    Bad spans (a buffer of another kind, offsets outside it, shapes that do not match) are
    refused with ``TypeError`` or ``ValueError`` by the call, before anything moves.
    """

    buffer: torch.Tensor
    offsets: np.ndarray
    sizes: tuple[int, ...]

    def __post_init__(self) -> None:
        offsets = self.offsets
        if isinstance(offsets, torch.Tensor):
            offsets = offsets.detach().cpu().numpy()
        try:
            arr = np.asarray(offsets)
        except (TypeError, ValueError) as e:
            raise TypeError(f"offsets: expected int64 [pages, parts], got {_shown(offsets)}") from e
        if arr.dtype.kind not in "iu" and not (arr.size == 0 and arr.dtype.kind == "f"):
            raise TypeError(f"offsets: expected integers, got dtype {arr.dtype}")
        if arr.dtype.kind == "u" and arr.size and int(arr.max()) > _I64_MAX:
            raise ValueError(f"offsets: {int(arr.max())} is past any buffer")
        sizes = self.sizes
        if isinstance(sizes, int) or not isinstance(sizes, Sequence):
            raise TypeError(f"sizes: expected a sequence of ints, got {_shown(sizes)}")
        if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) for s in sizes):
            raise TypeError(f"sizes: expected ints, got {_shown(sizes)}")
        sizes = tuple(int(s) for s in sizes)
        if not sizes or min(sizes) < 0 or max(sizes) > _I64_MAX:
            raise ValueError(f"sizes: need at least one part, each in [0, 2**63), got {sizes}")
        if arr.size == 0:
            arr = arr.reshape(0, len(sizes))
        if arr.ndim != 2 or arr.shape[1] != len(sizes):
            raise ValueError(
                f"offsets: shape must be [pages, {len(sizes)}] (one column per part size), got "
                f"{list(arr.shape)}"
            )
        # A copy of its own, read-only: the caller's array may change after the call checks it.
        own = np.array(arr, dtype=np.int64, order="C", copy=True)
        own.setflags(write=False)
        object.__setattr__(self, "offsets", own)
        object.__setattr__(self, "sizes", sizes)

    def __len__(self) -> int:
        return len(self.offsets)

    def check(self, pool: object) -> None:
        """Raise ``TypeError``/``ValueError`` (naming ``pool``) unless every range lies in a 1-D
        contiguous uint8 CPU ``buffer`` whose memory is all there (its storage as long as the
        tensor says: the store moves bytes by address, with no tensor to refuse a short one)."""
        offsets, sizes = self.offsets, self.sizes
        if (
            not isinstance(offsets, np.ndarray)
            or offsets.dtype != np.int64
            or offsets.ndim != 2
            or offsets.shape[1] != len(sizes)
        ):
            raise ValueError(
                f"pool {pool!r}: PageSpans.offsets must be int64 [pages, {len(sizes)}], got "
                f"{getattr(offsets, 'dtype', type(offsets).__name__)} "
                f"{list(getattr(offsets, 'shape', ()))}"
            )
        b = self.buffer
        if not isinstance(b, torch.Tensor):
            raise TypeError(
                f"pool {pool!r}: PageSpans.buffer must be a tensor, got {type(b).__name__}"
            )
        if b.dtype is not torch.uint8 or b.dim() != 1 or not b.is_contiguous() or not b.is_cpu:
            raise ValueError(
                f"pool {pool!r}: PageSpans.buffer must be a 1-D contiguous uint8 CPU tensor, got "
                f"{b.dtype} shape {tuple(b.shape)} on {b.device}"
            )
        n = b.numel()
        if b.storage_offset() + n > b.untyped_storage().nbytes():
            raise ValueError(
                f"pool {pool!r}: PageSpans.buffer's storage holds "
                f"{b.untyped_storage().nbytes()} bytes, short of its {b.storage_offset() + n} "
                "(a storage resized or freed)"
            )
        if len(offsets):
            # Per part: 0 <= offset <= n - size, compared without sums that could overflow.
            room = n - np.asarray(sizes, dtype=np.int64)  # sizes < 2**63; negative: no room
            bad = (offsets < 0) | (offsets > room)
            if bad.any():
                i = int(np.flatnonzero(bad.any(axis=1))[0])
                raise ValueError(
                    f"pool {pool!r}: PageSpans page {i}: ranges at {offsets[i].tolist()} of "
                    f"{list(sizes)} bytes leave the buffer's {n} bytes"
                )

    def page(self, i: int) -> Parts:
        """Page ``i``'s parts as tensors (views of ``buffer``)."""
        b = self.buffer
        return tuple(b[o : o + n] for o, n in zip(self.offsets[i].tolist(), self.sizes))

    def rows(self, pages: np.ndarray | slice) -> PageSpans:
        """These spans' ``pages`` (a 1-D index array, or a slice), in that order."""
        if not isinstance(pages, slice):
            pages = np.asarray(pages)
            if pages.ndim != 1 or (pages.size and pages.dtype.kind not in "iu"):
                raise ValueError(
                    f"pages: expected a 1-D index array or a slice, got {_shown(pages)}"
                )
        return self._made(self.buffer, self.offsets[pages], self.sizes)

    @classmethod
    def _made(cls, buffer: torch.Tensor, offsets: np.ndarray, sizes: tuple[int, ...]) -> PageSpans:
        """Spans from parts already checked (rows of checked spans): no checks again."""
        out = object.__new__(cls)
        object.__setattr__(out, "buffer", buffer)
        object.__setattr__(out, "offsets", offsets)
        object.__setattr__(out, "sizes", sizes)
        return out


class SpanPages(Sequence[Parts]):
    """A call's pages given as ``PageSpans`` (one per transfer, in order), as the sequence of
    ``Parts`` the backends take: a page's tensors are made only when it is indexed. Stores
    that know spans (the segment store, through ``PageViews``) never index it."""

    def __init__(self, chunks: Sequence[PageSpans]) -> None:
        self.chunks = [c for c in chunks if len(c)]
        self._starts = np.array([0, *itertools.accumulate(len(c) for c in self.chunks)], np.int64)

    def __len__(self) -> int:
        return int(self._starts[-1])

    def _locate(self, i: int) -> tuple[PageSpans, int]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"page {i} of {n}")
        c = int(np.searchsorted(self._starts, i, side="right")) - 1
        return self.chunks[c], i - int(self._starts[c])

    def __getitem__(self, i):  # type: ignore[override]
        if isinstance(i, slice):
            return self.select(range(len(self))[i])
        chunk, j = self._locate(i)
        return chunk.page(j)

    def __iter__(self) -> Iterator[Parts]:
        for chunk in self.chunks:
            for j in range(len(chunk)):
                yield chunk.page(j)

    def select(self, pages: Sequence[int]) -> SpanPages:
        """These pages, in the order given, as spans (no tensor per page)."""
        n = len(self)
        if isinstance(pages, range) and pages.step == 1 and 0 <= pages.start <= pages.stop <= n:
            if len(self.chunks) == 1:  # the common case: a run of one transfer's pages
                return SpanPages([self.chunks[0].rows(slice(pages.start, pages.stop))])
        idx = np.asarray(pages, dtype=np.int64).reshape(-1)
        if len(self.chunks) == 1:
            if len(idx) and (idx.min() < 0 or idx.max() >= n):
                raise IndexError(f"pages outside [0, {n})")
            return SpanPages([self.chunks[0].rows(idx)])
        if len(idx) and (idx.min() < 0 or idx.max() >= len(self)):
            raise IndexError(f"pages outside [0, {len(self)})")
        chunk = np.searchsorted(self._starts, idx, side="right") - 1
        out: list[PageSpans] = []
        # Runs of consecutive picks from one chunk stay one chunk (the order is kept).
        cut = np.flatnonzero(np.diff(chunk)) + 1
        for run_idx, run_chunk in zip(np.split(idx, cut), np.split(chunk, cut)):
            if len(run_idx):
                c = int(run_chunk[0])
                out.append(self.chunks[c].rows(run_idx - int(self._starts[c])))
        return SpanPages(out)

    def page_bytes(self) -> list[int]:
        """Each page's length in bytes."""
        return [n for c in self.chunks for n in itertools.repeat(sum(c.sizes), len(c))]

    def nbytes(self) -> int:
        """The bytes of every page together."""
        return sum(len(c) * sum(c.sizes) for c in self.chunks)


def select_pages(pages: Sequence[Parts], idx: Sequence[int]) -> Sequence[Parts]:
    """``[pages[i] for i in idx]``, kept as spans where ``pages`` are spans."""
    if isinstance(pages, SpanPages):
        return pages.select(idx)
    return [pages[i] for i in idx]
