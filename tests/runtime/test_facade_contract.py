"""The facade's contract under wrong and awkward inputs from another program.

Every refused call raises ``TypeError`` or ``ValueError`` naming the argument, and leaves the
cache's books exactly as they were: allocators, tree, pins, running requests and counters. After
each refusal the same cache still serves a full request and passes ``check_integrity``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtier.runtime.cache import TieredKVCache
from kvtier.runtime.config import CacheConfig
from kvtier.runtime.pools.mamba import MambaStateSpec

P = 4
SPEC = MambaStateSpec(temporal_shape=(2, 3), conv_shapes=((4, 2),), conv_dtypes=(torch.float32,))


def make_cache(kinds=("full", "swa", "mamba"), policy="write_through", **kw) -> TieredKVCache:
    cfg = CacheConfig(
        layer_kinds=kinds,
        kv_heads=1,
        head_dim=4,
        page_size=P,
        device_tokens=64,
        dtype=torch.float32,
        swa_window=8 if "swa" in kinds else None,
        mamba=SPEC if "mamba" in kinds else None,
        mamba_slots=kw.pop("mamba_slots", 8) if "mamba" in kinds else None,
        host_ratio=4.0,
        write_policy=policy,
        **kw,
    )
    return TieredKVCache(cfg)


def step(cache: TieredKVCache, req, end: int) -> None:
    """One forward step of a model that writes nothing: slots taken, positions marked."""
    cache.begin_step(req, end)
    for layer in range(len(cache.layer_map)):
        cache.wait_layer(layer, [req])
    cache.computed(req, end)


def serve(cache: TieredKVCache, tokens: list[int], new: int = 3):
    """A whole request: match, reserve, prefill by pages, decode, finish."""
    req = cache.match(tokens)
    cache.reserve(req, len(tokens) + new)
    cache.start_loading()
    while req.computed_len < len(tokens) + new:
        c = req.computed_len
        step(cache, req, min(len(tokens) + new, (c // P + 1) * P))
    req.token_ids = list(tokens) + [7] * new
    cache.cache_finished_req(req)
    cache.poll()
    cache.check_integrity()
    return req


def books(cache: TieredKVCache) -> dict:
    """Everything a refused call must leave as it was."""
    t, a = cache.tree, cache.kv_alloc
    out = {
        "kv_free": a.full_available_size() if cache.swa_pool is not None else a.available_size(),
        "host_free": t.full.host_alloc.available_size(),
        "nodes": sorted((n.id, n.pins[:], n.host_pins[:]) for n in t.all_nodes()),
        "evictable": list(t.evictable),
        "protected": list(t.protected),
        "counters": cache.counters.as_dict(),
        "requests": {
            k: (
                r.computed_len,
                r.kv_slots.tolist(),
                r.cache_protected_len,
                r.swa_evicted_seqlen,
                r.released,
                None if r.mamba_slot is None else int(r.mamba_slot),
            )
            for k, r in cache.requests.items()
        },
    }
    if cache.swa_pool is not None:
        out["swa_free"] = a.swa_available_size()
        out["swa_map"] = a.translate(torch.arange(a.size)).tolist()
    if cache.mamba_pool is not None:
        out["mamba_free"] = t.mamba.device_alloc.available_size()
    return out


class Foreign:
    def __repr__(self) -> str:
        return "Foreign()"


# (id, call, exception, message pattern). ``call(cache, live, ctx)`` gets a cache, a running
# request ``live`` with 8 computed positions and 16 reserved, and ``ctx`` with an aborted, a
# finished and another cache's request.
BAD_CALLS = [
    ("match-str", lambda c, r, x: c.match("hello"), TypeError, "token_ids"),
    ("match-bytes", lambda c, r, x: c.match(b"\x01\x02"), TypeError, "token_ids"),
    ("match-none", lambda c, r, x: c.match(None), TypeError, "token_ids"),
    ("match-float", lambda c, r, x: c.match(3.0), TypeError, "token_ids"),
    ("match-float-items", lambda c, r, x: c.match([1.0, 2.0]), TypeError, "token_ids"),
    ("match-nested", lambda c, r, x: c.match([[1, 2], [3]]), TypeError, "token_ids"),
    ("match-bool-items", lambda c, r, x: c.match([True, False]), TypeError, "token_ids"),
    ("match-str-items", lambda c, r, x: c.match(["1", "2"]), TypeError, "token_ids"),
    (
        "match-2d-tensor",
        lambda c, r, x: c.match(torch.ones(2, 3, dtype=torch.int64)),
        TypeError,
        "token_ids",
    ),
    ("match-float-tensor", lambda c, r, x: c.match(torch.ones(4)), TypeError, "token_ids"),
    (
        "match-complex32-tensor",
        lambda c, r, x: c.match(torch.zeros(4, dtype=torch.complex32)),
        TypeError,
        "token_ids",
    ),
    (
        "match-meta-tensor",
        lambda c, r, x: c.match(torch.zeros(4, dtype=torch.int64, device="meta")),
        TypeError,
        "token_ids",
    ),
    ("match-bytearray", lambda c, r, x: c.match(bytearray(b"\x01\x02")), TypeError, "token_ids"),
    ("match-memoryview", lambda c, r, x: c.match(memoryview(b"\x01\x02")), TypeError, "token_ids"),
    (
        "match-bool-tensor",
        lambda c, r, x: c.match(torch.ones(4, dtype=torch.bool)),
        TypeError,
        "token_ids",
    ),
    ("match-float-array", lambda c, r, x: c.match(np.ones(4)), TypeError, "token_ids"),
    (
        "match-2d-array",
        lambda c, r, x: c.match(np.ones((2, 2), dtype=np.int64)),
        TypeError,
        "token_ids",
    ),
    ("match-empty", lambda c, r, x: c.match([]), ValueError, "token_ids"),
    ("match-negative", lambda c, r, x: c.match([1, -1, 2]), ValueError, "token_ids"),
    ("match-huge", lambda c, r, x: c.match([1, 2**63]), ValueError, "token_ids"),
    ("match-below-int64", lambda c, r, x: c.match([3, -(2**64), 2]), ValueError, "-18446744"),
    (
        "match-huge-uint64",
        lambda c, r, x: c.match(np.array([2**63], np.uint64)),
        ValueError,
        "2\\*\\*63",
    ),
    ("match-ns-list", lambda c, r, x: c.match([1, 2], namespace=["a"]), TypeError, "namespace"),
    ("match-ns-float", lambda c, r, x: c.match([1, 2], namespace=1.5), TypeError, "namespace"),
    (
        "match-ns-object",
        lambda c, r, x: c.match([1, 2], namespace=Foreign()),
        TypeError,
        "namespace",
    ),
    ("match-ns-set", lambda c, r, x: c.match([1, 2], namespace={"a"}), TypeError, "namespace"),
    (
        "match-ns-tuple-of-set",
        lambda c, r, x: c.match([1, 2], namespace=("a", {"b"})),
        TypeError,
        "namespace",
    ),
    ("match-priority-str", lambda c, r, x: c.match([1, 2], priority="high"), TypeError, "priority"),
    ("match-priority-float", lambda c, r, x: c.match([1, 2], priority=1.5), TypeError, "priority"),
    ("prefetch-str", lambda c, r, x: c.prefetch("abc"), TypeError, "token_ids"),
    ("abort-prefetch-none", lambda c, r, x: c.abort_prefetch(None), TypeError, "prefetch"),
    ("reserve-negative", lambda c, r, x: c.reserve(r, -4), ValueError, "total_tokens"),
    ("reserve-float", lambda c, r, x: c.reserve(r, 20.0), TypeError, "total_tokens"),
    ("reserve-str", lambda c, r, x: c.reserve(r, "20"), TypeError, "total_tokens"),
    ("reserve-bool", lambda c, r, x: c.reserve(r, True), TypeError, "total_tokens"),
    ("reserve-not-a-request", lambda c, r, x: c.reserve(object(), 4), TypeError, "req"),
    ("reserve-aborted", lambda c, r, x: c.reserve(x["aborted"], 20), ValueError, "aborted"),
    ("reserve-finished", lambda c, r, x: c.reserve(x["finished"], 20), ValueError, "finished"),
    ("reserve-foreign", lambda c, r, x: c.reserve(x["foreign"], 20), ValueError, "req"),
    ("computed-beyond-reserved", lambda c, r, x: c.computed(r, 17), ValueError, "n_tokens"),
    ("computed-backwards", lambda c, r, x: c.computed(r, 4), ValueError, "n_tokens"),
    ("computed-negative", lambda c, r, x: c.computed(r, -1), ValueError, "n_tokens"),
    ("computed-float", lambda c, r, x: c.computed(r, 9.0), TypeError, "n_tokens"),
    ("computed-without-swa-slots", lambda c, r, x: c.computed(r, 12), ValueError, "begin_step"),
    ("computed-aborted", lambda c, r, x: c.computed(x["aborted"], 8), ValueError, "aborted"),
    ("begin-step-beyond", lambda c, r, x: c.begin_step(r, 17), ValueError, "end"),
    ("begin-step-backwards", lambda c, r, x: c.begin_step(r, 3), ValueError, "end"),
    ("begin-step-str", lambda c, r, x: c.begin_step(r, "12"), TypeError, "end"),
    ("swa-slots-finished", lambda c, r, x: c.swa_slots(x["finished"]), ValueError, "finished"),
    ("wait-layer-negative", lambda c, r, x: c.wait_layer(-1), ValueError, "layer"),
    ("wait-layer-too-big", lambda c, r, x: c.wait_layer(99), ValueError, "layer"),
    ("wait-layer-str", lambda c, r, x: c.wait_layer("0"), TypeError, "layer"),
    ("wait-layer-float", lambda c, r, x: c.wait_layer(1.0), TypeError, "layer"),
    ("wait-layer-bool", lambda c, r, x: c.wait_layer(True), TypeError, "layer"),
    ("wait-layer-foreign-req", lambda c, r, x: c.wait_layer(0, [x["foreign"]]), ValueError, "req"),
    ("wait-layer-one-request", lambda c, r, x: c.wait_layer(0, r), TypeError, "requests"),
    ("wait-layer-requests-none", lambda c, r, x: c.wait_layer(0, None), TypeError, "requests"),
    (
        "finish-token-ids-none",
        lambda c, r, x: (setattr(r, "token_ids", None), c.cache_finished_req(r)),
        TypeError,
        "req.token_ids",
    ),
    (
        "unfinished-token-ids-int",
        lambda c, r, x: (setattr(r, "token_ids", 5), c.cache_unfinished_req(r)),
        TypeError,
        "req.token_ids",
    ),
    ("evict-negative", lambda c, r, x: c.evict(-8), ValueError, "tokens"),
    ("evict-float", lambda c, r, x: c.evict(1.5), TypeError, "tokens"),
    ("evict-str", lambda c, r, x: c.evict("8"), TypeError, "tokens"),
    ("finish-foreign", lambda c, r, x: c.cache_finished_req(x["foreign"]), ValueError, "req"),
    ("finish-aborted", lambda c, r, x: c.cache_finished_req(x["aborted"]), ValueError, "aborted"),
    ("finish-twice", lambda c, r, x: c.cache_finished_req(x["finished"]), ValueError, "finished"),
    (
        "finish-short-token-ids",
        lambda c, r, x: (setattr(r, "token_ids", r.token_ids[:5]), c.cache_finished_req(r)),
        ValueError,
        "token_ids",
    ),
    (
        "finish-str-token-id",
        lambda c, r, x: (
            setattr(r, "token_ids", r.token_ids[:11] + ["x"]),
            c.cache_finished_req(r),
        ),
        TypeError,
        "req.token_ids",
    ),
    (
        "unfinished-float-token-id",
        lambda c, r, x: (
            setattr(r, "token_ids", r.token_ids[:8] + [3.5, 4, 5, 6]),
            c.cache_unfinished_req(r),
        ),
        TypeError,
        "req.token_ids",
    ),
    (
        "finish-2d-token-tensor",
        lambda c, r, x: (
            setattr(r, "token_ids", torch.ones(2, 6, dtype=torch.int64)),
            c.cache_finished_req(r),
        ),
        TypeError,
        "req.token_ids",
    ),
    (
        "unfinished-finished",
        lambda c, r, x: c.cache_unfinished_req(x["finished"]),
        ValueError,
        "finished",
    ),
    ("abort-twice", lambda c, r, x: c.abort(x["aborted"]), ValueError, "aborted"),
    ("abort-foreign", lambda c, r, x: c.abort(x["foreign"]), ValueError, "req"),
    ("abort-not-a-request", lambda c, r, x: c.abort("req-1"), TypeError, "req"),
]


@pytest.fixture(scope="module")
def other_cache():
    return make_cache()


@pytest.mark.parametrize("name, call, exc, pattern", BAD_CALLS, ids=[b[0] for b in BAD_CALLS])
def test_refused_call_leaves_books_unchanged(name, call, exc, pattern, other_cache):
    cache = make_cache()
    prompt = list(range(1, 11))
    serve(cache, prompt)  # something cached, pinned by the next match
    finished = serve(cache, [50, 51, 52, 53, 54])
    aborted = cache.match([60, 61, 62, 63, 64, 65])
    cache.abort(aborted)
    foreign = other_cache.match([1, 2, 3, 4, 5])
    live = cache.match(prompt + [11, 12])
    cache.reserve(live, 16)
    cache.start_loading()
    step(cache, live, 8)
    ctx = {"aborted": aborted, "finished": finished, "foreign": foreign}
    token_ids = list(live.token_ids)
    before = books(cache)
    with pytest.raises(exc, match=pattern):
        call(cache, live, ctx)
    live.token_ids = token_ids  # the one call that edits the request by hand
    assert books(cache) == before, f"{name}: a refused call changed the books"
    cache.check_integrity()
    # the cache and the live request still work
    step(cache, live, 12)
    live.token_ids = prompt + [11, 12]
    cache.cache_finished_req(live)
    cache.check_integrity()
    again = serve(cache, prompt + [11, 12, 13, 14])
    assert again.device_hit >= 8
    other_cache.abort(foreign)
    assert len(BAD_CALLS) >= 47


@pytest.mark.parametrize(
    "convert",
    [
        list,
        tuple,
        torch.tensor,
        lambda t: torch.tensor(t, dtype=torch.int32),
        np.array,
        lambda t: np.array(t, dtype=np.uint16),
        lambda t: [np.int64(x) for x in t],
    ],
    ids=["list", "tuple", "tensor", "int32-tensor", "array", "uint16-array", "numpy-ints"],
)
def test_match_accepts_integer_tensors_and_arrays_as_lists(convert):
    cache = make_cache(("full",))
    prompt = list(range(1, 14))
    serve(cache, prompt)
    want = cache.match(prompt)
    cache.abort(want)
    got = cache.match(convert(prompt))
    assert got.device_hit == want.device_hit == 12
    assert got.token_ids == prompt and all(type(t) is int for t in got.token_ids)
    cache.abort(got)
    cache.check_integrity()


def test_reserve_refused_for_capacity_keeps_books():
    cache = make_cache()
    serve(cache, list(range(1, 30)))
    req = cache.match(list(range(1, 30)) + [5])
    before = books(cache)
    with pytest.raises(RuntimeError, match="device KV pool exhausted"):
        cache.reserve(req, 10_000)
    assert books(cache) == before
    cache.abort(req)
    cache.check_integrity()


@pytest.mark.parametrize("inserts, backed_up", [(1, False), (2, True)])
def test_selective_backs_up_on_the_second_insert(inserts, backed_up):
    """``write_through_selective`` counts the insert that creates a node."""
    cache = make_cache(("full",), policy="write_through_selective")
    prompt = list(range(1, 18))  # 16 cacheable tokens after 3 generated
    for _ in range(inserts):
        serve(cache, prompt, new=3)
    cache.drain()
    m = cache.tree.match_prefix(prompt)
    node = m.best_match_node
    assert node is not cache.tree.root
    assert (node.host_value[0] is not None) == backed_up
    assert cache.controller.stats.backups == (1 if backed_up else 0)
    cache.check_integrity()


def test_finished_request_token_ids_as_tensor_or_array():
    """``req.token_ids`` handed back as an integer tensor or array is taken as ``match`` takes
    token ids; a list stays the caller's own object through a checkpoint."""
    cache = make_cache()
    prompt = list(range(1, 11))
    serve(cache, prompt)
    for convert in (torch.tensor, np.array):
        req = cache.match(prompt + [11, 12])
        cache.reserve(req, 16)
        cache.start_loading()
        step(cache, req, 12)
        own = req.token_ids
        cache.cache_unfinished_req(req)
        assert req.token_ids is own
        req.token_ids = convert(prompt + [11, 12])
        cache.cache_finished_req(req)
        cache.poll()
        cache.check_integrity()
        again = cache.match(prompt + [11, 12, 13])
        assert again.device_hit == 12
        cache.abort(again)


