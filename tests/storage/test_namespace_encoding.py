"""Request namespaces in L3 keys: canonical bytes, the same in every process, apart when unequal.

The invariant under test: two namespaces get the same encoding exactly when they compare equal,
because the radix tree keeps namespaces apart by equality; and the encoding never depends on
``PYTHONHASHSEED``.
"""

from __future__ import annotations

import enum
import subprocess
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch

from kvtier.runtime.config import CacheConfig, StorageConfig
from kvtier.runtime.l3.pools import namespace_for
from kvtier.storage import page_hashes
from kvtier.storage.keys import canonical_namespace
from tests.children import child_env

REPO = Path(__file__).resolve().parents[2]
TOKENS = list(range(8))  # two pages of 4

# Sixteen strings: enough that a frozenset's iteration order differs between hash seeds.
WORDS = tuple(f"tenant-{i}" for i in range(16))


def case_id(value: object) -> str:
    """``repr`` with sets' members sorted: a set prints in the hash seed's order, and test ids
    must be the same in every process (pytest-xdist's workers collect separately)."""
    if isinstance(value, (set, frozenset)):
        inner = ", ".join(sorted(case_id(v) for v in value))
        return f"{type(value).__name__}({{{inner}}})"
    if isinstance(value, tuple):
        return "(" + ", ".join(case_id(v) for v in value) + ("," if len(value) == 1 else "") + ")"
    return repr(value)


SEEDED_NAMESPACES = {
    "frozenset": frozenset(WORDS),
    "set": set(WORDS),
    "tuple": ("lora", frozenset(WORDS), b"salt", 7, None, True),
    "nested_sets": frozenset({("a", 1), ("b", None), b"x", 3, frozenset(WORDS[:5])}),
}


def make_config(salt: str = "") -> CacheConfig:
    return CacheConfig(
        layer_kinds=("full", "full"),
        kv_heads=1,
        head_dim=4,
        page_size=4,
        device_tokens=16,
        dtype=torch.float32,
        host_ratio=2.0,
        model_id="test-model",
        storage=StorageConfig(namespace_key=salt),
    )


def page_keys(namespace: object, salt: str = "") -> list[str]:
    return page_hashes(TOKENS, namespace_for(make_config(salt), namespace, 1))


def seeded_report() -> str:
    """What the subprocesses print: each namespace's page keys, then a frozenset's hash order."""
    lines = [f"{name} {' '.join(page_keys(ns))}" for name, ns in SEEDED_NAMESPACES.items()]
    lines.append("order " + " ".join(frozenset(WORDS)))
    return "\n".join(lines)


def run_with_seed(seed: str) -> dict[str, str]:
    code = "from tests.storage.test_namespace_encoding import seeded_report; print(seeded_report())"
    env = child_env(PYTHONHASHSEED=seed)
    out = subprocess.run(
        [sys.executable, "-c", code],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    return dict(line.split(" ", 1) for line in out.stdout.splitlines())


def test_page_keys_agree_across_hash_seeds() -> None:
    seed0, seed1 = run_with_seed("0"), run_with_seed("1")
    # Otherwise the seeds would not exercise hash order at all and the test could not fail.
    assert seed0["order"] != seed1["order"], "frozenset iteration order should differ by seed"
    for name, ns in SEEDED_NAMESPACES.items():
        here = " ".join(page_keys(ns))
        assert seed0[name] == seed1[name] == here, name


def le8(n: int) -> bytes:
    return n.to_bytes(8, "little")


def enc(tag: bytes, payload: bytes) -> bytes:
    return tag + le8(len(payload)) + payload


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, enc(b"N", b"")),
        (0, enc(b"i", b"\x00")),
        (True, enc(b"i", b"\x01")),
        (-1, enc(b"i", b"\xff")),
        (127, enc(b"i", b"\x7f")),
        (128, enc(b"i", b"\x00\x80")),
        (256, enc(b"i", b"\x01\x00")),
        (-(2**70), enc(b"i", (-(2**70)).to_bytes(9, "big", signed=True))),
        ("", enc(b"s", b"")),
        ("é", enc(b"s", "é".encode())),
        ("\ud800", enc(b"s", b"\xed\xa0\x80")),
        (b"ab", enc(b"b", b"ab")),
        ((), enc(b"t", b"")),
        (("a", None), enc(b"t", enc(b"s", b"a") + enc(b"N", b""))),
        (frozenset({2, 1}), enc(b"f", enc(b"i", b"\x01") + enc(b"i", b"\x02"))),
        ({"a", 1}, enc(b"f", enc(b"i", b"\x01") + enc(b"s", b"a"))),
    ],
    ids=case_id,
)
def test_encoding_follows_its_table(value: object, expected: bytes) -> None:
    assert canonical_namespace(value) == expected


# Values chosen to look alike: same repr-ish text, same bytes in another type, same flattening.
INTS = [None, 0, 1, -1, 2, 255, -256, 256, 2**64, -(2**64), True, False]
STRS = ["", "1", "01", "a", "b", "ab", "abc", "None", "True", "()", "(1,)", "('a', 'b')"]
ODD_STRS = ["frozenset({1})", "\ud800", "\U0001f600", "\ud83d\ude00"]
BYTES = [b"", b"1", b"a", b"ab", b"\x01", b"\xff"]
TUPLES = [(), (1,), (True,), ("1",), (b"1",), (None,), ("a", "b"), ("ab",), ("a", "bc")]
NESTED = [("ab", "c"), ("a",), (("a",),), ((),), ((), ()), ((), ((),)), (((),),)]
SETS = [frozenset(), frozenset({1}), frozenset({True}), {1}, {"a", "b"}, frozenset({"b", "a"})]
NESTED_SETS = [frozenset({frozenset()}), frozenset({()}), frozenset({("a",)}), {"a", ("a",)}]
MIXED = [frozenset({1, 2}), frozenset({(1, 2)}), frozenset({None}), ("a", {1, "1", b"1"})]
POOL = INTS + STRS + ODD_STRS + BYTES + TUPLES + NESTED + SETS + NESTED_SETS + MIXED


