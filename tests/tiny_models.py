"""Tiny random checkpoints of each supported family, written with transformers' save_pretrained.

Each has 2-3 layers, 8 experts, top-2, hidden 64, a 320-entry byte-level BPE tokenizer trained
on a few lines of text, and a Qwen-style chat template, all from a fixed seed.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

VOCAB = 320
CHAT_TEMPLATE = (
    "{%- for m in messages %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}"
    "{%- endfor %}{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    eos_token_id=0,
    pad_token_id=0,
    bos_token_id=None,
)
MLA = dict(
    q_lora_rank=32,
    kv_lora_rank=16,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    num_key_value_heads=4,
)
CONFIGS: dict[str, dict] = {
    "qwen3_moe": dict(
        intermediate_size=96,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        decoder_sparse_step=1,
        mlp_only_layers=[],
    ),
    "mixtral": dict(intermediate_size=32, num_local_experts=8, num_experts_per_tok=2),
    "deepseek_v3": dict(
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=2,
        topk_group=1,
        num_hidden_layers=3,
        **MLA,
    ),
    "glm4_moe": dict(
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        head_dim=16,
        num_hidden_layers=3,
    ),
    "gpt_oss": dict(
        intermediate_size=32,
        num_local_experts=8,
        num_experts_per_tok=2,
        head_dim=16,
        sliding_window=16,
        layer_types=["sliding_attention", "full_attention"],
    ),
    "glm_moe_dsa": dict(
        intermediate_size=96,
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=8,
        num_hidden_layers=3,
        **MLA,
    ),
    "deepseek_v4": dict(
        moe_intermediate_size=32,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_shared_experts=1,
        num_key_value_heads=1,
        head_dim=32,
        q_lora_rank=32,
        o_groups=2,
        o_lora_rank=16,
        index_n_heads=2,
        index_head_dim=16,
        index_topk=4,
        sliding_window=8,
        num_hidden_layers=3,
        mlp_layer_types=["hash_moe", "moe", "moe"],
    ),
}
MODEL_TYPES = tuple(CONFIGS)
TEXT = (
    "It was a bright cold day in April, and the clocks were striking thirteen. "
    "The quick brown fox jumps over the lazy dog. Call me Ishmael. "
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. Hello world! How are you today? I am fine, thank you.\n"
)


def build_tokenizer():  # type: ignore[no-untyped-def]
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([TEXT] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny(
    model_type: str, out_dir: Path, *, fused: bool = False, seed: int = 0, **overrides: object
) -> Path:
    """Write a tiny random `model_type` checkpoint (fp32) with tokenizer into `out_dir`.

    fused=True writes the model's own state dict (3-D `experts.gate_up_proj` tensors) instead of
    save_pretrained's per-expert checkpoint names; `overrides` change config fields."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kwargs = dict(COMMON)
    kwargs.update(CONFIGS[model_type])
    kwargs.update(overrides)
    config = AutoConfig.for_model(model_type, **kwargs)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("tid2eid"):  # DeepSeek-V4 hash routing: random, not all-zero
                buf.copy_(torch.randint(0, 8, buf.shape))
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.1)
        for name, p in model.named_parameters():
            # Random biases/norm weights so the paths they feed are exercised, not all 0 or 1.
            if p.dim() == 1 or name.endswith("_bias") or name.endswith("sinks"):
                p.add_(torch.randn(p.shape) * 0.1)
    out_dir = Path(out_dir)
    if fused:
        from safetensors.torch import save_file

        out_dir.mkdir(parents=True, exist_ok=True)
        config.save_pretrained(out_dir)
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        if getattr(config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)
        save_file(state, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    else:
        model.save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    return out_dir


def write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=1))


