"""L3 on the Mooncake distributed store (``mooncake.store.MooncakeDistributedStore``).

Each page object is stored as two parts of one Mooncake object, header then payload, with
``batch_put_from_multi_buffers`` and read back with ``batch_get_into_multi_buffers``: the payload
parts are the caller's page buffers themselves (one, or a page's K and V ranges) and the 32-byte
header sits in a small registered arena owned by this backend. So neither direction copies the page in Python, and the checksum costs one
read pass over the page (no copy) on each side.

Page buffers must lie inside a region given to ``register_host_buffer`` (normally the whole
pinned host pool, registered once): the transfer engine moves bytes only between registered
memory (RDMA registration; on TCP it also lets the engine use the buffer directly).

Facts about the client this relies on (mooncake-transfer-engine-non-cuda 0.3.13):

* ``setup`` against an unreachable master retries for about 90 s, so the master's RPC port is
  probed first with ``connect_timeout_s`` and an unreachable master raises ``ConnectionError``
  naming the address.
* Calls report per key: ``batch_is_exist`` 1/0, ``batch_get_*`` bytes read, ``batch_put_*`` 0,
  or a negative ``mooncake::ErrorCode``. ``RPC_FAIL`` (-900) means the master did not answer
  (``UNAVAILABLE_IN_CURRENT_STATUS``, -1010, an HA master that cannot serve); a miss is
  ``OBJECT_NOT_FOUND`` (-704) and a full store ``NO_AVAILABLE_HANDLE`` (-200).
* Once the master is gone, the first call fails at once (its connection reads EOF) and every
  later call only after about 4 s of the client's own reconnect attempts.
* The client reconnects by itself: its ping thread keeps reconnecting ("Failed to ping master
  ... reconnecting") and calls made once the master is back on the same address are answered.
  It then remounts its segment, and until it has (about a second) puts fail with
  ``NO_AVAILABLE_HANDLE``. A restarted master has lost every object. Buffers given to
  ``register_buffer`` are registered with the local transfer engine, not the master, so they
  stay valid across a master restart and need no re-registration.
* ``close`` holds the GIL while it talks to the master (about 2 s with a live master, 6-12 s of
  retries with a dead one), and ``health_check`` still answers "healthy" seconds after the master
  died. So ``close`` first probes the master's port itself; if nothing answers it does not call
  the client's ``close`` and parks the dead client until process exit (whose teardown then still
  spends about 12 s in the client's own retries).
* The client listens on every interface whatever ``MC_TCP_BIND_ADDRESS`` says; run it inside a
  network namespace (or on a trusted network).

Surviving a master outage. Every ``batch_*`` call goes through a ``CircuitBreaker``: a call is a
failure when the master did not answer any of its keys (``RPC_FAIL`` or
``UNAVAILABLE_IN_CURRENT_STATUS`` for all, or an exception); misses and other per-key errors are
answers. After ``breaker_failures`` consecutive failures the breaker opens: calls then fail at
once, every page ``False`` (counted failed pages: a failed backup, a prefetch miss), instead of
each waiting about 4 s. After the cooldown one call probes: first the master's port (within
``probe_timeout_s``, so a probe of a dead master costs no client timeout), then the call itself;
the cooldown doubles after each failed probe, up to ``breaker_max_cooldown_s``. Writes retry the
pages the master did not take, with jittered exponential backoff (``RetryPolicy``), until
``write_retry_budget_s`` has passed since the call began, or since the master first stopped
answering if that was earlier: a short outage (a master restart) is ridden out, while in a long
one every write fails at once once the outage is older than the budget. What is still not
written is reported ``False``, which the base class counts in ``failed_pages.write``. A put
refused for space within that budget of the master having been unreachable is retried too: the
client is most likely still remounting its segment on a restarted master.
"""

from __future__ import annotations

import bisect
import logging
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum

import torch

from kvtier.checks import is_finite
from kvtier.metrics import TierMetrics
from kvtier.storage.base import Parts, StorageBackend
from kvtier.storage.breaker import (
    Backoff,
    BreakerEvent,
    BreakerState,
    CircuitBreaker,
    RetryPolicy,
)
from kvtier.storage.keys import KeyScope
from kvtier.storage.page_format import HEADER_SIZE, buffer_of, make_header, verify

