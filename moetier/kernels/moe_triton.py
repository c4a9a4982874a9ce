"""Triton grouped MoE kernels: experts decoded on the fly from slot-pool blobs.

Twin of `moe_ref.moe_slots_ref` (same arguments, same contract: out[t, j] = w[t, j] · expert(x[t])
for every (token, k) pair whose expert has a slot). Two launches per call:

  gate_up: part[s, p, :] = W_gu[e_p] · x[t_p] over K-split s          -> [S, P, 2I] float32
  down:    out[p, :] = w_p · (W_down[e_p] · act(Σ_s part[s, p]) + b)    -> [P, H] float32

The activation (and the gate_up bias) is applied while the down kernel loads its input, so no
kernel writes h; split-K partials are summed in a fixed order, so results do not depend on
timing (no atomics) nor on which other pairs are in the call (residency never changes numerics).

Weights are found through two tables: slot_table [E] int32 (expert -> slot, -1 = absent) and
slot_offsets [S] int64 (slot -> byte offset from `pool`'s first byte, a multiple of 256; `pool`
itself 256-byte aligned). A slot may live outside
`pool`, e.g. in pinned host memory (its offset is then host_ptr - pool_ptr, read zero-copy).

Two modes, chosen by `moe_dispatch.choose`:
  GEMV   one program per (pair, N-tile, K-split), a broadcast multiply and a sum over K: decode;
  GEMM   pairs grouped by (expert, delta on/off) into blocks of BLOCK_M rows, `tl.dot`: prefill.
A group holds only pairs with the delta on or only pairs with it off, so the delta is applied per
(token, expert) pair exactly as the mask says, and a group with it off never reads the delta blob.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from moetier.config import ExpertActivation
from moetier.core.layout import BlobFormat, format_kind, has_tensor, matrix_codecs
from moetier.kernels.moe_dispatch import KernelChoice, choose_pair

# Kinds of a matrix inside a blob (constexpr in the kernels).
NONE, RAW_F32, RAW_BF16, RAW_F16, Q2S, NVFP4, MXFP4, NESTED, NESTED_DELTA = range(-1, 8)
_RAW_KINDS = {"float32": RAW_F32, "bfloat16": RAW_BF16, "float16": RAW_F16}
_BIAS_KINDS = {"float32": 1, "bfloat16": 2, "float16": 3}
ACTIVATIONS = {"silu": 0, "silu_clamped": 1, "gpt_oss": 2}


@dataclass(frozen=True)
class MatrixSpec:
    """Where one matrix of a blob lives and how it decodes (byte offsets inside the blob)."""

    kind: int
    n: int
    k: int
    codes: int = 0  # codes (or the raw matrix, or the nested delta's low bits)
    scales: int = 0
    row_scale: int = 0  # q2s row scale
    aux: int = 0  # q2s grid (a, b) or nested table [4]
    tensor_scale: int = 0  # nvfp4 / nested
    group: int = 1  # elements per scale along K


def matrix_spec(fmt: BlobFormat | None, name: str) -> MatrixSpec | None:
    """The kernel's view of matrix `name` of `fmt`; None when the kernels cannot decode it
    (int2 / affine2 baselines and nested planes with MXFP4 scales run on the reference path)."""
    if fmt is None or fmt.name == "nested-mxfp4-base":
        return None
    kind = format_kind(fmt)
    if kind == "raw":
        spec = fmt.tensor(name)
        if spec.dtype not in _RAW_KINDS:
            return None
        n, k = spec.shape
        return MatrixSpec(_RAW_KINDS[spec.dtype], n, k, codes=spec.offset)

    def off(part: str) -> int:
        return fmt.tensor(f"{name}.{part}").offset

    if kind == "nested-delta":
        n, k4 = fmt.tensor(f"{name}.low").shape
        return MatrixSpec(NESTED_DELTA, n, 4 * k4, codes=off("low"))
    codes = fmt.tensor(f"{name}.codes")
    scales = fmt.tensor(f"{name}.scales")
    n = codes.shape[0]
    if kind == "nested-base":
        k = 4 * codes.shape[1]
        return MatrixSpec(NESTED, n, k, codes.offset, scales.offset, aux=off("table"),
                          tensor_scale=off("tensor_scale"), group=k // scales.shape[1])  # fmt: skip
    codecs = matrix_codecs(fmt)
    codec = codecs[name].kind if codecs is not None else None
    if codec == "q2s":
        k = 4 * codes.shape[1]
        return MatrixSpec(Q2S, n, k, codes.offset, scales.offset, off("row_scale"), off("grid"),
                          group=k // scales.shape[1])  # fmt: skip
    if codec in ("nvfp4", "mxfp4"):
        k = 2 * codes.shape[1]
        return MatrixSpec(NVFP4 if codec == "nvfp4" else MXFP4, n, k, codes.offset, scales.offset,
                          tensor_scale=off("tensor_scale") if codec == "nvfp4" else 0,
                          group=k // scales.shape[1])  # fmt: skip
    return None


def supports(fmt: BlobFormat, delta_fmt: BlobFormat | None) -> bool:
    """Whether these kernels decode this (base, delta) pair of formats, both matrices."""
    for name in ("gate_up", "down"):
        base = matrix_spec(fmt, name)
        if base is None or base.kind == NESTED_DELTA:
            return False
        if delta_fmt is None:
            continue
        delta = matrix_spec(delta_fmt, name)
        # a nested delta completes only a nested base; an additive delta is any decodable format
        if delta is None or (delta.kind == NESTED_DELTA) != (base.kind == NESTED):
            return False
    return True


# --------------------------------------------------------------------------------------------
# Tile decoders: rows [BN] and cols [BK] index the matrix; each returns a float32 [BN, BK] tile
# WITHOUT the per-row factor (`_row_factor`), which the caller applies once after the K loop.


@triton.jit
def _f32_at(ptr, offset):
    return tl.load((ptr + offset).to(tl.pointer_type(tl.float32)))


@triton.jit
def _e4m3(byte):
    return byte.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _e2m1(code):
    """E2M1 code (int32, 0..15) -> float32 by building the float's bits (no table, no exp2)."""
    m = code & 7
    e = m >> 1
    normal = ((e + 126) << 23) | ((m & 1) << 22)
    bits = tl.where(m >= 2, normal, tl.where(m == 1, 126 << 23, 0)) | ((code & 8) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _codes2(ptr, offset, rows, cols, K, mask):
    """2-bit codes, 4 per byte along K, code j at bits 2j -> int32 [BN, BK]."""
    byte = tl.load(ptr + offset + rows[:, None] * (K // 4) + cols[None, :] // 4, mask=mask, other=0)
    return (byte.to(tl.int32) >> ((cols[None, :] % 4) * 2)) & 3


@triton.jit
def _codes4(ptr, offset, rows, cols, K, mask):
    """E2M1 codes, 2 per byte along K, element 2j in the low nibble -> int32 [BN, BK]."""
    byte = tl.load(ptr + offset + rows[:, None] * (K // 2) + cols[None, :] // 2, mask=mask, other=0)
    return (byte.to(tl.int32) >> ((cols[None, :] % 2) * 4)) & 15


@triton.jit
def _group_scale(ptr, offset, rows, cols, K, GROUP: tl.constexpr, mask, E8M0: tl.constexpr):
    byte = tl.load(
        ptr + offset + rows[:, None] * (K // GROUP) + cols[None, :] // GROUP, mask=mask, other=0
    )
    if E8M0:
        return (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2^(s - 127)
    return _e4m3(byte)


@triton.jit
def _decode(ptr, KIND: tl.constexpr, codes, scales, aux, rows, cols, K, GROUP: tl.constexpr, mask):
    if KIND == 0:  # RAW_F32
        w = tl.load((ptr + codes).to(tl.pointer_type(tl.float32)) + rows[:, None] * K
                    + cols[None, :], mask=mask, other=0.0)  # fmt: skip
    elif KIND == 1:  # RAW_BF16
        w = tl.load((ptr + codes).to(tl.pointer_type(tl.bfloat16)) + rows[:, None] * K
                    + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # fmt: skip
    elif KIND == 2:  # RAW_F16
        w = tl.load((ptr + codes).to(tl.pointer_type(tl.float16)) + rows[:, None] * K
                    + cols[None, :], mask=mask, other=0.0).to(tl.float32)  # fmt: skip
    elif KIND == 3:  # Q2S: level (-b, -a, a, b)[c] times the group scale
        c = _codes2(ptr, codes, rows, cols, K, mask)
        a = _f32_at(ptr, aux)
        b = _f32_at(ptr, aux + 4)
        mag = tl.where((c == 1) | (c == 2), a, b)
        w = tl.where(c >= 2, mag, -mag) * _group_scale(ptr, scales, rows, cols, K, GROUP, mask, 0)
    elif KIND == 4:  # NVFP4
        w = _e2m1(_codes4(ptr, codes, rows, cols, K, mask)) * _group_scale(
            ptr, scales, rows, cols, K, GROUP, mask, 0
        )
    elif KIND == 5:  # MXFP4
        w = _e2m1(_codes4(ptr, codes, rows, cols, K, mask)) * _group_scale(
            ptr, scales, rows, cols, K, GROUP, mask, 1
        )
    else:  # NESTED base only: table[c] times the block scale
        c = _codes2(ptr, codes, rows, cols, K, mask)
        t0 = _f32_at(ptr, aux)
        t1 = _f32_at(ptr, aux + 4)
        t2 = _f32_at(ptr, aux + 8)
        t3 = _f32_at(ptr, aux + 12)
        level = tl.where(c == 0, t0, tl.where(c == 1, t1, tl.where(c == 2, t2, t3)))
        w = level * _group_scale(ptr, scales, rows, cols, K, GROUP, mask, 0)
    return w


@triton.jit
def _decode_nested_full(bptr, codes, scales, dptr, low, rows, cols, K, GROUP: tl.constexpr, mask):
    """NVFP4 rebuilt from both planes: ((base code << 2) | low) decoded with the base's scales."""
    code = (_codes2(bptr, codes, rows, cols, K, mask) << 2) | _codes2(
        dptr, low, rows, cols, K, mask
    )
    return _e2m1(code) * _group_scale(bptr, scales, rows, cols, K, GROUP, mask, 0)


@triton.jit
def _row_factor(ptr, KIND: tl.constexpr, row_scale, tensor_scale, rows, nmask):
    """Per-row factor [BN] the decoded tile is multiplied by after the K loop."""
    if KIND == 3:
        f = tl.load((ptr + row_scale).to(tl.pointer_type(tl.float32)) + rows, mask=nmask, other=0.0)
    elif (KIND == 4) or (KIND == 6):
        f = tl.zeros(rows.shape, tl.float32) + _f32_at(ptr, tensor_scale)
    else:
        f = tl.full(rows.shape, 1.0, tl.float32)
    return f


@triton.jit
def _bias(ptr, BIAS: tl.constexpr, offset, idx, mask):
    if BIAS == 1:
        b = tl.load((ptr + offset).to(tl.pointer_type(tl.float32)) + idx, mask=mask, other=0.0)
    elif BIAS == 2:
        b = tl.load((ptr + offset).to(tl.pointer_type(tl.bfloat16)) + idx, mask=mask, other=0.0)
    else:
        b = tl.load((ptr + offset).to(tl.pointer_type(tl.float16)) + idx, mask=mask, other=0.0)
    return b.to(tl.float32)


@triton.jit
def _activation(g, u, ACT: tl.constexpr, limit, alpha):
    if ACT == 0:
        y = g * tl.sigmoid(g) * u
    elif ACT == 1:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        y = g * tl.sigmoid(g) * u
    else:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        y = (u + 1) * (g * tl.sigmoid(g * alpha))
    return y


@triton.jit
def _tile_product(x, w, USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] times w [BLOCK_N, BLOCK_K] transposed -> [BLOCK_M, BLOCK_N] fp32."""
    if USE_DOT:
        y = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision=PRECISION)
    else:
        y = tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    return y


@triton.jit
def _q2s_gemv_tile(ptr, codes, scales, aux, rows, nmask, k0, k_hi, row_bytes, row_groups, x,
                   GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):  # fmt: skip
    """Σ_k W[n, k] x[k] over one K tile of a q2s matrix, without the row scale -> [BLOCK_N].

    The tile is handled as [BLOCK_N, groups, bytes per group, 4 codes] so that bytes load
    contiguously and groups reduce without reshaping registers. No per-element table lookup or
    int->float conversion: code c placed in the top mantissa bits of 1.0 gives 1 + c/4 with one
    shift and one mask-or; the level is linear in it when b = 3a (L = 8a(1 + c/4) - 11a), so per
    group Σ L x = 8a Σ (1 + c/4) x - 11a Σ x; a grid with b != 3a adds (b - 3a) Σ v x,
    v = [c = 3] - [c = 0]. Group scales are applied once per group."""
    GROUPS: tl.constexpr = BLOCK_K // GROUP
    GB: tl.constexpr = GROUP // 4  # bytes per group
    g = tl.arange(0, GROUPS)
    bcol = k0 // 4 + g[:, None] * GB + tl.arange(0, GB)[None, :]  # [GROUPS, GB] byte index
    bmask = nmask[:, None, None] & (bcol < k_hi // 4)[None, :, :]
    at = ptr + codes + rows[:, None, None] * row_bytes + bcol[None, :, :]
    byte = tl.load(at, mask=bmask, other=0).to(tl.int32)[:, :, :, None]  # [BN, GROUPS, GB, 1]
    j = tl.arange(0, 4)[None, None, None, :]
    lv = (((byte << (21 - 2 * j)) & (3 << 21)) | 0x3F800000).to(tl.float32, bitcast=True)
    x4 = tl.reshape(x, (GROUPS, GB, 4))  # element k = GROUP * g + 4 * byte + j
    s1 = tl.sum(tl.sum(lv * x4[None, :, :, :], axis=3), axis=2)  # [BN, GROUPS]
    sx = tl.sum(tl.sum(x4, axis=2), axis=1)  # [GROUPS]
    a = _f32_at(ptr, aux)
    b = _f32_at(ptr, aux + 4)
    part = 8 * a * s1 - 11 * a * sx[None, :]
    corr = b - 3 * a
    if corr != 0:
        c = (byte >> (2 * j)) & 3
        v = tl.where(c == 3, 1.0, 0.0) - tl.where(c == 0, 1.0, 0.0)
        part += corr * tl.sum(tl.sum(v * x4[None, :, :, :], axis=3), axis=2)
    gcol = k0 // GROUP + g
    gmask = nmask[:, None] & (gcol < k_hi // GROUP)[None, :]
    sc = tl.load(ptr + scales + rows[:, None] * row_groups + gcol[None, :], mask=gmask, other=0)
    return tl.sum(_e4m3(sc) * part, axis=1)


@triton.jit
def _moe_kernel(
    # routing
    x_ptr, stride_x, stride_xk, topk_ids, topk_w, delta_mask, block_pairs, block_key, num_pairs,
    # experts
    pool, slot_table, slot_offsets, delta_table,
    # input/output
    part_in, out, N, K, stride_part_s, row_bytes, row_groups,
    # base matrix
    KIND: tl.constexpr, codes, scales, row_scale, aux, tensor_scale, GROUP: tl.constexpr,
    # delta matrix
    DKIND: tl.constexpr, d_codes, d_scales, d_row_scale, d_aux, d_tensor_scale,
    DGROUP: tl.constexpr,
    # epilogue / prologue
    BIAS: tl.constexpr, in_bias, out_bias, ACT: tl.constexpr, limit, alpha,
    IS_DOWN: tl.constexpr, SPLIT_IN: tl.constexpr, TOPK: tl.constexpr,
    # tiling
    GROUPED: tl.constexpr, USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One (pair block, N-tile, K-split) program; see the module docstring for the two roles.

    gate_up (IS_DOWN=0): x = hidden[token], writes part_in-shaped partials out[s, p, n]
    down    (IS_DOWN=1): x = act(Σ_s part_in[s, p, :I] (+b), Σ_s part_in[s, p, I:] (+b)),
                         writes out[p, n] = w_p · (W x + b)
    """
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_s = tl.program_id(2)
    split = tl.num_programs(2)
    m_idx = tl.arange(0, BLOCK_M)
    if GROUPED:
        pairs = tl.load(block_pairs + pid_m * BLOCK_M + m_idx)
        key = tl.load(block_key + pid_m)  # expert * 2 + delta flag; -1 = unused block
        expert = tl.maximum(key, 0) >> 1
        use_delta = (key & 1) == 1
        pmask = pairs >= 0  # unused blocks (key -1) hold only -1 pairs
        slot = tl.where(key >= 0, tl.load(slot_table + expert), -1)
    else:  # one pair per program (BLOCK_M == 1)
        pairs = pid_m + m_idx
        expert = tl.load(topk_ids + pid_m).to(tl.int32)
        use_delta = pid_m < 0  # False
        if DKIND >= 0:
            use_delta = tl.load(delta_mask + pid_m) != 0
        pmask = pairs < num_pairs
        slot = tl.load(slot_table + expert)
    if DKIND >= 0:
        dslot = tl.load(delta_table + expert)
        use_delta = use_delta & (dslot >= 0)
    if slot >= 0:
        # slots start on TENSOR_ALIGN (256-byte) boundaries: say so, so loads vectorize
        bptr = pool + tl.multiple_of(tl.load(slot_offsets + slot), 256)
        dptr = bptr
        if DKIND >= 0:
            if use_delta:
                dptr = pool + tl.multiple_of(tl.load(slot_offsets + dslot), 256)
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rows < N
        tokens = pairs // TOPK
        k_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), split) * BLOCK_K
        k_lo = pid_s * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        acc_delta = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
        factor = _row_factor(bptr, KIND, row_scale, tensor_scale, rows, nmask)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            kmask = cols < k_hi
            wmask = nmask[:, None] & kmask[None, :]
            xmask = pmask[:, None] & kmask[None, :]
            # x tile [BLOCK_M, BLOCK_K]
            if IS_DOWN:
                g = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
                u = tl.zeros((BLOCK_M, BLOCK_K), tl.float32)
                for s in range(SPLIT_IN):
                    base = part_in + s * stride_part_s + pairs[:, None] * (2 * K)
                    g += tl.load(base + cols[None, :], mask=xmask, other=0.0)
                    u += tl.load(base + K + cols[None, :], mask=xmask, other=0.0)
                if BIAS > 0:
                    g += _bias(bptr, BIAS, in_bias, cols, kmask)[None, :]
                    u += _bias(bptr, BIAS, in_bias, K + cols, kmask)[None, :]
                x = _activation(g, u, ACT, limit, alpha)
            else:
                x_at = x_ptr + tokens[:, None] * stride_x + cols[None, :] * stride_xk
                x = tl.load(x_at, mask=xmask, other=0.0).to(tl.float32)
            if (KIND == 3) and (not USE_DOT):  # q2s GEMV: the fast path
                acc += _q2s_gemv_tile(bptr, codes, scales, aux, rows, nmask, k0, k_hi, row_bytes,
                                      row_groups, x, GROUP, BLOCK_N, BLOCK_K)[None, :]  # fmt: skip
            else:
                w = _decode(bptr, KIND, codes, scales, aux, rows, cols, K, GROUP, wmask)
                if DKIND == 7:  # nested delta: the full FP4 code replaces the base decode
                    if use_delta:
                        w = _decode_nested_full(bptr, codes, scales, dptr, d_codes, rows, cols, K,
                                                GROUP, wmask)  # fmt: skip
                acc += _tile_product(x, w, USE_DOT, DOT_DTYPE, PRECISION)
            if (DKIND >= 0) and (DKIND != 7):  # additive delta: its own product, summed below
                if use_delta:
                    dw = _decode(dptr, DKIND, d_codes, d_scales, d_aux, rows, cols, K, DGROUP,
                                 wmask)  # fmt: skip
                    acc_delta += _tile_product(x, dw, USE_DOT, DOT_DTYPE, PRECISION)
        if (DKIND >= 0) and (DKIND != 7):
            if use_delta:
                dfac = _row_factor(dptr, DKIND, d_row_scale, d_tensor_scale, rows, nmask)
                acc_delta = acc_delta * dfac[None, :]
        acc = acc * factor[None, :] + acc_delta
        omask = pmask[:, None] & nmask[None, :]
        if IS_DOWN:
            if BIAS > 0:  # the down projection is never split along K
                acc += _bias(bptr, BIAS, out_bias, rows, nmask)[None, :]
            weight = tl.load(topk_w + pairs, mask=pmask, other=0.0).to(tl.float32)
            tl.store(out + pairs[:, None] * N + rows[None, :], acc * weight[:, None], mask=omask)
        else:
            tl.store(out + pid_s * stride_part_s + pairs[:, None] * N + rows[None, :], acc,
                     mask=omask)  # fmt: skip


def _group_pairs(
    topk_ids: torch.Tensor,
    delta_on: torch.Tensor | None,
    slot_table: torch.Tensor,
    num_experts: int,
    block_m: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Blocks of BLOCK_M pairs sharing (expert, delta flag), all on the GPU (no host sync).

    Returns block_pairs [B, BLOCK_M] int32 (pair index, -1 = padding) and block_key [B] int32
    (expert * 2 + delta flag, -1 = unused block); B is the static bound ceil(P / BLOCK_M) + the
    number of groups, so the grid never depends on the routing."""
    pairs = topk_ids.numel()
    groups = 2 * num_experts
    key = topk_ids.reshape(-1).long() * 2
    if delta_on is not None:
        key = key + delta_on.reshape(-1).long()
    key = torch.where(slot_table.long()[topk_ids.reshape(-1).long()] < 0, groups, key)
    order = torch.argsort(key, stable=True)
    counts = torch.zeros(groups + 1, dtype=torch.int64, device=key.device)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:groups]  # [G]; bincount syncs
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)
    pair_start = torch.cumsum(counts, 0) - counts
    num_blocks = -(-pairs // block_m) + min(pairs, groups)
    b = torch.arange(num_blocks, device=topk_ids.device)
    group = torch.searchsorted(block_end, b, right=True)  # [B]
    valid = group < groups
    group = group.clamp(max=groups - 1)
    row = (b - (block_end[group] - blocks[group])) * block_m  # first row of the block in its group
    offsets = row[:, None] + torch.arange(block_m, device=b.device)  # [B, BLOCK_M]
    ok = valid[:, None] & (offsets < counts[group][:, None])
    index = (pair_start[group][:, None] + offsets).clamp(max=pairs - 1)
    block_pairs = torch.where(ok, order[index], -1).to(torch.int32)
    block_key = torch.where(valid, group, -1).to(torch.int32)
    return block_pairs, block_key


def _bias_kind(fmt: BlobFormat) -> tuple[int, int, int]:
    if not has_tensor(fmt, "gate_up_bias"):
        return 0, 0, 0
    gu, down = fmt.tensor("gate_up_bias"), fmt.tensor("down_bias")
    return _BIAS_KINDS[gu.dtype], gu.offset, down.offset


_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def moe_slots_triton(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    slot_table: torch.Tensor,
    pool: torch.Tensor,
    fmt: BlobFormat,
    act: ExpertActivation,
    out: torch.Tensor,
    delta_mask: torch.Tensor | None = None,
    delta_table: torch.Tensor | None = None,
    delta_fmt: BlobFormat | None = None,
    slot_offsets: torch.Tensor | None = None,
    choice: tuple[KernelChoice, KernelChoice] | None = None,
) -> None:
    """Same contract as `moe_ref.moe_slots_ref`, plus:

    slot_offsets: [S] int64, byte offset of each slot from pool's first byte (default: slot s at
                  s * pool.stride(0)); slots outside `pool` (pinned host memory) are allowed
    choice:       (gate_up, down) kernel configs; default `moe_dispatch.choose`
    """
    tokens, top_k = topk_ids.shape
    if hidden.dim() != 2 or hidden.shape[0] != tokens or topk_weights.shape != topk_ids.shape:
        raise ValueError(
            f"bad shapes: hidden {tuple(hidden.shape)}, ids {tuple(topk_ids.shape)}, "
            f"weights {tuple(topk_weights.shape)}"
        )
    if out.shape != (tokens, top_k, hidden.shape[1]) or out.dtype != torch.float32:
        raise ValueError(f"out must be float32 [T, k, H], got {tuple(out.shape)} {out.dtype}")
    if not out.is_contiguous() or pool.dtype != torch.uint8:
        raise ValueError("out must be contiguous and pool uint8")
    if delta_fmt is not None and delta_mask is not None and not supports(fmt, delta_fmt):
        raise ValueError(f"no kernel for base {fmt.name} with delta {delta_fmt.name}")
    gu, dn = matrix_spec(fmt, "gate_up"), matrix_spec(fmt, "down")
    if gu is None or dn is None:
        raise ValueError(f"no kernel for expert format {fmt.name}")
    use_delta = delta_fmt is not None and delta_mask is not None and delta_table is not None
    dgu = matrix_spec(delta_fmt, "gate_up") if use_delta else None
    ddn = matrix_spec(delta_fmt, "down") if use_delta else None
    if slot_offsets is None:
        slot_offsets = torch.arange(pool.shape[0], device=pool.device, dtype=torch.int64)
        slot_offsets *= pool.stride(0)
    pairs = tokens * top_k
    inter = gu.n // 2
    if choice is None:
        experts = slot_table.shape[0]
        choice = choose_pair(pairs, experts, (gu.n, gu.k), (dn.n, dn.k))
    c_gu, c_dn = choice
    if c_gu.grouped != c_dn.grouped or (c_gu.grouped and c_gu.block_m != c_dn.block_m):
        raise ValueError("gate_up and down must use the same pair grouping (mode and BLOCK_M)")
    topk_ids = topk_ids.contiguous()
    topk_w = topk_weights.contiguous()
    mask = delta_mask.contiguous().to(torch.uint8) if use_delta and delta_mask is not None else None
    grouped = c_gu.grouped
    block_pairs = block_key = topk_ids  # unused placeholders in the ungrouped mode
    if grouped:
        delta_on = None
        if use_delta and mask is not None and delta_table is not None:
            delta_on = mask.bool() & (delta_table.long()[topk_ids.long()] >= 0)
        block_pairs, block_key = _group_pairs(
            topk_ids, delta_on, slot_table, slot_table.shape[0], c_gu.block_m
        )
        blocks = block_key.shape[0]
    else:
        blocks = pairs
    part = torch.empty(c_gu.split_k, pairs, 2 * inter, device=hidden.device, dtype=torch.float32)
    bias, in_bias, out_bias = _bias_kind(fmt)
    dot_dtype = _DOT_DTYPES[hidden.dtype]
    dtable = delta_table if use_delta and delta_table is not None else slot_table
    dmask = mask if mask is not None else topk_ids  # read only when the op has a delta
    for is_down, spec, dspec, c, dst in (
        (0, gu, dgu, c_gu, part),
        (1, dn, ddn, c_dn, out),
    ):
        if spec.kind == Q2S and not c.use_dot:  # the q2s GEMV tile holds whole groups
            c = replace(c, block_k=max(c.block_k, spec.group))
        grid = (blocks, triton.cdiv(spec.n, c.block_n), 1 if is_down else c.split_k)
        _moe_kernel[grid](
            hidden, hidden.stride(0), hidden.stride(1), topk_ids, topk_w, dmask, block_pairs,
            block_key, pairs,
            pool, slot_table, slot_offsets, dtable,
            part, dst, spec.n, spec.k, part.stride(0), spec.k // 4, spec.k // spec.group,
            spec.kind, spec.codes, spec.scales, spec.row_scale, spec.aux, spec.tensor_scale,
            spec.group,
            dspec.kind if dspec else NONE, dspec.codes if dspec else 0,
            dspec.scales if dspec else 0, dspec.row_scale if dspec else 0,
            dspec.aux if dspec else 0, dspec.tensor_scale if dspec else 0,
            dspec.group if dspec else 1,
            bias, in_bias, out_bias, ACTIVATIONS[act.kind], act.limit, act.alpha,
            is_down, c_gu.split_k, top_k,
            grouped, c.use_dot, dot_dtype, "ieee" if hidden.dtype == torch.float32 else "tf32",
            c.block_m if grouped else 1, c.block_n, c.block_k,
            num_warps=c.num_warps, num_stages=c.num_stages,
        )  # fmt: skip
