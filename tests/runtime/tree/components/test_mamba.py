"""Mamba states handed between the tree and requests: copy-on-write on match, the branching
seqlen, and state donation by running requests (behaviour.md §2.5, §2.7; §6, 28 and 57)."""

from __future__ import annotations

import pytest
import torch

from kvtier.runtime import CacheRequest
from kvtier.runtime.pools.mamba import MambaDevicePool, MambaStateSpec
from tests.runtime.tree.harness import CONFIGS, Harness

MAMBA = [(p, w) for _, p, w, m in CONFIGS if m]
MAMBA_IDS = [f"p{p}-w{w}" for p, w in MAMBA]


def states(h: Harness) -> dict[int, int]:
    """Node id -> device state slot, for every node holding a state."""
    s = h.tree.mamba.slot
    return {n.id: int(n.value[s]) for n in h.tree.all_nodes()[1:] if n.value[s] is not None}


def extend(h: Harness, prefix: list[int], suffix: list[int]) -> None:
    """Cache ``prefix + suffix`` as a request that matched ``prefix`` and saved no state."""
    m = h.tree.match_prefix(prefix)
    assert m.device_len == len(prefix)
    slots = torch.cat([m.device_indices, h.alloc(len(suffix))])
    h.tree.insert(prefix + suffix, slots, prev_prefix_len=len(prefix))
    h.check()


@pytest.mark.parametrize("P,W", MAMBA, ids=MAMBA_IDS)
def test_cow_match_gives_the_request_its_own_slot(P: int, W: int | None) -> None:
    h = Harness(P, W, True)
    pool = h.tree.mamba.device_alloc
    A = h.tokens(2)
    src = h.insert(A).last_node.value[h.tree.mamba.slot].clone()
    free = pool.available_size()
    assert h.tree.match_prefix(A).mamba_cow is None and pool.available_size() == free
    assert h.tree.match_prefix(h.tokens(2), cow_mamba=True).mamba_cow is None  # miss
    assert h.tree.match_prefix(A, cow_mamba=True, read_only=True).mamba_cow is None
    assert pool.available_size() == free
    m = h.tree.match_prefix(A, cow_mamba=True)
    assert m.device_len == len(A) and m.mamba_cow is not None
    assert torch.equal(m.mamba_cow.src, src) and int(m.mamba_cow.dst) != int(src)
    assert pool.available_size() == free - 1 and bool(pool.is_allocated(m.mamba_cow.dst).all())
    lock = h.tree.pin(m.last_device_node)
    req = CacheRequest(list(A), m.device_indices, len(A), lock, mamba_slot=m.mamba_cow.dst)
    h.requests.append(req)
    h.check()  # the new slot is the request's, the source still the tree's
    h.tree.cache_finished_req(req)  # the node has a state already: the request's slot is freed
    h.requests.remove(req)
    h.check()
    assert pool.available_size() == free and states(h) == {m.last_device_node.id: int(src)}


def test_cow_copy_gives_the_request_the_anchor_state_and_leaves_the_tree_copy_alone() -> None:
    h = Harness(16, None, True)
    pool = MambaDevicePool(2, h.tree.mamba.device_alloc.size, MambaStateSpec((2, 4), ((3, 2),)))
    A = h.tokens(2)
    src = int(h.insert(A).last_node.value[h.tree.mamba.slot])
    for t in pool.tensors:
        t.normal_()
    ref = [t[:, src].clone() for t in pool.tensors]
    m = h.tree.match_prefix(A, cow_mamba=True)
    lock = h.tree.pin(m.last_device_node)
    pool.copy_slots(m.mamba_cow.src, m.mamba_cow.dst)
    dst = int(m.mamba_cow.dst)
    for t, r in zip(pool.tensors, ref, strict=True):
        assert torch.equal(t[:, dst], r)
        t[:, dst] += 1  # the request advances its own copy
        assert torch.equal(t[:, src], r), "the tree's state changed with the request's copy"
    h.tree.unpin(lock)
    h.tree.mamba.device_alloc.free(m.mamba_cow.dst)
    h.check()


