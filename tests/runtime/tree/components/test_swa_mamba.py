"""SWA tombstones, the leaf cap, window pins, Mamba states and the eviction cascade
(behaviour.md §6, 21–24, 28–32, 34, 35, 37, 40)."""

from __future__ import annotations

import pytest
import torch

from kvtier.runtime import CacheRequest, TreeIntegrityError
from tests.runtime.tree.harness import CONFIGS, Harness

SWA = [(p, w, m) for _, p, w, m in CONFIGS if w is not None]
SWA_IDS = [f"p{p}-w{w}{'-mamba' if m else ''}" for p, w, m in SWA]
MAMBA = [(p, w) for _, p, w, m in CONFIGS if m]
SWA_MAMBA = [(p, w) for p, w in MAMBA if w is not None]


def insert(h: Harness, tokens: list[int], slots: torch.Tensor, **kw):
    """Insert with a Mamba state where the config has one (matches end only at states)."""
    mamba = h.mamba_slot()
    res = h.tree.insert(tokens, slots, mamba_value=mamba, **kw)
    if mamba is not None and not res.mamba_adopted:
        h.tree.mamba.device_alloc.free(mamba)
    return res


def swa_request(h: Harness, tokens: list[int], evicted: int) -> torch.Tensor:
    """Slots of a request whose SWA data below ``evicted`` slid out of the window."""
    slots = h.alloc(len(tokens))
    h.kv.free_swa(slots[:evicted])
    return slots


