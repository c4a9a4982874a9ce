"""A prefill's attention over a mask as one opaque op: `torch.ops.moetier.masked_attention`.

PyTorch's SDPA on the backends a prefill may use (PREFILL_SDPA_BACKENDS), wrapped as a custom
op so that a compiled prefill (engine/runner.py's `compile_prefill`) calls the same kernel an
eager one does: torch.compile traces no backend switch and no SDPA lowering of symbolic shapes
(the query and key counts of a prefill vary with every prompt), it calls this op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

# The SDPA backends of a prefill's attention (rows of more than one query, over a mask: the
# engine's packed steps, the static prefill): not cuDNN's. Recent PyTorch puts cuDNN's SDPA first
# on Hopper and Blackwell (sdp_utils.cpp's check_prefer_cudnn_attention: sm90 / sm100 with cuDNN
# > 9.15), and cuDNN builds an execution plan for each new shape (query length, key length), tens
# of milliseconds each (55-70 ms a shape on SM100: flashinfer-ai/flashinfer#5245). A prefill
# step's shape is nearly always new (its chunk and its context, the cached prefix + the chunk,
# vary with every prompt), so a warm agent turn would pay a plan for milliseconds of attention.
# #42's H100 figures at 8c63926 fit that (inferred, not profiled there yet): 21 ms for 800 tokens
# of the warm-up's shape, 60-110 ms for ~800 new tokens over any cached prefix, 1K to 7K.
# Memory-efficient attention takes the mask with no per-shape plan; CPU runs as before.
PREFILL_SDPA_BACKENDS = [
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]


@torch.library.custom_op("moetier::masked_attention", mutates_args=())
def masked_attention_op(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    """SDPA of q [B, h, T, D] over keys [B, h, Lk, D] and values [B, h, Lk, Dv] where mask
    [B, 1, T, Lk] (bool) allows, on PREFILL_SDPA_BACKENDS -> [B, T, h, Dv], contiguous (the
    layout the o_proj reads; the memory-efficient kernel writes it so, no copy)."""
    with sdpa_kernel(PREFILL_SDPA_BACKENDS):
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).contiguous()


@masked_attention_op.register_fake
def _(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float
) -> torch.Tensor:
    batch, heads, tokens, _ = q.shape
    return q.new_empty(batch, tokens, heads, values.shape[-1])
