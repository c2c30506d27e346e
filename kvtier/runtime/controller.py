"""The cache controller: issues the copies the tree's books call for, and acknowledges them.

- Backup (D→H) runs on a dedicated write stream, all layers in one call per pool (one batched
  copy-engine call or one kernel launch), after the compute stream has produced the data.
- Load (H→D) is queued by ``load_back`` and started once per batch by ``start_loading``: layer by
  layer on a dedicated load stream, with one event per layer, so the forward pass can wait for
  layer N while layer N+1 is still loading (``wait_layer``). Its descriptors (or device-side
  indices) are built once per batch, before the first layer is issued.
- Each pool's copies go through its :class:`~kvtier.kernels.copier.HostCopier`, which picks the
  copy engine or the kernel per transfer (``io_backend``); the path and the reason are counted in
  :class:`TransferStats`.
- A batch with copy-engine plans is enqueued by a worker thread (:class:`IssueWorker`): the
  driver's cost per descriptor then stays off the scheduler's thread. ``wait_layer(i)`` first
  waits (on the CPU) until step ``i`` is enqueued, then makes the stream wait for its event;
  ``poll`` acknowledges an operation only once all of it is enqueued.
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

import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from kvtier.kernels.copier import CopyPlan, HostCopier, IssueWorker, Ticket
from kvtier.kernels.dispatch import CROSSOVERS, RouteReason
from kvtier.nvtx import nvtx_range
from kvtier.runtime.tp import all_reduce_max, all_reduce_min
from kvtier.runtime.tree.node import TreeNode
from kvtier.runtime.tree.tree import UnifiedRadixTree
from kvtier.runtime.tree.types import Backup, LoadBack

__all__ = ["BoundCopier", "CacheController", "PoolBinding", "TransferStats"]


@dataclass(frozen=True)
class BoundCopier:
    """One pool pair a binding moves.

    ``layers`` maps the layer of a load step (what ``PoolBinding.load`` receives) to the pair's
    own layer, and a step whose layer is missing moves nothing of this pair (a sidecar that
    holds only some layers); None: the same numbers. ``index_group`` lives in the copier.
    """

    copier: HostCopier
    layers: Mapping[int, int] | None = None

    def own(self, layer: int) -> int | None:
        """The pair's own layer for a load step's ``layer``; None: the step moves nothing of it."""
        return layer if self.layers is None else self.layers.get(layer)


@dataclass
class PoolBinding:
    """How one tree pool's transfers are carried out.

    Attributes:
        name: the tree's pool name ("kv", "swa", "mamba").
        backup: ``(device_idx, host_idx) -> None``: D→H of all layers, kernel path, indices on
            the device (used where ``copiers`` is empty, and by ``warmup``).
        load: ``(host_idx, device_idx, layer) -> None``: H→D of one pool-local layer, likewise.
        bytes_per_index: bytes moved per index across all layers (for the counters).
        num_layers: pool-local layers.
        copiers: the pool pairs this binding moves, each on the path its ``io_backend`` picks
            (the anchor pool, then the sidecars' pages that ride along); they take the tree's
            CPU indices. Empty: ``backup``/``load`` carry the copies.
    """

    name: str
    backup: Callable[[torch.Tensor, torch.Tensor], object]
    load: Callable[[torch.Tensor, torch.Tensor, int], object]
    bytes_per_index: int
    num_layers: int
    copiers: tuple[BoundCopier, ...] = ()


# The paths a planned copy can take (``Route.path``): the copy engine, the staged path, and the
# kernel path's implementations (``kvtier.kernels.dispatch.select_impl``).
COPY_PATHS = ("copy_engine", "staged", "triton", "interpreter", "torch")


@dataclass
class TransferStats:
    """Monotonic counters of the copies issued and acknowledged.

    ``*_seconds`` is the copies' own time: on CUDA, the sum over each run of steps issued at
    once of the span between events recorded on the copy stream right before its first launch
    and after its last (a load issued as the forward pass waits is several runs, and the gaps
    between them, where the stream waits for the next issue, are left out; idle gaps inside a
    run, if the GPU outruns the launching CPU, are inside); on CPU, the synchronous copy's wall
    time. ``*_ack_seconds`` is the latency a scheduler sees: from submission to the ``poll``
    that acknowledged the copy, summed over ``*_acked`` copies.

    ``paths`` counts planned copies (one per pool pair per backup or load batch, plus the
    kernel lead of a copy-engine load's first layer) by ``"<d2h|h2d>.<path>"``
    (``copy_engine``, ``staged``, ``triton``, ``interpreter``, ``torch``);
    ``route_reasons`` counts them by :class:`~kvtier.kernels.dispatch.RouteReason` value.
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
    # Every path and reason from the start, at 0: a dashboard or alert sees each series before
    # its first count.
    paths: dict[str, int] = field(
        default_factory=lambda: {f"{d}.{p}": 0 for d in ("d2h", "h2d") for p in COPY_PATHS}
    )
    route_reasons: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in RouteReason})

    def count_plan(self, plan: CopyPlan) -> None:
        key = f"{'d2h' if plan.d2h else 'h2d'}.{plan.route.path}"
        self.paths[key] = self.paths.get(key, 0) + 1
        reason = plan.route.reason.value
        self.route_reasons[reason] = self.route_reasons.get(reason, 0) + 1

    def gbps(self, direction: str) -> float:
        """Bytes over the copies' own time (``"d2h"`` or ``"h2d"``); 0 before any was timed."""
        seconds = getattr(self, f"{direction}_seconds")
        return getattr(self, f"{direction}_timed_bytes") / seconds / 1e9 if seconds else 0.0


