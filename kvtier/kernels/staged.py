"""The staged path: a gather or scatter on the device, plus contiguous copy-engine transfers.

The copy engine moves bytes without SMs, but only as ranges (``copy_engine.py``). Where a host
layout cuts a page's bytes for one layer into many small ranges (``page_first`` at P > 1: one
``I``-byte item per token, ``L * I`` apart), or where a batch would need so many descriptors that
enqueueing them rivals the copy (``page_first_direct`` at P = 16: one 32 KiB range per (buffer,
page, layer)), the staged path splits the copy in two::

    D→H   device pages ──Triton gather (HBM speed)──▶ ring slot ──copy engine──▶ host pages
    H→D   host pages ──copy engine──▶ ring slot ──Triton scatter (HBM speed)──▶ device pages

A ring slot holds a chunk of the batch laid out exactly like the host bytes it mirrors: the
chunk's pages form a tiny host pool of the same layout (:func:`stage_strides`), so the existing
copy kernel moves items between the device pool and the slot (a :class:`HostBuffer` may live on
the device) and no new kernel is needed. The batch is sorted by host page first, so runs of
consecutive host pages land in consecutive slot pages, and each run is one region per buffer:

    layout             per-layer region of a run of r pages        all-layer region (backup)
    layer_first        1 row of r*P*I                              L rows of r*P*I, pitch N*I
    page_first         r*P rows of I, pitch L*I                    1 row of r*P*L*I
    page_first_direct  r rows of P*I, pitch L*P*I                  1 row of r*L*P*I

A region of one row, or of rows of at least :data:`ROW_BATCH_BYTES`, becomes descriptors of one
``cudaMemcpyBatchAsync`` per chunk; narrower rows become one ``cudaMemcpy2DAsync`` each (the copy
engine walks the pitch itself). Layer groups: a per-layer load stages one layer at a time (so
``wait_layer(i)`` needs only layer ``i``'s scatter); a backup stages all layers of a chunk of
pages at once where a page of every layer fits a slot, else one layer at a time.

Ring slots are reused round-robin; each has an event recorded after the last operation that
reads or writes it, and a stream that takes a slot waits on that event first, so the write
stream's backups and the load stream's loads share one ring safely.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch

from kvtier.kernels.copy_engine import memcpy_2d, memcpy_batch, stream_handle
from kvtier.kernels.kv_transfer import TransferKnobs, copy_device_to_host, copy_host_to_device
from kvtier.kernels.layout import DeviceBuffers, HostBuffer
from kvtier.nvtx import copy_range_name, nvtx_range

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "MAX_PITCH",
    "ROW_BATCH_BYTES",
    "STAGED_KNOBS",
    "StagedPlan",
    "Stager",
    "StagingRing",
    "engine_copy",
    "host_regions",
    "stage_strides",
]

# A ring of two 8 MiB slots per pool pair: a per-layer load of 8x128 bf16 K and V at P = 16
# stages 128 pages (2048 tokens) per chunk.
DEFAULT_STAGING_BYTES = 16 << 20
_SLOTS = 2
_SLOT_ALIGN = 256

# Rows at least this wide go into the batch as one descriptor each; narrower rows of a
# multi-row region go to one cudaMemcpy2DAsync (a descriptor per 2 KiB row would cost more CPU
# than the copy engine spends moving it).
ROW_BATCH_BYTES = 64 << 10

# cudaMemcpy2DAsync refuses pitches above the device's cudaDevAttrMaxPitch (2^31 - 1 on current
# GPUs); such regions (layer_first backups of a pool over 2 GiB per layer) go row by row.
MAX_PITCH = 2**31 - 1

# The gather and scatter run device to device: more programs than a host copy's 4 reach HBM
# speed, and they finish sooner, which is what frees SMs for the forward pass. The small-call
# variant answers the latency of host reads, which these never make: off.
STAGED_KNOBS = TransferKnobs(num_programs=32, small_h2d_bytes=0)

Strides = tuple[int, int, int, int]  # buffer, page, token, layer (bytes)


def stage_strides(host: HostBuffer, cap_pages: int, layers: int) -> Strides:
    """Byte strides of a slot holding ``cap_pages`` pages of ``layers`` layers of ``host``'s
    buffers, densely, with the dimensions in ``host``'s order (largest stride outermost)."""
    dims = [
        (host.stride_buffer, host.num_buffers, 0),
        (host.stride_page, cap_pages, 1),
        (host.stride_token, host.page_size, 2),
        (host.stride_layer, layers, 3),
    ]
    out = [0, 0, 0, 0]
    acc = host.item_bytes
    # Innermost first; ties keep buffer, page, token, layer outermost to innermost.
    for _, n, k in sorted(dims, key=lambda d: (d[0], -d[2])):
        out[k] = acc
        acc *= n
    return out[0], out[1], out[2], out[3]


