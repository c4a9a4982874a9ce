"""Triton grouped MoE kernels: experts decoded on the fly from slot-pool blobs. The entry point
`moe_slots_triton` and the generic kernel `_moe_kernel`.

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

q2s matrices have kernels of their own, which `moe_slots_triton` sends calls to: decode (below
`Q2S_GEMV_MAX_PAIRS` pairs) the q2s GEMV (`q2s_gemv.py`, or per launch its Gluon counterpart,
`q2s_gluon.py`), or, for calls of 2+ tokens that share experts (`choose_q2s_grouped`), the
GEMV grouped by expert (`q2s_gemv_grouped.py`: each distinct expert read once a call); prefill
the grouped GEMM on tensor cores (`q2s_mma.py`).
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from moetier.config import ExpertActivation
from moetier.core.layout import BlobFormat
from moetier.kernels import q2s_gemv_grouped, q2s_mma
from moetier.kernels.act_gate import act_score
from moetier.kernels.blob_decode import (
    _DOT_DTYPES,
    ACTIVATIONS,
    NONE,
    MatrixSpec,
    _activation,
    _bias,
    _bias_kind,
    _blob_ptrs,
    _decode,
    _decode_nested_full,
    _row_factor,
    matrix_spec,
    supports,
)
from moetier.kernels.moe_dispatch import (
    Q2S_GEMV_MAX_PAIRS,
    KernelChoice,
    choose,
    choose_pair,
    choose_q2s_gemv,
    choose_q2s_grouped,
    choose_q2s_mma,
)
from moetier.kernels.pair_tables import _group_pairs, _mask_bytes
from moetier.kernels.q2s_gemv import _q2s_gemv, q2s_gemv_supports


@triton.jit
def _tile_product(x, w, USE_DOT: tl.constexpr, DOT_DTYPE: tl.constexpr, PRECISION: tl.constexpr):
    """x [BLOCK_M, BLOCK_K] times w [BLOCK_N, BLOCK_K] transposed -> [BLOCK_M, BLOCK_N] fp32."""
    if USE_DOT:
        y = tl.dot(x.to(DOT_DTYPE), tl.trans(w.to(DOT_DTYPE)), input_precision=PRECISION)
    else:
        y = tl.sum(x[:, None, :] * w[None, :, :], axis=2)
    return y


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


def base_gate_up(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    slot_table: torch.Tensor,
    pool: torch.Tensor,
    slot_offsets: torch.Tensor,
    gu: MatrixSpec,
    choice: KernelChoice | None = None,
) -> torch.Tensor:
    """The base plane's gate_up of every pair whose expert has a slot: part [S, P, 2I] float32
    (split-K partials), by the generic kernel's gate_up launch (GEMV one pair a program, or the
    grouped GEMM from GEMM_MIN_PAIRS pairs), activations in float."""
    pairs = topk_ids.numel()
    top_k = topk_ids.shape[1]
    if choice is None:
        choice = choose(pairs, slot_table.shape[0], gu.n, gu.k)
    block_pairs = block_key = topk_ids  # placeholders in the GEMV mode
    blocks = pairs
    if choice.grouped:
        block_pairs, block_key = _group_pairs(
            topk_ids, None, slot_table, slot_table.shape[0], choice.block_m
        )
        blocks = block_key.shape[0]
    part = torch.empty(choice.split_k, pairs, gu.n, device=hidden.device, dtype=torch.float32)
    grid = (blocks, triton.cdiv(gu.n, choice.block_n), choice.split_k)
    _moe_kernel[grid](
        hidden, hidden.stride(0), hidden.stride(1), topk_ids, topk_weights, topk_ids,
        block_pairs, block_key, pairs,
        pool, slot_table, slot_offsets, slot_table,
        part, part, gu.n, gu.k, part.stride(0),
        gu.kind, gu.codes, gu.scales, gu.row_scale, gu.aux, gu.tensor_scale, gu.group,
        NONE, 0, 0, 0, 0, 0, 1,
        0, 0, 0, 0, 1.0, 1.0,
        0, 1, top_k,
        choice.grouped, choice.use_dot, _DOT_DTYPES[hidden.dtype],
        "ieee" if hidden.dtype == torch.float32 else "tf32",
        choice.block_m if choice.grouped else 1, choice.block_n, choice.block_k,
        num_warps=choice.num_warps, num_stages=choice.num_stages,
    )  # fmt: skip
    return part


def act_gate(
    hidden: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    slot_table: torch.Tensor,
    pool: torch.Tensor,
    slot_offsets: torch.Tensor,
    fmt: BlobFormat,
    act: ExpertActivation,
    gu: MatrixSpec,
    delta_mask: torch.Tensor,
    sketch: torch.Tensor,
    coef: torch.Tensor,
    threshold: torch.Tensor,
    choice: KernelChoice | None = None,
) -> None:
    """The gate's act term (act_gate.py): the pairs' base gate_up, then delta_mask &=
    coef · ‖sketch[e] h‖² >= threshold in place (the act branch of `moe_ref.moe_slots_ref`)."""
    topk_ids = topk_ids.contiguous()
    part = base_gate_up(
        hidden, topk_ids, topk_weights.contiguous(), slot_table, pool, slot_offsets, gu, choice
    )
    act_score(part, topk_ids, slot_table, pool, slot_offsets, fmt, act, delta_mask, sketch, coef,
              threshold)  # fmt: skip


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
    act_sketch: torch.Tensor | None = None,
    act_coef: torch.Tensor | None = None,
    act_threshold: torch.Tensor | None = None,
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
    act_sketch, act_coef, act_threshold: the gate's act term (moe_ref.moe_slots_ref): two
                  launches first narrow delta_mask in place (`act_gate.act_gate`), then the
                  call runs with that mask.
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
    if act_sketch is not None:
        if delta_mask is None or act_coef is None or act_threshold is None:
            raise ValueError("the act term needs delta_mask, act_coef and act_threshold")
        act_gate(hidden, topk_ids, topk_weights, slot_table, pool, slot_offsets, fmt, act, gu,
                 delta_mask, act_sketch, act_coef, act_threshold)  # fmt: skip
    pairs = tokens * top_k
    inter = gu.n // 2
    if choice is None:
        experts = slot_table.shape[0]
        by_expert = None
        if q2s_gemv_grouped.q2s_grouped_supports(gu, dn, dgu, ddn):
            by_expert = choose_q2s_grouped(
                tokens, top_k, experts, ((gu.n, gu.k), (dn.n, dn.k)), zero_copy
            )
        if by_expert is not None:
            choice = by_expert
        elif pairs < Q2S_GEMV_MAX_PAIRS and q2s_gemv_supports(gu, dn, dgu, ddn):
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
    if c_gu.group_pairs:
        if not q2s_gemv_grouped.q2s_grouped_supports(gu, dn, dgu, ddn):
            raise ValueError(f"the grouped q2s kernel does not run {fmt.name} (or a delta)")
        q2s_gemv_grouped.q2s_gemv_grouped(hidden, topk_ids.contiguous(),
                                          topk_weights.contiguous(), slot_table, pool,
                                          slot_offsets, fmt, act, out, gu, dn, c_gu,
                                          c_dn)  # fmt: skip
        return c_gu, c_dn
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
