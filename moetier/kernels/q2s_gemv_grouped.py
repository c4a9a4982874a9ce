"""The q2s decode GEMV grouped by expert: a step's (token, expert) pairs sorted by expert on the
GPU (`_group_kernel`: groups of up to BLOCK_T pairs of one expert) and one program per (group,
row tile) that reads its expert's weight tile ONCE and applies it to every pair of the group
(`_q2s_grouped_kernel`), so each distinct expert of a step is read once (an expert with more
than BLOCK_T pairs: once per group) from wherever its slot lies (GPU pool or a pinned host row
read zero-copy, as `slot_offsets` says). Same numerics as the per-pair kernel
(`q2s_gemv._q2s_gemv_kernel` with int8 activations: IDP4A per word, the same sums per pair);
twin `moe_slots_ref(..., act_int8=True)`. No delta plane (the dispatcher keeps the per-pair
kernel for calls with one); CUDA-graph capturable (fixed grids and buffers, no host sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetier.config import ExpertActivation
from moetier.core.layout import BlobFormat
from moetier.kernels.blob_decode import (
    ACTIVATIONS,
    MatrixSpec,
    _activation,
    _bias,
    _bias_kind,
    _f32_at,
    _row_factor,
)
from moetier.kernels.int8_words import _q2s_word_dots, quant_words, quant_words_buffers
from moetier.kernels.moe_dispatch import KernelChoice
from moetier.kernels.ptx import _inline_asm
from moetier.kernels.q2s_gemv import q2s_gemv_supports
from moetier.kernels.q2s_gemv_tiles import _q2s_group_scales4, _q2s_words4

_NO_SLOT = tl.constexpr(1 << 20)  # sort key of pairs whose expert has no slot (after every expert)


@triton.jit
def _run_start(k1, s1, k2, s2):
    """Combine of a scan over sorted keys: (key, first position of the key's run)."""
    return k2, tl.where(k1 == k2, s1, s2)


@triton.jit
def _group_kernel(topk_ids, slot_table, groups, P, n_entries, P2: tl.constexpr,
                  BT: tl.constexpr, FILL: tl.constexpr):  # fmt: skip
    """One program: groups [G, BT] int32 <- the call's pairs grouped by expert, BT at most a
    group, in expert order (pair order within an expert), -1 where a group has fewer or none;
    pairs whose expert has no slot are in no group. The pairs are sorted by (expert, pair)
    (`tl.sort`); a pair's rank in its expert's run (a segmented scan) gives its place in its
    group, the count of group leaders up to it (rank % BT == 0) its group."""
    for i0 in range(0, n_entries, FILL):
        at = i0 + tl.arange(0, FILL)
        tl.store(groups + at, tl.full((FILL,), -1, tl.int32), mask=at < n_entries)
    tl.debug_barrier()  # the -1s before the pairs (one program: its threads' stores in order)
    i = tl.arange(0, P2)
    valid = i < P
    e = tl.load(topk_ids + i, mask=valid, other=0).to(tl.int32)
    slot = tl.load(slot_table + e, mask=valid, other=-1)
    key = tl.where(valid & (slot >= 0), e, _NO_SLOT)
    s = tl.sort(key * P2 + i)
    ks = s // P2
    pos = tl.arange(0, P2)
    _, start = tl.associative_scan((ks, pos), 0, _run_start)
    rank = pos - start
    gid = tl.cumsum((rank % BT == 0).to(tl.int32), 0) - 1
    tl.store(groups + gid * BT + rank % BT, s % P2, mask=ks < _NO_SLOT)


@triton.jit
def _x_rows(xq, xs, xsum, x_idx, row_words, wd, wmask, EVEN: tl.constexpr):
    """Words wd of the int8 activation rows x_idx [BT] (`_quant_words_kernel`'s layout): the
    four s-planes, the scales and Σq, each [BT, 1, W]."""
    q_at = xq + x_idx[:, None] * (4 * row_words) + wd[None, :]
    s_at = x_idx[:, None] * row_words + wd[None, :]
    if EVEN:
        q0 = tl.load(q_at)
        q1 = tl.load(q_at + row_words)
        q2 = tl.load(q_at + 2 * row_words)
        q3 = tl.load(q_at + 3 * row_words)
        xsc = tl.load(xs + s_at)
        qs = tl.load(xsum + s_at)
    else:
        m = wmask[None, :]
        q0 = tl.load(q_at, mask=m, other=0)
        q1 = tl.load(q_at + row_words, mask=m, other=0)
        q2 = tl.load(q_at + 2 * row_words, mask=m, other=0)
        q3 = tl.load(q_at + 3 * row_words, mask=m, other=0)
        xsc = tl.load(xs + s_at, mask=m, other=0.0)
        qs = tl.load(xsum + s_at, mask=m, other=0)
    return (q0[:, None, :], q1[:, None, :], q2[:, None, :], q3[:, None, :], xsc[:, None, :],
            qs[:, None, :])  # fmt: skip


@triton.jit
def _member_sums(acc, w, sc, q0, q1, q2, q3, xsc, qs, HIGH: tl.constexpr, GSUM: tl.constexpr,
                 WPG: tl.constexpr, ASM: tl.constexpr):  # fmt: skip
    """acc [BT, SUB, W or W / WPG] plus one K tile of one sub-tile's words w [SUB, W] (group
    scales sc) against every member's int8 words ([BT, 1, W] each): the per-pair kernel's
    `_tile_sums` for BT pairs at once (R, or RH with HIGH, times the x and group scales)."""
    BT: tl.constexpr = q0.shape[0]
    shape: tl.constexpr = (BT, w.shape[0], w.shape[1])
    wb = tl.broadcast_to(w[None, :, :], shape)
    if HIGH:
        init = qs * -64
    else:
        init = qs * -96  # R = 64C - 96Σq = 32(2C - 3Σq)
    r = _q2s_word_dots(wb, q0, q1, q2, q3, tl.broadcast_to(init, shape), HIGH, ASM)
    if GSUM:
        rx = tl.reshape(r.to(tl.float32) * xsc, (BT, shape[1], shape[2] // WPG, WPG))
        t = tl.sum(rx, axis=3) * sc[None, :, :]
    else:
        t = r.to(tl.float32) * (sc[None, :, :] * xsc)
    return acc + t


@triton.jit
def _quant_rows(v, wd, KW, rows, oq, osc, osum, mask):
    """v [BT, NW, 16] (words wd [NW] of rows `rows` [BT] of KW words) rounded to int8 per word
    and stored as `int8_words._quant_store` stores one row (xq, scales, Σq; no column-order
    plane: nothing reads it without a delta)."""
    BT: tl.constexpr = v.shape[0]
    NW: tl.constexpr = v.shape[1]
    col = tl.arange(0, 16)[None, None, :]
    amax = tl.max(tl.abs(v), axis=2)
    inv = tl.where(amax > 0, 127.0 / tl.where(amax > 0, amax, 1.0), 0.0)
    q = tl.floor(v * inv[:, :, None] + 0.5).to(tl.int32)
    qb = (q & 0xFF) << ((col // 4) * 8)  # column 4j + s -> byte j of int32 s
    packed = tl.sum(tl.reshape(qb, (BT, NW, 4, 4)), axis=2)  # [BT, NW, 4 (s)]
    s_idx = tl.arange(0, 4)[None, None, :]
    q_at = oq + rows[:, None, None] * (4 * KW) + s_idx * KW + wd[None, :, None]
    tl.store(q_at, packed, mask=mask[:, :, None])
    at = rows[:, None] * KW + wd[None, :]
    tl.store(osc + at, amax / 127.0, mask=mask)
    tl.store(osum + at, tl.sum(q, axis=2), mask=mask)


@triton.jit
def _q2s_grouped_kernel(
    groups, topk_ids, topk_w, pool, slot_table, slot_offsets, out,
    N, K, INTER, row_words, row_groups,
    codes, scales, row_scale, aux, GROUP: tl.constexpr,
    BIAS: tl.constexpr, in_bias, out_bias, ACT: tl.constexpr, limit, alpha,
    IS_DOWN: tl.constexpr, TOPK: tl.constexpr, SUB: tl.constexpr, BLOCK_K: tl.constexpr,
    BT: tl.constexpr, xq, xs, xsum, ASM: tl.constexpr,
    oq, osc, osum, QUANT_OUT: tl.constexpr, EVEN: tl.constexpr, GROUP_ACC: tl.constexpr,
):  # fmt: skip
    """One (group of pairs of one expert, row tile) per program: four row sub-tiles of SUB rows
    as `_q2s_gemv_kernel` lays them out (gate_up: gate rows r, r + SUB and the matching up rows,
    the activation applied here; down: four consecutive row blocks), each K tile's words and
    group scales loaded once and multiplied by the int8 activation words of the group's BT
    members ([BT, SUB, W] IDP4A products; a member slot without a pair (-1) computes the
    leader's rows again and stores nothing). Per pair the sums are the per-pair kernel's:
    R·(s·xs) per word (or per group with GROUP_ACC), then β/32 Σ R + γ/64 Σ RH (a fitted grid's
    high bits in a second pass over K), times the row factor.
    gate_up writes h[p, r] (QUANT_OUT: as int8 words for down, SUB a multiple of 16); down
    writes out[p, n] = w_p · (W h_p + b).
    EVEN: K a multiple of BLOCK_K and the rows a multiple of the program's (no masks)."""
    g = tl.program_id(0)
    pid_n = tl.program_id(1)
    lead = tl.load(groups + g * BT)
    if lead >= 0:
        members = tl.load(groups + g * BT + tl.arange(0, BT))
        ok = members >= 0
        pairs = tl.where(ok, members, lead)  # (empty member slots: the leader's addresses)
        expert = tl.load(topk_ids + lead).to(tl.int32)
        slot = tl.load(slot_table + expert)
        bptr = pool + tl.multiple_of(tl.load(slot_offsets + slot), 256)
        wbase = (bptr + codes).to(tl.pointer_type(tl.int32))
        a = _f32_at(bptr, aux)
        b = _f32_at(bptr, aux + 4)
        corr = tl.where(b == 3 * a, 0.0, b - 3 * a)  # (see `_q2s_gemv_kernel`)
        W: tl.constexpr = BLOCK_K // 16
        WPG: tl.constexpr = GROUP // 16
        GSUM: tl.constexpr = GROUP_ACC and WPG >= 2
        AW: tl.constexpr = W // WPG if GSUM else W
        r = tl.arange(0, SUB)
        if IS_DOWN:
            rows0 = pid_n * 4 * SUB + r
            rows1 = rows0 + SUB
            rows2 = rows0 + 2 * SUB
            rows3 = rows0 + 3 * SUB
            m0, m1, m2, m3 = rows0 < N, rows1 < N, rows2 < N, rows3 < N
            x_idx = pairs
        else:
            rows0 = pid_n * 2 * SUB + r
            rows1 = rows0 + SUB
            rows2 = rows0 + INTER
            rows3 = rows1 + INTER
            m0, m1 = rows0 < INTER, rows1 < INTER
            m2, m3 = m0, m1
            x_idx = pairs // TOPK
        acc0 = tl.zeros((BT, SUB, AW), tl.float32)
        acc1 = tl.zeros((BT, SUB, AW), tl.float32)
        acc2 = tl.zeros((BT, SUB, AW), tl.float32)
        acc3 = tl.zeros((BT, SUB, AW), tl.float32)
        rf0 = _row_factor(bptr, 3, row_scale, 0, rows0, m0)
        rf1 = _row_factor(bptr, 3, row_scale, 0, rows1, m1)
        rf2 = _row_factor(bptr, 3, row_scale, 0, rows2, m2)
        rf3 = _row_factor(bptr, 3, row_scale, 0, rows3, m3)
        wd = tl.arange(0, W)
        wmask = wd < row_words
        # the words of K tile i + 1 are loaded before tile i is multiplied (as the per-pair
        # kernel's DEPTH 1)
        w0, w1, w2, w3 = _q2s_words4(wbase, rows0, rows1, rows2, rows3, m0, m1, m2, m3, wd,
                                     wmask, row_words, EVEN)  # fmt: skip
        for k0 in range(0, K, BLOCK_K):
            pref = wd + W
            pmask = pref < row_words
            if EVEN:  # the last tile's prefetch reloads it (no masks)
                pref = tl.multiple_of(tl.minimum(k0 + BLOCK_K, K - BLOCK_K) // 16,
                                      W) + tl.arange(0, W)  # fmt: skip
            n0, n1, n2, n3 = _q2s_words4(wbase, rows0, rows1, rows2, rows3, m0, m1, m2, m3,
                                         pref, pmask, row_words, EVEN)  # fmt: skip
            sc0, sc1, sc2, sc3 = _q2s_group_scales4(bptr, scales, rows0, rows1, rows2, rows3,
                                                    m0, m1, m2, m3, k0, row_groups, GROUP, W,
                                                    EVEN, GSUM)  # fmt: skip
            q0, q1, q2, q3, xsc, qs = _x_rows(xq, xs, xsum, x_idx, row_words, wd, wmask, EVEN)
            acc0 = _member_sums(acc0, w0, sc0, q0, q1, q2, q3, xsc, qs, False, GSUM, WPG, ASM)
            acc1 = _member_sums(acc1, w1, sc1, q0, q1, q2, q3, xsc, qs, False, GSUM, WPG, ASM)
            acc2 = _member_sums(acc2, w2, sc2, q0, q1, q2, q3, xsc, qs, False, GSUM, WPG, ASM)
            acc3 = _member_sums(acc3, w3, sc3, q0, q1, q2, q3, xsc, qs, False, GSUM, WPG, ASM)
            w0, w1, w2, w3 = n0, n1, n2, n3
            wd = wd + W
            wmask = wd < row_words
        # β/32 and γ/64 (`_q2s_gemv_kernel`); β = a exactly when b = 3a
        beta = tl.where(corr != 0, 0.5 * (b - a), a) / 32
        gamma = -corr / 128
        y0 = tl.sum(beta * acc0, axis=2)  # [BT, SUB]
        y1 = tl.sum(beta * acc1, axis=2)
        y2 = tl.sum(beta * acc2, axis=2)
        y3 = tl.sum(beta * acc3, axis=2)
        if corr != 0:  # a fitted grid: the high bits' sums, in a pass of their own
            av0 = tl.zeros((BT, SUB, AW), tl.float32)
            av1 = tl.zeros((BT, SUB, AW), tl.float32)
            av2 = tl.zeros((BT, SUB, AW), tl.float32)
            av3 = tl.zeros((BT, SUB, AW), tl.float32)
            for k0 in range(0, K, BLOCK_K):
                wd = tl.multiple_of(k0 // 16, W) + tl.arange(0, W)
                wmask = wd < row_words
                w0, w1, w2, w3 = _q2s_words4(wbase, rows0, rows1, rows2, rows3, m0, m1, m2, m3,
                                             wd, wmask, row_words, EVEN)  # fmt: skip
                sc0, sc1, sc2, sc3 = _q2s_group_scales4(
                    bptr, scales, rows0, rows1, rows2, rows3, m0, m1, m2, m3, k0, row_groups,
                    GROUP, W, EVEN, GSUM)  # fmt: skip
                q0, q1, q2, q3, xsc, qs = _x_rows(xq, xs, xsum, x_idx, row_words, wd, wmask,
                                                  EVEN)  # fmt: skip
                av0 = _member_sums(av0, w0, sc0, q0, q1, q2, q3, xsc, qs, True, GSUM, WPG, ASM)
                av1 = _member_sums(av1, w1, sc1, q0, q1, q2, q3, xsc, qs, True, GSUM, WPG, ASM)
                av2 = _member_sums(av2, w2, sc2, q0, q1, q2, q3, xsc, qs, True, GSUM, WPG, ASM)
                av3 = _member_sums(av3, w3, sc3, q0, q1, q2, q3, xsc, qs, True, GSUM, WPG, ASM)
            y0 += tl.sum(gamma * av0, axis=2)
            y1 += tl.sum(gamma * av1, axis=2)
            y2 += tl.sum(gamma * av2, axis=2)
            y3 += tl.sum(gamma * av3, axis=2)
        z0 = y0 * rf0[None, :]
        z1 = y1 * rf1[None, :]
        z2 = y2 * rf2[None, :]
        z3 = y3 * rf3[None, :]
        if BIAS > 0:
            bias_at = out_bias if IS_DOWN else in_bias
            z0 += _bias(bptr, BIAS, bias_at, rows0, m0)[None, :]
            z1 += _bias(bptr, BIAS, bias_at, rows1, m1)[None, :]
            z2 += _bias(bptr, BIAS, bias_at, rows2, m2)[None, :]
            z3 += _bias(bptr, BIAS, bias_at, rows3, m3)[None, :]
        okc = ok[:, None]
        if IS_DOWN:
            weight = tl.load(topk_w + pairs).to(tl.float32)[:, None]
            at = out + pairs[:, None] * N
            tl.store(at + rows0[None, :], z0 * weight, mask=okc & m0[None, :])
            tl.store(at + rows1[None, :], z1 * weight, mask=okc & m1[None, :])
            tl.store(at + rows2[None, :], z2 * weight, mask=okc & m2[None, :])
            tl.store(at + rows3[None, :], z3 * weight, mask=okc & m3[None, :])
        else:
            h0 = _activation(z0, z2, ACT, limit, alpha)
            h1 = _activation(z1, z3, ACT, limit, alpha)
            if QUANT_OUT:  # h rounded to int8 words here, for down (SUB % 16 == 0)
                HW: tl.constexpr = SUB // 16
                word0 = pid_n * 2 * HW + tl.arange(0, HW)
                hrow = INTER // 16
                _quant_rows(tl.reshape(h0, (BT, HW, 16)), word0, hrow, pairs, oq, osc, osum,
                            okc & (word0 < hrow)[None, :])  # fmt: skip
                _quant_rows(tl.reshape(h1, (BT, HW, 16)), word0 + HW, hrow, pairs, oq, osc,
                            osum, okc & (word0 + HW < hrow)[None, :])  # fmt: skip
            else:
                at = out + pairs[:, None] * INTER
                tl.store(at + rows0[None, :], h0, mask=okc & m0[None, :])
                tl.store(at + rows1[None, :], h1, mask=okc & m1[None, :])


def q2s_grouped_supports(
    gu: MatrixSpec, dn: MatrixSpec, dgu: MatrixSpec | None, ddn: MatrixSpec | None
) -> bool:
    """Whether `q2s_gemv_grouped` runs this call: what the per-pair kernel runs, without a
    delta plane."""
    return dgu is None and ddn is None and q2s_gemv_supports(gu, dn, None, None)


def max_groups(pairs: int, experts: int, block_t: int) -> int:
    """Groups a call of `pairs` pairs over `experts` experts can make, BLOCK_T pairs at most a
    group: Σ_e ceil(c_e / BT) <= D + (P - D) // BT <= min(P, E) + P // BT, and <= P."""
    return min(pairs, min(pairs, experts) + pairs // block_t)


def group_pairs(topk_ids: torch.Tensor, slot_table: torch.Tensor, block_t: int) -> torch.Tensor:
    """groups [G, BLOCK_T] int32 (`_group_kernel`; G = `max_groups`): one launch, on the GPU."""
    pairs = topk_ids.numel()
    n_groups = max_groups(pairs, slot_table.shape[0], block_t)
    groups = torch.empty(n_groups, block_t, device=topk_ids.device, dtype=torch.int32)
    p2 = max(16, triton.next_power_of_2(pairs))
    _group_kernel[(1,)](
        topk_ids, slot_table, groups, pairs, groups.numel(), p2, block_t,
        min(1024, triton.next_power_of_2(groups.numel())),
        num_warps=4 if p2 <= 128 else 8,
    )  # fmt: skip
    return groups


def q2s_gemv_grouped(
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
    c_gu: KernelChoice,
    c_dn: KernelChoice,
) -> None:
    """The call's pairs grouped by expert (one launch), x rounded to int8 words (one launch),
    then gate_up (+ activation, h rounded to int8 words where its sub-tiles hold whole words,
    else a launch rounding h) and down, one program per (group, row tile); BLOCK_T is gate_up's
    `group_pairs` (both launches walk the same groups)."""
    tokens, top_k = topk_ids.shape
    pairs = tokens * top_k
    inter = gu.n // 2
    block_t = c_gu.group_pairs
    if block_t < 1 or block_t & (block_t - 1):
        raise ValueError(f"group_pairs must be a power of two, not {block_t}")
    bias, in_bias, out_bias = _bias_kind(fmt)
    groups = group_pairs(topk_ids, slot_table, block_t)
    n_groups = groups.shape[0]
    sub_gu = max(1, c_gu.block_n // 4)
    quant_out = sub_gu % 16 == 0 and inter % 16 == 0
    hq = quant_words_buffers(pairs, inter, hidden.device) if quant_out else None
    h = hq[1] if hq is not None else torch.empty(pairs, inter, device=hidden.device)
    for is_down, spec, c, x, dst in ((0, gu, c_gu, hidden, h), (1, dn, c_dn, h, out)):
        sub = max(1, c.block_n // 4)
        block_k = max(spec.group, min(c.block_k, max(16, triton.next_power_of_2(spec.k))))
        rows = spec.n if is_down else inter
        tile_rows = (4 if is_down else 2) * sub
        even = spec.k % block_k == 0 and rows % tile_rows == 0
        if is_down and hq is not None:
            xq, xs, xsum, _ = hq
        else:
            xq, xs, xsum, _ = quant_words(x)
        oq, osc, osum = (hq[0], hq[1], hq[2]) if hq is not None and not is_down else (x, x, x)
        grid = (n_groups, triton.cdiv(rows, tile_rows))
        _q2s_grouped_kernel[grid](
            groups, topk_ids, topk_w, pool, slot_table, slot_offsets, dst,
            spec.n, spec.k, inter, spec.k // 16, spec.k // spec.group,
            spec.codes, spec.scales, spec.row_scale, spec.aux, spec.group,
            bias, in_bias, out_bias, ACTIVATIONS[act.kind], act.limit, act.alpha,
            is_down, top_k, sub, block_k, block_t, xq, xs, xsum, _inline_asm(),
            oq, osc, osum, quant_out and not is_down, even, c.group_acc,
            num_warps=c.num_warps, num_stages=c.num_stages,
        )  # fmt: skip
