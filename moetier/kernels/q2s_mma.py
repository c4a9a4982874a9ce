"""q2s prefill on tensor cores: a grouped GEMM that decodes 2-bit codes into the dot's dtype.

Pairs are grouped per (expert, delta flag) into blocks of BLOCK_M rows (`pair_tables._group_pairs`,
no host sync). Per K tile a program loads int32 words of 16 codes (one load per 16 weights, not
one per weight as the generic `_moe_kernel` does) and its group scales once per word. On the GPU
(bf16 / fp16 dots) each code's value is looked up with PRMT in a per-(row, word) table of the
four levels (-b, -a, a, b) times the group scale, already in the dot's 16-bit format: about 3
instructions per weight, no float arithmetic per weight (the interpreter, in the CPU tests,
computes the same values with float selects). The tile goes to `tl.dot` as its first operand
(wgmma reads it from registers), in the activations' dtype; the row scale is applied once after
the K loop. Two launches:

  gate_up: h[p, n] = act(g, u), g / u = rows n / I + n of W_gu[e_p] . x[t_p]   (h: x's dtype)
  down:    out[p, :] = w_p . (W_down[e_p] . h[p] + b)

An additive delta (FP4 and q2s decoded by words, raw formats by `blob_decode._decode`) adds its
own product for the blocks whose flag is on; blocks with it off never read the delta blob.
Same contract and twin as `moe_triton.moe_slots_triton` (`moe_ref.moe_slots_ref`, float
activations): the gate_up activation is rounded to x's dtype before the down dot, exactly as
the generic kernel's dot rounds it.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from moetier.config import ExpertActivation
from moetier.core.layout import BlobFormat
from moetier.kernels.blob_decode import (
    _DOT_DTYPES,
    ACTIVATIONS,
    NESTED,
    NESTED_DELTA,
    NONE,
    Q2S,
    MatrixSpec,
    _activation,
    _bias,
    _bias_kind,
    _blob_ptrs,
    _decode,
    _e2m1,
    _e4m3,
    _f32_at,
    _row_factor,
)
from moetier.kernels.moe_dispatch import KernelChoice
from moetier.kernels.pair_tables import _group_pairs
from moetier.kernels.ptx import _sm_at_least


@functools.cache
def supports(
    gu: MatrixSpec, dn: MatrixSpec, dgu: MatrixSpec | None, ddn: MatrixSpec | None
) -> bool:
    """q2s base matrices of whole int32 words whose groups are whole words (16..128 columns),
    with no delta or an additive one."""
    for spec, dspec in ((gu, dgu), (dn, ddn)):
        if spec.kind != Q2S or spec.k % 16 or spec.group % 16 or spec.group > 128:
            return False
        if dspec is not None and dspec.kind in (NESTED, NESTED_DELTA):
            return False
    return True


@triton.jit
def _q2s_tables(a_s, b_s, F16: tl.constexpr):
    """The four levels (-b, -a, a, b) times the group scale as 16-bit floats, packed two per
    int32: (lo, hi) = ((-b, -a), (a, b)) (`cvt.rn.bf16x2.f32` / `.f16x2`, then sign flips)."""
    if F16:
        hi, lo = tl.inline_asm_elementwise(
            "{cvt.rn.f16x2.f32 $0, $2, $3; xor.b32 $1, $0, 0x80008000;"
            " prmt.b32 $1, $1, 0, 0x1032;}",
            "=r,=r,f,f", [b_s, a_s], dtype=(tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip
    else:
        hi, lo = tl.inline_asm_elementwise(
            "{cvt.rn.bf16x2.f32 $0, $2, $3; xor.b32 $1, $0, 0x80008000;"
            " prmt.b32 $1, $1, 0, 0x1032;}",
            "=r,=r,f,f", [b_s, a_s], dtype=(tl.int32, tl.int32), is_pure=True, pack=1,
        )  # fmt: skip
    return lo, hi


def _lut_asm() -> str:
    """PTX: the sixteen 16-bit levels of word $16's codes from the table ($17, $18). Code c selects
    bytes 2c, 2c + 1 of the table; the PRMT selector of columns (2m, 2m + 1), codes (c0, c1) in
    nibble m, is 0x1010 + 0x22 (c0 + 256 c1)."""
    lines = ["{", ".reg .b32 x, y, u, s, r;"]
    for m in range(8):
        lines += [
            f"shr.b32 x, $16, {4 * m};",
            "shl.b32 y, x, 6;",
            "and.b32 y, y, 0x300;",
            "and.b32 u, x, 3;",
            "or.b32 u, u, y;",
            "mad.lo.u32 s, u, 0x22, 0x1010;",
            "prmt.b32 r, $17, $18, s;",
            f"mov.b32 {{${2 * m}, ${2 * m + 1}}}, r;",
        ]
    return "\n".join([*lines, "}"])


_LUT_ASM = tl.constexpr(_lut_asm())
_LUT_CONSTRAINTS = tl.constexpr("=h," * 16 + "r,r,r")


@triton.jit
def _join16(v):
    """16 tensors [BN, W] (columns 0..15 of each word) -> [BN, W, 2, 2, 2, 2] in column order."""
    a = tl.join(tl.join(tl.join(v[0], v[8]), tl.join(v[4], v[12])),
                tl.join(tl.join(v[2], v[10]), tl.join(v[6], v[14])))  # fmt: skip
    b = tl.join(tl.join(tl.join(v[1], v[9]), tl.join(v[5], v[13])),
                tl.join(tl.join(v[3], v[11]), tl.join(v[7], v[15])))  # fmt: skip
    return tl.join(a, b)


@triton.jit
def _q2s_word_lut(words, lo, hi, F16: tl.constexpr):
    """The levels (in the table's 16-bit format) of the sixteen codes of each word, looked up by
    PRMT in (lo, hi): [BN, W, 2, 2, 2, 2], column order."""
    if F16:
        v = tl.inline_asm_elementwise(
            _LUT_ASM, _LUT_CONSTRAINTS, [words, lo, hi], dtype=(tl.float16,) * 16,
            is_pure=True, pack=1,
        )  # fmt: skip
    else:
        v = tl.inline_asm_elementwise(
            _LUT_ASM, _LUT_CONSTRAINTS, [words, lo, hi], dtype=(tl.bfloat16,) * 16,
            is_pure=True, pack=1,
        )  # fmt: skip
    return _join16(v)


@triton.jit
def _q2s_tile(bptr, codes, scales, rows, rmask, k0, row_words, row_groups, a, b,
              GROUP: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr,
              LUT: tl.constexpr):  # fmt: skip
    """Rows `rows`, columns k0..k0+BK of a q2s matrix times its group scales (no row scale):
    [BN, BK] in DOT_DTYPE; zero outside the matrix. LUT (bf16 / fp16 dots on the GPU): each
    code's value is looked up by PRMT in a table of the four scaled levels per (row, word);
    otherwise decoded with float selects (the interpreter; identical values)."""
    W: tl.constexpr = BK // 16
    BN: tl.constexpr = rows.shape[0]
    wd = k0 // 16 + tl.arange(0, W)
    m = rmask[:, None] & (wd < row_words)[None, :]
    words = tl.load((bptr + codes).to(tl.pointer_type(tl.int32)) + rows[:, None] * row_words
                    + wd[None, :], mask=m, other=0)  # fmt: skip
    sc = _e4m3(tl.load(bptr + scales + rows[:, None] * row_groups + (wd // (GROUP // 16))[None, :],
                       mask=m, other=0))  # fmt: skip
    if LUT:
        lo, hi = _q2s_tables(a * sc, b * sc, DOT_DTYPE == tl.float16)
        w = _q2s_word_lut(words, lo, hi, DOT_DTYPE == tl.float16)
    else:
        j2 = 2 * tl.arange(0, 16)
        c = (words[:, :, None] >> j2[None, None, :]) & 3
        mag = tl.where((c == 1) | (c == 2), a, b)
        w = (tl.where(c >= 2, mag, -mag) * sc[:, :, None]).to(DOT_DTYPE)
    return tl.reshape(w, (BN, BK))


@triton.jit
def _fp4_tile(dptr, codes, scales, rows, rmask, k0, K, GROUP: tl.constexpr, E8M0: tl.constexpr,
              BK: tl.constexpr, DOT_DTYPE: tl.constexpr):  # fmt: skip
    """Rows `rows`, columns k0..k0+BK of an NVFP4 / MXFP4 matrix times its block scales (no
    tensor scale): [BN, BK] in DOT_DTYPE. int32 words of 8 codes (code j at bits 4j) and one
    scale load per word, instead of `_decode`'s two byte gathers per element."""
    W: tl.constexpr = BK // 8
    BN: tl.constexpr = rows.shape[0]
    wd = k0 // 8 + tl.arange(0, W)
    m = rmask[:, None] & (wd < K // 8)[None, :]
    words = tl.load((dptr + codes).to(tl.pointer_type(tl.int32)) + rows[:, None] * (K // 8)
                    + wd[None, :], mask=m, other=0)  # fmt: skip
    byte = tl.load(dptr + scales + rows[:, None] * (K // GROUP) + (wd // (GROUP // 8))[None, :],
                   mask=m, other=0)  # fmt: skip
    if E8M0:
        sc = (byte.to(tl.int32) << 23).to(tl.float32, bitcast=True)
    else:
        sc = _e4m3(byte)
    c = (words[:, :, None] >> (4 * tl.arange(0, 8))[None, None, :]) & 15
    w = (_e2m1(c) * sc[:, :, None]).to(DOT_DTYPE)
    return tl.reshape(w, (BN, BK))


@triton.jit
def _delta_tile(dptr, DKIND: tl.constexpr, d_codes, d_scales, d_aux, rows, nmask, cols, kmask,
                k0, K, DGROUP: tl.constexpr, BK: tl.constexpr, DOT_DTYPE: tl.constexpr,
                LUT: tl.constexpr):  # fmt: skip
    """One K tile of an additive delta matrix without its row / tensor factor: FP4 and q2s by
    words, raw formats by `_decode`."""
    if (DKIND == 4) or (DKIND == 5):  # NVFP4 / MXFP4
        dw = _fp4_tile(dptr, d_codes, d_scales, rows, nmask, k0, K, DGROUP, DKIND == 5, BK,
                       DOT_DTYPE)  # fmt: skip
    elif DKIND == 3:  # q2s
        dw = _q2s_tile(dptr, d_codes, d_scales, rows, nmask, k0, K // 16, K // DGROUP,
                       _f32_at(dptr, d_aux), _f32_at(dptr, d_aux + 4), DGROUP, BK, DOT_DTYPE,
                       LUT)  # fmt: skip
    else:
        dw = _decode(dptr, DKIND, d_codes, d_scales, d_aux, rows, cols, K, DGROUP,
                     nmask[:, None] & kmask[None, :]).to(DOT_DTYPE)  # fmt: skip
    return dw


@triton.jit
def _dot(w, x, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """w [BN, BK] times x [BM, BK]^T: [BN, BM]. The decoded weights are the dot's first operand,
    which wgmma takes from registers (as the second, they would go through shared memory)."""
    return tl.dot(w, tl.trans(x.to(DOT_DTYPE)), input_precision=PRECISION)


@triton.jit
def _q2s_mma_kernel(
    x_ptr, stride_x, stride_xk, topk_w, block_pairs, block_key,
    pool, slot_table, slot_offsets, delta_table,
    out, N, K, row_words, row_groups,
    codes, scales, row_scale, aux, GROUP: tl.constexpr,
    DKIND: tl.constexpr, d_codes, d_scales, d_row_scale, d_aux, d_tensor_scale,
    DGROUP: tl.constexpr,
    BIAS: tl.constexpr, in_bias, out_bias, ACT: tl.constexpr, limit, alpha_act,
    IS_DOWN: tl.constexpr, TOPK: tl.constexpr,
    DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr, LUT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One (block of pairs, N tile) program. gate_up (IS_DOWN=0): N = I, x = hidden (row =
    token), writes h[p, n] = act(gate, up) in out's dtype. down: x = h (row = pair), writes
    out[p, n] = w_p (W x + b) as float32."""
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    key = tl.load(block_key + pid_m)  # expert * 2 + delta flag; -1 = unused block
    expert = tl.maximum(key, 0) >> 1
    slot = tl.where(key >= 0, tl.load(slot_table + expert), -1)
    if slot >= 0:
        use_delta = (key & 1) == 1
        dslot = slot
        if DKIND >= 0:
            dslot = tl.load(delta_table + expert)
            use_delta = use_delta & (dslot >= 0)
        bptr, dptr = _blob_ptrs(pool, slot_offsets, slot, dslot, use_delta, DKIND)
        pairs = tl.load(block_pairs + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        pmask = pairs >= 0
        src = pairs
        if not IS_DOWN:
            src = pairs // TOPK
        rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rows < N
        a = _f32_at(bptr, aux)
        b = _f32_at(bptr, aux + 4)
        acc = tl.zeros((BLOCK_N, BLOCK_M), tl.float32)  # transposed: rows of W by pairs
        acc_up = tl.zeros_like(acc)
        acc_d = tl.zeros_like(acc)
        acc_dup = tl.zeros_like(acc)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            kmask = cols < K
            x = tl.load(x_ptr + src[:, None] * stride_x + cols[None, :] * stride_xk,
                        mask=pmask[:, None] & kmask[None, :], other=0.0)  # fmt: skip
            w = _q2s_tile(bptr, codes, scales, rows, nmask, k0, row_words, row_groups, a, b,
                          GROUP, BLOCK_K, DOT_DTYPE, LUT)  # fmt: skip
            acc += _dot(w, x, DOT_DTYPE, PRECISION)
            if not IS_DOWN:
                w = _q2s_tile(bptr, codes, scales, N + rows, nmask, k0, row_words, row_groups,
                              a, b, GROUP, BLOCK_K, DOT_DTYPE, LUT)  # fmt: skip
                acc_up += _dot(w, x, DOT_DTYPE, PRECISION)
            if DKIND >= 0:
                if use_delta:
                    dw = _delta_tile(dptr, DKIND, d_codes, d_scales, d_aux, rows, nmask, cols,
                                     kmask, k0, K, DGROUP, BLOCK_K, DOT_DTYPE, LUT)  # fmt: skip
                    acc_d += _dot(dw, x, DOT_DTYPE, PRECISION)
                    if not IS_DOWN:
                        dw = _delta_tile(dptr, DKIND, d_codes, d_scales, d_aux, N + rows,
                                         nmask, cols, kmask, k0, K, DGROUP, BLOCK_K, DOT_DTYPE,
                                         LUT)  # fmt: skip
                        acc_dup += _dot(dw, x, DOT_DTYPE, PRECISION)
        rs = tl.load((bptr + row_scale).to(tl.pointer_type(tl.float32)) + rows, mask=nmask,
                     other=0.0)  # fmt: skip
        acc = acc * rs[:, None]
        if DKIND >= 0:
            if use_delta:
                dfac = _row_factor(dptr, DKIND, d_row_scale, d_tensor_scale, rows, nmask)
                acc += acc_d * dfac[:, None]
        omask = nmask[:, None] & pmask[None, :]
        optr = pairs[None, :] * N + rows[:, None]
        if IS_DOWN:
            if BIAS > 0:
                acc += _bias(bptr, BIAS, out_bias, rows, nmask)[:, None]
            weight = tl.load(topk_w + pairs, mask=pmask, other=0.0).to(tl.float32)
            tl.store(out + optr, acc * weight[None, :], mask=omask)
        else:
            rs_up = tl.load((bptr + row_scale).to(tl.pointer_type(tl.float32)) + N + rows,
                            mask=nmask, other=0.0)  # fmt: skip
            acc_up = acc_up * rs_up[:, None]
            if DKIND >= 0:
                if use_delta:
                    dfac = _row_factor(dptr, DKIND, d_row_scale, d_tensor_scale, N + rows, nmask)
                    acc_up += acc_dup * dfac[:, None]
            if BIAS > 0:
                acc += _bias(bptr, BIAS, in_bias, rows, nmask)[:, None]
                acc_up += _bias(bptr, BIAS, in_bias, N + rows, nmask)[:, None]
            h = _activation(acc, acc_up, ACT, limit, alpha_act)
            tl.store(out + optr, h.to(out.dtype.element_ty), mask=omask)


def q2s_mma(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
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
) -> None:
    """Two launches of `_q2s_mma_kernel` (arguments as `moe_triton.moe_slots_triton`'s, after
    its checks; `supports(gu, dn, dgu, ddn)` must hold)."""
    if c_gu.block_m != c_dn.block_m:
        raise ValueError("gate_up and down must group pairs into the same BLOCK_M")
    tokens, top_k = topk_ids.shape
    pairs = tokens * top_k
    inter = gu.n // 2
    topk_ids = topk_ids.contiguous()
    has_delta = dgu is not None and delta_mask is not None and delta_table is not None
    delta_on = None
    if has_delta and delta_mask is not None and delta_table is not None:
        delta_on = delta_mask.bool() & (delta_table.long()[topk_ids.long()] >= 0)
    block_pairs, block_key = _group_pairs(
        topk_ids, delta_on, slot_table, slot_table.shape[0], c_gu.block_m
    )
    bias, in_bias, out_bias = _bias_kind(fmt)
    dot_dtype = _DOT_DTYPES[hidden.dtype]
    precision = "ieee" if hidden.dtype == torch.float32 else "tf32"
    dtable = delta_table if has_delta and delta_table is not None else slot_table
    # cvt.rn.bf16x2.f32 / .f16x2 (the lookup tables) need sm_80; older GPUs decode with selects
    lut = hidden.dtype != torch.float32 and _sm_at_least(hidden.device, 8)
    h = torch.empty(pairs, inter, device=hidden.device, dtype=hidden.dtype)
    topk_w = topk_weights.contiguous()
    for is_down, spec, dspec, c, x, dst in (
        (0, gu, dgu, c_gu, hidden, h),
        (1, dn, ddn, c_dn, h, out.view(pairs, -1)),
    ):
        dspec = dspec if has_delta else None
        rows = spec.n if is_down else inter
        block_k = max(spec.group, c.block_k)
        grid = (block_key.shape[0], triton.cdiv(rows, c.block_n))
        _q2s_mma_kernel[grid](
            x, x.stride(0), x.stride(1), topk_w, block_pairs, block_key,
            pool, slot_table, slot_offsets, dtable,
            dst, rows, spec.k, spec.k // 16, spec.k // spec.group,
            spec.codes, spec.scales, spec.row_scale, spec.aux, spec.group,
            dspec.kind if dspec else NONE, dspec.codes if dspec else 0,
            dspec.scales if dspec else 0, dspec.row_scale if dspec else 0,
            dspec.aux if dspec else 0, dspec.tensor_scale if dspec else 0,
            dspec.group if dspec else 1,
            bias, in_bias, out_bias, ACTIVATIONS[act.kind], act.limit, act.alpha,
            is_down, top_k, dot_dtype, precision, lut,
            c.block_m, c.block_n, block_k,
            num_warps=c.num_warps, num_stages=c.num_stages,
        )  # fmt: skip
