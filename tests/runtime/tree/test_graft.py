"""The tree API the L3 prefetch uses: ``graft_host`` and ``check_integrity(host_owned=...)``.

A prefetch allocates host slots from the tree's host pool, reads pages into them while they are
held outside the tree, then grafts them: the tree takes the slots of the tokens it lacked, the
caller keeps (and frees) the rest. The integrity check balances every host pool only when it is
told what is held outside.
"""

from __future__ import annotations

import pytest
import torch

from kvtier.runtime.tree.config import TreeConfig, build_tree
from kvtier.runtime.tree.types import TreeIntegrityError

P = 4
TOKENS = list(range(100, 116))  # 4 pages


def make_tree():
    return build_tree(TreeConfig(page_size=P, kv_size=32, host_kv_size=64))


def hashes(n_pages: int, tag: str = "h") -> list[str]:
    return [f"{tag}{i}" for i in range(n_pages)]


def test_graft_takes_missing_tokens_and_books_balance():
    tree = make_tree()
    host = tree.full.host_alloc
    slots = host.alloc(8)
    tree.check_integrity(host_owned={"kv": 8})
    with pytest.raises(
        TreeIntegrityError,
        match="kv host: allocator has 8 slots in use, tree owns 0, holders outside the tree own 0",
    ):
        tree.check_integrity()
    end, present = tree.graft_host(tree.root, TOKENS[:8], {"kv": slots}, hashes(2), "ns")
    assert present == 0 and end.end == 8 and end.value[0] is None
    assert torch.equal(end.host_value[0], slots) and end.page_hashes == ["h0", "h1"]
    tree.check_integrity()
    m = tree.match_prefix(TOKENS[:8] + [1], "ns")
    assert m.device_len == 0 and m.host_hit_length == 8 and m.best_match_node is end
    assert tree.match_prefix(TOKENS[:8] + [1], "other").host_hit_length == 0

    # The whole 4 pages again: the first 2 are present, the caller keeps their slots.
    more = host.alloc(16)
    end2, present2 = tree.graft_host(tree.root, TOKENS, {"kv": more}, hashes(4), "ns")
    assert present2 == 8 and end2.parent is end and torch.equal(end2.host_value[0], more[8:])
    assert end2.page_hashes == ["h2", "h3"]
    tree.check_integrity(host_owned={"kv": 8})
    host.free(more[:8])
    tree.check_integrity()

    # Already all present: nothing taken.
    again = host.alloc(16)
    assert tree.graft_host(tree.root, TOKENS, {"kv": again}, None, "ns") == (end2, 16)
    tree.check_integrity(host_owned={"kv": 16})
    host.free(again)
    tree.check_integrity()


def test_graft_splits_a_partly_matching_node():
    tree = make_tree()
    host = tree.full.host_alloc
    first, _ = tree.graft_host(tree.root, TOKENS[:12], {"kv": host.alloc(12)}, hashes(3), None)
    other = TOKENS[:4] + [1, 2, 3, 4]
    slots = host.alloc(8)
    end, present = tree.graft_host(tree.root, other, {"kv": slots}, hashes(2, "x"), None)
    assert present == 4 and end.key == [1, 2, 3, 4] and end.page_hashes == ["x1"]
    upper = end.parent
    assert upper.key == TOKENS[:4] and first.parent is upper and first.key == TOKENS[4:12]
    assert first.page_hashes == ["h1", "h2"] and upper.page_hashes == ["h0"]
    tree.check_integrity(host_owned={"kv": 4})
    host.free(slots[:4])
    tree.check_integrity()


def test_graft_stops_below_a_node_without_host_data():
    """Backup continuity: nothing hangs below a device-only node (#30106)."""
    tree = make_tree()
    dev = tree.full.device_alloc.alloc(8)
    tree.insert(TOKENS[:8], dev)
    slots = tree.full.host_alloc.alloc(16)
    assert tree.graft_host(tree.root, TOKENS, {"kv": slots}, None, None) == (None, 0)
    tree.check_integrity(host_owned={"kv": 16})


def test_graft_rejects_bad_arguments():
    tree = make_tree()
    slots = tree.full.host_alloc.alloc(8)
    with pytest.raises(ValueError, match="tokens: 6 tokens is not a whole number of pages"):
        tree.graft_host(tree.root, TOKENS[:6], {"kv": slots[:6]}, None, None)
    with pytest.raises(ValueError, match="the FULL pool 'kv' is required"):
        tree.graft_host(tree.root, TOKENS[:8], {}, None, None)
    with pytest.raises(ValueError, match=r"host_slots_per_pool\['kv'\]: 4 slots for 8 tokens"):
        tree.graft_host(tree.root, TOKENS[:8], {"kv": slots[:4]}, None, None)
    with pytest.raises(ValueError, match="'swa' is not a per-token host pool"):
        tree.graft_host(tree.root, TOKENS[:8], {"kv": slots, "swa": slots}, None, None)
    with pytest.raises(ValueError, match="page_hashes: 1 hashes for 2 pages"):
        tree.graft_host(tree.root, TOKENS[:8], {"kv": slots}, ["a"], None)
    tree.check_integrity(host_owned={"kv": 8})