PREFIX_EDITS = [
    ("finish-changed-cached-prefix", lambda t: [99] * 12, False, r"positions \[0, 8\) differ"),
    ("unfinished-changed-page", lambda t: [1, 2, 3, 9] + t[4:], True, r"positions \[0, 8\) differ"),
    ("finish-huge-id-past-prefix", lambda t: t[:11] + [2**64], False, r"token_ids\[8:\]: token"),
    ("unfinished-none-past-prefix", lambda t: t[:9] + [None, 1, 2], True, r"token_ids\[8:\]"),
]


@pytest.mark.parametrize(
    "name, edit, unfinished, pattern", PREFIX_EDITS, ids=[e[0] for e in PREFIX_EDITS]
)
def test_token_ids_edited_in_the_cached_prefix_are_refused(name, edit, unfinished, pattern):
    """Token ids handed back for positions whose slots the tree owns must be the ones the
    request was matched on (else the tree would give a second node those slots: a double free
    at the next eviction), and every later id must be one ``match`` accepts."""
    cache = make_cache(("full",))
    prompt = list(range(1, 11))
    serve(cache, prompt)
    live = cache.match(prompt + [11, 12])
    assert live.cache_protected_len == 8
    cache.reserve(live, 16)
    cache.start_loading()
    step(cache, live, 12)
    token_ids = list(live.token_ids)
    before = books(cache)
    live.token_ids = edit(token_ids)
    with pytest.raises((ValueError, TypeError), match=pattern):
        (cache.cache_unfinished_req if unfinished else cache.cache_finished_req)(live)
    assert books(cache) == before, f"{name}: a refused call changed the books"
    cache.check_integrity()
    live.token_ids = token_ids
    cache.cache_finished_req(live)
    cache.poll()
    cache.check_integrity()
    assert cache.evict(64) >= 0
    cache.check_integrity()


