"""``TieredKVCache``: the one object a model runner embeds.

A request's life, as a serving engine drives it::

    cache = TieredKVCache(CacheConfig(...))
    req = cache.match(prompt)              # device hit + queued load-back of host hits
    cache.reserve(req, len(prompt) + max_new_tokens)
    cache.start_loading()                  # once per batch: layer-by-layer H→D starts
    # forward: layer i calls cache.wait_layer(i) before reading its KV; it writes new K/V at
    # req.kv_slots[pos] (full layers; the MLA latent there with ``mla_dim``, and the DSA indexer
    # key and scale in page req.kv_slots[pos] // P of cache.indexer_pool with ``indexer``),
    # cache.swa_slots(req)[pos] (SWA layers) and the Mamba state at req.mamba_slot; a sidecar's
    # entries of position pos in page slot // P of cache.sidecar_pools[name], where slot is the
    # position's slot in its anchor (req.kv_slots[pos] or cache.swa_slots(req)[pos])
    cache.computed(req, n)                 # n tokens' KV/state are written (checkpoints Mamba)
    cache.cache_finished_req(req)          # hand the cacheable prefix to the tree
    cache.poll()                           # every scheduler step: acknowledge finished copies

With L3 storage (``CacheConfig.storage``), host pages are written on to storage after each
device→host copy, and a waiting request can first be prefetched from storage::

    pf = cache.prefetch(prompt)            # None: not worth a lookup (short, host pool busy)
    while pf is not None and not pf.done:  # one scheduler step per iteration
        cache.poll()
    req = cache.match(prompt)              # the prefetched pages are now host hits

Positions ``[0, req.cached_len)`` of the prompt come from the cache; the runner computes the rest.
At least the last prompt token is always computed, so the runner has logits to sample from.

Mamba states are exact only at the positions where they were taken: ``computed`` copies the
request's live state into a checkpoint slot each time the computed length reaches a page
boundary, and the finished request caches the state of its last page boundary.
"""

from __future__ import annotations

import atexit
import logging
import time
import weakref
from collections.abc import Callable, Hashable, Iterable, Sequence

import torch

from kvtier.events.config import EventsConfig
from kvtier.nvtx import nvtx_range
from kvtier.runtime.build import build_cache_parts
from kvtier.runtime.config import CacheConfig, StorageConfig
from kvtier.runtime.inserts import RequestInserts
from kvtier.runtime.l3.attach import StorageChange, StorageSwitch
from kvtier.runtime.l3.prefetch import Prefetch
from kvtier.runtime.l3.tier import L3Tier
from kvtier.runtime.metrics import CacheMetrics
from kvtier.runtime.request import Request
from kvtier.runtime.slots import RequestSlots
from kvtier.runtime.tokens import token_list
from kvtier.runtime.tp import all_reduce_max, rank_and_size
from kvtier.runtime.tree.retention import (
    RetentionBudget,
    RetentionClock,
    RetentionHandle,
    RetentionRefused,
    check_priority,
    check_ttl,
)
from kvtier.storage import StorageBackend
from kvtier.storage.keys import canonical_namespace

__all__ = ["Request", "TieredKVCache"]


