"""Shared building blocks of the native model files: RMSNorm, rotary embedding, attention over a
static KV cache, the dense SwiGLU MLP and the softmax top-k router; for the DeepSeek-V3 family,
multi-head latent attention over a static latent cache and the sigmoid group-limited router.

Parameter names are those of the HF checkpoints (`q_proj.weight`, `q_norm.weight`, `gate.weight`
...), so a native model loads a store's dense.safetensors by name. Every function here is shape-
static for a given (batch, tokens): no host syncs, no branching on tensor values, so one decode
step captures into a CUDA graph.

The KV cache is one tensor of pages [layers, 2, pages, kv_heads, page_size, head_dim] (2 = key,
value); an `AttentionBatch` (attention_batch.py) says where each token's entry goes and which
keys each token sees. The static cache of StaticDecoder is one page of max_len positions per row:
token t of row b is written at position positions[b, t] of page b and attends to every position
<= its own. Prefill and decode share that one code path. Rows of different lengths are right-
padded: a pad token gets the positions after its row's last real token, so its (finite) keys land
where that row's later decode tokens overwrite them before any query can see them.
MLA's cache is one tensor [layers, pages, page_size, kv_lora_rank + rope_dim] with the same rules.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moetier.config import DecoderConfig
from moetier.kernels.attention import decode_attention
from moetier.kernels.masked_attention import masked_attention_op
from moetier.kernels.mla_decode import mla_decode
from moetier.kernels.prefill_attention import prefill_attention
from moetier.kernels.router import router_topk
from moetier.models.attention_batch import AttentionBatch
from moetier.models.dense_linear import dense_weight


class Experts(Protocol):
    """What an MoE block calls for its routed experts: ExpertsRuntime.forward's signature."""

    def __call__(
        self, layer: int, hidden: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor
    ) -> torch.Tensor: ...


class RMSNorm(nn.Module):
    """transformers' RMSNorm: normalise in fp32, scale in the input dtype."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


class RotaryEmbedding(nn.Module):
    """cos/sin for given positions from inverse frequencies [rot_dim / 2] (the loader takes them
    from transformers' own rope initialiser, so rope_theta, scaling types and partial factors are
    as the config says). Computed in fp32 as transformers does, then cast."""

    def __init__(self, inv_freq: torch.Tensor, attention_scaling: float = 1.0) -> None:
        super().__init__()
        self.inv_freq: torch.Tensor
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        self.attention_scaling = attention_scaling

    def forward(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [B, T] int64 -> (cos, sin), each [B, T, rot_dim]."""
        freqs = positions[..., None].float() * self.inv_freq  # [B, T, rot_dim / 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, D], cos/sin [B, T, R] with R <= D: rotates the first R dims."""
    cos, sin = cos[:, None], sin[:, None]  # [B, 1, T, R]
    rot_dim = cos.shape[-1]
    if rot_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    rot, keep = x[..., :rot_dim], x[..., rot_dim:]
    return torch.cat((rot * cos + _rotate_half(rot) * sin, keep), dim=-1)


