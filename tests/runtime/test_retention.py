"""Retention pins (``TieredKVCache.pin``/``unpin``): TTL and refresh on a fake clock, the budget
and its overflow policies, eviction order on device and host, bad input, L3 write order, and an
agent trace with tool-call pauses where pinned sessions keep their hits."""

from __future__ import annotations

import math
import threading
from types import SimpleNamespace

import pytest
import torch

from kvtier.metrics import TierMetrics
from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig, StorageConfig
from kvtier.runtime.l3.backup import BackupJob, BackupWriter
from kvtier.runtime.tree.config import TreeConfig, build_tree
from kvtier.runtime.tree.retention import RetentionBudget, RetentionHandle, RetentionRefused
from tests.runtime.synthetic import MODELS, SPEC, P, run_turn


class FakeClock:
    """The cache's clock: tests advance it instead of sleeping."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def make(
    kinds=MODELS["full"],
    policy="write_through",
    device_tokens=48,
    host_tokens=None,
    clock=None,
    **kw,
) -> TieredKVCache:
    cfg = CacheConfig(
        layer_kinds=kinds,
        kv_heads=1,
        head_dim=4,
        page_size=P,
        device_tokens=device_tokens,
        dtype=torch.float32,
        swa_window=8 if "swa" in kinds else None,
        mamba=SPEC if "mamba" in kinds else None,
        mamba_slots=8 if "mamba" in kinds else None,
        host_tokens=host_tokens or 8 * device_tokens,
        write_policy=policy,
        **kw,
    )
    return TieredKVCache(cfg, clock=clock or FakeClock())


def prompt(session: int, n: int) -> list[int]:
    """``n`` tokens of a session: distinct sessions share no page."""
    return [1000 * (session + 1) + i for i in range(n)]


def path(cache: TieredKVCache, tokens: list[int]):
    """The nodes of the longest cached prefix of ``tokens`` (read-only), root excluded."""
    node = cache.tree.match_prefix(tokens, read_only=True).best_match_node
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out


def on_device(cache: TieredKVCache, tokens: list[int]) -> int:
    return cache.tree.match_prefix(tokens, read_only=True).device_len


def cached(cache: TieredKVCache, tokens: list[int]) -> int:
    return cache.tree.match_prefix(tokens, read_only=True).best_match_node.end


def books(cache: TieredKVCache) -> dict:
    """Everything a refused call must leave as it was."""
    t = cache.tree
    return {
        "kv_free": cache.kv_alloc.available_size(),
        "host_free": t.full.host_alloc.available_size(),
        "nodes": sorted(
            (n.id, n.pins[:], n.host_pins[:], n.retention, n.last_access) for n in t.all_nodes()
        ),
        "counters": cache.counters.as_dict(),
        "handles": {i: (h.expires_at, h.released) for i, h in t.retention.handles.items()},
        "backups": cache.controller.stats.backups,
    }


# -- pin, unpin, TTL ------------------------------------------------------------------------------


@pytest.mark.parametrize("model", list(MODELS))
def test_pinned_prefix_stays_on_device_while_unpinned_ones_go(model):
    cache = make(MODELS[model])
    a = prompt(0, 16)
    run_turn(cache, a)
    h = cache.pin(a, ttl_s=60)
    cache.check_integrity()
    assert h.tokens == 16 and not h.released
    assert all(n.retention == 0 for n in path(cache, a))
    for s in range(1, 5):  # newer sessions press on the 48-token device pool
        run_turn(cache, prompt(s, 16))
        assert on_device(cache, a) == 16, s
    assert on_device(cache, prompt(1, 16)) < 16  # older unpinned sessions went first
    req = run_turn(cache, a + [5, 6, 7, 8])  # checks every reused byte equals a cold run
    assert req.device_hit == 16
    cache.unpin(h)
    cache.check_integrity()
    assert h.released == "unpinned" and all(n.retention is None for n in path(cache, a))


@pytest.mark.parametrize("model", ["full", "full+swa+mamba"])
def test_device_pressure_demotes_a_pinned_prefix_and_host_pressure_keeps_it(model):
    cache = make(MODELS[model], device_tokens=32, host_tokens=64)
    a = prompt(0, 16)
    run_turn(cache, a)
    cache.pin(a, ttl_s=60)
    for s in range(1, 6):  # more than device and host hold together
        run_turn(cache, prompt(s, 16))
    cache.check_integrity()
    assert cached(cache, a) == 16  # demoted to host at most, never lost
    assert cache.tree.evict_host(full=10**6).full > 0  # host pressure takes the others
    cache.check_integrity()
    assert cached(cache, a) == 16
    req = run_turn(cache, a + [5])  # loaded back, bytes exact
    assert req.cached_len == 16


def test_ttl_expires_at_a_poll_and_a_hit_restarts_it():
    clock = FakeClock()
    cache = make(clock=clock)
    a = prompt(0, 16)
    run_turn(cache, a)
    h = cache.pin(a, ttl_s=10)
    assert h.expires_at == clock.t + 10
    clock.t += 6
    run_turn(cache, a + [1, 2])  # a hit on the whole pinned prefix
    assert h.expires_at == clock.t + 10
    assert cache.counters.retention_refreshed == 1
    run_turn(cache, a[:8] + [3, 4, 5])  # covers only part of it: no refresh
    assert h.expires_at == clock.t + 10
    clock.t += 9.5
    cache.poll()
    assert not h.released
    clock.t += 0.5
    cache.poll()
    cache.check_integrity()
    assert h.released == "expired" and cache.counters.retention_expired == 1
    assert all(n.retention is None for n in path(cache, a))
    with pytest.raises(ValueError, match="already released"):
        cache.unpin(h)


def test_refresh_on_hit_can_be_turned_off():
    clock = FakeClock()
    cache = make(clock=clock, retention_refresh_on_hit=False)
    a = prompt(0, 16)
    run_turn(cache, a)
    h = cache.pin(a, ttl_s=10)
    clock.t += 6
    run_turn(cache, a + [1])
    assert h.expires_at == 110 and cache.counters.retention_refreshed == 0
    clock.t += 4
    cache.poll()
    assert h.released == "expired"


def test_partly_cached_prefix_pins_what_is_cached_and_reports_its_length():
    cache = make()
    a = prompt(0, 16)
    run_turn(cache, a)
    h = cache.pin(a + prompt(9, 8) + [1, 2], ttl_s=5)  # 16 cached, 10 never seen
    cache.check_integrity()
    assert h.tokens == 16
    h2 = cache.pin(a[:9], ttl_s=5)  # a prefix inside a node: the node is split at page 2
    cache.check_integrity()
    assert h2.tokens == 8
    assert [n.retention for n in path(cache, a)] == [0, 0]


def test_a_host_only_prefix_is_pinned_on_host_and_not_loaded_back():
    cache = make(device_tokens=32, host_tokens=64)
    a = prompt(0, 16)
    run_turn(cache, a)
    cache.evict(10**6)
    assert on_device(cache, a) == 0 and cached(cache, a) == 16
    loads = cache.controller.stats.loads
    h = cache.pin(a, ttl_s=5)
    cache.check_integrity()
    assert h.tokens == 16 and cache.controller.stats.loads == loads
    cache.tree.evict_host(full=10**6)
    assert cached(cache, a) == 16


def test_a_pin_inside_a_host_only_node_pins_its_first_pages():
    cache = make(device_tokens=32, host_tokens=64)
    a = prompt(0, 16)
    run_turn(cache, a)
    cache.evict(10**6)
    h = cache.pin(a[:10], ttl_s=5)  # 2 whole pages of a 4-page host-only node
    cache.check_integrity()
    assert h.tokens == 8 and cache.tree.retention.retained_tokens == 8
    cache.tree.evict_host(full=10**6)
    cache.check_integrity()
    assert cached(cache, a) == 8


def test_eviction_order_among_pins_is_priority_then_recency():
    cache = make(device_tokens=64, retention_device_tokens=64, retention_host_tokens=64)
    a, b, c = prompt(0, 8), prompt(1, 8), prompt(2, 8)
    for t in (a, b, c):
        run_turn(cache, t)
    cache.pin(a, ttl_s=60, priority=5)  # oldest, but the highest priority
    cache.pin(b, ttl_s=60)
    cache.pin(c, ttl_s=60)  # same priority as b, more recent
    run_turn(cache, prompt(3, 8))  # an unpinned session, newer than every pin
    order = []
    for _ in range(4):
        cache.evict(8)
        cache.check_integrity()
        order.append([t for t in (a, b, c, prompt(3, 8)) if on_device(cache, t) == 8])
    assert order == [[a, b, c], [a, c], [a], []]


def test_an_unbacked_pinned_leaf_is_never_deleted():
    """Without a host copy to demote to (no host tier here) a pinned leaf stays on device."""
    tree = build_tree(TreeConfig(page_size=P, kv_size=32))
    keys = [prompt(s, 8) for s in range(2)]
    for key in keys:
        tree.insert(key, tree.full.device_alloc.alloc(8))
    node = tree.match_prefix(keys[0]).best_match_node
    budget = RetentionBudget(32, 32, "refuse")
    assert tree.retention.admit(node, 8, 0, budget) == []
    h = tree.retention.pin(node, ttl_s=1.0, priority=0, namespace=None, now=0.0)
    freed = tree.evict(full=10**6).full
    tree.check_integrity()
    tree.retention.check(budget)
    assert freed == 8 and tree.match_prefix(keys[0], read_only=True).device_len == 8
    assert tree.match_prefix(keys[1], read_only=True).device_len == 0
    tree.retention.unpin(h)
    assert tree.evict(full=10**6).full == 8
    tree.check_integrity()


@pytest.mark.parametrize("policy", ["write_back", "write_through_selective"])
def test_a_pinned_prefix_is_backed_up_at_once(policy):
    cache = make(policy=policy)
    a = prompt(0, 16)
    run_turn(cache, a)
    assert all(n.host_value[0] is None for n in path(cache, a))
    cache.pin(a, ttl_s=5)
    cache.poll()
    cache.check_integrity()
    assert all(n.host_value[0] is not None for n in path(cache, a))


@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_random_trace_never_loses_a_live_pin(model, policy):
    """Sessions, pins, unpins and clock steps at random under pressure on both tiers: after
    every step the books add up and every live pin's prefix is still cached whole."""
    gen = torch.Generator().manual_seed(14)
    clock = FakeClock()
    cache = make(
        MODELS[model],
        policy,
        device_tokens=48,
        host_tokens=96,
        clock=clock,
        retention_device_tokens=32,
        retention_overflow="evict_lowest",
    )
    history = {s: prompt(s, 8) for s in range(6)}
    live: list[tuple[RetentionHandle, list[int]]] = []
    for _ in range(40):
        op = int(torch.randint(0, 5, (1,), generator=gen))  # turn, turn, pin, pin, unpin
        s = int(torch.randint(0, 6, (1,), generator=gen))
        if op <= 1:
            tokens = history[s] + [600 + s] * int(torch.randint(1, 6, (1,), generator=gen))
            history[s] = run_turn(cache, tokens).token_ids
        elif op <= 3:
            prio = int(torch.randint(0, 3, (1,), generator=gen))
            ttl = float(torch.randint(1, 8, (1,), generator=gen))
            tokens = history[s][: P * int(torch.randint(1, 6, (1,), generator=gen))]
            if cached(cache, tokens):  # a hybrid prefix is usable only at some ends
                try:
                    h = cache.pin(tokens, ttl_s=ttl, priority=prio)
                    live.append((h, tokens[: h.tokens]))
                except RetentionRefused:
                    pass  # counted; the books are checked below all the same
        elif op == 4 and live:
            h, _ = live.pop(int(torch.randint(0, len(live), (1,), generator=gen)))
            if not h.released:
                cache.unpin(h)
        clock.t += 1.0
        cache.poll()
        cache.check_integrity()
        live = [(h, t) for h, t in live if not h.released]
        for h, t in live:
            assert cached(cache, t) == h.tokens, (h, t)
    c = cache.counters
    assert c.retention_pins > 3 and c.retention_expired > 0, c


