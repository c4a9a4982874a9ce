"""Native MiniMax-M2 (HF model_type `minimax_m2`): module names are the checkpoint's, so the dense
tensors of a moetier store load by name; routed experts run through moetier's experts runtime.

forward(input_ids [B, T], positions [B, T], cache[, batch]) -> logits, as qwen3_moe: grouped-
query attention (layers.Attention) over the paged KV cache, so decode steps read their pages in
the GQA decode kernel and replay from CUDA graphs. What differs, as transformers' MiniMaxM2*
computes it:
- q/k RMSNorm over the whole projection (all heads' dims at once), not per head;
- partial rotary (`partial_rotary_factor`, the real release's rotary_dim 64 of 128);
- every layer is MoE, no shared expert; the router is sigmoid scores, the choice adds
  `e_score_correction_bias` (held by the MoE block, not by its `gate`), the weights are the
  chosen experts' unbiased scores renormalised to sum to one.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetier.config import DecoderConfig
from moetier.models.layers import (
    Attention,
    GQACausalLM,
    GQADecoderModel,
    PreNormLayer,
    RotaryEmbedding,
)
from moetier.models.qwen3_moe import SparseMoeBlock

KEEP_FP32 = ("e_score_correction_bias", "mlp.gate.weight")


class MiniMaxM2TopKRouter(nn.Module):
    """transformers' MiniMaxM2TopKRouter, in fp32: sigmoid scores; top-k of scores + bias; the
    chosen scores renormalised. Shape-static (no host sync)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.top_k = top_k

    def forward(self, x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32)."""
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        ids = torch.topk(scores + bias, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        return ids, weights / weights.sum(dim=-1, keepdim=True)


class MiniMaxM2SparseMoeBlock(SparseMoeBlock):
    """Qwen3-MoE's block with MiniMax-M2's router `gate` and the block's own
    `e_score_correction_bias`; routed experts are the store's blobs (the loader sets
    `experts`)."""

    def __init__(self, config: DecoderConfig, layer: int) -> None:
        super().__init__(config, layer)
        self.gate = MiniMaxM2TopKRouter(config.hidden_size, config.num_experts, config.top_k)
        self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts))

    def route(self, flat: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.gate(flat, self.e_score_correction_bias)


class DecoderLayer(PreNormLayer):
    def __init__(self, config: DecoderConfig, layer: int) -> None:
        attention = Attention(
            layer,
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.rms_norm_eps,
            flat_qk_norm=True,
        )
        mlp = MiniMaxM2SparseMoeBlock(config, layer)
        super().__init__(attention, mlp, config.hidden_size, config.rms_norm_eps)


class MiniMaxM2ForCausalLM(GQACausalLM):
    """The native model. `config` is the normalised DecoderConfig; `rotary` carries the inverse
    frequencies of transformers' MiniMaxM2RotaryEmbedding (partial rotary included)."""

    def __init__(self, config: DecoderConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        if config.model_type != "minimax_m2":
            raise ValueError(f"native minimax_m2 model asked to build {config.model_type!r}")
        if set(config.moe_layers) != set(range(config.num_layers)):
            raise ValueError("native minimax_m2 expects every layer to be MoE")
        self.config = config
        self.model = GQADecoderModel(
            config, rotary, [DecoderLayer(config, i) for i in range(config.num_layers)]
        )
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
