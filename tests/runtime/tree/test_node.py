"""Node helpers: ``match_len`` against a page-by-page reference, and the child-key rules."""

from __future__ import annotations

import random
import sys

import pytest

from kvtier.runtime.tree.node import NO_CHILDREN, TreeNode, link_key, match_len, page_key


def ref_match_len(key: list[int], tokens: list[int], pos: int, P: int, end: int | None) -> int:
    n = min(len(key), (len(tokens) if end is None else end) - pos)
    i = 0
    while i + P <= n and key[i : i + P] == tokens[pos + i : pos + i + P]:
        i += P
    return i


@pytest.mark.parametrize("P", [1, 4, 16])
def test_match_len_equals_page_by_page(P: int) -> None:
    rng = random.Random(P)
    for _ in range(500):
        key = [rng.randrange(3) for _ in range(rng.randrange(1, 12) * P)]
        pos = rng.randrange(3) * P
        # Mostly equal to the key, a token here and there changed, a tail of any length.
        body = [k if rng.random() < 0.95 else rng.randrange(3) for k in key]
        tail = [rng.randrange(3) for _ in range(rng.randrange(3 * P))]
        tokens = [rng.randrange(3) for _ in range(pos)] + body + tail
        end = rng.choice([None, len(tokens) - len(tokens) % P, pos + len(key) // 2])
        ref = ref_match_len(key, tokens, pos, P, end)
        assert match_len(key, tokens, pos, P, end) == ref, (key, tokens, pos, end)


def test_link_key_takes_the_hash_unless_a_sibling_holds_it() -> None:
    M = sys.hash_info.modulus
    a, b = (5, 1), (5 + M, 1)  # different pages, one hash
    assert hash(a) == hash(b) and a != b
    assert link_key(NO_CHILDREN, a) == hash(a)
    holder = TreeNode([5, 1], None, 1)
    assert link_key({hash(a): holder}, b) == b
    assert link_key({}, 7) == 7  # an int page key (P = 1 below the root) is its own key
    assert page_key([3, 4, 5, 6], 2, 2, "ns", at_root=True) == ("ns", (5, 6))
    assert page_key([3, 4, 5, 6], 1, 1, "ns", at_root=False) == 4


def test_a_leaf_shares_its_empty_children_and_pins() -> None:
    leaf = TreeNode([1, 2], None, 2)
    other = TreeNode([3, 4], None, 2)
    assert leaf.children is other.children is NO_CHILDREN
    assert leaf.pins is other.pins and leaf.pins == (0, 0)
    with pytest.raises(TypeError):
        leaf.children[1] = other  # read-only: a write must go through own_children()
    leaf.own_children()[1] = other
    leaf.own_pins()[1] += 1
    assert dict(leaf.children) == {1: other} and other.children is NO_CHILDREN
    assert leaf.pins == [0, 1] and other.pins == (0, 0)
    assert leaf.drop_pin(1) == 0 and leaf.pins is other.pins  # the list goes back
    assert leaf.drop_pin(0) == -1 and leaf.pins is other.pins  # one too many: nothing changes
