"""Every counter of one cache behind one snapshot and one export.

Four sources, one reader:

    CacheCounters      requests, prompt tokens, hits per tier, load-backs, evictions, retention
                       pins by outcome (facade)
    TransferStats      device<->host copies: bytes, the copies' own time, submit-to-ack latency
    TierMetrics     per tier: hit tokens, bytes and seconds, prefetch outcomes, checksum
                       misses, failed pages, the storage circuit breaker (L3 backends count here)
    L3Tier.counters    L3 decisions: load or recompute, prefetches revoked (``RevokeReason``),
                       not started, cut for host room, pages backed up

``snapshot()`` flattens them into one dict; ``prometheus()`` renders Prometheus text; and
``collector()`` gives a ``prometheus_client`` collector, so that the counters join a serving
engine's own registry (``registry.register(cache.metrics_collector())``).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from kvtier.metrics import Direction, Tier, TierMetrics
from kvtier.runtime.controller import TransferStats
from kvtier.runtime.l3.prefetch import RevokeReason
from kvtier.runtime.request import Request

__all__ = ["L3_COUNTERS", "CacheCounters", "CacheMetrics"]

# Every key ``L3Tier.counters`` and the storage switch count, so that the snapshot holds each
# from the start, at 0 (tests/runtime/test_metrics_export.py checks the list against the code).
L3_COUNTERS = (
    "backup_failed_pages",
    "backup_not_started_detaching",
    "backup_pages",
    "backup_revoked_pages",
    "l3_decision_load",
    "l3_decision_recompute",
    "prefetch_cut_host_capacity",
    "prefetch_not_started_detaching",
    "prefetch_not_started_host_occupancy",
    "prefetch_not_started_short",
    *(f"prefetch_revoked_{r.value}" for r in RevokeReason),
    "prefetch_revoked_detach",  # aborted by a forced detach
    "prefetched_tokens",  # tokens prefetches read from L3 into the host tier (served or not)
    "storage_attached",
    "storage_backfill_jobs",
    "storage_changes_refused",
    "storage_clear_failed",
    "storage_cleared",
    "storage_detach_timeouts",
    "storage_detached",
)


def _l3_keys(counters: Counter) -> list[str]:
    """Every L3 counter's key: the known ones (at 0 until counted) and any other counted."""
    return sorted(set(L3_COUNTERS).union(counters))


