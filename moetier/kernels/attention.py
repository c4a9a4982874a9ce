"""Decode attention (one query token per row) of grouped-query attention over a paged KV cache:
`torch.ops.moetier.decode_attention`.

The cache is pages [P, KVH, page_size, D]; row b's position p lives in page
page_table[b, p // page_size] at offset p % page_size. A static cache [B, KVH, L, D] is one page
of L positions per row: without a page table row b reads page b (no table lookups, the kernel of
a static cache).

SDPA over the whole cache, after the kv heads are repeated to the query heads, took ~7 µs per
layer of a batch-1 decode step of Qwen3-30B-A3B on the H200 (plus ~2-3 µs of inductor prologue
that builds the expanded keys and the mask), for a few hundred KB read: launch latency, not
bytes. Here one Triton launch does it (two for long caches):

- one program per (batch row, kv head, split of the cache): the kv head's G = H / KVH query
  heads as one [G, D] tile (padded to 16 rows for `tl.dot`), keys and values in BLOCK_L chunks
  up to the row's position only (nothing past position + 1 is read; each key's page looked up in
  the row's page table), online softmax in fp32 (exp2 domain), a [G, D] fp32 accumulator;
- short caches (max_len <= SPLIT_THRESHOLD, the common decode case): one split, the program
  writes the output;
- long caches (flash-decoding): the cache splits into ranges so that a few hundred programs
  run; each writes its normalised partial output and log-sum-exp, and a second kernel (one
  program per (row, query head)) combines the splits.

`choose_config` picks the split count and tiles from shapes only (never from positions: no host
sync, so the op captures into a CUDA graph). The plain-torch twin `decode_attention_ref` (repeat
kv + SDPA with the position mask, what `Attention.forward` does for prefill) is the CPU path and
the test oracle.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

SPLIT_THRESHOLD = 512  # caches of more positions than this split across programs
TARGET_PROGRAMS = 264  # two per SM of an H200 (132 SMs)
MIN_SPLIT_KEYS = 128  # fewest cache positions a split covers


@dataclass(frozen=True)
class DecodeConfig:
    """One launch's choices: `splits` ranges of the cache (1: single pass), `block_l` keys per
    loop step, and the kernel's warps and pipeline stages."""

    splits: int
    block_l: int
    num_warps: int
    num_stages: int


