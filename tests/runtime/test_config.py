"""CacheConfig, StorageConfig and MambaStateSpec refuse every bad field with the right exception
type and a message naming the field; valid edge values pass; a self-defeating L3 set-up warns."""

from __future__ import annotations

import dataclasses
import re
import warnings

import pytest
import torch

from kvtier.kernels.kv_transfer import TransferKnobs
from kvtier.runtime.config import CacheConfig, KVTierConfigWarning, StorageConfig
from kvtier.runtime.pools.mamba import MambaStateSpec

P = 4
SPEC = MambaStateSpec(temporal_shape=(2, 3), conv_shapes=((4, 2),))
BASE = {
    "layer_kinds": ("full", "swa", "mamba"),
    "kv_heads": 1,
    "head_dim": 4,
    "page_size": P,
    "device_tokens": 32,
    "dtype": torch.float32,
    "swa_window": 8,
    "mamba": SPEC,
    "mamba_slots": 4,
    "host_ratio": 2.0,
}
NAN, INF = float("nan"), float("inf")

# (id, overrides of BASE, exception, pattern the message must contain)
CACHE_CASES = [
    ("layer_kinds-str", {"layer_kinds": "full"}, TypeError, "layer_kinds"),
    ("layer_kinds-int", {"layer_kinds": 3}, TypeError, "layer_kinds"),
    ("layer_kinds-elem", {"layer_kinds": ("full", 1)}, TypeError, r"layer_kinds\[1\]"),
    ("kv_heads-float", {"kv_heads": 1.0}, TypeError, "kv_heads: .*1.0"),
    ("head_dim-str", {"head_dim": "4"}, TypeError, "head_dim: .*'4'"),
    ("page_size-float", {"page_size": 3.5}, TypeError, "page_size: .*3.5"),
    ("page_size-bool", {"page_size": True}, TypeError, "page_size: .*True"),
    ("page_size-zero", {"page_size": 0}, ValueError, "page_size .*0"),
    ("page_size-big", {"page_size": 512}, ValueError, "page_size .*512"),
    ("device_tokens-float", {"device_tokens": 64.0}, TypeError, "device_tokens: .*64.0"),
    ("device_tokens-none", {"device_tokens": None}, TypeError, "device_tokens: .*None"),
    ("device_tokens-ragged", {"device_tokens": 30}, ValueError, "device_tokens=30"),
    ("mla_dim-float", {"layer_kinds": ("full",), "mla_dim": 8.0}, TypeError, "mla_dim: .*8.0"),
    ("swa_window-str", {"swa_window": "8"}, TypeError, "swa_window: .*'8'"),
    ("swa_window-zero", {"swa_window": 0}, ValueError, "swa_window .*0"),
    (
        "swa_window-neg-no-swa",
        {"layer_kinds": ("full",), "swa_window": -1},
        ValueError,
        "swa_window .*-1",
    ),
    ("swa_tokens-float", {"swa_tokens": 16.0}, TypeError, "swa_tokens: .*16.0"),
    ("swa_tokens-small", {"swa_tokens": 8}, ValueError, "swa_tokens=8.*swa_window=8"),
    (
        "swa-device-small",
        {"device_tokens": 16, "host_ratio": 2.0, "swa_window": 13},
        ValueError,
        "swa_tokens=None.*swa_window=13",
    ),
    ("mamba_slots-bool", {"mamba_slots": True}, TypeError, "mamba_slots: .*True"),
    ("mamba_slots-zero", {"mamba_slots": 0}, ValueError, "mamba_slots .*0"),
    (
        "host_tokens-float",
        {"host_ratio": None, "host_tokens": 64.0},
        TypeError,
        "host_tokens: .*64.0",
    ),
    ("host_ratio-nan", {"host_ratio": NAN}, ValueError, "host_ratio .*nan"),
    ("host_ratio-inf", {"host_ratio": INF}, ValueError, "host_ratio .*inf"),
    ("host_ratio-huge-int", {"host_ratio": 10**400}, ValueError, "host_ratio must be finite"),
    ("host_ratio-neg", {"host_ratio": -2.0}, ValueError, "host_ratio .*-2.0"),
    ("host_ratio-zero", {"host_ratio": 0.0}, ValueError, "host_ratio .*0.0"),
    ("host_ratio-str", {"host_ratio": "2"}, TypeError, "host_ratio: .*'2'"),
    ("host-both", {"host_tokens": 64}, ValueError, "host_tokens=64, host_ratio=2.0"),
    (
        "load_back_min-float",
        {"load_back_min_tokens": 1.5},
        TypeError,
        "load_back_min_tokens: .*1.5",
    ),
    ("load_back_min-neg", {"load_back_min_tokens": -1}, ValueError, "load_back_min_tokens .*-1"),
    ("load_back_max-str", {"load_back_max_tokens": "8"}, TypeError, "load_back_max_tokens: .*'8'"),
    ("dtype-str", {"dtype": "bfloat16"}, TypeError, "dtype: .*'bfloat16'.*torch.bfloat16"),
    ("dtype-int", {"dtype": 16}, TypeError, "dtype: .*16"),
    ("dtype-int32", {"dtype": torch.int32}, ValueError, "dtype: .*int32"),
    ("dtype-bool", {"dtype": torch.bool}, ValueError, "dtype: .*bool"),
    ("indexer-str", {"indexer": "yes"}, TypeError, "indexer: .*'yes'"),
    ("write_policy-none", {"write_policy": None}, TypeError, "write_policy: .*None"),
    ("host_layout-int", {"host_layout": 1}, TypeError, "host_layout: .*1"),
    ("mamba_host_layout-none", {"mamba_host_layout": None}, TypeError, "mamba_host_layout"),
    ("knobs-dict", {"knobs": {"num_programs": 2}}, TypeError, "knobs: .*num_programs"),
    ("model_id-int", {"model_id": 7}, TypeError, "model_id: .*7"),
    ("storage-dict", {"storage": {"backend": "file"}}, TypeError, "storage: .*'file'"),
    ("mamba-tuple", {"mamba": ((2, 3), ((4, 2),))}, TypeError, r"mamba: .*\(2, 3\)"),
    ("device-int", {"device": 0}, TypeError, "device: .*0"),
    ("device-bad-str", {"device": "gpu0"}, ValueError, "device: .*'gpu0'"),
    ("device-meta", {"device": "meta"}, ValueError, "device: .*'meta'"),
    ("device-cuda-index", {"device": "cuda:99"}, ValueError, "device: .*'cuda:99'"),
]


