"""The paged prefill attention (`moetier::prefill_attention`) against the engine's gathered path
(models/attention_batch.py's packed batch: each sequence's keys gathered from its pages, the kv
heads repeated, SDPA over the batch's mask): packed steps of several sequences over cached
prefixes, pages in any order, awkward head dims and groups, blocks split across sequences; the
twin on CPU, the Triton kernel under the interpreter (fp32; conftest sets TRITON_INTERPRET),
bf16 on the GPU."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.utils import counters

from moetier.kernels.prefill_attention import (
    BLOCK_M,
    page_rows,
    prefill_attention,
    prefill_attention_ref,
    prefill_blocks,
)
from moetier.models.attention_batch import AttentionBatch
from moetier.models.layers import _repeat_kv

pytest.importorskip("triton")
from moetier.kernels.prefill_attention import prefill_attention_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# (heads, kv_heads, head_dim, page_size, [(cached prefix, new tokens)] per sequence)
CASES = [
    (4, 4, 64, 16, [(0, 5)]),  # one short prompt, groups 1
    (8, 2, 64, 4, [(13, 7), (0, 1), (3, 70)]),  # groups 4; a decode row; a block split at 64
    (6, 2, 80, 8, [(40, 3), (0, 33)]),  # head_dim not a power of two
    (16, 4, 128, 16, [(150, BLOCK_M + 9), (7, 2)]),  # a long prefix, more than a key block
]


def make_step(heads, kv_heads, dim, page_size, spans, dtype, device, seed=0):
    """A cache of shuffled pages holding each sequence's prefix and chunk, and the packed step's
    queries -> (q [N, H, D], k_cache, v_cache, the sequences' (start, count, pages))."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    needed = [-(-(start + count) // page_size) + rng.randrange(0, 2) for start, count in spans]
    ids = list(range(sum(needed) + 3))
    rng.shuffle(ids)
    packed = []
    for (start, count), n in zip(spans, needed, strict=True):
        packed.append((start, count, ids[:n]))
        ids = ids[n:]
    total = sum(needed) + 3
    k_cache = torch.randn(total, kv_heads, page_size, dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(total, kv_heads, page_size, dim, generator=gen).to(dtype).to(device)
    tokens = sum(count for _, count in spans)
    q = (torch.randn(tokens, heads, dim, generator=gen) * 2).to(dtype).to(device)
    return q, k_cache, v_cache, packed


def gathered(q, k_cache, v_cache, packed, page_size, scale):
    """The engine's path before the kernel: AttentionBatch.packed's keys and mask, SDPA."""
    batch = AttentionBatch.packed(packed, page_size, q.device)
    groups = q.shape[1] // k_cache.shape[1]
    keys = _repeat_kv(batch.keys(k_cache), groups)  # [1, H, Lk, D]
    values = _repeat_kv(batch.keys(v_cache), groups)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None].float(), keys.float(), values.float(), attn_mask=batch.mask,
        scale=scale,
    )  # fmt: skip
    return out[0].transpose(0, 1)  # [N, H, D]


def tables(packed, page_size, device):
    starts = [start for start, _, _ in packed]
    counts = [count for _, count, _ in packed]
    widths = [-(-(start + count) // page_size) for start, count, _ in packed]
    blocks = torch.from_numpy(prefill_blocks(starts, counts)).to(device)
    pages = torch.from_numpy(page_rows([p for _, _, p in packed], widths)).to(device)
    return pages, blocks


def test_blocks_cover_each_sequence_in_runs_of_block_m():
    blocks = prefill_blocks([10, 0, 3], [2, 130, 1], block_m=64).tolist()
    assert blocks == [[0, 0, 2, 10], [1, 2, 64, 0], [1, 66, 64, 64], [1, 130, 2, 128],
                      [2, 132, 1, 3]]  # fmt: skip
    assert page_rows([[5, 6, 7], [2]], [3, 1]).tolist() == [[5, 6, 7], [2, 0, 0]]
    # never a size of 1 (a compiled step would specialise on it): an empty block, a zero row
    assert prefill_blocks([7], [3]).tolist() == [[0, 0, 3, 7], [0, 0, 0, 0]]
    assert page_rows([[4]], [1]).tolist() == [[4, 0], [0, 0]]


@pytest.mark.parametrize("case", CASES, ids=[str(i) for i in range(len(CASES))])
@pytest.mark.parametrize("path", ["ref", "triton"])
def test_prefill_attention_reads_what_the_gathered_path_reads(case, path):
    heads, kv_heads, dim, page_size, spans = case
    q, k_cache, v_cache, packed = make_step(heads, kv_heads, dim, page_size, spans,
                                            torch.float32, DEVICE)  # fmt: skip
    pages, blocks = tables(packed, page_size, q.device)
    scale = dim**-0.5
    want = gathered(q, k_cache, v_cache, packed, page_size, scale)
    fn = prefill_attention_ref if path == "ref" else prefill_attention_triton
    got = fn(q, k_cache, v_cache, pages, blocks, scale)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)
    # the op: the kernel where it runs (CUDA, the interpreter in fp32), else the twin
    torch.testing.assert_close(prefill_attention(q, k_cache, v_cache, pages, blocks, scale), want,
                               atol=2e-5, rtol=2e-5)  # fmt: skip


def test_strided_queries_and_cache_views():
    """q as the model hands it (a transposed view of [1, H, N, D]) and the caches as a layer's
    views of the whole cache [layers, 2, P, KVH, PS, D]."""
    heads, kv_heads, dim, page_size, spans = CASES[1]
    q, k_cache, v_cache, packed = make_step(heads, kv_heads, dim, page_size, spans,
                                            torch.float32, DEVICE, seed=4)  # fmt: skip
    whole = torch.stack([torch.stack([k_cache, v_cache])] * 2)  # [2 layers, 2, P, KVH, PS, D]
    q_view = q.transpose(0, 1).contiguous().transpose(0, 1)  # [N, H, D], strides (D, N * D, 1)
    pages, blocks = tables(packed, page_size, q.device)
    want = gathered(q, k_cache, v_cache, packed, page_size, 0.1)
    got = prefill_attention_triton(q_view, whole[1, 0], whole[1, 1], pages, blocks, 0.1)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.gpu
def test_bf16_on_the_gpu():
    for i, (heads, kv_heads, dim, page_size, spans) in enumerate(CASES):
        q, k_cache, v_cache, packed = make_step(heads, kv_heads, dim, page_size, spans,
                                                torch.bfloat16, "cuda", seed=i)  # fmt: skip
        pages, blocks = tables(packed, page_size, q.device)
        want = gathered(q, k_cache, v_cache, packed, page_size, dim**-0.5)
        got = prefill_attention_triton(q, k_cache, v_cache, pages, blocks, dim**-0.5)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("compiled", "page"), [(False, 4), (True, 4), (True, 16)])
