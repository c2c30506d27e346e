"""Bad arguments raise ValueError naming the argument."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kvtier.example import HybridModel, HybridModelConfig, ModelPools
from tests.example.helpers import CONFIGS, poisoned_pools, scattered_rows


@pytest.fixture
def setup(device):
    model = HybridModel(CONFIGS["hybrid"], device)
    pools = poisoned_pools(model)
    return model, pools, *scattered_rows(pools, 10, seed=0)


def test_slot_rows(setup) -> None:
    model, pools, full, swa = setup
    toks = [1, 2, 3]
    with pytest.raises(ValueError, match="full_slots: 4 slots for positions"):
        model.forward(toks, 2, full[:4], swa, 0, pools)
    with pytest.raises(ValueError, match="full_slots: expected a 1-D int64"):
        model.forward(toks, 0, full.int(), swa, 0, pools)
    bad = full.clone()
    bad[1] = -1
    with pytest.raises(ValueError, match="full_slots: slots of positions"):
        model.forward(toks, 0, bad, swa, 0, pools)
    with pytest.raises(ValueError, match="swa_slots: required"):
        model.forward(toks, 0, full, None, 0, pools)
    with pytest.raises(ValueError, match="swa_slots: 2 slots"):
        model.forward(toks, 0, full, swa[:2], 0, pools)


def test_tokens_and_mamba(setup) -> None:
    model, pools, full, swa = setup
    with pytest.raises(ValueError, match="token_ids: need at least one"):
        model.forward([], 0, full, swa, 0, pools)
    with pytest.raises(ValueError, match="token_ids:"):
        model.forward([model.config.vocab], 0, full, swa, 0, pools)
    with pytest.raises(ValueError, match="start_pos"):
        model.forward([1], -1, full, swa, 0, pools)
    with pytest.raises(ValueError, match="mamba_slot"):
        model.forward([1], 0, full, swa, None, pools)
    with pytest.raises(ValueError, match="mamba_checkpoints: seqlen 3"):
        model.forward([1, 2], 0, full, swa, 0, pools, mamba_checkpoints={3: 1})
    with pytest.raises(ValueError, match="mamba_checkpoints: slot 0"):
        model.forward([1, 2], 0, full, swa, 0, pools, mamba_checkpoints={2: 0})
    with pytest.raises(ValueError, match="start_pos: 3 must be in"):
        model.generate([1, 2, 3], 2, full, swa, 0, pools, start_pos=3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate([1, 2, 3], 0, full, swa, 0, pools)


def test_pools_must_fit(setup, device) -> None:
    model, pools, full, swa = setup
    with pytest.raises(ValueError, match="pools.swa_pool: the model has 2 swa layers"):
        model.forward([1], 0, full, swa, 0, ModelPools(pools.full_pool, None, pools.mamba_pool))
    other = ModelPools.create(dataclasses.replace(model.config, dtype=torch.bfloat16), 16)
    with pytest.raises(ValueError, match="pools.full_pool: expected 2 layers"):
        model.forward(
            [1], 0, full, swa, 0, ModelPools(other.full_pool, pools.swa_pool, pools.mamba_pool)
        )
    with pytest.raises(ValueError, match="pools.mamba_pool"):
        model.forward(
            [1], 0, full, swa, 0, ModelPools(pools.full_pool, pools.swa_pool, other.mamba_pool)
        )


@pytest.mark.parametrize(
    "kwargs, arg",
    [
        ({"layer_kinds": ("swa", "mamba")}, "layer_kinds"),
        ({"layer_kinds": ("full", "moe")}, "layer_kinds"),
        ({"q_heads": 3, "kv_heads": 2}, "q_heads"),
        ({"head_dim": 7}, "head_dim"),
        ({"swa_window": 0}, "swa_window"),
        ({"mamba_kernel": 1}, "mamba_kernel"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_config(kwargs: dict, arg: str) -> None:
    base = {"layer_kinds": ("full", "swa", "mamba")}
    with pytest.raises(ValueError, match=arg):
        HybridModelConfig(**{**base, **kwargs})


def test_public_api() -> None:
    from kvtier import example

    assert sorted(example.__all__) == [
        "Generation",
        "HybridModel",
        "HybridModelConfig",
        "LayerKind",
        "ModelPools",
    ]