@lru_cache(maxsize=1024)
def _pattern(
    item: int, dims: tuple[tuple[int, int, int], ...]
) -> tuple[int, tuple[tuple[int, int, int], ...]]:
    """Coalesce ``dims`` (extent, host stride, slot stride) around a contiguous item.

    Returns the contiguous row width and the remaining dims, innermost first; dims merge into
    the row while they continue it on both sides, and into each other while the outer one
    continues the inner one on both sides.
    """
    rest = [d for d in dims if d[0] > 1]
    width = item
    grew = True
    while grew:
        grew = False
        for d in rest:
            if d[1] == width and d[2] == width:
                width *= d[0]
                rest.remove(d)
                grew = True
                break
    rest.sort(key=lambda d: (d[1], d[2]))
    merged: list[tuple[int, int, int]] = []
    for n, hs, ss in rest:
        if merged:
            m, mh, ms = merged[-1]
            if hs == m * mh and ss == m * ms:
                merged[-1] = (m * n, mh, ms)
                continue
        merged.append((n, hs, ss))
    return width, tuple(merged)


@dataclass(frozen=True)
class Regions:
    """Copies between host bytes and a slot, as offsets from the host buffer's slot 0 (buffer 0,
    layer 0) and from the slot's start.

    Attributes:
        rows_host, rows_stage, rows_size: int64 ``[n]``: one contiguous range each.
        mats: int64 ``[k, 6]``: 2-D copies ``(host, stage, width, height, host_pitch,
            stage_pitch)``.
    """

    rows_host: np.ndarray
    rows_stage: np.ndarray
    rows_size: np.ndarray
    mats: np.ndarray

    @property
    def calls(self) -> int:
        """Copy-engine calls: one batch (if any rows) plus one per 2-D copy."""
        return int(len(self.rows_size) > 0) + len(self.mats)


def host_regions(host: HostBuffer, stage: Strides, runs: np.ndarray, layers: int) -> Regions:
    """The regions that move ``runs`` between ``host`` and a slot at strides ``stage``.

    ``runs``: int64 ``[n, 3]`` of (first host page, first slot page, pages); layers
    ``[0, layers)`` of the host against the slot's layers (offset the host side by
    ``l * stride_layer`` for a single layer ``l``).
    """
    rows_h: list[int] = []
    rows_s: list[int] = []
    rows_n: list[int] = []
    mats: list[tuple[int, int, int, int, int, int]] = []
    sb, sp, st, sl = stage
    for h0, j0, r in runs.tolist():
        width, outer = _pattern(
            host.item_bytes,
            (
                (r, host.stride_page, sp),
                (host.page_size, host.stride_token, st),
                (layers, host.stride_layer, sl),
            ),
        )
        inner = outer[0] if outer else (1, 0, 0)
        # Every index of the dims outside the innermost: usually none.
        starts = [(0, 0)]
        for n, hs, ss in outer[1:]:
            starts = [(a + i * hs, b + i * ss) for a, b in starts for i in range(n)]
        n, hp, spitch = inner
        as_rows = n == 1 or width >= ROW_BATCH_BYTES or max(hp, spitch) > MAX_PITCH
        for b in range(host.num_buffers):
            hb = b * host.stride_buffer + h0 * host.stride_page
            kb = b * sb + j0 * sp
            for a, c in starts:
                if as_rows:
                    for i in range(n):
                        rows_h.append(hb + a + i * hp)
                        rows_s.append(kb + c + i * spitch)
                        rows_n.append(width)
                else:
                    mats.append((hb + a, kb + c, width, n, hp, spitch))
    return Regions(
        rows_host=np.array(rows_h, dtype=np.int64),
        rows_stage=np.array(rows_s, dtype=np.int64),
        rows_size=np.array(rows_n, dtype=np.int64),
        mats=np.array(mats, dtype=np.int64).reshape(-1, 6),
    )


def engine_copy(
    dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, mats: np.ndarray, stream: int
) -> None:
    """The copy-engine step of a staged chunk: one batch of ranges (int64 addresses and sizes)
    and 2-D copies (``mats``: int64 ``[k, 6]`` of dst, dpitch, src, spitch, width, height).

    A seam: CPU tests replace it with the same moves done by ``memmove``.
    """
    memcpy_batch(dst, src, sizes, stream)
    for d, dp, s, spitch, w, h in mats.tolist():
        memcpy_2d(d, dp, s, spitch, w, h, stream)


