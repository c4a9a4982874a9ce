"""int8 activation words: activations rounded to int8 per 16-column word, with a float32 scale and
Σq each (`_quant_words_kernel`, launched by `quant_words`; inside a kernel `_quant_store` and
`_quant_tile`; twin: `moe_ref.quant_words_ref`), read back (`_x_words`, `_dequant_words`), and
a weight word's integer products with them (`_q2s_word_dots`: 16 q2s codes by IDP4A;
`_fp4_word_dot`: 16 E2M1 codes by PRMT + IDP4A). The q2s GEMV (`q2s_gemv`) takes them all, its
Gluon counterpart (`q2s_gluon`) `_q2s_word_dots`; `_quant_words_kernel`'s docstring gives the
layouts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moetier.kernels.ptx import _dp4a, _prmt


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
