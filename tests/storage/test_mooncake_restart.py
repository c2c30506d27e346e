"""L3 on Mooncake survives a master restart: a real master is killed and started again on the
same address.

While it is down, calls fail in bounded time and are counted; once the circuit breaker is open
they fail at once. A write in flight rides out a short outage within its retry budget. After
the restart the client reconnects by itself and writes and reads work again; the restarted
master has lost its objects, so only pages written after it are read back.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvtier.storage import Namespace, PoolTransfer, StorageBackend, create_backend, page_hashes
from kvtier.storage.breaker import BreakerState
from tests.storage.conftest import MASTER_START_TIMEOUT_S, Master, stop_master

NS = Namespace("restart-model", "bfloat16", 4, "page_first")
PAGES, PAGE_BYTES = 8, 4096
DOWN_CALL_S = 15.0  # a call before the breaker opens waits out the client's ~4 s RPC timeout
OPEN_CALL_S = 3.0  # a call while it is open touches nothing but, at most, the closed port
RECOVER_S = 60.0
POLL_S = 0.05  # between polls for recovery: only keeps the loop from spinning


def restart_master(master: Master, log_dir: Path) -> Master:
    """Start ``mooncake_master`` again on ``master``'s RPC address; wait (bounded) until it
    accepts."""
    host, _, port = master.address.rpartition(":")

    def free_port() -> int:
        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]

    log_path = log_dir / f"mooncake_master_{port}_restarted.log"
    cmd = [
        shutil.which("mooncake_master") or "mooncake_master",
        f"--rpc_address={host}",
        f"--rpc_port={port}",
        "--enable_http_metadata_server=false",
        f"--http_metadata_server_host={host}",
        f"--http_metadata_server_port={free_port()}",
        f"--metrics_host={host}",
        f"--metrics_port={free_port()}",
        "--enable_metric_reporting=false",
    ]
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + MASTER_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"restarted master exited with {proc.returncode}: {log_path.read_text()}")
        try:
            socket.create_connection((host, int(port)), timeout=0.2).close()
            return Master(master.address, proc)
        except OSError:
            if time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"restarted master did not listen on {master.address}")
            time.sleep(0.02)


@pytest.fixture
def restartable(fresh_master: Master, tmp_path: Path) -> Iterator[dict[str, Master]]:
    """``{"first": master}``; the test stores ``"second"`` when it restarts it. Both are
    stopped at the end if still alive."""
    masters = {"first": fresh_master}
    yield masters
    second = masters.get("second")
    if second is not None and second.process.poll() is None:
        stop_master(second)


def make_backend(master: Master, budget_s: float) -> tuple[StorageBackend, torch.Tensor]:
    backend = create_backend(
        "mooncake",
        master_address=master.address,
        global_segment_size=16 << 20,
        breaker_failures=2,
        breaker_cooldown_s=0.2,
        breaker_max_cooldown_s=1.0,
        write_retry_budget_s=budget_s,
    )
    pool = torch.zeros(4 * PAGES * PAGE_BYTES, dtype=torch.uint8)
    backend.register_host_buffer(pool)
    return backend, pool


def pages_of(pool: torch.Tensor, block: int) -> list[torch.Tensor]:
    return list(pool[block * PAGES * PAGE_BYTES :][: PAGES * PAGE_BYTES].view(PAGES, -1).unbind(0))


def fill(pages: list[torch.Tensor], seed: int) -> None:
    for i, p in enumerate(pages):
        p.copy_((torch.arange(PAGE_BYTES) * (seed + 2) + i) % 251)


def timed(fn, *args):
    """``fn(*args)`` and the seconds it took, by the monotonic clock."""
    start = time.monotonic()
    out = fn(*args)
    return out, time.monotonic() - start


def round_trip(backend: StorageBackend, pool: torch.Tensor, seed: int) -> bool:
    """Write ``PAGES`` fresh pages under keys of ``seed`` and read them back intact."""
    src, dst = pages_of(pool, 0), pages_of(pool, 1)
    fill(src, seed)
    dst_all = pool[PAGES * PAGE_BYTES : 2 * PAGES * PAGE_BYTES]
    dst_all.fill_(0xEE)
    keys = page_hashes(range(seed * 1000, seed * 1000 + 4 * PAGES), NS)
    if not backend.set([PoolTransfer("kv", keys, src)]).all_ok:
        return False
    got = backend.get([PoolTransfer("kv", keys, dst)])
    return got.all_ok and all(torch.equal(a, b) for a, b in zip(src, dst))


@pytest.mark.timeout(90)
def test_write_rides_out_a_master_restart(restartable, tmp_path: Path) -> None:
    master = restartable["first"]
    backend, pool = make_backend(master, budget_s=45.0)
    try:
        assert round_trip(backend, pool, seed=1)
        stop_master(master)
        src = pages_of(pool, 2)
        fill(src, 2)
        keys = page_hashes(range(50_000, 50_000 + 4 * PAGES), NS)
        result: dict[str, object] = {}

        def backup() -> None:
            try:
                result["ok"] = backend.set([PoolTransfer("kv", keys, src)]).ok
            except BaseException as e:  # noqa: BLE001 - the test reports anything that escapes
                result["error"] = e

        writer = threading.Thread(target=backup)
        writer.start()
        # The write has failed at least once against the dead master before it comes back.
        deadline = time.monotonic() + DOWN_CALL_S
        while backend.metrics.snapshot()["retried_pages"] == 0:
            assert writer.is_alive(), result
            assert time.monotonic() < deadline, "the write never retried"
            time.sleep(POLL_S)
        restartable["second"] = restart_master(master, tmp_path)
        writer.join(RECOVER_S)
        assert not writer.is_alive(), "the write outlived its retry budget"
        assert "error" not in result, result
        assert result["ok"] == {"kv": [True] * PAGES}, (result, backend.metrics.snapshot())
        dst = pages_of(pool, 3)
        assert backend.get([PoolTransfer("kv", keys, dst)]).all_ok
        assert all(torch.equal(a, b) for a, b in zip(src, dst))
        assert backend.breaker.state is BreakerState.CLOSED
        assert backend.metrics.snapshot()["failed_pages.write"] == 0
    finally:
        backend.close()


@pytest.mark.timeout(120)
def test_fails_fast_while_down_and_recovers_after_restart(restartable, tmp_path: Path) -> None:
    master = restartable["first"]
    backend, pool = make_backend(master, budget_s=0.5)
    try:
        assert round_trip(backend, pool, seed=1)
        old = page_hashes(range(1000, 1000 + 4 * PAGES), NS)
        assert backend.exists([PoolTransfer("kv", old)]) == PAGES
        stop_master(master)

        # Until the breaker opens, each call may wait out the client's own RPC timeout.
        src, dst = pages_of(pool, 2), pages_of(pool, 3)
        seed = 100
        while backend.breaker.state is BreakerState.CLOSED:
            seed += 1
            assert seed < 110, "the breaker never opened"
            keys = page_hashes(range(seed * 1000, seed * 1000 + 4 * PAGES), NS)
            failed = backend.metrics.snapshot()["failed_pages.write"]
            res, seconds = timed(backend.set, [PoolTransfer("kv", keys, src)])
            assert not any(res.ok["kv"]) and seconds < DOWN_CALL_S, (res, seconds)
            # Past its retry budget a write is dropped, every page counted.
            assert backend.metrics.snapshot()["failed_pages.write"] - failed == PAGES
        before = backend.metrics.snapshot()
        # Opened once, or more if a write's retries outlasted a cooldown and probed the port.
        assert before["breaker.opened"] >= 1 and before["breaker.state.open"] == 1, before

        # Open: backups and prefetches fail at once, every page counted.
        rounds = 5
        for i in range(rounds):
            keys = page_hashes(range((200 + i) * 1000, (200 + i) * 1000 + 4 * PAGES), NS)
            res, seconds = timed(backend.set, [PoolTransfer("kv", keys, src)])
            assert res.ok["kv"] == [False] * PAGES and seconds < OPEN_CALL_S, (res, seconds)
            res, seconds = timed(backend.get, [PoolTransfer("kv", old, dst)])
            assert res.ok["kv"] == [False] * PAGES and seconds < OPEN_CALL_S, (res, seconds)
            hit, seconds = timed(backend.exists, [PoolTransfer("kv", old)])
            assert hit == 0 and seconds < OPEN_CALL_S, (hit, seconds)
        after = backend.metrics.snapshot()
        assert after["failed_pages.write"] - before["failed_pages.write"] == rounds * PAGES
        assert after["failed_pages.read"] - before["failed_pages.read"] == rounds * PAGES
        refused = after["breaker.short_circuited"] - before["breaker.short_circuited"]
        probed = after["breaker.probe"] - before["breaker.probe"]
        assert refused + probed >= 3 * rounds, "every call was refused or was a (failed) probe"
        assert after["breaker.recovered"] == 0 and after["breaker.state.closed"] == 0

        restartable["second"] = restart_master(master, tmp_path)
        deadline = time.monotonic() + RECOVER_S
        seed = 300
        while not round_trip(backend, pool, seed):
            assert time.monotonic() < deadline, backend.metrics.snapshot()
            seed += 1
            time.sleep(POLL_S)
        s = backend.metrics.snapshot()
        assert backend.breaker.state is BreakerState.CLOSED
        assert s["breaker.state.closed"] == 1 and s["breaker.recovered"] >= 1, s
        written = page_hashes(range(seed * 1000, seed * 1000 + 4 * PAGES), NS)
        assert backend.exists([PoolTransfer("kv", written)]) == PAGES
        assert backend.exists([PoolTransfer("kv", old)]) == 0, "a restarted master starts empty"
    finally:
        backend.close()


def test_misses_do_not_open_the_breaker(mooncake_backend: StorageBackend, make_pages) -> None:
    b = mooncake_backend
    before = b.metrics.snapshot()["breaker.opened"]
    absent = page_hashes(range(900_000, 900_000 + 16), NS)
    out = make_pages(4, 1024)
    for _ in range(3 * b.breaker.failure_threshold):
        assert b.get([PoolTransfer("kv", absent, out)]).ok["kv"] == [False] * 4
        assert b.exists([PoolTransfer("kv", absent)]) == 0
    assert b.breaker.state is BreakerState.CLOSED
    assert b.breaker.stats().consecutive_failures == 0
    assert b.metrics.snapshot()["breaker.opened"] == before