def test_equal_exactly_when_namespaces_are_equal() -> None:
    codes = [canonical_namespace(v) for v in POOL]
    for i, a in enumerate(POOL):
        for j, b in enumerate(POOL):
            assert (a == b) == (codes[i] == codes[j]), f"{a!r} vs {b!r}"


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (1, "1"),
        (1, b"1"),
        ("1", b"1"),
        (True, "1"),
        (True, b"1"),
        (True, "True"),
        (("a", "b"), "('a', 'b')"),
        ((("a",),), ("a",)),
        (frozenset({1}), (1,)),
        (frozenset({1}), "frozenset({1})"),
        (None, "None"),
        (None, ""),
        (None, ()),
        ("", b""),
        ((), frozenset()),
        (("ab",), ("a", "b")),
        (("a", "bc"), ("ab", "c")),
        (-1, 255),
    ],
    ids=case_id,
)
def test_look_alikes_share_no_page(a: object, b: object) -> None:
    assert a != b
    assert not set(page_keys(a)) & set(page_keys(b))


@pytest.mark.parametrize(
    ("a", "b"),
    [
        (True, 1),
        (False, 0),
        ((True, "a"), (1, "a")),
        (frozenset({1}), {1}),
        (frozenset({True}), frozenset({1})),
        (frozenset(WORDS), frozenset(reversed(WORDS))),
    ],
    ids=case_id,
)
def test_equal_namespaces_share_pages(a: object, b: object) -> None:
    # The tree joins these (dict lookup by ==), so L3 must not split them.
    assert a == b
    assert page_keys(a) == page_keys(b)


@pytest.mark.parametrize(
    ("salt_a", "ns_a", "salt_b", "ns_b"),
    [
        ("a", "b", "ab", None),
        ("", "x", "x", None),
        ("x", "", "", "x"),
        ("a", "bc", "ab", "c"),
        ("t", None, "", "t"),
        ("", None, "", ""),
    ],
)
def test_salt_and_namespace_join_injectively(salt_a, ns_a, salt_b, ns_b) -> None:
    assert not set(page_keys(ns_a, salt_a)) & set(page_keys(ns_b, salt_b))


class Tenant:
    """Distinct objects that print alike: repr once let them share pages."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return "Tenant('a')"


class Colour(enum.IntEnum):
    RED = 1


class Label(str):
    pass


Pair = namedtuple("Pair", "a b")


@pytest.mark.parametrize(
    ("value", "where", "type_name"),
    [
        (1.5, "namespace", "float"),
        (float("nan"), "namespace", "float"),
        (1 + 2j, "namespace", "complex"),
        ([1], "namespace", "list"),
        ({"a": 1}, "namespace", "dict"),
        (bytearray(b"a"), "namespace", "bytearray"),
        (object(), "namespace", "object"),
        (Tenant("a"), "namespace", "Tenant"),
        (Colour.RED, "namespace", "Colour"),
        (Label("a"), "namespace", "Label"),
        (Pair(1, 2), "namespace", "Pair"),
        (("a", 1.5), r"namespace\[1\]", "float"),
        ((("a", [1]),), r"namespace\[0\]\[1\]", "list"),
        (frozenset({1.5}), "a member of namespace", "float"),
        (("x", frozenset({(1, 2.0)})), r"a member of namespace\[1\]\[1\]", "float"),
    ],
    ids=lambda v: type(v).__name__ if not isinstance(v, str) else v,
)
def test_unsupported_types_are_refused(value: object, where: str, type_name: str) -> None:
    with pytest.raises(TypeError, match=rf"^namespace: {where} is a {type_name},"):
        canonical_namespace(value)
    with pytest.raises(TypeError, match=rf"{where} is a {type_name},"):
        namespace_for(make_config(), value, 1)


def test_equal_reprs_are_refused_not_joined() -> None:
    a, b = Tenant("a"), Tenant("b")
    assert a != b and repr(a) == repr(b)
    for ns in (a, b, ("lora", a)):
        with pytest.raises(TypeError, match="namespace.*Tenant"):
            canonical_namespace(ns)


def nest(depth: int, make) -> object:
    value: object = "x"
    for _ in range(depth):
        value = make(value)
    return value


@pytest.mark.parametrize("make", [lambda v: (v,), lambda v: frozenset({v})], ids=["tuple", "set"])
def test_nesting_depth(make) -> None:
    deepest = canonical_namespace(nest(32, make))
    assert deepest != canonical_namespace(nest(31, make))
    assert len(deepest) == 32 * 9 + len(canonical_namespace("x")), "9 header bytes per level"
    for depth in (33, 10_000):
        with pytest.raises(ValueError, match="namespace.* deeper than 32"):
            canonical_namespace(nest(depth, make))


def test_large_set() -> None:
    members = list(range(-5000, 5000)) + [f"m{i}" for i in range(5000)] + [b"b", (1, "t")]
    big = frozenset(members)
    code = canonical_namespace(big)
    # Another insertion order, so equal-hash buckets may iterate differently.
    assert code == canonical_namespace(set(members[1::2] + members[::2]))
    parts = [canonical_namespace(m) for m in members]
    assert code == enc(b"f", b"".join(sorted(parts)))
    assert code != canonical_namespace(big - {0})
    assert code != canonical_namespace(tuple(members))
