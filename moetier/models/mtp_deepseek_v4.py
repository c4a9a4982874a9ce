"""DeepSeek-V4's multi-token-prediction (MTP) layer, for speculative decoding (loader/mtp.py).

What it computes, from DeepSeek's own inference code (`inference/model.py` of the
DeepSeek-V4-Flash / -Pro releases: `class MTPBlock(Block)`, read in copies of that file such as
github.com/Nicooo-Wang/DeepSeek-V4-Pro-code) and vLLM's `deepseek_v4_mtp.py`
(DeepSeekV4MultiTokenPredictorLayer, vllm-project/vllm), which agree:

- Names. The checkpoint keeps MTP layer i as `mtp.{i}.*` (not `model.layers.{L + i}` as V3):
  `e_proj.weight` and `h_proj.weight` ([H, H] each, V3's `eh_proj` split in two), `enorm`,
  `hnorm`, `norm` (RMSNorms), `hc_head_fn` [hc, hc H], `hc_head_base` [hc], `hc_head_scale` [1]
  (the layer's own hyper-connection head), and one decoder block named as a main layer's
  (`attn.*`, `attn_norm`, `ffn_norm`, `hc_attn_*`, `hc_ffn_*`, `ffn.gate.*`,
  `ffn.shared_experts.*`, `ffn.experts.{e}.w1/w2/w3`). The embedding and the LM head are the
  main model's (`MTPBlock.embed` / `.head` are assigned, not stored); a checkpoint that carries
  `mtp.{i}.head.weight` has its own head (vLLM loads one there), and its own embedding copy
  (`emb.tok_emb.weight`) is never read.
- Forward, at position p (DeepSeek's reference): x = the main model's hyper-connection
  streams after its last block, *before* its `hc_head` collapse ([B, T, hc, H]); e = the
  embedding of the token at p + 1;
      x = e_proj(enorm(e))[:, :, None] + h_proj(hnorm(x))   (hnorm per stream, over H)
      x = Block.forward(x)                                    (a whole V4 decoder block: attn_hc,
                                                               attention, ffn_hc, MoE)
      logits = head(norm(hc_head(x; hc_head_fn, hc_head_scale, hc_head_base)))
  so hyper-connections enter as the main model's streams (the embedding broadcast to every
  stream) and leave through the layer's own `hc_head` collapse (sigmoid weights of the
  RMS-normed flattened streams, + hc_eps, as the main model's final collapse) and its own `norm`
  before the shared LM head. vLLM keeps the target's pre-`hc_head` streams flat [T, hc H] for it
  and, for drafts past the first, feeds the layer's own output streams back in, as here.
- The block is layer `num_hidden_layers + i` of DeepSeek's code: its attention type is
  `compress_ratios[num_hidden_layers + i]` of the release's config.json (44 entries for the
  43 layers of V4-Flash, the last one 0: sliding-window attention, no compressor, no indexer;
  transformers' config keeps only the first num_hidden_layers, so loader/mtp.py reads the raw
  list and refuses a config without the entry); its router is not hashed (DeepSeek: hashed iff
  layer_id < n_hash_layers; vLLM passes no token ids).
- Not taken from vLLM: it zeroes the embedding at position 0 before `enorm` ("not needed by
  MTP"); DeepSeek's reference does not, and neither does this file (nor models/mtp.py for V3).

Here the block is models/deepseek_v4.py's DecoderLayer at index num_hidden_layers + i, so its
rows go to the cache's layer num_hidden_layers + i and its routed experts are the store's MTP
blobs of that layer. The main model hands the drafter its final streams flattened [.., hc H]
(DeepseekV4ForCausalLM.feed_mtp); `step` -> the block's output streams, flattened the same way
(chained drafts read them back); `logits` collapses them.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import nn

from moetier.models.attention_batch import AttentionBatch
from moetier.models.deepseek_v4 import DecoderLayer, DeepseekV4Config, HyperHead
from moetier.models.deepseek_v4_attention import Positions, V4RMSNorm

# an MTP layer's own tensors in the checkpoint, after its prefix `mtp.{i}.` -> name here
OWN = {
    "e_proj.weight": "e_proj.weight",
    "h_proj.weight": "h_proj.weight",
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "norm.weight": "norm.weight",
    "hc_head_fn": "hc_head.hc_fn",
    "hc_head_base": "hc_head.hc_base",
    "hc_head_scale": "hc_head.hc_scale",
    "head.weight": "head.weight",
}
SHARED_COPIES = ("emb.", "embed.", "embed_tokens.")  # copies of the main embedding: not read


class DeepseekV4MTPLayer(nn.Module):
    def __init__(self, block: DecoderLayer, config: DeepseekV4Config, own_head: bool) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.hc, self.hidden, self.window = config.hc_mult, hidden, config.sliding_window
        self.e_proj = nn.Linear(hidden, hidden, bias=False)
        self.h_proj = nn.Linear(hidden, hidden, bias=False)
        self.enorm = V4RMSNorm(hidden, eps)
        self.hnorm = V4RMSNorm(hidden, eps)
        self.norm = V4RMSNorm(hidden, eps)
        self.hc_head = HyperHead(hidden, config.hc_mult, config.hc_eps, eps)
        self.block = block
        self.head = nn.Linear(hidden, config.vocab_size, bias=False) if own_head else None

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        input_ids: torch.Tensor,
        where: Positions,
        batch: AttentionBatch,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        """embeds [B, T, H] of the next tokens (input_ids [B, T]); hidden [B, T, hc H]: the
        previous streams, flattened (the main model's before its hc_head, or this layer's own
        when chaining) -> this layer's output streams [B, T, hc H]."""
        streams = hidden.unflatten(-1, (self.hc, self.hidden))
        x = self.e_proj(self.enorm(embeds))[:, :, None] + self.h_proj(self.hnorm(streams))
        return self.block(x, input_ids, where, batch, cache).flatten(2)

    def step(
        self,
        model: Any,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        batch: AttentionBatch,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        """The drafter's call (as MTPLayer.step): `model` the main DeepseekV4Model (its
        embedding and ropes), input_ids [B, T] the next tokens -> [B, T, hc H]."""
        embeds = model.embed_tokens(input_ids)
        where = Positions.build(batch, model.rotary_emb, self.window, embeds.dtype)
        return self(embeds, hidden, input_ids, where, batch, cache)

    def logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """hidden [.., hc H] (this layer's output streams) -> logits: the layer's own hc_head
        collapse and norm, then its own head or the main model's."""
        streams = hidden.unflatten(-1, (self.hc, self.hidden))
        head = self.head if self.head is not None else lm_head
        return head(self.norm(self.hc_head(streams)))


def block_config(config: DeepseekV4Config, kind: str) -> DeepseekV4Config:
    """The config a DecoderLayer at index num_layers reads: the MTP layer's attention type
    `kind`, a router that is not hashed."""
    return dataclasses.replace(
        config,
        layer_types=(*config.layer_types, kind),
        mlp_layer_types=(*config.mlp_layer_types, "moe"),
    )