def test_requests_compare_and_hash_by_identity():
    """Two running requests for one prompt are two requests: engines keep them in lists, sets
    and dicts (value equality over their slot tensors raised on ``in`` and ``remove``)."""
    cache = make_cache(("full",))
    prompt = list(range(1, 10))
    a, b = cache.match(prompt), cache.match(prompt)
    cache.reserve(a, 16)
    cache.reserve(b, 20)
    running = [a, b]
    assert b in running and running.index(b) == 1 and a != b and len({a, b}) == 2
    running.remove(a)
    assert running == [b]
    for req in (a, b):
        cache.abort(req)
    cache.check_integrity()


@pytest.mark.parametrize("how", ["list", "generator"])
def test_wait_layer_takes_requests_as_any_iterable(how):
    """The matched prefix's Mamba state reaches the request's live slot whether ``requests``
    is a list or a one-shot iterator (the checks used to use the iterator up: no copy)."""
    cache = make_cache(("full", "mamba"))
    states = cache.mamba_pool.tensors[0]
    prompt = list(range(1, 10))
    first = cache.match(prompt + [7, 7, 7])
    cache.reserve(first, 12)
    cache.start_loading()
    cache.begin_step(first, 12)
    for layer in range(2):
        cache.wait_layer(layer, [first])
    states[:, int(first.mamba_slot)] = 42.0  # the model writes its state
    cache.computed(first, 12)
    first.token_ids = prompt + [7, 7, 7]
    cache.cache_finished_req(first)
    cache.poll()
    req = cache.match(prompt + [7, 7, 7, 5])
    assert req.cached_len == 12
    states[:, int(req.mamba_slot)] = -1.0  # a stale state in the request's own slot
    cache.reserve(req, 16)
    cache.start_loading()
    cache.begin_step(req, 13)
    for layer in range(2):
        cache.wait_layer(layer, [req] if how == "list" else (r for r in [req]))
    assert torch.all(states[:, int(req.mamba_slot)] == 42.0)
    cache.abort(req)
    cache.check_integrity()


