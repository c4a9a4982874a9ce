"""Native DeepSeek-V4 (HF model_type `deepseek_v4`: DeepSeek-V4-Flash / Pro): module names are
the checkpoint's, so the dense tensors of a moetier store load by name; routed experts run
through moetier's experts runtime, the shared expert is a clamped SwiGLU beside them.

What transformers' DeepseekV4 computes, and so this file: the residual is `hc_mult` streams
[B, T, hc, H] mixed by manifold-constrained hyper-connections (`attn_hc`, `ffn_hc`: sigmoid
collapse / expand weights and a Sinkhorn-normalised mixing matrix; `hc_head` collapses them at
the end); attention per layer type (sliding window, compressed sparse with a lightning indexer,
heavily compressed: deepseek_v4_attention.py, over a position-indexed paged cache); MoE layers
route by a frozen token -> experts table (`hash_moe` layers) or by sqrt-softplus scores plus a
correction bias (top-k, renormalised, scaled); experts and shared expert clamp gate and up
(`swiglu_limit`). forward(input_ids, positions, cache[, batch]) -> logits, prefill and decode
alike, shape-static (no host sync outside the experts runtime), as the other native files.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moetier.models.attention_batch import AttentionBatch
from moetier.models.deepseek_v4_attention import (
    CSA,
    HCA,
    SLIDING,
    DeepseekV4Attention,
    Positions,
    V4RMSNorm,
    V4Rotary,
    row_layout,
    unweighted_rms_norm,
)
from moetier.models.layers import Experts, NativeCausalLM

SCORE_FUNCTIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sqrtsoftplus": lambda x: F.softplus(x).sqrt(),
    "sigmoid": torch.sigmoid,
}
# parameters transformers keeps in fp32 at any dtype (its _keep_in_fp32_modules_strict)
KEEP_FP32 = (
    "_hc.fn",
    "_hc.base",
    "_hc.scale",
    "hc_head.hc_fn",
    "hc_head.hc_base",
    "hc_head.hc_scale",
    "sinks",
    "position_bias",
    "e_score_correction_bias",
    "norm.weight",  # every DeepseekV4RMSNorm of the model is kept in fp32
)


@dataclass(frozen=True)
class DeepseekV4Config:
    """The facts the native file needs, read from transformers' DeepseekV4Config (whose own
    __post_init__ has folded the legacy keys and filled the defaults)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    rms_norm_eps: float
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_rates: dict[str, int]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    mlp_layer_types: tuple[str, ...]
    num_experts: int
    top_k: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    scoring_func: str
    swiglu_limit: float
    mlp_bias: bool
    max_position_embeddings: int
    tie_word_embeddings: bool
    # the attention type of each MTP layer that is loaded (models/mtp_deepseek_v4.py)
    mtp_layer_types: tuple[str, ...] = ()

    @property
    def moe_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers))  # every V4 layer is a MoE layer

    @property
    def cache_width(self) -> int:
        """Values a cache row holds per token and layer (the widest layer type's, MTP layers'
        included)."""
        kinds = (*self.layer_types, *self.mtp_layer_types)
        return max(row_layout(kind, self.head_dim, self.index_head_dim).width for kind in kinds)

    @classmethod
    def from_transformers(cls, hf: Any) -> DeepseekV4Config:
        if hf.model_type != "deepseek_v4":
            raise ValueError(f"native deepseek_v4 model asked to build {hf.model_type!r}")
        if hf.scoring_func not in SCORE_FUNCTIONS:
            raise ValueError(
                f"deepseek_v4 scoring_func {hf.scoring_func!r} is not in the native file "
                f"(supported: {', '.join(SCORE_FUNCTIONS)}): run it with --no-native"
            )
        if hf.hidden_act not in ("silu", "swish"):
            raise ValueError(f"deepseek_v4 hidden_act {hf.hidden_act!r} is not supported")
        return cls(
            model_type=hf.model_type,
            vocab_size=int(hf.vocab_size),
            hidden_size=int(hf.hidden_size),
            num_layers=int(hf.num_hidden_layers),
            num_heads=int(hf.num_attention_heads),
            head_dim=int(hf.head_dim),
            q_lora_rank=int(hf.q_lora_rank),
            o_groups=int(hf.o_groups),
            o_lora_rank=int(hf.o_lora_rank),
            rms_norm_eps=float(hf.rms_norm_eps),
            sliding_window=int(hf.sliding_window),
            layer_types=tuple(hf.layer_types),
            compress_rates={k: int(v) for k, v in hf.compress_rates.items()},
            index_n_heads=int(hf.index_n_heads),
            index_head_dim=int(hf.index_head_dim),
            index_topk=int(hf.index_topk),
            hc_mult=int(hf.hc_mult),
            hc_sinkhorn_iters=int(hf.hc_sinkhorn_iters),
            hc_eps=float(hf.hc_eps),
            mlp_layer_types=tuple(hf.mlp_layer_types),
            num_experts=int(hf.n_routed_experts),
            top_k=int(hf.num_experts_per_tok),
            moe_intermediate_size=int(hf.moe_intermediate_size),
            routed_scaling_factor=float(hf.routed_scaling_factor),
            scoring_func=str(hf.scoring_func),
            swiglu_limit=float(hf.swiglu_limit),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            max_position_embeddings=int(hf.max_position_embeddings),
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        )