# -- budget and overflow ---------------------------------------------------------------------


def test_budget_refuses_over_it_and_counts_it():
    cache = make(retention_device_tokens=16, retention_host_tokens=100)
    a, b = prompt(0, 12), prompt(1, 8)
    run_turn(cache, a + [9, 9, 9, 9])
    run_turn(cache, b)
    cache.pin(a, ttl_s=5)
    cache.pin(a + [9, 9, 9, 9], ttl_s=5)  # shares 12 tokens: costs 4 more
    assert cache.tree.retention.retained_tokens == 16
    before = books(cache)
    with pytest.raises(RetentionRefused, match="budget of 16 tokens"):
        cache.pin(b, ttl_s=5, priority=3)
    after = books(cache)
    assert after["counters"].pop("retention_refused") == 1
    before["counters"].pop("retention_refused")
    assert after == before
    cache.check_integrity()


def test_evict_lowest_drops_lower_priority_pins_first():
    cache = make(device_tokens=64, retention_device_tokens=16, retention_overflow="evict_lowest")
    a, b, c, d = (prompt(s, 8) for s in range(4))
    for t in (a, b, c, d):
        run_turn(cache, t)
    ha = cache.pin(a, ttl_s=5, priority=1)
    hb = cache.pin(b, ttl_s=5, priority=0)
    hc = cache.pin(c, ttl_s=5, priority=2)  # over by 8: b (lowest) goes
    cache.check_integrity()
    assert (hb.released, ha.released, hc.released) == ("dropped", "", "")
    assert cache.counters.retention_dropped == 1
    before = books(cache)
    with pytest.raises(RetentionRefused, match="no pin of lower priority"):
        cache.pin(d, ttl_s=5, priority=1)  # a pin of equal priority is not dropped
    assert books(cache)["handles"] == before["handles"]
    hd = cache.pin(d, ttl_s=5, priority=3)  # a (1) goes before c (2)
    assert (ha.released, hc.released, hd.released) == ("dropped", "", "")
    assert cache.counters.retention_dropped == 2 and cache.counters.retention_refused == 1
    text = cache.prometheus()
    for outcome, n in (("pinned", 4), ("dropped", 2), ("refused", 1), ("expired", 0)):
        assert f'kvtier_retention_pins_total{{outcome="{outcome}"}} {n}' in text, outcome
    assert 'outcome="refreshed"' not in text  # TTL restarts are not pins: their own family
    assert f"kvtier_retention_refreshes_total {cache.counters.retention_refreshed}" in text
    assert cache.metrics()["retention_pins"] == 4
    cache.check_integrity()
    with pytest.raises(ValueError, match="already released"):
        cache.unpin(hb)