def test_match_takes_the_requests_state_slot_before_a_load_back():
    """A host hit with a Mamba state when one state slot is left: the request gets that slot
    (its live state) and the load-back, which needs a slot of its own, is skipped and counted.
    It used to commit the load-back (KV slots, a queued copy, the last slot) and then raise
    for want of the request's slot, leaving the books changed and no request."""
    cache = make_cache(("full", "mamba"), mamba_slots=2)
    prompt = list(range(1, 18))
    serve(cache, prompt)
    cache.drain()
    cache.evict(10**6)
    cache.poll()
    cache.check_integrity()
    hold = cache.match([100, 101, 102])  # a running request holds one of the two slots
    skipped = cache.counters.load_backs_skipped
    req = cache.match(prompt + [7, 7, 7, 9])
    assert req.mamba_slot is not None and req.host_hit == 0
    assert cache.counters.load_backs_skipped == skipped + 1
    cache.check_integrity()
    for r in (req, hold):
        cache.abort(r)
    again = cache.match(prompt + [7, 7, 7, 9])  # with slots free, the host hit loads back
    assert again.host_hit > 0
    cache.abort(again)
    cache.drain()
    cache.check_integrity()


def test_closed_cache_refuses_work_and_drain_returns(tmp_path):
    """After ``close`` (the L3 threads stopped), calls that would start work raise
    ``ValueError`` naming the closed cache instead of queueing L3 jobs no thread will run
    (``drain`` then waited for them forever); ``drain`` and a second ``close`` return."""
    import threading

    from kvtier.runtime.config import StorageConfig

    cache = make_cache(
        ("full",),
        model_id="m@1",
        storage=StorageConfig(backend="file", backend_config={"root": str(tmp_path / "l3")}),
    )
    prompt = list(range(1, 18))
    live = cache.match(prompt + [1])
    serve(cache, prompt)
    cache.drain()
    cache.close()
    calls = {  # name -> a call that must be refused
        "match": lambda: cache.match(prompt),
        "prefetch": lambda: cache.prefetch(prompt + [1, 2, 3, 4, 5]),
        "pin": lambda: cache.pin(prompt, ttl_s=10.0),
        "start_loading": cache.start_loading,
        "poll": cache.poll,
        "reserve": lambda: cache.reserve(live, 20),
        "finish": lambda: cache.cache_finished_req(live),
        "abort": lambda: cache.abort(live),
        "attach_storage": lambda: cache.attach_storage(
            StorageConfig(backend="file", backend_config={"root": str(tmp_path / "l3b")})
        ),
        "detach_storage": cache.detach_storage,
        "clear_storage": cache.clear_storage,
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="closed"):
            call()
            pytest.fail(f"{name} after close was accepted")
    done = threading.Event()
    t = threading.Thread(target=lambda: (cache.drain(), done.set()), daemon=True)
    t.start()
    assert done.wait(10.0), "drain after close did not return"
    cache.close()