def new_kv_cache(
    num_layers: int,
    pages: int,
    num_kv_heads: int,
    page_size: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """[layers, 2, pages, kv_heads, page_size, head_dim], zeroed: masked positions must hold
    finite values, since a masked score is still computed from them. The static cache: one page
    of max_len positions per row."""
    return torch.zeros(
        num_layers, 2, pages, num_kv_heads, page_size, head_dim, dtype=dtype, device=device
    )


class Attention(nn.Module):
    """Grouped-query attention with q/k RMSNorm (per head or flat) over the paged KV cache.
    Decode steps on CUDA attend with `moetier::decode_attention` (one Triton launch, reading
    each row's keys up to its position through its page table); prefill and CPU with SDPA over
    each row's keys and the batch's mask."""

    # decode rows read their pages in the kernel: the engine's decode batches need no gathered
    # keys on CUDA, and its steps capture into CUDA graphs (engine/runner.py)
    pages_in_kernel = True
    # the engine's packed steps may run compiled (engine/prefill_compile.py): the prefill's
    # attention is one opaque op (kernels/masked_attention.py), the rest traces as is
    prefill_compiles = True
    # a packed step's attention may read the pages through the sequences' tables
    # (kernels/prefill_attention.py; the engine's `paged_prefill`)
    prefill_reads_pages = True

    def __init__(
        self,
        layer: int,
        hidden_size: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        eps: float,
        bias: bool = False,
        qk_norm: bool = True,
        flat_qk_norm: bool = False,
    ) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(hidden_size, num_heads * head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden_size, num_kv_heads * head_dim, bias=bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=bias)
        # q/k RMSNorm over each head's dims (Qwen3), or with flat_qk_norm over all heads' dims
        # at once (MiniMax-M2: one norm of the whole projection)
        self.flat_qk_norm = flat_qk_norm
        q_dims, k_dims = (num_heads, num_kv_heads) if flat_qk_norm else (1, 1)
        self.q_norm: nn.Module = RMSNorm(q_dims * head_dim, eps) if qk_norm else nn.Identity()
        self.k_norm: nn.Module = RMSNorm(k_dims * head_dim, eps) if qk_norm else nn.Identity()
        # [q; k; v] weight and bias after `fuse_qkv` (plain attributes: the checkpoint names
        # stay those of the three projections, which become views of these)
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None
        # quantized q/k/v fused by the loader (models/dense_linear.fuse_dense_qkv; unregistered)
        self.qkv_proj: nn.Module | None = None

    def fuse_qkv(self) -> None:
        """Store q, k and v's weights (and biases) as one tensor so that the three projections
        run as one GEMM (at batch 1, one GEMV launch instead of three); the three modules keep
        views of it, so nothing is duplicated."""
        projections = (self.q_proj, self.k_proj, self.v_proj)
        self.qkv_weight = torch.cat([p.weight.detach() for p in projections])
        biases = [p.bias for p in projections]
        if all(b is not None for b in biases):
            self.qkv_bias = torch.cat([b.detach() for b in biases if b is not None])
        start = 0
        for p in projections:
            rows = p.weight.shape[0]
            p.weight = nn.Parameter(self.qkv_weight[start : start + rows], requires_grad=False)
            if self.qkv_bias is not None:
                p.bias = nn.Parameter(self.qkv_bias[start : start + rows], requires_grad=False)
            start += rows

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, T, H]; cache [layers, 2, pages, kvh, page_size, D] (this layer's keys/values
        are written in place where `batch` says) -> [B, T, H]."""
        rows, tokens, _ = x.shape
        if self.qkv_proj is not None:
            q_, k_, v_ = self.qkv_proj(x).split(
                [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features],
                dim=-1,
            )
        elif self.qkv_weight is not None:
            q_, k_, v_ = F.linear(x, self.qkv_weight, self.qkv_bias).split(
                [self.q_proj.out_features, self.k_proj.out_features, self.v_proj.out_features],
                dim=-1,
            )
        else:
            q_, k_, v_ = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.flat_qk_norm:
            q = self.q_norm(q_).reshape(rows, tokens, -1, self.head_dim).transpose(1, 2)
            k = self.k_norm(k_).reshape(rows, tokens, -1, self.head_dim).transpose(1, 2)
        else:
            q = self.q_norm(q_.reshape(rows, tokens, -1, self.head_dim)).transpose(1, 2)
            k = self.k_norm(k_.reshape(rows, tokens, -1, self.head_dim)).transpose(1, 2)
        v = v_.reshape(rows, tokens, -1, self.head_dim).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)  # [B, h, T, D]
        k_cache, v_cache = cache[self.layer, 0], cache[self.layer, 1]  # [P, kvh, PS, D]
        batch.write_kv(cache, self.layer, k, v)
        paged = batch.page_table is not None  # decode rows reading pages through their tables
        if (paged and batch.mask is None) or (
            (paged or batch.static_rows) and _decode_kernel_applies(x, tokens)
        ):
            out = decode_attention(
                q, k_cache, v_cache, batch.page_table, batch.positions[:, 0], self.head_dim**-0.5
            )  # [B, h, 1, D]
        elif batch.blocks is not None and batch.seq_pages is not None:  # a packed step, paged
            out = prefill_attention(
                q[0].transpose(0, 1), k_cache, v_cache, batch.seq_pages, batch.blocks,
                self.head_dim**-0.5,
            )  # [N, h, D]  # fmt: skip
            return self.o_proj(out.reshape(rows, tokens, -1))
        else:
            groups = self.num_heads // self.num_kv_heads
            keys = _repeat_kv(batch.keys(k_cache), groups)  # [B, h, Lk, D]
            values = _repeat_kv(batch.keys(v_cache), groups)
            out = masked_attention(q, keys, values, batch.mask, self.head_dim**-0.5)  # [B, h, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(rows, tokens, -1))


# MLAttention's CUDA decode through `moetier::mla_decode` (no gathered pages, so the engine's MLA
# decode steps are graphed). Its GPU tests (tests/kernels/test_mla_decode.py, the engine's batched
# greedy against alone, the native DeepSeek tests) passed on an H100 with it on; off, CUDA runs SDPA
# over gathered pages (eager engine steps), as the CPU path does unless a test switches it on.
MLA_DECODE_KERNEL = True

# The engine's packed steps (GQA) attend through the sequences' page tables on CUDA
# (`moetier::prefill_attention`: no gathered keys, no [tokens, context] mask) instead of SDPA over
# gathered keys: 1.9-2.0x faster and 16 MiB against up to 1.4 GB on an H100
# (bench/prefill_attention.py, docs/benchmarks.md), but off until its pipeline stages fit the
# shared memory of sm_86 / sm_89 cards; the CPU tests run it under Triton's interpreter.
PAGED_PREFILL_KERNEL = False


def masked_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor | None,
    scale: float,
) -> torch.Tensor:  # fmt: skip
    """SDPA of q [B, h, T, D] over keys and values [B, h, Lk, D] where mask [B, 1, T, Lk] allows
    -> [B, h, T, D]; a prefill (T > 1) as `moetier::masked_attention` (kernels/
    masked_attention.py: PREFILL_SDPA_BACKENDS, and one opaque op in a compiled prefill).
    (Decode rows, T = 1, keep every backend: their shapes are a graph's, fixed, and a compiled
    step traces no backend switch.)"""
    if q.shape[-2] > 1 and mask is not None:
        return masked_attention_op(q, keys, values, mask, scale).transpose(1, 2)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)


def _decode_kernel_applies(x: torch.Tensor, tokens: int) -> bool:
    """Whether Attention runs `moetier::decode_attention` (one Triton launch per layer) instead
    of SDPA over the repeated kv heads, and MLAttention `moetier::mla_decode`: decode steps (one
    token per row) on CUDA. Prefill and CPU keep SDPA (the tests route CPU decode through the
    kernels' interpreter by patching this)."""
    return tokens == 1 and x.is_cuda


def _repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, kvh, L, D] -> [B, kvh * groups, L, D], each kv head serving `groups` query heads."""
    if groups == 1:
        return x
    batch, kv_heads, length, dim = x.shape
    return (
        x[:, :, None].expand(batch, kv_heads, groups, length, dim).reshape(batch, -1, length, dim)
    )


class PreNormLayer(nn.Module):
    """A decoder layer of the native families (HF names): x + self_attn(input_layernorm(x)),
    then + mlp(post_attention_layernorm(x)); the family passes its attention and MLP modules.
    An MLP with `after_residual` set (MoE blocks: the loader sets `ExpertsRuntime.after_layer`)
    sees the layer's output (zero-copy staging's guesses)."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.self_attn = self_attn
        self.mlp = mlp
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, batch, cache)
        x = x + self.mlp(self.post_attention_layernorm(x))
        after = getattr(self.mlp, "after_residual", None)  # MoE blocks: ExpertsRuntime's
        if after is not None:  # look at the layer output (staging's guesses)
            after(self.mlp.layer, x)
        return x