__all__ = ["MooncakeBackend", "MooncakeConfig"]

log = logging.getLogger(__name__)

_ARENA_PAGES = 4096  # header slots per arena; larger batches go in chunks of this many pages
_PARKED: list[object] = []  # clients of dead masters: their teardown would block on retries

# mooncake::ErrorCode values (mooncake-store/include/types.h) this backend tells apart.
_RPC_FAIL = -900
_UNAVAILABLE_IN_CURRENT_STATUS = -1010
_NO_AVAILABLE_HANDLE = -200
_OBJECT_NOT_FOUND = -704
_UNANSWERED = frozenset({_RPC_FAIL, _UNAVAILABLE_IN_CURRENT_STATUS})  # the master did not answer


class _Put(Enum):
    """What became of one page in one write attempt."""

    STORED = "stored"
    RETRY = "retry"  # the store was unreachable (or still remounting): worth another attempt
    FAILED = "failed"


@dataclass(frozen=True)
class MooncakeConfig:
    """Attributes:
    master_address: ``host:port`` of ``mooncake_master``'s RPC service.
    metadata_server: transfer-engine metadata: ``"P2PHANDSHAKE"`` (no server needed) or the URL
        of an HTTP metadata server, e.g. the master's own (``http://host:port/metadata``).
    local_hostname: address other clients reach this one at (and ``MC_TCP_BIND_ADDRESS``).
    protocol: ``"tcp"``, or ``"rdma"`` with ``device_name``.
    device_name: RDMA devices (comma-separated); empty for TCP.
    global_segment_size: bytes of memory this client contributes to the distributed pool. Objects
        live in the segments of the clients that mounted them and vanish when that client exits;
        for pages that outlive the serving process, run a standalone ``mooncake_client`` with the
        memory and set 0 here.
    local_buffer_size: bytes of the client's own staging buffer (unused on the zero-copy path).
    connect_timeout_s: bound on reaching the master at start-up.
    breaker_failures: consecutive unanswered calls that open the circuit breaker.
    breaker_cooldown_s: how long the open breaker fails calls at once before it probes.
    breaker_max_cooldown_s: cap of that cooldown, which doubles after each failed probe.
    probe_timeout_s: bound on a probe's connection to the master's port.
    write_retry_budget_s: how long a write retries pages the master did not take (0: never).
    """

    master_address: str
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = 256 << 20
    local_buffer_size: int = 16 << 20
    connect_timeout_s: float = 5.0
    breaker_failures: int = 3
    breaker_cooldown_s: float = 0.5
    breaker_max_cooldown_s: float = 8.0
    probe_timeout_s: float = 1.0
    write_retry_budget_s: float = 5.0

    def __post_init__(self) -> None:
        host, sep, port = self.master_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"master_address must be host:port, got {self.master_address!r}")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if self.global_segment_size < 0 or self.local_buffer_size <= 0:
            raise ValueError("need global_segment_size >= 0 and local_buffer_size > 0")
        n = self.breaker_failures
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"breaker_failures must be an int >= 1, got {n!r}")
        for name in ("breaker_cooldown_s", "breaker_max_cooldown_s", "probe_timeout_s"):
            value = getattr(self, name)
            if not _seconds(value) or value == 0:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        if self.breaker_max_cooldown_s < self.breaker_cooldown_s:
            raise ValueError(
                f"breaker_max_cooldown_s must be >= breaker_cooldown_s "
                f"({self.breaker_cooldown_s}), got {self.breaker_max_cooldown_s!r}"
            )
        budget = self.write_retry_budget_s
        if not _seconds(budget):
            raise ValueError(
                f"write_retry_budget_s must be a finite number of seconds >= 0, got {budget!r}"
            )

    def breaker(
        self,
        clock: Callable[[], float] = time.monotonic,
        on_event: Callable[[BreakerEvent, BreakerState], None] | None = None,
    ) -> CircuitBreaker:
        """A circuit breaker with this config's thresholds."""
        return CircuitBreaker(
            self.breaker_failures,
            self.breaker_cooldown_s,
            self.breaker_max_cooldown_s,
            clock=clock,
            on_event=on_event,
        )

    def retry_policy(self) -> RetryPolicy:
        """The backoff of writes: first retry after about 50 ms, at most 1 s apart."""
        return RetryPolicy(budget_s=self.write_retry_budget_s)