@pytest.mark.parametrize("P,W", MAMBA, ids=MAMBA_IDS)
def test_cow_waits_for_a_host_only_state_to_load_back(P: int, W: int | None) -> None:
    h = Harness(P, W, True, host=True)
    s = h.tree.mamba.slot
    A = h.tokens(2)
    node = h.insert(A).last_node
    h.tree.finish_backup(h.tree.backup(node))
    h.tree.evict(full=10**6)  # demoted: FULL and the state live on host only
    assert node.evicted and node.value[s] is None and node.host_value[s] is not None
    free = h.tree.mamba.device_alloc.available_size()
    m = h.tree.match_prefix(A, cow_mamba=True)
    assert m.best_match_node is node and m.mamba_host_hit_length == 1
    assert m.mamba_cow is None and h.tree.mamba.device_alloc.available_size() == free
    load = h.tree.load_back(node)
    cow = h.tree.mamba_copy_on_write(node)
    assert cow is not None and torch.equal(cow.src, node.value[s])
    h.tree.finish_load_back(load)
    h.tree.mamba.device_alloc.free(cow.dst)
    h.check()


@pytest.mark.parametrize("P,W", MAMBA, ids=MAMBA_IDS)
def test_cow_on_a_full_pool_evicts_another_state_not_the_source(P: int, W: int | None) -> None:
    h = Harness(P, W, True)
    pool = h.tree.mamba.device_alloc
    anchor = h.insert(h.tokens(2)).last_node  # oldest in the Mamba LRU
    others = [h.insert(h.tokens(2)).last_node for _ in range(pool.size - 1)]
    assert pool.available_size() == 0
    src = int(anchor.value[h.tree.mamba.slot])
    cow = h.tree.mamba_copy_on_write(anchor)
    assert cow is not None and int(cow.src) == src and int(cow.dst) != src
    assert int(anchor.value[h.tree.mamba.slot]) == src and anchor.pins[0] == 0
    assert sum(n.value[h.tree.mamba.slot] is None for n in others) == 1
    h.tree.mamba.device_alloc.free(cow.dst)
    h.check()


@pytest.mark.parametrize("P,W", MAMBA, ids=MAMBA_IDS)
def test_branching_seqlen_points_past_the_mamba_anchor(P: int, W: int | None) -> None:
    h = Harness(P, W, True, mamba_chunk_size=2 * P)  # grid: every 2 pages
    A, B, C = h.tokens(2), h.tokens(3), h.tokens(1)
    h.insert(A)
    extend(h, A, B)  # FULL reaches len(A + B), the last state ends at len(A)
    m = h.tree.match_prefix(A + B + C)
    assert m.device_len == len(A) and m.mamba_branching_seqlen == 4 * P
    assert h.tree.match_prefix(A + C).mamba_branching_seqlen is None  # FULL ends at the state
    ro = h.tree.match_prefix(A + B + C, read_only=True)
    assert ro.mamba_branching_seqlen == 4 * P
    # The request computed past A with its own slots, checkpointed its state at the branching
    # position, and caches that prefix: its duplicate FULL slots are freed, the state adopted.
    state = h.mamba_slot()
    seq = (A + B)[: 4 * P]
    slots = torch.cat([m.device_indices, h.alloc(len(seq) - len(A))])
    free = h.kv.available_size() if W is None else h.kv.full_available_size()
    res = h.tree.insert(seq, slots, prev_prefix_len=len(A), mamba_value=state)
    assert res.mamba_adopted and res.last_node.end == 4 * P
    assert (h.kv.available_size() if W is None else h.kv.full_available_size()) == free + 2 * P
    h.check()
    m = h.tree.match_prefix(A + B + C)
    assert m.device_len == 4 * P and m.mamba_branching_seqlen is None


@pytest.mark.parametrize("P,W", MAMBA, ids=MAMBA_IDS)
def test_branching_seqlen_is_off_with_a_host_tier(P: int, W: int | None) -> None:
    h = Harness(P, W, True, host=True, mamba_chunk_size=2 * P)
    A, B = h.tokens(2), h.tokens(3)
    h.insert(A)
    extend(h, A, B)
    m = h.tree.match_prefix(A + B)
    assert m.device_len == len(A) and m.mamba_branching_seqlen is None