# --- the breadth path: a tiny checkpoint of any transformers MoE family -----------------------
# `breadth_config` shrinks a family's default config generically (the sizes below, wherever the
# family has the key; per-layer lists cut to one layer of each kind); BREADTH_EXTRAS holds what
# a family needs on top (its own validators, layer schedules).
BREADTH_SIZES: dict[str, object] = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    intermediate_size=64,
    moe_intermediate_size=32,
    max_position_embeddings=256,
    shared_expert_intermediate_size=32,
    moe_shared_expert_intermediate_size=32,
    shared_intermediate_size=32,
    shared_experts_intermediate_size=32,
    dense_intermediate_size=64,
    prefix_dense_intermediate_size=64,
    expert_intermediate_size=32,
    kv_lora_rank=16,
    q_lora_rank=32,
    qk_rope_head_dim=8,
    qk_nope_head_dim=8,
    v_head_dim=16,
    linear_key_head_dim=16,
    linear_value_head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    mamba_d_state=8,
    mamba_dt_rank=8,
    ssm_state_size=8,
    mamba_num_heads=4,
    mamba_head_dim=16,
    mamba_n_heads=4,
    mamba_d_head=32,
    n_groups=1,
    mamba_n_groups=1,
    chunk_size=16,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=8,
    sliding_window=16,
    n_group=1,
    topk_group=1,
    num_expert_group=1,
    max_window_layers=2,
    mlp_only_layers=[],
)
BREADTH_EXPERTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
BREADTH_TOP_K = (
    "num_experts_per_tok",
    "experts_per_token",
    "num_experts_per_token",
    "moe_k",
    "moe_topk",
    "top_k_experts",
)
BREADTH_SHARED = ("n_shared_experts", "num_shared_experts", "moe_num_shared_experts")
BREADTH_TOKENS = ("eos_token_id", "pad_token_id", "eod_token_id", "sep_token_id")
BREADTH_EXTRAS: dict[str, dict] = {
    "zaya": dict(num_experts_per_tok=1),  # its config allows top-1 only
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=1),
    "gemma4_text": dict(
        enable_moe_block=True,
        num_experts=8,
        top_k_experts=2,
        moe_intermediate_size=32,
        vocab_size_per_layer_input=VOCAB,
        hidden_size_per_layer_input=16,
        global_head_dim=16,
    ),
    # a Mamba layer and an attention layer, both MoE
    "jamba": dict(
        attn_layer_period=2, attn_layer_offset=1, expert_layer_period=1, expert_layer_offset=0
    ),
    "granitemoehybrid": dict(layer_types=["linear_attention", "full_attention"]),
    "qwen4_exp_text": dict(
        indexer_n_heads=2,
        indexer_kv_heads=1,
        indexer_head_dim=16,
        indexer_budget=8,
        indexer_compress_ratio=4,
        ngram_vocab_size_base=1000,
        make_ngram_vocab_size_divisible_by=8,
        heads_per_ngram=2,
    ),
    "dots3_note": dict(
        vision_config=dict(adapter_out_dim=64), audio_config=dict(adapter_out_dim=64)
    ),
}


def breadth_config(model_type: str, **overrides: object):  # type: ignore[no-untyped-def]
    """A tiny config of `model_type`: 2-4 layers, hidden 64, 8 experts, top-2."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    default = cls().to_dict()
    layers = default.get("num_hidden_layers")
    kw: dict[str, object] = {
        k: v
        for k, v in BREADTH_SIZES.items()
        if k in default and (v == [] or k == "head_dim" or default[k] is not None)
    }
    kw.update({k: 8 for k in BREADTH_EXPERTS if k in default})
    kw.update({k: 2 for k in BREADTH_TOP_K if k in default})
    kw.update({k: 1 for k in BREADTH_SHARED if k in default})
    kw.update({k: 0 for k in BREADTH_TOKENS if k in default})
    if "bos_token_id" in default:
        kw["bos_token_id"] = None
    if default.get("kv_lora_rank"):  # MLA: as many KV heads as heads, rope dims as head_dim
        kw["num_key_value_heads"] = 4
        if "head_dim" in default:
            kw["head_dim"] = BREADTH_SIZES["qk_rope_head_dim"]
    text = default.get("text_config")
    if isinstance(text, dict) and text.get("model_type") and text["model_type"] != model_type:
        # a composite config: the tiny text model inside (vision parts as the family has them)
        kw["text_config"] = breadth_config(text["model_type"]).to_dict()
    if default.get("first_k_dense_replace"):
        kw["first_k_dense_replace"] = 1
    # per-layer lists: keep the first layer of each kind (attention type, dense or MoE ...)
    lists = {
        k: v
        for k, v in default.items()
        if isinstance(v, list) and layers and len(v) == layers and k not in kw
    }
    chosen: list[int] = []
    for values in lists.values():
        names = [str(v) for v in values]
        for name in dict.fromkeys(names):
            if not any(names[i] == name for i in chosen):
                chosen.append(names.index(name))
    chosen = sorted(set(chosen)) or [0]
    while len(chosen) < 2:
        chosen.append(chosen[-1] + 1)
    if layers:
        kw["num_hidden_layers"] = len(chosen)
    for k, values in lists.items():
        kw[k] = [values[i] for i in chosen]
    for k in BREADTH_TOP_K:
        if isinstance(default.get(k), list):
            kw[k] = [2] * len(chosen)
    kw.update(BREADTH_EXTRAS.get(model_type, {}))
    kw.update(overrides)
    return cls(**kw)


def build_breadth(
    model_type: str,
    out_dir: Path,
    *,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    **overrides: object,
) -> Path:
    """Write a tiny random `model_type` checkpoint (save_pretrained, in `dtype`) with tokenizer."""
    from transformers import AutoModelForCausalLM

    config = breadth_config(model_type, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith(("e_score_correction_bias", "expert_bias")):
                buf.copy_(torch.randn(buf.shape) * 0.1)
        for name, p in model.named_parameters():
            # random biases / norm weights so the paths they feed are exercised
            if p.dim() == 1 or name.endswith("_bias"):
                p.add_(torch.randn(p.shape) * 0.1)
    model.to(dtype).save_pretrained(out_dir)
    build_tokenizer().save_pretrained(out_dir)
    return Path(out_dir)


def skip_without_transformers_family(model_type: str) -> None:
    """Skip the calling test where the installed transformers has no config class for
    `model_type` (5.17 lacks deepseek_v4, for one); any other failure is the test's."""
    import pytest
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    if model_type not in CONFIG_MAPPING_NAMES:
        pytest.skip(f"transformers has no {model_type} here")
