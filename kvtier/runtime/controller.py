"""The cache controller: issues the copies the tree's books call for, and acknowledges them.

- Backup (D→H) runs on a dedicated write stream, all layers in one launch per pool, after the
  compute stream has produced the data.
- Load (H→D) is queued by ``load_back`` and started once per batch by ``start_loading``: layer by
  layer on a dedicated load stream, with one event per layer, so the forward pass can wait for
  layer N while layer N+1 is still loading (``wait_layer``).
- Index tensors, host pins and device locks of an operation live until its completion event has
  fired and the operation is acknowledged in ``poll``; only then are its books released.
- With tensor-parallel ranks, each ``poll`` makes exactly one fixed-size all-reduce (MIN) on a CPU
  (gloo) group over the counts of completed backups and loads, so every rank acknowledges the
  same operations in the same step and their trees change identically. Other agreed values
  (the L3 tier's) ride in the same collective (``poll(extra)``).
- An acknowledged backup is reported to ``on_backup_done`` (the L3 tier writes it on from host).

On CPU there are no streams: copies complete when issued, and ``poll`` acknowledges them.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from kvtier.nvtx import nvtx_range
from kvtier.runtime.tp import all_reduce_max, all_reduce_min
from kvtier.runtime.tree.node import TreeNode
from kvtier.runtime.tree.tree import UnifiedRadixTree
from kvtier.runtime.tree.types import Backup, LoadBack

__all__ = ["CacheController", "PoolBinding", "TransferStats"]


@dataclass
class PoolBinding:
    """How one tree pool's transfers are carried out.

    Attributes:
        name: the tree's pool name ("kv", "swa", "mamba").
        backup: ``(device_idx, host_idx) -> None``: D→H of all layers.
        load: ``(host_idx, device_idx, layer) -> None``: H→D of one pool-local layer.
        bytes_per_index: bytes moved per index across all layers (for the counters).
        num_layers: pool-local layers.
    """

    name: str
    backup: Callable[[torch.Tensor, torch.Tensor], object]
    load: Callable[[torch.Tensor, torch.Tensor, int], object]
    bytes_per_index: int
    num_layers: int


@dataclass
class TransferStats:
    """Monotonic counters of the copies issued and acknowledged.

    ``*_seconds`` is the copies' own time: on CUDA, between events recorded on the copy stream
    right before the first launch and after the last (the stream's idle gaps between launches,
    if the GPU outruns the launching CPU, are inside); on CPU, the synchronous copy's wall
    time. ``*_ack_seconds`` is the latency a scheduler sees: from submission to the ``poll``
    that acknowledged the copy, summed over ``*_acked`` copies.
    """

    d2h_bytes: int = 0
    h2d_bytes: int = 0
    backups: int = 0
    backups_refused: int = 0
    write_back_backups: int = 0
    loads: int = 0
    d2h_seconds: float = 0.0
    h2d_seconds: float = 0.0
    d2h_ack_seconds: float = 0.0
    h2d_ack_seconds: float = 0.0
    d2h_acked: int = 0
    h2d_acked: int = 0
    d2h_timed_bytes: int = 0
    h2d_timed_bytes: int = 0

    def gbps(self, direction: str) -> float:
        """Bytes over the copies' own time (``"d2h"`` or ``"h2d"``); 0 before any was timed."""
        seconds = getattr(self, f"{direction}_seconds")
        return getattr(self, f"{direction}_timed_bytes") / seconds / 1e9 if seconds else 0.0


@dataclass
class _Op:
    kind: str
    books: Backup | list[LoadBack]
    event: torch.cuda.Event | None
    keep_alive: list[torch.Tensor] = field(default_factory=list)
    issued_step: int = 0
    start: torch.cuda.Event | None = None
    nbytes: int = 0
    layer_events: list[torch.cuda.Event | None] = field(default_factory=list)
    submitted: float = field(default_factory=time.perf_counter)