@pytest.mark.parametrize(
    "overrides, exc, pattern", [c[1:] for c in CACHE_CASES], ids=[c[0] for c in CACHE_CASES]
)
def test_cache_config_refuses(overrides: dict, exc: type[Exception], pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        CacheConfig(**{**BASE, **overrides})


def test_cuda_device_refused_without_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ValueError, match="device: 'cuda' requested, but CUDA is not available"):
        CacheConfig(**{**BASE, "device": "cuda"})
    with pytest.raises(ValueError, match="device: device.type='cuda'.* not available"):
        CacheConfig(**{**BASE, "device": torch.device("cuda")})


STORAGE_CASES = [
    ("backend-empty", {"backend": ""}, ValueError, "backend: .*''"),
    ("backend-none", {"backend": None}, TypeError, "backend: .*None"),
    (
        "backend_config-list",
        {"backend_config": [("root", "/x")]},
        TypeError,
        "backend_config: .*root",
    ),
    ("namespace_key-int", {"namespace_key": 3}, TypeError, "namespace_key: .*3"),
    (
        "prefetch_policy-unknown",
        {"prefetch_policy": "eager"},
        ValueError,
        "prefetch_policy: .*'eager'",
    ),
    ("prefetch_policy-none", {"prefetch_policy": None}, TypeError, "prefetch_policy: .*None"),
    (
        "timeout_base-nan",
        {"prefetch_timeout_base_s": NAN},
        ValueError,
        "prefetch_timeout_base_s .*nan",
    ),
    (
        "timeout_base-inf",
        {"prefetch_timeout_base_s": INF},
        ValueError,
        "prefetch_timeout_base_s .*inf",
    ),
    (
        "timeout_base-neg",
        {"prefetch_timeout_base_s": -1.0},
        ValueError,
        "prefetch_timeout_base_s .*-1.0",
    ),
    (
        "timeout_base-str",
        {"prefetch_timeout_base_s": "1"},
        TypeError,
        "prefetch_timeout_base_s: .*'1'",
    ),
    (
        "timeout_per_ki-nan",
        {"prefetch_timeout_per_ki_token_s": NAN},
        ValueError,
        "prefetch_timeout_per_ki_token_s .*nan",
    ),
    ("min_tokens-float", {"prefetch_min_tokens": 16.0}, TypeError, "prefetch_min_tokens: .*16.0"),
    ("min_tokens-neg", {"prefetch_min_tokens": -1}, ValueError, "prefetch_min_tokens .*-1"),
    ("occupancy-nan", {"host_occupancy_limit": NAN}, ValueError, "host_occupancy_limit .*nan"),
    ("occupancy-big", {"host_occupancy_limit": 1.5}, ValueError, "host_occupancy_limit .*1.5"),
    ("occupancy-bool", {"host_occupancy_limit": True}, TypeError, "host_occupancy_limit: .*True"),
    ("write_to_storage-int", {"write_to_storage": 1}, TypeError, "write_to_storage: .*1"),
    ("rank_replicated-str", {"rank_replicated": "no"}, TypeError, "rank_replicated: .*'no'"),
    ("prefill_rate-inf", {"prefill_tokens_per_s": INF}, ValueError, "prefill_tokens_per_s .*inf"),
    ("prefill_rate-zero", {"prefill_tokens_per_s": 0}, ValueError, "prefill_tokens_per_s .*0"),
    ("gbps-nan", {"assumed_storage_gbps": NAN}, ValueError, "assumed_storage_gbps .*nan"),
    ("retries-bool", {"backup_retries": False}, TypeError, "backup_retries: .*False"),
    ("retries-neg", {"backup_retries": -1}, ValueError, "backup_retries .*-1"),
    ("batch_pages-float", {"batch_pages": 2.0}, TypeError, "batch_pages: .*2.0"),
    ("batch_pages-zero", {"batch_pages": 0}, ValueError, "batch_pages .*0"),
    # The backend's name, keys and values on construction, not inside TieredKVCache (a user
    # trial: all three were accepted, and the cache's errors did not name backend_config).
    (
        "backend_config-unknown-key",
        {"backend_config": {"root": "/x", "capacity": 5}},
        TypeError,
        "backend_config: 'capacity' is not a setting of the 'file' backend.*capacity_bytes",
    ),
    (
        "backend_config-bad-value",
        {"backend_config": {"root": "/x", "capacity_bytes": -1}},
        ValueError,
        "backend_config: capacity_bytes .*-1",
    ),
    (
        "backend_config-mooncake-key",
        {"backend": "mooncake", "backend_config": {"root": "/x"}},
        TypeError,
        "backend_config: 'root' is not a setting of the 'mooncake' backend",
    ),
]


