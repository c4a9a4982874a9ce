"""Native GLM-4.5 / 4.6 / 4.7 (HF model_type `glm4_moe`): module names are the checkpoint's, so
the dense tensors of a moetier store load by name; routed experts run through moetier's experts
runtime, shared experts are a dense MLP beside them.

forward(input_ids [B, T], positions [B, T], cache[, batch]) -> logits, prefill and decode alike,
as qwen3_moe: grouped-query attention (layers.Attention) over the paged KV cache, so decode steps
read their pages in the GQA decode kernel and replay from CUDA graphs. What differs from
qwen3_moe, as transformers' Glm4Moe* computes it:
- partial rotary: only the first `partial_rotary_factor` of each head's dims rotate (the inverse
  frequencies come from transformers' own rotary module, `apply_rotary` keeps the rest);
- q/k RMSNorm only with `use_qk_norm`; biases on q, k and v with `attention_bias`, never on o;
- the first `first_k_dense_replace` layers have a dense MLP, the rest DeepSeek-V3's MoE block:
  sigmoid router with `e_score_correction_bias`, group-limited top-k (`n_group`, `topk_group`),
  `norm_topk_prob`, `routed_scaling_factor` (layers.SigmoidGroupTopKRouter), plus
  `shared_experts`.
"""

from __future__ import annotations

from torch import nn

from moetier.config import DecoderConfig
from moetier.models.deepseek_v3 import DeepseekV3MoE
from moetier.models.layers import (
    MLP,
    Attention,
    GQACausalLM,
    GQADecoderModel,
    PreNormLayer,
    RotaryEmbedding,
)

# transformers' Glm4MoeMoE is DeepSeek-V3's block (router `gate` with its correction bias, routed
# experts, `shared_experts`), parameter for parameter
Glm4MoeMoE = DeepseekV3MoE


def model_kwargs(hf: object) -> dict[str, bool]:
    """What the loader passes the model class beside the DecoderConfig (loader/native.py)."""
    return {"qk_norm": bool(getattr(hf, "use_qk_norm", False))}


class DecoderLayer(PreNormLayer):
    def __init__(self, config: DecoderConfig, layer: int, qk_norm: bool) -> None:
        attention = Attention(
            layer,
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.rms_norm_eps,
            bias=config.attention_bias,
            qk_norm=qk_norm,
        )
        # Glm4MoeAttention: attention_bias puts biases on q, k and v only
        attention.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, False)
        mlp: nn.Module = (
            Glm4MoeMoE(config, layer)
            if layer in config.moe_layers
            else MLP(config.hidden_size, config.intermediate_size)
        )
        super().__init__(attention, mlp, config.hidden_size, config.rms_norm_eps)


class Glm4MoeForCausalLM(GQACausalLM):
    """The native model. `config` is the normalised DecoderConfig; `rotary` carries the inverse
    frequencies of transformers' Glm4MoeRotaryEmbedding (partial rotary included); `qk_norm` is
    the config's use_qk_norm."""

    def __init__(self, config: DecoderConfig, rotary: RotaryEmbedding, qk_norm: bool) -> None:
        super().__init__()
        if config.model_type != "glm4_moe":
            raise ValueError(f"native glm4_moe model asked to build {config.model_type!r}")
        self.config = config
        self.qk_norm = qk_norm
        layers = [DecoderLayer(config, i, qk_norm) for i in range(config.num_layers)]
        self.model = GQADecoderModel(config, rotary, layers)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def new_layer(self, config: DecoderConfig, layer: int) -> DecoderLayer:
        """A decoder layer of this model's kind at index `layer` (an MTP layer's block)."""
        return DecoderLayer(config, layer, self.qk_norm)
