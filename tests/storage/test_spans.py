"""Pages given as ``PageSpans`` (byte ranges of one host buffer) instead of tensors: the same
bytes stored and served as with page tensors, in every backend; bad spans refused before anything
moves; the host pool's spans name the bytes its page views do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvtier.storage import Namespace, PageSpans, PoolTransfer, create_backend, page_hashes
from kvtier.storage.spans import SpanPages

NS = Namespace("spans", "bfloat16", 16, "page_first")
H = page_hashes(range(64 * 16), NS)
POISON = 0xEE


def layout(n: int, sizes: tuple[int, ...], seed: int) -> np.ndarray:
    """Offsets of ``n`` pages' parts in a buffer of ``room(n, sizes)`` bytes: parts shuffled
    over the buffer, a poisoned byte after each."""
    slot = sum(sizes) + len(sizes)
    order = np.random.default_rng(seed).permutation(n)
    out = np.empty((n, len(sizes)), dtype=np.int64)
    for k in range(len(sizes)):
        # Part k of every page in a band of its own, pages in a shuffled order.
        out[:, k] = n * (sum(sizes[:k]) + k) + order * (sizes[k] + 1)
    assert (out + np.asarray(sizes)).max() <= n * slot
    return out


def room(n: int, sizes: tuple[int, ...]) -> int:
    return n * (sum(sizes) + len(sizes))


def contents(spans: PageSpans) -> list[torch.Tensor]:
    return [torch.cat(spans.page(i)) if spans.sizes else torch.empty(0) for i in range(len(spans))]


@pytest.fixture(params=["segment", "segment-python-loops", "file_per_page", "mooncake"])
def any_backend(request: pytest.FixtureRequest, tmp_path: Path):
    """Every store: the segment store with its C loops and with its Python loops, the per-page
    store, and Mooncake (through the shared ``backend`` fixture)."""
    if request.param == "segment":
        return create_backend("file", root=tmp_path / "l3")
    if request.param == "segment-python-loops":
        return create_backend("file", root=tmp_path / "l3", native=False)
    if request.param == "file_per_page":
        return create_backend("file_per_page", root=tmp_path / "l3")
    return request.getfixturevalue("mooncake_backend_fresh")


@pytest.fixture
def mooncake_backend_fresh(mooncake_backend):
    from kvtier.metrics import TierMetrics

    mooncake_backend.clear()
    mooncake_backend.metrics = TierMetrics()
    yield mooncake_backend
    mooncake_backend.clear()


@pytest.mark.parametrize("sizes", [(4096,), (3000, 5000), (0, 777, 1)], ids=str)
def test_spans_round_trip_in_every_backend(
    any_backend, host_arena: torch.Tensor, sizes: tuple[int, ...]
) -> None:
    """Pages set as spans are served into spans over another buffer, exactly; nothing outside
    the ranges is written; the same objects read as page tensors match."""
    n = 24
    need = room(n, sizes)
    src_buf, dst_buf = host_arena[:need], host_arena[need : 2 * need]
    src_buf.copy_(torch.randint(0, 256, (need,), dtype=torch.uint8))
    dst_buf.fill_(POISON)
    src = PageSpans(src_buf, layout(n, sizes, 1), sizes)
    dst = PageSpans(dst_buf, layout(n, sizes, 2), sizes)
    keys = H[:n]
    backend = any_backend
    assert backend.set([PoolTransfer("kv", keys, src)]).all_ok
    assert backend.get([PoolTransfer("kv", keys, dst)]).all_ok
    assert all(torch.equal(a, b) for a, b in zip(contents(dst), contents(src)))
    covered = torch.zeros(need, dtype=torch.bool)
    for row in dst.offsets.tolist():
        for o, s in zip(row, sizes):
            covered[o : o + s] = True
    assert bool((dst_buf[~covered] == POISON).all()), "nothing written outside the ranges"
    # The same objects as page tensors (views of the arena, as a backend that registers it
    # needs).
    total = sum(sizes)
    flat = host_arena[2 * need : 2 * need + n * total]
    flat.fill_(POISON)
    pages = list(flat.view(n, total).unbind(0)) if total else [flat[:0]] * n
    assert backend.get([PoolTransfer("kv", keys, pages)]).all_ok
    assert all(torch.equal(a, b) for a, b in zip(pages, contents(src)))
    snap = backend.metrics.snapshot()
    assert snap.get("failed_pages.write", 0) == 0 and snap.get("failed_pages.read", 0) == 0


def test_spans_with_stored_and_malformed_keys_move_only_their_own_pages(tmp_path: Path) -> None:
    """A batch whose pages are partly stored already and whose keys are partly malformed: the
    store writes the rest from the right ranges (the spans' rows picked out, in order)."""
    b = create_backend("file", root=tmp_path / "l3")
    sizes = (1000, 24)
    n = 12
    buf = torch.randint(0, 256, (room(n, sizes),), dtype=torch.uint8)
    spans = PageSpans(buf, layout(n, sizes, 3), sizes)
    keys = list(H[:n])
    first = PageSpans(buf, spans.offsets[[1, 5, 6]], sizes)
    assert b.set([PoolTransfer("kv", [keys[i] for i in (1, 5, 6)], first)]).all_ok
    keys[3] = "../../escape"
    keys[8] = "A" * 64
    res = b.set([PoolTransfer("kv", keys, spans)]).ok["kv"]
    assert res == [i not in (3, 8) for i in range(n)]
    good = [i for i in range(n) if i not in (3, 8)]
    out = torch.full_like(buf, POISON)
    dst = PageSpans(out, spans.offsets[good], sizes)
    assert b.get([PoolTransfer("kv", [keys[i] for i in good], dst)]).all_ok
    want = contents(spans)
    assert all(torch.equal(got, want[i]) for got, i in zip(contents(dst), good))
    assert b.metrics.snapshot()["failed_pages.write"] == 2


def test_spans_beside_page_tensors_in_one_call(tmp_path: Path) -> None:
    """One transfer of spans and one of page tensors in one call: both stored and served."""
    b = create_backend("file", root=tmp_path / "l3")
    buf = torch.randint(0, 256, (room(4, (512,)),), dtype=torch.uint8)
    spans = PageSpans(buf, layout(4, (512,), 4), (512,))
    tensors = list(torch.randint(0, 256, (4, 300), dtype=torch.uint8).unbind(0))
    assert b.set([PoolTransfer("kv", H[:4], spans), PoolTransfer("swa", H[:4], tensors)]).all_ok
    out_kv = PageSpans(torch.zeros_like(buf), spans.offsets, (512,))
    out_swa = [torch.zeros(300, dtype=torch.uint8) for _ in range(4)]
    assert b.get([PoolTransfer("kv", H[:4], out_kv), PoolTransfer("swa", H[:4], out_swa)]).all_ok
    assert all(torch.equal(x, y) for x, y in zip(contents(out_kv), contents(spans)))
    assert all(torch.equal(x, y) for x, y in zip(out_swa, tensors))


def _spans_cases() -> list[tuple[str, object, type, str]]:
    buf = torch.zeros(4096, dtype=torch.uint8)
    ok = np.array([[0], [100]])
    return [
        ("float buffer", lambda: PageSpans(buf.float(), ok, (10,)), ValueError, "uint8"),
        ("2-D buffer", lambda: PageSpans(buf.view(64, 64), ok, (10,)), ValueError, "1-D"),
        ("strided buffer", lambda: PageSpans(buf[::2], ok, (10,)), ValueError, "contiguous"),
        ("not a tensor", lambda: PageSpans(bytearray(10), ok, (10,)), TypeError, "tensor"),
        (
            "past the end",
            lambda: PageSpans(buf, np.array([[0], [4090]]), (10,)),
            ValueError,
            "page 1",
        ),
        ("negative", lambda: PageSpans(buf, np.array([[-1], [0]]), (10,)), ValueError, "page 0"),
        # offset + size past 2**63 wraps to a negative end: compared without the sum
        (
            "offset overflow",
            lambda: PageSpans(buf, np.array([[0], [2**63 - 8]]), (64,)),
            ValueError,
            "page 1",
        ),
        (
            "size overflow",
            lambda: PageSpans(buf, np.array([[1], [2]]), (2**63 - 1,)),
            ValueError,
            "page 0",
        ),
        (
            "size past the buffer",
            lambda: PageSpans(buf, np.array([[0], [0]]), (4097,)),
            ValueError,
            "page 0",
        ),
        (
            "storage cut short",
            lambda: PageSpans(_short_storage(), ok, (10,)),
            ValueError,
            "storage",
        ),
    ]


def _short_storage() -> torch.Tensor:
    """A tensor that says 1 MiB over a storage resized to 4 KiB (as FSDP frees one): moved by
    address, its pages would run past the allocation."""
    t = torch.zeros(1 << 20, dtype=torch.uint8)
    t.untyped_storage().resize_(4096)
    return t


@pytest.mark.parametrize(
    ("make", "error", "match"),
    [(m, e, s) for _, m, e, s in _spans_cases()],
    ids=[name for name, *_ in _spans_cases()],
)
@pytest.mark.parametrize("native", [True, False], ids=["c-loops", "python-loops"])
def test_bad_spans_are_refused_and_nothing_moves(
    tmp_path: Path, make, error: type, match: str, native: bool
) -> None:
    """Refused before anything moves: a get names no page a miss (a good record is not dropped),
    a set stores nothing; the metrics are as before."""
    b = create_backend("file", root=tmp_path / "l3", native=native)
    good = list(torch.randint(0, 256, (2, 64), dtype=torch.uint8).unbind(0))
    assert b.set([PoolTransfer("kv", H[:2], good)]).all_ok
    before = b.metrics.snapshot()
    for call, keys in ((b.set, H[2:4]), (b.get, H[:2])):
        with pytest.raises(error, match=match):
            call([PoolTransfer("kv", keys, make())])
    assert b.contains("kv", H[:4]) == [True, True, False, False]
    assert b.metrics.snapshot() == before


@pytest.mark.parametrize(
    ("offsets", "sizes", "error", "match"),
    [
        (np.array([0, 100]), (10,), ValueError, "shape"),
        (np.array([[0, 5], [100, 105]]), (10,), ValueError, "shape"),
        (np.array([[0.0], [1.0]]), (10,), TypeError, "integers"),
        (np.array([[0], [1]]), (-1,), ValueError, "sizes"),
        (np.array([[0], [1]]), (), ValueError, "sizes"),
        (np.array([[0], [1]]), 10, TypeError, "sizes"),
        (np.array([[0], [1]]), (1.5,), TypeError, "sizes"),
        ("0 1", (10,), TypeError, "integers|offsets"),
    ],
)
def test_malformed_spans_are_refused_when_made(offsets, sizes, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        PageSpans(torch.zeros(64, dtype=torch.uint8), offsets, sizes)


def test_spans_of_another_length_than_the_keys_are_refused(tmp_path: Path) -> None:
    b = create_backend("file", root=tmp_path / "l3")
    spans = PageSpans(torch.zeros(64, dtype=torch.uint8), np.array([[0], [10], [20]]), (5,))
    with pytest.raises(ValueError, match="2 keys but 3 page buffers"):
        b.set([PoolTransfer("kv", H[:2], spans)])
    assert b.contains("kv", H[:3]) == [False] * 3


def test_span_pages_index_slice_and_select_in_order() -> None:
    a = PageSpans(torch.arange(100, dtype=torch.uint8), np.array([[0], [10], [20]]), (3,))
    c = PageSpans(torch.arange(50, dtype=torch.uint8), np.array([[5, 40], [1, 30]]), (2, 4))
    pages = SpanPages([a, c])
    assert len(pages) == 5 and pages.page_bytes() == [3, 3, 3, 6, 6] and pages.nbytes() == 21
    flat = [torch.cat(p).tolist() for p in pages]
    assert flat[1] == [10, 11, 12] and flat[3] == [5, 6, 40, 41, 42, 43]
    assert torch.cat(pages[-1]).tolist() == flat[4]
    picked = pages.select([4, 0, 1, 3])
    assert [torch.cat(p).tolist() for p in picked] == [flat[i] for i in (4, 0, 1, 3)]
    one = SpanPages([a])  # one transfer: runs sliced, picks kept in their order
    assert [torch.cat(p).tolist() for p in one.select(range(1, 3))] == flat[1:3]
    assert [torch.cat(p).tolist() for p in one.select([2, 0])] == [flat[2], flat[0]]
    with pytest.raises(IndexError):
        one.select([3])
    assert [torch.cat(p).tolist() for p in pages[1:4]] == flat[1:4]
    with pytest.raises(IndexError):
        pages[5]
    with pytest.raises(IndexError):
        pages.select([0, 5])


def test_the_host_pools_spans_name_the_bytes_of_its_page_views() -> None:
    from kvtier.runtime.pools.device import MHADevicePool
    from kvtier.runtime.pools.host import HostPool

    dev = MHADevicePool(3, 16 * 8, 2, 8, page_size=4)
    for layout in ("page_first", "page_first_direct"):
        host = HostPool(dev, layout, size=16 * 8, pin=False)
        host.tensor.view(-1).view(torch.uint8).copy_(
            torch.randint(
                0, 256, (host.tensor.numel() * host.tensor.element_size(),), dtype=torch.uint8
            )
        )
        pages = torch.tensor([5, 0, 31, 7], dtype=torch.int64)
        spans = host.page_spans(pages)
        views = host.page_views(pages)
        assert len(spans) == len(views)
        for i, parts in enumerate(views):
            got = spans.page(i)
            assert [p.data_ptr() for p in got] == [p.data_ptr() for p in parts]
            assert [p.numel() for p in got] == [p.numel() for p in parts]
        with pytest.raises(ValueError, match="page 32 outside"):
            host.page_spans(torch.tensor([1, 32]))
    with pytest.raises(ValueError, match="not contiguous"):
        HostPool(dev, "layer_first", size=16 * 8, pin=False).page_spans(torch.tensor([0]))


def test_spans_keep_their_own_offsets() -> None:
    """The offsets are copied and read-only: the caller's array changed after a call checked
    the spans cannot move them."""
    arr = np.array([[0], [64]])
    spans = PageSpans(torch.zeros(128, dtype=torch.uint8), arr, (64,))
    arr[1, 0] = 10**12
    assert spans.offsets.tolist() == [[0], [64]] and not spans.offsets.flags.writeable
    t = torch.tensor([[0], [64]])
    spans = PageSpans(torch.zeros(128, dtype=torch.uint8), t, (64,))
    t[1, 0] = 10**12
    assert spans.offsets.tolist() == [[0], [64]]
    with pytest.raises(ValueError, match="past any buffer"):
        PageSpans(torch.zeros(128, dtype=torch.uint8), np.array([[2**64 - 1]], np.uint64), (1,))
    with pytest.raises(ValueError, match="1-D index array"):
        spans.rows(1)
    with pytest.raises(ValueError, match="1-D index array"):
        spans.rows(np.array([[0, 1]]))


@pytest.mark.parametrize("native", [True, False], ids=["c-loops", "python-loops"])
def test_spans_over_two_storages_in_one_call(tmp_path: Path, native: bool) -> None:
    """Two transfers' spans over two host buffers (two storages): each page from its own."""
    b = create_backend("file", root=tmp_path / "l3", native=native)
    bufs = [torch.randint(0, 256, (room(6, (700, 300)),), dtype=torch.uint8) for _ in range(2)]
    spans = [PageSpans(x, layout(6, (700, 300), 5 + k), (700, 300)) for k, x in enumerate(bufs)]
    assert b.set([PoolTransfer("kv", H[:6], spans[0]), PoolTransfer("swa", H[:6], spans[1])]).all_ok
    outs = [PageSpans(torch.zeros_like(x), sp.offsets, sp.sizes) for x, sp in zip(bufs, spans)]
    got = b.get([PoolTransfer("kv", H[:6], outs[0]), PoolTransfer("swa", H[:6], outs[1])])
    assert got.all_ok
    for out, sp in zip(outs, spans):
        assert all(torch.equal(x, y) for x, y in zip(contents(out), contents(sp)))
    assert b.metrics.snapshot()["bytes.storage.write"] == 12 * 1000


@pytest.mark.parametrize("native", [True, False], ids=["c-loops", "python-loops"])
def test_two_storages_at_one_address_each_serve_their_own_bytes(
    tmp_path: Path, native: bool
) -> None:
    """Two storages that start at one address (tensors over one mapping, of other lengths): a
    part of the longer is served from its own storage, not cut to the shorter (the store kept
    one region per address, so the Python loops wrote a part shorter than its page)."""
    import mmap
    import warnings

    mm = mmap.mmap(-1, 1 << 20)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # frombuffer over a writable mapping
        small = torch.frombuffer(mm, dtype=torch.uint8, count=4096)
        big = torch.frombuffer(mm, dtype=torch.uint8)
    big.copy_(torch.randint(0, 256, (1 << 20,), dtype=torch.uint8))
    b = create_backend("file", root=tmp_path / "l3", native=native)
    for k, form in enumerate(("tensors", "spans")):
        keys = H[2 * k : 2 * k + 2]
        if form == "tensors":
            t = [
                PoolTransfer("a", keys[:1], [small[:1000]]),
                PoolTransfer("b", keys[1:], [big[500000:501000]]),
            ]
        else:
            t = [
                PoolTransfer("a", keys[:1], PageSpans(small, np.array([[0]]), (1000,))),
                PoolTransfer("b", keys[1:], PageSpans(big, np.array([[500000]]), (1000,))),
            ]
        assert b.set(t).all_ok
        out = torch.zeros(1000, dtype=torch.uint8)
        assert b.get([PoolTransfer("b", keys[1:], [out])]).all_ok
        assert torch.equal(out, big[500000:501000])
    b.close()


def test_page_spans_refuse_page_ids_that_are_not_integers() -> None:
    from kvtier.runtime.pools.device import MHADevicePool
    from kvtier.runtime.pools.host import HostPool

    host = HostPool(MHADevicePool(2, 64, 2, 8, page_size=4), "page_first", size=64, pin=False)
    for bad in (torch.tensor([1.7]), torch.tensor([True])):
        with pytest.raises(TypeError, match="integer page ids"):
            host.page_spans(bad)
    assert host.page_spans(torch.tensor([3], dtype=torch.int32)).offsets.tolist() == (
        host.page_spans(torch.tensor([3])).offsets.tolist()
    )


def test_one_transfer_of_more_pages_than_a_mooncake_arena_holds(
    mooncake_backend_fresh, host_arena: torch.Tensor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Mooncake moves a batch in chunks of its header arena (4,096 pages; 8 here): spans sliced
    for each chunk from the right page (review of the spans change: a slice from page 0 passed
    every other test)."""
    from kvtier.storage import mooncake_backend

    monkeypatch.setattr(mooncake_backend, "_ARENA_PAGES", 8)
    n, s = 20, 16
    src, dst = host_arena[: n * s], host_arena[n * s : 2 * n * s]
    src.copy_(torch.randint(0, 256, (n * s,), dtype=torch.uint8))
    dst.fill_(POISON)
    at = (np.arange(n) * s)[:, None]
    keys = H[:n]
    assert mooncake_backend_fresh.set([PoolTransfer("kv", keys, PageSpans(src, at, (s,)))]).all_ok
    assert mooncake_backend_fresh.get([PoolTransfer("kv", keys, PageSpans(dst, at, (s,)))]).all_ok
    assert torch.equal(src, dst)
