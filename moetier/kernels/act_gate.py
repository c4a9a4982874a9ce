"""The confidence gate's `act` term on CUDA (docs/gate.md): each pair's delta mask narrowed by
its base hidden activation, before the experts' own launches, without a host sync.

Two launches, fixed shapes (graph-capturable):
  base gate_up: part[s, p, :] = W_gu[e_p] · x[t_p] over K-split s, base plane only, float
                activations (the generic kernel's gate_up launch, `moe_triton._moe_kernel`)
  score:        one program per pair: h = act(Σ_s part[s, p] (+ b)), energy = ‖S[e_p] h‖² over
                the sketch's R rows, mask[p] &= coef[p] · energy >= threshold[p]
Then the call runs as any masked-delta call. The base gate_up is computed twice (here and in
the experts' kernel): the simple shape of the design; a fused kernel would score inside the
experts' gate_up. Twin: the act branch of `moe_ref.moe_slots_ref` (`act_energy_ref`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from moetier.config import ExpertActivation
from moetier.core.layout import BlobFormat
from moetier.kernels.blob_decode import (
    ACTIVATIONS,
    _activation,
    _bias,
    _bias_kind,
)


@triton.jit
def _act_score_kernel(
    part, stride_part_s, SPLIT: tl.constexpr, topk_ids, slot_table, slot_offsets, pool,
    mask, coef, threshold, sketch, stride_se, stride_sr, R, INTER,
    BIAS: tl.constexpr, in_bias, ACT: tl.constexpr, limit, alpha,
    BLOCK_R: tl.constexpr, BLOCK_I: tl.constexpr,
):  # fmt: skip
    """One pair: its mask byte narrowed in place where its expert has a slot."""
    p = tl.program_id(0)
    expert = tl.load(topk_ids + p).to(tl.int32)
    slot = tl.load(slot_table + expert)
    if slot >= 0:
        bptr = pool + tl.multiple_of(tl.load(slot_offsets + slot), 256)
        r = tl.arange(0, BLOCK_R)
        rmask = r < R
        acc = tl.zeros((BLOCK_R,), tl.float32)
        for i0 in range(0, INTER, BLOCK_I):
            cols = i0 + tl.arange(0, BLOCK_I)
            cmask = cols < INTER
            g = tl.zeros((BLOCK_I,), tl.float32)
            u = tl.zeros((BLOCK_I,), tl.float32)
            for s in range(SPLIT):
                base = part + s * stride_part_s + p * (2 * INTER)
                g += tl.load(base + cols, mask=cmask, other=0.0)
                u += tl.load(base + INTER + cols, mask=cmask, other=0.0)
            if BIAS > 0:
                g += _bias(bptr, BIAS, in_bias, cols, cmask)
                u += _bias(bptr, BIAS, in_bias, INTER + cols, cmask)
            h = tl.where(cmask, _activation(g, u, ACT, limit, alpha), 0.0)
            at = sketch + expert.to(tl.int64) * stride_se + r[:, None] * stride_sr + cols[None, :]
            s_tile = tl.load(at, mask=rmask[:, None] & cmask[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(s_tile * h[None, :], axis=1)
        energy = tl.sum(acc * acc, axis=0)
        keep = tl.load(coef + p) * energy >= tl.load(threshold + p)
        old = tl.load(mask + p)
        tl.store(mask + p, tl.where(keep, old, 0).to(old.dtype))


def act_score(
    part: torch.Tensor,
    topk_ids: torch.Tensor,
    slot_table: torch.Tensor,
    pool: torch.Tensor,
    slot_offsets: torch.Tensor,
    fmt: BlobFormat,
    act: ExpertActivation,
    delta_mask: torch.Tensor,
    sketch: torch.Tensor,
    coef: torch.Tensor,
    threshold: torch.Tensor,
) -> None:
    """delta_mask [T, k] (bool or uint8) &= coef · ‖sketch[e] h‖² >= threshold for every pair
    whose expert has a slot, in place; part [S, P, 2I] float32: the pairs' base gate_up (split-K
    partials, `moe_triton.base_gate_up`)."""
    work = delta_mask if delta_mask.is_contiguous() else delta_mask.contiguous()
    mask_bytes = work.view(torch.uint8) if work.dtype == torch.bool else work
    sketch = sketch.float().contiguous()
    rank, inter = sketch.shape[1], sketch.shape[2]
    if inter != part.shape[2] // 2:
        raise ValueError(
            f"the act sketch is [E, R, {inter}], the experts' hidden is {part.shape[2] // 2}"
        )
    bias, in_bias, _ = _bias_kind(fmt)
    _act_score_kernel[(topk_ids.numel(),)](
        part, part.stride(0), part.shape[0], topk_ids, slot_table, slot_offsets, pool,
        mask_bytes, coef.float().contiguous(), threshold.float().contiguous(), sketch,
        sketch.stride(0), sketch.stride(1), rank, inter,
        bias, in_bias, ACTIVATIONS[act.kind], act.limit, act.alpha,
        BLOCK_R=triton.next_power_of_2(max(rank, 1)),
        BLOCK_I=min(128, triton.next_power_of_2(inter)),
    )  # fmt: skip
    if work is not delta_mask:
        delta_mask.copy_(work)
