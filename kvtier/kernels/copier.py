"""Copies between one device pool and one host pool, on the path ``io_backend`` picks.

A :class:`HostCopier` is built once per pool pair and caches what does not change between calls:
the chunk geometry (every tensor's address and the host strides), whether the copy engine can
run here, and (on first use) the staged path's device ring. Each batch of indices becomes a
:class:`CopyPlan` first (descriptors on the copy engine, device-side index tensors on the kernel,
slot regions and chunk indices on the staged path) and is issued after, so a layer-by-layer load
pays the planning once per batch and each layer's issue is one call::

    plan = copier.plan(dev_slots, host_slots, d2h=False, per_layer=True)   # CPU work, once
    for layer in range(L):
        plan.issue(layer)          # one cudaMemcpyBatchAsync (or one launch); record an event
    # keep plan.keep alive until the last event has fired

Indices are int64 token slots on the CPU (the tree's books), in page-aligned runs, ``-1``
skipping a run. ``index_group=G`` says that each item of the pools covers ``G`` slots (the DSA
indexer: one item per KV page), so the item of slot run ``s`` is ``s // G``.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier.kernels.copy_engine import (
    ChunkGeometry,
    Descriptors,
    LayerEntries,
    PageRuns,
    engine_support,
    memcpy_batch,
    page_runs,
    runs_descriptors,
    stream_handle,
    upload_indices,
)
from kvtier.kernels.dispatch import (
    CROSSOVERS,
    Route,
    RouteReason,
    check_io_backend,
    debug_checks,
    select_impl,
    select_route,
)
from kvtier.kernels.kv_transfer import TransferKnobs, copy_device_to_host, copy_host_to_device
from kvtier.kernels.layout import DeviceBuffers, HostBuffer
from kvtier.kernels.staged import DEFAULT_STAGING_BYTES, STAGED_KNOBS, Stager
from kvtier.nvtx import copy_range_name, nvtx_range

__all__ = ["CopyPlan", "HostCopier", "IssueWorker", "Ticket"]


@dataclass
class CopyPlan:
    """One batch of a copy, ready to issue.

    Attributes:
        route: the path it takes and why.
        nbytes: bytes it moves over all its layers.
        keep: tensors the copy reads asynchronously: keep them alive until its event fired.
        descriptors: copy-engine descriptors of its largest call (0 on the kernel path; on the
            staged path, copy-engine calls plus kernel launches of its largest issue).
        lead: a kernel plan of the same copy, for the first layer a load issues (``plan(...,
            lead=True)`` or ``plan(..., lead_plan=)`` on the copy-engine and staged routes);
            None otherwise.
    """

    route: Route
    d2h: bool
    nbytes: int
    keep: list[torch.Tensor] = field(default_factory=list)
    descriptors: int = 0
    _issue: Callable[[int | None], None] | None = None
    lead: CopyPlan | None = None

    def issue(self, layer: int | None = None) -> str:
        """Enqueue the copy of ``layer`` (a per-layer plan) or of every layer (a whole plan) on
        the current stream; returns the path taken."""
        if self._issue is not None:
            self._issue(layer)
        return self.route.path


class HostCopier:
    """Device↔host copies of one pool pair (see the module docstring).

    Args:
        dev: the device pool's buffers.
        host: the host pool's buffer (same buffers, layers and item size).
        io_backend: "auto", "kernel", "copy_engine" or "staged" (see
            :func:`~kvtier.kernels.dispatch.select_route`).
        knobs: launch knobs of the kernel path.
        index_group: slots per item (1, or the KV page size for the DSA indexer's pages).
        staging_bytes: the staged path's device ring (allocated on its first use).
        staged_knobs: launch knobs of the staged path's gather and scatter.
    """

    def __init__(
        self,
        dev: DeviceBuffers,
        host: HostBuffer,
        *,
        io_backend: str = "auto",
        knobs: TransferKnobs | None = None,
        index_group: int = 1,
        staging_bytes: int = DEFAULT_STAGING_BYTES,
        staged_knobs: TransferKnobs = STAGED_KNOBS,
    ) -> None:
        check_io_backend(io_backend)
        for name, v in (("index_group", index_group), ("staging_bytes", staging_bytes)):
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name}: expected an int, got {v!r}")
            if v < 1:
                raise ValueError(f"{name} must be >= 1, got {v!r}")
        if not isinstance(staged_knobs, TransferKnobs):
            raise TypeError(f"staged_knobs: expected TransferKnobs, got {staged_knobs!r}")
        if dev.item_bytes != host.item_bytes or dev.num_layers != host.num_layers:
            raise ValueError(
                f"host: {host.num_layers} layers of {host.item_bytes} B items, the device pool "
                f"has {dev.num_layers} of {dev.item_bytes} B"
            )
        self.dev, self.host = dev, host
        self.io_backend = io_backend
        self.knobs = knobs
        self.index_group = index_group
        self.staging_bytes = staging_bytes
        self.staged_knobs = staged_knobs
        self._stager: Stager | None = None
        self.kernel_path = select_impl(dev.device)
        self.geometry = ChunkGeometry.of(dev, host)
        self.layout = host.layout.value if host.layout is not None else "strided"
        # The probe reads driver versions: once per pool pair, not per call.
        support = engine_support(dev.device) if io_backend != "kernel" else None
        self.engine_reason = "" if support is None or support.ok else support.reason
        # What plan_lead worked out for an inline copy-engine load, for the plan() call that
        # follows it with the same index tensors, unchanged (their versions): page ids,
        # descriptor count and route once.
        self._counted: _Counted | None = None

    # -- routing ---------------------------------------------------------------------------

    def route(self, *, d2h: bool, call_bytes: int, descriptors: int = 0) -> Route:
        """The path a call of ``call_bytes`` bytes (``descriptors`` copy-engine descriptors, 0:
        not weighed) in this direction takes on the current stream."""
        legacy = False
        if self.dev.device.type == "cuda" and not self.engine_reason:
            legacy = stream_handle(self.dev.device) == 0
        return select_route(
            self.io_backend,
            kernel_path=self.kernel_path,
            engine_reason=self.engine_reason,
            contiguous=self.geometry.contiguous,
            legacy_stream=legacy,
            d2h=d2h,
            chunk_bytes=self.geometry.chunk_bytes,
            call_bytes=call_bytes,
            descriptors=descriptors,
        )

    # -- planning ----------------------------------------------------------------------------

    def _items(self, idx: torch.Tensor, name: str) -> np.ndarray:
        """Token slots (CPU int64) → item slots, as numpy (no copy where ``index_group`` is 1)."""
        if not isinstance(idx, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor, got {type(idx).__name__}")
        if idx.device.type != "cpu" or idx.dtype != torch.int64 or idx.dim() != 1:
            raise ValueError(
                f"{name}: expected 1-D int64 token slots on the CPU, got {tuple(idx.shape)} "
                f"{idx.dtype} on {idx.device}"
            )
        a = idx.numpy()
        G = self.index_group
        if G == 1:
            return a
        if a.size % G:
            raise ValueError(f"{name}: {a.size} slots is not a whole number of runs of {G}")
        first = a[::G]
        return np.where(first >= 0, first // G, -1)

    def plan(
        self,
        dev_idx: torch.Tensor,
        host_idx: torch.Tensor,
        *,
        d2h: bool,
        per_layer: bool,
        check: bool | None = None,
        lead: bool = False,
        lead_plan: CopyPlan | None = None,
    ) -> CopyPlan:
        """Plan the copy between device slots ``dev_idx`` and host slots ``host_idx``.

        ``per_layer``: issued one layer at a time (``plan.issue(layer)``); otherwise all layers
        in one call (``plan.issue()``). The route is chosen for the current stream: plan on the
        stream you will issue on. ``check``: range and page-run checks of the indices (on the
        CPU, no sync; default :func:`~kvtier.kernels.dispatch.debug_checks`). ``lead``: under
        ``io_backend="auto"``, a per-layer load that takes the copy engine also gets
        ``plan.lead``, a kernel plan of the same copy, for the layer issued first: before the
        forward pass computes, the kernel's SMs are free and its launch starts the copy at
        once, where the copy engine would first spend the batch's enqueue (H100, bench_e2e: the
        first layer waited 1.9 ms, its copy alone takes 0.6 ms). A forced ``"copy_engine"``
        gets no lead: no copy of it takes SMs. ``lead_plan``: this copy's ``plan_lead``, made
        (and its first layer issued) before: reused as the plan's lead on the copy-engine and
        staged routes, or as the plan itself (its uploaded indices) on the kernel route; only
        for a per-layer host-to-device load.
        """
        if lead_plan is not None and (d2h or not per_layer):
            raise ValueError(
                f"lead_plan: only for a per-layer host-to-device load, got d2h={d2h}, "
                f"per_layer={per_layer}"
            )
        counted, self._counted = self._counted, None
        known: Route | None = None  # plan_lead's route and count, for a per-layer load
        runs: PageRuns | None = None
        if counted is not None and counted.of(dev_idx, host_idx):
            d_items, h_items, layer_bytes = counted.d_items, counted.h_items, counted.layer_bytes
            pages, runs = counted.pages, counted.runs
            if not d2h and per_layer:
                known = counted.route
        else:
            pages = None
            d_items, h_items, layer_bytes = self._pair(dev_idx, host_idx)
        if check if check is not None else debug_checks():
            P = self.host.page_size
            _check_runs(d_items, "dev_idx", self.dev.num_slots, P, self.index_group)
            _check_runs(h_items, "host_idx", self.host.num_slots, P, self.index_group)
        L = self.dev.num_layers
        call_bytes = layer_bytes if per_layer else layer_bytes * L
        route = known or self.route(d2h=d2h, call_bytes=call_bytes)
        if route.path == self.kernel_path:
            return self._plan_kernel(route, d_items, h_items, d2h, layer_bytes * L, lead_plan)
        d_pages, h_pages = pages or (self._pages(d_items), self._pages(h_items))
        if route.path == "staged":
            return _with_lead(self._plan_staged(route, d_pages, h_pages, d2h, per_layer), lead_plan)
        geom = self.geometry
        if runs is None:
            runs = page_runs(geom, d_pages, h_pages)

        @functools.cache
        def build() -> Descriptors:
            return runs_descriptors(geom, runs, d2h=d2h, layers=range(L), per_layer=per_layer)

        # A load's descriptors are built when its first copy-engine step is issued (on the
        # issue worker, or inline for a batch of few): here only counted, for the route. A
        # backup's are built now.
        most = runs.layer_descriptors(geom) if per_layer else _most(build())
        if self.io_backend == "auto" and known is None:
            # Weigh what enqueueing this batch costs: its largest call's descriptors.
            route = self.route(d2h=d2h, call_bytes=call_bytes, descriptors=most)
            if route.path == "staged":
                plan = self._plan_staged(route, d_pages, h_pages, d2h, per_layer)
                return _with_lead(plan, lead_plan)
            if route.path != "copy_engine":
                return self._plan_kernel(route, d_items, h_items, d2h, layer_bytes * L, lead_plan)
        inline = CROSSOVERS["d2h" if d2h else "h2d"].inline_descriptors
        if per_layer and most <= inline:
            # Few entries a layer: each built in Python when its layer is issued (LayerEntries),
            # not the whole batch's with numpy before the first layer's call.
            group: Callable[[int], tuple] = LayerEntries(geom, runs, d2h=d2h)
        else:
            group = lambda g: _group(build(), g)  # noqa: E731
        plan = self._plan_engine(route, group, most, layer_bytes * L, d2h, per_layer)
        if (
            lead_plan is None
            and lead
            and per_layer
            and not d2h
            and self.io_backend == "auto"
            and most > CROSSOVERS["h2d"].inline_descriptors
        ):
            lead_route = Route(self.kernel_path, RouteReason.LEAD_LAYER)
            lead_plan = self._plan_kernel(lead_route, d_items, h_items, d2h, layer_bytes)
        return _with_lead(plan, lead_plan)

    def plan_lead(self, dev_idx: torch.Tensor, host_idx: torch.Tensor) -> CopyPlan | None:
        """The kernel plan of a per-layer load, for the first layer a load issues, made before
        the rest of the batch is planned so that layer starts at once (route, page ids and
        descriptor counts then come after its launch); pass it to ``plan(..., lead_plan=)``.
        None under a forced ``"copy_engine"`` or ``"staged"`` (no copy of those takes SMs), and
        where ``"auto"`` sends the load to the copy engine in calls of at most the crossover's
        ``inline_descriptors``: such a call starts the copy for less CPU than the
        kernel's index upload and launch."""
        self._counted = None
        if self.io_backend not in ("auto", "kernel"):
            return None
        d_items, h_items, layer_bytes = self._pair(dev_idx, host_idx)
        inline = self._inline_engine(d_items, h_items, layer_bytes)
        if inline is not None:
            versions = (dev_idx._version, host_idx._version)
            self._counted = _Counted(
                dev_idx, host_idx, versions, d_items, h_items, layer_bytes, *inline
            )
            return None
        route = Route(self.kernel_path, RouteReason.LEAD_LAYER)
        return self._plan_kernel(route, d_items, h_items, False, layer_bytes)

    def _inline_engine(
        self, d_items: np.ndarray, h_items: np.ndarray, layer_bytes: int
    ) -> tuple[tuple[np.ndarray, np.ndarray], PageRuns, Route] | None:
        """Both sides' page ids, their runs (:func:`page_runs`) and the route, where
        ``"auto"`` sends a per-layer host-to-device load of these items to the copy engine in
        calls of at most the crossover's ``inline_descriptors`` (see ``plan_lead``); None
        otherwise."""
        if self.io_backend != "auto" or self.engine_reason or not self.geometry.contiguous:
            return None
        pages = self._pages(d_items), self._pages(h_items)
        runs = page_runs(self.geometry, *pages)
        most = runs.layer_descriptors(self.geometry)
        route = self.route(d2h=False, call_bytes=layer_bytes, descriptors=most)
        if route.path == "copy_engine" and most <= CROSSOVERS["h2d"].inline_descriptors:
            return pages, runs, route
        return None

    def _pair(
        self, dev_idx: torch.Tensor, host_idx: torch.Tensor
    ) -> tuple[np.ndarray, np.ndarray, int]:
        """Both sides' item slots (``_items``), checked to pair up, and the bytes one layer of
        the copy moves (items valid on both sides)."""
        d_items = self._items(dev_idx, "dev_idx")
        h_items = self._items(host_idx, "host_idx")
        if d_items.size != h_items.size:
            raise ValueError(
                f"dev_idx has {dev_idx.numel()} slots but host_idx has {host_idx.numel()}"
            )
        n_valid = int(np.count_nonzero((d_items >= 0) & (h_items >= 0)))
        return d_items, h_items, n_valid * self.dev.num_buffers * self.dev.item_bytes

    def _pages(self, items: np.ndarray) -> np.ndarray:
        """Page-aligned runs of P item slots → page ids (a run's first slot names its page)."""
        P = self.host.page_size
        first = items[::P]
        return np.where(first >= 0, first // P, -1)

    def _plan_kernel(
        self,
        route: Route,
        d_items: np.ndarray,
        h_items: np.ndarray,
        d2h: bool,
        nbytes: int,
        like: CopyPlan | None = None,
    ) -> CopyPlan:
        if like is not None:  # the lead made before: same indices, already on the device
            return CopyPlan(route, d2h, nbytes, like.keep, _issue=like._issue)
        # Both index arrays in one upload (each ``.to`` costs ~35 us of CPU on an H100 host,
        # on the critical path of a load's lead layer).
        both = upload_indices((d_items, h_items), self.dev.device)
        d, h = both[0], both[1]
        dev, host, knobs = self.dev, self.host, self.knobs

        def issue(layer: int | None) -> None:
            if d2h:
                copy_device_to_host(dev, host, d, h, layer=layer, knobs=knobs, check=False)
            else:
                copy_host_to_device(host, dev, h, d, layer=layer, knobs=knobs, check=False)

        return CopyPlan(route, d2h, nbytes, [d, h], _issue=issue)

    def _plan_engine(
        self,
        route: Route,
        group: Callable[[int], tuple[np.ndarray, np.ndarray, np.ndarray, int]],
        most: int,
        total: int,
        d2h: bool,
        per_layer: bool,
    ) -> CopyPlan:
        # ``group(g)`` gives group ``g``'s call (``(dst, src, sizes, bytes)``), made when it is
        # first issued: on the issue worker for all but a load's first layer; for a load
        # enqueued inline, its first ``1 + load_ahead`` layers in ``start_loading`` and the
        # rest at the forward pass's waits.
        groups: dict[int, tuple] = {}
        device, layout = self.dev.device, self.layout

        def issue(layer: int | None) -> None:
            if per_layer and layer is None:
                raise ValueError("layer: this plan is per layer; pass the layer to issue")
            g = layer if per_layer else 0
            call = groups.get(g)
            if call is None:
                call = groups[g] = group(g)
            dsts, srcs, sizes, nbytes = call
            shown = layer if per_layer else None
            with nvtx_range(copy_range_name(d2h, "copy_engine", shown, layout, nbytes)):
                memcpy_batch(dsts, srcs, sizes, stream_handle(device))

        return CopyPlan(route, d2h, total, [], descriptors=most, _issue=issue)

    def stager(self) -> Stager:
        """The staged path of this pair (its ring is allocated on first use)."""
        if self._stager is None:
            self._stager = Stager(
                self.dev, self.host, staging_bytes=self.staging_bytes, knobs=self.staged_knobs
            )
        return self._stager

    def _plan_staged(
        self, route: Route, d_pages: np.ndarray, h_pages: np.ndarray, d2h: bool, per_layer: bool
    ) -> CopyPlan:
        sp = self.stager().plan(d_pages, h_pages, d2h=d2h, per_layer=per_layer)
        return CopyPlan(route, d2h, sp.nbytes, sp.keep, descriptors=sp.calls, _issue=sp.issue)

    def warmup(self) -> None:
        """Compile the staged path's gather and scatter where this pair may take it (the
        kernel path's variants are compiled by the pools' own warmup)."""
        if self.engine_reason or self.io_backend in ("kernel", "copy_engine"):
            return
        if self.io_backend == "staged" or any(x.staged for x in CROSSOVERS.values()):
            self.stager().warmup()


@dataclass
class _Counted:
    """What ``plan_lead`` worked out for an inline copy-engine load, for the ``plan`` call of
    the same index tensors that follows it."""

    dev_idx: torch.Tensor
    host_idx: torch.Tensor
    versions: tuple[int, int]  # the tensors' versions then: rewritten in place, not reused
    d_items: np.ndarray
    h_items: np.ndarray
    layer_bytes: int
    pages: tuple[np.ndarray, np.ndarray]
    runs: PageRuns  # a layer's call: a descriptor per (buffer, run) at most
    route: Route

    def of(self, dev_idx: torch.Tensor, host_idx: torch.Tensor) -> bool:
        """Whether these are the same tensors, unchanged."""
        return (
            self.dev_idx is dev_idx
            and self.host_idx is host_idx
            and self.versions == (dev_idx._version, host_idx._version)
        )


def _with_lead(plan: CopyPlan, lead: CopyPlan | None) -> CopyPlan:
    """``plan`` with ``lead`` as the kernel plan of its first layer (kept alive with it)."""
    if lead is not None:
        plan.lead = lead
        plan.keep += lead.keep
    return plan


def _check_runs(items: np.ndarray, name: str, limit: int, P: int, group: int) -> None:
    """Items in ``[0, limit)`` in page-aligned runs of ``P`` (or runs of ``-1``)."""
    if not items.size:
        return
    bad = (items < -1) | (items >= limit)
    if bad.any():
        v = int(items[np.flatnonzero(bad)[0]])
        raise ValueError(f"{name}: item {v} outside [0, {limit}) (and -1 for skip)")
    if items.size % P:
        raise ValueError(f"{name}: {items.size} items is not a whole number of pages of {P}")
    runs = items.reshape(-1, P)
    first = runs[:, :1]
    ok = ((runs == first + np.arange(P)).all(1) & (first[:, 0] % P == 0)) | (runs == -1).all(1)
    if not ok.all():
        row = int(np.flatnonzero(~ok)[0])
        unit = f" (slots / {group})" if group > 1 else ""
        raise ValueError(
            f"{name}: items{unit} {runs[row][:4].tolist()}... at page {row} are not one "
            f"page-aligned run of {P}"
        )


def _most(desc: Descriptors) -> int:
    """Descriptors of the largest call of a batch."""
    return int(np.diff(desc.offsets).max()) if len(desc.offsets) > 1 else 0


def _group(desc: Descriptors, g: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    src, dst, sizes = desc.group(g)
    return dst, src, sizes, int(sizes.sum())


class Ticket:
    """Progress of one job on an :class:`IssueWorker`: steps enqueued so far, and its error.

    Paced (``ahead``): the job enqueues step ``i`` only once a waiter has asked for step
    ``i - ahead`` or later (:meth:`gate`), so a layer-by-layer load enqueues a layer or two
    ahead of the forward pass's ``wait_layer`` instead of all of them in one burst as the
    forward starts, when every launch it delays is a delay of the GPU (H100, bench_e2e: a burst
    of 31 layers stretched layer 0 from 1.5 to 2.5-3.2 ms). Where nobody waits step by step, a
    gate gives up after ``pace_s`` and the rest is enqueued at once.
    """

    def __init__(
        self,
        steps: int,
        done: int = 0,
        ahead: int | None = None,
        pace_s: float = 0.002,
        hold: bool = False,
    ) -> None:
        self.steps = steps
        self._done = done
        self._error: BaseException | None = None
        self._cond = threading.Condition()
        self._ahead = ahead
        # As InlineSteps: the first step and ``ahead`` more before anyone waits; ``hold`` (a
        # paced job): none past ``done`` until the first wait (or ``pace_s``).
        if ahead is None:
            self._allowed = steps
        else:
            self._allowed = min(steps, done if hold else max(done, 1) + ahead)
        self._pace_s = pace_s

    def unpace(self) -> None:
        """Allow every step now (another job waits behind this one on the worker)."""
        with self._cond:
            if self._allowed < self.steps:
                self._allowed = self.steps
                self._cond.notify_all()

    def gate(self, step: int) -> bool:
        """Called by the job before it enqueues step ``step`` (0-based): returns once a waiter
        has allowed it, or after ``pace_s`` (then every later step is allowed too). True if it
        had to wait (the copy stream may have gone idle since the step before)."""
        with self._cond:
            if step < self._allowed:
                return False
            if not self._cond.wait_for(lambda: step < self._allowed, timeout=self._pace_s):
                self._allowed = self.steps  # nobody waits step by step: stop pacing
            return True

    def advance(self) -> None:
        """Called by the job after each step it has enqueued."""
        with self._cond:
            self._done += 1
            self._cond.notify_all()

    def _fail(self, error: BaseException) -> None:
        with self._cond:
            self._error, self._done = error, self.steps
            self._cond.notify_all()

    def wait(self, steps: int | None = None) -> None:
        """Block until ``steps`` steps (default: all) are enqueued; re-raise the job's error.
        A paced job may then run up to ``ahead`` steps past them."""
        need = self.steps if steps is None else steps
        with self._cond:
            allowed = min(self.steps, need + (self._ahead or 0))
            if allowed > self._allowed:
                self._allowed = allowed
                self._cond.notify_all()
            self._cond.wait_for(lambda: self._done >= need)
            if self._error is not None:
                raise RuntimeError("a copy could not be enqueued") from self._error

    def done(self) -> bool:
        """Whether every step is enqueued (re-raises the job's error)."""
        with self._cond:
            if self._error is not None:
                raise RuntimeError("a copy could not be enqueued") from self._error
            return self._done >= self.steps


class IssueWorker:
    """One thread that enqueues copies in submission order, off the caller's thread.

    The driver spends about 1 µs per copy-engine descriptor inside ``cudaMemcpyBatchAsync``
    (issue #12: 28 ms for a 32768-chunk backup, 0.6-0.9 ms per 1024-chunk layer), and the call
    releases the GIL while it runs. Issued from here, that time overlaps the scheduler and the
    forward pass's launches instead of delaying them; a waiter blocks only until the step it
    needs has been enqueued (:meth:`Ticket.wait`), long before that step's copy completes.
    """

    def __init__(self, name: str = "kvtier-issue") -> None:
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._name = name
        self._thread: threading.Thread | None = None
        self._running: Ticket | None = None  # the job being run

    def submit(
        self,
        job: Callable[[Ticket], None],
        steps: int,
        done: int = 0,
        ahead: int | None = None,
        pace_s: float = 0.002,
        hold: bool = False,
    ) -> Ticket:
        """Run ``job(ticket)`` on the worker; it calls ``ticket.advance()`` after each of its
        ``steps - done`` steps (``done``: steps the caller enqueued itself, first), and with
        ``ahead`` (a paced ticket) ``ticket.gate(i)`` before step ``i``; ``hold``: a paced job
        enqueues nothing past ``done`` before the first wait (see ``Ticket``)."""
        ticket = Ticket(steps, done, ahead, pace_s, hold)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        running = self._running  # read first: the job put next may start at once
        self._jobs.put((job, ticket))
        if running is not None:
            # A paced job must not hold up the one queued behind it (a later batch's load, a
            # backup): it enqueues the rest of its steps at once (a finished one: no effect).
            running.unpace()
        return ticket

    def _run(self) -> None:
        while True:
            job, ticket = self._jobs.get()
            self._running = ticket
            if not self._jobs.empty():
                ticket.unpace()
            try:
                job(ticket)
            except BaseException as e:  # handed to the waiters: a worker never dies silently
                ticket._fail(e)
            finally:
                self._running = None
