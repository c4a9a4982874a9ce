"""q2s decode GEMV in Gluon (Triton's layout-explicit dialect), sm_90: one launch of a call's
gate_up or down, in place of `q2s_gemv._q2s_gemv_kernel` where a config sets
`KernelChoice.gluon` (H200 configs: where it measured faster, docs/benchmarks.md).

Every program copies its token's activation row into shared memory once (int8 planes, scales,
Σq and the offsets x scale · -96 Σq: 28 bytes a word of 16 columns), after its weights' first
tile is asked for, and each K tile reads it from there. gate_up can round x to int8 words
itself while copying it (QUANT_IN: once a program, so no rounding launch) and rounds h into
int8 words for down (QUANT_OUT), so a call is two launches. The words and group scales of tile
i + 1 are loaded into registers before tile i is decoded (or the words stream through a
cp.async ring, STAGES >= 2: slower on the H200). PRIME (`KernelChoice.prime`): tile 1's are
asked for with tile 0's, before the wait for the launch before and the staging of x.
WAIT_FIRST (`KernelChoice.wait_first`, a call's first launch): the program waits for the
launch before, then lets the next start, before it reads anything (as the Triton kernel's).
PREFETCH_L2 (`KernelChoice.prefetch_l2`): once its blob is found, and before its first tile's
loads, each program whose blob is in the GPU pool asks L2 for all its rows' words and group
scales (`ptx._prefetch_rows`, as the Triton kernel does).

The Triton kernel's int8 path's IDP4A sums (`_q2s_word_dots`) and rounding, so the twin is the
same: `moe_ref.moe_slots_ref(..., act_int8=True)`; its floats in another order: a word's sum
times its x scale plus its staged offset, a group's words added, then one product with the
group scale (groups of 32: two words; sm_90, DeepSeek-V4-Flash's tiles: 145 instructions a K
tile where a product a word took 167, `bench/studies/gluon_sass.py`). NEXT_L2 (gate_up,
`KernelChoice.next_l2`): the programs ask L2 for their pair's down weights
(`ptx._prefetch_share`) when `next_l2_at` K tiles are left, or after the loop.

What it takes (`tile` and `launch` raise otherwise): q2s matrices whose K tiles and row tiles
are whole (no masks), groups of 16 or 32 columns; `q2s_gemv` sends it no call with a delta
plane or a bias. A fitted grid (b != 3a) takes a second pass over the words for its high bits,
as the Triton kernel does.

A program computes two row tiles of R rows (gate_up: R gate rows and their R up rows; down: 2R
consecutive rows), each held as [R, W/4, 4] int32 words (four consecutive words a thread: one
16-byte load) in the kernel's blocked layout L3.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy as cp
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moetier.kernels.blob_decode import MatrixSpec
from moetier.kernels.int8_words import _q2s_word_dots
from moetier.kernels.moe_dispatch import KernelChoice
from moetier.kernels.ptx import _globaltimer, _prefetch_rows, _prefetch_share, _trace_store

# Gluon is experimental and its names move: Triton 3.6 (the H200 image) has
# `gl.thread_barrier`, `shared_memory_descriptor._reinterpret` and
# `async_copy_global_to_shared`, 3.9 (CI) `gl.barrier`, `.reinterpret` and `async_load`
_barrier = gl.thread_barrier if hasattr(gl, "thread_barrier") else gl.barrier
_async_load = cp.async_load if hasattr(cp, "async_load") else cp.async_copy_global_to_shared
_NEW_REINTERPRET: gl.constexpr = gl.constexpr(hasattr(gl.shared_memory_descriptor, "reinterpret"))


@gluon.jit
def _view(smem, dtype: gl.constexpr, shape: gl.constexpr, layout: gl.constexpr):
    """smem's bytes as dtype [shape] with layout (plain row-major layouts only)."""
    if _NEW_REINTERPRET:
        return smem.reinterpret(dtype, shape, layout)
    else:
        return smem._reinterpret(dtype, shape, layout)


