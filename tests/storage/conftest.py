"""Storage test fixtures: a real ``mooncake_master`` on 127.0.0.1, backends, and host page views.

The Mooncake client listens on every interface, so Mooncake tests only run where the network
namespace holds nothing but loopback (``scripts/test.sh`` runs the suite under ``unshare -n``).
Where Mooncake is missing or the network is not isolated, its tests skip, or fail with the reason
when ``CI=true``.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import pytest
import torch

from kvtier.metrics import TierMetrics
from kvtier.storage import PoolTransfer, StorageBackend, create_backend
from kvtier.storage.segments import native

MASTER_START_TIMEOUT_S = 20.0
ARENA_BYTES = 48 << 20  # host memory all test pages are carved from; registered once


def _unavailable(reason: str) -> None:
    if os.environ.get("CI") == "true":
        pytest.fail(f"Mooncake tests cannot run in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Master(NamedTuple):
    address: str  # host:port of the RPC service
    process: subprocess.Popen


def start_master(log_dir: Path) -> Master:
    """Start ``mooncake_master`` with every listener on 127.0.0.1; wait (bounded) until it accepts."""
    binary = shutil.which("mooncake_master")
    if binary is None:
        _unavailable(
            "mooncake_master is not on PATH (pip install mooncake-transfer-engine-non-cuda)"
        )
    ifaces = sorted(name for _, name in socket.if_nameindex())
    if ifaces != ["lo"]:
        _unavailable(
            f"network interfaces {ifaces} besides lo: the Mooncake client listens on all of them; "
            "run under `unshare -n` with only lo up (scripts/test.sh)"
        )
    rpc_port = _free_port()
    log_path = log_dir / f"mooncake_master_{rpc_port}.log"
    cmd = [
        binary,
        "--rpc_address=127.0.0.1",
        f"--rpc_port={rpc_port}",
        "--enable_http_metadata_server=false",
        "--http_metadata_server_host=127.0.0.1",
        f"--http_metadata_server_port={_free_port()}",
        "--metrics_host=127.0.0.1",
        f"--metrics_port={_free_port()}",
        "--enable_metric_reporting=false",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + MASTER_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(
                f"mooncake_master exited with {proc.returncode}: {log_path.read_text()[-2000:]}"
            )
        try:
            socket.create_connection(("127.0.0.1", rpc_port), timeout=0.2).close()
            return Master(f"127.0.0.1:{rpc_port}", proc)
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(
                    f"mooncake_master did not listen on 127.0.0.1:{rpc_port} within "
                    f"{MASTER_START_TIMEOUT_S} s: {log_path.read_text()[-2000:]}"
                )
            time.sleep(0.02)


def stop_master(master: Master) -> None:
    master.process.kill()
    master.process.wait(timeout=10)


@pytest.fixture(scope="session")
def mooncake_master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Address (``127.0.0.1:port``) of a real ``mooncake_master`` shared by the session."""
    try:
        import mooncake.store  # noqa: F401
    except ImportError as e:
        _unavailable(
            f"cannot import mooncake.store ({e}); pip install mooncake-transfer-engine-non-cuda"
        )
    master = start_master(tmp_path_factory.mktemp("mooncake"))
    yield master.address
    stop_master(master)


@pytest.fixture(scope="session")
def segment_holder(mooncake_master: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A standalone ``mooncake_client`` lending 64 MiB to the session master, so objects outlive
    the processes that wrote them; yields the master's address."""
    binary = shutil.which("mooncake_client")
    if binary is None:
        _unavailable("mooncake_client is not on PATH")
    port = _free_port()
    log_path = tmp_path_factory.mktemp("holder") / "mooncake_client.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [
                binary,
                f"--master_server_address={mooncake_master}",
                "--host=127.0.0.1",
                f"--port={port}",
                "--metadata_server=P2PHANDSHAKE",
                "--protocol=tcp",
                "--global_segment_size=64MB",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    deadline = time.monotonic() + MASTER_START_TIMEOUT_S
    while "Starting real client service" not in log_path.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"mooncake_client did not start: {log_path.read_text()[-2000:]}")
        time.sleep(0.05)
    yield mooncake_master
    proc.kill()
    proc.wait(timeout=10)