class GQADecoderModel(nn.Module):
    """The `model` of the GQA families (HF names): embed_tokens, the family's decoder `layers`,
    the final `norm` (RMSNorm unless the family passes its own) and `rotary_emb`; forward as
    qwen3_moe's: embeddings, cos/sin of the positions, each layer over the paged KV cache."""

    def __init__(
        self,
        config: DecoderConfig,
        rotary: RotaryEmbedding,
        layers: Sequence[nn.Module],
        norm: nn.Module | None = None,
    ) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(layers)
        self.norm = norm if norm is not None else RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary_emb = rotary

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: torch.Tensor,
        batch: AttentionBatch | None = None,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [B, T, H]
        cos, sin = self.rotary_emb(positions, x.dtype)  # [B, T, rotary dims]
        batch = batch or AttentionBatch.static(positions, cache.shape[4])
        for layer in self.layers:
            x = layer(x, cos, sin, batch, cache)
        return self.norm(x)


class NativeCausalLM(nn.Module):
    """What the native model files share: `model` (embeddings, layers, final norm: hidden
    [B, T, H]) then `lm_head`. Subclasses set config, model and lm_head, and new_cache."""

    model: nn.Module
    lm_head: nn.Linear

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        cache: torch.Tensor,
        last_only: torch.Tensor | None = None,
        batch: AttentionBatch | None = None,
    ) -> torch.Tensor:
        """input_ids, positions [B, T] int64; cache written in place -> logits [B, T, V]; with
        last_only [B] (index of each row's last real token) -> [B, V]. batch: where the tokens'
        KV goes in a paged cache (default: the static cache, row b is page b)."""
        hidden = self.model(input_ids, positions, cache, batch)  # [B, T, H]
        if last_only is not None:
            index = last_only[:, None, None].expand(-1, 1, hidden.shape[-1])
            hidden = hidden.gather(1, index)[:, 0]  # [B, H]
        return self.head(hidden)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        """`model`'s final hidden states -> logits (the LM head; DeepSeek-V4 feeding an MTP
        layer first collapses its streams)."""
        return self.lm_head(hidden)


