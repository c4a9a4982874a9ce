"""The dense GEMV (kernels/dense_gemv.py) against its torch twin and the formats' definitions:
on CPU through Triton's interpreter, on the GPU (marked `gpu`) at real shapes, in bf16, inside a
CUDA graph, and the prefill path."""

from __future__ import annotations

import pytest
import torch

from moetier.kernels.dense_gemv import (
    GEMV_MAX_ROWS,
    dense_dequant_ref,
    dense_gemv_triton,
    dense_linear,
    dense_linear_ref,
)
from moetier.quant.dense_formats import DenseFormat
from moetier.quant.fp4 import quantize_nvfp4
from moetier.quant.sources import dequant_fp8_block


def _weights(fmt: DenseFormat, n: int, k: int, seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * (torch.rand(n, 1, generator=g) + 0.2)
    parts = fmt.quantize(w)
    weight, scale = parts[0].to(device), parts[1].to(device)
    scale_2 = parts[2].to(device) if len(parts) > 2 else None
    return weight, scale, scale_2


def test_every_e4m3_code_decodes_exactly():
    """A weight holding each finite E4M3 bit pattern once; x one-hot picks columns, so each
    output is one decoded code times its tile scale, compared exactly."""
    codes = torch.tensor([c for c in range(256) if c & 0x7F != 0x7F], dtype=torch.uint8)
    weight = codes.view(2, 127).view(torch.float8_e4m3fn)  # [2, 127]
    scale = torch.tensor([[0.5, 3.0]])  # tiles of 2 x 64
    for col in (0, 5, 63, 64, 126):
        x = torch.zeros(1, 127)
        x[0, col] = 1.0
        out = dense_gemv_triton(x, weight, scale, None, "fp8", 2, 64, block_rows=2)
        expected = weight[:, col].float() * scale[0, col // 64]
        assert torch.equal(out[0], expected), col


@pytest.mark.parametrize("name", ["fp8", "int4-g32", "int4-g128", "nvfp4"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_gemv_matches_the_twin(name, split_k):
    """Rows 1..3, N not a multiple of the row tile, K split over programs; fp32 accumulation
    against the twin's dequantised F.linear."""
    fmt = DenseFormat.parse(name)
    n, k = 72, 384
    weight, scale, scale_2 = _weights(fmt, n, k)
    kind, bn, bk = fmt.kernel_args()
    for rows in (1, 3):
        x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
        ours = dense_gemv_triton(x, weight, scale, scale_2, kind, bn, bk, split_k=split_k)
        ref = dense_linear_ref(x, weight, scale, scale_2, None, kind, bn, bk)
        assert ours.shape == (rows, n)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-4)


def test_fp8_partial_tiles_small_blocks():
    """DeepSeek's layout with tiles that do not divide the matrix (8 x 8 on 20 x 44)."""
    g = torch.Generator().manual_seed(3)
    weight = (torch.randn(20, 44, generator=g) * 50).to(torch.float8_e4m3fn)
    scale = torch.rand(3, 6, generator=g) + 0.1
    assert torch.equal(
        dense_dequant_ref(weight, scale, None, "fp8", 8, 8),
        dequant_fp8_block(weight, scale, (8, 8)),
    )
    x = torch.randn(2, 44, generator=g)
    ours = dense_gemv_triton(x, weight, scale, None, "fp8", 8, 8, block_rows=8)
    ref = x @ dequant_fp8_block(weight, scale, (8, 8)).T
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-4)


def test_twin_decodes_as_the_formats_define():
    w = torch.randn(16, 64, generator=torch.Generator().manual_seed(4))
    codes, scale, scale_2 = DenseFormat.parse("nvfp4").quantize(w)
    twin = dense_dequant_ref(codes, scale, scale_2, "nvfp4", 1, 16)
    assert torch.equal(twin, quantize_nvfp4(w).dequantize())
    codes, scale = DenseFormat.parse("int4-g16").quantize(w)
    by_hand = torch.empty(16, 64)
    by_hand[:, 0::2] = (codes & 15).float() - 8
    by_hand[:, 1::2] = (codes >> 4).float() - 8
    by_hand *= scale.float().repeat_interleave(16, dim=1)
    assert torch.equal(dense_dequant_ref(codes, scale, None, "int4", 1, 16), by_hand)


def test_op_on_cpu_is_the_twin_and_keeps_leading_dims():
    fmt = DenseFormat.parse("int4-g32")
    weight, scale, _ = _weights(fmt, 24, 64)
    x = torch.randn(2, 3, 64)
    bias = torch.randn(24)
    out = dense_linear(x, weight, scale, None, bias, "int4", 1, 32)
    assert out.shape == (2, 3, 24)
    assert torch.equal(out, dense_linear_ref(x, weight, scale, None, bias, "int4", 1, 32))


# ---- on the GPU (the lead runs these on the device) -----------------------------------------

SHAPES = [(5120, 2048), (2048, 4096), (768, 2048), (151936, 2048)]  # Qwen3-30B-A3B qkv, o, ...


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8", "int4", "nvfp4"])
@pytest.mark.parametrize("shape", SHAPES[:3])
def test_gpu_gemv_and_prefill_match_the_twin(name, shape):
    fmt = DenseFormat.parse(name)
    n, k = shape
    weight, scale, scale_2 = _weights(fmt, n, k, device="cuda")
    kind, bn, bk = fmt.kernel_args()
    for rows in (1, 4, GEMV_MAX_ROWS, GEMV_MAX_ROWS + 1, 300):  # GEMV, then the prefill path
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        ours = torch.ops.moetier.dense_linear(x, weight, scale, scale_2, None, kind, bn, bk)
        ref = x.float() @ dense_dequant_ref(weight, scale, scale_2, kind, bn, bk).T
        err = (ours.float() - ref).abs().max() / ref.abs().max()
        assert err < 2e-2, (rows, err.item())


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["fp8", "int4"])
def test_gpu_gemv_replays_in_a_cuda_graph(name):
    fmt = DenseFormat.parse(name)
    weight, scale, scale_2 = _weights(fmt, 5120, 2048, device="cuda")
    kind, bn, bk = fmt.kernel_args()
    x = torch.randn(1, 2048, device="cuda", dtype=torch.bfloat16)
    eager = torch.ops.moetier.dense_linear(x, weight, scale, scale_2, None, kind, bn, bk)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):  # warm-up (Triton compiles) off the capture
        torch.ops.moetier.dense_linear(x, weight, scale, scale_2, None, kind, bn, bk)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = torch.ops.moetier.dense_linear(x, weight, scale, scale_2, None, kind, bn, bk)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.cuda.synchronize()
    expected = torch.ops.moetier.dense_linear(x, weight, scale, scale_2, None, kind, bn, bk)
    assert torch.equal(out, expected)
    assert not torch.equal(out, eager)


