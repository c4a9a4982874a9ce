"""DeepSeek-V4's attention (transformers' DeepseekV4Attention) over a paged cache of positions.

What transformers computes, per layer type: shared-KV multi-query attention (one `kv_proj` head
read as key and value) over a sliding window of `sliding_window` positions, with a learned sink
per head and partial interleaved RoPE on the trailing dims (undone on the output at the query's
position), a grouped low-rank output projection; compressed layers add entries that compress
`m` positions each: heavily compressed attention (HCA) attends to every finished entry,
compressed sparse attention (CSA, overlapping windows of 2m) to the top `index_topk` entries a
lightning indexer (its own compressed keys at `index_head_dim`) scores for the query.

How it is cached here: everything is indexed by position, in one cache tensor [layers, pages,
page_size, width] paged like MLA's latent cache (AttentionBatch), so page tables, prefix reuse
and preemption work unchanged. Per token and layer a row holds: the rotated key (= value); for a
compressed layer the compressor's raw projections (kv and gate) and the *candidate entry* of the
token's window, computed from the raw rows of the window's positions up to the token; for CSA
the same three for the indexer. Position p's candidate is the window's entry when p closes the
window ((p + 1) % m == 0), and only those are visible, which is transformers' causality rule
(entry w is seen by query t iff (w + 1) m <= t + 1). Every token computes its candidate (a
shape-static step; an unfinished one is masked), so a decode step has no host sync.

A forward writes its rows twice: raw projections and keys first, then, once the window rows of
this forward are in the cache, the candidates. Costs against transformers' cache: the raw rows
(for exactness at any chunking) and a candidate per position rather than per m positions; a
decode step reads the rows of its context bucket (engine/decode_graphs.py: the gathered path,
shape-static, so the engine's steps replay CUDA graphs; no kernel yet).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from moetier.models.attention_batch import AttentionBatch

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"


class V4RMSNorm(nn.Module):
    """transformers' DeepseekV4RMSNorm: weights kept in fp32, scaled in fp32, cast once."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' DeepseekV4UnweightedRMSNorm."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


class V4Rotary(nn.Module):
    """The two ropes of V4 ("main": sliding layers; "compress": compressed layers, their
    compressors and indexers), inverse frequencies and scaling from transformers' own
    DeepseekV4RotaryEmbedding. cos/sin have one entry per interleaved pair."""

    def __init__(
        self,
        main_inv_freq: torch.Tensor,
        main_scaling: float,
        compress_inv_freq: torch.Tensor,
        compress_scaling: float,
    ) -> None:
        super().__init__()
        self.main_inv_freq: torch.Tensor
        self.compress_inv_freq: torch.Tensor
        self.register_buffer("main_inv_freq", main_inv_freq.float(), persistent=False)
        self.register_buffer("compress_inv_freq", compress_inv_freq.float(), persistent=False)
        self.scaling = {"main": main_scaling, "compress": compress_scaling}

    def forward(
        self, positions: torch.Tensor, kind: str, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [...] int64 -> (cos, sin), each [..., rope_dim / 2] in dtype."""
        inv_freq = self.main_inv_freq if kind == "main" else self.compress_inv_freq
        freqs = positions[..., None].float() * inv_freq
        scaling = self.scaling[kind]
        return (freqs.cos() * scaling).to(dtype), (freqs.sin() * scaling).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' V4 apply_rotary_pos_emb: x [B, heads, T, D], cos/sin [B, T, R / 2]; rotates
    the trailing R dims, pairs (0, 1), (2, 3) ... interleaved, in fp32, leaving the order."""
    cos = cos.repeat_interleave(2, dim=-1)[:, None]
    sin = sin.repeat_interleave(2, dim=-1)[:, None]
    rope_dim = cos.shape[-1]
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:]
    turned = torch.stack((-rope[..., 1::2], rope[..., 0::2]), dim=-1).flatten(-2)
    rotated = (rope.float() * cos + turned.float() * sin).to(x.dtype)
    return torch.cat([nope, rotated], dim=-1)


