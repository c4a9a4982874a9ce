"""The q2s decode GEMV: `_q2s_gemv_kernel` and its launcher `_q2s_gemv`, which
`moe_triton.moe_slots_triton` calls for q2s decode (below `Q2S_GEMV_MAX_PAIRS` pairs, matrices
`q2s_gemv_supports` takes; per launch where a config sets `gluon`, the kernel's Gluon counterpart
in `q2s_gluon.py` runs instead): int32 words of 16 codes, four row sub-tiles sharing each load of
x, gate_up applying the activation itself (gate and up rows of the same outputs in one program),
so it writes h [P, I] and no split-K partials. By default (`KernelChoice.int8_act`) its
activations are rounded to int8 per 16 columns (`int8_words._quant_words_kernel`; gate_up rounds
h itself) and each word's products are integer (IDP4A; an NVFP4 delta through PRMT + IDP4A): the
twin is `moe_slots_ref(..., act_int8=True)`. Its tile helpers are in `q2s_gemv_tiles.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from moetier.config import ExpertActivation
from moetier.core.layout import BlobFormat
from moetier.kernels.blob_decode import (
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
    _f32_at,
    _row_factor,
)
from moetier.kernels.int8_words import (
    _dequant_words,
    _q2s_word_dots,
    _quant_store,
    _quant_tile,
    _x_words,
    quant_words,
    quant_words_buffers,
)
from moetier.kernels.moe_dispatch import KernelChoice
from moetier.kernels.pair_tables import _mask_bytes
from moetier.kernels.ptx import (
    _globaltimer,
    _inline_asm,
    _prefetch_rows,
    _prefetch_share,
    _sm_at_least,
    _trace_store,
)
from moetier.kernels.q2s_gemv_tiles import (
    Q2S_ONE,
    _delta_dot,
    _fp4_delta_dot,
    _fp4_delta_loads4,
    _fp4_delta_tile,
    _fp4_delta_x,
    _group_sum,
    _q2s_group_scales4,
    _q2s_level,
    _q2s_outer,
    _q2s_words4,
    _split_sum,
    _tile_sums,
)


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


# a study (bench/studies/timeline.py): where set, (gate_up's, down's) int64 [programs, 8]
# buffers that the q2s GEMV's launches (Triton and Gluon, sm_90) write their programs' timer
# stamps to (`TRACE`)
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
