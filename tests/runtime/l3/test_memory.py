"""What the L3 tier keeps per request namespace is bounded: a server that salts every session's
keys (a namespace per session) grew one key namespace per session for good (~0.5 KB each;
a soak trial)."""

from __future__ import annotations

from kvtier.runtime.l3 import tier as tier_mod
from kvtier.storage import create_backend
from tests.runtime.l3.helpers import make_l3_cache


def test_key_namespaces_kept_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(tier_mod, "_NAMESPACE_MEMORY", 8)
    cache = make_l3_cache("full", create_backend("file", root=tmp_path))
    tier = cache.l3
    first = tier.namespace(("session", 0))
    for i in range(1, 40):
        assert tier.namespace(("session", i)) == tier_mod.namespace_for(
            tier.cfg, ("session", i), tier.tp_size
        )
        tier.namespace(("session", 0))  # in use: kept
    assert len(tier._namespaces) == 8
    assert tier.namespace(("session", 0)) is first
    cache.close()
