"""Synthetic stores written directly in q2s form (benchmarks at real shapes): well-formed
enough that the transformers path and the native path load them and agree."""

from __future__ import annotations

import pytest
import torch
from tiny_models import skip_without_transformers_family

from moetier.config import DEFAULT_STORE, EngineConfig
from moetier.loader.load import load_model
from moetier.quant.store import Store
from moetier.quant.synthetic import (
    QWEN3_30B_A3B,
    SHAPES,
    dense_and_experts,
    meta_model,
    shape,
    slice_layers,
    write_synthetic_store,
)

TINY = dict(
    QWEN3_30B_A3B,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    moe_intermediate_size=32,
    intermediate_size=96,
    num_experts=8,
    num_experts_per_tok=2,
    vocab_size=320,
)


@pytest.mark.parametrize("experts", ["q2s", "bfloat16"])
def test_synthetic_store_loads_and_both_paths_agree(tmp_path, experts):
    path = write_synthetic_store(tmp_path / experts, TINY, experts, DEFAULT_STORE, distinct=3)
    store = Store(path)
    assert store.verify() == []
    assert len(store.blobs) == 2 * 8 and store.index["quantization"]["synthetic"]
    ids = torch.randint(0, 320, (1, 10), generator=torch.Generator().manual_seed(0))
    out = {}
    for native in (False, True):
        loaded = load_model(path, EngineConfig(device="cpu", dtype="float32", native=native))
        with torch.no_grad():
            if native:
                from moetier.engine.static_decode import StaticDecoder

                decoder = StaticDecoder(loaded.model, 1, 16, torch.float32, "cpu")
                out[native] = decoder.prefill([ids[0].tolist()])
            else:
                out[native] = loaded.model(ids).logits[:, -1]
    assert torch.isfinite(out[True]).all()
    assert (out[True] - out[False]).abs().max() < 1e-4


def test_a_model_type_transformers_lacks_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no nope_moe config class"):
        write_synthetic_store(tmp_path, dict(TINY, model_type="nope_moe"))


@pytest.mark.parametrize("name", ["glm-5", "deepseek-v4-flash"])
def test_real_shape_slices(tmp_path, name):
    """A --layers slice of the real shapes: MoE layers only, at the real layer shapes; written
    (scaled down: the real GLM-5 slice is ~7 GB a layer) and run by both model paths."""
    skip_without_transformers_family(SHAPES[name]["model_type"])
    config = slice_layers(SHAPES[f"{name}-tiny"], 2)
    meta_model(config)
    real = shape(name, 2)
    assert real["num_hidden_layers"] == 2 and real["hidden_size"] == SHAPES[name]["hidden_size"]
    path = write_synthetic_store(tmp_path / name, config, "q2s", DEFAULT_STORE, distinct=2)
    store = Store(path)
    assert store.moe_layers == [0, 1] and len(store.blobs) == 2 * 8  # every layer routed
    assert store.model_config.model_type == config["model_type"] and store.verify() == []
    dense, moe = dense_and_experts(meta_model(config))
    assert store.moe_modules == moe
    assert store.dense_size[0] == sum(t.numel() for t in dense.values())
    ids = torch.randint(0, 512, (1, 10), generator=torch.Generator().manual_seed(0))
    out = {}
    for native in (False, True):  # True: the native file where the family has one
        loaded = load_model(path, EngineConfig(device="cpu", dtype="float32", native=native))
        with torch.no_grad():
            if hasattr(loaded.model, "new_cache"):
                cache = loaded.model.new_cache(1, 16, torch.float32, "cpu")
                out[native] = loaded.model(ids, torch.arange(10)[None], cache)[:, -1]
            else:
                out[native] = loaded.model(ids).logits[:, -1]
    assert torch.isfinite(out[False]).all()
    assert (out[True] - out[False]).abs().max() < 1e-4


def test_slices_keep_the_real_layer_kinds():
    glm = shape("glm-5", 3)
    assert glm["first_k_dense_replace"] == 0 and SHAPES["glm-5"]["first_k_dense_replace"] == 3
    v4 = shape("deepseek-v4-flash", 3)
    assert v4["mlp_layer_types"] == ["moe"] * 3 and "num_hash_layers" not in v4
    assert v4["compress_ratios"] == [4, 128, 4]  # CSA / HCA in the release's order
    assert shape("glm-5") == SHAPES["glm-5"]  # no --layers: the whole model