@pytest.mark.parametrize(
    "kwargs, exc, pattern", [c[1:] for c in STORAGE_CASES], ids=[c[0] for c in STORAGE_CASES]
)
def test_storage_config_refuses(kwargs: dict, exc: type[Exception], pattern: str) -> None:
    with pytest.raises(exc, match=pattern):
        StorageConfig(**kwargs)


MAMBA_CASES = [
    ("temporal-neg", {"temporal_shape": (2, -3)}, ValueError, r"temporal_shape\[1\]: .*-3"),
    ("temporal-zero", {"temporal_shape": (0, 3)}, ValueError, r"temporal_shape\[0\]: .*0"),
    ("temporal-str", {"temporal_shape": "23"}, TypeError, "temporal_shape: .*'23'"),
    ("temporal-int", {"temporal_shape": 6}, TypeError, "temporal_shape: .*6"),
    ("temporal-float-dim", {"temporal_shape": (2, 3.0)}, TypeError, r"temporal_shape\[1\]: .*3.0"),
    ("temporal-bool-dim", {"temporal_shape": (True, 3)}, TypeError, r"temporal_shape\[0\]: .*True"),
    ("conv-empty", {"conv_shapes": ()}, ValueError, "conv_shapes: .*at least one"),
    ("conv-not-nested", {"conv_shapes": (4, 2)}, TypeError, r"conv_shapes\[0\]: .*4"),
    ("conv-zero", {"conv_shapes": ((4, 2), (5, 0))}, ValueError, r"conv_shapes\[1\]\[1\]: .*0"),
    ("conv-str-dim", {"conv_shapes": ((4, "2"),)}, TypeError, r"conv_shapes\[0\]\[1\]: .*'2'"),
    ("conv-str", {"conv_shapes": "42"}, TypeError, "conv_shapes: .*'42'"),
    ("temporal_dtype-str", {"temporal_dtype": "float32"}, TypeError, "temporal_dtype: .*'float32'"),
    (
        "conv_dtypes-elem",
        {"conv_dtypes": ("bfloat16",)},
        TypeError,
        r"conv_dtypes\[0\]: .*'bfloat16'",
    ),
    ("conv_dtypes-bare", {"conv_dtypes": torch.float32}, TypeError, "conv_dtypes: .*float32"),
    (
        "conv_dtypes-count",
        {"conv_dtypes": (torch.float32, torch.float32)},
        ValueError,
        "conv_dtypes: 2 dtypes for 1 conv states",
    ),
]


