"""The DeepSeek Sparse Attention (DSA) indexer as transformers implements it for GLM-5
(`GlmMoeDsaIndexer`): per query token, a cheap score over every visible key picks the
`index_topk` keys the layer's attention may see.

Per layer the indexer keeps one key per token (`wk`, LayerNorm `k_norm`, the first rope dims
rotated with interleaved pairs): `index_head_dim` values cached beside the MLA latent (the native
model stores them in the same paged cache entry). A query token's score of key t is
sum_h w_h * relu(q_h . k_t / sqrt(D)), with q_h = wq_b(q_resid) per index head and w = the
(fp32) `weights_proj` of the hidden state times n_heads^-1/2; scores are computed in fp32 with
the same matmuls as transformers, masked to the keys the token may see, and the top-k of them
become a boolean mask (`top_k_mask`). Where scores tie at the k-th place (several keys scoring
exactly 0 in every head) the earliest keys win; transformers leaves that to torch.topk, so on
such ties the keys chosen may differ from its. Shape-static (a top-k of a fixed width, masks,
a cumsum): a decode step with it captures into a CUDA graph.

Parameter names are the checkpoint's (`indexer.wq_b.weight`, `indexer.wk.weight`,
`indexer.k_norm.weight` / `.bias`, `indexer.weights_proj.weight`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetier.models.layers import apply_rotary_interleaved

SCORE_BYTES = 1 << 29  # the most fp32 index scores one chunk of query tokens computes at once


class DsaIndexer(nn.Module):
    """transformers' GlmMoeDsaIndexer over keys laid out by an AttentionBatch."""

    def __init__(
        self,
        hidden_size: int,
        q_lora_rank: int,
        n_heads: int,
        head_dim: int,
        rope_dim: int,
        topk: int,
    ) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.rope_dim, self.topk = n_heads, head_dim, rope_dim, topk
        self.wq_b = nn.Linear(q_lora_rank, n_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden_size, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden_size, n_heads, bias=False)  # kept fp32 (as HF)
        self.softmax_scale = head_dim**-0.5

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, heads, T, D]: the first rope dims rotated (interleaved pairs), the rest kept."""
        rot, keep = x.split([self.rope_dim, self.head_dim - self.rope_dim], dim=-1)
        return torch.cat((apply_rotary_interleaved(rot, cos, sin), keep), dim=-1)

    def key(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> each token's index key [B, T, head_dim] (what the cache holds)."""
        k = self.k_norm(self.wk(x))[:, None]  # [B, 1, T, D]
        return self._rotate(k, cos, sin)[:, 0]

    def select(
        self,
        x: torch.Tensor,
        q_resid: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys: torch.Tensor,
        visible: torch.Tensor,
    ) -> torch.Tensor:
        """x [B, T, H], q_resid [B, T, q_lora_rank] (q_a_layernorm's output), keys [B, Lk, D]
        (every key of the batch's layout), visible [B, 1, T, Lk] bool (the causal / sequence
        mask) -> [B, 1, T, Lk] bool: the visible keys among each token's top-k index scores
        (all visible keys where there are at most k)."""
        rows, tokens, _ = x.shape
        q = self.wq_b(q_resid).view(rows, tokens, self.n_heads, self.head_dim)
        q = self._rotate(q.transpose(1, 2), cos, sin).transpose(1, 2)  # [B, T, h, D]
        projection = self.weights_proj  # an fp32 nn.Linear, as transformers keeps it
        if isinstance(projection, nn.Linear):
            x = x.to(projection.weight.dtype)
        weights = projection(x).float() * self.n_heads**-0.5  # [B, T, h]
        keys_t = keys.transpose(-1, -2).float()[:, None]  # [B, 1, D, Lk]
        if tokens == 1:  # a decode row: one chunk, without arithmetic on the key count (a
            # compiled decode step keeps it symbolic across context buckets, no guard on it)
            return self._choose(q, weights, keys_t, visible)
        # query tokens a chunk at a time, so that a long prefill's fp32 scores [B, T, h, Lk]
        # stay under SCORE_BYTES (the chunking depends on shapes only: capturable)
        step = max(1, SCORE_BYTES // (4 * rows * self.n_heads * keys.shape[1]))
        chosen = [
            self._choose(
                q[:, s : s + step], weights[:, s : s + step], keys_t, visible[:, :, s : s + step]
            )
            for s in range(0, tokens, step)
        ]
        return chosen[0] if len(chosen) == 1 else torch.cat(chosen, dim=2)

    def _choose(
        self, q: torch.Tensor, weights: torch.Tensor, keys_t: torch.Tensor, visible: torch.Tensor
    ) -> torch.Tensor:
        """q [B, t, h, D], weights [B, t, h] fp32, keys_t [B, 1, D, Lk] fp32, visible [B, 1, t,
        Lk] -> [B, 1, t, Lk] bool, transformers' ops in its order."""
        scores = F.relu(torch.matmul(q.float(), keys_t) * self.softmax_scale)  # [B, t, h, Lk]
        index = torch.matmul(weights[:, :, None], scores)[:, :, 0]  # [B, t, Lk]
        index = index.masked_fill(~visible[:, 0], float("-inf"))
        return (top_k_mask(index, self.topk) & visible[:, 0])[:, None]


def top_k_mask(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores [..., L] -> bool [..., L]: the k largest of each row (every entry if L <= k),
    ties at the k-th value broken towards the lower index. torch.topk breaks them as it likes
    (and differently for another row length), so that the keys chosen do not depend on where a
    sequence's keys sit in the batch (static cache, packed prefill, decode pages), which all
    keep a sequence's keys in position order. Shape-static, no host sync."""
    k = min(k, scores.shape[-1])
    kth = scores.topk(k, dim=-1).values[..., -1:]  # [..., 1]
    above = scores > kth
    tied = scores == kth
    room = k - above.sum(-1, keepdim=True)  # how many of the tied ones fit
    return above | (tied & (tied.cumsum(-1) <= room))
