"""Writing a forward's keys and values into the paged KV cache as one op (`moetier::write_pages`)
that declares the cache mutated: torch.compile then updates the cache in place. Written as plain
advanced indexing on a view of the cache, a compiled step copied the whole cache per write
(functionalisation of a mutated view of a graph input): at a 675 MB cache that was ~10 ms a step.
"""

from __future__ import annotations

import torch


@torch.library.custom_op("moetier::write_pages", mutates_args=("cache",))
def write_pages(
    cache: torch.Tensor,
    layer: int,
    part: int,
    page: torch.Tensor,
    offset: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """Store each token's entry of layer `layer`: GQA cache [layers, 2, pages, KVH, PS, D], part
    0 (keys) or 1 (values), values [B, KVH, T, D]; MLA cache [layers, pages, PS, W], part -1,
    values [B, T, W]. page, offset [B, T] int64: where token (b, t) goes."""
    _store(cache, layer, part, page, offset, values)


def _store(
    cache: torch.Tensor,
    layer: int,
    part: int,
    page: torch.Tensor,
    offset: torch.Tensor,
    values: torch.Tensor,
) -> None:
    """`write_pages`'s indexing, shared with `write_kv_pages`'s fallback."""
    if part < 0:
        cache[layer][page, offset] = values
    else:
        cache[layer, part][page, :, offset] = values.transpose(1, 2)


@write_pages.register_fake
def _(
    cache: torch.Tensor,
    layer: int,
    part: int,
    page: torch.Tensor,
    offset: torch.Tensor,
    values: torch.Tensor,
) -> None:
    return None


# One launch for a GQA layer's keys and values on CUDA (`write_kv_pages`) instead of two
# `write_pages` (two advanced-indexing kernels: 16 of a 8-layer step's launches, 54 µs of its
# 0.640 ms on an H100 at one row, bench/serve.py --profile). Its GPU test
# (tests/kernels/test_paged_kv_write.py -m gpu: in a CUDA graph, equal to the two writes)
# passed on an H100 at 5d109f0; the step's time with it is not measured yet.
FUSED_KV_WRITE = True

try:
    import triton
    import triton.language as tl

    # `layer` is not specialized: Triton makes an int argument equal to 1 a constexpr (a Python int,
    # no `.to`), which failed the first compile for layer 1 on the H200 at 5d80edf, and a layer
    # each would compile its own kernel
    @triton.jit(do_not_specialize=["layer"])
    def _write_kv_kernel(
        cache, k, v, page, offset, layer, pages, page_size, tokens,
        skb, skh, skt, svb, svh, svt,
        KVH: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """Program (token b*T+t, head h): k[b, h, t] and v[b, h, t] (D values each) into the
        cache [layers, 2, pages, KVH, page_size, D] at (page, offset) of that token."""
        pid = tl.program_id(0)
        h = tl.program_id(1)
        b = pid // tokens
        t = pid % tokens
        pg = tl.load(page + pid).to(tl.int64)
        off = tl.load(offset + pid).to(tl.int64)
        d = tl.arange(0, BLOCK_D)
        m = d < D
        kv = tl.load(k + b * skb + h * skh + t * skt + d, mask=m)
        vv = tl.load(v + b * svb + h * svh + t * svt + d, mask=m)
        row_k = ((layer.to(tl.int64) * 2 * pages + pg) * KVH + h) * page_size + off
        row_v = row_k + pages * KVH * page_size  # part 1: one part further
        tl.store(cache + row_k * D + d, kv, mask=m)
        tl.store(cache + row_v * D + d, vv, mask=m)

except ImportError:  # pragma: no cover - triton is a dependency on Linux x86_64
    triton = None


def write_kv_pages_triton(
    cache: torch.Tensor,
    layer: int,
    page: torch.Tensor,
    offset: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """`write_kv_pages` by the Triton kernel (also under TRITON_INTERPRET=1 on CPU, for tests)."""
    if triton is None:
        raise RuntimeError("the fused KV write needs triton")
    if not cache.is_contiguous() or k.stride(-1) != 1 or v.stride(-1) != 1:
        raise ValueError("the fused KV write needs a contiguous cache and unit-stride head dims")
    rows, heads, tokens, dim = k.shape
    page, offset = page.contiguous(), offset.contiguous()
    _write_kv_kernel[(rows * tokens, heads)](
        cache, k, v, page, offset, layer, cache.shape[2], cache.shape[4], tokens,
        k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        KVH=heads, D=dim, BLOCK_D=triton.next_power_of_2(dim),
    )  # fmt: skip


@torch.library.custom_op("moetier::write_kv_pages", mutates_args=("cache",))
def write_kv_pages(
    cache: torch.Tensor,
    layer: int,
    page: torch.Tensor,
    offset: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    """A GQA layer's keys and values [B, KVH, T, D] into the cache [layers, 2, pages, KVH, PS,
    D] at page, offset [B, T] (int64): one Triton launch on CUDA where FUSED_KV_WRITE is on, else
    `write_pages` twice."""
    if FUSED_KV_WRITE and cache.is_cuda and triton is not None:
        write_kv_pages_triton(cache, layer, page, offset, k, v)
        return
    _store(cache, layer, 0, page, offset, k)
    _store(cache, layer, 1, page, offset, v)


@write_kv_pages.register_fake
def _(
    cache: torch.Tensor,
    layer: int,
    page: torch.Tensor,
    offset: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
) -> None:
    return None
