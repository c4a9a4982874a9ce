"""Native GLM-5 (HF model_type `glm_moe_dsa`): DeepSeek-V3-style MLA with a DeepSeek Sparse
Attention indexer (models/dsa_indexer.py), a sigmoid group-limited router with shared experts,
dense first layers. Module names are the checkpoint's, so the dense tensors of a moetier store
load by name; routed experts run through moetier's experts runtime.

forward(input_ids [B, T], positions [B, T], cache[, batch]) -> logits, prefill and decode alike,
as deepseek_v3. Attention is layers.MLAttention's latent-space attention (kv_b_proj folded into
the query and the output, one shared latent key for every head), always with interleaved rope
as transformers applies it here, restricted per query token to the keys the indexer picks: a
"full" layer (`indexer_types`) runs its own indexer, a "shared" layer reuses the selection of the
layer before. The cache is one tensor [layers, pages, page_size, kv_lora_rank + rope_dim +
index_head_dim]: per token and layer the normalised latent, the rotated rope key and the
indexer's key, written and read with the paged cache's rules (models/attention_batch.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moetier.config import DecoderConfig
from moetier.models.attention_batch import AttentionBatch
from moetier.models.deepseek_v3 import DeepseekV3MoE
from moetier.models.dense_linear import dense_weight
from moetier.models.dsa_indexer import DsaIndexer
from moetier.models.layers import (
    MLP,
    MLAttention,
    NativeCausalLM,
    PreNormLayer,
    RMSNorm,
    RotaryEmbedding,
    apply_rotary_interleaved,
    new_latent_cache,
)


@dataclass(frozen=True)
class DsaConfig:
    """The facts of GLM-5's sparse attention, from the transformers config."""

    index_n_heads: int
    index_head_dim: int
    index_topk: int
    indexer_types: tuple[str, ...]  # per layer: "full" runs its indexer, "shared" reuses

    @classmethod
    def from_transformers(cls, hf: Any) -> DsaConfig:
        layers = int(hf.num_hidden_layers)
        types = tuple(getattr(hf, "indexer_types", None) or ("full",) * layers)
        if len(types) != layers or set(types) - {"full", "shared"}:
            raise ValueError(f"indexer_types {types} is not 'full' / 'shared' per layer")
        if types and types[0] != "full":
            raise ValueError("the first layer of a glm_moe_dsa model must run its own indexer")
        return cls(int(hf.index_n_heads), int(hf.index_head_dim), int(hf.index_topk), types)


def model_kwargs(hf: Any) -> dict[str, Any]:
    """What the loader passes the model class beside the DecoderConfig (loader/native.py)."""
    sparse = getattr(hf, "mlp_layer_types", None)
    if sparse is not None:
        layers = tuple(i for i, kind in enumerate(sparse) if kind == "sparse")
        if layers != DecoderConfig.from_transformers(hf).moe_layers:
            raise ValueError(
                f"mlp_layer_types {list(sparse)} does not put the MoE layers after "
                "first_k_dense_replace: not supported natively, run without --native"
            )
    return {"dsa": DsaConfig.from_transformers(hf)}


