"""Tables over a call's (token, k) pairs that the launches read, made on the GPU without a host
sync: the pairs grouped per (expert, delta flag) into blocks of BLOCK_M rows (`_group_pairs`:
the generic kernel's GEMM mode and the q2s prefill kernel) and the delta mask as bytes
(`_mask_bytes`).
"""

from __future__ import annotations

import torch


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


def _mask_bytes(mask: torch.Tensor) -> torch.Tensor:
    """The delta mask as uint8 bytes; a contiguous bool mask is viewed as them (no launch)."""
    if mask.dtype == torch.bool and mask.is_contiguous():
        return mask.view(torch.uint8)
    return mask.contiguous().to(torch.uint8)
