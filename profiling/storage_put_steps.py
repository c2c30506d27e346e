"""Where a file-store put's CPU goes outside its IO: every step of ``set`` timed on its own.

The store's write is replaced by one that writes nothing (the C loops' write thread, or their
one call, returns at once; the hashing still runs), so what is left is the batch's Python and
the checksums, step by step (wall time of each call, summed per batch; a step's time includes
the steps inside it). The bytes written are not checked here: this measures, it does not test.

    python3 -m profiling.storage_put_steps --page-kib 64 --dir /tmp

A segment roll (every ``segment_bytes``) is averaged into ``_roll``'s line. Only page sizes
that a batch writes through one lane (records under ``writer.LANE_MIN_RECORD``): larger ones
are split among lanes on several threads, whose steps overlap.
"""

from __future__ import annotations

import argparse
import collections
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from kvtier.storage import PoolTransfer, create_backend
from kvtier.storage.segments import native, writer
from profiling.bench_storage import BATCH_BYTES, keys_for, page_views


def timed_steps(store, spent: dict[str, float]) -> None:
    """Wrap the steps of a put (on ``store``'s own objects and the modules it calls) so that
    each call adds its wall seconds to ``spent[name]``."""

    def wrap(owner, label: str, name: str) -> None:
        fn = getattr(owner, name)

        def step(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[f"{label}.{name}"] += time.perf_counter() - t

        setattr(owner, name, step)

    lane = store._writer._lanes[0]
    for owner, label, names in (
        (store, "store", ("_check_pages", "_object_keys", "_write")),
        (store._writer, "writer", ("append",)),
        (lane, "lane", ("append", "_append_some", "_after_known", "_roll")),
        (store._index, "index", ("insert_new_locked", "new_locs", "refresh_locked")),
        (store._compactor, "compactor", ("step",)),
        (native, "native", ("encode_entries", "hash_records", "make_runs")),
        (writer, "writer", ("layout", "write_all")),
    ):
        for name in names:
            wrap(owner, label, name)


class _Written:
    def wait(self) -> None:
        pass


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--page-kib", type=int, default=64)
    p.add_argument("--total-mib", type=int, default=256)
    args = p.parse_args()
    page = args.page_kib << 10
    if page >= writer.LANE_MIN_RECORD:
        p.error(f"--page-kib must be under {writer.LANE_MIN_RECORD >> 10} (one write lane)")
    src = torch.randint(0, 256, (args.total_mib << 20,), dtype=torch.uint8)
    pages = page_views(src, page)
    per = BATCH_BYTES // page
    work = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        store = create_backend("file", root=work / "l3")
        # After the store's library self-test: from here on nothing is written.
        native.write_start = lambda *a: _Written()
        native.write = lambda lib, runs, addr, lengths, *rest: np.zeros(len(lengths), np.uint64)
        writer.write_all = lambda fd, views, offset: None
        spent: dict[str, float] = collections.defaultdict(float)
        timed_steps(store, spent)
        keys = keys_for(0, len(pages))
        batches = [
            PoolTransfer("kv", keys[lo : lo + per], pages[lo : lo + per])
            for lo in range(0, len(keys), per)
        ]
        total = 0.0
        for b in batches:
            t = time.perf_counter()
            store.set([b])
            total += time.perf_counter() - t
        store.close()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    n = len(batches)
    print(f"{args.page_kib} KiB pages, {per} a batch, {n} batches: set {total / n * 1e6:.0f} us")
    for name, sec in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {name:26s} {sec / n * 1e6:7.1f} us a batch")


if __name__ == "__main__":
    main()
