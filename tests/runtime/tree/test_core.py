"""Core radix tree scenarios (behaviour.md §6, 9–20, 26, 27, 39, 41) on every configuration."""

from __future__ import annotations

import sys

import pytest
import torch

from kvtier.runtime import CacheRequest, EvictResult
from tests.runtime.tree.harness import CONFIG_IDS, CONFIGS, Harness


@pytest.fixture(params=CONFIGS, ids=CONFIG_IDS)
def h(request) -> Harness:
    _, P, window, mamba = request.param
    return Harness(P, window, mamba)


def full_free(h: Harness) -> int:
    return h.kv.full_available_size() if h.tree.swa is not None else h.kv.available_size()


def test_insert_and_match_basics(h: Harness) -> None:
    A, B = h.tokens(2), h.tokens(1)
    assert h.insert(A).prefix_len == 0
    assert h.insert(A + B).prefix_len == len(A)
    assert h.device_len(A + B) == len(A + B)
    assert h.device_len(A + h.tokens(1)) == len(A)
    assert h.device_len(h.tokens(2)) == 0
    h.check()


def test_shared_prefix_branches(h: Harness) -> None:
    base, b1, b2, b3 = h.tokens(2), h.tokens(1), h.tokens(2), h.tokens(1)
    h.insert(base)
    for branch in (b1, b2, b3):
        h.insert(base + branch)
    for branch in (b1, b2, b3):
        assert h.device_len(base + branch) == len(base + branch)
    assert h.device_len(base + h.tokens(1)) == len(base)
    assert len(h.tree.match_prefix(base).last_device_node.children) == 3
    h.check()


def test_evict_empty_tree_frees_nothing(h: Harness) -> None:
    assert h.tree.evict(full=100, swa=100, mamba=5) == EvictResult(0, 0, 0)
    h.check()


def test_lock_protects_and_unlock_releases(h: Harness) -> None:
    A = h.tokens(3)
    h.insert(A)
    assert h.tree.evictable[0] == len(A)
    m = h.tree.match_prefix(A)
    handle = h.tree.pin(m.last_device_node)
    assert handle.delta == len(A)
    assert h.tree.evictable[0] == 0 and h.tree.protected[0] == len(A)
    assert h.tree.evict(full=10**6).full == 0
    assert h.device_len(A) == len(A)
    h.check()
    h.tree.unpin(handle)
    h.check()
    freed = h.tree.evict(full=10**6)
    assert freed.full == len(A)
    assert h.device_len(A) == 0
    assert h.tree.evictable == [0] * len(h.tree.components)
    assert full_free(h) == h.kv.size
    h.check()


def test_evict_until_empty(h: Harness) -> None:
    seqs = [h.tokens(2), h.tokens(1), h.tokens(3)]
    for s in seqs:
        h.insert(s)
    h.insert(seqs[0] + h.tokens(1))
    before = h.tree.evictable[0]
    assert h.tree.evict(full=10**6).full == before
    assert all(h.device_len(s) == 0 for s in seqs)
    assert not h.tree.root.children
    if h.tree.mamba is not None:
        assert h.tree.mamba.device_alloc.available_size() == h.tree.mamba.device_alloc.size
    h.check()


def test_prev_prefix_len_frees_each_duplicate_once(h: Harness) -> None:
    P, T = h.P, h.tokens(3)
    h.tree.insert(T[:P], h.alloc(P), mamba_value=h.mamba_slot())
    h.check()
    s2 = h.alloc(2 * P)
    free_before = full_free(h)
    h.tree.insert(T[: 2 * P], s2, prev_prefix_len=0, mamba_value=h.mamba_slot())
    assert full_free(h) == free_before + P  # the overlapping first page came back
    h.check()
    m = h.tree.match_prefix(T[: 2 * P])
    assert m.device_len == 2 * P
    handle = h.tree.pin(m.last_device_node)
    value = torch.cat([m.device_indices, h.alloc(P)])
    free_before = full_free(h)
    h.tree.insert(T, value, prev_prefix_len=2 * P)
    assert full_free(h) == free_before  # nothing duplicated, nothing freed
    h.tree.unpin(handle)
    h.check()