@dataclass
class CacheCounters:
    """Monotonic counters of the facade (tokens and events)."""

    requests: int = 0
    prompt_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    load_backs: int = 0
    load_backs_skipped: int = 0
    evicted_tokens: int = 0
    # Retention pins: taken, refused over the budget, dropped for a higher-priority pin over the
    # budget (``retention_overflow="evict_lowest"``), expired, and TTLs restarted by a hit.
    retention_pins: int = 0
    retention_refused: int = 0
    retention_dropped: int = 0
    retention_expired: int = 0
    retention_refreshed: int = 0

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class CacheMetrics:
    """The counters of one cache (see the module docstring)."""

    def __init__(
        self, tiers: TierMetrics, transfers: TransferStats, l3_counters: Counter | None
    ) -> None:
        self.counters = CacheCounters()
        self.tiers = tiers
        self.transfers = transfers
        self.l3_counters = l3_counters
        self._host_seen = (0, 0.0, 0, 0.0)

    def add_request(self, prompt_tokens: int, req: Request) -> None:
        """A matched request: ``host_hit_tokens`` counts every token loaded back from host; the
        per-tier ``hit_tokens`` split the hit into device, host and storage (the tokens an L3
        prefetch read for it, ``req.storage_hit``), so they sum to the tokens served."""
        c = self.counters
        c.requests += 1
        c.prompt_tokens += prompt_tokens
        c.device_hit_tokens += req.device_hit
        c.host_hit_tokens += req.host_hit
        self.tiers.add_hit_tokens(Tier.DEVICE, req.device_hit)
        self.tiers.add_hit_tokens(Tier.HOST, req.host_hit - req.storage_hit)
        self.tiers.add_hit_tokens(Tier.STORAGE, req.storage_hit)

    def count_evicted(self, tokens: int) -> None:
        """FULL device tokens an eviction freed (``UnifiedRadixTree.on_evicted``)."""
        self.counters.evicted_tokens += tokens

    def sync_host(self) -> None:
        """Carry the copies timed since the last call into the host tier's transfer counters."""
        s = self.transfers
        seen = (s.d2h_timed_bytes, s.d2h_seconds, s.h2d_timed_bytes, s.h2d_seconds)
        old, self._host_seen = self._host_seen, seen
        if seen[0] > old[0]:
            self.tiers.add_transfer(Tier.HOST, Direction.WRITE, seen[0] - old[0], seen[1] - old[1])
        if seen[2] > old[2]:
            self.tiers.add_transfer(Tier.HOST, Direction.READ, seen[2] - old[2], seen[3] - old[3])

    def snapshot(self) -> dict[str, float]:
        """Every counter as a flat dict: the facade's, the copies' (``d2h_*``, ``h2d_*``, the path
        each planned copy took: ``copy_path.h2d.copy_engine``, ``copy_route.<reason>``), per
        tier (``tier.hit_tokens.storage``, ``tier.gbps.storage.read``, ``tier.prefetch.complete``,
        ...) and the L3 decisions (``l3.*``)."""
        s = self.transfers
        out: dict[str, float] = self.counters.as_dict()
        out.update(
            d2h_bytes=s.d2h_bytes,
            h2d_bytes=s.h2d_bytes,
            backups=s.backups,
            backups_refused=s.backups_refused,
            write_back_backups=s.write_back_backups,
            loads=s.loads,
            d2h_seconds=s.d2h_seconds,
            h2d_seconds=s.h2d_seconds,
            d2h_gbps=s.gbps("d2h"),
            h2d_gbps=s.gbps("h2d"),
            d2h_ack_ms_mean=1e3 * s.d2h_ack_seconds / s.d2h_acked if s.d2h_acked else 0.0,
            h2d_ack_ms_mean=1e3 * s.h2d_ack_seconds / s.h2d_acked if s.h2d_acked else 0.0,
        )
        out.update({f"copy_path.{k}": v for k, v in sorted(s.paths.items())})
        out.update({f"copy_route.{k}": v for k, v in sorted(s.route_reasons.items())})
        out.update({f"tier.{k}": v for k, v in self.tiers.snapshot().items()})
        if self.l3_counters is not None:
            lc = self.l3_counters
            out.update({f"l3.{k}": lc[k] for k in _l3_keys(lc)})
        return out

    def _families(self) -> list[tuple[str, str, str, list[tuple[dict[str, str], float]]]]:
        """The cache's own families: (name, type, help, [(labels, value)])."""
        c, s = self.counters, self.transfers
        fams = [
            ("kvtier_requests_total", "counter", "Requests matched.", [({}, c.requests)]),
            (
                "kvtier_prompt_tokens_total",
                "counter",
                "Prompt tokens matched.",
                [({}, c.prompt_tokens)],
            ),
            (
                "kvtier_evicted_tokens_total",
                "counter",
                "FULL tokens evicted from the device.",
                [({}, c.evicted_tokens)],
            ),
            (
                "kvtier_load_backs_total",
                "counter",
                "Host hits loaded back, or skipped.",
                [
                    ({"result": "loaded"}, c.load_backs),
                    ({"result": "skipped"}, c.load_backs_skipped),
                ],
            ),
            (
                "kvtier_retention_pins_total",
                "counter",
                "Retention pins by outcome.",
                [
                    ({"outcome": "pinned"}, c.retention_pins),
                    ({"outcome": "refused"}, c.retention_refused),
                    ({"outcome": "dropped"}, c.retention_dropped),
                    ({"outcome": "expired"}, c.retention_expired),
                ],
            ),
            (
                "kvtier_retention_refreshes_total",
                "counter",
                "Retention TTLs restarted by a hit (a pin's TTL can restart many times).",
                [({}, c.retention_refreshed)],
            ),
            (
                "kvtier_copies_total",
                "counter",
                "Device-host copies issued.",
                [({"direction": "d2h"}, s.backups), ({"direction": "h2d"}, s.loads)],
            ),
            (
                "kvtier_copy_plans_total",
                "counter",
                "Planned device-host copies (one per pool pair per batch), by the path taken.",
                [
                    ({"direction": k.split(".", 1)[0], "path": k.split(".", 1)[1]}, v)
                    for k, v in sorted(s.paths.items())
                ],
            ),
            (
                "kvtier_copy_route_reasons_total",
                "counter",
                "Why each planned copy took its path (kvtier.kernels.dispatch.RouteReason).",
                [({"reason": k}, v) for k, v in sorted(s.route_reasons.items())],
            ),
            (
                "kvtier_copy_ack_seconds_total",
                "counter",
                "Submit-to-acknowledge latency of device-host copies, summed.",
                [
                    ({"direction": "d2h"}, s.d2h_ack_seconds),
                    ({"direction": "h2d"}, s.h2d_ack_seconds),
                ],
            ),
        ]
        if self.l3_counters is not None:
            lc = self.l3_counters
            fams += [
                (
                    "kvtier_l3_decisions_total",
                    "counter",
                    "L3 hits loaded or recomputed (load-or-recompute).",
                    [
                        ({"decision": "load"}, lc["l3_decision_load"]),
                        ({"decision": "recompute"}, lc["l3_decision_recompute"]),
                    ],
                ),
                (
                    "kvtier_prefetch_revoked_total",
                    "counter",
                    "Prefetches revoked, by reason.",
                    [
                        ({"reason": r}, lc[f"prefetch_revoked_{r}"])
                        for r in (*(r.value for r in RevokeReason), "detach")
                    ],
                ),
                (
                    "kvtier_prefetched_tokens_total",
                    "counter",
                    "Tokens prefetches read from L3 into the host tier, served or not (a storage "
                    "hit once a match serves them: kvtier_hit_tokens_total).",
                    [({}, lc["prefetched_tokens"])],
                ),
                (
                    "kvtier_l3_events_total",
                    "counter",
                    "The L3 tier's other counts (l3.* in the snapshot), each its own series: "
                    "backup pages (written, failed, revoked, not started), prefetches (not "
                    "started, cut), storage changes.",
                    [
                        ({"event": k}, lc[k])
                        for k in _l3_keys(lc)
                        if not k.startswith(("l3_decision_", "prefetch_revoked_"))
                        and k != "prefetched_tokens"
                    ],
                ),
            ]
        return fams

    def prometheus(self) -> str:
        """Every counter in Prometheus text format."""
        lines = []
        for name, kind, help_, samples in self._families():
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
            for labels, value in samples:
                lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
                lines.append(f"{name}{{{lab}}} {value}" if lab else f"{name} {value}")
        return self.tiers.prometheus() + "\n".join(lines) + "\n"

    def collector(self):
        """A ``prometheus_client`` collector of the same families (needs ``prometheus_client``:
        ``pip install kvtier[metrics]``); register it in the engine's registry."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        from prometheus_client.parser import text_string_to_metric_families

        metrics = self

        class _Collector:
            def collect(self):
                # The storage tiers render their own text; parse it back into families.
                yield from text_string_to_metric_families(metrics.tiers.prometheus())
                for name, kind, help_, samples in metrics._families():
                    keys = sorted({k for labels, _ in samples for k in labels})
                    cls = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                    base = name.removesuffix("_total") if kind == "counter" else name
                    fam = cls(base, help_, labels=keys)
                    for labels, value in samples:
                        fam.add_metric([labels.get(k, "") for k in keys], value)
                    yield fam

        return _Collector()