def test_abort_prefetch_refuses_another_caches_prefetch(tmp_path):
    """``abort_prefetch`` with a prefetch another cache started raises ``ValueError`` naming
    ``prefetch`` and leaves it alone: it used to cancel it in its own cache (whose match then
    lost the host hit) before failing on its own queue."""
    from kvtier.runtime.config import StorageConfig

    def l3_cache(root):
        storage = StorageConfig(
            backend="file",
            backend_config={"root": str(root)},
            prefetch_min_tokens=4,
            prefetch_policy="wait_complete",
        )
        return make_cache(("full",), model_id="m@1", storage=storage)

    prompt = list(range(1, 18))
    writer = l3_cache(tmp_path / "a")
    serve(writer, prompt)
    writer.drain()
    writer.close()
    owner, other = l3_cache(tmp_path / "a"), l3_cache(tmp_path / "b")
    pf = owner.prefetch(prompt + [5])
    assert pf is not None
    before = books(owner)
    with pytest.raises(ValueError, match="prefetch: not one of this cache's"):
        other.abort_prefetch(pf)
    assert not pf.cancel.is_set() and books(owner) == before
    owner.drain()
    assert pf.done
    req = owner.match(prompt + [5])
    assert req.host_hit == 16
    owner.abort(req)
    owner.check_integrity()
    other.check_integrity()
    for c in (owner, other):
        c.close()