class InlineSteps:
    """A load's steps issued by the thread that waits for them (the kernel path's launches):
    ``load_ahead`` steps when the load starts, then up to ``ahead`` steps past each step a
    waiter asks for, so a forward pass launches the copies of later layers between its own
    layers instead of waiting for all of them before its first (H100, bench_e2e: 32 launches,
    ~1 ms of CPU before the forward). The same calls as :class:`~kvtier.kernels.copier.Ticket`:
    ``wait(steps)`` issues what it needs; ``done()``, asked when acknowledging, issues the rest,
    so a load nobody waits on step by step is still issued whole by the next ``poll``."""

    def __init__(
        self, issue: Callable[[int, int], None], steps: int, issued: int, ahead: int
    ) -> None:
        self.steps = steps
        self._issue, self._issued, self._ahead = issue, issued, ahead
        self._error: BaseException | None = None
        self._lock = threading.Lock()  # a poll on another thread never passes a step in issue

    def _to(self, stop: int) -> None:
        with self._lock:
            if self._error is not None:  # a step's copy may be missing: no wait may pass it
                raise RuntimeError("a copy could not be enqueued") from self._error
            stop = min(stop, self.steps)
            if stop > self._issued:
                try:
                    self._issue(self._issued, stop)
                except BaseException as e:
                    self._error = e
                    raise RuntimeError("a copy could not be enqueued") from e
                self._issued = stop

    @property
    def issued(self) -> int:
        """Steps issued so far."""
        return self._issued

    def wait(self, steps: int | None = None) -> None:
        """Issue every step up to ``steps`` (default: all) and ``ahead`` more."""
        self._to(self.steps if steps is None else steps + self._ahead)

    def done(self) -> bool:
        """Issue the rest; True (every step is then issued)."""
        self._to(self.steps)
        return True


@dataclass
class _Op:
    kind: str
    books: Backup | list[LoadBack]
    # A backup's completion event; a load's is its last layer event (``event``), recorded
    # when that step is enqueued.
    end: torch.cuda.Event | None
    keep_alive: list[torch.Tensor] = field(default_factory=list)
    issued_step: int = 0
    # ``(step, event)`` recorded before the first step of each run of steps issued at once; a
    # run ends at the step before the next one's (its layer event), the last at ``event``.
    starts: list[tuple[int, torch.cuda.Event]] = field(default_factory=list)
    nbytes: int = 0
    layer_events: list[torch.cuda.Event | None] = field(default_factory=list)
    submitted: float = field(default_factory=time.perf_counter)
    # Enqueued by the worker (Ticket) or by its waiters (InlineSteps): its events exist once
    # it is done.
    ticket: Ticket | InlineSteps | None = None

    @property
    def event(self) -> torch.cuda.Event | None:
        """The event after the operation's last copy (None on CPU, or before it is enqueued)."""
        return self.layer_events[-1] if self.layer_events else self.end

    def enqueued(self) -> bool:
        return self.ticket is None or self.ticket.done()


