"""Random but valid expert blobs of any format, written directly in their stored form.

For kernel tests and benchmarks at shapes no real checkpoint is at hand for: every byte pattern
of the codes is legal, scales are drawn in a realistic range, so a decoder that misreads any
field is caught. Never materialises unquantized weights.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from moetier.config import DEFAULT_STORE
from moetier.core.layout import DTYPES, BlobFormat
from moetier.quant.dense_formats import DensePolicy, dense_class


def random_blob(
    fmt: BlobFormat,
    generator: torch.Generator,
    out: torch.Tensor | None = None,
    fitted_grid: bool = True,
) -> torch.Tensor:
    """One blob of `fmt` (uint8 [fmt.nbytes], or written into `out`, a uint8 view of at least
    that size on any device) with random codes and plausible scales. q2s grids (a, b) are drawn
    freely (`fitted_grid`) or with b = 3a, the evenly spaced grid the quantizer uses today."""
    blob = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    for spec in fmt.tensors:
        shape, dtype = spec.shape, DTYPES[spec.dtype]
        leaf = spec.name.rsplit(".", 1)[-1]
        if leaf == "scales" and spec.dtype == "uint8":  # E8M0 (MXFP4, nested MXFP4)
            value = torch.randint(118, 128, shape, generator=generator, dtype=torch.uint8)
        elif dtype == torch.uint8:
            value = torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)
        elif leaf in ("scales", "row_scale", "tensor_scale"):
            value = (torch.rand(shape, generator=generator) * 1.5 + 0.25).to(dtype)
        elif leaf == "grid":  # q2s (a, b) with 0 < a < b
            a = torch.rand((), generator=generator) * 0.4 + 0.3
            ratio = 2.5 + float(torch.rand((), generator=generator)) if fitted_grid else 3.0
            # b from the float32 a, so b = 3a holds in float32 too (the kernels test b - 3a
            # against 0; 3.0 times a float64 a, rounded, missed it for ~40% of the blobs)
            value = torch.stack([a, a * ratio]).float()
        elif leaf == "table":  # nested: mean E2M1 value of each (sign, exponent MSB) code
            value = torch.tensor([0.75, 3.75, -0.75, -3.75]) * (
                1 + 0.1 * torch.randn(4, generator=generator)
            )
        else:  # raw matrices and biases
            value = (torch.randn(shape, generator=generator) * 0.05).to(dtype)
        raw = value.contiguous().view(-1).view(torch.uint8)
        blob[spec.offset : spec.offset + spec.nbytes] = raw
    if out is None:
        return blob
    out[: blob.numel()].copy_(blob)
    return out


QWEN3_30B_A3B = dict(  # the Qwen3-30B-A3B shape (vocab cut to 8192)
    model_type="qwen3_moe",
    hidden_size=2048,
    num_hidden_layers=48,
    num_attention_heads=32,
    num_key_value_heads=4,
    head_dim=128,
    moe_intermediate_size=768,
    intermediate_size=6144,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    vocab_size=8192,
    max_position_embeddings=4096,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    torch_dtype="bfloat16",
)


TINY_QWEN3_MOE = dict(  # the CPU smoke-test shape: Qwen3-MoE layout, tiny sizes
    QWEN3_30B_A3B,
    hidden_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    moe_intermediate_size=64,
    intermediate_size=256,
    num_experts=32,  # eval-moe-70m's router_trace.npz maps onto it (bench/decode.py, CPU smoke)
    num_experts_per_tok=4,
    vocab_size=512,
)

# GLM-5 (zai-org/GLM-5, 744B parameters, 40B active): config.json as published on the Hugging
# Face hub (huggingface.co/zai-org/GLM-5/blob/main/config.json), the fields that set a shape. Read
# from public copies of that file (it agrees with transformers' GlmMoeDsaConfig defaults, whose
# docstring names zai-org/GLM-5, and with NVIDIA's NeMo model card: 78 layers, 3 dense first,
# 256 routed experts, top-8, hidden 6144); rope left at transformers' default (no shape depends
# on it); quantization_config left out (synthetic stores are bf16 dense, q2s experts).
GLM_5 = dict(
    model_type="glm_moe_dsa",
    architectures=["GlmMoeDsaForCausalLM"],
    vocab_size=154880,
    hidden_size=6144,
    intermediate_size=12288,  # the 3 dense MLP layers
    moe_intermediate_size=2048,
    num_hidden_layers=78,
    first_k_dense_replace=3,
    num_attention_heads=64,
    num_key_value_heads=64,
    q_lora_rank=2048,
    kv_lora_rank=512,
    qk_nope_head_dim=192,
    qk_rope_head_dim=64,
    v_head_dim=256,
    index_n_heads=32,  # the DSA indexer
    index_head_dim=128,
    index_topk=2048,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    routed_scaling_factor=2.5,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    hidden_act="silu",
    attention_bias=False,
    max_position_embeddings=202752,
    rms_norm_eps=1e-5,
    num_nextn_predict_layers=1,
    tie_word_embeddings=False,
    torch_dtype="bfloat16",
)

# DeepSeek-V4-Flash (deepseek-ai/DeepSeek-V4-Flash, 284B parameters, 13B active): config.json as
# published on the Hugging Face hub (huggingface.co/deepseek-ai/DeepSeek-V4-Flash/blob/main/
# config.json), read from public copies of that file; they agree with transformers'
# DeepseekV4Config defaults (docstring: deepseek-ai/DeepSeek-V4-Flash-Base) and NVIDIA's NeMo
# model card (43 layers, all MoE, 256 routed + 1 shared expert, top-6). transformers' class reads
# the legacy keys (compress_ratios, num_hash_layers, qk_rope_head_dim) itself. Left out:
# quantization_config (FP8 dense, FP4 experts in the release; synthetic stores are bf16 dense,
# q2s experts).
DEEPSEEK_V4_FLASH = dict(
    model_type="deepseek_v4",
    architectures=["DeepseekV4ForCausalLM"],
    vocab_size=129280,
    hidden_size=4096,
    moe_intermediate_size=2048,
    num_hidden_layers=43,
    num_hash_layers=3,  # the first 3 MoE layers route by token id (hash_moe)
    num_attention_heads=64,
    num_key_value_heads=1,
    head_dim=512,
    qk_rope_head_dim=64,
    q_lora_rank=1024,
    o_lora_rank=1024,
    o_groups=8,
    index_n_heads=64,
    index_head_dim=128,
    index_topk=512,
    sliding_window=128,
    compress_ratios=[0, 0] + [4, 128] * 20 + [4, 0],  # 0 sliding, 4 CSA, 128 HCA per layer
    compress_rope_theta=160000,
    rope_theta=10000,
    rope_scaling={
        "type": "yarn",
        "factor": 16,
        "beta_fast": 32,
        "beta_slow": 1,
        "original_max_position_embeddings": 65536,
    },
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=6,
    routed_scaling_factor=1.5,
    scoring_func="sqrtsoftplus",
    topk_method="noaux_tc",
    norm_topk_prob=True,
    swiglu_limit=10.0,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
    max_position_embeddings=1048576,
    rms_norm_eps=1e-6,
    num_nextn_predict_layers=1,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    torch_dtype="bfloat16",
)

# DeepSeek-V3 (deepseek-ai/DeepSeek-V3, 671B parameters, 37B active): config.json as published
# on the Hugging Face hub (huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json), the
# fields that set a shape; they equal transformers' DeepseekV3Config defaults (61 layers, the
# first 3 dense, MLA with q/kv LoRA 1536/512, 256 routed + 1 shared expert, top-8 in 8 groups).
# Left out: quantization_config (the release's dense weights and experts are FP8 with 128x128
# block scales; synthetic stores are moetier's formats) and the MTP layer's fields.
DEEPSEEK_V3 = dict(
    model_type="deepseek_v3",
    architectures=["DeepseekV3ForCausalLM"],
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,  # the 3 dense MLP layers
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    first_k_dense_replace=3,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=256,
    n_shared_experts=1,
    num_experts_per_tok=8,
    routed_scaling_factor=2.5,
    n_group=8,
    topk_group=4,
    norm_topk_prob=True,
    scoring_func="sigmoid",
    topk_method="noaux_tc",
    hidden_act="silu",
    attention_bias=False,
    max_position_embeddings=163840,
    rope_theta=10000,
    rope_scaling={
        "type": "yarn",
        "factor": 40,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=1,
    torch_dtype="bfloat16",
)

# Kimi-K2 (moonshotai/Kimi-K2-Instruct, 1.04T parameters, 32B active): config.json as published
# on the Hugging Face hub (huggingface.co/moonshotai/Kimi-K2-Instruct/blob/main/config.json),
# read from public copies of that file: DeepSeek-V3's architecture (its `architectures` is
# DeepseekV3ForCausalLM) with 64 attention heads, 384 routed experts, one dense first layer, one
# expert group and a 163840-token vocabulary. Its model_type "kimi_k2" names remote code
# transformers does not carry, so the shape says deepseek_v3, the class that runs it. Left out:
# quantization_config (FP8 block scales in the release) and auto_map.
KIMI_K2 = dict(
    DEEPSEEK_V3,
    vocab_size=163840,
    num_attention_heads=64,
    num_key_value_heads=64,
    first_k_dense_replace=1,
    n_routed_experts=384,
    routed_scaling_factor=2.827,
    n_group=1,
    topk_group=1,
    max_position_embeddings=131072,
    rope_theta=50000.0,
    rope_scaling={
        "type": "yarn",
        "factor": 32.0,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
    bos_token_id=163584,
    eos_token_id=163585,
)

# Qwen3-235B-A22B (Qwen/Qwen3-235B-A22B): config.json as published on the Hugging Face hub
# (huggingface.co/Qwen/Qwen3-235B-A22B/blob/main/config.json), the fields that set a shape: 94
# layers, every one MoE (128 experts of 1536, top-8, no shared expert), GQA 64 query / 4 KV heads
# of 128, vocabulary 151936, embeddings not tied.
QWEN3_235B_A22B = dict(
    model_type="qwen3_moe",
    architectures=["Qwen3MoeForCausalLM"],
    hidden_size=4096,
    num_hidden_layers=94,
    num_attention_heads=64,
    num_key_value_heads=4,
    head_dim=128,
    moe_intermediate_size=1536,
    intermediate_size=12288,
    num_experts=128,
    num_experts_per_tok=8,
    norm_topk_prob=True,
    vocab_size=151936,
    max_position_embeddings=40960,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    attention_bias=False,
    bos_token_id=151643,
    eos_token_id=151645,
    torch_dtype="bfloat16",
)

# GLM-5 and DeepSeek-V4-Flash with their layer kinds kept and every size cut down: CPU smoke
# tests of the real shapes' code paths (a real GLM-5 layer is ~7 GB of store).
TINY_GLM_5 = dict(
    GLM_5,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=4,
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_nope_head_dim=8,
    qk_rope_head_dim=8,
    v_head_dim=16,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    vocab_size=512,
)
TINY_DEEPSEEK_V4_FLASH = dict(
    DEEPSEEK_V4_FLASH,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_hash_layers=1,
    compress_ratios=[0, 4, 128, 0],
    num_attention_heads=4,
    head_dim=32,
    qk_rope_head_dim=8,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=4,
    sliding_window=8,
    n_routed_experts=8,
    num_experts_per_tok=2,
    vocab_size=512,
)

# GLM-4.5 (zai-org/GLM-4.5, 355B parameters, 32B active; GLM-4.6 and 4.7 have its layer shapes):
# config.json as published on the Hugging Face hub, read from public copies of that file: 92
# layers, the first 3 dense, 160 routed + 1 shared expert of 1536, top-8, GQA 96 query / 8 KV
# heads of 128 with q/k norm and q/k/v biases, half of each head's dims rotated.
GLM_4_5 = dict(
    model_type="glm4_moe",
    architectures=["Glm4MoeForCausalLM"],
    vocab_size=151552,
    hidden_size=5120,
    intermediate_size=12288,  # the 3 dense MLP layers
    moe_intermediate_size=1536,
    num_hidden_layers=92,
    first_k_dense_replace=3,
    num_attention_heads=96,
    num_key_value_heads=8,
    head_dim=128,
    partial_rotary_factor=0.5,
    rope_theta=1000000.0,
    use_qk_norm=True,
    attention_bias=True,
    n_routed_experts=160,
    n_shared_experts=1,
    num_experts_per_tok=8,
    routed_scaling_factor=2.5,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    hidden_act="silu",
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    num_nextn_predict_layers=1,
    tie_word_embeddings=False,
    eos_token_id=[151329, 151336, 151338],
    torch_dtype="bfloat16",
)

# gpt-oss-120b (openai/gpt-oss-120b, 117B parameters, 5.1B active): config.json as published on
# the Hugging Face hub, read from public copies of that file (they agree with transformers'
# GptOssConfig defaults): 36 layers alternating 128-token sliding-window and full attention,
# 128 experts of 2880 with biases, top-4, GQA 64 query / 8 KV heads of 64, yarn rope. Left out:
# quantization_config (MXFP4 experts in the release; synthetic stores hold q2s or bf16 experts).
GPT_OSS_120B = dict(
    model_type="gpt_oss",
    architectures=["GptOssForCausalLM"],
    vocab_size=201088,
    hidden_size=2880,
    intermediate_size=2880,  # each expert's
    num_hidden_layers=36,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=64,
    num_local_experts=128,
    num_experts_per_tok=4,
    sliding_window=128,
    attention_bias=True,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    swiglu_limit=7.0,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    eos_token_id=200002,
    pad_token_id=199999,
    torch_dtype="bfloat16",
)

# MiniMax-M2 (MiniMaxAI/MiniMax-M2, 230B parameters, 10B active): config.json as published on
# the Hugging Face hub, read from public copies of that file (they agree with transformers'
# MiniMaxM2Config defaults): 62 layers, all MoE, 256 experts of 1536, top-8, sigmoid router with
# a correction bias, GQA 48 query / 8 KV heads of 128 with q/k norm over the whole projection,
# rotary_dim 64 of 128 (written as transformers reads it: partial_rotary_factor 0.5). Left out:
# the multi-token-prediction modules (use_mtp, num_mtp_modules 3).
MINIMAX_M2 = dict(
    model_type="minimax_m2",
    architectures=["MiniMaxM2ForCausalLM"],
    vocab_size=200064,
    hidden_size=3072,
    intermediate_size=1536,  # each expert's
    num_hidden_layers=62,
    num_attention_heads=48,
    num_key_value_heads=8,
    head_dim=128,
    num_local_experts=256,
    num_experts_per_tok=8,
    rope_parameters={"rope_type": "default", "rope_theta": 5000000.0, "partial_rotary_factor": 0.5},
    max_position_embeddings=196608,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    eos_token_id=200020,
    torch_dtype="bfloat16",
)

# GLM-4.5, gpt-oss-120b and MiniMax-M2 with their layer kinds kept and every size cut down
# (CPU tests).
TINY_GLM_4_5 = dict(
    GLM_4_5,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    first_k_dense_replace=1,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    eos_token_id=0,
)
TINY_GPT_OSS_120B = dict(
    GPT_OSS_120B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    sliding_window=4,
    eos_token_id=0,
    pad_token_id=0,
)
TINY_MINIMAX_M2 = dict(
    MINIMAX_M2,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=8,
    num_experts_per_tok=2,
    eos_token_id=0,
)

# The shapes a synthetic store can be written at, by name (`moetier bench --shape NAME`,
# `moetier plan --shape NAME`).
SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "glm-5": GLM_5,
    "deepseek-v4-flash": DEEPSEEK_V4_FLASH,
    "tiny": TINY_QWEN3_MOE,
    "glm-5-tiny": TINY_GLM_5,
    "deepseek-v4-flash-tiny": TINY_DEEPSEEK_V4_FLASH,
    "glm-4.5": GLM_4_5,
    "gpt-oss-120b": GPT_OSS_120B,
    "glm-4.5-tiny": TINY_GLM_4_5,
    "gpt-oss-120b-tiny": TINY_GPT_OSS_120B,
    "minimax-m2": MINIMAX_M2,
    "minimax-m2-tiny": TINY_MINIMAX_M2,
    "deepseek-v3": DEEPSEEK_V3,
    "kimi-k2": KIMI_K2,
    "qwen3-235b-a22b": QWEN3_235B_A22B,
}


def shape(name: str, layers: int | None = None) -> dict[str, Any]:
    """The HF config of shape `name` (SHAPES): the whole model, or with `layers` a slice of that
    many MoE decoder layers at the real layer shapes (GLM-5's dense first layers and
    DeepSeek-V4's hash-routed ones left out; DeepSeek-V4's attention kinds taken in the release's
    order from its first compressed layer). ValueError naming the shapes for an unknown one."""
    if name not in SHAPES:
        raise ValueError(f"unknown shape {name!r}: the shapes are {', '.join(SHAPES)}")
    if layers is not None and layers < 1:
        raise ValueError(f"--layers {layers}: a model needs at least one layer")
    return slice_layers(SHAPES[name], layers) if layers is not None else dict(SHAPES[name])


def slice_layers(hf_config: dict[str, Any], layers: int) -> dict[str, Any]:
    """`hf_config` cut to `layers` decoder layers, every one a routed-MoE layer."""
    config = dict(hf_config, num_hidden_layers=layers)
    if "first_k_dense_replace" in config:
        config["first_k_dense_replace"] = 0
    if config.get("model_type") == "deepseek_v4":
        ratios = [r for r in config.get("compress_ratios", ()) if r] or [4, 128]
        config["compress_ratios"] = [ratios[i % len(ratios)] for i in range(layers)]
        config["mlp_layer_types"] = ["moe"] * layers
        config.pop("num_hash_layers", None)
    return config


def expert_format(hf_config: dict[str, Any], experts: str = "q2s") -> BlobFormat:
    """The blob format of a synthetic store's experts: "q2s" (g32, down g16) or "bfloat16", with
    expert biases where the family has them (gpt_oss)."""
    from moetier.config import ModelConfig
    from moetier.core.layout import q2s_expert_format, raw_expert_format

    cfg = ModelConfig.from_hf(hf_config)
    hidden, inter, bias = cfg.hidden_size, cfg.expert_intermediate_size, cfg.expert_has_bias
    if experts == "q2s":
        return q2s_expert_format(hidden, inter, bias, 32, 16)
    if experts == "bfloat16":
        return raw_expert_format("bfloat16", hidden, inter, bias)
    raise ValueError(f"synthetic experts are q2s or bfloat16, not {experts!r}")


def meta_model(hf_config: dict[str, Any]) -> torch.nn.Module:
    """The transformers model of `hf_config` on the meta device (names and shapes only);
    ValueError where the installed transformers has no class for its model_type."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type = hf_config["model_type"]
    kwargs = {k: v for k, v in hf_config.items() if k != "model_type"}
    try:
        config = AutoConfig.for_model(model_type, **kwargs)
    except (KeyError, ValueError) as err:
        raise ValueError(
            f"this transformers has no {model_type} config class ({err}): upgrade transformers"
        ) from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