def test_paged_keys(h: Harness) -> None:
    P = h.P
    A = h.tokens(2)
    tail = [7] * (P - 1)
    assert h.insert(A + tail).total_len == len(A)
    assert h.device_len(A + tail) == len(A)
    if P > 1:
        assert h.device_len(A[: P - 1]) == 0
        (child,) = h.tree.root.children.values()
        assert child.key == A[: len(child.key)] and len(child.key) % P == 0
    other = A[:P] + h.tokens(1)
    assert h.device_len(other) == (0 if h.tree.mamba is not None else P)
    assert h.device_len(h.tokens(1) + A[P:]) == 0
    h.check()


def test_split_forks(h: Harness) -> None:
    P = h.P
    base, a, b, c = h.tokens(2), h.tokens(1), h.tokens(1), h.tokens(1)
    h.insert(base + a)
    h.insert(base[:P] + c)
    h.insert(base + b)
    for seq in (base + a, base + b, base[:P] + c):
        assert h.device_len(seq) == len(seq)
    h.check()


@pytest.mark.parametrize("tail", [0, 1], ids=["aligned", "unaligned"])
def test_cache_finished_req(h: Harness, tail: int) -> None:
    P = h.P
    tokens = h.tokens(3) + [5] * (tail * max(1, P // 2))
    n_pages = -(-len(tokens) // P)
    req = CacheRequest(tokens, h.alloc(n_pages * P), mamba_slot=h.mamba_slot())
    h.requests.append(req)
    h.check()
    h.tree.cache_finished_req(req)
    h.requests.remove(req)
    h.check()
    aligned = len(tokens) // P * P
    assert full_free(h) == h.kv.size - aligned
    if h.tree.mamba is None:
        assert h.device_len(tokens) == aligned
        return
    # The live state covers every token, so only a page-aligned request hands it over.
    adopted = aligned == len(tokens)
    assert h.device_len(tokens) == (aligned if adopted else 0)
    mamba = h.tree.mamba.device_alloc
    assert mamba.available_size() == mamba.size - adopted


def test_cache_finished_req_without_insert(h: Harness) -> None:
    tokens = h.tokens(3)
    req = CacheRequest(tokens, h.alloc(len(tokens)), mamba_slot=h.mamba_slot())
    h.tree.release_req(req)
    assert h.device_len(tokens) == 0
    assert full_free(h) == h.kv.size
    h.check()


def test_cache_unfinished_req(h: Harness) -> None:
    P = h.P
    tokens = h.tokens(2)
    req = CacheRequest(list(tokens), h.alloc(2 * P))
    h.requests.append(req)
    h.tree.cache_unfinished_req(req)
    h.check()
    assert req.cache_protected_len == 2 * P
    assert req.pin is not None and req.pin.node.end == 2 * P
    assert h.tree.protected[0] == 2 * P
    req.token_ids += h.tokens(1)
    req.kv_slots = torch.cat([req.kv_slots, h.alloc(P)])
    h.check()
    h.tree.cache_unfinished_req(req)
    assert req.cache_protected_len == 3 * P
    assert torch.equal(req.kv_slots, torch.cat(_path_values(req.pin.node)))
    h.check()
    h.tree.cache_finished_req(req)
    h.requests.remove(req)
    assert h.tree.protected[0] == 0
    h.check()


def _path_values(node) -> list[torch.Tensor]:
    out = []
    while node.parent is not None:
        out.append(node.value[0])
        node = node.parent
    return out[::-1]


def test_read_only_match_never_splits(h: Harness) -> None:
    P = h.P
    A = h.tokens(3)  # the first node is >= 2 pages even after an SWA leaf cap
    h.insert(A)
    probe = A[:P] + h.tokens(1)
    n_nodes = len(h.tree.all_nodes())
    ro = h.tree.match_prefix(probe, read_only=True)
    assert len(h.tree.all_nodes()) == n_nodes
    reg = h.tree.match_prefix(probe)
    assert len(h.tree.all_nodes()) == n_nodes + 1
    # Same answer as the splitting match: one page unless MAMBA (no state inside a node).
    assert ro.device_len == reg.device_len == (0 if h.tree.mamba is not None else P)
    assert torch.equal(ro.device_indices, reg.device_indices)
    assert torch.equal(ro.device_indices, h.tree.match_prefix(A).device_indices[: ro.device_len])
    h.check()


def test_namespaces_separate_trees(h: Harness) -> None:
    A = h.tokens(2)
    h.insert(A, namespace="lora-1")
    assert h.device_len(A) == 0
    assert h.tree.match_prefix(A, "lora-1").device_len == len(A)
    assert h.tree.match_prefix(A, "lora-2").device_len == 0
    h.check()


def test_colliding_page_hashes_stay_apart(h: Harness) -> None:
    """Children are keyed by their page's hash: pages whose hashes collide (ints equal modulo
    the hash modulus hash alike, and so do tuples of them) stay distinct siblings through
    insert, split, match, eviction of the one holding the hash, and reinsertion."""
    M = sys.hash_info.modulus

    def twin(tokens: list[int], k: int) -> list[int]:
        return [tokens[0] + k * M, *tokens[1:]]

    base, A = h.tokens(1), h.tokens(2)
    for prefix in ([], base):  # siblings under the root (namespace in the key) and below it
        h.insert(prefix + A)
        h.insert(prefix + twin(A, 1))  # under ``base`` this also splits at the shared page
        assert h.device_len(prefix + A) == h.device_len(prefix + twin(A, 1)) == len(prefix + A)
        assert h.device_len(prefix + twin(A, 2)) == (len(prefix) if h.tree.mamba is None else 0)
    assert len(h.tree.root.children) == 3
    assert h.tree.match_prefix(A, 5 + M).device_len == 0  # a namespace of the same hash
    h.insert(A, namespace=5)
    assert h.tree.match_prefix(A, 5 + M).device_len == 0
    assert h.tree.match_prefix(A, 5).device_len == len(A)
    # Evict the root child that holds the hash (the oldest leaf); its twin stays reachable.
    for seq in (base + A, base + twin(A, 1), twin(A, 1)):
        h.tree.match_prefix(seq)
    h.tree.match_prefix(A, 5)
    assert h.tree.evict(full=len(A)).full == len(A)
    h.check()
    assert h.device_len(A) == 0 and h.device_len(twin(A, 1)) == len(A)
    h.insert(twin(A, 2))  # takes the freed hash
    h.insert(A)
    for seq in (A, twin(A, 1), twin(A, 2), base + A, base + twin(A, 1)):
        assert h.device_len(seq) == len(seq)
    h.tree.evict(full=h.kv.size)
    assert not h.tree.root.children
    h.check()


def test_lru_order_and_priority_policy() -> None:
    h = Harness(4)
    a, b, c = h.tokens(1), h.tokens(1), h.tokens(1)
    for s in (a, b, c):
        h.insert(s)
    h.tree.match_prefix(a)  # a is now the most recent
    assert h.tree.evict(full=4).full == 4
    assert [h.device_len(s) for s in (a, b, c)] == [4, 0, 4]
    hp = Harness(4, eviction_policy="priority")
    x, y = hp.tokens(1), hp.tokens(1)
    hp.insert(x, priority=5)
    hp.insert(y, priority=0)
    hp.tree.match_prefix(y)
    hp.tree.match_prefix(x)
    hp.tree.evict(full=4)
    assert hp.device_len(x) == 4 and hp.device_len(y) == 0
    hp.check()


def test_locked_branch_keeps_shared_prefix() -> None:
    h = Harness(4)
    base, b1, b2 = h.tokens(2), h.tokens(1), h.tokens(1)
    h.insert(base + b1)
    h.insert(base + b2)
    handle = h.tree.pin(h.tree.match_prefix(base + b1).last_device_node)
    freed = h.tree.evict(full=10**6)
    assert freed.full == len(b2)
    assert h.device_len(base + b1) == len(base + b1)
    h.tree.unpin(handle)
    assert h.tree.evict(full=10**6).full == len(base + b1)
    h.check()