def test_a_pin_larger_than_the_whole_budget_is_refused():
    cache = make(retention_device_tokens=8, retention_overflow="evict_lowest")
    a = prompt(0, 16)
    run_turn(cache, a)
    with pytest.raises(RetentionRefused):
        cache.pin(a, ttl_s=5, priority=10)
    assert not cache.tree.retention.handles and cache.counters.retention_refused == 1


def test_retention_config_is_validated():
    with pytest.raises(ValueError, match="retention_device_tokens=49"):
        make(retention_device_tokens=49)
    with pytest.raises(ValueError, match="retention_host_tokens must be >= 0"):
        make(retention_host_tokens=-1)
    with pytest.raises(TypeError, match="retention_device_tokens"):
        make(retention_device_tokens=1.5)
    with pytest.raises(ValueError, match="retention_overflow: unknown 'lru'"):
        make(retention_overflow="lru")
    with pytest.raises(TypeError, match="retention_refresh_on_hit"):
        make(retention_refresh_on_hit=1)
    assert make().config.retention_budget == (24, 192)
    with pytest.raises(TypeError, match="clock"):
        TieredKVCache(make().config, clock=5.0)


# -- bad input -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "args, kw, err, what",
    [
        (("abc", 5), {}, TypeError, "prefix"),
        (([1.0, 2.0], 5), {}, TypeError, "prefix"),
        (([], 5), {}, ValueError, "prefix"),
        ((None, 5), {}, TypeError, "prefix"),
        ((prompt(0, 8), -1), {}, ValueError, "ttl_s"),
        ((prompt(0, 8), 0), {}, ValueError, "ttl_s"),
        ((prompt(0, 8), math.nan), {}, ValueError, "ttl_s"),
        ((prompt(0, 8), math.inf), {}, ValueError, "ttl_s"),
        ((prompt(0, 8), 10**400), {}, ValueError, "ttl_s"),  # beyond a float: no OverflowError
        ((prompt(0, 8), "5"), {}, TypeError, "ttl_s"),
        ((prompt(0, 8), True), {}, TypeError, "ttl_s"),
        ((prompt(0, 8), 5), {"priority": 1.5}, TypeError, "priority"),
        ((prompt(0, 8), 5), {"priority": True}, TypeError, "priority"),
        ((prompt(0, 8), 5), {"namespace": {1}}, TypeError, "namespace"),
        ((prompt(7, 8), 5), {}, ValueError, "prefix: no whole page"),
        ((prompt(0, 3), 5), {}, ValueError, "prefix: no whole page"),
        ((prompt(0, 8), 5), {"namespace": "other"}, ValueError, "prefix: no whole page"),
    ],
)
def test_bad_pin_is_refused_and_changes_nothing(args, kw, err, what):
    cache = make()
    run_turn(cache, prompt(0, 8))
    cache.pin(prompt(0, 4), ttl_s=5)
    before = books(cache)
    with pytest.raises(err, match=what):
        cache.pin(*args, **kw)
    assert books(cache) == before
    cache.check_integrity()


