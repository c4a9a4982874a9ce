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

q2s decode (below `Q2S_GEMV_MAX_PAIRS` pairs) has its own GEMV kernel, `_q2s_gemv_kernel` (or,
per launch where a config sets `gluon`, its Gluon counterpart in `q2s_gluon.py`): int32 words of
16 codes, four row sub-tiles sharing each load of x, gate_up applying the activation itself
(gate and up rows of the same outputs in one program), so it writes h [P, I] and no split-K
partials. By default (`KernelChoice.int8_act`) its activations are rounded to int8 per 16 columns
(`_quant_words_kernel`; gate_up rounds h itself) and each word's products are integer (IDP4A; an
NVFP4 delta through PRMT + IDP4A): the twin is `moe_slots_ref(..., act_int8=True)`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moetier.config import ExpertActivation
from moetier.core.layout import BlobFormat, format_kind, has_tensor, matrix_codecs
from moetier.kernels.moe_dispatch import (
    Q2S_GEMV_MAX_PAIRS,
    KernelChoice,
    choose_pair,
    choose_q2s_gemv,
    choose_q2s_mma,
)

# Kinds of a matrix inside a blob (constexpr in the kernels).
NONE, RAW_F32, RAW_BF16, RAW_F16, Q2S, NVFP4, MXFP4, NESTED, NESTED_DELTA = range(-1, 8)
_RAW_KINDS = {"float32": RAW_F32, "bfloat16": RAW_BF16, "float16": RAW_F16}
_BIAS_KINDS = {"float32": 1, "bfloat16": 2, "float16": 3}
ACTIVATIONS = {"silu": 0, "silu_clamped": 1, "gpt_oss": 2}
Q2S_ONE = 0x3F800000  # bits of 1.0f (see _q2s_level)


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
def _q2s_level(word, J: tl.constexpr, one):
    """1 + c/4 (float32) for code J of each int32 word (code J at bits 2J..2J+1): the code is
    shifted into the top mantissa bits of 1.0 (`one` holds its bits; a runtime value, so the
    mask-or compiles to one LOP3 instead of two)."""
    if J <= 10:
        t = word << (21 - 2 * J)
    else:
        t = word >> (2 * J - 21)
    return ((t & (3 << 21)) | one).to(tl.float32, bitcast=True)


@triton.jit
def _q2s_outer(word, J: tl.constexpr):
    """[c = 3] - [c = 0] for code J: the part of a level not linear in c when b != 3a."""
    c = (word >> (2 * J)) & 3
    return (c == 3).to(tl.float32) - (c == 0).to(tl.float32)


