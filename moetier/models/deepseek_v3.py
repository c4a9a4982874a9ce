"""Native DeepSeek-V3 (HF model_type `deepseek_v3`: DeepSeek-V3/R1, Kimi K2): module names are the
checkpoint's, so the dense tensors of a moetier store load by name; routed experts run through
moetier's experts runtime, shared experts are a dense MLP beside them.

forward(input_ids [B, T], positions [B, T], cache) -> logits, prefill and decode alike, as
qwen3_moe. Attention is multi-head latent attention (layers.MLAttention) over a static latent
cache [layers, B, L, kv_lora_rank + qk_rope_head_dim]: per token the normalised KV latent and the
rotated rope key, what transformers' own cache holds (576 values per token and layer at the real
shape, against 128 heads x (192 + 128) for expanded keys and values); decode attends in the
latent space, so nothing is expanded per step. The first `first_k_dense_replace` layers have a
dense MLP; the rest a sigmoid, group-limited router (layers.SigmoidGroupTopKRouter).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moetier.config import DecoderConfig
from moetier.models.attention_batch import AttentionBatch
from moetier.models.layers import (
    MLP,
    Experts,
    MLAttention,
    NativeCausalLM,
    PreNormLayer,
    RMSNorm,
    RotaryEmbedding,
    SigmoidGroupTopKRouter,
    new_latent_cache,
)


class DeepseekV3MoE(nn.Module):
    """DeepseekV3MoE: router `gate`, routed experts (weights are the store's expert blobs; the
    loader sets `experts`) plus `shared_experts`, a SwiGLU MLP of n_shared_experts x the expert
    width, on the same input."""

    def __init__(self, config: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.gate = SigmoidGroupTopKRouter(
            config.hidden_size,
            config.num_experts,
            config.top_k,
            config.n_group,
            config.topk_group,
            config.norm_topk_prob,
            config.routed_scaling_factor,
        )
        self.shared_experts = MLP(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts
        )
        self.experts: Experts | None = None  # set by the loader
        # the experts runtime's look at the layer output (`PreNormLayer`; set by the loader)
        self.after_residual: Callable[[int, torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts is None:
            raise RuntimeError("experts not wired: load native models with moetier.loader")
        batch, tokens, hidden = x.shape
        flat = x.reshape(-1, hidden)  # [B*T, H]
        ids, weights = self.gate(flat)  # weights fp32, as transformers passes them
        routed = self.experts(self.layer, flat, ids, weights).view(batch, tokens, hidden)
        return routed + self.shared_experts(x)


class DecoderLayer(PreNormLayer):
    def __init__(self, config: DecoderConfig, layer: int) -> None:
        attention = MLAttention(
            layer,
            config.hidden_size,
            config.num_heads,
            config.q_lora_rank,
            config.kv_lora_rank,
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
            config.mla_softmax_scale,
            config.rope_interleave,
            bias=config.attention_bias,
        )
        mlp: nn.Module = (
            DeepseekV3MoE(config, layer)
            if layer in config.moe_layers
            else MLP(config.hidden_size, config.intermediate_size)
        )
        super().__init__(attention, mlp, config.hidden_size, config.rms_norm_eps)


class DeepseekV3Model(nn.Module):
    def __init__(self, config: DecoderConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = rotary

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: torch.Tensor,
        batch: AttentionBatch | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = self.rotary_emb(positions, x.dtype)  # [B, T, rope_dim]
        batch = batch or AttentionBatch.static(positions, cache.shape[2])
        folded = self.layer_batch(batch)
        for layer in self.layers:
            x = layer(x, cos, sin, folded, cache)
        return self.norm(x)

    def layer_batch(self, batch: AttentionBatch) -> AttentionBatch:
        """The batch the decoder layers take (an MTP layer's too): one latent key for all heads."""
        return batch.head_folded(self.num_heads)


class DeepseekV3ForCausalLM(NativeCausalLM):
    """The native model. `config` is the normalised DecoderConfig; `rotary` carries the inverse
    frequencies and attention scaling from transformers' DeepseekV3RotaryEmbedding (yarn's
    mscale included)."""

    def __init__(self, config: DecoderConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        if config.model_type != "deepseek_v3":
            raise ValueError(f"native deepseek_v3 model asked to build {config.model_type!r}")
        if not config.kv_lora_rank:
            raise ValueError("deepseek_v3 config without kv_lora_rank: not an MLA model")
        self.config = config
        self.model = DeepseekV3Model(config, rotary)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def new_cache(
        self, pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        """A zeroed latent cache [layers, pages, page_size, kv_lora_rank + rope_dim] (the
        static cache: one page of max_len positions per row)."""
        c = self.config
        width = c.kv_lora_rank + c.qk_rope_head_dim
        layers = c.num_layers + (1 if getattr(self, "mtp", None) is not None else 0)  # MTP's
        return new_latent_cache(layers, pages, page_size, width, dtype, device)