class StagingRing:
    """Device slots of ``slot_bytes``, reused round-robin, each guarded by an event.

    :meth:`take` (under :attr:`lock`) hands out the next slot after making the current stream
    wait for the slot's last use; :meth:`give` records that use. The buffer is allocated on
    first use.
    """

    def __init__(self, device: torch.device, slot_bytes: int, num_slots: int = _SLOTS) -> None:
        self.device = device
        self.slot_bytes = slot_bytes
        self.num_slots = num_slots
        self.lock = threading.Lock()
        self._buf: torch.Tensor | None = None
        self._next = 0
        cuda = device.type == "cuda"
        self._events = [torch.cuda.Event() if cuda else None for _ in range(num_slots)]

    def slot(self, s: int) -> torch.Tensor:
        """Slot ``s`` as a uint8 tensor of ``slot_bytes`` on the device."""
        if self._buf is None:
            self._buf = torch.empty(
                self.num_slots * self.slot_bytes, dtype=torch.uint8, device=self.device
            )
        return self._buf[s * self.slot_bytes : (s + 1) * self.slot_bytes]

    def take(self) -> int:
        s = self._next
        self._next = (s + 1) % self.num_slots
        ev = self._events[s]
        if ev is not None:  # an event never recorded is no dependency
            torch.cuda.current_stream(self.device).wait_event(ev)
        return s

    def give(self, s: int) -> None:
        ev = self._events[s]
        if ev is not None:
            ev.record(torch.cuda.current_stream(self.device))


@dataclass
class _Chunk:
    dev_idx: torch.Tensor  # device token slots of the chunk's pages, on the device
    stage_idx: torch.Tensor  # slot token slots 0..n*P-1
    regions: Regions


@dataclass
class StagedPlan:
    """A staged batch, ready to issue (see :class:`Stager`).

    Attributes:
        nbytes: bytes it moves over all its layers.
        keep: device tensors the copies read asynchronously.
        calls: copy-engine calls plus kernel launches of its largest issue.
        issue: enqueue layer ``l`` (a per-layer plan) or every layer (``None``) on the current
            stream.
    """

    nbytes: int
    keep: list[torch.Tensor]
    calls: int
    issue: Callable[[int | None], None]