def _seconds(value: object) -> bool:
    """Whether ``value`` is a finite, non-negative number of seconds."""
    return (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and is_finite(value)
        and value >= 0
    )


class _Arenas:
    """Registered header arenas, one per concurrent call, reused across calls."""

    def __init__(self, register: Callable[[torch.Tensor], None]):
        self._register = register
        self._free: list[torch.Tensor] = []
        self._all: list[torch.Tensor] = []
        self._mutex = threading.Lock()

    def acquire(self) -> torch.Tensor:
        with self._mutex:
            if self._free:
                return self._free.pop()
        arena = torch.zeros(_ARENA_PAGES * HEADER_SIZE, dtype=torch.uint8)
        self._register(arena)
        with self._mutex:
            self._all.append(arena)
        return arena

    def release(self, arena: torch.Tensor) -> None:
        with self._mutex:
            self._free.append(arena)

    def all(self) -> list[torch.Tensor]:
        with self._mutex:
            return list(self._all)


class MooncakeBackend(StorageBackend):
    """Page objects in a Mooncake distributed store; see the module docstring.

    ``breaker`` is the ``CircuitBreaker`` every store call goes through (its ``state`` and
    ``stats()``; its events are also counted in ``metrics``).
    """

    name = "mooncake"
    Config = MooncakeConfig

    def __init__(
        self,
        config: MooncakeConfig,
        *,
        scope: KeyScope | None = None,
        metrics: TierMetrics | None = None,
    ):
        super().__init__(scope=scope, metrics=metrics)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as e:
            raise ImportError(
                "the mooncake backend needs `pip install mooncake-transfer-engine-non-cuda` "
                "(CPU hosts, plus Debian's libibverbs1) or `mooncake-transfer-engine` (GPU hosts)"
            ) from e
        self.config = config
        if not self._master_answers():
            raise ConnectionError(
                f"mooncake master at {config.master_address} is unreachable "
                f"(waited {config.connect_timeout_s} s)"
            )
        os.environ.setdefault("MC_TCP_BIND_ADDRESS", config.local_hostname)
        self._store = MooncakeDistributedStore()
        rc = self._store.setup(
            config.local_hostname,
            config.metadata_server,
            config.global_segment_size,
            config.local_buffer_size,
            config.protocol,
            config.device_name,
            config.master_address,
        )
        if rc != 0:
            raise ConnectionError(
                f"mooncake setup against master {config.master_address} "
                f"(metadata {config.metadata_server}) failed with code {rc}"
            )
        self._regions: list[tuple[int, int]] = []  # sorted (start, end) of registered memory
        self._regions_mutex = threading.Lock()
        self._arenas = _Arenas(self._register)
        self._clock = time.monotonic
        self._in_outage = False
        self.breaker = config.breaker(self._clock, self._on_breaker_event)
        self._retry = config.retry_policy()
        self._rng = random.Random()
        self._closing = threading.Event()  # wakes writes out of their backoff on close
        self._unanswered_at: float | None = None  # last time the master did not answer a call

    def _master_answers(self, timeout: float | None = None) -> bool:
        host, _, port = self.config.master_address.rpartition(":")
        try:
            socket.create_connection(
                (host, int(port)), timeout or self.config.connect_timeout_s
            ).close()
        except OSError:
            return False
        return True

    def _on_breaker_event(self, event: BreakerEvent, state: BreakerState) -> None:
        # Through self.metrics at event time: the L3 tier swaps in its own metrics after build.
        # Called under the breaker's lock, so in order: one warning per outage, not per probe.
        self.metrics.record_breaker(event, state)
        if event is BreakerEvent.OPENED and not self._in_outage:
            self._in_outage = True
            log.warning(
                "mooncake master %s is not answering: L3 calls fail at once until a probe is "
                "answered",
                self.config.master_address,
            )
        elif event is BreakerEvent.RECOVERED:
            self._in_outage = False
            log.warning("mooncake master %s answers again", self.config.master_address)

    # -- guarded store calls ----------------------------------------------------------------------

    def _call(self, fn: Callable[[], Sequence[int]]) -> list[int] | None:
        """One store call under the breaker: its per-key codes, or None when it was not made
        (breaker open, or a probe that found the master's port closed)."""
        ticket = self.breaker.admit()
        if ticket is None:
            return None
        answered = False
        try:
            if ticket.probe and not self._master_answers(self.config.probe_timeout_s):
                return None
            codes = list(fn())
            answered = not codes or any(c not in _UNANSWERED for c in codes)
            return codes
        finally:
            self.breaker.record(ticket, answered)
            if not answered:
                self._unanswered_at = self._clock()

    # -- registration -------------------------------------------------------------------------------

    def register_host_buffer(self, buffer: torch.Tensor) -> None:
        """Register ``buffer``'s memory with the transfer engine (a whole host pool, once)."""
        if buffer.is_cuda or not buffer.is_contiguous():
            raise ValueError("register a contiguous CPU tensor (the host pool's storage)")
        start, size = self._register(buffer)
        with self._regions_mutex:
            bisect.insort(self._regions, (start, start + size))

    def _register(self, buffer: torch.Tensor) -> tuple[int, int]:
        start, size = buffer.data_ptr(), buffer.numel() * buffer.element_size()
        rc = self._store.register_buffer(start, size)
        if rc != 0:
            raise RuntimeError(f"mooncake register_buffer({start:#x}, {size}) failed with {rc}")
        return start, size

    def _check_buffers(self, pages: list[Parts]) -> None:
        with self._regions_mutex:
            regions = list(self._regions)
        starts = [r[0] for r in regions]
        for i, parts in enumerate(pages):
            for p in parts:
                if not p.numel():
                    continue  # no bytes move (an empty tensor's address may be 0)
                ptr = p.data_ptr()
                j = bisect.bisect_right(starts, ptr) - 1
                if j < 0 or ptr + p.numel() > regions[j][1]:
                    raise ValueError(
                        f"page buffer {i} at {ptr:#x} is outside every registered host buffer; "
                        "call register_host_buffer(host_pool) first"
                    )

    # -- StorageBackend ----------------------------------------------------------------------------

    def _contains(self, object_keys: list[str]) -> list[bool]:
        codes = self._call(lambda: self._store.batch_is_exist(object_keys))
        if codes is None:
            return [False] * len(object_keys)
        return [c == 1 for c in codes]

    def _read(self, object_keys: list[str], pages: list[Parts]) -> list[bool]:
        out: list[bool] = []
        for lo in range(0, len(object_keys), _ARENA_PAGES):
            out += self._read_chunk(
                object_keys[lo : lo + _ARENA_PAGES], pages[lo : lo + _ARENA_PAGES]
            )
        return out

    def _read_chunk(self, keys: list[str], pages: list[Parts]) -> list[bool]:
        arena = self._arenas.acquire()
        try:
            base = arena.data_ptr()
            ptrs = [
                [base + i * HEADER_SIZE, *(p.data_ptr() for p in parts)]
                for i, parts in enumerate(pages)
            ]
            sizes = [[HEADER_SIZE, *(p.numel() for p in parts)] for parts in pages]
            got = self._call(lambda: self._store.batch_get_into_multi_buffers(keys, ptrs, sizes))
            if got is None:
                return [False] * len(keys)
            headers = buffer_of(arena)
            out, bad = [], []
            for i, (key, size, n) in enumerate(zip(keys, sizes, got)):
                if n != sum(size):
                    # Missing, evicted, a failed store, or an object of another size than the
                    # caller's buffer (puts are atomic, so not a torn object): not served.
                    out.append(False)
                    continue
                ok = verify(
                    headers[i * HEADER_SIZE : (i + 1) * HEADER_SIZE],
                    key,
                    [buffer_of(p) for p in pages[i]],
                )
                if not ok:
                    bad.append(key)
                out.append(ok)
        finally:
            self._arenas.release(arena)
        if bad:
            self.metrics.add_checksum_miss(len(bad))
            self._store.batch_remove(bad, True)
        return out

    def _write(self, object_keys: list[str], pages: list[Parts]) -> list[bool]:
        """Write in chunks; retry what the master did not take, within the retry budget."""
        done = [False] * len(object_keys)
        # The budget runs from when the master stopped answering, if it already has: an outage
        # older than the budget fails writes at once instead of stalling every backup batch.
        backoff = Backoff(
            self._retry, since=self.breaker.failing_since, clock=self._clock, rng=self._rng
        )
        todo = list(range(len(object_keys)))
        while True:
            retry: list[int] = []
            for lo in range(0, len(todo), _ARENA_PAGES):
                chunk = todo[lo : lo + _ARENA_PAGES]
                puts = self._write_chunk([object_keys[i] for i in chunk], [pages[i] for i in chunk])
                for i, put in zip(chunk, puts):
                    done[i] = put is _Put.STORED
                    if put is _Put.RETRY:
                        retry.append(i)
            if not retry or self._closing.is_set():
                return done
            delay = backoff.next_delay()
            if delay is None:
                return done
            self.metrics.add_retried_pages(len(retry))
            if self._closing.wait(delay):
                return done
            todo = retry

    def _write_chunk(self, keys: list[str], pages: list[Parts]) -> list[_Put]:
        exists = self._call(lambda: self._store.batch_is_exist(keys))
        if exists is None:
            return [_Put.RETRY] * len(keys)
        # Stored already (1), to put (0; settled by the put below), or an error code.
        out = [_Put.STORED if e == 1 else self._put_failure(e) for e in exists]
        todo = [i for i, e in enumerate(exists) if e == 0]
        if not todo:
            return out
        arena = self._arenas.acquire()
        try:
            base = arena.data_ptr()
            headers = buffer_of(arena)
            for slot, i in enumerate(todo):
                headers[slot * HEADER_SIZE : (slot + 1) * HEADER_SIZE] = make_header(
                    keys[i], [buffer_of(p) for p in pages[i]]
                )
            rcs = self._call(
                lambda: self._store.batch_put_from_multi_buffers(
                    [keys[i] for i in todo],
                    [
                        [base + slot * HEADER_SIZE, *(p.data_ptr() for p in pages[i])]
                        for slot, i in enumerate(todo)
                    ],
                    [[HEADER_SIZE, *(p.numel() for p in pages[i])] for i in todo],
                )
            )
        finally:
            self._arenas.release(arena)
        if rcs is None:  # the breaker opened between the two calls
            for i in todo:
                out[i] = _Put.RETRY
            return out
        for i, rc in zip(todo, rcs):
            out[i] = _Put.STORED if rc == 0 else self._put_failure(rc)
        return out

    def _put_failure(self, code: int) -> _Put:
        """Whether a page whose exist-check or put returned error ``code`` is worth retrying."""
        if code in _UNANSWERED:
            return _Put.RETRY
        if code == _NO_AVAILABLE_HANDLE:
            # Right after an outage this is the client remounting its segment on a restarted
            # master, which takes about a second; any other time, a full store.
            since = self._unanswered_at
            if since is not None and self._clock() - since < self._retry.budget_s:
                return _Put.RETRY
        return _Put.FAILED

    def _delete(self, object_keys: list[str]) -> list[bool]:
        """``batch_remove`` (forced, like ``clear``: leases held by readers elsewhere do not keep
        a page); an object the master does not know is gone already."""
        codes = self._call(lambda: self._store.batch_remove(object_keys, True))
        if codes is None or len(codes) != len(object_keys):
            return [False] * len(object_keys)
        return [c == 0 or c == _OBJECT_NOT_FOUND for c in codes]

    def clear(self) -> None:
        """Remove every object in the Mooncake cluster this client talks to (not just ours)."""
        self._store.remove_all(True)

    def close(self) -> None:
        """Unregister buffers and close the client; returns at once if the master is gone."""
        self._closing.set()
        store = self._store
        if not self._master_answers():
            log.warning(
                "mooncake master %s is unreachable; leaving the client to process exit",
                self.config.master_address,
            )
            _PARKED.append(store)
            return
        for arena in self._arenas.all():
            store.unregister_buffer(arena.data_ptr())
        with self._regions_mutex:
            regions, self._regions = self._regions, []
        for start, _ in regions:
            store.unregister_buffer(start)
        store.close()
