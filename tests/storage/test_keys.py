"""Page keys: the chain, stability across processes, namespace isolation, per-rank names."""

from __future__ import annotations

import dataclasses
import hashlib
import subprocess
import sys

import numpy as np
import pytest
import torch

from kvtier.storage import KeyScope, Namespace, page_hashes
from tests.children import child_env

NS = Namespace("meta-llama/Llama-3-8B", "bfloat16", 16, "page_first", tp_size=2)
LLAMA = Namespace("meta-llama/Llama-3-8B", "bfloat16", 16, "page_first")
# Pinned so that any change to the byte encoding shows up here (it must bump KEY_FORMAT_VERSION).
LLAMA_DIGEST = "0f31e1e12241fac88da1f59b0109f41e7c47906abb4ca3f9950871f5703fe087"


def test_digest_is_pinned() -> None:
    assert LLAMA.digest().hex() == LLAMA_DIGEST


def test_chain_matches_its_definition() -> None:
    tokens = list(range(1000, 1040))  # 2 full pages of 16 and a partial page of 8
    got = page_hashes(tokens, NS)
    assert len(got) == 2, "the partial page must not be hashed"
    ref = NS.digest()
    for i, h in enumerate(got):
        ref = hashlib.sha256(
            ref + np.array(tokens[16 * i : 16 * (i + 1)], "<i8").tobytes()
        ).digest()
        assert h == ref.hex(), f"page {i}"


def test_chain_folds_in_the_prefix() -> None:
    a = page_hashes([1] * 16 + [2] * 16, NS)
    b = page_hashes([3] * 16 + [2] * 16, NS)
    assert a[0] != b[0] and a[1] != b[1], "the same page under another prefix needs another key"


def test_chain_continues_from_prev_hash() -> None:
    tokens = torch.arange(64)
    whole = page_hashes(tokens, NS)
    assert page_hashes(tokens[32:], NS, prev_hash=whole[1]) == whole[2:]
    assert page_hashes(tokens.numpy(), NS) == whole == page_hashes(tokens.tolist(), NS)


def test_large_token_ids_are_not_truncated() -> None:
    assert page_hashes([2**32 + 5] * 16, NS) != page_hashes([5] * 16, NS)


def test_stable_across_processes() -> None:
    code = (
        "from kvtier.storage import Namespace, page_hashes\n"
        "ns = Namespace('meta-llama/Llama-3-8B', 'bfloat16', 16, 'page_first', tp_size=2)\n"
        "print(' '.join(page_hashes(range(64), ns)))\n"
    )
    env = child_env(PYTHONHASHSEED="12345")
    out = subprocess.run(
        [sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    assert out.stdout.split() == page_hashes(range(64), NS)


@pytest.mark.parametrize(
    "change",
    [
        {"model_id": "meta-llama/Llama-3-8B-Instruct"},
        {"namespace_key": "tenant-a"},
        {"dtype": "float8_e4m3fn"},
        {"page_size": 32},
        {"layout": "layer_first"},
        {"tp_size": 4},
        {"tp_size": None},
    ],
    ids=lambda c: next(iter(c)) + "=" + str(next(iter(c.values()))),
)
def test_namespace_isolation(change: dict) -> None:
    other = dataclasses.replace(NS, **change)
    tokens = list(range(64))
    if other.page_size == NS.page_size:
        assert not set(page_hashes(tokens, other)) & set(page_hashes(tokens, NS))
    assert other.digest() != NS.digest()


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ({"model_id": "ab", "namespace_key": "c"}, {"model_id": "a", "namespace_key": "bc"}),
        ({"model_id": "a", "namespace_key": ""}, {"model_id": "a\x00", "namespace_key": ""}),
        ({"dtype": "bf16", "layout": "x"}, {"dtype": "bf", "layout": "16x"}),
        ({"namespace_key": "1"}, {"namespace_key": "01"}),
    ],
)
def test_encoding_cannot_alias(a: dict, b: dict) -> None:
    assert dataclasses.replace(NS, **a).digest() != dataclasses.replace(NS, **b).digest()


def test_namespace_validates() -> None:
    with pytest.raises(ValueError, match="page_size"):
        Namespace("m", "bfloat16", 0, "page_first")
    with pytest.raises(ValueError, match="tp_size"):
        Namespace("m", "bfloat16", 16, "page_first", tp_size=0)
    with pytest.raises(ValueError, match="model_id"):
        Namespace("", "bfloat16", 16, "page_first")


def test_sharded_keys_are_per_rank() -> None:
    h = page_hashes(range(16), NS)[0]
    r0, r1 = KeyScope.for_namespace(NS, 0, 2), KeyScope.for_namespace(NS, 1, 2)
    assert r0.object_key(h, "kv") == f"{h}.kv.r0"
    assert r1.object_key(h, "kv") == f"{h}.kv.r1"
    assert r0.writes and r1.writes
    with pytest.raises(ValueError, match="sharded over 2"):
        KeyScope.for_namespace(NS, 0, 4)


def test_replicated_keys_are_rank_free_and_rank0_writes() -> None:
    mla = dataclasses.replace(NS, tp_size=None)
    h = page_hashes(range(16), mla)[0]
    scopes = [KeyScope.for_namespace(mla, r, 4) for r in range(4)]
    assert {s.object_key(h, "kv") for s in scopes} == {f"{h}.kv"}
    assert [s.writes for s in scopes] == [True, False, False, False]


def test_pool_suffixes_differ_and_are_validated() -> None:
    scope = KeyScope()
    h = page_hashes(range(16), NS)[0]
    keys = {scope.object_key(h, p) for p in ("kv", "swa", "mamba", "indexer")}
    assert len(keys) == 4
    for bad in ("KV", "kv.r0", "", "a/b"):
        with pytest.raises(ValueError, match="pool name"):
            scope.object_key(h, bad)
    with pytest.raises(ValueError, match="tp_rank"):
        KeyScope(tp_rank=2, tp_size=2)
