"""The segment store's per-batch shortcuts against the per-item forms they replace.

Each shortcut (journal entries packed as one numpy record array, the closed-form layout of
records of one size, page views merged by address, hashing a run's pages at once, the batch key
check, a read batch's chunks found adjacent at once) must give exactly what the per-item code
gives, including where it falls back to it.
"""

from __future__ import annotations

import random

import pytest
import torch

from kvtier.storage import Namespace, page_hashes
from kvtier.storage.base import PoolTransfer, StorageBackend
from kvtier.storage.page_format import PageViews, buffer_of, payload_checksum
from kvtier.storage.segments.format import Entry, encode_entries, encode_entry, parse_entries
from kvtier.storage.segments.index import Loc, Segment
from kvtier.storage.segments.io import IOV_MAX, RUN_BYTES
from kvtier.storage.segments.reader import _adjacent, _adjacent_chunks, _chunks, _plan
from kvtier.storage.segments.writer import layout

pytestmark = pytest.mark.usefixtures("loops")  # the C loops and the Python loops

NS = Namespace("test-model", "bfloat16", 4, "page_first")


def per_entry(keys, offsets, lengths, time_ns, algorithms, checksums) -> bytes:
    return b"".join(
        encode_entry(Entry(k, o, n, 0, time_ns, a, c))
        for k, o, n, a, c in zip(keys, offsets, lengths, algorithms, checksums)
    )


@pytest.mark.parametrize(
    "keys",
    [
        [f"{i:064x}.kv.r0" for i in range(37)],
        ["a" * 64 + ".kv"],
        [f"{i:064x}.kv.r{i}" for i in range(12)],  # keys of two lengths: the per-entry form
        [],
    ],
    ids=["one-length", "one-key", "mixed-lengths", "none"],
)
def test_encode_entries_equals_encode_entry(keys: list[str]) -> None:
    rng = random.Random(len(keys))
    offsets = [rng.randrange(1 << 40) for _ in keys]
    lengths = [rng.randrange(1 << 30) for _ in keys]
    algorithms = [rng.choice((1, 2)) for _ in keys]
    # Checksums over the whole unsigned 64-bit range, the top bit set included.
    checksums = [rng.choice((0, 1 << 63, (1 << 64) - 1, rng.getrandbits(64))) for _ in keys]
    t = (1 << 63) + 12345
    got = encode_entries(keys, offsets, lengths, t, algorithms, checksums)
    assert got == per_entry(keys, offsets, lengths, t, algorithms, checksums)
    entries, used = parse_entries(got, seq=5)
    assert used == len(got)
    assert [
        (e.key, e.offset, e.length, e.seq, e.time_ns, e.algorithm, e.checksum) for e in entries
    ] == [
        (k, o, n, 5 + i, t, a, c)
        for i, (k, o, n, a, c) in enumerate(zip(keys, offsets, lengths, algorithms, checksums))
    ]


def loop_layout(pos, size, room, keys, lengths, counts, j):
    return layout(pos, size, room, keys, lengths, counts, j, uniform=False)


@pytest.mark.parametrize("seed", range(40))
def test_uniform_layout_equals_the_loop(seed: int) -> None:
    rng = random.Random(seed)
    m = rng.randrange(1, 300)
    rsize = rng.choice((0, 1, 4096, 65536, 100_000, RUN_BYTES, RUN_BYTES + 1, 3 << 20))
    count = rng.choice((1, 2, 3, IOV_MAX, IOV_MAX + 1))
    keys = ["k" * rng.choice((70, 72))] * m
    lengths, counts = [rsize] * m, [count] * m
    j = rng.randrange(m)
    pos = rng.randrange(0, 1 << 20)
    # Room for record j always (the caller's promise); sometimes for all of them, sometimes not.
    size = pos + rsize * rng.randrange(1, m + 2) + rng.randrange(rsize + 1)
    room = (48 + len(keys[0])) * rng.randrange(1, m + 2) + rng.randrange(40)
    want = loop_layout(pos, size, room, keys, lengths, counts, j)
    got = layout(pos, size, room, keys, lengths, counts, j, uniform=True)
    assert got == want, f"seed {seed}: m={m} size={rsize} count={count} j={j}"


