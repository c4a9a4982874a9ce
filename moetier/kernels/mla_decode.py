"""Decode attention of multi-head latent attention (DeepSeek-V2/V3, one query token per row) over
the paged latent cache: `torch.ops.moetier.mla_decode`.

The cache is what models/layers.py `new_latent_cache` holds, one layer's view [P, page_size, W]:
per position the normalised KV latent (its first C = kv_lora_rank values) and the rotated shared
rope key (the next R), W >= C + R (glm_moe_dsa keeps its indexer key after them); row b's
position p lives in page page_table[b, p // page_size] at offset p % page_size (no table: row b
is page b, the static cache). The query is already absorbed (MLAttention does that before):
per head [q_nope @ W_k ; rotated q_pe], C + R values, so a score is one dot product with the
cache row's first C + R values and the value is the latent itself; the output [B, H, C] is the
attended latent, which MLAttention multiplies by kv_b_proj's value half. All heads share one
key, so a head block's keys are read once for all of its heads.

- one program per (batch row, block of BLOCK_H query heads, split of the cache): the heads'
  [BLOCK_H, C] and [BLOCK_H, R] query tiles, the cache in BLOCK_L chunks up to the row's
  position only (nothing past position + 1 is read; each position's page looked up in the
  row's table), the latent chunk used for both the scores and the values, online softmax in
  fp32 (exp2 domain), a [BLOCK_H, C] fp32 accumulator;
- long caches split into ranges (flash-decoding) so that a few hundred programs run; each
  writes its normalised partial output and log-sum-exp, which kernels/attention.py's
  `_combine_splits_kernel` combines (one program per (row, head)).

`choose_config` picks the split count and tiles from shapes only (never positions: no host
sync, CUDA-graph capturable). The plain-torch twin `mla_decode_ref` (pages gathered, one SDPA
call with the heads as query rows, what MLAttention computes for prefill) is the CPU path and
the test oracle.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from moetier.kernels.attention import MIN_SPLIT_KEYS, TARGET_PROGRAMS, _interpreted

SPLIT_THRESHOLD = 256  # caches of more positions than this split across programs
BLOCK_H = 16  # query heads per program: the smallest `tl.dot` tile


@dataclass(frozen=True)
class MlaDecodeConfig:
    """One launch's choices: `splits` ranges of the cache (1: single pass), `block_h` heads and
    `block_l` positions per loop step, the kernel's warps and pipeline stages."""

    splits: int
    block_h: int
    block_l: int
    num_warps: int
    num_stages: int


def gather_latent(cache: torch.Tensor, page_table: torch.Tensor) -> torch.Tensor:
    """cache [P, page_size, W], page_table [B, T] -> each row's positions in order,
    [B, T * page_size, W] (a copy)."""
    batch, width = page_table.shape
    return cache[page_table.long()].reshape(batch, width * cache.shape[1], cache.shape[2])


