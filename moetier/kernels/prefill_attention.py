"""A packed step's attention read through each sequence's page table (GQA):
`torch.ops.moetier.prefill_attention`.

The engine packs a step's tokens into one row (models/attention_batch.py): chunks of prompts,
each the next positions of a sequence whose earlier positions are in its pages. SDPA needs each
sequence's keys gathered from the pages, the kv heads repeated to the query heads and a
[tokens, keys] mask, all growing with tokens x context (one Qwen3-30B-A3B layer, a 2,048-token
chunk at 64K of context: 1,425 MiB at the peak against 16 MiB here, and twice the time;
bench/prefill_attention.py on an H100, docs/benchmarks.md). Here one Triton launch reads the
pages in place:

- the step's tokens in blocks of BLOCK_M tokens of one sequence (`blocks`, [NB, 4] int32: the
  sequence, its first token's row in the packed step, its token count, its first token's
  position; `prefill_blocks` builds it on the host);
- one program per (block, query head): the block's queries [BLOCK_M, D], keys and values in
  BLOCK_N chunks from position 0 to the block's last position, each key's page looked up in the
  sequence's row of `pages` ([S, W] int32), causal (a key at or before the query's position),
  online softmax in fp32 (exp2 domain).

The plain-torch twin `prefill_attention_ref` (keys gathered per sequence, SDPA with the causal
mask) is the CPU path and the test oracle; the kernel also runs under TRITON_INTERPRET=1 in fp32.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from moetier.kernels.attention import _runs_triton

BLOCK_M = 64  # tokens of one sequence a program computes


def prefill_blocks(
    starts: Sequence[int], counts: Sequence[int], block_m: int = BLOCK_M
) -> np.ndarray:
    """Sequences whose tokens are consecutive rows of a packed step (counts[s] tokens from
    position starts[s]) -> [NB, 4] int32 blocks: (sequence, first row, tokens, first position),
    each of at most block_m tokens of one sequence; at least two rows (an empty block, which
    reads and writes nothing, after a single one: a compiled step never sees a size of 1,
    which torch.compile would specialise)."""
    rows = []
    row = 0
    for seq, (start, count) in enumerate(zip(starts, counts, strict=True)):
        for first in range(0, count, block_m):
            rows.append((seq, row + first, min(block_m, count - first), start + first))
        row += count
    while len(rows) < 2:
        rows.append((0, 0, 0, 0))
    return np.array(rows, dtype=np.int32)


def page_rows(pages: Sequence[Sequence[int]], widths: Sequence[int]) -> np.ndarray:
    """Each sequence's first widths[s] pages as a row of an [S, W] int32 table, W the widest
    (0 past a row's own pages: never read); at least 2 x 2 (as `prefill_blocks`)."""
    table = np.zeros((max(len(pages), 2), max([*widths, 2])), dtype=np.int32)
    for seq, (held, used) in enumerate(zip(pages, widths, strict=True)):
        table[seq, :used] = held[:used]
    return table


def prefill_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    blocks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [N, H, D] (the packed step's tokens); k_cache, v_cache [P, KVH, page_size, D]; pages
    [S, W] int32; blocks [NB, 4] int32 (module docstring) -> [N, H, D] in q's dtype: each
    block's queries over its sequence's keys up to each query's position."""
    out = torch.zeros_like(q)
    heads, kv_heads, page_size = q.shape[1], k_cache.shape[1], k_cache.shape[2]
    for seq, first, count, position in blocks.tolist():
        if count == 0:  # (an empty block: padding)
            continue
        end = position + count  # keys [0, end)
        used = pages[seq, : -(-end // page_size)].long()
        keys = k_cache[used].transpose(0, 1).reshape(kv_heads, -1, k_cache.shape[3])[:, :end]
        values = v_cache[used].transpose(0, 1).reshape(kv_heads, -1, v_cache.shape[3])[:, :end]
        keys = keys.repeat_interleave(heads // kv_heads, dim=0)  # [H, end, D]
        values = values.repeat_interleave(heads // kv_heads, dim=0)
        query = q[first : first + count].transpose(0, 1)  # [H, count, D]
        visible = torch.arange(end, device=q.device)[None, :] <= (
            position + torch.arange(count, device=q.device)[:, None]
        )
        got = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=scale)
        out[first : first + count] = got.transpose(0, 1)
    return out


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _prefill_attention_kernel(
        q, sqn, sqh, k, skp, skh, skl, v, svp, svh, svl, pages, spt, page_size, blocks,
        out, scale_log2, D,
        H: tl.constexpr, G: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One program per (block, query head): the block's tokens over their sequence's
        keys [0, last position], causal; writes out [N, H, D] (contiguous)."""
        blk = tl.program_id(0)
        head = tl.program_id(1)
        seq = tl.load(blocks + blk * 4).to(tl.int64)
        first = tl.load(blocks + blk * 4 + 1).to(tl.int64)
        count = tl.load(blocks + blk * 4 + 2)
        position = tl.load(blocks + blk * 4 + 3)
        m = tl.arange(0, BLOCK_M)
        d = tl.arange(0, BLOCK_D)
        m_ok = m < count
        d_ok = d < D
        q_pos = position + m  # [BLOCK_M]
        rows = first + m
        q_tile = tl.load(
            q + rows[:, None] * sqn + head * sqh + d[None, :],
            mask=m_ok[:, None] & d_ok[None, :], other=0.0,
        )  # fmt: skip
        kvh = (head // G).to(tl.int64)
        k_base = k + kvh * skh
        v_base = v + kvh * svh
        row_pages = pages + seq * spt
        hi = position + count  # keys [0, hi)
        m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_M,), tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
        for start in range(0, hi, BLOCK_N):
            keys = start + tl.arange(0, BLOCK_N)
            k_ok = keys < hi
            kv_mask = k_ok[:, None] & d_ok[None, :]
            page = tl.load(row_pages + keys // page_size, mask=k_ok, other=0).to(tl.int64)
            offset = (keys % page_size).to(tl.int64)
            k_tile = tl.load(
                k_base + (page * skp + offset * skl)[:, None] + d[None, :], mask=kv_mask,
                other=0.0,
            )  # fmt: skip
            s = tl.dot(q_tile, tl.trans(k_tile), input_precision=PRECISION) * scale_log2
            visible = k_ok[None, :] & (keys[None, :] <= q_pos[:, None])
            s = tl.where(visible, s, float("-inf"))  # key 0 is in the first chunk: finite max
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_tile = tl.load(
                v_base + (page * svp + offset * svl)[:, None] + d[None, :], mask=kv_mask,
                other=0.0,
            )  # fmt: skip
            acc = acc * alpha[:, None] + tl.dot(
                p.to(v_tile.dtype), v_tile, input_precision=PRECISION
            )
            m_i = m_new
        o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # (an empty padding block: l = 0)
        tl.store(
            out + (rows[:, None] * H + head) * D + d[None, :], o.to(out.dtype.element_ty),
            mask=m_ok[:, None] & d_ok[None, :],
        )  # fmt: skip

except ImportError:  # pragma: no cover - triton is a dependency on Linux x86_64
    triton = None


def _check(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, pages: torch.Tensor,
    blocks: torch.Tensor,
) -> None:  # fmt: skip
    if q.dim() != 3 or k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            f"q must be [N, H, D] and both caches [pages, KVH, page_size, D], got {q.shape}, "
            f"{k_cache.shape}, {v_cache.shape}"
        )
    if q.shape[2] != k_cache.shape[3] or q.shape[1] % k_cache.shape[1]:
        raise ValueError(f"cache {k_cache.shape} does not fit q {q.shape}")
    if pages.dim() != 2 or pages.dtype != torch.int32:
        raise ValueError(f"pages must be [S, W] int32, got {pages.shape} {pages.dtype}")
    if blocks.dim() != 2 or blocks.shape[1] != 4 or blocks.dtype != torch.int32:
        raise ValueError(f"blocks must be [NB, 4] int32, got {blocks.shape} {blocks.dtype}")


def prefill_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    blocks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The Triton kernel (also on CPU under TRITON_INTERPRET=1, fp32): operands as
    `prefill_attention_ref`'s; head_dim contiguous in q and the caches; blocks of at most
    BLOCK_M tokens."""
    _check(q, k_cache, v_cache, pages, blocks)
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the cache's head_dim must be contiguous (stride 1)")
    if q.stride(2) != 1:
        q = q.contiguous()
    tokens, heads, dim = q.shape
    out = q.new_empty(tokens, heads, dim)
    if tokens == 0 or blocks.shape[0] == 0:
        return out
    fp32 = q.dtype == torch.float32
    _prefill_attention_kernel[(blocks.shape[0], heads)](
        q, q.stride(0), q.stride(1), k_cache, *k_cache.stride()[:3], v_cache,
        *v_cache.stride()[:3], pages, pages.stride(0), k_cache.shape[2], blocks, out,
        scale * 1.4426950408889634, dim, H=heads, G=heads // k_cache.shape[1], BLOCK_M=BLOCK_M,
        BLOCK_N=32 if fp32 else 64, BLOCK_D=max(16, triton.next_power_of_2(dim)),
        PRECISION="ieee" if fp32 else "tf32", num_warps=8 if fp32 else 4,
        num_stages=2 if fp32 else 3,
    )  # fmt: skip
    return out


@torch.library.custom_op("moetier::prefill_attention", mutates_args=())
def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    blocks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """A packed step's GQA attention through the sequences' page tables: q [N, H, D]; k_cache,
    v_cache [pages, KVH, page_size, D] (this layer's); pages [S, W] int32; blocks [NB, 4] int32
    (module docstring) -> [N, H, D] in q's dtype, contiguous. Triton on CUDA (and fp32 under
    TRITON_INTERPRET=1), `prefill_attention_ref` otherwise."""
    if not _runs_triton(q):  # (decode_attention's rule: CUDA, or fp32 under the interpreter)
        _check(q, k_cache, v_cache, pages, blocks)
        return prefill_attention_ref(q, k_cache, v_cache, pages, blocks, scale).contiguous()
    return prefill_attention_triton(q, k_cache, v_cache, pages, blocks, scale)


@prefill_attention.register_fake
def _(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    blocks: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape)