@gluon.jit
def _scale_words(raw, WPG: gl.constexpr, L3: gl.constexpr):
    """Group scales of a thread's four words: raw [R, W/4] int32 holds the bytes of its 4 / WPG
    groups (E4M3); -> [R, W/4, 4] float32, one per word."""
    j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
    shift = gl.expand_dims(gl.expand_dims((j // WPG) * 8, 0), 1)  # [1, 1, 4]
    byte = (gl.expand_dims(raw, 2) >> shift) & 0xFF
    return byte.to(gl.uint8).to(gl.float8e4nv, bitcast=True).to(gl.float32)


@gluon.jit
def _e4m3_pair(raw):
    """The two E4M3 bytes in raw's low 16 bits (int32) as float32 (byte 0, byte 1): one
    conversion of the pair (`cvt.rn.f16x2.e4m3x2`), where converting each byte took a mask and
    shift to pack it first (sm_90)."""
    return gl.inline_asm_elementwise(
        """{ .reg .b16 lo, h0, h1; .reg .b32 h2;
        cvt.u16.u32 lo, $2; cvt.rn.f16x2.e4m3x2 h2, lo; mov.b32 {h0, h1}, h2;
        cvt.f32.f16 $0, h0; cvt.f32.f16 $1, h1; }""",
        "=r,=r,r", [raw], dtype=(gl.float32, gl.float32), is_pure=True, pack=1,
    )  # fmt: skip


@gluon.jit
def _tile_sum(acc, w, raw, xqm, xsm, xcm, t, NTP: gl.constexpr, WPG: gl.constexpr,
              HIGH: gl.constexpr, L3: gl.constexpr):  # fmt: skip
    """acc [R, W/4] + one K tile's products of words w [R, W/4, 4] with the staged activations
    of tile t (xqm: the four planes of int8 bytes, xsm: the scales' bits and Σq, xcm: the
    words' offsets c = x scale · -96 Σq): (x scale · r + c) · group scale per word (r:
    `moe_triton._q2s_word_dots` without its offset, called from here), a group's words summed
    before their scale (one float product a group), summed over a thread's four words. HIGH
    (the fitted grid's second pass): r · (group scale · x scale) per word, as the Triton
    kernel."""
    XL: gl.constexpr = gl.SliceLayout(0, L3)
    q0 = gl.expand_dims(xqm.index(t).load(XL), 0)
    q1 = gl.expand_dims(xqm.index(NTP + t).load(XL), 0)
    q2 = gl.expand_dims(xqm.index(2 * NTP + t).load(XL), 0)
    q3 = gl.expand_dims(xqm.index(3 * NTP + t).load(XL), 0)
    xsc = gl.expand_dims(xsm.index(t).load(XL), 0).to(gl.float32, bitcast=True)
    if HIGH:
        qs = gl.expand_dims(xsm.index(NTP + t).load(XL), 0)
        r = _q2s_word_dots(w, q0, q1, q2, q3, qs * -64, True, True)
        # a thread's four words of a row summed before they meet its sum: [R, W/4] accumulators
        return acc + gl.sum(r.to(gl.float32) * (_scale_words(raw, WPG, L3) * xsc), axis=2)
    else:
        cw = gl.expand_dims(xcm.index(t).load(XL), 0).to(gl.float32, bitcast=True)
        r = _q2s_word_dots(w, q0, q1, q2, q3, 0, False, True)
        p = r.to(gl.float32) * xsc + cw  # x scale · 32 Σ(2c - 3)q, a word
        if WPG == 2:  # two groups a thread: their words' sums, then one product each
            pa, pb = gl.split(gl.reshape(p, [p.shape[0], p.shape[1], 2, 2]))
            s0, s1 = gl.split(pa + pb)  # (the same registers in [R, W/4] layouts of their own)
            s0 = gl.convert_layout(s0, acc.type.layout)
            s1 = gl.convert_layout(s1, acc.type.layout)
            g0, g1 = _e4m3_pair(raw)
            return acc + g0 * s0 + g1 * s1
        else:
            return acc + gl.sum(p * _scale_words(raw, WPG, L3), axis=2)


@gluon.jit
def _offset_bits(xsc, qsum):
    """A word's offset x scale · -96 Σq (what maps codes 0-3 to the grid's -3, -1, 1, 3 in
    `_tile_sum`), as int32 bits for the shared int32 planes."""
    return (xsc * (qsum * -96).to(gl.float32)).to(gl.int32, bitcast=True)


@gluon.jit
def _round_words(v):
    """v [n, 16] float32 (one word of 16 columns a row) -> int8 per word exactly as
    `moe_triton._quant_store` rounds it: (the four s-planes of packed bytes, byte j of plane s
    being column 4j + s; the scales amax / 127; Σq), each [n]."""
    col = gl.arange(0, 16, layout=gl.SliceLayout(0, v.type.layout))[None, :]
    amax = gl.max(gl.abs(v), axis=1)
    inv = gl.where(amax > 0, 127.0 / gl.where(amax > 0, amax, 1.0), 0.0)
    q = gl.floor(v * inv[:, None] + 0.5).to(gl.int32)
    qb = (q & 0xFF) << ((col // 4) * 8)
    p0 = gl.sum(gl.where(col % 4 == 0, qb, 0), axis=1)
    p1 = gl.sum(gl.where(col % 4 == 1, qb, 0), axis=1)
    p2 = gl.sum(gl.where(col % 4 == 2, qb, 0), axis=1)
    p3 = gl.sum(gl.where(col % 4 == 3, qb, 0), axis=1)
    return p0, p1, p2, p3, amax / 127.0, gl.sum(q, axis=1)


@gluon.jit
def _stage_x_rounded(x_row, stride_xk, xq2, xs2, xc2, NT: gl.constexpr, NTP: gl.constexpr,
                     W: gl.constexpr, NW: gl.constexpr):  # fmt: skip
    """The NT·W words of x_row (float) rounded as `_quant_words_kernel` does, one word a thread
    at a time, into the staging buffers (xq2 [4·NTP, W]: the four planes of int8 bytes; xs2
    [2·NTP, W]: the scales' bits, then Σq; xc2 [NTP, W]: the offsets x scale · -96 Σq)."""
    LQ: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [NW, 1], [1, 0])
    SL1: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    CH: gl.constexpr = min(32 * NW, NTP * W)  # words a chunk
    xq1 = _view(xq2, gl.int32, [4, NTP * W], SL1)
    xs1 = _view(xs2, gl.int32, [2, NTP * W], SL1)
    xc1 = _view(xc2, gl.int32, [NTP * W], SL1)
    cq = gl.arange(0, 16, layout=gl.SliceLayout(0, LQ))
    for c in gl.static_range(NTP * W // CH):
        wq = c * CH + gl.arange(0, CH, layout=gl.SliceLayout(1, LQ))
        v = gl.load(x_row + (wq[:, None] * 16 + cq[None, :]) * stride_xk,
                    mask=(wq < NT * W)[:, None], other=0.0).to(gl.float32)  # fmt: skip
        p0, p1, p2, p3, xsc, qsum = _round_words(v)
        xq1.index(0).slice(c * CH, CH).store(p0)
        xq1.index(1).slice(c * CH, CH).store(p1)
        xq1.index(2).slice(c * CH, CH).store(p2)
        xq1.index(3).slice(c * CH, CH).store(p3)
        xs1.index(0).slice(c * CH, CH).store(xsc.to(gl.int32, bitcast=True))
        xs1.index(1).slice(c * CH, CH).store(qsum)
        xc1.slice(c * CH, CH).store(_offset_bits(xsc, qsum))


@gluon.jit
def _stage_x_words(xq, xs, xsum, x_idx, row_words, xq2, xs2, xc2, NT: gl.constexpr,
                   NTP: gl.constexpr, W: gl.constexpr, NW: gl.constexpr):  # fmt: skip
    """Row x_idx of int8 words already rounded (`_quant_words_kernel`'s, or h's from
    `_store_h_words`: q, scale, Σq, row_words words a row) into the staging buffers, as
    `_stage_x_rounded` fills them."""
    LF: gl.constexpr = gl.BlockedLayout([1, 4], [1, 32], [NW, 1], [1, 0])
    tf = gl.arange(0, NTP, layout=gl.SliceLayout(1, LF))
    wf = gl.arange(0, W, layout=gl.SliceLayout(0, LF))
    word = gl.expand_dims(tf * W, 1) + gl.expand_dims(wf, 0)  # [NTP, W]
    fmask = word < NT * W
    xq_row = xq + x_idx * (4 * row_words)
    for p in gl.static_range(4):
        xq2.slice(p * NTP, NTP).store(gl.load(xq_row + p * row_words + word, mask=fmask,
                                              other=0))  # fmt: skip
    xs_row = (xs + x_idx * row_words).to(gl.pointer_type(gl.int32))
    xsc_bits = gl.load(xs_row + word, mask=fmask, other=0)
    qsum = gl.load(xsum + x_idx * row_words + word, mask=fmask, other=0)
    xs2.slice(0, NTP).store(xsc_bits)
    xs2.slice(NTP, NTP).store(qsum)
    xc2.store(_offset_bits(xsc_bits.to(gl.float32, bitcast=True), qsum))


@gluon.jit
def _activation(ya, yb, ACT: gl.constexpr, limit, alpha):
    """h from a row's gate (ya) and up (yb) sums: SiLU(gate)·up (ACT 0), the same clamped (1),
    gpt-oss's clamped and biased (2), as `moe_triton._activation`."""
    if ACT == 0:
        h = ya / (1 + gl.exp(-ya)) * yb
    elif ACT == 1:
        ya = gl.minimum(ya, limit)
        yb = gl.minimum(gl.maximum(yb, -limit), limit)
        h = ya / (1 + gl.exp(-ya)) * yb
    else:
        ya = gl.minimum(ya, limit)
        yb = gl.minimum(gl.maximum(yb, -limit), limit)
        h = (yb + 1) * (ya / (1 + gl.exp(-ya * alpha)))
    return h


@gluon.jit
def _store_h_words(h, oq, osc, osum, pair, INTER, word0, R: gl.constexpr, NW: gl.constexpr):
    """h [R] (R / 16 words of a pair's h, from word word0) rounded to int8 words as
    `_round_words` does and stored for down (oq: the four planes, osc: scales, osum: Σq, INTER
    / 16 words a row), through shared memory so that a thread holds a word."""
    SL1H: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[0])
    SL2H: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
    hsm = gl.allocate_shared_memory(gl.float32, [R], layout=SL1H)
    hsm.store(h)
    _barrier()
    LH: gl.constexpr = gl.BlockedLayout([1, 16], [32, 1], [NW, 1], [1, 0])
    hv = _view(hsm, gl.float32, [R // 16, 16], SL2H).load(LH)
    p0, p1, p2, p3, hsc, hsum = _round_words(hv)
    hrow = INTER // 16
    wd = word0 + gl.arange(0, R // 16, layout=gl.SliceLayout(1, LH))
    hq_row = oq + pair * (INTER // 4)
    gl.store(hq_row + wd, p0)
    gl.store(hq_row + hrow + wd, p1)
    gl.store(hq_row + 2 * hrow + wd, p2)
    gl.store(hq_row + 3 * hrow + wd, p3)
    gl.store(osc + pair * hrow + wd, hsc)
    gl.store(osum + pair * hrow + wd, hsum)


@gluon.jit
def _q2s_gemv_gluon_kernel(
    x_ptr, stride_x, stride_xk, xq, xs, xsum, topk_ids, topk_w, pool, slot_table, slot_offsets,
    out, oq, osc, osum,
    N, INTER, row_words, row_groups, codes, scales, row_scale, aux,
    ACT: gl.constexpr, limit, alpha, IS_DOWN: gl.constexpr, TOPK: gl.constexpr,
    R: gl.constexpr, W: gl.constexpr, NT: gl.constexpr, NTP: gl.constexpr, WPG: gl.constexpr,
    RPT: gl.constexpr, TR: gl.constexpr, NW: gl.constexpr,
    PDL: gl.constexpr, STAGES: gl.constexpr, QUANT_IN: gl.constexpr, QUANT_OUT: gl.constexpr,
    NEXT_L2: gl.constexpr, NEXT_AT: gl.constexpr, next_lo, next_bytes, pool_bytes,
    PRIME: gl.constexpr,
    trace, TRACE: gl.constexpr, WAIT_FIRST: gl.constexpr = False,
    PREFETCH_L2: gl.constexpr = False,
):  # fmt: skip
    """One (pair, 2R rows) per program; see the module docstring. NT K tiles of W words (NTP: the
    next power of two). STAGES 1: the words of tile i + 1 are loaded into registers before tile
    i is decoded; 2+: they stream through a ring of STAGES tiles in shared memory (cp.async,
    STAGES - 1 tiles ahead; each thread reads back only what it copied, so no barrier). QUANT_IN
    (gate_up): the program rounds its token's row of x (x_ptr, float) to int8 words itself while
    staging it, so no launch rounds x; else it copies `_quant_words_kernel`'s words (xq, xs,
    xsum). QUANT_OUT (gate_up): h is written as int8 words (oq, osc, osum; the column-order
    plane, which only a delta reads, is not), so no launch rounds it for down; else as float
    (out). TRACE (a study, bench/timeline.py): timer stamps and SM to trace[program], as the
    Triton kernel writes them."""
    if TRACE:
        t_start = _globaltimer()
        t_pre = t_start
        t_post = t_start
    W4: gl.constexpr = W // 4
    L3: gl.constexpr = gl.BlockedLayout([RPT, 1, 4], [TR, W4, 1], [NW, 1, 1], [2, 1, 0])
    LR: gl.constexpr = gl.SliceLayout(2, L3)  # [R, W/4]
    LROW: gl.constexpr = gl.SliceLayout(1, LR)  # [R]
    pair = gl.program_id(0)
    if PDL:
        if WAIT_FIRST:  # the routing may be the previous launch's output: wait, then let go
            gdc_wait()
        gdc_launch_dependents()
    pid_n = gl.program_id(1)
    expert = gl.load(topk_ids + pair).to(gl.int32)
    slot = gl.load(slot_table + expert)
    if slot >= 0:
        slot_off = gl.load(slot_offsets + slot)
        bptr = pool + gl.multiple_of(slot_off, 256)
        wbase = (bptr + codes).to(gl.pointer_type(gl.int32))
        sbase = bptr + scales
        if PREFETCH_L2:  # this program's rows, gate_up's up rows too (blobs in the GPU pool)
            if (slot_off >= 0) & (slot_off < pool_bytes):
                first = pid_n * 2 * R if IS_DOWN else pid_n * R
                count: gl.constexpr = 2 * R if IS_DOWN else R
                _prefetch_rows(bptr, codes, scales, first, count, row_words, row_groups)
                if not IS_DOWN:
                    _prefetch_rows(bptr, codes, scales, first + INTER, count, row_words,
                                   row_groups)  # fmt: skip
        r = gl.arange(0, R, layout=LROW)
        if IS_DOWN:
            rows_a = pid_n * 2 * R + r
            rows_b = rows_a + R
        else:
            rows_a = pid_n * R + r
            rows_b = rows_a + INTER
        g = gl.arange(0, W4, layout=gl.SliceLayout(0, LR))
        j = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, L3)))
        col = gl.expand_dims(gl.expand_dims(g * 4, 0), 2) + gl.expand_dims(gl.expand_dims(j, 0), 1)
        w_at_a = wbase + gl.expand_dims(gl.expand_dims(rows_a * row_words, 1), 2) + col
        w_at_b = wbase + gl.expand_dims(gl.expand_dims(rows_b * row_words, 1), 2) + col
        # a thread's 4 / WPG group scale bytes of a row, as one int32 (WPG 1) or int16 (WPG 2)
        gcol = gl.expand_dims(g * (4 // WPG), 0)  # [1, W/4] group of each thread's first word
        s_at_a = sbase + gl.expand_dims(rows_a * row_groups, 1) + gcol
        s_at_b = sbase + gl.expand_dims(rows_b * row_groups, 1) + gcol
        SDT: gl.constexpr = gl.int32 if WPG == 1 else gl.int16
        s_at_a = s_at_a.to(gl.pointer_type(SDT))
        s_at_b = s_at_b.to(gl.pointer_type(SDT))
        # (a K tile moves each of these pointers by W / 4 of its elements)
        if STAGES > 1:
            SW: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[2, 1, 0])
            wsm_a = gl.allocate_shared_memory(gl.int32, [STAGES, R, W4, 4], layout=SW)
            wsm_b = gl.allocate_shared_memory(gl.int32, [STAGES, R, W4, 4], layout=SW)
            for s in gl.static_range(STAGES - 1):
                _async_load(wsm_a.index(s), w_at_a + min(s, NT - 1) * W)
                _async_load(wsm_b.index(s), w_at_b + min(s, NT - 1) * W)
                cp.commit_group()
            wa = gl.zeros([R, W4, 4], gl.int32, layout=L3)
            wb = wa
        else:
            wa = gl.load(w_at_a)
            wb = gl.load(w_at_b)
        sa = gl.load(s_at_a).to(gl.int32)
        sb = gl.load(s_at_b).to(gl.int32)
        if PRIME:  # tile 1 asked for now too, before the wait and the staging of x
            t1: gl.constexpr = min(1, NT - 1)
            pa = gl.load(w_at_a + t1 * W)
            pb = gl.load(w_at_b + t1 * W)
            psa = gl.load(s_at_a + t1 * W4).to(gl.int32)
            psb = gl.load(s_at_b + t1 * W4).to(gl.int32)
        a = gl.load((bptr + aux).to(gl.pointer_type(gl.float32)))
        b = gl.load((bptr + aux + 4).to(gl.pointer_type(gl.float32)))
        corr = gl.where(b == 3 * a, 0.0, b - 3 * a)
        # what the epilogue multiplies by, loaded now: loaded after the K loop, its latency
        # ended every program (H200: 1.00-1.07x the time a call, docs/benchmarks.md)
        rs = (bptr + row_scale).to(gl.pointer_type(gl.float32))
        rs_a = gl.load(rs + rows_a)
        rs_b = gl.load(rs + rows_b)
        if IS_DOWN:
            weight = gl.load(topk_w + pair).to(gl.float32)
        if TRACE:
            t_pre = _globaltimer()
        if PDL and not WAIT_FIRST:
            gdc_wait()
        if TRACE:
            t_post = _globaltimer()
        # the token's activations into shared memory: 4 planes of int8 bytes (xqm), the scales'
        # bits and Σq (xsm), the offsets x scale · -96 Σq (xcm), each NTP tiles x [W/4, 4] words
        x_idx = pair if IS_DOWN else pair // TOPK
        # (plain row-major layouts, so the [tiles, W] views that fill them and the [tiles,
        # W/4, 4] views the K loop indexes are the same bytes)
        SL: gl.constexpr = gl.SwizzledSharedLayout(vec=1, per_phase=1, max_phase=1, order=[1, 0])
        xq2 = gl.allocate_shared_memory(gl.int32, [4 * NTP, W], layout=SL)
        xs2 = gl.allocate_shared_memory(gl.int32, [2 * NTP, W], layout=SL)
        xc2 = gl.allocate_shared_memory(gl.int32, [NTP, W], layout=SL)
        if QUANT_IN:
            _stage_x_rounded(x_ptr + x_idx * stride_x, stride_xk, xq2, xs2, xc2, NT, NTP, W, NW)
        else:
            _stage_x_words(xq, xs, xsum, x_idx, row_words, xq2, xs2, xc2, NT, NTP, W, NW)
        xqm = _view(xq2, gl.int32, [4 * NTP, W4, 4], SL)
        xsm = _view(xs2, gl.int32, [2 * NTP, W4, 4], SL)
        xcm = _view(xc2, gl.int32, [NTP, W4, 4], SL)
        _barrier()
        acc_a = gl.zeros([R, W4], gl.float32, layout=LR)
        acc_b = gl.zeros([R, W4], gl.float32, layout=LR)
        T0: gl.constexpr = 1 if PRIME else 0
        if PRIME:  # tile 0 decoded while tile 1 lands; the loop goes on from tile 1
            acc_a = _tile_sum(acc_a, wa, sa, xqm, xsm, xcm, 0, NTP, WPG, False, L3)
            acc_b = _tile_sum(acc_b, wb, sb, xqm, xsm, xcm, 0, NTP, WPG, False, L3)
            wa, wb, sa, sb = pa, pb, psa, psb
        for t in range(T0, NT):
            tn = gl.minimum(t + 1, NT - 1)  # the last tile's look-ahead reloads it (no masks)
            if STAGES > 1:
                ta = gl.minimum(t + STAGES - 1, NT - 1)
                _async_load(wsm_a.index((t + STAGES - 1) % STAGES), w_at_a + ta * W)
                _async_load(wsm_b.index((t + STAGES - 1) % STAGES), w_at_b + ta * W)
                cp.commit_group()
                cp.wait_group(STAGES - 1)
                wa = wsm_a.index(t % STAGES).load(L3)
                wb = wsm_b.index(t % STAGES).load(L3)
                na, nb = wa, wb
            else:
                na = gl.load(w_at_a + tn * W)
                nb = gl.load(w_at_b + tn * W)
            nsa = gl.load(s_at_a + tn * W4)
            nsb = gl.load(s_at_b + tn * W4)
            if NEXT_L2 and NEXT_AT > 0:  # (at the loop's first tile if it has fewer left)
                if t == max(NT - NEXT_AT, T0):
                    _prefetch_share(pool, slot_offsets, slot, pool_bytes, next_lo, next_bytes)
            acc_a = _tile_sum(acc_a, wa, sa, xqm, xsm, xcm, t, NTP, WPG, False, L3)
            acc_b = _tile_sum(acc_b, wb, sb, xqm, xsm, xcm, t, NTP, WPG, False, L3)
            wa, wb = na, nb
            sa, sb = nsa.to(gl.int32), nsb.to(gl.int32)
        if NEXT_L2 and NEXT_AT == 0:
            _prefetch_share(pool, slot_offsets, slot, pool_bytes, next_lo, next_bytes)
        if STAGES > 1:  # the look-ahead's last reloads land before any shared memory is reused
            cp.wait_group(0)
        beta = gl.where(corr != 0, 0.5 * (b - a), a) / 32
        ya = gl.sum(acc_a, axis=1) * beta
        yb = gl.sum(acc_b, axis=1) * beta
        if corr != 0:  # a fitted grid: the high bits' sums, in a pass of their own
            gamma = -corr / 128
            ha = gl.zeros([R, W4], gl.float32, layout=LR)
            hb = gl.zeros([R, W4], gl.float32, layout=LR)
            for t in range(NT):
                wa = gl.load(w_at_a + t * W)
                wb = gl.load(w_at_b + t * W)
                sa = gl.load(s_at_a + t * W4).to(gl.int32)
                sb = gl.load(s_at_b + t * W4).to(gl.int32)
                ha = _tile_sum(ha, wa, sa, xqm, xsm, xcm, t, NTP, WPG, True, L3)
                hb = _tile_sum(hb, wb, sb, xqm, xsm, xcm, t, NTP, WPG, True, L3)
            ya += gl.sum(ha, axis=1) * gamma
            yb += gl.sum(hb, axis=1) * gamma
        ya = ya * rs_a
        yb = yb * rs_b
        if IS_DOWN:
            gl.store(out + pair * N + rows_a, ya * weight)
            gl.store(out + pair * N + rows_b, yb * weight)
        else:
            h = _activation(ya, yb, ACT, limit, alpha)
            if QUANT_OUT:
                _store_h_words(h, oq, osc, osum, pair, INTER, pid_n * (R // 16), R, NW)
            else:
                gl.store(out + pair * INTER + rows_a, h)
    if TRACE:
        program = gl.program_id(0) * gl.num_programs(1) + gl.program_id(1)
        _trace_store(trace, program, t_start, t_pre, t_post)


def tile(spec_k: int, group: int, choice: KernelChoice) -> tuple[int, int, int, int]:
    """(R, W, RPT, TR) of a launch whose matrix has K = spec_k, or ValueError when this kernel
    cannot run it: R = block_n / 2 rows a row tile, W = the words of the largest K tile <=
    block_k / 16 that divides K (at least 16), four words a thread along K, TR = 32 / (W / 4)
    threads along rows, RPT rows a thread."""
    kw = spec_k // 16
    wpg = group // 16
    if spec_k % 16 or wpg not in (1, 2):
        raise ValueError(f"q2s gluon GEMV: K {spec_k} with groups of {group} not supported")
    w = min(choice.block_k // 16, 128)
    while w >= 16 and kw % w:
        w //= 2
    if w < 16:
        raise ValueError(f"q2s gluon GEMV: no K tile of 16-128 words divides {kw} words")
    r = choice.block_n // 2
    tr = 32 // (w // 4)
    rpt = r // (tr * choice.num_warps)
    if rpt < 1 or rpt * tr * choice.num_warps != r or r & (r - 1):
        raise ValueError(f"q2s gluon GEMV: block_n {choice.block_n} with {choice.num_warps} "
                         f"warps and {w}-word tiles")  # fmt: skip
    return r, w, rpt, tr


def launch(
    is_down: bool,
    x: torch.Tensor,
    xwords: tuple[torch.Tensor, ...] | None,
    topk_ids: torch.Tensor,
    topk_w: torch.Tensor,
    pool: torch.Tensor,
    slot_table: torch.Tensor,
    slot_offsets: torch.Tensor,
    out: torch.Tensor,
    hwords: tuple[torch.Tensor, ...] | None,
    spec: MatrixSpec,
    inter: int,
    top_k: int,
    act: int,
    limit: float,
    alpha: float,
    choice: KernelChoice,
    pdl: bool,
    trace: torch.Tensor | None = None,
    next_l2: tuple[int, int] | None = None,
    launch_pdl: bool = True,
    wait_first: bool = False,
) -> None:
    """One launch: gate_up (h into out [P, I] float, or as int8 words into hwords (q, scale, Σq)
    when given) or down (out [P, N]). x: the launch's float input, rounded here (gate_up only)
    when xwords (`quant_words`' q, scale, Σq) is None. pdl: the program lets the next launch
    start and waits for the one before (`_q2s_gemv_gluon_kernel`'s PDL); launch_pdl (with
    pdl): the launch itself starts while the one before ends (False: the call's first launch,
    unless `moe_triton.moe_slots_triton`'s first_pdl; its wait then returns at once);
    wait_first (with pdl): the programs wait before they read anything (WAIT_FIRST)."""
    pairs = topk_ids.numel()
    r, w, rpt, tr = tile(spec.k, spec.group, choice)
    rows, per = (spec.n, 2 * r) if is_down else (inter, r)
    if rows % per:
        raise ValueError(f"q2s gluon GEMV: {rows} rows are not whole tiles of {per}")
    if is_down and (xwords is None or hwords is not None):
        raise ValueError("q2s gluon GEMV: down reads int8 words and writes float")
    if hwords is not None and r % 16:
        raise ValueError(f"q2s gluon GEMV: rows of {r} are not whole words of h to round")
    nt = spec.k // 16 // w
    wpg = spec.group // 16
    xq, xs, xsum = xwords[:3] if xwords is not None else (out, out, out)  # (unread placeholders)
    oq, osc, osum = hwords[:3] if hwords is not None else (out, out, out)
    _q2s_gemv_gluon_kernel[(pairs, rows // per)](
        x, x.stride(0), x.stride(1), xq, xs, xsum, topk_ids, topk_w, pool, slot_table,
        slot_offsets, out, oq, osc, osum,
        spec.n, inter, spec.k // 16, spec.k // spec.group, spec.codes, spec.scales,
        spec.row_scale, spec.aux, act, limit, alpha, int(is_down), top_k,
        r, w, nt, triton.next_power_of_2(nt), wpg, rpt, tr, choice.num_warps, pdl,
        max(1, choice.pipe), xwords is None, hwords is not None,
        next_l2 is not None, choice.next_l2_at, *(next_l2 or (0, 0)), pool.numel(),
        choice.prime and choice.pipe < 2,
        trace if trace is not None else topk_ids, trace is not None, pdl and wait_first,
        choice.prefetch_l2, num_warps=choice.num_warps, launch_pdl=pdl and launch_pdl,
        **({"maxnreg": choice.maxnreg} if choice.maxnreg else {}),
    )  # fmt: skip
