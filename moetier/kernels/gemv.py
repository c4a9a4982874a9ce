"""Dense projections of a decode step as one Triton GEMV: `torch.ops.moetier.linear`.

At batch 1-8 the q/k/v, o, router and lm_head matmuls are matrix-vector products bound by
reading the weight once; cuBLAS's kernels for those shapes read bf16 weights at ~1.7 TB/s on the
H200 (docs/benchmarks.md), a Triton GEMV that streams [BLOCK_N, BLOCK_K] tiles and keeps one
partial sum per row and token reads them near copy bandwidth. More tokens go to F.linear
(`linear_ref`, also the CPU path and the test oracle).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

# Tokens up to which the GEMV runs (each weight tile is reused for every token in registers).
GEMV_MAX_TOKENS = 8
# MOETIER_TRITON_GEMV=0 sends every call to F.linear (for A/B timing)
ENABLED = os.environ.get("MOETIER_TRITON_GEMV", "1") != "0"


def linear_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(x, weight, bias)


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _gemv_kernel(
        x, stride_xt, w, stride_wn, bias, out, stride_ot, T, N, K,
        HAS_BIAS: tl.constexpr, T_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """out[t, n] = Σ_k x[t, k] w[n, k] (+ bias[n]) for BLOCK_N rows n and every token t < T:
        each weight tile is loaded once and multiplied with the T_P (padded) token rows."""
        rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        tok = tl.arange(0, T_P)
        rmask = rows < N
        acc = tl.zeros((T_P, BLOCK_N), tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + tl.arange(0, BLOCK_K)
            kmask = cols < K
            wmask = rmask[:, None] & kmask[None, :]
            wt = tl.load(w + rows[:, None] * stride_wn + cols[None, :], mask=wmask, other=0.0)
            xmask = (tok < T)[:, None] & kmask[None, :]
            xt = tl.load(x + tok[:, None] * stride_xt + cols[None, :], mask=xmask, other=0.0)
            wt = wt.to(tl.float32)
            xt = xt.to(tl.float32)
            acc += tl.sum(xt[:, None, :] * wt[None, :, :], axis=2)
        if HAS_BIAS:
            acc += tl.load(bias + rows, mask=rmask, other=0.0).to(tl.float32)[None, :]
        tl.store(out + tok[:, None] * stride_ot + rows[None, :], acc.to(out.dtype.element_ty),
                 mask=(tok < T)[:, None] & rmask[None, :])  # fmt: skip

except ImportError:  # pragma: no cover - triton is a dependency on Linux x86_64
    triton = None


def linear_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    block: tuple[int, int] | None = None,
) -> torch.Tensor:
    """x [T, K] (T <= GEMV_MAX_TOKENS), weight [N, K] (rows contiguous) -> [T, N] in x's dtype
    (also runs on CPU under TRITON_INTERPRET=1, for the tests); block: (BLOCK_N, BLOCK_K)."""
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [T, K] and [N, K]"
        )
    tokens, k = x.shape
    n = weight.shape[0]
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    out = torch.empty(tokens, n, device=x.device, dtype=x.dtype)
    t_p = max(1, triton.next_power_of_2(tokens))
    block_n, block_k = block or (32 if n >= 2048 else 16, max(64, 256 // t_p))
    _gemv_kernel[(triton.cdiv(n, block_n),)](
        x, x.stride(0), weight, weight.stride(0), bias if bias is not None else weight, out,
        out.stride(0), tokens, n, k, bias is not None, t_p, block_n, block_k, num_warps=4,
    )  # fmt: skip
    return out


@torch.library.custom_op("moetier::linear", mutates_args=())
def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear over the last dim of x ([..., K] -> [..., N]); the Triton GEMV on CUDA when at
    most GEMV_MAX_TOKENS rows."""
    flat = x.reshape(-1, x.shape[-1])
    small = 0 < flat.shape[0] <= GEMV_MAX_TOKENS
    if not (x.is_cuda and small and ENABLED) or triton is None:
        return linear_ref(x, weight, bias)
    return linear_triton(flat, weight, bias).view(*x.shape[:-1], weight.shape[0])


@linear.register_fake
def _(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], weight.shape[0])