def test_bad_unpin_is_refused_and_changes_nothing():
    cache, other = make(), make()
    for c in (cache, other):
        run_turn(c, prompt(0, 8))
    h = cache.pin(prompt(0, 8), ttl_s=5)
    theirs = other.pin(prompt(0, 8), ttl_s=5)
    before = books(cache)
    with pytest.raises(TypeError, match="handle"):
        cache.unpin(object())
    with pytest.raises(TypeError, match="handle"):
        cache.unpin(h.id)
    with pytest.raises(ValueError, match="another cache"):
        cache.unpin(theirs)
    forged = RetentionHandle(cache.tree.retention, h._node, 0, None, 1.0, 1.0)
    with pytest.raises(ValueError, match="not a live pin"):
        cache.unpin(forged)
    assert books(cache) == before
    cache.unpin(h)
    before = books(cache)
    with pytest.raises(ValueError, match="already released"):
        cache.unpin(h)
    assert books(cache) == before
    cache.check_integrity()
    other.check_integrity()


# -- L3: retained prefixes are written first -------------------------------------------------


def test_write_back_pin_reaches_storage(tmp_path):
    st = StorageConfig(backend_config={"root": str(tmp_path)}, prefetch_min_tokens=4)
    cache = make(policy="write_back", model_id="synthetic-retention", storage=st)
    a = prompt(0, 16)
    run_turn(cache, a)
    assert cache.l3.counters["backup_pages"] == 0  # write-back: nothing written yet
    cache.pin(a, ttl_s=5)
    cache.drain()
    cache.check_integrity()
    assert cache.l3.counters["backup_pages"] == 4
    cache.close()