def mla_decode_ref(
    q: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor | None,
    positions: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """q [B, H, C + R] (absorbed queries, C = kv_lora_rank); cache [P, page_size, W >= C + R]
    (any strides); page_table [B, T] int32 (row b's pages in order; None: page b is row b);
    positions [B] int64, the query's position (keys at positions <= it are visible) ->
    [B, H, C] in q's dtype: softmax(scale * q . cache[:, :C + R]) over the visible positions
    applied to the latents cache[:, :C]. The pages gathered and one SDPA call with the heads as
    query rows, as MLAttention computes prefill."""
    keys = cache if page_table is None else gather_latent(cache, page_table)  # [B, L, W]
    keys = keys[:, None, :, : q.shape[-1]]  # [B, 1, L, C + R]: one key for every head
    visible = torch.arange(keys.shape[2], device=q.device)[None, :] <= positions[:, None]
    out = F.scaled_dot_product_attention(
        q[:, None],  # [B, 1, H, C + R]
        keys,
        keys[..., :kv_lora_rank],  # the latent is the value
        attn_mask=visible[:, None, None, :],  # [B, 1, 1, L]
        scale=scale,
    )  # [B, 1, H, C]
    return out[:, 0]


def choose_config(
    batch: int,
    heads: int,
    max_len: int,
    dtype: torch.dtype,
    split_threshold: int = SPLIT_THRESHOLD,
) -> MlaDecodeConfig:
    """The one place the MLA decode kernel's variant is chosen, from shapes only (never
    positions). Splits: 1 up to `split_threshold` cache positions; beyond, enough for
    ~TARGET_PROGRAMS programs over (batch, head blocks), none shorter than MIN_SPLIT_KEYS
    positions. Tiles (untimed; chosen for registers at kv_lora_rank 512): 16 heads, 32
    positions, 8 warps (the [16, 512] fp32 accumulator is 32 registers a thread), 2 stages for
    16-bit caches; fp32 caches (exact `ieee` dots on FMA units) 16 positions, 1 stage."""
    splits = 1
    if max_len > split_threshold:
        head_blocks = -(-heads // BLOCK_H)
        for_occupancy = -(-TARGET_PROGRAMS // (batch * head_blocks))
        by_length = -(-max_len // MIN_SPLIT_KEYS)
        splits = max(1, min(for_occupancy, by_length))
    if dtype == torch.float32:
        return MlaDecodeConfig(splits, BLOCK_H, block_l=16, num_warps=8, num_stages=1)
    return MlaDecodeConfig(splits, BLOCK_H, block_l=32, num_warps=8, num_stages=2)


try:
    import triton
    import triton.language as tl

    from moetier.kernels.attention import _combine_splits_kernel

    @triton.jit
    def _mla_decode_kernel(
        q, sqb, sqh, cache, scp, scl, page_table, spt, page_size, positions, sp,
        out, part_o, part_lse, scale_log2, L, H, C, R, chunk,
        SPLITS: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_L: tl.constexpr,
        BLOCK_C: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
        PAGED: tl.constexpr,
    ):  # fmt: skip
        """One program per (row b, head block, split s): query heads hb * BLOCK_H + [0, BLOCK_H)
        over the row's positions [s * chunk, min((s + 1) * chunk, position + 1)); PAGED:
        position p read from page page_table[b, p // page_size] (cache [pages, page_size, W]
        with strides scp per page, scl per position), else from page b. Scores: the query's
        first C values against the latent, the next R against the rope key; values: the latent.
        SPLITS == 1: writes out [B, H, C]; else part_o [B, H, SPLITS, C] fp32 (normalised) and
        part_lse [B, H, SPLITS] fp32 (log2-sum-exp2 of the scaled scores, -inf if empty)."""
        pid = tl.program_id(0)
        split = tl.program_id(1)
        head_blocks = tl.cdiv(H, BLOCK_H)
        b = (pid // head_blocks).to(tl.int64)
        head = (pid % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        c = tl.arange(0, BLOCK_C)
        r = tl.arange(0, BLOCK_R)
        h_ok = head < H
        c_ok = c < C
        r_ok = r < R
        q_row = q + b * sqb + head[:, None] * sqh
        q_lat = tl.load(q_row + c[None, :], mask=h_ok[:, None] & c_ok[None, :], other=0.0)
        q_rot = tl.load(q_row + C + r[None, :], mask=h_ok[:, None] & r_ok[None, :], other=0.0)
        position = tl.load(positions + b * sp).to(tl.int32)
        lo = split * chunk
        hi = tl.minimum(tl.minimum(lo + chunk, position + 1), L)
        base = cache
        if not PAGED:
            base += b * scp
        row_pages = page_table + b * spt
        m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)
        l_i = tl.zeros((BLOCK_H,), tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_C), tl.float32)
        for start in range(lo, hi, BLOCK_L):
            keys = start + tl.arange(0, BLOCK_L)
            k_ok = keys < hi
            if PAGED:
                page = tl.load(row_pages + keys // page_size, mask=k_ok, other=0).to(tl.int64)
                rows = page * scp + (keys % page_size) * scl
            else:
                rows = keys.to(tl.int64) * scl
            latent = tl.load(
                base + rows[:, None] + c[None, :], mask=k_ok[:, None] & c_ok[None, :], other=0.0
            )  # [BLOCK_L, BLOCK_C]
            rot = tl.load(
                base + rows[:, None] + C + r[None, :],
                mask=k_ok[:, None] & r_ok[None, :], other=0.0,
            )  # [BLOCK_L, BLOCK_R]  # fmt: skip
            s = tl.dot(q_lat, tl.trans(latent), input_precision=PRECISION)
            s = tl.dot(q_rot, tl.trans(rot), acc=s, input_precision=PRECISION) * scale_log2
            s = tl.where(k_ok[None, :], s, float("-inf"))  # [BLOCK_H, BLOCK_L], log2 units
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: each chunk holds a key
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(
                p.to(latent.dtype), latent, input_precision=PRECISION
            )
            m_i = m_new
        out_mask = h_ok[:, None] & c_ok[None, :]
        l_safe = tl.where(l_i > 0, l_i, 1.0)  # an empty range leaves o = 0 and lse = -inf
        o = acc / l_safe[:, None]
        if SPLITS == 1:
            tl.store(
                out + (b * H + head[:, None]) * C + c[None, :],
                o.to(out.dtype.element_ty), mask=out_mask,
            )  # fmt: skip
        else:
            row = (b * H + head) * SPLITS + split  # [BLOCK_H] in [B * H * SPLITS]
            tl.store(part_o + row[:, None] * C + c[None, :], o, mask=out_mask)
            lse = tl.where(l_i > 0, m_i + tl.log2(l_safe), float("-inf"))
            tl.store(part_lse + row, lse, mask=h_ok)

except ImportError:  # pragma: no cover - triton is a dependency on Linux x86_64
    triton = None


def _runs_triton(q: torch.Tensor) -> bool:
    """On CUDA; under Triton's interpreter (the CPU tests) only for fp32, since the interpreter
    computes 16-bit `tl.dot` wrongly."""
    if triton is None:
        return False
    return q.dtype == torch.float32 if _interpreted() else q.is_cuda


def _check(
    q: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor | None,
    positions: torch.Tensor,
    kv_lora_rank: int,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [B, H, kv_lora_rank + rope_dim] (one token a row), {q.shape}")
    if cache.dim() != 3:
        raise ValueError(f"cache must be one layer's [pages, page_size, width], got {cache.shape}")
    batch = q.shape[0]
    if not 0 < kv_lora_rank < q.shape[2] <= cache.shape[2]:
        raise ValueError(
            f"q {q.shape} must hold kv_lora_rank = {kv_lora_rank} latent and some rope values, "
            f"no more than the cache's width {cache.shape[2]}"
        )
    if page_table is None:
        if cache.shape[0] != batch:
            raise ValueError(f"a static cache {cache.shape} holds one row per query row")
    elif page_table.dim() != 2 or page_table.shape[0] != batch or page_table.dtype != torch.int32:
        raise ValueError(f"page_table must be [B = {batch}, T] int32, got {page_table.shape}")
    if positions.shape != (batch,) or positions.dtype != torch.int64:
        raise ValueError(f"positions must be [B] = [{batch}] int64, got {positions.shape}")
    if q.dtype != cache.dtype:
        raise ValueError(f"q and the cache differ in dtype: {q.dtype}, {cache.dtype}")


def mla_decode_triton(
    q: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor | None,
    positions: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
    splits: int | None = None,
) -> torch.Tensor:
    """The Triton kernels (also on CPU under TRITON_INTERPRET=1, for the tests); same operands
    as `mla_decode_ref`, any batch / head / page / position strides, the last dim contiguous.
    splits: ranges of the positions run as separate programs and combined (default from
    `choose_config`; the tests force it)."""
    _check(q, cache, page_table, positions, kv_lora_rank)
    if _interpreted() and q.dtype != torch.float32:
        raise ValueError("Triton's interpreter computes 16-bit tl.dot wrongly: test in fp32")
    if cache.stride(2) != 1:
        raise ValueError("the cache's last dim must be contiguous (stride 1)")
    if q.stride(2) != 1:
        q = q.contiguous()  # [B, H, C + R]: a few hundred KB at most
    batch, heads, dim = q.shape
    lora, rope, page_size = kv_lora_rank, dim - kv_lora_rank, cache.shape[1]
    width = 1 if page_table is None else page_table.shape[1]
    length = width * page_size  # the most positions a row can hold
    config = choose_config(batch, heads, length, q.dtype)
    if splits is not None:
        config = replace(config, splits=splits)
    out = q.new_empty(batch, heads, lora)
    if batch == 0 or length == 0:
        return out.zero_()
    # positions [s * chunk, (s + 1) * chunk) per split, whole loop steps
    chunk = triton.cdiv(triton.cdiv(length, config.splits), config.block_l) * config.block_l
    block_c = max(16, triton.next_power_of_2(lora))
    if config.splits > 1:
        shape = (batch, heads, config.splits)
        part_o = torch.empty(*shape, lora, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(shape, dtype=torch.float32, device=q.device)
    else:
        part_o = part_lse = out  # not touched
    head_blocks = triton.cdiv(heads, config.block_h)
    _mla_decode_kernel[(batch * head_blocks, config.splits)](
        q, q.stride(0), q.stride(1), cache, cache.stride(0), cache.stride(1),
        positions if page_table is None else page_table,  # not read when not PAGED
        0 if page_table is None else page_table.stride(0), page_size, positions,
        positions.stride(0), out, part_o, part_lse, scale * 1.4426950408889634,
        length, heads, lora, rope, chunk, SPLITS=config.splits, BLOCK_H=config.block_h,
        BLOCK_L=config.block_l, BLOCK_C=block_c, BLOCK_R=max(16, triton.next_power_of_2(rope)),
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32", PAGED=page_table is not None,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip
    if config.splits > 1:
        _combine_splits_kernel[(batch * heads,)](
            part_o, part_lse, out, lora, SPLITS=config.splits,
            BLOCK_S=triton.next_power_of_2(config.splits), BLOCK_D=block_c, num_warps=4,
        )  # fmt: skip
    return out


@torch.library.custom_op("moetier::mla_decode", mutates_args=())
def mla_decode(
    q: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor | None,
    positions: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """MLA attention of one absorbed query token per row over the paged latent cache. q [B, H,
    kv_lora_rank + rope_dim] (per head q_nope @ W_k then the rotated q_pe); cache [pages,
    page_size, W] (one layer's view of `new_latent_cache`: the latent, the rope key, anything
    after them unread; the last dim contiguous); page_table [B, T] int32 (row b's pages in
    order; None: a static cache, row b is page b); positions [B] int64 (positions <= it are
    visible) -> the attended latent [B, H, kv_lora_rank] in q's dtype, contiguous. Triton on
    CUDA (no host sync: CUDA-graph safe) and for fp32 under TRITON_INTERPRET=1; `mla_decode_ref`
    otherwise."""
    if not _runs_triton(q):
        _check(q, cache, page_table, positions, kv_lora_rank)
        return mla_decode_ref(q, cache, page_table, positions, kv_lora_rank, scale).contiguous()
    return mla_decode_triton(q, cache, page_table, positions, kv_lora_rank, scale)


@mla_decode.register_fake
def _(
    q: torch.Tensor,
    cache: torch.Tensor,
    page_table: torch.Tensor | None,
    positions: torch.Tensor,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    return q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