def dense_and_experts(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], dict[int, str]]:
    """The (meta) tensors a store keeps dense, by name, and layer -> experts module path: every
    persistent tensor but the routed experts' parameters, a tensor tied to another (the output
    head of a model with tie_word_embeddings) once, under its first name (the embedding), as
    save_pretrained writes the checkpoint and convert the store."""
    from moetier.quant.convert import EXPERT_PARAMS, experts_modules

    modules = experts_modules(model)
    routed = {f"{path}.{p}" for path in modules for p in EXPERT_PARAMS}
    dense: dict[str, torch.Tensor] = {}
    seen: set[int] = set()
    for name, tensor in model.state_dict(keep_vars=True).items():  # the parameters themselves
        if name in routed or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        dense[name] = tensor.detach()
    return dense, {m.layer: path for path, m in modules.items()}


def synthetic_store_bytes(
    hf_config: dict[str, Any], experts: str = "q2s", delta: str | None = None
) -> int:
    """Bytes `write_synthetic_store` writes for `hf_config`: bf16 dense tensors and one
    aligned blob per (MoE layer, expert) and plane."""
    from moetier.config import ModelConfig
    from moetier.core.layout import align_up, fp4_expert_format
    from moetier.quant.store import BLOB_ALIGN

    dense, moe = dense_and_experts(meta_model(hf_config))
    cfg = ModelConfig.from_hf(hf_config)
    blobs = len(moe) * cfg.num_experts
    stride = align_up(expert_format(hf_config, experts).nbytes, BLOB_ALIGN)
    if delta is not None:
        dfmt = fp4_expert_format(delta, cfg.hidden_size, cfg.expert_intermediate_size, False)
        stride += align_up(dfmt.nbytes, BLOB_ALIGN)
    return sum(t.numel() * 2 for t in dense.values()) + blobs * stride