@pytest.mark.parametrize("P,W", MAMBA, ids=MAMBA_IDS)
def test_unfinished_req_donates_a_copy_of_its_state(P: int, W: int | None) -> None:
    h = Harness(P, W, True)
    pool = h.tree.mamba.device_alloc
    s = h.tree.mamba.slot
    T = h.tokens(2)
    req = CacheRequest(list(T), h.alloc(len(T)), mamba_slot=h.mamba_slot())
    h.requests.append(req)
    free = pool.available_size()
    copy = h.tree.cache_unfinished_req(req, donate_mamba=True)
    assert copy is not None and torch.equal(copy.src, req.mamba_slot)
    first = req.pin.node
    assert torch.equal(first.value[s], copy.dst) and int(copy.dst) != int(req.mamba_slot)
    assert pool.available_size() == free - 1 and first.pins[s] == 1
    assert h.device_len(T) == len(T)
    h.check()
    # Decode moves on by a page: a second checkpoint on the new end node.
    req.token_ids += h.tokens(1)
    req.kv_slots = torch.cat([req.kv_slots, h.alloc(P)])
    copy = h.tree.cache_unfinished_req(req, donate_mamba=True)
    assert copy is not None and req.pin.node is not first
    assert torch.equal(req.pin.node.value[s], copy.dst) and first.pins[s] == 0
    h.check()
    # A second request on the same tokens donates nothing: the node has a state.
    twin = CacheRequest(list(req.token_ids), h.alloc(len(req.token_ids)), mamba_slot=h.mamba_slot())
    h.requests.append(twin)
    before = pool.available_size()
    assert (
        h.tree.cache_unfinished_req(twin, donate_mamba=True) is None
        and pool.available_size() == before
    )
    h.check()
    # Off a page boundary (P > 1) the live state fits no node: FULL is cached, no state given.
    req.token_ids += h.tokens(1) + [7] * (P > 1)
    req.kv_slots = torch.cat([req.kv_slots, h.alloc(2 * P)])
    protected = req.cache_protected_len
    copy = h.tree.cache_unfinished_req(req, donate_mamba=True)
    assert req.cache_protected_len == protected + P
    assert (copy is None) == (P > 1) and pool.available_size() == before - (P == 1)
    h.check()
    for r in (req, twin):
        h.tree.cache_finished_req(r)
        h.requests.remove(r)
    h.check()
    kept = 2 + (P == 1)
    assert len(states(h)) == kept and pool.available_size() == pool.size - kept


@pytest.mark.parametrize("P,W", MAMBA, ids=MAMBA_IDS)
def test_unfinished_req_donates_nothing_unless_asked(P: int, W: int | None) -> None:
    h = Harness(P, W, True)
    pool = h.tree.mamba.device_alloc
    T = h.tokens(2)
    req = CacheRequest(list(T), h.alloc(len(T)), mamba_slot=h.mamba_slot())
    h.requests.append(req)
    free = pool.available_size()
    assert h.tree.cache_unfinished_req(req) is None
    assert pool.available_size() == free and not states(h)
    assert req.cache_protected_len == len(T) and h.device_len(T) == 0  # no state to end on
    h.check()


@pytest.mark.parametrize("P,W", MAMBA, ids=MAMBA_IDS)
def test_unfinished_req_donation_evicts_a_state_on_a_full_pool(P: int, W: int | None) -> None:
    h = Harness(P, W, True)
    pool = h.tree.mamba.device_alloc
    for _ in range(pool.size - 1):
        h.insert(h.tokens(2))
    T = h.tokens(2)
    req = CacheRequest(list(T), h.alloc(len(T)), mamba_slot=h.mamba_slot())
    h.requests.append(req)
    assert pool.available_size() == 0
    copy = h.tree.cache_unfinished_req(req, donate_mamba=True)
    assert copy is not None and len(states(h)) == pool.size - 1
    assert h.device_len(T) == len(T)
    h.check()
