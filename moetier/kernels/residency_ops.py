"""Device-side bookkeeping of the zero-copy decode path, as a torch custom op (no host sync, so
a decode step that calls it still captures into a CUDA graph):

- `moetier::count_pairs`: one MoE layer's (token, expert) pairs counted per expert (what the
  rebalance promotes by) and the GPU hits among them, in one launch (the torch version was
  about ten launches, 160 µs of a 2 ms token on the H200).

A plain-torch twin (`count_pairs_ref`) is the CPU path and the tests' reference.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _count_pairs_kernel(ids, n, counts, offsets, table, pool_bytes, gpu_pairs,
                        BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    e = tl.load(ids + i, mask=m, other=0)
    tl.atomic_add(counts + e, tl.full((BLOCK,), 1, tl.int64), mask=m)
    off = tl.load(offsets + tl.load(table + e, mask=m, other=0), mask=m, other=-1)
    on_gpu = m & (off >= 0) & (off < pool_bytes)
    tl.atomic_add(gpu_pairs, tl.sum(on_gpu.to(tl.int64), axis=0))


def count_pairs_ref(
    topk_ids: torch.Tensor,
    counts: torch.Tensor,
    table: torch.Tensor,
    offsets: torch.Tensor,
    pool_bytes: int,
    gpu_pairs: torch.Tensor,
) -> None:
    """Twin of `count_pairs` in plain torch."""
    flat = topk_ids.flatten().long()
    counts.index_add_(0, flat, torch.ones_like(flat, dtype=counts.dtype))
    off = offsets[table[flat].long()]
    gpu_pairs.add_(((off >= 0) & (off < pool_bytes)).sum().to(gpu_pairs.dtype))


@torch.library.custom_op("moetier::count_pairs", mutates_args=("counts", "gpu_pairs"))
def count_pairs(
    topk_ids: torch.Tensor,
    counts: torch.Tensor,
    table: torch.Tensor,
    offsets: torch.Tensor,
    pool_bytes: int,
    gpu_pairs: torch.Tensor,
) -> None:
    """counts [E] int64 += pairs per expert of topk_ids [T, k]; gpu_pairs [] int64 += the pairs
    whose expert's entry (table [E] -> offsets) lies in the GPU pool's [0, pool_bytes)."""
    n = topk_ids.numel()
    if not topk_ids.is_cuda and os.environ.get("TRITON_INTERPRET") != "1":
        count_pairs_ref(topk_ids, counts, table, offsets, pool_bytes, gpu_pairs)
        return
    block = min(1024, triton.next_power_of_2(max(n, 16)))
    _count_pairs_kernel[(triton.cdiv(n, block),)](
        topk_ids.contiguous(), n, counts, offsets, table, pool_bytes, gpu_pairs, BLOCK=block
    )


@count_pairs.register_fake
def _(
    topk_ids: torch.Tensor,
    counts: torch.Tensor,
    table: torch.Tensor,
    offsets: torch.Tensor,
    pool_bytes: int,
    gpu_pairs: torch.Tensor,
) -> None:
    return None
