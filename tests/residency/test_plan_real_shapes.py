"""The planner's whole-model prediction from a config alone (`moetier plan --shape`): the same
split as `plan` over the store that config converts to (a synthetic store written at scaled
shapes), and for the real GLM-5 and DeepSeek-V4-Flash configs dense parameters and blob counts
against hand arithmetic from the published architecture."""

from __future__ import annotations

import dataclasses

import pytest
from tiny_models import skip_without_transformers_family

from moetier.cli.main import main
from moetier.core.layout import TENSOR_ALIGN, align_up
from moetier.quant.store import Store
from moetier.quant.synthetic import expert_format, meta_model, shape, write_synthetic_store
from moetier.residency.planner import parse_bytes, plan, plan_shape


def config_or_skip(name: str, **changes: object) -> dict:
    config = dict(shape(name), **changes)
    skip_without_transformers_family(config["model_type"])
    meta_model(config)
    return config


@pytest.mark.parametrize("name", ["glm-5-tiny", "deepseek-v4-flash-tiny"])
def test_plan_from_config_equals_plan_of_its_store(tmp_path, name):
    """The real shapes' layer kinds at tiny sizes (SHAPES' -tiny copies), written as stores."""
    config = config_or_skip(name)
    store = Store(write_synthetic_store(tmp_path / name, config, "q2s", distinct=2))
    for gpu, host in (("1GiB", "0"), ("600MiB", "2MiB")):
        budgets = dict(gpu_memory=parse_bytes(gpu), host_memory=parse_bytes(host),
                       max_context=256, zero_copy_stage=1)  # fmt: skip
        ours = plan_shape(config, **budgets)
        assert dataclasses.asdict(ours) == dataclasses.asdict(plan(store, **budgets))
    assert ours.base_blobs == len(store.moe_layers) * 8 and ours.base_blobs > 0


def glm5_dense_params(c: dict) -> int:
    """GLM-5's non-expert parameters from its architecture (MLA with q/kv LoRA, the DSA indexer,
    3 dense MLP layers, then MoE layers with a sigmoid router + correction bias and a shared
    expert), counted by hand."""
    h, heads, v = c["hidden_size"], c["num_attention_heads"], c["vocab_size"]
    qr, kvr, nope, rope, vd = (c[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
                                             "qk_rope_head_dim", "v_head_dim"))  # fmt: skip
    ih, idim = c["index_n_heads"], c["index_head_dim"]
    attention = (h * qr + qr + qr * heads * (nope + rope) + h * (kvr + rope) + kvr
                 + kvr * heads * (nope + vd) + heads * vd * h)  # fmt: skip
    indexer = qr * ih * idim + h * idim + 2 * idim + h * ih
    per_layer = attention + indexer + 2 * h  # + input and post-attention norms
    dense_layers = c["first_k_dense_replace"]
    moe_layers = c["num_hidden_layers"] - dense_layers
    experts = c["n_routed_experts"]
    moe = experts * h + experts + 3 * h * c["moe_intermediate_size"] * c["n_shared_experts"]
    return (2 * v * h + h + c["num_hidden_layers"] * per_layer
            + dense_layers * 3 * h * c["intermediate_size"] + moe_layers * moe)  # fmt: skip


def test_glm5_on_one_96gb_gpu_with_512gb_host():
    config = config_or_skip("glm-5")
    p = plan_shape(config, parse_bytes("96GB"), parse_bytes("512GB"))
    assert p.dense_bytes == 2 * glm5_dense_params(config)
    assert p.base_blobs == 75 * 256 and p.blobs_per_token == 75 * 8  # 3 dense layers first
    assert p.slot_bytes == align_up(expert_format(config).nbytes, TENSOR_ALIGN)
    assert p.kv_bytes == 78 * (512 + 64) * 4096 * 2  # MLA latent + rope key per token and layer
    # what is left of 96 GB after dense, KV and workspace holds whole slots, the host the rest
    spare = parse_bytes("96GB") - p.dense_bytes - p.kv_bytes - p.workspace_bytes
    assert p.gpu_base_slots == spare // p.slot_bytes
    assert p.host_blobs == p.base_blobs - p.gpu_base_slots  # 512 GB holds every other blob
    assert p.traffic_per_token(0.5)[1] == 0  # nothing from disk


def test_deepseek_v4_flash_on_one_32gb_gpu_with_192gb_host():
    config = config_or_skip("deepseek-v4-flash")
    p = plan_shape(config, parse_bytes("32GB"), parse_bytes("192GB"))
    assert p.base_blobs == 43 * 256 and p.blobs_per_token == 43 * 6  # every layer MoE
    assert p.slot_bytes == align_up(expert_format(config).nbytes, TENSOR_ALIGN)
    spare = parse_bytes("32GB") - p.dense_bytes - p.kv_bytes - p.workspace_bytes
    assert 0 < p.gpu_base_slots == spare // p.slot_bytes < p.base_blobs
    assert p.host_blobs == p.base_blobs - p.gpu_base_slots


@pytest.mark.parametrize(
    "name,gpu,host", [("glm-5", "96GB", "512GB"), ("deepseek-v4-flash", "32GB", "192GB")]
)
def test_moetier_plan_prints_the_prediction(capsys, name, gpu, host):
    config = config_or_skip(name)
    assert main(["plan", "--shape", name, "--gpu-memory", gpu, "--host-memory", host]) == 0
    out = capsys.readouterr().out
    p = plan_shape(config, parse_bytes(gpu), parse_bytes(host), zero_copy_stage=3)
    assert out.splitlines()[0].startswith(f"{name}: {config['model_type']}")
    assert out.endswith(p.render() + "\n")
    assert f"{p.gpu_base_slots} of {p.base_blobs} base blobs" in out