class _OnStream:
    """``torch.cuda.stream(stream)`` without its device lookups: that context manager and
    ``current_stream(None)`` ask for the current device through ``torch.cuda.is_available`` (an
    environment read) each time, ~30 us of CPU per use on an H100 host, several per load before
    the forward pass. Where the thread's current device is not the stream's (a worker thread
    starts on device 0), it is ``torch.cuda.stream`` itself: ``set_stream`` would switch the
    device."""

    __slots__ = ("_stream", "_prev", "_ctx")

    def __init__(self, stream: torch.cuda.Stream) -> None:
        self._stream = stream
        self._prev: torch.cuda.Stream | None = None
        self._ctx: AbstractContextManager | None = None

    def __enter__(self) -> None:
        index = self._stream.device_index
        if torch.cuda.current_device() != index:
            self._ctx = torch.cuda.stream(self._stream)
            self._ctx.__enter__()
            return
        if _GET_STREAM is None:
            self._prev = torch.cuda.current_stream(index)
        else:  # (id, device index, device type): no Stream object built for it
            self._prev = _GET_STREAM(index)
        torch.cuda.set_stream(self._stream)

    def __exit__(self, *exc) -> None:
        if self._ctx is not None:
            self._ctx.__exit__(*exc)
        elif _GET_STREAM is None:
            torch.cuda.set_stream(self._prev)
        else:
            sid, index, kind = self._prev
            _SET_STREAM(stream_id=sid, device_index=index, device_type=kind)


# The current stream as (id, device index, device type), and setting it back from those, as
# ``torch.cuda.current_stream`` / ``set_stream`` do underneath, minus the ``Stream`` object
# (several µs of CPU each on an H100 host); both or neither.
_GET_STREAM = getattr(torch._C, "_cuda_getCurrentStream", None)
_SET_STREAM = getattr(torch._C, "_cuda_setStream", None)
if _SET_STREAM is None:
    _GET_STREAM = None


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat`` of index tensors; one is returned as is (a batch of one request: ~15 us of
    the CPU before the forward saved per call on an H100 host)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def _worth_a_worker(plans: list[CopyPlan]) -> bool:
    """Whether a batch is worth the issue worker: it has staged plans (their launches) or
    copy-engine plans of calls over their direction's ``Crossover.inline_descriptors`` (about
    1 µs of CPU a descriptor). A batch of few descriptors is enqueued inline: the worker's
    Python would contend with the forward pass's launches for the GIL for longer than the calls
    take (H200, bench_e2e: the forward's first kernels launched ~1 ms late beside it)."""
    return any(
        p.route.path == "staged"
        or (
            p.route.path == "copy_engine"
            and p.descriptors > CROSSOVERS["d2h" if p.d2h else "h2d"].inline_descriptors
        )
        for p in plans
    )