def test_the_engine_reads_pages_through_the_kernel_as_each_request_alone(
    tiny, compiled, page, monkeypatch
):
    """The engine's packed steps with `paged_prefill` (the tables, no gathered keys or mask;
    on CPU the kernel under the interpreter): chunked prefill with decodes mixed in, staggered
    arrivals, eager and through the compiled prefill, as each request decodes alone."""
    from moetier.config import EngineConfig
    from moetier.engine.engine import Engine, EngineLimits
    from moetier.engine.graph_placement import place_for_graphs
    from moetier.kernels import prefill_attention as kernel
    from moetier.loader.load import load_model
    from tests.engine.test_engine import check_against_alone, random_requests

    loaded = load_model(tiny.store("qwen3_moe"), EngineConfig(device="cpu", dtype="float32",
                                                              native=True))  # fmt: skip
    assert place_for_graphs(loaded)
    engine = Engine(loaded, EngineLimits(num_pages=96, page_size=page, max_num_batched_tokens=16))
    runner = engine.runner
    runner.paged_prefill = True
    if compiled:
        runner.compile_prefill()
        graphs = counters["stats"]["unique_graphs"]
    blocks = []  # each kernel call's block count
    launch = kernel.prefill_attention_triton

    def counted(q, k_cache, v_cache, pages, table, scale):
        blocks.append(table.shape[0])
        return launch(q, k_cache, v_cache, pages, table, scale)

    monkeypatch.setattr(kernel, "prefill_attention_triton", counted)
    check_against_alone(loaded, engine, random_requests(loaded.model_config.vocab_size, 6, 5))
    layers = loaded.model_config.num_layers
    assert blocks and len(blocks) % layers == 0  # every packed step's layers through it
    assert max(blocks) > 1  # steps of several sequences (decodes mixed into prompt chunks)
    if compiled:  # every step on the warm-up's graph: one sequence or several, any width
        assert runner.prefill is not None and runner.prefill.steps > 3
        assert counters["stats"]["unique_graphs"] == graphs


@pytest.mark.gpu
def test_the_engine_on_cuda_reads_pages_through_the_kernel(tiny, monkeypatch):
    """With PAGED_PREFILL_KERNEL on, the CUDA engine (CUDA graphs, compiled prefill) builds
    paged batches and decodes each request as it decodes alone (float32 greedy)."""
    from moetier.config import EngineConfig
    from moetier.engine.engine import Engine, EngineLimits
    from moetier.loader.load import load_model
    from moetier.models import layers
    from tests.engine.test_engine import check_against_alone, random_requests

    monkeypatch.setattr(layers, "PAGED_PREFILL_KERNEL", True)
    config = EngineConfig(device="cuda", dtype="float32", native=True, compile_prefill=True)
    loaded = load_model(tiny.store("qwen3_moe"), config)
    limits = EngineLimits(num_pages=64, page_size=16, max_num_seqs=6, max_num_batched_tokens=16)
    engine = Engine(loaded, limits)
    assert engine.runner.paged_prefill and engine.runner.prefill is not None
    check_against_alone(loaded, engine, random_requests(loaded.model_config.vocab_size, 6, 5))
