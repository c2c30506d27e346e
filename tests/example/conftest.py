"""Example-model test fixtures: the storage tests' real ``mooncake_master`` (one definition, in
``tests/storage``), for the V4 example's producer → consumer run over Mooncake."""

from __future__ import annotations

from tests.storage.conftest import fresh_master, mooncake_master, segment_holder

__all__ = ["fresh_master", "mooncake_master", "segment_holder"]
