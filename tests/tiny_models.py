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
