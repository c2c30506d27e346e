"""``graft_host`` with an ``"swa"`` entry: the SWA window read from L3 goes onto the tree with KV.

A prefetch of a hybrid (FULL + SWA) model reads its SWA window into SWA host slots and grafts
them next to the KV slots. The tree must take the SWA slots of exactly the tokens it takes, keep
them aligned with KV through splits, leave the caller the rest, and balance both host pools.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.runtime.tree.config import TreeConfig, build_tree
from kvtier.runtime.tree.types import TreeIntegrityError

P = 4
TOKENS = list(range(200, 216))  # 4 pages


def make_tree():
    return build_tree(
        TreeConfig(page_size=P, kv_size=32, swa_window=8, host_kv_size=64, host_swa_size=64)
    )


def test_graft_takes_swa_slots_with_kv_and_books_balance():
    tree = make_tree()
    s = tree.swa.slot
    kv_host, swa_host = tree.full.host_alloc, tree.swa.host_alloc
    kv, swa = kv_host.alloc(8), swa_host.alloc(8)
    with pytest.raises(TreeIntegrityError, match="swa host: allocator has 8 slots in use"):
        tree.check_integrity(host_owned={"kv": 8})
    tree.check_integrity(host_owned={"kv": 8, "swa": 8})

    end, present = tree.graft_host(tree.root, TOKENS[:8], {"kv": kv, "swa": swa}, None, "ns")
    assert present == 0 and end.end == 8
    assert torch.equal(end.host_value[0], kv) and torch.equal(end.host_value[s], swa)
    assert end.value[0] is None and end.value[s] is None
    tree.check_integrity()
    m = tree.match_prefix(TOKENS[:8] + [1], "ns")
    assert m.host_hit_length == 8 and m.swa_host_hit_length == 8, m

    # The whole 4 pages: the first 2 are present; the tree takes KV and SWA of the last 2 only.
    kv2, swa2 = kv_host.alloc(16), swa_host.alloc(16)
    end2, present2 = tree.graft_host(tree.root, TOKENS, {"kv": kv2, "swa": swa2}, None, "ns")
    assert present2 == 8 and end2.parent is end
    assert torch.equal(end2.host_value[0], kv2[8:]) and torch.equal(end2.host_value[s], swa2[8:])
    with pytest.raises(TreeIntegrityError, match="swa host"):
        tree.check_integrity(host_owned={"kv": 8})
    tree.check_integrity(host_owned={"kv": 8, "swa": 8})
    kv_host.free(kv2[:8])
    swa_host.free(swa2[:8])
    tree.check_integrity()
    assert kv_host.used_size() == 16 and swa_host.used_size() == 16


def test_graft_swa_split_keeps_kv_and_swa_aligned():
    tree = make_tree()
    s = tree.swa.slot
    kv_host, swa_host = tree.full.host_alloc, tree.swa.host_alloc
    kv, swa = kv_host.alloc(12), swa_host.alloc(12)
    first, _ = tree.graft_host(
        tree.root, TOKENS[:12], {"kv": kv, "swa": swa}, ["a", "b", "c"], None
    )
    other = TOKENS[:4] + [1, 2, 3, 4]
    kv2, swa2 = kv_host.alloc(8), swa_host.alloc(8)
    end, present = tree.graft_host(tree.root, other, {"kv": kv2, "swa": swa2}, ["a", "x"], None)
    assert present == 4 and end.key == [1, 2, 3, 4]
    upper = end.parent
    assert upper.key == TOKENS[:4] and first.parent is upper
    # The split cut both host values at the same token.
    assert torch.equal(upper.host_value[0], kv[:4]) and torch.equal(upper.host_value[s], swa[:4])
    assert torch.equal(first.host_value[0], kv[4:]) and torch.equal(first.host_value[s], swa[4:])
    assert torch.equal(end.host_value[0], kv2[4:]) and torch.equal(end.host_value[s], swa2[4:])
    tree.check_integrity(host_owned={"kv": 4, "swa": 4})
    kv_host.free(kv2[:4])
    swa_host.free(swa2[:4])
    tree.check_integrity()

    # Host eviction frees SWA with KV: both pools are empty afterwards.
    tree.evict_host(full=10**6)
    tree.check_integrity()
    assert kv_host.used_size() == 0 and swa_host.used_size() == 0


def test_graft_kv_only_in_swa_tree_has_no_swa_host_hit():
    """Without the window (a partial prefetch) the node is KV-only: no SWA host data claimed."""
    tree = make_tree()
    kv = tree.full.host_alloc.alloc(8)
    end, _ = tree.graft_host(tree.root, TOKENS[:8], {"kv": kv}, None, None)
    assert end.host_value[tree.swa.slot] is None
    tree.check_integrity()
    assert tree.match_prefix(TOKENS[:8] + [1], None).swa_host_hit_length == 0


def test_graft_rejects_swa_slots_of_the_wrong_length():
    tree = make_tree()
    kv, swa = tree.full.host_alloc.alloc(8), tree.swa.host_alloc.alloc(4)
    with pytest.raises(ValueError, match=r"host_slots_per_pool\['swa'\]: 4 slots for 8 tokens"):
        tree.graft_host(tree.root, TOKENS[:8], {"kv": kv, "swa": swa}, None, None)
    tree.check_integrity(host_owned={"kv": 8, "swa": 4})  # nothing was taken
