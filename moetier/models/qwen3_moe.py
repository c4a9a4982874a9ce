"""Native Qwen3-MoE (HF model_type `qwen3_moe`): module names are the checkpoint's, so the dense
tensors of a moetier store load by name; routed experts run through moetier's experts runtime.

forward(input_ids [B, T], positions [B, T], cache[, batch]) -> logits: the same code for prefill
and decode, over the paged KV cache of layers.py (default: the static cache, one page a row; no
host syncs outside the experts runtime's residency step; see ExpertsRuntime.forward_resident for
the capturable experts call).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from moetier.config import DecoderConfig
from moetier.models.layers import (
    MLP,
    Attention,
    Experts,
    GQACausalLM,
    GQADecoderModel,
    PreNormLayer,
    RotaryEmbedding,
    SoftmaxTopKRouter,
)


class SparseMoeBlock(nn.Module):
    """Qwen3MoeSparseMoeBlock: softmax top-k router `gate`, routed experts (no shared expert).
    `experts` owns no parameters: its weights are the store's expert blobs."""

    def __init__(self, config: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.gate: nn.Module = SoftmaxTopKRouter(
            config.hidden_size, config.num_experts, config.top_k, config.norm_topk_prob
        )
        self.experts: Experts | None = None  # set by the loader
        # the experts runtime's look at the layer output (`PreNormLayer`; set by the loader)
        self.after_residual: Callable[[int, torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts is None:
            raise RuntimeError("experts not wired: load native models with moetier.loader")
        batch, tokens, hidden = x.shape
        flat = x.reshape(-1, hidden)  # [B*T, H]
        ids, weights = self.route(flat)
        return self.experts(self.layer, flat, ids, weights).view(batch, tokens, hidden)

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """[T, H] -> top-k expert ids and routing weights [T, k]."""
        return self.gate(flat)


class DecoderLayer(PreNormLayer):
    def __init__(self, config: DecoderConfig, layer: int) -> None:
        attention = Attention(
            layer,
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.rms_norm_eps,
            bias=config.attention_bias,
        )
        mlp: nn.Module = (
            SparseMoeBlock(config, layer)
            if layer in config.moe_layers
            else MLP(config.hidden_size, config.intermediate_size)
        )
        super().__init__(attention, mlp, config.hidden_size, config.rms_norm_eps)


class Qwen3MoeForCausalLM(GQACausalLM):
    """The native model. `config` is the normalised DecoderConfig; `rotary` carries the inverse
    frequencies from transformers' rope initialiser for this config."""

    def __init__(self, config: DecoderConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        if config.model_type != "qwen3_moe":
            raise ValueError(f"native qwen3_moe model asked to build {config.model_type!r}")
        self.config = config
        self.model = GQADecoderModel(
            config, rotary, [DecoderLayer(config, i) for i in range(config.num_layers)]
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
