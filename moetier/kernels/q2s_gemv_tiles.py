"""The q2s GEMV kernel's (`q2s_gemv._q2s_gemv_kernel`) tile helpers: a K tile's code words and
group scales for its four row sub-tiles (`_q2s_words4`, `_q2s_group_scales4`), the float path's
levels (`_q2s_level`, `_q2s_outer`), the int8 path's sums per word or group (`_tile_sums`), an
additive delta's tile (`_delta_dot`, or an NVFP4 delta's words by PRMT + IDP4A: `_fp4_delta_*`)
and split-K's meeting of partial sums (`_split_sum`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from moetier.kernels.blob_decode import _decode, _e4m3
from moetier.kernels.int8_words import _fp4_word_dot, _q2s_word_dots

Q2S_ONE = 0x3F800000  # bits of 1.0f (see _q2s_level)


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
def _q2s_words(wbase, rows, rmask, wd, wmask, row_words, EVEN: tl.constexpr):
    """Words wd of rows `rows`: [SUB, W] int32 (EVEN: whole tiles, no mask)."""
    at = wbase + rows[:, None] * row_words + wd[None, :]
    if EVEN:
        return tl.load(at)
    return tl.load(at, mask=rmask[:, None] & wmask[None, :], other=0)


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