class TieredKVCache:
    """Device pools, host pools, the unified tree and the controller behind one API.

    Args:
        config: a validated :class:`CacheConfig`.
        tp_group: CPU (gloo) group of tensor-parallel ranks that must agree, or None.
        ack_delay_steps: test hook; see :class:`CacheController`.
        storage_backend: an L3 backend to use instead of building ``config.storage.backend``
            (needs ``config.storage``).
        events: publish KV events (``kvtier.events``; needs ``config.model_id``); None: off.
        clock: seconds on a monotonic clock, for retention TTLs (tests pass a fake one).
    """

    def __init__(
        self,
        config: CacheConfig,
        tp_group=None,
        ack_delay_steps: int = 0,
        storage_backend: StorageBackend | None = None,
        events: EventsConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not callable(clock):
            raise TypeError(f"clock: expected a callable returning seconds, got {clock!r}")
        self.config = config
        self._clock = RetentionClock(clock, agreed=tp_group is not None)
        self._retention_budget = RetentionBudget(
            *config.retention_budget, config.retention_overflow
        )
        parts = build_cache_parts(config, tp_group, ack_delay_steps, storage_backend)
        self.device = parts.device
        self.full_pool = parts.full_pool
        self.sidecar_pools = parts.sidecar_pools
        self.indexer_pool = parts.sidecar_pools.get("indexer")
        self.swa_pool = parts.swa_pool
        self.mamba_pool = parts.mamba_pool
        self.host_full = parts.host_full
        self.host_sidecars = parts.host_sidecars
        self.host_indexer = parts.host_sidecars.get("indexer")
        self.host_swa = parts.host_swa
        self.host_mamba = parts.host_mamba
        self.tree = parts.tree
        self.tree.retention.restamp_at_poll = tp_group is not None  # see Retention
        self.kv_alloc = parts.tree.full.device_alloc
        self.controller = parts.controller
        self.layer_map = parts.layer_map
        self._wait_steps = parts.wait_steps
        self.tier_metrics = parts.tier_metrics
        self._metrics = CacheMetrics(
            parts.tier_metrics, parts.controller.stats, parts.l3.counters if parts.l3 else None
        )
        self._storage = StorageSwitch(
            config,
            parts.l3,
            parts.build_l3,
            parts.tree,
            parts.controller,
            self._metrics,
            agreed=tp_group is not None,
        )
        self.counters = self._metrics.counters
        parts.tree.on_evicted = self._metrics.count_evicted
        self._inserts = RequestInserts(config, parts.tree, parts.controller)
        self._slots = RequestSlots(
            config,
            parts.tree,
            self._inserts,
            parts.swa_pool is not None,
            parts.mamba_pool,
            parts.layer_map,
            parts.device,
        )
        self.requests: dict[int, Request] = {}
        self._closed = False
        self.events = _start_events(self, events, tp_group)
        _OPEN.add(self)  # closed at interpreter exit if still open (see _close_open)
        if self.device.type == "cuda":
            self.warmup()

    def warmup(self) -> None:
        """Compile every copy-kernel variant the cache issues while serving: the backup of each
        pool and its per-layer load (the kernel specializes on the pool and direction only, not
        on sizes, layers or index addresses). Runs at construction on CUDA, so that no request
        waits for a compile; the copies' indices are all ``-1``, so no byte moves."""
        with nvtx_range("kvtier.warmup"):
            for b in self.controller.bindings.values():
                n = 1 if b.name == "mamba" else self.config.page_size
                skip = torch.full((n,), -1, dtype=torch.int64, device=self.device)
                b.backup(skip, skip)
                for pool, layer in self.controller.layer_map:  # its load steps
                    if pool == b.name:
                        b.load(skip, skip, layer)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)

    # -- match and load-back ---------------------------------------------------------------

    def match(
        self, token_ids: Sequence[int], namespace: Hashable = None, priority: int = 0
    ) -> Request:
        """Match ``token_ids`` against the cache, pin the hit, and queue a load-back of host hits.

        The returned request owns a pin on its cached prefix until ``cache_finished_req``.
        """
        self._check_open()
        cfg, tree = self.config, self.tree
        tokens = token_list(token_ids)
        _check_namespace(namespace)
        if type(priority) is not int:
            raise TypeError(f"priority: expected an int, got {priority!r}")
        with nvtx_range(f"kvtier.match {len(tokens)} tokens"):
            m = tree.match_prefix(tokens[:-1], namespace)
        if cfg.retention_refresh_on_hit and tree.retention.handles:
            self.counters.retention_refreshed += tree.retention.refresh(
                m.best_match_node, self._clock.now
            )
        req = Request(
            token_ids=tokens,
            kv_slots=m.device_indices.clone(),
            namespace=namespace,
            priority=priority,
        )
        node = m.last_device_node
        req.pin = tree.pin(node) if node is not tree.root else None
        req.device_hit = req.cache_protected_len = m.device_len
        slot = None
        if self.mamba_pool is not None:
            # The request's own state slot before any load-back, which takes state slots too:
            # taking the last one there made this raise after committing the load.
            slot = tree.alloc_or_evict(tree.mamba, 1)
            if slot is None:
                if req.pin is not None:  # the request never started: release its pin
                    tree.unpin(req.pin)
                raise RuntimeError("mamba: no free state slot for the request")
        if (
            m.best_match_node is not node
            and m.host_hit_length >= max(cfg.load_back_min_tokens, 1)
            and (cfg.load_back_max_tokens is None or m.host_hit_length <= cfg.load_back_max_tokens)
        ):
            books = self.controller.load_back(m.best_match_node)
            if books is not None:
                node = m.best_match_node
                lock = tree.pin(node)
                if req.pin is not None:
                    tree.unpin(req.pin)
                req.pin = lock
                req.kv_slots = tree.path_slots(node)
                # The tokens whose KV is copied: a hybrid model's device path can hold KV
                # without the state a hit needs (a Mamba state, an SWA window), and those
                # tokens are served from the device, not loaded (a user trial: 8 device tokens
                # counted as host hits).
                req.host_hit = books.loaded_tokens
                req.device_hit = req.kv_slots.numel() - req.host_hit
                req.storage_hit = books.l3_tokens
                req.cache_protected_len = req.kv_slots.numel()
                self.counters.load_backs += 1
            else:
                self.counters.load_backs_skipped += 1
        elif m.best_match_node is not node:
            self.counters.load_backs_skipped += 1
        if slot is not None:
            try:
                self._slots.give_mamba_state(req, node, slot)
            except RuntimeError:
                tree.mamba.device_alloc.free(slot)
                req.mamba_slot = None
                if req.pin is not None:  # the request never started: release its pin
                    tree.unpin(req.pin)
                raise
        req.computed_len = req.cached_len
        self._metrics.add_request(len(tokens), req)
        self.requests[id(req)] = req
        return req

    # -- retention -----------------------------------------------------------------------------

    def pin(
        self, prefix: Sequence[int], ttl_s: float, priority: int = 0, namespace: Hashable = None
    ) -> RetentionHandle:
        """Keep the cached prefix of ``prefix`` on device, or at least on host, for ``ttl_s``
        seconds (restarted by each hit under ``retention_refresh_on_hit``; checked in ``poll``).
        Eviction order and what is pinned: ``kvtier.runtime.tree.retention``.

        The longest cached prefix is pinned (``handle.tokens``), and parts of it on device only
        are backed up to host now, under every write policy, so that with L3 it is written to
        storage ahead of unpinned pages. Raises ``ValueError`` when none of ``prefix`` is
        cached, and ``RetentionRefused`` (a ``RuntimeError``, counted) when the pin exceeds the
        budget and ``retention_overflow`` cannot make room. Under TP every rank pins alike.
        """
        self._check_open()
        try:
            tokens = token_list(prefix)
        except (TypeError, ValueError) as e:
            raise type(e)(str(e).replace("token_ids", "prefix", 1)) from None
        _check_namespace(namespace)
        ttl_s = check_ttl(ttl_s)
        check_priority(priority)
        try:
            handle, dropped = self.tree.retention.pin_prefix(
                tokens,
                namespace,
                ttl_s=ttl_s,
                priority=priority,
                now=self._clock.now(),
                budget=self._retention_budget,
            )
        except RetentionRefused:
            self.counters.retention_refused += 1
            raise
        self.counters.retention_pins += 1
        self.counters.retention_dropped += len(dropped)
        for node in self.tree.retention.backup_targets(handle):
            self.controller.backup(node)
        return handle

    def unpin(self, handle: RetentionHandle) -> None:
        """Release a retention pin; its prefix becomes ordinary cache. Refuses another cache's
        handle and one already released (unpinned, expired or dropped)."""
        self.tree.retention.unpin(handle)
        self._storage.book_calls += 1

    # -- L3 prefetch ---------------------------------------------------------------------------

    def prefetch(self, token_ids: Sequence[int], namespace: Hashable = None) -> Prefetch | None:
        """Look the tokens beyond ``token_ids``' cached prefix up in L3 and read them to host.

        Progress is made in ``poll``; once ``done``, ``match`` finds the pages on host. Returns
        None when no prefetch was started (no storage, too short, host pool busy). Under TP
        every rank must make the same calls in the same order.
        """
        self._check_open()
        tokens = token_list(token_ids)
        _check_namespace(namespace)
        if self.l3 is None:
            return None
        with nvtx_range(f"kvtier.prefetch {len(tokens)} tokens"):
            return self.l3.prefetch(tokens, namespace)

    def abort_prefetch(self, prefetch: Prefetch) -> None:
        """Give up ``prefetch`` (request aborted); what it holds is released exactly once."""
        if not isinstance(prefetch, Prefetch):
            raise TypeError(f"prefetch: expected a Prefetch from prefetch(), got {prefetch!r}")
        if self.l3 is not None:
            self.l3.abort(prefetch)

    # -- L3 at run time ------------------------------------------------------------------------

    @property
    def l3(self) -> L3Tier | None:
        """The L3 tier in use (also while it drains for a detach), or None."""
        return self._storage.tier

    @property
    def storage_state(self) -> str:
        """``"detached"``, ``"attached"``, ``"draining"`` (graceful detach) or ``"revoking"``."""
        return self._storage.state

    def attach_storage(
        self,
        storage: StorageConfig | StorageBackend,
        *,
        config: StorageConfig | None = None,
        backfill: bool = True,
    ) -> StorageChange:
        """Attach L3 to the live cache: ``storage`` is a ``StorageConfig`` (its backend is built
        now) or a backend (used as is, never closed by the cache; ``config``, else the cache's
        ``config.storage``, else ``StorageConfig()``, says how prefetch and backup use it).

        The tier is built now, so bad input raises here (``TypeError``/``ValueError``, nothing
        changed); it takes effect in the first ``poll`` at which every TP rank has asked
        (``kvtier.runtime.l3.attach``). Keys then equal those of a cache attached at start-up
        (page hashes of another key seed are dropped). ``backfill``: every page already on
        host is written to the new store at once (an agent switching backends finds its cached
        prefixes there); pages on device only follow when they are backed up, as usual.
        """
        return self._storage.attach(storage, config, backfill)

    def detach_storage(self, graceful: bool = True, timeout_s: float = 30.0) -> StorageChange:
        """Detach L3 from the live cache, in the first ``poll`` at which every TP rank asked.

        Graceful: no new prefetch or backup is started, those in flight finish (each later
        ``poll`` moves them on), and the tier closes once none is left; if that takes more than
        ``timeout_s`` on the agreed clock, the rest is revoked as in a forced detach
        (``outcome`` ``FORCED_AFTER_TIMEOUT``). Forced: prefetches are aborted and backup jobs
        not started are skipped; what they hold is released once their IO stops. The returned
        change is ``done`` when the tier is closed. A second detach, or one with nothing
        attached, is a ``ValueError``.
        """
        return self._storage.detach(graceful, timeout_s)

    def clear_storage(self) -> StorageChange:
        """Remove the pages this cache wrote to the attached backend, in the first ``poll`` at
        which every TP rank asked: through the backend's per-key ``delete`` (the latest million
        pages the tier remembers writing; pages under keys it did not write stay, but a cache of
        the same deployment that wrote the same keys loses them too), or, for a
        backend without ``delete``, whatever its ``clear`` removes; the cache forgets which pages
        it wrote. Writes still in flight may land afterwards. Pages that could not be removed,
        or a ``clear`` that raises, end the change ``FAILED`` with the error (counted); the cache
        keeps working."""
        return self._storage.clear()

    def start_loading(self) -> bool:
        """Start every queued load-back (once per batch, before the forward pass)."""
        self._check_open()
        return self.controller.start_loading()

    def wait_layer(self, layer: int, requests: Sequence[Request] = ()) -> None:
        """Call before layer ``layer`` reads the cache: waits for its loads, copies Mamba states.

        ``layer`` is a model layer in ``[0, len(layer_kinds))``; ``requests`` are the running
        requests of this forward pass (default: every running request). Loads that ``match``
        queued and no ``start_loading`` started yet are started first (see
        ``CacheController.wait_layer``).
        """
        n = len(self.layer_map)
        if type(layer) is not int:
            raise TypeError(f"layer: expected an int model layer, got {layer!r}")
        if not 0 <= layer < n:
            raise ValueError(f"layer: {layer} is not a model layer in [0, {n})")
        requests = _requests(requests)  # once: an iterator would be used up by the checks
        for req in requests:
            self._check_request(req)
        self.controller.wait_layer(self._wait_steps[layer])
        self._slots.copy_states(layer, requests or self.requests.values())

    # -- slots for new tokens ----------------------------------------------------------------

    def reserve(self, req: Request, total_tokens: int) -> torch.Tensor:
        """Make ``req.kv_slots`` cover ``total_tokens`` positions (whole pages); returns them.

        Takes FULL slots only; a hybrid model's SWA slots are taken step by step by
        ``begin_step``. Raises ``RuntimeError``, taking nothing, when room cannot be made (see
        ``RequestSlots._make_room``: pages it evicted before finding that out stay on host).
        """
        self._check_request(req, change=True)
        _check_count(total_tokens, "total_tokens")
        return self._slots.reserve(req, total_tokens)

    def begin_step(self, req: Request, end: int) -> torch.Tensor | None:
        """The runner is about to write positions ``[req.computed_len, end)``: give them SWA
        slots (evicting cached SWA data if the SWA pool is short) and return the SWA slot of
        every position of ``req.kv_slots`` (``-1`` where there is none: outside the window, or
        not reached yet). None for a model without SWA layers.

        Call it before each forward step (a prefill chunk, a decode step); ``computed``
        frees the SWA slots that slid out of the window. Raises ``ValueError`` if ``end`` is
        beyond the reserved slots, and ``RuntimeError`` (taking nothing) if the SWA pool cannot
        hold the step.
        """
        self._check_request(req, change=True)
        return self._slots.begin_step(req, end)

    def swa_slots(self, req: Request) -> torch.Tensor | None:
        """SWA pool slots of the request's positions (-1 where none), or None without SWA."""
        self._check_request(req)
        return self._slots.swa_slots(req)

    def computed(self, req: Request, n_tokens: int) -> None:
        """The runner has written KV/state for the first ``n_tokens`` positions of the request.

        ``n_tokens`` never goes back and never passes the reserved slots; with SWA layers the
        new positions must have had SWA slots (``begin_step``). SWA slots no later position
        reads are freed, and at a page boundary the request's Mamba state is checkpointed, so
        that it can be cached.
        """
        self._check_request(req, change=True)
        self._slots.computed(req, n_tokens)

    def _check_open(self) -> None:
        if self._closed:
            raise ValueError("cache: closed by close(); make a new TieredKVCache")

    def _check_request(self, req: Request, change: bool = False) -> None:
        """Refuse a request that is not one of this cache's running requests; ``change``: a
        call that changes the books (counted: TP ranks compare the counts at each poll)."""
        self._check_open()
        if not isinstance(req, Request):
            raise TypeError(f"req: expected a Request from match(), got {type(req).__name__}")
        if req.released:
            raise ValueError(
                f"req: the request was already {req.released}; its slots and pins were released "
                "(match the prompt again for a new request)"
            )
        if self.requests.get(id(req)) is not req:
            raise ValueError("req: the request was not matched by this cache (another cache's?)")
        self._storage.book_calls += change

    # -- caching requests ------------------------------------------------------------------

    def cache_finished_req(self, req: Request) -> None:
        """Hand the request's cacheable prefix to the tree and release everything it holds.

        ``req.token_ids`` must name at least the ``computed_len`` computed positions (the prompt
        and every generated token fed back); the tree keeps their whole pages.
        """
        self._check_request(req, change=True)
        self._inserts.finish(req)
        self.requests.pop(id(req), None)
        req.released = "finished"
        self._inserts.back_up(req)

    def abort(self, req: Request) -> None:
        """Release everything a request holds without caching it (an aborted or failed request):
        its own slots, Mamba slots, and the pin on its cached prefix."""
        self._check_request(req, change=True)
        if req.mamba_ckpt is not None:
            self.tree.mamba.device_alloc.free(req.mamba_ckpt)
            req.mamba_ckpt = None
        req._pending_cow.clear()
        self.tree.release_req(req)
        self.requests.pop(id(req), None)
        req.released = "aborted"

    def cache_unfinished_req(self, req: Request) -> None:
        """Checkpoint a running request's full pages into the tree (chunked prefill, decode)."""
        self._check_request(req, change=True)
        self._inserts.checkpoint(req)

    # -- per step ----------------------------------------------------------------------------

    def poll(self) -> tuple[int, int]:
        """Acknowledge finished backups and loads, and move L3 prefetches and backups on
        (call once per scheduler step; under TP, one all-reduce). Storage changes every rank
        has asked for are applied here, and expired retention pins released (on the agreed
        clock under TP: ``RetentionClock``)."""
        self._check_open()
        extra = self._storage.votes(self._clock.local_ms())
        acks = self.controller.poll(extra)
        self._clock.agree(self._storage.apply(extra).clock_ms)
        if self.tree.retention.handles:
            self.counters.retention_expired += len(self.tree.retention.expire(self._clock.now()))
        self._metrics.sync_host()
        if self.events is not None:
            self.events.flush()
        return acks

    def evict(self, tokens: int) -> int:
        """Free at least ``tokens`` FULL device slots if possible; returns tokens freed."""
        _check_count(tokens, "tokens")
        self._storage.book_calls += 1
        with nvtx_range(f"kvtier.evict {tokens} tokens"):
            return self.tree.evict(full=tokens).full

    def drain(self) -> None:
        """Wait for and acknowledge every copy in flight, and every L3 backup and prefetch.

        Ends when every rank has nothing outstanding (agreed: MAX), so ranks stay in step.
        After ``close`` only the copies are waited for (the L3 threads are stopped).
        """
        self.controller.drain()
        if self.l3 is None or self._closed:
            return
        while True:
            self.l3.wait_some(0.05)
            self.poll()  # may end a detach: then nothing is outstanding
            left = torch.tensor([self.l3.outstanding if self.l3 else 0], dtype=torch.int64)
            if int(all_reduce_max(left, self.controller.tp_group)) == 0:
                return

    def close(self, cancel: bool = False) -> None:
        """Stop the L3 threads and release the backend (after ``drain``). Later calls that
        would start work (``match``, ``prefetch``, ``pin``, ``start_loading``, ``poll``, and
        every call on a request) raise ``ValueError``; a second ``close`` does nothing.
        ``cancel``: L3 writes and reads still queued are dropped, not waited for."""
        if self._closed:
            return
        self._closed = True
        if self.events is not None:
            self.events.close()  # publishes that this instance holds nothing any more
        self._storage.close(cancel)

    def request_owned(self) -> dict[str, int]:
        """Device slots per pool (``kv``, ``swa``, ``mamba``) running requests hold outside the
        tree."""
        return self._slots.owned(self.requests.values())

    def check_integrity(self) -> None:
        """Recount the tree and every pool against the slots running requests hold (and the
        host slots in-flight prefetches hold)."""
        held = self.l3.held_by_ops() if self.l3 is not None else None
        self.tree.check_integrity(self.request_owned(), held)
        self.tree.retention.check(self._retention_budget)

    def metrics(self) -> dict[str, float]:
        """Every counter as a flat dict (``CacheMetrics.snapshot``): hit tokens per tier, bytes,
        GB/s, submit-to-ack latency, prefetch outcomes, backup failures, L3 decisions."""
        return self._metrics.snapshot()

    def prometheus(self) -> str:
        """Every counter in Prometheus text format."""
        return self._metrics.prometheus()

    def metrics_collector(self):
        """A ``prometheus_client`` collector of every counter, for the engine's registry."""
        return self._metrics.collector()