def gather_pages(cache: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """cache [P, KVH, page_size, D], page_table [B, W] -> each row's positions in order,
    [B, KVH, W * page_size, D] (a copy)."""
    batch, width = page_table.shape
    pages = cache[page_table.long()]  # [B, W, KVH, PS, D]
    kv_heads, size, dim = cache.shape[1:]
    return pages.transpose(1, 2).reshape(batch, kv_heads, width * size, dim)


def decode_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor | None,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """q [B, H, 1, D]; k_cache, v_cache [P, KVH, page_size, D] (any strides); page_table [B, W]
    int32 (row b's pages in order; None: page b is row b); positions [B] int64, the query's
    position (keys at positions <= it are visible); H a multiple of KVH, query head h reads kv
    head h // (H / KVH) -> [B, H, 1, D] in q's dtype. The pages gathered, repeat kv + SDPA with
    the position mask, as `Attention.forward` computes prefill."""
    if page_table is not None:
        k_cache, v_cache = gather_pages(k_cache, page_table), gather_pages(v_cache, page_table)
    batch, kv_heads, length, dim = k_cache.shape
    groups = q.shape[1] // kv_heads
    keys = k_cache[:, :, None].expand(batch, kv_heads, groups, length, dim)
    values = v_cache[:, :, None].expand(batch, kv_heads, groups, length, dim)
    visible = torch.arange(length, device=q.device)[None, :] <= positions[:, None]  # [B, L]
    return F.scaled_dot_product_attention(
        q,
        keys.reshape(batch, -1, length, dim),  # [B, H, L, D]
        values.reshape(batch, -1, length, dim),
        attn_mask=visible[:, None, None, :],  # [B, 1, 1, L]
        scale=scale,
    )


def choose_config(
    batch: int,
    kv_heads: int,
    max_len: int,
    dtype: torch.dtype,
    split_threshold: int = SPLIT_THRESHOLD,
) -> DecodeConfig:
    """The one place the decode kernel's variant is chosen, from shapes only (never positions).
    Splits: 1 up to `split_threshold` cache positions; beyond, enough for ~TARGET_PROGRAMS
    programs over (batch, kv_heads), none shorter than MIN_SPLIT_KEYS positions. Tiles: 64 keys,
    4 warps, 3 stages for 16-bit caches (88 registers at head_dim 128 on sm_90, no spills);
    fp32 caches (exact `ieee` dots run on FMA units) 32 keys, 8 warps, 2 stages, which keep the
    split variant from spilling."""
    splits = 1
    if max_len > split_threshold:
        for_occupancy = -(-TARGET_PROGRAMS // (batch * kv_heads))
        by_length = -(-max_len // MIN_SPLIT_KEYS)
        splits = max(1, min(for_occupancy, by_length))
    if dtype == torch.float32:
        return DecodeConfig(splits, block_l=32, num_warps=8, num_stages=2)
    return DecodeConfig(splits, block_l=64, num_warps=4, num_stages=3)


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_attention_kernel(
        q, sqb, sqh, k, skb, skh, skl, v, svb, svh, svl, page_table, spt, page_size, positions, sp,
        out, part_o, part_lse, scale_log2, L, D, chunk,
        G: tl.constexpr, KVH: tl.constexpr, SPLITS: tl.constexpr, BLOCK_G: tl.constexpr,
        BLOCK_L: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr,
        PAGED: tl.constexpr,
    ):  # fmt: skip
        """One program per (row b, kv head, split s): query heads kvh * G + [0, G) over the row's
        positions [s * chunk, min((s + 1) * chunk, position + 1)); PAGED: position p read from
        page page_table[b, p // page_size] (k and v: [pages, KVH, page_size, D] with strides
        skb / svb per page, skl / svl per position), else from page b (a static cache, no table
        read). SPLITS == 1: writes out;
        else part_o [B, H, SPLITS, D] fp32 (normalised) and part_lse [B, H, SPLITS] fp32
        (log2-sum-exp2 of the scaled scores, -inf for an empty range)."""
        pid = tl.program_id(0)
        split = tl.program_id(1)
        b = (pid // KVH).to(tl.int64)
        kvh = pid % KVH
        g = tl.arange(0, BLOCK_G)
        d = tl.arange(0, BLOCK_D)
        g_ok = g < G
        d_ok = d < D
        head = kvh * G + g  # [BLOCK_G] query heads
        q_tile = tl.load(
            q + b * sqb + head[:, None] * sqh + d[None, :],
            mask=g_ok[:, None] & d_ok[None, :], other=0.0,
        )  # [BLOCK_G, BLOCK_D]  # fmt: skip
        position = tl.load(positions + b * sp).to(tl.int32)
        lo = split * chunk
        hi = tl.minimum(tl.minimum(lo + chunk, position + 1), L)
        k_base = k + kvh.to(tl.int64) * skh
        v_base = v + kvh.to(tl.int64) * svh
        if not PAGED:
            k_base += b * skb
            v_base += b * svb
        row_pages = page_table + b * spt
        m_i = tl.full((BLOCK_G,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_G,), tl.float32)
        acc = tl.zeros((BLOCK_G, BLOCK_D), tl.float32)
        for start in range(lo, hi, BLOCK_L):
            keys = start + tl.arange(0, BLOCK_L)
            k_ok = keys < hi
            kv_mask = k_ok[:, None] & d_ok[None, :]
            if PAGED:
                page = tl.load(row_pages + keys // page_size, mask=k_ok, other=0).to(tl.int64)
                k_rows = page * skb + (keys % page_size) * skl
                v_rows = page * svb + (keys % page_size) * svl
            else:
                k_rows = keys * skl
                v_rows = keys * svl
            k_tile = tl.load(k_base + k_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q_tile, tl.trans(k_tile), input_precision=PRECISION) * scale_log2
            s = tl.where(k_ok[None, :], s, float("-inf"))  # [BLOCK_G, BLOCK_L], log2 units
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: each chunk holds a key
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v_tile = tl.load(v_base + v_rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + tl.dot(
                p.to(v_tile.dtype), v_tile, input_precision=PRECISION
            )
            m_i = m_new
        out_mask = g_ok[:, None] & d_ok[None, :]
        l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty range leaves o = 0 and lse = -inf
        o = acc / l_safe[:, None]
        if SPLITS == 1:
            tl.store(
                out + (b * (KVH * G) + head[:, None]) * D + d[None, :],
                o.to(out.dtype.element_ty), mask=out_mask,
            )  # fmt: skip
        else:
            row = (b * (KVH * G) + head) * SPLITS + split  # [BLOCK_G] in [B * H * SPLITS]
            tl.store(part_o + row[:, None] * D + d[None, :], o, mask=out_mask)
            lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(part_lse + row, lse, mask=g_ok)

    @triton.jit
    def _combine_splits_kernel(
        part_o, part_lse, out, D,
        SPLITS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """One program per (row b, query head h): the splits' partial outputs weighted by
        exp2(lse - max lse), divided by the weights' sum."""
        pid = tl.program_id(0).to(tl.int64)  # b * H + h
        s = tl.arange(0, BLOCK_S)
        d = tl.arange(0, BLOCK_D)
        s_ok = s < SPLITS
        lse = tl.load(part_lse + pid * SPLITS + s, mask=s_ok, other=float("-inf"))
        weight = tl.exp2(lse - tl.max(lse, axis=0))  # split 0 always holds position 0
        parts = tl.load(
            part_o + (pid * SPLITS + s[:, None]) * D + d[None, :],
            mask=s_ok[:, None] & (d[None, :] < D), other=0.0,
        )  # [BLOCK_S, BLOCK_D]  # fmt: skip
        o = tl.sum(parts * weight[:, None], axis=0) / tl.sum(weight, axis=0)
        tl.store(out + pid * D + d, o.to(out.dtype.element_ty), mask=d < D)

except ImportError:  # pragma: no cover - triton is a dependency on Linux x86_64
    triton = None


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _runs_triton(q: torch.Tensor) -> bool:
    """On CUDA; under Triton's interpreter (the CPU tests) only for fp32, since the interpreter
    computes 16-bit `tl.dot` wrongly."""
    if triton is None:
        return False
    return q.dtype == torch.float32 if _interpreted() else q.is_cuda


def _check(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor | None,
    positions: torch.Tensor,
) -> None:
    if q.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"q must be [B, H, 1, D] (one decode token per row), got {q.shape}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(
            "k_cache and v_cache must both be [pages, KVH, page_size, D], got "
            f"{k_cache.shape}, {v_cache.shape}"
        )
    batch, heads, _, dim = q.shape
    if k_cache.shape[3] != dim:
        raise ValueError(f"cache {k_cache.shape} does not match q {q.shape} in head_dim")
    if page_table is None:
        if k_cache.shape[0] != batch:
            raise ValueError(f"a static cache {k_cache.shape} holds one row per query row")
    elif page_table.dim() != 2 or page_table.shape[0] != batch or page_table.dtype != torch.int32:
        raise ValueError(f"page_table must be [B = {batch}, W] int32, got {page_table.shape}")
    if heads % k_cache.shape[1]:
        raise ValueError(f"{heads} query heads are not a multiple of {k_cache.shape[1]} kv heads")
    if positions.shape != (batch,) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be [B] = [{batch}] int64, got {positions.shape}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"q, keys and values differ in dtype: {q.dtype}, {k_cache.dtype}")


def decode_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor | None,
    positions: torch.Tensor,
    scale: float,
    splits: int | None = None,
) -> torch.Tensor:
    """The Triton kernels (also on CPU under TRITON_INTERPRET=1, for the tests); same operands
    as `decode_attention_ref`, any batch / head / position strides, head_dim contiguous in the
    cache. splits: ranges of the positions run as separate programs and combined (default from
    `choose_config`; the tests force it)."""
    _check(q, k_cache, v_cache, page_table, positions)
    if _interpreted() and q.dtype != torch.float32:
        raise ValueError("Triton's interpreter computes 16-bit tl.dot wrongly: test in fp32")
    if k_cache.stride(3) != 1 or v_cache.stride(3) != 1:
        raise ValueError("the cache's head_dim must be contiguous (stride 1)")
    if q.stride(3) != 1:
        q = q.contiguous()  # [B, H, 1, D]: a few KB
    batch, heads, _, dim = q.shape
    kv_heads, page_size = k_cache.shape[1], k_cache.shape[2]
    width = 1 if page_table is None else page_table.shape[1]
    length = width * page_size  # the most positions a row can hold
    config = choose_config(batch, kv_heads, length, q.dtype)
    if splits is not None:
        config = replace(config, splits=splits)
    out = q.new_empty(batch, heads, 1, dim)
    if batch == 0 or length == 0:
        return out.zero_()
    # positions [s * chunk, (s + 1) * chunk) per split, whole loop steps
    chunk = triton.cdiv(triton.cdiv(length, config.splits), config.block_l) * config.block_l
    block_d = max(16, triton.next_power_of_2(dim))
    if config.splits > 1:
        shape = (batch, heads, config.splits)
        part_o = torch.empty(*shape, dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # not touched
    groups = heads // kv_heads
    _decode_attention_kernel[(batch * kv_heads, config.splits)](
        q, q.stride(0), q.stride(1), k_cache, *k_cache.stride()[:3], v_cache, *v_cache.stride()[:3],
        positions if page_table is None else page_table,  # not read when not PAGED
        0 if page_table is None else page_table.stride(0), page_size, positions,
        positions.stride(0), out, part_o, part_lse, scale * 1.4426950408889634,
        length, dim, chunk, G=groups, KVH=kv_heads, SPLITS=config.splits,
        BLOCK_G=max(16, triton.next_power_of_2(groups)), BLOCK_L=config.block_l, BLOCK_D=block_d,
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PAGED=page_table is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if config.splits > 1:
        _combine_splits_kernel[(batch * heads,)](
            part_o, part_lse, out, dim, SPLITS=config.splits,
            BLOCK_S=triton.next_power_of_2(config.splits), BLOCK_D=block_d, num_warps=1,
        )  # fmt: skip
    return out


@torch.library.custom_op("moetier::decode_attention", mutates_args=())
def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor | None,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Attention of one query token per row over a paged cache. q [B, H, 1, D]; k_cache,
    v_cache [pages, KVH, page_size, D] (this layer's views of the cache; any strides but a
    contiguous head_dim); page_table [B, W] int32 (row b's pages in order; None: a static
    cache [B, KVH, L, D], row b is page b, nothing to look up); positions [B] int64
    (keys at positions <= it are visible); query head h reads kv head h // (H / KVH) ->
    [B, H, 1, D] in q's dtype, contiguous. Triton on CUDA (no host sync: CUDA-graph safe) and
    for fp32 under TRITON_INTERPRET=1; `decode_attention_ref` otherwise."""
    if not _runs_triton(q):
        _check(q, k_cache, v_cache, page_table, positions)
        return decode_attention_ref(q, k_cache, v_cache, page_table, positions, scale).contiguous()
    return decode_attention_triton(q, k_cache, v_cache, page_table, positions, scale)


@decode_attention.register_fake
def _(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor | None,
    positions: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], 1, q.shape[3])