def write_synthetic_store(
    dst: Path,
    hf_config: dict[str, Any],
    experts: str = "q2s",
    tokenizer_from: Path | None = DEFAULT_STORE,
    seed: int = 0,
    distinct: int = 8,
    progress: bool = False,
    dense: DensePolicy | None = None,
    delta: str | None = None,
    mtp: bool = False,
) -> Path:
    """A moetier store of a model of `hf_config` (any family transformers builds) with random
    weights, written directly: dense tensors random bf16 (norms 1, integer buffers 0) one at a
    time, experts in `experts` form ("q2s" g32/down g16, or "bfloat16"), `distinct` random blobs
    repeated over all (layer, expert) slots, never an unquantized expert. For benchmarks at
    shapes no checkpoint is at hand for; `tokenizer_from` (a store or HF directory; default the
    demo store's, whose vocabulary random token ids need not match) lends its tokenizer files,
    which the loaders require (None: a store without them); `progress`: a progress bar of the
    layers written; `dense`: the dense classes' formats, as `moetier convert --dense`
    (quant/dense_formats.py); `delta` "nvfp4": a delta plane of random NVFP4 blobs too (the
    gate's benchmarks); `mtp`: an MTP layer too (`model.layers.{num_hidden_layers}.*`,
    DeepSeek's layout with the family's dense decoder block; qwen3_moe), kept as a converted
    store keeps one (speculative decoding's benchmarks)."""
    from moetier.config import ModelConfig
    from moetier.core.layout import align_up
    from moetier.quant.convert import _SafetensorsWriter
    from moetier.quant.store import (
        BLOB_ALIGN,
        DENSE_FILE,
        EXPERTS_FILE,
        INDEX_FILE,
        STORE_VERSION,
        blob_index_entry,
        file_records,
    )

    dense_meta, moe = dense_and_experts(meta_model(hf_config))
    mtp_meta = mtp_tensors(hf_config) if mtp else {}
    dense_meta.update(mtp_meta)
    fmt = expert_format(hf_config, experts)
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(hf_config, indent=1))
    if tokenizer_from is not None:
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if (tokenizer_from / name).exists():
                shutil.copyfile(tokenizer_from / name, dst / name)
    gen = torch.Generator().manual_seed(seed)
    names = sorted(dense_meta)
    specs: list[tuple[str, str, tuple[int, ...]]] = []
    formats: dict[str, Any] = {}
    quantized: dict[str, Any] = {}
    for name in names:
        meta = dense_meta[name]
        shape_ = tuple(meta.shape)
        dense_fmt = None
        if dense is not None and meta.is_floating_point() and not name.endswith("norm.weight"):
            dense_fmt = dense.choose(name, shape_)
        if dense_fmt is None:
            dtype = str(meta.dtype).removeprefix("torch.")
            specs.append((name, "bfloat16" if meta.is_floating_point() else dtype, shape_))
            continue
        formats[name] = dense_fmt
        specs.extend(dense_fmt.tensors(name, shape_))
        quantized[name[: -len(".weight")]] = {
            "format": dense_fmt.to_json(),
            "class": dense_class(name),
            "shape": list(shape_),
        }
    writer = _SafetensorsWriter(dst / DENSE_FILE, specs)
    for name in names:  # one tensor at a time: GLM-5's embedding alone is 1.9 GB in bf16
        meta = dense_meta[name]
        if not meta.is_floating_point():
            writer.write(name, torch.zeros(meta.shape, dtype=meta.dtype))
        elif name.endswith("norm.weight"):
            writer.write(name, torch.ones(meta.shape, dtype=torch.bfloat16))
        else:
            weight = (torch.randn(meta.shape, generator=gen) * 0.02).to(torch.bfloat16)
            if name not in formats:
                writer.write(name, weight)
                continue
            stored = formats[name].tensors(name, tuple(meta.shape))
            for (part, _, _), value in zip(stored, formats[name].quantize(weight), strict=True):
                writer.write(part, value)
    writer.close()
    stride = align_up(fmt.nbytes, BLOB_ALIGN)
    blobs = []
    for _ in range(distinct):
        blob = torch.zeros(stride, dtype=torch.uint8)
        random_blob(fmt, gen, blob, fitted_grid=False)
        blobs.append(blob)
    num_experts = ModelConfig.from_hf(hf_config).num_experts
    planes = [("base", fmt, stride, blobs)]
    if delta is not None:
        if delta != "nvfp4":
            raise ValueError(f"synthetic delta planes are nvfp4, not {delta!r}")
        from moetier.core.layout import fp4_expert_format

        cfg = ModelConfig.from_hf(hf_config)
        dfmt = fp4_expert_format("nvfp4", cfg.hidden_size, cfg.expert_intermediate_size, False)
        dstride = align_up(dfmt.nbytes, BLOB_ALIGN)
        deltas = []
        for _ in range(distinct):
            blob = torch.zeros(dstride, dtype=torch.uint8)
            random_blob(dfmt, gen, blob)
            deltas.append(blob)
        planes.append(("delta", dfmt, dstride, deltas))
    index_blobs = []
    offset = 0
    with open(dst / EXPERTS_FILE, "wb") as f:
        for plane, pfmt, pstride, pblobs in planes:
            for n, layer in enumerate(
                tqdm(sorted(moe), desc=f"{plane} layers", unit="layer", disable=not progress)
            ):
                for expert in range(num_experts):
                    blob = pblobs[(n * num_experts + expert) % distinct]
                    f.write(blob.numpy().tobytes())
                    index_blobs.append(blob_index_entry(layer, expert, offset, pfmt, blob, plane))
                    offset += pstride
    index = {
        "version": STORE_VERSION,
        "model_type": hf_config["model_type"],
        "source_dtype": "bfloat16",
        "alignment": BLOB_ALIGN,
        "formats": {pfmt.name: pfmt.to_json() for _, pfmt, _, _ in planes},
        "moe_modules": {str(layer): path for layer, path in sorted(moe.items())},
        "skipped_source_tensors": [],
        "blobs": index_blobs,
        "quantization": {"experts": experts, "synthetic": True},
        "files": file_records(dst),  # dense.safetensors' checksums, as a converted store's
    }
    if dense is not None:
        index["dense"] = {"policy": dense.to_json(), "tensors": quantized}
    if mtp_meta:
        layer = int(hf_config["num_hidden_layers"])
        index["mtp_layers"] = {str(layer): {"prefix": f"model.layers.{layer}.", "experts": None}}
        index["mtp_dense"] = sorted(mtp_meta)
    (dst / INDEX_FILE).write_text(json.dumps(index))
    return dst


def mtp_tensors(hf_config: dict[str, Any]) -> dict[str, torch.Tensor]:
    """The (meta) tensors of one MTP layer for `hf_config`, by checkpoint name: enorm, hnorm,
    eh_proj, shared_head.norm and a dense decoder block of the family at index
    num_hidden_layers (qwen3_moe: its mlp_only_layers make it dense)."""
    if hf_config["model_type"] != "qwen3_moe":
        raise ValueError(f"synthetic MTP layers are qwen3_moe's, not {hf_config['model_type']}'s")
    layer = int(hf_config["num_hidden_layers"])
    prefix = f"model.layers.{layer}."
    bigger = {**hf_config, "num_hidden_layers": layer + 1, "mlp_only_layers": [layer]}
    state = meta_model(bigger).state_dict()
    out = {k: v for k, v in state.items() if k.startswith(prefix)}
    hidden = int(hf_config["hidden_size"])
    for name, shape_ in (("enorm.weight", (hidden,)), ("hnorm.weight", (hidden,)),
                         ("eh_proj.weight", (hidden, 2 * hidden)),
                         ("shared_head.norm.weight", (hidden,))):  # fmt: skip
        out[prefix + name] = torch.empty(shape_, device="meta", dtype=torch.bfloat16)
    return out
