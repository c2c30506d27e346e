"""Metrics: monotonic counters, derived bandwidth, Prometheus text, thread safety."""

from __future__ import annotations

import re
import threading

import pytest

from kvtier.metrics import Direction, PrefetchOutcome, Tier, TierMetrics


def test_counters_and_bandwidth() -> None:
    m = TierMetrics()
    m.add_hit_tokens(Tier.STORAGE, 128)
    m.add_transfer(Tier.STORAGE, Direction.READ, 2_000_000_000, 1.0)
    m.add_transfer(Tier.STORAGE, Direction.READ, 2_000_000_000, 3.0)
    m.add_prefetch_outcome(PrefetchOutcome.TIMED_OUT)
    m.add_prefetch_outcome(PrefetchOutcome.CHECKSUM_MISS, 2)
    m.add_checksum_miss(3)
    m.add_backup_failure(4)
    s = m.snapshot()
    assert s["hit_tokens.storage"] == 128 and s["hit_tokens.host"] == 0
    assert s["bytes.storage.read"] == 4e9 and s["gbps.storage.read"] == pytest.approx(1.0)
    assert s["prefetch.timed_out"] == 1 and s["prefetch.checksum_miss"] == 2
    assert s["checksum_miss_pages"] == 3 and s["backup_failures"] == 4
    with pytest.raises(ValueError, match="only grow"):
        m.add_hit_tokens(Tier.HOST, -1)


def test_prometheus_exposition() -> None:
    m = TierMetrics()
    m.add_hit_tokens(Tier.DEVICE, 5)
    m.add_prefetch_outcome(PrefetchOutcome.PARTIAL)
    text = m.prometheus()
    sample = re.compile(r'^kvtier_[a-z_]+(\{[a-z_]+="[a-z_]+"(,[a-z_]+="[a-z_]+")*\})? [0-9.e+-]+$')
    for line in text.splitlines():
        assert line.startswith(("# HELP ", "# TYPE ")) or sample.match(line), line
    assert 'kvtier_hit_tokens_total{tier="device"} 5' in text
    assert 'kvtier_prefetch_total{outcome="partial"} 1' in text
    assert "# TYPE kvtier_backup_failures_total counter" in text
    names = {o.value for o in PrefetchOutcome}
    assert names == {"complete", "partial", "revoked", "timed_out", "aborted", "checksum_miss"}


def test_prometheus_counters_are_exact() -> None:
    """Large counters keep every digit (a 6-digit ``:g`` froze a byte counter past a million:
    ``rate()`` read zero), and a float time reads back as the same float."""
    m = TierMetrics()
    m.add_hit_tokens(Tier.DEVICE, 1234567)
    m.add_transfer(Tier.HOST, Direction.WRITE, 123456789, 0.1234567891)
    m.add_hit_tokens(Tier.DEVICE, 4)
    text = m.prometheus()
    assert 'kvtier_hit_tokens_total{tier="device"} 1234571\n' in text
    assert 'kvtier_transfer_bytes_total{tier="host",direction="write"} 123456789\n' in text
    seconds = m.snapshot()["seconds.host.write"]
    value = [
        float(x.rsplit(" ", 1)[1])
        for x in text.splitlines()
        if x.startswith('kvtier_transfer_seconds_total{tier="host",direction="write"}')
    ]
    assert value == [seconds]


def test_thread_safe_increments() -> None:
    m = TierMetrics()

    def bump() -> None:
        for _ in range(5000):
            m.add_transfer(Tier.HOST, Direction.WRITE, 1, 0.0)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert m.snapshot()["bytes.host.write"] == 20000
