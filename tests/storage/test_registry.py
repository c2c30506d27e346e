"""The backend registry and the package's public names."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvtier import storage
from kvtier.storage import StorageBackend, available_backends, create_backend, register_backend
from tests.children import child_env


def test_public_api_is_pinned() -> None:
    assert sorted(storage.__all__) == sorted(
        [
            "ALL_PAGES",
            "BatchResult",
            "Direction",
            "HitPolicy",
            "KeyScope",
            "Namespace",
            "PageSpans",
            "PoolTransfer",
            "PrefetchOutcome",
            "StorageBackend",
            "StorageMetrics",
            "TRAILING_PAGES",
            "Tier",
            "available_backends",
            "create_backend",
            "page_hashes",
            "register_backend",
            "usable_prefix",
        ]
    )


def test_builtin_backends_are_lazy(tmp_path: Path) -> None:
    assert {"file", "mooncake"} <= set(available_backends())
    code = (
        "import sys, kvtier.storage as s\n"
        f"s.create_backend('file', root={str(tmp_path)!r})\n"
        "print(sorted(m for m in sys.modules if 'mooncake' in m))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=child_env(),
    )
    assert out.stdout.strip() == "[]", "choosing the file backend must not import Mooncake"


def test_unknown_backend_names_the_choices() -> None:
    with pytest.raises(ValueError, match="choose one of .*file"):
        create_backend("nope")


def test_register_a_custom_backend(tmp_path: Path) -> None:
    from dataclasses import dataclass

    @dataclass(frozen=True)
    class Cfg:
        boom: bool = False

    class Failing(StorageBackend):
        name = "failing"
        Config = Cfg

        def __init__(self, config: Cfg, **kw) -> None:
            super().__init__(**kw)

        def _contains(self, object_keys: list[str]) -> list[bool]:
            raise OSError("store down")

        def _read(self, object_keys, pages):
            raise OSError("store down")

        def _write(self, object_keys, pages):
            raise OSError("store down")

        def clear(self) -> None:
            pass

    register_backend("failing-test", Failing)
    with pytest.raises(ValueError, match="already registered"):
        register_backend("failing-test", Failing)
    b = create_backend("failing-test")
    page = [torch.zeros(8, dtype=torch.uint8)]
    t = storage.PoolTransfer("kv", ["0" * 64], page)
    assert b.exists([t]) == 0, "a store error is absence, not an exception"
    assert b.get([t]).ok == {"kv": [False]}
    assert b.set([t]).ok == {"kv": [False]}
    assert b.metrics.snapshot()["failed_pages.write"] == 1