@dataclass
class Positions:
    """What every layer of one forward needs about its tokens and keys, built once: the keys
    are AttentionBatch's per-row layout, in which each sequence's positions 0, 1, ... are
    consecutive key indices (static rows, decode rows with gathered keys, packed sequences)."""

    positions: torch.Tensor  # [B, T] int64
    mask: torch.Tensor  # [B, 1, T, Lk] bool: the token's own sequence, keys up to its position
    own: torch.Tensor  # [B, T] int64: the key index of the token's own position
    start: torch.Tensor  # [B, T] int64: the key index of its sequence's position 0
    sliding: torch.Tensor  # [B, 1, T, Lk] bool: keys within the sliding window
    rope: dict[str, tuple[torch.Tensor, torch.Tensor]]  # kind -> query cos, sin [B, T, R / 2]
    rotary: V4Rotary
    _closed: dict[int, torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def build(
        batch: AttentionBatch, rotary: V4Rotary, window: int, dtype: torch.dtype
    ) -> Positions:
        if batch.mask is None:
            raise ValueError(
                "DeepSeek-V4 attends through masks: build the AttentionBatch with its keys "
                "(AttentionBatch.decode(..., with_keys=True))"
            )
        positions, mask = batch.positions, batch.mask
        keys = torch.arange(mask.shape[-1], device=mask.device)
        own = torch.where(mask[:, 0], keys, -1).amax(-1)  # [B, T]
        sliding = mask & (keys > (own - window)[:, None, :, None])
        rope = {kind: rotary(positions, kind, dtype) for kind in ("main", "compress")}
        return Positions(positions, mask, own, own - positions, sliding, rope, rotary)

    def closed(self, rate: int) -> torch.Tensor:
        """[B, 1, T, Lk] bool: visible keys whose position closes a window of `rate`."""
        if rate not in self._closed:
            keys = torch.arange(self.mask.shape[-1], device=self.mask.device)
            key_pos = keys - self.start[:, None, :, None]
            self._closed[rate] = self.mask & ((key_pos + 1) % rate == 0)
        return self._closed[rate]

    def window_rows(self, rate: int, overlap: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """Key indices [B, T, n] of the positions whose raw rows make each token's candidate
        (n = rate, or 2 rate with the previous window first when `overlap`) and which of them
        count [B, T, n] (positions up to the token's; the previous window exists)."""
        slot = torch.arange(rate, device=self.own.device)
        offset = self.positions % rate  # [B, T]
        first = self.own - offset  # key index of the window's first position
        rows = first[..., None] + slot  # [B, T, m]
        valid = slot <= offset[..., None]
        if overlap:
            before = rows - rate
            has_before = (self.positions >= rate)[..., None].expand_as(before)
            rows = torch.cat([before, rows], dim=-1)
            valid = torch.cat([has_before, valid], dim=-1)
        rows = torch.where(valid, rows, self.own[..., None])
        return rows, valid


def gather_rows(keys: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """keys [B, Lk, C], rows [B, T, n] key indices -> [B, T, n, C]."""
    batch, tokens, n = rows.shape
    index = rows.reshape(batch, -1, 1).expand(-1, -1, keys.shape[-1])
    return keys.gather(1, index).view(batch, tokens, n, -1)


class Compressor(nn.Module):
    """transformers' DeepseekV4HCACompressor (overlap=False) / the CSA compressor's own
    parameters (overlap=True: two series, Ca for the next window and Cb for this one)."""

    def __init__(self, hidden: int, dim: int, rate: int, overlap: bool, eps: float) -> None:
        super().__init__()
        width = 2 * dim if overlap else dim
        self.dim, self.rate, self.overlap = dim, rate, overlap
        self.kv_proj = nn.Linear(hidden, width, bias=False)
        self.gate_proj = nn.Linear(hidden, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(rate, width))
        self.kv_norm = V4RMSNorm(dim, eps)
        self.indexer: Indexer | None = None  # CSA's lightning indexer

    def raw(self, x: torch.Tensor) -> torch.Tensor:
        """x [B, T, H] -> the cached raw projections [B, T, 2 width]: kv, then gate."""
        return torch.cat([self.kv_proj(x), self.gate_proj(x)], dim=-1)

    def candidates(self, raw_keys: torch.Tensor, where: Positions) -> torch.Tensor:
        """raw_keys [B, Lk, 2 width] (this forward's rows written) -> each token's candidate
        entry [B, T, dim]: its window's gated softmax pool, normed, rotated at the window's
        first position."""
        rows, valid = where.window_rows(self.rate, self.overlap)
        kv, gate = gather_rows(raw_keys, rows).chunk(2, dim=-1)  # [B, T, n, width] each
        m, d = self.rate, self.dim
        if self.overlap:
            bias = self.position_bias
            kv = torch.cat([kv[:, :, :m, :d], kv[:, :, m:, d:]], dim=2)
            gate = torch.cat(
                [gate[:, :, :m, :d] + bias[:, :d], gate[:, :, m:, d:] + bias[:, d:]], 2
            )
        else:
            gate = gate + self.position_bias
        valid = valid[..., None]
        kv = kv.masked_fill(~valid, 0.0)
        gate = gate.masked_fill(~valid, float("-inf"))
        pooled = (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2)
        entry = self.kv_norm(pooled)  # [B, T, d]
        start = where.positions - where.positions % m
        cos, sin = where.rotary(start, "compress", entry.dtype)
        return apply_rope(entry[:, None], cos, sin)[:, 0]


class IndexerScorer(nn.Module):
    def __init__(self, hidden: int, heads: int) -> None:
        super().__init__()
        self.weights_proj = nn.Linear(hidden, heads, bias=False)


class Indexer(Compressor):
    """transformers' DeepseekV4Indexer: its own overlapping compressor at index_head_dim, and
    per query the sum over heads of w_h relu(q_h . k) over finished entries; top index_topk."""

    def __init__(
        self, hidden: int, q_lora_rank: int, heads: int, dim: int, rate: int, topk: int, eps: float
    ) -> None:
        super().__init__(hidden, dim, rate, True, eps)
        self.heads, self.topk = heads, topk
        self.q_b_proj = nn.Linear(q_lora_rank, heads * dim, bias=False)
        self.scorer = IndexerScorer(hidden, heads)

    def select(
        self, x: torch.Tensor, q_residual: torch.Tensor, index_keys: torch.Tensor, where: Positions
    ) -> torch.Tensor:
        """-> [B, 1, T, Lk] bool: the finished entries (at their closing positions) each token
        keeps. Top-k runs over the entries in order, as transformers' does over its list."""
        rows, tokens, _ = x.shape
        cos, sin = where.rope["compress"]
        q = self.q_b_proj(q_residual).view(rows, tokens, -1, self.dim).transpose(1, 2)
        q = apply_rope(q, cos, sin).transpose(1, 2)  # [B, T, h, d]
        scores = torch.matmul(q.float(), index_keys.float().transpose(-1, -2)[:, None])
        scores = F.relu(scores) * self.dim**-0.5  # [B, T, h, Lk]
        weights = self.scorer.weights_proj(x).float() * self.heads**-0.5  # [B, T, h]
        scores = (scores * weights[..., None]).sum(dim=2)  # [B, T, Lk]
        length = scores.shape[-1]
        m = self.rate
        entries = torch.arange(-(-length // m), device=x.device)  # [E]
        closing = where.start[..., None] + (entries + 1) * m - 1  # [B, T, E] key indices
        finished = entries < ((where.positions + 1) // m)[..., None]
        closing = torch.where(finished, closing, where.own[..., None])
        entry_scores = scores.gather(-1, closing).masked_fill(~finished, float("-inf"))
        picked = entry_scores.topk(min(self.topk, entries.numel()), dim=-1).indices
        keep = finished.gather(-1, picked)
        target = torch.where(keep, closing.gather(-1, picked), length)  # dropped: a spare column
        chosen = torch.zeros(rows, tokens, length + 1, dtype=torch.bool, device=x.device)
        chosen.scatter_(-1, target, True)
        return chosen[:, None, :, :length]


@dataclass(frozen=True)
class RowLayout:
    """Columns of a layer's cache row: the key; the compressor's raw rows and candidate; the
    indexer's raw rows and candidate (CSA). Empty slices where the layer type has none."""

    key: slice
    raw: slice
    entry: slice
    index_raw: slice
    index_entry: slice
    width: int


def row_layout(kind: str, head_dim: int, index_dim: int) -> RowLayout:
    d, i = head_dim, index_dim
    if kind == SLIDING:
        none = slice(d, d)
        return RowLayout(slice(0, d), none, none, none, none, d)
    raw = 4 * d if kind == CSA else 2 * d
    entry_end = d + raw + d
    if kind == HCA:
        none = slice(entry_end, entry_end)
        return RowLayout(slice(0, d), slice(d, d + raw), slice(d + raw, entry_end), none, none,
                         entry_end)  # fmt: skip
    index_end = entry_end + 4 * i
    return RowLayout(
        slice(0, d),
        slice(d, d + raw),
        slice(d + raw, entry_end),
        slice(entry_end, index_end),
        slice(index_end, index_end + i),
        index_end + i,
    )


class DeepseekV4Attention(nn.Module):
    """transformers' DeepseekV4Attention (module names verbatim) over the cache of this
    module's docstring; `width` is the whole cache row (the widest layer's)."""

    def __init__(
        self,
        layer: int,
        kind: str,
        hidden: int,
        heads: int,
        head_dim: int,
        q_lora_rank: int,
        o_groups: int,
        o_lora_rank: int,
        window: int,
        rates: dict[str, int],
        index: tuple[int, int, int],  # index_n_heads, index_head_dim, index_topk
        eps: float,
        width: int,
    ) -> None:
        super().__init__()
        self.layer, self.kind, self.heads, self.head_dim = layer, kind, heads, head_dim
        self.eps, self.window, self.width, self.groups = eps, window, width, o_groups
        self.rope_kind = "main" if kind == SLIDING else "compress"
        self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=False)
        self.q_a_norm = V4RMSNorm(q_lora_rank, eps)
        self.q_b_proj = nn.Linear(q_lora_rank, heads * head_dim, bias=False)
        self.kv_proj = nn.Linear(hidden, head_dim, bias=False)
        self.kv_norm = V4RMSNorm(head_dim, eps)
        self.o_a_proj = nn.Linear(heads * head_dim // o_groups, o_groups * o_lora_rank, bias=False)
        self.o_b_proj = nn.Linear(o_groups * o_lora_rank, hidden, bias=False)
        self.sinks = nn.Parameter(torch.zeros(heads))
        self.layout = row_layout(kind, head_dim, index[1])
        self.compressor: Compressor | None = None
        if kind != SLIDING:
            self.compressor = Compressor(hidden, head_dim, rates[kind], kind == CSA, eps)
            if kind == CSA:
                self.compressor.indexer = Indexer(
                    hidden, q_lora_rank, index[0], index[1], rates[kind], index[2], eps
                )

    def forward(
        self, x: torch.Tensor, where: Positions, batch: AttentionBatch, cache: torch.Tensor
    ) -> torch.Tensor:
        """x [B, T, H] (the normed collapsed streams); cache [layers, P, PS, width] (this
        layer's rows written in place) -> [B, T, H]."""
        rows, tokens, _ = x.shape
        cos, sin = where.rope[self.rope_kind]
        q_residual = self.q_a_norm(self.q_a_proj(x))
        q = self.q_b_proj(q_residual).view(rows, tokens, -1, self.head_dim).transpose(1, 2)
        q = apply_rope(unweighted_rms_norm(q, self.eps), cos, sin)  # [B, h, T, D]
        key = apply_rope(self.kv_norm(self.kv_proj(x))[:, None], cos, sin)[:, 0]  # [B, T, D]
        layout, comp = self.layout, self.compressor
        parts = [key]
        indexer = None
        if comp is not None:
            parts += [comp.raw(x), key.new_zeros(rows, tokens, comp.dim)]
            indexer = comp.indexer
            if indexer is not None:
                parts += [indexer.raw(x), key.new_zeros(rows, tokens, indexer.dim)]
        row = self._row(parts)
        batch.write(cache, self.layer, -1, row)
        rows_of = cache[self.layer]  # [P, PS, width]: columns are gathered as needed
        if comp is not None:  # the candidates read this forward's raw rows
            parts[2] = comp.candidates(batch.keys(rows_of[..., layout.raw]), where)
            if indexer is not None:
                raw = batch.keys(rows_of[..., layout.index_raw])
                parts[4] = indexer.candidates(raw, where)
            batch.write(cache, self.layer, -1, self._row(parts))
        visible = where.sliding
        values = batch.keys(rows_of[..., layout.key])  # [B, Lk, D]
        if comp is not None:
            chosen = where.closed(comp.rate)
            if indexer is not None:
                index_keys = batch.keys(rows_of[..., layout.index_entry])
                chosen = indexer.select(x, q_residual, index_keys, where)
            entries = batch.keys(rows_of[..., layout.entry])
            values = torch.cat([values, entries], dim=1)  # [B, 2 Lk, D]
            visible = torch.cat([visible, chosen], dim=-1)
        out = self._attend(q, values, visible)  # [B, h, T, D]
        out = apply_rope(out, cos, -sin).transpose(1, 2)  # [B, T, h, D]
        grouped = out.reshape(rows * tokens, self.groups, -1).transpose(0, 1)  # [g, N, in]
        weight = self.o_a_proj.weight.view(self.groups, -1, grouped.shape[-1]).transpose(1, 2)
        grouped = torch.bmm(grouped, weight).transpose(0, 1)  # [N, g, o_lora]
        return self.o_b_proj(grouped.reshape(rows, tokens, -1))

    def _row(self, parts: list[torch.Tensor]) -> torch.Tensor:
        row = torch.cat(parts, dim=-1)
        pad = self.width - row.shape[-1]
        return F.pad(row, (0, pad)) if pad else row

    def _attend(self, q: torch.Tensor, values: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """transformers' eager attention with sinks, one shared key = value head: q [B, h, T,
        D], values [B, L, D], visible [B, 1, T, L] bool -> [B, h, T, D]."""
        scores = torch.matmul(q, values.transpose(1, 2)[:, None]) * self.head_dim**-0.5
        scores = scores.masked_fill(~visible, float("-inf"))
        rows, heads, tokens, _ = scores.shape
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(rows, heads, tokens, 1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1, dtype=logits.dtype)[..., :-1].to(values.dtype)
        return torch.matmul(probs, values[:, None])