def test_views_merge_only_what_is_adjacent_in_one_region() -> None:
    pool = torch.arange(4096, dtype=torch.int32).view(torch.uint8)  # 16 KiB
    own = torch.arange(300, dtype=torch.uint8)  # a storage of its own
    pages = [
        (pool[0:1000],),
        (pool[1000:1500],),  # right after page 0: merged with it
        (pool[3000:3100],),  # a gap: a view of its own
        (own[0:100],),  # another storage
        (own[100:300],),  # adjacent in that storage: merged
        (pool[3100:3100],),  # empty: left out
        (pool[3100:3200], pool[5000:5010]),  # two parts, the first adjacent to page 2
    ]
    views = PageViews(pages)
    assert views.lengths() == [1000, 500, 100, 100, 200, 0, 110]
    assert views.counts() == [1, 1, 1, 1, 1, 1, 2]
    got = views.iovecs(range(len(pages)))
    want = [pool[0:1500], pool[3000:3100], own[0:300], pool[3100:3200], pool[5000:5010]]
    assert [bytes(v) for v in got] == [bytes(buffer_of(t)) for t in want]
    got = views.iovecs([2, 6, 0])  # file order need not be memory order
    want = [pool[3000:3200], pool[5000:5010], pool[0:1000]]
    assert [bytes(v) for v in got] == [bytes(buffer_of(t)) for t in want]
    # The views alias the tensors: a write through one lands in the tensor.
    views.iovecs([3])[0][5] = 0xAB
    assert own[5].item() == 0xAB


def test_checksum_by_address_equals_payload_checksum() -> None:
    g = torch.Generator().manual_seed(3)
    pool = torch.randint(0, 256, (1 << 18,), dtype=torch.uint8, generator=g)
    pages = [
        (pool[0:65536],),
        (pool[7 : 7 + 1000],),  # unaligned
        (pool[70000 : 70000 + 300], pool[100:200]),  # two parts: one stream
        (pool[5:5],),  # empty
        (pool[9:9], pool[10:20]),  # an empty part first
    ]
    views = PageViews(pages)
    wants = [payload_checksum([buffer_of(p) for p in parts]) for parts in pages]
    for i, want in enumerate(wants):
        assert views.checksum(i) == want, f"page {i}"
        assert views.matches(i, *want), f"page {i}"
        assert not views.matches(i, want[0], want[1] ^ 1), f"page {i}"
    assert views.checksums([4, 0, 2]) == [wants[4], wants[0], wants[2]]
    # One part each (the run path of the binding on views), over two storages, one page empty.
    own = torch.randint(0, 256, (5000,), dtype=torch.uint8, generator=g)
    singles = [(pool[0:65536],), (own[3:4003],), (pool[5:5],), (pool[7 : 7 + 1000],)]
    views = PageViews(singles)
    want = [payload_checksum([buffer_of(p) for p in parts]) for parts in singles]
    assert views.checksums(range(4)) == want
    assert views.checksums([3, 1]) == [want[3], want[1]]


class _Keys(StorageBackend):
    """Only the key checks of the base class."""

    name = "keys-only"

    def _contains(self, object_keys):  # pragma: no cover - not called
        raise AssertionError

    def _read(self, object_keys, pages):  # pragma: no cover - not called
        raise AssertionError

    def _write(self, object_keys, pages):  # pragma: no cover - not called
        raise AssertionError

    def clear(self) -> None:  # pragma: no cover - not called
        raise AssertionError


H = page_hashes(range(4 * 6), NS)


@pytest.mark.parametrize(
    "batch, bad",
    [
        ([H[0], H[1], H[2]], set()),
        ([H[0][:63], H[1] + "a"], {0, 1}),  # lengths 63 and 65: the joined length is right
        ([H[0][:63] + "\n", H[1]], {0}),  # a newline one place early
        ([H[0], "０" + H[1][1:]], {1}),  # a fullwidth digit: hex to str.isdigit, not ASCII
        ([H[0], H[1][:64].replace(H[1][3], "g", 1)], {1}),
        ([H[0], H[1].upper()], {1} if H[1].upper() != H[1] else set()),
        ([H[0], H[1][:32] + "\n" + H[1][33:]], {1}),
    ],
    ids=["good", "63-and-65", "early-newline", "fullwidth", "non-hex", "upper", "newline"],
)
def test_batch_key_check_fails_exactly_the_bad_pages(batch: list[str], bad: set[int]) -> None:
    names = _Keys()._object_keys(PoolTransfer("kv", batch))
    assert [i for i, k in enumerate(names) if k is None] == sorted(bad)
    for h, k in zip(batch, names):
        if k is not None:
            assert k == f"{h}.kv.r0"


