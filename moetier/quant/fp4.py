"""FP4 (E2M1) expert formats: NVFP4 and MXFP4 (research/quant.md §2).

E2M1: 1 sign, 2 exponent, 1 mantissa bit; magnitudes (0, 0.5, 1, 1.5, 2, 3, 4, 6) for codes 0..7,
code | 8 negative. Rounding is round-to-nearest-even, saturating at ±6 (as ml_dtypes'
float4_e2m1fn cast). Codes are packed two per byte along K, the even element in the low nibble.

NVFP4: blocks of 16 along K, an E4M3 block scale, one FP32 scale per matrix (4.5 bpw):
    W = e2m1 * e4m3_scale[block] * tensor_scale,  tensor_scale = amax(W) / (6 * 448).
MXFP4 (OCP Microscaling v1.0): blocks of 32, an E8M0 power-of-two scale (4.25 bpw):
    W = e2m1 * 2^(e8m0 - 127),  e8m0 - 127 = floor(log2(amax(block))) - 2.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from moetier.kernels.moe_ref import e2m1_values, unpack_fp4

# Midpoints between consecutive magnitudes; at a tie the even code (mantissa bit 0) wins.
_MIDPOINTS = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
_TIE_GOES_UP = torch.tensor([False, True, False, True, False, True, False])
E4M3_MAX = 448.0
NVFP4_BLOCK = 16
MXFP4_BLOCK = 32


def e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """float -> 4-bit E2M1 codes (uint8 0..15), round-to-nearest-even, saturating."""
    mag = x.abs().float()
    idx = torch.bucketize(mag, _MIDPOINTS)  # first midpoint >= mag: ties land on the lower code
    at_tie = (idx < len(_MIDPOINTS)) & (mag == _MIDPOINTS[idx.clamp(max=len(_MIDPOINTS) - 1)])
    idx = idx + (at_tie & _TIE_GOES_UP[idx.clamp(max=len(_MIDPOINTS) - 1)]).long()
    sign = (x < 0).to(torch.uint8) << 3
    return idx.to(torch.uint8) | sign


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """[N, K] codes 0..15 -> [N, K // 2] uint8, element 2j in the low nibble of byte j."""
    c = codes.view(codes.shape[0], -1, 2).to(torch.uint8)
    return c[..., 0] | (c[..., 1] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    """[N, K // 2] uint8 -> [N, K] codes (the inverse of pack_nibbles)."""
    return unpack_fp4(packed)


@dataclass
class NVFP4:
    codes: torch.Tensor  # [N, K] uint8 E2M1 codes
    scales: torch.Tensor  # [N, K // 16] float8_e4m3fn
    tensor_scale: torch.Tensor  # [1] float32

    def dequantize(self) -> torch.Tensor:
        block = self.scales.float().repeat_interleave(NVFP4_BLOCK, dim=1)
        return e2m1_values(self.codes) * block * self.tensor_scale


@dataclass
class MXFP4:
    codes: torch.Tensor  # [N, K] uint8 E2M1 codes
    scales: torch.Tensor  # [N, K // 32] uint8, E8M0 (biased exponent)

    def dequantize(self) -> torch.Tensor:
        block = torch.exp2(self.scales.float() - 127).repeat_interleave(MXFP4_BLOCK, dim=1)
        return e2m1_values(self.codes) * block


def _blocks(w: torch.Tensor, size: int) -> torch.Tensor:
    if w.dim() != 2 or w.shape[1] % size:
        raise ValueError(f"FP4 needs a 2-D matrix with K divisible by {size}, got {tuple(w.shape)}")
    return w.float().view(w.shape[0], -1, size)


def quantize_nvfp4(w: torch.Tensor) -> NVFP4:
    blocks = _blocks(w, NVFP4_BLOCK)  # [N, K/16, 16]
    tensor_scale = (w.abs().amax().float() / (6 * E4M3_MAX)).clamp_min(1e-30).reshape(1)
    scale = (blocks.abs().amax(-1) / 6 / tensor_scale).clamp(max=E4M3_MAX).to(torch.float8_e4m3fn)
    denom = (scale.float() * tensor_scale)[..., None]  # [N, K/16, 1]
    scaled = torch.where(denom > 0, blocks / denom.clamp_min(1e-30), torch.zeros_like(blocks))
    return NVFP4(e2m1_codes(scaled).view_as(w), scale, tensor_scale)


def quantize_mxfp4(w: torch.Tensor) -> MXFP4:
    blocks = _blocks(w, MXFP4_BLOCK)  # [N, K/32, 32]
    amax = blocks.abs().amax(-1)
    exponent = torch.where(
        amax > 0, torch.floor(torch.log2(amax.clamp_min(1e-38))) - 2, torch.full_like(amax, -127)
    ).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent)[..., None]
    return MXFP4(e2m1_codes(scaled).view_as(w), (exponent + 127).to(torch.uint8))