class _GatedBackend:
    """Records the order of page writes; the first write says it started, then waits for the
    gate, so that the jobs submitted meanwhile queue up behind it."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.gate = threading.Event()
        self.written: list[str] = []

    def set(self, transfers):
        if not self.written:
            self.started.set()
            self.gate.wait(10)
        t = transfers[0]
        self.written += list(t.keys)
        return SimpleNamespace(ok={t.pool: [True] * len(t.keys)})


def test_backup_writer_writes_retained_prefixes_first():
    backend = _GatedBackend()
    pool = SimpleNamespace(name="kv", batch_pages=8, write_views=lambda pages: [pages])
    writer = BackupWriter(backend, {"kv": pool}, 0, TierMetrics(), True)

    def job(key: str, retained: bool) -> BackupJob:
        node = SimpleNamespace(retention=0 if retained else None)
        pages = {"kv": ([key], torch.zeros(1, dtype=torch.int64))}
        return BackupJob(pages, [SimpleNamespace(node=node)])

    jobs = [job("first", False), job("plain", False), job("pinned", True)]
    writer.submit(jobs[0])
    assert backend.started.wait(10)  # the thread is inside the first job's write
    for j in jobs[1:]:
        writer.submit(j)
    backend.gate.set()
    for j in jobs:
        assert j.done.wait(10)
    writer.close(10)
    assert backend.written == ["first", "pinned", "plain"]


# -- an agent trace --------------------------------------------------------------------------


def agent_trace(pin: bool) -> tuple[dict[str, tuple[float, float]], TieredKVCache]:
    """Eight sessions of four turns each on a 64-token device pool and a 128-token host pool.
    Each turn sends the session's whole history plus a tool result; a session then waits for its
    tool while the others run (its pause is the other sessions' turns, one second each on the
    fake clock). Sessions 0 and 1 are agents: with ``pin`` their history is pinned across each
    pause (the previous pin released, the new history pinned for 30 s).

    Returns, for the agents and the others, the hit rate (cached prompt tokens / prompt tokens)
    and the device hit rate (device-hit tokens / prompt tokens).
    """
    clock = FakeClock()
    cache = make(
        device_tokens=64,
        host_tokens=128,
        clock=clock,
        retention_device_tokens=48,
        retention_host_tokens=48,
    )
    agents = (0, 1)
    history = {s: prompt(s, 8) for s in range(8)}
    handles: dict[int, RetentionHandle] = {}
    hits = {"agents": [0, 0, 0], "others": [0, 0, 0]}
    for turn in range(4):
        for s in range(8):
            tokens = history[s] + [500 + 10 * turn + s] * P  # the tool's result
            req = run_turn(cache, tokens)
            group = hits["agents" if s in agents else "others"]
            group[0] += req.cached_len
            group[1] += req.device_hit
            group[2] += len(tokens)
            history[s] = req.token_ids[: len(tokens) // P * P]
            if pin and s in agents:
                if s in handles:
                    cache.unpin(handles[s])
                handles[s] = cache.pin(history[s], ttl_s=30)
            clock.t += 1.0
            cache.check_integrity()
    return {k: (a / n, d / n) for k, (a, d, n) in hits.items()}, cache


def test_agent_trace_pinned_sessions_keep_their_hits():
    base, _ = agent_trace(pin=False)
    pinned, cache = agent_trace(pin=True)
    for who in ("agents", "others"):
        (b, bd), (p, pd) = base[who], pinned[who]
        print(
            f"\n{who}: hit rate {b:.1%} without pins -> {p:.1%} with (gain {p - b:+.1%}); "
            f"device hits {bd:.1%} -> {pd:.1%}",
            end="",
        )
    assert pinned["agents"][0] > base["agents"][0]
    assert pinned["agents"][1] > base["agents"][1]
    # Unpinned sessions are the ones evicted: they hit less than the pinned agents.
    assert pinned["agents"][0] > pinned["others"][0]
    assert cache.counters.retention_pins == 8 and cache.counters.retention_refused == 0


def test_a_hybrid_prefix_whose_device_kv_lacks_its_state_is_pinned_whole():
    """A hybrid model's cached prefix can hold FULL KV on device below the device anchor (its
    Mamba state or SWA window only on host): ``pin`` took device plus host-only tokens for the
    prefix's length, missed those, and raised ``TreeIntegrityError`` or pinned a shorter
    prefix (a soak trial)."""
    from tests.runtime.synthetic import make_cache

    cache = make_cache(("swa", "full", "mamba"), "write_through", device_tokens=96)
    t = list(range(100, 120))
    run_turn(cache, t[:17])  # [0, 16) with a Mamba state at 16, backed up
    cache.drain()
    cache.poll()
    cache.evict(96)  # everything to host
    cache.poll()
    run_turn(cache, t[:8] + [900 + i for i in range(6)])  # [0, 8) recomputed on device
    cache.drain()
    cache.poll()
    prompt = t[:17] + [7, 7, 7, 1]
    m = cache.tree.match_prefix(prompt, read_only=True)
    assert m.device_len + m.host_hit_length < m.matched_len == 20, m  # the case itself
    h = cache.pin(prompt, ttl_s=10.0)
    assert h.tokens == 20
    cache.check_integrity()