def _loc(seg: Segment, offset: int, length: int, trusted: bool = False) -> Loc:
    return Loc(seg, offset, length, 0, 0, trusted, 1, 0)


@pytest.mark.parametrize("seed", range(60))
def test_adjacent_chunks_equal_the_chunk_by_chunk_check(seed: int) -> None:
    """Batches written together (back to back in one segment) and every way they can fail to
    be: a gap, a key read twice, a second segment, a record larger than a run, pages of many
    parts, records of mixed sizes."""
    rng = random.Random(seed)
    segs = [Segment(f"1-0000000{k}-00000001", "w", 1, -1, None) for k in range(2)]
    n = rng.randrange(1, 200)
    size = rng.choice((4096, 65536, RUN_BYTES, RUN_BYTES + 1))
    lengths = [size] * n
    if rng.random() < 0.2:
        lengths = [rng.choice((4096, 33 << 10, 65536)) for _ in range(n)]
    offsets = [0]
    for length in lengths[:-1]:
        offsets.append(offsets[-1] + length)
    locs = [_loc(segs[0], o, ln, trusted=rng.random() < 0.1) for o, ln in zip(offsets, lengths)]
    damage = rng.choice(("none", "gap", "twice", "segment", "none"))
    k = rng.randrange(n)
    if damage == "gap":
        for i in range(k, n):
            locs[i] = locs[i]._replace(offset=locs[i].offset + 4096)
    elif damage == "twice" and n > 1:
        locs[k] = locs[k - 1 if k else 1]
        lengths[k] = locs[k].length
    elif damage == "segment":
        for i in range(k, n):
            locs[i] = locs[i]._replace(seg=segs[1])
    rng.shuffle(order := list(range(n)))  # the caller's order need not be the file's
    locs, lengths = [locs[i] for i in order], [lengths[i] for i in order]
    plan = _plan(locs, lengths)  # type: ignore[arg-type]
    assert plan is not None
    counts = [rng.choice((1, 1, 2, IOV_MAX // 4, IOV_MAX))] * n
    bounds = _chunks(plan.order, lengths)
    want = [_adjacent(plan, lo, hi, counts) for lo, hi in zip(bounds, bounds[1:])]
    assert _adjacent_chunks(plan, bounds, counts) == want, f"seed {seed}: {damage} at {k}"


@pytest.mark.parametrize("seed", range(6))
def test_indexing_new_records_at_once_equals_entry_by_entry(tmp_path, seed: int) -> None:
    """``Index.insert_new_locked`` (the append's bulk path, or its fallback where a key is
    indexed or tombstoned already) leaves the same books as ``insert_locked`` entry by entry."""
    from kvtier.storage.segments.index import Index

    rng = random.Random(seed)
    books = []
    for bulk in (True, False):
        index = Index(tmp_path, -1, ["w"], 8, 1.0)
        old = Segment("1-00000000-00000001", "w", 1, -1, None)
        seg = Segment("1-00000000-00000002", "w", 2, -1, None)
        rng = random.Random(seed)
        keys = [f"k{i}" for i in rng.sample(range(100), 40)]
        before = rng.sample(keys, rng.choice([0, 0, 3]))  # indexed earlier, in another segment
        with index.mutex:
            index.insert_locked(
                old, [Entry(k, 64 * i, 64, i, 5, 1, i) for i, k in enumerate(before)]
            )
            if rng.random() < 0.5:
                index.insert_locked(old, [Entry(keys[-1], 0, 0, 99, 6, deleted=True)])
            offsets = [4096 * i for i in range(len(keys))]
            lengths = [rng.choice([4096, 100]) for _ in keys]
            sums = [rng.randrange(2**64) for _ in keys]
            if bulk:
                index.insert_new_locked(seg, keys, offsets, lengths, 7, 10, [1] * len(keys), sums)
            else:
                index.insert_locked(
                    seg,
                    [
                        Entry(k, o, n, 7 + i, 10, 1, c)
                        for i, (k, o, n, c) in enumerate(zip(keys, offsets, lengths, sums))
                    ],
                )
        books.append(
            (
                {k: (v.seg.stem, *v[1:]) for k, v in index.entries.items()},
                dict(index.tombs),
                seg.keys,
                (seg.live, seg.live_bytes, seg.end, old.live, old.live_bytes),
                {s.stem for s in index.changed},
            )
        )
    assert books[0] == books[1]