class Stager:
    """Staged copies of one pool pair: the ring, the slot descriptions, and batch plans.

    Args:
        dev, host: the pool pair (same buffers, layers and item size).
        staging_bytes: the ring's size (two slots); a slot is grown to hold at least one page
            of every buffer.
        knobs: launch knobs of the gather and scatter.
    """

    def __init__(
        self,
        dev: DeviceBuffers,
        host: HostBuffer,
        *,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        knobs: TransferKnobs = STAGED_KNOBS,
    ) -> None:
        self.dev, self.host, self.knobs = dev, host, knobs
        B, L, P, I = dev.num_buffers, dev.num_layers, host.page_size, dev.item_bytes
        slot = max(staging_bytes // _SLOTS, B * P * I)
        slot = -(-slot // _SLOT_ALIGN) * _SLOT_ALIGN
        self.ring = StagingRing(dev.device, slot)
        # Whole pages of every layer per slot where one fits (a backup in one pass), else one
        # layer at a time.
        self.group = L if B * L * P * I <= slot else 1
        self.layout = host.layout.value if host.layout is not None else "strided"
        self._slots: dict[tuple[int, int], HostBuffer] = {}

    def capacity(self, group: int) -> int:
        """Pages per chunk when staging ``group`` layers (1 or all)."""
        h = self.host
        return self.ring.slot_bytes // (h.num_buffers * group * h.page_size * h.item_bytes)

    def strides(self, group: int) -> Strides:
        sb, sp, st, sl = stage_strides(self.host, self.capacity(group), group)
        return sb, sp, st, (sl if group > 1 else 0)

    def slot_buffer(self, s: int, group: int) -> HostBuffer:
        """Slot ``s`` described as a host buffer of ``group`` layers' chunk (cached: the copy
        kernel caches its launch per buffer pair). With one layer staged, every layer maps to
        the same bytes (layer stride 0), so a launch for layer ``l`` fills the slot."""
        key = (s, group)
        hb = self._slots.get(key)
        if hb is None:
            h, (sb, sp, st, sl) = self.host, self.strides(group)
            hb = self._slots[key] = HostBuffer.strided(
                self.ring.slot(s),
                num_buffers=h.num_buffers,
                num_layers=h.num_layers,
                num_slots=self.capacity(group) * h.page_size,
                page_size=h.page_size,
                item_bytes=h.item_bytes,
                stride_buffer=sb,
                stride_page=sp,
                stride_token=st,
                stride_layer=sl,
                arg="staging",
            )
        return hb

    def plan(
        self, dev_pages: np.ndarray, host_pages: np.ndarray, *, d2h: bool, per_layer: bool
    ) -> StagedPlan:
        """Plan moving device page ``dev_pages[i]`` to/from host page ``host_pages[i]`` (pairs
        with a ``-1`` side skipped). ``per_layer``: issued one layer at a time."""
        dev, host = self.dev, self.host
        B, L, P, I = dev.num_buffers, dev.num_layers, host.page_size, dev.item_bytes
        keep_pair = (dev_pages >= 0) & (host_pages >= 0)
        dp = dev_pages[keep_pair].astype(np.int64, copy=False)
        hp = host_pages[keep_pair].astype(np.int64, copy=False)
        order = np.argsort(hp, kind="stable")  # host runs become slot runs
        dp, hp = dp[order], hp[order]
        group = 1 if per_layer else self.group
        cap = self.capacity(group)
        stage = self.strides(group)
        device = dev.device
        slots = (dp[:, None] * P + np.arange(P, dtype=np.int64)).reshape(-1)
        dev_idx = torch.from_numpy(slots).to(device, non_blocking=True)
        stage_idx = torch.arange(cap * P, dtype=torch.int64, device=device)
        chunks = []
        for a in range(0, hp.size, cap):
            h = hp[a : a + cap]
            first = np.flatnonzero(np.diff(h, prepend=h[0] - 2) != 1)  # run starts
            lens = np.diff(np.append(first, h.size))
            runs = np.stack([h[first], first, lens], axis=1)
            chunks.append(
                _Chunk(
                    dev_idx=dev_idx[a * P : (a + h.size) * P],
                    stage_idx=stage_idx[: h.size * P],
                    regions=host_regions(host, stage, runs, group),
                )
            )
        layers_per_issue = 1 if per_layer else L
        nbytes = hp.size * B * L * P * I
        calls = sum(c.regions.calls + 1 for c in chunks) * (layers_per_issue // group)
        host_base = host.tensor.data_ptr() + host.offset
        s_layer = host.stride_layer
        ring, knobs, layout = self.ring, self.knobs, self.layout

        def run_chunk(c: _Chunk, layer: int | None, stream: int) -> None:
            g = c.regions
            with ring.lock:
                s = ring.take()
                slot = self.slot_buffer(s, group)
                base = slot.tensor.data_ptr()
                hb = host_base + (layer * s_layer if layer is not None else 0)
                h_rows, s_rows = g.rows_host + hb, g.rows_stage + base
                mats = g.mats.copy()
                mats[:, 0] += hb
                mats[:, 1] += base
                if d2h:
                    copy_device_to_host(
                        dev, slot, c.dev_idx, c.stage_idx, layer=layer, knobs=knobs, check=False
                    )
                    engine_copy(h_rows, s_rows, g.rows_size, mats[:, [0, 4, 1, 5, 2, 3]], stream)
                else:
                    engine_copy(s_rows, h_rows, g.rows_size, mats[:, [1, 5, 0, 4, 2, 3]], stream)
                    copy_host_to_device(
                        slot, dev, c.stage_idx, c.dev_idx, layer=layer, knobs=knobs, check=False
                    )
                ring.give(s)

        def issue(layer: int | None) -> None:
            if per_layer and layer is None:
                raise ValueError("layer: this plan is per layer; pass the layer to issue")
            if per_layer:
                todo: list[int | None] = [layer]
            else:
                todo = [None] if group == L else list(range(L))
            stream = stream_handle(device)
            shown_bytes = nbytes // L if per_layer else nbytes
            with nvtx_range(copy_range_name(d2h, "staged", layer, layout, shown_bytes)):
                for lay in todo:
                    for c in chunks:
                        run_chunk(c, lay, stream)

        return StagedPlan(nbytes, [dev_idx, stage_idx], calls, issue)

    def warmup(self) -> None:
        """Compile the gather and scatter variants this pair issues (no byte moves)."""
        skip = torch.full((self.host.page_size,), -1, dtype=torch.int64, device=self.dev.device)
        for group in {1, self.group}:
            slot = self.slot_buffer(0, group)
            layer = 0 if group == 1 else None
            copy_device_to_host(self.dev, slot, skip, skip, layer=layer, knobs=self.knobs)
            copy_host_to_device(slot, self.dev, skip, skip, layer=layer, knobs=self.knobs)
