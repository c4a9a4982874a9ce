"""Synthetic stores written directly in q2s form (benchmarks at real shapes): well-formed
enough that the transformers path and the native path load them and agree."""

from __future__ import annotations

import pytest
import torch

from moetier.config import DEFAULT_STORE, EngineConfig
from moetier.loader.load import load_model
from moetier.quant.store import Store
from moetier.quant.synthetic import QWEN3_30B_A3B, write_synthetic_store

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


def test_only_qwen3_moe(tmp_path):
    with pytest.raises(ValueError, match="qwen3_moe shapes only"):
        write_synthetic_store(tmp_path, dict(TINY, model_type="mixtral"))
