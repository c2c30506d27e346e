"""Two tensor-parallel ranks on gloo: acks are agreed, so both trees change identically.

Rank 1's copies are acknowledged two steps late (``ack_delay_steps``). With agreement every rank
acknowledges the same operations in the same step and the trees stay identical after every step;
without it the ranks' trees drift apart, which shows the check can fail.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig
from tests.runtime.synthetic import fingerprint, forward

STEPS = 14


def turn(cache: TieredKVCache, tokens: list[int]) -> None:
    """One request: match, load, write two more positions, finish."""
    req = cache.match(tokens)
    cache.reserve(req, len(tokens) + 2)
    cache.start_loading()
    req.token_ids = tokens + [1, 1]
    forward(cache, req, len(tokens) + 2)
    cache.cache_finished_req(req)


def workload(cache: TieredKVCache, step: int) -> None:
    gen = torch.Generator().manual_seed(step)
    conv = step % 3
    turn(cache, [conv] * 4 + torch.randint(0, 40, (8 + 4 * (step % 4),), generator=gen).tolist())


def _rank(rank: int, init: str, agree: bool, out: str, gpus: bool) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    device = f"cuda:{rank}" if gpus else "cpu"  # data on each rank's GPU; agreement on gloo
    if gpus:
        torch.cuda.set_device(rank)
    cache = TieredKVCache(
        tp_config(device=device),
        tp_group=dist.group.WORLD if agree else None,
        ack_delay_steps=2 if rank == 1 else 0,
    )
    same = []
    for step in range(STEPS):
        workload(cache, step)
        cache.poll()
        cache.check_integrity()
        prints = [None, None]
        dist.all_gather_object(prints, fingerprint(cache))
        same.append(prints[0] == prints[1])
    if rank == 0:
        torch.save(same, out)
    dist.barrier()
    dist.destroy_process_group()
    # Results are saved and the group is gone: leave without interpreter teardown, where
    # gloo's and Mooncake's C++ threads have aborted a finished rank now and then (SIGABRT,
    # "terminate called without an active exception") after its work was done.
    os._exit(0)


def run_two_ranks(agree: bool, gpus: bool = False) -> list[bool]:
    with tempfile.TemporaryDirectory() as d:
        init = f"file://{os.path.join(d, 'store')}"
        out = os.path.join(d, "same.pt")
        mp.start_processes(_rank, args=(init, agree, out, gpus), nprocs=2, start_method="spawn")
        return torch.load(out)


@pytest.mark.timeout(240)
def test_trees_identical_after_every_step_with_agreement():
    same = run_two_ranks(agree=True)
    assert len(same) == STEPS and all(same), (
        f"trees differed at steps {[i for i, s in enumerate(same) if not s]}"
    )


@pytest.mark.timeout(240)
def test_without_agreement_trees_drift():
    same = run_two_ranks(agree=False)
    assert not all(same), "delayed acks without agreement should make the trees differ"


@pytest.mark.timeout(240)
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs (one per rank)")
def test_two_gpus_one_rank_each():
    same = run_two_ranks(agree=True, gpus=True)
    assert all(same), f"trees differed at steps {[i for i, s in enumerate(same) if not s]}"


def tp_config(host_ratio: float = 4.0, **kw) -> CacheConfig:
    return CacheConfig(
        layer_kinds=("full", "full"),
        kv_heads=1,
        head_dim=4,
        page_size=4,
        device_tokens=64,
        dtype=torch.float32,
        host_ratio=host_ratio,
        write_policy="write_through",
        **kw,
    )


def _join(rank: int, init: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)


def _leave(rank: int, mine: object, out: str) -> None:
    """Gather every rank's ``mine`` into ``out`` (rank 0 writes it), then leave at once."""
    got = [None, None]
    dist.all_gather_object(got, mine)
    if rank == 0:
        torch.save(got, out)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def two_ranks(target, *args) -> list:
    """Run ``target(rank, init, *args, out)`` on two spawned ranks; what they gathered."""
    with tempfile.TemporaryDirectory() as d:
        init = f"file://{os.path.join(d, 'store')}"
        out = os.path.join(d, "out.pt")
        mp.start_processes(target, args=(init, *args, out), nprocs=2, start_method="spawn")
        return torch.load(out)


def _rank_out_of_step(rank: int, init: str, how: str, out: str) -> None:
    _join(rank, init)
    cache = TieredKVCache(tp_config(), tp_group=dist.group.WORLD)
    errors = []
    for step in range(6):
        try:
            if step == 3 and rank == 1 and how == "skipped-call":
                cache.match([1, 2, -5])  # refused on this rank only: the engine skips it
            else:
                workload(cache, step)
        except ValueError:
            pass
        try:
            cache.poll()
            if step == 3 and rank == 0 and how == "extra-poll":
                cache.poll()
        except RuntimeError as e:
            errors.append((step, str(e)))
            break
    _leave(rank, errors, out)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("how", ["skipped-call", "extra-poll"])
