"""Two TP ranks on gloo sharing a file L3: one rank misses a page, both trees stay identical.

Each rank writes its own head shard (rank-suffixed keys). Rank 1's object for one page is then
deleted (the segment store's through its API, the per-page store's file from the root), so its
existence query finds fewer pages than rank 0's. The agreed (MIN) hit makes both
ranks read, commit and graft the same pages, and their trees are identical after every step.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kvtier.runtime.l3.pools import namespace_for
from kvtier.storage import KeyScope, PoolTransfer, StorageBackend, create_backend, page_hashes
from kvtier.storage.file_backend import FilePerPageBackend, FilePerPageConfig
from tests.runtime.l3.helpers import conversations, make_l3_cache, produce, second_turn
from tests.runtime.synthetic import P, fingerprint, run_turn

MISSING_PAGE = 3


def _rank(rank: int, init: str, root: str, out: str, kind: str) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    group = dist.group.WORLD
    convs = conversations(31, n=2)

    def store() -> StorageBackend:
        if kind == "file":
            return create_backend("file", root=root, scope=KeyScope(rank, 2))
        return FilePerPageBackend(FilePerPageConfig(root=root), scope=KeyScope(rank, 2))

    producer = make_l3_cache("full+swa", store(), tp_group=group)
    produce(producer, convs)
    producer.close()
    dist.barrier()
    if rank == 1:
        ns = namespace_for(producer.config, None, 2)
        h = page_hashes(convs[0], ns)[MISSING_PAGE]
        if kind == "file":
            gone = store()
            assert gone.delete([PoolTransfer("kv", [h])]).ok["kv"] == [True]
            assert f"{h}.kv.r1" not in gone.object_keys()
            gone.close()
        else:
            os.remove(os.path.join(root, f"{h}.kv.r1.kvp"))
    dist.barrier()
    cache = make_l3_cache("full+swa", store(), tp_group=group)
    same, loaded = [], []
    for conv in convs:
        pf = cache.prefetch(second_turn(conv))
        while not pf.done:
            cache.l3.wait_some(0.05)
            cache.poll()
            cache.check_integrity()
            prints = [None, None]
            dist.all_gather_object(prints, fingerprint(cache))
            same.append(prints[0] == prints[1])
        loaded.append(pf.loaded_tokens)
        run_turn(cache, second_turn(conv))
        prints = [None, None]
        dist.all_gather_object(prints, fingerprint(cache))
        same.append(prints[0] == prints[1])
    cache.drain()
    cache.check_integrity()
    if rank == 0:
        torch.save((same, loaded), out)
    cache.close()
    dist.barrier()
    dist.destroy_process_group()
    # Results are saved and the group is gone: leave without interpreter teardown, where
    # gloo's and Mooncake's C++ threads have aborted a finished rank now and then (SIGABRT,
    # "terminate called without an active exception") after its work was done.
    os._exit(0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("kind", ["file", "file_per_page"])
def test_one_rank_misses_a_page_trees_stay_identical(kind):
    with tempfile.TemporaryDirectory() as d:
        init = f"file://{os.path.join(d, 'store')}"
        out = os.path.join(d, "out.pt")
        root = os.path.join(d, "l3")
        mp.start_processes(_rank, args=(init, root, out, kind), nprocs=2, start_method="spawn")
        same, loaded = torch.load(out)
    assert same and all(same), f"trees differed at steps {[i for i, s in enumerate(same) if not s]}"
    assert loaded == [MISSING_PAGE * P, 20], loaded
