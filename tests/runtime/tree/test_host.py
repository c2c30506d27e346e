"""Host tier books: backup, demotion, the two match anchors, load-back, host-leaf eviction, skip
handles and failed write-back (behaviour.md §6, 33, 45–49, 51, 54–56, 58, 61)."""

from __future__ import annotations

import pytest
import torch

from kvtier.runtime import TreeConfig, build_tree
from tests.runtime.tree.harness import Harness

HOST = [(4, None, False), (4, 8, False), (1, None, True), (4, 8, True)]
HOST_IDS = ["full", "swa", "mamba", "swa+mamba"]


@pytest.fixture(params=HOST, ids=HOST_IDS)
def h(request) -> Harness:
    P, window, mamba = request.param
    return Harness(P, window, mamba, host=True)


def backed_up_leaf(h: Harness, tokens: list[int]):
    leaf = h.insert(tokens).last_node
    b = h.tree.backup(leaf)
    assert b is not None
    pools = {t.pool for t in b.transfers}
    assert "kv" in pools and all(t.direction == "d2h" for t in b.transfers)
    h.tree.finish_backup(b)
    h.check()
    return leaf


def test_backup_then_eviction_demotes_to_host(h: Harness) -> None:
    T = h.tokens(2)
    leaf = backed_up_leaf(h, T)
    freed = h.tree.evict(full=10**6)
    assert freed.full == len(T)
    assert leaf.attached and leaf.evicted and leaf.backed_up
    assert leaf in h.tree.host_leaves and leaf not in h.tree.device_leaves
    for comp in h.tree.aux:
        assert leaf.id in comp.host_lru
    h.check()
    freed = h.tree.evict_host(full=10**6)
    assert freed.full == len(T) and not leaf.attached
    assert h.tree.match_prefix(T).best_match_node is h.tree.root
    h.check()


def test_two_anchors_and_load_back(h: Harness) -> None:
    base, tail = h.tokens(2), h.tokens(2)
    h.insert(base)
    leaf = backed_up_leaf(h, base + tail)
    handle = h.tree.pin(h.tree.match_prefix(base).last_device_node)
    h.tree.evict(full=10**6)
    m = h.tree.match_prefix(base + tail)
    assert m.device_len == len(base) and m.best_match_node is leaf
    assert m.last_device_node is handle.node
    assert m.host_hit_length == len(tail)
    if h.tree.mamba is not None:
        assert m.mamba_host_hit_length == 1
    lb = h.tree.load_back(m.best_match_node)
    assert lb is not None and lb.loaded_tokens == len(tail)
    kv = next(t for t in lb.transfers if t.pool == "kv")
    assert torch.equal(kv.host_indices, leaf.host_value[0]) and kv.direction == "h2d"
    h.check()
    assert h.tree.evict(full=10**6).full == 0  # the loaded path is pinned mid-copy
    assert h.tree.evict_host(full=10**6).full == 0  # and so is its host copy
    h.tree.finish_load_back(lb)
    h.tree.unpin(handle)
    m = h.tree.match_prefix(base + tail)
    assert m.device_len == len(base + tail) and m.host_hit_length == 0
    h.check()


def test_partial_match_on_host_node_splits_and_counts_as_host_hit(h: Harness) -> None:
    P = h.P
    T = h.tokens(3)
    leaf = backed_up_leaf(h, T)
    h.tree.evict(full=10**6)
    m = h.tree.match_prefix(T[: 2 * P] + h.tokens(1))
    assert leaf.parent is not h.tree.root and len(leaf.parent.key) >= P
    if h.tree.mamba is None and h.tree.swa is None:
        assert m.host_hit_length == 2 * P and m.best_match_node is leaf.parent
    if h.tree.mamba is not None:
        assert m.host_hit_length == 0  # the split piece holds no state
    h.check()


def test_lock_on_evicted_node_skips_and_survives_load_back(h: Harness) -> None:
    base, tail = h.tokens(2), h.tokens(1)
    h.insert(base)
    leaf = backed_up_leaf(h, base + tail)
    h.tree.evict(full=len(tail))
    assert leaf.evicted and not leaf.parent.evicted
    handle = h.tree.pin(leaf)  # skips the evicted bottom, pins the device ancestors
    assert handle.full_end == leaf.start and leaf.pins[0] == 0
    lb = h.tree.load_back(leaf)
    h.tree.finish_load_back(lb)
    assert not leaf.evicted
    h.tree.unpin(handle)  # must not decrement the restored leaf
    assert all(x == 0 for x in leaf.pins)
    h.check()


def test_swa_only_host_copy_gives_swa_host_hit() -> None:
    h = Harness(4, 8, False, host=True)
    A, B = h.tokens(2), h.tokens(2)
    h.insert(A)
    leaf = backed_up_leaf(h, A + B)
    handle = h.tree.pin(leaf)
    handle = h.tree.unpin_swa(handle)
    h.tree.evict(swa=10**6)
    assert leaf.value[1] is None and leaf.host_value[1] is not None
    m = h.tree.match_prefix(A + B)
    assert m.host_hit_length == 0 and m.swa_host_hit_length == len(B)
    assert m.best_match_node is leaf and m.last_device_node is not leaf
    lb = h.tree.load_back(leaf)
    assert lb is not None and lb.loaded_tokens == 0
    assert [t.pool for t in lb.transfers] == ["swa"]
    h.tree.finish_load_back(lb)
    h.tree.unpin(handle)
    assert h.tree.match_prefix(A + B).last_device_node is leaf
    h.check()


def test_device_leaf_with_host_only_children(h: Harness) -> None:
    A, B = h.tokens(1), h.tokens(1)
    h.insert(A)
    leaf = backed_up_leaf(h, A + B)
    h.tree.evict(full=len(B))
    parent = leaf.parent
    assert leaf.evicted and parent.children and parent in h.tree.device_leaves
    h.tree.evict(full=10**6)
    assert parent.evicted and parent.backed_up
    h.check()


def test_failed_write_back_keeps_node_on_device() -> None:
    tree = build_tree(
        TreeConfig(page_size=4, kv_size=64, host_kv_size=64), write_back=lambda n: False
    )
    kv = tree.full.device_alloc
    tree.insert(list(range(8)), kv.alloc(8))
    assert tree.evict(full=100).full == 0
    assert tree.match_prefix(list(range(8))).device_len == 8
    tree.check_integrity()


def test_write_back_backs_up_on_eviction() -> None:
    backups = []

    def write_back(node) -> bool:
        b = tree.backup(node)
        if b is None:
            return False
        backups.append(b)
        tree.finish_backup(b)
        return True

    tree = build_tree(
        TreeConfig(page_size=4, kv_size=64, host_kv_size=64, backup_continuity=False), write_back
    )
    kv = tree.full.device_alloc
    tree.insert(list(range(8)), kv.alloc(8))
    tree.insert(list(range(12)), kv.alloc(12), prev_prefix_len=0)
    assert tree.evict(full=4).full == 4
    assert len(backups) == 1 and backups[0].nodes[0].start == 8  # the leaf, not its parent
    tree.check_integrity()
    m = tree.match_prefix(list(range(12)))
    assert m.device_len == 8 and m.host_hit_length == 4


def test_backup_without_host_room_changes_nothing() -> None:
    tree = build_tree(TreeConfig(page_size=4, kv_size=64, host_kv_size=16))
    kv = tree.full.device_alloc
    leaf = tree.insert(list(range(32)), kv.alloc(32)).last_node
    assert tree.backup(leaf) is None
    assert not leaf.backed_up and tree.full.host_alloc.available_size() == 16
    tree.check_integrity()