@pytest.fixture
def fresh_master(mooncake_master: str, tmp_path: Path) -> Iterator[Master]:
    """A master of this test's own, for tests that kill it; stopped at the end if still alive."""
    master = start_master(tmp_path)
    yield master
    if master.process.poll() is None:
        stop_master(master)


@pytest.fixture(scope="session")
def host_arena() -> torch.Tensor:
    """One host buffer every test's page views come from (Mooncake registers it once)."""
    return torch.zeros(ARENA_BYTES, dtype=torch.uint8)


@pytest.fixture(scope="session")
def mooncake_backend(mooncake_master: str, host_arena: torch.Tensor) -> Iterator[StorageBackend]:
    backend = create_backend(
        "mooncake", master_address=mooncake_master, global_segment_size=64 << 20
    )
    backend.register_host_buffer(host_arena)
    yield backend
    backend.close()


PageFactory = Callable[[int, int], list[torch.Tensor]]


@pytest.fixture
def make_pages(host_arena: torch.Tensor) -> PageFactory:
    """``make_pages(n, page_bytes)``: ``n`` fresh page views of the arena, filled with 0xEE."""
    offset = 0

    def make(n: int, page_bytes: int) -> list[torch.Tensor]:
        nonlocal offset
        if offset + n * page_bytes > host_arena.numel():
            raise RuntimeError("test host arena exhausted")
        block = host_arena[offset : offset + n * page_bytes]
        offset += n * page_bytes
        block.fill_(0xEE)
        return list(block.view(n, page_bytes).unbind(0))

    return make


@pytest.fixture(params=["file", "mooncake"])
def backend(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[StorageBackend]:
    """Each backend, empty, with fresh metrics."""
    if request.param == "file":
        yield create_backend("file", root=tmp_path / "l3")
        return
    shared = request.getfixturevalue("mooncake_backend")
    shared.clear()
    shared.metrics = TierMetrics()
    yield shared
    shared.clear()


@pytest.fixture(params=["native", "python"])
def loops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The segment store's batch loops: in C (``segments.native``; skipped where it cannot be
    built, failed in CI) or in Python. A module runs every test both ways with
    ``pytestmark = pytest.mark.usefixtures("loops")``."""
    if request.param == "python":
        monkeypatch.setattr(native, "library", lambda: None)
    else:
        native_library()
    return request.param


def native_library():
    """The C loops' library; the test skips where it cannot be built, and fails in CI."""
    lib = native.library()
    if lib is None:
        if os.environ.get("CI") == "true":
            pytest.fail("the segment store's native loops did not build in CI", pytrace=False)
        pytest.skip("the segment store's native loops are not built here")
    return lib


@pytest.fixture
def python_loops(monkeypatch: pytest.MonkeyPatch) -> None:
    """The segment store's batch loops in Python (a test that hooks one of their calls)."""
    monkeypatch.setattr(native, "library", lambda: None)


def assert_only_the_later_batch_served(b: StorageBackend, root, keys: list[str], pages) -> None:
    """A batch of ``keys[:n]`` failed and one of ``keys[n:2n]`` was stored, both of ``pages``
    (n of 64 KiB): ``b`` and a fresh store on ``root`` serve the later batch's pages exactly and
    none of the failed one's. Closes both."""
    n = len(pages)
    fresh = create_backend("file", root=root)
    for store in (b, fresh):
        out = [torch.full((64 << 10,), 0xEE, dtype=torch.uint8) for _ in range(2 * n)]
        assert (
            store.get([PoolTransfer("kv", keys[: 2 * n], out)]).ok["kv"] == [False] * n + [True] * n
        )
        assert all(torch.equal(o, p) for o, p in zip(out[n:], pages))
    b.close()
    fresh.close()
