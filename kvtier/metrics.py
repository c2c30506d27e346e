"""Counters every layer shares: per-tier hits, bytes and time, prefetch outcomes, failures.

One bag for all tiers (device, host, storage), below both the runtime and the storage adapters:
the runtime counts device and host hits and copies here, the L3 threads and the storage
backends count storage traffic, failures and circuit-breaker events here, and the facade's
``CacheMetrics`` (``kvtier.runtime.metrics``) reads it with the other counters of a cache.

Counters only ever grow (Prometheus ``counter`` semantics); bandwidth is derived from two counters
(bytes / busy seconds) when read, never stored as a gauge that a later sample overwrites. The one
gauge is the storage circuit breaker's state (``kvtier.storage.breaker.CircuitBreaker``). All
methods are thread-safe: the backup thread, the prefetch thread and the scheduler update the same
object.
"""

from __future__ import annotations

import threading
from collections import Counter
from enum import Enum

__all__ = [
    "BreakerEvent",
    "BreakerState",
    "Direction",
    "PrefetchOutcome",
    "StorageMetrics",
    "Tier",
    "TierMetrics",
]


def _sample(value: float) -> str:
    """A sample value exactly: an int as itself, a float as the shortest text that reads back
    the same (``:g`` kept 6 digits: a byte counter past a million stopped moving)."""
    if isinstance(value, int):
        return str(int(value))
    return repr(float(value))


class Tier(str, Enum):
    DEVICE = "device"
    HOST = "host"
    STORAGE = "storage"


class Direction(str, Enum):
    READ = "read"
    WRITE = "write"


class BreakerState(str, Enum):
    """A storage circuit breaker's state."""

    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class BreakerEvent(str, Enum):
    """A storage circuit breaker's transitions and refusals."""

    OPENED = "opened"  # closed -> open, or a failed probe: half_open -> open
    PROBE = "probe"  # open -> half_open: one call let through to test the store
    SHORT_CIRCUITED = "short_circuited"  # a call refused without touching the store
    RECOVERED = "recovered"  # a probe succeeded: half_open -> closed


class PrefetchOutcome(str, Enum):
    COMPLETE = "complete"
    PARTIAL = "partial"
    REVOKED = "revoked"
    TIMED_OUT = "timed_out"
    ABORTED = "aborted"
    CHECKSUM_MISS = "checksum_miss"


_PREFIX = "kvtier"


