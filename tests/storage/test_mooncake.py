"""Mooncake specifics against a real master: start-up errors, registration, a dying master."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from kvtier.storage import Namespace, PoolTransfer, StorageBackend, create_backend, page_hashes
from tests.children import child_env

NS = Namespace("test-model", "bfloat16", 4, "page_first")


def test_unreachable_master_is_a_clear_error(mooncake_master: str) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        start = time.monotonic()
        with pytest.raises(ConnectionError, match=f"127.0.0.1:{port}"):
            create_backend("mooncake", master_address=f"127.0.0.1:{port}", connect_timeout_s=2.0)
    assert time.monotonic() - start < 5


def test_pages_must_be_registered(mooncake_backend: StorageBackend) -> None:
    stray = [torch.zeros(256, dtype=torch.uint8)]
    with pytest.raises(ValueError, match="register_host_buffer"):
        mooncake_backend.set([PoolTransfer("kv", page_hashes(range(4), NS), stray)])


def test_corrupted_object_is_a_counted_miss(mooncake_backend: StorageBackend, make_pages) -> None:
    b = mooncake_backend
    b.clear()
    h = page_hashes(range(8), NS)
    src = make_pages(2, 512)
    src[1].fill_(7)
    assert b.set([PoolTransfer("kv", h, src)]).all_ok
    key = b.scope.object_key(h[1], "kv")
    good = b._store.get(key)
    b._store.remove(key, True)
    bad = bytearray(good)
    bad[-1] ^= 0xFF
    assert b._store.put(key, bytes(bad)) == 0
    before = b.metrics.snapshot()["checksum_miss_pages"]
    out = make_pages(2, 512)
    assert b.get([PoolTransfer("kv", h, out)]).ok["kv"] == [True, False]
    assert b.metrics.snapshot()["checksum_miss_pages"] == before + 1
    assert b.exists([PoolTransfer("kv", h[1:])]) == 0, "the bad object is removed"
    b.clear()


@pytest.mark.timeout(90)
def test_master_killed_mid_operation(fresh_master) -> None:
    """Calls in flight and after the kill report per-page failures in bounded time, never raise."""
    master = fresh_master
    backend = create_backend(
        "mooncake", master_address=master.address, global_segment_size=32 << 20
    )
    try:
        n = 64
        pool = torch.zeros(n * 65536, dtype=torch.uint8)
        backend.register_host_buffer(pool)
        pages = list(pool.view(n, 65536).unbind(0))
        h = page_hashes(range(4 * n), NS)
        assert backend.set([PoolTransfer("kv", h, pages)]).all_ok
        first_round = threading.Event()
        results: list[dict[str, list[bool]]] = []
        errors: list[BaseException] = []

        def prefetcher() -> None:
            try:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    res = backend.get([PoolTransfer("kv", h, pages)])
                    results.append(res.ok)
                    first_round.set()
                    if not res.all_ok:
                        return
            except BaseException as e:  # noqa: BLE001 - the test reports anything that escapes
                errors.append(e)

        t = threading.Thread(target=prefetcher)
        t.start()
        assert first_round.wait(20)
        master.process.kill()
        t.join(timeout=40)
        assert not t.is_alive(), "a get hung after the master died"
        assert not errors, errors
        assert all(len(r["kv"]) == n for r in results)
        assert not all(results[-1]["kv"]), "gets after the kill must report failed pages"

        start = time.monotonic()
        assert backend.exists([PoolTransfer("kv", h)]) == 0
        assert backend.get([PoolTransfer("kv", h[:4], pages[:4])]).ok["kv"] == [False] * 4
        assert backend.set([PoolTransfer("swa", h[:4], pages[:4])]).ok["swa"] == [False] * 4
        assert time.monotonic() - start < 20
        assert backend.metrics.snapshot()["failed_pages.write"] == 4
    finally:
        start = time.monotonic()
        backend.close()
        assert time.monotonic() - start < 3, "close must not wait on a dead master"


def test_objects_outlive_the_writer_process(
    segment_holder: str, mooncake_backend, make_pages
) -> None:
    """A writer lending no memory (segment 0) stores into the standalone client's segment, so a
    reader finds the pages after the writer has exited."""
    code = (
        "import sys, torch\n"
        "from kvtier.storage import Namespace, PoolTransfer, create_backend, page_hashes\n"
        "b = create_backend('mooncake', master_address=sys.argv[1], global_segment_size=0)\n"
        "pool = (torch.arange(4 * 1024) % 251).to(torch.uint8)\n"
        "b.register_host_buffer(pool)\n"
        "h = page_hashes(range(16), Namespace('test-model', 'bfloat16', 4, 'page_first'))\n"
        "assert b.set([PoolTransfer('kv', h, list(pool.view(4, 1024).unbind(0)))]).all_ok\n"
        "b.close()\n"
    )
    subprocess.run(
        [sys.executable, "-c", code, segment_holder],
        check=True,
        timeout=60,
        capture_output=True,
        env=child_env(),
    )
    out = make_pages(4, 1024)
    h = page_hashes(range(16), NS)
    assert mooncake_backend.get([PoolTransfer("kv", h, out)]).all_ok
    assert torch.equal(torch.cat(out), (torch.arange(4 * 1024) % 251).to(torch.uint8))
    mooncake_backend.clear()
