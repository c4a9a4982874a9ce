"""E2M1 / NVFP4 / MXFP4 against ml_dtypes and the published rules."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import torch

from moetier.kernels.moe_ref import dequant_fp4_ref
from moetier.quant.fp4 import (
    e2m1_codes,
    e2m1_values,
    pack_nibbles,
    quantize_mxfp4,
    quantize_nvfp4,
    unpack_nibbles,
)


def test_e2m1_rounding_matches_ml_dtypes():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.5, 100.0, 1e-3])
    x = torch.cat([torch.randn(50_000) * 3, ties, -ties])
    ref = x.numpy().astype(ml_dtypes.float4_e2m1fn)
    assert torch.equal(e2m1_values(e2m1_codes(x)), torch.from_numpy(ref.astype(np.float32)))
    nonzero = torch.from_numpy(ref.astype(np.float32)) != 0  # ml_dtypes may keep -0 as code 8
    assert torch.equal(e2m1_codes(x)[nonzero], torch.from_numpy(ref.view(np.uint8))[nonzero])


def test_nibble_packing_layout():
    codes = torch.randint(0, 16, (3, 8), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert torch.equal(packed[:, 0], codes[:, 0] | (codes[:, 1] << 4))
    assert torch.equal(unpack_nibbles(packed), codes)


def test_nvfp4_follows_the_rules():
    w = torch.randn(32, 64) * 0.05
    q = quantize_nvfp4(w)
    assert q.scales.dtype == torch.float8_e4m3fn and q.scales.shape == (32, 4)  # blocks of 16
    assert q.tensor_scale.item() == pytest.approx(w.abs().max().item() / (6 * 448))
    # The block holding the tensor's largest magnitude scales it to exactly 6 (E4M3 448 * 6).
    assert e2m1_values(q.codes).abs().max() == 6
    assert torch.equal(
        dequant_fp4_ref(pack_nibbles(q.codes), q.scales, q.tensor_scale), q.dequantize()
    )
    rel = ((w - q.dequantize()) ** 2).sum() / (w**2).sum()
    assert rel < 0.012  # ≈0.009 on Gaussian weights (research/quant.md §0)


def test_mxfp4_follows_the_rules():
    w = torch.randn(32, 64) * 0.05
    q = quantize_mxfp4(w)
    assert q.scales.dtype == torch.uint8 and q.scales.shape == (32, 2)  # blocks of 32, E8M0
    amax = w.view(32, 2, 32).abs().amax(-1)
    expected = torch.floor(torch.log2(amax)) - 2  # OCP MX: shared exponent minus emax(E2M1) = 2
    assert torch.equal(q.scales.float() - 127, expected)
    scale = torch.from_numpy((q.scales.numpy().view(ml_dtypes.float8_e8m0fnu)).astype(np.float32))
    assert torch.equal(scale, torch.exp2(expected))
    assert torch.equal(dequant_fp4_ref(pack_nibbles(q.codes), q.scales, None), q.dequantize())
    nv = quantize_nvfp4(w).dequantize()
    assert ((w - nv) ** 2).sum() < ((w - q.dequantize()) ** 2).sum()  # NVFP4 is the finer format
