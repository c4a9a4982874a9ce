"""The 2-bit baselines (int2, affine2) and the per-matrix codec layouts: names, bits per weight,
pack/unpack, and that the reference decode of a written blob is the quantiser's output."""

from __future__ import annotations

import pytest
import torch

from moetier.core.layout import (
    MatrixCodec,
    blob_view,
    coded_expert_format,
    format_kind,
    matrix_codecs,
    raw_expert_format,
)
from moetier.kernels.moe_ref import expert_matrix
from moetier.quant.baselines import quantize_affine2, quantize_int2
from moetier.quant.q2s import pack_codes, unpack_codes
from moetier.quant.requantize import _encode, _put


def weights(n: int = 48, k: int = 256, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02


def rel_mse(w: torch.Tensor, w_hat: torch.Tensor) -> float:
    return float(((w - w_hat) ** 2).sum() / (w**2).sum())


def test_int2_grid_and_scale():
    w = weights()
    q = quantize_int2(w, 32)
    assert q.codes.max() <= 3 and q.scales.dtype == torch.float16 and q.scales.shape == (48, 8)
    groups = w.view(48, 8, 32)
    assert torch.equal(q.scales, (groups.abs().amax(-1) / 2).half())
    values = q.codes.float() - 2  # {-2, -1, 0, 1}
    scale = q.scales.float().repeat_interleave(32, dim=1)
    assert torch.equal(values, (w / scale).round().clamp(-2, 1))
    assert torch.equal(q.dequantize(), values * scale)
    # Gaussian weights: about research/quant.md's synthetic 0.153 for naive int2 g32.
    assert 0.13 < rel_mse(w, q.dequantize()) < 0.18


def test_affine2_decode_and_refinement():
    w = weights(seed=1)
    q = quantize_affine2(w, 64)
    assert q.codes.max() <= 3 and q.zeros.dtype == q.scales.dtype == torch.float16
    scale = q.scales.float().repeat_interleave(64, dim=1)
    zero = q.zeros.float().repeat_interleave(64, dim=1)
    assert torch.equal(q.dequantize(), (q.codes.float() - zero) * scale)
    # Codes are the nearest for the stored scale and zero.
    assert torch.equal(q.codes.float(), (w / scale + zero).round().clamp(0, 3))
    plain = quantize_affine2(w, 64, iters=0)  # min-max zero, no HQQ steps
    assert rel_mse(w, q.dequantize()) < rel_mse(w, plain.dequantize())


def test_constant_groups():
    w = torch.zeros(4, 64)
    w[1] = 0.5
    assert torch.equal(quantize_affine2(w, 32).dequantize(), w)
    # int2's top level is +absmax/2: a positive constant clips to half (the lopsided grid).
    assert torch.equal(quantize_int2(w, 32).dequantize(), w / 2)


@pytest.mark.parametrize(
    ("name", "bpw"),
    [
        ("int2-g32", 2.5),
        ("affine2-g64", 2.5),
        ("affine2-g32", 3.0),
        ("q2s-g16", 2 + 8 / 16 + 32 / 512 + 64 / (256 * 512)),
        ("nvfp4", 4.5 + 32 / (256 * 512)),
        ("mxfp4", 4.25),
    ],
)
def test_codec_bits_per_weight(name, bpw):
    codec = MatrixCodec.parse(name)
    assert codec.name == name
    assert codec.bits_per_weight(256, 512) == pytest.approx(bpw)


@pytest.mark.parametrize(
    ("gate_up", "down", "has_bias", "name"),
    [
        ("q2s-g32", "q2s-g16", False, "q2s-g32-down-g16"),  # the name stores have always had
        ("q2s-g16", "q2s-g16", False, "q2s-g16-down-g16"),
        ("nvfp4", "nvfp4", False, "nvfp4"),
        ("int2-g32", "int2-g32", True, "int2-g32+bias"),
        ("affine2-g64", "affine2-g32", False, "affine2-g64-down-g32"),
        ("q2s-g32", "nvfp4", False, "q2s-g32-down-nvfp4"),
        ("nvfp4", "int2-g16", False, "nvfp4-down-int2-g16"),
    ],
)
def test_format_names_round_trip(gate_up, down, has_bias, name):
    codecs = {"gate_up": MatrixCodec.parse(gate_up), "down": MatrixCodec.parse(down)}
    fmt = coded_expert_format(codecs["gate_up"], codecs["down"], 64, 32, has_bias)
    assert fmt.name == name
    assert matrix_codecs(fmt) == codecs
    kinds = {c.kind for c in codecs.values()}
    assert format_kind(fmt) == (kinds.pop() if len(kinds) == 1 else "mixed")


def test_unquantized_and_bad_names():
    assert matrix_codecs(raw_expert_format("bfloat16", 64, 32, False)) is None
    for bad in ("int3-g32", "q2s-g", "q2s-g30", "nvfp4-g32", "fp4"):
        with pytest.raises(ValueError, match="q2s-gN, int2-gN|multiple of 4|blocks of 16"):
            MatrixCodec.parse(bad)


def test_pack_unpack_round_trip():
    codes = torch.randint(0, 4, (5, 128), dtype=torch.uint8)
    assert torch.equal(unpack_codes(pack_codes(codes)), codes)


@pytest.mark.parametrize(
    ("gate_up", "down"),
    [("int2-g32", "int2-g32"), ("affine2-g64", "affine2-g32"), ("affine2-g32", "q2s-g16")],
)
def test_reference_decode_of_a_written_blob(gate_up, down):
    """Bytes written through the layout decode (moe_ref.expert_matrix) to the quantiser output."""
    hidden, inter = 128, 64
    codecs = {"gate_up": MatrixCodec.parse(gate_up), "down": MatrixCodec.parse(down)}
    fmt = coded_expert_format(codecs["gate_up"], codecs["down"], hidden, inter, False)
    mats = {"gate_up": weights(2 * inter, hidden, 2), "down": weights(hidden, inter, 3)}
    blob = torch.zeros(fmt.nbytes, dtype=torch.uint8)
    for name, w in mats.items():
        for part, value in _encode(codecs[name], w, None).items():
            _put(blob, fmt.tensor(f"{name}.{part}"), value)
    for name, w in mats.items():
        codec = codecs[name]
        if codec.kind == "int2":
            want = quantize_int2(w, codec.group).dequantize()
        elif codec.kind == "affine2":
            want = quantize_affine2(w, codec.group).dequantize()
        else:
            from moetier.quant.q2s import quantize_q2s

            want = quantize_q2s(w, None, group=codec.group).dequantize()
        assert torch.equal(expert_matrix(blob, fmt, name), want)
        codes = blob_view(blob, fmt.tensor(f"{name}.codes"))
        assert codes.shape == (w.shape[0], w.shape[1] // 4)