def setup(hf_config: Any) -> tuple[DeepseekV4Config, V4Rotary]:
    """The loader's hook: the config and both ropes as transformers' own rotary computes them."""
    from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

    config = DeepseekV4Config.from_transformers(hf_config)
    with torch.device("cpu"):
        rotary: Any = hf.DeepseekV4RotaryEmbedding(config=hf_config)
    return config, V4Rotary(
        rotary.main_inv_freq,
        float(rotary.main_attention_scaling),
        rotary.compress_inv_freq,
        float(rotary.compress_attention_scaling),
    )


class HyperConnection(nn.Module):
    """transformers' DeepseekV4HyperConnection (fp32): from the hc streams, the collapse
    (`pre`), expand (`post`) and Sinkhorn-normalised mixing (`comb`) weights."""

    def __init__(self, hidden: int, hc: int, iters: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc, self.iters, self.eps, self.norm_eps = hc, iters, eps, norm_eps
        self.fn = nn.Parameter(torch.zeros((2 + hc) * hc, hc * hidden))
        self.base = nn.Parameter(torch.zeros((2 + hc) * hc))
        self.scale = nn.Parameter(torch.ones(3))

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [B, T, hc, H] -> (post [B, T, hc], comb [B, T, hc, hc] fp32, collapsed
        [B, T, H] in the streams' dtype)."""
        hc = self.hc
        flat = unweighted_rms_norm(streams.flatten(2).float(), self.norm_eps)
        pre_w, post_w, comb_w = F.linear(flat, self.fn.float()).split([hc, hc, hc * hc], dim=-1)
        pre_b, post_b, comb_b = self.base.split([hc, hc, hc * hc])
        pre_s, post_s, comb_s = self.scale.unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        comb_w = comb_w.view(*comb_w.shape[:-1], hc, hc)
        comb = torch.softmax(comb_w * comb_s + comb_b.view(hc, hc), dim=-1) + self.eps
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.eps)
        collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
        return post, comb, collapsed


class HyperHead(nn.Module):
    """transformers' DeepseekV4HyperHead: the final collapse of the streams."""

    def __init__(self, hidden: int, hc: int, eps: float, norm_eps: float) -> None:
        super().__init__()
        self.eps, self.norm_eps = eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc, hc * hidden))
        self.hc_base = nn.Parameter(torch.zeros(hc))
        self.hc_scale = nn.Parameter(torch.ones(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [.., hc, H] -> [.., H]."""
        flat = unweighted_rms_norm(x.flatten(-2).float(), self.norm_eps)
        mixes = F.linear(flat, self.hc_fn.float())
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.eps
        return (pre.unsqueeze(-1) * x).sum(dim=-2).to(x.dtype)


class ClampedMLP(nn.Module):
    """transformers' DeepseekV4MLP (the shared expert): down(silu(min(gate, l)) * clamp(up))."""

    def __init__(self, hidden: int, intermediate: int, limit: float, bias: bool) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate = self.gate_proj(x).clamp(max=self.limit)
        up = self.up_proj(x).clamp(min=-self.limit, max=self.limit)
        return self.down_proj(F.silu(gate) * up)


class Router(nn.Module):
    """transformers' DeepseekV4TopKRouter (`hashed=False`: top-k of the scores plus
    `e_score_correction_bias`) or DeepseekV4HashRouter (`hashed`: the experts of `tid2eid`
    [vocab, k] for the token id); weights are the chosen scores, renormalised, scaled."""

    def __init__(self, config: DeepseekV4Config, hashed: bool) -> None:
        super().__init__()
        self.hashed, self.top_k = hashed, config.top_k
        self.score = SCORE_FUNCTIONS[config.scoring_func]
        self.scaling = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.zeros(config.num_experts, config.hidden_size))
        if hashed:
            table = torch.zeros(config.vocab_size, config.top_k, dtype=torch.int64)
            self.tid2eid = nn.Parameter(table, requires_grad=False)
        else:
            self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts))

    def forward(
        self, x: torch.Tensor, input_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H], input_ids [N] -> (ids [N, k] int64, weights [N, k] in x's dtype)."""
        scores = self.score(F.linear(x, self.weight))  # [N, E]
        if self.hashed:
            ids = self.tid2eid[input_ids].long()
        else:
            biased = scores + self.e_score_correction_bias
            ids = torch.topk(biased, self.top_k, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling


class DeepseekV4MoE(nn.Module):
    """transformers' DeepseekV4SparseMoeBlock: router `gate`, routed experts (the store's
    blobs; the loader sets `experts`) plus `shared_experts` on the same input."""

    def __init__(self, config: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.gate = Router(config, hashed=config.mlp_layer_types[layer] == "hash_moe")
        self.shared_experts = ClampedMLP(
            config.hidden_size, config.moe_intermediate_size, config.swiglu_limit, config.mlp_bias
        )
        self.experts: Experts | None = None  # set by the loader
        # the experts runtime's look at the layer output (zero-copy staging; set by the loader)
        self.after_residual: Callable[[int, torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        if self.experts is None:
            raise RuntimeError("experts not wired: load native models with moetier.loader")
        batch, tokens, hidden = x.shape
        flat = x.reshape(-1, hidden)
        ids, weights = self.gate(flat, input_ids.reshape(-1))
        routed = self.experts(self.layer, flat, ids, weights).view(batch, tokens, hidden)
        return routed + self.shared_experts(x)


class DecoderLayer(nn.Module):
    """transformers' DeepseekV4DecoderLayer: attention and MoE, each between a hyper-connection
    collapse and expand of the streams."""

    def __init__(self, config: DeepseekV4Config, layer: int) -> None:
        super().__init__()
        c = config
        self.self_attn = DeepseekV4Attention(
            layer,
            c.layer_types[layer],
            c.hidden_size,
            c.num_heads,
            c.head_dim,
            c.q_lora_rank,
            c.o_groups,
            c.o_lora_rank,
            c.sliding_window,
            c.compress_rates,
            (c.index_n_heads, c.index_head_dim, c.index_topk),
            c.rms_norm_eps,
            c.cache_width,
        )
        self.mlp = DeepseekV4MoE(c, layer)
        self.input_layernorm = V4RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = V4RMSNorm(c.hidden_size, c.rms_norm_eps)
        hc = (c.hidden_size, c.hc_mult, c.hc_sinkhorn_iters, c.hc_eps, c.rms_norm_eps)
        self.attn_hc = HyperConnection(*hc)
        self.ffn_hc = HyperConnection(*hc)

    def forward(
        self,
        streams: torch.Tensor,
        input_ids: torch.Tensor,
        where: Positions,
        batch: AttentionBatch,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        dtype = streams.dtype
        post, comb, collapsed = self.attn_hc(streams)
        out = self.self_attn(self.input_layernorm(collapsed), where, batch, cache)
        streams = post.to(dtype)[..., None] * out[..., None, :] + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )
        post, comb, collapsed = self.ffn_hc(streams)
        out = self.mlp(self.post_attention_layernorm(collapsed), input_ids)
        streams = post.to(dtype)[..., None] * out[..., None, :] + torch.matmul(
            comb.to(dtype).transpose(-1, -2), streams
        )
        after = self.mlp.after_residual  # zero-copy staging's guesses: a look at the layer
        if after is not None:
            after(self.mlp.layer, streams.sum(dim=2))
        return streams


class DeepseekV4Model(nn.Module):
    def __init__(self, config: DeepseekV4Config, rotary: V4Rotary) -> None:
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = V4RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hc_head = HyperHead(
            config.hidden_size, config.hc_mult, config.hc_eps, config.rms_norm_eps
        )
        self.rotary_emb = rotary
        # hand on the final streams [B, T, hc H] instead of the collapsed hidden states: what
        # an MTP layer reads (DeepseekV4ForCausalLM.feed_mtp); `final` collapses them
        self.streams_out = False

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: torch.Tensor,
        batch: AttentionBatch | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [B, T, H]
        batch = batch or AttentionBatch.static(positions, cache.shape[2])
        where = Positions.build(batch, self.rotary_emb, self.config.sliding_window, x.dtype)
        streams = x[:, :, None].expand(-1, -1, self.config.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, where, batch, cache)
        if self.streams_out:
            return streams.flatten(2)
        return self.norm(self.hc_head(streams))

    def final(self, hidden: torch.Tensor) -> torch.Tensor:
        """forward's output -> the final hidden states [.., H] the LM head reads."""
        if not self.streams_out:
            return hidden
        return self.norm(self.hc_head(hidden.unflatten(-1, (self.config.hc_mult, -1))))


class DeepseekV4ForCausalLM(NativeCausalLM):
    """The native model; `rotary` carries both ropes (`setup`)."""

    model: DeepseekV4Model

    def __init__(self, config: DeepseekV4Config, rotary: V4Rotary) -> None:
        super().__init__()
        if config.model_type != "deepseek_v4":
            raise ValueError(f"native deepseek_v4 model asked to build {config.model_type!r}")
        unknown = set(config.layer_types) - {SLIDING, CSA, HCA}
        if unknown:
            raise ValueError(f"deepseek_v4 layer types {sorted(unknown)} are not known")
        self.config = config
        self.model = DeepseekV4Model(config, rotary)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head(self.model.final(hidden))

    def feed_mtp(self, kinds: tuple[str, ...]) -> None:
        """Ready the model for MTP layers of attention types `kinds` (loader/mtp.py): the
        decoder hands on its final streams (the MTP layer's input; `head` collapses them for
        the LM head), the cache gets their layers and rows as wide as their widest."""
        self.config = dataclasses.replace(self.config, mtp_layer_types=kinds)
        self.model.config = self.config
        self.model.streams_out = True
        for module in self.modules():
            if isinstance(module, DeepseekV4Attention):
                module.width = self.config.cache_width  # (wider only for a wider MTP row)

    def new_cache(
        self, pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        """A zeroed cache [layers, pages, page_size, width] (deepseek_v4_attention.py: key,
        compressor and indexer rows per position; the static cache: one page a row), MTP
        layers after the decoder's."""
        c = self.config
        layers = c.num_layers + len(c.mtp_layer_types)
        return torch.zeros(layers, pages, page_size, c.cache_width, dtype=dtype,
                           device=device)  # fmt: skip
