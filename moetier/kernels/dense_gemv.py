"""Quantized dense (non-expert) linear layers: `torch.ops.moetier.dense_linear`.

Weight kinds (docs/formats.md, "Dense formats"; quant/dense_formats.py writes them):
  fp8    weight float8_e4m3fn [N, K], scale float32 [ceil(N/bn), ceil(K/bk)] (DeepSeek-V3's
         `weight_scale_inv`): W = fp8 * scale of its bn x bk tile
  int4   weight uint8 [N, K/2] (element 2j in the low nibble, code = q + 8, q in -8..7),
         scale bfloat16 [N, K/g]: W = q * scale of its group of g along K
  nvfp4  weight uint8 [N, K/2] E2M1 codes, scale float8_e4m3fn [N, K/16], scale_2 float32 [1]:
         W = e2m1 * scale * scale_2 (ModelOpt's names)

Decode (a few rows) runs a Triton GEMV (`_dense_gemv_kernel`: W8A16 / W4A16, activations in
their dtype, fp32 accumulation, split-K over a second grid axis where N alone gives too few
programs) that reads the stored bytes once; shape-static, so it captures into the CUDA-graph
step. Prefill dequantises to the activations' dtype and runs one GEMM. `dense_linear_ref` (the
dequantised weight through F.linear) is the CPU path and the test oracle.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from moetier.kernels.moe_ref import e2m1_values, unpack_fp4

KINDS = ("fp8", "int4", "nvfp4")
NVFP4_GROUP = 16
GEMV_MAX_ROWS = 16  # rows (tokens) up to which the GEMV runs; above, dequantise + GEMM


def dense_dequant_ref(
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_2: torch.Tensor | None,
    kind: str,
    block_n: int,
    block_k: int,
) -> torch.Tensor:
    """The stored weight (module docstring) -> [N, K] float32."""
    if kind == "fp8":
        n, k = weight.shape
        full = scale.float().repeat_interleave(block_n, 0).repeat_interleave(block_k, 1)
        return weight.float() * full[:n, :k]
    if kind == "int4":
        q = unpack_fp4(weight).float() - 8.0
        return q * scale.float().repeat_interleave(block_k, dim=1)
    if kind == "nvfp4":
        values = e2m1_values(unpack_fp4(weight))
        if scale_2 is None:
            raise ValueError("nvfp4 dense weights need their scale_2")
        block = scale.float().repeat_interleave(NVFP4_GROUP, dim=1)
        return values * block * scale_2.float()
    raise ValueError(f"dense weight kind {kind!r}: one of {', '.join(KINDS)}")


def dense_linear_ref(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_2: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str,
    block_n: int,
    block_k: int,
) -> torch.Tensor:
    """x [..., K] -> [..., N]: the dequantised weight, cast to x's dtype, through F.linear (what
    the HF model of the dequantised checkpoint computes)."""
    w = dense_dequant_ref(weight, scale, scale_2, kind, block_n, block_k).to(x.dtype)
    return F.linear(x, w, None if bias is None else bias.to(x.dtype))


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _e4m3(bits):
        """uint8 E4M3 (fn) bit patterns -> float32: the 7 low bits moved into an fp16's exponent
        and mantissa fields, times 2^8 (the exponent biases differ by 8); exact for every finite
        code, subnormals included."""
        b = bits.to(tl.uint16)
        h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
        return h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0

    @triton.jit
    def _e2m1(nibble):
        """E2M1 codes 0..15 (bit 3 the sign) -> float32."""
        mag = nibble & 7
        e = (mag >> 1).to(tl.float32)
        m = (mag & 1).to(tl.float32)
        v = tl.where(e == 0.0, 0.5 * m, (1.0 + 0.5 * m) * tl.exp2(e - 1.0))
        return tl.where((nibble & 8) != 0, -v, v)

    @triton.jit
    def _dense_gemv_kernel(
        x, stride_xm, w, stride_wn, s, stride_sn, stride_sk, scale_2, out, stride_os, stride_om,
        N, K, K_SPLIT,
        KIND: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        SCALE_BN: tl.constexpr, GROUP: tl.constexpr, FP8_NATIVE: tl.constexpr,
    ):  # fmt: skip
        """out[pid_k, m, n] = sum over this program's K range of W[n, k] x[m, k] (fp32 sums,
        stored in out's dtype). KIND 0:
        fp8 (one scale per row and BLOCK_K step: GROUP, the scale tile's K, is a multiple of
        BLOCK_K); 1: int4 and 2: nvfp4 (bytes [N, K/2], a scale per GROUP elements, BLOCK_K a
        multiple of GROUP). FP8_NATIVE: w holds float8_e4m3fn, converted by the card's own
        instructions (sm_89+); else its bytes, decoded by `_e4m3`."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        nmask = rn < N
        acc = tl.zeros((BLOCK_N,), tl.float32)
        k_begin = pid_k * K_SPLIT
        k_end = tl.minimum(k_begin + K_SPLIT, K)
        xrow = x + pid_m * stride_xm
        srow = s + (rn // SCALE_BN) * stride_sn
        if KIND == 0:
            for k0 in range(k_begin, k_end, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                kmask = rk < K
                xv = tl.load(xrow + rk, mask=kmask, other=0.0).to(tl.float32)
                wmask = nmask[:, None] & kmask[None, :]
                wp = w + rn[:, None] * stride_wn + rk[None, :]
                if FP8_NATIVE:
                    wv = tl.load(wp, mask=wmask, other=0.0).to(tl.float32)
                else:
                    wv = _e4m3(tl.load(wp, mask=wmask, other=0))
                sc = tl.load(srow + (k0 // GROUP) * stride_sk, mask=nmask, other=0.0)
                acc += tl.sum(wv * xv[None, :], axis=1) * sc
        else:
            G: tl.constexpr = BLOCK_K // GROUP
            H: tl.constexpr = GROUP // 2
            g = tl.arange(0, G)
            j = tl.arange(0, H)
            e = tl.arange(0, GROUP)
            for k0 in range(k_begin, k_end, BLOCK_K):
                # x [G, GROUP] contiguous, split into its even and odd elements [G, H]; the
                # weight's bytes [BN, G, H] at contiguous offsets (one byte = elements 2j, 2j+1)
                kx = k0 + g[:, None] * GROUP + e[None, :]
                xv = tl.load(xrow + kx, mask=kx < K, other=0.0).to(tl.float32)
                xe, xo = tl.split(tl.reshape(xv, (G, H, 2)))
                kb = k0 // 2 + g[:, None] * H + j[None, :]  # [G, H] byte offsets
                kmask = 2 * kb < K
                bits = tl.load(
                    w + rn[:, None, None] * stride_wn + kb[None, :, :],
                    mask=nmask[:, None, None] & kmask[None, :, :],
                    other=0,
                )
                lo = bits & 15
                hi = bits >> 4
                if KIND == 1:
                    vl = lo.to(tl.float32) - 8.0
                    vh = hi.to(tl.float32) - 8.0
                else:
                    vl = _e2m1(lo)
                    vh = _e2m1(hi)
                part = tl.sum(vl * xe[None, :, :] + vh * xo[None, :, :], axis=2)  # [BN, G]
                sidx = k0 // GROUP + g
                smask = nmask[:, None] & (sidx[None, :] * GROUP < K)
                sv = tl.load(srow[:, None] + sidx[None, :] * stride_sk, mask=smask, other=0)
                if KIND == 1:
                    sc = sv.to(tl.float32)
                else:
                    sc = _e4m3(sv)
                acc += tl.sum(part * sc, axis=1)
            if KIND == 2:
                acc = acc * tl.load(scale_2)
        tl.store(out + pid_k * stride_os + pid_m * stride_om + rn, acc, mask=nmask)

except ImportError:  # pragma: no cover - triton is a dependency on Linux x86_64
    triton = None


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


@functools.cache
def _fp8_native(index: int) -> bool:
    """Whether the card converts E4M3 itself (sm_89+: Ada, Hopper, Blackwell)."""
    return torch.cuda.get_device_capability(index) >= (8, 9)


def gemv_supports(kind: str, block_n: int, block_k: int) -> bool:
    """Whether the Triton GEMV decodes this weight (powers of two along K; fp8 tiles any N)."""
    if triton is None or kind not in KINDS:
        return False
    if kind == "nvfp4":
        return True
    return block_k >= (1 if kind == "fp8" else 2) and block_k & (block_k - 1) == 0


def dense_gemv_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_2: torch.Tensor | None,
    kind: str,
    block_n: int,
    block_k: int,
    block_rows: int = 32,
    split_k: int | None = None,
    block_kk: int | None = None,
    num_warps: int = 4,
    fp8_native: bool | None = None,
) -> torch.Tensor:
    """x [M, K] -> [M, N] in x's dtype by the GEMV kernel (also under TRITON_INTERPRET=1 on CPU,
    for the tests). split_k: K ranges per output (default: enough programs for the device);
    block_kk: the K elements a loop step reads (default 128; fp8: at most the scale tile's K,
    int4 / nvfp4: a multiple of the group); block_rows and num_warps: the program's tile
    (`bench/studies/dense_gemv_tiles.py` sweeps them); fp8_native: E4M3 converted by the card
    (default: on sm_89+ CUDA cards, never in the interpreter)."""
    if triton is None:
        raise RuntimeError("the dense GEMV needs triton")
    x = x.contiguous()
    rows, k = x.shape
    n = weight.shape[0]
    if kind == "fp8":
        code, group, scale_rows = 0, block_k, block_n
        block_kk = min(block_kk or 128, block_k)
    else:
        group = NVFP4_GROUP if kind == "nvfp4" else block_k
        code, scale_rows = (2 if kind == "nvfp4" else 1), 1
        block_kk = max(group, block_kk or 128)
    if block_kk % group and group % block_kk:
        raise ValueError(f"block_kk {block_kk} and the scale group {group} must nest")
    n_blocks = triton.cdiv(n, block_rows)
    k_steps = triton.cdiv(k, block_kk)
    if split_k is None:
        want = 2 * _sm_count(x.device.index or 0) if x.is_cuda else 1
        split_k = max(1, min(k_steps // 4, triton.cdiv(want, rows * n_blocks)))
    split_k = max(1, min(split_k, k_steps))
    k_split = triton.cdiv(k_steps, split_k) * block_kk
    split_k = triton.cdiv(k, k_split)
    # one K range: the kernel stores in x's dtype; several: fp32 partial sums, then their sum
    dtype = x.dtype if split_k == 1 else torch.float32
    partial = torch.empty(split_k, rows, n, dtype=dtype, device=x.device)
    if fp8_native is None:
        fp8_native = x.is_cuda and _fp8_native(x.device.index or 0)
    fp8_native = fp8_native and kind == "fp8" and weight.dtype == torch.float8_e4m3fn
    w_arg = weight if fp8_native else weight.view(torch.uint8)
    scale_arg = scale.view(torch.uint8) if scale.dtype == torch.float8_e4m3fn else scale
    s2 = scale_2 if scale_2 is not None else scale  # unread unless nvfp4
    _dense_gemv_kernel[(rows, n_blocks, split_k)](
        x, x.stride(0), w_arg, weight.stride(0),
        scale_arg, scale_arg.stride(0), scale_arg.stride(1), s2,
        partial, partial.stride(0), partial.stride(1),
        n, k, k_split,
        KIND=code, BLOCK_N=block_rows, BLOCK_K=block_kk, SCALE_BN=scale_rows, GROUP=group,
        FP8_NATIVE=fp8_native, num_warps=num_warps,
    )  # fmt: skip
    return partial[0] if split_k == 1 else partial.sum(0).to(x.dtype)


@torch.library.custom_op("moetier::dense_linear", mutates_args=())
def dense_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    scale_2: torch.Tensor | None,
    bias: torch.Tensor | None,
    kind: str,
    block_n: int,
    block_k: int,
) -> torch.Tensor:
    """x [..., K] -> [..., N] through a quantized weight (module docstring): the GEMV on CUDA
    for up to GEMV_MAX_ROWS rows, else the dequantised weight in x's dtype and one GEMM."""
    rows = x.numel() // x.shape[-1]
    if x.is_cuda and rows <= GEMV_MAX_ROWS and gemv_supports(kind, block_n, block_k):
        out = dense_gemv_triton(
            x.reshape(rows, x.shape[-1]), weight, scale, scale_2, kind, block_n, block_k
        )
        if bias is not None:
            out = out + bias.to(out.dtype)
        return out.view(*x.shape[:-1], weight.shape[0])
    return dense_linear_ref(x, weight, scale, scale_2, bias, kind, block_n, block_k)


@dense_linear.register_fake
def _(x, weight, scale, scale_2, bias, kind, block_n, block_k):  # type: ignore[no-untyped-def]
    return x.new_empty(*x.shape[:-1], weight.shape[0])
