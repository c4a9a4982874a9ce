"""Multi-token prediction (MTP) layers, DeepSeek's layout (research/serving.md §3): the layer
after the decoder stack, `model.layers.{num_hidden_layers + i}.*` in the checkpoint, holding
`enorm` (RMSNorm of the next token's embedding), `hnorm` (RMSNorm of the main model's hidden
state), `eh_proj` ([H, 2H] over their concatenation, embedding first), an ordinary decoder block
(`self_attn`, `mlp`, `input_layernorm`, `post_attention_layernorm`: the family's own layer, with
its own KV in the cache's layer `num_hidden_layers + i`) and `shared_head.norm` (+
`shared_head.head`, else the main model's LM head).

At position p the layer reads the main model's final hidden state h_p and the embedding of the
token at p + 1 and predicts the token at p + 2; applied again on its own output hidden state and
its own draft (EAGLE-style chaining) it drafts further tokens. `forward` -> the block's output
hidden state [B, T, H]; `logits` reads it through the shared head.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moetier.models.attention_batch import AttentionBatch
from moetier.models.layers import RMSNorm

# checkpoint names of an MTP layer's own tensors (the rest belong to its decoder block)
OWN = ("enorm.", "hnorm.", "eh_proj.", "shared_head.", "embed_tokens.")


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, eps: float, own_head: bool) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)
        self.head = nn.Linear(hidden_size, vocab_size, bias=False) if own_head else None


class MTPLayer(nn.Module):
    def __init__(
        self, block: nn.Module, hidden_size: int, vocab_size: int, eps: float, own_head: bool
    ) -> None:
        super().__init__()
        self.enorm = RMSNorm(hidden_size, eps)
        self.hnorm = RMSNorm(hidden_size, eps)
        self.eh_proj = nn.Linear(2 * hidden_size, hidden_size, bias=False)
        self.block = block
        self.shared_head = SharedHead(hidden_size, vocab_size, eps, own_head)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        """embeds: the next tokens' embeddings, hidden: the previous hidden states (the main
        model's, or this layer's own when chaining), both [B, T, H] -> [B, T, H]."""
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        out = self.block(x, cos, sin, batch, cache)
        return out[0] if isinstance(out, tuple) else out  # (GLM-5's layers hand on more)

    def step(
        self,
        model: Any,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        batch: AttentionBatch,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        """The drafter's call: `model` the main decoder (its embedding and rotary), input_ids
        [B, T] the next tokens, hidden [B, T, H] -> forward's output."""
        embeds = model.embed_tokens(input_ids)
        cos, sin = model.rotary_emb(batch.positions, embeds.dtype)
        return self(embeds, hidden, cos, sin, batch, cache)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        head = self.shared_head.head if self.shared_head.head is not None else lm_head
        return head(self.shared_head.norm(hidden))


def module_name(key: str, prefix: str) -> str | None:
    """A checkpoint tensor `prefix` + rest -> its name in MTPLayer (the block's tensors under
    `block.`); None if the key is not the layer's or is its copy of the embedding (shared with
    the main model)."""
    if not key.startswith(prefix):
        return None
    rest = key[len(prefix) :]
    if rest.startswith("embed_tokens."):
        return None
    return rest if rest.startswith(OWN) else f"block.{rest}"