class TierMetrics:
    """Thread-safe monotonic counters; ``snapshot()`` reads them, ``prometheus()`` exports them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hit_tokens: Counter[Tier] = Counter()
        self._bytes: Counter[tuple[Tier, Direction]] = Counter()
        self._seconds: Counter[tuple[Tier, Direction]] = Counter()
        self._outcomes: Counter[PrefetchOutcome] = Counter()
        self._checksum_miss_pages = 0
        self._failed_pages: Counter[Direction] = Counter()
        self._backup_failures = 0
        self._retried_pages = 0
        self._breaker_events: Counter[BreakerEvent] = Counter()
        self._breaker_state = BreakerState.CLOSED

    def add_hit_tokens(self, tier: Tier, tokens: int) -> None:
        """Tokens of a request's prefix served from ``tier``."""
        self._check(tokens)
        with self._lock:
            self._hit_tokens[Tier(tier)] += tokens

    def add_transfer(self, tier: Tier, direction: Direction, nbytes: int, seconds: float) -> None:
        """``nbytes`` moved to (WRITE) or from (READ) ``tier`` in ``seconds`` of wall time."""
        self._check(nbytes)
        self._check(seconds)
        key = (Tier(tier), Direction(direction))
        with self._lock:
            self._bytes[key] += nbytes
            self._seconds[key] += seconds

    def add_prefetch_outcome(self, outcome: PrefetchOutcome, count: int = 1) -> None:
        """Prefetches that ended for ``outcome``."""
        self._check(count)
        with self._lock:
            self._outcomes[PrefetchOutcome(outcome)] += count

    def add_checksum_miss(self, pages: int) -> None:
        """Pages read back whose checksum, key or length did not match; they were not served."""
        self._check(pages)
        with self._lock:
            self._checksum_miss_pages += pages

    def add_failed_pages(self, direction: Direction, pages: int) -> None:
        """Pages a backend failed to read or write (misses, errors and checksum misses alike)."""
        self._check(pages)
        with self._lock:
            self._failed_pages[Direction(direction)] += pages

    def add_backup_failure(self, pages: int = 1) -> None:
        """Pages whose backup to L3 finally failed after its bounded retries."""
        self._check(pages)
        with self._lock:
            self._backup_failures += pages

    def add_retried_pages(self, pages: int) -> None:
        """Pages sent again after an attempt failed: by a backend (the store unreachable) or by
        the L3 backup's bounded retries."""
        self._check(pages)
        with self._lock:
            self._retried_pages += pages

    def record_breaker(self, event: BreakerEvent, state: BreakerState) -> None:
        """A storage circuit breaker ``event``, after which the breaker is in ``state``."""
        with self._lock:
            self._breaker_events[BreakerEvent(event)] += 1
            self._breaker_state = BreakerState(state)

    def snapshot(self) -> dict[str, float]:
        """Every counter, plus derived GB/s per tier and direction, as a flat dict."""
        with self._lock:
            out: dict[str, float] = {}
            for tier in Tier:
                out[f"hit_tokens.{tier.value}"] = self._hit_tokens[tier]
                for d in Direction:
                    nbytes, secs = self._bytes[(tier, d)], self._seconds[(tier, d)]
                    out[f"bytes.{tier.value}.{d.value}"] = nbytes
                    out[f"seconds.{tier.value}.{d.value}"] = secs
                    out[f"gbps.{tier.value}.{d.value}"] = nbytes / secs / 1e9 if secs else 0.0
            for o in PrefetchOutcome:
                out[f"prefetch.{o.value}"] = self._outcomes[o]
            for d in Direction:
                out[f"failed_pages.{d.value}"] = self._failed_pages[d]
            out["checksum_miss_pages"] = self._checksum_miss_pages
            out["backup_failures"] = self._backup_failures
            out["retried_pages"] = self._retried_pages
            for e in BreakerEvent:
                out[f"breaker.{e.value}"] = self._breaker_events[e]
            for st in BreakerState:
                out[f"breaker.state.{st.value}"] = int(st is self._breaker_state)
            return out

    def prometheus(self) -> str:
        """The counters in Prometheus text exposition format (version 0.0.4)."""
        s = self.snapshot()
        lines: list[str] = []

        def family(name: str, kind: str, help_: str, samples: list[tuple[str, float]]) -> None:
            lines.append(f"# HELP {_PREFIX}_{name} {help_}")
            lines.append(f"# TYPE {_PREFIX}_{name} {kind}")
            lines.extend(f"{_PREFIX}_{name}{labels} {_sample(value)}" for labels, value in samples)

        tiers = [t.value for t in Tier]
        pairs = [(t, d.value) for t in tiers for d in Direction]
        family(
            "hit_tokens_total",
            "counter",
            "Prefix tokens served from each tier.",
            [(f'{{tier="{t}"}}', s[f"hit_tokens.{t}"]) for t in tiers],
        )
        family(
            "transfer_bytes_total",
            "counter",
            "Bytes moved to (write) or from (read) a tier.",
            [(f'{{tier="{t}",direction="{d}"}}', s[f"bytes.{t}.{d}"]) for t, d in pairs],
        )
        family(
            "transfer_seconds_total",
            "counter",
            "Wall seconds spent moving those bytes.",
            [(f'{{tier="{t}",direction="{d}"}}', s[f"seconds.{t}.{d}"]) for t, d in pairs],
        )
        family(
            "transfer_gbps",
            "gauge",
            "Bytes over seconds of the two counters above, in GB/s.",
            [(f'{{tier="{t}",direction="{d}"}}', s[f"gbps.{t}.{d}"]) for t, d in pairs],
        )
        family(
            "prefetch_total",
            "counter",
            "Prefetches by how they ended.",
            [(f'{{outcome="{o.value}"}}', s[f"prefetch.{o.value}"]) for o in PrefetchOutcome],
        )
        family(
            "storage_failed_pages_total",
            "counter",
            "Pages a storage backend failed to move.",
            [(f'{{direction="{d.value}"}}', s[f"failed_pages.{d.value}"]) for d in Direction],
        )
        family(
            "storage_checksum_miss_pages_total",
            "counter",
            "Pages whose checksum did not match on read; never served.",
            [("", s["checksum_miss_pages"])],
        )
        family(
            "backup_failures_total",
            "counter",
            "Pages whose L3 backup failed after retries.",
            [("", s["backup_failures"])],
        )
        family(
            "storage_retried_pages_total",
            "counter",
            "Pages sent again after the store was unreachable.",
            [("", s["retried_pages"])],
        )
        family(
            "storage_breaker_events_total",
            "counter",
            "Storage circuit breaker events: opened, probe, short_circuited, recovered.",
            [(f'{{event="{e.value}"}}', s[f"breaker.{e.value}"]) for e in BreakerEvent],
        )
        family(
            "storage_breaker_state",
            "gauge",
            "1 for the storage circuit breaker's current state, 0 for the others.",
            [(f'{{state="{st.value}"}}', s[f"breaker.state.{st.value}"]) for st in BreakerState],
        )
        return "\n".join(lines) + "\n"

    @staticmethod
    def _check(value: float) -> None:
        if value < 0:
            raise ValueError(f"counters only grow; got an increment of {value}")


# The name this class had while it lived in kvtier.storage; kept so embedders' imports still work.
StorageMetrics = TierMetrics