@triton.jit
def _dp4a(a, b, c, ASM: tl.constexpr):
    """c + Σ_j a.u8[j] · b.s8[j] per int32 lane (one IDP4A; plain integer ops under the
    interpreter, which has no inline assembly)."""
    if ASM:
        y = tl.inline_asm_elementwise(
            "dp4a.u32.s32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, c],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        y = c
        for j in tl.static_range(4):
            y += ((a >> (8 * j)) & 0xFF) * ((b << (24 - 8 * j)) >> 24)
    return y


@triton.jit
def _prmt(a, b, sel, ASM: tl.constexpr):
    """PRMT: byte i of the result is byte (nibble i of sel) & 7 of the 8 bytes (a, then b), or
    that byte's sign replicated (0x00 / 0xFF) when the nibble's bit 3 is set (plain integer ops
    under the interpreter)."""
    if ASM:
        y = tl.inline_asm_elementwise(
            "prmt.b32 $0, $1, $2, $3;", "=r,r,r,r", [a, b, sel],
            dtype=tl.int32, is_pure=True, pack=1,
        )  # fmt: skip
    else:
        y = tl.zeros(sel.shape, tl.int32)
        for i in tl.static_range(4):
            nib = (sel >> (4 * i)) & 0xF
            idx = nib & 7
            byte = tl.where(idx < 4, (a >> (8 * (idx & 3))) & 0xFF, (b >> (8 * (idx & 3))) & 0xFF)
            byte = tl.where(nib >= 8, tl.where(byte >= 128, 0xFF, 0), byte)
            y = y | (byte << (8 * i))
    return y


@triton.jit
def _fp4_word_dot(d_lo, d_hi, x0, x1, x2, x3, ASM: tl.constexpr):
    """Σ 2·e2m1(code)·q over one 16-column word, per int32 lane: d_lo / d_hi hold the E2M1 codes
    of columns 0-7 / 8-15 (nibble i = column i, bit 3 the sign), xj the int8 q of columns
    4j..4j+3 in column order. PRMT turns 4 codes into the bytes 2|e2m1| = (0 1 2 3 4 6 8 12) of
    the positive codes (0 for negative ones; flipping the sign bits gives the negative codes'),
    so each 4 columns take two PRMT and two IDP4A."""
    t_lo = tl.full(d_lo.shape, 0x03020100, tl.int32)
    t_hi = tl.full(d_lo.shape, 0x0C080604, tl.int32)
    p = tl.zeros(d_lo.shape, tl.int32)
    n = tl.zeros(d_lo.shape, tl.int32)
    for j in tl.static_range(4):
        if j == 0:
            sel = d_lo
            x = x0
        elif j == 1:
            sel = d_lo >> 16
            x = x1
        elif j == 2:
            sel = d_hi
            x = x2
        else:
            sel = d_hi >> 16
            x = x3
        xb = tl.broadcast_to(x, d_lo.shape)
        p = _dp4a(_prmt(t_lo, t_hi, sel, ASM), xb, p, ASM)
        n = _dp4a(_prmt(t_lo, t_hi, sel ^ 0x8888, ASM), xb, n, ASM)
    return p - n


@triton.jit
def _fp4_delta_load(dptr, d_codes, d_scales, rows, rmask, wd, wmask, row_words,
                    EVEN: tl.constexpr):  # fmt: skip
    """Words wd of an NVFP4 delta's rows `rows`: (codes [SUB, W] int64, one word's 16 codes
    each, loaded in the base words' [SUB, W] layout and split in registers by
    `_fp4_delta_dot`: a [SUB, 2W] int32 load split by a reshape made Triton move it through
    shared memory every K step; block scale bytes [SUB, W])."""
    dwords = (dptr + d_codes).to(tl.pointer_type(tl.int64)) + rows[:, None] * row_words
    dsc_at = dptr + d_scales + rows[:, None] * row_words + wd[None, :]
    if EVEN:
        return tl.load(dwords + wd[None, :]), tl.load(dsc_at)
    m = rmask[:, None] & wmask[None, :]
    return tl.load(dwords + wd[None, :], mask=m, other=0), tl.load(dsc_at, mask=m, other=0)


@triton.jit
def _fp4_delta_dot(d, dsc, xn0, xn1, xn2, xn3, xsc, ASM: tl.constexpr):
    """One K tile of an NVFP4 delta (`_fp4_delta_load`'s d, dsc) times int8 activations (xn:
    column order): [SUB, W] per-word partial sums (2·Σ e2m1·q times block and activation
    scales; the tensor scale comes after the loop)."""
    d_lo = d.to(tl.int32)  # columns 0-7 of the word
    d_hi = (d >> 32).to(tl.int32)  # columns 8-15
    dot = _fp4_word_dot(d_lo, d_hi, xn0, xn1, xn2, xn3, ASM)
    return dot.to(tl.float32) * (_e4m3(dsc) * xsc)


@triton.jit
def _fp4_delta_x(xqn_row, wd, wmask, row_words, EVEN: tl.constexpr):
    """Words wd of a row's int8 activations in column order (the four planes, [1, W] each)."""
    xw = xqn_row + wd
    if EVEN:
        xn0 = tl.load(xw)[None, :]
        xn1 = tl.load(xw + row_words)[None, :]
        xn2 = tl.load(xw + 2 * row_words)[None, :]
        xn3 = tl.load(xw + 3 * row_words)[None, :]
    else:
        xn0 = tl.load(xw, mask=wmask, other=0)[None, :]
        xn1 = tl.load(xw + row_words, mask=wmask, other=0)[None, :]
        xn2 = tl.load(xw + 2 * row_words, mask=wmask, other=0)[None, :]
        xn3 = tl.load(xw + 3 * row_words, mask=wmask, other=0)[None, :]
    return xn0, xn1, xn2, xn3


@triton.jit
def _fp4_delta_loads4(dptr, d_codes, d_scales, rows0, rows1, rows2, rows3, m0, m1, m2, m3, wd,
                      wmask, row_words, EVEN: tl.constexpr):  # fmt: skip
    """Words wd of the four sub-tiles' delta rows (`_fp4_delta_load` each): 8 tensors."""
    d0, s0 = _fp4_delta_load(dptr, d_codes, d_scales, rows0, m0, wd, wmask, row_words, EVEN)
    d1, s1 = _fp4_delta_load(dptr, d_codes, d_scales, rows1, m1, wd, wmask, row_words, EVEN)
    d2, s2 = _fp4_delta_load(dptr, d_codes, d_scales, rows2, m2, wd, wmask, row_words, EVEN)
    d3, s3 = _fp4_delta_load(dptr, d_codes, d_scales, rows3, m3, wd, wmask, row_words, EVEN)
    return d0, s0, d1, s1, d2, s2, d3, s3


@triton.jit
def _fp4_delta_tile(dptr, d_codes, d_scales, rows0, rows1, rows2, rows3, m0, m1, m2, m3, wd,
                    wmask, row_words, xqn_row, xsc, EVEN: tl.constexpr,
                    ASM: tl.constexpr):  # fmt: skip
    """One K tile of an NVFP4 delta for the four sub-tiles' rows, loaded and multiplied here,
    against the tile's int8 activations in column order (xqn, loaded once for the four)."""
    xn0, xn1, xn2, xn3 = _fp4_delta_x(xqn_row, wd, wmask, row_words, EVEN)
    d0, s0, d1, s1, d2, s2, d3, s3 = _fp4_delta_loads4(
        dptr, d_codes, d_scales, rows0, rows1, rows2, rows3, m0, m1, m2, m3, wd, wmask,
        row_words, EVEN)  # fmt: skip
    return (
        _fp4_delta_dot(d0, s0, xn0, xn1, xn2, xn3, xsc, ASM),
        _fp4_delta_dot(d1, s1, xn0, xn1, xn2, xn3, xsc, ASM),
        _fp4_delta_dot(d2, s2, xn0, xn1, xn2, xn3, xsc, ASM),
        _fp4_delta_dot(d3, s3, xn0, xn1, xn2, xn3, xsc, ASM),
    )


@triton.jit
def _q2s_word_dots(w, q0, q1, q2, q3, init, HIGH: tl.constexpr, ASM: tl.constexpr):
    """R = 64·Σ c·q + init per int32 word w of 16 codes, q the int8 activations of the word's 16
    columns packed as `_quant_words_kernel` writes them (int32 s holds the bytes of columns s,
    s + 4, s + 8, s + 12). Byte j of w holds the codes of columns 4j..4j+3, code s at bits 2s, so
    w & 0xC0C0C0C0 is 64·code 3 of each byte, (w << 4) & 0xC0C0C0C0 64·code 1, and the 0x30
    masks 16·codes 2 and 0: one shift, four LOP3, four IDP4A and one LEA per word (shifting
    each code down to bits 0-1 took three shifts). HIGH: RH = 128·Σ h·q + init instead, h the
    high bit of each code (the masks of bit 1 of each code: 0x80 of 128·h of codes 3 and 1,
    0x20 of 32·h of codes 2 and 0)."""
    if HIGH:
        m_hi = 0x80808080 - (1 << 32)
        m_lo = 0x20202020
    else:
        m_hi = 0xC0C0C0C0 - (1 << 32)
        m_lo = 0x30303030
    w4 = w << 4
    hi = _dp4a(w & m_hi, tl.broadcast_to(q3, w.shape), init, ASM)
    hi = _dp4a(w4 & m_hi, tl.broadcast_to(q1, w.shape), hi, ASM)
    lo = _dp4a(w & m_lo, tl.broadcast_to(q2, w.shape), 0, ASM)
    lo = _dp4a(w4 & m_lo, tl.broadcast_to(q0, w.shape), lo, ASM)
    return hi + (lo << 2)


@triton.jit
def _dequant_words(xq_row, xs_row, cols, K, mask):
    """Columns `cols` of one row of `_quant_words_kernel`'s output, as float32 (q · scale)."""
    packed = tl.load(xq_row + (cols % 4) * (K // 16) + cols // 16, mask=mask, other=0)
    q = (packed << (24 - 8 * ((cols % 16) // 4))) >> 24  # byte (col % 16) // 4, sign-extended
    return q.to(tl.float32) * tl.load(xs_row + cols // 16, mask=mask, other=0.0)


@triton.jit
def _quant_store(v, wd, KW, xq_row, xs_row, xsum_row, xqn_row, wmask):
    """Round v [NW, 16] (words wd [NW] of one row of KW words) to int8 per word and store it as
    `_quant_words_kernel` documents."""
    NW: tl.constexpr = v.shape[0]
    col = tl.arange(0, 16)
    amax = tl.max(tl.abs(v), axis=1)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    q = tl.floor(v * inv[:, None] + 0.5).to(tl.int32)
    qb = (q & 0xFF) << ((col[None, :] // 4) * 8)  # column 4j + s -> byte j of int32 s
    packed = tl.sum(tl.reshape(qb, (NW, 4, 4)), axis=1)  # [NW, 4 (s)]
    s_idx = tl.arange(0, 4)
    tl.store(xq_row + s_idx[None, :] * KW + wd[:, None], packed, mask=wmask[:, None])
    tl.store(xs_row + wd, amax / 127.0, mask=wmask)
    tl.store(xsum_row + wd, tl.sum(q, axis=1), mask=wmask)
    qn = (q & 0xFF) << ((col[None, :] % 4) * 8)  # column 4j + s -> byte s of int32 j
    natural = tl.sum(tl.reshape(qn, (NW, 4, 4)), axis=2)  # [NW, 4 (j)]
    tl.store(xqn_row + s_idx[None, :] * KW + wd[:, None], natural, mask=wmask[:, None])


@triton.jit
def _quant_words_kernel(x_ptr, stride_r, stride_k, xq, xs, xsum, xqn, K,
                        BLOCK_W: tl.constexpr, PDL: tl.constexpr = False,
                        WAIT: tl.constexpr = False):  # fmt: skip
    """x [R, K] float -> int8 per 16-column word with a float32 scale each (absmax / 127, round
    half up): xq int32 [R, 4, K/16], xs float32 [R, K/16], xsum int32 [R, K/16] = Σ q over the
    word (twin: moe_ref.quant_words_ref). xq's (row, s, w) holds the bytes of columns
    16w + s + 4j, j = 0..3, so the GEMV loads each s for consecutive words as one vector; xqn
    int32 [R, 4, K/16] holds the same bytes in column order: byte s of (row, j, w) is column
    16w + 4j + s (the FP4 delta's products), again one vector per j. PDL: lets the next launch
    (the GEMV, launched with programmatic dependent launch) start reading its weights now.
    WAIT (launched with programmatic dependent launch itself): first waits for the launch
    before (x may be its output; nothing is read or written before), and only then lets the
    next one start, so what the next reads before its own wait is as ready as without it."""
    if WAIT:
        gdc_wait()
    if PDL:
        gdc_launch_dependents()
    row = tl.program_id(0)
    wd = tl.program_id(1) * BLOCK_W + tl.arange(0, BLOCK_W)
    wmask = wd < K // 16
    col = tl.arange(0, 16)
    v = tl.load(x_ptr + row * stride_r + (wd[:, None] * 16 + col[None, :]) * stride_k,
                mask=wmask[:, None], other=0.0).to(tl.float32)  # fmt: skip
    _quant_store(v, wd, K // 16, xq + row * (K // 4), xs + row * (K // 16),
                 xsum + row * (K // 16), xqn + row * (K // 4), wmask)  # fmt: skip


@triton.jit
def _quant_tile(x_row, stride_k, wd, wmask):
    """Words wd [W] of one row of x rounded to int8 in registers, exactly as `_quant_store`
    rounds and packs them: (q0, q1, q2, q3) [1, W] int32 (the s-planes of `xq`: byte j of q_s is
    column 16w + 4j + s), the scales [1, W] float32 and Σq [1, W] int32."""
    W: tl.constexpr = wd.shape[0]
    col = tl.arange(0, 16)
    v = tl.load(x_row + (wd[:, None] * 16 + col[None, :]) * stride_k, mask=wmask[:, None],
                other=0.0).to(tl.float32)  # fmt: skip
    amax = tl.max(tl.abs(v), axis=1)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    q = tl.floor(v * inv[:, None] + 0.5).to(tl.int32)
    qb = (q & 0xFF) << ((col[None, :] // 4) * 8)  # column 4j + s -> byte j of int32 s
    packed = tl.sum(tl.reshape(qb, (W, 4, 4)), axis=1)  # [W, 4 (s)]
    even, odd = tl.split(tl.reshape(packed, (W, 2, 2)))  # s = 0, 2 and s = 1, 3
    q0, q2 = tl.split(even)
    q1, q3 = tl.split(odd)
    return (q0[None, :], q1[None, :], q2[None, :], q3[None, :], (amax / 127.0)[None, :],
            tl.sum(q, axis=1)[None, :])  # fmt: skip


@triton.jit
def _q2s_words(wbase, rows, rmask, wd, wmask, row_words, EVEN: tl.constexpr):
    """Words wd of rows `rows`: [SUB, W] int32 (EVEN: whole tiles, no mask)."""
    at = wbase + rows[:, None] * row_words + wd[None, :]
    if EVEN:
        return tl.load(at)
    return tl.load(at, mask=rmask[:, None] & wmask[None, :], other=0)


@triton.jit
def _x_words(xq_row, xs_row, xsum_row, row_words, wd, wmask, EVEN: tl.constexpr):
    """Words wd of one row of `_quant_words_kernel`'s output: the four s-planes of int8 bytes,
    the scales and Σq, each [1, W] (EVEN: no masks)."""
    if EVEN:
        q0 = tl.load(xq_row + wd)[None, :]
        q1 = tl.load(xq_row + row_words + wd)[None, :]
        q2 = tl.load(xq_row + 2 * row_words + wd)[None, :]
        q3 = tl.load(xq_row + 3 * row_words + wd)[None, :]
        xsc = tl.load(xs_row + wd)[None, :]
        qs = tl.load(xsum_row + wd)[None, :]
    else:
        q0 = tl.load(xq_row + wd, mask=wmask, other=0)[None, :]
        q1 = tl.load(xq_row + row_words + wd, mask=wmask, other=0)[None, :]
        q2 = tl.load(xq_row + 2 * row_words + wd, mask=wmask, other=0)[None, :]
        q3 = tl.load(xq_row + 3 * row_words + wd, mask=wmask, other=0)[None, :]
        xsc = tl.load(xs_row + wd, mask=wmask, other=0.0)[None, :]
        qs = tl.load(xsum_row + wd, mask=wmask, other=0)[None, :]
    return q0, q1, q2, q3, xsc, qs


@triton.jit
def _q2s_group_scale(bptr, scales, rows, rmask, k0, row_groups, GROUP: tl.constexpr,
                     W: tl.constexpr, EVEN: tl.constexpr, PER_GROUP: tl.constexpr):  # fmt: skip
    """Group scales of the K tile starting at column k0, one per word: [SUB, W] float32. Loaded
    once per group ([SUB, W / words per group], contiguous) and repeated by joins, so the result
    keeps the words' register layout (a per-word byte gather made Triton shuffle every
    accumulator through shared memory)."""
    WPG: tl.constexpr = GROUP // 16
    NG: tl.constexpr = W // WPG
    gd = k0 // GROUP + tl.arange(0, NG)
    at = bptr + scales + rows[:, None] * row_groups + gd[None, :]
    if EVEN:
        sc = _e4m3(tl.load(at))
    else:
        sc = _e4m3(tl.load(at, mask=rmask[:, None] & (gd < row_groups)[None, :], other=0))
    if not PER_GROUP:  # [SUB, W], else [SUB, NG]
        if WPG >= 2:
            sc = tl.join(sc, sc)
        if WPG >= 4:
            sc = tl.join(sc, sc)
        if WPG >= 8:
            sc = tl.join(sc, sc)
        sc = tl.reshape(sc, (rows.shape[0], W))
    return sc


@triton.jit
def _q2s_words4(wbase, rows0, rows1, rows2, rows3, m0, m1, m2, m3, wd, wmask, row_words,
                EVEN: tl.constexpr):  # fmt: skip
    """Words wd of the four sub-tiles' rows (`_q2s_words` each)."""
    return (
        _q2s_words(wbase, rows0, m0, wd, wmask, row_words, EVEN),
        _q2s_words(wbase, rows1, m1, wd, wmask, row_words, EVEN),
        _q2s_words(wbase, rows2, m2, wd, wmask, row_words, EVEN),
        _q2s_words(wbase, rows3, m3, wd, wmask, row_words, EVEN),
    )


@triton.jit
def _q2s_group_scales4(bptr, scales, rows0, rows1, rows2, rows3, m0, m1, m2, m3, k0, row_groups,
                       GROUP: tl.constexpr, W: tl.constexpr, EVEN: tl.constexpr,
                       PER_GROUP: tl.constexpr):  # fmt: skip
    """The K tile's group scales of the four sub-tiles' rows (`_q2s_group_scale` each)."""
    return (
        _q2s_group_scale(bptr, scales, rows0, m0, k0, row_groups, GROUP, W, EVEN, PER_GROUP),
        _q2s_group_scale(bptr, scales, rows1, m1, k0, row_groups, GROUP, W, EVEN, PER_GROUP),
        _q2s_group_scale(bptr, scales, rows2, m2, k0, row_groups, GROUP, W, EVEN, PER_GROUP),
        _q2s_group_scale(bptr, scales, rows3, m3, k0, row_groups, GROUP, W, EVEN, PER_GROUP),
    )


@triton.jit
def _group_sum(t, WPG: tl.constexpr):
    """[SUB, W] -> [SUB, W / WPG]: sums of WPG consecutive words (one group each)."""
    return tl.sum(tl.reshape(t, (t.shape[0], t.shape[1] // WPG, WPG)), axis=2)


@triton.jit
def _delta_dot(dptr, DKIND: tl.constexpr, d_codes, d_scales, d_aux, rows, rmask, cols, kmask, K,
               DGROUP: tl.constexpr, x):  # fmt: skip
    """Σ_k D[n, k] x[k] over one K tile of an additive delta matrix, without its row factor."""
    dw = _decode(dptr, DKIND, d_codes, d_scales, d_aux, rows, cols, K, DGROUP,
                 rmask[:, None] & kmask[None, :])  # fmt: skip
    return tl.sum(dw * x, axis=1)


@triton.jit
def _tile_sums(s0, s1, s2, s3, w0, w1, w2, w3, sc0, sc1, sc2, sc3, q0, q1, q2, q3, xsc, qs,
               HIGH: tl.constexpr, GSUM: tl.constexpr, WPG: tl.constexpr,
               ASM: tl.constexpr):  # fmt: skip
    """The four sub-tiles' sums s0..s3 plus one K tile of words against one row's int8 x words
    (q0..q3, scales xsc, Σq qs), as `_q2s_gemv_kernel`'s K loop sums them: R (HIGH False) or,
    for a fitted grid, RH (HIGH True), times the x and group scales, per word or per group
    (GSUM)."""
    if HIGH:
        init = qs * -64
    else:
        init = qs * -96
    r0 = _q2s_word_dots(w0, q0, q1, q2, q3, init, HIGH, ASM).to(tl.float32)
    r1 = _q2s_word_dots(w1, q0, q1, q2, q3, init, HIGH, ASM).to(tl.float32)
    r2 = _q2s_word_dots(w2, q0, q1, q2, q3, init, HIGH, ASM).to(tl.float32)
    r3 = _q2s_word_dots(w3, q0, q1, q2, q3, init, HIGH, ASM).to(tl.float32)
    if GSUM:
        t0 = _group_sum(r0 * xsc, WPG) * sc0
        t1 = _group_sum(r1 * xsc, WPG) * sc1
        t2 = _group_sum(r2 * xsc, WPG) * sc2
        t3 = _group_sum(r3 * xsc, WPG) * sc3
    else:
        t0 = r0 * (sc0 * xsc)
        t1 = r1 * (sc1 * xsc)
        t2 = r2 * (sc2 * xsc)
        t3 = r3 * (sc3 * xsc)
    return s0 + t0, s1 + t1, s2 + t2, s3 + t3


@triton.jit
def _split_sum(scratch, counters, pair, pid_n, N, rows0, rows1, rows2, rows3, m0, m1, m2, m3,
               y0, y1, y2, y3, SPLIT: tl.constexpr):  # fmt: skip
    """The sums of a (pair, row tile) over its SPLIT K ranges, one program each: every program
    adds its partial rows into scratch [P, N] (float32, zero between calls), then counts itself
    in counters [P, row tiles]; the last to arrive reads the total back, and zeroes both for
    the next call. Returns the totals (only the last program's are meaningful) and whether
    this program is the last. Memory order: the adds are relaxed atomics (an acq_rel one costs
    a fence and an L1 flush each: H200, DeepSeek-V3 down at one token 17.7 -> 34.8 us); the
    barrier puts every thread's adds before the count, whose atomic (acq_rel, gpu scope, the
    kernel's one fence) releases them, cumulatively, to the last program's, which acquires
    them (the pattern of CUTLASS's split-K semaphore); its reads are relaxed atomics, served
    by L2."""
    at = scratch + pair * N
    tl.atomic_add(at + rows0, y0, mask=m0, sem="relaxed")
    tl.atomic_add(at + rows1, y1, mask=m1, sem="relaxed")
    tl.atomic_add(at + rows2, y2, mask=m2, sem="relaxed")
    tl.atomic_add(at + rows3, y3, mask=m3, sem="relaxed")
    tl.debug_barrier()
    count = counters + pair * tl.num_programs(1) + pid_n
    last = tl.atomic_add(count, 1) == SPLIT - 1
    zero = tl.zeros_like(y0)
    # the last program's lanes (tl.where: `mask & scalar` is no bool mask to Triton 3.9's
    # interpreter)
    l0, l1 = tl.where(last, m0, False), tl.where(last, m1, False)
    l2, l3 = tl.where(last, m2, False), tl.where(last, m3, False)
    t0 = tl.atomic_add(at + rows0, zero, mask=l0, sem="relaxed")
    t1 = tl.atomic_add(at + rows1, zero, mask=l1, sem="relaxed")
    t2 = tl.atomic_add(at + rows2, zero, mask=l2, sem="relaxed")
    t3 = tl.atomic_add(at + rows3, zero, mask=l3, sem="relaxed")
    tl.store(at + rows0, zero, mask=l0)
    tl.store(at + rows1, zero, mask=l1)
    tl.store(at + rows2, zero, mask=l2)
    tl.store(at + rows3, zero, mask=l3)
    if last:
        tl.store(count, 0)
    return t0, t1, t2, t3, last


@triton.jit
def _globaltimer():
    """The GPU's global nanosecond timer (sm_90 PTX; `TRACE` only)."""
    return tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64,
                                     is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _smid():
    """The SM this program runs on (`TRACE` only)."""
    return tl.inline_asm_elementwise("mov.u32 $0, %smid;", "=r", [], dtype=tl.int32,
                                     is_pure=False, pack=1)  # fmt: skip


@triton.jit
def _trace_store(trace, program, t_start, t_pre, t_post):
    """A program's stamps (`TRACE`): start, before and after its wait, now (its end) and its SM
    at trace[program] (the Gluon kernel's too)."""
    t_end = _globaltimer()
    at = trace + program * 8
    tl.store(at, t_start)
    tl.store(at + 1, t_pre)
    tl.store(at + 2, t_post)
    tl.store(at + 3, t_end)
    tl.store(at + 4, _smid().to(tl.int64))


@triton.jit
def _prefetch_l2(ptr, nbytes):
    """Ask for bytes [ptr, ptr + nbytes) in L2 (sm_90 `cp.async.bulk.prefetch.L2`, issued by the
    program's first thread; the range shrunk to whole 16-byte units, as the instruction wants).
    A hint: loads stay correct whatever it does, but each program's rows are requested at once
    instead of one K tile at a time."""
    start = (ptr.to(tl.int64) + 15) & -16
    size = (((ptr.to(tl.int64) + nbytes) & -16) - start).to(tl.int32)
    tl.inline_asm_elementwise(
        """{
        .reg .pred p;
        .reg .u32 t;
        mov.u32 t, %tid.x;
        setp.eq.u32 p, t, 0;
        setp.gt.and.s32 p, $2, 0, p;
        @p cp.async.bulk.prefetch.L2.global [$1], $2;
        mov.u32 $0, 0;
        }""",
        "=r,l,r", [start, size], dtype=tl.int32, is_pure=False, pack=1,
    )  # fmt: skip


@triton.jit
def _prefetch_rows(bptr, codes, scales, first, count, row_words, row_groups):
    """Ask L2 (`_prefetch_l2`) for rows [first, first + count) of the matrix whose words and
    group scale bytes start at byte offsets codes and scales of the blob at bptr: the rows'
    words, then their scale bytes (each a contiguous span)."""
    _prefetch_l2(bptr + codes + first * row_words * 4, count * row_words * 4)
    _prefetch_l2(bptr + scales + first * row_groups, count * row_groups)


@triton.jit
def _prefetch_share(pool, slot_offsets, slot, pool_bytes, lo, nbytes):
    """Ask L2 (`_prefetch_l2`) for this program's share of bytes [lo, lo + nbytes) of the blob
    in `slot`, when that blob is in the GPU pool: the range split in 256-byte multiples over
    the launch's programs of one pair (program ids 1 and 2)."""
    slot_off = tl.load(slot_offsets + slot)
    if (slot_off >= 0) & (slot_off < pool_bytes):
        count = tl.num_programs(1) * tl.num_programs(2)
        pid = tl.program_id(1) * tl.num_programs(2) + tl.program_id(2)
        share = (tl.cdiv(nbytes, count) + 255) // 256 * 256
        first = pid * share
        _prefetch_l2(pool + slot_off + lo + first, tl.minimum(share, nbytes - first))


@triton.jit
def _blob_ptrs(pool, slot_offsets, slot, dslot, use_delta, DKIND: tl.constexpr):
    """(base blob, delta blob) pointers of a slotted pair; the delta's is the base's when the
    pair does not use it. Slots start on TENSOR_ALIGN (256-byte) boundaries: say so, so loads
    vectorize."""
    bptr = pool + tl.multiple_of(tl.load(slot_offsets + slot), 256)
    dptr = bptr
    if DKIND >= 0:
        if use_delta:
            dptr = pool + tl.multiple_of(tl.load(slot_offsets + dslot), 256)
    return bptr, dptr


@triton.jit
def _q2s_gemv_kernel(
    x_ptr, stride_x, stride_xk, topk_ids, topk_w, delta_mask,
    pool, slot_table, slot_offsets, delta_table,
    out, N, K, INTER, row_words, row_groups, one,
    codes, scales, row_scale, aux, GROUP: tl.constexpr,
    DKIND: tl.constexpr, d_codes, d_scales, d_row_scale, d_aux, d_tensor_scale,
    DGROUP: tl.constexpr,
    BIAS: tl.constexpr, in_bias, out_bias, ACT: tl.constexpr, limit, alpha,
    IS_DOWN: tl.constexpr, TOPK: tl.constexpr, SUB: tl.constexpr, BLOCK_K: tl.constexpr,
    xq, xs, xsum, xqn, INT8: tl.constexpr, ASM: tl.constexpr,
    oq, osc, osum, oqn, QUANT_OUT: tl.constexpr, EVEN: tl.constexpr,
    GROUP_ACC: tl.constexpr, PREFETCH_L2: tl.constexpr, pool_bytes, PDL: tl.constexpr,
    QUANT_IN: tl.constexpr, DEPTH: tl.constexpr, PIPE: tl.constexpr, LOOP_STAGES: tl.constexpr,
    scratch, counters, SPLIT: tl.constexpr, PAIRS: tl.constexpr, PAIRS_P2: tl.constexpr,
    ROW_TILES: tl.constexpr, NEXT_L2: tl.constexpr, next_lo, next_bytes, UNROLL: tl.constexpr,
    DELTA_AHEAD: tl.constexpr, trace, TRACE: tl.constexpr, WAIT_FIRST: tl.constexpr = False,
):  # fmt: skip
    """q2s GEMV, one (pair, row tiles) per program, four row sub-tiles of SUB rows sharing every
    load of x and Σx. K walks int32 words of 16 codes; code j of all words of a sub-tile is one
    [SUB, W] tensor, its level 1 + c/4 built from bits (`_q2s_level`). The levels are linear in
    that when b = 3a: L = 8a(1 + c/4) - 11a, so per word Σ L x = 8a Σ (1 + c/4) x - 11a Σ x, and
    group scales multiply per word. A grid with b != 3a adds (b - 3a) Σ ([c=3] - [c=0]) x.

    gate_up (IS_DOWN=0): sub-tiles are gate rows r, r + SUB and the matching up rows r + INTER,
        r + SUB + INTER, so the activation is applied here: writes h[p, r] = act(gate, up).
    down    (IS_DOWN=1): x = h[p]; sub-tiles are 4 consecutive row blocks; writes
        out[p, n] = w_p · (W x + b).
    An additive delta (pairs whose mask is on) is decoded in the same K loop (`_decode`).

    INT8: x comes as int8 words (`_quant_words_kernel`: q, scale per 16 columns, Σq) and each
    word's dot products are integer (IDP4A). The levels (-b, -a, a, b) are linear in the code's
    two bits: L = β(2c - 3) + γ(2h - 1), h the high bit, β = (b - a)/2, γ = (3a - b)/2 (zero when
    b = 3a). Per word, `_q2s_word_dots` gives R = 32(2C - 3Σq) (C = Σ c·q, the -96Σq entering
    as the first IDP4A's addend) and, for a fitted grid, with HIGH, RH = 64(2H - Σq) (in a
    second pass over the words, after the K loop, so that the b = 3a loop holds no registers
    for it); each is converted once per word and row and multiplied by the group and
    activation scales: y = β/32 Σ R·s + γ/64 Σ RH·s.
    QUANT_OUT (gate_up, SUB 8 or a multiple of 16, INTER of 16): h is written as int8 words (oq,
    osc, osum: `_quant_store`) instead of float, so no launch rounds it for down (SUB 8: the two
    sub-tiles' rows are one word).
    EVEN: K a multiple of BLOCK_K and the rows a multiple of the program's, so no load is
    masked (the prefetch past the last K tile reloads that tile).
    GROUP_ACC (int8, groups of 2+ words; `KernelChoice.group_acc`): the sums are kept per group
    ([SUB, W / words per group]), a group's words multiplied by their x scales and added before
    its scale multiplies once: fewer FMUL and half the accumulator registers, so larger tiles
    fit (sm_90: 1.08 instructions per weight at 32 words and rows per thread, no spills).
    PREFETCH_L2 (sm_90; `KernelChoice.prefetch_l2`): each program whose blob is in the GPU pool
        (offset in [0, pool_bytes)) first asks for all of its rows' codes and scales in L2
        (`_prefetch_l2`): far more bytes in flight than the one-tile pipeline below (H200: a
        gain at DeepSeek-V4-Flash's 8-16 tokens, a loss at DeepSeek-V3's, so it is tuned per
        shape). Host rows are never prefetched: L2 prefetch of pinned host memory measured no
        gain.
    DEPTH (1 or 2; `KernelChoice.depth`): the words of K tile i + DEPTH are loaded before tile
        i is decoded, so DEPTH tiles of each program's weights are in flight while it computes
        (2: twice the bytes in flight per program, for the registers of one more tile).
    PIPE (`KernelChoice.pipe`; LOOP_STAGES = PIPE): no hand-made prefetch; each K tile's
        words, scales and activations are loaded in the loop, which is marked
        `tl.range(num_stages=PIPE)`, so Triton's pipeliner streams PIPE - 1 tiles ahead
        through shared memory with cp.async (registers do not hold the tiles in flight).
    LOOP_STAGES 2 with PIPE 0 (`KernelChoice.pipe_x`): the words keep the hand-made prefetch,
        and the pipeliner streams what the loop loads itself, the activations and group
        scales, one tile ahead through shared memory (their wait at the top of every K tile
        was the loop's longest stall in an H200 profile; held in registers a tile ahead they
        cost up to 40 registers, through shared memory -2 to +17).
    QUANT_IN (gate_up, int8, no delta plane; `KernelChoice.quant_in`): each program rounds its
        K tiles of x to int8 words itself (`_quant_tile`, the same rounding as
        `_quant_words_kernel`) instead of reading them: one launch fewer per call.
    SPLIT (1 or 2; `KernelChoice.split_k`): K is split in SPLIT ranges of whole tiles, one per
        program (program_id 2), for more programs and shorter chains of K tiles when few pairs
        would leave the GPU waiting; the partial sums meet in `_split_sum`, and the last
        program of a (pair, row tile) to arrive finishes the epilogue. Two ranges keep the
        results deterministic (a + b == b + a).
    PAIRS (1 or 2; `KernelChoice.pairs`; int8, no delta plane, no split, x rounded by a launch):
        with 2, a program serves two pairs of one expert, so the expert's rows are read once
        for both: of the pairs routed to an expert (in pair order), those of even rank lead
        and take the next one as their second (found in the call's topk_ids, PAIRS_P2 >= the
        pair count), those of odd rank leave their programs empty; a program without a second
        skips the second's work in the K loop (a branch it takes whole).
    PDL (sm_90; `KernelChoice.pdl`, launched with programmatic dependent launch): the program
        lets the next launch start (`gdc_launch_dependents`), then reads its weights' first tile
        and asks for the rest (PREFETCH_L2) before it waits for the previous launch
        (`gdc_wait`) and reads its activations: weight reads overlap the previous kernel.
    ROW_TILES (`KernelChoice.row_tiles`; no split): a program computes that many consecutive
        row tiles of its pair, one after another, so the chain of dependent loads that finds
        its blob (pair -> expert -> slot -> offset -> grid) is paid once for all of them.
    NEXT_L2 (gate_up on sm_90, blobs in the GPU pool; `KernelChoice.next_l2`): each program, when
        done, asks L2 for its share of its pair's down weights (bytes [next_lo, next_lo +
        next_bytes) of the blob, split evenly over the pair's programs), so that down's reads
        start while gate_up's last programs run and down's launch waits. (Asked for before the
        K loop instead, they measured 1.01-1.44x the time: they compete with gate_up's own.)
    UNROLL (`KernelChoice.unroll`): the K loop unrolled this many times (Triton's
        loop_unroll_factor), so the hand-made prefetch's tiles are renamed rather than moved.
    DELTA_AHEAD (NVFP4 delta, int8; `KernelChoice.delta_ahead`): the delta's codes, block
        scales and column-order activations of K tile i + 1 are loaded before tile i's are
        multiplied (as the base words are), in pairs whose mask is on; else each tile's are
        loaded where they are used.
    TRACE (sm_90, a study: `TRACE_BUFFERS`, bench/timeline.py): each program writes the global
        timer at its start, before and after its wait for the launch before, and at its end,
        and its SM, to trace[program]: where a chained call's time goes.
    WAIT_FIRST (with PDL; `KernelChoice.wait_first`, a call's first launch in the op's way):
        the program waits for the launch before first, then lets the next launch start, then
        reads the routing and everything else: the launch overlaps the kernel before's end
        (when that kernel lets it start early), its reads do not."""
    if TRACE:
        t_start = _globaltimer()
        t_pre = t_start
        t_post = t_start
    pair = tl.program_id(0)
    if PDL:
        if WAIT_FIRST:  # the routing may be the previous launch's output: wait, then let go
            gdc_wait()
        gdc_launch_dependents()
    pid_n0 = tl.program_id(1)
    expert = tl.load(topk_ids + pair).to(tl.int32)
    slot = tl.load(slot_table + expert)
    use_delta = pair < 0  # False
    dslot = slot
    if DKIND >= 0:
        dslot = tl.load(delta_table + expert)
        use_delta = (tl.load(delta_mask + pair) != 0) & (dslot >= 0)
    run = slot >= 0
    tl.static_assert(ROW_TILES == 1 or SPLIT == 1)
    if PAIRS == 2:  # the pair of the same expert after this one, if this one leads
        tl.static_assert(INT8 and DKIND < 0 and SPLIT == 1 and not QUANT_IN)
        idx = tl.arange(0, PAIRS_P2)
        ids = tl.load(topk_ids + idx, mask=idx < tl.num_programs(0), other=-1).to(tl.int32)
        same = ids == expert
        run = run & (tl.sum((same & (idx < pair)).to(tl.int32), axis=0) % 2 == 0)
        pair_b = tl.min(tl.where(same & (idx > pair), idx, PAIRS_P2), axis=0)
        has_b = pair_b < PAIRS_P2
        pair_b = tl.minimum(pair_b, tl.num_programs(0) - 1)  # an address to read: masked
    if run:
        bptr, dptr = _blob_ptrs(pool, slot_offsets, slot, dslot, use_delta, DKIND)
        wbase = (bptr + codes).to(tl.pointer_type(tl.int32))
        a = _f32_at(bptr, aux)
        b = _f32_at(bptr, aux + 4)
        # b - 3a, exactly 0 when b = 3a as float32 rounds it: `b - 3 * a` alone compiles to one
        # FFMA on the GPU (fp fusion), whose unrounded 3a left it nonzero for most grids with b
        # = fl(3a) (the interpreter rounds, so only the H200 showed it: the fitted path ran)
        corr = tl.where(b == 3 * a, 0.0, b - 3 * a)
        W: tl.constexpr = BLOCK_K // 16
        DELTA_K: tl.constexpr = 64 if BLOCK_K > 64 else BLOCK_K
        # NVFP4 delta with int8 activations: PRMT + IDP4A per word (`_fp4_delta_dot`)
        FP4_INT8: tl.constexpr = INT8 and DKIND == 4 and DGROUP == 16
        FP4_AHEAD: tl.constexpr = DELTA_AHEAD and FP4_INT8
        # GROUP_ACC (int8, groups of 2+ words): the int8 path's sums are kept per group, each
        # word's product with its x scale summed over the group before the group scale
        WPG: tl.constexpr = GROUP // 16
        GSUM: tl.constexpr = GROUP_ACC and INT8 and WPG >= 2
        AW: tl.constexpr = W // WPG if GSUM else W
        HW: tl.constexpr = SUB // 16  # words of h per sub-tile (QUANT_OUT, SUB % 16 == 0)
        # ROW_TILES: this program's row tiles one after another (the pair's slot and blob
        # looked up once); past the last one it does the last again (the same values)
        n_tiles = tl.cdiv(N if IS_DOWN else INTER, (4 if IS_DOWN else 2) * SUB)
        pair0 = pair  # (the epilogue of a second pair, PAIRS 2, sets pair to it)
        for rt in tl.static_range(ROW_TILES):
            pid_n = tl.minimum(pid_n0 * ROW_TILES + rt, n_tiles - 1)
            pair = pair0
            r = tl.arange(0, SUB)
            if IS_DOWN:
                rows0 = pid_n * 4 * SUB + r
                rows1 = rows0 + SUB
                rows2 = rows0 + 2 * SUB
                rows3 = rows0 + 3 * SUB
                m0, m1, m2, m3 = rows0 < N, rows1 < N, rows2 < N, rows3 < N
                x_row = x_ptr + pair * stride_x
                x_idx = pair
            else:
                rows0 = pid_n * 2 * SUB + r
                rows1 = rows0 + SUB
                rows2 = rows0 + INTER
                rows3 = rows1 + INTER
                m0, m1 = rows0 < INTER, rows1 < INTER
                m2, m3 = m0, m1
                x_row = x_ptr + (pair // TOPK) * stride_x
                x_idx = pair // TOPK
            # row_words (= K / 16) rather than K // 16: an argument, so its divisibility is known
            # and the per-word loads below vectorize
            xq_row = xq + x_idx * (4 * row_words)
            xqn_row = xqn + x_idx * (4 * row_words)
            xs_row = xs + x_idx * row_words
            xsum_row = xsum + x_idx * row_words
            if PAIRS == 2:
                xb_idx = pair_b if IS_DOWN else pair_b // TOPK
                xq_row_b = xq + xb_idx * (4 * row_words)
                xs_row_b = xs + xb_idx * row_words
                xsum_row_b = xsum + xb_idx * row_words
            dv0 = tl.zeros((SUB, W), tl.float32)
            dv1 = tl.zeros((SUB, W), tl.float32)
            dv2 = tl.zeros((SUB, W), tl.float32)
            dv3 = tl.zeros((SUB, W), tl.float32)
            acc0 = tl.zeros((SUB, AW), tl.float32)
            acc1 = tl.zeros((SUB, AW), tl.float32)
            acc2 = tl.zeros((SUB, AW), tl.float32)
            acc3 = tl.zeros((SUB, AW), tl.float32)
            # float path: Σx per word times the group scale (the -11a term); both paths: the
            # b != 3a term
            ax0 = tl.zeros((SUB, W), tl.float32)
            ax1 = tl.zeros((SUB, W), tl.float32)
            ax2 = tl.zeros((SUB, W), tl.float32)
            ax3 = tl.zeros((SUB, W), tl.float32)
            av0 = tl.zeros((SUB, AW), tl.float32)
            av1 = tl.zeros((SUB, AW), tl.float32)
            av2 = tl.zeros((SUB, AW), tl.float32)
            av3 = tl.zeros((SUB, AW), tl.float32)
            if PAIRS == 2:  # the second pair's sums
                accb0 = tl.zeros((SUB, AW), tl.float32)
                accb1 = tl.zeros((SUB, AW), tl.float32)
                accb2 = tl.zeros((SUB, AW), tl.float32)
                accb3 = tl.zeros((SUB, AW), tl.float32)
                avb0 = tl.zeros((SUB, AW), tl.float32)
                avb1 = tl.zeros((SUB, AW), tl.float32)
                avb2 = tl.zeros((SUB, AW), tl.float32)
                avb3 = tl.zeros((SUB, AW), tl.float32)
            d0 = tl.zeros((SUB,), tl.float32)
            d1 = tl.zeros((SUB,), tl.float32)
            d2 = tl.zeros((SUB,), tl.float32)
            d3 = tl.zeros((SUB,), tl.float32)
            # the words of K tile i + 1 are loaded before tile i is decoded (a hand-made pipeline:
            # each program holds few tiles, so load latency would otherwise stall every one)
            k_lo = 0
            k_hi = K
            wd = tl.arange(0, W)
            if SPLIT > 1:  # this program's range of whole K tiles
                per = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT) * BLOCK_K
                k_lo = tl.program_id(2) * per
                k_hi = tl.minimum(K, k_lo + per)
                wd = tl.multiple_of(k_lo // 16, W) + tl.arange(0, W)
            wmask = wd < row_words
            if PIPE > 0:  # loaded in the loop
                w0 = tl.zeros((SUB, W), tl.int32)
                w1, w2, w3 = w0, w0, w0
            else:
                w0, w1, w2, w3 = _q2s_words4(wbase, rows0, rows1, rows2, rows3, m0, m1, m2, m3,
                                             wd, wmask, row_words, EVEN)  # fmt: skip
            # DEPTH 2: tile 1 too (v: the tile after w); EVEN: K >= BLOCK_K, and a one-tile K
            # reloads tile 0 (from L1) rather than masking
            v0, v1, v2, v3 = w0, w1, w2, w3
            if (DEPTH == 2) and (PIPE == 0):
                wd1 = wd + W
                if EVEN:
                    wd1 = tl.multiple_of(tl.minimum(k_lo + BLOCK_K, k_hi - BLOCK_K) // 16,
                                         W) + tl.arange(0, W)  # fmt: skip
                wmask1 = wd1 < row_words
                v0, v1, v2, v3 = _q2s_words4(wbase, rows0, rows1, rows2, rows3, m0, m1, m2, m3,
                                             wd1, wmask1, row_words, EVEN)  # fmt: skip
            # DELTA_AHEAD: the delta's first tile, asked for with the base words' (the
            # activations' after the wait below: the launch before may write them)
            da0 = tl.zeros((SUB, W), tl.int64)
            da1, da2, da3 = da0, da0, da0
            sa0 = tl.zeros((SUB, W), tl.uint8)
            sa1, sa2, sa3 = sa0, sa0, sa0
            xa0 = tl.zeros((1, W), tl.int32)
            xa1, xa2, xa3 = xa0, xa0, xa0
            if FP4_AHEAD:
                if use_delta:
                    da0, sa0, da1, sa1, da2, sa2, da3, sa3 = _fp4_delta_loads4(
                        dptr, d_codes, d_scales, rows0, rows1, rows2, rows3, m0, m1, m2, m3, wd,
                        wmask, row_words, EVEN)  # fmt: skip
            if PREFETCH_L2:
                slot_off = tl.load(slot_offsets + slot)
                if (slot_off >= 0) & (slot_off < pool_bytes):
                    if IS_DOWN:
                        first = pid_n * 4 * SUB
                        count = tl.minimum(4 * SUB, N - first)
                        _prefetch_rows(bptr, codes, scales, first, count, row_words, row_groups)
                    else:  # the gate rows, then the matching up rows
                        first = pid_n * 2 * SUB
                        count = tl.minimum(2 * SUB, INTER - first)
                        _prefetch_rows(bptr, codes, scales, first, count, row_words, row_groups)
                        _prefetch_rows(bptr, codes, scales, first + INTER, count, row_words,
                                       row_groups)  # fmt: skip
            # what the epilogue multiplies by, loaded now: loaded after the K loop, its latency
            # ended every program (H200: 1.00-1.07x the time a call, docs/benchmarks.md)
            rf0 = _row_factor(bptr, 3, row_scale, 0, rows0, m0)
            rf1 = _row_factor(bptr, 3, row_scale, 0, rows1, m1)
            rf2 = _row_factor(bptr, 3, row_scale, 0, rows2, m2)
            rf3 = _row_factor(bptr, 3, row_scale, 0, rows3, m3)
            if IS_DOWN:
                weight0 = tl.load(topk_w + pair).to(tl.float32)
            if TRACE:
                t_pre = _globaltimer()
            if PDL and not WAIT_FIRST:  # the activations are the previous launch's output
                gdc_wait()
            if TRACE:
                t_post = _globaltimer()
            if FP4_AHEAD:
                if use_delta:
                    xa0, xa1, xa2, xa3 = _fp4_delta_x(xqn_row, wd, wmask, row_words, EVEN)
            for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=LOOP_STAGES,
                               loop_unroll_factor=UNROLL):  # fmt: skip
                if PIPE > 0:  # this tile's words, here (the pipeliner loads them stages ahead)
                    wd = tl.multiple_of(k0 // 16, W) + tl.arange(0, W)
                    wmask = wd < row_words
                    w0, w1, w2, w3 = _q2s_words4(wbase, rows0, rows1, rows2, rows3, m0, m1, m2, m3,
                                                 wd, wmask, row_words, EVEN)  # fmt: skip
                wd_next = wd + W
                wmask_next = wd_next < row_words
                if PIPE > 0:
                    n0, n1, n2, n3 = w0, w1, w2, w3
                else:
                    pref = wd + DEPTH * W  # the tile DEPTH ahead
                    pmask = pref < row_words
                    if EVEN:  # the last tiles' prefetches reload the last tile (from L1): no masks
                        kw_next = tl.minimum(k0 + DEPTH * BLOCK_K, k_hi - BLOCK_K) // 16
                        pref = tl.multiple_of(kw_next, W) + tl.arange(0, W)
                    n0, n1, n2, n3 = _q2s_words4(wbase, rows0, rows1, rows2, rows3, m0, m1, m2, m3,
                                                 pref, pmask, row_words, EVEN)  # fmt: skip
                sc0, sc1, sc2, sc3 = _q2s_group_scales4(bptr, scales, rows0, rows1, rows2, rows3,
                                                        m0, m1, m2, m3, k0, row_groups, GROUP, W,
                                                        EVEN, GSUM)  # fmt: skip
                if INT8:
                    if PAIRS == 2:  # the same words against the second pair's activations
                        if has_b:  # (a branch the whole program takes or skips: no second, no cost)
                            qb0, qb1, qb2, qb3, xscb, qsb = _x_words(xq_row_b, xs_row_b, xsum_row_b,
                                                                     row_words, wd, wmask,
                                                                     EVEN)  # fmt: skip
                            accb0, accb1, accb2, accb3 = _tile_sums(
                                accb0, accb1, accb2, accb3, w0, w1, w2, w3, sc0, sc1, sc2, sc3, qb0,
                                qb1, qb2, qb3, xscb, qsb, False, GSUM, WPG, ASM)  # fmt: skip
                    if QUANT_IN:  # this tile's activations rounded here, as `_quant_store` does
                        q0, q1, q2, q3, xsc, qs = _quant_tile(x_row, stride_xk, wd, wmask)
                    else:
                        q0, q1, q2, q3, xsc, qs = _x_words(xq_row, xs_row, xsum_row, row_words, wd,
                                                           wmask, EVEN)  # fmt: skip
                    init = qs * -96  # R = 64C - 96Σq = 32(2C - 3Σq)
                    r0 = _q2s_word_dots(w0, q0, q1, q2, q3, init, False, ASM)
                    r1 = _q2s_word_dots(w1, q0, q1, q2, q3, init, False, ASM)
                    r2 = _q2s_word_dots(w2, q0, q1, q2, q3, init, False, ASM)
                    r3 = _q2s_word_dots(w3, q0, q1, q2, q3, init, False, ASM)
                    if GSUM:
                        acc0 += _group_sum(r0.to(tl.float32) * xsc, WPG) * sc0
                        acc1 += _group_sum(r1.to(tl.float32) * xsc, WPG) * sc1
                        acc2 += _group_sum(r2.to(tl.float32) * xsc, WPG) * sc2
                        acc3 += _group_sum(r3.to(tl.float32) * xsc, WPG) * sc3
                    else:
                        sc0 = sc0 * xsc
                        sc1 = sc1 * xsc
                        sc2 = sc2 * xsc
                        sc3 = sc3 * xsc
                        acc0 += r0.to(tl.float32) * sc0
                        acc1 += r1.to(tl.float32) * sc1
                        acc2 += r2.to(tl.float32) * sc2
                        acc3 += r3.to(tl.float32) * sc3
                else:
                    s0 = tl.zeros((SUB, W), tl.float32)
                    s1 = tl.zeros((SUB, W), tl.float32)
                    s2 = tl.zeros((SUB, W), tl.float32)
                    s3 = tl.zeros((SUB, W), tl.float32)
                    o0 = tl.zeros((SUB, W), tl.float32)
                    o1 = tl.zeros((SUB, W), tl.float32)
                    o2 = tl.zeros((SUB, W), tl.float32)
                    o3 = tl.zeros((SUB, W), tl.float32)
                    sx = tl.zeros((1, W), tl.float32)
                    for j in tl.static_range(16):
                        xj = tl.load(x_row + (wd[None, :] * 16 + j) * stride_xk,
                                     mask=wmask[None, :], other=0.0).to(tl.float32)  # fmt: skip
                        sx += xj
                        s0 += _q2s_level(w0, j, one) * xj
                        s1 += _q2s_level(w1, j, one) * xj
                        s2 += _q2s_level(w2, j, one) * xj
                        s3 += _q2s_level(w3, j, one) * xj
                        if corr != 0:
                            o0 += _q2s_outer(w0, j) * xj
                            o1 += _q2s_outer(w1, j) * xj
                            o2 += _q2s_outer(w2, j) * xj
                            o3 += _q2s_outer(w3, j) * xj
                    acc0 += s0 * sc0
                    acc1 += s1 * sc1
                    acc2 += s2 * sc2
                    acc3 += s3 * sc3
                    ax0 += sx * sc0
                    ax1 += sx * sc1
                    ax2 += sx * sc2
                    ax3 += sx * sc3
                    if corr != 0:
                        av0 += o0 * sc0
                        av1 += o1 * sc1
                        av2 += o2 * sc2
                        av3 += o3 * sc3
                if FP4_AHEAD:
                    if use_delta:  # the next tile's delta asked for, then this one's used
                        nwd, nwmask = wd_next, wmask_next  # (past the last tile: all masked)
                        if EVEN:  # the last tile's look-ahead reloads it (no masks)
                            nwd = tl.multiple_of(tl.minimum(k0 + BLOCK_K, k_hi - BLOCK_K) // 16,
                                                 W) + tl.arange(0, W)  # fmt: skip
                        nd0, ns0, nd1, ns1, nd2, ns2, nd3, ns3 = _fp4_delta_loads4(
                            dptr, d_codes, d_scales, rows0, rows1, rows2, rows3, m0, m1, m2, m3,
                            nwd, nwmask, row_words, EVEN)  # fmt: skip
                        nx0, nx1, nx2, nx3 = _fp4_delta_x(xqn_row, nwd, nwmask, row_words, EVEN)
                        dv0 += _fp4_delta_dot(da0, sa0, xa0, xa1, xa2, xa3, xsc, ASM)
                        dv1 += _fp4_delta_dot(da1, sa1, xa0, xa1, xa2, xa3, xsc, ASM)
                        dv2 += _fp4_delta_dot(da2, sa2, xa0, xa1, xa2, xa3, xsc, ASM)
                        dv3 += _fp4_delta_dot(da3, sa3, xa0, xa1, xa2, xa3, xsc, ASM)
                        da0, sa0, da1, sa1 = nd0, ns0, nd1, ns1
                        da2, sa2, da3, sa3 = nd2, ns2, nd3, ns3
                        xa0, xa1, xa2, xa3 = nx0, nx1, nx2, nx3
                elif DKIND >= 0:
                    if use_delta and FP4_INT8:  # NVFP4 delta, integer products per word
                        t0, t1, t2, t3 = _fp4_delta_tile(
                            dptr, d_codes, d_scales, rows0, rows1, rows2, rows3, m0, m1, m2, m3,
                            wd, wmask, row_words, xqn_row, xsc, EVEN, ASM)  # fmt: skip
                        dv0 += t0
                        dv1 += t1
                        dv2 += t2
                        dv3 += t3
                    elif use_delta:  # additive delta, its own product (natural-order x), decoded
                        # DELTA_K columns at a time (a whole BLOCK_K tile of float weights spills)
                        for kk in range(0, BLOCK_K, DELTA_K):
                            cols = k0 + kk + tl.arange(0, DELTA_K)
                            kmask = cols < K
                            if INT8:  # the same rounded activations as the base plane
                                xn = _dequant_words(xq_row, xs_row, cols, K, kmask)[None, :]
                            else:
                                xn = tl.load(x_row + cols[None, :] * stride_xk, mask=kmask[None, :],
                                             other=0.0).to(tl.float32)  # fmt: skip
                            d0 += _delta_dot(dptr, DKIND, d_codes, d_scales, d_aux, rows0, m0, cols,
                                             kmask, K, DGROUP, xn)  # fmt: skip
                            d1 += _delta_dot(dptr, DKIND, d_codes, d_scales, d_aux, rows1, m1, cols,
                                             kmask, K, DGROUP, xn)  # fmt: skip
                            d2 += _delta_dot(dptr, DKIND, d_codes, d_scales, d_aux, rows2, m2, cols,
                                             kmask, K, DGROUP, xn)  # fmt: skip
                            d3 += _delta_dot(dptr, DKIND, d_codes, d_scales, d_aux, rows3, m3, cols,
                                             kmask, K, DGROUP, xn)  # fmt: skip
                if (DEPTH == 2) and (PIPE == 0):
                    w0, w1, w2, w3 = v0, v1, v2, v3
                    v0, v1, v2, v3 = n0, n1, n2, n3
                else:
                    w0, w1, w2, w3 = n0, n1, n2, n3
                wd, wmask = wd_next, wmask_next
            if INT8 and (corr != 0):
                # a fitted grid (b != 3a; the converter writes b = 3a): the high bits' sums, in a
                # pass of their own over the words, so that the loop above keeps no registers for
                # them (sm_90: 16-row sub-tiles 158 -> 124 registers, 32-row ones with 8 warps
                # 171 -> 122). RH = 128H - 64Σq = 64(2H - Σq), summed as the loop above sums R.
                for k0 in range(k_lo, k_hi, BLOCK_K):
                    wd = tl.multiple_of(k0 // 16, W) + tl.arange(0, W)
                    wmask = wd < row_words
                    w0, w1, w2, w3 = _q2s_words4(wbase, rows0, rows1, rows2, rows3, m0, m1, m2, m3,
                                                 wd, wmask, row_words, EVEN)  # fmt: skip
                    sc0, sc1, sc2, sc3 = _q2s_group_scales4(
                        bptr, scales, rows0, rows1, rows2, rows3, m0, m1, m2, m3, k0, row_groups,
                        GROUP, W, EVEN, GSUM)  # fmt: skip
                    if QUANT_IN:
                        q0, q1, q2, q3, xsc, qs = _quant_tile(x_row, stride_xk, wd, wmask)
                    else:
                        q0, q1, q2, q3, xsc, qs = _x_words(xq_row, xs_row, xsum_row, row_words, wd,
                                                           wmask, EVEN)  # fmt: skip
                    av0, av1, av2, av3 = _tile_sums(
                        av0, av1, av2, av3, w0, w1, w2, w3, sc0, sc1, sc2, sc3, q0, q1, q2, q3,
                        xsc, qs, True, GSUM, WPG, ASM)  # fmt: skip
                    if PAIRS == 2:
                        if has_b:
                            q0, q1, q2, q3, xsc, qs = _x_words(
                                xq_row_b, xs_row_b, xsum_row_b, row_words, wd, wmask,
                                EVEN)  # fmt: skip
                            avb0, avb1, avb2, avb3 = _tile_sums(
                                avb0, avb1, avb2, avb3, w0, w1, w2, w3, sc0, sc1, sc2, sc3, q0, q1,
                                q2, q3, xsc, qs, True, GSUM, WPG, ASM)  # fmt: skip
            if INT8:
                # β/32 and γ/64 (module docstring); β = a exactly when b = 3a
                beta = tl.where(corr != 0, 0.5 * (b - a), a) / 32
                gamma = -corr / 128
                y0 = tl.sum(beta * acc0 + gamma * av0, axis=1)
                y1 = tl.sum(beta * acc1 + gamma * av1, axis=1)
                y2 = tl.sum(beta * acc2 + gamma * av2, axis=1)
                y3 = tl.sum(beta * acc3 + gamma * av3, axis=1)
                if PAIRS == 2:
                    yb0 = tl.sum(beta * accb0 + gamma * avb0, axis=1)
                    yb1 = tl.sum(beta * accb1 + gamma * avb1, axis=1)
                    yb2 = tl.sum(beta * accb2 + gamma * avb2, axis=1)
                    yb3 = tl.sum(beta * accb3 + gamma * avb3, axis=1)
            else:
                y0 = tl.sum(8 * a * acc0 - 11 * a * ax0 + corr * av0, axis=1)
                y1 = tl.sum(8 * a * acc1 - 11 * a * ax1 + corr * av1, axis=1)
                y2 = tl.sum(8 * a * acc2 - 11 * a * ax2 + corr * av2, axis=1)
                y3 = tl.sum(8 * a * acc3 - 11 * a * ax3 + corr * av3, axis=1)
            for member in tl.static_range(PAIRS):
                if member == 1:  # the second pair (PAIRS 2): its sums, its rows of out or h
                    y0, y1, y2, y3 = yb0, yb1, yb2, yb3
                    pair = pair_b
                    # (tl.where: `mask & scalar` is no bool mask to Triton 3.9's interpreter)
                    m0, m1 = tl.where(has_b, m0, False), tl.where(has_b, m1, False)
                    m2, m3 = tl.where(has_b, m2, False), tl.where(has_b, m3, False)
                # (the same rows for both pairs of PAIRS 2)
                y0, y1, y2, y3 = y0 * rf0, y1 * rf1, y2 * rf2, y3 * rf3
                if FP4_INT8:
                    d0 = 0.5 * tl.sum(dv0, axis=1)
                    d1 = 0.5 * tl.sum(dv1, axis=1)
                    d2 = 0.5 * tl.sum(dv2, axis=1)
                    d3 = 0.5 * tl.sum(dv3, axis=1)
                if DKIND >= 0:
                    if use_delta:
                        y0 += d0 * _row_factor(dptr, DKIND, d_row_scale, d_tensor_scale, rows0, m0)
                        y1 += d1 * _row_factor(dptr, DKIND, d_row_scale, d_tensor_scale, rows1, m1)
                        y2 += d2 * _row_factor(dptr, DKIND, d_row_scale, d_tensor_scale, rows2, m2)
                        y3 += d3 * _row_factor(dptr, DKIND, d_row_scale, d_tensor_scale, rows3, m3)
                if SPLIT > 1:  # the K ranges' sums meet; the last program to arrive goes on alone
                    y0, y1, y2, y3, last = _split_sum(
                        scratch, counters, pair, pid_n, N, rows0, rows1, rows2, rows3, m0, m1, m2,
                        m3, y0, y1, y2, y3, SPLIT)  # fmt: skip
                    m0, m1 = tl.where(last, m0, False), tl.where(last, m1, False)
                    m2, m3 = tl.where(last, m2, False), tl.where(last, m3, False)
                words_ok = INTER // 16  # the words of h this program may write (split: the last's)
                if SPLIT > 1:
                    words_ok = tl.where(last, words_ok, 0)
                if member == 1:
                    words_ok = tl.where(has_b, words_ok, 0)
                if BIAS > 0:
                    bias_at = out_bias if IS_DOWN else in_bias
                    y0 += _bias(bptr, BIAS, bias_at, rows0, m0)
                    y1 += _bias(bptr, BIAS, bias_at, rows1, m1)
                    y2 += _bias(bptr, BIAS, bias_at, rows2, m2)
                    y3 += _bias(bptr, BIAS, bias_at, rows3, m3)
                if IS_DOWN:
                    if member == 0:
                        weight = weight0
                    else:
                        weight = tl.load(topk_w + pair).to(tl.float32)
                    tl.store(out + pair * N + rows0, y0 * weight, mask=m0)
                    tl.store(out + pair * N + rows1, y1 * weight, mask=m1)
                    tl.store(out + pair * N + rows2, y2 * weight, mask=m2)
                    tl.store(out + pair * N + rows3, y3 * weight, mask=m3)
                else:
                    h0 = _activation(y0, y2, ACT, limit, alpha)
                    h1 = _activation(y1, y3, ACT, limit, alpha)
                    if QUANT_OUT and SUB == 8:  # the two sub-tiles' 16 rows are one word of h
                        word = pid_n + tl.arange(0, 1)
                        hrow = INTER // 16
                        both = tl.reshape(tl.trans(tl.join(h0, h1)), (1, 16))  # rows h0 then h1
                        _quant_store(both, word, hrow, oq + pair * (INTER // 4), osc + pair * hrow,
                                     osum + pair * hrow, oqn + pair * (INTER // 4),
                                     word < words_ok)  # fmt: skip
                    elif QUANT_OUT:  # h rounded to int8 words here, for down (SUB % 16 == 0)
                        word0 = pid_n * 2 * HW + tl.arange(0, HW)
                        hrow = INTER // 16
                        hq_row, hqn_row = oq + pair * (INTER // 4), oqn + pair * (INTER // 4)
                        _quant_store(tl.reshape(h0, (HW, 16)), word0, hrow, hq_row,
                                     osc + pair * hrow, osum + pair * hrow, hqn_row,
                                     word0 < words_ok)  # fmt: skip
                        _quant_store(tl.reshape(h1, (HW, 16)), word0 + HW, hrow, hq_row,
                                     osc + pair * hrow, osum + pair * hrow, hqn_row,
                                     word0 + HW < words_ok)  # fmt: skip
                    else:
                        tl.store(out + pair * INTER + rows0, h0, mask=m0)
                        tl.store(out + pair * INTER + rows1, h1, mask=m1)
        if NEXT_L2:
            _prefetch_share(pool, slot_offsets, slot, pool_bytes, next_lo, next_bytes)
    if TRACE:
        lin = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2)
        _trace_store(trace, lin + tl.program_id(2), t_start, t_pre, t_post)


@triton.jit
def _moe_kernel(
    # routing
    x_ptr, stride_x, stride_xk, topk_ids, topk_w, delta_mask, block_pairs, block_key, num_pairs,
    # experts
    pool, slot_table, slot_offsets, delta_table,
    # input/output
    part_in, out, N, K, stride_part_s,
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
    dslot = slot
    if DKIND >= 0:
        dslot = tl.load(delta_table + expert)
        use_delta = use_delta & (dslot >= 0)
    if slot >= 0:
        bptr, dptr = _blob_ptrs(pool, slot_offsets, slot, dslot, use_delta, DKIND)
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


_PLAIN_OFFSETS: dict[tuple[torch.device, int, int], torch.Tensor] = {}


def _plain_slot_offsets(pool: torch.Tensor) -> torch.Tensor:
    """The default slot offsets (slot s at s * pool.stride(0)), made once per pool shape: made
    per call they were two more launches in every call (and in every captured graph), which
    also broke the programmatic dependent launch chain from one call's down to the next
    call's gate_up."""
    key = (pool.device, pool.shape[0], pool.stride(0))
    offsets = _PLAIN_OFFSETS.get(key)
    if offsets is None:
        offsets = torch.arange(pool.shape[0], device=pool.device, dtype=torch.int64)
        offsets *= pool.stride(0)
        if not (pool.is_cuda and torch.cuda.is_current_stream_capturing()):
            _PLAIN_OFFSETS[key] = offsets  # (one made in a capture belongs to that graph)
    return offsets


def _mask_bytes(mask: torch.Tensor) -> torch.Tensor:
    """The delta mask as uint8 bytes; a contiguous bool mask is viewed as them (no launch)."""
    if mask.dtype == torch.bool and mask.is_contiguous():
        return mask.view(torch.uint8)
    return mask.contiguous().to(torch.uint8)


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
    zero_copy: bool = False,
    first_pdl: bool = False,
) -> tuple[KernelChoice, KernelChoice]:
    """Same contract as `moe_ref.moe_slots_ref`, plus:

    slot_offsets: [S] int64, byte offset of each slot from pool's first byte (default: slot s at
                  s * pool.stride(0)); slots outside `pool` (pinned host memory) are allowed
    choice:       (gate_up, down) kernel configs; default `moe_dispatch.choose`
    zero_copy:    slots may be pinned host rows (zero-copy decode): the q2s GEMV takes the
                  configs tuned for reads over PCIe where there are some
    first_pdl:    (sm_90, the q2s GEMV) the call's first launch starts while the kernel before
                  it ends (programmatic dependent launch) and reads the routing (topk_ids,
                  topk_weights, delta_mask) and tables before it waits for that kernel
                  (`_q2s_gemv_kernel`'s PDL): only where that kernel wrote none of them, e.g.
                  bench/kernels.py's chained calls (fixed routing). Off (the op: its routing
                  comes from the kernels just before), a GEMV launch first in the call starts
                  once the kernel before has ended, or where its config sets `wait_first`,
                  while it ends (PDL) with programs that wait for it before they read anything
                  and then let down start; a rounding launch first keeps PDL (it lets the
                  GEMV start only after its own wait), as do the launches after the first.
    Returns the configs it ran (int8_act: the twin is moe_slots_ref(..., act_int8=True)).
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
        slot_offsets = _plain_slot_offsets(pool)
    pairs = tokens * top_k
    inter = gu.n // 2
    from moetier.kernels import q2s_mma  # it imports this module's tile decoders

    if choice is None:
        experts = slot_table.shape[0]
        if pairs < Q2S_GEMV_MAX_PAIRS and q2s_gemv_supports(gu, dn, dgu, ddn):
            delta = dgu is not None
            choice = (
                choose_q2s_gemv(gu.n, gu.k, zero_copy, delta, pairs),
                choose_q2s_gemv(dn.n, dn.k, zero_copy, delta, pairs),
            )
        elif q2s_mma.supports(gu, dn, dgu, ddn):
            choice = choose_q2s_mma(pairs, experts, (gu.n, gu.k), (dn.n, dn.k))
        else:
            choice = choose_pair(pairs, experts, (gu.n, gu.k), (dn.n, dn.k))
    c_gu, c_dn = choice
    if c_gu.q2s_mma:
        if not (c_dn.q2s_mma and q2s_mma.supports(gu, dn, dgu, ddn)):
            raise ValueError(f"the q2s prefill kernel does not run {fmt.name} (both launches)")
        q2s_mma.q2s_mma(hidden, topk_ids, topk_weights, slot_table, pool, slot_offsets, fmt, act,
                        out, gu, dn, dgu, ddn, c_gu, c_dn, delta_mask,
                        delta_table if use_delta else None)  # fmt: skip
        return c_gu, c_dn
    if not c_gu.grouped and q2s_gemv_supports(gu, dn, dgu, ddn):
        _q2s_gemv(hidden, topk_ids.contiguous(), topk_weights.contiguous(), slot_table, pool,
                  slot_offsets, fmt, act, out, gu, dn, dgu, ddn, c_gu, c_dn, delta_mask,
                  delta_table if use_delta else None, first_pdl)  # fmt: skip
        return c_gu, c_dn
    c_gu, c_dn = replace(c_gu, int8_act=False), replace(c_dn, int8_act=False)
    if c_gu.grouped != c_dn.grouped or (c_gu.grouped and c_gu.block_m != c_dn.block_m):
        raise ValueError("gate_up and down must use the same pair grouping (mode and BLOCK_M)")
    topk_ids = topk_ids.contiguous()
    topk_w = topk_weights.contiguous()
    mask = _mask_bytes(delta_mask) if use_delta and delta_mask is not None else None
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
        grid = (blocks, triton.cdiv(spec.n, c.block_n), 1 if is_down else c.split_k)
        _moe_kernel[grid](
            hidden, hidden.stride(0), hidden.stride(1), topk_ids, topk_w, dmask, block_pairs,
            block_key, pairs,
            pool, slot_table, slot_offsets, dtable,
            part, dst, spec.n, spec.k, part.stride(0),
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
    return c_gu, c_dn


Q2S_GEMV_GROUPS = (16, 32, 64, 128)  # q2s groups the q2s GEMV kernel takes


def q2s_gemv_supports(
    gu: MatrixSpec, dn: MatrixSpec, dgu: MatrixSpec | None, ddn: MatrixSpec | None
) -> bool:
    """Whether `_q2s_gemv_kernel` runs this call: q2s base matrices whose K is whole int32 words
    (16 codes) and whose groups are 1, 2, 4 or 8 words (`_q2s_group_scale` repeats each group's
    scale by joins), and no delta or an additive one."""
    for spec, dspec in ((gu, dgu), (dn, ddn)):
        if spec.kind != Q2S or spec.k % 16 or spec.group not in Q2S_GEMV_GROUPS:
            return False
        if dspec is not None and dspec.kind in (NESTED, NESTED_DELTA):
            return False
    return True


def _q2s_gemv(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    slot_table: torch.Tensor,
    pool: torch.Tensor,
    slot_offsets: torch.Tensor,
    fmt: BlobFormat,
    act: ExpertActivation,
    out: torch.Tensor,
    gu: MatrixSpec,
    dn: MatrixSpec,
    dgu: MatrixSpec | None,
    ddn: MatrixSpec | None,
    c_gu: KernelChoice,
    c_dn: KernelChoice,
    delta_mask: torch.Tensor | None,
    delta_table: torch.Tensor | None,
    first_pdl: bool = False,
) -> None:
    """Two launches of `_q2s_gemv_kernel`: gate_up (+ activation) into h [P, I], then down
    (and a launch rounding x in front where gate_up does not; first_pdl: `moe_slots_triton`)."""
    tokens, top_k = topk_ids.shape
    pairs = tokens * top_k
    inter = gu.n // 2
    int8 = c_gu.int8_act
    if int8 != c_dn.int8_act:
        raise ValueError("gate_up and down must agree on int8 activations")
    bias, in_bias, out_bias = _bias_kind(fmt)
    has_delta = dgu is not None and delta_mask is not None and delta_table is not None
    dmask = _mask_bytes(delta_mask) if has_delta and delta_mask is not None else topk_ids
    dtable = delta_table if has_delta and delta_table is not None else slot_table
    # gate_up rounds h to int8 words itself when its row sub-tiles hold whole words (or, at 8
    # rows, its two sub-tiles make one)
    sub_gu = max(1, c_gu.block_n // 4)
    # the Gluon kernel (`q2s_gluon`) on the launches whose config asks for it, where it runs:
    # sm_90, int8, no delta plane or bias (elsewhere the Triton kernel takes the same config)
    gluon = _sm_at_least(hidden.device, 9) and int8 and not has_delta and bias == 0
    gl_gu, gl_dn = gluon and c_gu.gluon, gluon and c_dn.gluon
    quant_out = int8 and (sub_gu % 16 == 0 or sub_gu == 8) and inter % 16 == 0
    if gl_gu:  # (its row tiles of block_n / 2 rows round whole words)
        quant_out = int8 and (c_gu.block_n // 2) % 16 == 0 and inter % 16 == 0
    hq = quant_words_buffers(pairs, inter, hidden.device) if quant_out else None
    if hq is None:
        h = torch.empty(pairs, inter, device=hidden.device, dtype=torch.float32)
    else:
        h = hq[1]  # placeholder: no float h is written
    # sm_90 features (compiled PTX, so never under the interpreter): L2 prefetch of each
    # program's rows, programmatic dependent launch of the GEMV after the kernel before it
    hopper = _sm_at_least(hidden.device, 9)
    pdl = hopper and c_gu.pdl and c_dn.pdl
    # gate_up rounds x itself (no activation-rounding launch) when no delta reads the rounded x
    quant_in = c_gu.quant_in and int8 and not has_delta
    # down's weights in its blob (NEXT_L2: gate_up's programs ask L2 for them)
    dn_lo = min(dn.codes, dn.scales)
    dn_hi = max(dn.codes + dn.n * dn.k // 4, dn.scales + dn.n * (dn.k // dn.group))
    for is_down, spec, dspec, c, x, dst in (
        (0, gu, dgu, c_gu, hidden, h),
        (1, dn, ddn, c_dn, h, out),
    ):
        sub = max(1, c.block_n // 4)
        # whole groups per K tile (a group of 8 words needs BLOCK_K >= 128)
        block_k = max(spec.group, min(c.block_k, max(16, triton.next_power_of_2(spec.k))))
        rows = spec.n if is_down else inter
        tile_rows = (4 if is_down else 2) * sub
        # split-K (two K ranges of whole tiles, `_split_sum`); nothing to split in one tile
        if c.split_k not in (1, 2):
            raise ValueError(f"the q2s GEMV splits K in 1 or 2 ranges, not {c.split_k}")
        split = c.split_k if spec.k > block_k else 1
        if c.row_tiles < 1 or (c.row_tiles > 1 and split > 1):
            raise ValueError(f"row_tiles {c.row_tiles}: 1, or more without split-K")
        grid = (pairs, triton.cdiv(triton.cdiv(rows, tile_rows), c.row_tiles), split)
        scratch, counters = dst, slot_table  # placeholders of the same types
        if split > 1:
            scratch, counters = _split_buffers(hidden.device, is_down, pairs, spec.n, grid[1])
        # two pairs of one expert per program: int8 x rounded by a launch, no delta, no split
        if c.pairs not in (1, 2):
            raise ValueError(f"a q2s GEMV program serves 1 or 2 pairs, not {c.pairs}")
        x_launched = int8 and not (quant_in and not is_down)
        two = c.pairs == 2 and x_launched and not has_delta and split == 1
        # whole K tiles and row tiles: no masks in the K loop
        even = spec.k % block_k == 0 and rows % tile_rows == 0
        dspec = dspec if has_delta else None
        xq = xs = xsum = xqn = x  # placeholders, unused without int8 activations
        if x_launched:
            xq, xs, xsum, xqn = (
                hq if is_down and hq is not None
                else quant_words(x, pdl, pdl and c_gu.quant_pdl)
            )  # fmt: skip
        # launched with PDL: down, and gate_up behind its rounding launch (which lets it start
        # only after its own wait: the routing the GEMV reads before its wait is then
        # visible); gate_up first in the call only with first_pdl (`moe_slots_triton`)
        launch_pdl = pdl and (bool(is_down) or x_launched or first_pdl)
        # or, first and with wait_first, launched with PDL all the same, its programs reading
        # nothing before their wait (and letting down start only after it)
        wait_first = pdl and c.wait_first and not launch_pdl
        launch_pdl = launch_pdl or wait_first
        oq, os_, osum, oqn = hq if not is_down and hq is not None else (x, x, x, x)
        trace = TRACE_BUFFERS[is_down] if TRACE_BUFFERS and hopper else None
        if gl_dn if is_down else gl_gu:
            from moetier.kernels import q2s_gluon

            next_l2 = (dn_lo, dn_hi - dn_lo) if c.next_l2 and not is_down else None

            q2s_gluon.launch(bool(is_down), x, None if xq is x else (xq, xs, xsum, xqn),
                             topk_ids, topk_w, pool, slot_table, slot_offsets, dst,
                             None if is_down else hq, spec, inter, top_k,
                             ACTIVATIONS[act.kind], act.limit, act.alpha, c, pdl, trace,
                             next_l2, launch_pdl, wait_first)  # fmt: skip
            continue
        _q2s_gemv_kernel[grid](
            x, x.stride(0), x.stride(1), topk_ids, topk_w, dmask,
            pool, slot_table, slot_offsets, dtable,
            dst, spec.n, spec.k, inter, spec.k // 16, spec.k // spec.group, Q2S_ONE,
            spec.codes, spec.scales, spec.row_scale, spec.aux, spec.group,
            dspec.kind if dspec else NONE, dspec.codes if dspec else 0,
            dspec.scales if dspec else 0, dspec.row_scale if dspec else 0,
            dspec.aux if dspec else 0, dspec.tensor_scale if dspec else 0,
            dspec.group if dspec else 1,
            bias, in_bias, out_bias, ACTIVATIONS[act.kind], act.limit, act.alpha,
            is_down, top_k, sub, block_k, xq, xs, xsum, xqn, int8, _inline_asm(),
            oq, os_, osum, oqn, quant_out and not is_down, even, c.group_acc,
            c.prefetch_l2 and hopper and spec.k % 64 == 0, pool.numel(),
            pdl, quant_in and not is_down, c.depth, c.pipe, c.pipe or (2 if c.pipe_x else None),
            scratch, counters, split, 2 if two else 1,
            triton.next_power_of_2(pairs) if two else 1,  # (one compile for all pair counts)
            c.row_tiles, c.next_l2 and hopper and not is_down, dn_lo, dn_hi - dn_lo,
            c.unroll if c.unroll > 1 else None, c.delta_ahead,
            trace if trace is not None else topk_ids, trace is not None, wait_first,
            num_warps=c.num_warps, num_stages=c.num_stages,
            launch_pdl=launch_pdl, **({"maxnreg": c.maxnreg} if c.maxnreg else {}),
        )  # fmt: skip


# a study (bench/timeline.py): where set, (gate_up's, down's) int64 [programs, 8] buffers that
# the q2s GEMV's launches (Triton and Gluon, sm_90) write their programs' timer stamps to
# (`TRACE`)
TRACE_BUFFERS: tuple[torch.Tensor, torch.Tensor] | None = None

_SplitKey = tuple[torch.device, int, int, int, int]  # device, is_down, pairs, n, row tiles
_SPLIT_BUFFERS: dict[_SplitKey, tuple[torch.Tensor, torch.Tensor]] = {}


def _split_buffers(
    device: torch.device, is_down: int, pairs: int, n: int, tiles: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The split-K partial sums [pairs, n] float32 and arrival counts [pairs, tiles] int32 of
    one launch (gate_up or down) and shape: zero when made, and left zero by every launch
    (`_split_sum`), so made once and kept (launches of one kind and shape run one after
    another on the stream)."""
    key = (device, is_down, pairs, n, tiles)
    if key not in _SPLIT_BUFFERS:
        _SPLIT_BUFFERS[key] = (
            torch.zeros(pairs, n, device=device, dtype=torch.float32),
            torch.zeros(pairs, tiles, device=device, dtype=torch.int32),
        )
    return _SPLIT_BUFFERS[key]


def _inline_asm() -> bool:
    """Under TRITON_INTERPRET=1 (the CPU tests) there is no inline assembly: `_dp4a` then uses
    plain integer ops."""
    return os.environ.get("TRITON_INTERPRET") != "1"


def _sm_at_least(device: torch.device, major: int, minor: int = 0) -> bool:
    """Compiled PTX (not Triton's interpreter) on a CUDA device of at least this compute
    capability: where the kernels' sm-specific instructions may be used."""
    return (
        _inline_asm()
        and device.type == "cuda"
        and torch.cuda.get_device_capability(device) >= (major, minor)
    )


def quant_words_buffers(
    rows: int, k: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Empty (q int32 [rows, 4, k/16], scale float32 [rows, k/16], Σq int32 [rows, k/16],
    q in column order int32 [rows, 4, k/16])."""
    return (
        torch.empty(rows, 4, k // 16, device=device, dtype=torch.int32),
        torch.empty(rows, k // 16, device=device, dtype=torch.float32),
        torch.empty(rows, k // 16, device=device, dtype=torch.int32),
        torch.empty(rows, 4, k // 16, device=device, dtype=torch.int32),
    )


def quant_words(
    x: torch.Tensor, pdl: bool = False, pdl_wait: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """x [R, K] float (K a multiple of 16) -> (q packed int32 [R, 4, K/16], scale float32
    [R, K/16], Σq int32 [R, K/16], q in column order int32 [R, 4, K/16]): `_quant_words_kernel`,
    twin of moe_ref.quant_words_ref. pdl (sm_90): the next launch, if launched with programmatic
    dependent launch, may start before this one ends. pdl_wait (sm_90): this launch is one
    too (its launch overlaps the kernel before; `_quant_words_kernel`'s WAIT)."""
    rows, k = x.shape
    xq, xs, xsum, xqn = quant_words_buffers(rows, k, x.device)
    block_w = min(64, triton.next_power_of_2(k // 16))
    _quant_words_kernel[(rows, triton.cdiv(k // 16, block_w))](
        x, x.stride(0), x.stride(1), xq, xs, xsum, xqn, k, block_w, pdl, pdl_wait,
        launch_pdl=pdl_wait,
    )  # fmt: skip
    return xq, xs, xsum, xqn