class CacheController:
    """Copies between a tree's device and host pools, with per-layer load events and TP acks.

    Args:
        tree: the tree whose books drive the copies.
        bindings: one :class:`PoolBinding` per tree pool name that has a host tier.
        layer_map: for each model layer, ``(pool name, pool-local layer)``.
        device: where the device pools live.
        tp_group: a CPU (gloo) process group whose ranks must agree on acks, or None.
        ack_delay_steps: acknowledge an operation only after this many ``poll`` calls since it
            was issued (a test hook that makes one rank's completions arrive later).
        on_backup_done: called with ``(books, event)`` once a backup's D→H copy is acknowledged
            (``event``: its completion event on CUDA, already complete; None on CPU).
    """

    def __init__(
        self,
        tree: UnifiedRadixTree,
        bindings: dict[str, PoolBinding],
        layer_map: list[tuple[str, int]],
        device: torch.device,
        tp_group=None,
        ack_delay_steps: int = 0,
        on_backup_done: Callable[[Backup, torch.cuda.Event | None], None] | None = None,
    ) -> None:
        self.tree = tree
        self.bindings = bindings
        self.layer_map = layer_map
        self.device = device
        self.tp_group = tp_group
        self.ack_delay_steps = ack_delay_steps
        self.cuda = device.type == "cuda"
        self.write_stream = torch.cuda.Stream(device) if self.cuda else None
        # Loads gate the forward pass layer by layer: a high-priority stream lets their few
        # copy programs take SM slots as soon as the compute stream's kernels free them.
        self.load_stream = torch.cuda.Stream(device, priority=-1) if self.cuda else None
        self.stats = TransferStats()
        self._backups: deque[_Op] = deque()
        self._loads: deque[_Op] = deque()
        self._queued: list[LoadBack] = []
        self._untimed: deque[_Op] = deque()  # write-back copies, acknowledged at once: timed later
        self._step = 0
        self.on_backup_done = on_backup_done

    # -- helpers ---------------------------------------------------------------------------

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True) if self.cuda else t

    def _after_compute(self, stream: torch.cuda.Stream | None) -> AbstractContextManager:
        """Issue on ``stream``, ordered after what the compute stream has queued (no-op on CPU)."""
        if not self.cuda:
            return nullcontext()
        stream.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(stream)

    def _event(self) -> torch.cuda.Event | None:
        return torch.cuda.Event(enable_timing=True) if self.cuda else None

    # -- backup (D→H) ------------------------------------------------------------------------

    def backup(self, node: TreeNode, wait: bool = False) -> bool:
        """Back ``node`` (and unbacked ancestors) up to host. False if host space ran out.

        ``wait=True`` (write-back eviction, which frees the device slots as soon as this
        returns): the compute stream is ordered after the copy and the books are released at
        once instead of at the next ``poll``.
        """
        books = self.tree.backup(node)
        if books is None:
            self.stats.backups_refused += 1
            return False
        with nvtx_range(f"kvtier.backup {len(books.nodes)} nodes"):
            keep, nbytes = [], 0
            start = self._event()
            t0 = time.perf_counter()
            with self._after_compute(self.write_stream):
                # Indices first, so that the timed span holds the copies alone.
                idx = [
                    (t, self._to_device(t.device_indices), self._to_device(t.host_indices))
                    for t in books.transfers
                ]
                if start is not None:
                    start.record()
                for t, d, h in idx:
                    b = self.bindings[t.pool]
                    keep += [d, h]
                    b.backup(d, h)
                    nbytes += t.device_indices.numel() * b.bytes_per_index
                event = self._event()
                if event is not None:
                    event.record()
        self.stats.backups += 1
        self.stats.d2h_bytes += nbytes
        if not self.cuda:  # synchronous copies: the host clock times them
            self.stats.d2h_seconds += time.perf_counter() - t0
            self.stats.d2h_timed_bytes += nbytes
        if wait:
            self.stats.write_back_backups += 1
            # The caller frees the source slots now. Every later use of them is ordered after
            # the copy: compute waits for it here, and loads start after compute. The index
            # tensors are kept by the allocator until the write stream is done with them.
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
                for t in keep:
                    t.record_stream(self.write_stream)
                self._untimed.append(_Op("backup", books, event, [], self._step, start, nbytes))
            self.tree.finish_backup(books)
            if self.on_backup_done is not None:
                self.on_backup_done(books, event)
            return True
        self._backups.append(_Op("backup", books, event, keep, self._step, start, nbytes))
        return True

    # -- load (H→D) --------------------------------------------------------------------------

    def load_back(self, anchor: TreeNode) -> LoadBack | None:
        """Commit device slots for ``anchor``'s host-only path and queue the copy.

        The copy starts at the next ``start_loading``; until the load is acknowledged its host
        data stays pinned and its device slots locked.
        """
        books = self.tree.load_back(anchor)
        if books is not None:
            self._queued.append(books)
        return books

    def start_loading(self) -> bool:
        """Start every queued load, layer by layer, on the load stream. False if none queued."""
        if not self._queued:
            return False
        loads, self._queued = self._queued, []
        merged: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for lb in loads:
            for t in lb.transfers:
                d, h = merged.setdefault(t.pool, ([], []))
                d.append(t.device_indices)
                h.append(t.host_indices)
        idx = {
            pool: (self._to_device(torch.cat(d)), self._to_device(torch.cat(h)))
            for pool, (d, h) in merged.items()
        }
        nbytes = sum(d.numel() * self.bindings[p].bytes_per_index for p, (d, _) in idx.items())
        events: list[torch.cuda.Event | None] = []
        start = self._event()
        t0 = time.perf_counter()
        with self._after_compute(self.load_stream):
            if start is not None:
                start.record()
            for layer, (pool, pool_layer) in enumerate(self.layer_map):
                if pool in idx:
                    d, h = idx[pool]
                    with nvtx_range(f"kvtier.load layer{layer} {pool}"):
                        self.bindings[pool].load(h, d, pool_layer)
                ev = self._event()
                if ev is not None:
                    ev.record()
                events.append(ev)
        keep = [t for pair in idx.values() for t in pair]
        self.stats.loads += len(loads)
        self.stats.h2d_bytes += nbytes
        if not self.cuda:
            self.stats.h2d_seconds += time.perf_counter() - t0
            self.stats.h2d_timed_bytes += nbytes
        self._loads.append(
            _Op(
                "load",
                loads,
                events[-1] if events else None,
                keep,
                self._step,
                start,
                nbytes,
                events,
            )
        )
        return True

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until layer ``layer`` of every load not yet acknowledged
        is on device.

        Not only this batch's: a load-back marks its nodes on-device when it is queued, so a
        later request can hit them while an earlier batch's copy is still in flight.
        """
        if not self.cuda:
            return
        stream = torch.cuda.current_stream(self.device)
        for op in self._loads:
            ev = op.layer_events[layer]
            if ev is not None:
                stream.wait_event(ev)

    # -- acknowledgements ------------------------------------------------------------------

    def _ready(self, queue: deque[_Op]) -> int:
        n = 0
        for op in queue:
            if self._step - op.issued_step < self.ack_delay_steps:
                break
            if op.event is not None and not op.event.query():
                break
            n += 1
        return n

    def poll(self, extra: torch.Tensor | None = None) -> tuple[int, int]:
        """Acknowledge finished backups and loads (agreed across TP ranks); returns the counts.

        ``extra``: int64 ``[n]`` local values every rank must agree on (MIN), reduced in place
        in the same all-reduce; its length must be the same on every rank and every step.
        """
        self._step += 1
        n_backup, n_load = self._ready(self._backups), self._ready(self._loads)
        if self.tp_group is not None:
            counts = torch.tensor([n_backup, n_load], dtype=torch.int64)
            if extra is not None:
                counts = torch.cat([counts, extra])
            all_reduce_min(counts, self.tp_group)
            n_backup, n_load = int(counts[0]), int(counts[1])
            if extra is not None:
                extra.copy_(counts[2:])
        for _ in range(n_backup):
            op = self._backups.popleft()
            self._account(op, "d2h")
            self.tree.finish_backup(op.books)
            if self.on_backup_done is not None:
                self.on_backup_done(op.books, op.event)
        for _ in range(n_load):
            op = self._loads.popleft()
            self._account(op, "h2d")
            for lb in op.books:
                self.tree.finish_load_back(lb)
        while self._untimed and self._untimed[0].event.query():
            self._time(self._untimed.popleft(), "d2h")
        return n_backup, n_load

    def _account(self, op: _Op, direction: str) -> None:
        """An acknowledged copy: its submit-to-ack latency and (on CUDA) its own time."""
        st = self.stats
        latency = time.perf_counter() - op.submitted
        if direction == "d2h":
            st.d2h_ack_seconds += latency
            st.d2h_acked += 1
        else:
            st.h2d_ack_seconds += latency
            st.h2d_acked += 1
        self._time(op, direction)

    def _time(self, op: _Op, direction: str) -> None:
        if op.event is None or op.start is None:
            return  # CPU: timed when issued
        op.event.synchronize()
        seconds = op.start.elapsed_time(op.event) / 1e3
        st = self.stats
        if direction == "d2h":
            st.d2h_seconds += seconds
            st.d2h_timed_bytes += op.nbytes
        else:
            st.h2d_seconds += seconds
            st.h2d_timed_bytes += op.nbytes

    def drain(self) -> None:
        """Wait for every issued copy and acknowledge it (shutdown, tests).

        Every rank loops the same number of times: the loop's condition is agreed (MAX of the
        operations still outstanding), so the collectives stay in step.
        """
        if self._queued:
            self.start_loading()
        while True:
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.poll()
            remaining = torch.tensor([len(self._backups) + len(self._loads)], dtype=torch.int64)
            if int(all_reduce_max(remaining, self.tp_group)) == 0:
                return

    @property
    def in_flight(self) -> int:
        return len(self._backups) + len(self._loads) + len(self._queued)
