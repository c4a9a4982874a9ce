"""Native gpt-oss (HF model_type `gpt_oss`): module names are the checkpoint's, so the dense
tensors of a moetier store load by name; routed experts run through moetier's experts runtime
(biases and the clamped SwiGLU, `ExpertActivation("gpt_oss", alpha, limit)`, are the op's; an
MXFP4 checkpoint's experts stay FP4 codes in an `mxfp4` store, quant/sources.py).

forward(input_ids [B, T], positions [B, T], cache[, batch]) -> logits, prefill and decode alike,
over the GQA paged KV cache of layers.py. What differs from qwen3_moe, as transformers'
GptOss* computes it:
- attention sinks: a learned logit per head joins each query's softmax and is dropped after
  it (eager_attention_forward's arithmetic, in the compute dtype);
- `layer_types`: "sliding_attention" layers see only the last `sliding_window` positions
  (key position > query position - window), "full_attention" layers every earlier one;
- biases on q, k, v and o (`attention_bias`), no q/k norm; RMSNorm scaling in fp32, then cast;
- the router `mlp.router` (weight and bias): top-k of the logits, softmax over those k.
The GQA decode kernel (kernels/attention.py) has neither sinks nor windows, so this attention
reads gathered pages and masks in torch on every device (`pages_in_kernel` False): the engine's
decode steps gather a context bucket's width of pages in their CUDA graphs
(engine/decode_graphs.py), not only the window's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from moetier.config import DecoderConfig
from moetier.models.attention_batch import AttentionBatch
from moetier.models.layers import (
    Attention,
    Experts,
    GQACausalLM,
    GQADecoderModel,
    PreNormLayer,
    RMSNorm,
    RotaryEmbedding,
    _repeat_kv,
    apply_rotary,
)

LAYER_TYPES = ("sliding_attention", "full_attention")
SCORE_BYTES = 1 << 29  # the most attention scores one chunk of query tokens computes at once


def setup(hf: Any) -> tuple[DecoderConfig, RotaryEmbedding]:
    """The loader's hook: the DecoderConfig (experts sized by `intermediate_size`, every layer
    MoE) and the rope as transformers' GptOssRotaryEmbedding computes it (yarn)."""
    from transformers.models.gpt_oss import modeling_gpt_oss as hf_gpt_oss

    rope_type = (getattr(hf, "rope_parameters", None) or {}).get("rope_type", "default")
    if "dynamic" in rope_type or rope_type == "longrope":
        raise ValueError(
            f"rope_type {rope_type!r} changes with the sequence length, which a static decode "
            "step cannot follow: run this model without --native"
        )
    heads, layers = int(hf.num_attention_heads), int(hf.num_hidden_layers)
    config = DecoderConfig(
        model_type=hf.model_type,
        vocab_size=int(hf.vocab_size),
        hidden_size=int(hf.hidden_size),
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=int(hf.num_key_value_heads),
        head_dim=int(getattr(hf, "head_dim", None) or hf.hidden_size // heads),
        rms_norm_eps=float(hf.rms_norm_eps),
        attention_bias=bool(hf.attention_bias),
        max_position_embeddings=int(hf.max_position_embeddings),
        tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
        intermediate_size=int(hf.intermediate_size),
        moe_intermediate_size=int(hf.intermediate_size),
        num_experts=int(hf.num_local_experts),
        top_k=int(hf.num_experts_per_tok),
        norm_topk_prob=False,
        moe_layers=tuple(range(layers)),
        rope_type=rope_type,
    )
    with torch.device("cpu"):
        rotary = hf_gpt_oss.GptOssRotaryEmbedding(config=hf)
    return config, RotaryEmbedding(rotary.inv_freq, float(rotary.attention_scaling))


def model_kwargs(hf: Any) -> dict[str, Any]:
    """What the loader passes the model class beside (config, rotary): each layer's window
    (None: full attention)."""
    kinds = list(hf.layer_types)
    unknown = sorted(set(kinds) - set(LAYER_TYPES))
    if unknown:
        raise ValueError(
            f"gpt_oss layer_types {unknown} are not in the native model file (it has "
            f"{', '.join(LAYER_TYPES)}): run this model without --native"
        )
    window = int(hf.sliding_window) if hf.sliding_window else None
    return {"windows": tuple(window if k == "sliding_attention" else None for k in kinds)}


class GptOssRMSNorm(RMSNorm):
    """transformers' GptOssRMSNorm: the weight scales the fp32 normalised input, then the cast.
    (Its _keep_in_fp32_modules apply at float16 only: at bfloat16 the weight is bf16, as here.)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


class GptOssAttention(Attention):
    """GQA with attention sinks (`sinks` [heads]) and an optional sliding window, over the paged
    cache: every token's keys gathered per row (AttentionBatch.keys) and its batch mask."""

    # sinks and windows are not in moetier::decode_attention: decode rows need gathered keys
    pages_in_kernel = False
    prefill_compiles = False  # (its attention is not moetier::masked_attention)
    prefill_reads_pages = False  # (nor moetier::prefill_attention)

    def __init__(self, config: DecoderConfig, layer: int, window: int | None) -> None:
        super().__init__(
            layer,
            config.hidden_size,
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
            config.rms_norm_eps,
            bias=config.attention_bias,
            qk_norm=False,
        )
        self.window = window
        self.sinks = nn.Parameter(torch.zeros(config.num_heads))

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v projections [B, T, out] as Attention.forward runs them (fused or not)."""
        sizes = [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features]
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split(sizes, dim=-1)
        elif self.qkv_weight is not None:
            q, k, v = F.linear(x, self.qkv_weight, self.qkv_bias).split(sizes, dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return q, k, v

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, T, H]; cache [layers, 2, pages, kvh, page_size, D] (this layer's entries
        written in place) -> [B, T, H]."""
        if batch.mask is None:
            raise ValueError(
                "gpt_oss attends through masks (sinks, sliding windows): build the "
                "AttentionBatch with its keys (AttentionBatch.decode(..., with_keys=True))"
            )
        rows, tokens, _ = x.shape
        q_, k_, v_ = self._qkv(x)
        q = q_.view(rows, tokens, -1, self.head_dim).transpose(1, 2)  # [B, h, T, D]
        k = k_.view(rows, tokens, -1, self.head_dim).transpose(1, 2)
        v = v_.view(rows, tokens, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        batch.write(cache, self.layer, 0, k)
        batch.write(cache, self.layer, 1, v)
        groups = self.num_heads // self.num_kv_heads
        keys = _repeat_kv(batch.keys(cache[self.layer, 0]), groups)  # [B, h, Lk, D]
        values = _repeat_kv(batch.keys(cache[self.layer, 1]), groups)
        mask = batch.mask  # [B, 1, T, Lk]: the token's own sequence, keys up to its position
        if self.window is not None:  # a sequence's keys are consecutive: the last `window`
            index = torch.arange(mask.shape[-1], device=mask.device)
            own = torch.where(mask, index, -1).amax(-1, keepdim=True)  # [B, 1, T, 1]
            mask = mask & (index > own - self.window)
        if tokens == 1:  # a decode row: one chunk, without arithmetic on the key count (a
            # compiled decode step keeps it symbolic across context buckets, no guard on it)
            out = self._attend(q, keys, values, mask)
            return self.o_proj(out.transpose(1, 2).reshape(rows, tokens, -1))
        # query tokens a chunk at a time, so that a long prefill's scores [B, h, t, Lk] stay
        # under SCORE_BYTES (the chunking depends on shapes only: capturable)
        width = rows * self.num_heads * keys.shape[2] * q.element_size()
        step = max(1, SCORE_BYTES // width)
        outs = [
            self._attend(q[:, :, s : s + step], keys, values, mask[:, :, s : s + step])
            for s in range(0, tokens, step)
        ]
        out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [B, h, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(rows, tokens, -1))

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """transformers' eager attention with sinks: q [B, h, t, D], keys / values [B, h, Lk,
        D], mask [B, 1, t, Lk] -> [B, h, t, D]."""
        scores = torch.matmul(q, keys.transpose(2, 3)) * self.head_dim**-0.5  # [B, h, t, Lk]
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
        sinks = self.sinks.to(scores.dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        logits = torch.cat((scores, sinks), dim=-1)
        logits = logits - logits.amax(dim=-1, keepdim=True)
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1]  # the sink dropped
        return torch.matmul(probs.to(values.dtype), values)


class GptOssTopKRouter(nn.Module):
    """transformers' GptOssTopKRouter: logits with a bias, top-k of them, softmax over the k."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.bias = nn.Parameter(torch.zeros(num_experts))
        self.top_k = top_k

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] in x's dtype)."""
        logits = F.linear(x, self.weight, self.bias)  # [T, E]
        values, ids = torch.topk(logits, self.top_k, dim=-1)
        return ids, F.softmax(values, dim=1, dtype=values.dtype)


class GptOssMLP(nn.Module):
    """GptOssMLP: `router`, then the routed experts (the store's blobs; the loader sets
    `experts`)."""

    def __init__(self, config: DecoderConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.router = GptOssTopKRouter(config.hidden_size, config.num_experts, config.top_k)
        self.experts: Experts | None = None  # set by the loader
        # the experts runtime's look at the layer output (`PreNormLayer`; set by the loader)
        self.after_residual: Callable[[int, torch.Tensor], None] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.experts is None:
            raise RuntimeError("experts not wired: load native models with moetier.loader")
        batch, tokens, hidden = x.shape
        flat = x.reshape(-1, hidden)  # [B*T, H]
        ids, weights = self.router(flat)
        return self.experts(self.layer, flat, ids, weights).view(batch, tokens, hidden)


class DecoderLayer(PreNormLayer):
    def __init__(self, config: DecoderConfig, layer: int, window: int | None) -> None:
        super().__init__(
            GptOssAttention(config, layer, window),
            GptOssMLP(config, layer),
            config.hidden_size,
            config.rms_norm_eps,
        )
        self.input_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)


class GptOssForCausalLM(GQACausalLM):
    """The native model. `config` from `setup`; `rotary` carries transformers' yarn inverse
    frequencies and attention scaling; `windows` each layer's sliding window (None: full)."""

    def __init__(
        self, config: DecoderConfig, rotary: RotaryEmbedding, windows: tuple[int | None, ...]
    ) -> None:
        super().__init__()
        if config.model_type != "gpt_oss":
            raise ValueError(f"native gpt_oss model asked to build {config.model_type!r}")
        if len(windows) != config.num_layers:
            raise ValueError(f"{len(windows)} layer types for {config.num_layers} layers")
        self.config = config
        layers = [DecoderLayer(config, i, windows[i]) for i in range(config.num_layers)]
        norm = GptOssRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.model = GQADecoderModel(config, rotary, layers, norm)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