class GQACausalLM(NativeCausalLM):
    """A native model over the GQA KV cache of `new_kv_cache` (config: a DecoderConfig)."""

    config: DecoderConfig

    def new_cache(
        self, pages: int, page_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> torch.Tensor:
        """A zeroed KV cache [layers, 2, pages, kv_heads, page_size, head_dim] (the static
        cache: one page of max_len positions per row)."""
        c = self.config
        layers = c.num_layers + (1 if getattr(self, "mtp", None) is not None else 0)  # MTP's
        return new_kv_cache(layers, pages, c.num_kv_heads, page_size, c.head_dim, dtype, device)


class MLP(nn.Module):
    """The dense SwiGLU MLP: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SoftmaxTopKRouter(nn.Module):
    """Router of Qwen3-MoE / Mixtral style: softmax over all experts in fp32, top-k, optionally
    renormalised over the k. Parameter `weight` [E, H], as in the checkpoints."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, norm_topk: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.top_k, self.norm_topk = top_k, norm_topk

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] in x's dtype)."""
        logits = F.linear(x, self.weight)  # [T, E]
        ids, weights = router_topk(logits, self.top_k, self.norm_topk)  # one kernel on CUDA
        return ids, weights.to(logits.dtype)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, T, R] whose dims pair up interleaved, (x0, x1), (x2, x3) ... (DeepSeek's
    `rope_interleave`); cos/sin [B, T, R] as RotaryEmbedding gives them. Returns the rotated
    pairs de-interleaved ([evens; odds]), as transformers does: q and k get the same layout, so
    their dot products are those of the interleaved rotation."""
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :, :half], sin[:, None, :, :half]  # [B, 1, T, R / 2]
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


def new_latent_cache(
    num_layers: int,
    pages: int,
    page_size: int,
    width: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> torch.Tensor:
    """The MLA cache [layers, pages, page_size, width], width = kv_lora_rank + qk_rope_head_dim:
    per token the normalised KV latent and the rotated shared rope key. Zeroed (finite), as
    new_kv_cache. The static cache: one page of max_len positions per row."""
    return torch.zeros(num_layers, pages, page_size, width, dtype=dtype, device=device)


class MLAttention(nn.Module):
    """Multi-head latent attention (DeepSeek-V2/V3, transformers' DeepseekV3Attention) over the
    paged latent cache of `new_latent_cache`.

    The cache holds what transformers' cache holds (the normalised latent and the rotated rope
    key, kv_lora_rank + rope dims per token), never per-head keys and values. Attention runs in
    the latent space: kv_b_proj's key rows are folded into the query (q_nope @ W_k) and its value
    rows applied to the attended latent, so a step reads only the latent cache and expands
    nothing; all heads attend to one shared key, as one SDPA call with heads folded into the
    query rows. The same arithmetic as expanding keys and values, in another order (fp32 logits
    of the tiny model agree with transformers to ~1e-6). Decode steps on CUDA attend with
    `moetier::mla_decode` (kernels/mla_decode.py: the latent pages read through each row's page
    table up to its position, as Attention's decode kernel); prefill and CPU with SDPA."""

    @property
    def pages_in_kernel(self) -> bool:
        """As Attention's, once MLA_DECODE_KERNEL is on (subclasses that attend through masks
        set False)."""
        return MLA_DECODE_KERNEL

    def __init__(
        self,
        layer: int,
        hidden_size: int,
        num_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        nope_dim: int,
        rope_dim: int,
        v_head_dim: int,
        softmax_scale: float,
        interleave: bool,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.layer, self.num_heads, self.scale = layer, num_heads, softmax_scale
        self.interleave, self.q_lora = interleave, bool(q_lora_rank)
        self.dims = (kv_lora_rank, nope_dim, rope_dim, v_head_dim)
        q_out = num_heads * (nope_dim + rope_dim)
        if self.q_lora:
            self.q_a_proj = nn.Linear(hidden_size, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, 1e-6)  # transformers' default eps, as there
            self.q_b_proj = nn.Linear(q_lora_rank, q_out, bias=False)
        else:
            self.q_proj = nn.Linear(hidden_size, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden_size, kv_lora_rank + rope_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (nope_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden_size, bias=bias)

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        batch: AttentionBatch,
        cache: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, T, H]; batch with its mask head-folded (`AttentionBatch.head_folded`); cache
        [layers, pages, page_size, kv_lora_rank + rope_dim] (this layer's entries written in
        place) -> [B, T, H]."""
        rows, tokens, _ = x.shape
        lora, nope, rope, v_dim = self.dims
        if self.q_lora:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(rows, tokens, self.num_heads, nope + rope).transpose(1, 2)  # [B, h, T, qk]
        q_nope, q_rot = q.split([nope, rope], dim=-1)
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([lora, rope], dim=-1)
        rotate = apply_rotary_interleaved if self.interleave else apply_rotary
        q_rot, k_rot = rotate(q_rot, cos, sin), rotate(k_rot[:, None], cos, sin)[:, 0]
        entry = torch.cat((self.kv_a_layernorm(latent), k_rot), dim=-1)  # [B, T, lora + rope]
        batch.write(cache, self.layer, -1, entry)
        w_kv = dense_weight(self.kv_b_proj, x.dtype).view(self.num_heads, nope + v_dim, lora)
        w_k, w_v = w_kv[:, :nope], w_kv[:, nope:]  # [h, nope, lora], [h, v, lora]
        query = torch.cat((q_nope @ w_k, q_rot), dim=-1)  # [B, h, T, lora + rope]
        paged = batch.page_table is not None  # decode rows reading pages through their tables
        if (paged and batch.mask is None) or (
            MLA_DECODE_KERNEL and (paged or batch.static_rows) and _decode_kernel_applies(x, tokens)
        ):
            out = mla_decode(
                query[:, :, 0], cache[self.layer], batch.page_table, batch.positions[:, 0],
                lora, self.scale,
            )[:, :, None]  # [B, h, 1, lora]  # fmt: skip
        else:
            keys = batch.keys(cache[self.layer])[:, None]  # [B, 1, Lk, lora + rope]: all heads'
            out = F.scaled_dot_product_attention(
                query.reshape(rows, 1, -1, lora + rope),  # [B, 1, h * T, lora + rope]
                keys,
                keys[..., :lora],  # the latent is the value
                attn_mask=batch.mask,
                scale=self.scale,
            ).view(rows, self.num_heads, tokens, lora)
        out = out @ w_v.transpose(1, 2)  # [B, h, T, v]
        return self.o_proj(out.transpose(1, 2).reshape(rows, tokens, -1))


class SigmoidGroupTopKRouter(nn.Module):
    """DeepSeek-V3's router (transformers' DeepseekV3TopkRouter), in fp32: sigmoid scores; the
    selection adds `e_score_correction_bias` and keeps the `topk_group` of `n_group` groups with
    the best two-expert sums; weights are the unbiased scores of the chosen experts, renormalised
    if `norm_topk`, times `scaling`. Shape-static (top-k and masks, no host sync)."""

    def __init__(
        self,
        hidden_size: int,
        num_experts: int,
        top_k: int,
        n_group: int,
        topk_group: int,
        norm_topk: bool,
        scaling: float,
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden_size))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(num_experts))  # kept in fp32
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk, self.scaling = norm_topk, scaling

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, H] -> (topk_ids [T, k] int64, topk_weights [T, k] fp32, as transformers hands
        its experts)."""
        experts = self.weight.shape[0]
        scores = F.linear(x.float(), self.weight.float()).sigmoid()  # [T, E]
        choice = scores + self.e_score_correction_bias
        grouped = choice.view(-1, self.n_group, experts // self.n_group)  # [T, G, E / G]
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)  # [T, G]
        group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask[:, :, None].expand_as(grouped).reshape(-1, experts)  # [T, E]
        choice = choice.masked_fill(~score_mask.bool(), float("-inf"))
        ids = torch.topk(choice, k=self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.norm_topk:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling
