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
* Once the master is gone, ``batch_is_exist`` and ``batch_get_*`` fail at once and
  ``batch_put_*`` after about 4 s; all report per key, which this backend reports per page.
* ``close`` holds the GIL while it talks to the master (about 2 s with a live master, 6-12 s of
  retries with a dead one), and ``health_check`` still answers "healthy" seconds after the master
  died. So ``close`` first probes the master's port itself; if nothing answers it does not call
  the client's ``close`` and parks the dead client until process exit (whose teardown then still
  spends about 12 s in the client's own retries).
* The client listens on every interface whatever ``MC_TCP_BIND_ADDRESS`` says; run it inside a
  network namespace (or on a trusted network).
"""

from __future__ import annotations

import bisect
import logging
import os
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kvtier.storage.base import Parts, StorageBackend
from kvtier.storage.keys import KeyScope
from kvtier.storage.metrics import StorageMetrics
from kvtier.storage.page_format import HEADER_SIZE, buffer_of, make_header, verify

__all__ = ["MooncakeBackend", "MooncakeConfig"]

log = logging.getLogger(__name__)

_ARENA_PAGES = 4096  # header slots per arena; larger batches go in chunks of this many pages
_PARKED: list[object] = []  # clients of dead masters: their teardown would block on retries


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
    """

    master_address: str
    metadata_server: str = "P2PHANDSHAKE"
    local_hostname: str = "127.0.0.1"
    protocol: str = "tcp"
    device_name: str = ""
    global_segment_size: int = 256 << 20
    local_buffer_size: int = 16 << 20
    connect_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        host, sep, port = self.master_address.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"master_address must be host:port, got {self.master_address!r}")
        if self.protocol not in ("tcp", "rdma"):
            raise ValueError(f"protocol must be 'tcp' or 'rdma', got {self.protocol!r}")
        if self.global_segment_size < 0 or self.local_buffer_size <= 0:
            raise ValueError("need global_segment_size >= 0 and local_buffer_size > 0")


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
    """Page objects in a Mooncake distributed store; see the module docstring."""

    name = "mooncake"
    Config = MooncakeConfig

    def __init__(
        self,
        config: MooncakeConfig,
        *,
        scope: KeyScope | None = None,
        metrics: StorageMetrics | None = None,
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

    def _master_answers(self) -> bool:
        host, _, port = self.config.master_address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), self.config.connect_timeout_s).close()
        except OSError:
            return False
        return True

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
                ptr = p.data_ptr()
                j = bisect.bisect_right(starts, ptr) - 1
                if j < 0 or ptr + p.numel() > regions[j][1]:
                    raise ValueError(
                        f"page buffer {i} at {ptr:#x} is outside every registered host buffer; "
                        "call register_host_buffer(host_pool) first"
                    )

    # -- StorageBackend ----------------------------------------------------------------------------

    def _contains(self, object_keys: list[str]) -> list[bool]:
        return [r == 1 for r in self._store.batch_is_exist(object_keys)]

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
            ptrs = [[base + i * HEADER_SIZE, *(p.data_ptr() for p in parts)]
                    for i, parts in enumerate(pages)]
            sizes = [[HEADER_SIZE, *(p.numel() for p in parts)] for parts in pages]
            got = self._store.batch_get_into_multi_buffers(keys, ptrs, sizes)
            headers = buffer_of(arena)
            out, bad = [], []
            for i, (key, size, n) in enumerate(zip(keys, sizes, got)):
                if n != sum(size):
                    # Missing, evicted, a failed store, or an object of another size than the
                    # caller's buffer (puts are atomic, so not a torn object): not served.
                    out.append(False)
                    continue
                ok = verify(headers[i * HEADER_SIZE : (i + 1) * HEADER_SIZE], key,
                            [buffer_of(p) for p in pages[i]])
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
        out: list[bool] = []
        for lo in range(0, len(object_keys), _ARENA_PAGES):
            out += self._write_chunk(
                object_keys[lo : lo + _ARENA_PAGES], pages[lo : lo + _ARENA_PAGES]
            )
        return out

    def _write_chunk(self, keys: list[str], pages: list[Parts]) -> list[bool]:
        exists = self._store.batch_is_exist(keys)
        if any(e < 0 for e in exists):
            return [False] * len(keys)  # the master did not answer: nothing will be written
        todo = [i for i, e in enumerate(exists) if e != 1]
        out = [True] * len(keys)
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
            rcs = self._store.batch_put_from_multi_buffers(
                [keys[i] for i in todo],
                [[base + slot * HEADER_SIZE, *(p.data_ptr() for p in pages[i])]
                 for slot, i in enumerate(todo)],
                [[HEADER_SIZE, *(p.numel() for p in pages[i])] for i in todo],
            )
        finally:
            self._arenas.release(arena)
        for i, rc in zip(todo, rcs):
            out[i] = rc == 0
        return out

    def clear(self) -> None:
        """Remove every object in the Mooncake cluster this client talks to (not just ours)."""
        self._store.remove_all(True)

    def close(self) -> None:
        """Unregister buffers and close the client; returns at once if the master is gone."""
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