class GlmMoeDsaAttention(MLAttention):
    """transformers' GlmMoeDsaAttention: MLA (q low-rank always, interleaved rope) whose query
    tokens see only the keys their indexer (or the layer before's, on "shared" layers) picks."""

    # the indexer scores every cached index key and attention reads the top-k it picks: both
    # over gathered keys and masks, so the engine's decode steps gather pages, over a context
    # bucket's width in its CUDA graphs (engine/decode_graphs.py); moetier::mla_decode would
    # need the selection as an index input
    pages_in_kernel = False

    def __init__(self, config: DecoderConfig, dsa: DsaConfig, layer: int) -> None:
        super().__init__(
            layer,
            config.hidden_size,
            config.num_heads,
            config.q_lora_rank,
            config.kv_lora_rank,
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
            config.v_head_dim,
            config.mla_softmax_scale,
            interleave=True,
            bias=config.attention_bias,
        )
        self.indexer: DsaIndexer | None = None
        if dsa.indexer_types[layer] == "full":
            self.indexer = DsaIndexer(
                config.hidden_size,
                config.q_lora_rank,
                dsa.index_n_heads,
                dsa.index_head_dim,
                config.qk_rope_head_dim,
                dsa.index_topk,
            )
        self.index_dim = dsa.index_head_dim

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        cache: torch.Tensor,
        chosen: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [B, T, H]; batch with its causal mask [B, 1, T, Lk] (not head-folded); cache
        [layers, pages, page_size, lora + rope + index_dim] (this layer's entries written in
        place); chosen: the keys the layer before picked ([B, 1, T, Lk] bool; "shared" layers)
        -> (output [B, T, H], the keys this layer attended to)."""
        if batch.mask is None:
            raise ValueError("glm_moe_dsa attends through masks: build the batch with its keys")
        rows, tokens, _ = x.shape
        lora, nope, rope, v_dim = self.dims
        q_resid = self.q_a_layernorm(self.q_a_proj(x))
        q = self.q_b_proj(q_resid).view(rows, tokens, self.num_heads, nope + rope).transpose(1, 2)
        q_nope, q_rot = q.split([nope, rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([lora, rope], dim=-1)
        q_rot = apply_rotary_interleaved(q_rot, cos, sin)
        k_rot = apply_rotary_interleaved(k_rot[:, None], cos, sin)[:, 0]
        parts = [self.kv_a_layernorm(latent), k_rot]
        if self.indexer is not None:
            parts.append(self.indexer.key(x, cos, sin))
        else:  # a "shared" layer keeps no index keys: zeros, finite as the rest of the cache
            parts.append(x.new_zeros(rows, tokens, self.index_dim))
        batch.write(cache, self.layer, -1, torch.cat(parts, dim=-1))
        keys = batch.keys(cache[self.layer])  # [B, Lk, lora + rope + index_dim]
        if self.indexer is not None:
            chosen = self.indexer.select(x, q_resid, cos, sin, keys[..., lora + rope :], batch.mask)
        elif chosen is None:
            raise ValueError("a 'shared' DSA layer needs the selection of a layer before it")
        mask = chosen[:, :, None].expand(rows, 1, self.num_heads, tokens, chosen.shape[-1])
        w_kv = dense_weight(self.kv_b_proj, x.dtype).view(self.num_heads, nope + v_dim, lora)
        w_k, w_v = w_kv[:, :nope], w_kv[:, nope:]  # [h, nope, lora], [h, v, lora]
        query = torch.cat((q_nope @ w_k, q_rot), dim=-1)  # [B, h, T, lora + rope]
        latent_keys = keys[:, None, :, : lora + rope]  # [B, 1, Lk, lora + rope]: all heads'
        out = F.scaled_dot_product_attention(
            query.reshape(rows, 1, -1, lora + rope),  # [B, 1, h * T, lora + rope]
            latent_keys,
            latent_keys[..., :lora],  # the latent is the value
            attn_mask=mask.reshape(rows, 1, -1, chosen.shape[-1]),
            scale=self.scale,
        )  # [B, 1, h * T, lora]
        out = out.view(rows, self.num_heads, tokens, lora) @ w_v.transpose(1, 2)  # [B, h, T, v]
        return self.o_proj(out.transpose(1, 2).reshape(rows, tokens, -1)), chosen


class DecoderLayer(PreNormLayer):
    """PreNormLayer whose attention also hands on the keys it picked (for "shared" layers)."""

    self_attn: GlmMoeDsaAttention

    def __init__(self, config: DecoderConfig, dsa: DsaConfig, layer: int) -> None:
        mlp: nn.Module = (
            DeepseekV3MoE(config, layer)
            if layer in config.moe_layers
            else MLP(config.hidden_size, config.intermediate_size)
        )
        attention = GlmMoeDsaAttention(config, dsa, layer)
        super().__init__(attention, mlp, config.hidden_size, config.rms_norm_eps)

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        cache: torch.Tensor,
        chosen: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        attended, chosen = self.self_attn(self.input_layernorm(x), cos, sin, batch, cache, chosen)
        x = x + attended
        x = x + self.mlp(self.post_attention_layernorm(x))
        after = getattr(self.mlp, "after_residual", None)  # MoE blocks: ExpertsRuntime's
        if after is not None:
            after(self.mlp.layer, x)
        return x, chosen


class GlmMoeDsaModel(nn.Module):
    def __init__(self, config: DecoderConfig, dsa: DsaConfig, rotary: RotaryEmbedding) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, dsa, i) for i in range(config.num_layers))
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
        chosen = None
        for layer in self.layers:
            x, chosen = layer(x, cos, sin, batch, cache, chosen)
        return self.norm(x)


class GlmMoeDsaForCausalLM(NativeCausalLM):
    """The native model. `config` is the normalised DecoderConfig, `dsa` the sparse-attention
    facts; `rotary` carries the inverse frequencies and attention scaling of transformers'
    GlmMoeDsaRotaryEmbedding (over the rope dims)."""

    def __init__(self, config: DecoderConfig, rotary: RotaryEmbedding, dsa: DsaConfig) -> None:
        super().__init__()
        if config.model_type != "glm_moe_dsa":
            raise ValueError(f"native glm_moe_dsa model asked to build {config.model_type!r}")
        if not config.kv_lora_rank or not config.q_lora_rank:
            raise ValueError("glm_moe_dsa needs kv_lora_rank and q_lora_rank (MLA, q low-rank)")
        if dsa.index_head_dim < config.qk_rope_head_dim:
            raise ValueError("index_head_dim is smaller than qk_rope_head_dim")
        self.config = config
        self.dsa = dsa
        self.model = GlmMoeDsaModel(config, dsa, rotary)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def new_layer(self, config: DecoderConfig, layer: int) -> DecoderLayer:
        """A decoder layer at index `layer` (an MTP layer's block: past the stack, it runs its
        own indexer)."""
        types = self.dsa.indexer_types
        if layer >= len(types):
            types = (*types, *("full",) * (layer + 1 - len(types)))
        return DecoderLayer(config, dataclasses.replace(self.dsa, indexer_types=types), layer)

    def new_cache(
        self, pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        """A zeroed cache [layers, pages, page_size, kv_lora_rank + rope_dim + index_head_dim]
        (the static cache: one page of max_len positions per row)."""
        c = self.config
        width = c.kv_lora_rank + c.qk_rope_head_dim + self.dsa.index_head_dim
        layers = c.num_layers + (1 if getattr(self, "mtp", None) is not None else 0)  # MTP's
        return new_latent_cache(layers, pages, page_size, width, dtype, device)
