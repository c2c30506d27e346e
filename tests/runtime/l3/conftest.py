"""L3 test fixtures: the storage tests' real ``mooncake_master`` and where a test's L3 lives.

The Mooncake fixtures are the storage tests' own (one definition, in ``tests/storage``); naming
them here makes them visible to the tests of this folder without any test module importing them.
"""

from __future__ import annotations

import pytest

from tests.storage.conftest import fresh_master, mooncake_master, segment_holder

__all__ = ["fresh_master", "l3_location", "mooncake_master", "segment_holder"]


@pytest.fixture(params=["file", "mooncake"])
def l3_location(request: pytest.FixtureRequest, tmp_path) -> tuple[str, str]:
    """``(kind, where)``: a file L3's root directory, or a Mooncake master that outlives writers."""
    if request.param == "file":
        return "file", str(tmp_path / "l3")
    return "mooncake", request.getfixturevalue("segment_holder")