def test_ranks_out_of_step_raise_at_the_same_poll(how):
    """A call refused on one rank only (the engine skips that request there), or an extra poll,
    is found at the next poll: every rank raises there, naming the mismatch, while the
    collectives are still paired. The trees drifted apart silently, and a drain never ended
    (found in a TP trial)."""
    e0, e1 = two_ranks(_rank_out_of_step, how)
    # The same poll on both (its number is in the message; with an extra poll it falls in
    # different steps of the two ranks' loops).
    assert e0 and e1 and "TP ranks out of step at poll" in e0[0][1], (e0, e1)
    assert e0[0][1] == e1[0][1], (e0, e1)


def _poll_error(cache: TieredKVCache) -> str:
    """The RuntimeError a poll raised, or ""."""
    try:
        cache.poll()
    except RuntimeError as e:
        return str(e)
    return ""


def _rank_other_config(rank: int, init: str, out: str) -> None:
    _join(rank, init)
    # An engine sizing host pools per rank.
    cache = TieredKVCache(tp_config(4.0 if rank == 0 else 2.0), tp_group=dist.group.WORLD)
    _leave(rank, _poll_error(cache), out)


@pytest.mark.timeout(240)
def test_ranks_with_other_configs_raise_at_the_first_poll():
    """Ranks built with configs that change the books (another host pool size) raise at the
    first poll; their trees drifted apart silently from the first eviction (a TP trial)."""
    e0, e1 = two_ranks(_rank_other_config)
    assert "config digests" in e0 and e0 == e1, (e0, e1)
    # Where the pools live and how copies run do not change the books.
    assert tp_config().books_digest() == tp_config(io_backend="kernel").books_digest()
    assert tp_config().books_digest() != tp_config(2.0).books_digest()


def _idle_pin_rank(rank: int, init: str, out: str) -> None:
    _join(rank, init)
    now = [0.0]
    cache = TieredKVCache(tp_config(), tp_group=dist.group.WORLD, clock=lambda: now[0])
    sys_prompt = list(range(100, 116))
    got = []
    cache.poll()
    now[0] = 1.0
    cache.poll()
    now[0] = 600.0  # ten idle minutes: no requests, no polls
    turn(cache, sys_prompt + [1, 2, 3])
    h = cache.pin(sys_prompt, ttl_s=120.0)
    now[0] = 600.5
    cache.poll()  # the next step: the pin lives 120 s from this poll's agreed time
    got.append((h.released, h.expires_at))
    now[0] = 700.0
    cache.poll()
    now[0] = 1000.0  # idle again, past the TTL; then a hit on the pinned prefix refreshes it
    req = cache.match(sys_prompt + [9, 9, 9])
    cache.abort(req)
    now[0] = 1000.25
    cache.poll()
    got.append((h.released, h.expires_at))
    now[0] = 1121.0
    cache.poll()
    got.append((h.released, h.expires_at))
    cache.check_integrity()
    _leave(rank, got, out)


@pytest.mark.timeout(240)
def test_a_pin_after_an_idle_spell_lives_its_ttl_under_tp():
    """Under TP retention time is agreed at each poll, so between polls ``now`` is the last
    poll's: a pin taken (or refreshed by a hit) after an idle spell with no polls got an expiry
    in the past and was released at the very next poll (a TP trial). Such pins expire ``ttl_s``
    after the next poll's agreed time instead, on every rank alike."""
    got = two_ranks(_idle_pin_rank)
    assert got[0] == got[1], got
    assert got[0] == [("", 720.5), ("", 1120.25), ("expired", 1120.25)], got[0]


def _one_sided_rank(rank: int, init: str, which: str, out: str) -> None:
    _join(rank, init)
    cache = TieredKVCache(tp_config(), tp_group=dist.group.WORLD)
    tokens = list(range(40, 56))
    turn(cache, tokens)
    cache.poll()
    h = cache.pin(tokens, ttl_s=100.0)
    cache.poll()
    if rank == 1:  # a call made on this rank only
        if which == "unpin":
            cache.unpin(h)
        elif which == "evict":
            cache.evict(8)
        else:
            req = cache.match(tokens + [9])
            cache.abort(req)
            cache.match(tokens + [9])  # the same count of matches as rank 0, one more abort
    else:
        if which == "abort":
            cache.match(tokens + [9])
            cache.match(tokens + [9])
    _leave(rank, _poll_error(cache), out)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("which", ["unpin", "evict", "abort"])
def test_a_call_made_on_one_rank_only_is_found_at_the_next_poll(which):
    """An unpin, an evict or an abort made on one rank only changed its books with no error,
    and the ranks' trees stayed apart (a TP trial): such calls are counted in the poll's
    control header too, and every rank raises at the next poll."""
    errors = two_ranks(_one_sided_rank, which)
    assert all("TP ranks out of step" in e for e in errors), errors