@pytest.mark.parametrize(
    "overrides, exc, pattern", [c[1:] for c in MAMBA_CASES], ids=[c[0] for c in MAMBA_CASES]
)
def test_mamba_spec_refuses(overrides: dict, exc: type[Exception], pattern: str) -> None:
    kwargs = {"temporal_shape": (2, 3), "conv_shapes": ((4, 2),), **overrides}
    with pytest.raises(exc, match=pattern):
        MambaStateSpec(**kwargs)


def test_mamba_spec_normalises_lists() -> None:
    spec = MambaStateSpec(temporal_shape=[2, 3], conv_shapes=[[4, 2]])
    assert spec == SPEC and hash(spec) == hash(SPEC)
    assert spec.conv_dtypes == (torch.bfloat16,)
    assert spec.component_shapes() == [((2, 3), torch.float32), ((4, 2), torch.bfloat16)]


# -- valid edge values --------------------------------------------------------------------------


@pytest.mark.parametrize("page_size", [1, 256])
def test_page_size_bounds_accepted(page_size: int) -> None:
    cfg = CacheConfig(**{**BASE, "page_size": page_size, "device_tokens": 2 * 256 + 256})
    assert cfg.page_size == page_size


@pytest.mark.parametrize("window", [8, 7, 5], ids=["whole-pages", "one-short", "ragged"])
def test_swa_tokens_exactly_window_plus_page(window: int) -> None:
    need = -(-window // P) * P + P
    cfg = CacheConfig(**{**BASE, "swa_window": window, "swa_tokens": need})
    assert cfg.swa_device_tokens == need
    with pytest.raises(ValueError, match=f"swa_tokens={need - P}.*swa_window={window}"):
        CacheConfig(**{**BASE, "swa_window": window, "swa_tokens": need - P})


def test_valid_values_and_types() -> None:
    cfg = CacheConfig(
        **{
            **BASE,
            "layer_kinds": ["full", "swa"],
            "host_ratio": 1.0,
            "device": torch.device("cpu"),
            "knobs": TransferKnobs(num_programs=2),
        }
    )
    assert cfg.layer_kinds == ("full", "swa"), "a list of kinds is stored as a tuple"
    assert cfg.host_kv_tokens == cfg.device_tokens
    assert CacheConfig(**{**BASE, "host_ratio": 3}).host_kv_tokens == 96, "an int ratio is fine"
    st = StorageConfig(
        prefetch_timeout_base_s=0,
        prefetch_min_tokens=0,
        backup_retries=0,
        host_occupancy_limit=1,
        prefill_tokens_per_s=1e6,
        batch_pages=1,
    )
    assert st.prefetch_timeout_base_s == 0 and st.batch_pages == 1


def test_replace_validates() -> None:
    cfg = CacheConfig(**BASE)
    assert dataclasses.replace(cfg, page_size=8).page_size == 8
    with pytest.raises(TypeError, match="page_size: .*3.5"):
        dataclasses.replace(cfg, page_size=3.5)
    with pytest.raises(ValueError, match="host_ratio .*nan"):
        dataclasses.replace(cfg, host_ratio=NAN)
    with pytest.raises(ValueError, match="prefetch_timeout_base_s .*inf"):
        dataclasses.replace(StorageConfig(), prefetch_timeout_base_s=INF)
    with pytest.raises(ValueError, match=r"temporal_shape\[0\]: .*-1"):
        dataclasses.replace(SPEC, temporal_shape=(-1,))


# -- the write-through + small host + L3 warning -----------------------------------------------


def _l3_config(**overrides) -> CacheConfig:
    kw = {**BASE, "model_id": "m", "storage": StorageConfig(), "host_ratio": 1.0, **overrides}
    return CacheConfig(**kw)


def test_warns_when_write_through_host_mirrors_device() -> None:
    with pytest.warns(KVTierConfigWarning, match=re.escape("host_ratio >= 2")) as rec:
        _l3_config()
    assert len(rec) == 1
    assert "write_through" in str(rec[0].message) and "32 tokens" in str(rec[0].message)
    assert rec[0].filename == __file__, "the warning points at the caller's line"
    with pytest.warns(KVTierConfigWarning):
        _l3_config(host_ratio=None, host_tokens=32 + P - 1)  # floored to whole pages: 32


@pytest.mark.parametrize(
    "overrides",
    [
        {"host_ratio": 2.0},
        {"host_ratio": None, "host_tokens": 32 + P},
        {"storage": None},
        {"write_policy": "write_back"},
        {"write_policy": "write_through_selective"},
    ],
    ids=["ratio-2", "one-page-more", "no-storage", "write-back", "selective"],
)
def test_no_warning_when_l3_can_serve(overrides: dict) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error", KVTierConfigWarning)
        _l3_config(**overrides)


@pytest.mark.parametrize(
    "storage, exc, pattern",
    [
        # A name registered later (``register_backend``) or never (the cache is given the
        # backend built): accepted by the config, refused by name by a cache that builds it.
        (
            {"backend": "not-registered", "backend_config": {"anything": 1}},
            ValueError,
            "backend: unknown storage backend 'not-registered'",
        ),
        # What the backend needs (``root``) may be left out for a backend given built.
        ({}, TypeError, "backend_config: the 'file' backend needs root"),
    ],
)
def test_what_a_storage_config_may_leave_open_is_refused_when_the_cache_builds_it(
    storage: dict, exc: type[Exception], pattern: str
) -> None:
    from kvtier.runtime.cache import TieredKVCache

    cfg = CacheConfig(
        layer_kinds=("full",), kv_heads=1, head_dim=4, page_size=4, device_tokens=32,
        host_ratio=2.0, storage=StorageConfig(**storage), model_id="m",
    )  # fmt: skip
    with pytest.raises(exc, match=pattern):
        TieredKVCache(cfg)
