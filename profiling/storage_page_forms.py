"""A host pool's pages to and from the file store as the L3 tier moves them: as page tensors
(``HostPool.page_views``, a tensor per K and V range) or as ``PageSpans`` (``page_spans``, the
same ranges as offsets), each batch's time counting the pages' making and the store call.

Batches of the two forms alternate in one process (which goes first alternates too), into one
store with distinct keys, so host drift falls on both alike; per form the median batch and the
median of its page-making step, and the ratio.

    python3 -m profiling.storage_page_forms --dir /tmp --page-kib 64 --rounds 3

The pool: an MHA ``page_first`` host pool (two parts a page), ``--page-kib`` a page, its pages
filled with random bytes; pages picked at random, ``BATCH_BYTES`` a call as in bench_storage.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from kvtier.runtime.pools.device import MHADevicePool
from kvtier.runtime.pools.host import HostPool
from kvtier.storage import PoolTransfer, create_backend
from profiling.bench_storage import BATCH_BYTES, keys_for, settle_memory

FORMS = ("tensors", "spans")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--page-kib", type=int, default=64)
    p.add_argument("--total-mib", type=int, default=256, help="bytes each form moves a round")
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    page = args.page_kib << 10
    # K and V of one layer-stack per page: page_size 16 tokens, 2 KiB a token across layers.
    heads, dim, tokens = 8, 64, 16
    token_bytes = 2 * heads * dim * 2  # K and V, bf16
    layers = max(1, page // (tokens * token_bytes))
    per = max(1, BATCH_BYTES // page)
    n_pages = 2 * (args.total_mib << 20) // page
    dev = MHADevicePool(layers, tokens * per, heads, dim, page_size=tokens)
    host = HostPool(dev, "page_first", size=tokens * n_pages, pin=False)
    raw = host.tensor.view(-1).view(torch.uint8)
    raw.copy_(torch.randint(0, 256, (raw.numel(),), dtype=torch.uint8))
    page_bytes = host.buffer.page_bytes
    print(f"pool: {n_pages} pages of {page_bytes >> 10} KiB, {per} a batch, {layers} layers")
    work = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        for r in range(args.rounds):
            store = create_backend("file", root=work / f"l3-{r}")
            order = torch.randperm(n_pages)
            times = {(f, op): [] for f in FORMS for op in ("put", "get")}
            making = {(f, op): [] for f in FORMS for op in ("put", "get")}
            batches = n_pages // per // 2
            keys = {f: keys_for(2 * r + k, n_pages) for k, f in enumerate(FORMS)}
            stored: dict[str, list] = {f: [] for f in FORMS}  # (page ids, keys) a batch
            for op in ("put", "get"):
                settle_memory()
                for i in range(batches):
                    forms = FORMS if i % 2 == 0 else FORMS[::-1]
                    for k, form in enumerate(forms):
                        if op == "put":
                            lo = (2 * i + k) * per
                            ids, names = order[lo : lo + per], keys[form][lo : lo + per]
                            stored[form].append((ids, names))
                        else:
                            ids, names = stored[form][i]
                        start = time.perf_counter()
                        pages = host.page_views(ids) if form == "tensors" else host.page_spans(ids)
                        made = time.perf_counter()
                        call = store.set if op == "put" else store.get
                        assert call([PoolTransfer("kv", names, pages)]).all_ok
                        end = time.perf_counter()
                        times[(form, op)].append(end - start)
                        making[(form, op)].append(made - start)
            store.clear()
            store.close()
            for op in ("put", "get"):
                t = {f: statistics.median(times[(f, op)]) for f in FORMS}
                m = {f: statistics.median(making[(f, op)]) for f in FORMS}
                print(
                    f"round {r} {op}: tensors {t['tensors'] * 1e3:.3f} ms (pages made in "
                    f"{m['tensors'] * 1e6:.0f} us), spans {t['spans'] * 1e3:.3f} ms (made in "
                    f"{m['spans'] * 1e6:.0f} us), tensors / spans {t['tensors'] / t['spans']:.3f}"
                )
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