@pytest.mark.parametrize("P,W,mamba", SWA, ids=SWA_IDS)
def test_swa_tombstone_parent_from_evicted_seqlen(P: int, W: int, mamba: bool) -> None:
    h = Harness(P, W, mamba)
    T = h.tokens(2 * h.tail // P)
    res = insert(h, T, swa_request(h, T, h.tail), swa_evicted_seqlen=h.tail)
    h.check()
    leaf = res.last_node
    assert leaf.start == h.tail and leaf.value[1] is not None
    assert leaf.parent.value[1] is None and leaf.parent.value[0] is not None
    assert h.device_len(T) == len(T)  # tombstone is > window above the boundary


@pytest.mark.parametrize("P,W,mamba", SWA, ids=SWA_IDS)
def test_swa_out_of_window_span_keeps_full(P: int, W: int, mamba: bool) -> None:
    h = Harness(P, W, mamba)
    T = h.tokens(2)
    free_before = h.kv.full_available_size()
    res = insert(h, T, swa_request(h, T, len(T)), swa_evicted_seqlen=len(T))
    assert h.kv.full_available_size() == free_before - len(T)
    assert res.last_node.value[0] is not None and res.last_node.value[1] is None
    assert h.device_len(T) == 0  # no SWA-resident window at the boundary
    h.check()
    # A later request with SWA data restores the tombstone (old FULL slots freed, new adopted).
    fresh = h.alloc(len(T))
    insert(h, T, fresh)
    assert torch.equal(torch.cat([n.value[0] for n in _path(res.last_node)]), fresh)
    assert h.device_len(T) == len(T)
    assert h.kv.full_available_size() == free_before - len(T)
    h.check()


def _path(node):
    out = []
    while node.parent is not None:
        out.append(node)
        node = node.parent
    return out[::-1]


@pytest.mark.parametrize("P,W,mamba", SWA, ids=SWA_IDS)
def test_swa_locked_tombstone_is_not_restored(P: int, W: int, mamba: bool) -> None:
    h = Harness(P, W, mamba)
    T = h.tokens(1)
    res = insert(h, T, swa_request(h, T, len(T)), swa_evicted_seqlen=len(T))
    handle = h.tree.pin(res.last_node)
    old = res.last_node.value[0].clone()
    free_before = h.kv.full_available_size()
    h.tree.insert(T, h.alloc(len(T)))
    assert h.kv.full_available_size() == free_before  # the fresh slots were freed
    assert torch.equal(res.last_node.value[0], old) and res.last_node.value[1] is None
    h.check()
    # A running request keeps its fresh slots (they carry its SWA data) and protects nothing.
    fresh = h.alloc(len(T))
    req = CacheRequest(list(T), fresh.clone())
    h.requests.append(req)
    h.tree.cache_unfinished_req(req)
    assert req.cache_protected_len == 0 and torch.equal(req.kv_slots, fresh)
    h.check()
    h.tree.unpin(handle)
    h.tree.cache_finished_req(req)
    h.requests.remove(req)
    assert res.last_node.value[1] is not None  # restored once unpinned
    h.check()


@pytest.mark.parametrize("P,W,mamba", SWA, ids=SWA_IDS)
def test_swa_leaf_cap_pins_one_window(P: int, W: int, mamba: bool) -> None:
    h = Harness(P, W, mamba)
    n = 3 * h.tail + P
    T = h.tokens(n // P)
    res = h.insert(T)
    assert len(res.last_node.key) == h.tail
    handle = h.tree.pin(h.tree.match_prefix(T).last_device_node)
    assert h.tree.protected[1] == h.tail
    assert h.tree.protected[0] == n
    h.tree.unpin(handle)
    short = h.tokens(1)
    assert len(h.insert(short).last_node.key) == P  # shorter than a window: not split
    h.check()


@pytest.mark.parametrize("P,W,mamba", SWA, ids=SWA_IDS)
def test_swa_eviction_tombstones_internal_and_cascades(P: int, W: int, mamba: bool) -> None:
    h = Harness(P, W, mamba)
    A, B = h.tokens(h.tail // P), h.tokens(h.tail // P)
    h.insert(A)
    h.insert(A + B)
    handle = h.tree.pin(h.tree.match_prefix(A + B).last_device_node)
    freed = h.tree.evict(swa=len(A))
    a_node = h.tree.match_prefix(A).last_device_node
    assert freed.swa == len(A)
    a_node = handle.node.parent
    assert a_node.value[1] is None and a_node.value[0] is not None
    if mamba:
        assert freed.mamba == 1 and a_node.value[2] is None  # cascade SWA > MAMBA
    h.check()
    h.tree.unpin(handle)
    h.check()


@pytest.mark.parametrize("P,W,mamba", SWA, ids=SWA_IDS)
def test_full_leaf_eviction_frees_swa_and_window_pin_protects(P: int, W: int, mamba: bool) -> None:
    h = Harness(P, W, mamba)
    T = h.tokens(h.tail // P)
    h.insert(T)
    handle = h.tree.pin(h.tree.match_prefix(T).last_device_node)
    assert h.tree.evict(swa=10**6).swa == 0
    h.tree.unpin(handle)
    freed = h.tree.evict(full=10**6)
    assert (freed.full, freed.swa, freed.mamba) == (len(T), len(T), int(mamba))
    assert h.kv.swa_available_size() == h.kv.swa.size
    h.check()


@pytest.mark.parametrize("P,W,mamba", SWA, ids=SWA_IDS)
def test_aux_eviction_on_full_locked_leaf_tombstones_only(P: int, W: int, mamba: bool) -> None:
    h = Harness(P, W, mamba)
    T = h.tokens(h.tail // P)
    leaf = h.insert(T).last_node
    handle = h.tree.pin(leaf)
    handle = h.tree.unpin_swa(handle)  # FULL stays pinned, SWA (and Mamba) released
    assert leaf.pins[0] == 1 and leaf.pins[1] == 0
    freed = h.tree.evict(swa=10**6)
    assert freed.swa == len(T) and freed.full == 0
    assert leaf.value[1] is None and leaf.id not in h.tree.swa.device_lru
    h.check()
    h.tree.unpin(handle)
    h.check()


def test_swa_eager_out_of_window_free() -> None:
    h = Harness(4, 8)
    T = h.tokens(8)
    req = CacheRequest(list(T), h.alloc(len(T)))
    h.requests.append(req)
    freed = h.tree.free_out_of_window(req)
    expect = len(T) // 4 * 4 - 8  # the window (8, two pages) below the last page boundary
    assert req.swa_evicted_seqlen == expect and freed == expect
    h.check()
    h.tree.cache_finished_req(req)
    h.requests.remove(req)
    assert h.device_len(T) == len(T)
    h.check()
    short = CacheRequest(h.tokens(2), h.alloc(8))
    assert h.tree.free_out_of_window(short) == 0 and short.swa_evicted_seqlen == 0


def test_swa_bounded_refresh_evicts_old_ancestors_first() -> None:
    h = Harness(1, 4)
    T, X, Y, S = h.tokens(16), h.tokens(4), h.tokens(4), h.tokens(4)
    h.insert(T + X)  # leaf cap: [0, 16) and [16, 20)
    h.insert(T + X + Y)
    top = h.tree.match_prefix(T, read_only=True).last_device_node
    h.insert(S)
    for _ in range(3):
        h.tree.match_prefix(T + X + Y)  # refreshes only window + P = 5 tokens near the bottom
    freed = h.tree.evict(swa=1)
    assert freed.swa == 16 and top.value[1] is None and top.value[0] is not None
    assert h.device_len(S) == len(S) and h.device_len(T + X + Y) == len(T + X + Y)
    h.check()


@pytest.mark.parametrize("P,W", MAMBA)
def test_mamba_only_eviction_breaks_match(P: int, W: int | None) -> None:
    h = Harness(P, W, True)
    A, B = h.tokens(1), h.tokens(1)
    h.insert(A)
    h.insert(A + B)
    assert h.tree.evict(mamba=1).mamba == 1
    h.check()
    h.tree.evict(mamba=10**6)
    assert h.device_len(A + B) == 0 and h.device_len(A) == 0
    assert h.tree.evictable[h.tree.mamba.slot] == 0
    h.check()


@pytest.mark.parametrize("P,W", MAMBA)
def test_mamba_insert_reports_existing_state(P: int, W: int | None) -> None:
    h = Harness(P, W, True)
    A = h.tokens(1)
    assert h.insert(A).mamba_adopted
    res = h.insert(A)
    assert res.mamba_exist and not res.mamba_adopted
    h.check()


@pytest.mark.parametrize("P,W", SWA_MAMBA)
def test_stranded_mamba_pin_raises_in_cascade(P: int, W: int) -> None:
    h = Harness(P, W, True)
    A, B = h.tokens(1), h.tokens(1)
    h.insert(A)
    leaf = h.insert(A + B).last_node
    internal = leaf.parent
    m = h.tree.mamba.slot
    internal.own_pins()[0] += 1
    internal.own_pins()[m] += 1  # a Mamba-only pin without the SWA window: stranded
    with pytest.raises(TreeIntegrityError, match="stranded"):
        h.tree.evict(swa=len(A))
    leaf.own_pins()[0] += 1
    leaf.own_pins()[m] += 1
    h.tree.evict_host()
    with pytest.raises(TreeIntegrityError, match="stranded"):
        h.tree.eviction._tombstone(leaf, h.tree.swa, [0, 0, 0], host=False)


def test_early_swa_release_drops_mamba_pin_keeps_full() -> None:
    h = Harness(1, 4, True)
    A, B = h.tokens(8), h.tokens(2)
    h.insert(A)
    h.insert(A + B)
    handle = h.tree.pin(h.tree.match_prefix(A).last_device_node)
    node = handle.node
    assert handle.mamba and node.pins[2] == 1
    handle = h.tree.unpin_swa(handle)
    assert node.pins == [1, 0, 0]
    h.tree.evict(full=len(B))
    freed = h.tree.evict(swa=10**6)
    assert freed.swa >= len(A) - 4 and node.value[0] is not None  # FULL stays pinned
    h.check()
    h.tree.unpin(handle)
    h.check()