def _check_namespace(namespace: Hashable) -> None:
    """A request namespace the tree can key and L3 can encode (``canonical_namespace``)."""
    canonical_namespace(namespace)
    try:
        hash(namespace)
    except TypeError as e:  # a set, or a tuple holding one: it cannot key the tree
        raise TypeError(
            f"namespace: {namespace!r:.80} cannot key the tree ({e}); use tuples and frozensets"
        ) from None


def _requests(requests: Iterable[Request]) -> tuple[Request, ...]:
    """``wait_layer``'s requests as a tuple; a single request or None is refused by name."""
    if isinstance(requests, Request) or not isinstance(requests, Iterable):
        raise TypeError(
            f"requests: expected an iterable of Requests (a list of the batch's), got "
            f"{type(requests).__name__}"
        )
    return tuple(requests)


def _check_count(n: int, arg: str) -> None:
    if type(n) is not int:
        raise TypeError(f"{arg}: expected an int, got {n!r}")
    if n < 0:
        raise ValueError(f"{arg}: must be >= 0, got {n}")


def _start_events(cache: TieredKVCache, events: EventsConfig | None, tp_group):
    """The KV-event sink of ``cache`` (rank 0 only: every rank's tree changes alike), or None.
    A bind that fails (endpoint in use) stops what the cache started and raises ``ValueError``."""
    try:
        if events is not None and not isinstance(events, EventsConfig):
            raise TypeError(f"events: expected an EventsConfig or None, got {events!r}")
        rank, size = rank_and_size(tp_group)
        if events is None or rank != 0:
            return None
        from kvtier.events.sink import EventSink  # pyzmq and msgspec: only when events are on

        return EventSink.for_cache(cache, events, size)
    except BaseException:
        cache.events = None
        cache.close()  # stops the L3 threads already started
        raise


_OPEN: weakref.WeakSet[TieredKVCache] = weakref.WeakSet()


@atexit.register
def _close_open() -> None:
    """Close every cache still open when the interpreter exits: its L3 threads (daemons) would
    otherwise be stopped in the middle of a torch call, which aborts the process (a user trial:
    an embedding that never called ``close()`` died with SIGABRT, "terminate called without an
    active exception", after real L3 traffic)."""
    for cache in list(_OPEN):
        try:
            cache.close(cancel=True)  # queued writes are not worth holding the exit for
        except Exception:  # one cache's failure must not keep the others open
            logging.getLogger(__name__).exception("kvtier: closing a cache at exit failed")
