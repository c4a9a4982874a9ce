"""The 2-bit baselines q2s is measured against, as real store formats (docs/quality.md).

int2-g{G}:    naive symmetric int2, W = q · s with q in {−2, −1, 0, 1} and s = absmax / 2 of the
              group (fp16), round to nearest: the lopsided grid wastes a level on one side.
affine2-g{G}: asymmetric affine 2-bit, W = (q − z) · s with q in 0..3 and an fp16 scale and zero
              per group, the zero refined by HQQ's half-quadratic proximal steps (l_p, p = 0.7).

Both pack their codes like q2s (quant/q2s.pack_codes); int2 stores code q + 2. Bits per weight:
int2 2 + 16/G, affine2 2 + 32/G (core/layout.MatrixCodec.bits_per_weight).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Int2:
    codes: torch.Tensor  # [N, K] uint8 0..3, value code - 2
    scales: torch.Tensor  # [N, K // group] float16
    group: int

    def dequantize(self) -> torch.Tensor:
        scale = self.scales.float().repeat_interleave(self.group, dim=1)  # [N, K]
        return (self.codes.float() - 2) * scale

    @property
    def bits_per_weight(self) -> float:
        return 2 + 16 / self.group


@dataclass
class Affine2:
    codes: torch.Tensor  # [N, K] uint8 0..3
    scales: torch.Tensor  # [N, K // group] float16
    zeros: torch.Tensor  # [N, K // group] float16, in code units
    group: int

    def dequantize(self) -> torch.Tensor:
        scale = self.scales.float().repeat_interleave(self.group, dim=1)  # [N, K]
        zero = self.zeros.float().repeat_interleave(self.group, dim=1)
        return (self.codes.float() - zero) * scale

    @property
    def bits_per_weight(self) -> float:
        return 2 + 32 / self.group


def _groups(w: torch.Tensor, group: int) -> torch.Tensor:
    if w.dim() != 2 or w.shape[1] % group:
        raise ValueError(f"needs a 2-D matrix with K divisible by {group}, got {tuple(w.shape)}")
    return w.float().reshape(w.shape[0], -1, group)  # [N, G, g]


def quantize_int2(w: torch.Tensor, group: int = 32) -> Int2:
    """W [N, K] -> naive int2: per group s = fp16(absmax / 2), q = clamp(round(w / s), −2, 1)."""
    g = _groups(w, group)
    scale = (g.abs().amax(-1, keepdim=True) / 2).half()  # [N, G, 1], as stored
    safe = scale.float().clamp_min(1e-12)
    q = (g / safe).round().clamp(-2, 1)
    codes = (q + 2).to(torch.uint8).reshape(w.shape)
    return Int2(codes, scale.squeeze(-1), group)


def quantize_affine2(w: torch.Tensor, group: int = 64, iters: int = 20) -> Affine2:
    """W [N, K] -> asymmetric affine 2-bit: min-max scale (fp16), zero refined by HQQ's
    half-quadratic solver (sparse l_p error, p = 0.7, beta growing 1% a step), then fp16."""
    g = _groups(w, group)
    lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
    s = ((hi - lo) / 3).half().float()  # [N, G, 1], as stored
    # A constant group (range 0 in fp16): scale |lo|, so that code 0 with zero -sign(lo) is lo.
    s = torch.where(s > 0, s, lo.abs().half().float())
    s = torch.where(s > 0, s, torch.ones_like(s))
    s_safe = s.clamp_min(1e-12)
    z = -lo / s_safe
    beta, p = 10.0, 0.7
    for _ in range(iters):
        q = (g / s_safe + z).round().clamp(0, 3)
        err = g - (q - z) * s_safe
        pull = err.abs().clamp_min(1e-12) ** (p - 1) / beta
        shrunk = torch.sign(err) * torch.relu(err.abs() - pull)
        z = (q - (g - shrunk) / s_safe).mean(-1, keepdim=True)
        beta *= 1.01
    z = z.half()
    codes = (g / s_safe + z.float()).round().clamp(0, 3).to(torch.uint8).reshape(w.shape)
    return Affine2(codes, s.half().squeeze(-1), z.squeeze(-1), group)