class CacheController:
    """Copies between a tree's device and host pools, with per-layer load events and TP acks.

    Args:
        tree: the tree whose books drive the copies.
        bindings: one :class:`PoolBinding` per tree pool name that has a host tier.
        layer_map: the load steps in order, ``(pool name, layer)``: step ``i`` loads ``layer``
            through ``bindings[pool]`` and records event ``i`` (``wait_layer(i)``).
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
        # When the oldest queued load was queued (the poll count then) and the stream that was
        # current there: a load no batch started by the poll after next is started by that
        # poll, ordered after that stream's work (see ``poll``).
        self._queued_at: tuple[int, torch.cuda.Stream | None] | None = None
        self._untimed: deque[_Op] = deque()  # write-back copies, acknowledged at once: timed later
        self._step = 0
        self.on_backup_done = on_backup_done
        self._worker = IssueWorker() if self.cuda else None
        # Enqueue copy-engine batches from the worker thread (False: inline, as kernels are).
        self.offload_enqueue = True
        # The worker enqueues a load's step at most this many steps ahead of the forward pass's
        # latest wait_layer (Ticket pacing; None: every step at once).
        self.load_ahead: int | None = 2
        # True: the worker enqueues none of a load's later steps before the forward pass's
        # first wait_layer (or 2 ms), so that its enqueueing leaves the forward's first
        # launches alone. Off: measured better in one H100 call of three and equal in two
        # (profiling/results/bench_e2e_paths.md, tenth session); ``bench_e2e --hold``.
        self.hold_until_wait = False

    def bind_backup_done(
        self, on_backup_done: Callable[[Backup, torch.cuda.Event | None], None] | None
    ) -> None:
        """Report acknowledged backups to ``on_backup_done`` from now on (L3 attached or
        detached at run time); None: to no one."""
        self.on_backup_done = on_backup_done

    # -- helpers ---------------------------------------------------------------------------

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True) if self.cuda else t

    def _after_compute(
        self, stream: torch.cuda.Stream | None, compute: torch.cuda.Stream | None = None
    ) -> AbstractContextManager:
        """Issue on ``stream``, ordered after what the compute stream (default: the current
        one) has queued (no-op on CPU)."""
        if not self.cuda:
            return nullcontext()
        stream.wait_stream(compute or torch.cuda.current_stream(self.device))
        return _OnStream(stream)

    def _event(self) -> torch.cuda.Event | None:
        return torch.cuda.Event(enable_timing=True) if self.cuda else None

    def _on(self, stream: torch.cuda.Stream | None) -> AbstractContextManager:
        """Issue on ``stream`` from whichever thread runs this (no-op on CPU)."""
        return _OnStream(stream) if stream is not None else nullcontext()

    def _offload(self, plans: list[CopyPlan]) -> bool:
        """Whether a batch is enqueued by the worker (see ``_worth_a_worker``)."""
        return self._worker is not None and self.offload_enqueue and _worth_a_worker(plans)

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
            starts = [(0, start)] if start is not None else []
            t0 = time.perf_counter()
            with self._after_compute(self.write_stream):
                # Plans (descriptors, device-side indices) first, so that the timed span holds
                # the copies alone.
                plans: list[CopyPlan] = []
                idx = []
                for t in books.transfers:
                    b = self.bindings[t.pool]
                    nbytes += t.device_indices.numel() * b.bytes_per_index
                    if b.copiers:
                        plans += [
                            c.copier.plan(
                                t.device_indices,
                                t.host_indices,
                                d2h=True,
                                per_layer=False,
                                check=False,  # the tree's own allocators made them
                            )
                            for c in b.copiers
                        ]
                    else:
                        idx.append(
                            (b, self._to_device(t.device_indices), self._to_device(t.host_indices))
                        )
                for p in plans:
                    keep += p.keep
                    self.stats.count_plan(p)
                keep += [t for _, d, h in idx for t in (d, h)]
                event = self._event()
                stream = self.write_stream

                def enqueue(ticket: Ticket | None = None) -> None:
                    with self._on(stream):
                        if start is not None:
                            start.record()
                        for p in plans:
                            p.issue()
                        for b, d, h in idx:
                            b.backup(d, h)
                        if event is not None:
                            event.record()
                    if ticket is not None:
                        ticket.advance()

                ticket = None
                if not wait and self._offload(plans):
                    ticket = self._worker.submit(enqueue, 1)
                else:
                    enqueue()
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
                self._untimed.append(_Op("backup", books, event, [], self._step, starts, nbytes))
            self.tree.finish_backup(books)
            if self.on_backup_done is not None:
                self.on_backup_done(books, event)
            return True
        op = _Op("backup", books, event, keep, self._step, starts, nbytes, ticket=ticket)
        self._backups.append(op)
        return True

    # -- load (H→D) --------------------------------------------------------------------------

    def load_back(self, anchor: TreeNode) -> LoadBack | None:
        """Commit device slots for ``anchor``'s host-only path and queue the copy.

        The copy starts at the next ``start_loading``; until the load is acknowledged its host
        data stays pinned and its device slots locked.
        """
        books = self.tree.load_back(anchor)
        if books is not None:
            if not self._queued:
                compute = torch.cuda.current_stream(self.device) if self.cuda else None
                self._queued_at = (self._step, compute)
            self._queued.append(books)
        return books

    def start_loading(self, compute: torch.cuda.Stream | None = None) -> bool:
        """Start every queued load, layer by layer, on the load stream, ordered after the work
        ``compute`` (default: the current stream) has queued. False if none queued."""
        if not self._queued:
            return False
        loads, self._queued = self._queued, []
        self._queued_at = None
        merged: dict[str, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for lb in loads:
            for t in lb.transfers:
                d, h = merged.setdefault(t.pool, ([], []))
                d.append(t.device_indices)
                h.append(t.host_indices)
        cpu_idx = {pool: (_cat(d), _cat(h)) for pool, (d, h) in merged.items()}
        nbytes = sum(d.numel() * self.bindings[p].bytes_per_index for p, (d, _) in cpu_idx.items())
        # Each step's event is made and recorded when the step is enqueued (33 events made up
        # front cost ~85 us of CPU before the forward pass on an H100 host); a waiter reads it
        # only after the step is enqueued (see wait_layer).
        events: list[torch.cuda.Event | None] = [None] * len(self.layer_map)
        starts: list[tuple[int, torch.cuda.Event]] = []
        t0 = time.perf_counter()
        plans: dict[str, list[tuple[BoundCopier, CopyPlan]]] = {}
        idx: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        first_pool, first_layer = self.layer_map[0] if self.layer_map else (None, None)
        stream = self.load_stream

        def enqueue(
            ticket: Ticket | None = None,
            first: int = 0,
            stop: int | None = None,
            use: dict[str, list[tuple[BoundCopier, CopyPlan]]] | None = None,
        ):
            by_pool = plans if use is None else use
            with self._on(stream):
                for i, (pool, layer) in enumerate(self.layer_map[first:stop], first):
                    resumed = ticket is not None and ticket.gate(i)
                    if self.cuda and (i == first or resumed):  # a run of steps starts
                        run = self._event()
                        run.record(stream)
                        starts.append((i, run))
                    with nvtx_range(f"kvtier.load layer{layer} {pool}"):
                        for c, p in by_pool.get(pool, ()):
                            own = c.own(layer)
                            if own is not None:
                                # The first step through the kernel where the plan has a
                                # lead (see HostCopier.plan): the forward pass waits on it.
                                (p.lead if i == 0 and p.lead is not None else p).issue(own)
                        if pool in idx:
                            d, h = idx[pool]
                            self.bindings[pool].load(h, d, layer)
                    if self.cuda:
                        ev = events[i] = self._event()
                        ev.record(stream)
                    if ticket is not None:
                        ticket.advance()

        ticket: Ticket | InlineSteps | None = None
        with self._after_compute(self.load_stream, compute):
            try:
                # The batch's first step at once, through the kernel, before the rest is
                # planned (HostCopier.plan_lead): the forward pass's first layer waits on it,
                # and its route, page ids and descriptor counts can come after its launch
                # (H100 host: ~0.3 ms of planning no longer ahead of the first copy).
                leads: list[tuple[BoundCopier, CopyPlan]] = []
                if first_pool in cpu_idx:
                    d, h = cpu_idx[first_pool]
                    for c in self.bindings[first_pool].copiers:
                        if c.own(first_layer) is not None:
                            lp = c.copier.plan_lead(d, h)
                            if lp is None:  # a forced path takes no lead: no early step
                                leads = []
                                break
                            leads.append((c, lp))
                if leads:
                    enqueue(first=0, stop=1, use={first_pool: leads})
                early = {id(c): lp for c, lp in leads}  # first-pool copiers only
                # Every layer's descriptors (or the device-side indices) once per batch, before
                # the later layers are issued: the per-layer issue is then one call per pool
                # pair. A plan that owns the batch's first step gets a kernel lead for it.
                for pool, (d, h) in cpu_idx.items():
                    copiers = self.bindings[pool].copiers
                    if copiers:
                        plans[pool] = []
                        for c in copiers:
                            lead = pool == first_pool and c.own(first_layer) is not None
                            plan = c.copier.plan(
                                d,
                                h,
                                d2h=False,
                                per_layer=True,
                                check=False,
                                lead=lead,
                                lead_plan=early.get(id(c)),
                            )
                            plans[pool].append((c, plan))
                    else:
                        idx[pool] = (self._to_device(d), self._to_device(h))
                done = 1 if early else 0  # steps issued already
                all_plans = [p for pool_plans in plans.values() for _, p in pool_plans]
                steps, ahead = len(self.layer_map), self.load_ahead
                if not self._offload(all_plans):
                    # The first ``1 + ahead`` steps now, the rest as the forward pass waits
                    # for them. Kernel copies start before the forward's kernels take the
                    # SMs. Copy-engine calls too: right after the first they cost ~20 µs
                    # each, where the first wait paid ~110 µs a call with the CPU's caches
                    # cold, and at that wait the forward is still launch-bound (H200,
                    # bench_e2e --layer-trace: layer 0's attention launched 0.22 ms late).
                    head = 1 + ahead if ahead else 1
                    if not self.cuda or not ahead or steps <= head:
                        enqueue(first=done)
                    else:
                        enqueue(first=done, stop=head)
                        ticket = InlineSteps(
                            lambda a, b: enqueue(first=a, stop=b), steps, head, ahead
                        )
                elif not done and not any(p.lead is not None for p in all_plans):
                    ticket = self._worker.submit(enqueue, steps, ahead=ahead or None)
                else:
                    # The lead step here, at once (if not issued above); the worker enqueues
                    # the rest while the forward runs, ``load_ahead`` steps ahead of its waits.
                    if not done:
                        enqueue(first=0, stop=1)
                    ticket = self._worker.submit(
                        lambda t: enqueue(t, first=1),
                        steps,
                        done=1,
                        ahead=ahead or None,
                        hold=self.hold_until_wait,
                    )
            except BaseException:
                # Nothing is in flight on the books: the batch goes back to the queue (its
                # nodes already count as on device), so a later start_loading issues it again;
                # copies this call enqueued before failing move the same bytes again.
                self._queued = loads + self._queued
                self._queued_at = (self._step, compute)
                raise
        keep = [t for pair in idx.values() for t in pair]
        for pool_plans in plans.values():
            for _, p in pool_plans:
                keep += p.keep
                self.stats.count_plan(p)
                if p.lead is not None:
                    self.stats.count_plan(p.lead)
        self.stats.loads += len(loads)
        self.stats.h2d_bytes += nbytes
        if not self.cuda:
            self.stats.h2d_seconds += time.perf_counter() - t0
            self.stats.h2d_timed_bytes += nbytes
        self._loads.append(
            _Op(
                "load",
                loads,
                None,
                keep,
                self._step,
                starts,
                nbytes,
                events,
                ticket=ticket,
            )
        )
        return True

    def wait_layer(self, layer: int) -> None:
        """Make the current stream wait until layer ``layer`` of every load not yet acknowledged
        is on device.

        Not only this batch's: a load-back marks its nodes on-device when it is queued, so a
        later request can hit them while an earlier batch's copy is still in flight. Loads
        queued and not started yet (a ``match`` with no ``start_loading`` after it: the next
        batch matched while this one runs, or a wait before the batch's start) are started
        first, ordered after the stream current when they were queued (as ``poll`` does): a
        wait passed over them returned at once, and the states copied after it were read from
        slots nothing had loaded yet (a user trial: a Mamba state silently wrong).
        """
        if self._queued:
            self.start_loading(self._queued_at[1] if self._queued_at is not None else None)
        for op in self._loads:
            if op.ticket is not None:
                op.ticket.wait(layer + 1)  # until step ``layer`` is enqueued: its event exists
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
            if not op.enqueued():  # an event not yet recorded would query as complete
                break
            if op.event is not None and not op.event.query():
                break
            n += 1
        return n

    def poll(self, extra: torch.Tensor | None = None) -> tuple[int, int]:
        """Acknowledge finished backups and loads (agreed across TP ranks); returns the counts.

        ``extra``: int64 ``[n]`` local values every rank must agree on (MIN), reduced in place
        in the same all-reduce; its length must be the same on every rank and every step.

        Loads queued before the previous ``poll`` and still not started (their requests were
        aborted before a batch ran, so no ``start_loading`` came) are started first, ordered
        after the stream that was current when they were queued: their device slots and pins
        are released once they land, instead of waiting for the next batch (found in a user
        trial: an aborted request's load held device pages no eviction could free). A load
        queued since the previous poll is left to the batch's ``start_loading``.
        """
        if self._queued_at is not None and self._queued_at[0] < self._step:
            self.start_loading(self._queued_at[1])
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
        if op.event is None or not op.starts:
            return  # CPU: timed when issued
        op.event.synchronize()
        ends = [op.layer_events[i - 1] for i, _ in op.starts[1:]] + [op.event]
        seconds = sum(s.elapsed_time(e) for (_, s), e in zip(op.starts, ends)) / 1e3
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
            for op in (*self._backups, *self._loads):
                if op.ticket is not None:
                    op.ticket.wait()
            if self.cuda:
                torch.cuda.synchronize(self.device)
            self.poll()
            remaining = torch.tensor([len(self._backups) + len(self._loads)], dtype=torch.int64)
            if int(all_reduce_max(remaining, self.tp_group)) == 0:
                return

    @property
    def in_flight(self) -> int:
        return len(self._backups) + len(self._loads) + len(self._queued)
