"""q2s: packing, the decode rule, and that calibration-aware rounding beats round-to-nearest."""

from __future__ import annotations

import pytest
import torch

from moetier.quant.q2s import pack_codes, quantize_q2s, unpack_codes


def data(seed: int = 0, n: int = 64, k: int = 256, tokens: int = 2048):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.02
    # Correlated, anisotropic inputs, as real layer inputs are.
    x = torch.randn(tokens, k, generator=g) @ (
        torch.eye(k) + 0.3 * torch.randn(k, k, generator=g) / k**0.5
    )
    x = x * (0.2 + 3 * torch.rand(k, generator=g))
    return w, x


def output_error(w: torch.Tensor, w_hat: torch.Tensor, x: torch.Tensor) -> float:
    return float(((x @ (w - w_hat).T) ** 2).sum() / ((x @ w.T) ** 2).sum())


def test_pack_layout_is_16_codes_per_little_endian_word():
    codes = torch.randint(0, 4, (3, 64), dtype=torch.uint8)
    packed = pack_codes(codes)
    assert packed.shape == (3, 16)
    assert torch.equal(unpack_codes(packed), codes)
    word = int.from_bytes(packed[1, :4].numpy().tobytes(), "little")
    assert [(word >> (2 * j)) & 3 for j in range(16)] == codes[1, :16].tolist()


def test_decode_rule_and_stored_scales():
    w, _ = data()
    q = quantize_q2s(w, None, group=32)
    assert q.scales.dtype == torch.float8_e4m3fn and q.scales.shape == (64, 8)
    levels = torch.tensor([-1.5, -0.5, 0.5, 1.5])
    manual = torch.empty_like(w)
    for n in range(w.shape[0]):
        for kk in range(w.shape[1]):
            manual[n, kk] = (
                q.row_scale[n] * float(q.scales[n, kk // 32]) * levels[int(q.codes[n, kk])]
            )
    assert torch.allclose(q.dequantize(), manual, rtol=1e-6, atol=0)
    assert q.bits_per_weight == pytest.approx(2 + 8 / 32 + 32 / 256 + 64 / (64 * 256))


def test_round_to_nearest_picks_the_nearest_level():
    w, _ = data(1)
    q = quantize_q2s(w, None)
    scale = q.row_scale[:, None] * q.scales.float().repeat_interleave(32, dim=1)
    candidates = scale[..., None] * torch.tensor([-1.5, -0.5, 0.5, 1.5])  # [N, K, 4]
    best = (w[..., None] - candidates).abs().argmin(-1)
    chosen_err = (w - q.dequantize()).abs()
    best_err = (w[..., None] - candidates).abs().gather(-1, best[..., None]).squeeze(-1)
    assert torch.allclose(chosen_err, best_err, atol=1e-9)
    # The sign-symmetric grid with a searched scale beats naive int2 {-2,-1,0,1}*absmax/2 (g32).
    g = w.view(w.shape[0], -1, 32)
    s = g.abs().amax(-1, keepdim=True) / 2
    naive = ((g / s).round().clamp(-2, 1) * s).view_as(w)
    assert ((w - q.dequantize()) ** 2).sum() < 0.85 * ((w - naive) ** 2).sum()


@pytest.mark.parametrize("act_order", [False, True])
def test_hessian_rounding_beats_round_to_nearest(act_order):
    w, x = data(2)
    rtn = output_error(w, quantize_q2s(w, None).dequantize(), x)
    gptq = output_error(w, quantize_q2s(w, x.T @ x, act_order=act_order).dequantize(), x)
    print(f"output error: rtn {rtn:.4f}, gptq(act_order={act_order}) {gptq:.4f}")
    assert gptq < 0.9 * rtn


def test_scale_refit_never_hurts():
    w, x = data(3)
    h = x.T @ x
    plain = output_error(w, quantize_q2s(w, h, refit_scales=False).dequantize(), x)
    refit = output_error(w, quantize_q2s(w, h, refit_scales=True).dequantize(), x)
    assert refit <= plain + 1e-12


def test_rejects_bad_shapes():
    with pytest.raises(ValueError, match="divisible by 32"):
        quantize_q2s(torch.randn(4, 40))