def _graph_ms(step, replays: int = 200) -> float:
    """ms per call of `step`, 20 calls captured in one CUDA graph, replayed (CUDA events)."""
    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(20):
            step()
    for _ in range(10):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / replays / 20


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["bf16", "fp8", "int4"])
def test_gpu_gemv_bandwidth(name):
    """Prints GB/s of stored bytes for batch-1 GEMVs at the Qwen3-30B-A3B shapes (the figure
    the lead reports; the assertion only guards against a gross regression)."""
    for n, k in SHAPES:
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        if name == "bf16":
            w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
            nbytes = w.numel() * 2

            def step(w=w, x=x):
                return torch.nn.functional.linear(x, w)
        else:
            fmt = DenseFormat.parse(name)
            weight, scale, scale_2 = _weights(fmt, n, k, device="cuda")
            kind, bn, bk = fmt.kernel_args()
            nbytes = weight.numel() + scale.numel() * scale.element_size()

            def step(x=x, a=(weight, scale, scale_2, None, kind, bn, bk)):
                return torch.ops.moetier.dense_linear(x, *a)

        ms = _graph_ms(step)
        gbps = nbytes / ms / 1e6
        print(f"dense GEMV {name} [{n}, {k}]: {ms * 1e3:.1f} us, {gbps:.0f} GB/s")
        if n * k >= 2**28:  # the head: large enough that launch latency does not count
            assert gbps > 500