def test_namespace_changed_after_match_is_refused():
    """The cached prefix a request holds belongs to the namespace it was matched in: handing
    it back under another namespace would give a second node the tree's own slots (a double
    free at the next eviction), so it is refused and nothing changes."""
    cache = make_cache(("full",))
    prompt = list(range(1, 11))
    serve_ns = cache.match(prompt, namespace="a")
    cache.reserve(serve_ns, 12)
    cache.start_loading()
    step(cache, serve_ns, 12)
    serve_ns.token_ids = prompt + [1, 2]
    cache.cache_finished_req(serve_ns)
    cache.poll()
    live = cache.match(prompt + [11, 12], namespace="a")
    assert live.cache_protected_len == 8
    cache.reserve(live, 16)
    cache.start_loading()
    step(cache, live, 12)
    before = books(cache)
    live.namespace = "b"
    with pytest.raises(ValueError, match="req.namespace: 'b'"):
        cache.cache_finished_req(live)
    assert books(cache) == before
    live.namespace = "a"
    cache.cache_finished_req(live)
    cache.poll()
    cache.evict(64)
    cache.check_integrity()


def test_aborted_requests_queued_load_is_released_by_poll():
    """A host hit commits device slots and queues their load; the request is aborted before any
    batch runs (its reserve failed for capacity, as the README's recovery path goes). The poll
    after next starts the queued load (one step passed with no ``start_loading``) and its books
    are released when it lands: the slots are evictable again and a new request can reserve
    them. They stayed locked until the next ``start_loading`` (found in a user trial). A poll
    between a batch's match and its ``start_loading`` leaves the load to the batch."""
    cache = make_cache(kinds=("full",))
    prompt = list(range(1, 30))
    serve(cache, prompt)
    cache.drain()
    cache.evict(10**6)
    cache.poll()
    req = cache.match(prompt + [5])
    assert req.host_hit > 0
    with pytest.raises(RuntimeError, match="device KV pool exhausted"):
        cache.reserve(req, 10_000)
    cache.abort(req)
    cache.poll()  # the step the load was queued in: still the batch's to start
    assert cache.controller._queued
    cache.poll()
    cache.check_integrity()
    assert not cache.controller._queued and not cache.controller._loads
    assert cache.evict(10**6) >= req.host_hit
    assert cache.kv_alloc.available_size() == cache.config.device_tokens
    other = cache.match(list(range(100, 160)))
    cache.reserve(other, 64)  # the whole pool: nothing is left locked
    cache.abort(other)
    cache.check_integrity()
    # A batch that polls between its match and its start_loading keeps its load.
    cache.evict(10**6)
    cache.poll()
    req = cache.match(prompt + [5])
    assert req.host_hit > 0
    cache.poll()
    assert cache.start_loading(), "the poll started the batch's load"
    cache.abort(req)
    cache.poll()
    cache.check_integrity()


def test_evicted_tokens_counts_a_load_backs_evictions_too():
    """``evicted_tokens`` counts every FULL device token evicted, also those a load-back
    evicts to make room (it counted only ``evict()`` and ``reserve``'s)."""
    cache = make_cache(kinds=("full",))

    def on_device() -> int:
        return sum(
            len(n.key) for n in cache.tree.all_nodes() if n.parent and n.value[0] is not None
        )

    a, b = list(range(1, 30)), list(range(100, 160))
    serve(cache, a)
    cache.drain()
    cache.evict(10**6)
    cache.poll()
    serve(cache, b)  # fills the device
    cache.drain()
    before, counted = on_device(), cache.metrics()["evicted_tokens"]
    req = cache.match(a + [5])  # its load-back evicts part of b
    assert req.host_hit > 0
    evicted = before - (on_device() - req.host_hit)
    assert evicted > 0
    assert cache.metrics()["evicted_tokens"] - counted == evicted
    cache.abort(req)
    cache.poll()
    cache.check_integrity()
