"""The fused K/V page write (`moetier::write_kv_pages`): the Triton kernel (Triton's interpreter on
CPU) against two `write_pages` calls, the op's own fallback, on awkward shapes and strided inputs;
on CUDA, in a CUDA graph."""

from __future__ import annotations

import pytest
import torch

from moetier.kernels import paged_kv
from moetier.kernels.paged_kv import write_kv_pages_triton, write_pages


def _case(layers, pages, heads, page_size, dim, rows, tokens, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(rows * 100 + tokens)
    cache = torch.randn(layers, 2, pages, heads, page_size, dim, generator=g).to(device, dtype)
    # distinct (page, offset) for every token, in a shuffled order
    slots = torch.randperm(pages * page_size, generator=g)[: rows * tokens].view(rows, tokens)
    page, offset = (slots // page_size).to(device), (slots % page_size).to(device)
    # k, v as Attention makes them: [B, T, KVH, D] transposed to [B, KVH, T, D] (strided)
    k = torch.randn(rows, tokens, heads, dim, generator=g).to(device, dtype).transpose(1, 2)
    v = torch.randn(rows, tokens, heads, dim, generator=g).to(device, dtype).transpose(1, 2)
    return cache, page, offset, k, v


@pytest.mark.parametrize(
    ("layers", "pages", "heads", "page_size", "dim", "rows", "tokens"),
    [(2, 5, 2, 4, 8, 3, 1), (3, 9, 1, 16, 6, 1, 7), (1, 4, 4, 2, 16, 2, 3)],
)
def test_kernel_writes_what_two_write_pages_calls_write(
    layers, pages, heads, page_size, dim, rows, tokens
):
    cache, page, offset, k, v = _case(layers, pages, heads, page_size, dim, rows, tokens)
    expected = cache.clone()
    layer = layers - 1
    write_pages(expected, layer, 0, page, offset, k)
    write_pages(expected, layer, 1, page, offset, v)
    ours = cache.clone()
    write_kv_pages_triton(ours, layer, page, offset, k, v)
    assert torch.equal(ours, expected)
    assert not torch.equal(ours, cache)  # something was written


def test_op_on_cpu_is_the_two_writes():
    cache, page, offset, k, v = _case(2, 6, 2, 4, 8, 2, 2)
    expected = cache.clone()
    write_pages(expected, 1, 0, page, offset, k)
    write_pages(expected, 1, 1, page, offset, v)
    torch.ops.moetier.write_kv_pages(cache, 1, page, offset, k, v)
    assert torch.equal(cache, expected)


@pytest.mark.gpu
@pytest.mark.parametrize("layer", [0, 1, 2])  # Triton specializes an int argument equal to 1
def test_gpu_kernel_in_a_cuda_graph_equals_the_two_writes(monkeypatch, layer):
    monkeypatch.setattr(paged_kv, "FUSED_KV_WRITE", True)
    cache, page, offset, k, v = _case(4, 64, 4, 16, 128, 8, 1, "cuda", torch.bfloat16)
    expected = cache.clone()
    write_pages(expected, layer, 0, page, offset, k)
    write_pages(expected, layer, 1, page, offset, v)
    torch.ops.moetier.write_kv_pages(cache.clone(), layer, page, offset, k, v)  # compile first
    torch.cuda.synchronize()
    ours = cache.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.moetier.write_kv_pages(ours, layer, page, offset, k, v)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(ours, expected)
